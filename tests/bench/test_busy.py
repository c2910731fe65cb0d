"""`bench busy`: its pure parts (the summary's paired ratios, its tables, the upload's tenfold
PDF), and one shortened real run (a served app, headless Chromium, an upload, llama-bench) whose
figures are printed, not asserted: docs/benchmarks.md has them."""

from __future__ import annotations

import os

import pytest

from llmweb.bench import busy
from llmweb.bench.common import llama_tool
from llmweb.bench.served import nginx_exe
from llmweb.retrieval.parsers import parse_document

REQUIRE = os.environ.get("LLMWEB_REQUIRE_BROWSER") == "1"


def row(case: str, repeat: int, tok_s: float, wall: float) -> dict:
    return {
        "case": case,
        "repeat": repeat,
        "tokens": 100,
        "prompt_tokens": 400,
        "decode_tok_s": tok_s,
        "ttft_s": 0.2,
        "wall_s": wall,
        "web_cpu_s": 0.3,
        "engine_cpu_s": 3.0,
        "browser_cpu_s": 1.0,
    }


def test_the_summary_holds_each_case_to_the_api_turn_of_its_own_repeat():
    seen = [{"seen_ttft_s": 0.3, "seen_updates": 20}, {"seen_ttft_s": 0.5, "seen_updates": 22}]
    rows = [row("api", 1, 60, 2.0), row("api", 2, 80, 3.0), row("browser", 1, 35, 4.0) | seen[0]]
    rows += [row("browser", 2, 35, 6.0) | seen[1], row("proxy", 1, 30, 5.0) | seen[0] | {"note": "through nginx"}]
    rows.append(row("upload", 1, 14, 10.0) | {"note": "the upload still indexing at the end"})
    summary = {s["case"]: s for s in busy.summarize(rows)}
    assert summary["api"]["decode_tok_s"] == 70 and summary["api"]["decode_vs_api"] == 1.0
    # each repeat against its own api turn (35/60 and 35/80), not the medians' ratio (35/70 = 0.5)
    assert summary["browser"]["decode_vs_api"] == 0.51 and summary["browser"]["wall_vs_api"] == 2.0
    assert summary["upload"]["runs"] == 1 and summary["upload"]["decode_vs_api"] == 0.23
    assert summary["browser"]["prompt_tokens"] == 400 and summary["browser"]["seen_ttft_s"] == 0.4
    assert summary["proxy"]["decode_vs_api"] == 0.5 and summary["api"]["seen_ttft_s"] is None
    table = busy.markdown(
        {"message": "m", "new_tokens": 160, "repeats": 2, "idle_browser_cores": 0.004, "rows": rows}
        | {"summary": list(summary.values())}
    )
    assert "Chromium with the page open and idle for 5 s: 0.004 of a core." in table
    assert table.splitlines()[0].endswith("2 repeats, one server.")
    long = busy.markdown({"message": "m", "new_tokens": 160, "repeats": 2, "history": 100, "rows": rows, "summary": []})
    assert long.splitlines()[0].endswith("one server; the page's chat imported with 100 turns.")
    assert "| browser | 400 | 35.0 | 0.51 | 5.00 | 2.00 | 0.40 |" in table
    assert "| api | 400 | 70.0 | 1.00 | 2.50 | 1.00 | — |" in table
    assert "the upload still indexing at the end" in table
    assert "| browser | 1 | 400 | 100 | 35.0 | 0.20 | 0.30 | 20 | 4.00 | 0.30 | 3.0 | 1.00 |" in table
    assert "| api | 1 | 400 | 100 | 60.0 | 0.20 | — | — | 2.00 |" in table


def test_the_uploads_pdf_expands_tenfold_and_parses_within_the_caps():
    data = busy.expanding_pdf(seed=3, chars=60_000)
    doc = parse_document(data, "notes.pdf")
    assert len(doc.text) >= busy.EXPANSION * len(data)
    assert "Plot 000001 of survey 3" in doc.text and doc.sections[-1].page > 1
    assert busy.expanding_pdf(seed=4, chars=60_000) != data, "each repeat uploads new content"


