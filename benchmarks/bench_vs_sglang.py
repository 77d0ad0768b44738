"""kvplug's ``radix`` cache vs SGLang 0.5.23's trees, side by side on one request sequence.

    PYTHONPATH=.:hookspecs /path/to/sglang-venv/bin/python benchmarks/bench_vs_sglang.py [--quick]

The workload (issue 10): 8 shared system prompts of 512 random tokens; each request is one
system prompt's first ``r ~ U[64, 512]`` tokens plus ``u ~ U[16, 256]`` fresh unique tokens; a
16,384-token pool; 3,000 seeded requests. Each request is served once, SGLang-style: match the
prefix, lock it, evict the allocator's shortfall, allocate the rest (whole pages), insert the
whole key with its slots, free the unaligned tail, unlock.

The caches serve the identical sequence (the printed digest covers it), each over its own
allocator on CPU:

* ``kvplug``: ``RadixCache`` over kvplug's ``standard``/``paged`` allocator, default options
  (every check on), ``evict_from_tree_cache`` for the shortfall, inserting with ``prev=match``
  (when the cache offers it) as SGLang inserts with its previous prefix; as installed, i.e. on
  the compiled kernels when pip could build them;
* ``kvplug-pure``: the same on the pure-Python kernels (``kvplug.speedups.use_native(False)``),
  what a machine without a C compiler runs;
* ``sglang-py``: SGLang's Python ``RadixCache`` over SGLang's ``TokenToKVPoolAllocator`` /
  ``PagedTokenToKVPoolAllocator``;
* ``sglang-rust``: SGLang's ``UnifiedRadixCache`` (full-attention component) on its Rust
  ``TreeCore``, the 0.5.23 default, inserting with ``prev_prefix_len`` as its scheduler does.

Repetitions interleave them (the order rotates), each on a fresh cache. Reported: the
median requests/s of each, the median and spread (min-max) of the per-repetition ratio
kvplug / other, and each cache's hit tokens (summed matched prefix lengths).

SGLang imports a few GPU-only modules at load time; they are stubbed (only those that are not
installed) by the SGLang test bootstrap, ``tests/integration/sglang/conftest.py``, the one copy
of that stub.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import inspect
import random
import statistics
import sys
import time
from array import array
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def install_stubs() -> None:
    """Stub SGLang's GPU-only imports: importing the SGLang test bootstrap does it."""
    import tests.integration.sglang.conftest  # noqa: F401


SYSTEM_PROMPTS = 8
SYSTEM_TOKENS = 512
POOL_TOKENS = 16_384
VOCAB = 32_000
clock = time.process_time  # CPU time: the machine may be shared; no cache here sleeps


def workload(num_requests: int, seed: int) -> list[list[int]]:
    """The request sequence: a system prompt's first r tokens plus u fresh unique tokens."""
    rng = random.Random(seed)
    systems = [[rng.randrange(VOCAB) for _ in range(SYSTEM_TOKENS)] for _ in range(SYSTEM_PROMPTS)]
    requests = []
    for _ in range(num_requests):
        prefix = systems[rng.randrange(SYSTEM_PROMPTS)][: rng.randint(64, SYSTEM_TOKENS)]
        requests.append(prefix + [rng.randrange(VOCAB) for _ in range(rng.randint(16, 256))])
    return requests


def digest(requests: list[list[int]]) -> str:
    h = hashlib.sha256()
    for r in requests:
        h.update(array("q", r).tobytes())
        h.update(b"|")
    return h.hexdigest()[:16]


