"""Block ranks: the built-in policies' eviction orders over vLLM block ids, at vLLM's cost.

A kvplug policy ranks candidate objects through method calls (``add``/``discard``/``pop``),
which costs several vLLM per-block operations per block. Inside vLLM's block pool the
candidates are block ids and their statistics sit in the queue's per-block lists
(:class:`~kvplug.integrations.vllm.block_pool.PolicyFreeBlockQueue`), so a rank here keeps
integer heaps of ``key << bits | block_id`` (compared in C, no tuples, no objects per block).

Each rank makes exactly the choices its policy makes on the same candidates (the tests drive
both side by side): the same keys, the same feedback. A hit is seen when a block joins again
with more hits than when it was last seen. A block's new content is a new candidate (its state
is reset: ``created`` changed) and an insert in the policy's terms: vLLM offers it when the
block is first freed, after it was cached, so a :class:`PolicyRank` passes it to the policy's
``insert``. An eviction (``pop``: vLLM then drops the block's hash to reuse it) leaves a ghost
keyed by the block hash, bounded by the policy's ``ghost_entries``; new content whose hash has
a ghost (computed again after its eviction, in whichever block) is returning content: ``arc``
puts it in T2 and adapts ``p``, ``s3fifo`` puts it in the main queue, as the policies do.
:func:`rank_for` picks the rank of a policy, or ``None`` for policies without one (they run
through :class:`PolicyRank`).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from typing import Any

from kvplug_hookspecs import CandidateStats, EvictionPolicy, FeedbackEvictionPolicy

from ... import speedups
from ...policies.arc import ARCPolicy
from ...policies.builtin import LFUPolicy, LRUPolicy, PriorityPolicy, SLRUPolicy
from ...policies.s3fifo import S3FIFOPolicy

__all__ = [
    "ARCRank",
    "BlockRank",
    "BlockStats",
    "BlockTable",
    "KeyedRank",
    "PolicyRank",
    "S3FIFORank",
    "keyed_rank",
    "rank_for",
]

_heappush, _heappop, _heappushpop = heapq.heappush, heapq.heappop, heapq.heappushpop


def _leave_ghost(ghosts: OrderedDict[Any, Any], content: Any, tag: Any, capacity: int) -> None:
    """Remember evicted ``content`` (a block hash; ``None``: nothing cached) as the newest
    ghost, with ``tag``; the oldest is forgotten beyond ``capacity``."""
    if content is None:
        return
    ghosts.pop(content, None)
    ghosts[content] = tag
    if len(ghosts) > capacity:
        ghosts.popitem(last=False)


class BlockStats(CandidateStats):
    """The statistics of a vLLM block's cached content (``block_id`` finds the block)."""

    __slots__ = ("block_id",)

    def __init__(self, block_id: int, now: int, num_tokens: int) -> None:
        super().__init__(now, num_tokens=num_tokens)
        self.block_id = block_id


class BlockTable:
    """Per-block statistics of the current cached content, indexed by block id (the queue's).

    ``created`` is the clock tick the content was cached at (it names the content: a rank's
    state for a block is valid while its stamp equals it), ``last`` the tick of the last free
    or hit, ``hits`` the requests that reused it, ``tokens`` the tokens it added, ``content``
    the block hash the row describes.
    """

    __slots__ = ("content", "created", "hits", "last", "tokens")

    def __init__(self, num_blocks: int) -> None:
        self.created = [0] * num_blocks
        self.last = [0] * num_blocks
        self.hits = [0] * num_blocks
        self.tokens = [0] * num_blocks
        self.content: list[Any] = [None] * num_blocks

    def describe(self, stats: BlockStats, block: Any) -> None:
        """Set the fields of ``stats`` that last as long as its block's content (``block``:
        vLLM's ``KVCacheBlock``): creation, tokens, ``depth`` and ``content_id``."""
        block_id = stats.block_id
        num_tokens = self.tokens[block_id]
        stats.creation_time = self.created[block_id]
        stats.num_tokens = stats.new_tokens = num_tokens
        hash_tokens = block.block_hash_num_tokens
        stats.depth = max(hash_tokens - num_tokens, 0) if hash_tokens else 0
        content = self.content[block_id]
        stats.content_id = hash(content) if content is not None else 0


