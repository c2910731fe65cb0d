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
from llmweb.records import GenerationStats, MemorySnapshot, Source, Turn, TurnStats
from llmweb.store.conversations import auto_title
from llmweb.store.db import Store
from llmweb.store.models import (
    DEFAULT_TITLE,
    MAX_TITLE_CHARS,
    Conversation,
    ConversationInfo,
    Fact,
    NotFound,
    StoredTurn,
    new_id,
)
from llmweb.store.schema import SCHEMA_VERSION

REPO = Path(__file__).resolve().parents[2]
A = "anon:alice-token"  # the owner of everything in these tests, unless a test says otherwise
B = "user:bob"

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
        "conversations",
        "turns",
        "facts",
        "schema_version",
    }
    raw.close()
    assert store._db.execute("PRAGMA foreign_keys").fetchone()[0] == 1
    assert store._db.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL


def test_reopen_does_not_remigrate_and_newer_schema_is_refused(db_path: Path):
    Store(db_path).close()
    with Store(db_path) as s:
        assert s.schema_version() == SCHEMA_VERSION
        cid = s.create_conversation(A)
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
    a = store.create_conversation(A)
    time.sleep(0.01)
    b = store.create_conversation(A, "Second")
    assert len(a) == 32 and int(a, 16) >= 0 and a != b
    listed = store.list_conversations(A)
    assert all(isinstance(c, ConversationInfo) for c in listed)
    assert [c.id for c in listed] == [b, a]  # newest first
    assert [(c.title, c.n_turns) for c in listed] == [("Second", 0), (DEFAULT_TITLE, 0)]
    conv = store.get(A, a)
    assert isinstance(conv, Conversation)
    assert (conv.id, conv.title, conv.summary, conv.summarized_upto, conv.turns, conv.facts) == (
        a,
        DEFAULT_TITLE,
        "",
        0,
        [],
        [],
    )


def test_add_turn_orders_and_bumps_list(store: Store):
    a = store.create_conversation(A)
    b = store.create_conversation(A)
    stats = TurnStats(
        turn=1,
        gen=GenerationStats(prompt_tokens=120, ttft_s=0.0125, reused_tokens=80, finish_reason="eos", oom_retry=True),
        sections={"history": 40},
        context_limit=4096,
        dropped_facts=1,
    )
    sources = (Source(1, "notes.md", None, "Intro", 0.71, "document", "the intro"), Source(2, "turn 3", kind="recall"))
    assert store.add_turn(A, a, "hi", "hello", stats, sources) == 0
    assert store.add_turn(A, a, "second", "answer 2") == 1  # no figures, no sources
    conv = store.get(A, a)
    assert conv.turns == [
        StoredTurn(0, "hi", "hello", stats, list(sources), conv.turns[0].created),
        StoredTurn(1, "second", "answer 2", None, [], conv.turns[1].created),
    ]
    assert isinstance(conv.turns[0].stats, TurnStats) and conv.turns[0].stats.gen.ttft_s == 0.0125
    assert all(isinstance(x, Source) for x in conv.turns[0].sources)
    assert conv.turns[0].as_turn() == Turn("hi", "hello")
    assert [c.id for c in store.list_conversations(A)] == [a, b]  # activity moves a to the top
    assert {c.id: c.n_turns for c in store.list_conversations(A)} == {a: 2, b: 0}
    assert store.get(A, b).turns == []


def test_auto_title(store: Store):
    a = store.create_conversation(A)
    store.add_turn(
        A, a, "  How do I\n\tbake   bread at home without a stand mixer or a bread machine?", "...", None, ()
    )
    title = store.get(A, a).title
    assert title.startswith("How do I bake bread at home") and title.endswith("…")
    assert len(title) <= 41 and "\n" not in title
    store.add_turn(A, a, "another", "x", None, ())
    assert store.get(A, a).title == title  # only the first message titles

    named = store.create_conversation(A, "My title")
    store.add_turn(A, named, "something else", "x", None, ())
    assert store.get(A, named).title == "My title"

    blank = store.create_conversation(A)
    store.add_turn(A, blank, " \x00\n ", "x", None, ())
    assert store.get(A, blank).title == DEFAULT_TITLE

    assert auto_title("short one") == "short one"
    assert auto_title("a\x00b\x1bc") == "a b c"
    assert auto_title("x" * 100) == "x" * 40 + "…"


def test_summary(store: Store):
    a = store.create_conversation(A)
    for i in range(4):
        store.add_turn(A, a, f"u{i}", f"a{i}", None, ())
    before = store.list_conversations(A)[0].updated
    store.set_summary(A, a, "They talked about u0..u2.", 3)
    conv = store.get(A, a)
    assert (conv.summary, conv.summarized_upto, len(conv.turns)) == ("They talked about u0..u2.", 3, 4)
    assert store.list_conversations(A)[0].updated == before  # compression is not activity
    with pytest.raises(ValueError):
        store.set_summary(A, a, "too far", 5)
    with pytest.raises(ValueError):
        store.set_summary(A, a, "negative", -1)
    assert store.get(A, a).summarized_upto == 3


