"""The generation engine: ONE worker thread owns the model; everyone else submits requests.

The engine speaks token ids. It knows nothing of text, chat templates, retrieval or the UI.

    submit(GenerationRequest) -> Handle       (bounded queue; BusyError when full)
    for event in handle.events(): ...        Waiting(position) | Tokens(ids) | Restarted(reason);
                                              raises domain errors
    handle.generated                          the ids of the reply so far (reset by Restarted)
    handle.stats                              GenerationStats once finished
    handle.cancel()                           stops within a token (or a prefill chunk) and frees
                                              the worker; a queued request leaves the queue at once

One request runs at a time, whoever submits it (UI, API, CLI, tests): Gradio's concurrency
limits are per event group and do not guarantee that (DESIGN.md). Interactive requests are
served first-in first-out; background jobs (summaries) run only when no interactive request
waits.

For each request the worker
  1) admits it: predicts its peak memory (KV for prompt + max_new_tokens, plus an activation
     margin) and, if it does not fit, evicts idle session caches, waits, and finally refuses
     with the numbers;
  2) reuses the session's KV cache: crops it to the longest common prefix with the prompt and
     prefills only the rest (in chunks, to bound activation memory);
  3) decodes token by token under `torch.inference_mode()`, streaming ids to the handle and
     checking cancel / time limit between steps;
  4) stores the session's cache (prompt + generated[:-1]) for the next turn, or drops it.
`torch.OutOfMemoryError` anywhere in 2-3 frees that request's cache, evicts idle caches,
empties the allocator and retries once with the request's smaller `fallback` (the tokens already
streamed are void: `Restarted` tells the consumer to start the reply over); the worker itself
never dies. The retry runs only after the failed attempt's exception is gone, because its
traceback would keep that attempt's frames, and with them its KV cache and activations, alive.

When idle, the worker expires old session caches and, on CUDA, empties the allocator cache once
reserved − allocated passes `frag_release_bytes` (`release_fragmentation`, counted in
`counters.idle_releases`). Every request's stats carry the memory snapshot after it, including
the allocator's fragmentation figures on CUDA.
"""

from __future__ import annotations

import gc
import itertools
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

from .errors import AdmissionError, BusyError, Cancelled, LlmwebError, OutOfMemory, TimedOut
from .kvcache import KVStore, cache_nbytes, reusable
from .telemetry import GenerationStats, RssPeak, is_cuda, memory_snapshot, reset_peak, rss_bytes

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
    background: bool = False  # low priority (summaries); never counted as "waiting" for users
    timeout_s: float | None = None  # from the start of processing
    fallback: Callable[[], "GenerationRequest | None"] | None = None  # smaller request for the OOM retry


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

    def __init__(self, request: GenerationRequest, engine: "Engine"):
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
        """1-based place among waiting interactive requests; 0 once running or done."""
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


@dataclass
class EngineLimits:
    queue_size: int = 8
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


