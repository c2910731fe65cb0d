"""The chat-completions wire format: read a request (`parse_request`), write the response
(`Completion.response`) or its chunks for server-sent events (`Completion.chunk`).

Pure: no I/O, no model, no web framework; web/api/chat.py reads the body and runs the turn. Every
refusal is an `ApiError` (web/api/errors.py). `response_format`, `tools` and tool messages are
read by web/api/tools.py. Unsupported features (n > 1, images, ...) are refused by name,
never ignored; an unknown field is refused like OpenAI does
("Unrecognized request argument"). llmweb's extensions ride along as plain fields: in a request
`conversation_id` (stateful mode; "new" starts a conversation), `use_docs` and `x_llmweb`; in a
response the `x_llmweb` object. `StopScanner` implements `stop` on decoded text: it finds the first
stop string and holds back a tail that could still become one, so a streamed delta never shows part
of a stop string. Must not know how the turn runs or who is calling.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from llmweb.chat.session import clean_message
from llmweb.chat.turn import held_back
from llmweb.engine.request import MAX_TOP_LOGPROBS
from llmweb.errors import InputError
from llmweb.records import MAX_CHAT_DOCUMENTS, VIEW_WORDS
from llmweb.web.api.common import Usage, checked_fields, model_named, number, optional, same, unsupported
from llmweb.web.api.errors import bad
from llmweb.web.api.tools import (
    GENERIC_FORMAT,
    Shaped,
    ToolFormat,
    ToolSet,
    call_text,
    parse_response_format,
    parse_tools,
    result_text,
)

MAX_STOP_STRINGS = 4  # as OpenAI
MAX_STOP_CHARS = 200
MAX_USER_CHARS = 256
NEW_CONVERSATION = "new"

ROLES = ("system", "developer", "user", "assistant")
# accepted and ignored: they change nothing a client could notice here
IGNORED_FIELDS = ("metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier")
# OpenAI fields we do not implement: refused unless they hold their neutral value
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "n": (None, 1),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}),
    "functions": (None, []),
    "function_call": (None, "none"),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "prediction": (None,),
    "web_search_options": (None,),
    "reasoning_effort": (None,),
    "verbosity": (None,),
}
KNOWN_FIELDS = {
    "model",
    "messages",
    "stream",
    "stream_options",
    "temperature",
    "top_p",
    "max_tokens",
    "max_completion_tokens",
    "stop",
    "seed",
    "user",
    "conversation_id",
    "use_docs",
    "logprobs",
    "top_logprobs",
    "response_format",  # web/api/tools.py
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "x_llmweb",  # llmweb's own options: {"whole_document": true, "loop_guard": false, "documents": [...]}
    *IGNORED_FIELDS,
    *NEUTRAL,
}
MESSAGE_FIELDS = {"role", "content", "name"}
MESSAGE_TOOL_FIELDS = {"tool_calls", "tool_call_id"}  # web/api/tools.py renders them
MESSAGE_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "function_call": (None,),
    "refusal": (None,),
    "audio": (None,),
}


@dataclass(frozen=True, slots=True)
class Message:
    role: str  # system | user | assistant | tool ("developer" is read as "system")
    text: str  # a tool's result, and an assistant's tool calls, as the model reads them (web/api/tools.py)
    call_id: str = ""  # a stateful request's tool result: the stored call it answers (rendered by the route)


@dataclass(frozen=True, slots=True)
class ChatRequest:
    """One validated chat-completions request. None means: the server's default."""

    model: str
    messages: tuple[Message, ...]
    stream: bool = False
    include_usage: bool = False
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    seed: int | None = None
    user: str | None = None
    conversation_id: str | None = None  # None: stateless; NEW_CONVERSATION: start one
    use_docs: bool | None = None  # None: on for stateful, off for stateless
    whole_document: bool = False  # x_llmweb.whole_document: read the whole document (chat/document_task.py)
    loop_guard: bool | None = None  # x_llmweb.loop_guard: None = the chat's (engine/runners/loopguard.py)
    documents: tuple[str, ...] | None = None  # x_llmweb.documents: names or ids, instead of the chat's
    logprobs: int | None = (
        None  # None: none asked; k: each token's log-probability and its k most likely (top_logprobs)
    )
    shaped: Shaped | None = None  # response_format or tools: the reply's grammar and instruction
    tools: ToolSet | None = None  # tools, tool_choice, parallel_tool_calls
    tool_format: ToolFormat = GENERIC_FORMAT  # how the model writes calls and reads results (tools.model_format)
    turn_views: tuple[tuple[int, str], ...] = ()  # x_llmweb.turns: (0-based turn, Turn.view), set before the turn
    memory: bool = False  # x_llmweb.memory: a stateless request reads the owner's memory across chats
    continue_from: str | None = None  # x_llmweb.continue_from: "new" starts from this chat of the caller's

    @property
    def stateful(self) -> bool:
        return self.conversation_id is not None


