"""Every cache x policy combination is selectable by config and works through ``kvplug.build``."""

from __future__ import annotations

import pytest
import torch

import kvplug
from kvplug import CacheKey, EvictResult

POLICIES = ["lru", "lfu", "fifo", "mru", "filo", "priority", "slru", "largest_first"]
CACHES = ["radix", "swa_radix", "block_hash", "chunk"]


def _config(cache: str, policy: str) -> dict:
    pool = {"capacity_tokens": 64, "num_layers": 2, "kv_heads": 1, "head_dim": 4, "device": "cpu"}
    if cache == "swa_radix":
        allocator = {
            "name": "swa",
            "options": {"swa_capacity_tokens": 64, "sliding_window_size": 4},
        }
    else:
        allocator, pool["page_size"] = "paged", 4
    return {"allocator": allocator, "prefix_cache": cache, "eviction_policy": policy, "pool": pool}


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("cache_name", CACHES)
def test_build_insert_match_and_evict_exactly_the_shortfall(cache_name, policy):
    stack = kvplug.build(_config(cache_name, policy))
    cache, allocator = stack.prefix_cache, stack.allocator
    assert allocator.available_size() == 64
    prompts = [list(range(100 * i, 100 * i + 16)) for i in range(3)]
    for tokens in prompts[:2]:
        slots = allocator.alloc(16)
        stack.pool.set_kv(
            0,
            slots,
            torch.ones(16, 1, 4, dtype=stack.pool.dtype),
            torch.ones(16, 1, 4, dtype=stack.pool.dtype),
        )
        assert cache.insert(CacheKey(tokens), slots) == 0
    if cache.is_chunk_cache:
        assert cache.match_prefix(CacheKey(prompts[0])).prefix_len == 0
        assert stack.evict_for(48) is None
        assert allocator.available_size() == 64
        return
    match = cache.match_prefix(CacheKey(prompts[0]))
    assert match.prefix_len == 16
    assert torch.equal(match.device_indices.sort().values, match.device_indices.unique())
    assert cache.evictable_size() == 32 and cache.protected_size() == 0
    assert allocator.available_size() == 32
    # 48 needed, 32 free: exactly the 16-token shortfall is evicted, never 48
    result = stack.evict_for(48)
    assert result.num_tokens == 16
    assert allocator.available_size() == 48 and cache.evictable_size() == 16
    # 30 needed, 48 free: nothing is evicted
    assert stack.evict_for(30) == EvictResult()
    assert cache.evictable_size() == 16
    # a locked prefix is protected, and eviction cannot reach it
    survivor = next(t for t in prompts[:2] if cache.match_prefix(CacheKey(t)).prefix_len == 16)
    handle = cache.match_prefix(CacheKey(survivor)).last_node
    cache.inc_lock_ref(handle)
    assert (cache.evictable_size(), cache.protected_size()) == (0, 16)
    assert stack.evict_for(64).num_tokens == 0
    cache.dec_lock_ref(handle)
    assert allocator.available_size() + cache.evictable_size() + cache.protected_size() == 64


def test_options_of_the_selected_cache_are_validated():
    config = _config("radix", "lru")
    config["prefix_cache"] = {"name": "radix", "options": {"granularity": "page"}}
    with pytest.raises(Exception) as info:
        kvplug.build(config)
    assert "prefix_cache" in str(info.value) and "granularity" in str(info.value)


@pytest.mark.parametrize("cache_name", ["radix", "block_hash"])
def test_bare_token_sequences_and_tensors_are_keys_in_the_default_namespace(cache_name):
    stack = kvplug.build(_config(cache_name, "lru"))
    cache, allocator = stack.prefix_cache, stack.allocator
    tokens = list(range(8))
    cache.insert(tokens, allocator.alloc(8))
    assert cache.match_prefix(torch.tensor(tokens)).prefix_len == 8
    assert cache.match_prefix(CacheKey(tokens)).prefix_len == 8
    assert cache.match_prefix(CacheKey(tokens, extra_key="lora-1")).prefix_len == 0
    with pytest.raises(TypeError, match="a cache key is a CacheKey or a sequence of token ids"):
        cache.match_prefix("abc")


@pytest.mark.parametrize("cache_name", ["radix", "block_hash", "swa_radix"])
def test_observer_plugins_receive_cache_events_through_build(cache_name):
    from kvplug import hookimpl
    from kvplug.registry import PluginRegistry

    events = []

    class Recorder:
        @hookimpl
        def kvplug_prefix_stored(self, event):
            events.append(("stored", event.num_tokens, len(event.block_hashes)))

        @hookimpl
        def kvplug_prefix_removed(self, event):
            events.append(("removed", event.num_tokens))

        @hookimpl
        def kvplug_cache_cleared(self, event):
            events.append(("cleared", event.num_tokens))

    registry = PluginRegistry().load_plugins(autoload=False)
    registry.register(Recorder(), name="recorder")
    stack = kvplug.build(_config(cache_name, "lru"), registry=registry)
    cache, allocator = stack.prefix_cache, stack.allocator
    cache.insert(list(range(16)), allocator.alloc(16))
    cache.insert(list(range(100, 132)), allocator.alloc(32))
    assert stack.evict_for(32).num_tokens == 16  # 16 free, 32 needed: evict 16
    cache.reset()
    hashes = 16 // cache.page_size  # one per page (page 4; swa_radix here: page 1)
    assert cache.page_size == (1 if cache_name == "swa_radix" else 4)
    assert events[:3] == [("stored", 16, hashes), ("stored", 32, 2 * hashes), ("removed", 16)]
    assert events[-1] == ("cleared", 32)


def test_no_observer_means_no_event_sink():
    stack = kvplug.build(_config("radix", "lru"))
    assert stack.prefix_cache.events is None
