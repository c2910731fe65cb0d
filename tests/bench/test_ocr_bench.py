"""`bench ocr`'s own arithmetic and table: the edit distance against the textbook one, the CER, and
a run over scripted engines (one perfect, one that drops every space, one missing). The real
engines' figures are the command's business (docs/documents.md); no timing assertions here."""

from __future__ import annotations

import random

import pytest

from llmweb.bench import ocr as bench_ocr
from llmweb.cli.main import build_parser


def textbook_distance(a: str, b: str) -> int:
    row = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        prev, row[0] = row[0], i
        for j, cb in enumerate(b, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (ca != cb))
    return row[-1]


def test_the_row_wise_edit_distance_equals_the_textbook_one():
    rng = random.Random(7)
    for _ in range(200):
        a = "".join(rng.choice("abc ") for _ in range(rng.randrange(0, 30)))
        b = "".join(rng.choice("abcd") for _ in range(rng.randrange(0, 30)))
        assert bench_ocr.edit_distance(a, b) == textbook_distance(a, b), (a, b)
    assert bench_ocr.edit_distance("kitten", "sitting") == 3


def test_cer_counts_characters_over_the_reference_with_whitespace_runs_as_one_space():
    assert bench_ocr.cer("one two\nthree", "one  two three") == 0.0
    assert bench_ocr.cer("abcd", "abed") == pytest.approx(0.25)
    assert bench_ocr.cer("abcd", "") == 1.0 and bench_ocr.cer("", "") == 0.0


def test_a_run_scores_each_engine_on_each_page_and_lists_missing_ones(monkeypatch):
    def missing():
        raise ImportError("no such engine")

    engines = (
        bench_ocr.Engine("perfect", lambda: "v1", lambda: lambda image: page_text[image.size]),
        bench_ocr.Engine("spaceless", lambda: "v2", lambda: lambda image: page_text[image.size].replace(" ", "")),
        bench_ocr.Engine("absent", lambda: "v3", missing),
    )
    monkeypatch.setattr(bench_ocr, "ENGINES", engines)
    small = [bench_ocr.scan_page("A short page.", dpi=72, inches=(4, 2)), bench_ocr.note_photo("A note.")]
    page_text = {p.image.size: p.text for p in small}
    monkeypatch.setattr(bench_ocr, "pages", lambda dpis: small)
    result = bench_ocr.run(dpis=[72], repeats=1)
    perfect, spaceless, absent = result["rows"]
    assert [p["cer"] for p in perfect["pages"]] == [0.0, 0.0]
    assert spaceless["pages"][0]["cer"] == pytest.approx(2 / len("A short page."))
    assert "not installed" in absent["missing"]
    table = bench_ocr.markdown(result)
    assert "| perfect | v1 |" in table and "| 0.0% |" in table and "| absent | not installed" in table
    assert f"{spaceless['pages'][0]['cer']:.1%}" in table


def test_the_command_is_registered_with_its_options():
    args = build_parser().parse_args(["bench", "ocr", "--dpi", "200", "--repeats", "1"])
    assert (args.which, args.dpi, args.repeats) == ("ocr", "200", 1)
