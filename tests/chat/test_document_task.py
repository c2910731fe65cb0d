"""Whole-document tasks (chat/document_plan.py, chat/document_task.py) with the word-level FakeFormat,
the real Engine over a scripted FakeRunner and a real SQLite store: the intent rule on both sides,
the pieces, the fold, the cache, cancel, the events, two visitors. No model."""

from __future__ import annotations

import dataclasses
import re
import threading
import time

import pytest

from llmweb.chat import document_plan as dp
from llmweb.chat.context import Budget
from llmweb.chat.document_task import DocumentTasks, remove_document
from llmweb.chat.session import Chat
from llmweb.chat.turn import Delta, Finished, Progress, Started, finish
from llmweb.errors import InputError
from llmweb.records import Chunk
from llmweb.store.db import Store
from llmweb.store.models import Deleted
from tests.conftest import make_settings
from tests.fakes import FakeFormat, FakeRunner, fake_engine

A, B = "anon:visitor-a", "anon:visitor-b"


def doc_chunks(name: str, n: int, words: int = 20, overlap: int = 0) -> list[Chunk]:
    """`n` chunks of `words` distinct words each, in order, neighbours sharing `overlap` words."""
    chunks, pos, text = [], 0, ""
    for i in range(n):
        own = " ".join(f"{name[:3]}{i}w{j}" for j in range(words))
        carried = " ".join(text.split()[-overlap:]) + " " if overlap and text else ""
        text = carried + own
        start = pos - len(carried)
        chunks.append(Chunk(text, name, heading=f"Part {i // 5 + 1}", start=start, end=start + len(text), doc_id=name))
        pos = start + len(text) + 1
    return chunks


class FakeLibrary:
    """Documents per owner, as `Library` answers them (`documents`, `chunks`, `remove`), scoped."""

    def __init__(self):
        self.docs: dict[str, dict[str, list[Chunk]]] = {}  # owner -> doc_id -> chunks
        self.shared: dict[str, list[Chunk]] = {}  # everyone's; anyone may remove it (uploads_shared)

    def add(self, owner: str, name: str, chunks: list[Chunk]) -> None:
        self.docs.setdefault(owner, {})[name] = chunks

    def documents(self, owner):
        from llmweb.retrieval.library import LibraryDocument

        return [
            LibraryDocument(d, d, len(c), "yours", True, added=i)
            for i, (d, c) in enumerate(self.docs.get(owner, {}).items())
        ] + [
            LibraryDocument(d, d, len(c), "shared", True, added=100 + i) for i, (d, c) in enumerate(self.shared.items())
        ]

    def chunks(self, owner, doc_id):
        return list(self.docs.get(owner, {}).get(doc_id, self.shared.get(doc_id, [])))

    def remove(self, owner, doc_id):
        if doc_id in self.docs.get(owner, {}):
            return self.docs[owner].pop(doc_id)
        if doc_id in self.shared:
            return self.shared.pop(doc_id)
        raise InputError("That document is not in your library (it may have been removed already).")

    def delete_owner(self, owner):
        return self.docs.pop(owner, None) is not None

    def usage_bytes(self, owner):
        return sum(c.end for chunks in self.docs.get(owner, {}).values() for c in chunks[-1:])

    def is_empty(self, owner):
        return True

    def search(self, *a, **k):
        return []


@pytest.fixture
def rig(tmp_path):
    settings = make_settings(tmp_path, recall=False)
    fmt = FakeFormat()
    runner = FakeRunner()
    runner.background = lambda request: fmt._words("note of the section") + [fmt.END]
    engine, _ = fake_engine(runner)
    store = Store(tmp_path / "chat.sqlite3")
    budget = Budget(
        context_limit=200, max_new_tokens=20, summary_tokens=30, retrieved_tokens=40, user_tokens=60, facts_tokens=30
    )
    library = FakeLibrary()
    chat = Chat(settings, engine, fmt, store, budget, library)
    yield chat, runner, fmt, store, library
    chat.wait_background(timeout=5)
    engine.close()
    store.close()


# ---- the rule, both sides


def refs(*names: str) -> list[dp.DocRef]:
    return [dp.DocRef(n, n, added=i) for i, n in enumerate(names)]


