"""The chat turn over the real Engine with a scripted FakeRunner and the word-level FakeFormat, on a
real SQLite store: what is stored, stopped turns, refused input, folding, facts. No model."""

from __future__ import annotations

import pytest

from llmweb.chat import recall as recall_module
from llmweb.chat.context import Budget
from llmweb.chat.session import Chat, Delta, Finished
from llmweb.chat.turn import finish
from llmweb.errors import InputError
from llmweb.store.db import Store
from tests.conftest import make_settings
from tests.fakes import FakeFormat, FakeRunner, fake_engine

OWNER = "anon:visitor-a"


@pytest.fixture
def rig(tmp_path):
    settings = make_settings(tmp_path, recall=False)
    engine, runner = fake_engine(FakeRunner())
    fmt = FakeFormat()
    store = Store(tmp_path / "chat.sqlite3")
    budget = Budget(
        context_limit=200, max_new_tokens=20, summary_tokens=30, retrieved_tokens=40, user_tokens=60, facts_tokens=30
    )
    chat = Chat(settings, engine, fmt, store, budget)
    yield chat, runner, fmt, store
    chat.wait_background(timeout=5)
    engine.close()
    store.close()


def words(fmt, text):
    return fmt._words(text)


def test_a_turn_streams_and_is_stored_with_its_stats(rig):
    chat, runner, fmt, store = rig
    conv = store.create_conversation(OWNER)
    runner.enqueue(words(fmt, "Paris is the capital") + [fmt.END])
    events = list(chat.send(OWNER, conv, "What is the capital of France?"))
    assert [e.text for e in events if isinstance(e, Delta)][-1] == "Paris is the capital"
    fin = events[-1]
    assert isinstance(fin, Finished) and fin.reply == "Paris is the capital"
    stored = store.get(OWNER, conv).turns
    assert [(t.user, t.assistant) for t in stored] == [("What is the capital of France?", "Paris is the capital")]
    assert stored[0].stats == fin.stats and fin.stats.gen.finish_reason == "eos"
    assert fin.stats.gen.prompt_tokens == sum(v for k, v in fin.stats.sections.items() if k != "reserve")


def test_the_next_turn_reuses_the_previous_prompt_and_reply(rig):
    chat, runner, fmt, store = rig
    conv = store.create_conversation(OWNER)
    runner.enqueue(words(fmt, "first answer") + [fmt.END], words(fmt, "second answer") + [fmt.END])
    first = chat.ask(OWNER, conv, "first question")
    second = chat.ask(OWNER, conv, "second question")
    assert first.stats.gen.reused_tokens == 0
    # everything up to the end of turn 1's reply is reused (the planner keeps the prefix append-only)
    assert second.stats.gen.reused_tokens >= first.stats.gen.prompt_tokens


def test_closing_the_stream_stores_the_partial_reply_as_stopped(rig):
    chat, runner, fmt, store = rig
    runner.token_delay_s = 0.01
    conv = store.create_conversation(OWNER)
    runner.enqueue(words(fmt, " ".join(f"w{i}" for i in range(200))))
    stream = chat.send(OWNER, conv, "tell me a long story")
    for event in stream:
        if isinstance(event, Delta) and len(event.text.split()) >= 3:
            break
    stream.close()
    (turn,) = store.get(OWNER, conv).turns
    assert turn.assistant.startswith("w0 w1 w2") and turn.stats.stopped


def test_refused_messages_store_nothing(rig):
    chat, runner, fmt, store = rig
    conv = store.create_conversation(OWNER)
    with pytest.raises(InputError, match="empty"):
        chat.ask(OWNER, conv, "   \x00 ")
    with pytest.raises(InputError, match="the limit is 60"):
        chat.ask(OWNER, conv, " ".join(["word"] * 61))
    assert store.get(OWNER, conv).turns == [] and runner.requests == []


def test_old_turns_fold_into_a_summary_by_a_background_job(rig):
    chat, runner, fmt, store = rig
    conv = store.create_conversation(OWNER)
    for i in range(12):
        chat.ask(OWNER, conv, f"message {i} " + "x " * 12, wait_summary=True)
    got = store.get(OWNER, conv)
    assert got.summarized_upto > 0, "history passed its high-water mark"
    background = [r for r in runner.requests if r.background]
    assert background, "the summary was written by a low-priority engine job"
    # the next prompt starts with the summary and keeps the newest turns verbatim
    fin = chat.ask(OWNER, conv, "and now?")
    assert fin.stats.summarized_turns == got.summarized_upto
    assert fin.prompt[-2] == ("assistant", got.turns[-1].assistant)


