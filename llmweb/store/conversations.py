"""Conversations and their turns: create, list, read, append, undo, regenerate, summarise, rename,
per-chat settings, delete (`ConversationQueries`).

The contract: what goes in comes back exactly. Every string is bound as a query parameter (never
formatted into SQL), so emoji, right-to-left text, control characters, NUL and megabyte-long
messages round-trip unchanged. Stats and sources are stored as JSON text. A conversation is
created with its first turn (`add_turn(..., create=True)`), so no empty chats pile up.

Every method takes the caller's owner first and scopes its SQL by it (in the statement, or through
store/owners.py); another owner's conversation is the same `NotFound` as a missing one. A write that
adds a chat or text checks the owner's caps in its transaction (store/owners.py `check_room`). A write
given the owner's `generation` (read with the chat, `Conversation.generation`, before a reply or
a fold began) commits nothing when the owner deleted all their data since (`Deleted`). It must
not fork the chat (store/versions.py does) nor know of tokens, models or the UI.
"""

from __future__ import annotations

import json
import sqlite3
import time
import unicodedata
from collections.abc import Sequence

from llmweb.errors import InputError
from llmweb.records import OUT, TURN_VIEWS, Source, TurnStats
from llmweb.store.connection import Connection
from llmweb.store.facts import facts_of
from llmweb.store.models import (
    DEFAULT_TITLE,
    MAX_TITLE_CHARS,
    TITLE_CHARS,
    ChatSettings,
    Conversation,
    ConversationInfo,
    StoredTurn,
    missing,
    new_id,
    sources_from_text,
    sources_text,
    stats_from_text,
    stats_text,
)
from llmweb.store.owners import check_generation, check_room, generation_of, owned, owned_row, seen, text_bytes
from llmweb.store.schema import OWNER_TAG


