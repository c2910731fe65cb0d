"""Concurrency: k chats at once, batched engine vs the serial one, side by side in one run.

`python -m llmweb bench concurrency [--concurrency 1,2,4,8] [--max-new-tokens 128] [--max-batch N] [--json]`

For each k, the same k prompts (one scripted user question each, the chat template around it,
different lengths) are submitted at once, from k owners, to two engines built here from
`EngineLimits` over the one loaded model: the serial engine (`max_batch=1`, one request at a
time, as before batching) and the batched one (`max_batch` = `--max-batch`, default the app's
LLMWEB_MAX_BATCH: 4 on CPU, 8 on GPU). No stop ids, so every reply is exactly
`max_new_tokens` long and both engines do the same work. Per (k, engine) we record
  - aggregate tok/s: all generated tokens / wall time from the submissions to the last token;
  - per-request tok/s: the mean of each request's own decode rate (first token to last);
  - TTFT p50 / p95 as a user sees it: queue wait + time to the first token;
  - the peak memory during the run (CUDA max allocated, or the process peak RSS) and its
    growth over the baseline just before it;
and the batched engine's ratios against the serial one at the same k.

On llama.cpp, the same run also measures llama.cpp's own `llama-batched-bench` (when it is on the
PATH, or LLMWEB_LLAMA_BATCHED_BENCH names it) on the same GGUF file, prompt length, reply length,
threads and batch chunk: k sequences at once against one, as llama.cpp alone batches them. Its
ratio is the bound of ours: a decode step of k sequences costs what llama.cpp's kernels make it
cost. Nothing heavy at import.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from llmweb.config import Settings
from llmweb.engine.telemetry import PeakMeter, current_bytes, release_memory
from llmweb.errors import ConfigError

from .common import llama_tool, prompt_ids, scripted_turns

log = logging.getLogger(__name__)


def run(
    settings: Settings,
    concurrencies: Sequence[int] = (1, 2, 4, 8),
    max_new_tokens: int = 128,
    max_batch: int = 0,
    loaded=None,
    progress: Callable[[str], None] = log.info,
) -> dict:
    """Measure every concurrency on the serial and the batched engine; return rows and the setup."""
    from llmweb.engine import models
    from llmweb.engine.request import auto_max_batch

    concurrencies = sorted(set(concurrencies))
    if not concurrencies or min(concurrencies) < 1:
        raise ConfigError("--concurrency needs positive integers, e.g. 1,2,4,8")
    if max_new_tokens < 1 or max_batch < 0:
        raise ConfigError("--max-new-tokens must be >= 1 and --max-batch >= 0")
    loaded = loaded or models.load(settings, progress=progress)
    batch = max_batch or settings.max_batch or auto_max_batch(loaded.on_cpu)
    prompts = [prompt_ids(loaded, text) for text in scripted_turns(max(concurrencies))]
    rows = []
    t_all = time.perf_counter()
    references: list[list[dict] | None] = []
    if loaded.backend == "llama.cpp":  # before ours and after it: the machine's drift hits both alike
        mean_prompt = round(sum(len(p) for p in prompts) / len(prompts))
        references.append(batched_bench(loaded.model, mean_prompt, max_new_tokens, concurrencies, progress))
    for k in concurrencies:
        for mode, size in (("serial", 1), ("batched", batch)):
            progress(f"concurrency: {k} chat(s), {mode} engine (max_batch={size})…")
            rows.append(
                {
                    "concurrency": k,
                    "engine": mode,
                    "max_batch": size,
                    **_measure(loaded, prompts[:k], max_new_tokens, size),
                }
            )
    for row in rows:
        serial = next(r for r in rows if r["concurrency"] == row["concurrency"] and r["engine"] == "serial")
        row["aggregate_vs_serial"] = round(row["aggregate_tok_s"] / max(serial["aggregate_tok_s"], 1e-9), 2)
        row["ttft_p95_vs_serial"] = round(row["ttft_p95_s"] / max(serial["ttft_p95_s"], 1e-9), 2)
    if references:
        references.append(batched_bench(loaded.model, mean_prompt, max_new_tokens, concurrencies, progress))
    reference = _mean_reference(references)
    for ref in reference or []:
        ours = next(r for r in rows if r["concurrency"] == ref["concurrency"] and r["engine"] == "batched")
        ref["ours_vs_serial"] = ours["aggregate_vs_serial"]
    return {
        "bench": "concurrency",
        "model": loaded.name,
        "quant": loaded.quant,
        "backend": loaded.backend,
        "device": loaded.device,
        "max_new_tokens": max_new_tokens,
        "max_batch": batch,
        "prompt_tokens": [len(p) for p in prompts],
        "total_s": round(time.perf_counter() - t_all, 1),
        "rows": rows,
        "llama_batched_bench": reference,
    }


def _mean_reference(runs: list[list[dict] | None]) -> list[dict] | None:
    """llama-batched-bench's rows, each figure the mean of the runs that ran; None when none did."""
    done = [r for r in runs if r]
    if not done:
        return None
    return [
        {
            key: (round(sum(r[i][key] for r in done) / len(done), 2) if key != "concurrency" else v)
            for key, v in row.items()
        }
        | {"runs": len(done)}
        for i, row in enumerate(done[0])
    ]


