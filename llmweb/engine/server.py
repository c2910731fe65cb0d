"""The client of an OpenAI-compatible server (vLLM, SGLang, llama.cpp's llama-server, ...): its
address and timeouts (`RemoteConfig`), HTTP over stdlib `http.client` (`Server`: one connection per
request, the model's name, `GET /props`'s slots and context, a one-token probe of what the prompt
may be and which extra fields it takes, cached), a refusal's status and whether it says "too
long" (`HTTPStatus`), and the map of llama.cpp's slots to conversations (`SlotTable`).

A router in front of replicas (`RemoteConfig.router`, LLMWEB_ENGINE_ROUTER): its `/props` answers
for whichever replica it picks, so no slots and no context are read through it (one replica's slot
numbers mean nothing on another); `replicas()` reads how many answer where the router says
(vLLM's router: `GET /readiness` or `GET /workers`).

Used by the remote runner (engine/remote.py) and by the runtime (runtime/engines.py builds a
`Server`; runtime/health.py watches it). Must not: run a request's stream or schedule (the runner
and the engine do), or send conversation ids or owners in the clear (the runner hashes them).
"""

from __future__ import annotations

import http.client
import json
import logging
import threading
import time
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from llmweb.errors import LlmwebError

log = logging.getLogger(__name__)

RETRY_STATUS = frozenset({429, 500, 502, 503, 504})
# Behind a router, one retry before the first token, not three: the router retries and breaks
# circuits on its own, and ours would multiply its attempts; but a router that has not yet seen a
# replica die answers that request with an error (vLLM's router: HTTP 500), and one retry lets it
# send the same request to a replica that answers.
ROUTER_RETRIES = 1
CONTEXT_MARKERS = ("maximum context length", "context_length_exceeded", "exceed_context_size", "context length")


class RemoteError(LlmwebError):
    """The remote engine failed a request (unreachable, refused, cut off); the message says which."""


@dataclass(frozen=True)
class RemoteConfig:
    url: str  # http(s)://host:port (a trailing /v1 is fine)
    model: str = ""  # the server's model name; "" = the first of GET /v1/models
    api_key: str = ""
    routing_header: str = "X-Session-Id"  # "" = none
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 60.0  # no data for this long ends the request
    retries: int = 3  # for refused connections, 429 and 5xx, before the first token
    backoff_s: float = 0.5  # doubled each retry
    router: bool = False  # the URL is a router in front of replicas: no llama.cpp slots, no context read

    @property
    def parts(self) -> tuple[str, str, int, str]:
        """(scheme, host, port, base path without a trailing /v1)."""
        u = urllib.parse.urlsplit(self.url if "://" in self.url else f"http://{self.url}")
        base = u.path.rstrip("/")
        if base.endswith("/v1"):
            base = base[:-3]
        return u.scheme or "http", u.hostname or "127.0.0.1", u.port or (443 if u.scheme == "https" else 80), base


class HTTPStatus(Exception):
    def __init__(self, status: int, body: str):
        super().__init__(f"HTTP {status}: {body[:300]}")
        self.status, self.body = status, body

    @property
    def context_length(self) -> bool:
        """The server refused the prompt as too long (vLLM, OpenAI, llama.cpp say it in words only)."""
        low = self.body.lower()
        return self.status in (400, 413, 422) and any(m in low for m in CONTEXT_MARKERS)


@dataclass
class Capabilities:
    ids: bool  # the prompt may be a list of token ids
    extras: bool  # the server accepts the non-OpenAI fields (cache_salt, repetition_penalty, ...)
    logprobs: bool = False  # a completion with `logprobs` comes back with them (llama.cpp's or vLLM's shape)


