"""The running app's parts, built from Settings: model, engine, store, document library, chat.

`Runtime.start()` loads the model on a background thread so the web page can come up at once
and show progress ("converting GGUF, first run…"); `wait_ready()` blocks callers until the
chat is usable and re-raises a load failure as a user-facing error. The CLI's `replay` and
`bench` use the same object, so every path shares one engine (one worker per model).
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import psutil

from llmweb.chat.context import Budget
from llmweb.config import SAMPLE_DIR, Settings
from llmweb.engine import models
from llmweb.engine.kvcache import KVStore
from llmweb.errors import ConfigError, LlmwebError
from llmweb.store.db import Store

if TYPE_CHECKING:
    from llmweb.chat.session import Chat
    from llmweb.engine.scheduler import Engine
    from llmweb.retrieval.library import Library

log = logging.getLogger(__name__)

SAMPLE_MARKER = ".sample-seeded-shared"  # in data_dir/index: the bundled guide is in the shared library


def gpu_entry(fn):
    """`@spaces.GPU` where the `spaces` package is present (Hugging Face ZeroGPU); elsewhere `fn` itself."""
    try:
        import spaces
    except ImportError:
        return fn
    return spaces.GPU(fn)


def kv_budget_bytes(settings: Settings, loaded) -> int:
    """LLMWEB_KV_BUDGET_MB, or a quarter of free device memory after loading (CPU: 1/16 of RAM, <= 1 GiB)."""
    if settings.kv_budget_mb > 0:
        return settings.kv_budget_mb * 2**20
    if not loaded.on_cpu:
        import torch

        free, _total = torch.cuda.mem_get_info()
        return max(int(free * 0.25), 64 * 2**20)
    return min(psutil.virtual_memory().total // 16, 2**30)


REMOTE_RETRY_S = 5.0  # a remote engine that does not answer is checked again this often
REMOTE_CHECK_S = 30.0  # ... and one that answers, this often (the status line follows it)


def tokenizer_dir(settings: Settings, progress) -> Path:
    """The embedded model's folder for its tokenizer: the converted copy (made once, as for the local model)."""
    target = models.converted_dir(settings)
    if (target / "tokenizer.json").is_file():
        return target
    return models.ensure_converted(settings, progress)


ANON_PREFIXES = ("anon:", "api:")  # owners the retention purge may delete (never "user:" or the local one)
PURGE_EVERY_S = 3600.0


def read_or_create_secret(path) -> str:
    """A 256-bit hex secret kept in `path` (created once, atomically, mode 600)."""
    import os
    import secrets

    try:
        return path.read_text().strip()
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")
    try:
        os.link(tmp, path)  # never replaces a secret another process wrote first
    except FileExistsError:
        pass
    finally:
        os.unlink(tmp)
    return path.read_text().strip()


def cpu_mem_limit_bytes(settings: Settings) -> int:
    if settings.mem_limit_mb > 0:
        return settings.mem_limit_mb * 2**20
    return int(psutil.virtual_memory().total * 0.8)


