"""llama-server's own tests of tools, `response_format`, log-probabilities and sampling
(llama.cpp's tools/server/tests/unit/test_chat_completion.py, test_tool_call.py, and the parts of
test_completion.py they lean on), as cases against llmweb's API: what they require is answered,
and what they refuse gets a 400 naming the field. docs/api.md ("Compatibility with llama-server's
tests") lists each of their cases and where it went.

Their model is a 15M stories model and bigger ones; ours is the embedded SmolLM2-135M, too weak to
say "Istanbul" or `print("Hello world")` on request. Where their case checks words only a bigger
model writes, ours checks the contract instead: the shape, that arguments validate against the
tool's schema, that a constraint held. The refusals run on the scripted runner (fast); the rest
share one server over the real model, with replies of a few tokens.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import jsonschema
import openai
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from llmweb.runtime import Runtime
from llmweb.web.api.routes import api_routes
from tests.conftest import make_settings
from tests.web.api.conftest import LOCAL_PEER, LOCAL_URL, body, events

KEY = "alice-key-0123456789"
WAIT_S = 300

# their tools (test_tool_call.py), as their cases send them
TEST_TOOL = {
    "type": "function",
    "function": {
        "name": "test",
        "description": "",
        "parameters": {
            "type": "object",
            "properties": {"success": {"type": "boolean", "const": True}},
            "required": ["success"],
        },
    },
}
PYTHON_TOOL = {
    "type": "function",
    "function": {
        "name": "python",
        "description": "Runs code in an ipython interpreter and returns the result of the execution after 60 seconds.",
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "The code to run in the ipython interpreter."}},
            "required": ["code"],
        },
    },
}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_current_weather",
        "description": "Get the current weather in a given location",
        "parameters": {
            "type": "object",
            "properties": {
                "location": {
                    "type": "string",
                    "description": "The city and country/state, e.g. 'San Francisco, CA', or 'Paris, France'",
                },
            },
            "required": ["location"],
        },
    },
}
CALCULATE_TOOL = {
    "type": "function",
    "function": {
        "name": "calculate",
        "description": "A calculator function that computes values of arithmetic expressions in the Python syntax",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "An arithmetic expression"}},
            "required": ["expression"],
        },
    },
}
CODING = [
    {"role": "system", "content": "You are a coding assistant."},
    {"role": "user", "content": "Write an example"},
]
BOOK = [{"role": "system", "content": "Book"}, {"role": "user", "content": "What is the best book"}]


# ---- what they refuse, and what llmweb refuses where they answer: a 400 naming the field


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        (None, "messages"),
        ("string", "messages"),
        ([123], "messages[0]"),
        ([{}], "messages[0].role"),
        ([{"role": 123}], "messages[0].role"),
        ([{"role": "system", "content": 123}], "messages[0].content"),
        ([{"role": "system", "content": "test"}, {}], "messages[1].role"),
        (
            [
                {"role": "user", "content": "test"},
                {"role": "assistant", "content": "test"},
                {"role": "assistant", "content": "test"},
            ],
            "messages[2].role",
        ),
        ([{"content": "hello"}], "messages[0].role"),  # theirs is a TODO: "should not be a valid case"
        ([{"role": "tool", "tool_call_id": "call_1", "content": "x"}], "messages[0].tool_call_id"),
    ],
)
def test_an_invalid_chat_body_is_a_400_naming_the_message(api, messages, param):
    """test_invalid_chat_completion_req (they accept a 400 or a 500; here always a 400 with its field)."""
    b = body()
    if messages is None:
        del b["messages"]
    else:
        b["messages"] = messages
    r = api.client.post("/v1/chat/completions", json=b)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert param.split(".")[0] in r.json()["error"]["message"], "the message names the message"


SCHEMA = "response_format.json_schema.schema"


def _schema(schema) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "example", "schema": schema}}


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        # test_completion_with_response_format: the formats they refuse
        ({"response_format": {"type": "sound"}}, "response_format"),
        ({"response_format": _schema(123)}, SCHEMA),
        ({"response_format": _schema({"type": 123})}, SCHEMA),
        ({"response_format": _schema({"type": "hiccup"})}, SCHEMA),
        # their `json_object` with a `schema` is llama-server's own: OpenAI's json_object has none, and
        # a schema ignored would be an unconstrained reply
        ({"response_format": {"type": "json_object", "schema": {"const": "42"}}}, "response_format.schema"),
        ({"response_format": {"type": "json_object", "schema": 123}}, "response_format.schema"),
        # OpenAI and vLLM require json_schema.name; they do not
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"const": "foooooo"}}}}, None),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": "yes", "schema": {}}}},
            "response_format.json_schema.strict",
        ),
        # test_completion_with_json_schema, test_completion_with_grammar: llama-server's own fields
        ({"json_schema": {"const": "42"}}, "json_schema"),
        ({"grammar": 'root ::= "a"{5,5}'}, "grammar"),
        ({"grammar": "root ::= this is (not valid GBNF"}, "grammar"),
        # test_chat_completions_multiple_choices, test_logit_bias, test_chat_completion_with_timings_per_token,
        # test_return_progress, test_verbose_debug, test_chat_template_continue_final_message_*
        ({"n": 2}, "n"),
        ({"logit_bias": {"1": -100}}, "logit_bias"),
        ({"timings_per_token": True}, "timings_per_token"),
        ({"return_progress": True}, "return_progress"),
        ({"verbose": True}, "verbose"),
        ({"add_generation_prompt": True, "continue_final_message": True}, None),
        ({"reasoning_format": "deepseek"}, "reasoning_format"),
        # log-probabilities out of range (OpenAI's 0..20)
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
        # tools that cannot be served
        ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": [WEATHER_TOOL], "tool_choice": "always"}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER_TOOL], "parallel_tool_calls": "no"}, "parallel_tool_calls"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "hiccup"}}}]},
            "tools[0].function.parameters",
        ),
        ({"tools": [WEATHER_TOOL], "response_format": {"type": "json_object"}}, "response_format"),
    ],
)
def test_what_llmweb_does_not_serve_is_a_400_naming_the_field(api, extra, param):
    r = api.client.post("/v1/chat/completions", json=body(**extra))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["message"] and err["param"] == (param or err["param"]) and err["param"], err
    assert not api.runner.requests, "nothing reached the engine"


def test_a_completion_prompt_past_the_context_is_a_400_whole_and_streamed(api):
    """test_context_size_exceeded(_stream), on /v1/completions: a chat's history is fitted into the
    context (summarised, left out) instead, so there a long history is answered, never refused."""
    for stream in (False, True):
        r = api.client.post("/v1/completions", json={"model": "llmweb", "prompt": "Book " * 400, "stream": stream})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] == "context_length_exceeded" and r.json()["error"]["param"] == "prompt"


# ---- what they require, on the real model


@pytest.fixture(scope="module")
def served(tmp_path_factory, app_model):
    """The API's routes over the real model (no UI), the caller holding alice's key."""
    settings = make_settings(
        tmp_path_factory.mktemp("llamacpp"),
        context_limit=1024,
        max_new_tokens=64,
        summary_tokens=64,
        user_tokens=384,
        retrieved_tokens=64,
        facts_tokens=32,
        single_user="0",
        api_keys=f"alice:{KEY}",
    )
    runtime = Runtime(settings, loaded=app_model).start(background=True)
    runtime.wait_ready(WAIT_S)
    http = TestClient(
        FastAPI(routes=api_routes(runtime)),
        base_url=LOCAL_URL,
        client=LOCAL_PEER,
        headers={"Authorization": f"Bearer {KEY}"},
    )
    sdk = openai.OpenAI(base_url=LOCAL_URL + "/v1", api_key=KEY, max_retries=0, http_client=http)
    yield SimpleNamespace(runtime=runtime, http=http, sdk=sdk)
    http.close()
    runtime.close()


def chat(s, stream: bool = False, **kw) -> dict:
    """One chat completion; streamed, its chunks put together into the shape of a whole one (as
    llama.cpp's `make_any_request` does), the chunks kept in `_chunks`."""
    b = {"model": "llmweb", "messages": BOOK, **kw}
    if not stream:
        r = s.http.post("/v1/chat/completions", json=b)
        assert r.status_code == 200, r.text
        return r.json()
    with s.http.stream("POST", "/v1/chat/completions", json={**b, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        chunks = [c for c in events(r) if c != "[DONE]"]
    content, calls, reason = "", {}, None
    for c in chunks:
        for choice in c["choices"]:
            d = choice["delta"]
            content += d.get("content") or ""
            for part in d.get("tool_calls") or []:
                call = calls.setdefault(part["index"], {"function": {"name": "", "arguments": ""}})
                for key in ("id", "type"):
                    if key in part:
                        call[key] = part[key]
                call["function"]["name"] += part.get("function", {}).get("name") or ""
                call["function"]["arguments"] += part.get("function", {}).get("arguments") or ""
            reason = choice["finish_reason"] or reason
    message = {"role": "assistant", "content": content or None}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return {"choices": [{"message": message, "finish_reason": reason}], "_chunks": chunks}


def the_calls(d: dict, tools: list[dict]) -> list[dict]:
    """The reply's tool calls, each checked: OpenAI's shape, a tool sent, arguments that validate."""
    choice = d["choices"][0]
    m = choice["message"]
    calls = m.get("tool_calls") or []
    assert calls and choice["finish_reason"] == "tool_calls" and m["content"] is None, m
    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    for call in calls:
        assert call["id"].startswith("call_") and call["type"] == "function"
        assert isinstance(call["function"]["arguments"], str), "arguments are JSON text"
        jsonschema.validate(json.loads(call["function"]["arguments"]), by_name[call["function"]["name"]])
    assert len({c["id"] for c in calls}) == len(calls)
    return calls


# their python tool, closed to properties it does not list and with `code` bounded: left open, the
# 135M model writes made-up properties after `code`, or prose inside it, until max_tokens cuts the call
_PY = PYTHON_TOOL["function"]["parameters"]
CLOSED_PYTHON_TOOL = {
    "type": "function",
    "function": {
        **PYTHON_TOOL["function"],
        "parameters": {
            **_PY,
            "properties": {**_PY["properties"], "code": {**_PY["properties"]["code"], "maxLength": 60}},
            "additionalProperties": False,
        },
    },
}


@pytest.mark.parametrize(
    ("tool", "key", "stream"),
    [(TEST_TOOL, "success", False), (TEST_TOOL, "success", True), (CLOSED_PYTHON_TOOL, "code", False)],
    ids=["test-whole", "test-streamed", "python-whole"],
)
def test_a_required_tool_is_called_once_with_arguments_that_validate(served, tool, key, stream):
    """test_completion_with_required_tool_real_model (and its tiny-model variants, commented out
    there since llama-server lets content come before a required call): one call, no content."""
    kw = dict(tools=[tool], tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=48)
    d = chat(served, stream, messages=CODING, **kw)
    (call,) = the_calls(d, [tool])
    assert call["function"]["name"] == tool["function"]["name"] and key in json.loads(call["function"]["arguments"])
    if tool is TEST_TOOL:
        assert json.loads(call["function"]["arguments"]) == {"success": True}, "const holds"


@pytest.mark.parametrize(
    ("tools", "choice", "stream"), [([], None, False), ([PYTHON_TOOL], "none", True)], ids=["no-tools", "choice-none"]
)
def test_without_tools_or_under_none_no_tool_is_called(served, tools, choice, stream):
    """test_completion_without_tool_call_fast/slow: no tools, or tool_choice "none"."""
    d = chat(served, stream, messages=CODING, tools=tools or None, tool_choice=choice, max_tokens=6)
    m = d["choices"][0]["message"]
    assert "tool_calls" not in m and m["content"] and d["choices"][0]["finish_reason"] in ("stop", "length")


@pytest.mark.parametrize(
    ("question", "stream"),
    [("What is the weather in Istanbul?", False), ("say hello world with python", True)],
    ids=["weather", "hello-world"],
)
def test_weather_and_hello_world_under_auto_are_a_valid_call_or_an_answer(served, question, stream):
    """test_weather, test_hello_world (and the auto case of test_completion_without_tool_call): they
    want "Istanbul" and `print("Hello world")`, which a 135M model does not reliably write. The
    contract: under auto the reply is content, or calls whose arguments validate."""
    tools = [WEATHER_TOOL, CLOSED_PYTHON_TOOL]
    messages = [{"role": "system", "content": "You are a tool-calling agent."}, {"role": "user", "content": question}]
    d = chat(served, stream, messages=messages, tools=tools, max_tokens=32)
    m = d["choices"][0]["message"]
    if m.get("tool_calls"):
        the_calls(d, tools)
    else:
        assert isinstance(m["content"], str) and d["choices"][0]["finish_reason"] in ("stop", "length")


def test_a_named_tool_streamed_adds_up_to_the_same_call_whole(served):
    """test_weather's contract with the call made certain (tool_choice names it), and
    make_any_request's streamed mode: the id, type and name once, then argument fragments by index,
    adding up to the call the same request gets whole (greedy)."""
    named = {"type": "function", "function": {"name": "get_current_weather"}}
    messages = [{"role": "user", "content": "What is the weather in Istanbul?"}]
    kw = dict(messages=messages, tools=[WEATHER_TOOL, PYTHON_TOOL], tool_choice=named, temperature=0, max_tokens=32)
    whole = chat(served, **kw)
    (call,) = the_calls(whole, [WEATHER_TOOL])
    assert isinstance(json.loads(call["function"]["arguments"])["location"], str)
    d = chat(served, True, **kw)
    (streamed,) = the_calls(d, [WEATHER_TOOL])
    parts = [p for c in d["_chunks"] for ch in c["choices"] for p in ch["delta"].get("tool_calls") or []]
    assert sum("id" in p for p in parts) == 1 and parts[0]["function"]["name"] == "get_current_weather"
    assert streamed["function"] == call["function"], "greedy: the same call"


CALC_HISTORY = [
    {
        "role": "system",
        "content": "You are a tools-calling assistant. You express numerical values with at most two decimals.",
    },
    {"role": "user", "content": "What's the y coordinate of a point on the unit sphere at angle 30 degrees?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_6789",
                "type": "function",
                "function": {"name": "calculate", "arguments": '{"expression":"sin(30 * pi / 180)"}'},
            }
        ],
    },
    {"role": "tool", "name": "calculate", "content": "0.55644242476", "tool_call_id": "call_6789"},
]


def test_a_tool_result_in_the_history_is_answered(served):
    """test_calc_result: they want "0.56" in the answer (a bigger model's arithmetic); here the
    history with its call and result is taken, and under auto the reply is an answer or a valid
    call, under "none" (streamed) an answer."""
    d = chat(served, messages=CALC_HISTORY, tools=[CALCULATE_TOOL], max_tokens=16)
    m = d["choices"][0]["message"]
    if m.get("tool_calls"):
        the_calls(d, [CALCULATE_TOOL])
    else:
        assert isinstance(m["content"], str)
    d = chat(served, True, messages=CALC_HISTORY, tools=[CALCULATE_TOOL], tool_choice="none", max_tokens=6)
    assert d["choices"][0]["message"]["content"] and "tool_calls" not in d["choices"][0]["message"]


@pytest.mark.parametrize(
    ("schema", "check"),
    [
        ({"const": "42"}, lambda v: v == "42"),
        ({"const": "foooooo"}, lambda v: v == "foooooo"),
        # bounded: unbounded, the 135M model writes integers until max_tokens cuts the array
        ({"type": "array", "items": {"type": "integer"}, "maxItems": 3}, lambda v: isinstance(v, list)),
        (
            {"type": "array", "prefixItems": [{"type": "integer"}], "minItems": 1, "maxItems": 1},
            lambda v: isinstance(v, list) and len(v) == 1 and isinstance(v[0], int),
        ),
    ],
    ids=["const-42", "const-foooooo", "items", "prefix-items"],
)
def test_a_json_schema_reply_matches_its_schema(served, schema, check):
    """test_completion_with_response_format's schemas (their `json_object` + `schema` sent as
    json_schema, with a name; their draft-4 `items: [...]` as `prefixItems`)."""
    d = chat(served, messages=CODING, response_format=_schema(schema), temperature=0, max_tokens=16)
    content = d["choices"][0]["message"]["content"]
    value = json.loads(content)
    assert check(value), content
    jsonschema.validate(value, schema)


def test_json_object_is_an_object_and_a_cut_one_says_length(served):
    """test_completion_with_response_format's json_object, and max_tokens cutting it: "length"."""
    d = chat(served, messages=CODING, response_format={"type": "json_object"}, temperature=0, max_tokens=48)
    assert isinstance(json.loads(d["choices"][0]["message"]["content"]), dict)
    cut = chat(served, messages=CODING, response_format={"type": "json_object"}, max_tokens=3)
    assert cut["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize(
    "user",
    ["What is the best book", [{"type": "text", "text": "What is"}, {"type": "text", "text": "the best book"}]],
    ids=["text", "parts"],
)
def test_a_chat_completion_in_openais_shape_cut_at_max_tokens(served, user):
    """test_chat_completion: id, role, usage; with max_tokens 8, finish_reason "length" means 8
    tokens. (Their exact text and prompt counts are their model's; `system_fingerprint` is theirs.)"""
    d = chat(served, messages=[{"role": "system", "content": "Book"}, {"role": "user", "content": user}], max_tokens=8)
    assert d["id"].startswith("chatcmpl-") and d["object"] == "chat.completion"
    choice, usage = d["choices"][0], d["usage"]
    assert choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str)
    assert choice["finish_reason"] in ("stop", "length") and 1 <= usage["completion_tokens"] <= 8
    if choice["finish_reason"] == "length":
        assert usage["completion_tokens"] == 8
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"] and usage["prompt_tokens"] > 5


