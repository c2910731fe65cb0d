"""Chat search is scoped to the owner before it scans: FTS5 yields the caller's rows
only, so another owner's turns are never joined, ranked or cut into snippets; and a search is
bounded in terms and in time. Real SQLite files in tmp_path; the fixtures are earlier releases'."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from llmweb.errors import InputError
from llmweb.store import search
from llmweb.store.db import Store
from tests.store.test_store import A, B

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def store(tmp_path):
    s = Store(tmp_path / "llmweb.sqlite3")
    yield s
    s.close()


def _fill(store: Store, owner: str, n: int, text: str = "the bike trip to busan") -> str:
    conv = store.create_conversation(owner)
    with store._write() as db:  # many turns at once: one transaction
        from llmweb.store.conversations import insert_turn

        for i in range(n):
            insert_turn(db, conv, i, (f"{text} {i}", "a reply about the bike", "{}", "[]", 0.0))
    return conv


def _steps(store: Store, monkeypatch, owner: str, query: str) -> tuple[int, list]:
    """SQLite VM steps of one search (its progress handler called every step), and its hits."""
    calls = [0]

    def clock() -> float:
        calls[0] += 1
        return 0.0

    monkeypatch.setattr(search, "_PROGRESS_STEPS", 1, raising=False)
    monkeypatch.setattr(search, "_clock", clock, raising=False)
    hits = store.search(owner, query)
    return calls[0], hits


def test_a_search_never_visits_another_owners_rows(store, monkeypatch):
    """A has 3 matching turns; B gets 3,000 more. A's search takes fewer VM steps than B has rows
    (joining and ranking a row costs ~9): FTS5 hands it A's rows only. On the code before, every
    match of every owner was joined, ranked, then thrown away by `c.owner = ?`: 282 -> 27,823 steps.
    (What does grow a little is FTS5 reading the word's postings: 397 -> ~1,000-1,400 steps.)"""
    mine = _fill(store, A, 3)
    alone, hits = _steps(store, monkeypatch, A, "bike")
    assert {h.conversation_id for h in hits} == {mine} and len(hits) == 3
    _fill(store, B, 3_000)
    beside, hits = _steps(store, monkeypatch, A, "bike")
    assert {h.conversation_id for h in hits} == {mine} and len(hits) == 3
    print(f"\n[search] A's search: {alone} VM steps alone, {beside} beside 3,000 of B's matching turns")
    assert 0 < alone and beside < 3_000, (alone, beside)
    match = search.match_expression(A, "bike")
    rows = store._db.execute("SELECT rowid FROM turns_fts WHERE turns_fts MATCH ?", (match,)).fetchall()
    owners = {
        store._db.execute(
            "SELECT c.owner FROM turns t JOIN conversations c ON c.id = t.conversation_id WHERE t.rowid = ?", r
        ).fetchone()[0]
        for r in rows
    }
    assert owners == {A} and len(rows) == 3, "the index itself yields A's rows only"
    plan = [r[3] for r in store._db.execute("EXPLAIN QUERY PLAN " + search.SEARCH_SQL, ("", "", match, A, 20))]
    print("[search] plan:", " | ".join(plan))
    assert plan[0].startswith("SCAN turns_fts VIRTUAL TABLE INDEX"), plan


def test_the_owner_tag_cannot_be_reached_from_the_query_or_the_snippet(store):
    """A user who types another owner's tag finds nothing of theirs; no snippet shows a tag."""
    _fill(store, B, 2)
    _fill(store, A, 1, "hello world")
    tag = search.owner_tag(B)
    for q in (tag, f'"{tag}"', f"{tag[:6]}*", f"hello OR {tag}"):
        assert all(h.snippet.find("o") < 0 or tag not in h.snippet for h in store.search(A, q)), q
        assert [h.idx for h in store.search(A, q) if "bike" in h.snippet] == [], q
    (hit,) = store.search(A, "hello")
    assert search.owner_tag(A) not in hit.snippet and "hello" in hit.snippet


@pytest.mark.parametrize(
    "query,word",
    [
        (" ".join(f"w{i}" for i in range(17)), "words or phrases"),
        (" ".join(f"ab{i}*" for i in range(5)), "prefixes"),
    ],
)
def test_a_search_over_the_term_caps_is_refused_with_the_limit(store, query, word):
    _fill(store, A, 1)
    with pytest.raises(InputError) as e:
        store.search(A, query)
    assert word in str(e.value) and "limit" in str(e.value)
    assert len(store.search(A, "bike")) == 1, "the store still answers"


def test_a_runaway_search_is_stopped_with_a_clear_message(store, monkeypatch):
    """The clock is past the deadline at the first look: the search stops, says why, and the next
    one runs as usual (the handler is gone)."""
    _fill(store, A, 200)
    ticks = iter(range(0, 10**9, 10))
    monkeypatch.setattr(search, "_PROGRESS_STEPS", 1, raising=False)
    monkeypatch.setattr(search, "_clock", lambda: float(next(ticks)), raising=False)
    with pytest.raises(InputError) as e:
        store.search(A, "b* OR t*")
    assert "stopped" in str(e.value) and f"{search.SEARCH_TIME_S:g} s" in str(e.value)
    monkeypatch.undo()
    assert len(store.search(A, "bike")) == 20


def test_every_fixture_migrates_to_tagged_turns_and_a_sound_index(tmp_path: Path):
    """The earlier releases' databases open; each turn carries its owner's tag, the index passes
    FTS5's integrity check, and each owner's search finds their own turns only."""
    for name in ("schema1", "schema2", "schema3"):
        path = tmp_path / f"{name}.sqlite3"
        shutil.copy(REPO / "tests" / "fixtures" / f"{name}.sqlite3", path)
        with Store(path) as s:
            rows = s._db.execute(
                "SELECT t.owner_tag, c.owner FROM turns t JOIN conversations c ON c.id = t.conversation_id"
            ).fetchall()
            assert rows and all(tag == search.owner_tag(owner) for tag, owner in rows), name
            s._db.execute("INSERT INTO turns_fts(turns_fts) VALUES ('integrity-check')")
            for owner in {o for _, o in rows}:
                conv = s.list_conversations(owner)[0].id
                word = s.get(owner, conv).turns[0].user.split()[0]
                assert {h.conversation_id for h in s.search(owner, f'"{word}"')} <= {
                    c.id for c in s.list_conversations(owner)
                }


def test_a_turn_without_its_owners_tag_is_refused(store):
    conv = store.create_conversation(A)
    with pytest.raises(Exception, match="owner"):
        with store._write() as db:
            db.execute(
                "INSERT INTO turns (conversation_id, idx, user, assistant, created, owner_tag) "
                "VALUES (?, 0, 'x', 'y', 0, ?)",
                (conv, search.owner_tag(B)),
            )
