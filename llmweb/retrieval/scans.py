"""Scans: the text of image files and of PDF pages without a text layer, read by OCR within limits.

Contract:
- `read_image(data, name, limits, progress) -> (text, sections)`: a PNG, JPEG, TIFF or WebP file
  (whatever its suffix says, only these decoders are used). Each frame of a multi-page TIFF is a
  page and its section carries the page number; another file is one image, with no page.
- `pdf_pages_to_read(texts, has_images)`: the PDF pages to read by OCR, 1-based: no text layer and
  at least one image XObject (`PdfImages` finds them; an inline image is not read).
  `read_pdf_pages(images, numbers, limits, progress)`: their text, from the images each page
  holds, as pypdf decodes them (no rasteriser), turned by the page's /Rotate.
- Limits, checked before the work they bound: `OcrLimits.max_pages` pages to read per document
  (0 = OCR off) before the first is read; MAX_IMAGE_PIXELS per image from its header (or the
  PDF's /Width and /Height) before it is decoded; an image file with a side under MIN_IMAGE_SIDE
  is refused; MAX_IMAGES_PER_PAGE; `max_seconds` of OCR per upload event (`OcrLimits.event()`: one
  `OcrTimer` shared by the event's files, started at its first page), checked before each page and
  by the engine inside a page (it stops between pieces of work). Past one: InputError, one sentence
  naming the file (and the page), and the document is not added.
- Memory: `prepare` shrinks an image to MAX_OCR_SIDE (the engine's own bound) before it converts
  or pads it, so the canvas the engine gets is at most MAX_OCR_SIDE on each side.
- `progress(what)` hears "name: reading page 3 of 12 (OCR)…" before each page.

The engine is retrieval/ocr.py's, imported when the first page is read. This module never writes
a file and holds no lock but the engine's (never the embedder's).
"""

from __future__ import annotations

import io
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from llmweb.config import Settings
from llmweb.errors import InputError

IMAGE_FORMATS = {".png": "PNG", ".jpg": "JPEG", ".jpeg": "JPEG", ".tif": "TIFF", ".tiff": "TIFF", ".webp": "WEBP"}
IMAGE_SUFFIXES = tuple(IMAGE_FORMATS)
MAX_IMAGE_PIXELS = 50_000_000  # one image (an A4 page at 600 dpi is 35 million)
MAX_IMAGES_PER_PAGE = 16  # a scanned page is one image, or a few strips
MAX_XOBJECT_VISITS = 100_000  # images and forms looked at, in a whole PDF, to find its pages' images
MAX_FORM_DEPTH = 8  # forms inside forms followed while looking for a page's images
MIN_IMAGE_SIDE = 16  # pixels: a smaller image (a rule, a bullet, a speck) holds no text to read
MIN_OCR_SIDE = 32  # pixels: the engine needs this much on each side...
MAX_OCR_ASPECT = 40  # ...and an aspect under this: a thin strip is padded with white to it
MAX_OCR_SIDE = 2000  # pixels: the engine shrinks a longer side to this (rapidocr's max_side_len), so do we, first

Progress = Callable[[str], None]


class OcrTimer:
    """The OCR seconds of one upload event, shared by its files: the clock starts at the first page
    read, and `deadline` is when the event's OCR must end (the engine stops a page there)."""

    def __init__(self, max_seconds: float, clock: Callable[[], float] | None = None) -> None:
        self.max_seconds, self.clock = max_seconds, clock or time.monotonic
        self.started: float | None = None
        self._lock = threading.Lock()

    def start(self) -> None:
        with self._lock:
            if self.started is None:
                self.started = self.clock()

    def spent(self) -> float:
        return 0.0 if self.started is None else self.clock() - self.started

    @property
    def deadline(self) -> float:
        assert self.started is not None, "the deadline of a timer not started"
        return self.started + self.max_seconds