def test_the_same_prompt_again_is_served_from_the_cache(served):
    """test_chat_completion_cached_tokens: the second time, most of the prompt is cached."""
    messages = [{"role": "system", "content": "Test"}, {"role": "user", "content": "1 2 3 4 5 6"}]
    first = chat(served, messages=messages, max_tokens=4)
    again = chat(served, messages=messages, max_tokens=4)
    assert again["usage"]["prompt_tokens"] == first["usage"]["prompt_tokens"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_a_stream_has_one_id_the_role_first_and_the_usage_last(served):
    """test_chat_completion_stream (their first delta's content is None; ours is "", as OpenAI's)."""
    d = chat(served, True, max_tokens=8, stream_options={"include_usage": True})
    chunks = d["_chunks"]
    assert len({c["id"] for c in chunks}) == 1
    with_choices = [c for c in chunks if c["choices"]]
    assert with_choices[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all("role" not in c["choices"][0]["delta"] for c in with_choices[1:])
    finish = [c for c in with_choices if c["choices"][0]["finish_reason"]]
    assert len(finish) == 1 and "content" not in finish[0]["choices"][0]["delta"]
    assert chunks[-1]["choices"] == [] and 1 <= chunks[-1]["usage"]["completion_tokens"] <= 8


def test_the_openai_library_with_a_seed_and_a_temperature(served):
    """test_chat_completion_with_openai_library."""
    r = served.sdk.chat.completions.create(model="llmweb", messages=BOOK, max_tokens=8, seed=42, temperature=0.8)
    assert r.choices[0].message.content is not None and r.choices[0].finish_reason in ("stop", "length")


def _tokens_are_the_text(logprobs, text: str) -> None:
    assert "".join(t.token for t in logprobs) == text
    for t in logprobs:
        assert t.logprob <= 0.0 and t.bytes == list(t.token.encode()) and t.top_logprobs
        tops = [x.logprob for x in t.top_logprobs]
        assert tops == sorted(tops, reverse=True) and all(v <= 0.0 for v in tops)


def test_logprobs_whole_and_streamed(served):
    """test_logprobs, test_logprobs_stream: each token's log-probability <= 0, its bytes, its top
    list; the tokens put together are the text. Greedy: the token is the top of its list."""
    kw = dict(model="llmweb", messages=BOOK, max_tokens=5, temperature=0.0, logprobs=True, top_logprobs=10)
    r = served.sdk.chat.completions.create(**kw)
    content = r.choices[0].logprobs.content
    _tokens_are_the_text(content, r.choices[0].message.content)
    assert all(t.token == t.top_logprobs[0].token and len(t.top_logprobs) == 10 for t in content)

    text, tokens = "", []
    for i, chunk in enumerate(served.sdk.chat.completions.create(**kw, stream=True)):
        choice = chunk.choices[0]
        assert (choice.delta.role == "assistant") == (i == 0)
        text += choice.delta.content or ""
        if choice.delta.content:
            assert choice.logprobs is not None and choice.logprobs.content
        tokens += choice.logprobs.content if choice.logprobs and choice.logprobs.content else []
    _tokens_are_the_text(tokens, text)
    assert text == r.choices[0].message.content, "greedy: streamed as whole"


def test_completions_n_probs_whole_and_streamed(served):
    """test_n_probs, test_n_probs_stream on /v1/completions' `logprobs` (their n_probs)."""
    b = {"model": "llmweb", "prompt": "I believe the meaning of life is", "max_tokens": 5, "temperature": 0.0}
    d = served.http.post("/v1/completions", json={**b, "logprobs": 5}).json()
    lp = d["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == d["usage"]["completion_tokens"]
    assert all(v <= 0.0 for v in lp["token_logprobs"]) and all(len(top) == 5 for top in lp["top_logprobs"])
    assert all(v <= 0.0 for top in lp["top_logprobs"] for v in top.values())
    with served.http.stream("POST", "/v1/completions", json={**b, "logprobs": 5, "stream": True}) as r:
        chunks = [c for c in events(r) if c != "[DONE]"]
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    streamed = [
        t for c in chunks if c["choices"] and c["choices"][0]["logprobs"] for t in c["choices"][0]["logprobs"]["tokens"]
    ]
    assert text == d["choices"][0]["text"] and "".join(streamed) == text


def test_a_completion_streamed_is_the_completion_whole(served):
    """test_completion_stream_vs_non_stream, test_completion_(stream_)with_openai_library."""
    kw = dict(model="llmweb", prompt="I believe the meaning of life is", max_tokens=8, temperature=0.0)
    whole = served.sdk.completions.create(**kw)
    streamed = list(served.sdk.completions.create(**kw, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == whole.choices[0].text
    assert (
        whole.choices[0].finish_reason in ("stop", "length")
        and streamed[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    )


def test_stop_strings_end_the_text_before_them(served):
    """test_completion_stream_with_openai_library_stops: whatever the model writes, a stop string
    never shows, whole or streamed, and the reply ends there with "stop"."""
    kw = dict(model="llmweb", prompt="1, 2, 3, 4, 5, 6,", max_tokens=8, temperature=0.0)
    free = served.sdk.completions.create(**kw).choices[0].text
    stop = free.strip()[:2] if free.strip() else " "
    cut = served.sdk.completions.create(**kw, stop=[stop])
    assert stop not in cut.choices[0].text and free.startswith(cut.choices[0].text)
    assert cut.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in served.sdk.completions.create(**kw, stop=[stop], stream=True))
    assert streamed == cut.choices[0].text


def test_the_same_seed_gives_the_same_text_and_other_seeds_others(served):
    """test_consistent_result_same_seed (here at temperature 1, where the seed matters) and
    test_different_result_different_seed (at least two of three seeds differ: 8 tokens of a small
    model can agree by chance, their case asks every pair of four)."""
    b = {"model": "llmweb", "prompt": "I believe the meaning of life is", "max_tokens": 8, "temperature": 1.0}
    same = {served.http.post("/v1/completions", json={**b, "seed": 42}).json()["choices"][0]["text"] for _ in range(2)}
    assert len(same) == 1
    seeds = {served.http.post("/v1/completions", json={**b, "seed": s}).json()["choices"][0]["text"] for s in range(3)}
    assert len(seeds) > 1
