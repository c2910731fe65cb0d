"""The machine owner's proof: a secret only the local user can read, never a guess from the network.

A single-user install (`Settings.is_single_user`) has one OWNER, the person who started it. Like
Jupyter's token, what makes a request theirs is a secret kept in the data dir, readable only by
that user (mode 600, written atomically by runtime/secret.py), not where the request seems to come
from: a forwarder (socat, `ssh -R`, a bare nginx `proxy_pass`) can make a stranger's request look
like this machine's in every header, but cannot read the file.

  - `owner-token`: `python -m llmweb serve` prints `http://127.0.0.1:7860/?token=<it>`. A visit with
    it gets an HttpOnly, SameSite=Strict cookie and a redirect to the bare URL (`OwnerLink`); the
    cookie, compared in constant time, makes that browser the owner from then on.
  - `local-api-key`: the owner's key for the OpenAI API (`Authorization: Bearer <it>`) and for
    programs on this machine (gradio_client's `headers=`), so `/v1` is never keyless.
A request with neither is a stranger's, wherever it comes from (web/identity.py).

It owns the two files' names, the cookie and the link; it must not decide an owner (identity.py
does) nor log, show or derive anything from the secrets but the cookie's name.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
from dataclasses import dataclass
from http.cookies import CookieError, SimpleCookie
from urllib.parse import parse_qsl, urlencode

from llmweb.config import Settings
from llmweb.runtime.secret import read_or_create_secret

TOKEN_FILE = "owner-token"
API_KEY_FILE = "local-api-key"
COOKIE_MAX_AGE_S = 400 * 24 * 3600  # the longest browsers keep a cookie
TOKEN_PARAM = "token"


@dataclass(frozen=True, slots=True)
class OwnerSecrets:
    """The owner link's token and the local API key of one data dir."""

    token: str
    api_key: str

    @property
    def cookie_name(self) -> str:
        """Per data dir (cookies ignore the port): two servers on one machine keep their cookies apart."""
        return "llmweb-owner-" + hashlib.sha256(self.token.encode()).hexdigest()[:12]


@functools.lru_cache(maxsize=16)
def owner_secrets(settings: Settings) -> OwnerSecrets:
    """The data dir's owner token and local API key (each created once: 256 bits, mode 600)."""
    return OwnerSecrets(
        read_or_create_secret(settings.data_dir / TOKEN_FILE),
        read_or_create_secret(settings.data_dir / API_KEY_FILE),
    )


def owner_link(settings: Settings, port: int | None = None) -> str:
    """The URL the owner opens first: this server with `?token=`."""
    host = "127.0.0.1" if settings.host in ("0.0.0.0", "::", "") else settings.host
    host = f"[{host}]" if ":" in host else host
    return f"http://{host}:{port or settings.port}/?{TOKEN_PARAM}={owner_secrets(settings).token}"


def owner_headers(settings: Settings) -> dict[str, str]:
    """The header a program on this machine sends to act as the owner (gradio_client, httpx, the SDK)."""
    return {"Authorization": f"Bearer {owner_secrets(settings).api_key}"}


def _same(given: str, expected: str) -> bool:
    return bool(given) and hmac.compare_digest(given.encode(), expected.encode())


def _cookie(headers, name: str) -> str:
    jar = SimpleCookie()
    try:
        jar.load(headers.get("cookie", ""))
    except CookieError:
        return ""
    morsel = jar.get(name)
    return morsel.value if morsel is not None else ""


def has_owner_cookie(settings: Settings, headers) -> bool:
    """Does this request carry the owner's cookie (set by the owner link)?"""
    secrets = owner_secrets(settings)
    return _same(_cookie(headers, secrets.cookie_name), secrets.token)


def bearer(headers) -> str:
    """The key of `Authorization: Bearer <key>` ("" without one)."""
    scheme, _, key = (headers.get("authorization") or "").partition(" ")
    return key.strip() if scheme.lower() == "bearer" else ""


def is_local_api_key(settings: Settings, key: str) -> bool:
    return _same(key, owner_secrets(settings).api_key)


def proves_owner(settings: Settings, headers) -> bool:
    """The owner's cookie, or the local API key as a Bearer token (a program of the owner's)."""
    return has_owner_cookie(settings, headers) or is_local_api_key(settings, bearer(headers))


class OwnerLink:
    """ASGI middleware in front of the app: a GET of the page (`/`) with `?token=` is answered with a redirect to the
    same URL without it, setting the owner's cookie when the token is right (a wrong one sets nothing:
    that browser stays a visitor). Every other request passes through untouched."""

    def __init__(self, app, settings: Settings):
        self.app, self.settings = app, settings

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope.get("method") != "GET" or scope.get("path") not in ("/", ""):
            return await self.app(scope, receive, send)
        query = parse_qsl(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True)
        given = [v for k, v in query if k == TOKEN_PARAM]
        if not given:
            return await self.app(scope, receive, send)
        rest = urlencode([(k, v) for k, v in query if k != TOKEN_PARAM])
        location = scope.get("root_path", "") + scope.get("path", "/") + (f"?{rest}" if rest else "")
        headers = [(b"location", location.encode("latin-1")), (b"content-length", b"0")]
        headers.append((b"cache-control", b"no-store"))
        secrets = owner_secrets(self.settings)
        if _same(given[-1], secrets.token):
            secure = "; Secure" if scope.get("scheme") == "https" else ""
            cookie = (
                f"{secrets.cookie_name}={secrets.token}; Path=/; Max-Age={COOKIE_MAX_AGE_S}; "
                f"HttpOnly; SameSite=Strict{secure}"
            )
            headers.append((b"set-cookie", cookie.encode("latin-1")))
        await send({"type": "http.response.start", "status": 303, "headers": headers})
        await send({"type": "http.response.body", "body": b""})
