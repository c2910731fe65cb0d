"""One turn's run, from a planned prompt to a measured reply: the pipeline every chat path shares.

The UI's chat, regenerate, continue and edit (chat/session.py), and the stateless API path
(chat/stateless.py) each read their snapshot and plan it (`Prompt.plan`, from one read); then
`TurnRunner.run(job)` does the rest the same way for all of them: the engine request with its
sampling and its one smaller retry after an OOM, streaming (`Started`, `Queued` while it waits,
`Delta`: the reply so far), stop strings, cancel (closing the generator, or a `Cancel` from
another thread), the `TurnStats` record and the notes, and returns the `Finished` event.

It must not read or write the store, retrieve, or decide what is planned: its callers do.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection, Generator, Iterator, Sequence
from dataclasses import dataclass, field, replace

from llmweb.chat import context
from llmweb.chat.document_plan import DocumentStats
from llmweb.chat.tokens import ChatFormat
from llmweb.config import Settings
from llmweb.engine.constraint import Constraint
from llmweb.engine.request import GenerationRequest, Handle, Prefilling, TokenLogprob, Tokens, Waiting
from llmweb.engine.scheduler import Engine
from llmweb.errors import ConfigError, EngineStopped, InputError
from llmweb.records import ENGINE_STOPPED, Chunk, GenerationStats, Source, Turn, TurnStats

SETTLE_S = 2.0  # after a cancel, how long a partial reply waits for the engine's figures


@dataclass(frozen=True)
class Started:
    conv_id: str  # the conversation this turn belongs to (new ones get their id here; "" stateless)


@dataclass(frozen=True)
class Queued:
    position: int
    wait_s: float = 0.0  # the engine's estimate of the wait until it starts


@dataclass(frozen=True)
class Delta:
    text: str  # the whole reply so far
    logprobs: tuple[TokenLogprob, ...] = ()  # the new ids' since the last Delta, when the request asked


@dataclass(frozen=True)
class Progress:
    """A whole-document task's progress (chat/document_task.py): `done` of `total` sections."""

    done: int
    total: int
    text: str  # "Reading section 3 of 12…"


@dataclass(frozen=True)
class Finished:
    reply: str
    stats: TurnStats
    sources: list[Source] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    prompt: tuple[tuple[str, str], ...] = ()  # the planned messages (role, text), system first
    conv_id: str = ""  # the conversation the turn was stored in
    document: DocumentStats | None = None  # a whole-document task's figures (chat/document_task.py)
    logprobs: tuple[TokenLogprob, ...] = ()  # one per generated id, when the request asked (`Sampling.logprobs`)
    contents: str = ""  # what is in the prompt and why (ContextPlan.contents)

    def prompt_text(self) -> str:
        head = [self.contents] if self.contents else []
        return "\n\n".join(head + [f"### {role}\n{text}" for role, text in self.prompt])


Event = Started | Queued | Progress | Delta | Finished


def finish(events: Iterator) -> Finished:
    """Run a turn to the end (replay, benchmarks, tests): its `Finished` event."""
    for event in events:
        if isinstance(event, Finished):
            return event
    raise AssertionError("the turn ended without a Finished event")


@dataclass(frozen=True, slots=True)
class Sampling:
    """A caller's sampling over the chat's own (the API's request fields); None: the chat's."""

    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None  # the reply's cap, within the budget's
    loop_guard: bool | None = None  # x_llmweb.loop_guard
    logprobs: int | None = None  # None: none; k: each id's log-probability and the k most likely (engine/request.py)
    constraint: Constraint | None = None  # the reply's grammar (response_format, tools: engine/constraint.py)
    instruction: str = ""  # what the system message adds to tell the model of the grammar (stateless turns)


