"""Replicas behind a router, for real: two llama.cpp `llama-server` processes (the embedded GGUF file,
1 thread, 2 slots each) behind vLLM's router (`vllm-router --policy consistent_hash`), llmweb's
remote engine at the router (LLMWEB_ENGINE_ROUTER=1). 4 chats of 6 turns: the first three turns
of each at once, then one reply whose replica is killed (SIGKILL) while it streams, then the rest.

Between the router and each replica sits a recording proxy (below): it forwards every request and
streams every reply back, and keeps each request's body, so the test reads what reached the
replicas (no `id_slot`, ever) and which replica served each chat.

Needs `llama-server` (LLMWEB_LLAMA_SERVER or the PATH) and `vllm-router` (requirements-dev.txt);
skipped without them, except where LLMWEB_LLAMA_SERVER is set (CI builds llama-server): there a
missing router fails. The fast tests of the same mode: tests/engine/test_router.py.
"""

from __future__ import annotations

import http.client
import json
import os
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from llmweb.bench import router as bench_router
from llmweb.bench.common import llama_tool
from llmweb.chat.turn import Delta, Finished
from llmweb.engine.server import RemoteConfig, Server
from llmweb.errors import LlmwebError
from tests.conftest import make_settings

SERVER, ROUTER = llama_tool("llama-server"), bench_router.router_exe()
IN_CI = bool(os.environ.get("LLMWEB_LLAMA_SERVER"))

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not (SERVER and ROUTER) and not IN_CI,
        reason="no llama-server (LLMWEB_LLAMA_SERVER or the PATH) or no vllm-router (requirements-dev.txt)",
    ),
]

CHATS, TURNS, KILL_AT = 4, 6, 4  # the kill comes in chat 0's turn KILL_AT (1-based)


class RecordingProxy:
    """A pass-through HTTP proxy in front of one replica: each request goes on unchanged, each reply
    streams back chunk by chunk; POST bodies are kept in `bodies`. When the replica is gone (refused,
    or cut off mid-reply) the proxy drops the connection the same way, so the router sees what it
    would have seen without it."""

    def __init__(self, upstream: str):
        self.upstream = urllib.parse.urlsplit(upstream)
        self.bodies: list[dict] = []
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_GET(self):
                proxy.forward(self, None)

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                try:
                    proxy.bodies.append(json.loads(body))
                except ValueError:
                    proxy.bodies.append({"unparsed": body.decode("utf-8", "replace")})
                proxy.forward(self, body)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def forward(self, handler: BaseHTTPRequestHandler, body: bytes | None) -> None:
        handler.close_connection = True
        skip = {"host", "content-length", "connection", "transfer-encoding"}
        headers = {k: v for k, v in handler.headers.items() if k.lower() not in skip}
        conn = http.client.HTTPConnection(self.upstream.hostname, self.upstream.port, timeout=60)
        try:
            conn.request(handler.command, handler.path, body=body, headers=headers)
            r = conn.getresponse()
            handler.send_response(r.status)
            for k, v in r.getheaders():
                if k.lower() not in skip:
                    handler.send_header(k, v)
            handler.send_header("Transfer-Encoding", "chunked")
            handler.send_header("Connection", "close")
            handler.end_headers()
            while data := r.read1(65536):
                handler.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                handler.wfile.flush()
            if not r.isclosed() and r.length not in (None, 0):
                return  # cut off: no last chunk, the router sees a reply that broke off
            handler.wfile.write(b"0\r\n\r\n")
        except (OSError, http.client.HTTPException):
            return  # the replica is gone: drop the connection (no answer, no last chunk)
        finally:
            conn.close()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """(router URL, [(replica, proxy)]), the router's log kept beside the test's data."""
    if not (SERVER and ROUTER):
        pytest.fail(f"LLMWEB_LLAMA_SERVER is set (CI) but llama-server={SERVER!r}, vllm-router={ROUTER!r}")
    log = tmp_path_factory.mktemp("router") / "router.log"
    with bench_router.replicas(2, 2, threads=1, progress=lambda _: None) as replicas:
        proxies = [RecordingProxy(r.url) for r in replicas]
        try:
            with bench_router.router([p.url for p in proxies], "consistent_hash", log=log) as url:
                yield url, list(zip(replicas, proxies, strict=True))
        finally:
            for p in proxies:
                p.close()


