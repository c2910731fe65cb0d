"""The OpenAI-compatible API without a model: request checks, stop strings, stateless fitting, keys,
and the HTTP routes over the real Engine with a scripted FakeRunner (Starlette's TestClient)."""

from __future__ import annotations

import json
import threading
import time
from types import SimpleNamespace

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from hypothesis import given, settings
from hypothesis import strategies as st

from llmweb.chat.context import Budget
from llmweb.chat.session import Chat
from llmweb.chat.stateless import Memory, SummaryCache, dialogue, fit, prefix_keys
from llmweb.config import Settings
from llmweb.engine.request import GenerationRequest
from llmweb.errors import ConfigError
from llmweb.records import LOCAL_OWNER, Chunk, Turn
from llmweb.runtime.resident import Lease
from llmweb.store.db import Store
from llmweb.web.api.chat_wire import StopScanner, parse_request
from llmweb.web.api.errors import ApiError
from llmweb.web.api.keys import ApiKeys, parse_api_keys
from llmweb.web.api.routes import api_routes
from llmweb.web.owner import owner_secrets
from tests.conftest import make_settings
from tests.fakes import FakeFormat, FakeRunner, fake_engine

BUDGET = Budget(context_limit=200, max_new_tokens=20, summary_tokens=30, retrieved_tokens=40, user_tokens=60)


# ---- the request


def body(**kw):
    return {"model": "llmweb", "messages": [{"role": "user", "content": "hi"}], **kw}


def refusal(b, headers=None) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse_request(b, ["llmweb"], 1000, headers)
    return info.value


@pytest.mark.parametrize(
    "b, status, param",
    [
        (body(n=2), 400, "n"),
        (body(tools=[{"type": "function", "function": {"name": "f"}}]), 400, "tools"),
        (body(logprobs=True), 400, "logprobs"),
        (body(response_format={"type": "json_object"}), 400, "response_format"),
        (body(frobnicate=1), 400, "frobnicate"),
        (body(model="gpt-4o"), 404, "model"),
        ({"messages": [{"role": "user", "content": "hi"}]}, 400, "model"),
        (body(messages=[]), 400, "messages"),
        (body(messages=[{"role": "wizard", "content": "hi"}]), 400, "messages[0].role"),
        (body(messages=[{"role": "tool", "content": "hi", "tool_call_id": "x"}]), 400, "messages[0].role"),
        (body(messages=[{"role": "user", "content": "   "}]), 400, "messages[0].content"),
        (body(messages=[{"role": "user", "content": None}]), 400, "messages[0].content"),
        (body(messages=[{"role": "user", "content": "x" * 1001}]), 400, "messages[0].content"),
        (body(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]), 400, None),
        (body(messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]), 400, None),
        (body(temperature=3), 400, "temperature"),
        (body(temperature="hot"), 400, "temperature"),
        (body(top_p=0), 400, "top_p"),
        (body(max_tokens=0), 400, "max_tokens"),
        (body(max_tokens=True), 400, "max_tokens"),
        (body(stop=["a", "b", "c", "d", "e"]), 400, "stop"),
        (body(stop=[""]), 400, "stop"),
        (body(stream_options={"include_usage": True}), 400, "stream_options"),
        (
            body(
                conversation_id="new", messages=[{"role": "system", "content": "x"}, {"role": "user", "content": "y"}]
            ),
            400,
            "messages",
        ),
    ],
)
def test_each_bad_request_is_refused_with_its_status_and_parameter(b, status, param):
    e = refusal(b)
    assert e.status == status and e.message
    if param is not None:
        assert e.param == param
    assert e.body()["error"]["message"] == e.message


def test_a_good_request_is_read_with_its_options_and_neutral_values_of_unsupported_fields():
    req = parse_request(
        body(
            messages=[
                {"role": "developer", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]},
            ],
            stream=True,
            stream_options={"include_usage": True},
            temperature=0.5,
            top_p=0.9,
            max_completion_tokens=7,
            stop="END",
            seed=3,
            user="u1",
            n=1,
            logprobs=False,
            presence_penalty=0,
            tools=[],
            metadata={"a": "b"},
        ),
        ["llmweb"],
        1000,
        {"X-Llmweb-Use-Docs": "1"},
    )
    assert [(m.role, m.text) for m in req.messages] == [("system", "Be brief."), ("user", "Hello\nthere")]
    assert (req.stream, req.include_usage, req.temperature, req.top_p, req.max_tokens) == (True, True, 0.5, 0.9, 7)
    assert (req.stop, req.seed, req.user, req.use_docs, req.stateful) == (("END",), 3, "u1", True, False)
    stateful = parse_request(body(), ["llmweb"], 1000, {"X-Llmweb-Conversation-Id": "abc"})
    assert stateful.conversation_id == "abc" and stateful.stateful


