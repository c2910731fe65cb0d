"""Hugging Face Spaces readiness: binding, a writable data dir, and ZeroGPU against a faithful stand-in
for the `spaces` package (tests/fake_spaces.py: each call a fork, its arguments and results pickled)."""

from __future__ import annotations

import argparse
import json
import pickle
import threading

import pytest

from llmweb.cli.main import serve_settings
from llmweb.engine.kvcache import KVStore, kv_bytes_per_token
from llmweb.engine.request import EngineLimits, GenerationRequest
from llmweb.runtime import Runtime
from tests import fake_spaces
from tests.conftest import make_settings


def args(**kw):
    return argparse.Namespace(host=kw.get("host"), port=kw.get("port"))


def test_local_default_binds_loopback():
    s = serve_settings(args(), env={})
    assert s.host == "127.0.0.1" and s.port == 7860


def test_on_spaces_binds_all_interfaces_and_writes_to_a_writable_dir(tmp_path):
    s = serve_settings(args(), env={"SYSTEM": "spaces"})
    assert s.host == "0.0.0.0" and s.port == 7860
    assert str(s.data_dir) in ("/data/llmweb", "/tmp/llmweb")
    # an explicit data dir still wins
    s = serve_settings(args(), env={"SYSTEM": "spaces", "LLMWEB_DATA_DIR": str(tmp_path)})
    assert s.data_dir == tmp_path


def test_on_spaces_the_client_address_comes_from_the_ingress_unless_proxies_are_configured(tmp_path):
    """A Space's ingress reaches the app from a private address and appends the visitor's address to
    X-Forwarded-For: that address is the one counted (web/trust.py), never one the client sent itself."""
    from types import SimpleNamespace

    from llmweb.web.trust import SPACES_INGRESS, origin_of

    space = serve_settings(args(), env={"SYSTEM": "spaces", "LLMWEB_DATA_DIR": str(tmp_path)})
    assert space.trusted_proxies == SPACES_INGRESS
    assert serve_settings(args(), env={}).trusted_proxies == "", "elsewhere: only what the operator trusts"
    mine = serve_settings(args(), env={"SYSTEM": "spaces", "LLMWEB_TRUSTED_PROXIES": "192.0.2.1"})
    assert mine.trusted_proxies == "192.0.2.1"

    def via_ingress(xff: str) -> SimpleNamespace:
        return SimpleNamespace(client=SimpleNamespace(host="10.16.3.80"), headers={"x-forwarded-for": xff})

    assert origin_of(space, via_ingress("203.0.113.7")).address == "203.0.113.7"
    assert origin_of(space, via_ingress("6.6.6.6, 10.0.0.9, 203.0.113.7")).address == "203.0.113.7", "forged hops"
    direct = SimpleNamespace(client=SimpleNamespace(host="198.51.100.4"), headers={"x-forwarded-for": "1.2.3.4"})
    assert origin_of(space, direct).address == "198.51.100.4", "a public peer is not the ingress"


# ---- ZeroGPU (engine/runners/zerogpu.py, runtime/zerogpu.py) against the stand-in


@pytest.fixture
def spaces(monkeypatch):
    fake_spaces.install(monkeypatch)
    return fake_spaces


@pytest.fixture(scope="module")
def tiny():
    """A random two-layer llama (vocabulary 64): real forward passes and caches, in milliseconds."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    return LlamaForCausalLM(config).eval()


def _zero_engine(tiny, call, kv):
    from llmweb.engine.runners.zerogpu import Model, ZeroRunner, register
    from llmweb.engine.scheduler import Engine

    register("tiny", Model(tiny, "cpu", kv_bytes_per_token(tiny.config, 4)))
    return Engine(ZeroRunner(call, "tiny", kv), kv, EngineLimits(max_new_tokens=12))


def _local_engine(tiny):
    from llmweb.engine.runners.transformers import local_engine

    kv = KVStore(2**24, 60)
    return local_engine(tiny, "cpu", kv, EngineLimits(max_new_tokens=12), kv_bytes_per_token(tiny.config, 4))


def _turns(engine, first, second):
    """Two turns of one chat: (ids, stats) of each."""
    h1 = engine.submit(GenerationRequest(first, 12, session_id="chat", owner="a"))
    ids1 = h1.result()
    h2 = engine.submit(GenerationRequest(second(ids1), 12, session_id="chat", owner="a"))
    return [(ids1, h1.stats), (h2.result(), h2.stats)]


def test_the_stand_in_refuses_an_engine_as_spaces_does(spaces):
    """A GPU call's arguments are pickled into the fork: an engine's bound method (its lock and thread
    come with it) cannot go, so a call gets a Job of plain data, never the engine's busy period."""
    from tests.fakes import fake_engine

    engine, _runner = fake_engine()
    try:
        with pytest.raises(pickle.PicklingError):
            spaces.GPU(lambda work: work())(engine._busy_period)
    finally:
        engine.close()


