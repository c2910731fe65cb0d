"""`bench chatpath`: the chat path's decode against llama.cpp's `llama-bench` at each turn's prompt
depth, side by side in one run.

`python -m llmweb bench chatpath [--repeats 3] [--max-new-tokens 128] [--json]`

Ours is the whole chat path, as `python -m llmweb replay` runs it (`Chat.ask`): a Runtime at the defaults (the
bundled guide retrieved from, the loop guard, summaries, the engine process, the thread
governor) over a scratch data dir, and SCRIPT's four messages in a new chat; each turn's decode
tok/s is its own stats'. The reference is `llama-bench -p 0 -n M -d N` on the same GGUF file and
threads, at N = each turn's prompt tokens (every depth any run of ours had). Each repeat runs
both, the order alternating, so the machine's drift hits both alike; per turn, the medians and
ours against llama-bench's.

The served model must be the embedded file (as `bench peer`'s); llama-bench runs the file served
(by default its Q8_0 copy: LLMWEB_GGUF_REQUANT) and comes from
LLMWEB_LLAMA_BENCH or the PATH (built from the pinned sdist: .ci/run). Without either, the command
says so and stops.

Must not: be imported by the product; write outside its scratch dir.
"""

from __future__ import annotations

import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path

from llmweb.errors import ConfigError

SCRIPT = (
    "Write a poem about the sea.",
    "Now write one about the mountains, longer.",
    "Tell me a story about a lighthouse keeper.",
    "Write a poem about the sea.",
)


def run(settings, new_tokens: int = 128, repeats: int = 3, progress: Callable[[str], None] = print) -> dict:
    from llmweb.engine import gguf, models
    from llmweb.runtime import Runtime

    from .common import llama_tool
    from .decode import llama_bench

    if settings.model or settings.engine_url:
        raise ConfigError("bench chatpath compares the embedded GGUF file: unset LLMWEB_MODEL and LLMWEB_ENGINE_URL")
    if not llama_tool("llama-bench"):
        raise ConfigError("bench chatpath needs llama.cpp's llama-bench: set LLMWEB_LLAMA_BENCH or put it on the PATH")
    gguf_file, _, _ = models.served_gguf(settings, progress)  # what the chat path below serves
    threads = settings.threads or gguf.default_threads()
    ours: list[list[dict]] = []
    theirs: list[dict[int, float]] = []
    with tempfile.TemporaryDirectory(prefix="llmweb-chatpath-") as tmp:
        runtime = Runtime(settings.replace(data_dir=Path(tmp), max_new_tokens=new_tokens)).start(background=False)
        try:
            progress(f"bench chatpath: a warm-up run of the {len(SCRIPT)} turns (it gives their depths)…")
            chat = runtime.wait_ready()
            depths = {t["prompt_tokens"] for t in _script(chat)}
            for r in range(repeats):
                for side in ("ours", "llama-bench") if r % 2 == 0 else ("llama-bench", "ours"):
                    if side == "ours":
                        progress(f"bench chatpath: repeat {r + 1}/{repeats}, the {len(SCRIPT)} turns…")
                        ours.append(_script(chat))
                        depths |= {t["prompt_tokens"] for t in ours[-1]}  # a reply may differ by a few tokens
                    else:
                        ran = llama_bench(gguf_file, sorted(depths), new_tokens, threads, 1, progress, "chatpath")
                        theirs.append(_reference(ran))
        finally:
            runtime.close()
    return {
        "bench": "chatpath",
        "new_tokens": new_tokens,
        "repeats": repeats,
        "threads": threads,
        "rows": summarize(ours, theirs),
    }


def _script(chat) -> list[dict]:
    """SCRIPT in a new chat of the local user, as `replay` sends it (its folds waited for after
    each turn); each turn's prompt tokens and decode tok/s. The chat stays, as replay's does (the
    scratch dir goes at the end)."""
    from llmweb.records import LOCAL_OWNER as LOCAL

    conv, out = None, []
    for text in SCRIPT:
        ev = chat.ask(LOCAL, conv, text, wait_summary=True)
        conv, g = ev.conv_id, ev.stats.gen
        out.append({"prompt_tokens": int(g.prompt_tokens), "decode_tok_s": float(g.decode_tok_s)})
    return out


def _reference(rows: list[dict] | None) -> dict[int, float]:
    if rows is None:
        raise ConfigError("bench chatpath: llama-bench failed (its error is above)")
    return {r["prompt"]: r["decode_tok_s"] for r in rows if "decode_tok_s" in r}


def summarize(ours: list[list[dict]], theirs: list[dict[int, float]]) -> list[dict]:
    """Per turn of SCRIPT: its prompt tokens (the most common over the repeats: a greedy reply may
    still differ by a few tokens), the medians of our decode and of llama-bench's at that depth,
    and their ratio."""
    rows = []
    for i in range(len(ours[0]) if ours else 0):
        depth = statistics.mode(run[i]["prompt_tokens"] for run in ours if len(run) > i)
        mine = [run[i]["decode_tok_s"] for run in ours if len(run) > i]
        ref = [t[depth] for t in theirs if depth in t]
        row = {"turn": i + 1, "prompt_tokens": depth, "decode_tok_s": round(statistics.median(mine), 1)}
        row["llama_bench_tok_s"] = round(statistics.median(ref), 1) if ref else None
        row["ratio"] = round(row["decode_tok_s"] / row["llama_bench_tok_s"], 2) if ref else None
        row["runs"] = [round(x, 1) for x in mine]
        row["reference_runs"] = [round(x, 1) for x in ref]
        rows.append(row)
    return rows


def markdown(r: dict) -> str:
    lines = [
        f"`bench chatpath`: {len(SCRIPT)} turns of a new chat through the chat path against `llama-bench -p 0 "
        f"-n {r['new_tokens']} -d N` at each turn's prompt tokens, {r['threads']} threads, {r['repeats']} repeats.",
        "",
        "| turn | prompt tokens | chat path tok/s | llama-bench tok/s | ratio | chat path runs | llama-bench runs |",
        "|---:|---:|---:|---:|---:|---|---|",
    ]
    for x in r["rows"]:
        ref = "—" if x["llama_bench_tok_s"] is None else f"{x['llama_bench_tok_s']:.1f}"
        ratio = "—" if x["ratio"] is None else f"{x['ratio']:.2f}"
        lines.append(
            f"| {x['turn']} | {x['prompt_tokens']} | {x['decode_tok_s']:.1f} | {ref} | {ratio} | "
            f"{', '.join(map(str, x['runs']))} | {', '.join(map(str, x['reference_runs']))} |"
        )
    return "\n".join(lines)
