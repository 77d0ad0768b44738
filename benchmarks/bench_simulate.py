"""The simulator's speed on the real Mooncake conversation trace (issue 9's budget: < 30 s a run).

    python benchmarks/bench_simulate.py [--trace FILE] [--pages 512,16] [--policy lru]
                                        [--capacity 3M] [--limit N] [--quick] [--no-profile]

Replays the whole trace (12031 requests) through ``kvplug.sim.run_one`` — the real ``radix``
cache and ``paged`` allocator under the reference scheduler, on pools without K/V memory,
sequential timing — once per page size, and prints per run: requests/s, the cache's time per
request (match, lock, evict, alloc, insert, free, as the scheduler measures it), the hit rate,
wall and CPU seconds (CPU is the steadier number on a shared machine), whether the run fits the
budget, and a cProfile top 10 by own time (a second, profiled run). The trace is read from
``../shared/traces`` beside the clone (never copied into it); ``--trace`` points elsewhere.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
import warnings
from pathlib import Path

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")  # torch without numpy

import torch  # noqa: E402

from kvplug.sim import RunSpec, TraceSource, parse_capacity, run_one  # noqa: E402
from kvplug.sim.metrics import RunResult  # noqa: E402

_TRACE = Path("shared", "traces", "mooncake_conversation_trace.jsonl")
BUDGET_S = 30.0


def default_trace() -> Path:
    """The shared trace in ``../shared/traces`` beside the clone (or beside a parent folder,
    for a worktree nested deeper)."""
    here = Path(__file__).resolve()
    for folder in here.parents:
        if (folder / _TRACE).exists():
            return folder / _TRACE
    return here.parents[1].parent / _TRACE


def spec_for(trace: Path, page: int, policy: str, capacity: int, limit: int | None) -> RunSpec:
    source = TraceSource(kind="mooncake", path=str(trace), limit=limit)
    return RunSpec(
        source=source,
        policy=policy,
        capacity_tokens=capacity,
        page_size=page,
        timing="sequential",
    )


def timed(spec: RunSpec) -> tuple[RunResult, float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    result = run_one(spec)
    return result, time.perf_counter() - wall, time.process_time() - cpu


def profile_top(spec: RunSpec, top: int) -> str:
    profiler = cProfile.Profile()
    profiler.enable()
    run_one(spec)
    profiler.disable()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(top)
    lines = out.getvalue().splitlines()
    start = next((i for i, line in enumerate(lines) if "ncalls" in line), 0)
    return "\n".join(lines[start:]).rstrip()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", type=Path, default=None, help="Mooncake JSONL trace")
    parser.add_argument("--pages", default="512,16", help="page sizes, comma-separated")
    parser.add_argument("--policy", default="lru")
    parser.add_argument("--capacity", default="3M", help="tokens, K/M/G suffixes")
    parser.add_argument("--limit", type=int, default=None, help="first N requests only")
    parser.add_argument("--quick", action="store_true", help="the first 1000 requests")
    parser.add_argument("--no-profile", action="store_true", help="skip the cProfile runs")
    parser.add_argument("--top", type=int, default=10, help="cProfile rows")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: default)")
    args = parser.parse_args()

    # The simulator's tensors are small: extra intra-op threads only add synchronisation, and on
    # a shared machine they make a run several times slower.
    if args.threads:
        torch.set_num_threads(args.threads)
    trace = args.trace or default_trace()
    if not trace.exists():
        print(f"trace not found: {trace} (pass --trace FILE)", file=sys.stderr)
        return 2
    limit = 1000 if args.quick and args.limit is None else args.limit
    capacity = parse_capacity(args.capacity)
    pages = [int(p) for p in args.pages.split(",")]
    print(
        f"trace {trace.name} ({'all' if limit is None else limit} requests), policy "
        f"{args.policy}, capacity {capacity} tokens, sequential timing, torch threads "
        f"{torch.get_num_threads()}"
    )
    header = (
        f"{'page':>5} {'requests':>9} {'req/s':>8} {'cache us/req':>13} {'hit rate':>9} "
        f"{'wall s':>7} {'CPU s':>7}  budget (CPU)"
    )
    print(header)
    over = False
    for page in pages:
        result, wall, cpu = timed(spec_for(trace, page, args.policy, capacity, limit))
        fits = limit is not None or cpu < BUDGET_S
        over |= not fits
        print(
            f"{page:>5} {result.completed:>9} {result.completed / wall:>8.0f} "
            f"{result.cache_us_per_request:>13.0f} {result.hit_rate:>9.4f} {wall:>7.1f} "
            f"{cpu:>7.1f}  {'ok' if fits else f'OVER {BUDGET_S:.0f} s'}"
        )
    if not args.no_profile:
        for page in pages:
            print(f"\ncProfile, page {page}, top {args.top} by own time:")
            print(profile_top(spec_for(trace, page, args.policy, capacity, limit), args.top))
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
