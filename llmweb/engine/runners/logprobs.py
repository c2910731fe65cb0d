"""A sampled id's log-probability, and the most likely ids', from one row of logits: computed only
for a request that asks (`GenerationRequest.logprobs`), from the model's raw logits (before the
repetition penalty, the loop guard's ban, temperature and top-p: the distribution llama-server and
vLLM report by default), on llama.cpp's numpy row or a torch model's (1, vocab) tensor.

    logp = log_softmax(row)              before the sampler reads the row (it may reuse its buffer)
    token_logprob(logp, token, top)      once the sampler has picked `token`

Must not: import torch at module level (the llama.cpp path needs none), or change what is sampled.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from llmweb.engine.request import TokenLogprob


def log_softmax(row: Any) -> Any:
    """The row's log-softmax, as a new flat vector (a torch row stays on its device)."""
    if hasattr(row, "detach"):
        import torch

        return torch.log_softmax(row.detach().reshape(-1).float(), dim=-1)
    scores = np.asarray(row, dtype=np.float64).reshape(-1)
    peak = scores.max()
    return scores - (peak + np.log(np.exp(scores - peak).sum()))


def token_logprob(logp: Any, token: int, top: int) -> TokenLogprob:
    """`token`'s entry in `logp` (`log_softmax`'s), and the `top` most likely ids with theirs, most likely first."""
    chosen = float(logp[token])
    if top <= 0:
        return TokenLogprob(token, chosen)
    if hasattr(logp, "detach"):  # torch: the top k on the device, a few floats back
        import torch

        values, ids = torch.topk(logp, top)
        return TokenLogprob(token, chosen, tuple(zip(ids.tolist(), values.tolist(), strict=True)))
    best = np.argpartition(-logp, top - 1)[:top]
    best = best[np.argsort(-logp[best], kind="stable")]
    return TokenLogprob(token, chosen, tuple((int(i), float(logp[i])) for i in best))
