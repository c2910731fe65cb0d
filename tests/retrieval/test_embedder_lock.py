"""No stranger-sized work under the embedder's lock, and an upload parsed once.

The real embedder and real indexes on disk. Every other visitor's retrieval takes `Embedder.lock`
for its query; an upload that chunks a long document, or an import's recall batch of 1 MB
messages, must not hold it for the whole of its work.
"""

from __future__ import annotations

import threading

import pytest

from llmweb.retrieval import embedder as embedder_module
from llmweb.retrieval import index as index_module
from llmweb.retrieval import parsers
from llmweb.retrieval.library import Library
from tests.retrieval.test_documents import make_pdf
from tests.retrieval.test_library import embedder, make_settings, upload  # noqa: F401 (the fixture)

pytestmark = pytest.mark.slow  # the real embedder

ALICE, BOB = "anon:alice", "anon:bob"


def test_a_query_goes_on_while_another_visitors_upload_is_chunked(tmp_path, embedder, monkeypatch):  # noqa: F811
    """Alice's upload is stopped inside its chunking (a hook); Bob's query embeds meanwhile. On the
    code before, the chunking held the embedder's lock and Bob's query waited for all of it."""
    library = Library(make_settings(tmp_path), embedder)
    library.ingest_uploads(BOB, [upload(tmp_path, "bob.txt", "Bob keeps bees on the roof.")])
    real = index_module.chunk_document
    seen: dict[str, bool] = {}
    threads: list[threading.Thread] = []

    def chunk(doc, tokenizer, **kw):
        if doc.name == "alice.txt" and "done" not in seen:
            other = threading.Thread(target=lambda: library.search(BOB, "Where are the bees?"))
            other.start()
            other.join(timeout=20)
            seen["done"] = not other.is_alive()  # else it waits for this chunking's lock: joined below
            threads.append(other)
        return real(doc, tokenizer, **kw)

    monkeypatch.setattr(index_module, "chunk_document", chunk)
    text = "\n\n".join(f"Paragraph {i} of Alice's long notes about gardening." for i in range(400))
    [report] = library.ingest_uploads(ALICE, [upload(tmp_path, "alice.txt", text)])
    for other in threads:
        other.join()
    assert report.ok, report.message
    assert seen == {"done": True}, "Bob's query waited for Alice's chunking"
    assert [d.source for d in library.documents(ALICE)] == ["alice.txt"]
    assert "bees" in library.search(BOB, "Where are the bees?")[0].text


def test_two_chunkings_at_once_each_borrow_their_own_tokenizer(embedder):  # noqa: F811
    with embedder.borrowed_tokenizer() as a, embedder.borrowed_tokenizer() as b:
        assert a is not b and a is not embedder.tokenizer
        assert a("two words")["input_ids"] == embedder.tokenizer("two words")["input_ids"]
    with embedder.borrowed_tokenizer() as again:
        assert again in (a, b), "copies are kept for reuse, not made per chunking"


def test_a_huge_text_is_cut_before_it_is_tokenized_and_embeds_the_same(embedder, monkeypatch):  # noqa: F811
    """An import's recall batch may hold 1 MB messages; the model reads 256 word pieces of each, so
    tokenizing the rest only held the lock. What reaches the model is cut; the vector is the same."""
    model = embedder.model
    cut = embedder_module.MAX_CHARS_PER_TOKEN * model.max_seq_length
    big = "the orchard needs pruning before the frost " * 25_000  # ~1.1 MB
    lengths: list[int] = []
    real = model.encode

    def encode(texts, **kw):
        lengths.extend(len(t) for t in texts)
        return real(texts, **kw)

    monkeypatch.setattr(model, "encode", encode)
    vec = embedder.embed([big])[0]
    assert max(lengths) <= cut < len(big)
    monkeypatch.setattr(model, "encode", real)
    whole = real([big], normalize_embeddings=True, convert_to_numpy=True, show_progress_bar=False)[0]
    assert float(vec @ whole) > 0.999, "the model saw the same first word pieces"


def test_a_pdf_upload_is_parsed_once(tmp_path, embedder, monkeypatch):  # noqa: F811
    """The quota check measures the parsed text that the index then adds (it parsed a PDF itself
    before: a 10-million-character PDF cost its extraction twice)."""
    calls: list[str] = []
    real = parsers.parse_document

    def parse(data, name, **kw):
        calls.append(name)
        return real(data, name, **kw)

    monkeypatch.setattr(parsers, "parse_document", parse)
    library = Library(make_settings(tmp_path), embedder)
    pdf = make_pdf(["The vault code is 4417.", "Page two."])
    [report] = library.ingest_uploads(ALICE, [upload(tmp_path, "vault.pdf", pdf)])
    assert report.ok, report.message
    assert calls == ["vault.pdf"]
    assert "4417" in library.search(ALICE, "What is the vault code?")[0].text
