"""A say in what the model sees: turns kept in context (pinned) and left out, through the planner,
the folds, the store (owner-scoped) and an export. FakeRunner and the word-level FakeFormat; no model."""

from __future__ import annotations

import json

import pytest

from llmweb.chat.context import Budget, plan
from llmweb.chat.session import Chat
from llmweb.errors import InputError
from llmweb.records import OUT, PIN, Turn
from llmweb.store.db import Store
from llmweb.store.models import NotFound
from tests.conftest import make_settings
from tests.fakes import FakeFormat, FakeRunner, fake_engine

OWNER, OTHER = "anon:visitor-a", "anon:visitor-b"
PINNED = "remember the zebra code quokka"
SECRET = "forget the walrus word narwhal"


@pytest.fixture
def rig(tmp_path):
    settings = make_settings(tmp_path, recall=False)
    engine, runner = fake_engine(FakeRunner())
    fmt = FakeFormat()
    # a summary names the planted words of the turns its prompt was given (and the merges keep
    # them), so a turn that reached a summary prompt shows in the summary
    planted = ("quokka", "narwhal", "walrus", "zebra")

    def summarise(request):
        seen = [w for w in fmt.decode(request.prompt_ids).split() if w.strip(".,") in planted]
        return fmt._words("the user wrote " + " ".join(dict.fromkeys(seen)) + " again.") + [fmt.END]

    runner.background = summarise
    store = Store(tmp_path / "chat.sqlite3")
    budget = Budget(
        context_limit=200, max_new_tokens=20, summary_tokens=30, retrieved_tokens=40, user_tokens=60, facts_tokens=30
    )
    chat = Chat(settings, engine, fmt, store, budget)
    yield chat, runner, fmt, store
    chat.wait_background(timeout=5)
    engine.close()
    store.close()


def prompt_text(fin) -> str:
    return "\n".join(text for _, text in fin.prompt)


def budget(limit=120):
    return Budget(limit, 10, summary_tokens=20, retrieved_tokens=0, user_tokens=40)


def turn(i, view=""):
    return Turn(f"question {i} " + "w " * 6, f"answer {i}", view)


# ---- the planner


def test_a_pinned_turn_outside_the_newest_turns_comes_right_after_the_system_message():
    fmt = FakeFormat()
    turns = [turn(i, PIN if i == 3 else "") for i in range(40)]
    p = plan("sys", "", turns, [], "now", budget(), fmt)
    users = [t for role, t in p.messages if role == "user"][:-1]
    assert users[0] == turns[3].user, "the pinned turn is first in the history"
    assert turns[3].user not in users[1:] and p.pinned_turns == 1
    assert users[1:] == [t.user for t in turns[len(turns) - len(users) + 1 :]], "then the newest turns, contiguous"
    assert "1 turn you keep in context" in p.contents
    assert sum(v for k, v in p.sections.items() if k != "reserve") == len(p.ids)


def test_an_unpinned_old_turn_is_dropped_where_the_pinned_one_stays():
    fmt = FakeFormat()
    p = plan("sys", "", [turn(i) for i in range(40)], [], "now", budget(), fmt)
    assert turn(3).user not in [t for _, t in p.messages] and p.pinned_turns == 0


def test_folded_pinned_turns_are_placed_too_and_the_oldest_go_when_even_they_do_not_fit():
    fmt = FakeFormat()
    folded = [turn(i, PIN) for i in range(30)]  # far more than the context holds
    p = plan("sys", "", [turn(40), turn(41)], [], "now", budget(), fmt, folded_pins=folded)
    users = [t for role, t in p.messages if role == "user"]
    assert users[-3:] == [turn(40).user, turn(41).user, "now"], "the newest turns outrank the pins"
    assert p.dropped_pins > 0 and folded[-1].user in users and folded[0].user not in users
    assert "older pinned turn" in p.left_out
    assert len(p.ids) + p.max_new_tokens <= p.context_limit


