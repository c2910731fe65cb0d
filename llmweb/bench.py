"""Benchmarks that print figures: `python -m llmweb bench [all | ttft | retrieval | quant]`.

Every comparison is measured side by side in one run on one loaded model (these machines are
noisy; a ratio from one run means more than two absolute numbers from two). Nothing here is
asserted in the test suite; tests only check that the commands run and report what they say.

ttft: the same scripted conversation twice, with session KV reuse and without. For each mode,
the median time-to-first-token over the last 10 turns divided by the median over the first 5:
flat (≈1) with reuse, growing with history without it.

all (the default, `suite()`): one model load, then
  1) engine overhead: decode tokens/s of our Engine vs a bare `model.generate` greedy loop on
     the same prompts and token count, interleaved A/B repeats, as a ratio (ours / bare);
  2) TTFT with reuse vs without (`ttft()`);
  3) memory over a long replay (`memory_replay()`): after a warm-up, the growth of RSS (CPU) or
     allocated memory (CUDA) across the turns beyond what the KV store explains; a leak shows
     up here, and in the count of live tensors outside KV caches;
  4) retrieval (`bench_retrieval.run`) at a smaller corpus;
  5) the hardware, model, quantisation and settings.
It writes a Markdown and a JSON report under `data_dir/reports` and prints the Markdown. The
chats of the suite run in a temporary data dir, never the user's database.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .capacity import add_parser as add_capacity_parser  # noqa: F401  (cli.py registers it next to ours)
from .capacity import private_bytes, release_memory

log = logging.getLogger(__name__)

TOPICS = ["the history of tea", "how bridges carry load", "why the sky is blue", "what a compiler does",
          "how bees find flowers", "the rules of chess", "how vaccines work", "what makes bread rise",
          "how tides happen", "what a database index is", "how a bicycle stays up", "why leaves change colour",
          "how rainbows form", "what an operating system does", "how glaciers move", "why we sleep",
          "how batteries store energy", "what a black hole is", "how coffee is roasted", "why cats purr"]


def scripted_turns(n: int) -> list[str]:
    """A deterministic conversation of n user messages of similar length."""
    out = []
    for i in range(n):
        topic = TOPICS[i % len(TOPICS)]
        out.append(f"Question {i + 1}: in two or three sentences, explain {topic}. "
                   f"Keep it simple, and mention one surprising fact about {topic.split()[-1]}.")
    return out


@dataclass
class ModeResult:
    mode: str
    ttft_s: list[float]
    prompt_tokens: list[int]
    reused_tokens: list[int]
    replies: list[str]

    def ratio(self, early: int = 5, late: int = 10) -> float:
        return statistics.median(self.ttft_s[-late:]) / max(statistics.median(self.ttft_s[:early]), 1e-9)


def run_mode(runtime, turns: list[str], reuse: bool) -> ModeResult:
    from .chat import Finished

    chat = runtime.wait_ready()
    runtime.engine.kv.clear()
    runtime.engine.limits.kv_reuse = reuse
    conv = runtime.store.create_conversation(f"bench ttft ({'reuse' if reuse else 'full prefill'})")
    res = ModeResult("reuse" if reuse else "full", [], [], [], [])
    try:
        for text in turns:
            for ev in chat.send(conv, text, use_docs=False, wait_summary=True):
                if isinstance(ev, Finished):
                    g = ev.stats.gen
                    res.ttft_s.append(g.ttft_s)
                    res.prompt_tokens.append(g.prompt_tokens)
                    res.reused_tokens.append(g.reused_tokens)
                    res.replies.append(ev.reply)
    finally:
        runtime.engine.limits.kv_reuse = runtime.settings.kv_reuse
        chat.delete(conv)
    return res


def ttft(runtime, n_turns: int) -> dict:
    turns = scripted_turns(n_turns)
    results = [run_mode(runtime, turns, reuse=True), run_mode(runtime, turns, reuse=False)]
    same = sum(a == b for a, b in zip(results[0].replies, results[1].replies))
    return {
        "bench": "ttft", "turns": n_turns, **environment(runtime),
        "modes": {r.mode: {"late_early_ratio": round(r.ratio(), 3),
                           "median_first5_s": round(statistics.median(r.ttft_s[:5]), 4),
                           "median_last10_s": round(statistics.median(r.ttft_s[-10:]), 4),
                           "ttft_s": [round(x, 4) for x in r.ttft_s], "prompt_tokens": r.prompt_tokens,
                           "reused_tokens": r.reused_tokens} for r in results},
        "identical_replies": f"{same}/{n_turns}",
    }


def ttft_markdown(r: dict) -> str:
    reuse, full = r["modes"]["reuse"], r["modes"]["full"]
    rows = ["| turn | prompt tokens | reused | TTFT reuse (s) | TTFT full prefill (s) |", "|---:|---:|---:|---:|---:|"]
    for i, (p, u, a, b) in enumerate(zip(reuse["prompt_tokens"], reuse["reused_tokens"], reuse["ttft_s"], full["ttft_s"]), 1):
        rows.append(f"| {i} | {p} | {u} | {a:.3f} | {b:.3f} |")
    return "\n".join([
        f"## TTFT over {r['turns']} turns ({r['model']}, {r['quant']}, {r['device']})", "", *rows, "",
        "| mode | median TTFT, first 5 (s) | median TTFT, last 10 (s) | late / early |", "|---|---:|---:|---:|",
        f"| reuse | {reuse['median_first5_s']:.3f} | {reuse['median_last10_s']:.3f} | {reuse['late_early_ratio']:.2f} |",
        f"| full prefill | {full['median_first5_s']:.3f} | {full['median_last10_s']:.3f} | {full['late_early_ratio']:.2f} |",
        "", f"Replies identical in both modes: {r['identical_replies']}", ""])


def quant(settings, quants=("fp32", "4bit"), new_tokens: int = 64, repeats: int = 3) -> dict:
    """Weights size and decode speed of each quantisation, same prompt, one process."""
    from . import models
    from .engine import Engine, EngineLimits, GenerationRequest
    from .kvcache import KVStore
    from .tokens import TemplateFormat, render_prompt

    rows = []
    for q in quants:
        lm = models.load(settings.replace(quant=q))
        fmt = TemplateFormat(lm.tokenizer)
        engine = Engine(lm.model, lm.device, KVStore(0, 1), EngineLimits(max_new_tokens=new_tokens, kv_reuse=False),
                        lm.kv_bytes_per_token)
        ids = render_prompt(fmt, "You are a helpful assistant.", [("user", "Write a long story about a lighthouse.")])
        speeds, ttfts = [], []
        try:
            for _ in range(repeats):
                h = engine.submit(GenerationRequest(ids, new_tokens))  # no stop ids: always new_tokens
                h.result()
                speeds.append(h.stats.decode_tok_s)
                ttfts.append(h.stats.ttft_s)
        finally:
            engine.close()
        rows.append({"quant": lm.quant, "weights_mib": round(lm.weights_bytes / 2**20, 1),
                     "decode_tok_s": round(statistics.median(speeds), 1), "ttft_s": round(statistics.median(ttfts), 3),
                     "device": lm.device})
        del engine, lm
    return {"bench": "quant", "model": settings.model or models.EMBEDDED_NAME, "new_tokens": new_tokens, "rows": rows}


def quant_markdown(r: dict) -> str:
    lines = [f"## Quantisation ({r['model']}, {r['new_tokens']} new tokens, median of 3)", "",
             "| quant | weights (MiB) | decode tok/s | TTFT (s) | device |", "|---|---:|---:|---:|---|"]
    lines += [f"| {x['quant']} | {x['weights_mib']:.0f} | {x['decode_tok_s']:.1f} | {x['ttft_s']:.3f} | {x['device']} |"
              for x in r["rows"]]
    return "\n".join(lines) + "\n"


def environment(runtime) -> dict:
    return describe_setup(runtime.settings, runtime.loaded, runtime.budget)


def describe_setup(settings, loaded, budget=None) -> dict:
    """The hardware, model, quantisation and the settings that shape the figures."""
    import torch

    from .runtime import cpu_mem_limit_bytes, kv_budget_bytes

    env = {"model": loaded.name, "quant": loaded.quant, "device": loaded.device,
           "weights_mib": round(loaded.weights_bytes / 2**20, 1),
           "context_limit": budget.context_limit if budget else None,
           "max_new_tokens": budget.max_new_tokens if budget else None,
           "machine": f"{platform.machine()} {platform.processor() or ''}".strip(), "cpu": _cpu_name(),
           "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
           "ram_gib": round(_ram_bytes() / 2**30, 1), "python": platform.python_version(),
           "torch": torch.__version__, "transformers": _version("transformers"),
           "bitsandbytes": _version("bitsandbytes"), "kv_bytes_per_token": loaded.kv_bytes_per_token,
           "kv_budget_mib": round(kv_budget_bytes(settings, loaded) / 2**20, 1),
           "kv_reuse": settings.kv_reuse, "notes": list(loaded.notes), "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    if loaded.on_cpu:
        env["mem_limit_mib"] = round(cpu_mem_limit_bytes(settings) / 2**20, 1)
    else:
        props = torch.cuda.get_device_properties(loaded.device)
        env.update(gpu=props.name, gpu_mem_gib=round(props.total_memory / 2**30, 1),
                   mem_margin_mib=settings.mem_margin_mb)
    return env


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or ""


def _ram_bytes() -> int:
    import psutil

    return psutil.virtual_memory().total


def _version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return "not installed"


# ---- 1) engine overhead: our Engine vs a bare model.generate loop

OVERHEAD_PROMPTS = ["Write a long story about a lighthouse keeper.",
                    "Explain in detail how a steam engine works.",
                    "Describe a walk through a busy market on a summer morning."]


def _engine_decode(engine, ids: list[int], new_tokens: int) -> tuple[float, float, int]:
    from .engine import GenerationRequest

    h = engine.submit(GenerationRequest(ids, new_tokens))  # no stop ids: always new_tokens
    h.result()
    return h.stats.decode_tok_s, h.stats.ttft_s, h.stats.generated_tokens


def _bare_decode(loaded, ids: list[int], new_tokens: int) -> tuple[float, float, int]:
    """`model.generate`, greedy, exactly new_tokens; timed by a streamer, as the engine times itself."""
    import torch
    from transformers.generation.streamers import BaseStreamer

    class Clock(BaseStreamer):
        def __init__(self):
            self.times: list[float] = []  # the first put() is the prompt, then one per new token

        def put(self, value):
            self.times.append(time.perf_counter())

        def end(self):
            pass

    clock = Clock()
    input_ids = torch.tensor([ids], device=loaded.device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = loaded.model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                    max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                    repetition_penalty=1.0, streamer=clock)
    n = out.shape[1] - input_ids.shape[1]
    first, last = clock.times[1], clock.times[-1]
    return (n - 1) / max(last - first, 1e-9), first - t0, int(n)


def engine_overhead(loaded, new_tokens: int = 32, repeats: int = 3) -> dict:
    """Decode tokens/s of our Engine and of bare `model.generate`, same prompts, interleaved A/B."""
    from .engine import Engine, EngineLimits
    from .kvcache import KVStore
    from .tokens import TemplateFormat, render_prompt

    if new_tokens < 2:
        raise ValueError("the overhead benchmark needs at least 2 new tokens to time decoding")
    fmt = TemplateFormat(loaded.tokenizer)
    prompts = [render_prompt(fmt, "You are a helpful assistant.", [("user", q)]) for q in OVERHEAD_PROMPTS]
    engine = Engine(loaded.model, loaded.device, KVStore(0, 1),
                    EngineLimits(max_new_tokens=new_tokens, kv_reuse=False), loaded.kv_bytes_per_token)
    runs = {"engine": [], "bare": []}
    try:
        _engine_decode(engine, prompts[0], new_tokens)  # warm-up, not counted
        _bare_decode(loaded, prompts[0], new_tokens)
        for r in range(repeats):
            for i, ids in enumerate(prompts):
                order = ("engine", "bare") if (r + i) % 2 == 0 else ("bare", "engine")
                for which in order:
                    tok_s, ttft_s, n = (_engine_decode(engine, ids, new_tokens) if which == "engine"
                                        else _bare_decode(loaded, ids, new_tokens))
                    runs[which].append({"prompt": i, "tok_s": tok_s, "ttft_s": ttft_s, "tokens": n})
    finally:
        engine.close()
    med = {k: statistics.median(x["tok_s"] for x in v) for k, v in runs.items()}
    pairs = [a["tok_s"] / max(b["tok_s"], 1e-9) for a, b in zip(runs["engine"], runs["bare"])]
    ratio = med["engine"] / max(med["bare"], 1e-9)
    return {"new_tokens": new_tokens, "repeats": repeats, "prompts": len(prompts), "runs_per_side": len(pairs),
            "engine_tok_s": round(med["engine"], 2), "bare_tok_s": round(med["bare"], 2),
            "engine_ttft_s": round(statistics.median(x["ttft_s"] for x in runs["engine"]), 4),
            "bare_ttft_s": round(statistics.median(x["ttft_s"] for x in runs["bare"]), 4),
            "ratio": round(ratio, 3), "pair_ratio_median": round(statistics.median(pairs), 3),
            "pair_ratio_min": round(min(pairs), 3), "pair_ratio_max": round(max(pairs), 3),
            "same_token_count": all(x["tokens"] == new_tokens for v in runs.values() for x in v),
            "target": 0.9, "meets_target": ratio >= 0.9,
            "engine_runs_tok_s": [round(x["tok_s"], 2) for x in runs["engine"]],
            "bare_runs_tok_s": [round(x["tok_s"], 2) for x in runs["bare"]]}


def overhead_markdown(r: dict) -> str:
    return "\n".join([
        f"## Engine overhead ({r['new_tokens']} new tokens, {r['prompts']} prompts x {r['repeats']} repeats, "
        "interleaved A/B, greedy, no stop)", "",
        "| | decode tok/s (median) | TTFT (s, median) |", "|---|---:|---:|",
        f"| our Engine | {r['engine_tok_s']:.2f} | {r['engine_ttft_s']:.3f} |",
        f"| bare `model.generate` | {r['bare_tok_s']:.2f} | {r['bare_ttft_s']:.3f} |", "",
        f"Ratio ours / bare: **{r['ratio']:.2f}** (target >= {r['target']}: "
        f"{'met' if r['meets_target'] else 'NOT met'}); per-pair ratios median {r['pair_ratio_median']:.2f}, "
        f"range {r['pair_ratio_min']:.2f}-{r['pair_ratio_max']:.2f}. "
        f"Same token count on both sides: {'yes' if r['same_token_count'] else 'no'}.", ""])


# ---- 3) memory over a long replay

def live_tensors() -> tuple[int, int]:
    """(live torch tensors, of which held by live DynamicCaches), after a full collection.

    Types are tested with `type()`, not `isinstance()`: some torch objects warn when their
    `__class__` is read.
    """
    import torch
    from transformers import DynamicCache

    gc.collect()
    tensors = in_caches = 0
    for o in gc.get_objects():
        kind = type(o)
        if issubclass(kind, torch.Tensor):
            tensors += 1
        elif issubclass(kind, DynamicCache):
            for layer in getattr(o, "layers", ()):
                in_caches += sum(issubclass(type(getattr(layer, n, None)), torch.Tensor) for n in ("keys", "values"))
    return tensors, in_caches


def memory_replay(settings, loaded, turns: int = 200, warmup: int = 10, context: int = 1024,
                  max_new_tokens: int = 16, progress: Callable[[str], None] = log.info) -> dict:
    """Run warmup + turns through the chat path; measure memory growth the KV store does not explain.

    The warm-up lasts `warmup` turns and at least until the first fold into the summary (at most
    FOLD_WAIT more turns); then `turns` turns are measured.

    `settings.data_dir` should be a scratch folder: the chat is stored there (and deleted after).
    """
    from .chat import Finished
    from .runtime import Runtime

    s = settings.replace(context_limit=context, max_new_tokens=max_new_tokens, sample_docs=False,
                         summary_tokens=min(settings.summary_tokens, 48))
    runtime = Runtime(s, loaded=loaded).start(background=False)
    device = loaded.device
    texts = scripted_turns(warmup + turns + FOLD_WAIT)
    series: list[dict] = []
    ends: dict[str, dict] = {}
    start_turn, folded = None, False
    t0 = time.perf_counter()
    try:
        chat = runtime.wait_ready()
        conv = runtime.store.create_conversation("bench memory replay")

        def endpoint() -> dict:
            release_memory(device)
            tensors, in_caches = live_tensors()
            return {"mem_bytes": private_bytes(device)[0], "kv_store_bytes": runtime.engine.kv.total_bytes,
                    "tensors": tensors, "tensors_in_kv": in_caches, "tensors_outside_kv": tensors - in_caches}

        for i, text in enumerate(texts):
            # Measure from the end of the warm-up, but not before the first fold: folding loads
            # one-off things (the recall index and its embedder) that are not a leak.
            if start_turn is None and i >= warmup and (folded or i >= warmup + FOLD_WAIT):
                ends["start"], start_turn = endpoint(), i
            if start_turn is not None and i - start_turn >= turns:
                break
            for ev in chat.send(conv, text, use_docs=False, wait_summary=True):
                if isinstance(ev, Finished):
                    folded = folded or ev.stats.summarized_turns > 0
                    series.append({"turn": i + 1, "mem_bytes": private_bytes(device)[0],
                                   "kv_store_bytes": runtime.engine.kv.total_bytes,
                                   "summarized_turns": ev.stats.summarized_turns,
                                   "prompt_tokens": ev.stats.gen.prompt_tokens})
            if (i + 1) % 50 == 0:
                progress(f"memory replay: turn {i + 1}")
        if start_turn is None:
            ends["start"], start_turn = endpoint(), len(series)
        ends["end"] = endpoint()
        chat.delete(conv)
    finally:
        runtime.close()
    a, b = ends["start"], ends["end"]
    growth = b["mem_bytes"] - a["mem_bytes"]
    kv_growth = b["kv_store_bytes"] - a["kv_store_bytes"]
    measured = series[start_turn:]
    xs, ys = [x["turn"] for x in measured], [x["mem_bytes"] - x["kv_store_bytes"] for x in measured]
    half = len(xs) // 2
    slope, slope_first, slope_second = _slope(xs, ys), _slope(xs[:half], ys[:half]), _slope(xs[half:], ys[half:])
    unexplained = growth - kv_growth
    tensor_growth = b["tensors_outside_kv"] - a["tensors_outside_kv"]
    return {"turns": len(measured), "warmup_turns": start_turn, "context_limit": runtime.budget.context_limit,
            "max_new_tokens": runtime.budget.max_new_tokens, "summary_tokens": s.summary_tokens,
            "measure": private_bytes(device)[1] + (" (after gc + malloc_trim at both ends)" if loaded.on_cpu else ""),
            "start": a, "end": b, "mem_growth_bytes": growth, "kv_growth_bytes": kv_growth,
            "unexplained_growth_bytes": unexplained, "slope_bytes_per_turn": round(slope, 1),
            "slope_first_half_bytes_per_turn": round(slope_first, 1),
            "slope_second_half_bytes_per_turn": round(slope_second, 1),
            "tensor_growth": tensor_growth, "folded_turns": max((x["summarized_turns"] for x in series), default=0),
            "mem_min_bytes": min((x["mem_bytes"] for x in measured), default=0),
            "mem_max_bytes": max((x["mem_bytes"] for x in measured), default=0),
            "leak_threshold_bytes": LEAK_THRESHOLD_BYTES,
            "leak_suspected": unexplained > LEAK_THRESHOLD_BYTES or tensor_growth > LEAK_TENSOR_SLACK,
            "seconds": round(time.perf_counter() - t0, 1)}


FOLD_WAIT = 50  # extra warm-up turns allowed for the first fold into the summary
# The live-tensor count is exact; memory figures are not. On CPU, anonymous RSS moves by +-20 MiB
# between otherwise equal runs (allocator arenas, caches that fill up to their bound), so the byte
# threshold only catches leaks of a KV-cache's size; smaller ones show in the per-turn trend.
LEAK_THRESHOLD_BYTES = 64 * 2**20
LEAK_TENSOR_SLACK = 8


def _slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys over xs (0 for fewer than 2 points)."""
    if len(xs) < 2:
        return 0.0
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den if den else 0.0


