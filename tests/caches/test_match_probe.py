"""Engine-facing match options: a probe records nothing, hits are counted once at insert."""

from __future__ import annotations

import pytest
import torch

from kvplug.caches.block_hash import BlockHashCache
from kvplug.caches.radix import RadixCache
from kvplug_hookspecs import CacheKey
from tests.cache_helpers import make_allocator

CACHES = [RadixCache, BlockHashCache]


def _filled(cache_type, page_size: int = 1):
    allocator = make_allocator(64, page_size)
    cache = cache_type(allocator, page_size=page_size)
    tokens = list(range(8))
    cache.insert(tokens, allocator.alloc(8))
    return cache, tokens


def _snapshot(cache) -> tuple:
    node = cache.match_prefix(list(range(8)), record_hit=False, gather=False).last_node
    return (cache.stats.as_dict(), cache._clock, node.hit_count, node.last_access_time)


@pytest.mark.parametrize("cache_type", CACHES)
def test_probe_changes_nothing(cache_type) -> None:
    cache, tokens = _filled(cache_type)
    before = _snapshot(cache)
    for _ in range(10):
        probe = cache.match_prefix(tokens + [99], record_hit=False, gather=False)
        assert probe.prefix_len == 8
        assert probe.device_indices.numel() == 0
    assert _snapshot(cache) == before


@pytest.mark.parametrize("cache_type", CACHES)
def test_path_indices_equal_gathered_match(cache_type) -> None:
    cache, tokens = _filled(cache_type, page_size=2)
    match = cache.match_prefix(tokens)
    assert torch.equal(cache.path_indices(match.last_node), match.device_indices)
    assert cache.path_indices(cache.root).numel() == 0


@pytest.mark.parametrize("cache_type", CACHES)
def test_touch_refreshes_recency_without_a_hit(cache_type) -> None:
    cache, tokens = _filled(cache_type)
    node = cache.match_prefix(tokens, record_hit=False).last_node
    hits, stamp = node.hit_count, node.last_access_time
    cache.touch_prefix(CacheKey(tokens))
    assert node.hit_count == hits
    assert node.last_access_time > stamp
    assert cache.stats.match_queries == 0


@pytest.mark.parametrize("cache_type", CACHES)
def test_insert_counts_each_node_once_per_request(cache_type) -> None:
    allocator = make_allocator(64, 4)
    cache = cache_type(allocator, page_size=4)
    tokens = list(range(16))
    slots = allocator.alloc(16)
    cache.insert(tokens[:8], slots[:8], hits_after=0)  # first chunk
    cache.insert(tokens, slots, hits_after=8)  # the whole prompt: the first chunk is not recounted
    first = cache.match_prefix(tokens[:4], record_hit=False).last_node
    last = cache.match_prefix(tokens, record_hit=False).last_node
    assert first.hit_count == 1
    assert last.hit_count == 1