class Engine:
    def __init__(self, model, device: str, kv: KVStore, limits: EngineLimits, kv_bytes_per_token: int,
                 fault: Callable[[int], None] | None = None, gpu: Callable | None = None):
        self.model = model
        if gpu is not None:  # e.g. @spaces.GPU on ZeroGPU Spaces: the GPU entry point is one generation
            self._generate = gpu(self._generate)
        self.device = device
        self.kv = kv
        self.limits = limits
        self.kv_bytes_per_token = kv_bytes_per_token
        self.fault = fault  # test hook: called with the forward-pass index before each forward
        self.counters = _Counters()
        self._lock = threading.Condition()
        self._waiting: deque[Handle] = deque()
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
            lane.append(handle)
            self._lock.notify_all()
        return handle

    def position(self, handle: Handle) -> int:
        with self._lock:
            try:
                return self._waiting.index(handle) + 1
            except ValueError:
                return 0

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
            pending = list(self._waiting) + list(self._background)
            self._waiting.clear()
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
            for lane in (self._waiting, self._background):
                try:
                    lane.remove(handle)
                    break
                except ValueError:
                    continue
            else:
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
            self._current = (self._waiting or self._background).popleft()
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
        import torch

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
                    raise OutOfMemory("Out of memory while generating; nothing smaller to retry with. "
                                      "Try a shorter message or fewer documents.")
                smaller = _cap(smaller, self.limits.max_new_tokens)
                log.warning("engine: OOM; retrying request %s with %d prompt tokens (was %d)",
                            handle.id, len(smaller.prompt_ids), len(request.prompt_ids))
                handle._restart("oom")
                stats = self._attempt(handle, smaller, admit=False)
                if stats is None:
                    self.counters.ooms += 1
                    self._recover()
                    raise OutOfMemory("Out of memory even with a smaller prompt. Try a shorter message, "
                                      "fewer documents, or a smaller model / 4-bit weights.")
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
            handle._finish(stats, TimedOut(
                f"Stopped after {stats.total_s:.0f} s: the time limit per request is "
                f"{self._timeout(handle.request):.0f} s."))
        else:
            handle._finish(stats)

    def _attempt(self, handle: Handle, request: GenerationRequest, admit: bool) -> GenerationStats | None:
        """Admit (or only predict) and generate once; None if it ran out of memory.

        Returning instead of raising matters: while an OOM exception is alive, its traceback holds
        the frames of the failed forward pass, with this request's KV cache and activations. Once
        this handler returns they are freed, before `_recover` empties the allocator cache.
        """
        import torch

        try:
            predicted = self._admit(handle) if admit else self._predict(request)
            return self._generate(handle, request, predicted)
        except torch.OutOfMemoryError as e:
            log.warning("engine: request %s ran out of memory: %s", handle.id, str(e).splitlines()[0][:200])
            return None

    # ---- 1) admission
    def _predict(self, request: GenerationRequest) -> int:
        heads = getattr(getattr(self.model, "config", None), "num_attention_heads", 0) or 0
        kv, activation = predict_bytes(self.kv_bytes_per_token, heads, len(request.prompt_ids), request.max_new_tokens)
        return kv + activation

    def _available(self) -> int:
        if is_cuda(self.device):
            import torch

            free, _total = torch.cuda.mem_get_info(self.device)
            stats = torch.cuda.memory_stats(self.device)
            cached = stats.get("reserved_bytes.all.current", 0) - stats.get("allocated_bytes.all.current", 0)
            return free + cached - self.limits.mem_margin_bytes
        if self.limits.mem_limit_bytes <= 0:
            return 1 << 62
        return self.limits.mem_limit_bytes - rss_bytes()

    def _admit(self, handle: Handle) -> int:
        request = handle.request
        need = self._predict(request)
        deadline = time.perf_counter() + self.limits.admission_wait_s
        evicted = False
        while True:
            available = self._available()
            if need <= available:
                return need
            if handle.cancelled:
                raise Cancelled("Cancelled while waiting for memory.")
            if not evicted:
                # the request's own session cache counts as reusable memory, others are idle
                freed = self.kv.evict(self.kv.budget_bytes)  # everything idle
                evicted = True
                gc.collect()
                self._empty_cache()
                log.info("engine: admission evicted %d bytes of idle KV caches", freed)
                continue
            if time.perf_counter() >= deadline:
                self.counters.refused += 1
                raise AdmissionError(
                    f"This request needs ~{_gib(need)} of memory but only {_gib(max(available, 0))} is free; "
                    "try a shorter message or fewer documents.")
            time.sleep(0.25)

    # ---- 2-4) one generation
    def _generate(self, handle: Handle, request: GenerationRequest, predicted: int) -> GenerationStats:
        import torch
        from transformers import DynamicCache

        model = self.model
        stats = GenerationStats(prompt_tokens=len(request.prompt_ids), predicted_bytes=predicted)
        t0 = time.perf_counter()
        reset_peak(self.device)
        rss = RssPeak()
        prompt = list(request.prompt_ids)
        timeout = self._timeout(request)
        forward_index = 0

        def forward(ids_2d, cache):
            nonlocal forward_index
            if self.fault is not None:
                self.fault(forward_index)
            forward_index += 1
            return model(input_ids=ids_2d, cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1, :]

        cache = None
        try:
            with torch.inference_mode():
                # 2) reuse the session's cache: crop to the common prefix, keep >= 1 token to prefill
                entry = self.kv.take(request.session_id) if (request.session_id and self.limits.kv_reuse) else None
                reused = 0
                if entry is not None:
                    reused = reusable(entry.ids, prompt)
                    cache = entry.cache
                    held = cache.get_seq_length()
                    assert held == len(entry.ids), f"cache holds {held} tokens but records {len(entry.ids)} ids"
                    if reused == 0:
                        cache = None
                    elif held > reused:
                        cache.crop(-(held - reused))
                    del entry
                if cache is None:
                    cache = DynamicCache(config=model.config)
                    reused = 0
                stats.reused_tokens, stats.prefilled_tokens = reused, len(prompt) - reused

                # prefill the rest in chunks; a cancel or the time limit stops between chunks
                n_rest = len(prompt) - reused
                rest = torch.tensor([prompt[reused:]], device=self.device)  # (1, n_rest)
                filled, stop = reused, None
                for start in range(0, n_rest, PREFILL_CHUNK):
                    if start and (stop := _stop_reason(handle, t0, timeout)):
                        break
                    logits = forward(rest[:, start:start + PREFILL_CHUNK], cache)  # (1, vocab)
                    filled = reused + min(start + PREFILL_CHUNK, n_rest)
                del rest
                stats.prefilled_tokens = filled - reused

                # 3) decode
                finish = "length"
                generated: list[int] = []
                t_first = None
                if stop is not None:
                    finish = stop
                    del logits
                else:
                    sampler = _Sampler(request, prompt, self.device)
                    for step in range(request.max_new_tokens):
                        next_id = sampler(logits)
                        del logits
                        if t_first is None:
                            t_first = time.perf_counter()
                            stats.ttft_s = t_first - t0
                        if next_id in request.stop_ids:
                            finish = "eos"
                            break
                        generated.append(next_id)
                        handle._emit([next_id])
                        rss.sample()
                        if stop := _stop_reason(handle, t0, timeout):
                            finish = stop
                            break
                        if step + 1 == request.max_new_tokens:
                            break
                        logits = forward(torch.tensor([[next_id]], device=self.device), cache)
                t_end = time.perf_counter()
                stats.finish_reason = finish
                stats.generated_tokens = len(generated)
                if t_first is not None and len(generated) > 1:
                    stats.decode_tok_s = (len(generated) - 1) / max(t_end - t_first, 1e-9)
                stats.total_s = t_end - t0
                # 4) keep the cache for the session's next turn. Every generated token but the
                #    last was fed back; after a stop token, all kept ones were (it was not kept).
                #    A prefill stopped early holds only the prompt's first `filled` tokens.
                if filled < len(prompt):
                    held_ids = prompt[:filled]
                else:
                    held_ids = prompt + (generated if finish == "eos" else generated[:-1])
                assert cache.get_seq_length() == len(held_ids), \
                    f"cache {cache.get_seq_length()} != ids {len(held_ids)} ({finish})"
                stats.kv_session_bytes = cache_nbytes(cache)
                if request.session_id and self.limits.kv_reuse:
                    self.kv.put(request.session_id, held_ids, cache, stats.kv_session_bytes)
                cache = None
        except BaseException:
            cache = None  # free this request's cache before anyone retries
            raise
        stats.kv_store_bytes = self.kv.total_bytes
        stats.mem = memory_snapshot(self.device, peak_rss=rss.peak)
        return stats

    def _timeout(self, request: GenerationRequest) -> float:
        return request.timeout_s if request.timeout_s is not None else self.limits.request_timeout_s

    # ---- recovery and housekeeping
    def _recover(self) -> None:
        freed = self.kv.clear()
        gc.collect()
        self._empty_cache()
        log.warning("engine: OOM recovery freed %d bytes of KV caches and emptied the allocator cache", freed)

    def _empty_cache(self) -> None:
        if is_cuda(self.device):
            import torch

            torch.cuda.empty_cache()

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
        if not is_cuda(self.device):
            return 0
        before = memory_snapshot(self.device)
        frag = before.fragmentation_bytes or 0
        if frag <= max(self.limits.frag_release_bytes, self._frag_floor):
            return 0
        self._empty_cache()
        after = memory_snapshot(self.device)
        self._frag_floor = after.fragmentation_bytes or 0
        released = max((before.cuda_reserved_bytes or 0) - (after.cuda_reserved_bytes or 0), 0)
        self.counters.idle_releases += 1
        self.counters.idle_released_bytes += released
        log.info("engine: idle; reserved − allocated was %s (inactive split %s), emptied the allocator "
                 "cache: %s given back", _gib(frag), _gib(before.cuda_inactive_split_bytes or 0), _gib(released))
        return released


