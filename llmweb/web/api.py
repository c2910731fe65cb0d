"""The OpenAI-compatible API, on the UI's port: `GET /v1/models`, `POST /v1/chat/completions`, and
llmweb's own `GET /v1/x_llmweb/passage` (a cited source's passage, by the place its citation gives).

`api_routes(runtime)` returns the routes; cli/main.py hands them to Gradio's FastAPI app
(`launch(app_kwargs={"routes": ...})`), so `python -m llmweb serve` serves both on one port. This
module is transport only: who is calling (web/identity.py), reading a bounded body,
events to JSON or server-sent events (web/api_wire.py), errors to status codes. The turn itself is
the chat path's: stateful requests run `Chat.send` (history, summary, facts, recall, retrieval,
the store: the conversation shows in its owner's list), stateless ones `StatelessChat.send`
(chat/stateless.py: the client's messages fitted into the budget). Both go through the one engine
queue, so a full queue is a 429 here as it is a "busy" message in the UI.

Who the caller is and which owner they act for is web/identity.py's (`ApiCallers`, per request): a
key of user alice acts for "user:alice" (her conversations in the UI), and on a loopback bind
without login the key in data_dir/local-api-key acts for the single user (web/owner.py); there is
no keyless API. A page of another site is refused (its Origin; a body that is not application/json), and so
is a Host that is not this machine on a loopback bind (DNS rebinding). This module must not work
out an owner itself.

A chat turn blocks (it waits on the engine), so each request's turn runs on its own thread
(`_Pump`), and the event loop only moves its events. A client that disconnects (streaming or
not) cancels its engine request at once: it stops within a token, and a stateful turn keeps the
partial reply, marked as stopped, as the UI's Stop button does.

Sampling (temperature, top_p, max_tokens) and `stop` strings go to the turn with the request
(chat/turn.py: `Sampling`; the turn cancels its engine request at the first stop string), and a
`Cancel` lets a client that leaves stop it from the event loop; the reply shown is cut before
the stop string here (StopScanner).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import threading
import time
import weakref
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from llmweb.chat.passages import Passage, open_source
from llmweb.chat.session import Delta, Finished, Progress, Queued, Started
from llmweb.chat.stateless import Fitted, StatelessChat
from llmweb.chat.turn import Cancel, Sampling
from llmweb.errors import (
    AdmissionError,
    BusyError,
    Cancelled,
    ConfigError,
    EngineStopped,
    InputError,
    LlmwebError,
    OutOfMemory,
    TimedOut,
)
from llmweb.store.models import NotFound, new_id
from llmweb.web import api_models
from llmweb.web.api_wire import (
    NEW_CONVERSATION,
    ApiError,
    ChatRequest,
    Completion,
    PassageQuery,
    StopScanner,
    Usage,
    bad,
    finish_reason,
    model_object,
    parse_json,
    parse_passage_query,
    parse_request,
    passage_object,
    sse,
)
from llmweb.web.failures import public_message
from llmweb.web.identity import ApiCallers, Caller
from llmweb.web.login import login_routes

log = logging.getLogger(__name__)

RETRY_AFTER_S = 2  # what a 429 / 503 tells the client to wait
ENDPOINTS = "GET /v1/models, GET /v1/models/{id}, POST /v1/chat/completions, GET /v1/x_llmweb/passage"


def api_routes(runtime) -> list:
    """The API's routes, to put in front of Gradio's own (they take precedence); with them, when login
    is on, the login form's route with its back-off (web/login.py)."""
    api = OpenAIApi(runtime)
    router = APIRouter()
    router.add_api_route("/v1/models", api.models, methods=["GET"], include_in_schema=False)
    router.add_api_route("/v1/models/{model_id:path}", api.model, methods=["GET"], include_in_schema=False)
    router.add_api_route("/v1/chat/completions", api.chat_completions, methods=["POST"], include_in_schema=False)
    router.add_api_route("/v1/x_llmweb/passage", api.passage, methods=["GET"], include_in_schema=False)
    router.add_api_route(
        "/v1/{path:path}", api.unknown, methods=["GET", "POST", "PUT", "PATCH", "DELETE"], include_in_schema=False
    )
    return list(router.routes) + login_routes(runtime.settings)


