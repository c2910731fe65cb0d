"""Whole-document tasks, the pure part: which messages ask for one, the pieces a document is read
in, each step's prompt, and how the pieces' notes are folded until the last step fits.

The rule (`detect`): a message asks for a whole-document task when it carries a task cue AND names
a document, or, with the per-message "whole document" toggle on, whatever it says.
  - cues: summarise (summarise/summarize/summary/tl;dr/gist), translate (translate/translation,
    "into <language>"), extract ("list/extract/find/collect/name all|every|each"), outline
    (outline, "table of contents", "structure of"), compare (compare/comparison/contrast,
    "difference(s) between"); the toggle without a cue is "ask": the message itself, applied to
    every piece;
  - the document: one of the owner's documents whose file name (or its stem, 4 characters or
    more) the message contains, the longest first (compare takes two); or, when the message says
    "this/the/my/attached document|file|pdf|paper|text|book|report", the owner's most recent upload;
  - never a question that top-k retrieval answers: a message that opens with a question word
    (what, who, when, where, why, how, which, is, are, does, do, did, can, could...) is a question,
    unless it is a request ("can/could/would you ...", "please ..."), so "What does guide.md say
    about install?" and "What is the summary of chapter 2 in guide.md?" go to retrieval.

Pieces (`split`): a document's chunks in document order (the overlap between neighbours read
once), packed whole into pieces of at most the piece budget (`Budget.piece_room`); a chunk over
it alone is cut between words. Notes (`fold_groups`) are capped so that two always fit one fold
prompt, and each fold level at least halves their number, so the fold ends in O(log n) levels.

Every function here is linear in its text and bounded by a cap; none calls the model or the store.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from llmweb.records import Chunk, source_label

SUMMARISE, TRANSLATE, EXTRACT, OUTLINE, COMPARE, ASK = "summarise", "translate", "extract", "outline", "compare", "ask"
TASKS = (SUMMARISE, TRANSLATE, EXTRACT, OUTLINE, COMPARE, ASK)
MAX_DOCUMENTS = 2  # compare reads two documents; every other task one
MAX_NAME_SCAN = 500  # documents whose names a message is matched against
MAX_DETECT_CHARS = 4_000  # the head of a message the cues are looked for in
MAX_LABEL_CHARS = 200  # a piece's "source, heading" as its step's prompt names it

_CUES = (  # (task, pattern): plain alternations, no nested quantifiers (linear)
    (TRANSLATE, re.compile(r"\btranslat(?:e|ion|ing)\b", re.I)),
    (COMPARE, re.compile(r"\b(?:compare|comparison|contrast|differences? between)\b", re.I)),
    (OUTLINE, re.compile(r"\b(?:outline|table of contents|structure of)\b", re.I)),
    (EXTRACT, re.compile(r"\b(?:list|extract|find|collect|name)\s+(?:all|every|each)\b", re.I)),
    (SUMMARISE, re.compile(r"\b(?:summari[sz]e|summari[sz]ing|summary|tl;?dr|gist)\b", re.I)),
)
_QUESTION = re.compile(
    r"\s*(?:what|who|whom|whose|when|where|why|how|which|is|are|was|were|does|do|did|has|have|should|"
    r"can|could|would|will)\b",
    re.I,
)
_REQUEST = re.compile(r"\s*(?:please\b|(?:can|could|would|will)\s+you\b)", re.I)
_TARGET = re.compile(r"\b(?:into|to|in)\s+([A-Za-z][A-Za-z-]{1,24})\b")
_DEICTIC = re.compile(
    r"\b(?:this|the|my|that|attached|uploaded)\s+(?:document|doc|file|pdf|paper|text|book|article|report|upload)\b",
    re.I,
)
_NOT_LANGUAGES = frozenset({"the", "this", "a", "an", "my", "it", "its", "each", "every", "all", "plain", "short"})


@dataclass(frozen=True, slots=True)
class DocRef:
    """A document the owner can read, as detection sees it."""

    doc_id: str
    source: str
    added: float = 0.0
    own: bool = True  # the owner's upload (the "attached" candidate), not a shared one


@dataclass(frozen=True, slots=True)
class Intent:
    """A whole-document task: what to do, on which documents, asked how."""

    task: str  # one of TASKS
    docs: tuple[DocRef, ...]  # in the order they are read
    request: str  # the user's message
    target: str = ""  # translate: the language

    @property
    def key(self) -> str:
        """What a piece's cached result depends on besides the document, the piece and the model."""
        if self.task == TRANSLATE:
            return f"{TRANSLATE}:{self.target.lower()}"
        if self.task in (EXTRACT, COMPARE, ASK):  # the request is in the instruction
            return f"{self.task}:{hashlib.sha256(self.request.encode('utf-8', 'replace')).hexdigest()[:16]}"
        return self.task


