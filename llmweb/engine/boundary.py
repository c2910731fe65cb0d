"""The wire between the web process and the engine process: what crosses it, and the engine
process's side of it (`serve`).

The web process keeps the scheduler (engine/scheduler.py: the queue, fairness, admission, cancel,
time limits, the OOM retry's fallback, which is a closure over the chat's plan and never crosses);
the engine process keeps the runner (the model, its KV pool, the sessions' caches). Every
`Runner` call of the scheduler becomes one message and one answer over a
`multiprocessing.connection.Connection` on an anonymous socket pair that only the two processes
hold (its pickles come from our own child, never from a client):

    ("start", key, request)       ->  SlotDelta       the request without its fallback
    ("prefill", key, small)       ->  (ok, SlotDelta)   small: the scheduler's `Slot.small_chunks`
    ("decode", [key, ...])        ->  (ok, [SlotDelta, ...])   one batched step
    ("release", key, keep, finish) -> SlotDelta       the runner's release stats
    ("call", name, args)          ->  value            predict, padding, available, snapshot, empty_cache,
                                                       timing, the KV store's maintenance, and a
                                                       kept session's cache out and in (a recycle)

Ids and figures cross, never text. The engine process keeps a mirror `Slot` per request: the
runner records the ids it samples there, and the web process replays them (`SlotDelta.apply`) on
its own slot, so both agree on `finish` (a stop id, the length cap) without asking.

Owns: the message shapes and the engine process's dispatch loop. Must not: start or watch a
process (engine/process.py), build a runner (runtime/worker.py), or import torch.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from llmweb.engine import faults
from llmweb.engine.request import GenerationRequest, Slot, TokenLogprob
from llmweb.errors import LlmwebError
from llmweb.records import GenerationStats

log = logging.getLogger(__name__)

# the stats a runner writes on a slot (runners/base.py); the rest are the scheduler's
RUNNER_STATS = (
    "reused_tokens",
    "prefilled_tokens",
    "kv_session_bytes",
    "kv_store_bytes",
    "loop_cuts",
    "loop_stopped",
    "mem",
)
# what the web process may call on the runner or its KV store by name (nothing else is dispatched)
CALLS = frozenset(
    {"predict", "padding", "available", "snapshot", "empty_cache", "timing", "kv", "kv_export", "kv_import"}
)
KV_CALLS = frozenset({"drop", "expire", "evict", "clear", "total_bytes", "budget_bytes", "session_bytes", "sessions"})


@dataclass
class SlotDelta:
    """What one call changed on a request's mirror slot: the ids sampled, in order (a stop id
    included), whether its prompt is in, how it finished, a runner's error, its stats, and the KV
    it holds."""

    sampled: list[int] = field(default_factory=list)
    ready: bool = False
    finish: str | None = None
    error: LlmwebError | None = None
    stats: dict[str, Any] = field(default_factory=dict)
    held: int = 0
    logprobs: list[TokenLogprob | None] = field(default_factory=list)  # one per sampled id, when asked

    def apply(self, slot: Slot) -> None:
        """Replay this on the web process's slot: the same ids through `Slot.record`, so it
        streams them and finishes as the mirror did."""
        for i, token in enumerate(self.sampled):
            slot.record(token, self.logprobs[i] if i < len(self.logprobs) else None)
        slot.ready = slot.ready or self.ready
        if slot.finish is None and self.finish is not None:
            slot.finish = self.finish
        if self.error is not None:
            slot.error, slot.finish = self.error, "error"
        for name, value in self.stats.items():
            setattr(slot.stats, name, value)


class _Sink:
    """The mirror slot's handle: the engine process streams nothing itself."""

    cancelled = False

    def __init__(self, key: int):
        self.id = key

    def _emit(self, ids: list[int], logprobs: list[TokenLogprob] | None = None) -> None:
        return None


