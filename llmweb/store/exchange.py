"""Export and import of one conversation: the JSON format (`EXPORT_FORMAT`, version 1) with its
validation, and the readable Markdown transcript (`ExchangeQueries`).

`import_json` checks a whole document (`parse_export`) before it writes anything, and always
creates a NEW conversation (a new id) of the importing owner: an export never names its owner, so
importing one cannot reach anybody's chat. It must not change the format without a new
EXPORT_VERSION, nor write an imported row that `parse_export` has not checked.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from llmweb.errors import InputError
from llmweb.records import TURN_VIEWS, GenerationStats, MemorySnapshot, Source, TurnStats
from llmweb.store.conversations import INSERT_TURN, ConversationQueries
from llmweb.store.models import MAX_TITLE_CHARS, ChatSettings, Conversation, Fact, StoredTurn, new_id
from llmweb.store.owners import check_room, owned_row, require_owned, seen, text_bytes

EXPORT_FORMAT = "llmweb.conversation"
EXPORT_VERSION = 1

# caps on what one import may hold (a shared server: an import is a stranger's file)
MAX_IMPORT_CHARS = 32 * 2**20  # the whole document, before parsing
MAX_IMPORT_TURNS = 5_000  # turns in all: the chat's and every version's
MAX_IMPORT_VERSIONS = 500  # version rows in all, nested ones included
MAX_VERSION_DEPTH = 20  # versions inside versions
MAX_IMPORT_FACTS = 2_000  # facts in all
MAX_TURN_CHARS = 1_000_000  # one message or one reply
MAX_FACT_CHARS = 10_000
MAX_SUMMARY_CHARS = 200_000
MAX_SOURCES = 100  # sources under one reply
MAX_NAME_CHARS = 4_096  # a source's file name, heading or snippet
MAX_MODEL_CHARS = 255  # the model a turn's stats name (a file name's length at most)
MAX_DOC_ID_CHARS = 100  # a source's doc_id: a content hash, or "turn-<i>"
MAX_STAT_INT = 2**53  # any figure in a turn's stats
MAX_TIME = 1e11  # unix seconds (year ~5000)
# the prompt sections a turn's stats may name: chat/context.py's SECTIONS (a test keeps them equal;
# the store may not import the chat)
SECTION_NAMES = ("system", "memory", "summary", "facts", "history", "recall", "retrieved", "user", "reserve")
SOURCE_KINDS = ("document", "recall")
_SOURCE_OPTIONAL = ("page", "heading", "score", "kind", "snippet", "doc_id", "start", "end")
_TOP = ("format", "version", "title", "created", "updated", "summary", "summarized_upto", "turns")
_TOP_OPTIONAL = ("id", "settings", "facts", "versions", "continues")  # continues: the chat it went on from
_TURN = ("idx", "user", "assistant", "stats", "sources", "created")
_TURN_OPTIONAL = ("view",)  # records.Turn.view, written only when the owner set one

TurnRow = tuple[str, str, str, str, float]  # user, assistant, stats JSON, sources JSON, created
VersionRow = tuple[int, int, str | None]  # fork, version, body JSON (None: the active version)


@dataclass(frozen=True, slots=True)
class Imported:
    """An export document, checked and ready to insert."""

    head: tuple[str, float, float, str, int, str]  # title, created, updated, summary, summarized_upto, settings
    turns: list[TurnRow]
    facts: list[tuple[str, int, float]]  # text, pinned, created
    versions: list[VersionRow]
    views: tuple[tuple[int, str], ...] = ()  # (turn idx, Turn.view) of the turns with one
    continues: str = ""  # the id of the chat it continues (kept where the importer owns that chat)

    def size(self) -> int:
        """Bytes of text it adds to its owner's chats (as conversations.bytes counts them)."""
        return (
            text_bytes(self.head[3])
            + sum(text_bytes(*r[:4]) for r in self.turns)
            + sum(text_bytes(f[0]) for f in self.facts)
            + sum(text_bytes(v[2]) for v in self.versions if v[2] is not None)
        )