@pytest.mark.parametrize(
    "text, task",
    [
        ("Summarise report.pdf", dp.SUMMARISE),
        ("Please summarize report.pdf for me", dp.SUMMARISE),
        ("Can you give me a summary of report?", dp.SUMMARISE),
        ("Translate report.pdf into French", dp.TRANSLATE),
        ("List all the names in report.pdf", dp.EXTRACT),
        ("Extract every date from report.pdf", dp.EXTRACT),
        ("Outline report.pdf", dp.OUTLINE),
        ("Compare report.pdf and notes.md", dp.COMPARE),
    ],
)
def test_a_cue_and_a_named_document_is_a_task(text, task):
    intent = dp.detect(text, refs("report.pdf", "notes.md"))
    assert intent is not None and intent.task == task and intent.docs[0].source in ("report.pdf", "notes.md")


@pytest.mark.parametrize(
    "text",
    [
        "What does report.pdf say about the budget?",  # a question top-k answers
        "What is the summary of chapter 2 in report.pdf?",  # a question, even with a cue word
        "How do I list all files?",  # a question about something else
        "Summarise the French revolution",  # a cue, but no document named or pointed at
        "Tell me about report.pdf",  # a document, but no cue
    ],
)
def test_questions_and_messages_without_a_cue_or_a_document_are_not(text):
    assert dp.detect(text, refs("report.pdf", "notes.md")) is None


def test_the_attached_document_the_toggle_compare_and_the_language():
    docs = [
        dp.DocRef("old", "old.txt", 1.0),
        dp.DocRef("new", "new.txt", 2.0),
        dp.DocRef("s", "guide.md", 3.0, own=False),
    ]
    assert dp.detect("Summarise this document", docs).docs[0].doc_id == "new"  # the most recent upload
    forced = dp.detect("Who wins in the end?", docs, force=True)
    assert forced.task == dp.ASK and forced.docs[0].doc_id == "new"
    assert [d.source for d in dp.detect("Compare old.txt with new.txt", docs).docs] == ["old.txt", "new.txt"]
    assert dp.detect("Translate new.txt into german", docs).target == "German"
    assert dp.detect("Translate new.txt", docs).target == "English"
    # the key: a task's cached results depend on what it asks
    assert dp.detect("List all names in new.txt", docs).key != dp.detect("List all dates in new.txt", docs).key


def test_a_long_message_is_scanned_in_linear_time():
    text = "Summarise " + "a" * 2_000_000 + " report.pdf"
    t0 = time.perf_counter()
    dp.detect(text, refs(*(f"doc{i}.txt" for i in range(400))))
    assert time.perf_counter() - t0 < 1.0


# ---- pieces and the fold


def test_pieces_keep_document_order_fit_the_room_and_read_the_overlap_once():
    fmt = FakeFormat()
    chunks = doc_chunks("book.txt", 23, words=20, overlap=5)
    pieces = dp.split(chunks, 70, fmt.count)
    assert [p.n for p in pieces] == list(range(1, len(pieces) + 1)) and len(pieces) > 5
    assert all(fmt.count(p.text) <= 70 for p in pieces)
    words = " ".join(p.text for p in pieces).split()
    expected = [f"boo{i}w{j}" for i in range(23) for j in range(20)]
    assert words == expected  # every word once, in order: the overlap is read once
    assert pieces[0].heading == "Part 1" and pieces[-1].end == chunks[-1].end


def test_a_chunk_over_the_room_is_cut_between_words():
    fmt = FakeFormat()
    pieces = dp.split(doc_chunks("big.txt", 1, words=50), 20, fmt.count)
    assert len(pieces) == 3 and all(fmt.count(p.text) <= 20 for p in pieces)
    assert " ".join(p.text for p in pieces).split() == [f"big0w{j}" for j in range(50)]


def test_the_piece_budget_refuses_an_instruction_that_leaves_no_room():
    budget = Budget(context_limit=200, max_new_tokens=20, summary_tokens=0, retrieved_tokens=0, user_tokens=60)
    assert budget.piece_room(40, 20) == 140
    with pytest.raises(InputError, match="too long to read a document"):
        budget.piece_room(190, 20)


