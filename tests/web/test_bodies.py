"""Request bodies and client addresses against a real server (launched as `serve` launches it, on a free
port, with no model: every answer here comes before a chat would run). One anonymous client must not
freeze the event loop with a body, make Gradio echo its input, be parsed before the login check, count
as many addresses from one IPv6 /64, fill Gradio's upload cache, or reach routes llmweb does not use.
Each attack runs while a probe asks for a trivial page, which must keep answering within 0.5 s."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import httpx
import pytest
from gradio_client.exceptions import AppError

from llmweb.cli.main import launch_app
from llmweb.runtime import Runtime
from llmweb.web import accounts
from llmweb.web.accounts import Scrypt, new_record, save_users
from tests.conftest import make_settings
from tests.web.test_trust_app import event

QUICK_S = 0.5  # the longest a trivial request may wait while an attack runs
JOIN = "/gradio_api/queue/join"


@contextlib.contextmanager
def served(tmp_path, **kw):
    runtime = Runtime(make_settings(tmp_path, **kw))  # never started: no model
    demo, url = launch_app(runtime, server_port=None, quiet=True, prevent_thread_lock=True)
    try:
        yield demo, url.rstrip("/")
    finally:
        demo.close()
        runtime.store.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A multi-user server behind a proxy on this machine (so X-Forwarded-For names the client)."""
    with served(tmp_path_factory.mktemp("bodies"), single_user="0", trusted_proxies="127.0.0.1") as s:
        yield s


class Probe:
    """Asks for `path` over and over in a thread; `worst` is the slowest answer seen."""

    def __init__(self, url: str, path: str = "/config"):
        self.http = httpx.Client(base_url=url, timeout=30, trust_env=False)
        self.path, self.times, self._stop = path, [], threading.Event()
        self.http.get(path)  # warm: the first answer builds the config
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.monotonic()
            assert self.http.get(self.path).status_code == 200
            self.times.append(time.monotonic() - t0)
            time.sleep(0.02)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self.thread.join(timeout=60)

    @property
    def worst(self) -> float:
        return max(self.times)


def json_list(size: int) -> bytes:
    """A JSON list of `size` bytes: `[1,1,1,...]`, where Gradio expects an object."""
    n = (size - 2) // 2
    return b"[" + b",".join([b"1"] * n) + b"]"


def post_raw(url: str, path: str, body: bytes, headers: dict[str, str] | None = None, timeout: float = 120.0):
    """POST over a raw socket: (status, response bytes, seconds). The server may answer and close before
    the whole body is sent; what it said is still read."""
    host, port = url.removeprefix("http://").split(":")
    head = [f"POST {path} HTTP/1.1", f"Host: {host}:{port}", f"Content-Length: {len(body)}", "Connection: close"]
    head += [f"{k}: {v}" for k, v in {"Content-Type": "application/json", **(headers or {})}.items()]
    t0 = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        s.sendall(("\r\n".join(head) + "\r\n\r\n").encode())
        with contextlib.suppress(OSError):  # refused early: the server stopped reading
            s.sendall(body)
        data = b""
        with contextlib.suppress(OSError):
            while chunk := s.recv(65536):
                data += chunk
    return int(data.split(b" ", 2)[1]) if data else 0, data, time.monotonic() - t0


def test_a_json_list_to_the_queue_is_refused_at_once_and_short(server):
    """A JSON list where Gradio expects an object: Gradio validated it item by item on the event loop and
    its 422 echoed the whole input (3.9 MB held every other request ~5 s). Now a short 4xx before any
    parse: over the cap (LLMWEB_WEB_MAX_BODY_KB, 2 MB) by its Content-Length, under it by its first byte."""
    _demo, url = server
    for size, refusal in ((3_900_000, 413), (1_900_000, 400)):
        body = json_list(size)  # built first: the server shares this process (and its GIL)
        with Probe(url) as probe:
            status, answer, took = post_raw(url, JOIN, body)
        assert status == refusal, answer[:300]
        assert len(answer) < 2000, f"a short answer, not the input echoed ({len(answer)} bytes)"
        assert took < 2.0 and probe.worst < QUICK_S, (size, took, probe.worst)


def test_a_48_mb_list_to_an_api_route_named_upload_is_refused_before_it_is_read(server):
    """`/gradio_api/call/{name}` takes any name: a route named "upload" is not the upload route and gets
    the page's JSON cap (LLMWEB_WEB_MAX_BODY_KB), not the uploads' 51 MB."""
    _demo, url = server
    body = json_list(48_000_000)
    with Probe(url) as probe:
        status, answer, took = post_raw(url, "/gradio_api/call/upload", body)
    assert status == 413, answer[:300]
    assert took < 5.0 and probe.worst < QUICK_S, (took, probe.worst)


