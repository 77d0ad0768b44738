"""``block_hash``: vLLM-style prefix cache of hash-chained, reference-counted blocks.

A key is cut into blocks of ``page_size`` tokens (only full blocks are cached). A block's hash
covers its parent's hash and its own token ids, and the chain starts from a seed derived from the
namespace (``extra_key``), so a block hash identifies the *whole* prefix up to and including that
block in that namespace: equal tokens after a different parent, or in another namespace, never
match. One dict maps hash -> block, so a lookup is one hash and one dict probe per block.

Hashes are SHA-256 (or BLAKE2b) digests, deterministic across processes and machines, unlike
Python's ``hash()`` which salts strings per process; vLLM made SHA-256 its default for the same
reason (no silent wrong-KV reuse from a 64-bit collision).

Ownership: ``insert`` hands the cache the slots of every full block; for blocks that were already
cached, passed slots that differ from the cached ones are freed by the cache (the slots a request
got from ``match_prefix`` are identical and kept). Slots beyond the last full block stay the
caller's.

Reference counts: ``inc_lock_ref(handle)`` (the ``last_node`` of a ``MatchResult``) takes one
reference on every block of that prefix, ``dec_lock_ref`` drops it. A block is *evictable* when
nobody references it and no cached block chains from it: evicting a middle block would strand its
descendants, so blocks leave from the tail and a parent becomes evictable when its last child goes.
The evictable blocks are the configured policy's candidate set, maintained incrementally.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Literal, cast

import torch

from kvplug_hookspecs import (
    CacheCleared,
    CacheEvents,
    CacheKey,
    EvictionPolicy,
    EvictParams,
    EvictResult,
    FrozenModel,
    MatchResult,
    TokenAllocator,
)

from . import block_hashing
from .common import (
    BuiltFromContext,
    CacheStats,
    CandidateStats,
    cache_options,
    cache_page_size,
    check_indices,
    check_int,
    check_key,
    emit_removed,
    emit_stored,
    new_policy_instance,
    policy_error,
    rebuild_policies,
    release_ownership,
    take_ownership,
)
from .tiered import emit_tier_events, load_pages, prefetch_pages

if TYPE_CHECKING:
    from ..tiers import TierHierarchy

__all__ = ["Block", "BlockHashCache", "BlockHashOptions"]

log = logging.getLogger(__name__)

_EMPTY = b""


class BlockHashOptions(FrozenModel):
    """Options of the ``block_hash`` cache.

    ``hash_algorithm``: ``sha256`` (default, as vLLM) or ``blake2b`` (a 128-bit BLAKE2b digest,
    faster in CPython); both are deterministic across processes. A config's ``block_hash``
    (e.g. ``"vllm"``) replaces it.
    """

    hash_algorithm: Literal["sha256", "blake2b"] = "sha256"


class Block(CandidateStats):
    """One cached block: ``page_size`` slots, its chain hash, its parent, two counters.

    ``ref_count`` counts the running requests holding it; ``num_children`` the cached blocks
    chained from it. It is in the policy's evictable set exactly when both are zero.
    ``own_locks`` counts the locks taken with this block as the handle. ``token_ids``: its
    tokens, kept only when the cache has storage tiers (a demoted page carries them).
    """

    __slots__ = (
        "block_hash",
        "digest",
        "indices",
        "num_children",
        "own_locks",
        "parent",
        "ref_count",
        "token_ids",
    )

    def __init__(
        self,
        now: int,
        block_hash: int,
        digest: bytes,
        parent: Block | None,
        indices: torch.Tensor | None,
        num_tokens: int,
        priority: int = 0,
    ) -> None:
        super().__init__(now, priority)
        self.block_hash = block_hash
        self.digest = digest
        self.parent = parent
        self.indices = indices
        self.num_tokens = num_tokens
        self.ref_count = 0
        self.num_children = 0
        self.own_locks = 0
        self.token_ids: tuple[int, ...] = ()

    def __repr__(self) -> str:
        return (
            f"Block(hash={self.block_hash:#018x}..., tokens={self.num_tokens}, "
            f"ref_count={self.ref_count}, children={self.num_children})"
        )


class BlockHashCache(BuiltFromContext):
    """Hash-chained block prefix cache with reference counts (the protocol's ``PrefixCache``).

    ``match_prefix`` returns the slots of the longest run of cached blocks and, as ``last_node``,
    the last matched block (or the cache's root sentinel when nothing matched); lock that handle
    while a request uses the prefix. ``evict`` frees whole blocks, so it frees at least the
    shortfall when enough is evictable and at most the shortfall rounded up to ``page_size``.
    """

    name = "block_hash"
    is_chunk_cache = False

    def __init__(
        self,
        allocator: TokenAllocator,
        new_policy: Callable[[], EvictionPolicy] | None = None,
        *,
        page_size: int | None = None,
        events: CacheEvents | None = None,
        block_hasher: block_hashing.BlockHasher | None = None,
        options: BlockHashOptions | None = None,
        storage: Callable[[str], TierHierarchy] | None = None,
    ) -> None:
        options = cache_options("block_hash", options, BlockHashOptions)
        page_size = cache_page_size(page_size, allocator)
        policy = new_policy_instance(new_policy)
        self.allocator = allocator
        self.policy = policy
        self.page_size = page_size
        self.events = events
        self.options = options
        self.device = torch.device(allocator.device)
        self._empty = torch.empty(0, dtype=torch.int64, device=self.device)
        self.stats = CacheStats()
        self.block_hasher = block_hasher or block_hashing.BlockHasher(options.hash_algorithm)
        """How blocks are hashed: kvplug's scheme with ``hash_algorithm``, or the config's
        ``block_hash`` (which wins over ``hash_algorithm`` when given)."""
        self._clock = 0
        # the storage hierarchy below the pool (keys: the block digests), or None
        self.storage: TierHierarchy | None = storage(self.block_hasher.name) if storage else None
        self._init_state()

    def _init_state(self) -> None:
        self.root = Block(0, 0, _EMPTY, None, None, 0)
        self.root.ref_count = 1  # the sentinel is never evictable
        self._blocks: dict[bytes, Block] = {}
        self._evictable_tokens = 0
        self._protected_tokens = 0

    # ----------------------------------------------------------------------------- hashing
    def _seed(self, extra_key: str | None) -> bytes:
        """The chain's starting digest for a namespace: every block hash covers it."""
        return self.block_hasher.root(extra_key)

    def _block_digests(
        self, ids: tuple[int, ...], extra_key: str | None, num_blocks: int
    ) -> Iterator[bytes]:
        """Yield the chain digest of each of the first ``num_blocks`` blocks (lazily), as
        :mod:`kvplug.caches.block_hashing` defines it."""
        return self.block_hasher.chain(
            self._seed(extra_key), ids, self.page_size, num_blocks, extra_key
        )

    def _as_int(self, digest: bytes) -> int:
        """The event-facing hash of a block (kvplug's: the first 8 bytes of its digest)."""
        return self.block_hasher.event_hash(digest)

    # ----------------------------------------------------------------------------- failures
    def _saved_stats(self, blocks: list[Block]) -> list[tuple[int, int, int]]:
        return [(b.last_access_time, b.hit_count, b.priority) for b in blocks]

    def _restore(self, clock: int, blocks: list[Block], saved: list[tuple[int, int, int]]) -> None:
        """Undo stamps after a failure, then rebuild the policy's candidate set."""
        self._clock = clock
        for block, (time, hits, priority) in zip(blocks, saved, strict=True):
            block.last_access_time, block.hit_count, block.priority = time, hits, priority
        self._resync_policy()

    def _resync_policy(self, recheck: bool = True) -> None:
        """Make the policy's set the unreferenced childless blocks again (error path only); a
        policy that fails again is quarantined (``common.rebuild_policies``)."""

        def refill() -> None:
            for block in self._blocks.values():
                if block.ref_count == 0 and block.num_children == 0:
                    self.policy.add(block)

        rebuild_policies(self, ("policy",), refill, recheck=recheck)

    # ----------------------------------------------------------------------------- queries
    def match_prefix(
        self, key: CacheKey | Sequence[int], *, record_hit: bool = True, gather: bool = True
    ) -> MatchResult:
        """Longest cached run of full blocks of ``key``; updates recency and hit counts.

        ``record_hit=False`` is a probe: no statistic, hit count, clock or recency changes.
        ``gather=False`` returns an empty ``device_indices`` (length and handle still right).
        The key is checked before anything changes; a failing policy changes nothing and
        raises ``PolicyError``.
        """
        ids, extra_key = check_key(key)
        if self.policy_recheck:  # a policy failed since its view was rebuilt: rebuild it first
            self._resync_policy(recheck=False)
        matched = self._match_blocks(ids, extra_key)
        prefix_len = len(matched) * self.page_size
        if record_hit:
            self._stamp(matched, hit=True, operation="match_prefix")
            self.stats.match_queries += 1
            self.stats.match_query_tokens += len(ids)
            self.stats.hit_tokens += prefix_len
        tier_tokens: tuple[tuple[str, int], ...] = ()
        if self.storage is not None:
            matched, tier_tokens = self._match_tiers(ids, extra_key, matched, record_hit)
            prefix_len = len(matched) * self.page_size
        return MatchResult(
            device_indices=self._gather(matched) if gather else self._empty,
            last_node=matched[-1] if matched else self.root,
            prefix_len=prefix_len,
            tier_tokens=tier_tokens,
        )

    def prefetch(self, key: CacheKey | Sequence[int]) -> int:
        """A request with ``key`` was queued: start copying the blocks of its prefix that only
        a slower storage tier holds into the fastest one, in the background (see
        ``RadixCache.prefetch``). Changes nothing on the device; returns the pages on their
        way (0 without tiers)."""
        storage = self.storage
        ids, extra_key = check_key(key)
        if storage is None:
            return 0
        page = self.page_size
        matched = self._match_blocks(ids, extra_key)
        remaining = len(ids) // page - len(matched)
        if remaining <= 0:
            return 0
        pos = len(matched) * page
        parent = matched[-1].digest if matched else self._seed(extra_key)
        digests = self.block_hasher.chain(parent, ids[pos:], page, remaining, extra_key)
        return prefetch_pages(storage, digests, ids, pos, page)

    # ----------------------------------------------------------------------------- tiers
    def _match_tiers(
        self, ids: tuple[int, ...], extra_key: str | None, matched: list[Block], record_hit: bool
    ) -> tuple[list[Block], tuple[tuple[str, int], ...]]:
        """Continue a device match through the storage tiers (see ``kvplug.caches.tiered``):
        a probe locates; a match loads, inserts and returns the longer chain."""
        storage = self.storage
        assert storage is not None
        if self.events is not None:
            emit_tier_events(storage, self.events, self.name, self.block_hasher.event_hash)
        page = self.page_size
        pos = len(matched) * page
        remaining = len(ids) // page - len(matched)
        if remaining <= 0:
            return matched, ()
        parent = matched[-1].digest if matched else self._seed(extra_key)
        digests = self.block_hasher.chain(parent, ids[pos:], page, remaining, extra_key)
        keys, runs = storage.locate(digests)
        if not runs:
            return matched, ()
        if not record_hit:
            return matched, storage.reach(runs)
        handle = matched[-1] if matched else None
        if handle is not None:
            self.inc_lock_ref(handle)
        try:
            loaded = load_pages(self, storage, keys, runs, ids, pos)
            if loaded is None:
                return matched, ()
            slots, per_tier = loaded
            new_end = pos + slots.numel()
            try:
                self.insert(
                    CacheKey(ids[:new_end], extra_key),
                    torch.cat((self._gather(matched), slots)),
                    hits_after=pos,
                )
            except BaseException:
                self.allocator.free(slots)  # insert changed nothing: the slots are still ours
                raise
        finally:
            if handle is not None:
                self.dec_lock_ref(handle)
        chain = matched + [self._blocks[k] for k in keys[: slots.numel() // page]]
        return chain, tuple(per_tier)

    def _demote(self, pairs: list[tuple[Block, Block | None]]) -> None:
        """Hand ``(block, parent)`` pairs about to be freed (or just cached, write-through) to
        the storage tiers."""
        storage = self.storage
        assert storage is not None
        try:
            blocks = [b for b, _ in pairs]
            parents = [None if p is None or p is self.root else p.digest for _, p in pairs]
            storage.demote(
                [b.digest for b in blocks],
                [b.token_ids for b in blocks],
                parents,
                self._gather(blocks),
            )
        except Exception:  # never fails the cache's operation: the pages are recomputed
            log.exception("block_hash: demoting %d blocks failed", len(blocks))

    def touch_prefix(self, key: CacheKey | Sequence[int]) -> None:
        """Refresh the recency of ``key``'s cached blocks; no hit, no query counted."""
        ids, extra_key = check_key(key)
        if self.policy_recheck:  # a policy failed since its view was rebuilt: rebuild it first
            self._resync_policy(recheck=False)
        self._stamp(self._match_blocks(ids, extra_key), hit=False, operation="touch_prefix")

    def path_indices(self, node: Any) -> torch.Tensor:
        """The slots of the blocks from the first one to ``node`` (int64, on device)."""
        block: Block | None = self._check_handle(node)
        chain = []
        while block is not None and block is not self.root:
            chain.append(block)
            block = block.parent
        chain.reverse()
        return self._gather(chain)

    def _match_blocks(self, ids: tuple[int, ...], extra_key: str | None) -> list[Block]:
        matched: list[Block] = []
        blocks = self._blocks
        for digest in self._block_digests(ids, extra_key, len(ids) // self.page_size):
            block = blocks.get(digest)
            if block is None:
                break
            matched.append(block)
        return matched

    def _stamp(self, matched: list[Block], *, hit: bool, operation: str) -> None:
        clock, saved = self._clock, self._saved_stats(matched)
        self._clock += 1
        now = self._clock
        try:
            for block in matched:
                block.last_access_time = now
                if hit:
                    block.hit_count += 1
                self.policy.touch(block)
        except Exception as exc:
            self._restore(clock, matched, saved)
            raise policy_error(self.policy, operation, exc) from exc

    def _gather(self, blocks: list[Block]) -> torch.Tensor:
        if not blocks:
            return self._empty
        return torch.cat([b.indices for b in blocks if b.indices is not None])

    # ----------------------------------------------------------------------------- insert
    def insert(
        self,
        key: CacheKey | Sequence[int],
        indices: Any,
        *,
        priority: int = 0,
        hits_after: int | None = None,
    ) -> int:
        """Cache the full blocks of ``key`` with slots ``indices``; return the length cached before.

        The cache takes ownership of ``indices[:aligned_len]`` (``aligned_len`` = ``len(key)``
        rounded down to ``page_size``): slots duplicating already-cached blocks are freed here.
        ``hits_after=n`` counts hits at insert (for engines that probe with
        ``record_hit=False``): each block of the path ending past token ``n`` gets one hit.

        All or nothing: key, indices and the ownership of every slot the cache takes (new ones,
        and duplicates it frees) are checked before anything changes; a failing policy or
        ``allocator.free`` leaves cache and allocator as they were.
        """
        ids, extra_key = check_key(key)
        indices = check_indices(indices, len(ids), self.device)
        check_int(priority, "priority")
        if hits_after is not None:
            check_int(hits_after, "hits_after", minimum=0)
        if self.policy_recheck:  # a policy failed since its view was rebuilt: rebuild it first
            self._resync_policy(recheck=False)
        page = self.page_size
        num_blocks = len(ids) // page
        aligned_len = num_blocks * page
        blocks = self._blocks
        digests = list(self._block_digests(ids, extra_key, num_blocks))
        chain: list[Block] = []
        for digest in digests:
            block = blocks.get(digest)
            if block is None:
                break
            chain.append(block)
        num_cached = len(chain)
        cached_len = num_cached * page
        duplicates = self._empty
        if num_cached:  # the caller's duplicates of cached blocks (identical slots are ours)
            passed = indices[:cached_len]
            duplicates = passed[passed != self._gather(chain)]
        taken = torch.cat([indices[cached_len:aligned_len], duplicates])
        take_ownership(self.allocator, taken)  # raises (nothing changed) on a slot not held

        clock, saved = self._clock, self._saved_stats(chain)
        policy = self.policy
        new_blocks: list[Block] = []
        in_free = False
        try:
            self._clock += 1
            now = self._clock
            for n, block in enumerate(chain, 1):
                block.last_access_time = now
                if priority > block.priority:
                    block.priority = priority
                if hits_after is not None and n * page > hits_after:
                    block.hit_count += 1
                policy.touch(block)
            parent = chain[-1] if chain else self.root
            new_digests = digests[num_cached:]
            if new_digests:
                new_slots = indices[cached_len:aligned_len].clone().view(-1, page)
                if parent is not self.root and parent.num_children == 0 and parent.ref_count == 0:
                    policy.discard(parent)
                added = len(new_digests) * page
                for i, digest in enumerate(new_digests):
                    block_hash = self._as_int(digest)
                    block = Block(now, block_hash, digest, parent, new_slots[i], page, priority)
                    # features: where it starts, its namespace, its content (the chain hash)
                    block.depth, block.namespace = (num_cached + i) * page, extra_key
                    block.content_id, block.new_tokens = block_hash or 1, added
                    if hits_after is not None and (num_cached + i + 1) * page > hits_after:
                        block.hit_count = 1
                    if self.storage is not None:
                        start = (num_cached + i) * page
                        block.token_ids = ids[start : start + page]
                    blocks[digest] = block
                    new_blocks.append(block)
                    parent.num_children += 1
                    parent = block
                policy.add(parent)  # only the new tail block is childless
            if duplicates.numel():
                in_free = True
                self.allocator.free(duplicates)
        except Exception as exc:
            for block in reversed(new_blocks):
                del blocks[block.digest]
                assert block.parent is not None
                block.parent.num_children -= 1
            self._restore(clock, chain, saved)
            release_ownership(self.allocator, taken)
            if in_free:
                raise
            raise policy_error(self.policy, "insert", exc) from exc

        if not new_blocks:
            return cached_len
        new_tokens = len(new_blocks) * page
        if self.storage is not None and self.storage.write_through:
            self._demote([(b, b.parent) for b in new_blocks])
        self._evictable_tokens += new_tokens
        self.stats.inserted_tokens += new_tokens
        if self.events is not None:
            first_parent = new_blocks[0].parent
            emit_stored(
                self.events,
                self.name,
                new_tokens,
                tuple(b.block_hash for b in new_blocks),
                extra_key,
                None if first_parent is self.root else cast(Block, first_parent).block_hash,
                ids[cached_len:aligned_len],
            )
        return cached_len

    # ----------------------------------------------------------------------------- eviction
    def _check_victim(self, block: Any) -> Block:
        """What ``policy.pop()`` returned must be one of this cache's evictable blocks."""
        if (
            not isinstance(block, Block)
            or self._blocks.get(block.digest) is not block
            or block.ref_count
            or block.num_children
        ):
            raise ValueError(f"pop() returned {block!r}, which is not an evictable block here")
        return block

    def evict(self, params: EvictParams) -> EvictResult:
        """Free unreferenced tail blocks in policy order until ``params.num_tokens`` are freed.

        Frees whole blocks: at most ``num_tokens`` rounded up to ``page_size``; less when too
        little is evictable (the caller decides to retract or preempt). ``swa_num_tokens`` and
        ``mamba_num`` do not apply to this cache and are ignored. All or nothing: when the
        policy or ``allocator.free`` fails, every victim is put back and nothing is freed.
        """
        if not isinstance(params, EvictParams):
            raise TypeError(f"evict expects EvictParams, got {type(params).__name__}")
        need = params.num_tokens
        if need == 0:
            return EvictResult()
        if self.policy_recheck:  # a policy failed since the last evict: see rebuild_policies
            self._resync_policy(recheck=False)
        freed = 0
        victims: list[tuple[Block, Block]] = []  # (block, parent)
        policy = self.policy
        root = self.root
        blocks = self._blocks
        in_free = False
        try:
            while freed < need:
                block = policy.pop()
                if block is None:
                    break
                block = self._check_victim(block)
                parent = block.parent
                assert parent is not None
                del blocks[block.digest]
                victims.append((block, parent))
                freed += block.num_tokens
                block.parent = None
                if parent is not root:
                    parent.num_children -= 1
                    if parent.num_children == 0 and parent.ref_count == 0:
                        policy.add(parent)
            if victims and self.storage is not None and not self.storage.write_through:
                self._demote(list(victims))
            if victims:
                in_free = True
                self.allocator.free(self._gather([b for b, _ in victims]))
        except Exception as exc:
            for block, parent in reversed(victims):
                block.parent = parent
                blocks[block.digest] = block
                if parent is not root:
                    parent.num_children += 1
            self._resync_policy()
            if in_free:
                raise
            raise policy_error(self.policy, "evict", exc) from exc
        if victims:
            self._evictable_tokens -= freed
            if self.events is not None:
                emit_removed(self.events, self.name, freed, tuple(b.block_hash for b, _ in victims))
        self.stats.evictions += 1
        self.stats.evicted_tokens += freed
        return EvictResult(num_tokens=freed)

    # ----------------------------------------------------------------------------- locking
    def _check_handle(self, block: Any) -> Block:
        if not isinstance(block, Block):
            raise TypeError(
                f"a lock handle is the last_node of a MatchResult, got {type(block).__name__}"
            )
        if block is not self.root and self._blocks.get(block.digest) is not block:
            raise ValueError(
                f"{block!r} is not cached in this cache (evicted, or from another cache)"
            )
        return block

    def _chain_to_root(self, block: Block) -> list[Block]:
        chain = []
        x: Block | None = block
        while x is not None and x is not self.root:
            chain.append(x)
            x = x.parent
        return chain

    def inc_lock_ref(self, node: Any) -> int:
        """Take a reference on every block of the prefix ending at ``node``.

        Returns the change of ``evictable_size()`` (zero or negative), as SGLang does. Only
        ``dec_lock_ref`` with the same handle drops it.
        """
        block = self._check_handle(node)
        if self.policy_recheck:  # a policy failed since its view was rebuilt: rebuild it first
            self._resync_policy(recheck=False)
        chain = self._chain_to_root(block)
        unlocked = [b for b in chain if b.ref_count == 0]
        for b in chain:
            b.ref_count += 1
        block.own_locks += 1
        try:
            for b in unlocked:
                if b.num_children == 0:
                    self.policy.discard(b)
        except Exception as exc:
            for b in chain:
                b.ref_count -= 1
            block.own_locks -= 1
            self._resync_policy()
            raise policy_error(self.policy, "inc_lock_ref", exc) from exc
        moved = sum(b.num_tokens for b in unlocked)
        self._evictable_tokens -= moved
        self._protected_tokens += moved
        return -moved

    def dec_lock_ref(self, node: Any) -> int:
        """Drop the reference ``inc_lock_ref(node)`` took.

        Returns the change of ``evictable_size()`` (zero or positive). A handle that holds no
        lock of its own (an ancestor of a locked block, the root) is an error; nothing changes.
        """
        block = self._check_handle(node)
        if block.own_locks == 0:
            raise ValueError(
                f"dec_lock_ref on {block!r}, which holds no reference of its own: not locked "
                "by this handle (an ancestor of a locked block, or the root, cannot be unlocked)"
            )
        if self.policy_recheck:  # a policy failed since its view was rebuilt: rebuild it first
            self._resync_policy(recheck=False)
        chain = self._chain_to_root(block)
        freed = [b for b in chain if b.ref_count == 1]
        for b in chain:
            b.ref_count -= 1
        block.own_locks -= 1
        try:
            for b in freed:
                if b.num_children == 0:
                    self.policy.add(b)
        except Exception as exc:
            for b in chain:
                b.ref_count += 1
            block.own_locks += 1
            self._resync_policy()
            raise policy_error(self.policy, "dec_lock_ref", exc) from exc
        moved = sum(b.num_tokens for b in freed)
        self._evictable_tokens += moved
        self._protected_tokens -= moved
        return moved

    # ----------------------------------------------------------------------------- sizes
    def evictable_size(self) -> int:
        """Cached tokens no request references (freed eventually, tail blocks first)."""
        return self._evictable_tokens

    def protected_size(self) -> int:
        """Cached tokens referenced by at least one running request."""
        return self._protected_tokens

    def total_size(self) -> int:
        """All cached tokens."""
        return self._evictable_tokens + self._protected_tokens

    def num_blocks(self) -> int:
        """How many blocks are cached."""
        return len(self._blocks)

    def all_values_flatten(self) -> torch.Tensor:
        """Every cached slot (int64, on device): for checks and debugging."""
        return self._gather(list(self._blocks.values()))

    def reset(self) -> None:
        """Free every cached slot back to the allocator and forget every block.

        Refused while running requests hold references (their slots would be freed under them).
        """
        if self._protected_tokens:
            raise RuntimeError(
                f"cannot reset: {self._protected_tokens} cached tokens are referenced by "
                "running requests"
            )
        dropped = self.total_size()
        if dropped:
            self.allocator.free(self.all_values_flatten())  # raises: nothing changed
        with contextlib.suppress(Exception):  # the slots are freed: a fresh state is right
            self.policy.clear()
        self._init_state()
        if self.events is not None:
            self.events.cache_cleared(CacheCleared(cache=self.name, num_tokens=dropped))

    def __repr__(self) -> str:
        return (
            f"BlockHashCache(page_size={self.page_size}, blocks={len(self._blocks)}, "
            f"evictable={self._evictable_tokens}, protected={self._protected_tokens}, "
            f"policy={type(self.policy).__name__})"
        )
