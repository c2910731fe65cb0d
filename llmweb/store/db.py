"""SQLite persistence of conversations, turns, rolling summaries, per-turn stats and facts.

The contract: what goes in comes back exactly. Every string is bound as a query parameter
(never formatted into SQL), so emoji, right-to-left text, control characters, NUL and
megabyte-long messages round-trip unchanged. Stats and sources are stored as JSON text.

Durability: every write method is ONE transaction, committed before it returns. A process
killed at any moment (kill -9, OOM killer) loses at most the call in flight, never a committed
turn and never half a turn.

  - journal_mode=WAL: readers never block the writer, and a crash mid-commit leaves only an
    uncommitted tail in the WAL that the next open ignores.
  - synchronous=FULL: each commit also fsyncs the WAL. NORMAL would already survive a process
    crash (the committed pages sit in the OS page cache); FULL also survives a power cut or a
    kernel crash. The price is one fsync per write, i.e. per turn, which is nothing next to the
    seconds a generation takes.
  - foreign_keys=ON: deleting a conversation cascades to its turns and facts.

Threads: ONE connection (check_same_thread=False) serialised by a lock. Gradio calls us from
many worker threads, but writes are a few per turn and reads are small, so a lock costs
nothing measurable, while one connection per thread would bring SQLITE_BUSY retries between
our own threads and connections left behind by threads Gradio retires. Other processes (the
CLI while the server runs) are covered by WAL and a busy timeout.

Ownership: every conversation belongs to an OWNER (the login account "user:<name>", an
anonymous browser "anon:<token>", or LOCAL_OWNER for a single-user install), and every public
method takes the caller's owner first and scopes its query by it, here in SQL, not in the UI.
Facts are reached only through a conversation of the same owner. Another owner's conversation
behaves exactly like one that does not exist: the same `NotFound`, from the same single indexed
query, so no answer tells them apart. Ids are 128 random bits (`new_id`): unguessable. A
conversation is created with its first turn (`add_turn(..., create=True)`), so no empty chats
pile up in the store. `owners` remembers when each owner was last seen, for the retention purge.

Search: `search(owner, query)` reads an FTS5 index of every turn's text (migration 3), kept in
step by triggers, so no write method has to remember it; hits are scoped to the owner in the
same query.

Per-chat settings: `ChatSettings` (system prompt, temperature, reply cap, documents, memory mode)
is a JSON object in the conversation's row (migration 4), holding only the fields the chat sets;
chat/session.py checks them against the server's limits, the store only their shape.

Versions (migration 5): editing turn k (`edit_turn`) forks the chat there. `turns` always holds
the ACTIVE branch, so every other read (the planner, folds, search, exports) sees only it; each
other version is one JSON body in `versions` (its turns from k on, its summary, the unpinned facts
taken from those turns, the forks nested in it), reached only through the owner's conversation.
`switch_version` swaps bodies in one transaction.

Missing conversations raise `NotFound` (a `LookupError` and an `LlmwebError`, so the UI can
show its message as it is). Deleting something already gone is not an error.

This module knows nothing of tokens, models or the UI; it imports only the standard library
and llmweb's errors and records.
"""

from __future__ import annotations

import json
import re
import secrets
import sqlite3
import threading
import time
import unicodedata
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from llmweb.errors import ConfigError, InputError, LlmwebError
from llmweb.records import LOCAL_OWNER, Source, Turn, TurnStats

DEFAULT_TITLE = "New chat"
TITLE_CHARS = 40  # auto-titles are cut to about this many characters
MAX_TITLE_CHARS = 120  # a title the user types may be this long
BUSY_TIMEOUT_S = 30.0  # wait this long for another process's write lock
EXPORT_FORMAT = "llmweb.conversation"
EXPORT_VERSION = 1

