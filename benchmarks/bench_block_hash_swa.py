"""Cost of the ``block_hash`` and ``swa_radix`` caches under memory pressure, vs a rebuild baseline.

The workload is ``bench_cache.py``'s shared-prefix one: a few long system prompts, each request
one of them plus a unique 64-token suffix, on a cache filled to capacity with N evictable leaves
(N = 1k, 10k, 100k), so every request evicts about its own size. Each request does what an
engine does: ``match_prefix``, lock, ``evict_from_tree_cache``, ``alloc``, ``insert``, unlock.

* ``block_hash``: blocks of 16 tokens (a request's suffix is a chain of 4 blocks, its tail block
  is the only candidate; evicting it makes the parent a candidate).
* ``swa_radix``: window pool half the full pool, window 128: requests need both full and window
  tokens, so evictions free leaves (both pools) and tombstone nodes (window only).

The baseline is the same cache with SGLang 0.5.9's eviction: an incrementally kept set of
evictable candidates, but a heap rebuilt from all of them on every ``evict`` call (O(N) per
call); kvplug's policies keep the heap itself incrementally (O(k log N) per call).
Reported: median microseconds per request for match / evict (incl. ``shortfall`` and ``alloc``)
/ insert, and the median over requests of evict nanoseconds per evicted token (full + window).

    python benchmarks/bench_block_hash_swa.py            # N = 1k, 10k, 100k
    python benchmarks/bench_block_hash_swa.py --quick    # N = 1k, 10k, fewer requests
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
from typing import Any

import torch
from baseline import RebuildHeapLRU, random_tokens  # benchmarks/ is on sys.path

from kvplug.allocators.standard import StandardAllocator
from kvplug.allocators.swa import SWAAllocator
from kvplug.caches.block_hash import BlockHashCache
from kvplug.caches.swa_radix import SWARadixCache
from kvplug.eviction import evict_from_tree_cache
from kvplug.policies import LRUPolicy
from kvplug_hookspecs import EvictParams, EvictResult

SYSTEM_PROMPTS, SYSTEM_TOKENS, SUFFIX_TOKENS = 8, 512, 64
BLOCK = 16
WINDOW = 128


class RebuildBlockHash(BlockHashCache):
    filling = False  # while the benchmark fills the cache, keep one heap (its order is moot)

    def evict(self, params: EvictParams) -> EvictResult:
        if self.filling:
            return super().evict(params)
        self.policy.begin_evict()
        try:
            return super().evict(params)
        finally:
            self.policy.end_evict()


class RebuildSWARadix(SWARadixCache):
    filling = False

    def evict(self, params: EvictParams) -> EvictResult:
        if self.filling:
            return super().evict(params)
        self.full_policy.begin_evict()
        self.swa_policy.begin_evict()
        try:
            return super().evict(params)
        finally:
            self.full_policy.end_evict()
            self.swa_policy.end_evict()


def build(cache_name: str, kind: str, num_leaves: int, rng: random.Random):
    """A cache filled to capacity with ``num_leaves`` 64-token suffixes under 8 system prompts."""
    capacity = num_leaves * SUFFIX_TOKENS + SYSTEM_PROMPTS * SYSTEM_TOKENS
    policy = LRUPolicy if kind == "kvplug" else RebuildHeapLRU
    if cache_name == "block_hash":
        allocator = StandardAllocator(capacity, device="cpu", check_bounds=False)
        cls = BlockHashCache if kind == "kvplug" else RebuildBlockHash
        cache = cls(allocator, policy, page_size=BLOCK)
    else:
        allocator = SWAAllocator(capacity, capacity // 2, WINDOW, device="cpu", check_bounds=False)
        cache = (SWARadixCache if kind == "kvplug" else RebuildSWARadix)(allocator, policy)
    if cache_name == "block_hash":
        policies = [cache.policy]
    else:
        policies = [cache.full_policy, cache.swa_policy]
    if kind != "kvplug":  # filling must not cost O(N) per eviction: one heap kept throughout
        cache.filling = True
        for p in policies:
            p.begin_evict()
    systems = [random_tokens(rng, SYSTEM_TOKENS) for _ in range(SYSTEM_PROMPTS)]
    for system in systems:
        cache.insert(system, allocator.alloc(SYSTEM_TOKENS))
    for i in range(num_leaves):
        key = systems[i % SYSTEM_PROMPTS] + random_tokens(rng, SUFFIX_TOKENS)
        m = cache.match_prefix(key)
        cache.inc_lock_ref(m.last_node)
        evict_from_tree_cache(cache, len(key) - m.prefix_len)  # swa: the window pool runs short
        cache.insert(key, torch.cat([m.device_indices, allocator.alloc(len(key) - m.prefix_len)]))
        cache.dec_lock_ref(m.last_node)
    if kind != "kvplug":
        cache.filling = False
        for p in policies:
            p.end_evict()
    cache.systems = systems  # type: ignore[attr-defined]
    return cache, allocator


def serve(cache: Any, allocator: Any, key: list[int], times: dict[str, list[int]]) -> int:
    """One request, engine style; returns the tokens evicted (full + window)."""
    clock = time.perf_counter_ns
    t0 = clock()
    m = cache.match_prefix(key)
    cache.inc_lock_ref(m.last_node)
    t1 = clock()
    need = len(key) - m.prefix_len
    result = evict_from_tree_cache(cache, need)
    new = allocator.alloc(need)
    t2 = clock()
    assert new is not None, "the benchmark's cache could not make room"
    cache.insert(key, torch.cat([m.device_indices, new]))
    cache.dec_lock_ref(m.last_node)
    t3 = clock()
    times["match"].append(t1 - t0)
    times["evict"].append(t2 - t1)
    times["insert"].append(t3 - t2)
    return result.num_tokens + result.swa_num_tokens


def run(cache_name: str, kind: str, num_leaves: int, requests: int, seed: int = 0) -> dict:
    rng = random.Random(seed)
    cache, allocator = build(cache_name, kind, num_leaves, rng)
    keys = [rng.choice(cache.systems) + random_tokens(rng, SUFFIX_TOKENS) for _ in range(requests)]
    scratch: dict[str, list[int]] = {"match": [], "evict": [], "insert": []}
    for key in keys[: requests // 10]:
        serve(cache, allocator, key, scratch)
    gc.collect()
    times: dict[str, list[int]] = {"match": [], "evict": [], "insert": []}
    evicted = [serve(cache, allocator, key, times) for key in keys[requests // 10 :]]
    per_token = [t / e for t, e in zip(times["evict"], evicted) if e]
    policy = cache.policy if cache_name == "block_hash" else cache.full_policy
    return {
        "candidates": len(policy),
        "match_us": statistics.median(times["match"]) / 1e3,
        "evict_us": statistics.median(times["evict"]) / 1e3,
        "insert_us": statistics.median(times["insert"]) / 1e3,
        "evict_ns_per_token": statistics.median(per_token),
        "evicted_per_request": sum(evicted) / len(evicted),
        "hit_rate": cache.stats.hit_rate,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="N = 1k, 10k and fewer requests")
    parser.add_argument("--requests", type=int, default=None, help="requests per run (kvplug)")
    parser.add_argument("--cache", choices=("block_hash", "swa_radix"), action="append")
    args = parser.parse_args()
    caches = tuple(args.cache or ("block_hash", "swa_radix"))
    sizes = (1_000, 10_000) if args.quick else (1_000, 10_000, 100_000)
    requests = args.requests or (200 if args.quick else 1000)
    baseline_requests = max(50, requests // 5)

    print(
        f"torch {torch.__version__}, LRU, shared-prefix workload, cpu; block_hash blocks of "
        f"{BLOCK}, swa_radix window {WINDOW} with a window pool of half the full pool"
    )
    header = (
        f"{'cache':<10} {'impl':<8} {'N':>7} {'cands':>7} {'reqs':>5} {'match us':>9} "
        f"{'evict us':>9} {'insert us':>9} {'evict ns/tok':>12} {'evicted/req':>11} {'hit':>5}"
    )
    print(header)
    print("-" * len(header))
    per_token: dict[tuple[str, str, int], float] = {}
    for cache_name in caches:
        for n in sizes:
            for kind, reqs in (("kvplug", requests), ("rebuild", baseline_requests)):
                r = run(cache_name, kind, n, reqs)
                per_token[(cache_name, kind, n)] = r["evict_ns_per_token"]
                print(
                    f"{cache_name:<10} {kind:<8} {n:>7} {r['candidates']:>7} {reqs:>5} "
                    f"{r['match_us']:>9.1f} {r['evict_us']:>9.1f} {r['insert_us']:>9.1f} "
                    f"{r['evict_ns_per_token']:>12.0f} "
                    f"{r['evicted_per_request']:>11.1f} {r['hit_rate']:>5.2f}"
                )
    lo, hi = sizes[0], sizes[-1]
    print()
    for cache_name in caches:
        growth = per_token[(cache_name, "kvplug", hi)] / per_token[(cache_name, "kvplug", lo)]
        base = per_token[(cache_name, "rebuild", hi)] / per_token[(cache_name, "rebuild", lo)]
        speedup = per_token[(cache_name, "rebuild", hi)] / per_token[(cache_name, "kvplug", hi)]
        print(
            f"{cache_name}: evict ns/token N={hi} vs N={lo}: kvplug x{growth:.2f}, "
            f"rebuild x{base:.1f}; "
            f"rebuild / kvplug at N={hi}: x{speedup:.1f}"
        )


if __name__ == "__main__":
    main()
