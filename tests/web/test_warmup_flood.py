"""A warm-up flood through the real handlers, engine and tiny model: one visitor opening its chats
over and over (each open submits a warm-up prefill of that chat) never gets another visitor's
message refused, and never evicts the other visitor's kept cache (engine/share.py's warm-up
limits, engine/kvcache.py's share per owner)."""

from __future__ import annotations

import threading
import time

import pytest

from llmweb.runtime import Runtime
from llmweb.web.identity import new_owner_token
from llmweb.web.ui import Handlers
from tests.conftest import make_settings
from tests.web.test_visitors import page

pytestmark = pytest.mark.slow


def test_a_warm_up_flood_never_refuses_another_visitors_message_nor_evicts_their_kept_cache(tmp_path, app_model):
    # a KV budget of a few chats' caches: plain LRU would evict B's as A's warm-ups come in
    settings = make_settings(tmp_path, single_user="0", max_new_tokens=4, kv_budget_mb=4)
    runtime = Runtime(settings, loaded=app_model).start(background=False)
    try:
        h = Handlers(runtime)
        a_token, b_token = new_owner_token(), new_owner_token()
        pa, pb = page(session="a", peer="198.51.100.1"), page(session="b", peer="203.0.113.5")
        owner_a, owner_b = h.chat.owner(a_token, pa), h.chat.owner(b_token, pb)
        *_, last = h.chat.respond("Hello, my name is B. Remember it.", [], "", False, b_token, pb)
        conv_b = last[0]
        assert runtime.store.get(owner_b, conv_b).turns, "B's first turn is stored"
        chats = []  # A's chats, stored as an import stores them: nothing of them cached
        for n in range(8):
            conv = runtime.store.create_conversation(owner_a)
            for i in range(2):
                runtime.store.add_turn(owner_a, conv, f"chat {n} question {i} " + "x " * 10, f"answer {i} " + "y " * 10)
            chats.append(conv)
        stop, opened, errors = threading.Event(), [0], []

        def flood() -> None:
            while not stop.is_set():
                for conv in chats:
                    try:
                        h.chats.switch(conv, a_token, pa)
                        opened[0] += 1
                    except Exception as e:  # pragma: no cover - the flood's own failures are reported
                        errors.append(e)

        threads = [threading.Thread(target=flood, daemon=True) for _ in range(2)]
        for t in threads:
            t.start()
        try:
            kv = runtime.engine.kv
            deadline = time.monotonic() + 120
            while kv.evictions == 0 and time.monotonic() < deadline:
                time.sleep(0.1)  # A's warm-ups fill the session-cache store until it evicts
            warmed = sum(1 for c in chats if kv.peek(c) is not None)
            assert kv.evictions > 0, f"A's warm-ups filled the store ({warmed} kept, nothing evicted)"
            assert kv.peek(conv_b) is not None, "B's cache is still kept beside A's warm-ups"
            *_, after = h.chat.respond("What is my name?", [], conv_b, False, b_token, pb)  # raises if refused
        finally:
            stop.set()
            for t in threads:
                t.join(30)
        assert not errors, errors[:3]
        assert opened[0] >= len(chats), "the flood opened A's chats"
        turns = runtime.store.get(owner_b, conv_b).turns
        assert len(turns) == 2 and turns[-1].assistant.strip(), "B's message was answered"
        gen = turns[-1].stats.gen
        assert gen.reused_tokens > 0 and gen.prompt_tokens - gen.reused_tokens < 40, (
            f"B's kept cache survived A's warm-ups: {gen.reused_tokens} of {gen.prompt_tokens} reused"
        )
    finally:
        runtime.close()
