"""`python -m llmweb models fetch` as a user runs it (subprocesses; HF_ENDPOINT points huggingface_hub at
tests/fake_hub.py, HF_HUB_OFFLINE=1 as a user sets it), and its progress line."""

from __future__ import annotations

import io
import os
import random
import subprocess
import sys
import time

import pytest

from llmweb.cli.models import ProgressLine
from tests.conftest import REPO
from tests.fake_hub import FakeHub

Q4 = random.Random(4).randbytes(250_000)


@pytest.fixture
def fake():
    with FakeHub() as h:
        h.add("someone/tiny-GGUF", {"tiny-Q4_K_M.gguf": Q4, "README.md": b"# tiny"})
        yield h


def run_models(tmp_path, *args, **env):
    base = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "LLMWEB_"))}
    full = {**base, "LLMWEB_DATA_DIR": str(tmp_path / "data"), "HF_TOKEN": "", **env}
    command = [sys.executable, "-m", "llmweb", "models", *args]
    return subprocess.run(command, cwd=REPO, env=full, capture_output=True, text=True, timeout=60)


def test_fetch_prints_the_plan_then_progress_then_the_path(fake, tmp_path):
    out = run_models(tmp_path, "fetch", "someone/tiny-GGUF", "tiny-Q4_K_M.gguf", HF_ENDPOINT=fake.url)
    assert out.returncode == 0, out.stderr[-2000:]
    target = tmp_path / "data" / "models" / "tiny-Q4_K_M.gguf"
    lines = out.stdout.splitlines()
    assert lines[0].startswith("fetching someone/tiny-GGUF at main (commit ") and lines[0].endswith("1 file, 250 kB")
    assert lines[1:3] == ["  tiny-Q4_K_M.gguf  250 kB", f"into {target}"]
    assert lines[3].startswith("0 B of 250 kB (0%), ") and lines[-3].startswith("250 kB of 250 kB (100%), ")
    assert lines[-2:] == [f"fetched: {target}", f"to chat with it: LLMWEB_MODEL={target}"]
    assert target.read_bytes() == Q4


def test_fetch_refusals_exit_2_with_one_sentence(fake, tmp_path):
    tiny = ("fetch", "someone/tiny-GGUF", "tiny-Q4_K_M.gguf")
    t0 = time.perf_counter()
    out = run_models(tmp_path, *tiny, HF_ENDPOINT=fake.url, HF_HUB_OFFLINE="1")
    assert (out.returncode, out.stderr) == (
        2,
        "llmweb: The Hugging Face Hub is off for this process (HF_HUB_OFFLINE is set): nothing can be fetched.\n",
    )
    assert time.perf_counter() - t0 < 10 and fake.requests == []
    out = run_models(tmp_path, "fetch", "someone/tiny-GGUF", HF_ENDPOINT=fake.url)
    assert out.returncode == 2 and "name one of its .gguf files after the id: tiny-Q4_K_M.gguf (250 kB)" in out.stderr
    out = run_models(tmp_path, "fetch", "someone/tiny-GGUF", "../../x.gguf", HF_ENDPOINT=fake.url)
    assert out.returncode == 2 and "is not a file name in a repo" in out.stderr
    out = run_models(tmp_path, *tiny, HF_ENDPOINT=fake.url, LLMWEB_MAX_DOWNLOAD_GB="0.0001")
    assert out.returncode == 2 and out.stdout.startswith("fetching someone/tiny-GGUF"), "the plan shows first"
    assert "needs 250 kB, more than the 100 kB llmweb fetches (LLMWEB_MAX_DOWNLOAD_GB)" in out.stderr
    assert not (tmp_path / "data" / "models" / "tiny-Q4_K_M.gguf").exists()


def test_the_progress_line_rewrites_itself_on_a_terminal_and_steps_by_tenths_elsewhere():
    log = io.StringIO()
    line = ProgressLine(log, tty=False)
    for done in range(0, 1_000_001, 50_000):
        line(done, 1_000_000, "m.gguf")
    shown = log.getvalue().splitlines()
    assert len(shown) == 11 and shown[5].startswith("500 kB of 1 MB (50%), ") and shown[5].endswith("/s  m.gguf")
    term = io.StringIO()
    line = ProgressLine(term, tty=True)
    line(0, 100, "m.gguf")
    line(50, 100, "m.gguf")  # within 0.2 s: not drawn
    line(100, 100, "m.gguf")
    line.end()
    drawn = term.getvalue()
    assert drawn.count("\r") == 2 and "100 B of 100 B (100%)" in drawn and drawn.endswith("\n")
