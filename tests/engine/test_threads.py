"""The decode-thread governor (engine/runners/threads.py) on scripted CPU samples, and on this machine."""

from __future__ import annotations

from llmweb.engine.runners import threads
from llmweb.engine.runners.threads import ThreadGovernor, cpu_sample


def scripted(others_cores: list[float], own_cores: float = 1.8):
    """Samples 0.5 s apart in which other processes used `others_cores[i]` cores and we `own_cores`."""
    state = {"t": 0.0, "busy": 0.0, "own": 0.0, "i": 0}

    def sample():
        i = state["i"]
        state["i"] += 1
        if i:
            other = others_cores[min(i - 1, len(others_cores) - 1)]
            state["t"] += threads.SAMPLE_S
            state["busy"] += (other + own_cores) * threads.SAMPLE_S
            state["own"] += own_cores * threads.SAMPLE_S
        return state["t"], state["busy"], state["own"]

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
    g = ThreadGovernor(2, lambda: calls.append(1) or (0.0, 0.0, 0.0), clock=lambda: 0.0)
    assert [g.threads() for _ in range(5)] == [2] * 5 and len(calls) == 1, "not due: /proc/stat is not read"
    assert ThreadGovernor(1, scripted([5.0]), ticking()).threads() == 1
    assert ThreadGovernor(4, scripted([0.0, 3.0]), ticking()).threads() == 4
    assert ThreadGovernor(4, scripted([3.0]), ticking()).threads() == 3


def test_this_machine_gives_a_sample():
    s = cpu_sample()
    assert s is not None and s[1] >= 0 and s[2] >= 0