def test_rename_cleans_the_title_refuses_bad_ones_and_keeps_the_list_order(store: Store):
    a = store.create_conversation(A)
    store.add_turn(A, a, "first", "a")
    b = store.create_conversation(A)
    store.add_turn(A, b, "second", "a")
    assert store.rename(A, a, "\tTrip\x00 to\n\n  Jeju 🍊 ") == "Trip to Jeju 🍊"
    assert [(c.id, c.title) for c in store.list_conversations(A)] == [(b, "second"), (a, "Trip to Jeju 🍊")]
    for bad in ("", " \n\t", "\x00", "y" * (MAX_TITLE_CHARS + 1), None):
        with pytest.raises(InputError):
            store.rename(A, a, bad)  # type: ignore[arg-type]
    assert store.get(A, a).title == "Trip to Jeju 🍊", "a refused title changes nothing"
    with pytest.raises(NotFound):
        store.rename(B, a, "stolen")
    assert store.get(A, a).title == "Trip to Jeju 🍊"


def test_rename_delete_and_missing(store: Store):
    a = store.create_conversation(A)
    b = store.create_conversation(A)
    store.add_turn(A, a, "u", "a", None, ())
    fid = store.add_fact(A, a, "likes tea")
    store.rename(A, a, "Renamed ✓")
    assert store.get(A, a).title == "Renamed ✓"
    assert store.delete(A, a) is True
    assert store.delete(A, a) is False
    assert [c.id for c in store.list_conversations(A)] == [b]
    # cascade: no orphan rows left behind
    assert store._db.execute("SELECT COUNT(*) FROM turns").fetchone()[0] == 0
    assert store._db.execute("SELECT COUNT(*) FROM facts").fetchone()[0] == 0
    assert store.delete_fact(A, a, fid) is False
    for call in (
        lambda: store.get(A, a),
        lambda: store.add_turn(A, a, "u", "a", None, ()),
        lambda: store.rename(A, a, "x"),
        lambda: store.set_summary(A, a, "s", 0),
        lambda: store.add_fact(A, a, "f"),
        lambda: store.facts(A, a),
        lambda: store.export_json(A, a),
        lambda: store.export_markdown(A, a),
        lambda: store.set_fact_pinned(A, a, fid, False),
    ):
        with pytest.raises(NotFound) as info:
            call()
        assert isinstance(info.value, LookupError) and isinstance(info.value, LlmwebError)
        assert str(info.value)  # a message for the user


def test_facts_crud(store: Store):
    a = store.create_conversation(A)
    b = store.create_conversation(A)
    f1 = store.add_fact(A, a, "name is Ada")
    f2 = store.add_fact(A, a, "prefers metric", pinned=False)
    f3 = store.add_fact(A, b, "other conversation")
    assert [(f.id, f.text, f.pinned) for f in store.facts(A, a)] == [
        (f1, "name is Ada", True),
        (f2, "prefers metric", False),
    ]
    assert all(isinstance(f, Fact) for f in store.facts(A, a))
    store.set_fact_pinned(A, a, f1, False)
    store.set_fact_pinned(A, a, f2, True)
    assert [(f.id, f.pinned) for f in store.facts(A, a)] == [(f1, False), (f2, True)]
    assert store.delete_fact(A, a, f1) is True
    assert [f.id for f in store.facts(A, a)] == [f2]
    assert [f.id for f in store.get(A, a).facts] == [f2]
    assert [f.id for f in store.facts(A, b)] == [f3]
    with pytest.raises(NotFound):
        store.set_fact_pinned(A, a, f1, True)


def test_reopen_shows_everything(db_path: Path):
    with Store(db_path) as s:
        a = s.create_conversation(A)
        b = s.create_conversation(A, "kept")
        for i in range(3):
            s.add_turn(
                A,
                a,
                f"user {i}",
                f"assistant {i}",
                TurnStats(turn=i + 1, gen=GenerationStats(generated_tokens=i)),
                [Source(1, f"f{i}.txt")],
            )
        s.set_summary(A, a, "summary", 2)
        fid = s.add_fact(A, a, "fact")
        s.set_fact_pinned(A, a, fid, False)
        s.rename(A, b, "kept too")
        expected = (s.list_conversations(A), s.get(A, a), s.get(A, b))
    with Store(db_path) as s2:
        assert (s2.list_conversations(A), s2.get(A, a), s2.get(A, b)) == expected
        assert s2.get(A, a).turns[2].stats == TurnStats(turn=3, gen=GenerationStats(generated_tokens=2))
        assert s2.get(A, a).turns[2].sources == [Source(1, "f2.txt")]
        assert s2.get(A, a).facts[0].pinned is False


def _echo_stats(t: str) -> TurnStats:
    """Figures carrying `t` in every string the stats hold: the finish reason and a section name."""
    return TurnStats(turn=1, gen=GenerationStats(finish_reason=t), sections={t: len(t)})


def test_hostile_text_round_trips_exactly(db_path: Path):
    big = ("0123456789abcdef" * 65536)[: 1 << 20] + "😀\x00end"  # > 1 MB, NUL near the end
    texts = HOSTILE + [big]
    with Store(db_path) as s:
        cid = s.create_conversation(A, title=HOSTILE[2])
        for t in texts:
            s.add_turn(A, cid, t, t[::-1], _echo_stats(t), [Source(1, t, heading=t, snippet=t)])
        s.set_summary(A, cid, HOSTILE[1] + HOSTILE[2], 1)
        s.add_fact(A, cid, HOSTILE[3] + HOSTILE[0])
    with Store(db_path) as s:
        conv = s.get(A, cid)
        assert conv.title == HOSTILE[2]
        assert conv.summary == HOSTILE[1] + HOSTILE[2]
        assert conv.facts[0].text == HOSTILE[3] + HOSTILE[0]
        assert len(conv.turns) == len(texts)
        for t, got in zip(texts, conv.turns):
            assert got.user == t and got.assistant == t[::-1]
            assert got.stats == _echo_stats(t) and got.sources == [Source(1, t, heading=t, snippet=t)]
        assert len(conv.turns[-1].user) == len(big)
        # and through the JSON export too
        doc = json.loads(s.export_json(A, cid))
        assert [t["user"] for t in doc["turns"]] == texts
        assert [t["sources"] for t in doc["turns"]] == [[Source(1, t, heading=t, snippet=t).to_dict()] for t in texts]
        assert [t["stats"] for t in doc["turns"]] == [_echo_stats(t).to_dict() for t in texts]