def test_fold_groups_at_least_halve_the_notes():
    for sizes in ([10] * 9, [50, 50, 50], [1] * 100, [60, 5, 60, 5, 60]):
        groups = dp.fold_groups(sizes, 100)
        assert [i for g in groups for i in g] == list(range(len(sizes)))
        assert len(groups) <= (len(sizes) + 1) // 2 or all(sum(sizes[i] for i in g) <= 100 for g in groups)
        assert all(len(g) >= 2 for g in groups[:-1])


# ---- the run


def run_task(chat, owner, text, **kw) -> tuple[list, Finished]:
    events = list(chat.send(owner, None, text, **kw))
    assert isinstance(events[0], Started) and isinstance(events[-1], Finished)
    return events, events[-1]


def test_a_summary_reads_every_piece_folds_and_cites_them(rig):
    chat, runner, fmt, store, library = rig
    library.add(A, "book.txt", doc_chunks("book.txt", 60))
    runner.background = lambda request: fmt._words(" ".join(["a", "long", "note"] * 6)) + [fmt.END]
    runner.enqueue(fmt._words("the book in short [1] [12]") + [fmt.END])
    events, fin = run_task(chat, A, "Summarise book.txt")
    stats = fin.document
    assert stats.task == dp.SUMMARISE and stats.read == stats.pieces > 5 and stats.coverage == 1.0
    assert stats.from_cache == 0 and stats.fold_depth >= 1 and stats.tokens_read == 60 * 20
    progress = [e.text for e in events if isinstance(e, Progress)]
    assert progress[0] == f"Reading section 1 of {stats.pieces}…" and "Writing the answer…" in progress
    answer, walk = fin.reply.split("\n\nBy section:\n")
    assert answer == "the book in short [1] [12]"
    # the walk through the document: one line per top-level note, their spans end to end, [1] to the last
    spans = [re.match(r"- \[(\d+)\](?:–\[(\d+)\])? a long note", line).groups() for line in walk.splitlines()]
    bounds = [(int(a), int(b or a)) for a, b in spans]
    assert bounds[0][0] == 1 and bounds[-1][1] == stats.pieces and len(bounds) > 1
    assert all(bounds[i + 1][0] == bounds[i][1] + 1 for i in range(len(bounds) - 1))
    assert [s.n for s in fin.sources] == list(range(1, stats.pieces + 1)) and fin.sources[0].heading == "Part 1"
    # every step one request: map steps and folds in the background, the final step a normal one
    background = [r for r in runner.requests if r.background]
    assert len(background) == stats.steps - 1 and not runner.requests[-1].background
    assert all(len(r.prompt_ids) + r.max_new_tokens <= 200 for r in runner.requests)
    (conv,) = store.list_conversations(A)
    stored = store.get(A, conv.id).turns
    assert stored[0].assistant == fin.reply and stored[0].sources[0].source == "book.txt"


def test_the_second_run_reads_the_pieces_from_the_cache(rig):
    chat, runner, fmt, store, library = rig
    library.add(A, "book.txt", doc_chunks("book.txt", 20))
    first = run_task(chat, A, "Summarise book.txt")[1].document
    n = len(runner.requests)
    second = run_task(chat, A, "Summarise book.txt")[1].document
    assert second.from_cache == second.pieces == first.pieces and second.read == second.pieces
    assert len(runner.requests) - n == second.steps  # only the folds and the final step ran again
    assert second.steps < first.steps
    # another task, another key: read again
    third = run_task(chat, A, "Outline book.txt")[1].document
    assert third.from_cache == 0


def test_a_translation_streams_piece_by_piece_in_order(rig):
    chat, runner, fmt, store, library = rig
    library.add(A, "book.txt", doc_chunks("book.txt", 12))
    counter = iter(range(1000))
    runner.background = lambda request: fmt._words(f"translated{next(counter)}") + [fmt.END]
    events, fin = run_task(chat, A, "Translate book.txt into French")
    deltas = [e.text for e in events if isinstance(e, Delta)]
    n = fin.document.pieces
    assert len(deltas) == n and all(deltas[i + 1].startswith(deltas[i]) for i in range(n - 1))
    assert fin.reply.split() == [f"translated{i}" for i in range(n)]
    assert "French" in fmt.decode(runner.requests[0].prompt_ids)


