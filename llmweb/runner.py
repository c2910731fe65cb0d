"""The local model runner: the only part of the engine that touches torch and the model.

The engine (engine.py: queue, fairness, admission, cancel, time limits) decides WHAT runs; this
runner runs one request on the model and reports what it measured:

    predict(request) -> bytes         the request's peak memory (KV for prompt + max_new_tokens,
                                      plus an activation margin): admission control's figure
    available() -> bytes              free device memory (CUDA) or room under the RSS limit (CPU)
    generate(handle, request, predicted, timeout) -> GenerationStats | None
                                      2) reuse the session's KV cache: crop it to the longest
                                         common prefix with the prompt, prefill only the rest (in
                                         chunks, to bound activation memory);
                                      3) decode token by token under `torch.inference_mode()`,
                                         streaming ids to the handle, checking cancel / time limit
                                         between steps;
                                      4) store the session's cache (prompt + generated[:-1]).
                                      None when the device ran out of memory (see below).
    empty_cache(), fragmentation()    allocator housekeeping (CUDA; no-ops elsewhere)

`torch.OutOfMemoryError` is caught here and turned into None, and on purpose by returning, not
raising: while an OOM exception is alive, its traceback holds the frames of the failed forward
pass, with this request's KV cache and activations. Once the handler returns they are freed,
before the engine empties the allocator cache and retries with a smaller request.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch
from transformers import DynamicCache

from . import engine
from .engine import GenerationRequest, Handle, predict_bytes, stop_reason
from .kvcache import KVStore, cache_nbytes, reusable
from .records import GenerationStats
from .telemetry import RssPeak, is_cuda, memory_snapshot, reset_peak, rss_bytes

log = logging.getLogger(__name__)


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
    ):
        self.model = model
        self.device = device
        self.kv = kv
        self.kv_bytes_per_token = kv_bytes_per_token
        self.mem_limit_bytes = mem_limit_bytes  # CPU: RSS limit; 0 = no limit
        self.mem_margin_bytes = mem_margin_bytes  # CUDA: keep this much free
        self.fault = fault  # test hook: called with the forward-pass index before each forward
        if gpu is not None:  # e.g. @spaces.GPU on ZeroGPU Spaces: the GPU entry point is one generation
            self._generate = gpu(self._generate)  # type: ignore[method-assign]

    # ---- memory
    def predict(self, request: GenerationRequest) -> int:
        heads = getattr(getattr(self.model, "config", None), "num_attention_heads", 0) or 0
        kv, activation = predict_bytes(self.kv_bytes_per_token, heads, len(request.prompt_ids), request.max_new_tokens)
        return kv + activation

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

    # ---- one generation
    def generate(
        self, handle: Handle, request: GenerationRequest, predicted: int, timeout: float
    ) -> GenerationStats | None:
        try:
            return self._generate(handle, request, predicted, timeout)
        except torch.OutOfMemoryError as e:
            log.warning("runner: request %s ran out of memory: %s", handle.id, str(e).splitlines()[0][:200])
            return None

    def _generate(self, handle: Handle, request: GenerationRequest, predicted: int, timeout: float) -> GenerationStats:
        stats = GenerationStats(prompt_tokens=len(request.prompt_ids), predicted_bytes=predicted)
        reset_peak(self.device)
        run = _Run(self, handle, request, timeout)
        prompt = list(request.prompt_ids)
        cache = None
        try:
            with torch.inference_mode():
                cache, reused = self._reuse(request.session_id, prompt)  # 2) the session's cache
                stats.reused_tokens = reused
                logits, filled, stop = run.prefill(cache, prompt, reused)  # 2) the rest of the prompt
                stats.prefilled_tokens = filled - reused
                generated, finish = run.decode(logits, cache, prompt, stop, stats)  # 3)
                del logits
                self._keep(request.session_id, cache, prompt, filled, generated, finish, stats)  # 4)
                cache = None
        except BaseException:
            cache = None  # free this request's cache before anyone retries
            raise
        stats.kv_store_bytes = self.kv.total_bytes
        stats.mem = memory_snapshot(self.device, peak_rss=run.rss.peak)
        return stats

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
        return DynamicCache(config=self.model.config), 0

    def _keep(
        self,
        session_id: str | None,
        cache,
        prompt: list[int],
        filled: int,
        generated: list[int],
        finish: str,
        stats: GenerationStats,
    ) -> None:
        """Keep the cache for the session's next turn. Every generated token but the last was fed
        back; after a stop token, all kept ones were (it was not kept). A prefill stopped early
        holds only the prompt's first `filled` tokens."""
        if filled < len(prompt):
            held_ids = prompt[:filled]
        else:
            held_ids = prompt + (generated if finish == "eos" else generated[:-1])
        assert cache.get_seq_length() == len(held_ids), (
            f"cache {cache.get_seq_length()} != ids {len(held_ids)} ({finish})"
        )
        stats.kv_session_bytes = cache_nbytes(cache)
        if session_id:
            self.kv.put(session_id, held_ids, cache, stats.kv_session_bytes)


