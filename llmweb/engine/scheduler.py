"""The generation engine: ONE worker thread owns the model and runs a batch; everyone else submits.

The engine speaks token ids. It knows nothing of text, chat templates, retrieval or the UI, and
it does not import torch: it schedules and a `Runner` runs the batch on the model one step at a
time (engine/runners/: `LocalRunner`, `LlamaRunner`; engine/remote.py: `RemoteRunner`, an OpenAI-compatible
server; tests use a scripted `FakeRunner`). `local_engine(...)` / `remote.remote_engine(...)`
wire the two. The request, its events and `Handle` are in request.py; the waiting requests
(fair between owners) in queue.py; their estimated wait, which bounds the queue, and the
throughput it is measured from in waitroom.py; memory (admission, giving way, idle release) in
admission.py.

Whoever submits (UI, API, CLI, tests), requests go through this one worker: Gradio's concurrency
limits are per event group and guarantee nothing (docs/architecture.md).

The worker's loop is schedule -> run -> postprocess, until the batch is empty:
  schedule     admit waiting requests while the batch has fewer than `max_batch`
               (LLMWEB_MAX_BATCH), their owner fewer than `running_per_user`, and admission
               says their memory fits; a visitor's request that waits for room pre-empts a
               warm-up (share.py: also the owners' prompt tokens a minute and the warm-up caps);
  run          one prompt chunk (its session's cache reused: only new tokens are prefilled),
               chosen so that owners take turns and one owner's prompts take at most a share of
               the time from another owner's reply (turns.py), then one batched decode
               pass that gives every decoding request its next token; a request joins the decode
               batch once its prompt is in; a pass out of memory makes one request give way: the
               joining one in a prefill, the youngest in a decode (the others' caches are as
               before the pass and they go on);
  postprocess  a request that finished, was cancelled or ran out of time leaves at the end of
               that step; its session keeps its cache.
The worker itself never dies. When idle, it expires old session caches and releases a fragmented
allocator cache. Every request's stats carry the memory snapshot after it, including the
allocator's fragmentation figures on CUDA, and the largest batch it decoded in.

Owns: the worker thread, the lock, the running batch and each request's start and end. Must not:
import torch, order the queue (queue.py) or judge memory (admission.py) itself.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time

from llmweb.engine.admission import Admission, retry_plan
from llmweb.engine.kvcache import KVStore
from llmweb.engine.queue import Lanes
from llmweb.engine.request import (
    PREFILL_SHOWN_S,
    EngineCounters,
    EngineLimits,
    GenerationRequest,
    GiveWay,
    Handle,
    Runner,
    Slot,
    capped,
)
from llmweb.engine.share import Shares, preempt
from llmweb.engine.turns import ChunkTurns
from llmweb.engine.waitroom import Pace, running_work, wait_s, waiting_work
from llmweb.errors import AdmissionError, BusyError, Cancelled, LlmwebError
from llmweb.records import GenerationStats

log = logging.getLogger(__name__)


def prefill_progress(engine: Engine, handle: Handle) -> tuple[int, int] | None:
    """(tokens read, of the prompt's) while `handle`'s prompt is read and has been for over
    PREFILL_SHOWN_S; None otherwise (queued, short, decoding, done). `Engine.prefilling`."""
    with engine._lock:
        slot = next((s for s in engine._running if s.handle is handle), None)
        if slot is None or slot.ready or time.perf_counter() - slot.t0 < PREFILL_SHOWN_S:
            return None
        return slot.stats.reused_tokens + slot.stats.prefilled_tokens, len(slot.request.prompt_ids)


class Engine:
    """The scheduler: callers `submit` requests (a `Handle`); one worker admits and steps them (module docstring)."""

    prefilling = prefill_progress  # the handle's `Queued.prefilling`

    def __init__(self, runner: Runner, kv: KVStore, limits: EngineLimits):
        assert limits.max_batch >= 1, "max_batch must be >= 1"
        self.runner = runner
        self.device = runner.device
        self.kv = kv
        self.limits = limits
        self.counters = EngineCounters()
        self._lock = threading.Condition()
        self.pace = Pace()  # the throughput measured here, for the waiting room's estimates
        self._waiting = Lanes(limits, self._wait_s)  # interactive (fair between owners) and background requests
        self._running: list[Slot] = []  # the batch, oldest first (only the worker changes it, under the lock)
        self._retries: list[tuple[Handle, GenerationRequest, str]] = []  # gave way: first in line, through admission
        self._memory = Admission(runner, kv, limits, self.counters)
        self._stopped = False
        self.shares = Shares(limits)  # per-owner and per-address limits (share.py)
        self._turns = ChunkTurns()  # whose prompt gets each step's chunk (turns.py)
        self._last_work = time.monotonic()  # when a request last came or the batch last emptied (`idle_s`)
        self._thread = threading.Thread(target=self._loop, name="llmweb-engine", daemon=True)
        self._thread.start()

    # ---- callers
    def submit(self, request: GenerationRequest) -> Handle:
        handle = Handle(checked(request, self.limits), self)
        request = handle.request
        with self._lock:
            if self._stopped:
                raise BusyError("The engine is shutting down.")
            if request.optional:  # dropped (BusyError), not refused: no one asked for it
                busy = bool(self._waiting) or len(self._running) >= self.limits.max_batch
                self.shares.take_warmup(request.owner, busy)
            try:
                if not request.background:
                    self.shares.check_prompt(request.owner)
                self._waiting.push(handle)
            except BusyError:
                self.counters.refused += 1
                raise
            self._last_work = time.monotonic()
            self._lock.notify_all()
        return handle

    def note_address(self, owner: str, group: str) -> None:  # the web layer's word: one address, one share
        with self._lock:
            self.shares.note_address(owner, group)

    def position(self, handle: Handle) -> int:
        with self._lock:
            return self._waiting.position(handle)

    def wait(self, handle: Handle) -> tuple[int, float]:
        """(position, estimated seconds until it starts) while the request waits; (0, 0.0) after."""
        with self._lock:
            return self._waiting.estimate(handle)

    def _wait_s(self, ahead: list[Handle]) -> float:
        """The waiting room's estimate for a request with `ahead` before it (under the lock)."""
        running = [running_work(s, self.pace) for s in self._running if not s.request.optional]  # pre-empted
        queued = [waiting_work(h.request, self.pace) for h in ahead]
        return wait_s(running, queued, self.limits.max_batch, self.pace)

    @property
    def queue_depth(self) -> int:
        with self._lock:
            return len(self._waiting.interactive)

    def close(self, timeout: float = 5.0) -> None:
        """Refuse new requests, cancel the queued ones and the running ones, and stop the worker."""
        with self._lock:
            self._stopped = True
            pending = self._waiting.drain() + [h for h, _, _ in self._retries]
            self._retries.clear()
            running = [s.handle for s in self._running]
            self._lock.notify_all()
        for h in pending:
            h._finish(None, Cancelled("The engine shut down before this request ran."))
        for h in running:
            h._cancel.set()  # stops within a step; its consumer gets the partial reply
        self._thread.join(timeout)
        close = getattr(self.runner, "close", None)  # a runner that holds native memory (llama.cpp's context)
        if close is not None and (not self._thread.is_alive() or getattr(self.runner, "closes_while_busy", False)):
            close()

    def withdraw(self, handle: Handle) -> None:
        """Take a cancelled request out of its queue (`Handle.cancel`; a running one sees its flag)."""
        with self._lock:
            if not self._waiting.remove(handle):
                return  # running, done, or never queued: the worker sees the flag
            self._lock.notify_all()
        handle._finish(None, Cancelled("Cancelled before it started."))

    def cancel_owner(self, owner: str) -> int:
        """Cancel every request of `owner`, waiting or running, replies and background jobs alike
        ("Delete all my data"); how many. Each ends as `Handle.cancel` ends it."""
        with self._lock:
            queued = self._waiting.interactive.serving_order() + list(self._waiting.background)
            handles = [h for h in [s.handle for s in self._running] + queued if h.request.owner == owner]
        for h in handles:
            h.cancel()
        return len(handles)

    def release_fragmentation(self) -> int:  # see Admission.release_fragmentation
        return self._memory.release_fragmentation()

    # ---- the worker: schedule -> run -> postprocess, until nothing runs
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
            while not self._stopped and not self._waiting and not self._retries:
                if not self._lock.wait(timeout=1.0):
                    self._lock.release()
                    try:
                        self._idle()
                    finally:
                        self._lock.acquire()
            return not self._stopped

    def _idle(self) -> None:  # between requests: expire old session caches, release a fragmented allocator
        self.kv.expire()
        self.release_fragmentation()

    def _busy_period(self) -> None:
        """Admit and step the batch until it is empty."""
        while True:
            self._schedule()
            if not self._running:
                if self._memory.head is not None:  # the next request waits for memory: do not spin
                    with self._lock:
                        self._lock.wait(timeout=0.25)
                return
            self._run()
            self._postprocess()

    def _schedule(self) -> None:
        """Admit waiting requests while `max_batch` and memory allow: a retry first, then visitors (fair
        between owners), then background jobs; the head waits for room, and nobody behind it jumps ahead."""
        while True:
            with self._lock:
                if self._stopped:
                    return
                retry = self._retries[0] if self._retries else None  # a request that gave way goes first
                full = self.shares.full(self._running)
                handle = retry[0] if retry is not None else self._waiting.peek(full)
            if handle is None:
                return
            request, reason = (retry[1], retry[2]) if retry is not None else (handle.request, "oom")
            if retry is not None and handle.cancelled and self._take(handle, retry):  # not in a queue to withdraw
                handle._finish(None, Cancelled("Cancelled before it started."))
                continue
            if len(self._running) >= self.limits.max_batch:
                preempt(self._running, handle)
                return
            try:
                predicted = self._memory.admit(handle, list(self._running), request)
            except AdmissionError as refused:
                if self._take(handle, retry):
                    handle._finish(None, refused)
                continue
            if predicted is None:
                preempt(self._running, handle)
                return  # it waits for room
            if not self._take(handle, retry):
                continue  # cancelled meanwhile: it left the queue on its own
            if handle.cancelled:
                handle._finish(None, Cancelled("Cancelled before it started."))
                continue
            self._begin(handle, request, predicted, retried=retry is not None, reason=reason)

    def _take(self, handle: Handle, retry: tuple | None = None) -> bool:
        with self._lock:
            if retry is not None:
                return bool(self._retries) and self._retries.pop(0) is retry
            return self._waiting.take(handle)

    def _begin(
        self, handle: Handle, request: GenerationRequest, predicted: int, retried: bool, reason: str = "oom"
    ) -> None:
        """Start a slot for the request; it prefills in the next steps, then joins the batch."""
        slot = new_slot(handle, request, predicted, self.limits, retried, reason)
        try:
            self.runner.start(slot)
        except BaseException as e:  # the request ends with it; the batch goes on
            self._fail([slot], e)
            return
        with self._lock:
            self._running.append(slot)
            self.counters.active = len(self._running)
            self.counters.max_active = max(self.counters.max_active, self.counters.active)
        self._memory.frag_floor = 0  # allocations change: the next idle period may release again

    def _run(self) -> None:
        """One step: a prompt chunk of the oldest joining request, then a token for every decoding one."""
        # 1) prefill, chunked: the owners' prompts take turns, a visitor's before a background one
        # (a summary, a document step); next to another owner's decoding reply a prompt takes at
        # most a share of the time (`_joining`)
        joining, beside = self._turns.pick(self._running)
        if joining is not None:
            with self._lock:  # a visitor's or a background prompt: small chunks (share.py)
                joining.small_chunks = self.shares.small_chunks(joining, self._running)
            before, t0 = joining.stats.prefilled_tokens, time.perf_counter()
            try:
                if not self.runner.prefill(joining):
                    self._give_way(joining, "oom")
                elif not joining.request.background:  # the waiting room's rate: interactive prompts only
                    tokens = joining.stats.prefilled_tokens - before
                    self.pace.prefilled(tokens, time.perf_counter() - t0)
                    with self._lock:
                        self.shares.add_prefilled(joining.request.owner, tokens)
            except GiveWay as e:
                self._give_way(joining, e.reason, e.message)
            except BaseException as e:
                self._fail([joining], e)
            self._turns.ran(joining, beside, t0, time.perf_counter())  # the replies' share next
        # 2) decode: one batched forward pass
        decoding = [s for s in self._running if s.ready and s.finish is None]
        if decoding:
            for s in decoding:
                s.stats.batch_size = max(s.stats.batch_size, len(decoding))
            t0 = time.perf_counter()
            try:
                if not self.runner.decode(decoding):
                    self._give_way(decoding[-1], "oom")  # the youngest gives way; the others' caches are intact
                else:
                    self.pace.stepped(time.perf_counter() - t0)
            except BaseException as e:
                self._fail(decoding, e)

    def _postprocess(self) -> None:
        """Whoever finished, was cancelled or ran out of time leaves the batch at once."""
        for s in list(self._running):
            if s.finish is None:
                s.finish = s.stop_reason()
            if s.finish is not None:
                self._leave(s)

    def _remove(self, slot: Slot) -> None:
        with self._lock:
            self._running.remove(slot)
            self.counters.active = len(self._running)
            self._last_work = time.monotonic()

    def _leave(self, slot: Slot) -> None:
        """A finished slot leaves the batch; its session keeps the cache; the caller gets the stats."""
        self._remove(slot)
        try:
            self.runner.release(slot, keep=True)
        except BaseException as e:  # out of the batch already: _loop's _fail would not reach it
            self._fail([slot], e)
            return
        error = slot.conclude()
        self.counters.served += 1
        if not slot.request.background and slot.finish in ("eos", "length"):
            self.pace.replied(len(slot.generated))
        slot.handle._finish(slot.stats, error)

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

    def _give_way(self, victim: Slot, reason: str, refusal: str = "") -> None:
        """`victim` alone gives way, after an OOM in its pass ("oom") or the backend's refusal of its prompt
        (a `GiveWay` reason, its words in `refusal`): its cache is freed (after an OOM also the allocator's,
        and idle caches the retry needs), then it retries once with its `fallback`, first in line, or fails."""
        self._remove(victim)
        self.runner.release(victim, keep=False)
        smaller = retry_plan(victim, reason, refusal, self.limits.max_new_tokens)
        if reason == "oom":
            self.counters.ooms += 1
            retry = 0 if isinstance(smaller, LlmwebError) else self.runner.predict(smaller)
            self._memory.recover(retry, list(self._running))
        if isinstance(smaller, LlmwebError):
            victim.handle._finish(None, smaller)
            return
        what, n, was = "OOM" if reason == "oom" else reason, len(smaller.prompt_ids), len(victim.request.prompt_ids)
        log.warning("engine: %s; retrying request %s with %d prompt tokens (was %d)", what, victim.handle.id, n, was)
        victim.handle._restart(reason)
        with self._lock:  # at the head of the line, through admission like any request (`_schedule`)
            self._retries.append((victim.handle, smaller, reason))


def checked(request: GenerationRequest, limits: EngineLimits) -> GenerationRequest:
    """`request` as the engine takes it (ValueError for one it cannot run), a reply's length capped."""
    if request.max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    if len(request.prompt_ids) == 0:
        raise ValueError("empty prompt")
    assert request.background or not request.optional, "optional work is background work"
    # the cap is for replies; a summary has its own (LLMWEB_SUMMARY_TOKENS)
    return request if request.background else capped(request, limits.max_new_tokens)


def idle_s(engine: Engine) -> float:
    """Seconds since `engine` last had work, 0 while it has some (runtime/switching.py's keep-alive)."""
    with engine._lock:
        return 0.0 if engine._running or engine._waiting else time.monotonic() - engine._last_work


def new_slot(
    handle: Handle, request: GenerationRequest, predicted: int, limits: EngineLimits, retried: bool, reason: str
) -> Slot:
    """The batch's bookkeeping for a request starting now (without a session when `kv_reuse` is off)."""
    if not limits.kv_reuse and request.session_id is not None:
        request = dataclasses.replace(request, session_id=None)
    stats = GenerationStats(
        prompt_tokens=len(request.prompt_ids),
        predicted_bytes=predicted,
        queue_wait_s=time.perf_counter() - handle.submitted,
    )
    timeout = request.timeout_s if request.timeout_s is not None else limits.request_timeout_s
    return Slot(handle, request, predicted, timeout, stats, retried=retried, retry_reason=reason)
