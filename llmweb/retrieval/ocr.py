"""OCR engine: the text in an image, read offline by RapidOCR with the PP-OCRv6 models of its wheel.

Contract:
- `engine()` is the one process-wide `OcrEngine`, loaded on first use (~0.5 s). Its models are
  the files inside the `rapidocr` package, named by path: nothing is ever downloaded (rapidocr
  downloads only when it is given no model path). `OcrUnavailable` when rapidocr or onnxruntime
  is not installed.
- `OcrEngine.read(image, deadline) -> str` reads one PIL image: its lines top to bottom, words on
  one line joined by spaces, a blank line where two lines are further apart than usual (a
  paragraph). It runs as pieces on the "ocr" background thread: the page's detection, then its
  text lines REC_PIECE at a time; past `deadline` (time.monotonic) it stops between two pieces with
  `OcrTimeout`. Two visitors' reads take turns piece by piece (onnxruntime already uses every core
  for one piece), so no upload holds the engine for more than one piece (a second or so).
- `layout(boxes, texts)` is that ordering as a pure function of the engine's boxes.

Why this engine and these settings: `python -m llmweb bench ocr` (docs/documents.md has the table).
The line-orientation classifier is off: it took 3 of the 32 lines of the 150 dpi scan for upside
down and garbled them (7.8% CER with it, 0% without); a page scanned upside down is not turned back.

This module knows nothing of files, formats or limits (retrieval/scans.py does) and must not be
imported at module level by anything that runs without OCR: it loads onnxruntime and OpenCV.
"""

from __future__ import annotations

import contextlib
import statistics
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from llmweb.retrieval.background import in_background

MODELS = {  # rapidocr's config key -> the model file inside the rapidocr package (rapidocr 3.10)
    "Det": "PP-OCRv6_det_small.onnx",
    "Rec": "PP-OCRv6_rec_small.onnx",
    "Cls": "ch_ppocr_mobile_v2.0_cls_mobile.onnx",  # loaded by rapidocr even when unused
}
PARAGRAPH_STEP = 1.5  # lines this many usual line steps apart (or more) have a paragraph between them
REC_PIECE = 24  # text lines recognised in one piece of work (4 of rapidocr's batches of 6)


class OcrUnavailable(Exception):
    """The OCR packages are not installed."""


class OcrTimeout(Exception):
    """A read passed its deadline; it stopped between two pieces of work."""


class OcrEngine:
    """RapidOCR over onnxruntime, on the wheel's own model files."""

    def __init__(self) -> None:
        try:
            import rapidocr
            from rapidocr import RapidOCR
        except ImportError as e:
            raise OcrUnavailable(f"rapidocr is not installed ({e})") from None
        folder = Path(rapidocr.__file__).parent / "models"
        params: dict[str, Any] = {"Global.log_level": "error", "Global.use_cls": False}
        for part, file in MODELS.items():
            path = folder / file
            assert path.is_file(), f"rapidocr's wheel ships {path}; without it rapidocr would download a model"
            params[f"{part}.model_path"] = str(path)
        self._ocr = RapidOCR(params=params)
        self._stop = _Stop()
        for model in (self._ocr._load_det_model(), self._ocr._load_rec_model()):
            model.session.session = _Stoppable(model.session.session, self._stop)

    def read(self, image: Any, deadline: float | None = None) -> str:
        """The text of a PIL image ("" when it holds none); OcrTimeout past `deadline`."""
        import numpy as np

        pixels = np.ascontiguousarray(np.asarray(image.convert("RGB"))[:, :, ::-1])  # OpenCV's BGR
        _check(deadline)
        crops, boxes = in_background("ocr", self._detect, pixels, deadline)
        # rapidocr recognises lines sorted by aspect, in batches: the same batches, a few per piece
        order = sorted(range(len(crops)), key=lambda i: crops[i].shape[1] / crops[i].shape[0])
        found: dict[int, str] = {}
        for start in range(0, len(order), REC_PIECE):
            _check(deadline)
            piece = order[start : start + REC_PIECE]
            found |= in_background("ocr", self._recognize, piece, [crops[i] for i in piece], deadline)
        keep = sorted(found)
        return layout([boxes[i] for i in keep], [found[i] for i in keep])

    def _detect(self, pixels: Any, deadline: float | None) -> tuple[list[Any], list[Any]]:
        """The page's text lines: (cropped images, boxes in the image's coordinates). rapidocr's own
        steps (`RapidOCR.__call__` before recognition, rapidocr 3.10), on the background thread."""
        from rapidocr.main import RapidOCRError
        from rapidocr.utils.process_img import map_boxes_to_original

        ocr = self._ocr
        original = ocr.load_img(pixels)
        img, record = ocr.preprocess_img(original)
        try:
            with self._stop.at(deadline):
                crops, det = ocr.detect_and_crop(img, record)
        except RapidOCRError:  # no text found
            return [], []
        boxes = map_boxes_to_original(det.boxes, record, *original.shape[:2])
        return list(crops), boxes.tolist()

    def _recognize(self, ids: list[int], crops: list[Any], deadline: float | None) -> dict[int, str]:
        """The text of each line that rapidocr keeps (not blank, scored at least its text_score)."""
        from rapidocr.ch_ppocr_rec import TextRecInput

        with self._stop.at(deadline):
            out = self._ocr._load_rec_model()(TextRecInput(img=crops, return_word_box=False))
        return {
            i: text
            for i, text, score in zip(ids, out.txts or (), out.scores)
            if text.strip() and score >= self._ocr.text_score
        }


