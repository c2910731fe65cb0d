"""The records the store takes and returns: `ChatSettings`, `Conversation`, `StoredTurn`, `Fact`,
`ConversationInfo`, `SearchHit`, `OwnerCaps` (per owner and per client address), the `NotFound`
error, conversation ids (`new_id`), and how a turn's stats and sources are kept as JSON text.

It owns the shape of these values (ChatSettings checks the kind of each field; chat/session.py
checks them against the server's limits). It must not run SQL or know who owns what: that is the
query groups' work (store/conversations.py and its peers), behind `Store` in store/db.py.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from llmweb.config import Settings
from llmweb.errors import LlmwebError
from llmweb.records import LOCAL_OWNER, MAX_CHAT_DOCUMENTS, Source, Turn, TurnStats

DEFAULT_TITLE = "New chat"
TITLE_CHARS = 40  # auto-titles are cut to about this many characters
MAX_TITLE_CHARS = 120  # a title the user types may be this long
HIT_START, HIT_END = "\x02", "\x03"  # around the matched words in `SearchHit.snippet`

MEMORY_MODES = ("window", "summary", "recall")  # window only; + a rolling summary; + recall of old turns
MAX_SYSTEM_PROMPT_CHARS = 4000  # a chat's own system prompt may be this long
MAX_DOC_ID_CHARS = 128  # a document id (a content hash) is far shorter
MAX_DOC_NAME_CHARS = 1024  # a document's name (a relative path for a folder's files)
ADDRESS_SHARES = 4  # one client address's budgets, by default: this many owners' caps (as LLMWEB_RUNNING_PER_ADDRESS)


@dataclass(frozen=True, slots=True)
class ChatSettings:
    """What one chat sets for itself; None = the server's configuration. The store checks only
    the shape of each value; chat/session.py checks them against the server's limits before storing."""

    system_prompt: str | None = None  # the persona; "" is a chat without one
    temperature: float | None = None  # 0 = greedy
    max_new_tokens: int | None = None  # the reply length cap
    use_docs: bool | None = None  # answer from the documents when relevant
    memory: str | None = None  # one of MEMORY_MODES
    loop_guard: bool | None = None  # never a sentence a third time (engine/runners/loopguard.py)
    # the documents this chat reads, as (doc id, name) pairs (retrieval's Library.scope resolves
    # them); None: every document the owner can read. "None at all" is use_docs=False.
    documents: tuple[tuple[str, str], ...] | None = None
    model: str | None = None  # the model this chat runs on (engine/catalog.py's id); None: the one served

    def to_dict(self) -> dict[str, Any]:
        """Only the fields this chat sets."""
        return {k: getattr(self, k) for k in self.__slots__ if getattr(self, k) is not None}

    @classmethod
    def from_dict(cls, d: Any) -> ChatSettings:
        """Read a stored or imported object; a value of the wrong kind is a ValueError."""
        if not isinstance(d, dict):
            raise ValueError("settings must be an object")
        unknown = set(d) - set(cls.__slots__)
        if unknown:
            raise ValueError(f"unknown settings {sorted(unknown)}")
        values = {k: v for k, v in d.items() if v is not None}
        if "documents" in values:
            values["documents"] = _document_pairs(values["documents"])
        out = cls(**values)
        checks = (
            ("system_prompt", lambda v: isinstance(v, str) and len(v) <= MAX_SYSTEM_PROMPT_CHARS),
            ("temperature", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v <= 2),
            ("max_new_tokens", lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1),
            ("use_docs", lambda v: isinstance(v, bool)),
            ("memory", lambda v: v in MEMORY_MODES),
            ("loop_guard", lambda v: isinstance(v, bool)),
            ("model", lambda v: isinstance(v, str) and 0 < len(v) <= MAX_DOC_NAME_CHARS),
        )
        for name, ok in checks:
            value = getattr(out, name)
            if value is not None and not ok(value):
                raise ValueError(f"bad {name} {value!r}")
        return out


def _document_pairs(value: Any) -> tuple[tuple[str, str], ...]:
    """A chat's chosen documents as stored: a non-empty list of at most MAX_CHAT_DOCUMENTS [id, name] pairs."""
    if not isinstance(value, (list, tuple)) or not 0 < len(value) <= MAX_CHAT_DOCUMENTS:
        raise ValueError(f"documents must be a list of 1 to {MAX_CHAT_DOCUMENTS} [id, name] pairs")
    pairs = []
    for pair in value:
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2 and all(isinstance(x, str) for x in pair)):
            raise ValueError("each chosen document is an [id, name] pair of strings")
        doc_id, name = pair
        if not 0 < len(doc_id) <= MAX_DOC_ID_CHARS or not 0 < len(name) <= MAX_DOC_NAME_CHARS:
            raise ValueError("a chosen document's id or name is empty or too long")
        pairs.append((doc_id, name))
    return tuple(pairs)


