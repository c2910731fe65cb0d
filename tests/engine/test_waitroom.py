"""The waiting room: each waiting request's estimated wait, from the work ahead of it in
the fair queue's real serving order and of the running batch, over the throughput the engine
measures itself; the queue is bounded by that estimate (`max_wait_s`), not by a count. The pure
parts first, then the real Engine over a scripted FakeRunner (no model; fractions of a second)."""

from __future__ import annotations

import time

import pytest

from llmweb.engine import waitroom
from llmweb.engine.queue import Lanes
from llmweb.engine.request import EngineLimits, GenerationRequest, Handle, Slot, Waiting
from llmweb.engine.waitroom import Pace, Work, running_work, wait_s, waiting_work
from llmweb.errors import BusyError
from llmweb.records import GenerationStats
from tests.fakes import FakeRunner, fake_engine


def req(ids=(1, 2, 3), n=8, **kw) -> GenerationRequest:
    return GenerationRequest(prompt_ids=list(ids), max_new_tokens=n, **kw)


def pace(prefill_tok_s=1000.0, step_s=0.1) -> Pace:
    return Pace(prefill_tok_s=prefill_tok_s, step_s=step_s)


# ---- the pure estimate


def test_pace_starts_from_its_priors_and_follows_what_it_measures():
    p = Pace()
    assert p.prefill_tok_s == waitroom.PRIOR_PREFILL_TOK_S and p.step_s == waitroom.PRIOR_STEP_S
    assert p.expected_reply(256) == 256, "before any reply, a request is expected to use its cap"
    p.prefilled(1000, 0.5)
    assert p.prefill_tok_s == pytest.approx(2000)
    p.prefilled(10, 0.0)  # nothing measured
    p.prefilled(1000, 1.5)  # slower now: the average moves towards it, weighted by tokens
    assert 1000 / 1.5 < p.prefill_tok_s < 2000
    p.stepped(0.02)
    assert p.step_s == pytest.approx(0.02), "the first measured step replaces the prior"
    for _ in range(50):
        p.stepped(0.04)
    assert p.step_s == pytest.approx(0.04, rel=0.01)
    p.replied(10)
    assert p.expected_reply(256) == 10 and p.expected_reply(4) == 4, "the average, at most the cap"


def test_wait_is_zero_while_a_slot_is_free_and_grows_with_the_work_ahead():
    p = pace()
    running = [Work(0, 20)]  # 2 s of decode left
    assert wait_s(running, [], width=2, pace=p) == 0.0, "a free slot: it starts at once"
    assert wait_s(running, [], width=1, pace=p) == pytest.approx(2.0), "the next slot frees when it ends"
    ahead = [Work(500, 10)]  # 0.5 s of prefill, then 1 s of decode
    assert wait_s(running, ahead, width=1, pace=p) == pytest.approx(2.0 + 0.5 + 1.0)
    # two slots: the one ahead starts at once, and its prefill pauses the running request
    assert wait_s(running, ahead, width=2, pace=p) == pytest.approx(1.5)
    more = wait_s(running, ahead * 3, width=2, pace=p)
    assert more > wait_s(running, ahead * 2, width=2, pace=p) > 1.5, "each request ahead adds to the wait"
    prompt_left = wait_s([Work(1000, 20)], [], width=1, pace=p)
    assert prompt_left == pytest.approx(1.0 + 2.0), "a running request's prompt still to prefill counts"


def test_the_work_of_waiting_and_running_requests():
    p = pace()
    p.replied(6)
    assert waiting_work(req(ids=range(40), n=100), p) == Work(40, 6.0), "the whole prompt, the expected reply"
    request = req(ids=range(40), n=100)
    s = Slot(Handle(request, engine=None), request, 0, 60.0, GenerationStats(prompt_tokens=40, reused_tokens=30))
    assert running_work(s, p) == Work(10, 6.0), "only what the session cache does not hold is prefilled"
    s.ready, s.generated = True, [1] * 5
    assert running_work(s, p) == Work(0, 1.0)
    s.generated = [1] * 20
    assert running_work(s, p) == Work(0, 1.0), "past the average: at least one more token"
    s.generated = [1] * 100
    assert running_work(s, p) == Work(0, 0.0), "at the cap: done"
    s.finish = "eos"
    assert running_work(s, p) == Work(0, 0.0)


