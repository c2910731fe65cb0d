"""Engine parts from Settings: the KV and memory budgets, the local engine's limits, and the whole
remote engine (LLMWEB_ENGINE_URL: its tokenizer, budget, limits and runner).

These are pure set-up: they read settings and the loaded model and build objects; they must not
start threads, keep state or touch the store (runtime/__init__.py's `Runtime` wires the parts).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

from llmweb.chat.context import Budget
from llmweb.config import Settings
from llmweb.engine import models
from llmweb.records import LOCAL_OWNER

if TYPE_CHECKING:
    from llmweb.engine.request import EngineLimits
    from llmweb.engine.scheduler import Engine


def kv_budget_bytes(settings: Settings, loaded) -> int:
    """LLMWEB_KV_BUDGET_MB, or a quarter of free device memory after loading (CPU: 1/16 of RAM, <= 1 GiB),
    or less where the model was sized to a tight memory (`size_to_memory`: a quarter of the room).
    Free device memory counts the blocks the allocator keeps cached from loading (`device_free_bytes`)."""
    if settings.kv_budget_mb > 0:
        return settings.kv_budget_mb * 2**20
    if getattr(loaded, "kv_store_bytes", 0):
        return loaded.kv_store_bytes
    if not loaded.on_cpu:
        return max(int(models.device_free_bytes(getattr(loaded, "device", "cuda")) * 0.25), 64 * 2**20)
    return host_kv_budget_bytes(settings)


def host_kv_budget_bytes(settings: Settings) -> int:
    """The idle chats' caches kept in this process's memory: LLMWEB_KV_BUDGET_MB, or 1/16 of RAM, <= 1 GiB."""
    if settings.kv_budget_mb > 0:
        return settings.kv_budget_mb * 2**20
    return min(psutil.virtual_memory().total // 16, 2**30)


def cpu_mem_limit_bytes(settings: Settings) -> int:
    if settings.mem_limit_mb > 0:
        return settings.mem_limit_mb * 2**20
    return int(psutil.virtual_memory().total * 0.8)


def size_to_memory(settings: Settings, loaded) -> None:
    """Fit the loaded model's context and batch to the memory left now (engine/sizing.py), in the
    process that holds it: `loaded.max_context` and `loaded.max_batch` are cut where every slot's
    full-context KV cache would not fit, and the reason joins `loaded.notes` (the status line)."""
    from llmweb.engine.admission import ACTIVATION_FLOOR
    from llmweb.engine.request import auto_max_batch
    from llmweb.engine.sizing import fit

    s = settings
    wanted = Budget.from_settings(s, loaded.max_context, loaded.on_cpu).context_limit
    slots = s.max_batch or auto_max_batch(loaded.on_cpu)
    margin = s.mem_margin_mb * 2**20
    if loaded.on_cpu:  # the weights are resident once loaded (llama.cpp reads them all: 111 MiB for a 92 MiB file)
        room = cpu_mem_limit_bytes(s) - psutil.Process().memory_info().rss - margin
    else:  # what the allocator holds cached from loading is room too (`device_free_bytes`)
        room = models.device_free_bytes(getattr(loaded, "device", "cuda")) - margin
    room -= ACTIVATION_FLOOR  # the compute buffers and activations beside the KV caches (engine/admission.py)
    sized = fit(wanted, slots, loaded.kv_bytes_per_token, room, name=loaded.name)
    if sized.note:  # tight: the idle chats' caches (kept as host bytes) get a quarter of the room, the pool the rest
        loaded.kv_store_bytes = min(kv_budget_bytes(s, loaded), max(room, 0) // 4)
        sized = fit(wanted, slots, loaded.kv_bytes_per_token, room - loaded.kv_store_bytes, name=loaded.name)
    loaded.max_context = min(loaded.max_context, sized.context) if sized.note else loaded.max_context
    loaded.max_batch = sized.slots
    if sized.note:
        loaded.notes.append(sized.note)


def uncapped_owner(s: Settings) -> str:
    """The owner whose own parallel requests queue past LLMWEB_QUEUE_PER_USER: the one person of a
    single-user install (`Settings.is_single_user`: loopback, no login; or LLMWEB_SINGLE_USER=1),
    so an agent that fans out its calls is not refused by its own install. Elsewhere none."""
    return LOCAL_OWNER if s.is_single_user else ""


def _queue_limits(s: Settings, budget: Budget) -> dict[str, Any]:
    """The limits every engine has, local or remote: its queue, the reply cap, time limits, KV reuse."""
    prompt_cap = s.prompt_tokens_per_min or 4 * budget.context_limit
    return dict(
        queue_size=s.queue_size,
        max_new_tokens=budget.max_new_tokens,
        request_timeout_s=s.request_timeout_s,
        admission_wait_s=s.admission_wait_s,
        kv_reuse=s.kv_reuse,
        queue_per_user=s.queue_per_user,
        uncapped_owner=uncapped_owner(s),
        max_wait_s=s.max_wait_s,
        running_per_user=s.running_per_user,
        prompt_tokens_per_min=prompt_cap,
        running_per_address=s.running_per_address,
        prompt_tokens_per_address_min=s.prompt_tokens_per_address_min or 2 * prompt_cap,
        warmups_per_min=s.warmups_per_min,
        warmups_per_owner_min=s.warmups_per_user_min,
    )


def local_limits(settings: Settings, budget: Budget, loaded) -> EngineLimits:
    """The local engine's queue, time and memory limits."""
    from llmweb.engine.request import EngineLimits, auto_max_batch

    s = settings
    return EngineLimits(
        **_queue_limits(s, budget),
        mem_limit_bytes=cpu_mem_limit_bytes(s) if loaded.on_cpu else 0,
        mem_margin_bytes=s.mem_margin_mb * 2**20,
        frag_release_bytes=s.frag_release_mb * 2**20,
        max_batch=min(s.max_batch or auto_max_batch(loaded.on_cpu), getattr(loaded, "max_batch", 0) or 1 << 30),
    )


