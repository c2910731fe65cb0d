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


# ---- a share of the store per owner (`KVStore.put`)


def test_an_owner_over_its_share_evicts_its_own_caches_first():
    kv = KVStore(budget_bytes=100, ttl_s=60.0, clock=lambda: 0.0)
    kv.put("v1", [1], "victim's", nbytes=40, owner="victim")  # the oldest entry
    kv.put("f1", [1], "f1", nbytes=30, owner="flooder")
    kv.put("f2", [1], "f2", nbytes=30, owner="flooder")
    assert kv.put("f3", [1], "f3", nbytes=30, owner="flooder")
    assert set(kv.sessions()) == {"v1", "f2", "f3"}, "the flooder's own oldest went, not the victim's"
    assert kv.put("v2", [1], "v2", nbytes=10, owner="victim")  # the victim within its share: the flooder's go
    assert set(kv.sessions()) == {"v1", "f3", "v2"} and kv.total_bytes <= 100


def test_background_work_never_evicts_another_owners_cache():
    kv = KVStore(budget_bytes=100, ttl_s=60.0, clock=lambda: 0.0)
    kv.put("v1", [1], "v1", nbytes=60, owner="victim")
    kv.put("v2", [1], "v2", nbytes=40, owner="victim")
    assert not kv.put("w1", [1], "warm-up", nbytes=30, owner="opener", background=True), "not kept"
    assert set(kv.sessions()) == {"v1", "v2"}
    kv.put("o1", [1], "o1", nbytes=20, owner="opener")  # a visitor's own turn: the store is shared
    assert set(kv.sessions()) == {"v2", "o1"}, "the owner over its share lost its oldest"
    assert kv.put("w2", [1], "warm-up", nbytes=50, owner="opener", background=True)
    assert set(kv.sessions()) == {"v2", "w2"}, "a warm-up makes room from its own owner's caches"


def test_one_owner_alone_keeps_the_least_recently_used_order():
    kv = KVStore(budget_bytes=100, ttl_s=60.0, clock=lambda: 0.0)
    for i in range(5):
        kv.put(f"s{i}", [1], i, nbytes=30, owner="local")
    assert kv.sessions() == ["s2", "s3", "s4"] and kv.evictions == 2
