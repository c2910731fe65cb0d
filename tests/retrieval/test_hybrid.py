"""Hybrid retrieval: the FTS5 keyword index kept in step with FAISS on disk, fusion, the gate, the CLI.

Real embedder, real FAISS and SQLite files in tmp_path. The labelled messages come from
data/eval/ (the same files `python -m llmweb bench retrieval` calibrates the gate on).
"""

from __future__ import annotations

import json
import os
import sqlite3
from pathlib import Path

import pytest

from llmweb.bench.retrieval import EVAL_DIR, GUIDE, calibrate, load_questions, ranking_metrics
from llmweb.config import Settings
from llmweb.errors import ConfigError
from llmweb.records import Chunk
from llmweb.retrieval import hybrid
from llmweb.retrieval.embedder import Embedder
from llmweb.retrieval.hybrid import Evidence, Gate
from llmweb.retrieval.index import Candidates, Index
from llmweb.retrieval.keywords import KeywordIndex, content_words
from llmweb.retrieval.library import Library
from llmweb.retrieval.storage import MANIFEST
from tests.cli.test_cli import run_cli

pytestmark = pytest.mark.slow  # the real embedder and FAISS indexes on disk (seconds per test)

CATS = "# Cats\n\nCats purr when they are content. A cat sleeps up to sixteen hours a day.\n"
TRAINS = "# Trains\n\nThe night train to Vienna leaves the central station at eleven.\n"
SETTINGS_DOC = "# Tuning\n\nLLMWEB_FRAG_RELEASE_MB releases cached allocator blocks when the server idles.\n"


@pytest.fixture(scope="module")
def embedder() -> Embedder:
    e = Embedder()
    assert e.dim == 384  # loads the model once for the module
    return e


@pytest.fixture
def settings(tmp_path) -> Settings:
    return Settings(data_dir=tmp_path / "data", sample_docs=False)


@pytest.fixture
def corpus(tmp_path) -> Path:
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "cats.md").write_text(CATS)
    (folder / "trains.md").write_text(TRAINS)
    (folder / "tuning.md").write_text(SETTINGS_DOC)
    return folder


@pytest.fixture(scope="module")
def guide_library(tmp_path_factory, embedder) -> Library:
    """The bundled guide in a shared library, as a fresh install has it."""
    settings = Settings(data_dir=tmp_path_factory.mktemp("guide") / "data", sample_docs=False)
    library = Library(settings, embedder)
    assert [r.status for r in library.ingest_shared([GUIDE])] == ["added"]
    return library


def in_step(index: Index) -> set[int]:
    """The published state's keyword rows are exactly its chunks, and they describe its generation."""
    state = index._current()
    if state.keywords is None:
        assert not state.chunks
        return set()
    assert state.keywords.generation == state.generation
    assert state.keywords.ids() == set(state.chunks), "keyword rows and vectors disagree"
    return set(state.chunks)


def keyword_sources(index: Index, query: str) -> list[str]:
    vector = index.embedder.embed_query(query)
    return [c.source for c, _ in index.candidates(query, vector, 5, -1.0).keyword]


# --------------------------------------------------------------------------- the keyword index alone


def test_derive_copies_and_leaves_the_original_untouched():
    base = KeywordIndex.build([(1, "cats purr softly"), (2, "dogs bark loudly")], generation=1)
    new = base.derive([(3, "owls hoot at night")], [(1, "cats purr softly")], generation=2)
    assert (base.generation, base.ids(), new.generation, new.ids()) == (1, {1, 2}, 2, {2, 3})
    assert [h.chunk_id for h in base.search("purring cats", 5)] == [1]  # porter: purring ~ purr
    assert new.search("purring cats", 5) == []
    again = KeywordIndex.from_bytes(new.to_bytes())
    assert (again.generation, again.size, again.ids()) == (2, 2, {2, 3})
    with pytest.raises(sqlite3.DatabaseError):
        KeywordIndex.from_bytes(b"not a database" * 10)


def test_queries_are_words_never_fts_syntax():
    index = KeywordIndex.build([(1, 'the AND gate and the "NEAR" field: text*'), (2, "unrelated")], generation=1)
    for query in ("AND OR NOT", 'NEAR("x" "y")', "text: *", '"', "-col:x ^y", "a'b\"c"):
        index.search(query, 5)  # no sqlite3.OperationalError
    assert [h.chunk_id for h in index.search('"near" field', 5)] == [1]
    assert content_words("How do I change the model?") == ["change", "model"]
    assert content_words("Hi! How are you?") == ["hi"]


