"""Engine time is shared between owners, not only admission: a joining prompt's chunks take turns
between owners and yield to another owner's decoding reply (engine/scheduler.py `_joining`); an
owner's running requests and prompt tokens a minute are capped (the flooder is refused, not the
others); warm-ups are optional work (dropped when busy, pre-empted, capped, never in a visitor's
estimate). The real Engine over a FakeRunner whose prefill takes a step per chunk, with a cost
log: a chunk costs CHUNK_COST units (and sleeps that many milliseconds x 4), a decode step 1."""

from __future__ import annotations

import threading
import time

import pytest

from llmweb.engine.request import GenerationRequest
from llmweb.engine.waitroom import Pace, Work, wait_s
from llmweb.errors import BusyError
from tests.fakes import FakeRunner, fake_engine, frozen_pace

CHUNK = 4  # prompt tokens per chunk
CHUNK_COST = 5  # a chunk's cost in decode steps (20 ms against 4 ms)
UNIT_S = 0.004


class ChunkRunner(FakeRunner):
    """Prefills CHUNK tokens a step; replies `reply_len[owner]` tokens; logs (cost, owner, end time)."""

    def __init__(self, reply_len: dict[str, int]):
        super().__init__(token_delay_s=UNIT_S)
        self.reply_len = reply_len
        self.log: list[tuple[int, str, float]] = []
        self.chunked = threading.Event()

    def prefill(self, slot) -> bool:
        time.sleep(UNIT_S * CHUNK_COST)
        request, stats = slot.request, slot.stats
        todo = len(request.prompt_ids) - stats.reused_tokens
        self.log.append((CHUNK_COST, request.owner, time.perf_counter()))
        self.chunked.set()
        if stats.prefilled_tokens + CHUNK < todo:
            stats.prefilled_tokens += CHUNK
            return True
        stats.prefilled_tokens = todo
        slot.state = iter(range(1000, 1000 + self.reply_len.get(request.owner, 3)))
        slot.ready = True
        self._next(slot)
        return True

    def decode(self, slots) -> bool:
        done = super().decode(slots)
        self.log.append((1, ",".join(sorted({s.request.owner for s in slots})), time.perf_counter()))
        return done

    def cost_between(self, t0: float, t1: float) -> int:
        return sum(c for c, _, t in self.log if t0 < t <= t1)


def timed(engine, runner: ChunkRunner, request: GenerationRequest) -> int:
    """The engine's work (in cost units) from submitting `request` to its end."""
    t0 = time.perf_counter()
    engine.submit(request).result()
    return runner.cost_between(t0, time.perf_counter())


def short_turn() -> GenerationRequest:
    return GenerationRequest(list(range(10, 14)), 30, owner="victim")  # one chunk, 30 tokens


def test_a_flooders_long_prompts_leave_another_owners_short_turn_within_2x():
    replies = {"victim": 30, "flooder": 400}
    runner = ChunkRunner(replies)
    engine, _ = fake_engine(runner, max_batch=4, max_new_tokens=400)
    try:
        alone = timed(engine, runner, short_turn())
        assert alone == CHUNK_COST + 29  # its one chunk (the first token), then 29 decode steps
        # two tabs of one identity, each a long message in a new chat (40 chunks of prompt)
        flood = [engine.submit(GenerationRequest(list(range(200, 360)), 400, owner="flooder")) for _ in range(2)]
        runner.chunked.clear()
        assert runner.chunked.wait(5)
        beside = timed(engine, runner, short_turn())
        assert beside <= 2 * alone, (alone, beside)
        for h in flood:
            h.cancel()
    finally:
        engine.close()


