"""Stateless chat: answer a client's whole message list inside the token budget, never failing for length.

An OpenAI client sends the whole conversation every call. llmweb plans it like one of its own
chats (context.plan): the client's system message is kept whole, its earlier messages become
turns, the newest turns go in verbatim, and when they do not fit, the oldest are folded into a
summary (with the user's fact sentences kept word for word next to it), through the chat's
own summariser (chat/memory.py's `Summariser.write`: engine jobs at background priority).
Nothing is cut silently: what was summarised and what was left out is reported.

A growing chat is not summarised from scratch each call: `SummaryCache` keeps the memory
(summary + facts) of a summarised message prefix under the hash of that prefix, and the next
call starts from the longest prefix it has. Folds follow the chat's hysteresis
(summary.turns_to_fold: history down to the low-water mark), so a fold is rare and the prompt's
prefix (system, summary, kept turns) stays the same between folds, which the session KV cache
(keyed by the chat's first message) reuses.

Pure parts: `dialogue` (messages -> turns), `prefix_keys`, `SummaryCache`, `fit` (given a fold
function). `StatelessChat.send` wires them to retrieval and to the turn pipeline every chat path
shares (chat/turn.py: the request, its OOM retry, streaming, cancel, stats and notes), and yields
its events (Started, Queued, Delta, Finished), preceded by `Fitted`; a fold is chat/fold.py's, as
the stateful chat's is. It stores nothing: the client holds the history, and must not.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from llmweb.chat import context, summary
from llmweb.chat.fold import Memory, Write, turns_fitting
from llmweb.chat.fold import fold as fold_memory
from llmweb.chat.tokens import ChatFormat
from llmweb.chat.turn import Cancel, Event, Job, Prompt, Sampling, TurnRunner, plan_sources
from llmweb.chat.turn import documents as retrieve
from llmweb.config import Settings
from llmweb.engine.scheduler import Engine
from llmweb.errors import InputError, LlmwebError
from llmweb.records import Chunk, Turn

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


TOOL = "tool"  # a tool's result (web/api/tools.py renders it naming its call): the user's side of a turn


def cut_results(messages: Sequence[tuple[str, str]], fmt: ChatFormat, room: int) -> list[tuple[str, str]]:
    """The messages with each run of tool results (the results of one step's calls, joined into
    one user-side message) within `room` tokens: a result over its share is cut to it, with a
    note that says so; then every tool result is a user-side message."""
    out: list[tuple[str, str]] = []
    i = 0
    while i < len(messages):
        if messages[i][0] != TOOL:
            out.append(messages[i])
            i += 1
            continue
        j = i
        while j < len(messages) and messages[j][0] == TOOL:
            j += 1
        share = max(1, room // (j - i) - 2)  # the joining blank lines
        out.extend(("user", _cut(text, fmt, share)) for _, text in messages[i:j])
        i = j
    return out


def _cut(text: str, fmt: ChatFormat, room: int) -> str:
    """`text` within `room` tokens: whole, or its longest head that fits with the note (a binary
    search over characters: O(log n) counts)."""
    n = fmt.count(text)
    if n <= room:
        return text

    def cut(k: int) -> str:
        return f"{text[:k]}\n[cut: this tool result is {n:,} tokens; only its start fits the context]"

    lo, hi = 0, len(text)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fmt.count(cut(mid)) <= room:
            lo = mid
        else:
            hi = mid - 1
    return cut(lo)


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
    remembered: Sequence[str] = (),
) -> Fit:
    """Plan `d` within `budget`: start from the longest summarised prefix in `cache`, then fold the
    oldest turns (`fold`: the previous memory and the turns -> the new memory) until the rest fits,
    caching each new memory under its prefix key. `fold=None`: never summarise (old turns are left
    out and reported); a fold that fails (a domain error: the engine busy, ...) stops the folding,
    and what it would have summarised is left out and reported. Raises InputError when the system
    message, the user's message and the reply alone do not fit. `remembered`: what the owner asked
    all their chats to remember, where the request asks for it (context.plan's `memory`)."""
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
        plan = context.plan(
            system, memory.summary, turns[j:], chunks, d.user, budget, fmt, facts=memory.facts, memory=remembered
        )
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
    if n >= budget.prompt_room:
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
    the chat's summariser (chat/memory.py's `Summariser.write`), at most `budget.summary_cap` tokens."""

    def __init__(
        self,
        settings: Settings,
        engine: Engine,
        fmt: ChatFormat,
        budget: context.Budget,
        write_summary: Write,
        library=None,
        cache: SummaryCache | None = None,
    ):
        self.settings = settings
        self.fmt = fmt
        self.budget = budget
        self.write_summary = write_summary
        self.library = library
        self.cache = cache if cache is not None else SummaryCache()
        self.runner = TurnRunner(settings, engine, fmt)

    def fold(self, memory: Memory, turns: Sequence[Turn]) -> Memory:
        """The memory after folding `turns` (chat/fold.py, as the chat folds). The turns go to the
        summariser in batches whose summary prompt, with the summary as it is by then, fits the
        context with room for the cap: one engine job each, and never a prompt measured against
        an older, shorter summary."""
        return fold_memory(memory, turns, self._summarise)

    def _summarise(self, previous: str, turns: list[Turn]) -> str:
        cap = self.budget.summary_cap
        text, rest = previous, turns
        while rest:
            n = turns_fitting(self.fmt, text, rest, cap, self.budget.context_limit - cap)
            text = self.write_summary(text, rest[:n])
            rest = rest[n:]
        return text

    def send(
        self,
        owner: str,
        messages: Sequence[tuple[str, str]],
        *,
        use_docs: bool = False,
        seed: int | None = None,
        sampling: Sampling | None = None,
        stop: Sequence[str] = (),
        cancel: Cancel | None = None,
        documents: Sequence[str] | None = None,
        memory: Sequence[str] = (),
    ) -> Iterator[Fitted | Event]:
        """One stateless turn for `owner`. Yields Fitted, Started(""), Queued / Delta, Finished.
        `sampling` (the request's temperature, top_p, max_tokens: a smaller reply cap leaves more
        room for history), `stop` and `cancel` as `Chat.send` takes them; `documents` (names or ids,
        `Library.resolve`: an InputError for one the owner has not) the only documents it reads.
        A "tool" message (a tool's result, restating its call) is a user-side message, cut to
        the user budget with a note where it is longer (`cut_results`);
        `memory` what the owner asked all their chats to remember (only where the request asks)."""
        s = self.settings
        budget = self.budget.capped(sampling.max_tokens if sampling is not None else None)
        d = dialogue(cut_results(messages, self.fmt, budget.user_tokens))
        system = d.system or s.system_prompt
        if sampling is not None and sampling.instruction:  # what the reply's grammar is (web/api/tools.py)
            system = f"{system}\n\n{sampling.instruction}"
        system_fits(system, budget, self.fmt)

        # 1) retrieve, 2) fit (summarising what does not fit), 3) generate
        only = None
        if documents is not None and self.library is not None:
            only = frozenset(i for i, _ in self.library.resolve(owner, documents))
        chunks = retrieve(self.library, s, owner, d.user, use_docs, only)
        scope = f"{owner}\n{system}"
        fold = self.fold if s.summaries else None
        f = fit(
            d,
            system,
            budget,
            self.fmt,
            self.cache,
            scope,
            fold,
            high=s.history_high,
            low=s.history_low,
            chunks=chunks,
            remembered=memory,
        )
        yield Fitted(f, plan_sources(f.plan))

        notes = [f"The oldest {f.summarized_messages} messages are summarised."] if f.summarized_messages else []
        if f.fold_error:
            notes.append(f"Summarising stopped: {f.fold_error}")
        first = d.turns[0].user if d.turns else d.user
        job = Job(
            owner=owner,
            conv_id="",
            # the prompt's prefix is the same call after call: the session (its KV cache) is the chat's first message
            session_id="api:" + hashlib.sha256(f"{scope}\n{first}".encode("utf-8", "replace")).hexdigest()[:32],
            prompt=Prompt(
                system,
                f.memory.summary,
                d.turns[f.summarized_turns :],
                chunks,
                d.user,
                facts=f.memory.facts,
                memory=tuple(memory),
            ),
            plan=f.plan,
            budget=budget,
            temperature=s.temperature,
            number=len(d.turns) + 1,
            summarized=f.summarized_turns,
            seed=seed,
            notes=tuple(notes),
            loop_guard=s.loop_guard,
        )
        yield (yield from self.runner.run(job, sampling=sampling, stop=stop, cancel=cancel))
