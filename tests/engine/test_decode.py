"""Decode speed without changing a token: the block-growing KV cache, int8-cpu weights
and the `auto` quantisation, and `bench decode`.

The fast tests check the cache layer against transformers' own DynamicLayer on random tensors;
the slow ones run the real model: the engine's greedy fp32 text is the same with either cache,
and int8-cpu loads, is smaller and answers."""

from __future__ import annotations

import pytest
import torch
from transformers.cache_utils import DynamicLayer

from llmweb.bench.baselines import dynamic_cache
from llmweb.chat.tokens import TemplateFormat, render_prompt
from llmweb.engine import models
from llmweb.engine.blockcache import BLOCK, KEEP_ROOM, BlockLayer, compact, new_cache
from llmweb.engine.kvcache import KVStore, cache_nbytes
from llmweb.engine.request import EngineLimits, GenerationRequest
from llmweb.engine.runners.transformers import LocalRunner
from llmweb.engine.scheduler import Engine
from llmweb.errors import ConfigError
from tests.conftest import make_settings


def kv(tokens: int, batch: int = 1, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 3, tokens, 8, generator=g), torch.randn(batch, 3, tokens, 8, generator=g)


def test_block_layer_matches_dynamic_layer_through_prefill_decode_and_crop():
    ours, theirs = BlockLayer(), DynamicLayer()
    for step, tokens in enumerate([37, 1, 1, 1, *[1] * BLOCK, 5]):
        k, v = kv(tokens, seed=step)
        a, b = ours.update(k, v), theirs.update(k, v)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        assert ours.get_seq_length() == theirs.get_seq_length()
    ours.crop(-7)
    theirs.crop(-7)
    assert torch.equal(ours.keys, theirs.keys) and torch.equal(ours.values, theirs.values)
    k, v = kv(2, seed=99)  # written in place over the cropped tokens
    assert torch.equal(ours.update(k, v)[0], theirs.update(k, v)[0])


def test_block_layer_grows_a_block_at_a_time_and_counts_its_buffer():
    layer = BlockLayer()
    layer.update(*kv(10))
    assert layer.capacity == BLOCK and layer.get_seq_length() == 10
    first = layer._k
    for _ in range(BLOCK - 10):
        layer.update(*kv(1))
    assert layer._k is first and layer.get_seq_length() == BLOCK, "decode steps write into the same buffer"
    layer.update(*kv(1))  # the buffer was full: one move to a bigger one
    assert layer._k is not first and layer.capacity == 2 * BLOCK and layer.get_seq_length() == BLOCK + 1
    cache = new_cache(_config())
    cache.layers[0].update(*kv(10))
    assert cache_nbytes(cache) == 2 * BLOCK * 3 * 8 * 4, "the memory a cache holds is its buffer, not its length"


def test_compact_keeps_the_tokens_and_a_little_room_for_the_next_message():
    cache = new_cache(_config())
    cache.layers[0].update(*kv(10))
    before = cache.layers[0].keys.clone()
    compact(cache)
    layer = cache.layers[0]
    assert layer.capacity == 10 + KEEP_ROOM and torch.equal(layer.keys, before)
    assert cache_nbytes(cache) == 2 * (10 + KEEP_ROOM) * 3 * 8 * 4, "an idle cache holds its tokens and the room"
    buffer = layer._k
    layer.update(*kv(KEEP_ROOM))  # the next message fits the room: written in place
    assert layer._k is buffer and layer.get_seq_length() == 10 + KEEP_ROOM
    layer.update(*kv(1))  # past it, the buffer grows a block again
    assert layer._k is not buffer and layer.capacity == BLOCK


def test_assigning_keys_adopts_the_tensor_and_the_next_update_does_not_write_into_it():
    layer = BlockLayer()
    layer.update(*kv(4))
    big_k, big_v = kv(12, batch=2)
    row_k, row_v = big_k[1:2, :, 2:], big_v[1:2, :, 2:]  # a view into someone else's tensor
    layer.keys, layer.values = row_k, row_v
    assert layer.get_seq_length() == 10 and torch.equal(layer.keys, row_k)
    before = big_k.clone()
    layer.update(*kv(1, seed=5))
    assert torch.equal(big_k, before), "the adopted tensor had no spare room: it was copied, not written"
    assert layer.get_seq_length() == 11 and torch.equal(layer.keys[:, :, :10], row_k)


def test_keys_and_values_are_reassigned_one_after_the_other_as_the_batch_does():
    """`_Batch.leave` sets `layer.keys = f(layer.keys)`, then `layer.values = f(layer.values)`:
    reading the values in between must see all of them (the bench caught a cut there)."""
    ours, theirs = BlockLayer(), DynamicLayer()
    for layer in (ours, theirs):
        layer.update(*kv(20, batch=2))
        layer.keys = layer.keys.index_select(0, torch.tensor([1]))[:, :, 5:]
        layer.values = layer.values.index_select(0, torch.tensor([1]))[:, :, 5:]
    assert ours.keys.shape == ours.values.shape == (1, 3, 15, 8)
    assert torch.equal(ours.values, theirs.values) and torch.equal(ours.keys, theirs.keys)
    k, v = kv(1, seed=3)
    assert torch.equal(ours.update(k, v)[1], theirs.update(k, v)[1])


def test_auto_is_4bit_on_cuda_and_int8_on_the_cpu():
    assert models.resolve_quant("auto", "cpu") == "int8-cpu"
    assert models.resolve_quant("auto", "cuda") == "4bit"
    assert models.resolve_quant("fp32", "cpu") == "fp32"
    with pytest.raises(ConfigError, match="CPU only"):
        models.resolve_quant("int8-cpu", "cuda")