def test_unstorable_text_is_a_clear_error_and_changes_nothing(store: Store):
    cid = store.create_conversation(A)
    with pytest.raises(InputError):
        store.add_turn(A, cid, "lone surrogate \ud800", "a", None, ())
    assert store.get(A, cid).turns == []
    assert store.get(A, cid).title == DEFAULT_TITLE
    # a surrogate-escaped file name inside sources is still storable (JSON escapes it)
    bad = Source(1, "bad\udcffname.txt", heading="h\udc80", snippet="s\udcfe")
    store.add_turn(A, cid, "u", "a", None, [bad])
    assert store.get(A, cid).turns[0].sources == [bad]
    # not JSON: refused before anything is written
    with pytest.raises(TypeError):
        store.add_turn(A, cid, "u", "a", TurnStats(turn=2, gen=GenerationStats(), sections={Path("x"): 1}), ())
    with pytest.raises(TypeError):
        store.add_turn(A, cid, "u", "a", None, [Source(1, Path("x"))])
    assert len(store.get(A, cid).turns) == 1


def _sample(store: Store) -> str:
    cid = store.create_conversation(A)
    mem = MemorySnapshot(
        rss_bytes=5 << 20,
        peak_rss_bytes=6 << 20,
        cuda_allocated_bytes=700,
        cuda_reserved_bytes=900,
        cuda_peak_bytes=800,
        cuda_inactive_split_bytes=50,
        cuda_alloc_retries=0,
        cuda_ooms=0,
    )
    store.add_turn(
        A,
        cid,
        "What is **WAL**?",
        "Write-ahead logging.\n\n- point one",
        TurnStats(
            turn=1,
            gen=GenerationStats(prompt_tokens=10, generated_tokens=7, decode_tok_s=31.5, finish_reason="eos", mem=mem),
            sections={"system": 4, "retrieved": 6},
            context_limit=4096,
        ),
        [Source(1, "sqlite.md", heading="WAL", score=0.9, snippet="WAL is …")],
    )
    store.add_turn(
        A,
        cid,
        "And 🐍 in עברית?",
        "שלום 🐍",
        TurnStats(
            turn=2,
            gen=GenerationStats(prompt_tokens=22, finish_reason="cancelled"),
            summarized_turns=1,
            summary_tokens=5,
            dropped_turns=1,
            dropped_chunks=2,
        ),
        (),
    )
    store.add_turn(
        A,
        cid,
        "third question",
        "third answer",
        None,
        [Source(1, "doc.pdf", page=3), Source(2, "turn 1", kind="recall", score=0.25)],
    )
    store.set_summary(A, cid, "Asked about WAL.", 1)
    store.add_fact(A, cid, "user writes Hebrew")
    store.add_fact(A, cid, "unpinned note", pinned=False)
    return cid


def test_export_markdown_contains_every_turn(store: Store):
    cid = _sample(store)
    md = store.export_markdown(A, cid)
    conv = store.get(A, cid)
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
        text = s.export_json(A, cid)
        conv = s.get(A, cid)
    doc = json.loads(text)
    assert doc["summary"] == "Asked about WAL." and doc["summarized_upto"] == 1
    assert [(t["user"], t["assistant"], t["stats"], t["sources"]) for t in doc["turns"]] == [
        (t.user, t.assistant, t.stats.to_dict() if t.stats else {}, [s.to_dict() for s in t.sources])
        for t in conv.turns
    ]
    assert doc["turns"][0]["stats"]["mem"]["cuda_fragmentation_bytes"] == 200
    assert doc["turns"][2]["stats"] == {}  # stored without figures
    with Store(tmp_path / "other.sqlite3") as other:
        new_id = other.import_json(A, text)
        assert new_id != cid
        back = other.get(A, new_id)
        assert (back.title, back.summary, back.summarized_upto, back.turns, back.created, back.updated) == (
            conv.title,
            conv.summary,
            conv.summarized_upto,
            conv.turns,
            conv.created,
            conv.updated,
        )
        assert back.turns[2].stats is None and back.turns[0].stats.gen.mem.cuda_inactive_split_bytes == 50
        assert [(f.text, f.pinned) for f in back.facts] == [(f.text, f.pinned) for f in conv.facts]
        again = json.loads(other.export_json(A, new_id))
    doc.pop("id"), again.pop("id")
    assert again == doc


@pytest.mark.parametrize(
    "bad", ["not json", "[]", '{"format": "other"}', '{"format": "llmweb.conversation", "version": 1}']
)
def test_import_rejects_garbage(store: Store, bad: str):
    with pytest.raises(InputError):
        store.import_json(A, bad)
    assert store.list_conversations(A) == []


