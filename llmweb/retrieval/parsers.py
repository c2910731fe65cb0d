"""Parsers: read a user's file into text with structure, within limits on what it may unpack to.

Contract:
- `load_document(path, name)` reads one file (.txt, .md, .pdf, .html/.htm, .docx, or an image:
  .png, .jpg/.jpeg, .tif/.tiff, .webp) and returns a `Document`: the extracted text, `Section`s
  saying which page (PDF, multi-page TIFF) or nearest heading (Markdown, HTML, DOCX) covers each
  character range, and a content hash used as `doc_id`. Anything we cannot use raises
  `InputError` with one sentence naming the file and the problem.
- `parse_document(data, name)` does the same from bytes already read (a document is parsed once).
- Images, and PDF pages without a text layer, are read by OCR (retrieval/scans.py) within the
  `OcrLimits` passed in; `progress(what)` hears each OCR page before it is read.
- `safe_name(name)` turns a user-given file name into a display name that is a plain basename.

Every loader is linear in its input and capped while it reads (text, pages, unpacked bytes,
nesting), because a small file can be a bomb. This module reads files and never writes any, and
never chunks or tokenizes (chunking.py does).
"""

from __future__ import annotations

import codecs
import hashlib
import io
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from llmweb.config import Settings
from llmweb.errors import InputError
from llmweb.retrieval import scans
from llmweb.retrieval.scans import IMAGE_SUFFIXES, OcrLimits, Progress

SUPPORTED_SUFFIXES = (".txt", ".md", ".markdown", ".pdf", ".html", ".htm", ".docx", *IMAGE_SUFFIXES)
MB = 1024 * 1024
MAX_NAME_CHARS = 200
MAX_PATH_CHARS = 4096  # a name given with its folders (Linux's PATH_MAX); longer is refused before it is read
# Limits on what a file may unpack to, checked while it is read, whatever its size on disk (a small
# file can be a bomb: a .docx is a zip, PDF pages are compressed streams, HTML can nest without end).
MAX_TEXT_CHARS = 20_000_000  # extracted text of one document (about 4,000 pages of prose)
MAX_PDF_PAGES = 5_000
# A PDF's text is counted while it is drawn: a 1 KB file can draw one form thousands of times.
MAX_PDF_CHARS_PER_BYTE = 50
MIN_PDF_TEXT_CHARS = 200_000  # small files get this much whatever their size (about 60 pages)
MAX_PDF_OPERATIONS = 20_000_000  # content-stream operations in all (text or not), forms included
MAX_DOCX_UNPACKED_BYTES = 100 * MB  # the sum of the zip's members' uncompressed sizes
MAX_DOCX_MEMBERS = 5_000
MAX_DOCX_ROW_CELLS = 1_000  # grid cells in one table row, spans counted (Word itself stops at 63 columns)
MAX_HTML_BYTES = 50 * MB
MAX_HTML_DEPTH = 5_000  # elements inside elements (unclosed <p> and <li> nest too, in html.parser)
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Section:
    """A character range of a document's text with where it sits (page or heading)."""

    start: int
    end: int
    page: int | None = None  # 1-based, PDFs only
    heading: str | None = None


@dataclass(frozen=True, slots=True)
class Document:
    """One file's extracted text. Chunk offsets index into `text`."""

    name: str  # display name: a basename (or a relative path inside an ingested folder)
    text: str
    sections: tuple[Section, ...]
    doc_id: str  # content hash of the file's bytes: the same bytes give the same id
    size: int  # bytes on disk


# --------------------------------------------------------------------------- names


def safe_name(name: str) -> str:
    """The last path component of a user-given name, without control characters.

    "../../etc/passwd" -> "passwd", "/tmp/x.txt" -> "x.txt", "C:\\Users\\me\\a.md" -> "a.md".
    Raises InputError when nothing usable is left (e.g. "", "..", "/").
    """
    _check_path_length(name)
    base = re.split(r"[\\/]", str(name))[-1]
    base = re.sub(r"^[A-Za-z]:", "", base)  # a Windows drive prefix such as "C:file.txt"
    base = "".join(ch for ch in base if ch.isprintable()).strip()
    if base in ("", ".", ".."):
        raise InputError(f"The file name {name!r} has no usable name part; rename the file and try again.")
    if len(base) > MAX_NAME_CHARS:
        stem, dot, suffix = base.rpartition(".")
        keep = suffix if dot and len(suffix) <= 10 else ""
        base = base[: MAX_NAME_CHARS - len(keep) - 1] + ("." + keep if keep else "")
    return base