def test_a_turn_left_out_is_in_no_prompt_and_costs_nothing():
    fmt = FakeFormat()
    turns = [turn(i) for i in range(4)]
    left = [turn(i, OUT if i == 1 else "") for i in range(4)]
    full, without = (plan("sys", "", t, [], "now", budget(400), fmt) for t in (turns, left))
    assert turns[1].user in [t for _, t in full.messages]
    assert turns[1].user not in [t for _, t in without.messages] and turns[1].assistant not in str(without.messages)
    assert without.sections["history"] == full.sections["history"] - (
        len(fmt.message_ids("user", turns[1].user)) + len(fmt.message_ids("assistant", turns[1].assistant))
    )
    assert without.dropped_turns == 0 and without.excluded_turns == 1 and "1 turn you left out" in without.contents


# ---- the chat: 60 turns later, folds, the KV cache


def test_a_pinned_turn_is_in_the_prompt_60_turns_later_and_a_left_out_one_in_no_prompt_or_summary(rig):
    chat, runner, fmt, store = rig
    conv = None
    for i in range(62):
        text = PINNED if i == 0 else SECRET if i == 1 else f"message {i} " + "x " * 10
        fin = chat.ask(OWNER, conv, text, wait_summary=True)
        conv = fin.conv_id
        if i == 1:
            chat.set_view(OWNER, conv, [(0, PIN)])
            chat.set_view(OWNER, conv, [(1, OUT)])
        if i >= 2:
            assert PINNED in prompt_text(fin), f"the pinned turn is in the prompt of turn {i + 1}"
            assert fin.prompt_text().startswith("In this prompt:") and "you keep in context" in fin.prompt_text()
            assert "walrus" not in prompt_text(fin) and "narwhal" not in prompt_text(fin)
    got = store.get(OWNER, conv)
    assert got.summarized_upto > 2, "the turns were folded meanwhile"
    assert got.summary and "narwhal" not in got.summary and "walrus" not in got.summary
    assert "quokka" not in got.summary, "a pinned turn stays verbatim, it is not summarised"
    assert not any("narwhal" in f.text for f in got.facts)
    assert [t.view for t in got.turns[:2]] == [PIN, OUT]


def test_a_change_re_prefills_the_prompt_once_from_the_changed_turn(rig):
    chat, runner, fmt, store = rig
    conv = None
    for i in range(4):
        conv = chat.ask(OWNER, conv, f"message {i} here", wait_summary=True).conv_id
    before = chat.ask(OWNER, conv, "next")
    chat.set_view(OWNER, conv, [(1, OUT)])
    changed = chat.ask(OWNER, conv, "and next")
    again = chat.ask(OWNER, conv, "and then")
    assert changed.stats.gen.reused_tokens < before.stats.gen.prompt_tokens, "the prefix ends at the change"
    assert again.stats.gen.reused_tokens >= changed.stats.gen.prompt_tokens, "then it is reused as before"


def test_leaving_out_a_folded_turn_is_refused(rig):
    chat, runner, fmt, store = rig
    conv = None
    for i in range(14):
        conv = chat.ask(OWNER, conv, f"message {i} " + "x " * 12, wait_summary=True).conv_id
    assert store.get(OWNER, conv).summarized_upto > 0
    with pytest.raises(InputError, match="folded"):
        chat.set_view(OWNER, conv, [(0, OUT)])
    chat.set_view(OWNER, conv, [(0, PIN)])  # pinning one brings it back into the prompt
    assert "message 0" in prompt_text(chat.ask(OWNER, conv, "now"))


# ---- the store: per owner, checked, exported


def test_a_turns_say_is_its_owners_alone(tmp_path):
    with Store(tmp_path / "s.sqlite3") as store:
        conv = store.create_conversation(OWNER)
        store.add_turn(OWNER, conv, "a", "b")
        with pytest.raises(NotFound):
            store.set_turn_view(OTHER, conv, 0, PIN)
        assert store.get(OWNER, conv).turns[0].view == ""
        mine = store.create_conversation(OTHER)
        store.add_turn(OTHER, mine, "c", "d")
        store.set_turn_view(OWNER, conv, 0, OUT)
        store.set_turn_view(OTHER, mine, 0, PIN)
        assert store.get(OWNER, conv).turns[0].view == OUT and store.get(OTHER, mine).turns[0].view == PIN
        with pytest.raises(InputError):
            store.set_turn_view(OWNER, conv, 0, "maybe")
        with pytest.raises(InputError):
            store.set_turn_view(OWNER, conv, 5, PIN)


