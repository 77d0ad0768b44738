"""``KeyedEvictionPolicy``: the base class for policies that rank candidates by a sort key.

A subclass only writes ``key(candidate)``; the smallest key is evicted first. The evictable set
is a binary heap with lazy invalidation: ``add``/``touch`` push an entry and remember it as the
candidate's live entry, ``discard`` forgets the live entry, and ``pop`` skips entries that are no
longer live. Every operation is O(log N); the heap is compacted when stale entries outnumber
live ones, so memory stays O(N). Nothing is ever rebuilt from all leaves on an eviction.
"""

from __future__ import annotations

import heapq
from typing import Any, ClassVar

from .protocols import EvictionCandidate

__all__ = ["KeyedEvictionPolicy"]


class KeyedEvictionPolicy:
    """Evicts the candidate with the smallest ``key()``; ties go to the smaller ``node_id``.

    Set ``touch_changes_key = False`` when the key does not depend on access statistics
    (FIFO, FILO): ``touch`` is then free.
    """

    touch_changes_key: ClassVar[bool] = True

    def __init__(self, options: Any = None) -> None:
        self.options = options
        self._heap: list[tuple[Any, int, int, EvictionCandidate]] = []
        self._live: dict[EvictionCandidate, tuple[Any, int, int, EvictionCandidate]] = {}
        self._stamp = 0

    def key(self, candidate: EvictionCandidate) -> Any:
        """The sort key of ``candidate``: smaller keys are evicted first."""
        raise NotImplementedError

    def _push(self, candidate: EvictionCandidate) -> None:
        self._stamp += 1
        entry = (self.key(candidate), candidate.node_id, self._stamp, candidate)
        self._live[candidate] = entry
        heapq.heappush(self._heap, entry)
        if len(self._heap) > 2 * len(self._live) + 64:
            self._heap = list(self._live.values())
            heapq.heapify(self._heap)

    def add(self, candidate: EvictionCandidate) -> None:
        """``candidate`` became evictable (adding a present candidate refreshes its key)."""
        self._push(candidate)

    def discard(self, candidate: EvictionCandidate) -> None:
        """``candidate`` is no longer evictable; a no-op when it was not in the set."""
        self._live.pop(candidate, None)

    def touch(self, candidate: EvictionCandidate) -> None:
        """``candidate``'s statistics changed; re-rank it if it is in the set."""
        if self.touch_changes_key and candidate in self._live:
            self._push(candidate)

    def pop(self) -> EvictionCandidate | None:
        """Remove and return the next victim, or ``None`` when nothing is evictable."""
        heap, live = self._heap, self._live
        while heap:
            entry = heapq.heappop(heap)
            candidate = entry[3]
            if live.get(candidate) is entry:
                del live[candidate]
                return candidate
        return None

    def peek(self) -> EvictionCandidate | None:
        """The next victim without removing it."""
        heap, live = self._heap, self._live
        while heap:
            entry = heap[0]
            if live.get(entry[3]) is entry:
                return entry[3]
            heapq.heappop(heap)
        return None

    def clear(self) -> None:
        """Forget every candidate."""
        self._heap.clear()
        self._live.clear()

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, candidate: object) -> bool:
        return candidate in self._live