@pytest.mark.parametrize(
    "field,value",
    [
        ("sources", [{"source": "no number.md"}]),  # a source needs n and source
        ("sources", [{"n": 1}]),
        ("sources", ["notes.md"]),
        ("stats", []),
        ("stats", "eos"),
    ],
)
def test_import_rejects_malformed_sources_and_stats(store: Store, field: str, value):
    doc = json.loads(store.export_json(A, _sample(store)))
    before = store.list_conversations(A)
    doc["turns"][0][field] = value
    with pytest.raises(InputError):
        store.import_json(A, json.dumps(doc))
    assert store.list_conversations(A) == before


def test_import_reads_older_stats_with_defaults(store: Store):
    """Rows written before TurnStats had every field (or by hand) still load: missing figures take
    their defaults and unknown keys are ignored."""
    doc = json.loads(store.export_json(A, _sample(store)))
    doc["turns"][0]["stats"] = {
        "turn": 1,
        "finish_reason": "eos",
        "prompt_tokens": 12,
        "ttft_ms": 5,
        "sections": {"history": 3},
    }
    back = store.get(A, store.import_json(A, json.dumps(doc)))
    assert back.turns[0].stats == TurnStats(
        turn=1, gen=GenerationStats(prompt_tokens=12, finish_reason="eos"), sections={"history": 3}
    )


def test_concurrent_add_turn_loses_nothing(store: Store):
    shared = store.create_conversation(A)
    own = [store.create_conversation(A) for _ in range(8)]
    n = 25
    errors: list[BaseException] = []
    start = threading.Barrier(8)

    def work(k: int) -> None:
        try:
            start.wait()
            for i in range(n):
                store.add_turn(
                    A, shared, f"t{k}-{i}", f"a{k}-{i}", TurnStats(turn=i, gen=GenerationStats(prompt_tokens=k))
                )
                store.add_turn(A, own[k], f"t{k}-{i}", f"a{k}-{i}", None, ())
                store.list_conversations(A)  # readers interleaved with writers
                store.get(A, shared)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    turns = store.get(A, shared).turns
    assert [t.idx for t in turns] == list(range(8 * n))
    assert sorted(t.user for t in turns) == sorted(f"t{k}-{i}" for k in range(8) for i in range(n))
    for k in range(8):  # each thread's own turns kept its order
        mine = [t.stats.turn for t in turns if t.stats.gen.prompt_tokens == k]
        assert mine == list(range(n))
        assert [t.user for t in store.get(A, own[k]).turns] == [f"t{k}-{i}" for i in range(n)]


