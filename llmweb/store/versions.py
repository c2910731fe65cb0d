"""Versions of a chat (migration 5): editing turn k (`edit_turn`) forks the chat there.

`turns` always holds the ACTIVE branch, so every other read (the planner, folds, search, exports)
sees only it; each other version is one JSON body in `versions` (its turns from k on, its summary,
the unpinned facts taken from those turns, the forks nested in it), reached only through the
owner's conversation. `switch_version` swaps bodies in one transaction.

Which facts go with a branch is a check that grows with the chat's text; it runs outside the
store's lock on a snapshot, and the write commits only if the snapshot still holds (`_forking`).

It owns the `versions` table and the stash/unstash of a branch. It must not change turns before
the fork, nor anything of a conversation whose owner it has not checked.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from llmweb.errors import InputError
from llmweb.records import Source, TurnStats
from llmweb.store.connection import Connection
from llmweb.store.conversations import INSERT_TURN, TURN_COLUMNS, insert_turn, turn_count, versions_of
from llmweb.store.models import sources_text, stats_text
from llmweb.store.owners import check_generation, check_room, owned, require_owned, seen, text_bytes


class VersionQueries(Connection):
    """An edited turn forks the chat; `turns` holds the active branch."""

    def edit_turn(
        self,
        owner: str,
        conv_id: str,
        idx: int,
        user: str,
        assistant: str,
        stats: TurnStats | None = None,
        sources: Sequence[Source] = (),
        *,
        generation: int | None = None,
    ) -> None:
        """Replace turn `idx` and every turn after it by one new turn (an edited message and its
        reply), keeping what was there as another version of the chat from `idx` on; the new one
        becomes the active version. Refused (InputError, nothing changed) when turn `idx` does not
        exist or is folded into the summary."""
        stats_json, sources_json = stats_text(stats), sources_text(sources)
        now = time.time()
        with self._forking(owner, conv_id, idx) as (db, taken):
            check_generation(db, owner, generation)
            n, upto = turn_count(db, owner, conv_id)
            if not 0 <= idx < n:
                raise InputError("That message is no longer in this chat: reload it and try again.")
            if idx < upto:
                raise InputError(
                    "That message is already folded into this chat's summary, so it can no longer be edited."
                )
            check_room(db, self.caps, owner, size=text_bytes(user, assistant, stats_json, sources_json))
            group = versions_of(db, conv_id).get(idx)
            body = _stash(db, conv_id, idx, taken)
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
            insert_turn(db, conv_id, idx, (user, assistant, stats_json, sources_json, now))
            db.execute("UPDATE conversations SET updated = ? WHERE id = ?", (now, conv_id))
            seen(db, owner, now)

    def switch_version(self, owner: str, conv_id: str, fork: int, version: int) -> None:
        """Make `version` the active branch of the chat from turn `fork` on (its turns, summary and
        facts come back; the branch that was active is kept as it was). Unknown is an InputError."""
        with self._forking(owner, conv_id, fork) as (db, taken):
            require_owned(db, owner, conv_id)
            group = versions_of(db, conv_id).get(fork)
            if group is None or not 0 <= version < group[1]:
                raise InputError("That version of the chat no longer exists: reload it and try again.")
            if version == group[0]:
                return
            (target,) = db.execute(
                "SELECT body FROM versions WHERE conversation_id = ? AND fork = ? AND version = ?",
                (conv_id, fork, version),
            ).fetchone()
            body = _stash(db, conv_id, fork, taken)
            db.execute(
                "UPDATE versions SET body = ? WHERE conversation_id = ? AND fork = ? AND version = ?",
                (body, conv_id, fork, group[0]),
            )
            db.execute(
                "UPDATE versions SET body = NULL WHERE conversation_id = ? AND fork = ? AND version = ?",
                (conv_id, fork, version),
            )
            _unstash(db, conv_id, fork, json.loads(target))

    @contextmanager
    def _forking(self, owner: str, conv_id: str, fork: int) -> Iterator[tuple[sqlite3.Connection, list[int]]]:
        """A write transaction on the owner's chat, with the ids of the unpinned facts that belong
        to its branch from turn `fork` on (`branch_facts`), computed OUTSIDE the store's lock: that
        check grows with facts x text (2,000 facts against 7 MB of an import: ~24 s), and every
        visitor's call waits for the lock. It reads a snapshot, checks it unlocked, then writes
        only if the snapshot is still what the chat holds (else it reads again; after
        FORK_TRIES changes in a row, an InputError): an edit, undo or delete racing it is never lost."""
        for _ in range(FORK_TRIES):
            with self._read() as db:
                before = _branch(db, conv_id, fork) if owned(db, owner, conv_id) else None
            taken = [] if before is None else branch_facts(*before)  # the lock is free here
            with self._write() as db:  # not the owner's: the caller's checks raise NotFound or Deleted
                if (_branch(db, conv_id, fork) if owned(db, owner, conv_id) else None) == before:
                    yield db, taken
                    return
        raise InputError("This chat changed meanwhile (another tab?): reload it and try again.")


FORK_TRIES = 3  # snapshots a fork reads again when its chat changed meanwhile

Branch = tuple[list[str], list[str], list[tuple[int, str]]]  # earlier users, later users, unpinned facts


def _branch(db: sqlite3.Connection, conv_id: str, fork: int) -> Branch:
    """What `branch_facts` reads: the users' texts before and from `fork`, and the unpinned facts."""
    users = db.execute("SELECT idx, user FROM turns WHERE conversation_id = ? ORDER BY idx", (conv_id,)).fetchall()
    facts = db.execute(
        "SELECT id, text FROM facts WHERE conversation_id = ? AND pinned = 0 ORDER BY id", (conv_id,)
    ).fetchall()
    return [u for i, u in users if i < fork], [u for i, u in users if i >= fork], facts