class BlockRank:
    """Which candidate block (a free cached chain leaf) is evicted next."""

    def add(self, block_id: int) -> None:
        """``block_id`` became a candidate."""
        raise NotImplementedError

    def discard(self, block_id: int) -> None:
        """``block_id`` is no longer a candidate (it may stay cached); no-op if it was not."""
        raise NotImplementedError

    def pop(self) -> int:
        """Remove and return the next victim, ``-1`` when there is none."""
        raise NotImplementedError

    def pushpop(self, block_id: int) -> int:
        """``add(block_id)`` then ``pop()`` (one call on the eviction path)."""
        self.add(block_id)
        return self.pop()

    def peek(self) -> int:
        """The next victim without removing it, ``-1`` when there is none."""
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError

    def __contains__(self, block_id: object) -> bool:
        raise NotImplementedError


class _IntHeap:
    """Block ids by an integer key, smallest first; lazy removal (``entry`` says what is live)."""

    __slots__ = ("_entry", "_heap", "_live", "_mask", "_shift")

    def __init__(self, num_blocks: int) -> None:
        self._shift = max(num_blocks - 1, 1).bit_length()
        self._mask = (1 << self._shift) - 1
        self._heap: list[int] = []
        self._entry = [-1] * num_blocks  # the live heap entry of each block, -1 if none
        self._live = 0

    def push(self, block_id: int, key: int) -> None:
        entry = key << self._shift | block_id
        if self._entry[block_id] < 0:
            self._live += 1
        self._entry[block_id] = entry
        heap = self._heap
        _heappush(heap, entry)
        if len(heap) > 2 * self._live + 64:  # stale entries outnumber live ones: compact
            live = self._entry
            mask = self._mask
            self._heap = [e for e in heap if live[e & mask] == e]
            heapq.heapify(self._heap)

    def remove(self, block_id: int) -> bool:
        if self._entry[block_id] < 0:
            return False
        self._entry[block_id] = -1
        self._live -= 1
        return True

    def pop(self) -> int:
        heap, live, mask = self._heap, self._entry, self._mask
        while heap:
            entry = _heappop(heap)
            block_id = entry & mask
            if live[block_id] == entry:
                live[block_id] = -1
                self._live -= 1
                return block_id
        return -1

    def peek(self) -> int:
        heap, live, mask = self._heap, self._entry, self._mask
        while heap:
            entry = heap[0]
            if live[entry & mask] == entry:
                return entry & mask
            _heappop(heap)
        return -1

    def __len__(self) -> int:
        return self._live

    def __contains__(self, block_id: object) -> bool:
        return isinstance(block_id, int) and self._entry[block_id] >= 0


