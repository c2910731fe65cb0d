"""Plain records passed between modules: turns, chunks, sources and the per-turn statistics.

No behaviour beyond conversions, no imports beyond the standard library, so every module can
share them. `to_dict`/`from_dict` are used only at the edges (SQLite, JSON output, the API).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

LOCAL_OWNER = "local"  # the one owner of a single-user install, and of data from before owners existed
MAX_CHAT_DOCUMENTS = 100  # documents one chat may choose to read (ChatSettings.documents, Library.resolve)

# what its owner says of a turn in the prompt (Turn.view): "" as the planner sees fit, PIN kept in
# context (never folded, never dropped while it fits), OUT left out (of every prompt, summary and recall)
PIN, OUT = "pin", "out"
TURN_VIEWS = ("", PIN, OUT)
VIEW_WORDS = {"keep": PIN, "leave_out": OUT, "as_planned": ""}  # as the API and a replay script name each view


@dataclass(frozen=True, slots=True)
class Turn:
    """One finished exchange: what the user said and what the assistant answered; `view` is its
    owner's say in what the model sees of it (TURN_VIEWS)."""

    user: str
    assistant: str
    view: str = ""


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
        return source_label(self.source, self.page, self.heading)


@dataclass(frozen=True, slots=True)
class Source:
    """A numbered source shown under an answer: a document chunk or a recalled earlier turn."""

    n: int  # the [number] the prompt and the answer use
    source: str
    page: int | None = None
    heading: str | None = None
    score: float = 0.0
    kind: str = "document"  # document | recall
    snippet: str = ""
    # where the passage is, to open it again (chat/passages.py): the chunk's `doc_id` (a document's
    # content hash; "turn-<i>" for recall) and its character offsets; "" in turns stored before
    doc_id: str = ""
    start: int = 0
    end: int = 0

    SNIPPET_CHARS = 240

    @classmethod
    def from_chunk(cls, chunk: Chunk, n: int) -> Source:
        text = " ".join(chunk.text.split())
        snippet = text[: cls.SNIPPET_CHARS] + ("…" if len(text) > cls.SNIPPET_CHARS else "")
        score = round(float(chunk.score), 3)
        where = (chunk.doc_id, chunk.start, chunk.end)
        return cls(n, chunk.source, chunk.page, chunk.heading, score, chunk.kind, snippet, *where)

    def label(self) -> str:
        return source_label(self.source, self.page, self.heading)

    def to_dict(self) -> dict[str, Any]:
        """The stored form; the place (`doc_id`, `start`, `end`) only when known, so a source
        without one is stored as before."""
        fields = _SOURCE_FIELDS + (_PLACE_FIELDS if self.doc_id else ())
        return {f: getattr(self, f) for f in fields}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Source:
        return cls(**{k: d[k] for k in _SOURCE_FIELDS + _PLACE_FIELDS if k in d})


_SOURCE_FIELDS = ("n", "source", "page", "heading", "score", "kind", "snippet")
_PLACE_FIELDS = ("doc_id", "start", "end")


def source_label(source: str, page: int | None, heading: str | None) -> str:
    """ "file.pdf, p. 3", "guide.md, Install" or "notes.txt": the one way a source is named."""
    where = f"p. {page}" if page else (heading or "")
    return f"{source}, {where}" if where else source


# ---- statistics: what the engine measured for one request, and what the chat adds per turn


ENGINE_STOPPED = "engine_stopped"  # a turn's finish_reason when the model's process died under it


@dataclass(frozen=True, slots=True)
class MemorySnapshot:
    rss_bytes: int = 0
    peak_rss_bytes: int = 0  # during the request (sampled), 0 when not measured
    cuda_allocated_bytes: int | None = None
    cuda_reserved_bytes: int | None = None
    cuda_peak_bytes: int | None = None  # since the last reset_peak: a request that starts on an empty batch
    cuda_inactive_split_bytes: int | None = None
    cuda_alloc_retries: int | None = None
    cuda_ooms: int | None = None

    @property
    def fragmentation_bytes(self) -> int | None:
        if self.cuda_reserved_bytes is None or self.cuda_allocated_bytes is None:
            return None
        return self.cuda_reserved_bytes - self.cuda_allocated_bytes

    @property
    def on_cuda(self) -> bool:
        return self.cuda_allocated_bytes is not None

    def to_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in dataclasses.asdict(self).items() if v is not None}
        if self.fragmentation_bytes is not None:
            d["cuda_fragmentation_bytes"] = self.fragmentation_bytes
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> MemorySnapshot:
        return cls(**_known(cls, d or {}))


