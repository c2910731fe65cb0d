"""Recall: earlier turns of a chat that left the window, brought back when a message is about them.

Owns: one recall index per conversation (`RecallCache`: made on first use, kept in memory,
deleted with the chat), what goes into it (`recall_chunks`, used by every fold: chat/fold.py),
keeping it in step with the active version of the chat, and the choice of passages
(`RecallCache.recall`: confident matches that bring back what the summary and facts lost).
Every write is checked against the store under the folder's lock (`alive`: the chat is still
there, no "Delete all my data" since its writer read it), so none recreates a deleted chat's folder.
It must not plan prompts, store turns or call the model (the embedder is the library's).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

from llmweb.chat import facts
from llmweb.config import Settings
from llmweb.records import Chunk, Turn

# Recall needs a confident match: cosine >= 0.40 (all-MiniLM-L6-v2) kept no unrelated turn in the
# fidelity script's messages (filler -> planted fact: max 0.38 as a whole turn; as the user's words
# alone, one pair passes, 0.415 "green tea" -> "My favourite colour is teal.", a fact, so covered;
# question -> filler: max 0.36) and kept 9 of 10 questions about a planted fact by the user's
# words (the earlier calibration on whole turns with the model's replies kept 6 of 10; the one
# lost now, "Which company do I work for?", is a fact).
RECALL_MIN_SCORE = 0.40
RECALL_CANDIDATES = 4  # recall looks at this many passages per turn it may recall
# A passage is cut at this many characters: the embedder reads its first 256 word pieces (~1,000
# characters) anyway, a passage past the retrieved-text budget (512 tokens) is never recalled
# whole, and a batch of passages (retrieval/embedder.py's BATCH) is what one hold of the embedder's
# lock tokenizes. Uncut, an import's batch of 1 MB messages held that lock ~24-36 s while every
# visitor's retrieval waited.
RECALL_PASSAGE_CHARS = 8_000

Alive = Callable[[], bool]  # does the chat a recall writer read still exist (store.alive)?


def recall_namespace(conv_id: str) -> str:
    """The index folder of a conversation's recall passages (deleted with the conversation)."""
    return f"recall-{conv_id}"


def recall_chunks(turns: Iterable[tuple[int, Turn]]) -> list[Chunk]:
    """Turns (index, turn) as recall passages, two per turn under the turn's doc_id: the whole turn,
    and the user's words alone. A question about what the user said ("Which instrument do I
    play?") matches their words, and a small model's long reply beside them can pull the whole
    turn's score under RECALL_MIN_SCORE (0.39 for "I play the cello in a quartet." in `bench
    fidelity`); a question about the reply matches the whole turn."""
    out = []
    for i, t in turns:
        whole = f"User: {t.user}\nAssistant: {t.assistant}"
        for text in (whole, f"User: {t.user}"):
            out.append(Chunk(text=_cut(text), source=f"turn {i + 1}", doc_id=f"turn-{i}", kind="recall"))
    return out


