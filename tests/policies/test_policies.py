"""Eviction policies: registration, options, and each documented order through a real RadixCache."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from kvplug.caches.common import CandidateStats
from kvplug.policies import LRUPolicy, SLRUOptions, SLRUPolicy
from kvplug_hookspecs import EvictionPolicy, EvictParams, NoOptions
from tests.cache_helpers import POLICIES, POLICY_NAMES, cached_slots, make_radix, put


def test_builtin_policies_are_registered_with_descriptions():
    assert POLICY_NAMES == (
        "lru",
        "lfu",
        "fifo",
        "mru",
        "filo",
        "priority",
        "slru",
        "arc",
        "s3fifo",
        "lhd",
        "olru",
        "gdsf",
    )
    for registration in POLICIES.values():
        assert registration.description
        policy = registration.factory(registration.options_model())
        assert isinstance(policy, EvictionPolicy)
        assert len(policy) == 0 and policy.pop() is None
    assert POLICIES["filo"].aliases == ("lifo",)
    assert POLICIES["slru"].options_model is SLRUOptions
    assert POLICIES["lru"].options_model is NoOptions


def test_slru_options_are_validated():
    assert SLRUOptions().protected_hits == 2
    assert SLRUPolicy(SLRUOptions(protected_hits=3)).options.protected_hits == 3
    for bad in (0, -1, 2.5, "2"):
        with pytest.raises(ValidationError, match="protected_hits"):
            SLRUOptions(protected_hits=bad)
    with pytest.raises(ValidationError, match="extra"):
        SLRUOptions(protected_hit=2)
    with pytest.raises(TypeError, match="SLRUOptions"):
        SLRUPolicy(NoOptions())


def _candidate(now: int) -> CandidateStats:
    return CandidateStats(now)


def test_touch_reranks_and_discard_removes():
    policy = LRUPolicy()
    a, b, c = _candidate(1), _candidate(2), _candidate(3)
    for x in (a, b, c):
        policy.add(x)
    a.last_access_time = 10
    policy.touch(a)
    policy.discard(b)
    assert len(policy) == 2 and b not in policy and a in policy
    assert [policy.pop(), policy.pop(), policy.pop()] == [c, a, None]


def _scenario(policy: str, **options):
    """Four 2-token prefixes with known statistics; returns the order the policy evicts them.

    insert A(t1, priority 1), B(t2, 0), C(t3, 2), D(t4, 0); match B (t5), A (t6), B (t7), D (t8):
    last access A6 B7 C3 D8, hits A1 B2 C0 D1, created A1 B2 C3 D4.
    """
    cache, allocator = make_radix(capacity=16, policy=policy, **options)
    keys = {"A": [10, 11], "B": [20, 21], "C": [30, 31], "D": [40, 41]}
    priorities = {"A": 1, "B": 0, "C": 2, "D": 0}
    slots = {
        name: set(put(cache, allocator, key, priority=priorities[name]).tolist())
        for name, key in keys.items()
    }
    for name in "BABD":
        assert cache.match_prefix(keys[name]).prefix_len == 2
    order = []
    while cache.evictable_size():
        before = cached_slots(cache)
        assert cache.evict(EvictParams(num_tokens=2)).num_tokens == 2
        gone = before - cached_slots(cache)
        order += [name for name, s in slots.items() if s == gone]
    return "".join(order)


@pytest.mark.parametrize(
    ("policy", "options", "expected"),
    [
        ("lru", {}, "CABD"),  # last access 3 < 6 < 7 < 8
        ("mru", {}, "DBAC"),
        ("lfu", {}, "CADB"),  # hits 0 < 1 (A older than D) < 2: counts really move on match
        ("fifo", {}, "ABCD"),  # hits do not re-rank
        ("filo", {}, "DCBA"),
        ("priority", {}, "BDAC"),  # priority 0 (LRU: B before D), then 1, then 2
        ("slru", {}, "CADB"),  # probationary (<2 hits) C, A, D in LRU order; protected B
        ("slru", {"protected_hits": 1}, "CABD"),  # probationary C; protected A, B, D in LRU order
    ],
)
def test_policy_eviction_order_through_radix_cache(policy, options, expected):
    assert _scenario(policy, **options) == expected


def test_lfu_counts_every_matched_node_of_a_path():
    """A hit on a long prompt counts on each node of its path, so a shared prefix stays hot."""
    cache, allocator = make_radix(capacity=32, policy="lfu")
    put(cache, allocator, [1, 2, 3, 4])
    tail = put(cache, allocator, [1, 2, 5, 6])[2:]  # splits: [1,2] -> [3,4], [5,6]
    other = put(cache, allocator, [9, 9])
    for _ in range(3):
        cache.match_prefix([1, 2, 3, 4])  # hits: [1,2] 3, [3,4] 3, [5,6] 0, [9,9] 0
    head_and_leaf = cached_slots(cache) - set(tail.tolist()) - set(other.tolist())
    cache.evict(EvictParams(num_tokens=2))  # [5,6]: 0 hits, older than [9,9]
    assert cached_slots(cache) == head_and_leaf | set(other.tolist())
    cache.evict(EvictParams(num_tokens=2))  # [9,9]
    assert cached_slots(cache) == head_and_leaf
    cache.evict(EvictParams(num_tokens=2))  # [3,4]; then [1,2] becomes a leaf
    assert cache.evictable_size() == 2
    assert cache.match_prefix([1, 2, 3, 4]).prefix_len == 2