def branch_facts(
    earlier: list[str], later: list[str], facts: list[tuple[int, str]], budget: int | None = None
) -> list[int]:
    """The ids of the unpinned facts taken from the branch's messages (`later`), not from earlier
    ones: each a sentence of a user's message, kept verbatim. Pure, and run without the lock.
    Bounded: past `budget` characters searched (FACT_SCAN_CHARS), the facts left stay with the chat
    (only a crafted import gets there: 2,000 one-word facts found nowhere in 7 MB took ~8 s)."""
    later_, earlier_ = _Texts(later), _Texts(earlier)
    left = FACT_SCAN_CHARS if budget is None else budget
    taken = []
    for fid, text in facts:
        if left <= 0:
            break
        found, spent = later_.holds(text)
        left -= spent
        if found:
            before, spent = earlier_.holds(text)
            left -= spent
            if not before:
                taken.append(fid)
    return taken


FACT_SCAN_CHARS = 1_000_000_000  # characters `branch_facts` may search in all (~0.5 s)


class _Texts:
    """Messages to look for facts in: one search through their joined text per fact, after a word
    test that rules out most facts that are in none of them (a fact's inner words are whole
    words of the message that holds it), so the red team's 2,000 facts cost ~0.2 s, not ~12 s."""

    SEP = "\x00"  # between the joined messages: a fact with no NUL cannot match across two

    def __init__(self, texts: list[str]):
        self.texts = texts
        self.joined = self.SEP.join(texts)
        self.words: set[str] = set().union(*(t.split() for t in texts))

    def holds(self, text: str) -> tuple[bool, int]:
        """Is `text` in one of the messages, and how many characters that search read (at most)."""
        inner = text.split()[1:-1]
        if any(w not in self.words for w in inner):
            return False, len(inner)
        if self.SEP in text:
            return any(text in t for t in self.texts), len(self.joined)
        return text in self.joined, len(self.joined)


def _stash(db: sqlite3.Connection, conv_id: str, fork: int, taken: list[int]) -> str:
    """Take the active branch from turn `fork` on out of the live tables, as a version's JSON body:
    its turns, its summary, the unpinned facts `taken` from those turns (`branch_facts`) and the
    forks nested after `fork`. Only the turns and facts are removed; the caller sets what follows."""
    turns = db.execute(
        f"SELECT {TURN_COLUMNS} FROM turns WHERE conversation_id = ? AND idx >= ? ORDER BY idx", (conv_id, fork)
    ).fetchall()
    chosen = set(taken)
    facts = [
        (fid, text, created)
        for fid, text, created in db.execute(
            "SELECT id, text, created FROM facts WHERE conversation_id = ? AND pinned = 0 ORDER BY id", (conv_id,)
        )
        if fid in chosen
    ]
    nested = db.execute(
        "SELECT fork, version, body FROM versions WHERE conversation_id = ? AND fork > ? ORDER BY fork, version",
        (conv_id, fork),
    ).fetchall()
    summary, upto = db.execute("SELECT summary, summarized_upto FROM conversations WHERE id = ?", (conv_id,)).fetchone()
    views = [
        v
        for (v,) in db.execute(
            "SELECT view FROM turns WHERE conversation_id = ? AND idx >= ? ORDER BY idx", (conv_id, fork)
        )
    ]
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
            **({"views": views} if any(views) else {}),  # each turn's Turn.view, where one has one
        }
    )


def _unstash(db: sqlite3.Connection, conv_id: str, fork: int, body: dict) -> None:
    """Put a stashed version back as the active branch from turn `fork` on (the live tables hold no
    turn from `fork` on: `_stash` took them)."""
    db.executemany(
        INSERT_TURN,
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
    db.executemany(
        "UPDATE turns SET view = ? WHERE conversation_id = ? AND idx = ?",
        [(v, conv_id, i) for i, v in enumerate(body.get("views", ()), fork) if v],
    )