class KeyedRank(_IntHeap, BlockRank):
    """A sort-key policy whose key is ``(class, last_access_time)``: ``lru`` (class 0), ``lfu``
    (the hit count), ``slru`` (protected or not), ``priority`` (vLLM blocks have priority 0).

    ``last_access_time`` differs between blocks (each free ticks the clock), so the policies'
    ``node_id`` tie-break never decides and ``class << 64 | last`` orders exactly as their keys.
    The class is ``min(hits, cap) // div``: ``lru`` (0, 1), ``lfu`` (unbounded, 1), ``slru``
    (``protected_hits`` twice).
    """

    __slots__ = ("_cap", "_div", "_hits", "_last", "kind")

    def __init__(self, table: BlockTable, kind: str, protected_hits: int = 1) -> None:
        super().__init__(len(table.last))
        self._last, self._hits = table.last, table.hits
        self.kind = kind
        self._cap, self._div = _keyed_class(kind, protected_hits)

    def add(self, block_id: int) -> None:
        hits, cap = self._hits[block_id], self._cap
        self.push(
            block_id, ((hits if hits < cap else cap) // self._div) << 64 | self._last[block_id]
        )

    def discard(self, block_id: int) -> None:
        entry = self._entry
        if entry[block_id] >= 0:
            entry[block_id] = -1
            self._live -= 1

    def pushpop(self, block_id: int) -> int:
        hits, cap, shift = self._hits[block_id], self._cap, self._shift
        key = ((hits if hits < cap else cap) // self._div) << 64 | self._last[block_id]
        entry = key << shift | block_id
        heap, live = self._heap, self._entry
        if live[block_id] < 0 and (not heap or entry < heap[0]):
            return block_id  # the next victim anyway (a chain walk): the heap is untouched
        if live[block_id] < 0:
            self._live += 1
        live[block_id] = entry
        mask = self._mask
        entry = _heappushpop(heap, entry)
        while live[entry & mask] != entry:
            entry = _heappop(heap)
        block_id = entry & mask
        live[block_id] = -1
        self._live -= 1
        return block_id


class S3FIFORank(BlockRank):
    """``s3fifo`` (:class:`~kvplug.policies.s3fifo.S3FIFOPolicy`) over block ids: the small and
    main FIFOs as integer heaps keyed by queue position, the same promotions and second chances.
    """

    _S, _M = 1, 2

    def __init__(
        self, table: BlockTable, small_fraction: float, max_freq: int, ghost_entries: int
    ) -> None:
        n = len(table.last)
        self._table = table
        self._small, self._main = _IntHeap(n), _IntHeap(n)
        self._small_tokens = self._main_tokens = 0
        self._stamp = [-1] * n  # the content (``created``) the state below describes
        self._queue = [0] * n
        self._position = [0] * n
        self._freq = [0] * n
        self._seen_hits = [0] * n
        self._clock = 0
        self._fraction = small_fraction
        self._max_freq = max_freq
        self._ghosts: OrderedDict[Any, None] = OrderedDict()  # contents evicted, oldest first
        self._ghost_entries = ghost_entries

    def _leave(self, block_id: int) -> None:
        if self._queue[block_id] == self._S:
            if self._small.remove(block_id):
                self._small_tokens -= self._table.tokens[block_id]
        elif self._main.remove(block_id):
            self._main_tokens -= self._table.tokens[block_id]

    def _to_main_tail(self, block_id: int, freq: int) -> None:
        """Re-queue at M's tail with ``freq`` hits left (``block_id`` has left its queue)."""
        self._clock += 1
        self._queue[block_id], self._position[block_id] = self._M, self._clock
        self._freq[block_id] = freq
        self._main.push(block_id, self._clock)
        self._main_tokens += self._table.tokens[block_id]

    def add(self, block_id: int) -> None:
        table = self._table
        hits = table.hits[block_id]
        if self._stamp[block_id] != table.created[block_id]:  # new content: S's or M's tail
            self._stamp[block_id] = table.created[block_id]
            self._clock += 1
            queue = self._S
            ghosts = self._ghosts
            if ghosts and table.content[block_id] in ghosts:  # evicted before: straight to M
                del ghosts[table.content[block_id]]
                queue = self._M
            self._queue[block_id] = queue
            self._position[block_id] = self._clock
            self._freq[block_id] = 0
        else:
            if hits > self._seen_hits[block_id] and self._freq[block_id] < self._max_freq:
                self._freq[block_id] += 1  # reused since last seen (one step, as on_hit)
            self._leave(block_id)
        self._seen_hits[block_id] = hits
        if self._queue[block_id] == self._S:
            self._small.push(block_id, self._position[block_id])
            self._small_tokens += table.tokens[block_id]
        else:
            self._main.push(block_id, self._position[block_id])
            self._main_tokens += table.tokens[block_id]

    def discard(self, block_id: int) -> None:
        if self._stamp[block_id] == self._table.created[block_id]:
            self._leave(block_id)

    def _victim(self, remove: bool) -> int:
        small, main, freq = self._small, self._main, self._freq
        tokens = self._table.tokens
        while True:
            if small._live and (
                self._small_tokens > self._fraction * (self._small_tokens + self._main_tokens)
                or not main._live
            ):
                block_id = small.peek()
                if freq[block_id] > 0:  # reused while in S: promote to M
                    small.remove(block_id)
                    self._small_tokens -= tokens[block_id]
                    self._to_main_tail(block_id, 0)
                    continue
                if remove:
                    small.remove(block_id)
                    self._small_tokens -= tokens[block_id]
            else:
                block_id = main.peek()
                if block_id < 0:
                    return -1
                if freq[block_id] > 0:  # second chance: back to M's tail
                    main.remove(block_id)
                    self._main_tokens -= tokens[block_id]
                    self._to_main_tail(block_id, freq[block_id] - 1)
                    continue
                if remove:
                    main.remove(block_id)
                    self._main_tokens -= tokens[block_id]
            if remove:
                self._stamp[block_id] = -1  # evicted: its state goes, its ghost stays
                _leave_ghost(self._ghosts, self._table.content[block_id], None, self._ghost_entries)
            return block_id

    def pop(self) -> int:
        return self._victim(True)

    def peek(self) -> int:
        return self._victim(False)

    def queue_of(self, block_id: int) -> str:
        """``"small"`` or ``"main"`` (for tests and debugging)."""
        return "small" if self._queue[block_id] == self._S else "main"

    def __len__(self) -> int:
        return self._small._live + self._main._live

    def __contains__(self, block_id: object) -> bool:
        return block_id in self._small or block_id in self._main


class ARCRank(BlockRank):
    """``arc`` (:class:`~kvplug.policies.arc.ARCPolicy`) over block ids: T1 (seen once) and T2
    (reused, or returning content) in LRU order, T1 evicted while it holds more than ``p``
    tokens; the ghost of returning content (its block hash, evicted from T1 or T2) adapts ``p``
    as in the policy.
    """

    def __init__(
        self, table: BlockTable, initial_recency_fraction: float, ghost_entries: int
    ) -> None:
        n = len(table.last)
        self._table = table
        self._t1, self._t2 = _IntHeap(n), _IntHeap(n)
        self._t1_tokens = self._t2_tokens = 0
        self._stamp = [-1] * n
        self._in_t2 = bytearray(n)
        self._seen_hits = [0] * n
        self._fraction = initial_recency_fraction
        self._capacity = 0
        self._ghosts: OrderedDict[Any, int] = OrderedDict()  # content evicted -> from T2
        self._ghost_entries = ghost_entries
        self._b1 = self._b2 = 0.0  # decayed tokens evicted from T1 and from T2
        self.p = 0.0
        """Target tokens of T1 (adapted on ghost hits)."""

    def _leave(self, block_id: int) -> None:
        if self._in_t2[block_id]:
            if self._t2.remove(block_id):
                self._t2_tokens -= self._table.tokens[block_id]
        elif self._t1.remove(block_id):
            self._t1_tokens -= self._table.tokens[block_id]

    def add(self, block_id: int) -> None:
        table = self._table
        hits = table.hits[block_id]
        if self._stamp[block_id] != table.created[block_id]:  # new content: T1, T2 if returning
            self._stamp[block_id] = table.created[block_id]
            ghosts = self._ghosts
            if ghosts and table.content[block_id] in ghosts:
                size, b1, b2 = table.tokens[block_id], self._b1, self._b2
                if ghosts.pop(table.content[block_id]):  # from T2: shrink T1's target
                    self.p = max(0.0, self.p - size * max(1.0, b1 / max(b2, 1.0)))
                else:  # from T1: recency was cut too short
                    self.p = min(float(self._capacity), self.p + size * max(1.0, b2 / max(b1, 1.0)))
                self._in_t2[block_id] = 1
            else:
                self._in_t2[block_id] = 0
        else:
            self._leave(block_id)
            if hits > self._seen_hits[block_id]:
                self._in_t2[block_id] = 1  # reused: the frequency list
        self._seen_hits[block_id] = hits
        tokens = table.tokens[block_id]
        if self._in_t2[block_id]:
            self._t2.push(block_id, table.last[block_id])
            self._t2_tokens += tokens
        else:
            self._t1.push(block_id, table.last[block_id])
            self._t1_tokens += tokens
        total = self._t1_tokens + self._t2_tokens
        if total > self._capacity:
            if self._capacity == 0:
                self.p = self._fraction * total
            self._capacity = total

    def discard(self, block_id: int) -> None:
        if self._stamp[block_id] == self._table.created[block_id]:
            self._leave(block_id)

    def _side(self) -> _IntHeap:
        t1 = self._t1
        return t1 if t1._live and (self._t1_tokens > self.p or not self._t2._live) else self._t2

    def pop(self) -> int:
        side = self._side()
        block_id = side.pop()
        if block_id >= 0:
            table = self._table
            tokens = table.tokens[block_id]
            self._b1 *= 0.999  # ghosts are bounded: old evictions fade
            self._b2 *= 0.999
            if side is self._t1:
                self._t1_tokens -= tokens
                self._b1 += tokens
            else:
                self._t2_tokens -= tokens
                self._b2 += tokens
            self._stamp[block_id] = -1
            # its ghost, tagged with the list it left
            _leave_ghost(
                self._ghosts, table.content[block_id], self._in_t2[block_id], self._ghost_entries
            )
        return block_id

    def peek(self) -> int:
        return self._side().peek()

    def recency_tokens(self) -> int:
        """Candidate tokens in T1 now."""
        return self._t1_tokens

    def __len__(self) -> int:
        return self._t1._live + self._t2._live

    def __contains__(self, block_id: object) -> bool:
        return block_id in self._t1 or block_id in self._t2


class PolicyRank(BlockRank):
    """Any kvplug policy, through its own methods on one :class:`BlockStats` object per block
    (renewed in place for new content); what runs for policies without a rank of their own.

    New content joins a :class:`~kvplug_hookspecs.FeedbackEvictionPolicy` through its
    ``insert`` (its ghosts are matched by the block hash, and what it knew of the block's old
    content goes); a block the policy evicted gets a new object if it holds new content before
    the policy has left the old content's ghost (at its next call).
    """

    def __init__(self, table: BlockTable, policy: EvictionPolicy, blocks: list[Any]) -> None:
        self._table = table
        self.policy = policy
        self._blocks = blocks
        self._stats: list[BlockStats | None] = [None] * len(blocks)
        self._stamp = [0] * len(blocks)
        self._joined = [0] * len(blocks)  # the content (``created``) last offered to the policy
        self._popped: BlockStats | None = None  # the last victim (its ghost may be pending)
        self._insert = policy.insert if isinstance(policy, FeedbackEvictionPolicy) else None

    def stats(self, block_id: int) -> BlockStats | None:
        """The policy's candidate object for the block, brought up to date with the table."""
        table = self._table
        created = table.created[block_id]
        if not created:
            return None
        stats = self._stats[block_id]
        if stats is None or (stats is self._popped and self._stamp[block_id] != created):
            stats = self._stats[block_id] = BlockStats(block_id, created, 0)
            self._popped = None
        if self._stamp[block_id] != created:  # new content: new lifetime
            self._stamp[block_id] = created
            table.describe(stats, self._blocks[block_id])
        stats.last_access_time = table.last[block_id]
        stats.hit_count = table.hits[block_id]
        return stats

    def add(self, block_id: int) -> None:
        stats = self.stats(block_id)
        created = self._table.created[block_id]
        if self._insert is not None and self._joined[block_id] != created:
            self._joined[block_id] = created
            self._insert(stats)  # type: ignore[arg-type]
        else:
            self.policy.add(stats)  # type: ignore[arg-type]

    def discard(self, block_id: int) -> None:
        stats = self._stats[block_id]
        if stats is not None:
            self.policy.discard(stats)

    def pop(self) -> int:
        stats: Any = self.policy.pop()
        if stats is None:
            return -1
        self._popped = stats
        block_id: int = stats.block_id
        return block_id

    def peek(self) -> int:
        stats = self.policy.peek()
        return -1 if stats is None else stats.block_id  # type: ignore[attr-defined]

    def __len__(self) -> int:
        return len(self.policy)

    def __contains__(self, block_id: object) -> bool:
        if not isinstance(block_id, int):
            return False
        stats = self._stats[block_id]
        return stats is not None and stats in self.policy


def _keyed_class(kind: str, protected_hits: int) -> tuple[int, int]:
    """``(cap, div)`` of a keyed rank's class ``min(hits, cap) // div``."""
    caps = {"lru": (0, 1), "lfu": (1 << 62, 1), "slru": (protected_hits, protected_hits)}
    return caps[kind]


def keyed_rank(table: BlockTable, kind: str, protected_hits: int = 1) -> BlockRank:
    """A :class:`KeyedRank`, or the compiled ``BlockHeap`` keyed the same way (from the same
    lists) while the compiled kernels are in use."""
    native = speedups.native_type("BlockHeap")
    if native is None:
        return KeyedRank(table, kind, protected_hits)
    cap, div = _keyed_class(kind, protected_hits)
    rank: BlockRank = native(table.last, table.hits, cap, div)
    return rank


def _table_lists(table: BlockTable) -> tuple[list[Any], ...]:
    """The lists a compiled rank reads (it keeps them: the table changes them in place)."""
    return table.hits, table.created, table.content, table.tokens, table.last


def rank_for(policy: EvictionPolicy, table: BlockTable) -> BlockRank | None:
    """The rank that orders blocks exactly as ``policy`` does, or ``None`` (exact classes only:
    a subclass may change the key or the feedback). While the compiled kernels are in use, the
    built-in ranks are their compiled versions (``kvplug._speedups``: the same choices)."""
    kind = type(policy)
    if kind is LRUPolicy or kind is PriorityPolicy:
        return keyed_rank(table, "lru")
    if kind is LFUPolicy:
        return keyed_rank(table, "lfu")
    options: Any = getattr(policy, "options", None)
    if kind is SLRUPolicy:
        return keyed_rank(table, "slru", options.protected_hits)
    if kind is S3FIFOPolicy:
        native = speedups.native_type("S3FIFORank")
        if native is None:
            return S3FIFORank(
                table, options.small_fraction, options.max_freq, options.ghost_entries
            )
        rank: BlockRank = native(
            *_table_lists(table), options.small_fraction, options.max_freq, options.ghost_entries
        )
        return rank
    if kind is ARCPolicy:
        native = speedups.native_type("ARCRank")
        if native is None:
            return ARCRank(table, options.initial_recency_fraction, options.ghost_entries)
        rank = native(*_table_lists(table), options.initial_recency_fraction, options.ghost_entries)
        return rank
    return None
