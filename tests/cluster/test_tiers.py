"""With a host tier: demoted and loaded pages reach the wire with their medium, and the
metrics report per-tier hits and bytes from the hierarchy's own counters."""

from __future__ import annotations

import pytest

pytest.importorskip("msgspec")
pytest.importorskip("prometheus_client")

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

import kvplug
from kvplug.cluster.wire import EventBatcher
from kvplug_hookspecs import CacheKey


def tiered_stack(batcher, **extra):
    """A stack over a host tier; ``batcher`` (an observer plugin) records its wire events."""
    registry = kvplug.PluginRegistry().load_plugins()
    registry.register(batcher, name="batcher")
    return kvplug.build(
        {
            "pool": {"capacity_tokens": 32, "page_size": 4, "device": "cpu", "store_kv": False},
            "allocator": "paged",
            "storage": {
                "tiers": [{"name": "host", "options": {"capacity_tokens": 1024}}],
                "background": False,
            },
            "metrics": {"port": None},
            **extra,
        },
        registry=registry,
    )


def samples(metrics) -> dict:
    text = generate_latest(metrics.registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


@pytest.mark.parametrize("cache", ["radix", "block_hash"])
def test_demoted_and_loaded_pages_carry_their_medium(cache):
    batcher = EventBatcher(4)
    stack = tiered_stack(batcher, prefix_cache=cache)
    metrics = stack.observers[0]
    try:
        first, second = list(range(16)), list(range(100, 116))
        for key in (first, second):
            stack.prefix_cache.insert(CacheKey(key), stack.allocator.alloc(16))
        stack.evict_for(32)  # every page goes down to the host tier
        stack.end_step()
        match = stack.prefix_cache.match_prefix(CacheKey(first))
        assert (match.prefix_len, match.tier_tokens) == (16, (("host", 16),))
        stack.end_step()
        batcher.end_step()  # a plugin batcher: the test ends its step
        events = [e for b in batcher.take_batches() for e in b.events]
        by_medium = {}
        for e in events:
            by_medium.setdefault((type(e).__name__, e.medium), []).extend(e.block_hashes)
        gpu_stored = by_medium[("BlockStored", "GPU")]
        assert len(gpu_stored) == 12  # 8 pages inserted, then 4 loaded back onto the device
        assert sorted(by_medium[("BlockStored", "CPU")]) == sorted(gpu_stored[:8])
        assert sorted(by_medium[("BlockRemoved", "GPU")]) == sorted(gpu_stored[:8])
        assert sorted(gpu_stored[8:]) == sorted(gpu_stored[:4])  # the same hashes come back

        got = samples(metrics)
        stats = stack.storage.stats
        per_token = 2 * 1 * 1 * 64 * 2  # K and V, 1 layer, 1 head, 64 dims, float16
        tier = (("medium", "CPU"), ("tier", "host"))
        assert got[("kvplug:tier_prefix_cache_hits_total", tier)] == stats.hit_tokens["host"] == 16
        assert got[("kvplug:external_prefix_cache_hits_total", ())] == 16
        store = ("kvplug:kv_offload_store_bytes_total", (("transfer_type", "GPU_to_CPU"),))
        load = ("kvplug:kv_offload_load_bytes_total", (("transfer_type", "CPU_to_GPU"),))
        assert got[store] == stats.transfer_bytes["GPU_to_CPU"] == 32 * per_token
        assert got[load] == stats.transfer_bytes["CPU_to_GPU"] == 16 * per_token
        assert got[("kvplug:tier_tokens", tier)] == 32
        assert got[("kvplug:tier_bytes", tier)] == 32 * per_token
        assert got[("kvplug:kv_blocks_stored_total", (("medium", "CPU"),))] == 8
        assert got[("kvplug:tier_demoted_pages_total", ())] == stats.demoted_pages == 8
    finally:
        stack.close()
