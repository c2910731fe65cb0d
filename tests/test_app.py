"""The launched Gradio app, driven through gradio_client like an API user."""

from __future__ import annotations

import json

import pytest
from gradio_client import Client

from llmweb.runtime import Runtime
from llmweb.store import LOCAL_OWNER as LOCAL
from llmweb.ui import build_app
from tests.conftest import make_settings


@pytest.fixture(scope="module")
def served(tmp_path_factory, nf4_model):
    settings = make_settings(tmp_path_factory.mktemp("app"), max_new_tokens=48)
    runtime = Runtime(settings, loaded=nf4_model).start(background=True)
    demo = build_app(runtime)
    demo.queue(default_concurrency_limit=None, max_size=64)
    _app, url, _ = demo.launch(prevent_thread_lock=True, server_name="127.0.0.1", quiet=True)
    yield runtime, url
    demo.close()
    runtime.close()


def test_streamed_reply_names_paris(served):
    runtime, url = served
    client = Client(url, verbose=False)
    job = client.submit("What is the capital of France?", "", api_name="/chat")
    partials = list(job)
    final = job.result()
    assert "Paris" in final
    assert len(partials) >= 2, "the reply streamed in pieces"
    conv = runtime.store.list_conversations(LOCAL)[0]
    stats = json.loads(client.predict(conv.id, api_name="/stats"))
    assert stats["generated_tokens"] >= 1 and stats["prompt_tokens"] > 0
    assert stats["mem"]["rss_bytes"] > 0


def test_ui_panel_and_plots_update_after_each_turn(served):
    """The Send button's event (api name "respond"): the stats panel and the session plots per turn."""
    _runtime, url = served
    client = Client(url, verbose=False)
    history, conv = [], ""
    for turn, question in enumerate(["What is the capital of France?", "And of Italy?"], 1):
        conv, history, _lst, stats_md, bar, _memory, _facts, tokens, memory, _msg = client.predict(
            question, history, conv, True, api_name="/respond"
        )
        assert f"**Turn {turn}**" in stats_md and "prompt **" in stats_md
        assert "llmweb-bar" in bar and "system" in bar
        token_turns = {row[0] for row in tokens["data"]}
        assert token_turns == set(range(1, turn + 1)), tokens["data"]
        measures = {(row[0], row[1]) for row in memory["data"]}
        assert (turn, "RSS") in measures and (turn, "KV this chat") in measures
        assert [m["role"] for m in history[-2:]] == ["user", "assistant"]
    assert "reused" in stats_md
