"""What the engine, its callers and its runners share: a request, its events, its `Handle`, its
`Slot` in the batch, the `Runner` protocol, and the engine's limits and counters.

    submit(GenerationRequest) -> Handle       (engine/scheduler.py; BusyError over the owner's cap or
                                              the waiting room's bound, engine/waitroom.py)
    for event in handle.events(): ...        Waiting(position, wait_s) | Prefilling(done, total) |
                                              Tokens(ids) | Restarted(reason); raises domain errors
    handle.generated                          the ids of the reply so far (reset by Restarted)
    handle.stats                              GenerationStats once finished
    handle.cancel()                           stops within a step (one token or one prefill chunk)
                                              and leaves the batch; a queued request leaves the
                                              queue at once

Owns: these records and their small behaviour (a handle's event stream, a slot's recording of
the ids a runner samples). Must not: schedule (the fair queue is queue.py, admission and the OOM
policy admission.py, the loop scheduler.py), import torch, or know text: ids only.
"""

from __future__ import annotations

import contextvars
import dataclasses
import itertools
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from llmweb.engine.constraint import Constraint
from llmweb.errors import LlmwebError, TimedOut
from llmweb.records import GenerationStats, MemorySnapshot


@dataclass(frozen=True)
class GenerationRequest:
    prompt_ids: Sequence[int]
    max_new_tokens: int
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    loop_guard: bool = False  # a reply may not say a sentence a third time (runners/loopguard.py)
    seed: int | None = None
    stop_ids: frozenset[int] = frozenset()
    session_id: str | None = None  # KV-cache reuse key; None = no reuse
    owner: str = ""  # who asked, for the fair queue; "" = nobody in particular (the CLI), one owner too
    background: bool = False  # low priority (summaries); never counted as "waiting" for users
    optional: bool = False  # background work that may be dropped (a warm-up): refused when busy, pre-empted
    timeout_s: float | None = None  # from the start of processing
    fallback: Callable[[], GenerationRequest | None] | None = None  # smaller request for the OOM retry
    # the reply must match this grammar (engine/constraint.py); the loop guard and the penalty are off
    constraint: Constraint | None = None
    # None: no log-probabilities (nothing computed); k (0..MAX_TOP_LOGPROBS): each sampled id's
    # log-probability under the model's raw distribution, and the k most likely ids' (`TokenLogprob`)
    logprobs: int | None = None


MAX_TOP_LOGPROBS = 20  # as OpenAI's top_logprobs


@dataclass(frozen=True)
class TokenLogprob:
    """A sampled id's log-probability under the model's raw distribution (log-softmax of the logits,
    before the repetition penalty, the loop guard's ban, temperature and top-p, as llama-server and
    vLLM report them), and the `top` most likely ids with theirs, most likely first. Plain data: it
    crosses the engine process's wire and a ZeroGPU call's pickle."""

    id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def capped(request: GenerationRequest, cap: int) -> GenerationRequest:
    """The request with at most `cap` new tokens."""
    if request.max_new_tokens <= cap:
        return request
    return dataclasses.replace(request, max_new_tokens=cap)


@dataclass(frozen=True)
class Waiting:
    position: int  # 1 = next
    wait_s: float = 0.0  # the estimated wait until it starts (engine/waitroom.py)


@dataclass(frozen=True)
class Prefilling:
    """A prompt still being read, past PREFILL_SHOWN_S: `done` of its `total` tokens (reused ones included)."""

    done: int
    total: int


PREFILL_SHOWN_S = 1.0  # a prefill that takes longer than this reports its progress (`Handle.events`)


@dataclass(frozen=True)
class Tokens:
    ids: list[int]
    logprobs: list[TokenLogprob] | None = None  # one per id, when the request asked (`logprobs`)


@dataclass(frozen=True)
class Restarted:
    """The ids streamed so far are void (`handle.generated` is empty again); a retry starts over."""

    reason: str  # "oom": ran out of memory; "context_length": a remote server refused the prompt's
    # length (`GiveWay`); either way, retrying with the request's smaller fallback


_DONE = object()


