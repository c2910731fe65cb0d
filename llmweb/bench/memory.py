"""Memory over a long chat (the 200-turn replay): growth that the KV store does not explain.

After a warm-up (at least until the first fold into the summary), `run()` measures memory at
both ends of `turns` chat turns: RSS on CPU (anonymous, after gc + malloc_trim) or CUDA
allocated bytes, minus what the session KV store holds, plus the count of live tensors outside
KV caches. A leak shows up in either. The chat runs on a Runtime built from Settings (its own
context and reply limits); the engine's KV store is only read.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from llmweb.engine.telemetry import live_tensors, private_bytes, release_memory
from llmweb.records import LOCAL_OWNER as LOCAL

from .common import scripted_turns

log = logging.getLogger(__name__)

FOLD_WAIT = 50  # extra warm-up turns allowed for the first fold into the summary
# The live-tensor count is exact; memory figures are not. On CPU, anonymous RSS moves by +-20 MiB
# between otherwise equal runs (allocator arenas, caches that fill up to their bound), so the byte
# threshold only catches leaks of a KV-cache's size; smaller ones show in the per-turn trend.
LEAK_THRESHOLD_BYTES = 64 * 2**20
LEAK_TENSOR_SLACK = 8


def run(
    settings,
    loaded,
    turns: int = 200,
    warmup: int = 10,
    context: int = 1024,
    max_new_tokens: int = 16,
    progress: Callable[[str], None] = log.info,
) -> dict:
    """Run warmup + turns through the chat path; measure memory growth the KV store does not explain.

    The warm-up lasts `warmup` turns and at least until the first fold into the summary (at most
    FOLD_WAIT more turns); then `turns` turns are measured.

    `settings.data_dir` should be a scratch folder: the chat is stored there (and deleted after).
    """
    from llmweb.runtime import Runtime

    s = settings.replace(
        context_limit=context,
        max_new_tokens=max_new_tokens,
        sample_docs=False,
        summary_tokens=min(settings.summary_tokens, 48),
    )
    runtime = Runtime(s, loaded=loaded).start(background=False)
    t0 = time.perf_counter()
    try:
        chat = runtime.wait_ready()
        replay = _replay(chat, runtime.store, loaded.device, turns, warmup, progress)
    finally:
        runtime.close()
    return {
        "turns": len(replay.series[replay.start_turn :]),
        "warmup_turns": replay.start_turn,
        "context_limit": chat.budget.context_limit,
        "max_new_tokens": chat.budget.max_new_tokens,
        "summary_tokens": s.summary_tokens,
        "measure": private_bytes(loaded.device)[1]
        + (" (after gc + malloc_trim at both ends)" if loaded.on_cpu else ""),
        **_growth(replay),
        "seconds": round(time.perf_counter() - t0, 1),
    }


@dataclass
class _Replay:
    """What a replay recorded: per-turn figures, and the two endpoints' snapshots."""

    series: list[dict] = field(default_factory=list)  # one row per turn
    ends: dict[str, dict] = field(default_factory=dict)  # "start" (after the warm-up), "end"
    start_turn: int = 0  # the index in `series` where measuring began


def _endpoint(chat, device) -> dict:
    """Memory, the KV store's bytes and live tensors, after gc and releasing cached memory."""
    release_memory(device)
    tensors, in_caches = live_tensors()
    return {
        "mem_bytes": private_bytes(device)[0],
        "kv_store_bytes": chat.engine.kv.total_bytes,
        "tensors": tensors,
        "tensors_in_kv": in_caches,
        "tensors_outside_kv": tensors - in_caches,
    }


def _replay(chat, store, device, turns: int, warmup: int, progress: Callable[[str], None]) -> _Replay:
    """The scripted chat: warm up (and wait for the first fold), then `turns` measured turns."""
    from llmweb.chat.session import Finished

    texts = scripted_turns(warmup + turns + FOLD_WAIT)
    replay = _Replay()
    start_turn: int | None = None
    folded = False
    conv = store.create_conversation(LOCAL, "bench memory replay")
    for i, text in enumerate(texts):
        # Measure from the end of the warm-up, but not before the first fold: folding loads
        # one-off things (the recall index and its embedder) that are not a leak.
        if start_turn is None and i >= warmup and (folded or i >= warmup + FOLD_WAIT):
            replay.ends["start"], start_turn = _endpoint(chat, device), i
        if start_turn is not None and i - start_turn >= turns:
            break
        for ev in chat.send(LOCAL, conv, text, use_docs=False, wait_summary=True):
            if isinstance(ev, Finished):
                folded = folded or ev.stats.summarized_turns > 0
                replay.series.append(
                    {
                        "turn": i + 1,
                        "mem_bytes": private_bytes(device)[0],
                        "kv_store_bytes": chat.engine.kv.total_bytes,
                        "summarized_turns": ev.stats.summarized_turns,
                        "prompt_tokens": ev.stats.gen.prompt_tokens,
                    }
                )
        if (i + 1) % 50 == 0:
            progress(f"memory replay: turn {i + 1}")
    if start_turn is None:
        replay.ends["start"], start_turn = _endpoint(chat, device), len(replay.series)
    replay.ends["end"] = _endpoint(chat, device)
    replay.start_turn = start_turn
    chat.delete(LOCAL, conv)
    return replay


