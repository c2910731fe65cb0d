"""Budgets per client address: what all the anonymous owners of one address store together (chats'
text, private documents' bytes), beside each owner's own caps. Visitors A1 and A2 share address X, B
comes from Y: A1 and A2 together reach X's budget and are refused with a message naming it, B is not,
and deleting A1's data frees room for A2. Real SQLite files in tmp_path; the migration on a file in
the previous schema."""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path

import pytest

from llmweb.config import Settings
from llmweb.errors import InputError
from llmweb.records import LOCAL_OWNER
from llmweb.store.db import Store
from llmweb.store.models import OwnerCaps
from llmweb.store.owners import ADDRESS_CHAT_BYTES, ADDRESS_DOC_BYTES, text_bytes
from llmweb.store.schema import MIGRATIONS, SCHEMA_VERSION

A1, A2, B = "anon:a1-token", "anon:a2-token", "anon:b-token"
X, Y = "2001:db8:1:2::/64", "203.0.113.5"
KB = 1024


def budgeted(tmp_path: Path, **caps) -> Store:
    caps = {"stored_bytes": 5 * KB, "address_bytes": 6 * KB, **caps}
    store = Store(tmp_path / "llmweb.sqlite3", caps=OwnerCaps(**caps))
    for owner, address in ((A1, X), (A2, X), (B, Y)):
        store.note_address(owner, address)
    return store


def stored(store: Store, owner: str) -> int:
    return store._db.execute("SELECT COALESCE(SUM(bytes), 0) FROM conversations WHERE owner = ?", (owner,)).fetchone()[
        0
    ]


def test_the_defaults_are_four_times_one_owners_caps():
    caps = OwnerCaps.from_settings(Settings())
    assert caps.address_bytes == 4 * caps.stored_bytes == 4 * 200 * 2**20
    assert caps.address_doc_bytes == 4 * 50 * 2**20
    caps = OwnerCaps.from_settings(Settings(stored_per_address_mb=300, docs_per_address_mb=70))
    assert (caps.address_bytes, caps.address_doc_bytes) == (300 * 2**20, 70 * 2**20)


def test_one_addresss_visitors_share_its_chat_budget_and_another_address_does_not(tmp_path: Path):
    with budgeted(tmp_path) as store:
        store.add_turn(A1, "a" * 32, "x" * (3 * KB), "ok", create=True)  # within A1's own 5 kB
        store.add_turn(A2, "b" * 32, "y" * (2 * KB), "ok", create=True)  # X holds ~5 kB of its 6
        with pytest.raises(InputError) as e:  # within A2's own 5 kB, past X's 6 kB
            store.add_turn(A2, "b" * 32, "z" * (2 * KB), "ok")
        message = str(e.value)
        assert "LLMWEB_STORED_PER_ADDRESS_MB" in message and "Delete some chats" in message, message
        assert "network" in message and "kB" in message, message
        with pytest.raises(InputError, match="LLMWEB_STORED_PER_ADDRESS_MB"):  # the early check says the same
            store.room(A2, size=2 * KB)
        assert store.get(A2, "b" * 32).turns[-1].user == "y" * (2 * KB), "nothing was written past the budget"
        store.add_turn(B, "c" * 32, "w" * (3 * KB), "ok", create=True)  # Y is another address
        store.add_turn(B, "c" * 32, "v" * 800, "ok")
        store.delete(A1, "a" * 32)  # A1's data gone: room for A2
        store.add_turn(A2, "b" * 32, "z" * (2 * KB), "ok")
        assert stored(store, A2) > 4 * KB - KB


def test_each_owner_still_has_its_own_cap_inside_the_address_budget(tmp_path: Path):
    with budgeted(tmp_path, address_bytes=100 * KB) as store:
        with pytest.raises(InputError, match="LLMWEB_OWNER_MAX_STORED_MB"):
            store.add_turn(A1, "a" * 32, "x" * (5 * KB), "ok", create=True)