def test_each_reply_is_one_gpu_call_from_host_bytes_and_the_second_turn_reuses_the_cache(spaces, tiny):
    """Through the stand-in (every call a fresh fork), a chat's two turns give the ids a local engine
    gives, the chat's cache lives on the host as bytes between the calls, and the second turn's call
    starts from it: its prompt's common prefix is reused, not prefilled again."""
    from llmweb.engine.runners.zerogpu import gpu_call

    first = [5, 9, 12, 7, 3, 22, 41, 8]

    def second(reply):
        return first + list(reply) + [17, 4, 30]

    kv = KVStore(2**24, 60)
    zero = _zero_engine(tiny, gpu_call(spaces), kv)
    local = _local_engine(tiny)
    try:
        got, want = _turns(zero, first, second), _turns(local, first, second)
        entry = kv.peek("chat")
    finally:
        zero.close()
        local.close()
    assert [ids for ids, _ in got] == [ids for ids, _ in want], "the same greedy replies as a local engine"
    assert isinstance(entry.cache, bytes) and entry.nbytes == len(entry.cache), "kept on the host, as bytes"
    (_, s1), (_, s2) = got
    assert s1.reused_tokens == 0 and s1.prefilled_tokens == len(first)
    assert s2.reused_tokens == want[1][1].reused_tokens > len(first), "the second call starts from the host's cache"
    assert s2.prefilled_tokens == s2.prompt_tokens - s2.reused_tokens
    assert len(spaces.durations) == 2 and all(isinstance(d, int) and 1 <= d <= 120 for d in spaces.durations)


def test_the_duration_asked_grows_with_the_request_and_stays_within_its_time_limit():
    from llmweb.engine.runners.zerogpu import Job, duration

    def job(prompt: int, cached: int, new: int, timeout: float = 120.0) -> Job:
        cache = (tuple(range(cached)), b"") if cached else None
        return Job("m", tuple(range(prompt)), new, 0.0, 1.0, 1.0, False, None, (), True, cache, timeout)

    short, long_reply = duration(job(100, 0, 64)), duration(job(100, 0, 1024))
    assert 15 < short < long_reply <= 120
    assert duration(job(8000, 7900, 64)) < duration(job(8000, 0, 64)), "a cached prefix is not prefilled again"
    assert duration(job(100, 0, 1024, timeout=30.0)) == 30, "never past the request's own limit"


def test_a_cancelled_call_stops_and_the_chat_keeps_the_cache_it_had(spaces, tiny):
    from llmweb.engine.runners.zerogpu import gpu_call

    kv = KVStore(2**24, 60)
    engine = _zero_engine(tiny, gpu_call(spaces), kv)
    try:
        engine.submit(GenerationRequest([5, 9, 12, 7], 4, session_id="chat")).result()
        before = kv.peek("chat").ids
        handle = engine.submit(GenerationRequest(before + [3, 3], 12, session_id="chat"))
        for _ in handle.events():
            handle.cancel()
        assert handle.stats.finish_reason == "cancelled"
        assert kv.peek("chat").ids == before, "the call's new cache died with it; the old one still serves"
        assert engine.submit(GenerationRequest([1, 2, 3], 3)).result(), "the engine goes on"
    finally:
        engine.close()


