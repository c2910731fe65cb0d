"""The running app's parts, built from Settings: model, engine, store, document library, chat.

`Runtime.start()` loads the model on a background thread so the web page can come up at once
and show progress ("converting GGUF, first run…"); `wait_ready()` blocks callers until the
chat is usable and re-raises a load failure as a user-facing error. The CLI's `replay` and
`bench` use the same object, so every path shares one engine (one worker per model).

`Runtime` (this file) only wires the parts and runs the start-up; each other job has its module:

  engines.py    engine parts from settings: KV and memory budgets, limits, the remote engine
  switching.py  which model is served: a switch, the unload when idle, room for the next model
  resident.py   the models kept loaded (LLMWEB_MAX_LOADED), the turns that hold them, whom to let go
  status.py     the status line the page shows (`Runtime.status`)
  health.py     the remote engine's health watch, which keeps the status line current
  secret.py     the secret file that encrypts what browsers keep (`Runtime.secret`)
  retention.py  the purge of idle anonymous owners (`Runtime.purge_idle`)
  samples.py    the bundled user guide, seeded into the shared library once
  zerogpu.py    ZeroGPU's start-up: `spaces` first, the GPU call, the engine over it

The runtime sits between the chat and the edges: it may import chat/ and everything below it,
never web/, cli/ or bench/ (they import it), and it turns no error into a message for a page.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from llmweb.chat.context import Budget
from llmweb.config import Settings
from llmweb.engine import models
from llmweb.engine.kvcache import KVStore
from llmweb.errors import ConfigError, LlmwebError
from llmweb.runtime import zerogpu
from llmweb.runtime.engines import (
    cpu_mem_limit_bytes,
    kv_budget_bytes,
    local_limits,
    remote_parts,
    size_to_memory,
    tokenizer_dir,
)
from llmweb.runtime.health import REMOTE_RETRY_S, RemoteHealth
from llmweb.runtime.resident import Lease, Resident, Residents
from llmweb.runtime.retention import ANON_PREFIXES, Retention
from llmweb.runtime.samples import seed_sample
from llmweb.runtime.secret import read_or_create_secret
from llmweb.runtime.status import StatusLine
from llmweb.runtime.switching import (
    close_parked,
    hold_model,
    keep_alive,
    listed,
    load_making_room,
    make_room,
    model_id,
    progress_of,
    retire,
    sizing_settings,
    switch_model,
    unload_model,
)
from llmweb.runtime.worker import engine_process_runner
from llmweb.store.db import Store
from llmweb.store.models import OwnerCaps

if TYPE_CHECKING:
    from llmweb.chat.session import Chat
    from llmweb.engine.catalog import ModelEntry
    from llmweb.engine.scheduler import Engine
    from llmweb.retrieval.library import Library

# the names callers (bench, tests) import from here, wherever they live
__all__ = [
    "ANON_PREFIXES",
    "REMOTE_RETRY_S",
    "Runtime",
    "cpu_mem_limit_bytes",
    "kv_budget_bytes",
    "read_or_create_secret",
    "tokenizer_dir",
]

log = logging.getLogger(__name__)


class Runtime:
    def __init__(self, settings: Settings, loaded=None):
        self.settings = settings
        self._preloaded = loaded  # tests and benchmarks share one loaded model
        settings.data_dir.mkdir(parents=True, exist_ok=True)
        self.store = Store(settings.data_dir / "llmweb.sqlite3", caps=OwnerCaps.from_settings(settings))
        self._status = StatusLine()
        self.loaded: models.LoadedModel | None = None
        self.engine: Engine | None = None
        self.chat: Chat | None = None
        self.budget: Budget | None = None
        self._library: Library | None = None
        self._library_lock = threading.Lock()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._closing = threading.Event()
        self._retention = Retention(settings, lambda: self.chat if self.ready else None)
        self.model_id = model_id(settings)  # the model served, or to be served once loaded (engine/catalog.py)
        self._switching = threading.Lock()  # one switch, unload or reload at a time
        self.unloaded = False  # the keep-alive unloaded the model: the next `wait_ready` loads it again
        self.residents = Residents(settings.max_loaded)  # the served model's record and the parked ones'
        self._zero_call: Callable | None = None  # ZeroGPU: the decorated GPU call (runtime/zerogpu.py)

    @property
    def status(self) -> str:
        """The status line: what the runtime is doing, or which engine serves."""
        return self._status.text

    # ---- start-up
    def start(self, background: bool = True) -> Runtime:
        if self.settings.anon_retention_days > 0:
            self._retention.start(self._ready, self._closing)
        if self.settings.model_keep_alive_s > 0 and not self.settings.engine_url:
            keep_alive(self, self.settings.model_keep_alive_s, self._closing)
        if self.settings.zero_gpu and not self.settings.engine_url and self._zero_call is None:
            self._zero_call = zerogpu.prepare()  # before the model loads, on this thread (runtime/zerogpu.py)
        if background and self._zero_call is None:
            self._thread = threading.Thread(target=self._load, name="llmweb-load", daemon=True)
            self._thread.start()
        else:
            self._load()
            if self._error is not None and not background:
                raise self._error
        return self

    def _load(self) -> None:
        """Build the engine and the chat; a failure is kept for `wait_ready` and shown in the status line."""
        remote = bool(self.settings.engine_url)
        try:
            t0 = time.perf_counter()
            if remote:
                self._load_remote(t0)
            else:
                load_making_room(self, lambda: self._load_local(t0))
        except BaseException as e:  # shown in the UI's status line and raised to callers
            log.exception("remote engine set-up failed" if remote else "model load failed")
            self._error = e
            self._status.failed("Remote engine set-up failed" if remote else "Model failed to load", e)
        finally:
            self._ready.set()

    def _load_local(self, t0: float) -> None:
        from llmweb.engine.backends import make_engine

        s = self.settings
        loaded = self._preloaded
        if self._zero_call is not None:  # ZeroGPU: one GPU call per request; nothing sized here (no GPU)
            loaded = loaded or models.load(zerogpu.load_settings(s), progress=self._status.progress)
            engine, budget = zerogpu.zero_engine(s, loaded, self._zero_call)
            self.loaded = loaded
            self._wire(engine, budget, loaded.tokenizer, loaded.stop_ids)
            self._status.ready_local(loaded, budget, time.perf_counter() - t0)
            return
        if loaded is None and s.in_engine_process:
            self._load_process(t0)
            return
        if loaded is None:
            loaded = models.load(s, progress=self._status.progress)
            size_to_memory(s, loaded)  # a preloaded model (tests, benchmarks) was sized by its loader, if at all
        budget = Budget.from_settings(s, loaded.max_context, loaded.on_cpu)
        if s.warmup:
            self._status.progress(f"Warming up at {budget.context_limit - budget.max_new_tokens} prompt tokens…")
            models.warm_up(loaded, budget.context_limit - budget.max_new_tokens)
        kv = KVStore(kv_budget_bytes(s, loaded), s.kv_ttl_s)
        limits = local_limits(s, budget, loaded)
        engine = make_engine(loaded, kv, limits, context=budget.context_limit)
        self.loaded = loaded
        self._wire(engine, budget, loaded.tokenizer, loaded.stop_ids)
        self._status.ready_local(loaded, budget, time.perf_counter() - t0)

    def _load_process(self, t0: float) -> None:
        """The model in an engine process of its own (engine/process.py); here only its tokenizer,
        with the budget and limits computed from the same settings as there (runtime/worker.py)."""
        from llmweb.engine.scheduler import Engine

        s = self.settings
        runner = engine_process_runner(sizing_settings(self), progress_of(self, self.model_id))
        try:
            info = runner.boot()
            tokenizer = models.load_tokenizer(s, info["backend"], self._status.progress)
        except BaseException:
            runner.close()
            raise
        # the process's info, less what only the supervisor keeps (its pid; the sizing later processes reuse)
        fields = {k: v for k, v in info.items() if k not in ("pid", "kv_budget_bytes")}
        loaded = models.LoadedModel(model=None, tokenizer=tokenizer, **fields)
        budget = Budget.from_settings(s, loaded.max_context, loaded.on_cpu)
        engine = Engine(runner, runner.kv, local_limits(s, budget, loaded))
        self.loaded = loaded
        self._wire(engine, budget, tokenizer, loaded.stop_ids)
        self._status.ready_local(loaded, budget, time.perf_counter() - t0)
        runner.ready_text = self._status.text

    def _load_remote(self, t0: float) -> None:
        """A remote engine generates (LLMWEB_ENGINE_URL): load the tokenizer only, no weights.

        The server need not be up: the page comes up, the status line says it is unreachable, and
        the health watch (runtime/health.py) keeps checking; requests meanwhile fail after the
        runner's retries with a message that says so.
        """
        s = self.settings
        engine, budget, tokenizer = remote_parts(s, self._status.progress)
        self._wire(engine, budget, tokenizer)
        started = f"context {budget.context_limit} tokens · started in {time.perf_counter() - t0:.0f} s"
        # REMOTE_RETRY_S is read here, from this module, so a test may shorten it
        RemoteHealth(engine.runner, s.engine_url, self._status, started, REMOTE_RETRY_S).start(self._closing)

    def _wire(self, engine: Engine, budget: Budget, tokenizer, stop_ids: tuple[int, ...] = ()) -> None:
        """The chat over the engine, the store and the library; then the sample guide, if asked for.
        `stop_ids`: the ends the model's files name, beside its template's (chat/tokens.py)."""
        from llmweb.chat.session import Chat
        from llmweb.chat.tokens import TemplateFormat

        self.engine, self.budget = engine, budget
        fmt = TemplateFormat(tokenizer, model_stops=stop_ids)
        self.chat = Chat(self.settings, engine, fmt, self.store, budget, library=self.library)
        self.chat.runner.model = self.model_id  # each turn's stats name the model that answered
        self.residents.serve(Resident(self.model_id, engine, self.chat, self.loaded, budget))
        if self.settings.sample_docs:
            self._seed_sample()

    def _seed_sample(self) -> None:
        """The bundled user guide into the shared library, once per data dir (runtime/samples.py)."""
        seed_sample(self.settings, self.library, self._status.progress)

    def wait_ready(self, timeout: float | None = None) -> Chat:
        if self.unloaded:
            self._reload()
        if not self._ready.wait(timeout):
            raise LlmwebError(f"The model is still loading ({self.status}). Try again in a moment.")
        if self._error is not None:
            if isinstance(self._error, LlmwebError):
                raise self._error
            raise ConfigError(f"The model failed to load: {self._error}")
        assert self.chat is not None  # a load without error made it
        return self.chat

    def hold(self, model: str | None = None, timeout: float | None = None) -> Lease | None:
        """The chat of `model` (None: the one served) held for one turn: it is not closed (switched
        away from with LLMWEB_MAX_LOADED=1, let go, unloaded) until the lease is released. The
        served model is waited for as `wait_ready` waits (LlmwebError past `timeout`); a parked one
        answers at once; None when `model` is not loaded (the caller may switch to it)."""
        return hold_model(self, model, timeout)

    @property
    def ready(self) -> bool:
        return self._ready.is_set() and self._error is None

    # ---- which model (runtime/switching.py)
    def models(self) -> list[ModelEntry]:
        """Every model this runtime can serve (the embedded default, the models folder's, and the
        one configured if it lives elsewhere); none to choose from with a remote engine."""
        return listed(self)

    def switch(self, wanted: str) -> bool:
        """Serve the model `wanted` (an id from `models()`) from now on: the current model is parked
        (LLMWEB_MAX_LOADED > 1) or closed once its requests finish; a parked `wanted` serves at once,
        else it loads in the background (the status line shows its progress; `wait_ready` waits for
        it). False when it is already the one served. InputError for an unknown id. The caller
        decides who may (web/owner.py's `may_switch_models`)."""
        return switch_model(self, wanted)

    def loaded_ids(self) -> list[str]:
        """The models loaded now: the served one (unless unloaded), then the parked, most recent first."""
        return self.residents.ids()

    def unload(self, why: str) -> bool:
        """Close the model (its memory returns to the machine) until the next `wait_ready` loads it again."""
        return unload_model(self, why)

    def _reload(self) -> None:
        with self._switching:
            if not self.unloaded:
                return
            self.unloaded = False
            self._status.after_ready = " ".join(make_room(self))
            self._begin_load()

    def _begin_load(self) -> None:
        """Load `self.settings`' model again on a background thread (a switch, or after an unload)."""
        self._error = None
        self._ready.clear()
        self._thread = threading.Thread(target=self._load, name="llmweb-load", daemon=True)
        self._thread.start()

    def _stop_serving(self, status: str) -> None:
        """Let the turns and requests in flight finish (bounded), then close the engine and the chat."""
        self._ready.clear()
        self._status.progress(status)
        record = self.residents.unserve()
        if record is not None:
            retire(self.residents, record)
        self.chat = self.engine = self.loaded = None
        self._preloaded = None  # a test's shared model is not closed, but no longer served here

    # ---- documents
    @property
    def library(self) -> Library:
        """The document library (shared + per-owner private), built on first use."""
        with self._library_lock:
            if self._library is None:
                from llmweb.retrieval.library import Library

                self._library = Library(self.settings)
            return self._library

    # ---- many visitors
    @property
    def secret(self) -> str:
        """The key that encrypts what browsers keep (owner token, open chat): LLMWEB_SECRET, else a
        random one created once in the data dir (mode 600), so visitors keep their chats over a restart."""
        if self.settings.secret:
            return self.settings.secret
        return read_or_create_secret(self.settings.data_dir / "secret")

    def purge_idle(self, now: float | None = None) -> tuple[int, int]:
        """Delete the data of anonymous owners (browsers, API conversations) idle longer than
        LLMWEB_ANON_RETENTION_DAYS (runtime/retention.py). Accounts and the single user are never
        purged. Returns (owners, conversations) deleted."""
        return self._retention.purge_idle(now)

    def close(self) -> None:
        self._closing.set()
        if self.chat is not None:
            self.chat.wait_background(timeout=30)  # summaries write to the store
        if self.engine is not None:
            self.engine.close()
        close_parked(self)
        self.store.close()
