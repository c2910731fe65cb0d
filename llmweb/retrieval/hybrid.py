"""Hybrid retrieval: fuse dense and keyword rankings, decide whether anything is relevant, rerank.

Contract:
- `search(indexes, query, k, min_score, ...) -> Retrieval` asks each `retrieval.Index` (one
  namespace each: the shared library, an owner's private one) for its `Candidates`, embedding the
  query once, and only when some namespace has chunks.
- The GATE decides per namespace, from `Evidence` (the best dense cosine; how much of the query's
  specific wording one chunk holds, by BM25; whether the two rankings agree), whether the query
  is about that namespace at all. A namespace that fails contributes nothing; a message that fails
  in every namespace retrieves nothing (`Retrieval.gated`). Its constants are calibrated on
  labelled messages over two corpora, not guessed: see `GATE` for the data and the command.
- Ranking is reciprocal rank fusion: score(chunk) = sum over rankings of 1 / (RRF_K + rank), ranks
  from 1, over the dense ranking (cosine >= min_score) and the keyword ranking (BM25) of every
  admitted namespace. Ranks are fused, never raw scores: cosines and BM25 values are on unrelated
  scales, and BM25 values of two namespaces are not comparable either. Dense ranks are taken after
  merging the namespaces by cosine (one embedder, comparable); keyword ranks are per namespace.
- An optional `Reranker` (a local `sentence_transformers.CrossEncoder`) reorders the fused top
  RERANK_POOL; it never admits or drops a namespace, so the gate's calibration holds with or
  without it.
- Every returned chunk's `score` is its own cosine with the query (as `Index.search` reports it,
  and as recall chunks report theirs), whichever ranking found it; the list order is the fused
  (or reranked) order; `Retrieval.scored` has every figure behind it. `gate=None` skips the gate
  (Library's `raw=True`, `search --raw`).

Nothing here reads the environment or touches files; retrieval/index.py owns the indexes.
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmweb.errors import ConfigError
from llmweb.records import Chunk

if TYPE_CHECKING:
    from llmweb.retrieval.embedder import Embedder
    from llmweb.retrieval.index import Candidates, Index

RRF_K = 60  # the usual constant of reciprocal rank fusion (Cormack et al. 2009)
AGREE_DEPTH = 3  # the rankings "agree" when their top AGREE_DEPTH chunks share one
RERANK_POOL = 20  # fused candidates the cross-encoder reorders


@dataclass(frozen=True, slots=True)
class Evidence:
    """What the relevance gate sees of one query over one namespace."""

    cosine: float  # the best dense cosine of any chunk, before the min_score floor
    coverage: float  # BM25 of the best keyword hit / the query's total IDF (see `of`)
    agree: bool  # the dense (before the floor) and keyword rankings share a chunk in their top AGREE_DEPTH

    @classmethod
    def of(cls, c: Candidates) -> Evidence:
        """`coverage`: a chunk that holds every content word of the query once, at the average
        length, scores about the sum of their IDFs in BM25, so the ratio is roughly the share of
        the query's specific wording found together in one chunk (0 = none; common words weigh
        little; words the namespace lacks weigh most). It needs no per-corpus scale, unlike raw
        BM25."""
        mass = sum(t.idf(c.total) for t in c.terms)
        best = c.keyword[0][1] if c.keyword else 0.0
        dense_top = {_key(x) for x in c.dense[:AGREE_DEPTH]}
        keyword_top = {_key(x) for x, _ in c.keyword[:AGREE_DEPTH]}
        cosine = c.dense[0].score if c.dense else 0.0
        return cls(cosine, best / mass if mass > 0 else 0.0, bool(dense_top & keyword_top))


@dataclass(frozen=True, slots=True)
class Gate:
    """A query is about a namespace when its meaning is close on its own (`cosine_alone`), or
    fairly close (`cosine_with_words`) while one chunk also holds much of its specific wording
    (`coverage`) and the dense and keyword rankings agree on a chunk: a setting's name, a term
    of the trade, a question phrased in the documents' own words."""

    cosine_alone: float
    cosine_with_words: float
    coverage: float

    def admits(self, e: Evidence) -> bool:
        if e.cosine >= self.cosine_alone:
            return True
        return e.cosine >= self.cosine_with_words and e.coverage >= self.coverage and e.agree


