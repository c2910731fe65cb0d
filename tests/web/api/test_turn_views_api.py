"""`x_llmweb.turns` on the stateful API: keep a turn in context or leave it out before this turn."""

from __future__ import annotations

from llmweb.records import LOCAL_OWNER, OUT, PIN
from tests.web.api.conftest import body, say


def ask(api, conv, text, **ours):
    extra = {"x_llmweb": ours} if ours else {}
    say(api, "ok")
    return api.client.post(
        "/v1/chat/completions", json=body(conversation_id=conv, messages=[{"role": "user", "content": text}], **extra)
    )


def test_a_stateful_request_keeps_and_leaves_out_turns_before_it_is_planned(api):
    conv = ask(api, "new", "first words").json()["x_llmweb"]["conversation_id"]
    ask(api, conv, "second words")
    r = ask(api, conv, "third", turns=[{"turn": 1, "view": "keep"}, {"turn": 2, "view": "leave_out"}])
    assert r.status_code == 200, r.text
    assert [t.view for t in api.store.get(LOCAL_OWNER, conv).turns] == [PIN, OUT, ""]
    prompt = api.fmt.decode(api.runner.requests[-1].prompt_ids)
    assert "first words" in prompt and "second words" not in prompt
    ask(api, conv, "fourth", turns=[{"turn": 2, "view": "as_planned"}])
    assert "second words" in api.fmt.decode(api.runner.requests[-1].prompt_ids)


def test_bad_turn_entries_and_stateless_requests_are_refused(api):
    conv = ask(api, "new", "first").json()["x_llmweb"]["conversation_id"]
    for wrong in ([{"turn": 0, "view": "keep"}], [{"turn": 1, "view": "pin"}], [{"turn": True, "view": "keep"}], {}):
        r = ask(api, conv, "x", turns=wrong)
        assert r.status_code == 400 and r.json()["error"]["param"] == "x_llmweb.turns", (wrong, r.text)
    missing = ask(api, conv, "x", turns=[{"turn": 9, "view": "keep"}])
    assert missing.status_code == 400 and "no longer in this chat" in missing.json()["error"]["message"]
    say(api, "ok")
    stateless = api.client.post("/v1/chat/completions", json=body(x_llmweb={"turns": [{"turn": 1, "view": "keep"}]}))
    assert stateless.status_code == 400
    assert [t.view for t in api.store.get(LOCAL_OWNER, conv).turns] == [""]