def test_pinned_facts_reach_the_prompt_as_their_own_section(rig):
    chat, runner, fmt, store = rig
    conv = store.create_conversation(OWNER)
    chat.pins.add(OWNER, conv, "my locker code is Zanzibar-7781")
    fin = chat.ask(OWNER, conv, "what is my locker code?")
    assert "- my locker code is Zanzibar-7781" in fin.prompt[0][1]
    assert fin.stats.sections["facts"] > 0 and fin.stats.sections["summary"] == 0


def test_two_owners_never_share_a_conversation_facts_or_a_kv_cache(rig):
    chat, runner, fmt, store = rig
    mine = chat.ask(OWNER, None, "my locker code is Zanzibar-7781").conv_id
    other = "anon:visitor-b"
    from llmweb.store.models import NotFound

    with pytest.raises(NotFound):
        chat.ask(other, mine, "what is the locker code?")
    with pytest.raises(NotFound):
        chat.pins.add(other, mine, "I own this chat now")
    assert chat.delete(other, mine) is False and store.exists(OWNER, mine)
    theirs = chat.ask(other, None, "hello").conv_id
    assert theirs != mine and [c.id for c in store.list_conversations(other)] == [theirs]
    assert all(r.session_id in (mine, theirs) for r in runner.requests)
    assert {r.owner for r in runner.requests} == {OWNER, other}, "the engine queue knows who asked"


def test_the_retention_purge_deletes_idle_anonymous_owners_only(rig):
    import time

    chat, runner, fmt, store = rig
    old = chat.ask("anon:old-visitor", None, "hello from long ago").conv_id
    account = chat.ask("user:alice", None, "an account's chat").conv_id
    recent = chat.ask(OWNER, None, "hello today").conv_id
    chat.pins.add("anon:old-visitor", old, "my cat is called Miso")
    past = time.time() - 40 * 86400
    store._db.execute("UPDATE owners SET last_seen = ? WHERE owner IN ('anon:old-visitor', 'user:alice')", (past,))
    assert chat.purge_idle(("anon:", "api:"), 30 * 86400) == (1, 1)
    assert not store.exists("anon:old-visitor", old)
    assert store.exists("user:alice", account) and store.exists(OWNER, recent), "accounts and recent visitors stay"
    assert store._db.execute("SELECT COUNT(*) FROM facts").fetchone()[0] == 0


def test_a_fold_appends_to_the_summary_and_the_next_turn_reuses_the_prefix_before_it(rig):
    """Folds append a paragraph (the cached prefix up to the old summary survives); only when the
    paragraphs pass the summary's cap are they merged (rewritten) into half of it."""
    chat, runner, fmt, store = rig
    folds = iter(range(1, 100))
    # grounded text (no invented names or numbers): lowercase words from the turns, one more each fold
    runner.background = lambda request: fmt._words("the user wrote " + "x " * next(folds) + "again.") + [fmt.END]
    conv, folded, summary = None, 0, ""
    appends, merges, appended, system_and_old = [], 0, False, 0
    for i in range(40):
        fin = chat.ask(OWNER, conv, f"message {i} " + "x " * 12, wait_summary=True)
        conv = fin.conv_id
        if fin.stats.summarized_turns != folded:  # the first turn planned after a fold
            folded = fin.stats.summarized_turns
            if appended:
                appends.append((fin.stats.gen.reused_tokens, system_and_old))
        new = store.get(OWNER, conv).summary
        if new != summary:
            appended = new.startswith(summary)
            merges += not appended
            system_and_old = len(fmt.system_ids(chat.settings.system_prompt + " " + summary)) - 1
            assert fmt.count(new) <= chat.budget.summary_cap, "the stored summary stays within its cap"
            summary = new
    assert len(appends) >= 3 and merges >= 1, (len(appends), merges)
    assert merges < len(appends), "merges (full rewrites) are rarer than appends"
    for reused, system_and_old_summary in appends:
        assert reused >= system_and_old_summary - 3, "after an append the system prompt and old summary stay cached"


def test_after_a_fold_the_next_turn_prefills_only_its_message(rig):
    """A fold moves the window, so the session's cached prefix ends at the summary. The fold job
    then prefills the new prefix in the background (a warm-up request with the session's id), and
    the next turn prefills only its own message."""
    chat, runner, fmt, store = rig
    runner.background = lambda request: fmt._words("the user wrote x again.") + [fmt.END]
    conv, folded, after = None, 0, []
    for i in range(30):
        fin = chat.ask(OWNER, conv, f"message {i} " + "x " * 12, wait_summary=True)
        conv = fin.conv_id
        if fin.stats.summarized_turns != folded:  # the first turn planned after a fold
            folded = fin.stats.summarized_turns
            after.append(fin.stats.gen)
    assert len(after) >= 2, "the chat folded at least twice"
    warmups = [r for r in runner.requests if r.background and r.session_id == conv]
    assert len(warmups) >= len(after) and all(r.max_new_tokens == 1 for r in warmups)
    own = len(fmt.message_ids("user", "message 29 " + "x " * 12)) + len(fmt.generation_prompt_ids())
    for gen in after:
        assert gen.prompt_tokens - gen.reused_tokens <= own, gen