def tokenizer_dir(settings: Settings, progress) -> Path:
    """The embedded model's folder for its tokenizer: the converted copy (made once, as for the local model)."""
    target = models.converted_dir(settings)
    if (target / "tokenizer.json").is_file():
        return target
    return models.ensure_converted(settings, progress)


def remote_parts(settings: Settings, progress: Callable[[str], None]) -> tuple[Engine, Budget, object]:
    """A remote engine (no weights here): (engine, budget, tokenizer). The server need not be up."""
    from transformers import AutoConfig, AutoTokenizer

    from llmweb.engine.remote import remote_engine
    from llmweb.engine.request import EngineLimits
    from llmweb.engine.server import ROUTER_RETRIES, RemoteConfig, Server

    s = settings
    source = s.model or tokenizer_dir(s, progress)
    progress(f"Loading the tokenizer of {s.model or models.EMBEDDED_NAME} (the engine is remote)…")
    tokenizer = AutoTokenizer.from_pretrained(source)
    config = RemoteConfig(
        url=s.engine_url,
        model=s.engine_model,
        api_key=s.engine_api_key,
        routing_header=s.engine_routing_header,
        read_timeout_s=min(s.request_timeout_s, 60.0),
        router=s.engine_router,
        retries=ROUTER_RETRIES if s.engine_router else 3,
    )
    max_context = int(getattr(AutoConfig.from_pretrained(source), "max_position_embeddings", 0) or 2048)
    # a llama.cpp slot holds n_ctx / slots: less than the model's; a router: LLMWEB_CONTEXT_LIMIT (required) says
    served = Server(config).context_length()
    if served:
        max_context = min(max_context, served)
    budget = Budget.from_settings(s, max_context, on_cpu=False)  # the server's device, not ours
    limits = EngineLimits(**_queue_limits(s, budget), max_batch=s.engine_concurrency)

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    def decode(ids) -> str:
        return tokenizer.decode(list(ids), skip_special_tokens=False)

    return remote_engine(config, encode, decode, limits), budget, tokenizer
