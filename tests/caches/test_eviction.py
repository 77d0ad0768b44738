"""``evict_from_tree_cache``: the project's contract, evict exactly the allocator's shortfall."""

from __future__ import annotations

import pytest

from kvplug.eviction import evict_from_tree_cache
from kvplug_hookspecs import EvictResult
from tests.cache_helpers import cached_slots, make_chunk, make_radix, put


def _filled(capacity: int, free: int, leaf: int, page_size: int = 1, granularity: str = "exact"):
    """A radix cache whose allocator has ``free`` slots left, the rest cached in ``leaf``-token
    prompts."""
    cache, allocator = make_radix(capacity=capacity, page_size=page_size, granularity=granularity)
    first = 0
    while allocator.available_size() > free:
        n = min(leaf, allocator.available_size() - free)
        put(cache, allocator, [first, *range(1000, 1000 + n - 1)])
        first += 1
    assert allocator.available_size() == free and cache.evictable_size() == capacity - free
    return cache, allocator


def test_evicts_the_shortfall_not_the_request():
    """The SGLang regression: 20 needed, 5 free -> 15 evicted, not 20."""
    cache, allocator = _filled(capacity=40, free=5, leaf=5)
    assert evict_from_tree_cache(cache, 20) == EvictResult(num_tokens=15)
    assert allocator.available_size() == 20 and cache.evictable_size() == 20
    assert allocator.alloc(20) is not None
    assert (cache.stats.shortfall_requested_tokens, cache.stats.shortfall_freed_tokens) == (15, 15)


def test_exact_shortfall_cuts_a_leaf():
    cache, allocator = _filled(capacity=40, free=5, leaf=7)  # five 7-token prompts
    assert evict_from_tree_cache(cache, 20) == EvictResult(num_tokens=15)  # 7 + 7 + 1 cut
    assert allocator.available_size() == 20 and cache.total_size() == 20


def test_leaf_granularity_may_free_more():
    cache, _allocator = _filled(capacity=40, free=5, leaf=7, granularity="leaf")
    assert evict_from_tree_cache(cache, 20) == EvictResult(num_tokens=21)
    assert (cache.stats.shortfall_requested_tokens, cache.stats.shortfall_freed_tokens) == (15, 21)


def test_no_eviction_when_enough_is_free():
    cache, allocator = _filled(capacity=40, free=30, leaf=5)
    before = cached_slots(cache)
    assert evict_from_tree_cache(cache, 30) == EvictResult()
    assert evict_from_tree_cache(cache, 0) == EvictResult()
    assert cached_slots(cache) == before and allocator.available_size() == 30
    assert (cache.stats.evictions, cache.stats.shortfall_requested_tokens) == (0, 0)


def test_paged_shortfall_rounds_up_to_a_page():
    cache, allocator = _filled(capacity=64, free=8, leaf=16, page_size=4)
    # need 13, 8 free: shortfall 5 -> the allocator asks for 8 (two pages), the cache frees 8
    assert evict_from_tree_cache(cache, 13) == EvictResult(num_tokens=8)
    assert allocator.available_size() == 16 and cache.total_size() == 48
    assert allocator.alloc(16) is not None


def test_too_little_evictable_frees_what_it_can():
    cache, allocator = _filled(capacity=40, free=5, leaf=5)
    locked = cache.match_prefix([0, *range(1000, 1004)]).last_node
    cache.inc_lock_ref(locked)
    result = evict_from_tree_cache(cache, 100)
    assert result == EvictResult(num_tokens=30)  # all but the locked 5
    assert allocator.available_size() == 35 and cache.protected_size() == 5
    assert (cache.stats.shortfall_requested_tokens, cache.stats.shortfall_freed_tokens) == (95, 30)


def test_no_cache_or_chunk_cache_returns_none():
    assert evict_from_tree_cache(None, 10) is None
    chunk, _ = make_chunk(capacity=8)
    assert evict_from_tree_cache(chunk, 100) is None


def test_bad_num_tokens():
    cache, _allocator = _filled(capacity=16, free=0, leaf=4)
    with pytest.raises(ValueError, match=">= 0"):
        evict_from_tree_cache(cache, -1)
    with pytest.raises(TypeError, match="int"):
        evict_from_tree_cache(cache, 2.0)
    assert cache.total_size() == 16
