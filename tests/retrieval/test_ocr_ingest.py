"""OCR end to end: a scanned PDF (image-only pages rendered from known text) and a photo of a note,
ingested with the CLI and through the page's upload handler; a search finds a fact printed only in
an image and cites its page. The real OCR engine, the real embedder, real FAISS folders on disk.

Small pages (half a page at 150 dpi, the note at 1600 x 1200): OCR takes a few seconds in all;
the embedder's loads are most of the time.
"""

from __future__ import annotations

import io
import json
import threading

import pytest
from PIL import Image

from llmweb.bench.ocr import note_photo, scan_page
from llmweb.cli.main import main
from llmweb.retrieval import ocr
from llmweb.retrieval.library import Library
from llmweb.web.ui import Handlers
from tests.retrieval.test_library import embedder  # noqa: F401 (the real embedder, a fixture)
from tests.web.test_limits import gradio_cache  # noqa: F401 (Gradio's upload folder, a fixture)
from tests.web.test_ui import A_TOKEN, NOBODY, runtime  # noqa: F401 (a fake runtime, a fixture)

pytestmark = pytest.mark.slow  # the real embedder

PAGE_1 = "Harbour Archive, visitor notes.\nLockers are beside the stairs; pencils only."
PAGE_2 = "The reading room closes at five.\nThe badge code for the east door is 7391."
BADGE = "What is the badge code for the east door?"
KEY = "Where is the spare key?"


def scanned_pdf() -> bytes:
    """Two image-only pages (no text layer), as a scanner's PDF: one JPEG a page."""
    pages = [scan_page(text, dpi=150, seed=n, inches=(6.0, 2.6)).image for n, text in enumerate((PAGE_1, PAGE_2))]
    buf = io.BytesIO()
    pages[0].save(buf, "PDF", resolution=150, save_all=True, append_images=pages[1:])
    return buf.getvalue()


def note_png() -> bytes:
    buf = io.BytesIO()
    note_photo().image.save(buf, "PNG")
    return buf.getvalue()


def test_the_cli_ingests_a_scanned_pdf_and_a_photo_and_search_cites_the_page(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LLMWEB_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("LLMWEB_SAMPLE_DOCS", "0")
    (tmp_path / "archive.pdf").write_bytes(scanned_pdf())
    (tmp_path / "note.png").write_bytes(note_png())
    assert main(["ingest", str(tmp_path / "archive.pdf"), str(tmp_path / "note.png")]) == 0
    out = capsys.readouterr().out
    assert "ok    archive.pdf: added" in out and "ok    note.png: added" in out, out

    assert main(["search", BADGE, "--k", "2", "--json"]) == 0
    hits = json.loads(capsys.readouterr().out)
    assert (hits[0]["source"], hits[0]["page"]) == ("archive.pdf", 2), hits
    assert "7391" in hits[0]["text"]
    assert main(["search", KEY, "--k", "2", "--json"]) == 0
    hits = json.loads(capsys.readouterr().out)
    assert (hits[0]["source"], hits[0]["page"]) == ("note.png", None), hits
    assert "under the blue flowerpot" in hits[0]["text"]


def test_an_upload_through_the_page_is_read_by_ocr_with_progress_outside_the_embedders_lock(
    runtime,  # noqa: F811
    embedder,  # noqa: F811
    gradio_cache,  # noqa: F811
    monkeypatch,
):
    runtime.library = Library(runtime.settings, embedder)
    uploads = []
    for name, data in (("archive.pdf", scanned_pdf()), ("note.png", note_png())):
        path = gradio_cache / name.replace(".", "-") / name  # Gradio keeps the upload's own name
        path.parent.mkdir()
        path.write_bytes(data)
        uploads.append(str(path))

    read = ocr.OcrEngine.read
    lock_free: list[bool] = []

    def read_while_another_thread_takes_the_embedders_lock(self, image: Image.Image, deadline=None) -> str:
        got: list[bool] = []

        def take() -> None:
            if embedder.lock.acquire(timeout=10):
                got.append(True)
                embedder.lock.release()

        other = threading.Thread(target=take)
        other.start()
        other.join()
        lock_free.append(bool(got))
        return read(self, image, deadline)

    monkeypatch.setattr(ocr.OcrEngine, "read", read_while_another_thread_takes_the_embedders_lock)
    heard: list[str] = []
    *_, report, cleared = Handlers(runtime).docs.upload(
        uploads, "", A_TOKEN, NOBODY, progress=lambda fraction, desc="": heard.append(desc)
    )
    assert "archive.pdf: added" in report and "note.png: added" in report, report
    assert cleared is None
    assert lock_free == [True, True, True], "each OCR read ran while the embedder's lock was free"
    assert "archive.pdf: reading page 1 of 2 (OCR)…" in heard and "archive.pdf: reading page 2 of 2 (OCR)…" in heard
    assert "note.png: reading the image (OCR)…" in heard

    owner = Handlers(runtime).docs.owner(A_TOKEN, NOBODY)
    [best, *_] = runtime.library.search(owner, BADGE)
    assert best.label() == "archive.pdf, p. 2" and "7391" in best.text
    [best, *_] = runtime.library.search(owner, KEY)
    assert best.label() == "note.png" and "flowerpot" in best.text