def test_prompts_take_turns_between_owners_and_one_owner_runs_at_most_its_cap():
    runner = ChunkRunner({"flooder": 400, "victim": 3})
    engine, _ = fake_engine(runner, max_batch=4, running_per_user=2, queue_per_user=4, max_new_tokens=400)
    try:
        flood = [engine.submit(GenerationRequest(list(range(200, 240)), 400, owner="flooder")) for _ in range(3)]
        assert runner.chunked.wait(5)
        victim = engine.submit(GenerationRequest(list(range(10, 22)), 3, owner="victim"))  # 3 chunks
        victim.result()
        started = [r.owner for r in runner.requests]
        assert started == ["flooder", "flooder", "victim"], "the flooder's third waits for one of its two"
        owners = [o for c, o, _ in runner.log if c == CHUNK_COST]
        first = owners.index("victim")
        assert first <= 2 and owners[first : first + 5 : 2] == ["victim"] * 3, owners
        for h in flood:
            h.cancel()
    finally:
        engine.close()


def test_the_owner_past_its_prompt_tokens_a_minute_is_refused_and_the_other_is_not():
    runner = ChunkRunner({})
    engine, _ = fake_engine(runner, max_batch=4, prompt_tokens_per_min=100)
    try:
        for _ in range(2):
            engine.submit(GenerationRequest(list(range(200, 260)), 3, owner="flooder")).result()
        with pytest.raises(BusyError, match=r"You sent 120 prompt tokens in the last minute, over .* limit of 100"):
            engine.submit(GenerationRequest(list(range(200, 260)), 3, owner="flooder"))
        engine.submit(GenerationRequest(list(range(300, 360)), 3, owner="victim")).result()
        assert engine.counters.refused == 1
    finally:
        engine.close()


class FlagRunner(FakeRunner):
    """Records (owner, small_chunks) of each prefill step."""

    def __init__(self):
        super().__init__(token_delay_s=0.002)
        self.flags: list[tuple[str, bool]] = []

    def prefill(self, slot) -> bool:
        self.flags.append((slot.request.owner, slot.small_chunks))
        return super().prefill(slot)


def test_every_strangers_prompt_goes_in_small_chunks_and_only_the_single_users_alone_keeps_full_ones():
    """Another stranger may arrive at any step and waits for the chunk that runs: a visitor's prompt
    goes in small chunks even alone (full ones kept a short turn waiting ~1.4 s behind a light
    visitor's long prompt on llama.cpp, ~3x its time alone); the single-user owner alone keeps full ones."""
    from llmweb.records import LOCAL_OWNER

    runner = FlagRunner()
    engine, _ = fake_engine(runner, max_batch=4)
    try:
        engine.submit(GenerationRequest(list(range(300)), 2, owner="light")).result()  # alone, light
        runner.enqueue(list(range(1000, 1200)))
        long = engine.submit(GenerationRequest([1, 2, 3], 200, owner=LOCAL_OWNER))
        assert runner.running.wait(5)
        engine.submit(GenerationRequest([4, 5, 6], 2, owner="other")).result()
        long.cancel()
        for ids in [list(range(300)), [1, 2, 3]]:  # the owner of a single-user install alone: full chunks
            engine.submit(GenerationRequest(ids, 2, owner=LOCAL_OWNER)).result()
        background = GenerationRequest(list(range(300)), 2, owner="light", background=True)
        engine.submit(background).result()  # a background prompt, even alone: small chunks
        assert runner.flags == [
            ("light", True),  # a stranger, alone and light: still small chunks
            (LOCAL_OWNER, False),
            ("other", True),  # beside another owner's request
            (LOCAL_OWNER, False),
            (LOCAL_OWNER, False),
            ("light", True),
        ]
    finally:
        engine.close()


# ---- warm-ups: optional work


def warmup(owner: str, n: int = 4000) -> GenerationRequest:
    return GenerationRequest(list(range(n)), 1, owner=owner, background=True, optional=True)


def test_a_running_warm_up_never_makes_a_visitors_request_refused_and_gives_way_to_it():
    runner = ChunkRunner({"visitor": 3})
    engine, _ = fake_engine(runner, max_batch=1, max_wait_s=10)
    engine.pace = frozen_pace(step_s=0.01, prefill_tok_s=100)  # the warm-up's 4,000 tokens: 40 s
    try:
        warm = engine.submit(warmup("opener"))
        assert runner.chunked.wait(5)
        t0 = time.perf_counter()
        engine.submit(GenerationRequest([1, 2, 3], 3, owner="visitor")).result()
        assert time.perf_counter() - t0 < 2, "the warm-up was pre-empted"
        warm.result()
        assert warm.stats is not None and warm.stats.finish_reason == "cancelled"
    finally:
        engine.close()