def test_closing_the_stream_keeps_the_pieces_read_and_stores_a_stopped_turn(rig):
    chat, runner, fmt, store, library = rig
    library.add(A, "book.txt", doc_chunks("book.txt", 40))
    stream = chat.send(A, None, "Summarise book.txt")
    for event in stream:
        if isinstance(event, Progress) and event.text.startswith("Reading section 3 "):
            break
    stream.close()
    intent = chat.documents.detect(A, "Summarise book.txt")
    assert len(store.piece_results(A, "book.txt", intent.key, chat.documents.model_key)) == 2
    (conv,) = store.list_conversations(A)
    (turn,) = store.get(A, conv.id).turns
    assert turn.stats.stopped and turn.assistant.startswith("Stopped after reading 2 of ")
    again = run_task(chat, A, "Summarise book.txt")[1].document
    assert again.from_cache == 2 and again.read == again.pieces


def test_two_visitors_caches_and_documents_are_their_own(rig):
    chat, runner, fmt, store, library = rig
    library.add(A, "book.txt", doc_chunks("book.txt", 10))
    run_task(chat, A, "Summarise book.txt")
    # B names A's document: not theirs, so no task (retrieval answers, and finds nothing of A's)
    assert chat.documents.detect(B, "Summarise book.txt") is None
    key = chat.documents.detect(A, "Summarise book.txt").key
    assert store.piece_results(B, "book.txt", key, chat.documents.model_key) == {}
    # B's own copy of the same content is read afresh, not from A's cache
    library.add(B, "book.txt", doc_chunks("book.txt", 10))
    assert run_task(chat, B, "Summarise book.txt")[1].document.from_cache == 0


def test_another_visitors_turn_runs_while_a_task_reads(rig):
    """Each step is its own request at background priority: B's turn does not wait for A's task."""
    chat, runner, fmt, store, library = rig
    runner.token_delay_s = 0.01
    library.add(A, "book.txt", doc_chunks("book.txt", 60))
    done: dict[str, float] = {}

    def task():
        finish(chat.send(A, None, "Summarise book.txt"))
        done["a"] = time.monotonic()

    thread = threading.Thread(target=task)
    thread.start()
    deadline = time.monotonic() + 10
    while not any(r.background for r in runner.requests) and time.monotonic() < deadline:
        time.sleep(0.01)
    chat.ask(B, None, "hello there", use_docs=False)
    done["b"] = time.monotonic()
    thread.join(30)
    assert done["b"] < done["a"]
    steps_after_b = [
        r for r in runner.requests[runner.requests.index(next(r for r in runner.requests if r.owner == B)) :]
    ]
    assert any(r.owner == A for r in steps_after_b)  # A's task went on after B's turn


def test_deleting_the_document_or_all_data_forgets_the_results(rig):
    chat, runner, fmt, store, library = rig
    library.add(A, "book.txt", doc_chunks("book.txt", 10))
    library.add(A, "other.txt", doc_chunks("other.txt", 10))
    run_task(chat, A, "Summarise book.txt")
    run_task(chat, A, "Summarise other.txt")
    key, model = chat.documents.detect(A, "Summarise book.txt").key, chat.documents.model_key
    with pytest.raises(InputError):
        remove_document(library, store, B, "book.txt")  # not B's: nothing removed
    assert store.piece_results(A, "book.txt", key, model)
    remove_document(library, store, A, "book.txt")
    assert store.piece_results(A, "book.txt", key, model) == {} and store.piece_results(A, "other.txt", key, model)
    generation = store.generation(A)
    chat.delete_owner(A)
    assert store.piece_results(A, "other.txt", key, model) == {}
    with pytest.raises(Deleted):  # a task begun before "Delete all my data" stores nothing
        store.put_piece(A, "other.txt", key, 0, model, "late", generation=generation)
    assert store.piece_results(A, "other.txt", key, model) == {}


def test_an_ordinary_question_is_still_a_top_k_turn(rig):
    chat, runner, fmt, store, library = rig
    library.add(A, "book.txt", doc_chunks("book.txt", 10))
    fin = chat.ask(A, None, "What does book.txt say about boo3w1?")
    assert fin.document is None and not any(r.background for r in runner.requests)


