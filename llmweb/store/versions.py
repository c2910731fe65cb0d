"""Versions of a chat (migration 5): editing turn k (`edit_turn`) forks the chat there.

`turns` always holds the ACTIVE branch, so every other read (the planner, folds, search, exports)
sees only it; each other version is one JSON body in `versions` (its turns from k on, its summary,
the unpinned facts taken from those turns, the forks nested in it), reached only through the
owner's conversation. `switch_version` swaps bodies in one transaction.

It owns the `versions` table and the stash/unstash of a branch. It must not change turns before
the fork, nor anything of a conversation whose owner it has not checked.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Sequence

from llmweb.errors import InputError
from llmweb.records import Source, TurnStats
from llmweb.store.connection import Connection
from llmweb.store.conversations import TURN_COLUMNS, insert_turn, turn_count, versions_of
from llmweb.store.models import sources_text, stats_text
from llmweb.store.owners import check_generation, require_owned, seen


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
        with self._write() as db:
            check_generation(db, owner, generation)
            n, upto = turn_count(db, owner, conv_id)
            if not 0 <= idx < n:
                raise InputError("That message is no longer in this chat: reload it and try again.")
            if idx < upto:
                raise InputError(
                    "That message is already folded into this chat's summary, so it can no longer be edited."
                )
            group = versions_of(db, conv_id).get(idx)
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
            insert_turn(db, conv_id, idx, (user, assistant, stats_json, sources_json, now))
            db.execute("UPDATE conversations SET updated = ? WHERE id = ?", (now, conv_id))
            seen(db, owner, now)

    def switch_version(self, owner: str, conv_id: str, fork: int, version: int) -> None:
        """Make `version` the active branch of the chat from turn `fork` on (its turns, summary and
        facts come back; the branch that was active is kept as it was). Unknown is an InputError."""
        with self._write() as db:
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


def _stash(db: sqlite3.Connection, conv_id: str, fork: int) -> str:
    """Take the active branch from turn `fork` on out of the live tables, as a version's JSON body:
    its turns, its summary, the unpinned facts taken from those turns (not from earlier ones) and
    the forks nested after `fork`. Only the turns and facts are removed; the caller sets what follows."""
    turns = db.execute(
        f"SELECT {TURN_COLUMNS} FROM turns WHERE conversation_id = ? AND idx >= ? ORDER BY idx", (conv_id, fork)
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
        f"INSERT INTO turns (conversation_id, idx, {TURN_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?)",
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
