"""Facts: the user's own sentences, kept verbatim, reached only through the owner's conversation.

It owns the `facts` table's queries (`FactQueries`, and `facts_of` for reads that already checked
the owner). It must not reach a fact except through FACT_OWNED or a conversation already checked.
"""

from __future__ import annotations

import sqlite3
import time

from llmweb.store.connection import Connection
from llmweb.store.models import Fact, NotFound
from llmweb.store.owners import FACT_OWNED, check_generation, check_room, require_owned, text_bytes


def facts_of(db: sqlite3.Connection, conv_id: str) -> list[Fact]:
    """A conversation's facts, oldest first (the caller has checked its owner)."""
    return [
        Fact(fid, text, bool(pinned), created)
        for fid, text, pinned, created in db.execute(
            "SELECT id, text, pinned, created FROM facts WHERE conversation_id = ? ORDER BY id", (conv_id,)
        )
    ]


class FactQueries(Connection):
    def add_fact(
        self, owner: str, conv_id: str, text: str, pinned: bool = True, *, generation: int | None = None
    ) -> int:
        """A fact of the owner's conversation; its id. With `generation` (a fold's, read before it
        began), `Deleted` when the owner deleted all their data since: nothing is added."""
        with self._write() as db:
            check_generation(db, owner, generation)
            require_owned(db, owner, conv_id)
            check_room(db, self.caps, owner, size=text_bytes(text))
            cur = db.execute(
                "INSERT INTO facts (conversation_id, text, pinned, created) VALUES (?, ?, ?, ?)",
                (conv_id, text, int(bool(pinned)), time.time()),
            )
            assert cur.lastrowid is not None  # set by every INSERT
            return cur.lastrowid

    def set_fact_pinned(self, owner: str, conv_id: str, fact_id: int, pinned: bool) -> None:
        with self._write() as db:
            cur = db.execute(
                f"UPDATE facts SET pinned = ? WHERE id = ? AND {FACT_OWNED}",
                (int(bool(pinned)), fact_id, conv_id, owner),
            )
            if cur.rowcount == 0:
                raise NotFound("That fact no longer exists.")

    def delete_fact(self, owner: str, conv_id: str, fact_id: int) -> bool:
        """False if it was already gone (or is not the owner's)."""
        with self._write() as db:
            return (
                db.execute(f"DELETE FROM facts WHERE id = ? AND {FACT_OWNED}", (fact_id, conv_id, owner)).rowcount > 0
            )

    def facts(self, owner: str, conv_id: str) -> list[Fact]:
        with self._read() as db:
            require_owned(db, owner, conv_id)
            return facts_of(db, conv_id)
