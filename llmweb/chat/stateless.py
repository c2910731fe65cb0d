"""Stateless chat: answer a client's whole message list inside the token budget, never failing for length.

An OpenAI client sends the whole conversation every call. llmweb plans it like one of its own
chats (context.plan): the client's system message is kept whole, its earlier messages become
turns, the newest turns go in verbatim, and when they do not fit, the oldest are folded into a
summary (with the user's fact sentences kept word for word next to it), through the chat's
own summariser (`Chat.write_summary`: engine jobs at background priority). Nothing is cut
silently: what was summarised and what was left out is reported.

A growing chat is not summarised from scratch each call: `SummaryCache` keeps the memory
(summary + facts) of a summarised message prefix under the hash of that prefix, and the next
call starts from the longest prefix it has. Folds follow the chat's hysteresis
(summary.turns_to_fold: history down to the low-water mark), so a fold is rare and the prompt's
prefix (system, summary, kept turns) stays the same between folds, which the session KV cache
(keyed by the chat's first message) reuses.

Pure parts: `dialogue` (messages -> turns), `prefix_keys`, `SummaryCache`, `fit` (given a fold
function). `StatelessChat.send` wires them to retrieval and the engine, and yields the chat
path's events (chat/session.py: Started, Queued, Delta, Finished), preceded by `Fitted`. It stores
nothing: the client holds the history.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from llmweb.chat import context, facts, summary
from llmweb.chat.session import Delta, Finished, Queued, Started, plan_sources, reduced_budget
from llmweb.chat.tokens import ChatFormat, render_prompt
from llmweb.config import Settings
from llmweb.engine.request import GenerationRequest, Tokens, Waiting
from llmweb.errors import ConfigError, InputError, LlmwebError
from llmweb.records import Chunk, GenerationStats, Turn, TurnStats

CACHE_ENTRIES = 256  # summarised prefixes kept (a few KB each)
MAX_FOLDS = 8  # folds in one call, at most (each one engine job; the loop ends far sooner in practice)


@dataclass(frozen=True, slots=True)
class Dialogue:
    """A client's message list as the planner sees it."""

    system: str  # the client's system messages, joined ("" = none given)
    turns: tuple[Turn, ...]  # earlier exchanges, oldest first
    user: str  # the message to answer (the last user messages, joined)
    sizes: tuple[int, ...]  # client messages in each turn (to report messages, not turns)


def dialogue(messages: Sequence[tuple[str, str]]) -> Dialogue:
    """(role, text) pairs -> system, turns, the message to answer. Consecutive messages of one role
    are joined; a conversation that starts with the assistant gets an empty user side."""
    system = "\n\n".join(text for role, text in messages if role == "system")
    runs: list[tuple[str, list[str]]] = []
    for role, text in messages:
        if role == "system":
            continue
        if runs and runs[-1][0] == role:
            runs[-1][1].append(text)
        else:
            runs.append((role, [text]))
    if not runs or runs[-1][0] != "user":
        raise InputError("The last message must be the user's.")
    *earlier, (_, last) = runs
    turns: list[Turn] = []
    sizes: list[int] = []
    pending: list[str] | None = None
    for role, texts in earlier:
        if role == "user":
            pending = texts
        else:
            turns.append(Turn("\n\n".join(pending or []), "\n\n".join(texts)))
            sizes.append(len(pending or []) + len(texts))
            pending = None
    if pending is not None:  # cannot happen: runs alternate and the last one is the user's
        raise AssertionError("two user runs in a row")
    return Dialogue(system, tuple(turns), "\n\n".join(last), tuple(sizes))


def prefix_keys(scope: str, turns: Sequence[Turn]) -> list[str]:
    """keys[i]: the hash of `scope` and the first i turns (keys[0]: of none). A rolling SHA-256, so
    all of them cost one pass over the messages."""
    h = hashlib.sha256(scope.encode("utf-8", "replace"))
    keys = [h.hexdigest()]
    for t in turns:
        for part in (t.user, t.assistant):
            data = part.encode("utf-8", "replace")
            h.update(len(data).to_bytes(8, "big") + data)
        keys.append(h.hexdigest())
    return keys


@dataclass(frozen=True, slots=True)
class Memory:
    """What stands for a summarised prefix: the summary and the user's facts from it (oldest first)."""

    summary: str = ""
    facts: tuple[facts.FactLike, ...] = ()


class SummaryCache:
    """Memories of summarised prefixes by prefix key, least recently used dropped first. Thread-safe."""

    def __init__(self, entries: int = CACHE_ENTRIES):
        self.entries = entries
        self._items: OrderedDict[str, Memory] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key: str) -> Memory | None:
        with self._lock:
            memory = self._items.get(key)
            if memory is not None:
                self._items.move_to_end(key)
            return memory

    def put(self, key: str, memory: Memory) -> None:
        with self._lock:
            self._items[key] = memory
            self._items.move_to_end(key)
            while len(self._items) > self.entries:
                self._items.popitem(last=False)


