"""The engine process's supervisor (engine/process.py) and wire (engine/boundary.py), with real
processes that serve a FakeRunner (tests/engine/fake_worker.py) under the real scheduler: a death
mid-stream, a restart, a crash loop, recycling. Real-model versions: test_process.py."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from llmweb.engine.process import EngineProcess, ProcessRunner, Recycle
from llmweb.engine.request import EngineLimits, GenerationRequest
from llmweb.engine.scheduler import Engine
from llmweb.errors import ConfigError, EngineStopped, LlmwebError
from tests.engine.workers import FAKE, launcher


def wait_for(cond, timeout=10.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def process_engine(spec=None, recycle=None, **limits):
    launched: list[EngineProcess] = []
    statuses: list[str] = []
    runner = ProcessRunner(launcher(FAKE, spec or {}, launched), recycle=recycle or Recycle(), status=statuses.append)
    runner.boot()
    limits.setdefault("max_batch", 4)
    engine = Engine(runner, runner.kv, EngineLimits(**limits))
    return engine, runner, launched, statuses


def req(ids=(1, 2, 3, 4, 5), n=8, **kw) -> GenerationRequest:
    return GenerationRequest(prompt_ids=list(ids), max_new_tokens=n, **kw)


@pytest.fixture
def proc():
    made = []

    def make(*args, **kw):
        made.append(process_engine(*args, **kw))
        return made[-1]

    yield make
    for engine, *_ in made:
        engine.close()


def test_replies_cross_the_boundary_as_the_runner_gives_them(proc):
    engine, runner, launched, _ = proc()
    h = engine.submit(req((10, 11, 12, 13), n=8, session_id="s", owner="alice"))
    assert h.result() == [11, 12, 13]  # FakeRunner echoes the prompt's last 3 ids, then ends as eos
    assert h.stats.finish_reason == "eos" and h.stats.prefilled_tokens == 4
    assert h.stats.mem is not None and h.stats.mem.rss_bytes == 1  # the runner's release stats crossed
    again = engine.submit(req((10, 11, 12, 13, 11, 12, 13, 14), n=2, session_id="s", owner="alice"))
    assert again.result() == [12, 13]  # cut by the length cap, here, as there
    assert again.stats.reused_tokens == 7 and again.stats.finish_reason == "length"
    assert engine.kv.sessions() == [] and launched[0].alive  # FakeRunner keeps its own sessions
    assert runner.pid == launched[0].pid != os.getpid()


def test_kill_9_mid_stream_ends_every_stream_and_a_new_process_answers(proc):
    engine, runner, launched, statuses = proc({"token_delay_s": 0.05, "default_len": 200})
    handles = [engine.submit(req(range(1, 300), n=200, owner=o)) for o in ("a", "b", "c")]
    wait_for(lambda: all(len(h.generated) > 2 for h in handles), what="three streams")
    os.kill(launched[0].pid, signal.SIGKILL)
    ended = []
    for h in handles:
        t0 = time.monotonic()
        with pytest.raises(EngineStopped, match="press retry"):
            for _ in h.events():
                pass
        ended.append(time.monotonic() - t0)
        assert h.generated, "the partial reply stays on the handle"
    assert max(ended) < 5.0
    after = engine.submit(req((7, 8, 9), n=4))
    assert after.result() == [7, 8, 9]
    assert len(launched) == 2 and runner.restarts == 1 and launched[1].pid == runner.pid
    assert any("restarting the model" in s for s in statuses)


def test_a_request_that_arrives_during_the_restart_waits_and_is_answered(proc):
    engine, runner, launched, _ = proc({"token_delay_s": 0.01})
    os.kill(launched[0].pid, signal.SIGKILL)
    h = engine.submit(req((4, 5, 6), n=4))  # may meet the dead process or wait for the new one
    try:
        got = h.result()
    except EngineStopped:  # it started on the dead one: the next is answered
        got = engine.submit(req((4, 5, 6), n=4)).result()
    assert got == [4, 5, 6] and len(launched) == 2


def test_three_deaths_within_a_minute_stop_the_restarts_and_say_so(proc):
    engine, runner, launched, statuses = proc()
    for n in range(3):
        wait_for(
            lambda n=n: len(launched) > n and launched[n].alive and runner.pid == launched[n].pid, what="a process"
        )
        os.kill(launched[n].pid, signal.SIGKILL)
        wait_for(lambda n=n: not launched[n].alive)
    wait_for(lambda: bool(runner.gave_up), what="giving up")
    time.sleep(0.3)
    assert len(launched) == 3, "no fourth process after the third death"
    with pytest.raises(EngineStopped, match="3 times within a minute"):
        engine.submit(req()).result()
    assert "3 times within a minute" in statuses[-1]


def test_a_load_that_fails_is_raised_with_its_message(proc):
    with pytest.raises(ConfigError, match="no such model"):
        proc({"fail_load": "no such model"})


def test_recycle_after_5_answers_all_20_requests_by_at_least_3_processes(proc):
    engine, runner, launched, _ = proc({"token_delay_s": 0.04, "default_len": 6}, recycle=Recycle(after=5))
    results: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def client(i: int) -> None:
        for j in range(5):
            n = i * 5 + j
            try:
                results[n] = engine.submit(req(range(n + 10, n + 20), n=6, owner=f"u{i}")).result()
            except BaseException as e:  # noqa: BLE001 (the assert below names it)
                errors.append(e)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert sorted(results) == list(range(20))
    assert all(results[n] == list(range(n + 14, n + 20)) for n in range(20))
    assert runner.recycles >= 2 and len(launched) >= 3
    wait_for(lambda: sum(c.alive for c in launched) == 1, what="the drained processes to stop")
    assert sum(c.started for c in launched) == 20


def test_the_kv_store_and_memory_are_the_engine_process_s(proc):
    engine, runner, launched, _ = proc()
    assert engine.kv.budget_bytes == 1 << 20 and engine.kv.total_bytes == 0
    assert engine.kv.drop("nothing") is False and engine.kv.expire() == 0
    assert runner.snapshot().rss_bytes == 1  # FakeRunner's figure, from the other side
    assert runner.available() == 1 << 40 and runner.predict(req()) == 1
    assert runner.padding(req(), [req((1, 2))]) == (0, 0)  # the fake's figure: admission's padding crosses too


def test_only_the_runner_s_calls_are_dispatched_and_a_refusal_leaves_the_process_up(proc):
    engine, runner, launched, _ = proc()
    with pytest.raises(LlmwebError, match="no KV call"):
        launched[0].call(("call", "kv", ("__class__",)))
    with pytest.raises(LlmwebError, match="does not know"):
        launched[0].call(("call", "close", ()))
    assert launched[0].alive and engine.submit(req((1, 2), n=2)).result() == [1, 2]


def test_fragmentation_past_the_limit_recycles_the_process(proc):
    from llmweb.records import MemorySnapshot

    engine, runner, launched, _ = proc(recycle=Recycle(frag_bytes=100 * 2**20))
    # reserved − allocated is mostly the allocator's cache of freed activations: no fragmentation
    cached = MemorySnapshot(
        cuda_allocated_bytes=1 << 30, cuda_reserved_bytes=3 << 30, cuda_inactive_split_bytes=50 << 20
    )
    runner._recycle_due(launched[0], cached)
    assert not runner.loading and len(launched) == 1
    split = MemorySnapshot(
        cuda_allocated_bytes=1 << 30, cuda_reserved_bytes=(1 << 30) + 250 * 2**20, cuda_inactive_split_bytes=200 << 20
    )
    runner._recycle_due(launched[0], split)  # as after a request whose snapshot shows this
    wait_for(lambda: len(launched) == 2 and runner.pid == launched[1].pid, what="the replacement")
    wait_for(lambda: not launched[0].alive, what="the old process to stop")
    assert runner.recycles == 1 and engine.submit(req((3, 4), n=2)).result() == [3, 4]


def test_the_api_tells_a_client_to_retry_when_the_model_process_stopped():
    from llmweb.web.api.errors import api_error

    e = api_error(EngineStopped("The model process stopped; your message was not lost: press retry."))
    assert e.status == 503 and e.headers.get("Retry-After") and "press retry" in str(e.body())


def test_a_restart_that_cannot_load_counts_as_a_death_until_llmweb_gives_up(proc, tmp_path):
    gone = tmp_path / "model-gone"
    engine, runner, launched, statuses = proc({"fail_if": str(gone)})
    gone.touch()
    os.kill(launched[0].pid, signal.SIGKILL)
    wait_for(lambda: bool(runner.gave_up), what="giving up")
    assert len(launched) == 3, "the death, then two failed loads: three within a minute"
    assert "3 times within a minute" in statuses[-1]
    with pytest.raises(EngineStopped, match="3 times within a minute"):
        engine.submit(req()).result()


def test_a_recycle_whose_replacement_cannot_load_leaves_the_old_one_serving(proc, tmp_path):
    gone = tmp_path / "model-gone"
    engine, runner, launched, _ = proc({"fail_if": str(gone)}, recycle=Recycle(after=2))
    gone.touch()
    for _ in range(4):
        assert engine.submit(req((5, 6, 7), n=3)).result() == [5, 6, 7]
        wait_for(lambda: not runner.loading, what="the replacement's load to end")
    assert len(launched) == 2 and runner.recycles == 0 and not runner.gave_up
    assert runner.pid == launched[0].pid and launched[0].alive  # tried once; again only after a minute


def test_closing_while_a_restart_loads_stops_every_process_and_the_waiting_request(tmp_path):
    slow = tmp_path / "slow"
    launched: list[EngineProcess] = []
    runner = ProcessRunner(launcher(FAKE, {"load_wait_if": str(slow)}, launched))
    runner.boot()
    engine = Engine(runner, runner.kv, EngineLimits(max_batch=2))
    slow.touch()  # the next process takes its time to load
    os.kill(launched[0].pid, signal.SIGKILL)
    wait_for(lambda: len(launched) == 2, what="the restart to begin")
    waiting = engine.submit(req())
    t0 = time.monotonic()
    engine.close(timeout=1.0)
    assert time.monotonic() - t0 < 5.0
    with pytest.raises(LlmwebError):
        waiting.result()
    wait_for(lambda: not any(c.alive for c in launched), what="every engine process to stop")


def test_the_engine_process_finds_llmweb_from_any_working_directory(tmp_path):
    import subprocess
    import sys

    from llmweb.runtime.worker import child_env

    plain = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    code = "import llmweb.runtime.worker"
    lost = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=plain, capture_output=True)
    installed = lost.returncode == 0  # pip-installed into the environment: found either way
    assert installed or b"No module named 'llmweb'" in lost.stderr
    found = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=child_env(), capture_output=True)
    assert found.returncode == 0, found.stderr.decode()[-300:]


def test_a_hand_over_answered_with_an_error_leaves_no_process_behind_and_recycling_goes_on(proc):
    engine, runner, launched, _ = proc(
        {"keep_caches": True, "fail_import": True, "token_delay_s": 0.2, "default_len": 5}
    )
    assert engine.submit(req((1, 2), n=2, session_id="chat-a")).result() == [1, 2]
    long = engine.submit(req(n=10, session_id="chat-b"))  # 0.8 s: it ends on the old process after the switch
    wait_for(lambda: bool(launched[0].keys), what="the request to run on the first process")
    assert runner.recycle_now(timeout=10.0), "the replacement serves although its hand-over failed"
    assert long.result() == [1, 2, 3, 4, 5], "a reply that finished on the draining process is no failure"
    wait_for(lambda: not launched[0].alive, what="the drained process to stop")
    assert runner.hand_over_failures == 2, "at the switch, and again when the old one drained"
    assert runner.recycle_now(timeout=10.0), "recycling goes on"
    wait_for(lambda: [c.alive for c in launched] == [False, False, True], what="only the serving process")
    assert runner.pid == launched[2].pid and engine.submit(req((3, 4), n=2)).result() == [3, 4]


def test_a_sticky_device_error_fails_its_step_ends_the_process_and_a_new_one_answers(proc, tmp_path):
    armed = tmp_path / "device-assert"
    text = "CUDA error: device-side assert triggered"
    engine, runner, launched, _ = proc({"raise_when": [str(armed), text], "default_len": 5})
    armed.touch()
    with pytest.raises(LlmwebError, match="device-side assert"):
        engine.submit(req(n=5)).result()
    wait_for(lambda: not launched[0].alive, what="the poisoned process to end")
    assert launched[0].proc.returncode == 3
    assert engine.submit(req((3, 4), n=2)).result() == [3, 4], "the supervisor restarted it"
    assert len(launched) == 2 and runner.restarts == 1


def test_an_ordinary_error_leaves_the_process_serving(proc, tmp_path):
    armed = tmp_path / "bug"
    engine, runner, launched, _ = proc({"raise_when": [str(armed), "shape mismatch"], "default_len": 5})
    armed.touch()
    with pytest.raises(LlmwebError, match="shape mismatch"):
        engine.submit(req(n=5)).result()
    assert engine.submit(req((3, 4), n=2)).result() == [3, 4] and launched[0].alive and len(launched) == 1


def test_a_later_engine_process_is_sized_as_the_first_not_to_what_the_old_one_leaves(tmp_path, monkeypatch):
    from types import SimpleNamespace

    import torch

    from llmweb.runtime.worker import WorkerSpec, fit_memory
    from tests.conftest import make_settings

    settings = make_settings(tmp_path / "data", max_batch=8)

    def loaded():  # an 8B llama's shape in bf16: 128 KiB of KV a token
        return SimpleNamespace(
            on_cpu=False, max_context=8192, kv_bytes_per_token=2**17, name="m", notes=[], kv_store_bytes=0, max_batch=0
        )

    free = [12 * 2**30]
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (free[0], 80 * 2**30))
    first = loaded()
    budget = fit_memory(WorkerSpec(settings), first)
    info = {"max_context": first.max_context, "max_batch": first.max_batch, "kv_budget_bytes": budget}
    free[0] = 3 * 2**30  # during a recycle the old process still holds its weights and caches
    squeezed = loaded()
    assert fit_memory(WorkerSpec(settings), squeezed) < budget and squeezed.max_batch < first.max_batch
    later = loaded()
    assert fit_memory(WorkerSpec(settings, sized=info), later) == budget
    assert (later.max_context, later.max_batch) == (first.max_context, first.max_batch) and not later.notes


def test_the_schedulers_small_chunks_reach_the_runner_in_the_engine_process():
    """`Slot.small_chunks` is the scheduler's (web process) and the chunk is the runner's (engine
    process): the flag crosses with each prefill call, or every visitor's chunk stays full-size."""
    from multiprocessing.connection import Pipe
    from types import SimpleNamespace

    from llmweb.engine.boundary import serve
    from llmweb.engine.kvcache import KVStore
    from llmweb.engine.process import _Placed
    from llmweb.engine.request import Slot
    from llmweb.records import GenerationStats
    from tests.fakes import FakeRunner

    class Flags(FakeRunner):
        def __init__(self):
            super().__init__()
            self.flags: list[bool] = []

        def prefill(self, slot) -> bool:
            self.flags.append(slot.small_chunks)
            return super().prefill(slot)

    runner = Flags()
    web, child = Pipe()
    thread = threading.Thread(target=serve, args=(child, runner, KVStore(0, 1)), daemon=True)
    thread.start()
    try:
        request = GenerationRequest([1, 2, 3], 2, owner="visitor")
        key = 7
        web.send(("start", key, request))
        web.recv()

        class Child:  # the web process's end of the wire, as ProcessRunner holds it
            def call(self, msg):
                web.send(msg)
                kind, value = web.recv()
                assert kind == "ok", value
                return value

        sink = SimpleNamespace(_emit=lambda ids, logprobs=None: None)
        slot = Slot(sink, request, 0, 60.0, GenerationStats(prompt_tokens=3))  # type: ignore[arg-type]
        slot.state = _Placed(Child(), key)  # type: ignore[call-arg]
        slot.small_chunks = True
        ProcessRunner.prefill(None, slot)  # type: ignore[arg-type]
        assert runner.flags == [True]
    finally:
        web.send(("exit",))
        thread.join(5)
