"""Racing the memory ("safe in front of strangers"): an edit, a reply or "Delete all my
data" while a background fold runs, on a real SQLite store and real recall folders (FAISS on disk,
with a word-hashing stand-in for the embedder), over the real Engine with a scripted FakeRunner.

A fold in flight is held at one point (its recall embedding, its summary) until the test lets it
go, so each race happens in the order the test names, every time."""

from __future__ import annotations

import threading
import zlib
from pathlib import Path

import numpy as np
import pytest

from llmweb.chat.context import Budget
from llmweb.chat.session import Chat, Delta, Finished, Started
from llmweb.errors import InputError
from llmweb.retrieval.library import Library
from llmweb.store.db import Store
from llmweb.store.models import Deleted, NotFound
from tests.conftest import make_settings
from tests.fakes import FakeFormat, FakeRunner, fake_engine

A = "anon:visitor-a"
B = "anon:visitor-b"
WAIT_S = 15.0


class WordEmbedder:
    """A stand-in for the embedder: each word hashed into one of `dim` slots, rows unit-length.
    With `hold` set, `embed` (what a recall write calls) signals `entered` and waits for `release`."""

    label = "test-words"
    dim = 64

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.hold = False
        self.entered = threading.Event()
        self.release = threading.Event()

    def _vectors(self, texts) -> np.ndarray:
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        for i, text in enumerate(texts):
            for word in text.lower().split():
                out[i, zlib.crc32(word.encode()) % self.dim] += 1.0
            out[i, 0] += 1e-3  # never a zero row
        return out / np.linalg.norm(out, axis=1, keepdims=True)

    def embed(self, texts, progress=None, *, threads=None):
        if self.hold:
            self.entered.set()
            assert self.release.wait(WAIT_S), "the test never released the recall write"
        if progress is not None:
            progress(len(texts), len(texts))
        return self._vectors(texts)

    def embed_query(self, text: str):
        return self._vectors([text])


class Rig:
    def __init__(self, tmp_path: Path):
        self.settings = make_settings(tmp_path, recall=True)
        self.engine, self.runner = fake_engine(FakeRunner())
        self.fmt = FakeFormat()
        self.store = Store(tmp_path / "chat.sqlite3")
        budget = Budget(
            context_limit=200,
            max_new_tokens=20,
            summary_tokens=30,
            retrieved_tokens=40,
            user_tokens=60,
            facts_tokens=30,
        )
        self.embedder = WordEmbedder()
        self.chat = Chat(
            self.settings, self.engine, self.fmt, self.store, budget, Library(self.settings, self.embedder)
        )
        summary = self.fmt._words("They talked about their lucky words.") + [self.fmt.END]
        self.runner.background = lambda request: summary

    def folder(self, conv_id: str) -> Path:
        return Path(self.settings.data_dir) / "index" / f"recall-{conv_id}"

    def fold_in_flight(self) -> bool:
        return any(j.is_alive() for j in self.chat.folds._jobs.values())

    def chat_until_a_fold(self, owner: str, conv: str | None, *, wait: bool) -> str:
        """Turns (each with a fact sentence) until a fold starts; with `wait`, until it is done."""
        for i in range(30):
            fin = self.chat.ask(owner, conv, f"My lucky word {i} is w{i}x. " + "x " * 12, wait_summary=wait)
            conv = fin.conv_id
            if self.fold_in_flight() or self.store.get(owner, conv).summarized_upto > 0:
                return conv
        raise AssertionError("no fold started")

    def facts_count(self, conv_ids) -> tuple[int, int]:
        marks = ",".join("?" * len(conv_ids))
        db = self.store._db
        turns = db.execute(f"SELECT COUNT(*) FROM turns WHERE conversation_id IN ({marks})", conv_ids).fetchone()[0]
        facts = db.execute(f"SELECT COUNT(*) FROM facts WHERE conversation_id IN ({marks})", conv_ids).fetchone()[0]
        return turns, facts

    def close(self) -> None:
        self.embedder.release.set()
        self.chat.wait_background(timeout=WAIT_S)
        self.engine.close()
        self.store.close()


@pytest.fixture
def rig(tmp_path):
    r = Rig(tmp_path)
    yield r
    r.close()


def long_reply(rig: Rig, n: int = 120) -> None:
    rig.runner.token_delay_s = 0.1  # the reply's cap (20 tokens) is 2 s away: time to race it
    rig.runner.enqueue(rig.fmt._words(" ".join(f"r{i}" for i in range(n))) + [rig.fmt.END])


def first_delta(stream) -> str:
    """Run a turn's stream to its first Delta; the conversation id from its Started."""
    conv = ""
    for event in stream:
        if isinstance(event, Started):
            conv = event.conv_id
        if isinstance(event, Delta):
            return conv
    raise AssertionError("the reply ended before it streamed")


