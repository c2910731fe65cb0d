"""Tools and response_format through the routes and the real engine with a scripted runner: the
constraint reaches the engine request (stateless and stateful), and a reply in the tool format
comes back in OpenAI's shape, whole and streamed."""

from __future__ import annotations

import json

from tests.web.api.conftest import body, events, say

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CALL = '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo in Norway"}}]}'


def test_a_tool_call_comes_back_in_openais_shape_and_the_engine_was_constrained(api):
    say(api, CALL)
    r = api.client.post("/v1/chat/completions", json=body(tools=[WEATHER], tool_choice="required"))
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {
        "city": "Oslo in Norway"
    }
    request = api.runner.requests[-1]
    assert request.constraint is not None and request.constraint.kind == "tools"
    assert "get_weather" in api.fmt.decode(request.prompt_ids), "the tools are described in the prompt"


def test_a_streamed_tool_call_sends_its_head_once_then_argument_fragments_then_the_finish(api):
    api.runner.token_delay_s = 0.02  # each token its own delta
    say(api, CALL)
    with api.client.stream("POST", "/v1/chat/completions", json=body(tools=[WEATHER], stream=True)) as r:
        chunks = [c for c in events(r) if c != "[DONE]"]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    head, *parts = calls
    assert head["id"].startswith("call_") and head["function"] == {"name": "get_weather", "arguments": ""}
    assert all("id" not in p and p["index"] == 0 for p in parts) and len(parts) > 1
    assert json.loads("".join(p["function"]["arguments"] for p in parts)) == {"city": "Oslo in Norway"}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert not any(d.get("content") for d in deltas), "no content next to the calls"


def test_a_streamed_call_cut_by_max_tokens_has_sent_its_arguments_as_they_were_decoded(api):
    api.runner.token_delay_s = 0.02
    say(api, '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "a b c d e f g h i j k l m"}}]}')
    ask = body(tools=[WEATHER], tool_choice="required", stream=True, max_tokens=9)
    with api.client.stream("POST", "/v1/chat/completions", json=ask) as r:
        chunks = [c for c in events(r) if c != "[DONE]"]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    head, *parts = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert head["function"]["name"] == "get_weather" and len(parts) >= 3, "each token's fragment as it came"
    assert "".join(p["function"]["arguments"] for p in parts).startswith('{"city": "a b')
    assert chunks[-1]["choices"][0]["finish_reason"] == "length", "the call was cut: no tool_calls finish"


def test_under_auto_a_plain_answer_is_content(api):
    say(api, '{"response": "Hello there."}')
    r = api.client.post("/v1/chat/completions", json=body(tools=[WEATHER]))
    choice = r.json()["choices"][0]
    assert choice["message"]["content"] == "Hello there." and choice["finish_reason"] == "stop"
    assert "tool_calls" not in choice["message"]


def test_response_format_constrains_a_stateful_turn_too(api):
    say(api, '{"a": 1}')
    r = api.client.post(
        "/v1/chat/completions", json=body(conversation_id="new", response_format={"type": "json_object"})
    )
    assert r.status_code == 200, r.text
    assert json.loads(r.json()["choices"][0]["message"]["content"]) == {"a": 1}
    assert api.runner.requests[-1].constraint.kind == "json_object"


def test_without_a_format_nothing_is_constrained(api):
    say(api, "Hi.")
    api.client.post("/v1/chat/completions", json=body())
    assert api.runner.requests[-1].constraint is None


def test_a_stateful_conversation_calls_a_tool_and_its_result_is_answered_by_id(api):
    say(api, CALL)
    r = api.client.post(
        "/v1/chat/completions", json=body(conversation_id="new", tools=[WEATHER], tool_choice="required")
    )
    assert r.status_code == 200, r.text
    conv = r.json()["x_llmweb"]["conversation_id"]
    (call,) = r.json()["choices"][0]["message"]["tool_calls"]
    assert "get_weather" in api.fmt.decode(api.runner.requests[-1].prompt_ids), "the tools are described"

    wrong = [{"role": "tool", "tool_call_id": "call_nope", "content": "x"}]
    r = api.client.post("/v1/chat/completions", json=body(conversation_id=conv, tools=[WEATHER], messages=wrong))
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].tool_call_id"

    say(api, '{"response": "It is mild in Oslo."}')
    result = [{"role": "tool", "tool_call_id": call["id"], "content": "12 C and cloudy"}]
    r = api.client.post("/v1/chat/completions", json=body(conversation_id=conv, tools=[WEATHER], messages=result))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "It is mild in Oslo."
    prompt = api.fmt.decode(api.runner.requests[-1].prompt_ids)
    assert "12 C and cloudy" in prompt and '"city": "Oslo in Norway"' in prompt, "the result restates its call"
