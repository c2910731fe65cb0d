"""`POST /v1/chat/completions`: read the body, parse it (web/api/chat_wire.py), run the turn, write
the reply as one JSON object or as server-sent events.

The turn itself is the chat path's: stateful requests run `Chat.send` (history, summary, facts,
recall, retrieval, the store: the conversation shows in its owner's list), stateless ones
`StatelessChat.send` (chat/stateless.py: the client's messages fitted into the budget). Both go
through the one engine queue, so a full queue is a 429 here as it is a "busy" message in the UI.
A client that disconnects cancels its engine request (web/api/common.py's `Pump`), and a stateful
turn keeps the partial reply, marked as stopped, as the UI's Stop button does.

Sampling (temperature, top_p, max_tokens) and `stop` strings go to the turn with the request
(chat/turn.py: `Sampling`; the turn cancels its engine request at the first stop string), and a
`Cancel` lets a client that leaves stop it from the event loop; the reply shown is cut before
the stop string here (StopScanner).

Owns: a request's turn and its response. Must not work out an owner itself (web/identity.py's
`ApiCallers` says who is calling and for which owner they act) or load a model (web/api/models.py).
"""

from __future__ import annotations

import secrets
import threading
import weakref
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from llmweb.chat.memory import remembered
from llmweb.chat.session import Delta, Finished, Progress, Queued
from llmweb.chat.stateless import Fitted, StatelessChat, cut_results
from llmweb.chat.turn import Cancel, Sampling
from llmweb.engine.request import TokenLogprob
from llmweb.store.models import new_id
from llmweb.web.api import models
from llmweb.web.api.chat_wire import (
    NEW_CONVERSATION,
    ChatRequest,
    Completion,
    StopScanner,
    finish_reason,
    parse_request,
)
from llmweb.web.api.common import (
    EventStream,
    Pump,
    Usage,
    logprob_entries,
    logprobs_supported,
    logprobs_unsupported,
    parse_body,
    read_body,
    require_json,
    sse,
    whole_reply,
    within,
)
from llmweb.web.api.errors import ApiError, api_error, bad, error_response
from llmweb.web.api.tools import (
    CallScanner,
    ToolCall,
    ToolFormat,
    model_format,
    result_text,
    stored_call_id,
    stored_calls,
)
from llmweb.web.identity import ApiCallers, Caller
from llmweb.web.trust import origin_of


def tool_format_of(chat) -> ToolFormat:
    """The tool format of the model behind `chat` (web/api/tools.py); a remote engine's is generic."""
    local = getattr(getattr(chat.engine, "runner", None), "device", None) != "remote"
    return model_format(chat.fmt, local)


def uses_tools(body: dict[str, Any]) -> bool:
    """Whether a body sends tools, tool calls or tool results: what a model's tool format writes."""
    messages = body.get("messages")
    listed = messages if isinstance(messages, list) else []
    return bool(body.get("tools")) or any(
        isinstance(m, dict) and (m.get("role") == "tool" or m.get("tool_calls")) for m in listed
    )