def test_recall_skips_turns_the_facts_already_carry(rig, monkeypatch):
    from llmweb.chat.facts import vocabulary
    from llmweb.chat.recall import covered as _covered
    from llmweb.records import Chunk

    def covered(chunk, memory):
        return _covered(chunk, vocabulary(memory))

    turn = Chunk("User: My dog is called Pixel, a border collie.\nAssistant: Nice!", "turn 1", kind="recall")
    assert covered(turn, "- My dog is called Pixel, a border collie.")
    assert not covered(turn, "The user was born in Tromsø."), "the name and the statement are both lost"
    plain = Chunk("User: Question 2: tell me about bread. Keep it short.\nAssistant: Flour.", "turn 2", kind="recall")
    assert covered(plain, ""), "a turn that only asked is covered by the summary's paraphrase"
    coded = Chunk("User: Set retry_limit to 3 and port 8443 in Oslo.\nAssistant: Done.", "turn 3", kind="recall")
    assert not covered(coded, "Oslo, port 8443."), "an identifier the summary lost is worth recalling"
    assert covered(coded, "Oslo, port 8443, retry_limit.")
    # a statement about the user with no detail term: recalled while the summary lacks it
    cello = Chunk("User: I play the cello in a quartet.\nAssistant: Lovely!", "turn 4", kind="recall")
    assert not covered(cello, "The user talked about jazz music and trains.")
    assert covered(cello, "The user plays cello in a string quartet."), "kept in other words: covered"


def test_recall_looks_past_covered_turns_and_counts_a_turn_once(rig, monkeypatch):
    """A stand-in index (no embedder) returns passages best first: the question asked before
    (covered: it only asked) must not take the place of the statement, and a turn's two passages
    (the whole turn, the user's words) are one turn."""
    from dataclasses import replace
    from types import SimpleNamespace

    from llmweb.chat.recall import RECALL_CANDIDATES, RECALL_MIN_SCORE
    from llmweb.chat.recall import recall_chunks as _recall_chunks
    from llmweb.records import Turn

    chat, runner, fmt, store = rig
    chunks = _recall_chunks(
        [
            (0, Turn("I play the cello in a quartet.", "A long reply about something else entirely.")),
            (1, Turn("My dog is called Pixel.", "Nice.")),
            (7, Turn("Which instrument do I play?", "The guitar.")),
        ]
    )
    assert [c.doc_id for c in chunks] == ["turn-0"] * 2 + ["turn-1"] * 2 + ["turn-7"] * 2
    assert chunks[1].text == "User: I play the cello in a quartet." and "Assistant:" in chunks[0].text
    by_rank = [chunks[4], chunks[5], chunks[1], chunks[0], chunks[3]]  # the asked question first
    asked = {}

    def search(text, k, min_score):
        asked.update(k=k, min_score=min_score)
        return [replace(c, score=0.9 - 0.1 * n) for n, c in enumerate(by_rank)][:k]

    monkeypatch.setattr(chat.recalls, "index", lambda conv_id: SimpleNamespace(search=search))
    conv = SimpleNamespace(id="c", summary="The user talked about music.", facts=[])
    got = chat.recalls.recall(conv, "Which instrument do I play?")
    assert asked == {"k": RECALL_CANDIDATES * chat.settings.recall_k, "min_score": RECALL_MIN_SCORE}
    assert [c.text for c in got] == ["User: I play the cello in a quartet.", "User: My dog is called Pixel."]
    assert len({c.doc_id for c in got}) == len(got), "one passage per turn"
    monkeypatch.setattr(chat.recalls, "settings", chat.settings.replace(recall_k=1))
    assert [c.doc_id for c in chat.recalls.recall(conv, "Which instrument do I play?")] == ["turn-0"]


def test_unkept_statements_are_the_users_own_words_a_summary_dropped():
    from llmweb.chat.facts import unkept_statements, vocabulary

    text = "I play the cello in a quartet. Which instrument suits jazz? Tell me about bees."
    assert unkept_statements(text, vocabulary("The user asked about jazz.")) == ["I play the cello in a quartet."]
    assert unkept_statements(text, vocabulary("The user plays the cello in a quartet.")) == []
    # half of the content words missing is enough; one of four is not
    assert unkept_statements("My brother repairs old clocks.", vocabulary("brother repaired clocks")) == []
    assert unkept_statements("My brother repairs old clocks.", vocabulary("brother")) != []
    # not about the user, or a question: never a statement to recall
    assert unkept_statements("Bees make honey from nectar.", set()) == []
    assert unkept_statements("Do I need a visa for Peru?", set()) == []
    # other languages: the first person is seen, so the statement is recalled rather than lost
    assert unkept_statements("Ich spiele Cello in einem Quartett.", vocabulary("Jazz")) != []


