"""POST /v1/completions over the routes (web/api/completions.py), the real Engine under a scripted
FakeRunner: a raw prompt (no chat template), the legacy shape whole and streamed, stop strings,
logprobs as an int, echo, the context's limit, and the refusals, each naming its field."""

from __future__ import annotations

import pytest

from llmweb.records import LOCAL_OWNER
from tests.web.api.conftest import BUDGET, events, say


def comp(**kw):
    return {"model": "llmweb", "prompt": "Once upon a time", **kw}


def test_a_raw_prompt_goes_to_the_engine_as_it_is_and_comes_back_in_the_legacy_shape(api):
    say(api, "there was a dragon")
    r = api.client.post("/v1/completions", json=comp(max_tokens=10))
    assert r.status_code == 200, r.text
    d = r.json()
    assert d["object"] == "text_completion" and d["id"].startswith("cmpl-")
    choice = d["choices"][0]
    assert choice["text"] == "there was a dragon" and choice["finish_reason"] == "stop" and choice["logprobs"] is None
    sent = api.runner.requests[-1]
    assert list(sent.prompt_ids) == api.fmt._words("Once upon a time"), "no chat template around it"
    assert sent.max_new_tokens == 10 and sent.logprobs is None and sent.loop_guard is False
    assert d["usage"] == {"prompt_tokens": 4, "completion_tokens": 4, "total_tokens": 8}
    assert api.store.list_conversations(LOCAL_OWNER) == [], "stateless: nothing stored"


def test_a_stream_of_text_completions_ends_with_usage_and_done(api):
    say(api, "one two three")
    req = comp(stream=True, stream_options={"include_usage": True}, logprobs=1)
    with api.client.stream("POST", "/v1/completions", json=req) as r:
        assert r.status_code == 200
        ev = events(r)
    assert ev[-1] == "[DONE]" and ev[-2]["choices"] == [] and ev[-2]["usage"]["completion_tokens"] == 3
    chunks = [c for c in ev[:-2]]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == "one two three"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    tokens = [t for c in chunks if c["choices"][0]["logprobs"] for t in c["choices"][0]["logprobs"]["tokens"]]
    assert tokens == ["one", "two", "three"]


def test_legacy_logprobs_stop_strings_length_and_echo(api):
    say(api, "alpha beta")
    d = api.client.post("/v1/completions", json=comp(logprobs=2)).json()
    lp = d["choices"][0]["logprobs"]
    assert lp["tokens"] == ["alpha", "beta"] and lp["token_logprobs"] == [-0.5, -0.5]
    assert lp["text_offset"][0] == 0 and len(lp["top_logprobs"][0]) == 2
    assert api.runner.requests[-1].logprobs == 2

    say(api, "alpha beta STOP gamma")
    d = api.client.post("/v1/completions", json=comp(stop="STOP")).json()
    assert d["choices"][0]["text"].strip() == "alpha beta" and d["choices"][0]["finish_reason"] == "stop"

    say(api, "a b c d e")
    d = api.client.post("/v1/completions", json=comp(max_tokens=2)).json()
    assert d["choices"][0]["text"] == "a b" and d["choices"][0]["finish_reason"] == "length"

    say(api, "again")
    d = api.client.post("/v1/completions", json=comp(prompt=["Say"], echo=True)).json()
    assert d["choices"][0]["text"] == "Sayagain"


def test_a_prompt_past_the_context_is_a_400_naming_it_never_a_cut(api):
    long = " ".join(f"w{i}" for i in range(BUDGET.context_limit + 5))
    r = api.client.post("/v1/completions", json=comp(prompt=long))
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    near = " ".join(f"w{i}" for i in range(BUDGET.context_limit - 5))
    r = api.client.post("/v1/completions", json=comp(prompt=near, max_tokens=10))
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
    assert api.runner.requests == [], "nothing reached the engine"


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"prompt": [1, 2, 3]}, "prompt"),
        ({"prompt": 5}, "prompt"),
        ({"prompt": None}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"logprobs": True}, "logprobs"),
        ({"logprobs": 21}, "logprobs"),
        ({"echo": True, "logprobs": 1}, "echo"),
        ({"n": 2}, "n"),
        ({"best_of": 3}, "best_of"),
        ({"suffix": "end"}, "suffix"),
        ({"temperature": "hot"}, "temperature"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"stop": 3}, "stop"),
        ({"banana": 1}, "banana"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
    ],
)
def test_bad_completions_are_a_400_naming_the_field(api, extra, param):
    r = api.client.post("/v1/completions", json=comp(**extra))
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_completions_need_the_key_as_chat_does(api):
    r = api.client.post("/v1/completions", json=comp(), headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401
