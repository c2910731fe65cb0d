"""Who owns what in the store: the owner checks every query group shares, and the `owners` table.

Every conversation belongs to an OWNER (the login account "user:<name>", an anonymous browser
"anon:<token>", or LOCAL_OWNER for a single-user install). Each query group scopes its SQL by the
caller's owner, in the same statement or through `owned` here; facts are reached only through a
conversation of the same owner (FACT_OWNED). Another owner's conversation behaves exactly like one
that does not exist: the same `NotFound` (models.missing), from one indexed query. `owners`
remembers when each owner was last seen, for the retention purge (`idle_owners`, `delete_owner`).
`owner_generations` is the tombstone of a delete: `delete_owner` bumps the owner's generation in
its transaction, and a write that read an older one (a reply or a fold that began before the
delete) commits nothing (`check_generation`, inside the write's transaction: `Deleted`).

`check_room` holds the per-owner caps (`OwnerCaps`: conversations, bytes of text) that every
write adding a chat or text checks in its transaction.

It must not decide who the caller is (web/ does) nor open transactions of its own beyond the
owner methods of `OwnerQueries`.
"""

from __future__ import annotations

import sqlite3
import time

from llmweb.errors import InputError
from llmweb.store.connection import Connection
from llmweb.store.models import OwnerCaps, deleted, missing

# a fact is the caller's when its conversation is (parameters: conversation id, owner)
FACT_OWNED = "conversation_id = ? AND conversation_id IN (SELECT id FROM conversations WHERE owner = ?)"


def owned(db: sqlite3.Connection, owner: str, conv_id: str) -> bool:
    return db.execute("SELECT 1 FROM conversations WHERE id = ? AND owner = ?", (conv_id, owner)).fetchone() is not None


def require_owned(db: sqlite3.Connection, owner: str, conv_id: str) -> None:
    """NotFound unless `conv_id` is `owner`'s conversation."""
    if not owned(db, owner, conv_id):
        raise missing(conv_id)


def owned_row(db: sqlite3.Connection, owner: str, conv_id: str, columns: str) -> tuple:
    """`columns` (llmweb's own SQL over the conversation `c`, never user text) of `owner`'s
    conversation `conv_id`; NotFound if there is none, or it is another owner's."""
    row = db.execute(f"SELECT {columns} FROM conversations c WHERE c.id = ? AND c.owner = ?", (conv_id, owner))
    found = row.fetchone()
    if found is None:
        raise missing(conv_id)
    return found


def generation_of(db: sqlite3.Connection, owner: str) -> int:
    """The owner's generation: how many times they deleted all their data (0: never)."""
    row = db.execute("SELECT generation FROM owner_generations WHERE owner = ?", (owner,)).fetchone()
    return 0 if row is None else int(row[0])


def check_generation(db: sqlite3.Connection, owner: str, generation: int | None) -> None:
    """`Deleted` unless the owner's generation is still `generation`, the one the writer read
    before its work began (None: a write that reads what it changes in its own transaction)."""
    if generation is not None and generation_of(db, owner) != generation:
        raise deleted()


def seen(db: sqlite3.Connection, owner: str, now: float) -> None:
    db.execute(
        "INSERT INTO owners (owner, created, last_seen) VALUES (?, ?, ?) "
        "ON CONFLICT(owner) DO UPDATE SET last_seen = excluded.last_seen",
        (owner, now, now),
    )


