"""``KeyedEvictionPolicy``: the base class for policies that rank candidates by a sort key.

A subclass only writes ``key(candidate)``; the smallest key is evicted first. The evictable set
is a binary heap with lazy invalidation: ``add``/``touch`` push an entry and remember it as the
candidate's live entry, ``discard`` forgets the live entry, and ``pop`` skips entries that are no
longer live. Every operation is O(log N); the heap is compacted when stale entries outnumber
live ones, so memory stays O(N). Nothing is ever rebuilt from all leaves on an eviction.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, ClassVar

from .protocols import EvictionCandidate

__all__ = ["FeedbackEvictionPolicy", "Ghost", "KeyedEvictionPolicy"]


class KeyedEvictionPolicy:
    """Evicts the candidate with the smallest ``key()``; ties go to the smaller ``node_id``.

    Set ``touch_changes_key = False`` when the key does not depend on access statistics
    (FIFO, FILO): ``touch`` is then free. ``touch_candidates_only`` tells a cache that touching
    anything but a current candidate is a no-op here, so it may skip those calls (a radix match
    then touches only the last node of its path instead of every node).
    """

    touch_changes_key: ClassVar[bool] = True
    touch_candidates_only: ClassVar[bool] = True

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


@dataclass(frozen=True, slots=True)
class Ghost:
    """What a :class:`FeedbackEvictionPolicy` remembers of an evicted candidate.

    ``evicted_at`` is the policy's clock at the eviction, ``age`` the candidate's age then (time
    since its last access), ``hit_count`` and ``num_tokens`` its statistics, ``tag`` whatever the
    policy stored with it (the ARC list it left, the LHD class it was in).
    """

    evicted_at: int
    age: int
    hit_count: int
    num_tokens: int
    tag: int = 0


class FeedbackEvictionPolicy:
    """Base for policies that learn from what happens to their candidates.

    The cache calls only the plain protocol (``add``/``discard``/``touch``/``pop``); this class
    derives the feedback a learning policy needs from those calls and hands it to optional
    callbacks, so no cache needs a new call:

    * ``on_insert(c, ghost)`` — ``c`` is seen for the first time (a new leaf or block). ``ghost``
      is the :class:`Ghost` of an earlier eviction of the same content when one matches
      (same ``content_id``), i.e. the policy evicted that content too early; else ``None``.
      Only a candidate created at the current tick is matched (a parent that became a leaf
      again is not re-inserted content), or one the cache passes to :meth:`insert`.
    * ``on_hit(c, age)`` — ``c``'s ``hit_count`` grew: a request reused it ``age`` clock ticks
      after its previous access. Called for cached candidates that are not evictable right now,
      too (hits on locked or inner nodes the policy saw as leaves before).
    * ``on_evict(c, age) -> tag`` — ``c``, returned by ``pop``, is gone; the return value is
      kept in its ghost. Reported at the policy's next call, when it is known that the cache did
      not re-add ``c`` at once.
    * ``on_trim(c, freed)`` — ``c`` was popped but the cache re-added it at once with ``freed``
      tokens fewer: an exact eviction took only its tail; ``c`` stays cached (no ghost).
    * ``on_shrink(c, old_tokens, age)`` — ``c`` holds fewer tokens than when last seen, ``age``
      ticks after its previous access: a request matched only its head, so the radix cache split
      it (the reused head became a new inner node; ``c`` keeps the unused tail). For a radix
      leaf this is how a partial reuse looks.

    A subclass ranks its members with four methods: ``_enter(c)`` (became evictable),
    ``_leave(c)`` (no longer evictable), ``_update(c)`` (statistics changed while evictable) and
    ``_victim(remove)`` (the next victim, removed when ``remove``). ``self.now`` is the latest
    logical time seen on any candidate (the cache's clock). Ghosts are bounded by
    ``ghost_capacity`` entries (oldest forgotten first).

    Example: a policy that evicts least recently used first, but never content that came back
    after an eviction while anything else is evictable::

        class SecondChance(FeedbackEvictionPolicy):
            def __init__(self, options=None):
                super().__init__(options)
                self.lists = (LazyHeap(), LazyHeap())  # kvplug.policies.heap
                self.returned, self.where = set(), {}

            def on_insert(self, c, ghost):
                if ghost is not None:
                    self.returned.add(c)

            def on_evict(self, c, age):
                self.returned.discard(c)
                return 0

            def _enter(self, c):
                self.where[c] = heap = self.lists[c in self.returned]
                heap.push(c, c.last_access_time)

            def _leave(self, c):
                self.where.pop(c).remove(c)

            def _update(self, c):
                self._leave(c)
                self._enter(c)

            def _victim(self, remove):
                for heap in self.lists:
                    if (c := heap.peek()) is not None:
                        if remove:
                            self._leave(c)
                        return c
                return None

            def __len__(self):
                return len(self.where)

            def __contains__(self, c):
                return c in self.where

            def _clear(self):
                for heap in self.lists:
                    heap.clear()
                self.where.clear()
    """

    def __init__(self, options: Any = None, *, ghost_capacity: int = 4096) -> None:
        self.options = options
        self.now = 0
        self.ghost_capacity = ghost_capacity
        self._state: dict[EvictionCandidate, list[int]] = {}  # [last access, hits, tokens] seen
        self._ghosts: OrderedDict[Any, Ghost] = OrderedDict()
        self._pending: EvictionCandidate | None = None  # popped; evicted unless re-added now

    # -- feedback callbacks (override what you need) --------------------------------------------

    def on_insert(self, candidate: EvictionCandidate, ghost: Ghost | None) -> None:
        """``candidate`` is new; ``ghost`` is set when its content was evicted before."""

    def on_hit(self, candidate: EvictionCandidate, age: int) -> None:
        """``candidate`` was reused ``age`` ticks after its previous access."""

    def on_evict(self, candidate: EvictionCandidate, age: int) -> int:
        """``candidate`` is being evicted at ``age``; the return value is the ghost's tag."""
        return 0

    def on_trim(self, candidate: EvictionCandidate, freed: int) -> None:
        """An eviction freed ``freed`` tokens of ``candidate``'s tail; its head stays cached."""

    def on_shrink(self, candidate: EvictionCandidate, old_tokens: int, age: int) -> None:
        """``candidate`` held ``old_tokens`` when last seen (``age`` ticks ago), fewer now."""

    # -- ranking (a subclass implements these) ---------------------------------------------------

    def _enter(self, candidate: EvictionCandidate) -> None:
        raise NotImplementedError

    def _leave(self, candidate: EvictionCandidate) -> None:
        raise NotImplementedError

    def _update(self, candidate: EvictionCandidate) -> None:
        raise NotImplementedError

    def _victim(self, remove: bool) -> EvictionCandidate | None:
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError

    def __contains__(self, candidate: object) -> bool:
        raise NotImplementedError

    def _clear(self) -> None:
        raise NotImplementedError

    # -- ghosts ----------------------------------------------------------------------------------

    @staticmethod
    def ghost_keys(candidate: EvictionCandidate) -> tuple[Any, ...]:
        """The keys a ghost of ``candidate`` is found by: its ``content_id`` (none when 0)."""
        return (candidate.content_id,) if candidate.content_id else ()

    def take_ghost(self, candidate: EvictionCandidate) -> Ghost | None:
        """Remove and return the ghost matching ``candidate``'s content, if any."""
        ghosts, found = self._ghosts, None
        for key in self.ghost_keys(candidate):
            ghost = ghosts.pop(key, None)
            if found is None:
                found = ghost
        return found

    def ghost_count(self) -> int:
        """Ghost entries kept now (a candidate may be findable under two keys)."""
        return len(self._ghosts)

    # -- the protocol ----------------------------------------------------------------------------

    def _seen(self, candidate: EvictionCandidate, inserted: bool = False) -> list[int]:
        """The candidate's state, reporting a hit when its ``hit_count`` grew since last seen;
        ``inserted``: it is new content, whatever its ``creation_time`` (see :meth:`insert`)."""
        if candidate.last_access_time > self.now:
            self.now = candidate.last_access_time
        state = self._state.get(candidate)
        if state is None:
            state = [candidate.last_access_time, candidate.hit_count, candidate.num_tokens]
            self._state[candidate] = state
            # created now (not an old parent that became a leaf again), or said to be new
            fresh = inserted or candidate.creation_time >= self.now
            self.on_insert(candidate, self.take_ghost(candidate) if fresh else None)
            return state
        if candidate.hit_count > state[1]:
            self.on_hit(candidate, candidate.last_access_time - state[0])
        if candidate.num_tokens < state[2]:
            self.on_shrink(candidate, state[2], self.now - state[0])
        state[0], state[1], state[2] = (
            candidate.last_access_time,
            candidate.hit_count,
            candidate.num_tokens,
        )
        return state

    def _settle(self) -> None:
        """The candidate ``pop`` returned was not re-added: it is evicted; leave its ghost."""
        candidate, self._pending = self._pending, None
        if candidate is None:
            return
        age = max(0, self.now - candidate.last_access_time)
        tag = self.on_evict(candidate, age)
        self._state.pop(candidate, None)
        ghost = Ghost(self.now, age, candidate.hit_count, candidate.num_tokens, tag)
        ghosts = self._ghosts
        for key in self.ghost_keys(candidate):
            ghosts.pop(key, None)
            ghosts[key] = ghost
        while len(ghosts) > self.ghost_capacity:
            ghosts.popitem(last=False)

    def add(self, candidate: EvictionCandidate) -> None:
        """``candidate`` became evictable (adding a present candidate refreshes its rank)."""
        if candidate is self._pending:  # an exact eviction freed its tail and kept its head
            self._pending = None
            state = self._state[candidate]
            freed, state[2] = state[2] - candidate.num_tokens, candidate.num_tokens
            self.on_trim(candidate, freed)
            self._enter(candidate)
            return
        self._settle()
        self._seen(candidate)
        if candidate in self:
            self._update(candidate)
        else:
            self._enter(candidate)

    def insert(self, candidate: EvictionCandidate) -> None:
        """``candidate`` holds new content and becomes evictable: :meth:`add`, except that it
        is an insert (``on_insert``, matched against ghosts) whatever its ``creation_time``,
        and whatever was known of the object before is forgotten.

        For a cache that shows content to its policy only some time after creating it, and
        knows when the content is new: vLLM's block pool offers a block when it is freed (its
        content was cached earlier) and reuses one candidate object per block.
        """
        self._settle()
        if candidate in self:
            self._leave(candidate)
        self._state.pop(candidate, None)
        self._seen(candidate, True)
        self._enter(candidate)

    def discard(self, candidate: EvictionCandidate) -> None:
        """``candidate`` is no longer evictable (its state is kept: it is still cached)."""
        self._settle()
        if candidate in self:
            self._leave(candidate)

    def touch(self, candidate: EvictionCandidate) -> None:
        """``candidate``'s statistics changed: report a hit, re-rank it if evictable."""
        self._settle()
        if candidate not in self._state:
            return  # never a candidate of ours (an inner radix node): nothing to learn
        self._seen(candidate)
        if candidate in self:
            self._update(candidate)

    def pop(self) -> EvictionCandidate | None:
        """Remove and return the next victim (its ghost is left at the next call)."""
        self._settle()
        candidate = self._victim(True)
        self._pending = candidate
        return candidate

    def peek(self) -> EvictionCandidate | None:
        """The next victim without removing it."""
        self._settle()
        return self._victim(False)

    def clear(self) -> None:
        """Forget every candidate and ghost."""
        self._clear()
        self._state.clear()
        self._ghosts.clear()
        self._pending = None