# ---- stop strings


def test_stop_scanner_never_shows_part_of_a_stop_string_and_cuts_at_the_first():
    s = StopScanner(["###", "END"])
    assert s.scan("Hello #") == ("Hello ", False)
    assert s.scan("Hello ##") == ("Hello ", False)
    assert s.scan("Hello #!") == ("Hello #!", False)
    assert s.scan("Hello EN") == ("Hello ", False)
    assert s.scan("Hello world END and ### more") == ("Hello world ", True)
    assert s.stopped
    assert StopScanner([]).scan("caf\ufffd") == ("caf", False)
    assert StopScanner(["x"]).scan("abc", final=True) == ("abc", False)


# ---- stateless fitting


def turns(n: int, words: int = 6) -> list[tuple[str, str]]:
    msgs = []
    for i in range(n):
        msgs.append(("user", f"question {i} " + " ".join(f"u{i}w{j}" for j in range(words))))
        msgs.append(("assistant", f"answer {i} " + " ".join(f"a{i}w{j}" for j in range(words))))
    return msgs


class Folder:
    """A fake summariser: the summary names the folded turns; counts its calls."""

    def __init__(self):
        self.calls: list[int] = []

    def __call__(self, memory: Memory, folded) -> Memory:
        self.calls.append(len(folded))
        return Memory((memory.summary + f" folded {len(folded)} turns.").strip())


def test_dialogue_pairs_turns_joins_runs_and_keeps_system_messages():
    d = dialogue(
        [("system", "S1"), ("assistant", "welcome"), ("user", "a"), ("user", "b"), ("assistant", "c"), ("system", "S2")]
        + [("user", "last")]
    )
    assert d.system == "S1\n\nS2"
    assert d.turns == (Turn("", "welcome"), Turn("a\n\nb", "c"))
    assert d.user == "last" and d.sizes == (1, 3)


def test_a_history_that_fits_is_sent_whole_without_a_summary():
    fmt, fold = FakeFormat(), Folder()
    d = dialogue(turns(3) + [("user", "now?")])
    f = fit(d, "system", BUDGET, fmt, SummaryCache(), "owner", fold, high=0.85, low=0.5)
    assert f.plan.kept_turns == 3 and f.summarized_turns == 0 and not fold.calls
    assert f.report()["left_out_messages"] == 0


def test_a_long_history_is_summarised_oldest_first_within_the_budget_and_the_next_call_reuses_it():
    fmt, fold, cache = FakeFormat(), Folder(), SummaryCache()
    msgs = turns(100)  # 200 messages, ~1,600 words: eight times the context
    f = fit(dialogue(msgs + [("user", "now?")]), "system", BUDGET, fmt, cache, "owner", fold, high=0.85, low=0.5)
    assert len(f.plan.ids) + BUDGET.max_new_tokens <= BUDGET.context_limit
    assert f.summarized_turns > 90 and f.summarized_messages == 2 * f.summarized_turns
    assert f.plan.dropped_turns == 0 and f.plan.kept_turns == 100 - f.summarized_turns
    assert "folded" in f.plan.summary and f.folds == len(fold.calls) >= 1 and not f.from_cache

    # the client sends the same chat, two messages longer: the summary comes from the cache
    calls = len(fold.calls)
    again = fit(
        dialogue(msgs + [("user", "now?"), ("assistant", "ok"), ("user", "and?")]),
        "system", BUDGET, fmt, cache, "owner", fold, high=0.85, low=0.5,
    )  # fmt: skip
    assert again.from_cache and again.summarized_turns >= f.summarized_turns
    assert len(fold.calls) - calls <= 1, "at most one fold of the newest turns, never the whole chat again"
    # another owner's identical chat does not see that cache
    other = fit(dialogue(msgs + [("user", "now?")]), "system", BUDGET, fmt, cache, "someone else", Folder(),
                high=0.85, low=0.5)  # fmt: skip
    assert not other.from_cache


