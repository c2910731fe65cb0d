"""The schema of the store's SQLite file: its DDL as a list of migrations, and `migrate`, which
brings a file of any earlier version up to SCHEMA_VERSION.

It owns every CREATE/ALTER statement and the `schema_version` table. It must not query or change
the conversations themselves (that is the query groups'), and it must never edit a released
migration: a change to the schema is a new entry at the end of MIGRATIONS.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

from llmweb.errors import ConfigError
from llmweb.records import LOCAL_OWNER

# An owner's search tag (migration 8): 'o' + the hex of its name + 'x', one token of letters and digits
# that the tokenizer keeps whole and the porter stemmer leaves alone (no English suffix ends in x).
# store/search.py's `owner_tag` makes the same in Python.
OWNER_TAG = "'o' || lower(hex(owner)) || 'x'"


def _len(value: str) -> str:
    """SQL for the UTF-8 bytes of a text value (0 for NULL)."""
    return f"COALESCE(length(CAST({value} AS BLOB)), 0)"


_TURN_BYTES = " + ".join(_len(f"{{t}}.{c}") for c in ("user", "assistant", "stats", "sources"))


def _bytes_triggers(table: str, size: str, columns: str) -> tuple[str, str, str]:
    """Triggers that keep conversations.bytes in step with `table`'s rows (`size`: SQL of a row's
    bytes over the row {t}), on insert, delete and an update of `columns`."""
    if "length" not in size:  # a column: its bytes
        size = _len(size)
    new, old = f"({size.format(t='new')})", f"({size.format(t='old')})"
    update = "UPDATE conversations SET bytes = bytes {} WHERE id = {}.conversation_id;"
    return (
        f"CREATE TRIGGER {table}_bytes_insert AFTER INSERT ON {table} BEGIN {update.format('+ ' + new, 'new')} END",
        f"CREATE TRIGGER {table}_bytes_delete AFTER DELETE ON {table} BEGIN {update.format('- ' + old, 'old')} END",
        f"CREATE TRIGGER {table}_bytes_update AFTER UPDATE OF {columns} ON {table} BEGIN "
        f"{update.format(f'+ {new} - {old}', 'new')} END",
    )


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
        # schema 1 created a conversation on every page load: drop the empty ones
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
    (  # 6: owner generations. "Delete all my data" (`delete_owner`) bumps the owner's generation, and
        # the row outlives the delete: it is the tombstone. A write of a turn, summary, fact or
        # conversation that read an older generation commits nothing (store/owners.py
        # `check_generation`), so a reply or a fold that started before the delete cannot recreate
        # what it deleted. No row: generation 0.
        """CREATE TABLE owner_generations (
            owner           TEXT PRIMARY KEY,
            generation      INTEGER NOT NULL CHECK (generation >= 0)
        )""",
    ),
    (  # 7: whole-document tasks' per-piece results (store/pieces.py), keyed by owner, document (its
        # content hash), task, piece and model; deleted with the document and with the owner's data
        """CREATE TABLE document_pieces (
            owner           TEXT NOT NULL,
            doc_id          TEXT NOT NULL,
            task            TEXT NOT NULL,
            piece           INTEGER NOT NULL CHECK (piece >= 0),
            model           TEXT NOT NULL,
            text            TEXT NOT NULL,
            created         REAL NOT NULL,
            PRIMARY KEY (owner, doc_id, task, piece, model)
        )""",
    ),
    (  # 8: search scoped to the owner before it scans. Each turn carries its owner's tag (OWNER_TAG:
        # one token no user text can reach, in a column of its own), and the index has it as a third
        # column, so store/search.py's query matches the owner's tag AND the words: FTS5 never yields
        # another owner's row to join, rank or snippet. The insert paths set the tag (INSERT_TURN);
        # the guard refuses a turn without its conversation's.
        "ALTER TABLE turns ADD COLUMN owner_tag TEXT NOT NULL DEFAULT ''",
        f"UPDATE turns SET owner_tag = (SELECT {OWNER_TAG} FROM conversations c WHERE c.id = turns.conversation_id)",
        "DROP TRIGGER turns_fts_insert",
        "DROP TRIGGER turns_fts_delete",
        "DROP TRIGGER turns_fts_update",
        "DROP TABLE turns_fts",
        """CREATE VIRTUAL TABLE turns_fts USING fts5(
            user, assistant, owner_tag, content='turns', content_rowid='rowid',
            tokenize='porter unicode61 remove_diacritics 2'
        )""",
        "INSERT INTO turns_fts(turns_fts) VALUES ('rebuild')",
        f"""CREATE TRIGGER turns_owner_tag BEFORE INSERT ON turns
            WHEN new.owner_tag IS NOT (SELECT {OWNER_TAG} FROM conversations c WHERE c.id = new.conversation_id)
            BEGIN SELECT RAISE(ABORT, 'a turn must carry its conversation owner''s tag'); END""",
        """CREATE TRIGGER turns_fts_insert AFTER INSERT ON turns BEGIN
            INSERT INTO turns_fts (rowid, user, assistant, owner_tag)
            VALUES (new.rowid, new.user, new.assistant, new.owner_tag);
        END""",
        """CREATE TRIGGER turns_fts_delete AFTER DELETE ON turns BEGIN
            INSERT INTO turns_fts (turns_fts, rowid, user, assistant, owner_tag)
            VALUES ('delete', old.rowid, old.user, old.assistant, old.owner_tag);
        END""",
        """CREATE TRIGGER turns_fts_update AFTER UPDATE OF user, assistant, owner_tag ON turns BEGIN
            INSERT INTO turns_fts (turns_fts, rowid, user, assistant, owner_tag)
            VALUES ('delete', old.rowid, old.user, old.assistant, old.owner_tag);
            INSERT INTO turns_fts (rowid, user, assistant, owner_tag)
            VALUES (new.rowid, new.user, new.assistant, new.owner_tag);
        END""",
    ),
    (  # 9: what each conversation holds, in bytes of text (turns, versions, facts, its summary), kept by
        # triggers, so an owner's total (store/owners.py `check_room`) is a sum over their chats, not a
        # read of their text. It grows with every write, whichever path makes it.
        "ALTER TABLE conversations ADD COLUMN bytes INTEGER NOT NULL DEFAULT 0",
        f"""UPDATE conversations SET bytes = {_len("summary")}
            + COALESCE((SELECT SUM({_TURN_BYTES.format(t="t")}) FROM turns t
                        WHERE t.conversation_id = conversations.id), 0)
            + COALESCE((SELECT SUM({_len("v.body")}) FROM versions v WHERE v.conversation_id = conversations.id), 0)
            + COALESCE((SELECT SUM({_len("f.text")}) FROM facts f WHERE f.conversation_id = conversations.id), 0)""",
        *_bytes_triggers("turns", _TURN_BYTES, "user, assistant, stats, sources"),
        *_bytes_triggers("versions", "{t}.body", "body"),
        *_bytes_triggers("facts", "{t}.text", "text"),
        f"""CREATE TRIGGER conversations_bytes_insert AFTER INSERT ON conversations BEGIN
            UPDATE conversations SET bytes = bytes + {_len("new.summary")} WHERE id = new.id;
        END""",
        f"""CREATE TRIGGER conversations_bytes_summary AFTER UPDATE OF summary ON conversations BEGIN
            UPDATE conversations SET bytes = bytes + {_len("new.summary")} - {_len("old.summary")} WHERE id = new.id;
        END""",
    ),
    (  # 10: its owner's say in what the model sees of a turn (records.Turn.view): '' as planned, 'pin'
        # kept in context, 'out' left out. Only the active branch's turns carry it (a version's stash does not).
        "ALTER TABLE turns ADD COLUMN view TEXT NOT NULL DEFAULT '' CHECK (view IN ('', 'pin', 'out'))",
    ),
    (  # 11: what an owner asked to be remembered in all their chats (store/memories.py), and where a chat
        # continues one it was started from ("Continue in a new chat"; NULL: none)
        """CREATE TABLE memories (
            id              INTEGER PRIMARY KEY AUTOINCREMENT,
            owner           TEXT NOT NULL,
            text            TEXT NOT NULL,
            enabled         INTEGER NOT NULL DEFAULT 1 CHECK (enabled IN (0, 1)),
            created         REAL NOT NULL
        )""",
        "CREATE INDEX memories_by_owner ON memories(owner, id)",
        "ALTER TABLE conversations ADD COLUMN continues TEXT",
    ),
    (  # 12: where each owner's requests come from (its client address group as the web layer computes it
        # from the connection, web/trust.py: an IPv6 /64 or an IPv4 address; NULL: never said, its own
        # group), the bytes of its chats (the sum of its conversations.bytes, kept by triggers: a
        # conversation never changes owner) and of its private documents (the library's count, recorded
        # at each upload and removal), so what all the owners of one address keep is an indexed sum over
        # their rows (store/owners.py). An owner's row exists before its first conversation's (BEFORE
        # INSERT), so every change of that conversation's bytes reaches it.
        "ALTER TABLE owners ADD COLUMN address TEXT",
        "ALTER TABLE owners ADD COLUMN chat_bytes INTEGER NOT NULL DEFAULT 0",
        "ALTER TABLE owners ADD COLUMN doc_bytes INTEGER NOT NULL DEFAULT 0 CHECK (doc_bytes >= 0)",
        "CREATE INDEX owners_by_address ON owners(address)",
        """INSERT OR IGNORE INTO owners (owner, created, last_seen)
           SELECT owner, MIN(created), MAX(updated) FROM conversations GROUP BY owner""",
        """UPDATE owners SET chat_bytes = COALESCE(
            (SELECT SUM(bytes) FROM conversations c WHERE c.owner = owners.owner), 0)""",
        """CREATE TRIGGER owners_row_for_conversation BEFORE INSERT ON conversations BEGIN
            INSERT OR IGNORE INTO owners (owner, created, last_seen) VALUES (new.owner, new.created, new.updated);
        END""",
        """CREATE TRIGGER owners_chat_bytes_insert AFTER INSERT ON conversations BEGIN
            UPDATE owners SET chat_bytes = chat_bytes + new.bytes WHERE owner = new.owner;
        END""",
        """CREATE TRIGGER owners_chat_bytes_update AFTER UPDATE OF bytes ON conversations BEGIN
            UPDATE owners SET chat_bytes = chat_bytes + new.bytes - old.bytes WHERE owner = new.owner;
        END""",
        """CREATE TRIGGER owners_chat_bytes_delete AFTER DELETE ON conversations BEGIN
            UPDATE owners SET chat_bytes = chat_bytes - old.bytes WHERE owner = old.owner;
        END""",
    ),
)
SCHEMA_VERSION = len(MIGRATIONS)


def migrate(
    db: sqlite3.Connection, write: Callable[[], AbstractContextManager[sqlite3.Connection]], path: Path
) -> None:
    """Apply the migrations `db` lacks, each in its own `write()` transaction. A file written by a
    newer llmweb (a version past SCHEMA_VERSION) is a ConfigError naming `path`."""
    db.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
    while True:
        with write() as tx:  # re-read inside the lock: another process may migrate too
            version = read_version(tx)
            if version > SCHEMA_VERSION:
                raise ConfigError(
                    f"The database {path} was written by a newer llmweb (schema "
                    f"{version}, this one knows {SCHEMA_VERSION}). Upgrade llmweb or use "
                    "another data directory."
                )
            if version == SCHEMA_VERSION:
                return
            for statement in MIGRATIONS[version]:
                tx.execute(statement)
            tx.execute("DELETE FROM schema_version")
            tx.execute("INSERT INTO schema_version (version) VALUES (?)", (version + 1,))


def read_version(db: sqlite3.Connection) -> int:
    row = db.execute("SELECT MAX(version) FROM schema_version").fetchone()
    return row[0] or 0
