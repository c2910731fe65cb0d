"""Limits and cleanup in front of strangers: every Gradio event belongs to a concurrency
group whose limits add up to less than Gradio's thread pool, so waiting handlers (a streaming turn,
Stop waiting for the partial turn, a file being indexed) cannot hold every worker thread; Stop's wait
is bounded; export files and Gradio's upload copies do not stay; streamed text is escaped."""

from __future__ import annotations

import os
import threading
import time
from types import SimpleNamespace

import pytest

from llmweb.web.panels import chat as chat_panel
from llmweb.web.panels import transfer
from llmweb.web.panels.base import Panel
from llmweb.web.ui import CONCURRENCY, GRADIO_CACHE_TTL, GRADIO_THREADS, Handlers, build_app
from tests.web.test_ui import A_TOKEN, NOBODY, runtime  # noqa: F401 (a fixture)

HOSTILE = '"><img src=x onerror=alert(1)>'


def test_every_event_has_a_bounded_group_and_the_groups_leave_threads_free(runtime):  # noqa: F811
    demo = build_app(runtime)
    fns = [fn for fn in demo.fns.values() if fn.fn is not None]
    assert fns
    for fn in fns:
        assert fn.concurrency_id in CONCURRENCY, (fn.name, fn.concurrency_id)
        assert fn.concurrency_limit == CONCURRENCY[fn.concurrency_id], fn.name
    assert sum(CONCURRENCY.values()) < GRADIO_THREADS, "some thread always free for the page's quick events"
    group = {fn.name: fn.concurrency_id for fn in fns}
    assert group["respond"] == group["regenerate"] == group["api_chat"] == "generate"
    assert group["after_stop"] == "stop" and group["upload"] == group["import_chat"] == "files"
    assert group["delete_everything"] == group["export_json"] == "account", "never behind an upload"
    assert CONCURRENCY["stop"] < GRADIO_THREADS // 4
    assert demo.delete_cache == GRADIO_CACHE_TTL


def test_after_stop_waits_a_bounded_time(runtime, monkeypatch):  # noqa: F811
    """A stop whose partial turn never arrives returns after STOP_WAIT_S, not later."""
    h = Handlers(runtime)
    *_, final = h.chat.respond("Capital?", [], "", True, A_TOKEN, NOBODY)
    conv = Panel(*final[:-1]).conv_state
    monkeypatch.setattr(chat_panel, "STOP_WAIT_S", 0.3)
    history = [{"role": "user", "content": "Capital?"}] * 5  # asks for turns that never come
    t0 = time.monotonic()
    h.chat.after_stop(conv, history, A_TOKEN, NOBODY)
    assert time.monotonic() - t0 < 2.0
    assert chat_panel.STOP_WAIT_S <= 30


def test_streamed_messages_are_escaped(runtime):  # noqa: F811
    h = Handlers(runtime)
    for out in h.chat.respond(HOSTILE, [], "", True, A_TOKEN, NOBODY):
        texts = [m["content"] for m in out[1] if m["role"] == "user"]
        assert texts and all("<img" not in t for t in texts), texts


@pytest.fixture
def gradio_cache(tmp_path, monkeypatch):
    """Gradio's upload folder, here."""
    cache = tmp_path / "gradio"
    cache.mkdir()
    monkeypatch.setattr(transfer, "get_upload_folder", lambda: str(cache))
    return cache


def test_an_imported_file_is_deleted_once_read_even_when_refused(runtime, tmp_path, gradio_cache):  # noqa: F811
    h = Handlers(runtime)
    bad = gradio_cache / "a1b2" / "bad.json"
    bad.parent.mkdir()
    bad.write_text('{"format": "llmweb.conversation", "version": 1, "onerror": 1}')
    elsewhere = tmp_path / "mine.json"  # not Gradio's: never deleted
    elsewhere.write_text("{}")
    for path in (bad, elsewhere):
        with pytest.raises(Exception, match="onerror|not an llmweb"):
            h.transfer.import_chat(str(path), A_TOKEN, NOBODY)
    assert not bad.exists() and not bad.parent.exists() and gradio_cache.is_dir()
    assert elsewhere.exists()


def test_exports_expire_and_go_with_delete_all(runtime, tmp_path, monkeypatch, gradio_cache):  # noqa: F811
    monkeypatch.setattr(transfer, "EXPORTS", tmp_path / "exports")
    h = Handlers(runtime)
    *_, final = h.chat.respond("Capital?", [], "", True, A_TOKEN, NOBODY)
    conv = Panel(*final[:-1]).conv_state
    path = transfer.Path(h.transfer.export_json(conv, A_TOKEN, NOBODY))
    assert path.is_file() and path.parent.parent == tmp_path / "exports"
    assert A_TOKEN not in str(path), "the folder is a hash of the owner"
    assert transfer.sweep_exports(now=time.time()) == 0, "fresh: kept"
    assert transfer.sweep_exports(now=time.time() + transfer.EXPORT_TTL_S + 1) == 1 and not path.exists()
    stale = transfer.Path(h.transfer.export_json(conv, A_TOKEN, NOBODY))
    old = time.time() - transfer.EXPORT_TTL_S - 1
    os.utime(stale, (old, old))
    h.account.visit(A_TOKEN, conv, NOBODY)  # any page load sweeps
    assert not stale.exists()

    path = transfer.Path(h.transfer.export_md(conv, A_TOKEN, NOBODY))
    copy = gradio_cache / transfer.hash_file(path) / path.name  # where Gradio keeps its copy of the download
    copy.parent.mkdir(parents=True)
    copy.write_bytes(path.read_bytes())
    h.account.delete_everything(A_TOKEN, NOBODY)
    assert not path.exists() and not path.parent.exists() and not copy.exists()


