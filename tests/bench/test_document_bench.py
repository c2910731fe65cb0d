"""`bench document`: the cold task's read rate against llama-bench's prefill of the shipped file, as
the command prints it from its own figures; the real command, shortened, beside the real llama-bench."""

from __future__ import annotations

import os

import pytest

from llmweb.bench import document
from llmweb.bench.common import llama_tool
from llmweb.config import Settings

COLD = {
    "run": "cold",
    "task": "summarise",
    "pieces": 7,
    "read": 7,
    "from_cache": 0,
    "fold_depth": 1,
    "tokens_read": 11_430,
    "steps": 9,
    "coverage": 1.0,
    "first_partial_s": 4.0,
    "seconds": 30.0,
    "turn_ttft_s": 28.0,
    "outside_ttft_s": 28.1,
    "turn_total_s": 30.0,
    "outside_total_s": 30.48,
    "rss_mib": 612.0,
}
CACHED = dict(COLD, run="cached", from_cache=7, outside_total_s=1.5, turn_total_s=1.5, rss_mib=None)
VISITOR = {"seconds": 0.5, "ttft_s": 0.2, "decode_tok_s": 90.0, "tokens": 16, "batch_size": 1}


def result(reference: list[float | None]) -> dict:
    return {
        "bench": "document",
        "parts": 4,
        "document_chars": 37_062,
        "context_limit": 2048,
        "piece_tokens": 48,
        "served": "Q8_0 GGUF from Q4_1",
        "weights_mib": 136.0,
        "runs": [COLD, CACHED],
        "visitor_idle": VISITOR,
        "visitor_during_task": VISITOR,
        "prefill": document.prefill_figures(COLD, reference, document.SAMPLE),
    }


def test_the_ratio_is_the_cold_read_rate_over_the_mean_llama_bench_prefill_and_is_printed():
    r = result([240.0, 260.0])
    p = r["prefill"]
    assert p["task_read_tok_s"] == pytest.approx(11_430 / 30.48, abs=0.05)  # 375.0
    assert p["llama_bench_tok_s"] == 250.0 and p["ratio"] == 1.5
    md = document.markdown(r)
    assert "**Cold task read rate / llama-bench prefill of the shipped file: 1.50x**" in md
    assert "11,430 tokens in 30.48 s: 375.0 tok/s" in md and "240.0, 260.0 tok/s (mean 250.0)" in md
    assert "The cached re-ask took 1.50 s, 0.05x the cold run." in md
    assert "Served: Q8_0 GGUF from Q4_1, 136 MiB weights; the engine's RSS after the cold run 612 MiB." in md


def test_without_llama_bench_there_is_no_ratio_and_it_says_so():
    r = result([None, None])
    assert r["prefill"]["ratio"] is None and r["prefill"]["task_read_tok_s"] > 0
    md = document.markdown(r)
    assert "no ratio" in md and "llama-bench prefill of the shipped file:" not in md
    half = result([None, 300.0])["prefill"]  # one of the two ran: that one
    assert half["llama_bench_tok_s"] == 300.0


@pytest.mark.slow  # the real model, two document tasks and llama-bench (~1-2 min on 2 cores)
@pytest.mark.skipif(not llama_tool("llama-bench"), reason="no llama-bench (LLMWEB_LLAMA_BENCH or the PATH)")
def test_the_command_sets_the_cold_task_beside_llama_bench_on_the_shipped_file(tmp_path):
    from tests.conftest import MODEL_CACHE

    threads = int(os.environ.get("LLMWEB_THREADS", "0"))
    s = Settings(data_dir=tmp_path, cache_dir=MODEL_CACHE, threads=threads, request_timeout_s=900)  # a loaded CI
    r = document.run(s, parts=1, piece_tokens=8, progress=lambda _: None, bench_repeats=1)
    cold, p = r["runs"][0], r["prefill"]
    assert cold["run"] == "cold" and cold["coverage"] == 1.0 and cold["from_cache"] == 0
    assert r["runs"][1]["from_cache"] == cold["pieces"], "the re-ask reads every piece from the cache"
    assert p["llama_bench_file"] == "SmolLM2-135M-Instruct.Q4_1.gguf", "the file as it ships, not the Q8_0 copy"
    assert r["served"] == "Q8_0 GGUF from Q4_1"
    assert len(p["llama_bench_runs"]) == 2 and all(x and x > 0 for x in p["llama_bench_runs"]), p
    # from its own figures (those printed are rounded: the ratio to within their last digit)
    assert p["ratio"] == pytest.approx(
        cold["tokens_read"] / cold["outside_total_s"] / p["llama_bench_tok_s"], abs=0.011
    )
    assert f"{p['ratio']:.2f}x**" in document.markdown(r)
