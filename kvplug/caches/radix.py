"""``radix``: an SGLang-style radix tree mapping token-id prefixes to KV slot indices.

Each edge holds a run of token ids and the int64 tensor of their KV slots. With ``page_size > 1``
keys are truncated to whole pages and every node holds whole pages, so a page is never split
between two nodes. A node's children are keyed by their first token (``page_size == 1``) or their
first page (a tuple); children of the root are keyed by ``(extra_key, first)``, so two
namespaces never share a node. A match that ends inside a node splits it.

Engine sequence (SGLang's ``cache_finished_req`` / ``cache_unfinished_req`` in plain calls)::

    key = CacheKey(tokens, extra_key)
    m = cache.match_prefix(key)                   # m.device_indices: the cached prefix's slots
    cache.inc_lock_ref(m.last_node)               # the prefix can no longer be evicted
    need = len(tokens) - m.prefix_len             # (paged allocator: rounded up to pages)
    evict_from_tree_cache(cache, need)            # evicts only what the allocator lacks
    new = allocator.alloc(need)                   # ... the model writes the rest's KV there
    cache.insert(key, torch.cat([m.device_indices, new])[: len(tokens)])
    aligned = len(tokens) // page_size * page_size
    allocator.free(new[aligned - m.prefix_len :])  # the caller's part: the unaligned tail
    cache.dec_lock_ref(m.last_node)

A request that keeps running after ``insert`` (chunked prefill) matches again, locks the new
``last_node``, unlocks the old one and uses the returned slots from then on.

Eviction: the evictable set is the policy's candidate set, kept incrementally: a node joins it
when it becomes an unlocked leaf and leaves it when locked, given a child, or freed. ``evict``
pops leaves in policy order, so evicting k tokens from N leaves is O(k log N); a parent left as
an unlocked leaf joins the set. With ``granularity="exact"`` (default) the last victim is cut:
only its tail pages are freed and its head stays cached, so an eviction frees at least the
request (when enough is evictable) and at most the request rounded up to ``page_size``.
``granularity="leaf"`` frees whole leaves, as SGLang does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any, Literal

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
    release_ownership,
    take_ownership,
)
from .radix_tree import child_key, common_len

__all__ = ["RadixCache", "RadixCacheOptions", "RadixNode"]


class RadixCacheOptions(FrozenModel):
    """Options of the ``radix`` cache.

    ``granularity``: ``exact`` cuts the last victim leaf so an eviction frees the request
    rounded up to a page; ``leaf`` frees whole leaves (SGLang's behaviour, may free more).
    """

    granularity: Literal["exact", "leaf"] = "exact"


_ID_TOKENS = 64


def _start_id(namespace: str | None, depth: int, key: tuple[int, ...]) -> int:
    """A node's ``content_id``: where its content starts (namespace, depth, first tokens).

    Content evicted and cached again usually comes back longer (a conversation's next turn), so
    an identity of the start, not the end, lets a policy's ghost of it match.
    """
    return hash((namespace, depth, key[:_ID_TOKENS])) or 1


class RadixNode(CandidateStats):
    """One edge of the tree: ``key`` token ids, ``value`` their KV slots (int64, on device).

    ``edge`` is this node's key in ``parent.children``; ``lock_ref`` counts requests using the
    prefix that ends here or below, ``own_locks`` the locks taken *at* this node (the handles
    ``dec_lock_ref`` accepts). A freed node has ``parent is None``.
    """

    __slots__ = ("children", "edge", "key", "lock_ref", "own_locks", "parent", "value")

    def __init__(self, now: int, priority: int = 0) -> None:
        super().__init__(now, priority)
        self.children: dict[Any, RadixNode] = {}
        self.parent: RadixNode | None = None
        self.edge: Any = None
        self.key: tuple[int, ...] = ()
        self.value: torch.Tensor | None = None
        self.num_tokens = 0
        self.lock_ref = 0
        self.own_locks = 0

    def __repr__(self) -> str:
        return (
            f"RadixNode(id={self.node_id}, tokens={self.num_tokens}, lock_ref={self.lock_ref}, "
            f"children={len(self.children)})"
        )


class RadixCache(BuiltFromContext):
    """Radix-tree prefix cache over an allocator (and pool) it need not have created.

    **Ownership rule of** ``insert(key, indices)``: ``indices[i]`` is the slot holding token
    ``key[i]`` and both have the same length. The cache stores ``key[:aligned]`` with
    ``indices[:aligned]`` (``aligned`` = the length rounded down to ``page_size``) and owns those
    slots from then on. For the part that was already cached, a passed slot that differs from the
    cached one is a duplicate and the cache frees it; identical slots (those the request got from
    ``match_prefix``) are kept. ``indices[aligned:]`` stay the caller's to free. ``insert``
    returns the length that was already cached.

    Handles (``MatchResult.last_node``) are valid while the prefix is cached; lock one with
    ``inc_lock_ref`` before allocating, or an eviction may free it first.
    """

    name = "radix"
    is_chunk_cache = False

    def __init__(
        self,
        allocator: TokenAllocator,
        new_policy: Callable[[], EvictionPolicy] | None = None,
        *,
        page_size: int | None = None,
        events: CacheEvents | None = None,
        options: RadixCacheOptions | None = None,
    ) -> None:
        options = cache_options("radix", options, RadixCacheOptions)
        page_size = cache_page_size(page_size, allocator)
        policy = new_policy_instance(new_policy)
        self.allocator = allocator
        self.page_size = page_size
        self.device = torch.device(allocator.device)
        self.events = events
        self.options = options
        self.stats = CacheStats()
        self.policy = policy
        self._exact = options.granularity == "exact"
        self._empty = torch.empty(0, dtype=torch.int64, device=self.device)
        self._clock = 0
        self._new_tree()

    def _new_tree(self) -> None:
        self.root = RadixNode(self._clock, priority=0)
        self.root.value = self._empty
        self.root.lock_ref = 1  # never evicted, never in the policy
        self._evictable = 0
        self._protected = 0

    # -- sizes ----------------------------------------------------------------------------------

    def evictable_size(self) -> int:
        """Cached tokens no running request uses: what ``evict`` can free."""
        return self._evictable

    def protected_size(self) -> int:
        """Cached tokens locked by running requests."""
        return self._protected

    def total_size(self) -> int:
        """All cached tokens."""
        return self._evictable + self._protected

    # -- lookup and insert ----------------------------------------------------------------------

    def _split(self, child: RadixNode, length: int) -> RadixNode:
        """Cut ``child`` after ``length`` tokens; a new node takes the head and child's place.

        The tail keeps its identity (a lock handle stays valid). The tree is relinked before the
        policy hears of it, so a failing policy leaves a consistent tree (and a resync fixes it).
        """
        parent = child.parent
        assert parent is not None and child.value is not None
        head = RadixNode(child.creation_time, child.priority)
        head.last_access_time = child.last_access_time
        head.hit_count = child.hit_count
        head.depth, head.namespace, head.new_tokens = child.depth, child.namespace, child.new_tokens
        head.content_id = child.content_id  # the head starts where the child started
        head.lock_ref = child.lock_ref
        head.parent, head.edge = parent, child.edge
        head.key, head.value, head.num_tokens = child.key[:length], child.value[:length], length
        parent.children[head.edge] = head
        child.key, child.value = child.key[length:], child.value[length:]
        child.num_tokens -= length
        child.edge = child.key[0] if self.page_size == 1 else child.key[: self.page_size]
        child.depth += length
        child.content_id = _start_id(child.namespace, child.depth, child.key)
        child.parent = head
        head.children[child.edge] = child
        if child in self.policy:  # its size changed: let size-aware policies re-rank it
            self.policy.discard(child)
            self.policy.add(child)
        return head

    def _lookup(
        self, ids: tuple[int, ...], end: int, extra_key: str | None
    ) -> tuple[list[RadixNode], int, list[torch.Tensor]]:
        """Read-only descent along ``ids[:end]``: the matched nodes, the length, the slots."""
        node, pos = self.root, 0
        nodes: list[RadixNode] = []
        values: list[torch.Tensor] = []
        while pos < end:
            child = node.children.get(
                child_key(ids, pos, self.page_size, node is self.root, extra_key)
            )
            if child is None:
                break
            assert child.value is not None
            length = common_len(child.key, ids, pos, end, self.page_size)
            nodes.append(child)
            values.append(child.value[:length])
            node, pos = child, pos + length
            if length < child.num_tokens:
                break
        return nodes, pos, values

    def _walk(
        self,
        ids: tuple[int, ...],
        end: int,
        extra_key: str | None,
        path: list[RadixNode],
        *,
        hit_from: int | None,
        priority: int | None,
        stamp: bool = True,
    ) -> RadixNode:
        """Descend along ``ids[:end]`` (known to match ``len(path)`` nodes), split where the match
        ends inside a node, stamp every matched node. A node ending past ``hit_from`` gets one
        hit (``None``: no hits). Appends the matched nodes to ``path``; returns the last one."""
        now = self._clock
        policy = self.policy
        node, pos = self.root, 0
        while pos < end:
            child = node.children.get(
                child_key(ids, pos, self.page_size, node is self.root, extra_key)
            )
            if child is None:
                break
            length = common_len(child.key, ids, pos, end, self.page_size)
            if length < child.num_tokens:
                child = self._split(child, length)
            path.append(child)
            if stamp:
                child.last_access_time = now
                if hit_from is not None and pos + length > hit_from:
                    child.hit_count += 1
                if priority is not None and priority > child.priority:
                    child.priority = priority
                policy.touch(child)
            node, pos = child, pos + length
        return node

    @staticmethod
    def _saved_stats(nodes: list[RadixNode]) -> list[tuple[int, int, int]]:
        return [(n.last_access_time, n.hit_count, n.priority) for n in nodes]

    def _restore(
        self, clock: int, path: list[RadixNode], saved: list[tuple[int, int, int]]
    ) -> None:
        """Undo stamps after a failure (the i-th walked node stands for the i-th looked-up one:
        a split head copied its stats before it was stamped), then rebuild the policy's set."""
        self._clock = clock
        for node, (time, hits, priority) in zip(path, saved, strict=False):
            node.last_access_time, node.hit_count, node.priority = time, hits, priority
        self._resync_policy()

    def _resync_policy(self) -> None:
        """Make the policy's candidate set the tree's unlocked leaves again (error path only).

        A policy that fails again here is left as it is: the original error is what is raised.
        """
        with contextlib.suppress(Exception):  # the caller re-raises the first failure
            self.policy.clear()
            for node in self._nodes():
                if node.lock_ref == 0 and not node.children:
                    self.policy.add(node)

    def _nodes(self) -> list[RadixNode]:
        nodes, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            nodes.append(node)
            stack.extend(node.children.values())
        return nodes

    def match_prefix(
        self, key: CacheKey | Sequence[int], *, record_hit: bool = True, gather: bool = True
    ) -> MatchResult:
        """The longest cached prefix of ``key`` (in whole pages) and the node it ends at.

        Every matched node gets the current logical time and one more hit, then the policy is
        told (``touch``). ``device_indices`` is a fresh int64 tensor on the allocator's device.

        ``record_hit=False`` is a probe (an engine ranking its waiting queue): it changes no
        statistic, hit count, clock or recency, and splits nothing. ``gather=False`` skips
        building the index tensor (``device_indices`` is empty; ``prefix_len`` and ``last_node``
        are still right). The key is validated before anything changes; a failing policy leaves
        the cache as it was and raises ``PolicyError``.
        """
        ids, extra_key = check_key(key)
        end = len(ids) - len(ids) % self.page_size
        nodes, pos, values = self._lookup(ids, end, extra_key)
        clock, saved = self._clock, self._saved_stats(nodes)
        path: list[RadixNode] = []
        try:
            if record_hit:
                self._clock += 1
            node = self._walk(
                ids, end, extra_key, path, hit_from=0, priority=None, stamp=record_hit
            )
        except Exception as exc:
            self._restore(clock, path, saved)
            raise policy_error(self.policy, "match_prefix", exc) from exc
        indices = torch.cat(values) if gather and values else self._empty
        if not record_hit:
            return MatchResult(device_indices=indices, last_node=node, prefix_len=pos)
        stats = self.stats
        stats.match_queries += 1
        stats.match_query_tokens += len(ids)
        stats.hit_tokens += pos
        return MatchResult(device_indices=indices, last_node=node, prefix_len=pos)

    def touch_prefix(self, key: CacheKey | Sequence[int]) -> None:
        """Refresh the recency of ``key``'s cached path without counting a hit or a query
        (SGLang's ``touch_prefix`` for requests that keep waiting)."""
        ids, extra_key = check_key(key)
        end = len(ids) - len(ids) % self.page_size
        nodes, _, _ = self._lookup(ids, end, extra_key)
        clock, saved = self._clock, self._saved_stats(nodes)
        path: list[RadixNode] = []
        try:
            self._clock += 1
            self._walk(ids, end, extra_key, path, hit_from=None, priority=None)
        except Exception as exc:
            self._restore(clock, path, saved)
            raise policy_error(self.policy, "touch_prefix", exc) from exc

    def path_indices(self, node: RadixNode) -> torch.Tensor:
        """The slots from the root to ``node`` (int64, on device), root side first."""
        self._check_handle(node)
        values = []
        x: RadixNode | None = node
        while x is not None and x is not self.root:
            assert x.value is not None
            values.append(x.value)
            x = x.parent
        if not values:
            return self._empty
        values.reverse()
        return torch.cat(values) if len(values) > 1 else values[0].clone()

    def insert(
        self,
        key: CacheKey | Sequence[int],
        indices: torch.Tensor,
        *,
        priority: int = 0,
        hits_after: int | None = None,
    ) -> int:
        """Cache ``key[:aligned]`` with slots ``indices[:aligned]``; return the length already
        cached. See the class docstring for who owns which slots afterwards.

        ``priority`` (for the ``priority`` policy) is raised to at least ``priority`` on every
        node of the path, as SGLang does. ``hits_after=n`` counts the hits at insert instead of
        at match (engines that probe with ``record_hit=False``): each node of the path ending
        past token ``n`` gets one hit, so a request that re-inserts its growing prefix (chunked
        prefill) with ``n`` = what it inserted before counts each node once.

        All or nothing: the key, the indices and the ownership of the slots the cache takes
        (new ones and duplicates it frees) are checked before anything changes; a failing policy
        or ``allocator.free`` leaves cache and allocator as they were.
        """
        ids, extra_key = check_key(key)
        indices = check_indices(indices, len(ids), self.device)
        check_int(priority, "priority")
        if hits_after is not None:
            check_int(hits_after, "hits_after", minimum=0)
        end = len(ids) - len(ids) % self.page_size
        nodes, pos, values = self._lookup(ids, end, extra_key)
        duplicates = self._empty
        if pos:
            cached = torch.cat(values) if len(values) > 1 else values[0]
            given = indices[:pos]
            duplicates = given[given != cached]
        taken = torch.cat([indices[pos:end], duplicates])
        take_ownership(self.allocator, taken)  # raises (nothing changed) on a slot not held
        clock, saved = self._clock, self._saved_stats(nodes)
        path: list[RadixNode] = []
        leaf: RadixNode | None = None
        in_free = False
        try:
            self._clock += 1
            node = self._walk(ids, end, extra_key, path, hit_from=hits_after, priority=priority)
            if pos < end:
                leaf = RadixNode(self._clock, priority)
                if hits_after is not None and end > hits_after:
                    leaf.hit_count = 1
                leaf.parent = node
                leaf.edge = child_key(ids, pos, self.page_size, node is self.root, extra_key)
                leaf.key, leaf.value = ids[pos:end], indices[pos:end].clone()
                leaf.num_tokens = leaf.new_tokens = end - pos
                leaf.depth, leaf.namespace = pos, extra_key
                leaf.content_id = _start_id(extra_key, pos, leaf.key)
                node.children[leaf.edge] = leaf
                self.policy.discard(node)  # no longer a leaf
                self.policy.add(leaf)
            if duplicates.numel():
                in_free = True
                self.allocator.free(duplicates)
        except Exception as exc:
            if leaf is not None and leaf.parent is not None:
                del leaf.parent.children[leaf.edge]
                leaf.parent = None
            self._restore(clock, path, saved)
            release_ownership(self.allocator, taken)
            if in_free:
                raise
            raise policy_error(self.policy, "insert", exc) from exc
        if leaf is not None:
            self._evictable += leaf.num_tokens
            self.stats.inserted_tokens += leaf.num_tokens
            emit_stored(self.events, self.name, leaf.num_tokens, extra_key=extra_key)
        return pos

    # -- locks ----------------------------------------------------------------------------------

    def _check_handle(self, node: Any) -> None:
        if not isinstance(node, RadixNode):
            raise TypeError(f"expected a RadixNode from match_prefix, got {type(node).__name__}")
        top = node
        while top.parent is not None:
            top = top.parent
        if top is not self.root:
            raise ValueError(f"{node!r} is not cached here (evicted, reset, or from another cache)")

    def _path_to_root(self, node: RadixNode) -> list[RadixNode]:
        path = []
        x: RadixNode | None = node
        while x is not None and x is not self.root:
            path.append(x)
            x = x.parent
        return path

    def inc_lock_ref(self, node: RadixNode) -> int:
        """Lock the prefix ending at ``node`` (one running request more uses it).

        Returns the change of ``evictable_size()`` (zero or negative), as SGLang does. Only
        ``dec_lock_ref(node)`` with this same handle undoes it.
        """
        self._check_handle(node)
        path = self._path_to_root(node)
        unlocked = [x for x in path if x.lock_ref == 0]
        for x in path:
            x.lock_ref += 1
        node.own_locks += 1
        try:
            for x in unlocked:
                self.policy.discard(x)
        except Exception as exc:
            for x in path:
                x.lock_ref -= 1
            node.own_locks -= 1
            self._resync_policy()
            raise policy_error(self.policy, "inc_lock_ref", exc) from exc
        moved = sum(x.num_tokens for x in unlocked)
        self._evictable -= moved
        self._protected += moved
        return -moved

    def dec_lock_ref(self, node: RadixNode) -> int:
        """Unlock the prefix ending at ``node``; returns the change of ``evictable_size()``.

        ``node`` must be a handle this cache locked with ``inc_lock_ref`` and not yet unlocked
        as often: unlocking an ancestor of a locked node, or the root, is an error that changes
        nothing (it would drive a lock count negative or free a running request's prefix).
        """
        self._check_handle(node)
        if node.own_locks == 0:
            raise ValueError(
                f"{node!r} is not locked by this handle: dec_lock_ref without inc_lock_ref on "
                "it (an ancestor of a locked node, or the root, cannot be unlocked)"
            )
        path = self._path_to_root(node)
        freed = [x for x in path if x.lock_ref == 1]
        for x in path:
            x.lock_ref -= 1
        node.own_locks -= 1
        try:
            for x in freed:
                if not x.children:
                    self.policy.add(x)
        except Exception as exc:
            for x in path:
                x.lock_ref += 1
            node.own_locks += 1
            self._resync_policy()
            raise policy_error(self.policy, "dec_lock_ref", exc) from exc
        moved = sum(x.num_tokens for x in freed)
        self._evictable += moved
        self._protected -= moved
        return moved

    # -- eviction -------------------------------------------------------------------------------

    def _check_victim(self, leaf: Any) -> RadixNode:
        """What ``policy.pop()`` returned must be one of this cache's evictable leaves."""
        if (
            not isinstance(leaf, RadixNode)
            or leaf.parent is None
            or leaf.parent.children.get(leaf.edge) is not leaf
            or leaf.lock_ref
            or leaf.children
        ):
            raise ValueError(f"pop() returned {leaf!r}, which is not an evictable leaf here")
        return leaf

    def evict(self, params: EvictParams) -> EvictResult:
        """Free ``params.num_tokens`` cached tokens in policy order (see the module docstring).

        When less is evictable, frees all of it and says so in the result. ``swa_num_tokens``
        and ``mamba_num`` do not apply to this cache and are ignored. All or nothing: when the
        policy or ``allocator.free`` fails, every victim is put back and nothing is freed.
        """
        if not isinstance(params, EvictParams):
            raise TypeError(f"evict takes EvictParams, got {type(params).__name__}")
        need = params.num_tokens
        if need == 0:
            return EvictResult()
        page, policy, root = self.page_size, self.policy, self.root
        freed = 0
        victims: list[torch.Tensor] = []
        removed: list[tuple[RadixNode, RadixNode]] = []  # unlinked leaves and their parents
        cut: tuple[RadixNode, tuple[int, ...], torch.Tensor] | None = None
        in_free = False
        try:
            while freed < need:
                popped = policy.pop()
                if popped is None:
                    break
                leaf = self._check_victim(popped)
                assert leaf.value is not None and leaf.parent is not None
                remaining = -(-(need - freed) // page) * page  # still needed, in whole pages
                if self._exact and remaining < leaf.num_tokens:
                    keep = leaf.num_tokens - remaining
                    cut = (leaf, leaf.key, leaf.value)
                    victims.append(leaf.value[keep:])
                    leaf.key, leaf.value, leaf.num_tokens = leaf.key[:keep], leaf.value[:keep], keep
                    policy.add(leaf)
                    freed += remaining
                    break
                victims.append(leaf.value)
                freed += leaf.num_tokens
                parent = leaf.parent
                del parent.children[leaf.edge]
                leaf.parent = None
                removed.append((leaf, parent))
                if parent is not root and parent.lock_ref == 0 and not parent.children:
                    policy.add(parent)
            if victims:
                in_free = True
                self.allocator.free(torch.cat(victims) if len(victims) > 1 else victims[0])
        except Exception as exc:
            for leaf, parent in reversed(removed):
                leaf.parent = parent
                parent.children[leaf.edge] = leaf
            if cut is not None:
                leaf, key, value = cut
                leaf.key, leaf.value, leaf.num_tokens = key, value, len(key)
            self._resync_policy()
            if in_free:
                raise
            raise policy_error(self.policy, "evict", exc) from exc
        for leaf, _ in removed:
            leaf.value = None
        self._evictable -= freed
        stats = self.stats
        stats.evictions += 1
        stats.evicted_tokens += freed
        emit_removed(self.events, self.name, freed)
        return EvictResult(num_tokens=freed)

    # -- whole-cache operations -----------------------------------------------------------------

    def all_values_flatten(self) -> torch.Tensor:
        """Every cached slot (int64, on device), in depth-first order: for checks and debugging."""
        values = [n.value for n in self._nodes() if n.value is not None]
        return torch.cat(values) if values else self._empty

    def reset(self) -> None:
        """Free every cached slot back to the allocator and start an empty tree.

        Refused while running requests hold locks (their slots would be freed under them).
        When ``allocator.free`` fails, nothing changes.
        """
        if self._protected:
            raise RuntimeError(
                f"cannot reset: {self._protected} cached tokens are locked by running requests"
            )
        dropped = self.total_size()
        if dropped:
            self.allocator.free(self.all_values_flatten())
        with contextlib.suppress(Exception):  # the slots are freed: a fresh tree is right
            self.policy.clear()
        self._new_tree()
        if self.events is not None:
            self.events.cache_cleared(CacheCleared(cache=self.name, num_tokens=dropped))

    def __repr__(self) -> str:
        return (
            f"RadixCache(page_size={self.page_size}, evictable={self._evictable}, "
            f"protected={self._protected}, policy={type(self.policy).__name__})"
        )
