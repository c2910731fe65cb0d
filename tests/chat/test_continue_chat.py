"""Continue in a new chat: from a long chat, a new one of its owner that starts from its summary,
facts, kept turns and last few turns, linked back; its first prompt is small and its KV cache
fresh. FakeRunner and the word-level FakeFormat; no model."""

from __future__ import annotations

import pytest

from llmweb.chat.carry import KEEP_TURNS
from llmweb.chat.context import Budget
from llmweb.chat.session import Chat
from llmweb.records import OUT, PIN
from llmweb.store.db import Store
from llmweb.store.models import NotFound
from tests.conftest import make_settings
from tests.fakes import FakeFormat, FakeRunner, fake_engine

ANA, BOB = "anon:visitor-a", "anon:visitor-b"
PLANTED = ("My locker code is 4471.", "My sister lives in Lisbon.", "My cat is called Quokka.")


@pytest.fixture
def rig(tmp_path):
    settings = make_settings(tmp_path, recall=False)
    engine, runner = fake_engine(FakeRunner())
    fmt = FakeFormat()
    runner.background = lambda request: fmt._words("the user chatted about many things again.") + [fmt.END]
    store = Store(tmp_path / "chat.sqlite3")
    budget = Budget(400, 20, summary_tokens=40, retrieved_tokens=40, user_tokens=60, facts_tokens=60)
    chat = Chat(settings, engine, fmt, store, budget)
    yield chat, store
    chat.wait_background(timeout=5)
    engine.close()
    store.close()


def prompt(fin) -> str:
    return "\n".join(text for _, text in fin.prompt)


def name(i: int) -> str:
    """A turn's marker without digits (a sentence with a number could read as a fact)."""
    return "turn " + chr(97 + i // 26) + chr(97 + i % 26)


def long_chat(chat, turns=120) -> tuple[str, object]:
    conv, fin = None, None
    for i in range(turns):
        planted = PLANTED[i // 40] if i % 40 == 5 else ""
        fin = chat.ask(ANA, conv, f"{planted} {name(i)} tell me more " + "x " * 6, wait_summary=True)
        conv = fin.conv_id
    return conv, fin


def test_a_continued_chat_starts_small_and_fresh_with_the_planted_facts(rig):
    chat, store = rig
    old, last = long_chat(chat)
    chat.set_view(ANA, old, [(110, PIN)])
    chat.set_view(ANA, old, [(118, OUT)])
    new = chat.carry.continue_in_new(ANA, old)
    got = store.get(ANA, new)
    assert got.continues == (old, store.get(ANA, old).title) and got.title.endswith("(continued)")
    assert [t.user for t in got.turns][-KEEP_TURNS:] == [t.user for t in store.get(ANA, old).turns if t.view != OUT][
        -KEEP_TURNS:
    ]
    assert name(110) in got.turns[0].user and got.turns[0].view == PIN, "the kept turn goes too"
    assert not any(name(118) in t.user for t in got.turns), "a turn left out goes nowhere"
    first = chat.ask(ANA, new, "Where were we?")
    assert first.stats.gen.reused_tokens == 0, "its KV cache starts fresh"
    assert all(fact in prompt(first) for fact in PLANTED), prompt(first)
    assert first.stats.gen.prompt_tokens < last.stats.gen.prompt_tokens, "its first prompt is smaller"
    assert len(store.get(ANA, old).turns) == 120, "the chat it continues is unchanged"


def test_only_the_owner_continues_a_chat(rig):
    chat, store = rig
    conv = chat.ask(ANA, None, "My locker code is 4471.").conv_id
    with pytest.raises(NotFound):
        chat.carry.continue_in_new(BOB, conv)
    assert store.list_conversations(BOB) == []
    new = chat.carry.continue_in_new(ANA, conv)
    chat.delete(ANA, conv)
    assert store.get(ANA, new).continues is None, "the link goes with the chat it named"


def test_an_export_carries_the_link_where_the_importer_owns_the_chat_it_names(rig):
    chat, store = rig
    conv = chat.ask(ANA, None, "first").conv_id
    new = chat.carry.continue_in_new(ANA, conv)
    exported = store.export_json(ANA, new)
    assert store.get(ANA, store.import_json(ANA, exported)).continues == (conv, store.get(ANA, conv).title)
    assert store.get(BOB, store.import_json(BOB, exported)).continues is None, "another owner's chat is not named"


def test_a_continued_chats_link_and_its_turns_say_hold_across_an_edit_a_version_switch_and_an_export(rig):
    """A continued chat edited at its first turn (a new version from there) keeps its link; going
    back to the first version brings back its kept turn; an export with both versions, imported
    by the owner, keeps the link and each version's turns' say."""
    chat, store = rig
    conv = None
    for text in ("My locker code is 4471.", "second " + "x " * 6, "third", "fourth", "fifth"):
        conv = chat.ask(ANA, conv, text, wait_summary=True).conv_id
    chat.set_view(ANA, conv, [(0, PIN)])
    new = chat.carry.continue_in_new(ANA, conv)
    link = (conv, store.get(ANA, conv).title)
    views = [t.view for t in store.get(ANA, new).turns]
    assert views[0] == PIN and store.get(ANA, new).continues == link
    list(chat.edit(ANA, new, 0, "A new start."))
    assert store.get(ANA, new).continues == link, "an edit keeps the link"
    assert [t.view for t in store.get(ANA, new).turns] == [""]
    chat.switch_version(ANA, new, 0, 0)
    assert [t.view for t in store.get(ANA, new).turns] == views and store.get(ANA, new).continues == link
    copy = store.import_json(ANA, store.export_json(ANA, new))
    got = store.get(ANA, copy)
    assert got.continues == link and [t.view for t in got.turns] == views
    store.switch_version(ANA, copy, 0, 1)
    assert [t.user for t in store.get(ANA, copy).turns] == ["A new start."]
    assert store.get(ANA, copy).continues == link
