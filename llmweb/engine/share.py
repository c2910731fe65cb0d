"""Each owner's share of the engine over the last minute: the prompt tokens its requests prefilled
and the optional jobs (warm-ups) it started, and the refusals that follow from the limits
(`EngineLimits.prompt_tokens_per_min`, `warmups_per_min`, `warmups_per_owner_min`).

A limit falls on the owner who passes it: an owner over its prompt tokens gets the busy message
for its next request while everyone else's are taken as before; an optional job over either
warm-up limit is dropped, never queued.

The owner's running requests are capped too (`full_owners`, `EngineLimits.running_per_user`), and a
visitor's request that waits for room pre-empts an optional job in the batch (`preempt`).

Owns: the sliding minute of use per owner and its messages, the owners at their running cap, the
choice of the optional job that gives way. Must not: lock (the engine holds its
lock around every call), order the queue (queue.py) or run anything.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from llmweb.engine.request import Handle, Slot
from llmweb.errors import BusyError
from llmweb.records import LOCAL_OWNER

WINDOW_S = 60.0
MAX_OWNERS = 4096  # owners remembered at once; the one whose last use is oldest is forgotten first
# not capped per owner: a single-user install's one owner, and requests of nobody in particular (the CLI)
EXEMPT = frozenset({"", LOCAL_OWNER})


class Meter:
    """Amounts per owner over the last WINDOW_S seconds (a deque of (time, amount) each)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self._use: dict[str, deque[tuple[float, int]]] = {}  # insertion order: least recently used first

    def add(self, owner: str, amount: int) -> None:
        if amount <= 0:
            return
        use = self._use.pop(owner, None) or deque()
        use.append((self.clock(), amount))
        self._use[owner] = use
        while len(self._use) > MAX_OWNERS:
            del self._use[next(iter(self._use))]

    def used(self, owner: str) -> int:
        use = self._use.get(owner)
        if use is None:
            return 0
        start = self.clock() - WINDOW_S
        while use and use[0][0] < start:
            use.popleft()
        if not use:
            del self._use[owner]
        return sum(n for _, n in use)

    def total(self) -> int:
        return sum(self.used(o) for o in list(self._use))

    def free_in(self, owner: str) -> float:
        """Seconds until the oldest use of `owner` in the window leaves it."""
        use = self._use.get(owner)
        return max(use[0][0] + WINDOW_S - self.clock(), 0.0) if use else 0.0


class Shares:
    """The engine's per-owner limits over the last minute (see the module docstring)."""

    def __init__(self, prompt_tokens_per_min: int, warmups_per_min: int, warmups_per_owner_min: int):
        self.prompt_tokens_per_min = prompt_tokens_per_min
        self.warmups_per_min = warmups_per_min
        self.warmups_per_owner_min = warmups_per_owner_min
        self.prefilled = Meter()  # interactive prompt tokens prefilled, per owner
        self.warmups = Meter()  # optional jobs accepted, per owner

    def check_prompt(self, owner: str) -> None:
        """BusyError when `owner`'s requests prefilled `prompt_tokens_per_min` tokens in the last minute."""
        cap = self.prompt_tokens_per_min
        if cap > 0 and owner not in EXEMPT and (used := self.prefilled.used(owner)) >= cap:
            raise BusyError(
                f"You sent {used:,} prompt tokens in the last minute, over this server's limit of {cap:,} "
                f"per visitor; try again in {self.prefilled.free_in(owner):.0f} s."
            )

    def small_chunks(self, slot: Slot, running: list[Slot]) -> bool:
        """Should `slot`'s next chunk be a small one? Yes for every visitor's prompt: a chunk is never
        cut, and another stranger may arrive at any step (a short turn that met a light visitor's
        full 256-token chunk on llama.cpp waited ~1.4 s for it on 2 cores, ~3x its time alone); the
        small ones cost a long prompt ~15% (`llama-bench -p 256 -t 1`: 147-152 tok/s in 64-token
        batches, 174 in 256). The owner of a single-user install alone, or beside only their own
        requests, keeps the runner's own size: there is nobody to protect."""
        owner = slot.request.owner
        if slot.request.background:  # background prompts have small chunks of their own (the runner's)
            return False
        return owner not in EXEMPT or any(s.request.owner != owner for s in running)

    def take_warmup(self, owner: str, busy: bool) -> None:
        """Count an optional job of `owner`; BusyError (it is dropped, never queued) when the engine
        is `busy` (anything waits, or the batch is full) or over either warm-up limit."""
        if busy:
            raise BusyError("Warm-up dropped: the model is busy.")
        if self.warmups_per_owner_min > 0 and self.warmups.used(owner) >= self.warmups_per_owner_min:
            raise BusyError("Warm-up dropped: this visitor's warm-ups for this minute are spent.")
        if self.warmups_per_min > 0 and self.warmups.total() >= self.warmups_per_min:
            raise BusyError("Warm-up dropped: this server's warm-ups for this minute are spent.")
        self.warmups.add(owner, 1)


def full_owners(running: list[Slot], cap: int) -> set[str]:
    """Owners with `cap` interactive requests in the batch: their next one waits (0: no cap)."""
    if cap <= 0:
        return set()
    counts: dict[str, int] = {}
    for s in running:
        if not s.request.background and s.request.owner not in EXEMPT:
            counts[s.request.owner] = counts.get(s.request.owner, 0) + 1
    return {o for o, n in counts.items() if n >= cap}


def preempt(running: list[Slot], waiting: Handle) -> None:
    """A visitor's request waits for room: the youngest optional job (a warm-up) in the batch stops
    at the end of this step (its session keeps what it prefilled)."""
    if waiting.request.background:
        return
    optional = [s for s in running if s.request.optional and s.finish is None]
    if optional:
        optional[-1].finish = "cancelled"
