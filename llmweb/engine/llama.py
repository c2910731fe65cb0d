"""The native CPU runner: llama.cpp (through `llama-cpp-python`'s low-level API) on the GGUF file as it ships.

Why: on the CPU, a decode step of the transformers path is the model's forward pass in eager
PyTorch (int8 products, attention, a 49,152-wide fp32 output layer read every step), ~6x slower
than llama.cpp's kernels on the same GGUF file (README "CPU engines"). This runner keeps the
engine's whole contract (engine/request.py `Runner`), so the scheduler, the fair queue, admission,
cancel, time limits, the session KV store and the stats are the ones the transformers path uses:

    one llama_context       n_seq_max = the batch size; its KV cells are one unified pool of
                            `n_ctx` = n_seq_max x the context limit, shared by the running slots
    start(slot)             a free sequence id; the session's saved KV state (host bytes, from
                            `kv`) is restored into it and cut to the longest common prefix with
                            the prompt (`llama_memory_seq_rm`)
    prefill(slot)           one `llama_decode` of the next prompt chunk (PREFILL_CHUNK tokens,
                            BACKGROUND_CHUNK for a background request)
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

Owns: the llama.cpp model and context, its batch and the slots' sequences, sampling from its
logits. Must not: import torch, choose what runs or when (the scheduler does), or raise an
out-of-memory condition to the engine.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from llmweb.engine.kvcache import KVStore, reusable
from llmweb.engine.request import EngineLimits, GenerationRequest, Slot
from llmweb.engine.scheduler import Engine
from llmweb.engine.telemetry import RssPeak, StepTiming, memory_snapshot, rss_bytes
from llmweb.errors import LlmwebError

log = logging.getLogger(__name__)

PREFILL_CHUNK = 256  # prompt tokens per llama_decode: ~1 s on 2 cores, so the batch goes on between chunks
# a background prompt's (a summary, a whole-document step) chunk: a visitor who arrives while one
# runs waits for it to end, so it is a quarter of the size (~0.25 s); prefill is compute-bound here,
# so the smaller chunks cost the background little
BACKGROUND_CHUNK = 64
KV_DTYPE_BYTES = 2  # llama.cpp's default KV cache type is f16

_GGML_LOG_WARN, _GGML_LOG_ERROR = 3, 4  # ggml.h's enum ggml_log_level
_backend_lock = threading.Lock()
_backend_ready = False
_log_callback = None  # kept alive: llama.cpp holds the pointer


def available() -> str | None:
    """None when llama-cpp-python imports here; else why not (the status line says it)."""
    try:
        import llama_cpp  # noqa: F401
    except (ImportError, OSError, RuntimeError) as e:  # OSError: the shared library failed to load
        return f"llama-cpp-python is not usable here ({type(e).__name__}: {str(e)[:160]})"
    return None


def openmp_note() -> str:
    """A warning for the status line when this llama.cpp was built with OpenMP, else "".

    torch ships its own libgomp under the same name, so one OpenMP runtime serves both. Once torch
    has run in another thread (the embedder, a transformers model), there are more OpenMP threads
    than cores, libgomp stops spinning at barriers, and each of llama.cpp's hundreds of barriers
    per token sleeps and wakes: on 2 cores decode fell from ~95 to ~50 tok/s. pre-requirements.txt
    builds it without OpenMP (ggml's own thread pool); an older install may still have it."""
    import llama_cpp as ll

    if b"OPENMP = 1" not in ll.llama_print_system_info():
        return ""
    return (
        "llama.cpp here was built with OpenMP, which torch's OpenMP slows (decode ~2x slower beside the "
        "embedder): reinstall it with `pip install --force-reinstall --no-deps --no-cache-dir -r pre-requirements.txt`."
    )


def _init_backend() -> None:
    """llama_backend_init once per process, with llama.cpp's own log sent to ours (warnings and up)."""
    global _backend_ready, _log_callback
    import llama_cpp as ll

    with _backend_lock:
        if _backend_ready:
            return

        @ll.llama_log_callback
        def _to_logging(level: int, text: bytes, _data) -> None:
            if level in (_GGML_LOG_WARN, _GGML_LOG_ERROR) and text:
                log.warning("llama.cpp: %s", text.decode("utf-8", "replace").rstrip())

        _log_callback = _to_logging
        ll.llama_log_set(_to_logging, ctypes.c_void_p(0))
        ll.llama_backend_init()
        _backend_ready = True


def default_threads() -> int:
    """The cores this process may run on (llama.cpp's own default is a fixed 4)."""
    try:
        return max(len(os.sched_getaffinity(0)), 1)
    except AttributeError:  # not Linux
        return max(os.cpu_count() or 1, 1)


# LLMWEB_GGUF_REQUANT: llama.cpp's own quantiser re-encodes the GGUF file into a type whose CPU
# kernels run faster (README "Re-encoding the GGUF file"). Q8_0 holds a 4-bit file's weights almost
# exactly; Q4_0 (faster still) re-rounds them, and halved bench fidelity's right answers: not offered.
REQUANT_TYPES = {"q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0"}


def requantised(source: Path, kind: str, folder: Path, threads: int, progress: Callable[[str], None]) -> Path:
    """`source` re-encoded as `kind` by llama.cpp's quantiser, made once into `folder` and reused
    while the source is unchanged (the copy's name carries a hash of the source's path, size and
    mtime; an older copy of the same source is removed). Written to a temporary name and renamed,
    so an interrupted start leaves no half file to load."""
    import hashlib

    import llama_cpp as ll

    _init_backend()
    st = source.stat()
    stamp = hashlib.sha256(f"{source.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:12]
    target = folder / f"{source.stem}.{kind}-{stamp}.gguf"
    if target.is_file():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    progress(f"First start with LLMWEB_GGUF_REQUANT={kind}: re-encoding {source.name} as {kind.upper()} (once)…")
    t0 = time.perf_counter()
    tmp = folder / f".{target.name}.tmp-{os.getpid()}-{threading.get_ident()}"
    params = ll.llama_model_quantize_default_params()
    params.ftype = getattr(ll, REQUANT_TYPES[kind])
    params.allow_requantize = True
    params.nthread = threads
    try:
        rc = ll.llama_model_quantize(str(source).encode(), str(tmp).encode(), params)
        if rc != 0 or not tmp.is_file():
            raise LlmwebError(f"llama.cpp could not re-encode {source.name} as {kind} (llama_model_quantize: {rc}).")
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    for old in folder.glob(f"{source.stem}.{kind}-*.gguf"):
        if old != target:
            old.unlink(missing_ok=True)
    progress(f"Re-encoded {source.name} as {kind.upper()} in {time.perf_counter() - t0:.1f} s.")
    return target


class GgufModel:
    """A GGUF file loaded by llama.cpp (weights memory-mapped as they ship: no conversion)."""

    def __init__(self, path: Path, threads: int = 0):
        import llama_cpp as ll

        _init_backend()
        self.path = Path(path)
        self.threads = threads or default_threads()
        params = ll.llama_model_default_params()
        params.n_gpu_layers = 0
        self.ptr = ll.llama_model_load_from_file(str(self.path).encode(), params)
        if not self.ptr:
            raise LlmwebError(f"llama.cpp could not load {self.path.name}: is it a GGUF file?")
        self.n_layer = ll.llama_model_n_layer(self.ptr)
        self.n_head = ll.llama_model_n_head(self.ptr)
        self.n_head_kv = ll.llama_model_n_head_kv(self.ptr)
        self.n_embd = ll.llama_model_n_embd(self.ptr)
        self.n_ctx_train = ll.llama_model_n_ctx_train(self.ptr)
        self.n_vocab = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(self.ptr))
        self.size_bytes = int(ll.llama_model_size(self.ptr))
        self.type_name = _model_desc(self.ptr)

    @property
    def kv_bytes_per_token(self) -> int:
        """layers x kv heads x head dim x 2 (keys and values) x 2 bytes (f16)."""
        return self.n_layer * self.n_head_kv * (self.n_embd // self.n_head) * 2 * KV_DTYPE_BYTES

    def tokenize(self, text: str, special: bool = True) -> list[int]:
        """llama.cpp's own tokenisation (tests check it matches the transformers tokenizer's)."""
        import llama_cpp as ll

        vocab = ll.llama_model_get_vocab(self.ptr)
        data = text.encode("utf-8")
        room = len(data) + 8
        out = (ll.llama_token * room)()
        n = ll.llama_tokenize(vocab, data, len(data), out, room, False, special)
        return list(out[: max(n, 0)])

    def close(self) -> None:
        import llama_cpp as ll

        if self.ptr:
            ll.llama_model_free(self.ptr)
            self.ptr = None


def _model_desc(ptr) -> str:
    import llama_cpp as ll

    buf = ctypes.create_string_buffer(128)
    ll.llama_model_desc(ptr, buf, len(buf))
    return buf.value.decode("utf-8", "replace")


@dataclass(eq=False)
class _Seq:
    """One slot's sequence: its id in the context, its prompt, how far it is, its sampler."""

    seq: int
    prompt: list[int]
    reused: int
    filled: int
    sampler: _Sampler
    rss: RssPeak
    last: int = -1
    pos: int = 0  # the position of the next token fed


class LlamaRunner:
    """A GGUF model on the CPU through llama.cpp, `slots` sequences per decode step."""

    device = "cpu"

    def __init__(
        self,
        model: GgufModel,
        kv: KVStore,
        slots: int,
        context: int,
        *,
        mem_limit_bytes: int = 0,
        fault: Callable[[int], None] | None = None,
    ):
        import llama_cpp as ll

        self.ll = ll
        self.model = model
        self.kv = kv
        self.kv_bytes_per_token = model.kv_bytes_per_token
        self.mem_limit_bytes = mem_limit_bytes
        self.fault = fault  # test hook: called with the pass index before each llama_decode; MemoryError = OOM
        self.tap: Callable[[Slot, np.ndarray], None] | None = None  # test hook: each slot's logits before sampling
        self.forwards = 0
        self.timing = StepTiming()
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
        params.kv_unified = True  # one pool of cells: a long chat may use what short ones leave
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
        self._batch = ll.llama_batch_init(params.n_batch, 0, 1)
        self._free = list(range(self.slots))[::-1]  # sequence ids not in use
        self._running: dict[int, Slot] = {}

    def close(self) -> None:
        ll = self.ll
        if self.ctx:
            ll.llama_batch_free(self._batch)
            ll.llama_free(self.ctx)
            self.ctx = None

    # ---- memory
    def predict(self, request: GenerationRequest) -> int:
        return self.kv_bytes_per_token * (len(request.prompt_ids) + request.max_new_tokens)

    def held(self, slot: Slot) -> int:
        seq: _Seq | None = slot.state
        return 0 if seq is None else self.kv_bytes_per_token * (seq.filled + len(slot.generated))

    def available(self) -> int:
        """The pool's free cells in bytes (the running slots' tokens are taken), and no more than
        the room under the RSS limit, if one is set."""
        used = sum(self.held(s) for s in self._running.values())
        free = self.n_ctx * self.kv_bytes_per_token - used
        if self.mem_limit_bytes > 0:
            free = min(free, self.mem_limit_bytes - rss_bytes())
        return free

    def empty_cache(self) -> None:
        return None  # llama.cpp's buffers are allocated once, at the context's creation

    def snapshot(self):
        return memory_snapshot("cpu")

    def busy(self, work: Callable[[], None]) -> None:
        work()

    # ---- the batch, step by step
    def start(self, slot: Slot) -> None:
        assert self._free, f"more running slots than the context's {self.slots} sequences"
        seq_id = self._free.pop()
        self._running[seq_id] = slot
        request = slot.request
        prompt = list(request.prompt_ids)
        reused = self._restore(request.session_id, prompt, seq_id)
        slot.stats.reused_tokens = reused
        slot.state = _Seq(
            seq_id, prompt, reused, reused, _Sampler(request, prompt, self.n_vocab), RssPeak(), pos=reused
        )

    def prefill(self, slot: Slot) -> bool:
        seq: _Seq = slot.state
        end = min(seq.filled + (BACKGROUND_CHUNK if slot.request.background else PREFILL_CHUNK), len(seq.prompt))
        chunk = seq.prompt[seq.filled : end]
        last = end == len(seq.prompt)
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
        if not self._decode(slot.handle.id, "prefill"):
            return False
        seq.filled = seq.pos = end
        slot.stats.prefilled_tokens = end - seq.reused
        if last:
            seq.last = self._sample(slot, len(chunk) - 1)
            slot.ready = True
            slot.record(seq.last)
        return True

    def decode(self, slots: list[Slot]) -> bool:
        t0 = time.perf_counter()
        b = self._batch
        for i, slot in enumerate(slots):
            seq: _Seq = slot.state
            b.token[i] = seq.last
            b.pos[i] = seq.pos
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seq.seq
            b.logits[i] = 1
        b.n_tokens = len(slots)
        t1 = time.perf_counter()
        if not self._decode(None, f"decode of {len(slots)}"):
            return False
        rss = rss_bytes()
        t2 = time.perf_counter()
        for i, slot in enumerate(slots):
            seq = slot.state
            seq.pos += 1
            seq.last = self._sample(slot, i)
            seq.rss.peak = max(seq.rss.peak, rss)
            slot.record(seq.last)
        t3 = time.perf_counter()
        self.timing.add(t0, t1, t2, t3)
        return True

    def release(self, slot: Slot, keep: bool) -> None:
        seq: _Seq | None = slot.state
        if seq is None:
            return  # it never started
        slot.state = None
        try:
            if keep and slot.request.session_id:
                self._keep(slot, seq)
        finally:
            self.ll.llama_memory_seq_rm(self.mem, seq.seq, -1, -1)
            self._running.pop(seq.seq, None)
            self._free.append(seq.seq)
        slot.stats.kv_store_bytes = self.kv.total_bytes
        slot.stats.mem = memory_snapshot("cpu", peak_rss=seq.rss.peak)

    # ---- session caches: the sequence's KV as host bytes in `kv`
    def _restore(self, session_id: str | None, prompt: list[int], seq_id: int) -> int:
        """Restore the session's saved sequence into `seq_id`, cut to its longest common prefix with
        the prompt (>= 1 token left to prefill); the number of prompt tokens it serves."""
        entry = self.kv.take(session_id) if session_id else None
        if entry is None:
            return 0
        reused = reusable(entry.ids, prompt)
        if reused <= 0:
            return 0
        data: ctypes.Array = entry.cache
        read = self.ll.llama_state_seq_set_data(self.ctx, data, len(data), seq_id)
        if read == 0:  # no room in the pool for it now: prefill it all
            log.info("llama runner: the session's cache did not fit the pool; prefilling the whole prompt")
            self.ll.llama_memory_seq_rm(self.mem, seq_id, -1, -1)
            return 0
        self.ll.llama_memory_seq_rm(self.mem, seq_id, reused, -1)
        return reused

    def _keep(self, slot: Slot, seq: _Seq) -> None:
        """Save the sequence's state for the session's next turn; `Slot.fed_ids` says which ids it holds."""
        finish = slot.finish
        held_ids = slot.fed_ids(seq.prompt, seq.filled)
        top = self.ll.llama_memory_seq_pos_max(self.mem, seq.seq) + 1
        assert top == len(held_ids), f"sequence holds {top} positions but records {len(held_ids)} ids ({finish})"
        if not held_ids:
            return
        size = self.ll.llama_state_seq_get_size(self.ctx, seq.seq)
        data = (ctypes.c_uint8 * size)()
        written = self.ll.llama_state_seq_get_data(self.ctx, data, size, seq.seq)
        if written != size:
            log.warning("llama runner: saved %d of %d bytes of a session's state; not kept", written, size)
            return
        slot.stats.kv_session_bytes = size
        self.kv.put(slot.request.session_id or "", held_ids, data, size)

    # ---- llama.cpp
    def _decode(self, handle_id: int | None, what: str) -> bool:
        """One llama_decode of the filled batch; False when the pool has no room (the memory is as
        before). Any other failure is the engine's error, not an OOM."""
        try:
            if self.fault is not None:
                self.fault(self.forwards)
            self.forwards += 1
            rc = self.ll.llama_decode(self.ctx, self._batch)
        except MemoryError as e:
            log.warning("llama runner: %s ran out of memory: %s", what, e)
            return False
        if rc == 1:
            log.warning("llama runner: %s found no room in the KV pool (%d cells)", what, self.n_ctx)
            return False
        if rc != 0:
            raise LlmwebError(f"llama.cpp failed in {what} (llama_decode returned {rc}).")
        return True

    def _sample(self, slot: Slot, i: int) -> int:
        """The next id of `slot` from the logits of the batch's row `i`."""
        logits = np.ctypeslib.as_array(self.ll.llama_get_logits_ith(self.ctx, i), shape=(self.n_vocab,))
        if self.tap is not None:
            self.tap(slot, logits)
        return slot.state.sampler(logits)


def bare_greedy(model: GgufModel, ids: list[int], new_tokens: int) -> tuple[float, float, int]:
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


class _Sampler:
    """Greedy, or temperature and top-p, with a repetition penalty over prompt + generated (as
    transformers' processors: a seen id's logit is divided by the penalty if positive, multiplied
    if negative)."""

    def __init__(self, request: GenerationRequest, prompt: list[int], n_vocab: int):
        self.greedy = request.temperature <= 0
        self.temperature = request.temperature
        self.top_p = request.top_p
        self.penalty = request.repetition_penalty or 1.0
        self.seen = np.zeros(n_vocab, dtype=bool)
        if self.penalty != 1.0:
            self.seen[np.asarray(prompt, dtype=np.int64)] = True
        seed = request.seed if request.seed is not None else time.time_ns() % 2**31
        self.rng = None if self.greedy else np.random.default_rng(seed)

    def __call__(self, logits: np.ndarray) -> int:
        if self.penalty != 1.0:
            logits = logits.copy()
            seen = logits[self.seen]
            logits[self.seen] = np.where(seen < 0, seen * self.penalty, seen / self.penalty)
        if self.greedy:
            nxt = int(np.argmax(logits))
        else:
            nxt = self._sample(logits)
        self.seen[nxt] = True
        return nxt

    def _sample(self, logits: np.ndarray) -> int:
        assert self.rng is not None
        scores = logits.astype(np.float64) / self.temperature
        scores -= scores.max()
        probs = np.exp(scores)
        probs /= probs.sum()
        if self.top_p < 1.0:
            order = np.argsort(-probs)
            cum = np.cumsum(probs[order])
            keep = order[: int(np.searchsorted(cum, self.top_p)) + 1]  # the smallest set reaching top_p
            kept = probs[keep] / probs[keep].sum()
            return int(keep[self.rng.choice(len(keep), p=kept)])
        return int(self.rng.choice(len(probs), p=probs))


def llama_engine(
    model: GgufModel,
    kv: KVStore,
    limits: EngineLimits,
    context: int,
    fault: Callable[[int], None] | None = None,
) -> Engine:
    """An engine over a GGUF model on llama.cpp: one sequence per batch slot, `context` tokens each."""
    runner = LlamaRunner(model, kv, limits.max_batch, context, mem_limit_bytes=limits.mem_limit_bytes, fault=fault)
    return Engine(runner, kv, limits)
