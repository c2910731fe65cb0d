"""The generation engine: ONE worker thread owns the model and runs a batch; everyone else submits.

The engine speaks token ids. It knows nothing of text, chat templates, retrieval or the UI, and
it does not import torch: it schedules (queue, fairness, priorities, admission of the whole batch,
cancel, time limits, OOM retry) and a `Runner` runs the batch on the model one step at a time
(engine/local.py: `LocalRunner`; engine/remote.py: `RemoteRunner`, an OpenAI-compatible server; tests use a
scripted `FakeRunner`). `local_engine(...)` / `remote.remote_engine(...)` wire the two.

    submit(GenerationRequest) -> Handle       (bounded queue, and per owner; BusyError when full)
    for event in handle.events(): ...        Waiting(position) | Tokens(ids) | Restarted(reason);
                                              raises domain errors
    handle.generated                          the ids of the reply so far (reset by Restarted)
    handle.stats                              GenerationStats once finished
    handle.cancel()                           stops within a step (one token or one prefill chunk)
                                              and leaves the batch; a queued request leaves the
                                              queue at once

Whoever submits (UI, API, CLI, tests), requests go through this one worker: Gradio's concurrency
limits are per event group and guarantee nothing (docs/architecture.md). Strangers share one server, so the
interactive queue is fair between owners (`GenerationRequest.owner`; "" is one owner too): each
owner may have `queue_per_user` requests waiting (running ones do not count), and the owners take
turns, round-robin (`FairQueue`: the owner served least recently goes next; one owner's requests
first-in first-out). `handle.position` counts what is really ahead in that order, so it can grow
when a new owner arrives. Background jobs (summaries) start only when no interactive request
waits; they have their own bound and no per-owner cap.

The worker's loop is schedule() -> step() -> leave:
  schedule  admit waiting requests while the batch has fewer than `max_batch` (LLMWEB_MAX_BATCH)
            and the whole batch's predicted memory fits (each running request's prediction minus
            the KV it already holds, plus the newcomer's); a request that does not fit waits at
            the head of the line until the batch shrinks; one that would not fit even alone is
            refused with the numbers after idle caches were evicted and `admission_wait_s`;
  step      one prompt chunk of the oldest joining request (its session's cache reused: only new
            tokens are prefilled), then one batched decode pass that gives every decoding request
            its next token; a request joins the decode batch once its prompt is in;
  leave     a request that finished, was cancelled or ran out of time leaves at the end of that
            step; its session keeps its cache.
Running out of device memory in a pass (the runner returns False, its frames already freed) makes
one request give way: the joining one in a prefill, the youngest in a decode (the others' caches
are as before the pass and they go on). Its cache is freed, idle caches are evicted, the
allocator is emptied, and it retries once with its smaller `fallback` (the ids already streamed
are void: `Restarted` tells the consumer to start the reply over); the worker itself never dies.

When idle, the worker expires old session caches and, on CUDA, empties the allocator cache once
reserved − allocated passes `frag_release_bytes` (`release_fragmentation`, counted in
`counters.idle_releases`). Every request's stats carry the memory snapshot after it, including
the allocator's fragmentation figures on CUDA, and the largest batch it decoded in.
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from llmweb.engine.kvcache import KVStore
from llmweb.errors import AdmissionError, BusyError, Cancelled, LlmwebError, OutOfMemory, TimedOut
from llmweb.records import GenerationStats, MemorySnapshot

log = logging.getLogger(__name__)

PREFILL_CHUNK = 512  # prompt tokens per forward pass during prefill
ACTIVATION_MARGIN = 0.15  # of the KV prediction, plus a fixed floor (below)
ACTIVATION_FLOOR = 64 * 2**20


@dataclass(frozen=True)
class GenerationRequest:
    prompt_ids: Sequence[int]
    max_new_tokens: int
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop_ids: frozenset[int] = frozenset()
    session_id: str | None = None  # KV-cache reuse key; None = no reuse
    owner: str = ""  # who asked, for the fair queue; "" = nobody in particular (the CLI), one owner too
    background: bool = False  # low priority (summaries); never counted as "waiting" for users
    timeout_s: float | None = None  # from the start of processing
    fallback: Callable[[], GenerationRequest | None] | None = None  # smaller request for the OOM retry


@dataclass(frozen=True)
class Waiting:
    position: int  # 1 = next


@dataclass(frozen=True)
class Tokens:
    ids: list[int]


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


class Handle:
    """A submitted request: stream its events, cancel it, read its stats when done."""

    _ids = itertools.count(1)

    def __init__(self, request: GenerationRequest, engine: Engine):
        self.id = next(self._ids)
        self.request = request
        self._engine = engine
        self._events: queue.Queue = queue.Queue()
        self._cancel = threading.Event()
        self.submitted = time.perf_counter()
        self.stats: GenerationStats | None = None
        self.error: LlmwebError | None = None
        self.generated: list[int] = []

    def cancel(self) -> None:
        """Stop this request: a running one within a token, a queued one at once (it leaves the queue)."""
        self._cancel.set()
        self._engine._withdraw(self)

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    @property
    def position(self) -> int:
        """1-based place in the serving order of the waiting interactive requests (round-robin
        between owners: a new owner can come in ahead); 0 once running or done."""
        return self._engine.position(self)

    def events(self, poll_s: float = 0.5) -> Iterator[Waiting | Tokens | Restarted]:
        """Yield Waiting every `poll_s` while queued, then Tokens as they come (Restarted before an
        OOM retry); raise the request's error if any.

        Waiting repeats even when the position has not changed: a consumer that streams to a
        client (a Gradio generator) only learns that its client left when it yields, and must not
        sit silently in the queue until its turn comes.
        """
        while True:
            try:
                item = self._events.get(timeout=poll_s)
            except queue.Empty:
                pos = self.position
                if pos:
                    yield Waiting(pos)
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
    def _emit(self, ids: list[int]) -> None:
        self.generated.extend(ids)
        self._events.put(Tokens(ids))

    def _restart(self, reason: str) -> None:
        self.generated = []  # a new list: a reader never sees the old ids and new ones mixed
        self._events.put(Restarted(reason))

    def _finish(self, stats: GenerationStats | None, error: LlmwebError | None = None) -> None:
        self.stats, self.error = stats, error
        self._events.put(_DONE)


class FairQueue:
    """Waiting interactive requests, served round-robin between owners (`request.owner`).

    `pop` takes the first request of the owner served least recently (never served counts as
    least; ties go to the owner whose first request arrived first); one owner's requests leave
    first-in first-out. Only the last `remember` owners' turns are kept: an owner forgotten is
    the one served longest ago, and as never served it still goes before all those remembered.
    Not thread-safe: the engine holds its lock around every call.
    """

    remember = 1024

    def __init__(self) -> None:
        self._owners: dict[str, deque[tuple[int, Handle]]] = {}  # owner -> (arrival, handle), oldest first
        self._served: dict[str, int] = {}  # owner -> turn of its last pop, oldest first
        self._arrivals = itertools.count()
        self._turns = itertools.count()

    def __len__(self) -> int:
        return sum(len(q) for q in self._owners.values())

    def waiting(self, owner: str) -> int:
        return len(self._owners.get(owner, ()))

    def push(self, handle: Handle) -> None:
        self._owners.setdefault(handle.request.owner, deque()).append((next(self._arrivals), handle))

    def peek(self) -> Handle:
        """The next request to serve (IndexError when empty)."""
        return self._owners[self._order()[0]][0][1]

    def pop(self) -> Handle:
        """Take the next request to serve out (IndexError when empty)."""
        handle = self.peek()
        self.take(handle)
        return handle

    def take(self, handle: Handle) -> bool:
        """Take a request out to serve it: its owner's turn is spent. False if it is not waiting here."""
        owner = handle.request.owner
        if not self.remove(handle):
            return False
        self._served.pop(owner, None)
        self._served[owner] = next(self._turns)
        if len(self._served) > self.remember:
            del self._served[next(iter(self._served))]
        return True

    def remove(self, handle: Handle) -> bool:
        """Take a request out (a cancel); False if it is not waiting here."""
        owner = handle.request.owner
        queue_ = self._owners.get(owner)
        if queue_ is None:
            return False
        for item in queue_:
            if item[1] is handle:
                queue_.remove(item)
                if not queue_:
                    del self._owners[owner]
                return True
        return False

    def position(self, handle: Handle) -> int:
        """1 = served next, if nothing new arrives; 0 = not waiting here.

        The owners take turns in `_order()`, one request each per round, so ahead of the request
        at index i of its owner's queue are i requests (or all there are) of every owner, plus
        the i-th of each owner whose turn comes earlier in the round.
        """
        owner = handle.request.owner
        mine = [h for _, h in self._owners.get(owner, ())]
        if handle not in mine:
            return 0
        i = mine.index(handle)
        order = self._order()
        earlier = order[: order.index(owner)]
        return sum(min(len(self._owners[o]), i) for o in order) + sum(len(self._owners[o]) > i for o in earlier) + 1

    def drain(self) -> list[Handle]:
        """Take every waiting request out (at shutdown)."""
        handles = [h for q in self._owners.values() for _, h in q]
        self._owners.clear()
        return handles

    def _order(self) -> list[str]:
        """The owners with requests waiting, in the order of their next turns."""
        return sorted(self._owners, key=lambda o: (self._served.get(o, -1), self._owners[o][0][0]))


