"""The stateful chat, UI-agnostic: retrieve → plan → generate → record → compress.

`Chat.send(owner, conv_id, text)` yields `Started(conv_id)`, `Queued` while it waits, then
`Delta` (the reply so far) as tokens stream, then one `Finished` with the reply, its `TurnStats`
and its sources (the events and the run are chat/turn.py's, shared with the stateless path).
`regenerate`, `continue_reply` and `edit` are the same turn over another snapshot of the chat.
Every call names the OWNER it acts for (store/db.py: every read is scoped to it);
`conv_id=None` starts a new conversation, which the store creates with its first turn. The UI, the
API endpoint, `replay` and the benchmarks all call these; `Chat.ask()` runs `send` to the end and
returns the `Finished`. Closing the generator early (stop button, client gone) cancels the engine
request; a partial reply is still stored, marked as stopped.

Compression runs after the reply (chat/memory.py): when the window's history passes its
high-water mark, the oldest turns are folded into the rolling summary by a background engine job,
so the prompt prefix changes rarely (and the session KV cache is dropped only then). Recall's
indexes are chat/recall.py's, the per-chat settings and their checks chat/settings.py's.

Races: edit, regenerate and continue read the chat once its fold in flight is done (`_settled`);
undo and a version switch wait for it too. Every write of a turn passes the owner's generation read
with the chat, so a reply that outlives "Delete all my data" stores nothing (`Deleted`);
`delete_owner` first stops the owner's folds and cancels their engine requests.
It must not turn domain errors into messages (the web layer and the CLI do).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace

from llmweb.chat import context, facts, scope
from llmweb.chat.carry import Carry
from llmweb.chat.document_task import DocumentTasks
from llmweb.chat.memory import Folds, Windows, folded_pins, remembered
from llmweb.chat.recall import RecallCache
from llmweb.chat.settings import TurnSettings, check_pins, checked, clean_message, turn_settings
from llmweb.chat.tokens import ChatFormat
from llmweb.chat.turn import (
    NO_CHOSEN_DOCUMENTS,
    Cancel,
    Delta,
    Event,
    Finished,
    Job,
    Progress,
    Prompt,
    Queued,
    Sampling,
    Started,
    TurnRunner,
    documents,
    finish,
    plan_sources,
)
from llmweb.config import Settings
from llmweb.engine.scheduler import Engine
from llmweb.errors import InputError
from llmweb.records import Source, Turn, TurnStats
from llmweb.store.db import Store
from llmweb.store.models import DEFAULT_TITLE, ChatSettings, Conversation, StoredTurn, new_id

# the events and the message check, for the chat's callers
__all__ = ["Chat", "Delta", "Finished", "Progress", "Queued", "Started", "clean_message", "reply_prefix_ids"]

# Regenerate must give a new reply: with greedy decoding (LLMWEB_TEMPERATURE=0, the default) it
# samples at this temperature instead, with a fresh seed.
REGENERATE_TEMPERATURE = 0.7
# "Delete all my data" waits this long for the owner's folds in flight to stop (a fold's summary job is
# cancelled; its recall embedding runs to the end). Past it, the store's generation check still holds.
STOP_WAIT_S = 30.0

Record = Callable[[str, TurnStats, list[Source]], None]  # (reply, stats, sources) into the store


@dataclass(frozen=True, slots=True)
class _How:
    """How a caller runs a turn, beside what it asks: `send`'s keyword arguments."""

    use_docs: bool | None = None  # None: the chat's own setting
    seed: int | None = None
    wait_summary: bool = False
    sampling: Sampling | None = None
    stop: tuple[str, ...] = ()
    cancel: Cancel | None = None
    documents: tuple[str, ...] | None = None  # the documents this turn reads, by name or id; None: the chat's


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


