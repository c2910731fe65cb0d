"""API keys (web/api/keys.py) and whom they make the caller (web/identity.py's `ApiCallers`)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from llmweb.config import Settings
from llmweb.errors import ConfigError
from llmweb.records import LOCAL_OWNER
from llmweb.web.api.keys import ApiKeys, parse_api_keys
from tests.conftest import make_settings
from tests.web.api.conftest import body, rig, say


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
