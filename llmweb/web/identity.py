"""Who is asking, and which OWNER they act for: the one place owners are minted and derived.

Every stored thing has an owner, a string, and every read names one. This module decides it:

  - a single-user install (`Settings.is_single_user`): LOCAL_OWNER, but only for a request from this
    machine directly (web/trust.py; `LLMWEB_SINGLE_USER=1`: every request); anyone else, through a
    proxy or from another machine, is a stranger as on a multi-user install;
  - a login account (Gradio's `request.username`, or an API key made for a user): "user:<name>";
  - an anonymous browser: "anon:<token>", the token minted on the server by the page's first event
    that needs one (web/visitors.py: 192 bits, kept in a `gr.BrowserState`, never shown, never in a
    URL), checked on every event, and counted per client address;
  - a gradio_client caller without login: each conversation owns itself ("api:<id>": the id is
    the capability), so a browser's conversation is never reachable through the API;
  - an OpenAI-API caller (`ApiCallers`): a key of user alice is "user:alice", a key of no user
    "key:<tag>"; without keys the API answers only local requests on a loopback bind without login,
    and then each conversation owns itself as above ("api:<id>"), a stateless call OPEN_STATELESS_OWNER;
    a login account removed from the users file stops working at its next event.

It must not store anything, decide what an owner may see (the store and library scope every read
by the owner they are given), or import gradio: a Gradio request is read for its `username`, its
client and headers (web/trust.py), and its app's login sessions (to end a removed user's).
Passwords are web/accounts.py's, key hashes web/api_keys.py's; this module only asks it whom a key belongs to.
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
from llmweb.web.api_keys import ApiKeys
from llmweb.web.api_wire import ApiError
from llmweb.web.trust import cross_site, headers_of, host_is_local, is_forwarded, origin_of

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
    every request; `auto` only for a local one (web/trust.py: loopback bind and peer, no forwarding
    headers, a local Host)."""
    if settings.single_user == "1":
        return True
    return settings.is_single_user and origin_of(settings, request, port).local


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
        if not self.keys.configured and not self.open:
            log.warning(
                "the OpenAI-compatible API (/v1) refuses every request: it needs keys when the server is "
                "bound to %s%s (LLMWEB_API_KEYS, or `python -m llmweb user key NAME`)",
                settings.host,
                " with login on" if settings.login else "",
            )

    @property
    def open(self) -> bool:
        """Without keys, the API answers only on a loopback bind without login (and there, only local requests)."""
        return self.settings.on_loopback and not self.settings.login

    def caller(self, request) -> Caller:
        """The caller's owner. ApiError 403 for a page of another site or (on a loopback bind) a Host that
        is not this machine; 401 without a valid key where one is needed. Without keys (local requests on a
        loopback bind only), whatever key a client sends is ignored."""
        port = server_port(request)
        refuse_browser_attacks(self.settings, request, port)
        single = acts_as_single_user(self.settings, request, port)
        if not self.keys.configured:
            if not self.open:
                raise ApiError(
                    401,
                    "This server's API needs an API key: it is reachable from other machines or has login on, "
                    "and no keys are set (LLMWEB_API_KEYS, or `python -m llmweb user key NAME`).",
                    type="authentication_error",
                    code="api_key_required",
                )
            if not origin_of(self.settings, request, port).local:
                raise ApiError(
                    401,
                    "This server's API answers without a key only to this machine directly; this request came "
                    "through a proxy or from elsewhere. Set keys "
                    "(LLMWEB_API_KEYS, or `python -m llmweb user key NAME`).",
                    type="authentication_error",
                    code="api_key_required",
                )
            return Caller(LOCAL_OWNER if single else None)
        scheme, _, key = (headers_of(request).get("authorization") or "").partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise ApiError(
                401,
                "Missing API key: send the header Authorization: Bearer <your key>.",
                type="authentication_error",
                code="missing_api_key",
            )
        who = self.keys.lookup(key.strip())
        if who is None:
            raise ApiError(401, "Incorrect API key.", type="authentication_error", code="invalid_api_key")
        if single:
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
