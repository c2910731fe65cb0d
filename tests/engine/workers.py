"""Engine processes for the tests: how a test starts one (`launcher`), and the real engine process
of runtime/worker.py with a fault injected into its runner (`python -m tests.engine.workers FD`):
a native crash in the Nth model pass ("segv@N", "abort@N"), or one out-of-memory pass once a file
exists ("oom-when:PATH": the test arms it from its own process, as test_engine's fault closures do
in one process). The product carries none of this."""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmweb.config import Settings
from llmweb.engine.process import EngineProcess

ROOT = Path(__file__).resolve().parents[2]
REAL = [sys.executable, "-m", "tests.engine.workers"]
FAKE = [sys.executable, "-m", "tests.engine.fake_worker"]


def launcher(argv: list[str], spec: Any, launched: list[EngineProcess], stall_s: float = 60.0) -> Callable:
    """`launch(number)` for a ProcessRunner: an EngineProcess of `argv` run from the repository
    (so `-m tests...` resolves), each one appended to `launched`."""

    def launch(number: int) -> EngineProcess:
        cwd = os.getcwd()
        os.chdir(ROOT)
        try:
            child = EngineProcess(argv, spec, number, stall_s=stall_s)
        finally:
            os.chdir(cwd)
        launched.append(child)
        return child

    return launch


@dataclass(frozen=True)
class FaultySpec:
    settings: Settings
    fault: str = ""
    sized: dict | None = None  # as runtime/worker.py's WorkerSpec: sized to the memory free at its start


def wrap(runner, spec: FaultySpec):
    """The runner with the spec's fault in its model passes (tests/fakes.py FaultyRunner)."""
    from tests.fakes import FaultyRunner

    kind, _, arg = spec.fault.partition("@") if "@" in spec.fault else spec.fault.partition(":")
    if not kind:
        return runner
    fired = []

    def fault(index: int) -> None:
        if kind == "oom-when":
            if not fired and os.path.exists(arg):
                fired.append(index)
                raise runner.out_of_memory[0]("out of memory (injected into the engine process)")
        elif index + 1 >= int(arg):
            if kind == "abort":
                ctypes.CDLL(None).abort()
            ctypes.string_at(0)  # SIGSEGV

    return FaultyRunner(runner, fault)


if __name__ == "__main__":
    from llmweb.runtime.worker import main

    sys.exit(main(sys.argv, wrap=wrap))
