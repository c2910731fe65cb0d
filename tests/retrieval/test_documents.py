"""retrieval/parsers.py and chunking.py: loaders, structure (pages / headings), chunking limits and offsets, bad input.

Uses the embedder's real tokenizer (from the embedded all-MiniLM-L6-v2 folder; the model itself
is not loaded here) and real PDF / DOCX files built in the test.
"""

from __future__ import annotations

import io

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmweb.bench.hostile import make_pdf, pdf_file
from llmweb.errors import InputError
from llmweb.retrieval.chunking import chunk_document, count_tokens
from llmweb.retrieval.parsers import (
    MB,
    SUPPORTED_SUFFIXES,
    display_name,
    load_document,
    parse_document,
    safe_name,
)

MAX = 254  # all-MiniLM-L6-v2: max_seq_length 256 less [CLS] and [SEP]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from llmweb.retrieval.embedder import default_embedder_path

    return AutoTokenizer.from_pretrained(default_embedder_path())


# --------------------------------------------------------------------------- file builders
# make_pdf: llmweb/bench/hostile.py's (bench hostile parses the same kind of PDF)


def encrypt_pdf(pdf: bytes, user_password: str = "secret") -> bytes:
    from pypdf import PdfReader, PdfWriter

    writer = PdfWriter(clone_from=PdfReader(io.BytesIO(pdf)))
    writer.encrypt(user_password, owner_password="owner", algorithm="RC4-128")
    buf = io.BytesIO()
    writer.write(buf)
    return buf.getvalue()


def make_docx() -> bytes:
    import docx

    d = docx.Document()
    d.add_paragraph("Preface text before any heading.")
    d.add_heading("Installing the widget", level=1)
    d.add_paragraph("Unpack the box. Screw the widget to the wall.")
    d.add_heading("Cleaning", level=2)
    d.add_paragraph("Wipe the widget with a dry cloth.")
    table = d.add_table(rows=2, cols=2)
    table.cell(0, 0).text = "part"
    table.cell(0, 1).text = "colour"
    table.cell(1, 0).text = "lid"
    table.cell(1, 1).text = "blue"
    buf = io.BytesIO()
    d.save(buf)
    return buf.getvalue()


def prose(n_sentences: int, seed: int = 0) -> str:
    import random

    rng = random.Random(seed)
    words = "alpha beta gamma delta river stone window garden engine token memory index page".split()
    out = []
    for i in range(n_sentences):
        s = " ".join(rng.choice(words) for _ in range(rng.randint(5, 14)))
        out.append(s.capitalize() + ".")
        if i % 7 == 6:
            out.append("\n\n")
    return " ".join(out).replace(" \n\n ", "\n\n")


def check_chunks(doc, chunks, tokenizer, limit):
    assert chunks, "no chunks"
    for c in chunks:
        assert doc.text[c.start : c.end] == c.text, (c.start, c.end)
        assert c.text.strip() == c.text and c.text
        assert count_tokens(tokenizer, [c.text])[0] <= limit
        assert c.doc_id == doc.doc_id and c.source == doc.name
    covered = sorted((c.start, c.end) for c in chunks)
    for (_, e1), (s2, _) in zip(covered, covered[1:]):  # no text is skipped between chunks
        assert not doc.text[e1:s2].strip(), doc.text[e1:s2]


# --------------------------------------------------------------------------- loaders and structure


def test_txt_chunks_respect_limit_offsets_and_overlap(tokenizer):
    doc = parse_document(prose(120).encode(), "notes.txt")
    chunks = chunk_document(doc, tokenizer, max_tokens=60, overlap=15)
    check_chunks(doc, chunks, tokenizer, 60)
    assert len(chunks) > 5
    # neighbours overlap, and each chunk ends at a sentence end
    assert sum(b.start < a.end for a, b in zip(chunks, chunks[1:])) >= len(chunks) // 2
    assert all(c.text.endswith(".") for c in chunks)