@dataclass(frozen=True, slots=True)
class Fit:
    """How a client's messages were fitted: the plan, and how many turns stand behind the summary."""

    plan: context.ContextPlan
    memory: Memory
    summarized_turns: int  # the oldest turns replaced by the summary
    summarized_messages: int  # the same, in client messages
    dropped_messages: int  # client messages neither summarised nor in the prompt (plan.dropped_turns)
    from_cache: bool  # the summary of a prefix came from the cache (no fold needed for it)
    folds: int  # folds run for this call
    fold_error: str = ""  # why summarising stopped early (the rest is left out, and reported)

    def report(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "summarized_messages": self.summarized_messages,
            "left_out_messages": self.dropped_messages,
            "summary_cached": self.from_cache,
            "summary_folds": self.folds,
            "summary_tokens": self.plan.summary_tokens,
            "facts": len(self.plan.facts),
        }
        if self.fold_error:
            d["summary_error"] = self.fold_error
        return d


Fold = Callable[[Memory, Sequence[Turn]], Memory]


def fit(
    d: Dialogue,
    system: str,
    budget: context.Budget,
    fmt: ChatFormat,
    cache: SummaryCache,
    scope: str,
    fold: Fold | None,
    *,
    high: float,
    low: float,
    chunks: Sequence[Chunk] = (),
) -> Fit:
    """Plan `d` within `budget`: start from the longest summarised prefix in `cache`, then fold the
    oldest turns (`fold`: the previous memory and the turns -> the new memory) until the rest fits,
    caching each new memory under its prefix key. `fold=None`: never summarise (old turns are left
    out and reported); a fold that fails (a domain error: the engine busy, ...) stops the folding,
    and what it would have summarised is left out and reported. Raises InputError when the system
    message, the user's message and the reply alone do not fit."""
    turns = list(d.turns)
    keys = prefix_keys(scope, turns)

    # 1) the longest prefix already summarised
    j, memory = 0, Memory()
    for i in range(len(turns), 0, -1):
        hit = cache.get(keys[i])
        if hit is not None:
            j, memory = i, hit
            break
    from_cache, folds, error = j > 0, 0, ""

    # 2) plan; while turns are left out, fold the oldest into the summary (hysteresis: down to `low`)
    while True:
        plan = context.plan(system, memory.summary, turns[j:], chunks, d.user, budget, fmt, facts=memory.facts)
        if not plan.dropped_turns or fold is None or folds >= MAX_FOLDS:
            break
        counts = [context.turn_tokens(fmt, t) for t in turns[j:]]
        n = summary.turns_to_fold(counts, plan.history_room, high, low)
        if n <= 0:
            break  # only the newest turns are left, and they alone are too big: left out, reported
        try:
            memory = fold(memory, turns[j : j + n])
        except LlmwebError as e:
            error = str(e)
            break
        j, folds = j + n, folds + 1
        cache.put(keys[j], memory)

    dropped = sum(d.sizes[j : j + plan.dropped_turns])
    return Fit(plan, memory, j, sum(d.sizes[:j]), dropped, from_cache, folds, error)


def system_fits(system: str, budget: context.Budget, fmt: ChatFormat) -> None:
    """Refuse, with the numbers, a client system message that leaves no room for anything else."""
    n = len(fmt.system_ids(system))
    room = budget.context_limit - budget.max_new_tokens
    if n >= room:
        raise InputError(
            f"The system message is {n:,} tokens; with the room kept for the reply ({budget.max_new_tokens:,}) "
            f"the context ({budget.context_limit:,} tokens) has no room left for the conversation. Shorten it."
        )


@dataclass(frozen=True)
class Fitted:
    """The first event of a stateless turn: how the messages were fitted (before generation)."""

    fit: Fit
    sources: list = field(default_factory=list)


