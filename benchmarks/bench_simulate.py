"""Simulator speed on the real Mooncake conversation trace (issue budget: < 30 s per run).

Replays ``../shared/traces/mooncake_conversation_trace.jsonl`` (beside the clone; never copied
in) through the default radix cache with ``lru`` at 3M tokens, sequential timing, page size 512
and 16, and prints requests/s, cache microseconds per request and a cProfile top 10::

    .venv/bin/python benchmarks/bench_simulate.py [--limit N] [--page-size 512,16] [--no-profile]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
from pathlib import Path

import torch

from kvplug.sim import RunSpec, TraceSource, run_one

TRACE = Path("shared", "traces", "mooncake_conversation_trace.jsonl")


def find_trace() -> Path:
    for folder in Path(__file__).resolve().parents:
        if (folder / TRACE).exists():
            return folder / TRACE
    raise SystemExit(f"{TRACE} not found beside the clone")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--page-size", default="512,16")
    parser.add_argument("--capacity", type=int, default=3_000_000)
    parser.add_argument("--policy", default="lru")
    parser.add_argument("--no-profile", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    source = TraceSource(kind="mooncake", path=str(find_trace()), limit=args.limit)
    print(
        f"torch {torch.__version__}, 1 thread, {args.policy}, {args.capacity:,} tokens, sequential"
    )
    header = ("page", "requests", "wall s", "req/s", "cache us/req", "hit rate")
    print(" ".join(f"{h:>{w}}" for h, w in zip(header, (5, 9, 8, 8, 13, 9))))
    profiles = []
    for page in (int(p) for p in args.page_size.split(",")):
        spec = RunSpec(
            source=source, policy=args.policy, capacity_tokens=args.capacity, page_size=page
        )
        started = time.perf_counter()
        result = run_one(spec)
        wall = time.perf_counter() - started
        print(
            f"{page:>5} {result.requests:>9} {wall:>8.1f} {result.requests / wall:>8.0f} "
            f"{result.cache_us_per_request:>13.0f} {result.hit_rate:>9.2%}"
        )
        if not args.no_profile:
            profiler = cProfile.Profile()
            profiler.runcall(run_one, spec)
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(10)
            profiles.append((page, text.getvalue()))
    for page, text in profiles:
        print(f"\ncProfile, page {page}, top 10 by own time:")
        print("\n".join(line for line in text.splitlines() if line.strip())[:4000])


if __name__ == "__main__":
    main()
