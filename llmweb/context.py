"""The context planner: what goes into this turn's prompt, and what is left out and why.

`plan(...)` is a pure function of the conversation and a `Budget`: no torch, no I/O, no model.
It measures every section by rendering it with the `ChatFormat` (never by estimating) and
returns a `ContextPlan` whose `ids` are exactly the prompt the engine will run.

Prompt layout (one chat message per line):

    system     system prompt + "\\n\\nSummary of the conversation so far:\\n" + summary
    user       oldest kept turn            } history: whole turns, the newest ones,
    assistant  ...                         } contiguous up to the last turn
    user       [earlier passages] + [numbered sources] + the user's text
    (generation prompt)

The system message is a stable prefix between summary updates, and per-turn material (the
retrieved chunks, the recalled passages) sits in the current user message, after the history,
so the session's KV cache can reuse everything before it.

Guarantees: len(ids) + max_new_tokens <= context_limit; the system prompt is first and whole;
turns are never split; the user's message is never cut (too long -> `InputError` with the
numbers). What does not fit is left out whole and reported: old turns, chunks, the tail of the
summary. Priority when room is short: system + user + reply reserve, then the summary, then
retrieved text, then history.

It must not call the model, touch the store, or decide when to summarise: summary.py does that,
from `ContextPlan.history_room`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .config import CPU_CONTEXT_CAP, Settings
from .errors import ConfigError, InputError
from .records import Chunk, Turn
from .summary import cap_text
from .tokens import ChatFormat

SUMMARY_HEADER = "Summary of the conversation so far:"
RECALL_HEADER = "Earlier in this conversation:"
SOURCES_HEADER = "Sources:"

OVER_BUDGET = "over the retrieved-text budget"
NO_ROOM = "no room left in the context"

PROTECTED_TURNS = 2  # the newest turns, kept verbatim before the summary and retrieved text get room
SECTIONS = ("system", "summary", "history", "recall", "retrieved", "user", "reserve")


@dataclass(frozen=True, slots=True)
class Budget:
    """Token limits for one prompt. `max_new_tokens` is both the generation cap and the reserve."""

    context_limit: int
    max_new_tokens: int
    summary_tokens: int
    retrieved_tokens: int
    user_tokens: int

    def __post_init__(self) -> None:
        if self.context_limit < 2:
            raise ConfigError(f"the context limit must be at least 2 tokens, not {self.context_limit}")
        if not 1 <= self.max_new_tokens < self.context_limit:
            raise ConfigError(f"max_new_tokens ({self.max_new_tokens}) must be at least 1 and below "
                              f"the context limit ({self.context_limit})")
        if self.summary_tokens < 0 or self.retrieved_tokens < 0 or self.user_tokens < 1:
            raise ConfigError("summary and retrieved-text budgets must be >= 0 and the user budget >= 1")

    @classmethod
    def from_settings(cls, settings: Settings, model_max: int, on_cpu: bool) -> "Budget":
        """Resolve the settings against the loaded model.

        context_limit 0 means the model's maximum, capped at CPU_CONTEXT_CAP on CPU; an explicit
        limit is kept as given, but never above the model's maximum. max_new_tokens is clamped to
        half the context, so at least half is left for the prompt.
        """
        if model_max < 2:
            raise ConfigError(f"the model reports a context length of {model_max} tokens, which is unusable")
        limit = settings.context_limit or model_max
        if not settings.context_limit and on_cpu:
            limit = min(limit, CPU_CONTEXT_CAP)
        limit = min(limit, model_max)
        return cls(
            context_limit=limit,
            max_new_tokens=min(settings.max_new_tokens, limit // 2),
            summary_tokens=settings.summary_tokens,
            retrieved_tokens=settings.retrieved_tokens,
            user_tokens=settings.user_tokens,
        )


@dataclass(frozen=True, slots=True)
class ContextPlan:
    """One turn's prompt, itemised. All counts are tokens measured by rendering with the format."""

    ids: tuple[int, ...]  # the whole prompt, generation prompt included
    messages: tuple[tuple[str, str], ...]  # (role, text), system first, the composed user message last
    sections: dict[str, int]  # keys: SECTIONS; all but "reserve" sum to len(ids)
    context_limit: int
    kept_turns: int  # how many of the newest turns are in
    dropped_turns: int  # oldest turns left out for lack of room (they should have been summarised)
    chunks: tuple[Chunk, ...]  # document chunks used, in prompt order: chunks[i] is tagged [i + 1]
    recall: tuple[Chunk, ...]  # earlier passages of this conversation used, in prompt order
    dropped_chunks: tuple[tuple[Chunk, str], ...]  # (chunk or recalled passage, reason), best score first
    summary: str  # the summary as placed in the prompt (maybe cut)
    summary_tokens: int  # tokens of that summary text (fmt.count)
    summary_cut: int  # tokens cut from the end of the given summary (0 = whole)
    history_room: int  # tokens history could use this turn (for summary.turns_to_fold)

    @property
    def max_new_tokens(self) -> int:
        return self.sections["reserve"]

    @property
    def free(self) -> int:
        """Tokens of the context neither in the prompt nor reserved for the reply."""
        return self.context_limit - len(self.ids) - self.max_new_tokens

    @property
    def left_out(self) -> str:
        """One line for the UI, e.g. "left out: 3 old turns (no room), 2 chunks (over the
        retrieved-text budget)"; "" when nothing was left out."""
        parts = []
        if self.dropped_turns:
            parts.append(f"{_n(self.dropped_turns, 'old turn')} (no room)")
        groups: dict[tuple[str, str], int] = {}
        for chunk, reason in self.dropped_chunks:
            noun = "earlier passage" if chunk.kind == "recall" else "chunk"
            groups[(noun, reason)] = groups.get((noun, reason), 0) + 1
        parts += [f"{_n(n, noun)} ({reason})" for (noun, reason), n in groups.items()]
        if self.summary_cut:
            parts.append(f"the last {_n(self.summary_cut, 'token')} of the summary")
        return "left out: " + ", ".join(parts) if parts else ""