def memory_markdown(r: dict) -> str:
    mib = lambda n: f"{n / 2**20:,.1f}"  # noqa: E731
    a, b = r["start"], r["end"]
    return "\n".join([
        f"## Memory over a {r['turns']}-turn replay (after {r['warmup_turns']} warm-up turns; context "
        f"{r['context_limit']}, replies {r['max_new_tokens']} tokens, {r['folded_turns']} turns folded into the summary)",
        "",
        "| | after warm-up | at the end | growth |", "|---|---:|---:|---:|",
        f"| {r['measure']} (MiB) | {mib(a['mem_bytes'])} | {mib(b['mem_bytes'])} | {mib(r['mem_growth_bytes'])} |",
        f"| KV store (MiB) | {mib(a['kv_store_bytes'])} | {mib(b['kv_store_bytes'])} | {mib(r['kv_growth_bytes'])} |",
        f"| growth the KV store does not explain (MiB) | | | **{mib(r['unexplained_growth_bytes'])}** |",
        f"| live tensors outside KV caches | {a['tensors_outside_kv']} | {b['tensors_outside_kv']} "
        f"| {r['tensor_growth']:+d} |", "",
        f"Per-turn trend of (memory - KV store): {r['slope_bytes_per_turn'] / 1024:+.1f} KiB/turn "
        f"(first half {r['slope_first_half_bytes_per_turn'] / 1024:+.1f}, second half "
        f"{r['slope_second_half_bytes_per_turn'] / 1024:+.1f}: a bounded cache filling up levels off, a leak "
        f"does not; range over the turns {mib(r['mem_min_bytes'])}-{mib(r['mem_max_bytes'])} MiB). "
        f"Leak suspected: **{'yes' if r['leak_suspected'] else 'no'}** (threshold: > {mib(r['leak_threshold_bytes'])} "
        f"MiB unexplained or > {LEAK_TENSOR_SLACK} more live tensors). {r['seconds']:.0f} s.", ""])


