"""The OpenAI-compatible API of the launched app, driven with the official `openai` package: the real
default model (int8-cpu on the CPU), real SQLite, the UI and the API on one port
(as `python -m llmweb serve` runs them).

A multi-user install with two keys (alice, bob); replies are kept short (max_tokens) and the
context small, so the whole file takes a few minutes on two cores."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import httpx2
import openai
import pytest

from llmweb.cli.main import launch_app
from llmweb.runtime import Runtime
from llmweb.web.identity import browser_owner
from llmweb.web.panels.base import PanelHandlers
from tests.conftest import make_settings

ALICE, BOB = "alice-key-0123456789", "bob-key-0123456789"
WAIT_S = 300


@pytest.fixture(scope="module")
def served(tmp_path_factory, app_model):
    settings = make_settings(
        tmp_path_factory.mktemp("api"),
        context_limit=1024,
        max_new_tokens=32,
        summary_tokens=64,
        user_tokens=256,
        retrieved_tokens=128,
        facts_tokens=64,
        single_user="0",
        api_keys=f"alice:{ALICE},bob:{BOB}",
        queue_size=2,
        queue_per_user=1,
    )
    runtime = Runtime(settings, loaded=app_model).start(background=True)
    runtime.wait_ready(WAIT_S)
    demo, url = launch_app(runtime, server_port=None, quiet=True, prevent_thread_lock=True)
    yield runtime, url.rstrip("/") + "/v1"
    demo.close()
    runtime.close()


def client(base: str, key: str = ALICE) -> openai.OpenAI:
    return openai.OpenAI(base_url=base, api_key=key, max_retries=0, timeout=WAIT_S)


def ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def wait_for(predicate, timeout=WAIT_S, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def test_models_and_a_stateless_answer_without_and_with_streaming(served):
    runtime, base = served
    c = client(base)
    models = {m.id: m for m in c.models.list()}
    assert list(models)[:2] == ["llmweb", runtime.model_id], "the model served, under both names, first"
    assert models["llmweb"].context_length == runtime.budget.context_limit and models[runtime.model_id].loaded

    r = c.chat.completions.create(model="llmweb", messages=ask("What is the capital of France?"), max_tokens=24)
    assert "Paris" in r.choices[0].message.content and r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens >= 1 and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.usage.prompt_tokens_details.cached_tokens >= 0
    x = r.x_llmweb
    assert x["mode"] == "stateless"
    assert sum(v for k, v in x["sections"].items() if k != "reserve") == r.usage.prompt_tokens

    chunks = list(
        c.chat.completions.create(
            model="llmweb",
            messages=[{"role": "system", "content": "Answer in one sentence."}, *ask("What is the capital of France?")],
            max_tokens=24,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert "Paris" in text and len([ch for ch in chunks if ch.choices and ch.choices[0].delta.content]) >= 2
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= 1
    finish = [ch for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert len(finish) == 1 and finish[0].x_llmweb["sections"]["system"] > 0
    # the same question again: the prompt's prefix comes from the KV cache
    again = c.chat.completions.create(model="llmweb", messages=ask("What is the capital of France?"), max_tokens=24)
    assert again.usage.prompt_tokens_details.cached_tokens > 0


def test_a_200_message_history_that_cannot_fit_is_answered_inside_the_budget(served):
    runtime, base = served
    c = client(base)
    history = []
    for i in range(100):  # ~1,600 tokens: short messages, so that one summary job folds what must go
        history += [{"role": "user", "content": f"Item {i}."}, {"role": "assistant", "content": "Ok."}]
    question = ask("How many items did I list?")
    t0 = time.perf_counter()
    raw = c.chat.completions.with_raw_response.create(model="llmweb", messages=history + question, max_tokens=24)
    first_s = time.perf_counter() - t0
    r = raw.parse()
    limit = runtime.budget.context_limit
    assert r.usage.prompt_tokens + 24 <= limit, "inside the budget"
    x = r.x_llmweb
    assert 100 <= x["summarized_messages"] < 200 and x["left_out_messages"] == 0, x.get("summary_error", x)
    assert x["sections"]["summary"] > 0 and x["summary_folds"] >= 1 and not x["summary_cached"]
    assert raw.headers["x-llmweb-summarized-messages"] == str(x["summarized_messages"])
    assert raw.headers["x-llmweb-left-out-messages"] == "0"
    assert r.choices[0].message.content

    # the chat goes on: the summary of the same prefix comes from the cache, nothing is folded again
    longer = history + question + [{"role": "assistant", "content": r.choices[0].message.content}] + ask("Thanks!")
    t0 = time.perf_counter()
    r2 = c.chat.completions.create(model="llmweb", messages=longer, max_tokens=8)
    assert r2.x_llmweb["summary_cached"] and r2.x_llmweb["summary_folds"] == 0
    assert r2.x_llmweb["summarized_messages"] == x["summarized_messages"]
    assert time.perf_counter() - t0 < first_s, "no summary from scratch on the next call"


def test_a_stateful_conversation_continues_and_shows_only_in_its_owners_list(served):
    runtime, base = served
    alice, bob = client(base, ALICE), client(base, BOB)
    first = alice.chat.completions.with_raw_response.create(
        model="llmweb",
        messages=ask("My name is Ada. What is 2 + 2?"),
        max_tokens=16,
        extra_body={"conversation_id": "new"},
    )
    conv = first.headers["x-llmweb-conversation-id"]
    assert first.parse().x_llmweb["conversation_id"] == conv
    stream = alice.chat.completions.create(
        model="llmweb",
        messages=ask("And what is 3 + 3?"),
        max_tokens=16,
        stream=True,
        extra_headers={"X-Llmweb-Conversation-Id": conv},
    )
    assert "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices).strip()
    stored = runtime.store.get("user:alice", conv)
    assert [t.user for t in stored.turns] == ["My name is Ada. What is 2 + 2?", "And what is 3 + 3?"]

    # alice's list in the UI (login as alice) has it; bob's has not, and bob cannot continue it
    shown = PanelHandlers(runtime)
    for name, listed in (("alice", True), ("bob", False)):
        owner = browser_owner(runtime.settings, "", SimpleNamespace(username=name))
        choices = shown.panel(owner, stored).conv_list["choices"]
        assert any(conv == value for _label, value in choices) is listed
    with pytest.raises(openai.NotFoundError, match="no conversation"):
        bob.chat.completions.create(
            model="llmweb", messages=ask("hi"), max_tokens=8, extra_body={"conversation_id": conv}
        )


def test_a_client_that_disconnects_cancels_its_generation(served):
    runtime, base = served
    with client(base).chat.completions.create(
        model="llmweb",
        messages=ask("Count from 1 to 300, separated by commas."),
        stream=True,
        extra_body={"conversation_id": "new"},
    ) as stream:
        conv = stream.response.headers["x-llmweb-conversation-id"]
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                break  # leave after the first words: the context manager closes the connection

    def stored():  # the conversation is created with its first turn, the stopped one
        return runtime.store.exists("user:alice", conv) and runtime.store.get("user:alice", conv).turns[0]

    turn = wait_for(stored, what="the partial turn")
    assert turn.stats.gen.finish_reason == "cancelled"
    assert turn.stats.gen.generated_tokens < runtime.budget.max_new_tokens


def test_each_bad_request_gets_its_4xx(served):
    runtime, base = served
    c = client(base)
    cases = [
        (openai.BadRequestError, dict(n=2), "n > 1"),
        (
            openai.BadRequestError,
            dict(
                tools=[{"type": "function", "function": {"name": "f"}}],
                tool_choice={"type": "function", "function": {"name": "g"}},
            ),
            "not among tools",
        ),
        (openai.BadRequestError, dict(logprobs=True, top_logprobs=21), "top_logprobs"),
        (openai.BadRequestError, dict(messages=[{"role": "robot", "content": "hi"}]), "role"),
        (openai.BadRequestError, dict(messages=ask("  ")), "empty"),
        (openai.NotFoundError, dict(model="gpt-5"), "does not exist"),
    ]
    for error, overrides, words in cases:
        kw = {"model": "llmweb", "messages": ask("hi"), "max_tokens": 8, **overrides}
        with pytest.raises(error, match=words):
            c.chat.completions.create(**kw)
    with pytest.raises(openai.AuthenticationError):
        client(base, "not-a-key").chat.completions.create(model="llmweb", messages=ask("hi"))
    http = httpx2.Client(headers={"Authorization": f"Bearer {ALICE}"}, timeout=60)
    bad_json = http.post(
        f"{base}/chat/completions",
        content=b'{"model": "llmweb", "messages": [',
        headers={"Content-Type": "application/json"},
    )
    assert bad_json.status_code == 400 and "not valid JSON" in bad_json.json()["error"]["message"]
    huge = {"model": "llmweb", "messages": ask("x" * (runtime.settings.api_max_body_kb * 1024 + 1))}
    too_big = http.post(f"{base}/chat/completions", json=huge)
    assert too_big.status_code == 413 and too_big.json()["error"]["code"] == "request_too_large"


def test_a_flood_gets_429_with_retry_after(served):
    runtime, base = served
    c = client(base)
    results: list = []

    def one():
        try:
            c.chat.completions.create(model="llmweb", messages=ask("Say hello."), max_tokens=16)
            results.append("ok")
        except openai.RateLimitError as e:
            results.append(e)

    threads = [threading.Thread(target=one) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S)
    refused = [r for r in results if r != "ok"]
    assert len(results) == 6 and "ok" in results and refused
    assert all(e.status_code == 429 and e.response.headers["retry-after"].isdigit() for e in refused)


def test_the_sdks_default_embeddings_create_equals_the_embedders_own_vectors(served):
    """`client.embeddings.create` as callers write it (the SDK asks for base64 and decodes it): a
    string and a list, each vector the embedder's own (the library's); bob's key works the same."""
    runtime, base = served
    import numpy as np

    texts = ["The capital of France is Paris.", "Cats sleep most of the day.", "x" * 5000]
    own = runtime.library.embedder.embed(texts)
    raw = client(base).embeddings.with_raw_response.create(model="llmweb-embedding", input=texts[0])
    assert isinstance(raw.http_response.json()["data"][0]["embedding"], str), "the SDK asked for base64"
    one = raw.parse()
    assert one.model == "all-MiniLM-L6-v2" and one.usage.prompt_tokens == one.usage.total_tokens > 2
    many = client(base, BOB).embeddings.create(model="all-MiniLM-L6-v2", input=texts)
    for got, want in zip([one.data[0], *many.data[:1]], [own[0], own[0]], strict=True):
        v = np.asarray(got.embedding, dtype=np.float32)
        assert v.shape == want.shape and float(v @ want) / float(np.linalg.norm(v)) > 0.999
    vectors = np.asarray([d.embedding for d in many.data], dtype=np.float32)
    assert [d.index for d in many.data] == [0, 1, 2] and np.allclose(vectors, own, atol=1e-5)
    assert many.model_extra["x_llmweb"]["truncated"] == [2], "the long text: the model read its window"
    with pytest.raises(openai.NotFoundError, match="does not exist here"):
        client(base).embeddings.create(model="text-embedding-3-small", input="hi")
    with pytest.raises(openai.BadRequestError, match="dimensions must be 384"):
        client(base).embeddings.create(model="llmweb-embedding", input="hi", dimensions=256)