class Cancel:
    """A hand on a turn's engine request from another thread (an API client gone): `cancel()`
    stops it within a token, or before it starts. Closing the turn's generator does the same
    from the thread that reads it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._handle: Handle | None = None
        self._cancelled = False

    def attach(self, handle: Handle) -> None:
        with self._lock:
            self._handle = handle
            cancelled = self._cancelled
        if cancelled:
            handle.cancel()

    def cancel(self) -> None:
        with self._lock:
            self._cancelled = True
            handle = self._handle
        if handle is not None:
            handle.cancel()


@dataclass(frozen=True, slots=True)
class Prompt:
    """What a turn's prompt is planned from, read once: `context.plan`'s inputs."""

    system: str
    summary: str
    turns: tuple[Turn, ...]  # the window, oldest first
    chunks: tuple[Chunk, ...]  # retrieved document chunks
    user: str
    recall: tuple[Chunk, ...] = ()  # earlier passages of this conversation
    facts: tuple = ()  # the user's facts (`.text`, `.pinned`), oldest first
    hold: int = 0  # where the window started last turn, while it still fits (context.plan)
    low: float = 1.0  # past that, history is cut to this share of its room
    pinned: tuple[Turn, ...] = ()  # turns kept in context that are already folded out of the window
    memory: tuple[str, ...] = ()  # what the owner asked all their chats to remember (store/memories.py)

    def plan(self, budget: context.Budget, fmt: ChatFormat) -> context.ContextPlan:
        return context.plan(
            self.system,
            self.summary,
            self.turns,
            self.chunks,
            self.user,
            budget,
            fmt,
            recall=self.recall,
            facts=self.facts,
            hold=self.hold,
            low=self.low,
            folded_pins=self.pinned,
            memory=self.memory,
        )

    def smaller(self) -> Prompt:
        """The OOM retry's: half the document chunks and half the recalled passages."""
        return replace(self, chunks=self.chunks[: len(self.chunks) // 2], recall=self.recall[: len(self.recall) // 2])


def documents(
    library, settings: Settings, owner: str, text: str, use_docs: bool, only: Collection[str] | None = None
) -> tuple[Chunk, ...]:
    """The document chunks (shared and the owner's own; with `only`, of those doc ids alone) a message
    retrieves; none when off, empty, or `only` is empty."""
    if not use_docs or library is None or (only is not None and not only) or library.is_empty(owner):
        return ()
    return tuple(library.search(owner, text, k=settings.top_k, min_score=settings.min_score, only=only))


NO_CHOSEN_DOCUMENTS = (
    "None of the documents this chat reads is in your library any more, so it read none: "
    "choose its documents again under Documents."
)


@dataclass(frozen=True, slots=True)
class Job:
    """One planned turn, ready to run."""

    owner: str
    conv_id: str  # what `Started` and `Finished` name ("" for a stateless turn)
    session_id: str  # the KV cache's session
    prompt: Prompt
    plan: context.ContextPlan  # `prompt` planned in `budget`
    budget: context.Budget
    temperature: float
    number: int  # the turn's number in its conversation (TurnStats.turn)
    summarized: int  # turns folded into the summary
    seed: int | None = None
    partial: tuple[int, ...] | None = None  # continue: the reply so far (no smaller retry: it would drop it)
    loop_guard: bool = True  # the chat's setting (TurnSettings.loop_guard)
    notes: tuple[str, ...] = ()  # known before generation (stateless: what was summarised)


def plan_sources(plan: context.ContextPlan) -> list[Source]:
    """The numbered sources of a plan: document chunks [1..n] as the prompt tags them, then recall."""
    used = list(plan.chunks) + list(plan.recall)
    return [Source.from_chunk(c, n) for n, c in enumerate(used, 1)]


def turn_stats(
    gen: GenerationStats | None,
    plan: context.ContextPlan,
    number: int,
    summarized: int,
    ended: str = "cancelled",
    model: str = "",
) -> TurnStats:
    """A turn's stats record: the engine's figures (or, stopped before it had any, the plan's,
    ending as `ended`), the plan's, and the model that answered."""
    if gen is None:
        gen = GenerationStats(prompt_tokens=len(plan.ids), finish_reason=ended)
    return TurnStats(
        turn=number,
        gen=gen,
        sections=dict(plan.sections),
        context_limit=plan.context_limit,
        dropped_turns=plan.dropped_turns,
        summarized_turns=summarized,
        summary_tokens=plan.summary_tokens,
        dropped_chunks=len(plan.dropped_chunks),
        dropped_facts=len(plan.dropped_facts),
        model=model,
    )


def reading(done: int, total: int) -> str:
    """A long prefill's progress line, as the page shows it."""
    return f"Reading your message and this chat: {done:,} of {total:,} tokens…"


def held_back(text: str, stops: Sequence[str], final: bool = True) -> tuple[str, bool]:
    """`text` as far as it may be shown: cut before the first of `stops` in it (True), else, unless
    `final`, less a tail that could be the start of one (a stream must not show what it takes back)."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    if hits:
        return text[: min(hits)], True
    if final:
        return text, False
    hold = max((n for s in stops for n in range(1, len(s)) if text.endswith(s[:n])), default=0)
    return text[: len(text) - hold], False


Keep = Callable[[str, TurnStats], None]  # (partial reply, its stats): a turn closed early keeps what it showed


class TurnRunner:
    """Runs planned turns on the engine (`run`)."""

    def __init__(self, settings: Settings, engine: Engine, fmt: ChatFormat, model: str = ""):
        self.settings, self.engine, self.fmt = settings, engine, fmt
        self.model = model  # named in each turn's stats

    def request(self, job: Job, sampling: Sampling) -> GenerationRequest:
        """The engine request: the job's prompt (continue: with the reply so far) and sampling, and
        a smaller plan ready for one retry after an OOM."""
        s, partial = self.settings, job.partial or ()
        cap = job.budget.max_new_tokens - len(partial)
        if sampling.max_tokens is not None:
            cap = min(cap, sampling.max_tokens)

        def smaller() -> GenerationRequest | None:
            reduced = job.budget.reduced()
            try:
                p = job.prompt.smaller().plan(reduced, self.fmt)
            except (InputError, ConfigError):
                return None
            return replace(request, prompt_ids=p.ids, max_new_tokens=min(reduced.max_new_tokens, cap), fallback=None)

        request = GenerationRequest(
            prompt_ids=job.plan.ids + partial,
            max_new_tokens=cap,
            temperature=job.temperature if sampling.temperature is None else sampling.temperature,
            top_p=s.top_p if sampling.top_p is None else sampling.top_p,
            repetition_penalty=s.repetition_penalty,
            loop_guard=job.loop_guard if sampling.loop_guard is None else sampling.loop_guard,
            seed=job.seed,
            stop_ids=self.fmt.stop_ids,
            session_id=job.session_id,  # the prompt's prefix is the session's last: reuse its KV cache
            timeout_s=s.request_timeout_s,
            fallback=smaller if job.partial is None else None,
            owner=job.owner,
            logprobs=sampling.logprobs,
            constraint=sampling.constraint,
        )
        return request

    def run(
        self,
        job: Job,
        *,
        sampling: Sampling | None = None,
        stop: Sequence[str] = (),
        cancel: Cancel | None = None,
        keep: Keep | None = None,
    ) -> Generator[Started | Queued | Progress | Delta, None, Finished]:
        """Yield Started, then Queued / Delta; return the Finished (the caller records it first).
        A reply that shows one of `stop` (after leading whitespace) is cancelled there; so is one
        whose generator is closed early (stop button, client gone) or that fails, and then `keep`,
        if given, gets what was generated (a partial reply, marked as stopped)."""
        handle = self.engine.submit(self.request(job, sampling or Sampling()))
        if cancel is not None:
            cancel.attach(handle)
        yield Started(job.conv_id)
        finished = False
        given = 0  # the log-probabilities handed out with a Delta so far
        try:
            for event in handle.events():
                if isinstance(event, Waiting):
                    yield Queued(event.position, event.wait_s)
                elif isinstance(event, Prefilling):  # a long prompt (a changed system prompt, a pasted text)
                    yield Progress(event.done, event.total, reading(event.done, event.total))
                elif isinstance(event, Tokens):
                    text, ended = self._reply(job, handle, final=False)
                    if ended or (stop and any(s in text.lstrip() for s in stop)):
                        handle.cancel()  # the reply ends before the stop string (the caller cuts its own)
                    logprobs = tuple(handle.logprobs[given:]) if event.logprobs else ()  # those of the text
                    given += len(logprobs)
                    yield Delta(text, logprobs)
            finished = True
        finally:
            if not finished:  # closed early (stop, disconnect) or failed (time limit, OOM)
                handle.cancel()
                if keep is not None:
                    self._keep_partial(job, handle, keep)
        reply, ended = self._reply(job, handle)
        gen = handle.stats
        if ended and gen is not None and gen.finish_reason in ("cancelled", "length"):
            gen = replace(gen, finish_reason="eos")  # the format's stop text ended the turn, as its token would
        stats = turn_stats(gen, job.plan, job.number, job.summarized, model=self.model)
        notes = ["Stopped."] if stats.gen.finish_reason == "cancelled" else []
        if job.plan.left_out:
            notes.append(job.plan.left_out.capitalize() + ".")
        return Finished(
            reply.strip(),
            stats,
            plan_sources(job.plan),
            notes + list(job.notes),
            job.plan.messages,
            job.conv_id,
            logprobs=tuple(handle.logprobs),
            contents=job.plan.contents,
        )

    def _reply(self, job: Job, handle: Handle, final: bool = True) -> tuple[str, bool]:
        """The reply so far, cut before the format's own stop text (`ChatFormat.stop_texts`), and
        whether one came; while it streams (not `final`), less a tail that may be the start of one."""
        text = self.fmt.decode([*(job.partial or ()), *handle.generated])
        return held_back(text, self.fmt.stop_texts, final)

    def _keep_partial(self, job: Job, handle: Handle, keep: Keep) -> None:
        deadline = time.monotonic() + SETTLE_S
        while handle.stats is None and handle.error is None and time.monotonic() < deadline:
            time.sleep(0.05)  # the worker notices within a token; then its stats are complete
        if handle.generated:  # keep what was shown; the worker stops within a token
            ended = ENGINE_STOPPED if isinstance(handle.error, EngineStopped) else "cancelled"
            stats = turn_stats(handle.stats, job.plan, job.number, job.summarized, ended, self.model)
            keep(self._reply(job, handle)[0].strip(), stats)