_CHILD = r"""
import sys
from pathlib import Path
from llmweb.records import GenerationStats, Source, TurnStats
from llmweb.store.db import Store

A = "anon:alice-token"

def turn(i):
    pad = ("%06d" % i) * 20000  # ~120 KB per message, so kills often land mid-write
    stats = TurnStats(turn=i + 1, gen=GenerationStats(prompt_tokens=len(pad), generated_tokens=i))
    return ("user %d " % i) + pad, ("assistant %d " % i) + pad, stats, [Source(1, "f%d" % i)]

store = Store(Path(sys.argv[1]))
cid = store.create_conversation(A, "kill test")
for i in range(5):
    assert store.add_turn(A, cid, *turn(i)) == i
print("ready", cid, flush=True)
i = 5
while True:
    assert store.add_turn(A, cid, *turn(i)) == i
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
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(db_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
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
        conv = s.get(A, cid)
        assert [t.idx for t in conv.turns] == list(range(len(conv.turns)))
        # every turn the child saw committed is there; at most the one in flight beyond it
        assert reported + 1 <= len(conv.turns) <= reported + 2
        for t in conv.turns:  # and every row is complete
            user, assistant, stats, sources = turn(t.idx)
            assert (t.user, t.assistant, t.stats, t.sources) == (user, assistant, stats, sources), t.idx
        assert s.list_conversations(A)[0].n_turns == len(conv.turns)
        assert s.add_turn(A, cid, "after", "restart", None, ()) == len(conv.turns)  # still writable


# ---- owners: every read is scoped to the caller --------------------------------------------


def _public_methods():
    import inspect

    # no owner data in, or operator-only: the purge; a removed shared document's results, every owner's
    skip = {"close", "schema_version", "idle_owners", "delete_document_pieces_everywhere"}
    return [n for n, f in inspect.getmembers(Store, inspect.isfunction) if not n.startswith("_") and n not in skip]


def test_every_public_method_takes_the_owner_first():
    import inspect

    for name in _public_methods():
        params = list(inspect.signature(getattr(Store, name)).parameters)
        assert params[:2] == ["self", "owner"], f"Store.{name} must take the caller's owner first"


def test_another_owners_conversation_is_exactly_like_an_unknown_one(store: Store):
    a = new_id()
    store.add_turn(A, a, "my locker code is Zanzibar-7781", "noted", None, (), create=True)
    fid = store.add_fact(A, a, "my locker code is Zanzibar-7781")
    unknown = new_id()
    calls = {
        "get": lambda c: store.get(B, c),
        "add_turn": lambda c: store.add_turn(B, c, "u", "a", None, ()),
        "set_summary": lambda c: store.set_summary(B, c, "s", 0),
        "rename": lambda c: store.rename(B, c, "x"),
        "add_fact": lambda c: store.add_fact(B, c, "f"),
        "facts": lambda c: store.facts(B, c),
        "set_fact_pinned": lambda c: store.set_fact_pinned(B, c, fid, False),
        "export_json": lambda c: store.export_json(B, c),
        "export_markdown": lambda c: store.export_markdown(B, c),
    }
    for what, call in calls.items():
        errors = []
        for conv in (a, unknown):
            with pytest.raises(NotFound) as info:
                call(conv)
            errors.append(str(info.value).replace(conv[:8], "<id>"))
        assert errors[0] == errors[1], f"{what}: another owner's id must read like an unknown one"
    assert store.delete(B, a) is False and store.delete_fact(B, a, fid) is False
    assert store.exists(B, a) is False and store.exists(A, a) is True
    assert store.list_conversations(B) == []
    # and nothing of A's changed
    conv = store.get(A, a)
    assert [t.user for t in conv.turns] == ["my locker code is Zanzibar-7781"] and conv.facts[0].pinned
    with pytest.raises(NotFound):  # create=True cannot take over an id that exists for another owner
        store.add_turn(B, a, "u", "a", None, (), create=True)


def test_a_conversation_is_created_with_its_first_turn(store: Store):
    conv = new_id()
    assert store.list_conversations(A) == []
    assert store.add_turn(A, conv, "hello there", "hi", None, (), create=True) == 0
    assert [(c.id, c.title, c.n_turns) for c in store.list_conversations(A)] == [(conv, "hello there", 1)]
    assert len(conv) == 32 and conv != new_id()  # 128 random bits


def test_delete_owner_removes_everything_of_that_owner_only(store: Store):
    mine = [store.create_conversation(A) for _ in range(2)]
    theirs = store.create_conversation(B)
    store.add_fact(A, mine[0], "fact")
    assert sorted(store.delete_owner(A)) == sorted(mine)
    assert store.list_conversations(A) == [] and [c.id for c in store.list_conversations(B)] == [theirs]
    assert store._db.execute("SELECT COUNT(*) FROM facts").fetchone()[0] == 0


def test_a_write_begun_before_delete_all_commits_nothing_and_says_the_chat_was_deleted(store: Store):
    """Pressing "Delete all my data" bumps the owner's generation in its transaction; a turn,
    summary, fact or conversation write that read the older one (a reply or a fold in flight)
    commits nothing: `Deleted`, a `NotFound` with a sentence for the user."""
    from llmweb.store.models import Deleted

    conv = new_id()
    store.add_turn(A, conv, "my locker code is 4471", "noted", None, (), create=True)
    theirs = new_id()
    store.add_turn(B, theirs, "hello", "hi", None, (), create=True)
    before = store.get(A, conv).generation
    assert before == store.generation(A) == 0 and store.alive(A, conv, before)
    assert store.delete_owner(A) == [conv]
    assert store.generation(A) == before + 1 and not store.alive(A, conv, before)
    fresh = new_id()
    writes = {
        "first turn of a new chat": lambda: store.add_turn(
            A, fresh, "u", "a", None, (), create=True, generation=before
        ),
        "turn": lambda: store.add_turn(A, conv, "u", "a", None, (), generation=before),
        "regenerated reply": lambda: store.replace_last_reply(A, conv, 0, "a", generation=before),
        "edit": lambda: store.edit_turn(A, conv, 0, "u", "a", generation=before),
        "summary": lambda: store.set_summary(A, conv, "s", 1, generation=before),
        "fact": lambda: store.add_fact(A, conv, "f", pinned=False, generation=before),
        "conversation": lambda: store.create_conversation(A, generation=before),
    }
    for what, write in writes.items():
        with pytest.raises(Deleted, match="^This chat was deleted.$"):
            write()
        assert isinstance(Deleted("x"), NotFound), what
    assert store.list_conversations(A) == [] and not store.exists(A, fresh)
    counts = [store._db.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0] for t in ("turns", "facts", "versions")]
    assert counts == [1, 0, 0], "only B's turn is left"
    # B is untouched, and A may start again with the generation as it is now
    assert store.add_turn(B, theirs, "again", "yes", None, (), generation=store.generation(B)) == 1
    again = new_id()
    store.add_turn(A, again, "new start", "ok", None, (), create=True, generation=store.generation(A))
    assert [c.id for c in store.list_conversations(A)] == [again]
    assert store.delete_owner(A) == [again] and store.generation(A) == before + 2


@pytest.mark.parametrize("fixture", ["schema1", "schema2", "schema3"])
def test_every_old_database_migrates_to_owner_generations(tmp_path: Path, fixture: str):
    import shutil

    path = tmp_path / "old.sqlite3"
    shutil.copy(REPO / "tests" / "fixtures" / f"{fixture}.sqlite3", path)
    with Store(path) as s:
        assert s.schema_version() == SCHEMA_VERSION
        owners = [r[0] for r in s._db.execute("SELECT DISTINCT owner FROM conversations")]
        assert owners and all(s.generation(o) == 0 for o in owners)
        s.delete_owner(owners[0])
        assert s.generation(owners[0]) == 1 and s.list_conversations(owners[0]) == []


def test_idle_owners_lists_anonymous_owners_past_the_retention(store: Store):
    store.create_conversation("anon:old")
    store.create_conversation("anon:new")
    store.create_conversation("user:old-account")
    now = time.time()
    store._db.execute(
        "UPDATE owners SET last_seen = ? WHERE owner IN ('anon:old', 'user:old-account')", (now - 40 * 86400,)
    )
    assert store.idle_owners("anon:", 30 * 86400) == ["anon:old"], "accounts are never purged; recent visitors stay"
    store.touch_owner("anon:old")
    assert store.idle_owners("anon:", 30 * 86400) == []


def test_a_database_from_before_owners_opens_without_loss_for_the_local_owner(tmp_path: Path):
    """tests/fixtures/schema1.sqlite3 was written by the previous release's store (schema 1)."""
    import shutil

    from llmweb.records import LOCAL_OWNER

    path = tmp_path / "old.sqlite3"
    shutil.copy(REPO / "tests" / "fixtures" / "schema1.sqlite3", path)
    with Store(path) as s:
        assert s.schema_version() == SCHEMA_VERSION
        (info,) = s.list_conversations(LOCAL_OWNER)  # the empty "New chat" of schema 1 is gone
        conv = s.get(LOCAL_OWNER, info.id)
        assert [(t.user, t.assistant) for t in conv.turns] == [
            ("My locker code is Zanzibar-7781. Please remember it.", "I will remember it."),
            ("What is my locker code?", "Zanzibar-7781."),
        ]
        assert conv.turns[0].stats.gen.prompt_tokens == 60 and conv.turns[0].stats.sections["user"] == 30
        assert conv.turns[0].sources[0].label() == "llmweb-guide.md, Models"
        assert (conv.summary, conv.summarized_upto) == ("The user shared a locker code.", 1)
        assert [(f.text, f.pinned) for f in conv.facts] == [("My locker code is Zanzibar-7781.", True)]
        assert s.list_conversations("anon:someone-else") == []
        assert {h.idx for h in s.search(LOCAL_OWNER, "zanzibar")} == {0, 1}, "old turns are searchable"


