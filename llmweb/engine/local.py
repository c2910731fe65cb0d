"""The local model runner: the only part of the engine that touches torch and the model.

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
    busy(work)                        runs the engine's busy period inside the GPU entry point
    empty_cache(), snapshot()         allocator housekeeping (CUDA; no-ops elsewhere)

`torch.OutOfMemoryError` is caught here and turned into False, and on purpose by returning, not
raising: while an OOM exception is alive, its traceback holds the frames of the failed forward
pass, with its activations. Once the handler returns they are freed, before the engine empties
the allocator cache and retries. A failed decode leaves every cache as it was before the step
(layers the pass already grew are cropped back), so the rest of the batch goes on.

Owns: the model's forward passes, sampling, the batch's left-padded cache (`_Batch`) and the
session caches' handover to `kv`. Must not: choose what runs or when (queue, admission, time
limits, retries are the scheduler's), or raise an out-of-memory error to the engine.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from llmweb.engine import admission
from llmweb.engine.admission import predict_bytes
from llmweb.engine.blockcache import BLOCK, compact, new_cache
from llmweb.engine.kvcache import KVStore, cache_nbytes, reusable
from llmweb.engine.request import EngineLimits, GenerationRequest, Slot
from llmweb.engine.scheduler import Engine
from llmweb.engine.telemetry import RssPeak, StepTiming, is_cuda, memory_snapshot, reset_peak, rss_bytes

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Seq:
    """The runner's state of one slot: its prompt, its own cache until it joins the batch, its sampler."""

    prompt: list[int]
    cache: DynamicCache | None  # None once the cache is a row of the batch
    reused: int  # prompt tokens served from the session's cache
    filled: int  # prompt tokens in the cache
    sampler: _Sampler
    rss: RssPeak
    last: int = -1  # the last sampled id, fed in the next decode step


