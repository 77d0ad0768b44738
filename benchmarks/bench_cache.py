"""Prefix-cache cost under memory pressure: kvplug's radix cache vs a heap rebuilt per evict.

Two workloads run on a full cache holding N evictable leaves (N = 1k, 10k, 100k), so every
request must evict about its own size:

* ``shared``: many requests over a few long system prompts, each with a unique suffix;
* ``multiturn``: conversations whose every turn re-sends the whole history plus a new message.

Each request does what an engine does: ``match_prefix``, lock, ``evict_from_tree_cache``,
``alloc``, ``insert``, free the tail, unlock. Reported: median microseconds per request for
match / evict / insert (evict includes the allocator's ``shortfall`` and ``alloc``), and the
median over requests of evict nanoseconds per evicted token. The first 10% of requests warm up;
the garbage collector is off while timing unless ``--gc`` (with it on, the baseline's 100k-entry
list per evict also triggers full collections of the whole tree and looks far worse).

The baseline is the same tree with SGLang 0.5.9's eviction: an incrementally kept *set* of
evictable leaves, but a heap rebuilt from all of them on every ``evict`` call (O(N) per call).
kvplug keeps the heap itself incrementally (lazy invalidation), so a call costs O(k log N).

    python benchmarks/bench_cache.py            # N = 1k, 10k, 100k
    python benchmarks/bench_cache.py --quick    # smaller N and fewer requests
    python benchmarks/bench_cache.py --tiers    # a host tier configured but never hit, vs none

``--tiers`` serves the same requests to two caches in turn, one without storage tiers and one
with a host tier (write-back: every eviction demotes its pages, page digests are computed for
them, every match asks the tier about the page after the device match) that no request ever
hits (every suffix is new), and prints the median per-request time of each and their ratio.
The pool keeps no K/V here (bookkeeping pages): this is the cache path's cost, not the copy's
(``bench_tiers.py`` measures the copies). Timed is the engine's thread; the worker that stores
the demoted pages shares its GIL. ``--step-ms 0`` (the default) leaves it no idle time: it runs
while the engine schedules, a CPU-bound worst case. ``--step-ms 2`` models an engine step: after
each request the hierarchy's ``end_step`` hands that step's demotions to the worker
(``handoff="step"``, what kvplug's scheduler does before a forward pass) and the engine waits
2 ms, as for the device's forward pass, during which the worker stores them.

    python benchmarks/bench_cache.py --tiers --step-ms 2
"""

from __future__ import annotations

import argparse
import gc
import itertools
import random
import statistics
import time
from array import array
from collections.abc import Callable, Iterator
from typing import Any

import torch
from baseline import RebuildHeapLRU, random_tokens  # benchmarks/ is on sys.path

from kvplug.allocators.paged import PagedAllocator
from kvplug.allocators.standard import StandardAllocator
from kvplug.caches.radix import RadixCache
from kvplug.eviction import evict_from_tree_cache
from kvplug.plugins.policies import kvplug_eviction_policies
from kvplug_hookspecs import EvictParams, EvictResult

POLICIES = {r.name: r for r in kvplug_eviction_policies()}
SYSTEM_PROMPTS = 8
SYSTEM_TOKENS = 512
BACKGROUND = True  # the demotion worker (False: demote on the engine thread, to profile)
SUFFIX_TOKENS = 64  # a request's unique part and each prefilled leaf's size: N stays ~constant


class RebuildHeapRadixCache(RadixCache):
    """The same radix tree, evicting through a heap rebuilt from all evictable leaves per call."""

    def evict(self, params: EvictParams) -> EvictResult:
        self.policy.begin_evict()
        try:
            return super().evict(params)
        finally:
            self.policy.end_evict()


def new_allocator(capacity: int, page: int) -> Any:
    """The allocator of a ``page``-token page size (``standard`` at 1, ``paged`` above)."""
    if page == 1:
        return StandardAllocator(capacity, device="cpu", check_bounds=False)
    return PagedAllocator(capacity, page, device="cpu", check_bounds=False)


