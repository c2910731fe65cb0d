"""The API's whole-document option: `x_llmweb: {"whole_document": true}` parsed and
checked field by field (web/api/chat_wire.py); the figures come back in the response's `x_llmweb.document`
(the real-model test is tests/chat/test_document_model.py)."""

from __future__ import annotations

import json

import pytest

from llmweb.web.api.chat_wire import parse_request
from llmweb.web.api.errors import ApiError


def body(**kw) -> dict:
    return {"model": "llmweb", "messages": [{"role": "user", "content": "Summarise guide.md"}], **kw}


def test_whole_document_is_off_unless_asked():
    assert parse_request(body(), ["llmweb"], 1000).whole_document is False
    assert parse_request(body(x_llmweb={}), ["llmweb"], 1000).whole_document is False
    assert parse_request(body(x_llmweb={"whole_document": True}), ["llmweb"], 1000).whole_document is True


@pytest.mark.parametrize(
    "ours, param",
    [
        ({"whole_document": "yes"}, "x_llmweb.whole_document"),
        ({"whole_doc": True}, "x_llmweb"),
        ({"<img src=x>": True}, "x_llmweb"),
        ("whole_document", "x_llmweb"),
    ],
)
def test_a_bad_x_llmweb_is_a_400_naming_the_field(ours, param):
    with pytest.raises(ApiError) as e:
        parse_request(body(x_llmweb=ours), ["llmweb"], 1000)
    assert e.value.status == 400 and e.value.param == param


# ---- through the routes, over the real engine with a scripted runner (tests/web/api/conftest.py's rig)


@pytest.fixture
def served(tmp_path):
    from llmweb.records import LOCAL_OWNER
    from tests.chat.test_document_task import FakeLibrary, doc_chunks
    from tests.web.api.conftest import rig

    library = FakeLibrary()
    library.add(LOCAL_OWNER, "book.txt", doc_chunks("book.txt", 12))
    r = rig(tmp_path, library=library)
    r.runner.background = lambda request: r.fmt._words("a note") + [r.fmt.END]
    yield r
    r.engine.close()
    r.store.close()


def ask(text: str, **kw) -> dict:
    return body(messages=[{"role": "user", "content": text}], x_llmweb={"whole_document": True}, **kw)


def test_a_stateless_whole_document_request_reads_every_piece_and_says_so(served):
    served.runner.enqueue(served.fmt._words("the book in short [1]") + [served.fmt.END])
    r = served.client.post("/v1/chat/completions", json=ask("Who is in book.txt?"))
    assert r.status_code == 200, r.text
    d = r.json()
    doc = d["x_llmweb"]["document"]
    assert doc["task"] == "ask" and doc["read"] == doc["pieces"] >= 2 and doc["coverage"] == 1.0
    assert d["choices"][0]["message"]["content"] == "the book in short [1]"
    assert d["x_llmweb"]["sources"][0]["source"] == "book.txt"
    assert served.store.list_conversations("local") == []  # stateless: nothing stored but the pieces


def test_a_streamed_stateful_whole_document_request_sends_progress_and_stores_the_turn(served):
    with served.client.stream(
        "POST", "/v1/chat/completions", json=ask("Summarise book.txt", stream=True, conversation_id="new")
    ) as r:
        lines = list(r.iter_lines())
    assert any(line.startswith(": 0 of ") and "Reading section 1 of" in line for line in lines), lines
    last = [json.loads(line[6:]) for line in lines if line.startswith("data: {")][-1]
    assert last["x_llmweb"]["document"]["from_cache"] == 0
    (conv,) = served.store.list_conversations("local")
    assert served.store.get("local", conv.id).turns[0].user == "Summarise book.txt"


def test_without_a_document_to_read_a_stateless_request_is_a_400(served):
    served.chat.library.docs.clear()  # the caller has no document (one unnamed would be their latest upload)
    r = served.client.post("/v1/chat/completions", json=ask("Summarise something"))
    assert r.status_code == 400 and r.json()["error"]["param"] == "x_llmweb"


def test_loop_guard_is_the_chats_unless_the_request_says():
    assert parse_request(body(), ["llmweb"], 1000).loop_guard is None
    assert parse_request(body(x_llmweb={"loop_guard": False}), ["llmweb"], 1000).loop_guard is False
    with pytest.raises(ApiError) as e:
        parse_request(body(x_llmweb={"loop_guard": 0}), ["llmweb"], 1000)
    assert e.value.status == 400 and e.value.param == "x_llmweb.loop_guard"


def test_a_request_without_the_loop_guard_reaches_the_engine_without_it(served):
    for guard in (False, None):
        served.runner.enqueue(served.fmt._words("an answer") + [served.fmt.END])
        ours = {} if guard is None else {"loop_guard": guard}
        r = served.client.post("/v1/chat/completions", json=body(x_llmweb=ours))
        assert r.status_code == 200, r.text
    assert [r.loop_guard for r in served.runner.requests if not r.background] == [False, True]