@dataclass(slots=True)
class GenerationStats:
    """What the engine measured for one request."""

    prompt_tokens: int = 0
    generated_tokens: int = 0
    reused_tokens: int = 0  # prompt tokens served from the session's KV cache
    reuse_reported: bool = True  # False: a remote engine did not report its cached tokens (reused 0 = unknown)
    prefilled_tokens: int = 0  # prompt tokens computed this time
    queue_wait_s: float = 0.0
    ttft_s: float = 0.0  # from the start of processing to the first new token
    decode_tok_s: float = 0.0
    total_s: float = 0.0
    finish_reason: str = ""  # eos | length | cancelled | timeout | engine_stopped (a kept partial reply)
    kv_session_bytes: int = 0
    kv_store_bytes: int = 0
    predicted_bytes: int = 0  # admission control's estimate of the request's peak
    oom_retry: bool = False
    batch_size: int = 1  # the most requests that shared a decode step with this one (1 = alone)
    loop_cuts: int = 0  # times the loop guard turned the reply away from a third copy of a sentence
    loop_stopped: bool = False  # the guard ended the reply as a loop
    mem: MemorySnapshot | None = None

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "mem"}
        d["mem"] = self.mem.to_dict() if self.mem else {}
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GenerationStats:
        known = _known(cls, d)
        known["mem"] = MemorySnapshot.from_dict(d.get("mem")) if d.get("mem") else None
        return cls(**known)


@dataclass(slots=True)
class TurnStats:
    """One chat turn: the engine's figures plus the prompt plan's itemisation.

    Flattened by `to_dict` for the store, the replay JSON and the API; `from_dict` reads it back
    (missing keys take their defaults, unknown keys are ignored, so older rows still load).
    """

    turn: int
    gen: GenerationStats
    sections: dict[str, int] = field(default_factory=dict)
    context_limit: int = 0
    dropped_turns: int = 0
    summarized_turns: int = 0
    summary_tokens: int = 0
    dropped_chunks: int = 0
    dropped_facts: int = 0  # unpinned facts left out for lack of room
    # a whole-document task's own figures (chat/document_plan.py DocumentStats.to_dict): pieces read
    # and from cache, fold depth, tokens read, seconds, coverage; empty for an ordinary turn
    document: dict[str, Any] = field(default_factory=dict)
    model: str = ""  # the model that answered (engine/catalog.py's id), "" where not known

    @property
    def mem(self) -> MemorySnapshot:
        return self.gen.mem or MemorySnapshot()

    @property
    def stopped(self) -> bool:
        """Cut short: by the user (stop, a client gone), or by the model process's death."""
        return self.gen.finish_reason in ("cancelled", ENGINE_STOPPED)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"turn": self.turn}
        d.update(self.gen.to_dict())
        d.update(
            sections=dict(self.sections),
            context_limit=self.context_limit,
            dropped_turns=self.dropped_turns,
            summarized_turns=self.summarized_turns,
            summary_tokens=self.summary_tokens,
            dropped_chunks=self.dropped_chunks,
            dropped_facts=self.dropped_facts,
        )
        if self.model:
            d["model"] = self.model
        if self.document:
            d["document"] = dict(self.document)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TurnStats:
        known = _known(cls, d)
        known.pop("gen", None)
        known.setdefault("turn", 0)
        known["sections"] = {str(k): int(v) for k, v in (d.get("sections") or {}).items()}
        known["document"] = dict(d["document"]) if isinstance(d.get("document"), dict) else {}
        return cls(gen=GenerationStats.from_dict(d), **known)


def _known(cls, d: dict[str, Any]) -> dict[str, Any]:
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in d.items() if k in names and k != "mem"}