def build(
    kind: str,
    num_leaves: int,
    rng: random.Random,
    policy: str = "lru",
    page: int = 1,
    host_tier: bool = False,
    handoff: str = "immediate",
) -> tuple[RadixCache, Any]:
    """A cache filled to capacity with ``num_leaves`` evictable 64-token leaves under 8 prompts
    (``host_tier``: with a host tier below it, see ``host_tier_storage``)."""
    capacity = num_leaves * SUFFIX_TOKENS + SYSTEM_PROMPTS * SYSTEM_TOKENS
    # the engine's running requests hold no memory here: every slot is cached and evictable
    allocator = new_allocator(capacity, page)
    if kind == "kvplug":
        registration = POLICIES[policy]
        options = registration.options_model()
        storage = host_tier_storage(allocator, handoff) if host_tier else None
        cache = RadixCache(allocator, lambda: registration.factory(options), storage=storage)
    else:
        cache = RebuildHeapRadixCache(allocator, RebuildHeapLRU)
    systems = [random_tokens(rng, SYSTEM_TOKENS) for _ in range(SYSTEM_PROMPTS)]
    cache.insert(systems[0], allocator.alloc(SYSTEM_TOKENS))
    for i in range(1, SYSTEM_PROMPTS):
        cache.insert(systems[i], allocator.alloc(SYSTEM_TOKENS))
    for i in range(num_leaves):
        key = systems[i % SYSTEM_PROMPTS] + random_tokens(rng, SUFFIX_TOKENS)
        m = cache.match_prefix(key)
        cache.insert(key, torch.cat([m.device_indices, allocator.alloc(len(key) - m.prefix_len)]))
    allocator.alloc(allocator.available_size())  # the rare suffix collisions left a few slots
    cache.systems = systems  # type: ignore[attr-defined]
    return cache, allocator


def host_tier_storage(allocator: Any, handoff: str = "immediate") -> Callable[[str], Any]:
    """The cache's ``storage`` factory: a host tier ten times the device pool, LRU-ranked."""
    from kvplug.policies.builtin import LRUPolicy
    from kvplug.tiers import TierHierarchy
    from kvplug.tiers.host import HostTier, HostTierOptions
    from kvplug_hookspecs import StorageConfig, TierContext, TierNamespace

    namespace = TierNamespace(
        model_id="bench", num_layers=1, kv_heads=1, head_dim=64, dtype="float16",
        page_size=allocator.page_size, hash_function="kvplug-sha256",
    )  # fmt: skip
    context = TierContext(namespace, 1, 0, False, False, lambda _: LRUPolicy())

    def storage(hash_function: str) -> TierHierarchy:
        tier = HostTier(context, HostTierOptions(capacity_tokens=allocator.size * 10))
        config = StorageConfig(background=BACKGROUND, handoff=handoff)
        return TierHierarchy(
            [tier],
            config,
            namespace,
            pool=None,
            page_size=allocator.page_size,
            kv_bytes_per_token=256,
        )

    return storage


def serve(
    cache: RadixCache, allocator: StandardAllocator, key: list[int], times: dict[str, list[float]]
) -> int:
    """One request, engine style; returns tokens evicted."""
    clock = time.perf_counter_ns
    t0 = clock()
    m = cache.match_prefix(key)
    cache.inc_lock_ref(m.last_node)
    t1 = clock()
    need = len(key) - m.prefix_len
    result = evict_from_tree_cache(cache, need)
    new = allocator.alloc(need)
    t2 = clock()
    cache.insert(key, torch.cat([m.device_indices, new]))
    cache.dec_lock_ref(m.last_node)
    t3 = clock()
    times["match"].append(t1 - t0)
    times["evict"].append(t2 - t1)
    times["insert"].append(t3 - t2)
    return result.num_tokens if result else 0


def segment(rng: random.Random, n: int, fresh: Iterator[int] | None) -> list[int]:
    """``n`` random tokens; with ``fresh``, the first is a never-seen id (no prefix of the
    segment was ever cached, on the device or in a tier)."""
    tokens = random_tokens(rng, n)
    if fresh is not None:
        tokens[0] = next(fresh)
    return tokens


def shared_prefix_keys(
    cache: Any, rng: random.Random, n: int, fresh: Iterator[int] | None = None
) -> list[list[int]]:
    return [rng.choice(cache.systems) + segment(rng, SUFFIX_TOKENS, fresh) for _ in range(n)]


def multiturn_keys(
    cache: Any,
    rng: random.Random,
    n: int,
    fresh: Iterator[int] | None = None,
    conversations: int = 16,
) -> list[list[int]]:
    """Interleaved conversations: a turn = the previous turn + a 32-token answer + a 32-token
    message."""
    histories = [rng.choice(cache.systems) + segment(rng, 32, fresh) for _ in range(conversations)]
    keys = []
    for _ in range(n):
        c = rng.randrange(conversations)
        keys.append(histories[c])
        histories[c] = histories[c] + segment(rng, 64, fresh)
        if len(histories[c]) > SYSTEM_TOKENS + 1024:  # a new conversation
            histories[c] = rng.choice(cache.systems) + segment(rng, 32, fresh)
    return keys


