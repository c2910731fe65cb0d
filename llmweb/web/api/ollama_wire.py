"""Ollama's wire format, translated: `/api/chat` and `/api/generate` bodies into the OpenAI-shaped
chat-completions body that web/api/chat_wire.py parses (so `format` becomes `response_format`,
`tools` stay `tools`, `options` become sampling fields), their replies into Ollama's NDJSON lines,
and the shapes of `/api/tags`, `/api/show`, `/api/ps` and `/api/embed`.

Options: `temperature`, `top_p`, `num_predict` (-1 and -2: the server's reply budget), `stop`,
`seed` are used; `num_ctx` is accepted and clamped (the loaded model's context is the server's,
LLMWEB_CONTEXT_LIMIT; `/api/show` reports it); the other options Ollama defines (`top_k`,
`repeat_penalty`, `num_thread`, ...) are accepted and ignored (IGNORED_OPTIONS); any other name, or
a value of the wrong type, is a 400 naming it. `keep_alive` is accepted and ignored (the server
keeps its model loaded). Ollama is stateless: each request carries its whole history, and nothing
is stored (llmweb's stateful conversations are /v1's `conversation_id`).

Pure: no I/O, no model, no web framework. Every refusal is an `ApiError` naming the field.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from llmweb.web.api.errors import bad

VERSION = "0.12.0"  # the Ollama API this subset follows (clients check for a recent one)
LATEST = ":latest"
# Ollama's options that change nothing here (the server decides threads, memory and the sampler's rest)
IGNORED_OPTIONS = frozenset(
    {
        "num_keep",
        "top_k",
        "min_p",
        "typical_p",
        "repeat_last_n",
        "repeat_penalty",
        "presence_penalty",
        "frequency_penalty",
        "penalize_newline",
        "mirostat",
        "mirostat_tau",
        "mirostat_eta",
        "tfs_z",
        "numa",
        "num_batch",
        "num_gpu",
        "main_gpu",
        "low_vram",
        "use_mmap",
        "use_mlock",
        "num_thread",
        "vocab_only",
        "f16_kv",
        "logits_all",
    }
)
USED_OPTIONS = {"temperature": (int, float), "top_p": (int, float), "num_predict": (int,), "seed": (int,)}
CHAT_FIELDS = {"model", "messages", "stream", "format", "options", "tools", "keep_alive", "think"}
GENERATE_FIELDS = {
    "model",
    "prompt",
    "system",
    "stream",
    "format",
    "options",
    "keep_alive",
    "raw",
    "think",
    "suffix",
    "images",
    "template",
    "context",
}
MESSAGE_FIELDS = {"role", "content", "images", "tool_calls", "tool_name", "thinking"}


def model_name(body: Mapping[str, Any]) -> str:
    """`model`, without Ollama's default tag (":latest")."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("model is required (GET /api/tags lists them).", "model")
    return model[: -len(LATEST)] if model.endswith(LATEST) else model


def now() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def _unknown(body: Mapping[str, Any], known: set[str]) -> None:
    for name in body:
        if name not in known:
            raise bad(f"Unrecognized field: {str(name)[:100]}", str(name)[:100], "unknown_parameter")


def _neutral(body: Mapping[str, Any], name: str, neutral: tuple[Any, ...], why: str) -> None:
    value = body.get(name)
    if value is not None and value not in neutral:
        raise bad(f"{name}: {why}", name, "unsupported_parameter")