def task_of(text: str) -> str | None:
    """The task a message's cue asks for, or None (no cue, or a question for retrieval)."""
    head = text[:MAX_DETECT_CHARS]
    if _QUESTION.match(head) and not _REQUEST.match(head):
        return None
    for task, pattern in _CUES:
        if pattern.search(head):
            return task
    return None


def target_language(text: str) -> str:
    """Translate's target: the word after "into/to/in" following the cue; English if none."""
    head = text[:MAX_DETECT_CHARS]
    cue = _CUES[0][1].search(head)
    for m in _TARGET.finditer(head, cue.end() if cue else 0):
        word = m.group(1)
        if word.lower() not in _NOT_LANGUAGES and "." not in word:
            return word.capitalize()
    return "English"


def named(text: str, docs: Sequence[DocRef]) -> list[DocRef]:
    """The documents a message names (file name, or its stem of 4+ characters), longest name first."""
    lowered = text[:MAX_DETECT_CHARS].lower()
    found: list[tuple[int, DocRef]] = []
    for doc in docs[:MAX_NAME_SCAN]:
        name = doc.source.lower()
        stem = name.rsplit(".", 1)[0]
        hit = name if name and name in lowered else (stem if len(stem) >= 4 and stem in lowered else "")
        if hit:
            found.append((len(hit), doc))
    found.sort(key=lambda p: -p[0])
    return [d for _, d in found]


def detect(text: str, docs: Sequence[DocRef], force: bool = False) -> Intent | None:
    """The whole-document task `text` asks for (see the module docstring), or None."""
    task = task_of(text)
    if task is None and not force:
        return None
    task = task or ASK
    chosen = named(text, docs)
    if not chosen and (force or _DEICTIC.search(text[:MAX_DETECT_CHARS])):
        own = sorted((d for d in docs if d.own), key=lambda d: d.added)
        chosen = own[-1:]
    if not chosen:
        return None
    count = MAX_DOCUMENTS if task == COMPARE else 1
    picked = tuple(chosen[:count])
    return Intent(task, picked, text, target_language(text) if task == TRANSLATE else "")


# ---- pieces


@dataclass(frozen=True, slots=True)
class Piece:
    """A run of a document's text read in one step; `n` is its 1-based number across the task."""

    n: int
    text: str
    source: str
    doc_id: str
    index: int  # 0-based within its document (the cache key)
    page: int | None = None
    heading: str | None = None
    start: int = 0
    end: int = 0

    def label(self) -> str:
        return source_label(self.source, self.page, self.heading)

    def as_chunk(self) -> Chunk:
        return Chunk(self.text, self.source, self.page, self.heading, self.start, self.end, 1.0, self.doc_id)


def own_text(chunks: Sequence[Chunk]) -> list[tuple[Chunk, str]]:
    """Each chunk with the part of its text its predecessor did not already hold (the overlap once)."""
    out: list[tuple[Chunk, str]] = []
    end = -1
    for c in chunks:
        skip = max(0, end - c.start)
        text = c.text[skip:] if skip < len(c.text) else ""
        if text.strip():
            out.append((c, text))
        end = max(end, c.end or c.start + len(c.text))
    return out


def _cut(text: str, room: int, count: Callable[[str], int]) -> list[str]:
    """`text` cut between words into parts of at most `room` tokens (each word counted once)."""
    parts: list[str] = []
    words: list[str] = []
    used = 0
    for word in text.split():
        n = max(count(word), 1)
        if words and used + n > room:
            parts.append(" ".join(words))
            words, used = [], 0
        words.append(word[: room * 8] if n > room else word)  # a single giant "word": its head
        used += min(n, room)
    if words:
        parts.append(" ".join(words))
    return parts


