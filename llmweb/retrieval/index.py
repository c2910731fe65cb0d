"""`Index`: a persistent, searchable set of chunks in one namespace folder; search and ingestion.

Contract:
- `Index(settings, namespace)` owns `settings.data_dir / "index" / namespace`: "docs" holds the
  user's documents; other namespaces (e.g. "recall-<conversation id>") hold other chunk sets and
  are removed with `delete_namespace` (retrieval/storage.py). It adds documents incrementally, skips
  content it already holds (same bytes = same `doc_id`), replaces an earlier version of a file with
  the same name, removes and lists documents, and answers `search(query, k, min_score) -> list[Chunk]`.
- `search` is dense only (cosine >= min_score), as before; `candidates` gives the raw material of
  hybrid ranking (the dense and the keyword rankings, and the query words' chunk counts) for
  retrieval/hybrid.py, which fuses them and decides whether anything is relevant at all.
- Concurrency: readers never block. The published state (`storage.State`) is immutable: a change
  clones it (`_apply`), writes the clone to disk (`storage.save`) and then swaps it in, under the
  folder's thread and file locks (a CLI ingest and a running server may share a data dir). An index
  notices a newer manifest written by another process on its next call. Embedding runs outside
  these locks.

The embedder is retrieval/embedder.py's; the files, their format and the locks are
retrieval/storage.py's. This module must not read or write those files itself, nor know about
owners (retrieval/library.py maps owners to namespaces). Nothing here imports torch, faiss or
sentence-transformers at module level.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from llmweb.config import Settings
from llmweb.errors import InputError
from llmweb.records import Chunk
from llmweb.retrieval import parsers, storage
from llmweb.retrieval.chunking import chunk_document
from llmweb.retrieval.embedder import Embedder
from llmweb.retrieval.keywords import KeywordIndex, Term
from llmweb.retrieval.parsers import SUPPORTED_SUFFIXES, Document, hash_bytes, read_file, safe_name
from llmweb.retrieval.scans import OcrLimits
from llmweb.retrieval.storage import MANIFEST, DocumentInfo, State, file_lock, namespace_dir, thread_lock_for

Progress = Callable[[int, int, str], None]  # (done, total, what) for a UI bar or tqdm
T = TypeVar("T")

DOCS = "docs"
COMMIT_EVERY_CHUNKS = 2048  # a long ingest saves its progress about this often
CANDIDATES = 20  # each ranking (dense, keyword) offers at least this many chunks to the fusion


# --------------------------------------------------------------------------- records


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
class Read:
    """Uploads read and parsed once (`Index.read_uploads`): each file's name as given, the parsed
    documents at their positions, and a report at the position of each file that failed."""

    given: list[str]
    docs: list[tuple[int, Document]]
    reports: dict[int, IngestReport]


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
        self._write_lock = thread_lock_for(self.dir)
        self._load_lock = threading.Lock()
        self._state: State | None = None

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

    def candidates(
        self, query: str, vector: Any, k: int, min_score: float | None = None, only: Collection[str] | None = None
    ) -> Candidates:
        """The dense and keyword rankings of `query` (embedded as `vector`, shape (1, dim)).

        Each ranking has at most max(k, CANDIDATES) chunks; min_score (default settings.min_score)
        is kept as `Candidates.floor`. `vector` may be None for an empty namespace, or one that holds
        none of `only` (the caller embeds once for several namespaces, and only if one has chunks).
        `only`: the doc ids a chat reads (None: every document): both rankings are of their chunks
        alone, FAISS's search filtered by an ID selector and FTS5's by rowid, so a chosen document
        is ranked as deep as if it were alone, however many others the namespace holds.
        """
        import numpy as np

        floor = self.settings.min_score if min_score is None else float(min_score)
        state = self._current()
        allowed = None if only is None else [i for d in only for i in state.ids.get(d, ())]
        if state.index is None or state.index.ntotal == 0 or not query.strip() or allowed == []:
            return Candidates([], [], [], 0)
        assert state.keywords is not None, "a non-empty state always has its keyword index"
        assert vector is not None, "a non-empty namespace needs the query vector"
        n = min(max(k, CANDIDATES), state.index.ntotal if allowed is None else len(allowed))
        if allowed is None:
            scores, ids = state.index.search(vector, n)
        else:
            import faiss

            chosen = faiss.IDSelectorBatch(np.asarray(allowed, dtype=np.int64))
            scores, ids = state.index.search(vector, n, params=faiss.SearchParameters(sel=chosen))
        dense = [
            dataclasses.replace(state.chunks[i], score=float(s))
            for s, i in zip(scores[0].tolist(), ids[0].tolist())
            if i >= 0 and i in state.chunks
        ]
        keyword = []
        for hit in state.keywords.search(query, n, allowed):
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
        return self.add_read(self.read_uploads(files, progress), progress)

    def read_uploads(
        self,
        files: Sequence[tuple[str | os.PathLike, str]],
        progress: Progress | None = None,
        admit: Admit | None = None,
    ) -> Read:
        """Read and parse uploaded files (temp path, the name the user gave), each once: what a caller
        may measure (a quota) before `add_read` chunks, embeds and commits the same documents. Content
        already indexed is not parsed again; `admit(name, bytes)` hears each other file before its
        parse and may refuse the upload (InputError)."""
        entries: list[tuple[Path | None, str, str | None]] = []
        for path, given in files:
            try:
                name = safe_name(given)
            except InputError as e:
                entries.append((None, str(given), str(e)))
                continue
            entries.append((Path(path), name, None))
        reports: dict[int, IngestReport] = {}
        docs = _load(entries, self.settings, progress, reports, self._current(), admit)
        return Read([str(given) for _, given in files], docs, reports)

    def add_read(self, read: Read, progress: Progress | None = None) -> list[IngestReport]:
        """Add what `read_uploads` parsed: one report per file, in order."""
        reports = dict(read.reports)
        self._add_docs(read.docs, reports, progress)
        out = []
        for n, given in enumerate(read.given):
            report = reports[n]
            if report.ok and given != report.name:
                report = dataclasses.replace(report, message=f"{report.message} (given as {given!r})")
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

        def find(state: State) -> DocumentInfo | None:
            return state.docs.get(doc) or next((d for d in state.docs.values() if d.source == doc), None)

        def change(base: State) -> tuple[State, DocumentInfo | None]:
            found = find(base)
            return (base, None) if found is None else (_apply(base, [], [found.doc_id]), found)

        removed = self._commit(change) if find(self._current()) is not None else None
        if removed is None:
            raise InputError(f"There is no document named {doc!r} in the library.")
        return removed

    def move_to(self, target: Index, doc_ids: Sequence[str]) -> int:
        """Move documents to `target` with their stored vectors (nothing is embedded again): added
        there first, then removed here, so a crash in between leaves a copy, never a loss. A document
        `target` already holds is only removed here. Returns how many left this index."""
        import numpy as np

        state = self._current()
        moving = [d for d in dict.fromkeys(doc_ids) if d in state.docs and state.ids.get(d)]
        if not moving:
            return 0
        pending = [
            _Pending(
                state.docs[d],
                [state.chunks[i] for i in state.ids[d]],
                np.vstack([state.index.reconstruct(int(i)) for i in state.ids[d]]),
            )
            for d in moving
        ]

        def add(base: State) -> tuple[State, None]:
            new = [p for p in pending if p.info.doc_id not in base.docs]
            return (_apply(base, new, []) if new else base), None

        def remove(base: State) -> tuple[State, int]:
            gone = [d for d in moving if d in base.docs]
            return (_apply(base, [], gone) if gone else base), len(gone)

        target._commit(add)
        return self._commit(remove)

    # -- internals -------------------------------------------------------------

    def _ingest_entries(
        self, entries: list[tuple[Path | None, str, str | None]], progress: Progress | None
    ) -> list[IngestReport]:
        """Read, chunk, embed and commit (path, display name, error) entries: one report each, in order."""
        reports: dict[int, IngestReport] = {}
        docs = _load(entries, self.settings, progress, reports, self._current())
        self._add_docs(docs, reports, progress)
        return [reports[n] for n in range(len(entries))]

    def _add_docs(
        self, docs: list[tuple[int, Document]], reports: dict[int, IngestReport], progress: Progress | None
    ) -> None:
        """Chunk, embed and commit parsed documents, each report at its document's position."""
        todo = _unseen(docs, self._current(), reports)  # before paying for embeddings
        if todo:
            prepared = self._chunk([doc for _, doc in todo])
            for (n, _), report in zip(todo, self._embed_and_commit(prepared, progress, replace_same_name=True)):
                reports[n] = report

    def _chunk(self, docs: list[Document]) -> list[tuple[DocumentInfo, list[Chunk]]]:
        """Each document's chunks (at most the embedder's word pieces), with its DocumentInfo."""
        limit = min(self.settings.chunk_tokens, self.embedder.max_tokens)
        now = time.time()
        prepared = []
        with self.embedder.borrowed_tokenizer() as tokenizer:  # not the embedder's lock: queries go on
            for doc in docs:
                cs = chunk_document(doc, tokenizer, max_tokens=limit, overlap=self.settings.chunk_overlap)
                prepared.append((DocumentInfo(doc.doc_id, doc.name, len(cs), size=doc.size, added=now), cs))
        return prepared

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

    def _current(self) -> State:
        """The latest state: ours, or a newer one another process wrote (checked by a stat)."""
        signature = storage.signature(self.dir / MANIFEST)
        state = self._state
        if state is not None and state.signature == signature:
            return state
        with self._load_lock:
            state = self._state
            if state is None or state.signature != storage.signature(self.dir / MANIFEST):
                state = storage.load(self.dir, self.embedder.label)
                self._state = state
        return state

    def _commit(self, change: Callable[[State], tuple[State, T]]) -> T:
        """Apply `change` to the latest state, write the result, then publish it."""
        with self._write_lock, file_lock(self.dir):
            base = self._current()
            new, result = change(base)
            if new is base:
                return result
            storage.save(self.dir, new, self.embedder.label)
            self._state = dataclasses.replace(new, signature=storage.signature(self.dir / MANIFEST))
            storage.clean(self.dir, keep_from=new.generation - 1)
        return result


