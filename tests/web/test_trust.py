"""The trust model (web/owner.py, web/identity.py, web/trust.py): on a loopback install the single
user is whoever shows the owner's secret (the owner link's cookie, or the local API key), never a
request that only looks local: without it, this machine's browser, a proxy's visitor, another peer
or another Host is a stranger, and /v1 wants a key. /v1 refuses other sites' pages (Origin, a body
that is not JSON) and DNS rebinding (Host)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from llmweb.errors import InputError
from llmweb.records import LOCAL_OWNER
from llmweb.web import identity, owner, trust
from tests.conftest import make_settings
from tests.web.api.conftest import body, rig, say

TOKEN = identity.new_owner_token()


def request(peer="127.0.0.1", username=None, **headers) -> SimpleNamespace:
    """A gr.Request as Gradio hands it over: the TCP peer and the headers."""
    headers = {"host": "127.0.0.1:7860", **{k.replace("_", "-"): v for k, v in headers.items()}}
    return SimpleNamespace(username=username, client=SimpleNamespace(host=peer), headers=headers)


@pytest.fixture
def local(tmp_path):
    return make_settings(tmp_path)  # auto: loopback bind, no login


def cookie_of(settings) -> str:
    """The Cookie header of the browser that opened the owner link."""
    secrets = owner.owner_secrets(settings)
    return f"other=1; {secrets.cookie_name}={secrets.token}"


# ---- the UI


def test_the_owners_cookie_or_key_is_the_single_user_wherever_the_request_comes_from(local):
    assert identity.browser_owner(local, "", request(cookie=cookie_of(local))) == LOCAL_OWNER
    key = owner.owner_secrets(local).api_key
    assert identity.gradio_api_owner(local, "c1", request(authorization=f"Bearer {key}")) == LOCAL_OWNER
    through_a_tunnel = request("203.0.113.9", cookie=cookie_of(local), host="chat.example.org")
    assert identity.browser_owner(local, "", through_a_tunnel) == LOCAL_OWNER, "the owner, away from home"


def test_a_direct_local_request_without_the_secret_is_a_stranger(local):
    """socat, `ssh -R` or a bare nginx proxy_pass: loopback peer, no forwarding header, a local Host."""
    for req in (request(), request(host="localhost:7860"), request("::1", host="[::1]:7860")):
        assert identity.browser_owner(local, TOKEN, req) == f"anon:{TOKEN}"
        with pytest.raises(InputError, match="no session yet"):
            identity.browser_owner(local, "", req)
        assert identity.gradio_api_owner(local, "c1", req) == "api:c1"
    secrets = owner.owner_secrets(local)
    for wrong in (f"{secrets.cookie_name}={secrets.token[:-1]}x", f"{secrets.cookie_name}=", "llmweb-owner=x", "%%%"):
        assert identity.browser_owner(local, TOKEN, request(cookie=wrong)) == f"anon:{TOKEN}", wrong
    assert identity.gradio_api_owner(local, "c1", request(authorization="Bearer sk-anything")) == "api:c1"
    assert identity.gradio_api_owner(local, "c1", request(authorization=f"Bearer {secrets.token}")) == "api:c1"


def test_the_owner_secrets_are_files_only_the_user_reads(local):
    secrets = owner.owner_secrets(local)
    for name in (owner.TOKEN_FILE, owner.API_KEY_FILE):
        path = local.data_dir / name
        assert path.stat().st_mode & 0o777 == 0o600, name
        assert len(path.read_text().strip()) == 64
    assert secrets.token != secrets.api_key
    owner.owner_secrets.cache_clear()
    assert owner.owner_secrets(local) == secrets, "read again after a restart, not made anew"
    assert owner.owner_link(local) == f"http://127.0.0.1:7860/?token={secrets.token}"


@pytest.mark.parametrize(
    "headers",
    [
        {"x_forwarded_for": "203.0.113.9"},
        {"forwarded": "for=203.0.113.9;proto=https"},
        {"x_forwarded_proto": "https"},
        {"x_forwarded_host": "chat.example.org"},
        {"x_real_ip": "203.0.113.9"},
    ],
)
def test_a_proxied_request_on_a_loopback_install_is_a_stranger(local, headers):
    """nginx/Caddy/cloudflared on the same host forward to 127.0.0.1: their visitors are not the owner."""
    assert identity.browser_owner(local, TOKEN, request(**headers)) == f"anon:{TOKEN}"
    with pytest.raises(InputError, match="no session yet"):
        identity.browser_owner(local, "", request(**headers))
    assert identity.gradio_api_owner(local, "c1", request(**headers)) == "api:c1"


def test_another_peer_or_another_host_is_a_stranger(local):
    assert identity.browser_owner(local, TOKEN, request("192.168.1.20")) == f"anon:{TOKEN}"
    assert identity.browser_owner(local, TOKEN, request(host="evil.example:7860")) == f"anon:{TOKEN}"
    assert identity.browser_owner(local, TOKEN, SimpleNamespace(username=None)) == f"anon:{TOKEN}"


def test_single_user_1_still_makes_everyone_the_owner(tmp_path):
    forced = make_settings(tmp_path, single_user="1")
    assert identity.browser_owner(forced, "", request(x_forwarded_for="203.0.113.9")) == LOCAL_OWNER


# ---- the client's address


def test_forwarded_addresses_count_only_from_trusted_proxies(tmp_path):
    plain = make_settings(tmp_path / "a")
    spoofed = request("198.51.100.7", x_forwarded_for="10.9.9.9")
    assert trust.origin_of(plain, spoofed).address == "198.51.100.7", "anyone can send the header"

    behind = make_settings(tmp_path / "b", trusted_proxies="127.0.0.1, 10.0.0.0/8")
    hops = request(x_forwarded_for="6.6.6.6, 203.0.113.9, 10.1.2.3")
    assert trust.origin_of(behind, hops).address == "203.0.113.9", "the rightmost untrusted hop"
    assert not trust.origin_of(behind, hops).local
    rfc = request(forwarded='for=198.51.100.1, for="[2001:db8::1]:4711"')
    assert trust.origin_of(behind, rfc).address == "2001:db8::1"
    assert trust.origin_of(behind, request("192.0.2.1", x_forwarded_for="6.6.6.6")).address == "192.0.2.1"


def test_trusted_proxies_must_be_addresses(tmp_path):
    from llmweb.errors import ConfigError

    with pytest.raises(ConfigError, match="LLMWEB_TRUSTED_PROXIES"):
        make_settings(tmp_path, trusted_proxies="nginx")


def test_host_and_origin_checks():
    assert trust.host_is_local("127.0.0.1:7860", 7860) and trust.host_is_local("localhost")
    assert trust.host_is_local("[::1]:7860", 7860)
    for bad in ("evil.example:7860", "127.0.0.1:9999", "localhost.evil.example", "", None, "127.0.0.1:x"):
        assert not trust.host_is_local(bad, 7860), bad
    assert not trust.cross_site({"host": "127.0.0.1:7860"})
    assert not trust.cross_site({"host": "127.0.0.1:7860", "origin": "http://127.0.0.1:7860"})
    assert trust.cross_site({"host": "127.0.0.1:7860", "origin": "https://evil.example"})
    assert trust.cross_site({"host": "127.0.0.1:7860", "origin": "null"})
    assert trust.cross_site({"host": "127.0.0.1:7860", "sec-fetch-site": "cross-site"})


# ---- /v1


@pytest.fixture
def api(tmp_path):
    r = rig(tmp_path)  # a loopback install without keys: open to this machine
    yield r
    r.engine.close()
    r.store.close()


def test_the_api_needs_the_local_key_from_this_machine_too_and_a_proxy_adds_nothing(api):
    say(api, "hello")
    assert api.client.post("/v1/chat/completions", json=body()).status_code == 200, "the rig sends the local key"
    no_key = {"Authorization": ""}
    for headers in ({}, {"X-Forwarded-For": "203.0.113.9"}, {"Forwarded": "for=203.0.113.9"}):
        r = api.client.post("/v1/chat/completions", json=body(), headers={**headers, **no_key})
        assert r.status_code == 401 and r.json()["error"]["code"] == "api_key_required", headers
        assert "local-api-key" in r.json()["error"]["message"]
        assert api.client.get("/v1/models", headers={**headers, **no_key}).status_code == 401
    assert not api.store.list_conversations(LOCAL_OWNER)


def test_a_proxied_request_with_a_key_acts_for_the_key_not_the_local_owner(tmp_path):
    r = rig(tmp_path, api_keys="alice:key-of-alice")
    try:
        say(r, "hi")
        headers = {"X-Forwarded-For": "203.0.113.9", "Authorization": "Bearer key-of-alice"}
        ok = r.client.post("/v1/chat/completions", json=body(conversation_id="new"), headers=headers)
        assert ok.status_code == 200
        assert r.store.list_conversations("user:alice") and not r.store.list_conversations(LOCAL_OWNER)
    finally:
        r.engine.close()


def test_a_page_of_another_site_cannot_post_to_the_api(api):
    """CSRF: a form or fetch from another site, with or without a JSON body."""
    say(api, "never")
    evil = {"Origin": "https://evil.example"}
    r = api.client.post("/v1/chat/completions", json=body(), headers=evil)
    assert r.status_code == 403 and r.json()["error"]["code"] == "cross_site_request"
    as_text = api.client.post(
        "/v1/chat/completions", content=json.dumps(body()).encode(), headers={"Content-Type": "text/plain"}
    )
    assert as_text.status_code == 415 and as_text.json()["error"]["code"] == "unsupported_media_type"
    form = api.client.post("/v1/chat/completions", data={"a": "b"})
    assert form.status_code == 415
    assert api.client.get("/v1/models", headers={"Sec-Fetch-Site": "cross-site"}).status_code == 403
    same = api.client.post("/v1/chat/completions", json=body(), headers={"Origin": "http://127.0.0.1:7860"})
    assert same.status_code == 200
    assert len(api.store.list_conversations(LOCAL_OWNER)) == 0, "stateless: nothing stored"


@pytest.mark.parametrize("host", ["evil.example:7860", "evil.example", "127.0.0.1:9999", "localhost.evil.example"])
def test_a_wrong_host_is_refused_on_a_loopback_install(api, host):
    """DNS rebinding: a page of evil.example whose name now points to 127.0.0.1."""
    r = api.client.get("/v1/models", headers={"Host": host})
    assert r.status_code == 403 and r.json()["error"]["code"] == "host_not_allowed"
    r = api.client.post("/v1/chat/completions", json=body(), headers={"Host": host})
    assert r.status_code == 403


def test_uploads_are_private_on_every_install_unless_the_operator_shares_them(tmp_path):
    """On a single-user install too: a visitor through a proxy must not read the owner's uploads."""
    from llmweb.retrieval.library import Library

    fake = SimpleNamespace(dim=384, label="fake")
    local = Library(make_settings(tmp_path / "a"), embedder=fake)  # auto
    assert not local.shares_uploads(LOCAL_OWNER) and not local.shares_uploads(f"anon:{TOKEN}")
    assert local.may_remove_shared(LOCAL_OWNER) and not local.may_remove_shared(f"anon:{TOKEN}")
    assert Library(make_settings(tmp_path / "b", shared_uploads="1"), embedder=fake).shares_uploads(f"anon:{TOKEN}")
    closed = Library(make_settings(tmp_path / "c", shared_uploads="0"), embedder=fake)
    assert not closed.shares_uploads(LOCAL_OWNER) and not closed.may_remove_shared(LOCAL_OWNER)


