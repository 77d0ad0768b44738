"""The simulator's speed on the real Mooncake conversation trace, side by side with a baseline.

    python benchmarks/bench_simulate.py [--trace FILE] [--pages 512] [--policy lru]
                                        [--capacity 3M] [--limit N] [--quick] [--rounds 3]
                                        [--baseline REF | --no-baseline] [--profile]

Replays the trace (12,031 requests) through ``kvplug.sim.run_one`` (the real ``radix`` cache
and ``paged`` allocator under the reference scheduler, pools without K/V memory, sequential
timing) with this tree's code and with the code of git ``--baseline`` REF (default: the commit
before the simulator's speed work, issue 23). The baseline is checked out in a temporary git
worktree (its C extension copied when its source is unchanged, else built there); each run is
a fresh process, baseline and current alternating, ``--rounds`` times, so a busy machine slows
both alike. Per side it prints the medians of the cache's time per request (match, lock, evict,
alloc, insert, free, as the scheduler measures it), wall and CPU ms per request; then the
ratios, and whether every figure of the result (hit rate, evictions, preemptions, ...) is
identical on both sides (the exit status is 1 when not). ``--profile`` adds a cProfile top of
the current code. The trace is read from ``../shared/traces`` beside the clone (never copied
into it); ``--trace`` points elsewhere.
"""

from __future__ import annotations

import argparse
import cProfile
import filecmp
import io
import json
import os
import pstats
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")  # torch without numpy

_TRACE = Path("shared", "traces", "mooncake_conversation_trace.jsonl")
_ROOT = Path(__file__).resolve().parents[1]
BEFORE_SPEEDUP = "611b6f0"  # the last commit before issue 23's simulator speed work
_TIMES = ("wall_seconds", "cache_us_per_request")


def default_trace() -> Path:
    """The shared trace in ``../shared/traces`` beside the clone (or beside a parent folder,
    for a worktree nested deeper)."""
    for folder in _ROOT.parents:
        if (folder / _TRACE).exists():
            return folder / _TRACE
    return _ROOT.parent / _TRACE


def worker(args: argparse.Namespace) -> int:
    """One run in this process with whichever kvplug is first on ``sys.path``; prints JSON."""
    import torch

    torch.set_num_threads(1)  # small tensors: intra-op threads only add contention
    from kvplug.sim import RunSpec, TraceSource, parse_capacity, run_one

    source = TraceSource(kind="mooncake", path=str(args.trace), limit=args.limit)
    spec = RunSpec(
        source=source,
        policy=args.policy,
        capacity_tokens=parse_capacity(args.capacity),
        page_size=args.page,
        timing="sequential",
    )
    if args.profile:
        profiler = cProfile.Profile()
        profiler.enable()
        run_one(spec)
        profiler.disable()
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(args.top)
        lines = out.getvalue().splitlines()
        start = next((i for i, line in enumerate(lines) if "ncalls" in line), 0)
        print("\n".join(lines[start:]).rstrip())
        return 0
    cpu = time.process_time()
    result = run_one(spec).as_dict()
    result["cpu_seconds"] = time.process_time() - cpu
    print(json.dumps(result))
    return 0


def baseline_tree(ref: str, folder: Path) -> Path:
    """A detached worktree of ``ref`` in ``folder``, with its C extension in place."""
    tree = folder / "baseline"
    subprocess.run(
        ["git", "-C", str(_ROOT), "worktree", "add", "--detach", "--force", str(tree), ref],
        check=True,
        capture_output=True,
    )
    source = tree / "kvplug" / "_speedups.c"
    built = sorted((_ROOT / "kvplug").glob("_speedups*.so"))
    if built and source.exists() and filecmp.cmp(source, _ROOT / "kvplug" / "_speedups.c"):
        shutil.copy2(built[0], tree / "kvplug" / built[0].name)
    elif source.exists():
        subprocess.run(
            [sys.executable, "setup.py", "-q", "build_ext", "--inplace"],
            cwd=tree,
            check=True,
            capture_output=True,
        )
    return tree


