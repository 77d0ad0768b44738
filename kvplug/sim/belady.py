"""``belady``: the offline optimum, a policy only the simulator can run.

It evicts the evictable candidate whose next use lies farthest in the future, read from the whole
trace up front. A candidate is identified by the block its first token belongs to (block ids
stand for whole prefixes, see :mod:`kvplug.traces.base`); its next use is the first later request
whose prompt holds that block. Keys are kept in the usual lazy heap: a candidate's next use only
changes when a request reaches it, and that request's match touches it; a key that went stale
anyway (the request matched less than the block) is refreshed when it reaches the top, so each
eviction is O(log N) amortised, never a scan. The bound is for leaf-only eviction, like every
policy here; it needs a radix-family cache (candidates carry their tokens) and a
block-structured trace (Mooncake or synthetic).
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Iterable, Sequence
from typing import Any

from kvplug_hookspecs import EvictionCandidate, KeyedEvictionPolicy

from ..traces.base import block_id_of

__all__ = ["BeladyOracle", "BeladyPolicy"]

_NEVER = float("inf")


class BeladyOracle:
    """For each block id, the sorted indices of the requests whose prompt holds it."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.uses: dict[int, list[int]] = {}
        self.now = -1  # index of the last request admitted

    def add_request(self, index: int, block_ids: Iterable[int]) -> None:
        for block_id in block_ids:
            uses = self.uses.get(block_id)
            if uses is None:
                self.uses[block_id] = [index]
            elif uses[-1] != index:
                uses.append(index)

    def next_use(self, block_id: int) -> float:
        """Index of the first request after ``now`` that holds ``block_id`` (inf: never)."""
        uses = self.uses.get(block_id)
        if not uses:
            return _NEVER
        i = bisect.bisect_right(uses, self.now)
        return uses[i] if i < len(uses) else _NEVER


def _first_token(candidate: Any) -> int:
    key: Sequence[int] = candidate.key
    return int(key[0])


class BeladyPolicy(KeyedEvictionPolicy):
    """Farthest next use first (the smallest key is ``-next_use``)."""

    def __init__(self, oracle: BeladyOracle) -> None:
        super().__init__(None)
        self.oracle = oracle

    def key(self, candidate: EvictionCandidate) -> Any:
        token = _first_token(candidate)
        return -self.oracle.next_use(block_id_of(token, self.oracle.block_size))

    def pop(self) -> EvictionCandidate | None:
        heap, live, now = self._heap, self._live, self.oracle.now
        while heap:
            entry = heap[0]
            candidate = entry[3]
            if live.get(candidate) is not entry:
                heapq.heappop(heap)
                continue
            if -entry[0] <= now:  # its next use has passed without touching it: refresh
                heapq.heappop(heap)
                self._push(candidate)
                continue
            heapq.heappop(heap)
            del live[candidate]
            return candidate
        return None
