"""Ollama's API (web/api/ollama.py): the translation into the chat-completions body (pure), and the
routes over the real Engine under a scripted FakeRunner: NDJSON lines and whole replies, raw
generate, the key, and the refusals, each naming its field."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from llmweb.web.api import ollama_wire as wire
from llmweb.web.api.errors import ApiError
from tests.web.api.conftest import LOCAL_PEER, body, say


def lines(r) -> list[dict]:
    return [json.loads(x) for x in r.text.splitlines() if x.strip()]


# ---- the translation (pure)


def test_a_chat_body_becomes_the_openai_body_the_chat_path_parses():
    body = {
        "model": "llmweb:latest",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"function": {"name": "weather", "arguments": {"city": "Paris"}}}],
            },
            {"role": "tool", "content": "18 C", "tool_name": "weather"},
            {"role": "user", "content": "And so?"},
        ],
        "format": {"type": "object", "properties": {"a": {"type": "integer"}}},
        "options": {
            "temperature": 0.2,
            "top_p": 0.5,
            "num_predict": 7,
            "stop": ["\n\n"],
            "seed": 3,
            "top_k": 40,
            "num_ctx": 99999,
        },
        "tools": [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}],
        "keep_alive": "5m",
    }
    out = wire.chat_body(body)
    assert out["model"] == "llmweb" and out["stream"] is True and out["stream_options"] == {"include_usage": True}
    assert (out["temperature"], out["top_p"], out["max_tokens"], out["stop"], out["seed"]) == (0.2, 0.5, 7, ["\n\n"], 3)
    assert "top_k" not in out and "num_ctx" not in out, "ignored and clamped options do not reach the chat path"
    assert out["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "response", "schema": body["format"], "strict": True},
    }
    assert out["tools"] == body["tools"]
    call = out["messages"][2]["tool_calls"][0]
    assert call["function"] == {"name": "weather", "arguments": '{"city": "Paris"}'} and call["type"] == "function"
    assert out["messages"][2]["content"] is None
    assert out["messages"][3] == {"role": "tool", "content": "18 C", "tool_call_id": call["id"]}
    assert wire.chat_body({**body, "format": "json", "stream": False})["response_format"] == {"type": "json_object"}
    assert "stream_options" not in wire.chat_body({**body, "stream": False})


def test_tool_calls_in_a_reply_become_ollamas_with_arguments_as_objects():
    calls = [{"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]
    assert wire.message("", calls) == {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"function": {"name": "weather", "arguments": {"city": "Paris"}}}],
    }


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"options": {"temprature": 1}}, "options.temprature"),
        ({"options": {"temperature": "hot"}}, "options.temperature"),
        ({"options": {"num_predict": 1.5}}, "options.num_predict"),
        ({"options": {"num_ctx": "big"}}, "options.num_ctx"),
        ({"options": {"stop": 5}}, "options.stop"),
        ({"options": []}, "options"),
        ({"format": "xml"}, "format"),
        ({"stream": "yes"}, "stream"),
        ({"keep_alive": [1]}, "keep_alive"),
        ({"think": True}, "think"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user", "content": "hi", "images": ["abc"]}]}, "messages[0].images"),
        ({"messages": [{"role": "tool", "content": "18 C"}]}, "messages[0].role"),
        ({"colour": "red"}, "colour"),
        ({"model": 5}, "model"),
    ],
)
def test_bad_ollama_fields_are_refused_by_name(change, param):
    body = {"model": "llmweb", "messages": [{"role": "user", "content": "hi"}], **change}
    with pytest.raises(ApiError) as e:
        wire.chat_body(body)
    assert e.value.status == 400 and e.value.param == param


# ---- the routes


def test_version_tags_show_and_ps(api):
    assert api.client.get("/api/version").json()["version"] == wire.VERSION
    names = [m["name"] for m in api.client.get("/api/tags").json()["models"]]
    assert "llmweb" in names and "all-MiniLM-L6-v2" in names
    shown = api.client.post("/api/show", json={"model": "llmweb"}).json()
    assert "completion" in shown["capabilities"]
    info = shown["model_info"]
    assert info[f"{info['general.architecture']}.context_length"] == 200
    assert api.client.post("/api/show", json={"model": "all-MiniLM-L6-v2"}).json()["capabilities"] == ["embedding"]
    assert api.client.post("/api/show", json={"model": "nope"}).status_code == 404
    assert "models" in api.client.get("/api/ps").json()


def test_a_streamed_chat_is_ndjson_lines_then_a_final_line_with_the_counts(api):
    say(api, "Paris is the capital")
    r = api.client.post("/api/chat", json={"model": "llmweb", "messages": [{"role": "user", "content": "Capital?"}]})
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson"), r.text
    got = lines(r)
    assert all(x["done"] is False for x in got[:-1]) and got[-1]["done"] is True
    assert "".join(x["message"]["content"] for x in got).strip() == "Paris is the capital"
    assert got[-1]["done_reason"] == "stop" and got[-1]["eval_count"] == 4 and got[-1]["prompt_eval_count"] > 0


def test_a_whole_chat_and_generate_through_the_template_and_raw(api):
    say(api, "Paris")
    body = {"model": "llmweb", "messages": [{"role": "user", "content": "Capital?"}], "stream": False}
    d = api.client.post("/api/chat", json={**body, "options": {"num_predict": 5, "temperature": 0.5}}).json()
    assert d["message"] == {"role": "assistant", "content": "Paris"} and d["done"] is True
    sent = api.runner.requests[-1]
    assert sent.max_new_tokens == 5 and sent.temperature == 0.5

    say(api, "Paris")
    d = api.client.post(
        "/api/generate", json={"model": "llmweb", "prompt": "Capital?", "system": "Brief.", "stream": False}
    ).json()
    assert d["response"] == "Paris" and d["done"] is True
    assert api.fmt._words("Brief.")[0] in api.runner.requests[-1].prompt_ids, (
        "through the chat template with the system"
    )

    say(api, "there was")
    r = api.client.post("/api/generate", json={"model": "llmweb", "prompt": "Once upon a time", "raw": True})
    got = lines(r)
    assert "".join(x["response"] for x in got) == "there was" and got[-1]["done"] is True
    assert list(api.runner.requests[-1].prompt_ids) == api.fmt._words("Once upon a time"), "raw: as written"

    d = api.client.post("/api/generate", json={"model": "llmweb"}).json()
    assert d["done_reason"] == "load" and d["response"] == ""


def test_ollama_errors_are_its_error_object_with_the_v1_status(api):
    r = api.client.post(
        "/api/chat", json={"model": "llmweb", "messages": [{"role": "user", "content": "hi"}], "options": {"bogus": 1}}
    )
    assert r.status_code == 400 and "options.bogus" in r.json()["error"]
    r = api.client.post(
        "/api/chat",
        json={
            "model": "llmweb",
            "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"type": "function"}],
        },
    )
    assert r.status_code == 400 and "tools" in r.json()["error"], r.json()
    r = api.client.post("/api/generate", json={"model": "llmweb", "prompt": "hi", "context": [1, 2]})
    assert r.status_code == 400 and "stateless" in r.json()["error"]
    r = api.client.get("/api/tags", headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401 and "error" in r.json()


def test_a_prompt_past_the_context_is_a_400_never_a_hang(api):
    long = " ".join(f"w{i}" for i in range(300))
    r = api.client.post("/api/generate", json={"model": "llmweb", "prompt": long, "raw": True})
    assert r.status_code == 400 and "context" in r.json()["error"]
    r = api.client.post("/api/chat", json={"model": "llmweb", "messages": [{"role": "user", "content": long}]})
    assert r.status_code == 400 and r.json()["error"]
    assert api.runner.requests == [], "nothing reached the engine"


# ---- a client that leaves before a reply without streaming


def leave_midway(api, path: str, payload: dict) -> list[dict]:
    """POST `payload` to `path` straight into the ASGI app, and disconnect once the engine runs it;
    what the app sent back. Fails if the app is still busy 4 s later (the reply takes 10 s)."""
    raw = json.dumps(payload).encode()
    headers = [(b"host", b"127.0.0.1:7860"), (b"content-type", b"application/json")]
    headers += [(b"content-length", str(len(raw)).encode())]
    headers += [(b"authorization", f"Bearer {api.key}".encode())] if api.key else []
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": headers,
        "client": LOCAL_PEER,
        "server": ("127.0.0.1", 7860),
    }
    given, sent = False, []

    async def receive():
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": raw, "more_body": False}
        while not api.runner.running.is_set():  # the engine runs the request: leave
            await asyncio.sleep(0.01)
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    async def run():
        await asyncio.wait_for(api.client.app(scope, receive, send), 4)

    asyncio.run(run())
    return sent


@pytest.mark.parametrize(
    ("path", "payload"),
    [
        ("/api/chat", {"messages": [{"role": "user", "content": "hi"}]}),
        ("/api/generate", {"prompt": "hi"}),
        ("/api/generate", {"prompt": "hi", "raw": True}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/completions", {"prompt": "hi"}),
    ],
    ids=["ollama-chat", "ollama-generate", "ollama-raw", "v1-chat", "v1-completions"],
)
def test_a_client_that_leaves_a_reply_without_streaming_frees_the_engine(api, path, payload):
    say(api, " ".join(f"w{i}" for i in range(20)))
    api.runner.token_delay_s = 0.5  # the whole reply: 10 s
    leave_midway(api, path, {"model": "llmweb", "stream": False, **payload})
    deadline = time.monotonic() + 2
    while api.runner.running.is_set() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not api.runner.running.is_set(), "the engine request was cancelled"
    api.runner.token_delay_s = 0
    say(api, "Next.")
    r = api.client.post("/v1/chat/completions", json=body())
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "Next."