def options(raw: Any) -> dict[str, Any]:
    """Ollama's `options` as chat-completions fields (see the module docstring)."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise bad("options must be an object.", "options", "invalid_type")
    out: dict[str, Any] = {}
    for name, value in raw.items():
        where = f"options.{str(name)[:60]}"
        if name in IGNORED_OPTIONS:
            continue
        if name == "num_ctx":
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise bad(f"{where} must be a positive integer.", where, "invalid_type")
            continue  # clamped: the loaded model's context is the server's (LLMWEB_CONTEXT_LIMIT)
        if name == "stop":
            stops = [value] if isinstance(value, str) else value
            if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
                raise bad(f"{where} must be a string or a list of strings.", where, "invalid_type")
            out["stop"] = stops
            continue
        kinds = USED_OPTIONS.get(name)
        if kinds is None:
            raise bad(f"Unknown option {where}.", where, "unknown_parameter")
        if isinstance(value, bool) or not isinstance(value, kinds):
            raise bad(f"{where} must be {'an integer' if kinds == (int,) else 'a number'}.", where, "invalid_type")
        if name == "num_predict":
            if value == 0 or value < -2:
                raise bad(f"{where} must be positive (or -1: the server's reply budget).", where)
            if value > 0:
                out["max_tokens"] = value
        else:
            out[name] = value
    return out


def response_format(fmt: Any) -> dict[str, Any] | None:
    """`format`: "json" is `json_object`; a JSON schema is a strict `json_schema`; "" or none: free text."""
    if fmt is None or fmt == "":
        return None
    if fmt == "json":
        return {"type": "json_object"}
    if isinstance(fmt, dict):
        return {"type": "json_schema", "json_schema": {"name": "response", "schema": fmt, "strict": True}}
    raise bad('format must be "json" or a JSON schema object.', "format", "invalid_type")


def _common(body: Mapping[str, Any]) -> dict[str, Any]:
    """The fields /api/chat and /api/generate share, as chat-completions fields."""
    stream = body.get("stream", True)
    if not isinstance(stream, bool):
        raise bad("stream must be a boolean.", "stream", "invalid_type")
    keep_alive = body.get("keep_alive")
    if keep_alive is not None and (isinstance(keep_alive, bool) or not isinstance(keep_alive, str | int | float)):
        raise bad("keep_alive must be a duration (a string such as '5m', or seconds).", "keep_alive", "invalid_type")
    _neutral(body, "think", (False,), "thinking is not supported by this server's model.")
    out: dict[str, Any] = {"model": model_name(body), "stream": stream, **options(body.get("options"))}
    if stream:
        out["stream_options"] = {"include_usage": True}
    rf = response_format(body.get("format"))
    if rf is not None:
        out["response_format"] = rf
    return out


def chat_body(body: Mapping[str, Any]) -> dict[str, Any]:
    """An `/api/chat` body as a chat-completions body (web/api/chat_wire.py parses it next)."""
    _unknown(body, CHAT_FIELDS)
    out = _common(body)
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise bad("messages must be a non-empty list of {role, content}.", "messages")
    out["messages"] = messages(raw)
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise bad("tools must be a list of functions.", "tools", "invalid_type")
        if tools:
            out["tools"] = tools
    return out


def messages(raw: Sequence[Any]) -> list[dict[str, Any]]:
    """Ollama's messages as OpenAI's: an assistant's `tool_calls` (arguments as objects) get ids and
    arguments as JSON strings, and a `tool` message answers the latest call of its `tool_name`
    (else the latest call)."""
    out: list[dict[str, Any]] = []
    calls: list[tuple[str, str]] = []  # (id, name) of the calls so far
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(f"{where} must be an object.", where, "invalid_type")
        for name in m:
            if name not in MESSAGE_FIELDS:
                raise bad(f"Unrecognized field {where}.{str(name)[:60]}.", f"{where}.{str(name)[:60]}")
        if m.get("images"):
            raise bad(f"{where}.images: images are not supported by this server's model.", f"{where}.images")
        role, content = m.get("role"), m.get("content", "")
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise bad(f"{where}.content must be a string.", f"{where}.content", "invalid_type")
        msg: dict[str, Any] = {"role": role, "content": content}
        if m.get("tool_calls"):
            msg["tool_calls"] = []
            for j, call in enumerate(m["tool_calls"]):
                fn = call.get("function") if isinstance(call, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise bad(f"{where}.tool_calls[{j}] needs function.name.", f"{where}.tool_calls")
                args = fn.get("arguments", {})
                call_id = f"call_{i}_{j}"
                calls.append((call_id, fn["name"]))
                text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
                msg["tool_calls"].append(
                    {"id": call_id, "type": "function", "function": {"name": fn["name"], "arguments": text}}
                )
            msg["content"] = content or None
        if role == "tool":
            named = m.get("tool_name")
            match = [c for c, n in calls if n == named] if named else []
            picked = match[-1] if match else calls[-1][0] if calls else None
            if picked is None:
                raise bad(f"{where}: a tool message with no tool call before it.", f"{where}.role")
            msg["tool_call_id"] = picked
        out.append(msg)
    return out


def generate_body(body: Mapping[str, Any]) -> dict[str, Any]:
    """An `/api/generate` body (not raw) as a chat-completions body: `system` and `prompt` as messages."""
    _unknown(body, GENERATE_FIELDS)
    check_generate(body)
    out = _common(body)
    system = body.get("system")
    if system is not None and not isinstance(system, str):
        raise bad("system must be a string.", "system", "invalid_type")
    out["messages"] = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": body.get("prompt")}
    ]
    return out


def check_generate(body: Mapping[str, Any]) -> None:
    """What /api/generate refuses, raw or not: a suffix (fill-in-the-middle), images, a template, a context."""
    _neutral(body, "suffix", ("",), "fill-in-the-middle (suffix) is not supported.")
    _neutral(body, "template", ("",), "a custom template is not supported: send raw with the prompt as written.")
    if body.get("images"):
        raise bad("images are not supported by this server's model.", "images", "unsupported_parameter")
    if body.get("context"):
        raise bad(
            "context (the token list of an earlier reply) is not supported: Ollama's API is stateless here; "
            "send the history with /api/chat.",
            "context",
            "unsupported_parameter",
        )
    prompt = body.get("prompt")
    if prompt is not None and not isinstance(prompt, str):
        raise bad("prompt must be a string.", "prompt", "invalid_type")
    raw = body.get("raw")
    if raw is not None and not isinstance(raw, bool):
        raise bad("raw must be a boolean.", "raw", "invalid_type")
    if raw and body.get("format"):
        raise bad("format is not supported with raw.", "format", "unsupported_parameter")


# ---- replies


def ollama_tool_calls(calls: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI's tool calls (arguments as a JSON string) as Ollama's (arguments as an object)."""
    out = []
    for call in calls:
        fn = call.get("function") or {}
        args = fn.get("arguments") or "{}"
        try:
            parsed = json.loads(args) if isinstance(args, str) else args
        except json.JSONDecodeError:
            parsed = {}
        out.append({"function": {"name": fn.get("name", ""), "arguments": parsed if isinstance(parsed, dict) else {}}})
    return out


