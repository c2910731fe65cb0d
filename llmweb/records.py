"""Plain records passed between modules: a conversation turn and a retrieved chunk.

No behaviour, no imports beyond the standard library, so every module can share them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Turn:
    """One finished exchange: what the user said and what the assistant answered."""

    user: str
    assistant: str


@dataclass(frozen=True, slots=True)
class Chunk:
    """A piece of a document (or, with kind="recall", of an earlier turn) with where it came from."""

    text: str
    source: str  # the file name shown to the user (never an absolute path)
    page: int | None = None  # 1-based page for PDFs
    heading: str | None = None  # nearest heading for Markdown / HTML / DOCX
    start: int = 0  # character offsets in the document's extracted text
    end: int = 0
    score: float = 0.0
    doc_id: str = ""
    kind: str = "document"

    def label(self) -> str:
        where = f"p. {self.page}" if self.page else (self.heading or "")
        return f"{self.source}, {where}" if where else self.source
