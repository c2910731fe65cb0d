"""Bring your own model, with real models in their engine process: two GGUF files in the
models folder (the embedded Q4_1 file and llama.cpp's own Q8_0 re-encoding of it); `/v1/models`
lists both with their context lengths; a request naming the second is answered by it; the page's
picker switches back and the status line names it; the keep-alive unloads the model (the memory of
the engine process returns to the machine) and the next request loads it again; on a shared server
a visitor can switch nothing. With LLMWEB_MAX_LOADED=2 (a third file, a hard link of the first
under another name): a switch back is instant (the same engine process), a request naming a
parked model is answered by it, a visitor may use a loaded model but loads none, the least
recently used goes when a third loads (its process exits), the second model is sized beside the
first, and the keep-alive closes a parked model. And a model whose full-context KV cache would not
fit the memory limit starts with a smaller context, says so, and a long chat on it never overflows."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from types import SimpleNamespace

import gradio as gr
import psutil
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from llmweb.engine import gguf
from llmweb.engine.models import embedded_gguf
from llmweb.runtime import Runtime
from llmweb.runtime.switching import keep_alive
from llmweb.store.models import ChatSettings
from llmweb.web.api.routes import api_routes
from llmweb.web.owner import owner_headers
from llmweb.web.ui import Handlers
from tests.conftest import make_settings
from tests.web.test_ui import A_TOKEN, NOBODY

pytestmark = pytest.mark.slow

Q4, Q8, COPY = "smollm2-q4", "smollm2-q8", "smollm2-copy"
KEEP_ALIVE_S = 4.0


def add_q8_model(models: Path, scratch: Path) -> Path:
    """The embedded model re-encoded as Q8_0 by llama.cpp's quantiser, as models/Q8.gguf (~1 s on 2
    cores; also the browser test's second model, tests/web/test_browser.py)."""
    folder_, name = embedded_gguf()
    made = gguf.requantised(folder_ / name, "q8_0", scratch, 2, print)
    models.mkdir(parents=True, exist_ok=True)
    return Path(shutil.move(made, models / f"{Q8}.gguf"))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A models folder with two GGUF files of different encodings."""
    data = tmp_path_factory.mktemp("models-folder")
    models = data / "models"
    models.mkdir()
    folder_, name = embedded_gguf()
    shutil.copy(folder_ / name, models / f"{Q4}.gguf")
    add_q8_model(models, data / "copies")
    os.link(models / f"{Q4}.gguf", models / f"{COPY}.gguf")  # a third model, no bytes more
    return data


def tree_rss() -> int:
    """This process's and its children's (the engine process's) resident memory."""
    me = psutil.Process()
    return sum(p.memory_info().rss for p in [me, *me.children(recursive=True)])


def ask(client, settings, model: str, headers: dict | None = None) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": "Name a fruit."}], "max_tokens": 8}
    r = client.post("/v1/chat/completions", json=body, headers=headers or owner_headers(settings))
    assert r.status_code == 200, r.text
    return r.json()


def loaded(client, settings) -> set[str]:
    data = client.get("/v1/models", headers=owner_headers(settings)).json()["data"]
    return {m["id"] for m in data if m["loaded"]} - {"llmweb"}


def test_two_models_listed_switched_by_a_request_and_the_picker_and_unloaded_when_idle(folder):
    s = make_settings(
        folder / "data",
        models_dir=folder / "models",
        model=str(folder / "models" / f"{Q4}.gguf"),
        context_limit=1024,
        max_new_tokens=16,
        model_keep_alive_s=KEEP_ALIVE_S,
        engine_process="1",
    )
    rt = Runtime(s).start(background=False)
    try:
        client = TestClient(FastAPI(routes=api_routes(rt)), base_url="http://127.0.0.1:7860", client=("127.0.0.1", 1))
        listed = {m["id"]: m for m in client.get("/v1/models", headers=owner_headers(s)).json()["data"]}
        assert {Q4, Q8} <= set(listed) and listed[Q4]["loaded"] and not listed[Q8]["loaded"]
        assert listed[Q4]["context_length"] == 1024 and listed[Q8]["context_train"] == 8192
        assert listed[Q8]["size_bytes"] > listed[Q4]["size_bytes"]

        # a request naming the second model is answered by it
        answer = ask(client, s, Q8)
        assert answer["model"] == Q8 and rt.model_id == Q8 and "Q8_0" in rt.status, rt.status
        assert answer["x_llmweb"]["stats"]["model"] == Q8, "the turn's stats name the model that answered"
        assert Q8 in rt.status
        listed = {m["id"]: m for m in client.get("/v1/models", headers=owner_headers(s)).json()["data"]}
        assert listed[Q8]["loaded"] and not listed[Q4]["loaded"]

        # the page's picker (the machine's owner: its local key) switches back, for the open chat too
        owner_request = SimpleNamespace(username=None, headers=owner_headers(s), session_hash=None)
        h = Handlers(rt)
        conv = rt.store.create_conversation("local")
        status, _timer, _picker = h.models.switch(Q4, conv, "", owner_request)
        assert "Switching to smollm2-q4" in status
        rt.wait_ready(300)
        assert rt.model_id == Q4 and Q4 in rt.status and rt.store.get("local", conv).settings.model == Q4
        assert ask(client, s, "llmweb")["model"] == Q4

        # idle past the keep-alive: the engine process ends and its memory returns to the machine
        before = tree_rss()
        deadline = time.monotonic() + KEEP_ALIVE_S + 30
        while not rt.unloaded and time.monotonic() < deadline:
            time.sleep(0.5)
        assert rt.unloaded and "unloaded" in rt.status, rt.status
        time.sleep(1.0)
        freed = before - tree_rss()
        assert freed >= listed[Q4]["size_bytes"], f"only {freed / 2**20:.0f} MiB returned"
        answer = ask(client, s, "llmweb")  # loads it again
        assert answer["model"] == Q4 and rt.ready and not rt.unloaded

        # a shared server: a visitor switches nothing, through the page or the API
        rt.settings = rt.settings.replace(single_user="0", api_keys="bob:bob-key-0123456789")
        h = Handlers(rt)
        with pytest.raises(gr.Error, match="Only this server's operator"):
            h.models.switch(Q8, "", A_TOKEN, NOBODY)
        picker = h.models.picker(A_TOKEN, NOBODY)
        assert picker["interactive"] is False and picker["value"] == Q4
        client = TestClient(FastAPI(routes=api_routes(rt)), base_url="http://127.0.0.1:7860", client=("127.0.0.1", 1))
        body = {"model": Q8, "messages": [{"role": "user", "content": "Hi"}]}
        r = client.post("/v1/chat/completions", json=body, headers={"Authorization": "Bearer bob-key-0123456789"})
        assert r.status_code == 409 and r.json()["error"]["code"] == "model_not_loaded"
        assert rt.model_id == Q4 and rt.ready
    finally:
        rt.close()


def engine_rss(rt) -> int:
    """The engine process's resident memory."""
    return sum(p.memory_info().rss for p in psutil.Process().children(recursive=True))


def test_a_model_whose_full_context_does_not_fit_gets_a_smaller_one_and_never_overflows(folder):
    """The trained context (8,192) asked for, and a memory limit on the engine process that leaves
    ~24 MiB for KV caches (23 KiB a token; a quarter for idle chats' caches) beside 64 MiB kept for
    activations and a 64 MiB margin: the context is cut (to ~768 tokens), the status line says so,
    and a long chat stays inside it. The limit is set from the engine process's own memory, measured
    in a first start with no limit."""
    s = make_settings(
        folder / "fit",
        model=str(folder / "models" / f"{Q4}.gguf"),
        context_limit=8192,
        max_batch=1,
        mem_margin_mb=64,
        max_new_tokens=24,
        engine_process="1",
    )
    first = Runtime(s).start(background=False)
    try:
        assert first.budget.context_limit == 8192, "no limit: the whole trained context"
        baseline = engine_rss(first) - 8192 * first.loaded.kv_bytes_per_token  # the model without its pool
    finally:
        first.close()
    s = s.replace(mem_limit_mb=int((baseline + (64 + 64 + 24) * 2**20) // 2**20))
    rt = Runtime(s).start(background=False)
    try:
        chat = rt.wait_ready()
        limit_tokens = rt.budget.context_limit
        assert 512 <= limit_tokens < 8192, rt.status
        assert f"context {limit_tokens:,} tokens (not 8,192)" in rt.status and "Sized to memory" in rt.status
        paragraph = "The harbour office keeps records of every ship that docks, its cargo and its crew. " * 12
        conv = None
        for n in range(4):
            fin = chat.ask("local", conv, f"Note {n}: {paragraph} What did note {n} say?")
            conv = fin.conv_id
            assert fin.stats.gen.prompt_tokens + fin.stats.gen.generated_tokens <= limit_tokens
        assert fin.stats.summarized_turns > 0 or fin.stats.dropped_turns > 0, "the history had to be folded"
    finally:
        rt.close()


def engine_pid(rt, model: str) -> int:
    """The engine process of a loaded model (served or parked)."""
    records = [r for r in [rt.residents.serving, *rt.residents.parked()] if r is not None and r.model_id == model]
    assert records, f"{model} is not loaded"
    return records[0].engine.runner.pid


def exits(pid: int, within_s: float = 30.0) -> bool:
    """Whether process `pid` ends within `within_s` (its parent reaps it: engine/process.py)."""
    deadline = time.monotonic() + within_s
    while psutil.pid_exists(pid):
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def test_two_models_kept_loaded_answer_their_requests_and_the_least_recently_used_goes(folder):
    s = make_settings(
        folder / "two",
        models_dir=folder / "models",
        model=str(folder / "models" / f"{Q4}.gguf"),
        context_limit=1024,
        max_new_tokens=16,
        max_loaded=2,
        mem_limit_mb=3000,
        engine_process="1",
    )
    rt = Runtime(s).start(background=False)
    try:
        client = TestClient(FastAPI(routes=api_routes(rt)), base_url="http://127.0.0.1:7860", client=("127.0.0.1", 1))
        q4_pid = engine_pid(rt, Q4)
        assert ask(client, s, Q8)["model"] == Q8, "not loaded: the owner's request switches to it"
        assert rt.model_id == Q8 and "Kept smollm2-q4 loaded." in rt.status, rt.status
        assert "Sized to the" in rt.status and "smollm2-q4 left of the limit" in rt.status, rt.status
        assert loaded(client, s) == {Q4, Q8} and psutil.pid_exists(q4_pid)

        # back to Q4: instant, the same engine process, no load
        t0 = time.perf_counter()
        assert rt.switch(Q4) and rt.ready, "served at once: nothing to wait for"
        assert time.perf_counter() - t0 < 1.0 and engine_pid(rt, Q4) == q4_pid
        assert "switched at once" in rt.status and Q4 in rt.status, rt.status

        # a request naming the parked Q8 is answered by it while Q4 stays served; so is a chat of Q8's
        q8_engine = rt.residents.parked()[0].engine
        parked_answer = ask(client, s, Q8)
        assert parked_answer["model"] == Q8 and rt.model_id == Q4 and loaded(client, s) == {Q4, Q8}
        assert parked_answer["x_llmweb"]["stats"]["model"] == Q8
        owner_request = SimpleNamespace(username=None, headers=owner_headers(s), session_hash=None)
        h = Handlers(rt)
        conv = rt.store.create_conversation("local")
        rt.store.set_settings("local", conv, ChatSettings(model=Q8))
        before = q8_engine.counters.served
        for _ in h.chat.respond("Name a colour.", [], conv, False, "", owner_request):
            pass
        assert q8_engine.counters.served > before and rt.model_id == Q4, "the chat's own model answered it"

        # a visitor of a shared server: a loaded model answers them, but they load none
        rt.settings = rt.settings.replace(single_user="0", api_keys="bob:bob-key-0123456789")
        bob = {"Authorization": "Bearer bob-key-0123456789"}
        client = TestClient(FastAPI(routes=api_routes(rt)), base_url="http://127.0.0.1:7860", client=("127.0.0.1", 1))
        assert ask(client, s, Q8, bob)["model"] == Q8 and rt.model_id == Q4
        body = {"model": COPY, "messages": [{"role": "user", "content": "Hi"}]}
        r = client.post("/v1/chat/completions", json=body, headers=bob)
        assert r.status_code == 409 and r.json()["error"]["code"] == "model_not_loaded", r.text
        assert rt.model_id == Q4 and rt.ready and set(rt.loaded_ids()) == {Q4, Q8}

        # a third model: Q4 is parked, Q8 (used before it) is the least recently used and goes
        q8_pid = engine_pid(rt, Q8)
        rt.switch(COPY)
        rt.wait_ready(300)
        assert rt.loaded_ids() == [COPY, Q4], rt.loaded_ids()
        assert "Unloaded smollm2-q8 (the least recently used; LLMWEB_MAX_LOADED=2)." in rt.status, rt.status
        assert exits(q8_pid), "Q8's engine process did not exit"

        # the keep-alive (as LLMWEB_MODEL_KEEP_ALIVE_S starts it) closes the parked Q4; COPY, in use, stays
        with rt.hold(COPY):
            keep_alive(rt, 2.0, rt._closing)
            deadline = time.monotonic() + 30
            while Q4 in rt.loaded_ids() and time.monotonic() < deadline:
                time.sleep(0.2)
            assert rt.loaded_ids() == [COPY] and not rt.unloaded
            assert exits(q4_pid), "Q4's engine process did not exit"
    finally:
        rt.close()
