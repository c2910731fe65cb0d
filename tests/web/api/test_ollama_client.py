"""Ollama's API of the launched app, driven with the official `ollama` package: the real default
model, a multi-user install with two keys (alice, bob) sent as `Authorization: Bearer` headers."""

from __future__ import annotations

import ollama
import pytest

from tests.web.api.test_openai_client import ALICE, BOB, client, served  # noqa: F401 (the fixture)


def ollama_client(base: str, key: str = ALICE) -> ollama.Client:
    return ollama.Client(host=base.removesuffix("/v1"), headers={"Authorization": f"Bearer {key}"}, timeout=300)


def test_list_show_chat_generate_and_embed(served):  # noqa: F811
    runtime, base = served
    o = ollama_client(base)
    names = [m.model for m in o.list().models]
    assert "llmweb" in names and runtime.model_id in names
    shown = o.show("llmweb")
    assert "completion" in shown.capabilities
    arch = shown.modelinfo["general.architecture"]
    assert shown.modelinfo[f"{arch}.context_length"] == runtime.budget.context_limit
    embedder = next(n for n in names if n not in ("llmweb", runtime.model_id) and "MiniLM" in n)
    assert o.show(embedder).capabilities == ["embedding"]

    ask = [{"role": "user", "content": "What is the capital of France?"}]
    whole = o.chat(model="llmweb", messages=ask, options={"num_predict": 24, "temperature": 0})
    assert "Paris" in whole.message.content and whole.done and whole.eval_count >= 1
    parts = list(o.chat(model="llmweb:latest", messages=ask, stream=True, options={"num_predict": 24}))
    assert parts[-1].done and parts[-1].done_reason in ("stop", "length") and len(parts) >= 3
    assert "".join(p.message.content for p in parts).strip() == whole.message.content, "greedy: the same reply"

    gen = o.generate(model="llmweb", prompt="What is the capital of France?", options={"num_predict": 24})
    assert "Paris" in gen.response and gen.done
    raw = o.generate(model="llmweb", prompt="The capital of France is", raw=True, options={"num_predict": 6})
    assert raw.response and raw.prompt_eval_count >= 5

    vectors = o.embed(model=embedder, input=["Paris is in France.", "A cat sat."]).embeddings
    assert len(vectors) == 2 and len(vectors[0]) == 384
    assert o.embeddings(model=embedder, prompt="Paris").embedding

    with pytest.raises(ollama.ResponseError) as e:
        o.chat(model="llmweb", messages=ask, options={"num_predict": "many"})
    assert e.value.status_code == 400 and "options.num_predict" in str(e.value)
    with pytest.raises(ollama.ResponseError) as e:
        ollama_client(base, "wrong-key").list()
    assert e.value.status_code == 401


def test_one_visitors_ollama_calls_store_nothing_and_see_nobody_elses(served):  # noqa: F811
    runtime, base = served
    alice = client(base, ALICE)
    first = alice.chat.completions.with_raw_response.create(
        model="llmweb",
        messages=[{"role": "user", "content": "My secret word is heliotrope."}],
        max_tokens=8,
        extra_body={"conversation_id": "new"},
    )
    conv = first.headers["x-llmweb-conversation-id"]
    before = [c.id for c in runtime.store.list_conversations("user:bob")]
    bob = ollama_client(base, BOB)
    reply = bob.chat(
        model="llmweb", messages=[{"role": "user", "content": "What is my secret word?"}], options={"num_predict": 16}
    )
    assert "heliotrope" not in reply.message.content.lower(), "alice's chat is not in bob's prompt"
    assert [c.id for c in runtime.store.list_conversations("user:bob")] == before, "Ollama calls store nothing"
    assert runtime.store.exists("user:alice", conv) and not runtime.store.exists("user:bob", conv)


def test_ollama_format_and_tools_go_through_the_constrained_chat_path(served):  # noqa: F811
    import json

    import jsonschema

    _runtime, base = served
    o = ollama_client(base)
    assert "tools" in o.show("llmweb").capabilities
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
        "required": ["city", "country"],
    }
    ask = [{"role": "user", "content": "Paris is the capital of France. Give the city and its country as JSON."}]
    shaped = o.chat(model="llmweb", messages=ask, format=schema, options={"num_predict": 48, "temperature": 0})
    jsonschema.validate(json.loads(shaped.message.content), schema)

    weather = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
    ask = [{"role": "user", "content": "What is the weather in Paris? Use the tool."}]
    for streamed in (False, True):
        if streamed:
            parts = list(
                o.chat(model="llmweb", messages=ask, tools=[weather], stream=True, options={"num_predict": 48})
            )
            message = parts[-1].message
            assert parts[-1].done
        else:
            message = o.chat(model="llmweb", messages=ask, tools=[weather], options={"num_predict": 48}).message
        if message.tool_calls:  # under `auto` the model may answer in prose; a call is always well formed
            call = message.tool_calls[0]
            assert call.function.name == "get_weather"
            jsonschema.validate(dict(call.function.arguments), weather["function"]["parameters"])
        else:
            assert message.content
