"""The remote runner against a real llama.cpp `llama-server` (not a fake): 30 turns of a chat.

The fake server in test_remote.py models the wire format we read; this one is llama.cpp's own,
built from the llama-cpp-python sdist that requirements.txt pins (.ci/run builds it; locally, put
`llama-server` on the PATH or name it in LLMWEB_LLAMA_SERVER). It serves the embedded GGUF file
with 4 slots. Through llmweb's remote runner (LLMWEB_ENGINE_URL) and the whole chat path, every
turn must report what the server took from its cache (its last event: `timings.cache_n`, read
after the stop token), and from turn 2 each turn prefills under 30% of its prompt, because the
chat stays on its slot (`id_slot`). The late/early TTFT ratio is printed, not asserted (timing is
for `bench ttft --engine-url`, docs/benchmarks.md "Time to first token").
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
import urllib.request

import pytest

from llmweb.bench import ttft
from llmweb.engine import models
from tests.conftest import make_settings

SERVER = os.environ.get("LLMWEB_LLAMA_SERVER") or shutil.which("llama-server")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not SERVER, reason="no llama-server (LLMWEB_LLAMA_SERVER or the PATH); .ci/run builds one"),
]


@pytest.fixture(scope="module")
def llama_server():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    folder, name = models.embedded_gguf()
    # on a CPU: no flash attention (it takes a chunk's queries one at a time) and no host prompt
    # cache (it copies the slot's KV at every request); docs/benchmarks.md "Time to first token" measures both
    args = [str(SERVER), "-m", str(folder / name), "-np", "4", "-c", "8192", "--port", str(port)]
    args += ["-fa", "off", "--cache-ram", "0"]
    proc = subprocess.Popen([*args, "--host", "127.0.0.1"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    break
        except OSError:
            time.sleep(0.5)
    else:
        proc.kill()
        pytest.fail("llama-server did not come up in 120 s")
    yield url
    proc.terminate()
    proc.wait(30)


def test_thirty_turns_through_llama_server_each_report_their_reuse(llama_server, tmp_path):
    settings = make_settings(tmp_path / "data", engine_url=llama_server, max_new_tokens=48, sample_docs=True)
    mode = ttft.run_mode(settings, None, ttft.script_turns("topics", 30), reuse=True)
    assert len(mode.ttft_s) == 30 and all(mode.reuse_reported), "every turn reports what the server reused"
    pairs = list(zip(mode.prompt_tokens, mode.reused_tokens))[1:]
    heavy = [(i + 2, p, r) for i, (p, r) in enumerate(pairs) if p - r >= ttft.LOW_PREFILL * p]
    assert not heavy, f"turns that prefilled 30% or more of their prompt (turn, prompt, reused): {heavy}"
    print(f"llama-server, 30 turns: late/early TTFT {mode.ratio():.2f}")


def test_logprobs_come_through_from_llama_server_in_openais_shape(llama_server, tmp_path):
    """llama-server gives each token's log-probability and its alternatives with their ids: the
    chat and completions endpoints pass them on in OpenAI's shape, as the local engine does."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from llmweb.runtime import Runtime
    from llmweb.web.api.routes import api_routes
    from llmweb.web.owner import owner_secrets

    settings = make_settings(tmp_path / "data", engine_url=llama_server, max_new_tokens=16)
    rt = Runtime(settings).start(background=False)
    try:
        rt.wait_ready(120)
        assert rt.engine.runner.logprobs is True, "probed: llama-server gives logprobs"
        key = owner_secrets(settings).api_key
        client = TestClient(
            FastAPI(routes=api_routes(rt)),
            base_url="http://127.0.0.1:7860",
            client=("127.0.0.1", 5000),
            headers={"Authorization": f"Bearer {key}"} if key else {},
        )
        model = client.get("/v1/models").json()["data"][0]["id"]
        ask = {"model": model, "messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 8}
        r = client.post("/v1/chat/completions", json={**ask, "logprobs": True, "top_logprobs": 3, "seed": 1})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        content = choice["logprobs"]["content"]
        assert content and "".join(e["token"] for e in content) == choice["message"]["content"]
        for e in content:
            assert e["logprob"] <= 0 and len(e["top_logprobs"]) == 3
            tops = [t["logprob"] for t in e["top_logprobs"]]
            assert tops == sorted(tops, reverse=True) and e["logprob"] <= tops[0] + 1e-6
        r = client.post(
            "/v1/completions", json={"model": model, "prompt": "Once upon a time", "max_tokens": 5, "logprobs": 2}
        )
        assert r.status_code == 200, r.text
        lp = r.json()["choices"][0]["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) > 0
        assert all(len(t) <= 2 for t in lp["top_logprobs"])
    finally:
        rt.close()
