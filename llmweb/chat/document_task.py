"""Whole-document tasks, the run: summarise, translate, list, outline or compare a document too long
for one prompt, piece by piece, through the engine.

`DocumentTasks.detect(owner, text, force)` answers whether a message asks for one
(chat/document_plan.py's rule); `run(...)` reads the document's pieces in order, one engine request
per step at background priority (as summary jobs: other visitors' turns go first and the fair queue
between owners holds), folds the notes level by level until the last step fits, and runs that last
step as an ordinary request, streamed. It yields the turn's events (chat/turn.py): `Started`,
`Progress` ("Reading section 3 of 12…"), `Delta` (translation: the text so far, piece by piece in
order; otherwise the final answer as it grows) and returns the `Finished`, whose sources are the
pieces (page/heading) and whose `document` is the `DocumentStats`.

Each piece's result is kept in the owner's store (store/pieces.py), keyed by the document's
content hash, the task, the piece and the model, written with the owner's generation read before
the task began: a run again reads only what it has not read, a cancel keeps every piece already
read, and nothing is written after a "Delete all my data". An owner runs at most
LLMWEB_OWNER_DOCUMENT_JOBS tasks at once (`_one_more`).

It must not read or write chats (the caller records the turn) nor decide what a message asks (the
pure rule is document_plan's).
"""

from __future__ import annotations

import dataclasses
import hashlib
import threading
import time
from collections.abc import Callable, Collection, Generator, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from llmweb.chat import document_plan as dp
from llmweb.chat.context import Budget
from llmweb.chat.summary import cap_text
from llmweb.chat.tokens import ChatFormat, render_prompt
from llmweb.chat.turn import Cancel, Delta, Finished, Progress, Started
from llmweb.config import Settings
from llmweb.engine.request import GenerationRequest, Tokens
from llmweb.engine.scheduler import Engine
from llmweb.errors import InputError
from llmweb.records import LOCAL_OWNER, GenerationStats, Source, TurnStats

NOTE_TOKENS = 160  # the most a map or fold step writes (a summary, a list, notes of one piece)
MAX_PIECES = 400  # a task reads at most this many pieces (about 600,000 tokens at context 2048)
MARGIN = 8  # tokens each step keeps spare

Keep = Callable[[Finished], None]  # what a task closed early has (a partial reply, marked as stopped)
Record = Callable[[str, TurnStats, list[Source]], None]  # (reply, stats, sources) into the store
Step = Generator[Progress | Delta, None, tuple[str, GenerationStats | None]]


@dataclass(frozen=True, slots=True)
class Sizes:
    """One task's token sizes, from the budget and the prompts without their text."""

    room: int  # document text per map step
    map_cap: int  # a map step's reply cap
    note_cap: int  # a note as kept for folding (two always fit one fold prompt)
    fold_room: int  # notes per fold step
    final_room: int  # notes in the final step