class OpenAIApi:
    def __init__(self, runtime):
        self.runtime = runtime
        self.settings = runtime.settings
        self.callers = ApiCallers(self.settings)
        self.created = int(time.time())
        self._stateless: weakref.WeakKeyDictionary[Any, StatelessChat] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def model_names(self) -> list[str]:
        return api_models.names(self.runtime)

    # ---- routes
    async def models(self, request: Request) -> Response:
        try:
            self.callers.caller(request)
        except ApiError as e:
            return error_response(e)
        return JSONResponse({"object": "list", "data": api_models.objects(self.runtime, self.created)})

    async def model(self, request: Request, model_id: str) -> Response:
        try:
            self.callers.caller(request)
            if model_id not in self.model_names():
                message = f"The model {model_id[:100]!r} does not exist here."
                raise ApiError(404, message, type="not_found_error", code="model_not_found")
        except ApiError as e:
            return error_response(e)
        found = [m for m in api_models.objects(self.runtime, self.created) if m["id"] == model_id]
        return JSONResponse(found[0] if found else model_object(model_id, self.created))

    async def unknown(self, request: Request, path: str) -> Response:
        known = {"models": "GET", "chat/completions": "POST", "x_llmweb/passage": "GET"}
        if path in known:
            e = ApiError(405, f"Use {known[path]} for /v1/{path}.", code="method_not_allowed")
        else:
            e = ApiError(404, f"Unknown endpoint /v1/{path[:100]}; this server has {ENDPOINTS}.", code="unknown_url")
        return error_response(e)

    async def chat_completions(self, request: Request) -> Response:
        lease = None
        try:
            caller = self.callers.caller(request)
            require_json(request)
            body = parse_json(await read_body(request, self.settings.api_max_body_kb * 1024))
            req = parse_request(body, self.model_names(), self.settings.max_message_chars, request.headers)
            # the model that answers, held until the turn's events end (the pump's thread runs them)
            lease = await run_in_threadpool(api_models.ensure, self.runtime, caller, req.model)
            turn = self.start(caller, req, lease.chat)
            pump = _Pump(lease.around(turn.events), turn.cancel)
            try:
                early = await pump.until_started()
            except BaseException:
                pump.close()
                raise
        except Exception as e:
            if lease is not None:
                lease.release()  # again from the pump's thread is a no-op
            return error_response(e if isinstance(e, ApiError) else api_error(e))
        fitted = next((e for e in early if isinstance(e, Fitted)), None)
        reply = _Reply(req, turn, fitted, Completion(lease.model_id, "chatcmpl-" + secrets.token_hex(12)))
        if req.stream:
            return _EventStream(reply.stream(pump), on_close=pump.close, headers=reply.headers(None))
        return await reply.whole(pump, request)

    async def passage(self, request: Request) -> Response:
        """A cited source's passage, by the place `x_llmweb.sources[i]` gives (chat/passages.py), in
        what the key's owner may read; 404 for any other place, whatever the reason."""
        try:
            caller = self.callers.caller(request)
            query = parse_passage_query(request.query_params)
            found = await asyncio.to_thread(self._passage, caller, query)
        except ApiError as e:
            return error_response(e)
        except Exception as e:
            return error_response(api_error(e))
        if found is None:
            message = "No passage of yours is at that place (its document or turn may be gone, or changed)."
            return error_response(ApiError(404, message, type="not_found_error", code="passage_not_found"))
        return JSONResponse(passage_object(found))

    def _passage(self, caller: Caller, query: PassageQuery) -> Passage | None:
        conv_id, conv = query.conversation_id, None
        owner = caller.of_conversation(conv_id) if conv_id else caller.stateless_owner
        if conv_id:
            if not self.runtime.store.exists(owner, conv_id):
                return None
            conv = self.runtime.store.get(owner, conv_id)
        if query.source.kind == "recall" and conv is None:
            return None
        return open_source(self.runtime.library, owner, conv, query.source)

    # ---- the turn
    def start(self, caller: Caller, req: ChatRequest, chat) -> _Turn:
        """Start the chat turn for `req` on `chat` (nothing runs until its events are read)."""
        cap = chat.budget.max_new_tokens
        max_tokens = chat.budget.capped(req.max_tokens).max_new_tokens
        sampling, cancel = Sampling(req.temperature, req.top_p, max_tokens, req.loop_guard), Cancel()
        notes = []
        if req.max_tokens is not None and req.max_tokens > cap:
            notes.append(f"max_tokens was capped at {cap} (the reply budget, LLMWEB_MAX_NEW_TOKENS).")
        if req.stateful:
            new = req.conversation_id == NEW_CONVERSATION
            conv_id = new_id() if new else str(req.conversation_id)
            owner = caller.of_conversation(conv_id)
            if not new and not chat.store.exists(owner, conv_id):
                raise ApiError(
                    404,
                    'There is no conversation with this id for your key. Start one with conversation_id "new".',
                    type="not_found_error",
                    code="conversation_not_found",
                    param="conversation_id",
                )
            use_docs = True if req.use_docs is None else req.use_docs
            whole = {"whole_document": True} if req.whole_document else {}
            events = chat.send(
                owner,
                conv_id,
                req.messages[0].text,
                new=new,
                use_docs=use_docs,
                seed=req.seed,
                sampling=sampling,
                stop=req.stop,
                cancel=cancel,
                documents=req.documents,
                **whole,
            )
            return _Turn(events, cancel, "stateful", conv_id, max_tokens, notes)
        owner = caller.stateless_owner
        if req.whole_document:  # the last user message, over one of the caller's documents
            text = next((m.text for m in reversed(req.messages) if m.role == "user"), "")
            only = None
            if req.documents is not None and chat.library is not None:
                only = frozenset(i for i, _ in chat.library.resolve(owner, req.documents))
            intent = chat.documents.detect(owner, text, force=True, only=only)
            if intent is None:
                raise bad("x_llmweb.whole_document: name one of your documents in the message.", "x_llmweb")
            events = chat.documents.stream(owner, intent, cancel)
            return _Turn(events, cancel, "stateless", None, max_tokens, notes)
        events = self.stateless(chat).send(
            owner,
            [(m.role, m.text) for m in req.messages],
            use_docs=bool(req.use_docs),
            seed=req.seed,
            sampling=sampling,
            stop=req.stop,
            cancel=cancel,
            documents=req.documents,
        )
        return _Turn(events, cancel, "stateless", None, max_tokens, notes)

    def stateless(self, chat) -> StatelessChat:
        """The stateless path over `chat`'s engine: one per loaded model's chat (its summaries are that
        model's), gone with the chat."""
        with self._lock:
            found = self._stateless.get(chat)
            if found is None:
                found = self._stateless[chat] = StatelessChat(
                    self.settings, chat.engine, chat.fmt, chat.budget, chat.folds.summariser.write, chat.library
                )
                found.runner.model = chat.runner.model  # its turns' stats name the model, as the chat's do
            return found