def test_document_tasks_sizes_fit_the_context(tmp_path):
    fmt = FakeFormat()
    budget = Budget(context_limit=200, max_new_tokens=20, summary_tokens=0, retrieved_tokens=0, user_tokens=60)
    tasks = DocumentTasks(make_settings(tmp_path), None, fmt, None, budget, None)
    for text in ("Summarise x.txt", "Translate x.txt into French", "List all names in x.txt"):
        sizes = tasks.sizes(dp.detect(text, refs("x.txt")))
        assert sizes.room >= 16 and sizes.map_cap >= 1
        if sizes.note_cap:
            assert 2 * (sizes.note_cap + 4) <= sizes.fold_room


def test_the_stateless_api_path_streams_the_task_and_keeps_only_the_pieces(rig):
    chat, runner, fmt, store, library = rig
    library.add(A, "book.txt", doc_chunks("book.txt", 10))
    intent = chat.documents.detect(A, "Who is in it? book.txt", force=True)
    assert intent.task == dp.ASK
    events = list(chat.documents.stream(A, intent))
    assert isinstance(events[0], Started) and isinstance(events[-1], Finished)
    assert events[-1].document.read == events[-1].document.pieces
    assert store.list_conversations(A) == []  # no chat stored
    assert len(store.piece_results(A, "book.txt", intent.key, chat.documents.model_key)) == events[-1].document.pieces


def test_a_long_heading_still_fits_every_step(rig):
    chat, runner, fmt, store, library = rig
    heading = " ".join(f"h{i}" for i in range(60))
    chunks = [dataclasses.replace(c, heading=heading) for c in doc_chunks("long.txt", 12)]
    library.add(A, "long.txt", chunks)
    fin = run_task(chat, A, "Summarise long.txt")[1]
    assert fin.document.read == fin.document.pieces and fin.document.coverage == 1.0
    assert all(len(r.prompt_ids) + r.max_new_tokens <= 200 for r in runner.requests)


def test_removing_a_shared_document_forgets_every_owners_results_for_it(rig):
    chat, runner, fmt, store, library = rig
    library.shared["guide.txt"] = doc_chunks("guide.txt", 10)
    library.add(B, "mine.txt", doc_chunks("mine.txt", 10))
    for owner in (A, B):
        run_task(chat, owner, "Summarise guide.txt")
    run_task(chat, B, "Summarise mine.txt")
    key, model = chat.documents.detect(A, "Summarise guide.txt").key, chat.documents.model_key
    assert store.piece_results(A, "guide.txt", key, model) and store.piece_results(B, "guide.txt", key, model)
    remove_document(library, store, A, "guide.txt")
    assert store.piece_results(A, "guide.txt", key, model) == {} == store.piece_results(B, "guide.txt", key, model)
    assert store.piece_results(B, "mine.txt", key, model), "B's own document keeps its results"


NOTES = {
    1: "The lighthouse keeper counts the stairs and checks the lamp.",
    2: "Ships reach the harbour during winter storms.",
    3: "The logbook records the weather every evening.",
}


def test_each_point_of_an_answer_cites_the_section_it_came_from():
    index = dp.cite_index(NOTES)
    reply = "The keeper checks the lamp on the stairs. Winter storms bring ships [9]. Weather [3] is logged. Yes.\nEnd"
    assert dp.attribute(reply, index, 3) == (
        "The keeper checks the lamp on the stairs [1]. Winter storms bring ships [2]. Weather [3] is logged. Yes.\nEnd"
    )
    # no note shares two words: no citation made up
    assert dp.attribute("Bananas are yellow fruit.", index, 3) == "Bananas are yellow fruit."


def test_a_streaming_answers_citations_only_ever_extend_it():
    index = dp.cite_index(NOTES)
    reply = "The keeper checks the lamp on the stairs. Winter storms bring ships... Weather is logged every evening"
    shown = [dp.attribute(reply[:i], index, 3, complete=False) for i in range(len(reply) + 1)]
    assert all(shown[i + 1].startswith(shown[i]) for i in range(len(shown) - 1))
    final = dp.attribute(reply, index, 3)
    assert final.startswith(shown[-1]) and final.endswith("every evening [3]")


