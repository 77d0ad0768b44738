"""Built-in eviction policies: ``lru`` (the default), ``lfu``, ``fifo``, ``mru``, ``filo``,
``priority``, ``slru``; the learning policies ``arc``, ``s3fifo``, ``lhd``, ``olru`` and the
cost-aware ``gdsf``."""

from __future__ import annotations

from collections.abc import Iterator

from kvplug_hookspecs import EvictionPolicyRegistration, hookimpl

from ..policies import (
    ARCOptions,
    ARCPolicy,
    FIFOPolicy,
    FILOPolicy,
    GDSFOptions,
    GDSFPolicy,
    LFUPolicy,
    LHDOptions,
    LHDPolicy,
    LRUPolicy,
    MRUPolicy,
    OLRUOptions,
    OLRUPolicy,
    PriorityPolicy,
    S3FIFOOptions,
    S3FIFOPolicy,
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
    yield EvictionPolicyRegistration(
        name="arc",
        factory=ARCPolicy,
        options_model=ARCOptions,
        description="adaptive replacement: recency and frequency lists, split adapted by ghosts",
    )
    yield EvictionPolicyRegistration(
        name="s3fifo",
        factory=S3FIFOPolicy,
        options_model=S3FIFOOptions,
        description="small + main FIFO queues with ghosts: one-hit wonders leave early",
    )
    yield EvictionPolicyRegistration(
        name="lhd",
        factory=LHDPolicy,
        options_model=LHDOptions,
        description="learned hit density per class and age, guarded against losing to LRU",
    )
    yield EvictionPolicyRegistration(
        name="olru",
        factory=OLRUPolicy,
        options_model=OLRUOptions,
        description="LRU shifted by learned reuse odds per conversation-turn class, LRU-guarded",
    )
    yield EvictionPolicyRegistration(
        name="gdsf",
        factory=GDSFPolicy,
        options_model=GDSFOptions,
        description="greedy-dual size-frequency: hits x prefill cost per token (by depth)",
    )
