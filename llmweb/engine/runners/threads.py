"""How many threads llama.cpp decodes with: every core while the machine is otherwise idle, one
fewer while another process keeps a core busy.

Why: llama.cpp's thread pool runs a thread per core and waits at every graph node (hundreds per
token) for the slowest one, so a core that another process takes stalls every step. Measured on
the 2-core machine with a reply streaming into a headless Chromium on the same machine (Chromium
took ~0.65 of a core): 2 decode threads gave 15-17 tok/s, 1 thread 31-43 tok/s, while alone 2
threads decode 90 tok/s and 1 thread 61 (llama-bench tg64). So the pool shrinks while others work
and grows back when they stop. Prefill (compute-bound, and rarely beside a rendering browser)
keeps every core.

    others      the CPU time of every other process (from /proc/stat's busy time minus this
                process's, and the web process's when this is an engine process), in cores,
                over the last SAMPLE_S; the web process's background threads (an upload's
                embedding and OCR, named BACKGROUND_PREFIX: retrieval/background.py) count as others
    stale       the first reading after an idle spell (a window over STALE_S) says nothing of
                the reply starting now: it only starts a window of FRESH_S, and the last decision
                holds until that one is read; a quiet fresh window gives every thread back at once
                (no second sample: there was no decoding to flap)
    fewer       others >= BUSY cores: cores - 1 decode threads (at least 1)
    all again   others < IDLE cores in two samples in a row (no flapping on a single quiet one)

Must not: be used when the user fixed the thread count (LLMWEB_THREADS), or read anything but
/proc/stat, this process's own times and those of the process it counts as its own (and its threads').
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence

SAMPLE_S = 0.5  # how often the others' load is read
BUSY = 0.25  # cores of other processes' work that take a decode thread away
IDLE = 0.10  # ... and below which it comes back
STALE_S = 4 * SAMPLE_S  # a reading over a longer window spans an idle spell
FRESH_S = 0.1  # ... and then the window read next, at the reply's start
BACKGROUND_PREFIX = b"llmweb-bg"  # retrieval/background.py's thread names: another visitor's work


def cpu_sample(kin: Sequence[int] = ()) -> tuple[float, float, float] | None:
    """(wall s, the machine's busy CPU s, the CPU s of this process and of the `kin` processes);
    None where /proc/stat is not there."""
    try:
        with open("/proc/stat", "rb") as f:
            fields = f.readline().split()[1:]
    except OSError:
        return None
    ticks = [int(x) for x in fields[:8]]  # user nice system idle iowait irq softirq steal
    busy = ticks[0] + ticks[1] + ticks[2] + ticks[5] + ticks[6] + ticks[7]
    own = os.times()
    tick = os.sysconf("SC_CLK_TCK")
    return time.monotonic(), busy / tick, own.user + own.system + sum(_cpu_ticks(pid) for pid in kin) / tick


def _cpu_ticks(pid: int) -> int:
    """A process's user + system CPU ticks (/proc/PID/stat fields 14 and 15); 0 when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            after_name = f.read().rpartition(b")")[2].split()
    except OSError:
        return 0
    return int(after_name[11]) + int(after_name[12])


def _thread_ticks(pid: int) -> dict[int, tuple[int, bool]]:
    """Each thread of `pid`: its user + system CPU ticks, and whether it is named as background work."""
    out: dict[int, tuple[int, bool]] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
                name, _, rest = f.read().partition(b"(")[2].rpartition(b")")
        except OSError:
            continue
        fields = rest.split()
        out[int(tid)] = (int(fields[11]) + int(fields[12]), name.startswith(BACKGROUND_PREFIX))
    return out


class KinSample:
    """`cpu_sample` with the process `pid` counted as ours, less the CPU of its threads named as
    background work (at either end of a window: a thread is named only while it does that work)."""

    def __init__(self, pid: int):
        self.pid = pid
        self._last: dict[int, tuple[int, bool]] = {}
        self._background = 0  # ticks, summed over readings

    def __call__(self) -> tuple[float, float, float] | None:
        base = cpu_sample((self.pid,))
        if base is None:
            return None
        now = _thread_ticks(self.pid)
        for tid, (ticks, background) in now.items():
            last = self._last.get(tid)
            if last is None:
                self._background += ticks if background else 0  # born since the last reading
            elif background or last[1]:
                self._background += ticks - last[0]
        self._last = now
        wall, busy, own = base
        return wall, busy, own - self._background / os.sysconf("SC_CLK_TCK")


class ThreadGovernor:
    """`threads()` before each decode step: the decode threads for now (see the module docstring)."""

    def __init__(
        self,
        cores: int,
        sample: Callable[[], tuple[float, float, float] | None] = cpu_sample,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.cores = cores
        self.sample = sample
        self.clock = clock
        self.current = cores
        self.others = 0.0  # the last reading, in cores
        self._last = sample() if cores > 1 else None
        self._due = clock() + SAMPLE_S  # a decode step between readings costs one clock call, no I/O
        self._quiet = 0

    def count_as_own(self, pid: int) -> None:
        """Count `pid`'s CPU time as ours: the web process, for a runner in an engine process
        (its streaming is the reply's own work, as when both were one process), but not its
        background threads' (an upload's embedding: another visitor's work)."""
        self.sample = KinSample(pid)
        self._last = self.sample() if self.cores > 1 else None

    def threads(self) -> int:
        if self._last is None or self.clock() < self._due:
            return self.current
        now = self.sample()
        if now is None or now[0] <= self._last[0]:
            return self.current
        self._due = self.clock() + SAMPLE_S
        wall, busy, own = (b - a for a, b in zip(self._last, now))
        self._last = now
        if wall > STALE_S:  # the first step after an idle spell: read a fresh window first, and
            self._due, self._quiet = self.clock() + FRESH_S, 1  # a quiet one gives every thread back
            return self.current
        self.others = max(busy - own, 0.0) / wall
        if self.others >= BUSY:
            self.current, self._quiet = max(self.cores - 1, 1), 0
        elif self.others < IDLE:
            self._quiet += 1
            if self._quiet >= 2:
                self.current = self.cores
        return self.current