class Runtime:
    def __init__(self, settings: Settings, fault=None, loaded=None):
        self.settings = settings
        self._preloaded = loaded  # tests and benchmarks share one loaded model
        settings.data_dir.mkdir(parents=True, exist_ok=True)
        self.store = Store(settings.data_dir / "llmweb.sqlite3")
        self.fault = fault
        self.status = "Starting…"
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
        self._remote_ready = ""  # a remote engine's part of the status line

    # ---- start-up
    def start(self, background: bool = True) -> Runtime:
        if self.settings.anon_retention_days > 0:
            threading.Thread(target=self._purge_loop, name="llmweb-purge", daemon=True).start()
        if background:
            self._thread = threading.Thread(target=self._load, name="llmweb-load", daemon=True)
            self._thread.start()
        else:
            self._load()
            if self._error is not None:
                raise self._error
        return self

    def _progress(self, message: str) -> None:
        self.status = message
        log.info(message)

    def _load(self) -> None:
        from llmweb.chat.session import Chat
        from llmweb.chat.tokens import TemplateFormat
        from llmweb.engine.local import local_engine
        from llmweb.engine.request import EngineLimits, auto_max_batch

        s = self.settings
        if s.engine_url:
            return self._load_remote()
        try:
            t0 = time.perf_counter()
            loaded = self._preloaded or models.load(s, progress=self._progress)
            fmt = TemplateFormat(loaded.tokenizer)
            budget = Budget.from_settings(s, loaded.max_context, loaded.on_cpu)
            if s.warmup:
                self._progress(f"Warming up at {budget.context_limit - budget.max_new_tokens} prompt tokens…")
                models.warm_up(loaded, budget.context_limit - budget.max_new_tokens)
            kv = KVStore(kv_budget_bytes(s, loaded), s.kv_ttl_s)
            limits = EngineLimits(
                queue_size=s.queue_size,
                max_new_tokens=budget.max_new_tokens,
                request_timeout_s=s.request_timeout_s,
                admission_wait_s=s.admission_wait_s,
                mem_limit_bytes=cpu_mem_limit_bytes(s) if loaded.on_cpu else 0,
                mem_margin_bytes=s.mem_margin_mb * 2**20,
                frag_release_bytes=s.frag_release_mb * 2**20,
                kv_reuse=s.kv_reuse,
                queue_per_user=s.queue_per_user,
                max_batch=s.max_batch or auto_max_batch(loaded.on_cpu),
            )
            self.engine = local_engine(
                loaded.model, loaded.device, kv, limits, loaded.kv_bytes_per_token, fault=self.fault, gpu=gpu_entry
            )
            self.loaded, self.budget = loaded, budget
            self.chat = Chat(s, self.engine, fmt, self.store, budget, library=self.library)
            if s.sample_docs:
                self._seed_sample()
            notes = (" " + " ".join(loaded.notes)) if loaded.notes else ""
            self._progress(
                f"Ready: {loaded.describe()} · context {budget.context_limit} tokens"
                f" · started in {time.perf_counter() - t0:.0f} s.{notes}"
            )
        except BaseException as e:  # shown in the UI's status line and raised to callers
            log.exception("model load failed")
            self._error = e
            self.status = f"Model failed to load: {e}"
        finally:
            self._ready.set()

    def _load_remote(self) -> None:
        """A remote engine generates (LLMWEB_ENGINE_URL): load the tokenizer only, no weights.

        The server need not be up: the page comes up, the status line says it is unreachable, and
        a background thread keeps checking (`_watch_remote`); requests meanwhile fail after the
        runner's retries with a message that says so.
        """
        from transformers import AutoConfig, AutoTokenizer

        from llmweb.chat.session import Chat
        from llmweb.chat.tokens import TemplateFormat
        from llmweb.engine.remote import RemoteConfig, remote_engine
        from llmweb.engine.request import EngineLimits

        s = self.settings
        try:
            t0 = time.perf_counter()
            source = s.model or tokenizer_dir(s, self._progress)
            self._progress(f"Loading the tokenizer of {s.model or models.EMBEDDED_NAME} (the engine is remote)…")
            tokenizer = AutoTokenizer.from_pretrained(source)
            max_context = int(getattr(AutoConfig.from_pretrained(source), "max_position_embeddings", 0) or 2048)
            budget = Budget.from_settings(s, max_context, on_cpu=False)  # the server's device, not ours
            limits = EngineLimits(
                queue_size=s.queue_size,
                max_new_tokens=budget.max_new_tokens,
                request_timeout_s=s.request_timeout_s,
                admission_wait_s=s.admission_wait_s,
                kv_reuse=s.kv_reuse,
                queue_per_user=s.queue_per_user,
                max_batch=s.engine_concurrency,
            )
            config = RemoteConfig(
                url=s.engine_url,
                model=s.engine_model,
                api_key=s.engine_api_key,
                routing_header=s.engine_routing_header,
                read_timeout_s=min(s.request_timeout_s, 60.0),
            )

            def encode(text: str) -> list[int]:
                return tokenizer.encode(text, add_special_tokens=False)

            def decode(ids) -> str:
                return tokenizer.decode(list(ids), skip_special_tokens=False)

            self.engine = remote_engine(config, encode, decode, limits)
            self.budget = budget
            self.chat = Chat(s, self.engine, TemplateFormat(tokenizer), self.store, budget, library=self.library)
            if s.sample_docs:
                self._seed_sample()
            self._remote_ready = f"context {budget.context_limit} tokens · started in {time.perf_counter() - t0:.0f} s"
            self._check_remote()
            threading.Thread(target=self._watch_remote, name="llmweb-remote-watch", daemon=True).start()
        except BaseException as e:  # shown in the UI's status line and raised to callers
            log.exception("remote engine set-up failed")
            self._error = e
            self.status = f"Remote engine set-up failed: {e}"
        finally:
            self._ready.set()

    def _check_remote(self) -> bool:
        """Update the status line: which engine serves, and whether it answers now."""
        from llmweb.engine.remote import RemoteRunner

        assert self.engine is not None and isinstance(self.engine.runner, RemoteRunner), "a remote engine"
        runner = self.engine.runner
        why = runner.server.reachable()
        url = self.settings.engine_url
        if why is None:
            try:
                name, caps = runner.server.model, runner.probe()  # the probe runs once, then is remembered
            except Exception as e:  # it answered /v1/models but not usefully (a wrong key, no model): say so
                name, why = "?", f"{type(e).__name__}: {e}"
        if why is None:
            prompts = "token-id prompts" if caps.ids else "text prompts"
            self.status = f"Ready: remote engine {url} · model {name} · reachable · {prompts} · {self._remote_ready}."
        else:
            self.status = (
                f"Ready, but the remote engine {url} is not reachable ({why}); retrying every "
                f"{REMOTE_RETRY_S:.0f} s. Messages fail until it answers."
            )
        return why is None

    def _watch_remote(self) -> None:
        while not self._closing.is_set():
            up = self._check_remote()
            self._closing.wait(REMOTE_CHECK_S if up else REMOTE_RETRY_S)

    def wait_ready(self, timeout: float | None = None) -> Chat:
        if not self._ready.wait(timeout):
            raise LlmwebError(f"The model is still loading ({self.status}). Try again in a moment.")
        if self._error is not None:
            if isinstance(self._error, LlmwebError):
                raise self._error
            raise ConfigError(f"The model failed to load: {self._error}")
        assert self.chat is not None  # a load without error made it
        return self.chat

    @property
    def ready(self) -> bool:
        return self._ready.is_set() and self._error is None

    # ---- documents
    def _seed_sample(self) -> None:
        """Index the bundled user guide into the shared library once per data dir, so a new user
        can ask about llmweb at once. (The previous version's marker, ".sample-seeded", marked the
        guide in the old "docs" index, which `Library` moves to the local owner's private library.)"""
        marker = self.settings.data_dir / "index" / SAMPLE_MARKER
        if marker.exists() or not SAMPLE_DIR.is_dir():
            return
        self._progress("Indexing the sample user guide…")
        reports = self.library.ingest_shared([SAMPLE_DIR])
        for r in reports:
            if not r.ok:
                log.warning("sample corpus: %s", r.describe())
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text("indexed into the shared library\n")

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
        LLMWEB_ANON_RETENTION_DAYS. Accounts and the single user are never purged. Returns
        (owners, conversations) deleted; logs the counts."""
        days = self.settings.anon_retention_days
        if days <= 0 or not self.ready:
            return 0, 0
        assert self.chat is not None  # ready
        owners, conversations = self.chat.purge_idle(ANON_PREFIXES, days * 86400, now)
        if owners:
            log.info(
                "retention: purged %d anonymous owners idle over %g days (%d conversations)",
                owners,
                days,
                conversations,
            )
        return owners, conversations

    def _purge_loop(self) -> None:
        """Once the model is up, then every PURGE_EVERY_S until close."""
        self._ready.wait()
        while not self._closing.is_set():
            try:
                self.purge_idle()
            except Exception:  # the next round tries again; serving is never affected
                log.exception("retention purge failed")
            self._closing.wait(PURGE_EVERY_S)

    def close(self) -> None:
        self._closing.set()
        if self.chat is not None:
            self.chat.wait_background(timeout=30)  # summaries write to the store
        if self.engine is not None:
            self.engine.close()
        self.store.close()
