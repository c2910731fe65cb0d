"""Opening a cited source (chat/passages.py) over a real Library: uploads chunked and indexed into
FAISS and FTS5 files on disk (a word-hashing stand-in for the embedder, words as tokens), and
Sources made as a turn makes them (`Source.from_chunk`). A source opens its passage with the text
around it, only for an owner who may read its document; a place from another owner, a removed or
re-ingested document, or a forged one opens nothing, one answer for all."""

from __future__ import annotations

import contextlib
import re
import threading
import zlib
from types import SimpleNamespace

import numpy as np
import pytest

from llmweb.chat.passages import NEIGHBOUR_CHARS, PASSAGE_CHARS, joined, locate, open_source
from llmweb.records import Chunk, Source
from llmweb.retrieval.library import Library
from tests.conftest import make_settings

A, B = "anon:" + "a" * 32, "anon:" + "b" * 32
WORDS = re.compile(r"\S+")


class WordTokenizer:
    """Words as tokens, answered in the shape of a fast Hugging Face tokenizer's."""

    def __call__(self, texts, add_special_tokens=False, verbose=False, return_offsets_mapping=False):
        if isinstance(texts, str):
            spans = [m.span() for m in WORDS.finditer(texts)]
            out = {"input_ids": [0] * len(spans)}
            return out | ({"offset_mapping": spans} if return_offsets_mapping else {})
        return {"input_ids": [[0] * len(WORDS.findall(t)) for t in texts]}


class WordEmbedder:
    """A stand-in for the embedder: each word hashed into one of 64 slots, rows unit-length."""

    label, dim, max_tokens = "test-words", 64, 256

    def __init__(self) -> None:
        self.lock = threading.RLock()

    @contextlib.contextmanager
    def borrowed_tokenizer(self):
        yield WordTokenizer()

    def embed(self, texts, progress=None, *, threads=None):
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        for i, text in enumerate(texts):
            for word in text.lower().split():
                out[i, zlib.crc32(word.encode()) % self.dim] += 1.0
            out[i, 0] += 1e-3
        if progress is not None:
            progress(len(texts), len(texts))
        return out / np.linalg.norm(out, axis=1, keepdims=True)

    def embed_query(self, text: str):
        return self.embed([text])


def paragraph(i: int) -> str:
    return f"Paragraph {i} says the rover number {i} carries {i * 7} kilograms of rock samples home."


LETTER = "# Rover log\n\n" + "\n\n".join(paragraph(i) for i in range(1, 13)) + "\n"


@pytest.fixture
def library(tmp_path) -> Library:
    settings = make_settings(tmp_path, single_user="0", chunk_tokens=30, chunk_overlap=4)
    return Library(settings, WordEmbedder())


def upload(library: Library, owner: str, name: str, text: str, tmp_path) -> str:
    path = tmp_path / f"upload-{zlib.crc32(text.encode())}"
    path.write_text(text)
    [report] = library.ingest_uploads(owner, [(path, name)])
    assert report.ok, report
    return report.doc_id


def cited(library: Library, owner: str, doc_id: str, at: int, n: int = 1) -> Source:
    """The source a turn would store for chunk number `at` of the document."""
    return Source.from_chunk(library.chunks(owner, doc_id)[at], n)


def test_a_source_opens_its_passage_with_its_heading_and_the_text_around_it(library, tmp_path):
    doc = upload(library, A, "rover.md", LETTER, tmp_path)
    chunks = library.chunks(A, doc)
    assert len(chunks) >= 4, "the letter is cut into several chunks"
    source = cited(library, A, doc, 2)
    assert (source.doc_id, source.start, source.end) == (doc, chunks[2].start, chunks[2].end)

    p = open_source(library, A, None, source)
    assert p is not None and not p.by_words
    assert p.cited.text == chunks[2].text, "the passage as the model was given it"
    assert p.cited.heading == "Rover log"
    assert LETTER[chunks[1].start : chunks[2].start].strip().endswith(p.before.text.strip()[-40:])
    assert p.before.text and chunks[2].text not in p.before.text, "before it: the text the passage does not hold"
    assert LETTER[chunks[2].end : chunks[3].end].strip() == p.after.text.strip()
    first = open_source(library, A, None, cited(library, A, doc, 0))
    assert first.before is None and first.after is not None
    last = open_source(library, A, None, cited(library, A, doc, len(chunks) - 1))
    assert last.after is None and last.before is not None


