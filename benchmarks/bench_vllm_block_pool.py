"""vLLM's BlockPool with its stock free queue vs a kvplug policy: cost per block.

    /path/to/vllm-venv/bin/python benchmarks/bench_vllm_block_pool.py [--quick]

Steady state of a full prefix cache: every round a request takes ``--request-blocks`` new
blocks (``get_new_blocks`` evicts that many free cached blocks), caches them as a chain
(``cache_full_blocks``), reuses a shared prefix of another chain (``touch``), and frees all of
them tail first (``free_blocks``), as vLLM's KVCacheManager does. Each phase is timed apart and
reported as nanoseconds per block (median of ``--repeat`` runs); ``ratio`` is kvplug's cost over
the stock queue's (above 1: kvplug is slower). Needs vLLM (``scripts/integration-env.sh vllm``).
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import time
from types import SimpleNamespace
from typing import Any

PHASES = ("get_new_blocks", "cache_full_blocks", "touch", "free_blocks")


def make_pool(num_blocks: int, policy: str | None, chains: bool = True) -> Any:
    from vllm.v1.core.block_pool import BlockPool

    pool = BlockPool(num_blocks, enable_caching=True, hash_block_size=16)
    if policy is not None:
        from kvplug import get_registry
        from kvplug.integrations.vllm.block_pool import install_policy

        registration = get_registry().get("eviction_policy", policy)
        policy_object = registration.factory(registration.options_model())
        install_policy(pool, policy_object, chain_group_ids=(0,) if chains else ())
    return pool


def chain_hashes(seed: int, length: int) -> list[bytes]:
    out, parent = [], b""
    for i in range(length):
        parent = hashlib.blake2b(parent + f"{seed}:{i}".encode(), digest_size=16).digest()
        out.append(parent)
    return out


def run(
    policy: str | None, num_blocks: int, request_blocks: int, rounds: int, chains: bool = True
) -> dict[str, float]:
    """Nanoseconds per block of each phase over ``rounds`` requests (after a warm-up fill)."""
    pool = make_pool(num_blocks, policy, chains)
    totals = dict.fromkeys(PHASES, 0)
    shared = chain_hashes(-1, request_blocks)
    counted = 0
    for r in range(rounds + num_blocks // request_blocks):  # the first rounds fill the cache
        timed = r >= num_blocks // request_blocks
        req = SimpleNamespace(
            block_hashes=shared if r % 4 == 0 else chain_hashes(r, request_blocks)
        )
        hits: list[Any] = []
        if r % 4 == 0:  # a quarter of the requests reuse the shared prefix (half its blocks)
            for block_hash in shared[: request_blocks // 2]:
                found = pool.get_cached_block(block_hash, [0])
                if found is None:
                    break
                hits.append(found[0])
        t0 = time.perf_counter_ns()
        pool.touch(hits)
        t1 = time.perf_counter_ns()
        blocks = pool.get_new_blocks(request_blocks - len(hits))
        t2 = time.perf_counter_ns()
        chain = hits + blocks
        pool.cache_full_blocks(req, chain, len(hits), request_blocks, 16, 0)
        t3 = time.perf_counter_ns()
        pool.free_blocks(reversed(chain))
        t4 = time.perf_counter_ns()
        if timed:
            totals["touch"] += t1 - t0
            totals["get_new_blocks"] += t2 - t1
            totals["cache_full_blocks"] += t3 - t2
            totals["free_blocks"] += t4 - t3
            counted += request_blocks
    assert pool.get_num_free_blocks() == num_blocks - 1
    return {phase: totals[phase] / counted for phase in PHASES}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=20_000)
    parser.add_argument("--request-blocks", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--policies", default="lru,lfu,slru")
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    args = parser.parse_args()
    if args.quick:
        args.blocks, args.rounds, args.repeat = 2_000, 200, 2
    import vllm

    print(
        f"vllm {vllm.__version__}: {args.blocks} blocks, {args.request_blocks} blocks per "
        f"request, {args.rounds} requests, median of {args.repeat}; ns per block"
    )
    # (policy, chain protection); the last row shows what keeping chain leaves costs
    names = args.policies.split(",")
    cases: list[tuple[str | None, bool]] = [(None, True), *((n, True) for n in names)]
    cases.append((names[0], False))
    medians: dict[tuple[str | None, bool], dict[str, float]] = {}
    for case in cases:
        runs = [
            run(case[0], args.blocks, args.request_blocks, args.rounds, case[1])
            for _ in range(args.repeat)
        ]
        medians[case] = {p: statistics.median(r[p] for r in runs) for p in PHASES}
    header = f"{'queue':<12}" + "".join(f"{p:>19}" for p in PHASES) + f"{'total':>10}{'ratio':>8}"
    print(header)
    stock = medians[(None, True)]
    stock_total = sum(stock.values())
    for case in cases:
        row = medians[case]
        total = sum(row.values())
        policy, chains = case
        name = "vllm stock" if policy is None else f"kvplug {policy}" + ("" if chains else "*")
        cells = "".join(
            f"{row[p]:>10.0f} ({row[p] / stock[p]:>4.1f}x)" if policy else f"{row[p]:>19.0f}"
            for p in PHASES
        )
        print(f"{name:<12}{cells}{total:>10.0f}{total / stock_total:>8.2f}")
    print("* without chain protection (every free cached block is a candidate)")


if __name__ == "__main__":
    main()
