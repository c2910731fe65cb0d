"""retrieval/index.py with the real embedder, real FAISS files and real JSON metadata in tmp_path."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

from llmweb.config import Settings
from llmweb.errors import ConfigError, InputError
from llmweb.records import Chunk
from llmweb.retrieval.chunking import count_tokens
from llmweb.retrieval.embedder import Embedder
from llmweb.retrieval.index import Index
from llmweb.retrieval.parsers import load_document
from llmweb.retrieval.storage import MANIFEST, delete_namespace, list_namespaces
from tests.retrieval.test_documents import encrypt_pdf, make_docx, make_pdf

pytestmark = pytest.mark.slow  # the real embedder and FAISS indexes on disk (seconds per test)

GUIDE = Path(__file__).resolve().parents[2] / "data" / "sample" / "llmweb-guide.md"

CATS = (
    "# Cats\n\nCats purr when they are content. A cat sleeps up to sixteen hours a day.\n\n"
    "# Feeding\n\nAdult cats eat twice a day; kittens need more frequent meals.\n"
)
DOGS = "Dogs bark at the mailman. A dog needs a walk every day, rain or shine.\n"
TRAINS = (
    "<h1>Trains</h1><p>The night train leaves the central station at eleven.</p>"
    "<h2>Tickets</h2><p>Buy tickets at the machine on platform two.</p>"
)


@pytest.fixture(scope="module")
def embedder() -> Embedder:
    e = Embedder()
    assert e.dim == 384  # loads the model once for the module
    return e


@pytest.fixture
def settings(tmp_path) -> Settings:
    return Settings(data_dir=tmp_path / "data")


@pytest.fixture
def corpus(tmp_path) -> Path:
    folder = tmp_path / "corpus"
    (folder / "sub").mkdir(parents=True)
    (folder / "cats.md").write_text(CATS)
    (folder / "sub" / "dogs.txt").write_text(DOGS)
    (folder / "trains.html").write_text(TRAINS)
    (folder / "widget.docx").write_bytes(make_docx())
    (folder / "report.pdf").write_bytes(
        make_pdf(
            ["Quarterly sales of umbrellas rose in the rainy spring.", "The cafeteria menu now includes lentil soup."]
        )
    )
    (folder / ".hidden.txt").write_text("hidden file, must be skipped")
    (folder / "image.gif").write_bytes(b"GIF89a")  # not a supported type: a folder walk skips it
    return folder


def results(hits: list[Chunk]) -> list[tuple]:
    return [(c.source, c.start, c.end, c.text, c.page, c.heading, round(c.score, 5)) for c in hits]


QUERIES = [
    "how long do cats sleep",
    "when does the night train leave",
    "what soup is on the menu",
    "clean the widget",
    "walking the dog",
]


def snapshot(index: Index) -> list[list[tuple]]:
    return [results(index.search(q, k=3, min_score=0.0)) for q in QUERIES]


# --------------------------------------------------------------------------- ingest, search, reload


def test_ingest_search_and_reload_after_restart(settings, embedder, corpus):
    index = Index(settings, embedder=embedder)
    reports = index.ingest([corpus])
    assert [(r.name, r.status) for r in reports] == [
        ("corpus/cats.md", "added"),
        ("corpus/report.pdf", "added"),
        ("corpus/trains.html", "added"),
        ("corpus/widget.docx", "added"),
        ("corpus/sub/dogs.txt", "added"),
    ]
    assert all(
        r.chunks >= 1 and r.message == f"added {r.chunks} chunk" + ("s" if r.chunks > 1 else "") for r in reports
    )

    top = {q: index.search(q, k=1)[0] for q in QUERIES}
    assert top["how long do cats sleep"].heading == "Cats"
    assert top["when does the night train leave"].heading == "Trains"
    assert (top["what soup is on the menu"].source, top["what soup is on the menu"].page) == ("corpus/report.pdf", 2)
    assert top["clean the widget"].heading == "Cleaning"
    assert top["walking the dog"].source == "corpus/sub/dogs.txt"
    hits = index.search("how long do cats sleep", k=5, min_score=0.0)
    assert [h.score for h in hits] == sorted((h.score for h in hits), reverse=True)
    assert all(not os.path.isabs(h.source) for h in hits)

    before = snapshot(index)
    docs_before = index.documents()
    restarted = Index(Settings(data_dir=settings.data_dir), embedder=Embedder())  # new objects, same dir
    assert snapshot(restarted) == before
    assert restarted.documents() == docs_before
    assert [d.chunks for d in docs_before] == [r.chunks for r in sorted(reports, key=lambda r: r.name.lower())]


def test_empty_index_answers_without_loading_the_embedder(settings):
    cold = Embedder()
    index = Index(settings, embedder=cold)
    assert index.search("anything at all") == []
    assert index.documents() == [] and len(index) == 0
    assert not cold.loaded
    assert not settings.data_dir.exists()  # reading creates nothing


def test_k_is_clamped_and_score_floor_applies(settings, embedder, corpus):
    index = Index(settings.replace(max_top_k=3, top_k=2), embedder=embedder)
    index.ingest([corpus])
    assert len(index) > 3
    assert len(index.search("cats", k=100, min_score=-1.0)) == 3
    assert len(index.search("cats", min_score=-1.0)) == 2  # settings.top_k
    assert index.search("cats", k=0) == []
    assert index.search("   ") == []
    assert index.search("quantum chromodynamics of neutron stars", min_score=0.6) == []
    assert all(h.score >= 0.3 for h in index.search("cats sleep", k=3, min_score=0.3))


def test_progress_reports_reading_and_embedding(settings, embedder, corpus):
    calls = []
    reports = Index(settings, embedder=embedder).ingest([corpus], progress=lambda *a: calls.append(a))
    reading = [c for c in calls if c[2].startswith("reading")]
    embedding = [c for c in calls if c[2] == "embedding"]
    assert [c[:2] for c in reading] == [(i, 5) for i in range(5)]
    assert embedding[-1][:2] == (sum(r.chunks for r in reports),) * 2
    assert [c[0] for c in embedding] == sorted(c[0] for c in embedding)


# --------------------------------------------------------------------------- dedupe, update, removal


def test_dedupe_by_content(settings, embedder, corpus, tmp_path):
    index = Index(settings, embedder=embedder)
    index.ingest([corpus])
    n, files = len(index), sorted(os.listdir(index.dir))
    again = index.ingest([corpus / "cats.md"])
    assert [(r.status, r.chunks, r.message) for r in again] == [
        ("duplicate", 0, "already indexed (same content as corpus/cats.md)")
    ]
    assert len(index) == n and sorted(os.listdir(index.dir)) == files  # nothing was written
    copy = tmp_path / "copy-of-dogs.txt"
    copy.write_text(DOGS)
    twice = tmp_path / "twice.txt"
    twice.write_text("brand new words about owls")
    reports = index.ingest([copy, twice, twice])
    assert [(r.status, r.message) for r in reports] == [
        ("duplicate", "already indexed (same content as corpus/sub/dogs.txt)"),
        ("added", "added 1 chunk"),
        ("duplicate", "already indexed"),
    ]
    assert len(index) == n + 1


def test_changed_file_replaces_earlier_version(settings, embedder, tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("The meeting is on Monday.")
    index = Index(settings, embedder=embedder)
    first = index.ingest([path])[0]
    path.write_text("The meeting moved to Thursday afternoon.")
    second = index.ingest([path])[0]
    assert (second.status, second.message) == ("updated", "updated: replaced the earlier version with 1 chunk")
    assert [d.doc_id for d in index.documents()] == [second.doc_id] != [first.doc_id]
    assert [h.text for h in index.search("when is the meeting", k=5, min_score=0)] == [
        "The meeting moved to Thursday afternoon."
    ]


def test_remove_document(settings, embedder, corpus):
    index = Index(settings, embedder=embedder)
    index.ingest([corpus])
    total = len(index)
    removed = index.remove("corpus/cats.md")
    assert removed.source == "corpus/cats.md" and len(index) == total - removed.chunks
    assert all(h.source != "corpus/cats.md" for h in index.search("cats sleeping", k=10, min_score=-1))
    trains = next(d for d in index.documents() if d.source == "corpus/trains.html")
    index.remove(trains.doc_id)  # by id works too
    reloaded = Index(settings, embedder=embedder)
    assert sorted(d.source for d in reloaded.documents()) == [
        "corpus/report.pdf",
        "corpus/sub/dogs.txt",
        "corpus/widget.docx",
    ]
    assert len(reloaded) == total - removed.chunks - trains.chunks
    with pytest.raises(InputError, match="no document named 'nope.md'"):
        index.remove("nope.md")
    assert index.ingest([corpus / "cats.md"])[0].status == "added"  # can come back after removal


def test_other_instance_sees_changes(settings, embedder, corpus):
    a, b = Index(settings, embedder=embedder), Index(settings, embedder=embedder)
    assert b.search("cats") == []
    a.ingest([corpus / "cats.md"])
    assert b.search("how long do cats sleep", k=1)[0].heading == "Cats"
    b.ingest([corpus / "sub" / "dogs.txt"])  # b commits on top of a's generation, losing nothing
    assert sorted(d.source for d in a.documents()) == ["cats.md", "dogs.txt"]


# --------------------------------------------------------------------------- atomicity


@pytest.mark.parametrize("fail_on", ["vectors-", "meta-", "fts-", MANIFEST])
def test_failed_write_leaves_previous_index(settings, embedder, corpus, monkeypatch, fail_on):
    index = Index(settings, embedder=embedder)
    index.ingest([corpus / "cats.md", corpus / "trains.html"])
    before, docs = snapshot(index), index.documents()
    real_replace = os.replace

    def crash(src, dst):
        if Path(dst).name.startswith(fail_on):
            raise OSError(28, "No space left on device (simulated)")
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="simulated"):
        index.ingest([corpus / "report.pdf", corpus / "sub" / "dogs.txt"])
    with pytest.raises(OSError, match="simulated"):
        index.remove("cats.md")
    monkeypatch.setattr(os, "replace", real_replace)

    assert snapshot(index) == before and index.documents() == docs  # the live object kept the old state
    reloaded = Index(settings, embedder=embedder)  # and so does the disk
    assert snapshot(reloaded) == before and reloaded.documents() == docs
    assert not [p for p in os.listdir(index.dir) if p.endswith(".tmp")]

    # the next write succeeds and cleans up
    assert [r.status for r in reloaded.ingest([corpus / "report.pdf"])] == ["added"]
    manifest = json.loads((index.dir / MANIFEST).read_text())
    assert set(os.listdir(index.dir)) <= {
        MANIFEST,
        manifest["vectors"],
        manifest["meta"],
        manifest["keywords"],
        f"vectors-{manifest['generation'] - 1:08d}.faiss",
        f"meta-{manifest['generation'] - 1:08d}.json",
        f"fts-{manifest['generation'] - 1:08d}.sqlite3",
    }
    assert len(Index(settings, embedder=embedder).documents()) == 3


def test_disagreeing_files_are_reported_not_loaded(settings, embedder, corpus):
    index = Index(settings, embedder=embedder)
    index.ingest([corpus / "cats.md"])
    index.ingest([corpus / "trains.html"])
    manifest = json.loads((index.dir / MANIFEST).read_text())
    manifest["meta"] = f"meta-{manifest['generation'] - 1:08d}.json"  # pair new vectors with old metadata
    (index.dir / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ConfigError, match="cannot be read .*disagree.*delete that folder"):
        Index(settings, embedder=embedder).documents()


def test_index_built_with_another_embedder_is_refused(settings, embedder, corpus):
    Index(settings, embedder=embedder).ingest([corpus / "cats.md"])
    other = Embedder("sentence-transformers/some-other-model")
    with pytest.raises(ConfigError, match="built with the embedding model 'all-MiniLM-L6-v2 \\(embedded\\)'"):
        Index(settings, embedder=other).search("cats")
    assert not other.loaded


# --------------------------------------------------------------------------- bad input in a batch


def test_bad_files_get_messages_and_the_rest_ingests(tmp_path, embedder):
    settings = Settings(data_dir=tmp_path / "data", max_file_mb=1)
    d = tmp_path / "in"
    d.mkdir()
    files = {
        "good.txt": DOGS.encode(),
        "empty.txt": b"",
        "binary.txt": bytes(range(256)) * 8,
        "broken.pdf": b"%PDF-1.7\n1 0 obj << /Type /Catalog >> garbage",
        "locked.pdf": encrypt_pdf(make_pdf(["top secret plans"])),
        "program.exe": b"MZ\x90\x00",
        "huge.md": b"# big\n\n" + b"lorem ipsum " * 100_000,
        "good.pdf": make_pdf(["Owls hunt at night and sleep by day."]),
    }
    for name, data in files.items():
        (d / name).write_bytes(data)
    index = Index(settings, embedder=embedder)
    reports = index.ingest([d / n for n in files] + [d / "missing.md"])
    got = {r.name: (r.status, r.message) for r in reports}
    assert got["good.txt"] == ("added", "added 1 chunk")
    assert got["good.pdf"] == ("added", "added 1 chunk")
    assert got["empty.txt"] == ("error", "empty.txt is empty.")
    assert got["binary.txt"][1].startswith("binary.txt looks like a binary file, not text")
    assert got["broken.pdf"][1].startswith("broken.pdf could not be read as a PDF (damaged or malformed")
    assert got["locked.pdf"][1].startswith("locked.pdf is password-protected")
    assert got["program.exe"][1].startswith("program.exe: '.exe' files are not supported; use one of .txt, .md")
    assert got["huge.md"] == ("error", "huge.md is 1.1 MB; the limit is 1 MB (LLMWEB_MAX_FILE_MB).")
    assert got["missing.md"][0] == "error" and "no such file or folder" in got["missing.md"][1]
    assert [r.ok for r in reports].count(True) == 2
    assert [r.describe() for r in reports[:2]] == ["good.txt: added 1 chunk", "empty.txt is empty."]
    assert sorted(doc.source for doc in index.documents()) == ["good.pdf", "good.txt"]
    assert index.search("when do owls hunt", k=1)[0].source == "good.pdf"


def test_uploads_sanitise_names_and_write_only_under_data_dir(tmp_path, embedder):
    outside = tmp_path / "outside"
    data = outside / "inner" / "data"  # "../" from the data dir's index folder still lands in tmp_path
    settings = Settings(data_dir=data, max_file_mb=1)
    uploads = tmp_path / "uploads"
    uploads.mkdir()
    for i, text in enumerate(
        ["Penguins live in the southern hemisphere.", "Koalas eat eucalyptus leaves.", "nothing", "Big " * 300_000]
    ):
        (uploads / f"tmp{i}").write_text(text)
    before = {p for p in tmp_path.rglob("*")}
    index = Index(settings, embedder=embedder)
    reports = index.ingest_uploads(
        [
            (uploads / "tmp0", "../../../evil.txt"),
            (uploads / "tmp1", "/etc/cron.d/koala.md"),
            (uploads / "tmp2", ".."),
            (uploads / "tmp3", "../big.txt"),
        ]
    )
    assert [(r.name, r.status) for r in reports] == [
        ("evil.txt", "added"),
        ("koala.md", "added"),
        ("..", "error"),
        ("big.txt", "error"),
    ]
    assert reports[0].message == "added 1 chunk (given as '../../../evil.txt')"
    assert "no usable name" in reports[2].message
    assert reports[3].message == "big.txt is 1.1 MB; the limit is 1 MB (LLMWEB_MAX_FILE_MB)."
    assert index.search("where do penguins live", k=1)[0].source == "evil.txt"
    new = {p for p in tmp_path.rglob("*")} - before
    assert new and all(p == data or data in p.parents or p in data.parents for p in new), new
    assert not list(tmp_path.rglob("evil.txt")) and not list(tmp_path.rglob("koala.md"))
    single = index.ingest_upload(uploads / "tmp0", "again.txt")
    assert (single.status, single.message) == ("duplicate", "already indexed (same content as evil.txt)")


# --------------------------------------------------------------------------- the sample guide, limits, offsets


def test_sample_guide_answers_how_to_change_the_model(settings, embedder):
    index = Index(settings, embedder=embedder)
    assert [r.status for r in index.ingest([GUIDE])] == ["added"]
    for query in ("how do I change the model", "How do I change the model?"):
        top = index.search(query, k=4)[0]
        assert top.heading == "How do I change the model?" and "LLMWEB_MODEL" in top.text
        assert top.label() == "llmweb-guide.md, How do I change the model?"
    assert index.search("where is my data stored", k=1)[0].heading == "Where is my data stored?"
    assert index.search("how do I add documents", k=1)[0].heading == "How do I add documents?"


@pytest.mark.parametrize("chunk_tokens, overlap", [(200, 40), (1000, 100), (32, 8)])
def test_chunks_fit_the_embedder_and_offsets_are_exact(tmp_path, embedder, corpus, chunk_tokens, overlap):
    settings = Settings(data_dir=tmp_path / "data", chunk_tokens=chunk_tokens, chunk_overlap=overlap)
    index = Index(settings, embedder=embedder)
    (corpus / "long.txt").write_text(
        " ".join(f"Sentence number {i} talks about topic {i % 17}." for i in range(250)) + " " + "x" * 1500
    )
    index.ingest([corpus, GUIDE])
    limit = min(chunk_tokens, embedder.max_tokens)
    assert embedder.max_tokens == 254 and embedder.model.max_seq_length == 256
    checked = 0
    for info in index.documents():
        path = GUIDE if info.source == GUIDE.name else corpus.parent / info.source
        doc = load_document(path, info.source)
        for c in index.chunks(info.doc_id):
            assert doc.text[c.start : c.end] == c.text
            assert count_tokens(embedder.tokenizer, [c.text])[0] <= limit
            assert len(embedder.tokenizer(c.text)["input_ids"]) <= embedder.model.max_seq_length
            checked += 1
    assert checked == len(index) > 10


# --------------------------------------------------------------------------- namespaces and threads


def test_namespaces_are_separate_and_deletable(settings, embedder, corpus):
    docs = Index(settings, embedder=embedder)
    docs.ingest([corpus / "cats.md"])
    recall = Index(settings, namespace="recall-42", embedder=embedder)
    turns = [
        Chunk(
            text="User asked about the train to Vienna; I said it leaves at nine.",
            source="turn 1",
            doc_id="turn-1",
            kind="recall",
        ),
        Chunk(text="User's favourite colour is green.", source="turn 2", doc_id="turn-2", kind="recall"),
    ]
    assert recall.add_chunks(turns) == 2
    assert recall.add_chunks(turns[:1]) == 0  # already there
    hit = recall.search("what time is the Vienna train", k=1)[0]
    assert (hit.kind, hit.source, hit.doc_id) == ("recall", "turn 1", "turn-1")
    assert all(h.kind == "document" for h in docs.search("train to Vienna", k=5, min_score=-1))
    assert list_namespaces(settings) == ["docs", "recall-42"]

    assert delete_namespace(settings, "recall-42") is True
    assert delete_namespace(settings, "recall-42") is False
    assert recall.search("Vienna train") == [] and len(recall) == 0
    assert list_namespaces(settings) == ["docs"] and len(docs) > 0
    assert recall.add_chunks(turns[1:]) == 1  # a deleted namespace starts again from empty
    for bad in ("../docs", "a/b", "", ".hidden", "x" * 200):
        with pytest.raises(InputError, match="not a valid index name"):
            Index(settings, namespace=bad, embedder=embedder)
        with pytest.raises(InputError):
            delete_namespace(settings, bad)


def test_search_while_ingesting(settings, embedder, corpus, tmp_path):
    index = Index(settings, embedder=embedder)
    index.ingest([corpus / "cats.md"])
    big = tmp_path / "big"
    big.mkdir()
    for i in range(6):
        (big / f"f{i}.txt").write_text(f"File {i}. " + " ".join(f"Fact {j} about subject {i}." for j in range(300)))
    errors, answers = [], []
    done = threading.Event()

    def searcher():
        while not done.is_set():
            try:
                answers.append(index.search("how long do cats sleep", k=1)[0].heading)
            except Exception as e:  # noqa: BLE001 - any error fails the test below
                errors.append(e)
                return

    threads = [threading.Thread(target=searcher) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        reports = index.ingest([big])
    finally:
        done.set()
        for t in threads:
            t.join()
    assert not errors, errors
    assert answers and set(answers) == {"Cats"}
    assert all(r.status == "added" for r in reports) and len(reports) == 6
