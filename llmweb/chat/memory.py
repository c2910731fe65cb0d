"""A chat's memory after its turns: the rolling summary written by the model, and the background
jobs that fold old turns into it and warm the session's cache for the next turn.

Owns: `Summariser` (the summary prompts, sized so each fits: chat/fold.py's `turns_fitting`; a
summary past its cap merged; engine jobs at background priority), `Folds` (when a turn's
window passes its high-water mark, one job per conversation folds its oldest turns: recall
indexing, grounding and facts through chat/fold.py, then the store, then warming; and the
warm-up of a chat its owner opens) and `Windows` (where each chat's window starts, held while
its turns fit: context.plan's `hold`). ("Memory" here is what the chat remembers; RAM and VRAM
are engine/telemetry.py's.)
It must not plan the turn itself or stream replies: chat/turn.py does that.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from functools import partial
from threading import Event

from llmweb.chat import context, summary
from llmweb.chat.fold import Memory, fold, learn, turns_fitting
from llmweb.chat.recall import RecallCache
from llmweb.chat.settings import TurnSettings, turn_settings
from llmweb.chat.tokens import ChatFormat, render_prompt
from llmweb.config import Settings
from llmweb.engine.request import GenerationRequest, Handle
from llmweb.engine.scheduler import Engine
from llmweb.errors import InputError, LlmwebError
from llmweb.records import PIN, Turn
from llmweb.store.db import Store
from llmweb.store.models import Conversation, NotFound

log = logging.getLogger(__name__)


def log_id(conv_id: str) -> str:
    """What a log line calls a chat: "chat-" and 8 hex digits of its id's SHA-256, never the id itself
    (with the owner's browser token, an id opens the chat; logs are read by more people than that)."""
    return "chat-" + hashlib.sha256(conv_id.encode("utf-8", "surrogatepass")).hexdigest()[:8]


def folded_pins(conv: Conversation) -> tuple[Turn, ...]:
    """The turns its owner keeps in context that are already folded out of the window (context.plan's `pinned`)."""
    return tuple(t.as_turn() for t in conv.turns[: conv.summarized_upto] if t.view == PIN)


def remembered(store: Store, owner: str) -> tuple[str, ...]:
    """What the owner asked all their chats to remember, the items turned on (context.plan's `memory`)."""
    return tuple(m.text for m in store.memories(owner, enabled_only=True))


class Summariser:
    """Writes summaries with the model: `write(previous, turns)`, at most `budget.summary_cap` tokens."""

    def __init__(self, settings: Settings, engine: Engine, fmt: ChatFormat, budget: context.Budget):
        self.settings, self.engine, self.fmt, self.budget = settings, engine, fmt, budget

    def write(self, previous: str, turns: list[Turn], *, owner: str = "") -> str:
        """The summary after folding `turns`: `previous` with a paragraph about them appended (the
        cached prefix survives); when that passes the cap, everything merged into half the cap.
        The engine jobs are `owner`'s (cancelled with their other requests: `Engine.cancel_owner`).

        Turns go in batches, oldest first, each sized against the summary as it is by then (every
        paragraph makes the next prompt longer); a summary over its cap is merged before the next
        batch, so every prompt fits."""
        cap = self.budget.summary_cap
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
                text = self._merge(text, cap, owner)
            n = turns_fitting(self.fmt, text, pending, segment_cap, limit)
            request = summary.segment_request_messages(text, pending[:n], segment_cap)
            segment = self._generate(*request, segment_cap, owner)
            text = f"{text}\n{segment}".strip() if segment else text
            pending = pending[n:]
        return self._merge(text, cap, owner) if count(text) > cap else text

    def _merge(self, text: str, cap: int, owner: str) -> str:
        """Rare: rewrite the whole summary into half its cap (the cached prefix is lost once)."""
        return self._generate(*summary.summary_request_messages(text, [], cap // 2), cap // 2, owner)

    def _generate(self, system: str, user: str, cap: int, owner: str) -> str:
        ids = render_prompt(self.fmt, system, [("user", user)])
        if len(ids) > self.budget.context_limit - cap:
            raise InputError(f"summary prompt of {len(ids)} tokens does not fit the context")
        handle = self.engine.submit(
            GenerationRequest(
                prompt_ids=ids,
                max_new_tokens=cap,
                temperature=0.0,
                repetition_penalty=self.settings.repetition_penalty,
                loop_guard=self.settings.loop_guard,
                stop_ids=self.fmt.stop_ids,
                background=True,
                owner=owner,
            )
        )
        return summary.clean_summary(self.fmt.decode(handle.result()), cap, self.fmt)


class Windows:
    """Where each chat's last prompt started its history (a turn's index in the chat), so the next
    prompt starts there while the turns from there fit (context.plan's `hold`): a window that
    passed its room moves in one step, and the prompts until the next step share their prefix.
    In memory, for the newest MAX_CHATS chats; a restart forgets them, and the first prompt after
    it plans afresh (its KV cache is cold then anyway)."""

    MAX_CHATS = 4096

    def __init__(self) -> None:
        self._starts: OrderedDict[str, int] = OrderedDict()
        self._lock = threading.Lock()

    def hold(self, conv_id: str, first: int) -> int:
        """Where the window of `conv_id` starts among the turns from `first` (those not folded) on."""
        with self._lock:
            return max(self._starts.get(conv_id, first) - first, 0)

    def forget(self, conv_id: str) -> None:
        with self._lock:
            self._starts.pop(conv_id, None)

    def note(self, conv_id: str, start: int) -> None:
        with self._lock:
            self._starts[conv_id] = start
            self._starts.move_to_end(conv_id)
            while len(self._starts) > self.MAX_CHATS:
                self._starts.popitem(last=False)


class FoldJob(threading.Thread):
    """A fold in flight: its thread, whose chat it folds, and the flag that stops it before its next
    write (`Folds.stop`: "Delete all my data"). `fold` is called with `args`, then the flag."""

    def __init__(self, fold: Callable[..., None], owner: str, conv_id: str, args: tuple):
        self.owner = owner
        self.stopped = threading.Event()
        super().__init__(target=fold, name=f"summary-{conv_id[:8]}", args=(owner, conv_id, *args, self.stopped))
        self.daemon = True


class Folds:
    """The background fold of each conversation, at most one at a time per conversation."""

    def __init__(
        self,
        settings: Settings,
        engine: Engine,
        fmt: ChatFormat,
        store: Store,
        budget: context.Budget,
        recalls: RecallCache,
        windows: Windows | None = None,
    ):
        self.settings, self.engine, self.fmt, self.store, self.budget = settings, engine, fmt, store, budget
        self.recalls = recalls
        self.windows = windows or Windows()
        self.summariser = Summariser(settings, engine, fmt, budget)
        self._jobs: dict[str, FoldJob] = {}
        self._warming: dict[str, Handle | None] = {}  # per owner: the warm-up of a chat it opened, in flight
        self._lock = threading.Lock()

    def after_turn(self, conv: Conversation, new: Turn, plan: context.ContextPlan, mine: TurnSettings) -> None:
        """Start a fold when the window passed its high-water mark. `conv` as it was before this
        turn, and the turn just stored: no second read of the store."""
        if not mine.summaries:
            return  # window only: old turns are left out (and reported), never folded
        window = [t.as_turn() for t in conv.turns[conv.summarized_upto :]] + [new]
        # a pinned turn has room of its own and one left out takes none: folding them frees nothing
        counts = [0 if t.view else context.turn_tokens(self.fmt, t) for t in window]
        # the room history has apart from this turn's retrieved text, which comes and goes: folding
        # against it keeps compressions rare (and the prompt prefix, so the KV cache, stable)
        room = plan.history_room + plan.sections["retrieved"] + plan.sections["recall"]
        n = summary.turns_to_fold(counts, room, self.settings.history_high, self.settings.history_low)
        if n <= 0:
            return
        with self._lock:
            job = self._jobs.get(conv.id)
            if job is not None and job.is_alive():
                return
            for done in [k for k, j in self._jobs.items() if not j.is_alive()]:  # only folds in flight are kept
                del self._jobs[done]
            job = FoldJob(
                self._fold, conv.owner, conv.id, (conv.summary, window[:n], conv.summarized_upto, mine.recall)
            )
            self._jobs[conv.id] = job
        job.start()

    def wait(self, conv_id: str | None = None, timeout: float | None = None) -> None:
        """Until the folds in flight (of one conversation, or all) are done."""
        with self._lock:
            jobs = [j for k, j in self._jobs.items() if conv_id is None or k == conv_id]
        for j in jobs:
            j.join(timeout)

    def stop(self, owner: str) -> list[FoldJob]:
        """Flag the owner's folds in flight to write nothing more ("Delete all my data"; the caller
        cancels their engine jobs and waits for them); they are returned."""
        with self._lock:
            jobs = [j for j in self._jobs.values() if j.owner == owner and j.is_alive()]
        for j in jobs:
            j.stopped.set()
        return jobs

    def _fold(
        self, owner: str, conv_id: str, previous: str, turns: list[Turn], first: int, recall: bool, stop: Event
    ) -> None:
        """Fold turns out of the window (`turns` are turn indices first, first + 1, ...): index them for
        recall, keep the user's facts, summarise. Every write passes the owner's generation read with
        the chat (the store refuses it after a "Delete all my data": `Deleted`), and none is made
        once `stop` is set."""
        try:
            conv = self.store.get(owner, conv_id)
            if conv.summarized_upto != first:
                return  # an earlier fold finished after this turn read the chat; the next turn decides again
            generation = conv.generation
            # their owner's say as it is now: a turn kept in context or left out is not summarised,
            # learned from or recalled (a pinned one stays in the prompt as it is: chat/context.py)
            views = {t.idx: t.view for t in conv.turns}
            taken = [(i, t) for i, t in enumerate(turns, first) if not views.get(i, t.view)]

            def alive() -> bool:  # the recall index writes its folder only while this holds
                return not stop.is_set() and self.store.alive(owner, conv_id, generation)

            if recall and self.recalls.library is not None:
                self.recalls.add(conv_id, iter(taken), alive=alive)
            known = Memory(previous, tuple(self.store.facts(owner, conv_id)))
            try:
                said = [t for _, t in taken]
                folded = fold(known, said, partial(self.summariser.write, owner=owner), name=log_id(conv_id))
            except LlmwebError as e:  # the window still moves on: facts and recall keep what matters
                if stop.is_set():
                    return
                log.warning("summary for %s failed (%s); keeping the previous summary", log_id(conv_id), e)
                folded = learn(known, [t for _, t in taken])
            for fact in folded.facts[len(known.facts) :]:
                if stop.is_set():
                    return
                self.store.add_fact(owner, conv_id, fact.text, pinned=False, generation=generation)
            if not stop.is_set():
                self.store.set_summary(owner, conv_id, folded.summary, first + len(turns), generation=generation)
                self._warm(owner, conv_id)
        except NotFound:  # deleted meanwhile (`Deleted` too): nothing of it is left to fold
            log.info("folding turns for %s: the chat was deleted", log_id(conv_id))
        except Exception:  # the turn already streamed; a failed fold is tried again next turn
            log.exception("folding turns for %s failed", log_id(conv_id))

    def _warm(self, owner: str, conv_id: str) -> None:
        """Prefill the folded prompt's prefix now, in the background, into the session's KV cache.

        A fold moves the window, so every token after the summary sits at a new position and the
        cached prefix ends there: the next turn would prefill the whole window (~1,000 tokens at
        context 2048) before its first token. The fold waits for it (`warm_request`). Planning
        never fails the fold: a conversation gone or not fitting just is not warmed.
        """
        request = self.warm_request(owner, conv_id)
        if request is None:
            return
        try:
            self.engine.submit(request).result()
        except LlmwebError as e:  # busy, out of memory, shut down: the next turn prefills it itself
            log.info("warming %s after a fold: %s", log_id(conv_id), e)

    def warm(self, owner: str, conv_id: str) -> bool:
        """A chat just opened (picked in the list or found; an import is not warmed): prefill its
        next prompt into its KV cache in the background, so the message its owner types meanwhile
        prefills only itself. Not while the chat's fold runs (the fold warms it after), and one per owner at a
        time: a visitor clicking through their chats keeps at most one prefill of theirs in flight.
        The engine drops it when busy or over the warm-up limits (LLMWEB_WARMUPS_PER_MIN,
        LLMWEB_WARMUPS_PER_USER_MIN). Returns whether one was submitted; it is not waited for."""
        with self._lock:
            for done in [k for k, h in self._warming.items() if h and (h.stats is not None or h.error is not None)]:
                del self._warming[done]
            fold = self._jobs.get(conv_id)
            if owner in self._warming or (fold is not None and fold.is_alive()):
                return False
            self._warming[owner] = None  # taken while it is planned and submitted
        handle = None
        try:
            request = self.warm_request(owner, conv_id)
            handle = self.engine.submit(request) if request is not None else None
        except LlmwebError as e:  # busy or over the limits: the next turn prefills it itself
            log.info("warming %s as it opened: %s", log_id(conv_id), e)
        finally:
            with self._lock:
                if handle is None:
                    del self._warming[owner]
                else:
                    self._warming[owner] = handle
        return handle is not None

    def warm_request(self, owner: str, conv_id: str) -> GenerationRequest | None:
        """The background request that prefills the chat's next prompt up to its user text: planned
        as a turn is (chat/session.py's `_prompt`, its window's start held and noted) with an empty
        message and no retrieved text; the engine keeps it as the session's cache (one token is
        generated and dropped). None where there is nothing to warm: KV reuse off, no turns, the
        chat gone or not fitting."""
        if not self.settings.kv_reuse:
            return None
        try:
            conv = self.store.get(owner, conv_id)
            if not conv.turns:
                return None
            window = [t.as_turn() for t in conv.turns[conv.summarized_upto :]]
            mine = turn_settings(self.settings, self.budget, conv.settings)
            plan = context.plan(
                mine.system_prompt,
                conv.summary if mine.summaries else "",
                window,
                [],
                "",
                mine.budget,
                self.fmt,
                facts=conv.facts,
                hold=self.windows.hold(conv_id, conv.summarized_upto),
                low=self.settings.history_low,
                folded_pins=folded_pins(conv),
                memory=remembered(self.store, owner),
            )
        except LlmwebError:
            return None
        self.windows.note(conv_id, conv.summarized_upto + plan.window_start)
        return GenerationRequest(
            prompt_ids=plan.ids,
            max_new_tokens=1,
            stop_ids=self.fmt.stop_ids,
            session_id=conv_id,
            owner=owner,
            background=True,
            optional=True,  # dropped when the engine is busy, pre-empted by a visitor's request
        )