def split(
    chunks: Sequence[Chunk], room: int, count: Callable[[str], int], first: int = 1, doc_id: str = ""
) -> list[Piece]:
    """One document's chunks (in document order) packed into pieces of at most `room` tokens of
    text each, numbered from `first`; `room` comes from `Budget.piece_room`."""
    assert room >= 1, "a piece needs room for at least one token"
    pieces: list[Piece] = []
    group: list[tuple[Chunk, str]] = []
    used = 0

    def close() -> None:
        nonlocal group, used
        if group:
            c0, last = group[0][0], group[-1][0]
            text = "\n\n".join(t.strip() for _, t in group)
            n = first + len(pieces)
            pieces.append(
                Piece(n, text, c0.source, doc_id or c0.doc_id, len(pieces), c0.page, c0.heading, c0.start, last.end)
            )
        group, used = [], 0

    for chunk, text in own_text(chunks):
        n = count(text) + 2  # the join between parts
        if n > room:
            close()
            for part in _cut(text, max(room - 2, 1), count):
                group, used = [(chunk, part)], room
                close()
            continue
        if used + n > room:
            close()
        group.append((chunk, text))
        used += n
    close()
    return pieces


# ---- prompts

MAP_SYSTEM = "You read one section of a long document at a time and do exactly what is asked."
FOLD_SYSTEM = (
    "You combine notes taken on the sections of a long document. Each note starts with its section number [n]."
)

_MAP = {
    SUMMARISE: "Summarise this section in a few sentences. Keep names, figures and conclusions.",
    TRANSLATE: "Translate this section into {target}. Give only the translation.",
    EXTRACT: "List every item this request asks for in this section, one per line, or write 'none': {request}",
    OUTLINE: "Give this section's main points as a short bulleted outline.",
    COMPARE: "Note what this section says that matters for this comparison: {request}",
    ASK: "Note what this section says that helps with this request, or write 'nothing': {request}",
}
_FOLD = {
    SUMMARISE: "Combine these notes into one shorter summary. Keep the [n] numbers of the sections you use.",
    EXTRACT: "Merge these lists into one, without repeats. Keep the [n] numbers.",
    OUTLINE: "Merge these outlines into one outline, in order. Keep the [n] numbers.",
    COMPARE: "Combine these notes, keeping what matters for the comparison and the [n] numbers.",
    ASK: "Combine these notes, keeping what helps with the request and the [n] numbers.",
}
_FINAL = {
    SUMMARISE: "Write a summary of the whole document from these notes. Cite sections as [n].",
    EXTRACT: "Give the complete list the request asks for, without repeats, citing sections as [n]. Request: {request}",
    OUTLINE: "Write an outline of the whole document from these notes, in order, citing sections as [n].",
    COMPARE: "Answer this comparison from the notes, citing sections as [n]: {request}",
    ASK: "Answer this request from the notes, citing sections as [n]: {request}",
}


def map_message(intent: Intent, piece: Piece | None, total: int) -> str:
    """The map step's user message for `piece` (None: the message without its text and label, to
    size it; the caller adds the longest label)."""
    where = piece.label()[:MAX_LABEL_CHARS] if piece else ""
    head = f"Section [{piece.n if piece else total}] of {total}, from {where}:"
    body = piece.text if piece else ""
    order = _MAP[intent.task].format(target=intent.target or "English", request=intent.request)
    return f"{head}\n{body}\n\n{order}"


def notes_message(intent: Intent, notes: Sequence[tuple[int, str]], final: bool) -> str:
    """A fold step's (or the final step's) user message over notes [(piece number, text)]."""
    body = "\n\n".join(f"[{n}] {text.strip()}" for n, text in notes)
    order = (_FINAL if final else _FOLD)[intent.task].format(request=intent.request)
    return f"Notes on {', '.join(d.source for d in intent.docs)}:\n{body}\n\n{order}"


_CITE = re.compile(r" ?\[(\d{1,6})\]")
_POINT = re.compile(r"[^.!?\n]*+[.!?]++|[^.!?\n]++|\n")  # a sentence, its tail, or a line break: possessive, linear
_CONTENT = re.compile(r"[^\W\d_]{4,}")  # words of four letters or more: what two texts share that means something
MIN_SHARED = 2  # content words a point must share with a section's note to cite it
MAX_CITE_CHARS = 40_000  # the reply text `attribute` cites; what follows is kept as it is
MIN_POINT_WORDS = 3  # a point shorter than this (a heading, "Notes:") gets no citation


def cite_index(notes: dict[int, str]) -> dict[str, list[int]]:
    """Content word -> the sections whose notes have it (`attribute`'s index, built once a task)."""
    index: dict[str, list[int]] = {}
    for n, text in notes.items():
        for word in {w.lower() for w in _CONTENT.findall(text)}:
            index.setdefault(word, []).append(n)
    return index