class ExchangeQueries(ConversationQueries):
    def export_json(self, owner: str, conv_id: str) -> str:
        """The whole conversation as JSON; `import_json` reads it back."""
        conv = self.get(owner, conv_id)
        return to_json(conv, self._version_rows(owner, conv_id))

    def import_json(self, owner: str, text: str) -> str:
        """Create a new conversation of `owner` (with a new id) from `export_json` output; return its id."""
        doc = parse_export(text)
        conv_id = new_id()
        with self._write() as db:
            check_room(db, self.caps, owner, chats=1, size=doc.size())
            db.execute(
                "INSERT INTO conversations (id, title, created, updated, summary, summarized_upto, settings, owner) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (conv_id, *doc.head, owner),
            )
            seen(db, owner, time.time())
            db.executemany(
                INSERT_TURN,
                [(conv_id, i, *r) for i, r in enumerate(doc.turns)],
            )
            db.executemany(
                "INSERT INTO facts (conversation_id, text, pinned, created) VALUES (?, ?, ?, ?)",
                [(conv_id, *f) for f in doc.facts],
            )
            db.executemany("INSERT INTO versions VALUES (?, ?, ?, ?)", [(conv_id, *v) for v in doc.versions])
            db.executemany(
                "UPDATE turns SET view = ? WHERE conversation_id = ? AND idx = ?",
                [(view, conv_id, idx) for idx, view in doc.views],
            )
            if doc.continues:  # the link holds where the chat it names is the importer's own
                db.execute(
                    "UPDATE conversations SET continues = ? WHERE id = ? AND EXISTS "
                    "(SELECT 1 FROM conversations c WHERE c.id = ? AND c.owner = ?)",
                    (doc.continues, conv_id, doc.continues, owner),
                )
        return conv_id

    def continue_conversation(
        self, owner: str, from_id: str, summary: str, facts: Sequence[Fact | Any], turns: Sequence[StoredTurn]
    ) -> str:
        """A new chat of `owner` that continues `from_id` (theirs, else `NotFound`): its title and
        settings, the given summary and facts (pinned as they were), and `turns` (the last few, and
        those kept in context, with their say) as its first turns; linked back to it. Its id."""
        conv_id, now = new_id(), time.time()
        size = text_bytes(summary, *(f.text for f in facts), *(f"{t.user}{t.assistant}" for t in turns))
        with self._write() as db:
            title, settings = owned_row(db, owner, from_id, "title, settings")
            check_room(db, self.caps, owner, chats=1, size=size)
            db.execute(
                "INSERT INTO conversations (id, title, created, updated, summary, settings, owner, continues) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (conv_id, continued_title(title), now, now, summary, settings, owner, from_id),
            )
            seen(db, owner, now)
            for i, t in enumerate(turns):
                db.execute(INSERT_TURN, (conv_id, i, t.user, t.assistant, "{}", "[]", now))
                db.execute("UPDATE turns SET view = ? WHERE conversation_id = ? AND idx = ?", (t.view, conv_id, i))
            db.executemany(
                "INSERT INTO facts (conversation_id, text, pinned, created) VALUES (?, ?, ?, ?)",
                [(conv_id, f.text, int(f.pinned), now) for f in facts],
            )
        return conv_id

    def export_markdown(self, owner: str, conv_id: str) -> str:
        """A readable transcript. Message text is included as written (it may contain Markdown)."""
        return to_markdown(self.get(owner, conv_id))

    def _version_rows(self, owner: str, conv_id: str) -> list[dict]:
        with self._read() as db:
            require_owned(db, owner, conv_id)
            rows = db.execute(
                "SELECT fork, version, body FROM versions WHERE conversation_id = ? ORDER BY fork, version", (conv_id,)
            ).fetchall()
        return [{"fork": f, "version": v, "body": None if b is None else json.loads(b)} for f, v, b in rows]


def continued_title(title: str) -> str:
    """The title of a chat that continues one titled `title`: "… (continued)", within MAX_TITLE_CHARS."""
    tail = " (continued)"
    if title.endswith(tail):
        return title
    room = MAX_TITLE_CHARS - len(tail)
    return (title if len(title) <= room else title[: room - 1] + "…") + tail


