"""Settings: one frozen dataclass, read once from `LLMWEB_*` environment variables.

Nothing here runs at import time. `Settings.from_env()` is called by the entry points (app.py,
the CLI, tests) and the result is passed down explicitly; no module reads the environment on
its own. Every field is checked in `__post_init__`, so a bad value fails at start with a clear
message instead of deep inside a turn.

docs/configuration.md's table lists every variable below with its default; tests/test_config.py
checks that the two stay in step.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from llmweb.errors import ConfigError, InputError

QUANTS = ("auto", "4bit", "8bit", "int8-cpu", "bf16", "fp16", "fp32")
BACKENDS = ("auto", "llama.cpp", "transformers")
GGUF_REQUANTS = ("auto", "q8_0", "none", "off")  # gguf.requant_kind; none and off are the same
DEVICES = ("auto", "cpu", "cuda")
CPU_CONTEXT_CAP = 2048  # tokens; prefill cost on CPU grows fast past this

REPO_DIR = Path(__file__).resolve().parent.parent
SAMPLE_DIR = REPO_DIR / "data" / "sample"


@dataclass(frozen=True, slots=True)
class Settings:
    # where things live
    data_dir: Path = REPO_DIR / "data"
    cache_dir: Path | None = None  # converted model copies; default data_dir/models
    models_dir: Path | None = None  # the models folder (engine/catalog.py); default data_dir/models
    model_keep_alive_s: float = 0.0  # unload the model after this long without a request; 0 = keep it loaded
    max_loaded: int = 1  # models kept loaded at once (runtime/resident.py); 1 = a switch closes the one served
    operators: str = ""  # login names (comma-separated) who may switch the server's model (web/owner.py)
    # the model
    model: str = ""  # "" = the embedded SmolLM2-135M-Instruct; else a hub id or a local path
    quant: str = "auto"  # 4bit on CUDA, int8-cpu on the CPU (models.resolve_quant)
    backend: str = "auto"  # llama.cpp for a GGUF model on the CPU, else transformers (models.resolve_backend)
    threads: int = 0  # llama.cpp's threads; 0 = the cores this process may use
    gguf_requant: str = "auto"  # llama.cpp: re-encode the GGUF file once as q8_0 (auto: a Q4_1 file; none: never)
    max_download_gb: float = 64.0  # `models fetch` (engine/hub.py) refuses a model bigger than this, in GB (10^9 B)
    device: str = "auto"
    offload: bool = False
    warmup: bool = False
    embedder: str = ""  # "" = the embedded all-MiniLM-L6-v2
    sample_docs: bool = True  # index the bundled user guide (data/sample) on first start
    # token budgets
    context_limit: int = 0  # 0 = the model's maximum, capped at CPU_CONTEXT_CAP on CPU
    max_new_tokens: int = 256  # the hard cap and the generation reserve
    summary_tokens: int = 192
    retrieved_tokens: int = 512
    user_tokens: int = 1024
    facts_tokens: int = 128  # the user's own fact sentences kept verbatim next to the summary
    memory_tokens: int = 128  # what a user asked all their chats to remember (store/memories.py)
    summaries: bool = True  # fold old turns into a summary (off: window only)
    recall: bool = True  # retrieve earlier turns that left the window
    recall_k: int = 2  # earlier turns recalled per message, at most
    history_high: float = 0.85  # fold old turns into the summary past this share of the room
    history_low: float = 0.5  # ... until history is back under this share
    system_prompt: str = (
        "You are a helpful, concise assistant. When sources are given, answer from them and "
        "cite them by their [number]."
    )
    # generation defaults
    temperature: float = 0.0
    top_p: float = 0.9
    repetition_penalty: float = 1.1
    loop_guard: bool = True  # a reply never says a sentence a third time (engine/runners/loopguard.py)
    # the engine
    queue_size: int = 8  # background jobs (summaries) waiting: 4 x this; visitors are bounded by max_wait_s
    max_wait_s: float = 120.0  # the waiting room: a request estimated to wait longer is refused with the estimate
    max_batch: int = 0  # requests sharing each decode step; 0 = by device (4 on CPU, 8 on GPU); 1 = serial
    request_timeout_s: float = 120.0
    admission_wait_s: float = 10.0
    mem_limit_mb: int = 0  # CPU: process RSS limit for admission; 0 = 80% of RAM
    mem_margin_mb: int = 512  # CUDA: free memory kept in reserve
    frag_release_mb: int = 256  # idle: empty_cache() when reserved-allocated passes this
    # the engine process (engine/process.py): the model runs in a child process, restarted when it dies
    engine_process: str = "auto"  # auto | 1 | 0; auto = on, except on ZeroGPU (its GPU is the web process's)
    zero_gpu: bool = False  # a ZeroGPU Space: read from SPACES_ZERO_GPU, which the platform sets (not an LLMWEB_ name)
    recycle_after: int = 0  # requests per engine process before a graceful replacement; 0 = never
    recycle_s: float = 0.0  # an engine process's age before a graceful replacement; 0 = never
    recycle_frag_mb: int = 0  # CUDA: replace it once inactive split bytes pass this after a request; 0 = never
    engine_stall_s: float = 300.0  # an engine process silent this long in one call is killed (and restarted)
    # session KV caches
    kv_reuse: bool = True
    kv_ttl_s: float = 1800.0
    kv_budget_mb: int = 0  # 0 = derived from device memory
    # retrieval
    top_k: int = 4
    max_top_k: int = 16
    min_score: float = 0.25  # the dense ranking's cosine floor (the relevance gate decides whether to retrieve)
    retrieval_gate: bool = True  # off: every message retrieves (hybrid ranking, dense floor only)
    reranker: str = ""  # "" = off; else a local folder of a sentence-transformers CrossEncoder
    chunk_tokens: int = 200
    chunk_overlap: int = 40
    # serving
    host: str = "127.0.0.1"
    port: int = 7860
    auth: str = ""  # "user:password[,user2:password2...]" turns on login
    auth_file: Path | None = None  # users file with salted scrypt hashes (python -m llmweb user add ...)
    max_file_mb: int = 20
    ocr_max_pages: int = 50  # pages (or images) one document may have read by OCR; 0 = OCR off
    ocr_max_s: float = 300.0  # OCR time one upload event may take, all its files, checked inside a page too
    max_message_chars: int = 100_000
    web_max_body_kb: int = 2048  # largest body of a page event (its message and the turns shown; web/body_cap.py)
    # many visitors, one server
    single_user: str = "auto"  # auto | 1 | 0: one owner ("local") for every browser; auto = loopback, no login
    shared_uploads: str = "auto"  # auto | 1 | 0: 1 = every UI upload joins the shared library; auto, 0 = private
    user_docs_mb: int = 50  # each owner's private uploads, in total
    queue_per_user: int = 2  # waiting requests per owner; more get the busy message
    running_per_user: int = 2  # requests one owner may have in the engine's batch at once (the local owner: not capped)
    prompt_tokens_per_min: int = 0  # prompt tokens one owner may have prefilled a minute; 0 = 4 x the context limit
    # ... and all the visitors of one client address together (its identities are one share); 0 = no cap
    running_per_address: int = 4
    prompt_tokens_per_address_min: int = 0  # 0 = twice the per-visitor figure
    warmups_per_min: int = 30  # warm-ups of opened chats accepted a minute, all visitors together; 0 = no limit
    warmups_per_user_min: int = 6  # ... and from one visitor
    owner_max_chats: int = 1000  # conversations one owner may keep (the local owner: not capped)
    owner_max_stored_mb: int = 200  # text one owner's chats may hold, imports included (the local owner: not capped)
    stored_per_address_mb: int = 0  # ... all the anonymous owners of one client address; 0 = 4 x the figure above
    docs_per_address_mb: int = 0  # their private uploads, together; 0 = 4 x LLMWEB_USER_DOCS_MB
    owner_document_jobs: int = 2  # whole-document tasks one owner may run at once (the local owner: not capped)
    anon_retention_days: float = 30.0  # purge anonymous owners idle this long; 0 = keep forever
    secret: str = ""  # signs browser state; "" = a random secret kept in data_dir/secret (mode 600)
    trusted_proxies: str = ""  # addresses/CIDRs of proxies whose X-Forwarded-For / Forwarded names the client
    anon_per_address: int = 20  # new anonymous visitors one client address may start per hour
    ipv6_prefix: int = 64  # an IPv6 client's address counts per network of this prefix (one line gets a /64)
    upload_per_address_mb: int = 200  # what one client address may upload to the page within the upload cache's life
    # a remote engine (engine/remote.py): an OpenAI-compatible server generates; this process loads the tokenizer only
    engine_url: str = ""  # "" = the local model; else http(s)://host:port of vLLM, SGLang, llama.cpp, ...
    engine_model: str = ""  # the server's model name; "" = the first it lists
    engine_api_key: str = ""  # sent as a Bearer token
    engine_concurrency: int = 8  # requests in flight to the server at once; more wait in the fair queue
    engine_routing_header: str = "X-Session-Id"  # carries the hashed conversation id for a sticky router
    engine_router: bool = False  # the engine URL is a router in front of replicas (docs/scaling.md): no slot pinning
    # the OpenAI-compatible API (web/api/)
    api_keys: str = ""  # "alice:key1,bob:key2" or "key1,key2"; none: open on a loopback bind only
    api_max_body_kb: int = 2048  # largest request body accepted

    def __post_init__(self) -> None:
        check = _Checker()
        check(self.quant in QUANTS, f"LLMWEB_QUANT must be one of {', '.join(QUANTS)}, not {self.quant!r}")
        check(self.backend in BACKENDS, f"LLMWEB_BACKEND must be one of {', '.join(BACKENDS)}, not {self.backend!r}")
        check(
            self.gguf_requant in GGUF_REQUANTS,
            f"LLMWEB_GGUF_REQUANT must be one of {', '.join(GGUF_REQUANTS)}, not {self.gguf_requant!r}",
        )
        check(self.threads >= 0, "LLMWEB_THREADS must be >= 0 (0 = the cores this process may use)")
        check(self.max_download_gb > 0, "LLMWEB_MAX_DOWNLOAD_GB must be > 0 (the largest model `models fetch` takes)")
        check(self.device in DEVICES, f"LLMWEB_DEVICE must be one of {', '.join(DEVICES)}, not {self.device!r}")
        check(self.context_limit >= 0, "LLMWEB_CONTEXT_LIMIT must be >= 0 (0 = the model's maximum)")
        check(self.max_batch >= 0, "LLMWEB_MAX_BATCH must be >= 0 (0 = by device, 1 = one request at a time)")
        check(self.model_keep_alive_s >= 0, "LLMWEB_MODEL_KEEP_ALIVE_S must be >= 0 (0 = keep the model loaded)")
        check(self.max_loaded >= 1, "LLMWEB_MAX_LOADED must be >= 1 (the models kept loaded at once; 1 = one)")
        check(self.max_new_tokens >= 1, "LLMWEB_MAX_NEW_TOKENS must be >= 1")
        check(self.memory_tokens >= 0, "LLMWEB_MEMORY_TOKENS must be >= 0 (0: no memory across chats)")
        for name in (
            "summary_tokens",
            "facts_tokens",
            "recall_k",
            "retrieved_tokens",
            "user_tokens",
            "queue_size",
            "top_k",
            "max_top_k",
            "chunk_tokens",
            "port",
            "max_file_mb",
            "max_message_chars",
            "api_max_body_kb",
            "web_max_body_kb",
            "engine_concurrency",
            "running_per_user",
        ):
            check(getattr(self, name) >= 1, f"LLMWEB_{name.upper()} must be >= 1")
        check(0 < self.history_low < self.history_high <= 1, "need 0 < LLMWEB_HISTORY_LOW < LLMWEB_HISTORY_HIGH <= 1")
        check(0 <= self.chunk_overlap < self.chunk_tokens, "need 0 <= LLMWEB_CHUNK_OVERLAP < LLMWEB_CHUNK_TOKENS")
        check(self.top_k <= self.max_top_k, "LLMWEB_TOP_K must be <= LLMWEB_MAX_TOP_K")
        check(self.request_timeout_s > 0 and self.kv_ttl_s > 0, "time limits must be > 0")
        check(self.max_wait_s > 0, "LLMWEB_MAX_WAIT_S must be > 0 (seconds a request may be estimated to wait)")
        check(self.ocr_max_pages >= 0, "LLMWEB_OCR_MAX_PAGES must be >= 0 (0 = no OCR)")
        check(self.ocr_max_s > 0, "LLMWEB_OCR_MAX_S must be > 0 (seconds of OCR per upload)")
        check(
            not self.auth or all(":" in pair for pair in self.auth.split(",")),
            "LLMWEB_AUTH must look like user:password (several: user1:pw1,user2:pw2)",
        )
        check(
            self.recycle_after >= 0 and self.recycle_s >= 0 and self.recycle_frag_mb >= 0,
            "LLMWEB_RECYCLE_AFTER, LLMWEB_RECYCLE_S and LLMWEB_RECYCLE_FRAG_MB must be >= 0 (0 = never)",
        )
        check(self.engine_stall_s > 0, "LLMWEB_ENGINE_STALL_S must be > 0")
        for name in ("single_user", "shared_uploads", "engine_process"):
            value = getattr(self, name)
            check(value in ("auto", "1", "0"), f"LLMWEB_{name.upper()} must be auto, 1 or 0, not {value!r}")
        check(
            self.user_docs_mb >= 1 and self.queue_per_user >= 1,
            "LLMWEB_USER_DOCS_MB and LLMWEB_QUEUE_PER_USER must be >= 1",
        )
        check(min(self.anon_per_address, self.upload_per_address_mb) >= 1, "LLMWEB_*_PER_ADDRESS* must be >= 1")
        check(1 <= self.ipv6_prefix <= 128, "LLMWEB_IPV6_PREFIX must be between 1 and 128 (64: one line's network)")
        check(
            min(self.owner_max_chats, self.owner_max_stored_mb, self.owner_document_jobs) >= 1,
            "LLMWEB_OWNER_MAX_CHATS, LLMWEB_OWNER_MAX_STORED_MB and LLMWEB_OWNER_DOCUMENT_JOBS must be >= 1",
        )
        self.proxy_networks  # noqa: B018  (ConfigError for an address that is not one)
        check(self.anon_retention_days >= 0, "LLMWEB_ANON_RETENTION_DAYS must be >= 0 (0 = keep forever)")
        address_caps = (self.prompt_tokens_per_address_min, self.stored_per_address_mb, self.docs_per_address_mb)
        check(min(self.running_per_address, *address_caps) >= 0, "per-address caps: >= 0")
        check(self.temperature >= 0, "LLMWEB_TEMPERATURE must be >= 0")
        check(
            not self.reranker or Path(self.reranker).expanduser().is_dir(),
            f"LLMWEB_RERANKER must be the local folder of a cross-encoder model, not {self.reranker!r} "
            "(nothing is downloaded)",
        )
        self._check_engine(check)
        if self.api_keys:
            parse_api_keys(self.api_keys)  # ConfigError with the entry's number, never the key

    def _check_engine(self, check: _Checker) -> None:
        """A remote engine's settings (LLMWEB_ENGINE_*)."""
        check(
            not self.engine_url or self.engine_url.split("://", 1)[0] in ("http", "https") and "://" in self.engine_url,
            f"LLMWEB_ENGINE_URL must look like http://host:port, not {self.engine_url!r}",
        )
        check(
            not self.engine_router or bool(self.engine_url),
            "LLMWEB_ENGINE_ROUTER=1 says LLMWEB_ENGINE_URL is a router: set LLMWEB_ENGINE_URL to the router's address",
        )
        check(
            not self.engine_router or self.context_limit > 0,
            "LLMWEB_ENGINE_ROUTER=1 needs LLMWEB_CONTEXT_LIMIT: the context one request may fill on every replica "
            "(llama.cpp: -c divided by -np; vLLM: --max-model-len). Behind a router, /props and /v1/models "
            "answer for whichever replica the router picks, so llmweb does not read it from there.",
        )

    @property
    def login(self) -> bool:
        return bool(self.auth or self.auth_file)

    @property
    def is_single_user(self) -> bool:
        """One person's install: every browser is the same owner ("local"). Auto: bound to a loopback
        address without login (a server others reach, or one with accounts, keeps visitors apart).
        This is the install's ceiling: web/identity.py decides per request (a proxied request, or one
        from another machine, is a stranger even here)."""
        if self.single_user != "auto":
            return self.single_user == "1"
        return not self.login and self.host in ("127.0.0.1", "localhost", "::1")

    @property
    def on_loopback(self) -> bool:
        """Bound to a loopback address: only this machine can reach the server."""
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False

    @property
    def proxy_networks(self) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
        """`LLMWEB_TRUSTED_PROXIES` as networks (a bare address is a /32 or /128)."""
        nets = []
        for item in self.trusted_proxies.split(","):
            if item.strip():
                try:
                    nets.append(ipaddress.ip_network(item.strip(), strict=False))
                except ValueError:
                    raise ConfigError(
                        f"LLMWEB_TRUSTED_PROXIES: {item.strip()[:60]!r} is not an address or a CIDR (10.0.0.0/8)"
                    ) from None
        return tuple(nets)

    @property
    def uploads_shared(self) -> bool:
        """Do UI uploads go to the shared library? Only where the operator says so (`1`): by default
        (auto, 0) every upload is its owner's, on every install (retrieval/library.py)."""
        return self.shared_uploads == "1"

    @property
    def in_engine_process(self) -> bool:
        """Does the local model run in an engine process of its own? Yes (auto), except on ZeroGPU,
        whatever LLMWEB_ENGINE_PROCESS says: its GPU calls are forks of the web process. Every Space
        has the `spaces` package, a dedicated-GPU one too, so that is no sign of ZeroGPU;
        SPACES_ZERO_GPU is (`spaces` reads it)."""
        if self.zero_gpu:
            return False
        return self.engine_process in ("auto", "1")

    @property
    def copies_dir(self) -> Path:
        """Where llmweb keeps its own converted copies of models (LLMWEB_CACHE_DIR)."""
        return self.cache_dir if self.cache_dir is not None else self.data_dir / "models"

    @property
    def models_folder(self) -> Path:
        """The folder whose .gguf files and model folders llmweb serves (LLMWEB_MODELS_DIR)."""
        return Path(self.models_dir).expanduser() if self.models_dir is not None else self.data_dir / "models"

    @property
    def max_download_bytes(self) -> int:
        return int(self.max_download_gb * 10**9)

    def replace(self, **changes) -> Settings:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides) -> Settings:
        """Read every field from `LLMWEB_<FIELD>`; keyword overrides win (the CLI's flags)."""
        source = os.environ if env is None else env
        values: dict = {"zero_gpu": zero_gpu(source)}
        for f in dataclasses.fields(cls):
            if f.name in PLATFORM_FIELDS:
                continue
            raw = source.get(f"LLMWEB_{f.name.upper()}")
            if raw is None or raw == "":
                continue
            values[f.name] = _parse(f, raw)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