class _Run:
    """One request's forward passes: chunked prefill, then token-by-token decode with streaming."""

    def __init__(self, runner: LocalRunner, handle: Handle, request: GenerationRequest, timeout: float):
        self.runner, self.handle, self.request, self.timeout = runner, handle, request, timeout
        self.t0 = time.perf_counter()
        self.rss = RssPeak()
        self.forwards = 0

    def forward(self, ids_2d, cache):
        """(1, n) ids -> (1, vocab) logits of the last position; the fault hook sees every pass."""
        if self.runner.fault is not None:
            self.runner.fault(self.forwards)
        self.forwards += 1
        return self.runner.model(input_ids=ids_2d, cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1, :]

    def stop(self) -> str | None:
        return stop_reason(self.handle, self.t0, self.timeout)

    def prefill(self, cache, prompt: list[int], reused: int):
        """(logits, filled, stop): the prompt after `reused` in chunks; a cancel or the time limit
        stops between chunks (then `filled` < len(prompt) and `stop` says why)."""
        chunk, n_rest = engine.PREFILL_CHUNK, len(prompt) - reused
        rest = torch.tensor([prompt[reused:]], device=self.runner.device)  # (1, n_rest)
        filled, stop, logits = reused, None, None
        for start in range(0, n_rest, chunk):
            if start and (stop := self.stop()):
                break
            logits = self.forward(rest[:, start : start + chunk], cache)  # (1, vocab)
            filled = reused + min(start + chunk, n_rest)
        return logits, filled, stop

    def decode(self, logits, cache, prompt: list[int], stop: str | None, stats: GenerationStats):
        """(generated ids, finish reason): sample, stream, feed back, until a stop id, the cap, a cancel
        or the time limit. Fills the timing figures of `stats`."""
        generated: list[int] = []
        finish, t_first = stop or "length", None
        request = self.request
        if stop is None:
            sampler = _Sampler(request, prompt, self.runner.device)
            for step in range(request.max_new_tokens):
                next_id = sampler(logits)
                if t_first is None:
                    t_first = time.perf_counter()
                    stats.ttft_s = t_first - self.t0
                if next_id in request.stop_ids:
                    finish = "eos"
                    break
                generated.append(next_id)
                self.handle._emit([next_id])
                self.rss.sample()
                if reason := self.stop():
                    finish = reason
                    break
                if step + 1 == request.max_new_tokens:
                    break
                logits = self.forward(torch.tensor([[next_id]], device=self.runner.device), cache)
        t_end = time.perf_counter()
        stats.finish_reason, stats.generated_tokens = finish, len(generated)
        if t_first is not None and len(generated) > 1:
            stats.decode_tok_s = (len(generated) - 1) / max(t_end - t_first, 1e-9)
        stats.total_s = t_end - self.t0
        return generated, finish


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
        self.ids = torch.tensor([prompt], device=device)  # (1, n) grows by one per step
        self.gen = None
        if not self.greedy:
            self.gen = torch.Generator(device=device)
            self.gen.manual_seed(request.seed if request.seed is not None else int(time.time_ns() % 2**31))

    def __call__(self, logits) -> int:
        scores = self.procs(self.ids, logits.float()) if len(self.procs) else logits.float()
        if self.greedy:
            nxt = int(scores.argmax(dim=-1)[0])
        else:
            probs = torch.softmax(scores, dim=-1)
            nxt = int(torch.multinomial(probs, 1, generator=self.gen)[0, 0])
        self.ids = torch.cat([self.ids, torch.tensor([[nxt]], device=self.ids.device)], dim=1)
        return nxt
