"""A request body read as one JSON object, with bounds, off the event loop when it is large.

A body where a JSON object is expected is refused by its first byte when it is not one (a list is
never parsed: FastAPI validated a 3.9 MB list item by item on the event loop, ~5 s). The number of
values is bounded before anything is parsed: every value but the first of a container follows a
comma, every key a colon, so commas + colons + opening brackets bound them (`count_values`: four
byte counts, ~15 ms for 4 MB; a comma inside a string counts too, which only errs on the safe side).
`json.loads` holds the interpreter for as long as it runs whatever thread it is on (~0.35 s for 4 MB
of `1,1,1...`), so only a body within the bound is parsed: tens of ms at most, on a worker thread when
it is over `INLINE_BYTES`. Every refusal is a `BodyError` with a short message that never quotes
the body.

Owns: that check, for the page's routes (web/body_cap.py) and any route of llmweb's that reads
JSON. Must not: read a body from the network, or know a route's schema.
"""

from __future__ import annotations

import asyncio
import json

from llmweb.errors import InputError

INLINE_BYTES = 64 << 10  # smaller bodies are parsed on the event loop (well under a millisecond)
MAX_ELEMENTS = 200_000  # values and keys in one body (a page's event with a whole long chat: ~30,000)
_WHITESPACE = b" \t\r\n"


class BodyError(InputError):
    """A body refused by its shape: `status` is the HTTP status to answer with."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


def load_object(raw: bytes, max_elements: int = MAX_ELEMENTS) -> dict:
    """`raw` as a JSON object, or BodyError (not an object, not JSON, too many values or too deep)."""
    if raw.lstrip(_WHITESPACE)[:1] != b"{":
        raise BodyError("The request body must be a JSON object.")
    if count_values(raw) > max_elements:
        raise BodyError(f"The request body holds more than {max_elements:,} JSON values.", status=413)
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise BodyError("The request body is not valid JSON.") from None
    except RecursionError:
        raise BodyError("The request body nests JSON arrays or objects too deeply.") from None
    if not isinstance(body, dict):  # "{" then garbage cannot parse; kept for the type checker
        raise BodyError("The request body must be a JSON object.")
    return body


async def parse_object(raw: bytes, max_elements: int = MAX_ELEMENTS) -> dict:
    """`load_object`, on a worker thread when `raw` is large (the event loop answers others meanwhile)."""
    if len(raw) <= INLINE_BYTES:
        return load_object(raw, max_elements)
    return await asyncio.to_thread(load_object, raw, max_elements)


def count_values(raw: bytes) -> int:
    """An upper bound of the values and keys in the JSON text `raw`, without parsing it."""
    return raw.count(b",") + raw.count(b":") + raw.count(b"[") + raw.count(b"{")