def test_a_database_from_before_search_opens_without_loss_and_every_old_turn_is_searchable(tmp_path: Path):
    """tests/fixtures/schema2.sqlite3 was written by the previous release's store (schema 2: owners)."""
    import shutil

    path = tmp_path / "old.sqlite3"
    shutil.copy(REPO / "tests" / "fixtures" / "schema2.sqlite3", path)
    a, b = "anon:fixture-visitor-a", "user:fixture-b"
    with Store(path) as s:
        assert s.schema_version() == SCHEMA_VERSION
        (info,) = s.list_conversations(a)
        conv = s.get(a, info.id)
        assert [(t.user, t.assistant) for t in conv.turns] == [
            ("제 사물함 번호는 4471이에요. 기억해 주세요.", "네, 기억할게요."),
            ("Mein Hund heißt Bello.", "Ein schöner Name!"),
        ]
        assert conv.turns[1].sources[0].source == "notes.md"
        assert (conv.summary, conv.summarized_upto, info.title) == (
            "The user shared a locker number.",
            1,
            "제 사물함 번호는 4471이에요. 기억해 주세요.",
        )
        assert [f.text for f in conv.facts] == ["제 사물함 번호는 4471이에요."]
        assert [(h.conversation_id, h.idx) for h in s.search(a, "사물함")] == [(info.id, 0)]
        assert [h.idx for h in s.search(a, "bello")] == [1]
        assert s.search(a, "orion") == []
        assert [h.title for h in s.search(b, "orion")] == ["The launch code is Orion-42."]


def test_search_finds_the_owners_turn_and_never_another_owners(store: Store):
    mine = store.create_conversation(A)
    for u, r in [("Hello there", "Hi!"), ("My bike lock code is 5521", "Noted."), ("Plan a trip to Busan", "Day 1…")]:
        store.add_turn(A, mine, u, r)
    theirs = store.create_conversation(B)
    store.add_turn(B, theirs, "My bike is red", "Nice bike.")
    (hit,) = store.search(A, "bike")
    assert (hit.conversation_id, hit.idx) == (mine, 1)
    assert hit.snippet == "My \x02bike\x03 lock code is 5521"
    assert [h.idx for h in store.search(A, "day")] == [2], "replies are searched too"
    assert {h.idx for h in store.search(A, '"trip to busan" OR hello')} == {0, 2}
    assert [h.conversation_id for h in store.search(B, "bike")] == [theirs], "B sees only B's"
    assert store.search("anon:nobody", "bike") == []
    store.delete(A, mine)
    assert store.search(A, "bike") == [], "deleted turns leave the index (cascade)"
    copy = store.import_json(B, store.export_json(B, theirs))
    assert {h.conversation_id for h in store.search(B, "red")} == {theirs, copy}, "imported turns are indexed"
    store._db.execute("INSERT INTO turns_fts(turns_fts) VALUES ('integrity-check')")  # raises if out of step


def test_search_takes_pasted_codes_and_punctuation_as_phrases(store: Store):
    conv = store.create_conversation(A)
    store.add_turn(A, conv, "My locker code is Zanzibar-7781, e-mail me at a@b.example", "ok")
    store.add_turn(A, conv, "I write C++ and 제주도 여행?", "ok")
    for query, idx in (("Zanzibar-7781", 0), ("e-mail", 0), ("a@b.example", 0), ("C++", 1), ("여행?", 1), ("zanz*", 0)):
        assert [h.idx for h in store.search(A, query)] == [idx], query
    assert store.search(A, "nosuchcolumn:word") == [] and store.search(A, "*") == [] and store.search(A, "🙂") == []