def zero_gpu(env: Mapping[str, str]) -> bool:
    """Is this a ZeroGPU Space? SPACES_ZERO_GPU as the `spaces` package reads it (spaces/config.py)."""
    return (env.get("SPACES_ZERO_GPU") or "").lower() in ("1", "t", "true")


PLATFORM_FIELDS = {"zero_gpu"}  # settings the platform sets under its own names, not LLMWEB_*


def env_names() -> list[str]:
    return [f"LLMWEB_{f.name.upper()}" for f in dataclasses.fields(Settings) if f.name not in PLATFORM_FIELDS]


class _Checker:
    def __call__(self, ok: bool, message: str) -> None:
        if not ok:
            raise ConfigError(message)


def _parse(f: dataclasses.Field, raw: str):
    kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    name = f"LLMWEB_{f.name.upper()}"
    try:
        if "Path" in kind:
            return Path(raw).expanduser()
        if kind == "bool":
            low = raw.strip().lower()
            if low not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
                raise ValueError(raw)
            return low in ("1", "true", "yes", "on")
        if kind == "int":
            return int(raw)
        if kind == "float":
            return float(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a valid {kind}") from None
    return raw


# -- user names and the LLMWEB_API_KEYS spec (config checks them; web/accounts.py uses them) -------

MAX_USERNAME_CHARS = 64
USERNAME_RE = re.compile(rf"[A-Za-z0-9._@-]{{1,{MAX_USERNAME_CHARS}}}")  # ASCII only: no look-alike names


def check_username(name: str) -> str:
    if not isinstance(name, str) or not USERNAME_RE.fullmatch(name):
        shown = name[:MAX_USERNAME_CHARS] + "..." if isinstance(name, str) and len(name) > MAX_USERNAME_CHARS else name
        raise InputError(f"user name {shown!r} is not valid: use 1-{MAX_USERNAME_CHARS} letters, digits or . _ - @")
    return name


def parse_api_keys(spec: str) -> list[tuple[str | None, str]]:
    """`LLMWEB_API_KEYS`: "alice:key1,bob:key2" (a key of a user) or "key1,key2" (keys of no user),
    as (name or None, key). Messages never show a key."""
    out: list[tuple[str | None, str]] = []
    seen: set[str] = set()
    for n, item in enumerate(spec.split(",") if spec.strip() else [], 1):
        name, sep, key = item.strip().rpartition(":")
        if not key or any(c.isspace() for c in key):
            raise ConfigError(f"LLMWEB_API_KEYS: entry {n} has an empty key or one with spaces")
        if sep:
            try:
                check_username(name.strip())
            except InputError as e:
                raise ConfigError(f"LLMWEB_API_KEYS: entry {n}: {e}") from None
        if key in seen:
            raise ConfigError(f"LLMWEB_API_KEYS: entry {n} repeats a key")
        seen.add(key)
        out.append((name.strip() if sep else None, key))
    return out
