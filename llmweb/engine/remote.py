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
`return_token_ids`) are probed the same way, and so is whether a completion with `logprobs` comes
back with them (llama.cpp's shape, with ids; vLLM's legacy one): a request that asks for them gets
the server's ids and figures (`_logprobs`), or, from a server without them, a refusal (web/api/common.py).
A constrained request (engine/constraint.py) goes
with the server's own field: llama.cpp's `json_schema`, vLLM's `structured_outputs`; a server
with neither refuses it rather than answer unconstrained. The reply comes back as text (or ids, with vLLM's
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

Owns: the stream threads and the errors users read about them; the HTTP to the server, its
probing and the slot map are engine/server.py's.
Must not: schedule (the engine's queue and `max_batch` decide what runs), retry a reply
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
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import psutil

from llmweb.engine.kvcache import KVStore
from llmweb.engine.request import EngineLimits, GenerationRequest, GiveWay, Slot, TokenLogprob, Unmetered
from llmweb.engine.scheduler import Engine
from llmweb.engine.server import (
    RETRY_STATUS,
    Capabilities,
    HTTPStatus,
    RemoteConfig,
    RemoteError,
    Server,
    SlotTable,
    reply_logprobs,
)
from llmweb.errors import InputError, LlmwebError
from llmweb.records import MemorySnapshot

log = logging.getLogger(__name__)

TICK_S = 0.02  # longest wait of one engine step for news from the streams
DRAIN_S = 0.5  # longest wait at a reply's normal end for the stream's last event (its usage); it blocks the worker


@dataclass(eq=False)
class _Call:
    """One request's stream, fed by its own thread, read by the engine's worker."""

    events: deque = field(default_factory=deque)  # (ids, arrival time, their TokenLogprobs or None)
    top: int | None = None  # the request's logprobs (how many alternatives), when it asked and the server gives them
    accepted: bool = False  # HTTP 200 came
    done: bool = False  # the stream ended (finish_reason below) or failed (error)
    finish: str = ""  # eos | length
    error: BaseException | None = None
    cached: int | None = None  # prompt tokens the server served from its cache, when it says so
    server_slot: int = -1  # the llama.cpp slot asked for (SlotTable); -1: the server's choice
    closed: bool = False
    conn: http.client.HTTPConnection | None = None
    thread: threading.Thread | None = None


class RemoteRunner(Unmetered):
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

    # ---- memory: the server's business (`Unmetered`)
    def snapshot(self) -> MemorySnapshot:
        return MemorySnapshot(rss_bytes=psutil.Process().memory_info().rss)  # this process only: no VRAM figures

    def probe(self) -> Capabilities:
        """What the server takes (asked once, then remembered): the status line shows it at start."""
        sample = self.encode("Hello")
        return self.server.capabilities(sample, self.decode_text(sample))

    @property
    def logprobs(self) -> bool:
        """Whether the server gives log-probabilities (probed with the other fields): llama.cpp's
        and vLLM's do, with ids; a server that does not, or cannot be asked now, gets a request's
        `logprobs` refused (web/api/common.py) rather than answered without them."""
        try:
            return self.probe().logprobs
        except (LlmwebError, OSError, ValueError):
            return False

    # ---- the batch
    def start(self, slot: Slot) -> None:
        self._constrained(slot.request)  # a server that cannot constrain refuses here, before anything is asked
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
            ids, arrived, logprobs = call.events.popleft()
            for i, token in enumerate(ids):
                first = slot.t_first is None
                slot.record(token, logprobs[i] if logprobs else None)
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
        if request.logprobs is not None and caps.logprobs:
            body["logprobs"] = max(1, request.logprobs)  # llama.cpp sends none for 0
        if server_slot >= 0:
            body["id_slot"] = server_slot  # llama.cpp: the slot that holds this conversation's prefix
            body["cache_prompt"] = True
        headers: dict[str, str] = {}
        if request.session_id:
            body["user"] = _hashed(request.session_id)
            if self.server.config.routing_header:
                headers[self.server.config.routing_header] = _hashed(request.session_id)
        body.update(self._constrained(request))
        if caps.extras:
            body["cache_salt"] = _hashed("owner:" + request.owner)
            body["add_special_tokens"] = False  # the chat template's tokens are in the prompt already
            body["return_token_ids"] = True  # vLLM: the reply's own ids, not our re-tokenised text
            if request.repetition_penalty != 1.0:
                body["repetition_penalty"] = request.repetition_penalty
        return body, headers

    def _constrained(self, request: GenerationRequest) -> dict[str, Any]:
        """The server's own field for the request's constraint (engine/constraint.py): llama.cpp's
        `json_schema`, vLLM's `structured_outputs`; a server with neither refuses the request
        (InputError) rather than answer it unconstrained."""
        if request.constraint is None:
            return {}
        schema = json.loads(request.constraint.schema)
        if self.server.slots():
            return {"json_schema": schema}
        prompt = list(request.prompt_ids[:8])
        if self.server.capabilities(prompt, self.decode_text(prompt)).extras:
            return {"structured_outputs": {"json": schema}}
        raise InputError(
            f"The engine server at {self.server.config.url} cannot constrain a reply (it is neither llama.cpp's "
            "nor vLLM's), so response_format and tools are refused rather than answered unconstrained."
        )

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
                call.top = request.logprobs if "logprobs" in body else None
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
            logprobs = None
            if call.top is not None:
                ids, logprobs = self._logprobs(choice, ids, call.top)
            if ids is None and choice.get("text"):
                ids = self.encode(choice["text"])
            if ids:
                with self._news:
                    call.events.append((list(ids), time.perf_counter(), logprobs))
                    self._news.notify_all()
            reason = choice.get("finish_reason")
            if reason:
                call.finish = "length" if reason == "length" else "eos"
                finished = True
        return finished

    def _logprobs(self, choice: dict, ids: list[int] | None, top: int) -> tuple[list[int] | None, list | None]:
        """A chunk's tokens as (ids, TokenLogprobs): llama.cpp names each token's id, vLLM gives
        `token_ids` beside them; a token named only by its text is its id when it tokenises to one.
        (ids, None) where they cannot be paired: that chunk's tokens go without log-probabilities."""
        entries = reply_logprobs(choice.get("logprobs"))
        if not entries:
            return ids, None

        def one(known: int | None, text: str) -> int | None:
            if known is not None:
                return known
            got = self.encode(text) if text else []
            return got[0] if len(got) == 1 else None

        named = [e[0] for e in entries]
        if ids is not None and len(ids) == len(entries):
            named = list(ids)
        found = [one(n, e[1]) for n, e in zip(named, entries, strict=True)]
        if any(i is None for i in found):
            return ids, None
        tokens = [t for t in found if t is not None]
        out = []
        for token, (_, _, lp, alts) in zip(tokens, entries, strict=True):
            pairs = [(a, alp) for a, alp in ((one(i, t), alp) for i, t, alp in alts) if a is not None]
            out.append(TokenLogprob(token, lp, tuple(pairs[:top])))
        return tokens, out


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
