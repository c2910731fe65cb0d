"""Caps per owner: conversations and bytes of text, imports included, each refusal a
clear message naming its setting; one owner at a cap leaves every other owner untouched, and the
local owner of a single-user install is not capped. Real SQLite files in tmp_path."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from llmweb.config import Settings
from llmweb.errors import InputError
from llmweb.records import LOCAL_OWNER
from llmweb.store.db import Store
from llmweb.store.models import OwnerCaps
from tests.store.test_store import A, B

REPO = Path(__file__).resolve().parents[2]


def capped(tmp_path, **caps) -> Store:
    return Store(tmp_path / "llmweb.sqlite3", caps=OwnerCaps(**caps))


def _export(tmp_path: Path, text: str = "hello") -> str:
    """An export of a one-turn chat, made in a store of its own (no caps)."""
    with Store(tmp_path / "exports.sqlite3") as other:
        conv = other.create_conversation(B)
        other.add_turn(B, conv, text, "a reply")
        return other.export_json(B, conv)


def test_the_defaults_are_a_strangers_and_the_local_owner_is_free():
    caps = OwnerCaps.from_settings(Settings())
    assert caps.chats == 1000 and caps.stored_bytes == 200 * 2**20 and LOCAL_OWNER in caps.exempt


def test_one_owner_at_the_chat_cap_is_refused_and_the_other_is_not(tmp_path):
    with capped(tmp_path, chats=3) as store:
        doc = _export(tmp_path)
        store.create_conversation(A)
        store.add_turn(A, "c" * 32, "first", "reply", create=True)
        store.import_json(A, doc)
        for make in (
            lambda: store.create_conversation(A),
            lambda: store.add_turn(A, "d" * 32, "fourth", "reply", create=True),
            lambda: store.import_json(A, doc),
        ):
            with pytest.raises(InputError) as e:
                make()
            assert "LLMWEB_OWNER_MAX_CHATS" in str(e.value) and "3" in str(e.value), str(e.value)
        assert len(store.list_conversations(A)) == 3, "nothing was created past the cap"
        for _ in range(3):  # B is not affected: its own 3
            store.create_conversation(B)
        for _ in range(5):  # the local owner is not capped
            store.create_conversation(LOCAL_OWNER)
        assert len(store.list_conversations(B)) == 3 and len(store.list_conversations(LOCAL_OWNER)) == 5
        store.delete(A, store.list_conversations(A)[0].id)
        store.create_conversation(A)  # room again


def test_imports_without_end_stop_at_the_byte_cap_and_the_other_owner_is_not_affected(tmp_path):
    """The red team's "20 MB imports without end", scaled down: 50 kB each under a 200 kB cap."""
    with capped(tmp_path, stored_bytes=200_000) as store:
        doc = _export(tmp_path, "x" * 50_000)
        ids = []
        with pytest.raises(InputError) as e:
            for _ in range(10):
                ids.append(store.import_json(A, doc))
        assert len(ids) == 3, ids
        assert "LLMWEB_OWNER_MAX_STORED_MB" in str(e.value) and "MB" in str(e.value), str(e.value)
        conv = ids[0]
        with pytest.raises(InputError, match="LLMWEB_OWNER_MAX_STORED_MB"):
            store.add_turn(A, conv, "y" * 60_000, "reply")
        with pytest.raises(InputError, match="LLMWEB_OWNER_MAX_STORED_MB"):
            store.edit_turn(A, conv, 0, "y" * 60_000, "reply")
        store.add_turn(A, conv, "a short one", "fits")  # under the cap still
        for _ in range(3):
            store.import_json(B, doc)  # B's own room, all of it
        for _ in range(6):
            store.import_json(LOCAL_OWNER, doc)  # not capped
        store.delete(A, ids[1])
        store.import_json(A, doc)  # deleting makes room


def test_the_byte_count_follows_every_write(tmp_path):
    """conversations.bytes (kept by triggers) equals the bytes the chat holds, through turns, edits,
    versions, a switch, undo, a regenerated reply, facts, a summary, an import and a delete; and
    owners.chat_bytes their sum per owner."""
    with capped(tmp_path) as store:

        def check() -> None:
            kept = dict(store._db.execute("SELECT id, bytes FROM conversations"))
            real = {
                cid: sum(
                    len(v.encode()) if isinstance(v, str) else 0
                    for sql in (
                        "SELECT summary FROM conversations WHERE id = ?",
                        "SELECT user || assistant || stats || sources FROM turns WHERE conversation_id = ?",
                        "SELECT body FROM versions WHERE conversation_id = ?",
                        "SELECT text FROM facts WHERE conversation_id = ?",
                    )
                    for (v,) in store._db.execute(sql, (cid,))
                )
                for cid in kept
            }
            assert kept == real
            # ... and owners.chat_bytes (what an address's sum reads) equals the sum over each owner's chats
            totals = dict(store._db.execute("SELECT owner, SUM(bytes) FROM conversations GROUP BY owner"))
            owners = dict(store._db.execute("SELECT owner, chat_bytes FROM owners"))
            assert {o: owners.get(o) for o in totals} == totals
            assert all(n == 0 for o, n in owners.items() if o not in totals)

        conv = store.create_conversation(A)
        for i in range(3):
            store.add_turn(A, conv, f"q{i} é😀", f"a{i}")
        check()
        store.edit_turn(A, conv, 1, "edited ü", "new")
        check()
        store.switch_version(A, conv, 1, 0)
        check()
        store.pop_last_turn(A, conv)
        store.replace_last_reply(A, conv, 1, "regenerated, longer than before")
        fact = store.add_fact(A, conv, "I live in Oslo.")
        store.set_summary(A, conv, "a summary ✓", 1)
        check()
        store.delete_fact(A, conv, fact)
        copy = store.import_json(B, store.export_json(A, conv))
        check()
        store.delete(A, conv)
        check()
        assert store._db.execute("SELECT bytes FROM conversations WHERE id = ?", (copy,)).fetchone()[0] > 0
        fresh = "anon:first-write-is-an-import"  # no owners row before its write
        store.import_json(fresh, store.export_json(B, copy))
        check()
        store.delete_owner(B)
        check()


def test_an_earlier_releases_database_counts_what_it_holds(tmp_path: Path):
    path = tmp_path / "old.sqlite3"
    shutil.copy(REPO / "tests" / "fixtures" / "schema3.sqlite3", path)
    with Store(path) as s:
        for cid, kept in s._db.execute("SELECT id, bytes FROM conversations").fetchall():
            turns = s._db.execute(
                "SELECT SUM(length(CAST(user AS BLOB)) + length(CAST(assistant AS BLOB)) + length(CAST(stats AS BLOB))"
                " + length(CAST(sources AS BLOB))) FROM turns WHERE conversation_id = ?",
                (cid,),
            ).fetchone()[0]
            assert kept >= (turns or 0) > 0


def test_an_import_refused_at_the_cap_is_a_clear_message_and_stores_nothing(tmp_path):
    with capped(tmp_path, stored_bytes=1_000) as store:
        doc = json.loads(_export(tmp_path, "z" * 2_000))
        with pytest.raises(InputError) as e:
            store.import_json(A, json.dumps(doc))
        assert "Traceback" not in str(e.value) and "Delete some chats" in str(e.value)
        assert store.list_conversations(A) == []
