"""A model's own tool format, read from its chat template: a Hermes/Qwen template (`<tool_call>`)
gets its tools block from the template itself, its calls and results written as the template
writes them, its reply read and constrained in that syntax; a template without tools, or with a
format llmweb does not write, gets the generic JSON format. The Qwen model here has the embedded
SmolLM2's vocabulary, Qwen's special tokens and a Qwen 2.5 template, and random weights: the
tests check rendering, reading and the grammar, not words."""

from __future__ import annotations

import json
import logging
from dataclasses import replace

import jsonschema
import pytest

from llmweb.chat.tokens import TemplateFormat
from llmweb.engine import models
from llmweb.web.api.chat_wire import parse_request
from llmweb.web.api.tools import GENERIC, HERMES, CallScanner, ToolFormat, model_format
from tests.conftest import make_settings
from tests.engine import zoo

# Qwen 2.5's chat template (its tool branches in), as the model ships it
QWEN25_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}"
    "{%- else %}{{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}{%- endif %}"
    '{{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n'
    'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}'
    '{%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}'
    '{{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments '
    'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": '
    '<args-json-object>}\\n</tool_call><|im_end|>\\n" }}'
    "{%- else %}{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
    "assistant.<|im_end|>\\n' }}{%- endif %}{%- endif %}"
    "{%- for message in messages %}"
    '{%- if (message.role == "user") or (message.role == "system" and not loop.first) or '
    '(message.role == "assistant" and not message.tool_calls) %}'
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == \"assistant\" %}{{- '<|im_start|>' + message.role }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    '{{- \'\\n<tool_call>\\n{"name": "\' }}{{- tool_call.name }}{{- \'", "arguments": \' }}'
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    '{%- elif message.role == "tool" %}'
    "{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != \"tool\") %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city", "days"],
        },
    },
}

# bounded arguments and one call: a random model's reply always fits the cap
BOUNDED = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 8},
                "days": {"type": "integer", "maximum": 9, "minimum": 1},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """A Qwen-shaped tokenizer with Qwen 2.5's tool template, and a tiny random Qwen3 model beside it."""
    folder, name = models.embedded_gguf()
    settings = make_settings(tmp_path_factory.mktemp("qwen-data"))
    base = models.tokenizer_source(settings, folder / name, progress=lambda _: None)
    family = replace(zoo.FAMILIES["qwen3"], template=QWEN25_TEMPLATE)
    out = tmp_path_factory.mktemp("qwen-tools")
    tok = zoo.build_tokenizer(family, base, out)
    return family, out, tok


def test_a_template_tells_its_tool_format(qwen, caplog):
    _, _, tok = qwen
    fmt = TemplateFormat(tok)
    assert model_format(fmt).name == HERMES
    assert model_format(fmt, local=False).name == GENERIC, "a remote server constrains with a schema of its own"
    plain = TemplateFormat(tok)
    plain.tokenizer = type("T", (), {"chat_template": zoo.QWEN3_TEMPLATE})()  # the zoo's: no tools
    assert model_format(plain).name == GENERIC
    other = type("F", (), {"tools_text": None})()
    other.tokenizer = type("T", (), {"chat_template": "{% if tools %}<|python_tag|>{% endif %}"})()
    other.tools_text = lambda tools: ""
    with caplog.at_level(logging.WARNING):
        assert model_format(other).name == GENERIC
    assert "Llama 3.x" in caplog.text and "generic JSON format" in caplog.text


def test_tools_calls_and_results_render_as_the_template_renders_them(qwen):
    _, _, tok = qwen
    fmt = TemplateFormat(tok)
    tools = model_format(fmt)
    history = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Weather in Oslo for 2 days?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 2}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "rain, 9 C"},
    ]
    req = parse_request({"model": "m", "messages": history, "tools": [WEATHER]}, ["m"], 10_000, None, tools)
    assert req.shaped is not None and req.shaped.constraint is None, "auto: the model writes a call or text"
    system, *rest = req.messages
    ids = fmt.system_ids(f"{system.text}\n\n{req.shaped.instruction}")
    for m in rest:
        ids += fmt.message_ids("assistant" if m.role == "assistant" else "user", m.text)
    ids += fmt.generation_prompt_ids()
    theirs = [
        *history[:2],
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}}],
        },
        history[3],
    ]
    expected = tok.apply_chat_template(theirs, tools=[WEATHER], tokenize=False, add_generation_prompt=True)
    assert tok.decode(ids) == expected

    required = parse_request(
        {"model": "m", "messages": history, "tools": [WEATHER], "tool_choice": "required"}, ["m"], 10_000, None, tools
    )
    assert required.shaped is not None and required.shaped.constraint is not None
    assert "<tool_call>" in required.shaped.constraint.grammar and required.shaped.constraint.kind == "tools"


