"""`bench peer`: k chats at once through llmweb's API against llama.cpp's own `llama-server -np k`,
on the same GGUF file, prompts, reply length and threads, side by side in one run.

`python -m llmweb bench peer [--chats 1,4] [--max-new-tokens 128] [--repeats 3] [--json]`

Both are real servers on this machine: `python -m llmweb serve` at the defaults over a scratch
data dir, and `llama-server` (LLMWEB_LLAMA_SERVER, or the PATH; built from the pinned sdist as
.ci/run builds it) serving the embedded GGUF file with k slots, the same threads as ours, flash
attention off and no host prompt cache (as our runner on a CPU; tests/engine/test_llama_server.py
starts it the same way). For each k, one round sends k different requests at once (temperature 0,
`max_tokens` the reply length, no streaming) to one server, then the same k to the other; the order
alternates by repeat, so the machine's drift hits both alike, and each repeat asks new questions,
so neither answers from a cache of the last round's. Per (k, server):
  aggregate tok/s  the generated tokens (each response's `usage`) / the wall time from the first
                   request sent to the last response read
and ours against llama-server's at the same k (the median over repeats of each server's figure).

The k requests come through the one local key, so the server's waiting-room cap per owner is
raised to k for the run (LLMWEB_QUEUE_PER_USER): without it, a third request of one owner is
refused as busy; it sets nothing about speed. The served model must be the embedded file (no
LLMWEB_MODEL or LLMWEB_ENGINE_URL): else the command says so and stops. llama-server serves the
file llmweb serves: by default its Q8_0 copy (LLMWEB_GGUF_REQUANT, engine/models.py `served_gguf`).

Must not: be imported by the product; leave either server running when it ends.
"""

from __future__ import annotations

import contextlib
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from llmweb.config import Settings
from llmweb.errors import ConfigError

from .common import TOPICS, llama_tool
from .served import START_S, free_port, http_status, post_json, serve, stop, wait_for

SERVERS = ("llmweb", "llama-server")
PAUSE_S = 1.0  # before each round: ggml's kept thread pool (llama-server's) polls for work after a request
SLOT_CONTEXT = 1024  # llama-server's context per slot: a prompt of ~60 tokens and the reply


def questions(k: int, repeat: int) -> list[str]:
    """k requests for this repeat, each its own topic (none repeats within a run of few repeats)."""
    return [
        f"Write a long, detailed story about {TOPICS[(repeat * k + i) % len(TOPICS)]}, with characters and dialogue."
        for i in range(k)
    ]


def run(
    settings: Settings,
    concurrencies: Sequence[int] = (1, 4),
    new_tokens: int = 128,
    repeats: int = 3,
    progress: Callable[[str], None] = print,
) -> dict:
    from llmweb.engine import gguf, models

    if settings.model or settings.engine_url:
        raise ConfigError("bench peer compares the embedded GGUF file: unset LLMWEB_MODEL and LLMWEB_ENGINE_URL")
    exe = llama_tool("llama-server")
    if not exe:
        raise ConfigError("bench peer needs llama-server: put it on the PATH or name it in LLMWEB_LLAMA_SERVER")
    concurrencies = sorted(set(concurrencies))
    if not concurrencies or min(concurrencies) < 1 or repeats < 1 or new_tokens < 1:
        raise ConfigError("--chats needs positive integers, --repeats and --max-new-tokens at least 1")
    served, _, _ = models.served_gguf(settings, progress)  # the file the server below loads too
    threads = settings.threads or gguf.default_threads()
    rows: list[dict] = []
    env = {"LLMWEB_QUEUE_PER_USER": str(max(concurrencies))}
    with tempfile.TemporaryDirectory(prefix="llmweb-peer-") as tmp, serve(Path(tmp), new_tokens, progress, env) as srv:
        ours = srv.url + "v1/chat/completions"
        headers = {"Authorization": f"Bearer {srv.key}"}
        srv.api_turn("Say hello.", 8)  # warm-up: the model is loaded and has run once
        for k in concurrencies:
            with llama_server(exe, served, k, threads, progress) as peer:
                post_json(peer, chat_body("Say hello.", 8), {})
                for r in range(repeats):
                    asks = questions(k, r)
                    for which in SERVERS if r % 2 == 0 else SERVERS[::-1]:
                        time.sleep(PAUSE_S)  # the other's threads stop polling for work first
                        progress(f"bench peer: {k} chat(s) at once, repeat {r + 1}/{repeats}, {which}…")
                        url, hdrs = (ours, headers) if which == "llmweb" else (peer, {})
                        rows.append(
                            {"concurrency": k, "server": which, "repeat": r + 1, **at_once(url, hdrs, asks, new_tokens)}
                        )
    return {
        "bench": "peer",
        "model_file": served.name,
        "threads": threads,
        "new_tokens": new_tokens,
        "repeats": repeats,
        "rows": rows,
        "summary": summarize(rows),
    }


