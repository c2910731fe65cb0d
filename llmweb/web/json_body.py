"""A request body read as one JSON object, with bounds, off the event loop when it is large.

A body where a JSON object is expected is refused by its first byte when it is not one (a list is
never parsed: FastAPI validated a 3.9 MB list item by item on the event loop, ~5 s). An object is
parsed on a worker thread when it is over `INLINE_BYTES` (the event loop keeps serving meanwhile;
`json.loads` holds the interpreter only for what a capped body costs, tens of ms), and refused
when it holds more than `max_elements` values or nests deeper than the interpreter allows. Every
refusal is a `BodyError` with a short message that never quotes the body.

Owns: that check, for the page's routes (web/body_cap.py) and any route of llmweb's that reads
JSON. Must not: read a body from the network, or know a route's schema.
"""

from __future__ import annotations

import asyncio
import json

from llmweb.errors import InputError

INLINE_BYTES = 64 << 10  # smaller bodies are parsed on the event loop (well under a millisecond)
MAX_ELEMENTS = 100_000  # values (and keys) in one body: a page's event with a whole long chat has ~30,000
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
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise BodyError("The request body is not valid JSON.") from None
    except RecursionError:
        raise BodyError("The request body nests JSON arrays or objects too deeply.") from None
    if not isinstance(body, dict):  # "{" then garbage cannot parse; kept for the type checker
        raise BodyError("The request body must be a JSON object.")
    if count_values(body, max_elements) > max_elements:
        raise BodyError(f"The request body holds more than {max_elements:,} JSON values.", status=413)
    return body


async def parse_object(raw: bytes, max_elements: int = MAX_ELEMENTS) -> dict:
    """`load_object`, on a worker thread when `raw` is large (the event loop answers others meanwhile)."""
    if len(raw) <= INLINE_BYTES:
        return load_object(raw, max_elements)
    return await asyncio.to_thread(load_object, raw, max_elements)


def count_values(value, limit: int) -> int:
    """How many values (and object keys) `value` holds, counting stops a little past `limit`."""
    seen, stack = 0, [value]
    while stack and seen <= limit:
        item = stack.pop()
        seen += 1
        if isinstance(item, dict):
            seen += len(item)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return seen