# Each entry moves the schema up one version; applied in order, each in its own transaction.
# Never edit an entry once released: append a new one.
MIGRATIONS: tuple[tuple[str, ...], ...] = (
    (  # 1: the initial schema
        """CREATE TABLE conversations (
            id              TEXT PRIMARY KEY,
            title           TEXT NOT NULL,
            created         REAL NOT NULL,
            updated         REAL NOT NULL,
            summary         TEXT NOT NULL DEFAULT '',
            summarized_upto INTEGER NOT NULL DEFAULT 0 CHECK (summarized_upto >= 0)
        )""",
        """CREATE TABLE turns (
            conversation_id TEXT NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
            idx             INTEGER NOT NULL CHECK (idx >= 0),
            user            TEXT NOT NULL,
            assistant       TEXT NOT NULL,
            stats           TEXT NOT NULL DEFAULT '{}',
            sources         TEXT NOT NULL DEFAULT '[]',
            created         REAL NOT NULL,
            PRIMARY KEY (conversation_id, idx)
        )""",
        """CREATE TABLE facts (
            id              INTEGER PRIMARY KEY AUTOINCREMENT,
            conversation_id TEXT NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
            text            TEXT NOT NULL,
            pinned          INTEGER NOT NULL DEFAULT 1 CHECK (pinned IN (0, 1)),
            created         REAL NOT NULL
        )""",
        "CREATE INDEX facts_by_conversation ON facts(conversation_id, id)",
        "CREATE INDEX conversations_by_updated ON conversations(updated)",
    ),
    (  # 2: owners. What a single-user install wrote before goes to LOCAL_OWNER, which it keeps seeing
        f"ALTER TABLE conversations ADD COLUMN owner TEXT NOT NULL DEFAULT '{LOCAL_OWNER}'",
        "CREATE INDEX conversations_by_owner ON conversations(owner, updated)",
        """CREATE TABLE owners (
            owner           TEXT PRIMARY KEY,
            created         REAL NOT NULL,
            last_seen       REAL NOT NULL
        )""",
        """INSERT INTO owners (owner, created, last_seen)
           SELECT owner, MIN(created), MAX(updated) FROM conversations GROUP BY owner""",
        # round 1 created a conversation on every page load: drop the empty ones
        "DELETE FROM conversations WHERE NOT EXISTS (SELECT 1 FROM turns t WHERE t.conversation_id = conversations.id)",
    ),
    (  # 3: full-text search over the turns' text (FTS5, an external-content index: the text stays in
        # `turns` only). Triggers keep it in step with every insert, update and delete, cascades
        # included. It is keyed by turns' implicit rowid, which only VACUUM could renumber; llmweb
        # never runs VACUUM (after one, run: INSERT INTO turns_fts(turns_fts) VALUES('rebuild')).
        """CREATE VIRTUAL TABLE turns_fts USING fts5(
            user, assistant, content='turns', content_rowid='rowid',
            tokenize='porter unicode61 remove_diacritics 2'
        )""",
        "INSERT INTO turns_fts(turns_fts) VALUES ('rebuild')",  # index the turns already stored
        """CREATE TRIGGER turns_fts_insert AFTER INSERT ON turns BEGIN
            INSERT INTO turns_fts (rowid, user, assistant) VALUES (new.rowid, new.user, new.assistant);
        END""",
        """CREATE TRIGGER turns_fts_delete AFTER DELETE ON turns BEGIN
            INSERT INTO turns_fts (turns_fts, rowid, user, assistant)
            VALUES ('delete', old.rowid, old.user, old.assistant);
        END""",
        """CREATE TRIGGER turns_fts_update AFTER UPDATE OF user, assistant ON turns BEGIN
            INSERT INTO turns_fts (turns_fts, rowid, user, assistant)
            VALUES ('delete', old.rowid, old.user, old.assistant);
            INSERT INTO turns_fts (rowid, user, assistant) VALUES (new.rowid, new.user, new.assistant);
        END""",
    ),
    (  # 4: per-chat settings (system prompt, temperature, reply cap, documents, memory), a JSON object
        # of the fields a chat overrides ('{}': every field from the server's configuration)
        "ALTER TABLE conversations ADD COLUMN settings TEXT NOT NULL DEFAULT '{}'",
    ),
    (  # 5: versions of a chat from an edited turn on. `turns` always holds the active branch (so the
        # planner, the summary, the FTS index and every other read see only it); each other version
        # of a fork is kept here as one JSON body (its turns from `fork` on, its summary, the facts
        # taken from those turns, the forks nested in it). The active version's row has body NULL.
        """CREATE TABLE versions (
            conversation_id TEXT NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
            fork            INTEGER NOT NULL CHECK (fork >= 0),
            version         INTEGER NOT NULL CHECK (version >= 0),
            body            TEXT,
            PRIMARY KEY (conversation_id, fork, version)
        )""",
    ),
)
SCHEMA_VERSION = len(MIGRATIONS)


MAX_QUERY_CHARS = 500  # a search query may be this long
HIT_START, HIT_END = "\x02", "\x03"  # around the matched words in `SearchHit.snippet`


