"""The launched Gradio app, driven through gradio_client like an API user."""

from __future__ import annotations

import json

import pytest
from gradio_client import Client

from llmweb.records import LOCAL_OWNER as LOCAL
from llmweb.runtime import Runtime
from llmweb.web.owner import owner_headers, owner_secrets
from llmweb.web.ui import build_app
from tests.conftest import make_settings


@pytest.fixture(scope="module")
def served(tmp_path_factory, app_model):
    settings = make_settings(tmp_path_factory.mktemp("app"), max_new_tokens=48)
    runtime = Runtime(settings, loaded=app_model).start(background=True)
    demo = build_app(runtime)
    demo.queue(default_concurrency_limit=None, max_size=64)
    _app, url, _ = demo.launch(prevent_thread_lock=True, server_name="127.0.0.1", quiet=True)
    yield runtime, url
    demo.close()
    runtime.close()


def test_streamed_reply_names_paris_and_returns_the_conversation_id(served):
    runtime, url = served
    client = Client(url, headers=owner_headers(runtime.settings), verbose=False)  # this machine's key
    job = client.submit("What is the capital of France?", "", api_name="/chat")
    partials = list(job)
    reply, conv_id = job.result()
    assert "Paris" in reply
    assert len(partials) >= 2, "the reply streamed in pieces"
    assert [c.id for c in runtime.store.list_conversations(LOCAL)] == [conv_id], "a single-user install's own chat"
    stats = json.loads(client.predict(conv_id, api_name="/stats"))
    assert stats["generated_tokens"] >= 1 and stats["prompt_tokens"] > 0
    assert stats["mem"]["rss_bytes"] > 0
    again, same = client.predict("And of Germany?", conv_id, api_name="/chat")
    assert same == conv_id and len(runtime.store.get(LOCAL, conv_id).turns) == 2, "the id continues the chat"


def test_ui_panel_and_plots_update_after_each_turn(served):
    """The Send button's handler on the real model: the stats panel and the session plots per turn."""
    from types import SimpleNamespace

    from llmweb.web.panels.base import Panel
    from llmweb.web.ui import Handlers

    runtime, _url = served
    h = Handlers(runtime)
    secrets = owner_secrets(runtime.settings)  # the browser that opened the owner's link has its cookie
    cookie = f"{secrets.cookie_name}={secrets.token}"
    headers = {"host": "127.0.0.1", "cookie": cookie}
    here = SimpleNamespace(username=None, client=SimpleNamespace(host="127.0.0.1"), headers=headers)
    history, conv = [], ""  # the single user's browser, without login
    for turn, question in enumerate(["What is the capital of France?", "And of Italy?"], 1):
        *_, final = h.chat.respond(question, history, conv, True, "", here)
        panel = Panel(*final[:-1])
        conv, history, stats_md, bar = panel.conv_state, panel.chatbot, panel.stats_md, panel.bar
        assert f"**Turn {turn}**" in stats_md and "prompt **" in stats_md
        assert "llmweb-bar" in bar and "system" in bar
        assert f"turn {turn}:" in panel.tokens_plot and f"turn {turn + 1}:" not in panel.tokens_plot
        assert f"RSS, turn {turn}:" in panel.memory_plot and f"KV this chat, turn {turn}:" in panel.memory_plot
        assert [m["role"] for m in history[-2:]] == ["user", "assistant"]
    assert "reused" in stats_md