# --------------------------------------------------------------------------- in step on disk


def test_keywords_follow_add_remove_and_reload(settings, embedder, corpus):
    index = Index(settings, embedder=embedder)
    index.ingest([corpus / "cats.md", corpus / "trains.md"])
    ids = in_step(index)
    manifest = json.loads((index.dir / MANIFEST).read_text())
    assert (
        manifest["keywords"] == f"fts-{manifest['generation']:08d}.sqlite3"
        and (index.dir / manifest["keywords"]).exists()
    )
    assert keyword_sources(index, "Vienna night train") == ["trains.md"]

    index.remove("trains.md")
    assert in_step(index) < ids and keyword_sources(index, "Vienna night train") == []
    index.ingest([corpus / "tuning.md"])
    in_step(index)

    reloaded = Index(Settings(data_dir=settings.data_dir), embedder=embedder)  # as after a restart
    assert in_step(reloaded) == set(index._current().chunks)
    assert keyword_sources(reloaded, "LLMWEB_FRAG_RELEASE_MB") == ["tuning.md"]
    assert keyword_sources(reloaded, "Vienna") == []
    other = Index(settings, embedder=embedder)  # another process's writes show up on the next call
    other.ingest([corpus / "trains.md"])
    assert keyword_sources(index, "Vienna") == ["trains.md"] and in_step(index)


@pytest.mark.parametrize("fail_on", ["vectors-", "meta-", "fts-", MANIFEST])
def test_a_failed_write_keeps_keywords_and_vectors_of_one_generation(settings, embedder, corpus, monkeypatch, fail_on):
    index = Index(settings, embedder=embedder)
    index.ingest([corpus / "cats.md", corpus / "trains.md"])
    before = in_step(index)
    real_replace = os.replace

    def crash(src, dst):
        if Path(dst).name.startswith(fail_on):
            raise OSError(28, "No space left on device (simulated)")
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="simulated"):
        index.ingest([corpus / "tuning.md"])
    with pytest.raises(OSError, match="simulated"):
        index.remove("trains.md")
    monkeypatch.setattr(os, "replace", real_replace)

    for seen in (index, Index(settings, embedder=embedder)):  # the live object, and the disk
        assert in_step(seen) == before
        assert keyword_sources(seen, "Vienna night train") == ["trains.md"]
        assert keyword_sources(seen, "LLMWEB_FRAG_RELEASE_MB") == []
    index.ingest([corpus / "tuning.md"])  # the next write works and cleans up
    assert in_step(Index(settings, embedder=embedder)) > before
    manifest = json.loads((index.dir / MANIFEST).read_text())
    g = manifest["generation"]
    assert set(os.listdir(index.dir)) <= {
        MANIFEST,
        *(
            f"{kind}-{n:08d}.{ext}"
            for n in (g, g - 1)
            for kind, ext in [("vectors", "faiss"), ("meta", "json"), ("fts", "sqlite3")]
        ),
    }


def test_a_keyword_file_from_another_generation_is_reported_not_loaded(settings, embedder, corpus):
    index = Index(settings, embedder=embedder)
    index.ingest([corpus / "cats.md"])
    index.ingest([corpus / "trains.md"])
    manifest = json.loads((index.dir / MANIFEST).read_text())
    manifest["keywords"] = f"fts-{manifest['generation'] - 1:08d}.sqlite3"  # vectors of g, keywords of g - 1
    (index.dir / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ConfigError, match="cannot be read .*keyword index and metadata disagree"):
        Index(settings, embedder=embedder).documents()
    (index.dir / manifest["keywords"]).write_bytes(b"garbage" * 100)
    with pytest.raises(ConfigError, match="cannot be read .*DatabaseError"):
        Index(settings, embedder=embedder).documents()


