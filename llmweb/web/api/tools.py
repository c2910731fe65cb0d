"""Structured output and tools on the chat-completions wire: `response_format`, `tools`,
`tool_choice`, `parallel_tool_calls`, assistant `tool_calls` and `role: "tool"` messages.

    fmt = parse_response_format(body)      -> Shaped | None   (a constraint, a system instruction)
    ts = parse_tools(body)                 -> ToolSet | None
    ts.shaped()                            -> Shaped | None   (None under tool_choice "none")
    ts = ts.written_as(model_format(chat.fmt))   the answering model's own format, where it has one
    ts.reply(text)                         -> (content | None, [ToolCall])
    ts.scanner(ids).feed(text_so_far)      -> the stream's tool_calls deltas, as the reply grows

The tool format is the model's (`model_format`, read from its chat template as llama.cpp's
common/chat.cpp tells formats by their markers). A Hermes/Qwen template (`<tool_call>`) lists the
tools itself (its tools block, rendered by the template: chat/tokens.py's `tools_text`); a call is
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, a result a user-side
`<tool_response>` as the template renders a `tool` message; under `required` and a named tool the
reply is constrained to such blocks (engine/constraint.py's `tagged_calls`), under `auto` it is free.
Every other model answers in a generic JSON format, as llama.cpp does for a chat template without a
tool format (the embedded SmolLM2 has none): a system instruction lists the tools and asks for
`{"tool_calls": [{"name": ..., "arguments": {...}}]}` or, under `auto`, `{"response": "..."}`; the
reply is constrained to exactly that, each call's arguments to its tool's parameters schema, so they
always parse and validate. History renders the same way: an assistant's calls as that JSON, a tool's
result as a user-side message that restates its call (chat/stateless.py cuts a result too long for
the context, with a note, and folds old steps into the summary).

`CallScanner` reads a reply's calls as it grows (the stream's head and argument fragments) and
whole; the arguments are the model's own JSON text either way.

Pure: no I/O, no model. Every refusal is an `ApiError` naming the field. Must not know how the turn
runs (web/api/chat.py) or sample (the engine).
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Any

from llmweb.engine.constraint import (
    Constraint,
    ConstraintError,
    check_schema,
    json_object,
    json_schema,
    tagged_calls,
    tools_schema,
)
from llmweb.web.api.errors import ApiError, bad

MAX_TOOLS = 64
MAX_TOOL_NAME = 64
MAX_DESCRIPTION_CHARS = 2_000
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
GENERIC, HERMES = "generic", "hermes"
HERMES_OPEN, HERMES_CLOSE = "<tool_call>\n", "\n</tool_call>"

log = logging.getLogger(__name__)


def _constraint_error(e: ConstraintError) -> ApiError:
    return bad(str(e), e.param, "invalid_schema")


@dataclass(frozen=True, slots=True)
class Shaped:
    """What a request's reply must be: the grammar (None: free, the model's own format under
    `auto`), and the system text that tells the model."""

    constraint: Constraint | None
    instruction: str


def parse_response_format(body: Mapping[str, Any]) -> Shaped | None:
    """`response_format`: text (None), json_object, or json_schema {name, schema, strict}."""
    rf = body.get("response_format")
    if rf is None:
        return None
    if not isinstance(rf, dict):
        raise bad("response_format must be an object with a type.", "response_format", "invalid_type")
    kind = rf.get("type")
    for key in rf:
        if key not in ("type", *(("json_schema",) if kind == "json_schema" else ())):
            how = ' (for a schema, send {"type": "json_schema", "json_schema": {"name": ..., "schema": ...}})'
            raise bad(
                f"Unrecognized field response_format.{str(key)[:60]}{how if key == 'schema' else ''}.",
                f"response_format.{str(key)[:60]}",
                "unknown_parameter",
            )
    if kind == "text":
        return None
    if kind == "json_object":
        return Shaped(json_object(), "Answer with one JSON object and nothing else.")
    if kind != "json_schema":
        shown = repr(kind)[:40]
        raise bad(f"response_format.type is {shown}; it must be text, json_object or json_schema.", "response_format")
    js = rf.get("json_schema")
    if not isinstance(js, dict):
        raise bad("response_format.json_schema must be an object.", "response_format.json_schema", "invalid_type")
    for key in js:
        if key not in ("name", "schema", "strict", "description"):
            raise bad(f"Unrecognized field response_format.json_schema.{str(key)[:60]}.", "response_format.json_schema")
    name = js.get("name")
    if not isinstance(name, str) or not 0 < len(name) <= MAX_TOOL_NAME:
        raise bad(
            f"response_format.json_schema.name must be a string of 1 to {MAX_TOOL_NAME} characters.",
            "response_format.json_schema.name",
        )
    if not isinstance(js.get("strict", False), bool | None):
        raise bad("response_format.json_schema.strict must be a boolean.", "response_format.json_schema.strict")
    schema = js.get("schema", {"type": "object"})
    try:
        c = json_schema(schema, "response_format.json_schema.schema")
    except ConstraintError as e:
        raise _constraint_error(e) from None
    return Shaped(c, f"Answer with one JSON value that matches this JSON schema, and nothing else:\n{c.schema}")


# ---- the model's tool format


@dataclass(frozen=True, slots=True)
class ToolFormat:
    """How a model writes and reads tool calls. `generic`: the JSON format above, for a chat template
    without tools. `hermes`: the model's own (Hermes 2 Pro, Qwen 2.5/3, ...): its template lists the
    tools in the system message (`render`: that text, from the template itself), a call is
    `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, a result is a user-side
    `<tool_response>\\n...\\n</tool_response>`, as the template renders a `tool` message."""

    name: str = GENERIC
    render: Callable[[list[dict[str, Any]]], str] | None = field(default=None, compare=False)


GENERIC_FORMAT = ToolFormat()


def model_format(chat_fmt: Any, local: bool = True) -> ToolFormat:
    """The tool format of a model, read from its chat template (as llama.cpp's common/chat.cpp
    tells formats by their markers). A template that renders no tools, or whose format is not one
    of ours, gets the generic one (the latter said once in the log). `local`: a remote server
    constrains with a JSON schema of its own, so it gets the generic format."""
    tokenizer = getattr(chat_fmt, "tokenizer", None)
    template = getattr(tokenizer, "chat_template", None)
    render = getattr(chat_fmt, "tools_text", None)
    if not local or not isinstance(template, str) or render is None:
        return GENERIC_FORMAT
    name = _template_format(template)
    return ToolFormat(name, render) if name != GENERIC else GENERIC_FORMAT


@lru_cache(maxsize=64)
def _template_format(template: str) -> str:
    if not re.search(r"\btools\b", template):
        return GENERIC
    if "<tool_call>" in template:
        return HERMES
    known = {"<|python_tag|>": "Llama 3.x", "[TOOL_CALLS]": "Mistral", "<|tool_call_start|>": "LFM2"}
    seen = next((v for k, v in known.items() if k in template), "not recognised")
    log.warning(
        "the model's chat template renders tools, but its tool format (%s) is not one llmweb writes: "
        "tools use the generic JSON format",
        seen,
    )
    return GENERIC


# ---- reading a reply's calls, as it grows

_CALL_HEAD = re.compile(r'\{\s*"name"\s*:\s*"([A-Za-z0-9_\-]{1,64})"\s*,\s*"arguments"\s*:\s*(?=\S)')
_GENERIC_START = re.compile(r'\{\s*"tool_calls"\s*:\s*\[\s*')
_CLOSERS = {"{": "}", "[": "]"}


class _Call:
    __slots__ = ("id", "name", "start", "end", "sent", "depth", "at", "in_string", "escaped")

    def __init__(self, call_id: str, name: str, start: int):
        self.id, self.name, self.start = call_id, name, start
        self.end: int | None = None  # past the arguments' JSON value, once it is whole
        self.sent = start  # the arguments streamed so far end here
        self.depth, self.at, self.in_string, self.escaped = 0, start, False, False

    def scan(self, text: str) -> None:
        """Walk the arguments' JSON value from where the last call stopped (linear over a reply)."""
        i = self.at
        while i < len(text) and self.end is None:
            ch = text[i]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
                    if self.depth == 0:
                        self.end = i + 1
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif self.depth == 0 and (ch in ",}]" or ch.isspace()):
                self.end = i  # a bare number, true, false or null ends before this
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.end = i + 1
            i += 1
        self.at = i


class CallScanner:
    """A reply's tool calls as its text grows: `feed(text)` gives the stream's new `tool_calls`
    deltas (a call's head once: index, id, type, name, arguments ""; then argument fragments as
    they are decoded); `result(text)` the reply as (content, calls). The arguments are the
    model's own JSON text, streamed or not, so the two always agree."""

    def __init__(self, fmt: ToolFormat, ids: Callable[[int], str] | None = None):
        self.fmt = fmt
        self.ids = ids
        self.calls: list[_Call] = []
        self.pos = 0  # where the next call may start
        self.started = False  # the reply is in the tool-call format

    def _next_head(self, text: str) -> re.Match[str] | None:
        if self.fmt.name == HERMES:
            at = text.find("<tool_call>", self.pos)
            if at < 0:
                return None
            self.started = True
            j = at + len("<tool_call>")
            while j < len(text) and text[j].isspace():
                j += 1
            return _CALL_HEAD.match(text, j)
        if not self.started:
            if _GENERIC_START.match(text) is None:
                return None
            self.started = True
        return _CALL_HEAD.search(text, self.pos)

    def feed(self, text: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        while True:
            if self.calls and self.calls[-1].end is None:
                c, i = self.calls[-1], len(self.calls) - 1
                c.scan(text)
                upto = c.end if c.end is not None else len(text)
                if upto > c.sent:
                    out.append({"index": i, "function": {"arguments": text[c.sent : upto]}})
                    c.sent = upto
                if c.end is None:
                    return out
                self.pos = c.end
            m = self._next_head(text)
            if m is None:
                return out
            i = len(self.calls)
            call_id = self.ids(i) if self.ids is not None else new_call_id()
            self.calls.append(_Call(call_id, m.group(1), m.end()))
            head = {"index": i, "id": call_id, "type": "function", "function": {"name": m.group(1), "arguments": ""}}
            out.append(head)

    def shown(self, text: str) -> int:
        """How much of `text` may stream as content: none of the generic format's JSON; the Hermes
        format's text before its first call (and before what may yet become one)."""
        if self.fmt.name != HERMES:
            return 0
        at = text.find("<tool_call>")
        if at >= 0:
            return at
        for k in range(min(len("<tool_call>"), len(text)), 0, -1):
            if "<tool_call>".startswith(text[-k:]):
                return len(text) - k
        return len(text)

    def result(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The whole reply as (content, calls): the calls whose arguments are whole JSON; text that
        is not the format is content."""
        self.feed(text)
        calls = []
        for c in self.calls:
            args = text[c.start : c.end] if c.end is not None else ""
            try:
                json.loads(args)
            except ValueError:
                continue
            calls.append(ToolCall(c.id, c.name, args))
        if self.fmt.name == HERMES:
            content = re.sub(r"<tool_call>.*?(</tool_call>|$)", "", text, flags=re.S).strip() if calls else text
            return (content or None) if calls else text, calls
        if calls:
            return None, calls
        try:
            value = json.loads(text)
        except ValueError:
            return text, []
        if isinstance(value, dict) and isinstance(value.get("response"), str):
            return value["response"], []
        return text, []


# ---- tools


@dataclass(frozen=True, slots=True)
class Tool:
    name: str
    description: str
    parameters: Any  # the JSON schema of its arguments (checked)


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True, slots=True)
class ToolSet:
    tools: tuple[Tool, ...]
    choice: str  # auto | none | required | a tool's name (named)
    parallel: bool = True
    fmt: ToolFormat = field(default_factory=lambda: GENERIC_FORMAT)

    @property
    def callable(self) -> tuple[Tool, ...]:
        if self.choice in ("auto", "required"):
            return self.tools
        return tuple(t for t in self.tools if t.name == self.choice)

    def written_as(self, fmt: ToolFormat) -> ToolSet:
        """These tools, in the answering model's format (`model_format`)."""
        return self if fmt == self.fmt else replace(self, fmt=fmt)

    def _call_schema(self) -> dict[str, Any]:
        return {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {"name": {"const": t.name}, "arguments": t.parameters},
                    "required": ["name", "arguments"],
                    "additionalProperties": False,
                }
                for t in self.callable
            ]
        }

    def shaped(self) -> Shaped | None:
        """The grammar and the instruction of this request's reply; None under "none", and None
        under "auto" in a model's own format (it writes a call, or text, as it was trained to)."""
        if self.choice == "none":
            return None
        if self.fmt.name == HERMES:
            if self.choice == "auto":
                return Shaped(None, self.instruction())
            try:
                c = tagged_calls(self._call_schema(), HERMES_OPEN, HERMES_CLOSE, self.parallel, "tools")
            except ConstraintError as e:
                raise _constraint_error(e) from None
            return Shaped(c, self.instruction())
        calls = {
            "type": "array",
            "items": self._call_schema(),
            "minItems": 1,
            **({} if self.parallel else {"maxItems": 1}),
        }
        schema: dict[str, Any] = {
            "type": "object",
            "properties": {"tool_calls": calls},
            "required": ["tool_calls"],
            "additionalProperties": False,
        }
        if self.choice == "auto":
            answer = {
                "type": "object",
                "properties": {"response": {"type": "string"}},
                "required": ["response"],
                "additionalProperties": False,
            }
            schema = {"anyOf": [schema, answer]}
        try:
            c = tools_schema(schema, "tools")
        except ConstraintError as e:
            for i, t in enumerate(self.tools):  # name the tool whose parameters cannot compile
                if t in self.callable:
                    try:
                        json_schema(t.parameters, f"tools[{i}].function.parameters")
                    except ConstraintError as one:
                        raise _constraint_error(one) from None
            raise _constraint_error(e) from None
        return Shaped(c, self.instruction())

    def instruction(self) -> str:
        if self.fmt.render is not None:  # the model's own template lists the tools
            listed = [
                {
                    "type": "function",
                    "function": {"name": t.name, "description": t.description, "parameters": t.parameters},
                }
                for t in self.callable
            ]
            text = self.fmt.render(listed)
            if self.choice not in ("auto", "required"):
                text += f"\n\nCall the function {self.choice}."
            return text
        listed_text = "\n".join(
            json.dumps({"name": t.name, "description": t.description, "parameters": t.parameters}, ensure_ascii=False)
            for t in self.callable
        )
        how = 'Respond in JSON: {"tool_calls": [{"name": "<tool name>", "arguments": {<its arguments>}}]}'
        if self.choice == "auto":
            how += ' to call tools, or {"response": "<your answer>"} to answer the user directly.'
        elif self.choice != "required":
            how += f" to call the tool {self.choice}."
        else:
            how += " to call one or more of them."
        return f"You can call these tools:\n{listed_text}\n{how}"

    def scanner(self, ids: Callable[[int], str] | None = None) -> CallScanner:
        return CallScanner(self.fmt, ids)

    def reply(self, text: str, ids: Callable[[int], str] | None = None) -> tuple[str | None, list[ToolCall]]:
        """The model's reply as (content, calls); text that is not the format is content.
        `ids(i)`: the i-th call's id (a stateful turn's, `stored_call_id`); else a random one."""
        return self.scanner(ids).result(text)


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def stored_call_id(conv_id: str, turn: int, i: int) -> str:
    """The id of a stateful turn's i-th call: the same when the next request answers it."""
    return "call_" + hashlib.sha256(f"{conv_id}\n{turn}\n{i}".encode()).hexdigest()[:24]


def stored_calls(conv_id: str, turn: int, reply: str, fmt: ToolFormat = GENERIC_FORMAT) -> dict[str, str]:
    """A stored turn's calls by id (each as the model wrote it), from its reply; {} when it made none."""
    _, calls = CallScanner(fmt, lambda i: stored_call_id(conv_id, turn, i)).result(reply)
    return {c.id: _call_json(c.name, c.arguments) for c in calls}


def _call_json(name: str, arguments: str) -> str:
    """A call as the model writes it: `{"name": ..., "arguments": ...}`, its arguments as they were."""
    return '{"name": ' + json.dumps(name, ensure_ascii=False) + ', "arguments": ' + arguments + "}"


def parse_tools(body: Mapping[str, Any]) -> ToolSet | None:
    """`tools`, `tool_choice` and `parallel_tool_calls`; None when no tools are sent."""
    raw = body.get("tools")
    choice_raw = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad("parallel_tool_calls must be a boolean.", "parallel_tool_calls", "invalid_type")
    if raw is None or raw == []:
        if choice_raw not in (None, "none", "auto"):
            raise bad("tool_choice names a tool, but the request sends no tools.", "tool_choice")
        return None
    if not isinstance(raw, list) or len(raw) > MAX_TOOLS:
        raise bad(f"tools must be a list of at most {MAX_TOOLS} tools.", "tools")
    tools = tuple(_tool(t, f"tools[{i}]") for i, t in enumerate(raw))
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise bad("tools: two tools have the same name.", "tools")
    choice = _choice(choice_raw, names)
    return ToolSet(tools, choice, True if parallel is None else parallel)


def _tool(t: Any, where: str) -> Tool:
    if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
        raise bad(f'{where} must be {{"type": "function", "function": {{...}}}}.', where)
    f = t["function"]
    name = f.get("name")
    if not isinstance(name, str) or not 0 < len(name) <= MAX_TOOL_NAME or not name.replace("-", "_").isidentifier():
        raise bad(
            f"{where}.function.name must be 1 to {MAX_TOOL_NAME} letters, digits, _ or -.", f"{where}.function.name"
        )
    description = f.get("description") or ""
    if not isinstance(description, str) or len(description) > MAX_DESCRIPTION_CHARS:
        raise bad(
            f"{where}.function.description must be a string of at most {MAX_DESCRIPTION_CHARS:,} characters.",
            f"{where}.function.description",
        )
    params = f.get("parameters", EMPTY_PARAMETERS)
    try:
        check_schema(params, f"{where}.function.parameters")
    except ConstraintError as e:
        raise _constraint_error(e) from None
    return Tool(name, description, params)


def _choice(raw: Any, names: Sequence[str]) -> str:
    if raw is None:
        return "auto"
    if raw in ("auto", "none", "required"):
        return str(raw)
    if isinstance(raw, dict) and raw.get("type") == "function" and isinstance(raw.get("function"), dict):
        name = raw["function"].get("name")
        if name in names:
            return str(name)
        shown = repr(name)[:70]
        raise bad(f"tool_choice names {shown}, which is not among tools ({', '.join(names)}).", "tool_choice")
    raise bad(
        'tool_choice must be "auto", "none", "required" or {"type": "function", "function": {"name": ...}}.',
        "tool_choice",
    )


# ---- history


def call_text(tool_calls: Any, where: str, fmt: ToolFormat = GENERIC_FORMAT) -> tuple[str, dict[str, str]]:
    """An assistant's `tool_calls` as the model writes them (its format), and {id: the call}."""
    if not isinstance(tool_calls, list) or not tool_calls:
        raise bad(f"{where}.tool_calls must be a non-empty list.", f"{where}.tool_calls")
    calls, ids = [], {}
    for j, c in enumerate(tool_calls):
        at = f"{where}.tool_calls[{j}]"
        f = c.get("function") if isinstance(c, dict) else None
        if not isinstance(f, dict) or not isinstance(c.get("id"), str) or not isinstance(f.get("name"), str):
            raise bad(f"{at} must be {{id, type: function, function: {{name, arguments}}}}.", at)
        raw = f.get("arguments") or "{}"
        try:
            json.loads(raw)
        except (TypeError, ValueError):
            raise bad(f"{at}.function.arguments must be a JSON text.", f"{at}.function.arguments") from None
        calls.append(_call_json(f["name"], raw.strip()))
        ids[c["id"]] = calls[-1]
    if fmt.name == HERMES:
        return "\n".join(HERMES_OPEN + call + HERMES_CLOSE for call in calls), ids
    return '{"tool_calls": [' + ", ".join(calls) + "]}", ids


def result_text(call_id: str, call: str, content: str, fmt: ToolFormat = GENERIC_FORMAT) -> str:
    """A tool's result as the model reads it, a user-side message. Generic: it restates its call, so
    a result is never without its call, even once the call's own message is folded into the
    summary. Hermes: as the model's template renders a `tool` message."""
    if fmt.name == HERMES:
        return f"<tool_response>\n{content}\n</tool_response>"
    return f"[result of the tool call {call} ({call_id})]\n{content}"