def test_visitor_b_cannot_open_visitor_as_passage_even_with_its_exact_place(library, tmp_path):
    doc = upload(library, A, "rover.md", LETTER, tmp_path)
    source = cited(library, A, doc, 2)
    assert open_source(library, A, None, source) is not None
    assert open_source(library, B, None, source) is None, "A's exact place opens nothing for B"
    # B has a document of the same name: A's place still opens nothing, and neither does B's own
    # name and A's first words (a turn stored before places: found only in what B may read)
    upload(library, B, "rover.md", "# Rover log\n\nB's own rover notes, nothing like A's.\n", tmp_path)
    assert open_source(library, B, None, source) is None
    legacy = Source(1, source.source, source.page, source.heading, snippet=source.snippet)
    assert open_source(library, A, None, legacy).by_words
    assert open_source(library, B, None, legacy) is None
    forged = [
        Source(1, "x.md", doc_id="f" * 32, start=0, end=50, snippet="Paragraph"),
        Source(1, "x.md", doc_id="../" + doc, start=source.start, end=source.end, snippet=source.snippet),
        Source(1, "rover.md", doc_id=doc, start=source.end, end=source.start, snippet=source.snippet),
    ]
    assert [open_source(library, A, None, s) for s in forged] == [None, None, None]


def test_a_removed_or_re_ingested_document_opens_nothing_a_shared_one_opens_for_everyone(library, tmp_path):
    doc = upload(library, A, "rover.md", LETTER, tmp_path)
    source = cited(library, A, doc, 1)
    library.ingest_uploads(A, [(_write(tmp_path, LETTER.replace("rover", "probe")), "rover.md")])  # replaces it
    assert doc not in {d.doc_id for d in library.documents(A)}
    assert open_source(library, A, None, source) is None, "the document was re-ingested with other text"

    shared = library.ingest_shared([_write(tmp_path, LETTER, "guide.md")])[0].doc_id
    s = cited(library, A, shared, 1)
    assert open_source(library, A, None, s) is not None and open_source(library, B, None, s) is not None
    library.shared.remove(shared)
    assert open_source(library, A, None, s) is None


def _write(tmp_path, text: str, name: str = "") -> object:
    path = tmp_path / (name or f"file-{zlib.crc32(text.encode())}")
    path.write_text(text)
    return path


def test_a_source_stored_before_places_opens_by_its_name_page_heading_and_first_words(library, tmp_path):
    doc = upload(library, A, "rover.md", LETTER, tmp_path)
    s = cited(library, A, doc, 3)
    old = Source.from_dict({k: v for k, v in s.to_dict().items() if k not in ("doc_id", "start", "end")})
    p = open_source(library, A, None, old)
    assert p.by_words and p.cited.text == library.chunks(A, doc)[3].text
    other_words = Source(1, "rover.md", None, "Rover log", snippet="Nothing in the letter says this")
    no_words = Source(1, "rover.md", None, "Rover log")
    assert open_source(library, A, None, other_words) is None and open_source(library, A, None, no_words) is None


def test_a_stored_source_keeps_its_place_and_a_source_without_one_is_stored_as_before():
    s = Source(2, "a.pdf", 3, None, 0.5, "document", "text", "d" * 32, 10, 90)
    assert Source.from_dict(s.to_dict()) == s
    old = {"n": 1, "source": "a.md", "page": None, "heading": "H", "score": 0.1, "kind": "document", "snippet": "x"}
    assert Source.from_dict(old).to_dict() == old, "a turn stored before places reads and writes back the same"


