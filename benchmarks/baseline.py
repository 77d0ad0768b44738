"""What the cache benchmarks share: the rebuild-per-evict baseline and random token ids."""

from __future__ import annotations

import heapq
import random
from typing import Any

_VOCAB = range(1, 32000)


def random_tokens(rng: random.Random, n: int) -> list[int]:
    """``n`` random token ids (no 0, the padding id)."""
    return rng.choices(_VOCAB, k=n)


class RebuildHeapLRU:
    """SGLang 0.5.9's evictable-set handling: a set kept incrementally, a heap built per evict."""

    def __init__(self) -> None:
        self._items: set[Any] = set()
        self._heap: list[tuple[int, int, Any]] | None = None

    def add(self, c: Any) -> None:
        self._items.add(c)
        if self._heap is not None:  # became evictable during this eviction
            heapq.heappush(self._heap, (c.last_access_time, c.node_id, c))

    def discard(self, c: Any) -> None:
        self._items.discard(c)

    def touch(self, c: Any) -> None:
        if self._heap is not None and c in self._items:
            heapq.heappush(self._heap, (c.last_access_time, c.node_id, c))

    def begin_evict(self) -> None:
        self._heap = [(c.last_access_time, c.node_id, c) for c in self._items]
        heapq.heapify(self._heap)

    def end_evict(self) -> None:
        self._heap = None

    def pop(self) -> Any:
        while self._heap:
            c = heapq.heappop(self._heap)[2]
            if c in self._items:
                self._items.discard(c)
                return c
        return None

    def peek(self) -> Any:
        """The next victim without taking it: a scan, as the rebuild baseline would do."""
        return min(self._items, key=lambda c: (c.last_access_time, c.node_id), default=None)

    def clear(self) -> None:
        self._items.clear()

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, c: object) -> bool:
        return c in self._items