# ---- the suite

def suite(settings, *, turns: int = 40, ttft_new_tokens: int = 32, chunks: int = 2000, replay_turns: int = 200,
          warmup_turns: int = 10, replay_context: int = 1024, replay_new_tokens: int = 16,
          overhead_tokens: int = 32, overhead_repeats: int = 3, loaded=None,
          progress: Callable[[str], None] = log.info) -> dict:
    """All benchmarks on one loaded model; chats run in a temporary data dir."""
    from . import bench_retrieval, models
    from .context import Budget
    from .runtime import Runtime

    t_all = time.perf_counter()
    loaded = loaded or models.load(settings, progress=progress)
    seconds: dict[str, float] = {}
    out: dict = {"bench": "suite"}
    with tempfile.TemporaryDirectory(prefix="llmweb-bench-") as tmp:
        scratch = settings.replace(data_dir=Path(tmp), cache_dir=settings.models_dir, sample_docs=False)

        progress(f"bench: engine overhead ({overhead_tokens} tokens, {overhead_repeats} repeats)…")
        t0 = time.perf_counter()
        out["overhead"] = engine_overhead(loaded, overhead_tokens, overhead_repeats)
        seconds["overhead"] = time.perf_counter() - t0

        progress(f"bench: TTFT over {turns} turns, with and without KV reuse…")
        t0 = time.perf_counter()
        runtime = Runtime(scratch.replace(max_new_tokens=ttft_new_tokens), loaded=loaded).start(background=False)
        try:
            out["ttft"] = ttft(runtime, turns)
        finally:
            runtime.close()
        seconds["ttft"] = time.perf_counter() - t0

        progress(f"bench: memory over {warmup_turns} + {replay_turns} turns…")
        t0 = time.perf_counter()
        out["memory"] = memory_replay(scratch, loaded, replay_turns, warmup_turns, replay_context,
                                      replay_new_tokens, progress=progress)
        seconds["memory"] = time.perf_counter() - t0

        progress(f"bench: retrieval at {chunks} chunks…")
        t0 = time.perf_counter()
        out["retrieval"] = bench_retrieval.run(scratch, n_chunks=chunks)
        out["retrieval"]["requested_chunks"] = chunks
        seconds["retrieval"] = time.perf_counter() - t0

    ttft_settings = settings.replace(max_new_tokens=ttft_new_tokens)  # the app's settings as the TTFT runs used them
    out["environment"] = describe_setup(ttft_settings, loaded, Budget.from_settings(ttft_settings, loaded.max_context,
                                                                                   loaded.on_cpu))
    out["seconds"] = {k: round(v, 1) for k, v in seconds.items()}
    out["total_s"] = round(time.perf_counter() - t_all, 1)
    return out


