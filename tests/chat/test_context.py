"""Context planner: layout, budget rules, and invariants over random conversations (FakeFormat)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmweb.chat.context import (
    NO_ROOM,
    OVER_BUDGET,
    SECTIONS,
    SUMMARY_HEADER,
    Budget,
    compose_user_message,
    plan,
    system_message,
    turn_tokens,
)
from llmweb.chat.facts import FactLike
from llmweb.chat.tokens import render_prompt
from llmweb.config import CPU_CONTEXT_CAP, Settings
from llmweb.errors import ConfigError, InputError
from llmweb.records import Chunk, Turn
from tests.fakes import FakeFormat

SYSTEM = "You are helpful."


def words(n: int, w: str = "w") -> str:
    return " ".join(f"{w}{i}" for i in range(n))


def budget(limit=1000, new=100, summary=50, retrieved=200, user=300) -> Budget:
    return Budget(
        context_limit=limit, max_new_tokens=new, summary_tokens=summary, retrieved_tokens=retrieved, user_tokens=user
    )


def check_invariants(p, fmt, system, turns, user_message, b):
    assert set(p.sections) == set(SECTIONS)
    assert sum(v for k, v in p.sections.items() if k != "reserve") == len(p.ids)
    assert p.sections["reserve"] == b.max_new_tokens
    assert len(p.ids) + b.max_new_tokens <= b.context_limit
    assert p.free >= 0
    # the system message is first and whole; the system prompt's own words are its uncut start
    sys_ids = fmt.system_ids(system)
    assert list(p.ids[: len(sys_ids) - 1]) == sys_ids[:-1]
    assert p.messages[0] == ("system", system_message(system, p.summary, p.facts))
    # ids are exactly whole rendered messages: nothing split, nothing else
    assert list(p.ids) == render_prompt(fmt, p.messages[0][1], p.messages[1:])
    # history: the newest turns, whole and contiguous up to the last one
    assert p.kept_turns + p.dropped_turns == len(turns)
    newest = turns[len(turns) - p.kept_turns :] if p.kept_turns else []
    expected = [m for t in newest for m in (("user", t.user), ("assistant", t.assistant))]
    assert list(p.messages[1:-1]) == expected
    assert p.sections["history"] == sum(turn_tokens(fmt, t) for t in newest)
    # no room for the next older turn (if any was left out)
    if p.dropped_turns:
        assert turn_tokens(fmt, turns[p.dropped_turns - 1]) > p.free
    assert p.history_room == p.sections["history"] + p.free
    # the user's text opens the last message, unchanged (passages follow it)
    assert p.messages[-1][0] == "user" and p.messages[-1][1].startswith(user_message)
    assert p.sections["recall"] + p.sections["retrieved"] <= b.retrieved_tokens


def test_layout_sections_and_numbering():
    fmt = FakeFormat()
    turns = [Turn("hi there", "hello"), Turn("what is x", "x is y")]
    chunks = [Chunk("low text", "notes.txt", score=0.3), Chunk("guide text here", "guide.md", page=2, score=0.9)]
    p = plan(SYSTEM, "The user likes x.", turns, chunks, "and z?", budget(), fmt)
    assert p.messages[0] == ("system", f"{SYSTEM}\n\n{SUMMARY_HEADER}\nThe user likes x.")
    assert p.messages[1:5] == (
        ("user", "hi there"),
        ("assistant", "hello"),
        ("user", "what is x"),
        ("assistant", "x is y"),
    )
    assert [c.source for c in p.chunks] == ["guide.md", "notes.txt"]  # best score first, tagged [1], [2]
    last = p.messages[-1][1]
    assert last == "and z?\n\nSources:\n[1] guide.md, p. 2:\nguide text here\n\n[2] notes.txt:\nlow text"
    assert p.kept_turns == 2 and p.dropped_turns == 0 and p.dropped_chunks == ()
    sys_ids = fmt.system_ids(SYSTEM)
    assert p.sections["system"] == len(sys_ids)
    assert p.sections["summary"] == len(fmt.system_ids(p.messages[0][1])) - len(sys_ids)
    assert p.sections["user"] == len(fmt.message_ids("user", "and z?")) + len(fmt.generation_prompt_ids())
    assert p.sections["recall"] == 0
    assert p.sections["reserve"] == 100
    assert p.left_out == ""
    check_invariants(p, fmt, SYSTEM, turns, "and z?", budget())


def test_no_summary_means_plain_system_prompt_prefix():
    fmt = FakeFormat()
    p = plan(SYSTEM, "  ", [], [], "hi", budget(), fmt)
    assert p.messages[0] == ("system", SYSTEM)
    assert list(p.ids[: len(fmt.system_ids(SYSTEM))]) == fmt.system_ids(SYSTEM)
    assert p.sections["summary"] == 0 and p.summary == "" and p.summary_cut == 0


def test_user_message_over_budget_raises_with_both_numbers():
    with pytest.raises(InputError) as e:
        plan(SYSTEM, "", [], [], words(1234), budget(limit=4000, user=1024), FakeFormat())
    assert "1,234" in str(e.value) and "1,024" in str(e.value)


def test_user_message_at_budget_is_accepted_uncut():
    p = plan(SYSTEM, "", [], [], words(300), budget(user=300), FakeFormat())
    assert p.messages[-1][1] == words(300)


def test_system_user_and_reserve_not_fitting_raises_with_numbers():
    fmt = FakeFormat()
    b = budget(limit=200, new=100, user=150)
    with pytest.raises(InputError) as e:
        plan(SYSTEM, "", [], [], words(120), b, fmt)
    msg = str(e.value)
    assert "120" in msg and "200" in msg and "100" in msg


def test_summary_over_budget_is_cut_at_a_sentence_and_reported():
    fmt = FakeFormat()
    summary = "Alice wants a cat. " + words(30, "a") + ". Bob said no. " + words(30, "b") + "."
    p = plan(SYSTEM, summary, [], [], "hi", budget(summary=40), fmt)
    assert p.summary == "Alice wants a cat. " + words(30, "a") + ". Bob said no."
    assert p.summary_tokens == fmt.count(p.summary) <= 40
    assert p.summary_cut == fmt.count(summary) - p.summary_tokens
    assert "of the summary" in p.left_out


def test_summary_is_cut_to_the_room_left_after_the_newest_turns():
    fmt = FakeFormat()
    b = budget(limit=60, new=10, summary=200)
    p = plan("s", words(100), [Turn("a", "b")], [Chunk("c", "f.txt", score=1)], "hi", b, fmt)
    # 60 - 10 reserve - 4 system - 6 user = 40 left; the newest turn (8) first: the 6-word
    # header + 26 words of summary, and no room for the chunk
    assert p.summary == words(26) and p.summary_cut == 74 and p.free == 0
    assert p.kept_turns == 1 and p.chunks == () and p.dropped_chunks[0][1] == NO_ROOM
    check_invariants(p, fmt, "s", [Turn("a", "b")], "hi", b)


def test_chunks_whole_best_first_with_reasons():
    fmt = FakeFormat()
    big = Chunk(words(80), "big.md", score=0.9)
    mid = Chunk(words(50), "mid.md", score=0.8)
    small = Chunk(words(10), "small.md", score=0.1)
    p = plan(SYSTEM, "", [], [small, mid, big], "q", budget(retrieved=100), fmt)
    assert p.chunks == (big, small)  # mid would pass the budget; small still fits after it
    assert p.dropped_chunks == ((mid, OVER_BUDGET),)
    assert "1 chunk (over the retrieved-text budget)" in p.left_out
    # now the context, not the budget, is what is short
    b = budget(limit=150, new=20, retrieved=500)
    p = plan(SYSTEM, "", [], [big, mid], "q", b, fmt)
    assert p.chunks == (big,) and p.dropped_chunks == ((mid, NO_ROOM),)


def test_recall_shares_the_budget_and_has_its_own_section():
    fmt = FakeFormat()
    rec = Chunk("we chose blue", "this conversation", heading="turn 3", score=0.95, kind="recall")
    doc = Chunk(words(20), "guide.md", score=0.5)
    p = plan(SYSTEM, "", [], [doc], "colour?", budget(), fmt, recall=[rec])
    last = p.messages[-1][1]
    assert "\n\nEarlier in this conversation:\n(this conversation, turn 3) we chose blue\n\nSources:" in last
    assert "[1] guide.md:" in last  # document numbering is not shifted by recalled passages
    assert p.recall == (rec,) and p.chunks == (doc,)
    assert p.sections["recall"] > 0 and p.sections["retrieved"] > 0
    alone = plan(SYSTEM, "", [], [doc], "colour?", budget(), fmt)
    assert alone.sections["retrieved"] == p.sections["retrieved"]
    assert p.sections["recall"] == len(p.ids) - len(alone.ids)
    # the shared budget: a recalled passage with a better score pushes the chunk out
    tight = plan(SYSTEM, "", [], [doc], "colour?", budget(retrieved=p.sections["recall"] + 5), fmt, recall=[rec])
    assert tight.recall == (rec,) and tight.chunks == () and tight.dropped_chunks == ((doc, OVER_BUDGET),)


def test_history_keeps_the_newest_whole_turns():
    fmt = FakeFormat()
    turns = [Turn(words(30, f"u{i}_"), words(30, f"a{i}_")) for i in range(10)]
    b = budget(limit=400, new=50)
    p = plan(SYSTEM, "", turns, [], "next", b, fmt)
    assert 0 < p.kept_turns < 10
    assert p.left_out == f"left out: {p.dropped_turns} old turns (no room)"
    check_invariants(p, fmt, SYSTEM, turns, "next", b)


def test_prefix_grows_between_turns_for_kv_reuse():
    fmt = FakeFormat()
    b = budget(limit=2000)
    turns: list[Turn] = []
    prev = None
    for i in range(6):
        p = plan(SYSTEM, "Alice likes tea.", turns, [Chunk(f"doc {i}", "d.md", score=1)], f"question {i}", b, fmt)
        if prev is not None:
            stable = len(prev.ids) - len(fmt.message_ids("user", prev.messages[-1][1])) - 2
            assert p.ids[:stable] == prev.ids[:stable]
        prev = p
        turns.append(Turn(f"question {i}", f"answer {i}"))


def _grow(hold_steps: bool, n: int = 40):
    """A chat of n equal turns planned turn by turn in a small context, each plan's start held (the
    session's part) when `hold_steps`; per turn: (its plan, whether its history starts where the last one's did)."""
    fmt, b = FakeFormat(), budget(limit=400, new=50)
    turns: list[Turn] = []
    start, out = 0, []
    for i in range(n):
        held = dict(hold=start, low=0.5) if hold_steps else {}
        p = plan(SYSTEM, "", turns, [], f"q{i}", b, fmt, **held)
        out.append((p, p.dropped_turns == start))
        start = p.dropped_turns
        turns.append(Turn(words(20, f"u{i}_"), words(20, f"a{i}_")))
    return fmt, b, turns, out


def test_a_window_past_its_room_moves_in_steps_down_to_the_low_water_mark():
    """Held at its start, the window moves only when the turns from there no longer fit, and then
    down to half its room; a turn at a time without the hold (the old way: every turn's prefix new)."""
    fmt, b, turns, held = _grow(True)
    *_, sliding = _grow(False)
    steps = [i for i, (p, same) in enumerate(held) if not same]
    slides = [i for i, (p, same) in enumerate(sliding) if not same and p.dropped_turns]
    assert len(slides) >= 25, "without the hold, a full window moves on every turn"
    assert 3 <= len(steps) <= len(slides) // 3, (steps, slides)
    for i, (p, same) in enumerate(held):
        check_invariants_held(p, fmt, turns[:i], f"q{i}", b)
        if not same:
            assert p.sections["history"] <= 0.5 * p.history_room, "a step goes down to the low-water mark"
        elif i:
            prev = held[i - 1][0]
            stable = len(prev.ids) - len(fmt.message_ids("user", prev.messages[-1][1])) - 2
            assert p.ids[:stable] == prev.ids[:stable], "between steps the prompt keeps the last one's prefix"


def check_invariants_held(p, fmt, turns, user, b):
    assert len(p.ids) + b.max_new_tokens <= b.context_limit
    assert p.kept_turns + p.dropped_turns == len(turns)
    assert list(p.ids) == render_prompt(fmt, p.messages[0][1], p.messages[1:])
    newest = turns[len(turns) - p.kept_turns :] if p.kept_turns else []
    assert list(p.messages[1:-1]) == [m for t in newest for m in (("user", t.user), ("assistant", t.assistant))]


def test_a_hold_is_ignored_when_every_turn_fits_or_it_would_keep_too_few():
    fmt, b = FakeFormat(), budget(limit=400, new=50)
    few = [Turn(words(10, f"u{i}_"), words(10, f"a{i}_")) for i in range(3)]
    assert plan(SYSTEM, "", few, [], "q", b, fmt, hold=2, low=0.5).dropped_turns == 0, "all fit: history is whole"
    many = [Turn(words(20, f"u{i}_"), words(20, f"a{i}_")) for i in range(20)]
    fit = plan(SYSTEM, "", many, [], "q", b, fmt).dropped_turns
    assert plan(SYSTEM, "", many, [], "q", b, fmt, hold=fit + 2, low=0.5).dropped_turns == fit + 2
    stepped = plan(SYSTEM, "", many, [], "q", b, fmt, hold=19, low=0.5)  # past the newest two: a fresh step
    assert stepped.dropped_turns == plan(SYSTEM, "", many, [], "q", b, fmt, hold=0, low=0.5).dropped_turns < 19
    assert plan(SYSTEM, "", many, [], "q", b, fmt, hold=fit - 1, low=0.5).dropped_turns > fit, "no longer fits: a step"


def test_budget_from_settings():
    s = Settings()
    b = Budget.from_settings(s, model_max=8192, on_cpu=False)
    assert b.context_limit == 8192 and b.max_new_tokens == s.max_new_tokens
    assert Budget.from_settings(s, model_max=8192, on_cpu=True).context_limit == CPU_CONTEXT_CAP
    assert Budget.from_settings(s, model_max=1024, on_cpu=True).context_limit == 1024
    explicit = Budget.from_settings(s.replace(context_limit=4096), model_max=8192, on_cpu=True)
    assert explicit.context_limit == 4096  # the user's explicit choice is kept on CPU
    assert Budget.from_settings(s.replace(context_limit=9999), model_max=8192, on_cpu=False).context_limit == 8192
    small = Budget.from_settings(s.replace(max_new_tokens=900), model_max=1000, on_cpu=False)
    assert small.max_new_tokens == 500
    with pytest.raises(ConfigError):
        Budget.from_settings(s, model_max=0, on_cpu=False)
    with pytest.raises(ConfigError):
        Budget(context_limit=100, max_new_tokens=100, summary_tokens=1, retrieved_tokens=1, user_tokens=1)


def test_compose_user_message_plain():
    assert compose_user_message("hello") == "hello"


# --- properties over random conversations ---------------------------------------------------

text = st.integers(0, 25).map(lambda n: words(n, "t"))
turn_st = st.builds(Turn, text, text)
chunk_st = st.builds(
    Chunk,
    st.integers(1, 40).map(lambda n: words(n, "c")),
    st.sampled_from(["a.md", "b.pdf"]),
    page=st.one_of(st.none(), st.integers(1, 9)),
    score=st.floats(0, 1),
)
recall_st = st.builds(
    Chunk,
    st.integers(1, 30).map(lambda n: words(n, "r")),
    st.just("this conversation"),
    score=st.floats(0, 1),
    kind=st.just("recall"),
)
fact_st = st.builds(FactLike, st.integers(1, 12).map(lambda n: words(n, "f")), st.booleans())
budget_st = st.builds(
    lambda limit, new_frac, s, r, u, f: Budget(limit, max(1, int(limit * new_frac)), s, r, u, f),
    st.integers(10, 600),
    st.floats(0.01, 0.4),
    st.integers(0, 60),
    st.integers(0, 200),
    st.integers(1, 100),
    st.integers(0, 60),
)


@settings(max_examples=200, deadline=None)
@given(
    system=st.integers(0, 20).map(lambda n: words(n, "s")),
    summary=st.integers(0, 80).map(lambda n: words(n, "m")),
    turns=st.lists(turn_st, max_size=12),
    chunks=st.lists(chunk_st, max_size=6),
    recall=st.lists(recall_st, max_size=3),
    user_len=st.one_of(st.integers(0, 15), st.integers(0, 120)),
    facts=st.lists(fact_st, max_size=6),
    b=budget_st,
)
def test_plan_invariants(system, summary, turns, chunks, recall, user_len, facts, b):
    fmt = FakeFormat()
    user_message = words(user_len, "u")
    pinned = [f for f in facts if f.pinned]
    fixed = (
        len(fmt.system_ids(system_message(system, "", pinned)))
        + len(fmt.message_ids("user", user_message))
        + len(fmt.generation_prompt_ids())
        + b.max_new_tokens
    )
    if user_len > b.user_tokens or fixed > b.context_limit:
        with pytest.raises(InputError) as e:
            plan(system, summary, turns, chunks, user_message, b, fmt, recall=recall, facts=facts)
        assert f"{user_len:,}" in str(e.value)
        assert (f"{b.user_tokens:,}" if user_len > b.user_tokens else f"{b.context_limit:,}") in str(e.value)
        return
    p = plan(system, summary, turns, chunks, user_message, b, fmt, recall=recall, facts=facts)
    check_invariants(p, fmt, system, turns, user_message, b)
    # facts: every pinned one placed; the rest placed or reported, in their order; unpinned within the budget
    assert all(f in p.facts for f in pinned)
    assert sorted(map(id, p.facts + p.dropped_facts)) == sorted(map(id, facts))
    if any(not f.pinned for f in p.facts):
        assert p.sections["facts"] <= b.facts_tokens
    # chunks: every one used or dropped with a reason, whole
    used = list(p.chunks) + list(p.recall)
    assert sorted(map(id, used + [c for c, _ in p.dropped_chunks])) == sorted(map(id, chunks + recall))
    assert all(reason in (OVER_BUDGET, NO_ROOM) for _, reason in p.dropped_chunks)
    for c in p.chunks:
        assert c.text in p.messages[-1][1]
    # the summary: a word-prefix of the given one, within its budget
    assert " ".join(summary.split()).startswith(p.summary)
    assert p.summary_tokens <= b.summary_tokens
    assert p.summary_tokens + p.summary_cut == fmt.count(summary)


def test_newest_two_turns_outrank_summary_and_retrieved_text():
    from llmweb.chat.context import Budget, plan
    from llmweb.records import Chunk, Turn
    from tests.fakes import FakeFormat

    fmt = FakeFormat()
    turns = [Turn(f"question {i} " + "q " * 10, f"answer {i} " + "a " * 10) for i in range(6)]
    chunks = [Chunk(text="chunk " * 60, source=f"doc{i}.md", score=0.9 - i / 10) for i in range(4)]
    budget = Budget(context_limit=200, max_new_tokens=20, summary_tokens=80, retrieved_tokens=150, user_tokens=50)
    p = plan("sys", "summary " * 70, turns, chunks, "hello there", budget, fmt)
    assert p.kept_turns >= 2, p.sections
    assert len(p.ids) + budget.max_new_tokens <= 200


def test_pinned_facts_survive_a_budget_squeeze_that_cuts_everything_else():
    """The squeeze that used to cut the tail of "summary + facts" (the facts block, pinned ones too)."""
    fmt = FakeFormat()
    turns = [Turn(f"question {i} " + "q " * 10, f"answer {i} " + "a " * 10) for i in range(6)]
    facts = [
        FactLike("my locker code is Zanzibar-7781", True),
        FactLike("old unpinned fact here", False),
        FactLike("I live in Tromso", True),
        FactLike("newest unpinned fact", False),
    ]
    b = Budget(
        context_limit=120, max_new_tokens=20, summary_tokens=80, retrieved_tokens=50, user_tokens=50, facts_tokens=20
    )
    p = plan("sys", "summary " * 70, turns, [], "what is my locker code?", b, fmt, facts=facts)
    system_text = p.messages[0][1]
    assert "- my locker code is Zanzibar-7781" in system_text and "- I live in Tromso" in system_text
    assert [f.text for f in p.dropped_facts] == ["old unpinned fact here"], "the oldest unpinned goes first"
    assert p.summary_cut > 0, "the summary was squeezed, the pinned facts were not"
    assert "1 older unpinned fact" in p.left_out
    assert p.sections["facts"] > 0 and len(p.ids) + b.max_new_tokens <= b.context_limit


def test_pinned_facts_that_cannot_fit_are_refused_with_the_numbers_not_cut():
    fmt = FakeFormat()
    facts = [FactLike(words(40, "p"), True)]
    b = Budget(context_limit=60, max_new_tokens=10, summary_tokens=10, retrieved_tokens=10, user_tokens=20)
    with pytest.raises(InputError, match="pinned facts"):
        plan("sys", "", [], [], "hello", b, fmt, facts=facts)