class StatelessChat:
    """Runs stateless turns: one per call, nothing stored. `write_summary(previous, turns) -> str` is
    the chat's summariser (Chat.write_summary) and `summary_cap` its cap (Chat.summary_cap())."""

    def __init__(
        self,
        settings: Settings,
        fmt: ChatFormat,
        budget: context.Budget,
        write_summary: Callable[[str, list[Turn]], str],
        summary_cap: int,
        library=None,
        cache: SummaryCache | None = None,
    ):
        self.settings = settings
        self.fmt = fmt
        self.budget = budget
        self.write_summary = write_summary
        self.summary_cap = summary_cap
        self.library = library
        self.cache = cache if cache is not None else SummaryCache()

    def fold(self, memory: Memory, turns: Sequence[Turn]) -> Memory:
        """The memory after folding `turns`: the summary grounded in them (as the chat does), and
        their fact sentences added to the facts.

        The turns go to the summariser in batches whose summary prompt, with the summary as it is
        by then, fits the context with room for the cap: one engine job each, and never a prompt
        measured against an older, shorter summary."""
        text, rest = memory.summary, list(turns)
        while rest:
            n = self._fitting(text, rest)
            text = self.write_summary(text, rest[:n])
            rest = rest[n:]
        source = memory.summary + "\n" + "\n".join(f"{t.user}\n{t.assistant}" for t in turns)
        grounded = facts.ground(text, source).text
        known = {" ".join(f.text.lower().split()) for f in memory.facts}
        new = [f for f in facts.extract_facts(t.user for t in turns) if " ".join(f.lower().split()) not in known]
        return Memory(grounded, memory.facts + tuple(facts.FactLike(f, False) for f in new))

    def _fitting(self, previous: str, turns: Sequence[Turn]) -> int:
        """The most turns (at least one) whose summary prompt fits in the context less the cap."""
        limit = self.budget.context_limit - self.summary_cap

        def fits(n: int) -> bool:
            system, user = summary.segment_request_messages(previous, turns[:n], self.summary_cap)
            return len(render_prompt(self.fmt, system, [("user", user)])) <= limit

        lo, hi = 1, len(turns)  # binary search: fits(n) only gets false as n grows
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if fits(mid):
                lo = mid
            else:
                hi = mid - 1
        return lo

    def send(
        self,
        owner: str,
        messages: Sequence[tuple[str, str]],
        engine,
        *,
        max_tokens: int | None = None,
        use_docs: bool = False,
        seed: int | None = None,
    ) -> Iterator[Fitted | Started | Queued | Delta | Finished]:
        """One stateless turn for `owner` over `engine` (the engine, or web/api.py's view of it with the
        request's sampling). Yields Fitted, Started(""), Queued / Delta, Finished."""
        s = self.settings
        d = dialogue(messages)
        system = d.system or s.system_prompt
        budget = self.budget
        if max_tokens is not None and max_tokens < budget.max_new_tokens:  # a smaller reserve: more history
            budget = replace(budget, max_new_tokens=max_tokens)
        system_fits(system, budget, self.fmt)

        # 1) retrieve, 2) fit (summarising what does not fit), 3) generate
        chunks: list[Chunk] = []
        if use_docs and self.library is not None and not self.library.is_empty(owner):
            chunks = self.library.search(owner, d.user, k=s.top_k, min_score=s.min_score)
        scope = f"{owner}\n{system}"
        fold = self.fold if s.summaries else None
        high, low = s.history_high, s.history_low
        f = fit(d, system, budget, self.fmt, self.cache, scope, fold, high=high, low=low, chunks=chunks)
        plan = f.plan
        sources = plan_sources(plan)
        yield Fitted(f, sources)

        def smaller() -> GenerationRequest | None:
            reduced = reduced_budget(budget)
            try:
                p = context.plan(
                    system,
                    f.memory.summary,
                    d.turns[f.summarized_turns :],
                    chunks[: len(chunks) // 2],
                    d.user,
                    reduced,
                    self.fmt,
                    facts=f.memory.facts,
                )
            except (InputError, ConfigError):
                return None
            return replace(request, prompt_ids=p.ids, max_new_tokens=reduced.max_new_tokens, fallback=None)

        first = d.turns[0].user if d.turns else d.user
        session = "api:" + hashlib.sha256(f"{scope}\n{first}".encode("utf-8", "replace")).hexdigest()[:32]
        request = GenerationRequest(
            prompt_ids=plan.ids,
            max_new_tokens=budget.max_new_tokens,
            temperature=s.temperature,
            top_p=s.top_p,
            repetition_penalty=s.repetition_penalty,
            seed=seed,
            stop_ids=self.fmt.stop_ids,
            session_id=session,  # the prompt's prefix is the same call after call: reuse its KV cache
            timeout_s=s.request_timeout_s,
            fallback=smaller,
            owner=owner,
        )
        handle = engine.submit(request)
        yield Started("")
        finished = False
        try:
            for event in handle.events():
                if isinstance(event, Waiting):
                    yield Queued(event.position)
                elif isinstance(event, Tokens):
                    yield Delta(self.fmt.decode(handle.generated))
            finished = True
        finally:
            if not finished:  # closed early (client gone) or failed: stop the worker within a token
                handle.cancel()
        gen = handle.stats
        if gen is None:  # the engine reports stats for every request it ran; this one never ran
            gen = GenerationStats(prompt_tokens=len(plan.ids), finish_reason="cancelled")
        stats = TurnStats(
            turn=len(d.turns) + 1,
            gen=gen,
            sections=dict(plan.sections),
            context_limit=plan.context_limit,
            dropped_turns=plan.dropped_turns,
            summarized_turns=f.summarized_turns,
            summary_tokens=plan.summary_tokens,
            dropped_chunks=len(plan.dropped_chunks),
            dropped_facts=len(plan.dropped_facts),
        )
        notes = ["Stopped."] if gen.finish_reason == "cancelled" else []
        if plan.left_out:
            notes.append(plan.left_out.capitalize() + ".")
        if f.summarized_messages:
            notes.append(f"The oldest {f.summarized_messages} messages are summarised.")
        if f.fold_error:
            notes.append(f"Summarising stopped: {f.fold_error}")
        reply = self.fmt.decode(handle.generated).strip()
        yield Finished(reply, stats, sources, notes, plan.messages, "")
