"""Admission's pure parts: the memory figure of a request, and what a request that gave way does
next (its fallback once, else a clear error). The engine's use of them is in test_fast_engine.py."""

from __future__ import annotations

import pytest

from llmweb.engine import admission
from llmweb.engine.admission import predict_bytes, retry_plan
from llmweb.engine.request import GenerationRequest, Handle, Slot
from llmweb.errors import LlmwebError, OutOfMemory
from llmweb.records import GenerationStats


def slot(fallback=None, retried=False) -> Slot:
    request = GenerationRequest(prompt_ids=[1, 2, 3, 4], max_new_tokens=8, fallback=fallback)
    return Slot(Handle(request, engine=None), request, 0, 60.0, GenerationStats(), retried=retried)


def test_predict_bytes_counts_kv_to_the_end_and_one_prefill_chunks_attention_scores():
    kv, activation = predict_bytes(kv_bytes_per_token=1000, heads=2, prompt_tokens=100, max_new_tokens=28)
    assert kv == 1000 * 128
    assert activation == int(kv * admission.ACTIVATION_MARGIN + 2 * 100 * 128 * 4 + admission.ACTIVATION_FLOOR)
    chunk = admission.PREFILL_CHUNK
    kv, activation = predict_bytes(1000, 2, 10 * chunk, 0)
    scores = 2 * chunk * (10 * chunk) * 4  # one chunk against the whole context, not the context squared
    assert activation == int(kv * admission.ACTIVATION_MARGIN + scores + admission.ACTIVATION_FLOOR)


def test_a_request_that_gave_way_retries_once_with_its_fallback_capped():
    smaller = GenerationRequest(prompt_ids=[3, 4], max_new_tokens=500)
    for reason in ("oom", "context_length"):
        plan = retry_plan(slot(fallback=lambda: smaller), reason, "too long", max_new_tokens=64)
        assert isinstance(plan, GenerationRequest)
        assert list(plan.prompt_ids) == [3, 4] and plan.max_new_tokens == 64


@pytest.mark.parametrize(
    ("reason", "retried", "fallback", "error", "words"),
    [
        ("oom", False, None, OutOfMemory, "nothing smaller to retry with"),
        ("oom", False, lambda: None, OutOfMemory, "nothing smaller to retry with"),
        ("oom", True, None, OutOfMemory, "even with a smaller prompt"),
        ("context_length", False, None, LlmwebError, "the server said: too long"),
        ("context_length", True, None, LlmwebError, "the server said: too long"),
    ],
)
def test_without_a_fallback_or_on_the_retry_it_ends_with_a_clear_error(reason, retried, fallback, error, words):
    plan = retry_plan(slot(fallback, retried), reason, "the server said: too long", max_new_tokens=64)
    assert type(plan) is error and words in str(plan)


def test_a_retry_never_asks_for_another_fallback():
    def fallback():
        raise AssertionError("a retried request has no second fallback")

    assert isinstance(retry_plan(slot(fallback, retried=True), "oom", "", 64), OutOfMemory)
    assert type(retry_plan(slot(fallback, retried=True), "context_length", "no", 64)) is LlmwebError