def attribute(reply: str, index: dict[str, list[int]], total: int, complete: bool = True) -> str:
    """`reply` with every point (a sentence or a line) citing the section it came from: a citation
    of a section that does not exist ([n] outside 1..total) is dropped, and a point that cites none
    gets the section whose note shares the most of its content words (`cite_index`), each word
    weighted by how few notes have it (1 / their number), when it shares at least MIN_SHARED.
    Linear in the texts. `complete=False` (a reply still streaming): only the points already ended,
    those a longer text cannot change, so each result extends the one before. Past MAX_CITE_CHARS
    the text follows uncited, none of it lost."""
    reply, rest = reply[:MAX_CITE_CHARS], reply[MAX_CITE_CHARS:]
    matches = list(_POINT.finditer(reply))
    if not complete and not rest:
        matches = [m for m in matches if m.end() < len(reply)]
    out = []
    for m in matches:
        point = _CITE.sub(lambda c: c.group(0) if 1 <= int(c.group(1)) <= total else "", m.group(0))
        words = {w.lower() for w in _CONTENT.findall(point)}
        if _CITE.search(point) is None and len(words) >= MIN_POINT_WORDS:
            best = _best_note(words, index)
            if best:
                body = point.rstrip(".!? ")
                point = f"{body} [{best}]{point[len(body) :]}"
        out.append(point)
    return "".join(out) + rest


def _best_note(words: set[str], index: dict[str, list[int]]) -> int:
    """The section sharing the most rarity-weighted words (ties: the earlier); 0 for none enough."""
    score: dict[int, float] = {}
    shared: dict[int, int] = {}
    for word in words:
        where = index.get(word, ())
        for n in where:
            score[n] = score.get(n, 0.0) + 1 / len(where)
            shared[n] = shared.get(n, 0) + 1
    ranked = sorted((n for n in score if shared[n] >= MIN_SHARED), key=lambda n: (-score[n], n))
    return ranked[0] if ranked else 0


def by_section(notes: Sequence[tuple[int, int, str]], max_chars: int = 240) -> str:
    """The answer's part that walks the document: one line per top-level note (first section, last
    section, its text), its first sentence cut to `max_chars`, citing the sections it covers."""
    lines = []
    for first, last, text in notes:
        m = _POINT.search(" ".join(text.split()))
        head = (m.group(0) if m else "").strip()[:max_chars]
        if head:
            cite = f"[{first}]" if first == last else f"[{first}]–[{last}]"
            lines.append(f"- {cite} {head}")
    return "By section:\n" + "\n".join(lines) if lines else ""


def fold_groups(sizes: Sequence[int], room: int) -> list[range]:
    """Consecutive groups of notes (their token sizes, each with its tag) whose sum fits `room`,
    at least two per group (the caller caps notes so two fit), so each level at least halves them."""
    groups: list[range] = []
    i = 0
    while i < len(sizes):
        j, used = i, 0
        while j < len(sizes) and (j - i < 2 or used + sizes[j] <= room):
            used += sizes[j]
            j += 1
        groups.append(range(i, j))
        i = j
    return groups


@dataclass(frozen=True, slots=True)
class DocumentStats:
    """What a whole-document task did (the turn's notes, the API's `x_llmweb.document`)."""

    task: str
    documents: tuple[str, ...]
    pieces: int  # pieces of the documents
    read: int  # pieces done (from the model or the cache)
    from_cache: int  # of those, from the cache
    fold_depth: int  # fold levels before the final step (0: the notes fit it at once)
    tokens_read: int  # tokens of document text read
    seconds: float
    coverage: float  # the share of the documents' text read, 0..1
    steps: int = 0  # engine requests made
    first_partial_s: float | None = None  # seconds until the first piece's result; None: none yet

    def describe(self) -> str:
        pct = round(self.coverage * 100)
        return (
            f"Read {self.read} of {self.pieces} sections of {', '.join(self.documents)} ({pct}% of the text, "
            f"{self.tokens_read:,} tokens, {self.from_cache} from cache, fold depth {self.fold_depth}) "
            f"in {self.seconds:.1f} s."
        )

    def to_dict(self) -> dict:
        return {
            "task": self.task,
            "documents": list(self.documents),
            "pieces": self.pieces,
            "read": self.read,
            "from_cache": self.from_cache,
            "fold_depth": self.fold_depth,
            "tokens_read": self.tokens_read,
            "seconds": round(self.seconds, 3),
            "coverage": round(self.coverage, 4),
            "steps": self.steps,
            "first_partial_s": None if self.first_partial_s is None else round(self.first_partial_s, 3),
        }
