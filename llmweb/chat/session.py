"""The chat turn, UI-agnostic: retrieve → plan → generate → record → compress.

`Chat.send(owner, conv_id, text)` yields `Started(conv_id)`, `Queued` while it waits, then
`Delta` (the reply so far) as tokens stream, then one `Finished` with the reply, its `TurnStats`
and its sources. Every call names the OWNER it acts for (store/db.py: every read is scoped to it);
`conv_id=None` starts a new conversation, which the store creates with its first turn. The UI, the API endpoint,
`replay` and the benchmarks all call this one path; `Chat.ask()` runs it to the end and returns
the `Finished`. Closing the generator early (stop button,
client gone) cancels the engine request; a partial reply is still stored, marked as stopped.

Compression runs after the reply: when the window's history passes its high-water mark, the
oldest turns are folded into the rolling summary by a background engine job, so the prompt
prefix changes rarely (and the session KV cache is dropped only then).
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace

from llmweb.chat import context, facts, summary
from llmweb.chat.tokens import ChatFormat, render_prompt
from llmweb.config import Settings
from llmweb.engine.request import GenerationRequest, Tokens, Waiting
from llmweb.engine.scheduler import Engine
from llmweb.errors import ConfigError, InputError, LlmwebError
from llmweb.records import Chunk, GenerationStats, Source, Turn, TurnStats
from llmweb.store.db import (
    DEFAULT_TITLE,
    MAX_SYSTEM_PROMPT_CHARS,
    MEMORY_MODES,
    ChatSettings,
    Conversation,
    Store,
    new_id,
)

log = logging.getLogger(__name__)

# Recall needs a confident match: cosine >= 0.40 (all-MiniLM-L6-v2) kept no unrelated turn in the
# fidelity script's messages (filler -> planted fact: max 0.38 as a whole turn; as the user's words
# alone, one pair passes, 0.415 "green tea" -> "My favourite colour is teal.", a fact, so covered;
# question -> filler: max 0.36) and kept 9 of 10 questions about a planted fact by the user's
# words (the earlier calibration on whole turns with the model's replies kept 6 of 10; the one
# lost now, "Which company do I work for?", is a fact).
RECALL_MIN_SCORE = 0.40
RECALL_CANDIDATES = 4  # recall looks at this many passages per turn it may recall
# Regenerate must give a new reply: with greedy decoding (LLMWEB_TEMPERATURE=0, the default) it
# samples at this temperature instead, with a fresh seed.
REGENERATE_TEMPERATURE = 0.7
MAX_TEMPERATURE = 2.0  # a chat may sample this hot at most

_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")


@dataclass(frozen=True, slots=True)
class TurnSettings:
    """What one turn runs with: the chat's own settings over the configuration's (`Chat.turn_settings`)."""

    system_prompt: str
    temperature: float
    budget: context.Budget  # max_new_tokens is the chat's reply cap
    use_docs: bool
    summaries: bool  # fold old turns into the rolling summary
    recall: bool  # bring back earlier turns that left the window

    @property
    def memory(self) -> str:
        """The memory mode in effect: one of store.MEMORY_MODES."""
        return "recall" if self.recall else "summary" if self.summaries else "window"


@dataclass(frozen=True)
class Started:
    conv_id: str  # the conversation this turn belongs to (new ones get their id here)


@dataclass(frozen=True)
class Queued:
    position: int


@dataclass(frozen=True)
class Delta:
    text: str  # the whole reply so far


@dataclass(frozen=True)
class Finished:
    reply: str
    stats: TurnStats
    sources: list[Source] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    prompt: tuple[tuple[str, str], ...] = ()  # the planned messages (role, text), system first
    conv_id: str = ""  # the conversation the turn was stored in

    def prompt_text(self) -> str:
        return "\n\n".join(f"### {role}\n{text}" for role, text in self.prompt)


def clean_message(text: str, max_chars: int) -> str:
    """Validate a user message: not empty, not huge; control characters and lone surrogates removed."""
    if not isinstance(text, str):
        raise InputError("A message must be text.")
    text = text.encode("utf-8", "replace").decode("utf-8")
    text = _CONTROL.sub("", text).strip()
    if not text:
        raise InputError("Your message is empty. Type a question or some text first.")
    if len(text) > max_chars:
        raise InputError(
            f"Your message is {len(text):,} characters; the limit is {max_chars:,}. "
            "Attach long text as a document instead, and ask about it."
        )
    return text


def reduced_budget(b: context.Budget) -> context.Budget:
    """The budget for the one retry after an OOM: two thirds of the context, half the reply and documents."""
    limit = max(b.context_limit * 2 // 3, 2)
    return replace(
        b,
        context_limit=limit,
        max_new_tokens=max(min(b.max_new_tokens // 2, limit // 2), 1),
        retrieved_tokens=b.retrieved_tokens // 2,
    )


def _covered(passage: Chunk, known: set[str]) -> bool:
    """Does the summary + facts vocabulary (`known`, `facts.vocabulary`) already carry what the
    turn's user text said? Every detail (`facts.detail_terms`: names, codes, numbers) must be in it,
    and every statement the user made about themselves mostly (`facts.unkept_statements`: "I play
    the cello in a quartet." has no detail, and a small summary drops it whole). A turn that only
    asked or asked for something is covered by the summary's paraphrase of it."""
    user_text = passage.text.split("\nAssistant:")[0].removeprefix("User:")
    return facts.detail_terms(user_text) <= known and not facts.unkept_statements(user_text, known)


def reply_prefix_ids(fmt: ChatFormat, text: str) -> list[int]:
    """The ids of an assistant reply as the model would go on from it: its message without the
    opening and closing tokens the chat template puts around every assistant message."""
    empty, full = fmt.message_ids("assistant", ""), fmt.message_ids("assistant", text)
    head = 0
    while head < min(len(empty), len(full)) and empty[head] == full[head]:
        head += 1
    tail = 0
    while tail < min(len(empty), len(full)) - head and empty[-1 - tail] == full[-1 - tail]:
        tail += 1
    return list(full[head : len(full) - tail])


def _recall_chunks(turns: Iterable[tuple[int, Turn]]) -> list[Chunk]:
    """Turns (index, turn) as recall passages, two per turn under the turn's doc_id: the whole turn,
    and the user's words alone. A question about what the user said ("Which instrument do I
    play?") matches their words, and a small model's long reply beside them can pull the whole
    turn's score under RECALL_MIN_SCORE (0.39 for "I play the cello in a quartet." in `bench
    fidelity`); a question about the reply matches the whole turn."""
    out = []
    for i, t in turns:
        whole = f"User: {t.user}\nAssistant: {t.assistant}"
        for text in (whole, f"User: {t.user}"):
            out.append(Chunk(text=text, source=f"turn {i + 1}", doc_id=f"turn-{i}", kind="recall"))
    return out


def plan_sources(plan: context.ContextPlan) -> list[Source]:
    """The numbered sources of a plan: document chunks [1..n] as the prompt tags them, then recall."""
    used = list(plan.chunks) + list(plan.recall)
    return [Source.from_chunk(c, n) for n, c in enumerate(used, 1)]


class Chat:
    def __init__(
        self, settings: Settings, engine: Engine, fmt: ChatFormat, store: Store, budget: context.Budget, library=None
    ):
        self.settings = settings
        self.engine = engine
        self.fmt = fmt
        self.store = store
        self.budget = budget
        self.library = library
        self._jobs: dict[str, threading.Thread] = {}
        self._recall: dict = {}  # conversation id -> its recall Index
        self._jobs_lock = threading.Lock()

    # ---- the turn
    def send(
        self,
        owner: str,
        conv_id: str | None,
        text: str,
        *,
        new: bool = False,
        use_docs: bool | None = None,
        seed: int | None = None,
        wait_summary: bool = False,
        redo: bool = False,
        more: bool = False,
        edit: int | None = None,
    ) -> Iterator[Started | Queued | Delta | Finished]:
        """One turn. `conv_id=None` starts a conversation with an id made here; `new=True` starts one
        with `conv_id`, which the caller must have made with `store.new_id()` (never a client's).
        `redo=True` (regenerate) answers the conversation's last message again, `text` unused, and
        replaces that turn's reply, planned as if the turn had not been there; refused when the
        turn is already folded into the summary. The session's KV cache needs nothing: the runner
        reuses only the longest common prefix of the new prompt with what it cached.
        `more=True` (continue) is the same for a reply cut by the length cap or stopped, except that
        the prompt ends with that reply so far, and the reply grows from it.
        The chat's own settings (`ChatSettings`: system prompt, temperature, reply cap, documents,
        memory mode) apply over the configuration's; `use_docs` None follows the chat's.
        `edit=k` sends `text` in place of turn k's message: the reply is planned from the turns
        before k only (the session's KV cache reuses that prefix), and the turn is stored as a new
        version of the chat from k on (`Store.edit_turn`: the old turns stay, as another version).
        Refused when turn k is already folded into the summary."""
        s = self.settings
        redone = None
        partial: tuple[int, ...] = ()  # continue: the ids of the reply so far
        if redo or more:
            if conv_id is None or new:
                raise InputError("There is no reply to regenerate or continue yet.")
            self.wait_background(conv_id)  # a fold in flight may be taking the last turn
            redone = self.store.last_turn(owner, conv_id)
            text = redone.user
        if more:
            assert redone is not None
            if redone.stats is None or redone.stats.gen.finish_reason not in ("length", "cancelled"):
                raise InputError("The last reply is complete: only a reply cut short or stopped can be continued.")
        text = clean_message(text, s.max_message_chars)
        new = new or conv_id is None
        # read once: the whole turn plans from this snapshot (NotFound for another owner's id)
        conv = (
            self.store.get(owner, conv_id)
            if conv_id is not None and not new
            else Conversation(conv_id or new_id(), DEFAULT_TITLE, "", 0, [], owner=owner)
        )
        if redone is not None:
            conv = replace(conv, turns=[t for t in conv.turns if t.idx < redone.idx])
        if edit is not None:
            if new or not 0 <= edit < len(conv.turns):
                raise InputError("That message is no longer in this chat: reload it and try again.")
            if edit < conv.summarized_upto:
                raise InputError(
                    "That message is already folded into this chat's summary, so it can no longer be edited."
                )
            conv = replace(conv, turns=conv.turns[:edit])
        conv_id = conv.id
        window = [t.as_turn() for t in conv.turns[conv.summarized_upto :]]
        mine = self.turn_settings(conv.settings)  # this chat's settings over the configuration's
        base = budget = mine.budget
        if more:
            assert redone is not None
            partial = tuple(reply_prefix_ids(self.fmt, redone.assistant))
            reserve = min(budget.max_new_tokens + len(partial), budget.context_limit - 1)
            if reserve - len(partial) < 1:
                raise InputError("The last reply already fills this chat's context: it cannot go on.")
            budget = replace(budget, max_new_tokens=reserve)  # room for the reply so far and its rest
        if use_docs is None:
            use_docs = mine.use_docs
        # window only: the summary of an earlier mode stays stored, but is no longer in the prompt
        summary_text = conv.summary if mine.summaries else ""

        # 1) retrieve: documents (shared + the owner's own), and earlier turns that left the window
        chunks: list[Chunk] = []
        if use_docs and self.library is not None and not self.library.is_empty(owner):
            chunks = self.library.search(owner, text, k=s.top_k, min_score=s.min_score)
        recalling = mine.recall and conv.summarized_upto > 0 and self.library is not None
        recall = self.recall(conv, text) if recalling else []

        # 2) plan (raises InputError with the numbers when the message cannot fit)
        plan = context.plan(
            mine.system_prompt, summary_text, window, chunks, text, budget, self.fmt, recall=recall, facts=conv.facts
        )

        # 3) generate, with a smaller plan ready for an OOM retry
        def smaller() -> GenerationRequest | None:
            reduced = reduced_budget(base)
            try:
                p = context.plan(
                    mine.system_prompt,
                    summary_text,
                    window,
                    chunks[: len(chunks) // 2],
                    text,
                    reduced,
                    self.fmt,
                    recall=recall[: len(recall) // 2],
                    facts=conv.facts,
                )
            except (InputError, ConfigError):
                return None
            return replace(request, prompt_ids=p.ids, max_new_tokens=reduced.max_new_tokens, fallback=None)

        request = GenerationRequest(
            prompt_ids=plan.ids + partial if partial else plan.ids,
            max_new_tokens=budget.max_new_tokens - len(partial),
            temperature=mine.temperature or (REGENERATE_TEMPERATURE if redo else 0.0),
            top_p=s.top_p,
            repetition_penalty=s.repetition_penalty,
            seed=seed,
            stop_ids=self.fmt.stop_ids,
            session_id=conv_id,
            timeout_s=s.request_timeout_s,
            fallback=None if more else smaller,  # a smaller plan would drop the reply so far
            owner=owner,
        )
        handle = self.engine.submit(request)
        yield Started(conv_id)
        reply, finished = "", False
        sources = plan_sources(plan)

        def record(reply: str, stats: TurnStats) -> None:
            if redone is not None:
                self.store.replace_last_reply(owner, conv_id, redone.idx, reply, stats, sources)
            elif edit is not None:
                self.store.edit_turn(owner, conv_id, edit, text, reply, stats, sources)
            else:
                self.store.add_turn(owner, conv_id, text, reply, stats, sources, create=new)

        try:
            for event in handle.events():
                if isinstance(event, Waiting):
                    yield Queued(event.position)
                elif isinstance(event, Tokens):
                    reply = self.fmt.decode([*partial, *handle.generated])
                    yield Delta(reply)
            finished = True
        finally:
            if not finished:  # closed early (stop, disconnect) or failed (time limit, OOM)
                handle.cancel()
                for _ in range(40):  # the worker notices within a token; then its stats are complete
                    if handle.stats is not None or handle.error is not None:
                        break
                    time.sleep(0.05)
                if handle.generated:  # keep what was shown; the worker stops within a token
                    stats = self._stats(handle.stats, plan, conv)
                    record(self.fmt.decode([*partial, *handle.generated]).strip(), stats)
        reply = self.fmt.decode([*partial, *handle.generated]).strip()
        stats = self._stats(handle.stats, plan, conv)

        # 4) record
        record(reply, stats)
        notes = []
        if stats.gen.finish_reason == "cancelled":
            notes.append("Stopped.")
        if plan.left_out:
            notes.append(plan.left_out.capitalize() + ".")

        # 5) compress
        self._maybe_compress(conv, Turn(text, reply), plan, mine)
        if wait_summary:
            self.wait_background(conv_id)
        yield Finished(reply, stats, sources, notes, plan.messages, conv_id)

    def ask(self, owner: str, conv_id: str | None, text: str, **kw) -> Finished:
        """Run one turn to the end (replay, benchmarks, tests): the `Finished` event of `send`."""
        for event in self.send(owner, conv_id, text, **kw):
            if isinstance(event, Finished):
                return event
        raise AssertionError("Chat.send ended without a Finished event")

    def _stats(self, gen: GenerationStats | None, plan: context.ContextPlan, conv: Conversation) -> TurnStats:
        if gen is None:  # stopped before the engine had figures: what the plan knows
            gen = GenerationStats(prompt_tokens=len(plan.ids), finish_reason="cancelled")
        return TurnStats(
            turn=len(conv.turns) + 1,
            gen=gen,
            sections=dict(plan.sections),
            context_limit=plan.context_limit,
            dropped_turns=plan.dropped_turns,
            summarized_turns=conv.summarized_upto,
            summary_tokens=plan.summary_tokens,
            dropped_chunks=len(plan.dropped_chunks),
            dropped_facts=len(plan.dropped_facts),
        )

    # ---- compression
    def _maybe_compress(self, conv: Conversation, new: Turn, plan: context.ContextPlan, mine: TurnSettings) -> None:
        """`conv` as it was before this turn, and the turn just stored: no second read of the store."""
        if not mine.summaries:
            return  # window only: old turns are left out (and reported), never folded
        conv_id, owner = conv.id, conv.owner
        window = [t.as_turn() for t in conv.turns[conv.summarized_upto :]] + [new]
        counts = [context.turn_tokens(self.fmt, t) for t in window]
        # the room history has apart from this turn's retrieved text, which comes and goes: folding
        # against it keeps compressions rare (and the prompt prefix, so the KV cache, stable)
        room = plan.history_room + plan.sections["retrieved"] + plan.sections["recall"]
        n = summary.turns_to_fold(counts, room, self.settings.history_high, self.settings.history_low)
        if n <= 0:
            return
        with self._jobs_lock:
            job = self._jobs.get(conv_id)
            if job is not None and job.is_alive():
                return
            job = threading.Thread(
                target=self._fold,
                name=f"summary-{conv_id[:8]}",
                args=(owner, conv_id, conv.summary, window[:n], conv.summarized_upto, mine.recall),
                daemon=True,
            )
            self._jobs[conv_id] = job
        job.start()

    def _fold(self, owner: str, conv_id: str, previous: str, turns: list[Turn], first: int, recall: bool) -> None:
        """Fold turns out of the window (`turns` are turn indices first, first + 1, ...): index them for
        recall, keep the user's facts, summarise."""
        try:
            upto = first + len(turns)
            if self.store.get(owner, conv_id).summarized_upto != first:
                return  # an earlier fold finished after this turn read the chat; the next turn decides again
            if recall and self.library is not None:
                self.recall_index(conv_id).add_chunks(_recall_chunks(enumerate(turns, first)))
            source = previous + "\n" + "\n".join(f"{t.user}\n{t.assistant}" for t in turns)
            try:
                grounded = facts.ground(self.write_summary(previous, turns), source)
                if grounded.dropped:
                    log.info(
                        "summary for %s: dropped %d ungrounded sentences: %s",
                        conv_id,
                        len(grounded.dropped),
                        grounded.dropped,
                    )
                new = grounded.text
            except LlmwebError as e:  # the window still moves on: facts and recall keep what matters
                log.warning("summary for %s failed (%s); keeping the previous summary", conv_id, e)
                new = previous
            known = {" ".join(f.text.lower().split()) for f in self.store.facts(owner, conv_id)}
            for fact in facts.extract_facts(t.user for t in turns):
                if " ".join(fact.lower().split()) not in known:
                    self.store.add_fact(owner, conv_id, fact, pinned=False)
            self.store.set_summary(owner, conv_id, new, upto)
            self._warm(owner, conv_id)
        except Exception:  # the turn already streamed; a failed fold is tried again next turn
            log.exception("folding turns for %s failed", conv_id)

    def _warm(self, owner: str, conv_id: str) -> None:
        """Prefill the folded prompt's prefix now, in the background, into the session's KV cache.

        A fold moves the window, so every token after the summary sits at a new position and the
        cached prefix ends there: the next turn would prefill the whole window (~1,000 tokens at
        context 2048) before its first token. Planned with an empty message, this prompt is the
        next turn's up to its user text; the engine keeps it as the session's cache (one token is
        generated and dropped), and the user's next message, typed meanwhile, reuses it. Planning
        never fails the fold: a conversation gone or not fitting just is not warmed.
        """
        if not self.settings.kv_reuse:
            return
        try:
            conv = self.store.get(owner, conv_id)
            window = [t.as_turn() for t in conv.turns[conv.summarized_upto :]]
            mine = self.turn_settings(conv.settings)
            plan = context.plan(
                mine.system_prompt, conv.summary, window, [], "", mine.budget, self.fmt, facts=conv.facts
            )
        except LlmwebError:
            return
        try:
            self.engine.submit(
                GenerationRequest(
                    prompt_ids=plan.ids,
                    max_new_tokens=1,
                    stop_ids=self.fmt.stop_ids,
                    session_id=conv_id,
                    owner=owner,
                    background=True,
                )
            ).result()
        except LlmwebError as e:  # busy, out of memory, shut down: the next turn prefills it itself
            log.info("warming %s after a fold: %s", conv_id, e)

    def recall(self, conv: Conversation, text: str) -> list[Chunk]:
        """Earlier turns of this chat that left the window, when the message is about one of them.

        Only confident matches (RECALL_MIN_SCORE) that bring back details (`facts.detail_terms`:
        names, codes, numbers) or statements about the user (`facts.unkept_statements`) that the
        facts and the summary do not carry: the rest is in the prompt already, verbatim or
        paraphrased, and a recalled passage costs prefill now and a re-prefill of the reply after
        it next turn (`bench ttft`: a scripted chat that returns to its topics recalled ~170
        tokens every turn after the first fold, late/early TTFT 8.9).
        """
        k = self.settings.recall_k
        # covered turns must not take the places of those that are not (a question asked before
        # matches itself best), and a turn's two passages count once: look past the first k
        hits = self.recall_index(conv.id).search(text, k=RECALL_CANDIDATES * k, min_score=RECALL_MIN_SCORE)
        known = facts.vocabulary(" ".join([conv.summary, *(f.text for f in conv.facts)]))
        best: dict[str, Chunk] = {}
        for c in hits:  # best first: a turn's better-matching passage
            best.setdefault(c.doc_id, c)
        return [c for c in best.values() if not _covered(c, known)][:k]

    def recall_index(self, conv_id: str):
        from llmweb.retrieval.index import Index

        with self._jobs_lock:
            index = self._recall.get(conv_id)
            if index is None:
                index = self._recall[conv_id] = Index(
                    self.settings, f"recall-{conv_id}", embedder=self.library.embedder
                )
            return index

    def write_summary(self, previous: str, turns: list[Turn]) -> str:
        """The summary after folding `turns`: `previous` with a paragraph about them appended (the
        cached prefix survives); when that passes the cap, everything merged into half the cap.

        Turns go in batches, oldest first, each sized against the summary as it is by then (every
        paragraph makes the next prompt longer); a summary over its cap is merged before the next
        batch, so every prompt fits."""
        cap = self.summary_cap()
        segment_cap = max(cap // 3, 16)
        limit = self.budget.context_limit - segment_cap
        per_turn = max(limit // 8, 16)  # tokens kept of each side of a turn in the summary prompt
        count = self.fmt.count
        pending = [
            Turn(summary.cap_text(t.user, per_turn, count), summary.cap_text(t.assistant, per_turn, count))
            for t in turns
        ]
        text = previous.strip()
        while pending:
            if count(text) > cap:
                text = self._merge_summary(text, cap)
            n = len(pending)
            while n > 1 and self._summary_prompt_tokens(text, pending[:n], segment_cap) > limit:
                n = max(n // 2, 1)  # the most turns whose prompt fits
            segment = self._generate_summary(
                *summary.segment_request_messages(text, pending[:n], segment_cap), segment_cap
            )
            text = f"{text}\n{segment}".strip() if segment else text
            pending = pending[n:]
        return self._merge_summary(text, cap) if count(text) > cap else text

    def summary_cap(self) -> int:
        return min(self.budget.summary_tokens, self.budget.context_limit // 4)  # room for turns in small contexts

    def _merge_summary(self, text: str, cap: int) -> str:
        """Rare: rewrite the whole summary into half its cap (the cached prefix is lost once)."""
        return self._generate_summary(*summary.summary_request_messages(text, [], cap // 2), cap // 2)

    def _summary_prompt_tokens(self, text: str, batch: list[Turn], cap: int) -> int:
        system, user = summary.segment_request_messages(text, batch, cap)
        return len(render_prompt(self.fmt, system, [("user", user)]))

    def _generate_summary(self, system: str, user: str, cap: int) -> str:
        ids = render_prompt(self.fmt, system, [("user", user)])
        if len(ids) > self.budget.context_limit - cap:
            raise InputError(f"summary prompt of {len(ids)} tokens does not fit the context")
        handle = self.engine.submit(
            GenerationRequest(
                prompt_ids=ids,
                max_new_tokens=cap,
                temperature=0.0,
                repetition_penalty=self.settings.repetition_penalty,
                stop_ids=self.fmt.stop_ids,
                background=True,
            )
        )
        return summary.clean_summary(self.fmt.decode(handle.result()), cap, self.fmt)

    def wait_background(self, conv_id: str | None = None, timeout: float | None = None) -> None:
        with self._jobs_lock:
            jobs = [j for k, j in self._jobs.items() if conv_id is None or k == conv_id]
        for j in jobs:
            j.join(timeout)

    # ---- per-chat settings
    def turn_settings(self, chosen: ChatSettings) -> TurnSettings:
        """What a turn of a chat with these settings runs with: each field the chat sets, else the
        configuration's. Stored settings were checked against the limits when they were set; a
        server restarted with lower limits still caps them here."""
        s = self.settings
        memory = chosen.memory or ("recall" if s.summaries and s.recall else "summary" if s.summaries else "window")
        cap = self.budget.max_new_tokens
        return TurnSettings(
            system_prompt=s.system_prompt if chosen.system_prompt is None else chosen.system_prompt,
            temperature=min(s.temperature if chosen.temperature is None else chosen.temperature, MAX_TEMPERATURE),
            budget=replace(self.budget, max_new_tokens=min(chosen.max_new_tokens or cap, cap)),
            use_docs=True if chosen.use_docs is None else chosen.use_docs,
            summaries=memory != "window" and s.summaries,
            recall=memory == "recall" and s.summaries and s.recall,
        )

    def set_settings(self, owner: str, conv_id: str, chosen: ChatSettings) -> ChatSettings:
        """Store a chat's own settings, after checking them against this server's limits (an
        `InputError` that names the limit, nothing changed). Returns what was stored."""
        s = self.settings
        prompt = chosen.system_prompt
        if prompt is not None:
            prompt = prompt.encode("utf-8", "replace").decode("utf-8")
            prompt = _CONTROL.sub("", prompt).strip()
            if len(prompt) > MAX_SYSTEM_PROMPT_CHARS:
                raise InputError(
                    f"This system prompt has {len(prompt):,} characters; the limit is {MAX_SYSTEM_PROMPT_CHARS:,}."
                )
            room = self.budget.context_limit // 4
            if self.fmt.count(prompt) > room:
                raise InputError(
                    f"This system prompt takes {self.fmt.count(prompt):,} tokens; at most {room:,} (a quarter "
                    "of this server's context) leave room for the chat. Make it shorter."
                )
        if chosen.temperature is not None and not 0 <= chosen.temperature <= MAX_TEMPERATURE:
            raise InputError(f"The temperature must be between 0 and {MAX_TEMPERATURE} (0: the likeliest word).")
        cap = self.budget.max_new_tokens
        if chosen.max_new_tokens is not None and not 1 <= chosen.max_new_tokens <= cap:
            raise InputError(
                f"The reply cap must be between 1 and {cap:,} tokens: this server's limit "
                "(LLMWEB_MAX_NEW_TOKENS, at most half the context)."
            )
        if chosen.memory is not None and chosen.memory not in MEMORY_MODES:
            raise InputError(f"The memory mode must be one of {', '.join(MEMORY_MODES)}.")
        if chosen.memory in ("summary", "recall") and not s.summaries:
            raise InputError("This server keeps no summaries (LLMWEB_SUMMARIES=0): only window memory is available.")
        if chosen.memory == "recall" and not s.recall:
            raise InputError("This server recalls no earlier turns (LLMWEB_RECALL=0): pick window or summary.")
        chosen = replace(chosen, system_prompt=prompt)
        self.store.set_settings(owner, conv_id, chosen)
        return chosen

    # ---- conversations
    def import_json(self, owner: str, text: str) -> str:
        """A new chat of `owner` from an export (`Store.import_json`: a bad file is an InputError and
        stores nothing); its turns already folded into the summary are indexed for recall, as the
        folds that made them did."""
        conv_id = self.store.import_json(owner, text)
        conv = self.store.get(owner, conv_id)
        if conv.summarized_upto and self.library is not None and self.turn_settings(conv.settings).recall:
            folded = conv.turns[: conv.summarized_upto]
            self.recall_index(conv_id).add_chunks(_recall_chunks((t.idx, t.as_turn()) for t in folded))
        return conv_id

    def switch_version(self, owner: str, conv_id: str, fork: int, version: int) -> None:
        """Make another version of the chat (from turn `fork` on) the active one. Its summary and
        facts come back with it (the store keeps them per version); the recall index is brought in
        step here: the other branch's folded turns from `fork` on leave it, this one's come back.
        The KV cache needs nothing: the next prompt shares its prefix up to the fork."""
        self.wait_background(conv_id)  # a fold in flight writes the branch it read
        self.store.switch_version(owner, conv_id, fork, version)
        if self.library is None:
            return
        conv = self.store.get(owner, conv_id)
        index = self.recall_index(conv_id)
        for doc_id in [d.doc_id for d in index.documents()]:
            if doc_id.startswith("turn-") and int(doc_id.removeprefix("turn-")) >= fork:
                index.remove(doc_id)
        if self.turn_settings(conv.settings).recall and conv.summarized_upto > fork:
            index.add_chunks(_recall_chunks((t.idx, t.as_turn()) for t in conv.turns[fork : conv.summarized_upto]))

    def undo(self, owner: str, conv_id: str):
        """Remove the conversation's last turn and return it (`StoredTurn`); refused when it is
        already folded into the summary. The session's KV cache is left as it is: the next prompt
        shares its prefix up to the removed turn, and the runner reuses only the common prefix."""
        self.wait_background(conv_id)  # a fold in flight may be taking the last turn
        return self.store.pop_last_turn(owner, conv_id)

    def delete(self, owner: str, conv_id: str) -> bool:
        """Delete one of the owner's conversations with its recall index and KV cache; False if it
        is not theirs (or already gone), and then nothing else is touched either."""
        if not self.store.delete(owner, conv_id):
            return False
        self._forget(conv_id)
        return True

    def delete_owner(self, owner: str) -> int:
        """Everything the owner stored: conversations, facts, recall indexes, caches, private documents.
        Returns the number of conversations deleted."""
        ids = self.store.delete_owner(owner)
        for conv_id in ids:
            self._forget(conv_id)
        if self.library is not None:
            self.library.delete_owner(owner)
        return len(ids)

    def purge_idle(self, prefixes: tuple[str, ...], idle_s: float, now: float | None = None) -> tuple[int, int]:
        """Delete every owner whose name starts with one of `prefixes` and who was idle `idle_s` or
        longer (the retention of anonymous visitors); (owners, conversations) deleted."""
        owners = [o for prefix in prefixes for o in self.store.idle_owners(prefix, idle_s, now)]
        return len(owners), sum(self.delete_owner(o) for o in owners)

    def _forget(self, conv_id: str) -> None:
        from llmweb.retrieval.index import delete_namespace

        self.engine.drop_session(conv_id)
        with self._jobs_lock:
            self._recall.pop(conv_id, None)
        delete_namespace(self.settings, f"recall-{conv_id}")

    # ---- memory panel
    def add_fact(self, owner: str, conv_id: str, text: str) -> None:
        text = clean_message(text, 300)
        self._check_pins(self.store.facts(owner, conv_id), facts.FactLike(text, True))
        self.store.add_fact(owner, conv_id, text, pinned=True)

    def set_fact_pinned(self, owner: str, conv_id: str, fact_id: int, pinned: bool) -> None:
        if pinned:
            known = self.store.facts(owner, conv_id)
            fact = next((f for f in known if f.id == fact_id), None)
            if fact is not None and not fact.pinned:
                self._check_pins(known, fact)
        self.store.set_fact_pinned(owner, conv_id, fact_id, pinned)

    def _check_pins(self, known, new) -> None:
        """Pinned facts are never left out of a prompt, so together they must stay within their budget."""
        cap = self.budget.facts_tokens
        cost = facts.pinned_cost(known, self.fmt.count) + facts.fact_cost(new, self.fmt.count)
        if cost > cap:
            raise InputError(
                f"Pinned facts would take {cost:,} tokens; their budget is {cap:,} "
                "(LLMWEB_FACTS_TOKENS). Unpin or delete a fact first, or keep this one shorter."
            )

    def delete_fact(self, owner: str, conv_id: str, fact_id: int) -> None:
        self.store.delete_fact(owner, conv_id, fact_id)
