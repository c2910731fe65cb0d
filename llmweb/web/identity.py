"""Who is asking, and which OWNER they act for: the one place owners are minted and derived.

Every stored thing has an owner, a string, and every read names one. This module decides it:

  - a single-user install (`Settings.is_single_user`): LOCAL_OWNER, but only for a request that
    proves it is the machine's owner (web/owner.py: the cookie the printed owner link sets, or the
    local API key; `LLMWEB_SINGLE_USER=1`: every request). Nothing about the network counts: a
    request without the proof is a stranger's, from this machine or through any forwarder;
  - a login account (Gradio's `request.username`, or an API key made for a user): "user:<name>";
  - an anonymous browser: "anon:<token>", the token minted on the server by the page's first event
    that needs one (web/visitors.py: 192 bits, kept in a `gr.BrowserState`, never shown, never in a
    URL), checked on every event, and counted per client address;
  - a gradio_client caller without login: each conversation owns itself ("api:<id>": the id is
    the capability), so a browser's conversation is never reachable through the API;
  - an OpenAI-API caller (`ApiCallers`): never keyless. On a loopback bind without login the local
    API key (data_dir/local-api-key) acts for LOCAL_OWNER (with `LLMWEB_SINGLE_USER=0`: each
    conversation owns itself, "api:<id>", a stateless call OPEN_STATELESS_OWNER); a key of user alice
    is "user:alice", a key of no user "key:<tag>"; a login account removed from the users file stops
    working at its next event.

It must not store anything, decide what an owner may see (the store and library scope every read
by the owner they are given), or import gradio: a Gradio request is read for its `username`, its
headers (cookie, Authorization; web/trust.py for Origin and Host), and its app's login sessions.
Passwords are web/accounts.py's, key hashes web/api/keys.py's; this module only asks whom a key belongs to.
"""

from __future__ import annotations

import logging
import re
import secrets
from dataclasses import dataclass

from llmweb.config import Settings
from llmweb.errors import InputError
from llmweb.records import LOCAL_OWNER
from llmweb.web.accounts import accounts_for
from llmweb.web.api.errors import ApiError
from llmweb.web.api.keys import ApiKeys
from llmweb.web.owner import bearer, is_local_api_key, owner_secrets, proves_owner
from llmweb.web.trust import cross_site, headers_of, host_is_local, is_forwarded

log = logging.getLogger(__name__)

BROWSER = "anon:"  # + a browser's token
API_CONVERSATION = "api:"  # + a conversation id: an anonymous API conversation owns itself
# the owners the retention purge may delete (never a login account, a key or the local owner);
# llmweb.runtime.retention keeps the same pair (it sits below this layer), tests/web/test_ui.py checks it
ANONYMOUS = (BROWSER, API_CONVERSATION)
OPEN_STATELESS_OWNER = API_CONVERSATION + "stateless"  # open API on a multi-user install, no conversation

_TOKEN = re.compile(r"^[A-Za-z0-9_-]{32}$")  # secrets.token_urlsafe(24): 192 bits


def new_owner_token() -> str:
    """A new browser's token: unguessable, URL-safe, 32 characters."""
    return secrets.token_urlsafe(24)


def is_owner_token(token) -> bool:
    """Whether `token` is one `new_owner_token` could have made (a forged or empty one is not)."""
    return isinstance(token, str) and bool(_TOKEN.match(token))


def login_owner(name: str) -> str:
    return f"user:{name}"


def _login_name(request, settings: Settings | None = None) -> str | None:
    """The login account of a request; InputError when its user was removed since it logged in
    (`python -m llmweb user remove`): its Gradio sessions end here, the page asks to log in again."""
    name = getattr(request, "username", None) or None
    if name and settings is not None and settings.login and not accounts_for(settings).exists(name):
        _end_sessions(request, name)
        log.info("a session of the removed user %r ended", name)
        raise InputError("Your account no longer exists on this server. Reload the page to log in again.")
    return name


def _end_sessions(request, name: str) -> None:
    """Forget every Gradio login session of `name` (the app's token -> user map the cookies point to)."""
    app = getattr(getattr(request, "request", None), "app", None)
    tokens = getattr(app, "tokens", None)
    if isinstance(tokens, dict):
        for token in [t for t, user in tokens.items() if user == name]:
            tokens.pop(token, None)


def acts_as_single_user(settings: Settings, request, port: int | None = None) -> bool:
    """Is this request the single user of a single-user install? `LLMWEB_SINGLE_USER=1` says so for
    every request; `auto` only for one that proves it (web/owner.py: the owner link's cookie, or the
    local API key). `port` is unused (kept for callers)."""
    if settings.single_user == "1":
        return True
    return settings.is_single_user and proves_owner(settings, headers_of(request))


def needs_owner_token(settings: Settings, request) -> bool:
    """Is this page event an anonymous browser's (so its owner is its token)?"""
    return not getattr(request, "username", None) and not acts_as_single_user(settings, request)


