"""`bench chatpath`: its pure parts (the summary, the table), and one real run of the chat path beside
llama.cpp's `llama-bench`. The run's figures are printed, not asserted (docs/benchmarks.md, "Decode
speed"); what must hold is that every turn ran and has llama-bench's figure at its own depth."""

from __future__ import annotations

import os

import pytest

from llmweb.bench import chatpath
from llmweb.bench.common import llama_tool
from llmweb.config import Settings
from llmweb.errors import ConfigError


def test_each_turn_is_held_to_llama_bench_at_its_own_depth_by_the_medians():
    ours = [
        [{"prompt_tokens": 45, "decode_tok_s": 110.0}, {"prompt_tokens": 331, "decode_tok_s": 90.0}],
        [{"prompt_tokens": 45, "decode_tok_s": 120.0}, {"prompt_tokens": 331, "decode_tok_s": 99.0}],
        [{"prompt_tokens": 45, "decode_tok_s": 100.0}, {"prompt_tokens": 331, "decode_tok_s": 95.0}],
    ]
    theirs = [{45: 125.0, 331: 100.0}, {45: 120.0, 331: 104.0}, {45: 130.0, 331: 96.0}]
    rows = chatpath.summarize(ours, theirs)
    assert [(r["turn"], r["prompt_tokens"]) for r in rows] == [(1, 45), (2, 331)]
    assert rows[0]["decode_tok_s"] == 110.0 and rows[0]["llama_bench_tok_s"] == 125.0 and rows[0]["ratio"] == 0.88
    assert rows[1]["decode_tok_s"] == 95.0 and rows[1]["llama_bench_tok_s"] == 100.0 and rows[1]["ratio"] == 0.95
    table = chatpath.markdown({"new_tokens": 128, "threads": 2, "repeats": 3, "rows": rows})
    assert "| 1 | 45 | 110.0 | 125.0 | 0.88 | 110.0, 120.0, 100.0 | 125.0, 120.0, 130.0 |" in table


def test_a_depth_llama_bench_did_not_run_has_no_ratio():
    rows = chatpath.summarize([[{"prompt_tokens": 45, "decode_tok_s": 110.0}]], [{46: 120.0}])
    assert rows[0]["llama_bench_tok_s"] is None and rows[0]["ratio"] is None
    table = chatpath.markdown({"new_tokens": 8, "threads": 2, "repeats": 1, "rows": rows})
    assert "| 1 | 45 | 110.0 | — | — |" in table


def test_it_compares_only_the_embedded_file():
    with pytest.raises(ConfigError, match="LLMWEB_MODEL"):
        chatpath.run(Settings(model="/elsewhere/model.gguf"))


@pytest.mark.slow
@pytest.mark.skipif(not llama_tool("llama-bench"), reason="no llama-bench (LLMWEB_LLAMA_BENCH or the PATH)")
def test_every_turn_of_the_chat_path_is_set_beside_llama_bench_at_its_depth(monkeypatch):
    monkeypatch.delenv("LLMWEB_GGUF_REQUANT", raising=False)
    result = chatpath.run(Settings(threads=int(os.environ.get("LLMWEB_THREADS", "0"))), new_tokens=16, repeats=1)
    rows = result["rows"]
    assert [r["turn"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        assert r["prompt_tokens"] > 10 and len(r["runs"]) == len(r["reference_runs"]) == 1, r
        assert r["decode_tok_s"] > 0 and r["llama_bench_tok_s"] and r["ratio"] > 0, r
    print(chatpath.markdown(result))