# Chosen by `python -m llmweb bench retrieval` (bench/retrieval.py: `calibrate`, which prints the
# table) from data/eval/guide-questions.jsonl (50 on topic) over the bundled guide (22 chunks),
# data/eval/packages-questions.jsonl (44 on topic) over 30 installed packages' READMEs (897 chunks)
# and data/eval/off-topic.jsonl (44 messages) over both: of the rules that admit at most 10% of the
# off-topic messages on each corpus, the best worst-corpus (on-topic admitted - off-topic admitted).
# It admits 92% / 2.3% (on / off topic) on the guide and 97.7% / 9.1% on the READMEs; 0.35 scores
# the same. Fit to the guide alone, the best rule admitted 18% of the off-topic messages over the
# READMEs (their top cosines run ~0.1 higher), hence both corpora. A cosine floor alone that gates
# as much admits 76% of the guide's questions (0.35) or lets 41% of off-topic messages in (0.25).
GATE = Gate(cosine_alone=0.36, cosine_with_words=0.23, coverage=0.40)


@dataclass(frozen=True, slots=True)
class Scored:
    """One fused result with every figure behind its place (for `search --raw` and the benchmark)."""

    chunk: Chunk  # score = cosine
    fused: float  # the RRF score
    dense_rank: int | None  # 1-based, None when the dense ranking did not offer it
    keyword_rank: int | None
    bm25: float | None
    rerank: float | None = None  # the cross-encoder's score, when one ran


@dataclass(frozen=True, slots=True)
class Retrieval:
    """The answer to one query: the chunks to use, and why."""

    chunks: list[Chunk]
    scored: list[Scored] = field(default_factory=list)  # the same order as `chunks`
    evidence: list[Evidence] = field(default_factory=list)  # one per searched namespace that has chunks
    admitted: list[bool] = field(default_factory=list)  # the gate's verdict per `evidence`

    @property
    def gated(self) -> bool:
        """True when there was something to search but the gate admitted no namespace."""
        return bool(self.evidence) and not any(self.admitted)


def search(
    indexes: Sequence[Index],
    query: str,
    k: int,
    min_score: float,
    *,
    embedder: Embedder,
    gate: Gate | None = GATE,
    reranker: Reranker | None = None,
    mode: str = "hybrid",
    only: Collection[str] | None = None,
) -> Retrieval:
    """The best `k` chunks for `query` over `indexes` (see the module docstring).

    gate=None skips the gate (every namespace counts). mode "dense" or "keyword" ranks by one
    ranking alone (the benchmark's baselines); the gate is the same in every mode. `only`: the doc
    ids a chat reads (None: all); each namespace ranks those of its chunks alone (`Index.candidates`).
    """
    assert mode in ("hybrid", "dense", "keyword"), f"unknown ranking mode {mode!r}"
    if k < 1 or not query.strip() or (only is not None and not only):
        return Retrieval([])
    # 1) both rankings from every namespace, the query embedded once (and not at all if none holds anything to rank)
    vector = None
    cands: list[Candidates] = []
    for index in indexes:
        if vector is None and len(index) > 0 and (only is None or any(d in index for d in only)):
            vector = embedder.embed_query(query)
        c = index.candidates(query, vector, k, min_score, only)
        if not c.empty:
            cands.append(c)
    # 2) the gate, per namespace
    evidence = [Evidence.of(c) for c in cands]
    admitted = [gate is None or gate.admits(e) for e in evidence]
    kept = [c for c, ok in zip(cands, admitted) if ok]
    if not kept:
        return Retrieval([], [], evidence, admitted)
    # 3) fuse ranks
    scored = fuse(kept, use_dense=mode != "keyword", use_keyword=mode != "dense")
    # 4) rerank the head of the fused list
    if reranker is not None and scored:
        scored = reranker.rerank(query, scored[: max(k, RERANK_POOL)])
    top = scored[:k]
    return Retrieval([s.chunk for s in top], top, evidence, admitted)


