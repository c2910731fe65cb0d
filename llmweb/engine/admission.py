"""The batch's memory: admission by predicted bytes, what a request does when it must give way,
and the allocator's housekeeping when idle.

  admit     a waiting request joins while the whole batch's predicted memory fits (each running
            request's prediction minus the KV it already holds, plus the newcomer's, with the pads
            it adds to a left-padded batch's rows and, for its join, the batch's copy); one that
            does not fit waits at the head of the line until the batch shrinks; one that would
            not fit even alone is refused with the numbers after idle caches were evicted and
            `admission_wait_s`;
  give way  running out of device memory in a pass (the runner returns False, its frames
            already freed) makes one request give way, as does a backend's refusal of a prompt
            (`GiveWay`): its cache is freed (after an OOM the allocator is emptied too, and idle
            caches are evicted as far as its retry needs their room), and it retries once with
            its smaller `fallback` (`retry_plan`), first in line and through `admit`; without
            one, or on the retry, it fails;
  idle      on CUDA, the allocator cache is emptied once reserved − allocated passes
            `frag_release_bytes` (`release_fragmentation`, counted in `counters.idle_releases`).

Owns: `predict_bytes` (the local runner's figure), the head-of-line wait and its refusal, the
retry-or-fail decision, OOM recovery and the idle release. Must not: import torch (it reaches
the device through the `Runner`), touch the queue, or start or finish a request itself.
"""

from __future__ import annotations

import gc
import logging
import time

from llmweb.engine.kvcache import KVStore
from llmweb.engine.request import EngineCounters, EngineLimits, GenerationRequest, Handle, Runner, Slot, capped
from llmweb.errors import AdmissionError, LlmwebError, OutOfMemory

log = logging.getLogger(__name__)

PREFILL_CHUNK = 512  # prompt tokens per forward pass during prefill
ACTIVATION_MARGIN = 0.15  # of the KV prediction, plus a fixed floor (below)
ACTIVATION_FLOOR = 64 * 2**20


def predict_bytes(kv_bytes_per_token: int, heads: int, prompt_tokens: int, max_new_tokens: int) -> tuple[int, int]:
    """(KV bytes, activation bytes) of one request. Activations: a margin on the KV, a floor, and
    the attention scores of one prefill chunk against the whole context (heads x chunk x context
    x 4 bytes), which dominate at long contexts (measured by `capacity` at 4096 tokens)."""
    tokens = prompt_tokens + max_new_tokens
    kv = kv_bytes_per_token * tokens
    scores = heads * min(PREFILL_CHUNK, prompt_tokens) * tokens * 4
    return kv, int(kv * ACTIVATION_MARGIN + scores + ACTIVATION_FLOOR)


def retry_plan(victim: Slot, reason: str, refusal: str, max_new_tokens: int) -> GenerationRequest | LlmwebError:
    """What a request that gave way does next: once, its smaller `fallback` (capped at
    `max_new_tokens`); else the error it ends with. `reason` is "oom" after an out-of-memory pass,
    else a `GiveWay` reason, with the backend's words in `refusal`."""
    oom = reason == "oom"
    if oom and victim.retried:
        return OutOfMemory(
            "Out of memory even with a smaller prompt. Try a shorter message, "
            "fewer documents, or a smaller model / 4-bit weights."
        )
    smaller = victim.request.fallback() if victim.request.fallback and not victim.retried else None
    if smaller is not None:
        return capped(smaller, max_new_tokens)
    if oom:
        return OutOfMemory(
            "Out of memory while generating; nothing smaller to retry with. Try a shorter message or fewer documents."
        )
    return LlmwebError(refusal)


class Admission:
    """The engine's memory bookkeeping over its runner and the idle session caches in `kv`."""

    def __init__(self, runner: Runner, kv: KVStore, limits: EngineLimits, counters: EngineCounters):
        self.runner, self.kv, self.limits, self.counters = runner, kv, limits, counters
        self.head: tuple[Handle, float] | None = None  # the request waiting for memory, and its refusal time
        self.frag_floor = 0  # fragmentation left after the last idle release (it could not free more)

    def admit(self, handle: Handle, running: list[Slot], request: GenerationRequest | None = None) -> int | None:
        """The request's predicted bytes if it fits next to the running batch now; None while it
        waits for room. The batch needs what each running request still adds (its prediction
        minus the KV it holds) plus the new one's prediction, with the padding it adds to the
        batch's rows (`Runner.padding`) and, for the moment of its join, the batch's copy. When it
        would not fit even as the batch shrinks, idle session caches are evicted, and after
        `admission_wait_s` it raises AdmissionError with the numbers. `request`: the handle's
        retry, when it is not the handle's own request."""
        request = request or handle.request
        alone = self.runner.predict(request)
        padding = getattr(self.runner, "padding", None)
        pad, copy = padding(request, [s.request for s in running]) if padding is not None else (0, 0)
        need = alone + pad
        held = sum(self.runner.held(s) for s in running)
        growth = sum(max(s.predicted - self.runner.held(s), 0) for s in running)
        free = self.runner.available()
        if need + growth + copy <= free:
            self.head = None
            return need
        if running and alone <= free + held:
            return None  # it fits once running requests leave: keep the place
        need = alone
        if self.head is None or self.head[0] is not handle:
            freed = self.kv.evict(self.kv.budget_bytes)  # every idle session cache
            gc.collect()
            self.runner.empty_cache()
            log.info("engine: admission evicted %d bytes of idle KV caches", freed)
            self.head = (handle, time.perf_counter() + self.limits.admission_wait_s)
            return None
        if handle.cancelled or time.perf_counter() < self.head[1]:
            return None  # a cancelled one leaves the queue through `Engine.withdraw`
        self.head = None
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

    def recover(self, retry_bytes: int, running: list[Slot]) -> None:
        """After an out-of-memory pass: collect and empty the allocator cache; then evict idle
        session caches, oldest first, only as far as the retry (`retry_bytes`) and the running
        batch's growth still do not fit: other chats keep their prefixes when there is room."""
        gc.collect()
        self.runner.empty_cache()
        growth = sum(max(s.predicted - self.runner.held(s), 0) for s in running)
        short = retry_bytes + growth - self.runner.available() if retry_bytes else 0
        freed = 0
        if short > 0:
            freed = self.kv.evict(self.kv.budget_bytes - max(self.kv.total_bytes - short, 0))
            gc.collect()
            self.runner.empty_cache()
        log.warning("engine: OOM recovery emptied the allocator cache and freed %d bytes of idle KV caches", freed)

    def release_fragmentation(self) -> int:
        """Empty the allocator cache once reserved − allocated passes `frag_release_bytes`.

        CUDA only (a no-op elsewhere); the worker calls it when idle. What `empty_cache()` could
        not give back (segments that still hold live tensors) is remembered, so an idle worker
        does not try again every second for nothing; serving a request resets that. Returns the
        reserved bytes given back to the device.
        """
        before = self.runner.snapshot()
        frag = before.fragmentation_bytes
        if frag is None or frag <= max(self.limits.frag_release_bytes, self.frag_floor):
            return 0  # not CUDA, or not fragmented enough to bother
        self.runner.empty_cache()
        after = self.runner.snapshot()
        self.frag_floor = after.fragmentation_bytes or 0
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


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:,.0f} MiB"