def test_a_warm_up_is_dropped_not_queued_when_the_engine_is_busy():
    runner = ChunkRunner({"visitor": 200})
    engine, _ = fake_engine(runner, max_batch=1)
    try:
        visitor = engine.submit(GenerationRequest([1, 2, 3], 200, owner="visitor"))
        assert runner.chunked.wait(5)
        with pytest.raises(BusyError, match="Warm-up dropped"):
            engine.submit(warmup("opener", 8))
        assert not engine._waiting and engine.counters.refused == 0
        visitor.cancel()
    finally:
        engine.close()


def test_warm_ups_are_capped_per_owner_and_in_all_each_minute():
    engine, _ = fake_engine(ChunkRunner({}), max_batch=4, warmups_per_min=3, warmups_per_owner_min=2)
    try:
        for owner in ("a", "a", "b"):
            engine.submit(warmup(owner, 8)).result()
        with pytest.raises(BusyError, match="visitor's warm-ups"):
            engine.submit(warmup("a", 8))
        with pytest.raises(BusyError, match="server's warm-ups"):
            engine.submit(warmup("c", 8))
        engine.submit(GenerationRequest([1, 2, 3], 2, owner="c")).result()  # a visitor's own request is taken
    finally:
        engine.close()


def test_the_prefill_rate_is_measured_on_visitors_prompts_only():
    runner = ChunkRunner({})
    engine, _ = fake_engine(runner, max_batch=4)
    try:
        engine.submit(GenerationRequest(list(range(40)), 2, owner="a", background=True)).result()
        assert engine.pace.prefill_tok_s == Pace().prefill_tok_s, "a background prefill measures nothing"
        engine.submit(GenerationRequest(list(range(40)), 2, owner="a")).result()
        assert engine.pace.prefill_tok_s != Pace().prefill_tok_s
    finally:
        engine.close()


def test_each_running_slot_frees_after_its_own_prefill_not_the_sum_of_all():
    p = Pace(prefill_tok_s=1000.0, step_s=0.1)
    running = [Work(1000, 0), Work(1000, 0), Work(1000, 0)]  # 1 s of prefill each
    assert wait_s(running, [], width=3, pace=p) == pytest.approx(1.0)


# ---- the real llama.cpp runner (slow: the embedded GGUF on the CPU)


def test_on_llama_cpp_two_tabs_of_long_prompts_leave_another_owners_short_turn_within_2x(llama_model):
    """One identity, two tabs, each a ~1,000-token message in a new chat (4 chunks of 256), beside
    another owner's short turn: that turn takes at most twice its time alone, plus the one chunk
    already running when it arrives (a chunk is never cut)."""
    from llmweb.engine.kvcache import KVStore
    from llmweb.engine.request import EngineLimits
    from llmweb.engine.runners.llama_cpp import llama_engine

    engine = llama_engine(
        llama_model.model, KVStore(0, 1), EngineLimits(max_batch=4, max_new_tokens=64, max_wait_s=3600), 2048
    )
    short = GenerationRequest(list(range(1000, 1030)), 32, owner="victim")  # no stop id: 32 tokens

    def turn() -> float:
        t0 = time.perf_counter()
        engine.submit(short).result()
        return time.perf_counter() - t0

    try:
        turn()  # one-off allocations
        alone = min(turn(), turn())
        t0 = time.perf_counter()
        engine.submit(GenerationRequest(list(range(2000, 2256)), 1, owner="probe")).result()
        chunk = time.perf_counter() - t0  # one 256-token chunk
        flood = [
            engine.submit(GenerationRequest(list(range(3000 + 1000 * i, 4000 + 1000 * i)), 64, owner="flooder"))
            for i in range(2)
        ]
        time.sleep(chunk / 2)  # the flooder's first chunk runs
        beside = turn()
        print(f"alone {alone:.2f} s, a chunk {chunk:.2f} s, beside the flood {beside:.2f} s")
        for h in flood:
            h.cancel()
        assert beside <= 2 * alone + chunk, (alone, chunk, beside)
    finally:
        engine.close()


