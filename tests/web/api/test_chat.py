"""POST /v1/chat/completions over the routes (web/api/chat.py), the real Engine under a scripted
FakeRunner: OpenAI's fields, streaming, stop strings, the budget, stateful conversations, bodies
refused, a full queue, batching with the UI, citations, and a client that leaves."""

from __future__ import annotations

import json
import threading
import time

import pytest

from llmweb.engine.request import GenerationRequest
from llmweb.records import LOCAL_OWNER
from llmweb.web.identity import OPEN_STATELESS_OWNER
from tests.web.api.conftest import BUDGET, FakeLibrary, body, events, rig, say


def test_a_stateless_reply_has_openai_fields_usage_sections_and_headers(api):
    say(api, "Paris is the capital")
    r = api.client.post("/v1/chat/completions", json=body(messages=[{"role": "user", "content": "Capital of France?"}]))
    assert r.status_code == 200, r.text
    d = r.json()
    assert d["object"] == "chat.completion" and d["id"].startswith("chatcmpl-")
    assert d["choices"][0]["message"] == {"role": "assistant", "content": "Paris is the capital", "refusal": None}
    assert d["choices"][0]["finish_reason"] == "stop"
    u = d["usage"]
    assert u["completion_tokens"] == 4 and u["total_tokens"] == u["prompt_tokens"] + 4
    assert u["prompt_tokens_details"]["cached_tokens"] == 0
    x = d["x_llmweb"]
    assert x["mode"] == "stateless" and x["conversation_id"] is None
    assert sum(v for k, v in x["sections"].items() if k != "reserve") == u["prompt_tokens"]
    assert x["summarized_messages"] == 0 and x["left_out_messages"] == 0
    assert r.headers["x-llmweb-mode"] == "stateless" and r.headers["x-llmweb-summarized-messages"] == "0"
    assert api.store.list_conversations(LOCAL_OWNER) == [], "stateless calls store nothing"


def test_a_stateless_stream_is_openai_chunks_with_usage_last_and_done(api):
    say(api, "one two three")
    req = body(stream=True, stream_options={"include_usage": True})
    with api.client.stream("POST", "/v1/chat/completions", json=req) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        ev = events(r)
    assert ev[-1] == "[DONE]"
    chunks = ev[:-1]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text.strip() == "one two three"
    finish = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finish) == 1 and finish[0]["choices"][0]["finish_reason"] == "stop" and "x_llmweb" in finish[0]
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3


def test_a_stop_string_ends_the_reply_before_it(api):
    say(api, "alpha beta STOP gamma delta epsilon")
    d = api.client.post("/v1/chat/completions", json=body(stop=["STOP"])).json()
    assert d["choices"][0]["message"]["content"] == "alpha beta"
    assert d["choices"][0]["finish_reason"] == "stop" and d["x_llmweb"]["stop"] is True
    say(api, "alpha beta STOP gamma delta epsilon")
    with api.client.stream("POST", "/v1/chat/completions", json=body(stop="STOP", stream=True)) as r:
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in events(r)[:-1] if c["choices"])
    assert text.strip() == "alpha beta"


def test_max_tokens_is_capped_by_the_budget_and_cuts_the_reply(api):
    say(api, "a b c d e f g h")
    d = api.client.post("/v1/chat/completions", json=body(max_tokens=3)).json()
    assert d["choices"][0]["message"]["content"] == "a b c" and d["choices"][0]["finish_reason"] == "length"
    assert d["usage"]["completion_tokens"] == 3
    d = api.client.post("/v1/chat/completions", json=body(max_tokens=10_000)).json()
    assert d["x_llmweb"]["max_tokens"] == BUDGET.max_new_tokens and "capped" in " ".join(d["x_llmweb"]["notes"])
    assert api.runner.requests[-1].max_new_tokens == BUDGET.max_new_tokens


def test_sampling_parameters_reach_the_engine(api):
    api.client.post("/v1/chat/completions", json=body(temperature=0.7, top_p=0.5, seed=11))
    sent = api.runner.requests[-1]
    assert (sent.temperature, sent.top_p, sent.seed) == (0.7, 0.5, 11)