def _n(n: int, noun: str) -> str:
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


def system_message(system: str, summary: str) -> str:
    """The system message: the system prompt, then the running summary in a fixed form."""
    if not summary:
        return system
    block = f"{SUMMARY_HEADER}\n{summary}"
    return f"{system}\n\n{block}" if system else block


def compose_user_message(user_message: str, chunks: Sequence[Chunk] = (), recall: Sequence[Chunk] = ()) -> str:
    """The current user message: the user's text as given, then earlier passages and numbered sources.

    The user's text comes first on purpose. History keeps only that text, so next turn the
    session's KV cache still matches up to its end, and only the reply after it is prefilled
    again; with the passages first, all of them would be prefilled again every turn.
    """
    parts = [user_message]
    if recall:
        parts.append(RECALL_HEADER + "\n" + "\n\n".join(f"({c.label()}) {c.text.strip()}" for c in recall))
    if chunks:
        parts.append(SOURCES_HEADER + "\n" + "\n\n".join(
            f"[{i}] {c.label()}:\n{c.text.strip()}" for i, c in enumerate(chunks, 1)))
    return "\n\n".join(parts)


def turn_tokens(fmt: ChatFormat, turn: Turn) -> int:
    """A turn's rendered size in history (what summary.turns_to_fold counts)."""
    return len(fmt.message_ids("user", turn.user)) + len(fmt.message_ids("assistant", turn.assistant))


