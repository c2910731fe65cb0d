"""Anonymous visitors (web/visitors.py): the owner token is minted on the server by the page's first
event that needs one, so a message sent before the page load's answer is kept; and a client address
starts at most LLMWEB_ANON_PER_ADDRESS new anonymous owners an hour, whatever tokens it makes up."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from llmweb.errors import InputError
from llmweb.web.identity import gradio_api_owner, is_owner_token, new_owner_token
from llmweb.web.owner import owner_secrets
from llmweb.web.ui import Handlers
from llmweb.web.visitors import AddressQuota, PageTokens, Visitors
from tests.conftest import make_settings
from tests.web.test_ui import runtime  # noqa: F401  (the fixture: handlers over a fake chat)


def page(session="s1", peer="203.0.113.5", **headers) -> SimpleNamespace:
    """A gr.Request of one page load, from a stranger (another machine)."""
    return SimpleNamespace(
        username=None,
        session_hash=session,
        client=SimpleNamespace(host=peer),
        headers={"host": "chat.example.org", **{k.replace("_", "-"): v for k, v in headers.items()}},
    )


class Clock:
    now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_message_sent_before_the_page_has_its_token_is_kept_and_the_page_then_gets_that_token(runtime):  # noqa: F811
    h = Handlers(runtime)
    req = page()
    *_, final = list(h.chat.respond("Capital?", [], "", True, "", req))  # the load's answer has not come back
    conv_id = final[0]
    assert conv_id and any(m["content"] == "Paris" for m in final[1])
    token, *panel = h.account.visit("", "", req)  # the page load's event, later
    assert is_owner_token(token)
    assert [c.id for c in runtime.store.list_conversations(f"anon:{token}")] == [conv_id]
    assert panel[2]["choices"] == [
        (c.title + " (1)", conv_id) for c in runtime.store.list_conversations(f"anon:{token}")
    ]
    # every other event of the page, before or after, is the same owner
    assert h.chats.switch(conv_id, "", req).conv_state == conv_id
    assert h.chats.switch(conv_id, token, req).conv_state == conv_id
    # another page load (another session) without a token is someone else
    other, *_ = h.account.visit("", "", page("s2"))
    assert other != token and h.chats.switch(conv_id, other, page("s2")).chatbot == []


def test_an_event_without_a_token_or_a_session_is_still_refused(runtime):  # noqa: F811
    h = Handlers(runtime)
    with pytest.raises(Exception, match="no session yet"):
        h.chats.new_chat("", SimpleNamespace(username=None))


def test_one_address_starts_a_bounded_number_of_anonymous_owners_an_hour(tmp_path):
    clock = Clock()
    v = Visitors(make_settings(tmp_path, single_user="0", anon_per_address=3), clock=clock)
    made_up = [new_owner_token() for _ in range(4)]
    owners = [v.resolve(t, page(f"s{i}"))[0] for i, t in enumerate(made_up[:3])]
    assert owners == [f"anon:{t}" for t in made_up[:3]]
    with pytest.raises(InputError, match="Too many new visitors"):
        v.resolve(made_up[3], page("s3"))  # a fourth made-up token: no fresh quotas
    with pytest.raises(InputError, match="Too many new visitors"):
        v.resolve("", page("s4"), first=True)  # nor a fourth minted one
    assert v.resolve(made_up[0], page("s9"))[0] == owners[0], "a returning browser counts once"
    assert v.resolve(made_up[3], page("s3", peer="198.51.100.8"))[0] == f"anon:{made_up[3]}", "another address"
    clock.now += 3600
    assert v.resolve(made_up[3], page("s3"))[0] == f"anon:{made_up[3]}", "an hour later"


def test_behind_a_trusted_proxy_each_forwarded_address_is_counted_and_a_spoofed_header_is_not(tmp_path):
    s = make_settings(tmp_path, single_user="0", anon_per_address=1, trusted_proxies="10.0.0.1")
    v = Visitors(s, clock=Clock())
    via_proxy = dict(peer="10.0.0.1")
    v.resolve(new_owner_token(), page(x_forwarded_for="203.0.113.1", **via_proxy))
    v.resolve(new_owner_token(), page(x_forwarded_for="203.0.113.2", **via_proxy))
    with pytest.raises(InputError):
        v.resolve(new_owner_token(), page(x_forwarded_for="203.0.113.1", **via_proxy))
    direct = dict(peer="198.51.100.9")
    v.resolve(new_owner_token(), page(x_forwarded_for="203.0.113.50", **direct))
    with pytest.raises(InputError):
        v.resolve(new_owner_token(), page(x_forwarded_for="203.0.113.51", **direct))  # not a trusted proxy


def test_the_single_user_and_login_accounts_get_no_token_and_are_not_counted(tmp_path):
    settings = make_settings(tmp_path, anon_per_address=1)
    v = Visitors(settings, clock=Clock())
    secrets = owner_secrets(settings)  # the browser that opened the owner link has its cookie
    local = SimpleNamespace(username=None, session_hash="s", client=SimpleNamespace(host="127.0.0.1"), headers={})
    local.headers = {"host": "127.0.0.1:7860", "cookie": f"{secrets.cookie_name}={secrets.token}"}
    for _ in range(3):
        assert v.resolve("", local, first=True) == ("local", "")


def test_page_tokens_and_the_quota_stay_bounded(monkeypatch):
    from llmweb.web import visitors

    monkeypatch.setattr(visitors, "MAX_PAGES", 2)
    monkeypatch.setattr(visitors, "MAX_ADDRESSES", 2)
    pages = PageTokens(Clock())
    first = pages.token("a", "x")
    assert pages.token("a", "x") == first and pages.token("a", "y") != first
    pages.token("b", "x"), pages.token("c", "x")
    assert len(pages._tokens) == 2
    quota = AddressQuota(1, clock=Clock())
    for address in "pqrs":
        assert quota.admit(address, "o")
    assert len(quota._seen) == 2


def test_a_gradio_client_caller_who_leaves_out_the_id_gets_no_fresh_quota(tmp_path):
    """Each new anonymous `/chat` conversation is a new owner (it owns itself): counted per address
    like a browser, so a script that starts a conversation per message is held to the same cap."""
    s = make_settings(tmp_path, single_user="0", anon_per_address=2)
    v = Visitors(s, clock=Clock())
    for conv in ("c1", "c2"):
        v.admit_api_conversation(gradio_api_owner(s, conv, page()), page())
    with pytest.raises(InputError, match="Too many new visitors"):
        v.admit_api_conversation(gradio_api_owner(s, "c3", page()), page())
    v.admit_api_conversation(gradio_api_owner(s, "c3", page(peer="198.51.100.8")), page(peer="198.51.100.8"))
    v.admit_api_conversation("user:alice", page())  # a login account is not counted
