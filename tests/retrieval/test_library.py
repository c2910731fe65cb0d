"""retrieval/library.py: owners' private libraries and the shared one, with the real embedder and FAISS folders."""

from __future__ import annotations

import itertools
import re
import threading
from pathlib import Path

import pytest

from llmweb.config import Settings
from llmweb.errors import InputError
from llmweb.retrieval import library as library_module
from llmweb.retrieval.embedder import Embedder
from llmweb.retrieval.index import Index
from llmweb.retrieval.library import LOCAL_OWNER, SHARED, Library, private_namespace
from llmweb.retrieval.storage import list_namespaces

pytestmark = pytest.mark.slow  # the real embedder and FAISS indexes on disk (seconds per test)

ALICE, BOB = "anon:alice-token", "user:bob"
LLAMA = "The llama sleeps in the red barn behind the orchard.\n"
OWL = "# Owls\n\nThe owl hunts mice at night over the frozen lake.\n"
GUIDE = "# Guide\n\nTo change the model, set LLMWEB_MODEL and restart the server.\n"
_names = itertools.count()


@pytest.fixture(scope="module")
def embedder() -> Embedder:
    e = Embedder()
    assert e.dim == 384  # loads the model once for the module
    return e


def make_settings(tmp_path: Path, **kw) -> Settings:
    kw.setdefault("shared_uploads", "0")  # a server for many visitors unless a test says otherwise
    kw.setdefault("sample_docs", False)
    return Settings(data_dir=tmp_path / "data", **kw)


@pytest.fixture
def library(tmp_path, embedder) -> Library:
    return Library(make_settings(tmp_path), embedder)


def upload(tmp_path: Path, name: str, data: str | bytes) -> tuple[Path, str]:
    """A browser upload: a temp file with a meaningless name, and the name the user gave."""
    folder = tmp_path / "uploads"
    folder.mkdir(exist_ok=True)
    path = folder / f"upload-{next(_names)}"
    path.write_bytes(data.encode() if isinstance(data, str) else data)
    return path, name


def padded_html(text: str, kib: int) -> bytes:
    """An HTML page of about `kib` KiB whose text is one sentence: big on disk, one chunk to embed."""
    pad = "x" * (kib * 1024)
    return f"<html><head><script>var pad = '{pad}';</script></head><body><p>{text}</p></body></html>".encode()


