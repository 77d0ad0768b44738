"""Quick start: build a kvplug stack from a config and serve shared-prefix requests on it.

Runs on the CPU in a second. It shows the engine-side calls (match, lock, evict exactly the
shortfall, alloc, write KV, insert, unlock) and prints what the cache kept and evicted::

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
    cache, allocator, page = stack.prefix_cache, stack.allocator, stack.allocator.page_size
    match = cache.match_prefix(CacheKey(tokens))
    cache.inc_lock_ref(match.last_node)
    need = len(tokens) - match.prefix_len
    padded = -(-need // page) * page  # allocators hand out whole pages
    freed = stack.evict_for(padded)  # exactly the shortfall, or nothing
    new = allocator.alloc(padded)
    if new is None:  # too little evictable: a real engine would preempt
        cache.dec_lock_ref(match.last_node)
        raise RuntimeError("out of KV memory")
    geometry = stack.config.pool
    kv = torch.randn(need, geometry.kv_heads, geometry.head_dim).to(stack.pool.dtype)
    full_layers = getattr(stack.pool, "full_layer_ids", range(geometry.num_layers))
    for layer in full_layers:  # window layers would write at translate_loc_from_full_to_swa(...)
        stack.pool.set_kv(layer, new[:need], kv, kv)
    slots = torch.cat([match.device_indices, new])
    cache.insert(CacheKey(tokens), slots[: len(tokens)])
    aligned = len(tokens) // page * page
    if aligned < len(slots):  # the partial last page stays ours: this request is done with it
        allocator.free(slots[aligned:])
    cache.dec_lock_ref(match.last_node)
    return match.prefix_len, freed.num_tokens if freed else 0


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


if __name__ == "__main__":
    main()