class Chat:
    def __init__(
        self, settings: Settings, engine: Engine, fmt: ChatFormat, store: Store, budget: context.Budget, library=None
    ):
        self.settings, self.engine, self.fmt, self.store, self.budget = settings, engine, fmt, store, budget
        self.library = library
        self.runner = TurnRunner(settings, engine, fmt)
        self.recalls = RecallCache(settings, library)
        self.windows = Windows()  # where each chat's window starts (context.plan's `hold`)
        self.folds = Folds(settings, engine, fmt, store, budget, self.recalls, self.windows)
        self.documents = DocumentTasks(settings, engine, fmt, store, budget, library)
        self.pins, self.carry = Pins(store, budget, fmt), Carry(self.folds)  # the facts panel; "Continue in a new chat"

    # ---- the turn, over four snapshots of the chat
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
        sampling: Sampling | None = None,
        stop: Sequence[str] = (),
        cancel: Cancel | None = None,
        whole_document: bool = False,
        documents: Sequence[str] | None = None,
    ) -> Iterator[Event]:
        """One turn. `conv_id=None` starts a conversation with an id made here; `new=True` starts one
        with `conv_id`, which the caller must have made with `store.new_id()` (never a client's).
        The chat's own settings (`ChatSettings`: system prompt, temperature, reply cap, documents,
        memory mode) apply over the configuration's; `use_docs` None follows the chat's.
        `sampling` (an API request's temperature, top_p, max_tokens) applies over those; a reply
        that shows one of `stop` is cancelled there; `cancel` stops it from another thread. A message
        that asks for a whole-document task (or any, with `whole_document`) reads the whole document
        instead (chat/document_task.py). `documents` (names or ids) are the documents this turn
        reads instead of the chat's own choice (`ChatSettings.documents`); [] reads none."""
        how = _How(use_docs, seed, wait_summary, sampling, tuple(stop), cancel, _names(documents))
        text = clean_message(text, self.settings.max_message_chars)
        new = new or conv_id is None
        # read once: the whole turn plans from this snapshot (NotFound for another owner's id)
        conv = (
            self.store.get(owner, conv_id)
            if conv_id is not None and not new
            else Conversation(
                conv_id or new_id(), DEFAULT_TITLE, "", 0, [], owner=owner, generation=self.store.generation(owner)
            )
        )

        self.store.room(owner, chats=int(new), size=len(text.encode("utf-8", "surrogatepass")))  # at a cap: now

        def record(reply: str, stats: TurnStats, sources: list[Source]) -> None:  # Deleted after "Delete all my data"
            self.store.add_turn(owner, conv.id, text, reply, stats, sources, create=new, generation=conv.generation)

        only = scope.turn_scope(self.library, conv, how.documents)  # an unknown name: InputError, now
        if whole_document or use_docs is not False:
            intent = self.documents.detect(owner, text, force=whole_document, only=only)
            if intent is not None:
                yield from self.documents.answer(conv, intent, record, cancel)
                return
        yield from self._answer(conv, text, record, how)

    def regenerate(
        self, owner: str, conv_id: str | None, *, use_docs: bool | None = None, seed: int | None = None
    ) -> Iterator[Event]:
        """Answer the conversation's last message again and replace that turn's reply, planned as
        if the turn had not been there; refused when the turn is already folded into the summary.
        The session's KV cache needs nothing: the runner reuses only the longest common prefix of
        the new prompt with what it cached."""
        conv, text, record, _ = self._without_last(owner, conv_id)
        yield from self._answer(conv, text, record, _How(use_docs, seed), regenerate=True)

    def continue_reply(
        self, owner: str, conv_id: str | None, *, use_docs: bool | None = None, seed: int | None = None
    ) -> Iterator[Event]:
        """Regenerate for a reply cut by the length cap or stopped, except that the prompt ends with
        that reply so far, and the reply grows from it."""
        conv, text, record, last = self._without_last(owner, conv_id, cut_short=True)
        partial = tuple(reply_prefix_ids(self.fmt, last.assistant))
        yield from self._answer(conv, text, record, _How(use_docs, seed), partial=partial)

    def edit(
        self, owner: str, conv_id: str | None, turn: int, text: str, *, use_docs: bool | None = None
    ) -> Iterator[Event]:
        """Send `text` in place of turn `turn`'s message: the reply is planned from the turns before
        it only (the session's KV cache reuses that prefix), and the turn is stored as a new
        version of the chat from there on (`Store.edit_turn`: the old turns stay, as another
        version). Refused when the turn is already folded into the summary."""
        text = clean_message(text, self.settings.max_message_chars)
        conv = self._settled(owner, conv_id) if conv_id is not None else None
        if conv is None or not 0 <= turn < len(conv.turns):
            raise InputError("That message is no longer in this chat: reload it and try again.")
        if turn < conv.summarized_upto:
            raise InputError("That message is already folded into this chat's summary, so it can no longer be edited.")
        conv = replace(conv, turns=conv.turns[:turn])

        def record(reply: str, stats: TurnStats, sources: list[Source]) -> None:
            self.store.edit_turn(owner, conv.id, turn, text, reply, stats, sources, generation=conv.generation)

        yield from self._answer(conv, text, record, _How(use_docs))

    def ask(self, owner: str, conv_id: str | None, text: str, **kw) -> Finished:
        """Run one turn to the end (replay, benchmarks, tests): the `Finished` event of `send`."""
        return finish(self.send(owner, conv_id, text, **kw))

    def _without_last(
        self, owner: str, conv_id: str | None, cut_short: bool = False
    ) -> tuple[Conversation, str, Record, StoredTurn]:
        """To answer the last turn again: the chat without it, its message, how the new reply
        replaces the old one, and the turn. `cut_short`: only a reply cut by the cap or stopped."""
        if conv_id is None:
            raise InputError("There is no reply to regenerate or continue yet.")
        conv = self._settled(owner, conv_id)
        last = self.store.last_turn(owner, conv_id)
        if cut_short and (last.stats is None or last.stats.gen.finish_reason not in ("length", "cancelled")):
            raise InputError("The last reply is complete: only a reply cut short or stopped can be continued.")
        text = clean_message(last.user, self.settings.max_message_chars)

        def record(reply: str, stats: TurnStats, sources: list[Source]) -> None:
            g = conv.generation
            self.store.replace_last_reply(owner, conv.id, last.idx, reply, stats, sources, generation=g)

        return replace(conv, turns=[t for t in conv.turns if t.idx < last.idx]), text, record, last

    def _answer(
        self,
        conv: Conversation,
        text: str,
        record: Record,
        how: _How,
        *,
        regenerate: bool = False,
        partial: tuple[int, ...] | None = None,
    ) -> Iterator[Event]:
        """The turn over the snapshot `conv` (its turns are those before this one): plan, run, record, compress."""
        mine = self.turn_settings(conv.settings)  # this chat's settings over the configuration's
        budget = mine.budget if partial is None else mine.budget.continuing(len(partial))
        use_docs = mine.use_docs if how.use_docs is None else how.use_docs
        only = scope.turn_scope(self.library, conv, how.documents)
        gone = use_docs and how.documents is None and conv.settings.documents is not None and not only
        prompt = self._prompt(conv, text, mine, use_docs, only)
        prompt = _told(prompt, how.sampling)
        plan = prompt.plan(budget, self.fmt)  # InputError with the numbers when the message cannot fit
        self.windows.note(conv.id, conv.summarized_upto + plan.window_start)
        job = Job(
            owner=conv.owner,
            conv_id=conv.id,
            session_id=conv.id,
            prompt=prompt,
            plan=plan,
            budget=budget,
            temperature=mine.temperature or (REGENERATE_TEMPERATURE if regenerate else 0.0),
            number=len(conv.turns) + 1,
            summarized=conv.summarized_upto,
            seed=how.seed,
            partial=partial,
            loop_guard=mine.loop_guard,
            notes=(NO_CHOSEN_DOCUMENTS,) if gone else (),
        )
        sources = plan_sources(plan)

        def keep(reply: str, stats: TurnStats) -> None:  # a partial reply, closed early or failed
            record(reply, stats, sources)

        fin = yield from self.runner.run(job, sampling=how.sampling, stop=how.stop, cancel=how.cancel, keep=keep)
        record(fin.reply, fin.stats, sources)
        self.folds.after_turn(conv, Turn(text, fin.reply), plan, mine)
        if how.wait_summary:
            self.wait_background(conv.id)
        yield fin

    def _prompt(
        self, conv: Conversation, text: str, mine: TurnSettings, use_docs: bool, only: frozenset[str] | None
    ) -> Prompt:
        """Retrieve (documents: shared and the owner's own, or the chat's chosen ones; earlier turns
        that left the window) and gather what the prompt is planned from."""
        chunks = documents(self.library, self.settings, conv.owner, text, use_docs, only)
        recalling = mine.recall and conv.summarized_upto > 0 and self.library is not None
        recall = self.recalls.recall(conv, text) if recalling else []
        return Prompt(
            system=mine.system_prompt,
            # window only: the summary of an earlier mode stays stored, but is no longer in the prompt
            summary=conv.summary if mine.summaries else "",
            turns=tuple(t.as_turn() for t in conv.turns[conv.summarized_upto :]),
            pinned=folded_pins(conv),
            memory=remembered(self.store, conv.owner),
            chunks=chunks,
            user=text,
            recall=tuple(recall),
            facts=tuple(conv.facts),
            hold=self.windows.hold(conv.id, conv.summarized_upto),
            low=self.settings.history_low,
        )

    def warm(self, owner: str, conv_id: str) -> bool:
        """The owner opened this chat: prefill its next prompt in the background (chat/memory.py's
        `Folds.warm`); whether one was submitted. Another owner's chat id warms nothing."""
        return self.folds.warm(owner, conv_id)

    def wait_background(self, conv_id: str | None = None, timeout: float | None = None) -> None:
        self.folds.wait(conv_id, timeout)  # the folds in flight (of one chat, or all)

    def _settled(self, owner: str, conv_id: str) -> Conversation:
        """The chat read once its fold in flight is done: edit, regenerate and continue plan from
        it (a fold may be taking the turn they change: its summary, facts and recall would keep
        the old text), as undo and a version switch wait before they change it."""
        self.wait_background(conv_id)
        return self.store.get(owner, conv_id)

    # ---- per-chat settings (chat/settings.py)
    def turn_settings(self, chosen: ChatSettings) -> TurnSettings:
        return turn_settings(self.settings, self.budget, chosen)

    def set_settings(self, owner: str, conv_id: str, chosen: ChatSettings) -> ChatSettings:
        """Store a chat's own settings, after checking them against this server's limits (an
        `InputError` that names the limit, nothing changed). Returns what was stored."""
        chosen = checked(self.settings, self.budget, self.fmt, chosen)
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
            folded = ((t.idx, t.as_turn()) for t in conv.turns[: conv.summarized_upto])
            self.recalls.add(conv_id, folded, alive=self._alive(conv))
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
        folded = conv.turns[fork : conv.summarized_upto] if self.turn_settings(conv.settings).recall else []
        self.recalls.follow(conv_id, fork, ((t.idx, t.as_turn()) for t in folded), alive=self._alive(conv))

    def set_view(self, owner: str, conv_id: str, views: Sequence[tuple[int, str]]) -> None:
        """Each (turn, view): keep it in context (PIN), leave it out (OUT) or neither; all or none."""
        self.wait_background(conv_id)
        self.store.set_turn_views(owner, conv_id, views)

    def undo(self, owner: str, conv_id: str):
        """Remove the conversation's last turn and return it (`StoredTurn`); refused when it is folded
        into the summary. The KV cache stays: the runner reuses only the next prompt's common prefix."""
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
        Returns the number of conversations deleted.

        First their work in flight stops: their folds write nothing more, and their engine requests
        (replies, summaries, waiting or running) are cancelled; the folds are waited for (a while).
        Then the store deletes and bumps the owner's generation, so a reply or fold that began
        before commits nothing (its end is `Deleted`: "This chat was deleted."), and a recall
        writer in flight writes no folder (chat/recall.py)."""
        folds = self.folds.stop(owner)
        self.engine.cancel_owner(owner)
        for job in folds:
            job.join(STOP_WAIT_S)
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

    def _alive(self, conv: Conversation) -> Callable[[], bool]:
        """Is `conv` (as read) still there, with no "Delete all my data" since? (recall's writers)"""
        return lambda: self.store.alive(conv.owner, conv.id, conv.generation)

    def _forget(self, conv_id: str) -> None:
        self.engine.kv.drop(conv_id)
        self.recalls.forget(conv_id)
        self.windows.forget(conv_id)


class Pins:
    """The facts of a chat that its owner adds, pins, unpins and deletes by hand (the memory panel).
    Pinned facts are never left out of a prompt, so together they stay within their budget
    (`check_pins`); every call is scoped to the owner by the store."""

    def __init__(self, store: Store, budget: context.Budget, fmt: ChatFormat):
        self.store, self.budget, self.fmt = store, budget, fmt

    def add(self, owner: str, conv_id: str, text: str) -> None:
        text = clean_message(text, 300)
        check_pins(self.budget, self.fmt, self.store.facts(owner, conv_id), facts.FactLike(text, True))
        self.store.add_fact(owner, conv_id, text, pinned=True)

    def set_pinned(self, owner: str, conv_id: str, fact_id: int, pinned: bool) -> None:
        if pinned:
            known = self.store.facts(owner, conv_id)
            fact = next((f for f in known if f.id == fact_id), None)
            if fact is not None and not fact.pinned:
                check_pins(self.budget, self.fmt, known, fact)
        self.store.set_fact_pinned(owner, conv_id, fact_id, pinned)

    def delete(self, owner: str, conv_id: str, fact_id: int) -> None:
        self.store.delete_fact(owner, conv_id, fact_id)

    def remember(self, owner: str, conv_id: str, fact_id: int) -> None:
        """Remember a fact of this chat in all the owner's chats (store/memories.py), as its owner asked."""
        fact = next((f for f in self.store.facts(owner, conv_id) if f.id == fact_id), None)
        if fact is None:
            raise InputError("That fact is gone (deleted in another tab?).")
        self.store.add_memory(owner, fact.text)


def _names(documents: Sequence[str] | None) -> tuple[str, ...] | None:
    if documents is None:
        return None
    if isinstance(documents, str):  # one name, not its characters
        return (documents,)
    return tuple(documents)


def _told(prompt, sampling):
    """The prompt with the reply's grammar told in its system message (web/api/tools.py), if any."""
    if sampling is None or not sampling.instruction:
        return prompt
    return replace(prompt, system=f"{prompt.system}\n\n{sampling.instruction}")
