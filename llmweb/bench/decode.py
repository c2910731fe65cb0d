"""`python -m llmweb bench decode`: decode and prefill tokens/s of the engine, before and after each
optimisation, at several prompt lengths, with where a decode step's time goes.

The steps, each measured in the same run on an Engine of its own (public constructors: a
`LocalRunner` with or without the block cache, models loaded by `settings.replace(quant=...)`):

  before            4bit weights (the old default everywhere) and transformers' DynamicCache,
                    which copies the whole cache with torch.cat at every step
  + block cache     the KV cache grows in blocks and a step writes its token in place
  + int8-cpu        (CPU only) torch's dynamic int8 linear layers instead of bitsandbytes, whose
                    CPU path computes in bf16: the CPU default until llama.cpp
  + llama.cpp       (CPU only, where llama-cpp-python loads) the GGUF file as it ships on
                    engine/runners/llama_cpp.py, in this process
  + engine process  the same, in an engine process of its own behind engine/boundary.py's wire,
                    as the app runs it (LLMWEB_ENGINE_PROCESS): the default on the CPU; the
                    difference to the row above is the boundary's cost
  fp32, both caches the greedy text of the block cache must be the eager cache's, token for token

and, on the same GGUF file, prompt lengths and threads, llama.cpp's own `llama-bench` (when it is
on the PATH, or LLMWEB_LLAMA_BENCH names it): prefill (`-p N`) and decode at that depth (`-n M -d N`),
the reference the default's decode is held to (README "CPU engines"). The whole reply is measured
too: a first turn of FIRST_TURN (a 400-token prompt, 128 new tokens), the default against the
previous default (int8-cpu), interleaved.

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

from .common import SYSTEM, llama_bench_tests, llama_tool

LENGTHS = (32, 512, 1536)
FIRST_TURN = (400, 128)  # prompt tokens, new tokens
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
    backend: str = "transformers"
    process: bool = False  # in an engine process of its own (engine/process.py), as the app runs it

    @property
    def key(self) -> tuple[str, str]:
        return self.backend, self.quant


INT8 = "+ int8-cpu weights (the CPU default before llama.cpp)"
LLAMA = "+ llama.cpp on the GGUF file (auto on the CPU)"
PROCESS = "+ the engine process (llama.cpp behind the boundary: the app's default)"


def steps_for(device: str, llama_ok: bool = False, process: bool = False) -> list[Step]:
    steps = [Step("before: 4bit, DynamicCache (torch.cat per step)", "4bit", False)]
    steps.append(Step("+ block cache", "4bit", True))
    if device == "cpu":
        steps.append(Step(INT8, "int8-cpu", True))
        if llama_ok:
            steps.append(Step(LLAMA, "auto", False, "llama.cpp"))
            if process:
                steps.append(Step(PROCESS, "auto", False, "llama.cpp", process=True))
    steps.append(Step("fp32, DynamicCache", "fp32", False))
    steps.append(Step("fp32, block cache", "fp32", True))
    return steps


def default_step(steps: list[Step], device: str) -> str:
    names = [s.name for s in steps]
    if device != "cpu":
        return names[1]
    return next((n for n in (PROCESS, LLAMA) if n in names), INT8)


def prompt_of(loaded, length: int) -> list[int]:
    """Exactly `length` ids: the chat template around a long user message, cut to length."""
    from llmweb.chat.tokens import TemplateFormat, render_prompt

    ids = render_prompt(TemplateFormat(loaded.tokenizer), SYSTEM, [("user", TEXT * (length // 30 + 2))])
    return ids[:length]


def _engine(loaded, block_cache: bool, new_tokens: int, process_settings=None):
    """(engine, runner) for one step; with `process_settings`, an engine process of those settings."""
    from llmweb.engine.kvcache import KVStore
    from llmweb.engine.request import EngineLimits
    from llmweb.engine.scheduler import Engine

    kv = KVStore(0, 1)
    limits = EngineLimits(max_new_tokens=new_tokens, kv_reuse=False)
    if process_settings:
        from llmweb.runtime.worker import engine_process_runner

        runner = engine_process_runner(process_settings, lambda m: None)
        runner.boot()
        return Engine(runner, runner.kv, limits), runner
    if loaded.backend == "llama.cpp":
        from llmweb.engine.backends import make_engine

        engine = make_engine(loaded, kv, limits)
        return engine, engine.runner
    from llmweb.engine.blockcache import new_cache
    from llmweb.engine.runners.transformers import LocalRunner

    from .baselines import dynamic_cache

    make_cache = new_cache if block_cache else dynamic_cache
    runner = LocalRunner(loaded.model, loaded.device, kv, loaded.kv_bytes_per_token, make_cache=make_cache)
    runner.timing.exact = True  # the split is the point here: wait for the device at each reading
    return Engine(runner, kv, limits), runner


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
    """Every step at every prompt length, interleaved; medians of `repeats`; the first turn; llama-bench."""
    import torch

    from llmweb.engine import gguf, models

    device = models.resolve_device(settings)
    steps = steps_for(device, gguf.available() is None, settings.in_engine_process)
    loaded: dict[tuple[str, str], Any] = {}
    for backend, q in dict.fromkeys(s.key for s in steps):
        progress(f"bench decode: loading {q} on {backend}…")
        loaded[(backend, q)] = models.load(settings.replace(quant=q, backend=backend), progress=lambda m: None)
    cap = max(new_tokens, FIRST_TURN[1])  # the first turn's too (a cap of `new_tokens` cut it short)
    child = settings.replace(backend="llama.cpp", max_new_tokens=cap)  # the engine process's step
    engines = {s.name: _engine(loaded[s.key], s.block_cache, cap, s.process and child) for s in steps}
    by_name = {s.name: s for s in steps}
    default = default_step(steps, device)
    samples: dict[tuple[str, int], list[dict]] = {}
    first: dict[str, list[float]] = {}
    gguf_file = next((m.model.path for m in loaded.values() if m.backend == "llama.cpp"), None)  # maybe re-encoded
    references: list[list[dict] | None] = []
    try:
        for name, (engine, runner) in engines.items():  # warm-up: first-call allocations, not counted
            _one(engine, runner, prompt_of(loaded[by_name[name].key], 32), 4)
        for r in range(repeats):
            order = steps if r % 2 == 0 else steps[::-1]
            for length in lengths:
                for s in order:
                    progress(f"bench decode: repeat {r + 1}/{repeats}, prompt {length}, {s.name}…")
                    engine, runner = engines[s.name]
                    samples.setdefault((s.name, length), []).append(
                        _one(engine, runner, prompt_of(loaded[s.key], length), new_tokens)
                    )
            for name in [n for n in (default, INT8) if n in engines][:: 1 if r % 2 == 0 else -1]:
                progress(f"bench decode: repeat {r + 1}/{repeats}, a first turn of {FIRST_TURN}, {name}…")
                engine, runner = engines[name]
                ids = prompt_of(loaded[by_name[name].key], FIRST_TURN[0])
                done = _one(engine, runner, ids, FIRST_TURN[1])
                assert len(done["ids"]) == FIRST_TURN[1], f"the first turn wrote {len(done['ids'])} tokens"
                first.setdefault(name, []).append(done["wall_s"])
            if gguf_file:  # in every repeat, beside ours: the machine's drift hits both alike
                references.append(llama_bench(gguf_file, lengths, new_tokens, _threads(settings), 1, progress))
    finally:
        for engine, _runner in engines.values():
            engine.close()
    rows = _rows(steps, lengths, samples, loaded)
    by = {(r["step"], r["prompt"]): r for r in rows}
    base = steps[0].name
    for row in rows:
        row["decode_vs_before"] = round(row["decode_tok_s"] / max(by[(base, row["prompt"])]["decode_tok_s"], 1e-9), 2)
    fp32_same = all(by[("fp32, DynamicCache", n)]["ids"] == by[("fp32, block cache", n)]["ids"] for n in lengths)
    for row in rows:
        del row["ids"]
    reference = _median_reference(references)
    for row in reference or []:
        ours = by[(default, row["prompt"])]
        row["default_decode_ratio"] = round(ours["decode_tok_s"] / max(row["decode_tok_s"], 1e-9), 2)
        row["default_prefill_ratio"] = round(ours["prefill_tok_s"] / max(row["prefill_tok_s"], 1e-9), 2)
    turn = {name: round(statistics.median(xs), 3) for name, xs in first.items()}
    return {
        "bench": "decode",
        "model": settings.model or models.EMBEDDED_NAME,
        "device": device,
        "threads": _threads(settings) if LLAMA in engines else torch.get_num_threads(),
        "torch_threads": torch.get_num_threads(),
        "new_tokens": new_tokens,
        "repeats": repeats,
        "lengths": list(lengths),
        "default_step": default,
        "rows": rows,
        "default_vs_before_512": by[(default, 512)]["decode_vs_before"] if 512 in lengths else None,
        "fp32_greedy_identical": fp32_same,
        "llama_bench": reference,
        "first_turn": {
            "prompt": FIRST_TURN[0],
            "new_tokens": FIRST_TURN[1],
            "total_s": turn,
            "default_vs_int8": round(turn[INT8] / max(turn[default], 1e-9), 2) if INT8 in turn else None,
        },
    }


def _rows(steps: list[Step], lengths, samples: dict, loaded: dict) -> list[dict]:
    rows: list[dict] = []
    for s in steps:
        for length in lengths:
            xs = samples[(s.name, length)]
            row: dict = {"step": s.name, "quant": loaded[s.key].quant, "block_cache": s.block_cache, "prompt": length}
            for key in FIGURES:
                row[key] = round(statistics.median(x[key] for x in xs), 2)
            row["ids"] = xs[0]["ids"]
            rows.append(row)
    return rows


def _median_reference(runs: list[list[dict] | None]) -> list[dict] | None:
    """llama-bench's rows, each figure the median over the repeats; None when it did not run."""
    done = [r for r in runs if r]
    if not done:
        return None
    rows = []
    for i, first in enumerate(done[0]):
        row = dict(first)
        for key in ("prefill_tok_s", "decode_tok_s"):
            values = [r[i][key] for r in done if key in r[i]]
            if values:
                row[key] = round(statistics.median(values), 2)
        rows.append(row)
    return rows


