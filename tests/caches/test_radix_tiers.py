"""The radix cache's demotion when one eviction frees a leaf and then its parent."""

from __future__ import annotations

import torch

import kvplug
from kvplug import CacheKey, EvictParams


def test_an_eviction_that_frees_a_chain_demotes_every_page() -> None:
    stack = kvplug.build(
        {
            "allocator": "paged",
            "pool": {"capacity_tokens": 64, "page_size": 4, "device": "cpu", "store_kv": False},
            "storage": {"tiers": [{"name": "host"}], "background": False},
        }
    )
    cache, alloc = stack.prefix_cache, stack.allocator
    head, tail = list(range(8)), list(range(8, 16))
    first = alloc.alloc(8)
    cache.insert(CacheKey(head), first)
    cache.insert(CacheKey(head + tail), torch.cat([first, alloc.alloc(8)]))  # no match: no digests
    assert cache.evict(EvictParams(num_tokens=16)).num_tokens == 16  # the tail, then the head
    assert stack.storage is not None
    assert stack.storage.stats.demoted_pages == 4
    assert stack.storage.stats.dropped_pages == 0
    again = cache.match_prefix(CacheKey(head + tail + [99]))
    assert again.prefix_len == 16 and again.tier_tokens == (("host", 16),)
    assert alloc.available_size() + cache.evictable_size() + cache.protected_size() == 64