def fuse(cands: Sequence[Candidates], *, use_dense: bool = True, use_keyword: bool = True) -> list[Scored]:
    """Reciprocal rank fusion of the namespaces' rankings, best first, each chunk once."""
    chunks: dict[tuple, Chunk] = {}
    fused: dict[tuple, float] = {}
    dense_rank: dict[tuple, int] = {}
    keyword_rank: dict[tuple, int] = {}
    bm25: dict[tuple, float] = {}
    order: list[tuple] = []  # first seen first: breaks ties (dense before keyword, own library first)

    def see(chunk: Chunk) -> tuple:
        key = _key(chunk)
        if key not in chunks:
            chunks[key] = chunk
            fused[key] = 0.0
            order.append(key)
        return key

    if use_dense:
        merged = sorted((x for c in cands for x in c.ranked), key=lambda x: -x.score)  # stable: own first
        rank = 0
        for chunk in merged:
            key = see(chunk)
            if key in dense_rank:  # the same file in both libraries
                continue
            rank += 1
            dense_rank[key] = rank
            fused[key] += 1.0 / (RRF_K + rank)
    if use_keyword:
        for c in cands:
            rank = 0
            for chunk, score in c.keyword:
                key = see(chunk)
                if key in keyword_rank:
                    continue
                rank += 1
                keyword_rank[key] = rank
                bm25[key] = score
                fused[key] += 1.0 / (RRF_K + rank)
    position = {key: n for n, key in enumerate(order)}
    ranked = sorted(order, key=lambda key: (-fused[key], position[key]))
    return [
        Scored(chunks[key], fused[key], dense_rank.get(key), keyword_rank.get(key), bm25.get(key))
        for key in ranked
        if fused[key] > 0
    ]


class Reranker:
    """A cross-encoder from a local folder, loaded on first use; scores (query, passage) pairs."""

    def __init__(self, path: str | Path, *, device: str = "cpu"):
        self.path = str(Path(path).expanduser())
        self.device = device
        self._model: Any = None
        self._lock = threading.Lock()  # one tokenizer, many request threads (see Embedder.lock)

    @classmethod
    def from_settings(cls, settings) -> Reranker | None:
        return cls(settings.reranker) if settings.reranker else None

    @property
    def model(self):
        with self._lock:
            if self._model is None:
                if not Path(self.path).is_dir():
                    raise ConfigError(
                        f"LLMWEB_RERANKER={self.path!r} is not a folder: give the local path of a "
                        "sentence-transformers cross-encoder (nothing is downloaded)."
                    )
                from sentence_transformers import CrossEncoder

                try:
                    self._model = CrossEncoder(self.path, device=self.device, local_files_only=True)
                except Exception as e:  # file-format and config errors all arrive here
                    raise ConfigError(
                        f"Could not load the reranker in {self.path!r} (LLMWEB_RERANKER): {type(e).__name__}: {e}"
                    ) from e
            return self._model

    def rerank(self, query: str, scored: Sequence[Scored]) -> list[Scored]:
        """`scored` reordered by the cross-encoder's score, best first (ties keep the fused order)."""
        import dataclasses

        model = self.model
        with self._lock:
            raw = model.predict([(query, s.chunk.text) for s in scored], show_progress_bar=False)
        values = [float(v) for v in raw]
        pairs = sorted(zip(values, range(len(values))), key=lambda p: (-p[0], p[1]))
        return [dataclasses.replace(scored[i], rerank=v) for v, i in pairs]


def _key(chunk: Chunk) -> tuple:
    """The same passage, wherever it is stored: one document (by content) and one offset."""
    return (chunk.doc_id, chunk.start, chunk.end)
