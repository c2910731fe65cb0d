"""OCR engine: the text in an image, read offline by RapidOCR with the PP-OCRv6 models of its wheel.

Contract:
- `engine()` is the one process-wide `OcrEngine`, loaded on first use (~0.5 s). Its models are
  the files inside the `rapidocr` package, named by path: nothing is ever downloaded (rapidocr
  downloads only when it is given no model path). `OcrUnavailable` when rapidocr or onnxruntime
  is not installed.
- `OcrEngine.read(image) -> str` reads one PIL image: its lines top to bottom, words on one line
  joined by spaces, a blank line where two lines are further apart than usual (a paragraph).
  One read at a time per process (`lock`): onnxruntime already uses every core for one page.
- `layout(boxes, texts)` is that ordering as a pure function of the engine's boxes.

Why this engine and these settings: `python -m llmweb bench ocr` (docs/documents.md has the table).
The line-orientation classifier is off: it took 3 of the 32 lines of the 150 dpi scan for upside
down and garbled them (7.8% CER with it, 0% without); a page scanned upside down is not turned back.

This module knows nothing of files, formats or limits (retrieval/scans.py does) and must not be
imported at module level by anything that runs without OCR: it loads onnxruntime and OpenCV.
"""

from __future__ import annotations

import statistics
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from llmweb.retrieval.background import in_background

MODELS = {  # rapidocr's config key -> the model file inside the rapidocr package (rapidocr 3.10)
    "Det": "PP-OCRv6_det_small.onnx",
    "Rec": "PP-OCRv6_rec_small.onnx",
    "Cls": "ch_ppocr_mobile_v2.0_cls_mobile.onnx",  # loaded by rapidocr even when unused
}
PARAGRAPH_STEP = 1.5  # lines this many usual line steps apart (or more) have a paragraph between them


class OcrUnavailable(Exception):
    """The OCR packages are not installed."""


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
        self.lock = threading.Lock()

    def read(self, image: Any) -> str:
        """The text of a PIL image ("" when it holds none)."""
        import numpy as np

        pixels = np.asarray(image.convert("RGB"))[:, :, ::-1]  # OpenCV's BGR
        with self.lock:  # on the background thread: another visitor's work to the engine's governor
            result = in_background("ocr", self._ocr, np.ascontiguousarray(pixels))
        if not result.txts:
            return ""
        return layout(result.boxes.tolist(), list(result.txts))


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
