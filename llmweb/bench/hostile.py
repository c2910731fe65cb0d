"""`bench hostile`: every function that reads user, document, import or model text, fed pathological
inputs at 1x and 16x their size; linear code takes ~16x as long, quadratic code ~256x.

One hostile chat message must not freeze the server: `re` holds the GIL, so a regex that
backtracks over a long line stops the event loop and the engine with it (a 62,000-character line
of dashes cost 70-100 s per pass of the old sentence regex). `CASES` are the inputs (long runs
without punctuation, many newlines, deep nesting, long digit runs, mixed scripts, combining marks,
long dash runs...), `TARGETS` the text functions; `measure` times one pair as the best of a few
repeats at each size and reports the 16x/1x ratio. tests/test_linear_text.py runs the same pairs
and asserts every ratio <= MAX_RATIO; `run()` is the table this command prints.

The 1x size is found per pair (doubled from a small start until one call takes a few ms), so a
ratio measures the growth of the work, not the timer's resolution or a fixed start-up cost.
"""

from __future__ import annotations

import gc
import io
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, cast

MAX_RATIO = 25.0  # 16x the input may take at most this many times as long (linear: ~16, quadratic: ~256)
GROWTH = 16
REPEATS = 3
MIN_SECONDS = 0.0005  # the 1x input is grown until one call takes this long, and twice its fixed cost
START_CHARS = 256
MAX_CHARS = 4_096  # the largest 1x input (16x: 64k characters, which stay in the caches)


@dataclass(frozen=True)
class Case:
    """A pathological input: `make(n)` is about n characters of it."""

    name: str
    make: Callable[[int], str]


@dataclass(frozen=True)
class Target:
    """A text function: `prepare(text)` builds its argument (untimed), `call(arg)` is timed."""

    name: str
    call: Callable[[Any], object]
    prepare: Callable[[str], Any] = lambda text: text
    cases: tuple[str, ...] = ()  # the names of the cases it is fed; () = every case


@dataclass(frozen=True)
class Timing:
    case: str
    target: str
    chars: int  # size of the 1x input
    seconds_1x: float
    seconds_16x: float

    @property
    def ratio(self) -> float:
        return self.seconds_16x / max(self.seconds_1x, 1e-9)