def _threads(settings) -> int:
    from llmweb.engine.gguf import default_threads

    return settings.threads or default_threads()


def llama_bench(
    gguf, lengths, new_tokens: int, threads: int, repeats: int, progress=print, bench: str = "decode"
) -> list[dict] | None:
    """llama.cpp's `llama-bench` on the GGUF file: prefill of each length (`-p N -n 0`) and decode of
    `new_tokens` after that many tokens (`-p 0 -n M -d N`); None when it is not installed."""
    if not llama_tool("llama-bench"):
        return None
    common = ["-t", str(threads), "-r", str(max(repeats, 1))]
    joined = ",".join(str(n) for n in lengths)
    progress(f"bench {bench}: llama-bench, prefill {joined} and decode {new_tokens} at those depths…")
    out: dict[int, dict] = {n: {"step": "llama.cpp llama-bench (reference)", "prompt": n} for n in lengths}
    for args, key in (
        (["-p", joined, "-n", "0"], "prefill_tok_s"),
        (["-p", "0", "-n", str(new_tokens), "-d", joined], "decode_tok_s"),
    ):
        tests = llama_bench_tests(gguf, common + args, progress, bench)
        if tests is None:
            return None
        for test in tests:
            n = test["n_prompt"] if key == "prefill_tok_s" else test.get("n_depth", 0)
            if n in out:
                out[n][key] = round(float(test["avg_ts"]), 2)
    return list(out.values())


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
    return "\n".join(lines + _reference_lines(r))


