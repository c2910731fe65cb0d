"""The engine's scheduling over a scripted FakeRunner (no model): queue, busy, cancel, OOM retry,
admission, priorities. Milliseconds each; the real-model behaviour is in test_engine.py."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest

from llmweb.engine import GenerationRequest, Restarted, Tokens, Waiting
from llmweb.errors import AdmissionError, BusyError, Cancelled, InputError, OutOfMemory
from tests.fakes import FakeRunner, fake_engine


def req(ids=(1, 2, 3), n=8, **kw) -> GenerationRequest:
    return GenerationRequest(prompt_ids=list(ids), max_new_tokens=n, **kw)


def wait_for(cond, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


@pytest.fixture
def engine():
    e, runner = fake_engine(FakeRunner(token_delay_s=0.002), queue_size=3)
    yield e, runner
    e.close()


def test_scripted_reply_streams_one_event_per_token(engine):
    e, runner = engine
    runner.enqueue([7, 8, 9])
    h = e.submit(req())
    assert [ev.ids for ev in h.events() if isinstance(ev, Tokens)] == [[7], [8], [9]]
    assert h.generated == [7, 8, 9] and h.stats.finish_reason == "eos"


def test_a_full_queue_refuses_at_once_with_the_count(engine):
    e, runner = engine
    runner.token_delay_s = 0.05
    first = e.submit(req(n=100))
    wait_for(runner.running.is_set)
    waiting = [e.submit(req(owner=owner)) for owner in "abc"]  # one each: under the per-owner cap
    with pytest.raises(BusyError, match="3 requests are waiting"):
        e.submit(req(owner="d"))
    assert [h.position for h in waiting] == [1, 2, 3]
    first.cancel()
    for h in waiting:
        h.cancel()


def test_cancel_while_queued_leaves_the_queue_and_raises_cancelled(engine):
    e, runner = engine
    runner.token_delay_s = 0.05
    first = e.submit(req(n=100))
    wait_for(runner.running.is_set)
    queued = e.submit(req())
    behind = e.submit(req())
    assert behind.position == 2
    queued.cancel()
    assert behind.position == 1, "the cancelled request no longer holds a place"
    with pytest.raises(Cancelled):
        queued.result()
    first.cancel()
    behind.cancel()


def test_cancel_while_running_stops_within_a_token_and_frees_the_worker(engine):
    e, runner = engine
    runner.token_delay_s = 0.01
    runner.enqueue(list(range(10, 500)))
    h = e.submit(req(n=400))
    wait_for(lambda: len(h.generated) >= 3)
    h.cancel()
    h.result()
    assert h.stats.finish_reason == "cancelled" and h.stats.generated_tokens < 50
    runner.enqueue([5])
    assert e.submit(req()).result() == [5], "the worker serves the next request"


def test_oom_retries_once_with_the_fallback_and_says_restarted(engine):
    e, runner = engine
    smaller = req(ids=(1, 2), n=4)
    runner.fail_next(oom=True).enqueue([42, 43])
    h = e.submit(dataclasses.replace(req(ids=(1, 2, 3, 4)), fallback=lambda: smaller))
    events = list(h.events())
    assert isinstance(events[0], Restarted) and events[0].reason == "oom"
    assert h.generated == [42, 43] and h.stats.oom_retry
    assert runner.requests[-1].prompt_ids == [1, 2], "the retry ran the smaller prompt"
    assert e.counters.ooms == 1 and runner.empties >= 1


def test_oom_twice_is_a_clear_error_and_the_worker_lives(engine):
    e, runner = engine
    runner.fail_next(oom=True).fail_next(oom=True)
    h = e.submit(dataclasses.replace(req(), fallback=lambda: req(ids=(1,))))
    with pytest.raises(OutOfMemory, match="smaller prompt"):
        h.result()
    runner.enqueue([1])
    assert e.submit(req()).result() == [1]


def test_a_domain_error_in_the_runner_reaches_the_caller_and_the_worker_lives(engine):
    e, runner = engine
    runner.fail_next(InputError("bad request"))
    with pytest.raises(InputError, match="bad request"):
        e.submit(req()).result()
    runner.enqueue([3])
    assert e.submit(req()).result() == [3]


def test_admission_refuses_with_the_numbers_after_waiting():
    e, runner = fake_engine(admission_wait_s=0.2)
    try:
        runner.predict_bytes, runner.available_bytes = 3 * 2**30, 1 * 2**30
        with pytest.raises(AdmissionError, match=r"3\.00 GiB.*1\.00 GiB"):
            e.submit(req()).result()
        assert e.counters.refused == 1
    finally:
        e.close()


def test_background_jobs_wait_for_interactive_requests(engine):
    e, runner = engine
    runner.token_delay_s = 0.02
    blocker = e.submit(req(n=5))
    wait_for(runner.running.is_set)
    summary = e.submit(req(ids=(9,), background=True))
    user = e.submit(req(ids=(8,)))
    assert summary.position == 0, "background jobs are never counted as waiting users"
    for h in (blocker, user, summary):
        h.result()
    order = [r.prompt_ids[0] for r in runner.requests]
    assert order == [1, 8, 9]


def test_only_one_generation_runs_at_a_time_whoever_submits():
    e, runner = fake_engine(FakeRunner(token_delay_s=0.002), queue_size=16)
    try:
        handles, lock = [], threading.Lock()

        def client(i):
            h = e.submit(req(n=3, owner=f"client{i}"))
            with lock:
                handles.append(h)
            h.result()

        threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(handles) == 8 and e.counters.max_active == 1 and e.counters.served == 8
    finally:
        e.close()


def test_waiting_events_repeat_while_queued(engine):
    e, runner = engine
    runner.token_delay_s = 0.05
    first = e.submit(req(n=20))
    wait_for(runner.running.is_set)
    h = e.submit(req())
    events = []
    for ev in h.events(poll_s=0.01):
        events.append(ev)
        if sum(isinstance(x, Waiting) for x in events) >= 3:
            break
    assert all(isinstance(x, Waiting) and x.position == 1 for x in events)
    h.cancel()
    first.cancel()
