"""The document library as visitors see it: one shared library plus a private library per owner.

Contract:
- An OWNER is a string ("local" for a single-user install, "anon:<token>", "user:<name>"). This
  module never decides who is asking; callers pass the owner, and it must not be empty.
- The SHARED library (namespace "shared") holds the bundled guide and what the operator ingests
  with the CLI (or, with `LLMWEB_SHARED_UPLOADS=1`, every UI upload). Everyone searches it; from the UI
  only the single user of a single-user install removes from it (`may_remove_shared`), or anyone under `=1`.
- Each owner's PRIVATE library (namespace "private-<32 hex of sha256(owner)>"; the owner string is
  never part of a path) holds that owner's UI uploads. Only that owner searches, lists or removes it.
- `search(owner, ...)` = shared + the owner's private, ranked by retrieval/hybrid.py: dense and keyword
  rankings fused by reciprocal rank, at most k, the same chunk (doc_id + offsets) never twice (the
  owner's copy kept), and nothing at all from a library the relevance gate finds the message is not
  about (`raw=True` skips the gate; so does `settings.retrieval_gate = False`). An optional
  cross-encoder (`settings.reranker`) reorders the result. `retrieve` gives the same answer with
  its figures (the CLI's `search --raw`). `remove` answers the same error for a document
  that exists elsewhere and one that does not exist at all, so it cannot be used to probe.
- A chat may read chosen documents only: `search(..., only=doc ids)` ranks their chunks alone.
  `resolve(owner, names or ids)` turns a request's names into (id, name) pairs among what `owner`
  can read (the same InputError for another owner's document as for a missing one); `scope(owner,
  pairs)` turns a chat's kept pairs into the ids readable now (by id, else by name: a replaced file).
- Uploads go to the owner's private library on every install (the shared one only under `=1`);
  a private library is capped at `settings.user_docs_mb` of uploaded files, checked before anything
  is written. Parsing, per-file limits and bad-input reports are `retrieval.Index`'s, unchanged.
- One `Embedder` serves every namespace; private `Index` objects are cached (LRU, PRIVATE_CACHE).
- Migration: the previous version kept everything (the guide and the uploads) in one namespace
  "docs". Opening a `Library` renames that folder, once (MIGRATED_MARKER), to LOCAL_OWNER's private
  library, so a single-user install keeps its uploads and a server does not show them to strangers.
  The version after it put a single-user install's UI uploads in the shared library, where a visitor
  through a proxy could read them: `migrate_shared_uploads` moves them, once (UPLOADS_MARKER), to
  LOCAL_OWNER's private library, vectors and all. An upload's name never has a "/" (`safe_name`),
  so the documents of a folder ingest (the bundled guide's "sample/...") stay shared.

Where an upload's owner is checked: here, and only here. Every public method that takes an owner
maps it to its private library through `private_namespace`, which refuses a missing owner
(`_check_owner`: never a fallback to some common library) and hashes it into a folder name:
  - `ingest_uploads`: into that owner's private library (or the shared one when
    `settings.uploads_shared`, LLMWEB_SHARED_UPLOADS=1), one upload at a time per owner (`_gate`),
    within the owner's quota (`_check_quota`) and its client address's budget (`DocumentRoom`, the
    store's count of every owner's documents), before anything is written;
  - `documents` / `is_empty` / `usage_bytes` / `search` / `chunks` / `resolve` / `scope`: the shared
    library plus that owner's own,
    with `removable` set per owner; `remove`: that owner's own (plus the shared one only when
    `may_remove_shared`), one message whether a document is elsewhere or nowhere;
  - `delete_owner`: that owner's private library, nothing else.
(`retrieve(None, ...)` and `ingest_shared` take no owner: the CLI's, on the shared library alone.)
What is not here: WHO the owner is (web/identity.py derives it from the login or the browser's
token; the upload handler in web/panels/documents.py only passes it on), and WHEN an idle owner's
uploads are purged (`Chat.purge_idle` asks the store's owners table, store/owners.py, then calls
`Chat.delete_owner`, which calls `delete_owner` here).

Nothing here reads the environment, imports torch/faiss at module level, or knows about the UI.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from llmweb.config import Settings
from llmweb.errors import InputError
from llmweb.records import LOCAL_OWNER, MAX_CHAT_DOCUMENTS, Chunk
from llmweb.retrieval import hybrid
from llmweb.retrieval.embedder import Embedder
from llmweb.retrieval.hybrid import Reranker, Retrieval
from llmweb.retrieval.index import DOCS, Index, IngestReport, Progress, Read
from llmweb.retrieval.parsers import MB
from llmweb.retrieval.storage import (
    DocumentInfo,
    delete_namespace,
    file_lock,
    fsync_dir,
    namespace_dir,
    thread_lock_for,
)

log = logging.getLogger(__name__)

SHARED = "shared"
PRIVATE_PREFIX = "private-"
LEGACY = DOCS  # the previous version's single namespace: the guide and every upload together
MIGRATED_MARKER = ".docs-migrated"  # in data_dir/index: the legacy namespace was handled
UPLOADS_MARKER = ".uploads-private"  # in data_dir/index: the shared library holds no single-user uploads
PRIVATE_CACHE = 64  # private Index objects kept open
MAX_NAME_SHOWN = 120  # a name that matched nothing is shown cut to this
_MARKER_TEXT = "the previous version's 'docs' index, if any, was moved to LOCAL_OWNER's private library\n"


def private_namespace(owner: str) -> str:
    """The namespace of an owner's private library: a hash, so no owner string reaches a path."""
    _check_owner(owner)
    return PRIVATE_PREFIX + hashlib.sha256(owner.encode("utf-8")).hexdigest()[:32]