def test_a_fold_that_fails_leaves_the_rest_out_and_says_why():
    from llmweb.errors import BusyError

    def busy(memory, folded):
        raise BusyError("The model is busy: 32 requests are waiting.")

    f = fit(dialogue(turns(100) + [("user", "now?")]), "system", BUDGET, FakeFormat(), SummaryCache(), "o", busy,
            high=0.85, low=0.5)  # fmt: skip
    assert len(f.plan.ids) + BUDGET.max_new_tokens <= BUDGET.context_limit
    assert f.summarized_messages == 0 and f.dropped_messages > 0 and f.dropped_messages + 2 * f.plan.kept_turns == 200
    assert "busy" in f.report()["summary_error"]


def test_folding_sends_batches_that_fit_with_the_summary_as_it_grows():
    from llmweb.chat.stateless import StatelessChat
    from llmweb.chat.summary import segment_request_messages
    from llmweb.chat.tokens import render_prompt

    fmt, cap = FakeFormat(), 30
    seen = []

    def write_summary(previous, batch):
        system, user = segment_request_messages(previous, batch, cap)
        seen.append((len(batch), len(render_prompt(fmt, system, [("user", user)]))))
        grown = previous.split() + [f"s{len(seen)}x{i}" for i in range(20)]  # grows, up to the cap
        return " ".join(grown[-cap:])

    chat = StatelessChat(Settings(), None, fmt, BUDGET, write_summary)  # summary_cap: BUDGET.summary_cap == cap
    memory = chat.fold(Memory(), [Turn(f"u{i} " * 5, f"a{i} " * 5) for i in range(40)])
    assert sum(n for n, _ in seen) == 40 and len(seen) > 1
    assert all(size <= BUDGET.context_limit - cap for _, size in seen), seen
    assert memory.summary.endswith(f"s{len(seen)}x19")


def test_prefix_keys_change_with_any_earlier_message():
    a = prefix_keys("o", [Turn("x", "y"), Turn("z", "w")])
    b = prefix_keys("o", [Turn("x", "y"), Turn("z", "W")])
    assert a[:2] == b[:2] and a[2] != b[2]
    assert prefix_keys("o", [Turn("ab", "c")])[1] != prefix_keys("o", [Turn("a", "bc")])[1]


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.integers(min_value=1, max_value=40), min_size=0, max_size=60),
    user=st.integers(min_value=1, max_value=50),
    summaries=st.booleans(),
)
def test_any_history_is_answered_inside_the_budget(sizes, user, summaries):
    """Never fails for length, never over the budget, and what is not in the prompt is reported."""
    fmt = FakeFormat()
    msgs = []
    for i, n in enumerate(sizes):
        msgs.append(("user" if i % 2 == 0 else "assistant", " ".join(f"m{i}w{j}" for j in range(n))))
    if msgs and msgs[-1][0] == "user":
        msgs.append(("assistant", "ok"))
    d = dialogue(msgs + [("user", " ".join(f"q{j}" for j in range(user)))])
    f = fit(d, "sys", BUDGET, fmt, SummaryCache(), "o", Folder() if summaries else None, high=0.85, low=0.5)
    assert len(f.plan.ids) + BUDGET.max_new_tokens <= BUDGET.context_limit
    in_prompt = sum(d.sizes[len(d.turns) - f.plan.kept_turns :]) if f.plan.kept_turns else 0
    assert f.summarized_messages + f.dropped_messages + in_prompt == sum(d.sizes)


# ---- keys


def test_api_keys_name_their_users_and_never_show_a_key_in_a_message():
    keys = ApiKeys(parse_api_keys("alice:secret-key-1, bob:secret-key-2,bare-key-3"))
    assert keys.configured
    assert keys.lookup("secret-key-1").name == "alice" and keys.lookup("secret-key-2").name == "bob"
    bare = keys.lookup("bare-key-3")
    assert bare.name is None and len(bare.tag) == 12 and bare.tag not in "bare-key-3"
    assert keys.lookup("secret-key-9") is None and keys.lookup("") is None
    assert not ApiKeys([]).configured
    with pytest.raises(ConfigError) as info:
        Settings.from_env({"LLMWEB_API_KEYS": "alice:k1,alice:k1"})
    assert "k1" not in str(info.value)
    with pytest.raises(ConfigError, match="entry 2"):
        Settings.from_env({"LLMWEB_API_KEYS": "alice:k1,bad name:k2"})


