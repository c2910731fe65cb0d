"""The on-disk format of an index namespace, and the locks and atomic writes that keep it whole.

A namespace is the folder `settings.data_dir / "index" / namespace` (`namespace_dir`). In it:
`vectors-<generation>.faiss` (IndexIDMap2 over IndexFlatIP), the chunk metadata
`meta-<generation>.json` (JSON, never pickle), the keyword index `fts-<generation>.sqlite3` (an
SQLite FTS5 database, see retrieval/keywords.py) and `MANIFEST.json`, which names the current
generation of all three. Every file is written to a temp file and moved into place with
`os.replace` (`atomic_write`); the manifest moves last. A crash at any point leaves the previous
manifest naming the previous, complete set, so the index on disk is always loadable and
self-consistent, and the keyword rows are always exactly the chunks of the published state
(checked by `load`: same generation, same chunk ids). An index written before the keyword file
existed gets one built in memory on load, and written with its next change.

Writers take a per-folder thread lock (`thread_lock_for`) plus an advisory file lock next to the
folder (`file_lock`), so a CLI ingest and a running server may share a data dir.

It owns `State` (an immutable snapshot of one namespace) and `DocumentInfo` as they are stored,
`load`/`save`/`clean` of a folder, and the namespaces' folders. It must not embed, parse documents
or rank anything (retrieval/index.py does), and imports faiss only inside functions.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmweb.config import Settings
from llmweb.errors import ConfigError, InputError
from llmweb.records import Chunk
from llmweb.retrieval.keywords import KeywordIndex

try:
    import fcntl
except ImportError:  # Windows: the in-process lock still holds; cross-process writers are not guarded
    fcntl = None  # type: ignore[assignment]

MANIFEST = "MANIFEST.json"
FORMAT = 1
_NAMESPACE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$")


@dataclass(frozen=True, slots=True)
class DocumentInfo:
    """One document in an index."""

    doc_id: str
    source: str
    chunks: int
    kind: str = "document"
    size: int = 0  # bytes of the original file (0 for non-file chunk sets)
    added: float = 0.0  # unix time


@dataclass(frozen=True, slots=True)
class State:
    """An immutable snapshot of one namespace. Never mutated once published."""

    generation: int = 0
    index: Any = None  # faiss.IndexIDMap2 | None
    chunks: dict = dataclasses.field(default_factory=dict)  # id -> Chunk
    docs: dict = dataclasses.field(default_factory=dict)  # doc_id -> DocumentInfo
    ids: dict = dataclasses.field(default_factory=dict)  # doc_id -> tuple of chunk ids
    next_id: int = 0
    signature: tuple | None = None  # MANIFEST.json's (inode, mtime, size) when loaded
    keywords: KeywordIndex | None = None  # exactly the ids and texts of `chunks`


@dataclass(frozen=True, slots=True)
class _Files:
    """What one generation's files hold, read as a set under one manifest."""

    manifest: dict
    meta: dict
    vectors: bytes
    keywords: bytes | None  # None: written before keyword indexes
    signature: tuple


# --------------------------------------------------------------------------- reading


def load(folder: Path, embedder_label: str) -> State:
    """The state the manifest in `folder` publishes (an empty State when there is none). Damaged or
    disagreeing files, and an index built by another embedder, are a ConfigError."""
    files = _read_files(folder)
    if files is None:
        return State()
    manifest = files.manifest
    if manifest.get("format") != FORMAT:
        raise damaged(folder, f"unknown format {manifest.get('format')!r}")
    if manifest.get("embedder") != embedder_label:
        raise ConfigError(
            f"The index in {folder} was built with the embedding model {manifest.get('embedder')!r}, "
            f"but LLMWEB_EMBEDDER now selects {embedder_label!r}. Set it back, or delete that "
            "folder and ingest the files again."
        )
    try:
        state, stored, keywords = _decode(files)
        in_keywords = keywords.ids()
    except Exception as e:  # faiss raises RuntimeError, sqlite3 DatabaseError; bad metadata KeyError/TypeError
        raise damaged(folder, f"{type(e).__name__}: {e}") from e
    listed = set().union(*state.ids.values()) if state.ids else set()
    if files.meta.get("generation") != state.generation or stored != set(state.chunks) or listed != set(state.chunks):
        raise damaged(folder, "its vectors and metadata disagree")
    if keywords.generation != state.generation or in_keywords != set(state.chunks):
        raise damaged(folder, "its keyword index and metadata disagree")
    return state


def _read_files(folder: Path) -> _Files | None:
    """The files the manifest names, read together; None when there is no manifest. Retried when
    another process moves to a newer generation (and deletes these files) while we read."""
    manifest_path = folder / MANIFEST
    for attempt in range(5):
        sig = signature(manifest_path)
        if sig is None:
            return None
        try:
            manifest = json.loads(manifest_path.read_text("utf-8"))
            meta = json.loads((folder / manifest["meta"]).read_text("utf-8"))
            blob = (folder / manifest["vectors"]).read_bytes()
            fts = (folder / manifest["keywords"]).read_bytes() if "keywords" in manifest else None
        except FileNotFoundError:  # another process moved to a newer generation meanwhile
            time.sleep(0.05 * (attempt + 1))
            continue
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise damaged(folder, f"{type(e).__name__}: {e}") from e
        return _Files(manifest, meta, blob, fts, sig)
    raise damaged(folder, "its files keep changing or are missing")


