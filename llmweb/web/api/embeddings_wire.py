"""`POST /v1/embeddings`' wire format as pure functions: the request's checks (`parse_embeddings`) and
the response (`embeddings_response`). No I/O, no model, no web framework: web/api/embeddings.py
reads the body, runs the embedder and sends what these return.

`input` is a string or a list of strings (at most MAX_INPUTS, each at most MAX_INPUT_CHARS and not
empty); token-id arrays are refused by name (their ids would be another tokenizer's). `model` is the
embedder's id or EMBEDDING_ALIAS; any other is a 404 as OpenAI answers it. `encoding_format` is
`float` or `base64` (little-endian float32, as the openai SDK decodes it); `dimensions` must be the
embedder's own size (checked where the size is known, web/api/embeddings.py); an unknown field is
refused as OpenAI refuses it.

Owns: the fields, their limits and the response's shape. Must not embed, count tokens or know who calls.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from llmweb.web.api.common import optional
from llmweb.web.api.errors import ApiError, bad

EMBEDDING_ALIAS = "llmweb-embedding"  # names whichever embedder the server has (LLMWEB_EMBEDDER)
MAX_INPUTS = 256  # texts per request (OpenAI allows 2,048; this CPU embedder reads ~35 texts a second)
MAX_INPUT_CHARS = 32_000  # characters per text (about OpenAI's 8,192 tokens); the model reads its window of them
ENCODINGS = ("float", "base64")
FIELDS = {"input", "model", "encoding_format", "dimensions", "user"}
TOKEN_IDS = (
    "input as token ids is not supported: send the text (a string or a list of strings). "
    "langchain-openai's OpenAIEmbeddings sends token ids unless it is given check_embedding_ctx_length=False."
)


@dataclass(frozen=True, slots=True)
class EmbeddingsRequest:
    texts: tuple[str, ...]
    model: str
    encoding: str = "float"  # float | base64
    dimensions: int | None = None


def parse_embeddings(body: Mapping[str, Any], models: Sequence[str]) -> EmbeddingsRequest:
    """The request in `body`, or ApiError naming the field at fault. `models`: the names `model` may take."""
    for name in body:
        if name not in FIELDS:
            raise bad(
                f"Unrecognized request argument supplied: {str(name)[:100]}", str(name)[:100], "unknown_parameter"
            )
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad(
            f"You must provide a model (this server's embedder: {models[0]!r}).", "model", "missing_required_parameter"
        )
    if model not in models:
        raise ApiError(
            404,
            f"The model {model[:100]!r} does not exist here; embeddings come from {', '.join(map(repr, models))}.",
            type="not_found_error",
            code="model_not_found",
            param="model",
        )
    encoding = optional(body, "encoding_format", str) or "float"
    if encoding not in ENCODINGS:
        raise bad(f"encoding_format must be 'float' or 'base64', not {encoding[:40]!r}.", "encoding_format")
    dimensions = optional(body, "dimensions", int)
    if dimensions is not None and dimensions < 1:
        raise bad("dimensions must be a positive integer.", "dimensions")
    optional(body, "user", str)
    return EmbeddingsRequest(texts(body.get("input")), model, encoding, dimensions)


def texts(value: Any) -> tuple[str, ...]:
    """`input` as texts: a string, or a list of 1..MAX_INPUTS strings, each 1..MAX_INPUT_CHARS characters."""
    if value is None:
        raise bad("You must provide input: a string or a list of strings.", "input", "missing_required_parameter")
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list):
        raise bad("input must be a string or a list of strings.", "input", "invalid_type")
    if not items:
        raise bad("input must not be an empty list.", "input")
    if len(items) > MAX_INPUTS:
        raise bad(f"input has {len(items):,} texts; at most {MAX_INPUTS} are embedded per request.", "input")
    if all(isinstance(i, int) and not isinstance(i, bool) for i in items) or any(isinstance(i, list) for i in items):
        raise bad(TOKEN_IDS, "input", "unsupported_parameter")
    for n, item in enumerate(items):
        where = "input" if isinstance(value, str) else f"input[{n}]"
        if not isinstance(item, str):
            raise bad(f"{where} must be a string.", "input", "invalid_type")
        if not item:
            raise bad(f"{where} is empty; send text to embed.", "input")
        if len(item) > MAX_INPUT_CHARS:
            message = (
                f"{where} has {len(item):,} characters; at most {MAX_INPUT_CHARS:,} per text. Split it into chunks."
            )
            raise bad(message, "input", "input_too_long")
    return tuple(items)


def embedding_value(vector, encoding: str) -> list[float] | str:
    """One vector as the response carries it: a list of floats, or base64 of little-endian float32."""
    import numpy as np

    if encoding == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return [float(x) for x in vector]


def embeddings_response(
    vectors, encoding: str, model: str, prompt_tokens: int, window: int, truncated: Sequence[int]
) -> dict[str, Any]:
    """OpenAI's embeddings list, with `x_llmweb`: the model's window and which inputs went past it."""
    return {
        "object": "list",
        "data": [
            {"object": "embedding", "index": i, "embedding": embedding_value(v, encoding)}
            for i, v in enumerate(vectors)
        ],
        "model": model,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
        "x_llmweb": {"window_tokens": window, "truncated": list(truncated)},
    }
