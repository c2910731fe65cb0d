"""The per-owner uploads quota counts what a file unpacks to: a small .docx or .pdf may
hold far more text than its bytes (a zip bomb's ratio), so its extracted text is measured."""

from __future__ import annotations

import io
from types import SimpleNamespace

import docx
import pytest

from llmweb.errors import InputError
from llmweb.retrieval import library as library_module
from llmweb.retrieval.library import Library
from tests.retrieval.test_library import make_settings, tree, upload

ALICE = "anon:alice"


def compressible_docx(mb: float) -> bytes:
    """A .docx of about `mb` MB of text that zips to a few KB."""
    d = docx.Document()
    line = "the llama sleeps in the barn " * 30
    for _ in range(int(mb * 2**20 / len(line))):
        d.add_paragraph(line)
    out = io.BytesIO()
    d.save(out)
    return out.getvalue()


def test_a_docx_counts_its_text_not_its_zipped_bytes(tmp_path):
    library = Library(make_settings(tmp_path, user_docs_mb=1), embedder=SimpleNamespace(dim=384, label="fake"))
    data = compressible_docx(1.5)
    assert len(data) < 200 * 1024, "small on disk"
    before = tree(tmp_path / "data")
    with pytest.raises(InputError, match="limit of 1 MB"):
        library.ingest_uploads(ALICE, [upload(tmp_path, "bomb.docx", data)])
    assert tree(tmp_path / "data") == before, "refused before anything is written"


def test_a_stored_document_counts_its_extracted_text(tmp_path):
    doc = SimpleNamespace(doc_id="d", size=1000)
    index = SimpleNamespace(chunks=lambda doc_id: [SimpleNamespace(end=500), SimpleNamespace(end=90_000)])
    assert library_module._quota_size(index, doc) == 90_000
    assert library_module._quota_size(SimpleNamespace(chunks=lambda d: []), doc) == 1000


def test_an_upload_past_its_addresss_budget_is_refused_before_it_is_read(tmp_path):
    """The store counts every owner's documents by client address: A2 shares X with A1, whose documents
    fill most of X's budget; A2's upload, within A2's own quota, is refused with the store's message
    at its admission (before a parse), writing nothing. B, of another address, is not refused by it."""
    from llmweb.store.db import Store
    from llmweb.store.models import OwnerCaps

    library = Library(make_settings(tmp_path, user_docs_mb=1), embedder=SimpleNamespace(dim=384, label="fake"))
    a1, a2, b = "anon:a1", "anon:a2", "anon:b"
    with Store(tmp_path / "llmweb.sqlite3", caps=OwnerCaps(address_doc_bytes=2**20)) as store:
        for owner, address in ((a1, "198.51.100.7"), (a2, "198.51.100.7"), (b, "203.0.113.5")):
            store.note_address(owner, address)
        store.claim_document_bytes(a1, 900 * 1024)
        before = tree(tmp_path / "data")
        with pytest.raises(InputError, match="LLMWEB_DOCS_PER_ADDRESS_MB") as e:
            library.ingest_uploads(a2, [upload(tmp_path, "notes.txt", "word " * 40_000)], room=store)
        assert "your network" in str(e.value) and "Remove some documents" in str(e.value)
        assert tree(tmp_path / "data") == before, "refused before anything is written"
        store.document_room(b, 900 * 1024)  # another address: room
