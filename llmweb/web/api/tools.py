"""Structured output and tools on the chat-completions wire: `response_format`, `tools`,
`tool_choice`, `parallel_tool_calls`, assistant `tool_calls` and `role: "tool"` messages.

    fmt = parse_response_format(body)      -> Shaped | None   (a constraint, a system instruction)
    ts = parse_tools(body)                 -> ToolSet | None
    ts.shaped()                            -> Shaped | None   (None under tool_choice "none")
    ts.reply(text)                         -> (content | None, [ToolCall])

The model answers in a generic JSON format, as llama.cpp does for a chat template without a tool
format (the embedded SmolLM2 has none): a system instruction lists the tools and asks for
`{"tool_calls": [{"name": ..., "arguments": {...}}]}` or, under `auto`, `{"response": "..."}`; the
reply is constrained to exactly that (engine/constraint.py), each call's arguments to its tool's
parameters schema, so they always parse and validate. History renders the same way: an assistant's
calls as that JSON, a tool's result as a user-side message that restates its call (chat/stateless.py
cuts a result too long for the context, with a note, and folds old steps into the summary).

Pure: no I/O, no model. Every refusal is an `ApiError` naming the field. Must not know how the turn
runs (web/api/chat.py) or sample (the engine).
"""

from __future__ import annotations

import hashlib
import json
import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from llmweb.engine.constraint import Constraint, ConstraintError, check_schema, json_object, json_schema, tools_schema
from llmweb.web.api.errors import ApiError, bad

MAX_TOOLS = 64
MAX_TOOL_NAME = 64
MAX_DESCRIPTION_CHARS = 2_000
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


def _constraint_error(e: ConstraintError) -> ApiError:
    return bad(str(e), e.param, "invalid_schema")


@dataclass(frozen=True, slots=True)
class Shaped:
    """What a request's reply must be: the grammar, and the system text that tells the model."""

    constraint: Constraint
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

    @property
    def callable(self) -> tuple[Tool, ...]:
        if self.choice in ("auto", "required"):
            return self.tools
        return tuple(t for t in self.tools if t.name == self.choice)

    def shaped(self) -> Shaped | None:
        """The grammar and the instruction of this request's reply; None under "none"."""
        if self.choice == "none":
            return None
        call = {
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
        calls = {"type": "array", "items": call, "minItems": 1, **({} if self.parallel else {"maxItems": 1})}
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
        listed = "\n".join(
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
        return f"You can call these tools:\n{listed}\n{how}"

    def reply(self, text: str, ids: Callable[[int], str] | None = None) -> tuple[str | None, list[ToolCall]]:
        """The model's JSON reply as (content, calls); text that is not the format is content.
        `ids(i)`: the i-th call's id (a stateful turn's, `stored_call_id`); else a random one."""
        try:
            value = json.loads(text)
        except ValueError:
            return text, []
        if isinstance(value, dict) and isinstance(value.get("tool_calls"), list):
            made = [c for c in value["tool_calls"] if isinstance(c, dict)]
            calls = [
                ToolCall(
                    ids(i) if ids is not None else new_call_id(),
                    str(c.get("name")),
                    json.dumps(c.get("arguments", {}), ensure_ascii=False),
                )
                for i, c in enumerate(made)
            ]
            return None, calls
        if isinstance(value, dict) and isinstance(value.get("response"), str):
            return value["response"], []
        return text, []


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def stored_call_id(conv_id: str, turn: int, i: int) -> str:
    """The id of a stateful turn's i-th call: the same when the next request answers it."""
    return "call_" + hashlib.sha256(f"{conv_id}\n{turn}\n{i}".encode()).hexdigest()[:24]


def stored_calls(conv_id: str, turn: int, reply: str) -> dict[str, str]:
    """A stored turn's calls by id (each as the model wrote it), from its reply; {} when it made none."""
    try:
        value = json.loads(reply)
    except ValueError:
        return {}
    made = value.get("tool_calls") if isinstance(value, dict) else None
    if not isinstance(made, list):
        return {}
    calls = [c for c in made if isinstance(c, dict)]
    return {stored_call_id(conv_id, turn, i): json.dumps(c, ensure_ascii=False) for i, c in enumerate(calls)}


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


def call_text(tool_calls: Any, where: str) -> tuple[str, dict[str, str]]:
    """An assistant's `tool_calls` as the model wrote them (the generic JSON), and {id: the call}."""
    if not isinstance(tool_calls, list) or not tool_calls:
        raise bad(f"{where}.tool_calls must be a non-empty list.", f"{where}.tool_calls")
    calls, ids = [], {}
    for j, c in enumerate(tool_calls):
        at = f"{where}.tool_calls[{j}]"
        f = c.get("function") if isinstance(c, dict) else None
        if not isinstance(f, dict) or not isinstance(c.get("id"), str) or not isinstance(f.get("name"), str):
            raise bad(f"{at} must be {{id, type: function, function: {{name, arguments}}}}.", at)
        try:
            args = json.loads(f.get("arguments") or "{}")
        except (TypeError, ValueError):
            raise bad(f"{at}.function.arguments must be a JSON text.", f"{at}.function.arguments") from None
        calls.append({"name": f["name"], "arguments": args})
        ids[c["id"]] = json.dumps(calls[-1], ensure_ascii=False)
    return json.dumps({"tool_calls": calls}, ensure_ascii=False), ids


def result_text(call_id: str, call: str, content: str) -> str:
    """A tool's result as the model reads it: a user-side message that restates its call, so a
    result is never without its call, even once the call's own message is folded into the summary."""
    return f"[result of the tool call {call} ({call_id})]\n{content}"