# -- the JSON format ---------------------------------------------------------------------------


def to_json(conv: Conversation, versions: list[dict]) -> str:
    """The export document of `conv`, with its version rows as `_version_rows` gives them."""
    doc = {
        "format": EXPORT_FORMAT,
        "version": EXPORT_VERSION,
        "id": conv.id,
        "title": conv.title,
        "created": conv.created,
        "updated": conv.updated,
        "summary": conv.summary,
        "summarized_upto": conv.summarized_upto,
        "settings": conv.settings.to_dict(),
        "turns": [
            {
                "idx": t.idx,
                "user": t.user,
                "assistant": t.assistant,
                "stats": t.stats.to_dict() if t.stats else {},
                "sources": [s.to_dict() for s in t.sources],
                "created": t.created,
                **({"view": t.view} if t.view else {}),
            }
            for t in conv.turns
        ],
        "facts": [{"text": f.text, "pinned": f.pinned, "created": f.created} for f in conv.facts],
        "versions": versions,
        **({"continues": conv.continues[0]} if conv.continues else {}),
    }
    return json.dumps(doc, ensure_ascii=False, indent=1)


def parse_export(text: str) -> Imported:
    """An export document, checked whole against the format; anything malformed or over a cap is
    one InputError that names what is wrong."""
    if len(text) > MAX_IMPORT_CHARS:
        raise InputError(f"That export is over {MAX_IMPORT_CHARS // 2**20} MB of text; it cannot be imported.")
    try:
        return _parse(json.loads(text))
    except RecursionError:
        raise InputError("This file is not an llmweb conversation export (nested too deeply).") from None
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise InputError(f"This file is not an llmweb conversation export ({e}).") from None


def _parse(doc: Any) -> Imported:
    if not isinstance(doc, dict) or doc.get("format") != EXPORT_FORMAT:
        raise ValueError("not an llmweb export")
    if doc.get("version") != EXPORT_VERSION or isinstance(doc.get("version"), bool):
        raise ValueError(f"unknown export version {str(doc.get('version'))[:20]!r}")
    doc = _fields(doc, "the export", _TOP, _TOP_OPTIONAL)
    caps = _Caps()
    turns = _items(doc["turns"], "turns", MAX_IMPORT_TURNS)
    turns = [_fields(t, "a turn", _TURN, _TURN_OPTIONAL) for t in turns]
    caps.turns(len(turns))
    turns.sort(key=lambda t: _int(t["idx"], "a turn's idx", MAX_IMPORT_TURNS))
    if [t["idx"] for t in turns] != list(range(len(turns))):
        raise ValueError("turn indices are not 0..n-1")
    upto = _int(doc["summarized_upto"], "summarized_upto", len(turns))
    rows = [
        _turn_row(t["user"], t["assistant"], _stats_json(t["stats"]), _sources_json(t["sources"]), t["created"])
        for t in turns
    ]
    facts = [_fact(f) for f in _items(doc.get("facts", []), "facts", MAX_IMPORT_FACTS)]
    caps.facts(len(facts))
    versions = _import_versions(doc.get("versions", []), len(turns), caps)
    settings = json.dumps(ChatSettings.from_dict(doc.get("settings", {})).to_dict())
    title = _text(doc["title"], "the title", MAX_TITLE_CHARS)
    summary = _text(doc["summary"], "the summary", MAX_SUMMARY_CHARS)
    head = (title, _time(doc["created"]), _time(doc["updated"]), summary, upto, settings)
    views = tuple((t["idx"], _view(t["view"])) for t in turns if t.get("view"))
    continues = _text(doc.get("continues", ""), "continues", 64)
    return Imported(head, rows, facts, versions, views, continues)


def _view(v: Any) -> str:
    if v not in TURN_VIEWS or not isinstance(v, str):
        raise ValueError(f"a turn's view must be one of {TURN_VIEWS}")
    return v


