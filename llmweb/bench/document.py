"""`python -m llmweb bench document`: a whole-document task on a text several contexts long.

The text is the bundled guide (data/sample/llmweb-guide.md) `parts` times over, each copy under a
"# Part k" heading (generated at run time, nothing bundled). One visitor uploads it and asks
"Summarise long-guide.md" twice: the first run reads every piece through the model, the second
reads them from the cache (only the fold and the final step run again). Then another visitor's
short turn is timed on the idle server and again while the first visitor's outline of the same
document reads it (each step a background request: the turn should not wait for the task).

`run()` builds a Runtime of its own in a scratch data dir that is removed afterwards; the figures
per run are chat/document_plan.py's `DocumentStats`, and the turn's own TTFT and total beside the
same times measured from outside the chat.

The reference, in the same run: `llama-bench -p 512 -n 0` (LLMWEB_LLAMA_BENCH or the PATH) on the
GGUF file as it ships (not the copy LLMWEB_GGUF_REQUANT may serve), on the same threads, once
before the cold run and once after the cached one (the mean of the two). The ratio is the cold
task's tokens read over its wall time (from outside), divided by that prefill rate: what share of
llama.cpp's own prefill of the shipped file a whole-document task reads at.
"""

from __future__ import annotations

import tempfile
import threading
import time
from pathlib import Path

from .common import scratch_settings

READER, VISITOR = "anon:bench-reader", "anon:bench-visitor"
NAME = "long-guide.md"
PROBE = "What colour is the sky on a clear day?"
SAMPLE = Path(__file__).resolve().parents[2] / "data" / "sample" / "llmweb-guide.md"
REFERENCE_PROMPT = 512  # llama-bench -p: the prefill rate the task's read rate is set against
PAUSE_S = 1.0  # before llama-bench: the engine's kept thread pool stops polling for work first


def long_text(parts: int) -> str:
    """The guide `parts` times over, each copy under its own top heading."""
    guide = SAMPLE.read_text(encoding="utf-8")
    return "\n\n".join(f"# Part {k}\n\n{guide}" for k in range(1, parts + 1))


def run(settings, loaded=None, parts: int = 4, piece_tokens: int = 48, progress=print, bench_repeats: int = 3) -> dict:
    """Summarise cold and from the cache, then a visitor's turn idle and during a task; the figures,
    and llama-bench's prefill of the shipped file around the two runs (`bench_repeats` each time)."""
    from llmweb.chat.turn import Finished, finish
    from llmweb.runtime import Runtime

    shipped = _shipped_file(settings)
    with tempfile.TemporaryDirectory(prefix="llmweb-document-") as root:
        path = Path(root) / NAME
        path.write_text(long_text(parts), encoding="utf-8")
        rt = Runtime(scratch_settings(settings, Path(root) / "data"), loaded=loaded).start(background=False)
        try:
            chat = rt.wait_ready()
            model = rt.loaded  # what the engine serves (its encoding, its weights)
            chat.documents.note_tokens = piece_tokens
            rt.library.ingest_uploads(READER, [(path, NAME)])
            reference = [_llama_bench_prefill(shipped, settings, bench_repeats, progress)]
            runs = []
            for label, text in (("cold", f"Summarise {NAME}"), ("cached", f"Summarise {NAME}")):
                fin, outside = _timed(chat.send(READER, None, text, seed=0))
                stats = fin.document
                assert stats is not None, f"{text!r} was not read as a whole-document task"
                mem = fin.stats.gen.mem
                reported = {
                    "turn_ttft_s": round(fin.stats.gen.ttft_s, 2),
                    "turn_total_s": round(fin.stats.gen.total_s, 2),
                    "rss_mib": round(mem.rss_bytes / 2**20, 1) if mem is not None and mem.rss_bytes else None,
                }
                runs.append({"run": label, **stats.to_dict(), **reported, **outside})
                progress(f"document: {label}: {stats.describe()}")
            reference.append(_llama_bench_prefill(shipped, settings, bench_repeats, progress))
            idle = _probe(chat)
            box: dict = {}

            def outline() -> None:
                box["fin"] = finish(chat.send(READER, None, f"Outline {NAME}", seed=0))

            served = chat.engine.counters.served
            task = threading.Thread(target=outline, daemon=True)
            task.start()
            deadline = time.monotonic() + 120
            while chat.engine.counters.served == served and time.monotonic() < deadline:  # a step of it ran
                time.sleep(0.1)
            during = _probe(chat)
            task.join()
            done = box.get("fin")
            if isinstance(done, Finished) and done.document is not None:
                runs.append({"run": "outline, with a visitor", **done.document.to_dict()})
        finally:
            rt.close()
    return {
        "bench": "document",
        "parts": parts,
        "document_chars": len(long_text(parts)),
        "context_limit": chat.budget.context_limit,
        "piece_tokens": piece_tokens,
        "served": model.quant if model is not None else None,
        "weights_mib": round(model.weights_bytes / 2**20, 1) if model is not None else None,
        "runs": runs,
        "visitor_idle": idle,
        "visitor_during_task": during,
        "prefill": prefill_figures(runs[0], reference, shipped),
    }


