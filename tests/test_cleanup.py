"""In-process caches stay bounded however many strangers come: the recall indexes are an
LRU with a size cap, and a conversation's finished fold leaves the table of folds in flight."""

from __future__ import annotations

import threading
from types import SimpleNamespace

from llmweb.chat import memory as memory_module
from llmweb.chat import recall as recall_module
from llmweb.chat.memory import Folds
from llmweb.chat.recall import RecallCache
from llmweb.records import Turn
from tests.conftest import make_settings


def test_the_recall_indexes_are_an_lru_with_a_cap(tmp_path, monkeypatch):
    monkeypatch.setattr(recall_module, "RECALL_INDEXES", 3)
    cache = RecallCache(make_settings(tmp_path), SimpleNamespace(embedder=SimpleNamespace(label="fake", dim=4)))
    first = cache.index("c0")
    for i in range(1, 3):
        cache.index(f"c{i}")
    assert cache.index("c0") is first, "used again: kept, and now the most recent"
    for i in range(3, 10):
        cache.index(f"c{i}")
    assert len(cache._indexes) == 3 and list(cache._indexes) == ["c7", "c8", "c9"]


def test_finished_folds_leave_the_table(tmp_path, monkeypatch):
    folds = Folds.__new__(Folds)
    folds._lock, folds._jobs = threading.Lock(), {}
    folds.settings = SimpleNamespace(history_high=0.9, history_low=0.5)
    folds.fmt = None
    folds._fold = lambda *args: None
    monkeypatch.setattr(memory_module.context, "turn_tokens", lambda fmt, t: 10)
    monkeypatch.setattr(memory_module.summary, "turns_to_fold", lambda counts, room, high, low: 1)
    plan = SimpleNamespace(history_room=10, sections={"retrieved": 0, "recall": 0})
    mine = SimpleNamespace(summaries=True, recall=False)
    for i in range(50):
        conv = SimpleNamespace(id=f"c{i}", owner="o", summary="", summarized_upto=0, turns=[])
        folds.after_turn(conv, Turn("u", "a"), plan, mine)
        folds.wait()
    assert len(folds._jobs) <= 1, "only folds in flight are kept"