def test_an_edit_during_a_summary_leaves_no_stale_recall_and_no_stale_facts(rig):
    """Before: the edit replaced turn 0 while the fold that read it was still writing, so the recall
    index and the facts kept turn 0's old words. Now the edit waits for the fold, as regenerate
    does, and then finds turn 0 folded (refused): the memory and the chat agree."""
    held, release = threading.Event(), threading.Event()

    def held_write(previous, turns, **kw):  # the fold's summary, held until the edit has been tried
        held.set()
        assert release.wait(WAIT_S)
        return "They talked about their lucky words."

    rig.chat.folds.summariser.write = held_write
    conv = rig.chat_until_a_fold(A, None, wait=False)
    assert held.wait(WAIT_S), "the fold is in flight: its recall is written, its facts and summary not yet"
    threading.Timer(0.3, release.set).start()  # a fold that took a while
    try:
        list(rig.chat.edit(A, conv, 0, "My lucky word 0 is changed-now."))
        edited = True
    except InputError as e:
        assert "folded" in str(e)
        edited = False
    rig.chat.wait_background(timeout=WAIT_S)

    active = rig.store.get(A, conv)
    users = {t.idx: t.user for t in active.turns}
    index = rig.chat.recalls.index(conv)
    for doc in index.documents():
        idx = int(doc.doc_id.removeprefix("turn-"))
        for chunk in index.chunks(doc.doc_id):
            said = chunk.text.split("\nAssistant:")[0].removeprefix("User: ")
            assert users.get(idx) == said, f"recall holds turn {idx} as it no longer is: {said!r}"
    for fact in active.facts:
        assert any(fact.text in u for u in users.values()), f"a fact from a turn no longer there: {fact.text!r}"
    assert not edited, "the edit waited for the fold, which took turn 0"


def test_delete_all_during_a_first_reply_leaves_nothing_and_the_reply_is_refused(rig):
    """Before: the reply of a new chat, still streaming when the visitor deleted all their data,
    stored its turn afterwards and so recreated the chat. Now the delete cancels the reply and the
    store refuses its end ("This chat was deleted."): no chat, turn, fact or recall folder is left."""
    older = rig.chat_until_a_fold(A, None, wait=True)
    rig.chat.wait_background(timeout=WAIT_S)
    assert rig.folder(older).is_dir() and rig.store.get(A, older).facts, "a folded chat: recall folder and facts"
    long_reply(rig)
    stream = rig.chat.send(A, None, "My name is Ada and I play the cello.")
    new = first_delta(stream)
    assert rig.chat.delete_owner(A) == 1
    with pytest.raises(Deleted, match="This chat was deleted"):
        for event in stream:
            assert not isinstance(event, Finished) or event.stats.gen.finish_reason == "cancelled"
    rig.chat.wait_background(timeout=WAIT_S)
    assert rig.store.list_conversations(A) == [] and not rig.store.exists(A, new)
    assert rig.facts_count([older, new]) == (0, 0), "no turns, no facts"
    assert not rig.folder(older).exists() and not rig.folder(new).exists()
    with pytest.raises(NotFound):
        rig.store.get(A, older)


@pytest.mark.parametrize("held_at", ["recall", "summary"])
def test_delete_all_during_a_summary_job_leaves_no_recall_folder(rig, held_at):
    """Before: a fold in flight (held while it embeds the turns for recall) wrote its recall folder
    after the delete had removed it: an orphan. Now the delete stops the owner's folds and cancels
    their summary jobs first, and a recall write checks that its chat is still there."""
    if held_at == "recall":
        rig.embedder.hold = True
    else:  # a slow summary job on the engine, which the delete cancels
        rig.runner.token_delay_s = 0.05
        rig.runner.background = lambda request: rig.fmt._words(" ".join(f"s{i}" for i in range(400)))
    conv = rig.chat_until_a_fold(A, None, wait=False)
    if held_at == "recall":
        assert rig.embedder.entered.wait(WAIT_S), "the fold is embedding its turns for recall"
    else:
        for _ in range(int(WAIT_S / 0.01)):
            if rig.folder(conv).is_dir() and any(r.background for r in rig.runner.requests):
                break
            threading.Event().wait(0.01)
    deleting = threading.Thread(target=rig.chat.delete_owner, args=(A,))
    deleting.start()
    deleting.join(0.5)
    rig.embedder.release.set()
    deleting.join(WAIT_S)
    assert not deleting.is_alive()
    rig.chat.wait_background(timeout=WAIT_S)
    assert not rig.fold_in_flight()
    assert not rig.folder(conv).exists(), "no orphaned recall folder"
    assert rig.store.list_conversations(A) == [] and rig.facts_count([conv]) == (0, 0)


def test_one_visitors_delete_all_leaves_anothers_chats_and_running_reply_alone(rig):
    """A's "Delete all my data" while both A and B have a reply streaming: A's is cancelled and
    refused, B's runs to its end and is stored; B's folded chat, facts and recall folder stay."""
    theirs = rig.chat_until_a_fold(B, None, wait=True)
    rig.chat.wait_background(timeout=WAIT_S)
    before = rig.store.get(B, theirs)
    assert rig.folder(theirs).is_dir() and before.facts
    mine = rig.chat.ask(A, None, "My name is Ada.").conv_id
    long_reply(rig, 60)
    b_stream = rig.chat.send(B, theirs, "What is my lucky word 0?")
    first_delta(b_stream)
    long_reply(rig, 60)
    a_stream = rig.chat.send(A, mine, "Tell me a story.")
    first_delta(a_stream)

    assert rig.chat.delete_owner(A) == 1
    with pytest.raises(Deleted):
        list(a_stream)
    b_end = [e for e in b_stream if isinstance(e, Finished)][-1]
    assert b_end.stats.gen.finish_reason == "length", "B's reply ran to its cap (20 tokens), not cancelled"
    assert b_end.reply.split() == [f"r{i}" for i in range(20)]
    rig.chat.wait_background(timeout=WAIT_S)

    after = rig.store.get(B, theirs)
    assert [t.user for t in after.turns] == [t.user for t in before.turns] + ["What is my lucky word 0?"]
    assert after.turns[-1].assistant == b_end.reply
    assert [f.text for f in after.facts][: len(before.facts)] == [f.text for f in before.facts]
    assert rig.folder(theirs).is_dir() and len(rig.chat.recalls.index(theirs).documents()) > 0
    assert [c.id for c in rig.store.list_conversations(B)] == [theirs]
    assert rig.store.list_conversations(A) == [] and not rig.folder(mine).exists()