@dataclass
class _Turn:
    events: Iterator
    cancel: Cancel  # the turn's engine request, stopped when the client leaves
    mode: str  # stateful | stateless
    conv_id: str | None
    max_tokens: int
    notes: list[str]


_END = object()


class _Failed:
    def __init__(self, error: BaseException):
        self.error = error


class _Pump:
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


class _EventStream(StreamingResponse):
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


class _Reply:
    """One response being written: the request, its turn, the reply text as stop strings allow it."""

    def __init__(self, req: ChatRequest, turn: _Turn, fitted: Fitted | None, completion: Completion):
        self.req, self.turn, self.fitted, self.c = req, turn, fitted, completion
        self.scanner = StopScanner(req.stop)
        self.cut = ""  # the reply up to the stop string, once one appeared

    def headers(self, finished: Finished | None) -> dict[str, str]:
        h = {"X-Llmweb-Mode": self.turn.mode}
        if self.turn.conv_id:
            h["X-Llmweb-Conversation-Id"] = self.turn.conv_id
        report = self.report(finished)
        for name in ("summarized_messages", "left_out_messages", "summary_cached"):
            if name in report:
                h["X-Llmweb-" + name.replace("_", "-").title()] = str(report[name]).lower()
        return h

    def report(self, finished: Finished | None) -> dict[str, Any]:
        """What was summarised and left out: known before generation in stateless mode, after it in stateful."""
        if self.fitted is not None:
            return self.fitted.fit.report()
        if finished is None:
            return {}
        st = finished.stats
        return {
            "summarized_messages": 2 * st.summarized_turns,
            "left_out_messages": 2 * st.dropped_turns,
            "summary_tokens": st.summary_tokens,
        }

    def extension(self, f: Finished) -> dict[str, Any]:
        st = f.stats
        return {
            "mode": self.turn.mode,
            "conversation_id": self.turn.conv_id,
            "sections": dict(st.sections),
            "context_limit": st.context_limit,
            "max_tokens": self.turn.max_tokens,
            **self.report(f),
            "sources": [s.to_dict() for s in f.sources],
            "notes": self.turn.notes + list(f.notes),
            "stop": self.scanner.stopped,
            "stats": st.to_dict(),
            **({"document": f.document.to_dict()} if f.document is not None else {}),
        }

    def on_delta(self, text: str) -> str:
        """What of the reply so far may be shown (the turn cancels its request at a stop string)."""
        shown, stopped = self.scanner.scan(text.lstrip())
        if stopped and not self.cut:
            self.cut = shown
        return self.cut if self.scanner.stopped else shown

    def content(self, f: Finished) -> str:
        text = self.cut if self.scanner.stopped else f.reply
        return self.scanner.scan(text, final=True)[0].strip()

    def usage(self, f: Finished) -> Usage:
        g = f.stats.gen
        return Usage(g.prompt_tokens, g.generated_tokens, g.reused_tokens if g.reuse_reported else None)

    def finish_reason(self, f: Finished) -> str:
        return finish_reason(f.stats.gen.finish_reason, self.scanner.stopped)

    async def whole(self, pump: _Pump, request: Request) -> Response:
        """A response without streaming; a client that leaves first cancels the request."""
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            while True:
                step = asyncio.ensure_future(pump.next())
                await asyncio.wait({step, gone}, return_when=asyncio.FIRST_COMPLETED)
                if not step.done():
                    step.cancel()
                    pump.close()
                    return Response(status_code=499)  # nobody reads it
                try:
                    event = step.result()
                except Exception as e:
                    return error_response(api_error(e))
                if event is None:
                    return error_response(ApiError(500, "The chat turn ended without a reply.", type="server_error"))
                if isinstance(event, Delta):
                    self.on_delta(event.text)
                elif isinstance(event, Finished):
                    content, reason = self.content(event), self.finish_reason(event)
                    body = self.c.response(content, reason, self.usage(event), self.extension(event))
                    return JSONResponse(body, headers=self.headers(event))
        finally:
            gone.cancel()

    async def stream(self, pump: _Pump) -> AsyncIterator[bytes]:
        """Server-sent events in OpenAI's chunk format, ending with `data: [DONE]`."""
        usage = self.req.include_usage
        yield sse(self.c.chunk({"role": "assistant", "content": ""}, include_usage=usage))
        sent = ""
        while True:
            try:
                event = await pump.next()
            except Exception as e:  # after the headers: an error event, as OpenAI streams do
                yield sse(api_error(e).body())
                return
            if event is None:
                yield sse(ApiError(500, "The chat turn ended without a reply.", type="server_error").body())
                return
            if isinstance(event, Queued):
                # keeps proxies open; notices a client gone
                yield f": waiting, number {event.position}, about {event.wait_s:.0f} s\n\n".encode()
            elif isinstance(event, Progress):  # a whole-document task: a comment line per step
                yield f": {event.done} of {event.total} sections, {event.text}\n\n".encode()
            elif isinstance(event, Delta):
                shown = self.on_delta(event.text)
                if len(shown) > len(sent) and shown.startswith(sent):
                    yield sse(self.c.chunk({"content": shown[len(sent) :]}, include_usage=usage))
                    sent = shown
            elif isinstance(event, Finished):
                final = self.content(event)
                if len(final) > len(sent) and final.startswith(sent):
                    yield sse(self.c.chunk({"content": final[len(sent) :]}, include_usage=usage))
                reason = self.finish_reason(event)
                yield sse(self.c.chunk({}, reason, include_usage=usage, extension=self.extension(event)))
                if usage:
                    yield sse(self.c.chunk(None, usage=self.usage(event), include_usage=True))
                yield sse("[DONE]")
                return


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone (the body is already read: what comes next is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


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


def _retry() -> dict[str, str]:
    return {"Retry-After": str(RETRY_AFTER_S)}


def api_error(e: BaseException) -> ApiError:
    """A failure as the API reports it: a domain error's sentence, anything else a 500 whose message
    is only a ref to the log (web/failures.py)."""
    message = public_message(e)
    if not isinstance(e, LlmwebError):
        return ApiError(500, message, type="server_error")
    if isinstance(e, NotFound):
        return ApiError(404, message, type="not_found_error", code="conversation_not_found")
    if isinstance(e, InputError):
        return ApiError(400, message, code="invalid_input")
    if isinstance(e, BusyError):
        return ApiError(429, message, type="rate_limit_error", code="queue_full", headers=_retry())
    if isinstance(e, AdmissionError | OutOfMemory):
        return ApiError(503, message, type="server_error", code="out_of_memory", headers=_retry())
    if isinstance(e, TimedOut):
        return ApiError(504, message, type="server_error", code="timeout")
    if isinstance(e, Cancelled):
        return ApiError(503, message, type="server_error", code="cancelled", headers=_retry())
    if isinstance(e, EngineStopped):  # the model's process died under it and is restarting: retry
        return ApiError(503, message, type="server_error", code="engine_stopped", headers=_retry())
    if isinstance(e, ConfigError):
        return ApiError(500, message, type="server_error", code="configuration")
    return ApiError(500, message, type="server_error")


def error_response(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)