def test_chunks_prefer_paragraph_breaks(tokenizer):
    paras = [prose(4, seed=i).replace("\n\n", " ") for i in range(12)]
    doc = parse_document("\n\n".join(paras).encode(), "p.txt")
    chunks = chunk_document(doc, tokenizer, max_tokens=120, overlap=0)
    check_chunks(doc, chunks, tokenizer, 120)
    starts = {doc.text.index(p) for p in paras}
    assert sum(c.start in starts for c in chunks) >= len(chunks) - 1


def test_pathological_text_never_exceeds_model_limit(tokenizer):
    text = (
        "x" * 3000
        + " "
        + "supercalifragilistic" * 200
        + " "
        + "word " * 900
        + "日本語のテキスト" * 300
        + "\n"
        + "a,b;c:" * 800
    )
    doc = parse_document(text.encode(), "weird.txt")
    chunks = chunk_document(doc, tokenizer, max_tokens=MAX, overlap=40)
    check_chunks(doc, chunks, tokenizer, MAX)
    with_specials = tokenizer([c.text for c in chunks])["input_ids"]
    assert max(len(ids) for ids in with_specials) <= 256


def test_markdown_headings(tokenizer):
    md = (
        "Intro line.\n\n# Guide\n\nSome text.\n\n## How do I change the model?\n\nSet LLMWEB_MODEL.\n\n"
        "```\n# not a heading, code\n```\n\nSetext title\n------------\n\nBody under setext.\n"
    )
    doc = parse_document(md.encode(), "guide.md")
    chunks = chunk_document(doc, tokenizer, max_tokens=200, overlap=20)
    check_chunks(doc, chunks, tokenizer, 200)
    by_text = {c.heading: c.text for c in chunks}
    assert by_text[None] == "Intro line."
    assert "Some text." in by_text["Guide"]
    assert "# not a heading" in by_text["How do I change the model?"]
    assert by_text["Setext title"].endswith("Body under setext.")


def test_html_text_headings_and_no_scripts(tokenizer):
    html = (
        b"<html><head><title>Widget manual</title><style>p{color:red}</style></head><body>"
        b"<p>Welcome to the <b>widget</b> manual.</p><script>alert('x')</script>"
        b"<h2>Safety</h2><p>Do not drop<br>the widget.</p><ul><li>Keep dry</li><li>Keep cool</li></ul>"
        b"<!-- a comment --></body></html>"
    )
    doc = parse_document(html, "manual.html")
    assert "alert" not in doc.text and "color" not in doc.text and "comment" not in doc.text
    chunks = chunk_document(doc, tokenizer, max_tokens=200, overlap=0)
    check_chunks(doc, chunks, tokenizer, 200)
    assert [(c.heading, c.text) for c in chunks] == [
        ("Widget manual", "Welcome to the widget manual."),
        ("Safety", "Safety\n\nDo not drop the widget.\n\nKeep dry\n\nKeep cool"),
    ]


def test_docx_headings_and_tables(tokenizer, tmp_path):
    path = tmp_path / "widget.docx"
    path.write_bytes(make_docx())
    doc = load_document(path)
    chunks = chunk_document(doc, tokenizer, max_tokens=200, overlap=0)
    check_chunks(doc, chunks, tokenizer, 200)
    headings = {c.heading: c.text for c in chunks}
    assert headings[None] == "Preface text before any heading."
    assert "Screw the widget" in headings["Installing the widget"]
    assert "dry cloth" in headings["Cleaning"] and "lid | blue" in headings["Cleaning"]


def test_pdf_pages(tokenizer, tmp_path):
    path = tmp_path / "report.pdf"
    path.write_bytes(make_pdf(["Quarterly report.\nSales went up (a lot).", "Page two is about cats.", ""]))
    doc = load_document(path)
    chunks = chunk_document(doc, tokenizer, max_tokens=200, overlap=0)
    check_chunks(doc, chunks, tokenizer, 200)
    assert [(c.page, c.text) for c in chunks] == [
        (1, "Quarterly report.\nSales went up (a lot)."),
        (2, "Page two is about cats."),
    ]
    assert chunks[1].label() == "report.pdf, p. 2"


def test_pdf_with_empty_user_password_opens(tmp_path):
    doc = parse_document(encrypt_pdf(make_pdf(["Open to all."]), user_password=""), "open.pdf")
    assert doc.text == "Open to all."


