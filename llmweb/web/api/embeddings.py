"""`POST /v1/embeddings`: the server's own embedder (retrieval/embedder.py, the one the document
library uses) turns texts into vectors, in OpenAI's shape (web/api/embeddings_wire.py).

The embedding runs on this family's own worker threads, never on the event loop; the embedder
takes its lock one batch of BATCH texts at a time, so a visitor's document search waits for a batch,
not for a whole request. Each owner may have LLMWEB_QUEUE_PER_USER + 1 requests in flight (the
single user of a single-user install: 4 x LLMWEB_QUEUE_SIZE, as in the engine's queue), and the
server 4 x LLMWEB_QUEUE_SIZE in all; past either, a 429 with Retry-After. `usage.prompt_tokens`
counts the word pieces the model read (at most its window per text); `x_llmweb.truncated` lists
the inputs it read only the start of. A client that leaves stops its work after the batch in hand.

Owns: the route, the limits on requests in flight, the embedder's names. Must not parse fields
(embeddings_wire.py), store anything, or work out an owner (web/identity.py's `ApiCallers` does).
"""

from __future__ import annotations

import asyncio
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from llmweb.config import Settings
from llmweb.errors import Cancelled
from llmweb.retrieval.embedder import MAX_CHARS_PER_TOKEN
from llmweb.runtime.engines import uncapped_owner
from llmweb.web.api.common import disconnected, parse_json, read_body, require_json
from llmweb.web.api.embeddings_wire import EMBEDDING_ALIAS, EmbeddingsRequest, embeddings_response, parse_embeddings
from llmweb.web.api.errors import RETRY_AFTER_S, ApiError, api_error, bad, error_response
from llmweb.web.identity import ApiCallers

DEFAULT_ID = "all-MiniLM-L6-v2"  # the embedded embedder's id (LLMWEB_EMBEDDER unset)
WORKERS = 2  # requests embedding at once; the embedder interleaves their batches


def embedder_names(settings: Settings) -> list[str]:
    """The names a request's `model` may give, the id a response names first: the embedder's id (a
    path's folder name), LLMWEB_EMBEDDER as written, and EMBEDDING_ALIAS."""
    given = settings.embedder.strip()
    first = os.path.basename(given.rstrip("/\\")) if given and os.path.isdir(given) else given or DEFAULT_ID
    return list(dict.fromkeys([first, given or DEFAULT_ID, EMBEDDING_ALIAS]))


class InFlight:
    """Embedding requests in flight, per owner and in all; a 429 with Retry-After past either cap."""

    def __init__(self, settings: Settings, uncapped_owner: str = ""):
        self.per_owner = settings.queue_per_user + 1  # one running and queue_per_user waiting, as chat's
        self.total = settings.queue_size * 4
        self.uncapped_owner = uncapped_owner  # a single-user install's owner: capped by the total only
        self._mine: dict[str, int] = {}
        self._lock = threading.Lock()

    def enter(self, owner: str) -> None:
        with self._lock:
            mine, total = self._mine.get(owner, 0), sum(self._mine.values())
            cap = self.total if owner == self.uncapped_owner else self.per_owner
            if mine >= cap or total >= self.total:
                who = (
                    f"you already have {mine} embedding requests" if mine >= cap else f"{total} embedding requests are"
                )
                raise ApiError(
                    429,
                    f"The embedder is busy: {who} in flight; try again in a moment.",
                    type="rate_limit_error",
                    code="queue_full",
                    headers={"Retry-After": str(RETRY_AFTER_S)},
                )
            self._mine[owner] = mine + 1

    def leave(self, owner: str) -> None:
        with self._lock:
            left = self._mine.get(owner, 0) - 1
            if left > 0:
                self._mine[owner] = left
            else:
                self._mine.pop(owner, None)


class Embeddings:
    """The route of `POST /v1/embeddings`."""

    def __init__(self, runtime, callers: ApiCallers):
        self.runtime = runtime
        self.settings = runtime.settings
        self.callers = callers
        self.names = embedder_names(self.settings)
        self.in_flight = InFlight(self.settings, uncapped_owner(self.settings))
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()

    def pool(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(WORKERS, "llmweb-api-embed")
            return self._pool

    async def post(self, request: Request) -> Response:
        try:
            caller = self.callers.caller(request)
            require_json(request)
            body = parse_json(await read_body(request, self.settings.api_max_body_kb * 1024))
            req = parse_embeddings(body, self.names)
            done = await self.serve(request, caller.stateless_owner, req)
            return done if isinstance(done, Response) else JSONResponse(done)
        except ApiError as e:
            return error_response(e)
        except Exception as e:
            return error_response(api_error(e))

    async def serve(self, request: Request, owner: str, req: EmbeddingsRequest) -> dict[str, Any] | Response:
        """`req`'s response for `owner` within the limits on requests in flight (Ollama's /api/embed
        comes here too); a 499 Response when the client left first."""
        gone = threading.Event()
        self.in_flight.enter(owner)
        try:
            future = self.pool().submit(self.embed, req, gone)
        except BaseException:
            self.in_flight.leave(owner)
            raise
        future.add_done_callback(lambda _f: self.in_flight.leave(owner))  # in flight until the work stops
        work, leaving = asyncio.wrap_future(future), asyncio.ensure_future(disconnected(request))
        both: set[asyncio.Future[Any]] = {work, leaving}
        try:
            await asyncio.wait(both, return_when=asyncio.FIRST_COMPLETED)
        finally:
            leaving.cancel()
        if not work.done():
            gone.set()  # the client left: the work stops after the batch in hand
            return Response(status_code=499)  # nobody reads it
        return work.result()

    def embed(self, req: EmbeddingsRequest, gone: threading.Event) -> dict[str, Any]:
        """The response for `req` (on a worker thread: it may load the embedder, then embeds);
        Cancelled after the batch in hand once `gone` is set (the client left)."""

        def stop_if_gone(_done: int, _total: int) -> None:
            if gone.is_set():
                raise Cancelled("The client left before its embeddings were ready.")

        embedder = self.runtime.library.embedder
        dim, window = embedder.dim, embedder.window
        if req.dimensions is not None and req.dimensions != dim:
            raise bad(f"dimensions must be {dim}, this embedder's size (it does not shorten vectors).", "dimensions")
        counts = embedder.token_counts(req.texts)
        cut = [
            i
            for i, (n, t) in enumerate(zip(counts, req.texts, strict=True))
            if n > window or len(t) > MAX_CHARS_PER_TOKEN * window
        ]
        vectors = embedder.embed(list(req.texts), progress=stop_if_gone)
        used = sum(min(n, window) for n in counts)
        return embeddings_response(vectors, req.encoding, self.names[0], used, window, cut)