class NotFound(LlmwebError, LookupError):
    """The conversation (or fact) does not exist, or no longer does."""


class Deleted(NotFound):
    """The owner deleted all their data after this write's turn or fold began: it commits nothing."""


@dataclass(frozen=True, slots=True)
class ConversationInfo:
    """One row of the conversation list."""

    id: str
    title: str
    updated: float  # unix seconds
    n_turns: int


@dataclass(frozen=True, slots=True)
class SearchHit:
    """One turn that matches a search: where it is, and a snippet with the matched words between
    HIT_START and HIT_END (control characters, so they cannot clash with the text)."""

    conversation_id: str
    title: str
    idx: int  # 0-based turn index
    snippet: str


@dataclass(frozen=True, slots=True)
class StoredTurn:
    idx: int  # 0-based position in the conversation
    user: str
    assistant: str
    stats: TurnStats | None  # None for a turn stored without figures
    sources: list[Source]
    created: float = 0.0
    view: str = ""  # Turn.view: "" / PIN / OUT

    def as_turn(self) -> Turn:
        return Turn(self.user, self.assistant, self.view)


@dataclass(frozen=True, slots=True)
class Fact:
    id: int
    text: str
    pinned: bool
    created: float


@dataclass(frozen=True, slots=True)
class Conversation:
    id: str
    title: str
    summary: str
    summarized_upto: int  # the oldest `summarized_upto` turns are folded into `summary`
    turns: list[StoredTurn]
    facts: list[Fact] = field(default_factory=list)
    created: float = 0.0
    updated: float = 0.0
    owner: str = ""
    settings: ChatSettings = field(default_factory=ChatSettings)
    versions: dict[int, tuple[int, int]] = field(default_factory=dict)  # fork turn -> (active version, count)
    generation: int = 0  # the owner's generation when read (store/owners.py): a write passes it back
    continues: tuple[str, str] | None = None  # (id, title) of the owner's chat this one continues


def new_id() -> str:
    """A conversation id: 128 random bits, hex. Unguessable, so an id can serve as a capability."""
    return secrets.token_hex(16)


def deleted() -> Deleted:
    """The one answer for a write that began before its owner's "Delete all my data"."""
    return Deleted("This chat was deleted.")


def missing(conv_id: str) -> NotFound:
    """The one answer for a conversation that does not exist and for one of another owner."""
    return NotFound(f"That conversation no longer exists (id {conv_id[:8]}).")


def stats_from_text(text: str) -> TurnStats | None:
    d = json.loads(text)
    return TurnStats.from_dict(d) if d else None


def sources_from_text(text: str) -> list[Source]:
    return [Source.from_dict(d) for d in json.loads(text)]


def stats_text(stats: TurnStats | None) -> str:
    return json.dumps({} if stats is None else stats.to_dict())


def sources_text(sources: Sequence[Source]) -> str:
    # ensure_ascii=True (the default) keeps odd strings (e.g. surrogate-escaped file names) storable
    return json.dumps([s.to_dict() for s in sources])


@dataclass(frozen=True, slots=True)
class OwnerCaps:
    """What one owner may keep (0: no cap), and what all the owners of one client address may keep
    together (`address_bytes`: their chats' text; `address_doc_bytes`: their private documents). The
    local owner of a single-user install is not capped (`exempt`): it is the machine's owner, and these
    caps are for strangers sharing a server."""

    chats: int = 0
    stored_bytes: int = 0
    exempt: frozenset[str] = frozenset({LOCAL_OWNER})
    address_bytes: int = 0
    address_doc_bytes: int = 0

    @classmethod
    def from_settings(cls, settings: Settings) -> OwnerCaps:
        stored, docs = settings.owner_max_stored_mb, settings.user_docs_mb
        return cls(
            settings.owner_max_chats,
            stored * 2**20,
            address_bytes=(settings.stored_per_address_mb or ADDRESS_SHARES * stored) * 2**20,
            address_doc_bytes=(settings.docs_per_address_mb or ADDRESS_SHARES * docs) * 2**20,
        )