def test_a_users_file_key_made_by_the_cli_opens_the_api_for_that_user(tmp_path, capsys):
    from llmweb.cli.user import cmd_user

    path = tmp_path / "users.json"
    s = make_settings(tmp_path, auth_file=path)
    args = SimpleNamespace(file=path, user_command="add", name="carol", password_stdin=True, replace=False)
    import io
    import sys

    sys_stdin, sys.stdin = sys.stdin, io.StringIO("a-long-password\n")
    try:
        cmd_user(args, s)
    finally:
        sys.stdin = sys_stdin
    assert not ApiKeys.from_settings(s).configured
    cmd_user(SimpleNamespace(file=path, user_command="key", name="carol", revoke=False), s)
    key = capsys.readouterr().out.splitlines()[-2]
    assert key.startswith("llmweb-") and key not in path.read_text()
    assert ApiKeys.from_settings(s).lookup(key).name == "carol"
    cmd_user(SimpleNamespace(file=path, user_command="key", name="carol", revoke=True), s)
    assert ApiKeys.from_settings(s).lookup(key) is None


# ---- the routes, over the real engine with a scripted runner


class FakeLibrary:
    def is_empty(self, owner):
        return False

    def search(self, owner, query, k=None, min_score=None, only=None):
        return [Chunk("The capital of France is Paris.", "geography.md", heading="Europe", score=0.9, doc_id="g")]


LOCAL_URL, LOCAL_PEER = "http://127.0.0.1:7860", ("127.0.0.1", 50000)  # as a program on this machine calls


def rig(tmp_path, *, library=None, **kw):
    limits = {k: kw.pop(k) for k in ("queue_size", "queue_per_user", "max_batch") if k in kw}
    s = make_settings(tmp_path, recall=False, **kw)
    engine, runner = fake_engine(FakeRunner(), max_new_tokens=BUDGET.max_new_tokens, **limits)
    fmt = FakeFormat()
    store = Store(tmp_path / "api.sqlite3")
    chat = Chat(s, engine, fmt, store, BUDGET, library=library)
    runtime = SimpleNamespace(
        settings=s,
        store=store,
        chat=chat,
        engine=engine,
        library=library,
        loaded=None,
        wait_ready=lambda t: chat,
        hold=lambda model=None, timeout=None: Lease("llmweb", chat),
    )
    # a program on this machine reads the local API key (web/owner.py) where the server accepts it
    key = owner_secrets(s).api_key if s.on_loopback and not s.login else ""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    client = TestClient(FastAPI(routes=api_routes(runtime)), base_url=LOCAL_URL, client=LOCAL_PEER, headers=headers)
    return SimpleNamespace(client=client, runner=runner, fmt=fmt, store=store, chat=chat, engine=engine, key=key)


@pytest.fixture
def api(tmp_path):
    r = rig(tmp_path)
    yield r
    r.engine.close()
    r.store.close()


def say(r, text: str) -> None:
    r.runner.enqueue(r.fmt._words(text) + [r.fmt.END])


def events(response) -> list:
    out = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            out.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
    return out


def test_models_lists_llmweb(api):
    r = api.client.get("/v1/models")
    assert r.status_code == 200 and [m["id"] for m in r.json()["data"]] == ["llmweb"]
    assert api.client.get("/v1/models/llmweb").json()["id"] == "llmweb"
    assert api.client.get("/v1/models/gpt-4").status_code == 404
    assert api.client.get("/v1/embeddings").json()["error"]["code"] == "unknown_url"
    assert api.client.get("/v1/chat/completions").status_code == 405