def test_on_zerogpu_spaces_comes_first_and_the_model_loads_through_transformers_on_that_thread(
    spaces, tmp_path, monkeypatch
):
    """`spaces` patches torch when imported: it must be imported (and a function decorated) before
    anything asks torch about CUDA; its patch is thread-local, so the model loads on that thread; and
    llama.cpp, which runs on the host's CPU, is not the ZeroGPU backend."""
    from llmweb.engine import models

    seen = {}

    def load(settings, progress=None):
        seen.update(decorated=list(spaces.decorated), backend=settings.backend, thread=threading.current_thread())
        raise RuntimeError("stop here")

    monkeypatch.setattr(models, "load", load)
    with pytest.raises(RuntimeError, match="No @spaces.GPU function detected during startup"):
        spaces.startup()  # what ZeroGPU does to a Space that launches with none
    runtime = Runtime(make_settings(tmp_path, zero_gpu=True, engine_process="auto")).start(background=True)
    try:
        assert seen["decorated"], "a @spaces.GPU function exists before the model loads (and the app launches)"
        spaces.startup()
        assert seen["backend"] == "transformers" and seen["thread"] is threading.current_thread()
        assert not runtime.ready and "stop here" in runtime.status
    finally:
        runtime.close()


def test_a_zerogpu_space_answers_three_visitors_and_a_second_turn_reuses_the_host_s_cache(spaces, tmp_path, fp32_model):
    """The done-when of ZeroGPU: a Space (`SYSTEM=spaces`, SPACES_ZERO_GPU on, the stand-in for
    `spaces`) launched as `serve` launches it, three visitors (three API conversations: three owners)
    each chat two turns; every reply is one GPU call made with that visitor's Gradio request, and
    each second turn reuses the chat's cache from the host."""
    from gradio_client import Client

    from llmweb.cli.main import launch_app

    env = {"SYSTEM": "spaces", "SPACES_ZERO_GPU": "1", "LLMWEB_DATA_DIR": str(tmp_path), "LLMWEB_SAMPLE_DOCS": "0"}
    settings = serve_settings(args(), env=env).replace(max_new_tokens=24, cache_dir=make_settings(tmp_path).cache_dir)
    assert settings.zero_gpu and not settings.in_engine_process
    runtime = Runtime(settings, loaded=fp32_model).start(background=True)
    demo, url = launch_app(runtime, server_port=None, quiet=True, prevent_thread_lock=True)  # the start-up check
    try:
        results = {}

        def visitor(n: int) -> None:
            client = Client(url, verbose=False)
            _reply, conv = client.predict(f"Name a colour. ({n})", "", api_name="/chat")
            reply, same = client.predict("And another one?", conv, api_name="/chat")
            results[n] = (conv, same, reply, json.loads(client.predict(conv, api_name="/stats")))

        threads = [threading.Thread(target=visitor, args=(n,)) for n in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=600)
    finally:
        demo.close()
        runtime.close()
    assert len(results) == 3 and len({conv for conv, *_ in results.values()}) == 3, "three chats, three owners"
    for conv, same, reply, stats in results.values():
        assert same == conv and reply.strip()
        assert stats["reused_tokens"] > 0 and stats["prefilled_tokens"] < stats["prompt_tokens"], stats
    assert len(spaces.durations) == 6, "one GPU call per reply"
    assert all(r is not None for r in spaces.requests), "each call made with its visitor's request (X-IP-Token)"


def test_a_gpu_call_brings_each_ids_logprob_back_as_a_local_engine_computes_it(spaces, tiny):
    """Log-probabilities cross the call's pickle as plain data beside the ids, as the local runner's."""
    from llmweb.engine.runners.zerogpu import gpu_call

    prompt = [5, 9, 12, 7, 3, 22, 41, 8]
    kv = KVStore(2**24, 60)
    zero, local = _zero_engine(tiny, gpu_call(spaces), kv), _local_engine(tiny)
    try:
        got, want = (e.submit(GenerationRequest(prompt, 6, owner="a", logprobs=2)) for e in (zero, local))
        ids = got.result()
        assert ids == want.result() and len(got.logprobs) == len(ids)
        for a, b in zip(got.logprobs, want.logprobs, strict=True):
            assert (
                a.id == b.id
                and a.logprob == pytest.approx(b.logprob, abs=1e-5)
                and [i for i, _ in a.top] == [i for i, _ in b.top]
            )
        plain = zero.submit(GenerationRequest(prompt, 6, owner="a"))
        assert plain.result() == ids and plain.logprobs == []
    finally:
        zero.close()
        local.close()
