"""`python -m llmweb bench decode`: decode and prefill tokens/s of the engine, before and after each
optimisation, at several prompt lengths, with where a decode step's time goes.

The steps, each measured in the same run on an Engine of its own (public constructors: a
`LocalRunner` with or without the block cache, models loaded by `settings.replace(quant=...)`):

  before            4bit weights (the old default everywhere) and transformers' DynamicCache,
                    which copies the whole cache with torch.cat at every step
  + block cache     the KV cache grows in blocks and a step writes its token in place
  + int8-cpu        (CPU only) torch's dynamic int8 linear layers instead of bitsandbytes, whose
                    CPU path computes in bf16: the `auto` default on the CPU
  fp32, both caches the greedy text of the block cache must be the eager cache's, token for token

Every measurement is one request of `new_tokens` greedy tokens with no stop ids; the runs are
interleaved (step by step, then again) so drift on a shared machine hits every step alike. The
per-step breakdown comes from the runner's own clock (`LocalRunner.timing`): the model's forward
pass, sampling, the rest of the runner's step, and the engine's loop around it (wall time per
token minus the runner's step).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

from .common import SYSTEM

LENGTHS = (32, 512, 1536)
FIGURES = ("decode_tok_s", "prefill_tok_s", "forward_ms", "sample_ms", "runner_other_ms", "engine_other_ms")
TEXT = (
    "The lighthouse keeper climbed the spiral stairs every evening, counting the steps, checking the "
    "lamp, and writing the weather into a worn logbook before the ships came round the headland. "
)


@dataclass
class Step:
    name: str
    quant: str
    block_cache: bool


def steps_for(device: str) -> list[Step]:
    steps = [Step("before: 4bit, DynamicCache (torch.cat per step)", "4bit", False)]
    steps.append(Step("+ block cache", "4bit", True))
    if device == "cpu":
        steps.append(Step("+ int8-cpu weights (auto on CPU)", "int8-cpu", True))
    steps.append(Step("fp32, DynamicCache", "fp32", False))
    steps.append(Step("fp32, block cache", "fp32", True))
    return steps


def prompt_of(loaded, length: int) -> list[int]:
    """Exactly `length` ids: the chat template around a long user message, cut to length."""
    from llmweb.chat.tokens import TemplateFormat, render_prompt

    ids = render_prompt(TemplateFormat(loaded.tokenizer), SYSTEM, [("user", TEXT * (length // 30 + 2))])
    return ids[:length]


def _engine(loaded, block_cache: bool, new_tokens: int):
    from llmweb.engine.kvcache import KVStore
    from llmweb.engine.local import LocalRunner
    from llmweb.engine.request import EngineLimits
    from llmweb.engine.scheduler import Engine

    kv = KVStore(0, 1)
    runner = LocalRunner(loaded.model, loaded.device, kv, loaded.kv_bytes_per_token, block_cache=block_cache)
    return Engine(runner, kv, EngineLimits(max_new_tokens=new_tokens, kv_reuse=False)), runner


def _one(engine, runner, ids: list[int], new_tokens: int) -> dict:
    from llmweb.engine.request import GenerationRequest

    before = dict(vars(runner.timing))
    h = engine.submit(GenerationRequest(ids, new_tokens))
    t0 = time.perf_counter()
    out = h.result()
    wall = time.perf_counter() - t0
    s = h.stats
    t = {k: v - before[k] for k, v in vars(runner.timing).items()}
    steps = max(t["steps"], 1)
    per_token = 1 / s.decode_tok_s if s.decode_tok_s else 0.0
    decode_ms = t["decode_s"] / steps * 1000
    return {
        "ids": list(out),
        "decode_tok_s": s.decode_tok_s,
        "prefill_tok_s": len(ids) / s.ttft_s if s.ttft_s else 0.0,
        "ttft_s": s.ttft_s,
        "wall_s": wall,
        "ms_per_token": per_token * 1000,
        "forward_ms": t["forward_s"] / steps * 1000,
        "sample_ms": t["sample_s"] / steps * 1000,
        "runner_other_ms": decode_ms - (t["forward_s"] + t["sample_s"]) / steps * 1000,
        "engine_other_ms": per_token * 1000 - decode_ms,
    }


def run(settings, lengths=LENGTHS, new_tokens: int = 64, repeats: int = 2, progress=print) -> dict:
    """Every step at every prompt length, interleaved; medians of `repeats`."""
    import torch

    from llmweb.engine import models

    device = models.resolve_device(settings)
    steps = steps_for(device)
    loaded: dict[str, Any] = {}
    for q in dict.fromkeys(s.quant for s in steps):
        progress(f"bench decode: loading {q}…")
        loaded[q] = models.load(settings.replace(quant=q), progress=lambda m: None)
    engines = {s.name: _engine(loaded[s.quant], s.block_cache, new_tokens) for s in steps}
    samples: dict[tuple[str, int], list[dict]] = {}
    try:
        for name, (engine, runner) in engines.items():  # warm-up: first-call allocations, not counted
            _one(engine, runner, prompt_of(loaded[_quant(steps, name)], 32), 4)
        for r in range(repeats):
            for length in lengths:
                order = steps if r % 2 == 0 else steps[::-1]
                for s in order:
                    progress(f"bench decode: repeat {r + 1}/{repeats}, prompt {length}, {s.name}…")
                    engine, runner = engines[s.name]
                    samples.setdefault((s.name, length), []).append(
                        _one(engine, runner, prompt_of(loaded[s.quant], length), new_tokens)
                    )
    finally:
        for engine, _runner in engines.values():
            engine.close()
    rows: list[dict] = []
    for s in steps:
        for length in lengths:
            xs = samples[(s.name, length)]
            row: dict = {"step": s.name, "quant": loaded[s.quant].quant, "block_cache": s.block_cache, "prompt": length}
            for key in FIGURES:
                row[key] = round(statistics.median(x[key] for x in xs), 2)
            row["ids"] = xs[0]["ids"]
            rows.append(row)
    by = {(r["step"], r["prompt"]): r for r in rows}
    base = steps[0].name
    default = steps[2].name if device == "cpu" else steps[1].name
    for row in rows:
        row["decode_vs_before"] = round(row["decode_tok_s"] / max(by[(base, row["prompt"])]["decode_tok_s"], 1e-9), 2)
    fp32_same = all(by[("fp32, DynamicCache", n)]["ids"] == by[("fp32, block cache", n)]["ids"] for n in lengths)
    for row in rows:
        del row["ids"]
    return {
        "bench": "decode",
        "model": settings.model or models.EMBEDDED_NAME,
        "device": device,
        "threads": torch.get_num_threads(),
        "new_tokens": new_tokens,
        "repeats": repeats,
        "lengths": list(lengths),
        "default_step": default,
        "rows": rows,
        "default_vs_before_512": by[(default, 512)]["decode_vs_before"] if 512 in lengths else None,
        "fp32_greedy_identical": fp32_same,
    }


def _quant(steps: list[Step], name: str) -> str:
    return next(s.quant for s in steps if s.name == name)


def markdown(r: dict) -> str:
    lines = [
        f"## Decode speed ({r['model']}, {r['device']}, {r['threads']} threads, {r['new_tokens']} new tokens, "
        f"greedy, median of {r['repeats']}, steps interleaved)",
        "",
        "| step | prompt | decode tok/s | × before | prefill tok/s | forward ms | sample ms | runner other ms | "
        "engine other ms |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {x['step']} | {x['prompt']} | {x['decode_tok_s']:.1f} | {x['decode_vs_before']:.2f} | "
        f"{x['prefill_tok_s']:.0f} | {x['forward_ms']:.1f} | {x['sample_ms']:.2f} | {x['runner_other_ms']:.2f} | "
        f"{x['engine_other_ms']:.2f} |"
        for x in r["rows"]
    ]
    lines += [
        "",
        f"The default on this device is **{r['default_step']}**"
        + (
            f": {r['default_vs_before_512']:.2f}x the decode speed of before at a 512-token prompt."
            if r["default_vs_before_512"]
            else "."
        ),
        f"fp32 greedy text, block cache vs DynamicCache: {'identical' if r['fp32_greedy_identical'] else 'DIFFERENT'}.",
        "",
    ]
    return "\n".join(lines)