@dataclass(frozen=True, slots=True)
class OcrLimits:
    """What OCR may spend: pages per document, seconds per upload event (the defaults are Settings')."""

    max_pages: int  # pages (or images) read by OCR; 0 turns OCR off (LLMWEB_OCR_MAX_PAGES)
    max_seconds: float  # of one upload event (or one document without `event()`) (LLMWEB_OCR_MAX_S)
    timer: OcrTimer | None = field(default=None, compare=False)  # the event's, shared by its files

    def __post_init__(self) -> None:
        assert self.max_pages >= 0 and self.max_seconds > 0, self

    @classmethod
    def of(cls, settings: Settings) -> OcrLimits:
        return cls(settings.ocr_max_pages, settings.ocr_max_s)

    def event(self) -> OcrLimits:
        """These limits for one upload event: its files share one clock of `max_seconds`."""
        return OcrLimits(self.max_pages, self.max_seconds, OcrTimer(self.max_seconds))

    @property
    def enabled(self) -> bool:
        return self.max_pages > 0


class OcrBudget:
    """One document's OCR: refuses more pages than the limit up front, and a page started after
    `max_seconds` of the event (the limits' timer, or the document's own); tells `progress` which
    page is next; `deadline` is the engine's, and `stopped` the message when it is reached."""

    def __init__(
        self,
        limits: OcrLimits,
        name: str,
        pages: int,
        progress: Progress | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.limits, self.name, self.progress = limits, name, progress
        what = "images" if pages > 1 else "image"
        if not limits.enabled:
            raise InputError(f"{name}: reading text from {what} (OCR) is turned off here (LLMWEB_OCR_MAX_PAGES=0).")
        if pages > limits.max_pages:
            raise InputError(
                f"{name} has {pages:,} pages to read by OCR; the limit is {limits.max_pages:,} "
                "(LLMWEB_OCR_MAX_PAGES). Split the file and upload the parts."
            )
        self.timer = limits.timer or OcrTimer(limits.max_seconds, clock)

    def page(self, number: int | None, of: int) -> None:
        """Before reading page `number` of `of` (None: a single image)."""
        self.timer.start()
        spent = self.timer.spent()
        where = "the image" if number is None else f"page {number} of {of}"
        if spent >= self.limits.max_seconds:
            raise InputError(
                f"{self.name}: OCR stopped before {where}, after {spent:.0f} s; the limit is "
                f"{self.limits.max_seconds:g} s of OCR an upload (LLMWEB_OCR_MAX_S). Nothing was added from "
                "it: split the file and upload the parts."
            )
        if self.progress is not None:
            self.progress(f"{self.name}: reading {where} (OCR)…")

    @property
    def deadline(self) -> float:
        return self.timer.deadline

    def stopped(self, number: int | None) -> InputError:
        """The message when the engine reached the deadline inside page `number`."""
        where = "the image" if number is None else f"page {number}"
        return InputError(
            f"{self.name}: OCR stopped inside {where}, after {self.timer.spent():.0f} s; the limit is "
            f"{self.limits.max_seconds:g} s of OCR an upload (LLMWEB_OCR_MAX_S). Nothing was added from it: "
            "split the file and upload the parts."
        )


# --------------------------------------------------------------------------- image files


def read_image(
    data: bytes, name: str, limits: OcrLimits, progress: Progress | None = None
) -> tuple[str, list[tuple[int, int, int | None]]]:
    """The text of an image file and its sections as (start, end, page or None)."""
    image = _open(data, name)
    frames = _frames(image, name, most=limits.max_pages + 1)
    if limits.enabled and frames > limits.max_pages:
        raise InputError(
            f"{name} has more than {limits.max_pages:,} pages to read by OCR; the limit is that "
            "(LLMWEB_OCR_MAX_PAGES). Split the file and upload the parts."
        )
    budget = OcrBudget(limits, name, frames, progress)
    texts: list[str] = []
    for frame in range(frames):
        number = frame + 1 if frames > 1 else None
        budget.page(number, frames)
        try:
            image.seek(frame)
            check_pixels(image.size, name, number)
            check_sides(image.size, name, number)
            image.load()
        except InputError:
            raise
        except Exception as e:  # Pillow raises OSError, SyntaxError, ValueError... on damaged files
            where = f" (page {number})" if number else ""
            raise InputError(f"{name} could not be read as an image{where} (damaged: {type(e).__name__}).") from None
        texts.append(_read(image, budget, number))
    if not any(t.strip() for t in texts):
        raise InputError(f"No text found in {name}: OCR read nothing in the {'pages' if frames > 1 else 'image'}.")
    return _join(texts, paged=frames > 1)


def _open(data: bytes, name: str) -> Any:
    """The image with its header read (each frame's size is checked before it is decoded)."""
    from PIL import Image, UnidentifiedImageError

    formats = sorted(set(IMAGE_FORMATS.values()))
    try:
        image = Image.open(io.BytesIO(data), formats=formats)
    except Image.DecompressionBombError:
        raise InputError(f"{name} declares far more pixels than the limit of {MAX_IMAGE_PIXELS:,}.") from None
    except UnidentifiedImageError:
        raise InputError(
            f"{name} is not a PNG, JPEG, TIFF or WebP image llmweb can read (damaged, or renamed?)."
        ) from None
    except Exception as e:  # a header Pillow recognises but cannot parse
        raise InputError(f"{name} could not be read as an image (damaged: {type(e).__name__}).") from None
    return image


def _frames(image: Any, name: str, most: int) -> int:
    """How many pages (frames) a TIFF holds, counted up to `most` (Pillow's `n_frames` walks every
    one of a file's frames, however many); 1 for another format."""
    if image.format != "TIFF":
        return 1
    count = 1
    try:
        while count < most:
            image.seek(count)  # from the frame before: one step each
            count += 1
    except EOFError:
        pass
    except Exception as e:  # a damaged chain of frames
        raise InputError(f"{name} could not be read as an image (damaged: {type(e).__name__}).") from None
    image.seek(0)
    return count


def check_pixels(size: tuple[int, int], name: str, page: int | None = None) -> None:
    """Refuse an image of more than MAX_IMAGE_PIXELS, or of no pixels, before it is decoded."""
    width, height = (int(v) for v in size)
    where = f" (page {page})" if page else ""
    if width < 1 or height < 1:
        raise InputError(f"{name} holds an image of {width} x {height} pixels{where}, which has nothing to read.")
    if width * height > MAX_IMAGE_PIXELS:
        raise InputError(
            f"{name} holds an image of {width:,} x {height:,} pixels{where} ({width * height / 1e6:,.0f} million); "
            f"the limit is {MAX_IMAGE_PIXELS / 1e6:g} million. Scan at 300 dpi, or make the image smaller."
        )


def check_sides(size: tuple[int, int], name: str, page: int | None = None) -> None:
    """Refuse an image file with a side under MIN_IMAGE_SIDE: a line of pixels holds no text, and
    padding one to the engine's aspect would make a canvas of its width squared."""
    width, height = (int(v) for v in size)
    if min(width, height) < MIN_IMAGE_SIDE:
        where = f" (page {page})" if page else ""
        raise InputError(
            f"{name} holds an image of {width:,} x {height:,} pixels{where}: too thin to hold text (the least "
            f"is {MIN_IMAGE_SIDE} pixels a side)."
        )


def _join(texts: Sequence[str], paged: bool) -> tuple[str, list[tuple[int, int, int | None]]]:
    """Pages' texts joined by blank lines; sections (start, end, page) of the non-empty ones."""
    parts: list[str] = []
    sections: list[tuple[int, int, int | None]] = []
    pos = 0
    for number, text in enumerate(texts, 1):
        text = text.strip()
        if not text:
            continue
        if parts:
            parts.append("\n\n")
            pos += 2
        sections.append((pos, pos + len(text), number if paged else None))
        parts.append(text)
        pos += len(text)
    return "".join(parts), sections


# --------------------------------------------------------------------------- PDF pages


def pdf_pages_to_read(texts: Sequence[str], has_images: Callable[[int], bool]) -> list[int]:
    """The 1-based pages with no text layer (only blanks) that draw at least one image."""
    return [n for n, text in enumerate(texts, 1) if not text.strip() and has_images(n)]


class PdfImages:
    """The image XObjects of an open PDF's pages, found by a walk of each page's resources: each
    object once a page, forms followed MAX_FORM_DEPTH deep, MAX_XOBJECT_VISITS objects looked at in
    the whole document (InputError past it). Not pypdf's `page.images`: it checks each object
    against a list of those it has seen, quadratic in a page's objects (4,000 forms took 1 s, a
    20 MB file of them would take half an hour), and `images[key]` runs that walk again."""

    def __init__(self, reader: Any, name: str) -> None:
        self.reader, self.name = reader, name
        self.visits = 0
        self._paths: dict[int, list[list[str]]] = {}

    def has_images(self, number: int) -> bool:
        return bool(self.paths(number))

    def paths(self, number: int) -> list[list[str]]:
        """Page `number`'s images as paths of XObject names (through forms), in resource order."""
        if number not in self._paths:
            self._paths[number] = self._walk(self.reader.pages[number - 1], number)
        return self._paths[number]

    def _walk(self, page: Any, number: int) -> list[list[str]]:
        from pypdf.generic import DictionaryObject, IndirectObject, StreamObject

        found: list[list[str]] = []
        seen: set[Any] = set()
        todo: list[tuple[Any, list[str]]] = [(page, [])]
        while todo:
            holder, path = todo.pop(0)
            resources = holder.get("/Resources")
            resources = resources.get_object() if resources is not None else None
            xobjects = resources.get("/XObject") if isinstance(resources, DictionaryObject) else None
            xobjects = xobjects.get_object() if xobjects is not None else None
            if not isinstance(xobjects, DictionaryObject):
                continue
            for key in xobjects:
                ref = xobjects.raw_get(key)
                identity = (ref.idnum, ref.generation) if isinstance(ref, IndirectObject) else id(ref)
                if identity in seen:
                    continue
                seen.add(identity)
                self.visits += 1
                if self.visits > MAX_XOBJECT_VISITS:
                    raise InputError(
                        f"{self.name} holds more than {MAX_XOBJECT_VISITS:,} images and forms to look through "
                        f"(page {number}); the limit is that."
                    )
                entry = ref.get_object()
                if not isinstance(entry, StreamObject):
                    continue
                if entry.get("/Subtype") == "/Image":
                    found.append([*path, str(key)])
                elif entry.get("/Subtype") == "/Form" and len(path) < MAX_FORM_DEPTH:
                    todo.append((entry, [*path, str(key)]))
        return found

    def images(self, number: int) -> list[Any]:
        """Page `number`'s images, each checked by its declared size before pypdf decodes it,
        turned as the page is shown (/Rotate)."""
        page, name = self.reader.pages[number - 1], self.name
        paths = self.paths(number)
        if len(paths) > MAX_IMAGES_PER_PAGE:
            raise InputError(
                f"{name}: page {number} draws {len(paths):,} images; the limit is {MAX_IMAGES_PER_PAGE} for a "
                "scanned page."
            )
        images = []
        for path in paths:
            declared = _declared_size(page, path)
            check_pixels(declared, name, number)
            if min(declared) < MIN_IMAGE_SIDE:
                continue
            try:
                image = page._get_image(path).image  # one image by its path (not `images[key]`: see above)
                check_pixels(image.size, name, number)
                image.load()
            except InputError:
                raise
            except Exception as e:  # pypdf and Pillow raise many types on damaged or oversized streams
                raise InputError(
                    f"{name}: the image on page {number} could not be read ({type(e).__name__})."
                ) from None
            if min(image.size) < MIN_IMAGE_SIDE:
                continue
            images.append(image.rotate(-page.rotation, expand=True) if page.rotation % 360 else image)
        return images


def read_pdf_pages(
    images: PdfImages, numbers: Sequence[int], limits: OcrLimits, progress: Progress | None = None
) -> dict[int, str]:
    """The OCR text of the 1-based pages `numbers`, page by page, from the images each draws."""
    name, pages = images.name, len(images.reader.pages)
    budget = OcrBudget(limits, name, len(numbers), progress)
    out: dict[int, str] = {}
    for number in numbers:
        budget.page(number, pages)
        texts = [_read(image, budget, number) for image in images.images(number)]
        out[number] = "\n\n".join(t for t in texts if t.strip())
    return out


def _declared_size(page: Any, path: list[str]) -> tuple[int, int]:
    """The /Width and /Height of the image XObject at `path` (names through forms), undecoded."""
    obj = page
    for part in path:
        obj = obj["/Resources"].get_object()["/XObject"].get_object()[part].get_object()
    return int(obj.get("/Width", 0)), int(obj.get("/Height", 0))


# --------------------------------------------------------------------------- the engine


def _read(image: Any, budget: OcrBudget, page: int | None) -> str:
    """The engine's text of one image of the budget's document (on `page`), stopped at its deadline."""
    from llmweb.retrieval import ocr

    name = budget.name
    try:
        engine = ocr.engine()
    except ocr.OcrUnavailable as e:
        raise InputError(f"{name}: OCR is not installed on this server ({e}), so images cannot be read.") from None
    try:
        return engine.read(prepare(image), deadline=budget.deadline)
    except ocr.OcrTimeout:
        raise budget.stopped(page) from None
    except Exception as e:  # onnxruntime and OpenCV raise their own types on an image they cannot take
        where = f" on page {page}" if page else ""
        raise InputError(f"{name}: OCR could not read the image{where} ({type(e).__name__}).") from None


def prepare(image: Any) -> Any:
    """An RGB image the engine reads as a person sees the original: the camera's EXIF orientation
    applied, 16-bit and float greys stretched to 8 bits, shrunk to MAX_OCR_SIDE (before anything
    makes a canvas of it), transparency over white paper, and a strip too thin for the engine
    padded with white: at most MAX_OCR_SIDE x MAX_OCR_SIDE pixels, whatever the input."""
    from PIL import Image, ImageOps

    image = ImageOps.exif_transpose(image)
    if image.mode in ("I", "I;16", "I;16B", "I;16L", "F"):
        image = _to_8_bit(image)
    clear = image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info)
    if image.mode in ("1", "P", "PA"):  # resized with NEAREST in these modes: a thin stroke would vanish
        image = image.convert("RGBA" if clear else "L")
    image = _shrink(image)
    if clear:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        image = Image.alpha_composite(white, rgba)
    image = image.convert("RGB")
    width, height = image.size
    want_w = max(width, MIN_OCR_SIDE, -(-height // MAX_OCR_ASPECT))
    want_h = max(height, MIN_OCR_SIDE, -(-width // MAX_OCR_ASPECT))
    if (want_w, want_h) != (width, height):
        padded = Image.new("RGB", (want_w, want_h), (255, 255, 255))
        padded.paste(image, (0, 0))
        image = padded
    return image


def _shrink(image: Any) -> Any:
    """`image` with its longer side at most MAX_OCR_SIDE (each side at least one pixel)."""
    from PIL import Image

    width, height = image.size
    if max(width, height) <= MAX_OCR_SIDE:
        return image
    scale = MAX_OCR_SIDE / max(width, height)
    size = (min(max(1, round(width * scale)), MAX_OCR_SIDE), min(max(1, round(height * scale)), MAX_OCR_SIDE))
    return image.resize(size, Image.Resampling.BILINEAR, reducing_gap=2.0)


def _to_8_bit(image: Any) -> Any:
    import numpy as np
    from PIL import Image

    pixels = np.array(image, dtype=np.float32)  # one copy, scaled in place
    low, high = float(pixels.min()), float(pixels.max())
    if high > low:
        pixels -= low
        pixels *= 255.0 / (high - low)
    else:
        pixels[:] = 0
    return Image.fromarray(pixels.astype(np.uint8), "L")