def _shipped_file(settings) -> Path | None:
    """The configured GGUF file as it ships (llama-bench's reference), or None: not a GGUF model."""
    if settings.engine_url:
        return None
    from llmweb.engine import models

    source = models.gguf_file(settings)
    return source[0] if source is not None else None


def _llama_bench_prefill(gguf: Path | None, settings, repeats: int, progress) -> float | None:
    """`llama-bench -p 512 -n 0` on `gguf`, on the threads the engine uses: its prefill tok/s, or None
    (no GGUF file, no llama-bench, or it failed: said through `progress`)."""
    from llmweb.engine import gguf as gguf_mod

    from .common import llama_bench_tests, llama_tool

    if gguf is None or not llama_tool("llama-bench"):
        progress("bench document: no llama-bench (LLMWEB_LLAMA_BENCH) or no GGUF file, so no ratio")
        return None
    time.sleep(PAUSE_S)
    threads = settings.threads or gguf_mod.default_threads()
    progress(f"bench document: llama-bench -p {REFERENCE_PROMPT} on {gguf.name}, {threads} threads…")
    args = ["-p", str(REFERENCE_PROMPT), "-n", "0", "-t", str(threads), "-r", str(max(repeats, 1))]
    tests = llama_bench_tests(gguf, args, progress, "document") or []
    rates = [float(t["avg_ts"]) for t in tests if t.get("n_prompt") == REFERENCE_PROMPT]
    return round(rates[0], 1) if rates else None


def prefill_figures(cold: dict, reference: list[float | None], shipped: Path | None) -> dict:
    """The cold task's read rate (tokens read / its wall time from outside) and its ratio to the mean
    of llama-bench's prefill rates of the shipped file (None where llama-bench did not run)."""
    read_tok_s = cold["tokens_read"] / cold["outside_total_s"] if cold["outside_total_s"] else 0.0
    rates = [r for r in reference if r]
    bench = sum(rates) / len(rates) if rates else None
    return {
        "task_read_tok_s": round(read_tok_s, 1),
        "llama_bench_file": shipped.name if shipped is not None else None,
        "llama_bench_prompt": REFERENCE_PROMPT,
        "llama_bench_tok_s": round(bench, 1) if bench else None,
        "llama_bench_runs": reference,
        "ratio": round(read_tok_s / bench, 2) if bench else None,
    }


def _timed(events) -> tuple:
    """(the Finished, {"outside_ttft_s", "outside_total_s"}): the turn timed from outside the chat,
    to its first text (Delta) and to its end, as the person who asked waited."""
    from llmweb.chat.turn import Delta, Finished

    t0, first, fin = time.monotonic(), None, None
    for event in events:
        if isinstance(event, Delta) and first is None:
            first = time.monotonic() - t0
        if isinstance(event, Finished):
            fin = event
    total = time.monotonic() - t0
    assert fin is not None, "the turn ended without a Finished event"
    return fin, {"outside_ttft_s": round(first if first is not None else total, 2), "outside_total_s": round(total, 2)}


