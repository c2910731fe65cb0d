"""response_format and tools on the wire (web/api/tools.py through chat_wire.parse_request): what is
read, the reply's OpenAI shape, and hostile input refused with a 400 that names the field."""

from __future__ import annotations

import json

import pytest

from llmweb.web.api.chat_wire import parse_request
from llmweb.web.api.common import parse_json
from llmweb.web.api.errors import ApiError
from tests.web.api.conftest import body

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def read(b):
    return parse_request(b, ["llmweb"], 100_000)


def refusal(b) -> ApiError:
    with pytest.raises(ApiError) as info:
        read(b)
    assert info.value.status == 400
    return info.value


def _nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def _rf(schema) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}


@pytest.mark.parametrize(
    ("b", "param", "said"),
    [
        (body(response_format=_rf(_nested(100))), "response_format.json_schema.schema", "32 deep"),
        (body(response_format=_rf({"description": "x" * 1_000_000})), "response_format.json_schema.schema", "64,000"),
        (
            body(response_format=_rf({"type": "string", "pattern": "((a{1,9999}){1,9999})*"})),
            "response_format.json_schema.schema",
            "repeats",
        ),
        (body(response_format=_rf({"type": "string", "pattern": "(?<=x)a"})), "response_format.json_schema.schema", ""),
        (body(response_format={"type": "json_schema"}), "response_format.json_schema", ""),
        (body(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice", "nope"),
        (body(tool_choice="required"), "tool_choice", "no tools"),
        (body(tools=[WEATHER, WEATHER]), "tools", "same name"),
        (
            body(tools=[{"type": "function", "function": {"name": "f", "parameters": _nested(40)}}]),
            "tools[0].function.parameters",
            "32 deep",
        ),
        (
            body(messages=[{"role": "user", "content": "hi"}, {"role": "tool", "tool_call_id": "c1", "content": "x"}]),
            "messages[1].tool_call_id",
            "must answer a call",
        ),
        (body(tools=[WEATHER], response_format={"type": "json_object"}), "response_format", "not both"),
        (body(parallel_tool_calls="yes"), "parallel_tool_calls", "boolean"),
    ],
)
def test_hostile_or_wrong_input_is_a_400_naming_the_field(b, param, said):
    e = refusal(b)
    assert e.param == param and said in e.message, e.message


def test_a_body_nested_1000_deep_is_a_400_naming_its_field_not_a_crash():
    raw = json.dumps(body(response_format=_rf({})))
    deep = '{"type": "object", "properties": {"a": ' * 1000 + '{"type": "string"}' + "}}" * 1000
    raw = raw.replace('"schema": {}', f'"schema": {deep}')
    with pytest.raises(ApiError) as info:
        read(parse_json(raw.encode()))
    assert info.value.status == 400 and info.value.param == "response_format"


def test_a_schema_and_tools_are_read_into_a_constraint_and_an_instruction():
    req = read(body(response_format=_rf({"type": "object", "properties": {"a": {"type": "integer"}}})))
    assert req.shaped is not None and '"integer"' in req.shaped.instruction
    assert req.shaped.constraint.kind == "json_schema" and req.tools is None
    req = read(body(tools=[WEATHER], tool_choice="none"))
    assert req.tools is not None and req.shaped is None, "none: the model answers in prose"
    req = read(body(tools=[WEATHER]))
    assert req.tools is not None and req.tools.choice == "auto" and req.shaped is not None
    assert "get_weather" in req.shaped.instruction and '{"response"' in req.shaped.instruction


def test_history_with_calls_and_results_is_rendered_for_the_model():
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    req = read(
        body(
            tools=[WEATHER],
            messages=[
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
            ],
        )
    )
    roles = [m.role for m in req.messages]
    assert roles == ["user", "assistant", "tool"]
    assert json.loads(req.messages[1].text) == {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}
    assert '"name": "get_weather", "arguments": {"city": "Paris"}} (call_1)' in req.messages[2].text
    assert req.messages[2].text.endswith("21 C")


def test_a_reply_in_the_tool_format_becomes_openai_tool_calls():
    ts = read(body(tools=[WEATHER], tool_choice="required")).tools
    assert ts is not None
    content, calls = ts.reply(
        '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo"}}, '
        '{"name": "get_weather", "arguments": {"city": "Rome"}}]}'
    )
    assert content is None and [json.loads(c.arguments)["city"] for c in calls] == ["Oslo", "Rome"]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)
    assert calls[0].to_dict()["type"] == "function"
    assert ts.reply('{"response": "It is sunny."}') == ("It is sunny.", [])
    assert ts.reply('{"tool_calls": [') == ('{"tool_calls": [', []), "cut by max_tokens: the text as it is"