MEMORY_MODES = ("window", "summary", "recall")  # window only; + a rolling summary; + recall of old turns
MAX_SYSTEM_PROMPT_CHARS = 4000  # a chat's own system prompt may be this long


@dataclass(frozen=True, slots=True)
class ChatSettings:
    """What one chat sets for itself; None = the server's configuration. The store checks only
    the shape of each value; chat/session.py checks them against the server's limits before storing."""

    system_prompt: str | None = None  # the persona; "" is a chat without one
    temperature: float | None = None  # 0 = greedy
    max_new_tokens: int | None = None  # the reply length cap
    use_docs: bool | None = None  # answer from the documents when relevant
    memory: str | None = None  # one of MEMORY_MODES

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
        out = cls(**{k: v for k, v in d.items() if v is not None})
        checks = (
            ("system_prompt", lambda v: isinstance(v, str) and len(v) <= MAX_SYSTEM_PROMPT_CHARS),
            ("temperature", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v <= 2),
            ("max_new_tokens", lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1),
            ("use_docs", lambda v: isinstance(v, bool)),
            ("memory", lambda v: v in MEMORY_MODES),
        )
        for name, ok in checks:
            value = getattr(out, name)
            if value is not None and not ok(value):
                raise ValueError(f"bad {name} {value!r}")
        return out


class NotFound(LlmwebError, LookupError):
    """The conversation (or fact) does not exist, or no longer does."""


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

    def as_turn(self) -> Turn:
        return Turn(self.user, self.assistant)


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


