"""OCR of images and scanned PDF pages (retrieval/scans.py, retrieval/ocr.py), without the embedder.

Most tests put a fake engine behind `ocr.engine()` (it records what it was given and answers
scripted text): the limits, the page selection, the messages, the progress and the citations'
page numbers are plain logic. The last tests read small rendered pages with the real engine.
"""

from __future__ import annotations

import io
import struct
import time
import zlib

import numpy as np
import pytest
from PIL import Image

from llmweb.bench.hostile import make_pdf, pdf_file
from llmweb.bench.ocr import NOTE, cer, note_photo, scan_page
from llmweb.errors import InputError
from llmweb.retrieval import ocr, scans
from llmweb.retrieval.chunking import chunk_document
from llmweb.retrieval.parsers import SUPPORTED_SUFFIXES, parse_document
from llmweb.retrieval.scans import OcrBudget, OcrLimits
from tests.retrieval.test_documents import tokenizer  # noqa: F401 (the embedder's tokenizer, a fixture)

LIMITS = OcrLimits(max_pages=50, max_seconds=300)


class FakeEngine:
    """Answers `texts` in turn (the last one again once they run out); records each image's size."""

    def __init__(self, *texts: str, delay: float = 0.0):
        self.texts = list(texts) or ["some text"]
        self.sizes: list[tuple[int, int]] = []
        self.delay = delay

    def read(self, image, deadline=None) -> str:
        assert image.mode == "RGB", "the engine gets what `prepare` made"
        self.sizes.append(image.size)
        time.sleep(self.delay)
        return self.texts[min(len(self.sizes), len(self.texts)) - 1]


@pytest.fixture
def engine(monkeypatch) -> FakeEngine:
    fake = FakeEngine("The badge code is 7391.")
    monkeypatch.setattr(ocr, "engine", lambda: fake)
    return fake


def png(image: Image.Image, fmt: str = "PNG", **kw) -> bytes:
    buf = io.BytesIO()
    image.save(buf, fmt, **kw)
    return buf.getvalue()


def scanned_pdf(*images: Image.Image) -> bytes:
    """An image-only PDF, one page per image, as Pillow writes it (each page one JPEG)."""
    buf = io.BytesIO()
    images[0].save(buf, "PDF", resolution=150, save_all=True, append_images=list(images[1:]))
    return buf.getvalue()


def merged(*pdfs: bytes, rotate: dict[int, int] | None = None) -> bytes:
    """The pages of several PDFs in one; `rotate` sets /Rotate on pages (1-based)."""
    from pypdf import PdfReader, PdfWriter

    writer = PdfWriter()
    for data in pdfs:
        for page in PdfReader(io.BytesIO(data)).pages:
            writer.add_page(page)
    for number, degrees in (rotate or {}).items():
        writer.pages[number - 1].rotate(degrees)
    buf = io.BytesIO()
    writer.write(buf)
    return buf.getvalue()


