"""GGUF files on llama.cpp: loading one (GgufModel: the weights memory-mapped as they ship, the ids its
metadata names as ends), re-encoding one with llama.cpp's own quantiser (LLMWEB_GGUF_REQUANT:
`requantised`), the stamp that names a copy made from one (`file_stamp`), and the process-wide
parts (the backend's one init with llama.cpp's log sent to ours, whether llama-cpp-python is usable
here, the OpenMP warning, the default thread count).

Must not: run a request (engine/runners/llama_cpp.py does) or import torch. llama_cpp is imported
inside the functions, so importing this module needs no llama-cpp-python.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from llmweb.errors import LlmwebError

log = logging.getLogger(__name__)

KV_DTYPE_BYTES = 2  # llama.cpp's default KV cache type is f16
# the metadata keys whose token ends a reply: the eos, the end of a turn, the end of a message (Llama 3.1's tool calls)
END_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")

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


def init_backend() -> None:
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
# kernels run faster (docs/benchmarks.md "Re-encoding the GGUF file"). Q8_0 holds a 4-bit file's
# weights almost exactly; Q4_0 (faster still) re-rounds them, and halved bench fidelity's right
# answers: not offered.
REQUANT_TYPES = {"q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0"}
# what `auto` re-encodes: the types llama.cpp has no repacked CPU kernels for and Q8_0 holds
# exactly. The embedded Q4_1 file prefills ~2x faster as Q8_0 on 2 cores (~500 against ~250 tok/s
# in llama-bench) and decodes as fast, at 136 instead of 92 MiB. Q4_0 and Q4_K are repacked (they
# prefill faster than Q8_0 as they ship); a Q8_0 or 16-bit file would gain nothing.
AUTO_REQUANT = {"Q4_1": "q8_0"}


def requant_kind(setting: str, file_type: str) -> str | None:
    """The type LLMWEB_GGUF_REQUANT=`setting` re-encodes a file of `file_type` ("Q4_1", llama.cpp's
    name) into, or None: served as it ships (`none`/`off`, or `auto` for a type it leaves)."""
    if setting == "auto":
        return AUTO_REQUANT.get(file_type)
    return setting if setting in REQUANT_TYPES else None


def requantised(source: Path, kind: str, folder: Path, threads: int, progress: Callable[[str], None]) -> Path:
    """`source` re-encoded as `kind` by llama.cpp's quantiser, made once into `folder` and reused
    while the source is unchanged (the copy's name carries a hash of the source's path, size and
    mtime; an older copy of the same source is removed). Written to a temporary name and renamed,
    so an interrupted start leaves no half file to load."""
    import llama_cpp as ll

    init_backend()
    target = folder / f"{source.stem}.{kind}-{file_stamp(source)}.gguf"
    if target.is_file():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    progress(f"First start: re-encoding {source.name} as {kind.upper()} for faster CPU kernels (once)…")
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


def file_stamp(path: Path) -> str:
    """12 hex digits of a hash of the file's path, size and mtime: a copy made from the file is named
    with it, so a changed file (new size or time) gets a new copy and never an older one's."""
    import hashlib

    st = path.stat()
    return hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:12]


class GgufModel:
    """A GGUF file loaded by llama.cpp (weights memory-mapped as they ship: no conversion)."""

    def __init__(self, path: Path, threads: int = 0):
        import llama_cpp as ll

        init_backend()
        self.path = Path(path)
        self.threads = threads or default_threads()
        self.fixed_threads = bool(threads)  # LLMWEB_THREADS: no governor (runners/threads.py)
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
        self.end_ids = self._end_ids()

    def meta(self, key: str) -> str | None:
        """The file's metadata value under `key`, as text; None where the file has none."""
        import llama_cpp as ll

        buf = ctypes.create_string_buffer(256)
        n = ll.llama_model_meta_val_str(self.ptr, key.encode(), buf, len(buf))
        return buf.value.decode("utf-8", "replace") if n >= 0 else None

    def _end_ids(self) -> tuple[int, ...]:
        """The ids the file's metadata names as ends (END_KEYS), in the vocabulary (the chat keeps
        the special ones: chat/tokens.py)."""
        ids = [self.meta(key) for key in END_KEYS]
        return tuple(dict.fromkeys(int(v) for v in ids if v is not None and v.isdigit() and int(v) < self.n_vocab))

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
