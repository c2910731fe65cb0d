"""Structured output and tools against the launched app with the real embedded model, driven by the
official `openai` package (`.parse()` with pydantic models, tool calls plain and streamed) and by
`langchain-openai` (`bind_tools`, `with_structured_output`): the reply always parses and validates,
because the grammar allows nothing else (engine/constraint.py)."""

from __future__ import annotations

import json
import time
from enum import StrEnum

import jsonschema
import openai
import pytest
from pydantic import BaseModel

from llmweb.cli.main import launch_app
from llmweb.runtime import Runtime
from tests.conftest import make_settings

KEY = "alice-key-0123456789"
WAIT_S = 300


@pytest.fixture(scope="module")
def served(tmp_path_factory, app_model):
    settings = make_settings(
        tmp_path_factory.mktemp("api"),
        context_limit=2048,
        max_new_tokens=160,
        summary_tokens=64,
        user_tokens=512,
        retrieved_tokens=128,
        facts_tokens=64,
        single_user="0",
        api_keys=f"alice:{KEY}",
    )
    runtime = Runtime(settings, loaded=app_model).start(background=True)
    runtime.wait_ready(WAIT_S)
    demo, url = launch_app(runtime, server_port=None, quiet=True, prevent_thread_lock=True)
    yield url.rstrip("/") + "/v1"
    demo.close()
    runtime.close()


def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base, api_key=KEY, max_retries=0, timeout=WAIT_S)


class Colour(StrEnum):
    red = "red"
    green = "green"
    blue = "blue"


class Address(BaseModel):
    city: str
    zip_code: int


class Person(BaseModel):
    name: str
    age: int
    height_m: float
    favourite: Colour
    hobbies: list[str]
    address: Address
    nickname: str | None = None


ADA = (
    "Ada is 36, 1.7 m tall, likes blue, her hobbies are chess and running, and she lives in London, "
    "zip code 12345. Describe her."
)


def test_parse_with_a_pydantic_model_returns_a_valid_object(served):
    r = client(served).chat.completions.parse(
        model="llmweb",
        messages=[{"role": "user", "content": ADA}],
        response_format=Person,
        temperature=0,
    )
    person = r.choices[0].message.parsed
    assert isinstance(person, Person) and isinstance(person.address, Address) and person.favourite in Colour
    assert r.choices[0].finish_reason == "stop"
    assert (person.name, person.age, person.hobbies, person.address.zip_code) == (
        "Ada",
        36,
        ["chess", "running"],
        12345,
    )


def test_json_object_and_a_reply_cut_by_max_tokens_says_length(served):
    c = client(served)
    r = c.chat.completions.create(
        model="llmweb",
        messages=[{"role": "user", "content": "Give me a JSON object about cats."}],
        response_format={"type": "json_object"},
    )
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    cut = c.chat.completions.create(
        model="llmweb",
        messages=[{"role": "user", "content": "Describe a person."}],
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": Person.model_json_schema()}},
        max_tokens=5,
    )
    assert cut.choices[0].finish_reason == "length"
    with pytest.raises(openai.LengthFinishReasonError):
        c.chat.completions.parse(
            model="llmweb", messages=[{"role": "user", "content": "A person."}], response_format=Person, max_tokens=5
        )


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city now.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time in a timezone.",
        "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}}, "required": ["timezone"]},
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_required_and_named_tool_choice_return_arguments_that_validate(served, choice):
    r = client(served).chat.completions.create(model="llmweb", messages=ASK, tools=[WEATHER, TIME], tool_choice=choice)
    m, reason = r.choices[0].message, r.choices[0].finish_reason
    assert reason == "tool_calls" and m.content is None and m.tool_calls
    for call in m.tool_calls:
        assert call.id.startswith("call_") and call.type == "function"
        tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
    if isinstance(choice, dict):
        assert {c.function.name for c in m.tool_calls} == {"get_weather"}
    assert len({c.id for c in m.tool_calls}) == len(m.tool_calls)


