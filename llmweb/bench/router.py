"""`bench router`: llama.cpp replicas behind vLLM's router (`vllm-router`), each routing policy,
against one llama-server holding the same number of slots.

For 1, 2 and 3 replicas (the embedded GGUF file, `--threads` each, `--slots` slots each) and each
policy (`consistent_hash` on the session key llmweb sends, `cache_aware`, `round_robin`), N chats
run M turns each, all at once, through llmweb's chat path with LLMWEB_ENGINE_URL at the router
and LLMWEB_ENGINE_ROUTER=1. Beside each replica count: one llama-server with replicas x slots
slots, llmweb at it directly (its slots pinned per chat). Per case: the share of the prompt served
from the engines' caches on turns 2+ (llama-server's `timings.cache_n`, what the chat's stats
report as reused), aggregate tok/s (generated tokens over the wall time), p95 TTFT, turns answered.

On one machine the replicas share its cores: the figures show each policy's cache behaviour and
the router's overhead, not a speed-up. `replicas` and `router` (processes started and stopped
here) are also the slow test's (tests/engine/test_router_replicas.py).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from llmweb.config import Settings
from llmweb.errors import ConfigError, LlmwebError

from .common import TOPICS, llama_tool, scratch_settings
from .served import free_port, http_status, stop, wait_for

POLICIES = ("consistent_hash", "cache_aware", "round_robin")
SLOT_CONTEXT = 2048  # each llama-server slot's context, and LLMWEB_CONTEXT_LIMIT
REPLICA_START_S = 120.0
HEALTH_S = 2  # the router's health checks: a dead replica is out within a few seconds


def router_exe() -> str | None:
    """vLLM's router: LLMWEB_VLLM_ROUTER, else beside this Python (pip's script), else the PATH."""
    beside = Path(sys.executable).parent / "vllm-router"
    return os.environ.get("LLMWEB_VLLM_ROUTER") or (str(beside) if beside.is_file() else shutil.which("vllm-router"))


@dataclass
class Replica:
    proc: subprocess.Popen
    url: str


@contextlib.contextmanager
def replicas(
    n: int, slots: int, threads: int = 1, progress: Callable[[str], None] = print, exe: str | None = None
) -> Iterator[list[Replica]]:
    """`n` llama-servers on the embedded GGUF file, `slots` slots of SLOT_CONTEXT each, set as our
    runner runs on a CPU; yields them once each /health answers, stops them after."""
    from llmweb.engine import models

    exe = exe or llama_tool("llama-server")
    if not exe:
        raise ConfigError("bench router needs llama-server: put it on the PATH or name it in LLMWEB_LLAMA_SERVER")
    folder, name = models.embedded_gguf()
    started: list[Replica] = []
    try:
        for _ in range(n):
            port = free_port()
            args = [exe, "-m", str(folder / name), "-np", str(slots), "-c", str(slots * SLOT_CONTEXT)]
            args += ["-t", str(threads), "-tb", str(threads), "-fa", "off", "--cache-ram", "0"]
            progress(f"bench router: llama-server -np {slots} -t {threads} on port {port}…")
            proc = subprocess.Popen(
                [*args, "--host", "127.0.0.1", "--port", str(port)],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            started.append(Replica(proc, f"http://127.0.0.1:{port}"))
        for r in started:
            health = r.url + "/health"
            wait_for(lambda: http_status(health) == 200, REPLICA_START_S, "llama-server", r.proc)  # noqa: B023
        yield started
    finally:
        for r in started:
            if r.proc.poll() is None:
                stop(r.proc)


@contextlib.contextmanager
def router(workers: Sequence[str], policy: str, log: Path | None = None, exe: str | None = None) -> Iterator[str]:
    """vLLM's router in front of `workers` with `policy`; yields its URL once every worker is ready.
    Health checks every HEALTH_S s; its log to `log` (else nowhere)."""
    exe = exe or router_exe()
    if not exe:
        raise ConfigError("bench router needs vllm-router (pip install vllm-router, or LLMWEB_VLLM_ROUTER)")
    port = free_port()
    args = [exe, "--host", "127.0.0.1", "--port", str(port), "--policy", policy, "--worker-urls", *workers]
    args += ["--health-check-interval-secs", str(HEALTH_S), "--health-failure-threshold", "1"]
    args += ["--prometheus-port", str(free_port())]  # its default, 29000, would clash with a second router
    out = open(log, "ab") if log else subprocess.DEVNULL  # noqa: SIM115  (closed below)
    proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_for(lambda: http_status(url + "/readiness") == 200, REPLICA_START_S, "vllm-router", proc)
        except LlmwebError as e:
            said = log.read_text(errors="replace")[-800:] if log else ""
            raise LlmwebError(f"{e}{': ' + said if said else ''}") from None
        yield url
    finally:
        stop(proc)
        if log:
            out.close()  # type: ignore[union-attr]


def chat_turns(chat: int, turns: int) -> list[str]:
    """Chat `chat`'s user messages: its own topics, so no two chats share more than the template."""
    return [
        f"Chat {chat + 1}, question {i + 1}: in two sentences, explain {TOPICS[(chat * 7 + i) % len(TOPICS)]}."
        for i in range(turns)
    ]