@pytest.mark.parametrize("query", ['"unclosed', "AND", "bike OR", "(", "bike NOT", " ", "x" * 501])
def test_a_search_fts5_cannot_read_is_a_clear_input_error(store: Store, query: str):
    conv = store.create_conversation(A)
    store.add_turn(A, conv, "bike", "ok")
    with pytest.raises(InputError) as e:
        store.search(A, query)
    assert "search" in str(e.value).lower() and "Traceback" not in str(e.value)
    assert [h.idx for h in store.search(A, "bike")] == [0], "the store still answers"


def test_the_last_turn_can_be_replied_again_or_removed_until_it_is_folded(store: Store):
    conv = store.create_conversation(A)
    store.add_turn(A, conv, "q1", "old reply one")
    store.add_turn(A, conv, "q2", "old reply two")
    store.replace_last_reply(A, conv, 1, "new reply two", None, [Source(1, "x.md")])
    turns = store.get(A, conv).turns
    assert [t.assistant for t in turns] == ["old reply one", "new reply two"] and turns[1].sources[0].source == "x.md"
    assert [h.idx for h in store.search(A, "new")] == [1] and [h.idx for h in store.search(A, "two")] == [1]
    assert [h.idx for h in store.search(A, "old")] == [0], "the index follows the replaced reply"
    with pytest.raises(InputError, match="changed meanwhile"):
        store.replace_last_reply(A, conv, 0, "stale")  # turn 0 is no longer the last
    for call in (lambda: store.replace_last_reply(B, conv, 1, "x"), lambda: store.pop_last_turn(B, conv)):
        with pytest.raises(NotFound):
            call()
    assert store.pop_last_turn(A, conv).user == "q2"
    assert store.search(A, "new") == [] and [t.user for t in store.get(A, conv).turns] == ["q1"]
    store.set_summary(A, conv, "folded", 1)
    before = store.get(A, conv)
    for call in (lambda: store.pop_last_turn(A, conv), lambda: store.replace_last_reply(A, conv, 0, "x")):
        with pytest.raises(InputError, match="folded"):
            call()
    assert store.get(A, conv) == before
    store._db.execute("INSERT INTO turns_fts(turns_fts) VALUES ('integrity-check')")


def test_a_database_from_before_chat_settings_opens_without_loss(tmp_path: Path):
    """tests/fixtures/schema3.sqlite3 was written by the previous release's store (schema 3: search)."""
    import shutil

    from llmweb.store.models import ChatSettings

    path = tmp_path / "old.sqlite3"
    shutil.copy(REPO / "tests" / "fixtures" / "schema3.sqlite3", path)
    a, b = "anon:fixture-visitor-a", "user:fixture-b"
    with Store(path) as s:
        assert s.schema_version() == SCHEMA_VERSION
        (info,) = s.list_conversations(a)
        conv = s.get(a, info.id)
        assert info.title == "Locker and cat" and conv.settings == ChatSettings()
        assert [(t.user, t.assistant) for t in conv.turns] == [
            ("Mein Schließfach hat die Nummer 5521.", "Notiert."),
            ("제 고양이 이름은 나비예요.", "예쁜 이름이네요!"),
            ("And the bike lock is Kestrel-19.", "Got it."),
        ]
        assert conv.turns[1].sources[0].source == "pets.md"
        assert (conv.summary, conv.summarized_upto) == ("The user has a locker numbered 5521.", 1)
        assert [(f.text, f.pinned) for f in conv.facts] == [("Mein Schließfach hat die Nummer 5521.", True)]
        assert [h.idx for h in s.search(a, "Kestrel-19")] == [2] and s.search(a, "heron") == []
        assert [h.title for h in s.search(b, "heron")] == ["The vault code is Heron-88."]
        s.set_settings(a, info.id, ChatSettings(system_prompt="Du bist ein Pirat.", memory="window"))
        assert s.get(a, info.id).settings.system_prompt == "Du bist ein Pirat."


def test_chat_settings_are_the_owners_round_trip_through_export_and_refuse_bad_shapes(store: Store):
    from llmweb.store.models import ChatSettings

    conv = store.create_conversation(A)
    store.add_turn(A, conv, "hello", "hi")
    chosen = ChatSettings(system_prompt="You are a pirate. 🏴‍☠️", temperature=0.4, max_new_tokens=64, use_docs=False)
    store.set_settings(A, conv, chosen)
    assert store.get(A, conv).settings == chosen
    with pytest.raises(NotFound):
        store.set_settings(B, conv, ChatSettings(system_prompt="stolen"))
    for bad in (ChatSettings(memory="everything"), ChatSettings(temperature=-1), ChatSettings(max_new_tokens=0)):
        with pytest.raises(InputError):
            store.set_settings(A, conv, bad)
    assert store.get(A, conv).settings == chosen, "a refused change changes nothing"
    exported = store.export_json(A, conv)
    assert json.loads(exported)["settings"] == chosen.to_dict()
    assert "You are a pirate." in store.export_markdown(A, conv)
    copy = store.import_json(B, exported)
    assert store.get(B, copy).settings == chosen and store.list_conversations(A)[0].id == conv
    with pytest.raises(NotFound):
        store.get(A, copy)
    doc = json.loads(exported)
    doc["settings"] = {"temperature": "hot"}
    before = store.list_conversations(B)
    with pytest.raises(InputError, match="not an llmweb conversation export"):
        store.import_json(B, json.dumps(doc))
    assert store.list_conversations(B) == before, "a bad file changes nothing"
    del doc["settings"]  # an export from before settings
    assert store.get(B, store.import_json(B, json.dumps(doc))).settings == ChatSettings()