def _check_owner(owner: str) -> None:
    # A missing owner must never fall back to some common library: that would mix visitors.
    if not isinstance(owner, str) or not owner:
        raise ValueError(f"an owner is a non-empty string, not {owner!r}")


class DocumentRoom(Protocol):
    """Where what every owner of one client address keeps in documents is counted together (the store,
    store/owners.py): `total` is what the owner's private library counts, in `_quota_size` bytes."""

    def document_room(self, owner: str, total: int) -> None:
        """InputError when the owner's library at `total` would take its address past its budget."""

    def claim_document_bytes(self, owner: str, total: int) -> None:
        """The same check, and `total` recorded, at once: two uploads of one address cannot both pass."""

    def record_document_bytes(self, owner: str, total: int) -> None:
        """What the owner's library counts now."""


@dataclass(frozen=True, slots=True)
class LibraryDocument:
    """One document as an owner sees it: the index's `DocumentInfo` fields plus where it lives."""

    doc_id: str
    source: str
    chunks: int
    scope: str  # "yours" (the owner's private library) | "shared"
    removable: bool  # may this owner remove it from the UI?
    kind: str = "document"
    size: int = 0
    added: float = 0.0

    @classmethod
    def of(cls, info: DocumentInfo, scope: str, removable: bool) -> LibraryDocument:
        return cls(info.doc_id, info.source, info.chunks, scope, removable, info.kind, info.size, info.added)