def test_lanes_bound_interactive_requests_by_their_wait_and_background_jobs_by_a_count():
    limits = EngineLimits(queue_size=2, queue_per_user=1, max_wait_s=25.0)
    lanes = Lanes(limits, wait_s=lambda ahead: 10.0 * (len(ahead) + 1))  # 10 s per request, its own included
    a1, b1 = Handle(req(owner="A"), engine=None), Handle(req(owner="B"), engine=None)
    assert lanes.push(a1) == 10.0 and lanes.push(b1) == 20.0
    assert lanes.estimate(b1) == (2, 20.0) and lanes.estimate(Handle(req(), engine=None)) == (0, 0.0)
    with pytest.raises(BusyError, match=r"about 30 s of work is waiting, over this server's limit of 25 s"):
        lanes.push(Handle(req(owner="C"), engine=None))
    assert len(lanes.interactive) == 2, "a refused request leaves no trace in the queue"
    with pytest.raises(BusyError, match="you already have 1 request waiting"):
        lanes.push(Handle(req(owner="A"), engine=None))  # the owner's cap comes first
    jobs = [Handle(req(background=True), engine=None) for _ in range(9)]
    for job in jobs[:8]:
        assert lanes.push(job) == 0.0  # 4 x queue_size, whatever the interactive wait
    with pytest.raises(BusyError, match="8 background jobs are waiting"):
        lanes.push(jobs[8])


# ---- the engine


def busy(e, runner, owner="A", n=200) -> Handle:
    """A long request of `owner`, running."""
    runner.enqueue(list(range(1000, 1000 + n)))
    first = e.submit(req((1,), n=n, owner=owner))
    assert runner.running.wait(5)
    return first


def test_waiting_events_carry_the_position_and_an_estimate_from_the_measured_pace():
    e, runner = fake_engine(FakeRunner(token_delay_s=0.02), max_batch=1, max_wait_s=600)
    try:
        first = busy(e, runner)
        time.sleep(0.3)  # some steps measured
        assert e.pace.steps > 3 and e.pace.step_s >= 0.02
        e.pace.step_s, e.pace.stepped = 0.02, lambda seconds: None  # held still: the figures below are exact
        waiting = [e.submit(req((2,), n=50, owner=o)) for o in "BCD"]
        events = [next(h.events(poll_s=0.01)) for h in waiting]
        assert all(isinstance(ev, Waiting) for ev in events)
        assert [ev.position for ev in events] == [1, 2, 3]
        waits = [ev.wait_s for ev in events]
        assert 0 < waits[0] <= 200 * 0.02, "at most what the running request has left"
        assert waits[0] < waits[1] < waits[2]
        assert waits[2] - waits[1] == pytest.approx(50 * 0.02, abs=0.1), "one 50-token reply ahead"
        later = e.wait(waiting[0])[1]
        time.sleep(0.3)
        assert e.wait(waiting[0])[1] < later, "the estimate falls as the running request advances"
        first.cancel()
        for h in waiting:
            h.cancel()
    finally:
        e.close()


def test_the_queue_is_bounded_by_the_estimated_wait_not_by_a_count():
    e, runner = fake_engine(FakeRunner(token_delay_s=0.01), max_batch=1, queue_size=2, max_wait_s=600)
    try:
        first = busy(e, runner, n=100)
        many = [e.submit(req((2,), n=4, owner=f"visitor{i}")) for i in range(20)]  # short: they all fit
        assert [h.position for h in many] == list(range(1, 21)) and e.counters.refused == 0
        e.limits.max_wait_s = 1.0
        with pytest.raises(BusyError, match=r"about \d+ s of work is waiting, over this server's limit of 1 s"):
            e.submit(req((3,), n=100, owner="late"))
        assert e.counters.refused == 1 and e.queue_depth == 20
        first.cancel()
        for h in many:
            h.result()
    finally:
        e.close()


def test_a_visitor_over_their_own_cap_is_refused_even_when_the_wait_is_short():
    e, runner = fake_engine(FakeRunner(token_delay_s=0.005), max_batch=1, queue_per_user=1, max_wait_s=600)
    try:
        first = busy(e, runner)
        mine = e.submit(req((2,), owner="B"))
        with pytest.raises(BusyError, match="you already have 1 request waiting"):
            e.submit(req((3,), owner="B"))
        first.cancel()
        mine.result()
    finally:
        e.close()


def test_the_engine_measures_prefill_decode_and_reply_lengths():
    e, runner = fake_engine(FakeRunner(token_delay_s=0.005), max_batch=2)
    try:
        runner.enqueue([7] * 6, [8] * 4)
        for h in [e.submit(req(ids=range(10, 50))), e.submit(req(ids=range(10, 30), owner="B"))]:
            h.result()
        assert e.pace.steps >= 4 and e.pace.step_s >= 0.005
        assert e.pace.prefill_tok_s != waitroom.PRIOR_PREFILL_TOK_S, "prefill was measured"
        assert e.pace.reply_tokens is not None and 4 <= e.pace.reply_tokens <= 6
    finally:
        e.close()
