"""A chat reads the documents it chose, with the real model, embedder and indexes: two
documents that disagree, and a chat scoped to one cites only it, through the page's handlers, the
OpenAI API and `replay`; unscoped, the same question cites both. A second visitor cannot name the
first one's document in any of the three."""

from __future__ import annotations

import gradio as gr
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from llmweb.cli.main import replay
from llmweb.records import LOCAL_OWNER
from llmweb.runtime import Runtime
from llmweb.web.api.routes import api_routes
from llmweb.web.identity import login_owner
from llmweb.web.ui import Handlers
from tests.conftest import make_settings
from tests.retrieval.test_scope import NEW, OLD, QUESTION
from tests.web.test_ui import A_TOKEN, B_TOKEN, NOBODY

ALICE, BOB = "alice-key-0123456789", "bob-key-0123456789"
PAGE_A = f"anon:{A_TOKEN}"  # the page's visitor A (no login: the browser's token)
OLD_NAME, NEW_NAME = "hours-2023.txt", "hours-2024.txt"


@pytest.fixture(scope="module")
def rt(tmp_path_factory, app_model):
    data = tmp_path_factory.mktemp("scope")
    settings = make_settings(
        data, context_limit=1024, max_new_tokens=12, recall=False, single_user="0", api_keys=f"alice:{ALICE},bob:{BOB}"
    )
    runtime = Runtime(settings, loaded=app_model).start(background=False)
    runtime.wait_ready()
    for owner in (PAGE_A, login_owner("alice"), LOCAL_OWNER):
        for name, text in ((OLD_NAME, OLD), (NEW_NAME, NEW)):
            path = data / f"{name}.upload"
            path.write_text(text, encoding="utf-8")
            [report] = runtime.library.ingest_uploads(owner, [(path, name)])
            assert report.ok, report.message
    yield runtime
    runtime.close()


def doc_id(rt, owner: str, name: str) -> str:
    return next(d.doc_id for d in rt.library.documents(owner) if d.source == name)


def cited(sources) -> set[str]:
    return {s["source"] if isinstance(s, dict) else s.source for s in sources}


def test_the_page_a_chat_scoped_to_one_document_cites_only_it(rt, tmp_path):
    h = Handlers(rt)
    panel = h.settings.set_documents("", [doc_id(rt, PAGE_A, NEW_NAME)], A_TOKEN, NOBODY)
    conv_id = panel.conv_state
    assert panel.doc_scope["value"] == [doc_id(rt, PAGE_A, NEW_NAME)], "the picker shows the choice"
    *_, final = h.chat.respond(QUESTION, [], conv_id, True, A_TOKEN, NOBODY)
    assert cited(rt.store.get(PAGE_A, conv_id).turns[-1].sources) == {NEW_NAME}
    *_, final = h.chat.respond(QUESTION, [], "", True, A_TOKEN, NOBODY)  # a new chat: every document
    assert cited(rt.store.get(PAGE_A, final[0]).turns[-1].sources) == {OLD_NAME, NEW_NAME}

    # a file attached while the chat reads chosen documents joins them; the chat is stored with them
    path = tmp_path / "hours-2025.txt"
    path.write_text(NEW.replace("2024", "2025").replace("11 am", "9 am"), encoding="utf-8")
    h.docs.upload([str(path)], conv_id, A_TOKEN, NOBODY, progress=lambda *a, **k: None)
    names = [name for _, name in rt.store.get(PAGE_A, conv_id).settings.documents]
    assert names == [NEW_NAME, "hours-2025.txt"]
    exported = rt.store.export_json(PAGE_A, conv_id)
    assert NEW_NAME in exported and "hours-2025.txt" in exported

    # visitor B: A's document, by id, is refused as one that does not exist; B's chat is unchanged
    with pytest.raises(gr.Error, match="There is no document"):
        h.settings.set_documents("", [doc_id(rt, PAGE_A, NEW_NAME)], B_TOKEN, NOBODY)


def test_the_api_a_request_reads_the_documents_it_names(rt):
    client = TestClient(FastAPI(routes=api_routes(rt)), base_url="http://127.0.0.1:7860", client=("127.0.0.1", 50000))

    def ask(key: str, names, **kw):
        body = {"model": "llmweb", "messages": [{"role": "user", "content": QUESTION}], "use_docs": True}
        body["x_llmweb"] = {"documents": names}
        return client.post("/v1/chat/completions", json=body | kw, headers={"Authorization": f"Bearer {key}"})

    r = ask(ALICE, [OLD_NAME])
    assert r.status_code == 200, r.text
    assert cited(r.json()["x_llmweb"]["sources"]) == {OLD_NAME}
    r = ask(ALICE, [doc_id(rt, login_owner("alice"), NEW_NAME)], conversation_id="new")  # by id, stateful
    assert r.status_code == 200, r.text
    assert cited(r.json()["x_llmweb"]["sources"]) == {NEW_NAME}
    r = ask(ALICE, [])  # none at all
    assert r.status_code == 200 and r.json()["x_llmweb"]["sources"] == []

    refused = ask(BOB, [OLD_NAME])
    missing = ask(BOB, ["nothing-by-this-name.txt"])
    assert refused.status_code == missing.status_code == 400
    assert refused.json()["error"]["message"].replace(OLD_NAME, "X") == missing.json()["error"]["message"].replace(
        "nothing-by-this-name.txt", "X"
    )


def test_replay_a_script_line_chooses_the_documents_from_there_on(rt):
    script = [{"user": QUESTION, "documents": [OLD_NAME]}, QUESTION, {"user": QUESTION, "documents": []}]
    rows = list(replay(rt, script))
    assert [cited(r["sources"]) for r in rows] == [{OLD_NAME}, {OLD_NAME}, set()], rows
    [refused] = list(replay(rt, [{"user": QUESTION, "documents": ["somebody-elses.txt"]}]))
    assert "There is no document" in refused["error"]
