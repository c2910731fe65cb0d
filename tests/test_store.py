"""Store: real SQLite files in tmp_path. Round-trips, reopen, hostile text, threads, kill -9."""

from __future__ import annotations

import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from llmweb.errors import ConfigError, InputError, LlmwebError
from llmweb.records import Turn
from llmweb.store import (
    DEFAULT_TITLE,
    SCHEMA_VERSION,
    Conversation,
    ConversationInfo,
    Fact,
    NotFound,
    Store,
    StoredTurn,
    auto_title,
)

REPO = Path(__file__).resolve().parent.parent

HOSTILE = [
    "emoji 😀👩‍👩‍👧‍👦🏳️‍🌈 and a flag 🇺🇦",
    "עברית ומילים בערבית: مرحبا بالعالم \u200f\u202e reversed \u202c",
    "control \x00 NUL \x01\x07\x08\x1b[31m ansi \x7f tab\t cr\r lf\n end",
    "\x00",
    "",
    "'; DROP TABLE turns; -- \" ` \\ %s ? :name",
    "\ufeffBOM and \U0010ffff last plane",
]


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "data" / "llmweb.sqlite3"


@pytest.fixture
def store(db_path: Path):
    s = Store(db_path)
    yield s
    s.close()


def test_fresh_store_has_pragmas_and_schema(store: Store, db_path: Path):
    assert db_path.exists()
    assert store.schema_version() == SCHEMA_VERSION
    raw = sqlite3.connect(db_path)
    assert raw.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert {r[0] for r in raw.execute("SELECT name FROM sqlite_master WHERE type='table'")} >= {
        "conversations", "turns", "facts", "schema_version"}
    raw.close()
    assert store._db.execute("PRAGMA foreign_keys").fetchone()[0] == 1
    assert store._db.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL


def test_reopen_does_not_remigrate_and_newer_schema_is_refused(db_path: Path):
    Store(db_path).close()
    with Store(db_path) as s:
        assert s.schema_version() == SCHEMA_VERSION
        cid = s.create_conversation()
    raw = sqlite3.connect(db_path)
    assert raw.execute("SELECT COUNT(*) FROM schema_version").fetchone()[0] == 1
    raw.execute("UPDATE schema_version SET version = ?", (SCHEMA_VERSION + 1,))
    raw.commit()
    raw.close()
    with pytest.raises(ConfigError, match="newer llmweb"):
        Store(db_path)
    raw = sqlite3.connect(db_path)  # nothing was touched
    assert raw.execute("SELECT id FROM conversations").fetchall() == [(cid,)]
    raw.close()


def test_create_list_get(store: Store):
    a = store.create_conversation()
    time.sleep(0.01)
    b = store.create_conversation("Second")
    assert len(a) == 32 and int(a, 16) >= 0 and a != b
    listed = store.list_conversations()
    assert all(isinstance(c, ConversationInfo) for c in listed)
    assert [c.id for c in listed] == [b, a]  # newest first
    assert [(c.title, c.n_turns) for c in listed] == [("Second", 0), (DEFAULT_TITLE, 0)]
    conv = store.get(a)
    assert isinstance(conv, Conversation)
    assert (conv.id, conv.title, conv.summary, conv.summarized_upto, conv.turns, conv.facts) == (
        a, DEFAULT_TITLE, "", 0, [], [])


def test_add_turn_orders_and_bumps_list(store: Store):
    a = store.create_conversation()
    b = store.create_conversation()
    stats = {"prompt_tokens": 120, "ttft_ms": 12.5, "sections": {"history": 40}, "reused": True}
    sources = [{"source": "notes.md", "page": None, "heading": "Intro", "score": 0.71}]
    assert store.add_turn(a, "hi", "hello", stats, sources) == 0
    assert store.add_turn(a, "second", "answer 2", {}, []) == 1
    conv = store.get(a)
    assert conv.turns == [
        StoredTurn(0, "hi", "hello", stats, sources, conv.turns[0].created),
        StoredTurn(1, "second", "answer 2", {}, [], conv.turns[1].created),
    ]
    assert conv.turns[0].as_turn() == Turn("hi", "hello")
    assert [c.id for c in store.list_conversations()] == [a, b]  # activity moves a to the top
    assert {c.id: c.n_turns for c in store.list_conversations()} == {a: 2, b: 0}
    assert store.get(b).turns == []


