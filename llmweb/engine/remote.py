"""The remote runner: the engine's batch runs on an OpenAI-compatible server, not in this process.

The scheduler (scheduler.py with queue.py and admission.py: the fair queue, admission, cancel,
time limits; `Handle` and its events in request.py) is the same object the local model uses;
only the `Runner` differs. `RemoteRunner` runs each admitted request as one streamed
`POST /v1/completions` on a thread of its own, and the engine's steps only collect what the
streams delivered:

    start(slot)        open the request's stream (its own thread; the server batches, not us)
    prefill(slot)      wait a moment for the server to ACCEPT the prompt (HTTP 200): the slot then
                       decodes; a "maximum context length" refusal raises `GiveWay` (the engine
                       retries once with the request's smaller fallback, as after an OOM)
    decode(slots)      record the token ids each stream delivered since the last step (waits up
                       to `TICK_S` for any); a stream that ended sets the slot's finish; one that
                       failed sets `slot.error` (that request alone fails, its partial reply kept)
    release(slot)      after a normal end (a stop id or the length cap), read the stream to its
                       end first (up to DRAIN_S, normally milliseconds): the server's last event carries the cached
                       tokens (vLLM's `usage`, llama.cpp's `timings.cache_n`); a cancel or time
                       limit closes it at once (that stops the server's work for it). Then fill
                       the stats: cached tokens as the server reported them
    predict/held/available   0 / 0 / unlimited: admission is the in-flight cap `max_batch`
                       (LLMWEB_ENGINE_CONCURRENCY); the server owns its memory and we do not guess

The prompt goes as token ids where the server takes them (vLLM, SGLang, llama.cpp), else as
text decoded with the special tokens kept in (the chat template's markers); `Server.probe`
finds out once, with a one-token request, and the answer is cached. Extra fields some servers
know and strict ones refuse (`cache_salt`, `repetition_penalty`, `add_special_tokens`,
`return_token_ids`) are probed the same way. The reply comes back as text (or ids, with vLLM's
`return_token_ids`); text is tokenised piece by piece with our tokenizer, so the engine still
speaks ids. Faults: refused connections, 429 and 5xx are retried with backoff up to `retries`
times, but only before the first token (a reply already shown is never silently restarted); a
connection lost mid-stream or no data for `read_timeout_s` ends the request with a clear error
and the partial reply. Routing: the conversation id goes as `user` and, hashed, in the
`routing_header` (a session-affinity router keeps a conversation on the replica that holds its
prefix cache); the owner, hashed, as `cache_salt` (vLLM keeps owners' prefix caches apart).
A llama.cpp server (`GET /props` names its `total_slots`) keeps one prompt cache per slot and
otherwise picks a slot by prompt similarity; `SlotTable` keeps each conversation on the slot that
holds its prefix (`id_slot`), and a slot busy with another of our requests is never asked for.

Nothing here imports torch. `remote_engine(...)` wires the runner into an `Engine`.

Owns: the HTTP to the server (`Server`), the stream threads and the errors users read about
them. Must not: schedule (the engine's queue and `max_batch` decide what runs), retry a reply
already streamed, or send conversation ids or owners in the clear.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import logging
import socket
import threading
import time
import urllib.parse
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import psutil

from llmweb.engine.kvcache import KVStore
from llmweb.engine.request import EngineLimits, GenerationRequest, GiveWay, Slot
from llmweb.engine.scheduler import Engine
from llmweb.errors import LlmwebError
from llmweb.records import MemorySnapshot

log = logging.getLogger(__name__)

TICK_S = 0.02  # longest wait of one engine step for news from the streams
DRAIN_S = 0.5  # longest wait at a reply's normal end for the stream's last event (its usage); it blocks the worker
RETRY_STATUS = frozenset({429, 500, 502, 503, 504})
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
        say or is not reachable (then the model's own figure stands)."""
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
                log.info("remote: %s takes token ids: %s; extra fields: %s", self.config.url, caps.ids, caps.extras)
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

        takes_ids = accepted({**plain, "prompt": ids})
        extras = accepted({**plain, "prompt": ids if takes_ids else text, **_EXTRAS_PROBE})
        return Capabilities(ids=takes_ids, extras=extras)


