"""The runtime's jobs apart from the model: the secret file, retention, the status line, the remote
health watch and sample seeding, each over fakes (no model, milliseconds)."""

from __future__ import annotations

import stat
import threading
from types import SimpleNamespace

from llmweb.runtime import Runtime
from llmweb.runtime.health import RemoteHealth
from llmweb.runtime.retention import ANON_PREFIXES, Retention
from llmweb.runtime.samples import SAMPLE_MARKER, seed_sample
from llmweb.runtime.secret import read_or_create_secret
from llmweb.runtime.status import StatusLine
from tests.conftest import make_settings


def test_the_secret_is_created_once_private_and_read_back(tmp_path):
    path = tmp_path / "data" / "secret"
    first = read_or_create_secret(path)
    assert len(first) == 64 and int(first, 16) >= 0
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert read_or_create_secret(path) == first, "a restart keeps the key, so visitors keep their chats"
    same = Runtime(make_settings(tmp_path / "data"))
    try:
        assert same.secret == first
    finally:
        same.close()
    rt = Runtime(make_settings(tmp_path / "other", secret="from-the-environment"))
    try:
        assert rt.secret == "from-the-environment" and not (tmp_path / "other" / "secret").exists()
    finally:
        rt.close()


class PurgingChat:
    def __init__(self):
        self.calls = []

    def purge_idle(self, prefixes, idle_s, now=None):
        self.calls.append((prefixes, idle_s, now))
        return 2, 3


def test_retention_purges_only_anonymous_owners_and_only_when_on_and_ready(tmp_path):
    chat = PurgingChat()
    on = make_settings(tmp_path, anon_retention_days=30)
    assert Retention(on, lambda: None).purge_idle() == (0, 0), "not ready: nothing"
    assert (
        Retention(make_settings(tmp_path, anon_retention_days=0), lambda: chat).purge_idle() == (0, 0)
        and not chat.calls
    ), "off"
    assert Retention(on, lambda: chat).purge_idle(now=5.0) == (2, 3)
    assert chat.calls == [(ANON_PREFIXES, 30 * 86400, 5.0)] and ANON_PREFIXES == ("anon:", "api:")


def test_the_retention_loop_waits_for_ready_and_ends_at_close(tmp_path):
    chat, ready, closing = PurgingChat(), threading.Event(), threading.Event()
    Retention(make_settings(tmp_path, anon_retention_days=1), lambda: chat).start(ready, closing)
    assert not chat.calls
    ready.set()
    for _ in range(200):
        if chat.calls:
            break
        threading.Event().wait(0.01)
    closing.set()
    assert len(chat.calls) == 1


class FakeServer:
    def __init__(self, why=None, router=False, replicas=None):
        self.why, self.model = why, "fake-model"
        self.config = SimpleNamespace(router=router)
        self._replicas = replicas

    def reachable(self):
        return self.why

    def replicas(self):
        return self._replicas


def test_the_health_watch_words_the_status_line_up_down_and_answering_badly():
    status = StatusLine()
    up = SimpleNamespace(server=FakeServer(), probe=lambda: SimpleNamespace(ids=True))
    assert RemoteHealth(up, "http://x", status, "started in 1 s", retry_s=5).check()
    assert status.text == "Ready: remote engine · model fake-model · reachable · token-id prompts · started in 1 s."
    down = SimpleNamespace(server=FakeServer("connection refused"), probe=lambda: None)
    assert not RemoteHealth(down, "http://x", status, "", retry_s=5).check()
    assert "not reachable (connection refused); retrying every 5 s" in status.text

    def refuse():
        raise PermissionError("wrong key")

    bad = SimpleNamespace(server=FakeServer(), probe=refuse)
    assert not RemoteHealth(bad, "http://x", status, "", retry_s=5).check()
    assert "not reachable (PermissionError: wrong key)" in status.text


def test_behind_a_router_the_status_line_counts_the_replicas_where_the_router_says():
    status = StatusLine()
    ids = SimpleNamespace(ids=True)
    counted = SimpleNamespace(server=FakeServer(router=True, replicas=(1, 2)), probe=lambda: ids)
    assert RemoteHealth(counted, "http://x", status, "started in 1 s", retry_s=5).check()
    assert "reachable · 1 of 2 replicas answer · token-id prompts" in status.text
    silent = SimpleNamespace(server=FakeServer(router=True), probe=lambda: ids)  # nginx: reports nothing
    assert RemoteHealth(silent, "http://x", status, "started in 1 s", retry_s=5).check()
    assert "reachable · behind a router · token-id prompts" in status.text


def test_the_status_line_never_shows_the_engine_address():
    """LLMWEB_ENGINE_URL may be a private host or carry a key: the page says "remote engine"."""
    url = "http://user:key@10.1.2.3:8000/v1"
    status = StatusLine()
    status.remote_up(url, "qwen", True, "started in 1 s")
    assert "10.1.2.3" not in status.text and "key" not in status.text and "model qwen" in status.text
    why = "ConnectionError: HTTPConnectionPool(host='10.1.2.3', port=8000): refused by user:key@10.1.2.3:8000"
    status.remote_down(url, why, 5)
    assert "10.1.2.3" not in status.text and "user:key" not in status.text and "refused" in status.text


def test_a_failed_start_shows_no_file_paths():
    status = StatusLine()
    status.failed("Model failed to load", FileNotFoundError("[Errno 2] No such file: '/srv/llmweb/models/x.gguf'"))
    assert status.text == "Model failed to load: [Errno 2] No such file: '…'"
    status.failed("Model failed to load", OSError(r"cannot open C:\\models\\x and ~/cache/y; 1/2 done"))
    assert "models" not in status.text and "cache" not in status.text and "1/2 done" in status.text


def test_the_status_line_shows_progress_and_failures():
    status = StatusLine()
    assert status.text == "Starting…"
    status.progress("Loading…")
    assert status.text == "Loading…"
    status.failed("Model failed to load", RuntimeError("no disk"))
    assert status.text == "Model failed to load: no disk"


def test_the_sample_guide_is_seeded_once(tmp_path):
    ingested, said = [], []
    library = SimpleNamespace(ingest_shared=lambda paths: ingested.append(paths) or [])
    settings = make_settings(tmp_path)
    seed_sample(settings, library, said.append)
    seed_sample(settings, library, said.append)
    assert len(ingested) == 1 and said == ["Indexing the sample user guide…"]
    assert (tmp_path / "index" / SAMPLE_MARKER).is_file()


def test_only_a_single_user_installs_owner_is_exempt_from_the_per_owner_queue_cap(tmp_path):
    from llmweb.records import LOCAL_OWNER
    from llmweb.runtime.engines import uncapped_owner

    assert uncapped_owner(make_settings(tmp_path)) == LOCAL_OWNER, "loopback, no login: one person's install"
    assert uncapped_owner(make_settings(tmp_path, single_user="1", host="0.0.0.0")) == LOCAL_OWNER
    assert uncapped_owner(make_settings(tmp_path, host="0.0.0.0")) == "", "others reach it: every cap holds"
    assert uncapped_owner(make_settings(tmp_path, auth="alice:secret-pass-1")) == "", "login: accounts are apart"
    assert uncapped_owner(make_settings(tmp_path, single_user="0")) == ""