def test_a_stateful_conversation_continues_and_is_listed_for_its_owner(api):
    say(api, "Hello Ada")
    first = api.client.post("/v1/chat/completions", json=body(conversation_id="new"))
    conv = first.headers["x-llmweb-conversation-id"]
    assert first.json()["x_llmweb"]["conversation_id"] == conv and first.json()["x_llmweb"]["mode"] == "stateful"
    say(api, "Still here")
    second = api.client.post(
        "/v1/chat/completions",
        json=body(messages=[{"role": "user", "content": "again"}]),
        headers={"X-Llmweb-Conversation-Id": conv},
    )
    assert second.status_code == 200 and second.json()["choices"][0]["message"]["content"] == "Still here"
    assert [c.id for c in api.store.list_conversations(LOCAL_OWNER)] == [conv]
    assert [t.assistant for t in api.store.get(LOCAL_OWNER, conv).turns] == ["Hello Ada", "Still here"]
    gone = api.client.post("/v1/chat/completions", json=body(conversation_id="no-such-id"))
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "conversation_not_found"


@pytest.mark.parametrize(
    "raw, status",
    [
        (b"{not json", 400),
        (b"[1, 2]", 400),
        (b"\xff\xfe", 400),
        (json.dumps(body(messages=[{"role": "user", "content": "x" * 3000}])).encode(), 413),
    ],
)
def test_malformed_and_oversized_bodies_get_a_4xx_error_object(tmp_path, raw, status):
    r = rig(tmp_path, api_max_body_kb=2)
    try:
        resp = r.client.post("/v1/chat/completions", content=raw, headers={"Content-Type": "application/json"})
        assert resp.status_code == status and resp.json()["error"]["message"]
    finally:
        r.engine.close()


def test_a_full_queue_is_a_429_with_retry_after(tmp_path):
    r = rig(tmp_path, queue_size=1, queue_per_user=1, single_user="0")  # shared: the per-owner cap holds
    r.runner.token_delay_s = 0.05
    long = GenerationRequest(prompt_ids=[1, 2, 3], max_new_tokens=20, owner=OPEN_STATELESS_OWNER)
    r.runner.enqueue(list(range(100, 120)))
    running = r.engine.submit(long)
    assert r.runner.running.wait(5)
    waiting = r.engine.submit(long)
    try:
        resp = r.client.post("/v1/chat/completions", json=body())
        assert resp.status_code == 429 and resp.headers["retry-after"].isdigit()
        assert resp.json()["error"]["type"] == "rate_limit_error"
    finally:
        running.cancel()
        waiting.cancel()
        r.engine.close()


def test_the_single_users_parallel_requests_queue_and_a_shared_servers_cap_holds(tmp_path):
    """Four requests at once with the install's own key: on a single-user install all four are
    answered (one runs, three wait); on a shared server the fourth gets a 429 with Retry-After."""
    for single_user, owner in (("auto", LOCAL_OWNER), ("0", OPEN_STATELESS_OWNER)):
        r = rig(tmp_path / single_user, single_user=single_user)  # queue_per_user 2, max_batch 1
        r.runner.token_delay_s = 0.02
        r.runner.enqueue(list(range(100, 110)))
        first = r.engine.submit(GenerationRequest(prompt_ids=[1, 2, 3], max_new_tokens=10, owner=owner))
        assert r.runner.running.wait(5)
        waiting = [r.engine.submit(GenerationRequest(prompt_ids=[1, 2], max_new_tokens=10, owner=owner))]
        waiting.append(r.engine.submit(GenerationRequest(prompt_ids=[1, 2], max_new_tokens=10, owner=owner)))
        try:
            say(r, "Paris")
            resp = r.client.post("/v1/chat/completions", json=body())
            if single_user == "auto":
                assert resp.status_code == 200, resp.text
            else:
                assert resp.status_code == 429 and resp.headers["retry-after"].isdigit()
                assert "you already have 2 requests waiting" in resp.json()["error"]["message"]
                streamed = r.client.post("/v1/chat/completions", json=body(stream=True))
                assert streamed.status_code == 429 and streamed.headers["retry-after"].isdigit()
        finally:
            for h in [first, *waiting]:
                h.cancel()
            r.engine.close()


