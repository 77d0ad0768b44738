"""The simulator: replay request traces through real kvplug stacks, policy by capacity.

It drives the same caches, allocators and shortfall eviction an engine drives (through the
reference scheduler in :mod:`kvplug.engine`), on pools that keep slot bookkeeping only, and sets
the offline optimum (:mod:`.belady`) beside the online policies; :mod:`.cluster` replays a trace
through N instances behind a router (:mod:`.routers`). ``kvplug simulate`` is its CLI.
"""

from __future__ import annotations

from .belady import BeladyOracle, BeladyPolicy
from .cluster import ClusterResult, ClusterSpec, run_cluster
from .metrics import PrefillCost, RunResult
from .replay import (
    BELADY,
    RunSpec,
    SimulationError,
    TraceSource,
    check_names,
    parse_capacity,
    run_one,
    trace_summary,
)
from .routers import ROUTERS
from .sweep import run_cell, run_grid

__all__ = [
    "BELADY",
    "ROUTERS",
    "BeladyOracle",
    "BeladyPolicy",
    "ClusterResult",
    "ClusterSpec",
    "PrefillCost",
    "RunResult",
    "RunSpec",
    "SimulationError",
    "TraceSource",
    "check_names",
    "parse_capacity",
    "run_cell",
    "run_cluster",
    "run_grid",
    "run_one",
    "trace_summary",
]
