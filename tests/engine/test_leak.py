"""Leak guards with the real model on CPU: the transformers runner (int8-cpu, the CPU default before
llama.cpp and the fallback) and the llama.cpp runner.

A long session must not grow memory request by request. We check it where it would start: live
torch tensors (after `gc.collect()`, counted with `gc.get_objects()`) must not grow across 50
requests, and every `DynamicCache` a finished request created must be gone (tracked by weak
references from a wrapped `DynamicCache.__init__`). With session ids the store keeps exactly one
cache per session, and `kv.clear()` frees them all.

A per-request leak fails these tests: keeping each request's cache (or one logits tensor per
request) in a global list was tried, and both checks caught it.

On llama.cpp there are no torch tensors: every sequence of the context must be empty once its
request has left, the store holds one saved state per session, and the process's RSS must not grow
over 50 requests once warm.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from transformers import DynamicCache

from llmweb.chat.tokens import TemplateFormat, render_prompt
from llmweb.engine.kvcache import KVStore
from llmweb.engine.request import EngineLimits, GenerationRequest
from llmweb.engine.runners.transformers import local_engine

SYSTEM = "You are a helpful assistant."
QUESTIONS = [
    "What is the capital of France?",
    "Name three colours of the rainbow.",
    "Explain in one sentence why the sky is blue, and mention sunlight.",
    "Count from one to five.",
    "Write a short greeting for a friend who just moved to a new city.",
]
REQUESTS = 50
TENSOR_SLACK = 5  # a per-request leak adds >= 50


def live_tensors() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if issubclass(type(o), torch.Tensor))


def alive(refs: list) -> list:
    gc.collect()
    return [r() for r in refs if r() is not None]


@pytest.fixture
def created_caches(monkeypatch) -> list:
    """Weak references to every DynamicCache created while the test runs."""
    refs: list = []
    original = DynamicCache.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        refs.append(weakref.ref(self))

    monkeypatch.setattr(DynamicCache, "__init__", init)
    return refs


@pytest.fixture(scope="module")
def int8_model(tmp_path_factory):
    from tests.conftest import _load

    return _load("int8-cpu", tmp_path_factory)


@pytest.fixture(scope="module")
def fmt4(int8_model):
    return TemplateFormat(int8_model.tokenizer)


@pytest.fixture
def engine(int8_model):
    e = local_engine(
        int8_model.model,
        int8_model.device,
        KVStore(256 * 2**20, ttl_s=600),
        EngineLimits(max_new_tokens=8),
        int8_model.kv_bytes_per_token,
    )
    yield e
    e.close()


def ask(engine, fmt, messages, session_id=None):
    ids = render_prompt(fmt, SYSTEM, messages)
    h = engine.submit(GenerationRequest(ids, 8, stop_ids=fmt.stop_ids, session_id=session_id))
    return fmt.decode(h.result()), h.stats


def test_fifty_requests_without_sessions_leave_no_tensors_and_no_caches(engine, fmt4, created_caches):
    for q in QUESTIONS:  # warm-up: one-off allocations (rotary tables, quantised-kernel buffers) happen here
        ask(engine, fmt4, [("user", q)])
    before = live_tensors()
    counts = []
    for i in range(REQUESTS):
        ask(engine, fmt4, [("user", QUESTIONS[i % len(QUESTIONS)])])
        if (i + 1) % 25 == 0:
            counts.append(live_tensors())
    assert len(created_caches) == len(QUESTIONS) + REQUESTS, "every request makes its own cache"
    assert counts[-1] - before <= TENSOR_SLACK, f"live tensors grew from {before} to {counts} over {REQUESTS} requests"
    left = alive(created_caches)
    assert not left, f"{len(left)} caches of finished requests are still referenced"
    assert engine.kv.total_bytes == 0 and engine.kv.sessions() == []


def test_session_caches_are_the_only_ones_kept_and_clear_frees_them(engine, fmt4, created_caches):
    ask(engine, fmt4, [("user", QUESTIONS[0])])  # warm-up
    before = live_tensors()
    sessions = ["alice", "bob", "carol"]
    histories = {s: [] for s in sessions}
    for turn in range(3):
        for s in sessions:
            histories[s].append(("user", QUESTIONS[(turn + sessions.index(s)) % len(QUESTIONS)]))
            reply, stats = ask(engine, fmt4, histories[s], session_id=s)
            histories[s].append(("assistant", reply))
            assert turn == 0 or stats.reused_tokens > 0, "the session cache is reused"
    kept = alive(created_caches)
    assert len(kept) == len(sessions), f"{len(kept)} caches alive for {len(sessions)} sessions"
    assert sorted(engine.kv.sessions()) == sorted(sessions)
    engine.kv.clear()
    del kept
    left = alive(created_caches)
    assert not left, f"{len(left)} caches still alive after kv.clear()"
    assert live_tensors() - before <= TENSOR_SLACK


def test_llama_cpp_frees_every_sequence_keeps_one_state_per_session_and_rss_stays_flat(llama_model):
    from llmweb.engine.backends import make_engine
    from llmweb.engine.telemetry import rss_bytes

    fmt = TemplateFormat(llama_model.tokenizer)
    e = make_engine(llama_model, KVStore(256 * 2**20, ttl_s=600), EngineLimits(max_new_tokens=8, max_batch=4))
    ll, runner = e.runner.ll, e.runner
    try:
        rss = []
        for i in range(REQUESTS):
            ids = render_prompt(fmt, SYSTEM, [("user", QUESTIONS[i % len(QUESTIONS)])])
            handles = [
                e.submit(GenerationRequest(ids, 8, session_id=f"s{(i + j) % 3}", owner=f"o{j}")) for j in range(2)
            ]
            for h in handles:
                h.result()
            rss.append(rss_bytes())
            assert all(ll.llama_memory_seq_pos_max(runner.mem, s) == -1 for s in range(runner.slots)), (
                "a finished request left cells in the pool"
            )
        assert sorted(e.kv.sessions()) == ["s0", "s1", "s2"]
        assert rss[-1] - rss[9] < 16 * 2**20, f"RSS grew {(rss[-1] - rss[9]) / 2**20:.1f} MiB over 40 warm requests"
        assert e.kv.clear() > 0 and e.kv.total_bytes == 0
    finally:
        e.close()
