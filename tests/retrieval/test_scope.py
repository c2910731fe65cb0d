"""A chat's chosen documents: retrieval ranks the chosen documents' chunks alone, however
many others outrank them (FAISS's ID selector and FTS5's rowid filter, not a filter after the top k);
names resolve only among the caller's own and the shared documents, and another owner's document
is the same "not found" as one that does not exist; a kept choice follows a file replaced by a new
version. Real embedder, real FAISS and FTS5 indexes on disk."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from llmweb.chat.document_task import DocumentTasks
from llmweb.config import Settings
from llmweb.errors import InputError
from llmweb.retrieval.embedder import Embedder
from llmweb.retrieval.library import Library

pytestmark = pytest.mark.slow  # the real embedder

A, B = "anon:" + "a" * 32, "anon:" + "b" * 32
QUESTION = "When does the Harbor office open on weekdays?"
OLD = "Harbor office hours (2023). The Harbor office opens at 8 am on weekdays and closes at 4 pm."
NEW = "Harbor office hours (2024). The Harbor office opens at 11 am on weekdays and closes at 7 pm."


@pytest.fixture(scope="module")
def embedder() -> Embedder:
    return Embedder()


@pytest.fixture
def library(tmp_path, embedder) -> Library:
    return Library(Settings(data_dir=tmp_path / "data", sample_docs=False, single_user="0"), embedder)


def upload(library: Library, owner: str, tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / f"up-{owner[-3:]}-{name}"
    path.write_text(text, encoding="utf-8")
    [report] = library.ingest_uploads(owner, [(path, name)])
    assert report.ok, report.message
    return report.doc_id


def cited(library: Library, owner: str, only=None, query: str = QUESTION) -> set[str]:
    return {c.source for c in library.search(owner, query, k=4, only=only)}


def test_a_chosen_document_is_the_only_one_read(library, tmp_path):
    old = upload(library, A, tmp_path, "hours-2023.txt", OLD)
    new = upload(library, A, tmp_path, "hours-2024.txt", NEW)
    assert cited(library, A) == {"hours-2023.txt", "hours-2024.txt"}, "unscoped, both documents answer"
    assert cited(library, A, only={old}) == {"hours-2023.txt"}
    assert cited(library, A, only={new}) == {"hours-2024.txt"}
    assert cited(library, A, only=frozenset()) == set(), "an empty choice reads nothing"


def test_a_chosen_document_is_found_below_many_better_matches(library, tmp_path):
    """Forty documents match the question better than the chosen one: a filter applied after the
    top k would find nothing; ranking the chosen chunks alone finds it."""
    files = []
    for n in range(40):
        path = tmp_path / f"near-{n}.txt"
        path.write_text(f"Harbor office {n}. The Harbor office opens at {n % 12 + 1} am on weekdays.\n")
        files.append((path, f"near-{n}.txt"))
    assert all(r.ok for r in library.ingest_uploads(A, files))
    far = upload(library, A, tmp_path, "far.txt", "Opening of the harbour: the ferry leaves on weekdays at noon.")
    assert "far.txt" not in cited(library, A), "unscoped, the chosen document is outranked"
    assert cited(library, A, only={far}) == {"far.txt"}


def test_names_resolve_among_the_callers_documents_only(library, tmp_path):
    mine = upload(library, A, tmp_path, "hours-2024.txt", NEW)
    assert library.resolve(A, ["hours-2024.txt"]) == ((mine, "hours-2024.txt"),)
    assert library.resolve(A, ["HOURS-2024.TXT", mine]) == ((mine, "hours-2024.txt"),), "by id, or any case"
    errors = []
    for wanted in (["hours-2024.txt"], [mine], ["no-such-file.txt"]):
        with pytest.raises(InputError) as e:
            library.resolve(B, wanted)
        errors.append(str(e.value).replace(repr(wanted[0]), "NAME"))
    assert len(set(errors)) == 1, "another owner's document reads as one that does not exist"
    # forged: B's choice or request naming A's document by id reads nothing of it
    assert library.scope(B, [(mine, "hours-2024.txt")]) == frozenset()
    assert cited(library, B, only={mine}) == set()
    tasks = DocumentTasks(library.settings, None, None, None, SimpleNamespace(context_limit=1024), library)
    assert tasks.detect(B, "Summarise hours-2024.txt", force=True, only={mine}) is None


def test_a_kept_choice_follows_its_file_to_a_new_version(library, tmp_path):
    first = upload(library, A, tmp_path, "hours.txt", OLD)
    kept = library.resolve(A, ["hours.txt"])
    second = upload(library, A, tmp_path, "hours.txt", NEW)  # same name: replaces it
    assert first != second and library.scope(A, kept) == {second}
    library.remove(A, second)
    assert library.scope(A, kept) == frozenset(), "removed: nothing left to read"


def test_a_whole_document_task_reads_only_the_chosen_documents(library, tmp_path):
    old = upload(library, A, tmp_path, "hours-2023.txt", OLD)
    new = upload(library, A, tmp_path, "hours-2024.txt", NEW)
    tasks = DocumentTasks(library.settings, None, None, None, SimpleNamespace(context_limit=1024), library)
    intent = tasks.detect(A, "Summarise this document", only={old})
    assert intent is not None and [d.doc_id for d in intent.docs] == [old], "'this document': the chosen one"
    with pytest.raises(InputError, match="hours-2024.txt is not one of the documents this chat reads"):
        tasks.detect(A, "Summarise hours-2024.txt", only={old})
    assert [d.doc_id for d in tasks.detect(A, "Summarise hours-2024.txt").docs] == [new], "unscoped: any"