class Library:
    """The shared library and every owner's private one, over `Index` folders in data_dir/index."""

    def __init__(self, settings: Settings, embedder: Embedder | None = None):
        self.settings = settings
        self.embedder = embedder if embedder is not None else Embedder.from_settings(settings)
        self._private_cache: OrderedDict[str, Index] = OrderedDict()  # namespace -> Index, oldest first
        self._cache_lock = threading.Lock()
        migrate_legacy(settings)  # before any Index of LOCAL_OWNER's private library opens
        self.shared = Index(settings, SHARED, embedder=self.embedder)  # the CLI reads it directly
        migrate_shared_uploads(settings, self.shared, self._private(LOCAL_OWNER))
        self.reranker = Reranker.from_settings(settings)  # None unless LLMWEB_RERANKER; loads on first use
        self._gates: dict[str, tuple[threading.Lock, int]] = {}  # namespace -> (lock, users)
        self._gates_lock = threading.Lock()

    # -- reading ---------------------------------------------------------------

    def search(
        self,
        owner: str,
        query: str,
        k: int | None = None,
        min_score: float | None = None,
        *,
        raw: bool = False,
        only: Collection[str] | None = None,
    ) -> list[Chunk]:
        """The best chunks for `query` in the shared library and `owner`'s own, best first; [] when
        the relevance gate finds the message is about neither (unless `raw`). `only`: the doc ids a
        chat reads (`scope`), None for all; an id `owner` cannot read matches nothing.

        k defaults to settings.top_k and is clamped to settings.max_top_k; min_score (default
        settings.min_score) is the dense ranking's cosine floor. Each chunk's `score` is its cosine.
        Empty libraries cost nothing (no embedding).
        """
        _check_owner(owner)  # None would mean the shared library alone (retrieve's CLI case)
        return self.retrieve(owner, query, k, min_score, raw=raw, only=only).chunks

    def retrieve(
        self,
        owner: str | None,
        query: str,
        k: int | None = None,
        min_score: float | None = None,
        *,
        raw: bool = False,
        only: Collection[str] | None = None,
    ) -> Retrieval:
        """`search` with its figures (fused ranks, BM25, the gate's evidence). owner=None searches
        the shared library alone (the CLI)."""
        indexes = [self.shared] if owner is None else [self._private(owner), self.shared]  # own copy first on ties
        k = self.settings.top_k if k is None else int(k)
        k = min(k, self.settings.max_top_k)
        floor = self.settings.min_score if min_score is None else float(min_score)
        gate = hybrid.GATE if self.settings.retrieval_gate and not raw else None
        return hybrid.search(
            indexes, query, k, floor, embedder=self.embedder, gate=gate, reranker=self.reranker, only=only
        )

    def is_empty(self, owner: str) -> bool:
        """True when `owner` has nothing to search: the chat can skip retrieval."""
        return len(self.shared) == 0 and len(self._private(owner)) == 0

    def documents(self, owner: str) -> list[LibraryDocument]:
        """What `owner` can search: their own documents first, then the shared ones, each by name.

        A document in both libraries is listed once, as "yours".
        """
        own = [LibraryDocument.of(d, "yours", True) for d in self._private(owner).documents()]
        mine = {d.doc_id for d in own}
        removable = self.may_remove_shared(owner)
        shared = [LibraryDocument.of(d, "shared", removable) for d in self.shared.documents() if d.doc_id not in mine]
        return own + shared

    def chunks(self, owner: str, doc_id: str) -> list[Chunk]:
        """One document's chunks in document order, if `owner` can read it (their own copy first,
        then the shared library's); [] for a document they cannot read, as for one that is not there."""
        for index in (self._private(owner), self.shared):
            if doc_id in index:
                return index.chunks(doc_id)
        return []

    def resolve(self, owner: str, wanted: Sequence[str]) -> tuple[tuple[str, str], ...]:
        """The documents a chat is told to read, named by id or by name, as (doc id, name) pairs in
        the order given: a name matches every document of `owner`'s by that name (theirs, then a
        shared one), exactly, else ignoring case. An InputError names the first that matches none:
        the same sentence for another owner's document as for one that does not exist."""
        if len(wanted) > MAX_CHAT_DOCUMENTS:
            raise InputError(f"A chat reads at most {MAX_CHAT_DOCUMENTS} chosen documents; {len(wanted)} were named.")
        docs = self.documents(owner)
        by_id = {d.doc_id: d for d in docs}
        by_name: dict[str, list[LibraryDocument]] = {}
        by_folded: dict[str, list[LibraryDocument]] = {}
        for d in docs:
            by_name.setdefault(d.source, []).append(d)
            by_folded.setdefault(d.source.casefold(), []).append(d)
        out: dict[str, str] = {}
        for name in wanted:
            if not isinstance(name, str) or not name.strip():
                raise InputError("Name each document by its name or id (a non-empty string).")
            hit = by_id.get(name)
            found = [hit] if hit else by_name.get(name) or by_folded.get(name.casefold(), [])
            if not found:
                shown = name[:MAX_NAME_SHOWN]
                raise InputError(f"There is no document {shown!r} in your library (give its name or id, as listed).")
            out.update((d.doc_id, d.source) for d in found)
        return tuple(out.items())

    def scope(self, owner: str, chosen: Sequence[tuple[str, str]]) -> frozenset[str]:
        """The doc ids `owner` can read among a chat's chosen (doc id, name) pairs: by id, else (the
        file was replaced by a new version, or the chat came from another install) by name. A
        document removed since is left out; so is one only another owner has."""
        docs = self.documents(owner)
        ids = {d.doc_id for d in docs}
        by_name: dict[str, set[str]] = {}
        for d in docs:
            by_name.setdefault(d.source, set()).add(d.doc_id)
        out: set[str] = set()
        for doc_id, name in chosen[:MAX_CHAT_DOCUMENTS]:
            out |= {doc_id} if doc_id in ids else by_name.get(name, set())
        return frozenset(out)

    def shares_uploads(self, owner: str) -> bool:
        """Do `owner`'s uploads join the shared library? Only with LLMWEB_SHARED_UPLOADS=1 (everyone's):
        by default every upload is private to its owner, the single user's too."""
        _check_owner(owner)
        return self.settings.uploads_shared

    def may_remove_shared(self, owner: str) -> bool:
        """May `owner` remove shared documents from the UI? Under LLMWEB_SHARED_UPLOADS=1 anyone; under
        auto only the single user of a single-user install (the operator: web/owner.py proves it); under 0 nobody."""
        if self.settings.shared_uploads == "auto":
            return owner == LOCAL_OWNER and self.settings.is_single_user
        return self.settings.uploads_shared

    def usage_bytes(self, owner: str) -> int:
        """What `owner`'s private library counts against `user_docs_mb`: per document, its file's
        bytes or its extracted text's characters, whichever is more (`_quota_size`)."""
        index = self._private(owner)
        return sum(_quota_size(index, d) for d in index.documents())

    # -- changing --------------------------------------------------------------

    def ingest_uploads(
        self,
        owner: str,
        files: Sequence[tuple[str | os.PathLike, str]],
        progress: Progress | None = None,
        room: DocumentRoom | None = None,
    ) -> list[IngestReport]:
        """Add files uploaded by `owner`, given as (temp path, the name the user gave).

        Private library (or the shared one when settings.uploads_shared). One report per file as
        `Index.ingest_uploads` gives them. Raises InputError, writing nothing, if the files would
        take the owner's private library past settings.user_docs_mb, or (`room`: the store) all the
        libraries of the owner's client address past their budget.
        """
        namespace = private_namespace(owner)  # checks the owner in either mode
        if self.shares_uploads(owner):
            return self.shared.ingest_uploads(files, progress)
        with self._gate(namespace):  # one upload at a time per owner: the quota check stays true
            index = self._private(owner)
            admit = self._admit(index, owner, room)
            read = index.read_uploads(files, progress, admit)  # parsed once, measured, added
            used, adding = self._check_quota(index, read)
            if room is None:
                return index.add_read(read, progress)
            if adding:  # the address's budget, checked and claimed in one transaction
                room.claim_document_bytes(owner, used + adding)
            try:
                return index.add_read(read, progress)
            finally:
                room.record_document_bytes(owner, self.usage_bytes(owner))

    def ingest_shared(self, paths: Sequence[str | os.PathLike], progress: Progress | None = None) -> list[IngestReport]:
        """Add files and folders to the shared library (the CLI, the bundled guide)."""
        return self.shared.ingest(paths, progress)

    def remove(self, owner: str, doc_id: str) -> DocumentInfo:
        """Remove one of `owner`'s documents (also a shared one when `may_remove_shared(owner)`).

        InputError, with one message whatever the reason, when `owner` has no such document.
        """
        targets = [self._private(owner)] + ([self.shared] if self.may_remove_shared(owner) else [])
        removed = None
        for index in targets:
            try:
                info = index.remove(doc_id)
            except InputError:  # not there (or gone meanwhile): one message below, whichever it was
                continue
            removed = removed or info
        if removed is None:
            raise InputError("That document is not in your library (it may have been removed already).")
        return removed

    def delete_owner(self, owner: str) -> bool:
        """Delete `owner`'s private library; False if there was none. The shared one is untouched."""
        namespace = private_namespace(owner)
        with self._gate(namespace):
            with self._cache_lock:
                self._private_cache.pop(namespace, None)
            return delete_namespace(self.settings, namespace)

    # -- internals -------------------------------------------------------------

    def _private(self, owner: str) -> Index:
        namespace = private_namespace(owner)
        with self._cache_lock:
            index = self._private_cache.get(namespace)
            if index is None:
                # Cheap: an Index reads nothing until used. Two Index objects on one folder (after
                # an eviction) stay consistent: writes share a per-folder lock, reads check the manifest.
                index = self._private_cache[namespace] = Index(self.settings, namespace, embedder=self.embedder)
                while len(self._private_cache) > PRIVATE_CACHE:
                    self._private_cache.popitem(last=False)
            else:
                self._private_cache.move_to_end(namespace)
            return index

    def _check_quota(self, index: Index, read: Read) -> tuple[int, int]:
        """Refuse (InputError) uploads that would take a private library past settings.user_docs_mb.

        Counts what would really be stored: not files the index refuses anyway (too big, unreadable,
        nameless: they have reports, no document), not content already held, and a same-named file
        replaces the earlier version. A document counts its file's bytes or its text's characters,
        whichever is more (`_quota_size`): a small .docx or .pdf may hold far more text than its bytes.
        Returns (what the library counts now, what the upload adds).
        """
        limit = self.settings.user_docs_mb * MB
        docs = index.documents()
        used = sum(_quota_size(index, d) for d in docs)
        held = {d.doc_id for d in docs}
        by_name = {d.source: d for d in docs if d.kind == "document"}
        adding = 0
        for _, doc in read.docs:
            if doc.doc_id in held:
                continue
            held.add(doc.doc_id)
            old = by_name.pop(doc.name, None)
            size = max(doc.size, len(doc.text))
            adding += max(size - (_quota_size(index, old) if old is not None else 0), 0)
        if adding and used + adding > limit:
            raise self._over_quota(adding, used)
        return used, adding

    def _admit(self, index: Index, owner: str, room: DocumentRoom | None) -> Callable[[str, int], None]:
        """The quota before each new file is parsed: its bytes (a lower bound of what it will count,
        `_quota_size`) beside the library's use refuse the upload before OCR or a parse is paid for;
        so does the budget of the owner's address (`room`)."""
        limit = self.settings.user_docs_mb * MB
        docs = index.documents()
        used = sum(_quota_size(index, d) for d in docs)
        by_name = {d.source: d for d in docs if d.kind == "document"}
        adding = 0

        def admit(name: str, size: int) -> None:
            nonlocal adding
            old = by_name.pop(name, None)
            adding += max(size - (_quota_size(index, old) if old is not None else 0), 0)
            if adding and used + adding > limit:
                raise self._over_quota(adding, used)
            if adding and room is not None:
                room.document_room(owner, used + adding)

        return admit

    def _over_quota(self, adding: int, used: int) -> InputError:
        return InputError(
            f"Not added: these files ({_mb(adding)}) would bring your documents to {_mb(used + adding)}, "
            f"over the limit of {self.settings.user_docs_mb} MB per person (you use {_mb(used)}). "
            "Remove some of your documents first."
        )

    @contextlib.contextmanager
    def _gate(self, namespace: str) -> Iterator[None]:
        """A lock per private namespace, kept only while someone holds or waits for it."""
        with self._gates_lock:
            lock, users = self._gates.get(namespace, (None, 0))
            lock = lock or threading.Lock()
            self._gates[namespace] = (lock, users + 1)
        try:
            with lock:
                yield
        finally:
            with self._gates_lock:
                _, users = self._gates[namespace]
                if users == 1:
                    del self._gates[namespace]
                else:
                    self._gates[namespace] = (lock, users - 1)


