"""logprobs and top_logprobs on POST /v1/chat/completions, over the real Engine under a scripted
FakeRunner (its made-up figures: each token -0.5, the k most likely `id + j` at -0.5 - j): OpenAI's
shape whole and streamed, nothing when not asked, and the refusals, each naming its field."""

from __future__ import annotations

import pytest

from tests.web.api.conftest import body, events, say


def test_logprobs_come_in_openais_shape_and_only_when_asked(api):
    say(api, "Paris is the capital")
    d = api.client.post("/v1/chat/completions", json=body(logprobs=True, top_logprobs=2)).json()
    content = d["choices"][0]["logprobs"]["content"]
    assert [t["token"] for t in content] == ["Paris", "is", "the", "capital"]
    first = content[0]
    assert first["logprob"] == -0.5 and first["bytes"] == list(b"Paris")
    assert [t["logprob"] for t in first["top_logprobs"]] == [-0.5, -1.5]
    assert first["top_logprobs"][0] == {"token": "Paris", "logprob": -0.5, "bytes": list(b"Paris")}
    assert api.runner.requests[-1].logprobs == 2

    say(api, "Paris")
    d = api.client.post("/v1/chat/completions", json=body(logprobs=True)).json()
    assert d["choices"][0]["logprobs"]["content"][0]["top_logprobs"] == []
    assert api.runner.requests[-1].logprobs == 0

    say(api, "Paris")
    d = api.client.post("/v1/chat/completions", json=body()).json()
    assert d["choices"][0]["logprobs"] is None and api.runner.requests[-1].logprobs is None, "not asked: not computed"


def test_streamed_logprobs_ride_with_the_chunks_that_carry_their_text(api):
    say(api, "one two three")
    with api.client.stream("POST", "/v1/chat/completions", json=body(stream=True, logprobs=True, top_logprobs=1)) as r:
        chunks = [c for c in events(r)[:-1] if c["choices"]]
    tokens = [t["token"] for c in chunks if c["choices"][0]["logprobs"] for t in c["choices"][0]["logprobs"]["content"]]
    assert tokens == ["one", "two", "three"]
    for c in chunks:
        if c["choices"][0]["delta"].get("content"):
            assert c["choices"][0]["logprobs"]["content"], "a chunk with text has its tokens' logprobs"


def test_a_stop_string_cuts_the_logprobs_with_the_text(api):
    say(api, "alpha STOP gamma delta")
    d = api.client.post("/v1/chat/completions", json=body(stop=["STOP"], logprobs=True)).json()
    assert d["choices"][0]["message"]["content"] == "alpha"
    assert [t["token"] for t in d["choices"][0]["logprobs"]["content"]][:1] == ["alpha"]
    assert "delta" not in [t["token"] for t in d["choices"][0]["logprobs"]["content"]]


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"logprobs": "yes"}, "logprobs"),
        ({"logprobs": True, "top_logprobs": 2.5}, "top_logprobs"),
    ],
)
def test_bad_logprobs_are_a_400_naming_the_field(api, extra, param):
    r = api.client.post("/v1/chat/completions", json=body(**extra))
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_an_engine_without_logprobs_refuses_them_by_name(api):
    api.runner.logprobs = False  # as the remote runner says (engine/remote.py): its ids are tokenised again
    r = api.client.post("/v1/chat/completions", json=body(logprobs=True))
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs", r.text
    assert "remote" in r.json()["error"]["message"]


def test_a_stateful_turn_has_its_logprobs_too(api):
    say(api, "Hello there")
    d = api.client.post("/v1/chat/completions", json=body(conversation_id="new", logprobs=True)).json()
    assert [t["token"] for t in d["choices"][0]["logprobs"]["content"]] == ["Hello", "there"]