def _probe(chat) -> dict:
    """Another visitor's short turn: its time, first token, decode speed and the batch it shared."""
    t0 = time.monotonic()
    gen = chat.ask(VISITOR, None, PROBE, use_docs=False, seed=0).stats.gen
    return {
        "seconds": round(time.monotonic() - t0, 2),
        "ttft_s": round(gen.queue_wait_s + gen.ttft_s, 2),
        "decode_tok_s": round(gen.decode_tok_s, 1),
        "tokens": gen.generated_tokens,
        "batch_size": gen.batch_size,
    }


def markdown(result: dict) -> str:
    lines = [
        f"Whole-document tasks: the guide x{result['parts']} ({result['document_chars']:,} characters), "
        f"context {result['context_limit']:,}, at most {result['piece_tokens']} tokens written per piece.",
        "",
        "| run | task | pieces | read | from cache | fold depth | tokens read | steps | coverage "
        "| first partial result (s) | time (s) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["runs"]:
        lines.append(
            f"| {r['run']} | {r['task']} | {r['pieces']} | {r['read']} | {r['from_cache']} | {r['fold_depth']} "
            f"| {r['tokens_read']:,} | {r['steps']} | {r['coverage']:.0%} | {_seconds(r.get('first_partial_s'))} "
            f"| {r['seconds']:.1f} |"
        )
    timed = [r for r in result["runs"] if "outside_total_s" in r]
    if timed:
        lines += [
            "",
            "| run | turn's TTFT (s) | measured from outside (s) | turn's total (s) | measured from outside (s) |",
            "|---|---:|---:|---:|---:|",
        ]
        lines += [
            f"| {r['run']} | {r['turn_ttft_s']:.2f} | {r['outside_ttft_s']:.2f} | {r['turn_total_s']:.2f} "
            f"| {r['outside_total_s']:.2f} |"
            for r in timed
        ]
        cold, cached = timed[0], timed[-1]
        if len(timed) > 1 and cold["outside_total_s"]:
            lines.append(
                f"\nThe cached re-ask took {cached['outside_total_s']:.2f} s, "
                f"{cached['outside_total_s'] / cold['outside_total_s']:.2f}x the cold run."
            )
    lines += ["", *prefill_lines(result)]
    lines += [
        "",
        "| another visitor's short turn | time (s) | first token (s) | decode tok/s | tokens | batch |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for label, key in (("idle server", "visitor_idle"), ("while a task reads", "visitor_during_task")):
        v = result[key]
        lines.append(
            f"| {label} | {v['seconds']:.2f} | {v['ttft_s']:.2f} | {v['decode_tok_s']} | {v['tokens']} "
            f"| {v['batch_size']} |"
        )
    return "\n".join(lines)


def prefill_lines(result: dict) -> list[str]:
    """The cold task's read rate against llama-bench's prefill of the shipped file, from `prefill`."""
    p, cold = result.get("prefill"), next((r for r in result["runs"] if r["run"] == "cold"), None)
    if not p or cold is None:
        return []
    lines = [
        f"The cold task read {cold['tokens_read']:,} tokens in {cold['outside_total_s']:.2f} s: "
        f"{p['task_read_tok_s']:,.1f} tok/s."
    ]
    if p["ratio"] is None:
        lines.append("No llama-bench reference (LLMWEB_LLAMA_BENCH or the PATH), so no ratio.")
    else:
        runs = ", ".join(f"{r:,.1f}" if r else "-" for r in p["llama_bench_runs"])
        lines += [
            f"`llama-bench -p {p['llama_bench_prompt']} -n 0` on {p['llama_bench_file']} as it ships, same "
            f"threads, before and after the two runs: {runs} tok/s (mean {p['llama_bench_tok_s']:,.1f}).",
            "",
            f"**Cold task read rate / llama-bench prefill of the shipped file: {p['ratio']:.2f}x**",
        ]
    if result.get("served"):
        rss = f"; the engine's RSS after the cold run {cold['rss_mib']:,.0f} MiB" if cold.get("rss_mib") else ""
        lines += ["", f"Served: {result['served']}, {result['weights_mib']:,.0f} MiB weights{rss}."]
    return lines


def _seconds(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"