class ChatCompletions:
    """The route of `POST /v1/chat/completions`, and the stateless chats it keeps per loaded model."""

    def __init__(self, runtime, callers: ApiCallers):
        self.runtime = runtime
        self.settings = runtime.settings
        self.callers = callers
        self._stateless: weakref.WeakKeyDictionary[Any, StatelessChat] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    async def post(self, request: Request) -> Response:
        lease = None
        try:
            caller = self.callers.caller(request)
            require_json(request)
            body = await parse_body(await read_body(request, self.settings.api_max_body_kb * 1024))
            known = await run_in_threadpool(models.names, self.runtime)  # reads the models folder
            req = parse_request(body, known, self.settings.max_message_chars, request.headers)
            # the model that answers, held until the turn's events end (the pump's thread runs them)
            lease = await run_in_threadpool(models.ensure, self.runtime, caller, req.model)
            if uses_tools(body) and (fmt := tool_format_of(lease.chat)) != req.tool_format:  # the model's own
                req = parse_request(body, known, self.settings.max_message_chars, request.headers, fmt)
            turn = self.start(caller, req, lease.chat, origin_of(self.settings, request).group)
            pump = Pump(lease.around(turn.events), turn.cancel)
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
        reply = _Reply(
            req, turn, fitted, Completion(lease.model_id, "chatcmpl-" + secrets.token_hex(12)), lease.chat.fmt
        )
        if req.stream:
            return EventStream(reply.stream(pump), on_close=pump.close, headers=reply.headers(None))
        return await reply.whole(pump, request)

    # ---- the turn
    def start(self, caller: Caller, req: ChatRequest, chat, address: str = "") -> _Turn:
        """Start the chat turn for `req` on `chat` (nothing runs until its events are read)."""
        cap = chat.budget.max_new_tokens
        max_tokens = chat.budget.capped(req.max_tokens).max_new_tokens
        sampling, cancel = _sampling(req, chat, max_tokens), Cancel()
        notes = []
        if req.max_tokens is not None and req.max_tokens > cap:
            notes.append(f"max_tokens was capped at {cap} (the reply budget, LLMWEB_MAX_NEW_TOKENS).")
        if req.stateful:
            new = req.conversation_id == NEW_CONVERSATION
            conv_id = new_id() if new else str(req.conversation_id)
            if req.continue_from is not None:  # a new chat of the caller's, from one of theirs (chat/carry.py)
                if not caller.owner:
                    raise bad("x_llmweb.continue_from needs an API key: without one, each chat is its own.")
                conv_id, new = chat.carry.continue_in_new(caller.owner, req.continue_from), False
            owner = caller.of_conversation(conv_id)
            chat.engine.note_address(owner, address)  # an address's conversations share its limits
            if not new and not chat.store.exists(owner, conv_id):
                raise ApiError(
                    404,
                    'There is no conversation with this id for your key. Start one with conversation_id "new".',
                    type="not_found_error",
                    code="conversation_not_found",
                    param="conversation_id",
                )
            if req.turn_views:  # the caller's say in what the model sees, before this turn: all or none
                chat.set_view(owner, conv_id, req.turn_views)
            use_docs = True if req.use_docs is None else req.use_docs
            whole = {"whole_document": True} if req.whole_document else {}
            text = req.messages[0].text if req.messages[0].role == "user" else self.results(chat, owner, conv_id, req)
            last = None if new else chat.store.last_turn(owner, conv_id)
            number = (last.stats.turn if last is not None and last.stats is not None else 0) + 1
            events = chat.send(
                owner,
                conv_id,
                text,
                new=new,
                use_docs=use_docs,
                seed=req.seed,
                sampling=sampling,
                stop=req.stop,
                cancel=cancel,
                documents=req.documents,
                **whole,
            )
            return _Turn(events, cancel, "stateful", conv_id, max_tokens, notes, number)
        owner = caller.stateless_owner
        if req.memory and not caller.owner:
            raise bad("x_llmweb.memory needs an API key: it reads the memory of the key's account.", "x_llmweb")
        if req.turn_views:
            raise bad("x_llmweb.turns: only a stored conversation (conversation_id) has turns to keep or leave out.")
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
            memory=remembered(chat.store, owner) if req.memory else (),
        )
        return _Turn(events, cancel, "stateless", None, max_tokens, notes)

    def results(self, chat, owner: str, conv_id: str, req: ChatRequest) -> str:
        """A stateful request's tool results, as the next user-side message: each must answer a call
        of the conversation's last reply (its ids are `stored_call_id`s), each restates its call,
        and together they are cut to the user budget (chat/stateless.py's `cut_results`)."""
        last = None if req.conversation_id == NEW_CONVERSATION else chat.store.last_turn(owner, conv_id)
        turn = last.stats.turn if last is not None and last.stats is not None else 0
        calls = stored_calls(conv_id, turn, last.assistant, req.tool_format) if last is not None else {}
        for i, m in enumerate(req.messages):
            if m.call_id not in calls:
                where = f"messages[{i}].tool_call_id"
                raise bad(f"{where}: {m.call_id[:60]!r} is not a call of this conversation's last reply.", where)
        rendered = [("tool", result_text(m.call_id, calls[m.call_id], m.text, req.tool_format)) for m in req.messages]
        return "\n\n".join(t for _, t in cut_results(rendered, chat.fmt, chat.budget.user_tokens))

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
    number: int = 0  # a stateful turn's number, as its stats will say: its calls' ids (`stored_call_id`)


