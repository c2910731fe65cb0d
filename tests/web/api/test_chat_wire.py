"""Chat completions' wire format without a server: request checks and stop strings (web/api/chat_wire.py)."""

from __future__ import annotations

import pytest

from llmweb.web.api.chat_wire import StopScanner, parse_request
from llmweb.web.api.errors import ApiError
from tests.web.api.conftest import body

# ---- the request


def refusal(b, headers=None) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse_request(b, ["llmweb"], 1000, headers)
    return info.value


@pytest.mark.parametrize(
    "b, status, param",
    [
        (body(n=2), 400, "n"),
        (body(tools=[{"name": "f"}]), 400, "tools[0]"),
        (body(logprobs=True, top_logprobs=30), 400, "top_logprobs"),
        (body(response_format={"type": "xml"}), 400, "response_format"),
        (body(frobnicate=1), 400, "frobnicate"),
        (body(model="gpt-4o"), 404, "model"),
        ({"messages": [{"role": "user", "content": "hi"}]}, 400, "model"),
        (body(messages=[]), 400, "messages"),
        (body(messages=[{"role": "wizard", "content": "hi"}]), 400, "messages[0].role"),
        (body(messages=[{"role": "tool", "content": "hi", "tool_call_id": "x"}]), 400, "messages[0].tool_call_id"),
        (body(messages=[{"role": "function", "content": "hi"}]), 400, "messages[0].role"),
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
