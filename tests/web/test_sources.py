"""The source panel (web/panels/sources.py) and what it shows (web/formatting.py): a click on a
Sources message opens that turn's source in the panel beside the chat, over a real store and a real
library (tests/chat/test_passages.py's word embedder); the page's script says which source line was
clicked. A visitor opens only what they may read: another visitor's chat opens nothing, and an
import of it, with its sources' exact places, shows "not available", never the other's text."""

from __future__ import annotations

import json
from types import SimpleNamespace

import gradio as gr
import pytest

from llmweb.chat.passages import Excerpt, Passage
from llmweb.records import Chunk, Source
from llmweb.retrieval.library import Library
from llmweb.runtime.resident import Lease
from llmweb.store.db import Store
from llmweb.web import formatting as f
from llmweb.web.panels.sources import NOTHING
from llmweb.web.ui import OPEN_SOURCE, SOURCE_CLICKS, Handlers, build_app, launch_kwargs
from tests.chat.test_passages import LETTER, WordEmbedder
from tests.conftest import make_settings
from tests.web.test_ui import A_TOKEN, B_TOKEN, NOBODY, FakeChat

A, B = f"anon:{A_TOKEN}", f"anon:{B_TOKEN}"


def click(index: int) -> gr.SelectData:
    return gr.SelectData(None, {"index": index, "value": "whatever the page says"})


@pytest.fixture
def runtime(tmp_path):
    store = Store(tmp_path / "llmweb.sqlite3")
    settings = make_settings(tmp_path, single_user="0", chunk_tokens=30, chunk_overlap=4)
    rt = SimpleNamespace(
        store=store,
        settings=settings,
        status="Ready",
        engine=None,
        library=Library(settings, WordEmbedder()),
        secret="s" * 64,
    )
    rt.chat = FakeChat(store, settings)
    rt.wait_ready = lambda timeout=None: rt.chat
    rt.hold = lambda model=None, timeout=None: Lease("fake", rt.chat)
    yield rt
    store.close()


def a_chat_citing_the_letter(rt, tmp_path) -> tuple[str, list[Chunk]]:
    """A's upload, and A's chat of two turns: the first without sources, the second citing chunks 1 and 3."""
    path = tmp_path / "upload"
    path.write_text(LETTER)
    [report] = rt.library.ingest_uploads(A, [(path, "rover.md")])
    chunks = rt.library.chunks(A, report.doc_id)
    conv = rt.store.create_conversation(A)
    rt.store.add_turn(A, conv, "Hello", "Hi.")
    sources = [Source.from_chunk(chunks[1], 1), Source.from_chunk(chunks[3], 2)]
    rt.store.add_turn(A, conv, "How heavy?", "Heavy [1][2].", None, sources)
    return conv, chunks


def test_a_click_on_a_sources_message_opens_the_clicked_source_beside_the_chat(runtime, tmp_path):
    conv, chunks = a_chat_citing_the_letter(runtime, tmp_path)
    h = Handlers(runtime)
    messages = f.history_messages(runtime.store.get(A, conv))
    assert [m.get("metadata", {}).get("title") for m in messages][-1] == "Sources (2)"
    assert messages[-1]["content"].startswith(f.SOURCES_HINT)

    box, pick, shown = h.sources.open_clicked(conv, 2, A_TOKEN, messages, NOBODY, click(len(messages) - 1))
    assert box["visible"] is True
    assert pick["value"] == "1:2" and [v for _, v in pick["choices"]] == ["1:1", "1:2"]
    assert pick["choices"][0][0] == "[1] rover.md, Rover log"
    assert f.escape(chunks[3].text) in shown and 'class="llmweb-cited"' in shown
    assert "llmweb-before" in shown and "llmweb-after" in shown
    _, pick, first = h.sources.open_clicked(conv, 0, A_TOKEN, messages, NOBODY, click(len(messages) - 1))
    assert pick["value"] == "1:1" and f.escape(chunks[1].text) in first, "no line known: the first source"
    _, _, picked = h.sources.pick(conv, "1:2", A_TOKEN, NOBODY)
    assert picked == shown
    for index in range(len(messages) - 1):  # a question or an answer: nothing opens
        assert h.sources.open_clicked(conv, 1, A_TOKEN, messages, NOBODY, click(index)) == NOTHING
    assert h.sources.pick(conv, "junk", A_TOKEN, NOBODY) == NOTHING
    assert h.sources.close()[0]["visible"] is False