@dataclass
class EngineLimits:
    queue_size: int = 8  # interactive requests waiting, in all
    queue_per_user: int = 2  # of those, per owner; more from that owner get BusyError
    max_new_tokens: int = 256
    request_timeout_s: float = 120.0
    admission_wait_s: float = 10.0
    mem_limit_bytes: int = 0  # CPU: RSS limit; 0 = no limit
    mem_margin_bytes: int = 512 * 2**20  # CUDA: keep this much free
    frag_release_bytes: int = 256 * 2**20
    kv_reuse: bool = True
    max_batch: int = 1  # requests sharing each decode step; 1 = serial (the app: LLMWEB_MAX_BATCH)


@dataclass
class _Counters:
    active: int = 0  # requests in the batch now
    max_active: int = 0  # the largest batch so far
    served: int = 0
    ooms: int = 0
    refused: int = 0
    idle_releases: int = 0  # allocator caches emptied while idle (release_fragmentation)
    idle_released_bytes: int = 0  # reserved bytes those gave back to the device


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
    finish: str | None = None  # eos | length | cancelled | timeout | error: it leaves after this step
    error: LlmwebError | None = None  # set by the runner with finish="error": this request alone fails
    generated: list[int] = dataclasses.field(default_factory=list)
    t_first: float | None = None
    t_last: float | None = None
    state: Any = None  # the runner's: caches, sampler

    def record(self, token: int) -> None:
        """The runner sampled `token` for this request: stream it, or finish on a stop id / the cap."""
        now = time.perf_counter()
        if self.t_first is None:
            self.t_first = now
            self.stats.ttft_s = now - self.t0
        if token in self.request.stop_ids:
            self.finish = "eos"
            return
        self.t_last = now
        self.generated.append(token)
        self.handle._emit([token])
        if len(self.generated) >= self.request.max_new_tokens:
            self.finish = "length"


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

    def busy(self, work: Callable[[], None]) -> None: ...  # run a busy period inside the device entry point

    def start(self, slot: Slot) -> None: ...  # take the session's cache (prefix reuse); no forward pass

    def prefill(self, slot: Slot) -> bool: ...  # one prompt chunk; the last one samples the first id

    def decode(self, slots: list[Slot]) -> bool: ...  # one id for each slot, in one batched forward pass

    def release(self, slot: Slot, keep: bool) -> None: ...  # leave the batch; keep the session's cache

    def empty_cache(self) -> None: ...

    def snapshot(self) -> MemorySnapshot: ...


