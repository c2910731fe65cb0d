"""The trust model (web/trust.py, web/identity.py): a loopback install is single-user, with a keyless
/v1, only for requests from this machine directly; a proxy's headers, another peer or another Host
make a request a stranger's. /v1 refuses other sites' pages (Origin, a body that is not JSON) and
DNS rebinding (Host)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from llmweb.errors import InputError
from llmweb.records import LOCAL_OWNER
from llmweb.web import identity, trust
from tests.conftest import make_settings
from tests.web.test_api_fast import body, rig, say

TOKEN = identity.new_owner_token()


def request(peer="127.0.0.1", username=None, **headers) -> SimpleNamespace:
    """A gr.Request as Gradio hands it over: the TCP peer and the headers."""
    headers = {"host": "127.0.0.1:7860", **{k.replace("_", "-"): v for k, v in headers.items()}}
    return SimpleNamespace(username=username, client=SimpleNamespace(host=peer), headers=headers)


@pytest.fixture
def local(tmp_path):
    return make_settings(tmp_path)  # auto: loopback bind, no login


# ---- the UI


def test_a_direct_local_request_is_the_single_user(local):
    assert identity.browser_owner(local, "", request()) == LOCAL_OWNER
    assert identity.browser_owner(local, "", request(host="localhost:7860")) == LOCAL_OWNER
    assert identity.browser_owner(local, "", request("::1", host="[::1]:7860")) == LOCAL_OWNER


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


def test_the_keyless_api_answers_this_machine_and_refuses_a_proxied_request(api):
    say(api, "hello")
    assert api.client.post("/v1/chat/completions", json=body()).status_code == 200
    for headers in ({"X-Forwarded-For": "203.0.113.9"}, {"Forwarded": "for=203.0.113.9"}):
        r = api.client.post("/v1/chat/completions", json=body(), headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "api_key_required"
        assert api.client.get("/v1/models", headers=headers).status_code == 401
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


def test_a_strangers_uploads_stay_private_on_a_single_user_install(tmp_path):
    """Through a proxy a visitor is not LOCAL_OWNER, so the single user's shared uploads are not theirs."""
    from llmweb.retrieval.library import Library

    fake = SimpleNamespace(dim=384, label="fake")
    local = Library(make_settings(tmp_path / "a"), embedder=fake)  # auto: shared uploads for the single user
    assert local.shares_uploads(LOCAL_OWNER)
    assert not local.shares_uploads(f"anon:{TOKEN}") and not local.shares_uploads("user:bob")
    assert Library(make_settings(tmp_path / "b", shared_uploads="1"), embedder=fake).shares_uploads(f"anon:{TOKEN}")
    assert not Library(make_settings(tmp_path / "c", shared_uploads="0"), embedder=fake).shares_uploads(LOCAL_OWNER)