def test_text_encodings():
    assert parse_document("naïve café".encode("utf-16"), "u16.txt").text == "naïve café"
    assert parse_document("naïve café".encode("cp1252"), "legacy.txt").text == "naïve café"
    assert parse_document(b"a\r\nb\rc", "crlf.txt").text == "a\nb\nc"


def test_same_bytes_same_doc_id():
    a = parse_document(b"same words", "a.txt")
    b = parse_document(b"same words", "b.txt")
    c = parse_document(b"other words", "a.txt")
    assert a.doc_id == b.doc_id != c.doc_id


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "name, data, expected",
    [
        ("empty.txt", b"", "empty.txt is empty"),
        ("blank.md", b"  \n\n \t", "blank.md contains no text"),
        ("photo.txt", bytes(range(256)) * 4, "photo.txt looks like a binary file"),
        ("noise.txt", bytes([0x81, 0x8D, 0x8F, 0x90, 0x9D]) * 50, "noise.txt looks like a binary file"),
        ("bad.pdf", b"%PDF-1.4\n garbage \n%%EOF", "bad.pdf could not be read as a PDF"),
        ("half.pdf", make_pdf(["some text"])[:150], "half.pdf could not be read as a PDF"),
        ("fake.pdf", b"hello, I am text", "fake.pdf is not a valid PDF"),
        ("locked.pdf", encrypt_pdf(make_pdf(["secret text"])), "locked.pdf is password-protected"),
        ("blank.pdf", make_pdf([""]), "blank.pdf has no extractable text"),
        ("bad.docx", b"PK\x03\x04 not really a zip", "bad.docx could not be read as a Word .docx"),
        ("sheet.xlsx", b"whatever", "sheet.xlsx: '.xlsx' files are not supported; use one of .txt, .md"),
        ("README", b"whatever", "README: files without an extension are not supported"),
    ],
)
def test_bad_input_messages(name, data, expected):
    with pytest.raises(InputError) as err:
        parse_document(data, name)
    assert str(err.value).startswith(expected), str(err.value)


def test_unsupported_lists_every_supported_type():
    with pytest.raises(InputError) as err:
        parse_document(b"x", "a.exe")
    assert all(s in str(err.value) for s in SUPPORTED_SUFFIXES)


def test_size_cap_checked_before_reading(tmp_path):
    path = tmp_path / "big.txt"
    path.write_bytes(b"word " * 330_000)  # 1.57 MB
    with pytest.raises(InputError) as err:
        load_document(path, max_mb=1)
    assert str(err.value) == "big.txt is 1.6 MB; the limit is 1 MB (LLMWEB_MAX_FILE_MB)."
    assert load_document(path, max_mb=2).size == 1_650_000


def test_missing_file(tmp_path):
    with pytest.raises(InputError, match="gone.txt: file not found"):
        load_document(tmp_path / "gone.txt")


@pytest.mark.parametrize(
    "given, expected",
    [
        ("../../etc/passwd.txt", "passwd.txt"),
        ("/etc/hosts.md", "hosts.md"),
        ("C:\\Users\\me\\notes.txt", "notes.txt"),
        ("..\\..\\win.ini.txt", "win.ini.txt"),
        ("bad\x00name\n.txt", "badname.txt"),
        ("ok name (1).pdf", "ok name (1).pdf"),
    ],
)
def test_safe_name(given, expected):
    assert safe_name(given) == expected


@pytest.mark.parametrize("given", ["", "..", "/", "a/..", "\x00"])
def test_safe_name_rejects_nothing_left(given):
    with pytest.raises(InputError, match="no usable name"):
        safe_name(given)


def test_display_name_keeps_relative_folders_only():
    assert display_name("notes/2024/a.md") == "notes/2024/a.md"
    assert display_name("/abs/../../x/a.md") == "abs/x/a.md"
    assert display_name("C:\\docs\\a.md") == "docs/a.md"