class GiveWay(Exception):
    """Raised by a runner's `prefill`: the backend refused the prompt as it is (a remote server's
    "maximum context length"). The request retries once with its smaller `fallback`, as after an
    out-of-memory pass (`Restarted(reason)`); without one, or on the retry, it fails with `message`."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason, self.message = reason, message


class Queued(Protocol):
    """The engine as a handle sees it: where its request waits, and how it leaves the queue."""

    def position(self, handle: Handle) -> int: ...

    def wait(self, handle: Handle) -> tuple[int, float]: ...  # (position, estimated seconds); (0, 0) once running

    def prefilling(self, handle: Handle) -> tuple[int, int] | None: ...  # (done, total) while a long prefill runs

    def withdraw(self, handle: Handle) -> None: ...


class Handle:
    """A submitted request: stream its events, cancel it, read its stats when done."""

    _ids = itertools.count(1)

    def __init__(self, request: GenerationRequest, engine: Queued):
        self.id = next(self._ids)
        self.request = request
        self._engine = engine
        self._events: queue.Queue = queue.Queue()
        self._cancel = threading.Event()
        self.submitted = time.perf_counter()
        self.stats: GenerationStats | None = None
        self.error: LlmwebError | None = None
        self.generated: list[int] = []
        self.logprobs: list[TokenLogprob] = []  # one per generated id, when the request asked
        # the submitter's context (a Gradio handler's carries its request): a ZeroGPU call for this
        # request is made in it (engine/runners/zerogpu.py)
        self.context = contextvars.copy_context()

    def cancel(self) -> None:
        """Stop this request: a running one within a token, a queued one at once (it leaves the queue)."""
        self._cancel.set()
        self._engine.withdraw(self)

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    @property
    def position(self) -> int:
        """1-based place in the serving order of the waiting interactive requests (round-robin
        between owners: a new owner can come in ahead); 0 once running or done."""
        return self._engine.position(self)

    def events(self, poll_s: float = 0.5) -> Iterator[Waiting | Prefilling | Tokens | Restarted]:
        """Yield Waiting (the position and the estimated wait) every `poll_s` while queued, then
        Prefilling every `poll_s` while a prefill past PREFILL_SHOWN_S runs, then Tokens as they
        come (Restarted before an OOM retry); raise the request's error if any.

        Waiting repeats even when the position has not changed: a consumer that streams to a
        client (a Gradio generator) only learns that its client left when it yields, and must not
        sit silently in the queue until its turn comes.
        """
        while True:
            try:
                item = self._events.get(timeout=poll_s)
            except queue.Empty:
                pos, wait = self._engine.wait(self)
                if pos:
                    yield Waiting(pos, wait)
                elif (filled := self._engine.prefilling(self)) is not None:
                    yield Prefilling(*filled)
                continue
            if item is _DONE:
                if self.error is not None:
                    raise self.error
                return
            yield item

    def result(self) -> list[int]:
        """Block until done; return all generated ids (raises the request's error)."""
        for _ in self.events():
            pass
        return list(self.generated)

    # worker side
    def _emit(self, ids: list[int], logprobs: list[TokenLogprob] | None = None) -> None:
        self.generated.extend(ids)
        if logprobs:
            self.logprobs.extend(logprobs)
        self._events.put(Tokens(ids, logprobs))

    def _restart(self, reason: str) -> None:
        self.generated = []  # a new list: a reader never sees the old ids and new ones mixed
        self.logprobs = []
        self._events.put(Restarted(reason))

    def _finish(self, stats: GenerationStats | None, error: LlmwebError | None = None) -> None:
        self.stats, self.error = stats, error
        self._events.put(_DONE)


@dataclass(eq=False)
class Slot:
    """One admitted request in the running batch: the engine's bookkeeping, and the runner's `state`.

    The runner calls `record(id)` for every id it samples; the slot streams it, or finishes on a
    stop id or the length cap (`finish`). The engine sets `finish` on a cancel or the time limit,
    and the slot leaves the batch at the end of that step.
    """

    handle: Handle
    request: GenerationRequest
    predicted: int  # admission's figure for this request's peak memory
    timeout: float
    stats: GenerationStats
    retried: bool = False  # this is the retry of the request (its fallback)
    retry_reason: str = "oom"  # why: "oom", or the runner's `GiveWay` reason ("context_length")
    t0: float = dataclasses.field(default_factory=time.perf_counter)  # start of processing
    ready: bool = False  # the prompt is prefilled: the slot decodes with the batch
    small_chunks: bool = False  # the scheduler's: prefill in the runner's small chunks (a chunk is never cut)
    finish: str | None = None  # eos | length | cancelled | timeout | error: it leaves after this step
    error: LlmwebError | None = None  # set by the runner with finish="error": this request alone fails
    generated: list[int] = dataclasses.field(default_factory=list)
    t_first: float | None = None
    t_last: float | None = None
    state: Any = None  # the runner's: caches, sampler

    def record(self, token: int, logprob: TokenLogprob | None = None) -> None:
        """The runner sampled `token` for this request (with its `logprob` when the request asked):
        stream it, or finish on a stop id / the cap."""
        now = time.perf_counter()
        if self.t_first is None:
            self.t_first = now
            self.stats.ttft_s = now - self.t0
        if token in self.request.stop_ids:
            self.finish = "eos"
            return
        self.t_last = now
        self.generated.append(token)
        self.handle._emit([token], [logprob] if logprob is not None else None)
        if len(self.generated) >= self.request.max_new_tokens:
            self.finish = "length"

    def fed_ids(self, prompt: list[int], filled: int) -> list[int]:
        """The ids a runner's cache holds once this slot stops: a prefill stopped early holds the
        prompt's first `filled`; else the prompt and every generated id but the last (it was sampled,
        never fed), or all of them after a stop id (the stop id is not kept)."""
        if filled < len(prompt):
            return prompt[:filled]
        return prompt + (self.generated if self.finish == "eos" else self.generated[:-1])

    def conclude(self) -> LlmwebError | None:
        """The slot has left the batch: fill in its stats; return the error it ends with, if any
        (its partial reply stays in `handle.generated`)."""
        stats, n = self.stats, len(self.generated)
        stats.finish_reason, stats.generated_tokens = self.finish or "", n
        stats.oom_retry = self.retried and self.retry_reason == "oom"
        stats.total_s = time.perf_counter() - self.t0
        if n > 1 and self.t_first is not None and self.t_last is not None:
            stats.decode_tok_s = (n - 1) / max(self.t_last - self.t_first, 1e-9)
        if stats.finish_reason == "timeout":
            return TimedOut(f"Stopped after {stats.total_s:.0f} s: the time limit per request is {self.timeout:.0f} s.")
        return self.error

    def stop_reason(self) -> str | None:
        """Why the engine must stop this request now: "cancelled", "timeout", or None to go on."""
        if self.handle.cancelled:
            return "cancelled"
        if time.perf_counter() - self.t0 > self.timeout:
            return "timeout"
        return None


class Runner(Protocol):
    """Runs the batch on a model, one step at a time, for the engine's worker thread.

    `prefill` and `decode` return False when the device ran out of memory (never raise it: the
    failed pass's frames must be gone before anyone retries); after a failed `decode` every cache
    is as it was before the step.
    """

    device: str

    def predict(self, request: GenerationRequest) -> int: ...  # peak bytes: KV to the end + activations

    def held(self, slot: Slot) -> int: ...  # bytes of KV the slot holds now

    def available(self) -> int: ...

    def busy(self, work: Callable[[], None]) -> None: ...  # run a busy period (the runner may wrap it)

    def start(self, slot: Slot) -> None: ...  # take the session's cache (prefix reuse); no forward pass

    def prefill(self, slot: Slot) -> bool: ...  # one prompt chunk; the last one samples the first id

    def decode(self, slots: list[Slot]) -> bool: ...  # one id for each slot, in one batched forward pass

    def release(self, slot: Slot, keep: bool) -> None: ...  # leave the batch; keep the session's cache

    def empty_cache(self) -> None: ...

    def snapshot(self) -> MemorySnapshot: ...


class Unmetered:
    """The memory half of a `Runner` whose memory is elsewhere (a remote server, a ZeroGPU call):
    nothing to predict, hold or release here, and a busy period that is just the work."""

    def predict(self, request: GenerationRequest) -> int:
        return 0

    def held(self, slot: Slot) -> int:
        return 0

    def available(self) -> int:
        return 1 << 62

    def busy(self, work: Callable[[], None]) -> None:
        work()

    def empty_cache(self) -> None:
        return None


@dataclass
class EngineLimits:
    queue_size: int = 8  # background jobs (summaries) waiting: 4 x this; interactive ones are bounded by the wait
    queue_per_user: int = 2  # interactive requests waiting per owner; more from that owner get BusyError
    # a single-user install's one owner: its own parallel requests (an agent fans out its calls) wait,
    # up to 4 x queue_size, bounded by max_wait_s as everyone's are; "" = every owner is capped
    uncapped_owner: str = ""
    max_wait_s: float = 120.0  # a request whose estimated wait is longer is refused (engine/waitroom.py)
    max_new_tokens: int = 256
    request_timeout_s: float = 120.0
    admission_wait_s: float = 10.0
    mem_limit_bytes: int = 0  # CPU: RSS limit; 0 = no limit
    mem_margin_bytes: int = 512 * 2**20  # CUDA: keep this much free
    frag_release_bytes: int = 256 * 2**20
    kv_reuse: bool = True
    max_batch: int = 1  # requests sharing each decode step; 1 = serial (the app: LLMWEB_MAX_BATCH)
    running_per_user: int = 0  # interactive requests one owner may have in the batch; 0 = no cap
    prompt_tokens_per_min: int = 0  # prompt tokens one owner's requests may prefill a minute; 0 = no cap
    # ... and all the owners of one client address together (the web layer names each owner's address
    # group: `Engine.note_address`); several identities from one address are one share; 0 = no cap
    running_per_address: int = 0
    prompt_tokens_per_address_min: int = 0
    warmups_per_min: int = 0  # optional jobs (warm-ups) accepted a minute, all owners together; 0 = no cap
    warmups_per_owner_min: int = 0  # ... and from one owner; 0 = no cap


def auto_max_batch(on_cpu: bool) -> int:
    """LLMWEB_MAX_BATCH=0: requests per decode step by device (a GPU has far more idle compute per step)."""
    return 4 if on_cpu else 8


@dataclass
class EngineCounters:
    active: int = 0  # requests in the batch now
    max_active: int = 0  # the largest batch so far
    served: int = 0
    ooms: int = 0
    refused: int = 0
    idle_releases: int = 0  # allocator caches emptied while idle (release_fragmentation)
    idle_released_bytes: int = 0  # reserved bytes those gave back to the device
