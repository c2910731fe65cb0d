"""The chat turn, UI-agnostic: retrieve → plan → generate → record → compress.

`Chat.send(conv_id, text)` yields `Queued`, then `Delta` (the reply so far) as tokens stream,
then one `Finished` with the reply, its `TurnStats` and its sources. The UI, the API endpoint,
`replay` and the benchmarks all call this one path. Closing the generator early (stop button,
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
from dataclasses import dataclass, field, replace
from typing import Iterator

from . import context, memory, summary
from .config import Settings
from .engine import Engine, GenerationRequest, Tokens, Waiting
from .errors import ConfigError, InputError, LlmwebError
from .records import Chunk, Turn
from .store import Store
from .telemetry import TurnStats
from .tokens import ChatFormat, render_prompt

log = logging.getLogger(__name__)

_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")


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
    sources: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    prompt: tuple[tuple[str, str], ...] = ()  # the planned messages (role, text), system first

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
        raise InputError(f"Your message is {len(text):,} characters; the limit is {max_chars:,}. "
                         "Attach long text as a document instead, and ask about it.")
    return text


def reduced_budget(b: context.Budget) -> context.Budget:
    """The budget for the one retry after an OOM: two thirds of the context, half the reply and documents."""
    limit = max(b.context_limit * 2 // 3, 2)
    return replace(b, context_limit=limit, max_new_tokens=max(min(b.max_new_tokens // 2, limit // 2), 1),
                   retrieved_tokens=b.retrieved_tokens // 2)


def source_dicts(chunks, start: int = 1) -> list[dict]:
    out = []
    for i, c in enumerate(chunks, start):
        snippet = " ".join(c.text.split())
        out.append({"n": i, "source": c.source, "page": c.page, "heading": c.heading,
                    "score": round(float(c.score), 3), "kind": c.kind,
                    "snippet": snippet[:240] + ("…" if len(snippet) > 240 else "")})
    return out


class Chat:
    def __init__(self, settings: Settings, engine: Engine, fmt: ChatFormat, store: Store,
                 budget: context.Budget, library=None):
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
    def send(self, conv_id: str, text: str, *, use_docs: bool = True, seed: int | None = None,
             wait_summary: bool = False) -> Iterator[Queued | Delta | Finished]:
        s = self.settings
        text = clean_message(text, s.max_message_chars)
        conv = self.store.get(conv_id)
        window = [t.as_turn() for t in conv.turns[conv.summarized_upto:]]

        # 1) retrieve: documents, and earlier turns of this chat that left the window
        chunks: list[Chunk] = []
        if use_docs and self.library is not None and len(self.library) > 0:
            chunks = self.library.search(text, k=s.top_k, min_score=s.min_score)
        recall: list[Chunk] = []
        if s.recall and conv.summarized_upto > 0 and self.library is not None:
            recall = self.recall_index(conv_id).search(text, k=s.recall_k, min_score=s.min_score)
        mem = self.memory_text(conv)

        # 2) plan (raises InputError with the numbers when the message cannot fit)
        plan = context.plan(s.system_prompt, mem, window, chunks, text, self.budget, self.fmt, recall=recall)

        # 3) generate, with a smaller plan ready for an OOM retry
        def smaller() -> GenerationRequest | None:
            reduced = reduced_budget(self.budget)
            try:
                p = context.plan(s.system_prompt, mem, window, chunks[: len(chunks) // 2], text, reduced,
                                 self.fmt, recall=recall[: len(recall) // 2])
            except (InputError, ConfigError):
                return None
            return replace(request, prompt_ids=p.ids, max_new_tokens=reduced.max_new_tokens, fallback=None)

        request = GenerationRequest(
            prompt_ids=plan.ids, max_new_tokens=self.budget.max_new_tokens, temperature=s.temperature,
            top_p=s.top_p, repetition_penalty=s.repetition_penalty, seed=seed, stop_ids=self.fmt.stop_ids,
            session_id=conv_id, timeout_s=s.request_timeout_s, fallback=smaller)
        handle = self.engine.submit(request)
        reply, finished = "", False
        sources = source_dicts(plan.chunks) + source_dicts(plan.recall, start=len(plan.chunks) + 1)
        try:
            for event in handle.events():
                if isinstance(event, Waiting):
                    yield Queued(event.position)
                elif isinstance(event, Tokens):
                    reply = self.fmt.decode(handle.generated)
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
                    stats = self._stats(handle.stats, plan, conv) if handle.stats else None
                    self._record(conv_id, text, self.fmt.decode(handle.generated).strip(), stats, plan, sources)
        reply = self.fmt.decode(handle.generated).strip()
        stats = self._stats(handle.stats, plan, conv)

        # 4) record
        self._record(conv_id, text, reply, stats, plan, sources)
        notes = []
        if handle.stats.finish_reason == "cancelled":
            notes.append("Stopped.")
        if plan.left_out:
            notes.append(plan.left_out.capitalize() + ".")

        # 5) compress
        self._maybe_compress(conv_id, plan)
        if wait_summary:
            self.wait_background(conv_id)
        yield Finished(reply, stats, sources, notes, plan.messages)

    def _stats(self, gen, plan, conv) -> TurnStats:
        return TurnStats(turn=len(conv.turns) + 1, gen=gen, sections=dict(plan.sections),
                         context_limit=plan.context_limit, dropped_turns=plan.dropped_turns,
                         summarized_turns=conv.summarized_upto, summary_tokens=plan.summary_tokens,
                         dropped_chunks=len(plan.dropped_chunks))

    def _record(self, conv_id, text, reply, stats, plan, sources) -> None:
        d = stats.to_dict() if stats is not None else {
            "turn": len(self.store.get(conv_id).turns) + 1, "finish_reason": "cancelled",
            "prompt_tokens": len(plan.ids), "sections": dict(plan.sections), "context_limit": plan.context_limit}
        self.store.add_turn(conv_id, text, reply, d, sources)

    # ---- compression
    def _maybe_compress(self, conv_id: str, plan) -> None:
        if not self.settings.summaries:
            return  # window only: old turns are left out (and reported), never folded
        conv = self.store.get(conv_id)
        window = conv.turns[conv.summarized_upto:]
        counts = [context.turn_tokens(self.fmt, t.as_turn()) for t in window]
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
            job = threading.Thread(target=self._fold, name=f"summary-{conv_id[:8]}",
                                   args=(conv_id, conv.summary, window[:n], conv.summarized_upto + n), daemon=True)
            self._jobs[conv_id] = job
        job.start()

    def _fold(self, conv_id: str, previous: str, folded, upto: int) -> None:
        """Fold turns out of the window: index them for recall, keep the user's facts, summarise."""
        try:
            turns = [t.as_turn() for t in folded]
            if self.settings.recall and self.library is not None:
                self.recall_index(conv_id).add_chunks([
                    Chunk(text=f"User: {t.user}\nAssistant: {t.assistant}", source=f"turn {st.idx + 1}",
                          doc_id=f"turn-{st.idx}", kind="recall") for st, t in zip(folded, turns)])
            source = previous + "\n" + "\n".join(f"{t.user}\n{t.assistant}" for t in turns)
            try:
                grounded = memory.ground(self.write_summary(previous, turns), source)
                if grounded.dropped:
                    log.info("summary for %s: dropped %d ungrounded sentences: %s", conv_id,
                             len(grounded.dropped), grounded.dropped)
                new = grounded.text
            except LlmwebError as e:  # the window still moves on: facts and recall keep what matters
                log.warning("summary for %s failed (%s); keeping the previous summary", conv_id, e)
                new = previous
            known = {" ".join(f.text.lower().split()) for f in self.store.facts(conv_id)}
            for fact in memory.extract_facts(t.user for t in turns):
                if " ".join(fact.lower().split()) not in known:
                    self.store.add_fact(conv_id, fact, pinned=False)
            self.store.set_summary(conv_id, new, upto)
            self.engine.drop_session(conv_id)  # the prefix changed: the old cache is no longer useful
        except Exception:  # the turn already streamed; a failed fold is tried again next turn
            log.exception("folding turns for %s failed", conv_id)

    def memory_text(self, conv) -> str:
        """The summary and the facts that fit their cap, as placed after the system prompt."""
        facts = memory.select_facts(conv.facts, self.settings.facts_tokens, self.fmt.count)
        return memory.memory_text(conv.summary, facts)

    def recall_index(self, conv_id: str):
        from .retrieval import Index

        with self._jobs_lock:
            index = self._recall.get(conv_id)
            if index is None:
                index = self._recall[conv_id] = Index(self.settings, f"recall-{conv_id}", embedder=self.library.embedder)
            return index

    def write_summary(self, previous: str, turns: list[Turn]) -> str:
        """Ask the model (low-priority jobs) for an updated summary of `turns`.

        Turns are folded in batches whose prompt fits the context (long turns are shortened
        first), each batch updating the summary of the ones before.
        """
        cap = min(self.settings.summary_tokens, self.budget.context_limit // 4)  # room for turns in small contexts
        limit = self.budget.context_limit - cap
        per_turn = max(limit // 8, 16)  # tokens kept of each side of a turn in the summary prompt
        short = [Turn(summary.cap_text(t.user, per_turn, self.fmt.count),
                      summary.cap_text(t.assistant, per_turn, self.fmt.count)) for t in turns]
        text = previous
        while short:
            n = len(short)
            while True:  # the most turns, oldest first, whose summary prompt fits
                system, user = summary.summary_request_messages(text, short[:n], cap)
                ids = render_prompt(self.fmt, system, [("user", user)])
                if len(ids) <= limit or n == 1:
                    break
                n = max(n // 2, 1)
            if len(ids) > limit:
                raise InputError(f"summary prompt of {len(ids)} tokens does not fit the context")
            handle = self.engine.submit(GenerationRequest(
                prompt_ids=ids, max_new_tokens=cap, temperature=0.0,
                repetition_penalty=self.settings.repetition_penalty, stop_ids=self.fmt.stop_ids, background=True))
            text = summary.clean_summary(self.fmt.decode(handle.result()), cap, self.fmt)
            short = short[n:]
        return text

    def wait_background(self, conv_id: str | None = None, timeout: float | None = None) -> None:
        with self._jobs_lock:
            jobs = [j for k, j in self._jobs.items() if conv_id is None or k == conv_id]
        for j in jobs:
            j.join(timeout)

    # ---- conversations
    def delete(self, conv_id: str) -> None:
        from .retrieval import delete_namespace

        self.engine.drop_session(conv_id)
        self.store.delete(conv_id)
        with self._jobs_lock:
            self._recall.pop(conv_id, None)
        delete_namespace(self.settings, f"recall-{conv_id}")

    # ---- memory panel
    def add_fact(self, conv_id: str, text: str) -> None:
        text = clean_message(text, 300)
        self.store.add_fact(conv_id, text, pinned=True)

    def set_fact_pinned(self, fact_id: int, pinned: bool) -> None:
        self.store.set_fact_pinned(fact_id, pinned)

    def delete_fact(self, fact_id: int) -> None:
        self.store.delete_fact(fact_id)