def _turn_row(user: Any, assistant: Any, stats: str, sources: str, created: Any) -> TurnRow:
    return (
        _text(user, "a message", MAX_TURN_CHARS),
        _text(assistant, "a reply", MAX_TURN_CHARS),
        stats,
        sources,
        _time(created),
    )


def _fact(f: Any) -> tuple[str, int, float]:
    f = _fields(f, "a fact", ("text", "pinned", "created"))
    if not isinstance(f["pinned"], bool | int):
        raise ValueError("a fact's pinned must be true or false")
    return _text(f["text"], "a fact", MAX_FACT_CHARS), int(bool(f["pinned"])), _time(f["created"])


def _import_versions(rows: Any, n_turns: int, caps: _Caps, depth: int = 0) -> list[tuple[int, int, str | None]]:
    """An export's version rows, checked: each fork has versions 0..k-1, exactly one of them active
    (body null) at a fork inside the active turns, and every other body is a well-formed version."""
    if depth > MAX_VERSION_DEPTH:
        raise ValueError(f"versions nested over {MAX_VERSION_DEPTH} deep")
    out: list[tuple[int, int, str | None]] = []
    groups: dict[int, list[tuple[int, bool]]] = {}
    for r in _items(rows, "versions", MAX_IMPORT_VERSIONS):
        r = _fields(r, "a version", ("fork", "version", "body"))
        fork = _int(r["fork"], "a version's fork", MAX_IMPORT_TURNS)
        version = _int(r["version"], "a version's number", MAX_IMPORT_VERSIONS)
        body = None if r["body"] is None else _body(r["body"], caps, depth)
        groups.setdefault(fork, []).append((version, body is None))
        out.append((fork, version, body))
    caps.versions(len(out))
    for fork, members in groups.items():
        if sorted(v for v, _ in members) != list(range(len(members))) or sum(a for _, a in members) != 1:
            raise ValueError(f"the versions at turn {fork + 1} are not numbered 0..n-1 with one active")
        if not 0 <= fork <= n_turns:  # == n_turns: the active version's turns were all undone
            raise ValueError(f"versions at turn {fork + 1}, past the chat's turns")
    return out


def _body(body: Any, caps: _Caps, depth: int) -> str:
    """A stored version (store/versions.py's JSON), checked and written again from the checked values."""
    body = _fields(body, "a version", ("turns", "summary", "summarized_upto", "facts", "nested"), ("views",))
    turns = []
    for t in _items(body["turns"], "a version's turns", MAX_IMPORT_TURNS):
        if not isinstance(t, list) or len(t) != 5:
            raise ValueError("a version's turn must be [user, assistant, stats, sources, created]")
        user, assistant, stats, sources, created = t
        stats = _stats_json(json.loads(_text(stats, "a version's stats", MAX_TURN_CHARS)))
        sources = _sources_json(json.loads(_text(sources, "a version's sources", MAX_TURN_CHARS)))
        turns.append(list(_turn_row(user, assistant, stats, sources, created)))
    caps.turns(len(turns))
    facts = []
    for f in _items(body["facts"], "a version's facts", MAX_IMPORT_FACTS):
        if not isinstance(f, list) or len(f) != 2:
            raise ValueError("a version's fact must be [text, created]")
        facts.append([_text(f[0], "a fact", MAX_FACT_CHARS), _time(f[1])])
    caps.facts(len(facts))
    nested = []
    for n in _items(body["nested"], "a version's nested versions", MAX_IMPORT_VERSIONS):
        if not isinstance(n, list) or len(n) != 3:
            raise ValueError("a nested version must be [fork, version, body]")
        inner = n[2] if n[2] is None else json.loads(_text(n[2], "a nested version", MAX_IMPORT_CHARS))
        nested.append({"fork": n[0], "version": n[1], "body": inner})
    checked = _import_versions(nested, MAX_IMPORT_TURNS, caps, depth + 1)
    summary = _text(body["summary"], "a version's summary", MAX_SUMMARY_CHARS)
    upto = _int(body["summarized_upto"], "a version's summarized_upto", MAX_IMPORT_TURNS)
    views = [_view(v) for v in _items(body.get("views", []), "a version's views", len(turns))]
    if views and len(views) != len(turns):
        raise ValueError("a version's views must be one per turn")
    return json.dumps(
        {
            "turns": turns,
            "summary": summary,
            "summarized_upto": upto,
            "facts": facts,
            "nested": [list(v) for v in checked],
            **({"views": views} if any(views) else {}),
        }
    )