def check_room(db: sqlite3.Connection, caps: OwnerCaps, owner: str, chats: int = 0, size: int = 0) -> None:
    """An InputError naming the limit when `chats` more conversations or `size` more bytes of text
    would take the owner past `caps` (inside the write's transaction, so two tabs cannot both pass).
    One indexed count and a sum over the owner's chats (conversations.bytes, migration 9)."""
    if owner in caps.exempt:
        return
    if chats and caps.chats:
        (n,) = db.execute("SELECT COUNT(*) FROM conversations WHERE owner = ?", (owner,)).fetchone()
        if n + chats > caps.chats:
            raise InputError(
                f"You have {n:,} chats here, the most one person may keep (LLMWEB_OWNER_MAX_CHATS = "
                f"{caps.chats:,}). Delete one to start another."
            )
    if size > 0 and caps.stored_bytes:
        (used,) = db.execute("SELECT COALESCE(SUM(bytes), 0) FROM conversations WHERE owner = ?", (owner,)).fetchone()
        if used + size > caps.stored_bytes:
            raise InputError(
                f"Your chats hold {_mb(used)} of text; this would add {_mb(size)}, past the "
                f"{_mb(caps.stored_bytes)} one person may keep (LLMWEB_OWNER_MAX_STORED_MB). "
                "Delete some chats first."
            )


def text_bytes(*texts: str) -> int:
    """The UTF-8 bytes of texts, as the store keeps them (conversations.bytes)."""
    return sum(len(t.encode("utf-8", "surrogatepass")) for t in texts)


def _mb(n: int) -> str:
    return f"{n / 2**20:,.1f} MB" if n >= 2**20 else f"{max(n, 0) / 1024:,.0f} kB"


class OwnerQueries(Connection):
    """The owners table: when each owner was last seen, and deleting all an owner stored."""

    def touch_owner(self, owner: str) -> None:
        """Note that an owner is active now (a page load, a message): the retention purge counts from here."""
        with self._write() as db:
            seen(db, owner, time.time())

    def delete_owner(self, owner: str) -> list[str]:
        """Delete everything the owner stored here (conversations, turns, facts); return the
        conversation ids. Bumps the owner's generation: a write begun before commits nothing."""
        with self._write() as db:
            ids = [r[0] for r in db.execute("SELECT id FROM conversations WHERE owner = ?", (owner,))]
            db.execute("DELETE FROM conversations WHERE owner = ?", (owner,))
            db.execute("DELETE FROM owners WHERE owner = ?", (owner,))
            db.execute("DELETE FROM document_pieces WHERE owner = ?", (owner,))  # whole-document results
            db.execute("DELETE FROM memories WHERE owner = ?", (owner,))  # what they asked every chat to remember
            db.execute(
                "INSERT INTO owner_generations (owner, generation) VALUES (?, 1) "
                "ON CONFLICT(owner) DO UPDATE SET generation = generation + 1",
                (owner,),
            )
        return ids

    def room(self, owner: str, chats: int = 0, size: int = 0) -> None:
        """`check_room` ahead of a long write (a reply generates for seconds before its turn is
        stored): the InputError naming the limit now, not after the work. The write checks again."""
        with self._read() as db:
            check_room(db, self.caps, owner, chats, size)

    def generation(self, owner: str) -> int:
        """The owner's generation now: a turn of a new chat reads it before it begins, and its
        write passes it back (`add_turn(..., generation=)`)."""
        with self._read() as db:
            return generation_of(db, owner)

    def alive(self, owner: str, conv_id: str, generation: int) -> bool:
        """Is `conv_id` still the owner's, with no "Delete all my data" since `generation`? (The
        recall index checks this before it writes its folder.)"""
        with self._read() as db:
            return generation_of(db, owner) == generation and owned(db, owner, conv_id)

    def idle_owners(self, prefix: str, idle_s: float, now: float | None = None) -> list[str]:
        """Owners whose name starts with `prefix` (e.g. "anon:") and who were last seen `idle_s` ago or more."""
        cutoff = (time.time() if now is None else now) - idle_s
        with self._read() as db:
            rows = db.execute(
                "SELECT owner FROM owners WHERE substr(owner, 1, ?) = ? AND last_seen <= ? ORDER BY last_seen",
                (len(prefix), prefix, cutoff),
            ).fetchall()
        return [r[0] for r in rows]