def chunk(text: str, start: int, page: int | None = None, heading: str | None = None) -> Chunk:
    return Chunk(text, "report.pdf", page, heading, start, start + len(text), doc_id="d" * 32)


def test_a_whole_document_piece_opens_as_its_chunks_joined_and_a_page_comes_with_each_part():
    text = "One. Two three four.\n\nFive six seven. Eight nine ten.\n\nEleven twelve."
    spans = [(0, 20), (5, 37), (22, 53), (55, len(text))]  # overlapping neighbours; a gap before the last
    chunks = [chunk(text[a:b], a, page=1 if a < 55 else 2) for a, b in spans]
    assert joined(chunks, 0, len(text)) == text, "the gap the chunker trimmed comes back as a paragraph break"
    piece = Source(1, "report.pdf", 1, None, doc_id="d" * 32, start=5, end=53, snippet="Two three four. Five six")
    p = locate(chunks, piece)
    assert p.cited.text == text[5:53] and p.cited.page == 1
    assert p.before.text == "One. " and p.after.text == "Eleven twelve." and p.after.page == 2


def test_text_is_bounded_whatever_the_chunk_and_cut_where_said():
    long = " ".join(f"w{i}" for i in range(6_000))
    chunks = [chunk(long, 0), chunk(long, len(long) + 2)]
    p = locate(chunks, Source.from_chunk(chunks[0], 1))
    assert p.cited.cut and len(p.cited.text) <= PASSAGE_CHARS + 1 and p.cited.text.endswith("…")
    assert p.after.cut and len(p.after.text) <= NEIGHBOUR_CHARS + 1
    back = locate(chunks, Source.from_chunk(chunks[1], 2))
    assert back.before.cut and back.before.text.startswith("…") and len(back.before.text) <= NEIGHBOUR_CHARS + 1
    assert back.before.text.endswith(long[-20:]), "the nearest text kept"


def conversation(*turns: tuple[str, str]):
    return SimpleNamespace(turns=[SimpleNamespace(idx=i, user=u, assistant=a) for i, (u, a) in enumerate(turns)])


def test_a_recall_source_opens_its_earlier_turn_while_that_turn_is_still_in_the_chat():
    conv = conversation(("My cello is named Bach.", "A fine name."), ("What else?", "Nothing."))
    recalled = Chunk("User: My cello is named Bach.", "turn 1", doc_id="turn-0", kind="recall")
    source = Source.from_chunk(recalled, 3)
    p = open_source(None, A, conv, source)
    assert p.cited.text == "User: My cello is named Bach.\nAssistant: A fine name."
    legacy = Source(3, "turn 1", kind="recall", snippet=source.snippet)  # stored before places
    assert open_source(None, A, conv, legacy).cited.text == p.cited.text
    edited = conversation(("My violin is named Bo.", "Nice."), ("What else?", "Nothing."))
    assert open_source(None, A, edited, source) is None, "another version of the chat is shown now"
    assert open_source(None, A, conversation(), source) is None, "the turn was undone"
    assert open_source(None, A, conv, Source(1, "turn x", kind="recall", doc_id="turn-x")) is None


def test_every_section_a_whole_document_task_cites_opens_as_its_run_of_the_document(library, tmp_path):
    from llmweb.chat.document_plan import split

    doc = upload(library, A, "rover.md", LETTER, tmp_path)
    chunks = library.chunks(A, doc)
    pieces = split(chunks, 60, lambda t: len(t.split()))
    assert 1 < len(pieces) < len(chunks), "pieces of a few chunks each"
    for piece in pieces:
        p = open_source(library, A, None, Source.from_chunk(piece.as_chunk(), piece.n))
        assert p is not None and " ".join(p.cited.text.split()) == " ".join(piece.text.split())
