"""Request bodies checked in front of Gradio's routes, before anything parses them.

FastAPI reads, parses and validates a route's body on the event loop, before the route's login
check, and its 422 quotes the input: one request could hold every other one. `BodyCap` is an ASGI
middleware on the app that decides per route (the path under the app's root, matched exactly):

  - the page's events (`/gradio_api/queue/join`, and the API's `run/`, `api/`, `call/` routes):
    at most LLMWEB_WEB_MAX_BODY_KB, read here, and refused unless they are one JSON object of
    bounded size (web/json_body.py: a list is refused by its first byte, a large object parsed on a
    worker thread); Gradio then gets the same bytes;
  - Gradio's small control routes (cancel, reset) and the login form: `SMALL_BYTES`;
  - the upload route `/gradio_api/upload` (only that path: `call/{name}` takes any name): as large as
    one owner may store (LLMWEB_USER_DOCS_MB; Gradio checks each file against LLMWEB_MAX_FILE_MB), and
    at most LLMWEB_UPLOAD_PER_ADDRESS_MB from one client address (web/trust.py's group: an IPv6 /64)
    within the life of Gradio's upload cache (`UploadBudget`), so no visitor fills the cache;
  - routes llmweb does not use (`CLOSED`: recording, streaming media, run history, vibe editing,
    component servers, profiling): 404 before they read anything;
  - `/v1`: its own limits (web/api/common.py, LLMWEB_API_MAX_BODY_KB); anything else: `SMALL_BYTES`.

A declared Content-Length over the cap is refused with 413 before the route runs; a streamed
(chunked) body is counted as it is read and cut off at the cap. With login on, a body-taking route
without a login session is refused with 401 before its body is read. `validation_handlers` make
FastAPI's 422 name the fields that did not fit, never the values it got.
It must not decide anything about a body but its size, its shape and whether the sender is logged in.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from llmweb.config import Settings
from llmweb.web.json_body import BodyError, parse_object

UPLOAD_SLACK = 1 << 20  # multipart headers around the files
SMALL_BYTES = 64 << 10  # the login form, Gradio's control routes and anything not named here
UPLOAD_ROUTE = "/gradio_api/upload"
EVENT_ROUTE = re.compile(r"^/gradio_api/(queue/join|(run|api|call|call/v2)/[^/]+)$")
CONTROL_ROUTES = ("/gradio_api/cancel", "/gradio_api/reset")
LOGIN_ROUTE = "/login"
CLOSED = (  # under /gradio_api/: routes of Gradio's that llmweb's page never calls
    "process_recording",
    "stream",
    "run-history",
    "vibe-edit",
    "undo-vibe-edit",
    "vibe-code",
    "vibe-starter-queries",
    "component_server",
    "profiling",
)
MAX_ADDRESSES = 10_000  # client addresses whose uploads are counted at once (least recent dropped)


@dataclass(frozen=True, slots=True)
class Rule:
    """What a route's body may be: `cap` bytes (None: not this middleware's), a JSON object or not,
    whether it needs a login session (with login on), whether it is the upload route, or closed."""

    cap: int | None
    json: bool = False
    login: bool = False
    upload: bool = False
    closed: bool = False


PASS = Rule(None)


class _TooLarge(Exception):
    pass


class UploadBudget:
    """At most `limit` bytes uploaded per client address group within `window_s`. In memory, bounded."""

    def __init__(self, limit: int, window_s: float, clock: Callable[[], float] = time.monotonic):
        self.limit, self.window_s, self._clock = limit, window_s, clock
        self._lock = threading.Lock()
        self._sent: OrderedDict[str, list[tuple[float, int]]] = OrderedDict()  # group -> (when, bytes)

    def charge(self, group: str, size: int) -> float:
        """Count `size` more bytes from `group`: 0 when they fit, else the seconds until they would."""
        now = self._clock()
        with self._lock:
            sent = [(t, n) for t, n in self._sent.pop(group, []) if now - t < self.window_s]
            used = sum(n for _, n in sent)
            wait = 0.0
            if used + size > self.limit:
                freed, wait = used + size - self.limit, self.window_s
                for t, n in sent:  # oldest first: wait until enough of them leave the window
                    freed -= n
                    if freed <= 0:
                        wait = t + self.window_s - now
                        break
            else:
                sent.append((now, size))
            self._sent[group] = sent
            while len(self._sent) > MAX_ADDRESSES:
                self._sent.popitem(last=False)
            return max(wait, 0.0)


class BodyCap:
    def __init__(self, app, settings: Settings, upload_window_s: float):
        self.app, self.settings = app, settings
        self.max_bytes, self.upload_bytes = settings.web_max_body_kb * 1024, settings.user_docs_mb * 2**20
        self.uploads = UploadBudget(settings.upload_per_address_mb * 2**20, upload_window_s)

    @classmethod
    def options(cls, settings: Settings, upload_window_s: float) -> dict:
        """The keyword arguments of Starlette's `Middleware(BodyCap, **options)`."""
        return {"settings": settings, "upload_window_s": upload_window_s}

    def rule(self, path: str) -> Rule:
        """The rule for `path` (under the app's root), matched exactly."""
        path = path.rstrip("/") or "/"
        if path == "/v1" or path.startswith("/v1/"):
            return PASS
        if path.startswith("/gradio_api/") and path.split("/")[2] in CLOSED:
            return Rule(0, closed=True)
        if path == UPLOAD_ROUTE:
            return Rule(self.upload_bytes + UPLOAD_SLACK, login=True, upload=True)
        if EVENT_ROUTE.match(path):
            return Rule(self.max_bytes, json=True, login=True)
        if path in CONTROL_ROUTES:
            return Rule(SMALL_BYTES, json=True, login=True)
        return Rule(SMALL_BYTES)

    def cap(self, path: str) -> int | None:
        return self.rule(path).cap

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        rule = self.rule(_route_path(scope))
        if rule.cap is None:
            return await self.app(scope, receive, send)
        if rule.closed:
            return await _refuse(send, 404, "Not found.")
        if rule.login and self.settings.login and not _logged_in(scope):
            return await _refuse(send, 401, "Not authenticated: log in first.")
        declared = [v for k, v in scope.get("headers", []) if k.lower() == b"content-length"]
        try:
            size = int(declared[0]) if declared else None
        except ValueError:
            return await _refuse(send, 400, "Refused: a Content-Length that is not a number.")
        if size is not None and size > rule.cap:
            return await _too_large(send, rule.cap)
        if rule.upload and size:
            wait = self.uploads.charge(self._group(scope), size)
            if wait:
                return await _over_budget(send, self.settings, wait)
        if rule.json and scope.get("method") in ("POST", "PUT", "PATCH"):
            return await self._json(scope, receive, send, rule.cap)
        await self._capped(scope, receive, send, rule, counted=rule.upload and size is None)

    def _group(self, scope) -> str:
        from starlette.requests import Request

        from llmweb.web.trust import origin_of

        return origin_of(self.settings, Request(scope)).group

    async def _json(self, scope, receive, send, cap: int) -> None:
        """Read the whole body (up to `cap`), refuse it unless it is one bounded JSON object, then hand
        Gradio the same bytes."""
        chunks, seen = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left
            seen += len(message.get("body", b""))
            if seen > cap:
                return await _too_large(send, cap)
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        if body.strip():
            try:
                _check_event(scope, await parse_object(body))
            except BodyError as e:
                return await _refuse(send, e.status, str(e))
        given = False

        async def replay():
            nonlocal given
            if not given:
                given = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _capped(self, scope, receive, send, rule: Rule, counted: bool) -> None:
        """The route reads its body itself; cut it off with 413 past the cap (and 429 past the
        address's upload budget when the upload's size was not declared)."""
        cap, seen, over, started = rule.cap or 0, 0, "", False
        group = self._group(scope) if counted else ""

        async def capped_receive():
            nonlocal seen, over
            message = await receive()
            if message["type"] == "http.request":
                n = len(message.get("body", b""))
                seen += n
                if seen > cap:
                    over = "size"
                    raise _TooLarge  # the route stops reading; whatever it answers, the visitor gets 413
                if counted and n and self.uploads.charge(group, n):
                    over = "budget"
                    raise _TooLarge
            return message

        async def refuse():
            if over == "budget":
                return await _over_budget(send, self.settings, self.uploads.window_s)
            return await _too_large(send, cap)

        async def capped_send(message):
            nonlocal started
            if over:  # the route's answer to a body cut off (FastAPI's 400, say) becomes the refusal
                if not started:
                    started = True
                    await refuse()
                return
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, capped_receive, capped_send)
        except _TooLarge:
            if not started:
                started = True
                await refuse()


