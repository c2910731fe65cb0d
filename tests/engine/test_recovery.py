"""Never lose a chat, never die of OOM: restart, kill -9 mid-turn, OOM in the chat path (and the
memory of the failed attempt freed before the retry), idle release of a fragmented allocator
cache, the offload settings, and login. Real model, real SQLite, the launched app where it
matters; CUDA-only logic is driven with injected figures so it runs on CPU."""

from __future__ import annotations

import asyncio
import json
import os
import queue
import signal
import sqlite3
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path
from types import SimpleNamespace

import httpx
import psutil
import pytest
import torch
from gradio_client import Client

from llmweb.chat.tokens import render_prompt
from llmweb.engine import admission, models
from llmweb.engine.blockcache import KEEP_ROOM
from llmweb.engine.kvcache import KVStore
from llmweb.engine.request import EngineLimits, GenerationRequest, Restarted, Tokens
from llmweb.engine.runners import base as runner_base
from llmweb.engine.runners import transformers as runner_mod
from llmweb.engine.runners.transformers import local_engine
from llmweb.errors import ConfigError
from llmweb.records import LOCAL_OWNER as LOCAL
from llmweb.records import MemorySnapshot
from llmweb.runtime import Runtime
from llmweb.store.db import Store
from llmweb.web.formatting import stats_markdown
from llmweb.web.owner import owner_headers, owner_secrets
from llmweb.web.ui import launch_kwargs
from tests.conftest import MODEL_CACHE, REPO, make_settings
from tests.fakes import with_fault
from tests.test_hostile import WAIT_S, serve

MiB = 2**20


def ui_handler(demo, trigger: str, name: str):
    """The Python function behind one of the page's own (private) events, e.g. the page-load handler."""
    for fn in demo.fns.values():
        if getattr(fn.fn, "__name__", "") == name and any(ev == trigger for _, ev in fn.targets):
            return fn.fn
    raise AssertionError(f"no {trigger!r} handler named {name!r}")


# ---- restart


def test_restart_restores_the_conversation_in_store_ui_and_api(tmp_path, app_model):
    settings = make_settings(tmp_path / "data", max_new_tokens=24)
    first = Runtime(settings, loaded=app_model).start(background=False)
    conv = first.store.create_conversation(LOCAL)
    sent = ["My name is Ada. What is the capital of France?", "And what is the capital of Italy?"]
    replies = []
    for text in sent:
        replies.append(first.chat.ask(LOCAL, conv, text).reply)
    first.close()

    again = Runtime(settings, loaded=app_model).start(background=False)
    try:
        stored = again.store.get(LOCAL, conv)
        assert [(t.user, t.assistant) for t in stored.turns] == list(zip(sent, replies))
        assert all(t.stats.gen.finish_reason in ("eos", "length") for t in stored.turns)
        assert [t.stats.turn for t in stored.turns] == [1, 2]
        with serve(again) as (demo, url):
            # what the browser gets on load, with the chat id it kept in its storage
            # a gr.Request of a browser on this machine, without login (single-user: the local owner)
            secrets = owner_secrets(settings)  # the browser that opened the owner's link has its cookie
            cookie = f"{secrets.cookie_name}={secrets.token}"
            nobody = SimpleNamespace(
                username=None, client=SimpleNamespace(host="127.0.0.1"), headers={"host": "127.0.0.1", "cookie": cookie}
            )
            opened = ui_handler(demo, "load", "visit")("", conv, nobody)
            values = list(opened.values()) if isinstance(opened, dict) else list(opened)
            assert conv in values, "the page keeps the same chat id"
            history = next(v for v in values if isinstance(v, list) and v and isinstance(v[0], dict) and "role" in v[0])
            assert [m["content"] for m in history if m["role"] == "user"] == sent
            assert [m["content"] for m in history if m["role"] == "assistant"] == replies
            client = Client(url, headers=owner_headers(settings), verbose=False)  # this machine's key
            stats = json.loads(client.predict(conv, api_name="/stats"))
            assert stats["turn"] == 2 and stats["generated_tokens"] >= 1
            # and the chat goes on where it stopped, with its history in the prompt
            assert client.predict("Thanks. Say goodbye.", conv, api_name="/chat")[0].strip()
            stats = json.loads(client.predict(conv, api_name="/stats"))
            assert stats["turn"] == 3 and stats["sections"]["history"] > 0
            assert len(again.store.get(LOCAL, conv).turns) == 3
    finally:
        again.close()