# --------------------------------------------------------------------------- migration


def migrate_legacy(settings: Settings) -> bool:
    """Move the previous version's "docs" namespace to LOCAL_OWNER's private library, once.

    A rename of the folder (atomic), under the folder locks a writer would take; then the marker.
    A crash between the two finds no "docs" folder next time and just writes the marker. If the
    target already exists the legacy folder is left where it is (logged), never merged or deleted.
    Returns True if a folder was moved.
    """
    root = Path(settings.data_dir) / "index"
    marker = root / MIGRATED_MARKER
    if marker.exists():
        return False
    legacy = namespace_dir(settings, LEGACY)
    if not legacy.is_dir():  # a new install: mark it, so a "docs" folder that shows up later is never moved
        with contextlib.suppress(OSError):  # a read-only data dir (`search` on a mounted copy) is fine too
            root.mkdir(parents=True, exist_ok=True)
            marker.write_text(_MARKER_TEXT)
        return False
    target = namespace_dir(settings, private_namespace(LOCAL_OWNER))
    moved = False
    with thread_lock_for(legacy), file_lock(legacy), thread_lock_for(target), file_lock(target):
        if marker.exists():  # another process did it while we waited
            return False
        if not legacy.is_dir():
            pass  # moved by a process that crashed before writing the marker
        elif target.exists():
            log.warning("not migrating %s: %s already exists; the old folder is left as it is", legacy, target)
        else:
            os.rename(legacy, target)
            fsync_dir(root)
            moved = True
            log.info("moved the previous version's documents (%s) to the local owner's library", legacy)
        marker.write_text(_MARKER_TEXT)
    return moved