class Store:
    """All conversations in one SQLite file. Safe to share between threads; see the module doc."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()
        self._db = sqlite3.connect(
            self.path, timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False
        )  # isolation_level=None: we issue BEGIN/COMMIT ourselves
        try:
            mode = self._db.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            assert mode.lower() == "wal", f"SQLite refused WAL mode for {self.path} (got {mode})"
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.execute("PRAGMA foreign_keys=ON")
            self._migrate()
        except BaseException:
            self._db.close()
            raise

    # -- lifecycle ---------------------------------------------------------------------------

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def schema_version(self) -> int:
        with self._read() as db:
            return _read_version(db)

    def _migrate(self) -> None:
        self._db.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
        while True:
            with self._write() as db:  # re-read inside the lock: another process may migrate too
                version = _read_version(db)
                if version > SCHEMA_VERSION:
                    raise ConfigError(
                        f"The database {self.path} was written by a newer llmweb (schema "
                        f"{version}, this one knows {SCHEMA_VERSION}). Upgrade llmweb or use "
                        "another data directory."
                    )
                if version == SCHEMA_VERSION:
                    return
                for statement in MIGRATIONS[version]:
                    db.execute(statement)
                db.execute("DELETE FROM schema_version")
                db.execute("INSERT INTO schema_version (version) VALUES (?)", (version + 1,))

    # -- transactions ------------------------------------------------------------------------

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """One write transaction. BEGIN IMMEDIATE takes the write lock up front, so a
        read-then-write (such as choosing the next turn index) cannot race another process."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except UnicodeEncodeError as e:  # a lone surrogate cannot be stored as UTF-8
                self._db.execute("ROLLBACK")
                raise InputError("The text contains characters that cannot be saved (unpaired surrogates).") from e
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            try:
                self._db.execute("COMMIT")
            except BaseException:  # e.g. disk full: leave no transaction open behind us
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
                raise

    @contextmanager
    def _read(self) -> Iterator[sqlite3.Connection]:
        """A read transaction: several SELECTs see one snapshot."""
        with self._lock:
            self._db.execute("BEGIN")
            try:
                yield self._db
            finally:
                self._db.execute("COMMIT")

    # -- conversations -----------------------------------------------------------------------

    def create_conversation(self, owner: str, title: str = DEFAULT_TITLE) -> str:
        """An empty conversation (scripts, imports, tests; the chat creates one with its first turn)."""
        conv_id = new_id()
        now = time.time()
        with self._write() as db:
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
            return _owned(db, owner, conv_id)

    def get(self, owner: str, conv_id: str) -> Conversation:
        with self._read() as db:
            row = db.execute(
                "SELECT title, summary, summarized_upto, created, updated, settings FROM conversations "
                "WHERE id = ? AND owner = ?",
                (conv_id, owner),
            ).fetchone()
            if row is None:
                raise _missing(conv_id)
            title, summary, upto, created, updated, settings = row
            turns = [
                StoredTurn(idx, user, assistant, _stats(stats), _sources(sources), t_created)
                for idx, user, assistant, stats, sources, t_created in db.execute(
                    "SELECT idx, user, assistant, stats, sources, created FROM turns "
                    "WHERE conversation_id = ? ORDER BY idx",
                    (conv_id,),
                )
            ]
            facts = _facts(db, conv_id)
            versions = _versions(db, conv_id)
        chosen = ChatSettings.from_dict(json.loads(settings))
        return Conversation(conv_id, title, summary, upto, turns, facts, created, updated, owner, chosen, versions)

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
    ) -> int:
        """Append a finished turn and return its 0-based index. The first turn of a conversation
        still titled DEFAULT_TITLE also gives it a title made from the user's message. With
        `create`, a conversation that does not exist yet is created by this turn (`conv_id` from
        `new_id()`); one that belongs to another owner is still `NotFound`."""
        # Serialise before the transaction: a value JSON cannot hold fails here, changing nothing.
        # ensure_ascii=True keeps odd strings (e.g. surrogate-escaped file names) storable.
        stats_json = json.dumps({} if stats is None else stats.to_dict())
        sources_json = json.dumps([s.to_dict() for s in sources])
        now = time.time()
        with self._write() as db:
            row = db.execute("SELECT title, owner FROM conversations WHERE id = ?", (conv_id,)).fetchone()
            if row is None and create:
                _insert_conversation(db, owner, conv_id, DEFAULT_TITLE, now)
                row = (DEFAULT_TITLE, owner)
            if row is None or row[1] != owner:
                raise _missing(conv_id)
            (idx,) = db.execute(
                "SELECT COALESCE(MAX(idx) + 1, 0) FROM turns WHERE conversation_id = ?", (conv_id,)
            ).fetchone()
            db.execute(
                "INSERT INTO turns (conversation_id, idx, user, assistant, stats, sources, created) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)",
                (conv_id, idx, user, assistant, stats_json, sources_json, now),
            )
            title = row[0]
            if idx == 0 and title == DEFAULT_TITLE:
                title = auto_title(user) or DEFAULT_TITLE
            db.execute("UPDATE conversations SET updated = ?, title = ? WHERE id = ?", (now, title, conv_id))
            _seen(db, owner, now)
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
    ) -> None:
        """Replace the reply (and its figures and sources) of turn `idx`, which must still be the last
        one and not folded into the summary (regenerate, continue); else an InputError, nothing changed."""
        stats_json = json.dumps({} if stats is None else stats.to_dict())
        sources_json = json.dumps([s.to_dict() for s in sources])
        with self._write() as db:
            last = _last_turn(db, owner, conv_id)
            if last.idx != idx:
                raise InputError("This chat changed meanwhile (another tab?): reload it and try again.")
            now = time.time()
            db.execute(
                "UPDATE turns SET assistant = ?, stats = ?, sources = ?, created = ? "
                "WHERE conversation_id = ? AND idx = ?",
                (assistant, stats_json, sources_json, now, conv_id, idx),
            )
            db.execute("UPDATE conversations SET updated = ? WHERE id = ?", (now, conv_id))

    # -- versions: an edited turn forks the chat; `turns` holds the active branch

    def edit_turn(
        self,
        owner: str,
        conv_id: str,
        idx: int,
        user: str,
        assistant: str,
        stats: TurnStats | None = None,
        sources: Sequence[Source] = (),
    ) -> None:
        """Replace turn `idx` and every turn after it by one new turn (an edited message and its
        reply), keeping what was there as another version of the chat from `idx` on; the new one
        becomes the active version. Refused (InputError, nothing changed) when turn `idx` does not
        exist or is folded into the summary."""
        stats_json = json.dumps({} if stats is None else stats.to_dict())
        sources_json = json.dumps([s.to_dict() for s in sources])
        now = time.time()
        with self._write() as db:
            n, upto = _turn_count(db, owner, conv_id)
            if not 0 <= idx < n:
                raise InputError("That message is no longer in this chat: reload it and try again.")
            if idx < upto:
                raise InputError(
                    "That message is already folded into this chat's summary, so it can no longer be edited."
                )
            group = _versions(db, conv_id).get(idx)
            body = _stash(db, conv_id, idx)
            if group is None:
                db.execute("INSERT INTO versions VALUES (?, ?, 0, ?)", (conv_id, idx, body))
                new_version = 1
            else:
                db.execute(
                    "UPDATE versions SET body = ? WHERE conversation_id = ? AND fork = ? AND version = ?",
                    (body, conv_id, idx, group[0]),
                )
                new_version = group[1]
            db.execute("INSERT INTO versions VALUES (?, ?, ?, NULL)", (conv_id, idx, new_version))
            db.execute(
                "INSERT INTO turns (conversation_id, idx, user, assistant, stats, sources, created) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)",
                (conv_id, idx, user, assistant, stats_json, sources_json, now),
            )
            db.execute("UPDATE conversations SET updated = ? WHERE id = ?", (now, conv_id))
            _seen(db, owner, now)

    def switch_version(self, owner: str, conv_id: str, fork: int, version: int) -> None:
        """Make `version` the active branch of the chat from turn `fork` on (its turns, summary and
        facts come back; the branch that was active is kept as it was). Unknown is an InputError."""
        with self._write() as db:
            if not _owned(db, owner, conv_id):
                raise _missing(conv_id)
            group = _versions(db, conv_id).get(fork)
            if group is None or not 0 <= version < group[1]:
                raise InputError("That version of the chat no longer exists: reload it and try again.")
            if version == group[0]:
                return
            (target,) = db.execute(
                "SELECT body FROM versions WHERE conversation_id = ? AND fork = ? AND version = ?",
                (conv_id, fork, version),
            ).fetchone()
            body = _stash(db, conv_id, fork)
            db.execute(
                "UPDATE versions SET body = ? WHERE conversation_id = ? AND fork = ? AND version = ?",
                (body, conv_id, fork, group[0]),
            )
            db.execute(
                "UPDATE versions SET body = NULL WHERE conversation_id = ? AND fork = ? AND version = ?",
                (conv_id, fork, version),
            )
            _unstash(db, conv_id, fork, json.loads(target))

    def set_summary(self, owner: str, conv_id: str, summary: str, summarized_upto: int) -> None:
        """Record the rolling summary covering the oldest `summarized_upto` turns.
        Does not touch `updated`: compression is not user activity and must not reorder the list."""
        with self._write() as db:
            row = db.execute(
                "SELECT (SELECT COUNT(*) FROM turns WHERE conversation_id = ?) FROM conversations "
                "WHERE id = ? AND owner = ?",
                (conv_id, conv_id, owner),
            ).fetchone()
            if row is None:
                raise _missing(conv_id)
            if not 0 <= summarized_upto <= row[0]:
                raise ValueError(f"summarized_upto={summarized_upto} outside 0..{row[0]} (the turn count)")
            db.execute(
                "UPDATE conversations SET summary = ?, summarized_upto = ? WHERE id = ?",
                (summary, summarized_upto, conv_id),
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
                raise _missing(conv_id)
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
                raise _missing(conv_id)

    def delete(self, owner: str, conv_id: str) -> bool:
        """Delete a conversation with its turns and facts. False if it was already gone (or not the owner's)."""
        with self._write() as db:
            return db.execute("DELETE FROM conversations WHERE id = ? AND owner = ?", (conv_id, owner)).rowcount > 0

    def search(self, owner: str, query: str, limit: int = 20) -> list[SearchHit]:
        """The owner's turns whose text matches `query` (SQLite FTS5 syntax: words, "phrases",
        AND/OR/NOT, (groups), prefix*; see `fts_query`), best first. A query FTS5 cannot read
        (an open quote, a dangling AND) is an `InputError`."""
        if not isinstance(query, str) or not query.strip():
            raise InputError("Type something to search for.")
        if len(query) > MAX_QUERY_CHARS:
            raise InputError(f"That search has {len(query):,} characters; the limit is {MAX_QUERY_CHARS}.")
        with self._read() as db:
            try:
                rows = db.execute(
                    """SELECT t.conversation_id, c.title, t.idx,
                              snippet(turns_fts, -1, ?, ?, '…', 12)
                       FROM turns_fts
                       JOIN turns t ON t.rowid = turns_fts.rowid
                       JOIN conversations c ON c.id = t.conversation_id
                       WHERE turns_fts MATCH ? AND c.owner = ?
                       ORDER BY bm25(turns_fts), c.updated DESC, t.idx
                       LIMIT ?""",
                    (HIT_START, HIT_END, fts_query(query), owner, max(1, int(limit))),
                ).fetchall()
            except sqlite3.OperationalError as e:  # only the query text can fail this read
                raise InputError(
                    f'Search could not read {query!r} ({e}). Use plain words, "a phrase in quotes", '
                    "AND, OR, NOT, or word* for a prefix."
                ) from None
        return [SearchHit(*row) for row in rows]

    # -- owners ------------------------------------------------------------------------------

    def touch_owner(self, owner: str) -> None:
        """Note that an owner is active now (a page load, a message): the retention purge counts from here."""
        with self._write() as db:
            _seen(db, owner, time.time())

    def delete_owner(self, owner: str) -> list[str]:
        """Delete everything the owner stored here (conversations, turns, facts); return the conversation ids."""
        with self._write() as db:
            ids = [r[0] for r in db.execute("SELECT id FROM conversations WHERE owner = ?", (owner,))]
            db.execute("DELETE FROM conversations WHERE owner = ?", (owner,))
            db.execute("DELETE FROM owners WHERE owner = ?", (owner,))
        return ids

    def idle_owners(self, prefix: str, idle_s: float, now: float | None = None) -> list[str]:
        """Owners whose name starts with `prefix` (e.g. "anon:") and who were last seen `idle_s` ago or more."""
        cutoff = (time.time() if now is None else now) - idle_s
        with self._read() as db:
            rows = db.execute(
                "SELECT owner FROM owners WHERE substr(owner, 1, ?) = ? AND last_seen <= ? ORDER BY last_seen",
                (len(prefix), prefix, cutoff),
            ).fetchall()
        return [r[0] for r in rows]

    # -- facts: the user's own sentences, kept verbatim; reached only through the owner's conversation

    def add_fact(self, owner: str, conv_id: str, text: str, pinned: bool = True) -> int:
        with self._write() as db:
            if not _owned(db, owner, conv_id):
                raise _missing(conv_id)
            cur = db.execute(
                "INSERT INTO facts (conversation_id, text, pinned, created) VALUES (?, ?, ?, ?)",
                (conv_id, text, int(bool(pinned)), time.time()),
            )
            assert cur.lastrowid is not None  # set by every INSERT
            return cur.lastrowid

    def set_fact_pinned(self, owner: str, conv_id: str, fact_id: int, pinned: bool) -> None:
        with self._write() as db:
            cur = db.execute(
                f"UPDATE facts SET pinned = ? WHERE id = ? AND {_FACT_OWNED}",
                (int(bool(pinned)), fact_id, conv_id, owner),
            )
            if cur.rowcount == 0:
                raise NotFound("That fact no longer exists.")

    def delete_fact(self, owner: str, conv_id: str, fact_id: int) -> bool:
        """False if it was already gone (or is not the owner's)."""
        with self._write() as db:
            return (
                db.execute(f"DELETE FROM facts WHERE id = ? AND {_FACT_OWNED}", (fact_id, conv_id, owner)).rowcount > 0
            )

    def facts(self, owner: str, conv_id: str) -> list[Fact]:
        with self._read() as db:
            if not _owned(db, owner, conv_id):
                raise _missing(conv_id)
            return _facts(db, conv_id)

    # -- export / import ---------------------------------------------------------------------

    def export_json(self, owner: str, conv_id: str) -> str:
        """The whole conversation as JSON; `import_json` reads it back."""
        conv = self.get(owner, conv_id)
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
            "versions": self._version_rows(owner, conv_id),
        }
        return json.dumps(doc, ensure_ascii=False, indent=1)

    def import_json(self, owner: str, text: str) -> str:
        """Create a new conversation of `owner` (with a new id) from `export_json` output; return its id."""
        try:
            doc = json.loads(text)
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
            times = (float(doc["created"]), float(doc["updated"]))
            head = (str(doc["title"]), *times, str(doc["summary"]), upto, settings)
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise InputError(f"This file is not an llmweb conversation export ({e}).") from None
        conv_id = new_id()
        with self._write() as db:
            db.execute(
                "INSERT INTO conversations (id, title, created, updated, summary, summarized_upto, settings, owner) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (conv_id, *head, owner),
            )
            _seen(db, owner, time.time())
            db.executemany(
                "INSERT INTO turns (conversation_id, idx, user, assistant, stats, sources, created) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)",
                [(conv_id, i, *r) for i, r in enumerate(rows)],
            )
            db.executemany(
                "INSERT INTO facts (conversation_id, text, pinned, created) VALUES (?, ?, ?, ?)",
                [(conv_id, *f) for f in facts],
            )
            db.executemany("INSERT INTO versions VALUES (?, ?, ?, ?)", [(conv_id, *v) for v in versions])
        return conv_id

    def _version_rows(self, owner: str, conv_id: str) -> list[dict]:
        with self._read() as db:
            if not _owned(db, owner, conv_id):
                raise _missing(conv_id)
            rows = db.execute(
                "SELECT fork, version, body FROM versions WHERE conversation_id = ? ORDER BY fork, version", (conv_id,)
            ).fetchall()
        return [{"fork": f, "version": v, "body": None if b is None else json.loads(b)} for f, v, b in rows]

    def export_markdown(self, owner: str, conv_id: str) -> str:
        """A readable transcript. Message text is included as written (it may contain Markdown)."""
        conv = self.get(owner, conv_id)
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