# ---- kill -9 mid-turn


@pytest.mark.slow  # a replay subprocess loads the model
@pytest.mark.parametrize("backend", ["transformers", "llama.cpp"])
def test_kill_9_during_turn_3_keeps_turns_1_and_2_whole(tmp_path, backend):
    script = tmp_path / "chat.jsonl"
    topics = [
        "a dragon",
        "a lighthouse",
        "a clockmaker",
        "the sea",
        "a robot",
        "a forest",
        "a city",
        "a river",
        "a mountain",
        "a library",
    ]
    script.write_text(
        "".join(json.dumps({"user": f"Write a long, detailed story about {t}."}) + "\n" for t in topics),
        encoding="utf-8",
    )
    data = tmp_path / "data"
    env = {
        **os.environ,
        "LLMWEB_DATA_DIR": str(data),
        "LLMWEB_CACHE_DIR": str(MODEL_CACHE),
        "LLMWEB_MAX_NEW_TOKENS": "800",  # seconds of work even at llama.cpp's speed
        "LLMWEB_BACKEND": backend,
        "LLMWEB_SAMPLE_DOCS": "0",
        "LLMWEB_DEVICE": "cpu",
        "PYTHONPATH": str(REPO),
    }
    stderr = open(tmp_path / "stderr.txt", "w")
    child = subprocess.Popen(
        [sys.executable, "-m", "llmweb", "replay", str(script), "--json"],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
    )
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in child.stdout], daemon=True).start()
    printed = []
    try:
        deadline = time.monotonic() + 2 * WAIT_S
        while len(printed) < 2:
            try:
                printed.append(json.loads(lines.get(timeout=max(deadline - time.monotonic(), 0.1))))
            except queue.Empty:
                raise AssertionError(
                    "replay printed fewer than 2 turns: " + (tmp_path / "stderr.txt").read_text()[-2000:]
                ) from None
        # turn 3 starts at once (turn 2 was printed after it was stored); 800 tokens take seconds
        time.sleep(0.5)
        child.send_signal(signal.SIGKILL)
        child.wait(60)
    finally:
        if child.poll() is None:
            child.kill()
        stderr.close()
    assert child.returncode == -signal.SIGKILL
    assert lines.empty(), "turn 3 had not finished when it was killed"

    db = data / "llmweb.sqlite3"
    with sqlite3.connect(db) as raw:
        assert raw.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    with Store(db) as store:
        (info,) = store.list_conversations(LOCAL)
        turns = store.get(LOCAL, info.id).turns
    assert [t.idx for t in turns] == [0, 1], "turns 1 and 2, and no part of turn 3"
    for turn, out, topic in zip(turns, printed, topics):
        assert turn.user == f"Write a long, detailed story about {topic}."
        assert turn.assistant == out["reply"] and turn.assistant.strip()
        assert turn.stats.gen.finish_reason == out["finish_reason"] in ("eos", "length")
        assert turn.stats.gen.generated_tokens == out["generated_tokens"]
        figures = turn.stats.to_dict()
        assert {k: out[k] for k in figures} == figures, "replay --json prints the stored figures"


# ---- out of memory in the chat path