def migrate_shared_uploads(settings: Settings, shared: Index, local: Index) -> int:
    """Move the uploads the previous version put in the shared library of a single-user install
    (LLMWEB_SHARED_UPLOADS=auto on a loopback bind without login) to LOCAL_OWNER's private library,
    once; returns how many moved. An upload is a document whose name has no "/" (`safe_name`); a
    single file the operator ingested with the CLI looks the same and becomes the owner's too (the
    owner keeps it; strangers do not see it: re-ingest a folder to share it). `Index.move_to` adds
    before it removes, so a crash leaves a copy, and the next start finishes the move.
    Any other install only writes the marker: its shared library never held an upload."""
    marker = Path(settings.data_dir) / "index" / UPLOADS_MARKER
    if marker.exists():
        return 0
    moved = 0
    if settings.shared_uploads == "auto" and settings.is_single_user and len(shared):
        uploads = [d.doc_id for d in shared.documents() if d.kind == "document" and "/" not in d.source]
        moved = shared.move_to(local, uploads)
        if moved:
            log.info("moved %d uploads from the shared library to the local owner's own", moved)
    with contextlib.suppress(OSError):  # a read-only data dir (`search` on a mounted copy) is fine too
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text("uploads of a single-user install live in LOCAL_OWNER's private library\n")
    return moved


def _mb(n: int) -> str:
    return f"{n / MB:.1f} MB"


def _quota_size(index: Index, doc: DocumentInfo) -> int:
    """What a stored document counts against the quota: its file's bytes, or the characters of its
    extracted text (where its last chunk ends) when more."""
    return max(doc.size, max((c.end for c in index.chunks(doc.doc_id)), default=0))
