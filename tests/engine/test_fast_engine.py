"""The engine's scheduling over a scripted FakeRunner (no model): queue, busy, cancel, OOM retry,
admission, priorities. Milliseconds each; the real-model behaviour is in test_engine.py."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest

from llmweb.engine.request import GenerationRequest, Restarted, Tokens, Waiting
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


def test_a_queue_past_the_wait_bound_refuses_at_once_with_the_estimate(engine):
    e, runner = engine
    runner.token_delay_s = 0.5
    e.pace.step_s, e.pace.stepped = 0.05, lambda seconds: None  # held still: the estimates are exact
    e.limits.max_wait_s = 10.0
    first = e.submit(req(n=100))  # ~5 s left
    wait_for(runner.running.is_set)
    waiting = [e.submit(req(n=40, owner=owner)) for owner in "abc"]  # 2 s each; c waits ~9 s
    with pytest.raises(BusyError, match=r"busy: about 11 s of work is waiting, over this server's limit of 10 s"):
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


# ---- batching: one worker, several requests per decode step


@pytest.fixture
def batched():
    e, runner = fake_engine(FakeRunner(token_delay_s=0.01), queue_size=8, max_batch=4)
    yield e, runner
    e.close()


def test_requests_submitted_together_share_each_decode_step(batched):
    e, runner = batched
    runner.enqueue(*[[10 + i] * 6 for i in range(4)])
    handles = [e.submit(req(n=6, owner=f"o{i}")) for i in range(4)]
    assert [h.result() for h in handles] == [[10 + i] * 6 for i in range(4)]
    assert e.counters.max_active == 4 and max(runner.batch_sizes) == 4
    assert all(h.stats.batch_size == 4 for h in handles)


def test_a_new_request_joins_the_running_batch_after_its_prefill(batched):
    e, runner = batched
    runner.enqueue(list(range(100, 160)), [7, 8, 9])
    first = e.submit(req(n=60))
    wait_for(lambda: len(first.generated) >= 5)
    second = e.submit(req(owner="late"))
    assert second.result() == [7, 8, 9], "it did not wait for the first to finish"
    assert not first.stats, "the first is still running"
    assert second.stats.batch_size == 2
    first.cancel()
    first.result()
    assert runner.batch_sizes[0] == 1 and 2 in runner.batch_sizes


def test_max_batch_bounds_the_batch_and_the_rest_wait_their_turn(batched):
    e, runner = batched
    handles = [e.submit(req(ids=(i, i + 1, i + 2), n=3, owner=f"o{i}")) for i in range(6)]
    for h in handles:
        h.result()
    assert e.counters.max_active == 4 and max(runner.batch_sizes) <= 4 and e.counters.served == 6


def test_cancelling_one_request_of_a_batch_leaves_it_at_once_and_the_others_unchanged(batched):
    e, runner = batched
    replies = [list(range(10 * i, 10 * i + 30)) for i in range(1, 4)]
    runner.enqueue(*replies)
    handles = [e.submit(req(n=30, owner=f"o{i}")) for i in range(3)]
    wait_for(lambda: len(handles[1].generated) >= 3)
    steps_before = len(runner.batch_sizes)
    handles[1].cancel()
    assert handles[0].result() == replies[0] and handles[2].result() == replies[2]
    assert handles[1].stats.finish_reason == "cancelled" and handles[1].stats.generated_tokens < 10
    after = runner.batch_sizes[steps_before + 1 :]  # the step in flight at the cancel may still count it
    assert after and max(after) <= 2, "the cancelled request left the batch"


def test_an_oom_in_a_batched_decode_step_restarts_only_the_youngest(batched):
    e, runner = batched
    replies = [[1] * 8, [2] * 8, [3] * 8]
    runner.enqueue(*replies, [4] * 8)  # the last one answers the retry
    handles = [e.submit(req(n=8, owner=f"o{i}", fallback=lambda: req(ids=(9,), n=8, owner="o2"))) for i in range(3)]
    wait_for(lambda: all(len(h.generated) >= 2 for h in handles))
    runner.fail_next(oom=True, in_decode=True)
    events = [list(h.events()) for h in handles]
    assert [any(isinstance(ev, Restarted) for ev in evs) for evs in events] == [False, False, True]
    assert [h.generated for h in handles] == [[1] * 8, [2] * 8, [4] * 8]
    assert handles[2].stats.oom_retry and runner.requests[-1].prompt_ids == [9]
    assert e.counters.ooms == 1
    assert e.submit(req(n=2)).result() == [1, 2], "the worker lives"
    assert e.counters.served == 4


def test_admission_counts_the_whole_batch_and_a_request_that_fits_later_waits():
    e, runner = fake_engine(FakeRunner(token_delay_s=0.01), max_batch=4, admission_wait_s=0.2)
    try:
        runner.predict_bytes, runner.available_bytes = 2**30, int(2.5 * 2**30)
        handles = [e.submit(req(n=10, owner=f"o{i}")) for i in range(3)]
        for h in handles:
            h.result()
        assert e.counters.max_active == 2, "the third did not fit next to two: it waited"
        assert e.counters.refused == 0 and e.counters.served == 3
    finally:
        e.close()


def test_admission_refuses_a_request_that_would_not_fit_next_to_the_batch_with_the_numbers():
    e, runner = fake_engine(FakeRunner(token_delay_s=0.01), max_batch=4, admission_wait_s=0.2)
    try:
        runner.predict_bytes = lambda request: 3 * 2**30 if request.owner == "big" else 2**30
        runner.available_bytes, runner.held_bytes = int(1.5 * 2**30), 2**29
        runner.enqueue(list(range(100, 400)))
        small = e.submit(req(n=300, owner="small"))
        wait_for(lambda: len(small.generated) >= 2)
        with pytest.raises(
            AdmissionError, match=r"needs ~3\.00 GiB of memory but only 1\.50 GiB is free next to the 1 running request"
        ):
            e.submit(req(owner="big")).result()
        assert not small.stats, "the running request goes on"
        small.cancel()
    finally:
        e.close()


def test_a_sessions_turn_in_a_batch_reuses_its_cache(batched):
    e, runner = batched
    e.submit(req(ids=(1, 2, 3), session_id="s", n=3)).result()
    turn2 = (1, 2, 3, 1, 2, 3, 4, 5)
    other = e.submit(req(ids=(7, 8), n=20, owner="x"))
    h = e.submit(req(ids=turn2, session_id="s", n=3))
    h.result()
    other.result()
    assert h.stats.reused_tokens == 6 and h.stats.prefilled_tokens == 2


def test_a_release_that_fails_ends_its_request_with_a_message_and_the_worker_goes_on():
    """A finished slot leaves the batch before its cache is released: if the release raises, the
    caller still gets an end (it used to wait for ever), and the next request is served."""

    class BrokenRelease(FakeRunner):
        broken = True

        def release(self, slot, keep: bool) -> None:
            if self.broken:
                self.broken = False
                raise RuntimeError("the cache could not be saved")
            super().release(slot, keep)

    e, _ = fake_engine(BrokenRelease(token_delay_s=0.0), queue_size=3)
    try:
        h = e.submit(req(n=4))
        done = threading.Event()
        errors: list[Exception] = []

        def consume():
            try:
                h.result()
            except Exception as err:
                errors.append(err)
            done.set()

        threading.Thread(target=consume, daemon=True).start()
        assert done.wait(10), "the caller was never told that its request ended"
        assert errors and "the cache could not be saved" in str(errors[0])
        assert e.submit(req(n=4)).result(), "the next request got no reply"
    finally:
        e.close()


class _TightAfterOom(FakeRunner):
    """Its first decode step of two requests runs out of memory; after that less memory is free."""

    def __init__(self):
        super().__init__(token_delay_s=0.002)
        self.after: list[int] = []  # batch sizes after the OOM

    def decode(self, slots) -> bool:
        if len(slots) == 2 and self.available_bytes > 150:
            self.available_bytes = 150  # room for one request of 100, not for two
            return False
        if self.available_bytes == 150:
            self.after.append(len(slots))
        return super().decode(slots)


def test_an_oom_retry_waits_for_admission_instead_of_starting_beside_the_batch():
    runner = _TightAfterOom()
    e, _ = fake_engine(runner, max_batch=4)
    try:
        runner.predict_bytes, runner.available_bytes = 100, 1000
        runner.enqueue([1] * 12, [2] * 12, [3] * 4)  # the last one answers the retry
        first = e.submit(req(n=12, owner="a"))
        wait_for(lambda: len(first.generated) >= 1)
        second = e.submit(req(n=12, owner="b", fallback=lambda: req(ids=(9,), n=4, owner="b")))
        assert first.result() == [1] * 12 and second.result() == [3] * 4
        assert e.counters.ooms == 1 and runner.after and max(runner.after) == 1, "the retry waited for room"
    finally:
        e.close()


class _ShortAfterOom(FakeRunner):
    """50 bytes free once a prefill ran out of memory."""

    def prefill(self, slot) -> bool:
        ok = super().prefill(slot)
        if not ok:
            self.available_bytes = 50
        return ok


@pytest.mark.parametrize(("retry_bytes", "kept"), [(40, ["idle-chat"]), (60, [])])
def test_an_oom_evicts_idle_caches_only_when_the_retry_needs_their_room(retry_bytes, kept):
    e, runner = fake_engine(_ShortAfterOom(), admission_wait_s=0.1)
    try:
        runner.predict_bytes = lambda r: 100 if len(r.prompt_ids) == 4 else retry_bytes
        runner.available_bytes = 1000
        e.kv.put("idle-chat", [1, 2, 3], object(), 1000)
        runner.fail_next(oom=True).enqueue([42, 43])
        h = e.submit(dataclasses.replace(req(ids=(1, 2, 3, 4)), fallback=lambda: req(ids=(3, 4))))
        if kept:
            assert h.result() == [42, 43], "the retry fits in the 50 bytes left"
        else:
            with pytest.raises(AdmissionError):
                h.result()  # 60 does not fit in 50, even with the idle cache gone
        assert e.counters.ooms == 1 and e.kv.sessions() == kept
    finally:
        e.close()