class ConversationQueries(Connection):
    def create_conversation(self, owner: str, title: str = DEFAULT_TITLE, *, generation: int | None = None) -> str:
        """An empty conversation (scripts, imports, tests; the chat creates one with its first turn)."""
        conv_id = new_id()
        now = time.time()
        with self._write() as db:
            check_generation(db, owner, generation)
            check_room(db, self.caps, owner, chats=1)
            _insert_conversation(db, owner, conv_id, title, now)
        return conv_id

    def list_conversations(self, owner: str) -> list[ConversationInfo]:
        """The owner's conversations, the most recently active first."""
        with self._read() as db:
            rows = db.execute(
                """SELECT c.id, c.title, c.updated,
                          (SELECT COUNT(*) FROM turns t WHERE t.conversation_id = c.id)
                   FROM conversations c WHERE c.owner = ? ORDER BY c.updated DESC, c.rowid DESC""",
                (owner,),
            ).fetchall()
        return [ConversationInfo(*row) for row in rows]

    def exists(self, owner: str, conv_id: str) -> bool:
        with self._read() as db:
            return owned(db, owner, conv_id)

    def get(self, owner: str, conv_id: str) -> Conversation:
        with self._read() as db:
            columns = "title, summary, summarized_upto, created, updated, settings, continues"
            title, summary, upto, created, updated, settings, continues = owned_row(db, owner, conv_id, columns)
            earlier = db.execute(  # the chat it continues, while it is still there and the owner's
                "SELECT id, title FROM conversations WHERE id = ? AND owner = ?", (continues, owner)
            ).fetchone()
            turns = [
                StoredTurn(idx, user, assistant, stats_from_text(stats), sources_from_text(sources), t_created, view)
                for idx, user, assistant, stats, sources, t_created, view in db.execute(
                    "SELECT idx, user, assistant, stats, sources, created, view FROM turns "
                    "WHERE conversation_id = ? ORDER BY idx",
                    (conv_id,),
                )
            ]
            facts = facts_of(db, conv_id)
            versions = versions_of(db, conv_id)
            generation = generation_of(db, owner)
        chosen = ChatSettings.from_dict(json.loads(settings))
        return Conversation(
            conv_id, title, summary, upto, turns, facts, created, updated, owner, chosen, versions, generation, earlier
        )

    def add_turn(
        self,
        owner: str,
        conv_id: str,
        user: str,
        assistant: str,
        stats: TurnStats | None = None,
        sources: Sequence[Source] = (),
        *,
        create: bool = False,
        generation: int | None = None,
    ) -> int:
        """Append a finished turn and return its 0-based index. The first turn of a conversation
        still titled DEFAULT_TITLE also gives it a title made from the user's message. With
        `create`, a conversation that does not exist yet is created by this turn (`conv_id` from
        `new_id()`); one that belongs to another owner is still `NotFound`. With `generation`, a
        turn begun before the owner deleted all their data is `Deleted` (nothing created)."""
        # Serialise before the transaction: a value JSON cannot hold fails here, changing nothing.
        stats_json, sources_json = stats_text(stats), sources_text(sources)
        now = time.time()
        with self._write() as db:
            check_generation(db, owner, generation)
            row = db.execute("SELECT title, owner FROM conversations WHERE id = ?", (conv_id,)).fetchone()
            size = text_bytes(user, assistant, stats_json, sources_json)
            check_room(db, self.caps, owner, chats=int(row is None and create), size=size)
            if row is None and create:
                _insert_conversation(db, owner, conv_id, DEFAULT_TITLE, now)
                row = (DEFAULT_TITLE, owner)
            if row is None or row[1] != owner:
                raise missing(conv_id)
            (idx,) = db.execute(
                "SELECT COALESCE(MAX(idx) + 1, 0) FROM turns WHERE conversation_id = ?", (conv_id,)
            ).fetchone()
            insert_turn(db, conv_id, idx, (user, assistant, stats_json, sources_json, now))
            title = row[0]
            if idx == 0 and title == DEFAULT_TITLE:
                title = auto_title(user) or DEFAULT_TITLE
            db.execute("UPDATE conversations SET updated = ?, title = ? WHERE id = ?", (now, title, conv_id))
            seen(db, owner, now)
        return idx

    def last_turn(self, owner: str, conv_id: str) -> StoredTurn:
        """The last turn, if it may still change (see `pop_last_turn` for the refusals)."""
        with self._read() as db:
            return _last_turn(db, owner, conv_id)

    def pop_last_turn(self, owner: str, conv_id: str) -> StoredTurn:
        """Delete the conversation's last turn (undo) and return it. Refused (InputError, nothing
        changed) when there is none, or when it is already folded into the summary: the summary,
        the facts and the recall index would still carry it."""
        with self._write() as db:
            last = _last_turn(db, owner, conv_id)
            db.execute("DELETE FROM turns WHERE conversation_id = ? AND idx = ?", (conv_id, last.idx))
            db.execute("UPDATE conversations SET updated = ? WHERE id = ?", (time.time(), conv_id))
        return last

    def replace_last_reply(
        self,
        owner: str,
        conv_id: str,
        idx: int,
        assistant: str,
        stats: TurnStats | None = None,
        sources: Sequence[Source] = (),
        *,
        generation: int | None = None,
    ) -> None:
        """Replace the reply (and its figures and sources) of turn `idx`, which must still be the last
        one and not folded into the summary (regenerate, continue); else an InputError, nothing changed."""
        stats_json, sources_json = stats_text(stats), sources_text(sources)
        with self._write() as db:
            check_generation(db, owner, generation)
            last = _last_turn(db, owner, conv_id)
            if last.idx != idx:
                raise InputError("This chat changed meanwhile (another tab?): reload it and try again.")
            check_room(db, self.caps, owner, size=text_bytes(assistant) - text_bytes(last.assistant))
            now = time.time()
            db.execute(
                "UPDATE turns SET assistant = ?, stats = ?, sources = ?, created = ? "
                "WHERE conversation_id = ? AND idx = ?",
                (assistant, stats_json, sources_json, now, conv_id, idx),
            )
            db.execute("UPDATE conversations SET updated = ? WHERE id = ?", (now, conv_id))

    def set_summary(
        self, owner: str, conv_id: str, summary: str, summarized_upto: int, *, generation: int | None = None
    ) -> None:
        """Record the rolling summary covering the oldest `summarized_upto` turns.
        Does not touch `updated`: compression is not user activity and must not reorder the list."""
        with self._write() as db:
            check_generation(db, owner, generation)
            n, _ = turn_count(db, owner, conv_id)
            if not 0 <= summarized_upto <= n:
                raise ValueError(f"summarized_upto={summarized_upto} outside 0..{n} (the turn count)")
            db.execute(
                "UPDATE conversations SET summary = ?, summarized_upto = ? WHERE id = ?",
                (summary, summarized_upto, conv_id),
            )

    def set_turn_view(self, owner: str, conv_id: str, idx: int, view: str) -> None:
        """Keep turn `idx` in context (PIN), leave it out (OUT) or let the planner decide (""): `set_turn_views`."""
        self.set_turn_views(owner, conv_id, [(idx, view)])

    def set_turn_views(self, owner: str, conv_id: str, views: Sequence[tuple[int, str]]) -> None:
        """Set each (turn index, view) in one transaction: all of them, or none when one is refused
        (InputError). Leaving out a turn already folded into the summary is refused: the summary
        carries it. Does not touch `updated`. Another owner's conversation is `NotFound`."""
        for _, view in views:
            if view not in TURN_VIEWS:
                raise InputError(f"A turn is kept in context, left out, or neither: not {view!r}.")
        with self._write() as db:
            n, upto = turn_count(db, owner, conv_id)
            for idx, view in views:
                if not 0 <= idx < n:
                    raise InputError("That turn is no longer in this chat: reload it and try again.")
                if view == OUT and idx < upto:
                    raise InputError(
                        "That turn is already folded into this chat's summary, so it can no longer be left out."
                    )
            db.executemany(
                "UPDATE turns SET view = ? WHERE conversation_id = ? AND idx = ?",
                [(view, conv_id, idx) for idx, view in views],
            )

    def rename(self, owner: str, conv_id: str, title: str) -> str:
        """Give the owner's conversation a new title and return it as stored: one line, whitespace
        collapsed, control characters dropped. An empty or over-long title is an `InputError` and
        changes nothing. Another owner's conversation is `NotFound`, as an unknown id is.
        Does not touch `updated`: a rename must not reorder the list."""
        if not isinstance(title, str):
            raise InputError("Type a title for this chat.")
        title = " ".join("".join(" " if unicodedata.category(c) == "Cc" else c for c in title).split())
        if not title:
            raise InputError("Type a title for this chat (it cannot be empty).")
        if len(title) > MAX_TITLE_CHARS:
            raise InputError(f"That title has {len(title):,} characters; the limit is {MAX_TITLE_CHARS}.")
        with self._write() as db:
            cur = db.execute("UPDATE conversations SET title = ? WHERE id = ? AND owner = ?", (title, conv_id, owner))
            if cur.rowcount == 0:
                raise missing(conv_id)
        return title

    def set_settings(self, owner: str, conv_id: str, settings: ChatSettings) -> None:
        """Store the chat's own settings (all of them: a field left None goes back to the
        configuration). Does not touch `updated`. Another owner's conversation is `NotFound`."""
        try:  # checked before the write
            text = json.dumps(ChatSettings.from_dict(settings.to_dict()).to_dict())
        except ValueError as e:
            raise InputError(f"These chat settings cannot be stored ({e}).") from None
        with self._write() as db:
            cur = db.execute("UPDATE conversations SET settings = ? WHERE id = ? AND owner = ?", (text, conv_id, owner))
            if cur.rowcount == 0:
                raise missing(conv_id)

    def delete(self, owner: str, conv_id: str) -> bool:
        """Delete a conversation with its turns and facts. False if it was already gone (or not the owner's)."""
        with self._write() as db:
            return db.execute("DELETE FROM conversations WHERE id = ? AND owner = ?", (conv_id, owner)).rowcount > 0


