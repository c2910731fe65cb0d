"""`python -m llmweb bench ocr`: the OCR engines side by side, character error rate and seconds per page.

Pages are rendered here from known text with Pillow's own font (the same on every machine), so
the reference is exact: `scan_page` is a page of prose as a flatbed scanner gives it (A4 at
`dpi`, grey paper, a little blur and noise, a fraction of a degree of skew, JPEG), `note_photo`
a phone's photo of a short note (cream paper on a table, uneven light, tilted a few degrees,
noise, blur, a strong JPEG). `cer` is the Levenshtein distance between the reference and the
engine's text, both with runs of whitespace made one space, over the reference's length.

The engines: llmweb's own (retrieval/ocr.py: the engine it ships, as uploads are read), and
whichever other candidates are installed: rapidocr with its own defaults, `rapidocr-onnxruntime`
1.4.4 (PP-OCRv4), Debian's `tesseract` 5.3. One that is missing is listed as missing, not
measured. The CER is of a warm-up read; then every engine reads every page once per round,
`repeats` rounds, and the table gives the median wall-clock and CPU seconds (every thread, and a
child process's: the CPU figure moves less when a neighbour loads the machine). The engine's load
is timed apart. This module reads no file of the user's and writes none.
"""

from __future__ import annotations

import io
import os
import random
import shutil
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

PROSE = """The Harbour Archive keeps its oldest ledgers in the cold room on the lower floor, where the
temperature is held at 14 degrees and the humidity at 45 percent. Visitors sign the register at the
front desk and leave their bags in the lockers beside the stairs. Pencils only: ink, food and drinks
stay outside, and gloves are handed out at the door of the reading room.

The archive was founded in 1887 by the merchants of the port, who wanted a record of every cargo
that came through the harbour. Their clerks wrote down the name of each ship, its captain, its
tonnage and what it carried, from coal and timber to tea, wool and salted fish. The ledgers fill
312 volumes, and the last of them was closed in 1961, when the container terminal opened on the
other side of the bay and the old quays fell quiet.

Researchers may request up to six volumes a day. Requests made before 11:30 are brought up the same
morning; later requests arrive after lunch. Fragile volumes, marked with a red label on the spine,
are shown only on the scanning table, and a member of staff turns the pages. Photographs without a
flash are allowed for private study; anyone who wants to publish an image must ask the archivist,
Mrs. Ingrid Maalouf, for written permission and pay the reproduction fee of 25 euros per image.

The reading room closes at 17:00 on weekdays and at 13:00 on Saturdays. It is shut on Sundays, on
public holidays and during the first two weeks of August, when the shelves are cleaned and the
climate system is serviced. The badge code for the east door is 7391; please do not share it. Lost
badges cost 12 euros to replace. Questions about the collection go to the front desk or to the
archive's office on the second floor, room 214.

Since 2019 the ledgers have been scanned, a volume at a time, by two volunteers who come in on
Tuesdays and Thursdays. Each page is photographed twice, once in daylight colour and once under a
raking light that shows the pressure of the pen, and the files are checked against the original
before the volume goes back to its shelf. So far 118 volumes are done. The scans can be seen on the
terminals in the reading room; they are not yet published online, because the names in the ledgers
must first be checked against the privacy rules for records younger than one hundred years.

Donations of papers, photographs and maps connected with the harbour are welcome. The archive does
not buy material, but it will copy a document and give the original back when the owner wishes to
keep it. Every donation is recorded with the name of the giver, unless they ask to stay anonymous."""

NOTE = """Plumber comes Tuesday 8:15
Spare key: under the blue flowerpot
Boiler ref QX-2291, service in March
Wi-Fi: heron-lamp-58
Call Marta about the invoice!"""


@dataclass(frozen=True, slots=True)
class Page:
    """A rendered page: what the engines read and what it says."""

    name: str
    image: Any  # a PIL.Image
    text: str  # the reference, line by line as drawn