def run_side(tree: Path, args: argparse.Namespace, page: int) -> dict:
    """One run in a fresh process importing kvplug (and its hookspecs) from ``tree``."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree), str(tree / "hookspecs")]))
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", "--page", str(page)]
    command += ["--trace", str(args.trace), "--policy", args.policy, "--capacity", args.capacity]
    if args.limit is not None:
        command += ["--limit", str(args.limit)]
    done = subprocess.run(command, env=env, cwd=tree, check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def per_request(runs: list[dict]) -> tuple[float, float, float]:
    """Medians: cache us/request, wall ms/request, CPU ms/request."""
    n = runs[0]["completed"]
    return (
        statistics.median(r["cache_us_per_request"] for r in runs),
        statistics.median(r["wall_seconds"] for r in runs) / n * 1e3,
        statistics.median(r["cpu_seconds"] for r in runs) / n * 1e3,
    )


def figures(run: dict) -> dict:
    return {k: v for k, v in run.items() if k not in (*_TIMES, "cpu_seconds")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", type=Path, default=None, help="Mooncake JSONL trace")
    parser.add_argument("--pages", default="512", help="page sizes, comma-separated")
    parser.add_argument("--policy", default="lru")
    parser.add_argument("--capacity", default="3M", help="tokens, K/M/G suffixes")
    parser.add_argument("--limit", type=int, default=None, help="first N requests only")
    parser.add_argument("--quick", action="store_true", help="the first 1000 requests")
    parser.add_argument("--rounds", type=int, default=3, help="runs per side (medians)")
    parser.add_argument("--baseline", default=BEFORE_SPEEDUP, help="git ref to compare with")
    parser.add_argument("--no-baseline", action="store_true", help="current code only")
    parser.add_argument("--profile", action="store_true", help="a cProfile top of the current")
    parser.add_argument("--top", type=int, default=25, help="cProfile rows")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--page", type=int, default=512, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.trace = args.trace or default_trace()
    if not args.trace.exists():
        print(f"trace not found: {args.trace} (pass --trace FILE)", file=sys.stderr)
        return 2
    if args.quick and args.limit is None:
        args.limit = 1000
    if args.worker:
        return worker(args)

    pages = [int(p) for p in args.pages.split(",")]
    print(
        f"trace {args.trace.name} ({'all' if args.limit is None else args.limit} requests), "
        f"policy {args.policy}, capacity {args.capacity}, sequential timing, {args.rounds} "
        f"round(s) per side, baseline {'none' if args.no_baseline else args.baseline}"
    )
    same = True
    with tempfile.TemporaryDirectory(prefix="kvplug-bench-") as folder:
        base = None if args.no_baseline else baseline_tree(args.baseline, Path(folder))
        try:
            for page in pages:
                current: list[dict] = []
                before: list[dict] = []
                for _ in range(args.rounds):
                    if base is not None:
                        before.append(run_side(base, args, page))
                    current.append(run_side(_ROOT, args, page))
                print(f"\npage {page}: {current[0]['completed']} requests, hit rate "
                      f"{current[0]['hit_rate']:.4f}")  # fmt: skip
                print(f"{'':10} {'cache us/req':>13} {'wall ms/req':>12} {'CPU ms/req':>11}")
                rows = [("current", per_request(current))]
                if before:
                    rows.insert(0, ("baseline", per_request(before)))
                for name, (cache, wall, cpu) in rows:
                    print(f"{name:10} {cache:>13.0f} {wall:>12.3f} {cpu:>11.3f}")
                if before:
                    (b_cache, b_wall, b_cpu), (c_cache, c_wall, c_cpu) = rows[0][1], rows[1][1]
                    print(f"{'ratio':10} {b_cache / c_cache:>12.2f}x {b_wall / c_wall:>11.2f}x "
                          f"{b_cpu / c_cpu:>10.2f}x")  # fmt: skip
                    identical = all(figures(r) == figures(before[0]) for r in before + current)
                    same &= identical
                    print(f"every figure identical on both sides: {'yes' if identical else 'NO'}")
        finally:
            if base is not None:
                subprocess.run(
                    ["git", "-C", str(_ROOT), "worktree", "remove", "--force", str(base)],
                    capture_output=True,
                )
    if args.profile:
        for page in pages:
            print(f"\ncProfile of the current code, page {page}, top {args.top} by own time:")
            command = [sys.executable, str(Path(__file__).resolve()), "--worker", "--profile"]
            command += ["--page", str(page), "--trace", str(args.trace), "--top", str(args.top)]
            command += ["--policy", args.policy, "--capacity", args.capacity]
            if args.limit is not None:
                command += ["--limit", str(args.limit)]
            subprocess.run(command, cwd=_ROOT, check=True)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
