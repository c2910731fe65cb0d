"""`bench continue` at a tiny size on the real model: it runs, its ratio is the one its own figures
give, and the continued chat's first prompt holds the facts planted in the chat it continues.
No timing assertions: these machines are noisy."""

from __future__ import annotations

import statistics

import pytest

from llmweb.bench import carry
from llmweb.cli.main import build_parser
from tests.conftest import make_settings


def test_bench_continue_is_a_command_with_120_turns_by_default():
    args = build_parser().parse_args(["bench", "continue"])
    assert args.which == "continue" and args.history == 0 and args.repeats == 3  # 0: the command's 120


@pytest.mark.slow  # the real model: a 20-turn chat folded, then 2 pairs of first turns
def test_bench_continue_prints_the_continued_and_fresh_first_ttft_and_their_ratio(app_model, tmp_path):
    settings = make_settings(
        tmp_path,
        device="cpu",
        engine_process="0",
        context_limit=1024,
        max_new_tokens=8,
        summary_tokens=48,
        request_timeout_s=900,
    )
    seen: list[str] = []
    r = carry.run(settings, app_model, history=20, repeats=2, progress=seen.append)
    assert r["bench"] == "continue" and r["history"] == 20 and len(r["pairs"]) == 2
    assert r["facts_planted"] == 2 and r["facts_in_first_prompt"] == 2 and r["summary_tokens"] > 0
    continued = [p["continued"]["ttft_s"] for p in r["pairs"]]
    fresh = [p["fresh"]["ttft_s"] for p in r["pairs"]]
    assert all(t > 0 for t in continued + fresh)
    assert r["median_continued_ttft_s"] == round(statistics.median(continued), 4)
    ratio = round(statistics.median(continued) / statistics.median(fresh), 3)
    assert r["continued_fresh_ratio"] == ratio
    assert all(p["continued"]["prompt_tokens"] < r["stay"]["prompt_tokens"] for p in r["pairs"]), "it starts small"
    for p in r["pairs"]:  # prefilled as it opens: its first message prefills only itself
        assert p["continued"]["reused_tokens"] > p["cold"]["reused_tokens"], p
        assert p["continued"]["prompt_tokens"] - p["continued"]["reused_tokens"] < 40, p
    cold = statistics.median(p["cold"]["ttft_s"] for p in r["pairs"])
    assert r["median_cold_ttft_s"] == round(cold, 4)
    assert r["cold_fresh_ratio"] == round(cold / statistics.median(fresh), 3)
    md = carry.markdown(r)
    assert f"| {r['continued_fresh_ratio']:.2f} |" in md and "continued / fresh" in md
    assert "2 of the 2 planted facts" in md and len(seen) == 3