# -- helpers -----------------------------------------------------------------------------------


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


_FTS_PART = re.compile(r'"(?:[^"]|"")*"?|[()]|[^\s()"]+')  # a "phrase" (maybe unclosed), a bracket, a word
_FTS_BAREWORD = re.compile(r"[^\W]+\*?|AND|OR|NOT")


def fts_query(text: str) -> str:
    """The user's search as an FTS5 query. Phrases, brackets, AND/OR/NOT and word* pass as
    written; a word FTS5 would read as syntax (Zanzibar-7781, e-mail, foo:bar, C++) becomes a
    quoted phrase, so people can paste what they remember. What is left to fail is real syntax
    trouble (an open quote, a dangling operator), which `search` reports."""
    out = []
    for part in _FTS_PART.findall(text):
        if part.startswith('"') or part in "()" or _FTS_BAREWORD.fullmatch(part):
            out.append(part)
        else:
            star = "*" if part.endswith("*") and len(part) > 1 else ""
            out.append('"' + part.removesuffix(star).replace('"', '""') + '"' + star)
    return " ".join(out)


def new_id() -> str:
    """A conversation id: 128 random bits, hex. Unguessable, so an id can serve as a capability."""
    return secrets.token_hex(16)


# a fact is the caller's when its conversation is (parameters: conversation id, owner)
_FACT_OWNED = "conversation_id = ? AND conversation_id IN (SELECT id FROM conversations WHERE owner = ?)"


