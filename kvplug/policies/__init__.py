"""Eviction policies: each ranks the evictable candidates a cache hands it; the cache frees.

One module per family; ``builtin`` holds the sort-key policies every engine knows (LRU, LFU,
FIFO, MRU, FILO, priority, SLRU). New policies are new modules here, registered in
:mod:`kvplug.plugins.policies`.
"""

from __future__ import annotations

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

__all__ = [
    "FIFOPolicy",
    "FILOPolicy",
    "LFUPolicy",
    "LRUPolicy",
    "MRUPolicy",
    "PriorityPolicy",
    "SLRUOptions",
    "SLRUPolicy",
]
