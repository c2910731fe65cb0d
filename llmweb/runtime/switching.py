"""Which model the runtime serves: the listing, a switch from one model to another, the models kept
loaded beside it (LLMWEB_MAX_LOADED, runtime/resident.py), the unload when idle
(LLMWEB_MODEL_KEEP_ALIVE_S, Ollama's keep_alive) and the load again on the next request.

With LLMWEB_MAX_LOADED=1 one model is loaded at a time. A switch or an unload lets the requests in
flight finish (at most DRAIN_S; then they are cancelled, and their partial replies are kept as for
Stop), waits for the chat's background folds, closes the engine (the engine process exits: every
byte of the model returns to the machine), and, for a switch, loads the new model on the load
thread with its progress in the status line, exactly as at start (`Runtime._load`: sized to
memory, its own template and stops). Requests that come meanwhile wait in `Runtime.wait_ready`.
With more, a switch parks the served model (its engine stays open, its turns go on) and a switch
back to a parked one is instant; a model about to load first lets the least recently used parked
ones go, while too many would be loaded or while it would not fit the memory they hold, and is
sized to what they leave. A remote engine (LLMWEB_ENGINE_URL) serves the model its server has:
nothing to switch or unload here.

Who may switch is not decided here (web/owner.py's `may_switch_models`); this module must not know
about owners or the page.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from llmweb.config import Settings
from llmweb.engine import catalog
from llmweb.engine.admission import ACTIVATION_FLOOR
from llmweb.engine.models import EMBEDDED_NAME, gguf_on_transformers, transformers_converts
from llmweb.engine.scheduler import idle_s
from llmweb.engine.sizing import MIN_CONTEXT, DoesNotFit
from llmweb.errors import InputError
from llmweb.runtime.engines import cpu_mem_limit_bytes
from llmweb.runtime.resident import Lease, Resident, to_free

log = logging.getLogger(__name__)

DRAIN_S = 120.0  # the most a switch or an unload waits for the requests in flight
KEEP_ALIVE_TICK_S = 5.0  # how often the keep-alive looks at the engine (at most)
LOAD_GROWTH = 1.25  # a GGUF file's RSS once loaded, per byte of file (llama.cpp: +111 MiB for the 92 MiB file)


def model_id(settings: Settings) -> str:
    """The id of the configured model: the embedded default's name, or the file's stem / folder's name."""
    if settings.engine_url:
        return settings.engine_model or "remote"
    if not settings.model:
        return EMBEDDED_NAME
    path = Path(settings.model).expanduser()
    return path.stem if path.suffix.lower() == ".gguf" else path.name


def listed(runtime) -> list[catalog.ModelEntry]:
    """The catalog's models, plus the configured one where it lives outside the models folder; where
    GGUF files run on transformers (a GPU, LLMWEB_BACKEND=transformers), not those of an architecture
    transformers cannot read (models.transformers_converts)."""
    if runtime.settings.engine_url:
        return []
    entries = catalog.scan(runtime.settings)
    if runtime.model_id not in {e.id for e in entries} and runtime.settings.model:
        path = Path(runtime.settings.model).expanduser()
        entry = catalog.entry_at(path)
        if entry is not None:
            entries.append(entry)
    if gguf_on_transformers(runtime.settings, _device(runtime)):
        entries = [e for e in entries if e.kind != "gguf" or transformers_converts(e.architecture)]
    return entries


def _device(runtime) -> str:
    """The device models load on: the served model's, else the one asked for (cpu until one loads)."""
    device = getattr(runtime.loaded, "device", None)
    if isinstance(device, str) and device:
        return device
    return "cuda" if runtime.settings.device == "cuda" else "cpu"


# ---- switching
def switch_model(runtime, wanted: str) -> bool:
    """See `Runtime.switch`."""
    if runtime.settings.engine_url:
        raise InputError("This server's model is the remote engine's (LLMWEB_ENGINE_URL): switch it there.")
    entry = next((e for e in listed(runtime) if e.id == wanted), None)
    if entry is None:
        raise InputError(f"There is no model {wanted[:120]!r} here; the models folder lists the ones there are.")
    with runtime._switching:
        _finish_loading(runtime)
        if entry.id == runtime.model_id and not runtime.unloaded and runtime._error is None:
            return False
        log.info("switching the model from %s to %s", runtime.model_id, entry.id)
        said = _set_aside(runtime, entry.id)
        runtime.unloaded = False
        runtime.settings = runtime.settings.replace(model=entry.model_setting)
        runtime.model_id = entry.id
        record = runtime.residents.unpark(entry.id)
        if record is not None:
            _serve_parked(runtime, record, said)
        else:
            runtime._status.after_ready = " ".join(said + make_room(runtime, entry))
            runtime._begin_load()
    return True


