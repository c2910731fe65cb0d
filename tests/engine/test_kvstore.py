"""The session store's shared prefixes (engine/kvcache.py `donor`), on plain lists: pure logic."""

from __future__ import annotations

from llmweb.engine.kvcache import SHARED_MIN_TOKENS, KVStore

N = SHARED_MIN_TOKENS


def store(clock=lambda: 0.0) -> KVStore:
    return KVStore(budget_bytes=10**6, ttl_s=60.0, clock=clock)


def test_the_longest_common_prefix_of_the_callers_own_sessions_and_the_smallest_of_equals():
    kv = store()
    head = list(range(N + 4))
    kv.put("a-long", head + [1, 2, 3] * 50, "long", nbytes=900, owner="alice")
    kv.put("a-short", head + [1, 2, 3], "short", nbytes=100, owner="alice")
    kv.put("a-other", head[:N] + [99], "other", nbytes=10, owner="alice")
    kv.put("b", head + [1, 2, 3, 4], "bob's", nbytes=10, owner="bob")
    entry, n = kv.donor("alice", head + [1, 2, 3, 4, 5])
    assert (entry.cache, n) == ("short", N + 7), "the smallest of the two that share the most"
    assert set(kv.sessions()) == {"a-long", "a-short", "a-other", "b"}, "a donor stays in the store"
    assert kv.donor("carol", head + [1, 2]) is None, "never another owner's"
    entry, n = kv.donor("bob", head + [1, 2, 3, 4])
    assert entry.cache == "bob's" and n == len(head) + 3, "at least one prompt token is left to prefill"


def test_a_short_common_prefix_or_an_expired_entry_gives_nothing():
    now = {"t": 0.0}
    kv = store(lambda: now["t"])
    kv.put("a", list(range(N - 1)) + [7, 7], "a", nbytes=10, owner="alice")
    assert kv.donor("alice", list(range(N - 1)) + [8, 8]) is None, f"under {N} tokens shared"
    kv.put("b", list(range(2 * N)), "b", nbytes=10, owner="alice")
    assert kv.donor("alice", list(range(2 * N)) + [5])[1] == 2 * N
    now["t"] = 61.0
    assert kv.donor("alice", list(range(2 * N)) + [5]) is None, "past its TTL"
