"""Ollama's API, the subset its clients use, on the same port, keys and owners as /v1:

    GET  /api/version          the Ollama API version this follows (no key needed: it says nothing else)
    GET  /api/tags             the models (/v1/models') and the embedder
    POST /api/show             one model: details, `capabilities`, its context in `model_info`
    POST /api/chat             a chat, NDJSON lines by default, or one object with "stream": false
    POST /api/generate         a prompt: through the chat template, or as written with "raw": true
    POST /api/embed            the embedder (/v1/embeddings'), and the older /api/embeddings
    GET  /api/ps               the models loaded now

`/api/chat` and `/api/generate` are translated (web/api/ollama_wire.py) into the OpenAI-shaped body
that /v1/chat/completions parses, and run through the same parse and the same turn
(web/api/chat.py): the same limits, queue, refusals and replies, written as Ollama's lines. A raw
`/api/generate` runs as /v1/completions does (web/api/completions.py). Every call is stateless
(Ollama's API is: a client sends its whole history each time), for the caller's stateless owner:
one visitor's calls never see another's chats or documents. Errors are Ollama's `{"error": ...}`
with the /v1 status.

Owns: the routes and the NDJSON framing. Must not parse OpenAI fields (chat_wire.py does, after the
translation) or work out an owner (web/identity.py).
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from llmweb.chat.session import Delta, Finished
from llmweb.chat.stateless import Fitted
from llmweb.chat.turn import Cancel
from llmweb.web.api import models
from llmweb.web.api import ollama_wire as wire
from llmweb.web.api.chat import ChatCompletions, _Reply, tool_format_of, uses_tools
from llmweb.web.api.chat_wire import NEUTRAL, Completion, parse_request
from llmweb.web.api.common import EventStream, Pump, parse_body, read_body, require_json, whole_reply
from llmweb.web.api.completions import Done, Raw, encode_prompt, raw_turn
from llmweb.web.api.embeddings import Embeddings
from llmweb.web.api.embeddings_wire import EmbeddingsRequest, texts
from llmweb.web.api.errors import ApiError, api_error, bad
from llmweb.web.identity import ApiCallers

NDJSON = "application/x-ndjson"


class Lines(EventStream):
    """Ollama's stream: one JSON object a line; `on_close` however it ends (a client gone cancels the turn)."""

    media_type = NDJSON


def ollama_error(e: BaseException) -> JSONResponse:
    """Ollama's error object, with the status (and Retry-After) /v1 would give."""
    err = e if isinstance(e, ApiError) else api_error(e)
    return JSONResponse({"error": err.message}, status_code=err.status, headers=err.headers)


def tools_supported() -> bool:
    """Whether the chat path takes `tools` (it refuses what it lists as neutral-only)."""
    return "tools" not in NEUTRAL


