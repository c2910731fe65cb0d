"""ZeroGPU's start-up (SPACES_ZERO_GPU, config.py `zero_gpu`): `spaces` first, a decorated GPU call,
then the model and an engine whose runner makes one GPU call per request (engine/runners/zerogpu.py).

Read from the `spaces` package (0.51): importing it patches torch, so that the web process, which
has no GPU, loads a model "for CUDA" (`torch.cuda.is_available()` answers True; the tensors stay on
the host and move to the GPU in each call's fork). It must come before anything asks torch about
CUDA (`models.resolve_device`). Its tensor interception is a thread-local torch mode, entered on the
thread that imported it: the model loads on that thread, not on a background one. And a function
must be decorated by the time the app launches, or ZeroGPU stops the Space.

Owns: that order. Must not: start threads or touch the store (runtime/__init__.py wires the parts).
"""

from __future__ import annotations

from collections.abc import Callable

from llmweb.chat.context import Budget
from llmweb.config import Settings


def prepare() -> Callable:
    """Import `spaces` and decorate the GPU call (before the model loads and the app launches)."""
    import spaces

    from llmweb.engine.runners.zerogpu import gpu_call

    return gpu_call(spaces)


def load_settings(settings: Settings) -> Settings:
    """The model loads for CUDA through transformers (the embedded GGUF converted once, as on any
    GPU): llama.cpp runs on the host's CPU, which is not where ZeroGPU's GPU is."""
    return settings.replace(backend="transformers")


def zero_engine(settings: Settings, loaded, call: Callable):
    """(engine, budget) over `loaded`: the chats' caches as host bytes, each request one `call`."""
    from llmweb.engine.backends import grammar_vocab, vocabulary_pieces
    from llmweb.engine.kvcache import KVStore
    from llmweb.engine.runners.zerogpu import Model, ZeroRunner, register
    from llmweb.engine.scheduler import Engine
    from llmweb.runtime.engines import host_kv_budget_bytes, local_limits

    budget = Budget.from_settings(settings, loaded.max_context, loaded.on_cpu)
    key = f"{loaded.name}#{id(loaded.model)}"
    pieces = vocabulary_pieces(loaded.tokenizer)
    register(
        key, Model(loaded.model, loaded.device, loaded.kv_bytes_per_token, pieces, grammar_vocab(loaded.tokenizer))
    )
    kv = KVStore(host_kv_budget_bytes(settings), settings.kv_ttl_s)
    return Engine(ZeroRunner(call, key, kv), kv, local_limits(settings, budget, loaded)), budget
