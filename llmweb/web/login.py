"""The login form's `POST /login`, in front of Gradio's own: the same cookies, with a back-off.

Gradio's login route hands `launch(auth=...)` the name and password only, so it cannot back off per
client address. This route replaces it (cli/main.py puts it in front of Gradio's routes, with the
API's): it reads the client's address (web/trust.py, LLMWEB_TRUSTED_PROXIES), and while the name or
the address backs off after failed logins it refuses at once, without running scrypt, saying how
long to wait (web/accounts.py: `Accounts.check`; web/throttle.py). On success it makes Gradio's own
session: a random token in the app's `tokens`, in the same two HttpOnly cookies Gradio sets.

Login CSRF: a form another site's page posts here (its `Origin`, or without one its `Referer`, is not
this server's Host, or `Sec-Fetch-Site: cross-site`) is refused with 403 before any check, so no page
can log a visitor in to an account of its choosing. A back-off's refusal is a 400 like a wrong password
(Gradio's login page shows its message only for a 400), with the wait in `detail` and `Retry-After`.
This module must not decide an owner (identity.py does).
"""

from __future__ import annotations

import asyncio
import secrets
from urllib.parse import urlsplit

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from llmweb.config import Settings
from llmweb.web.accounts import accounts_for
from llmweb.web.throttle import LoginBackoff
from llmweb.web.trust import headers_of, origin_of

MAX_FORM_FIELD = 4096  # characters of a name or password read from the form


def login_routes(settings: Settings) -> list:
    """`POST /login` (and `/login/`) when login is on; nothing otherwise."""
    if not settings.login:
        return []
    accounts = accounts_for(settings)

    async def login(request: Request) -> Response:
        if _cross_site(request):
            return JSONResponse({"detail": "Log in from this site's own login page."}, status_code=403)
        form = await request.form()
        username = str(form.get("username") or "")[:MAX_FORM_FIELD].strip()
        password = str(form.get("password") or "")[:MAX_FORM_FIELD]
        address = origin_of(settings, request).group  # an IPv6 client's /64 backs off as one
        try:
            ok = await asyncio.to_thread(accounts.check, username, password, address)
        except LoginBackoff as e:
            return JSONResponse({"detail": str(e)}, status_code=400, headers={"Retry-After": str(e.wait_s)})
        if not ok:
            return JSONResponse({"detail": "Incorrect credentials."}, status_code=400)
        return _session(request, username)

    router = APIRouter()
    for path in ("/login", "/login/"):
        router.add_api_route(path, login, methods=["POST"], include_in_schema=False)
    return list(router.routes)


def _cross_site(request: Request) -> bool:
    """Posted by another site's page? The Origin (else the Referer) must name this server as the browser
    reached it: the Host, or a proxy's X-Forwarded-Host (a page cannot add headers to a form it posts)."""
    headers = headers_of(request)
    if headers.get("sec-fetch-site", "").lower() == "cross-site":
        return True
    source = headers.get("origin") or headers.get("referer")
    if source is None:
        return False  # not a browser's cross-site post (curl, gradio_client)
    ours = {h.strip().lower() for h in (headers.get("host") or "", headers.get("x-forwarded-host") or "") if h}
    return urlsplit(source.strip()).netloc.lower() not in ours


def _session(request: Request, username: str) -> Response:
    """Gradio's own login session: its `app.tokens` and its two cookies."""
    app = request.app
    token = secrets.token_urlsafe(16)
    app.tokens[token] = username
    response = JSONResponse(content={"success": True})
    response.set_cookie(key=f"access-token-{app.cookie_id}", value=token, httponly=True, samesite="none", secure=True)
    response.set_cookie(key=f"access-token-unsecure-{app.cookie_id}", value=token, httponly=True)
    return response