def png_header(width: int, height: int) -> bytes:
    """A PNG whose header declares width x height greyscale pixels, with one tiny data chunk."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0")) + chunk(b"IEND", b"")


def image_xobject_pdf(width: int, height: int) -> bytes:
    """One page drawing one image XObject that declares width x height grey pixels (tiny data)."""
    data = zlib.compress(b"\x80" * 64)
    content = b"q 612 0 0 792 0 0 cm /Im0 Do Q"
    return pdf_file(
        [
            b"<< /Type /Catalog /Pages 2 0 R >>",
            b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
            b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Resources << /XObject << /Im0 5 0 R >> >> "
            b"/Contents 4 0 R >>",
            b"<< /Length %d >>\nstream\n" % len(content) + content + b"\nendstream",
            b"<< /Type /XObject /Subtype /Image /Width %d /Height %d /ColorSpace /DeviceGray /BitsPerComponent 8 "
            b"/Filter /FlateDecode /Length %d >>\nstream\n" % (width, height, len(data)) + data + b"\nendstream",
        ]
    )


def small_scan(text: str, seed: int = 0) -> Image.Image:
    return scan_page(text, dpi=150, seed=seed, inches=(5.5, 2.5)).image


# ---- the budget: pages, time, progress (pure)


def test_the_budget_refuses_too_many_pages_before_any_is_read_and_says_which_setting():
    OcrBudget(OcrLimits(3, 60), "scan.pdf", 3)  # at the limit: fine
    with pytest.raises(InputError, match=r"scan\.pdf has 4 pages to read by OCR; the limit is 3 \(LLMWEB_OCR_MAX_"):
        OcrBudget(OcrLimits(3, 60), "scan.pdf", 4)
    with pytest.raises(InputError, match=r"note\.png: reading text from image \(OCR\) is turned off here"):
        OcrBudget(OcrLimits(0, 60), "note.png", 1)


def test_the_budget_stops_before_the_page_that_starts_past_the_time_limit_and_reports_each_page():
    now = [100.0]
    heard: list[str] = []
    budget = OcrBudget(OcrLimits(10, 30), "scan.pdf", 3, heard.append, clock=lambda: now[0])
    budget.page(2, 9)
    now[0] += 29.9
    budget.page(5, 9)
    now[0] += 0.1
    with pytest.raises(InputError, match=r"scan\.pdf: OCR stopped before page 7 of 9, after 30 s; the limit is 30 s"):
        budget.page(7, 9)
    assert heard == ["scan.pdf: reading page 2 of 9 (OCR)…", "scan.pdf: reading page 5 of 9 (OCR)…"]


def test_pdf_pages_to_read_are_those_without_a_text_layer_that_draw_an_image():
    texts = ["Intro text", "", "  \n ", "", "More text"]
    with_images = {1, 2, 3, 5}
    assert scans.pdf_pages_to_read(texts, lambda n: n in with_images) == [2, 3]
    assert scans.pdf_pages_to_read([], lambda n: True) == []


def test_check_pixels_refuses_big_and_empty_images():
    scans.check_pixels((5000, 7000), "a.png")  # 35 million: an A4 page at 600 dpi
    with pytest.raises(InputError, match=r"a\.png holds an image of 8,000 x 8,000 pixels \(page 3\) \(64 million\)"):
        scans.check_pixels((8000, 8000), "a.png", 3)
    with pytest.raises(InputError, match="nothing to read"):
        scans.check_pixels((0, 10), "a.png")


# ---- layout of the engine's boxes (pure)


def box(x: float, y: float, w: float = 100, h: float = 20) -> list[list[float]]:
    return [[x, y], [x + w, y], [x + w, y + h], [x, y + h]]


def test_layout_orders_lines_top_down_pieces_left_to_right_and_marks_paragraphs():
    boxes = [box(300, 2), box(10, 0), box(10, 30), box(10, 60), box(10, 150), box(10, 180)]
    texts = ["right", "left", "second", "third", "new paragraph", "its second line"]
    assert ocr.layout(boxes, texts) == "left right\nsecond\nthird\n\nnew paragraph\nits second line"
    assert ocr.layout([box(0, 0), box(0, 300)], ["one", "two"]) == "one\ntwo", "two lines: no usual step to beat"
    assert ocr.layout([box(0, 0)], ["  "]) == "" and ocr.layout([], []) == ""


# ---- images: what the engine gets, and the messages


def test_prepare_gives_rgb_over_white_turned_by_exif_and_pads_a_thin_strip():
    clear = Image.new("RGBA", (40, 40), (0, 0, 0, 0))
    assert scans.prepare(clear).getpixel((5, 5)) == (255, 255, 255), "transparency is paper, not black"
    wide = Image.new("L", (400, 300), 0)
    exif = wide.getexif()
    exif[0x0112] = 6  # the camera was held sideways: shown turned 90 degrees
    turned = Image.open(io.BytesIO(png(wide, "JPEG", exif=exif)))
    assert scans.prepare(turned).size == (300, 400)
    assert scans.prepare(Image.new("L", (1600, 20), 255)).size == (1600, 40), "padded to an aspect of 40"
    assert scans.prepare(Image.new("L", (4000, 20), 255)).size == (2000, 50), "shrunk to 2,000 first, then padded"
    deep = Image.fromarray(np.array([[1000, 3000]], dtype=np.uint16)).resize((64, 64))
    assert scans.prepare(deep).getextrema()[0] == (0, 255), "16-bit greys stretched to the 8-bit range"


def test_an_image_is_read_as_one_section_without_a_page(engine):
    heard: list[str] = []
    doc = parse_document(png(small_scan("hello")), "note.png", ocr=LIMITS, progress=heard.append)
    assert doc.text == "The badge code is 7391." and [(s.start, s.end, s.page) for s in doc.sections] == [(0, 23, None)]
    assert heard == ["note.png: reading the image (OCR)…"]


def test_each_page_of_a_multipage_tiff_is_a_page_of_the_citation(engine, tokenizer):  # noqa: F811
    engine.texts = ["Page one says hello.", "", "Page three has the badge code 7391."]
    frames = [Image.new("L", (200, 100), 255) for _ in range(3)]
    heard: list[str] = []
    tiff = png(frames[0], "TIFF", save_all=True, append_images=frames[1:])
    doc = parse_document(tiff, "fax.tiff", progress=heard.append)
    assert [s.page for s in doc.sections] == [1, 3], "a page where OCR found nothing has no section"
    assert heard == [f"fax.tiff: reading page {n} of 3 (OCR)…" for n in (1, 2, 3)]
    [chunk] = [c for c in chunk_document(doc, tokenizer, max_tokens=64, overlap=8) if "7391" in c.text]
    assert chunk.label() == "fax.tiff, p. 3"


@pytest.mark.parametrize(
    ("name", "data", "expected"),
    [
        ("broken.png", png(Image.new("L", (300, 200), 255))[:80], r"broken\.png could not be read as an image"),
        ("notes.png", b"just some text, renamed", r"notes\.png is not a PNG, JPEG, TIFF or WebP image"),
        ("anim.webp", png(Image.new("RGB", (10, 10)), "GIF"), r"anim\.webp is not a PNG, JPEG, TIFF or WebP"),
        ("big.png", png_header(8000, 8000), r"big\.png holds an image of 8,000 x 8,000 pixels \(64 million\)"),
        ("bomb.png", png_header(20000, 20000), r"bomb\.png declares far more pixels than the limit"),
    ],
)
def test_bad_images_get_one_sentence_and_the_engine_never_sees_them(engine, name, data, expected):
    with pytest.raises(InputError, match=expected):
        parse_document(data, name, ocr=LIMITS)
    assert engine.sizes == []


def test_a_tiff_of_more_pages_than_the_limit_is_refused_counting_no_further(engine):
    frames = [Image.new("L", (40, 40), 255) for _ in range(12)]
    tiff = png(frames[0], "TIFF", save_all=True, append_images=frames[1:])
    with pytest.raises(InputError, match=r"fax\.tiff has more than 5 pages to read by OCR; the limit is that"):
        parse_document(tiff, "fax.tiff", ocr=OcrLimits(5, 300))
    assert engine.sizes == []
    assert len(parse_document(tiff, "fax.tiff", ocr=OcrLimits(12, 300)).sections) == 12


def test_an_image_without_text_and_an_unsupported_format_say_so(engine):
    engine.texts = [""]
    with pytest.raises(InputError, match=r"^No text found in blank\.png: OCR read nothing in the image\.$"):
        parse_document(png(Image.new("L", (300, 200), 255)), "blank.png", ocr=LIMITS)
    with pytest.raises(InputError, match=r"photo\.bmp: '\.bmp' files are not supported; use one of .*\.png, \.jpg"):
        parse_document(png(Image.new("L", (30, 20)), "BMP"), "photo.bmp")
    assert {".png", ".jpg", ".jpeg", ".tif", ".tiff", ".webp"} <= set(SUPPORTED_SUFFIXES)


def test_ocr_turned_off_refuses_images_and_keeps_the_text_pages_of_a_mixed_pdf(engine):
    off = OcrLimits(0, 300)
    with pytest.raises(InputError, match=r"turned off here \(LLMWEB_OCR_MAX_PAGES=0\)"):
        parse_document(png(small_scan("x")), "note.png", ocr=off)
    mixed = merged(make_pdf(["A page with a text layer."]), scanned_pdf(small_scan("scanned")))
    doc = parse_document(mixed, "mixed.pdf", ocr=off)
    assert doc.text == "A page with a text layer." and engine.sizes == []
    with pytest.raises(InputError, match=r"turned off here"):
        parse_document(scanned_pdf(small_scan("scanned")), "scan.pdf", ocr=off)


# ---- PDFs: which pages are read, in which turn, and the limits


def test_a_mixed_pdf_keeps_its_text_layer_and_reads_only_its_image_pages(engine):
    engine.texts = ["Scanned page two.", "Scanned page three.", "Scanned page five."]
    pdf = merged(
        make_pdf(["Page one has a text layer."]),
        scanned_pdf(small_scan("two"), small_scan("x")),
        make_pdf([""]),  # a blank page without an image: nothing to read
    )
    pdf = merged(pdf, scanned_pdf(small_scan("five")), rotate={2: 90})
    heard: list[str] = []
    doc = parse_document(pdf, "mixed.pdf", ocr=LIMITS, progress=heard.append)
    assert heard == [f"mixed.pdf: reading page {n} of 5 (OCR)…" for n in (2, 3, 5)]
    assert len(engine.sizes) == 3, "the text page and the blank page are not read"
    width, height = small_scan("x").size
    assert engine.sizes[0] == (height, width), "page 2 has /Rotate 90: its image is turned as it is shown"
    assert engine.sizes[1] == (width, height)
    assert [(doc.text[s.start : s.end], s.page) for s in doc.sections] == [
        ("Page one has a text layer.", 1),
        ("Scanned page two.", 2),
        ("Scanned page three.", 3),
        ("Scanned page five.", 5),
    ]


def test_a_scanned_pdf_over_the_page_limit_is_refused_before_the_engine_runs(engine):
    pdf = scanned_pdf(*(small_scan(str(n)) for n in range(4)))
    with pytest.raises(InputError, match=r"scan\.pdf has 4 pages to read by OCR; the limit is 3"):
        parse_document(pdf, "scan.pdf", ocr=OcrLimits(3, 300))
    assert engine.sizes == []


def test_a_scanned_pdf_past_the_time_limit_is_refused_naming_the_page(monkeypatch):
    slow = FakeEngine("text", delay=0.2)
    monkeypatch.setattr(ocr, "engine", lambda: slow)
    pdf = scanned_pdf(*(small_scan(str(n)) for n in range(3)))
    with pytest.raises(InputError, match=r"scan\.pdf: OCR stopped before page 2 of 3, after 0 s; the limit is 0\.1 s"):
        parse_document(pdf, "scan.pdf", ocr=OcrLimits(50, 0.1))
    assert len(slow.sizes) == 1


def test_pdf_images_are_checked_by_their_declared_size_before_they_are_decoded(engine):
    with pytest.raises(InputError, match=r"huge\.pdf holds an image of 10,000 x 10,000 pixels \(page 1\)"):
        parse_document(image_xobject_pdf(10_000, 10_000), "huge.pdf", ocr=LIMITS)
    with pytest.raises(InputError, match=r"lying\.pdf: the image on page 1 could not be read"):
        parse_document(image_xobject_pdf(600, 800), "lying.pdf", ocr=LIMITS)  # 64 bytes of 480,000
    assert engine.sizes == []


def test_a_scanned_pdf_where_ocr_finds_nothing_and_a_blank_pdf_say_different_things(engine):
    engine.texts = [""]
    with pytest.raises(InputError, match=r"^No text found in scan\.pdf: .* OCR read nothing in its scanned 2 pages\.$"):
        parse_document(scanned_pdf(small_scan("a"), small_scan("b")), "scan.pdf", ocr=LIMITS)
    with pytest.raises(InputError, match=r"^blank\.pdf has no extractable text \(no text layer, and no image"):
        parse_document(make_pdf([""]), "blank.pdf", ocr=LIMITS)


def test_a_page_with_more_images_than_the_limit_is_refused(engine, monkeypatch):
    monkeypatch.setattr(scans, "MAX_IMAGES_PER_PAGE", 1)
    strips = merged(scanned_pdf(small_scan("a")))
    from pypdf import PdfReader, PdfWriter

    writer = PdfWriter(clone_from=PdfReader(io.BytesIO(strips)))
    page = writer.pages[0]
    xobjects = page["/Resources"]["/XObject"]
    [name] = list(xobjects)
    from pypdf.generic import NameObject

    xobjects[NameObject("/Im9")] = xobjects[name]  # the same image under a second name
    buf = io.BytesIO()
    writer.write(buf)
    with pytest.raises(InputError, match=r"strips\.pdf: page 1 draws 2 images; the limit is 1"):
        parse_document(buf.getvalue(), "strips.pdf", ocr=LIMITS)


def forms_pdf(forms: int, shared: int = 0) -> bytes:
    """One page without text whose resources hold `forms` distinct empty forms, plus `shared` more
    names for the first of them; no image anywhere."""
    names = [b"/F%d %d 0 R" % (i, 5 + i) for i in range(forms)] + [b"/S%d 5 0 R" % i for i in range(shared)]
    return pdf_file(
        [
            b"<< /Type /Catalog /Pages 2 0 R >>",
            b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
            b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Resources << /XObject << "
            + b" ".join(names)
            + b" >> >> /Contents 4 0 R >>",
            b"<< /Length 0 >>\nstream\n\nendstream",
            *[b"<< /Subtype /Form /BBox [0 0 1 1] /Length 0 >>\nstream\n\nendstream"] * forms,
        ]
    )


def test_a_page_of_thousands_of_forms_is_walked_once_each_not_by_pypdfs_quadratic_images(engine, monkeypatch):
    """pypdf's `page.images` checks each object against a list of those seen (4,000 forms: 1 s; a
    20 MB file of them: half an hour); llmweb's walk looks at each object once and is capped."""
    from pypdf import PdfReader
    from pypdf._page import PageObject

    def refuse(_page):
        raise AssertionError("pypdf's quadratic page.images was used")

    monkeypatch.setattr(PageObject, "images", property(refuse))
    images = scans.PdfImages(PdfReader(io.BytesIO(forms_pdf(8000, shared=500))), "forms.pdf")
    assert images.paths(1) == [] and images.visits == 8000, "each form once, its 500 other names skipped"
    with pytest.raises(InputError, match=r"^forms\.pdf has no extractable text"):
        parse_document(forms_pdf(8000), "forms.pdf", ocr=LIMITS)
    monkeypatch.setattr(scans, "MAX_XOBJECT_VISITS", 1000)
    with pytest.raises(
        InputError, match=r"forms\.pdf holds more than 1,000 images and forms to look through \(page 1\)"
    ):
        parse_document(forms_pdf(1001), "forms.pdf", ocr=LIMITS)
    assert engine.sizes == []


# ---- the real engine, on small pages (a second or two)


def test_the_real_engine_reads_a_photo_of_a_note_and_a_small_scan():
    doc = parse_document(png(note_photo().image, "JPEG", quality=80), "note.jpg", ocr=LIMITS)
    assert cer(NOTE, doc.text) < 0.05, doc.text
    assert "flowerpot" in doc.text and "QX-2291" in doc.text
    text = "The cold room is kept at 14 degrees.\nThe badge code for the east door is 7391."
    pdf = merged(make_pdf(["Opening hours: nine to five."]), scanned_pdf(small_scan(text)))
    doc = parse_document(pdf, "archive.pdf", ocr=LIMITS)
    [scanned] = [s for s in doc.sections if s.page == 2]
    assert cer(text, doc.text[scanned.start : scanned.end]) < 0.05, doc.text
    assert "7391" in doc.text[scanned.start : scanned.end]
    assert ocr.engine() is ocr.engine(), "loaded once"
