"""The models kept loaded (LLMWEB_MAX_LOADED, Ollama's OLLAMA_MAX_LOADED_MODELS): the one served
and the ones parked beside it, the turns that hold each, and which to let go first.

A `Resident` is one loaded model (its engine, chat, loaded model, budget and status line). A
`Lease` is one turn's hold on one: a held model is not closed until the turn releases it, so a
request routed to a parked model is answered by it even while another request switches. Parked
models are let go least recently used first: when more than LLMWEB_MAX_LOADED would be loaded,
when a model about to load needs their memory (`to_free`), or after the keep-alive (`idle`).

Owns: the records, their holds and last use, and the choice of whom to let go. Must not: load,
drain or close a model (runtime/switching.py does), or know about owners or the page.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import psutil


@dataclass(eq=False)
class Resident:
    """One loaded model: what serves it, who holds it, when it was last used (time.monotonic())."""

    model_id: str
    engine: Any  # engine/scheduler.py's Engine
    chat: Any  # chat/session.py's Chat
    loaded: Any  # engine/models.py's LoadedModel (None for a remote engine)
    budget: Any  # chat/context.py's Budget
    status: str = ""  # its status line while it serves ("Ready: …")
    used_at: float = field(default_factory=time.monotonic)
    holds: int = 0  # turns running on it now (`Lease`)

    def footprint(self) -> int:
        """The memory it holds: its weights and KV pool, or its engine process's RSS where more (a
        model in the web process has no RSS of its own: that process's counts it with the rest)."""
        lm = self.loaded
        pool = getattr(lm, "kv_bytes_per_token", 0) * getattr(lm, "max_context", 0) * (getattr(lm, "max_batch", 0) or 1)
        held = getattr(lm, "weights_bytes", 0) + pool
        pid = getattr(self.engine.runner, "pid", None)
        if not isinstance(pid, int):
            return held
        try:
            return max(psutil.Process(pid).memory_info().rss, held)
        except psutil.Error:  # it just exited: nothing held
            return 0


class Lease:
    """One turn's hold on a resident model (`Runtime.hold`): `chat` answers, `model_id` names it in
    the response. Release it once, when the turn ends: `with lease as chat:`, or `around(events)`."""

    def __init__(self, model_id: str, chat, release: Callable[[], None] | None = None):
        self.model_id, self.chat = model_id, chat
        self._release = release
        self._lock = threading.Lock()

    def release(self) -> None:
        """Let the model go (again is a no-op)."""
        with self._lock:
            release, self._release = self._release, None
        if release is not None:
            release()

    def around(self, events: Iterator) -> Iterator:
        """`events`, released when they end, fail or are closed (a client gone)."""
        try:
            yield from events
        finally:
            self.release()

    def __enter__(self):
        return self.chat

    def __exit__(self, *exc) -> None:
        self.release()


class Residents:
    """The served model's record and the parked ones', under one lock (`max_loaded` in all)."""

    def __init__(self, max_loaded: int):
        assert max_loaded >= 1, "LLMWEB_MAX_LOADED is checked >= 1 in config.py"
        self.max_loaded = max_loaded
        self._cond = threading.Condition()
        self._serving: Resident | None = None
        self._parked: dict[str, Resident] = {}

    @property
    def serving(self) -> Resident | None:
        return self._serving

    def serve(self, record: Resident) -> None:
        """`record` is the served model from now on (loaded, or taken from the parked ones)."""
        with self._cond:
            assert self._serving is None, f"{self._serving.model_id} is still served: park or unserve it first"
            record.used_at = time.monotonic()
            self._serving = record

    def unserve(self) -> Resident | None:
        """The served model stops being resident (to be closed); None when none was."""
        with self._cond:
            record, self._serving = self._serving, None
            return record

    def park(self) -> Resident | None:
        """The served model stays loaded, parked (its clock restarts: it was in use until now)."""
        with self._cond:
            record, self._serving = self._serving, None
            if record is not None:
                record.used_at = time.monotonic()
                self._parked[record.model_id] = record
            return record

    def unpark(self, model_id: str) -> Resident | None:
        """The parked `model_id` is the served one from now on, in one step (a lease asked for it
        meanwhile finds it parked or served, never neither); None if it is not parked."""
        with self._cond:
            assert self._serving is None, f"{self._serving.model_id} is still served: park or unserve it first"
            record = self._parked.pop(model_id, None)
            if record is not None:
                record.used_at = time.monotonic()
                self._serving = record
            return record

    def remove(self, record: Resident) -> bool:
        """`record` out of the parked ones (to be closed); False when it was not there (taken already)."""
        with self._cond:
            if self._parked.get(record.model_id) is not record:
                return False
            del self._parked[record.model_id]
            return True

    def hold(self, model_id: str | None = None) -> Lease | None:
        """A lease on `model_id` (None: the one served) if it is resident, else None."""
        with self._cond:
            if model_id is None or (self._serving is not None and self._serving.model_id == model_id):
                record = self._serving
            else:
                record = self._parked.get(model_id)
            if record is None:
                return None
            record.holds += 1
            record.used_at = time.monotonic()
        return Lease(record.model_id, record.chat, lambda: self._release(record))

    def _release(self, record: Resident) -> None:
        with self._cond:
            record.holds -= 1
            record.used_at = time.monotonic()
            self._cond.notify_all()

    def wait_unheld(self, record: Resident, timeout: float) -> bool:
        """Wait until no turn holds `record` (taken out first: no new lease reaches it); False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: record.holds == 0, timeout)

    def ids(self) -> list[str]:
        """Every resident model's id: the served one first, then the parked, most recently used first."""
        with self._cond:
            served = [self._serving.model_id] if self._serving is not None else []
            return served + [r.model_id for r in reversed(self._lru())]

    def parked(self) -> list[Resident]:
        """The parked models, least recently used first."""
        with self._cond:
            return self._lru()

    def over(self, loading: int = 0) -> list[Resident]:
        """The parked models to let go, least recently used first, so that at most `max_loaded` are
        loaded once `loading` more have loaded."""
        with self._cond:
            extra = (self._serving is not None) + len(self._parked) + loading - self.max_loaded
            return self._lru()[: max(extra, 0)]

    def idle(self, seconds: float, now: float | None = None) -> list[Resident]:
        """The parked models no turn holds and none has used for `seconds` (the keep-alive's)."""
        now = time.monotonic() if now is None else now
        with self._cond:
            return [r for r in self._lru() if r.holds == 0 and now - r.used_at >= seconds]

    def _lru(self) -> list[Resident]:
        return sorted(self._parked.values(), key=lambda r: r.used_at)


def to_free(parked: list[Resident], footprint: Callable[[Resident], int], room: int, need: int) -> list[Resident]:
    """Of `parked` (least recently used first), the fewest from the front to let go so that `need`
    bytes fit in `room` plus what they hold; all of them when even that is not enough (the load
    then says what did not fit)."""
    out: list[Resident] = []
    for record in parked:
        if room >= need:
            break
        out.append(record)
        room += footprint(record)
    return out
