"""The remote engine against a scripted OpenAI-compatible server (tests/fake_openai.py, a real HTTP
server in a thread): the same scheduler and events as the local engine, the wire format, and the
faults. Fast: no model; each test well under a second."""

from __future__ import annotations

import dataclasses
import time

import pytest

from llmweb.engine.remote import remote_engine
from llmweb.engine.request import EngineLimits, GenerationRequest, Restarted, Tokens
from llmweb.engine.server import RemoteConfig, RemoteError, Server, SlotTable
from llmweb.errors import BusyError, LlmwebError
from tests.fake_openai import FakeOpenAI, decode, encode
from tests.fakes import frozen_pace

PROMPT = encode("<|user|>Hi<|assistant|>")


def req(prompt=PROMPT, n=64, **kw) -> GenerationRequest:
    return GenerationRequest(prompt_ids=list(prompt), max_new_tokens=n, **kw)


@pytest.fixture
def make():
    """make(server knobs..., engine=dict(limits), config=dict(RemoteConfig fields)) -> (engine, server, sleeps)."""
    made = []

    def _make(reply="Hello there.", engine=None, config=None, **knobs):
        server = FakeOpenAI(reply, **knobs)
        sleeps: list[float] = []
        cfg = RemoteConfig(url=server.url + "/v1", **({"read_timeout_s": 5.0} | (config or {})))
        e = remote_engine(cfg, encode, decode, EngineLimits(**(engine or {})), sleep=sleeps.append)
        made.append((e, server))
        return e, server, sleeps

    yield _make
    for e, server in made:
        e.close()
        server.close()


def test_token_ids_go_as_the_prompt_and_the_reply_streams_back_as_ids(make):
    e, server, _ = make(sends_ids=True)
    h = e.submit(req(session_id="conv-1", owner="alice"))
    assert decode(h.result()) == "Hello there."
    body, headers = server.completions[0]
    assert body["prompt"] == PROMPT and body["stream"] is True and body["max_tokens"] == 64
    assert body["return_token_ids"] is True and body["add_special_tokens"] is False
    assert h.stats.finish_reason == "eos" and h.stats.generated_tokens == len("Hello there.")
    assert h.stats.ttft_s > 0 and h.stats.mem is not None and h.stats.mem.cuda_allocated_bytes is None


def test_the_servers_cached_tokens_are_the_reused_tokens(make):
    e, server, _ = make()
    first = e.submit(req(session_id="conv-1"))
    first.result()
    assert first.stats.reuse_reported and first.stats.reused_tokens == 0
    longer = PROMPT + encode("Hello there.<|user|>More")
    second = e.submit(req(longer, session_id="conv-1"))
    second.result()
    assert second.stats.reused_tokens == len(PROMPT) and second.stats.reuse_reported
    assert second.stats.prefilled_tokens == len(longer) - len(PROMPT)


def test_a_server_that_does_not_report_its_cache_is_not_reported_as_zero_reuse(make):
    e, _, _ = make(report_cache=False)
    h = e.submit(req(session_id="c"))
    h.result()
    assert h.stats.reuse_reported is False and h.stats.prefilled_tokens == len(PROMPT)


def test_a_server_that_gives_logprobs_passes_them_through_with_its_ids(make):
    e, server, _ = make(logprobs=True)
    assert e.runner.logprobs is True, "probed at start with the other fields"
    h = e.submit(req(logprobs=2))
    assert decode(h.result()) == "Hello there."
    assert server.completions[-1][0]["logprobs"] == 2
    assert [(t.id, t.logprob) for t in h.logprobs] == [(ord(c), -0.25) for c in "Hello there."]
    assert h.logprobs[0].top == ((ord("H"), -0.25), (ord("H") + 1, -1.25))
    plain = e.submit(req())
    plain.result()
    assert "logprobs" not in server.completions[-1][0] and plain.logprobs == []


def test_a_server_without_logprobs_says_so(make):
    e, _, _ = make()
    assert e.runner.logprobs is False


