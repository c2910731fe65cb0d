"""`POST /v1/completions`: a raw prompt, no chat template, continued by the model; the legacy
response as one JSON object or as server-sent events (web/api/completions_wire.py).

The prompt is tokenised as it is (the tokenizer's own special tokens read as such, as llama-server
and vLLM read them: a caller that writes a chat template by hand gets it), and goes to the same
engine queue as a chat turn, for the caller's stateless owner, with the same keys, per-owner limits
and time limit; a prompt longer than the context is a 400 naming `prompt`, never a cut. Stop ids
are the model's (its end of turn and eos), and `stop` strings end the completion before them. The
server's repetition penalty applies; the loop guard (a chat's) does not. Stateless: nothing is
stored. `raw_turn` is the run itself, shared with Ollama's `/api/generate` with `raw` (web/api/ollama.py).

Owns: the raw prompt's turn and its response. Must not parse fields (completions_wire.py) or
work out an owner (web/identity.py).
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from llmweb.chat.session import Queued, Started
from llmweb.chat.turn import Cancel, Delta, held_back
from llmweb.engine.request import GenerationRequest, TokenLogprob, Tokens, Waiting
from llmweb.records import GenerationStats
from llmweb.web.api import models
from llmweb.web.api.common import (
    EventStream,
    Pump,
    Usage,
    logprobs_supported,
    logprobs_unsupported,
    parse_body,
    read_body,
    require_json,
    sse,
    whole_reply,
    within,
)
from llmweb.web.api.completions_wire import CompletionRequest, TextCompletion, legacy_logprobs, parse_completion
from llmweb.web.api.errors import ApiError, api_error, bad, error_response
from llmweb.web.identity import ApiCallers

CHARS_PER_TOKEN = 32  # a prompt of more characters than this x the context cannot fit: refused before tokenising


@dataclass(frozen=True)
class Raw:
    """A raw turn's sampling, as a request asks for it; None: the server's."""

    max_tokens: int
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logprobs: int | None = None


@dataclass(frozen=True)
class Done:
    """A raw turn's end: the text as shown (cut before a stop string), and what it cost."""

    text: str
    stats: GenerationStats
    stopped: bool  # a stop string ended it
    logprobs: tuple[TokenLogprob, ...] = ()
    notes: tuple[str, ...] = field(default=())

    @property
    def finish_reason(self) -> str:
        return "length" if self.stats.finish_reason == "length" and not self.stopped else "stop"


def encode_prompt(chat, text: str, max_tokens: int) -> tuple[list[int], int, list[str]]:
    """The prompt's ids, the reply's cap, and notes; a 400 naming `prompt` or `max_tokens` when they
    do not fit the context."""
    budget = chat.budget
    if len(text) > budget.context_limit * CHARS_PER_TOKEN:
        raise bad(f"prompt is far longer than the model's context of {budget.context_limit} tokens.", "prompt")
    ids = list(chat.fmt.encode_prompt(text))
    if not ids:
        raise bad("prompt holds no tokens.", "prompt")
    notes = []
    cap = min(max_tokens, budget.max_new_tokens)
    if cap < max_tokens:
        notes.append(f"max_tokens was capped at {cap} (the reply budget, LLMWEB_MAX_NEW_TOKENS).")
    if len(ids) >= budget.context_limit:
        raise bad(
            f"prompt is {len(ids)} tokens; the model's context is {budget.context_limit} tokens.",
            "prompt",
            "context_length_exceeded",
        )
    if len(ids) + cap > budget.context_limit:
        raise bad(
            f"prompt ({len(ids)} tokens) and max_tokens ({cap}) together pass the model's context of "
            f"{budget.context_limit} tokens; ask for at most {budget.context_limit - len(ids)}.",
            "max_tokens",
            "context_length_exceeded",
        )
    return ids, cap, notes


def raw_turn(chat, owner: str, ids: list[int], raw: Raw, cancel: Cancel, notes: Sequence[str] = ()) -> Iterator:
    """Run `ids` on the chat's engine for `owner`: Started, Queued while it waits, Delta (the text so
    far, held back where a stop string may begin, and the new tokens' log-probabilities), then Done."""
    s = chat.settings
    request = GenerationRequest(
        prompt_ids=ids,
        max_new_tokens=raw.max_tokens,
        temperature=s.temperature if raw.temperature is None else raw.temperature,
        top_p=s.top_p if raw.top_p is None else raw.top_p,
        repetition_penalty=s.repetition_penalty,
        seed=raw.seed,
        stop_ids=chat.fmt.stop_ids,
        owner=owner,
        timeout_s=s.request_timeout_s,
        logprobs=raw.logprobs,
    )
    handle = chat.engine.submit(request)
    cancel.attach(handle)
    yield Started("")
    given, stopped, done = 0, False, False
    try:
        for event in handle.events():
            if isinstance(event, Waiting):
                yield Queued(event.position, event.wait_s)
            elif isinstance(event, Tokens):
                shown, stopped = held_back(chat.fmt.decode(handle.generated), raw.stop, final=False)
                if stopped:
                    handle.cancel()  # the completion ends before the stop string
                logprobs = tuple(handle.logprobs[given:]) if event.logprobs else ()
                given += len(logprobs)
                yield Delta(shown.rstrip("\ufffd"), logprobs)
        done = True
    finally:
        if not done:
            handle.cancel()
    text, stopped = held_back(chat.fmt.decode(handle.generated), raw.stop, final=True)
    stats = handle.stats or GenerationStats(prompt_tokens=len(ids), finish_reason="cancelled")
    yield Done(text, stats, stopped, tuple(handle.logprobs), tuple(notes))


