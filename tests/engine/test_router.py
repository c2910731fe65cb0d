"""A remote engine behind a router (LLMWEB_ENGINE_ROUTER=1), against the scripted server of
tests/fake_openai.py: the request's shape (no llama.cpp slot, the session key where routers read
it), the context from LLMWEB_CONTEXT_LIMIT (required, said at start), one retry before the first
token, and the replicas the router reports in the status line. The same against real llama.cpp
servers behind the real vLLM router: tests/engine/test_router_replicas.py (slow).
"""

from __future__ import annotations

import hashlib

import pytest

from llmweb.engine.remote import remote_engine
from llmweb.engine.request import EngineLimits, GenerationRequest
from llmweb.engine.server import RemoteConfig, Server
from llmweb.errors import ConfigError, LlmwebError
from tests.conftest import make_settings
from tests.fake_openai import FakeOpenAI, decode, encode

PROMPT = encode("<|user|>Hi<|assistant|>")


def _hashed(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:32]


def test_through_a_router_no_request_names_a_slot_though_its_props_name_slots():
    server = FakeOpenAI(llama_slots=2, context=2048)  # /props answers for one replica, as through vLLM's router
    engine = remote_engine(
        RemoteConfig(url=server.url, router=True, read_timeout_s=5.0), encode, decode, EngineLimits()
    )
    try:
        for conv in ("conv-a", "conv-b", "conv-a"):
            engine.submit(GenerationRequest(prompt_ids=list(PROMPT), max_new_tokens=8, session_id=conv)).result()
        assert len(server.completions) == 3
        for body, _ in server.completions:
            assert "id_slot" not in body and "cache_prompt" not in body, "one replica's slot numbers, sent to another"
        keys = [(body["user"], headers["X-Session-Id"]) for body, headers in server.completions]
        assert keys[0] == keys[2] != keys[1], "the session key rides in `user` and X-Session-Id, stable per chat"
        assert keys[0] == (_hashed("conv-a"), _hashed("conv-a")), "hashed, never the conversation id"
        assert Server(RemoteConfig(url=server.url, router=True)).context_length() is None, "not one replica's n_ctx"
        assert Server(RemoteConfig(url=server.url)).context_length() == 2048, "a single server's still counts"
    finally:
        engine.close()
        server.close()


def test_router_mode_without_a_context_limit_refuses_to_start_and_says_what_to_set(tmp_path):
    with pytest.raises(ConfigError, match="LLMWEB_ENGINE_ROUTER=1 needs LLMWEB_CONTEXT_LIMIT.*-np.*--max-model-len"):
        make_settings(tmp_path, engine_url="http://127.0.0.1:9", engine_router=True)
    with pytest.raises(ConfigError, match="set LLMWEB_ENGINE_URL to the router"):
        make_settings(tmp_path, engine_router=True, context_limit=2048)
    assert make_settings(tmp_path, engine_url="http://127.0.0.1:9", engine_router=True, context_limit=2048)


def test_the_replicas_a_router_reports_are_counted_and_a_plain_server_reports_none():
    router, plain = FakeOpenAI(replicas=(1, 3)), FakeOpenAI()
    try:
        assert Server(RemoteConfig(url=router.url, router=True)).replicas() == (1, 3)
        router.replicas = (0, 3)  # vLLM's router answers 503 "not ready": none answer
        assert Server(RemoteConfig(url=router.url, router=True)).replicas() == (0, 3)
        assert Server(RemoteConfig(url=plain.url, router=True)).replicas() is None
        assert Server(RemoteConfig(url="http://127.0.0.1:9", router=True, connect_timeout_s=0.5)).replicas() is None
    finally:
        router.close()
        plain.close()


@pytest.fixture
def router_runtime(tmp_path):
    """A Runtime with LLMWEB_ENGINE_ROUTER=1 over a fake server (the real tokenizer, no weights)."""
    from llmweb.runtime import Runtime

    made = []

    def _start(server: FakeOpenAI) -> Runtime:
        s = make_settings(tmp_path, engine_url=server.url, engine_router=True, context_limit=1024, engine_concurrency=2)
        rt = Runtime(s).start(background=False)
        made.append(rt)
        return rt

    yield _start
    for rt in made:
        rt.close()


def test_through_a_router_llmweb_retries_once_before_the_first_token_not_three_times(router_runtime):
    server = FakeOpenAI("Answered.", replicas=(2, 2), llama_slots=4, context=512)
    try:
        rt = router_runtime(server)
        assert "2 of 2 replicas answer" in rt.status, rt.status
        assert rt.budget is not None and rt.budget.context_limit == 1024, "LLMWEB_CONTEXT_LIMIT, not /props"
        server.statuses = [500]  # the router's answer for a replica it has not yet seen die
        assert rt.wait_ready().ask("local", None, "Hello?").reply == "Answered."
        asked = len(server.completions)
        server.statuses = [503] * 10
        with pytest.raises(LlmwebError, match="HTTP 503"):
            rt.wait_ready().ask("local", None, "Again?")
        assert len(server.completions) - asked == 2, "one try and one retry: the router retries on its own"
        assert all("id_slot" not in body for body, _ in server.completions)
    finally:
        server.close()
