"""Accounts: scrypt hashes, the users file, LLMWEB_AUTH pairs, the `user` CLI, and no password in logs.

Fast: no model. scrypt runs at a tiny cost (n=16) except in the one test that checks the real
parameters, so the whole file takes about a second.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import inspect
import io
import json
import logging
import os
import stat

import pytest

from llmweb.cli import user as user_cli_mod
from llmweb.config import Settings
from llmweb.errors import ConfigError, InputError, LlmwebError
from llmweb.web import accounts, throttle
from llmweb.web.accounts import Accounts, Scrypt, gradio_auth, load_users, new_record, save_users

SECRET = "Tr0ub4dor&3-horse"  # distinctive, so a leak anywhere is easy to spot
OTHER = "correct-battery-staple"


@pytest.fixture(autouse=True)
def cheap_scrypt(monkeypatch):
    monkeypatch.setattr(accounts, "DEFAULT_SCRYPT", Scrypt(n=16, r=1, p=1))


@pytest.fixture
def users_path(tmp_path):
    return tmp_path / "auth" / "users.json"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="llmweb")
    user_cli_mod.add_parser(p.add_subparsers(dest="command"))
    return p


def user_cli(argv, settings, monkeypatch, password: str | None = None) -> int:
    """What cli.main will do: parse, then call the command (here with explicit Settings)."""
    if password is not None:
        monkeypatch.setattr("sys.stdin", io.StringIO(password + "\n"))
    args = parser().parse_args(["user", *argv])
    return args.func(args, settings=settings)


def add(path, name, password):
    users = load_users(path)
    users[name] = new_record(name, password)
    save_users(path, users)


# ---- hashing and verification


def test_right_password_passes_and_wrong_password_or_unknown_user_fails(users_path):
    add(users_path, "alice", SECRET)
    acc = Accounts(users_file=users_path)
    assert acc.verify("alice", SECRET)
    assert not acc.verify("alice", OTHER)
    assert not acc.verify("alice", SECRET + " ")
    assert not acc.verify("alice", "")
    assert not acc.verify("mallory", SECRET)
    assert not acc.verify("not a valid name!", SECRET)
    assert not acc.verify(None, SECRET) and not acc.verify("alice", None)


def test_equal_passwords_get_their_own_salt_and_so_different_hashes(users_path):
    add(users_path, "alice", SECRET)
    add(users_path, "bob", SECRET)
    doc = json.loads(users_path.read_text())
    a, b = doc["users"]["alice"], doc["users"]["bob"]
    assert a["salt"] != b["salt"] and a["hash"] != b["hash"]
    assert len(bytes.fromhex(a["salt"])) == 16
    acc = Accounts(users_file=users_path)
    assert acc.verify("alice", SECRET) and acc.verify("bob", SECRET)


def test_new_records_use_scrypt_n_2_14_r_8_p_1_with_a_32_byte_key(users_path, monkeypatch):
    monkeypatch.setattr(accounts, "DEFAULT_SCRYPT", Scrypt())
    add(users_path, "alice", SECRET)
    doc = json.loads(users_path.read_text())
    assert (doc["format"], doc["version"]) == ("llmweb.users", 1)
    entry = doc["users"]["alice"]
    assert (entry["n"], entry["r"], entry["p"]) == (2**14, 8, 1)
    assert len(bytes.fromhex(entry["hash"])) == 32 and entry["created"] > 0
    assert SECRET not in users_path.read_text()
    assert load_users(users_path)["alice"].matches(SECRET)


def test_unknown_and_invalid_names_cost_one_hash_like_real_users(users_path, monkeypatch):
    add(users_path, "alice", SECRET)
    acc = Accounts({"carol": "pw"}, users_file=users_path)
    calls = []
    real = Scrypt.hash
    monkeypatch.setattr(Scrypt, "hash", lambda self, pw, salt: calls.append(1) or real(self, pw, salt))
    for name, pw in [
        ("alice", SECRET),
        ("alice", OTHER),
        ("carol", "pw"),
        ("mallory", SECRET),
        ("bad name", SECRET),
        ("x" * 500, SECRET),
    ]:
        calls.clear()
        acc.verify(name, pw)
        assert len(calls) == 1, name[:20]


# ---- the users file


def test_users_file_is_mode_600_and_the_atomic_write_leaves_no_temp_files(users_path):
    add(users_path, "alice", SECRET)
    add(users_path, "bob", OTHER)
    assert stat.S_IMODE(os.stat(users_path).st_mode) == 0o600
    assert sorted(p.name for p in users_path.parent.iterdir()) == ["users.json"]


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temp_files(users_path, monkeypatch):
    add(users_path, "alice", SECRET)
    before = users_path.read_bytes()

    def boom(*a):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError):
        add(users_path, "bob", OTHER)
    assert users_path.read_bytes() == before
    assert sorted(p.name for p in users_path.parent.iterdir()) == ["users.json"]


def test_the_server_sees_users_added_and_removed_by_another_process(users_path, settings, monkeypatch, capsys):
    add(users_path, "alice", SECRET)
    server = Accounts.from_settings(settings.replace(auth_file=users_path))
    assert not server.verify("bob", OTHER)
    # the CLI runs as another process would: its own reads and writes, nothing shared in memory
    assert user_cli(["add", "bob", "--password-stdin", "--file", str(users_path)], settings, monkeypatch, OTHER) == 0
    assert server.verify("bob", OTHER)
    assert user_cli(["remove", "alice", "--file", str(users_path)], settings, monkeypatch) == 0
    assert not server.verify("alice", SECRET)
    assert server.names() == ["bob"]


def test_a_users_file_that_does_not_exist_yet_is_empty_until_a_user_is_added(users_path):
    acc = Accounts(users_file=users_path)
    assert acc.names() == [] and not acc.verify("alice", SECRET)
    add(users_path, "alice", SECRET)
    assert acc.verify("alice", SECRET)


@pytest.mark.parametrize(
    "content",
    [
        b"not json at all",
        b"\x80\x04\x95pickle\x94.",
        b"[]",
        b'{"format": "something.else", "version": 1, "users": {}}',
        b'{"format": "llmweb.users", "version": 2, "users": {}}',
        b'{"format": "llmweb.users", "version": 1, "users": []}',
        b'{"format": "llmweb.users", "version": 1, "users": {"a b": {}}}',
        b'{"format": "llmweb.users", "version": 1, "users": {"alice": {"salt": "zz", "hash": "00", "n": 16, "r": 1, '
        b'"p": 1}}}',
        b'{"format": "llmweb.users", "version": 1, "users": {"alice": {"salt": "00", "hash": "'
        + b"00" * 32
        + b'", "n": 1099511627776, "r": 8, "p": 1}}}',
    ],
)
def test_a_malformed_users_file_is_a_config_error_naming_the_file(users_path, content):
    users_path.parent.mkdir(parents=True)
    users_path.write_bytes(content)
    with pytest.raises(ConfigError, match="users file .*users.json"):
        load_users(users_path)
    with pytest.raises(ConfigError, match="users.json"):
        Accounts(users_file=users_path)


def test_a_users_file_broken_while_serving_locks_its_users_out_until_fixed(users_path, caplog):
    add(users_path, "alice", SECRET)
    acc = Accounts({"carol": "pw"}, users_file=users_path)
    good = users_path.read_bytes()
    users_path.write_text("{broken")
    with caplog.at_level(logging.ERROR, logger="llmweb.web.accounts"):
        assert not acc.verify("alice", SECRET)
    assert "users.json" in caplog.text
    assert acc.verify("carol", "pw"), "LLMWEB_AUTH users still log in"
    users_path.write_bytes(good)
    assert acc.verify("alice", SECRET)


# ---- LLMWEB_AUTH pairs


def test_env_pairs_admit_several_users_and_passwords_may_hold_colons(tmp_path):
    settings = Settings(data_dir=tmp_path, auth="alice:pw1,bob:p:w:2, carol@example.org:short")
    acc = Accounts.from_settings(settings)
    assert acc.names() == ["alice", "bob", "carol@example.org"]
    assert acc.verify("alice", "pw1") and acc.verify("bob", "p:w:2") and acc.verify("carol@example.org", "short")
    assert not acc.verify("alice", "p:w:2") and not acc.verify("bob", "pw1")


def test_env_pairs_win_over_the_file_for_the_same_name(tmp_path, users_path):
    add(users_path, "alice", SECRET)
    add(users_path, "bob", OTHER)
    acc = Accounts.from_settings(Settings(data_dir=tmp_path, auth="alice:envpass", auth_file=users_path))
    assert acc.verify("alice", "envpass") and not acc.verify("alice", SECRET)
    assert acc.verify("bob", OTHER)


@pytest.mark.parametrize(
    "auth, message",
    [
        ("bad name:pw", "LLMWEB_AUTH: user name 'bad name' is not valid"),
        ("alice:", "empty password"),
        ("alice:a,alice:b", "appears twice"),
    ],
)
def test_bad_env_pairs_are_config_errors_that_show_names_not_passwords(tmp_path, auth, message):
    with pytest.raises(ConfigError, match=message) as info:
        Accounts.from_settings(Settings(data_dir=tmp_path, auth=auth))
    assert "pw" not in str(info.value).replace("password", "")


# ---- gradio_auth


def test_gradio_auth_is_none_without_login_and_an_awaitable_check_with_it(tmp_path, users_path):
    assert gradio_auth(Settings(data_dir=tmp_path)) is None
    add(users_path, "alice", SECRET)
    check = gradio_auth(Settings(data_dir=tmp_path, auth="bob:pw", auth_file=users_path))
    assert callable(check) and inspect.iscoroutinefunction(check), "Gradio awaits coroutine functions"
    assert asyncio.run(check("alice", SECRET)) is True
    assert asyncio.run(check("bob", "pw")) is True
    assert asyncio.run(check("alice", OTHER)) is False
    assert asyncio.run(check("nobody", "pw")) is False


# ---- the CLI


def test_cli_adds_lists_and_removes_users_without_showing_hashes(users_path, settings, monkeypatch, capsys):
    f = ["--file", str(users_path)]
    assert user_cli(["add", "alice", "--password-stdin", *f], settings, monkeypatch, SECRET) == 0
    assert user_cli(["add", "bob", "--password-stdin", *f], settings, monkeypatch, OTHER) == 0
    capsys.readouterr()
    assert user_cli(["list", *f], settings, monkeypatch) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert [line.split("\t")[0] for line in lines] == ["alice", "bob"]
    assert all("added 20" in line for line in lines), out
    doc = json.loads(users_path.read_text())
    for entry in doc["users"].values():
        assert entry["hash"] not in out and entry["salt"] not in out
    assert user_cli(["remove", "alice", *f], settings, monkeypatch) == 0
    assert list(load_users(users_path)) == ["bob"]
    with pytest.raises(InputError, match="no user 'alice'"):
        user_cli(["remove", "alice", *f], settings, monkeypatch)


def test_cli_add_refuses_an_existing_user_unless_replace(users_path, settings, monkeypatch):
    f = ["--file", str(users_path)]
    user_cli(["add", "alice", "--password-stdin", *f], settings, monkeypatch, SECRET)
    with pytest.raises(InputError, match="already exists"):
        user_cli(["add", "alice", "--password-stdin", *f], settings, monkeypatch, OTHER)
    user_cli(["add", "alice", "--password-stdin", "--replace", *f], settings, monkeypatch, OTHER)
    acc = Accounts(users_file=users_path)
    assert acc.verify("alice", OTHER) and not acc.verify("alice", SECRET)


@pytest.mark.parametrize("name", ["", "has space", "x" * 65, "ünïcode", "semi;colon", "new\nline"])
def test_cli_rejects_bad_user_names(users_path, settings, monkeypatch, name):
    with pytest.raises(InputError, match="not valid"):
        user_cli(["add", name, "--password-stdin", "--file", str(users_path)], settings, monkeypatch, SECRET)
    assert not users_path.exists()


def test_cli_accepts_names_of_letters_digits_and_dot_underscore_dash_at(users_path, settings, monkeypatch):
    name = "a.B-c_9@example.org"
    user_cli(["add", name, "--password-stdin", "--file", str(users_path)], settings, monkeypatch, SECRET)
    assert Accounts(users_file=users_path).verify(name, SECRET)


def test_cli_rejects_a_short_password_and_writes_nothing(users_path, settings, monkeypatch):
    with pytest.raises(InputError, match="at least 8 characters") as info:
        user_cli(["add", "alice", "--password-stdin", "--file", str(users_path)], settings, monkeypatch, "short12")
    assert "short12" not in str(info.value)
    assert not users_path.exists()


def test_cli_asks_twice_with_getpass_and_refuses_a_mismatch(users_path, settings, monkeypatch):
    answers = iter([SECRET, OTHER])
    monkeypatch.setattr(user_cli_mod.getpass, "getpass", lambda prompt="": next(answers))
    with pytest.raises(InputError, match="differ") as info:
        user_cli(["add", "alice", "--file", str(users_path)], settings, monkeypatch)
    assert SECRET not in str(info.value) and not users_path.exists()
    answers = iter([SECRET, SECRET])
    user_cli(["add", "alice", "--file", str(users_path)], settings, monkeypatch)
    assert Accounts(users_file=users_path).verify("alice", SECRET)


def test_cli_file_defaults_to_llmweb_auth_file_then_the_data_dir(tmp_path, users_path, monkeypatch):
    data = tmp_path / "data"
    user_cli(["add", "alice", "--password-stdin"], Settings(data_dir=data), monkeypatch, SECRET)
    assert list(load_users(data / "users.json")) == ["alice"]
    user_cli(["add", "bob", "--password-stdin"], Settings(data_dir=data, auth_file=users_path), monkeypatch, SECRET)
    assert list(load_users(users_path)) == ["bob"]


def test_cli_problems_are_llmweb_errors_for_the_exit_message(users_path, settings, monkeypatch):
    users_path.parent.mkdir(parents=True)
    users_path.write_text("{oops")
    with pytest.raises(LlmwebError, match="users.json"):
        user_cli(["list", "--file", str(users_path)], settings, monkeypatch)


# ---- no password in logs or messages


def test_no_password_or_hash_reaches_the_log(users_path, settings, monkeypatch, caplog, capsys):
    f = ["--file", str(users_path)]
    errors = []
    with caplog.at_level(logging.DEBUG):
        user_cli(["add", "alice", "--password-stdin", *f], settings, monkeypatch, SECRET)
        acc = Accounts.from_settings(settings.replace(auth=f"carol:{OTHER}", auth_file=users_path))
        assert acc.verify("alice", SECRET)
        assert not acc.verify("alice", OTHER)
        assert not acc.verify(SECRET, SECRET), "a password typed into the name field"
        assert not acc.verify("carol", SECRET)
        for argv, pw in [
            (["add", "alice", "--password-stdin", *f], OTHER),
            (["add", "dave", "--password-stdin", *f], SECRET[:5]),
        ]:
            with pytest.raises(LlmwebError) as info:
                user_cli(argv, settings, monkeypatch, pw)
            errors.append(str(info.value))
        user_cli(["remove", "alice", *f], settings, monkeypatch)
    text = caplog.text + "\n".join(errors) + capsys.readouterr().out
    assert SECRET not in text and SECRET[:5] not in text and OTHER not in text
    for record in load_users(users_path).values():
        assert record.hash.hex() not in text and record.salt.hex() not in text
        assert record.hash.hex() not in repr(record)
    # the events are logged, by name
    assert "user 'alice' added" in caplog.text and "user 'alice' removed" in caplog.text
    assert "failed login for user 'alice'" in caplog.text and "failed login for user 'carol'" in caplog.text
    assert "failed login for an unknown user name" in caplog.text


# ---- login back-off


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def throttled(users_path, monkeypatch):
    """alice in the users file, a fake clock, and a count of scrypt runs."""
    add(users_path, "alice", SECRET)
    acc = Accounts(users_file=users_path)
    clock = Clock()
    acc.throttle = throttle.LoginThrottle(clock)
    runs = []
    real = Scrypt.hash
    monkeypatch.setattr(Scrypt, "hash", lambda self, pw, salt: runs.append(1) or real(self, pw, salt))
    return acc, clock, runs


def test_failed_logins_for_a_name_back_off_exponentially_without_running_scrypt(throttled, caplog):
    acc, clock, runs = throttled
    for _ in range(throttle.BACKOFF_FREE):
        assert not acc.check("alice", OTHER, "198.51.100.1")
    runs.clear()
    assert not acc.check("alice", OTHER, "198.51.100.2")  # the 4th failure: 1 s to wait
    waits = []
    for _ in range(4):
        with pytest.raises(throttle.LoginBackoff) as refused:
            acc.check("alice", SECRET, "198.51.100.3")  # even the right password, from another address
        waits.append(refused.value.wait_s)
        assert "try again in" in str(refused.value)
        clock.now += refused.value.wait_s
        assert not acc.check("alice", OTHER, "198.51.100.3")
    assert waits == [1, 2, 4, 8], "doubling"
    assert len(runs) == 1 + 4, "scrypt ran for the attempts let through, never for a refused one"
    assert not acc.verify("alice", SECRET), "verify: False while backing off"
    assert "backing off" in caplog.text and SECRET not in caplog.text and OTHER not in caplog.text
    clock.now += throttle.BACKOFF_CAP_S
    assert acc.check("alice", SECRET, "198.51.100.3"), "the wait is capped, and then the right password works"


def test_guesses_at_a_name_from_elsewhere_never_lock_its_owner_out_of_her_own_address(throttled):
    """The lockout the per-name back-off allowed: a stranger failing for "alice" from many
    addresses held alice herself up. Now an address she logged in from waits only for its own failures;
    a new address still waits for the name's."""
    acc, clock, runs = throttled
    assert acc.check("alice", SECRET, "192.0.2.10"), "alice, from her usual address"
    for i in range(20):
        with contextlib.suppress(throttle.LoginBackoff):
            acc.check("alice", OTHER, f"203.0.113.{i}")
    with pytest.raises(throttle.LoginBackoff):
        acc.check("alice", SECRET, "198.51.100.99")  # a new address still waits for the name's back-off
    assert acc.check("alice", SECRET, "192.0.2.10"), "not locked out from her own address"


