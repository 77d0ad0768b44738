"""A long seeded random run over a publishing stack, and the blocks its cache really holds.

Shared by the main suite's publisher tests and the engine integration tests (which decode the
same stream with vLLM's or SGLang's own classes).
"""

from __future__ import annotations

import random
from typing import Any

from kvplug.caches.block_hashing import event_hash
from kvplug_hookspecs import CacheKey, EvictParams
from tests.hash_rule import chain, ev, seed

CACHES = ("radix", "block_hash", "swa_radix")


def publishing_config(cache: str, page_size: int = 4, **kv_events: Any) -> dict[str, Any]:
    """A small CPU stack of ``cache`` publishing on loopback ports picked by ZMQ."""
    config: dict[str, Any] = {
        "pool": {"capacity_tokens": 256, "page_size": page_size, "device": "cpu"},
        "allocator": "paged" if page_size > 1 else "standard",
        "prefix_cache": cache,
        "kv_events": {
            "publisher": "zmq",
            "endpoint": "tcp://127.0.0.1:*",
            "replay_endpoint": "tcp://127.0.0.1:*",
            "topic": "kv@pod-0@tiny-model",
            **kv_events,
        },
    }
    if cache == "swa_radix":
        config["allocator"] = {
            "name": "swa",
            "options": {"swa_capacity_tokens": 128, "sliding_window_size": 8},
        }
    return config


def random_run(stack: Any, steps: int, rng: random.Random) -> dict[str, int]:
    """Stores (with shared prefixes and namespaces), probes, locks, shortfall evictions,
    window (SWA) drops and clears; ``stack.end_step()`` after every operation."""
    cache, allocator = stack.prefix_cache, stack.allocator
    p = stack.config.pool.page_size
    swa = hasattr(allocator, "swa_available_size")
    locked: list[Any] = []
    counts = dict.fromkeys(("insert", "evict", "swa_drop", "clear", "lock"), 0)
    for _ in range(steps):
        op = rng.random()
        ns = rng.choice((None, None, "lora-a"))
        key = [rng.randrange(4) for _ in range(p * rng.randrange(1, 6))]
        if op < 0.5:
            short = allocator.shortfall(len(key))
            if short is not None:
                cache.evict(short)
            if allocator.shortfall(len(key)) is None:
                cache.match_prefix(CacheKey(key, ns))
                cache.insert(CacheKey(key, ns), allocator.alloc(len(key)))
                counts["insert"] += 1
        elif op < 0.62:
            cache.match_prefix(CacheKey(key, ns))
        elif op < 0.74:
            node = cache.match_prefix(CacheKey(key, ns)).last_node
            cache.inc_lock_ref(node)
            locked.append(node)
            counts["lock"] += 1
        elif op < 0.84 and locked:
            cache.dec_lock_ref(locked.pop(rng.randrange(len(locked))))
        elif op < 0.9 and swa:
            cache.evict(EvictParams(swa_num_tokens=p * rng.randrange(1, 4)))
            counts["swa_drop"] += 1
        elif op < 0.98:
            stack.evict_for(allocator.available_size() + p * rng.randrange(1, 6))
            counts["evict"] += 1
        else:
            while locked:
                cache.dec_lock_ref(locked.pop())
            cache.reset()
            counts["clear"] += 1
        stack.end_step()
    while locked:
        cache.dec_lock_ref(locked.pop())
    stack.end_step()
    return counts


def cached_block_hashes(cache: Any) -> set[int]:
    """The 64-bit hashes of every page the cache holds, from its own structures: radix trees
    by the documented hash rule over each node's path, ``block_hash`` from its blocks."""
    if hasattr(cache, "_blocks"):
        return {event_hash(digest) for digest in cache._blocks}
    p = cache.page_size
    hashes: set[int] = set()
    for node in cache._nodes():
        path, up = [], node
        while up is not cache.root:
            path[:0] = up.key
            up = up.parent
        digests = chain(path, p, parent=seed(node.namespace))
        hashes.update(ev(digests[len(digests) - node.num_tokens // p :]))
    return hashes