# ---- several identities from one address: one share


def test_identities_from_one_address_share_its_running_cap_and_the_other_address_is_not_held():
    runner = ChunkRunner({"a1": 400, "a2": 400, "a3": 3, "b": 3})
    engine, _ = fake_engine(runner, max_batch=4, running_per_user=2, running_per_address=2, max_new_tokens=400)
    try:
        for owner in ("a1", "a2", "a3"):
            engine.note_address(owner, "198.51.100.7")
        engine.note_address("b", "203.0.113.9")
        flood = [engine.submit(GenerationRequest(list(range(200, 208)), 400, owner=o)) for o in ("a1", "a2")]
        assert runner.chunked.wait(5)
        third = engine.submit(GenerationRequest(list(range(10, 14)), 3, owner="a3"))  # a new identity, same address
        other = engine.submit(GenerationRequest(list(range(20, 24)), 3, owner="b"))
        other.result()
        assert [r.owner for r in runner.requests] == ["a1", "a2", "b"], "a3 waits for its address's room"
        for h in flood:
            h.cancel()
        third.result()
    finally:
        engine.close()


def test_identities_from_one_address_share_its_prompt_tokens_and_the_other_address_is_taken():
    runner = ChunkRunner({})
    engine, _ = fake_engine(runner, max_batch=4, prompt_tokens_per_min=1000, prompt_tokens_per_address_min=100)
    try:
        for owner in ("a1", "a2", "a3"):
            engine.note_address(owner, "2001:db8:1:2::/64")
        engine.note_address("b", "203.0.113.9")
        for owner in ("a1", "a2"):  # each far under its own cap
            engine.submit(GenerationRequest(list(range(200, 260)), 3, owner=owner)).result()
        with pytest.raises(BusyError, match=r"from your address sent 120 prompt tokens .* limit of 100 per address"):
            engine.submit(GenerationRequest(list(range(200, 260)), 3, owner="a3"))
        engine.submit(GenerationRequest(list(range(300, 360)), 3, owner="b")).result()
        assert engine.counters.refused == 1
    finally:
        engine.close()


class BackgroundFlagRunner(ChunkRunner):
    """ChunkRunner that also records (owner, small_chunks) of each background prefill step."""

    def __init__(self, reply_len: dict[str, int]):
        super().__init__(reply_len)
        self.background_flags: list[tuple[str, bool]] = []

    def prefill(self, slot) -> bool:
        if slot.request.background:
            self.background_flags.append((slot.request.owner, slot.small_chunks))
        return super().prefill(slot)


def test_a_background_prompt_goes_in_small_chunks_alone_and_beside_a_visitor():
    """A whole-document step reads in small chunks, alone or not: a visitor who arrives while a
    full chunk runs waits for all of it (`bench document`: first token 0.67 s beside the task
    against 0.13 s), and full chunks did not make the task faster."""
    runner = BackgroundFlagRunner({"visitor": 30})
    engine, _ = fake_engine(runner, max_batch=4)
    try:
        engine.submit(GenerationRequest(list(range(40)), 2, owner="reader", background=True)).result()
        task = engine.submit(GenerationRequest(list(range(400)), 2, owner="reader", background=True))
        deadline = time.monotonic() + 5
        while len(runner.background_flags) < 3 and time.monotonic() < deadline:
            time.sleep(0.001)
        engine.submit(GenerationRequest([1, 2, 3], 30, owner="visitor")).result()
        task.result()
        assert len(runner.background_flags) > 3 and all(small for _, small in runner.background_flags)
    finally:
        engine.close()