class LocalRunner:
    """A transformers model on one device, with the session KV caches in `kv`."""

    def __init__(
        self,
        model,
        device: str,
        kv: KVStore,
        kv_bytes_per_token: int,
        *,
        mem_limit_bytes: int = 0,
        mem_margin_bytes: int = 512 * 2**20,
        fault: Callable[[int], None] | None = None,
        gpu: Callable | None = None,
        block_cache: bool = True,
    ):
        self.model = model
        self.device = device
        self.kv = kv
        self.kv_bytes_per_token = kv_bytes_per_token
        self.mem_limit_bytes = mem_limit_bytes  # CPU: RSS limit; 0 = no limit
        self.mem_margin_bytes = mem_margin_bytes  # CUDA: keep this much free
        self.fault = fault  # test hook: called with the forward-pass index (this runner's count) before each
        self.forwards = 0
        self.timing = StepTiming()
        # caches that grow in blocks (blockcache); False: transformers' DynamicCache (torch.cat per
        # step), kept for `bench decode`'s before/after
        self._new_cache = new_cache if block_cache else _dynamic_cache
        self._batch = _Batch(model.config, self._new_cache)
        # e.g. @spaces.GPU on ZeroGPU Spaces: the GPU entry point is one busy period of the engine
        self._busy: Callable[[Callable[[], None]], None] = gpu(_call) if gpu is not None else _call

    # ---- memory
    def predict(self, request: GenerationRequest) -> int:
        heads = getattr(getattr(self.model, "config", None), "num_attention_heads", 0) or 0
        kv, activation = predict_bytes(self.kv_bytes_per_token, heads, len(request.prompt_ids), request.max_new_tokens)
        return kv + activation + BLOCK * self.kv_bytes_per_token  # a cache grows a block at a time (blockcache)

    def held(self, slot: Slot) -> int:
        seq: _Seq = slot.state
        return self.kv_bytes_per_token * (seq.filled + len(slot.generated))

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

    # ---- the batch, step by step
    def busy(self, work: Callable[[], None]) -> None:
        self._busy(work)

    def start(self, slot: Slot) -> None:
        request = slot.request
        if not self._batch.slots:
            reset_peak(self.device)  # the CUDA peak is the batch's, from its first request
        prompt = list(request.prompt_ids)
        cache, reused = self._reuse(request.session_id, prompt)
        slot.stats.reused_tokens = reused
        slot.state = _Seq(prompt, cache, reused, reused, _Sampler(request, prompt, self.device), RssPeak())

    def prefill(self, slot: Slot) -> bool:
        seq: _Seq = slot.state
        end = min(seq.filled + admission.PREFILL_CHUNK, len(seq.prompt))
        try:
            with torch.inference_mode():
                ids = torch.tensor([seq.prompt[seq.filled : end]], device=self.device)  # (1, chunk)
                logits = self._forward(input_ids=ids, cache=seq.cache)  # (1, vocab)
                seq.filled = end
                slot.stats.prefilled_tokens = end - seq.reused  # so far: a cancel between chunks reports it
                if end == len(seq.prompt):
                    seq.last = seq.sampler(logits)
                    slot.ready = True
                    slot.record(seq.last)
        except torch.OutOfMemoryError as e:
            log.warning("runner: request %s ran out of memory in prefill: %s", slot.handle.id, _first_line(e))
            return False
        return True

    def decode(self, slots: list[Slot]) -> bool:
        batch = self._batch
        length = batch.length
        t0 = time.perf_counter()
        try:
            with torch.inference_mode():
                for slot in slots:
                    if slot not in batch.slots:
                        batch.join(slot, slot.state.cache)  # all or nothing, so an OOM here leaves it out
                        slot.state.cache = None
                        length = batch.length
                rows = batch.slots
                assert set(rows) == set(slots), "the decoding slots are the rows of the batch"
                ids = torch.tensor([[slot.state.last] for slot in rows], device=self.device)  # (B, 1)
                mask, positions = batch.mask_and_positions(self.device)  # (B, L+1), (B, 1); None: no pads
                t1 = time.perf_counter()
                logits = self._forward(input_ids=ids, cache=batch.cache, attention_mask=mask, position_ids=positions)
                rss = rss_bytes()
                t2 = time.perf_counter()
                for i, slot in enumerate(rows):
                    seq: _Seq = slot.state
                    seq.last = seq.sampler(logits[i : i + 1])
                    seq.rss.peak = max(seq.rss.peak, rss)
                    slot.record(seq.last)
        except torch.OutOfMemoryError as e:
            log.warning("runner: a batch of %d ran out of memory in decode: %s", len(slots), _first_line(e))
            batch.crop(length)
            return False
        t3 = time.perf_counter()
        self.timing.add(t0, t1, t2, t3)
        return True

    def release(self, slot: Slot, keep: bool) -> None:
        seq: _Seq | None = slot.state
        if seq is None:
            return  # it never started
        cache = self._batch.leave(slot) if slot in self._batch.slots else seq.cache
        slot.state = None
        if keep and cache is not None:
            self._keep(slot, seq, cache)
        slot.stats.kv_store_bytes = self.kv.total_bytes
        slot.stats.mem = memory_snapshot(self.device, peak_rss=seq.rss.peak)

    # ---- session caches
    def _reuse(self, session_id: str | None, prompt: list[int]):
        """(cache, reused): the session's cache cropped to its longest common prefix with the prompt,
        leaving >= 1 token to prefill; a new empty cache when nothing is reusable."""
        entry = self.kv.take(session_id) if session_id else None
        if entry is not None:
            reused = reusable(entry.ids, prompt)
            cache, held = entry.cache, entry.cache.get_seq_length()
            assert held == len(entry.ids), f"cache holds {held} tokens but records {len(entry.ids)} ids"
            if reused > 0:
                if held > reused:
                    cache.crop(-(held - reused))
                return cache, reused
        return self._new_cache(self.model.config), 0

    def _keep(self, slot: Slot, seq: _Seq, cache) -> None:
        """Keep the cache for the session's next turn; `Slot.fed_ids` says which ids it holds."""
        finish = slot.finish
        held_ids = slot.fed_ids(seq.prompt, seq.filled)
        assert cache.get_seq_length() == len(held_ids), (
            f"cache {cache.get_seq_length()} != ids {len(held_ids)} ({finish})"
        )
        if slot.request.session_id:
            compact(cache)  # an idle session holds its tokens and a little room, not a block
        slot.stats.kv_session_bytes = cache_nbytes(cache)
        if slot.request.session_id:
            self.kv.put(slot.request.session_id, held_ids, cache, slot.stats.kv_session_bytes)

    def _forward(self, **inputs):
        """The model's logits of each row's last position, (B, vocab); the fault hook sees every pass."""
        if self.fault is not None:
            self.fault(self.forwards)
        self.forwards += 1
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
        for source, target in zip(self.cache.layers, own.layers, strict=True):
            target.lazy_initialization(source.keys, source.values)
            target.keys = source.keys[i : i + 1, :, pad:, :].clone()
            target.values = source.values[i : i + 1, :, pad:, :].clone()
            source.keys = source.keys.index_select(0, index)[:, :, trim:, :]
            source.values = source.values.index_select(0, index)[:, :, trim:, :]
        self.slots = [self.slots[j] for j in keep]
        self.pads = [self.pads[j] - trim for j in keep]
        return own

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


