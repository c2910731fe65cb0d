"""`x_llmweb.turns` on the stateful API: keep a turn in context or leave it out before this turn."""

from __future__ import annotations

from dataclasses import replace

from llmweb.records import LOCAL_OWNER, OUT, PIN
from tests.web.api.conftest import body, rig, say


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


def test_a_turns_list_refused_partway_changes_no_turn(api):
    conv = ask(api, "new", "first").json()["x_llmweb"]["conversation_id"]
    ask(api, conv, "second")
    r = ask(api, conv, "x", turns=[{"turn": 1, "view": "keep"}, {"turn": 9, "view": "leave_out"}])
    assert r.status_code == 400 and "no longer in this chat" in r.json()["error"]["message"]
    assert [t.view for t in api.store.get(LOCAL_OWNER, conv).turns] == ["", ""], "all or none"


# ---- memory across chats and "continue in a new chat" through the API


def test_the_stateful_api_uses_the_owners_memory_and_the_stateless_one_only_when_asked(api):
    api.chat.budget = replace(api.chat.budget, memory_tokens=40)  # the rig's budget has none
    api.store.add_memory(LOCAL_OWNER, "My cat is called Quokka.")
    assert ask(api, "new", "hello").status_code == 200
    assert "Quokka" in api.fmt.decode(api.runner.requests[-1].prompt_ids)
    say(api, "ok")
    assert api.client.post("/v1/chat/completions", json=body()).status_code == 200
    assert "Quokka" not in api.fmt.decode(api.runner.requests[-1].prompt_ids)
    say(api, "ok")
    asked = api.client.post("/v1/chat/completions", json=body(x_llmweb={"memory": True}))
    assert asked.status_code == 200 and "Quokka" in api.fmt.decode(api.runner.requests[-1].prompt_ids)


def test_continue_from_starts_a_new_conversation_linked_to_the_callers_one(api):
    conv = ask(api, "new", "My locker code is 4471.").json()["x_llmweb"]["conversation_id"]
    ask(api, conv, "second")
    r = ask(api, "new", "where were we?", continue_from=conv)
    assert r.status_code == 200, r.text
    new = r.json()["x_llmweb"]["conversation_id"]
    got = api.store.get(LOCAL_OWNER, new)
    assert new != conv and got.continues[0] == conv and len(got.turns) == 3
    assert "4471" in api.fmt.decode(api.runner.requests[-1].prompt_ids)
    assert api.runner.requests[-1].session_id == new, "its own KV cache session"
    gone = ask(api, "new", "x", continue_from="f" * 32)
    assert gone.status_code == 404
    not_new = ask(api, conv, "x", continue_from=conv)
    assert not_new.status_code == 400 and not_new.json()["error"]["param"] == "x_llmweb.continue_from"


def test_two_api_keys_never_reach_each_others_memories_turns_or_chats_to_continue(tmp_path):
    """alice's memory is in alice's stateful prompts, not bob's; bob can neither keep nor leave out
    alice's turns nor continue her chat (404, nothing made or changed)."""
    keyed = rig(tmp_path, host="0.0.0.0", api_keys="alice:key-of-alice,bob:key-of-bob")
    keyed.chat.budget = replace(keyed.chat.budget, memory_tokens=40)
    alice, bob = ({"Authorization": f"Bearer key-of-{n}"} for n in ("alice", "bob"))

    def post(headers, conv, text, **ours):
        say(keyed, "ok")
        extra = {"x_llmweb": ours} if ours else {}
        msgs = [{"role": "user", "content": text}]
        return keyed.client.post(
            "/v1/chat/completions", json=body(conversation_id=conv, messages=msgs, **extra), headers=headers
        )

    try:
        keyed.store.add_memory("user:alice", "My cat is called Quokka.")
        conv = post(alice, "new", "first words").json()["x_llmweb"]["conversation_id"]
        assert "Quokka" in keyed.fmt.decode(keyed.runner.requests[-1].prompt_ids)
        assert post(bob, "new", "hello").status_code == 200
        assert "Quokka" not in keyed.fmt.decode(keyed.runner.requests[-1].prompt_ids)
        bobs = {c.id for c in keyed.store.list_conversations("user:bob")}
        for ours in ({"turns": [{"turn": 1, "view": "leave_out"}]}, {}):
            assert post(bob, conv, "mine now", **ours).status_code == 404, ours
        assert post(bob, "new", "go on", continue_from=conv).status_code == 404
        assert {c.id for c in keyed.store.list_conversations("user:bob")} == bobs, "bob continued nothing"
        assert [t.view for t in keyed.store.get("user:alice", conv).turns] == [""]
        assert [c.id for c in keyed.store.list_conversations("user:alice")] == [conv]
    finally:
        keyed.engine.close()
        keyed.store.close()