def test_an_answer_past_the_citing_cap_is_kept_whole_and_still_only_grows(monkeypatch):
    monkeypatch.setattr(dp, "MAX_CITE_CHARS", 60)
    index = dp.cite_index(NOTES)
    reply = "The keeper checks the lamp on the stairs. Winter storms bring ships. Then more text follows here"
    final = dp.attribute(reply, index, 3)
    assert final.startswith("The keeper checks the lamp on the stairs [1].") and final.endswith(reply[60:])
    shown = [dp.attribute(reply[:i], index, 3, complete=False) for i in range(len(reply) + 1)]
    assert all(shown[i + 1].startswith(shown[i]) for i in range(len(shown) - 1)) and shown[-1] == final


def test_the_walk_through_the_document_cites_every_span():
    walk = dp.by_section([(1, 3, "First part. More."), (4, 4, "Second\npart"), (5, 9, "   ")])
    assert walk == "By section:\n- [1]–[3] First part.\n- [4] Second part"


def test_one_owner_at_the_document_jobs_cap_is_refused_and_the_other_is_not(rig):
    """LLMWEB_OWNER_DOCUMENT_JOBS (2 by default): A's third task at once is refused with the limit
    named; B's runs; when one of A's ends, A may start another. The local owner is not capped."""
    from llmweb.records import LOCAL_OWNER

    chat, runner, fmt, store, library = rig
    assert chat.settings.owner_document_jobs == 2
    for owner in (A, B, LOCAL_OWNER):
        library.add(owner, "book.txt", doc_chunks("book.txt", 10))
    intent = {o: chat.documents.detect(o, "Summarise book.txt") for o in (A, B, LOCAL_OWNER)}
    running = [chat.documents.stream(A, intent[A]) for _ in range(2)]
    for task in running:
        assert isinstance(next(task), Started)  # each holds its place while paused
    with pytest.raises(InputError) as e:
        next(chat.documents.stream(A, intent[A]))
    assert "LLMWEB_OWNER_DOCUMENT_JOBS" in str(e.value) and "2" in str(e.value), str(e.value)
    assert isinstance(list(chat.documents.stream(B, intent[B]))[-1], Finished), "B is not affected"
    local = [chat.documents.stream(LOCAL_OWNER, intent[LOCAL_OWNER]) for _ in range(3)]
    assert all(isinstance(next(t), Started) for t in local)
    for t in local:
        t.close()
    running[0].close()  # one of A's ends (a stop): A may start another
    assert isinstance(list(chat.documents.stream(A, intent[A]))[-1], Finished)
    running[1].close()


def test_a_whole_document_turn_s_times_and_work_are_what_the_user_waited_for(rig):
    chat, runner, fmt, store, library = rig
    library.add(A, "book.txt", doc_chunks("book.txt", 30))
    runner.token_delay_s = 0.01  # every step takes time: the pieces are most of the turn
    runner.enqueue(fmt._words("the book in short [1]") + [fmt.END])
    t0 = time.monotonic()
    first_text = None
    for event in chat.send(A, None, "Summarise book.txt"):
        if isinstance(event, Delta) and first_text is None:
            first_text = time.monotonic() - t0
        if isinstance(event, Finished):
            fin = event
    wall = time.monotonic() - t0
    g, doc = fin.stats.gen, fin.stats.document
    assert doc["coverage"] == 1.0 and doc["read"] == doc["pieces"] > 5 and doc["steps"] > doc["pieces"]
    assert abs(g.total_s - wall) <= 0.2 * wall, (g.total_s, wall)
    assert abs(g.ttft_s - first_text) <= 0.2 * first_text, (g.ttft_s, first_text)
    assert g.ttft_s > 0.5 * g.total_s  # the answer's first text comes after every piece is read
    (conv,) = store.list_conversations(A)
    stored = store.get(A, conv.id).turns[0].stats
    assert stored.document == doc and stored.gen.total_s == g.total_s  # kept with the turn, as replay prints it
    from llmweb.web.formatting import stats_markdown

    assert f"read {doc['read']} of {doc['pieces']} sections (100% of the text" in stats_markdown(stored)