class Ollama:
    """The routes of Ollama's API (see the module docstring)."""

    def __init__(self, runtime, callers: ApiCallers, chat: ChatCompletions, embeddings: Embeddings):
        self.runtime, self.settings, self.callers = runtime, runtime.settings, callers
        self.chat_route, self.embeddings = chat, embeddings
        self.started = time.time()

    def routes(self) -> list[tuple[str, Any, str]]:
        return [
            ("/api/version", self.version, "GET"),
            ("/api/tags", self.tags, "GET"),
            ("/api/show", self.show, "POST"),
            ("/api/chat", self.chat, "POST"),
            ("/api/generate", self.generate, "POST"),
            ("/api/embed", self.embed, "POST"),
            ("/api/embeddings", self.embed_one, "POST"),
            ("/api/ps", self.ps, "GET"),
        ]

    async def _body(self, request: Request) -> dict[str, Any]:
        require_json(request)
        return await parse_body(await read_body(request, self.settings.api_max_body_kb * 1024))

    # ---- models
    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": wire.VERSION})

    def _chat_models(self) -> list[dict[str, Any]]:
        return models.objects(self.runtime, int(self.started))

    def _embedder(self) -> dict[str, Any]:
        return {"id": self.embeddings.names[0], "architecture": "bert", "format": "safetensors"}

    async def tags(self, request: Request) -> Response:
        try:
            self.callers.caller(request)
            found = await run_in_threadpool(self._chat_models)
        except Exception as e:
            return ollama_error(e)
        listed = [wire.tag(m["id"], m, self.started) for m in found]
        listed.append(wire.tag(self.embeddings.names[0], self._embedder(), self.started))
        return JSONResponse({"models": listed})

    async def ps(self, request: Request) -> Response:
        try:
            self.callers.caller(request)
            found = await run_in_threadpool(self._chat_models)
        except Exception as e:
            return ollama_error(e)
        return JSONResponse({"models": [wire.ps_entry(m["id"], m) for m in found if m.get("loaded")]})

    async def show(self, request: Request) -> Response:
        try:
            self.callers.caller(request)
            name = wire.model_name(await self._body(request))
            if name in self.embeddings.names:
                window = getattr(getattr(self.runtime, "library", None), "embedder", None)
                model = {**self._embedder(), "context_length": getattr(window, "window", None)}
                return JSONResponse(wire.show(model, ["embedding"], self.started))
            found = [m for m in await run_in_threadpool(self._chat_models) if m["id"] == name]
            if not found:
                raise ApiError(404, f"model '{name[:100]}' not found", param="model")
        except Exception as e:
            return ollama_error(e)
        model = found[0]
        if model["id"] == models.MODEL_ID:  # the model served: its own architecture, from its listing
            served = [m for m in await run_in_threadpool(self._chat_models) if m["id"] == model.get("served")]
            model = {**(served[0] if served else {}), **{k: v for k, v in model.items() if v is not None}}
        capabilities = ["completion", *(["tools"] if tools_supported() else [])]
        return JSONResponse(wire.show(model, capabilities, self.started))

    # ---- chat and generate
    async def chat(self, request: Request) -> Response:
        return await self._converse(request, generate=False)

    async def generate(self, request: Request) -> Response:
        return await self._converse(request, generate=True)

    async def _converse(self, request: Request, generate: bool) -> Response:
        lease = None
        try:
            caller = self.callers.caller(request)
            body = await self._body(request)
            if generate:
                wire.check_generate(body)
                if body.get("raw"):
                    return await self._raw(request, caller, body)
                if not body.get("prompt"):  # Ollama's way to load a model: nothing to say
                    wire.model_name(body)
                    return JSONResponse(_loaded(wire.model_name(body)))
                openai_body = wire.generate_body(body)
            else:
                openai_body = wire.chat_body(body)
            known = await run_in_threadpool(models.names, self.runtime)
            req = parse_request(openai_body, known, self.settings.max_message_chars)
            lease = await run_in_threadpool(models.ensure, self.runtime, caller, req.model)
            if uses_tools(openai_body) and (fmt := tool_format_of(lease.chat)) != req.tool_format:
                req = parse_request(openai_body, known, self.settings.max_message_chars, None, fmt)
            turn = self.chat_route.start(caller, req, lease.chat)
            pump = Pump(lease.around(turn.events), turn.cancel)
            try:
                early = await pump.until_started()
            except BaseException:
                pump.close()
                raise
        except Exception as e:
            if lease is not None:
                lease.release()
            return ollama_error(e)
        fitted = next((e for e in early if isinstance(e, Fitted)), None)
        reply = _Reply(req, turn, fitted, Completion(lease.model_id, "ollama-" + secrets.token_hex(8)), lease.chat.fmt)
        writer = _Lines(wire.model_name(body), "response" if generate else "message")
        if req.stream:
            return Lines(writer.chat_stream(reply, pump), on_close=pump.close, headers={})
        return await writer.chat_whole(reply, pump, request)

    async def _raw(self, request: Request, caller, body: dict[str, Any]) -> Response:
        """`/api/generate` with "raw": true: the prompt as written, as /v1/completions runs it."""
        opts = wire.options(body.get("options"))
        stream = body.get("stream", True)
        if not isinstance(stream, bool):
            raise bad("stream must be a boolean.", "stream", "invalid_type")
        name = wire.model_name(body)
        known = await run_in_threadpool(models.names, self.runtime)
        if name not in known:
            raise ApiError(404, f"model '{name[:100]}' not found", param="model")
        prompt = body.get("prompt") or ""
        if not prompt:
            return JSONResponse(_loaded(name))
        lease = await run_in_threadpool(models.ensure, self.runtime, caller, name)
        try:
            cap = opts.get("max_tokens", lease.chat.budget.max_new_tokens)
            ids, cap, notes = await run_in_threadpool(encode_prompt, lease.chat, prompt, cap)
            stops = opts.get("stop", [])
            raw = Raw(cap, opts.get("temperature"), opts.get("top_p"), opts.get("seed"), tuple(stops))
            cancel = Cancel()
            pump = Pump(lease.around(raw_turn(lease.chat, caller.stateless_owner, ids, raw, cancel, notes)), cancel)
            await pump.until_started()
        except BaseException:
            lease.release()
            raise
        writer = _Lines(name, "response")
        if stream:
            return Lines(writer.raw_stream(pump), on_close=pump.close, headers={})
        return await writer.raw_whole(pump, request)

    # ---- embeddings
    async def embed(self, request: Request) -> Response:
        return await self._embed(request, old=False)

    async def embed_one(self, request: Request) -> Response:
        return await self._embed(request, old=True)

    async def _embed(self, request: Request, old: bool) -> Response:
        try:
            caller = self.callers.caller(request)
            body = await self._body(request)
            known = {"model", "prompt", "options", "keep_alive"} if old else {"model", "input", "truncate"}
            known |= {"options", "keep_alive", "dimensions"} if not old else set()
            for name in body:
                if name not in known:
                    raise bad(f"Unrecognized field: {str(name)[:100]}", str(name)[:100], "unknown_parameter")
            name = wire.model_name(body)
            if name not in self.embeddings.names:
                raise ApiError(404, f"model '{name[:100]}' not found (embeddings come from {self.embeddings.names[0]})")
            truncate = body.get("truncate", True)
            if not isinstance(truncate, bool):
                raise bad("truncate must be a boolean.", "truncate", "invalid_type")
            dims = body.get("dimensions")
            if dims is not None and (isinstance(dims, bool) or not isinstance(dims, int) or dims < 1):
                raise bad("dimensions must be a positive integer.", "dimensions", "invalid_type")
            items = texts(body.get("prompt") if old else body.get("input"))
            t0 = time.perf_counter()
            done = await self.embeddings.serve(
                request, caller.stateless_owner, EmbeddingsRequest(items, name, "float", dims)
            )
            if isinstance(done, Response):
                return done
            if not truncate and done["x_llmweb"]["truncated"]:
                cut = done["x_llmweb"]["truncated"][0]
                raise bad(f"input[{cut}] is longer than the embedder's window and truncate is false.", "input")
        except Exception as e:
            return ollama_error(e)
        vectors = [d["embedding"] for d in done["data"]]
        if old:
            return JSONResponse({"embedding": vectors[0]})
        return JSONResponse(
            {
                "model": name,
                "embeddings": vectors,
                "total_duration": int((time.perf_counter() - t0) * 1e9),
                "load_duration": 0,
                "prompt_eval_count": done["usage"]["prompt_tokens"],
            }
        )