def environment_markdown(env: dict) -> str:
    rows = [("model", f"{env['model']} ({env['quant']}, {env['weights_mib']:.0f} MiB weights)"),
            ("device", env["device"] + (f" ({env['gpu']}, {env['gpu_mem_gib']} GiB)" if "gpu" in env else "")),
            ("CPU", f"{env['cpu']} · {env['cpus']} cores · torch threads {env['torch_threads']} · "
                    f"{env['ram_gib']} GiB RAM"),
            ("software", f"Python {env['python']} · torch {env['torch']} · transformers {env['transformers']} · "
                         f"bitsandbytes {env['bitsandbytes']}"),
            ("settings (TTFT runs)",
             f"context {env['context_limit']} · max new tokens {env['max_new_tokens']} · "
             f"KV reuse {'on' if env['kv_reuse'] else 'off'} · KV budget {env['kv_budget_mib']:,.0f} MiB · "
             + (f"memory limit {env['mem_limit_mib']:,.0f} MiB" if "mem_limit_mib" in env
                else f"memory margin {env['mem_margin_mib']} MiB")),
            ("KV bytes per token", f"{env['kv_bytes_per_token']:,}"),
            ("run at", env["time"])]
    rows += [("note", n) for n in env.get("notes", [])]
    return "\n".join(["## Environment", "", "| | |", "|---|---|", *[f"| {k} | {v} |" for k, v in rows], ""])