def test_a_server_that_refuses_ids_and_extra_fields_gets_text_and_plain_openai(make):
    e, server, _ = make(takes_ids=False, strict=True)
    h = e.submit(req(session_id="conv-1", owner="alice", repetition_penalty=1.2))
    assert decode(h.result()) == "Hello there."
    body, _ = server.completions[0]
    assert body["prompt"] == decode(PROMPT)
    assert "cache_salt" not in body and "repetition_penalty" not in body
    e.submit(req()).result()
    assert len(server.requests) == 3 + 2, "the server was probed once (ids, extras, logprobs), then two requests"


def test_routing_key_per_conversation_and_cache_salt_per_owner(make):
    e, server, _ = make()
    for conv, owner in (("c1", "alice"), ("c1", "alice"), ("c2", "alice"), ("c3", "bob")):
        e.submit(req(session_id=conv, owner=owner)).result()
    bodies = [b for b, _ in server.completions]
    headers = [h for _, h in server.completions]
    assert bodies[0]["user"] == bodies[1]["user"] != bodies[2]["user"]
    assert headers[0]["X-Session-Id"] == bodies[0]["user"] and "c1" not in bodies[0]["user"]
    assert bodies[0]["cache_salt"] == bodies[2]["cache_salt"] != bodies[3]["cache_salt"]


def test_429_is_retried_with_backoff_then_succeeds(make):
    e, server, sleeps = make(statuses=[429, 503])
    h = e.submit(req())
    assert decode(h.result()) == "Hello there."
    assert sleeps == [0.5, 1.0] and len(server.completions) == 3


def test_5xx_that_persists_ends_with_a_clear_error_after_bounded_retries(make):
    e, server, sleeps = make(statuses=[503] * 10, config={"retries": 2})
    h = e.submit(req())
    with pytest.raises(RemoteError, match="HTTP 503: try later"):
        h.result()
    assert len(server.completions) == 3 and sleeps == [0.5, 1.0]


def test_maximum_context_length_retries_once_with_the_smaller_fallback(make):
    e, server, _ = make(context=len(PROMPT) + 5)
    small = req(PROMPT[-10:])
    h = e.submit(req(PROMPT + encode("x" * 50), fallback=lambda: small))
    events = list(h.events())
    assert isinstance(events[0], Restarted) and events[0].reason == "context_length"
    assert decode(h.generated) == "Hello there." and all(isinstance(ev, Tokens) for ev in events[1:])
    assert h.stats.oom_retry is False, "a context-length retry is not an out-of-memory one"
    assert [len(b["prompt"]) for b, _ in server.completions] == [len(PROMPT) + 50, 10]


def test_maximum_context_length_without_a_fallback_says_so(make):
    e, _, _ = make(context=5)
    with pytest.raises(LlmwebError, match="longer than its context.*maximum context length is 5"):
        e.submit(req()).result()


def test_a_connection_lost_mid_stream_keeps_the_partial_reply_and_says_so(make):
    e, _, _ = make(cut_after=2)
    h = e.submit(req())
    with pytest.raises(RemoteError, match="lost mid-reply; the reply so far is kept"):
        h.result()
    assert decode(h.generated) == "Hello "
    assert h.stats is not None and h.stats.finish_reason == "error"


def test_a_silent_server_times_out_with_a_clear_error(make):
    e, _, _ = make(stall_s=1.0, config={"read_timeout_s": 0.2})
    with pytest.raises(RemoteError, match="sent nothing for"):
        e.submit(req()).result()


def test_the_request_time_limit_stops_the_stream(make):
    e, server, _ = make(reply="x" * 900, delay_s=0.02)  # 300 events: 6 s
    e.submit(req(n=3)).result()  # the server is probed first, outside the timed request
    h = e.submit(req(n=900, timeout_s=1.0))
    with pytest.raises(LlmwebError, match="time limit"):
        h.result()
    assert 0 < len(h.generated) < 900
    _wait(lambda: server.gone == 1)


