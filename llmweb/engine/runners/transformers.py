"""The transformers runner: the only part of the engine that runs a torch model.

The engine (scheduler.py, with queue.py and admission.py: fairness, admission, cancel, time limits)
decides WHAT runs and when; this runner runs it on the model, one step at a time, for the engine's one worker thread:

    predict(request) -> bytes         the request's peak memory (KV for prompt + max_new_tokens,
                                      plus an activation margin): admission control's figure
    held(slot) -> bytes               the KV a running request holds now
    available() -> bytes              free device memory (CUDA) or room under the RSS limit (CPU)
    start(slot)                       take the session's KV cache, cropped to the longest common
                                      prefix with the prompt (at least one token left to prefill)
    prefill(slot) -> bool             one chunk of the rest of the prompt into the slot's own cache
                                      (chunks bound activation memory and let the batch go on);
                                      the last chunk samples the first token
    decode(slots) -> bool             one token for every decoding slot in ONE forward pass over
                                      the batch cache (`_Batch`: the slots' caches left-padded to
                                      one length, an attention mask with zeros on the pads, and
                                      each row's own positions)
    release(slot, keep)               the slot leaves: its row is cut out of the batch (pads
                                      dropped) and, with `keep`, stored as its session's cache
                                      (prompt + generated[:-1])
    empty_cache(), snapshot()         allocator housekeeping (CUDA; no-ops elsewhere)

`torch.OutOfMemoryError` is caught here and turned into False, and on purpose by returning, not
raising: while an OOM exception is alive, its traceback holds the frames of the failed forward
pass, with its activations. Once the handler returns they are freed, before the engine empties
the allocator cache and retries. A failed decode leaves every cache as it was before the step
(layers the pass already grew are cropped back), so the rest of the batch goes on.

Owns: the model's forward passes, the batch's left-padded cache (`_Batch`) and the session caches'
handover to `kv`; what every local runner does alike (session reuse, the step's timing, the stats,
catching the out-of-memory) is runners/base.py's, the sampler's rules runners/sampling.py's.
Must not: choose what runs or when (queue, admission, time limits, retries are the scheduler's),
or raise an out-of-memory error to the engine.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from llmweb.engine import admission
from llmweb.engine.admission import predict_bytes
from llmweb.engine.blockcache import BLOCK, compact, new_cache
from llmweb.engine.kvcache import KVStore, cache_nbytes
from llmweb.engine.request import EngineLimits, GenerationRequest, Slot
from llmweb.engine.runners.base import BaseRunner, Seq
from llmweb.engine.runners.sampling import TorchSampler
from llmweb.engine.scheduler import Engine
from llmweb.engine.telemetry import is_cuda, memory_snapshot, reset_peak, rss_bytes
from llmweb.errors import InputError

log = logging.getLogger(__name__)


@dataclass(eq=False, kw_only=True)
class _Seq(Seq):
    cache: DynamicCache | None  # its own cache; None once the cache is a row of the batch


class LocalRunner(BaseRunner):
    """A transformers model on one device, with the session KV caches in `kv`."""

    name = "runner"
    out_of_memory = (torch.OutOfMemoryError,)

    def __init__(
        self,
        model,
        device: str,
        kv: KVStore,
        kv_bytes_per_token: int,
        *,
        mem_limit_bytes: int = 0,
        mem_margin_bytes: int = 512 * 2**20,
        make_cache: Callable[[object], DynamicCache] = new_cache,
    ):
        super().__init__(kv, kv_bytes_per_token, mem_limit_bytes)
        self.model = model
        self.device = device
        self.mem_margin_bytes = mem_margin_bytes  # CUDA: keep this much free
        # caches that grow in blocks (blockcache); bench/baselines.py passes transformers' own
        # DynamicCache (torch.cat per step) for `bench decode`'s before/after
        self._new_cache = make_cache
        self._batch = _Batch(model.config, self._new_cache)
        embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        self.vocab = getattr(embeddings, "num_embeddings", 0)  # ids at or past it: a device-side assert on CUDA

    # ---- memory
    def predict(self, request: GenerationRequest) -> int:
        heads = getattr(getattr(self.model, "config", None), "num_attention_heads", 0) or 0
        kv, activation = predict_bytes(self.kv_bytes_per_token, heads, len(request.prompt_ids), request.max_new_tokens)
        return kv + activation + BLOCK * self.kv_bytes_per_token  # a cache grows a block at a time (blockcache)

    def padding(self, request: GenerationRequest, running: list[GenerationRequest]) -> tuple[int, int]:
        """(bytes, transient bytes) `request` adds beyond its own prediction when it joins `running`:
        the batch is left-padded, so every row is as long as the longest (`_Batch`); and the join
        builds the merged batch while the old one is still alive, a copy for a moment."""
        if not running:
            return 0, 0
        per = self.kv_bytes_per_token

        def padded(requests: list[GenerationRequest]) -> int:  # tokens beyond each row's own
            width = max(len(r.prompt_ids) + r.max_new_tokens for r in requests)
            return sum(width - len(r.prompt_ids) - r.max_new_tokens for r in requests)

        width = max(len(r.prompt_ids) + r.max_new_tokens for r in running)
        copy = len(running) * (width + BLOCK)  # the batch as it is before the join, at most
        return (padded([*running, request]) - padded(running)) * per, copy * per

    def available(self) -> int:
        if is_cuda(self.device):
            free, _total = torch.cuda.mem_get_info(self.device)
            stats = torch.cuda.memory_stats(self.device)
            cached = stats.get("reserved_bytes.all.current", 0) - stats.get("allocated_bytes.all.current", 0)
            return free + cached - self.mem_margin_bytes
        if self.mem_limit_bytes <= 0:
            return 1 << 62
        return self.mem_limit_bytes - rss_bytes()

    def empty_cache(self) -> None:
        if is_cuda(self.device):
            torch.cuda.empty_cache()

    def snapshot(self):
        return memory_snapshot(self.device)

    def _sync(self) -> None:
        if is_cuda(self.device):
            torch.cuda.synchronize(self.device)

    # ---- the sequences
    def _mode(self):
        return torch.inference_mode()

    def _chunk(self, request: GenerationRequest) -> int:
        return admission.PREFILL_CHUNK

    def _open(self, request: GenerationRequest, prompt: list[int]) -> Seq:
        if self.vocab and not 0 <= min(prompt) <= max(prompt) < self.vocab:
            bad = next(i for i in prompt if not 0 <= i < self.vocab)
            raise InputError(f"The prompt holds token id {bad}, outside this model's {self.vocab} embeddings.")
        if not self._batch.slots:
            reset_peak(self.device)  # the CUDA peak is the batch's, from its first request
        matcher = None if request.constraint is None else self.matcher(request, self._logits_width())
        sampler = TorchSampler(request, prompt, self.device, self.pieces, matcher)
        return _Seq(prompt=prompt, sampler=sampler, cache=self._new_cache(self.model.config))

    def _logits_width(self) -> int:
        """The width of a row of logits (the output layer's, which may pad the tokenizer's vocabulary)."""
        return self.model.get_output_embeddings().out_features

    def _restore(self, seq: Seq, entry, reused: int) -> int:
        """The session's cache, cropped to its longest common prefix with the prompt."""
        assert isinstance(seq, _Seq)
        cache, held = entry.cache, entry.cache.get_seq_length()
        assert held == len(entry.ids), f"cache holds {held} tokens but records {len(entry.ids)} ids"
        if held > reused:
            cache.crop(-(held - reused))
        seq.cache = cache
        return reused

    def _detach(self, slot: Slot, seq: Seq):
        assert isinstance(seq, _Seq)
        return self._batch.leave(slot) if slot in self._batch.slots else seq.cache

    def _drop(self, slot: Slot, seq: Seq) -> None:
        if slot in self._batch.slots:
            self._batch.drop(slot)

    def _held_tokens(self, seq: Seq, cache) -> int:
        return cache.get_seq_length() if cache is not None else 0

    def _save(self, seq: Seq, cache) -> tuple[DynamicCache, int] | None:
        if cache is None:
            return None
        compact(cache)  # an idle session holds its tokens and a little room, not a block
        return cache, cache_nbytes(cache)

    def export_cache(self, cache: DynamicCache) -> bytes:
        """A kept cache as safetensors bytes (every layer's keys and values, on the host): no pickle."""
        from safetensors.torch import save

        tensors = {}
        for i, layer in enumerate(cache.layers):
            tensors[f"k{i}"], tensors[f"v{i}"] = layer.keys.contiguous().cpu(), layer.values.contiguous().cpu()
        return save(tensors)

    def import_cache(self, data: bytes) -> DynamicCache:
        from safetensors.torch import load

        tensors = load(data)
        cache = self._new_cache(self.model.config)
        for i in range(len(tensors) // 2):
            cache.update(tensors[f"k{i}"].to(self.device), tensors[f"v{i}"].to(self.device), i)
        compact(cache)  # as it was kept (`_save`): the store's figure, not a block of room more
        return cache

    # ---- the passes
    def _prefill(self, seq: Seq, chunk: list[int], last: bool):
        assert isinstance(seq, _Seq)
        ids = torch.tensor([chunk], device=self.device)  # (1, chunk)
        return self._forward(input_ids=ids, cache=seq.cache), 0  # (1, vocab)

    def _feed(self, slots: list[Slot]) -> Callable[[], None]:
        """Each newcomer joins the batch's cache; the step's ids, mask and positions."""
        batch = self._batch
        length = batch.length
        for slot in slots:
            if slot not in batch.slots:
                batch.join(slot, slot.state.cache)  # all or nothing, so an OOM here leaves it out
                slot.state.cache = None
                length = batch.length
        assert set(batch.slots) == set(slots), "the decoding slots are the rows of the batch"
        ids = torch.tensor([[slot.state.last] for slot in batch.slots], device=self.device)  # (B, 1)
        mask, positions = batch.mask_and_positions(self.device)  # (B, L+1), (B, 1); None: no pads
        self._inputs = {"input_ids": ids, "attention_mask": mask, "position_ids": positions}
        return lambda: batch.crop(length)  # layers a failed pass grew are cropped back

    def _step(self, slots: list[Slot]):
        inputs, self._inputs = self._inputs, {}
        return list(self._batch.slots), self._forward(cache=self._batch.cache, **inputs)

    def _row(self, logits, i: int):
        return logits[i : i + 1]

    def _forward(self, **inputs):
        """The model's logits of each row's last position, (B, vocab)."""
        return self.model(**inputs, use_cache=True, logits_to_keep=1).logits[:, -1, :]


class _Batch:
    """The decoding slots' caches as one left-padded DynamicCache.

    Row i holds slots[i]'s tokens right-aligned in `length` columns; its first `pads[i]` columns
    are padding, masked out of attention. Every decode step appends one column to every row, so a
    row's pads stay the same until rows leave; then columns that are padding in every row left
    are dropped. Joining and leaving copy the batch's KV once; a decode step writes its column in
    place (blockcache: one copy per BLOCK steps).
    """

    def __init__(self, config, make_cache: Callable[[object], DynamicCache]) -> None:
        self.config = config  # the model's, to make caches of the right layers
        self.make_cache = make_cache
        self.slots: list[Slot] = []
        self.pads: list[int] = []
        self.cache: DynamicCache | None = None

    @property
    def length(self) -> int:
        return self.cache.get_seq_length() if self.cache is not None else 0

    def join(self, slot: Slot, cache: DynamicCache) -> None:
        """Add a row: pad the batch or the newcomer on the left to one length, then stack them."""
        if self.cache is None:
            self.slots, self.pads, self.cache = [slot], [0], cache
            return
        own, length = cache.get_seq_length(), self.length
        width = max(own, length)
        merged = []
        for mine, theirs in zip(self.cache.layers, cache.layers, strict=True):
            _check_layer(mine)
            merged.append(
                tuple(
                    torch.cat([_pad_left(a, width - length), _pad_left(b, width - own)], dim=0)
                    for a, b in ((mine.keys, theirs.keys), (mine.values, theirs.values))
                )
            )
        for layer, (keys, values) in zip(self.cache.layers, merged, strict=True):
            layer.keys, layer.values = keys, values
        self.pads = [p + width - length for p in self.pads] + [width - own]
        self.slots.append(slot)

    def leave(self, slot: Slot) -> DynamicCache:
        """Cut the slot's row out as a cache of its own (no pads); drop columns now padding everywhere."""
        i = self.slots.index(slot)
        pad = self.pads[i]
        assert self.cache is not None, "a row of the batch has a cache"
        if len(self.slots) == 1:
            own = self.cache
            if pad:
                _trim_left(own, pad)
            self.slots, self.pads, self.cache = [], [], None
            return own
        own = self.make_cache(self.config)
        keep = [j for j in range(len(self.slots)) if j != i]
        trim = min(self.pads[j] for j in keep)
        index = torch.tensor(keep, device=self.cache.layers[0].keys.device)
        built = []  # all or nothing, as `join`: every new tensor first (an OOM here changes nothing), then assign
        for source in self.cache.layers:
            mine = tuple(t[i : i + 1, :, pad:, :].clone() for t in (source.keys, source.values))
            rest = tuple(t.index_select(0, index)[:, :, trim:, :] for t in (source.keys, source.values))
            built.append((mine, rest))
        for source, target, (mine, rest) in zip(self.cache.layers, own.layers, built, strict=True):
            target.lazy_initialization(*mine)
            target.keys, target.values = mine
            source.keys, source.values = rest
        self.slots = [self.slots[j] for j in keep]
        self.pads = [self.pads[j] - trim for j in keep]
        return own

    def drop(self, slot: Slot) -> None:
        """Take the slot's row out in place, allocating nothing (when `leave` ran out of memory): the
        rows after it move up one; the buffers keep their size until they next grow."""
        i = self.slots.index(slot)
        assert self.cache is not None, "a row of the batch has a cache"
        if len(self.slots) > 1:
            with torch.inference_mode():
                for layer in self.cache.layers:
                    keys, values = layer.keys, layer.values
                    for j in range(i, len(self.slots) - 1):
                        keys[j].copy_(keys[j + 1])
                        values[j].copy_(values[j + 1])
                    layer.keys, layer.values = keys[:-1], values[:-1]
        del self.slots[i], self.pads[i]
        if not self.slots:
            self.cache = None

    def crop(self, length: int) -> None:
        """Back to `length` columns (after a failed pass grew some layers)."""
        if self.cache is None:
            return
        for layer in self.cache.layers:
            extra = layer.get_seq_length() - length
            if extra > 0:
                layer.crop(-extra)

    def mask_and_positions(self, device):
        """The attention mask over the cache plus the new token, (B, L+1), zeros on the pads, and
        each row's position for the new token, (B, 1); (None, None) when no row has pads."""
        if not any(self.pads):
            return None, None
        length = self.length
        mask = torch.ones(len(self.slots), length + 1, dtype=torch.long, device=device)
        for i, pad in enumerate(self.pads):
            mask[i, :pad] = 0
        positions = torch.tensor([[length - pad] for pad in self.pads], device=device)
        return mask, positions


def _check_layer(layer) -> None:
    assert not getattr(layer, "is_sliding", False), "batching needs full-attention cache layers"


def _pad_left(t: torch.Tensor, n: int) -> torch.Tensor:
    """(B, heads, L, dim) -> (B, heads, n + L, dim) with n zero columns in front."""
    if n == 0:
        return t
    return torch.cat([t.new_zeros(t.shape[0], t.shape[1], n, t.shape[3]), t], dim=2)


def _trim_left(cache: DynamicCache, n: int) -> None:
    for layer in cache.layers:
        layer.keys, layer.values = layer.keys[:, :, n:, :].clone(), layer.values[:, :, n:, :].clone()


def local_engine(
    model,
    device: str,
    kv: KVStore,
    limits: EngineLimits,
    kv_bytes_per_token: int,
) -> Engine:
    """An engine over a loaded transformers model (this module imports torch)."""
    runner = LocalRunner(
        model,
        device,
        kv,
        kv_bytes_per_token,
        mem_limit_bytes=limits.mem_limit_bytes,
        mem_margin_bytes=limits.mem_margin_bytes,
    )
    return Engine(runner, kv, limits)
