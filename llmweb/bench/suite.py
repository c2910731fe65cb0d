"""`python -m llmweb bench` (the default): every benchmark on one loaded model, one report.

Every comparison is measured side by side in one run on one loaded model (these machines are
noisy; a ratio from one run means more than two absolute numbers from two). Nothing here is
asserted in the test suite beyond the figures agreeing with each other.

`run()` loads the model once, then
  1) engine overhead (`overhead.py`): our Engine vs a bare `model.generate` loop, ours / bare;
  2) TTFT with reuse vs without (`ttft.py`);
  3) memory over a long replay (`memory.py`): growth the KV store does not explain, live tensors;
  4) retrieval (`retrieval.py`) at a smaller corpus;
  5) the hardware, model, quantisation and settings (`common.describe_setup`).
`markdown()` renders it; the CLI writes it as Markdown and JSON under `data_dir/reports`. The
chats of the suite run in a temporary data dir, never the user's database.
"""

from __future__ import annotations

import logging
import tempfile
import time
from collections.abc import Callable

from . import memory, overhead, retrieval, ttft
from .common import describe_setup, environment_markdown, scratch_settings

log = logging.getLogger(__name__)


def run(
    settings,
    *,
    turns: int = 40,
    ttft_new_tokens: int = 32,
    chunks: int = 2000,
    replay_turns: int = 200,
    warmup_turns: int = 10,
    replay_context: int = 1024,
    replay_new_tokens: int = 16,
    overhead_tokens: int = 32,
    overhead_repeats: int = 3,
    loaded=None,
    progress: Callable[[str], None] = log.info,
) -> dict:
    """All benchmarks on one loaded model; chats run in a temporary data dir."""
    from llmweb.chat.context import Budget
    from llmweb.engine import models

    t_all = time.perf_counter()
    loaded = loaded or models.load(settings, progress=progress)
    seconds: dict[str, float] = {}
    out: dict = {"bench": "suite"}
    with tempfile.TemporaryDirectory(prefix="llmweb-bench-") as tmp:
        scratch = scratch_settings(settings, tmp)

        progress(f"bench: engine overhead ({overhead_tokens} tokens, {overhead_repeats} repeats)…")
        t0 = time.perf_counter()
        out["overhead"] = overhead.run(loaded, overhead_tokens, overhead_repeats)
        seconds["overhead"] = time.perf_counter() - t0

        progress(f"bench: TTFT over {turns} turns, with and without KV reuse…")
        t0 = time.perf_counter()
        out["ttft"] = ttft.run(scratch.replace(max_new_tokens=ttft_new_tokens), loaded, turns)
        seconds["ttft"] = time.perf_counter() - t0

        progress(f"bench: memory over {warmup_turns} + {replay_turns} turns…")
        t0 = time.perf_counter()
        out["memory"] = memory.run(
            scratch, loaded, replay_turns, warmup_turns, replay_context, replay_new_tokens, progress=progress
        )
        seconds["memory"] = time.perf_counter() - t0

        progress(f"bench: retrieval at {chunks} chunks…")
        t0 = time.perf_counter()
        out["retrieval"] = retrieval.run(scratch, n_chunks=chunks)
        out["retrieval"]["requested_chunks"] = chunks
        seconds["retrieval"] = time.perf_counter() - t0

    ttft_settings = settings.replace(max_new_tokens=ttft_new_tokens)  # the app's settings as the TTFT runs used them
    out["environment"] = describe_setup(
        ttft_settings, loaded, Budget.from_settings(ttft_settings, loaded.max_context, loaded.on_cpu)
    )
    out["seconds"] = {k: round(v, 1) for k, v in seconds.items()}
    out["total_s"] = round(time.perf_counter() - t_all, 1)
    return out


def markdown(r: dict) -> str:
    ret = r["retrieval"]
    secs = " · ".join(f"{k} {v:.0f} s" for k, v in r["seconds"].items())
    return "\n".join(
        [
            "# llmweb benchmark suite",
            "",
            environment_markdown(r["environment"]),
            overhead.markdown(r["overhead"]),
            ttft.markdown(r["ttft"]),
            memory.markdown(r["memory"]),
            f"## Retrieval ({ret['requested_chunks']} chunks requested, the suite's smaller corpus; "
            "`bench retrieval` runs 10,000)",
            "",
            retrieval.markdown(ret),
            "",
            f"Wall time: {r['total_s']:.0f} s ({secs}).",
            "",
        ]
    )
