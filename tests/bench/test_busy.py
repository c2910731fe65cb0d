"""`bench busy`'s pure parts: the summary's ratios, its table, and the upload's tenfold PDF.
(The command itself starts a server and Chromium: docs/benchmarks.md has its figures.)"""

from __future__ import annotations

from llmweb.bench import busy
from llmweb.retrieval.parsers import parse_document


def row(case: str, repeat: int, tok_s: float, wall: float) -> dict:
    return {
        "case": case,
        "repeat": repeat,
        "tokens": 100,
        "decode_tok_s": tok_s,
        "ttft_s": 0.2,
        "wall_s": wall,
        "web_cpu_s": 0.3,
        "engine_cpu_s": 3.0,
        "browser_cpu_s": 1.0,
    }


def test_the_summary_holds_each_case_to_the_quiet_api_medians():
    rows = [row("api", 1, 60, 2.0), row("api", 2, 80, 3.0), row("browser", 1, 35, 4.0), row("browser", 2, 35, 6.0)]
    rows.append(row("upload", 1, 14, 10.0) | {"note": "the upload still indexing at the end"})
    summary = {s["case"]: s for s in busy.summarize(rows)}
    assert summary["api"]["decode_tok_s"] == 70 and summary["api"]["decode_vs_api"] == 1.0
    assert summary["browser"]["decode_vs_api"] == 0.5 and summary["browser"]["wall_vs_api"] == 2.0
    assert summary["upload"]["runs"] == 1 and summary["upload"]["decode_vs_api"] == 0.2
    table = busy.markdown(
        {"message": "m", "new_tokens": 160, "repeats": 2, "idle_browser_cores": 0.004, "rows": rows}
        | {"summary": list(summary.values())}
    )
    assert "Chromium with the page open and idle for 5 s: 0.004 of a core." in table
    assert table.splitlines()[0].endswith("2 repeats, one server.")
    long = busy.markdown({"message": "m", "new_tokens": 160, "repeats": 2, "history": 100, "rows": rows, "summary": []})
    assert long.splitlines()[0].endswith("one server; the page's chat imported with 100 turns.")
    assert "| browser | 35.0 | 0.50 | 5.00 | 2.00 |" in table
    assert "the upload still indexing at the end" in table
    assert "| browser | 1 | 100 | 35.0 | 0.20 | 4.00 | 0.30 | 3.0 | 1.00 |" in table


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
