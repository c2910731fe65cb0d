"""Capacity: predicted vs measured peak memory per (context, concurrency), on ONE engine.

`python -m llmweb capacity --context 512,1024,2048 --concurrency 1,2,4`

For each combination, `concurrency` sessions each submit a real prompt (the chat template
around filler text, `context - max_new_tokens` tokens, checked with the format) to a single
`Engine`, all at once, with session ids so every session's KV cache stays resident afterwards.
That is what concurrency costs here: the app's one worker runs up to `max_batch` requests
(LLMWEB_MAX_BATCH; 4 on CPU, 8 on GPU) in each decode step, so that many hold their KV and
activations at once, the rest wait in the queue, and every session's KV cache stays in memory
between turns.

Per combination we record
  - the prediction from the model config: weights + KV (`kv_bytes_per_token` x (prompt +
    max_new_tokens) x sessions) + the engine's activation margin for each request of the batch
    (`engine.predict_bytes`: a margin on its KV, a floor and one prefill chunk's attention
    scores; min(sessions, max_batch) requests), as admission control computes it;
  - the measured peak: CUDA `max_memory_allocated` (and the engine's per-request peaks); CPU
    the process peak RSS (Linux VmHWM, reset before each batch; a sampling thread elsewhere),
    and the growth over the baseline taken just before the batch with all caches freed;
  - whether it fits the device: CUDA total memory minus `LLMWEB_MEM_MARGIN_MB`; CPU the
    admission limit (`LLMWEB_MEM_LIMIT_MB`, default 80% of RAM);
  - the measured aggregate tok/s (all generated tokens / the combination's wall time) and the
    TTFT p95 a user sees (queue wait + time to the first token).

`run()` returns plain dicts; `markdown()`, `write_csv()` and `plot()` render them; the CLI
writes CSV + PNG (+ the Markdown) under `settings.data_dir / "reports"` and prints the paths.
The engine is built here from `EngineLimits` (its public constructor) around a KV store of our
own, which we clear between combinations; the engine itself is only read (resident bytes,
evictions). Nothing heavy happens at import time.
"""

from __future__ import annotations

import csv
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from llmweb.config import Settings
from llmweb.engine.telemetry import PeakMeter, current_bytes, release_memory
from llmweb.errors import ConfigError, LlmwebError

from .common import SYSTEM, report_stem
from .concurrency import percentile

log = logging.getLogger(__name__)

BATCH_NOTE = (
    "Concurrency runs through the one worker, up to max_batch requests per decode step: the "
    "figures show the batch's KV and activations, queueing beyond it, and resident KV caches "
    "(one per session)."
)

COLUMNS = [
    "context",
    "concurrency",
    "prompt_tokens",
    "kv_tokens_per_session",
    "completed",
    "refused",
    "evicted",
    "predicted_weights_bytes",
    "predicted_kv_bytes",
    "predicted_activation_bytes",
    "predicted_bytes",
    "predicted_growth_bytes",
    "measured_baseline_bytes",
    "measured_peak_bytes",
    "measured_growth_bytes",
    "resident_kv_bytes",
    "limit_bytes",
    "kv_budget_bytes",
    "fits",
    "max_queue_wait_s",
    "batch_s",
    "aggregate_tok_s",
    "ttft_p95_s",
]

_FILLER = (
    "The harbour town kept a long record of tides, ships and weather. Each morning the keeper "
    "wrote down the height of the water, the direction of the wind and the colour of the sky, "
    "and each evening he read the older pages to see whether the seasons repeated themselves. "
).split()


# ---- prompts


def filler_prompt(fmt, target_tokens: int, tag: str = "", system: str = SYSTEM) -> list[int]:
    """The longest real prompt (system + one user message of filler text) of at most `target_tokens`."""
    from llmweb.chat.tokens import render_prompt

    def ids_for(n_words: int) -> list[int]:
        words = [_FILLER[i % len(_FILLER)] for i in range(n_words)]
        text = (tag + " " if tag else "") + "Summarise these notes. " + " ".join(words)
        return render_prompt(fmt, system, [("user", text)])

    lo, hi = 0, max(target_tokens, 1)  # a word is at least one token: hi words is always too many
    if len(ids_for(lo)) > target_tokens:
        raise ConfigError(
            f"a context of {target_tokens} prompt tokens is too small for the chat template "
            f"({len(ids_for(lo))} tokens with an empty message)"
        )
    while lo < hi:  # the largest word count whose prompt fits
        mid = (lo + hi + 1) // 2
        if len(ids_for(mid)) <= target_tokens:
            lo = mid
        else:
            hi = mid - 1
    ids = ids_for(lo)
    assert len(ids) <= target_tokens, f"prompt of {len(ids)} tokens over the target {target_tokens}"
    return ids


