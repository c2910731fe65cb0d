"""Constrained decoding (engine/constraint.py) through the sampler (engine/runners/sampling.py):
random logits, masked by the grammar, always give a reply that parses and validates; the caps
refuse a hostile schema before anything compiles, naming the field."""

from __future__ import annotations

import json
import pickle

import jsonschema
import numpy as np
import pytest

from llmweb.engine import constraint
from llmweb.engine.constraint import ConstraintError, Vocab, json_object, json_schema
from llmweb.engine.request import GenerationRequest
from llmweb.engine.runners.loopguard import Pieces
from llmweb.engine.runners.sampling import NumpySampler, TorchSampler

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer"},
        "colour": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3},
        "score": {"type": "number"},
        "nick": {"anyOf": [{"type": "string", "maxLength": 5}, {"type": "null"}]},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}, "zip": {"type": "integer"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "colour", "tags", "score", "address"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def hf():
    """A small byte-level BPE tokenizer (every byte a token, some merges, one stop token)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["</s>"], initial_alphabet=alphabet)
    tok.train_from_iterator(['{"name": "x", "age": 3, "tags": ["a", "b"]} true false null red green'] * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>")


def _reply(hf, sampler, n: int = 400) -> str:
    stop = hf.eos_token_id
    rng = np.random.default_rng(7)
    out = []
    for _ in range(n):
        t = sampler(rng.normal(size=len(hf)).astype(np.float32))
        if t == stop:
            return hf.decode(out)
        out.append(t)
    raise AssertionError(f"no stop after {n} tokens: {hf.decode(out)!r}")


def _request(hf, c, **kw) -> GenerationRequest:
    kw.setdefault("temperature", 1.0)
    return GenerationRequest([1], 400, stop_ids=frozenset({hf.eos_token_id}), constraint=c, **kw)


@pytest.mark.parametrize("seed", range(5))
def test_random_logits_under_a_schema_always_give_a_reply_that_validates(hf, seed):
    c = json_schema(SCHEMA, "response_format.json_schema.schema")
    req = _request(hf, c, seed=seed)
    s = NumpySampler(req, [1], len(hf), matcher=Vocab(hf).matcher(c, req.stop_ids, len(hf)))
    jsonschema.validate(json.loads(_reply(hf, s)), SCHEMA)


def test_the_torch_sampler_masks_the_same_way(hf):
    import torch

    c = json_schema(SCHEMA, "p")
    req = _request(hf, c, seed=3)
    s = TorchSampler(req, [1], "cpu", matcher=Vocab(hf).matcher(c, req.stop_ids, len(hf)))
    stop, out = hf.eos_token_id, []
    g = torch.Generator().manual_seed(0)
    for _ in range(400):
        t = s(torch.randn(1, len(hf), generator=g))
        if t == stop:
            break
        out.append(t)
    jsonschema.validate(json.loads(hf.decode(out)), SCHEMA)


def test_json_object_greedy_ends_with_an_object(hf):
    c = json_object()
    req = _request(hf, c, temperature=0.0)
    s = NumpySampler(req, [1], len(hf), matcher=Vocab(hf).matcher(c, req.stop_ids, len(hf)))
    assert isinstance(json.loads(_reply(hf, s)), dict)


def test_under_a_constraint_the_loop_guard_and_the_penalty_are_off(hf):
    c = json_object()
    req = _request(hf, c, repetition_penalty=1.3, loop_guard=True)
    pieces = Pieces([hf.decode([i]) for i in range(len(hf))])
    s = NumpySampler(req, [1], len(hf), pieces, Vocab(hf).matcher(c, req.stop_ids, len(hf)))
    assert s.guard is None and s.penalty == 1.0
    free = NumpySampler(_request(hf, None, repetition_penalty=1.3, loop_guard=True), [1], len(hf), pieces)
    assert free.guard is not None and free.penalty == 1.3


def test_a_constraint_is_plain_data_a_process_can_pickle():
    c = json_schema(SCHEMA, "p")
    assert pickle.loads(pickle.dumps(c)) == c
    assert pickle.loads(pickle.dumps(GenerationRequest([1], 5, constraint=c))).constraint == c


def _nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@pytest.mark.parametrize(
    ("schema", "said"),
    [
        (_nested(1000), "nested more than 32 deep"),
        ({"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(4999)}}, "more than 5,000"),
        ({"type": "object", "description": "x" * 70_000}, "the limit is 64,000"),
        ({"type": "string", "pattern": "(a{1,100000}){1,100000}"}, "repeats {1,100000} times"),
        ({"type": "string", "pattern": "a" * 1001}, "limit is 1,000"),
        ({"type": "string", "pattern": "(("}, "cannot be used: regex parse error"),
        ([], "must be a JSON schema object"),
    ],
)
def test_a_hostile_schema_is_refused_before_it_compiles_naming_the_field(schema, said):
    with pytest.raises(ConstraintError) as e:
        json_schema(schema, "response_format.json_schema.schema")
    assert said in str(e.value) and e.value.param == "response_format.json_schema.schema"


def test_a_pattern_built_to_explode_backtracking_compiles_and_masks_at_once(hf):
    """llguidance's lexer is not a backtracking one: the classic catastrophic pattern is cheap."""
    import time

    schema = {"type": "string", "pattern": "^((a+)+|(a|aa)*)+b$"}
    c = json_schema(schema, "p")
    req = _request(hf, c, seed=1)
    s = NumpySampler(req, [1], len(hf), matcher=Vocab(hf).matcher(c, req.stop_ids, len(hf)))
    t0 = time.perf_counter()
    jsonschema.validate(json.loads(_reply(hf, s, 2000)), schema)
    assert time.perf_counter() - t0 < 10


def test_the_caps_are_the_documented_ones():
    assert (constraint.MAX_DEPTH, constraint.MAX_SCHEMA_CHARS, constraint.MAX_NODES) == (32, 64_000, 5_000)


# ---- the real model, on each local runner


def test_each_local_runner_answers_a_schema_with_a_reply_that_validates(runner, fmt):
    """Greedy on the embedded model: the transformers runner and llama.cpp alike mask each step,
    so the reply parses and validates; the same request unconstrained is prose."""
    from llmweb.chat.tokens import render_prompt

    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}, "population": {"type": "integer"}},
        "required": ["city", "population"],
        "additionalProperties": False,
    }
    ids = render_prompt(fmt, "You are a helpful assistant.", [("user", "Tell me about Paris, in JSON.")])
    e = runner.engine(max_new_tokens=64)
    try:
        h = e.submit(GenerationRequest(ids, 64, stop_ids=fmt.stop_ids, constraint=json_schema(schema, "p")))
        jsonschema.validate(json.loads(fmt.decode(h.result())), schema)
        assert h.stats is not None and h.stats.finish_reason == "eos"
        free = e.submit(GenerationRequest(ids, 16, stop_ids=fmt.stop_ids))
        assert not fmt.decode(free.result()).startswith('{"city": ')
    finally:
        e.close()