def _served_by(pairs, user: str) -> list[int]:
    """Which replicas got a completion request with this session key (`user`)."""
    return [i for i, (_, proxy) in enumerate(pairs) if any(b.get("user") == user for b in list(proxy.bodies))]


def test_two_replicas_behind_vllm_router_survive_a_replica_killed_mid_reply(fleet, tmp_path):
    from llmweb.engine.remote import _hashed
    from llmweb.runtime import Runtime

    url, pairs = fleet
    settings = make_settings(
        tmp_path / "data",
        engine_url=url,
        engine_router=True,
        context_limit=bench_router.SLOT_CONTEXT,
        engine_concurrency=4,
        max_new_tokens=24,
        temperature=0.0,
    )
    rt = Runtime(settings).start(background=False)
    convs: list[str | None] = [None] * CHATS
    failed: list[str] = []
    try:
        chat = rt.wait_ready()
        assert "2 of 2 replicas answer" in rt.status, rt.status
        owners = [f"owner-{c}" for c in range(CHATS)]

        def turns(c: int, which: range) -> None:
            for t in which:
                try:
                    convs[c] = chat.ask(owners[c], convs[c], bench_router.chat_turns(c, TURNS)[t - 1]).conv_id
                except LlmwebError as e:
                    failed.append(f"chat {c} turn {t}: {e}")

        def at_once(spans: dict[int, range]) -> None:
            threads = [threading.Thread(target=turns, args=(c, r)) for c, r in spans.items()]
            for th in threads:
                th.start()
            for th in threads:
                th.join(120)

        at_once({c: range(1, KILL_AT) for c in range(CHATS)})
        assert not failed, failed

        # chat 0's next reply: its replica is killed once the reply has begun to stream
        user = _hashed(convs[0] or "")
        home = _served_by(pairs, user)
        assert len(home) == 1, f"consistent hashing keeps a chat on one replica: {home}"
        victim = pairs[home[0]][0]
        t_kill, ended, error = 0.0, 0.0, None
        events = chat.send(owners[0], convs[0], "Tell me a long story about a lighthouse keeper and the sea.")
        try:
            for ev in events:
                if isinstance(ev, Delta) and not t_kill:
                    victim.proc.kill()  # SIGKILL, mid-stream
                    t_kill = time.perf_counter()
                if isinstance(ev, Finished):
                    break
        except LlmwebError as e:
            error = e
        ended = time.perf_counter()
        assert t_kill, "the reply never streamed"
        assert ended - t_kill < 10.0, f"the reply in flight took {ended - t_kill:.1f} s to end after the kill"
        print(f"the reply in flight ended {ended - t_kill:.2f} s after the kill: {error or 'answered'}")
        if error is not None:
            assert "engine server" in str(error) and ("lost mid-reply" in str(error) or "HTTP" in str(error)), error

        # the router's health check (every HEALTH_S s) takes the dead replica out, as before a person's next message
        router_view = Server(RemoteConfig(url=url, router=True))
        deadline = time.monotonic() + 15
        while router_view.replicas() != (1, 2) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert router_view.replicas() == (1, 2), "the router reports one of its two replicas answering"

        survivor = pairs[1 - home[0]][1]
        before = len(survivor.bodies)
        at_once({0: range(KILL_AT + 1, TURNS + 1), **{c: range(KILL_AT, TURNS + 1) for c in range(1, CHATS)}})
        assert not failed, f"turns after the kill that went unanswered: {failed}"
        later = survivor.bodies[before:]
        assert len(later) >= 2 + 3 * (TURNS - KILL_AT + 1), "every later turn went to the replica that answers"

        for c, conv in enumerate(convs):
            stored = chat.store.get(owners[c], conv or "").turns
            assert len(stored) == TURNS, f"chat {c} holds {len(stored)} of {TURNS} turns"
            assert all(t.assistant.strip() for t in stored[KILL_AT:]), f"chat {c}: an empty reply after the kill"
    finally:
        rt.close()
    carried = [b for _, proxy in pairs for b in proxy.bodies if "id_slot" in b or "cache_prompt" in b]
    slots = [(b.get("user"), b.get("id_slot")) for b in carried]
    assert not carried, (
        f"{len(carried)} requests through the router named a llama.cpp slot (user, id_slot): {slots[:4]}"
    )
    assert sum(len(proxy.bodies) for _, proxy in pairs) >= CHATS * TURNS, "the proxies saw the requests"
