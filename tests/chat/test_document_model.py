"""Whole-document tasks with the real model: a document several contexts long is read
whole, piece by piece, within the context; a second run reads the pieces from the cache; a cancel
keeps what was read; another visitor's turn runs while a task reads, and sees nothing of it.
Short on purpose: a 1,024-token context and 24 tokens written per piece."""

from __future__ import annotations

import re
import threading
import time

import pytest

from llmweb.bench.document import long_text
from llmweb.chat.turn import Delta, Finished, Progress, finish
from llmweb.runtime import Runtime
from tests.conftest import make_settings

A, B = "anon:reader-a", "anon:visitor-b"
NAME = "long-guide.md"


@pytest.fixture
def rig(tmp_path, app_model):
    rt = Runtime(make_settings(tmp_path, context_limit=1024, max_new_tokens=40, recall=False), loaded=app_model).start(
        background=False
    )
    chat = rt.wait_ready()
    chat.documents.note_tokens = 24
    path = tmp_path / NAME
    path.write_text(long_text(2), encoding="utf-8")
    (report,) = rt.library.ingest_uploads(A, [(path, NAME)])
    assert report.ok
    yield rt, chat
    rt.close()


def spy_requests(chat) -> list:
    """Every engine request the chat submits from now on, in order."""
    seen: list = []
    submit = chat.engine.submit

    def spy(request):
        seen.append(request)
        return submit(request)

    chat.engine.submit = spy
    return seen


def test_a_document_longer_than_the_context_is_read_whole_then_from_the_cache(rig):
    rt, chat = rig
    engine_requests = spy_requests(chat)
    events = list(chat.send(A, None, f"Summarise {NAME}", seed=0))
    fin = events[-1]
    assert isinstance(fin, Finished) and fin.document is not None
    first = fin.document
    doc_tokens = chat.fmt.count(long_text(2))
    assert doc_tokens > 3 * 1024, "the document is several contexts long"
    assert first.pieces > 3 and first.read == first.pieces and first.coverage == 1.0 and first.from_cache == 0
    assert first.tokens_read >= 0.9 * doc_tokens
    assert all(len(r.prompt_ids) + r.max_new_tokens <= 1024 for r in engine_requests)
    assert sum(r.background for r in engine_requests) == first.steps - 1 and not engine_requests[-1].background
    assert fin.reply.strip() and len(fin.sources) == first.pieces and fin.sources[0].source == NAME
    # the reply cites sections from the start, the middle and the end (its walk through the document)
    cited = {int(n) for n in re.findall(r"\[(\d+)\]", fin.reply)}
    assert {1, first.pieces} <= cited and any(1 < n < first.pieces for n in cited), fin.reply
    assert cited <= set(range(1, first.pieces + 1)), "no citation of a section that does not exist"
    assert [e.text for e in events if isinstance(e, Progress)][0] == f"Reading section 1 of {first.pieces}…"
    second = finish(chat.send(A, None, f"Summarise {NAME}", seed=0)).document
    assert second.from_cache == second.pieces == first.pieces
    assert 0 < first.first_partial_s < first.seconds and second.first_partial_s < first.first_partial_s
    assert first.to_dict()["first_partial_s"] == round(first.first_partial_s, 3)
    assert second.seconds < first.seconds / 2
    print(f"\ncold: {first.describe()}\ncached: {second.describe()}")


def test_a_cancel_keeps_the_pieces_read(rig):
    rt, chat = rig
    stream = chat.send(A, None, f"Outline {NAME}", seed=0)
    for event in stream:
        if isinstance(event, Progress) and event.text.startswith("Reading section 3 "):
            break
    stream.close()
    again = finish(chat.send(A, None, f"Outline {NAME}", seed=0)).document
    assert again.from_cache == 2 and again.read == again.pieces


def test_another_visitors_turn_runs_while_a_task_reads_and_sees_nothing_of_it(rig):
    rt, chat = rig
    box: dict = {}

    def task():
        box["fin"] = finish(chat.send(A, None, f"Summarise {NAME}", seed=0))
        box["a_done"] = time.monotonic()

    served = chat.engine.counters.served
    thread = threading.Thread(target=task)
    thread.start()
    deadline = time.monotonic() + 120
    while chat.engine.counters.served == served and time.monotonic() < deadline:
        time.sleep(0.05)
    t0 = time.monotonic()
    theirs = chat.ask(B, None, "What colour is the sky on a clear day?", use_docs=False, seed=0)
    b_done = time.monotonic()
    thread.join(300)
    assert theirs.reply and theirs.document is None
    assert b_done < box["a_done"], "B's turn did not wait for A's whole task"
    print(f"\nB's turn took {b_done - t0:.1f} s while A's task ran {box['fin'].document.seconds:.1f} s")
    # B names A's document: it is not theirs, so there is no task and retrieval finds nothing of A's
    assert chat.documents.detect(B, f"Summarise {NAME}") is None
    key = chat.documents.detect(A, f"Summarise {NAME}").key
    doc_id = chat.documents.detect(A, f"Summarise {NAME}").docs[0].doc_id
    assert rt.store.piece_results(B, doc_id, key, chat.documents.model_key) == {}
    assert rt.store.piece_results(A, doc_id, key, chat.documents.model_key)
    assert rt.library.chunks(B, doc_id) == []