class Server:
    """HTTP to one OpenAI-compatible server: stdlib `http.client`, one connection per request."""

    def __init__(self, config: RemoteConfig):
        self.config = config
        self.scheme, self.host, self.port, self.base = config.parts
        self._model = config.model
        self._caps: Capabilities | None = None
        self._slots: int | None = None  # llama.cpp's total_slots; 0: not a llama.cpp server
        self._lock = threading.Lock()

    def connect(self, timeout: float | None = None) -> http.client.HTTPConnection:
        cls = http.client.HTTPSConnection if self.scheme == "https" else http.client.HTTPConnection
        return cls(self.host, self.port, timeout=timeout or self.config.connect_timeout_s)

    def headers(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        h = {"Content-Type": "application/json", "Accept": "text/event-stream, application/json"}
        if self.config.api_key:
            h["Authorization"] = f"Bearer {self.config.api_key}"
        h.update(extra or {})
        return h

    def get_json(self, path: str) -> Any:
        conn = self.connect()
        try:
            conn.request("GET", self.base + path, headers=self.headers())
            r = conn.getresponse()
            body = r.read().decode("utf-8", "replace")
            if r.status != 200:
                raise HTTPStatus(r.status, body)
            return json.loads(body)
        finally:
            conn.close()

    def post(
        self,
        path: str,
        body: dict,
        headers: dict[str, str] | None = None,
        timeout: float | None = None,
        conn: http.client.HTTPConnection | None = None,
    ):
        """(connection, response) with status 200, headers read; raises HTTPStatus otherwise.
        `conn`: a connection made with `connect` (so another thread can shut it meanwhile)."""
        conn = conn or self.connect(timeout)
        try:
            conn.request("POST", self.base + path, body=json.dumps(body).encode(), headers=self.headers(headers))
            r = conn.getresponse()
        except BaseException:
            conn.close()
            raise
        if r.status != 200:
            text = r.read().decode("utf-8", "replace")
            conn.close()
            raise HTTPStatus(r.status, text)
        return conn, r

    @property
    def model(self) -> str:
        """The configured model name, else the server's first (asked once)."""
        if not self._model:
            data = self.get_json("/v1/models").get("data") or []
            if not data:
                raise RemoteError(f"The engine server at {self.config.url} lists no models.")
            self._model = str(data[0]["id"])
        return self._model

    def slots(self) -> int:
        """The server's slots when it is a llama.cpp server (`GET /props`), else 0 (asked until it
        answers: a server that is down now may be a llama.cpp server once it is up)."""
        if self.config.router:
            return 0  # a router's /props is one replica's: its slot numbers mean nothing on the others
        if self._slots is None:
            try:
                props = self.get_json("/props")
            except OSError:
                return 0
            except (HTTPStatus, ValueError):
                props = None
            total = props.get("total_slots") if isinstance(props, dict) else None
            self._slots = int(total) if isinstance(total, int) and total > 0 else 0
            log.info(
                "remote: %s has %s", self.config.url, f"{self._slots} llama.cpp slots" if self._slots else "no slots"
            )
        return self._slots

    def context_length(self) -> int | None:
        """The context one request may fill on the server, where it says: llama.cpp's per-slot
        `n_ctx` (`GET /props`), vLLM's `max_model_len` (`GET /v1/models`); None when it does not
        say or is not reachable (then the model's own figure stands), or is a router."""
        if self.config.router:
            return None  # one replica's answer, picked by the router: LLMWEB_CONTEXT_LIMIT says it instead
        for path, find in (
            ("/props", lambda d: (d.get("default_generation_settings") or {}).get("n_ctx")),
            ("/v1/models", lambda d: ((d.get("data") or [{}])[0] or {}).get("max_model_len")),
        ):
            try:
                data = self.get_json(path)
            except (OSError, HTTPStatus, ValueError):
                continue
            value = find(data) if isinstance(data, dict) else None
            if isinstance(value, int) and value > 1:
                return value
        return None

    def replicas(self) -> tuple[int, int] | None:
        """(answering, total) replicas behind a router, where it reports them: vLLM's router
        (`GET /readiness`: `healthy_workers`, `total_workers`) or a `GET /workers` list with
        `is_healthy` (vLLM's router); None when it reports neither (nginx)."""
        for path in ("/readiness", "/workers"):
            try:
                data = self.get_json(path)
            except HTTPStatus as e:
                data = _json_or_none(e.body) if e.status == 503 else None  # "not ready" still counts
            except (OSError, ValueError):
                return None
            if not isinstance(data, dict):
                continue
            healthy, total = data.get("healthy_workers"), data.get("total_workers")
            if isinstance(healthy, int) and isinstance(total, int):
                return healthy, total
            workers = data.get("workers")
            if isinstance(workers, list) and all(isinstance(w, dict) for w in workers):
                return sum(1 for w in workers if w.get("is_healthy", True)), len(workers)
        return None

    def reachable(self) -> str | None:
        """None when GET /v1/models answers; else why not, in a few words."""
        try:
            self.get_json("/v1/models")
            return None
        except (OSError, HTTPStatus, ValueError) as e:
            return f"{type(e).__name__}: {e}"

    def capabilities(self, sample_ids: Sequence[int], sample_text: str) -> Capabilities:
        """Probe once (two one-token requests), then the cached answer."""
        with self._lock:
            if self._caps is None:
                self._caps = self._probe(list(sample_ids), sample_text)
                caps = self._caps
                log.info(
                    "remote: %s takes token ids: %s; extra fields: %s; logprobs: %s",
                    self.config.url,
                    caps.ids,
                    caps.extras,
                    caps.logprobs,
                )
            return self._caps

    def _probe(self, ids: list[int], text: str) -> Capabilities:
        plain = {"model": self.model, "max_tokens": 1, "temperature": 0.0}

        def accepted(body: dict) -> bool:
            try:
                conn, r = self.post("/v1/completions", body, timeout=self.config.read_timeout_s)
            except HTTPStatus as e:
                if e.status in RETRY_STATUS or e.status in (401, 403, 404):
                    raise  # not an answer about the request's form
                return False
            r.read()
            conn.close()
            return True

        def logprobs(prompt) -> bool:
            try:
                conn, r = self.post("/v1/completions", {**plain, "prompt": prompt, "logprobs": 1}, timeout=timeout)
            except HTTPStatus as e:
                if e.status in RETRY_STATUS or e.status in (401, 403, 404):
                    raise
                return False
            try:
                data = _json_or_none(r.read().decode("utf-8", "replace"))
            finally:
                conn.close()
            choices = data.get("choices") if isinstance(data, dict) else None
            first = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {}
            return reply_logprobs(first.get("logprobs")) is not None

        timeout = self.config.read_timeout_s
        takes_ids = accepted({**plain, "prompt": ids})
        extras = accepted({**plain, "prompt": ids if takes_ids else text, **_EXTRAS_PROBE})
        return Capabilities(ids=takes_ids, extras=extras, logprobs=logprobs(ids if takes_ids else text))


def reply_logprobs(raw: Any) -> list[tuple[int | None, str, float, list[tuple[int | None, str, float]]]] | None:
    """A completion choice's `logprobs` as [(id, token text, logprob, [(id, text, logprob) of the
    most likely])], one per token; None when there are none or the shape is neither of these:
    llama.cpp's (`{"content": [{"id", "token", "logprob", "top_logprobs": [...]}]}`, ids given)
    and OpenAI's legacy one that vLLM writes (`tokens`, `token_logprobs`, `top_logprobs` as
    {text: logprob}; ids None: the caller has them as `token_ids`, or tokenises the text)."""
    if not isinstance(raw, dict):
        return None
    content = raw.get("content")
    if isinstance(content, list) and content:
        out = []
        for e in content:
            if not isinstance(e, dict) or not isinstance(e.get("logprob"), int | float):
                return None
            top = [
                (t.get("id"), str(t.get("token", "")), float(t["logprob"]))
                for t in e.get("top_logprobs") or []
                if isinstance(t, dict) and isinstance(t.get("logprob"), int | float)
            ]
            out.append(
                (
                    e.get("id") if isinstance(e.get("id"), int) else None,
                    str(e.get("token", "")),
                    float(e["logprob"]),
                    top,
                )
            )
        return out
    tokens, lps = raw.get("tokens"), raw.get("token_logprobs")
    if isinstance(tokens, list) and isinstance(lps, list) and tokens and len(tokens) == len(lps):
        tops = raw.get("top_logprobs") or [None] * len(tokens)
        out = []
        for tok, lp, top in zip(tokens, lps, tops, strict=False):
            if not isinstance(lp, int | float):
                return None
            alts = [(None, str(k), float(v)) for k, v in (top or {}).items() if isinstance(v, int | float)]
            out.append((None, str(tok), float(lp), sorted(alts, key=lambda a: -a[2])))
        return out
    return None


def _json_or_none(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


_EXTRAS_PROBE = {
    "cache_salt": "probe",
    "repetition_penalty": 1.0,
    "add_special_tokens": False,
    "return_token_ids": True,
}


class SlotTable:
    """Which llama.cpp server slot each conversation's prefix lives on.

    `take(key)`: the conversation's own slot if none of our requests holds it now, else the free
    slot used longest ago (it becomes the conversation's); -1 when every slot is busy (the server
    chooses). `give(slot)` when the request ends. Our requests are the only ones we know of: a
    server shared with other clients may still move a prefix.
    """

    def __init__(self, n: int):
        self.n = n
        self.home: dict[str, int] = {}  # conversation -> its slot
        self.busy: set[int] = set()
        self.used = [0.0] * n  # when each slot was last taken
        self._lock = threading.Lock()

    def take(self, key: str | None) -> int:
        with self._lock:
            slot = self.home.get(key, -1) if key else -1
            if slot < 0 or slot in self.busy:
                free = [i for i in range(self.n) if i not in self.busy]
                if not free:
                    return -1
                slot = min(free, key=lambda i: self.used[i])
                if key:
                    self.home = {k: v for k, v in self.home.items() if v != slot}  # its old prefix is gone
                    self.home[key] = slot
            self.busy.add(slot)
            self.used[slot] = time.monotonic()
            return slot

    def give(self, slot: int) -> None:
        with self._lock:
            self.busy.discard(slot)