def test_detail_terms_in_any_script():
    from llmweb.chat.facts import detail_terms, vocabulary

    assert detail_terms("My locker code is Zanzibar-7781. Please remember it.") == {"zanzibar-7781"}
    # German capitalises every noun: more terms (more recall), never fewer
    assert {"bello", "münchen", "12b"} <= detail_terms("Mein Hund heißt Bello und wohnt in München, Straße 12b.")
    assert any("4417" in t for t in detail_terms("제 사물함 번호는 4417입니다."))
    assert detail_terms("Question 22: explain tides. Keep it simple.") == set()
    assert "zanzibar-7781" in vocabulary("The user's code is Zanzibar-7781.")


def test_write_summary_sizes_each_batch_against_the_summary_as_it_grows(rig):
    """Many turns folded at once: every paragraph lengthens the next prompt, and no prompt may overflow."""
    from llmweb.records import Turn

    chat, runner, fmt, store = rig
    runner.background = lambda request: fmt._words("the user wrote x again and again " * 2) + [fmt.END]
    turns = [Turn(f"short message {i} " + "x " * 20, "a reply " + "y " * 20) for i in range(100)]
    text = chat.folds.summariser.write("", turns)  # raised "summary prompt ... does not fit" before
    assert text and fmt.count(text) <= chat.budget.summary_cap
    limit = chat.budget.context_limit
    assert all(len(r.prompt_ids) + r.max_new_tokens <= limit for r in runner.requests if r.background)


def test_regenerate_replaces_the_last_reply_with_a_new_one_planned_without_it(rig):
    chat, runner, fmt, store = rig
    conv = store.create_conversation(OWNER)
    runner.enqueue(
        words(fmt, "first answer") + [fmt.END],
        words(fmt, "bad answer") + [fmt.END],
        words(fmt, "better answer") + [fmt.END],
    )
    chat.ask(OWNER, conv, "first question")
    chat.ask(OWNER, conv, "second question")
    fin = finish(chat.regenerate(OWNER, conv))
    turns = store.get(OWNER, conv).turns
    assert [(t.user, t.assistant) for t in turns] == [
        ("first question", "first answer"),
        ("second question", "better answer"),
    ], "one turn replaced, not appended"
    assert fin.reply == "better answer" and turns[1].stats == fin.stats and fin.stats.turn == 2
    redo = runner.requests[-1]
    assert "bad" not in fmt.decode(redo.prompt_ids) and "second question" in fmt.decode(redo.prompt_ids)
    assert redo.temperature > 0 and redo.session_id == conv, "greedy settings sample anew; same session"
    assert fin.stats.gen.reused_tokens > 0, "the KV cache's common prefix is reused"


def test_undo_removes_the_last_turn_and_the_next_turn_plans_without_it(rig):
    chat, runner, fmt, store = rig
    conv = store.create_conversation(OWNER)
    runner.enqueue(*[words(fmt, f"answer {i}") + [fmt.END] for i in range(3)])
    chat.ask(OWNER, conv, "keep this")
    chat.ask(OWNER, conv, "drop this")
    gone = chat.undo(OWNER, conv)
    assert (gone.user, gone.assistant) == ("drop this", "answer 1")
    chat.ask(OWNER, conv, "next one")
    assert [t.user for t in store.get(OWNER, conv).turns] == ["keep this", "next one"]
    assert "drop" not in fmt.decode(runner.requests[-1].prompt_ids)
    chat.undo(OWNER, conv), chat.undo(OWNER, conv)
    with pytest.raises(InputError, match="no turns"):
        chat.undo(OWNER, conv)
    with pytest.raises(InputError, match="no turns"):
        finish(chat.regenerate(OWNER, conv))


def test_a_turn_folded_into_the_summary_cannot_be_undone_or_regenerated(rig):
    chat, runner, fmt, store = rig
    conv = store.create_conversation(OWNER)
    chat.ask(OWNER, conv, "first " + "x " * 12)
    chat.ask(OWNER, conv, "second " + "x " * 12)
    store.set_summary(OWNER, conv, "the user wrote twice", 2)  # as if a fold took both turns
    before = store.get(OWNER, conv)
    n_requests = len(runner.requests)
    for call in (lambda: chat.undo(OWNER, conv), lambda: finish(chat.regenerate(OWNER, conv))):
        with pytest.raises(InputError, match="folded into this chat's summary"):
            call()
    assert store.get(OWNER, conv) == before and len(runner.requests) == n_requests, "nothing changed or ran"