def test_one_address_guessing_many_names_backs_off_and_other_addresses_do_not(throttled):
    acc, clock, runs = throttled
    for i in range(throttle.BACKOFF_FREE + 1):
        assert not acc.check(f"guess{i}", OTHER, "203.0.113.66")
    runs.clear()
    with pytest.raises(throttle.LoginBackoff):
        acc.check("alice", SECRET, "203.0.113.66")
    assert runs == []
    assert acc.check("alice", SECRET, "192.0.2.10"), "alice from her own address is not held up"


def test_the_wait_is_capped_and_the_throttle_forgets_old_names(monkeypatch):
    clock = Clock()
    t = throttle.LoginThrottle(clock)
    for _ in range(40):
        t.failed("x", None)
    assert t.wait_s("x") == throttle.BACKOFF_CAP_S
    monkeypatch.setattr(throttle, "BACKOFF_KEYS", 3)
    for name in "abcd":
        t.failed(name, None)
    assert len(t._failures) == 3


def test_the_login_route_backs_off_per_address_behind_a_trusted_proxy_and_makes_gradios_session(tmp_path, users_path):
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from llmweb.web.login import login_routes

    add(users_path, "alice", SECRET)
    s = Settings(data_dir=tmp_path, auth_file=users_path, trusted_proxies="127.0.0.1")
    app = FastAPI(routes=login_routes(s))
    app.tokens, app.cookie_id = {}, "c1"  # what Gradio's App has
    http = TestClient(app, base_url="http://127.0.0.1:7860", client=("127.0.0.1", 5000))
    attacker = {"X-Forwarded-For": "203.0.113.66"}
    for i in range(throttle.BACKOFF_FREE + 1):
        r = http.post("/login", data={"username": f"name{i}", "password": OTHER}, headers=attacker)
        assert r.status_code == 400 and r.json()["detail"] == "Incorrect credentials."
    held = http.post("/login", data={"username": "alice", "password": SECRET}, headers=attacker)
    assert held.status_code == 400 and "try again in 1 s" in held.json()["detail"]
    assert held.headers["retry-after"] == "1" and not app.tokens
    ok = http.post("/login/", data={"username": "alice", "password": SECRET}, headers={"X-Forwarded-For": "192.0.2.7"})
    assert ok.status_code == 200 and list(app.tokens.values()) == ["alice"]
    assert "access-token-c1" in ok.headers["set-cookie"] and "httponly" in ok.headers["set-cookie"].lower()
    assert login_routes(Settings(data_dir=tmp_path)) == [], "no login, no route"