def _owned(db: sqlite3.Connection, owner: str, conv_id: str) -> bool:
    return db.execute("SELECT 1 FROM conversations WHERE id = ? AND owner = ?", (conv_id, owner)).fetchone() is not None


def _last_turn(db: sqlite3.Connection, owner: str, conv_id: str) -> StoredTurn:
    """The owner's conversation's last turn, if it may still change (not folded into the summary)."""
    row = db.execute(
        "SELECT summarized_upto FROM conversations WHERE id = ? AND owner = ?", (conv_id, owner)
    ).fetchone()
    if row is None:
        raise _missing(conv_id)
    turn = db.execute(
        "SELECT idx, user, assistant, stats, sources, created FROM turns WHERE conversation_id = ? "
        "ORDER BY idx DESC LIMIT 1",
        (conv_id,),
    ).fetchone()
    if turn is None:
        raise InputError("This chat has no turns yet.")
    idx, user, assistant, stats, sources, created = turn
    if idx < row[0]:
        raise InputError(
            "The last turn is already folded into this chat's summary, so it can no longer be changed or "
            "undone. Send a new message instead."
        )
    return StoredTurn(idx, user, assistant, _stats(stats), _sources(sources), created)


def _insert_conversation(db: sqlite3.Connection, owner: str, conv_id: str, title: str, now: float) -> None:
    db.execute(
        "INSERT INTO conversations (id, title, created, updated, owner) VALUES (?, ?, ?, ?, ?)",
        (conv_id, title, now, now, owner),
    )
    _seen(db, owner, now)


