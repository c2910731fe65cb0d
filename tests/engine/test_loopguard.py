"""The loop guard (engine/runners/loopguard.py) on a toy vocabulary, through the numpy sampler:
a looping model says its sentence twice and then something else; code and short lines repeat freely.
The real model's loop is tests/engine/test_engine.py's."""

from __future__ import annotations

import numpy as np

from llmweb.engine.request import GenerationRequest
from llmweb.engine.runners.loopguard import GIVE_UP, MIN_TOKENS, WATCH, LoopGuard, Pieces
from llmweb.engine.runners.sampling import NumpySampler

# a toy vocabulary: words, a period, a newline, a fence, and a stop id
WORDS = [f" w{i}" for i in range(40)]
PERIOD, NEWLINE, FENCE, ALT, STOP = 40, 41, 42, 43, 44
PIECES = Pieces([*WORDS, ".", "\n", "```", " other", "</s>"])
SENTENCE = list(range(10)) + [PERIOD]  # 11 ids: long enough to be watched


def _sampler(guard: bool = True, **kw) -> NumpySampler:
    request = GenerationRequest(prompt_ids=[0], max_new_tokens=500, loop_guard=guard, stop_ids=frozenset({STOP}), **kw)
    return NumpySampler(request, [0], len(PIECES), PIECES)


def _model_that_loops(pattern: list[int]):
    """Logits that make `pattern` the model's first choice, over and over, and ALT its second."""
    state = {"i": 0}

    def logits(last: int | None) -> np.ndarray:
        if last is not None and last == pattern[state["i"] % len(pattern)]:
            state["i"] += 1
        row = np.zeros(len(PIECES), dtype=np.float32)
        row[pattern[state["i"] % len(pattern)]] = 10.0
        row[ALT] = 5.0
        return row

    return logits


def _run(sampler: NumpySampler, pattern: list[int], steps: int) -> list[int]:
    model, out, last = _model_that_loops(pattern), [], None
    for _ in range(steps):
        last = sampler(model(last))
        out.append(last)
        if last == STOP:
            break
    return out


def _copies(out: list[int], sentence: list[int]) -> int:
    n = len(sentence)
    return sum(out[i : i + n] == sentence for i in range(len(out) - n + 1))


def test_a_looping_sentence_is_said_twice_then_turned_away_and_the_reply_ends_after_three_cuts():
    s = _sampler()
    out = _run(s, SENTENCE, 200)
    assert _copies(out, SENTENCE) == 2
    assert out[: 2 * len(SENTENCE)] == SENTENCE * 2, "the first two copies are untouched"
    third = out[2 * len(SENTENCE) :]
    assert third[:MIN_TOKENS] == SENTENCE[:MIN_TOKENS] and third[MIN_TOKENS] == ALT, "turned away at MIN_TOKENS"
    assert out[-1] == STOP and s.guard is not None and s.guard.cuts == GIVE_UP and s.guard.gave_up


def test_without_the_guard_the_same_model_loops_to_the_cap():
    out = _run(_sampler(guard=False), SENTENCE, 200)
    assert _copies(out, SENTENCE) == 200 // len(SENTENCE) and STOP not in out


def test_short_lines_and_code_in_a_fence_repeat_freely():
    short = [0, 1, 2, NEWLINE]  # "- yes" kind of line: under MIN_TOKENS
    s = _sampler()
    out = _run(s, short, 100)
    assert _copies(out, short) == 25 and s.guard.cuts == 0
    code_line = list(range(12)) + [NEWLINE]  # a long line, repeated inside ``` ... ```
    s = _sampler()
    for token in [FENCE, NEWLINE]:
        s.guard.seen(token)
    out = _run(s, code_line, 13 * 6)
    assert _copies(out, code_line) == 6 and s.guard.cuts == 0
    s.guard.seen(FENCE)  # the fence closes: prose is watched again
    s.guard.seen(NEWLINE)
    out = _run(s, SENTENCE, 60)
    assert _copies(out, SENTENCE) == 2


def test_sampling_also_turns_away_and_the_seeded_draw_is_repeatable():
    a = _run(_sampler(temperature=0.7, seed=3), SENTENCE, 120)
    b = _run(_sampler(temperature=0.7, seed=3), SENTENCE, 120)
    assert a == b and _copies(a, SENTENCE) <= 2


def test_a_sentence_without_a_boundary_costs_linear_work():
    """A reply of one long 'sentence' (no period, no newline) is never looked up past WATCH ids."""
    g = LoopGuard(PIECES)
    for i in range(20_000):
        g.seen(i % 40)
        assert g.banned() == frozenset() or len(g._sentence) < WATCH
    assert len(g._next) == 0


def test_a_watched_sentence_adds_at_most_watch_prefixes():
    long = [i % 40 for i in range(300)] + [PERIOD]
    g = LoopGuard(PIECES)
    for _ in range(2):
        for t in long:
            g.seen(t)
    assert 0 < len(g._next) <= WATCH - MIN_TOKENS


def test_unknown_ids_are_not_boundaries_and_do_not_raise():
    g = LoopGuard(PIECES)
    for t in [10**6, -1, *SENTENCE]:
        g.seen(t)
    assert g.cuts == 0
