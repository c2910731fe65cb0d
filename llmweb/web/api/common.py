"""What every endpoint family of the API shares: reading a request's body within its limit and as
JSON, the checks of one JSON field (and the refusal of a feature by name), OpenAI's `Usage`, and
moving a blocking turn's events to the event loop (`Pump`) and out as server-sent events
(`EventStream`, `sse`).

A turn blocks (it waits on the engine), so each request's turn runs on its own thread (`Pump`), and
the event loop only moves its events. A client that disconnects (streaming or not: `whole_reply`)
cancels its engine request at once (`Pump.close`): it stops within a token.

Owns: the body's size limit (LLMWEB_API_MAX_BODY_KB) and media type, JSON's parsing, the stream's
framing. Must not know any family's fields, run a turn itself, or work out who is calling.
"""

from __future__ import annotations

import asyncio
import json
import math
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from llmweb.chat.session import Started
from llmweb.chat.tokens import token_bytes
from llmweb.chat.turn import Cancel
from llmweb.engine.request import TokenLogprob
from llmweb.web import json_body
from llmweb.web.api.errors import ApiError, bad

# ---- the request's body


async def read_body(request: Request, cap: int) -> bytes:
    """The request body, refused (413) past `cap` bytes, whatever Content-Length says."""
    too_big = ApiError(
        413,
        f"The request body is over {cap // 1024:,} KB (LLMWEB_API_MAX_BODY_KB). Send fewer or shorter messages.",
        code="request_too_large",
    )
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > cap:
        raise too_big
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > cap:
            raise too_big
        parts.append(part)
    return b"".join(parts)