def browser_owner(settings: Settings, token, request) -> str:
    """A page event's owner: the single user, the login account, or the browser's token."""
    name = _login_name(request, settings)  # first: a removed user's session ends even on a single-user install
    if acts_as_single_user(settings, request):
        return LOCAL_OWNER
    if name:
        return login_owner(name)
    if not is_owner_token(token):
        raise InputError("This page has no session yet. Reload it, and allow this site to keep local storage.")
    return BROWSER + token


def gradio_api_owner(settings: Settings, conversation_id: str, request) -> str:
    """A gradio_client call's owner: the single user, the login account, or (anonymous) the conversation's own id."""
    name = _login_name(request, settings)
    if acts_as_single_user(settings, request):
        return LOCAL_OWNER
    return login_owner(name) if name else API_CONVERSATION + conversation_id


def may_switch_models(settings: Settings, owner: str) -> bool:
    """May `owner` switch the model the whole server serves? The machine's owner of a single-user
    install, and a login named in LLMWEB_OPERATORS; never an anonymous visitor or API conversation."""
    if owner == LOCAL_OWNER and settings.is_single_user:
        return True
    operators = {n.strip() for n in settings.operators.split(",") if n.strip()}
    return bool(owner) and owner in {login_owner(n) for n in operators}


@dataclass(frozen=True, slots=True)
class Caller:
    """An OpenAI-API caller. owner=None: the open API on a multi-user install (each conversation is its own owner)."""

    owner: str | None

    def of_conversation(self, conv_id: str) -> str:
        return self.owner or API_CONVERSATION + conv_id

    @property
    def stateless_owner(self) -> str:
        return self.owner or OPEN_STATELESS_OWNER


class ApiCallers:
    """The OpenAI API's callers, from the request (web/trust.py) and `Authorization: Bearer <key>`."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self.keys = ApiKeys.from_settings(settings)
        if self.open:
            owner_secrets(settings)  # the local API key's file exists from the start, for this machine's tools
        if not self.keys.configured and not self.open:
            log.warning(
                "the OpenAI-compatible API (/v1) refuses every request: it needs keys when the server is "
                "bound to %s%s (LLMWEB_API_KEYS, or `python -m llmweb user key NAME`)",
                settings.host,
                " with login on" if settings.login else "",
            )

    @property
    def open(self) -> bool:
        """A loopback bind without login: the local API key (data_dir/local-api-key) is accepted too."""
        return self.settings.on_loopback and not self.settings.login

    def caller(self, request) -> Caller:
        """The caller's owner. ApiError 403 for a page of another site or (on a loopback bind) a Host that
        is not this machine; 401 without a valid key: the local API key (on a loopback bind without
        login) or one of the configured keys."""
        port = server_port(request)
        refuse_browser_attacks(self.settings, request, port)
        key = bearer(headers_of(request))
        forced = self.settings.single_user == "1"
        if self.open and is_local_api_key(self.settings, key):
            return Caller(LOCAL_OWNER if self.settings.is_single_user else None)
        if not self.keys.configured and not self.open:
            raise ApiError(
                401,
                "This server's API needs an API key: it is reachable from other machines or has login on, "
                "and no keys are set (LLMWEB_API_KEYS, or `python -m llmweb user key NAME`).",
                type="authentication_error",
                code="api_key_required",
            )
        if not key:
            where = " (on this machine: the key in the data dir's local-api-key file)" if self.open else ""
            raise ApiError(
                401,
                f"Missing API key: send the header Authorization: Bearer <your key>{where}.",
                type="authentication_error",
                code="api_key_required" if self.open and not self.keys.configured else "missing_api_key",
            )
        who = self.keys.lookup(key) if self.keys.configured else None
        if who is None:
            raise ApiError(401, "Incorrect API key.", type="authentication_error", code="invalid_api_key")
        if forced:
            return Caller(LOCAL_OWNER)
        return Caller(login_owner(who.name) if who.name else f"key:{who.tag}")


def server_port(request) -> int | None:
    """The port a Starlette request arrived on (its ASGI scope's server), None when unknown."""
    scope = getattr(request, "scope", None)
    server = scope.get("server") if isinstance(scope, dict) else None
    return server[1] if server and isinstance(server[1], int) else None


def refuse_browser_attacks(settings: Settings, request, port: int | None) -> None:
    """ApiError 403 for what only a hostile page sends: a cross-site request (CSRF), or, on a loopback
    bind, a direct request whose Host is not this machine (a DNS-rebinding page)."""
    headers = headers_of(request)
    if cross_site(headers):
        raise ApiError(
            403,
            "Requests from another site's page are refused (its Origin is not this server).",
            type="permission_error",
            code="cross_site_request",
        )
    if settings.on_loopback and not is_forwarded(headers) and not host_is_local(headers.get("host"), port):
        raise ApiError(
            403,
            "This server answers only to localhost, 127.0.0.1 or [::1] (the Host header names another machine).",
            type="permission_error",
            code="host_not_allowed",
        )
