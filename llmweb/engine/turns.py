"""Whose prompt gets the step's prefill chunk: engine time shared between owners, not only admission.

Each step of the batch runs at most one prompt chunk (hundreds of tokens: about a second on a
2-core CPU) before the batch's decode (a token for every reply: ~15 ms there), so the choice of
chunk decides how fast everyone else's replies go:

  a visitor's prompt   goes before a background one (a summary, a document step, a warm-up);
                       free while no other owner's reply decodes; beside one, only once its
                       owner's last chunk was followed by (1 / BACKGROUND_SHARE - 1) times its
                       time: one owner's prompts, however many tabs send them, take at most that
                       share from another owner's reply, and the first chunk of an owner who had
                       none lately is never held back;
  a background prompt  runs only when no visitor's prompt joins; beside any visitor's reply, on
                       one step in BACKGROUND_EVERY and within BACKGROUND_SHARE of the time;
  among equals         the owner whose prompt had a chunk least recently goes next
                       (round-robin), then the oldest slot.

Owns: that choice and its bookkeeping. Must not: lock (only the worker thread calls it), run,
admit or finish a request, or import torch.
"""

from __future__ import annotations

import time

from llmweb.engine.request import Slot

# while a visitor's reply decodes, a background prompt (a summary, a whole-document step) gets a
# prefill chunk on one step in this many (a chunk every step: the visitor's decode fell from 27.8 to
# 4.1 tok/s next to a whole-document task in `bench document`, on the 2-core CPU)
BACKGROUND_EVERY = 4
# ... and no more than this share of the time: a chunk's length is the runner's (512 tokens of int8
# matrix products, 256 of llama.cpp, about 1 s on the 2-core CPU against a 15 ms decode step), so a
# step count alone let a visitor's reply decode at 3.7 tok/s next to a whole-document task there;
# the same share bounds one owner's prompts beside another owner's reply
BACKGROUND_SHARE = 0.25


class ChunkTurns:
    """The worker's choice of chunk each step (see the module docstring)."""

    def __init__(self) -> None:
        self._steps = 0  # steps a background prompt asked for a chunk (`_background_turn`)
        self._background_free_at = 0.0  # when a background chunk may run again beside a visitor's reply
        self._owner_free_at: dict[str, float] = {}  # owner -> when its prompt may run again beside another's reply
        self._served: dict[str, int] = {}  # owner -> the turn its prompt last had a chunk (owners in the batch)
        self._turn = 0

    def pick(self, running: list[Slot]) -> tuple[Slot | None, bool]:
        """The slot whose prompt gets this step's chunk (None: decode only), and whether it runs
        beside a reply it must not slow down (tell `ran` how long every chunk took)."""
        joining = [s for s in running if not s.ready and s.finish is None]
        if not joining:
            return None, False
        decoding = {s.request.owner for s in running if s.ready and s.finish is None and not s.request.background}
        visitors = [s for s in joining if not s.request.background]
        if visitors:
            now = time.perf_counter()
            for gone in [o for o, t in self._owner_free_at.items() if t <= now]:
                del self._owner_free_at[gone]
            waits = self._owner_free_at  # owners whose last chunk is still being paid for
            ready = [s for s in visitors if not decoding - {s.request.owner} or s.request.owner not in waits]
            if not ready:
                return None, False
            slot = self._next_owner(ready, running)
            return slot, bool(decoding - {slot.request.owner})
        if not self._background_turn(bool(decoding)):
            return None, False
        return self._next_owner(joining, running), bool(decoding)

    def ran(self, slot: Slot, beside: bool, t0: float, end: float) -> None:
        """`slot`'s chunk ran from `t0` to `end` (`beside` a reply it must not slow down): the other
        owners' replies get (1 / BACKGROUND_SHARE - 1) times its time before its owner's next chunk
        beside them (a background chunk's: before any background chunk, when it ran beside one).
        A visitor's chunk counts even when nobody else decoded: a reply that starts right after it
        does not meet that owner's next chunk at once."""
        free_at = end + (end - t0) * (1 / BACKGROUND_SHARE - 1)
        if not slot.request.background:
            self._owner_free_at[slot.request.owner] = free_at
        elif beside:
            self._background_free_at = free_at

    def _next_owner(self, slots: list[Slot], running: list[Slot]) -> Slot:
        """Round-robin between owners: the first slot of the owner served least recently."""
        slot = min(slots, key=lambda s: self._served.get(s.request.owner, -1))
        self._turn += 1
        self._served.pop(slot.request.owner, None)
        self._served[slot.request.owner] = self._turn
        owners = {s.request.owner for s in running}
        for gone in [o for o in self._served if o not in owners]:
            del self._served[gone]  # only the owners in the batch are remembered
        return slot

    def _background_turn(self, decoding: bool) -> bool:
        """May a background prompt take this step's chunk? Beside a visitor's reply, only after
        BACKGROUND_EVERY steps and (1 / BACKGROUND_SHARE - 1) times the last chunk's time."""
        self._steps += 1
        if not decoding:
            return True
        if self._steps < BACKGROUND_EVERY or time.perf_counter() < self._background_free_at:
            return False
        self._steps = 0
        return True
