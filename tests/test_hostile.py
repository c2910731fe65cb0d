"""Hostile input through the launched app (gradio_client, the real model as loaded by default, real SQLite):
empty and huge messages, odd characters, a flood of concurrent callers, a client that leaves
mid-stream, and bad uploads. Each gets a clear message or a normal answer; nothing hangs, the
engine never runs two generations at once, and nothing is written outside the data dir."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from gradio_client import Client
from gradio_client.exceptions import AppError

from llmweb.cli.main import GRADIO_QUEUE_SIZE
from llmweb.records import LOCAL_OWNER as LOCAL
from llmweb.retrieval.library import LOCAL_OWNER
from llmweb.runtime import Runtime
from llmweb.web.owner import owner_headers  # gradio_client as the owner: this machine's key
from llmweb.web.ui import build_app, launch_kwargs
from tests.conftest import make_settings

WAIT_S = 300  # generous: the CI machine has 2 cores and other suites may run at the same time


@contextmanager
def serve(runtime, **launch):
    """Launch the app as `llmweb serve` does (same queue size, launch options), on a free port."""
    demo = build_app(runtime)
    demo.queue(default_concurrency_limit=None, max_size=GRADIO_QUEUE_SIZE)
    kw = {**launch_kwargs(runtime.settings), "server_port": None, "quiet": True, "prevent_thread_lock": True}
    kw.update(launch)
    _app, url, _ = demo.launch(**kw)
    try:
        yield demo, url
    finally:
        demo.close()


def wait_for(predicate, timeout=WAIT_S, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def spy_handles(monkeypatch, engine) -> list:
    """Record every engine Handle the chat path submits (to check what happened to the request)."""
    handles, submit = [], engine.submit

    def spy(request):
        h = submit(request)
        handles.append(h)
        return h

    monkeypatch.setattr(engine, "submit", spy)
    return handles


@pytest.fixture(scope="module")
def short_app(tmp_path_factory, app_model):
    """Short replies and a small queue (4 waiting), as a busy small server would be set up."""
    settings = make_settings(tmp_path_factory.mktemp("hostile"), max_new_tokens=8, queue_size=4)
    runtime = Runtime(settings, loaded=app_model).start(background=False)
    with serve(runtime) as (_demo, url):
        yield runtime, url
    runtime.close()


@pytest.fixture(scope="module")
def long_app(tmp_path_factory, app_model):
    """Long replies, so a stream can be left mid-way."""
    settings = make_settings(tmp_path_factory.mktemp("hostile-long"), max_new_tokens=400)
    runtime = Runtime(settings, loaded=app_model).start(background=False)
    with serve(runtime) as (_demo, url):
        yield runtime, url
    runtime.close()


# ---- messages


@pytest.mark.parametrize("text", ["", "   ", " \n\t \r\n ", "\x00\x07\x1b"])
def test_empty_message_is_refused_clearly(short_app, text):
    runtime, url = short_app
    conv = runtime.store.create_conversation(LOCAL)
    client = Client(url, headers=owner_headers(runtime.settings), verbose=False)
    with pytest.raises(AppError, match="Your message is empty"):
        client.predict(text, conv, api_name="/chat")
    assert runtime.store.get(LOCAL, conv).turns == [], "nothing is recorded for a refused message"


def test_a_1_mb_paste_is_refused_with_the_numbers(short_app):
    runtime, url = short_app
    conv = runtime.store.create_conversation(LOCAL)
    client = Client(url, headers=owner_headers(runtime.settings), verbose=False)
    with pytest.raises(AppError, match=r"1,000,000 characters; the limit is 100,000"):
        client.predict("x" * 1_000_000, conv, api_name="/chat")
    # under the character limit but over the token cap: refused with both token counts, not cut
    with pytest.raises(AppError, match=r"Your message is [\d,]+ tokens; the limit is 1,024"):
        client.predict("word " * 5000, conv, api_name="/chat")
    assert runtime.store.get(LOCAL, conv).turns == []


def test_control_characters_emoji_and_rtl_get_a_normal_reply_and_round_trip(short_app):
    runtime, url = short_app
    conv = runtime.store.create_conversation(LOCAL)
    client = Client(url, headers=owner_headers(runtime.settings), verbose=False)
    emoji, hebrew, arabic = "👋🏽 🇫🇷 👩‍👩‍👧", "שלום עולם", "مرحبا بالعالم"
    text = f"\x00Hello\x07 {emoji}\x1b[0m {hebrew} \u202e{arabic}\u202c\x7f what is 2+2?\x0b"
    reply, _conv = client.predict(text, conv, api_name="/chat")
    assert isinstance(reply, str) and reply.strip(), "a normal reply"
    turn = runtime.store.get(LOCAL, conv).turns[-1]
    # control characters are removed; emoji, RTL text and bidi marks pass through unchanged
    expected = f"Hello {emoji}[0m {hebrew} \u202e{arabic}\u202c what is 2+2?"
    assert turn.user == expected
    assert turn.assistant == reply.strip()
    assert turn.stats.gen.finish_reason in ("eos", "length")
    stats = json.loads(client.predict(conv, api_name="/stats"))
    assert stats["generated_tokens"] >= 1
    assert stats == turn.stats.to_dict(), "the API gives the stored figures"


def test_lone_surrogates_are_replaced_not_fatal(short_app):
    """JSON over HTTP cannot carry a lone surrogate, so this one goes through the chat path directly."""
    runtime, _url = short_app
    conv = runtime.store.create_conversation(LOCAL)
    finished = runtime.chat.ask(LOCAL, conv, "abc\ud800def \U0001f600")
    assert finished.reply
    assert runtime.store.get(LOCAL, conv).turns[-1].user == "abc?def \U0001f600"


# ---- a flood of callers


def test_a_flood_of_50_callers_gets_answers_or_busy_and_nothing_hangs(short_app):
    runtime, url = short_app
    engine = runtime.engine
    served_before = engine.counters.served
    client = Client(url, headers=owner_headers(runtime.settings), verbose=False)
    outcomes: dict[int, tuple[str, str]] = {}
    start = threading.Barrier(50, timeout=WAIT_S)

    def caller(i):
        try:
            start.wait()
            outcomes[i] = ("answer", client.predict(f"Say the number {i}.", "", api_name="/chat")[0])
        except Exception as e:  # classified below
            outcomes[i] = (type(e).__name__, str(e))

    threads = [threading.Thread(target=caller, args=(i,), daemon=True) for i in range(50)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S)
    assert not any(t.is_alive() for t in threads), "a caller hung"
    assert len(outcomes) == 50
    answers = [v for kind, v in outcomes.values() if kind == "answer"]
    errors = [(kind, v) for kind, v in outcomes.values() if kind != "answer"]
    unclear = [(kind, v) for kind, v in errors if "busy" not in v.lower() and "queue is full" not in v.lower()]
    assert not unclear, f"every refusal says the server is busy: {unclear[:3]}"
    assert answers and all(isinstance(a, str) and a.strip() for a in answers)
    assert errors, "50 callers against a queue of 4 must meet a busy message"
    assert any("The model is busy" in v for _, v in errors), "the engine's own busy message reaches the caller"
    assert 1 <= engine.counters.max_active <= engine.limits.max_batch, "never more at once than the batch holds"
    assert engine.counters.served - served_before >= len(answers)
    wait_for(lambda: engine.counters.active == 0 and engine.queue_depth == 0, what="the queue to drain")
    # the server is still fine
    assert (
        Client(url, headers=owner_headers(runtime.settings), verbose=False)
        .predict("What is the capital of France?", "", api_name="/chat")[0]
        .strip()
    )


# ---- a client that leaves mid-stream


def _streams_then_is_cancelled(runtime, handles, conv, leave):
    """Start a long reply, `leave()` after 3 streamed pieces; the engine request must stop early."""
    engine = runtime.engine
    leave_after = 3
    leave()  # returns once it has seen `leave_after` pieces and left
    wait_for(lambda: handles and handles[0].stats is not None, what="the engine request to end")
    h = handles[0]
    assert h.stats.finish_reason == "cancelled"
    assert leave_after <= h.stats.generated_tokens < 400, "stopped soon after the client left"
    wait_for(lambda: engine.counters.active == 0, what="the worker to be free")
    turn = wait_for(lambda: (runtime.store.get(LOCAL, conv).turns or [None])[-1], what="the partial turn to be stored")
    assert turn.stats.gen.finish_reason == "cancelled"
    assert turn.assistant.strip(), "the partial reply is kept"
    # the worker serves the next request at once: nothing is ahead of it
    n = len(handles)
    conv2 = runtime.store.create_conversation(LOCAL)
    finished = runtime.chat.ask(LOCAL, conv2, "Say hi.")
    assert finished.stats.gen.finish_reason in ("eos", "length")
    assert len(handles) == n + 1


def test_client_cancel_mid_stream_stops_the_engine_request(long_app, monkeypatch):
    runtime, url = long_app
    handles = spy_handles(monkeypatch, runtime.engine)
    conv = runtime.store.create_conversation(LOCAL)
    client = Client(url, headers=owner_headers(runtime.settings), verbose=False)

    def leave():
        job = client.submit("Write a very long story about a dragon who learns to fly.", conv, api_name="/chat")
        wait_for(lambda: len(job.outputs()) >= 3, what="3 streamed pieces")
        job.cancel()

    _streams_then_is_cancelled(runtime, handles, conv, leave)


def test_dropped_http_connection_mid_stream_stops_the_engine_request(long_app, monkeypatch):
    """A raw SSE client (like a closed browser tab): read three pieces, then drop the connection."""
    runtime, url = long_app
    handles = spy_handles(monkeypatch, runtime.engine)
    conv = runtime.store.create_conversation(LOCAL)

    def leave():
        with httpx.Client(base_url=url, timeout=WAIT_S, headers=owner_headers(runtime.settings)) as http:
            r = http.post(
                "gradio_api/call/chat", json={"data": ["Write a very long story about a brave knight.", conv]}
            )
            r.raise_for_status()
            event_id = r.json()["event_id"]
            pieces = 0
            with http.stream("GET", f"gradio_api/call/chat/{event_id}") as stream:
                for line in stream.iter_lines():
                    if line.startswith("event: generating"):
                        pieces += 1
                        if pieces >= 3:
                            break  # leaving the block closes the connection
                    assert not line.startswith("event: error"), line

    _streams_then_is_cancelled(runtime, handles, conv, leave)


def test_a_caller_that_leaves_while_queued_never_runs(long_app, monkeypatch):
    """The chat stream says "queued" every half second, so whoever streams it (the UI's handler)
    gets the chance to notice its client left; closing it then withdraws the request unrun."""
    from llmweb.chat.session import Delta, Queued, Started

    runtime, _url = long_app
    # a batch of one: the dragon fills it, so the poem waits in the queue (with a bigger batch it
    # would join the dragon's batch at once)
    monkeypatch.setattr(runtime.engine, "limits", dataclasses.replace(runtime.engine.limits, max_batch=1))
    handles = spy_handles(monkeypatch, runtime.engine)
    busy = runtime.chat.send(LOCAL, runtime.store.create_conversation(LOCAL), "Write a very long story about a dragon.")
    next(ev for ev in busy if isinstance(ev, Delta))  # it runs
    waiting_conv = runtime.store.create_conversation(LOCAL)
    waiting = runtime.chat.send(LOCAL, waiting_conv, "Write a long poem about the sea.")
    assert isinstance(next(waiting), Started), "the turn says which conversation it is in first"
    queued = [next(waiting), next(waiting)]
    assert all(isinstance(ev, Queued) and ev.position == 1 for ev in queued), "repeated while it waits"
    waiting.close()  # its client left
    assert handles[1].cancelled and runtime.engine.queue_depth == 0, "its place in the queue is free at once"
    busy.close()
    wait_for(lambda: runtime.engine.counters.active == 0, what="the worker to be free")
    assert handles[1].stats is None, "it never ran: no prefill, no token"
    assert runtime.store.get(LOCAL, waiting_conv).turns == [], "nothing was generated, nothing is stored"


# ---- bad uploads


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            st = p.lstat()
            out[str(p.relative_to(root))] = (st.st_size, st.st_mtime_ns)
    return out


@pytest.mark.slow  # the real embedder
def test_bad_uploads_get_a_message_each_and_nothing_lands_outside_the_data_dir(tmp_path):
    data_dir = tmp_path / "srv" / "a" / "b" / "data"  # room for "../../" to climb inside tmp_path
    settings = make_settings(data_dir, max_file_mb=1)
    runtime = Runtime(settings)  # the document index needs no chat model
    uploads = tmp_path / "uploads"
    uploads.mkdir()

    def upload(name: str, data: bytes) -> Path:
        p = uploads / f"upload-{len(list(uploads.iterdir()))}"
        p.write_bytes(data)
        return p

    files = [
        (upload("binary", b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(range(256)) * 8), "photo.txt"),
        (upload("empty", b""), "empty.txt"),
        (upload("big", b"All work and no play makes Jack a dull boy.\n" * 40_000), "big.txt"),  # ~1.8 MB
        (upload("passwd", b"root:x:0:0:root:/root:/bin/bash\nThe llama sleeps in the barn.\n"), "../../etc/passwd.txt"),
        (upload("evil", b"# Evil\n\nThe abs file says the owl flies at night.\n"), "/abs/evil.md"),
        (upload("dots", b"hello"), ".."),
        (upload("exe", b"MZ\x90\x00"), "tool.exe"),
    ]
    before = _tree(tmp_path)
    reports = runtime.library.ingest_uploads(LOCAL_OWNER, files)
    after = _tree(tmp_path)

    assert len(reports) == len(files), "one report per file"
    by_given = {given: r for (_p, given), r in zip(files, reports)}
    expect = {
        "photo.txt": ("error", r"photo\.txt looks like a binary file"),
        "empty.txt": ("error", r"empty\.txt is empty"),
        "big.txt": ("error", r"big\.txt is 1\.\d MB; the limit is 1 MB"),
        "..": ("error", r"no usable name part"),
        "tool.exe": ("error", r"'\.exe' files are not supported"),
    }
    for given, (status, pattern) in expect.items():
        r = by_given[given]
        assert r.status == status, (given, r)
        assert re.search(pattern, r.describe()), (given, r.describe())
    # path-like names are reduced to their last part, never used as paths
    for given, safe in [("../../etc/passwd.txt", "passwd.txt"), ("/abs/evil.md", "evil.md")]:
        r = by_given[given]
        assert r.ok and r.name == safe and "/" not in r.name, r
        assert given in r.describe(), "the message says what the file was given as"
    assert {d.source for d in runtime.library.documents(LOCAL_OWNER)} == {"passwd.txt", "evil.md"}
    assert runtime.library.search(LOCAL_OWNER, "Where does the llama sleep?", k=1)[0].source == "passwd.txt"

    # nothing was written outside the data dir: not beside it, not above it, not at the absolute path
    changed = {p for p in after if before.get(p) != after[p]} | (before.keys() - after.keys())
    data_rel = str(data_dir.relative_to(tmp_path))
    outside = sorted(
        p
        for p in changed
        if p != data_rel and not p.startswith(data_rel + os.sep) and not data_rel.startswith(p + os.sep)
    )  # the data dir's own parents were created
    assert not outside, outside
    assert not Path("/abs").exists() and not Path("/etc/passwd.txt").exists()
    assert not (tmp_path / "srv" / "etc").exists() and not (tmp_path / "srv" / "a" / "etc").exists()
    for p in (uploads / n for n in os.listdir(uploads)):
        assert before[str(p.relative_to(tmp_path))] == after[str(p.relative_to(tmp_path))], "uploads are not touched"
    runtime.close()