class DocumentTasks:
    """Runs whole-document tasks for `Chat` (and the benchmark)."""

    def __init__(
        self,
        settings: Settings,
        engine: Engine,
        fmt: ChatFormat,
        store,
        budget: Budget,
        library,
        note_tokens: int = NOTE_TOKENS,
    ):
        self.settings, self.engine, self.fmt, self.store, self.budget = settings, engine, fmt, store, budget
        self.library, self.note_tokens = library, note_tokens
        self._running: dict[str, int] = {}  # owner -> whole-document tasks running now
        self._running_lock = threading.Lock()
        names = f"{settings.engine_url}|{settings.engine_model}|{settings.model}|{budget.context_limit}"
        self.model_key = hashlib.sha256(names.encode()).hexdigest()[:16]

    def detect(
        self, owner: str, text: str, force: bool = False, only: Collection[str] | None = None
    ) -> dp.Intent | None:
        """The task `text` asks of one of `owner`'s documents, or None (a question, or no document).
        `only`: the doc ids the chat reads; "this document" is then the latest of those, and naming
        one outside them is an InputError that says so."""
        if self.library is None or (not force and dp.task_of(text) is None):
            return None  # cheap: no listing of documents for an ordinary message
        every = self.library.documents(owner)
        chosen = [d for d in every if only is None or d.doc_id in only]
        docs = [dp.DocRef(d.doc_id, d.source, d.added, d.scope == "yours" or only is not None) for d in chosen]
        intent = dp.detect(text, docs, force)
        if intent is None and only is not None:
            outside = dp.named(text, [dp.DocRef(d.doc_id, d.source, d.added, False) for d in every])
            if outside:
                raise InputError(
                    f"{outside[0].source} is not one of the documents this chat reads: add it to the chat's "
                    "documents (under Documents) to read it here."
                )
        return intent

    # ---- sizes and pieces
    def sizes(self, intent: dp.Intent, label_tokens: int = 0) -> Sizes:
        """The task's sizes; `label_tokens`: its longest piece label ("source, heading"). Each room
        keeps MARGIN tokens for how the joined text tokenizes against its parts counted apart."""
        fmt, b = self.fmt, self.budget
        sized = dp.map_message(intent, None, 9999)
        overhead = len(render_prompt(fmt, dp.MAP_SYSTEM, [("user", sized)])) + label_tokens + MARGIN
        if intent.task == dp.TRANSLATE:  # a translation is about as long as its text: a third in, two out
            room = b.piece_room(overhead, (b.context_limit - overhead) * 2 // 3)
            return Sizes(room, b.context_limit - overhead - room, 0, 0, 0)
        fold = len(render_prompt(fmt, dp.FOLD_SYSTEM, [("user", dp.notes_message(intent, [], False))])) + MARGIN
        final = len(render_prompt(fmt, dp.FOLD_SYSTEM, [("user", dp.notes_message(intent, [], True))])) + MARGIN
        note = max(min(self.note_tokens, b.max_new_tokens, (b.context_limit - fold) // 4), 1)
        room = b.piece_room(overhead, note)
        fold_room = b.piece_room(fold, note)
        final_room = b.piece_room(final, b.max_new_tokens)
        return Sizes(room, note, note, fold_room, final_room)

    def pieces(self, owner: str, intent: dp.Intent) -> tuple[Sizes, list[dp.Piece]]:
        """The task's sizes and every document's pieces in order, numbered across the task (at most
        MAX_PIECES). Another owner's document reads as no document (`Library.chunks`)."""
        chunks = [(doc, self.library.chunks(owner, doc.doc_id)) for doc in intent.docs]
        labels = {c.label()[: dp.MAX_LABEL_CHARS] for _, cs in chunks for c in cs}
        sizes = self.sizes(intent, max((self.fmt.count(label) for label in labels), default=0))
        out: list[dp.Piece] = []
        for doc, cs in chunks:
            out += dp.split(cs, sizes.room, self.fmt.count, first=len(out) + 1, doc_id=doc.doc_id)
        if not out:
            raise InputError("That document has no text to read.")
        if len(out) > MAX_PIECES:
            raise InputError(
                f"That document is {len(out):,} sections long; a whole-document task reads at most {MAX_PIECES:,}."
            )
        return sizes, out

    # ---- the run
    def run(
        self,
        owner: str,
        conv_id: str,
        number: int,
        generation: int | None,
        intent: dp.Intent,
        *,
        cancel: Cancel | None = None,
        keep: Keep | None = None,
    ) -> Generator[Started | Progress | Delta, None, Finished]:
        """Yield Started, Progress and Delta; return the Finished (the caller records it). Closing
        the generator cancels the step in flight, and `keep`, if given, gets what there is (the
        translation so far, or where it stopped); the pieces read are kept in the cache either way."""
        t0 = time.monotonic()
        with self._one_more(owner):
            sizes, pieces = self.pieces(owner, intent)
            yield Started(conv_id)
            run = _Run(self, owner, generation, intent, pieces, sizes, cancel)
            try:
                notes = yield from run.read()
                if intent.task == dp.TRANSLATE or run.stopped:
                    reply, gen = run.partial(), run.last
                else:
                    reply, gen = yield from run.finish(notes)
            except GeneratorExit:
                if keep is not None:
                    run.stopped = True
                    keep(self._finished(run, run.partial(), run.last, number, conv_id, t0))
                raise
            return self._finished(run, reply, gen, number, conv_id, t0)

    @contextmanager
    def _one_more(self, owner: str) -> Iterator[None]:
        """One more of the owner's tasks running, while the block runs; an InputError naming the limit
        when they already run LLMWEB_OWNER_DOCUMENT_JOBS (the local owner is not capped). Each task
        reads its whole document through the engine: one stranger must not queue dozens at once."""
        cap = self.settings.owner_document_jobs
        with self._running_lock:
            n = self._running.get(owner, 0)
            if owner != LOCAL_OWNER and n >= cap:
                raise InputError(
                    f"You already have {n} whole-document task{'s' if n != 1 else ''} running, the most at once "
                    f"(LLMWEB_OWNER_DOCUMENT_JOBS = {cap}): wait for one to finish, or stop it."
                )
            self._running[owner] = n + 1
        try:
            yield
        finally:
            with self._running_lock:
                left = self._running[owner] - 1
                if left:
                    self._running[owner] = left
                else:
                    del self._running[owner]

    def answer(self, conv, intent: dp.Intent, record: Record, cancel: Cancel | None = None):
        """`run` as a turn of the chat `conv` (as read, before this turn): its events, and the
        reply recorded (a partial one too, when closed early) through `record`."""

        def keep(fin: Finished) -> None:
            record(fin.reply, fin.stats, fin.sources)

        number = len(conv.turns) + 1
        fin = yield from self.run(conv.owner, conv.id, number, conv.generation, intent, cancel=cancel, keep=keep)
        record(fin.reply, fin.stats, fin.sources)
        yield fin

    def stream(self, owner: str, intent: dp.Intent, cancel: Cancel | None = None):
        """`run` outside a chat (the stateless API): its events, then the Finished; nothing recorded
        but the pieces' results (with the owner's generation read now)."""
        fin = yield from self.run(owner, "", 1, self.store.generation(owner), intent, cancel=cancel)
        yield fin

    def _finished(
        self, run: _Run, reply: str, gen: GenerationStats | None, number: int, conv_id: str, t0: float
    ) -> Finished:
        seconds = time.monotonic() - t0
        stats = run.stats(seconds)
        # the turn's times are what the user waited, every piece included: the final step's own
        # TTFT and total would tell a 40 s task as a 5 s turn
        gen = dataclasses.replace(gen) if gen is not None else GenerationStats(finish_reason="eos")
        gen.ttft_s = run.shown_s if run.shown_s is not None else seconds
        gen.total_s = seconds
        if run.stopped:
            gen.finish_reason = "cancelled"
        turn = TurnStats(
            turn=number,
            gen=gen,
            sections={"retrieved": stats.tokens_read, "reserve": self.budget.max_new_tokens},
            context_limit=self.budget.context_limit,
            document=stats.to_dict(),
        )
        sources = [Source.from_chunk(p.as_chunk(), p.n) for p in run.pieces]
        notes = (["Stopped."] if run.stopped else []) + [stats.describe()]
        return Finished(reply, turn, sources, notes, run.prompt, conv_id, document=stats)


def remove_document(library, store, owner: str, doc_id: str):
    """Remove one of the owner's documents (`Library.remove`: InputError when it is not theirs) and
    the whole-document results for it (store/pieces.py): the owner's, or, when the document was in
    the shared library (`LLMWEB_UPLOADS_SHARED`), every owner's, since it is gone for all of them.
    The removed `DocumentInfo`."""
    shared = any(d.doc_id == doc_id and d.scope == "shared" for d in library.documents(owner))
    info = library.remove(owner, doc_id)
    if shared:
        store.delete_document_pieces_everywhere(doc_id)
    else:
        store.delete_document_pieces(owner, doc_id)
        store.record_document_bytes(owner, library.usage_bytes(owner))  # room again for its address
    return info


class _Run:
    """One task's run: its pieces, what it has read, and its steps."""

    def __init__(self, tasks: DocumentTasks, owner, generation, intent, pieces, sizes: Sizes, cancel):
        self.t, self.owner, self.generation, self.intent = tasks, owner, generation, intent
        self.pieces: list[dp.Piece] = pieces
        self.sizes, self.cancel = sizes, cancel
        self.results: dict[int, str] = {}  # piece number -> its result
        self.from_cache = 0
        self.depth = 0
        self.steps = 0
        self.stopped = False
        self.last: GenerationStats | None = None
        self.prompt: tuple[tuple[str, str], ...] = ()
        self.t0 = time.monotonic()
        self.first_s: float | None = None  # seconds until the first piece's result (the first partial result)
        self.shown_s: float | None = None  # seconds until the first text the user saw (the turn's TTFT)

    def read(self) -> Generator[Progress | Delta, None, list[tuple[int, str]]]:
        """The map: every piece's result, from the cache or one background step each, in order."""
        t, key, total = self.t, self.intent.key, len(self.pieces)
        cached = {d.doc_id: t.store.piece_results(self.owner, d.doc_id, key, t.model_key) for d in self.intent.docs}
        for p in self.pieces:
            hit = cached[p.doc_id].get(p.index)
            if hit is not None:
                self.results[p.n] = hit
                self.from_cache += 1
                self._first()
                yield Progress(p.n, total, f"Section {p.n} of {total} from the cache")
            else:
                yield Progress(p.n - 1, total, f"Reading section {p.n} of {total}…")
                msg = dp.map_message(self.intent, p, total)
                text, gen = yield from self.step(dp.MAP_SYSTEM, msg, self.sizes.map_cap, background=True)
                if self.stopped:
                    return []
                self.results[p.n] = text
                self._first()
                t.store.put_piece(self.owner, p.doc_id, key, p.index, t.model_key, text, generation=self.generation)
            if self.intent.task == dp.TRANSLATE:
                self._shown()
                yield Delta(self.translation())
        cap = self.sizes.note_cap
        return [(n, cap_text(r, cap, t.fmt.count) or "(nothing)") for n, r in sorted(self.results.items())]

    def finish(
        self, notes: list[tuple[int, str]]
    ) -> Generator[Progress | Delta, None, tuple[str, GenerationStats | None]]:
        """Fold the notes until they fit the final step, then run it (streamed, foreground)."""
        t = self.t
        spans = {n: n for n, _ in notes}  # a note's first section -> its last
        while len(notes) > 1 and self._size(notes) > self.sizes.final_room:
            self.depth += 1
            groups = dp.fold_groups([self._size([n]) for n in notes], self.sizes.fold_room)
            folded = []
            for g, rng in enumerate(groups, 1):
                part = notes[rng.start : rng.stop]
                yield Progress(
                    len(self.pieces),
                    len(self.pieces),
                    f"Combining notes: level {self.depth}, part {g} of {len(groups)}…",
                )
                msg = dp.notes_message(self.intent, part, final=False)
                text, _ = yield from self.step(dp.FOLD_SYSTEM, msg, self.sizes.note_cap, background=True)
                if self.stopped:
                    return self.stopped_note(), self.last
                folded.append((part[0][0], cap_text(text, self.sizes.note_cap, t.fmt.count) or "(nothing)"))
                spans[part[0][0]] = spans[part[-1][0]]
            notes = folded
        if self._size(notes) > self.sizes.final_room:  # one note over the final room: ours, so cut
            notes = [(notes[0][0], cap_text(notes[0][1], self.sizes.final_room - 8, t.fmt.count))]
        yield Progress(len(self.pieces), len(self.pieces), "Writing the answer…")
        msg = dp.notes_message(self.intent, notes, final=True)
        index, total = dp.cite_index(self.results), len(self.pieces)
        text, gen = yield from self.step(
            dp.FOLD_SYSTEM,
            msg,
            t.budget.max_new_tokens,
            background=False,
            stream=True,
            shape=lambda raw: dp.attribute(raw, index, total, complete=False),
        )
        if self.stopped and not text:
            return self.stopped_note(), gen
        reply = dp.attribute(text, index, total)
        if self.intent.task in (dp.SUMMARISE, dp.OUTLINE) and total > 1 and not self.stopped:
            walk = dp.by_section([(n, spans[n], note) for n, note in notes])
            reply = f"{reply}\n\n{walk}" if walk else reply
        return reply, gen

    def step(
        self,
        system: str,
        message: str,
        cap: int,
        *,
        background: bool,
        stream: bool = False,
        shape: Callable[[str], str] | None = None,
    ) -> Step:
        """One engine request; its text and stats. Closing the generator cancels it. `stream`: a
        Delta per token, of `shape(the text so far)` if given (each must extend the one before)."""
        t = self.t
        ids = render_prompt(t.fmt, system, [("user", message)])
        assert len(ids) + cap <= t.budget.context_limit, f"step of {len(ids)} + {cap} tokens over the context"
        handle = t.engine.submit(
            GenerationRequest(
                prompt_ids=ids,
                max_new_tokens=cap,
                temperature=0.0,
                repetition_penalty=t.settings.repetition_penalty,
                loop_guard=t.settings.loop_guard,
                stop_ids=t.fmt.stop_ids,
                owner=self.owner,
                background=background,
                timeout_s=t.settings.request_timeout_s,
            )
        )
        if self.cancel is not None:
            self.cancel.attach(handle)
        self.steps += 1
        self.prompt = (("system", system), ("user", message))
        done = False
        try:
            for event in handle.events():
                if stream and isinstance(event, Tokens):
                    self._shown()
                    so_far = t.fmt.decode(handle.generated)
                    yield Delta(shape(so_far.lstrip()) if shape else so_far)
            done = True
        finally:
            if not done:
                handle.cancel()
        self.last = handle.stats
        if handle.cancelled or (handle.stats is not None and handle.stats.finish_reason == "cancelled"):
            self.stopped = True
        return t.fmt.decode(handle.generated).strip(), handle.stats

    def _size(self, notes: Sequence[tuple[int, str]]) -> int:
        return sum(self.t.fmt.count(f"[{n}] {text}") + 2 for n, text in notes)

    def translation(self) -> str:
        return "\n\n".join(self.results[p.n] for p in self.pieces if p.n in self.results)

    def partial(self) -> str:
        """What a stopped (or translation) run shows: the translation so far, or where it stopped."""
        if self.intent.task == dp.TRANSLATE:
            return self.translation()
        return self.stopped_note()

    def stopped_note(self) -> str:
        return (
            f"Stopped after reading {len(self.results)} of {len(self.pieces)} sections. "
            "Ask again to go on from there: the sections read are kept."
        )

    def _first(self) -> None:
        if self.first_s is None:
            self.first_s = time.monotonic() - self.t0

    def _shown(self) -> None:
        if self.shown_s is None:
            self.shown_s = time.monotonic() - self.t0

    def stats(self, seconds: float) -> dp.DocumentStats:
        done = [p for p in self.pieces if p.n in self.results]
        total_chars = sum(len(p.text) for p in self.pieces) or 1
        return dp.DocumentStats(
            task=self.intent.task,
            documents=tuple(d.source for d in self.intent.docs),
            pieces=len(self.pieces),
            read=len(done),
            from_cache=self.from_cache,
            fold_depth=self.depth,
            tokens_read=sum(self.t.fmt.count(p.text) for p in done),
            seconds=seconds,
            coverage=sum(len(p.text) for p in done) / total_chars,
            steps=self.steps,
            first_partial_s=self.first_s,
        )
