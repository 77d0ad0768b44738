"""Run every cell of a study (policy x capacity, or router x instances x capacity), in local
worker processes or on a Ray cluster.

A cell is a :class:`~.replay.RunSpec` (one instance) or a :class:`~.cluster.ClusterSpec`; both
are plain picklable models, and a cell's result depends on nothing but its spec (routers break
ties with the spec's seed), so where it runs changes no figure.

``executor="ray"`` submits each cell as a Ray task (one CPU each) to the cluster at
``address`` (``ray.init(address=...)``: ``"auto"`` for a running cluster, ``ray://host:10001``
for a remote one), or to a local Ray instance started for the sweep when no address is given.
Every Ray worker must import the same kvplug (the same version, with the trace file at the same
path): on a remote cluster ship them in the job's ``runtime_env``. Ray is the ``ray`` extra,
imported only when asked for.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from typing import Any, Literal

from .cluster import ClusterResult, ClusterSpec, run_cluster
from .metrics import RunResult
from .replay import RunSpec, SimulationError, run_one

__all__ = ["Cell", "CellResult", "run_cell", "run_grid"]

Cell = RunSpec | ClusterSpec
CellResult = RunResult | ClusterResult


def run_cell(spec: Cell) -> CellResult:
    """One cell, single-threaded torch (many small tensor ops: threads only contend)."""
    import torch

    torch.set_num_threads(1)
    if isinstance(spec, ClusterSpec):
        return run_cluster(spec)
    return run_one(spec)


def run_grid(
    specs: Sequence[Cell],
    *,
    jobs: int = 1,
    on_result: Callable[[Any], None] | None = None,
    executor: Literal["local", "ray"] = "local",
    address: str | None = None,
) -> list[Any]:
    """Run ``specs`` and return their results in spec order: locally in ``jobs`` processes at
    most (1 runs in this process), or on Ray (``address``; see the module docstring)."""
    if executor == "ray":
        return _run_ray(specs, address, on_result)
    if executor != "local":
        raise SimulationError(f"executor must be local or ray, got {executor!r}")
    jobs = max(1, min(jobs, len(specs), os.cpu_count() or 1))
    results: list[Any] = [None] * len(specs)
    if jobs == 1:
        for i, spec in enumerate(specs):
            results[i] = run_cell(spec)
            if on_result is not None:
                on_result(results[i])
    else:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            futures = {pool.submit(run_cell, spec): i for i, spec in enumerate(specs)}
            for future in as_completed(futures):
                result = future.result()
                results[futures[future]] = result
                if on_result is not None:
                    on_result(result)
    return [r for r in results if r is not None]


def _run_ray(
    specs: Sequence[Cell], address: str | None, on_result: Callable[[Any], None] | None
) -> list[Any]:
    try:
        import ray
    except ImportError:
        raise SimulationError(
            "--executor ray needs Ray: pip install 'kvplug[ray]' (or pip install ray)"
        ) from None
    started = not ray.is_initialized()
    if started:
        ray.init(address=address, include_dashboard=False, log_to_driver=False)
    try:
        task = ray.remote(num_cpus=1)(run_cell)
        refs = [task.remote(spec) for spec in specs]
        order = {ref: i for i, ref in enumerate(refs)}
        results: list[Any] = [None] * len(specs)
        waiting = list(refs)
        while waiting:
            done, waiting = ray.wait(waiting, num_returns=1)
            for ref in done:
                result = ray.get(ref)
                results[order[ref]] = result
                if on_result is not None:
                    on_result(result)
        return results
    finally:
        if started:
            ray.shutdown()
