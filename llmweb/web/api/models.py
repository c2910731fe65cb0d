"""`GET /v1/models` and `GET /v1/models/{id}`, and a request's `model`. `/v1/models` lists every
model the server can serve, with its context length and whether it is loaded; a request's `model`
names one. A loaded one (the served model, or one kept loaded beside it: LLMWEB_MAX_LOADED) answers
the request itself, for any caller, since nothing loads and the served model stays; another is
switched to when the caller may switch models (web/identity.py's `may_switch_models`: the machine's
owner of a single-user install, or an operator), else the request is refused with 409 and the
models loaded.

"llmweb" always names whichever model is served. A response's `model` is the id of the model that
answered: the one the request's lease holds (`Runtime.hold`). Nothing here loads anything itself:
`Runtime.switch` and `Runtime.hold` do, on a worker thread (the caller awaits it), with the load's
progress in the page's status line. Must not work out who may switch (web/identity.py does).
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from llmweb.chat.context import Budget
from llmweb.errors import LlmwebError
from llmweb.runtime.resident import Lease
from llmweb.web.api.errors import ApiError, error_response
from llmweb.web.identity import ApiCallers, Caller, may_switch_models

MODEL_ID = "llmweb"  # the one model /v1/models lists; the loaded model's own name is accepted too
LOAD_WAIT_S = 600.0  # the most a request waits for its model to load


class Models:
    """The routes of `GET /v1/models` and `GET /v1/models/{id}`."""

    def __init__(self, runtime, callers: ApiCallers):
        self.runtime = runtime
        self.callers = callers
        self.created = int(time.time())

    async def listing(self, request: Request) -> Response:
        try:
            self.callers.caller(request)
        except ApiError as e:
            return error_response(e)
        # the listing reads the models folder's GGUF headers (cached by size and mtime): off the event loop
        data = await run_in_threadpool(objects, self.runtime, self.created)
        return JSONResponse({"object": "list", "data": data})

    async def model(self, request: Request, model_id: str) -> Response:
        try:
            self.callers.caller(request)
            if model_id not in await run_in_threadpool(names, self.runtime):
                message = f"The model {model_id[:100]!r} does not exist here."
                raise ApiError(404, message, type="not_found_error", code="model_not_found")
        except ApiError as e:
            return error_response(e)
        found = [m for m in await run_in_threadpool(objects, self.runtime, self.created) if m["id"] == model_id]
        return JSONResponse(found[0] if found else model_object(model_id, self.created))


def names(runtime) -> list[str]:
    """Every `model` a request may name: "llmweb", the served model's id and name, every listed model."""
    out = [MODEL_ID]
    for name in [getattr(runtime, "model_id", None), getattr(getattr(runtime, "loaded", None), "name", None)]:
        if isinstance(name, str) and name and name not in out:
            out.append(name)
    out += [e.id for e in _entries(runtime) if e.id not in out]
    return out


def objects(runtime, created: int) -> list[dict[str, Any]]:
    """`/v1/models`' data: "llmweb" (the model served), then every model with its context length
    (a loaded one's as loaded; another's as it would load before memory is measured), its trained
    context, its size and whether it is loaded."""
    served = getattr(runtime, "model_id", None)
    budget = getattr(runtime, "budget", None)
    loaded = bool(getattr(runtime, "ready", False)) and not getattr(runtime, "unloaded", False)
    resident = _resident(runtime, served if loaded else None)
    parked = {r.model_id: r.budget.context_limit for r in _parked(runtime)}
    head = _object(MODEL_ID, created, served=served, context=budget.context_limit if budget else None, loaded=loaded)
    out = [head]
    for e in _entries(runtime):
        mine = e.id == served
        context = budget.context_limit if mine and budget else parked.get(e.id) or _planned(runtime, e.context_train)
        out.append(
            _object(
                e.id,
                created,
                context=context,
                loaded=e.id in resident,
                context_train=e.context_train,
                size_bytes=e.size_bytes,
                architecture=e.architecture,
                format=e.kind,
            )
        )
    if len(out) == 1 and served:  # a remote engine, or a runtime without a catalog: the model it serves
        out.append(_object(served, created, context=head["context_length"], loaded=loaded))
    return out


def ensure(runtime, caller: Caller, model: str) -> Lease:
    """The model that answers a request naming `model`, held for its turn (the caller releases the
    lease when the turn ends): a loaded one as it is, for anyone; another once switched to and
    loaded, if the caller may switch. Runs on a worker thread: it may wait for a load."""
    loaded_name = getattr(getattr(runtime, "loaded", None), "name", None)
    wanted = None if model in (MODEL_ID, loaded_name) else model  # None: whichever is served
    lease = _hold(runtime, wanted)
    if lease is not None:
        return lease
    if not may_switch_models(runtime.settings, caller.owner or ""):
        names = ", ".join(repr(m) for m in [MODEL_ID, *_resident(runtime, getattr(runtime, "model_id", None))])
        raise ApiError(
            409,
            f"{model[:100]!r} is not loaded on this server; only its operator loads models (ask for one of {names}).",
            code="model_not_loaded",
            param="model",
        )
    runtime.switch(model)
    lease = _hold(runtime, model)
    if lease is None:  # switched away again before it answered (LLMWEB_MAX_LOADED=1)
        message = f"Another request switched the model to {runtime.model_id} before {model} answered; try again."
        raise ApiError(503, message, type="server_error", code="model_unavailable")
    return lease


def _hold(runtime, model: str | None) -> Lease | None:
    try:
        return runtime.hold(model, LOAD_WAIT_S)
    except LlmwebError as e:  # still loading after LOAD_WAIT_S, or failed to load
        raise ApiError(503, str(e), type="server_error", code="model_unavailable") from None


def _resident(runtime, served: str | None) -> list[str]:
    """The ids of the models loaded now (a runtime without `loaded_ids`: `served`, when given)."""
    loaded_ids = getattr(runtime, "loaded_ids", None)
    return list(loaded_ids()) if callable(loaded_ids) else [served] if served else []


def _parked(runtime) -> list:
    residents = getattr(runtime, "residents", None)
    return residents.parked() if residents is not None else []


def _entries(runtime) -> list:
    models = getattr(runtime, "models", None)
    return list(models()) if callable(models) else []


def _planned(runtime, trained: int) -> int | None:
    """The context a model of `trained` tokens loads with here (before memory is measured)."""
    if trained < 2:
        return None
    loaded = getattr(runtime, "loaded", None)
    return Budget.from_settings(runtime.settings, trained, getattr(loaded, "on_cpu", True)).context_limit


def _object(model_id: str, created: int, *, context: int | None, loaded: bool, **more) -> dict[str, Any]:
    obj: dict[str, Any] = {"id": model_id, "object": "model", "created": created, "owned_by": "llmweb"}
    obj |= {"context_length": context, "max_model_len": context, "loaded": loaded}
    return obj | {k: v for k, v in more.items() if v not in (None, "")}


def model_object(model: str, created: int) -> dict[str, Any]:
    return {"id": model, "object": "model", "created": created, "owned_by": "llmweb"}
