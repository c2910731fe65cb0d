"""A sliding-window model (Gemma 3's layers, window 8 here) on the transformers runner: its cache
keeps every token (engine/blockcache.py `new_cache`), so the model's mask alone keeps the window.
Greedy tokens are transformers' own generate's, and a session cut back further than the window
(KV reuse after a reply that re-tokenises differently) answers as a fresh prompt does. Before,
transformers' own sliding layer could not be cropped back past its window: the second turn failed.
A tiny random model built from a config: fast."""

from __future__ import annotations

import torch

from llmweb.engine.blockcache import BlockLayer, new_cache
from llmweb.engine.kvcache import KVStore
from llmweb.engine.request import EngineLimits, GenerationRequest
from llmweb.engine.runners.transformers import local_engine

WINDOW = 8


def gemma3():
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "gemma3_text",
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.3)
    return model


def test_every_layer_of_a_sliding_window_model_keeps_all_its_tokens():
    cache = new_cache(gemma3().config)
    assert [getattr(layer, "is_sliding", False) for layer in cache.layers] == [False, False]
    assert all(isinstance(layer, BlockLayer) for layer in cache.layers)


def test_greedy_tokens_past_the_window_are_transformers_own_and_a_cut_session_answers_as_a_fresh_one():
    model = gemma3()
    rng = torch.Generator().manual_seed(1)
    first = torch.randint(3, 96, (20,), generator=rng).tolist()
    model.generation_config.eos_token_id = None  # 12 tokens, whatever they are
    theirs = model.generate(torch.tensor([first]), max_new_tokens=12, do_sample=False)
    engine = local_engine(model, "cpu", KVStore(2**30, 600), EngineLimits(max_new_tokens=12), 4 * 8 * 2 * 4)
    try:
        ours = engine.submit(GenerationRequest(first, 12, session_id="s")).result()
        assert list(ours) == theirs[0, len(first) :].tolist()
        parted = first[:10] + torch.randint(3, 96, (6,), generator=rng).tolist()  # cut 21 tokens back
        handle = engine.submit(GenerationRequest(parted, 12, session_id="s"))
        reused = handle.result()
        assert handle.stats is not None and handle.stats.reused_tokens == 10
        fresh = engine.submit(GenerationRequest(parted, 12)).result()
        assert reused == fresh
    finally:
        engine.close()
