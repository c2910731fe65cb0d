"""The store's one SQLite connection and its transactions: `Connection`, the base every query
group (store/conversations.py, versions.py, facts.py, search.py, exchange.py) builds on.

Durability: every write method is ONE transaction (`_write`), committed before it returns. A
process killed at any moment (kill -9, OOM killer) loses at most the call in flight, never a
committed turn and never half a turn.

  - journal_mode=WAL: readers never block the writer, and a crash mid-commit leaves only an
    uncommitted tail in the WAL that the next open ignores.
  - synchronous=FULL: each commit also fsyncs the WAL. NORMAL would already survive a process
    crash (the committed pages sit in the OS page cache); FULL also survives a power cut or a
    kernel crash. The price is one fsync per write, i.e. per turn, which is nothing next to the
    seconds a generation takes.
  - foreign_keys=ON: deleting a conversation cascades to its turns and facts.

Threads: writes go through ONE connection (check_same_thread=False) serialised by a lock: a few
per turn, each short. Reads never take that lock: each read borrows a read-only connection
(`mode=ro`) from a small pool, so under WAL a long read (a search over 80k turns) runs beside the
writer and beside other readers, and never makes another visitor's call wait. A pool rather than a
connection per thread, because Gradio retires its worker threads: at most READERS_KEPT idle
readers stay open, and `close` closes them all (a reader still in use closes when its read ends).
Other processes (the CLI while the server runs) are covered by WAL and a busy timeout.

It owns opening, migrating (through store/schema.py) and closing the file. It must not hold a
query of its own: every public method that reads or writes conversations is a query group's.
"""

from __future__ import annotations

import sqlite3
import threading
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Self

from llmweb.errors import InputError
from llmweb.store.models import OwnerCaps
from llmweb.store.schema import migrate, read_version

BUSY_TIMEOUT_S = 30.0  # wait this long for another process's write lock
READERS_KEPT = 4  # idle read-only connections kept open for the next read


class Connection:
    """One SQLite file, opened in WAL mode and migrated to the current schema."""

    def __init__(self, path: Path, caps: OwnerCaps | None = None):
        self.path = Path(path)
        self.caps = caps or OwnerCaps()  # what one owner may keep (store/owners.py; none: no cap)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()  # the writer's
        self._readers: list[sqlite3.Connection] = []  # idle read-only connections
        self._readers_lock = threading.Lock()
        # owner -> the address group last written to its row (store/owners.py `note_address`), bounded
        self._addresses: OrderedDict[str, str] = OrderedDict()
        self._addresses_lock = threading.Lock()
        self._closed = False
        self._reader_uri = self.path.resolve().as_uri() + "?mode=ro"
        self._db = sqlite3.connect(
            self.path, timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False
        )  # isolation_level=None: we issue BEGIN/COMMIT ourselves
        try:
            mode = self._db.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            assert mode.lower() == "wal", f"SQLite refused WAL mode for {self.path} (got {mode})"
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.execute("PRAGMA foreign_keys=ON")
            migrate(self._db, self._write, self.path)
        except BaseException:
            self._db.close()
            raise

    def close(self) -> None:
        with self._readers_lock:
            self._closed = True
            idle, self._readers = self._readers, []
        for db in idle:
            db.close()
        with self._lock:
            self._db.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def schema_version(self) -> int:
        with self._read() as db:
            return read_version(db)

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
        """A read transaction on a read-only connection of its own: several SELECTs see one
        snapshot, and no other call (read or write) waits for it."""
        db = self._borrow()
        try:
            db.execute("BEGIN")
            try:
                yield db
            finally:
                if db.in_transaction:  # an interrupted statement may have ended it already
                    db.execute("COMMIT")
        finally:
            self._give_back(db)

    def _borrow(self) -> sqlite3.Connection:
        with self._readers_lock:
            if self._closed:
                raise sqlite3.ProgrammingError("Cannot operate on a closed database.")
            if self._readers:
                return self._readers.pop()
        db = sqlite3.connect(
            self._reader_uri, uri=True, timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False
        )
        db.execute("PRAGMA query_only=ON")
        return db

    def _give_back(self, db: sqlite3.Connection) -> None:
        with self._readers_lock:
            if not self._closed and not db.in_transaction and len(self._readers) < READERS_KEPT:
                self._readers.append(db)
                return
        db.close()
