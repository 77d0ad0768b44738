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

Statistics live in per-block lists indexed by block id (vLLM's blocks are slotted,
:class:`~.ranks.BlockTable`): renewed whenever the block holds new content (vLLM caches it), a
hit counted when a request reuses it (``BlockPool.touch``), its recency set when it is freed.
The built-in policies rank block ids over those lists (:mod:`.ranks`, the policies' exact
orders at a fraction of their per-object cost); any other policy gets one candidate object per
block through its own methods.

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

from ... import speedups
from ...policies.builtin import LRUPolicy
from .ranks import BlockRank, BlockStats, BlockTable, PolicyRank, rank_for

__all__ = [
    "BlockStats",
    "PolicyFreeBlockQueue",
    "follows_vllm_order",
    "install_policy",
    "installed_policy",
]


_Q = TypeVar("_Q")


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
    (the policy's domain); the rank holds the tracked blocks that are chain leaves. The
    statistics are per-block lists (:class:`~.ranks.BlockTable`); the built-in policies rank
    them directly (:func:`~.ranks.rank_for`), any other policy through its candidate objects.
    """

    _blocks: list[KVCacheBlock]
    _policy: EvictionPolicy
    _rank: BlockRank
    _table: BlockTable
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
        n = len(blocks)
        new._blocks = blocks
        new._policy = policy
        new._table = table = BlockTable(n)
        rank = rank_for(policy, table)
        new._rank = rank if rank is not None else PolicyRank(table, policy, blocks)
        new._tracked = bytearray(n)
        new._parent = [-1] * n
        new._parent_gen = [0] * n
        new._gen = [0] * n
        new._num_children = [0] * n
        new._clock = 0
        free = [b for b in new.get_all_free_blocks() if b.block_hash is not None]
        new._track_free(free)
        return new

    @property
    def policy(self) -> EvictionPolicy:
        """The kvplug policy whose order this queue keeps."""
        return self._policy

    @property
    def rank(self) -> BlockRank:
        """What ranks the candidate blocks (the policy's order, by block id)."""
        return self._rank

    def stats(self, block_id: int) -> CandidateStats | None:
        """The statistics of a block's cached content as the policy sees them (``None`` if it
        was never cached): the policy's own object, or a snapshot of the table's row."""
        if isinstance(self._rank, PolicyRank):
            return self._rank.stats(block_id)
        table = self._table
        created = table.created[block_id]
        if not created:
            return None
        stats = BlockStats(block_id, created, 0)
        table.describe(stats, self._blocks[block_id])
        stats.last_access_time = table.last[block_id]
        stats.hit_count = table.hits[block_id]
        return stats

    def is_leaf(self, block_id: int) -> bool:
        """No cached block continues this block's chain (evicting it orphans nothing)."""
        return not self._num_children[block_id]

    # -- vLLM's queue operations --------------------------------------------------------------
    # Hot paths: the per-block loops are kvplug.speedups' free_list_* kernels (compiled where
    # the extension was built; the Python reference otherwise), one call per operation.

    def popleft(self) -> KVCacheBlock:
        if not self.num_free_blocks:
            return super().popleft()  # vLLM's own error
        return self.popleft_n(1)[0]

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Take ``n`` blocks: vLLM's head while it is not a tracked cached block, else the
        rank's victim (the head again when the rank holds no leaf).

        Only ``get_new_blocks`` takes blocks, and it removes every taken block's hashes right
        after: the chain bookkeeping of that removal is done here (a parent whose last child
        goes becomes a candidate), so vLLM's per-block hash removal runs unhooked.
        """
        if n == 0:
            return []
        assert self.num_free_blocks >= n
        rank = self._rank
        taken = speedups.free_list_popleft(
            self.fake_free_list_head,
            n,
            self._tracked,
            self._blocks,
            self._parent,
            self._parent_gen,
            self._gen,
            self._num_children,
            self._table.content,
            rank.pop,
            rank.pushpop,
            rank.add,
        )
        self.num_free_blocks -= n
        return taken

    def remove(self, block: KVCacheBlock) -> None:
        before, after = block.prev_free_block, block.next_free_block
        if before is None or after is None:
            super().remove(block)  # vLLM's own error
            return
        before.next_free_block = after
        after.prev_free_block = before
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1
        block_id = block.block_id
        if self._tracked[block_id]:
            self._tracked[block_id] = 0
            if not self._num_children[block_id]:  # only leaves are candidates
                self._rank.discard(block_id)

    def append(self, block: KVCacheBlock) -> None:
        self.append_n([block])

    def append_n(self, blocks: list[KVCacheBlock]) -> None:
        """vLLM's append; each cached block is tracked with its recency (a tick each), and the
        chain leaves among them become candidates."""
        if not blocks:
            return
        tail = self.fake_free_list_tail
        assert tail.prev_free_block is not None, (
            "prev_free_block of fake_free_list_tail should always exist"
        )
        speedups.free_list_append(
            blocks,
            tail,
            self._tracked,
            self._table.last,
            self._num_children,
            self._clock,
            self._rank.add,
        )
        self._clock += len(blocks)
        self.num_free_blocks += len(blocks)

    def _track_free(self, blocks: list[KVCacheBlock]) -> None:
        """These cached blocks are in vLLM's list already (when adopting the list)."""
        table, tracked = self._table, self._tracked
        for block in blocks:
            block_id = block.block_id
            if table.content[block_id] is not block.block_hash:
                self._renew(block, 0)
            tracked[block_id] = 1
            self._clock += 1
            table.last[block_id] = self._clock
            if not self._num_children[block_id]:
                self._rank.add(block_id)

    # prepend_n is vLLM's: prepended blocks (unhashed or evict-first) are reused first, untracked.

    # -- bookkeeping -----------------------------------------------------------------------------

    def _renew(self, block: KVCacheBlock, num_tokens: int) -> None:
        """The block holds content not seen before: a new lifetime (chain links of its old
        content go)."""
        block_id = block.block_id
        if self._table.content[block_id] is not None:
            self._hash_removed(block_id)
        self._parent[block_id] = -1
        self._clock += 1
        table = self._table
        table.created[block_id] = table.last[block_id] = self._clock
        table.hits[block_id] = 0
        table.tokens[block_id] = num_tokens
        table.content[block_id] = block.block_hash

    def keep_in_place(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Leave these free blocks where vLLM put them (unpinned last-resort blocks)."""
        tracked, discard = self._tracked, self._rank.discard
        for block in blocks:
            block_id = block.block_id
            if tracked[block_id]:
                tracked[block_id] = 0
                discard(block_id)

    def on_cached(
        self, blocks: Sequence[KVCacheBlock], start: int, end: int, num_tokens: int, chained: bool
    ) -> None:
        """vLLM cached ``blocks[start:end]`` (new content, a request's chain): each starts a new
        lifetime; in a chained group each is linked under the block before it."""
        table = self._table
        content, created, hits, tokens = table.content, table.created, table.hits, table.tokens
        parent_of, parent_gen, gen = self._parent, self._parent_gen, self._gen
        num_children, tracked, discard = self._num_children, self._tracked, self._rank.discard
        clock = self._clock
        parent = blocks[start - 1] if chained and 0 < start <= len(blocks) else None
        if parent is not None and parent.block_hash is None:
            parent = None
        for i in range(start, min(end, len(blocks))):
            block = blocks[i]
            block_hash = block.block_hash
            if block_hash is None:  # null or masked-out: not cached
                parent = None
                continue
            block_id = block.block_id
            if content[block_id] is not None:  # it held other content (a partial block)
                self._hash_removed(block_id)
            clock += 1
            created[block_id] = clock  # its recency is set when it is freed
            hits[block_id] = 0
            tokens[block_id] = num_tokens
            content[block_id] = block_hash
            if parent is None:
                parent_of[block_id] = -1
            else:
                parent_id = parent.block_id
                parent_of[block_id] = parent_id
                parent_gen[block_id] = gen[parent_id]
                children = num_children[parent_id]
                num_children[parent_id] = children + 1
                if not children and tracked[parent_id]:
                    discard(parent_id)
            if chained:
                parent = block
        self._clock = clock

    def on_hits(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Requests reused these cached blocks (vLLM touched them when admitting a request).

        A hit does not tick the clock: a block is ranked only once freed again, and its free
        sets its recency (what every policy reads when the block becomes a candidate)."""
        hits = self._table.hits
        for block in blocks:
            if block.block_hash is not None:
                hits[block.block_id] += 1

    def touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        """vLLM's ``BlockPool.touch`` and :meth:`on_hits` in one pass
        (:func:`kvplug.speedups.free_list_touch`): take the free ones out of the list, add a
        reference, count a hit on the cached ones. For pools without a metrics collector."""
        unlinked, bad = speedups.free_list_touch(
            blocks, self._tracked, self._num_children, self._table.hits, self._rank.discard
        )
        self.num_free_blocks -= unlinked
        if bad >= 0:
            super().remove(blocks[bad])  # vLLM's own error

    def on_hashes_changed(self, block: KVCacheBlock) -> None:
        """``block`` lost or changed its hashes outside ``get_new_blocks`` and
        ``cache_full_blocks``: chain links through its old content go; new hashes are new
        content (every content change is seen here or in :meth:`on_cached`, so the free and
        hit paths need not check)."""
        block_id = block.block_id
        if block.block_hash is self._table.content[block_id]:
            return
        if block.block_hash is not None:
            self._renew(block, 0)
        elif self._table.content[block_id] is not None:
            self._hash_removed(block_id)
            self._table.content[block_id] = None

    def _hash_removed(self, block_id: int) -> None:
        """The content ``block_id`` held is gone: its parent may become a leaf, its children
        are unlinked (their links name an older generation), it is a leaf itself."""
        if self._parent[block_id] >= 0:
            self._unlink(block_id)
        self._gen[block_id] += 1
        if self._num_children[block_id]:
            self._num_children[block_id] = 0
            if self._tracked[block_id]:
                self._rank.add(block_id)

    def _unlink(self, block_id: int) -> None:
        parent_id = self._parent[block_id]
        self._parent[block_id] = -1
        if self._parent_gen[block_id] == self._gen[parent_id]:
            self._num_children[parent_id] -= 1
            if not self._num_children[parent_id] and self._tracked[parent_id]:
                self._rank.add(parent_id)

    def on_reset(self) -> None:
        """vLLM dropped every hash (``reset_prefix_cache``): no chains remain."""
        for block_id, children in enumerate(self._num_children):
            if children and self._tracked[block_id]:
                self._rank.add(block_id)
        n = len(self._blocks)
        self._parent = [-1] * n
        self._num_children = [0] * n
        self._gen = [gen + 1 for gen in self._gen]
        self._table.content[:] = [None] * n


def _hook_pool(block_pool: BlockPool, queue: PolicyFreeBlockQueue, chains: frozenset[int]) -> None:
    """Report hits, new cached blocks, lost hashes and resets of ``block_pool`` to ``queue``.

    Each hook is set on the pool object (its class stays vLLM's, so every object holding the
    pool sees them and attribute loads stay fast) and calls vLLM's method first, so vLLM's
    state is updated before the policy sees the change.
    """
    cls = type(block_pool)
    base_touch = cls.touch.__get__(block_pool)
    base_cache_full_blocks = cls.cache_full_blocks.__get__(block_pool)
    base_evict_blocks = cls.evict_blocks.__get__(block_pool)
    # newer vLLM only; hooked when present
    base_move_block_hashes: Any = getattr(block_pool, "move_block_hashes", None)
    base_cache_partial_block: Any = getattr(block_pool, "cache_partial_block", None)
    base_unpin_blocks = cls.unpin_blocks.__get__(block_pool)
    base_reset_prefix_cache = cls.reset_prefix_cache.__get__(block_pool)
    on_hits, on_cached, on_hashes_changed = queue.on_hits, queue.on_cached, queue.on_hashes_changed

    def touch(blocks: Sequence[KVCacheBlock]) -> None:
        if block_pool.metrics_collector is None and block_pool.free_block_queue is queue:
            queue.touch(blocks)
        else:  # vLLM reports each access to its collector: its own loop, then the hits
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

    def evict_blocks(block_ids: set[int]) -> None:
        base_evict_blocks(block_ids)
        for block_id in block_ids:
            on_hashes_changed(block_pool.blocks[block_id])

    def move_block_hashes(src_block: KVCacheBlock, dst_block: KVCacheBlock) -> None:
        base_move_block_hashes(src_block, dst_block)
        on_hashes_changed(src_block)
        on_hashes_changed(dst_block)

    def cache_partial_block(request: Any, block: KVCacheBlock, *args: Any, **kwargs: Any) -> Any:
        result = base_cache_partial_block(request, block, *args, **kwargs)
        on_hashes_changed(block)
        return result

    def unpin_blocks(blocks: Iterable[KVCacheBlock], on_reuse: Any) -> None:
        blocks = list(blocks)
        base_unpin_blocks(blocks, on_reuse)
        queue.keep_in_place(block for block in blocks if block.ref_cnt == 0)

    def reset_prefix_cache() -> bool:
        done: bool = base_reset_prefix_cache()
        if done:
            queue.on_reset()
        return done

    hooks: list[Any] = [touch, cache_full_blocks, evict_blocks, unpin_blocks, reset_prefix_cache]
    if base_move_block_hashes is not None:
        hooks.append(move_block_hashes)
    if base_cache_partial_block is not None:
        hooks.append(cache_partial_block)
    for hook in hooks:
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
