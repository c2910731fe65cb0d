"""Which model the runtime serves: the listing, a switch from one model to another, the unload when
idle (LLMWEB_MODEL_KEEP_ALIVE_S, Ollama's keep_alive) and the load again on the next request.

One model is served at a time. A switch or an unload lets the requests in flight finish (at most
DRAIN_S; then they are cancelled, and their partial replies are kept as for Stop), waits for the
chat's background folds, closes the engine (the engine process exits: every byte of the model
returns to the machine), and, for a switch, loads the new model on the load thread with its
progress in the status line, exactly as at start (`Runtime._load`: sized to memory, its own
template and stops). Requests that come meanwhile wait in `Runtime.wait_ready`. A remote engine
(LLMWEB_ENGINE_URL) serves the model its server has: nothing to switch or unload here.

Who may switch is not decided here (web/owner.py's `may_switch_models`); this module must not know
about owners or the page.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

from llmweb.config import Settings
from llmweb.engine import catalog
from llmweb.engine.models import EMBEDDED_NAME
from llmweb.engine.scheduler import idle_s
from llmweb.errors import InputError

log = logging.getLogger(__name__)

DRAIN_S = 120.0  # the most a switch or an unload waits for the requests in flight
KEEP_ALIVE_TICK_S = 5.0  # how often the keep-alive looks at the engine (at most)


def model_id(settings: Settings) -> str:
    """The id of the configured model: the embedded default's name, or the file's stem / folder's name."""
    if settings.engine_url:
        return settings.engine_model or "remote"
    if not settings.model:
        return EMBEDDED_NAME
    path = Path(settings.model).expanduser()
    return path.stem if path.suffix.lower() == ".gguf" else path.name


def listed(runtime) -> list[catalog.ModelEntry]:
    """The catalog's models, plus the configured one where it lives outside the models folder."""
    if runtime.settings.engine_url:
        return []
    entries = catalog.scan(runtime.settings)
    if runtime.model_id not in {e.id for e in entries} and runtime.settings.model:
        path = Path(runtime.settings.model).expanduser()
        entry = catalog.entry_at(path)
        if entry is not None:
            entries.append(entry)
    return entries


def switch_model(runtime, wanted: str) -> bool:
    """See `Runtime.switch`."""
    if runtime.settings.engine_url:
        raise InputError("This server's model is the remote engine's (LLMWEB_ENGINE_URL): switch it there.")
    entry = next((e for e in listed(runtime) if e.id == wanted), None)
    if entry is None:
        raise InputError(f"There is no model {wanted[:120]!r} here; the models folder lists the ones there are.")
    with runtime._switching:
        if entry.id == runtime.model_id and not runtime.unloaded and runtime._error is None:
            return False
        log.info("switching the model from %s to %s", runtime.model_id, entry.id)
        if not runtime.unloaded:
            runtime._stop_serving(f"Switching to {entry.id}: waiting for the replies in progress…")
        runtime.unloaded = False
        runtime.settings = runtime.settings.replace(model=entry.model_setting)
        runtime.model_id = entry.id
        runtime._begin_load()
    return True


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


def keep_alive(runtime, seconds: float, closing: threading.Event) -> threading.Thread:
    """A thread that unloads the model once its engine has been idle `seconds`."""

    def watch() -> None:
        while not closing.wait(min(KEEP_ALIVE_TICK_S, max(seconds / 4, 0.2))):
            engine = runtime.engine
            if engine is not None and runtime.ready and idle_s(engine) >= seconds:
                runtime.unload(f"after {_duration(seconds)} without a request")

    thread = threading.Thread(target=watch, name="llmweb-keep-alive", daemon=True)
    thread.start()
    return thread


def _duration(seconds: float) -> str:
    return f"{seconds / 60:.0f} min" if seconds >= 120 else f"{seconds:.0f} s"
