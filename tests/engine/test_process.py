"""The real model through the engine process (engine/process.py), on both local runners: greedy
replies alone and in a batch, a cancel in a batch, session reuse, an OOM that gives way, kill -9
of the engine process under 3 streams, a native crash inside it, recycling; and the app's own
wiring (runtime/worker.py) with kill -9 under 3 chats, their partial replies stored and marked."""

from __future__ import annotations

import os
import signal
import threading
import time
import urllib.request

import pytest

from llmweb.engine.process import EngineProcess, ProcessRunner, Recycle
from llmweb.engine.request import EngineLimits
from llmweb.engine.scheduler import Engine
from llmweb.errors import EngineStopped
from llmweb.records import ENGINE_STOPPED
from tests.conftest import make_settings
from tests.engine.test_engine import QUESTIONS, alone, cancel_in_a_batch, oom_in_a_batch, prompt, req, same_greedy
from tests.engine.workers import REAL, FaultySpec, launcher

pytestmark = pytest.mark.slow


def wait_for(cond, timeout=60.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


class Boundary:
    """An Engine over a ProcessRunner whose engine processes load `runner`'s model from settings."""

    def __init__(self, runner, tmp_path, fault: str = "", recycle: Recycle | None = None, **limits):
        # the model of `runner` in this process: fp32, or the GGUF file as it ships (conftest's llama_model)
        extra = {"quant": "fp32"} if runner.name == "transformers" else {"gguf_requant": "none"}
        limits.setdefault("max_batch", 4)
        settings = make_settings(
            tmp_path / "engine", backend=runner.name, device="cpu", max_batch=limits["max_batch"], **extra
        )
        self.launched: list[EngineProcess] = []
        self.statuses: list[str] = []
        self.runner = ProcessRunner(
            launcher(REAL, FaultySpec(settings, fault), self.launched),
            recycle=recycle or Recycle(),
            status=self.statuses.append,
        )
        info = self.runner.boot()
        assert info["backend"] == runner.name and info["pid"] != os.getpid()
        self.engine = Engine(self.runner, self.runner.kv, EngineLimits(**limits))

    def close(self) -> None:
        self.engine.close()


def test_greedy_in_a_batch_a_cancel_and_session_reuse_cross_the_boundary(runner, fmt, tmp_path):
    requests = [req(fmt, prompt(fmt, ("user", q)), n=24, owner=f"v{i}") for i, q in enumerate(QUESTIONS)]
    expected = alone(runner, requests)  # in this process
    b = Boundary(runner, tmp_path)
    try:
        e = b.engine
        handles = [e.submit(r) for r in requests]
        for h, serial in zip(handles, expected, strict=True):
            same_greedy(runner, h.result(), serial)
        assert max(h.stats.batch_size for h in handles) == 4
        assert handles[0].stats.mem.rss_bytes > 0 and handles[0].stats.prefilled_tokens == len(requests[0].prompt_ids)

        cancel_in_a_batch(runner, e, requests, expected)  # the others' replies as they were

        history, texts, reused = [], [], []  # session reuse: the same text as a full prefill
        for q in ("What is the capital of France?", "And of Germany?", "Name a river there."):
            history.append(("user", q))
            h = e.submit(req(fmt, prompt(fmt, *history), n=24, session_id="A", owner="alice"))
            texts.append(fmt.decode(h.result()))
            reused.append(h.stats.reused_tokens)
            history.append(("assistant", texts[-1]))
        assert reused[0] == 0 and all(r > 0 for r in reused[1:])
        assert e.kv.sessions() == ["A"] and e.kv.total_bytes > 0
        full = alone(runner, [req(fmt, prompt(fmt, *history[:-1]), n=24)])[0]
        assert fmt.decode(full) == texts[-1]
    finally:
        b.close()


def test_an_oom_in_a_batched_step_restarts_only_the_youngest_through_the_boundary(runner, fmt, tmp_path):
    arm = tmp_path / "arm-oom"  # the engine process's fault fires once this file exists
    b = Boundary(runner, tmp_path, fault=f"oom-when:{arm}")
    try:
        oom_in_a_batch(runner, fmt, b.engine, arm.touch)
        assert len(b.launched) == 1 and b.launched[0].alive  # an OOM is no death
    finally:
        b.close()


def test_kill_9_under_three_streams_ends_them_at_once_and_the_next_is_answered(runner, fmt, tmp_path):
    b = Boundary(runner, tmp_path)
    try:
        e = b.engine
        handles = [
            e.submit(req(fmt, prompt(fmt, ("user", q)), n=200, owner=f"v{i}")) for i, q in enumerate(QUESTIONS[:3])
        ]
        wait_for(lambda: all(len(h.generated) >= 3 for h in handles), what="three streams")
        killed = time.monotonic()
        os.kill(b.runner.pid, signal.SIGKILL)
        for h in handles:
            with pytest.raises(EngineStopped, match="press retry"):
                h.result()
            assert len(h.generated) >= 3
        assert time.monotonic() - killed < 5.0
        after = e.submit(req(fmt, prompt(fmt, ("user", QUESTIONS[0])), n=8))
        assert len(after.result()) >= 1 and time.monotonic() - killed < 90.0
        assert len(b.launched) == 2 and b.runner.restarts == 1
    finally:
        b.close()


@pytest.mark.parametrize("crash", ["segv", "abort"])
def test_a_native_crash_inside_the_engine_process_fails_the_request_and_it_restarts(llama_model, fmt, tmp_path, crash):
    from tests.fakes import RunnerKind

    kind = RunnerKind("llama.cpp", llama_model, MemoryError)
    b = Boundary(kind, tmp_path, fault=f"{crash}@6")  # the 6th model pass: a prefill, then decode steps
    try:
        h = b.engine.submit(req(fmt, prompt(fmt, ("user", QUESTIONS[0])), n=50))
        with pytest.raises(EngineStopped, match="press retry"):
            h.result()
        assert 1 <= len(h.generated) < 50
        code = b.launched[0].proc.wait(5)
        assert code == -(signal.SIGSEGV if crash == "segv" else signal.SIGABRT)
        wait_for(lambda: len(b.launched) == 2 and b.runner.pid == b.launched[1].pid, what="the restart")
        assert any("restarting the model" in s for s in b.statuses)
    finally:
        b.close()


def test_recycle_after_5_serves_20_requests_4_at_a_time_on_3_processes(llama_model, fmt, tmp_path):
    from tests.fakes import RunnerKind

    kind = RunnerKind("llama.cpp", llama_model, MemoryError)
    b = Boundary(kind, tmp_path, recycle=Recycle(after=5))
    try:
        results, errors = {}, []

        def client(i):
            for j in range(5):
                n = i * 5 + j
                try:
                    h = b.engine.submit(
                        req(fmt, prompt(fmt, ("user", QUESTIONS[n % len(QUESTIONS)])), n=24, owner=f"u{i}")
                    )
                    results[n] = h.result()
                except Exception as e:  # noqa: BLE001 (the assert names it)
                    errors.append(e)

        threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert not errors and sorted(results) == list(range(20))
        served = [c.started for c in b.launched]
        assert len([n for n in served if n]) >= 3 and sum(served) == 20, served
        first = alone(kind, [req(fmt, prompt(fmt, ("user", QUESTIONS[0])), n=24)])[0]
        same_greedy(kind, results[0], first)
    finally:
        b.close()


def test_the_app_s_engine_process_killed_under_three_chats(tmp_path):
    """The Runtime as `make run` builds it (its own engine process, llama.cpp): kill -9 under three
    streaming chats; the streams end with the message, the partial replies are stored and marked,
    the page still answers, and a new message is answered without restarting the app."""
    from llmweb.chat.turn import Delta, Finished
    from llmweb.cli.main import launch_app
    from llmweb.runtime import Runtime

    settings = make_settings(tmp_path / "app", max_new_tokens=200, engine_process="1")
    rt = Runtime(settings).start(background=False)
    demo, url = launch_app(rt, server_port=None, quiet=True, prevent_thread_lock=True)
    try:
        assert rt.loaded.model is None and rt.engine.runner.pid != os.getpid()
        owners = {rt.store.create_conversation(o): o for o in ("alice", "bob", "carol")}  # 3 visitors
        convs = list(owners)
        seen = {c: 0 for c in convs}
        errors: dict[str, BaseException] = {}

        def chat(conv):
            try:
                for ev in rt.chat.send(owners[conv], conv, f"Tell me a long story about {owners[conv]} and the sea."):
                    if isinstance(ev, Delta):
                        seen[conv] += 1
            except EngineStopped as e:
                errors[conv] = e

        threads = [threading.Thread(target=chat, args=(c,)) for c in convs]
        for t in threads:
            t.start()
        wait_for(lambda: all(n >= 3 for n in seen.values()), what="three streams")
        killed = time.monotonic()
        os.kill(rt.engine.runner.pid, signal.SIGKILL)
        for t in threads:
            t.join(10)
        assert time.monotonic() - killed < 10.0 and set(errors) == set(convs)
        with urllib.request.urlopen(url, timeout=10) as page:
            assert page.status == 200
        for c in convs:
            (turn,) = rt.store.get(owners[c], c).turns
            assert turn.assistant and turn.stats.gen.finish_reason == ENGINE_STOPPED
        conv = rt.store.create_conversation("local")
        fin = next(ev for ev in rt.chat.send("local", conv, "Say hello.") if isinstance(ev, Finished))
        assert fin.reply and time.monotonic() - killed < 90.0
    finally:
        demo.close()
        rt.close()


def test_a_recycle_hands_the_chats_caches_over_and_the_next_turn_reuses_its_prefix(runner, fmt, tmp_path):
    kind = runner
    b = Boundary(kind, tmp_path)
    try:
        history: list[tuple[str, str]] = []
        texts, reused = [], []
        for q in ("What is the capital of France?", "And of Germany?", "Name a river there."):
            if q == "Name a river there.":
                assert b.runner.recycle_now(timeout=120)  # the next turn runs on a new engine process
                assert len(b.launched) == 2 and b.runner.handed_over == 1
            history.append(("user", q))
            h = b.engine.submit(req(fmt, prompt(fmt, *history), n=24, session_id="A", owner="alice"))
            texts.append(fmt.decode(h.result()))
            reused.append(h.stats.reused_tokens)
            history.append(("assistant", texts[-1]))
        assert reused[2] > reused[1] > 0, reused  # the handed-over cache served the third turn's prefix
        wait_for(lambda: not b.launched[0].alive, what="the old process to stop")
        full = alone(kind, [req(fmt, prompt(fmt, *history[:-1]), n=24)])[0]
        assert fmt.decode(full) == texts[-1]
    finally:
        b.close()
