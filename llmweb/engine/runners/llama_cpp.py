"""The native CPU runner: llama.cpp (through `llama-cpp-python`'s low-level API) on the GGUF file as it ships.

Why: on the CPU, a decode step of the transformers path is the model's forward pass in eager
PyTorch (int8 products, attention, a 49,152-wide fp32 output layer read every step), ~6x slower
than llama.cpp's kernels on the same GGUF file (README "CPU engines"). This runner keeps the
engine's whole contract (engine/request.py `Runner`), so the scheduler, the fair queue, admission,
cancel, time limits, the session KV store and the stats are the ones the transformers path uses:

    one llama_context       n_seq_max = the batch size; its KV cells are a stream of the context
                            limit per sequence (`n_ctx` = n_seq_max x the context limit in all)
    start(slot)             a free sequence id; the session's saved KV state (host bytes, from
                            `kv`) is restored into it and cut to the longest common prefix with
                            the prompt (`llama_memory_seq_rm`); a sliding-window model's only
                            where its saved window reaches back to the cut
    prefill(slot)           one `llama_decode` of the next prompt chunk (PREFILL_CHUNK tokens,
                            SMALL_CHUNK when the scheduler asks: `Slot.small_chunks`, a
                            visitor's, and every background one)
                            on the slot's sequence; the last chunk asks for logits and samples
    decode(slots)           ONE `llama_decode` carrying one token per slot, each on its sequence
                            at its own position: the batch, with no padding
    release(slot, keep)     with `keep`, the sequence's KV is copied to host memory
                            (`llama_state_seq_get_data`) and stored in `kv` (TTL, byte budget,
                            LRU: engine/kvcache.py); the sequence is cleared for the next slot
    predict / held /        bytes of f16 KV per token x tokens; what is free is the pool's free
    available               cells (and the room under the RSS limit, if one is set)

`llama_decode` returning 1 ("no KV slot for the batch") is this runner's out-of-memory: it leaves
the memory as it was, and the runner returns False like the transformers runner after a CUDA OOM.

Owns: the llama.cpp context, its batch and the slots' sequences, the sessions' state as host
bytes. What every local runner does alike (session reuse, the step's timing, the stats, the
out-of-memory contract) is runners/base.py's; the GGUF file itself is engine/gguf.py's. Must not:
import torch, choose what runs or when (the scheduler does), or raise an out-of-memory condition to
the engine.
"""

from __future__ import annotations

import ctypes
import heapq
import logging
from dataclasses import dataclass

import numpy as np

from llmweb.engine.gguf import GgufModel
from llmweb.engine.kvcache import KVStore
from llmweb.engine.request import EngineLimits, GenerationRequest, Slot
from llmweb.engine.runners.base import BaseRunner, Seq
from llmweb.engine.runners.sampling import NumpySampler
from llmweb.engine.runners.threads import ThreadGovernor
from llmweb.engine.scheduler import Engine
from llmweb.engine.telemetry import rss_bytes
from llmweb.errors import LlmwebError

log = logging.getLogger(__name__)

PREFILL_CHUNK = 256  # prompt tokens per llama_decode: ~0.5-1 s on 2 cores, so the batch goes on between chunks
# the small chunk, when the scheduler asks for it (`Slot.small_chunks`: a visitor's prompt, and
# every background one): whoever arrives while a chunk runs waits for it to end, so it is a
# quarter of the size; prefill is compute-bound here, so the smaller chunks cost it little
SMALL_CHUNK = 64


@dataclass(eq=False, kw_only=True)
class _Seq(Seq):
    seq: int  # its sequence id in the context


