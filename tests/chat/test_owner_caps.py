"""A chat at its owner's cap is refused before the model works: the Chat asks the store
(`Store.room`) before it generates, so a visitor at LLMWEB_OWNER_MAX_CHATS or _STORED_MB hears so at
once, not after a reply it then cannot keep. The real Engine over a FakeRunner, a real store."""

from __future__ import annotations

import pytest

from llmweb.chat.context import Budget
from llmweb.chat.session import Chat
from llmweb.errors import InputError
from llmweb.store.db import Store
from llmweb.store.models import OwnerCaps
from tests.conftest import make_settings
from tests.fakes import FakeFormat, FakeRunner, fake_engine

A, B = "anon:visitor-a", "anon:visitor-b"


@pytest.fixture
def rig(tmp_path):
    fmt, runner = FakeFormat(), FakeRunner()
    engine, _ = fake_engine(runner)
    store = Store(tmp_path / "chat.sqlite3", caps=OwnerCaps(chats=1))
    budget = Budget(
        context_limit=200, max_new_tokens=20, summary_tokens=30, retrieved_tokens=40, user_tokens=60, facts_tokens=30
    )
    chat = Chat(make_settings(tmp_path, recall=False, summaries=False), engine, fmt, store, budget, None)
    yield chat, runner, store
    chat.wait_background(timeout=5)
    engine.close()
    store.close()


def test_a_new_chat_past_the_cap_is_refused_before_any_request_and_the_other_is_served(rig):
    chat, runner, store = rig
    conv = chat.ask(A, None, "hello there", use_docs=False).conv_id
    asked = len(runner.requests)
    with pytest.raises(InputError, match="LLMWEB_OWNER_MAX_CHATS"):
        chat.ask(A, None, "a second chat", use_docs=False)
    (used,) = store._db.execute("SELECT bytes FROM conversations WHERE id = ?", (conv,)).fetchone()
    store.caps = OwnerCaps(chats=1, stored_bytes=used + 20)  # A's chat is 20 bytes short of the cap
    with pytest.raises(InputError, match="LLMWEB_OWNER_MAX_STORED_MB"):
        chat.ask(A, conv, "a message thirty bytes long..", use_docs=False)
    assert len(runner.requests) == asked, "the model did no work for a refused turn"
    # B's chat is theirs to fill: a turn as short as A's first fits B's room (a stored turn's bytes
    # include its stats, whose figures vary by a few bytes: a 30-byte message could go past it)
    assert chat.ask(B, None, "hi there", use_docs=False).reply is not None
    assert len(store.list_conversations(A)) == 1 and len(store.list_conversations(B)) == 1