def _failed(e: BaseException) -> Response:
    return error_response(api_error(e))


class Completions:
    """The route of `POST /v1/completions`."""

    def __init__(self, runtime, callers: ApiCallers):
        self.runtime = runtime
        self.settings = runtime.settings
        self.callers = callers

    async def post(self, request: Request) -> Response:
        lease = None
        try:
            caller = self.callers.caller(request)
            require_json(request)
            body = await parse_body(await read_body(request, self.settings.api_max_body_kb * 1024))
            known = await run_in_threadpool(models.names, self.runtime)
            max_chars = self.settings.api_max_body_kb * 1024
            req = parse_completion(body, known, max_chars)
            lease = await run_in_threadpool(models.ensure, self.runtime, caller, req.model)
            chat = lease.chat
            if req.logprobs is not None and not logprobs_supported(chat.engine):
                raise logprobs_unsupported()
            ids, cap, notes = await run_in_threadpool(encode_prompt, chat, req.prompt, req.max_tokens)
            raw = Raw(cap, req.temperature, req.top_p, req.seed, req.stop, req.logprobs)
            cancel = Cancel()
            pump = Pump(lease.around(raw_turn(chat, caller.stateless_owner, ids, raw, cancel, notes)), cancel)
            try:
                await pump.until_started()
            except BaseException:
                pump.close()
                raise
        except Exception as e:
            if lease is not None:
                lease.release()
            return error_response(e if isinstance(e, ApiError) else api_error(e))
        reply = _Reply(req, TextCompletion(lease.model_id, "cmpl-" + secrets.token_hex(12)), chat.fmt, len(ids))
        if req.stream:
            return EventStream(reply.stream(pump), on_close=pump.close, headers={})
        return await reply.whole(pump, request)


class _Reply:
    def __init__(self, req: CompletionRequest, c: TextCompletion, fmt, prompt_tokens: int):
        self.req, self.c, self.fmt, self.prompt_tokens = req, c, fmt, prompt_tokens
        self.prefix = req.prompt if req.echo else ""

    def logprobs(self, items: Sequence[TokenLogprob], offset: int) -> dict | None:
        return None if self.req.logprobs is None else legacy_logprobs(self.fmt, items, offset)

    def usage(self, done: Done) -> Usage:
        g = done.stats
        return Usage(self.prompt_tokens, g.generated_tokens, None)

    def kept(self, done: Done) -> list[TokenLogprob]:
        """The tokens of the text as shown (a stop string cut the rest away)."""
        return within(self.fmt, done.logprobs, len(done.text.encode())) if done.stopped else list(done.logprobs)

    async def whole(self, pump: Pump, request: Request) -> Response:
        """A response without streaming; a client that leaves first cancels the request."""
        return await whole_reply(pump, request, self.take, _failed, "The completion ended without a reply.")

    def take(self, event) -> JSONResponse | None:
        if not isinstance(event, Done):
            return None
        logprobs = self.logprobs(self.kept(event), 0)
        text = self.prefix + event.text
        return JSONResponse(self.c.response(text, event.finish_reason, self.usage(event), logprobs, list(event.notes)))

    async def stream(self, pump: Pump) -> AsyncIterator[bytes]:
        usage = self.req.include_usage
        sent, pending = "", list[TokenLogprob]()
        if self.prefix:
            yield sse(self.c.chunk(self.prefix, include_usage=usage))
        while True:
            try:
                event = await pump.next()
            except Exception as e:
                yield sse(api_error(e).body())
                return
            if event is None:
                yield sse(ApiError(500, "The completion ended without a reply.", type="server_error").body())
                return
            if isinstance(event, Queued):
                yield f": waiting, number {event.position}, about {event.wait_s:.0f} s\n\n".encode()
            elif isinstance(event, Delta):
                pending.extend(event.logprobs)
                if len(event.text) > len(sent) and event.text.startswith(sent):
                    logprobs = self.logprobs(pending, len(sent))
                    yield sse(self.c.chunk(event.text[len(sent) :], logprobs=logprobs, include_usage=usage))
                    sent, pending = event.text, []
            elif isinstance(event, Done):
                rest = event.text[len(sent) :] if event.text.startswith(sent) else ""
                tail = self.kept(event)[len(event.logprobs) - len(pending) :]  # those not sent yet
                logprobs = self.logprobs(tail, len(sent)) if tail else None
                yield sse(self.c.chunk(rest, event.finish_reason, logprobs=logprobs, include_usage=usage))
                if usage:
                    yield sse(self.c.chunk(None, usage=self.usage(event), include_usage=True))
                yield sse("[DONE]")
                return
