"""The command line as a user runs it: replay, ingest, search (subprocesses, real model and embedder)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from llmweb.cli.main import replay_line
from tests.conftest import MODEL_CACHE, REPO

KEYS = {
    "turn",
    "prompt_tokens",
    "generated_tokens",
    "ttft_s",
    "decode_tok_s",
    "total_s",
    "reply",
    "mem",
    "sections",
    "dropped_turns",
    "summarized_turns",
    "summary_tokens",
    "reused_tokens",
    "prefilled_tokens",
    "kv_session_bytes",
    "kv_store_bytes",
}


def run_cli(tmp_path, *args, **env):
    full_env = {
        **os.environ,
        "LLMWEB_DATA_DIR": str(tmp_path / "data"),
        "LLMWEB_CACHE_DIR": str(MODEL_CACHE),
        "LLMWEB_SAMPLE_DOCS": "0",
        **env,
    }
    return subprocess.run(
        [sys.executable, "-m", "llmweb", *args], cwd=REPO, env=full_env, capture_output=True, text=True, timeout=900
    )


@pytest.mark.slow  # loads the real model in a subprocess
def test_replay_prints_one_json_object_per_turn(tmp_path):
    script = tmp_path / "chat.jsonl"
    questions = [f"Question {i}: name a country in Europe." for i in range(10)]
    script.write_text("\n".join(json.dumps({"user": q}) for q in questions) + "\n")
    out = run_cli(tmp_path, "replay", str(script), "--json", "--prompt-text", LLMWEB_MAX_NEW_TOKENS="12")
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert [r["turn"] for r in rows] == list(range(1, 11))
    for r, q in zip(rows, questions):
        assert KEYS <= set(r), KEYS - set(r)
        assert r["mem"]["rss_bytes"] > 0 and r["generated_tokens"] >= 1
        assert q in r["prompt_text"]
        assert sum(v for k, v in r["sections"].items() if k != "reserve") == r["prompt_tokens"]
    assert all(r["reused_tokens"] > 0 for r in rows[1:]), "later turns reuse the session's KV cache"


@pytest.mark.slow  # loads the real model in a subprocess
def test_replay_reports_refused_turns_goes_on_and_exits_1(tmp_path):
    script = tmp_path / "chat.jsonl"
    users = ["Name a colour.", "   ", 42, "word " * 40, "Name a fruit."]
    script.write_text("\n".join(json.dumps({"user": u}) for u in users) + "\n")
    out = run_cli(tmp_path, "replay", str(script), "--json", LLMWEB_MAX_NEW_TOKENS="6", LLMWEB_USER_TOKENS="24")
    assert out.returncode == 1, out.stderr[-2000:]
    assert "3 of 5 turns were refused" in out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert [r["turn"] for r in rows] == [1, 2, 3, 4, 5], "one row per message of the script, in order"
    assert rows[1] == {"turn": 2, "user": "   ", "error": rows[1]["error"]}
    assert rows[1]["error"].startswith("Your message is empty")
    assert rows[2] == {"turn": 3, "user": 42, "error": "A message must be text."}
    assert rows[3]["user"] == "word " * 40 and "the limit is 24" in rows[3]["error"]
    for r in (rows[0], rows[4]):
        assert "error" not in r and r["generated_tokens"] >= 1 and KEYS <= set(r)
    assert rows[4]["reused_tokens"] > 0, "the chat went on after the refused turns (its first turn is reused)"


def test_replay_prints_a_refused_turn_for_people():
    assert (
        replay_line({"turn": 2, "user": " ", "error": "Your message is empty."})
        == "[2] refused: Your message is empty.\n"
    )
    row = {"turn": 1, "prompt_tokens": 30, "reused_tokens": 0, "generated_tokens": 5, "ttft_s": 0.25, "reply": "Blue."}
    assert replay_line(row) == "[1] 30 prompt tokens (0 reused), 5 generated, TTFT 0.25 s\nBlue.\n"


def test_replay_rejects_a_malformed_script(tmp_path):
    script = tmp_path / "bad.jsonl"
    script.write_text('{"user": "hi"}\nnot json\n')
    out = run_cli(tmp_path, "replay", str(script), "--json")
    assert out.returncode == 2 and "bad.jsonl:2: expected a JSON object" in out.stderr


@pytest.mark.slow  # two subprocesses load torch and the embedder (~30 s)
def test_ingest_then_search_json(tmp_path):
    docs = tmp_path / "docs"
    (docs / "sub").mkdir(parents=True)
    (docs / "rover.md").write_text("# Rover\n\nThe Zephyr-7 rover's battery lasts 412 hours on one charge.\n")
    (docs / "sub" / "tea.txt").write_text("Green tea is steeped at 80 degrees for two minutes.\n")
    (docs / "sub" / "junk.bin").write_bytes(b"\x00\x01")
    out = run_cli(tmp_path, "ingest", str(docs))
    assert out.returncode == 0, out.stderr[-2000:]
    assert "2 of 2 files indexed" in out.stdout
    out = run_cli(tmp_path, "search", "how long does the rover battery last", "--k", "2", "--json")
    assert out.returncode == 0, out.stderr[-2000:]
    hits = json.loads(out.stdout)
    assert hits[0]["source"].endswith("rover.md") and "412 hours" in hits[0]["text"]
    assert set(hits[0]) == {"source", "page", "text", "score"} and len(hits) <= 2


def test_files_the_cli_creates_are_private(tmp_path):
    """World-readable data files: after `main` (any command) the process's umask is 077, so
    the SQLite file, the users file, the secret and the indexes it creates are 0600, folders 0700."""
    import stat
    import subprocess
    import sys

    script = (
        "import os, sys; from pathlib import Path; from llmweb.cli.main import main; "
        "main(['user', 'list', '--file', sys.argv[1] + '/users.json']); "
        "from llmweb.store.db import Store; d = Path(sys.argv[1]) / 'data'; d.mkdir(); "
        "Store(d / 'llmweb.sqlite3').close()"
    )
    subprocess.run([sys.executable, "-c", script, str(tmp_path)], check=True, capture_output=True, timeout=120)
    data = tmp_path / "data"
    assert stat.S_IMODE(data.stat().st_mode) == 0o700
    for f in data.iterdir():
        assert stat.S_IMODE(f.stat().st_mode) == 0o600, (f, oct(f.stat().st_mode))