def _cut(text: str) -> str:
    """`text` within RECALL_PASSAGE_CHARS, cut at a space near the end, marked with an ellipsis."""
    if len(text) <= RECALL_PASSAGE_CHARS:
        return text
    cut = text[: RECALL_PASSAGE_CHARS - 1]
    space = cut.rfind(" ", RECALL_PASSAGE_CHARS // 2)
    return (cut[:space] if space > 0 else cut) + "…"


def covered(passage: Chunk, known: set[str]) -> bool:
    """Does the summary + facts vocabulary (`known`, `facts.vocabulary`) already carry what the
    turn's user text said? Every detail (`facts.detail_terms`: names, codes, numbers) must be in it,
    and every statement the user made about themselves mostly (`facts.unkept_statements`: "I play
    the cello in a quartet." has no detail, and a small summary drops it whole). A turn that only
    asked or asked for something is covered by the summary's paraphrase of it."""
    user_text = passage.text.split("\nAssistant:")[0].removeprefix("User:")
    return facts.detail_terms(user_text) <= known and not facts.unkept_statements(user_text, known)


RECALL_INDEXES = 256  # recall indexes kept open, the least recently used dropped first (reopened from disk)


class RecallCache:
    """The recall index of the conversations in use, by conversation id, at most RECALL_INDEXES of
    them (an Index reads nothing until used, so reopening one is cheap). Thread-safe."""

    def __init__(self, settings: Settings, library):
        self.settings = settings
        self.library = library  # its embedder embeds the passages
        self._indexes: OrderedDict = OrderedDict()  # conversation id -> its recall Index, oldest first
        self._lock = threading.Lock()

    def index(self, conv_id: str):
        from llmweb.retrieval.index import Index

        with self._lock:
            index = self._indexes.get(conv_id)
            if index is None:
                index = self._indexes[conv_id] = Index(
                    self.settings, recall_namespace(conv_id), embedder=self.library.embedder
                )
                while len(self._indexes) > RECALL_INDEXES:
                    self._indexes.popitem(last=False)
            else:
                self._indexes.move_to_end(conv_id)
            return index

    def recall(self, conv, text: str) -> list[Chunk]:
        """Earlier turns of this chat (`conv`: a `Conversation`) that left the window, when the
        message is about one of them.

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
        hits = self.index(conv.id).search(text, k=RECALL_CANDIDATES * k, min_score=RECALL_MIN_SCORE)
        known = facts.vocabulary(" ".join([conv.summary, *(f.text for f in conv.facts)]))
        best: dict[str, Chunk] = {}
        for c in hits:  # best first: a turn's better-matching passage
            best.setdefault(c.doc_id, c)
        return [c for c in best.values() if not covered(c, known)][:k]

    def add(self, conv_id: str, turns: Iterable[tuple[int, Turn]], *, alive: Alive) -> bool:
        """Index folded turns (index, turn) of a conversation, if `alive()` still holds when the
        index is written (`_writing`); False when it did not and nothing was written."""
        chunks = recall_chunks(turns)
        with self._writing(conv_id, alive) as index:
            if index is None:
                return False
            index.add_chunks(chunks)
        return True

    def follow(self, conv_id: str, fork: int, folded: Iterable[tuple[int, Turn]], *, alive: Alive) -> None:
        """Another version of the chat is active from turn `fork` on: the other branch's turns from
        there leave the index, and this one's `folded` turns (from `fork` on) come in (while
        `alive()` holds: `_writing`)."""
        chunks = recall_chunks(folded)
        with self._writing(conv_id, alive) as index:
            if index is None:
                return
            for doc_id in [d.doc_id for d in index.documents()]:
                if doc_id.startswith("turn-") and int(doc_id.removeprefix("turn-")) >= fork:
                    index.remove(doc_id)
            if chunks:
                index.add_chunks(chunks)

    def forget(self, conv_id: str) -> None:
        """A deleted conversation: its index leaves memory and disk. Called after the store's delete
        committed; a writer in flight either wrote before (and its folder goes now) or sees its
        chat gone (`_writing`) and writes nothing."""
        from llmweb.retrieval.storage import delete_namespace

        with self._lock:
            self._indexes.pop(conv_id, None)
        delete_namespace(self.settings, recall_namespace(conv_id))

    @contextmanager
    def _writing(self, conv_id: str, alive: Alive) -> Iterator:
        """The conversation's index to write, holding its folder's lock (the one `forget`'s delete
        takes), if `alive()` (the chat still exists, no "Delete all my data" since the writer read
        it: `Store.alive`) holds under that lock; else None. So no writer recreates the folder of
        a chat deleted before it wrote."""
        from llmweb.retrieval.storage import namespace_dir, thread_lock_for

        with thread_lock_for(namespace_dir(self.settings, recall_namespace(conv_id))):
            yield self.index(conv_id) if alive() else None
