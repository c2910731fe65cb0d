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
write adding a chat or text checks in its transaction, and the budget of the owner's client address:
one visitor can start many anonymous owners, so `owners` keeps each one's address group (the web
layer's word, `note_address`; NULL: its own) and its private documents' bytes (`claim_document_bytes`,
`record_document_bytes`), and what all the owners of one address keep is an indexed sum
(`check_room`, `check_document_room`).

It must not decide who the caller is (web/ does) nor open transactions of its own beyond the
owner methods of `OwnerQueries`.
"""

from __future__ import annotations

import sqlite3
import time

from llmweb.errors import InputError
from llmweb.store.connection import Connection
from llmweb.store.models import OwnerCaps, deleted, missing

ADDRESSES_KEPT = 10_000  # owners whose last written address this process remembers (`note_address`)
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
    would take the owner past `caps`, or all the owners of its address past `caps.address_bytes`
    (inside the write's transaction, so two tabs cannot both pass). One indexed count and a sum over
    the owner's chats (conversations.bytes, migration 9), and one over its address's other owners'
    rows (owners.chat_bytes, migration 12)."""
    if owner in caps.exempt:
        return
    if chats and caps.chats:
        (n,) = db.execute("SELECT COUNT(*) FROM conversations WHERE owner = ?", (owner,)).fetchone()
        if n + chats > caps.chats:
            raise InputError(
                f"You have {n:,} chats here, the most one person may keep (LLMWEB_OWNER_MAX_CHATS = "
                f"{caps.chats:,}). Delete one to start another."
            )
    if size <= 0 or not (caps.stored_bytes or caps.address_bytes):
        return
    (used,) = db.execute("SELECT COALESCE(SUM(bytes), 0) FROM conversations WHERE owner = ?", (owner,)).fetchone()
    if caps.stored_bytes and used + size > caps.stored_bytes:
        raise InputError(
            f"Your chats hold {_mb(used)} of text; this would add {_mb(size)}, past the "
            f"{_mb(caps.stored_bytes)} one person may keep (LLMWEB_OWNER_MAX_STORED_MB). "
            "Delete some chats first."
        )
    address = address_of(db, owner)
    if caps.address_bytes and address is not None:
        (others,) = db.execute(ADDRESS_CHAT_BYTES, (address, owner)).fetchone()
        if others + used + size > caps.address_bytes:
            raise InputError(
                f"The visitors from your network already keep {_mb(others + used)} of chats here; this would "
                f"add {_mb(size)}, past the {_mb(caps.address_bytes)} one address may keep "
                "(LLMWEB_STORED_PER_ADDRESS_MB). Delete some chats first."
            )


# what the other owners of one address keep (parameters: the address, the owner left out): one row
# each, found through owners_by_address (owners.chat_bytes: triggers keep it, migration 12)
ADDRESS_CHAT_BYTES = "SELECT COALESCE(SUM(chat_bytes), 0) FROM owners WHERE address = ? AND owner != ?"
ADDRESS_DOC_BYTES = "SELECT COALESCE(SUM(doc_bytes), 0) FROM owners WHERE address = ? AND owner != ?"


def address_of(db: sqlite3.Connection, owner: str) -> str | None:
    """The address group the owner's requests last came from (None: never said; its own group)."""
    row = db.execute("SELECT address FROM owners WHERE owner = ?", (owner,)).fetchone()
    return None if row is None else row[0]


def check_document_room(db: sqlite3.Connection, caps: OwnerCaps, owner: str, total: int) -> None:
    """An InputError naming LLMWEB_DOCS_PER_ADDRESS_MB when the owner's private documents, grown to
    `total` bytes, would take all the owners of its address past `caps.address_doc_bytes`."""
    if owner in caps.exempt or not caps.address_doc_bytes:
        return
    row = db.execute("SELECT address, doc_bytes FROM owners WHERE owner = ?", (owner,)).fetchone()
    if row is None or row[0] is None or total <= row[1]:
        return  # no address known, or no growth
    (others,) = db.execute(ADDRESS_DOC_BYTES, (row[0], owner)).fetchone()
    if others + total > caps.address_doc_bytes:
        raise InputError(
            f"Not added: the visitors from your network already keep {_mb(others + row[1])} of documents here, "
            f"and these files would bring that to {_mb(others + total)}, past the {_mb(caps.address_doc_bytes)} "
            "one address may keep (LLMWEB_DOCS_PER_ADDRESS_MB). Remove some documents first."
        )


def _set_doc_bytes(db: sqlite3.Connection, owner: str, total: int) -> None:
    now = time.time()
    db.execute(
        "INSERT INTO owners (owner, created, last_seen, doc_bytes) VALUES (?, ?, ?, ?) "
        "ON CONFLICT(owner) DO UPDATE SET doc_bytes = excluded.doc_bytes",
        (owner, now, now, max(total, 0)),
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

    def note_address(self, owner: str, address: str) -> None:
        """The web layer's word: `owner`'s requests come from client address group `address` (web/trust.py,
        from the connection, never from what the client says). The per-address budgets count the owner
        there from now on (`check_room`, `check_document_room`). Written only when it changes: this
        store remembers the last it wrote per owner (forgotten with the row, `delete_owner`)."""
        if not address or owner in self.caps.exempt:
            return
        with self._addresses_lock:
            if self._addresses.get(owner) == address:
                self._addresses.move_to_end(owner)
                return
        now = time.time()
        with self._write() as db:
            db.execute(
                "INSERT INTO owners (owner, created, last_seen, address) VALUES (?, ?, ?, ?) "
                "ON CONFLICT(owner) DO UPDATE SET address = excluded.address WHERE address IS NOT excluded.address",
                (owner, now, now, address),
            )
        with self._addresses_lock:
            self._addresses[owner] = address
            self._addresses.move_to_end(owner)
            while len(self._addresses) > ADDRESSES_KEPT:
                self._addresses.popitem(last=False)

    def document_room(self, owner: str, total: int) -> None:
        """`check_document_room` ahead of an upload's parse: the InputError before OCR is paid for."""
        with self._read() as db:
            check_document_room(db, self.caps, owner, total)

    def claim_document_bytes(self, owner: str, total: int) -> None:
        """Check and record, in one transaction, that the owner's private documents are about to count
        `total` bytes: two uploads of one address cannot both pass. `record_document_bytes` after."""
        with self._write() as db:
            check_document_room(db, self.caps, owner, total)
            _set_doc_bytes(db, owner, total)

    def record_document_bytes(self, owner: str, total: int) -> None:
        """What the owner's private documents count now (after an upload, or a removal)."""
        with self._write() as db:
            _set_doc_bytes(db, owner, total)

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
        with self._addresses_lock:  # its row is gone: the next `note_address` writes it again
            self._addresses.pop(owner, None)
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
