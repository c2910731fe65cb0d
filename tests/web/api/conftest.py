"""What the API's fast tests share: a request body, and the routes over the real Engine with a
scripted FakeRunner (Starlette's TestClient), the caller on this machine holding the local API key."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from llmweb.chat.context import Budget
from llmweb.chat.session import Chat
from llmweb.records import Chunk
from llmweb.runtime.engines import uncapped_owner
from llmweb.runtime.resident import Lease
from llmweb.store.db import Store
from llmweb.web.api.routes import api_routes
from llmweb.web.owner import owner_secrets
from tests.conftest import make_settings
from tests.fakes import FakeFormat, FakeRunner, fake_engine

BUDGET = Budget(context_limit=200, max_new_tokens=20, summary_tokens=30, retrieved_tokens=40, user_tokens=60)


def body(**kw):
    return {"model": "llmweb", "messages": [{"role": "user", "content": "hi"}], **kw}


class FakeLibrary:
    def is_empty(self, owner):
        return False

    def search(self, owner, query, k=None, min_score=None, only=None):
        return [Chunk("The capital of France is Paris.", "geography.md", heading="Europe", score=0.9, doc_id="g")]


LOCAL_URL, LOCAL_PEER = "http://127.0.0.1:7860", ("127.0.0.1", 50000)  # as a program on this machine calls


def rig(tmp_path, *, library=None, **kw):
    limits = {k: kw.pop(k) for k in ("queue_size", "queue_per_user", "max_batch") if k in kw}
    s = make_settings(tmp_path, recall=False, **kw)
    limits["uncapped_owner"] = uncapped_owner(s)  # as the runtime builds the engine's limits
    engine, runner = fake_engine(FakeRunner(), max_new_tokens=BUDGET.max_new_tokens, **limits)
    fmt = FakeFormat()
    store = Store(tmp_path / "api.sqlite3")
    chat = Chat(s, engine, fmt, store, BUDGET, library=library)
    runtime = SimpleNamespace(
        settings=s,
        store=store,
        chat=chat,
        engine=engine,
        budget=BUDGET,
        library=library,
        loaded=None,
        wait_ready=lambda t: chat,
        hold=lambda model=None, timeout=None: Lease("llmweb", chat),
    )
    # a program on this machine reads the local API key (web/owner.py) where the server accepts it
    key = owner_secrets(s).api_key if s.on_loopback and not s.login else ""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    client = TestClient(FastAPI(routes=api_routes(runtime)), base_url=LOCAL_URL, client=LOCAL_PEER, headers=headers)
    return SimpleNamespace(client=client, runner=runner, fmt=fmt, store=store, chat=chat, engine=engine, key=key)


@pytest.fixture
def api(tmp_path):
    r = rig(tmp_path)
    yield r
    r.engine.close()
    r.store.close()


def say(r, text: str) -> None:
    r.runner.enqueue(r.fmt._words(text) + [r.fmt.END])


def events(response) -> list:
    out = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            out.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
    return out