def _growth(replay: _Replay) -> dict:
    """Growth between the endpoints, the KV store's share, the per-turn trend, and the verdict."""
    a, b = replay.ends["start"], replay.ends["end"]
    growth = b["mem_bytes"] - a["mem_bytes"]
    kv_growth = b["kv_store_bytes"] - a["kv_store_bytes"]
    measured = replay.series[replay.start_turn :]
    xs, ys = [x["turn"] for x in measured], [x["mem_bytes"] - x["kv_store_bytes"] for x in measured]
    half = len(xs) // 2
    slope, slope_first, slope_second = _slope(xs, ys), _slope(xs[:half], ys[:half]), _slope(xs[half:], ys[half:])
    unexplained = growth - kv_growth
    tensor_growth = b["tensors_outside_kv"] - a["tensors_outside_kv"]
    return {
        "start": a,
        "end": b,
        "mem_growth_bytes": growth,
        "kv_growth_bytes": kv_growth,
        "unexplained_growth_bytes": unexplained,
        "slope_bytes_per_turn": round(slope, 1),
        "slope_first_half_bytes_per_turn": round(slope_first, 1),
        "slope_second_half_bytes_per_turn": round(slope_second, 1),
        "tensor_growth": tensor_growth,
        "folded_turns": max((x["summarized_turns"] for x in replay.series), default=0),
        "mem_min_bytes": min((x["mem_bytes"] for x in measured), default=0),
        "mem_max_bytes": max((x["mem_bytes"] for x in measured), default=0),
        "leak_threshold_bytes": LEAK_THRESHOLD_BYTES,
        "leak_suspected": unexplained > LEAK_THRESHOLD_BYTES or tensor_growth > LEAK_TENSOR_SLACK,
    }


def _slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys over xs (0 for fewer than 2 points)."""
    if len(xs) < 2:
        return 0.0
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den if den else 0.0


def markdown(r: dict) -> str:
    mib = lambda n: f"{n / 2**20:,.1f}"  # noqa: E731
    a, b = r["start"], r["end"]
    return "\n".join(
        [
            f"## Memory over a {r['turns']}-turn replay (after {r['warmup_turns']} warm-up turns; context "
            f"{r['context_limit']}, replies {r['max_new_tokens']} tokens, {r['folded_turns']} turns folded into the "
            "summary)",
            "",
            "| | after warm-up | at the end | growth |",
            "|---|---:|---:|---:|",
            f"| {r['measure']} (MiB) | {mib(a['mem_bytes'])} | {mib(b['mem_bytes'])} | {mib(r['mem_growth_bytes'])} |",
            f"| KV store (MiB) | {mib(a['kv_store_bytes'])} | {mib(b['kv_store_bytes'])} "
            f"| {mib(r['kv_growth_bytes'])} |",
            f"| growth the KV store does not explain (MiB) | | | **{mib(r['unexplained_growth_bytes'])}** |",
            f"| live tensors outside KV caches | {a['tensors_outside_kv']} | {b['tensors_outside_kv']} "
            f"| {r['tensor_growth']:+d} |",
            "",
            f"Per-turn trend of (memory - KV store): {r['slope_bytes_per_turn'] / 1024:+.1f} KiB/turn "
            f"(first half {r['slope_first_half_bytes_per_turn'] / 1024:+.1f}, second half "
            f"{r['slope_second_half_bytes_per_turn'] / 1024:+.1f}: a bounded cache filling up levels off, a leak "
            f"does not; range over the turns {mib(r['mem_min_bytes'])}-{mib(r['mem_max_bytes'])} MiB). "
            f"Leak suspected: **{'yes' if r['leak_suspected'] else 'no'}** "
            f"(threshold: > {mib(r['leak_threshold_bytes'])} MiB unexplained or > {LEAK_TENSOR_SLACK} more live "
            f"tensors). {r['seconds']:.0f} s.",
            "",
        ]
    )