def test_auto_title(store: Store):
    a = store.create_conversation()
    store.add_turn(a, "  How do I\n\tbake   bread at home without a stand mixer or a bread machine?", "...", {}, [])
    title = store.get(a).title
    assert title.startswith("How do I bake bread at home") and title.endswith("…")
    assert len(title) <= 41 and "\n" not in title
    store.add_turn(a, "another", "x", {}, [])
    assert store.get(a).title == title  # only the first message titles

    named = store.create_conversation("My title")
    store.add_turn(named, "something else", "x", {}, [])
    assert store.get(named).title == "My title"

    blank = store.create_conversation()
    store.add_turn(blank, " \x00\n ", "x", {}, [])
    assert store.get(blank).title == DEFAULT_TITLE

    assert auto_title("short one") == "short one"
    assert auto_title("a\x00b\x1bc") == "a b c"
    assert auto_title("x" * 100) == "x" * 40 + "…"


def test_summary(store: Store):
    a = store.create_conversation()
    for i in range(4):
        store.add_turn(a, f"u{i}", f"a{i}", {}, [])
    before = store.list_conversations()[0].updated
    store.set_summary(a, "They talked about u0..u2.", 3)
    conv = store.get(a)
    assert (conv.summary, conv.summarized_upto, len(conv.turns)) == ("They talked about u0..u2.", 3, 4)
    assert store.list_conversations()[0].updated == before  # compression is not activity
    with pytest.raises(ValueError):
        store.set_summary(a, "too far", 5)
    with pytest.raises(ValueError):
        store.set_summary(a, "negative", -1)
    assert store.get(a).summarized_upto == 3


def test_rename_delete_and_missing(store: Store):
    a = store.create_conversation()
    b = store.create_conversation()
    store.add_turn(a, "u", "a", {}, [])
    fid = store.add_fact(a, "likes tea")
    store.rename(a, "Renamed ✓")
    assert store.get(a).title == "Renamed ✓"
    assert store.delete(a) is True
    assert store.delete(a) is False
    assert [c.id for c in store.list_conversations()] == [b]
    # cascade: no orphan rows left behind
    assert store._db.execute("SELECT COUNT(*) FROM turns").fetchone()[0] == 0
    assert store._db.execute("SELECT COUNT(*) FROM facts").fetchone()[0] == 0
    assert store.delete_fact(fid) is False
    for call in (lambda: store.get(a), lambda: store.add_turn(a, "u", "a", {}, []),
                 lambda: store.rename(a, "x"), lambda: store.set_summary(a, "s", 0),
                 lambda: store.add_fact(a, "f"), lambda: store.facts(a),
                 lambda: store.export_json(a), lambda: store.export_markdown(a),
                 lambda: store.set_fact_pinned(fid, False)):
        with pytest.raises(NotFound) as info:
            call()
        assert isinstance(info.value, LookupError) and isinstance(info.value, LlmwebError)
        assert str(info.value)  # a message for the user


def test_facts_crud(store: Store):
    a = store.create_conversation()
    b = store.create_conversation()
    f1 = store.add_fact(a, "name is Ada")
    f2 = store.add_fact(a, "prefers metric", pinned=False)
    f3 = store.add_fact(b, "other conversation")
    assert [(f.id, f.text, f.pinned) for f in store.facts(a)] == [(f1, "name is Ada", True), (f2, "prefers metric", False)]
    assert all(isinstance(f, Fact) for f in store.facts(a))
    store.set_fact_pinned(f1, False)
    store.set_fact_pinned(f2, True)
    assert [(f.id, f.pinned) for f in store.facts(a)] == [(f1, False), (f2, True)]
    assert store.delete_fact(f1) is True
    assert [f.id for f in store.facts(a)] == [f2]
    assert [f.id for f in store.get(a).facts] == [f2]
    assert [f.id for f in store.facts(b)] == [f3]
    with pytest.raises(NotFound):
        store.set_fact_pinned(f1, True)


def test_reopen_shows_everything(db_path: Path):
    with Store(db_path) as s:
        a = s.create_conversation()
        b = s.create_conversation("kept")
        for i in range(3):
            s.add_turn(a, f"user {i}", f"assistant {i}", {"i": i}, [{"source": f"f{i}.txt"}])
        s.set_summary(a, "summary", 2)
        fid = s.add_fact(a, "fact")
        s.set_fact_pinned(fid, False)
        s.rename(b, "kept too")
        expected = (s.list_conversations(), s.get(a), s.get(b))
    with Store(db_path) as s2:
        assert (s2.list_conversations(), s2.get(a), s2.get(b)) == expected
        assert s2.get(a).turns[2].stats == {"i": 2}
        assert s2.get(a).facts[0].pinned is False


