"""A visitor's prompt is prefilled before a background one's (engine/scheduler.py `_run`): a turn that
arrives while a long background prompt (a summary, a whole-document step) is half prefilled waits
one chunk, not the rest of that prompt. A FakeRunner whose prefill takes one step per chunk."""

from __future__ import annotations

import threading
import time

from llmweb.engine.request import GenerationRequest
from tests.fakes import FakeRunner, fake_engine

CHUNKS = 20  # steps each prompt's prefill takes


class ChunkedRunner(FakeRunner):
    def __init__(self):
        super().__init__(token_delay_s=0.0)
        self.order: list[str] = []  # the owner of each prefill step, in order
        self.left: dict[int, int] = {}
        self.first_chunk = threading.Event()

    def prefill(self, slot) -> bool:
        key = slot.handle.id  # (an id() may be reused once a slot is gone)
        self.left.setdefault(key, CHUNKS)
        self.order.append(slot.request.owner)
        self.first_chunk.set()
        time.sleep(0.02)
        self.left[key] -= 1
        if self.left[key]:
            return True  # not ready yet: another chunk next step
        return super().prefill(slot)


def test_a_visitors_prefill_overtakes_a_background_prompt_half_read():
    runner = ChunkedRunner()
    engine, _ = fake_engine(runner, max_batch=4)
    try:
        background = engine.submit(GenerationRequest([1, 2, 3], 2, owner="reader", background=True))
        assert runner.first_chunk.wait(5)
        visitor = engine.submit(GenerationRequest([4, 5, 6], 2, owner="visitor"))
        visitor.result()
        background.result()
        first = runner.order.index("visitor")
        assert first < CHUNKS, "the visitor came in while the background prompt was half read"
        assert runner.order[first : first + CHUNKS] == ["visitor"] * CHUNKS, runner.order
        assert runner.order.count("reader") == CHUNKS
    finally:
        engine.close()