def require_json(request: Request) -> None:
    """415 unless the body is declared JSON: a page of another site can POST text/plain or a form
    without asking the browser first (CSRF), but never application/json."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind != "application/json":
        raise ApiError(
            415,
            "Send the body as JSON, with the header Content-Type: application/json.",
            code="unsupported_media_type",
        )


async def parse_body(raw: bytes) -> dict[str, Any]:
    """`parse_json`, on a worker thread when `raw` is large, so the event loop answers others meanwhile."""
    if len(raw) <= json_body.INLINE_BYTES:
        return parse_json(raw)
    return await asyncio.to_thread(parse_json, raw)


def parse_json(raw: bytes) -> dict[str, Any]:
    """`raw` as a JSON object: anything else is refused by its first byte, and a body of more values
    than `json_body.MAX_ELEMENTS` by a count of its separators, before anything parses it."""
    if raw.lstrip(b" \t\r\n")[:1] != b"{":
        raise bad("The request body must be a JSON object.", code="invalid_json")
    if json_body.count_values(raw) > json_body.MAX_ELEMENTS:
        message = f"The request body holds more than {json_body.MAX_ELEMENTS:,} JSON values."
        raise ApiError(413, message, code="invalid_json")
    try:
        body = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise bad("The request body is not UTF-8 text.", code="invalid_json") from None
    except json.JSONDecodeError as e:
        where = f"{e.msg} at line {e.lineno} column {e.colno}"
        raise bad(f"The request body is not valid JSON: {where}.", code="invalid_json") from None
    except RecursionError:  # "[[[[..." deeper than the interpreter's recursion limit
        field = deep_field(raw)
        where = f" (in {field})" if field else ""
        raise bad(f"The request body nests JSON arrays or objects too deeply{where}.", field, "invalid_json") from None
    if not isinstance(body, dict):
        raise bad("The request body must be a JSON object.", code="invalid_json")
    return body


# ---- one field of a JSON body


def deep_field(raw: bytes, deep: int = 64) -> str | None:
    """The top-level field of a JSON object whose value nests deeper than `deep`: one linear scan."""
    depth, key, in_string, escaped, start = 0, None, False, False, 0
    for i, b in enumerate(raw):
        if in_string:
            if escaped:
                escaped = False
            elif b == 0x5C:  # backslash
                escaped = True
            elif b == 0x22:  # the closing quote
                in_string = False
                if depth == 1 and raw[i + 1 : i + 64].lstrip()[:1] == b":":
                    key = raw[start:i].decode("utf-8", "replace")[:100]
        elif b == 0x22:
            in_string, start = True, i + 1
        elif b in b"[{":
            depth += 1
            if depth > deep:
                return key
        elif b in b"]}":
            depth -= 1
    return None


def same(value: Any, neutral: Any) -> bool:
    """Equal, and of the same JSON kind (True is not 1 here)."""
    return type(value) is type(neutral) and value == neutral or (neutral is None and value is None)


def optional(d: Mapping[str, Any], name: str, kind: type, param: str | None = None) -> Any:
    """`d[name]` when it is of `kind`, None when absent or null; 400 naming `param` otherwise."""
    value = d.get(name)
    if value is None:
        return None
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise bad(f"{param or name} must be an integer.", param or name, "invalid_type")
    if not isinstance(value, kind):
        noun = {bool: "a boolean", str: "a string", dict: "an object"}.get(kind, kind.__name__)
        raise bad(f"{param or name} must be {noun}.", param or name, "invalid_type")
    return value


def number(body: Mapping[str, Any], name: str, low: float, high: float, low_open: bool = False) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise bad(f"{name} must be a number.", name, "invalid_type")
    if value > high or value < low or (low_open and value == low):
        raise bad(f"{name} must be {'>' if low_open else '>='} {low:g} and <= {high:g}, not {value}.", name)
    return float(value)


def checked_fields(body: Mapping[str, Any], known: Any, neutral: Mapping[str, tuple[Any, ...]]) -> None:
    """Refuse, as OpenAI does, a field the endpoint does not know, and one it does not implement
    (`neutral`: the values that change nothing) unless it holds a neutral value."""
    for name in body:
        if name not in known:
            raise bad(f"Unrecognized request argument supplied: {name}", name, "unknown_parameter")
    for name, values in neutral.items():
        if name in body and not any(same(body[name], v) for v in values):
            raise bad(unsupported(name), name, "unsupported_parameter")


def model_named(body: Mapping[str, Any], models: Sequence[str]) -> str:
    """The body's `model`: one of `models`, else a 400 (missing) or 404 (unknown) as OpenAI answers."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("You must provide a model (GET /v1/models lists it).", "model", "missing_required_parameter")
    if model not in models:
        raise ApiError(
            404,
            f"The model {model[:100]!r} does not exist here; this server has {', '.join(map(repr, models))}.",
            type="not_found_error",
            code="model_not_found",
            param="model",
        )
    return model


def unsupported(name: str) -> str:
    """The refusal of an OpenAI feature this server does not implement, by its field's name."""
    why = {
        "n": "n > 1 is not supported: one choice per request.",
        "tools": "tools are not supported by this server.",
        "functions": "functions are not supported by this server.",
        "response_format": 'only response_format {"type": "text"} is supported.',
        "modalities": 'only modalities ["text"] is supported.',
        "tool_calls": "tool calls are not supported by this server.",
    }
    return why.get(name, f"{name} is not supported by this server.")


# ---- what a reply cost, in OpenAI's usage object


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int | None = 0  # prompt tokens served from the conversation's KV cache; None: not reported

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }
        if self.cached_tokens is not None:  # a remote engine that did not say: no invented figure
            out["prompt_tokens_details"] = {"cached_tokens": self.cached_tokens}
        return out


# ---- log-probabilities, as the API writes them


def logprob_entries(fmt, logprobs: Sequence[TokenLogprob]) -> list[dict[str, Any]]:
    """OpenAI's `logprobs.content`: per token its text, log-probability, UTF-8 bytes and the most likely
    tokens' (`fmt` turns ids into bytes: chat/tokens.py `token_bytes`)."""

    def one(token: int, logprob: float) -> dict[str, Any]:
        raw = token_bytes(fmt, token)
        return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(raw)}

    return [{**one(lp.id, lp.logprob), "top_logprobs": [one(i, v) for i, v in lp.top]} for lp in logprobs]


