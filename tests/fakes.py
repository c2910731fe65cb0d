"""Deterministic fakes for fast unit tests of pure logic (next to real-model tests, never instead),
`RunnerKind`, the real runners' handle for the parametrised engine tests, and `FaultyRunner`, the
fault injection the product does not carry."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from llmweb.engine.kvcache import reusable


class FakeFormat:
    """A ChatFormat whose tokens are whitespace-separated words, with fixed per-message overhead.

    system_ids(text) = [BOS, SYS] + words + [END]; message_ids(role, text) = [START, ROLE] + words + [END];
    the generation prompt is [START, ASSISTANT]. Word ids are stable (assigned on first sight).
    """

    BOS, SYS, START, USER, ASSISTANT, END = 1, 2, 3, 4, 5, 6

    def __init__(self):
        self.vocab: dict[str, int] = {}
        self.words: dict[int, str] = {}

    def _words(self, text: str) -> list[int]:
        ids = []
        for w in text.split():
            if w not in self.vocab:
                self.vocab[w] = 100 + len(self.vocab)
                self.words[self.vocab[w]] = w
            ids.append(self.vocab[w])
        return ids

    def system_ids(self, text: str) -> list[int]:
        return [self.BOS, self.SYS] + self._words(text) + [self.END]

    def message_ids(self, role: str, text: str) -> list[int]:
        return [self.START, self.USER if role == "user" else self.ASSISTANT] + self._words(text) + [self.END]

    def generation_prompt_ids(self) -> list[int]:
        return [self.START, self.ASSISTANT]

    def count(self, text: str) -> int:
        return len(text.split())

    def encode_prompt(self, text: str) -> list[int]:
        return self._words(text)

    def decode(self, ids: Sequence[int]) -> str:
        return " ".join(self.words[i] for i in ids if i in self.words)

    @property
    def stop_ids(self) -> frozenset[int]:
        return frozenset({self.END})

    stop_texts: tuple[str, ...] = ()


class FakeRunner:
    """A scripted, batching `Runner` for the real `Engine` (queue, batch, admission, cancel, OOM), no model.

    Like simonw/llm's `MockModel.enqueue`: `enqueue([ids...])` queues the token ids of the next
    replies, taken in the order requests start (default: the prompt's last `default_len` ids
    echoed back); a reply that runs out ends as a stop token would ("eos"). A prefill takes one
    step for the whole prompt; each decode step gives every decoding request one id and takes
    `token_delay_s`, however many requests share it (`batch_sizes` records them). `fail_next(exc)`
    makes the next prefill raise `exc` (a domain error) or, with `oom=True`, run out of memory
    (returns False, as the real runner does); `in_decode=True` aims at the next decode step
    instead. `predict_bytes` (a number, or request -> number) / `available_bytes` / `held_bytes`
    feed admission control.
    `background` (request -> ids), when set, answers the low-priority jobs (summaries) instead of
    the queue of scripted replies. Session reuse follows the real contract: the longest common
    prefix with the session's last prompt + reply, at least one token prefilled. Every request it
    started is kept in `requests`.
    """

    def __init__(self, token_delay_s: float = 0.0, default_len: int = 3, stop_id: int | None = None):
        import threading

        self.device = "cpu"
        self.token_delay_s = token_delay_s
        self.default_len = default_len
        self.stop_id = stop_id
        self.predict_bytes: int | Callable = 1
        self.available_bytes = 1 << 40
        self.held_bytes = 0  # what each running request holds
        self.requests: list = []
        self.batch_sizes: list[int] = []  # requests in each decode step
        self._replies: list[list[int]] = []
        self._failures: list = []  # prefill: exception, or None for an OOM
        self._decode_failures: list = []
        self._sessions: dict[str, list[int]] = {}
        self._active: set = set()
        self.background = None  # optional: request -> ids, the reply to background (summary) jobs
        self.running = threading.Event()  # set while a request is in the batch
        self.empties = 0

    # scripting
    def enqueue(self, *replies: Sequence[int]) -> FakeRunner:
        self._replies.extend(list(r) for r in replies)
        return self

    def fail_next(self, exc: Exception | None = None, *, oom: bool = False, in_decode: bool = False) -> FakeRunner:
        assert oom or exc is not None, "give an exception, or oom=True"
        (self._decode_failures if in_decode else self._failures).append(None if oom else exc)
        return self

    # the Runner protocol
    def predict(self, request) -> int:
        return self.predict_bytes(request) if callable(self.predict_bytes) else self.predict_bytes

    def held(self, slot) -> int:
        return self.held_bytes

    def available(self) -> int:
        return self.available_bytes

    def empty_cache(self) -> None:
        self.empties += 1

    def snapshot(self):
        from llmweb.records import MemorySnapshot

        return MemorySnapshot(rss_bytes=1)

    def busy(self, work) -> None:
        work()

    def start(self, slot) -> None:
        request = slot.request
        self.requests.append(request)
        held = self._sessions.get(request.session_id or "", [])
        slot.stats.reused_tokens = reusable(held, request.prompt_ids) if request.session_id else 0
        self._active.add(slot)
        self.running.set()

    def prefill(self, slot) -> bool:
        if self._failures:
            failure = self._failures.pop(0)
            if failure is None:
                return False
            raise failure
        request = slot.request
        if request.background and self.background is not None:
            reply = list(self.background(request))
        else:
            reply = self._replies.pop(0) if self._replies else list(request.prompt_ids)[-self.default_len :]
        slot.state = iter(reply)
        slot.stats.prefilled_tokens = slot.stats.prompt_tokens - slot.stats.reused_tokens
        slot.ready = True
        self._next(slot)
        return True

    def decode(self, slots) -> bool:
        if self._decode_failures:
            failure = self._decode_failures.pop(0)
            if failure is None:
                return False
            raise failure
        if self.token_delay_s:
            time.sleep(self.token_delay_s)
        self.batch_sizes.append(len(slots))
        for slot in slots:
            self._next(slot)
        return True

    def release(self, slot, keep: bool) -> None:
        from llmweb.records import MemorySnapshot

        if keep and slot.request.session_id:
            self._sessions[slot.request.session_id] = list(slot.request.prompt_ids) + slot.generated
        slot.stats.mem = MemorySnapshot(rss_bytes=1)
        self._active.discard(slot)
        if not self._active:
            self.running.clear()

    def _next(self, slot) -> None:
        token = next(slot.state, None)
        if token is None or token == self.stop_id:
            slot.finish = "eos"
        elif slot.request.logprobs is not None:  # made-up figures: the sampled id first, then id + 1, ...
            from llmweb.engine.request import TokenLogprob

            top = tuple((token + k, -0.5 - k) for k in range(slot.request.logprobs))
            slot.record(token, TokenLogprob(token, -0.5, top))
        else:
            slot.record(token)


def fake_engine(runner: FakeRunner | None = None, **limits):
    """The real Engine (scheduler) over a FakeRunner: (engine, runner)."""
    from llmweb.engine.kvcache import KVStore
    from llmweb.engine.request import EngineLimits
    from llmweb.engine.scheduler import Engine

    runner = runner or FakeRunner()
    return Engine(runner, KVStore(1 << 30, 600), EngineLimits(**limits)), runner


def frozen_pace(step_s: float, prefill_tok_s: float = 1e9):
    """A `Pace` that measures nothing: the waiting room's estimates follow from the work alone (a
    test sets `engine.pace` to it for exact figures)."""
    from llmweb.engine.waitroom import Pace

    pace = Pace(prefill_tok_s=prefill_tok_s, step_s=step_s)
    pace.stepped = pace.prefilled = lambda *measured: None  # type: ignore[method-assign]
    return pace


@dataclass
class RunnerKind:
    """One real runner for the parametrised engine tests (conftest's `runner` fixture): its loaded
    model, the exception its fault hook raises to inject an out-of-memory pass, and an engine maker."""

    name: str
    model: Any  # a models.LoadedModel
    oom: type[BaseException]

    def engine(self, budget_mb: int = 256, fault=None, **limits):
        from llmweb.engine.backends import make_engine
        from llmweb.engine.kvcache import KVStore
        from llmweb.engine.request import EngineLimits

        kv = KVStore(budget_mb * 2**20, ttl_s=600)
        engine = make_engine(self.model, kv, EngineLimits(**limits))
        if fault is not None:
            with_fault(engine, fault)
        return engine


class FaultyRunner:
    """A real local runner with `fault(index)` called before each of its model passes (`index`:
    the passes counted here, from 0). What `fault` raises is raised inside the pass, where the
    runner's own out-of-memory handling meets it, so a test of recovery tests the runner's (the
    transformers batch cropped back after a failed step, llama.cpp's memory as it was). Hooked on
    the runner's one pass primitive: a transformers model's call, llama.cpp's `llama_decode`.
    Every other attribute is the runner's; `fault = None` disarms it."""

    def __init__(self, inner, fault: Callable[[int], None] | None):
        self.inner = inner
        self.fault = fault
        self.forwards = 0
        if hasattr(inner, "ll"):  # LlamaRunner: its llama_cpp module
            inner.ll = _Hooked(inner.ll, self._pass)
        else:  # LocalRunner: its model
            inner.model = _HookedModel(inner.model, self._pass)

    def _pass(self) -> None:
        index, self.forwards = self.forwards, self.forwards + 1
        if self.fault is not None:
            self.fault(index)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


class _Hooked:
    """llama_cpp with `before()` called ahead of each llama_decode."""

    def __init__(self, ll, before: Callable[[], None]):
        self._ll, self._before = ll, before

    def llama_decode(self, *args):
        self._before()
        return self._ll.llama_decode(*args)

    def __getattr__(self, name: str):
        return getattr(self._ll, name)


class _HookedModel:
    """A torch model with `before()` called ahead of each forward pass."""

    def __init__(self, model, before: Callable[[], None]):
        self._model, self._before = model, before

    def __call__(self, **inputs):
        self._before()
        return self._model(**inputs)

    def __getattr__(self, name: str):
        return getattr(self._model, name)


def with_fault(engine, fault: Callable[[int], None] | None) -> FaultyRunner:
    """`engine`'s runner wrapped in a FaultyRunner (before it runs anything); the wrapper."""
    faulty = FaultyRunner(engine.runner, fault)
    engine.runner = faulty
    return faulty