_EXTRAS_PROBE = {
    "cache_salt": "probe",
    "repetition_penalty": 1.0,
    "add_special_tokens": False,
    "return_token_ids": True,
}


@dataclass(eq=False)
class _Call:
    """One request's stream, fed by its own thread, read by the engine's worker."""

    events: deque = field(default_factory=deque)  # (ids, arrival time)
    accepted: bool = False  # HTTP 200 came
    done: bool = False  # the stream ended (finish_reason below) or failed (error)
    finish: str = ""  # eos | length
    error: BaseException | None = None
    cached: int | None = None  # prompt tokens the server served from its cache, when it says so
    server_slot: int = -1  # the llama.cpp slot asked for (SlotTable); -1: the server's choice
    closed: bool = False
    conn: http.client.HTTPConnection | None = None
    thread: threading.Thread | None = None


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


class RemoteRunner:
    """A `Runner` whose model is on an OpenAI-compatible server (see the module docstring)."""

    device = "remote"

    def __init__(
        self,
        server: Server,
        encode: Callable[[str], list[int]],
        decode: Callable[[Sequence[int]], str],
        sleep: Callable[[float], None] = time.sleep,
    ):
        self.server = server
        self.encode, self.decode_text = encode, decode
        self.sleep = sleep
        self._news = threading.Condition()
        self.counters = {"retries": 0, "disconnects": 0}
        self._table: SlotTable | None = None

    # ---- memory: the server's business
    def predict(self, request: GenerationRequest) -> int:
        return 0

    def held(self, slot: Slot) -> int:
        return 0

    def available(self) -> int:
        return 1 << 62

    def busy(self, work: Callable[[], None]) -> None:
        work()

    def empty_cache(self) -> None:
        pass

    def snapshot(self) -> MemorySnapshot:
        return MemorySnapshot(rss_bytes=psutil.Process().memory_info().rss)  # this process only: no VRAM figures

    def probe(self) -> Capabilities:
        """What the server takes (asked once, then remembered): the status line shows it at start."""
        sample = self.encode("Hello")
        return self.server.capabilities(sample, self.decode_text(sample))

    # ---- the batch
    def start(self, slot: Slot) -> None:
        call = _Call()
        if self._table is None and self.server.slots():
            self._table = SlotTable(self.server.slots())
        if self._table is not None:
            call.server_slot = self._table.take(slot.request.session_id)
        slot.state = call
        slot.stats.reused_tokens, slot.stats.reuse_reported = 0, False
        call.thread = threading.Thread(
            target=self._run, args=(call, slot.request), name=f"llmweb-remote-{slot.handle.id}", daemon=True
        )
        call.thread.start()

    def prefill(self, slot: Slot) -> bool:
        call: _Call = slot.state
        with self._news:
            if not (call.accepted or call.done):
                self._news.wait(TICK_S)
        if call.error is not None and not call.accepted:
            err = call.error
            if isinstance(err, HTTPStatus) and err.context_length:
                raise GiveWay(
                    "context_length",
                    f"The engine server refused the prompt as longer than its context "
                    f"({len(slot.request.prompt_ids)} tokens): {_detail(err.body)}",
                )
            raise _user_error(self.server.config, err)
        if call.accepted or call.done:
            slot.ready = True
            self._collect(slot)
        return True

    def decode(self, slots: list[Slot]) -> bool:
        with self._news:
            if not any(s.state.events or s.state.done for s in slots):
                self._news.wait(TICK_S)
        for slot in slots:
            self._collect(slot)
        return True

    def release(self, slot: Slot, keep: bool) -> None:
        call: _Call | None = slot.state
        if call is None:
            return
        if slot.finish in ("eos", "length") and not call.done:
            with self._news:  # the server's last event (its usage) is on its way: read it
                self._news.wait_for(lambda: call.done, timeout=DRAIN_S)
        self._close(call)
        if self._table is not None and call.server_slot >= 0:
            self._table.give(call.server_slot)
        if call.cached is not None:
            slot.stats.reused_tokens, slot.stats.reuse_reported = call.cached, True
        slot.stats.prefilled_tokens = slot.stats.prompt_tokens - slot.stats.reused_tokens
        slot.stats.mem = self.snapshot()

    # ---- the worker side of a stream
    def _collect(self, slot: Slot) -> None:
        """Record the ids the stream delivered; end the slot when its stream ended."""
        call: _Call = slot.state
        while call.events and slot.finish is None:
            ids, arrived = call.events.popleft()
            for token in ids:
                first = slot.t_first is None
                slot.record(token)
                if first and slot.t_first is not None:  # timed by arrival, not by when this step looked
                    slot.t_first, slot.stats.ttft_s = arrived, arrived - slot.t0
                if slot.t_last is not None:
                    slot.t_last = max(arrived, slot.t_first or arrived)
                if slot.finish is not None:
                    break
        if slot.finish is None and call.done and not call.events:
            if call.error is not None:
                slot.error = _user_error(self.server.config, call.error, partial=bool(slot.generated))
                slot.finish = "error"
            else:
                slot.finish = call.finish or "eos"

    def _close(self, call: _Call) -> None:
        call.closed = True
        conn = call.conn
        if conn is not None and conn.sock is not None:
            try:
                conn.sock.shutdown(socket.SHUT_RDWR)  # wakes the stream thread's read at once
            except OSError:
                pass

    def _body(self, request: GenerationRequest, server_slot: int = -1) -> tuple[dict, dict[str, str]]:
        prompt = list(request.prompt_ids)
        caps = self.server.capabilities(prompt[:8], self.decode_text(prompt[:8]))
        body: dict[str, Any] = {
            "model": self.server.model,
            "prompt": prompt if caps.ids else self.decode_text(prompt),
            "max_tokens": request.max_new_tokens,
            "temperature": request.temperature,
            "top_p": request.top_p if request.temperature > 0 else 1.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if request.seed is not None:
            body["seed"] = request.seed
        if server_slot >= 0:
            body["id_slot"] = server_slot  # llama.cpp: the slot that holds this conversation's prefix
            body["cache_prompt"] = True
        headers: dict[str, str] = {}
        if request.session_id:
            body["user"] = _hashed(request.session_id)
            if self.server.config.routing_header:
                headers[self.server.config.routing_header] = _hashed(request.session_id)
        if caps.extras:
            body["cache_salt"] = _hashed("owner:" + request.owner)
            body["add_special_tokens"] = False  # the chat template's tokens are in the prompt already
            body["return_token_ids"] = True  # vLLM: the reply's own ids, not our re-tokenised text
            if request.repetition_penalty != 1.0:
                body["repetition_penalty"] = request.repetition_penalty
        return body, headers

    def _run(self, call: _Call, request: GenerationRequest) -> None:
        """The stream thread: open (with retries before the first token), then read the events."""
        try:
            response = self._open(call, request)
            if response is not None:
                self._read(call, response)
        except BaseException as e:  # the worker reports it as this request's error
            if not call.closed:
                log.warning("remote: request failed: %s: %s", type(e).__name__, e)
                call.error = e
        finally:
            if call.conn is not None:
                call.conn.close()
            with self._news:
                call.done = True
                self._news.notify_all()

    def _open(self, call: _Call, request: GenerationRequest):
        """POST the request (probing the server first, once); refused connections, 429 and 5xx are
        retried with backoff. Returns the streaming response (None if closed meanwhile)."""
        cfg = self.server.config
        for attempt in range(cfg.retries + 1):
            if call.closed:
                return None
            try:
                body, headers = self._body(request, call.server_slot)
                call.conn = self.server.connect(cfg.read_timeout_s)  # a cancel can shut it while we wait
                if call.closed:
                    return None
                _, response = self.server.post("/v1/completions", body, headers, conn=call.conn)
            except (HTTPStatus, ConnectionError, TimeoutError) as e:
                retry = not isinstance(e, HTTPStatus) or e.status in RETRY_STATUS
                if not retry or attempt == cfg.retries:
                    raise
                self.counters["retries"] += 1
                wait = cfg.backoff_s * 2**attempt
                log.info("remote: %s; retry %d/%d in %.1f s", e, attempt + 1, cfg.retries, wait)
                self.sleep(wait)
                continue
            with self._news:
                call.accepted = True
                self._news.notify_all()
            return response
        return None

    def _read(self, call: _Call, response) -> None:
        """Server-sent events: `data: {json}` lines until `data: [DONE]` or the end of the stream."""
        saw_finish = False
        while not call.closed:
            line = response.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise RemoteError(f"The engine server reported an error mid-reply: {_detail(json.dumps(chunk))}")
            saw_finish |= self._chunk(call, chunk)
        if not call.closed and not saw_finish:
            self.counters["disconnects"] += 1
            raise ConnectionError("the stream ended before the reply did")

    def _chunk(self, call: _Call, chunk: dict) -> bool:
        """One event: its ids to the worker; usage and finish reason noted. True once it finished."""
        usage = chunk.get("usage") or {}
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        if cached is None:
            cached = (chunk.get("timings") or {}).get("cache_n")  # llama.cpp
        if cached is not None:
            call.cached = int(cached)
        finished = False
        for choice in chunk.get("choices") or []:
            ids = choice.get("token_ids")
            if ids is None and choice.get("text"):
                ids = self.encode(choice["text"])
            if ids:
                with self._news:
                    call.events.append((list(ids), time.perf_counter()))
                    self._news.notify_all()
            reason = choice.get("finish_reason")
            if reason:
                call.finish = "length" if reason == "length" else "eos"
                finished = True
        return finished


def _user_error(config: RemoteConfig, err: BaseException, partial: bool = False) -> LlmwebError:
    """What the user reads when a stream failed (`partial`: after some of the reply came)."""
    if isinstance(err, LlmwebError):
        return err
    url = config.url
    if isinstance(err, HTTPStatus):
        return RemoteError(f"The engine server at {url} answered HTTP {err.status}: {_detail(err.body)}")
    if isinstance(err, TimeoutError | socket.timeout):
        return RemoteError(
            f"The engine server at {url} sent nothing for {config.read_timeout_s:.0f} s"
            + ("; the reply so far is kept." if partial else ".")
        )
    if partial:
        return RemoteError(
            f"The connection to the engine server at {url} was lost mid-reply; the reply so far is kept."
        )
    return RemoteError(f"The engine server at {url} is not reachable ({type(err).__name__}: {err}).")


def _hashed(key: str) -> str:
    """A stable, opaque id for a routing key (the server never sees conversation ids or owners)."""
    return hashlib.sha256(key.encode()).hexdigest()[:32]


def _detail(body: str) -> str:
    """The server's own message from an error body, shortened."""
    try:
        data = json.loads(body)
        err = data.get("error", data.get("detail", data)) if isinstance(data, dict) else data
        msg = err.get("message", err) if isinstance(err, dict) else err
        return str(msg)[:300]
    except ValueError:
        return body.strip()[:300]


def remote_engine(
    config: RemoteConfig,
    encode: Callable[[str], list[int]],
    decode: Callable[[Sequence[int]], str],
    limits: EngineLimits,
    sleep: Callable[[float], None] = time.sleep,
) -> Engine:
    """The engine (the same scheduler as the local model's) over a remote server."""
    runner = RemoteRunner(Server(config), encode, decode, sleep=sleep)
    return Engine(runner, KVStore(0, 60.0), limits)