def test_hostile_text_round_trips_exactly(db_path: Path):
    big = ("0123456789abcdef" * 65536)[: 1 << 20] + "😀\x00end"  # > 1 MB, NUL near the end
    texts = HOSTILE + [big]
    with Store(db_path) as s:
        cid = s.create_conversation(title=HOSTILE[2])
        for t in texts:
            s.add_turn(cid, t, t[::-1], {"echo": t}, [{"source": t, "heading": t}])
        s.set_summary(cid, HOSTILE[1] + HOSTILE[2], 1)
        s.add_fact(cid, HOSTILE[3] + HOSTILE[0])
    with Store(db_path) as s:
        conv = s.get(cid)
        assert conv.title == HOSTILE[2]
        assert conv.summary == HOSTILE[1] + HOSTILE[2]
        assert conv.facts[0].text == HOSTILE[3] + HOSTILE[0]
        assert len(conv.turns) == len(texts)
        for t, got in zip(texts, conv.turns):
            assert got.user == t and got.assistant == t[::-1]
            assert got.stats == {"echo": t} and got.sources == [{"source": t, "heading": t}]
        assert len(conv.turns[-1].user) == len(big)
        # and through the JSON export too
        doc = json.loads(s.export_json(cid))
        assert [t["user"] for t in doc["turns"]] == texts


def test_unstorable_text_is_a_clear_error_and_changes_nothing(store: Store):
    cid = store.create_conversation()
    with pytest.raises(InputError):
        store.add_turn(cid, "lone surrogate \ud800", "a", {}, [])
    assert store.get(cid).turns == []
    assert store.get(cid).title == DEFAULT_TITLE
    # a surrogate-escaped file name inside sources is still storable (JSON escapes it)
    store.add_turn(cid, "u", "a", {}, [{"source": "bad\udcffname.txt"}])
    assert store.get(cid).turns[0].sources == [{"source": "bad\udcffname.txt"}]
    with pytest.raises(TypeError):  # not JSON: refused before anything is written
        store.add_turn(cid, "u", "a", {"path": Path("x")}, [])
    assert len(store.get(cid).turns) == 1


def _sample(store: Store) -> str:
    cid = store.create_conversation()
    store.add_turn(cid, "What is **WAL**?", "Write-ahead logging.\n\n- point one",
                   {"prompt_tokens": 10, "tok_s": 31.5}, [{"source": "sqlite.md", "heading": "WAL", "score": 0.9}])
    store.add_turn(cid, "And 🐍 in עברית?", "שלום 🐍", {"prompt_tokens": 22}, [])
    store.add_turn(cid, "third question", "third answer", {}, [{"source": "doc.pdf", "page": 3}])
    store.set_summary(cid, "Asked about WAL.", 1)
    store.add_fact(cid, "user writes Hebrew")
    store.add_fact(cid, "unpinned note", pinned=False)
    return cid


def test_export_markdown_contains_every_turn(store: Store):
    cid = _sample(store)
    md = store.export_markdown(cid)
    conv = store.get(cid)
    assert md.startswith(f"# {conv.title}\n")
    pos = -1
    for t in conv.turns:  # every turn, in order
        for text in (t.user, t.assistant):
            found = md.find(text, pos + 1)
            assert found > pos, text
            pos = found
    assert "Asked about WAL." in md and "user writes Hebrew" in md and "unpinned note" not in md
    assert "sqlite.md, WAL" in md and "doc.pdf, p. 3" in md
    assert md.count("## Turn ") == 3


def test_export_json_round_trips(db_path: Path, tmp_path: Path):
    with Store(db_path) as s:
        cid = _sample(s)
        text = s.export_json(cid)
        conv = s.get(cid)
    doc = json.loads(text)
    assert doc["summary"] == "Asked about WAL." and doc["summarized_upto"] == 1
    assert [(t["user"], t["assistant"], t["stats"], t["sources"]) for t in doc["turns"]] == [
        (t.user, t.assistant, t.stats, t.sources) for t in conv.turns]
    with Store(tmp_path / "other.sqlite3") as other:
        new_id = other.import_json(text)
        assert new_id != cid
        back = other.get(new_id)
        assert (back.title, back.summary, back.summarized_upto, back.turns, back.created, back.updated) == (
            conv.title, conv.summary, conv.summarized_upto, conv.turns, conv.created, conv.updated)
        assert [(f.text, f.pinned) for f in back.facts] == [(f.text, f.pinned) for f in conv.facts]
        again = json.loads(other.export_json(new_id))
    doc.pop("id"), again.pop("id")
    assert again == doc