def test_a_stranger_cannot_regenerate_or_undo_anothers_turn(rig):
    chat, runner, fmt, store = rig
    conv = store.create_conversation(OWNER)
    chat.ask(OWNER, conv, "mine")
    before = store.get(OWNER, conv)
    for call in (lambda: chat.undo("anon:b", conv), lambda: finish(chat.regenerate("anon:b", conv))):
        with pytest.raises(LookupError, match="no longer exists"):
            call()
    assert store.get(OWNER, conv) == before


def test_continue_grows_a_reply_cut_by_the_length_cap_from_where_it_stopped(rig):
    chat, runner, fmt, store = rig
    conv = store.create_conversation(OWNER)
    long = " ".join(f"w{i}" for i in range(30))
    runner.enqueue(words(fmt, long), words(fmt, "and the end") + [fmt.END])
    cut = chat.ask(OWNER, conv, "tell me a long story")
    assert cut.stats.gen.finish_reason == "length" and len(cut.reply.split()) == 20
    fin = finish(chat.continue_reply(OWNER, conv))
    (turn,) = store.get(OWNER, conv).turns
    assert turn.assistant == cut.reply + " and the end" == fin.reply, "one turn, the reply grown in place"
    request = runner.requests[-1]
    assert list(request.prompt_ids[-20:]) == words(fmt, cut.reply), "the prompt ends with the reply so far"
    assert request.max_new_tokens == chat.budget.max_new_tokens and request.temperature == 0.0
    assert fin.stats.gen.reused_tokens > 0, "the session's KV cache prefix is reused"
    with pytest.raises(InputError, match="complete"):
        finish(chat.continue_reply(OWNER, conv))  # finished with an end token: nothing to continue


def test_continue_a_stopped_reply_and_the_prefix_helper_strips_the_template(rig):
    from llmweb.chat.session import reply_prefix_ids
    from llmweb.chat.turn import turn_stats

    chat, runner, fmt, store = rig
    assert reply_prefix_ids(fmt, "half a reply") == words(fmt, "half a reply")
    assert reply_prefix_ids(fmt, "") == []
    conv = store.create_conversation(OWNER)
    store.add_turn(OWNER, conv, "question", "half a", turn_stats(None, _plan(chat, "question"), 1, 0))
    runner.enqueue(words(fmt, "reply") + [fmt.END])
    assert finish(chat.continue_reply(OWNER, conv)).reply == "half a reply"


def _plan(chat, text):
    from llmweb.chat import context

    return context.plan("", "", [], [], text, chat.budget, chat.fmt)


def test_a_chats_own_settings_reach_its_prompt_and_request_and_only_its_own(rig):
    from llmweb.store.models import ChatSettings

    chat, runner, fmt, store = rig
    mine, other = store.create_conversation(OWNER), store.create_conversation(OWNER)
    chat.set_settings(OWNER, mine, ChatSettings(system_prompt="You are a pirate.", temperature=0.5, max_new_tokens=7))
    fin = chat.ask(OWNER, mine, "hello")
    assert fin.prompt[0] == ("system", "You are a pirate.")
    request = runner.requests[-1]
    assert (request.temperature, request.max_new_tokens) == (0.5, 7)
    assert fin.stats.sections["reserve"] == 7
    plain = chat.ask(OWNER, other, "hello")
    assert plain.prompt[0][1] == chat.settings.system_prompt and runner.requests[-1].max_new_tokens == 20
    second = chat.ask(OWNER, mine, "again")
    assert second.stats.gen.reused_tokens >= fin.stats.gen.prompt_tokens, "an unchanged persona keeps the KV prefix"
    with pytest.raises(Exception, match="That conversation no longer exists"):
        chat.set_settings("anon:stranger", mine, ChatSettings(system_prompt="mine now"))


@pytest.mark.parametrize(
    ("chosen", "words"),
    [
        ({"max_new_tokens": 21}, "reply cap must be between 1 and 20"),
        ({"temperature": 2.5}, "temperature must be between 0 and 2"),
        ({"system_prompt": "word " * 51}, "a quarter"),
        ({"memory": "forever"}, "memory mode must be one of"),
    ],
)
def test_chat_settings_past_the_servers_limits_are_refused_with_the_limit(rig, chosen, words):
    from llmweb.store.models import ChatSettings

    chat, runner, fmt, store = rig
    conv = store.create_conversation(OWNER)
    with pytest.raises(InputError, match=words):
        chat.set_settings(OWNER, conv, ChatSettings(**chosen))
    assert store.get(OWNER, conv).settings == ChatSettings(), "nothing stored"