def batched_bench(model, prompt: int, new_tokens: int, concurrencies: Sequence[int], progress=log.info) -> list | None:
    """llama.cpp's `llama-batched-bench` on the model's GGUF file: k sequences of `prompt` tokens, each
    writing `new_tokens`, at once (`-npl`), a KV stream per sequence (no `-kvu`) with flash attention off and
    PREFILL_CHUNK-token batches, as our runner; a row per k. None when it is not installed.
      aggregate_vs_serial  k x (time for one sequence) / (time for k at once): the same figure as
                           ours (prefill included), for llama.cpp batching alone
      decode_vs_one        its decode tok/s at k over at 1 (prefill left out)"""
    import json
    import subprocess

    from llmweb.engine.runners.llama_cpp import PREFILL_CHUNK

    exe = llama_tool("llama-batched-bench")
    if not exe:
        return None
    ks = sorted(set(concurrencies) | {1})
    chunk = str(PREFILL_CHUNK)
    args = [exe, "-m", str(model.path), "-c", str(max(ks) * (prompt + new_tokens) + 256), "-b", chunk, "-ub", chunk]
    args += ["-npp", str(prompt), "-ntg", str(new_tokens), "-npl", ",".join(map(str, ks)), "-t", str(model.threads)]
    args += ["-fa", "off", "--output-format", "jsonl"]
    progress(f"concurrency: llama-batched-bench, {','.join(map(str, ks))} sequences at once…")
    done = subprocess.run(args, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        progress(f"concurrency: llama-batched-bench failed ({done.returncode}): {done.stderr[-300:]}")
        return None
    runs = {r["pl"]: r for r in (json.loads(line) for line in done.stdout.splitlines() if line.startswith("{"))}
    if 1 not in runs:
        progress("concurrency: llama-batched-bench printed no run of one sequence; no reference")
        return None
    one = runs[1]
    return [
        {
            "concurrency": k,
            "tokens_per_s": round(k * new_tokens / runs[k]["t"], 2),
            "aggregate_vs_serial": round(k * one["t"] / runs[k]["t"], 2),
            "decode_tok_s": round(runs[k]["speed_tg"], 2),
            "decode_vs_one": round(runs[k]["speed_tg"] / one["speed_tg"], 2),
        }
        for k in ks
        if k in runs and k in concurrencies
    ]


def _measure(loaded, prompts: list[list[int]], max_new_tokens: int, max_batch: int) -> dict:
    """All `prompts` at once on a fresh engine with this `max_batch`; its figures."""
    from llmweb.engine.backends import make_engine
    from llmweb.engine.kvcache import KVStore
    from llmweb.engine.request import EngineLimits, GenerationRequest

    limits = EngineLimits(
        queue_size=len(prompts),
        max_new_tokens=max_new_tokens,
        request_timeout_s=3600.0,
        kv_reuse=False,
        max_batch=max_batch,
    )
    engine = make_engine(loaded, KVStore(0, 1), limits)
    try:
        engine.submit(GenerationRequest(prompts[0], 4)).result()  # warm-up: one-off allocations
        release_memory(loaded.device)
        baseline = current_bytes(loaded.device)
        meter = PeakMeter(loaded.device).start()
        t0 = time.perf_counter()
        handles = [
            engine.submit(GenerationRequest(ids, max_new_tokens, owner=f"chat-{i}")) for i, ids in enumerate(prompts)
        ]
        for h in handles:
            h.result()
        wall = time.perf_counter() - t0
        peak = meter.stop()
    finally:
        engine.close()
    stats = [h.stats for h in handles if h.stats is not None]
    ttfts = [s.queue_wait_s + s.ttft_s for s in stats]
    tokens = sum(s.generated_tokens for s in stats)
    return {
        "completed": len(stats),
        "generated_tokens": tokens,
        "wall_s": round(wall, 2),
        "aggregate_tok_s": round(tokens / max(wall, 1e-9), 2),
        "per_request_tok_s": round(sum(s.decode_tok_s for s in stats) / max(len(stats), 1), 2),
        "ttft_p50_s": round(percentile(ttfts, 50), 3),
        "ttft_p95_s": round(percentile(ttfts, 95), 3),
        "largest_batch": max((s.batch_size for s in stats), default=0),
        "peak_bytes": int(peak),
        "peak_growth_bytes": int(max(peak - baseline, 0)),
        "peak_method": meter.method,
    }


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile with linear interpolation between the closest ranks (0 for no values)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def markdown(r: dict) -> str:
    lines = [
        f"## Concurrency ({r['model']}, {r['quant']}, {r['device']}, {r['max_new_tokens']} new tokens per chat, "
        f"batched engine max_batch={r['max_batch']})",
        "",
        "| chats | engine | aggregate tok/s | vs serial | per-request tok/s | TTFT p50 (s) | TTFT p95 (s) "
        "| largest batch | peak MiB | growth MiB | wall (s) |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for x in r["rows"]:
        lines.append(
            f"| {x['concurrency']} | {x['engine']} | {x['aggregate_tok_s']:.1f} | {x['aggregate_vs_serial']:.2f}x "
            f"| {x['per_request_tok_s']:.1f} | {x['ttft_p50_s']:.2f} | {x['ttft_p95_s']:.2f} | {x['largest_batch']} "
            f"| {x['peak_bytes'] / 2**20:,.0f} | {x['peak_growth_bytes'] / 2**20:,.0f} | {x['wall_s']:.1f} |"
        )
    lines += [
        "",
        f"- Prompts: {', '.join(map(str, r['prompt_tokens']))} tokens (the first k for k chats), submitted at once "
        "from k owners; no stop ids, so every reply is exactly the same length.",
        "- Aggregate: all generated tokens / wall time from the submissions to the last token (prefills included). "
        "TTFT: queue wait + time to the first token, as the user sees it.",
        f"- Peak: {r['rows'][0]['peak_method'] if r['rows'] else ''}; growth over the baseline just before the run.",
        f"- Total run time {r['total_s']:.0f} s.",
        "",
    ]
    return "\n".join(lines + _reference_lines(r))


def _reference_lines(r: dict) -> list[str]:
    ref = r.get("llama_batched_bench")
    if not ref:
        if r.get("backend") != "llama.cpp":
            return []
        return ["llama-batched-bench is not on the PATH (or LLMWEB_LLAMA_BATCHED_BENCH): no llama.cpp reference.", ""]
    lines = [
        f"### Against llama.cpp's own batching (`llama-batched-bench`, same file, prompt, reply length and threads; "
        f"mean of {ref[0]['runs']} runs, before and after ours)",
        "",
        "| chats | llama.cpp tok/s | llama.cpp vs one at a time | ours vs serial | llama.cpp decode at k vs at 1 |",
        "|---:|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {x['concurrency']} | {x['tokens_per_s']:.1f} | {x['aggregate_vs_serial']:.2f}x "
        f"| {x['ours_vs_serial']:.2f}x | {x['decode_vs_one']:.2f}x |"
        for x in ref
    ]
    lines += [
        "",
        "llama.cpp's tok/s counts the generated tokens over its prefill and decode time, like ours. Its batch "
        "of k costs what its kernels make a step of k rows cost; ours cannot batch better than that.",
        "",
    ]
    return lines
