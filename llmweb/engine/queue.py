"""The requests waiting to run: a fair interactive lane and a background lane.

Strangers share one server, so the interactive queue is fair between owners
(`GenerationRequest.owner`; "" is one owner too): each owner may have `queue_per_user` requests
waiting (running ones do not count; a single-user install's own owner, `uncapped_owner`, 4 x
`queue_size`: its parallel calls queue), and the owners take turns, round-robin (`FairQueue`: the
owner served least recently goes next; one owner's requests first-in first-out).
`handle.position` counts what is really ahead in that order, so it can grow when a new owner
arrives. The interactive lane has no count bound: a request is refused when its estimated wait
(engine/waitroom.py: the work ahead of it in this order and of the running batch, over the
measured throughput) passes `max_wait_s`. Background jobs (summaries) start only when no
interactive request waits; they have their own bound (a count) and no per-owner cap.

Owns: the order of waiting requests and the queue bounds (`BusyError`). Must not: lock (the
engine holds its lock around every call), admit, run or finish a request, or import torch.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Container

from llmweb.engine.request import EngineLimits, Handle
from llmweb.engine.waitroom import busy_message
from llmweb.errors import BusyError


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

    def peek(self, skip: Container[str] = ()) -> Handle:
        """The next request to serve, of an owner not in `skip` (IndexError when there is none)."""
        owner = next((o for o in self._order() if o not in skip), None)
        if owner is None:
            raise IndexError("no request to serve")
        return self._owners[owner][0][1]

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
        """1 = served next, if nothing new arrives; 0 = not waiting here."""
        ahead = self.ahead(handle)
        return 0 if ahead is None else len(ahead) + 1

    def ahead(self, handle: Handle) -> list[Handle] | None:
        """The requests served before this one, in order, if nothing new arrives; None if it is not
        waiting here."""
        order = self.serving_order()
        if not any(h is handle for h in order):
            return None
        return order[: next(i for i, h in enumerate(order) if h is handle)]

    def serving_order(self) -> list[Handle]:
        """Every waiting request in the order it will be served if nothing new arrives: the owners
        take turns in `_order()`, one request each per round."""
        queues = [self._owners[o] for o in self._order()]
        rounds = max((len(q) for q in queues), default=0)
        return [q[i][1] for i in range(rounds) for q in queues if i < len(q)]

    def drain(self) -> list[Handle]:
        """Take every waiting request out (at shutdown)."""
        handles = [h for q in self._owners.values() for _, h in q]
        self._owners.clear()
        return handles

    def _order(self) -> list[str]:
        """The owners with requests waiting, in the order of their next turns."""
        return sorted(self._owners, key=lambda o: (self._served.get(o, -1), self._owners[o][0][0]))


class Lanes:
    """The engine's waiting requests: `interactive` (a `FairQueue`) and `background` (first in,
    first out, served only when no interactive request waits). `wait_s(ahead)` estimates how
    long a request with the requests `ahead` before it waits (the engine's waiting room; without
    one, nothing is refused for its wait). Not thread-safe: the engine holds its lock around
    every call."""

    def __init__(self, limits: EngineLimits, wait_s: Callable[[list[Handle]], float] | None = None) -> None:
        self.limits = limits
        self.interactive = FairQueue()
        self.background: deque[Handle] = deque()
        self.wait_s = wait_s or (lambda ahead: 0.0)

    def __bool__(self) -> bool:
        return bool(self.interactive) or bool(self.background)

    def push(self, handle: Handle) -> float:
        """Queue a request and return its estimated wait. BusyError when, interactive, its owner
        already has `queue_per_user` requests waiting or its estimated wait is over `max_wait_s`;
        background, when `4 x queue_size` jobs wait."""
        request = handle.request
        if request.background:
            if len(self.background) >= self.limits.queue_size * 4:
                n = len(self.background)
                raise BusyError(f"The model is busy: {n} background jobs are waiting. Try again in a moment.")
            self.background.append(handle)
            return 0.0
        mine = self.interactive.waiting(request.owner)
        uncapped = bool(request.owner) and request.owner == self.limits.uncapped_owner
        if mine >= (self.limits.queue_size * 4 if uncapped else self.limits.queue_per_user):
            raise BusyError(
                f"The model is busy: you already have {mine} request{'s' if mine != 1 else ''} "
                "waiting; wait for them to finish or stop one."
            )
        self.interactive.push(handle)
        _, wait = self.estimate(handle)
        if wait > self.limits.max_wait_s:
            self.interactive.remove(handle)
            raise BusyError(busy_message(wait, self.limits.max_wait_s))
        return wait

    def peek(self, full: Container[str] = ()) -> Handle | None:
        """The request to admit next: interactive first (fair between owners; none of an owner in
        `full`, those already running their `running_per_user`), then background."""
        if self.interactive:
            try:
                return self.interactive.peek(full)
            except IndexError:
                pass
        if self.background:
            return self.background[0]
        return None

    def take(self, handle: Handle) -> bool:
        """Take a request out to run it (its owner's turn is spent); False if it no longer waits."""
        return self.interactive.take(handle) or self._remove_background(handle)

    def remove(self, handle: Handle) -> bool:
        """Take a cancelled request out; False if it no longer waits (running, done, never queued)."""
        return self.interactive.remove(handle) or self._remove_background(handle)

    def position(self, handle: Handle) -> int:
        return self.interactive.position(handle)

    def estimate(self, handle: Handle) -> tuple[int, float]:
        """(position, estimated seconds until it starts) of a waiting interactive request; (0, 0.0)
        for any other."""
        ahead = self.interactive.ahead(handle)
        if ahead is None:
            return 0, 0.0
        return len(ahead) + 1, self.wait_s(ahead)

    def drain(self) -> list[Handle]:
        """Take every waiting request out (at shutdown)."""
        pending = self.interactive.drain() + list(self.background)
        self.background.clear()
        return pending

    def _remove_background(self, handle: Handle) -> bool:
        try:
            self.background.remove(handle)
            return True
        except ValueError:
            return False