@pytest.fixture
def oom_runtime(tmp_path, app_model):
    plan = {"at": 0, "left": 0}  # raise OOM at forward pass `at` of the next `left` requests

    def fault(index):
        if plan["left"] and index == plan["at"]:
            plan["left"] -= 1
            raise oom("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")

    oom = MemoryError if app_model.backend == "llama.cpp" else torch.OutOfMemoryError  # each runner's out of memory
    rt = Runtime(make_settings(tmp_path / "data", max_new_tokens=24), loaded=app_model)
    rt.start(background=False)
    with_fault(rt.engine, fault)
    yield rt, plan
    rt.close()


def test_oom_on_the_first_forward_is_retried_smaller_and_the_next_turn_is_normal(oom_runtime):
    rt, plan = oom_runtime
    conv = rt.store.create_conversation(LOCAL)
    plan.update(at=0, left=1)
    finished = rt.chat.ask(LOCAL, conv, "What is the capital of France?")
    assert finished.reply.strip(), "the reply still comes"
    assert finished.stats.gen.oom_retry
    assert rt.engine.counters.ooms == 1
    stored = rt.store.get(LOCAL, conv).turns[-1].stats
    assert stored == finished.stats
    assert stored.gen.oom_retry is True and stored.gen.finish_reason in ("eos", "length")
    assert "ran out of memory once" in stats_markdown(stored)
    # the smaller plan: its reply cap is half of the configured one
    assert stored.gen.generated_tokens <= 24 // 2

    finished = rt.chat.ask(LOCAL, conv, "And of Germany?")
    assert finished.reply.strip() and not finished.stats.gen.oom_retry
    assert rt.engine.counters.ooms == 1


def test_oom_after_tokens_streamed_restarts_the_reply_cleanly(oom_runtime):
    """An OOM mid-reply voids what was streamed: the retried reply is not glued to the partial one."""
    rt, plan = oom_runtime
    question = "What is the capital of France?"
    runner = rt.engine.runner  # a FaultyRunner: it counts the forward passes
    plan.update(at=runner.forwards, left=1)
    clean = rt.chat.ask(LOCAL, rt.store.create_conversation(LOCAL), question)
    plan.update(at=runner.forwards + 4, left=1)  # prefill, then 3 decode steps: three tokens were streamed already
    conv = rt.store.create_conversation(LOCAL)
    finished = rt.chat.ask(LOCAL, conv, question)
    assert finished.stats.gen.oom_retry and rt.engine.counters.ooms == 2
    assert finished.reply == clean.reply, "the same reply as a retry that had streamed nothing"
    assert rt.store.get(LOCAL, conv).turns[-1].assistant == clean.reply


