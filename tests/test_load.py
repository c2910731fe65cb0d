"""A load test through the launched app (gradio_client, the real model, real SQLite): 16 visitors x
3 turns at once through the public `/chat` API. Nobody is told the model is busy (the engine's
waiting room lets them wait, bounded by the estimated wait, LLMWEB_MAX_WAIT_S); every turn is
answered and stored exactly once; p50/p95 latency are printed (`pytest -s`)."""

from __future__ import annotations

import sqlite3
import time

import pytest

from llmweb.bench.load import TURNS, VISITORS, crowd, summary
from llmweb.runtime import Runtime
from llmweb.web.identity import API_CONVERSATION
from tests.conftest import make_settings
from tests.test_hostile import serve

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def crowded(tmp_path_factory, app_model):
    """Strangers (every conversation its own owner), short replies, the default queue settings."""
    settings = make_settings(tmp_path_factory.mktemp("load"), max_new_tokens=8, single_user="0")
    runtime = Runtime(settings, loaded=app_model).start(background=False)
    with serve(runtime) as (_demo, url):
        yield runtime, url
    runtime.close()


def test_16_visitors_x_3_turns_wait_their_turn_and_every_turn_is_stored_once(crowded):
    runtime, url = crowded
    t0 = time.perf_counter()
    results, errors = crowd(url, VISITORS, TURNS)
    figures = summary(results, errors, time.perf_counter() - t0)
    print(f"\nload: {VISITORS} visitors x {TURNS} turns: {figures}")
    assert not errors, errors[:3]
    assert figures["refusals"] == 0, f"nobody is told the model is busy: {figures}"
    assert len(results) == VISITORS * TURNS and all(r.reply.strip() for r in results), "every turn is answered"
    convs = {r.visitor: r.conv_id for r in results}
    assert len(set(convs.values())) == VISITORS, "one conversation per visitor"
    assert all(r.conv_id == convs[r.visitor] for r in results), "a visitor's turns stay in their conversation"
    with sqlite3.connect(runtime.settings.data_dir / "llmweb.sqlite3") as db:
        rows = db.execute("SELECT conversation_id, idx, user FROM turns ORDER BY conversation_id, idx").fetchall()
    stored: dict[str, list[tuple[int, str]]] = {}
    for conv_id, idx, user in rows:
        stored.setdefault(conv_id, []).append((idx, user))
    assert set(stored) == set(convs.values()), "no other conversation was written"
    for visitor, conv_id in convs.items():
        sent = [r.message for r in results if r.visitor == visitor]
        assert stored[conv_id] == list(enumerate(sent)), f"visitor {visitor}: each turn stored once, in order"
        turns = runtime.store.get(API_CONVERSATION + conv_id, conv_id).turns
        assert [t.user for t in turns] == sent and all(t.assistant.strip() for t in turns)
    assert runtime.engine.counters.refused == 0
    assert 1 <= runtime.engine.counters.max_active <= runtime.engine.limits.max_batch
