"""Memory across chats: what an owner asked all their chats to remember reaches every chat of
theirs (and no other owner's), within its own budget, and leaves the next prompt of each once
deleted or turned off. FakeRunner and the word-level FakeFormat; no model."""

from __future__ import annotations

import pytest

from llmweb.chat.context import Budget, plan
from llmweb.chat.session import Chat
from llmweb.errors import InputError
from llmweb.store.db import Store
from llmweb.store.memories import MAX_MEMORIES
from llmweb.store.models import NotFound
from tests.conftest import make_settings
from tests.fakes import FakeFormat, FakeRunner, fake_engine

ANA, BOB = "anon:visitor-a", "anon:visitor-b"
FACT = "My cat is called Quokka."


@pytest.fixture
def rig(tmp_path):
    settings = make_settings(tmp_path, recall=False)
    engine, runner = fake_engine(FakeRunner())
    fmt = FakeFormat()
    store = Store(tmp_path / "chat.sqlite3")
    budget = Budget(200, 20, summary_tokens=30, retrieved_tokens=40, user_tokens=60, facts_tokens=30, memory_tokens=30)
    chat = Chat(settings, engine, fmt, store, budget)
    yield chat, store
    chat.wait_background(timeout=5)
    engine.close()
    store.close()


def prompt(fin) -> str:
    return "\n".join(text for _, text in fin.prompt)


def test_a_memory_of_chat_a_is_in_chat_bs_prompt_and_not_another_owners(rig):
    chat, store = rig
    a = chat.ask(ANA, None, FACT).conv_id
    chat.pins.add(ANA, a, FACT)  # a fact of chat A ...
    (fact,) = store.facts(ANA, a)
    chat.pins.remember(ANA, a, fact.id)  # ... its owner asks all their chats to remember
    with pytest.raises(NotFound):
        chat.pins.remember(BOB, a, fact.id)
    b = chat.ask(ANA, None, "hello again")
    assert FACT in prompt(b) and b.conv_id != a
    assert b.stats.sections["memory"] > 0 and "you asked all your chats to remember" in b.prompt_text()
    assert FACT in prompt(chat.ask(ANA, a, "and here?"))
    other = chat.ask(BOB, None, "hello")
    assert "Quokka" not in prompt(other) and other.stats.sections["memory"] == 0


def test_deleting_or_turning_off_a_memory_takes_it_out_of_the_next_prompt_of_every_chat(rig):
    chat, store = rig
    a, b = (chat.ask(ANA, None, f"chat {n}").conv_id for n in "ab")
    mid = store.add_memory(ANA, FACT)
    assert all(FACT in prompt(chat.ask(ANA, c, "now?")) for c in (a, b))
    store.edit_memory(ANA, mid, enabled=False)
    assert not any(FACT in prompt(chat.ask(ANA, c, "off?")) for c in (a, b))
    store.edit_memory(ANA, mid, enabled=True, text="My cat is called Wombat.")
    assert all("Wombat" in prompt(chat.ask(ANA, c, "edited?")) for c in (a, b))
    assert store.delete_memory(ANA, mid)
    assert not any("Wombat" in prompt(chat.ask(ANA, c, "gone?")) for c in (a, b))


def test_memories_are_their_owners_alone_and_go_with_all_their_data(rig):
    chat, store = rig
    mid = store.add_memory(ANA, FACT)
    assert store.memories(BOB) == []
    with pytest.raises(NotFound):
        store.edit_memory(BOB, mid, enabled=False)
    assert not store.delete_memory(BOB, mid) and [m.text for m in store.memories(ANA)] == [FACT]
    assert store.add_memory(ANA, "  My cat is   called Quokka. ") == mid, "the same text is the same memory"
    chat.ask(ANA, None, "hi")
    chat.delete_owner(ANA)
    assert store.memories(ANA) == []


def test_memories_are_capped_and_checked(rig):
    chat, store = rig
    for bad in ("", "   ", "x" * 301):
        with pytest.raises(InputError):
            store.add_memory(ANA, bad)
    for i in range(MAX_MEMORIES):
        store.add_memory(ANA, f"thing {i}")
    with pytest.raises(InputError, match="delete one"):
        store.add_memory(ANA, "one more")


def test_the_memory_section_keeps_the_newest_within_its_budget_and_reports_the_rest():
    fmt = FakeFormat()
    memory = [f"item {i} " + "w " * 5 for i in range(10)]
    budget = Budget(400, 20, summary_tokens=30, retrieved_tokens=0, user_tokens=60, memory_tokens=25)
    p = plan("sys", "", [], [], "hi", budget, fmt, memory=memory)
    assert 0 < p.sections["memory"] <= 25 and p.memory == tuple(memory[-len(p.memory) :])
    assert p.dropped_memory == 10 - len(p.memory) > 0 and "older memor" in p.left_out
    assert sum(v for k, v in p.sections.items() if k != "reserve") == len(p.ids)
    tight = Budget(40, 20, summary_tokens=0, retrieved_tokens=0, user_tokens=10, memory_tokens=25)
    small = plan("sys", "", [], [], "hi", tight, fmt, memory=memory)  # the fixed part first: fewer
    assert len(small.ids) + 20 <= 40 and len(small.memory) < len(p.memory)


def test_an_owners_memories_export_and_import_for_that_owner_alone(rig):
    chat, store = rig
    store.add_memory(ANA, FACT)
    off = store.add_memory(ANA, "I am vegetarian.")
    store.edit_memory(ANA, off, enabled=False)
    exported = store.export_memories(ANA)
    assert store.import_memories(BOB, exported) == 2
    assert [(m.text, m.enabled) for m in store.memories(BOB)] == [(FACT, True), ("I am vegetarian.", False)]
    assert store.import_memories(BOB, exported) == 0, "what the owner has already is not added twice"
    assert len(store.memories(ANA)) == 2
    for bad in ("{}", "not json", exported.replace(FACT, "x" * 400)):
        with pytest.raises(InputError, match="not an llmweb memories export"):
            store.import_memories(ANA, bad)


def test_a_chats_fact_sentences_are_offered_not_written():
    from llmweb.chat.facts import suggestions

    said = ["Hello there.", "My locker code is 4471.", "What is the capital of France?", "I live in Ghent since 2019."]
    assert suggestions(said, []) == ["My locker code is 4471.", "I live in Ghent since 2019."]
    assert suggestions(said, ["my locker   code is 4471."]) == ["I live in Ghent since 2019."], "known ones are not"
    assert len(suggestions([f"My code is {1000 + i}." for i in range(500)], [])) == 20