def parse_request(
    body: dict[str, Any],
    models: Sequence[str],
    max_message_chars: int,
    headers: Mapping[str, str] | None = None,
    tool_format: ToolFormat = GENERIC_FORMAT,
) -> ChatRequest:
    """Validate a chat-completions body (and the llmweb headers) into a `ChatRequest`; raise ApiError.
    `tool_format`: the answering model's (tools.model_format), once it is known: calls and results
    in the history are written in it, and so is the reply's grammar."""
    headers = {k.lower(): v for k, v in (headers or {}).items()}
    checked_fields(body, KNOWN_FIELDS, NEUTRAL)
    model = model_named(body, models)

    stream = optional(body, "stream", bool) or False
    include_usage = _include_usage(body, stream)

    temperature = number(body, "temperature", 0.0, 2.0)
    top_p = number(body, "top_p", 0.0, 1.0, low_open=True)
    max_tokens = _max_tokens(body)
    seed = optional(body, "seed", int)
    if seed is not None and not -(2**63) <= seed < 2**63:
        raise bad("seed must fit in 64 bits.", "seed")
    user = optional(body, "user", str)
    if user is not None and len(user) > MAX_USER_CHARS:
        raise bad(f"user must be at most {MAX_USER_CHARS} characters.", "user")

    conversation_id = optional(body, "conversation_id", str)
    if conversation_id is None:
        conversation_id = headers.get("x-llmweb-conversation-id") or None
    if conversation_id is not None and not conversation_id.strip():
        raise bad('conversation_id is empty; send an id, or "new" to start a conversation.', "conversation_id")
    use_docs = _use_docs(body, headers)
    ours = _ours(body)

    stateful = conversation_id is not None
    messages = parse_messages(body.get("messages"), max_message_chars, stateful=stateful, tool_format=tool_format)
    tools, shaped = _shaped(body, ours, tool_format)
    results = bool(messages) and all(m.role == "tool" for m in messages)  # answers to the stored turn's calls
    if conversation_id is not None and not results and (len(messages) != 1 or messages[0].role != "user"):
        raise bad(
            "With a conversation_id, send only the new user message: llmweb keeps the history, the summary "
            "and the system prompt of the conversation. (Without one, send the whole message list.)",
            "messages",
            "stateful_messages",
        )
    return ChatRequest(
        model=model,
        messages=messages,
        stream=stream,
        include_usage=include_usage,
        temperature=temperature,
        top_p=top_p,
        max_tokens=max_tokens,
        stop=_stop(body.get("stop")),
        seed=seed,
        user=user,
        conversation_id=conversation_id,
        use_docs=use_docs,
        whole_document=ours.get("whole_document") or False,
        loop_guard=ours.get("loop_guard"),  # None: the chat's
        documents=_documents(body),
        logprobs=parse_logprobs(body),
        shaped=shaped,
        tools=tools,
        tool_format=tool_format,
        **_long_sessions(body, ours, conversation_id),
    )


