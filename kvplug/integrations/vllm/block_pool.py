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
default) the pool therefore keeps vLLM's queue as it is (:class:`VllmOrderQueue`): the block
ids and the removal events are vLLM's in every free order, at vLLM's cost.

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

The pool and its queue are converted in place (``install_policy``), so every object already
holding them (managers, connectors) sees the policy.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue, KVCacheBlock

from kvplug_hookspecs import CandidateStats, EvictionPolicy

from ...policies.builtin import LRUPolicy

__all__ = [
    "BlockStats",
    "PolicyFreeBlockQueue",
    "VllmOrderQueue",
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


def follows_vllm_order(policy: EvictionPolicy) -> bool:
    """Whether vLLM's own free list already ranks free cached blocks as ``policy`` does.

    True for kvplug's ``LRUPolicy`` itself (not a subclass, which may change the key): its key
    is the time a block was last freed, and vLLM appends cached blocks to its list as they are
    freed and takes from the head.
    """
    return type(policy) is LRUPolicy


class VllmOrderQueue(FreeKVCacheBlockQueue):  # type: ignore[misc]
    """vLLM's free-block list, unchanged, under a policy it already implements (``lru`` without
    chain protection): every operation is vLLM's own, no statistics are kept."""

    _policy: EvictionPolicy

    @classmethod
    def adopt(cls, queue: FreeKVCacheBlockQueue, policy: EvictionPolicy) -> VllmOrderQueue:
        """Turn vLLM's queue into this class in place (nothing else changes)."""
        queue.__class__ = cls
        assert isinstance(queue, cls)
        queue._policy = policy
        return queue

    @property
    def policy(self) -> EvictionPolicy:
        """The kvplug policy this list's order implements."""
        return self._policy


class PolicyFreeBlockQueue(FreeKVCacheBlockQueue):  # type: ignore[misc]
    """vLLM's free-block list, where a kvplug policy chooses among the free cached blocks.

    ``_tracked[b]`` is 1 while block ``b`` sits in the list as a cached block appended by a free
    (the policy's domain); the policy holds the tracked blocks that are chain leaves.
    """

    _blocks: list[KVCacheBlock]
    _policy: EvictionPolicy
    _stats: list[BlockStats | None]
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
        """Turn vLLM's queue into this class in place; cached free blocks join in list order."""
        queue.__class__ = cls
        assert isinstance(queue, cls)
        n = len(blocks)
        queue._blocks = blocks
        queue._policy = policy
        queue._stats = [None] * n
        queue._tracked = bytearray(n)
        queue._parent = [-1] * n
        queue._parent_gen = [0] * n
        queue._gen = [0] * n
        queue._num_children = [0] * n
        queue._clock = 0
        for block in queue.get_all_free_blocks():
            queue._track(block)  # a cached free block joins with fresh statistics
        return queue

    @property
    def policy(self) -> EvictionPolicy:
        """The kvplug policy ranking the free cached leaves."""
        return self._policy

    def stats(self, block_id: int) -> BlockStats | None:
        """The statistics of a block's cached content (``None`` if it was never cached)."""
        return self._stats[block_id]

    def _stat(self, block_id: int) -> BlockStats:
        stats = self._stats[block_id]
        assert stats is not None, f"block {block_id} is tracked without statistics"
        return stats

    def is_leaf(self, block_id: int) -> bool:
        """No cached block continues this block's chain (evicting it orphans nothing)."""
        return not self._num_children[block_id]

    # -- vLLM's queue operations --------------------------------------------------------------

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
        head, tracked, policy, blocks = (
            self.fake_free_list_head,
            self._tracked,
            self._policy,
            self._blocks,
        )
        parent_of, parent_gen, gen, num_children = (
            self._parent,
            self._parent_gen,
            self._gen,
            self._num_children,
        )
        taken = []
        for _ in range(n):
            victim = head.next_free_block
            if tracked[victim.block_id]:
                stats = policy.pop()
                if stats is not None:
                    victim = blocks[stats.block_id]  # type: ignore[attr-defined]
                tracked[victim.block_id] = 0
            # unlink from vLLM's list (what its remove() does, without the call)
            before, after = victim.prev_free_block, victim.next_free_block
            before.next_free_block = after
            after.prev_free_block = before
            victim.prev_free_block = victim.next_free_block = None
            # vLLM evicts every taken block's hash right after: its parent is a leaf already.
            parent_id = parent_of[victim.block_id]
            if parent_id >= 0:
                parent_of[victim.block_id] = -1
                if parent_gen[victim.block_id] == gen[parent_id]:
                    num_children[parent_id] -= 1
                    if not num_children[parent_id] and tracked[parent_id]:
                        policy.add(self._stat(parent_id))
            taken.append(victim)
        self.num_free_blocks -= n
        return taken

    def remove(self, block: KVCacheBlock) -> None:
        super().remove(block)
        self._untrack(block.block_id)

    def append(self, block: KVCacheBlock) -> None:
        super().append(block)
        self._track(block)

    def append_n(self, blocks: list[KVCacheBlock]) -> None:
        super().append_n(blocks)
        for block in blocks:
            self._track(block)

    # prepend_n is vLLM's: prepended blocks (unhashed or evict-first) are reused first, untracked.

    # -- bookkeeping -----------------------------------------------------------------------------

    def _track(self, block: KVCacheBlock) -> None:
        block_hash = block.block_hash
        if block_hash is None:
            return  # unhashed: reused in vLLM's order
        block_id = block.block_id
        stats = self._stats[block_id]
        if stats is None or stats.content_id != hash(block_hash):
            stats = self._renew(block)
        self._tracked[block_id] = 1
        self._clock += 1
        stats.last_access_time = self._clock
        if not self._num_children[block_id]:
            self._policy.add(stats)

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
        stats.content_id = hash(block.block_hash)  # bytes cache their hash: free after lookups
        stats.new_tokens = num_tokens
        return stats

    def _untrack(self, block_id: int) -> None:
        if self._tracked[block_id]:
            self._tracked[block_id] = 0
            self._policy.discard(self._stat(block_id))

    def keep_in_place(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Leave these free blocks where vLLM put them (unpinned last-resort blocks)."""
        for block in blocks:
            self._untrack(block.block_id)

    def on_cached(
        self, blocks: Sequence[KVCacheBlock], start: int, end: int, num_tokens: int, chained: bool
    ) -> None:
        """vLLM cached ``blocks[start:end]`` (new content, a request's chain): each starts a new
        lifetime; in a chained group each is linked under the block before it."""
        parent_of, parent_gen, gen = self._parent, self._parent_gen, self._gen
        num_children, tracked = self._num_children, self._tracked
        for i in range(start, min(end, len(blocks))):
            block = blocks[i]
            block_hash = block.block_hash
            if block.is_null or block_hash is None:
                continue
            block_id = block.block_id
            self._renew(block, num_tokens)
            if parent_of[block_id] >= 0:
                self._unlink(block_id)
            parent = blocks[i - 1] if chained and i > 0 else None
            if parent is not None and not parent.is_null and parent.block_hash is not None:
                parent_id = parent.block_id
                parent_of[block_id] = parent_id
                parent_gen[block_id] = gen[parent_id]
                num_children[parent_id] += 1
                if num_children[parent_id] == 1 and tracked[parent_id]:
                    self._policy.discard(self._stat(parent_id))

    def on_hits(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Requests reused these cached blocks (vLLM touched them when admitting a request)."""
        stats_of = self._stats
        for block in blocks:
            block_hash = block.block_hash
            if block_hash is not None:
                stats = stats_of[block.block_id]
                if stats is None or stats.content_id != hash(block_hash):
                    stats = self._renew(block)
                self._clock += 1
                stats.hit_count += 1
                stats.last_access_time = self._clock

    def on_hash_removed(self, block: KVCacheBlock) -> None:
        """``block`` lost its hashes: its parent may become a leaf, its children are unlinked."""
        block_id = block.block_id
        if self._parent[block_id] >= 0:
            self._unlink(block_id)
        self._gen[block_id] += 1
        if self._num_children[block_id]:
            self._num_children[block_id] = 0
            if self._tracked[block_id]:
                self._policy.add(self._stat(block_id))

    def _unlink(self, block_id: int) -> None:
        parent_id = self._parent[block_id]
        if parent_id < 0:
            return
        self._parent[block_id] = -1
        if self._parent_gen[block_id] == self._gen[parent_id]:
            self._num_children[parent_id] -= 1
            if not self._num_children[parent_id] and self._tracked[parent_id]:
                self._policy.add(self._stat(parent_id))

    def on_reset(self) -> None:
        """vLLM dropped every hash (``reset_prefix_cache``): no chains remain."""
        for block_id, children in enumerate(self._num_children):
            if children and self._tracked[block_id]:
                self._policy.add(self._stat(block_id))
        n = len(self._blocks)
        self._parent = [-1] * n
        self._num_children = [0] * n
        self._gen = [gen + 1 for gen in self._gen]


class _PolicyBlockPool:
    """Mixed in before vLLM's ``BlockPool`` class: reports hits, new cached blocks, lost hashes
    and resets to the policy queue. Every method calls vLLM's first, so vLLM's state is updated
    before the policy sees the change."""

    free_block_queue: PolicyFreeBlockQueue
    _kvplug_chain_groups: frozenset[int]

    def touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        super().touch(blocks)  # type: ignore[misc]
        self.free_block_queue.on_hits(blocks)

    def cache_full_blocks(
        self,
        request: Any,
        blocks: list[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        kv_cache_group_id: int,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        super().cache_full_blocks(  # type: ignore[misc]
            request,
            blocks,
            num_cached_blocks,
            num_full_blocks,
            block_size,
            kv_cache_group_id,
            *args,
            **kwargs,
        )
        chained = kv_cache_group_id in self._kvplug_chain_groups
        self.free_block_queue.on_cached(
            blocks, num_cached_blocks, num_full_blocks, block_size, chained
        )

    def _remove_cached_block_hashes(self, block: KVCacheBlock) -> Any:
        had_hash = block.block_hash is not None
        removed = super()._remove_cached_block_hashes(block)  # type: ignore[misc]
        if had_hash:
            self.free_block_queue.on_hash_removed(block)
        return removed

    def unpin_blocks(self, blocks: Iterable[KVCacheBlock], on_reuse: Any) -> None:
        blocks = list(blocks)
        super().unpin_blocks(blocks, on_reuse)  # type: ignore[misc]
        self.free_block_queue.keep_in_place(block for block in blocks if block.ref_cnt == 0)

    def reset_prefix_cache(self) -> bool:
        done: bool = super().reset_prefix_cache()  # type: ignore[misc]
        if done:
            self.free_block_queue.on_reset()
        return done


_pool_classes: dict[type, type] = {}


def _policy_pool_class(base: type) -> type:
    cls = _pool_classes.get(base)
    if cls is None:
        cls = type(f"Kvplug{base.__name__}", (_PolicyBlockPool, base), {"__module__": __name__})
        _pool_classes[base] = cls
    return cls


def install_policy(
    block_pool: BlockPool,
    policy: EvictionPolicy,
    *,
    chain_group_ids: Iterable[int] = (0,),
    chain_protection: bool | None = None,
) -> PolicyFreeBlockQueue | VllmOrderQueue:
    """Let ``policy`` choose which free cached block of ``block_pool`` is evicted.

    ``chain_group_ids`` are the KV-cache groups whose blocks form prefix chains (full attention).
    With ``chain_protection`` their blocks are offered to the policy only as chain leaves; the
    default (``None``) is on for every policy except ``lru``, which keeps vLLM's order in every
    free order. A policy vLLM's list already implements (:func:`follows_vllm_order`) without
    protection leaves the pool and its list as vLLM's (a :class:`VllmOrderQueue`). Install
    before the pool serves requests: blocks cached earlier join without chain links. Returns the
    pool's queue.
    """
    if installed_policy(block_pool) is not None:
        raise ValueError("this BlockPool already has a kvplug eviction policy")
    if not isinstance(policy, EvictionPolicy):
        raise TypeError(f"policy must be a kvplug EvictionPolicy, got {type(policy).__name__}")
    native = follows_vllm_order(policy)
    if chain_protection is None:
        chain_protection = not native
    if native and not chain_protection:
        return VllmOrderQueue.adopt(block_pool.free_block_queue, policy)
    block_pool.__class__ = _policy_pool_class(type(block_pool))
    block_pool._kvplug_chain_groups = frozenset(chain_group_ids if chain_protection else ())
    return PolicyFreeBlockQueue.adopt(block_pool.free_block_queue, block_pool.blocks, policy)


def installed_policy(block_pool: BlockPool) -> EvictionPolicy | None:
    """The kvplug policy of a pool, or ``None`` when the pool runs vLLM's own order."""
    queue = block_pool.free_block_queue
    if isinstance(queue, (PolicyFreeBlockQueue, VllmOrderQueue)):
        return queue.policy
    return None