def _seen(db: sqlite3.Connection, owner: str, now: float) -> None:
    db.execute(
        "INSERT INTO owners (owner, created, last_seen) VALUES (?, ?, ?) "
        "ON CONFLICT(owner) DO UPDATE SET last_seen = excluded.last_seen",
        (owner, now, now),
    )


def _turn_count(db: sqlite3.Connection, owner: str, conv_id: str) -> tuple[int, int]:
    """(turns, summarized_upto) of the owner's conversation; NotFound if it is not theirs."""
    row = db.execute(
        "SELECT (SELECT COUNT(*) FROM turns WHERE conversation_id = c.id), c.summarized_upto "
        "FROM conversations c WHERE c.id = ? AND c.owner = ?",
        (conv_id, owner),
    ).fetchone()
    if row is None:
        raise _missing(conv_id)
    return row[0], row[1]


def _versions(db: sqlite3.Connection, conv_id: str) -> dict[int, tuple[int, int]]:
    """fork -> (active version, number of versions)."""
    return {
        fork: (active, count)
        for fork, active, count in db.execute(
            "SELECT fork, MAX(CASE WHEN body IS NULL THEN version END), COUNT(*) FROM versions "
            "WHERE conversation_id = ? GROUP BY fork",
            (conv_id,),
        )
    }


