"""A KV cache that grows in blocks: a decode step writes its token in place instead of copying
the whole cache.

transformers' `DynamicLayer.update` appends with `torch.cat`, so every decode step copies every
layer's keys and values: at a 512-token context on the 2-core CPU that copy was 31% of a decode
step (torch profiler), and on a GPU it is one allocation per layer per token, which is
where allocator fragmentation comes from. `BlockLayer` keeps a buffer with room for `BLOCK` more
tokens and writes new ones into it; only when the buffer is full does it move to a bigger one
(one copy per `BLOCK` tokens). Everything that reads `layer.keys` / `layer.values` sees exactly
the filled part (a view), so the model, cropping, the batch's join and leave and the session
store work unchanged; assigning `layer.keys = t` adopts `t` as the buffer (full, no spare room).

The memory a layer holds is its buffer: `kvcache.cache_nbytes` counts storage, not the view, and
admission adds one block per running request (`LocalRunner.predict`). A cache that goes to the
session store is `compact`ed first (one copy per turn, after the reply): an idle chat holds its
tokens and room for KEEP_ROOM more, so its next message is still written in place.

Owns: the cache layers' buffers and their growth. Must not: decide which cache a request gets
or keeps (runners/transformers.py and kvcache.py do).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

BLOCK = 256  # tokens of spare room a buffer gets when it grows
KEEP_ROOM = 64  # tokens of spare room an idle session's cache keeps (`compact`)


class BlockLayer(DynamicLayer):
    """A full-attention cache layer whose keys and values live in buffers grown `BLOCK` tokens at a time."""

    def __init__(self, **kwargs) -> None:
        self._k: torch.Tensor | None = None  # (batch, heads, capacity, head_dim)
        self._v: torch.Tensor | None = None
        self._n = 0  # tokens filled in _k
        self._nv = 0  # ... and in _v: the same except between `layer.keys = ...` and `layer.values = ...`
        super().__init__(**kwargs)

    # the filled part, as a view: what the model and everyone else reads
    @property
    def keys(self) -> torch.Tensor | None:
        return None if self._k is None else self._k[:, :, : self._n]

    @keys.setter
    def keys(self, t: torch.Tensor | None) -> None:
        self._k = t
        self._n = 0 if t is None or t.dim() < 3 else t.shape[-2]

    @property
    def values(self) -> torch.Tensor | None:
        return None if self._v is None else self._v[:, :, : self._nv]

    @values.setter
    def values(self, t: torch.Tensor | None) -> None:
        # its own length: `layer.keys = f(layer.keys); layer.values = f(layer.values)` must read the old values
        self._v = t
        self._nv = 0 if t is None or t.dim() < 3 else t.shape[-2]

    @property
    def capacity(self) -> int:
        return 0 if self._k is None or self._k.dim() < 3 else self._k.shape[-2]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self._k = self._v = None
        self._n = self._nv = 0
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n, new = self._n, key_states.shape[-2]
        assert self._nv == n, f"keys hold {n} tokens but values {self._nv}"
        if self._k is None or self.capacity < n + new or self._k.shape[0] != key_states.shape[0]:
            self._k = _grown(self._k, n, key_states)
            self._v = _grown(self._v, n, value_states)
        assert self._k is not None and self._v is not None
        self._k[:, :, n : n + new] = key_states
        self._v[:, :, n : n + new] = value_states
        self._n = self._nv = n + new
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self._n if self.is_initialized else 0

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes the number of tokens to remove as a negative int, not {tokens_to_remove}")
        if self.is_initialized:
            self._n = self._nv = max(self._n + tokens_to_remove, 0)

    def reset(self) -> None:
        self._k = self._v = None
        self._n = self._nv = 0
        self.is_initialized = False


def _grown(old: torch.Tensor | None, n: int, new: torch.Tensor) -> torch.Tensor:
    """A buffer with room for the `n` filled tokens of `old`, `new`'s tokens and up to BLOCK more."""
    batch, heads, tokens, dim = new.shape
    capacity = -(-(n + tokens + 1) // BLOCK) * BLOCK
    buf = new.new_empty(batch, heads, capacity, dim)
    if old is not None and n:
        buf[:, :, :n] = old[:, :, :n]
    return buf


def compact(cache: DynamicCache, room: int = KEEP_ROOM) -> None:
    """Cut every block layer's spare room down to `room` tokens (one copy of the filled part), for a
    cache that goes idle in the session store: room for a typical next message, so the next turn's
    prefill still writes in place and its time to first token pays no copy."""
    for layer in cache.layers:
        if isinstance(layer, BlockLayer) and layer._k is not None and layer._v is not None:
            n = layer._n
            if layer.capacity > n + room:
                keys, values = (t.new_empty(*t.shape[:2], n + room, t.shape[3]) for t in (layer._k, layer._v))
                keys[:, :, :n], values[:, :, :n] = layer._k[:, :, :n], layer._v[:, :, :n]
                layer._k, layer._v = keys, values


def new_cache(config) -> DynamicCache:
    """A DynamicCache for `config` whose attention layers grow in blocks, sliding-window ones too.

    A sliding-window layer (Gemma's, Mistral's) keeps every token here, as llama.cpp's full-size SWA
    cache does: the model's mask still limits each query to its window, and the cache can be cut back
    to any prefix (session reuse, a failed batch step) and join the batch like any other. transformers'
    own sliding layer drops what left the window, so its `crop` raises once the window is full: the
    second turn of a chat failed. Other layers (linear attention) stay as transformers makes them."""
    cache = DynamicCache(config=config)
    growable = (DynamicLayer, DynamicSlidingWindowLayer)
    cache.layers = [BlockLayer() if type(layer) in growable else layer for layer in cache.layers]
    return cache
