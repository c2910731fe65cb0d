"""Request bodies capped in front of Gradio's routes, before anything parses them.

Gradio's own routes (/gradio_api/queue/join, /gradio_api/run/..., ...) read and parse a JSON body of any
size before login is checked: 50 MB of JSON held the event loop ~2 s and ~320 MB. `BodyCap` is an ASGI
middleware on the app: a declared Content-Length over the cap is refused with 413 before the route runs,
and a streamed (chunked) body is counted as it is read and cut off with 413 at the cap. Uploads
(/gradio_api/upload) may be as large as one owner may store (LLMWEB_USER_DOCS_MB; Gradio checks each
file against LLMWEB_MAX_FILE_MB itself); /v1 keeps its own limit (web/api/common.py, LLMWEB_API_MAX_BODY_KB).
It must not read a body itself or decide anything but its size.
"""

from __future__ import annotations

import json

from llmweb.config import Settings

UPLOAD_SLACK = 1 << 20  # multipart headers around the files


class _TooLarge(Exception):
    pass


class BodyCap:
    def __init__(self, app, max_bytes: int, upload_bytes: int):
        self.app, self.max_bytes, self.upload_bytes = app, max_bytes, upload_bytes

    @classmethod
    def options(cls, settings: Settings) -> dict:
        """The keyword arguments of Starlette's `Middleware(BodyCap, **options)`."""
        return {"max_bytes": settings.web_max_body_kb * 1024, "upload_bytes": settings.user_docs_mb * 2**20}

    def cap(self, path: str) -> int | None:
        if path == "/v1" or path.startswith("/v1/"):
            return None
        if path.rstrip("/").endswith("/upload"):
            return self.upload_bytes + UPLOAD_SLACK
        return self.max_bytes

    async def __call__(self, scope, receive, send):
        cap = self.cap(scope.get("path", "")) if scope["type"] == "http" else None
        if cap is None:
            return await self.app(scope, receive, send)
        declared = [v for k, v in scope.get("headers", []) if k.lower() == b"content-length"]
        try:
            size = int(declared[0]) if declared else None
        except ValueError:
            return await _refuse(send, 400, "a Content-Length that is not a number")
        if size is not None and size > cap:
            return await _refuse(send, 413, f"a request body over {cap // 1024} KB")
        seen, over, started = 0, False, False

        async def capped_receive():
            nonlocal seen, over
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > cap:
                    over = True
                    raise _TooLarge  # the route stops reading; whatever it answers, the visitor gets 413
            return message

        async def capped_send(message):
            nonlocal started
            if over:  # the route's answer to a body cut off (FastAPI's 400, say) becomes the 413
                if not started:
                    started = True
                    await _refuse(send, 413, f"a request body over {cap // 1024} KB")
                return
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, capped_receive, capped_send)
        except _TooLarge:
            if not started:
                started = True
                await _refuse(send, 413, f"a request body over {cap // 1024} KB")


async def _refuse(send, status: int, what: str) -> None:
    body = json.dumps({"detail": f"Refused: {what}."}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers + [(b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})