def predict_bytes(kv_bytes_per_token: int, heads: int, prompt_tokens: int, max_new_tokens: int) -> tuple[int, int]:
    """(KV bytes, activation bytes) of one request. Activations: a margin on the KV, a floor, and
    the attention scores of one prefill chunk against the whole context (heads x chunk x context
    x 4 bytes), which dominate at long contexts (measured by `capacity` at 4096 tokens)."""
    tokens = prompt_tokens + max_new_tokens
    kv = kv_bytes_per_token * tokens
    scores = heads * min(PREFILL_CHUNK, prompt_tokens) * tokens * 4
    return kv, int(kv * ACTIVATION_MARGIN + scores + ACTIVATION_FLOOR)


class _Sampler:
    """Greedy or temperature/top-p sampling with a repetition penalty over prompt + generated."""

    def __init__(self, request: GenerationRequest, prompt: list[int], device: str):
        import torch
        from transformers import (LogitsProcessorList, RepetitionPenaltyLogitsProcessor,
                                  TemperatureLogitsWarper, TopPLogitsWarper)

        self.torch = torch
        self.greedy = request.temperature <= 0
        procs = []
        if request.repetition_penalty and request.repetition_penalty != 1.0:
            procs.append(RepetitionPenaltyLogitsProcessor(request.repetition_penalty))
        if not self.greedy:
            procs.append(TemperatureLogitsWarper(request.temperature))
            if request.top_p < 1.0:
                procs.append(TopPLogitsWarper(request.top_p))
        self.procs = LogitsProcessorList(procs)
        self.ids = torch.tensor([prompt], device=device)  # (1, n) grows by one per step
        self.gen = None
        if not self.greedy:
            self.gen = torch.Generator(device=device)
            self.gen.manual_seed(request.seed if request.seed is not None else int(time.time_ns() % 2**31))

    def __call__(self, logits) -> int:
        torch = self.torch
        scores = self.procs(self.ids, logits.float()) if len(self.procs) else logits.float()
        if self.greedy:
            nxt = int(scores.argmax(dim=-1)[0])
        else:
            probs = torch.softmax(scores, dim=-1)
            nxt = int(torch.multinomial(probs, 1, generator=self.gen)[0, 0])
        self.ids = torch.cat([self.ids, torch.tensor([[nxt]], device=self.ids.device)], dim=1)
        return nxt


def _stop_reason(handle: Handle, t0: float, timeout: float) -> str | None:
    if handle.cancelled:
        return "cancelled"
    if time.perf_counter() - t0 > timeout:
        return "timeout"
    return None


def _cap(request: GenerationRequest, cap: int) -> GenerationRequest:
    if request.max_new_tokens <= cap:
        return request
    from dataclasses import replace

    return replace(request, max_new_tokens=cap)


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:,.0f} MiB"
