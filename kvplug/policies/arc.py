"""``arc``: adaptive replacement (Megiddo & Modha, FAST 2003) over evictable leaves.

Candidates seen once live in the recency list T1, candidates reused (a hit, or an insert of
content that was evicted before) in the frequency list T2; each list is evicted in LRU order.
Evicted candidates leave ghosts (B1 or B2). An insert that matches a B1 ghost means recency
was cut too short: the target size ``p`` of T1 grows; a B2 ghost shrinks it. Eviction takes
from T1 while it holds more than ``p`` tokens, else from T2.

Leaf-only adaptation: the lists hold only what the cache says is evictable, sizes are in tokens
of evictable candidates, and ``p`` is bounded by the most tokens ever evictable at once.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from kvplug_hookspecs import EvictionCandidate, FeedbackEvictionPolicy, FrozenModel, Ghost

from .heap import LazyHeap

__all__ = ["ARCOptions", "ARCPolicy"]

_T1, _T2 = 1, 2


class ARCOptions(FrozenModel):
    """Options of the ``arc`` policy."""

    ghost_entries: Annotated[int, Field(ge=0, strict=True)] = 8192
    """Evicted candidates remembered (B1 and B2 together)."""
    initial_recency_fraction: Annotated[float, Field(ge=0.0, le=1.0)] = 0.5
    """Starting target share of T1 in the evictable tokens."""


class ARCPolicy(FeedbackEvictionPolicy):
    """ARC on leaves: recency (T1) and frequency (T2) lists with an adaptive split ``p``."""

    def __init__(self, options: ARCOptions | None = None) -> None:
        if options is None:
            options = ARCOptions()
        if not isinstance(options, ARCOptions):
            raise TypeError(f"arc options must be ARCOptions, got {type(options).__name__}")
        super().__init__(options, ghost_capacity=options.ghost_entries)
        self._lists = {_T1: LazyHeap(), _T2: LazyHeap()}
        self._tokens = {_T1: 0, _T2: 0}
        self._where: dict[EvictionCandidate, int] = {}  # T1 or T2, for every known candidate
        self._ghost_tokens = {_T1: 0.0, _T2: 0.0}  # decayed tokens evicted from each list
        self._fraction = options.initial_recency_fraction
        self._capacity = 0
        self.p = 0.0
        """Target tokens of T1 (adapted on ghost hits)."""

    # -- feedback ------------------------------------------------------------------------------

    def on_insert(self, candidate: EvictionCandidate, ghost: Ghost | None) -> None:
        if ghost is None:
            self._where[candidate] = _T1
            return
        size = candidate.num_tokens
        b1, b2 = self._ghost_tokens[_T1], self._ghost_tokens[_T2]
        if ghost.tag == _T1:
            self.p = min(float(self._capacity), self.p + size * max(1.0, b2 / max(b1, 1.0)))
        else:
            self.p = max(0.0, self.p - size * max(1.0, b1 / max(b2, 1.0)))
        self._where[candidate] = _T2

    def on_hit(self, candidate: EvictionCandidate, age: int) -> None:
        if self._where.get(candidate) == _T1:
            if candidate in self._lists[_T1]:
                self._leave(candidate)
                self._where[candidate] = _T2
                self._enter(candidate)
            else:
                self._where[candidate] = _T2

    def on_evict(self, candidate: EvictionCandidate, age: int) -> int:
        where = self._where.pop(candidate, _T1)
        ghosts = self._ghost_tokens
        for side in ghosts:
            ghosts[side] *= 0.999  # ghosts are bounded: old evictions fade
        ghosts[where] += candidate.num_tokens
        return where

    # -- ranking -------------------------------------------------------------------------------

    def _enter(self, candidate: EvictionCandidate) -> None:
        where = self._where.setdefault(candidate, _T1)
        self._lists[where].push(candidate, candidate.last_access_time)
        self._tokens[where] += candidate.num_tokens
        total = self._tokens[_T1] + self._tokens[_T2]
        if total > self._capacity:
            if self._capacity == 0:
                self.p = self._fraction * total
            self._capacity = total

    def _leave(self, candidate: EvictionCandidate) -> None:
        where = self._where.get(candidate, _T1)
        if self._lists[where].remove(candidate):
            self._tokens[where] -= candidate.num_tokens

    def _update(self, candidate: EvictionCandidate) -> None:
        # num_tokens may have changed (a split or an exact cut): re-enter with the new size
        self._leave(candidate)
        self._enter(candidate)

    def _victim(self, remove: bool) -> EvictionCandidate | None:
        t1, t2 = self._lists[_T1], self._lists[_T2]
        side = _T1 if len(t1) and (self._tokens[_T1] > self.p or not len(t2)) else _T2
        candidate = (t1 if side == _T1 else t2).peek()
        if candidate is not None and remove:
            self._leave(candidate)
        return candidate

    def recency_tokens(self) -> int:
        """Evictable tokens in T1 now."""
        return self._tokens[_T1]

    def __len__(self) -> int:
        return len(self._lists[_T1]) + len(self._lists[_T2])

    def __contains__(self, candidate: object) -> bool:
        return candidate in self._lists[_T1] or candidate in self._lists[_T2]

    def _clear(self) -> None:
        for heap in self._lists.values():
            heap.clear()
        self._tokens = {_T1: 0, _T2: 0}
        self._where.clear()
        self._ghost_tokens = {_T1: 0.0, _T2: 0.0}
        self._capacity, self.p = 0, 0.0
