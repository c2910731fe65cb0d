"""Opening a cited source again: the passage a turn gave the model, with its document's text around it.

Owns `open_source(library, owner, conv, source) -> Passage | None`. A document source is found by
its place (`Source.doc_id`, `start`, `end`) in what `owner` may read (`Library.chunks`: their own
library, then the shared one), and its text must still begin with the snippet stored with the
turn; a recall source is its earlier turn of `conv` (the owner's own conversation, as the caller
read it). A source stored before sources kept their place is found by its name, page or heading,
and first words. Anything else is None, one answer whatever the reason: another owner's document,
a document removed or re-ingested since, a forged place, a turn no longer in the chat.

Bounded and linear: the passage is at most PASSAGE_CHARS, each neighbour NEIGHBOUR_CHARS, and the
work one pass over the document's chunks. It must not format anything (web/formatting.py does),
work out who the owner is, or read an index's files itself.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from llmweb.records import Chunk, Source

# A chunk is LLMWEB_CHUNK_TOKENS embedder tokens (about 1,000 characters at the default 200); a
# whole-document task's piece, or a chunk of a larger setting, can be longer: cut, and said so.
PASSAGE_CHARS = 8_000
NEIGHBOUR_CHARS = 1_200  # of the document's text on each side of the passage
_TURN = re.compile(r"turn-(\d{1,9})")  # a recall source's doc_id (chat/recall.py)
_TURN_NAME = re.compile(r"turn (\d{1,9})")  # its name, "turn 3", in turns stored before places


@dataclass(frozen=True, slots=True)
class Excerpt:
    """Some of a document's text, with where it starts (page or heading)."""

    text: str
    page: int | None = None
    heading: str | None = None
    cut: bool = False  # longer than shown


@dataclass(frozen=True, slots=True)
class Passage:
    """A cited source opened: its passage, and the document's text just before and after it."""

    source: Source  # as the turn stored it
    cited: Excerpt
    before: Excerpt | None = None
    after: Excerpt | None = None
    by_words: bool = False  # found by its name and first words (a turn stored before sources kept their place)


def open_source(library, owner: str, conv, source: Source) -> Passage | None:
    """`source` (of a turn of `conv`, which the caller read as `owner`'s) opened for `owner`, or
    None when it cannot be found in what they may read."""
    if source.kind == "recall":
        return _recall(conv, source)
    if source.doc_id:  # its place: that document (same bytes), if the owner may read it, or nothing
        chunks = library.chunks(owner, source.doc_id)
        return locate(chunks, source) or by_words(chunks, source)
    for doc in library.documents(owner):  # stored before sources kept their place: by name and words
        if doc.source == source.source and doc.kind == "document":
            found = by_words(library.chunks(owner, doc.doc_id), source)
            if found is not None:
                return found
    return None


def locate(chunks: Sequence[Chunk], source: Source) -> Passage | None:
    """The passage over `source`'s offsets in its document, from the document's chunks (in
    document order), if its text still begins with the stored snippet."""
    a, b = source.start, source.end
    if b <= a:
        return None
    start = next((c for c in chunks if c.start <= a < _end(c)), None)
    if start is None:
        return None
    text, cut = _head(joined(chunks, a, b, PASSAGE_CHARS + 1), PASSAGE_CHARS)
    if not text.strip() or not _begins(text, source.snippet):
        return None
    cited = Excerpt(text, start.page, start.heading, cut)
    return Passage(source, cited, *_neighbours(chunks, a, b))


def by_words(chunks: Sequence[Chunk], source: Source) -> Passage | None:
    """The first chunk with `source`'s page and heading whose text begins with its snippet."""
    if not source.snippet.strip():
        return None
    for c in chunks:
        if c.page == source.page and c.heading == source.heading and _begins(c.text, source.snippet):
            text, cut = _head(c.text, PASSAGE_CHARS)
            before, after = _neighbours(chunks, c.start, _end(c))
            return Passage(source, Excerpt(text, c.page, c.heading, cut), before, after, by_words=True)
    return None


def joined(chunks: Sequence[Chunk], a: int, b: int, cap: int | None = None) -> str:
    """The document's text over [a, b), put together from its chunks (each an exact slice of it,
    neighbours overlapping): a gap between two chunks, whitespace the chunker trimmed, becomes a
    paragraph break. With `cap`, it stops once it has that many characters."""
    parts: list[str] = []
    at, size = a, 0
    for c in chunks:
        s, e = c.start, _end(c)
        if e <= at or s >= b:
            continue
        if s > at and parts:
            parts.append("\n\n")
        lo = max(at, s)
        parts.append(c.text[lo - s : min(b, e) - s])
        size += len(parts[-1])
        at = min(b, e)
        if at >= b or (cap is not None and size >= cap):
            break
    return "".join(parts)


def _neighbours(chunks: Sequence[Chunk], a: int, b: int) -> tuple[Excerpt | None, Excerpt | None]:
    """The document's text just before [a, b) (from the chunk before it) and just after it (to the
    end of the chunk after it), each at most NEIGHBOUR_CHARS, nearest the passage kept."""
    prev = nxt = None
    for c in chunks:
        if c.start < a:
            prev = c
        elif nxt is None and _end(c) > b:
            nxt = c
    before = after = None
    if prev is not None:
        text, cut = _tail(joined(chunks, prev.start, a), NEIGHBOUR_CHARS)
        before = Excerpt(text, prev.page, prev.heading, cut) if text.strip() else None
    if nxt is not None:
        text, cut = _head(joined(chunks, b, _end(nxt), NEIGHBOUR_CHARS + 1), NEIGHBOUR_CHARS)
        after = Excerpt(text, nxt.page, nxt.heading, cut) if text.strip() else None
    return before, after


def _recall(conv, source: Source) -> Passage | None:
    """An earlier turn of this chat, as recall gave it to the model, if it is still the turn shown
    there (an edit may have put another version of the chat in its place)."""
    m = _TURN.fullmatch(source.doc_id) if source.doc_id else _TURN_NAME.fullmatch(source.source)
    if m is None:
        return None
    idx = int(m.group(1)) - (0 if source.doc_id else 1)
    turn = next((t for t in conv.turns if t.idx == idx), None)
    if turn is None:
        return None
    text, cut = _head(f"User: {turn.user}\nAssistant: {turn.assistant}", PASSAGE_CHARS)
    if not _begins(text, source.snippet):
        return None
    return Passage(source, Excerpt(text, cut=cut))


def _begins(text: str, snippet: str) -> bool:
    """Does `text`, its whitespace runs as single spaces, begin with `snippet` (records.Source: the
    chunk's first SNIPPET_CHARS so written, then "…" when there was more)?"""
    want = snippet.removesuffix("…")
    return " ".join(text[: 4 * Source.SNIPPET_CHARS + 4 * len(want)].split()).startswith(want)


def _end(c: Chunk) -> int:
    return c.end if c.end > c.start else c.start + len(c.text)


def _head(text: str, cap: int) -> tuple[str, bool]:
    """The first `cap` characters of `text`, cut at a space when one is near; (text, was it cut)."""
    if len(text) <= cap:
        return text, False
    cut = text[:cap]
    space = cut.rfind(" ", cap * 4 // 5)
    return (cut[:space] if space > 0 else cut) + "…", True


def _tail(text: str, cap: int) -> tuple[str, bool]:
    """The last `cap` characters of `text`, cut at a space when one is near; (text, was it cut)."""
    if len(text) <= cap:
        return text, False
    cut = text[-cap:]
    space = cut.find(" ", 0, cap // 5)
    return "…" + (cut[space + 1 :] if space >= 0 else cut), True