def test_window_memory_never_folds_and_recall_is_refused_when_the_server_has_none(rig):
    from llmweb.store.models import ChatSettings

    chat, runner, fmt, store = rig
    conv = store.create_conversation(OWNER)
    with pytest.raises(InputError, match="LLMWEB_RECALL=0"):
        chat.set_settings(OWNER, conv, ChatSettings(memory="recall"))  # the rig's server runs without recall
    chat.set_settings(OWNER, conv, ChatSettings(memory="window"))
    for i in range(12):
        fin = chat.ask(OWNER, conv, f"message {i} " + "x " * 12, wait_summary=True)
    assert store.get(OWNER, conv).summarized_upto == 0 and not [r for r in runner.requests if r.background]
    assert fin.stats.dropped_turns > 0, "window only: old turns are left out, and reported"


def _own(fmt, text: str) -> int:
    """What a turn prefills when the session's cache holds the last prompt and reply: its message."""
    return len(fmt.message_ids("user", text)) + len(fmt.generation_prompt_ids()) + 1


def test_a_window_past_its_room_moves_in_steps_and_the_turns_between_prefill_only_their_message(rig):
    """Window memory over a context too small for the chat: the window's start holds while the
    turns from it fit, then steps down to the low-water mark, so most turns reuse the cached prefix
    (before, every turn past the room moved it by a turn and prefilled the whole prompt)."""
    from llmweb.store.models import ChatSettings

    chat, runner, fmt, store = rig
    conv = store.create_conversation(OWNER)
    chat.set_settings(OWNER, conv, ChatSettings(memory="window"))
    full, dropped = [], []
    for i in range(30):
        text = f"message {i} " + "x " * 12
        runner.enqueue(words(fmt, f"reply {i} " + "y " * 10) + [fmt.END])
        fin = chat.ask(OWNER, conv, text)
        full.append(fin.stats.gen.prompt_tokens - fin.stats.gen.reused_tokens > _own(fmt, text))
        dropped.append(fin.stats.dropped_turns)
    past = [i for i, d in enumerate(dropped) if d][1:]  # the turns after the window first passed its room
    assert len(past) >= 15, dropped
    steps = [i for i in past if full[i]]
    assert steps == [i for i in past if dropped[i] != dropped[i - 1]], "only a step prefills more than the message"
    assert 2 <= len(steps) <= len(past) // 3, (steps, dropped)


def test_an_imported_backlog_folds_in_the_background_while_the_turns_reuse_their_prefix(rig):
    """A chat imported with 40 turns and no summary: its first turn prefills a window cut to the
    low-water mark; while the fold of the backlog runs (held here), the next turns start where
    the first one did and prefill only their message; the fold lands once."""
    import threading

    chat, runner, fmt, store = rig
    conv = store.create_conversation(OWNER)
    for i in range(40):
        store.add_turn(OWNER, conv, f"old message {i} " + "x " * 12, f"old reply {i} " + "y " * 10)
    release, write = threading.Event(), chat.folds.summariser.write

    def held_write(previous, turns, **kw):  # the fold's thread waits; the engine stays free
        assert release.wait(10), "the test never released the fold"
        return write(previous, turns, **kw)

    runner.background = lambda request: fmt._words("the user wrote x again.") + [fmt.END]
    chat.folds.summariser.write = held_write
    try:
        gens = []
        for i in range(4):
            text = f"message {i} " + "x " * 12
            runner.enqueue(words(fmt, f"reply {i}") + [fmt.END])
            gens.append(chat.ask(OWNER, conv, text))
        assert store.get(OWNER, conv).summarized_upto == 0, "the fold is still held"
        assert gens[0].stats.dropped_turns > 0 and len({g.stats.dropped_turns for g in gens}) == 1
        for g, i in zip(gens[1:], range(1, 4)):
            assert g.stats.gen.prompt_tokens - g.stats.gen.reused_tokens <= _own(fmt, f"message {i} " + "x " * 12)
    finally:
        release.set()
    chat.wait_background(conv, timeout=10)
    assert store.get(OWNER, conv).summarized_upto > 0


def test_the_held_window_starts_are_capped_and_forgotten_with_their_chat():
    from llmweb.chat.memory import Windows

    w = Windows()
    w.MAX_CHATS = 3
    for i in range(4):
        w.note(f"c{i}", 10 + i)
    assert w.hold("c0", 0) == 0, "the oldest chat's start was dropped past the cap"
    assert (w.hold("c3", 0), w.hold("c3", 5), w.hold("c3", 20)) == (13, 8, 0), "relative to the first unfolded turn"
    w.forget("c3")
    assert w.hold("c3", 0) == 0


