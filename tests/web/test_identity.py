"""web/identity.py: who is asking, and which owner they act for, for every kind of caller."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from llmweb.errors import InputError
from llmweb.records import LOCAL_OWNER
from llmweb.web import identity
from llmweb.web.api.errors import ApiError
from llmweb.web.owner import owner_secrets
from tests.conftest import make_settings

NOBODY, BOB = SimpleNamespace(username=None), SimpleNamespace(username="bob")
# a program on this machine calling a loopback-bound server directly
HERE = SimpleNamespace(username=None, client=SimpleNamespace(host="127.0.0.1"), headers={"host": "127.0.0.1:7860"})


@pytest.fixture
def shared(tmp_path):
    return make_settings(tmp_path, single_user="0")


def test_a_browser_is_its_token_a_login_its_account_and_a_single_user_install_one_owner(shared, tmp_path):
    token = identity.new_owner_token()
    assert identity.is_owner_token(token) and len(token) == 32
    assert identity.browser_owner(shared, token, NOBODY) == f"anon:{token}"
    assert identity.browser_owner(shared, token, BOB) == "user:bob", "a login wins over the browser's token"
    for forged in ("", "not a token", None, token[:-1]):
        assert not identity.is_owner_token(forged)
        with pytest.raises(InputError, match="no session yet"):
            identity.browser_owner(shared, forged, NOBODY)
    single = make_settings(tmp_path / "one", single_user="1")
    assert identity.browser_owner(single, "", NOBODY) == LOCAL_OWNER
    assert identity.gradio_api_owner(single, "c1", BOB) == LOCAL_OWNER


def test_a_gradio_client_without_login_owns_each_conversation_through_its_id(shared):
    assert identity.gradio_api_owner(shared, "c1", NOBODY) == "api:c1"
    assert identity.gradio_api_owner(shared, "c1", BOB) == "user:bob"


def test_the_open_api_callers_conversations_own_themselves_and_keys_are_needed_off_loopback(shared, tmp_path):
    local_key = f"Bearer {owner_secrets(shared).api_key}"  # what a tool on this machine reads from the data dir
    caller = identity.ApiCallers(shared).caller(_with(authorization=local_key))
    assert caller.owner is None and caller.of_conversation("c1") == "api:c1"
    assert caller.stateless_owner == identity.OPEN_STATELESS_OWNER
    with pytest.raises(ApiError) as keyless:
        identity.ApiCallers(shared).caller(HERE)
    assert keyless.value.status == 401, "never keyless, even from this machine"
    exposed = make_settings(tmp_path / "lan", single_user="0", host="0.0.0.0")
    with pytest.raises(ApiError) as refused:
        identity.ApiCallers(exposed).caller(HERE)
    assert refused.value.status == 401


def test_an_api_key_acts_for_its_user_or_for_itself(shared, tmp_path):
    keyed = make_settings(tmp_path / "keys", single_user="0", api_keys="alice:sk-alice-1234567890,sk-nobody-1234567890")
    callers = identity.ApiCallers(keyed)
    assert callers.caller(_with(authorization="Bearer sk-alice-1234567890")).owner == "user:alice"
    assert callers.caller(_with(authorization="Bearer sk-nobody-1234567890")).owner.startswith("key:")
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "Basic sk-alice-1234567890"}):
        with pytest.raises(ApiError) as e:
            callers.caller(_with(**headers))
        assert e.value.status == 401


def _with(**headers) -> SimpleNamespace:
    return SimpleNamespace(username=None, client=HERE.client, headers={**HERE.headers, **headers})