def auto_title(text: str, limit: int = TITLE_CHARS) -> str:
    """A one-line title from a message: whitespace collapsed, control characters dropped, cut at
    a word boundary near `limit` characters with an ellipsis. "" if nothing printable is left."""
    words = "".join(" " if unicodedata.category(c) == "Cc" else c for c in text).split()
    title = " ".join(words)
    if len(title) <= limit:
        return title
    cut = title[:limit]
    space = cut.rfind(" ")
    if space >= limit // 2:
        cut = cut[:space]
    return cut.rstrip() + "…"


def _last_turn(db: sqlite3.Connection, owner: str, conv_id: str) -> StoredTurn:
    """The owner's conversation's last turn, if it may still change (not folded into the summary)."""
    (upto,) = owned_row(db, owner, conv_id, "summarized_upto")
    turn = db.execute(
        "SELECT idx, user, assistant, stats, sources, created FROM turns WHERE conversation_id = ? "
        "ORDER BY idx DESC LIMIT 1",
        (conv_id,),
    ).fetchone()
    if turn is None:
        raise InputError("This chat has no turns yet.")
    idx, user, assistant, stats, sources, created = turn
    if idx < upto:
        raise InputError(
            "The last turn is already folded into this chat's summary, so it can no longer be changed or "
            "undone. Send a new message instead."
        )
    return StoredTurn(idx, user, assistant, stats_from_text(stats), sources_from_text(sources), created)


def _insert_conversation(db: sqlite3.Connection, owner: str, conv_id: str, title: str, now: float) -> None:
    db.execute(
        "INSERT INTO conversations (id, title, created, updated, owner) VALUES (?, ?, ?, ?, ?)",
        (conv_id, title, now, now, owner),
    )
    seen(db, owner, now)


def turn_count(db: sqlite3.Connection, owner: str, conv_id: str) -> tuple[int, int]:
    """(turns, summarized_upto) of the owner's conversation; NotFound if it is not theirs."""
    columns = "(SELECT COUNT(*) FROM turns WHERE conversation_id = c.id), c.summarized_upto"
    return owned_row(db, owner, conv_id, columns)


TURN_COLUMNS = "user, assistant, stats, sources, created"  # a turn's row, less its place


def insert_turn(db: sqlite3.Connection, conv_id: str, idx: int, row: tuple[str, str, str, str, float]) -> None:
    """Store turn `idx`: `row` is its TURN_COLUMNS (stats and sources as JSON text)."""
    db.execute(INSERT_TURN, (conv_id, idx, *row))


# a turn's row (conversation id, idx, TURN_COLUMNS) with its owner's search tag (store/schema.py, migration 8)
INSERT_TURN = (
    f"INSERT INTO turns (conversation_id, idx, {TURN_COLUMNS}, owner_tag) VALUES "
    f"(?1, ?2, ?3, ?4, ?5, ?6, ?7, (SELECT {OWNER_TAG} FROM conversations c WHERE c.id = ?1))"
)


def versions_of(db: sqlite3.Connection, conv_id: str) -> dict[int, tuple[int, int]]:
    """fork -> (active version, number of versions)."""
    return {
        fork: (active, count)
        for fork, active, count in db.execute(
            "SELECT fork, MAX(CASE WHEN body IS NULL THEN version END), COUNT(*) FROM versions "
            "WHERE conversation_id = ? GROUP BY fork",
            (conv_id,),
        )
    }