def test_visitor_b_gets_nothing_of_as_chat_and_an_import_of_it_shows_not_available(runtime, tmp_path):
    conv, chunks = a_chat_citing_the_letter(runtime, tmp_path)
    h = Handlers(runtime)
    messages = f.history_messages(runtime.store.get(A, conv))
    index = len(messages) - 1
    assert h.sources.open_clicked(conv, 1, B_TOKEN, messages, NOBODY, click(index)) == NOTHING, "A's chat id, B's click"
    assert h.sources.pick(conv, "1:1", B_TOKEN, NOBODY) == NOTHING

    export = json.loads(runtime.store.export_json(A, conv))
    places = [(s["doc_id"], s["start"], s["end"]) for s in export["turns"][1]["sources"]]
    assert places == [(c.doc_id, c.start, c.end) for c in (chunks[1], chunks[3])], "the export keeps the places"
    theirs = runtime.store.import_json(B, json.dumps(export))
    for n in (1, 2):
        box, _, shown = h.sources.open_clicked(theirs, n, B_TOKEN, messages, NOBODY, click(index))
        assert box["visible"] is True and "not available" in shown
        assert "rock samples" not in shown, "none of A's text"
    _, _, mine = h.sources.open_clicked(theirs, 1, A_TOKEN, messages, NOBODY, click(index))
    assert mine == NOTHING[2], "B's imported chat is not A's either"


def test_a_new_view_of_the_chat_closes_the_panel_and_a_finished_turn_leaves_it(runtime):
    h = Handlers(runtime)
    *streaming, final = h.chat.respond("Capital?", [], "", True, A_TOKEN, NOBODY)
    assert all(out[-2] == gr.skip() for out in streaming), "nothing per streamed token"
    assert final[-2] == gr.skip(), "a turn's end keeps an open source open"
    assert h.chats.switch(final[0], A_TOKEN, NOBODY).source_box == gr.update(visible=False)


def test_the_page_reports_the_clicked_source_line_to_the_select_event(runtime):
    assert launch_kwargs(runtime.settings)["js"] == SOURCE_CLICKS
    config = build_app(runtime).config
    chat = next(c["id"] for c in config["components"] if c["props"].get("elem_id") == "llmweb-chat")
    [select] = [d for d in config["dependencies"] if (chat, "select") in d["targets"] and d["js"]]
    assert select["js"] == OPEN_SOURCE and select["api_visibility"] == "private"
    assert select["inputs"][-1] == chat, "the chat as shown: which turns it leaves out"
    ids = {c["props"].get("elem_id") for c in config["components"]}
    assert {"llmweb-source-panel", "llmweb-source-pick", "llmweb-source", "llmweb-source-close"} <= ids


# ---- what the panel shows


def conversation(*sources_per_turn):
    turns = [
        SimpleNamespace(idx=i, user="q", assistant="a", stats=None, sources=list(s))
        for i, s in enumerate(sources_per_turn)
    ]
    return SimpleNamespace(turns=turns)


def test_sources_turn_finds_the_turn_of_each_sources_message_as_history_messages_lays_them_out():
    one, two = [Source(1, "a.md")], [Source(1, "a.md"), Source(2, "b.md")]
    conv = conversation(one, [], two, [])
    messages = f.history_messages(conv)
    found = {i: f.sources_turn(conv, i) for i in range(len(messages) + 2)}
    assert {i: t for i, t in found.items() if t is not None} == {2: 0, 7: 2}
    assert all(messages[i]["metadata"]["title"].startswith("Sources") for i in (2, 7))
    later = f.history_messages(conv, 1)  # the page shows turns 1 on, after the note on turn 0
    found = {i: f.sources_turn(conv, i, 1) for i in range(len(later) + 2)}
    assert {i: t for i, t in found.items() if t is not None} == {5: 2}
    assert later[5]["metadata"]["title"].startswith("Sources")


def test_the_passage_is_marked_between_its_subdued_neighbours_with_its_page_and_heading():
    source = Source(2, "report.pdf", 3, "Results", doc_id="d" * 32, start=10, end=20)
    passage = Passage(
        source,
        Excerpt("the cited text", 3, "Results"),
        Excerpt("text before", 2, "Method", cut=True),
        Excerpt("text after", 3, "Results"),
    )
    shown = f.passage_html(passage, source)
    assert "<strong>[2] report.pdf</strong> · p. 3 · Results" in shown
    order = [shown.index(k) for k in ("llmweb-before", "llmweb-cited", "llmweb-after")]
    assert order == sorted(order)
    assert '<small class="llmweb-where">p. 2 · Method</small><div class="llmweb-text">text before' in shown
    assert shown.count("llmweb-where") == 1, "a neighbour on the passage's own page says nothing more"
    found_by_words = f.passage_html(Passage(source, Excerpt("x"), by_words=True), source)
    assert "Found by its name and first words" in found_by_words
    assert "not available" in f.passage_html(None, source)
    assert "not in this chat any more" in f.passage_html(None, Source(1, "turn 2", kind="recall"))


def test_a_hostile_passage_is_text_in_the_panel():
    evil = '<img src=x onerror=alert(1)>"&'
    source = Source(1, evil, 1, evil, doc_id="d")
    shown = f.passage_html(Passage(source, Excerpt(evil, 1, evil), Excerpt(evil, 2, evil)), source)
    assert "<img" not in shown and "&lt;img src=x onerror=alert(1)&gt;&quot;&amp;" in shown
    assert f.source_choices(0, [source]) == [(f"[1] {evil}, p. 1", "0:1")], "choices are text, kept as written"