class _Wrapped:
    """The real model behind a wrapper that fails its first forward pass while holding an
    'activation', and records whether the failed attempt's cache and activation are still alive
    when the retry starts."""

    def __init__(self, model):
        self.model, self.config, self.calls = model, model.config, 0
        self.refs: list = []
        self.alive_at_retry: list[bool] | None = None

    def __call__(self, **kw):
        self.calls += 1
        if self.calls == 1:
            activation = torch.empty(4 * MiB // 4)  # 4 MiB that a real forward pass would hold
            self.refs = [weakref.ref(kw["cache"]), weakref.ref(activation)]
            raise torch.OutOfMemoryError("injected")
        if self.calls == 2:
            self.alive_at_retry = [r() is not None for r in self.refs]
        return self.model(**kw)


def test_the_failed_attempts_memory_is_freed_before_the_retry(fp32_model, fmt):
    wrapped = _Wrapped(fp32_model.model)
    e = local_engine(wrapped, "cpu", KVStore(64 * MiB, 600), EngineLimits(), fp32_model.kv_bytes_per_token)
    try:
        ids = render_prompt(fmt, "You are a helpful assistant.", [("user", "Hello")])
        req = GenerationRequest(prompt_ids=ids, max_new_tokens=4, stop_ids=fmt.stop_ids)
        h = e.submit(GenerationRequest(prompt_ids=ids, max_new_tokens=4, stop_ids=fmt.stop_ids, fallback=lambda: req))
        events = list(h.events())
        assert h.stats.oom_retry
        assert isinstance(events[0], Restarted) and events[0].reason == "oom"
        assert all(isinstance(ev, Tokens) for ev in events[1:])
        assert wrapped.alive_at_retry == [False, False], (
            "the failed attempt's KV cache and activations must be gone before the retry runs"
        )
    finally:
        e.close()


def test_cancel_while_queued_frees_the_place_at_once(fp32_model, fmt):
    e = local_engine(
        fp32_model.model, "cpu", KVStore(64 * MiB, 600), EngineLimits(queue_size=1), fp32_model.kv_bytes_per_token
    )
    try:
        ids = render_prompt(fmt, "You are a helpful assistant.", [("user", "Write a long story.")])
        running = e.submit(GenerationRequest(prompt_ids=ids, max_new_tokens=200))
        for ev in running.events():
            if isinstance(ev, Tokens):
                break  # it runs
        queued = e.submit(GenerationRequest(prompt_ids=ids, max_new_tokens=4))
        queued.cancel()  # e.g. its browser tab was closed while it waited
        assert e.queue_depth == 0
        third = e.submit(GenerationRequest(prompt_ids=ids, max_new_tokens=4))  # not "busy"
        running.cancel()
        assert len(third.result()) >= 1
        with pytest.raises(Exception, match="Cancelled before it started"):
            queued.result()
    finally:
        e.close()


def test_cancel_during_a_long_prefill_stops_between_chunks_and_keeps_what_was_computed(fp32_model, fmt, monkeypatch):
    monkeypatch.setattr(admission, "PREFILL_CHUNK", 64)  # small chunks keep the test cheap on CPU
    held = {}

    def fault(index):  # the client leaves while the first prefill chunk runs
        if index == 0:
            held["h"].cancel()

    e = local_engine(fp32_model.model, "cpu", KVStore(256 * MiB, 600), EngineLimits(), fp32_model.kv_bytes_per_token)
    faulty = with_fault(e, fault)
    try:
        ids = render_prompt(fmt, "You are a helpful assistant.", [("user", "lorem ipsum " * 25)])
        assert len(ids) > 2 * admission.PREFILL_CHUNK  # three chunks; only the first is computed
        req = GenerationRequest(prompt_ids=ids, max_new_tokens=2, session_id="s")
        with e._lock:  # hold the worker until the handle is known to the fault hook
            held["h"] = h = e.submit(req)
        h.result()
        assert h.stats.finish_reason == "cancelled" and h.stats.generated_tokens == 0
        assert h.stats.prefilled_tokens == admission.PREFILL_CHUNK < h.stats.prompt_tokens
        per_token = fp32_model.kv_bytes_per_token  # kept: the computed chunk and some room (blockcache)
        held_bytes = e.kv.session_bytes("s")
        assert admission.PREFILL_CHUNK * per_token <= held_bytes <= (admission.PREFILL_CHUNK + KEEP_ROOM) * per_token
        faulty.fault = None
        again = e.submit(req)
        again.result()
        assert again.stats.reused_tokens == admission.PREFILL_CHUNK, "the computed part is reused"
    finally:
        e.close()


def test_close_stops_the_running_request(fp32_model, fmt):
    e = local_engine(fp32_model.model, "cpu", KVStore(64 * MiB, 600), EngineLimits(), fp32_model.kv_bytes_per_token)
    ids = render_prompt(fmt, "You are a helpful assistant.", [("user", "Write a very long story.")])
    h = e.submit(GenerationRequest(prompt_ids=ids, max_new_tokens=400, repetition_penalty=1.0))
    next(ev for ev in h.events() if isinstance(ev, Tokens))
    e.close(timeout=WAIT_S)
    assert not e._thread.is_alive()
    h.result()
    assert h.stats.finish_reason == "cancelled" and h.stats.generated_tokens < 400


# ---- fragmentation: idle release of the allocator cache (CUDA logic, injected figures)


class _FakeAllocator:
    """reserved/allocated figures as torch.cuda.memory_stats would give them; empty_cache() gives
    back everything reserved but unallocated except `stuck` bytes (segments split by live tensors)."""

    def __init__(self, allocated, reserved, stuck=0):
        self.allocated, self.reserved, self.stuck, self.empties = allocated, reserved, stuck, 0

    def snapshot(self, device="cuda", peak_rss=0):
        return MemorySnapshot(
            rss_bytes=1,
            cuda_allocated_bytes=self.allocated,
            cuda_reserved_bytes=self.reserved,
            cuda_peak_bytes=self.allocated,
            cuda_inactive_split_bytes=self.stuck,
        )

    def empty_cache(self):
        self.empties += 1
        self.reserved = min(self.reserved, self.allocated + self.stuck)


@pytest.fixture
def idle_engine(fp32_model, monkeypatch):
    """An engine whose worker has stopped (so only the test calls _idle), on a pretend CUDA device."""
    e = local_engine(
        fp32_model.model,
        "cpu",
        KVStore(64 * MiB, 600),
        EngineLimits(frag_release_bytes=256 * MiB),
        fp32_model.kv_bytes_per_token,
    )
    e.close()
    alloc = _FakeAllocator(allocated=1000 * MiB, reserved=1100 * MiB)
    monkeypatch.setattr(runner_mod, "is_cuda", lambda device: True)
    monkeypatch.setattr(runner_mod, "memory_snapshot", alloc.snapshot)
    monkeypatch.setattr(torch.cuda, "empty_cache", alloc.empty_cache)
    return e, alloc


def test_idle_releases_the_allocator_cache_only_past_the_threshold(idle_engine):
    e, alloc = idle_engine
    e._idle()  # 100 MiB reserved but unallocated: under 256 MiB, leave it
    assert alloc.empties == 0 and e.counters.idle_releases == 0

    alloc.reserved = 1400 * MiB  # 400 MiB: past the threshold
    e._idle()
    assert alloc.empties == 1 and alloc.reserved == 1000 * MiB
    assert e.counters.idle_releases == 1 and e.counters.idle_released_bytes == 400 * MiB
    e._idle()
    assert alloc.empties == 1, "nothing left to release: no second call"


def test_idle_release_does_not_repeat_for_memory_it_cannot_free(idle_engine):
    e, alloc = idle_engine
    alloc.reserved, alloc.stuck = 1600 * MiB, 300 * MiB  # 600 MiB, of which 300 MiB cannot be freed
    assert e.release_fragmentation() == 300 * MiB
    for _ in range(5):  # the worker idles once a second; the stuck 300 MiB stay over the threshold
        e._idle()
    assert alloc.empties == 1 and e.counters.idle_releases == 1
    alloc.reserved += 200 * MiB  # more got cached since: worth another try
    e._idle()
    assert alloc.empties == 2 and e.counters.idle_released_bytes == 500 * MiB


def test_stats_report_the_fragmentation_figures(fp32_model, fmt, monkeypatch):
    alloc = _FakeAllocator(allocated=700 * MiB, reserved=900 * MiB, stuck=50 * MiB)
    monkeypatch.setattr(runner_mod, "memory_snapshot", alloc.snapshot)  # the device stays "cpu"
    monkeypatch.setattr(runner_base, "memory_snapshot", alloc.snapshot)  # a finished request's stats (runners/base.py)
    e = local_engine(fp32_model.model, "cpu", KVStore(64 * MiB, 600), EngineLimits(), fp32_model.kv_bytes_per_token)
    try:
        ids = render_prompt(fmt, "You are a helpful assistant.", [("user", "Hello")])
        h = e.submit(GenerationRequest(prompt_ids=ids, max_new_tokens=2))
        h.result()
        mem = h.stats.to_dict()["mem"]
        assert mem["cuda_fragmentation_bytes"] == 200 * MiB  # reserved − allocated
        assert mem["cuda_inactive_split_bytes"] == 50 * MiB
    finally:
        e.close()


# ---- LLMWEB_OFFLOAD


def test_offload_kwargs_cap_the_gpu_and_use_a_folder_in_the_data_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (20 * 2**30, 24 * 2**30))
    settings = make_settings(tmp_path / "data", offload=True, mem_margin_mb=512)
    kw = models.load_kwargs(settings, "fp16", "cuda")
    assert kw["device_map"] == "auto" and kw["dtype"] == torch.float16 and "quantization_config" not in kw
    assert kw["max_memory"][0] == 20 * 2**30 - 512 * MiB
    assert 0 < kw["max_memory"]["cpu"] <= psutil.virtual_memory().total
    assert Path(kw["offload_folder"]) == settings.data_dir / "offload" and Path(kw["offload_folder"]).is_dir()


