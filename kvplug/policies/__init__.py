"""Eviction policies: each ranks the evictable candidates a cache hands it; the cache frees.

One module per family; ``builtin`` holds the sort-key policies every engine knows (LRU, LFU,
FIFO, MRU, FILO, priority, SLRU); ``arc``, ``s3fifo`` and ``lhd`` learn from feedback
(:class:`~kvplug_hookspecs.FeedbackEvictionPolicy`; ``lhd``'s model is :mod:`.reuse`, its guard
against LRU :mod:`.shadow`), ``olru`` shifts LRU by learned reuse odds of conversation-turn
classes; ``gdsf`` weighs recompute cost (:mod:`.cost`). New policies are new modules here,
registered in :mod:`kvplug.plugins.policies`.
"""

from __future__ import annotations

from .arc import ARCOptions, ARCPolicy
from .builtin import (
    FIFOPolicy,
    FILOPolicy,
    LFUPolicy,
    LRUPolicy,
    MRUPolicy,
    PriorityPolicy,
    SLRUOptions,
    SLRUPolicy,
)
from .cost import CostModel
from .gdsf import GDSFOptions, GDSFPolicy
from .lhd import LHDOptions, LHDPolicy
from .olru import OLRUOptions, OLRUPolicy
from .s3fifo import S3FIFOOptions, S3FIFOPolicy

__all__ = [
    "ARCOptions",
    "ARCPolicy",
    "CostModel",
    "FIFOPolicy",
    "FILOPolicy",
    "GDSFOptions",
    "GDSFPolicy",
    "LFUPolicy",
    "LHDOptions",
    "LHDPolicy",
    "LRUPolicy",
    "MRUPolicy",
    "OLRUOptions",
    "OLRUPolicy",
    "PriorityPolicy",
    "S3FIFOOptions",
    "S3FIFOPolicy",
    "SLRUOptions",
    "SLRUPolicy",
]
