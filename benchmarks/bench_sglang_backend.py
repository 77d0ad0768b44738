"""SGLang's scheduler-side cache calls per second: its default tree vs the kvplug backend.

    /path/to/sglang-venv/bin/python benchmarks/bench_sglang_backend.py [--quick]

Both caches serve the same request sequence through SGLang's own scheduler steps (the harness
of ``tests/integration/sglang/conftest.py``: ``PrefillAdder``, ``ScheduleBatch``,
``checkpoint_kv_cache``, ``release_kv_cache``, SGLang's allocators): requests share a few long
system prompts, the pool is small enough that admissions evict. Only the time spent inside the
cache's own methods is counted (``match_prefix``, ``touch_prefix``, ``checkpoint``,
``evict``/``evict_for_alloc``, ``inc_lock_ref``/``dec_lock_ref``, ``path_device_indices``,
``free_kv_row``; a call made from inside another is part of the outer one). Reported: calls per
second per method and overall (median of ``--repeat`` runs), and the ratio kvplug / default
(above 1: kvplug is faster). Needs SGLang (``scripts/integration-env.sh sglang``); run from the
repository root.
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="100 requests, 1 repeat")
    args = parser.parse_args()
    if args.quick:
        args.requests, args.repeat = 100, 1
    print(f"{args.requests} requests, median of {args.repeat} runs; calls/s inside the cache")
    for page_size in (1, 16):
        rates: dict[str, dict[str, float]] = {}
        for label, backend in (("default", None), ("kvplug", "kvplug")):
            per_run = []
            for r in range(args.repeat):
                per_run.append(run(backend, page_size, args.requests, seed=r))
            rate: dict[str, float] = {}
            for name in (*METHODS, "all"):
                values = []
                for timer in per_run:
                    if name == "all":
                        calls, secs = sum(timer.calls.values()), sum(timer.seconds.values())
                    else:
                        calls, secs = timer.calls[name], timer.seconds[name]
                    if calls:
                        values.append(calls / secs)
                if values:
                    rate[name] = statistics.median(values)
            rate["calls"] = float(sum(per_run[0].calls.values()))
            rate["ms"] = statistics.median(sum(t.seconds.values()) * 1e3 for t in per_run)
            rates[label] = rate
        default, kvplug = rates["default"], rates["kvplug"]
        print(f"\npage_size={page_size}")
        print(f"{'method':<20}{'default/s':>12}{'kvplug/s':>12}{'ratio':>8}")
        for name in (*METHODS, "all"):
            if name in default and name in kvplug:
                ratio = kvplug[name] / default[name]
                print(f"{name:<20}{default[name]:>12.0f}{kvplug[name]:>12.0f}{ratio:>8.2f}")
        print(
            f"total time in cache: default {default['ms']:.1f} ms ({default['calls']:.0f} "
            f"calls), kvplug {kvplug['ms']:.1f} ms ({kvplug['calls']:.0f} calls)"
        )


if __name__ == "__main__":
    main()