def test_uploaded_documents_are_deleted_once_indexed(runtime, gradio_cache):  # noqa: F811
    seen = []
    runtime.library.ingest_uploads = lambda owner, files, progress=None, room=None: seen.extend(files) or []
    up = gradio_cache / "abc" / "notes.txt"
    up.parent.mkdir(parents=True)
    up.write_text("hello")
    Handlers(runtime).docs.upload([str(up)], "", A_TOKEN, NOBODY, progress=lambda *a, **k: None)
    assert seen and not up.exists() and not up.parent.exists()


def test_request_bodies_are_capped_in_front_of_gradios_routes(tmp_path):
    """A real server (as `serve` launches it): a declared or a streamed body over LLMWEB_WEB_MAX_BODY_KB
    is refused with 413 before Gradio's route parses it; uploads and /v1 keep their own, larger caps."""
    import httpx

    from llmweb.cli.main import launch_app
    from llmweb.runtime import Runtime
    from tests.conftest import make_settings

    served = Runtime(make_settings(tmp_path / "app", web_max_body_kb=64))  # never started: no model
    demo, url = launch_app(served, server_port=None, quiet=True, prevent_thread_lock=True)
    try:
        http = httpx.Client(base_url=url.rstrip("/"), timeout=30, trust_env=False)
        big = b'{"data": ["' + b"x" * (1 << 20) + b'"], "fn_index": 0, "session_hash": "s"}'
        join = "/gradio_api/queue/join"
        declared = http.post(join, content=big, headers={"content-type": "application/json"})
        assert declared.status_code == 413, declared.text[:200]

        def chunks():
            for _ in range(64):
                yield b"x" * 16384  # 1 MiB, no Content-Length: chunked

        streamed = http.post(join, content=chunks(), headers={"content-type": "application/json"})
        assert streamed.status_code == 413, streamed.text[:200]
        small = http.post(join, json={"data": [], "fn_index": 0, "session_hash": "s"})
        assert small.status_code != 413
        upload = http.post("/gradio_api/upload", files={"files": ("a.txt", b"y" * (200 << 10), "text/plain")})
        assert upload.status_code == 200, upload.text[:200]
        api = http.post("/v1/chat/completions", content=b'{"x": "' + b"z" * (100 << 10) + b'"}')
        assert api.status_code != 413 or "api" in api.text.lower(), "/v1 has its own limit (2 MB here)"
        assert http.get("/gradio_api/info").status_code == 200, "the server still answers"
    finally:
        demo.close()
        served.store.close()


def test_exports_are_private_to_this_process_and_owner(runtime, gradio_cache):  # noqa: F811
    """A fixed /tmp/llmweb-exports let another local user plant the folder or read the files;
    now the root is the process's own mkdtemp folder, each owner's folder 0700, each file 0600."""
    import stat
    import tempfile

    h = Handlers(runtime)
    *_, final = h.chat.respond("Capital?", [], "", True, A_TOKEN, NOBODY)
    path = transfer.Path(h.transfer.export_json(Panel(*final[:-1]).conv_state, A_TOKEN, NOBODY))
    root = path.parent.parent
    assert root != transfer.Path(tempfile.gettempdir()) / "llmweb-exports" and root.name.startswith("llmweb-exports-")
    for p, mode in ((root, 0o700), (path.parent, 0o700), (path, 0o600)):
        assert stat.S_IMODE(p.stat().st_mode) == mode, (p, oct(p.stat().st_mode))
    h.account.delete_everything(A_TOKEN, NOBODY)


def test_one_visitors_long_upload_holds_one_place_and_never_anothers_actions(runtime, gradio_cache):  # noqa: F811
    """Visitor A's upload is being read (held here): A's second upload, import and "Delete all my
    data" are refused at once (one place of a group at most, never a thread waiting behind it), while
    visitor B uploads and deletes their data without waiting."""
    from tests.web.test_ui import B_TOKEN

    reading, release = threading.Event(), threading.Event()
    owners: list[str] = []

    def ingest(owner, files, progress=None, room=None):
        owners.append(owner)
        if len(owners) == 1:
            reading.set()
            assert release.wait(10), "the test never released the first upload"
        return []

    runtime.library = SimpleNamespace(ingest_uploads=ingest, documents=lambda *a: [], scope=lambda *a: frozenset())
    h = Handlers(runtime)

    def upload(token: str, name: str):
        path = gradio_cache / f"{name}-{token[:6]}" / name
        path.parent.mkdir()
        path.write_text("hello")
        return h.docs.upload([str(path)], "", token, NOBODY, progress=lambda *a, **k: None)

    export = gradio_cache / "chat.json"
    export.write_text("{}")
    first = threading.Thread(target=upload, args=(A_TOKEN, "one.txt"))
    first.start()
    try:
        assert reading.wait(10)
        for action in (
            lambda: upload(A_TOKEN, "two.txt"),
            lambda: h.transfer.import_chat(str(export), A_TOKEN, NOBODY),
            lambda: h.account.delete_everything(A_TOKEN, NOBODY),
        ):
            started = time.monotonic()
            with pytest.raises(Exception, match="Your upload is still running"):
                action()
            assert time.monotonic() - started < 1.0, "refused at once, not queued behind the upload"
        started = time.monotonic()
        upload(B_TOKEN, "theirs.txt")
        h.account.delete_everything(B_TOKEN, NOBODY)
        assert time.monotonic() - started < 2.0, "another visitor never waits for A's upload"
    finally:
        release.set()
        first.join(10)
    assert len(owners) == 2, "A's second upload never reached the library"
    upload(A_TOKEN, "three.txt")  # A's slot is free again
