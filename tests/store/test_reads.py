"""Reads run off the writer's lock, each on a read-only connection of its own under WAL: a long
search never makes another visitor's call wait, every reader still sees only its owner's rows, the
store stays consistent under concurrent reads and writes, and `close` closes every connection.
Real SQLite files in tmp_path; a search is made slow through its progress handler's clock."""

from __future__ import annotations

import sqlite3
import threading
import time

import pytest

from llmweb.errors import InputError
from llmweb.store import connection, search
from llmweb.store.conversations import insert_turn
from llmweb.store.db import Store
from tests.store.test_store import A, B

WAIT_S = 5.0  # a safety net for joins, never the bound a test asserts


@pytest.fixture
def store(tmp_path):
    s = Store(tmp_path / "llmweb.sqlite3")
    yield s
    s.close()


def _fill(store: Store, owner: str, n: int, text: str) -> str:
    conv = store.create_conversation(owner)
    with store._write() as db:
        for i in range(n):
            insert_turn(db, conv, i, (f"{text} {i}", f"a reply about {text}", "{}", "[]", 0.0))
    return conv


def test_another_visitors_calls_go_through_while_a_search_runs(store, monkeypatch):
    """While A's search is provably inside SQLite (its progress handler is running), B reads
    their chat, appends a turn and lists their chats, from another thread. On the code before,
    the search held the store's one lock, so B's calls waited until it ended."""
    _fill(store, A, 50, "the bike trip")
    conv_b = _fill(store, B, 3, "my garden")
    seen: dict = {}

    def b_calls() -> None:
        t0 = time.perf_counter()
        seen["turns"] = len(store.get(B, conv_b).turns)
        seen["idx"] = store.add_turn(B, conv_b, "and the roses?", "they bloom")
        seen["chats"] = len(store.list_conversations(B))
        seen["b_s"] = time.perf_counter() - t0

    calls = [0]

    def clock() -> float:  # called once for the deadline, then by the handler inside the search
        calls[0] += 1
        if calls[0] == 2:
            other = threading.Thread(target=b_calls)
            other.start()
            other.join(timeout=WAIT_S)  # a safety net: B must be done before the search goes on
            seen["during"] = "b_s" in seen
        return 0.0

    monkeypatch.setattr(search, "_PROGRESS_STEPS", 1, raising=False)
    monkeypatch.setattr(search, "_clock", clock, raising=False)
    hits = store.search(A, "bike")
    assert seen.get("during"), "B's calls completed while A's search was running"
    assert seen["b_s"] < 1.0, seen
    assert (seen["turns"], seen["idx"], seen["chats"]) == (3, 3, 1)
    assert len(hits) == 20 and all("bike" in h.snippet for h in hits)


def test_eight_slow_searches_leave_another_visitors_calls_quick(store, monkeypatch):
    """Eight visitors' searches, each held ~1 s inside SQLite, at once; meanwhile B makes 20 calls.
    Each of B's calls stays far under one search's time (on the code before, B waited behind the
    searches queued on the lock: seconds)."""
    searchers = [f"anon:searcher-{i}" for i in range(8)]
    for owner in searchers:
        _fill(store, owner, 200, "the bike trip")
    conv_b = _fill(store, B, 3, "my garden")
    main = threading.current_thread()
    started = threading.Barrier(9, timeout=WAIT_S)

    def clock() -> float:
        if threading.current_thread() is not main:
            time.sleep(0.002)  # ~1 s in all over a search's steps
        return 0.0

    monkeypatch.setattr(search, "_PROGRESS_STEPS", 25, raising=False)
    monkeypatch.setattr(search, "_clock", clock, raising=False)
    results: list = []

    def searcher(owner: str) -> None:
        started.wait()
        t0 = time.perf_counter()
        results.append((len(store.search(owner, "bike OR trip")), time.perf_counter() - t0))

    threads = [threading.Thread(target=searcher, args=(owner,)) for owner in searchers]
    for t in threads:
        t.start()
    started.wait()
    time.sleep(0.05)  # the searches are inside SQLite by now
    worst = 0.0
    for i in range(20):
        t0 = time.perf_counter()
        store.get(B, conv_b)
        store.add_turn(B, conv_b, f"q{i}", f"a{i}")
        worst = max(worst, time.perf_counter() - t0)
    for t in threads:
        t.join(timeout=60)
    search_s = min(s for _, s in results)
    print(f"\n[reads] 8 searches of ~{search_s:.2f} s each; B's slowest get + add_turn beside {worst * 1e3:.0f} ms")
    assert [n for n, _ in results] == [20] * 8
    assert search_s > 0.3, "the searches were slow, as meant"
    assert worst < search_s / 3, (worst, search_s)
    assert len(store.get(B, conv_b).turns) == 23