def plan(system: str, summary: str, turns: Sequence[Turn], chunks: Sequence[Chunk], user_message: str,
         budget: Budget, fmt: ChatFormat, recall: Sequence[Chunk] = ()) -> ContextPlan:
    """Plan this turn's prompt within `budget`; see the module docstring for layout and guarantees.

    `turns` are the turns in the window, oldest first (those folded into `summary` are not
    passed). `chunks` are retrieved document chunks and `recall` earlier passages of this
    conversation; they share `retrieved_tokens` and are taken whole, best score first.
    Raises InputError when the user's message is over `user_tokens`, or when the system prompt,
    the message and the reply reserve alone do not fit in the context.
    """
    limit, reserve = budget.context_limit, budget.max_new_tokens

    # 1) the user's message and the system prompt: refused if too long, never cut
    n_user = fmt.count(user_message)
    if n_user > budget.user_tokens:
        raise InputError(f"Your message is {n_user:,} tokens; the limit is {budget.user_tokens:,}. "
                         "Shorten it or split it into parts.")
    n_system = len(fmt.system_ids(system))
    gen = fmt.generation_prompt_ids()
    bare_user = len(fmt.message_ids("user", user_message))
    fixed = n_system + bare_user + len(gen) + reserve
    if fixed > limit:
        raise InputError(f"Your message is {n_user:,} tokens; with the system prompt ({n_system:,}) and the "
                         f"room kept for the reply ({reserve:,}) this turn needs {fixed:,} tokens, but the "
                         f"context limit is {limit:,}. Shorten your message.")
    left = limit - fixed

    # the newest turns outrank the summary and retrieved text: keep room for them first
    protected = 0
    for turn in list(reversed(turns))[:PROTECTED_TURNS]:
        cost = turn_tokens(fmt, turn)
        if protected + cost > left:
            break
        protected += cost

    # 2) the running summary: ours, so it is cut (at a sentence end) rather than refused
    given = summary.strip()
    used_summary = cap_text(given, budget.summary_tokens, fmt.count) if given else ""
    n_summary = _summary_cost(fmt, system, used_summary, n_system)
    while used_summary and n_summary > left - protected:
        used_summary = cap_text(used_summary, fmt.count(used_summary) - (n_summary - (left - protected)), fmt.count)
        n_summary = _summary_cost(fmt, system, used_summary, n_system)
    left -= n_summary

    # 3) retrieved text: recalled passages and document chunks share one budget; whole, best first
    cap = min(budget.retrieved_tokens, left - protected)
    pool = sorted([(c, True) for c in recall] + [(c, False) for c in chunks], key=lambda p: -p[0].score)
    docs: list[Chunk] = []
    recs: list[Chunk] = []
    dropped: list[tuple[Chunk, str]] = []
    n_retrieved_all = 0
    for chunk, is_recall in pool:
        trial_docs = docs if is_recall else docs + [chunk]
        trial_recs = recs + [chunk] if is_recall else recs
        cost = len(fmt.message_ids("user", compose_user_message(user_message, trial_docs, trial_recs))) - bare_user
        if cost <= cap:
            docs, recs, n_retrieved_all = trial_docs, trial_recs, cost
        else:
            dropped.append((chunk, OVER_BUDGET if cost > budget.retrieved_tokens else NO_ROOM))
    left -= n_retrieved_all

    # 4) history: the newest whole turns that fit in what is left
    history_room = left
    kept: list[list[int]] = []  # per turn: its user + assistant ids, newest first
    n_history = 0
    for turn in reversed(turns):
        seg = list(fmt.message_ids("user", turn.user)) + list(fmt.message_ids("assistant", turn.assistant))
        if n_history + len(seg) > left:
            break
        kept.append(seg)
        n_history += len(seg)
    kept.reverse()
    kept_turns = turns[len(turns) - len(kept):] if kept else []

    # 5) assemble, and check the sums against the ids
    sys_text = system_message(system, used_summary)
    final_text = compose_user_message(user_message, docs, recs)
    messages = [("system", sys_text)]
    for turn in kept_turns:
        messages += [("user", turn.user), ("assistant", turn.assistant)]
    messages.append(("user", final_text))
    ids = list(fmt.system_ids(sys_text))
    for seg in kept:
        ids += seg
    final_ids = fmt.message_ids("user", final_text)
    ids += list(final_ids) + list(gen)

    n_docs_only = len(fmt.message_ids("user", compose_user_message(user_message, docs)))
    sections = {
        "system": n_system,
        "summary": n_summary,
        "history": n_history,
        "recall": len(final_ids) - n_docs_only,
        "retrieved": n_docs_only - bare_user,
        "user": bare_user + len(gen),
        "reserve": reserve,
    }
    assert sum(v for k, v in sections.items() if k != "reserve") == len(ids), "sections do not add up to the prompt"
    assert len(ids) + reserve <= limit, f"planned {len(ids)} + {reserve} tokens over the limit {limit}"
    n_used_summary = fmt.count(used_summary) if used_summary else 0
    return ContextPlan(
        ids=tuple(ids),
        messages=tuple(messages),
        sections=sections,
        context_limit=limit,
        kept_turns=len(kept),
        dropped_turns=len(turns) - len(kept),
        chunks=tuple(docs),
        recall=tuple(recs),
        dropped_chunks=tuple(dropped),
        summary=used_summary,
        summary_tokens=n_used_summary,
        summary_cut=(fmt.count(given) - n_used_summary) if given else 0,
        history_room=history_room,
    )


def _summary_cost(fmt: ChatFormat, system: str, summary: str, n_system: int) -> int:
    return len(fmt.system_ids(system_message(system, summary))) - n_system if summary else 0
