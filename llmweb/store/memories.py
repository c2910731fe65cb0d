"""What an owner asked to be remembered in all their chats (`MemoryQueries`): short sentences, kept
verbatim, each on or off, listed, edited and deleted by their owner alone.

Every method takes the caller's owner first and scopes its SQL by it: another owner's memory is
the same `NotFound` as a missing one. An owner holds at most MAX_MEMORIES of at most
MAX_MEMORY_CHARS each; "Delete all my data" deletes them (store/owners.py). It must not decide
what goes into a prompt (chat/context.py does) nor write one without its owner's asking.
"""

from __future__ import annotations

import json
import time
import unicodedata
from dataclasses import dataclass

from llmweb.errors import InputError
from llmweb.store.connection import Connection
from llmweb.store.models import NotFound

MAX_MEMORIES = 100  # per owner
MAX_MEMORY_CHARS = 300  # one memory, as a fact typed in the memory panel
MEMORY_FORMAT = "llmweb.memories"  # the export of an owner's memories (`export_memories`), version 1


@dataclass(frozen=True, slots=True)
class Remembered:
    id: int
    text: str
    enabled: bool
    created: float


def clean_memory(text: str) -> str:
    """One line, whitespace collapsed, control characters dropped; InputError when empty or too long."""
    if not isinstance(text, str):
        raise InputError("Type what to remember.")
    text = " ".join("".join(" " if unicodedata.category(c) == "Cc" else c for c in text).split())
    if not text:
        raise InputError("Type what to remember (it cannot be empty).")
    if len(text) > MAX_MEMORY_CHARS:
        raise InputError(f"That is {len(text):,} characters; a memory holds at most {MAX_MEMORY_CHARS}.")
    return text


class MemoryQueries(Connection):
    def add_memory(self, owner: str, text: str) -> int:
        """Remember `text` in all the owner's chats (on); its id. The same text again is the same memory."""
        text = clean_memory(text)
        with self._write() as db:
            same = db.execute("SELECT id FROM memories WHERE owner = ? AND text = ?", (owner, text)).fetchone()
            if same is not None:
                return same[0]
            (n,) = db.execute("SELECT COUNT(*) FROM memories WHERE owner = ?", (owner,)).fetchone()
            if n >= MAX_MEMORIES:
                raise InputError(f"You keep {MAX_MEMORIES} memories for all your chats already: delete one first.")
            cur = db.execute(
                "INSERT INTO memories (owner, text, enabled, created) VALUES (?, ?, 1, ?)", (owner, text, time.time())
            )
            return int(cur.lastrowid or 0)

    def memories(self, owner: str, *, enabled_only: bool = False) -> list[Remembered]:
        """The owner's memories, oldest first (only those on, with `enabled_only`)."""
        where = " AND enabled = 1" if enabled_only else ""
        with self._read() as db:
            rows = db.execute(
                f"SELECT id, text, enabled, created FROM memories WHERE owner = ?{where} ORDER BY id", (owner,)
            ).fetchall()
        return [Remembered(i, t, bool(e), c) for i, t, e, c in rows]

    def edit_memory(self, owner: str, memory_id: int, *, text: str | None = None, enabled: bool | None = None) -> None:
        """Change a memory's text and/or turn it on or off. Another owner's is `NotFound`."""
        text = clean_memory(text) if text is not None else None
        with self._write() as db:
            cur = db.execute(
                "UPDATE memories SET text = COALESCE(?, text), enabled = COALESCE(?, enabled) "
                "WHERE id = ? AND owner = ?",
                (text, None if enabled is None else int(enabled), memory_id, owner),
            )
            if cur.rowcount == 0:
                raise NotFound("That memory is gone (deleted in another tab?).")

    def export_memories(self, owner: str) -> str:
        """The owner's memories as JSON; `import_memories` reads it back."""
        items = [{"text": m.text, "enabled": m.enabled, "created": m.created} for m in self.memories(owner)]
        return json.dumps({"format": MEMORY_FORMAT, "version": 1, "memories": items}, ensure_ascii=False, indent=1)

    def import_memories(self, owner: str, text: str) -> int:
        """Add the memories of an `export_memories` file the owner lacks, on or off as they were; how
        many were added. A bad file is an InputError and adds nothing."""
        try:
            doc = json.loads(text)
            if not isinstance(doc, dict) or doc.get("format") != MEMORY_FORMAT or doc.get("version") != 1:
                raise ValueError("not an llmweb memories export")
            items = doc["memories"]
            if not isinstance(items, list) or len(items) > MAX_MEMORIES:
                raise ValueError(f"memories must be a list of at most {MAX_MEMORIES}")
            rows = [(clean_memory(m["text"]), bool(m.get("enabled", True))) for m in items]
        except (ValueError, KeyError, TypeError, InputError) as e:
            raise InputError(f"This file is not an llmweb memories export ({e}).") from None
        added = 0
        with self._write() as db:
            known = {t for (t,) in db.execute("SELECT text FROM memories WHERE owner = ?", (owner,))}
            fresh = list(dict.fromkeys(t for t, _ in rows if t not in known))
            if len(known) + len(fresh) > MAX_MEMORIES:
                raise InputError(f"With these you would keep over {MAX_MEMORIES} memories: delete some first.")
            on = dict(rows)
            for t in fresh:
                db.execute(
                    "INSERT INTO memories (owner, text, enabled, created) VALUES (?, ?, ?, ?)",
                    (owner, t, int(on[t]), time.time()),
                )
                added += 1
        return added

    def delete_memory(self, owner: str, memory_id: int) -> bool:
        """Delete one memory; False if it was already gone (or not the owner's)."""
        with self._write() as db:
            return db.execute("DELETE FROM memories WHERE id = ? AND owner = ?", (memory_id, owner)).rowcount > 0
