"""The context planner: what goes into this turn's prompt, and what is left out and why.

`plan(...)` is a pure function of the conversation and a `Budget`: no torch, no I/O, no model.
It measures every section by rendering it with the `ChatFormat` (never by estimating) and
returns a `ContextPlan` whose `ids` are exactly the prompt the engine will run.

Prompt layout (one chat message per line):

    system     system prompt + "\\n\\n" + what the owner asked all their chats to remember
               + "\\n\\nSummary of the conversation so far:\\n" + summary
               + "\\n\\nFacts the user stated (verbatim):\\n- ..." (the user's facts)
    user       oldest kept turn            } history: whole turns, the newest ones,
    assistant  ...                         } contiguous up to the last turn
    user       [earlier passages] + [numbered sources] + the user's text
    (generation prompt)

The system message is a stable prefix between summary updates, and per-turn material (the
retrieved chunks, the recalled passages) sits in the current user message, after the history,
so the session's KV cache can reuse everything before it.

Guarantees: len(ids) + max_new_tokens <= context_limit; the system prompt is first and whole;
turns are never split; the user's message is never cut (too long -> `InputError` with the
numbers). Pinned facts are never left out (with the system prompt, the message and the reply
reserve they are the fixed part; chat/session.py keeps them under their cap when they are pinned). What
does not fit is left out whole and reported: old turns, chunks, unpinned facts (oldest first),
the tail of the summary. Priority when room is short: system + pinned facts + user + reply
reserve, then the newest two turns, then unpinned facts, then the summary, then retrieved text,
then history.

It must not call the model, touch the store, or decide when to summarise: chat/summary.py does that,
from `ContextPlan.history_room`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from llmweb.chat.facts import facts_block
from llmweb.chat.summary import cap_text
from llmweb.chat.tokens import ChatFormat
from llmweb.config import CPU_CONTEXT_CAP, Settings
from llmweb.errors import ConfigError, InputError
from llmweb.records import OUT, PIN, Chunk, Turn

SUMMARY_HEADER = "Summary of the conversation so far:"
MEMORY_HEADER = "What the user asked you to remember in all their chats:"
RECALL_HEADER = "Earlier in this conversation:"
SOURCES_HEADER = "Sources:"

OVER_BUDGET = "over the retrieved-text budget"
NO_ROOM = "no room left in the context"

PROTECTED_TURNS = 2  # the newest turns, kept verbatim before the summary and retrieved text get room
SECTIONS = ("system", "memory", "summary", "facts", "history", "recall", "retrieved", "user", "reserve")


@dataclass(frozen=True, slots=True)
class Budget:
    """Token limits for one prompt. `max_new_tokens` is both the generation cap and the reserve."""

    context_limit: int
    max_new_tokens: int
    summary_tokens: int
    retrieved_tokens: int
    user_tokens: int
    facts_tokens: int = 0  # the user's facts; pinned ones are kept even past it (chat/session.py caps pinning)
    memory_tokens: int = 0  # what the owner asked all their chats to remember (store/memories.py)

    def __post_init__(self) -> None:
        if self.context_limit < 2:
            raise ConfigError(f"the context limit must be at least 2 tokens, not {self.context_limit}")
        if not 1 <= self.max_new_tokens < self.context_limit:
            raise ConfigError(
                f"max_new_tokens ({self.max_new_tokens}) must be at least 1 and below "
                f"the context limit ({self.context_limit})"
            )
        if (
            min(self.summary_tokens, self.retrieved_tokens, self.facts_tokens, self.memory_tokens) < 0
            or self.user_tokens < 1
        ):
            raise ConfigError("summary, facts and retrieved-text budgets must be >= 0 and the user budget >= 1")

    @classmethod
    def from_settings(cls, settings: Settings, model_max: int, on_cpu: bool) -> Budget:
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
            facts_tokens=settings.facts_tokens,
            memory_tokens=settings.memory_tokens,
        )

    # Every other change to a budget is one of these: "where is the budget decided" is this class.
    def capped(self, max_new_tokens: int | None) -> Budget:
        """A smaller reply cap (a chat's own, an API request's max_tokens), which is a smaller
        reserve and so more room for history; never above this budget's cap. None: unchanged."""
        return replace(self, max_new_tokens=min(max_new_tokens or self.max_new_tokens, self.max_new_tokens))

    def continuing(self, partial: int) -> Budget:
        """Continue: room for the reply so far (`partial` tokens, at the prompt's end) and its rest."""
        reserve = min(self.max_new_tokens + partial, self.context_limit - 1)
        if reserve - partial < 1:
            raise InputError("The last reply already fills this chat's context: it cannot go on.")
        return replace(self, max_new_tokens=reserve)

    def reduced(self) -> Budget:
        """The budget for the one retry after an OOM: two thirds of the context, half the reply and documents."""
        limit = max(self.context_limit * 2 // 3, 2)
        return replace(
            self,
            context_limit=limit,
            max_new_tokens=max(min(self.max_new_tokens // 2, limit // 2), 1),
            retrieved_tokens=self.retrieved_tokens // 2,
        )

    @property
    def summary_cap(self) -> int:
        """The rolling summary's size: its budget, at most a quarter of the context (room for turns in small ones)."""
        return min(self.summary_tokens, self.context_limit // 4)

    @property
    def prompt_room(self) -> int:
        """Tokens the prompt may take: the context less the reply's reserve."""
        return self.context_limit - self.max_new_tokens

    def piece_room(self, overhead: int, reply: int) -> int:
        """Tokens of document text one step of a whole-document task may read: the context less
        the step's prompt without the text (`overhead`) and its reply cap. InputError when the
        instruction and the reply alone leave no room (chat/document_plan.py)."""
        room = self.context_limit - overhead - reply
        if room < 16:
            raise InputError(
                f"This request is too long to read a document with: its instruction takes {overhead:,} "
                f"tokens of the {self.context_limit:,}-token context. Shorten it."
            )
        return room

    @property
    def system_prompt_room(self) -> int:
        """The most tokens a chat's own system prompt may take: a quarter of the context."""
        return self.context_limit // 4


@dataclass(frozen=True, slots=True)
class ContextPlan:
    """One turn's prompt, itemised. All counts are tokens measured by rendering with the format."""

    ids: tuple[int, ...]  # the whole prompt, generation prompt included
    messages: tuple[tuple[str, str], ...]  # (role, text), system first, the composed user message last
    sections: dict[str, int]  # keys: SECTIONS; all but "reserve" sum to len(ids)
    context_limit: int
    kept_turns: int  # how many turns are in: the newest ones, and those pinned
    dropped_turns: int  # oldest turns left out for lack of room (they should have been summarised)
    chunks: tuple[Chunk, ...]  # document chunks used, in prompt order: chunks[i] is tagged [i + 1]
    recall: tuple[Chunk, ...]  # earlier passages of this conversation used, in prompt order
    dropped_chunks: tuple[tuple[Chunk, str], ...]  # (chunk or recalled passage, reason), best score first
    summary: str  # the summary as placed in the prompt (maybe cut)
    summary_tokens: int  # tokens of that summary text (fmt.count)
    summary_cut: int  # tokens cut from the end of the given summary (0 = whole)
    history_room: int  # tokens history could use this turn (for summary.turns_to_fold)
    facts: tuple = ()  # the facts placed, oldest first (every pinned one)
    dropped_facts: tuple = ()  # unpinned facts left out for lack of room, oldest first
    pinned_turns: int = 0  # turns kept in context by their owner (Turn.view PIN) that are in the prompt
    dropped_pins: int = 0  # pinned turns that did not fit even so (oldest first)
    excluded_turns: int = 0  # turns of the window their owner left out (Turn.view OUT)
    window_start: int = 0  # where the newest turns start among `turns` (the pinned ones before it come first)
    memory: tuple[str, ...] = ()  # what the owner asked all their chats to remember, as placed (oldest first)
    dropped_memory: int = 0  # of those, the oldest left out (over their budget, or no room)

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
        if self.dropped_facts:
            parts.append(f"{_n(len(self.dropped_facts), 'older unpinned fact')} (over the facts budget)")
        if self.summary_cut:
            parts.append(f"the last {_n(self.summary_cut, 'token')} of the summary")
        if self.dropped_memory:
            parts.append(f"{_n(self.dropped_memory, 'older memory')} of all your chats (over its budget)")
        if self.dropped_pins:
            parts.append(f"{_n(self.dropped_pins, 'older pinned turn')} (no room even for them)")
        return "left out: " + ", ".join(parts) if parts else ""

    @property
    def contents(self) -> str:
        """What is in this prompt and why, one line for the prompt view."""
        s = self.sections
        parts = [f"system prompt ({s['system']:,} tokens)"]
        if self.memory:
            parts.append(f"{_n(len(self.memory), 'thing')} you asked all your chats to remember ({s['memory']:,})")
        if s["summary"]:
            parts.append(f"summary of earlier turns ({s['summary']:,})")
        if self.facts:
            parts.append(f"{_n(len(self.facts), 'fact')} you stated ({s['facts']:,})")
        if self.pinned_turns:
            parts.append(f"{_n(self.pinned_turns, 'turn')} you keep in context")
        recent = self.kept_turns - self.pinned_turns
        if recent:
            parts.append(f"the {_n(recent, 'newest other turn')} that fit")
        if self.recall:
            parts.append(f"{_n(len(self.recall), 'earlier passage')} recalled for this message")
        if self.chunks:
            parts.append(f"{_n(len(self.chunks), 'document chunk')} retrieved for it")
        line = "In this prompt: " + ", ".join(parts) + ", your message."
        if self.excluded_turns:
            line += f" Not in it: {_n(self.excluded_turns, 'turn')} you left out."
        return line


def _n(n: int, noun: str) -> str:
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


def system_message(system: str, summary: str, facts: Sequence = ()) -> str:
    """The system message: the system prompt, the running summary, then the user's facts."""
    blocks = [system, f"{SUMMARY_HEADER}\n{summary}" if summary else "", facts_block(facts)]
    return "\n\n".join(b for b in blocks if b)


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
        parts.append(
            SOURCES_HEADER
            + "\n"
            + "\n\n".join(f"[{i}] {c.label()}:\n{c.text.strip()}" for i, c in enumerate(chunks, 1))
        )
    return "\n\n".join(parts)


def turn_tokens(fmt: ChatFormat, turn: Turn) -> int:
    """A turn's rendered size in history (what summary.turns_to_fold counts)."""
    return len(fmt.message_ids("user", turn.user)) + len(fmt.message_ids("assistant", turn.assistant))


# stepwise: six numbered steps over one running `left`, each reading the last; splitting them would thread it through
def plan(
    system: str,
    summary: str,
    turns: Sequence[Turn],
    chunks: Sequence[Chunk],
    user_message: str,
    budget: Budget,
    fmt: ChatFormat,
    recall: Sequence[Chunk] = (),
    facts: Sequence = (),
    hold: int = 0,
    low: float = 1.0,
    folded_pins: Sequence[Turn] = (),
    memory: Sequence[str] = (),
) -> ContextPlan:
    """Plan this turn's prompt within `budget`; see the module docstring for layout and guarantees.

    `turns` are the turns in the window, oldest first (those folded into `summary` are not
    passed). `chunks` are retrieved document chunks and `recall` earlier passages of this
    conversation; they share `retrieved_tokens` and are taken whole, best score first. `facts`
    (objects with `.text` and `.pinned`, oldest first) are the user's facts: all pinned ones, then
    the newest unpinned ones within `facts_tokens`.

    When not every turn fits, history starts at turn `hold` (the start of the caller's last prompt:
    chat/session.py) while the turns from there fit; past that, it is cut down to the newest turns
    within `low` of its room (at least the newest PROTECTED_TURNS that fit). So the window's start
    moves in steps, not a turn at a time, and the prompts between two steps share their prefix (the
    KV cache reuses it). `low` 1.0 (the default): only what does not fit is left out.

    Turns their owner keeps in context (`Turn.view` PIN: those of `turns`, and `folded_pins`, the ones
    already folded out of the window) have room of their own after the newest two turns: the ones
    outside the newest turns that fit come right after the system message, oldest first; when even
    they do not fit, the oldest are left out (reported). Turns left out by their owner (OUT) are in
    no prompt and cost nothing; they keep their place in `turns` (and in `hold`).
    `memory` (what the owner asked all their chats to remember, oldest first) follows the system
    prompt: the newest whole items within `memory_tokens`, fewer when the fixed part does not fit.
    Raises InputError when the user's message is over `user_tokens`, or when the system prompt,
    the pinned facts, the message and the reply reserve alone do not fit in the context.
    """
    limit, reserve = budget.context_limit, budget.max_new_tokens

    # 1) the user's message and the system prompt: refused if too long, never cut
    n_user = fmt.count(user_message)
    if n_user > budget.user_tokens:
        raise InputError(
            f"Your message is {n_user:,} tokens; the limit is {budget.user_tokens:,}. "
            "Shorten it or split it into parts."
        )
    n_bare = len(fmt.system_ids(system))
    pinned = [f for f in facts if f.pinned]
    gen = fmt.generation_prompt_ids()
    bare_user = len(fmt.message_ids("user", user_message))
    used_memory: list[str] = []
    prompt, cost = system, 0
    for item in reversed(memory):  # a first cut by each item's own size (one render per item below)
        cost += fmt.count(item) + 2
        if cost > budget.memory_tokens:
            break
        used_memory.insert(0, item)
    while True:  # what all the owner's chats remember: the newest within its budget, that leave room
        system = "\n\n".join([prompt, memory_block(used_memory)]) if used_memory else prompt
        n_system = len(fmt.system_ids(system))
        n_pinned = _facts_cost(fmt, system, pinned, n_system)
        fixed = n_system + n_pinned + bare_user + len(gen) + reserve
        if not used_memory or (n_system - n_bare <= budget.memory_tokens and fixed <= limit):
            break
        used_memory.pop(0)
    if fixed > limit:
        pins = f", your pinned facts ({n_pinned:,})" if n_pinned else ""
        raise InputError(
            f"Your message is {n_user:,} tokens; with the system prompt ({n_system:,}){pins} and "
            f"the room kept for the reply ({reserve:,}) this turn needs {fixed:,} tokens, but the "
            f"context limit is {limit:,}. Shorten your message."
        )
    left = limit - fixed

    # the newest turns outrank the summary and retrieved text: keep room for them first (a pinned
    # turn has room of its own, one left out needs none)
    protected = 0
    for turn in [t for t in reversed(turns) if not t.view][:PROTECTED_TURNS]:
        cost = turn_tokens(fmt, turn)
        if protected + cost > left:
            break
        protected += cost

    # 2a) the turns their owner keeps in context: whole, the oldest left out when even they do not fit
    before = list(folded_pins)  # pinned turns placed before the newest turns, oldest first
    win_pins = [i for i, t in enumerate(turns) if t.view == PIN]
    n_pins = sum(turn_tokens(fmt, t) for t in before) + sum(turn_tokens(fmt, turns[i]) for i in win_pins)
    dropped_pins = 0
    while n_pins > left - protected:
        n_pins -= turn_tokens(fmt, before.pop(0) if before else turns[win_pins.pop(0)])
        dropped_pins += 1
    left -= n_pins

    # 2) the user's facts: the newest unpinned ones that fit next to the pinned ones (whole facts)
    kept_facts = set(map(id, pinned))
    n_facts = n_pinned
    room = min(budget.facts_tokens, n_pinned + left - protected)
    for fact in reversed([f for f in facts if not f.pinned]):
        trial = [f for f in facts if id(f) in kept_facts or f is fact]
        cost = _facts_cost(fmt, system, trial, n_system)
        if cost <= room:
            kept_facts.add(id(fact))
            n_facts = cost
    used_facts = [f for f in facts if id(f) in kept_facts]
    dropped_facts = tuple(f for f in facts if id(f) not in kept_facts)
    left -= n_facts - n_pinned

    # 3) the running summary: ours, so it is cut (at a sentence end) rather than refused
    given = summary.strip()
    used_summary = cap_text(given, budget.summary_tokens, fmt.count) if given else ""
    n_summary = _summary_cost(fmt, system, used_summary, used_facts, n_system + n_facts)
    while used_summary and n_summary > left - protected:
        used_summary = cap_text(used_summary, fmt.count(used_summary) - (n_summary - (left - protected)), fmt.count)
        n_summary = _summary_cost(fmt, system, used_summary, used_facts, n_system + n_facts)
    left -= n_summary

    # 4) retrieved text: recalled passages and document chunks share one budget; whole, best first
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

    # 5) history: the newest whole turns that fit in what is left; when some do not, from `hold`
    #    while the rest fits, else the newest within `low` of the room (see the docstring). A
    #    pinned turn's room is already taken (2a); one left out takes none and shows nothing.
    history_room = left
    pin_idx = set(win_pins)
    kept: list[tuple[list[int], int]] = []  # per turn, newest first: its user + assistant ids, its cost here
    n_history = 0
    for i in reversed(range(len(turns))):
        seg = [] if turns[i].view == OUT else _turn_ids(fmt, turns[i])
        cost = 0 if i in pin_idx else len(seg)
        if n_history + cost > left:
            break
        kept.append((seg, cost))
        n_history += cost
    if len(kept) < len(turns):
        start = len(turns) - len(kept)
        if start <= hold <= len(turns) - min(len(kept), PROTECTED_TURNS):  # else a step: to `low`
            n_history -= sum(cost for _, cost in kept[len(turns) - hold :])
            del kept[len(turns) - hold :]
        else:
            while len(kept) > PROTECTED_TURNS and n_history > low * left:
                n_history -= kept.pop()[1]
    kept.reverse()
    start = len(turns) - len(kept)
    before += [turns[i] for i in win_pins if i < start]
    shown = list(before) + [t for t in turns[start:] if t.view != OUT]

    # 6) assemble, and check the sums against the ids
    sys_text = system_message(system, used_summary, used_facts)
    final_text = compose_user_message(user_message, docs, recs)
    messages = [("system", sys_text)]
    for turn in shown:
        messages += [("user", turn.user), ("assistant", turn.assistant)]
    messages.append(("user", final_text))
    ids = list(fmt.system_ids(sys_text))
    for turn in before:
        ids += _turn_ids(fmt, turn)
    for seg, _ in kept:
        ids += seg
    final_ids = fmt.message_ids("user", final_text)
    ids += list(final_ids) + list(gen)

    n_docs_only = len(fmt.message_ids("user", compose_user_message(user_message, docs)))
    sections = {
        "system": n_bare,
        "memory": n_system - n_bare,
        "summary": n_summary,
        "facts": n_facts,
        "history": n_history + n_pins,
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
        kept_turns=len(shown),
        dropped_turns=sum(1 for i, t in enumerate(turns[:start]) if t.view != OUT and i not in pin_idx),
        chunks=tuple(docs),
        recall=tuple(recs),
        dropped_chunks=tuple(dropped),
        summary=used_summary,
        summary_tokens=n_used_summary,
        summary_cut=(fmt.count(given) - n_used_summary) if given else 0,
        history_room=history_room,
        facts=tuple(used_facts),
        dropped_facts=dropped_facts,
        pinned_turns=len(folded_pins) - min(dropped_pins, len(folded_pins)) + len(win_pins),
        dropped_pins=dropped_pins,
        excluded_turns=sum(1 for t in turns if t.view == OUT),
        window_start=start,
        memory=tuple(used_memory),
        dropped_memory=len(memory) - len(used_memory),
    )


def memory_block(memory: Sequence[str]) -> str:
    """The memory of all the owner's chats, as the system message holds it after the system prompt."""
    return MEMORY_HEADER + "".join(f"\n- {m}" for m in memory) if memory else ""


def _turn_ids(fmt: ChatFormat, turn: Turn) -> list[int]:
    return list(fmt.message_ids("user", turn.user)) + list(fmt.message_ids("assistant", turn.assistant))


def _facts_cost(fmt: ChatFormat, system: str, facts: Sequence, n_system: int) -> int:
    return len(fmt.system_ids(system_message(system, "", facts))) - n_system if facts else 0


def _summary_cost(fmt: ChatFormat, system: str, summary: str, facts: Sequence, n_without: int) -> int:
    """What the summary adds to the system message that already holds the system prompt and facts."""
    return len(fmt.system_ids(system_message(system, summary, facts))) - n_without if summary else 0