# ---- the measurement


def device_limit(settings: Settings, loaded) -> int:
    """CUDA: total device memory minus the margin; CPU: the admission limit (LLMWEB_MEM_LIMIT_MB)."""
    if loaded.on_cpu:
        from llmweb.runtime import cpu_mem_limit_bytes

        return cpu_mem_limit_bytes(settings)
    import torch

    total = torch.cuda.get_device_properties(loaded.device).total_memory
    return int(total - settings.mem_margin_mb * 2**20)


def predict(loaded, prompt_tokens: int, max_new_tokens: int, sessions: int, max_batch: int = 1) -> dict:
    """Weights + resident KV of every session + the activation margin of each request in the batch."""
    from llmweb.engine.admission import predict_bytes
    from llmweb.engine.blockcache import BLOCK, KEEP_ROOM

    if loaded.backend == "llama.cpp":
        # an idle session is its sequence's state copied to host memory; a running one, its cells in
        # the context's pool (allocated with the context, resident once written)
        per_session = per_request = loaded.kv_bytes_per_token * (prompt_tokens + max_new_tokens)
    else:
        heads = getattr(loaded.model.config, "num_attention_heads", 0) or 0
        per_session, per_request = predict_bytes(loaded.kv_bytes_per_token, heads, prompt_tokens, max_new_tokens)
        per_session += KEEP_ROOM * loaded.kv_bytes_per_token  # an idle cache's room for the next message (blockcache)
        per_request += BLOCK * loaded.kv_bytes_per_token  # a running cache's spare room, a block at most
    kv = per_session * sessions
    activation = per_request * min(sessions, max_batch)
    return {
        "predicted_weights_bytes": int(loaded.weights_bytes),
        "predicted_kv_bytes": int(kv),
        "predicted_activation_bytes": activation,
        "predicted_bytes": int(loaded.weights_bytes + kv + activation),
        "predicted_growth_bytes": int(kv + activation),
    }


def run(
    settings: Settings,
    contexts: Sequence[int],
    concurrencies: Sequence[int],
    max_new_tokens: int = 16,
    loaded=None,
    progress: Callable[[str], None] = log.info,
) -> dict:
    """Measure every (context, concurrency) combination on one engine; return rows and the setup."""
    from llmweb.chat.tokens import TemplateFormat
    from llmweb.engine import models
    from llmweb.engine.backends import make_engine
    from llmweb.engine.kvcache import KVStore
    from llmweb.engine.request import EngineLimits, GenerationRequest, auto_max_batch
    from llmweb.runtime import kv_budget_bytes

    contexts, concurrencies = sorted(set(contexts)), sorted(set(concurrencies))
    if not contexts or not concurrencies or min(contexts) < 1 or min(concurrencies) < 1:
        raise ConfigError("--context and --concurrency need positive integers, e.g. 512,1024 and 1,2")
    if max_new_tokens < 1:
        raise ConfigError("--max-new-tokens must be >= 1")
    loaded = loaded or models.load(settings, progress=progress)
    if max(contexts) > loaded.max_context:
        raise ConfigError(f"context {max(contexts)} is over the model's maximum of {loaded.max_context} tokens")
    for c in contexts:
        if c <= max_new_tokens:
            raise ConfigError(f"context {c} leaves no room for a prompt with --max-new-tokens {max_new_tokens}")
    fmt = TemplateFormat(loaded.tokenizer)
    limit = device_limit(settings, loaded)
    kv_budget = kv_budget_bytes(settings, loaded)
    # The store never evicts here: every session's cache must stay resident to be measured.
    # Admission control still runs, against the same limit as the app's.
    kv = KVStore(budget_bytes=1 << 62, ttl_s=24 * 3600)
    limits = EngineLimits(
        queue_size=max(concurrencies),
        max_new_tokens=max_new_tokens,
        request_timeout_s=max(settings.request_timeout_s, 600.0),
        admission_wait_s=2.0,
        mem_limit_bytes=limit if loaded.on_cpu else 0,
        mem_margin_bytes=settings.mem_margin_mb * 2**20,
        kv_reuse=True,
        max_batch=settings.max_batch or auto_max_batch(loaded.on_cpu),
    )
    engine = make_engine(loaded, kv, limits, context=max(contexts))
    rows: list[dict] = []
    method = ""
    t_all = time.perf_counter()
    try:
        # one warm-up request, so the first combination does not pay for one-off allocations
        engine.submit(GenerationRequest(filler_prompt(fmt, min(contexts) - max_new_tokens), max_new_tokens)).result()
        for context in contexts:
            prompts = [
                filler_prompt(fmt, context - max_new_tokens, tag=f"Session {i + 1}.") for i in range(max(concurrencies))
            ]
            for k in concurrencies:
                progress(f"capacity: context {context}, {k} session(s)…")
                row, method = _measure(engine, kv, loaded, prompts[:k], context, max_new_tokens, limit, kv_budget)
                rows.append(row)
    finally:
        kv.clear()
        engine.close()
    return {
        "bench": "capacity",
        "model": loaded.name,
        "quant": loaded.quant,
        "device": loaded.device,
        "weights_bytes": int(loaded.weights_bytes),
        "kv_bytes_per_token": loaded.kv_bytes_per_token,
        "max_new_tokens": max_new_tokens,
        "limit_bytes": limit,
        "kv_budget_bytes": kv_budget,
        "limit_source": (
            "CUDA total memory - LLMWEB_MEM_MARGIN_MB" if not loaded.on_cpu else "LLMWEB_MEM_LIMIT_MB (0 = 80% of RAM)"
        ),
        "measured": method,
        "max_batch": limits.max_batch,
        "note": BATCH_NOTE,
        "total_s": round(time.perf_counter() - t_all, 1),
        "rows": rows,
    }