def test_a_strangers_turns_never_move_anothers_window(rig):
    """The held start is per chat: B, refused on A's chat, leaves A's window where it was, and A's
    next turn still prefills only its message."""
    from llmweb.store.models import ChatSettings, NotFound

    chat, runner, fmt, store = rig
    conv = store.create_conversation(OWNER)
    chat.set_settings(OWNER, conv, ChatSettings(memory="window"))
    for i in range(12):
        runner.enqueue(words(fmt, f"reply {i} " + "y " * 10) + [fmt.END])
        last = chat.ask(OWNER, conv, f"message {i} " + "x " * 12)
    assert last.stats.dropped_turns > 0
    with pytest.raises(NotFound):
        chat.ask("anon:visitor-b", conv, "message from b " + "z " * 12)
    other = store.create_conversation("anon:visitor-b")
    for i in range(12):
        runner.enqueue(words(fmt, f"b reply {i} " + "y " * 10) + [fmt.END])
        chat.ask("anon:visitor-b", other, f"b message {i} " + "z " * 12)
    runner.enqueue(words(fmt, "reply a") + [fmt.END])
    text = "message a"  # short: it fits in the window as it stands
    fin = chat.ask(OWNER, conv, text)
    assert fin.stats.dropped_turns == last.stats.dropped_turns
    assert fin.stats.gen.prompt_tokens - fin.stats.gen.reused_tokens <= _own(fmt, text)


def test_opening_a_chat_warms_its_next_prompt_once_per_owner_and_never_anothers(rig):
    """A chat opened (here: imported, so nothing of it is cached) is prefilled in the background,
    and the message typed next prefills only itself. One warm-up per owner at a time; a stranger
    who names the chat's id warms nothing of it."""
    import time

    chat, runner, fmt, store = rig
    convs = []
    for n in range(2):
        conv = store.create_conversation(OWNER)
        for i in range(6):
            store.add_turn(OWNER, conv, f"old message {n} {i} " + "x " * 8, f"old reply {i} " + "y " * 8)
        convs.append(conv)
    runner.token_delay_s = 0.3  # the first warm-up is still in flight when the second is asked for
    assert chat.warm(OWNER, convs[0])
    assert not chat.warm(OWNER, convs[1]), "one warm-up per owner at a time"
    assert not chat.warm("anon:visitor-b", convs[0]), "another owner's chat is not found"
    warmups = [r for r in runner.requests if r.background]
    deadline = time.monotonic() + 5
    while (len(warmups) < 1 or chat.folds._warming) and time.monotonic() < deadline:
        chat.warm("anon:nobody", "")  # prunes the finished warm-ups; warms nothing
        warmups = [r for r in runner.requests if r.background]
        time.sleep(0.05)
    runner.token_delay_s = 0.0
    assert [(r.session_id, r.owner, r.max_new_tokens) for r in warmups] == [(convs[0], OWNER, 1)]
    text = "new message " + "x " * 8
    runner.enqueue(words(fmt, "reply") + [fmt.END])
    fin = chat.ask(OWNER, convs[0], text)
    assert fin.stats.gen.reused_tokens > 0
    assert fin.stats.gen.prompt_tokens - fin.stats.gen.reused_tokens <= _own(fmt, text), fin.stats.gen
    runner.enqueue(words(fmt, "reply") + [fmt.END])
    cold = chat.ask(OWNER, convs[1], text)  # never warmed: its whole prompt is prefilled
    assert cold.stats.gen.reused_tokens == 0


def test_editing_turn_2_of_4_plans_from_turn_1_only_keeps_the_original_and_switching_back_restores_it(rig):
    chat, runner, fmt, store = rig
    conv = store.create_conversation(OWNER)
    for i in range(4):
        chat.ask(OWNER, conv, f"question {i}")
    before = store.get(OWNER, conv).turns
    fin = finish(chat.edit(OWNER, conv, 1, "question one, edited"))
    assert [m for _, m in fin.prompt[1:]][:-1] == [before[0].user, before[0].assistant], "planned from turn 1 only"
    new_message = len(fmt.message_ids("user", "question one, edited")) + len(fmt.generation_prompt_ids())
    assert fin.stats.turn == 2 and fin.stats.gen.reused_tokens >= fin.stats.gen.prompt_tokens - new_message, (
        "the KV prefix up to the end of turn 1 is reused"
    )
    got = store.get(OWNER, conv)
    assert [t.user for t in got.turns] == ["question 0", "question one, edited"] and got.versions == {1: (1, 2)}
    chat.switch_version(OWNER, conv, 1, 0)
    assert store.get(OWNER, conv).turns == before, "the original, all 4 turns"
    nxt = chat.ask(OWNER, conv, "question 4")
    assert fin.prompt[1] == nxt.prompt[1] and ("user", "question 3") in nxt.prompt, "the next turn plans from it"
    with pytest.raises(LookupError):
        chat.switch_version("anon:stranger", conv, 1, 1)
    with pytest.raises(LookupError):
        finish(chat.edit("anon:stranger", conv, 1, "mine now"))
    assert store.get(OWNER, conv).versions == {1: (0, 2)}