def test_a_turns_cpu_is_split_into_the_web_process_the_engine_processes_and_chromium():
    from llmweb.bench.served import ENGINES, cpu_used

    before = {100: 5.0, ENGINES: 20.0, 300: 1.0, 301: 2.0}
    after = {100: 5.4, ENGINES: 22.5, 300: 1.5, 302: 0.25}  # Chromium's 301 ended, 302 started
    web, engine, browser = cpu_used(before, after, server_pid=100)
    assert (round(web, 2), round(engine, 2), round(browser, 2)) == (0.4, 2.5, 0.75)


def test_the_reference_puts_llama_bench_beside_each_repeats_turns_at_their_prompt_length():
    rows = [row("api", 1, 98.2, 1.7), row("browser", 1, 67.6, 2.6), row("api", 2, 93.0, 1.9)]
    rows += [row("browser", 2, 66.7, 2.6) | {"prompt_tokens": 577}, row("upload", 2, 30.0, 4.0)]
    ref = [
        {"prompt_tokens": 400, "threads": 1, "decode_tok_s": 70.9},
        {"prompt_tokens": 400, "threads": 2, "decode_tok_s": 100.6},
        {"prompt_tokens": 577, "threads": 1, "decode_tok_s": 66.1},
    ]
    r = {"message": "m", "new_tokens": 160, "repeats": 2, "rows": rows, "summary": [], "llama_bench": ref}
    table = busy.markdown(r)
    head = "| repeat | prompt tokens | api tok/s | browser tok/s | llama-bench, 1 thread | llama-bench, 2 threads |"
    assert head in table
    assert "| 1 | 400 | 98.2 | 67.6 | 70.9 | 100.6 |" in table
    # the api turn of repeat 2 was at another length than the page's (400): not set beside it
    assert "| 2 | 577 | — | 66.7 | 66.1 | — |" in table
    assert "llama-bench" not in busy.markdown(r | {"llama_bench": []})


@pytest.mark.slow
@pytest.mark.browser
@pytest.mark.skipif(not busy.CHROMIUM.exists() and not REQUIRE, reason="no /usr/bin/chromium")
@pytest.mark.skipif(not llama_tool("llama-bench"), reason="no llama-bench (LLMWEB_LLAMA_BENCH or the PATH)")
def test_one_run_asks_every_case_at_the_pages_prompt_length_beside_llama_bench(monkeypatch):
    """The real command, shortened: a served app, headless Chromium, an upload, llama-bench. Its
    figures are printed, not asserted; what must hold is that the api case asked at the page's
    prompt length (its own chat, grown as the page's) and llama-bench ran at that length."""
    monkeypatch.delenv("LLMWEB_GGUF_REQUANT", raising=False)
    # the pauses that steady the printed figures (the idle page's CPU, the governor between cases):
    # no assertion reads them, and each code path they precede still runs
    monkeypatch.setattr(busy, "SETTLE_S", 0.5)
    monkeypatch.setattr(busy, "IDLE_S", 1.0)
    monkeypatch.setattr(busy, "CASE_GAP_S", 0.5)
    result = busy.run(new_tokens=24, repeats=1, progress=lambda _: None, upload_chars=30_000)
    got = {r["case"]: r for r in result["rows"]}
    cases = set(busy.CASES) if nginx_exe() or REQUIRE else set(busy.CASES) - {"proxy"}
    assert set(got) == cases, "the proxy case needs nginx (CI installs nginx-light)"
    assert got["browser"]["prompt_tokens"] > 45 + 2 * 24, "the page's chat has its warm-up turns"
    assert got["api"]["prompt_tokens"] == got["browser"]["prompt_tokens"]
    assert abs(got["upload"]["prompt_tokens"] - got["browser"]["prompt_tokens"]) < 2 * 24
    assert all(r["tokens"] > 0 and r["decode_tok_s"] > 0 for r in got.values()), got
    if "proxy" in got:
        assert got["proxy"]["prompt_tokens"] == got["browser"]["prompt_tokens"] and "nginx" in got["proxy"]["note"]
    for case in set(busy.PAGES) & set(got):  # the visitor saw the reply's words arrive, several times
        assert 0 < got[case]["seen_ttft_s"] < got[case]["wall_s"] and got[case]["seen_updates"] >= 2, got[case]
    depth = got["browser"]["prompt_tokens"]
    assert {(x["prompt_tokens"], x["threads"]) for x in result["llama_bench"]} >= {(depth, 1)}
    print(busy.markdown(result))
