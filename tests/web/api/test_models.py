"""GET /v1/models and GET /v1/models/{id} over the routes, and the answer for a path under /v1 that
is not an endpoint (web/api/models.py, web/api/routes.py)."""

from __future__ import annotations

from tests.web.api.conftest import body, say


def test_models_lists_llmweb(api):
    r = api.client.get("/v1/models")
    assert r.status_code == 200 and [m["id"] for m in r.json()["data"]] == ["llmweb"]
    assert api.client.get("/v1/models/llmweb").json()["id"] == "llmweb"
    assert api.client.get("/v1/models/gpt-4").status_code == 404
    assert api.client.get("/v1/audio/speech").json()["error"]["code"] == "unknown_url"
    assert api.client.get("/v1/embeddings").json()["error"]["code"] == "method_not_allowed"
    assert api.client.get("/v1/chat/completions").status_code == 405


def test_the_listing_reads_the_models_folder_off_the_event_loop(api, monkeypatch):
    """The listing parses GGUF headers a visitor cannot bound in time (a slow disk, a first read):
    `/v1/models`, `/v1/models/{id}` and a chat request's model check read it in a worker thread,
    so the event loop keeps answering everyone else meanwhile."""
    import asyncio

    from llmweb.web.api import models

    on_loop = []

    def entries(runtime):
        try:
            asyncio.get_running_loop()
            on_loop.append(True)
        except RuntimeError:
            on_loop.append(False)
        return []

    monkeypatch.setattr(models, "_entries", entries)
    assert api.client.get("/v1/models").status_code == 200
    assert api.client.get("/v1/models/llmweb").status_code == 200
    say(api, "Hello")
    assert api.client.post("/v1/chat/completions", json=body()).status_code == 200
    assert len(on_loop) >= 3 and not any(on_loop), on_loop
