"""Engine.cancel_owner ("Delete all my data"): every request of one owner ends, waiting or
running, replies and background jobs alike; another owner's run on. Real Engine, scripted FakeRunner."""

from __future__ import annotations

import pytest

from llmweb.engine.request import GenerationRequest
from llmweb.errors import Cancelled
from tests.fakes import FakeRunner, fake_engine


def request(owner: str, *, background: bool = False) -> GenerationRequest:
    return GenerationRequest(prompt_ids=[1, 2, 3], max_new_tokens=40, owner=owner, background=background)


def test_cancel_owner_ends_that_owners_requests_only():
    engine, runner = fake_engine(FakeRunner(token_delay_s=0.02), max_batch=2)
    try:
        runner.enqueue(*[list(range(100, 140))] * 5)
        a_running = engine.submit(request("anon:a"))
        b_running = engine.submit(request("anon:b"))
        assert runner.running.wait(5)
        a_waiting = engine.submit(request("anon:a"))
        a_summary = engine.submit(request("anon:a", background=True))
        b_waiting = engine.submit(request("anon:b"))
        assert engine.cancel_owner("anon:a") == 3
        a_running.result()  # stopped within a token: its partial reply, marked cancelled
        assert a_running.stats.finish_reason == "cancelled" and len(a_running.generated) < 40
        for h in (a_waiting, a_summary):
            with pytest.raises(Cancelled):
                h.result()
        assert len(b_running.result()) == 40 and b_running.stats.finish_reason == "length"
        assert len(b_waiting.result()) == 40
        assert engine.cancel_owner("anon:a") == 0, "nothing of theirs is left"
    finally:
        engine.close()