def chat_body(message: str, new_tokens: int) -> dict:
    return {
        "model": "llmweb",
        "messages": [{"role": "user", "content": message}],
        "max_tokens": new_tokens,
        "temperature": 0.0,
    }


def at_once(url: str, headers: dict[str, str], asks: list[str], new_tokens: int) -> dict:
    """Send every ask at once; the generated tokens and the wall time of them all."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(asks)) as pool:
        answers = list(pool.map(lambda m: post_json(url, chat_body(m, new_tokens), headers), asks))
    wall = time.perf_counter() - t0
    tokens = [int(a["usage"]["completion_tokens"]) for a in answers]
    prompts = [int(a["usage"]["prompt_tokens"]) for a in answers]
    return {
        "generated_tokens": sum(tokens),
        "shortest_reply": min(tokens),
        "prompt_tokens": round(statistics.mean(prompts)),
        "wall_s": round(wall, 3),
        "aggregate_tok_s": round(sum(tokens) / max(wall, 1e-9), 2),
    }


def summarize(rows: list[dict]) -> list[dict]:
    """Per k: each server's median aggregate tok/s and ours against llama-server's."""
    out = []
    for k in sorted({r["concurrency"] for r in rows}):
        med = {
            s: statistics.median(r["aggregate_tok_s"] for r in rows if r["concurrency"] == k and r["server"] == s)
            for s in SERVERS
        }
        out.append(
            {
                "concurrency": k,
                "llmweb_tok_s": round(med["llmweb"], 1),
                "llama_server_tok_s": round(med["llama-server"], 1),
                "ours_vs_peer": round(med["llmweb"] / max(med["llama-server"], 1e-9), 2),
            }
        )
    return out


def markdown(r: dict) -> str:
    lines = [
        f"`bench peer`: {r['model_file']}, {r['threads']} threads, {r['new_tokens']} new tokens a reply, "
        f"{r['repeats']} repeats; aggregate tok/s (medians).",
        "",
        "| chats at once | llmweb API | llama-server -np k | llmweb / llama-server |",
        "|---:|---:|---:|---:|",
    ]
    for s in r["summary"]:
        lines.append(
            f"| {s['concurrency']} | {s['llmweb_tok_s']:.1f} | {s['llama_server_tok_s']:.1f} | "
            f"{s['ours_vs_peer']:.2f} |"
        )
    lines += [
        "",
        "| k | server | repeat | tokens | shortest | prompt | wall s | tok/s |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for x in r["rows"]:
        lines.append(
            f"| {x['concurrency']} | {x['server']} | {x['repeat']} | {x['generated_tokens']} | {x['shortest_reply']} | "
            f"{x['prompt_tokens']} | {x['wall_s']:.2f} | {x['aggregate_tok_s']:.1f} |"
        )
    return "\n".join(lines)


@contextlib.contextmanager
def llama_server(exe: str, model: Path, slots: int, threads: int, progress: Callable[[str], None]) -> Iterator[str]:
    """llama-server with `slots` slots on `model`, set as our runner runs on a CPU; yields its
    chat-completions URL once /health answers, stops it after."""
    from llmweb.engine.runners.llama_cpp import PREFILL_CHUNK

    port, chunk = free_port(), str(PREFILL_CHUNK)
    args = [exe, "-m", str(model), "-np", str(slots), "-c", str(slots * SLOT_CONTEXT), "-t", str(threads)]
    args += ["-tb", str(threads), "-b", chunk, "-ub", chunk, "-fa", "off", "--cache-ram", "0"]
    progress(f"bench peer: starting llama-server -np {slots} on port {port}…")
    proc = subprocess.Popen(
        [*args, "--host", "127.0.0.1", "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        wait_for(lambda: http_status(f"http://127.0.0.1:{port}/health") == 200, START_S, "llama-server", proc)
        yield f"http://127.0.0.1:{port}/v1/chat/completions"
    finally:
        stop(proc)
