"""Per-session KV caches: longest-common-prefix reuse, TTL, eviction under a byte budget with a
share per owner (an owner over its share evicts its own caches first; a background job never
evicts another owner's: `KVStore.put`), least recently used first within each pass.

Each entry keeps a transformers `DynamicCache` and the exact token ids it holds
(prompt + generated[:-1]; the last sampled token was never fed to the model). Reuse is
decided on ids alone, never on re-tokenised text: a generated token can re-encode as two
(docs/architecture.md), so the cache is cropped to the longest common prefix with the new prompt, and
at least one prompt token is always left to prefill (the model needs logits for it).

Only the engine's worker thread uses entries. `take()` removes an entry while it is in use, so
eviction can never touch a cache mid-generation. Other threads may `drop()` a session (deleted
chat, changed summary) at any time.

A session with no cache of its own (a new chat, a stateless API request) may start from a copy of
the longest prefix it shares with another session of the same owner (`donor`: the system prompt
and the template's header, ~30 tokens at the defaults), as llama-server's slots reuse their last
prompt; only on a runner whose restore copies the donor's bytes and leaves them as they were
(`BaseRunner.shares_prefixes`). Never across owners: the time to the first token would tell a
stranger what another visitor's prompt begins with.

Owns: the session caches, their budget and reuse rule. Must not: import torch at module level
(the measuring helpers read tensors they are given), or run the model.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


def cache_nbytes(cache) -> int:
    """Bytes held by a DynamicCache, summed from its key and value tensors."""
    total = 0
    for layer in getattr(cache, "layers", ()):
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if t is not None and hasattr(t, "untyped_storage"):
                total += t.untyped_storage().nbytes()
    return total


def kv_bytes_per_token(config, dtype_bytes: int) -> int:
    """layers x kv_heads x head_dim x 2 (keys and values) x bytes per element."""
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return config.num_hidden_layers * heads * head_dim * 2 * dtype_bytes


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def reusable(cached_ids: Sequence[int], prompt_ids: Sequence[int]) -> int:
    """How many cached tokens a prompt can reuse: the common prefix, leaving >= 1 to prefill."""
    return min(common_prefix(cached_ids, prompt_ids), len(prompt_ids) - 1)


SHARED_MIN_TOKENS = 16  # the least a donor's prefix must give: below it, copying its state costs more


@dataclass(slots=True)
class Entry:
    ids: list[int]
    cache: Any  # a transformers DynamicCache (not imported here: this module needs no torch)
    nbytes: int
    last_used: float
    owner: str = ""


class KVStore:
    def __init__(self, budget_bytes: int, ttl_s: float, clock: Callable[[], float] = time.monotonic):
        self.budget_bytes = budget_bytes
        self.ttl_s = ttl_s
        self.clock = clock
        self._entries: dict[str, Entry] = {}  # insertion order = LRU order (oldest first)
        self._lock = threading.Lock()
        self.evictions = 0

    # ---- used by the worker around one request
    def take(self, session_id: str) -> Entry | None:
        """Remove and return the session's entry (None if absent or expired)."""
        with self._lock:
            entry = self._entries.pop(session_id, None)
        if entry is not None and self.clock() - entry.last_used > self.ttl_s:
            return None
        return entry

    def donor(self, owner: str, prompt_ids: Sequence[int]) -> tuple[Entry, int] | None:
        """The owner's entry that shares the longest prefix with `prompt_ids` (the smallest one of
        equals: the least to copy), and how many tokens of it the prompt can reuse; None under
        SHARED_MIN_TOKENS. The entry stays in the store: the caller copies from it, never changes it.
        Linear in the owner's entries times the prompt (each comparison stops at the first difference)."""
        now, best, best_n = self.clock(), None, SHARED_MIN_TOKENS - 1
        with self._lock:
            entries = [e for e in self._entries.values() if e.owner == owner and now - e.last_used <= self.ttl_s]
        for e in entries:
            n = reusable(e.ids, prompt_ids)
            if n > best_n or (n == best_n and best is not None and e.nbytes < best.nbytes):
                best, best_n = e, n
        return (best, best_n) if best is not None else None

    def put(
        self,
        session_id: str,
        ids: list[int],
        cache,
        nbytes: int | None = None,
        owner: str = "",
        background: bool = False,
    ) -> bool:
        """Store `owner`'s session cache after a request, evicting idle entries to fit (`_room_locked`:
        the owner's own first). Returns False (and keeps nothing) when this cache alone exceeds the
        budget, or when a `background` job's cache would fit only by evicting another owner's."""
        nbytes = cache_nbytes(cache) if nbytes is None else nbytes
        assert nbytes >= 0, "a cache cannot hold negative bytes"
        if nbytes > self.budget_bytes:
            return False
        with self._lock:
            self._entries.pop(session_id, None)
            if not self._room_locked(owner, nbytes, background):
                return False
            self._entries[session_id] = Entry(list(ids), cache, nbytes, self.clock(), owner)
        return True

    # ---- maintenance, any thread
    def drop(self, session_id: str) -> bool:
        with self._lock:
            return self._entries.pop(session_id, None) is not None

    def expire(self) -> int:
        now = self.clock()
        with self._lock:
            old = [k for k, e in self._entries.items() if now - e.last_used > self.ttl_s]
            for k in old:
                del self._entries[k]
        return len(old)

    def evict(self, need_bytes: int) -> int:
        """Evict idle entries, oldest first, until `need_bytes` could be added. Returns bytes freed."""
        with self._lock:
            before = self._total_locked()
            self._evict_locked(self.budget_bytes - need_bytes)
            return before - self._total_locked()

    def clear(self) -> int:
        with self._lock:
            freed = self._total_locked()
            self._entries.clear()
            return freed

    @property
    def total_bytes(self) -> int:
        with self._lock:
            return self._total_locked()

    def session_bytes(self, session_id: str) -> int:
        with self._lock:
            e = self._entries.get(session_id)
            return e.nbytes if e else 0

    def sessions(self) -> list[str]:
        with self._lock:
            return list(self._entries)

    def peek(self, session_id: str) -> Entry | None:
        """The session's entry, left in place (None if absent or expired): to copy it elsewhere."""
        with self._lock:
            entry = self._entries.get(session_id)
        if entry is None or self.clock() - entry.last_used > self.ttl_s:
            return None
        return entry

    def _total_locked(self) -> int:
        return sum(e.nbytes for e in self._entries.values())

    def _room_locked(self, owner: str, nbytes: int, background: bool) -> bool:
        """Room for `owner`'s new entry of `nbytes`, each owner's share being the budget over the
        owners holding entries (the newcomer counted). Evicted in passes, oldest first in each:
        the owner's own while it holds more than its share; other owners' while they hold more
        than theirs; the owner's own; anyone's. A background job (a summary, a warm-up) takes the
        owner's own passes only: it never evicts another owner's cache. Whether it fits."""
        allowed = self.budget_bytes - nbytes
        used: dict[str, int] = {owner: nbytes}
        for e in self._entries.values():
            used[e.owner] = used.get(e.owner, 0) + e.nbytes
        total, share = sum(used.values()) - nbytes, self.budget_bytes // len(used)
        passes: list[Callable[[Entry], bool]] = [
            lambda e: e.owner == owner and used[owner] > share,
            lambda e: e.owner != owner and used[e.owner] > share and not background,
            lambda e: e.owner == owner,
            lambda e: not background,
        ]
        for evictable in passes:
            for key, e in list(self._entries.items()):
                if total <= allowed:
                    return True
                if evictable(e):
                    del self._entries[key]
                    total, used[e.owner] = total - e.nbytes, used[e.owner] - e.nbytes
                    self.evictions += 1
        return total <= allowed

    def _evict_locked(self, allowed_total: int) -> None:
        while self._entries and self._total_locked() > max(allowed_total, 0):
            oldest = next(iter(self._entries))
            del self._entries[oldest]
            self.evictions += 1