def test_an_index_from_before_keyword_files_gets_one(settings, embedder, corpus):
    index = Index(settings, embedder=embedder)
    index.ingest([corpus / "cats.md", corpus / "trains.md"])
    manifest = json.loads((index.dir / MANIFEST).read_text())
    (index.dir / manifest.pop("keywords")).unlink()
    (index.dir / MANIFEST).write_text(json.dumps(manifest))  # as the previous version wrote it

    old = Index(settings, embedder=embedder)
    assert in_step(old) and keyword_sources(old, "Vienna") == ["trains.md"]  # built in memory on load
    old.ingest([corpus / "tuning.md"])
    assert "keywords" in json.loads((index.dir / MANIFEST).read_text())  # and written with the next change
    assert in_step(Index(settings, embedder=embedder))


# --------------------------------------------------------------------------- ranking and the gate


def test_hybrid_ranks_at_least_as_well_as_dense_on_the_labelled_guide_questions(guide_library, embedder):
    questions = load_questions(EVAL_DIR / "guide-questions.jsonl", on_topic=True)
    dense = ranking_metrics(guide_library.shared, questions, embedder, "dense")
    fused = ranking_metrics(guide_library.shared, questions, embedder, "hybrid")
    assert fused["recall_at_4"] >= dense["recall_at_4"] and fused["mrr"] >= dense["mrr"], (dense, fused)
    # a setting's name is found by its words, where the embedding alone ranks it low
    top = guide_library.search("local", "LLMWEB_CACHE_DIR", k=2)
    assert top and any("LLMWEB_CACHE_DIR" in c.text for c in top)


def test_off_topic_messages_retrieve_nothing_and_on_topic_ones_something(guide_library):
    off = load_questions(EVAL_DIR / "off-topic.jsonl", on_topic=False)
    on = load_questions(EVAL_DIR / "guide-questions.jsonl", on_topic=True)
    issue = ["My locker code is Zanzibar-7781. Please remember it.", "Can you summarize our conversation so far?"]
    assert [q.text for q in off[:2]] == issue  # two messages that must retrieve nothing
    for text in issue:
        assert guide_library.search("local", text) == [], text
        assert guide_library.search("local", text, min_score=-1, raw=True), "raw skips the gate (not the floor)"
    leaked = [q.text for q in off if guide_library.search("local", q.text)]
    assert len(leaked) <= 0.1 * len(off), leaked
    missed = [q.text for q in on if not guide_library.search("local", q.text)]
    assert len(missed) <= 0.15 * len(on), missed
    for q in on[::7]:
        hits = guide_library.search("local", q.text)
        assert not hits or any(q.answered_by(c) for c in hits), q.text
        assert all(-1.0 <= c.score <= 1.0 for c in hits)  # each chunk's own cosine


def test_the_private_library_is_gated_on_its_own(tmp_path, guide_library, embedder, corpus):
    library = Library(guide_library.settings.replace(shared_uploads="0"), embedder)
    library.ingest_uploads("anon:x", [(corpus / "trains.md", "trains.md")])
    hits = library.search("anon:x", "When does the night train to Vienna leave?")
    assert [c.source for c in hits] == ["trains.md"], "the guide is not about trains: nothing from it"
    found = library.retrieve("anon:x", "When does the night train to Vienna leave?")
    assert found.admitted == [True, False] and not found.gated


def test_fusion_counts_ranks_not_scores_and_keeps_one_copy():
    def chunk(name: str, score: float) -> Chunk:
        return Chunk(text=name, source=name, doc_id=name, score=score)

    a, b, c = chunk("a", 0.9), chunk("b", 0.5), chunk("c", 0.1)
    own = Candidates(dense=[a, b, c], keyword=[(c, 40.0), (b, 2.0)], terms=[], total=10, floor=0.2)
    shared = Candidates(dense=[a], keyword=[(a, 1.0)], terms=[], total=10)  # the same file
    fused = hybrid.fuse([own, shared])
    by = {s.chunk.source: s for s in fused}
    assert [s.chunk.source for s in fused] == ["a", "b", "c"], "one copy each"
    assert (by["a"].dense_rank, by["a"].keyword_rank, by["a"].fused) == (1, 1, pytest.approx(2 / 61))
    assert (by["b"].dense_rank, by["b"].keyword_rank, by["b"].fused) == (2, 2, pytest.approx(2 / 62))
    # c is under the dense floor; it tops one keyword ranking by far in BM25, but a rank is a rank
    assert (by["c"].dense_rank, by["c"].keyword_rank, by["c"].bm25, by["c"].fused) == (
        None,
        1,
        40.0,
        pytest.approx(1 / 61),
    )
    assert [s.chunk.source for s in hybrid.fuse([own], use_keyword=False)] == ["a", "b"]
    assert [s.chunk.source for s in hybrid.fuse([own], use_dense=False)] == ["c", "b"]