def test_a_stateless_reply_has_openai_fields_usage_sections_and_headers(api):
    say(api, "Paris is the capital")
    r = api.client.post("/v1/chat/completions", json=body(messages=[{"role": "user", "content": "Capital of France?"}]))
    assert r.status_code == 200, r.text
    d = r.json()
    assert d["object"] == "chat.completion" and d["id"].startswith("chatcmpl-")
    assert d["choices"][0]["message"] == {"role": "assistant", "content": "Paris is the capital", "refusal": None}
    assert d["choices"][0]["finish_reason"] == "stop"
    u = d["usage"]
    assert u["completion_tokens"] == 4 and u["total_tokens"] == u["prompt_tokens"] + 4
    assert u["prompt_tokens_details"]["cached_tokens"] == 0
    x = d["x_llmweb"]
    assert x["mode"] == "stateless" and x["conversation_id"] is None
    assert sum(v for k, v in x["sections"].items() if k != "reserve") == u["prompt_tokens"]
    assert x["summarized_messages"] == 0 and x["left_out_messages"] == 0
    assert r.headers["x-llmweb-mode"] == "stateless" and r.headers["x-llmweb-summarized-messages"] == "0"
    assert api.store.list_conversations(LOCAL_OWNER) == [], "stateless calls store nothing"


def test_a_stateless_stream_is_openai_chunks_with_usage_last_and_done(api):
    say(api, "one two three")
    req = body(stream=True, stream_options={"include_usage": True})
    with api.client.stream("POST", "/v1/chat/completions", json=req) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        ev = events(r)
    assert ev[-1] == "[DONE]"
    chunks = ev[:-1]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text.strip() == "one two three"
    finish = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finish) == 1 and finish[0]["choices"][0]["finish_reason"] == "stop" and "x_llmweb" in finish[0]
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3


def test_a_stop_string_ends_the_reply_before_it(api):
    say(api, "alpha beta STOP gamma delta epsilon")
    d = api.client.post("/v1/chat/completions", json=body(stop=["STOP"])).json()
    assert d["choices"][0]["message"]["content"] == "alpha beta"
    assert d["choices"][0]["finish_reason"] == "stop" and d["x_llmweb"]["stop"] is True
    say(api, "alpha beta STOP gamma delta epsilon")
    with api.client.stream("POST", "/v1/chat/completions", json=body(stop="STOP", stream=True)) as r:
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in events(r)[:-1] if c["choices"])
    assert text.strip() == "alpha beta"


def test_max_tokens_is_capped_by_the_budget_and_cuts_the_reply(api):
    say(api, "a b c d e f g h")
    d = api.client.post("/v1/chat/completions", json=body(max_tokens=3)).json()
    assert d["choices"][0]["message"]["content"] == "a b c" and d["choices"][0]["finish_reason"] == "length"
    assert d["usage"]["completion_tokens"] == 3
    d = api.client.post("/v1/chat/completions", json=body(max_tokens=10_000)).json()
    assert d["x_llmweb"]["max_tokens"] == BUDGET.max_new_tokens and "capped" in " ".join(d["x_llmweb"]["notes"])
    assert api.runner.requests[-1].max_new_tokens == BUDGET.max_new_tokens


def test_sampling_parameters_reach_the_engine(api):
    api.client.post("/v1/chat/completions", json=body(temperature=0.7, top_p=0.5, seed=11))
    sent = api.runner.requests[-1]
    assert (sent.temperature, sent.top_p, sent.seed) == (0.7, 0.5, 11)


def test_a_stateful_conversation_continues_and_is_listed_for_its_owner(api):
    say(api, "Hello Ada")
    first = api.client.post("/v1/chat/completions", json=body(conversation_id="new"))
    conv = first.headers["x-llmweb-conversation-id"]
    assert first.json()["x_llmweb"]["conversation_id"] == conv and first.json()["x_llmweb"]["mode"] == "stateful"
    say(api, "Still here")
    second = api.client.post(
        "/v1/chat/completions",
        json=body(messages=[{"role": "user", "content": "again"}]),
        headers={"X-Llmweb-Conversation-Id": conv},
    )
    assert second.status_code == 200 and second.json()["choices"][0]["message"]["content"] == "Still here"
    assert [c.id for c in api.store.list_conversations(LOCAL_OWNER)] == [conv]
    assert [t.assistant for t in api.store.get(LOCAL_OWNER, conv).turns] == ["Hello Ada", "Still here"]
    gone = api.client.post("/v1/chat/completions", json=body(conversation_id="no-such-id"))
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "conversation_not_found"