def display_name(name: str) -> str:
    """Like `safe_name`, but keeps a relative path ("notes/2024/a.md") minus "..", "." and roots."""
    _check_path_length(name)
    parts = [
        p
        for p in re.split(r"[\\/]", str(name))
        if p.strip() not in ("", ".", "..") and not re.fullmatch(r"[A-Za-z]:", p)
    ]
    if not parts:
        raise InputError(f"The file name {name!r} has no usable name part; rename the file and try again.")
    return "/".join(safe_name(p) for p in parts)


def _check_path_length(name: str) -> None:
    if len(str(name)) > MAX_PATH_CHARS:
        raise InputError(f"A file name is {len(str(name)):,} characters long; the limit is {MAX_PATH_CHARS:,}.")


def hash_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:32]


# --------------------------------------------------------------------------- loading


def load_document(
    path: str | Path,
    name: str | None = None,
    *,
    max_mb: float | None = None,
    ocr: OcrLimits | None = None,
    progress: Progress | None = None,
) -> Document:
    """Read and parse one file. `name` is the display name (default: the file's basename);
    it is passed through `display_name`, so it can never be absolute or climb with "..".

    The size cap is checked on the file's size before anything is read.
    """
    name, suffix, data = read_file(path, name, max_mb=max_mb)
    return parse_document(data, name, suffix=suffix, ocr=ocr, progress=progress)


def read_file(path: str | Path, name: str | None = None, *, max_mb: float | None = None) -> tuple[str, str, bytes]:
    """One file's (display name, suffix, bytes), unparsed: `load_document`'s checks and read, for a
    caller that looks at the bytes (a duplicate, a quota) before paying for the parse."""
    path = Path(path)
    name = display_name(name) if name is not None else safe_name(path.name)
    suffix = Path(name).suffix.lower() or path.suffix.lower()
    _check_suffix(name, suffix)
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise InputError(f"{name}: file not found.") from None
    except OSError as e:
        raise InputError(f"{name}: cannot read the file ({e.strerror or e}).") from None
    if not path.is_file():
        raise InputError(f"{name}: not a regular file.")
    if max_mb is not None and size > max_mb * MB:
        raise InputError(f"{name} is {size / MB:.1f} MB; the limit is {max_mb:g} MB (LLMWEB_MAX_FILE_MB).")
    try:
        return name, suffix, path.read_bytes()
    except OSError as e:
        raise InputError(f"{name}: cannot read the file ({e.strerror or e}).") from None


def parse_document(
    data: bytes,
    name: str,
    *,
    suffix: str | None = None,
    ocr: OcrLimits | None = None,
    progress: Progress | None = None,
) -> Document:
    """Parse a file's bytes; `suffix` (e.g. ".pdf") defaults to the name's extension. `ocr`: the
    limits of OCR (default: Settings' defaults); `progress` hears each page OCR reads."""
    suffix = (suffix or Path(name).suffix).lower()
    _check_suffix(name, suffix)
    ocr = ocr if ocr is not None else OcrLimits.of(Settings())
    if not data:
        raise InputError(f"{name} is empty.")
    if suffix == ".pdf":
        text, sections = _parse_pdf(data, name, ocr, progress)
    elif suffix in IMAGE_SUFFIXES:
        text, spans = scans.read_image(data, name, ocr, progress)
        sections = [Section(start, end, page=page) for start, end, page in spans]
    elif suffix == ".docx":
        text, sections = _parse_docx(data, name)
    elif suffix in (".html", ".htm"):
        text, sections = _parse_html(data, name)
    elif suffix in (".md", ".markdown"):
        text = _normalise(_decode_text(data, name))
        sections = _markdown_sections(text)
    else:
        text = _normalise(_decode_text(data, name))
        sections = [Section(0, len(text))]
    if not text.strip():
        raise InputError(f"{name} contains no text.")
    return Document(
        name=name,
        text=text,
        sections=tuple(s for s in sections if s.end > s.start),
        doc_id=hash_bytes(data),
        size=len(data),
    )