def within(fmt, logprobs: Sequence[TokenLogprob], size: int) -> list[TokenLogprob]:
    """The tokens that begin within the reply's first `size` bytes (a stop string cut the rest away)."""
    kept, at = [], 0
    for lp in logprobs:
        if at >= size:
            break
        kept.append(lp)
        at += len(token_bytes(fmt, lp.id))
    return kept


def logprobs_unsupported() -> ApiError:
    """The refusal of log-probabilities where the engine cannot give them (a remote server's)."""
    return bad(
        "logprobs are not available with this server's engine (a remote server: its reply is tokenised again here).",
        "logprobs",
        "unsupported_parameter",
    )


def logprobs_supported(engine) -> bool:
    return getattr(getattr(engine, "runner", None), "logprobs", True) is not False


# ---- a turn's events, from its thread to the client

_END = object()


class _Failed:
    def __init__(self, error: BaseException):
        self.error = error


class Pump:
    """Runs one blocking chat turn on its own thread and hands its events to the event loop.
    `close()` (client gone) cancels the engine request and ends the turn after its next event."""

    def __init__(self, events: Iterator, cancel: Cancel):
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue = asyncio.Queue()
        self._stop = threading.Event()
        self._cancel = cancel
        self._thread = threading.Thread(target=self._run, args=(events,), name="llmweb-api-turn", daemon=True)
        self._thread.start()

    def _run(self, events: Iterator) -> None:
        try:
            for event in events:
                self._put(event)
                if self._stop.is_set():
                    break
        except BaseException as e:  # handed to the request; the turn's own `finally` already ran
            self._put(_Failed(e))
        finally:
            close = getattr(events, "close", None)
            if close is not None:
                close()  # a turn left early: the chat cancels its request and keeps the partial reply
            self._put(_END)

    def _put(self, item) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the event loop is gone (shutdown): nobody is listening
            self._stop.set()

    async def next(self):
        """The next event; None at the end; raises the turn's error."""
        item = await self._queue.get()
        if item is _END:
            self._queue.put_nowait(_END)  # stays ended
            return None
        if isinstance(item, _Failed):
            raise item.error
        return item

    async def until_started(self) -> list:
        """The events before `Started` (a stateless turn's `Fitted`); the turn's errors until then."""
        early: list = []
        while True:
            event = await self.next()
            if event is None:
                raise ApiError(500, "The chat turn ended before it started.", type="server_error")
            if isinstance(event, Started):
                return early
            early.append(event)

    def close(self) -> None:
        """The client is gone: stop the engine request and end the turn."""
        self._stop.set()
        self._cancel.cancel()


class EventStream(StreamingResponse):
    """Server-sent events that call `on_close` however the response ends (done, client gone, error)."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[bytes], on_close, headers: dict[str, str]):
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers})
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def sse(data: dict[str, Any] | str) -> bytes:
    """One server-sent event: `data: <json>` and a blank line."""
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {text}\n\n".encode()


async def whole_reply(
    pump: Pump,
    request: Request,
    take: Callable[[Any], Response | None],
    failed: Callable[[BaseException], Response],
    ended: str,
) -> Response:
    """A reply without streaming: each of the turn's events goes to `take` until it returns the
    response; the turn's error, or its end without a reply (`ended`), goes to `failed`. A client
    that leaves first cancels the engine request (`Pump.close`), and nobody reads the 499."""
    gone = asyncio.ensure_future(disconnected(request))
    try:
        while True:
            step = asyncio.ensure_future(pump.next())
            await asyncio.wait({step, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not step.done():
                step.cancel()
                pump.close()
                return Response(status_code=499)
            try:
                event = step.result()
            except Exception as e:
                return failed(e)
            if event is None:
                return failed(ApiError(500, ended, type="server_error"))
            response = take(event)
            if response is not None:
                return response
    finally:
        gone.cancel()


async def disconnected(request: Request) -> None:
    """Returns when the client has gone (the body is already read: what comes next is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