def _texts(store: Store, owner: str, conv: str) -> list[str]:
    return [t.user for t in store.get(owner, conv).turns]


def test_an_edited_turn_forks_the_chat_and_each_version_comes_back_whole(store: Store):
    conv = store.create_conversation(A)
    for i in range(4):
        store.add_turn(A, conv, f"q{i}", f"a{i}")
    store.add_fact(A, conv, "q2", pinned=False)  # a fact taken from turn 3, as a fold would
    store.edit_turn(A, conv, 1, "q1 edited", "a1 new")
    assert _texts(store, A, conv) == ["q0", "q1 edited"] and store.get(A, conv).versions == {1: (1, 2)}
    assert store.facts(A, conv) == [], "the fact of the other branch left with it"
    assert [h.idx for h in store.search(A, "edited")] == [1]
    assert store.search(A, "q3") == [], "search sees the active branch only"
    store.add_turn(A, conv, "q2 on the new branch", "a2b")
    store.edit_turn(A, conv, 1, "q1 third", "a1 third")
    assert store.get(A, conv).versions == {1: (2, 3)}
    store.switch_version(A, conv, 1, 0)
    original = store.get(A, conv)
    assert [(t.user, t.assistant) for t in original.turns] == [(f"q{i}", f"a{i}") for i in range(4)]
    assert [f.text for f in original.facts] == ["q2"] and original.versions == {1: (0, 3)}
    store.switch_version(A, conv, 1, 1)
    assert _texts(store, A, conv) == ["q0", "q1 edited", "q2 on the new branch"]
    store.set_summary(A, conv, "folded on branch 1", 2)
    store.switch_version(A, conv, 1, 0)
    assert (store.get(A, conv).summary, store.get(A, conv).summarized_upto) == ("", 0), "the summary follows"
    store.switch_version(A, conv, 1, 1)
    assert store.get(A, conv).summary == "folded on branch 1"
    with pytest.raises(InputError, match="folded"):
        store.edit_turn(A, conv, 1, "too late", "x")
    for call in (
        lambda: store.edit_turn(B, conv, 2, "mine now", "x"),
        lambda: store.switch_version(B, conv, 1, 0),
        lambda: store.export_json(B, conv),
    ):
        with pytest.raises(NotFound):
            call()
    with pytest.raises(InputError, match="no longer exists"):
        store.switch_version(A, conv, 3, 0)
    store._db.execute("INSERT INTO turns_fts(turns_fts) VALUES ('integrity-check')")


def test_nested_versions_travel_with_their_branch_and_the_json_export_keeps_every_branch(store: Store):
    conv = store.create_conversation(A)
    for i in range(4):
        store.add_turn(A, conv, f"q{i}", f"a{i}")
    store.edit_turn(A, conv, 1, "b1", "x")  # fork at turn 2
    store.add_turn(A, conv, "b2", "x")
    store.add_turn(A, conv, "b3", "x")
    store.edit_turn(A, conv, 2, "c2", "x")  # a fork inside the new branch, at turn 3
    assert store.get(A, conv).versions == {1: (1, 2), 2: (1, 2)}
    store.switch_version(A, conv, 1, 0)
    assert store.get(A, conv).versions == {1: (0, 2)}, "the nested fork belongs to the other branch"
    exported = store.export_json(A, conv)
    markdown = store.export_markdown(A, conv)
    assert "## Turn 2 (version 1 of 2)" in markdown and "q3" in markdown and "c2" not in markdown, "the active branch"
    copy = store.import_json(B, exported)
    assert _texts(store, B, copy) == ["q0", "q1", "q2", "q3"] and store.get(B, copy).versions == {1: (0, 2)}
    store.switch_version(B, copy, 1, 1)
    assert _texts(store, B, copy) == ["q0", "b1", "c2"] and store.get(B, copy).versions == {1: (1, 2), 2: (1, 2)}
    store.switch_version(B, copy, 2, 0)
    assert _texts(store, B, copy) == ["q0", "b1", "b2", "b3"]
    assert _texts(store, A, conv) == ["q0", "q1", "q2", "q3"], "the importer's switches are the importer's"
    doc = json.loads(exported)
    doc["versions"][1]["body"] = None  # two active versions at one fork
    before = store.list_conversations(B)
    with pytest.raises(InputError, match="not an llmweb conversation export"):
        store.import_json(B, json.dumps(doc))
    assert store.list_conversations(B) == before
    store.delete(A, conv)
    assert store._db.execute("SELECT COUNT(*) FROM versions WHERE conversation_id = ?", (conv,)).fetchone() == (0,)


def test_undoing_the_edited_turn_leaves_an_empty_version_that_still_exports_and_switches(store: Store):
    conv = store.create_conversation(A)
    for i in range(3):
        store.add_turn(A, conv, f"q{i}", f"a{i}")
    store.edit_turn(A, conv, 1, "b1", "x")
    assert store.pop_last_turn(A, conv).user == "b1"
    copy = store.import_json(B, store.export_json(A, conv))
    assert _texts(store, B, copy) == ["q0"] and store.get(B, copy).versions == {1: (1, 2)}
    store.switch_version(B, copy, 1, 0)
    assert _texts(store, B, copy) == ["q0", "q1", "q2"]
    store.switch_version(B, copy, 1, 1)
    assert _texts(store, B, copy) == ["q0"]
