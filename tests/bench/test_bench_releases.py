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