def test_imports_and_facts_count_against_the_address_too(tmp_path: Path):
    with budgeted(tmp_path) as store:
        conv = store.create_conversation(B)
        store.add_turn(B, conv, "q" * (3 * KB), "ok")
        doc = store.export_json(B, conv)
        store.import_json(A1, doc)
        with pytest.raises(InputError, match="LLMWEB_STORED_PER_ADDRESS_MB"):
            store.import_json(A2, doc)
        mine = store.create_conversation(A2)
        store.add_turn(A2, mine, "hello", "ok")
        with pytest.raises(InputError, match="LLMWEB_STORED_PER_ADDRESS_MB"):
            store.add_fact(A2, mine, "f" * (3 * KB))


def test_an_owner_without_an_address_and_the_local_owner_are_not_counted_per_address(tmp_path: Path):
    with budgeted(tmp_path) as store:
        store.add_turn(A1, "a" * 32, "x" * (3 * KB), "ok", create=True)
        store.add_turn(A2, "b" * 32, "y" * (2 * KB), "ok", create=True)
        unknown = "anon:from-an-earlier-release"  # never noted: its own group
        store.add_turn(unknown, "d" * 32, "u" * (3 * KB), "ok", create=True)
        store.note_address(LOCAL_OWNER, X)  # never counted, whatever the web layer says
        for i in range(3):
            store.add_turn(LOCAL_OWNER, "e" * 32, "l" * (3 * KB), "ok", create=i == 0)
        with pytest.raises(InputError, match="LLMWEB_STORED_PER_ADDRESS_MB"):
            store.add_turn(A2, "b" * 32, "z" * (2 * KB), "ok")


def test_an_owner_that_moves_counts_at_its_new_address(tmp_path: Path):
    with budgeted(tmp_path) as store:
        store.add_turn(A1, "a" * 32, "x" * (3 * KB), "ok", create=True)
        store.add_turn(B, "c" * 32, "w" * (3 * KB), "ok", create=True)
        store.note_address(A1, Y)  # A1 now comes from Y: X is empty, Y holds ~6 kB
        store.add_turn(A2, "b" * 32, "y" * (3 * KB), "ok", create=True)
        with pytest.raises(InputError, match="LLMWEB_STORED_PER_ADDRESS_MB"):
            store.add_turn(B, "c" * 32, "w" * 500, "ok")


def test_after_delete_all_my_data_the_owner_is_counted_at_its_address_again(tmp_path: Path):
    """Deleting an owner drops its row; the next note writes it again (the store remembers what it
    wrote per owner, and forgets it with the row), so starting over does not leave the address budget."""
    with budgeted(tmp_path) as store:
        store.add_turn(A2, "b" * 32, "y" * (3 * KB), "ok", create=True)
        store.delete_owner(A1)
        store.note_address(A1, X)
        store.add_turn(A1, "a" * 32, "x" * (2 * KB), "ok", create=True)
        with pytest.raises(InputError, match="LLMWEB_STORED_PER_ADDRESS_MB"):
            store.add_turn(A1, "a" * 32, "x" * (2 * KB), "ok")
        assert store._db.execute("SELECT address FROM owners WHERE owner = ?", (A1,)).fetchone() == (X,)


def test_noting_the_same_address_again_writes_nothing(tmp_path: Path):
    with budgeted(tmp_path) as store:
        before = store._db.total_changes
        for _ in range(5):
            store.note_address(A1, X)
        assert store._db.total_changes == before
        store.note_address(A1, Y)
        assert store._db.total_changes == before + 1


def test_documents_bytes_of_one_address_are_claimed_against_its_budget(tmp_path: Path):
    with budgeted(tmp_path, address_doc_bytes=10 * KB) as store:
        store.claim_document_bytes(A1, 6 * KB)
        store.document_room(A2, 4 * KB)  # exactly the budget: fine
        with pytest.raises(InputError) as e:
            store.document_room(A2, 5 * KB)
        message = str(e.value)
        assert "LLMWEB_DOCS_PER_ADDRESS_MB" in message and "documents" in message and "network" in message, message
        with pytest.raises(InputError, match="LLMWEB_DOCS_PER_ADDRESS_MB"):
            store.claim_document_bytes(A2, 5 * KB)
        store.claim_document_bytes(B, 9 * KB)  # Y is another address
        store.claim_document_bytes(A1, 6 * KB)  # no growth: never refused
        store.record_document_bytes(A1, 1 * KB)  # A1 removed documents
        store.claim_document_bytes(A2, 9 * KB)
        store.delete_owner(A2)
        store.note_address(A2, X)
        store.claim_document_bytes(A1, 9 * KB)  # a deleted owner's documents no longer count
        store.note_address(LOCAL_OWNER, X)
        store.claim_document_bytes(LOCAL_OWNER, 100 * KB)  # the local owner: not counted