def test_the_login_route_refuses_a_form_posted_by_another_sites_page(tmp_path, users_path):
    """Login CSRF: another site's page could post the login form and log the visitor in to
    the attacker's account; now a cross-site Origin, Referer or Sec-Fetch-Site is refused first."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from llmweb.web.login import login_routes

    add(users_path, "alice", SECRET)
    app = FastAPI(routes=login_routes(Settings(data_dir=tmp_path, auth_file=users_path)))
    app.tokens, app.cookie_id = {}, "c1"
    http = TestClient(app, base_url="http://127.0.0.1:7860")
    form = {"username": "alice", "password": SECRET}
    for headers in (
        {"Origin": "https://evil.example"},
        {"Origin": "null"},
        {"Referer": "https://evil.example/page"},
        {"Sec-Fetch-Site": "cross-site"},
    ):
        r = http.post("/login", data=form, headers=headers)
        assert r.status_code == 403 and not app.tokens, headers
    assert http.post("/login", data=form, headers={"Origin": "http://127.0.0.1:7860"}).status_code == 200
    assert http.post("/login", data=form, headers={"Referer": "http://127.0.0.1:7860/"}).status_code == 200
    assert http.post("/login", data=form).status_code == 200, "no Origin: not a browser's cross-site post"
    proxied = {"Origin": "https://chat.example", "X-Forwarded-Host": "chat.example"}
    assert http.post("/login", data=form, headers=proxied).status_code == 200, "behind a proxy that sets the Host"


# ---- removing a user


def test_a_removed_users_session_stops_working_at_their_next_event(tmp_path, users_path, monkeypatch, capsys):
    from types import SimpleNamespace

    from llmweb.web import identity

    add(users_path, "alice", SECRET)
    s = Settings(data_dir=tmp_path, auth_file=users_path)
    app = SimpleNamespace(tokens={"t-alice": "alice", "t-alice-2": "alice", "t-bob": "bob"})
    page = SimpleNamespace(username="alice", request=SimpleNamespace(app=app), client=None, headers={})
    assert identity.browser_owner(s, "", page) == "user:alice"
    assert identity.gradio_api_owner(s, "c1", page) == "user:alice"
    assert user_cli(["remove", "alice", "--file", str(users_path)], s, monkeypatch) == 0
    assert "ends their sessions" in capsys.readouterr().out
    with pytest.raises(InputError, match="no longer exists"):
        identity.browser_owner(s, "", page)
    assert app.tokens == {"t-bob": "bob"}, "Gradio's sessions of alice are gone: a reload shows the login page"
    with pytest.raises(InputError, match="no longer exists"):
        identity.gradio_api_owner(s, "c1", page)


def test_remove_purge_deletes_the_users_chats_and_documents_and_nobody_elses(tmp_path, users_path, monkeypatch):
    from llmweb.chat.recall import recall_namespace
    from llmweb.retrieval.library import private_namespace
    from llmweb.retrieval.storage import namespace_dir
    from llmweb.store.db import Store

    add(users_path, "alice", SECRET)
    add(users_path, "bob", OTHER)
    s = Settings(data_dir=tmp_path, auth_file=users_path)
    store = Store(tmp_path / "llmweb.sqlite3")
    gone = store.create_conversation("user:alice")
    kept = store.create_conversation("user:bob")
    store.close()
    docs = namespace_dir(s, private_namespace("user:alice"))
    recalls = {c: namespace_dir(s, recall_namespace(c)) for c in (gone, kept)}
    for folder in (docs, *recalls.values()):
        folder.mkdir(parents=True)
        (folder / "manifest.json").write_text("{}")
    assert user_cli(["remove", "alice", "--purge", "--file", str(users_path)], s, monkeypatch) == 0
    store = Store(tmp_path / "llmweb.sqlite3")
    try:
        assert store.list_conversations("user:alice") == []
        assert [c.id for c in store.list_conversations("user:bob")] == [kept]
    finally:
        store.close()
    assert not docs.exists()
    assert not recalls[gone].exists(), "alice's recall indexes go with her chats"
    assert recalls[kept].exists(), "bob's stay"
    assert "bob" in load_users(users_path) and "alice" not in load_users(users_path)
