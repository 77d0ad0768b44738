"""``s3fifo``: a small FIFO, a main FIFO and a ghost queue (Yang et al., SOSP 2023).

New candidates enter the small queue S; most content is used once, and S evicts it quickly
("quick demotion of one-hit wonders"). A candidate reused while in S moves to the main queue M
when it reaches the head of S; an insert of content with a ghost (evicted before) goes straight
to M. M is a FIFO with second chances: a head with hits left is re-queued with one hit less.
S is evicted while it holds more than ``small_fraction`` of the evictable tokens.

Leaf-only adaptation: the queues hold only evictable candidates; a candidate that stops being
evictable (locked, gained a child) keeps its queue and place and returns to it.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from kvplug_hookspecs import EvictionCandidate, FeedbackEvictionPolicy, FrozenModel, Ghost

from .heap import LazyHeap

__all__ = ["S3FIFOOptions", "S3FIFOPolicy"]

_S, _M = 1, 2


class S3FIFOOptions(FrozenModel):
    """Options of the ``s3fifo`` policy."""

    small_fraction: Annotated[float, Field(gt=0.0, lt=1.0)] = 0.1
    """Share of the evictable tokens the small queue may hold before it is evicted from."""
    max_freq: Annotated[int, Field(ge=1, le=15, strict=True)] = 3
    """Hits counted per candidate (second chances in M)."""
    ghost_entries: Annotated[int, Field(ge=0, strict=True)] = 8192
    """Evicted candidates remembered."""


class S3FIFOPolicy(FeedbackEvictionPolicy):
    """S3-FIFO on leaves: one-hit wonders leave through S, reused content lives in M."""

    def __init__(self, options: S3FIFOOptions | None = None) -> None:
        if options is None:
            options = S3FIFOOptions()
        if not isinstance(options, S3FIFOOptions):
            raise TypeError(f"s3fifo options must be S3FIFOOptions, got {type(options).__name__}")
        super().__init__(options, ghost_capacity=options.ghost_entries)
        self._queues = {_S: LazyHeap(), _M: LazyHeap()}
        self._tokens = {_S: 0, _M: 0}
        self._meta: dict[EvictionCandidate, list[int]] = {}  # [queue, position, freq]
        self._position = 0
        self._small = options.small_fraction
        self._max_freq = options.max_freq

    def _queue_at_tail(self, candidate: EvictionCandidate, queue: int) -> list[int]:
        self._position += 1
        meta = self._meta.get(candidate)
        if meta is None:
            meta = self._meta[candidate] = [queue, self._position, 0]
        else:
            meta[0], meta[1], meta[2] = queue, self._position, 0
        return meta

    # -- feedback ------------------------------------------------------------------------------

    def on_insert(self, candidate: EvictionCandidate, ghost: Ghost | None) -> None:
        self._queue_at_tail(candidate, _S if ghost is None else _M)

    def on_hit(self, candidate: EvictionCandidate, age: int) -> None:
        meta = self._meta.get(candidate)
        if meta is not None and meta[2] < self._max_freq:
            meta[2] += 1

    def on_evict(self, candidate: EvictionCandidate, age: int) -> int:
        meta = self._meta.pop(candidate, None)
        return _S if meta is None else meta[0]

    def queue_of(self, candidate: EvictionCandidate) -> str:
        """``"small"`` or ``"main"`` (for tests and debugging)."""
        return "small" if self._meta[candidate][0] == _S else "main"

    # -- ranking -------------------------------------------------------------------------------

    def _enter(self, candidate: EvictionCandidate) -> None:
        meta = self._meta.get(candidate)
        if meta is None:  # seen before this policy kept state (after clear): start in S
            meta = self._queue_at_tail(candidate, _S)
        self._queues[meta[0]].push(candidate, meta[1])
        self._tokens[meta[0]] += candidate.num_tokens

    def _leave(self, candidate: EvictionCandidate) -> None:
        meta = self._meta[candidate]
        if self._queues[meta[0]].remove(candidate):
            self._tokens[meta[0]] -= candidate.num_tokens

    def _update(self, candidate: EvictionCandidate) -> None:
        self._leave(candidate)  # the size may have changed; the place in the queue does not
        self._enter(candidate)

    def _victim(self, remove: bool) -> EvictionCandidate | None:
        small, main = self._queues[_S], self._queues[_M]
        while True:
            total = self._tokens[_S] + self._tokens[_M]
            if len(small) and (self._tokens[_S] > self._small * total or not len(main)):
                candidate = small.peek()
                assert candidate is not None
                meta = self._meta[candidate]
                if meta[2] > 0:  # reused while in S: promote to M
                    self._leave(candidate)
                    self._queue_at_tail(candidate, _M)
                    self._enter(candidate)
                    continue
            else:
                candidate = main.peek()
                if candidate is None:
                    return None
                meta = self._meta[candidate]
                if meta[2] > 0:  # second chance: back to M's tail
                    freq = meta[2] - 1
                    self._leave(candidate)
                    self._queue_at_tail(candidate, _M)[2] = freq
                    self._enter(candidate)
                    continue
            if remove:
                self._leave(candidate)
            return candidate

    def __len__(self) -> int:
        return len(self._queues[_S]) + len(self._queues[_M])

    def __contains__(self, candidate: object) -> bool:
        return candidate in self._queues[_S] or candidate in self._queues[_M]

    def _clear(self) -> None:
        for queue in self._queues.values():
            queue.clear()
        self._tokens = {_S: 0, _M: 0}
        self._meta.clear()
