"""The repo is a Gradio Space as it is: the environment a Space builds, then a reply from it.

A Space installs `packages.txt` (Debian; here the machine has the compiler already), then
`pip install -r pre-requirements.txt` and `pip install -r requirements.txt`, nothing else: no
`--no-deps`, no other requirements file. So this test makes a fresh virtual environment, installs
exactly that (pip's wheel cache may serve the llama-cpp-python wheel that `make install` built, so
the test does not compile it twice), checks that its llama.cpp has no OpenMP and, on x86-64, no AVX-512 or AMX
(pre-requirements.txt says why), and
starts `app.py` with `SYSTEM=spaces`, offline (`HF_HUB_OFFLINE=1`: no model may come from a hub),
on a free port, from this checkout. It asks one question through the OpenAI-compatible API and
checks the answer and that the status line names llama.cpp. Before that, the same environment
reads a photo of a note by OCR with a fresh home: rapidocr's models come from its wheel.

Slow (an install of several minutes): it runs where LLMWEB_SPACE_BUILD_TEST=1 (CI sets it), and
is skipped elsewhere unless asked for.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        os.environ.get("LLMWEB_SPACE_BUILD_TEST") != "1", reason="LLMWEB_SPACE_BUILD_TEST=1 runs the Space build"
    ),
]

KEY = "space-test-key"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict, timeout: float = 120.0) -> dict:
    request = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"},
    )
    with urllib.request.urlopen(request, timeout=timeout) as r:
        return json.loads(r.read())


def space_python_version() -> tuple[int, int]:
    """The Python a Space builds with: README.md's front matter `python_version` (without it, the
    platform's default, older than the code needs)."""
    front = (REPO / "README.md").read_text(encoding="utf-8").split("---", 2)[1]
    found = re.search(r'^python_version:\s*"?(\d+)\.(\d+)"?\s*$', front, re.M)
    assert found, "README.md's front matter names no python_version"
    return int(found.group(1)), int(found.group(2))


def space_python() -> str:
    """An interpreter of the front matter's version, for the Space's virtual environment."""
    major, minor = space_python_version()
    if sys.version_info[:2] == (major, minor):
        return sys.executable
    found = shutil.which(f"python{major}.{minor}")
    if found is None:
        pytest.skip(f"no python{major}.{minor} here to build the Space with")
    return found


def test_a_space_built_from_its_requirements_files_alone_answers(tmp_path: Path):
    venv = tmp_path / "venv"
    subprocess.run([space_python(), "-m", "venv", str(venv)], check=True)
    for name in ("pre-requirements.txt", "requirements.txt"):
        pip = subprocess.run(
            [str(venv / "bin" / "pip"), "install", "-q", "-r", str(REPO / name)],
            capture_output=True,
            text=True,
            timeout=2400,
        )
        assert pip.returncode == 0, f"pip install -r {name} failed:\n{pip.stdout[-2000:]}\n{pip.stderr[-3000:]}"
    info = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import llama_cpp as ll; print(ll.llama_print_system_info().decode())"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "AVX" in info and "OPENMP = 1" not in info, info
    if platform.machine() == "x86_64":  # the portable build (pre-requirements.txt says why)
        assert "AVX2 = 1" in info and "AVX512" not in info and "AMX" not in info, info
    # OCR from the models inside rapidocr's wheel: a fresh home, nothing cached, nothing downloaded
    read = "from llmweb.bench.ocr import note_photo; from llmweb.retrieval import ocr, scans; "
    read += "print(ocr.engine().read(scans.prepare(note_photo().image)))"
    ocr = subprocess.run(
        [str(venv / "bin" / "python"), "-c", read],
        cwd=REPO,
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert ocr.returncode == 0 and "under the blue flowerpot" in ocr.stdout, ocr.stdout + ocr.stderr[-3000:]
    port = _free_port()
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(tmp_path),
        "SYSTEM": "spaces",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "LLMWEB_DATA_DIR": str(tmp_path / "data"),
        "LLMWEB_PORT": str(port),
        "LLMWEB_API_KEYS": f"tester:{KEY}",
        "GRADIO_ANALYTICS_ENABLED": "False",
    }
    log = open(tmp_path / "app.log", "w")
    app = subprocess.Popen([str(venv / "bin" / "python"), "app.py"], cwd=REPO, env=env, stdout=log, stderr=log)
    try:
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        body = {"model": "llmweb", "messages": [{"role": "user", "content": "What is the capital of France?"}]}
        deadline, answer, last = time.monotonic() + 600, None, ""
        while time.monotonic() < deadline and app.poll() is None:
            try:
                answer = _post(url, {**body, "max_tokens": 24})
                break
            except OSError as e:  # not up yet, or the model still loading (503)
                last = str(e)
                time.sleep(2)
        logged = (tmp_path / "app.log").read_text(errors="replace")
        assert answer is not None, f"no answer ({last}); app log:\n{logged[-4000:]}"
        text = answer["choices"][0]["message"]["content"]
        assert "Paris" in text, text
        assert "llama.cpp" in logged and "is not usable here" not in logged, "the Space runs on llama.cpp"
    finally:
        app.terminate()
        app.wait(30)
        log.close()