class _Stop:
    """The run options of the piece on the background thread: at its deadline a timer sets
    onnxruntime's `terminate`, and the run in progress ends with an error (OcrTimeout here)."""

    def __init__(self) -> None:
        import onnxruntime

        self.options = onnxruntime.RunOptions()
        self._new = onnxruntime.RunOptions

    @contextlib.contextmanager
    def at(self, deadline: float | None) -> Iterator[None]:
        self.options = options = self._new()
        timer = None
        if deadline is not None:
            timer = threading.Timer(max(deadline - time.monotonic(), 0.0), setattr, (options, "terminate", True))
            timer.daemon = True
            timer.start()
        try:
            yield
        except Exception:
            if options.terminate:
                raise OcrTimeout() from None
            raise
        finally:
            if timer is not None:
                timer.cancel()


class _Stoppable:
    """An onnxruntime session that runs with `_Stop`'s options (rapidocr passes none)."""

    def __init__(self, session: Any, stop: _Stop) -> None:
        self._session, self._stop = session, stop

    def __getattr__(self, name: str) -> Any:
        return getattr(self._session, name)

    def run(self, names: Any, feed: Any, run_options: Any = None) -> Any:
        return self._session.run(names, feed, self._stop.options)


def _check(deadline: float | None) -> None:
    if deadline is not None and time.monotonic() >= deadline:
        raise OcrTimeout()


_engine: OcrEngine | None = None
_engine_lock = threading.Lock()


def engine() -> OcrEngine:
    """The process's engine, loaded once."""
    global _engine
    with _engine_lock:
        if _engine is None:
            _engine = in_background("ocr", OcrEngine)  # onnxruntime's threads are born there, named
        return _engine


def engine_version() -> str:
    import importlib.metadata

    return f"rapidocr {importlib.metadata.version('rapidocr')} (PP-OCRv6 small), onnxruntime " + (
        importlib.metadata.version("onnxruntime")
    )


def layout(boxes: Sequence[Sequence[Sequence[float]]], texts: Sequence[str]) -> str:
    """Text pieces in reading order. Each box is four (x, y) corners. A piece whose vertical middle
    falls inside the first piece of the line above is on that line (left to right, joined by a
    space); lines go top to bottom, and a step between two lines' middles of more than
    PARAGRAPH_STEP times the median step becomes a blank line (a paragraph)."""
    assert len(boxes) == len(texts), f"{len(boxes)} boxes for {len(texts)} texts"
    pieces = []
    for box, text in zip(boxes, texts):
        if text.strip():
            ys, xs = [p[1] for p in box], [p[0] for p in box]
            pieces.append((min(ys), max(ys), min(xs), text.strip()))
    pieces.sort(key=lambda p: (p[0] + p[1]) / 2)
    lines: list[list[tuple[float, float, float, str]]] = []
    for piece in pieces:
        middle = (piece[0] + piece[1]) / 2
        if lines and lines[-1][0][0] <= middle <= lines[-1][0][1]:
            lines[-1].append(piece)
        else:
            lines.append([piece])
    middles = [statistics.fmean((p[0] + p[1]) / 2 for p in line) for line in lines]
    steps = [b - a for a, b in zip(middles, middles[1:])]
    usual = statistics.median(steps) if steps else 0.0
    out: list[str] = []
    for i, line in enumerate(lines):
        if i and steps[i - 1] > PARAGRAPH_STEP * usual:
            out.append("")
        out.append(" ".join(p[3] for p in sorted(line, key=lambda p: p[2])))
    return "\n".join(out)
