"""Rolling summary: hysteresis of folding, the request to the model, cleaning its reply (FakeFormat)."""

from __future__ import annotations

import random
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmweb.chat.context import Budget, plan, turn_tokens
from llmweb.chat.summary import cap_text, clean_summary, summary_request_messages, turns_to_fold
from llmweb.records import Turn
from tests.fakes import FakeFormat

HIGH, LOW = 0.85, 0.5


def count(text: str) -> int:
    return len(text.split())


# --- cap_text --------------------------------------------------------------------------------


def test_cap_text_keeps_text_that_fits():
    assert cap_text("  One two. Three  ", 3, count) == "One two. Three"


def test_cap_text_cuts_at_the_last_sentence_end_that_fits():
    assert cap_text("One two three. Four five. Six seven eight", 6, count) == "One two three. Four five."


def test_cap_text_falls_back_to_words_when_the_sentence_cut_loses_too_much():
    assert cap_text("One. two three four five six seven", 6, count) == "One. two three four five six"
    assert cap_text("no sentence end here at all", 3, count) == "no sentence end"
    assert cap_text("anything", 0, count) == ""


@given(st.lists(st.sampled_from(["a", "b.", "c!", "d?", "e"]), max_size=40), st.integers(0, 50))
def test_cap_text_is_a_prefix_within_the_cap(ws, cap):
    text = " ".join(ws)
    out = cap_text(text, cap, count)
    assert text.startswith(out) and count(out) <= cap
    if count(text) <= cap:
        assert out == text


# --- turns_to_fold ---------------------------------------------------------------------------


def test_no_fold_at_or_below_high_water():
    assert turns_to_fold([100] * 8, 1000, HIGH, LOW) == 0
    assert turns_to_fold([85] * 10, 1000, HIGH, LOW) == 0  # exactly at the mark
    assert turns_to_fold([], 0, HIGH, LOW) == 0


def test_fold_brings_history_down_to_low_water():
    counts = [100] * 9  # 900 > 850
    n = turns_to_fold(counts, 1000, HIGH, LOW)
    assert n == 4 and sum(counts[n:]) <= 500


def test_the_newest_two_turns_stay_while_they_fit():
    counts = [200, 200, 300, 300]  # the newest two alone are over low water (500) but fit the room
    assert turns_to_fold(counts, 1000, HIGH, LOW) == 2
    counts = [50, 700, 400]  # together over the room: still the newest two stay (the planner protects them)
    assert turns_to_fold(counts, 1000, HIGH, LOW) == 1
    assert turns_to_fold([1200], 1000, HIGH, LOW) == 0  # too big for the room: left out, folded once older


def test_bad_marks_raise():
    with pytest.raises(ValueError):
        turns_to_fold([1], 10, 0.5, 0.6)


@given(st.lists(st.integers(0, 400), max_size=30), st.integers(0, 3000), st.floats(0.05, 0.9), st.floats(0.01, 0.5))
def test_turns_to_fold_properties(counts, room, low, gap):
    high = min(low + gap, 1.0)
    n = turns_to_fold(counts, room, high, low)
    assert 0 <= n <= len(counts)
    if sum(counts) <= high * room:
        assert n == 0
        return
    rest = counts[n:]
    assert len(rest) >= min(2, len(counts))  # the newest two are never folded
    assert sum(rest) <= low * room or len(rest) <= 2  # down to low water, but for the newest two
    if n:  # and no more is folded than that needs
        one_less = counts[n - 1 :]
        assert sum(one_less) > low * room and len(one_less) > 2


def test_200_turns_fold_rarely_and_the_window_only_grows_in_between():
    rng = random.Random(7)
    room = 1500
    window: list[int] = []
    folds, total, previous = 0, 0, None
    for _ in range(200):
        size = rng.randint(20, 200)
        total += size
        window.append(size)
        n = turns_to_fold(window, room, HIGH, LOW)
        if n:
            folds += 1
            window = window[n:]
            assert sum(window) <= LOW * room
        elif previous is not None:
            assert window[:-1] == previous  # between folds the window only grows
        assert sum(window) <= HIGH * room
        previous = list(window)
    # each fold needs (high - low) x room new tokens since the last one
    assert 0 < folds <= 1 + total / ((HIGH - LOW) * room)
    assert folds <= 40


