"""The trust model through the launched app (as `python -m llmweb serve` serves it, on a loopback bind,
over real HTTP; no model is needed: every answer here comes before the chat would run): a proxy's
headers make /v1 want a key, another site's page and a wrong Host are refused; with login, the
login form backs off and a removed user's session stops working at its next call."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from gradio_client import Client
from gradio_client.exceptions import AppError

from llmweb.cli.main import launch_app
from llmweb.records import LOCAL_OWNER
from llmweb.runtime import Runtime
from llmweb.web import accounts, throttle
from llmweb.web.accounts import Scrypt, load_users, new_record, save_users
from tests.conftest import make_settings

pytestmark = pytest.mark.slow  # launches a server

SECRET = "Tr0ub4dor&3-horse"


@pytest.fixture
def serve(tmp_path):
    launched = []

    def start(**kw):
        runtime = Runtime(make_settings(tmp_path / f"app{len(launched)}", **kw))  # never started: no model
        demo, url = launch_app(runtime, server_port=None, quiet=True, prevent_thread_lock=True)
        launched.append((demo, runtime))
        return url.rstrip("/")

    start.runtime = lambda: launched[-1][1]

    yield start
    for demo, runtime in launched:
        demo.close()
        runtime.store.close()


def test_a_loopback_install_refuses_proxied_cross_site_and_rebound_requests_to_v1(serve):
    url = serve()
    http = httpx.Client(base_url=url, timeout=30, trust_env=False)
    assert http.get("/v1/models").status_code == 200, "this machine, directly: open"
    for headers in ({"X-Forwarded-For": "203.0.113.9"}, {"Forwarded": "for=203.0.113.9"}, {"X-Real-IP": "1.2.3.4"}):
        r = http.get("/v1/models", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "api_key_required", headers
    r = http.post("/v1/chat/completions", json={"model": "llmweb"}, headers={"Origin": "https://evil.example"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "cross_site_request"
    body = json.dumps({"model": "llmweb", "messages": [{"role": "user", "content": "hi"}]})
    r = http.post("/v1/chat/completions", content=body, headers={"Content-Type": "text/plain"})
    assert r.status_code == 415
    r = http.get("/v1/models", headers={"Host": "evil.example:80"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "host_not_allowed"


def test_login_backs_off_and_a_removed_users_session_ends(serve, tmp_path, monkeypatch):
    monkeypatch.setattr(accounts, "DEFAULT_SCRYPT", Scrypt(n=16, r=1, p=1))
    users_path = tmp_path / "users.json"
    save_users(users_path, {"alice": new_record("alice", SECRET), "bob": new_record("bob", SECRET)})
    url = serve(auth_file=users_path)

    http = httpx.Client(base_url=url, timeout=30, trust_env=False)
    for _ in range(throttle.BACKOFF_FREE + 1):
        assert http.post("/login", data={"username": "bob", "password": "wrong-password"}).status_code == 400
    held = http.post("/login", data={"username": "bob", "password": SECRET})
    assert held.status_code == 400 and "try again in" in held.json()["detail"] and "retry-after" in held.headers

    time.sleep(int(held.headers["retry-after"]) + 0.2)  # this address backs off too: 127.0.0.1 made the guesses
    page = httpx.Client(base_url=url, timeout=30, trust_env=False)  # alice's browser
    assert page.post("/login", data={"username": "alice", "password": SECRET}).status_code == 200
    assert page.get("/gradio_api/login_check").status_code == 200
    alice = Client(url, auth=("alice", SECRET), verbose=False)  # logs in through the same route
    with pytest.raises(AppError, match="no longer exists") as unknown:
        alice.predict("no-such-conversation", api_name="/stats")
    assert "Your account" not in str(unknown.value), "logged in: only the conversation is unknown"
    users = load_users(users_path)
    del users["alice"]
    save_users(users_path, users)  # what `python -m llmweb user remove alice` does to the file
    with pytest.raises(Exception):  # noqa: B017  the server says "Your account no longer exists" and ends it
        alice.predict("no-such-conversation", api_name="/stats")
    assert page.get("/gradio_api/login_check").status_code == 401, (
        "every session of alice ended: the page asks to log in"
    )


def test_on_a_loopback_install_a_proxied_page_event_is_a_stranger_not_the_single_user(serve):
    url = serve()
    conv = serve.runtime().store.create_conversation(LOCAL_OWNER)  # the single user's chat
    assert Client(url, verbose=False).predict(conv, api_name="/stats") == "{}", "this machine: the owner"
    proxied = Client(url, headers={"X-Forwarded-For": "203.0.113.9"}, verbose=False)
    with pytest.raises(AppError, match="no longer exists"):
        proxied.predict(conv, api_name="/stats")  # through nginx on the same host: someone else