def tree(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*") if p.is_file()}


def doc_ids(docs) -> set[str]:
    return {d.doc_id for d in docs}


def test_an_upload_is_found_and_listed_only_by_its_owner(tmp_path, library):
    [report] = library.ingest_uploads(ALICE, [upload(tmp_path, "llama.txt", LLAMA)])
    assert report.status == "added"

    hits = library.search(ALICE, "Where does the llama sleep?", k=3)
    assert hits and hits[0].source == "llama.txt"
    # not even with no score floor at all
    assert all(
        c.doc_id != report.doc_id for c in library.search(BOB, "Where does the llama sleep?", k=16, min_score=-1)
    )
    assert [(d.source, d.scope, d.removable) for d in library.documents(ALICE)] == [("llama.txt", "yours", True)]
    assert library.documents(BOB) == []
    assert library.is_empty(BOB) and not library.is_empty(ALICE)

    # the owner string never reaches a path: the folder is named by a hash
    names = [p.name for p in (tmp_path / "data" / "index").iterdir() if p.is_dir()]
    assert names == [private_namespace(ALICE)] and re.fullmatch(r"private-[0-9a-f]{32}", names[0])
    assert not any("alice" in str(p.relative_to(tmp_path)) for p in (tmp_path / "data").rglob("*"))


def test_a_visitor_cannot_remove_another_owners_document_nor_learn_that_it_exists(tmp_path, library):
    [report] = library.ingest_uploads(ALICE, [upload(tmp_path, "llama.txt", LLAMA)])

    with pytest.raises(InputError) as theirs:
        library.remove(BOB, report.doc_id)
    with pytest.raises(InputError) as by_name:
        library.remove(BOB, "llama.txt")
    with pytest.raises(InputError) as unknown:
        library.remove(BOB, "0" * 32)
    assert str(theirs.value) == str(by_name.value) == str(unknown.value)
    assert report.doc_id not in str(theirs.value)
    assert doc_ids(library.documents(ALICE)) == {report.doc_id}

    info = library.remove(ALICE, report.doc_id)
    assert (info.source, info.doc_id) == ("llama.txt", report.doc_id)
    assert library.documents(ALICE) == [] and library.search(ALICE, "llama", min_score=-1) == []


def test_the_shared_library_is_searched_by_everyone_and_a_visitor_cannot_remove_it(tmp_path, library):
    guide = tmp_path / "guide.md"
    guide.write_text(GUIDE)
    [report] = library.ingest_shared([guide])
    library.ingest_uploads(ALICE, [upload(tmp_path, "llama.txt", LLAMA)])

    for owner in (ALICE, BOB, LOCAL_OWNER):
        assert library.search(owner, "How do I change the model?", k=1)[0].source == "guide.md"
        shared = [d for d in library.documents(owner) if d.doc_id == report.doc_id]
        assert [(d.scope, d.removable) for d in shared] == [("shared", False)]
        assert not library.is_empty(owner)
    # the owner's own documents come first in the list
    assert [d.scope for d in library.documents(ALICE)] == ["yours", "shared"]

    with pytest.raises(InputError) as shared_doc:
        library.remove(BOB, report.doc_id)
    with pytest.raises(InputError) as unknown:
        library.remove(BOB, "0" * 32)
    assert str(shared_doc.value) == str(unknown.value)
    assert report.doc_id in library.shared


def test_search_merges_both_libraries_by_fused_rank_and_never_returns_a_chunk_twice(tmp_path, library):
    text = GUIDE + "\n" + OWL
    shared_file = tmp_path / "guide.md"
    shared_file.write_text(text)
    library.ingest_shared([shared_file])
    [mine] = library.ingest_uploads(ALICE, [upload(tmp_path, "guide.md", text)])  # the same bytes, privately
    library.ingest_uploads(ALICE, [upload(tmp_path, "llama.txt", LLAMA)])

    hits = library.search(ALICE, "What does the owl hunt at night?", k=16, min_score=-1)
    keys = [(c.doc_id, c.start) for c in hits]
    assert len(keys) == len(set(keys)), "the same chunk from both libraries is returned once"
    assert all(-1 <= c.score <= 1 for c in hits)  # each chunk's own cosine; the order is the fused rank
    assert hits[0].doc_id == mine.doc_id and "owl" in hits[0].text
    assert {c.source for c in hits} == {"guide.md", "llama.txt"}
    assert len(library.search(ALICE, "owl", k=1, min_score=-1)) == 1
    assert library.search(ALICE, "   ") == [] and library.search(ALICE, "owl", k=0) == []
    # listed once, as the owner's own
    assert [(d.source, d.scope) for d in library.documents(ALICE)] == [("guide.md", "yours"), ("llama.txt", "yours")]
    assert [(d.source, d.scope) for d in library.documents(BOB)] == [("guide.md", "shared")]


def test_shared_uploads_mode_puts_uploads_in_the_shared_library(tmp_path, embedder):
    library = Library(make_settings(tmp_path, shared_uploads="1"), embedder)
    [report] = library.ingest_uploads(ALICE, [upload(tmp_path, "llama.txt", LLAMA)])

    assert report.doc_id in library.shared
    assert library.search(BOB, "Where does the llama sleep?", k=1)[0].source == "llama.txt"
    assert [(d.scope, d.removable) for d in library.documents(BOB)] == [("shared", True)]
    assert list_namespaces(library.settings) == [SHARED]
    library.remove(BOB, report.doc_id)
    assert library.is_empty(ALICE)


def test_the_per_owner_cap_refuses_an_upload_with_both_numbers_and_writes_nothing(tmp_path, embedder):
    library = Library(make_settings(tmp_path, user_docs_mb=1), embedder)
    first = upload(tmp_path, "first.html", padded_html("The llama sleeps in the barn.", 700))
    [ok] = library.ingest_uploads(ALICE, [first])
    assert ok.status == "added" and library.usage_bytes(ALICE) > 700 * 1024

    before = tree(tmp_path / "data")
    second = upload(tmp_path, "second.html", padded_html("The owl hunts at night.", 500))
    with pytest.raises(InputError) as refused:
        library.ingest_uploads(ALICE, [upload(tmp_path, "small.txt", OWL), second])
    message = str(refused.value)
    assert re.search(r"to 1\.2 MB", message) and re.search(r"limit of 1 MB", message), message
    assert tree(tmp_path / "data") == before, "a refused upload writes nothing"
    assert [d.source for d in library.documents(ALICE)] == ["first.html"]

    # the same content again adds nothing, so it is not refused; another owner has a cap of their own
    assert library.ingest_uploads(ALICE, [first])[0].status == "duplicate"
    assert library.ingest_uploads(BOB, [second])[0].status == "added"
    # a new version of the same file replaces the old one and is measured as the difference
    assert (
        library.ingest_uploads(ALICE, [upload(tmp_path, "first.html", padded_html("Cats purr.", 720))])[0].status
        == "updated"
    )
    # files the index refuses anyway keep their own message rather than the cap's
    [too_big] = Library(make_settings(tmp_path, user_docs_mb=1, max_file_mb=1), embedder).ingest_uploads(
        ALICE, [upload(tmp_path, "huge.html", padded_html("Huge.", 1100))]
    )
    assert too_big.status == "error" and "LLMWEB_MAX_FILE_MB" in too_big.message


def test_two_uploads_at_once_by_one_owner_cannot_both_pass_the_cap(tmp_path, embedder):
    library = Library(make_settings(tmp_path, user_docs_mb=1), embedder)
    files = [upload(tmp_path, f"page{i}.html", padded_html(f"Page {i} is about topic {i}.", 600)) for i in range(2)]
    outcomes: list[str] = []
    start = threading.Barrier(2)

    def go(f):
        start.wait()
        try:
            outcomes.append(library.ingest_uploads(ALICE, [f])[0].status)
        except InputError:
            outcomes.append("refused")

    threads = [threading.Thread(target=go, args=(f,)) for f in files]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(outcomes) == ["added", "refused"]
    assert library.usage_bytes(ALICE) <= 1024 * 1024


def test_delete_owner_removes_their_private_folder_and_nothing_else(tmp_path, library):
    guide = tmp_path / "guide.md"
    guide.write_text(GUIDE)
    library.ingest_shared([guide])
    library.ingest_uploads(ALICE, [upload(tmp_path, "llama.txt", LLAMA)])
    library.ingest_uploads(BOB, [upload(tmp_path, "owl.md", OWL)])
    folder = tmp_path / "data" / "index" / private_namespace(ALICE)
    assert folder.is_dir()

    assert library.delete_owner(ALICE) is True
    assert not folder.exists()
    assert [d.scope for d in library.documents(ALICE)] == ["shared"]
    reachable = library.search(ALICE, "llama barn owl model", k=16, min_score=-1, raw=True)  # no gate: all it can see
    assert {c.source for c in reachable} == {"guide.md"}
    assert [d.source for d in library.documents(BOB)] == ["owl.md", "guide.md"]
    assert library.delete_owner(ALICE) is False
    # the owner can start again
    assert library.ingest_uploads(ALICE, [upload(tmp_path, "llama.txt", LLAMA)])[0].status == "added"


def test_private_libraries_stay_apart_when_the_cache_evicts_them(tmp_path, library, monkeypatch):
    monkeypatch.setattr(library_module, "PRIVATE_CACHE", 2)
    owners = {f"anon:{i}": text for i, text in enumerate([LLAMA, OWL, GUIDE])}
    for owner, text in owners.items():
        library.ingest_uploads(owner, [upload(tmp_path, f"{owner[5:]}.md", text)])
    for owner, text in owners.items():
        [hit] = library.search(owner, text, k=1)
        assert hit.source == f"{owner[5:]}.md" and len(library.documents(owner)) == 1


def test_an_owner_must_be_given(library):
    for owner in ("", None):
        with pytest.raises(ValueError):
            library.search(owner, "llama")  # type: ignore[arg-type]


def test_a_legacy_docs_index_moves_to_the_local_owners_library_once(tmp_path, embedder):
    settings = make_settings(tmp_path, shared_uploads="auto")
    legacy = Index(settings, "docs", embedder=embedder)  # what the previous version wrote
    old_upload = tmp_path / "llama.txt"
    old_upload.write_text(LLAMA)
    [old] = legacy.ingest([old_upload])
    (tmp_path / "data" / "index" / ".sample-seeded").write_text("indexed\n")  # the old seeding marker

    library = Library(settings, embedder)
    assert list_namespaces(settings) == [private_namespace(LOCAL_OWNER)]
    assert [(d.doc_id, d.source, d.scope) for d in library.documents(LOCAL_OWNER)] == [
        (old.doc_id, "llama.txt", "yours")
    ]
    assert library.search(LOCAL_OWNER, "Where does the llama sleep?", k=1)[0].doc_id == old.doc_id
    assert library.documents(ALICE) == [], "a stranger on a server does not see the old uploads"

    # a crash after the rename but before the marker: the next start just writes the marker
    marker = tmp_path / "data" / "index" / ".docs-migrated"
    marker.unlink()
    assert doc_ids(Library(settings, embedder).documents(LOCAL_OWNER)) == {old.doc_id} and marker.exists()

    # it runs once: a "docs" folder that appears later is left alone, and the moved library is untouched
    Index(settings, "docs", embedder=embedder).ingest_uploads([upload(tmp_path, "owl.md", OWL)])
    again = Library(settings, embedder)
    assert sorted(list_namespaces(settings)) == ["docs", private_namespace(LOCAL_OWNER)]
    assert doc_ids(again.documents(LOCAL_OWNER)) == {old.doc_id}


def test_the_sample_guide_is_seeded_into_the_shared_library_despite_the_old_marker(tmp_path, embedder):
    from llmweb.runtime import Runtime

    settings = make_settings(tmp_path, sample_docs=True, shared_uploads="auto")
    old_upload = tmp_path / "llama.txt"
    old_upload.write_text(LLAMA)
    Index(settings, "docs", embedder=embedder).ingest([old_upload])  # the previous version's library...
    (tmp_path / "data" / "index" / ".sample-seeded").write_text("indexed\n")  # ...and its seeding marker

    rt = Runtime(settings)
    try:
        rt._library = Library(settings, embedder)  # share the module's embedder instead of loading another
        rt._seed_sample()
        assert [(d.source, d.scope) for d in rt.library.documents(ALICE)] == [("sample/llmweb-guide.md", "shared")]
        assert [(d.source, d.scope) for d in rt.library.documents(LOCAL_OWNER)] == [
            ("llama.txt", "yours"),
            ("sample/llmweb-guide.md", "shared"),
        ]
        rt.library.remove(LOCAL_OWNER, rt.library.documents(ALICE)[0].doc_id)  # single-user: uploads are shared
        rt._seed_sample()
        assert rt.library.documents(ALICE) == [], "seeded once: a removed guide does not come back"
    finally:
        rt.close()


def test_one_addresss_visitors_share_its_documents_budget_and_a_removal_frees_it(tmp_path, embedder):
    """A1 and A2 from one address, B from another, each within their own 1 MB: A1's upload fills most
    of the address's budget, A2's is refused naming it (nothing written), B's is added; A1 removes its
    document (chat/document_task.py's `remove_document` records it), and A2's upload is added."""
    from llmweb.chat.document_task import remove_document
    from llmweb.store.db import Store
    from llmweb.store.models import OwnerCaps

    library = Library(make_settings(tmp_path, user_docs_mb=1), embedder)
    a1, a2, b = "anon:a1", "anon:a2", "anon:b"
    with Store(tmp_path / "llmweb.sqlite3", caps=OwnerCaps(address_doc_bytes=1200 * 1024)) as store:
        for owner, address in ((a1, "2001:db8:5:6::/64"), (a2, "2001:db8:5:6::/64"), (b, "203.0.113.5")):
            store.note_address(owner, address)
        [first] = library.ingest_uploads(a1, [upload(tmp_path, "a1.html", padded_html(LLAMA, 700))], room=store)
        assert first.status == "added"
        page = padded_html(OWL, 600)
        before = tree(tmp_path / "data")
        with pytest.raises(InputError, match="LLMWEB_DOCS_PER_ADDRESS_MB"):
            library.ingest_uploads(a2, [upload(tmp_path, "a2.html", page)], room=store)
        assert tree(tmp_path / "data") == before and library.is_empty(a2)
        assert library.ingest_uploads(b, [upload(tmp_path, "b.html", page)], room=store)[0].status == "added"
        remove_document(library, store, a1, first.doc_id)
        assert library.ingest_uploads(a2, [upload(tmp_path, "a2.html", page)], room=store)[0].status == "added"
        counted = dict(store._db.execute("SELECT owner, doc_bytes FROM owners").fetchall())
        assert counted[a1] == 0 and counted[a2] == library.usage_bytes(a2) > 600 * 1024
