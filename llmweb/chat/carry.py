"""Continue in a new chat: a chat grown unwieldy goes on in a new one that starts from its summary,
its facts, the turns its owner keeps in context and its last few turns, linked back to it.

Owns `Carry.continue_in_new`: what the new chat takes (the window's turns before the last
KEEP_TURNS are folded into the summary first, as a fold would: chat/fold.py; turns left out are
taken by nothing). The new chat has its own id, so its KV cache starts fresh and its first
prompt holds only that. It must not plan or run a turn, nor change the chat it continues.
"""

from __future__ import annotations

import logging
from functools import partial

from llmweb.chat.fold import Memory, fold, learn
from llmweb.chat.memory import Folds, log_id
from llmweb.chat.settings import turn_settings
from llmweb.errors import LlmwebError
from llmweb.records import OUT, PIN

log = logging.getLogger(__name__)

KEEP_TURNS = 3  # the last turns a continued chat starts with, verbatim


class Carry:
    def __init__(self, folds: Folds):
        self.folds = folds

    def continue_in_new(self, owner: str, conv_id: str) -> str:
        """A new chat of `owner` continuing `conv_id` (theirs, else `NotFound`); its id."""
        self.folds.wait(conv_id)  # a fold in flight writes the summary this one starts from
        store = self.folds.store
        conv = store.get(owner, conv_id)
        window = [t for t in conv.turns[conv.summarized_upto :] if t.view != OUT]
        last = window[-KEEP_TURNS:]
        kept = [t for t in conv.turns if t.view == PIN and t not in last]
        rest = [t.as_turn() for t in window[: len(window) - len(last)] if not t.view]
        known = Memory(conv.summary, tuple(conv.facts))
        mine = turn_settings(self.folds.settings, self.folds.budget, conv.settings)
        carried = known
        if rest and mine.summaries:
            write = partial(self.folds.summariser.write, owner=owner)
            try:
                carried = fold(known, rest, write, name=log_id(conv_id))
            except LlmwebError as e:  # the facts still carry what matters
                log.warning("summary for continuing %s failed (%s); keeping its summary", log_id(conv_id), e)
                carried = learn(known, rest)
        elif rest:
            carried = learn(known, rest)
        return store.continue_conversation(owner, conv_id, carried.summary, list(carried.facts), kept + last)
