"""A visitor's prompt is prefilled before a background one's (engine/scheduler.py `_run`): a turn that
arrives while a long background prompt (a summary, a whole-document step) is half prefilled waits
one chunk, not the rest of that prompt. A FakeRunner whose prefill takes one step per chunk."""

from __future__ import annotations

import threading
import time

from llmweb.engine.request import GenerationRequest
from llmweb.engine.turns import BACKGROUND_EVERY
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


class DecodeLog(ChunkedRunner):
    """ChunkedRunner that also logs each decode step with a visitor in it (as "decode-v")."""

    def __init__(self):
        super().__init__()
        self.decoding = threading.Event()

    def decode(self, slots) -> bool:
        if any(not s.request.background for s in slots):
            self.order.append("decode-v")
            self.decoding.set()
        return super().decode(slots)


def test_a_background_prompt_takes_a_chunk_every_few_steps_while_a_visitor_decodes():
    runner = DecodeLog()
    runner.token_delay_s = 0.01
    runner.enqueue(list(range(100, 180)))  # the visitor's 80-token reply
    engine, _ = fake_engine(runner, max_batch=4)
    try:
        visitor = engine.submit(GenerationRequest([4, 5, 6], 80, owner="visitor"))
        assert runner.decoding.wait(5)
        background = engine.submit(GenerationRequest([1, 2, 3], 2, owner="reader", background=True))
        visitor.result()
        background.result()
        order = runner.order
        last_visitor_step = max(i for i, o in enumerate(order) if o == "decode-v")
        chunks = [i for i, o in enumerate(order) if o == "reader"]
        assert len(chunks) == CHUNKS  # it still got through
        during = [i for i in chunks if i < last_visitor_step]
        assert len(during) >= 3, order
        gaps = [b - a for a, b in zip(during, during[1:], strict=False)]
        assert min(gaps) >= BACKGROUND_EVERY, order  # the visitor's decode steps in between
    finally:
        engine.close()


class TimedChunks(DecodeLog):
    """DecodeLog whose background chunks take 50 ms each (a visitor's decode step 5 ms), timed."""

    def __init__(self):
        super().__init__()
        self.spans: list[tuple[float, float]] = []  # (start, end) of each background chunk

    def prefill(self, slot) -> bool:
        if not slot.request.background:
            return super().prefill(slot)
        t0 = time.perf_counter()
        time.sleep(0.03)  # plus ChunkedRunner's 20 ms
        done = super().prefill(slot)
        self.spans.append((t0, time.perf_counter()))
        return done


def test_a_background_prompt_gets_at_most_its_share_of_the_time_while_a_visitor_decodes():
    from llmweb.engine.turns import BACKGROUND_SHARE

    runner = TimedChunks()
    runner.token_delay_s = 0.005
    runner.enqueue(list(range(100, 2100)))  # the visitor's reply: long enough to cover every chunk
    engine, _ = fake_engine(runner, max_batch=4, max_new_tokens=2000)
    try:
        visitor = engine.submit(GenerationRequest([4, 5, 6], 2000, owner="visitor"))
        assert runner.decoding.wait(5)
        background = engine.submit(GenerationRequest([1, 2, 3], 2, owner="reader", background=True))
        background.result()
        busy = visitor.stats is None  # the visitor still decoding all along
        visitor.cancel()
        assert busy and len(runner.spans) == CHUNKS, (busy, len(runner.spans), len(visitor.generated))
        for (s0, e0), (s1, _e1) in zip(runner.spans, runner.spans[1:]):
            assert s1 - e0 >= (e0 - s0) * (1 / BACKGROUND_SHARE - 1) * 0.99, "the visitor got its share first"
    finally:
        engine.close()
