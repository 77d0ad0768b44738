"""The simulator: replay request traces through real kvplug stacks, policy by capacity.

It drives the same caches, allocators and shortfall eviction an engine drives (through the
reference scheduler in :mod:`kvplug.engine`), on pools that keep slot bookkeeping only, and sets
the offline optimum (:mod:`.belady`) beside the online policies. ``kvplug simulate`` is its CLI.
"""

from __future__ import annotations

from .belady import BeladyOracle, BeladyPolicy
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
from .sweep import run_grid

__all__ = [
    "BELADY",
    "BeladyOracle",
    "BeladyPolicy",
    "PrefillCost",
    "RunResult",
    "RunSpec",
    "SimulationError",
    "TraceSource",
    "check_names",
    "parse_capacity",
    "run_grid",
    "run_one",
    "trace_summary",
]
