"""ChunkCache: shares nothing, frees what it is given, never evicts."""

from __future__ import annotations

import pytest

from kvplug.caches.chunk import ChunkCache, ChunkCacheOptions
from kvplug.policies import LRUPolicy
from kvplug_hookspecs import CacheKey, EvictParams, EvictResult, PrefixCache, PrefixCacheContext
from tests.cache_helpers import RecordingEvents, make_allocator, make_chunk


def test_chunk_cache_shares_nothing_and_frees_aligned_slots():
    events = RecordingEvents()
    cache, allocator = make_chunk(capacity=16, page_size=4, events=events)
    assert isinstance(cache, PrefixCache) and cache.is_chunk_cache is True
    slots = allocator.alloc(8)
    assert cache.insert(CacheKey(list(range(6)), "ns"), slots[:6]) == 0
    assert (
        allocator.available_size() == 12
    )  # the first page freed; the partial page is the caller's
    m = cache.match_prefix(list(range(6)))
    assert (m.prefix_len, m.last_node, m.device_indices.tolist()) == (0, None, [])
    assert cache.inc_lock_ref(m.last_node) == 0 and cache.dec_lock_ref(m.last_node) == 0
    assert cache.evict(EvictParams(num_tokens=8)) == EvictResult()
    assert (cache.evictable_size(), cache.protected_size(), cache.total_size()) == (0, 0, 0)
    assert cache.all_values_flatten().numel() == 0
    cache.reset()
    assert (
        [e.num_tokens for e in events.cleared] == [0]
        and events.stored == []
        and events.removed == []
    )
    assert (cache.stats.match_queries, cache.stats.match_query_tokens, cache.stats.hit_tokens) == (
        1,
        6,
        0,
    )


def test_chunk_cache_rejects_bad_input_without_freeing():
    cache, allocator = make_chunk(capacity=8)
    slots = allocator.alloc(3)
    with pytest.raises(ValueError, match="3 slots but the key has 2 tokens"):
        cache.insert([1, 2], slots)
    with pytest.raises(TypeError, match="None"):
        cache.inc_lock_ref(object())
    with pytest.raises(TypeError, match="EvictParams"):
        cache.evict(3)
    assert allocator.available_size() == 5


def test_chunk_cache_from_context():
    allocator = make_allocator(8)
    ctx = PrefixCacheContext(allocator=allocator, new_policy=LRUPolicy, page_size=1)
    cache = ChunkCache.from_context(ctx, ChunkCacheOptions())
    assert cache.insert([1, 2], allocator.alloc(2)) == 0 and allocator.available_size() == 8
    assert cache.device == allocator.device
