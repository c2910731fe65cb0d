"""tools/bench_releases.py: the headline figures it reads from each bench's JSON, and its table."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_path = Path(__file__).resolve().parents[2] / "tools" / "bench_releases.py"
_spec = importlib.util.spec_from_file_location("bench_releases", _path)
br = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(br)


def test_decode_headline_is_the_default_step_beside_llama_bench():
    r = {
        "bench": "decode",
        "default_step": "llama.cpp",
        "rows": [
            {"step": "int8", "prompt": 512, "decode_tok_s": 20.0, "prefill_tok_s": 900.0},
            {"step": "llama.cpp", "prompt": 512, "decode_tok_s": 88.44, "prefill_tok_s": 301.2},
        ],
        "llama_bench": [{"prompt": 512, "decode_tok_s": 90.0, "default_decode_ratio": 0.98}],
        "first_turn": {"prompt": 400, "new_tokens": 128, "total_s": {"llama.cpp": 2.6, "int8": 6.7}},
    }
    h = br.headline(r)
    assert h["decode tok/s, prompt 512"] == "88.4"
    assert h["decode / llama-bench, 512"] == "0.98"
    assert h["first turn (400 + 128 tokens) s"] == "2.60"


def test_ttft_and_concurrency_headlines():
    ttft = {
        "bench": "ttft",
        "modes": {
            "reuse": {"median_early_s": 0.1, "median_last10_s": 0.15, "late_early_ratio": 1.5, "low_prefill_share": 1.0}
        },
    }
    assert br.headline(ttft)["reuse: late / early"] == "1.50"
    assert br.headline(ttft)["reuse: turns prefilling < 30%"] == "100%"
    conc = {
        "bench": "concurrency",
        "rows": [
            {"concurrency": 4, "engine": "serial", "aggregate_tok_s": 80.0},
            {
                "concurrency": 4,
                "engine": "batched",
                "aggregate_tok_s": 124.0,
                "aggregate_vs_serial": 1.55,
                "ttft_p95_s": 0.7,
            },
        ],
        "llama_batched_bench": [{"concurrency": 4, "aggregate_vs_serial": 1.43}],
    }
    h = br.headline(conc)
    assert h["4 chats: batched / serial"] == "1.55" and h["4 chats: llama-batched-bench k / 1"] == "1.43"


def test_table_keeps_a_column_per_run_and_blanks_what_one_lacks():
    out = br.table([("before a #1", {"x": "1", "y": "2"}), ("now b #1", {"x": "3"})])
    assert out.splitlines()[0] == "| figure | before a #1 | now b #1 |"
    assert "| y | 2 |  |" in out


def test_an_unknown_bench_is_refused():
    with pytest.raises(SystemExit, match="not 'load'"):
        br.headline({"bench": "load"})


def test_document_headline_has_the_times_the_ratio_and_the_visitor_and_blanks_what_an_older_release_lacks():
    visitor = {"seconds": 0.5, "ttft_s": 0.21, "decode_tok_s": 90.0, "tokens": 16, "batch_size": 1}
    cold = {"run": "cold", "tokens_read": 11_430, "seconds": 30.4, "coverage": 1.0, "outside_total_s": 30.48}
    now = {
        "bench": "document",
        "served": "Q8_0 GGUF from Q4_1",
        "weights_mib": 136.0,
        "runs": [dict(cold, rss_mib=612.0), {"run": "cached", "seconds": 1.4, "outside_total_s": 1.5}],
        "visitor_idle": visitor,
        "visitor_during_task": visitor,
        "prefill": {"llama_bench_prompt": 512, "llama_bench_tok_s": 250.0, "ratio": 1.5},
    }
    h = br.headline(now)
    assert h["cold summary s"] == "30.48" and h["cached summary s"] == "1.50" and h["cold: read tok/s"] == "375.0"
    assert h["llama-bench -p 512 tok/s (shipped file)"] == "250.0" and h["cold read / llama-bench prefill"] == "1.50"
    assert h["served"] == "Q8_0 GGUF from Q4_1, 136 MiB" and h["visitor beside the task: first token s"] == "0.21"
    old = {k: v for k, v in now.items() if k not in ("served", "weights_mib", "prefill")}
    old["runs"] = [{k: v for k, v in cold.items() if k != "outside_total_s"}]  # an older release's JSON
    h = br.headline(old)
    assert h["cold summary s"] == "30.40" and "cold read / llama-bench prefill" not in h


def test_peer_headline_is_each_servers_rate_and_the_ratio():
    r = {
        "bench": "peer",
        "model_file": "SmolLM2-135M-Instruct.q8_0-0123456789ab.gguf",
        "summary": [{"concurrency": 4, "llmweb_tok_s": 140.0, "llama_server_tok_s": 150.0, "ours_vs_peer": 0.93}],
    }
    h = br.headline(r)
    assert h["4 chats: llmweb / llama-server"] == "0.93" and h["file"].endswith(".gguf")