def _apply(base: State, add: Sequence[_Pending], remove: Sequence[str]) -> State:
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
    return State(
        generation=generation, index=index, chunks=chunks, docs=docs, ids=ids, next_id=next_id, keywords=keywords
    )


def _add(base: State, pending: Sequence[_Pending], replace_same_name: bool) -> tuple[State, list[IngestReport]]:
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


Admit = Callable[[str, int], None]  # (name, bytes) of a new file before it is parsed; InputError refuses the upload


def _load(
    entries: list[tuple[Path | None, str, str | None]],
    settings: Settings,
    progress: Progress | None,
    reports: dict[int, IngestReport],
    state: State | None = None,
    admit: Admit | None = None,
) -> list[tuple[int, Document]]:
    """Parse each entry: (its position, the document), or a report at its position. Before a file
    is parsed (OCR is the dear part), its bytes are checked: content already in `state` or earlier
    in the batch is a "duplicate", and `admit` may refuse the whole upload (a quota). The entries'
    OCR shares one clock (`OcrLimits.event`). Before each page OCR reads, `progress` hears the page
    ("scan.pdf: reading page 3 of 12 (OCR)…")."""
    docs: list[tuple[int, Document]] = []
    seen: dict[str, str] = {}
    ocr = OcrLimits.of(settings).event()
    for n, (path, name, error) in enumerate(entries):
        _tell(progress, n, len(entries), f"reading {name}")
        if error is not None or path is None:
            reports[n] = IngestReport(name, "error", message=error or f"{name}: cannot be read.")
            continue
        pages = None if progress is None else (lambda what, n=n: _tell(progress, n, len(entries), what))
        try:
            name, suffix, data = read_file(path, name, max_mb=settings.max_file_mb)
        except InputError as e:
            reports[n] = IngestReport(name, "error", message=str(e))
            continue
        doc_id = hash_bytes(data)
        held = state.docs.get(doc_id) if state is not None else None
        if held is not None or doc_id in seen:
            reports[n] = _duplicate(name, held.source if held is not None else seen[doc_id], doc_id)
            continue
        if admit is not None:
            admit(name, len(data))
        try:
            docs.append((n, parsers.parse_document(data, name, suffix=suffix, ocr=ocr, progress=pages)))
        except InputError as e:
            reports[n] = IngestReport(name, "error", message=str(e))
            continue
        seen[doc_id] = name
    _tell(progress, len(entries), len(entries), "read")
    return docs


def _unseen(
    docs: list[tuple[int, Document]], state: State, reports: dict[int, IngestReport]
) -> list[tuple[int, Document]]:
    """The documents neither indexed already nor repeated earlier in this batch; the others get
    "duplicate" reports at their positions."""
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
    return todo


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
