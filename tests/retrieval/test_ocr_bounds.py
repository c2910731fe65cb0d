"""OCR within memory and time, whoever uploads: a thin or endless image never becomes a huge canvas,
one upload event's OCR stops at LLMWEB_OCR_MAX_S across all its files (inside a page too), the
quota and duplicate checks come before any OCR, and one visitor's slow page does not hold another's.

The canvas tests run in a child process (its peak memory measured, its address space capped so
that a regression fails instead of taking the machine); the engine there is a fake that records
what it was given. The stop inside a page and the two visitors use the real engine.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest
from PIL import Image, ImageDraw, ImageFont

from llmweb.bench.ocr import scan_page
from llmweb.errors import InputError
from llmweb.retrieval import ocr, scans
from llmweb.retrieval.index import Index
from llmweb.retrieval.library import Library
from llmweb.retrieval.parsers import parse_document
from llmweb.retrieval.scans import OcrLimits
from tests.chat.test_races import WordEmbedder
from tests.retrieval.test_library import make_settings, upload
from tests.retrieval.test_scans import FakeEngine, png

GiB = 1 << 30
CHILD = """
import io, resource, sys, time
resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))  # a regression fails here, the machine lives
import psutil
from PIL import Image
from llmweb.errors import InputError
from llmweb.retrieval import ocr, scans
from llmweb.retrieval.parsers import parse_document

sizes = []
class Fake:
    def read(self, image, deadline=None):
        sizes.append(image.size)
        return "text"
ocr.engine = lambda: Fake()
width, height = int(sys.argv[1]), int(sys.argv[2])
buf = io.BytesIO()
Image.new("L", (width, height), 255).save(buf, "PNG", optimize=True)
data = buf.getvalue()
before = psutil.Process().memory_info().rss
started = time.monotonic()
try:
    parse_document(data, "strip.png", ocr=scans.OcrLimits(50, 300))
    message = "read"
except InputError as e:
    message = str(e)
