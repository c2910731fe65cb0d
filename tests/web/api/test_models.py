"""GET /v1/models and GET /v1/models/{id} over the routes, and the answer for a path under /v1 that
is not an endpoint (web/api/models.py, web/api/routes.py)."""

from __future__ import annotations


def test_models_lists_llmweb(api):
    r = api.client.get("/v1/models")
    assert r.status_code == 200 and [m["id"] for m in r.json()["data"]] == ["llmweb"]
    assert api.client.get("/v1/models/llmweb").json()["id"] == "llmweb"
    assert api.client.get("/v1/models/gpt-4").status_code == 404
    assert api.client.get("/v1/audio/speech").json()["error"]["code"] == "unknown_url"
    assert api.client.get("/v1/embeddings").json()["error"]["code"] == "method_not_allowed"
    assert api.client.get("/v1/chat/completions").status_code == 405
