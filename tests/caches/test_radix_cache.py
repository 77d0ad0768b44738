"""RadixCache scenarios with exact numbers, through the public API and real allocators."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from kvplug.caches.radix import RadixCache, RadixCacheOptions, RadixNode
from kvplug.policies import LRUPolicy
from kvplug_hookspecs import CacheKey, EvictParams, EvictResult, PrefixCache, PrefixCacheContext
from tests.cache_helpers import RecordingEvents, cached_slots, make_allocator, make_radix, put


def _children(node):
    return sorted(child.num_tokens for child in node.children.values())


# -- insert / match / split ---------------------------------------------------------------------


def test_insert_match_split_page_1():
    cache, allocator = make_radix(capacity=32)
    assert isinstance(cache, PrefixCache) and cache.is_chunk_cache is False
    slots = put(cache, allocator, [1, 2, 3, 4, 5, 6])
    assert (cache.total_size(), cache.evictable_size(), cache.protected_size()) == (6, 6, 0)

    m = cache.match_prefix([1, 2, 3, 9])
    assert m.prefix_len == 3
    assert m.device_indices.dtype == torch.int64
    assert m.device_indices.tolist() == slots[:3].tolist()
    assert m.last_node.num_tokens == 3  # the node was split at the match end
    assert _children(cache.root) == [3] and _children(m.last_node) == [3]

    new = allocator.alloc(2)
    assert cache.insert([1, 2, 3, 7, 8], torch.cat([m.device_indices, new])) == 3
    assert _children(m.last_node) == [2, 3]
    assert (cache.total_size(), allocator.available_size()) == (8, 24)
    assert cache.match_prefix([1, 2, 3, 7, 8, 9]).device_indices.tolist() == [
        *slots[:3].tolist(),
        *new.tolist(),
    ]
    assert cache.match_prefix([1, 2, 3, 4, 5, 6]).prefix_len == 6
    assert cache.match_prefix([2, 1]).prefix_len == 0
    empty = cache.match_prefix([])
    assert (empty.prefix_len, empty.last_node, empty.device_indices.numel()) == (0, cache.root, 0)


def test_insert_of_a_cached_prefix_ending_inside_a_node_splits_it():
    cache, allocator = make_radix(capacity=32)
    slots = put(cache, allocator, [1, 2, 3, 4, 5, 6])
    assert cache.insert([1, 2, 3], slots[:3]) == 3
    assert cache.total_size() == 6 and allocator.available_size() == 26
    assert _children(cache.root) == [3]


def test_insert_match_split_page_4():
    cache, allocator = make_radix(capacity=64, page_size=4)
    key = list(range(100, 110))  # 10 tokens: 2 whole pages cached, 2 tokens left to the caller
    slots = allocator.alloc(12)
    assert cache.insert(key, slots[:10]) == 0
    assert cache.total_size() == 8
    allocator.free(slots[8:])  # the caller's partial page

    assert cache.match_prefix(key[:7]).prefix_len == 4  # truncated to whole pages
    assert cache.match_prefix(key).device_indices.tolist() == slots[:8].tolist()
    # a mismatch inside the second page matches only the first page, and splits at the page
    m = cache.match_prefix([*key[:5], 0, 0, 0])
    assert m.prefix_len == 4 and m.last_node.num_tokens == 4
    assert _children(cache.root) == [4] and _children(m.last_node) == [4]
    # a mismatch inside the first page shares nothing: a second child of the root
    put(cache, allocator, [100, 101, 102, 0])
    assert _children(cache.root) == [4, 4]
    assert cache.match_prefix([100, 101, 102, 0, 5]).prefix_len == 4
    assert (cache.total_size(), allocator.available_size()) == (12, 52)


def test_long_mismatch_is_found_by_bisection():
    cache, allocator = make_radix(capacity=2048)
    key = list(range(1000))
    put(cache, allocator, key)
    for cut in (1, 2, 511, 512, 999):
        probe = key[:cut] + [-1] + key[cut + 1 :]
        assert cache.match_prefix(probe).prefix_len == cut
    assert cache.total_size() == 1000


def test_namespaces_never_share():
    cache, allocator = make_radix(capacity=32)
    plain = put(cache, allocator, [1, 2, 3])
    lora = put(cache, allocator, [1, 2, 3], extra_key="lora-a")
    assert cache.total_size() == 6 and allocator.available_size() == 26
    assert (
        cache.match_prefix(CacheKey([1, 2, 3], "lora-a")).device_indices.tolist() == lora.tolist()
    )
    assert cache.match_prefix([1, 2, 3, 4]).device_indices.tolist() == plain.tolist()
    assert cache.match_prefix(CacheKey([1, 2], "lora-b")).prefix_len == 0
    # a split in one namespace leaves the other alone
    assert cache.match_prefix(CacheKey([1, 9], "lora-a")).prefix_len == 1
    assert cache.match_prefix([1, 2, 3]).last_node.num_tokens == 3


# -- ownership rule -----------------------------------------------------------------------------


def test_insert_frees_duplicate_slots_and_keeps_identical_ones():
    cache, allocator = make_radix(capacity=32)
    first = put(cache, allocator, [1, 2, 3, 4])
    assert allocator.available_size() == 28
    # a request that computed the same prompt on its own slots: all four are duplicates
    second = allocator.alloc(4)
    assert cache.insert([1, 2, 3, 4], second) == 4
    assert allocator.available_size() == 28 and cached_slots(cache) == set(first.tolist())
    # a request that reused the match (identical slots) and extended it: nothing freed
    m = cache.match_prefix([1, 2, 3, 4])
    new = allocator.alloc(2)
    assert cache.insert([1, 2, 3, 4, 5, 6], torch.cat([m.device_indices, new])) == 4
    assert allocator.available_size() == 26 and cache.total_size() == 6
    # mixed: the first two slots are the cached ones, the next two duplicates
    mixed = torch.cat([first[:2], allocator.alloc(2)])
    assert cache.insert([1, 2, 3, 4], mixed) == 4
    assert allocator.available_size() == 26
    assert (cached_slots(cache) | set(allocator.alloc(26).tolist())) == set(range(1, 33))


def test_insert_keeps_the_unaligned_tail_the_callers():
    cache, allocator = make_radix(capacity=16, page_size=4)
    slots = allocator.alloc(8)
    assert cache.insert(list(range(6)), slots[:6]) == 0
    assert cached_slots(cache) == set(slots[:4].tolist())
    assert allocator.available_size() == 8  # page 2 is still the caller's
    allocator.free(slots[4:])
    assert allocator.available_size() == 12


def test_bad_inserts_change_nothing():
    cache, allocator = make_radix(capacity=16)
    put(cache, allocator, [1, 2, 3])
    slots = allocator.alloc(4)
    state = (
        cache.total_size(),
        allocator.available_size(),
        _children(cache.root),
        cache.stats.as_dict(),
    )
    with pytest.raises(ValueError, match="4 slots but the key has 3 tokens"):
        cache.insert([1, 2, 7], slots)
    with pytest.raises(TypeError, match="integer"):
        cache.insert([1, 2, 7, 8], slots.float())
    with pytest.raises(TypeError, match="torch.Tensor"):
        cache.insert([1, 2, 7, 8], slots.tolist())
    with pytest.raises(ValueError, match="meta"):
        cache.insert([1, 2, 7, 8], torch.empty(4, dtype=torch.int64, device="meta"))
    with pytest.raises(TypeError, match="priority"):
        cache.insert([1, 2, 7, 8], slots, priority=1.5)
    with pytest.raises(TypeError, match="ints"):
        cache.insert([1.0, 2, 7, 8], slots)
    with pytest.raises(TypeError, match="CacheKey"):
        cache.insert("abcd", slots)
    assert (
        cache.total_size(),
        allocator.available_size(),
        _children(cache.root),
        cache.stats.as_dict(),
    ) == state
    # int32 slots and tensor keys are accepted
    assert (
        cache.insert(
            CacheKey(torch.tensor([1, 2, 7, 8], device=slots.device)), slots.to(torch.int32)
        )
        == 2
    )
    assert cache.total_size() == 5


def test_constructor_validation():
    allocator = make_allocator(16, page_size=4)
    with pytest.raises(ValueError, match="not a multiple of the allocator's page_size=4"):
        RadixCache(allocator, page_size=2)
    with pytest.raises(ValueError, match="positive"):
        RadixCache(allocator, page_size=0)
    with pytest.raises(TypeError, match="EvictionPolicy"):
        RadixCache(allocator, new_policy=lambda: object())
    with pytest.raises(ValidationError, match="granularity"):
        RadixCacheOptions(granularity="page")
    assert RadixCache(allocator, page_size=8).page_size == 8
    ctx = PrefixCacheContext(allocator=allocator, new_policy=LRUPolicy, page_size=4)
    cache = RadixCache.from_context(ctx, RadixCacheOptions(granularity="leaf"))
    assert (cache.page_size, cache.options.granularity, cache.device) == (
        4,
        "leaf",
        allocator.device,
    )


# -- locks --------------------------------------------------------------------------------------


def test_lock_moves_tokens_between_evictable_and_protected():
    cache, allocator = make_radix(capacity=32)
    put(cache, allocator, [1, 2, 3, 4, 5, 6])
    put(cache, allocator, [1, 2, 3, 7])
    m = cache.match_prefix([1, 2, 3, 4, 5, 6])
    assert cache.inc_lock_ref(m.last_node) == -6
    assert (cache.evictable_size(), cache.protected_size(), cache.total_size()) == (1, 6, 7)
    assert cache.inc_lock_ref(m.last_node) == 0  # a second request on the same prefix
    assert cache.evict(EvictParams(num_tokens=7)) == EvictResult(num_tokens=1)  # only [7]
    assert cache.dec_lock_ref(m.last_node) == 0
    assert cache.protected_size() == 6
    assert cache.dec_lock_ref(m.last_node) == 6
    assert (cache.evictable_size(), cache.protected_size()) == (6, 0)
    with pytest.raises(ValueError, match="not locked"):
        cache.dec_lock_ref(m.last_node)
    assert cache.inc_lock_ref(cache.root) == 0 and cache.dec_lock_ref(cache.root) == 0


def test_locked_inner_node_survives_and_becomes_evictable_on_unlock():
    cache, allocator = make_radix(capacity=32)
    put(cache, allocator, [1, 2, 3, 4])
    inner = cache.match_prefix([1, 2]).last_node  # split: [1,2] -> [3,4]
    cache.inc_lock_ref(inner)
    assert cache.evict(EvictParams(num_tokens=4)).num_tokens == 2  # the leaf [3,4]
    assert (cache.evictable_size(), cache.protected_size()) == (0, 2)
    cache.dec_lock_ref(inner)  # now an unlocked leaf
    assert cache.evict(EvictParams(num_tokens=4)).num_tokens == 2
    assert cache.total_size() == 0 and allocator.available_size() == 32


def test_bad_handles_are_rejected():
    cache, allocator = make_radix(capacity=32)
    other, other_allocator = make_radix(capacity=32)
    put(cache, allocator, [1, 2])
    put(other, other_allocator, [1, 2])
    node = cache.match_prefix([1, 2]).last_node
    with pytest.raises(ValueError, match="not cached here"):
        cache.inc_lock_ref(other.match_prefix([1, 2]).last_node)
    with pytest.raises(TypeError, match="RadixNode"):
        cache.inc_lock_ref(None)
    cache.evict(EvictParams(num_tokens=2))
    with pytest.raises(ValueError, match="not cached here"):
        cache.inc_lock_ref(node)
    assert (cache.evictable_size(), cache.protected_size()) == (0, 0)


# -- eviction -----------------------------------------------------------------------------------


def test_exact_eviction_cuts_the_last_leaf_and_keeps_its_head():
    cache, allocator = make_radix(capacity=32)
    slots = put(cache, allocator, list(range(10)))
    assert cache.evict(EvictParams(num_tokens=3)) == EvictResult(num_tokens=3)
    assert cached_slots(cache) == set(slots[:7].tolist())
    assert cache.match_prefix(list(range(10))).prefix_len == 7
    assert allocator.available_size() == 25


def test_exact_eviction_rounds_up_to_a_page():
    cache, allocator = make_radix(capacity=32, page_size=4)
    put(cache, allocator, list(range(12)))
    assert cache.evict(EvictParams(num_tokens=5)) == EvictResult(num_tokens=8)
    assert cache.match_prefix(list(range(12))).prefix_len == 4
    assert allocator.available_size() == 28


def test_leaf_granularity_frees_whole_leaves():
    cache, allocator = make_radix(capacity=32, page_size=4, granularity="leaf")
    put(cache, allocator, list(range(12)))
    assert cache.evict(EvictParams(num_tokens=5)) == EvictResult(num_tokens=12)
    assert cache.total_size() == 0 and allocator.available_size() == 32


def test_eviction_climbs_to_parents_in_policy_order():
    cache, allocator = make_radix(capacity=32)
    put(cache, allocator, [1, 2, 3])
    put(cache, allocator, [1, 2, 4, 5])  # [1,2] -> [3], [4,5]
    put(cache, allocator, [9, 9, 9])
    # LRU: [3] (t1), then [4,5] (t2); [1,2] (touched at t2) then beats [9,9,9] (t3)
    assert cache.evict(EvictParams(num_tokens=5)).num_tokens == 5
    assert cache.total_size() == 3 and cache.match_prefix([9, 9, 9]).prefix_len == 3
    assert cache.evict(EvictParams(num_tokens=100)) == EvictResult(num_tokens=3)  # all there is
    assert allocator.available_size() == 32
    assert cache.evict(EvictParams(num_tokens=1)) == EvictResult()
    assert cache.evict(EvictParams()) == EvictResult()
    with pytest.raises(TypeError, match="EvictParams"):
        cache.evict(5)


def test_reset_frees_everything_and_refuses_while_locked():
    events = RecordingEvents()
    cache, allocator = make_radix(capacity=32, events=events)
    put(cache, allocator, [1, 2, 3])
    put(cache, allocator, [4, 5])
    node = cache.match_prefix([4, 5]).last_node
    cache.inc_lock_ref(node)
    with pytest.raises(RuntimeError, match="2 cached tokens are locked"):
        cache.reset()
    assert cache.total_size() == 5
    cache.dec_lock_ref(node)
    cache.reset()
    assert (cache.total_size(), allocator.available_size()) == (0, 32)
    assert cache.match_prefix([1, 2, 3]).prefix_len == 0
    assert [e.num_tokens for e in events.cleared] == [5]
    with pytest.raises(ValueError, match="not cached here"):
        cache.inc_lock_ref(node)


# -- observability ------------------------------------------------------------------------------


def test_events_and_stats():
    events = RecordingEvents()
    cache, allocator = make_radix(capacity=32, events=events)
    put(cache, allocator, [1, 2, 3, 4])
    put(cache, allocator, [1, 2, 5], extra_key="ns")
    put(cache, allocator, [1, 2, 3, 4])  # nothing new: no event, duplicates freed
    assert [(e.cache, e.num_tokens, e.extra_key) for e in events.stored] == [
        ("radix", 4, None),
        ("radix", 3, "ns"),
    ]
    cache.match_prefix([1, 2, 3, 9])
    cache.match_prefix([7])
    cache.evict(EvictParams(num_tokens=5))
    assert [(e.cache, e.num_tokens, e.reason) for e in events.removed] == [("radix", 5, "evicted")]
    assert cache.stats.as_dict() == {
        "match_queries": 2,
        "match_query_tokens": 5,
        "hit_tokens": 3,
        "inserted_tokens": 7,
        "evicted_tokens": 5,
        "swa_evicted_tokens": 0,
        "evictions": 1,
        "shortfall_requested_tokens": 0,
        "shortfall_freed_tokens": 0,
        "hit_rate": 0.6,
    }


def test_priority_is_raised_along_the_path():
    cache, allocator = make_radix(capacity=32, policy="priority")
    put(cache, allocator, [1, 2, 3], priority=1)
    put(cache, allocator, [1, 2, 4], priority=5)  # [1,2] -> [3] (1), [4] (5); [1,2] raised to 5
    put(cache, allocator, [8, 8], priority=3)
    inner = cache.match_prefix([1, 2]).last_node
    assert isinstance(inner, RadixNode) and inner.priority == 5
    assert cache.evict(EvictParams(num_tokens=1)).num_tokens == 1
    assert cache.match_prefix([1, 2, 3]).prefix_len == 2  # priority 1 went first
    cache.evict(EvictParams(num_tokens=2))  # [8,8] (3) before [4] (5)
    assert cache.match_prefix([8, 8]).prefix_len == 0
    assert cache.total_size() == 3


class CountingLRU(LRUPolicy):
    """LRU that counts the policy calls a cache makes."""

    def __init__(self, options=None):
        super().__init__(options)
        self.calls = {"add": 0, "discard": 0, "touch": 0, "pop": 0}

    def add(self, c):
        self.calls["add"] += 1
        super().add(c)

    def discard(self, c):
        self.calls["discard"] += 1
        super().discard(c)

    def touch(self, c):
        self.calls["touch"] += 1
        super().touch(c)

    def pop(self):
        self.calls["pop"] += 1
        return super().pop()


def test_eviction_touches_only_its_victims_not_every_leaf():
    """The evictable set is kept incrementally: evicting k leaves of N costs k pops, no rebuild."""
    allocator = make_allocator(4096)
    policy = CountingLRU()
    cache = RadixCache(allocator, lambda: policy)
    for i in range(1000):
        put(cache, allocator, [i, i, i, i])
    assert len(policy) == 1000
    policy.calls = dict.fromkeys(policy.calls, 0)
    assert cache.evict(EvictParams(num_tokens=10)).num_tokens == 10  # 4 + 4 + 2 of the third
    assert policy.calls == {"add": 1, "discard": 0, "touch": 0, "pop": 3}  # the cut leaf re-joins
    assert len(policy) == 998


@pytest.mark.parametrize(
    ("page_size", "capacity", "cached"),
    [(1, 32, 10 + 1 + 11), (4, 32, 8 + 0 + 8), (1, 16, 16), (4, 16, 12)],  # 16: must evict
)
def test_documented_engine_sequence_conserves_slots(page_size, capacity, cached):
    """The module docstring's match -> lock -> evict -> alloc -> insert -> free tail -> unlock."""
    from kvplug.eviction import evict_from_tree_cache

    cache, allocator = make_radix(capacity=capacity, page_size=page_size)
    for tokens in (
        [1, 2, 3, 4, 5, 6, 7, 8, 9, 10],
        [1, 2, 3, 4, 5, 6, 7, 8, 11],
        [1, 2, 3, 4, 20] * 3,
    ):
        key = CacheKey(tokens)
        m = cache.match_prefix(key)
        cache.inc_lock_ref(m.last_node)
        need = -(-(len(tokens) - m.prefix_len) // page_size) * page_size
        evict_from_tree_cache(cache, need)
        new = allocator.alloc(need)
        cache.insert(key, torch.cat([m.device_indices, new])[: len(tokens)])
        aligned = len(tokens) // page_size * page_size
        allocator.free(new[aligned - m.prefix_len :])
        cache.dec_lock_ref(m.last_node)
        assert cache.match_prefix(key).prefix_len == aligned
        assert allocator.available_size() + cache.total_size() == capacity
        assert cache.protected_size() == 0
    assert cache.total_size() == cached
