"""An import's recall work holds the embedder's lock for one bounded batch: each passage
is cut at RECALL_PASSAGE_CHARS, so a batch of an import's 300 kB messages tokenizes ~0.5 MB, not
~6 MB, while other visitors' embeds wait. The real embedder and a real recall index."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

from llmweb.chat import recall
from llmweb.chat.recall import RecallCache, recall_chunks
from llmweb.records import Turn
from llmweb.retrieval.embedder import Embedder
from tests.conftest import make_settings

CAP = getattr(recall, "RECALL_PASSAGE_CHARS", 8_000)


def test_a_passage_is_cut_at_the_cap_between_words_and_says_so():
    turn = Turn("word " * 100_000, "reply " * 100_000)
    for c in recall_chunks([(0, turn)]):
        assert len(c.text) <= CAP and c.text.endswith("…") and c.text.startswith("User: word")
    short = recall_chunks([(0, Turn("I play the cello.", "Nice."))])
    assert [c.text for c in short] == ["User: I play the cello.\nAssistant: Nice.", "User: I play the cello."]


def test_one_hold_of_the_embedders_lock_tokenizes_a_bounded_batch(tmp_path):
    """Four folded turns of 300,000 characters each, indexed as an import indexes them: every call of
    the model under the lock gets at most a batch of capped passages; another visitor's query embed
    runs between two batches (it waited for one batch, never the whole import)."""
    embedder = Embedder()
    model = embedder.model
    real, sizes, waits = model.encode, [], []

    def encode(texts, **kw):
        sizes.append(sum(len(t) for t in texts))
        if len(sizes) == 1:  # a visitor's query arrives while the import embeds
            visitor.start()
        return real(texts, **kw)

    def query() -> None:
        t0 = time.perf_counter()
        embedder.embed_query("what did I say about the cello?")
        waits.append(time.perf_counter() - t0)

    visitor = threading.Thread(target=query)
    model.encode = encode
    try:
        cache = RecallCache(make_settings(tmp_path), SimpleNamespace(embedder=embedder))
        turns = [(i, Turn(f"turn {i} " + "lorem ipsum " * 25_000, "ok " * 1_000)) for i in range(4)]
        t0 = time.perf_counter()
        assert cache.add("c" * 32, turns, alive=lambda: True)
        took = time.perf_counter() - t0
    finally:
        model.encode = real
    visitor.join(30)
    bound = embedder.batch_size * CAP
    print(
        f"\n[recall] import of 4 x 300 kB turns: {took:.2f} s, largest locked batch {max(sizes):,} chars "
        f"(bound {bound:,}); a visitor's query embed meanwhile {waits[0] * 1000:.0f} ms"
    )
    assert max(sizes) <= bound, sizes
    assert waits, "the visitor's embed ran"
