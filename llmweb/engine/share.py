"""Each owner's share of the engine over the last minute: the prompt tokens its requests prefilled
and the optional jobs (warm-ups) it started, and the refusals that follow from the limits
(`EngineLimits.prompt_tokens_per_min`, `warmups_per_min`, `warmups_per_owner_min`).

A limit falls on the owner who passes it: an owner over its prompt tokens gets the busy message
for its next request while everyone else's are taken as before; an optional job over either
warm-up limit is dropped, never queued.

The owner's running requests are capped too (`Full`, `EngineLimits.running_per_user`), and a
visitor's request that waits for room pre-empts an optional job in the batch (`preempt`).

An anonymous visitor can start new identities (a browser without its cookie, an API call without a
conversation id), each with its own caps; so the owners of one client address (the web layer names
it: web/trust.py's group, an IPv6 /64) also share `running_per_address` and
`prompt_tokens_per_address_min`, and the limit falls on that address, not on the others.

Owns: the sliding minute of use per owner and per address and its messages, the owners at their
running cap, the choice of the optional job that gives way. Must not: lock (the engine holds its
lock around every call), order the queue (queue.py) or run anything.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable

from llmweb.engine.request import EngineLimits, Handle, Slot
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
    """The engine's per-owner and per-address limits over the last minute (see the module docstring)."""

    def __init__(self, limits: EngineLimits):
        self.limits = limits
        self.prefilled = Meter()  # interactive prompt tokens prefilled, per owner
        self.prefilled_by_address = Meter()  # ... per address group
        self.warmups = Meter()  # optional jobs accepted, per owner
        self._address: OrderedDict[str, str] = OrderedDict()  # owner -> its address group, least recent first

    def note_address(self, owner: str, group: str) -> None:
        """The web layer's word: `owner`'s requests come from address group `group`."""
        if owner in EXEMPT or not group:
            return
        self._address.pop(owner, None)
        self._address[owner] = group
        while len(self._address) > MAX_OWNERS:
            del self._address[next(iter(self._address))]

    def address_of(self, owner: str) -> str:
        return self._address.get(owner, "")

    def add_prefilled(self, owner: str, tokens: int) -> None:
        self.prefilled.add(owner, tokens)
        if address := self.address_of(owner):
            self.prefilled_by_address.add(address, tokens)

    def check_prompt(self, owner: str) -> None:
        """BusyError when `owner`'s requests, or those of all the owners of its address, prefilled
        their cap of prompt tokens in the last minute."""
        cap = self.limits.prompt_tokens_per_min
        if cap > 0 and owner not in EXEMPT and (used := self.prefilled.used(owner)) >= cap:
            raise BusyError(
                f"You sent {used:,} prompt tokens in the last minute, over this server's limit of {cap:,} "
                f"per visitor; try again in {self.prefilled.free_in(owner):.0f} s."
            )
        cap, address = self.limits.prompt_tokens_per_address_min, self.address_of(owner)
        if cap > 0 and address and (used := self.prefilled_by_address.used(address)) >= cap:
            raise BusyError(
                f"Visitors from your address sent {used:,} prompt tokens in the last minute, over this "
                f"server's limit of {cap:,} per address; try again in "
                f"{self.prefilled_by_address.free_in(address):.0f} s."
            )

    def full(self, running: list[Slot]) -> Full:
        """The owners whose next interactive request waits for room: at `running_per_user` in the
        batch themselves, or their address at `running_per_address`."""
        owners: dict[str, int] = {}
        addresses: dict[str, int] = {}
        for s in running:
            if s.request.background or s.request.owner in EXEMPT:
                continue
            owners[s.request.owner] = owners.get(s.request.owner, 0) + 1
            if address := self.address_of(s.request.owner):
                addresses[address] = addresses.get(address, 0) + 1
        per_user, per_address = self.limits.running_per_user, self.limits.running_per_address
        return Full(
            {o for o, n in owners.items() if per_user > 0 and n >= per_user},
            {a for a, n in addresses.items() if per_address > 0 and n >= per_address},
            self.address_of,
        )

    def small_chunks(self, slot: Slot, running: list[Slot]) -> bool:
        """Should `slot`'s next chunk be a small one? Yes for every visitor's prompt: a chunk is never
        cut, and another stranger may arrive at any step (a short turn that met a light visitor's
        full 256-token chunk on llama.cpp waited ~1.4 s for it on 2 cores, ~3x its time alone); the
        small ones cost a long prompt ~15% (`llama-bench -p 256 -t 1`: 147-152 tok/s in 64-token
        batches, 174 in 256). The owner of a single-user install alone, or beside only their own
        requests, keeps the runner's own size: there is nobody to protect.

        A background prompt (a whole-document step, a summary) always goes in small chunks: a
        visitor who arrives while a full one runs waits for all of it (`bench document`: first
        token 0.67 s beside the task against 0.13 s in small ones), and the full ones did not make
        the task faster (cold summary 60.4 s against 56.7 s: prefill is compute-bound here)."""
        owner = slot.request.owner
        if slot.request.background:
            return True
        return owner not in EXEMPT or any(s.request.owner != owner for s in running)

    def take_warmup(self, owner: str, busy: bool) -> None:
        """Count an optional job of `owner`; BusyError (it is dropped, never queued) when the engine
        is `busy` (anything waits, or the batch is full) or over either warm-up limit."""
        if busy:
            raise BusyError("Warm-up dropped: the model is busy.")
        per_owner, in_all = self.limits.warmups_per_owner_min, self.limits.warmups_per_min
        if per_owner > 0 and self.warmups.used(owner) >= per_owner:
            raise BusyError("Warm-up dropped: this visitor's warm-ups for this minute are spent.")
        if in_all > 0 and self.warmups.total() >= in_all:
            raise BusyError("Warm-up dropped: this server's warm-ups for this minute are spent.")
        self.warmups.add(owner, 1)


class Full:
    """Owners whose next interactive request waits (`Shares.full`): the queue asks `owner in full`."""

    def __init__(self, owners: set[str], addresses: set[str], address_of: Callable[[str], str]):
        self.owners, self.addresses, self.address_of = owners, addresses, address_of

    def __contains__(self, owner: object) -> bool:
        if not isinstance(owner, str):
            return False
        return owner in self.owners or (bool(self.addresses) and self.address_of(owner) in self.addresses)


def preempt(running: list[Slot], waiting: Handle) -> None:
    """A visitor's request waits for room: the youngest optional job (a warm-up) in the batch stops
    at the end of this step (its session keeps what it prefilled)."""
    if waiting.request.background:
        return
    optional = [s for s in running if s.request.optional and s.finish is None]
    if optional:
        optional[-1].finish = "cancelled"
