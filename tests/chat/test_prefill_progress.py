"""A prompt that takes over a second to read shows its progress ("Reading your message and this chat:
1,200 of 3,400 tokens…"), through the real Engine and the chat turn; a short one shows none."""

from __future__ import annotations

import time

import pytest

from llmweb.chat.context import Budget
from llmweb.chat.session import Chat, Progress
from llmweb.store.db import Store
from tests.conftest import make_settings
from tests.fakes import FakeFormat, FakeRunner, fake_engine

OWNER = "anon:visitor-a"


class SlowPrefill(FakeRunner):
    """Reads a prompt 20 tokens a step, `step_s` each (the FakeRunner reads it in one)."""

    step_s = 0.2

    def prefill(self, slot) -> bool:
        time.sleep(self.step_s)
        todo = slot.stats.prompt_tokens - slot.stats.reused_tokens
        if slot.stats.prefilled_tokens + 20 < todo:
            slot.stats.prefilled_tokens += 20
            return True
        return super().prefill(slot)


@pytest.fixture
def rig(tmp_path):
    engine, runner = fake_engine(SlowPrefill())
    store = Store(tmp_path / "chat.sqlite3")
    budget = Budget(600, 20, summary_tokens=30, retrieved_tokens=40, user_tokens=400)
    chat = Chat(make_settings(tmp_path, recall=False), engine, FakeFormat(), store, budget)
    yield chat, runner
    engine.close()
    store.close()


def test_a_long_prefill_reports_its_progress_and_a_short_one_none(rig):
    chat, runner = rig
    events = list(chat.send(OWNER, None, "long " * 300))  # 15 steps of 0.2 s
    shown = [e for e in events if isinstance(e, Progress)]
    assert shown, "a 3 s prefill shows its progress"
    total = events[-1].stats.gen.prompt_tokens
    assert all(e.total == total for e in shown) and shown[-1].done < total
    assert [e.done for e in shown] == sorted(e.done for e in shown)
    assert shown[-1].text == f"Reading your message and this chat: {shown[-1].done:,} of {total:,} tokens…"
    runner.step_s = 0.01
    assert not [e for e in chat.send(OWNER, None, "short") if isinstance(e, Progress)]
