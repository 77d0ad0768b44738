"""Run every policy x capacity of a study, in worker processes where that helps."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed

from .metrics import RunResult
from .replay import RunSpec, run_one

__all__ = ["run_grid"]


def _run_quiet(spec: RunSpec) -> RunResult:
    import torch

    torch.set_num_threads(1)  # many small tensor ops: threads only contend
    return run_one(spec)


def run_grid(
    specs: Sequence[RunSpec],
    *,
    jobs: int = 1,
    on_result: Callable[[RunResult], None] | None = None,
) -> list[RunResult]:
    """Run ``specs`` (``jobs`` processes at most; 1 runs in this process) in spec order."""
    jobs = max(1, min(jobs, len(specs), os.cpu_count() or 1))
    results: list[RunResult | None] = [None] * len(specs)
    if jobs == 1:
        for i, spec in enumerate(specs):
            results[i] = _run_quiet(spec)
            if on_result is not None:
                on_result(results[i])  # type: ignore[arg-type]
    else:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            futures = {pool.submit(_run_quiet, spec): i for i, spec in enumerate(specs)}
            for future in as_completed(futures):
                result = future.result()
                results[futures[future]] = result
                if on_result is not None:
                    on_result(result)
    return [r for r in results if r is not None]