@dataclass(eq=False)
class _Mirror(Slot):
    sampled: list[int] = field(default_factory=list)  # since the last delta
    logprobs: list[TokenLogprob | None] = field(default_factory=list)  # beside `sampled`, when asked

    def record(self, token: int, logprob: TokenLogprob | None = None) -> None:
        self.sampled.append(token)
        if self.request.logprobs is not None:
            self.logprobs.append(logprob)
        super().record(token, logprob)


def strip(request: GenerationRequest) -> GenerationRequest:
    """The request as it crosses: without its fallback (a closure of the web process's)."""
    return dataclasses.replace(request, fallback=None) if request.fallback is not None else request


def serve(conn: Connection, runner, kv) -> bool:
    """The engine process's loop: answer the web process's calls until it says "exit" or goes away
    (False), or until a call failed with a sticky device error (True: answered, and the caller
    must end the process, whose device context is lost; engine/faults.py)."""
    slots: dict[int, _Mirror] = {}

    def delta(s: _Mirror) -> SlotDelta:
        d = SlotDelta(list(s.sampled), s.ready, s.finish, s.error, {n: getattr(s.stats, n) for n in RUNNER_STATS})
        d.held = runner.held(s) if s.state is not None else 0
        d.logprobs, s.logprobs = s.logprobs, []
        s.sampled.clear()
        return d

    def call(name: str, args: tuple) -> Any:
        if name == "kv":
            what, *rest = args
            if what not in KV_CALLS:
                raise LlmwebError(f"no KV call {what!r}")
            attr = getattr(kv, what)
            return attr(*rest) if callable(attr) else attr
        if name == "timing":
            return runner.timing
        if name == "kv_export":  # (ids, owner, bytes, nbytes) of a kept session; None: absent or not portable
            entry = kv.peek(args[0])
            data = runner.export_cache(entry.cache) if entry is not None else None
            return None if data is None else (entry.ids, entry.owner, data, entry.nbytes)
        if name == "kv_import":
            session_id, ids, owner, data, nbytes = args
            return kv.put(session_id, ids, runner.import_cache(data), nbytes, owner=owner)
        return getattr(runner, name)(*args)

    def handle(msg: tuple) -> Any:
        op = msg[0]
        if op == "start":
            _, key, request = msg
            s = _Mirror(
                _Sink(key),  # type: ignore[arg-type]
                request,
                0,
                float("inf"),
                GenerationStats(prompt_tokens=len(request.prompt_ids)),
            )
            runner.start(s)
            slots[key] = s
            return delta(s)
        if op == "prefill":
            s = slots[msg[1]]
            s.small_chunks = msg[2]  # the scheduler's choice, made in the web process
            return runner.prefill(s), delta(s)
        if op == "decode":
            batch = [slots[k] for k in msg[1]]
            return runner.decode(batch), [delta(s) for s in batch]
        if op == "release":
            _, key, keep, finish = msg
            s = slots.pop(key, None)  # type: ignore[arg-type]
            if s is None:
                return SlotDelta()
            s.finish = s.finish or finish
            runner.release(s, keep)
            return delta(s)
        if op == "call" and msg[1] in CALLS:
            return call(msg[1], msg[2])
        raise LlmwebError(f"the engine process does not know {op!r}")

    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return False  # the web process is gone: so are we
        if msg[0] == "exit":
            conn.send(("ok", None))
            return False
        answer, lost = _answer(handle, msg)
        conn.send(answer)
        if lost:
            log.error("engine process: a sticky device error; this process ends and a new one takes over")
            return True


def _answer(handle: Callable[[tuple], Any], msg: tuple) -> tuple[tuple[str, Any], bool]:
    """(the answer to `msg`, whether it failed with a sticky device error: engine/faults.py)."""
    try:
        return ("ok", handle(msg)), False
    except LlmwebError as e:
        return ("error", e), False
    except Exception as e:  # the web process fails that request; this process goes on, unless sticky
        log.exception("engine process: %s failed", msg[0])
        return ("error", LlmwebError(f"Generation failed: {type(e).__name__}: {e}")), faults.sticky(e)