class LlamaRunner(BaseRunner):
    """A GGUF model on the CPU through llama.cpp, `slots` sequences per decode step."""

    name = "llama runner"
    out_of_memory = (MemoryError,)
    shares_prefixes = True  # llama_state_seq_set_data reads the saved bytes
    small_chunk = SMALL_CHUNK  # a visitor's prompt, a background one (share.py)

    def __init__(self, model: GgufModel, kv: KVStore, slots: int, context: int, *, mem_limit_bytes: int = 0):
        import llama_cpp as ll

        super().__init__(kv, model.kv_bytes_per_token, mem_limit_bytes)
        self.ll = ll
        self.model = model
        self.slots = max(slots, 1)
        self.context = context
        self.n_ctx = self.slots * context
        params = ll.llama_context_default_params()
        params.n_ctx = self.n_ctx
        params.n_batch = max(PREFILL_CHUNK, self.slots)
        params.n_ubatch = params.n_batch
        params.n_seq_max = self.slots
        params.n_threads = model.threads
        params.n_threads_batch = model.threads
        # A stream of `context` cells per sequence, as `llama-server -np k` has them, not one unified
        # pool: each token then attends over its own chat's cells only, where a unified pool's attention
        # spans every running chat's. llama-batched-bench, 4 x (64 + 128) tokens on 2 cores: decode
        # 173-183 tok/s in streams, 137-156 unified. A chat never holds more than `context` anyway.
        params.kv_unified = False
        # Flash attention off: on the CPU its kernel takes the queries of a prompt chunk one at a
        # time, so a turn's 40 new tokens after a 1,600-token cached prefix took 360 ms with it and
        # 216 ms without (180 ms at 300 tokens either way): TTFT would grow 2x over a chat, not 1.2x.
        params.flash_attn_type = 0  # LLAMA_FLASH_ATTN_TYPE_DISABLED
        params.no_perf = True
        self.ctx = ll.llama_init_from_model(model.ptr, params)
        if not self.ctx:
            raise LlmwebError(f"llama.cpp could not create a context of {self.n_ctx} tokens for {model.path.name}.")
        self.mem = ll.llama_get_memory(self.ctx)
        self.n_vocab = model.n_vocab
        self.n_swa = ll.llama_model_n_swa(model.ptr)  # the sliding window, 0 without one
        self._batch = ll.llama_batch_init(params.n_batch, 0, 1)
        self._free = list(range(self.slots))  # sequence ids not in use, a heap: the lowest is taken first
        self._running: dict[int, Slot] = {}
        self._fed: list[Slot] = []  # the last decode batch's slots, in the order of its logits' rows
        self.moves = 0  # running sequences moved to a lower id (_compact)
        # decode threads: every core, one fewer while another process keeps a core busy (threads.py)
        self.governor = None if model.fixed_threads or model.threads < 2 else ThreadGovernor(model.threads)
        self.decode_threads = model.threads

    def close(self) -> None:
        ll = self.ll
        if self.ctx:
            ll.llama_batch_free(self._batch)
            ll.llama_free(self.ctx)
            self.ctx = None

    # ---- memory
    def predict(self, request: GenerationRequest) -> int:
        return self.kv_bytes_per_token * (len(request.prompt_ids) + request.max_new_tokens)

    def available(self) -> int:
        """The pool's free cells in bytes (the running slots' tokens are taken); nothing while the
        process is over its RSS limit, if one is set (idle session caches, kept as host bytes, are
        then evicted first). The pool itself is allocated, and cleared, when the context is made, so
        its cells are in the RSS already: counting a request's KV against the room under the limit
        too would count it twice."""
        used = sum(self.held(s) for s in self._running.values())
        free = self.n_ctx * self.kv_bytes_per_token - used
        if self.mem_limit_bytes > 0:
            over = rss_bytes() - self.mem_limit_bytes
            free = min(free, -over) if over > 0 else free
        return free

    # ---- the sequences
    def _chunk(self, request: GenerationRequest) -> int:
        return PREFILL_CHUNK

    def _open(self, request: GenerationRequest, prompt: list[int]) -> Seq:
        assert self._free, f"more running slots than the context's {self.slots} sequences"
        matcher = self.matcher(request, self.n_vocab)
        sampler = NumpySampler(request, prompt, self.n_vocab, self.pieces, matcher)
        return _Seq(prompt=prompt, sampler=sampler, seq=heapq.heappop(self._free))

    def start(self, slot: Slot) -> None:
        super().start(slot)
        self._running[slot.state.seq] = slot

    def _close_seq(self, seq: Seq) -> None:
        assert isinstance(seq, _Seq)
        self.ll.llama_memory_seq_rm(self.mem, seq.seq, -1, -1)
        self._running.pop(seq.seq, None)
        heapq.heappush(self._free, seq.seq)
        self._compact()

    def _compact(self) -> None:
        """Keep the running sequences on the lowest ids: a batch over KV streams runs as one pass of
        the model per run of consecutive ids, so when the middle one of three chats ends first, the
        other two would take two passes a step until a new chat fills the gap. The highest running
        sequence moves into the gap instead, as a session's cache moves (its cells' state, copied:
        tokens x kv_bytes_per_token, once: ~23 MB for 1,000 tokens of the embedded model)."""
        ll = self.ll
        while self._free and self._running and self._free[0] < (top := max(self._running)):
            gap = self._free[0]
            size = ll.llama_state_seq_get_size(self.ctx, top)
            data = (ctypes.c_uint8 * size)()
            if ll.llama_state_seq_get_data(self.ctx, data, size, top) != size:
                return
            if ll.llama_state_seq_set_data(self.ctx, data, size, gap) == 0:
                ll.llama_memory_seq_rm(self.mem, gap, -1, -1)
                return  # the sequence stays where it is: two passes a step, nothing lost
            ll.llama_memory_seq_rm(self.mem, top, -1, -1)
            heapq.heapreplace(self._free, top)
            slot = self._running.pop(top)
            slot.state.seq = gap
            self._running[gap] = slot
            self.moves += 1

    # ---- session caches: the sequence's KV as host bytes in `kv`
    def _restore(self, seq: Seq, entry, reused: int) -> int:
        """The saved state into the sequence, cut to its common prefix with the prompt."""
        assert isinstance(seq, _Seq)
        data: ctypes.Array = entry.cache
        read = self.ll.llama_state_seq_set_data(self.ctx, data, len(data), seq.seq)
        if read == 0:  # no room in the pool for it now: prefill it all
            log.info("llama runner: the session's cache did not fit the pool; prefilling the whole prompt")
            self.ll.llama_memory_seq_rm(self.mem, seq.seq, -1, -1)
            return 0
        # A sliding-window model's saved state holds only the window before its last token (llama.cpp
        # leaves out what that window masks), so a cut further back lacks keys the next tokens attend
        # to, and the reply would silently differ: prefill it all, as llama-server does.
        if self.n_swa and self.ll.llama_memory_seq_pos_min(self.mem, seq.seq) > max(reused - self.n_swa, 0):
            log.info("llama runner: the session's sliding-window cache does not reach back to the cut; prefilling")
            self.ll.llama_memory_seq_rm(self.mem, seq.seq, -1, -1)
            return 0
        self.ll.llama_memory_seq_rm(self.mem, seq.seq, reused, -1)
        return reused

    def _held_tokens(self, seq: Seq, cache) -> int:
        assert isinstance(seq, _Seq)
        return self.ll.llama_memory_seq_pos_max(self.mem, seq.seq) + 1

    def _save(self, seq: Seq, cache) -> tuple[ctypes.Array, int] | None:
        assert isinstance(seq, _Seq)
        size = self.ll.llama_state_seq_get_size(self.ctx, seq.seq)
        data = (ctypes.c_uint8 * size)()
        written = self.ll.llama_state_seq_get_data(self.ctx, data, size, seq.seq)
        if written != size:
            log.warning("llama runner: saved %d of %d bytes of a session's state; not kept", written, size)
            return None
        return data, size

    def export_cache(self, cache: ctypes.Array) -> bytes:
        return bytes(cache)  # the sequence's state, as llama_state_seq_get_data wrote it

    def import_cache(self, data: bytes) -> ctypes.Array:
        return (ctypes.c_uint8 * len(data)).from_buffer_copy(data)

    # ---- the passes: one llama_decode of the filled batch
    def _prefill(self, seq: Seq, chunk: list[int], last: bool) -> tuple[None, int] | None:
        assert isinstance(seq, _Seq)
        b = self._batch
        for i, token in enumerate(chunk):
            b.token[i] = token
            b.pos[i] = seq.filled + i
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seq.seq
            b.logits[i] = 0
        if last:
            b.logits[len(chunk) - 1] = 1
        b.n_tokens = len(chunk)
        return (None, len(chunk) - 1) if self._decode("prefill") else None

    def _feed(self, slots: list[Slot]) -> None:
        """One token per slot, in the order of their sequence ids: llama.cpp splits a batch over
        KV streams into one pass per run of consecutive ids (llama_batch_allocr::split_equal), so
        sequences 2, 0, 3, 1 in that order would take two passes of the whole model, not one."""
        b = self._batch
        self._fed = sorted(slots, key=lambda slot: slot.state.seq)  # the logits' rows, for _step
        for i, slot in enumerate(self._fed):
            seq: _Seq = slot.state
            b.token[i] = seq.last
            b.pos[i] = seq.pos
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seq.seq
            b.logits[i] = 1
        b.n_tokens = len(slots)
        return None  # a failed llama_decode leaves the memory as it was

    def _step(self, slots: list[Slot]) -> tuple[list[Slot], None] | None:
        if self.governor is not None and (n := self.governor.threads()) != self.decode_threads:
            self.ll.llama_set_n_threads(self.ctx, n, self.model.threads)  # prefill keeps every core
            log.info("llama runner: other processes use %.2f cores; decoding with %d threads", self.governor.others, n)
            self.decode_threads = n
        return (self._fed, None) if self._decode(f"decode of {len(slots)}") else None

    def _row(self, logits, i: int) -> np.ndarray:
        return np.ctypeslib.as_array(self.ll.llama_get_logits_ith(self.ctx, i), shape=(self.n_vocab,))

    def _decode(self, what: str) -> bool:
        """One llama_decode of the filled batch; False when the pool has no room (the memory is as
        before). Any other failure is the engine's error, not an OOM."""
        rc = self.ll.llama_decode(self.ctx, self._batch)
        if rc == 1:
            log.warning("llama runner: %s found no room in the KV pool (%d cells)", what, self.n_ctx)
            return False
        if rc != 0:
            raise LlmwebError(f"llama.cpp failed in {what} (llama_decode returned {rc}).")
        return True


def llama_engine(model: GgufModel, kv: KVStore, limits: EngineLimits, context: int) -> Engine:
    """An engine over a GGUF model on llama.cpp: one sequence per batch slot, `context` tokens each."""
    runner = LlamaRunner(model, kv, limits.max_batch, context, mem_limit_bytes=limits.mem_limit_bytes)
    return Engine(runner, kv, limits)