seconds = time.monotonic() - started
# the peak of this process's own memory (ru_maxrss would carry the parent's over from the fork)
status = open("/proc/self/status").read()
peak = int(status.split("VmHWM:")[1].split()[0]) * 1024
print(len(data), peak - before, round(seconds, 3), max(sizes, default=(0, 0)), message, sep="\\n")
"""


def hostile(width: int, height: int) -> SimpleNamespace:
    """Parse a white `width` x `height` PNG in a child process: its size, memory growth, seconds,
    the largest image the engine got, and the message."""
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(width), str(height)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    size, grew, seconds, canvas, message = out.stdout.strip().split("\n", 4)
    return SimpleNamespace(bytes=int(size), grew=int(grew), seconds=float(seconds), canvas=canvas, message=message)


@pytest.mark.parametrize(("width", "height"), [(400_000, 1), (100_000, 1), (1, 100_000)])
def test_a_line_of_pixels_is_refused_as_too_thin_without_a_canvas(width, height):
    run = hostile(width, height)
    assert run.bytes < 2000, "a tiny file"
    assert "too thin to hold text" in run.message and "16 pixels" in run.message, run.message
    assert run.grew < GiB // 4 and run.seconds < 2, run


@pytest.mark.parametrize(("width", "height"), [(400_000, 16), (16, 400_000), (3_000_000, 16)])
def test_a_long_strip_is_shrunk_before_it_is_padded_so_the_canvas_stays_small(width, height):
    run = hostile(width, height)
    assert run.message == "read", run.message
    assert run.canvas in ("(2000, 50)", "(50, 2000)"), "shrunk to the engine's 2,000 px, then padded"
    assert run.grew < GiB // 2 and run.seconds < 15, run


def tiffs(files: int, pages: int) -> list[bytes]:
    frames = [Image.new("L", (200, 100), 255) for _ in range(pages)]
    return [png(frames[0], "TIFF", save_all=True, append_images=frames[1:], description=str(n)) for n in range(files)]


def test_one_upload_events_ocr_stops_at_the_limit_across_all_its_files(tmp_path, monkeypatch):
    slow = FakeEngine("text", delay=0.05)
    monkeypatch.setattr(ocr, "engine", lambda: slow)
    index = Index(make_settings(tmp_path, ocr_max_s=0.4), "private-test", embedder=WordEmbedder())
    files = [upload(tmp_path, f"fax-{n}.tiff", data) for n, data in enumerate(tiffs(10, 3))]
    started = time.monotonic()
    read = index.read_uploads(files)
    took = time.monotonic() - started
    assert took < 0.4 + 0.3, f"{took:.2f} s for a 0.4 s limit: the limit is the event's, not each file's"
    assert len(slow.sizes) <= 10, "about 0.4 s of 0.05 s pages, not all 30"
    stopped = [r for r in read.reports.values() if "OCR stopped" in r.message]
    assert stopped and all("an upload (LLMWEB_OCR_MAX_S)" in r.message for r in stopped)


def test_a_duplicate_and_an_upload_past_the_quota_are_refused_before_any_ocr(tmp_path, monkeypatch):
    fake = FakeEngine("The badge code is 7391.")
    monkeypatch.setattr(ocr, "engine", lambda: fake)
    settings = make_settings(tmp_path, user_docs_mb=1)
    index = Index(settings, "private-test", embedder=WordEmbedder())
    scan, other = (png(scan_page(t, dpi=100, inches=(4, 2)).image) for t in ("The code is 7391.", "Another page."))
    read = index.read_uploads([upload(tmp_path, "scan.png", scan), upload(tmp_path, "copy.png", scan)])
    assert [d.name for _, d in read.docs] == ["scan.png"] and read.reports[1].status == "duplicate"
    assert len(fake.sizes) == 1, "the same bytes twice in one upload are read once"
    held = SimpleNamespace(docs={read.docs[0][1].doc_id: SimpleNamespace(source="scan.png")})
    monkeypatch.setattr(index, "_current", lambda: held)
    read = index.read_uploads([upload(tmp_path, "again.png", scan), upload(tmp_path, "other.png", other)])
    assert read.reports[0].status == "duplicate" and len(fake.sizes) == 2, "already indexed: not read again"
    library = Library(settings, embedder=WordEmbedder())
    big = png(Image.effect_noise((800, 800), 64).convert("RGB"))  # ~1.9 MB that does not compress
    with pytest.raises(InputError, match="limit of 1 MB"):
        library.ingest_uploads("anon:alice", [upload(tmp_path, "photo.png", big)])
    assert len(fake.sizes) == 2, "the quota refused it before OCR"


def dense_page() -> Image.Image:
    """A page of 2,000 x 2,000 pixels with about a thousand short lines: a minute of OCR here."""
    page = Image.new("L", (2000, 2000), 255)
    draw, font = ImageDraw.Draw(page), ImageFont.load_default(size=14)
    for y in range(0, 2000, 18):
        for x in range(0, 2000, 200):
            draw.text((x + 5, y), f"word{y // 18:03d} x", fill=0, font=font)
    return page


def test_the_real_engine_stops_inside_a_dense_page_at_the_limit():
    data = png(dense_page())
    ocr.engine()  # loaded before the clock starts
    started = time.monotonic()
    with pytest.raises(InputError, match=r"dense\.png: OCR stopped inside the image, after \d+ s; the limit is 0\.5 s"):
        parse_document(data, "dense.png", ocr=OcrLimits(50, 0.5))
    took = time.monotonic() - started
    assert took < 0.5 + 4, f"{took:.1f} s for a 0.5 s limit: stopped inside the page, not after its minute"


@pytest.mark.slow  # a dense page on the real engine beside a small one: ~20 s of CPU
def test_one_visitors_dense_page_does_not_hold_another_visitors_small_scan():
    engine = ocr.engine()
    small = scans.prepare(scan_page("The badge code is 7391.", dpi=150, inches=(5.5, 2.5)).image)
    started = time.monotonic()
    assert "7391" in engine.read(small)
    alone = time.monotonic() - started
    dense = scans.prepare(dense_page())
    finished: list[float] = []

    def stranger() -> None:
        try:
            engine.read(dense, deadline=time.monotonic() + 30)
        except ocr.OcrTimeout:
            pass
        finished.append(time.monotonic())

    thread = threading.Thread(target=stranger)
    thread.start()
    time.sleep(0.5)  # the stranger's page is under way
    started = time.monotonic()
    assert "7391" in engine.read(small)
    mine = time.monotonic() - started
    done = time.monotonic()
    thread.join(60)
    assert finished and done < finished[0], "the small scan finished first: it never waited for the whole page"
    # it may wait for a piece of the stranger's (the page's detection: seconds on a busy CPU), no more
    print(f"the small scan: {alone:.1f} s alone, {mine:.1f} s beside the stranger's page")
