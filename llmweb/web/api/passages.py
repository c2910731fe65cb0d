"""`GET /v1/x_llmweb/passage` (llmweb's own, not OpenAI's): a cited source's passage, by the place
its citation gives (`x_llmweb.sources[i]` of a chat completion), with the document's text just
before and after it.

Owns: the query's parameters and the passage's JSON. Must not open a passage itself
(chat/passages.py does, in what the key's owner may read) or work out an owner (web/identity.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from llmweb.chat.passages import Excerpt, Passage, open_source
from llmweb.records import Source
from llmweb.web.api.errors import ApiError, api_error, bad, error_response
from llmweb.web.identity import ApiCallers, Caller

PASSAGE_PARAMS = ("doc_id", "start", "end", "kind", "snippet", "conversation_id")
MAX_OFFSET = 10**12


class Passages:
    """The route of `GET /v1/x_llmweb/passage`."""

    def __init__(self, runtime, callers: ApiCallers):
        self.runtime = runtime
        self.callers = callers

    async def passage(self, request: Request) -> Response:
        """A cited source's passage, by the place `x_llmweb.sources[i]` gives (chat/passages.py), in
        what the key's owner may read; 404 for any other place, whatever the reason."""
        try:
            caller = self.callers.caller(request)
            query = parse_passage_query(request.query_params)
            found = await asyncio.to_thread(self._passage, caller, query)
        except ApiError as e:
            return error_response(e)
        except Exception as e:
            return error_response(api_error(e))
        if found is None:
            message = "No passage of yours is at that place (its document or turn may be gone, or changed)."
            return error_response(ApiError(404, message, type="not_found_error", code="passage_not_found"))
        return JSONResponse(passage_object(found))

    def _passage(self, caller: Caller, query: PassageQuery) -> Passage | None:
        conv_id, conv = query.conversation_id, None
        owner = caller.of_conversation(conv_id) if conv_id else caller.stateless_owner
        if conv_id:
            if not self.runtime.store.exists(owner, conv_id):
                return None
            conv = self.runtime.store.get(owner, conv_id)
        if query.source.kind == "recall" and conv is None:
            return None
        return open_source(self.runtime.library, owner, conv, query.source)


@dataclass(frozen=True, slots=True)
class PassageQuery:
    source: Source  # the place, as `x_llmweb.sources[i]` gives it
    conversation_id: str = ""  # whose chat (and, for a key of no user, whose library) to look in


def parse_passage_query(params: Mapping[str, str]) -> PassageQuery:
    """`doc_id`, `start`, `end` (and `kind`, `snippet`, `conversation_id`) of a source, as
    `x_llmweb.sources[i]` and the response's conversation id give them; 400 for anything else."""
    for name in params:
        if name not in PASSAGE_PARAMS:
            raise bad(f"Unknown parameter {name[:40]!r}; this endpoint takes {', '.join(PASSAGE_PARAMS)}.", name)
    doc_id, kind = params.get("doc_id", ""), params.get("kind", "document")
    if not doc_id or len(doc_id) > 100:
        raise bad("doc_id: the source's doc_id, as x_llmweb.sources gives it.", "doc_id")
    if kind not in ("document", "recall"):
        raise bad("kind: document or recall.", "kind")
    place = []
    for name in ("start", "end"):
        value = params.get(name, "0")
        if not value.isdigit() or len(value) > 13 or int(value) > MAX_OFFSET:
            raise bad(f"{name}: a character offset (a whole number), as x_llmweb.sources gives it.", name)
        place.append(int(value))
    snippet = params.get("snippet", "")[: Source.SNIPPET_CHARS + 1]
    source = Source(1, "", kind=kind, snippet=snippet, doc_id=doc_id, start=place[0], end=place[1])
    return PassageQuery(source, params.get("conversation_id", "")[:100])


def passage_object(p: Passage) -> dict[str, Any]:
    """A passage as the API returns it: the cited text, and the document's text just before and after."""
    s = p.source
    return {
        "object": "x_llmweb.passage",
        **{"doc_id": s.doc_id, "start": s.start, "end": s.end, "kind": s.kind},
        **_excerpt(p.cited),
        "before": _excerpt(p.before) if p.before else None,
        "after": _excerpt(p.after) if p.after else None,
    }


def _excerpt(e: Excerpt) -> dict[str, Any]:
    return {"text": e.text, "page": e.page, "heading": e.heading, "cut": e.cut}