def _measure(
    engine, kv, loaded, prompts: list[list[int]], context: int, max_new_tokens: int, limit: int, kv_budget: int
) -> tuple[dict, str]:
    """One batch: `prompts` submitted at once to `engine`, whose KV store `kv` (ours) starts empty."""
    from llmweb.engine.request import GenerationRequest

    kv.clear()
    release_memory(loaded.device)
    evictions = kv.evictions
    baseline = current_bytes(loaded.device)
    meter = PeakMeter(loaded.device).start()
    t0 = time.perf_counter()
    handles = [
        engine.submit(GenerationRequest(ids, max_new_tokens, session_id=f"capacity-{context}-{i}"))
        for i, ids in enumerate(prompts)
    ]  # all at once: they queue for the one worker
    completed, refused, stats = 0, 0, []
    for h in handles:
        try:
            h.result()
            completed += 1
            stats.append(h.stats)
        except LlmwebError as e:  # admission refusal or OOM: that is a finding, not a crash
            refused += 1
            log.warning("capacity: context %d: %s", context, e)
    batch_s = time.perf_counter() - t0
    peak = meter.stop()
    for s in stats:  # the engine's own per-request peaks (CUDA resets per request; RSS sampled per token)
        if s.mem is not None:
            peak = max(peak, s.mem.cuda_peak_bytes or 0, s.mem.peak_rss_bytes or 0)
    prompt_tokens = max(len(p) for p in prompts)
    pred = predict(loaded, prompt_tokens, max_new_tokens, len(prompts), engine.limits.max_batch)
    growth = max(peak - baseline, 0)
    evicted = kv.evictions - evictions  # admission evicts idle caches when memory is short
    device_peak_predicted = baseline + pred["predicted_growth_bytes"]
    row = {
        "context": context,
        "concurrency": len(prompts),
        "prompt_tokens": prompt_tokens,
        "kv_tokens_per_session": prompt_tokens + max_new_tokens,
        "completed": completed,
        "refused": refused,
        "evicted": evicted,
        **pred,
        "measured_baseline_bytes": int(baseline),
        "measured_peak_bytes": int(peak),
        "measured_growth_bytes": int(growth),
        "resident_kv_bytes": int(kv.total_bytes),
        "limit_bytes": int(limit),
        "kv_budget_bytes": int(kv_budget),
        "fits": bool(refused == 0 and evicted == 0 and max(device_peak_predicted, peak) <= limit),
        "max_queue_wait_s": round(max((s.queue_wait_s for s in stats), default=0.0), 3),
        "batch_s": round(batch_s, 3),
        "aggregate_tok_s": round(sum(s.generated_tokens for s in stats) / max(batch_s, 1e-9), 2),
        "ttft_p95_s": round(percentile([s.queue_wait_s + s.ttft_s for s in stats], 95), 3),
    }
    kv.clear()
    return row, meter.method


# ---- rendering


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f}"