def _check_suffix(name: str, suffix: str) -> None:
    if suffix not in SUPPORTED_SUFFIXES:
        what = f"'{suffix}' files are" if suffix else "files without an extension are"
        raise InputError(f"{name}: {what} not supported; use one of {', '.join(SUPPORTED_SUFFIXES)}.")


def _normalise(text: str) -> str:
    return text.replace("\r\n", "\n").replace("\r", "\n").replace("\x00", "")


def _decode_text(data: bytes, name: str) -> str:
    for bom, codec in (
        (codecs.BOM_UTF8, "utf-8-sig"),
        (codecs.BOM_UTF16_LE, "utf-16"),
        (codecs.BOM_UTF16_BE, "utf-16"),
    ):
        if data.startswith(bom):
            try:
                return data.decode(codec)
            except UnicodeDecodeError:
                break
    binary = f"{name} looks like a binary file, not text; was it renamed? Supported: {', '.join(SUPPORTED_SUFFIXES)}."
    if b"\x00" in data:
        raise InputError(binary)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        pass
    # Legacy 8-bit text (Windows-1252 / Latin-1) is common; accept it only if it reads as text.
    text = data.decode("cp1252", errors="replace")
    odd = sum(1 for ch in text if ch == "\ufffd" or (not ch.isprintable() and ch not in "\n\r\t\f"))
    if odd > max(2, len(text) // 200):
        raise InputError(binary)
    return text


# PDF ------------------------------------------------------------------------


def _parse_pdf(data: bytes, name: str, ocr: OcrLimits, progress: Progress | None) -> tuple[str, list[Section]]:
    reader, pages = _with_pdf_errors(name, lambda: _open_pdf(data, name))
    # pages without a text layer that draw an image are read by OCR; the others keep their text
    images = scans.PdfImages(reader, name)
    scanned = _with_pdf_errors(name, lambda: scans.pdf_pages_to_read(pages, images.has_images))
    if scanned and (ocr.enabled or not any(p.strip() for p in pages)):  # OCR off: the text pages alone
        read = _with_pdf_errors(name, lambda: scans.read_pdf_pages(images, scanned, ocr, progress))
        pages = [read.get(number, text) for number, text in enumerate(pages, 1)]
    parts: list[str] = []
    sections: list[Section] = []
    pos = 0
    for number, page_text in enumerate(pages, start=1):
        page_text = _normalise(page_text).strip()
        if not page_text:
            continue
        if parts:
            parts.append("\n\n")
            pos += 2
        sections.append(Section(pos, pos + len(page_text), page=number))
        parts.append(page_text)
        pos += len(page_text)
    if not parts and scanned:
        pages_word = "page" if len(scanned) == 1 else f"{len(scanned)} pages"
        raise InputError(
            f"No text found in {name}: it has no text layer, and OCR read nothing in its scanned {pages_word}."
        )
    if not parts:
        raise InputError(f"{name} has no extractable text (no text layer, and no image for OCR to read).")
    _check_text_size(name, pos)
    return "".join(parts), sections


def _open_pdf(data: bytes, name: str) -> tuple[Any, list[str]]:
    """The reader (decrypted if it opens with an empty password) and each page's text layer."""
    from pypdf import PdfReader
    from pypdf.errors import DependencyError, FileNotDecryptedError

    if not data.lstrip()[:5].startswith(b"%PDF"):
        raise InputError(f"{name} is not a valid PDF file (it does not start with %PDF).")
    try:
        reader = PdfReader(io.BytesIO(data))
        if reader.is_encrypted:
            try:
                opened = bool(reader.decrypt(""))  # "encrypted" PDFs with an empty user password open fine
            except (DependencyError, NotImplementedError):
                opened = False
            if not opened:
                raise InputError(f"{name} is password-protected (encrypted); remove the password and upload it again.")
        return reader, _pdf_pages(reader, name, len(data))
    except FileNotDecryptedError:
        raise InputError(
            f"{name} is password-protected (encrypted); remove the password and upload it again."
        ) from None


def _with_pdf_errors(name: str, read: Callable[[], T]) -> T:
    """`read()`, with pypdf's many exception types on a damaged file made one InputError."""
    try:
        return read()
    except InputError:
        raise
    except Exception as e:  # pypdf raises many types (PdfReadError, KeyError, ValueError...) on damaged files
        raise InputError(f"{name} could not be read as a PDF (damaged or malformed: {type(e).__name__}).") from None


def _pdf_pages(reader, name: str, size: int) -> list[str]:
    """Each page's text; refused past MAX_PDF_PAGES pages, or once the text drawn so far passes the
    document's budget (`_pdf_text_budget`). The budget is counted *while* pypdf extracts, through its
    visitor hooks, so one page drawing a form thousands of times stops at the budget, not after."""
    if len(reader.pages) > MAX_PDF_PAGES:
        raise InputError(f"{name} has {len(reader.pages):,} pages; the limit is {MAX_PDF_PAGES:,} pages.")
    budget = _PdfBudget(_pdf_text_budget(size))
    pages = []
    for page in reader.pages:
        try:
            text = page.extract_text(visitor_text=budget.text, visitor_operand_before=budget.operation) or ""
        except _PdfOverBudget:
            text = ""
        if budget.over:  # pypdf swallows errors inside a form: the flag says it stopped all the same
            raise InputError(
                f"{name} holds more than {budget.chars:,} characters of text for a {size:,}-byte file "
                "(a form drawn over and over?); the limit is that."
            )
        pages.append(text)
    return pages


def _pdf_text_budget(size: int) -> int:
    """Characters a PDF of `size` bytes may extract to: MAX_PDF_CHARS_PER_BYTE per byte (prose
    compresses about 3-4x, so real files stay far below), at least MIN_PDF_TEXT_CHARS, at most
    MAX_TEXT_CHARS."""
    return min(MAX_TEXT_CHARS, max(MIN_PDF_TEXT_CHARS, MAX_PDF_CHARS_PER_BYTE * size))


class _PdfOverBudget(Exception):
    pass


class _PdfBudget:
    """pypdf visitor hooks that count characters and operations, raising once either is spent."""

    def __init__(self, chars: int) -> None:
        self.chars = chars
        self.used = 0
        self.operations = 0
        self.over = False

    def text(self, text: str, *_: Any) -> None:
        self.used += len(text)
        self._check()

    def operation(self, *_: Any) -> None:
        self.operations += 1
        self._check()

    def _check(self) -> None:
        if self.used > self.chars or self.operations > MAX_PDF_OPERATIONS:
            self.over = True
        if self.over:  # sticky: every later hook call raises too, up through each nested form
            raise _PdfOverBudget


# DOCX -----------------------------------------------------------------------


def _check_docx_zip(data: bytes, name: str) -> None:
    """Refuse a .docx whose zip directory declares more than the limits unpack to (a zip bomb).

    zipfile never reads a member past the size its directory declares, so checking the declared
    sizes caps what python-docx can decompress."""
    import zipfile

    try:
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            members = z.infolist()
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as e:
        raise InputError(f"{name} could not be read as a Word .docx document ({type(e).__name__}).") from None
    if len(members) > MAX_DOCX_MEMBERS:
        raise InputError(f"{name} holds {len(members):,} files inside; the limit is {MAX_DOCX_MEMBERS:,}.")
    unpacked = sum(m.file_size for m in members)
    if unpacked > MAX_DOCX_UNPACKED_BYTES:
        raise InputError(
            f"{name} unpacks to {unpacked / MB:,.0f} MB; the limit is {MAX_DOCX_UNPACKED_BYTES // MB} MB "
            "(a compressed bomb?)."
        )


def _parse_docx(data: bytes, name: str) -> tuple[str, list[Section]]:
    import docx
    from docx.table import Table

    _check_docx_zip(data, name)
    try:
        document = docx.Document(io.BytesIO(data))
        blocks: list[tuple[str, bool]] = []  # (text, is_heading)
        styles: dict[str | None, str] = {}  # style id -> name: python-docx scans every style per lookup
        for item in document.iter_inner_content():
            if isinstance(item, Table):
                for line in _table_lines(item, name):
                    if line:
                        blocks.append((line, False))
            else:
                style_id = item._p.style
                if style_id not in styles:
                    styles[style_id] = (item.style.name if item.style is not None else "") or ""
                style = styles[style_id]
                is_heading = style.startswith("Heading") or style == "Title"
                blocks.append((item.text, is_heading))
    except InputError:
        raise
    except Exception as e:  # python-docx / zipfile / lxml raise many types on damaged files
        raise InputError(f"{name} could not be read as a Word .docx document ({type(e).__name__}).") from None
    _check_text_size(name, sum(len(t) for t, _ in blocks))
    return _join_blocks(blocks)


def _table_lines(table: Any, name: str) -> list[str]:
    """Each row's non-empty cell texts joined with " | ", as python-docx's `row.cells` gives them: a
    cell spanning n grid columns n times, a vertically merged cell (vMerge "continue") as the cell
    above it at the same grid offset. In one pass over the rows, where `row.cells` looked each merged
    cell up row by row (quadratic in a tall merge) and repeated a cell `gridSpan` times whatever the
    number (a row is refused past MAX_DOCX_ROW_CELLS)."""
    from docx.table import _Cell

    lines = []
    above: dict[int, tuple[str, int]] = {}  # grid offset -> (text, copies) of the row above's cells
    for tr in table._tbl.tr_lst:
        here: dict[int, tuple[str, int]] = {}
        cells: list[str] = []
        offset = tr.grid_before
        for tc in tr.tc_lst:
            if tc.vMerge == "continue":
                if offset not in above:
                    raise ValueError("a merged cell with no cell above it")
                text, copies = above[offset]
            else:
                text, copies = _Cell(tc, table).text.strip(), tc.grid_span
            if len(cells) + copies > MAX_DOCX_ROW_CELLS:
                raise InputError(f"{name} has a table row over {MAX_DOCX_ROW_CELLS:,} cells wide; the limit is that.")
            here[offset] = (text, copies)
            cells.extend([text] * copies)
            offset += tc.grid_span
        above = here
        lines.append(" | ".join(c for c in cells if c))
    return lines


def _check_text_size(name: str, chars: int) -> None:
    if chars > MAX_TEXT_CHARS:
        raise InputError(f"{name} holds {chars:,} characters of text; the limit is {MAX_TEXT_CHARS:,}.")


# HTML -----------------------------------------------------------------------

_HEADINGS = {"h1", "h2", "h3", "h4", "h5", "h6"}
_BLOCKS = _HEADINGS | {
    "p",
    "div",
    "section",
    "article",
    "main",
    "header",
    "footer",
    "nav",
    "aside",
    "li",
    "ul",
    "ol",
    "dl",
    "dt",
    "dd",
    "table",
    "tr",
    "td",
    "th",
    "pre",
    "blockquote",
    "figure",
    "figcaption",
    "form",
    "hr",
    "body",
    "html",
    "caption",
    "details",
    "summary",
    "address",
}
_SKIP = {"script", "style", "noscript", "template", "head", "svg", "iframe", "object"}


def _parse_html(data: bytes, name: str) -> tuple[str, list[Section]]:
    from bs4 import BeautifulSoup

    if len(data) > MAX_HTML_BYTES:
        raise InputError(f"{name} is {len(data) / MB:.1f} MB of HTML; the limit is {MAX_HTML_BYTES // MB} MB.")
    if b"\x00" in data and not data.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        raise InputError(f"{name} looks like a binary file, not HTML; was it renamed?")
    try:
        soup = BeautifulSoup(data, "html.parser")
    except Exception as e:  # html.parser is lenient; this is a last resort
        raise InputError(f"{name} could not be read as HTML ({type(e).__name__}).") from None
    title = soup.title.get_text(" ", strip=True) if soup.title else None
    for br in soup.find_all("br"):
        br.replace_with("\n")
    blocks = _html_blocks(soup, name)
    _check_text_size(name, sum(len(t) for t, _ in blocks))
    return _join_blocks(blocks, first_heading=title)


def _html_blocks(soup: Any, name: str) -> list[tuple[str, bool]]:
    """The strings of the page grouped by their nearest block element, in document order, as
    (text, is_heading): text inside a heading is a heading block, inside <pre> keeps its lines.

    One walk down the tree that carries each element's context (nearest block, inside a heading, a
    <pre>) to its children: linear, where asking each string for its ancestors cost the depth per
    string (quadratic in nesting). Elements in _SKIP are not entered; past MAX_HTML_DEPTH levels the
    page is refused."""
    from bs4.element import NavigableString, PreformattedString, Tag

    blocks: list[tuple[str, bool]] = []
    current: Any = None
    pieces: list[str] = []
    current_is_heading = False
    current_pre = False

    def flush() -> None:
        if pieces:
            raw = "".join(pieces)
            text = raw.strip("\n") if current_pre else re.sub(r"\s+", " ", raw).strip()
            blocks.append((text, current_is_heading))

    # each level: (its children, nearest block element, inside a heading, inside <pre>)
    stack: list[tuple[Any, Any, bool, bool]] = [(iter(soup.contents), None, False, False)]
    while stack:
        children, block, heading, pre = stack[-1]
        node = next(children, None)
        if node is None:
            stack.pop()
        elif isinstance(node, Tag):
            if node.name in _SKIP:
                continue
            if len(stack) > MAX_HTML_DEPTH:
                raise InputError(
                    f"{name} nests HTML elements more than {MAX_HTML_DEPTH:,} levels deep; the limit is that."
                )
            stack.append(
                (
                    iter(node.contents),
                    node if node.name in _BLOCKS else block,
                    heading or node.name in _HEADINGS,
                    pre or node.name == "pre",
                )
            )
        elif isinstance(node, NavigableString) and not isinstance(node, PreformattedString):
            # not comments, doctype, CDATA, processing instructions
            if block is not current:
                flush()
                pieces = []
                current, current_is_heading, current_pre = block, heading, pre
            pieces.append(str(node))
    flush()
    return blocks


def _join_blocks(blocks: Sequence[tuple[str, bool]], first_heading: str | None = None) -> tuple[str, list[Section]]:
    """Join text blocks with blank lines; each heading block starts a new section."""
    parts: list[str] = []
    sections: list[Section] = []
    pos = 0
    sec_start, heading = 0, first_heading or None
    for text, is_heading in blocks:
        text = _normalise(text).strip()
        if not text:
            continue
        if parts:
            parts.append("\n\n")
            pos += 2
        if is_heading:
            if pos > sec_start:
                sections.append(Section(sec_start, pos, heading=heading))
            sec_start, heading = pos, _clean_heading(text)
        parts.append(text)
        pos += len(text)
    sections.append(Section(sec_start, pos, heading=heading))
    return "".join(parts), sections


# Markdown -------------------------------------------------------------------

_ATX_OPEN = re.compile(r" {0,3}(#{1,6})[ \t]+")
_SETEXT = re.compile(r"^ {0,3}(=+|-+)[ \t]*$")
_FENCE = re.compile(r"^ {0,3}(```|~~~)")


def _markdown_sections(text: str) -> list[Section]:
    lines = text.split("\n")
    starts: list[tuple[int, str]] = []  # (char offset of the heading line, heading text)
    pos = 0
    fenced = False
    for i, line in enumerate(lines):
        if _FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            atx = _atx_heading(line)
            nxt = lines[i + 1] if i + 1 < len(lines) else ""
            if atx is not None:
                starts.append((pos, atx))
            elif (
                line.strip() and _SETEXT.match(nxt) and not _SETEXT.match(line) and (i == 0 or not lines[i - 1].strip())
            ):
                starts.append((pos, line.strip()))
        pos += len(line) + 1
    sections: list[Section] = []
    prev, heading = 0, None
    for start, title in starts:
        if start > prev:
            sections.append(Section(prev, start, heading=heading))
        prev, heading = start, _clean_heading(title)
    sections.append(Section(prev, len(text), heading=heading))
    return sections


def _atx_heading(line: str) -> str | None:
    """The text of an ATX heading line ("## Title ##" -> "Title"), or None for another line.

    What `^ {0,3}(#{1,6})[ \t]+(.+?)[ \t]*#*[ \t]*$` captured, by plain scanning: the lazy group
    against the trailing blanks and closing hashes retried every split of a line of spaces (cubic).
    The text is what is left once the longest run of blanks, hashes, blanks is cut from the end,
    and at least one character."""
    m = _ATX_OPEN.match(line)
    if m is None:
        return None
    rest = line[m.end() :]
    if rest:
        return rest[: max(1, len(rest.rstrip(" \t").rstrip("#").rstrip(" \t")))]
    # only blanks after the hashes: the text is their last one, when there are two or more
    return line[-1] if m.end() - m.end(1) >= 2 else None


def _clean_heading(text: str) -> str:
    text = re.sub(r"[`*_]+", "", text)
    return re.sub(r"\s+", " ", text).strip()[:200]
