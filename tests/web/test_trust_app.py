"""The trust model through the launched app (as `python -m llmweb serve` serves it, on a loopback bind,
over real HTTP; no model is needed: every answer here comes before the chat would run): /v1 always
wants a key (this machine's is in the data dir), another site's page and a wrong Host are refused;
through a plain TCP forwarder nobody is the owner, while the owner's printed link still works; with
login, the login form backs off and a removed user's session stops working at its next call."""

from __future__ import annotations

import contextlib
import json
import secrets
import socket
import threading
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
from llmweb.web.owner import owner_link, owner_secrets
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
    start.demo = lambda: launched[-1][0]

    yield start
    for demo, runtime in launched:
        demo.close()
        runtime.store.close()


def test_a_loopback_install_refuses_proxied_cross_site_and_rebound_requests_to_v1(serve):
    url = serve()
    http = httpx.Client(base_url=url, timeout=30, trust_env=False)
    assert http.get("/v1/models").status_code == 401, "never keyless, even from this machine directly"
    key = {"Authorization": f"Bearer {owner_secrets(serve.runtime().settings).api_key}"}
    assert http.get("/v1/models", headers=key).status_code == 200, "this machine's key (data_dir/local-api-key)"
    for headers in ({"X-Forwarded-For": "203.0.113.9"}, {"Forwarded": "for=203.0.113.9"}, {"X-Real-IP": "1.2.3.4"}):
        r = http.get("/v1/models", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "api_key_required", headers
    evil = {"Origin": "https://evil.example"}
    r = http.post("/v1/chat/completions", json={"model": "llmweb"}, headers={**evil, **key})
    assert r.status_code == 403 and r.json()["error"]["code"] == "cross_site_request"
    body = json.dumps({"model": "llmweb", "messages": [{"role": "user", "content": "hi"}]})
    r = http.post("/v1/chat/completions", content=body, headers={"Content-Type": "text/plain", **key})
    assert r.status_code == 415
    r = http.get("/v1/models", headers={"Host": "evil.example:80", **key})
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
    key = {"Authorization": f"Bearer {owner_secrets(serve.runtime().settings).api_key}"}
    assert Client(url, headers=key, verbose=False).predict(conv, api_name="/stats") == "{}", "the owner's key"
    with pytest.raises(AppError, match="no longer exists"):
        Client(url, verbose=False).predict(conv, api_name="/stats")  # this machine without the key: someone else
    proxied = Client(url, headers={"X-Forwarded-For": "203.0.113.9"}, verbose=False)
    with pytest.raises(AppError, match="no longer exists"):
        proxied.predict(conv, api_name="/stats")  # through nginx on the same host: someone else


# ---- through a plain TCP forwarder (socat, `ssh -R`, nginx's bare proxy_pass): no header added


class Forwarder:
    """`socat TCP-LISTEN:port,fork TCP:127.0.0.1:target`: bytes both ways, nothing added, and the
    server's peer is this machine. Connects from `source` (another loopback address plays an ingress)."""

    def __init__(self, target_port: int, source: str = "127.0.0.1"):
        self.target, self.source = ("127.0.0.1", target_port), source
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return  # closed
            upstream = socket.create_connection(self.target, source_address=(self.source, 0))
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.listener.close()


def event(http: httpx.Client, demo, name: str, data: list, notices: list | None = None) -> list:
    """Run one of the page's own events (as the browser does: Gradio's queue, then its event stream)
    and return its outputs; named by its handler's name (the page load is `visit`). The notices it
    shows (gr.Warning) are added to `notices`."""
    fn_index = next(i for i, fn in demo.fns.items() if getattr(fn.fn, "__name__", "") == name)
    session = secrets.token_hex(8)
    joined = http.post(
        "/gradio_api/queue/join",
        json={"data": data, "fn_index": fn_index, "session_hash": session, "event_data": None, "trigger_id": None},
    )
    assert joined.status_code == 200, joined.text
    with http.stream("GET", "/gradio_api/queue/data", params={"session_hash": session}) as stream:
        for line in stream.iter_lines():
            if line.startswith("data:"):
                msg = json.loads(line[5:])
                if msg.get("msg") == "log" and notices is not None:
                    notices.append(msg.get("log", ""))
                if msg.get("msg") == "process_completed":
                    if not msg.get("success"):
                        raise AppError(str(msg.get("output", {}).get("error") or msg))
                    return msg["output"]["data"]
    raise AssertionError(f"no answer to {name}")


def test_through_a_plain_forwarder_nobody_is_the_owner_and_the_owners_link_still_works(serve, tmp_path):
    url = serve()
    runtime, demo = serve.runtime(), serve.demo()
    conv = runtime.store.create_conversation(LOCAL_OWNER, title="Secret plans")
    letter = tmp_path / "upload-1"
    letter.write_text("Dear Sam,\n\nThe vault code is 4711.\n")
    [added] = runtime.library.ingest_uploads(LOCAL_OWNER, [(letter, "secret-letter.txt")])
    assert added.ok
    port = int(url.rsplit(":", 1)[1])
    forwarder = Forwarder(port)
    try:
        # the Host a bare nginx `proxy_pass http://127.0.0.1:PORT` sends: the server's own
        stranger = httpx.Client(
            base_url=forwarder.url, timeout=60, trust_env=False, headers={"Host": f"127.0.0.1:{port}"}
        )
        token, *panel = event(stranger, demo, "visit", ["", ""])
        assert len(token) == 32, "an anonymous visitor, with a token of its own"
        assert "Secret plans" not in json.dumps(panel)
        assert "secret-letter" not in json.dumps(event(stranger, demo, "documents", ["", token]))
        r = stranger.get("/v1/models")
        assert r.status_code == 401 and r.json()["error"]["code"] == "api_key_required"
        r = stranger.post(
            "/v1/chat/completions", json={"model": "llmweb", "messages": [{"role": "user", "content": "x"}]}
        )
        assert r.status_code == 401
        proxied = Client(forwarder.url, verbose=False)
        with pytest.raises(AppError, match="no longer exists"):
            proxied.predict(conv, api_name="/stats")
        wrong = stranger.get("/?token=not-the-token", follow_redirects=False)
        assert wrong.status_code == 303 and "set-cookie" not in wrong.headers
    finally:
        forwarder.close()

    owner = httpx.Client(base_url=url, timeout=60, trust_env=False)
    link = owner_link(runtime.settings, int(url.rsplit(":", 1)[1]))
    opened = owner.get(link.split(url, 1)[1], follow_redirects=False)
    assert opened.status_code == 303 and opened.headers["location"] == "/"
    cookie = opened.headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and owner_secrets(runtime.settings).token in cookie
    assert owner.get("/").status_code == 200
    kept, *panel = event(owner, demo, "visit", ["", ""])
    assert kept == "" and "Secret plans" in json.dumps(panel), "the owner sees their chats"
    assert "secret-letter.txt" in json.dumps(event(owner, demo, "documents", ["", ""])), "and their uploads"
    key = {"Authorization": f"Bearer {owner_secrets(runtime.settings).api_key}"}
    assert owner.get("/v1/models", headers=key).status_code == 200, "the local API key from the data dir"
    assert Client(url, headers=key, verbose=False).predict(conv, api_name="/stats") == "{}"

    local_browser = httpx.Client(base_url=url, timeout=60, trust_env=False)  # this machine, no cookie
    notices: list = []
    token, *panel = event(local_browser, demo, "visit", ["", ""], notices)
    assert len(token) == 32 and "Secret plans" not in json.dumps(panel), "a visitor..."
    assert any("open the link" in n for n in notices), f"...told to open the printed link: {notices}"


# ---- a Space: its ingress's address is every visitor's peer


def test_started_as_a_space_starts_each_visitor_is_counted_by_the_address_its_ingress_sets(tmp_path):
    """`SYSTEM=spaces` (cli/main.py: serve_settings): the ingress reaches the app from a private
    address (here 127.0.0.2, through a forwarder) and sets X-Forwarded-For. 40 visitors from 40
    addresses are all admitted (LLMWEB_ANON_PER_ADDRESS is 20); one client that makes up tokens,
    and forges X-Forwarded-For too (the ingress appends the address it saw), is still held to 20."""
    import argparse

    from llmweb.cli.main import serve_settings
    from llmweb.web.identity import new_owner_token

    env = {"SYSTEM": "spaces", "LLMWEB_DATA_DIR": str(tmp_path / "space"), "LLMWEB_SAMPLE_DOCS": "0"}
    settings = serve_settings(argparse.Namespace(host=None, port=None), env=env)
    assert settings.host == "0.0.0.0" and settings.anon_per_address == 20
    runtime = Runtime(settings)  # never started: the page load needs no model
    demo, url = launch_app(runtime, server_port=None, quiet=True, prevent_thread_lock=True)
    ingress = Forwarder(int(url.rstrip("/").rsplit(":", 1)[1]), source="127.0.0.2")
    try:
        http = httpx.Client(base_url=ingress.url, timeout=60, trust_env=False)
        for n in range(40):
            visitor = {"X-Forwarded-For": f"203.0.113.{n + 1}"}
            token, *_ = event(
                httpx.Client(base_url=ingress.url, timeout=60, trust_env=False, headers=visitor),
                demo,
                "visit",
                ["", ""],
            )
            assert len(token) == 32, n
        admitted = 0
        with pytest.raises(AppError, match="Too many new visitors"):
            for n in range(settings.anon_per_address + 1):
                forged = {"X-Forwarded-For": f"10.9.{n}.1, 198.51.100.{n}, 198.51.100.7"}
                http.headers.update(forged)
                event(http, demo, "visit", [new_owner_token(), ""])
                admitted += 1
        assert admitted == settings.anon_per_address
    finally:
        ingress.close()
        demo.close()
        runtime.store.close()