def _error_line(e: BaseException) -> bytes:
    """An error after the stream began: a line of its own, as Ollama writes one."""
    message = (e if isinstance(e, ApiError) else api_error(e)).message
    return json.dumps({"error": message}, ensure_ascii=False).encode() + b"\n"


def _loaded(model: str) -> dict[str, Any]:
    return {"model": model, "created_at": wire.now(), "response": "", "done": True, "done_reason": "load"}


class _Lines:
    """A reply as Ollama's lines: each new piece of text, then a final line with the counts."""

    def __init__(self, model: str, field: str):
        self.model, self.field = model, field  # field: "message" (/api/chat) or "response" (/api/generate)

    def _piece(self, text: str, tool_calls=()) -> dict[str, Any]:
        return {"message": wire.message(text, tool_calls)} if self.field == "message" else {"response": text}

    def _final(self, reason: str, usage: dict[str, Any], total_s: float, ttft_s: float, rate: float, **more) -> dict:
        return {**more, "done": True, "done_reason": reason, **wire.stats(usage, total_s, ttft_s, rate)}

    def _chat_final(self, reply: _Reply, f: Finished, text: str) -> dict[str, Any]:
        """The last line: `text` (what is left to send), or under tools the model's calls (content empty)."""
        g = f.stats.gen
        content, calls = reply.calls(text, f)
        piece = self._piece(content or "", [c.to_dict() for c in calls])
        return self._final(
            reply.finish_reason(f), reply.usage(f).to_dict(), g.total_s, g.ttft_s, g.decode_tok_s, **piece
        )

    async def chat_whole(self, reply: _Reply, pump: Pump, request: Request) -> Response:
        """The reply as one object; a client that leaves first cancels the request."""

        def take(event) -> Response | None:
            if isinstance(event, Delta):
                reply.on_delta(event.text)
            if not isinstance(event, Finished):
                return None
            final = self._chat_final(reply, event, reply.content(event))
            return JSONResponse({"model": self.model, "created_at": wire.now(), **final})

        return await whole_reply(pump, request, take, ollama_error, "The chat turn ended without a reply.")

    async def chat_stream(self, reply: _Reply, pump: Pump) -> AsyncIterator[bytes]:
        sent = ""
        try:
            while True:
                try:
                    event = await pump.next()
                except Exception as e:
                    yield _error_line(e)
                    return
                if event is None:
                    return
                if isinstance(event, Delta):
                    shown = reply.on_delta(event.text)
                    if reply.req.tools is not None and reply.req.shaped is not None:
                        continue  # a reply under tools is read whole: calls or content, in the last line
                    if len(shown) > len(sent) and shown.startswith(sent):
                        yield wire.line(self.model, **self._piece(shown[len(sent) :]), done=False)
                        sent = shown
                elif isinstance(event, Finished):
                    final = reply.content(event)
                    if reply.req.tools is not None and reply.req.shaped is not None:
                        yield wire.line(self.model, **self._chat_final(reply, event, final))
                        return
                    rest = final[len(sent) :] if final.startswith(sent) else ""
                    if rest:
                        yield wire.line(self.model, **self._piece(rest), done=False)
                    yield wire.line(self.model, **self._chat_final(reply, event, ""))
                    return
        finally:
            pump.close()

    def _raw_final(self, done: Done, text: str) -> dict[str, Any]:
        g = done.stats
        usage = {"prompt_tokens": g.prompt_tokens, "completion_tokens": g.generated_tokens}
        return self._final(done.finish_reason, usage, g.total_s, g.ttft_s, g.decode_tok_s, response=text)

    async def raw_whole(self, pump: Pump, request: Request) -> Response:
        """The completion as one object; a client that leaves first cancels the request."""

        def take(event) -> Response | None:
            if not isinstance(event, Done):
                return None
            return JSONResponse({"model": self.model, "created_at": wire.now(), **self._raw_final(event, event.text)})

        return await whole_reply(pump, request, take, ollama_error, "The completion ended without a reply.")

    async def raw_stream(self, pump: Pump) -> AsyncIterator[bytes]:
        sent = ""
        try:
            while True:
                try:
                    event = await pump.next()
                except Exception as e:
                    yield _error_line(e)
                    return
                if event is None:
                    return
                if isinstance(event, Delta) and len(event.text) > len(sent) and event.text.startswith(sent):
                    yield wire.line(self.model, response=event.text[len(sent) :], done=False)
                    sent = event.text
                elif isinstance(event, Done):
                    rest = event.text[len(sent) :] if event.text.startswith(sent) else ""
                    if rest:
                        yield wire.line(self.model, response=rest, done=False)
                    yield wire.line(self.model, **self._raw_final(event, ""))
                    return
        finally:
            pump.close()