def test_gqa_attention_is_preferred_on_the_cpu_only_and_an_explicit_setting_wins():
    env: dict[str, str] = {}
    assert models.prefer_gqa_attention("cpu", env) and env == {models.GQA_SWITCH: "1"}
    env = {}
    assert not models.prefer_gqa_attention("cuda:0", env) and env == {}
    env = {models.GQA_SWITCH: "0"}
    assert not models.prefer_gqa_attention("cpu", env), "the user's 0 stays"


def _config():
    from transformers import LlamaConfig

    return LlamaConfig(num_hidden_layers=1, num_attention_heads=3, num_key_value_heads=3, hidden_size=24)


# ---- the real model


def _greedy(loaded, block_cache: bool, ids: list[int], n: int) -> list[int]:
    store = KVStore(0, 1)
    runner = LocalRunner(
        loaded.model,
        loaded.device,
        store,
        loaded.kv_bytes_per_token,
        make_cache=new_cache if block_cache else dynamic_cache,
    )
    engine = Engine(runner, store, EngineLimits(max_new_tokens=n, kv_reuse=False))
    try:
        return list(engine.submit(GenerationRequest(ids, n)).result())
    finally:
        engine.close()


def test_the_block_cache_gives_the_eager_caches_greedy_text_token_for_token(fp32_model):
    fmt = TemplateFormat(fp32_model.tokenizer)
    ids = render_prompt(fmt, "You are helpful.", [("user", "Tell me about lighthouses and their keepers. " * 12)])
    eager, block = _greedy(fp32_model, False, ids, 40), _greedy(fp32_model, True, ids, 40)
    assert len(eager) == 40 and block == eager


def test_masked_gqa_attention_gives_the_same_logits_as_repeated_kv_heads(fp32_model, monkeypatch):
    """The attention a reuse turn and a batched step run: new tokens after a cached prefix, and a
    left-padded batch with its mask. Grouped KV heads (models.prefer_gqa_attention) must give the
    logits that the copied heads (repeat_kv) give."""
    import torch
    from transformers import DynamicCache

    model = fp32_model.model
    ids = torch.arange(1000, 1300).unsqueeze(0)
    batch = torch.stack([ids[0, :64], torch.cat([torch.zeros(16, dtype=torch.long), ids[0, 100:148]])])
    mask = torch.ones_like(batch)
    mask[1, :16] = 0

    def logits(gqa: str):
        monkeypatch.setenv(models.GQA_SWITCH, gqa)
        cache = DynamicCache(config=model.config)
        with torch.inference_mode():
            model(ids[:, :260], cache=cache, use_cache=True)
            reuse = model(ids[:, 260:], cache=cache, use_cache=True).logits
            batched = model(batch, attention_mask=mask, use_cache=False).logits[:, 16:]
        return reuse, batched

    for repeated, grouped in zip(logits("0"), logits("1")):
        assert torch.allclose(repeated, grouped, atol=1e-4), (repeated - grouped).abs().max()


@pytest.mark.slow  # loads the model once more, as int8-cpu
def test_int8_cpu_loads_smaller_than_fp32_and_answers(tmp_path, fp32_model):
    loaded = models.load(make_settings(tmp_path, quant="int8-cpu", device="cpu"))
    assert loaded.quant == "int8-cpu" and "int8-cpu" in loaded.describe()
    assert loaded.weights_bytes < 0.6 * fp32_model.weights_bytes
    fmt = TemplateFormat(loaded.tokenizer)
    ids = render_prompt(fmt, "You are helpful.", [("user", "What is the capital of France?")])
    reply = fmt.decode(_greedy(loaded, True, ids, 16))
    assert "Paris" in reply, reply


@pytest.mark.slow  # loads the model in each quantisation
def test_bench_decode_measures_every_step_and_its_verdicts_follow_its_figures(tmp_path):
    from llmweb.bench import decode
    from llmweb.engine import gguf

    r = decode.run(make_settings(tmp_path, device="cpu"), lengths=(16, 64), new_tokens=4, repeats=1, progress=str)
    llama_ok = gguf.available() is None
    names = [s.name for s in decode.steps_for("cpu", llama_ok, process=True)]  # the engine process: auto
    assert [x["step"] for x in r["rows"]] == [n for n in names for _ in (16, 64)]
    by = {(x["step"], x["prompt"]): x for x in r["rows"]}
    for x in r["rows"]:
        assert x["decode_tok_s"] > 0 and x["prefill_tok_s"] > 0 and x["forward_ms"] > 0
        before = by[(names[0], x["prompt"])]["decode_tok_s"]
        assert x["decode_vs_before"] == pytest.approx(x["decode_tok_s"] / before, abs=0.01)
    assert r["default_step"] == (decode.PROCESS if llama_ok else decode.INT8) and r["fp32_greedy_identical"] is True
    if llama_ok:  # the same runner in this process and behind the boundary: the boundary's cost, side by side
        assert {decode.LLAMA, decode.PROCESS} <= {x["step"] for x in r["rows"]}
    ft = r["first_turn"]
    assert ft["default_vs_int8"] == pytest.approx(
        ft["total_s"][decode.INT8] / ft["total_s"][r["default_step"]], abs=0.01
    )
    md = decode.markdown(r)
    assert "| step | prompt | decode tok/s |" in md and "identical" in md and "A first turn of 400 prompt tokens" in md