_TURN_COLUMNS = "user, assistant, stats, sources, created"


def _stash(db: sqlite3.Connection, conv_id: str, fork: int) -> str:
    """Take the active branch from turn `fork` on out of the live tables, as a version's JSON body:
    its turns, its summary, the unpinned facts taken from those turns (not from earlier ones) and
    the forks nested after `fork`. Only the turns and facts are removed; the caller sets what follows."""
    turns = db.execute(
        f"SELECT {_TURN_COLUMNS} FROM turns WHERE conversation_id = ? AND idx >= ? ORDER BY idx", (conv_id, fork)
    ).fetchall()
    earlier = [
        r[0] for r in db.execute("SELECT user FROM turns WHERE conversation_id = ? AND idx < ?", (conv_id, fork))
    ]
    later = [t[0] for t in turns]
    facts = [
        (fid, text, created)
        for fid, text, created in db.execute(
            "SELECT id, text, created FROM facts WHERE conversation_id = ? AND pinned = 0 ORDER BY id", (conv_id,)
        )
        if any(text in u for u in later) and not any(text in u for u in earlier)
    ]
    nested = db.execute(
        "SELECT fork, version, body FROM versions WHERE conversation_id = ? AND fork > ? ORDER BY fork, version",
        (conv_id, fork),
    ).fetchall()
    summary, upto = db.execute("SELECT summary, summarized_upto FROM conversations WHERE id = ?", (conv_id,)).fetchone()
    db.execute("DELETE FROM turns WHERE conversation_id = ? AND idx >= ?", (conv_id, fork))
    db.executemany("DELETE FROM facts WHERE id = ?", [(f[0],) for f in facts])
    db.execute("DELETE FROM versions WHERE conversation_id = ? AND fork > ?", (conv_id, fork))
    return json.dumps(
        {
            "turns": [list(t) for t in turns],
            "summary": summary,
            "summarized_upto": upto,
            "facts": [[text, created] for _, text, created in facts],
            "nested": [list(v) for v in nested],
        }
    )


def _unstash(db: sqlite3.Connection, conv_id: str, fork: int, body: dict) -> None:
    """Put a stashed version back as the active branch from turn `fork` on (the live tables hold no
    turn from `fork` on: `_stash` took them)."""
    db.executemany(
        f"INSERT INTO turns (conversation_id, idx, {_TURN_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?)",
        [(conv_id, i, *t) for i, t in enumerate(body["turns"], fork)],
    )
    db.execute(
        "UPDATE conversations SET summary = ?, summarized_upto = ? WHERE id = ?",
        (body["summary"], body["summarized_upto"], conv_id),
    )
    db.executemany(
        "INSERT INTO facts (conversation_id, text, pinned, created) VALUES (?, ?, 0, ?)",
        [(conv_id, text, created) for text, created in body["facts"]],
    )
    db.executemany("INSERT INTO versions VALUES (?, ?, ?, ?)", [(conv_id, *v) for v in body["nested"]])


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


def _read_version(db: sqlite3.Connection) -> int:
    row = db.execute("SELECT MAX(version) FROM schema_version").fetchone()
    return row[0] or 0


def _facts(db: sqlite3.Connection, conv_id: str) -> list[Fact]:
    return [
        Fact(fid, text, bool(pinned), created)
        for fid, text, pinned, created in db.execute(
            "SELECT id, text, pinned, created FROM facts WHERE conversation_id = ? ORDER BY id", (conv_id,)
        )
    ]


def _missing(conv_id: str) -> NotFound:
    return NotFound(f"That conversation no longer exists (id {conv_id[:8]}).")


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M UTC")


def _stats(text: str) -> TurnStats | None:
    d = json.loads(text)
    return TurnStats.from_dict(d) if d else None


def _stats_json(d: Any) -> str:
    """Imported stats, checked by reading them as TurnStats; an empty object stays empty."""
    if not isinstance(d, dict):
        raise TypeError("stats must be an object")
    return json.dumps(TurnStats.from_dict(d).to_dict() if d else {})


def _sources(text: str) -> list[Source]:
    return [Source.from_dict(d) for d in json.loads(text)]