def test_load_document_sanitises_display_name(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text("hello")
    assert load_document(path, "../../../etc/a.txt").name == "etc/a.txt"


# --------------------------------------------------------------------------- limits on what a file unpacks to


def _zip(members: dict[str, bytes]) -> bytes:
    import zipfile

    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in members.items():
            z.writestr(name, data)
    return buf.getvalue()


def test_docx_zip_bomb_is_refused_from_its_directory(monkeypatch):
    from llmweb.retrieval import parsers as documents

    monkeypatch.setattr(documents, "MAX_DOCX_UNPACKED_BYTES", 1 * MB)
    bomb = _zip({"word/document.xml": b"\0" * (2 * MB)})  # ~2 kB on disk
    assert len(bomb) < 10_000
    with pytest.raises(InputError) as err:
        parse_document(bomb, "bomb.docx")
    assert str(err.value) == "bomb.docx unpacks to 2 MB; the limit is 1 MB (a compressed bomb?)."


def test_docx_with_too_many_members_is_refused(monkeypatch):
    from llmweb.retrieval import parsers as documents

    monkeypatch.setattr(documents, "MAX_DOCX_MEMBERS", 10)
    with pytest.raises(InputError, match=r"many.docx holds 11 files inside; the limit is 10\."):
        parse_document(_zip({f"f{i}": b"x" for i in range(11)}), "many.docx")


def test_docx_table_row_wider_than_the_limit_is_refused():
    """gridSpan is a number in the file: python-docx's row.cells repeated a cell that many times."""
    import zipfile

    data = make_docx()
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        xml = z.read("word/document.xml").decode()
    xml = xml.replace("<w:tc>", '<w:tc><w:tcPr><w:gridSpan w:val="2000000000"/></w:tcPr>', 1)
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        members = {i.filename: (xml.encode() if i.filename == "word/document.xml" else z.read(i)) for i in z.infolist()}
    with pytest.raises(InputError, match=r"wide.docx has a table row over 1,000 cells wide"):
        parse_document(_zip(members), "wide.docx")


def test_docx_merged_cells_read_as_python_docx_reads_them():
    import docx

    d = docx.Document()
    table = d.add_table(rows=3, cols=3)
    for r in range(3):
        for c in range(3):
            table.cell(r, c).text = f"r{r}c{c}"
    table.cell(0, 0).merge(table.cell(2, 0))  # one tall cell
    table.cell(0, 1).merge(table.cell(0, 2))  # one wide cell
    buf = io.BytesIO()
    d.save(buf)
    expected = [" | ".join(t for t in (c.text.strip() for c in row.cells) if t) for row in table.rows]
    doc = parse_document(buf.getvalue(), "merged.docx")
    assert doc.text.split("\n\n") == expected


def test_pdf_page_and_text_limits(monkeypatch):
    from llmweb.retrieval import parsers as documents

    monkeypatch.setattr(documents, "MAX_PDF_PAGES", 2)
    with pytest.raises(InputError, match=r"long.pdf has 3 pages; the limit is 2 pages\."):
        parse_document(make_pdf(["one", "two", "three"]), "long.pdf")
    monkeypatch.setattr(documents, "MAX_PDF_PAGES", 10)
    monkeypatch.setattr(documents, "MAX_TEXT_CHARS", 10)
    with pytest.raises(InputError, match=r"wordy.pdf holds more than 10 characters of text"):
        parse_document(make_pdf(["a few words", "and more words"]), "wordy.pdf")


def form_bomb_pdf(draws: int = 5_000, text: str = "All work and no play makes a dull boy. " * 50) -> bytes:
    """One page that draws one form XObject `draws` times, both streams Flate-compressed: a file
    of about 1.4 KB whose text layer is `draws * len(text)` characters (10 M by default)."""
    import zlib

    form = zlib.compress(f"BT /F1 12 Tf 72 720 Td ({text}) Tj ET".encode(), 9)
    page = zlib.compress(b"/Fm0 Do\n" * draws, 9)
    objs = [
        b"<< /Type /Catalog /Pages 2 0 R >>",
        b"<< /Type /Pages /Kids [4 0 R] /Count 1 >>",
        b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>",
        b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Resources << /XObject << /Fm0 6 0 R >> >> "
        b"/Contents 5 0 R >>",
        f"<< /Length {len(page)} /Filter /FlateDecode >>\nstream\n".encode() + page + b"\nendstream",
        b"<< /Type /XObject /Subtype /Form /BBox [0 0 612 792] /Resources << /Font << /F1 3 0 R >> >> "
        + f"/Length {len(form)} /Filter /FlateDecode >>\nstream\n".encode()
        + form
        + b"\nendstream",
    ]
    return pdf_file(objs)


def test_pdf_form_drawn_thousands_of_times_is_stopped_while_it_is_extracted():
    """A ~1.4 KB PDF drawing one form 5,000 times extracted to 10 M characters (under the
    20 M document cap), all from one page. The budget is counted while pypdf draws the page."""
    import time

    from llmweb.retrieval import parsers

    data = form_bomb_pdf()
    assert len(data) < 2_000
    small = parse_document(form_bomb_pdf(draws=2), "two.pdf")  # the same form drawn twice reads fine
    assert small.text.count("dull boy") == 100
    t0 = time.perf_counter()
    with pytest.raises(InputError, match=r"bomb.pdf holds more than 200,000 characters of text for a"):
        parse_document(data, "bomb.pdf")
    elapsed = time.perf_counter() - t0
    budget = parsers._pdf_text_budget(len(data))
    print(f"\nform bomb: {len(data):,} bytes refused after {elapsed:.2f} s (budget {budget:,} characters)")


def test_html_size_and_depth_limits(monkeypatch):
    from llmweb.retrieval import parsers as documents

    deep = b"<div>" * (documents.MAX_HTML_DEPTH + 1) + b"x"
    with pytest.raises(InputError, match=r"deep.html nests HTML elements more than 5,000 levels deep"):
        parse_document(deep, "deep.html")
    ok = b"<div>" * 3000 + b"<h1>Title</h1><p>text</p>" + b"</div>" * 3000
    assert parse_document(ok, "ok.html").text == "Title\n\ntext"
    monkeypatch.setattr(documents, "MAX_HTML_BYTES", 1000)
    with pytest.raises(InputError, match=r"big.html is 0.0 MB of HTML; the limit is 0 MB"):
        parse_document(b"<p>x</p>" * 200, "big.html")


def test_html_walk_keeps_blocks_headings_and_pre():
    html = (
        b"<html><head><title>T</title><style>p{}</style></head><body>"
        b"<h2>Head <b>bold</b></h2><div>one <span>two</span><p>three</p> four</div>"
        b"<pre>  a\n  b</pre><script>x()</script><!-- note --></body></html>"
    )
    doc = parse_document(html, "page.html")
    assert doc.text == "Head bold\n\none two\n\nthree\n\nfour\n\na\n  b"  # blocks are stripped
    assert [s.heading for s in doc.sections] == ["Head bold"]


def test_markdown_atx_headings_by_scanning():
    text = "# One #\n\nbody\n\n##   Two  ##  \n\ntext\n\n####### not a heading\n\n#    \n\nend\n"
    doc = parse_document(text.encode(), "h.md")
    # "#" and blanks only: the old regex gave the heading one of the blanks; cleaned, it is ""
    assert [s.heading for s in doc.sections] == ["One", "Two", ""]
    started = [doc.text[s.start :].split("\n")[0] for s in doc.sections]
    assert started == ["# One #", "##   Two  ##  ", "#    "]


def test_very_long_names_are_refused():
    from llmweb.retrieval.parsers import MAX_PATH_CHARS

    with pytest.raises(InputError, match=r"A file name is 4,100 characters long; the limit is 4,096\."):
        display_name("a/" * 2048 + "b.md")
    assert MAX_PATH_CHARS == 4096
    assert safe_name("x" * 300 + ".md") == "x" * 197 + ".md"  # long, not refused: cut to MAX_NAME_CHARS


OLD_ATX = r"^ {0,3}(#{1,6})[ \t]+(.+?)[ \t]*#*[ \t]*$"  # cubic on a heading line of blanks


@given(st.text(alphabet=" #\tab", max_size=16))
def test_atx_heading_scan_answers_as_the_old_regex(line):
    import re

    from llmweb.retrieval.parsers import _atx_heading

    m = re.match(OLD_ATX, line)
    assert _atx_heading(line) == (m.group(2) if m else None)