def test_an_api_request_joins_the_batch_of_a_running_ui_request(tmp_path):
    r = rig(tmp_path, max_batch=4)
    r.runner.token_delay_s = 0.02
    r.runner.enqueue(list(range(100, 120)))
    ui = r.engine.submit(GenerationRequest(prompt_ids=[1, 2, 3], max_new_tokens=20, owner="ui-visitor"))
    try:
        assert r.runner.running.wait(5)
        say(r, "Paris is the capital")
        resp = r.client.post("/v1/chat/completions", json=body())
        assert resp.status_code == 200 and resp.json()["choices"][0]["message"]["content"] == "Paris is the capital"
        assert ui.stats is None, "the API reply came while the UI's request was still running"
        assert 2 in r.runner.batch_sizes, "the two shared decode steps"
    finally:
        ui.cancel()
        r.engine.close()


def test_citations_are_in_the_extension_object(tmp_path):
    r = rig(tmp_path, library=FakeLibrary())
    try:
        say(r, "Paris [1]")
        d = r.client.post("/v1/chat/completions", json=body(use_docs=True)).json()
        (source,) = d["x_llmweb"]["sources"]
        assert source["n"] == 1 and source["source"] == "geography.md" and "Paris" in source["snippet"]
        assert source["doc_id"] == "g", "its place, to open it (GET /v1/x_llmweb/passage)"
        assert d["x_llmweb"]["sections"]["retrieved"] > 0
        say(r, "no sources")
        d = r.client.post("/v1/chat/completions", json=body()).json()
        assert d["x_llmweb"]["sources"] == [], "stateless: documents only on request"
        say(r, "sources by default")
        d = r.client.post("/v1/chat/completions", json=body(conversation_id="new")).json()
        assert len(d["x_llmweb"]["sources"]) == 1, "stateful: documents on by default"
    finally:
        r.engine.close()


def test_a_client_that_leaves_a_stream_cancels_its_request(api):
    api.runner.token_delay_s = 0.05
    api.runner.enqueue(list(range(100, 300)))
    handles = []
    submit = api.engine.submit

    def spy(request):
        h = submit(request)
        handles.append(h)
        return h

    api.chat.engine.submit = spy
    done = threading.Event()

    def read_a_little():
        with api.client.stream("POST", "/v1/chat/completions", json=body(stream=True, conversation_id="new")) as r:
            for line in r.iter_lines():
                if '"content":"' in line and '"content":""' not in line:
                    break
        done.set()

    threading.Thread(target=read_a_little, daemon=True).start()
    assert done.wait(10)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not (handles and handles[0].stats):
        time.sleep(0.05)
    assert handles and handles[0].cancelled and handles[0].stats.finish_reason == "cancelled"
    assert handles[0].stats.generated_tokens < 50


def test_a_body_that_is_not_one_bounded_object_is_refused_before_it_is_parsed(api, monkeypatch):
    """A list is refused by its first byte, a body of more values than the bound by a count of its
    separators: neither reaches `json.loads`, which holds the interpreter whatever thread runs it."""
    from llmweb.web.api import common

    parsed = []
    real = json.loads
    monkeypatch.setattr(common.json, "loads", lambda raw, **kw: parsed.append(len(raw)) or real(raw, **kw))
    many = b'{"model": "llmweb", "x": [' + b"1," * 200_001 + b"1]}"
    for raw, status in [(b"[" + b"1," * 100_000 + b"1]", 400), (many, 413)]:
        r = api.client.post("/v1/chat/completions", content=raw, headers={"Content-Type": "application/json"})
        assert r.status_code == status and len(r.text) < 400, r.text[:400]
    assert parsed == []
