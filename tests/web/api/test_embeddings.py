"""POST /v1/embeddings over the routes (web/api/embeddings.py) with a fake embedder (word counts for
tokens, a vector from each word's length): OpenAI's shape, float and base64, the model's names,
every refusal naming its field, and the per-owner limits on requests in flight, two owners apart."""

from __future__ import annotations

import base64
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from llmweb.errors import Cancelled
from llmweb.web.api.embeddings_wire import EMBEDDING_ALIAS, MAX_INPUT_CHARS, MAX_INPUTS, parse_embeddings
from tests.web.api.conftest import rig

WINDOW, DIM = 8, 4


class FakeEmbedder:
    """Tokens: a text's words and two special tokens; a vector: the first word lengths, unit-length."""

    def __init__(self):
        self.window, self.dim = WINDOW, DIM
        self.gate: threading.Event | None = None  # set by a test: embed waits for it
        self.started = threading.Semaphore(0)
        self.batches = 0

    def token_counts(self, texts):
        return [len(t.split()) + 2 for t in texts]

    def embed(self, texts, progress=None):
        """Batches of one text, `progress` after each, as Embedder.embed calls it."""
        self.started.release()
        if self.gate is not None:
            assert self.gate.wait(10)
        out = np.zeros((len(texts), DIM), dtype=np.float32)
        for i, t in enumerate(texts):
            lengths = [len(w) for w in t.split()][:DIM]
            out[i, : len(lengths)] = lengths
            out[i] /= np.linalg.norm(out[i]) or 1.0
            self.batches += 1
            if progress is not None:
                progress(i + 1, len(texts))
        return out


def embed_rig(tmp_path, **kw):
    r = rig(tmp_path, **kw)
    r.embedder = FakeEmbedder()
    routes = r.client.app.router.routes
    found = next(route.endpoint.__self__ for route in routes if getattr(route, "path", "") == "/v1/embeddings")
    found.runtime.library = SimpleNamespace(embedder=r.embedder)
    r.embeddings = found
    return r


@pytest.fixture
def emb(tmp_path):
    r = embed_rig(tmp_path)
    yield r
    r.engine.close()
    r.store.close()


def post(r, **body):
    return r.client.post("/v1/embeddings", json={"model": "all-MiniLM-L6-v2", **body})


def test_a_string_and_a_list_in_openais_shape_with_usage(emb):
    d = post(emb, input="hello there").json()
    assert d["object"] == "list" and d["model"] == "all-MiniLM-L6-v2"
    (one,) = d["data"]
    assert one["object"] == "embedding" and one["index"] == 0 and len(one["embedding"]) == DIM
    assert np.allclose(one["embedding"], emb.embedder.embed(["hello there"])[0])
    assert d["usage"] == {"prompt_tokens": 4, "total_tokens": 4}
    d = post(emb, input=["a bb", "ccc dddd eeeee", "x " * 20]).json()
    assert [e["index"] for e in d["data"]] == [0, 1, 2]
    assert d["usage"]["prompt_tokens"] == 4 + 5 + WINDOW, "a text past the window counts what the model reads"
    assert d["x_llmweb"] == {"window_tokens": WINDOW, "truncated": [2]}


def test_base64_is_little_endian_float32_of_the_same_vector(emb):
    floats = post(emb, input=["one two three"]).json()["data"][0]["embedding"]
    d = post(emb, input=["one two three"], encoding_format="base64").json()
    raw = base64.b64decode(d["data"][0]["embedding"])
    assert np.array_equal(np.frombuffer(raw, dtype="<f4"), np.asarray(floats, dtype=np.float32))


def test_the_alias_and_dimensions_of_the_native_size_are_accepted(emb):
    d = post(emb, input="hi", model=EMBEDDING_ALIAS, dimensions=DIM).json()
    assert d["model"] == "all-MiniLM-L6-v2" and len(d["data"][0]["embedding"]) == DIM