def _finish_loading(runtime) -> None:
    """A switch during a load waits for it: the loaded model is then parked or closed like any other
    (before, a second load started beside the first, whose engine was never closed)."""
    thread = runtime._thread
    if thread is not None and thread.is_alive() and thread is not threading.current_thread():
        thread.join()


def _set_aside(runtime, next_id: str) -> list[str]:
    """The served model stops being served: parked where more than one may be loaded (and it is
    loaded and well), else drained and closed (LLMWEB_MAX_LOADED=1: today's switch). What to say."""
    if runtime.unloaded:
        return []
    if runtime.residents.max_loaded > 1 and runtime.ready and runtime.residents.serving is not None:
        runtime._ready.clear()  # first: `hold` waits for the next one instead of finding none served
        record = runtime.residents.park()
        record.status = runtime._status.ready_line or runtime.status
        runtime.chat = runtime.engine = runtime.loaded = None
        runtime._preloaded = None
        return [f"Kept {record.model_id} loaded."]
    runtime._stop_serving(f"Switching to {next_id}: waiting for the replies in progress…")
    return []


def _serve_parked(runtime, record: Resident, said: list[str]) -> None:
    """Serve a parked model again (unparked already): no load, no drain (its engine never closed)."""
    runtime.engine, runtime.chat = record.engine, record.chat
    runtime.loaded, runtime.budget = record.loaded, record.budget
    runtime._error = None
    runtime._status.after_ready = " ".join([*said, f"{record.model_id} was loaded already: switched at once."])
    runtime._status.ready_again(record.status)
    runtime._ready.set()


# ---- room for the next model
def make_room(runtime, entry: catalog.ModelEntry | None = None) -> list[str]:
    """Before the served model (`entry`, else looked up) loads: let the least recently used parked
    models go while more than LLMWEB_MAX_LOADED would be loaded, then while it would not fit the
    CPU memory they hold (an estimate: `need_bytes`). What to say of each one let go."""
    said, most = [], runtime.residents.max_loaded
    for record in runtime.residents.over(loading=1):
        if let_go(runtime, record):
            said.append(f"Unloaded {record.model_id} (the least recently used; LLMWEB_MAX_LOADED={most}).")
    entry = entry or next((e for e in listed(runtime) if e.id == runtime.model_id), None)
    s = runtime.settings
    if entry is None or not (entry.kind == "gguf" or s.device == "cpu"):
        return said  # on CUDA the load measures free device memory itself (`load_making_room` retries)
    parked = runtime.residents.parked()
    for record in to_free(parked, Resident.footprint, _cpu_room(runtime, parked), need_bytes(s, entry)):
        if let_go(runtime, record):
            said.append(f"Unloaded {record.model_id} to make room for {entry.id}.")
    return said


def need_bytes(settings: Settings, entry: catalog.ModelEntry) -> int:
    """The least memory `entry` runs in: its weights as loaded, MIN_CONTEXT tokens of KV cache, the
    activations' floor and LLMWEB_MEM_MARGIN_MB (engine/sizing.py refuses it below that)."""
    kv = MIN_CONTEXT * entry.kv_bytes_per_token
    return int(entry.size_bytes * LOAD_GROWTH) + kv + ACTIVATION_FLOOR + settings.mem_margin_mb * 2**20


def _cpu_room(runtime, parked: list[Resident]) -> int:
    """The CPU memory under the limit that the parked models leave: in engine processes, the limit
    minus theirs; in the web process, the limit minus its RSS (theirs is in it)."""
    limit = cpu_mem_limit_bytes(runtime.settings)
    if runtime.settings.in_engine_process:
        return limit - sum(r.footprint() for r in parked)
    return limit - psutil.Process().memory_info().rss


