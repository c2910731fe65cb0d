"""Engine overhead: decode tokens/s of our Engine vs a bare greedy loop on the same model:
transformers' `model.generate`, or on llama.cpp `bench.baselines.bare_greedy` (its own context, one
`llama_decode` per token, nothing of ours).

Same prompts and token count on both sides, interleaved A/B repeats (these machines are noisy;
a ratio from one run means more than two absolute numbers from two), reported as ours / bare.
The Engine is one of our own (`common.timing_engine`), never the app's.
"""

from __future__ import annotations

import statistics
import time

from .common import engine_decode, prompt_ids, timing_engine

PROMPTS = [
    "Write a long story about a lighthouse keeper.",
    "Explain in detail how a steam engine works.",
    "Describe a walk through a busy market on a summer morning.",
]
TARGET = 0.9  # ours / bare


def bare_decode(loaded, ids: list[int], new_tokens: int) -> tuple[float, float, int]:
    """`model.generate` (or llama.cpp's bare loop), greedy, exactly new_tokens; timed by a streamer,
    as the engine times itself."""
    if loaded.backend == "llama.cpp":
        from .baselines import bare_greedy

        return bare_greedy(loaded.model, ids, new_tokens)
    import torch
    from transformers.generation.streamers import BaseStreamer

    class Clock(BaseStreamer):
        def __init__(self) -> None:
            self.times: list[float] = []  # the first put() is the prompt, then one per new token

        def put(self, value):
            self.times.append(time.perf_counter())

        def end(self):
            pass

    clock = Clock()
    input_ids = torch.tensor([ids], device=loaded.device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = loaded.model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            repetition_penalty=1.0,
            streamer=clock,
        )
    n = out.shape[1] - input_ids.shape[1]
    first, last = clock.times[1], clock.times[-1]
    return (n - 1) / max(last - first, 1e-9), first - t0, int(n)


def run(loaded, new_tokens: int = 32, repeats: int = 3) -> dict:
    """Decode tokens/s of our Engine and of bare `model.generate`, same prompts, interleaved A/B."""
    if new_tokens < 2:
        raise ValueError("the overhead benchmark needs at least 2 new tokens to time decoding")
    prompts = [prompt_ids(loaded, q) for q in PROMPTS]
    engine = timing_engine(loaded, new_tokens)
    runs: dict[str, list[dict]] = {"engine": [], "bare": []}
    try:
        engine_decode(engine, prompts[0], new_tokens)  # warm-up, not counted
        bare_decode(loaded, prompts[0], new_tokens)
        for r in range(repeats):
            for i, ids in enumerate(prompts):
                order = ("engine", "bare") if (r + i) % 2 == 0 else ("bare", "engine")
                for which in order:
                    tok_s, ttft_s, n = (
                        engine_decode(engine, ids, new_tokens)
                        if which == "engine"
                        else bare_decode(loaded, ids, new_tokens)
                    )
                    runs[which].append({"prompt": i, "tok_s": tok_s, "ttft_s": ttft_s, "tokens": n})
    finally:
        engine.close()
    med = {k: statistics.median(x["tok_s"] for x in v) for k, v in runs.items()}
    pairs = [a["tok_s"] / max(b["tok_s"], 1e-9) for a, b in zip(runs["engine"], runs["bare"])]
    ratio = round(med["engine"] / max(med["bare"], 1e-9), 3)  # rounded first: the verdict matches the figure
    return {
        "new_tokens": new_tokens,
        "repeats": repeats,
        "prompts": len(prompts),
        "runs_per_side": len(pairs),
        "engine_tok_s": round(med["engine"], 2),
        "bare_tok_s": round(med["bare"], 2),
        "engine_ttft_s": round(statistics.median(x["ttft_s"] for x in runs["engine"]), 4),
        "bare_ttft_s": round(statistics.median(x["ttft_s"] for x in runs["bare"]), 4),
        "ratio": ratio,
        "pair_ratio_median": round(statistics.median(pairs), 3),
        "pair_ratio_min": round(min(pairs), 3),
        "pair_ratio_max": round(max(pairs), 3),
        "same_token_count": all(x["tokens"] == new_tokens for v in runs.values() for x in v),
        "target": TARGET,
        "meets_target": ratio >= TARGET,
        "engine_runs_tok_s": [round(x["tok_s"], 2) for x in runs["engine"]],
        "bare_runs_tok_s": [round(x["tok_s"], 2) for x in runs["bare"]],
    }


def markdown(r: dict) -> str:
    return "\n".join(
        [
            f"## Engine overhead ({r['new_tokens']} new tokens, {r['prompts']} prompts x {r['repeats']} repeats, "
            "interleaved A/B, greedy, no stop)",
            "",
            "| | decode tok/s (median) | TTFT (s, median) |",
            "|---|---:|---:|",
            f"| our Engine | {r['engine_tok_s']:.2f} | {r['engine_ttft_s']:.3f} |",
            f"| bare `model.generate` | {r['bare_tok_s']:.2f} | {r['bare_ttft_s']:.3f} |",
            "",
            f"Ratio ours / bare: **{r['ratio']:.2f}** (target >= {r['target']}: "
            f"{'met' if r['meets_target'] else 'NOT met'}); per-pair ratios median {r['pair_ratio_median']:.2f}, "
            f"range {r['pair_ratio_min']:.2f}-{r['pair_ratio_max']:.2f}. "
            f"Same token count on both sides: {'yes' if r['same_token_count'] else 'no'}.",
            "",
        ]
    )
