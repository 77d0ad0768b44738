"""Quick start: build a kvplug stack from a config and serve shared-prefix requests on it.

Runs on the CPU in a second. Each request goes through ``kvplug.engine.serve_request``
(match, lock, evict exactly the shortfall, alloc, write KV, insert, unlock) and prints what
the cache kept and evicted::

    python examples/quickstart.py [CONFIG]      # default: a small radix + LRU stack on cpu
    python examples/quickstart.py examples/configs/paged_block_hash.toml
"""

from __future__ import annotations

import random
import sys
import warnings

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")  # torch without numpy

import torch

import kvplug
from kvplug import CacheKey
from kvplug.engine import serve_request

DEFAULT = {
    "allocator": "standard",
    "prefix_cache": "radix",
    "eviction_policy": "lru",
    "pool": {
        "capacity_tokens": 4096,
        "num_layers": 2,
        "kv_heads": 2,
        "head_dim": 16,
        "device": "cpu",
    },
}


def serve(stack: kvplug.KVCacheStack, tokens: list[int]) -> tuple[int, int]:
    """Prefill one request and cache it; returns (cached prefix length, tokens evicted)."""
    geometry = stack.config.pool

    def write_kv(new_slots: torch.Tensor, start: int) -> None:
        n = len(tokens) - start
        kv = torch.randn(n, geometry.kv_heads, geometry.head_dim).to(stack.pool.dtype)
        full_layers = getattr(stack.pool, "full_layer_ids", range(geometry.num_layers))
        for layer in full_layers:  # window layers write at translate_loc_from_full_to_swa(...)
            stack.pool.set_kv(layer, new_slots, kv, kv)

    result = serve_request(stack, CacheKey(tokens), write_kv)
    return result.prefix_len, result.evicted_tokens


def main() -> None:
    config = kvplug.load_config(sys.argv[1] if len(sys.argv) > 1 else DEFAULT)
    stack = kvplug.build(config)
    rng = random.Random(0)
    system_prompts = [[rng.randrange(32000) for _ in range(256)] for _ in range(3)]
    hits = evicted = 0
    for i in range(200):
        prompt = system_prompts[i % 3] + [
            rng.randrange(32000) for _ in range(rng.randrange(64, 512))
        ]
        cached, freed = serve(stack, prompt)
        hits += cached
        evicted += freed
    cache, allocator = stack.prefix_cache, stack.allocator
    print(
        f"stack: {config.allocator.name} / {config.prefix_cache.name} / "
        f"{config.eviction_policy.name}"
    )
    print(
        f"capacity {allocator.size} tokens, pool {stack.pool.mem_bytes() / 2**20:.1f} MiB "
        f"on {allocator.device}"
    )
    print(f"200 requests: {hits} prompt tokens served from cache, {evicted} tokens evicted")
    free = getattr(allocator, "full_available_size", allocator.available_size)()
    cached = cache.evictable_size() + cache.protected_size()
    print(f"free {free} + cached {cached} = {allocator.size}")
    for name, value in cache.stats.as_dict().items():
        print(f"  {name:28} {value:.3f}" if isinstance(value, float) else f"  {name:28} {value}")
    stack.close()  # stores what the storage tiers still have queued, stops their worker


if __name__ == "__main__":
    main()