def message(content: str, tool_calls: Sequence[Mapping[str, Any]] = ()) -> dict[str, Any]:
    out: dict[str, Any] = {"role": "assistant", "content": content}
    if tool_calls:
        out["tool_calls"] = ollama_tool_calls(tool_calls)
    return out


def stats(usage: Mapping[str, Any], total_s: float, ttft_s: float, decode_tok_s: float) -> dict[str, Any]:
    """The counts and durations (nanoseconds) of a final line."""
    generated = int(usage.get("completion_tokens", 0))
    eval_s = generated / decode_tok_s if decode_tok_s > 0 else 0.0
    return {
        "total_duration": int(total_s * 1e9),
        "load_duration": 0,
        "prompt_eval_count": int(usage.get("prompt_tokens", 0)),
        "prompt_eval_duration": int(ttft_s * 1e9),
        "eval_count": generated,
        "eval_duration": int(eval_s * 1e9),
    }


def line(model: str, **fields: Any) -> bytes:
    """One NDJSON line of a reply."""
    body = {"model": model, "created_at": now(), **fields}
    return (json.dumps(body, ensure_ascii=False, separators=(",", ":")) + "\n").encode()


def details(arch: str | None, fmt: str | None, size_bytes: int | None = None) -> dict[str, Any]:
    return {
        "parent_model": "",
        "format": fmt or "",
        "family": arch or "",
        "families": [arch] if arch else None,
        "parameter_size": "",
        "quantization_level": "",
    }


def tag(name: str, model: Mapping[str, Any], modified: float) -> dict[str, Any]:
    """One model of `/api/tags` from its /v1/models object."""
    return {
        "name": name,
        "model": name,
        "modified_at": datetime.fromtimestamp(modified, UTC).isoformat().replace("+00:00", "Z"),
        "size": int(model.get("size_bytes") or 0),
        "digest": "",
        "details": details(model.get("architecture"), model.get("format")),
    }


def show(model: Mapping[str, Any], capabilities: Sequence[str], modified: float) -> dict[str, Any]:
    """`/api/show` of a model from its /v1/models object: its details, its capabilities, and its
    context in `model_info` as `<arch>.context_length` (the context it serves with here)."""
    arch = model.get("architecture") or "llama"
    info: dict[str, Any] = {"general.architecture": arch}
    if model.get("context_length"):
        info[f"{arch}.context_length"] = int(model["context_length"])
    return {
        "modelfile": "",
        "parameters": "",
        "template": "",
        "details": details(arch, model.get("format")),
        "model_info": info,
        "capabilities": list(capabilities),
        "modified_at": datetime.fromtimestamp(modified, UTC).isoformat().replace("+00:00", "Z"),
    }


def ps_entry(name: str, model: Mapping[str, Any]) -> dict[str, Any]:
    far = datetime.fromtimestamp(time.time() + 365 * 86400, UTC).isoformat().replace("+00:00", "Z")
    return {
        "name": name,
        "model": name,
        "size": int(model.get("size_bytes") or 0),
        "digest": "",
        "details": details(model.get("architecture"), model.get("format")),
        "expires_at": far,
        "size_vram": 0,
        "context_length": int(model.get("context_length") or 0),
    }