@pytest.mark.parametrize(
    "fields, status, param, says",
    [
        ({"model": "text-embedding-3-small"}, 404, "model", "does not exist here"),
        ({"model": "llmweb"}, 404, "model", "all-MiniLM-L6-v2"),
        ({"model": None}, 400, "model", "must provide a model"),
        ({"input": None}, 400, "input", "must provide input"),
        ({"input": ""}, 400, "input", "input is empty"),
        ({"input": ["ok", ""]}, 400, "input", "input[1] is empty"),
        ({"input": []}, 400, "input", "empty list"),
        ({"input": ["ok", 3]}, 400, "input", "input[1] must be a string"),
        ({"input": [1, 2, 3]}, 400, "input", "token ids"),
        ({"input": [[1, 2], [3]]}, 400, "input", "check_embedding_ctx_length"),
        ({"input": {"text": "x"}}, 400, "input", "a string or a list"),
        ({"input": ["x"] * (MAX_INPUTS + 1)}, 400, "input", f"at most {MAX_INPUTS}"),
        ({"input": "x" * (MAX_INPUT_CHARS + 1)}, 400, "input", f"at most {MAX_INPUT_CHARS:,}"),
        ({"encoding_format": "int8"}, 400, "encoding_format", "'float' or 'base64'"),
        ({"dimensions": 2}, 400, "dimensions", f"must be {DIM}"),
        ({"dimensions": "4"}, 400, "dimensions", "integer"),
        ({"user": 5}, 400, "user", "string"),
        ({"truncate": True}, 400, "truncate", "Unrecognized request argument"),
    ],
)
def test_refusals_name_their_field(emb, fields, status, param, says):
    r = post(emb, **{"input": "hello", **fields})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and says in err["message"], err


def test_keys_are_needed_as_for_chat(tmp_path):
    r = embed_rig(tmp_path)
    try:
        resp = r.client.post(
            "/v1/embeddings", json={"model": EMBEDDING_ALIAS, "input": "x"}, headers={"Authorization": ""}
        )
        assert resp.status_code == 401
        assert r.client.get("/v1/embeddings").status_code == 405
    finally:
        r.engine.close()


def wait_for(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def flood(r, key: str, n: int) -> tuple[list, list[threading.Thread]]:
    """`n` requests of `key` at once (each waits in the fake embedder); their responses, and threads."""
    results: list = []

    def one():
        results.append(
            r.client.post(
                "/v1/embeddings",
                json={"model": EMBEDDING_ALIAS, "input": "a b"},
                headers={"Authorization": f"Bearer {key}"},
            )
        )

    threads = [threading.Thread(target=one, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    return results, threads


def test_one_owners_flood_is_refused_with_retry_after_and_the_other_owner_is_served(tmp_path):
    r = embed_rig(tmp_path, host="0.0.0.0", api_keys="alice:alice-key-0123456789,bob:bob-key-0123456789")
    r.embedder.gate = threading.Event()
    try:
        held, threads = flood(r, "alice-key-0123456789", 3)  # queue_per_user 2: one running, two waiting
        for _ in range(2):  # two run (the pool's workers); the third waits for a worker
            assert r.embedder.started.acquire(timeout=10)
        wait_for(lambda: sum(r.embeddings.in_flight._mine.values()) == 3)
        late = r.client.post(
            "/v1/embeddings",
            json={"model": EMBEDDING_ALIAS, "input": "a"},
            headers={"Authorization": "Bearer alice-key-0123456789"},
        )
        assert late.status_code == 429 and late.headers["retry-after"].isdigit()
        assert "you already have 3 embedding requests" in late.json()["error"]["message"]
        bob, bob_threads = flood(r, "bob-key-0123456789", 1)
        r.embedder.gate.set()
        for t in threads + bob_threads:
            t.join(10)
        assert [x.status_code for x in held + bob] == [200] * 4, "alice's flood did not refuse bob"
    finally:
        r.embedder.gate.set()
        r.engine.close()


def test_the_single_users_parallel_requests_are_all_answered(emb):
    emb.embedder.gate = threading.Event()
    try:
        results, threads = flood(emb, emb.key, 6)
        for _ in range(2):
            assert emb.embedder.started.acquire(timeout=10)
        emb.embedder.gate.set()
        for t in threads:
            t.join(10)
        assert [x.status_code for x in results] == [200] * 6
    finally:
        emb.embedder.gate.set()


def test_the_work_of_a_client_that_left_stops_after_the_batch_in_hand(emb):
    gone = threading.Event()
    gone.set()
    req = parse_embeddings({"model": EMBEDDING_ALIAS, "input": ["a", "b", "c"]}, emb.embeddings.names)
    with pytest.raises(Cancelled):
        emb.embeddings.embed(req, gone)
    assert emb.embedder.batches == 1
    assert len(emb.embeddings.embed(req, threading.Event())["data"]) == 3
