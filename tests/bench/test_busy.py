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
        "prompt_tokens": 400,
        "decode_tok_s": tok_s,
        "ttft_s": 0.2,
        "wall_s": wall,
        "web_cpu_s": 0.3,
        "engine_cpu_s": 3.0,
        "browser_cpu_s": 1.0,
    }


def test_the_summary_holds_each_case_to_the_api_turn_of_its_own_repeat():
    rows = [row("api", 1, 60, 2.0), row("api", 2, 80, 3.0), row("browser", 1, 35, 4.0), row("browser", 2, 35, 6.0)]
    rows.append(row("upload", 1, 14, 10.0) | {"note": "the upload still indexing at the end"})
    summary = {s["case"]: s for s in busy.summarize(rows)}
    assert summary["api"]["decode_tok_s"] == 70 and summary["api"]["decode_vs_api"] == 1.0
    # each repeat against its own api turn (35/60 and 35/80), not the medians' ratio (35/70 = 0.5)
    assert summary["browser"]["decode_vs_api"] == 0.51 and summary["browser"]["wall_vs_api"] == 2.0
    assert summary["upload"]["runs"] == 1 and summary["upload"]["decode_vs_api"] == 0.23
    assert summary["browser"]["prompt_tokens"] == 400
    table = busy.markdown(
        {"message": "m", "new_tokens": 160, "repeats": 2, "idle_browser_cores": 0.004, "rows": rows}
        | {"summary": list(summary.values())}
    )
    assert "Chromium with the page open and idle for 5 s: 0.004 of a core." in table
    assert table.splitlines()[0].endswith("2 repeats, one server.")
    long = busy.markdown({"message": "m", "new_tokens": 160, "repeats": 2, "history": 100, "rows": rows, "summary": []})
    assert long.splitlines()[0].endswith("one server; the page's chat imported with 100 turns.")
    assert "| browser | 400 | 35.0 | 0.51 | 5.00 | 2.00 |" in table
    assert "the upload still indexing at the end" in table
    assert "| browser | 1 | 400 | 100 | 35.0 | 0.20 | 4.00 | 0.30 | 3.0 | 1.00 |" in table


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
    assert "| repeat | prompt tokens | api tok/s | browser tok/s | llama-bench, 1 thread | llama-bench, 2 threads |" in table
    assert "| 1 | 400 | 98.2 | 67.6 | 70.9 | 100.6 |" in table
    # the api turn of repeat 2 was at another length than the page's (400): not set beside it
    assert "| 2 | 577 | — | 66.7 | 66.1 | — |" in table
    assert "llama-bench" not in busy.markdown(r | {"llama_bench": []})