def parse_logprobs(body: Mapping[str, Any]) -> int | None:
    """`logprobs` (a boolean) and `top_logprobs` (0..20, only with logprobs): None when not asked, else
    how many of the most likely tokens each token lists beside its own."""
    wanted = optional(body, "logprobs", bool) or False
    top = optional(body, "top_logprobs", int)
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
        raise bad(f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, not {top}.", "top_logprobs")
    if top and not wanted:
        raise bad("top_logprobs needs logprobs set to true.", "top_logprobs")
    return (top or 0) if wanted else None


def _include_usage(body: Mapping[str, Any], stream: bool) -> bool:
    """`stream_options.include_usage` (stream_options only with stream)."""
    options = optional(body, "stream_options", dict)
    if options is not None and not stream:
        raise bad("stream_options is only allowed when stream is true.", "stream_options")
    if not options:
        return False
    extra = set(options) - {"include_usage"}
    if extra:
        raise bad(f"Unrecognized stream_options field: {sorted(extra)[0]}", "stream_options", "unknown_parameter")
    return optional(options, "include_usage", bool, "stream_options.include_usage") or False


def _shaped(
    body: Mapping[str, Any], ours: Mapping[str, Any], tool_format: ToolFormat
) -> tuple[ToolSet | None, Shaped | None]:
    """`tools` and `response_format` (web/api/tools.py), and the grammar of the reply: one of them."""
    tools, shaped = parse_tools(body), parse_response_format(body)
    if tools is not None:
        tools = tools.written_as(tool_format)
    if tools is not None and (from_tools := tools.shaped()) is not None:
        if shaped is not None:
            raise bad(
                "Send response_format or tools, not both: tool calls have a format of their own.", "response_format"
            )
        shaped = from_tools
    if shaped is not None and ours.get("whole_document"):
        raise bad("x_llmweb.whole_document writes prose: send it without response_format or tools.", "x_llmweb")
    return tools, shaped


def _use_docs(body: Mapping[str, Any], headers: Mapping[str, str]) -> bool | None:
    """`use_docs`, else the X-Llmweb-Use-Docs header; None: neither (the default of the request's kind)."""
    use_docs = optional(body, "use_docs", bool)
    if use_docs is None and "x-llmweb-use-docs" in headers:
        flag = headers["x-llmweb-use-docs"].strip().lower()
        if flag not in ("1", "0", "true", "false"):
            raise bad("The X-Llmweb-Use-Docs header must be 1 or 0.", "use_docs")
        use_docs = flag in ("1", "true")
    return use_docs


OURS = ("whole_document", "loop_guard", "memory")  # x_llmweb's flags; "documents" is a list (`_documents`)
MAX_DOCUMENT_NAME_CHARS = 1024


def _ours(body: Mapping[str, Any]) -> dict[str, bool | None]:
    """llmweb's own flags, `x_llmweb`: {"whole_document": bool, "loop_guard": bool}; None where not sent."""
    ours = optional(body, "x_llmweb", dict) or {}
    for key in ours:
        if key not in (*OURS, "documents", "turns", "continue_from"):
            raise bad(f"Unrecognized x_llmweb field: {str(key)[:100]}", "x_llmweb", "unknown_parameter")
    return {name: optional(ours, name, bool, f"x_llmweb.{name}") for name in OURS}


def _documents(body: Mapping[str, Any]) -> tuple[str, ...] | None:
    """`x_llmweb.documents`: the names or ids of the documents this request reads ([]: none), or None."""
    names = (optional(body, "x_llmweb", dict) or {}).get("documents")
    if names is None:
        return None
    where = "x_llmweb.documents"
    if not isinstance(names, list) or len(names) > MAX_CHAT_DOCUMENTS:
        raise bad(f"{where} must be a list of at most {MAX_CHAT_DOCUMENTS} document names or ids.", where)
    if not all(isinstance(n, str) and 0 < len(n) <= MAX_DOCUMENT_NAME_CHARS for n in names):
        raise bad(f"{where}: each is a document's name or id, 1 to {MAX_DOCUMENT_NAME_CHARS} characters.", where)
    return tuple(names)


def _long_sessions(body: Mapping[str, Any], ours: Mapping[str, Any], conversation_id: str | None) -> dict:
    """x_llmweb's say in a long session: turns kept or left out, memory across chats, continue_from."""
    return dict(
        turn_views=_turn_views(body),
        memory=ours.get("memory") or False,
        continue_from=_continue_from(body, conversation_id),
    )


def _continue_from(body: Mapping[str, Any], conversation_id: str | None) -> str | None:
    """`x_llmweb.continue_from`: the id of the caller's chat a new one continues (conversation_id "new")."""
    from_id = (optional(body, "x_llmweb", dict) or {}).get("continue_from")
    if from_id is None:
        return None
    where = "x_llmweb.continue_from"
    if not isinstance(from_id, str) or not 0 < len(from_id) <= 64:
        raise bad(f"{where}: the id of one of your conversations.", where)
    if conversation_id != NEW_CONVERSATION:
        raise bad(f'{where} starts a new conversation: send it with conversation_id "new".', where)
    return from_id


MAX_TURN_VIEWS = 100  # entries of x_llmweb.turns in one request
VIEWS = VIEW_WORDS  # x_llmweb.turns[i].view -> records.Turn.view


def _turn_views(body: Mapping[str, Any]) -> tuple[tuple[int, str], ...]:
    """`x_llmweb.turns`: [{"turn": n (1-based), "view": "keep" | "leave_out" | "as_planned"}, ...]."""
    items = (optional(body, "x_llmweb", dict) or {}).get("turns")
    if items is None:
        return ()
    where = "x_llmweb.turns"
    if not isinstance(items, list) or len(items) > MAX_TURN_VIEWS:
        raise bad(f"{where} must be a list of at most {MAX_TURN_VIEWS} {{turn, view}} objects.", where)
    out = []
    for item in items:
        n = item.get("turn") if isinstance(item, dict) else None
        view = item.get("view") if isinstance(item, dict) else None
        if not isinstance(n, int) or isinstance(n, bool) or n < 1 or not isinstance(view, str) or view not in VIEWS:
            raise bad(f'{where}: each is {{"turn": n (from 1), "view": one of {", ".join(VIEWS)}}}.', where)
        if len(item) != 2:
            raise bad(f"{where}: each has a turn and a view, nothing else.", where)
        out.append((n - 1, VIEWS[view]))
    return tuple(out)


def parse_messages(
    raw: Any, max_chars: int, stateful: bool = False, tool_format: ToolFormat = GENERIC_FORMAT
) -> tuple[Message, ...]:
    """The messages; `stateful`: a tool result may answer a call of the stored conversation (the
    route checks its id, and renders it). Calls and results are written in `tool_format`."""
    if not isinstance(raw, list) or not raw:
        raise bad("messages must be a non-empty array of {role, content} objects.", "messages")
    out = []
    calls: dict[str, str] = {}  # the tool calls since the last assistant message: id -> name
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(f"{where} must be an object with a role and a content.", where)
        role = m.get("role")
        if role == "function":
            raise bad(f"{where}: function messages are not supported; send tool messages.", f"{where}.role")
        if role not in (*ROLES, "tool"):
            shown = repr(role)[:40]
            raise bad(f"{where}.role is {shown}; it must be one of {', '.join(ROLES)}, tool.", f"{where}.role")
        for name in m:
            if name in MESSAGE_TOOL_FIELDS:
                if (name == "tool_calls") != (role == "assistant") and m[name] not in (None, []):
                    raise bad(
                        f"{where}.{name} belongs to {'an assistant' if name == 'tool_calls' else 'a tool'} message.",
                        f"{where}.{name}",
                    )
            elif name in MESSAGE_NEUTRAL:
                if not any(same(m[name], v) for v in MESSAGE_NEUTRAL[name]):
                    raise bad(f"{where}.{name}: {unsupported(name)}", f"{where}.{name}", "unsupported_parameter")
            elif name not in MESSAGE_FIELDS:
                raise bad(f"Unrecognized field {where}.{name}.", f"{where}.{name}", "unknown_parameter")
        if role == "assistant" and m.get("tool_calls"):
            text, calls = call_text(m["tool_calls"], where, tool_format)
            if m.get("content"):
                text = _content(m["content"], where) + "\n" + text
            out.append(Message("assistant", clean_message(text, max_chars)))
            continue
        if role == "assistant":
            calls = {}
        try:
            text = clean_message(_content(m.get("content"), where), max_chars)
        except InputError as e:
            raise bad(f"{where}: {e}", f"{where}.content") from None
        if role == "tool":
            call_id = m.get("tool_call_id")
            if stateful and isinstance(call_id, str) and call_id not in calls:
                out.append(Message("tool", text, call_id))
                continue
            if not isinstance(call_id, str) or call_id not in calls:
                raise bad(
                    f"{where}: a tool message must answer a call of the assistant message before it "
                    f"(tool_call_id {str(call_id)[:60]!r} is not one of its tool_calls).",
                    f"{where}.tool_call_id",
                )
            text = result_text(call_id, calls[call_id], text, tool_format)
        out.append(Message("system" if role == "developer" else role, text))
    if out[-1].role not in ("user", "tool"):
        raise bad(
            f"messages[{len(out) - 1}]: the last message must be the user's (it is {out[-1].role!r}): "
            "llmweb answers it.",
            f"messages[{len(out) - 1}].role",
        )
    return tuple(out)


def _content(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text" or not isinstance(part.get("text"), str):
                raise bad(
                    f"{where}.content[{j}]: only text parts are supported (type {str(kind)[:40]!r}).",
                    f"{where}.content",
                    "unsupported_content",
                )
            parts.append(part["text"])
        return "\n".join(parts)
    if content is None:
        raise bad(f"{where}.content is missing.", f"{where}.content", "missing_required_parameter")
    raise bad(f"{where}.content must be a string or an array of text parts.", f"{where}.content")


def _max_tokens(body: Mapping[str, Any]) -> int | None:
    a, b = optional(body, "max_tokens", int), optional(body, "max_completion_tokens", int)
    if a is not None and b is not None and a != b:
        raise bad("max_tokens and max_completion_tokens differ; send one of them.", "max_tokens")
    value = a if a is not None else b
    if value is not None and value < 1:
        raise bad("max_tokens must be at least 1.", "max_tokens")
    return value


def _stop(raw: Any) -> tuple[str, ...]:
    stops = [raw] if isinstance(raw, str) else raw if raw is not None else []
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad("stop must be a string or an array of strings.", "stop", "invalid_type")
    if len(stops) > MAX_STOP_STRINGS:
        raise bad(f"stop takes at most {MAX_STOP_STRINGS} strings.", "stop")
    if any(not s or len(s) > MAX_STOP_CHARS for s in stops):
        raise bad(f"each stop string must have 1 to {MAX_STOP_CHARS} characters.", "stop")
    return tuple(dict.fromkeys(stops))


# ---- stop strings on streamed text


class StopScanner:
    """Stop strings on the decoded reply. `scan(text)` takes the whole reply so far and returns
    (what may be shown, stopped): up to the first stop string once one appears; before that,
    everything but a tail that could be the start of a stop string (or an unfinished character)."""

    def __init__(self, stops: Sequence[str]):
        self.stops = tuple(stops)
        self.stopped = False

    def scan(self, text: str, final: bool = False) -> tuple[str, bool]:
        shown, stopped = held_back(text, self.stops, final)
        self.stopped = self.stopped or stopped
        if stopped or final:
            return shown, stopped
        return shown.rstrip("\ufffd"), False  # U+FFFD: a character whose bytes are not all decoded yet


# ---- responses


@dataclass
class Completion:
    """One response's identity: the same id and time in every chunk."""

    model: str
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    def chunk(
        self,
        delta: dict[str, Any] | None,
        finish_reason: str | None = None,
        *,
        usage: Usage | None = None,
        include_usage: bool = False,
        extension: dict[str, Any] | None = None,
        logprobs: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        """One `chat.completion.chunk`. delta=None: the usage chunk (no choices) that ends a stream
        with `stream_options.include_usage`."""
        d: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": []
            if delta is None
            else [
                {
                    "index": 0,
                    "delta": delta,
                    "logprobs": None if logprobs is None else {"content": logprobs, "refusal": None},
                    "finish_reason": finish_reason,
                }
            ],
        }
        if include_usage:
            d["usage"] = usage.to_dict() if usage is not None else None
        if extension is not None:
            d["x_llmweb"] = extension
        return d

    def response(
        self,
        content: str | None,
        finish_reason: str,
        usage: Usage,
        extension: dict[str, Any],
        tool_calls: list[dict[str, Any]] | None = None,
        logprobs: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        """The whole `chat.completion` of a request without streaming (with `tool_calls`: content null;
        `logprobs`: its tokens', when asked)."""
        message: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None}
        if tool_calls:
            message.update(content=None, tool_calls=tool_calls)
        return {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "logprobs": None if logprobs is None else {"content": logprobs, "refusal": None},
                    "finish_reason": finish_reason,
                }
            ],
            "usage": usage.to_dict(),
            "x_llmweb": extension,
        }


def finish_reason(engine_reason: str, stopped: bool) -> str:
    """OpenAI's finish_reason from the engine's (eos | length | cancelled | timeout)."""
    if stopped:
        return "stop"
    return "length" if engine_reason == "length" else "stop"
