"""``LazyHeap``: the min-heap with lazy invalidation that the learning policies rank with.

The same structure as :class:`~kvplug_hookspecs.KeyedEvictionPolicy`'s heap, as a component: a
policy keeps several (one per list or class) and compares their heads. Push, remove and pop are
O(log N); stale entries are skipped on the way and compacted when they outnumber live ones.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from typing import Any

from kvplug_hookspecs import EvictionCandidate

__all__ = ["LazyHeap"]


class LazyHeap:
    """Candidates by ``(key, node_id)``, smallest first; pushing a member re-keys it."""

    __slots__ = ("_heap", "_live", "_stamp")

    def __init__(self) -> None:
        self._heap: list[tuple[Any, int, int, EvictionCandidate]] = []
        self._live: dict[EvictionCandidate, tuple[Any, int, int, EvictionCandidate]] = {}
        self._stamp = 0

    def push(self, candidate: EvictionCandidate, key: Any) -> None:
        """Insert ``candidate`` with ``key`` (or move it to ``key`` when present)."""
        self._stamp += 1
        entry = (key, candidate.node_id, self._stamp, candidate)
        self._live[candidate] = entry
        heapq.heappush(self._heap, entry)
        if len(self._heap) > 2 * len(self._live) + 64:
            self._heap = list(self._live.values())
            heapq.heapify(self._heap)

    def fill(self, items: Iterable[tuple[EvictionCandidate, Any]]) -> None:
        """Push many ``(candidate, key)`` pairs at once: one O(N) heapify instead of N pushes
        (a policy switching rankings refills a heap with every candidate)."""
        self._stamp += 1
        stamp, live = self._stamp, self._live
        for candidate, key in items:
            live[candidate] = (key, candidate.node_id, stamp, candidate)
        self._heap = list(live.values())
        heapq.heapify(self._heap)

    def remove(self, candidate: EvictionCandidate) -> bool:
        """Forget ``candidate``; ``False`` when it was not here."""
        return self._live.pop(candidate, None) is not None

    def key_of(self, candidate: EvictionCandidate) -> Any:
        """The key ``candidate`` was pushed with (it must be here)."""
        return self._live[candidate][0]

    def peek(self) -> EvictionCandidate | None:
        """The smallest member, or ``None``."""
        heap, live = self._heap, self._live
        while heap:
            entry = heap[0]
            if live.get(entry[3]) is entry:
                return entry[3]
            heapq.heappop(heap)
        return None

    def pop(self) -> EvictionCandidate | None:
        """Remove and return the smallest member, or ``None``."""
        candidate = self.peek()
        if candidate is not None:
            heapq.heappop(self._heap)
            del self._live[candidate]
        return candidate

    def rekey(self, key: Any) -> None:
        """Give every member the key ``key(candidate)`` (O(N))."""
        self._stamp += 1
        stamp = self._stamp
        live = self._live
        for candidate in live:
            live[candidate] = (key(candidate), candidate.node_id, stamp, candidate)
        self._heap = list(live.values())
        heapq.heapify(self._heap)

    def members(self) -> list[EvictionCandidate]:
        """The members, in no particular order."""
        return list(self._live)

    def clear(self) -> None:
        self._heap.clear()
        self._live.clear()

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, candidate: object) -> bool:
        return candidate in self._live