def test_an_edit_of_a_folded_turn_is_refused_before_anything_runs(rig):
    chat, runner, fmt, store = rig
    conv = store.create_conversation(OWNER)
    for i in range(3):
        chat.ask(OWNER, conv, f"question {i}")
    store.set_summary(OWNER, conv, "folded", 2)
    n = len(runner.requests)
    with pytest.raises(InputError, match="folded"):
        finish(chat.edit(OWNER, conv, 1, "too late"))
    with pytest.raises(InputError, match="no longer in this chat"):
        finish(chat.edit(OWNER, conv, 7, "nowhere"))
    assert len(runner.requests) == n and store.get(OWNER, conv).versions == {}


def test_a_changed_system_prompt_costs_one_full_prefill_and_then_the_prefix_is_reused_again(rig):
    from llmweb.store.models import ChatSettings

    chat, runner, fmt, store = rig
    conv = store.create_conversation(OWNER)
    chat.ask(OWNER, conv, "first")
    steady = chat.ask(OWNER, conv, "second")
    assert steady.stats.gen.reused_tokens > 0
    chat.set_settings(OWNER, conv, ChatSettings(system_prompt="You are a pirate now."))
    changed = chat.ask(OWNER, conv, "third")
    persona = len(fmt.system_ids("You are a pirate now."))
    assert changed.stats.gen.reused_tokens < persona, "reused only up to where the system prompts differ"
    after = chat.ask(OWNER, conv, "fourth")
    assert after.stats.gen.reused_tokens >= changed.stats.gen.prompt_tokens, "only on the change"


def test_switching_versions_brings_the_recall_index_in_step_with_the_active_branch(rig, monkeypatch):
    """The recall index holds the folded turns of the active branch only (a stand-in index, no embedder)."""
    from types import SimpleNamespace

    chat, runner, fmt, store = rig
    index: dict[str, str] = {}  # doc_id -> text
    fake = SimpleNamespace(
        documents=lambda: [SimpleNamespace(doc_id=d) for d in index],
        remove=lambda doc_id: index.pop(doc_id),
        add_chunks=lambda chunks: index.update({c.doc_id: c.text for c in chunks}),
    )
    monkeypatch.setattr(chat.recalls, "index", lambda conv_id: fake)
    chat.library = SimpleNamespace(is_empty=lambda owner: True)
    chat.settings = chat.settings.replace(recall=True)
    conv = store.create_conversation(OWNER)
    for i in range(4):
        store.add_turn(OWNER, conv, f"q{i}", f"a{i}")
    store.edit_turn(OWNER, conv, 1, "b1", "x")
    store.add_turn(OWNER, conv, "b2", "x")
    store.add_turn(OWNER, conv, "b3", "x")
    store.set_summary(OWNER, conv, "folded b1 and b2", 3)  # as a fold of branch 2 would have...
    folded = store.get(OWNER, conv).turns[:3]
    fake.add_chunks(recall_module.recall_chunks((t.idx, t.as_turn()) for t in folded))  # ...indexed them
    chat.switch_version(OWNER, conv, 1, 0)
    assert sorted(index) == ["turn-0"], "the other branch's folded turns left the index"
    chat.switch_version(OWNER, conv, 1, 1)
    assert sorted(index) == ["turn-0", "turn-1", "turn-2"] and "b2" in index["turn-2"], "and came back with it"


def test_the_loop_guard_is_on_by_default_and_each_chat_may_turn_it_off_for_itself(rig):
    """The configuration's loop guard (on) reaches the engine's request; a chat that turns it off
    sends its turns without it, and another visitor's chat keeps the default."""
    from llmweb.store.models import ChatSettings

    chat, runner, fmt, store = rig
    mine, theirs = store.create_conversation(OWNER), store.create_conversation("anon:visitor-b")
    chat.set_settings(OWNER, mine, ChatSettings(loop_guard=False))
    for owner, conv in ((OWNER, mine), ("anon:visitor-b", theirs)):
        runner.enqueue(words(fmt, "an answer") + [fmt.END])
        chat.ask(owner, conv, "a question")
    asked = [r for r in runner.requests if not r.background]
    assert [(r.session_id, r.loop_guard) for r in asked] == [(mine, False), (theirs, True)]
    assert store.get(OWNER, mine).settings == ChatSettings(loop_guard=False)
    with pytest.raises(ValueError, match="loop_guard"):
        ChatSettings.from_dict({"loop_guard": "no"})