@pytest.mark.parametrize("bad", ["not json", "[]", '{"format": "other"}',
                                 '{"format": "llmweb.conversation", "version": 1}'])
def test_import_rejects_garbage(store: Store, bad: str):
    with pytest.raises(InputError):
        store.import_json(bad)
    assert store.list_conversations() == []


def test_concurrent_add_turn_loses_nothing(store: Store):
    shared = store.create_conversation()
    own = [store.create_conversation() for _ in range(8)]
    n = 25
    errors: list[BaseException] = []
    start = threading.Barrier(8)

    def work(k: int) -> None:
        try:
            start.wait()
            for i in range(n):
                store.add_turn(shared, f"t{k}-{i}", f"a{k}-{i}", {"k": k, "i": i}, [])
                store.add_turn(own[k], f"t{k}-{i}", f"a{k}-{i}", {}, [])
                store.list_conversations()  # readers interleaved with writers
                store.get(shared)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    turns = store.get(shared).turns
    assert [t.idx for t in turns] == list(range(8 * n))
    assert sorted(t.user for t in turns) == sorted(f"t{k}-{i}" for k in range(8) for i in range(n))
    for k in range(8):  # each thread's own turns kept its order
        mine = [t.stats["i"] for t in turns if t.stats["k"] == k]
        assert mine == list(range(n))
        assert [t.user for t in store.get(own[k]).turns] == [f"t{k}-{i}" for i in range(n)]


_CHILD = r"""
import sys
from pathlib import Path
from llmweb.store import Store

def turn(i):
    pad = ("%06d" % i) * 20000  # ~120 KB per message, so kills often land mid-write
    return ("user %d " % i) + pad, ("assistant %d " % i) + pad, {"i": i, "len": len(pad)}, [{"source": "f%d" % i}]

store = Store(Path(sys.argv[1]))
cid = store.create_conversation("kill test")
for i in range(5):
    assert store.add_turn(cid, *turn(i)) == i
print("ready", cid, flush=True)
i = 5
while True:
    assert store.add_turn(cid, *turn(i)) == i
    print("wrote", i, flush=True)  # printed only after the commit returned
    i += 1
"""


def _turn_recipe():
    ns: dict = {}
    exec(_CHILD.split("store = Store")[0], ns)  # the child's own turn() recipe
    return ns["turn"]


@pytest.mark.parametrize("round_", range(3))  # each kill lands at a different moment
def test_kill_9_loses_at_most_the_unfinished_turn(db_path: Path, round_: int):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(db_path)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = child.stdout.readline()
        assert line.startswith("ready"), (line, child.stderr.read() if child.poll() is not None else "")
        cid = line.split()[1]
        while not line.startswith("wrote 7"):  # it is in its write loop now
            line = child.stdout.readline()
            assert line, child.stderr.read()
        time.sleep(random.uniform(0, 0.05))
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=10)
        rest = child.stdout.read()
        child.stdout.close()
        child.stderr.close()
    assert child.returncode == -signal.SIGKILL
    reported = max([7] + [int(ln.split()[1]) for ln in rest.splitlines() if ln.startswith("wrote ")])

    raw = sqlite3.connect(db_path)
    assert raw.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
    assert raw.execute("PRAGMA foreign_key_check").fetchall() == []
    raw.close()

    turn = _turn_recipe()
    with Store(db_path) as s:
        conv = s.get(cid)
        assert [t.idx for t in conv.turns] == list(range(len(conv.turns)))
        # every turn the child saw committed is there; at most the one in flight beyond it
        assert reported + 1 <= len(conv.turns) <= reported + 2
        for t in conv.turns:  # and every row is complete
            user, assistant, stats, sources = turn(t.idx)
            assert (t.user, t.assistant, t.stats, t.sources) == (user, assistant, stats, sources), t.idx
        assert s.list_conversations()[0].n_turns == len(conv.turns)
        assert s.add_turn(cid, "after", "restart", {}, []) == len(conv.turns)  # still writable