def test_a_streamed_list_is_refused_too(server):
    """No Content-Length (chunked): the body is counted as it comes and refused at the cap."""
    _demo, url = server
    http = httpx.Client(base_url=url, timeout=60, trust_env=False)

    def chunks():
        yield b"["
        for _ in range(300):
            yield b"1," * 8192  # ~4.9 MB in all

    with Probe(url) as probe:
        r = http.post(JOIN, content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code in (400, 413) and len(r.content) < 2000, r.text[:300]
    assert probe.worst < QUICK_S, probe.worst


def test_a_422_never_echoes_the_input(server):
    """An object of the wrong shape: Gradio's 422 named each error with the value it got, and an event
    with too few values failed with an error (logged, and shown to the visitor) that quoted them."""
    _demo, url = server
    http = httpx.Client(base_url=url, timeout=60, trust_env=False)
    marker = "echo-me-" * 20_000
    respond = next(i for i, fn in _demo.fns.items() if fn.name == "respond")
    for body in (
        {"data": marker, "fn_index": 0, "session_hash": "s"},
        {"data": [], "fn_index": [marker]},
        {"data": [marker], "fn_index": respond, "session_hash": "s"},  # too few values: Gradio quoted them all
    ):
        r = http.post(JOIN, json=body)
        assert r.status_code == 422, r.text[:300]
        assert "echo-me" not in r.text and len(r.content) < 2000, r.text[:300]


def test_a_page_event_still_runs(server):
    """The page's own events (a JSON object under the cap) and the API's calls by name are untouched."""
    demo, url = server
    http = httpx.Client(base_url=url, timeout=60, trust_env=False, headers={"X-Forwarded-For": "203.0.113.77"})
    token, *_ = event(http, demo, "visit", ["", ""])
    assert len(token) == 32
    called = http.post("/gradio_api/call/stats", json={"data": ["no-such-conversation"]})  # as curl calls the API
    assert called.status_code == 200 and "event_id" in called.json(), called.text[:200]


def test_routes_llmweb_does_not_use_are_closed(server):
    demo, url = server
    assert not any(getattr(b, "server_fns", None) for b in demo.blocks.values()), "no component server is used"
    http = httpx.Client(base_url=url, timeout=60, trust_env=False)
    recording = http.post("/gradio_api/process_recording", files={"files": ("a.wav", b"RIFF" + b"0" * 1000)})
    assert recording.status_code == 404, recording.text[:200]
    for path in ("/gradio_api/stream/abc", "/gradio_api/run-history/connect", "/gradio_api/vibe-edit"):
        assert http.post(path, json={}).status_code == 404, path
    assert http.post("/gradio_api/upload", files={"files": ("a.txt", b"hello")}).status_code == 200, "used: open"


def test_login_is_checked_before_the_body_is_read(tmp_path, monkeypatch):
    """With login on, a body from a client without a session is refused as soon as its headers arrive:
    the server does not wait for (or parse) 3.9 MB first."""
    monkeypatch.setattr(accounts, "DEFAULT_SCRYPT", Scrypt(n=16, r=1, p=1))
    users = tmp_path / "users.json"
    save_users(users, {"alice": new_record("alice", "Tr0ub4dor&3-horse")})
    with served(tmp_path / "app", auth_file=users) as (_demo, url):
        host, port = url.removeprefix("http://").split(":")
        for path in (JOIN, "/gradio_api/upload", "/gradio_api/call/chat"):
            with socket.create_connection((host, int(port)), timeout=10) as s:
                head = f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Length: 3900000\r\n"
                s.sendall(f"{head}Content-Type: application/json\r\n\r\n".encode() + b"[1,1,1")  # and no more
                s.settimeout(3)
                try:
                    answer = s.recv(4096)
                except TimeoutError:
                    pytest.fail(f"{path}: the server waited for the body before checking the login")
            assert answer.startswith(b"HTTP/1.1 401"), (path, answer[:200])


def test_one_ipv6_64_counts_as_one_address(server):
    """500 addresses of one /64 (what one home line or VPS gets) are one client for the per-address
    limit of new anonymous visitors (LLMWEB_ANON_PER_ADDRESS, 20 here); a visitor from another /64 is
    not affected by them."""
    demo, url = server

    def visit(address: str) -> str:
        http = httpx.Client(base_url=url, timeout=60, trust_env=False, headers={"X-Forwarded-For": address})
        token, *_ = event(http, demo, "visit", ["", ""])
        return token

    admitted = 0
    with pytest.raises(AppError, match="Too many new visitors"):
        for n in range(500):
            visit(f"2001:db8:aa:1:{n // 256:x}:{n % 256:x}::1")
            admitted += 1
    assert admitted == 20
    assert len(visit("2001:db8:aa:2::1")) == 32, "another /64: another client"
    with pytest.raises(AppError, match="Too many new visitors"):
        visit("2001:db8:aa:1:ffff:ffff:ffff:ffff")


def test_uploads_are_capped_per_address(tmp_path):
    """Gradio keeps uploaded files in its cache until it cleans it: one address may send at most
    LLMWEB_UPLOAD_PER_ADDRESS_MB within the cache's lifetime; another address is not affected."""
    with served(tmp_path, single_user="0", trusted_proxies="127.0.0.1", upload_per_address_mb=1) as (_demo, url):

        def upload(address: str) -> httpx.Response:
            http = httpx.Client(base_url=url, timeout=60, trust_env=False, headers={"X-Forwarded-For": address})
            return http.post("/gradio_api/upload", files={"files": ("a.txt", b"y" * (600 << 10), "text/plain")})

        assert upload("203.0.113.5").status_code == 200
        refused = upload("203.0.113.5")
        assert refused.status_code == 429 and "retry-after" in refused.headers, refused.text[:200]
        assert upload("198.51.100.5").status_code == 200, "another address: its own budget"
        assert upload("2001:db8:bb:1::1").status_code == 200
        assert upload("2001:db8:bb:1::2").status_code == 429, "the same /64"


# ---- the pieces, without a server


def test_address_groups(tmp_path):
    from llmweb.web.trust import address_group

    assert address_group("2001:db8:1:2:3:4:5:6", 64) == "2001:db8:1:2::/64"
    assert address_group("2001:db8:1:2:3:4:5:6", 48) == "2001:db8:1::/48"
    assert address_group("::ffff:203.0.113.9", 64) == "203.0.113.9", "IPv4-mapped: the IPv4 address"
    assert address_group("203.0.113.9", 64) == "203.0.113.9"
    assert address_group("", 64) == "" and address_group("not-an-ip", 64) == "not-an-ip"
    with pytest.raises(Exception, match="LLMWEB_IPV6_PREFIX"):
        make_settings(tmp_path, ipv6_prefix=0)


def test_the_upload_route_is_matched_exactly(tmp_path):
    from llmweb.web.body_cap import SMALL_BYTES, BodyCap

    cap = BodyCap(None, make_settings(tmp_path, web_max_body_kb=64, user_docs_mb=5), upload_window_s=720)
    assert cap.rule("/gradio_api/upload").upload and cap.rule("/gradio_api/upload/").upload
    for named_upload in ("/gradio_api/call/upload", "/gradio_api/run/upload", "/x/upload", "/gradio_api/api/upload"):
        assert not cap.rule(named_upload).upload and cap.cap(named_upload) <= 64 << 10, named_upload
    assert cap.rule("/gradio_api/queue/join").json and cap.cap("/gradio_api/queue/join") == 64 << 10
    assert cap.cap("/gradio_api/cancel") == cap.cap("/login") == cap.cap("/anything/else") == SMALL_BYTES
    assert cap.cap("/v1/chat/completions") is None, "/v1 has its own limit"
    assert cap.rule("/gradio_api/process_recording").closed and cap.rule("/gradio_api/stream/e1/close").closed


def test_the_upload_budget_falls_on_the_address_that_spends_it():
    from llmweb.web.body_cap import UploadBudget

    now = [0.0]
    budget = UploadBudget(limit=100, window_s=60, clock=lambda: now[0])
    assert budget.charge("a", 60) == 0 and budget.charge("b", 100) == 0
    now[0] = 10
    assert budget.charge("a", 60) == pytest.approx(50), "until the first 60 bytes leave the window"
    assert budget.charge("a", 40) == 0, "a refused upload is not counted"
    now[0] = 61
    assert budget.charge("a", 60) == 0


def test_a_body_must_be_one_bounded_json_object():
    from llmweb.web.json_body import BodyError, load_object

    assert load_object(b' {"data": [1, 2], "fn_index": 0}') == {"data": [1, 2], "fn_index": 0}
    for bad in (b"[1, 2]", b'"x"', b"1", b"{not json", b"\xff{", b"{" * 100_000 + b"}" * 100_000):
        with pytest.raises(BodyError):
            load_object(bad)
    with pytest.raises(BodyError, match="more than 1,000") as e:
        load_object(b'{"data": [' + b",".join([b"1"] * 2000) + b"]}", max_elements=1000)
    assert e.value.status == 413