def suite_markdown(r: dict) -> str:
    from . import bench_retrieval

    ret = r["retrieval"]
    secs = " · ".join(f"{k} {v:.0f} s" for k, v in r["seconds"].items())
    return "\n".join([
        "# llmweb benchmark suite", "",
        environment_markdown(r["environment"]),
        overhead_markdown(r["overhead"]),
        ttft_markdown(r["ttft"]),
        memory_markdown(r["memory"]),
        f"## Retrieval ({ret['requested_chunks']} chunks requested, the suite's smaller corpus; "
        "`bench retrieval` runs 10,000)", "",
        bench_retrieval.format_markdown(ret), "",
        f"Wall time: {r['total_s']:.0f} s ({secs}).", ""])


def write_reports(result: dict, markdown: str, data_dir: Path, stem: str = "bench") -> dict[str, Path]:
    folder = Path(data_dir) / "reports"
    folder.mkdir(parents=True, exist_ok=True)
    base = folder / f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}"
    md, js = base.with_suffix(".md"), base.with_suffix(".json")
    md.write_text(markdown, encoding="utf-8")
    js.write_text(json.dumps(result, indent=2), encoding="utf-8")
    return {"md": md, "json": js}


# ---- the command

def add_parser(sub) -> None:
    b = sub.add_parser("bench", help="benchmarks: all (the default suite) | ttft | retrieval | quant | fidelity")
    b.add_argument("which", nargs="?", default="all", choices=["all", "ttft", "retrieval", "quant", "fidelity"])
    b.add_argument("--turns", type=int, default=40, help="TTFT: turns of the scripted chat")
    b.add_argument("--chunks", type=int, default=None,
                   help="retrieval: corpus size in chunks (default 10000 for `bench retrieval`, 2000 in the suite)")
    b.add_argument("--max-new-tokens", type=int, default=None,
                   help="TTFT: reply length per turn (default 48 for `bench ttft`, 32 in the suite)")
    b.add_argument("--replay-turns", type=int, default=200, help="suite: measured turns of the memory replay")
    b.add_argument("--warmup-turns", type=int, default=10,
                   help="suite: replay turns before memory is measured (at least until the first fold)")
    b.add_argument("--replay-context", type=int, default=1024, help="suite: context limit of the memory replay")
    b.add_argument("--replay-new-tokens", type=int, default=16, help="suite: reply length in the memory replay")
    b.add_argument("--overhead-tokens", type=int, default=32, help="suite: new tokens per engine-overhead run")
    b.add_argument("--repeats", type=int, default=3, help="suite: A/B repeats of the engine-overhead runs")
    b.add_argument("--fillers", type=int, default=12, help="fidelity: filler turns before each checkpoint")
    b.add_argument("--checkpoints", type=int, default=3, help="fidelity: times each planted fact is asked about")
    b.add_argument("--json", action="store_true")
    b.set_defaults(func=main)


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def main(args) -> int:
    from .config import Settings

    if args.which == "all":
        settings = Settings.from_env()
        result = suite(settings, turns=args.turns, ttft_new_tokens=args.max_new_tokens or 32,
                       chunks=args.chunks or 2000, replay_turns=args.replay_turns, warmup_turns=args.warmup_turns,
                       replay_context=args.replay_context, replay_new_tokens=args.replay_new_tokens,
                       overhead_tokens=args.overhead_tokens, overhead_repeats=args.repeats, progress=_stderr)
        md = suite_markdown(result)
        paths = write_reports(result, md, settings.data_dir)
        if args.json:
            print(json.dumps({**result, "files": {k: str(p) for k, p in paths.items()}}, indent=2))
        else:
            print(md)
            for kind, p in paths.items():
                print(f"{kind}: {p}")
        return 0
    if args.which == "retrieval":
        from . import bench_retrieval

        result = bench_retrieval.run(Settings.from_env(), n_chunks=args.chunks or 10_000)
        print(json.dumps(result, indent=2) if args.json else bench_retrieval.format_markdown(result))
        return 0
    if args.which == "fidelity":
        from . import bench_fidelity

        # a small context by default, so the planted facts leave the window within the run
        settings = Settings.from_env(max_new_tokens=args.max_new_tokens or 32)
        if not settings.context_limit:
            settings = settings.replace(context_limit=512)
        result = bench_fidelity.run(settings, fillers_between=args.fillers, checkpoints=args.checkpoints,
                                    progress=_stderr)
        print(json.dumps(result, indent=2) if args.json else bench_fidelity.format_markdown(result))
        return 0
    if args.which == "quant":
        result = quant(Settings.from_env())
        print(json.dumps(result, indent=2) if args.json else quant_markdown(result))
        return 0
    from .runtime import Runtime

    settings = Settings.from_env(max_new_tokens=args.max_new_tokens or 48)
    runtime = Runtime(settings).start(background=False)
    try:
        result = ttft(runtime, args.turns)
    finally:
        runtime.close()
    print(json.dumps(result, indent=2) if args.json else ttft_markdown(result))
    return 0