# ---- the owner's link


def test_the_owner_link_sets_the_cookie_and_leaves_the_address_bar(local):
    from fastapi import FastAPI
    from fastapi.testclient import TestClient
    from starlette.middleware import Middleware

    app = FastAPI(middleware=[Middleware(owner.OwnerLink, settings=local)])
    app.add_api_route("/", lambda: {"page": True}, methods=["GET", "POST"])
    http = TestClient(app, base_url="http://127.0.0.1:7860", follow_redirects=False)
    secrets = owner.owner_secrets(local)
    opened = http.get(f"/?token={secrets.token}&__theme=dark")
    assert opened.status_code == 303 and opened.headers["location"] == "/?__theme=dark"
    cookie = opened.headers["set-cookie"]
    assert cookie.startswith(f"{secrets.cookie_name}={secrets.token};")
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and "Path=/" in cookie and "Secure" not in cookie
    wrong = http.get("/?token=guess")
    assert wrong.status_code == 303 and "set-cookie" not in wrong.headers and wrong.headers["location"] == "/"
    assert http.get("/").json() == {"page": True} and http.post("/?token=x").json() == {"page": True}


def test_serve_prints_the_owner_link_only_where_there_is_one_owner(tmp_path):
    from llmweb.cli.main import serving_lines

    single = make_settings(tmp_path / "a")
    assert f"http://127.0.0.1:7860/?token={owner.owner_secrets(single).token}" in serving_lines(single)
    assert "local-api-key" in serving_lines(single)
    for other in (make_settings(tmp_path / "b", host="0.0.0.0"), make_settings(tmp_path / "c", auth="u:p")):
        assert "token=" not in serving_lines(other)