@pytest.mark.parametrize(
    "raw, status",
    [
        (b"{not json", 400),
        (b"[1, 2]", 400),
        (b"\xff\xfe", 400),
        (json.dumps(body(messages=[{"role": "user", "content": "x" * 3000}])).encode(), 413),
    ],
)
def test_malformed_and_oversized_bodies_get_a_4xx_error_object(tmp_path, raw, status):
    r = rig(tmp_path, api_max_body_kb=2)
    try:
        resp = r.client.post("/v1/chat/completions", content=raw, headers={"Content-Type": "application/json"})
        assert resp.status_code == status and resp.json()["error"]["message"]
    finally:
        r.engine.close()


def test_keys_decide_the_owner_and_a_public_bind_without_keys_is_closed(tmp_path):
    closed = rig(tmp_path / "a", host="0.0.0.0")
    r = closed.client.post("/v1/chat/completions", json=body())
    assert r.status_code == 401 and r.json()["error"]["code"] == "api_key_required"
    assert closed.client.get("/v1/models").status_code == 401
    closed.engine.close()

    keyed = rig(tmp_path / "b", host="0.0.0.0", api_keys="alice:key-of-alice,key-of-nobody")
    assert keyed.client.post("/v1/chat/completions", json=body()).json()["error"]["code"] == "missing_api_key"
    wrong = keyed.client.post("/v1/chat/completions", json=body(), headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and "nope" not in wrong.text
    say(keyed, "hi alice")
    ok = keyed.client.post(
        "/v1/chat/completions", json=body(conversation_id="new"), headers={"Authorization": "Bearer key-of-alice"}
    )
    assert ok.status_code == 200
    conv = ok.headers["x-llmweb-conversation-id"]
    assert [c.id for c in keyed.store.list_conversations("user:alice")] == [conv], "in alice's UI list"
    other = keyed.client.post(
        "/v1/chat/completions",
        json=body(conversation_id=conv),
        headers={"Authorization": "Bearer key-of-nobody"},
    )
    assert other.status_code == 404, "another key cannot continue alice's conversation"
    keyed.engine.close()

    # on loopback: the local API key (data_dir/local-api-key) is the single user, LOCAL_OWNER; any other
    # key is refused, as is no key at all
    local = rig(tmp_path / "c")
    say(local, "hello")
    for key in ("sk-anything", ""):
        refused = local.client.post(
            "/v1/chat/completions", json=body(conversation_id="new"), headers={"Authorization": f"Bearer {key}"}
        )
        assert refused.status_code == 401 and not local.store.list_conversations(LOCAL_OWNER)
    ok = local.client.post("/v1/chat/completions", json=body(conversation_id="new"))  # the rig sends the local key
    assert ok.status_code == 200 and local.store.list_conversations(LOCAL_OWNER)
    local.engine.close()


def test_a_full_queue_is_a_429_with_retry_after(tmp_path):
    r = rig(tmp_path, queue_size=1, queue_per_user=1)
    r.runner.token_delay_s = 0.05
    long = GenerationRequest(prompt_ids=[1, 2, 3], max_new_tokens=20, owner=LOCAL_OWNER)
    r.runner.enqueue(list(range(100, 120)))
    running = r.engine.submit(long)
    assert r.runner.running.wait(5)
    waiting = r.engine.submit(long)
    try:
        resp = r.client.post("/v1/chat/completions", json=body())
        assert resp.status_code == 429 and resp.headers["retry-after"].isdigit()
        assert resp.json()["error"]["type"] == "rate_limit_error"
    finally:
        running.cancel()
        waiting.cancel()
        r.engine.close()


def test_an_api_request_joins_the_batch_of_a_running_ui_request(tmp_path):
    r = rig(tmp_path, max_batch=4)
    r.runner.token_delay_s = 0.02
    r.runner.enqueue(list(range(100, 120)))
    ui = r.engine.submit(GenerationRequest(prompt_ids=[1, 2, 3], max_new_tokens=20, owner="ui-visitor"))
    try:
        assert r.runner.running.wait(5)
        say(r, "Paris is the capital")
        resp = r.client.post("/v1/chat/completions", json=body())
        assert resp.status_code == 200 and resp.json()["choices"][0]["message"]["content"] == "Paris is the capital"
        assert ui.stats is None, "the API reply came while the UI's request was still running"
        assert 2 in r.runner.batch_sizes, "the two shared decode steps"
    finally:
        ui.cancel()
        r.engine.close()


def test_citations_are_in_the_extension_object(tmp_path):
    r = rig(tmp_path, library=FakeLibrary())
    try:
        say(r, "Paris [1]")
        d = r.client.post("/v1/chat/completions", json=body(use_docs=True)).json()
        (source,) = d["x_llmweb"]["sources"]
        assert source["n"] == 1 and source["source"] == "geography.md" and "Paris" in source["snippet"]
        assert source["doc_id"] == "g", "its place, to open it (GET /v1/x_llmweb/passage)"
        assert d["x_llmweb"]["sections"]["retrieved"] > 0
        say(r, "no sources")
        d = r.client.post("/v1/chat/completions", json=body()).json()
        assert d["x_llmweb"]["sources"] == [], "stateless: documents only on request"
        say(r, "sources by default")
        d = r.client.post("/v1/chat/completions", json=body(conversation_id="new")).json()
        assert len(d["x_llmweb"]["sources"]) == 1, "stateful: documents on by default"
    finally:
        r.engine.close()


def test_a_cited_passage_opens_for_its_key_only(tmp_path):
    """GET /v1/x_llmweb/passage: alice's upload opens for alice's key by the place a citation gives;
    bob's key gets the same 404 as for a place that does not exist; a recalled turn opens within its
    conversation only."""
    from llmweb.retrieval.library import Library
    from tests.chat.test_passages import LETTER, WordEmbedder

    keys = "alice:key-of-alice,bob:key-of-bob"
    s = make_settings(tmp_path, host="0.0.0.0", api_keys=keys, chunk_tokens=30, chunk_overlap=4)
    r = rig(tmp_path, library=Library(s, WordEmbedder()), host="0.0.0.0", api_keys=keys)
    alice, bob = ({"Authorization": f"Bearer key-of-{who}"} for who in ("alice", "bob"))
    try:
        path = tmp_path / "letter.md"
        path.write_text(LETTER)
        [report] = r.chat.library.ingest_uploads("user:alice", [(path, "rover.md")])
        chunk = r.chat.library.chunks("user:alice", report.doc_id)[2]
        place = {"doc_id": chunk.doc_id, "start": chunk.start, "end": chunk.end}
        got = r.client.get("/v1/x_llmweb/passage", params=place, headers=alice)
        assert got.status_code == 200 and got.json()["text"] == chunk.text and got.json()["before"]["text"]
        theirs = r.client.get("/v1/x_llmweb/passage", params=place, headers=bob)
        nowhere = r.client.get("/v1/x_llmweb/passage", params={**place, "doc_id": "f" * 32}, headers=alice)
        assert theirs.status_code == nowhere.status_code == 404 and theirs.json() == nowhere.json()
        assert "rock samples" not in theirs.text
        for bad_query in ({**place, "start": "-1"}, {"start": 1}, {**place, "kind": "x"}, {**place, "x": 1}):
            assert r.client.get("/v1/x_llmweb/passage", params=bad_query, headers=alice).status_code == 400

        say(r, "Noted")
        conv = r.client.post("/v1/chat/completions", json=body(conversation_id="new"), headers=alice).json()
        recall = {"kind": "recall", "doc_id": "turn-0", "conversation_id": conv["x_llmweb"]["conversation_id"]}
        turn = r.client.get("/v1/x_llmweb/passage", params=recall, headers=alice).json()
        assert turn["text"] == "User: hi\nAssistant: Noted"
        assert r.client.get("/v1/x_llmweb/passage", params=recall, headers=bob).status_code == 404
    finally:
        r.engine.close()
        r.store.close()


def test_a_client_that_leaves_a_stream_cancels_its_request(api):
    api.runner.token_delay_s = 0.05
    api.runner.enqueue(list(range(100, 300)))
    handles = []
    submit = api.engine.submit

    def spy(request):
        h = submit(request)
        handles.append(h)
        return h

    api.chat.engine.submit = spy
    done = threading.Event()

    def read_a_little():
        with api.client.stream("POST", "/v1/chat/completions", json=body(stream=True, conversation_id="new")) as r:
            for line in r.iter_lines():
                if '"content":"' in line and '"content":""' not in line:
                    break
        done.set()

    threading.Thread(target=read_a_little, daemon=True).start()
    assert done.wait(10)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not (handles and handles[0].stats):
        time.sleep(0.05)
    assert handles and handles[0].cancelled and handles[0].stats.finish_reason == "cancelled"
    assert handles[0].stats.generated_tokens < 50
