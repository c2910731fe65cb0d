"""The API's routes, on the UI's port: `api_routes(runtime)` returns them and cli/main.py hands them
to Gradio's FastAPI app (`launch(app_kwargs={"routes": ...})`), so `python -m llmweb serve` serves
both on one port. Any other path under /v1 gets an OpenAI-style 404 (or 405) naming the endpoints.

Ollama's API (web/api/ollama.py) is served under /api on the same port, with the same keys.
Each family is built here over one `ApiCallers` (web/identity.py), which says per request who is
calling and for which owner: a key of user alice acts for "user:alice", and on a loopback bind
without login the key in data_dir/local-api-key acts for the single user; there is no keyless API.
A page of another site is refused (its Origin; a body that is not application/json), and so is a
Host that is not this machine on a loopback bind (DNS rebinding). Must not serve a request itself.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from llmweb.web.api.chat import ChatCompletions
from llmweb.web.api.completions import Completions
from llmweb.web.api.embeddings import Embeddings
from llmweb.web.api.errors import ApiError, error_response
from llmweb.web.api.models import Models
from llmweb.web.api.ollama import Ollama
from llmweb.web.api.passages import Passages
from llmweb.web.identity import ApiCallers
from llmweb.web.login import login_routes

ENDPOINTS = (
    "GET /v1/models, GET /v1/models/{id}, POST /v1/chat/completions, POST /v1/completions, POST /v1/embeddings, "
    "GET /v1/x_llmweb/passage"
)
KNOWN = {
    "models": "GET",
    "chat/completions": "POST",
    "completions": "POST",
    "embeddings": "POST",
    "x_llmweb/passage": "GET",
}


def api_routes(runtime) -> list:
    """The API's routes, to put in front of Gradio's own (they take precedence); with them, when login
    is on, the login form's route with its back-off (web/login.py)."""
    callers = ApiCallers(runtime.settings)
    models, chat, passages = Models(runtime, callers), ChatCompletions(runtime, callers), Passages(runtime, callers)
    router = APIRouter()
    router.add_api_route("/v1/models", models.listing, methods=["GET"], include_in_schema=False)
    router.add_api_route("/v1/models/{model_id:path}", models.model, methods=["GET"], include_in_schema=False)
    router.add_api_route("/v1/chat/completions", chat.post, methods=["POST"], include_in_schema=False)
    completions = Completions(runtime, callers)
    router.add_api_route("/v1/completions", completions.post, methods=["POST"], include_in_schema=False)
    embeddings = Embeddings(runtime, callers)
    router.add_api_route("/v1/embeddings", embeddings.post, methods=["POST"], include_in_schema=False)
    router.add_api_route("/v1/x_llmweb/passage", passages.passage, methods=["GET"], include_in_schema=False)
    for path, route, method in Ollama(runtime, callers, chat, embeddings).routes():
        router.add_api_route(path, route, methods=[method], include_in_schema=False)
    router.add_api_route(
        "/v1/{path:path}", unknown, methods=["GET", "POST", "PUT", "PATCH", "DELETE"], include_in_schema=False
    )
    return list(router.routes) + login_routes(runtime.settings)


async def unknown(request: Request, path: str) -> Response:
    if path in KNOWN:
        e = ApiError(405, f"Use {KNOWN[path]} for /v1/{path}.", code="method_not_allowed")
    else:
        e = ApiError(404, f"Unknown endpoint /v1/{path[:100]}; this server has {ENDPOINTS}.", code="unknown_url")
    return error_response(e)