def _dynamic_cache(config) -> DynamicCache:
    return DynamicCache(config=config)


def _call(work: Callable[[], None]) -> None:
    work()


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


def _first_line(e: BaseException) -> str:
    return str(e).splitlines()[0][:200] if str(e) else type(e).__name__


class _Sampler:
    """Greedy or temperature/top-p sampling with a repetition penalty over prompt + generated."""

    def __init__(self, request: GenerationRequest, prompt: list[int], device: str):
        from transformers import (
            LogitsProcessorList,
            RepetitionPenaltyLogitsProcessor,
            TemperatureLogitsWarper,
            TopPLogitsWarper,
        )

        self.greedy = request.temperature <= 0
        procs = []
        if request.repetition_penalty and request.repetition_penalty != 1.0:
            procs.append(RepetitionPenaltyLogitsProcessor(request.repetition_penalty))
        if not self.greedy:
            procs.append(TemperatureLogitsWarper(request.temperature))
            if request.top_p < 1.0:
                procs.append(TopPLogitsWarper(request.top_p))
        self.procs = LogitsProcessorList(procs)
        # prompt + generated ids, for the penalty: filled in place, one column per step
        self._ids = torch.empty(1, len(prompt) + request.max_new_tokens + 1, dtype=torch.long, device=device)
        self._ids[0, : len(prompt)] = torch.tensor(prompt, dtype=torch.long)
        self._n = len(prompt)
        self.gen = None
        if not self.greedy:
            self.gen = torch.Generator(device=device)
            self.gen.manual_seed(request.seed if request.seed is not None else int(time.time_ns() % 2**31))

    def __call__(self, logits) -> int:
        """(1, vocab) logits -> the next id."""
        scores = self.procs(self._ids[:, : self._n], logits.float()) if len(self.procs) else logits.float()
        if self.greedy:
            nxt = int(scores.argmax(dim=-1)[0])
        else:
            probs = torch.softmax(scores, dim=-1)
            nxt = int(torch.multinomial(probs, 1, generator=self.gen)[0, 0])
        if self._n < self._ids.shape[1]:
            self._ids[0, self._n] = nxt
            self._n += 1
        return nxt


def local_engine(
    model,
    device: str,
    kv: KVStore,
    limits: EngineLimits,
    kv_bytes_per_token: int,
    fault: Callable[[int], None] | None = None,
    gpu: Callable | None = None,
) -> Engine:
    """An engine over a loaded transformers model (this module imports torch)."""
    runner = LocalRunner(
        model,
        device,
        kv,
        kv_bytes_per_token,
        mem_limit_bytes=limits.mem_limit_bytes,
        mem_margin_bytes=limits.mem_margin_bytes,
        fault=fault,
        gpu=gpu,
    )
    return Engine(runner, kv, limits)