def _wrap(text: str, font: Any, width: int) -> list[str]:
    """Lines of at most `width` pixels in `font`: each paragraph wrapped at spaces, a blank line kept."""
    lines: list[str] = []
    for paragraph in text.split("\n\n"):
        words = paragraph.split()
        line = ""
        for word in words:
            trial = f"{line} {word}".strip()
            if line and font.getlength(trial) > width:
                lines.append(line)
                line = word
            else:
                line = trial
        lines += [line, ""]
    return lines[:-1]


def scan_page(text: str = PROSE, dpi: int = 300, seed: int = 0, inches: tuple[float, float] = (8.27, 11.69)) -> Page:
    """A page of `text` (A4 unless `inches` says) in 11 pt type at `dpi`, as a flatbed scanner saves
    it (greyscale JPEG), with one-inch margins."""
    from PIL import Image, ImageDraw, ImageFilter, ImageFont

    rng = random.Random(seed)
    width, height = round(inches[0] * dpi), round(inches[1] * dpi)
    size = round(11 / 72 * dpi)
    font = ImageFont.load_default(size=size)
    margin = dpi
    lines = _wrap(text, font, width - 2 * margin)
    page = Image.new("L", (width, height), 238)
    draw = ImageDraw.Draw(page)
    y = margin
    for line in lines:
        draw.text((margin, y), line, fill=35, font=font)
        y += round(size * 1.45)
    page = page.rotate(rng.uniform(-0.4, 0.4), resample=Image.Resampling.BICUBIC, fillcolor=238)
    page = page.filter(ImageFilter.GaussianBlur(0.5 * dpi / 300))
    return Page(f"scan {dpi} dpi", _jpeg(_noise(page, 6, rng), quality=85), "\n".join(lines))


