"""The legacy completions wire format: read a request (`parse_completion`), write the response
(`TextCompletion.response`) or its chunks for server-sent events (`TextCompletion.chunk`), and the
legacy `logprobs` object (`legacy_logprobs`).

Pure: no I/O, no model, no web framework; web/api/completions.py runs it. Every refusal is an
`ApiError` naming its field. What is refused: `n`/`best_of` > 1, `suffix`, penalties and
`logit_bias`, `echo` together with `logprobs`, a prompt that is a list of more than one string
or a list of token ids. Must not know how the completion runs or who is calling.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from llmweb.chat.tokens import token_bytes
from llmweb.engine.request import MAX_TOP_LOGPROBS, TokenLogprob
from llmweb.web.api.chat_wire import _max_tokens, _stop
from llmweb.web.api.common import Usage, checked_fields, model_named, number, optional
from llmweb.web.api.errors import bad

DEFAULT_MAX_TOKENS = 16  # OpenAI's and vLLM's default for a completion
IGNORED_FIELDS = ("metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier")
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "n": (None, 1),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}),
}
KNOWN_FIELDS = {
    "model",
    "prompt",
    "stream",
    "stream_options",
    "temperature",
    "top_p",
    "max_tokens",
    "stop",
    "seed",
    "user",
    "logprobs",
    "echo",
    *IGNORED_FIELDS,
    *NEUTRAL,
}


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    """One validated completions request; None means the server's default."""

    model: str
    prompt: str
    stream: bool = False
    include_usage: bool = False
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int = DEFAULT_MAX_TOKENS
    stop: tuple[str, ...] = ()
    seed: int | None = None
    logprobs: int | None = None  # None: none; k: each token's, with its k most likely
    echo: bool = False  # the prompt before the completion, in `text`


def parse_completion(body: dict[str, Any], models: Sequence[str], max_chars: int) -> CompletionRequest:
    """Validate a completions body into a `CompletionRequest`; raise ApiError naming the field."""
    checked_fields(body, KNOWN_FIELDS, NEUTRAL)
    model = model_named(body, models)
    stream = optional(body, "stream", bool) or False
    options = optional(body, "stream_options", dict)
    if options is not None and not stream:
        raise bad("stream_options is only allowed when stream is true.", "stream_options")
    include_usage = False
    if options:
        if set(options) - {"include_usage"}:
            raise bad("stream_options takes only include_usage.", "stream_options", "unknown_parameter")
        include_usage = optional(options, "include_usage", bool, "stream_options.include_usage") or False
    seed = optional(body, "seed", int)
    if seed is not None and not -(2**63) <= seed < 2**63:
        raise bad("seed must fit in 64 bits.", "seed")
    optional(body, "user", str)
    logprobs = optional(body, "logprobs", int)
    if logprobs is not None and not 0 <= logprobs <= MAX_TOP_LOGPROBS:
        raise bad(f"logprobs must be between 0 and {MAX_TOP_LOGPROBS}, not {logprobs}.", "logprobs")
    echo = optional(body, "echo", bool) or False
    if echo and logprobs is not None:
        raise bad("echo with logprobs is not supported (the prompt's own log-probabilities).", "echo")
    max_tokens = _max_tokens({"max_tokens": body.get("max_tokens")})
    return CompletionRequest(
        model=model,
        prompt=_prompt(body.get("prompt"), max_chars),
        stream=stream,
        include_usage=include_usage,
        temperature=number(body, "temperature", 0.0, 2.0),
        top_p=number(body, "top_p", 0.0, 1.0, low_open=True),
        max_tokens=DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens,
        stop=_stop(body.get("stop")),
        seed=seed,
        logprobs=logprobs,
        echo=echo,
    )


def _prompt(raw: Any, max_chars: int) -> str:
    """A string, or a list of one string; at most `max_chars` characters (checked before tokenising)."""
    if isinstance(raw, list) and len(raw) == 1 and isinstance(raw[0], str):
        raw = raw[0]
    if isinstance(raw, list):
        raise bad("prompt must be a string or a list of one string (one completion per request).", "prompt")
    if not isinstance(raw, str):
        raise bad("prompt must be a string.", "prompt", "missing_required_parameter" if raw is None else "invalid_type")
    if not raw:
        raise bad("prompt is empty.", "prompt")
    if len(raw) > max_chars:
        raise bad(f"prompt is over {max_chars:,} characters, more than the model's context can take.", "prompt")
    return raw


def legacy_logprobs(fmt, items: Sequence[TokenLogprob], offset: int) -> dict[str, Any]:
    """The legacy `logprobs` object of these tokens, whose text starts at character `offset` of the
    completion's: `tokens`, `token_logprobs`, `top_logprobs` (a token -> logprob object per token),
    `text_offset`."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}

    def text(token: int) -> str:
        return token_bytes(fmt, token).decode("utf-8", errors="replace")

    for lp in items:
        piece = text(lp.id)
        out["tokens"].append(piece)
        out["token_logprobs"].append(lp.logprob)
        out["top_logprobs"].append({text(i): v for i, v in lp.top})
        out["text_offset"].append(offset)
        offset += len(piece)
    return out


@dataclass
class TextCompletion:
    """One response's identity: the same id and time in every chunk."""

    model: str
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    def _base(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
        }

    def chunk(
        self,
        text: str | None,
        finish_reason: str | None = None,
        *,
        logprobs: dict[str, Any] | None = None,
        usage: Usage | None = None,
        include_usage: bool = False,
    ) -> dict[str, Any]:
        """One streamed `text_completion`; text=None: the usage chunk (no choices) that ends a stream."""
        d = self._base()
        d["choices"] = (
            [] if text is None else [{"text": text, "index": 0, "logprobs": logprobs, "finish_reason": finish_reason}]
        )
        if include_usage:
            d["usage"] = usage.to_dict() if usage is not None else None
        return d

    def response(
        self, text: str, finish_reason: str, usage: Usage, logprobs: dict[str, Any] | None, notes: list[str]
    ) -> dict[str, Any]:
        d = self._base()
        d["choices"] = [{"text": text, "index": 0, "logprobs": logprobs, "finish_reason": finish_reason}]
        d["usage"] = usage.to_dict()
        d["x_llmweb"] = {"notes": notes}
        return d