def test_a_streamed_tool_call_accumulates_into_the_same_arguments_and_its_result_gets_an_answer(served):
    c = client(served)
    named = {"type": "function", "function": {"name": "get_weather"}}
    with c.chat.completions.stream(model="llmweb", messages=ASK, tools=[WEATHER], tool_choice=named) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    call = final.choices[0].message.tool_calls[0]
    assert final.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, WEATHER["function"]["parameters"])

    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump(exclude_none=True)]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "sky": "sunny"})},
    ]
    r = c.chat.completions.create(model="llmweb", messages=history, tools=[WEATHER], tool_choice="none")
    assert r.choices[0].finish_reason in ("stop", "length") and r.choices[0].message.content
    assert not r.choices[0].message.tool_calls


NOTE = {
    "type": "function",
    "function": {
        "name": "save_note",
        "description": "Save a note.",
        "parameters": {
            "type": "object",
            "properties": {"text": {"type": "string", "minLength": 60, "maxLength": 120}},
            "required": ["text"],
        },
    },
}


def test_a_streamed_call_arrives_in_fragments_as_decoded_and_equals_the_whole_one(served):
    """The SDK's streaming helper accumulates the same call as the whole reply with the same seed,
    and a long argument arrives in fragments spread over its decoding, not in one burst at the end."""
    c = client(served)
    ask = {
        "model": "llmweb",
        "messages": [{"role": "user", "content": "Save a note about Tuesday's meeting with the design team."}],
        "tools": [NOTE],
        "tool_choice": {"type": "function", "function": {"name": "save_note"}},
        "seed": 7,
    }
    whole = c.chat.completions.create(**ask).choices[0].message.tool_calls[0]
    arrived = []
    with c.chat.completions.stream(**ask) as stream:
        for event in stream:
            if event.type == "tool_calls.function.arguments.delta":
                arrived.append(time.perf_counter())
        final = stream.get_final_completion()
    call = final.choices[0].message.tool_calls[0]
    assert final.choices[0].finish_reason == "tool_calls"
    assert (call.function.name, call.function.arguments) == (whole.function.name, whole.function.arguments)
    assert len(json.loads(call.function.arguments)["text"]) >= 60
    assert len(arrived) > 10, "a fragment per decoded token or so"
    assert arrived[-1] - arrived[0] > 0.05, "the fragments came as the model decoded them, not all at the end"


def test_langchain_bind_tools_and_with_structured_output(served):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model="llmweb", base_url=served, api_key=KEY, max_retries=0, timeout=WAIT_S, temperature=0)
    msg = llm.bind_tools([WEATHER], tool_choice="get_weather").invoke("What is the weather in Rome?")
    assert msg.tool_calls and msg.tool_calls[0]["name"] == "get_weather"
    jsonschema.validate(msg.tool_calls[0]["args"], WEATHER["function"]["parameters"])
    person = llm.with_structured_output(Person, method="json_schema").invoke(ADA)
    assert isinstance(person, Person)


def test_an_agent_loop_with_long_tool_results_stays_inside_the_context(served):
    """The real model, fewer steps than the fast test's 200: each step a required call whose
    arguments validate, each 3,000-character result sent back with the whole history. Five steps:
    each result is about a thousand tokens, so from the third step on the history is longer than
    the 2,048-token context, and three steps are planned over it, as every later step would be."""
    c = client(served)
    messages: list = [{"role": "user", "content": "Get the weather of one city after another."}]
    for step in range(5):
        r = c.chat.completions.create(model="llmweb", messages=messages, tools=[WEATHER], tool_choice="required")
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", step
        call = choice.message.tool_calls[0]
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
        x = r.model_extra["x_llmweb"]
        assert r.usage.prompt_tokens + x["max_tokens"] <= x["context_limit"], step
        messages.append({"role": "assistant", "content": None, "tool_calls": [call.model_dump(exclude_none=True)]})
        report = " ".join(f"Hour {i}: {15 + i % 7} degrees, light wind." for i in range(120))[:3000]
        messages.append({"role": "tool", "tool_call_id": call.id, "content": report})