def pages(n: int, page: int) -> int:
    return -(-n // page) * page


# -- servers: one function per cache, each serving the whole sequence ---------------------------


def serve_kvplug(requests: list[list[int]], page: int, policy: str) -> tuple[float, int]:
    from kvplug.allocators.paged import PagedAllocator
    from kvplug.allocators.standard import StandardAllocator
    from kvplug.caches.radix import RadixCache
    from kvplug.eviction import evict_from_tree_cache
    from kvplug.policies import LFUPolicy, LRUPolicy

    allocator: Any = (
        StandardAllocator(POOL_TOKENS, device="cpu")
        if page == 1
        else PagedAllocator(POOL_TOKENS, page_size=page, device="cpu")
    )
    cache = RadixCache(allocator, LRUPolicy if policy == "lru" else LFUPolicy)
    keys = [tuple(r) for r in requests]
    resume = "prev" in inspect.signature(cache.insert).parameters
    hit = 0
    cat = torch.cat
    start = clock()
    for tokens in keys:
        n = len(tokens)
        m = cache.match_prefix(tokens)
        cache.inc_lock_ref(m.last_node)
        need = pages(n, page) - m.prefix_len
        evict_from_tree_cache(cache, need)
        new = allocator.alloc(need)
        slots = cat((m.device_indices, new))
        if resume:  # continue from the match, as SGLang passes its previous prefix
            cache.insert(tokens, slots[:n], prev=m)
        else:
            cache.insert(tokens, slots[:n])
        aligned = n - n % page
        if aligned < n:
            allocator.free(slots[aligned:])
        cache.dec_lock_ref(m.last_node)
        hit += m.prefix_len
    return clock() - start, hit


def _sglang_allocator(page: int) -> Any:
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    kv = MHATokenToKVPool(POOL_TOKENS, page, torch.float16, 1, 1, 1, "cpu", False)
    if page == 1:
        return TokenToKVPoolAllocator(POOL_TOKENS, torch.float16, "cpu", kv, False)
    return PagedTokenToKVPoolAllocator(POOL_TOKENS, page, torch.float16, "cpu", kv, False)


def _sglang_params(allocator: Any, page: int, policy: str, **extra: Any) -> Any:
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams

    return CacheInitParams(
        disable=False,
        req_to_token_pool=None,
        token_to_kv_pool_allocator=allocator,
        page_size=page,
        eviction_policy=policy,
        **extra,
    )


def serve_sglang_py(requests: list[list[int]], page: int, policy: str) -> tuple[float, int]:
    from sglang.srt.mem_cache.base_prefix_cache import (
        EvictParams,
        InsertParams,
        MatchPrefixParams,
    )
    from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

    allocator = _sglang_allocator(page)
    cache = RadixCache(_sglang_params(allocator, page, policy))
    keys = [array("q", r) for r in requests]
    hit = 0
    cat = torch.cat
    start = clock()
    for tokens in keys:
        n = len(tokens)
        key = RadixKey(tokens)
        m = cache.match_prefix(MatchPrefixParams(key=key))
        node, prefix_len = m.last_device_node, m.device_prefix_len
        prefix = cache.path_device_indices(node)
        cache.inc_lock_ref(node)
        need = pages(n, page) - prefix_len
        available = allocator.available_size()
        if available < need:
            cache.evict(EvictParams(num_tokens=need - available))
        new = allocator.alloc(need)
        slots = cat((prefix, new))
        aligned = n - n % page
        result = cache.insert(InsertParams(key=key, value=slots[:n]))
        if result.prefix_len > prefix_len:  # already cached meanwhile: duplicates are ours
            allocator.free(slots[prefix_len : result.prefix_len])
        if aligned < n:
            allocator.free(slots[aligned:])
        cache.dec_lock_ref(node)
        hit += prefix_len
    return clock() - start, hit


def serve_sglang_rust(requests: list[list[int]], page: int, policy: str) -> tuple[float, int]:
    from sglang.srt.mem_cache.base_prefix_cache import (
        EvictParams,
        InsertParams,
        MatchPrefixParams,
    )
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    allocator = _sglang_allocator(page)
    params = _sglang_params(
        allocator, page, policy, tree_components=(ComponentType.FULL,), tree_core_backend="rust"
    )
    cache = UnifiedRadixCache(params)
    assert "Rust" in type(cache.tree_core).__name__, type(cache.tree_core).__name__
    keys = [array("q", r) for r in requests]
    hit = 0
    cat = torch.cat
    start = clock()
    for tokens in keys:
        n = len(tokens)
        key = RadixKey(tokens)
        m = cache.match_prefix(MatchPrefixParams(key=key))
        node, prefix_len = m.last_device_node, m.device_prefix_len
        prefix = cache.path_device_indices(node)
        receipt = cache.inc_lock_ref(node).to_dec_params()
        need = pages(n, page) - prefix_len
        available = allocator.available_size()
        if available < need:
            cache.evict(EvictParams(num_tokens=need - available))
        new = allocator.alloc(need)
        slots = cat((prefix, new))
        aligned = n - n % page
        result = cache.insert(
            InsertParams(key=key, value=slots[:aligned], prev_prefix_len=prefix_len)
        )
        if result.prefix_len > prefix_len:
            allocator.free(slots[prefix_len : result.prefix_len])
        if aligned < n:
            allocator.free(slots[aligned:])
        cache.dec_lock_ref(node, receipt)
        hit += prefix_len
    return clock() - start, hit


def serve_kvplug_pure(requests: list[list[int]], page: int, policy: str) -> tuple[float, int]:
    """``serve_kvplug`` on the pure-Python kernels (what a machine without a C compiler runs)."""
    from kvplug import speedups

    was = speedups.native_enabled()
    speedups.use_native(False)
    try:
        return serve_kvplug(requests, page, policy)
    finally:
        speedups.use_native(was)


SERVERS: dict[str, Callable[[list[list[int]], int, str], tuple[float, int]]] = {
    "kvplug": serve_kvplug,
    "kvplug-pure": serve_kvplug_pure,
    "sglang-py": serve_sglang_py,
    "sglang-rust": serve_sglang_rust,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--repeat", type=int, default=5, help="interleaved repetitions")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--pages", default="1,16", help="page sizes, comma-separated")
    parser.add_argument("--policies", default="lru,lfu")
    parser.add_argument("--only", default=",".join(SERVERS), help="caches to run")
    parser.add_argument("--quick", action="store_true", help="1,000 requests, 3 repetitions")
    args = parser.parse_args()
    if args.quick:
        args.requests, args.repeat = 1000, 3
    install_stubs()  # SGLang imports GPU-only modules at load time: stubbed on the CPU
    import logging

    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    names = [s for s in args.only.split(",") if s]
    requests = workload(args.requests, args.seed)
    for name in names:  # imports and first-call costs stay out of the timed runs
        SERVERS[name](requests[:200], 16, "lru")
    total = sum(len(r) for r in requests)
    print(
        f"{args.requests} requests ({total} tokens, digest {digest(requests)}), pool "
        f"{POOL_TOKENS}, torch {torch.__version__}, cpu, CPU seconds, gc off while timing, "
        f"{args.repeat} interleaved repetitions"
    )
    header = (
        f"{'page':>4} {'policy':<6} {'cache':<12} {'req/s':>8} {'hit tokens':>11} {'ratio':>22}"
    )
    print(header)
    print("-" * len(header))
    for page in (int(p) for p in args.pages.split(",")):
        for policy in args.policies.split(","):
            seconds: dict[str, list[float]] = {n: [] for n in names}
            hits: dict[str, int] = {}
            for rep in range(args.repeat):
                order = names[rep % len(names) :] + names[: rep % len(names)]
                for name in order:
                    gc.collect()
                    gc.disable()
                    try:
                        secs, hit = SERVERS[name](requests, page, policy)
                    finally:
                        gc.enable()
                    seconds[name].append(secs)
                    hits[name] = hit
            for name in names:
                rps = statistics.median(args.requests / s for s in seconds[name])
                ratio = ""
                if name != "kvplug" and "kvplug" in seconds:
                    ratios = [o / k for k, o in zip(seconds["kvplug"], seconds[name])]
                    ratio = (
                        f"x{statistics.median(ratios):.2f} [{min(ratios):.2f}-{max(ratios):.2f}]"
                    )
                print(f"{page:>4} {policy:<6} {name:<12} {rps:>8.0f} {hits[name]:>11} {ratio:>22}")
    print("ratio: kvplug req/s over that cache's, median [min-max] of the repetitions")


if __name__ == "__main__":
    main()
