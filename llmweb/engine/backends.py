"""The runner (and the in-process engine) for a loaded model, whichever backend runs it (models.LoadedModel.backend):

  transformers   engine/runners/transformers.py's LocalRunner (the GPU path, and the CPU fallback)
  llama.cpp      engine/runners/llama_cpp.py's LlamaRunner (the CPU default for a GGUF model)

Both runners import their heavy libraries (torch, llama_cpp) here lazily, so the caller needs
neither to import this module. Either runner gets the vocabulary's pieces from the tokenizer (the
same ids on both), for the loop guard (runners/loopguard.py).
"""

from __future__ import annotations

import weakref

from llmweb.config import CPU_CONTEXT_CAP
from llmweb.engine.constraint import Vocab
from llmweb.engine.kvcache import KVStore
from llmweb.engine.request import EngineLimits
from llmweb.engine.runners.base import BaseRunner
from llmweb.engine.runners.loopguard import Pieces
from llmweb.engine.scheduler import Engine


def make_engine(
    loaded,
    kv: KVStore,
    limits: EngineLimits,
    *,
    context: int = 0,
) -> Engine:
    """An engine over `loaded` (a models.LoadedModel), in this process: `make_runner` under the scheduler."""
    return Engine(make_runner(loaded, kv, limits, context=context), kv, limits)


def make_runner(loaded, kv: KVStore, limits: EngineLimits, *, context: int = 0):
    """The runner for `loaded`'s backend. `context`: the tokens one request may hold (the budget's
    context limit; 0 = the model's, capped as on the CPU) — llama.cpp sizes its KV pool from it,
    one context per batch slot."""
    if loaded.backend == "llama.cpp":
        from llmweb.engine.runners.llama_cpp import LlamaRunner

        context = context or min(loaded.max_context, CPU_CONTEXT_CAP)
        runner: BaseRunner = LlamaRunner(
            loaded.model, kv, limits.max_batch, context, mem_limit_bytes=limits.mem_limit_bytes
        )
    else:
        from llmweb.engine.runners.transformers import LocalRunner

        runner = LocalRunner(
            loaded.model,
            loaded.device,
            kv,
            loaded.kv_bytes_per_token,
            mem_limit_bytes=limits.mem_limit_bytes,
            mem_margin_bytes=limits.mem_margin_bytes,
        )
    runner.pieces = vocabulary_pieces(loaded.tokenizer)
    runner.grammar_vocab = grammar_vocab(loaded.tokenizer)
    return runner


def grammar_vocab(tokenizer) -> Vocab | None:
    """The tokenizer as constrained decoding reads it (built on the first constrained request);
    None for one it cannot read (llguidance reads fast tokenizers)."""
    from transformers import PreTrainedTokenizerFast

    return Vocab(tokenizer) if isinstance(tokenizer, PreTrainedTokenizerFast) else None


_PIECES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # per tokenizer: decoded once (~0.8 s)


def vocabulary_pieces(tokenizer) -> Pieces | None:
    """Each id's text, as the tokenizer decodes it alone (a byte of a longer character reads as
    U+FFFD, which is no boundary); None when the tokenizer cannot say."""
    try:
        return _PIECES[tokenizer]
    except (KeyError, TypeError):
        pass
    try:
        ids = [[i] for i in range(len(tokenizer))]
        pieces = Pieces(tokenizer.batch_decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False))
    except (AttributeError, TypeError):
        return None
    try:
        _PIECES[tokenizer] = pieces
    except TypeError:  # not weakly referable: decoded again next time
        pass
    return pieces