def test_logprobs_and_completions_through_the_sdk(served):
    runtime, base = served
    c = client(base)
    r = c.chat.completions.create(
        model="llmweb", messages=ask("What is the capital of France?"), max_tokens=12, logprobs=True, top_logprobs=3
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert b"".join(bytes(t.bytes) for t in content).decode().strip() == r.choices[0].message.content
    assert all(t.logprob <= 0 and len(t.top_logprobs) == 3 for t in content)
    assert all(t.top_logprobs[0].logprob >= t.logprob - 1e-6 for t in content)

    chunks = list(
        c.chat.completions.create(
            model="llmweb", messages=ask("Name a colour."), max_tokens=8, stream=True, logprobs=True, top_logprobs=1
        )
    )
    streamed = [t for ch in chunks if ch.choices and ch.choices[0].logprobs for t in ch.choices[0].logprobs.content]
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert streamed and b"".join(bytes(t.bytes) for t in streamed).decode().strip() == text.strip()

    done = c.completions.create(model="llmweb", prompt="The capital of France is", max_tokens=8, logprobs=2)
    choice = done.choices[0]
    assert choice.text and choice.finish_reason in ("stop", "length") and done.usage.prompt_tokens > 3
    assert len(choice.logprobs.tokens) == done.usage.completion_tokens and len(choice.logprobs.top_logprobs[0]) == 2
    parts = list(c.completions.create(model="llmweb", prompt="The capital of France is", max_tokens=8, stream=True))
    assert "".join(p.choices[0].text for p in parts if p.choices) == choice.text, "greedy: the same text streamed"
    with pytest.raises(openai.BadRequestError, match="context"):
        c.completions.create(model="llmweb", prompt="word " * 2000, max_tokens=8)