def test_concurrent_searches_of_two_visitors_each_see_their_own_rows(store):
    mine = {_fill(store, A, 30, "the bike trip") for _ in range(2)}
    theirs = {_fill(store, B, 30, "the bike shop") for _ in range(2)}
    bad: list = []

    def searcher(owner: str, own: set) -> None:
        for _ in range(20):
            hits = store.search(owner, "bike")
            if not hits or {h.conversation_id for h in hits} - own:
                bad.append((owner, hits))

    threads = [threading.Thread(target=searcher, args=(o, c)) for o, c in [(A, mine), (B, theirs)]]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert bad == []


def test_concurrent_reads_and_writes_leave_the_store_consistent(store):
    """Four owners' writers append turns to their chats while their readers get, list and search;
    every read sees whole turns in order, and at the end nothing is lost and the index is sound."""
    owners = [A, B, "anon:carol", "user:dave"]
    convs = [_fill(store, owner, 1, "start") for owner in owners]
    errors: list = []
    stop = threading.Event()

    def writer(k: int) -> None:
        try:
            for i in range(40):
                store.add_turn(owners[k], convs[k], f"writer {k} turn {i}", f"reply {k} {i}")
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    def reader(k: int) -> None:
        try:
            while not stop.is_set():
                turns = store.get(owners[k], convs[k]).turns
                assert [t.idx for t in turns] == list(range(len(turns)))
                assert all(t.assistant.startswith(("a reply", "reply")) for t in turns)
                assert len(store.list_conversations(owners[k])) == 1
                assert {h.conversation_id for h in store.search(owners[k], "writer")} <= {convs[k]}
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    writers = [threading.Thread(target=writer, args=(k,)) for k in range(4)]
    readers = [threading.Thread(target=reader, args=(k,)) for k in range(4)]
    for t in writers + readers:
        t.start()
    for t in writers:
        t.join(timeout=60)
    stop.set()
    for t in readers:
        t.join(timeout=60)
    assert errors == []
    assert [len(store.get(o, c).turns) for o, c in zip(owners, convs, strict=True)] == [41] * 4
    store._db.execute("INSERT INTO turns_fts(turns_fts) VALUES ('integrity-check')")
    assert store._db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"


def test_reads_use_read_only_connections_that_close_with_the_store(tmp_path, monkeypatch):
    """Sixteen threads read at once: each on a read-only connection; at most READERS_KEPT stay
    open idle afterwards, and `close` closes every one of them, a reader still in use included
    (when its read ends)."""
    opened: list[sqlite3.Connection] = []
    real_connect = sqlite3.connect

    def connect(*args, **kwargs):
        db = real_connect(*args, **kwargs)
        opened.append(db)
        return db

    store = Store(tmp_path / "llmweb.sqlite3")
    conv = _fill(store, A, 5, "the bike trip")
    monkeypatch.setattr(connection.sqlite3, "connect", connect)
    gate = threading.Barrier(16, timeout=WAIT_S)

    def reader() -> None:
        with store._read() as db:
            gate.wait()  # all sixteen hold a read at once
            db.execute("SELECT COUNT(*) FROM turns").fetchone()

    threads = [threading.Thread(target=reader) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=WAIT_S)
    assert len(opened) == 16, "one connection per concurrent reader"
    assert len(store._readers) == connection.READERS_KEPT
    with store._read() as db, pytest.raises(sqlite3.OperationalError, match="readonly"):
        db.execute("DELETE FROM turns")
    assert len(store.get(A, conv).turns) == 5

    held = threading.Event()
    release = threading.Event()

    def long_read() -> None:
        with store._read():
            held.set()
            release.wait(WAIT_S)

    t = threading.Thread(target=long_read)
    t.start()
    held.wait(WAIT_S)
    store.close()
    release.set()
    t.join(timeout=WAIT_S)
    for db in opened:
        with pytest.raises(sqlite3.ProgrammingError):
            db.execute("SELECT 1")
    with pytest.raises(sqlite3.ProgrammingError):
        store.get(A, conv)


def test_one_search_per_owner_at_a_time(store, monkeypatch):
    """While A's search runs, A's second search (another tab, or a flood of them) is refused at
    once with a clear message; B's search goes through; A searches again once the first ends.
    On the code before, A's second search and B's waited for the first."""
    _fill(store, A, 30, "the bike trip")
    _fill(store, B, 30, "the bike shop")
    seen: dict = {}
    calls = [0]

    def others() -> None:
        try:
            store.search(A, "trip")
        except InputError as e:
            seen["a"] = str(e)
        seen["b"] = len(store.search(B, "shop"))

    def clock() -> float:
        calls[0] += 1
        if calls[0] == 2:  # inside A's first search
            other = threading.Thread(target=others)
            other.start()
            other.join(timeout=WAIT_S)
            seen["during"] = "b" in seen
        return 0.0

    monkeypatch.setattr(search, "_PROGRESS_STEPS", 1, raising=False)
    monkeypatch.setattr(search, "_clock", clock, raising=False)
    assert len(store.search(A, "bike")) == 20
    assert seen.get("during"), "A's second search and B's search were answered during A's first"
    assert "still running" in seen.get("a", ""), seen
    assert seen["b"] == 20
    assert len(store.search(A, "trip")) == 20, "the first search ended: A may search again"