def _check_event(scope, body: dict) -> None:
    """BodyError 422 for an event whose `data` is not a list, or shorter than its handler's inputs:
    Gradio's own error for that quotes every value it got, in the log and to the visitor."""
    if "data" not in body:
        return
    data = body["data"]
    if not isinstance(data, list):
        raise BodyError("The event's data must be a list.", status=422)
    blocks = getattr(scope.get("app"), "get_blocks", lambda: None)()
    fns = getattr(blocks, "fns", {})
    fn = fns.get(body.get("fn_index")) if isinstance(body.get("fn_index"), int) else None
    needed = len(fn.inputs) if fn is not None else 0
    if fn is None and "fn_index" not in body:  # an API name: the inputs the API shows (Gradio adds the rest)
        name = _route_path(scope).rstrip("/").rsplit("/", 1)[-1]
        fn = next((f for f in fns.values() if getattr(f, "api_name", None) == name), None)
        needed = sum(not getattr(b, "skip_api", False) for b in fn.inputs) if fn is not None else 0
    if len(data) < needed:
        raise BodyError(f"The event needs {needed} values in its data, not {len(data)}.", status=422)


def _route_path(scope) -> str:
    """The request's path under the app's root (a mount or a proxy's root path)."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root) else path


def _logged_in(scope) -> bool:
    """Does the request carry one of Gradio's login sessions (its cookies, the app's `tokens`)?"""
    from starlette.requests import cookie_parser

    app = scope.get("app")
    tokens, cookie_id = getattr(app, "tokens", None), getattr(app, "cookie_id", None)
    if not isinstance(tokens, dict) or cookie_id is None:
        return False
    raw = b"; ".join(v for k, v in scope.get("headers", []) if k.lower() == b"cookie").decode("latin-1")
    cookies = cookie_parser(raw)
    token = cookies.get(f"access-token-{cookie_id}") or cookies.get(f"access-token-unsecure-{cookie_id}")
    return token is not None and token in tokens


async def _over_budget(send, settings: Settings, wait_s: float) -> None:
    wait = round(wait_s + 1)
    detail = f"Refused: your network uploaded {settings.upload_per_address_mb} MB lately; try again in {wait} s."
    await _refuse(send, 429, detail, {"Retry-After": str(wait)})


async def _too_large(send, cap: int) -> None:
    await _refuse(send, 413, f"Refused: a request body over {cap // 1024} KB.")


async def _refuse(send, status: int, detail: str, headers: dict[str, str] | None = None) -> None:
    body = json.dumps({"detail": detail}).encode()
    extra = [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    head = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": head + extra + [(b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


def validation_handlers() -> dict:
    """FastAPI's `exception_handlers` for a request that does not fit its route: a 422 that names where
    (at most 5 places, each part cut to 40 characters) and never quotes the input."""
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse

    async def short_422(_request, exc: RequestValidationError):
        errors = [
            {"type": str(e.get("type", ""))[:40], "loc": [str(p)[:40] for p in list(e.get("loc", ()))[:6]]}
            for e in list(exc.errors())[:5]
        ]
        return JSONResponse({"detail": errors}, status_code=422)

    return {RequestValidationError: short_422}