def test_the_address_sums_are_indexed_queries(tmp_path: Path):
    with budgeted(tmp_path) as store:
        for sql in (ADDRESS_CHAT_BYTES, ADDRESS_DOC_BYTES):
            plan = " ".join(r[-1] for r in store._db.execute("EXPLAIN QUERY PLAN " + sql, (X, A1)))
            assert "owners_by_address" in plan, plan
            assert "SCAN c" not in plan and "SCAN conversations" not in plan, plan


def test_a_file_in_the_previous_schema_migrates_with_every_owner_its_own_group(tmp_path: Path):
    path = tmp_path / "old.sqlite3"
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
    for statement in (s for migration in MIGRATIONS[: SCHEMA_VERSION - 1] for s in migration):
        db.execute(statement)
    db.execute("INSERT INTO schema_version (version) VALUES (?)", (SCHEMA_VERSION - 1,))
    for conv, owner in (("c1", A1), ("c2", "anon:without-a-row")):
        db.execute(
            "INSERT INTO conversations (id, title, created, updated, owner) VALUES (?, 't', 1, 1, ?)", (conv, owner)
        )
        db.execute(
            "INSERT INTO turns (conversation_id, idx, user, assistant, created, owner_tag) "
            "VALUES (?, 0, 'hello', 'hi', 1, 'o' || lower(hex(?)) || 'x')",
            (conv, owner),
        )
    db.execute("INSERT INTO owners (owner, created, last_seen) VALUES (?, 1, 1)", (A1,))
    db.close()
    with Store(path, caps=OwnerCaps(stored_bytes=4 * KB, address_bytes=6 * KB)) as store:
        assert store.schema_version() == SCHEMA_VERSION
        rows = store._db.execute("SELECT owner, address, chat_bytes, doc_bytes FROM owners ORDER BY owner").fetchall()
        assert rows == [
            (A1, None, stored(store, A1), 0),
            ("anon:without-a-row", None, stored(store, "anon:without-a-row"), 0),
        ]
        assert stored(store, A1) > 0
        store.add_turn(A1, "c1", "x" * (3 * KB), "ok")  # its own group: only its own cap
        store.note_address(A2, X)
        store.add_turn(A2, "b" * 32, "y" * (3 * KB), "ok", create=True)
        assert text_bytes("x" * (3 * KB)) <= stored(store, A1)


def test_two_identities_of_one_address_writing_at_once_cannot_both_pass(tmp_path: Path):
    """The check and the write are one transaction: of two owners of X racing for the last room, in
    chats and in documents, one gets it and the other the message."""
    with budgeted(tmp_path, address_doc_bytes=10 * KB) as store:
        store.add_turn(A1, "a" * 32, "x" * KB, "ok", create=True)  # each racer fits its own cap, not both X's
        for write in (
            lambda owner, i: store.add_turn(owner, f"{i}" * 32, "y" * (3 * KB), "ok", create=True),
            lambda owner, i: store.claim_document_bytes(owner, 6 * KB),
        ):
            outcomes: list[str] = []
            start = threading.Barrier(2)

            def go(owner: str, i: int, write=write, outcomes=outcomes, start=start) -> None:
                start.wait()
                try:
                    write(owner, i)
                    outcomes.append("stored")
                except InputError:
                    outcomes.append("refused")

            threads = [threading.Thread(target=go, args=(o, i)) for i, o in enumerate((A1, A2))]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
            assert sorted(outcomes) == ["refused", "stored"]