def test_cancel_closes_the_stream_and_the_server_sees_the_client_go(make):
    e, server, _ = make(reply="y" * 300, delay_s=0.02)
    h = e.submit(req(n=300))
    for ev in h.events():
        if isinstance(ev, Tokens) and len(h.generated) >= 6:
            h.cancel()
    assert h.stats.finish_reason == "cancelled" and len(h.generated) < 300
    _wait(lambda: server.gone == 1)


def test_a_server_down_is_retried_then_reported_as_unreachable(make):
    e, server, sleeps = make(config={"retries": 2})
    server.close()
    with pytest.raises(RemoteError, match="not reachable"):
        e.submit(req()).result()
    assert sleeps == [0.5, 1.0]


def test_the_in_flight_cap_holds_and_the_queue_is_the_engines(make):
    e, server, _ = make(reply="z" * 60, delay_s=0.05, engine={"max_batch": 2, "max_wait_s": 64.9, "queue_per_user": 1})
    e.pace = frozen_pace(step_s=1.0)  # 64 s per request: c and d wait at most 64 s, e at least 65 s
    handles = [e.submit(req(owner=o)) for o in "ab"]
    _wait(lambda: server.in_flight == 2)
    handles += [e.submit(req(owner=o)) for o in "cd"]  # they wait in the engine's queue
    with pytest.raises(BusyError, match=r"about \d+ s of work is waiting, over this server's limit of 65 s"):
        e.submit(req(owner="e"))
    assert [h.position for h in handles] == [0, 0, 1, 2]
    for h in handles:
        assert decode(h.result()) == "z" * 60
    assert server.max_in_flight == 2
    assert max(h.stats.batch_size for h in handles) == 2


def test_the_length_cap_ends_the_reply_as_length(make):
    e, _, _ = make()
    h = e.submit(dataclasses.replace(req(), max_new_tokens=4))
    assert decode(h.result()) == "Hell"
    assert h.stats.finish_reason == "length"


