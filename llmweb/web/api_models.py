"""The API's models: `/v1/models` lists every model the server can serve, with its context length
and whether it is loaded; a request's `model` names one, and the served model switches to it when
the caller may switch models (web/identity.py's `may_switch_models`: the machine's owner of a
single-user install, or an operator), else the request is refused with 409 and the model served.

"llmweb" always names whichever model is served. A response's `model` is the id of the model that
answered. Nothing here loads anything itself: `Runtime.switch` and `Runtime.wait_ready` do, on a
worker thread (the caller awaits it), with the load's progress in the page's status line.
"""

from __future__ import annotations

from typing import Any

from llmweb.chat.context import Budget
from llmweb.errors import LlmwebError
from llmweb.web.api_wire import MODEL_ID, ApiError
from llmweb.web.identity import Caller, may_switch_models

LOAD_WAIT_S = 600.0  # the most a request waits for its model to load


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
    (the served one's as loaded; another's as it would load before memory is measured), its trained
    context, its size and whether it is loaded."""
    served = getattr(runtime, "model_id", None)
    budget = getattr(runtime, "budget", None)
    loaded = bool(getattr(runtime, "ready", False)) and not getattr(runtime, "unloaded", False)
    head = _object(MODEL_ID, created, served=served, context=budget.context_limit if budget else None, loaded=loaded)
    out = [head]
    for e in _entries(runtime):
        mine = e.id == served
        context = budget.context_limit if mine and budget else _planned(runtime, e.context_train)
        out.append(
            _object(
                e.id,
                created,
                context=context,
                loaded=mine and loaded,
                context_train=e.context_train,
                size_bytes=e.size_bytes,
                architecture=e.architecture,
                format=e.kind,
            )
        )
    if len(out) == 1 and served:  # a remote engine, or a runtime without a catalog: the model it serves
        out.append(_object(served, created, context=head["context_length"], loaded=loaded))
    return out


def ensure(runtime, caller: Caller, model: str) -> str:
    """Make `model` the one served (switching if it is another and the caller may), wait until it is
    ready, and return the id that will answer. Runs on a worker thread: it may wait for a load."""
    served = getattr(runtime, "model_id", None) or MODEL_ID
    loaded_name = getattr(getattr(runtime, "loaded", None), "name", None)
    if model not in (MODEL_ID, served, loaded_name):
        if not may_switch_models(runtime.settings, caller.owner or ""):
            raise ApiError(
                409,
                f"This server serves {served}; only its operator switches models (ask for {served!r} or 'llmweb').",
                code="model_not_loaded",
                param="model",
            )
        runtime.switch(model)
        served = model
    if getattr(runtime, "unloaded", False) or not getattr(runtime, "ready", True):
        try:
            runtime.wait_ready(LOAD_WAIT_S)
        except LlmwebError as e:
            raise ApiError(503, str(e), type="server_error", code="model_unavailable") from None
    return served


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