def _repeat(unit: str, n: int) -> str:
    return (unit * (n // len(unit) + 1))[:n]


CASES: tuple[Case, ...] = (
    Case("long line, no end mark, then a newline", lambda n: _repeat("lorem ipsum dolor sit ", n) + "\nnext"),
    Case("long dash run", lambda n: "-" * n + "\n-"),
    Case("long digit run", lambda n: "7" * n + "\nx"),
    Case("many newlines", lambda n: _repeat("a b\n", n)),
    Case("blank lines", lambda n: "\n" * n + "x"),
    Case("mixed scripts", lambda n: _repeat("Straße 東京 서울 القاهرة Ωμέγα Ünïcödé ", n) + "\n"),
    Case("combining marks", lambda n: "a" + _repeat("e\u0301\u0302\u0303", n) + "\nb"),
    Case("blanks inside a line", lambda n: "# a" + " " * n + "b\nc"),
    Case("many short sentences", lambda n: _repeat("I am Bo. ", n)),
    Case("chatter sentences", lambda n: "Summary: " + _repeat("Let me know. ", n)),
    Case("end marks and quotes", lambda n: _repeat('.")', n) + "x"),
    Case("hashes and stars", lambda n: _repeat("#*_", n) + "\nx"),
    Case("deep nesting", lambda n: "<div>" * (n // 16) + "x." + "</div>" * (n // 16)),
    Case("one long word", lambda n: "My " + "x" * n + " is 5"),
    Case("lines of combining marks", lambda n: _repeat("\u0301\u0302\n", n) + "x"),
)


# --------------------------------------------------------------------------- targets


class _WordFormat:
    """A chat format whose tokens are whitespace-separated words (what `clean_summary` needs)."""

    @staticmethod
    def count(text: str) -> int:
        return len(text.split())


def _words(text: str) -> int:
    return len(text.split())


_W = 'xmlns:w="http://schemas.openxmlformats.org/wordprocessingml/2006/main"'


def _docx(text: str) -> bytes:
    """A .docx with a heading, a paragraph per line of `text`, and a table of a row per 8 lines whose
    first column is one tall vertically merged cell (python-docx's own `row.cells` was quadratic in it)."""
    import zipfile
    from xml.sax.saxutils import escape

    import docx

    lines = text.split("\n")
    body = ['<w:p><w:pPr><w:pStyle w:val="Heading1"/></w:pPr><w:r><w:t>Title</w:t></w:r></w:p>']
    body += [f'<w:p><w:r><w:t xml:space="preserve">{escape(line)}</w:t></w:r></w:p>' for line in lines]
    rows = []
    for i, line in enumerate(lines[::8]):
        merge = '<w:vMerge w:val="restart"/>' if i == 0 else "<w:vMerge/>"
        first = "<w:p><w:r><w:t>merged</w:t></w:r></w:p>" if i == 0 else "<w:p/>"
        rows.append(
            f"<w:tr><w:tc><w:tcPr>{merge}</w:tcPr>{first}</w:tc>"
            f'<w:tc><w:p><w:r><w:t xml:space="preserve">{escape(line[:40])}</w:t></w:r></w:p></w:tc></w:tr>'
        )
    grid = '<w:tblGrid><w:gridCol w:w="2000"/><w:gridCol w:w="2000"/></w:tblGrid>'
    body.append(f"<w:tbl>{grid}{''.join(rows)}</w:tbl>")
    xml = (
        '<?xml version="1.0" encoding="UTF-8" standalone="yes"?>'
        f"<w:document {_W}><w:body>{''.join(body)}</w:body></w:document>"
    )
    template = io.BytesIO()
    docx.Document().save(template)  # python-docx's default package, its document replaced
    out = io.BytesIO()
    with zipfile.ZipFile(template) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as dst:
        for item in src.infolist():
            data = xml.encode() if item.filename == "word/document.xml" else src.read(item.filename)
            dst.writestr(item.filename, data)
    return out.getvalue()


def _one_page_pdf(text: str) -> bytes:
    return make_pdf([text])


def make_pdf(pages: list[str]) -> bytes:
    """A minimal valid PDF, one page per item, one Helvetica text line per "\\n"-separated line
    (text outside Latin-1 becomes "?"). The document tests build their PDFs with it too."""
    streams = []
    for text in pages:
        esc = text.replace("\\", "\\\\").replace("(", "\\(").replace(")", "\\)")
        lines = " ".join(f"({line}) Tj T*" for line in esc.split("\n"))
        streams.append(f"BT /F1 12 Tf 14 TL 72 720 Td {lines} ET".encode("latin-1", "replace"))
    return pdf_pages(streams)


def pdf_pages(streams: list[bytes], flate: bool = False) -> bytes:
    """A PDF of one page per content stream, in Helvetica as font F1; `flate`: the streams are
    zlib-compressed (/FlateDecode), as most PDF writers store them."""
    import zlib

    kids = " ".join(f"{4 + 2 * i} 0 R" for i in range(len(streams)))
    objs = [
        b"<< /Type /Catalog /Pages 2 0 R >>",
        f"<< /Type /Pages /Kids [{kids}] /Count {len(streams)} >>".encode(),
        b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>",
    ]
    for i, stream in enumerate(streams):
        data = zlib.compress(stream, 9) if flate else stream
        objs.append(
            b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Resources << /Font << /F1 3 0 R >> >> "
            + f"/Contents {5 + 2 * i} 0 R >>".encode()
        )
        head = f"<< /Length {len(data)}{' /Filter /FlateDecode' if flate else ''} >>\nstream\n".encode()
        objs.append(head + data + b"\nendstream")
    return pdf_file(objs)


def pdf_file(objs: list[bytes]) -> bytes:
    """A PDF file of these object bodies (object 1 the catalog), with its cross-reference table."""
    out = b"%PDF-1.4\n"
    offsets = []
    for i, body in enumerate(objs, 1):
        offsets.append(len(out))
        out += f"{i} 0 obj\n".encode() + body + b"\nendobj\n"
    xref = len(out)
    out += f"xref\n0 {len(objs) + 1}\n0000000000 65535 f \n".encode()
    out += b"".join(f"{o:010d} 00000 n \n".encode() for o in offsets)
    out += f"trailer\n<< /Size {len(objs) + 1} /Root 1 0 R >>\nstartxref\n{xref}\n%%EOF\n".encode()
    return out


def _parse(suffix: str) -> Callable[[bytes], object]:
    from llmweb.errors import InputError
    from llmweb.retrieval.parsers import parse_document

    def call(data: bytes) -> object:
        try:
            return parse_document(data, "hostile" + suffix)
        except InputError as e:  # "contains no text" is an answer too; a refused limit is not a pass here
            if "no text" in str(e) or "no extractable text" in str(e):
                return None
            raise

    return call


def _chunker() -> Callable[[Any], object] | None:
    """chunk_document with the embedder's tokenizer, or None where the embedder is not installed."""
    try:
        from transformers import AutoTokenizer

        from llmweb.retrieval.embedder import default_embedder_path

        tokenizer = AutoTokenizer.from_pretrained(default_embedder_path())
    except Exception:  # noqa: BLE001 - no embedder here: the target is left out
        return None
    from llmweb.retrieval.chunking import chunk_document

    return lambda doc: chunk_document(doc, tokenizer, max_tokens=200, overlap=40)


# python-docx and pypdf cost ~10 ms a file and ~20 us a paragraph: fed the cases that differ for them
_FILE_CASES = ("long line, no end mark, then a newline", "many newlines")


def _display_name(text: str) -> object:
    from llmweb.errors import InputError
    from llmweb.retrieval.parsers import MAX_PATH_CHARS, display_name

    name = text.replace("\n", "/") + ".md"
    try:
        return display_name(name)
    except InputError:  # past MAX_PATH_CHARS: refused without reading it
        if len(name) > MAX_PATH_CHARS:
            return None
        raise


def _as_document(text: str) -> Any:
    from llmweb.retrieval.parsers import parse_document

    return parse_document(text.encode(), "hostile.md")


def _detect(text: str) -> object:
    """A whole-document task's rule over a message (chat/document_plan.py), with 200 documents to name."""
    from llmweb.chat import document_plan

    docs = [document_plan.DocRef(f"d{i}", f"document-{i}.txt", float(i)) for i in range(200)]
    return document_plan.detect(f"Summarise {text} document-7.txt", docs, force=True)


def _as_chunks(text: str) -> list:
    """The text as a document's chunks of 2,000 characters, each overlapping the last by 100."""
    from llmweb.records import Chunk

    step = 1_900
    return [
        Chunk(text[i : i + 2_000], "x.txt", start=i, end=min(i + 2_000, len(text))) for i in range(0, len(text), step)
    ]


def _cited(text: str) -> tuple:
    """The text's chunks (`_as_chunks`) and a source cited over all of them, as a whole-document
    task cites a piece (chat/passages.py opens it)."""
    from llmweb.records import Chunk, Source

    return _as_chunks(text), Source.from_chunk(Chunk(text, "x.txt", start=0, end=len(text), doc_id="d"), 1)


def targets(chunking: bool = True) -> list[Target]:
    """Every text function on a path from a stranger's text (chat message, upload, import, the
    model's own replies folded into summaries). The API's wire parsing (web/api/) is a peer
    layer that bench may not import: tests/test_linear_text.py adds it to these."""
    from llmweb.chat import document_plan, facts, passages, summary
    from llmweb.chat.session import clean_message
    from llmweb.retrieval import keywords

    fmt = cast(Any, _WordFormat())
    out = [
        Target("facts.sentences", facts.sentences),
        Target("facts.salient_terms", facts.salient_terms),
        Target("facts.detail_terms", facts.detail_terms),
        Target("facts.vocabulary", facts.vocabulary),
        Target("facts.unkept_statements", lambda t: facts.unkept_statements(t, {"known"})),
        Target("facts.ground", lambda t: facts.ground(t, t)),
        Target("facts.is_fact", facts.is_fact),
        Target("facts.extract_facts", lambda t: facts.extract_facts([t])),
        Target("summary.cap_text", lambda t: summary.cap_text(t, 64, _words)),
        Target("summary.clean_summary", lambda t: summary.clean_summary(t, 64, fmt)),
        Target("session.clean_message", lambda t: clean_message(t, 10**8)),
        Target("keywords.content_words", keywords.content_words),
        Target("documents.display_name", _display_name),
        Target("document_plan.detect", _detect),
        Target("document_plan.split", lambda chunks: document_plan.split(chunks, 64, _words), _as_chunks),
        Target("document_plan.attribute", lambda t: document_plan.attribute(t, document_plan.cite_index({1: t}), 1)),
        Target("document_plan.by_section", lambda t: document_plan.by_section([(1, 2, t)])),
        Target("passages.locate", lambda cited: passages.locate(*cited), _cited),
        Target("documents.parse .txt", _parse(".txt"), lambda t: t.encode()),
        Target("documents.parse .md", _parse(".md"), lambda t: t.encode()),
        Target("documents.parse .html", _parse(".html"), lambda t: t.encode()),
        Target("documents.parse .docx", _parse(".docx"), _docx, _FILE_CASES),
        Target("documents.parse .pdf", _parse(".pdf"), _one_page_pdf, _FILE_CASES),
    ]
    chunk = _chunker() if chunking else None
    if chunk is not None:
        out.append(Target("documents.chunk_document", chunk, _as_document))
    return out


# --------------------------------------------------------------------------- measuring


def _time(call: Callable[[Any], object], arg: Any) -> float:
    """The CPU time of one call (this thread's): on a shared machine a long call loses wall time to
    other processes' time slices that a short one often escapes, which would read as growth."""
    t0 = time.thread_time()
    call(arg)
    return time.thread_time() - t0


def measure(case: Case, target: Target, repeats: int = REPEATS) -> Timing:
    """The best of `repeats` calls on the 1x input and on the 16x input, taken in turn (so a busy
    moment of the machine slows both sizes, not one).

    The 1x size doubles from START_CHARS until a call takes MIN_SECONDS and twice the call's fixed
    cost (its time on the smallest input), or MAX_CHARS is reached: small enough that both sizes
    stay in the processor's caches, where time grows with the work and not with cache misses."""
    n = START_CHARS
    enabled = gc.isenabled()
    gc.disable()  # a collection landing in one run and not the other is noise, not growth
    try:
        # warm (imports, first-use caches), then the fixed cost: the time on the smallest input
        arg = target.prepare(case.make(n))
        fixed = min(_time(target.call, arg) for _ in range(2))
        floor = max(MIN_SECONDS, 2 * fixed)
        while (t1 := _time(target.call, arg)) < floor and n < MAX_CHARS:
            n *= 2
            arg = target.prepare(case.make(n))
        big = target.prepare(case.make(GROWTH * n))
        t16 = float("inf")
        for _ in range(repeats):
            t1, t16 = min(t1, _time(target.call, arg)), min(t16, _time(target.call, big))
    finally:
        if enabled:
            gc.enable()
    return Timing(case.name, target.name, n, t1, t16)


def measure_steady(case: Case, target: Target, retries: int = 2) -> Timing:
    """`measure`, again (twice the repeats, up to `retries` times) while the ratio is over MAX_RATIO,
    keeping the lowest: a busy machine can slow one size and not the other, but quadratic work
    stays far over every time."""
    timing = measure(case, target)
    for _ in range(retries):
        if timing.ratio <= MAX_RATIO:
            break
        timing = min(timing, measure(case, target, repeats=2 * REPEATS), key=lambda t: t.ratio)
    return timing


def pairs(chunking: bool = True, extra: Iterable[Target] = ()) -> Iterable[tuple[Case, Target]]:
    for target in [*targets(chunking), *extra]:
        for case in CASES:
            if not target.cases or case.name in target.cases:
                yield case, target


def run(progress: Callable[[str], None] = lambda _: None) -> dict:
    """Every pair of `pairs()`, measured: a row each (sizes, times, ratio), the worst, the verdict."""
    rows: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    for case, target in pairs():
        timing = measure_steady(case, target)
        rows.append(
            {
                "target": timing.target,
                "case": timing.case,
                "chars": timing.chars,
                "ms_1x": round(timing.seconds_1x * 1000, 3),
                "ms_16x": round(timing.seconds_16x * 1000, 3),
                "ratio": round(timing.ratio, 1),
            }
        )
        if timing.ratio > MAX_RATIO:
            progress(f"over {MAX_RATIO:g}x: {timing.target} on {timing.case}: {timing.ratio:.1f}x")
    worst = max(rows, key=lambda r: r["ratio"])
    return {
        "growth": GROWTH,
        "max_ratio": MAX_RATIO,
        "rows": rows,
        "worst": worst,
        "all_linear": all(r["ratio"] <= MAX_RATIO for r in rows),
        "seconds": round(time.perf_counter() - t0, 1),
    }


def markdown(r: dict) -> str:
    lines = [
        f"## Hostile text: time on {r['growth']}x the input over time on 1x (linear ~{r['growth']}, quadratic "
        f"~{r['growth'] ** 2}; limit {r['max_ratio']:g})",
        "",
        "| function | input | 1x chars | 1x ms | 16x ms | ratio |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for row in r["rows"]:
        lines.append(
            f"| {row['target']} | {row['case']} | {row['chars']:,} | {row['ms_1x']:.2f} | {row['ms_16x']:.2f} "
            f"| {row['ratio']:.1f} |"
        )
    w = r["worst"]
    lines += [
        "",
        f"Worst: {w['target']} on {w['case']}, {w['ratio']:.1f}x. Every ratio <= {r['max_ratio']:g}: "
        f"**{'yes' if r['all_linear'] else 'no'}**. {r['seconds']:.0f} s.",
        "",
    ]
    return "\n".join(lines)
