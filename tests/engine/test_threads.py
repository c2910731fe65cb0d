"""The decode-thread governor (engine/runners/threads.py) on scripted CPU samples, and on this machine."""

from __future__ import annotations

from llmweb.engine.runners import threads
from llmweb.engine.runners.threads import KinSample, ThreadGovernor, cpu_sample


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


def test_the_first_reading_after_an_idle_spell_starts_a_short_window_and_decides_nothing():
    """A minute idle, during which another process was busy for half of it: averaged over the minute
    (0.5 cores) it would take a thread away; it is dropped, the next reading comes FRESH_S later and
    decides alone."""
    state = {"t": 0.0, "busy": 0.0, "own": 0.0}
    clock = {"t": 0.0}

    def sample():
        return state["t"], state["busy"], state["own"]

    def advance(seconds, others, own=1.8):
        state["t"] += seconds
        state["busy"] += (others + own) * seconds
        state["own"] += own * seconds
        clock["t"] += seconds

    g = ThreadGovernor(2, sample, lambda: clock["t"])
    advance(60.0, 0.5, own=0.0)  # idle: a neighbour busy on average
    assert g.threads() == 2 and g.others == 0.0, "the spell's average is not a reading"
    advance(threads.FRESH_S, 0.6)  # the reply's first tenth of a second: a neighbour is busy now
    assert g.threads() == 1, "the fresh window decides, a SAMPLE_S early"
    advance(threads.SAMPLE_S, 0.0)
    assert g.threads() == 1, "while decoding, one quiet window is not enough"
    advance(60.0, 0.0, own=0.0)
    assert g.threads() == 1, "the last decision holds over the stale reading"
    advance(threads.FRESH_S, 0.0)
    assert g.threads() == 2, "after an idle spell, one quiet fresh window gives the thread back"


BURN = """
import sys, threading, time
from llmweb.retrieval.background import in_background

def burn(cpu_s):
    t0 = time.thread_time()
    while time.thread_time() - t0 < cpu_s:
        pass

done, end = threading.Event(), threading.Event()

def pool_worker():  # as torch's OpenMP worker: born on the background thread, it takes its name, and stays
    burn(0.2)
    done.set()
    end.wait()

def piece():
    threading.Thread(target=pool_worker, daemon=True).start()
    burn(0.3)
    done.wait()

def step(name):
    print(name, flush=True)
    sys.stdin.readline()

step("ready")
in_background("test", piece)
step("background done")
burn(0.4)
step("foreground done")
"""


def test_the_web_process_background_threads_count_as_another_process(tmp_path):
    """A kin process (the web process, for an engine process) is ours, except retrieval/background.py's
    threads (an upload's embedding and OCR) and the threads they start."""
    import subprocess
    import sys

    from llmweb.retrieval import background

    assert background.BACKGROUND_PREFIX.encode() == threads.BACKGROUND_PREFIX, "one name on both sides"

    child = subprocess.Popen([sys.executable, "-c", BURN], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        kin = KinSample(child.pid)
        first = kin()
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "background done"
        after_background = kin()
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "foreground done"
        after_foreground = kin()
        assert first and after_background and after_foreground
        background_own = after_background[2] - first[2]
        foreground_own = after_foreground[2] - after_background[2]
        assert background_own < 0.15, f"0.5 CPU s of background work counted {background_own:.2f} s as ours"
        assert foreground_own > 0.3, f"0.4 CPU s of the kin's own work counted {foreground_own:.2f} s as ours"
    finally:
        child.stdin.close()
        child.wait(timeout=10)
