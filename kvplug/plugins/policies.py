"""Built-in eviction policies: ``lru`` (the default), ``lfu``, ``fifo``, ``mru``, ``filo``,
``priority``, ``slru``."""

from __future__ import annotations

from collections.abc import Iterator

from kvplug_hookspecs import EvictionPolicyRegistration, hookimpl

from ..policies import (
    FIFOPolicy,
    FILOPolicy,
    LFUPolicy,
    LRUPolicy,
    MRUPolicy,
    PriorityPolicy,
    SLRUOptions,
    SLRUPolicy,
)


@hookimpl
def kvplug_eviction_policies() -> Iterator[EvictionPolicyRegistration]:
    yield EvictionPolicyRegistration(
        name="lru", factory=LRUPolicy, description="least recently used first (default)"
    )
    yield EvictionPolicyRegistration(
        name="lfu",
        factory=LFUPolicy,
        description="fewest prefix hits first, ties least recently used",
    )
    yield EvictionPolicyRegistration(
        name="fifo", factory=FIFOPolicy, description="oldest inserted first; hits do not re-rank"
    )
    yield EvictionPolicyRegistration(
        name="mru", factory=MRUPolicy, description="most recently used first"
    )
    yield EvictionPolicyRegistration(
        name="filo",
        factory=FILOPolicy,
        description="newest inserted first; hits do not re-rank",
        aliases=("lifo",),
    )
    yield EvictionPolicyRegistration(
        name="priority",
        factory=PriorityPolicy,
        description="lowest request priority (set at insert) first, ties least recently used",
    )
    yield EvictionPolicyRegistration(
        name="slru",
        factory=SLRUPolicy,
        options_model=SLRUOptions,
        description="segmented LRU: candidates with fewer than protected_hits hits go first",
    )
