"""``--executor ray``: a small sweep on a local Ray instance gives every cell exactly the
figures of the local run (skipped where Ray, the ``ray`` extra, is not installed)."""

from __future__ import annotations

import pytest

from kvplug.sim import ClusterSpec, RunSpec, TraceSource, run_grid
from kvplug.traces import SyntheticSpec

ray = pytest.importorskip("ray")
pytest.importorskip("msgspec")

SMALL = SyntheticSpec(num_requests=80, block_size=4, system_blocks=8, conversations_per_s=20.0)
TIMES = ("wall_seconds", "cache_us_per_request", "router_us_per_request")


def _figures(result):
    return {k: v for k, v in result.as_dict().items() if k not in TIMES}


def test_a_sweep_on_local_ray_matches_the_local_run_cell_for_cell():
    run = RunSpec(
        source=TraceSource(kind="synthetic", synthetic=SMALL), capacity_tokens=300, page_size=4
    )
    specs = [
        run,
        run.model_copy(update={"policy": "s3fifo", "timing": "trace"}),
        ClusterSpec(run=run, instances=2, router="llmd", seed=3),
        ClusterSpec(run=run, instances=3, router="prefix_aware"),
    ]
    local = run_grid(specs, jobs=1)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        remote = run_grid(specs, executor="ray")
    finally:
        ray.shutdown()
    assert [_figures(r) for r in remote] == [_figures(r) for r in local]
    assert [type(r).__name__ for r in remote] == [
        "RunResult", "RunResult", "ClusterResult", "ClusterResult"
    ]  # fmt: skip
