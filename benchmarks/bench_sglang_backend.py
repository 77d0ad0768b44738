"""SGLang's scheduler-side cache calls per second: its default tree vs the kvplug backend.

    /path/to/sglang-venv/bin/python benchmarks/bench_sglang_backend.py [--quick]

Both caches serve the same request sequence through SGLang's own scheduler steps (the harness
of ``tests/integration/sglang/conftest.py``: ``PrefillAdder``, ``ScheduleBatch``,
``checkpoint_kv_cache``, ``release_kv_cache``, SGLang's allocators): requests share a few long
system prompts, the pool is small enough that admissions evict. Only the time spent inside the
cache's own methods is counted (``match_prefix``, ``touch_prefix``, ``checkpoint``,
``evict``/``evict_for_alloc``, ``inc_lock_ref``/``dec_lock_ref``, ``path_device_indices``,
``prefix_device_indices``, ``free_kv_row``; a call made from inside another is part of the outer
one). The two caches run in interleaved repetitions (the order alternates), each on a fresh
engine; a repetition replays its request sequence ``--runs`` times on each cache and keeps, per
method, the least time (the same calls each run: noise from other processes only adds time, and
one preempted call can double a method's total). Reported per method and overall: the median
calls/s of each, the median and spread of the per-repetition ratio kvplug / default (above 1:
kvplug is faster), and the call counts.
Needs SGLang (``scripts/integration-env.sh sglang``); run from the repository root.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.integration.sglang.conftest import Engine  # (stubs GPU-only modules)

METHODS = (
    "match_prefix",
    "touch_prefix",
    "checkpoint",
    "evict",
    "evict_for_alloc",
    "inc_lock_ref",
    "dec_lock_ref",
    "path_device_indices",
    "prefix_device_indices",
    "free_kv_row",
)


class CallTimer:
    """Wraps a tree cache's methods on the instance; times only the outermost call."""

    def __init__(self, tree: Any) -> None:
        self.calls: dict[str, int] = defaultdict(int)
        self.seconds: dict[str, float] = defaultdict(float)
        self._depth = 0
        for name in METHODS:
            method = getattr(tree, name, None)
            if method is not None:
                setattr(tree, name, self._wrap(name, method))

    def _wrap(self, name: str, method: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if self._depth:
                return method(*args, **kwargs)
            self._depth += 1
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - start
                self.calls[name] += 1
                self._depth -= 1

        return timed


def requests(n: int, seed: int) -> list[tuple[list[int], int]]:
    """Prompts over four 256-token system prompts plus a unique question; short answers."""
    rng = random.Random(seed)
    systems = [[1000 * (s + 1) + j for j in range(256)] for s in range(4)]
    out = []
    for _ in range(n):
        question = [rng.randrange(10, 900) for _ in range(rng.randrange(16, 96))]
        out.append((systems[rng.randrange(4)] + question, rng.randrange(1, 8)))
    return out


def run(backend: str | None, page_size: int, n: int, seed: int = 0) -> CallTimer:
    policy = "kvplug_lru" if backend else "lru"
    engine = Engine(page_size=page_size, capacity=2048, policy=policy, backend=backend, chunk=256)
    timer = CallTimer(engine.tree)
    for i, (prompt, new_tokens) in enumerate(requests(n, seed)):
        engine.add(f"q{i}", prompt, max_new_tokens=new_tokens)
        if len(engine.waiting) >= 4:  # requests arrive a few per scheduling round
            engine.prefill()
            engine.decode()
    engine.run(max_steps=10_000, check=False)
    return timer


LABELS = (("default", None), ("kvplug", "kvplug"))


class BestOf:
    """The fastest of repeated runs of one request sequence, per method (their calls agree)."""

    def __init__(self, timers: list[CallTimer]) -> None:
        self.calls: dict[str, int] = defaultdict(int, timers[0].calls)
        if any(t.calls != timers[0].calls for t in timers):
            raise RuntimeError("the runs of one request sequence made different cache calls")
        self.seconds = {name: min(t.seconds[name] for t in timers) for name in timers[0].calls}


def rates(timer: CallTimer | BestOf) -> dict[str, float]:
    """Calls per second inside the cache, per method and for all of them."""
    out = {name: timer.calls[name] / timer.seconds[name] for name in METHODS if timer.calls[name]}
    out["all"] = sum(timer.calls.values()) / sum(timer.seconds.values())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--runs", type=int, default=3, help="runs per repetition and cache")
    parser.add_argument("--quick", action="store_true", help="100 requests, 3 repetitions")
    args = parser.parse_args()
    if args.quick:
        args.requests, args.repeat, args.runs = 100, 3, 1
    print(
        f"{args.requests} requests; {args.repeat} interleaved repetitions (the order alternates), "
        f"each the least time per method of {args.runs} runs on fresh engines; calls/s inside "
        "the cache (median), ratio kvplug / default (median of the per-repetition ratios, "
        "min-max; above 1: kvplug is faster)"
    )
    for page_size in (1, 16):
        for _, backend in LABELS:  # warm-up: imports, first-call costs
            run(backend, page_size, 20, seed=99)
        timers: dict[str, list[BestOf]] = {label: [] for label, _ in LABELS}
        for r in range(args.repeat):
            runs: dict[str, list[CallTimer]] = {label: [] for label, _ in LABELS}
            for k in range(args.runs):
                order = LABELS if (r + k) % 2 == 0 else LABELS[::-1]
                for label, backend in order:
                    runs[label].append(run(backend, page_size, args.requests, seed=r))
            for label in timers:
                timers[label].append(BestOf(runs[label]))
        per_run = {label: [rates(t) for t in timers[label]] for label in timers}
        print(f"\npage_size={page_size}")
        header = f"{'method':<20}{'default/s':>11}{'kvplug/s':>11}{'ratio':>7}{'min-max':>12}"
        print(f"{header}{'calls default':>15}{'calls kvplug':>14}")
        for name in (*METHODS, "all"):
            default_runs, kvplug_runs = per_run["default"], per_run["kvplug"]
            if not all(name in d for d in default_runs + kvplug_runs):
                calls = [timers[label][0].calls[name] for label in timers]
                if any(calls):
                    print(f"{name:<20}{'':>41}{calls[0]:>15}{calls[1]:>14}")
                continue
            ratios = [k[name] / d[name] for d, k in zip(default_runs, kvplug_runs, strict=True)]
            d_med = statistics.median(d[name] for d in default_runs)
            k_med = statistics.median(k[name] for k in kvplug_runs)
            if name == "all":
                calls = [sum(timers[label][0].calls.values()) for label in timers]
            else:
                calls = [timers[label][0].calls[name] for label in timers]
            spread = f"{min(ratios):.2f}-{max(ratios):.2f}"
            print(
                f"{name:<20}{d_med:>11.0f}{k_med:>11.0f}{statistics.median(ratios):>7.2f}"
                f"{spread:>12}{calls[0]:>15}{calls[1]:>14}"
            )
        ms = {
            label: statistics.median(sum(t.seconds.values()) * 1e3 for t in timers[label])
            for label in timers
        }
        print(
            f"time in cache (median): default {ms['default']:.1f} ms, kvplug {ms['kvplug']:.1f} ms"
        )


if __name__ == "__main__":
    main()