def test_calibration_picks_a_rule_that_separates_separable_evidence():
    def ev(cos: float, cov: float = 0.0, agree: bool = False) -> Evidence:
        return Evidence(cos, cov, agree)

    data = {
        "one": [(ev(0.6), True), (ev(0.3, 1.0, True), True), (ev(0.3, 0.1, True), False), (ev(0.1), False)],
        "two": [(ev(0.5), True), (ev(0.35, 0.9, True), True), (ev(0.33), False), (ev(0.2, 1.0, False), False)],
    }
    result = calibrate(data)
    for rows in data.values():
        assert all(result.gate.admits(e) == label for e, label in rows), result.gate
    assert result.rows[0]["rule"] == "chosen (all corpora)"
    assert result.rows[0]["one"] == {"on_topic_admitted": 1.0, "off_topic_admitted": 0.0}
    assert isinstance(hybrid.GATE, Gate)


# --------------------------------------------------------------------------- the CLI


@pytest.mark.slow  # subprocesses load torch and the embedder
def test_search_cli_applies_the_gate_and_raw_shows_the_ranking(tmp_path):
    out = run_cli(tmp_path, "ingest", str(GUIDE))
    assert out.returncode == 0, out.stderr[-2000:]
    message = "My locker code is Zanzibar-7781. Please remember it."
    gated = run_cli(tmp_path, "search", message)
    assert gated.returncode == 0 and "Nothing relevant" in gated.stdout and "[1]" not in gated.stdout
    raw = run_cli(tmp_path, "search", message, "--raw", "--k", "3")
    assert raw.returncode == 0 and "gate: NOT relevant" in raw.stdout
    assert "[3]" in raw.stdout and "cosine " in raw.stdout and "fused " in raw.stdout
    on = json.loads(run_cli(tmp_path, "search", "Which port does llmweb listen on?", "--json", "--raw").stdout)
    assert on["gate"][0]["relevant"] and on["results"][0]["heading"] == "How do I start llmweb?"
    assert {"dense_rank", "keyword_rank", "bm25", "fused"} <= set(on["results"][0])


# --------------------------------------------------------------------------- the optional reranker


@pytest.fixture(scope="module")
def tiny_cross_encoder(tmp_path_factory) -> Path:
    """A random 1-layer BERT cross-encoder on the embedder's own tokenizer, saved to a folder: no download."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    from llmweb.retrieval.embedder import default_embedder_path

    folder = tmp_path_factory.mktemp("reranker")
    tokenizer = AutoTokenizer.from_pretrained(default_embedder_path())
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        num_labels=1,
    )
    BertForSequenceClassification(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_a_reranker_reorders_the_fused_results_and_never_opens_the_gate(guide_library, tiny_cross_encoder):
    library = Library(guide_library.settings.replace(reranker=str(tiny_cross_encoder)), guide_library.embedder)
    question = "How do I change the model?"
    found = library.retrieve("local", question, k=4)
    assert len(found.chunks) == 4 and all(s.rerank is not None for s in found.scored)
    values = [s.rerank for s in found.scored]
    assert values == sorted(values, reverse=True)
    pool = {(s.chunk.doc_id, s.chunk.start) for s in guide_library.retrieve("local", question, k=16).scored}
    assert {(c.doc_id, c.start) for c in found.chunks} <= pool, "it reorders what the fusion found"
    assert library.search("local", "Tell me a joke.") == [], "the gate decides before the reranker"


def test_a_reranker_path_that_does_not_load_is_a_config_error(tmp_path, guide_library):
    with pytest.raises(ConfigError, match="LLMWEB_RERANKER must be the local folder"):
        Settings(reranker=str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    library = Library(guide_library.settings.replace(reranker=str(tmp_path / "empty")), guide_library.embedder)
    with pytest.raises(ConfigError, match="Could not load the reranker in .*LLMWEB_RERANKER"):
        library.search("local", "How do I change the model?")