def test_a_hermes_reply_is_read_into_calls_and_content():
    text = (
        'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "days": 1}}\n</tool_call>'
    )
    scanner = CallScanner(ToolFormat(HERMES), lambda i: f"call_{i}")
    streamed = []
    for k in range(1, len(text) + 1):  # a character at a time, as a stream could bring it
        streamed += scanner.feed(text[:k])
    content, calls = CallScanner(ToolFormat(HERMES), lambda i: f"call_{i}").result(text)
    assert content == "Let me look."
    assert [(c.id, c.name, json.loads(c.arguments)) for c in calls] == [
        ("call_0", "get_weather", {"city": "Oslo", "days": 2}),
        ("call_1", "get_weather", {"city": "Rome", "days": 1}),
    ]
    for i, c in enumerate(calls):
        mine = [d for d in streamed if d["index"] == i]
        assert mine[0]["id"] == c.id and mine[0]["function"] == {"name": "get_weather", "arguments": ""}
        assert "".join(d["function"]["arguments"] for d in mine[1:]) == c.arguments and len(mine) > 3
    assert CallScanner(ToolFormat(HERMES)).result("Just text.") == ("Just text.", [])


@pytest.mark.slow
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_random_qwen_model_constrained_in_its_own_format_calls_a_valid_tool(qwen, tmp_path, choice):
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from llmweb.runtime import Runtime
    from llmweb.web.api.routes import api_routes
    from llmweb.web.owner import owner_secrets

    family, out, tok = qwen
    zoo.build_model(family, tok, out)
    settings = make_settings(
        tmp_path,
        model=str(out),
        backend="transformers",
        device="cpu",
        quant="fp32",
        engine_process="0",
        context_limit=1024,
        max_new_tokens=96,
        summary_tokens=48,
    )
    rt = Runtime(settings).start(background=False)
    try:
        rt.wait_ready(120)
        key = owner_secrets(settings).api_key
        client = TestClient(
            FastAPI(routes=api_routes(rt)),
            base_url="http://127.0.0.1:7860",
            client=("127.0.0.1", 5000),
            headers={"Authorization": f"Bearer {key}"} if key else {},
        )
        model = client.get("/v1/models").json()["data"][0]["id"]
        ask = {
            "model": model,
            "messages": [{"role": "user", "content": "Weather?"}],
            "tools": [BOUNDED],
            "tool_choice": choice,
            "parallel_tool_calls": False,
            "seed": 1,
            "temperature": 1.0,
        }
        for stateful in (False, True):  # stateful: the call is stored as written, and answered by its id
            sent = {**ask, "conversation_id": "new"} if stateful else ask
            r = client.post("/v1/chat/completions", json=sent)
            assert r.status_code == 200, r.text
            choice_ = r.json()["choices"][0]
            calls = choice_["message"].get("tool_calls") or []
            assert choice_["finish_reason"] == "tool_calls" and calls, choice_
            for call in calls:
                assert call["function"]["name"] == "get_weather"
                jsonschema.validate(json.loads(call["function"]["arguments"]), BOUNDED["function"]["parameters"])
        conv = r.headers["X-Llmweb-Conversation-Id"]
        results = [{"role": "tool", "tool_call_id": c["id"], "content": "rain, 9 C"} for c in calls]
        r = client.post(
            "/v1/chat/completions",
            json={
                "model": model,
                "conversation_id": conv,
                "messages": results,
                "tools": [BOUNDED],
                "tool_choice": "none",
            },
        )
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")
    finally:
        rt.close()


def test_the_generic_format_streams_arguments_with_braces_and_quotes_in_strings_whole():
    args = ['{"q": "a}b\\"c]{", "n": [1, {"x": null}], "ok": true}', '{"note": "\\\\"}']
    text = '{"tool_calls": [' + ", ".join(f'{{"name": "f{i}", "arguments": {a}}}' for i, a in enumerate(args)) + "]}"
    scanner = CallScanner(ToolFormat(GENERIC))
    streamed = []
    for k in range(1, len(text) + 1):
        streamed += scanner.feed(text[:k])
    content, calls = scanner.result(text)
    assert content is None and [c.arguments for c in calls] == args and [c.name for c in calls] == ["f0", "f1"]
    for i, a in enumerate(args):
        assert "".join(d["function"].get("arguments", "") for d in streamed if d["index"] == i) == a
    assert CallScanner(ToolFormat(GENERIC)).result('{"response": "Hi."}') == ("Hi.", [])
