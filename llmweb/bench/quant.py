"""`python -m llmweb bench quant`: weights size and decode speed per quantisation, same prompt, one process.

Each quantisation is loaded from `settings.replace(quant=...)` and timed on an Engine of its own
(`common.timing_engine`); docs/benchmarks.md's "bench quant" figures come from here.
"""

from __future__ import annotations

import statistics

from .common import engine_decode, prompt_ids, timing_engine

PROMPT = "Write a long story about a lighthouse."


def run(settings, quants=None, new_tokens: int = 64, repeats: int = 3) -> dict:
    """Weights size and decode speed of each quantisation, same prompt, one process (by default
    fp32, 4bit and, on the CPU, int8-cpu)."""
    from llmweb.engine import models

    if quants is None:
        quants = ("fp32", "4bit", "int8-cpu") if models.resolve_device(settings) == "cpu" else ("fp32", "bf16", "4bit")

    rows = []
    for q in quants:
        lm = models.load(settings.replace(quant=q))
        engine = timing_engine(lm, new_tokens)
        ids = prompt_ids(lm, PROMPT)
        speeds, ttfts = [], []
        try:
            for _ in range(repeats):
                tok_s, ttft_s, _n = engine_decode(engine, ids, new_tokens)
                speeds.append(tok_s)
                ttfts.append(ttft_s)
        finally:
            engine.close()
        rows.append(
            {
                "quant": lm.quant,
                "weights_mib": round(lm.weights_bytes / 2**20, 1),
                "decode_tok_s": round(statistics.median(speeds), 1),
                "ttft_s": round(statistics.median(ttfts), 3),
                "device": lm.device,
            }
        )
        del engine, lm
    return {
        "bench": "quant",
        "model": settings.model or models.EMBEDDED_NAME,
        "new_tokens": new_tokens,
        "repeats": repeats,
        "rows": rows,
    }


def markdown(r: dict) -> str:
    lines = [
        f"## Quantisation ({r['model']}, {r['new_tokens']} new tokens, median of {r['repeats']})",
        "",
        "| quant | weights (MiB) | decode tok/s | TTFT (s) | device |",
        "|---|---:|---:|---:|---|",
    ]
    lines += [
        f"| {x['quant']} | {x['weights_mib']:.0f} | {x['decode_tok_s']:.1f} | {x['ttft_s']:.3f} | {x['device']} |"
        for x in r["rows"]
    ]
    return "\n".join(lines) + "\n"