def run_chats(settings: Settings, chats: int, turns: int, progress: Callable[[str], None] = print) -> dict:
    """`chats` chats of `turns` turns at once through llmweb's chat path at `settings.engine_url`;
    per turn (chat, turn, prompt, reused, generated, ttft_s, error) and the wall time."""
    from llmweb.runtime import Runtime

    rt = Runtime(settings).start(background=False)
    rows: list[dict] = []
    lock = threading.Lock()

    def one(c: int) -> None:
        conv = None
        for t, text in enumerate(chat_turns(c, turns)):
            row = {"chat": c, "turn": t + 1, "prompt": 0, "reused": 0, "generated": 0, "ttft_s": 0.0, "error": ""}
            try:
                ev = rt.wait_ready().ask(f"router-bench-{c}", conv, text)
                conv, g = ev.conv_id, ev.stats.gen
                row |= {"prompt": g.prompt_tokens, "reused": g.reused_tokens, "generated": g.generated_tokens}
                row |= {"ttft_s": g.ttft_s, "conv": conv}
            except Exception as e:  # a failed turn is counted, and the chat goes on
                row["error"] = f"{type(e).__name__}: {e}"
            with lock:
                rows.append(row)

    try:
        rt.wait_ready()
        t0 = time.perf_counter()
        threads = [threading.Thread(target=one, args=(c,), daemon=True) for c in range(chats)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        wall = time.perf_counter() - t0
    finally:
        rt.close()
    return {"rows": rows, "wall_s": wall}


def summarize(rows: list[dict], wall_s: float) -> dict:
    later = [r for r in rows if r["turn"] > 1 and not r["error"]]
    ttfts = sorted(r["ttft_s"] for r in rows if not r["error"])
    prompt = sum(r["prompt"] for r in later)
    return {
        "answered": sum(1 for r in rows if not r["error"]),
        "turns": len(rows),
        "reuse_later": round(sum(r["reused"] for r in later) / prompt, 3) if prompt else None,
        "tok_s": round(sum(r["generated"] for r in rows) / wall_s, 1) if wall_s else 0.0,
        "ttft_p95_s": round(ttfts[max(0, int(0.95 * len(ttfts) + 0.5) - 1)], 3) if ttfts else None,
        "ttft_p50_s": round(statistics.median(ttfts), 3) if ttfts else None,
        "wall_s": round(wall_s, 2),
        "errors": sorted({r["error"][:200] for r in rows if r["error"]})[:3],  # why turns went unanswered
    }


def run(
    settings: Settings,
    counts: Sequence[int] = (1, 2, 3),
    policies: Sequence[str] = POLICIES,
    chats: int = 8,
    turns: int = 10,
    slots: int = 2,
    threads: int = 1,
    new_tokens: int = 32,
    progress: Callable[[str], None] = print,
) -> dict:
    if settings.model or settings.engine_url:
        raise ConfigError("bench router serves the embedded GGUF file: unset LLMWEB_MODEL and LLMWEB_ENGINE_URL")
    bad = [p for p in policies if p not in POLICIES]
    if bad or not policies or min(counts, default=0) < 1 or min(chats, turns, slots, threads, new_tokens) < 1:
        raise ConfigError(f"--policies from {', '.join(POLICIES)}; --replicas, --chats, --turns, --slots at least 1")
    if not router_exe():
        raise ConfigError("bench router needs vllm-router (pip install vllm-router, or LLMWEB_VLLM_ROUTER)")
    cases: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="llmweb-router-") as tmp:
        base = scratch_settings(settings, tmp).replace(
            context_limit=SLOT_CONTEXT, max_new_tokens=new_tokens, temperature=0.0, queue_per_user=2
        )
        for n in counts:
            setup = {"replicas": n, "slots": slots}
            for policy in ("one llama-server", *policies):
                progress(f"bench router: {n} replica(s) x {slots} slots, {policy}, {chats} chats x {turns} turns…")
                data = Path(tmp) / f"{n}-{policy.replace(' ', '-')}"
                if policy == "one llama-server":
                    with replicas(1, n * slots, threads * n, progress) as one:
                        s = base.replace(data_dir=data, engine_url=one[0].url, engine_concurrency=n * slots)
                        got = run_chats(s, chats, turns, progress)
                else:
                    with replicas(n, slots, threads, progress) as fleet:
                        with router([r.url for r in fleet], policy, Path(tmp) / f"router-{n}-{policy}.log") as url:
                            s = base.replace(
                                data_dir=data, engine_url=url, engine_router=True, engine_concurrency=n * slots
                            )
                            got = run_chats(s, chats, turns, progress)
                cases.append({**setup, "policy": policy, **summarize(got["rows"], got["wall_s"])})
                progress(f"bench router: {cases[-1]}")
    return {
        "bench": "router",
        "chats": chats,
        "turns": turns,
        "slots_per_replica": slots,
        "threads_per_replica": threads,
        "new_tokens": new_tokens,
        "load_average": list(os.getloadavg()),
        "cases": cases,
    }


def markdown(r: dict) -> str:
    lines = [
        f"{r['chats']} chats x {r['turns']} turns at once, {r['new_tokens']} new tokens per reply; each replica "
        f"{r['slots_per_replica']} slots, {r['threads_per_replica']} thread(s); one llama-server: the same slots "
        f"and threads in one process. Load average at the end: {', '.join(f'{x:.2f}' for x in r['load_average'])}.",
        "",
        "| replicas | routing | answered | reuse, turns 2+ | tok/s | TTFT p50 (s) | TTFT p95 (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in r["cases"]:
        reuse = "-" if c["reuse_later"] is None else f"{c['reuse_later']:.2f}"
        lines.append(
            f"| {c['replicas']} | {c['policy']} | {c['answered']}/{c['turns']} | {reuse} | {c['tok_s']:.1f} | "
            f"{c['ttft_p50_s']} | {c['ttft_p95_s']} |"
        )
    for c in r["cases"]:
        for error in c.get("errors", []):
            lines.append(f"\nUnanswered ({c['replicas']}, {c['policy']}): {error}")
    return "\n".join(lines)
