"""vLLM's BlockPool with its stock free queue vs a kvplug policy: cost per block.

    /path/to/vllm-venv/bin/python benchmarks/bench_vllm_block_pool.py [--quick]

Steady state of a full prefix cache: every round a request takes ``--request-blocks`` new
blocks (``get_new_blocks`` evicts that many free cached blocks), caches them as a chain
(``cache_full_blocks``), reuses a shared prefix of another chain (``touch``), and frees all of
them tail first (``free_blocks``), as vLLM's KVCacheManager does. Each repeat runs every queue
(stock, then each policy) once, in turn; each phase is timed apart and reported as nanoseconds
per block (median over repeats), with kvplug's cost over the stock queue's in the same repeat
(median of those ratios; above 1: kvplug is slower). Needs vLLM
(``scripts/integration-env.sh vllm``).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import statistics
import time
from types import SimpleNamespace
from typing import Any

PHASES = ("get_new_blocks", "cache_full_blocks", "touch", "free_blocks")


def make_pool(num_blocks: int, policy: str | None, protection: bool | None = None) -> Any:
    from vllm.v1.core.block_pool import BlockPool

    pool = BlockPool(num_blocks, enable_caching=True, hash_block_size=16)
    if policy is not None:
        from kvplug import get_registry
        from kvplug.integrations.vllm.block_pool import install_policy

        registration = get_registry().get("eviction_policy", policy)
        policy_object = registration.factory(registration.options_model())
        install_policy(pool, policy_object, chain_group_ids=(0,), chain_protection=protection)
    return pool


def chain_hashes(seed: int, length: int) -> list[bytes]:
    out, parent = [], b""
    for i in range(length):
        parent = hashlib.blake2b(parent + f"{seed}:{i}".encode(), digest_size=16).digest()
        out.append(parent)
    return out


Case = tuple[str | None, bool | None]  # (policy, chain protection; None: its default)


def clock_overhead(clock: Any) -> int:
    """What one reading of ``clock`` adds to an interval (median of back-to-back pairs)."""
    pairs = []
    for _ in range(2_000):
        start = clock()
        pairs.append(clock() - start)
    return int(statistics.median(pairs))


def run(
    case: Case, num_blocks: int, request_blocks: int, rounds: int, clock: Any = time.thread_time_ns
) -> dict[str, float]:
    """Nanoseconds per block of each phase over ``rounds`` requests (after a warm-up fill).

    ``clock`` is this thread's CPU time by default: time the scheduler gives other processes
    on a shared machine is not counted. Its own reading cost is subtracted per interval.
    """
    gc.collect()  # no garbage left by the previous run is collected on this one's clock
    pool = make_pool(num_blocks, *case)
    totals = dict.fromkeys(PHASES, 0)
    shared = chain_hashes(-1, request_blocks)
    counted = 0
    overhead = clock_overhead(clock)
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
        t0 = clock()
        pool.touch(hits)
        t1 = clock()
        blocks = pool.get_new_blocks(request_blocks - len(hits))
        t2 = clock()
        chain = hits + blocks
        pool.cache_full_blocks(req, chain, len(hits), request_blocks, 16, 0)
        t3 = clock()
        pool.free_blocks(reversed(chain))
        t4 = clock()
        if timed:
            totals["touch"] += max(t1 - t0 - overhead, 0)
            totals["get_new_blocks"] += max(t2 - t1 - overhead, 0)
            totals["cache_full_blocks"] += max(t3 - t2 - overhead, 0)
            totals["free_blocks"] += max(t4 - t3 - overhead, 0)
            counted += request_blocks
    assert pool.get_num_free_blocks() == num_blocks - 1
    return {phase: totals[phase] / counted for phase in PHASES}


def case_name(case: Case) -> str:
    policy, protection = case
    if policy is None:
        return "vllm stock"
    return f"kvplug {policy}" + ("" if protection is None else "+" if protection else "-")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=20_000)
    parser.add_argument("--request-blocks", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--policies", default="lru,lfu,slru,s3fifo,arc")
    parser.add_argument(
        "--clock", choices=("cpu", "wall"), default="cpu", help="thread CPU time or wall time"
    )
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    args = parser.parse_args()
    if args.quick:
        args.blocks, args.rounds, args.repeat = 2_000, 200, 3
    import vllm

    print(
        f"vllm {vllm.__version__}: {args.blocks} blocks, {args.request_blocks} blocks per "
        f"request, {args.rounds} requests, {args.repeat} runs of every queue in turn; "
        f"{args.clock} ns per block "
        f"(median), ratio to stock (median of the per-run ratios)"
    )
    clock = time.thread_time_ns if args.clock == "cpu" else time.perf_counter_ns
    names = args.policies.split(",")
    cases: list[Case] = [(None, None), *((n, None) for n in names)]
    if "lru" in names:
        cases.append(("lru", True))  # what chain protection costs (and changes) under lru
    runs: dict[Case, list[dict[str, float]]] = {case: [] for case in cases}
    for _ in range(args.repeat):  # every queue once per repeat, in turn: drift hits all alike
        for case in cases:
            runs[case].append(run(case, args.blocks, args.request_blocks, args.rounds, clock))
    stock_runs = runs[(None, None)]
    print(f"{'queue':<14}" + "".join(f"{p:>19}" for p in PHASES) + f"{'total':>16}")
    for case in cases:
        cells = []
        for phase in (*PHASES, "total"):
            values = [sum(r.values()) if phase == "total" else r[phase] for r in runs[case]]
            stock = [sum(r.values()) if phase == "total" else r[phase] for r in stock_runs]
            median = statistics.median(values)
            ratio = statistics.median(v / s for v, s in zip(values, stock, strict=True))
            width = 16 if phase == "total" else 19
            cells.append(f"{median:>{width - 8}.0f} ({ratio:>4.2f}x)")
        print(f"{case_name(case):<14}" + "".join(cells))
    print("lru: vLLM's own list (no chain protection); lru+: with chain protection")


if __name__ == "__main__":
    main()