LETTER = "letter.md"
PAGES = (  # three short pages, each a heading and a paragraph the chunker keeps apart
    "# Page one\n\nDear Anna, thank you for the books you sent in March. The children read them every evening "
    "by the window, and the youngest now knows the story of the red boat by heart. ",
    "# Page two\n\nThe garden is doing well this year. We planted tomatoes, beans and two apple trees near the "
    "old wall, and the neighbours helped us build a small fence against the rabbits. ",
    "# Page three\n\nWe hope to visit you in the summer, when the trains run more often. Please write soon and "
    "tell us how your new work at the library is going. With love, Maria. ",
)


def test_a_translation_streams_each_page_in_the_sources_order(tmp_path, app_model):
    """Translate on the real model: one step per piece, in the document's order, the reply is
    the pieces' translations joined in that order, streamed piece by piece (each delta extends
    the last), and nothing is summarised (no fold step)."""
    rt = Runtime(make_settings(tmp_path, context_limit=512, max_new_tokens=40, recall=False), loaded=app_model).start(
        background=False
    )
    try:
        chat = rt.wait_ready()
        path = tmp_path / LETTER
        path.write_text("\n\n".join(p * 2 for p in PAGES), encoding="utf-8")
        (report,) = rt.library.ingest_uploads(A, [(path, LETTER)])
        assert report.ok
        requests = spy_requests(chat)
        events = list(chat.send(A, None, f"Translate {LETTER} into French", seed=0))
        fin = events[-1]
        assert isinstance(fin, Finished) and fin.document is not None and fin.document.task == "translate"
        doc = fin.document
        assert doc.pieces >= 3 and doc.read == doc.pieces and doc.coverage == 1.0 and doc.fold_depth == 0
        assert len(requests) == doc.pieces == doc.steps, "one step per piece, no fold, no final summary"
        prompts = [chat.fmt.decode(r.prompt_ids) for r in requests]
        assert all("French" in p for p in prompts)
        order = [
            next(i for i, page in enumerate(PAGES) if page.split("\n\n")[1][:40] in p)
            for p in prompts
            if any(page.split("\n\n")[1][:40] in p for page in PAGES)
        ]
        assert order == sorted(order) and set(order) == {0, 1, 2}, "the pages are read in the source's order"
        deltas = [e.text for e in events if isinstance(e, Delta)]
        assert len(deltas) == doc.pieces and all(deltas[i + 1].startswith(deltas[i]) for i in range(len(deltas) - 1))
        assert fin.reply == deltas[-1] and fin.reply.strip()
        pieces = fin.reply.split("\n\n")
        assert len(pieces) >= doc.pieces and all(p.strip() for p in pieces)
        assert [s.n for s in fin.sources] == list(range(1, doc.pieces + 1))
        print(f"\n{doc.describe()}\n{fin.reply[:600]}")
    finally:
        rt.close()


def test_follow_ups_read_the_answer_from_the_chat_and_reuse_its_cache(rig):
    """After a whole-document answer, "shorter please" is an ordinary turn: it reads no piece and
    has the answer (the digest) in its prompt, at the same place in every later turn, so the next
    turn's KV prefix covers it instead of sending it again."""
    rt, chat = rig
    task = finish(chat.send(A, None, f"Summarise {NAME}", seed=0))
    answer = task.reply.split("\n\nBy section:")[0]
    shorter = chat.ask(A, task.conv_id, "Shorter please.", seed=0)
    assert shorter.document is None and shorter.conv_id == task.conv_id
    assert answer[:200] in shorter.prompt_text(), "the follow-up's prompt holds the whole-document answer"
    again = chat.ask(A, task.conv_id, "Thanks. And one more line on the install?", seed=0)
    assert again.document is None and answer[:200] in again.prompt_text()
    gen = again.stats.gen
    assert gen.reused_tokens >= gen.prompt_tokens * 0.7, f"reused {gen.reused_tokens} of {gen.prompt_tokens}"