def _decode(files: _Files) -> tuple[State, set[int], KeywordIndex]:
    """The state the files describe, the chunk ids its vectors hold, and its keyword index (for
    `load` to compare with the metadata)."""
    import faiss
    import numpy as np

    index = faiss.deserialize_index(np.frombuffer(files.vectors, dtype=np.uint8))
    chunks: dict[int, Chunk] = {}
    for row in files.meta["chunks"]:
        row = dict(row)
        chunk_id = int(row.pop("id"))
        chunks[chunk_id] = Chunk(**row)
    docs, ids = {}, {}
    for row in files.meta["documents"]:
        row = dict(row)
        ids[row["doc_id"]] = tuple(int(i) for i in row.pop("ids"))
        docs[row["doc_id"]] = DocumentInfo(**row)
    generation = int(files.manifest["generation"])
    if files.keywords is not None:
        keywords = KeywordIndex.from_bytes(files.keywords)
    else:  # written before keyword indexes: build one; the next change writes it
        keywords = KeywordIndex.build(((i, c.text) for i, c in chunks.items()), generation)
    stored = set(faiss.vector_to_array(index.id_map).tolist())
    next_id = int(files.meta["next_id"])
    state = State(generation, index, chunks, docs, ids, next_id, files.signature, keywords)
    return state, stored, keywords


# --------------------------------------------------------------------------- writing


def save(folder: Path, state: State, embedder_label: str) -> None:
    """Write `state` as generation `state.generation`: its three files, then the manifest (the commit)."""
    import faiss

    folder.mkdir(parents=True, exist_ok=True)
    g = state.generation
    vectors, meta, keywords = f"vectors-{g:08d}.faiss", f"meta-{g:08d}.json", f"fts-{g:08d}.sqlite3"
    assert state.keywords is not None and state.keywords.generation == g, "the keyword index is not this state's"
    chunk_rows = []
    for chunk_id, c in state.chunks.items():
        row = dataclasses.asdict(c)
        row.pop("score")
        chunk_rows.append({"id": chunk_id, **row})
    doc_rows = [{**dataclasses.asdict(d), "ids": list(state.ids[d.doc_id])} for d in state.docs.values()]
    meta_doc = {
        "format": FORMAT,
        "generation": g,
        "next_id": state.next_id,
        "documents": doc_rows,
        "chunks": chunk_rows,
    }
    atomic_write(folder / vectors, faiss.serialize_index(state.index).tobytes())
    atomic_write(folder / meta, json.dumps(meta_doc, ensure_ascii=False).encode("utf-8"))
    atomic_write(folder / keywords, state.keywords.to_bytes())
    manifest = {
        "format": FORMAT,
        "generation": g,
        "vectors": vectors,
        "meta": meta,
        "keywords": keywords,
        "embedder": embedder_label,
        "dim": int(state.index.d),
        "chunks": len(state.chunks),
    }
    atomic_write(folder / MANIFEST, json.dumps(manifest, indent=1).encode("utf-8"))  # the commit


def clean(folder: Path, keep_from: int) -> None:
    """Delete generations older than `keep_from` and temp files left by failed writes."""
    for path in folder.iterdir():
        m = re.fullmatch(r"(?:vectors|meta|fts)-(\d+)\.(?:faiss|json|sqlite3)", path.name)
        stale = (m is not None and int(m.group(1)) < keep_from) or path.name.endswith(".tmp")
        if stale:
            with contextlib.suppress(OSError):
                path.unlink()


def damaged(folder: Path, why: str) -> ConfigError:
    return ConfigError(f"The index in {folder} cannot be read ({why}); delete that folder and ingest the files again.")


def signature(path: Path) -> tuple | None:
    """(inode, mtime, size) of `path`, None if it does not exist: a newer manifest changes it."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return (st.st_ino, st.st_mtime_ns, st.st_size)


def atomic_write(path: Path, data: bytes) -> None:
    """Write to a temp file in the same folder, fsync, then os.replace onto `path`."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    fsync_dir(path.parent)


def fsync_dir(folder: Path) -> None:
    """Make a rename in `folder` durable (where the OS can open a folder)."""
    if hasattr(os, "O_DIRECTORY"):
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


# --------------------------------------------------------------------------- namespaces and locks


def namespace_dir(settings: Settings, namespace: str) -> Path:
    """The folder of a namespace; the name must be a plain identifier (no path tricks)."""
    if not _NAMESPACE.match(namespace) or ".." in namespace:
        raise InputError(f"{namespace!r} is not a valid index name (letters, digits, '.', '_', '-').")
    return Path(settings.data_dir) / "index" / namespace


def delete_namespace(settings: Settings, namespace: str) -> bool:
    """Delete a namespace's folder; False if it did not exist. Open `Index`es see it empty."""
    folder = namespace_dir(settings, namespace)
    with thread_lock_for(folder), file_lock(folder):
        if not folder.exists():
            return False
        shutil.rmtree(folder)
        return True


def list_namespaces(settings: Settings) -> list[str]:
    root = Path(settings.data_dir) / "index"
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if p.is_dir() and (p / MANIFEST).exists())


_THREAD_LOCKS: dict[str, threading.RLock] = {}
_THREAD_LOCKS_GUARD = threading.Lock()


def thread_lock_for(folder: Path) -> threading.RLock:
    key = os.path.abspath(folder)
    with _THREAD_LOCKS_GUARD:
        return _THREAD_LOCKS.setdefault(key, threading.RLock())


@contextlib.contextmanager
def file_lock(folder: Path) -> Iterator[None]:
    """An advisory lock next to the namespace folder, for writers in other processes."""
    if fcntl is None:
        yield
        return
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f".{folder.name}.lock", "a+b") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
