"""Uploads are private on every install (retrieval/library.py): on a default install (loopback, no
login) a stranger, their own anonymous owner, does not list, search or run a whole-document task
on the single user's uploads; and a data dir where the previous version shared them (the fixture
tests/fixtures/shared-uploads-v1, written by that version's `Library.ingest_uploads(LOCAL_OWNER)`)
opens with them moved to the single user's own library, nothing lost. Real embedder, real FAISS."""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from llmweb.chat.document_task import DocumentTasks
from llmweb.config import Settings
from llmweb.retrieval.embedder import Embedder
from llmweb.retrieval.index import Index
from llmweb.retrieval.library import LOCAL_OWNER, SHARED, UPLOADS_MARKER, Library

pytestmark = pytest.mark.slow  # the real embedder and FAISS indexes on disk

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "shared-uploads-v1"
STRANGER = "anon:" + "s" * 32
LETTER = "Dear Sam,\n\nThe vault code is 4711 and the spare key is under the blue flowerpot.\n"
QUESTION = "What is the vault code, and where is the spare key?"


@pytest.fixture(scope="module")
def embedder() -> Embedder:
    return Embedder()


def default_install(data_dir: Path, **kw) -> Settings:
    return Settings(data_dir=data_dir, sample_docs=False, **kw)  # 127.0.0.1, no login: single-user


def sees(library: Library, owner: str) -> dict:
    """What `owner` gets of the letter: its listing, its search hits, its chunks, a whole-document task."""
    docs = {d.source: d for d in library.documents(owner)}
    hits = library.search(owner, QUESTION, k=16, min_score=-1, raw=True)
    tasks = DocumentTasks(library.settings, None, None, None, SimpleNamespace(context_limit=1024), library)
    letter = next((d.doc_id for d in library.documents(LOCAL_OWNER) if d.source == "secret-letter.txt"), "")
    return {
        "listed": "secret-letter.txt" in docs,
        "found": any("4711" in h.text for h in hits),
        "chunks": bool(library.chunks(owner, letter)),
        "task": tasks.detect(owner, "Summarize secret-letter.txt", force=True) is not None,
    }


NOTHING = {"listed": False, "found": False, "chunks": False, "task": False}
EVERYTHING = {"listed": True, "found": True, "chunks": True, "task": True}


def test_a_stranger_gets_nothing_of_the_single_users_uploads_on_a_default_install(tmp_path, embedder):
    library = Library(default_install(tmp_path / "data"), embedder)
    upload = tmp_path / "upload-1"
    upload.write_text(LETTER)
    [report] = library.ingest_uploads(LOCAL_OWNER, [(upload, "secret-letter.txt")])
    assert report.ok and report.doc_id not in library.shared
    assert sees(library, LOCAL_OWNER) == EVERYTHING
    assert sees(library, STRANGER) == NOTHING
    assert [d.scope for d in library.documents(LOCAL_OWNER)] == ["yours"]


def test_the_previous_versions_shared_uploads_become_the_single_users_own_once(tmp_path, embedder):
    data = tmp_path / "data"
    shutil.copytree(FIXTURE, data)
    settings = default_install(data)
    before = Index(settings, SHARED, embedder=embedder)
    assert {d.source for d in before.documents()} == {"guide/models.md", "secret-letter.txt"}, "the fixture"

    library = Library(settings, embedder)
    assert sees(library, STRANGER) == NOTHING
    assert sees(library, LOCAL_OWNER) == EVERYTHING, "nothing lost"
    assert [(d.source, d.scope) for d in library.documents(LOCAL_OWNER)] == [
        ("secret-letter.txt", "yours"),
        ("guide/models.md", "shared"),
    ]
    assert [(d.source, d.scope) for d in library.documents(STRANGER)] == [("guide/models.md", "shared")]
    assert (data / "index" / UPLOADS_MARKER).exists()

    # once: a file the operator ingests into the shared library later stays shared
    later = tmp_path / "faq.md"
    later.write_text("# FAQ\n\nThe server listens on port 7860 unless LLMWEB_PORT says otherwise.\n")
    library.ingest_shared([later])
    again = Library(settings, embedder)
    assert {d.source for d in again.documents(STRANGER)} == {"guide/models.md", "faq.md"}


def test_a_move_cut_short_is_finished_at_the_next_start(tmp_path, embedder):
    """`Index.move_to` adds to the owner's library before it removes from the shared one: a crash in
    between leaves the letter in both, and the marker unwritten; the next start removes the copy."""
    data = tmp_path / "data"
    shutil.copytree(FIXTURE, data)
    settings = default_install(data)
    Library(settings, embedder)  # moved
    (data / "index" / UPLOADS_MARKER).unlink()
    letter = tmp_path / "upload-2"
    letter.write_text(LETTER)  # the same bytes as the fixture's upload: the same document id
    [again] = Index(settings, SHARED, embedder=embedder).ingest_uploads([(letter, "secret-letter.txt")])
    assert again.ok, "the state a crash between the two commits leaves: the letter in both libraries"

    library = Library(settings, embedder)
    assert sees(library, STRANGER) == NOTHING and sees(library, LOCAL_OWNER) == EVERYTHING
    assert [d.source for d in library.documents(LOCAL_OWNER)].count("secret-letter.txt") == 1


def test_an_install_that_never_shared_uploads_keeps_its_shared_library(tmp_path, embedder):
    """A server (0.0.0.0 or login) kept uploads private already: its shared library is the operator's."""
    data = tmp_path / "data"
    shutil.copytree(FIXTURE, data)
    library = Library(default_install(data, host="0.0.0.0"), embedder)
    assert {d.source for d in library.documents(STRANGER)} == {"guide/models.md", "secret-letter.txt"}
    assert (data / "index" / UPLOADS_MARKER).exists()