def _stats_json(d: Any) -> str:
    """Imported stats, checked field by field and written again as TurnStats writes them (keys of
    older formats that TurnStats no longer has are left out, as TurnStats.from_dict leaves them);
    an empty object stays empty."""
    if not isinstance(d, dict):
        raise TypeError("stats must be an object")
    if not d:
        return "{}"
    for name, value in d.items():
        kind = _STAT_KINDS.get(name)
        if kind == "sections":
            _sections(value)
        elif kind == "mem":
            if value is not None and not isinstance(value, dict):
                raise ValueError("stats' mem must be an object")
            for k, v in (value or {}).items():
                if k not in _MEM_KEYS:
                    raise ValueError(f"unknown key {str(k)[:40]!r} in stats' mem")
                if v is not None:
                    _int(v, f"stats' {k}", MAX_STAT_INT, lo=-MAX_STAT_INT)
        elif kind is not None:
            _STAT_CHECKS[kind](value, f"stats' {name}")
    return json.dumps(TurnStats.from_dict(d).to_dict())


def _sections(value: Any) -> None:
    if not isinstance(value, dict):
        raise ValueError("stats' sections must be an object")
    for name, n in value.items():
        if name not in SECTION_NAMES:
            raise ValueError(f"unknown prompt section {str(name)[:40]!r}")
        _int(n, f"the {name} section", MAX_STAT_INT)


def _sources_json(items: Any) -> str:
    out = []
    for s in _items(items, "sources", MAX_SOURCES):
        s = _fields(s, "a source", ("n", "source"), _SOURCE_OPTIONAL)
        if s.get("kind", "document") not in SOURCE_KINDS:
            raise ValueError(f"unknown source kind {str(s.get('kind'))[:20]!r}")
        source = Source(
            _int(s["n"], "a source's n", MAX_SOURCES, lo=1),
            _text(s["source"], "a source's name", MAX_NAME_CHARS),
            None if s.get("page") is None else _int(s["page"], "a source's page", MAX_STAT_INT),
            None if s.get("heading") is None else _text(s["heading"], "a source's heading", MAX_NAME_CHARS),
            _float(s.get("score", 0.0), "a source's score"),
            s.get("kind", "document"),
            _text(s.get("snippet", ""), "a source's snippet", MAX_NAME_CHARS),
            # where its passage is: kept as given, since opening it looks only in the importer's own
            # library and chat (chat/passages.py), where another owner's place finds nothing
            _text(s.get("doc_id", ""), "a source's doc_id", MAX_DOC_ID_CHARS),
            _int(s.get("start", 0), "a source's start", MAX_STAT_INT),
            _int(s.get("end", 0), "a source's end", MAX_STAT_INT),
        )
        out.append(source.to_dict())
    return json.dumps(out)


# -- the checks each field gets --------------------------------------------------------------------


class _Caps:
    """Counts what a whole document holds, its versions' bodies included, against the caps."""

    def __init__(self) -> None:
        self.n = {"turns": 0, "facts": 0, "versions": 0}

    def _add(self, what: str, n: int, cap: int) -> None:
        self.n[what] += n
        if self.n[what] > cap:
            raise ValueError(f"over {cap:,} {what} in all")

    def turns(self, n: int) -> None:
        self._add("turns", n, MAX_IMPORT_TURNS)

    def facts(self, n: int) -> None:
        self._add("facts", n, MAX_IMPORT_FACTS)

    def versions(self, n: int) -> None:
        self._add("versions", n, MAX_IMPORT_VERSIONS)