def run(
    kind: str,
    workload: str,
    num_leaves: int,
    requests: int,
    *,
    keep_gc: bool = False,
    seed: int = 0,
    policy: str = "lru",
) -> dict[str, float]:
    rng = random.Random(seed)
    cache, allocator = build(kind, num_leaves, rng, policy)
    maker = shared_prefix_keys if workload == "shared" else multiturn_keys
    keys = maker(cache, rng, requests)
    warmup = {"match": [], "evict": [], "insert": []}
    for key in keys[: requests // 10]:
        serve(cache, allocator, key, warmup)
    gc.collect()
    if not keep_gc:
        gc.disable()  # as timeit does: measure the algorithm, not when the collector runs
    times: dict[str, list[float]] = {"match": [], "evict": [], "insert": []}
    evicted = []
    try:
        for key in keys[requests // 10 :]:
            evicted.append(serve(cache, allocator, key, times))
    finally:
        gc.enable()
    per_token = [t / e for t, e in zip(times["evict"], evicted) if e]
    leaves = len(cache.policy)  # evictable leaves at the end (nothing is locked between requests)
    return {
        "leaves": leaves,
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
    parser.add_argument(
        "--gc", action="store_true", help="keep the garbage collector on while timing"
    )
    parser.add_argument(
        "--policies",
        default=None,
        help="comma list: time only kvplug with these policies and compare their evict "
        "cost with lru's (e.g. lru,arc,s3fifo,lhd,gdsf)",
    )
    parser.add_argument(
        "--tiers",
        action="store_true",
        help="compare a cache with a never-hit host tier against one without tiers",
    )
    parser.add_argument(
        "--step-ms",
        type=float,
        default=0.0,
        help="--tiers: model an engine step of this many ms after each request (the worker "
        "gets the step's demotions at its end, handoff='step'); 0: no idle time",
    )
    parser.add_argument(
        "--page-sizes",
        default="1,16",
        help="comma list of page sizes for --tiers (1: SGLang's default, 16: vLLM's)",
    )
    args = parser.parse_args()
    sizes = (1_000, 10_000) if args.quick else (1_000, 10_000, 100_000)
    if args.tiers:
        pages = tuple(int(p) for p in args.page_sizes.split(","))
        compare_tiers(sizes, args.requests or 1000, args.gc, pages, args.step_ms)
        return
    if args.policies:
        compare_policies(args.policies.split(","), sizes, args.requests or 1000, args.gc)
        return
    requests = args.requests or (200 if args.quick else 1000)
    baseline_requests = max(50, requests // 5)  # the baseline is O(N) per request

    print(
        f"torch {torch.__version__}, LRU policy, {SUFFIX_TOKENS}-token leaves, page_size 1, cpu, "
        f"gc {'on' if args.gc else 'off'} while timing"
    )
    header = (
        f"{'workload':<10} {'impl':<9} {'N':>7} {'N end':>7} {'reqs':>5} {'match us':>9} "
        f"{'evict us':>9} {'insert us':>9} {'evict ns/tok':>12} {'evicted/req':>11} {'hit':>5}"
    )
    print(header)
    print("-" * len(header))
    per_token: dict[tuple[str, str, int], float] = {}
    for workload in ("shared", "multiturn"):
        for n in sizes:
            for kind, reqs in (("kvplug", requests), ("rebuild", baseline_requests)):
                r = run(kind, workload, n, reqs, keep_gc=args.gc)
                per_token[(workload, kind, n)] = r["evict_ns_per_token"]
                print(
                    f"{workload:<10} {kind:<9} {n:>7} {r['leaves']:>7} {reqs:>5} "
                    f"{r['match_us']:>9.1f} "
                    f"{r['evict_us']:>9.1f} "
                    f"{r['insert_us']:>9.1f} {r['evict_ns_per_token']:>12.0f} "
                    f"{r['evicted_per_request']:>11.1f} {r['hit_rate']:>5.2f}"
                )
    lo, hi = sizes[0], sizes[-1]
    print()
    for workload in ("shared", "multiturn"):
        growth = per_token[(workload, "kvplug", hi)] / per_token[(workload, "kvplug", lo)]
        base_growth = per_token[(workload, "rebuild", hi)] / per_token[(workload, "rebuild", lo)]
        speedup = per_token[(workload, "rebuild", hi)] / per_token[(workload, "kvplug", hi)]
        print(
            f"{workload}: evict ns/token N={hi} vs N={lo}: kvplug x{growth:.2f}, "
            f"rebuild x{base_growth:.1f}; "
            f"rebuild / kvplug at N={hi}: x{speedup:.1f}"
        )


def compare_policies(
    policies: list[str], sizes: tuple[int, ...], requests: int, gc_on: bool
) -> None:
    """Evict cost per request of each policy, and its ratio to LRU's (same keys, same N).

    Side by side: one cache per policy, and every request is served by all of them in turn
    (rotating which goes first), so a slower or faster spell of this machine hits them alike.
    The mean includes the rare costly steps (a learned policy's table rebuild or ranking switch)
    that the median leaves out.
    """
    names = ["lru", *(p for p in policies if p != "lru")]
    print(f"evict us per request, median and mean (ratio to lru), {requests} requests, gc {gc_on}")
    print(f"{'workload':<10} {'N':>7} {'':>6} " + " ".join(f"{p:>15}" for p in names))
    for workload in ("shared", "multiturn"):
        for n in sizes:
            stacks = [build("kvplug", n, random.Random(0), policy) for policy in names]
            maker = shared_prefix_keys if workload == "shared" else multiturn_keys
            keys = maker(stacks[0][0], random.Random(1), requests)  # same prompts in every cache
            times: list[dict[str, list[float]]] = [
                {"match": [], "evict": [], "insert": []} for _ in names
            ]
            warm = requests // 10
            gc.collect()
            if not gc_on:
                gc.disable()
            try:
                for i, key in enumerate(keys):
                    for j in range(len(names)):
                        k = (i + j) % len(names)
                        serve(*stacks[k], key, times[k])
            finally:
                gc.enable()
            evict = [t["evict"][warm:] for t in times]
            for label, stat in (("median", statistics.median), ("mean", statistics.fmean)):
                us = [stat(e) / 1e3 for e in evict]
                cells = [f"{u:7.1f} (x{u / us[0]:4.2f})" for u in us]
                print(f"{workload:<10} {n:>7} {label:>6} " + " ".join(cells), flush=True)
            del stacks


def compare_tiers(
    sizes: tuple[int, ...],
    requests: int,
    gc_on: bool,
    pages: tuple[int, ...],
    step_ms: float = 0.0,
) -> None:
    """Per-request time (match + evict + insert) without tiers and with a never-hit host tier,
    served side by side (rotating which goes first); medians and their ratio. ``step_ms``:
    see the module docstring."""
    handoff = "step" if step_ms else "immediate"
    print(
        f"us per request, median (ratio to no tiers), {requests} requests, gc {gc_on}, "
        f"step {step_ms} ms (handoff {handoff})"
    )
    print(
        f"{'workload':<10} {'page':>4} {'N':>7} {'no tiers':>9} {'host tier':>9} {'ratio':>6} "
        f"{'mean':>5} "
        f"{'demoted':>8} {'dropped':>8} {'+match/evict/insert':>14}"
    )
    for workload, page, n in itertools.product(("shared", "multiturn"), pages, sizes):
        plain = build("kvplug", n, random.Random(0), page=page)
        tiered, tiered_alloc = build(
            "kvplug", n, random.Random(0), page=page, host_tier=True, handoff=handoff
        )
        assert tiered.storage is not None
        stacks = [plain, (tiered, tiered_alloc)]
        maker = shared_prefix_keys if workload == "shared" else multiturn_keys
        # each request gets fresh int objects, as from a tokenizer: keys made of the objects
        # one cache's nodes hold compare by identity there (faster, ~8% in an A/A run)
        keys = [
            array("q", key)
            for key in maker(plain[0], random.Random(1), requests, itertools.count(40_000))
        ]
        times = [{"match": [], "evict": [], "insert": []} for _ in stacks]
        gc.collect()
        if not gc_on:
            gc.disable()
        try:
            for i, key in enumerate(keys):
                for j in range(2):
                    k = (i + j) % 2
                    serve(*stacks[k], key.tolist(), times[k])
                    if step_ms:
                        tiered.storage.end_step()  # a no-op after the plain cache's request
                        time.sleep(step_ms / 1e3)
        finally:
            gc.enable()
        tiered.storage.flush()
        warm = requests // 10
        per_request = [
            [sum(parts) / 1e3 for parts in zip(t["match"], t["evict"], t["insert"])][warm:]
            for t in times
        ]
        totals = [statistics.median(us) for us in per_request]
        # the mean sees what the median cannot: the worker's GIL slices, a few requests long
        means = [statistics.fmean(us) for us in per_request]
        assert not tiered.storage.stats.hit_tokens  # never hit, as intended
        medians = [{p: statistics.median(t[p][warm:]) / 1e3 for p in t} for t in times]
        added = "/".join(f"{medians[1][p] - medians[0][p]:+.0f}" for p in medians[0])
        print(
            f"{workload:<10} {page:>4} {n:>7} {totals[0]:>9.1f} {totals[1]:>9.1f} "
            f"{totals[1] / totals[0]:>6.2f} {means[1] / means[0]:>5.2f} "
            f"{tiered.storage.stats.demoted_pages:>8} "
            f"{tiered.storage.stats.dropped_pages:>8} {added:>14}",
            flush=True,
        )
        tiered.storage.close()


if __name__ == "__main__":
    main()
