"""Log-probabilities from the runners (engine/runners/logprobs.py): the arithmetic on numpy and torch
rows alike, then on each real local runner, in this process and across the engine process's wire
(engine/boundary.py): the raw model's log-softmax of each sampled id, the most likely ids in order,
and nothing computed when the request does not ask."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from llmweb.engine.boundary import SlotDelta
from llmweb.engine.request import GenerationRequest, Handle, Slot, TokenLogprob
from llmweb.engine.runners.logprobs import log_softmax, token_logprob
from llmweb.records import GenerationStats
from tests.engine.test_engine import prompt, req


def test_numpy_and_torch_rows_give_the_same_figures():
    row = np.random.default_rng(0).normal(size=1000).astype(np.float32) * 5
    want = row.astype(np.float64) - math.log(np.exp(row.astype(np.float64)).sum())
    a = token_logprob(log_softmax(row), 7, 5)
    b = token_logprob(log_softmax(torch.from_numpy(row)[None, :]), 7, 5)
    assert a.id == b.id == 7 and a.logprob == pytest.approx(want[7], abs=1e-6)
    assert b.logprob == pytest.approx(want[7], abs=1e-4)
    best = np.argsort(-want)[:5]
    assert [i for i, _ in a.top] == [i for i, _ in b.top] == best.tolist()
    assert [v for _, v in a.top] == pytest.approx(want[best].tolist(), abs=1e-6)
    assert token_logprob(log_softmax(row), 3, 0).top == ()


class _Queue:
    def position(self, handle):
        return 0

    def wait(self, handle):
        return 0, 0.0

    def withdraw(self, handle):
        return None


def test_the_wire_replays_each_ids_logprob_on_the_web_processs_slot():
    request = GenerationRequest(prompt_ids=[1, 2], max_new_tokens=5, stop_ids=frozenset({9}), logprobs=1)
    slot = Slot(Handle(request, _Queue()), request, 0, 60.0, GenerationStats())
    lp = TokenLogprob(4, -0.25, ((4, -0.25),))
    SlotDelta(sampled=[4, 9], logprobs=[lp, None]).apply(slot)
    assert slot.generated == [4] and slot.finish == "eos"
    assert slot.handle.logprobs == [lp], "the stop id's is not kept"


@pytest.mark.slow
def test_each_runner_gives_the_raw_models_logprobs_only_when_asked(runner, fmt):
    engine = runner.engine()
    try:
        ids = prompt(fmt, ("user", "What is the capital of France?"))
        h = engine.submit(req(fmt, ids, n=12, logprobs=3))
        generated = h.result()
        assert len(h.logprobs) == len(generated) > 1
        for token, lp in zip(generated, h.logprobs, strict=True):
            assert lp.id == token and lp.logprob <= 0
            assert len(lp.top) == 3 and lp.top[0][0] == token, "greedy: the sampled id is the most likely"
            assert lp.top[0][1] == pytest.approx(lp.logprob, abs=1e-5)
            values = [v for _, v in lp.top]
            assert values == sorted(values, reverse=True) and sum(math.exp(v) for v in values) <= 1 + 1e-5
        if runner.name == "transformers":  # the first id's figure: the model's own log-softmax of the prompt
            with torch.inference_mode():
                logits = runner.model.model(torch.tensor([ids])).logits[0, -1].float()
            want = torch.log_softmax(logits, -1)[generated[0]].item()
            assert h.logprobs[0].logprob == pytest.approx(want, abs=1e-4)

        h = engine.submit(req(fmt, ids, n=12, temperature=1.5, seed=3, logprobs=0))
        sampled = h.result()
        assert [lp.id for lp in h.logprobs] == sampled and all(lp.top == () for lp in h.logprobs)

        plain = engine.submit(req(fmt, ids, n=12))
        assert plain.result() == generated and plain.logprobs == [], "not asked: none computed"
    finally:
        engine.close()


@pytest.mark.slow
def test_logprobs_cross_the_engine_processs_wire_as_computed_in_this_process(llama_model, fmt, tmp_path):
    from tests.engine.test_process import Boundary
    from tests.fakes import RunnerKind

    kind = RunnerKind("llama.cpp", llama_model, MemoryError)
    ids = prompt(fmt, ("user", "What is the capital of France?"))
    here = kind.engine()
    try:
        want = here.submit(req(fmt, ids, n=10, logprobs=2))
        want.result()
    finally:
        here.close()
    b = Boundary(kind, tmp_path)
    try:
        got = b.engine.submit(req(fmt, ids, n=10, logprobs=2))
        assert got.result() == want.generated
        assert [lp.id for lp in got.logprobs] == got.generated
        for a, w in zip(got.logprobs, want.logprobs, strict=True):
            assert a.logprob == pytest.approx(w.logprob, abs=1e-4) and [i for i, _ in a.top] == [i for i, _ in w.top]
    finally:
        b.close()