def markdown(r: dict) -> str:
    cpu = not str(r["device"]).startswith("cuda")
    peak_name = "measured peak RSS" if cpu else "measured peak allocated"
    lines = [
        f"## Capacity ({r['model']}, {r['quant']}, {r['device']}, {r['max_new_tokens']} new tokens per request)",
        "",
        f"| context | sessions | prompt tokens | predicted MiB (weights + KV + act) | {peak_name} MiB "
        "| predicted growth MiB (KV + act) | measured growth MiB | resident KV MiB | max queue wait (s) "
        "| aggregate tok/s | TTFT p95 (s) | fits |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for x in r["rows"]:
        why = ([f"{x['refused']} refused"] if x["refused"] else []) + (
            [f"{x['evicted']} caches evicted"] if x["evicted"] else []
        )
        fits = "yes" if x["fits"] else "**no**" + (f" ({', '.join(why)})" if why else "")
        lines.append(
            f"| {x['context']} | {x['concurrency']} | {x['prompt_tokens']} | {_mib(x['predicted_bytes'])} "
            f"| {_mib(x['measured_peak_bytes'])} | {_mib(x['predicted_growth_bytes'])} "
            f"| {_mib(x['measured_growth_bytes'])} | {_mib(x['resident_kv_bytes'])} "
            f"| {x['max_queue_wait_s']:.2f} | {x['aggregate_tok_s']:.1f} | {x['ttft_p95_s']:.2f} | {fits} |"
        )
    lines += [
        "",
        f"- Limit: {_mib(r['limit_bytes'])} MiB ({r['limit_source']}); the app's KV budget for all sessions' "
        f"caches: {_mib(r['kv_budget_bytes'])} MiB (not applied here, so every cache stays resident).",
        f"- Prediction: weights {_mib(r['weights_bytes'])} MiB + {r['kv_bytes_per_token']:,} KV bytes/token x "
        "(prompt + new tokens) x sessions + the engine's activation margin for each request of the batch "
        f"(max_batch {r['max_batch']}).",
        "- Aggregate tok/s: all generated tokens / the combination's wall time; TTFT p95: queue wait + time to "
        "the first token.",
        f"- Measured: {r['measured']}; growth = peak minus the baseline just before the batch (caches freed)."
        + (" On CPU the peak RSS also holds the Python/torch runtime, so compare growth with growth." if cpu else ""),
        "- Fits: the larger of (baseline + predicted growth) and the measured peak is under the limit, "
        "and admission control neither refused a request nor evicted a session's cache.",
        f"- {r['note']}",
        "",
    ]
    return "\n".join(lines)


def write_csv(r: dict, path: Path) -> Path:
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        for row in r["rows"]:
            w.writerow({k: row[k] for k in COLUMNS})
    return path


def plot(r: dict, path: Path) -> Path:
    """Predicted vs measured per context, one line per concurrency: growth (left), peak vs limit (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, k in enumerate(sorted({x["concurrency"] for x in r["rows"]})):
        rows = sorted((x for x in r["rows"] if x["concurrency"] == k), key=lambda x: x["context"])
        ctx = [x["context"] for x in rows]
        c = colours[i % len(colours)]
        for ax, pred, meas in (
            (axes[0], "predicted_growth_bytes", "measured_growth_bytes"),
            (axes[1], "predicted_bytes", "measured_peak_bytes"),
        ):
            ax.plot(ctx, [x[pred] / 2**20 for x in rows], "--", color=c, marker="o", label=f"{k} session(s), predicted")
            ax.plot(ctx, [x[meas] / 2**20 for x in rows], "-", color=c, marker="s", label=f"{k} session(s), measured")
    cpu = not str(r["device"]).startswith("cuda")
    axes[0].set_title("Growth over the loaded model: KV + activations")
    axes[1].set_title("Peak: predicted (weights + KV + act) vs measured" + (" RSS" if cpu else " allocated"))
    axes[1].axhline(r["limit_bytes"] / 2**20, color="black", linewidth=1, linestyle=":", label="limit")
    for ax in axes:
        ax.set_xlabel("context (tokens per session)")
        ax.set_ylabel("MiB")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    if cpu:
        axes[1].set_yscale("log")
    fig.suptitle(
        f"llmweb capacity: {r['model']} ({r['quant']}, {r['device']})\n"
        f"one worker, up to {r['max_batch']} requests per decode step; the rest queue; every session's KV stays",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_reports(r: dict, data_dir: Path) -> dict[str, Path]:
    stem = report_stem(data_dir, "capacity")
    paths = {"csv": write_csv(r, stem.with_suffix(".csv")), "png": plot(r, stem.with_suffix(".png"))}
    md = stem.with_suffix(".md")
    md.write_text(markdown(r), encoding="utf-8")
    paths["md"] = md
    return paths