class _Reply:
    """One response being written: the request, its turn, the reply text as stop strings allow it."""

    def __init__(self, req: ChatRequest, turn: _Turn, fitted: Fitted | None, completion: Completion, fmt=None):
        self.req, self.turn, self.fitted, self.c = req, turn, fitted, completion
        self.scanner = StopScanner(req.stop)
        self.cut = ""  # the reply up to the stop string, once one appeared
        self.fmt = fmt  # the model's tokens, for log-probabilities
        self.pending: list[TokenLogprob] = []  # streamed: the tokens not yet sent with a chunk
        self.calls_read: CallScanner | None = None  # under tools: the reply's calls as they are decoded
        if req.tools is not None and req.shaped is not None:
            conv_id, number = turn.conv_id, turn.number
            ids = None if conv_id is None else (lambda i: stored_call_id(conv_id, number, i))
            self.calls_read = req.tools.scanner(ids)

    def logprobs(self, items: Sequence[TokenLogprob]) -> list[dict[str, Any]] | None:
        """`logprobs.content` of these tokens; None when the request did not ask."""
        return None if self.req.logprobs is None else logprob_entries(self.fmt, items)

    def final_logprobs(self, f: Finished, items: Sequence[TokenLogprob]) -> list[dict[str, Any]] | None:
        """The tokens of the reply as shown: those past a stop string are not."""
        if self.req.logprobs is None:
            return None
        if self.scanner.stopped:
            lead = len(f.reply) - len(f.reply.lstrip())
            items = within(self.fmt, items, len((f.reply[:lead] + self.content(f)).encode()))
        return self.logprobs(items)

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

    def calls(self, content: str, f: Finished) -> tuple[str | None, list[ToolCall]]:
        """The reply as (content, tool calls), read in the model's tool format (web/api/tools.py);
        a stateful turn's calls get ids the next request can answer (`stored_call_id`)."""
        if self.calls_read is None:
            return content, []
        return self.calls_read.result(content)

    def usage(self, f: Finished) -> Usage:
        g = f.stats.gen
        return Usage(g.prompt_tokens, g.generated_tokens, g.reused_tokens if g.reuse_reported else None)

    def finish_reason(self, f: Finished) -> str:
        return finish_reason(f.stats.gen.finish_reason, self.scanner.stopped)

    async def whole(self, pump: Pump, request: Request) -> Response:
        """A response without streaming; a client that leaves first cancels the request."""
        return await whole_reply(pump, request, self.take, _failed, "The chat turn ended without a reply.")

    def take(self, event) -> JSONResponse | None:
        """One event of a reply without streaming: the response once it is finished."""
        if isinstance(event, Delta):
            self.on_delta(event.text)
        if not isinstance(event, Finished):
            return None
        content, reason = self.content(event), self.finish_reason(event)
        text, calls = self.calls(content, event)
        if calls:
            reason = "tool_calls"
        tool_calls = [c.to_dict() for c in calls]
        logprobs = self.final_logprobs(event, event.logprobs)
        body = self.c.response(text, reason, self.usage(event), self.extension(event), tool_calls, logprobs)
        return JSONResponse(body, headers=self.headers(event))

    async def stream(self, pump: Pump) -> AsyncIterator[bytes]:
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
                self.pending.extend(event.logprobs)
                if self.calls_read is not None:  # the calls as they are decoded; content only before them
                    for delta in self.calls_read.feed(shown):
                        yield sse(self.c.chunk({"tool_calls": [delta]}, include_usage=usage))
                    shown = shown[: self.calls_read.shown(shown)]
                if len(shown) > len(sent) and shown.startswith(sent):
                    logprobs, self.pending = self.logprobs(self.pending), []
                    yield sse(self.c.chunk({"content": shown[len(sent) :]}, include_usage=usage, logprobs=logprobs))
                    sent = shown
            elif isinstance(event, Finished):
                final = self.content(event)
                reason = self.finish_reason(event)
                if self.calls_read is not None:  # what the last tokens added to the calls
                    for delta in self.calls_read.feed(final):
                        yield sse(self.c.chunk({"tool_calls": [delta]}, include_usage=usage))
                text, calls = self.calls(final, event)
                n = len(event.logprobs) - len(self.pending)  # the tokens sent already
                logprobs = self.final_logprobs(event, event.logprobs)
                rest = None if logprobs is None else logprobs[n:]
                if calls:
                    reason = "tool_calls"
                final = text if text is not None else ""
                if len(final) > len(sent) and final.startswith(sent):
                    yield sse(self.c.chunk({"content": final[len(sent) :]}, include_usage=usage, logprobs=rest))
                    rest = None
                ext = self.extension(event)
                yield sse(self.c.chunk({}, reason, include_usage=usage, extension=ext, logprobs=rest or None))
                if usage:
                    yield sse(self.c.chunk(None, usage=self.usage(event), include_usage=True))
                yield sse("[DONE]")
                return


def _failed(e: BaseException) -> Response:
    return error_response(api_error(e))


def _sampling(req: ChatRequest, chat, max_tokens: int) -> Sampling:
    """The request's sampling over the chat's: its grammar (response_format, tools) and logprobs."""
    if req.logprobs is not None and req.whole_document:
        raise bad("logprobs are not available with x_llmweb.whole_document.", "logprobs")
    if req.logprobs is not None and not logprobs_supported(chat.engine):
        raise logprobs_unsupported()
    shaped = req.shaped
    return Sampling(
        req.temperature,
        req.top_p,
        max_tokens,
        req.loop_guard,
        logprobs=req.logprobs,
        constraint=shaped.constraint if shaped is not None else None,
        instruction=shaped.instruction if shaped is not None else "",
    )