def _fields(d: Any, where: str, required: tuple[str, ...], optional: tuple[str, ...] = ()) -> dict:
    """`d` as an object with every `required` key, and no key but those and `optional`."""
    if not isinstance(d, dict):
        raise TypeError(f"{where} must be an object")
    unknown = [k for k in d if k not in required and k not in optional]
    if unknown:
        raise ValueError(f"unknown key {str(unknown[0])[:40]!r} in {where}")
    missing = [k for k in required if k not in d]
    if missing:
        raise KeyError(f"{where} has no {missing[0]!r}")
    return d


def _items(v: Any, where: str, cap: int) -> list:
    if not isinstance(v, list):
        raise TypeError(f"{where} must be a list")
    if len(v) > cap:
        raise ValueError(f"over {cap:,} {where}")
    return v


def _text(v: Any, where: str, cap: int) -> str:
    if not isinstance(v, str):
        raise TypeError(f"{where} must be text")
    if len(v) > cap:
        raise ValueError(f"{where} is over {cap:,} characters")
    return v


def _int(v: Any, where: str, hi: int, lo: int = 0) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise ValueError(f"{where} must be a whole number from {lo} to {hi}")
    return v


def _float(v: Any, where: str) -> float:
    if not isinstance(v, int | float) or isinstance(v, bool) or not math.isfinite(v) or abs(v) > MAX_STAT_INT:
        raise ValueError(f"{where} must be a number")
    return float(v)


def _time(v: Any) -> float:
    t = _float(v, "a time")
    if not 0 <= t <= MAX_TIME:
        raise ValueError("a time is out of range")
    return t


def _bool(v: Any, where: str) -> None:
    if not isinstance(v, bool):
        raise ValueError(f"{where} must be true or false")


def _reason(v: Any, where: str) -> None:
    if not isinstance(v, str) or not _REASON.fullmatch(v):
        raise ValueError(f"{where} must be a short word")


_STAT_CHECKS = {
    "int": lambda v, where: _int(v, where, MAX_STAT_INT),
    "float": lambda v, where: _float(v, where),
    "bool": _bool,
    "str": _reason,
    "model": lambda v, where: _text(v, where, MAX_MODEL_CHARS),
}
_STAT_KINDS = {
    **{f.name: str(f.type) for f in dataclasses.fields(GenerationStats)},
    **{f.name: str(f.type) for f in dataclasses.fields(TurnStats) if f.name != "gen"},
    "sections": "sections",
    "mem": "mem",
    "model": "model",  # a model's id: a file's stem or a folder's name, not a short word
}
_MEM_KEYS = {f.name for f in dataclasses.fields(MemorySnapshot)} | {"cuda_fragmentation_bytes"}
_REASON = re.compile(r"[a-z_]{0,20}")


# -- the Markdown transcript -------------------------------------------------------------------


def to_markdown(conv: Conversation) -> str:
    """A readable transcript of `conv`."""
    out = [
        f"# {conv.title}",
        "",
        f"_Exported from llmweb; started {_iso(conv.created)}, {len(conv.turns)} turns._",
        "",
    ]
    chosen = conv.settings.to_dict()
    if chosen:
        out += ["## This chat's settings", ""]
        out += [f"- {k.replace('_', ' ')}: {_shown(k, v)}" for k, v in chosen.items()] + [""]
    if conv.summary:
        out += [f"## Summary of the first {conv.summarized_upto} turns", "", conv.summary, ""]
    pinned = [f for f in conv.facts if f.pinned]
    if pinned:
        out += ["## Pinned notes", ""] + [f"- {f.text}" for f in pinned] + [""]
    for t in conv.turns:
        version = conv.versions.get(t.idx)
        heading = f"## Turn {t.idx + 1}" + (f" (version {version[0] + 1} of {version[1]})" if version else "")
        out += [heading, "", "**You:**", "", t.user, "", "**Assistant:**", "", t.assistant, ""]
        if t.sources:
            out += ["Sources:", ""] + [f"- {s.label()}" for s in t.sources] + [""]
    return "\n".join(out)


def _shown(name: str, value) -> str:
    """A chat setting in the transcript: the chosen documents by name, anything else as Python shows it."""
    if name == "documents":
        return ", ".join(repr(doc_name) for _, doc_name in value)
    return repr(value)


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M UTC")