def auto_max_batch(on_cpu: bool) -> int:
    """LLMWEB_MAX_BATCH=0: requests per decode step by device (a GPU has far more idle compute per step)."""
    return 4 if on_cpu else 8


class Engine:
    def __init__(self, runner: Runner, kv: KVStore, limits: EngineLimits):
        assert limits.max_batch >= 1, "max_batch must be >= 1"
        self.runner = runner
        self.device = runner.device
        self.kv = kv
        self.limits = limits
        self.counters = _Counters()
        self._lock = threading.Condition()
        self._waiting = FairQueue()  # interactive requests
        self._background: deque[Handle] = deque()
        self._running: list[Slot] = []  # the batch, oldest first (only the worker changes it, under the lock)
        self._head: tuple[Handle, float] | None = None  # the request waiting for memory, and its refusal time
        self._frag_floor = 0  # fragmentation left after the last idle release (it could not free more)
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="llmweb-engine", daemon=True)
        self._thread.start()

    # ---- callers
    def submit(self, request: GenerationRequest) -> Handle:
        if request.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        if len(request.prompt_ids) == 0:
            raise ValueError("empty prompt")
        if not request.background:  # the cap is for replies; a summary has its own (LLMWEB_SUMMARY_TOKENS)
            request = _cap(request, self.limits.max_new_tokens)
        handle = Handle(request, self)
        with self._lock:
            if self._stopped:
                raise BusyError("The engine is shutting down.")
            lane = self._background if request.background else self._waiting
            bound = self.limits.queue_size * (4 if request.background else 1)
            if len(lane) >= bound:
                self.counters.refused += 1
                raise BusyError(f"The model is busy: {len(lane)} requests are waiting. Try again in a moment.")
            if request.background:
                self._background.append(handle)
            else:
                mine = self._waiting.waiting(request.owner)
                if mine >= self.limits.queue_per_user:
                    self.counters.refused += 1
                    raise BusyError(
                        f"The model is busy: you already have {mine} request{'s' if mine != 1 else ''} "
                        "waiting; wait for them to finish or stop one."
                    )
                self._waiting.push(handle)
            self._lock.notify_all()
        return handle

    def position(self, handle: Handle) -> int:
        with self._lock:
            return self._waiting.position(handle)

    @property
    def queue_depth(self) -> int:
        with self._lock:
            return len(self._waiting)

    def drop_session(self, session_id: str) -> None:
        self.kv.drop(session_id)

    def close(self, timeout: float = 5.0) -> None:
        """Refuse new requests, cancel the queued ones and the running ones, and stop the worker."""
        with self._lock:
            self._stopped = True
            pending = self._waiting.drain() + list(self._background)
            self._background.clear()
            running = [s.handle for s in self._running]
            self._lock.notify_all()
        for h in pending:
            h._finish(None, Cancelled("The engine shut down before this request ran."))
        for h in running:
            h._cancel.set()  # stops within a step; its consumer gets the partial reply
        self._thread.join(timeout)

    def _withdraw(self, handle: Handle) -> None:
        """Take a cancelled request out of its queue, so that it no longer holds a place there."""
        with self._lock:
            if not self._waiting.remove(handle):
                try:
                    self._background.remove(handle)
                except ValueError:
                    return  # running, done, or never queued: the worker sees the flag
            self._lock.notify_all()
        handle._finish(None, Cancelled("Cancelled before it started."))

    # ---- the worker: schedule() -> step() -> leave, until nothing runs
    def _loop(self) -> None:
        while self._wait_for_work():
            try:
                self.runner.busy(self._busy_period)
            except BaseException as e:  # the worker never dies; the callers get a message
                log.exception("engine: the batch failed")
                self._fail(list(self._running), e)

    def _wait_for_work(self) -> bool:
        """Block until a request waits (False once the engine is stopped); housekeeping while idle."""
        with self._lock:
            while not self._stopped and not self._waiting and not self._background:
                if not self._lock.wait(timeout=1.0):
                    self._lock.release()
                    try:
                        self._idle()
                    finally:
                        self._lock.acquire()
            return not self._stopped

    def _busy_period(self) -> None:
        """Admit and step the batch until it is empty (on ZeroGPU, one GPU call)."""
        while True:
            self._schedule()
            if not self._running:
                if self._head is not None:  # the next request waits for memory: do not spin
                    with self._lock:
                        self._lock.wait(timeout=0.25)
                return
            self._step()

    def _schedule(self) -> None:
        """Admit waiting requests into the batch while there is room: `max_batch` and memory.

        Interactive requests first (fair between owners), background jobs only when none waits.
        A request that does not fit next to the running batch keeps its place at the head of the
        line until the batch shrinks (nobody behind it jumps ahead).
        """
        while len(self._running) < self.limits.max_batch:
            with self._lock:
                if self._stopped:
                    return
                if self._waiting:
                    handle = self._waiting.peek()
                elif self._background:
                    handle = self._background[0]
                else:
                    return
            try:
                predicted = self._admit(handle)
            except AdmissionError as refused:
                if self._take(handle):
                    handle._finish(None, refused)
                continue
            if predicted is None:
                return  # it waits for room
            if not self._take(handle):
                continue  # cancelled meanwhile: it left the queue on its own
            if handle.cancelled:
                handle._finish(None, Cancelled("Cancelled before it started."))
                continue
            self._begin(handle, handle.request, predicted, retried=False)

    def _take(self, handle: Handle) -> bool:
        with self._lock:
            if self._waiting.take(handle):
                return True
            try:
                self._background.remove(handle)
                return True
            except ValueError:
                return False

    def _begin(
        self, handle: Handle, request: GenerationRequest, predicted: int, retried: bool, reason: str = "oom"
    ) -> None:
        """Start a slot for the request; it prefills in the next steps, then joins the batch."""
        if not self.limits.kv_reuse and request.session_id is not None:
            request = dataclasses.replace(request, session_id=None)
        stats = GenerationStats(
            prompt_tokens=len(request.prompt_ids),
            predicted_bytes=predicted,
            queue_wait_s=time.perf_counter() - handle.submitted,
        )
        slot = Slot(handle, request, predicted, self._timeout(request), stats, retried=retried, retry_reason=reason)
        try:
            self.runner.start(slot)
        except BaseException as e:  # the request ends with it; the batch goes on
            self._fail([slot], e)
            return
        with self._lock:
            self._running.append(slot)
            self.counters.active = len(self._running)
            self.counters.max_active = max(self.counters.max_active, self.counters.active)
        self._frag_floor = 0  # allocations change: the next idle period may release again

    def _step(self) -> None:
        """One step of the batch: a prompt chunk of the oldest joining request, then one token for
        every decoding request; then whoever finished, was cancelled or ran out of time leaves."""
        # 1) prefill, chunked: a long prompt costs the others one chunk per token, never a freeze
        joining = next((s for s in self._running if not s.ready), None)
        if joining is not None:
            try:
                if not self.runner.prefill(joining):
                    self._out_of_memory(joining)
            except GiveWay as e:
                self._give_way(joining, e)
            except BaseException as e:
                self._fail([joining], e)
        # 2) decode: one batched forward pass
        decoding = [s for s in self._running if s.ready and s.finish is None]
        if decoding:
            for s in decoding:
                s.stats.batch_size = max(s.stats.batch_size, len(decoding))
            try:
                if not self.runner.decode(decoding):
                    self._out_of_memory(decoding[-1])  # the youngest gives way; the others' caches are intact
            except BaseException as e:
                self._fail(decoding, e)
        # 3) leave at once: finished, cancelled, out of time
        for s in list(self._running):
            if s.finish is None:
                s.finish = stop_reason(s.handle, s.t0, s.timeout)
            if s.finish is not None:
                self._leave(s)

    def _remove(self, slot: Slot) -> None:
        with self._lock:
            self._running.remove(slot)
            self.counters.active = len(self._running)

    def _leave(self, slot: Slot) -> None:
        """A finished slot leaves the batch; its session keeps the cache; the caller gets the stats."""
        self._remove(slot)
        self.runner.release(slot, keep=True)
        stats, n = slot.stats, len(slot.generated)
        stats.finish_reason, stats.generated_tokens = slot.finish or "", n
        stats.oom_retry = slot.retried and slot.retry_reason == "oom"
        stats.total_s = time.perf_counter() - slot.t0
        if n > 1 and slot.t_first is not None and slot.t_last is not None:
            stats.decode_tok_s = (n - 1) / max(slot.t_last - slot.t_first, 1e-9)
        self.counters.served += 1
        if stats.finish_reason == "timeout":
            slot.handle._finish(
                stats,
                TimedOut(f"Stopped after {stats.total_s:.0f} s: the time limit per request is {slot.timeout:.0f} s."),
            )
        elif slot.error is not None:  # its partial reply stays in `handle.generated`
            slot.handle._finish(stats, slot.error)
        else:
            slot.handle._finish(stats)

    def _fail(self, slots: list[Slot], error: BaseException) -> None:
        """These slots end with `error` (a domain error as it is; anything else wrapped); the rest run on."""
        if not isinstance(error, LlmwebError):
            log.error("engine: %d request(s) failed: %s: %s", len(slots), type(error).__name__, error)
            error = LlmwebError(f"Generation failed: {type(error).__name__}: {error}")
        for s in slots:
            if s in self._running:
                self._remove(s)
            try:
                self.runner.release(s, keep=False)
            except Exception:  # its cache is lost either way
                log.exception("engine: releasing request %s failed", s.handle.id)
            s.handle._finish(None, error)

    def _out_of_memory(self, victim: Slot) -> None:
        """The device ran out of memory in a pass that involved `victim`: it alone gives way.

        Its cache is freed, idle caches are evicted, the allocator emptied; then it retries once
        with its smaller `fallback` (its streamed ids are void: `Restarted`), and the other
        requests of the batch go on as if nothing happened.
        """
        self.counters.ooms += 1
        self._remove(victim)
        self.runner.release(victim, keep=False)
        self._recover()
        if victim.retried:
            error = OutOfMemory(
                "Out of memory even with a smaller prompt. Try a shorter message, "
                "fewer documents, or a smaller model / 4-bit weights."
            )
        else:
            smaller = victim.request.fallback() if victim.request.fallback else None
            if smaller is not None:
                smaller = _cap(smaller, self.limits.max_new_tokens)
                log.warning(
                    "engine: OOM; retrying request %s with %d prompt tokens (was %d)",
                    victim.handle.id,
                    len(smaller.prompt_ids),
                    len(victim.request.prompt_ids),
                )
                victim.handle._restart("oom")
                self._begin(victim.handle, smaller, self.runner.predict(smaller), retried=True)
                return
            error = OutOfMemory(
                "Out of memory while generating; nothing smaller to retry with. "
                "Try a shorter message or fewer documents."
            )
        victim.handle._finish(None, error)

    def _give_way(self, victim: Slot, refusal: GiveWay) -> None:
        """The backend refused `victim`'s prompt: it retries once with its `fallback`, else fails."""
        self._remove(victim)
        self.runner.release(victim, keep=False)
        smaller = victim.request.fallback() if victim.request.fallback and not victim.retried else None
        if smaller is None:
            victim.handle._finish(None, LlmwebError(refusal.message))
            return
        smaller = _cap(smaller, self.limits.max_new_tokens)
        log.warning(
            "engine: %s; retrying request %s with %d prompt tokens (was %d)",
            refusal.reason,
            victim.handle.id,
            len(smaller.prompt_ids),
            len(victim.request.prompt_ids),
        )
        victim.handle._restart(refusal.reason)
        self._begin(victim.handle, smaller, self.runner.predict(smaller), retried=True, reason=refusal.reason)

    # ---- admission: the whole batch's memory
    def _admit(self, handle: Handle) -> int | None:
        """The request's predicted bytes if it fits next to the running batch now; None while it
        waits for room. The batch needs what each running request still adds (its prediction
        minus the KV it holds) plus the new one's prediction. When it would not fit even as the
        batch shrinks, idle session caches are evicted, and after `admission_wait_s` it raises
        AdmissionError with the numbers."""
        need = self.runner.predict(handle.request)
        running = list(self._running)
        held = sum(self.runner.held(s) for s in running)
        growth = sum(max(s.predicted - self.runner.held(s), 0) for s in running)
        free = self.runner.available()
        if need + growth <= free:
            self._head = None
            return need
        if running and need <= free + held:
            return None  # it fits once running requests leave: keep the place
        if self._head is None or self._head[0] is not handle:
            freed = self.kv.evict(self.kv.budget_bytes)  # every idle session cache
            gc.collect()
            self.runner.empty_cache()
            log.info("engine: admission evicted %d bytes of idle KV caches", freed)
            self._head = (handle, time.perf_counter() + self.limits.admission_wait_s)
            return None
        if handle.cancelled or time.perf_counter() < self._head[1]:
            return None  # a cancelled one leaves the queue through `_withdraw`
        self._head = None
        self.counters.refused += 1
        batch = (
            f" next to the {len(running)} running request{'s' if len(running) != 1 else ''}, which need "
            f"~{_gib(growth)} more"
            if running
            else ""
        )
        raise AdmissionError(
            f"This request needs ~{_gib(need)} of memory but only {_gib(max(free, 0))} is free{batch}; "
            "try a shorter message or fewer documents."
        )

    def _timeout(self, request: GenerationRequest) -> float:
        return request.timeout_s if request.timeout_s is not None else self.limits.request_timeout_s

    # ---- recovery and housekeeping
    def _recover(self) -> None:
        freed = self.kv.clear()  # idle caches only: the running requests' caches are not in the store
        gc.collect()
        self.runner.empty_cache()
        log.warning("engine: OOM recovery freed %d bytes of KV caches and emptied the allocator cache", freed)

    def _idle(self) -> None:
        """Between requests: expire old session caches; release a fragmented allocator cache."""
        self.kv.expire()
        self.release_fragmentation()

    def release_fragmentation(self) -> int:
        """Empty the allocator cache once reserved − allocated passes `frag_release_bytes`.

        CUDA only (a no-op elsewhere); the worker calls it when idle. What `empty_cache()` could
        not give back (segments that still hold live tensors) is remembered, so an idle worker
        does not try again every second for nothing; serving a request resets that. Returns the
        reserved bytes given back to the device.
        """
        before = self.runner.snapshot()
        frag = before.fragmentation_bytes
        if frag is None or frag <= max(self.limits.frag_release_bytes, self._frag_floor):
            return 0  # not CUDA, or not fragmented enough to bother
        self.runner.empty_cache()
        after = self.runner.snapshot()
        self._frag_floor = after.fragmentation_bytes or 0
        released = max((before.cuda_reserved_bytes or 0) - (after.cuda_reserved_bytes or 0), 0)
        self.counters.idle_releases += 1
        self.counters.idle_released_bytes += released
        log.info(
            "engine: idle; reserved − allocated was %s (inactive split %s), emptied the allocator cache: %s given back",
            _gib(frag),
            _gib(before.cuda_inactive_split_bytes or 0),
            _gib(released),
        )
        return released


def predict_bytes(kv_bytes_per_token: int, heads: int, prompt_tokens: int, max_new_tokens: int) -> tuple[int, int]:
    """(KV bytes, activation bytes) of one request. Activations: a margin on the KV, a floor, and
    the attention scores of one prefill chunk against the whole context (heads x chunk x context
    x 4 bytes), which dominate at long contexts (measured by `capacity` at 4096 tokens)."""
    tokens = prompt_tokens + max_new_tokens
    kv = kv_bytes_per_token * tokens
    scores = heads * min(PREFILL_CHUNK, prompt_tokens) * tokens * 4
    return kv, int(kv * ACTIVATION_MARGIN + scores + ACTIVATION_FLOOR)


def stop_reason(handle: Handle, t0: float, timeout: float) -> str | None:
    if handle.cancelled:
        return "cancelled"
    if time.perf_counter() - t0 > timeout:
        return "timeout"
    return None


def _cap(request: GenerationRequest, cap: int) -> GenerationRequest:
    if request.max_new_tokens <= cap:
        return request
    return dataclasses.replace(request, max_new_tokens=cap)


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:,.0f} MiB"
