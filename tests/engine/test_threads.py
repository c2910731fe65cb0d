"""The decode-thread governor (engine/runners/threads.py) on scripted CPU samples, and on this machine."""

from __future__ import annotations

import os

from llmweb.engine.runners import threads
from llmweb.engine.runners.threads import ThreadGovernor, cpu_sample


def scripted(others_cores: list[float], own_cores: float = 1.8, kin_cores: float = 0.0):
    """Samples 0.5 s apart in which other processes used `others_cores[i]` cores, we `own_cores`
    and the process we count as our own (the web process) `kin_cores` of those others'."""
    state = {"t": 0.0, "busy": 0.0, "own": 0.0, "kin": 0.0, "i": 0}

    def sample():
        i = state["i"]
        state["i"] += 1
        if i:
            other = others_cores[min(i - 1, len(others_cores) - 1)]
            state["t"] += threads.SAMPLE_S
            state["busy"] += (other + own_cores) * threads.SAMPLE_S
            state["own"] += own_cores * threads.SAMPLE_S
            state["kin"] += min(kin_cores, other) * threads.SAMPLE_S
        return state["t"], state["busy"], state["own"], state["kin"]

    return sample


def ticking():
    """A clock that moves SAMPLE_S on at each reading: every `threads()` call is due for a sample."""
    state = {"t": 0.0}

    def clock():
        state["t"] += threads.SAMPLE_S
        return state["t"]

    return clock


def test_a_busy_neighbour_takes_a_thread_and_two_quiet_samples_give_it_back():
    g = ThreadGovernor(2, scripted([0.0, 0.6, 0.6, 0.05, 0.3, 0.05, 0.05]), ticking())
    seen = [g.threads() for _ in range(7)]
    assert seen == [2, 1, 1, 1, 1, 1, 2], "down at once; up only after two quiet samples; a middling one holds"


def test_between_samples_the_answer_is_kept_without_reading_and_one_core_never_changes():
    calls = []
    g = ThreadGovernor(2, lambda: calls.append(1) or (0.0, 0.0, 0.0, 0.0), clock=lambda: 0.0)
    assert [g.threads() for _ in range(5)] == [2] * 5 and len(calls) == 1, "not due: /proc/stat is not read"
    assert ThreadGovernor(1, scripted([5.0]), ticking()).threads() == 1
    assert ThreadGovernor(4, scripted([0.0, 3.0]), ticking()).threads() == 4
    assert ThreadGovernor(4, scripted([3.0]), ticking()).threads() == 3


def test_the_web_process_s_streaming_is_ours_and_its_torch_work_is_another_s():
    streaming = ThreadGovernor(2, scripted([0.3, 0.3, 0.3], kin_cores=0.3), ticking())  # all of it the web process's
    assert [streaming.threads() for _ in range(3)] == [2, 2, 2] and abs(streaming.others - 0.05) < 1e-9
    embedding = ThreadGovernor(2, scripted([1.2, 1.2], kin_cores=1.2), ticking())  # an upload's torch threads
    assert [embedding.threads() for _ in range(2)] == [1, 1]
    assert abs(embedding.others - (1.2 - threads.KIN_SHARE)) < 1e-9
    alone = ThreadGovernor(2, scripted([0.3, 0.3]), ticking())  # the same 0.3 cores, another process's
    assert alone.threads() == 1


def test_this_machine_gives_a_sample():
    s = cpu_sample((os.getpid(),))
    assert s is not None and s[1] >= 0 and s[2] >= 0 and s[3] > 0  # this process, counted as kin too
