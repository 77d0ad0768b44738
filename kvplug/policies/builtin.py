"""The built-in eviction policies: each ranks evictable candidates by one sort key.

A policy never frees anything: a cache hands it the candidates that may be evicted right now
(unlocked radix leaves, unreferenced leaf blocks) and asks ``pop()`` for the next victim. Every
policy here is a :class:`~kvplug_hookspecs.KeyedEvictionPolicy`: a heap with lazy invalidation,
O(log N) per ``add``/``touch``/``pop``, never rebuilt from all leaves on an eviction.

Keys read the candidate statistics a cache keeps on its logical clock (``last_access_time``,
``creation_time``, ``hit_count``, ``priority``); the smallest key is evicted first and ties go to
the older node (smaller ``node_id``). The orders match SGLang's ``evict_policy.py`` strategies.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field

from kvplug_hookspecs import EvictionCandidate, FrozenModel, KeyedEvictionPolicy

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


class LRUPolicy(KeyedEvictionPolicy):
    """Least recently used first: the default, right for most chat and agent workloads."""

    def key(self, candidate: EvictionCandidate) -> Any:
        return candidate.last_access_time


class MRUPolicy(KeyedEvictionPolicy):
    """Most recently used first: keeps old prefixes when a scan of one-off prompts streams by."""

    def key(self, candidate: EvictionCandidate) -> Any:
        return -candidate.last_access_time


class LFUPolicy(KeyedEvictionPolicy):
    """Fewest hits first, then least recently used: keeps hot system prompts under churn."""

    def key(self, candidate: EvictionCandidate) -> Any:
        return (candidate.hit_count, candidate.last_access_time)


class FIFOPolicy(KeyedEvictionPolicy):
    """Oldest inserted first, whatever its use; hits do not re-rank (``touch`` is free)."""

    touch_changes_key = False

    def key(self, candidate: EvictionCandidate) -> Any:
        return candidate.creation_time


class FILOPolicy(KeyedEvictionPolicy):
    """Newest inserted first; hits do not re-rank (``touch`` is free)."""

    touch_changes_key = False

    def key(self, candidate: EvictionCandidate) -> Any:
        return -candidate.creation_time


class PriorityPolicy(KeyedEvictionPolicy):
    """Lowest request priority (given at ``insert``) first; equal priorities in LRU order."""

    def key(self, candidate: EvictionCandidate) -> Any:
        return (candidate.priority, candidate.last_access_time)


class SLRUOptions(FrozenModel):
    """Options of the ``slru`` policy."""

    protected_hits: Annotated[int, Field(ge=1, strict=True)] = 2
    """Hits after which a candidate leaves the probationary segment for the protected one."""


class SLRUPolicy(KeyedEvictionPolicy):
    """Segmented LRU: probationary candidates (fewer than ``protected_hits`` hits) go first, each
    segment in LRU order, so one burst of new prompts cannot flush prefixes reused repeatedly.
    """

    def __init__(self, options: SLRUOptions | None = None) -> None:
        if options is None:
            options = SLRUOptions()
        if not isinstance(options, SLRUOptions):
            raise TypeError(f"slru options must be SLRUOptions, got {type(options).__name__}")
        super().__init__(options)
        self._protected_hits = options.protected_hits

    def key(self, candidate: EvictionCandidate) -> Any:
        return (candidate.hit_count >= self._protected_hits, candidate.last_access_time)