def note_photo(text: str = NOTE, seed: int = 0) -> Page:
    """A phone's photo of a short note: cream paper on a darker table, light falling off to one side,
    tilted a few degrees, noise and blur, a strong JPEG; 1600 x 1200 pixels."""
    from PIL import Image, ImageDraw, ImageFilter, ImageFont

    rng = random.Random(seed)
    font = ImageFont.load_default(size=44)
    lines = text.split("\n")
    paper = Image.new("RGB", (1100, 140 + 80 * len(lines)), (236, 229, 208))
    draw = ImageDraw.Draw(paper)
    for i, line in enumerate(lines):
        draw.text((70, 70 + 80 * i), line, fill=(35, 40, 95), font=font)
    photo = Image.new("RGB", (1600, 1200), (112, 92, 74))
    photo.paste(paper, ((1600 - paper.width) // 2, (1200 - paper.height) // 2))
    photo = photo.rotate(
        rng.choice((-1, 1)) * rng.uniform(3.0, 4.5), resample=Image.Resampling.BICUBIC, fillcolor=(112, 92, 74)
    )
    light = Image.linear_gradient("L").rotate(90).resize(photo.size)  # dark on the left, bright on the right
    photo = Image.composite(
        photo, Image.new("RGB", photo.size, (60, 55, 50)), light.point(lambda v: 150 + v * 105 // 255)
    )
    photo = photo.filter(ImageFilter.GaussianBlur(1.1))
    return Page("photo of a note", _jpeg(_noise(photo, 10, rng), quality=70), text)


def _noise(image: Any, sigma: float, rng: random.Random) -> Any:
    import numpy as np
    from PIL import Image

    pixels = np.asarray(image, dtype=np.float32)
    noisy = pixels + np.random.default_rng(rng.randrange(2**32)).normal(0, sigma, pixels.shape)
    return Image.fromarray(np.clip(noisy, 0, 255).astype(np.uint8))


def _jpeg(image: Any, quality: int) -> Any:
    from PIL import Image

    buf = io.BytesIO()
    image.save(buf, "JPEG", quality=quality)
    return Image.open(io.BytesIO(buf.getvalue()))


# --------------------------------------------------------------------------- scoring


def cer(reference: str, hypothesis: str) -> float:
    """Character error rate: edit distance / reference length, whitespace runs made one space."""
    ref, hyp = " ".join(reference.split()), " ".join(hypothesis.split())
    if not ref:
        return float(bool(hyp))
    return edit_distance(ref, hyp) / len(ref)


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance, one row per character of `a`, each row in numpy: insertions are a running
    minimum (row[j] = min over k <= j of cost[k] + j - k), so a 3,000-character page takes milliseconds."""
    import numpy as np

    if not a or not b:
        return len(a) + len(b)
    codes = np.frombuffer(b.encode("utf-32-le"), dtype=np.uint32)
    steps = np.arange(len(b) + 1)
    row = steps.copy()
    for i, ch in enumerate(a, 1):
        cost = np.empty_like(row)
        cost[0] = i
        cost[1:] = np.minimum(row[1:] + 1, row[:-1] + (codes != ord(ch)))  # deletion, substitution
        row = np.minimum.accumulate(cost - steps) + steps  # then insertions
    return int(row[-1])


# --------------------------------------------------------------------------- engines


@dataclass(frozen=True, slots=True)
class Engine:
    """A candidate: `load()` returns a function from a PIL image to text, or raises ImportError /
    FileNotFoundError when the engine is not installed here."""

    name: str
    version: Callable[[], str]
    load: Callable[[], Callable[[Any], str]]


def _llmweb_engine() -> Callable[[Any], str]:
    from llmweb.retrieval import ocr, scans

    engine = ocr.engine()
    return lambda image: engine.read(scans.prepare(image))


def _llmweb_version() -> str:
    from llmweb.retrieval import ocr

    return ocr.engine_version()


def _rapidocr_defaults() -> Callable[[Any], str]:
    """rapidocr 3.x as it comes: the same models, its line-orientation classifier on."""
    import numpy as np
    from rapidocr import RapidOCR

    engine = RapidOCR(params={"Global.log_level": "error"})

    def read(image: Any) -> str:
        return "\n".join(engine(np.asarray(image.convert("RGB"))[:, :, ::-1]).txts or ())

    return read


def _rapidocr_144() -> Callable[[Any], str]:
    import numpy as np
    from rapidocr_onnxruntime import RapidOCR

    engine = RapidOCR()

    def read(image: Any) -> str:
        result, _ = engine(np.asarray(image.convert("RGB"))[:, :, ::-1])
        return "\n".join(text for _box, text, _score in result or [])

    return read


def _tesseract() -> Callable[[Any], str]:
    binary = shutil.which("tesseract")
    if binary is None:
        raise FileNotFoundError("tesseract")

    def read(image: Any) -> str:
        buf = io.BytesIO()
        image.save(buf, "PNG")
        done = subprocess.run(
            [binary, "stdin", "stdout", "-l", "eng"], input=buf.getvalue(), capture_output=True, check=True
        )
        return done.stdout.decode("utf-8", "replace")

    return read


def _dist_version(name: str) -> Callable[[], str]:
    def version() -> str:
        import importlib.metadata

        return f"{name} {importlib.metadata.version(name)}"

    return version


def _tesseract_version() -> str:
    binary = shutil.which("tesseract") or "tesseract"
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, check=True).stdout
    return out.splitlines()[0]


ENGINES = (
    Engine("llmweb (retrieval/ocr.py)", _llmweb_version, _llmweb_engine),
    Engine("rapidocr, its defaults (line classifier on)", _dist_version("rapidocr"), _rapidocr_defaults),
    Engine("rapidocr-onnxruntime (PP-OCRv4)", _dist_version("rapidocr-onnxruntime"), _rapidocr_144),
    Engine("tesseract (Debian)", _tesseract_version, _tesseract),
)


# --------------------------------------------------------------------------- the run


def pages(dpis: Sequence[int] = (300, 150)) -> list[Page]:
    return [*(scan_page(dpi=dpi) for dpi in dpis), note_photo()]


@dataclass(slots=True)
class _Loaded:
    engine: Engine
    read: Callable[[Any], str]
    load_s: float
    version: str
    texts: list[str]  # one per page, from the warm-up read
    seconds: list[list[float]]  # per page, one per timed read
    cpu: list[list[float]]  # per page, CPU seconds of each timed read (every thread, and child processes)


def run(dpis: Sequence[int] = (300, 150), repeats: int = 3, progress: Callable[[str], None] | None = None) -> dict:
    """Each installed engine on each page: CER and the median seconds of `repeats` reads. The timed
    reads go round by round (every engine on every page, then again), so a neighbour's load on a
    shared machine falls on every engine alike."""
    from llmweb.retrieval.ocr import OcrUnavailable

    say = progress or (lambda _m: None)
    load_before = os.getloadavg()[0]
    rendered = pages(dpis)
    rows: list[dict] = []
    loaded: list[_Loaded] = []
    for engine in ENGINES:
        try:
            t0 = time.perf_counter()
            read = engine.load()
            load_s = time.perf_counter() - t0
            version = engine.version()
        except (ImportError, FileNotFoundError, OcrUnavailable) as e:
            rows.append({"engine": engine.name, "missing": f"not installed ({type(e).__name__}: {e})"})
            say(f"{engine.name}: not installed")
            continue
        texts = [read(page.image) for page in rendered]  # the warm-up (the first call sizes buffers)
        say(f"{engine.name}: CER " + ", ".join(f"{cer(p.text, t):.3f}" for p, t in zip(rendered, texts)))
        loaded.append(_Loaded(engine, read, load_s, version, texts, [[] for _ in rendered], [[] for _ in rendered]))
        rows.append({"engine": engine.name, "version": version, "load_s": load_s, "pages": []})
    for round_ in range(repeats):
        for item in loaded:
            for page, seconds, cpu in zip(rendered, item.seconds, item.cpu):
                t0, c0 = time.perf_counter(), _cpu_seconds()
                item.read(page.image)
                seconds.append(time.perf_counter() - t0)
                cpu.append(_cpu_seconds() - c0)
        say(f"timed round {round_ + 1} of {repeats} done")
    for item in loaded:
        row = next(r for r in rows if r["engine"] == item.engine.name)
        row["pages"] = [
            {
                "page": page.name,
                "cer": cer(page.text, text),
                "seconds": statistics.median(seconds),
                "cpu_seconds": statistics.median(cpu),
                "text": text,
            }
            for page, text, seconds, cpu in zip(rendered, item.texts, item.seconds, item.cpu)
        ]
    sizes = {p.name: f"{p.image.width} x {p.image.height}" for p in rendered}
    load = {"before": load_before, "after": os.getloadavg()[0], "cores": os.cpu_count()}
    return {"dpis": list(dpis), "repeats": repeats, "pages": sizes, "rows": rows, "load_average": load}


def _cpu_seconds() -> float:
    """User + system CPU seconds of this process (all threads) and of its finished children."""
    import resource

    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def markdown(r: dict) -> str:
    names = list(r["pages"])
    lines = [
        f"## OCR: character error rate (CER), seconds and CPU seconds per page, median of {r['repeats']} reads",
        "",
        "| engine | version | load s | " + " | ".join(f"{n}: CER | s | CPU s" for n in names) + " |",
        "|---|---|---:|" + "---:|---:|---:|" * len(names),
    ]
    for row in r["rows"]:
        if "missing" in row:
            lines.append(f"| {row['engine']} | {row['missing']} | |" + " | | |" * len(names))
            continue
        cells = " | ".join(f"{p['cer']:.1%} | {p['seconds']:.2f} | {p['cpu_seconds']:.2f}" for p in row["pages"])
        lines.append(f"| {row['engine']} | {row['version']} | {row['load_s']:.2f} | {cells} |")
    pixels = ", ".join(f"{name} {size}" for name, size in r["pages"].items())
    load = r["load_average"]
    lines += [
        "",
        f"Pages (pixels): {pixels}. The machine's 1-minute load average: {load['before']:.2f} before, "
        f"{load['after']:.2f} after (this run's own included); {load['cores']} cores.",
        "",
    ]
    return "\n".join(lines)