def _reference_lines(r: dict) -> list[str]:
    lines = []
    ref = r.get("llama_bench")
    if ref:
        lines += [
            f"### The default against llama.cpp's llama-bench (same GGUF file, {r['threads']} threads)",
            "",
            "| prompt | llama-bench decode tok/s | default decode tok/s | ratio | llama-bench prefill tok/s | "
            "default prefill tok/s | ratio |",
            "|---:|---:|---:|---:|---:|---:|---:|",
        ]
        ours = {x["prompt"]: x for x in r["rows"] if x["step"] == r["default_step"]}
        for x in ref:
            o = ours[x["prompt"]]
            lines.append(
                f"| {x['prompt']} | {x.get('decode_tok_s', 0):.1f} | {o['decode_tok_s']:.1f} | "
                f"{x.get('default_decode_ratio', 0):.2f} | {x.get('prefill_tok_s', 0):.0f} | "
                f"{o['prefill_tok_s']:.0f} | {x.get('default_prefill_ratio', 0):.2f} |"
            )
        lines.append("")
    else:
        lines += ["llama-bench is not on the PATH (or LLMWEB_LLAMA_BENCH): no llama.cpp reference in this run.", ""]
    ft = r.get("first_turn") or {}
    if ft.get("total_s"):
        times = " · ".join(f"{name}: {sec:.2f} s" for name, sec in ft["total_s"].items())
        ratio = f"; the default finishes **{ft['default_vs_int8']:.2f}x** sooner" if ft.get("default_vs_int8") else ""
        lines += [
            f"A first turn of {ft['prompt']} prompt tokens and {ft['new_tokens']} new tokens: {times}{ratio}.",
            "",
        ]
    return lines
