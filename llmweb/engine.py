"""The generation engine: ONE worker thread owns the model; everyone else submits requests.

The engine speaks token ids. It knows nothing of text, chat templates, retrieval or the UI, and
it does not import torch: it schedules (queue, priorities, admission, cancel, time limits, OOM
retry) and a `Runner` runs one request on the model (runner.py: `LocalRunner`; tests use a
scripted `FakeRunner`). `local_engine(...)` wires the two for a loaded model.

    submit(GenerationRequest) -> Handle       (bounded queue, and per owner; BusyError when full)
    for event in handle.events(): ...        Waiting(position) | Tokens(ids) | Restarted(reason);
                                              raises domain errors
    handle.generated                          the ids of the reply so far (reset by Restarted)
    handle.stats                              GenerationStats once finished
    handle.cancel()                           stops within a token (or a prefill chunk) and frees
                                              the worker; a queued request leaves the queue at once

One request runs at a time, whoever submits it (UI, API, CLI, tests): Gradio's concurrency
limits are per event group and do not guarantee that (DESIGN.md). Strangers share one server,
so the interactive queue is fair between owners (`GenerationRequest.owner`; "" is one owner too):
each owner may have `queue_per_user` requests waiting (the running one does not count), and the
owners take turns, round-robin (`FairQueue`: the owner served least recently goes next; one
owner's requests first-in first-out). `handle.position` counts what is really ahead in that
order, so it can grow when a new owner arrives. Background jobs (summaries) run only when no
interactive request waits; they have their own bound and no per-owner cap.

For each request the worker
  1) admits it: asks the runner for its predicted peak memory and for what is available; if it
     does not fit, evicts idle session caches, waits, and finally refuses with the numbers;
  2-4) has the runner generate it (KV reuse, prefill, decode, keep the session's cache).
Running out of device memory in 2-3 (the runner returns None, its frames already freed) frees
that request's cache, evicts idle caches, empties the allocator and retries once with the
request's smaller `fallback` (the tokens already streamed are void: `Restarted` tells the
consumer to start the reply over); the worker itself never dies.

When idle, the worker expires old session caches and, on CUDA, empties the allocator cache once
reserved − allocated passes `frag_release_bytes` (`release_fragmentation`, counted in
`counters.idle_releases`). Every request's stats carry the memory snapshot after it, including
the allocator's fragmentation figures on CUDA.
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
from typing import Protocol

from .errors import AdmissionError, BusyError, Cancelled, LlmwebError, OutOfMemory, TimedOut
from .kvcache import KVStore
from .records import GenerationStats, MemorySnapshot

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

    reason: str  # "oom": ran out of memory, retrying with the request's smaller fallback


_DONE = object()


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

    def pop(self) -> Handle:
        """The next request to serve (IndexError when empty)."""
        owner = self._order()[0]
        queue_ = self._owners[owner]
        _, handle = queue_.popleft()
        if not queue_:
            del self._owners[owner]
        self._served.pop(owner, None)
        self._served[owner] = next(self._turns)
        if len(self._served) > self.remember:
            del self._served[next(iter(self._served))]
        return handle

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


@dataclass
class _Counters:
    active: int = 0
    max_active: int = 0
    served: int = 0
    ooms: int = 0
    refused: int = 0
    idle_releases: int = 0  # allocator caches emptied while idle (release_fragmentation)
    idle_released_bytes: int = 0  # reserved bytes those gave back to the device


class Runner(Protocol):
    """Runs one request on a model. `generate` returns None when the device ran out of memory."""

    device: str

    def predict(self, request: GenerationRequest) -> int: ...

    def available(self) -> int: ...

    def generate(
        self, handle: Handle, request: GenerationRequest, predicted: int, timeout: float
    ) -> GenerationStats | None: ...

    def empty_cache(self) -> None: ...

    def snapshot(self) -> MemorySnapshot: ...


def local_engine(
    model,
    device: str,
    kv: KVStore,
    limits: EngineLimits,
    kv_bytes_per_token: int,
    fault: Callable[[int], None] | None = None,
    gpu: Callable | None = None,
) -> Engine:
    """An engine over a loaded transformers model (imports torch, through runner.py)."""
    from .runner import LocalRunner

    runner = LocalRunner(
        model,
        device,
        kv,
        kv_bytes_per_token,
        mem_limit_bytes=limits.mem_limit_bytes,
        mem_margin_bytes=limits.mem_margin_bytes,
        fault=fault,
        gpu=gpu,
    )
    return Engine(runner, kv, limits)


class Engine:
    def __init__(self, runner: Runner, kv: KVStore, limits: EngineLimits):
        self.runner = runner
        self.device = runner.device
        self.kv = kv
        self.limits = limits
        self.counters = _Counters()
        self._lock = threading.Condition()
        self._waiting = FairQueue()  # interactive requests
        self._background: deque[Handle] = deque()
        self._current: Handle | None = None  # the request being served
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
        """Refuse new requests, cancel the queued ones and the running one, and stop the worker."""
        with self._lock:
            self._stopped = True
            pending = self._waiting.drain() + list(self._background)
            self._background.clear()
            current = self._current
            self._lock.notify_all()
        for h in pending:
            h._finish(None, Cancelled("The engine shut down before this request ran."))
        if current is not None:
            current._cancel.set()  # stops within a token; its consumer gets the partial reply
        self._thread.join(timeout)

    def _withdraw(self, handle: Handle) -> None:
        """Take a cancelled request out of its queue, so that it no longer holds a place there."""
        with self._lock:
            if not self._waiting.remove(handle):
                try:
                    self._background.remove(handle)
                except ValueError:
                    return  # running, done, or never queued: the worker sees the flag
        handle._finish(None, Cancelled("Cancelled before it started."))

    # ---- the worker
    def _next(self) -> Handle | None:
        with self._lock:
            while not self._stopped and not self._waiting and not self._background:
                if not self._lock.wait(timeout=1.0):
                    self._lock.release()
                    try:
                        self._idle()
                    finally:
                        self._lock.acquire()
            if self._stopped:
                return None
            self._current = self._waiting.pop() if self._waiting else self._background.popleft()
            return self._current

    def _loop(self) -> None:
        while True:
            handle = self._next()
            if handle is None:
                return
            try:
                self._serve(handle)
            except BaseException as e:  # the worker never dies; the caller gets a message
                log.exception("engine: request %s failed", handle.id)
                if not isinstance(e, LlmwebError):
                    e = LlmwebError(f"Generation failed: {type(e).__name__}: {e}")
                handle._finish(None, e)

    def _serve(self, handle: Handle) -> None:
        if handle.cancelled:
            handle._finish(None, Cancelled("Cancelled before it started."))
            return
        request = handle.request
        wait_s = time.perf_counter() - handle.submitted
        with self._lock:
            self.counters.active += 1
            self.counters.max_active = max(self.counters.max_active, self.counters.active)
        try:
            stats = self._attempt(handle, request, admit=True)
            if stats is None:  # out of memory; the failed attempt's frames are already freed
                self.counters.ooms += 1
                self._recover()
                smaller = request.fallback() if request.fallback else None
                if smaller is None:
                    raise OutOfMemory(
                        "Out of memory while generating; nothing smaller to retry with. "
                        "Try a shorter message or fewer documents."
                    )
                smaller = _cap(smaller, self.limits.max_new_tokens)
                log.warning(
                    "engine: OOM; retrying request %s with %d prompt tokens (was %d)",
                    handle.id,
                    len(smaller.prompt_ids),
                    len(request.prompt_ids),
                )
                handle._restart("oom")
                stats = self._attempt(handle, smaller, admit=False)
                if stats is None:
                    self.counters.ooms += 1
                    self._recover()
                    raise OutOfMemory(
                        "Out of memory even with a smaller prompt. Try a shorter message, "
                        "fewer documents, or a smaller model / 4-bit weights."
                    )
                stats.oom_retry = True
        finally:
            with self._lock:
                self.counters.active -= 1
                self._current = None
            self._frag_floor = 0  # allocations changed: the next idle period may release again
        stats.queue_wait_s = wait_s
        self.counters.served += 1
        if stats.finish_reason == "cancelled":
            handle._finish(stats)
        elif stats.finish_reason == "timeout":
            handle._finish(
                stats,
                TimedOut(
                    f"Stopped after {stats.total_s:.0f} s: the time limit per request is "
                    f"{self._timeout(handle.request):.0f} s."
                ),
            )
        else:
            handle._finish(stats)

    def _attempt(self, handle: Handle, request: GenerationRequest, admit: bool) -> GenerationStats | None:
        """Admit (or only predict) and generate once; None if it ran out of memory (the runner
        returns instead of raising, so the failed attempt's frames are already freed)."""
        predicted = self._admit(handle) if admit else self.runner.predict(request)
        if not self.limits.kv_reuse and request.session_id is not None:
            request = dataclasses.replace(request, session_id=None)
        return self.runner.generate(handle, request, predicted, self._timeout(request))

    # ---- 1) admission
    def _admit(self, handle: Handle) -> int:
        request = handle.request
        need = self.runner.predict(request)
        deadline = time.perf_counter() + self.limits.admission_wait_s
        evicted = False
        while True:
            available = self.runner.available()
            if need <= available:
                return need
            if handle.cancelled:
                raise Cancelled("Cancelled while waiting for memory.")
            if not evicted:
                # the request's own session cache counts as reusable memory, others are idle
                freed = self.kv.evict(self.kv.budget_bytes)  # everything idle
                evicted = True
                gc.collect()
                self.runner.empty_cache()
                log.info("engine: admission evicted %d bytes of idle KV caches", freed)
                continue
            if time.perf_counter() >= deadline:
                self.counters.refused += 1
                raise AdmissionError(
                    f"This request needs ~{_gib(need)} of memory but only {_gib(max(available, 0))} is free; "
                    "try a shorter message or fewer documents."
                )
            time.sleep(0.25)

    def _timeout(self, request: GenerationRequest) -> float:
        return request.timeout_s if request.timeout_s is not None else self.limits.request_timeout_s

    # ---- recovery and housekeeping
    def _recover(self) -> None:
        freed = self.kv.clear()
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
