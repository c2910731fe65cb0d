"""Folding turns out of the window: the one place both chats (session.py, stateless.py) do it.

Owns: what a fold makes of turns (`fold`: the summary written of them, grounded in them, and the
user's new fact sentences after the known ones, de-duplicated), and the one answer to "how many
turns fit one summary prompt" (`turns_fitting`). Recall's passages of folded turns come from
chat/recall.py (`recall_chunks`). Pure but for the summariser it is handed: it must not store
anything, submit engine jobs itself, or decide when to fold (chat/summary.py's `turns_to_fold`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from llmweb.chat import facts, summary
from llmweb.chat.tokens import ChatFormat, render_prompt
from llmweb.records import Turn

log = logging.getLogger(__name__)

Write = Callable[[str, list[Turn]], str]  # (previous summary, turns) -> the summary after them


@dataclass(frozen=True, slots=True)
class Memory:
    """What stands for folded turns: the summary and the user's facts from them (oldest first;
    `facts.FactLike`, or the store's facts: anything with `.text` and `.pinned`)."""

    summary: str = ""
    facts: tuple = ()


def new_facts(known: Sequence, turns: Sequence[Turn]) -> list[str]:
    """The user's fact sentences in `turns` that no known fact (`.text`) already says (case and spacing aside)."""
    seen = {" ".join(f.text.lower().split()) for f in known}
    return [f for f in facts.extract_facts(t.user for t in turns) if " ".join(f.lower().split()) not in seen]


def grounded(previous: str, turns: Sequence[Turn], written: str, *, name: str = "") -> str:
    """`written` (the summary after `turns`) without the sentences that carry a name, number or
    date found neither in the turns nor in the previous summary (`facts.ground`)."""
    source = previous + "\n" + "\n".join(f"{t.user}\n{t.assistant}" for t in turns)
    result = facts.ground(written, source)
    if result.dropped:
        # the sentences are the user's conversation: their lengths at INFO, their text at DEBUG only
        lengths = [len(d) for d in result.dropped]
        log.info("summary for %s: dropped %d ungrounded sentences (%s characters)", name, len(lengths), lengths)
        log.debug("summary for %s: the dropped sentences: %s", name, result.dropped)
    return result.text


def fold(memory: Memory, turns: Sequence[Turn], write: Write, *, name: str = "") -> Memory:
    """The memory after folding `turns`: the summary `write` makes of them, grounded, and their new
    fact sentences (unpinned) after the known facts. `write`'s domain errors propagate: the caller
    decides whether the chat moves on without a new summary (`learn`) or stops folding."""
    written = grounded(memory.summary, turns, write(memory.summary, list(turns)), name=name)
    return learn(Memory(written, memory.facts), turns)


def learn(memory: Memory, turns: Sequence[Turn]) -> Memory:
    """The memory with the new fact sentences of `turns` (unpinned) after its facts; the summary as it is."""
    learned = tuple(facts.FactLike(f, False) for f in new_facts(memory.facts, turns))
    return Memory(memory.summary, memory.facts + learned)


def turns_fitting(fmt: ChatFormat, previous: str, turns: Sequence[Turn], cap: int, limit: int) -> int:
    """How many turns fit one summary prompt: the most of `turns` (at least one) whose prompt, asking
    for `cap` tokens after the summary `previous`, is at most `limit` tokens."""
    assert turns, "no turns to summarise"

    def fits(n: int) -> bool:
        system, user = summary.segment_request_messages(previous, turns[:n], cap)
        return len(render_prompt(fmt, system, [("user", user)])) <= limit

    lo, hi = 1, len(turns)  # binary search: fits(n) only gets false as n grows
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo
