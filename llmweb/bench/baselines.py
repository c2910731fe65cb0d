"""The bench's baselines: the engine held to what its libraries do with nothing of ours around them.

  bare_greedy      llama.cpp alone: its own context, the prompt in one `llama_decode`, then argmax
                   and one `llama_decode` per token (`bench overhead`'s reference on llama.cpp)
  dynamic_cache    transformers' own DynamicCache (torch.cat per step), the "before" of `bench
                   decode`'s block cache (engine/blockcache.py), given to LocalRunner as its
                   `make_cache`

Must not: be imported by the product (only bench and its tests use these); import torch or
llama_cpp at module level.
"""

from __future__ import annotations

import time

import numpy as np

from llmweb.errors import LlmwebError


def dynamic_cache(config):
    """A DynamicCache of `config`'s layers: the cache before the block cache."""
    from transformers import DynamicCache

    return DynamicCache(config=config)


def bare_greedy(model, ids: list[int], new_tokens: int) -> tuple[float, float, int]:
    """llama.cpp with nothing of ours around it: a context of its own, the prompt in one
    `llama_decode`, then argmax and one `llama_decode` per token. (decode tok/s, TTFT s, tokens):
    the reference `bench`'s engine-overhead figure holds our engine to."""
    import llama_cpp as ll

    params = ll.llama_context_default_params()
    params.n_ctx = len(ids) + new_tokens + 8
    params.n_batch = params.n_ubatch = max(len(ids), 1)
    params.n_threads = params.n_threads_batch = model.threads
    ctx = ll.llama_init_from_model(model.ptr, params)
    try:
        t0 = time.perf_counter()
        tokens = (ll.llama_token * len(ids))(*ids)
        times = []
        batch = ll.llama_batch_get_one(tokens, len(ids))
        one = (ll.llama_token * 1)()
        for _ in range(new_tokens):
            if ll.llama_decode(ctx, batch) != 0:
                raise LlmwebError("llama.cpp failed in the bare loop")
            logits = np.ctypeslib.as_array(ll.llama_get_logits_ith(ctx, -1), shape=(model.n_vocab,))
            one[0] = int(np.argmax(logits))
            times.append(time.perf_counter())
            batch = ll.llama_batch_get_one(one, 1)
        n = len(times)
        return (n - 1) / max(times[-1] - times[0], 1e-9), times[0] - t0, n
    finally:
        ll.llama_free(ctx)
