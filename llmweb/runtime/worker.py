"""The engine process's main: `python -m llmweb.runtime.worker FD`, started by engine/process.py
(`engine_process_runner`, in the web process, builds the runner that starts it).

It reads a `WorkerSpec` from the connection on FD, loads the model as the web process would
(models.load: progress lines go back as ("progress", text)), builds the runner with the same
budget, KV budget and limits the web process computes from the same settings, answers
("ready", info) or ("failed", error), then serves the runner's calls (engine/boundary.py) until
told to exit or its parent goes away.

Must not: open the store, the library or any port; it holds the model and nothing else.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from llmweb.chat.context import Budget
from llmweb.config import Settings
from llmweb.engine import models
from llmweb.engine.boundary import serve
from llmweb.engine.kvcache import KVStore
from llmweb.errors import LlmwebError
from llmweb.runtime.engines import kv_budget_bytes, local_limits, size_to_memory

log = logging.getLogger("llmweb.engine.worker")

# -c, not -m: llmweb.runtime imports this module, so `-m llmweb.runtime.worker` ran it a second time
# as __main__ (runpy's RuntimeWarning at every engine start)
ARGV = [sys.executable, "-c", "import sys; from llmweb.runtime.worker import main; sys.exit(main(sys.argv))"]


EXIT_DEVICE_LOST = 3  # the exit code after a sticky device error (engine/faults.py)


@dataclass(frozen=True)
class WorkerSpec:
    settings: Settings
    # the first engine process's figures (max_context, max_batch, kv_budget_bytes): a later one (a
    # recycle's replacement, a restart) takes them rather than sizing to a GPU the old one still fills
    sized: dict | None = None


def engine_process_runner(settings: Settings, status: Callable[[str], None]):
    """(In the web process) the runner over engine processes (engine/process.py), each started as
    this module with these settings; `status` gets the progress of loads and restarts."""
    from llmweb.engine.process import EngineProcess, ProcessRunner, Recycle

    s = settings
    recycle = Recycle(s.recycle_after, s.recycle_s, s.recycle_frag_mb * 2**20)
    env = child_env()

    def launch(number: int) -> EngineProcess:
        first = runner.first_info
        sized = {k: first[k] for k in SIZED if k in first} if first else None
        return EngineProcess(ARGV, WorkerSpec(s, sized or None), number, s.engine_stall_s, env)

    runner = ProcessRunner(launch, recycle=recycle, status=status)
    return runner


def child_env() -> dict[str, str]:
    """This process's environment, with llmweb's own folder first on PYTHONPATH: `-m` finds the
    package wherever the app was started from (`python /elsewhere/app.py` imports it from the
    script's folder, which the engine process would not search)."""
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    return env


def model_info(loaded: models.LoadedModel) -> dict:
    """What the web process needs of the loaded model (all but the weights and the tokenizer)."""
    keep = ["name", "quant", "device", "weights_bytes", "max_context", "kv_bytes_per_token", "dtype_bytes"]
    keep += ["max_batch", "kv_store_bytes", "stop_ids"]
    info = {k: getattr(loaded, k) for k in keep}
    info.update(load_s=loaded.load_s, notes=list(loaded.notes), backend=loaded.backend, pid=os.getpid())
    return info


def build(spec: WorkerSpec, progress):
    """(runner, kv, info): the model and its runner, as the web process's settings say."""
    from llmweb.engine.backends import make_runner

    s = spec.settings
    loaded = models.load(s, progress=progress)
    kv_budget = fit_memory(spec, loaded)
    budget = Budget.from_settings(s, loaded.max_context, loaded.on_cpu)
    if s.warmup:
        progress(f"Warming up at {budget.context_limit - budget.max_new_tokens} prompt tokens…")
        models.warm_up(loaded, budget.context_limit - budget.max_new_tokens)
    kv = KVStore(kv_budget, s.kv_ttl_s)
    runner = make_runner(loaded, kv, local_limits(s, budget, loaded), context=budget.context_limit)
    governor = getattr(runner, "governor", None)
    if governor is not None:  # the web process's streaming is this reply's own work, not another's
        governor.count_as_own(os.getppid())
    return runner, kv, {**model_info(loaded), "kv_budget_bytes": kv_budget}


SIZED = ("max_context", "max_batch", "kv_budget_bytes")


def fit_memory(spec: WorkerSpec, loaded) -> int:
    """The KV store's budget, with `loaded`'s context and batch fitted to memory: on the first
    start, to the memory free now (`size_to_memory`); later, to the first process's figures
    (`spec.sized`), because a recycle's replacement loads while the old process still holds its
    weights and caches (`mem_get_info` is the whole device's), and would be sized to what is left
    for its whole life. The same figures also keep the web process's budget and limits true."""
    s, sized = spec.settings, spec.sized
    if not sized:
        size_to_memory(s, loaded)
        return kv_budget_bytes(s, loaded)
    loaded.max_context = min(loaded.max_context, sized["max_context"])
    loaded.max_batch = sized["max_batch"]
    return sized["kv_budget_bytes"]


def main(argv: list[str], wrap: Callable[[Any, Any], Any] | None = None) -> int:
    """Serve on the connection whose fd is argv[1]. `wrap(runner, spec)`: the runner to serve
    (tests wrap it in a fault injector; the product serves it as built)."""
    conn = Connection(int(argv[1]))
    spec: WorkerSpec = conn.recv()
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s engine[{os.getpid()}] %(levelname)s %(message)s")
    models.configure_allocator()
    try:
        runner, kv, info = build(spec, lambda text: conn.send(("progress", text)))
    except BaseException as e:  # the web process shows it in the status line
        log.exception("engine process: the model failed to load")
        conn.send(("failed", e if isinstance(e, LlmwebError) else LlmwebError(f"{type(e).__name__}: {e}")))
        return 1
    conn.send(("ready", info))
    close = getattr(runner, "close", None)
    try:
        lost = serve(conn, wrap(runner, spec) if wrap is not None else runner, kv)
    except BaseException:
        if close is not None:
            close()
        raise
    if lost:  # a sticky device error: no clean-up (every device call would fail); the supervisor restarts us
        os._exit(EXIT_DEVICE_LOST)
    if close is not None:
        close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