def test_planner_and_folding_together_keep_every_turn_and_a_stable_prefix():
    """200 turns: the lead's loop in miniature. No turn is ever dropped unsummarised, and between
    folds each prompt starts with the whole previous prompt's system + history."""
    rng = random.Random(3)
    fmt = FakeFormat()
    b = Budget(context_limit=900, max_new_tokens=100, summary_tokens=60, retrieved_tokens=100, user_tokens=60)
    window: list[Turn] = []
    summary, folds, prev = "", 0, None
    for i in range(200):
        user = " ".join(f"q{i}_{j}" for j in range(rng.randint(1, 30)))
        p = plan("Be brief.", summary, window, [], user, b, fmt)
        assert p.dropped_turns == 0
        if prev is not None:
            stable = len(prev.ids) - len(fmt.message_ids("user", prev.messages[-1][1])) - 2
            assert p.ids[:stable] == prev.ids[:stable]
        answer = " ".join(f"a{i}_{j}" for j in range(rng.randint(5, 80)))
        window.append(Turn(user, answer))
        n = turns_to_fold([turn_tokens(fmt, t) for t in window], p.history_room, HIGH, LOW)
        prev = p
        if n:
            folds += 1
            folded, window = window[:n], window[n:]
            summary = clean_summary(f"Summary after fold {folds}. " + " ".join(t.user for t in folded), 60, fmt)
            prev = None  # the prefix changed: the cache starts over
    assert 5 <= folds <= 60


# --- the request and the reply ---------------------------------------------------------------


def test_summary_request_messages():
    turns = [
        Turn("My name is Ana and I need 3 tickets.", "Booked 3 tickets for Ana."),
        Turn("Can we move it to Friday?", "I will check Friday."),
    ]
    system, user = summary_request_messages("Ana is planning a trip.", turns, 120)
    for word in ("name", "number", "decision", "open question", "120 tokens", "plain sentences"):
        assert word in system
    assert "Previous summary:\nAna is planning a trip." in user
    assert "User: My name is Ana and I need 3 tickets.\nAssistant: Booked 3 tickets for Ana." in user
    assert user.index("3 tickets") < user.index("Friday")
    _, first = summary_request_messages("", turns[:1], 120)
    assert "(none yet)" in first


def test_clean_summary_strips_chatter_and_markup():
    reply = (
        "Sure! Here is the updated summary:\n\n"
        "## Summary\n"
        "- Ana needs **3 tickets** for Friday\n"
        "- Open question: is Friday possible?\n\n"
        "Let me know if you need anything else!"
    )
    expected = "Ana needs 3 tickets for Friday. Open question: is Friday possible?"
    assert clean_summary(reply, 100, FakeFormat()) == expected


def test_clean_summary_keeps_plain_text_and_caps_at_a_sentence():
    fmt = FakeFormat()
    plain = "Okay so Ana called. She wants three seats, and I hope she gets them."
    assert clean_summary(plain, 100, fmt) == plain  # no chatter here to remove
    long = "Ana wants tickets. " * 3 + "Bob pays for them all later on"
    assert clean_summary(long, 12, fmt) == "Ana wants tickets. Ana wants tickets. Ana wants tickets."
    assert clean_summary("Summary: Ana wants tickets. I hope this helps.", 50, fmt) == "Ana wants tickets."


# --- the trailing chatter in one pass: the same answer as the old substitution loop ---

_OLD_CHATTER_START = r"(?:let me know|i hope|hope this|feel free|is there anything|if you (?:need|have|want|would))"
OLD_TRAILING_CHATTER = re.compile(r"(?:^|(?<=[.!?]))\s*" + _OLD_CHATTER_START + r"[^.!?]*[.!?]*\s*$", re.I)


def old_drop_trailing_chatter(joined: str) -> str:
    while True:
        shorter = OLD_TRAILING_CHATTER.sub("", joined)
        if shorter == joined:
            return joined
        joined = shorter


@given(st.lists(st.sampled_from(["Let me know", "I hope", " ", ".", "!", "?", "x", "Feel free", "hope this", "ab"])))
def test_trailing_chatter_is_dropped_as_before(pieces):
    from llmweb.chat.summary import _drop_trailing_chatter

    text = "".join(pieces)
    assert _drop_trailing_chatter(text) == old_drop_trailing_chatter(text)
    joined = " ".join(text.split())
    assert _drop_trailing_chatter(joined) == old_drop_trailing_chatter(joined)


def test_many_chatter_sentences_are_dropped_in_one_pass():
    text = "The user likes tea." + " Let me know." * 20_000
    assert clean_summary(text, 100, FakeFormat()) == "The user likes tea."
