"""The remote engine against a REAL server: `transformers serve` with the embedded SmolLM2 on CPU.

One server process for the whole module (starting it loads the model: ~10 s). It takes text
prompts only and refuses unknown fields (docs/architecture.md), so this also proves the probe's fallback to
text and to plain OpenAI fields. The last test kills the server mid-reply, so it runs last.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from llmweb.chat.session import Delta, Started
from llmweb.errors import LlmwebError
from tests.conftest import make_settings

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
SERVE = Path(sys.executable).with_name("transformers")
SCRIPT = [
    "Hi, my name is Ada.",
    "What is the capital of France?",
    "Name a colour.",
    "What is 2+2?",
    "Tell me a fruit.",
    "What is my name?",
    "Say something short.",
    "Name an animal.",
    "What day comes after Monday?",
    "Thanks, bye.",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def serve(tmp_path_factory):
    """(url, process) of one `transformers serve` for the module; the kill test may end it early."""
    from llmweb.runtime import tokenizer_dir

    model_dir = tokenizer_dir(make_settings(tmp_path_factory.mktemp("serve")), print)  # the converted copy
    port = _free_port()
    log = tmp_path_factory.mktemp("serve-log") / "serve.log"
    cmd = [str(SERVE), "serve", str(model_dir), "--device", "cpu", "--host", "127.0.0.1", "--port", str(port)]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    break
        except OSError:
            pass
        assert proc.poll() is None, f"transformers serve exited: {log.read_text()[-2000:]}"
        assert time.monotonic() < deadline, "transformers serve did not come up in 120 s"
        time.sleep(0.5)
    yield url, proc
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)


def test_replay_of_10_turns_through_transformers_serve_has_the_local_engines_json_keys(serve, fp32_model, tmp_path):
    from llmweb.cli.main import replay
    from llmweb.runtime import Runtime

    url, _ = serve
    script = tmp_path / "script.jsonl"
    script.write_text("".join(json.dumps({"user": u}) + "\n" for u in SCRIPT))
    env = {
        **os.environ,
        "LLMWEB_ENGINE_URL": url,
        "LLMWEB_DATA_DIR": str(tmp_path / "remote"),
        "LLMWEB_CACHE_DIR": str(REPO / "data" / "models"),
        "LLMWEB_SAMPLE_DOCS": "0",
        "LLMWEB_MAX_NEW_TOKENS": "16",
    }
    done = subprocess.run(
        [sys.executable, "-m", "llmweb", "replay", str(script), "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in done.stdout.splitlines()]
    assert [r["turn"] for r in rows] == list(range(1, 11)) and not any("error" in r for r in rows)
    assert all(r["generated_tokens"] > 0 and r["reply"] for r in rows)
    assert all(r["reuse_reported"] is False for r in rows), "transformers serve reports no cached tokens"
    assert all("cuda_allocated_bytes" not in r["mem"] for r in rows), "no device figures invented"
    rss_line = next(line for line in done.stderr.splitlines() if "process RSS" in line)
    print(f"\nremote replay, 10 turns: {rss_line}")

    # the local engine's row for the same first message: the same keys
    rt = Runtime(make_settings(tmp_path / "local", max_new_tokens=16), loaded=fp32_model).start(background=False)
    try:
        local = next(replay(rt, SCRIPT[:1]))
    finally:
        rt.close()
    assert set(rows[0]) == set(local)


def test_killing_the_server_mid_reply_keeps_the_partial_reply_with_a_clear_error(serve, tmp_path):
    from llmweb.engine.server import RemoteError
    from llmweb.runtime import Runtime

    url, proc = serve
    settings = make_settings(tmp_path, engine_url=url, max_new_tokens=200, summaries=False)
    rt = Runtime(settings).start(background=False)
    try:
        chat = rt.wait_ready()
        assert "reachable · text prompts" in rt.status, "transformers serve refuses token-id prompts: probed at start"
        conv_id, shown = None, ""
        events = chat.send("local", None, "Write a long story about a lighthouse keeper and the sea.")
        with pytest.raises(LlmwebError) as failed:
            for event in events:
                if isinstance(event, Started):
                    conv_id = event.conv_id
                elif isinstance(event, Delta):
                    shown = event.text
                    if len(shown) > 20 and proc.poll() is None:
                        os.killpg(proc.pid, signal.SIGKILL)  # the server dies mid-reply
        assert isinstance(failed.value, RemoteError) and "lost mid-reply" in str(failed.value)
        proc.wait(timeout=10)
        assert conv_id is not None and len(shown) > 20
        turn = rt.store.get("local", conv_id).turns[-1]
        assert turn.assistant and shown.strip().startswith(turn.assistant[:20]), "the partial reply is kept"
        assert "not reachable" in str(_next_error(chat)), "later messages say the server is gone"
    finally:
        rt.close()


def _next_error(chat) -> LlmwebError:
    try:
        chat.ask("local", None, "Still there?")
    except LlmwebError as e:
        return e
    raise AssertionError("a message to a dead server succeeded")
