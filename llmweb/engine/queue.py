"""The requests waiting to run: a fair interactive lane and a background lane.

Strangers share one server, so the interactive queue is fair between owners
(`GenerationRequest.owner`; "" is one owner too): each owner may have `queue_per_user` requests
waiting (running ones do not count), and the owners take turns, round-robin (`FairQueue`: the
owner served least recently goes next; one owner's requests first-in first-out).
`handle.position` counts what is really ahead in that order, so it can grow when a new owner
arrives. Background jobs (summaries) start only when no interactive request waits; they have
their own bound and no per-owner cap.

Owns: the order of waiting requests and the queue bounds (`BusyError`). Must not: lock (the
engine holds its lock around every call), admit, run or finish a request, or import torch.
"""

from __future__ import annotations

import itertools
from collections import deque

from llmweb.engine.request import EngineLimits, Handle
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


class Lanes:
    """The engine's waiting requests: `interactive` (a `FairQueue`) and `background` (first in,
    first out, served only when no interactive request waits). Not thread-safe: the engine holds
    its lock around every call."""

    def __init__(self, limits: EngineLimits) -> None:
        self.limits = limits
        self.interactive = FairQueue()
        self.background: deque[Handle] = deque()

    def __bool__(self) -> bool:
        return bool(self.interactive) or bool(self.background)

    def push(self, handle: Handle) -> None:
        """Queue a request; BusyError when its lane is full or, interactive, its owner already has
        `queue_per_user` requests waiting."""
        request = handle.request
        lane = self.background if request.background else self.interactive
        bound = self.limits.queue_size * (4 if request.background else 1)
        if len(lane) >= bound:
            raise BusyError(f"The model is busy: {len(lane)} requests are waiting. Try again in a moment.")
        if request.background:
            self.background.append(handle)
            return
        mine = self.interactive.waiting(request.owner)
        if mine >= self.limits.queue_per_user:
            raise BusyError(
                f"The model is busy: you already have {mine} request{'s' if mine != 1 else ''} "
                "waiting; wait for them to finish or stop one."
            )
        self.interactive.push(handle)

    def peek(self) -> Handle | None:
        """The request to admit next: interactive first (fair between owners), then background."""
        if self.interactive:
            return self.interactive.peek()
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