def sizing_settings(runtime) -> Settings:
    """The settings the next engine process loads with (`Runtime._load_process`): LLMWEB_MEM_LIMIT_MB
    less what the parked models' engine processes hold, so that two models never both size to the
    whole limit (said after the ready line). A model loaded in the web process needs none of this:
    that process's RSS, which its sizing subtracts, counts the parked models already."""
    s, parked = runtime.settings, runtime.residents.parked()
    held = sum(r.footprint() for r in parked)
    if not held:
        return s
    left = cpu_mem_limit_bytes(s) - held
    names = ", ".join(r.model_id for r in parked)
    runtime._status.after_ready += f" Sized to the {max(left, 0) / 2**20:,.0f} MiB that {names} left of the limit."
    return s.replace(mem_limit_mb=max(left // 2**20, 1))


def load_making_room(runtime, load: Callable[[], None]) -> None:
    """`load()`; when the model does not fit beside the parked models (engine/sizing.py's
    DoesNotFit), let the least recently used go and load again, until none is parked."""
    said = runtime._status.after_ready
    while True:
        runtime._status.after_ready = said  # each try says its own sizing (`sizing_settings`)
        try:
            return load()
        except DoesNotFit:
            parked = runtime.residents.parked()
            if not parked:
                raise
            if let_go(runtime, parked[0]):
                said += f" Unloaded {parked[0].model_id} to make room for {runtime.model_id}."


def progress_of(runtime, model: str) -> Callable[[str], None]:
    """An engine's progress lines (loads, restarts): the status line's while `model` is served, the
    log's while it is parked."""

    def progress(text: str) -> None:
        if runtime.model_id == model:
            runtime._status.progress(text)
        else:
            log.info("%s (parked): %s", model, text)

    return progress


# ---- letting go
def let_go(runtime, record: Resident) -> bool:
    """Close a parked model (`retire`); False when another thread took it first."""
    if not runtime.residents.remove(record):
        return False
    log.info("unloading the parked model %s", record.model_id)
    retire(runtime.residents, record)
    return True


def retire(residents, record: Resident, timeout: float = DRAIN_S) -> None:
    """Close a model no longer resident: the turns that hold it and the requests in flight finish
    (`timeout` in all; then they are cancelled), its chat's background folds end, its engine closes."""
    deadline = time.monotonic() + timeout
    if not residents.wait_unheld(record, timeout):
        log.warning("turns on %s did not end within %.0f s: their requests are cancelled", record.model_id, timeout)
    drain(record.engine, max(deadline - time.monotonic(), 0.0))
    record.chat.wait_background(timeout=30)
    record.engine.close()


def close_parked(runtime) -> None:
    """At shutdown: close every parked model (nothing more is asked of them)."""
    for record in runtime.residents.parked():
        if runtime.residents.remove(record):
            record.chat.wait_background(timeout=30)
            record.engine.close()


def unload_model(runtime, why: str) -> bool:
    """See `Runtime.unload`; False when nothing was loaded."""
    with runtime._switching:
        if runtime.unloaded or runtime.engine is None or runtime.settings.engine_url:
            return False
        runtime._stop_serving(f"Unloading {runtime.model_id}…")
        runtime.unloaded = True
        runtime._status.progress(f"{runtime.model_id} was unloaded {why}; the next message loads it again.")
        log.info("unloaded %s %s", runtime.model_id, why)
        return True


def drain(engine, timeout: float) -> bool:
    """Wait until the engine has no request running or waiting; False if `timeout` passed first."""
    deadline = time.monotonic() + timeout
    while idle_s(engine) == 0.0:
        if time.monotonic() >= deadline:
            log.warning("the requests in flight did not finish within %.0f s: they are cancelled", timeout)
            return False
        time.sleep(0.1)
    return True


# ---- who answers
def hold_model(runtime, model: str | None, timeout: float | None) -> Lease | None:
    """See `Runtime.hold`."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        if model is not None and model != runtime.model_id:
            return runtime.residents.hold(model)  # parked, or None: not loaded
        runtime.wait_ready(None if deadline is None else max(deadline - time.monotonic(), 0.0))
        lease = runtime.residents.hold(model)
        if lease is not None:
            return lease
        # switched away between the two: look again (a parked one is found; a closed one is None)


def quiet_s(record: Resident) -> float:
    """Seconds since `record` was last used (a turn, its engine's work, being served or parked)."""
    if record.holds:
        return 0.0
    return min(idle_s(record.engine), time.monotonic() - record.used_at)


def keep_alive(runtime, seconds: float, closing: threading.Event) -> threading.Thread:
    """A thread that unloads each resident model once it has been idle `seconds`: the served one
    until the next request loads it again, a parked one for good."""
    why = f"after {_duration(seconds)} without a request"

    def watch() -> None:
        while not closing.wait(min(KEEP_ALIVE_TICK_S, max(seconds / 4, 0.2))):
            record = runtime.residents.serving
            if record is not None and runtime.ready and quiet_s(record) >= seconds:
                runtime.unload(why)
            for record in runtime.residents.idle(seconds):
                if quiet_s(record) >= seconds and let_go(runtime, record):
                    log.info("unloaded the parked model %s %s", record.model_id, why)

    thread = threading.Thread(target=watch, name="llmweb-keep-alive", daemon=True)
    thread.start()
    return thread


def _duration(seconds: float) -> str:
    return f"{seconds / 60:.0f} min" if seconds >= 120 else f"{seconds:.0f} s"