def test_an_export_carries_each_turns_say(tmp_path):
    with Store(tmp_path / "s.sqlite3") as store:
        conv = store.create_conversation(OWNER)
        for i in range(3):
            store.add_turn(OWNER, conv, f"q{i}", f"a{i}")
        store.set_turn_view(OWNER, conv, 0, PIN)
        store.set_turn_view(OWNER, conv, 2, OUT)
        copy = store.import_json(OTHER, store.export_json(OWNER, conv))
        assert [t.view for t in store.get(OTHER, copy).turns] == [PIN, "", OUT]
        bad = store.export_json(OWNER, conv).replace('"view": "pin"', '"view": "always"')
        with pytest.raises(InputError):
            store.import_json(OTHER, bad)


def test_each_version_of_a_chat_keeps_its_turns_say_and_an_export_carries_it(tmp_path):
    with Store(tmp_path / "s.sqlite3") as store:
        conv = store.create_conversation(OWNER)
        for i in range(4):
            store.add_turn(OWNER, conv, f"q{i}", f"a{i}")
        store.set_turn_view(OWNER, conv, 0, PIN)
        store.set_turn_view(OWNER, conv, 2, OUT)
        store.edit_turn(OWNER, conv, 1, "q1 edited", "a1 new")  # turns 2-4 go to version 0
        assert [t.view for t in store.get(OWNER, conv).turns] == [PIN, ""]
        copy = store.import_json(OTHER, store.export_json(OWNER, conv))
        for owner, chat in ((OWNER, conv), (OTHER, copy)):
            store.switch_version(owner, chat, 1, 0)
            assert [t.view for t in store.get(owner, chat).turns] == [PIN, "", OUT, ""], owner


# ---- replay: a script says which turns to keep in context or leave out; the local owner's memories


def test_replay_keeps_and_leaves_out_the_turns_its_script_says_and_uses_the_owners_memories(rig, tmp_path):
    from dataclasses import replace
    from types import SimpleNamespace

    from llmweb.cli.main import read_script, replay
    from llmweb.errors import LlmwebError
    from llmweb.records import LOCAL_OWNER

    chat, runner, fmt, store = rig
    chat.budget = replace(chat.budget, memory_tokens=20)
    store.add_memory(LOCAL_OWNER, "My cat is called Quokka.")
    script = tmp_path / "script.jsonl"
    lines = [{"user": PINNED, "view": "keep"}, {"user": SECRET, "view": "leave_out"}]
    lines += [{"user": f"message {i} " + "x " * 10} for i in range(2, 30)]
    script.write_text("\n".join(json.dumps(d) for d in lines), encoding="utf-8")
    rows = list(replay(SimpleNamespace(wait_ready=lambda: chat, store=store), read_script(script), prompt_text=True))
    assert all("error" not in r for r in rows), rows
    assert all("Quokka" in r["prompt_text"] for r in rows), "the local owner's memories in every prompt"
    for r in rows[2:]:
        assert PINNED in r["prompt_text"] and "narwhal" not in r["prompt_text"], r["turn"]
    (conv,) = store.list_conversations(LOCAL_OWNER)
    got = store.get(LOCAL_OWNER, conv.id)
    assert got.summarized_upto > 2 and "narwhal" not in got.summary, "folded meanwhile, without the left-out turn"
    assert [t.view for t in got.turns[:3]] == [PIN, OUT, ""]
    script.write_text(json.dumps({"user": "hi", "view": "pin"}), encoding="utf-8")
    with pytest.raises(LlmwebError, match='"view" is "keep", "leave_out" or "as_planned"'):
        read_script(script)
