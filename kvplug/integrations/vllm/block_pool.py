"""A kvplug eviction policy inside vLLM's ``BlockPool``: it picks which free cached block goes.

vLLM keeps every free block in one intrusive doubly linked list (``FreeKVCacheBlockQueue``).
Blocks freed without a hash, and cached blocks freed with ``evict_first``, are prepended and
reused first; cached blocks are appended, and taking from the head makes eviction LRU. We keep
that list, the hash map, the ref counts and ``num_free_blocks`` exactly as vLLM maintains them
and change one decision: when the block at the head is a cached block appended by a free, the
policy names the cached free block that leaves instead. Blocks vLLM put elsewhere (unhashed,
evict-first, unpinned last-resort blocks) keep vLLM's order.

``lru`` is vLLM's own order: the cached blocks appended by frees sit in the list in the order
they were freed, so the head is the least recently used one. Without chain protection (lru's
default) the pool and its queue stay exactly vLLM's: the block ids and the removal events are
vLLM's in every free order, at vLLM's cost.

Statistics live in a side table indexed by block id (vLLM's blocks are slotted): one
:class:`BlockStats` per block, renewed whenever the block holds new content (vLLM caches it), a
hit counted when a request reuses it (``BlockPool.touch``), its recency set when it is freed.

Chains: vLLM finds a prefix by walking block hashes from the first block, so evicting a block
whose successor is still cached orphans the successor (cached, unreachable). With chain
protection (every policy but ``lru`` by default) a full-attention group's blocks are only
offered to the policy while they have no cached successor (leaves); a block becomes a candidate
when its last cached successor loses its hash. vLLM frees a request's blocks tail first, so
protection changes nothing for LRU then; a caller that frees a chain head first (vLLM's own
``free_blocks`` allows any order) gets the leaf before its parent, unlike vLLM, which is why
``lru`` leaves it off. If every free cached block is a non-leaf (possible only when a successor
is in use and its predecessor free), the head of vLLM's list is taken, as vLLM would.

``install_policy`` gives the pool a :class:`PolicyFreeBlockQueue` holding vLLM's list and sets
its hooks on the pool object itself (its class stays vLLM's), so every object already holding
the pool (managers, connectors) sees the policy.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, TypeVar

from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue, KVCacheBlock

from kvplug_hookspecs import CandidateStats, EvictionPolicy

from ...policies.builtin import LRUPolicy

__all__ = [
    "BlockStats",
    "PolicyFreeBlockQueue",
    "follows_vllm_order",
    "install_policy",
    "installed_policy",
]


class BlockStats(CandidateStats):
    """The statistics of a vLLM block's cached content (``block_id`` finds the block).

    One object per block id, reset when the block caches new content (its previous content was
    evicted, so no policy holds it): ``node_id`` names the block slot, ``content_id`` the content
    (the hash of vLLM's block hash, stable within the process).
    """

    __slots__ = ("block_id",)

    def __init__(self, block_id: int, now: int, num_tokens: int) -> None:
        super().__init__(now, num_tokens=num_tokens)
        self.block_id = block_id


_Q = TypeVar("_Q")
_base_remove = FreeKVCacheBlockQueue.remove
_base_append_n = FreeKVCacheBlockQueue.append_n


def _copy_as(cls: type[_Q], source: object) -> _Q:
    """A new ``cls`` object with ``source``'s attributes. Setting them one by one keeps
    CPython's compact instance layout, which assigning ``__class__`` loses (every attribute
    load on the object would then cost about 60 % more, and vLLM's list walks load many)."""
    obj = object.__new__(cls)
    for name, value in vars(source).items():
        setattr(obj, name, value)
    return obj


def follows_vllm_order(policy: EvictionPolicy) -> bool:
    """Whether vLLM's own free list already ranks free cached blocks as ``policy`` does.

    True for kvplug's ``LRUPolicy`` itself (not a subclass, which may change the key): its key
    is the time a block was last freed, and vLLM appends cached blocks to its list as they are
    freed and takes from the head.
    """
    return type(policy) is LRUPolicy


class PolicyFreeBlockQueue(FreeKVCacheBlockQueue):  # type: ignore[misc]
    """vLLM's free-block list, where a kvplug policy chooses among the free cached blocks.

    ``_tracked[b]`` is 1 while block ``b`` sits in the list as a cached block appended by a free
    (the policy's domain); the policy holds the tracked blocks that are chain leaves.
    """

    _blocks: list[KVCacheBlock]
    _policy: EvictionPolicy
    _stats: list[BlockStats | None]
    _content: list[Any]
    _tracked: bytearray
    _parent: list[int]
    _parent_gen: list[int]
    _gen: list[int]
    _num_children: list[int]
    _clock: int

    @classmethod
    def adopt(
        cls, queue: FreeKVCacheBlockQueue, blocks: list[KVCacheBlock], policy: EvictionPolicy
    ) -> PolicyFreeBlockQueue:
        """A queue of this class holding vLLM's list (``queue``'s attributes, set one by one);
        cached free blocks join in list order. The pool must use it in place of ``queue``."""
        new: PolicyFreeBlockQueue = _copy_as(cls, queue)
        queue = new
        n = len(blocks)
        queue._blocks = blocks
        queue._policy = policy
        queue._stats = [None] * n
        queue._content = [None] * n
        queue._tracked = bytearray(n)
        queue._parent = [-1] * n
        queue._parent_gen = [0] * n
        queue._gen = [0] * n
        queue._num_children = [0] * n
        queue._clock = 0
        free = queue.get_all_free_blocks()
        queue._track_free([b for b in free if b.block_hash is not None])
        return new

    @property
    def policy(self) -> EvictionPolicy:
        """The kvplug policy ranking the free cached leaves."""
        return self._policy

    def stats(self, block_id: int) -> BlockStats | None:
        """The statistics of a block's cached content (``None`` if it was never cached)."""
        return self._stats[block_id]

    def is_leaf(self, block_id: int) -> bool:
        """No cached block continues this block's chain (evicting it orphans nothing)."""
        return not self._num_children[block_id]

    # -- vLLM's queue operations --------------------------------------------------------------
    # Hot paths: locals instead of attribute lookups, vLLM's base methods called directly, no
    # helper call per block where a few lines do (each Python call costs as much as vLLM's own
    # per-block work).

    def popleft(self) -> KVCacheBlock:
        if not self.num_free_blocks:
            return super().popleft()  # vLLM's own error
        return self.popleft_n(1)[0]

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Take ``n`` blocks: vLLM's head while it is not a tracked cached block, else the
        policy's victim (the head again when the policy holds no leaf)."""
        if n == 0:
            return []
        assert self.num_free_blocks >= n
        head, tracked, blocks, stats_of = (
            self.fake_free_list_head,
            self._tracked,
            self._blocks,
            self._stats,
        )
        parent_of, parent_gen, gen, num_children = (
            self._parent,
            self._parent_gen,
            self._gen,
            self._num_children,
        )
        pop, add = self._policy.pop, self._policy.add
        taken: list[KVCacheBlock] = []
        keep = taken.append
        for _ in range(n):
            victim = head.next_free_block
            block_id = victim.block_id
            if tracked[block_id]:
                stats = pop()
                if stats is not None:
                    block_id = stats.block_id  # type: ignore[attr-defined]
                    victim = blocks[block_id]
                tracked[block_id] = 0
            # unlink from vLLM's list (what its remove() does, without the call)
            before, after = victim.prev_free_block, victim.next_free_block
            before.next_free_block = after
            after.prev_free_block = before
            victim.prev_free_block = victim.next_free_block = None
            # vLLM evicts every taken block's hash right after: its parent is a leaf already.
            parent_id = parent_of[block_id]
            if parent_id >= 0:
                parent_of[block_id] = -1
                if parent_gen[block_id] == gen[parent_id]:
                    left = num_children[parent_id] - 1
                    num_children[parent_id] = left
                    if not left and tracked[parent_id]:
                        add(stats_of[parent_id])
            keep(victim)
        self.num_free_blocks -= n
        return taken

    def remove(self, block: KVCacheBlock) -> None:
        _base_remove(self, block)
        block_id = block.block_id
        if self._tracked[block_id]:
            self._tracked[block_id] = 0
            self._policy.discard(self._stats[block_id])

    def append(self, block: KVCacheBlock) -> None:
        self.append_n([block])

    def append_n(self, blocks: list[KVCacheBlock]) -> None:
        """vLLM's append; each cached block joins the policy with its recency (a tick each)."""
        _base_append_n(self, blocks)
        self._track_free(blocks)

    def _track_free(self, blocks: list[KVCacheBlock]) -> None:
        """These blocks are in vLLM's list now: the cached ones join the policy (leaves only)."""
        stats_of, content, tracked, num_children = (
            self._stats,
            self._content,
            self._tracked,
            self._num_children,
        )
        add = self._policy.add
        clock = self._clock
        for block in blocks:
            block_hash = block.block_hash
            if block_hash is None:
                continue  # unhashed: reused in vLLM's order
            block_id = block.block_id
            if content[block_id] is not block_hash:
                self._clock = clock
                self._renew(block)
                clock = self._clock
            stats = stats_of[block_id]
            tracked[block_id] = 1
            clock += 1
            stats.last_access_time = clock
            if not num_children[block_id]:
                add(stats)
        self._clock = clock

    # prepend_n is vLLM's: prepended blocks (unhashed or evict-first) are reused first, untracked.

    # -- bookkeeping -----------------------------------------------------------------------------

    def _renew(self, block: KVCacheBlock, num_tokens: int = 0) -> BlockStats:
        """Fresh statistics for the block's current content: reuse the slot's object (its old
        content was evicted, so no policy holds it)."""
        block_id = block.block_id
        self._clock += 1
        stats: BlockStats | None = self._stats[block_id]
        if stats is None:
            stats = BlockStats(block_id, self._clock, num_tokens)
            self._stats[block_id] = stats
        else:
            stats.creation_time = stats.last_access_time = self._clock
            stats.hit_count = 0
            stats.num_tokens = num_tokens
        hash_tokens = block.block_hash_num_tokens
        stats.depth = max(hash_tokens - num_tokens, 0) if hash_tokens else 0
        block_hash = block.block_hash
        self._content[block_id] = block_hash
        stats.content_id = hash(block_hash)  # bytes cache their hash: free after lookups
        stats.new_tokens = num_tokens
        return stats

    def keep_in_place(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Leave these free blocks where vLLM put them (unpinned last-resort blocks)."""
        tracked, stats_of, discard = self._tracked, self._stats, self._policy.discard
        for block in blocks:
            block_id = block.block_id
            if tracked[block_id]:
                tracked[block_id] = 0
                discard(stats_of[block_id])

    def on_cached(
        self, blocks: Sequence[KVCacheBlock], start: int, end: int, num_tokens: int, chained: bool
    ) -> None:
        """vLLM cached ``blocks[start:end]`` (new content, a request's chain): each starts a new
        lifetime; in a chained group each is linked under the block before it."""
        parent_of, parent_gen, gen = self._parent, self._parent_gen, self._gen
        num_children, tracked, stats_of = self._num_children, self._tracked, self._stats
        content = self._content
        discard = self._policy.discard
        clock = self._clock
        parent = blocks[start - 1] if chained and 0 < start <= len(blocks) else None
        for i in range(start, min(end, len(blocks))):
            block = blocks[i]
            block_hash = block.block_hash
            if block.is_null or block_hash is None:
                parent = None
                continue
            block_id = block.block_id
            # fresh statistics for new content (what _renew does, inline)
            clock += 1
            stats = stats_of[block_id]
            if stats is None:
                stats = stats_of[block_id] = BlockStats(block_id, clock, num_tokens)
            else:
                stats.creation_time = stats.last_access_time = clock
                stats.hit_count = 0
                stats.num_tokens = num_tokens
            hash_tokens = block.block_hash_num_tokens
            depth = hash_tokens - num_tokens if hash_tokens else 0
            stats.depth = depth if depth > 0 else 0
            content[block_id] = block_hash
            stats.content_id = hash(block_hash)
            stats.new_tokens = num_tokens
            if parent_of[block_id] >= 0:
                self._unlink(block_id)
            if (
                chained
                and parent is not None
                and not parent.is_null
                and parent.block_hash is not None
            ):
                parent_id = parent.block_id
                parent_of[block_id] = parent_id
                parent_gen[block_id] = gen[parent_id]
                num_children[parent_id] += 1
                if num_children[parent_id] == 1 and tracked[parent_id]:
                    discard(stats_of[parent_id])
            parent = block
        self._clock = clock

    def on_hits(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Requests reused these cached blocks (vLLM touched them when admitting a request)."""
        for block in blocks:
            if block.block_hash is not None:
                stats = self._current_stats(block)
                self._clock += 1
                stats.hit_count += 1
                stats.last_access_time = self._clock

    def _current_stats(self, block: KVCacheBlock) -> BlockStats:
        """The statistics of the block's current content (renewed if it holds other content
        than they describe, e.g. its hashes were moved in from another block)."""
        stats: BlockStats | None = self._stats[block.block_id]
        if stats is None or self._content[block.block_id] is not block.block_hash:
            stats = self._renew(block)
        return stats

    def on_hash_removed(self, block: KVCacheBlock) -> None:
        """``block`` lost its hashes: its parent may become a leaf, its children are unlinked."""
        block_id = block.block_id
        if self._parent[block_id] >= 0:
            self._unlink(block_id)
        self._gen[block_id] += 1
        if self._num_children[block_id]:
            self._num_children[block_id] = 0
            if self._tracked[block_id]:
                self._policy.add(self._stats[block_id])

    def _unlink(self, block_id: int) -> None:
        parent_id = self._parent[block_id]
        if parent_id < 0:
            return
        self._parent[block_id] = -1
        if self._parent_gen[block_id] == self._gen[parent_id]:
            self._num_children[parent_id] -= 1
            if not self._num_children[parent_id] and self._tracked[parent_id]:
                self._policy.add(self._stats[parent_id])  # type: ignore[arg-type]

    def on_reset(self) -> None:
        """vLLM dropped every hash (``reset_prefix_cache``): no chains remain."""
        for block_id, children in enumerate(self._num_children):
            if children and self._tracked[block_id]:
                self._policy.add(self._stats[block_id])  # type: ignore[arg-type]
        n = len(self._blocks)
        self._parent = [-1] * n
        self._num_children = [0] * n
        self._gen = [gen + 1 for gen in self._gen]


def _hook_pool(block_pool: BlockPool, queue: PolicyFreeBlockQueue, chains: frozenset[int]) -> None:
    """Report hits, new cached blocks, lost hashes and resets of ``block_pool`` to ``queue``.

    Each hook is set on the pool object (its class stays vLLM's, so every object holding the
    pool sees them and attribute loads stay fast) and calls vLLM's method first, so vLLM's
    state is updated before the policy sees the change.
    """
    cls = type(block_pool)
    base_touch = cls.touch.__get__(block_pool)
    base_cache_full_blocks = cls.cache_full_blocks.__get__(block_pool)
    base_remove_hashes = cls._remove_cached_block_hashes.__get__(block_pool)
    base_unpin_blocks = cls.unpin_blocks.__get__(block_pool)
    base_reset_prefix_cache = cls.reset_prefix_cache.__get__(block_pool)
    on_hits, on_cached, on_hash_removed = queue.on_hits, queue.on_cached, queue.on_hash_removed

    def touch(blocks: Sequence[KVCacheBlock]) -> None:
        base_touch(blocks)
        on_hits(blocks)

    def cache_full_blocks(
        request: Any,
        blocks: list[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        kv_cache_group_id: int,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        base_cache_full_blocks(
            request,
            blocks,
            num_cached_blocks,
            num_full_blocks,
            block_size,
            kv_cache_group_id,
            *args,
            **kwargs,
        )
        chained = kv_cache_group_id in chains
        on_cached(blocks, num_cached_blocks, num_full_blocks, block_size, chained)

    def _remove_cached_block_hashes(block: KVCacheBlock) -> Any:  # once per evicted block
        if block.block_hash is None:
            return base_remove_hashes(block)
        removed = base_remove_hashes(block)
        on_hash_removed(block)
        return removed

    def unpin_blocks(blocks: Iterable[KVCacheBlock], on_reuse: Any) -> None:
        blocks = list(blocks)
        base_unpin_blocks(blocks, on_reuse)
        queue.keep_in_place(block for block in blocks if block.ref_cnt == 0)

    def reset_prefix_cache() -> bool:
        done: bool = base_reset_prefix_cache()
        if done:
            queue.on_reset()
        return done

    hooks = (touch, cache_full_blocks, _remove_cached_block_hashes, unpin_blocks)
    for hook in (*hooks, reset_prefix_cache):
        setattr(block_pool, hook.__name__, hook)


def install_policy(
    block_pool: BlockPool,
    policy: EvictionPolicy,
    *,
    chain_group_ids: Iterable[int] = (0,),
    chain_protection: bool | None = None,
) -> FreeKVCacheBlockQueue:
    """Let ``policy`` choose which free cached block of ``block_pool`` is evicted.

    ``chain_group_ids`` are the KV-cache groups whose blocks form prefix chains (full attention).
    With ``chain_protection`` their blocks are offered to the policy only as chain leaves; the
    default (``None``) is on for every policy except ``lru``, which keeps vLLM's order in every
    free order. A policy vLLM's list already implements (:func:`follows_vllm_order`) without
    protection leaves the pool and its list exactly as vLLM's: nothing runs per block. Otherwise
    the pool's list becomes a :class:`PolicyFreeBlockQueue`. Install before the pool serves
    requests: blocks cached earlier join without chain links. Returns the pool's queue.
    """
    if installed_policy(block_pool) is not None:
        raise ValueError("this BlockPool already has a kvplug eviction policy")
    if not isinstance(policy, EvictionPolicy):
        raise TypeError(f"policy must be a kvplug EvictionPolicy, got {type(policy).__name__}")
    native = follows_vllm_order(policy)
    if chain_protection is None:
        chain_protection = not native
    if chain_protection or not native:
        chains = frozenset(chain_group_ids if chain_protection else ())
        queue = PolicyFreeBlockQueue.adopt(block_pool.free_block_queue, block_pool.blocks, policy)
        block_pool.free_block_queue = queue
        _hook_pool(block_pool, queue, chains)
        block_pool._kvplug_chain_groups = chains
    block_pool._kvplug_policy = policy
    return block_pool.free_block_queue


def installed_policy(block_pool: BlockPool) -> EvictionPolicy | None:
    """The kvplug policy of a pool, or ``None`` when the pool runs vLLM's own order."""
    return getattr(block_pool, "_kvplug_policy", None)