def test_offload_with_4bit_or_8bit_weights_is_refused_with_the_setting_to_change(tmp_path, monkeypatch):
    """transformers 5.24 quantises every linear before it turns device_map="auto" into a dict, so the
    layers bound for the CPU or disk would be 4-bit too (bitsandbytes reads `keys_on_cpu` from a dict
    only): refused, rather than a load that was never run."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (20 * 2**30, 24 * 2**30))
    settings = make_settings(tmp_path / "data", offload=True)
    for quant in ("4bit", "8bit"):
        with pytest.raises(
            ConfigError, match="LLMWEB_OFFLOAD=1 is not supported with 4-bit or 8-bit.*LLMWEB_QUANT=fp16"
        ):
            models.load_kwargs(settings, quant, "cuda")
    assert not (tmp_path / "data" / "offload").exists()


def test_offload_is_for_cuda_only_and_off_by_default(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (20 * 2**30, 24 * 2**30))
    on = make_settings(tmp_path / "data", offload=True)
    assert models.load_kwargs(on, "4bit", "cpu")["device_map"] == {"": "cpu"}
    off = models.load_kwargs(on.replace(offload=False), "4bit", "cuda")
    assert off["device_map"] == {"": "cuda"} and "max_memory" not in off and "offload_folder" not in off
    assert not off["quantization_config"].llm_int8_enable_fp32_cpu_offload
    assert not (tmp_path / "data" / "offload").exists()
    # GPU memory below the margin: nothing is pinned on the GPU rather than an impossible cap
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (256 * MiB, 24 * 2**30))
    assert models.load_kwargs(on, "fp16", "cuda")["max_memory"][0] == 0


# ---- login


def test_auth_refuses_anonymous_callers_and_admits_the_user(tmp_path, app_model):
    settings = make_settings(tmp_path / "data", auth="u:p", max_new_tokens=8)
    check = launch_kwargs(settings)["auth"]  # an async check (scrypt runs off the event loop)
    assert asyncio.run(check("u", "p")) and not asyncio.run(check("u", "x"))
    assert asyncio.run(launch_kwargs(settings.replace(auth="u:p:q"))["auth"]("u", "p:q")), "a password may hold ':'"
    assert launch_kwargs(settings.replace(auth=""))["auth"] is None
    rt = Runtime(settings, loaded=app_model).start(background=False)
    try:
        with serve(rt) as (_demo, url):
            with pytest.raises(Exception, match="credentials were not provided"):
                Client(url, verbose=False).predict("Hello", "", api_name="/chat")
            with pytest.raises(ValueError, match="Could not login"):
                Client(url, auth=("u", "wrong"), verbose=False)
            r = httpx.post(url + "gradio_api/call/chat", json={"data": ["Hello", ""]})
            assert r.status_code == 401
            assert Client(url, auth=("u", "p"), verbose=False).predict("Say hi.", "", api_name="/chat")[0].strip()
        assert len(rt.store.list_conversations("user:u")) == 1, "only the logged-in call reached the chat, as user u"
        assert rt.store.list_conversations(LOCAL) == []
    finally:
        rt.close()
