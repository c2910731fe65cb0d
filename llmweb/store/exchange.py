"""Export and import of one conversation: the JSON format (`EXPORT_FORMAT`, version 1) with its
validation, and the readable Markdown transcript (`ExchangeQueries`).

`import_json` checks a whole document (`parse_export`) before it writes anything, and always
creates a NEW conversation (a new id) of the importing owner: an export never names its owner, so
importing one cannot reach anybody's chat. It must not change the format without a new
EXPORT_VERSION, nor write an imported row that `parse_export` has not checked.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from llmweb.errors import InputError
from llmweb.records import Source, TurnStats
from llmweb.store.conversations import ConversationQueries
from llmweb.store.models import ChatSettings, Conversation, new_id
from llmweb.store.owners import require_owned, seen

EXPORT_FORMAT = "llmweb.conversation"
EXPORT_VERSION = 1

TurnRow = tuple[str, str, str, str, float]  # user, assistant, stats JSON, sources JSON, created
VersionRow = tuple[int, int, str | None]  # fork, version, body JSON (None: the active version)


@dataclass(frozen=True, slots=True)
class Imported:
    """An export document, checked and ready to insert."""

    head: tuple[str, float, float, str, int, str]  # title, created, updated, summary, summarized_upto, settings
    turns: list[TurnRow]
    facts: list[tuple[str, int, float]]  # text, pinned, created
    versions: list[VersionRow]


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
            db.execute(
                "INSERT INTO conversations (id, title, created, updated, summary, summarized_upto, settings, owner) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (conv_id, *doc.head, owner),
            )
            seen(db, owner, time.time())
            db.executemany(
                "INSERT INTO turns (conversation_id, idx, user, assistant, stats, sources, created) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)",
                [(conv_id, i, *r) for i, r in enumerate(doc.turns)],
            )
            db.executemany(
                "INSERT INTO facts (conversation_id, text, pinned, created) VALUES (?, ?, ?, ?)",
                [(conv_id, *f) for f in doc.facts],
            )
            db.executemany("INSERT INTO versions VALUES (?, ?, ?, ?)", [(conv_id, *v) for v in doc.versions])
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
            }
            for t in conv.turns
        ],
        "facts": [{"text": f.text, "pinned": f.pinned, "created": f.created} for f in conv.facts],
        "versions": versions,
    }
    return json.dumps(doc, ensure_ascii=False, indent=1)


def parse_export(text: str) -> Imported:
    """An export document, checked whole; anything malformed is one InputError."""
    try:
        return _parse(json.loads(text))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise InputError(f"This file is not an llmweb conversation export ({e}).") from None


def _parse(doc: Any) -> Imported:
    if not isinstance(doc, dict) or doc.get("format") != EXPORT_FORMAT:
        raise ValueError("not an llmweb export")
    if doc.get("version") != EXPORT_VERSION:
        raise ValueError(f"unknown export version {doc.get('version')!r}")
    turns = sorted(doc["turns"], key=lambda t: t["idx"])
    if [t["idx"] for t in turns] != list(range(len(turns))):
        raise ValueError("turn indices are not 0..n-1")
    upto = int(doc["summarized_upto"])
    if not 0 <= upto <= len(turns):
        raise ValueError("summarized_upto out of range")
    rows = [
        (
            t["user"],
            t["assistant"],
            _stats_json(t["stats"]),
            json.dumps([Source.from_dict(s).to_dict() for s in t["sources"]]),
            float(t["created"]),
        )
        for t in turns
    ]
    if not all(isinstance(v, str) for r in rows for v in r[:2]):
        raise ValueError("turn text must be strings")
    facts = [(str(f["text"]), int(bool(f["pinned"])), float(f["created"])) for f in doc.get("facts", [])]
    versions = _import_versions(doc.get("versions", []), len(turns))
    settings = json.dumps(ChatSettings.from_dict(doc.get("settings", {})).to_dict())
    head = (str(doc["title"]), float(doc["created"]), float(doc["updated"]), str(doc["summary"]), upto, settings)
    return Imported(head, rows, facts, versions)


def _import_versions(rows: Any, n_turns: int) -> list[tuple[int, int, str | None]]:
    """An export's version rows, checked: each fork has versions 0..k-1, exactly one of them active
    (body null) at a fork inside the active turns, and every other body is a well-formed version."""
    if not isinstance(rows, list):
        raise TypeError("versions must be a list")
    out: list[tuple[int, int, str | None]] = []
    groups: dict[int, list[tuple[int, bool]]] = {}
    for r in rows:
        fork, version, body = int(r["fork"]), int(r["version"]), r["body"]
        if body is not None:
            _check_body(body)
        groups.setdefault(fork, []).append((version, body is None))
        out.append((fork, version, None if body is None else json.dumps(body)))
    for fork, members in groups.items():
        if sorted(v for v, _ in members) != list(range(len(members))) or sum(a for _, a in members) != 1:
            raise ValueError(f"the versions at turn {fork + 1} are not numbered 0..n-1 with one active")
        if not 0 <= fork <= n_turns:  # == n_turns: the active version's turns were all undone
            raise ValueError(f"versions at turn {fork + 1}, past the chat's turns")
    return out


def _check_body(body: Any) -> None:
    if not isinstance(body, dict) or not isinstance(body.get("turns"), list):
        raise TypeError("a version must be an object with turns")
    for t in body["turns"]:
        user, assistant, stats, sources, created = t
        if not (isinstance(user, str) and isinstance(assistant, str)):
            raise ValueError("turn text must be strings")
        _stats_json(json.loads(stats))
        [Source.from_dict(s) for s in json.loads(sources)]
        float(created)
    if not isinstance(body["summary"], str) or not 0 <= int(body["summarized_upto"]):
        raise ValueError("a version's summary is malformed")
    for text, created in body["facts"]:
        if not isinstance(text, str):
            raise ValueError("facts must be text")
        float(created)
    for nested in body["nested"]:
        fork, version, inner = nested
        int(fork), int(version)
        if inner is not None:
            _check_body(json.loads(inner))


def _stats_json(d: Any) -> str:
    """Imported stats, checked by reading them as TurnStats; an empty object stays empty."""
    if not isinstance(d, dict):
        raise TypeError("stats must be an object")
    return json.dumps(TurnStats.from_dict(d).to_dict() if d else {})


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
        out += [f"- {k.replace('_', ' ')}: {v!r}" for k, v in chosen.items()] + [""]
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


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M UTC")
