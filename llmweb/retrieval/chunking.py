"""Chunking: cut a parsed `Document` into token-bounded `records.Chunk`s.

Contract:
- `chunk_document(doc, tokenizer, max_tokens, overlap)` cuts a `Document` into chunks of at most
  `max_tokens` word pieces (counted with the embedder's own Hugging Face tokenizer), preferring
  paragraph, then sentence, boundaries, with about `overlap` tokens repeated between neighbours.
  A chunk never crosses a section, and `doc.text[chunk.start:chunk.end] == chunk.text`.
- `count_tokens(tokenizer, texts)` counts word pieces without special tokens.

No torch, no model loading, no file reading: the tokenizer is passed in (anything callable like a
fast HF tokenizer), and the parsed document comes from parsers.py. Linear in the text.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from llmweb.records import Chunk
from llmweb.retrieval.parsers import Document, Section

_PARAGRAPH_BREAK = re.compile(r"\n[ \t]*\n\s*")
_SENTENCE_BREAK = re.compile(r"(?<=[.!?])\s+|(?<=[.!?][\"')\]])\s+|\n+")


@dataclass(frozen=True, slots=True)
class _Unit:
    start: int
    end: int
    tokens: int
    para: bool  # first unit of a paragraph: a preferred place to cut


def count_tokens(tokenizer, texts: Sequence[str]) -> list[int]:
    """Word pieces per text, without special tokens."""
    if not texts:
        return []
    ids = tokenizer(list(texts), add_special_tokens=False, verbose=False)["input_ids"]
    return [len(x) for x in ids]


def chunk_document(doc: Document, tokenizer, *, max_tokens: int, overlap: int) -> list[Chunk]:
    """Cut `doc` into chunks of at most `max_tokens` tokens (see the module docstring)."""
    assert max_tokens >= 8, f"max_tokens={max_tokens} is too small to chunk with"
    overlap = max(0, min(overlap, max_tokens // 2))
    chunks: list[Chunk] = []
    for section in doc.sections:
        units = _units(doc.text, section, tokenizer, max_tokens)
        for start, end in _pack(doc.text, units, tokenizer, max_tokens, overlap):
            chunks.append(
                Chunk(
                    text=doc.text[start:end],
                    source=doc.name,
                    page=section.page,
                    heading=section.heading,
                    start=start,
                    end=end,
                    doc_id=doc.doc_id,
                )
            )
    return chunks


def _units(text: str, section: Section, tokenizer, limit: int) -> list[_Unit]:
    """Sentences (and lines) of a section, each at most `limit` tokens, as character spans."""
    spans: list[tuple[int, int, bool]] = []
    for p_start, p_end in _split(text, section.start, section.end, _PARAGRAPH_BREAK):
        first = True
        for s, e in _split(text, p_start, p_end, _SENTENCE_BREAK):
            spans.append((s, e, first))
            first = False
    counts = count_tokens(tokenizer, [text[s:e] for s, e, _ in spans])
    units: list[_Unit] = []
    for (s, e, para), n in zip(spans, counts):
        if n <= limit:
            units.append(_Unit(s, e, n, para))
        else:
            units.extend(_split_long(text, s, e, para, tokenizer, limit))
    return units


def _split(text: str, start: int, end: int, pattern: re.Pattern) -> list[tuple[int, int]]:
    """Non-blank spans of text[start:end] between matches of `pattern`, trimmed of whitespace."""
    out = []
    pos = start
    for m in pattern.finditer(text, start, end):
        out.append((pos, m.start()))
        pos = m.end()
    out.append((pos, end))
    trimmed = []
    for s, e in out:
        while s < e and text[s].isspace():
            s += 1
        while e > s and text[e - 1].isspace():
            e -= 1
        if e > s:
            trimmed.append((s, e))
    return trimmed


def _split_long(text: str, start: int, end: int, para: bool, tokenizer, limit: int) -> list[_Unit]:
    """Cut an over-long sentence into windows of at most `limit` tokens, at word boundaries."""
    piece = text[start:end]
    enc = tokenizer(piece, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
    offsets = enc["offset_mapping"]
    units: list[_Unit] = []
    i = 0
    while i < len(offsets):
        j = min(i + limit, len(offsets))
        if j < len(offsets):  # back off to a token that starts after whitespace (a word start)
            k = j
            while k > i + 1 and offsets[k][0] == offsets[k - 1][1]:
                k -= 1
            if k > i + 1:
                j = k
        while True:
            s, e = start + offsets[i][0], start + offsets[j - 1][1]
            n = count_tokens(tokenizer, [text[s:e]])[0]
            if n <= limit or j == i + 1:
                break
            j -= max(1, n - limit)
            j = max(j, i + 1)
        if e > s:
            units.append(_Unit(s, e, n, para and not units))
        i = j
    return units


def _pack(text: str, units: list[_Unit], tokenizer, limit: int, overlap: int) -> list[tuple[int, int]]:
    """Greedy packing of units into (start, end) spans of at most `limit` tokens, with overlap."""
    spans: list[tuple[int, int]] = []
    i = 0
    while i < len(units):
        j, total = i, 0
        while j < len(units) and total + units[j].tokens <= limit:
            total += units[j].tokens
            j += 1
        j = max(j, i + 1)
        if j < len(units):  # we must cut: prefer a paragraph start in the chunk's second half
            acc = sum(u.tokens for u in units[i:j])
            for b in range(j - 1, i, -1):
                acc -= units[b].tokens
                if units[b].para and acc >= limit // 2:
                    j = b
                    break
        # The real count of the joined text can differ from the sum for some tokenizers: check it.
        while True:
            s, e = units[i].start, units[j - 1].end
            if j == i + 1 or count_tokens(tokenizer, [text[s:e]])[0] <= limit:
                break
            j -= 1
        spans.append((s, e))
        if j >= len(units):
            break
        # Start the next chunk with trailing units of this one (the overlap), leaving room for units[j].
        k, carried = j, 0
        while (
            k - 1 > i
            and carried + units[k - 1].tokens <= overlap
            and carried + units[k - 1].tokens + units[j].tokens <= limit
        ):
            k -= 1
            carried += units[k].tokens
        i = k
    return spans