def _wait(cond, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


# ---- the app's wiring: LLMWEB_ENGINE_URL (the real tokenizer, no weights)


@pytest.fixture
def remote_settings(tmp_path):
    from tests.conftest import make_settings

    def _settings(url: str, **kw):
        return make_settings(tmp_path, engine_url=url, engine_concurrency=2, request_timeout_s=10.0, **kw)

    return _settings


def test_runtime_with_an_engine_url_chats_through_the_server_without_loading_weights(remote_settings):
    from llmweb.runtime import Runtime

    server = FakeOpenAI("Hi! I am remote.")
    rt = Runtime(remote_settings(server.url)).start(background=False)
    try:
        assert rt.loaded is None, "no model weights in this process"
        assert "remote engine" in rt.status and "fake-model" in rt.status
        assert "reachable · token-id prompts" in rt.status, "probed at start"
        first = rt.wait_ready().ask("local", None, "Hello, who are you?")
        assert first.reply == "Hi! I am remote." and first.stats.gen.reuse_reported
        second = rt.wait_ready().ask("local", first.conv_id, "And again?")
        body, headers = server.completions[-1]
        assert isinstance(body["prompt"], list) and body["user"] == server.completions[0][0]["user"]
        assert second.stats.gen.reused_tokens > 0, "the server's cached tokens came back as reused"
        assert rt.engine is not None and rt.engine.limits.max_batch == 2
    finally:
        rt.close()
        server.close()


def test_runtime_comes_up_with_the_server_down_and_says_so(remote_settings, monkeypatch):
    from llmweb import runtime as runtime_mod
    from llmweb.runtime import Runtime

    server = FakeOpenAI()
    url = server.url
    server.close()
    monkeypatch.setattr(runtime_mod, "REMOTE_RETRY_S", 0.05)
    rt = Runtime(remote_settings(url)).start(background=False)
    try:
        assert rt.ready and "not reachable" in rt.status and "retrying" in rt.status
        back = FakeOpenAI("Back.", port=int(url.rsplit(":", 1)[1]))  # the server comes back
        try:
            _wait(lambda: "reachable ·" in rt.status)
            assert rt.wait_ready().ask("local", None, "Hello?").reply == "Back."
        finally:
            back.close()
    finally:
        rt.close()


def test_bench_ttft_with_an_engine_url_runs_one_mode_through_the_server(remote_settings):
    from llmweb.bench import ttft

    server = FakeOpenAI("Fine.")
    try:
        r = ttft.run(remote_settings(server.url, max_new_tokens=8), None, 6)
    finally:
        server.close()
    assert list(r["modes"]) == ["reuse"] and r["model"] == "fake-model" and r["device"] == server.url
    m = r["modes"]["reuse"]
    assert len(m["ttft_s"]) == 6 and all(t > 0 for t in m["ttft_s"])
    assert all(isinstance(u, int) for u in m["reused_tokens"][1:]) and m["reused_tokens"][-1] > 0
    assert "fake-model" in ttft.markdown(r)


def test_owners_take_turns_in_the_engines_fair_queue_before_the_server_sees_them(make):
    e, server, _ = make(reply="w" * 60, delay_s=0.05, engine={"max_batch": 1, "queue_per_user": 2})
    first = e.submit(req(session_id="a0", owner="alice"))
    _wait(lambda: server.in_flight == 1)
    later = [e.submit(req(session_id=s, owner=o)) for s, o in (("a1", "alice"), ("a2", "alice"), ("b1", "bob"))]
    for h in [first, *later]:
        h.result()
    from llmweb.engine.remote import _hashed

    order = {_hashed(s): s for s in ("a0", "a1", "a2", "b1")}
    assert [order[b["user"]] for b, _ in server.completions] == ["a0", "b1", "a1", "a2"]


def test_the_replys_own_token_ids_win_over_its_text_when_the_server_sends_them():
    from llmweb.engine.remote import RemoteRunner, _Call
    from llmweb.engine.server import Server

    runner = RemoteRunner(Server(RemoteConfig(url="http://127.0.0.1:1")), encode, decode)
    call = _Call()
    assert runner._chunk(call, {"choices": [{"text": "\n\n", "token_ids": [198]}]}) is False
    assert runner._chunk(call, {"choices": [{"text": "ab"}]}) is False  # no ids: our tokenizer's
    done = {"choices": [{"text": "", "finish_reason": "length"}], "timings": {"cache_n": 7}}
    assert runner._chunk(call, done) is True  # llama.cpp's cache count
    assert [ids for ids, _, _ in call.events] == [[198], encode("ab")]
    assert call.finish == "length" and call.cached == 7


# ---- llama.cpp's server: its last event after a stop token, and its slots


def test_a_reply_that_ends_on_a_stop_id_still_reads_the_servers_cached_tokens(make):
    """llama.cpp streams the end-of-sequence token's text, then the last event with the usage: the
    slot ends on the stop id first, and must read on to the usage (it was dropped before)."""
    e, server, _ = make(eos="¶", last_delay_s=0.05)
    stop = frozenset(encode("¶"))
    first = e.submit(req(session_id="conv-1", stop_ids=stop))
    assert decode(first.result()) == "Hello there." and first.stats.finish_reason == "eos"
    assert first.stats.reuse_reported and first.stats.reused_tokens == 0
    longer = PROMPT + encode("Hello there.<|user|>More")
    second = e.submit(req(longer, session_id="conv-1", stop_ids=stop))
    second.result()
    assert second.stats.reuse_reported and second.stats.reused_tokens == len(PROMPT)  # the fake caches prompts
    assert second.stats.prefilled_tokens == len(longer) - second.stats.reused_tokens
    assert server.gone == 0, "the stream was read to its end, not cut"


def test_a_cancel_still_closes_the_stream_at_once(make):
    e, server, _ = make(reply="word " * 200, delay_s=0.01, eos="¶", last_delay_s=5.0)
    h = e.submit(req(n=400, stop_ids=frozenset(encode("¶"))))
    t0 = time.perf_counter()
    for ev in h.events():
        if isinstance(ev, Tokens):
            h.cancel()
    assert h.stats.finish_reason == "cancelled" and time.perf_counter() - t0 < 3.0


def test_each_conversation_keeps_its_llama_cpp_slot(make):
    e, server, _ = make(llama_slots=2, eos="¶")
    stop = frozenset(encode("¶"))
    history = {c: PROMPT + encode(f"{c} asks") for c in ("conv-a", "conv-b")}
    slots: dict[str, set[int]] = {"conv-a": set(), "conv-b": set()}
    for turn in range(3):
        for conv in history:
            h = e.submit(req(history[conv], session_id=conv, stop_ids=stop))
            reply = h.result()
            slots[conv].add(server.completions[-1][0]["id_slot"])
            if turn:  # the slot's cache is this conversation's last prompt (the fake caches prompts)
                assert h.stats.reused_tokens == len(history[conv]) - len(reply) - len(encode("<|user|>next"))
            history[conv] = history[conv] + list(reply) + encode("<|user|>next")
    assert all(len(s) == 1 for s in slots.values()) and slots["conv-a"] != slots["conv-b"]


def test_a_server_without_slots_gets_no_id_slot(make):
    e, server, _ = make()
    e.submit(req(session_id="conv-1")).result()
    assert "id_slot" not in server.completions[0][0]


def test_the_slot_table_keeps_homes_and_never_hands_out_a_busy_slot():
    t = SlotTable(2)
    a = t.take("a")
    b = t.take("b")
    assert {a, b} == {0, 1}
    assert t.take("c") == -1, "every slot is busy: the server chooses"
    t.give(a)
    t.give(b)
    assert t.take("a") == a and t.take("b") == b, "each conversation goes home"
    t.give(a)
    assert t.take("c") == a and "a" not in t.home, "a newcomer takes the free slot; its old owner loses it"
    t.give(a)
    t.give(b)
    assert t.take(None) in (0, 1)


def test_the_servers_own_context_is_read_where_it_says_it():
    llama_cpp = FakeOpenAI(llama_slots=4, context=2048)  # llama.cpp: n_ctx per slot in /props
    plain = FakeOpenAI()
    try:
        assert Server(RemoteConfig(url=llama_cpp.url)).context_length() == 2048
        assert Server(RemoteConfig(url=plain.url)).context_length() is None
        assert Server(RemoteConfig(url="http://127.0.0.1:9", connect_timeout_s=0.5)).context_length() is None
    finally:
        llama_cpp.close()
        plain.close()


# ---- constrained replies: the server's own field, or a refusal


def test_a_constraint_goes_as_llama_cpps_json_schema_or_vllms_structured_outputs(make):
    from llmweb.engine.constraint import json_schema

    c = json_schema({"type": "object", "properties": {"a": {"type": "integer"}}}, "response_format")
    e, server, _ = make(llama_slots=2)
    e.submit(req(constraint=c)).result()
    assert server.completions[0][0]["json_schema"] == {"type": "object", "properties": {"a": {"type": "integer"}}}
    e, server, _ = make(sends_ids=True)
    e.submit(req(constraint=c)).result()
    assert server.completions[0][0]["structured_outputs"] == {
        "json": {"type": "object", "properties": {"a": {"type": "integer"}}}
    }


def test_a_server_without_a_constraint_field_refuses_the_request_clearly(make):
    from llmweb.engine.constraint import json_object
    from llmweb.errors import InputError

    e, server, _ = make(takes_ids=False, strict=True)
    with pytest.raises(InputError, match="cannot constrain"):
        e.submit(req(constraint=json_object())).result()
    assert not server.completions, "nothing unconstrained was asked"
