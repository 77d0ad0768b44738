"""``swa_radix``: a radix tree for hybrid full / sliding-window models, on the ``swa`` allocator.

Each node holds the full-pool slots of its tokens; the allocator maps each full slot to a window
slot. Sliding-window layers only ever read the last ``sliding_window_size`` tokens, so the window
side of an old prefix can go while its full side stays useful: window eviction *tombstones* a
node (``swa_tombstone = True``: its window slots are freed with ``allocator.free_swa``, its full
slots are kept). A cached prefix is usable only if its last ``sliding_window_size`` tokens after
the last tombstone are window-live (or no tombstone lies on its path); ``match_prefix`` returns
the longest such prefix, as SGLang's ``SWARadixCache._match_prefix_helper`` does.

Two evictable sets, each the configured policy (``new_policy()`` is called twice):

* full: unlocked, window-live leaves. Evicting one frees both sides, so its window tokens count
  in ``EvictResult.swa_num_tokens`` too.
* window: window-live nodes without a window lock, leaves *or internal*. Evicting one only
  tombstones it; a tombstoned leaf can never be matched (no live window follows it), so it
  becomes *dead* and full eviction reclaims dead leaves first, oldest first, before asking the
  policy.

``evict(EvictParams(num_tokens, swa_num_tokens))`` runs the full pass, then the window pass for
whatever window tokens are still missing. Both are exact: the last full victim keeps its head
and frees only its tail pages; the last window victim is split and only its head pages are
tombstoned (the tail stays live, which is the part a match ending there needs). So
``num_tokens`` freed is at most ``num_tokens`` asked rounded up to ``page_size``, and window
tokens freed at most the larger of the two requests rounded up.

Locks, as SGLang: ``inc_lock_ref(node)`` takes a full lock on every node up to the root and a
window lock only on the nodes covering the last ``sliding_window_size`` tokens, so older window
KV of a running request's prefix can still be tombstoned. A locked node is never evicted from
either pool. The window lock's extent is remembered on the handle in tokens (a later split of a
node on the path changes node boundaries, never token offsets), so ``dec_lock_ref(node)`` needs
no extra argument.

Insert ownership is the radix cache's: the cache owns ``indices[:aligned]``; for the part already
cached, passed slots that differ from the cached ones are freed (identical ones are kept), except
that a tombstoned, unlocked node is *revived* with the passed slots (their window side is live)
and its old full slots are freed; without that, a prompt ending within a window of a tombstone
could never be matched again. ``insert(..., swa_evicted_seqlen=s)`` says the caller already freed
the window side of the first ``s`` tokens (SGLang's ``req.swa_evicted_seqlen``): new tokens
before ``s`` are stored as a tombstone, and nodes before ``s`` are not revived.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from pydantic import Field

from kvplug_hookspecs import (
    CacheCleared,
    CacheEvents,
    CacheKey,
    EvictionPolicy,
    EvictParams,
    EvictResult,
    FrozenModel,
    MatchResult,
    SWATokenAllocator,
)

from .block_hashing import BlockHasher
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
    new_policy_instance,
    policy_error,
    rebuild_policies,
    release_ownership,
    start_content_id,
    take_ownership,
)
from .radix_events import RadixBlockHashes
from .radix_tree import child_key, common_len, descendants

__all__ = ["SWARadixCache", "SWARadixNode", "SWARadixOptions"]

_INF = float("inf")


class SWARadixOptions(FrozenModel):
    """Options of the ``swa_radix`` cache.

    ``sliding_window_size``: the attention window in tokens; ``None`` takes the allocator's.
    """

    sliding_window_size: int | None = Field(None, strict=True, gt=0)


class SWARadixNode(CandidateStats):
    """One edge: ``key`` token ids and ``value`` their full-pool slots (int64, on device).

    ``full_lock_ref`` counts requests whose prefix passes through here; ``swa_lock_ref`` those
    whose window covers it (always ``<= full_lock_ref``). ``swa_tombstone`` means the window side
    was freed. ``swa_lock_spans`` lists, per lock taken *at* this node, how many tokens its window
    lock covers. A freed node has ``parent is None``.
    """

    __slots__ = (
        "children",
        "edge",
        "full_lock_ref",
        "key",
        "parent",
        "swa_lock_ref",
        "swa_lock_spans",
        "swa_tombstone",
        "value",
    )

    def __init__(self, now: int, priority: int = 0) -> None:
        super().__init__(now, priority)
        self.children: dict[Any, SWARadixNode] = {}
        self.parent: SWARadixNode | None = None
        self.edge: Any = None
        self.key: tuple[int, ...] = ()
        self.value: torch.Tensor | None = None
        self.num_tokens = 0
        self.full_lock_ref = 0
        self.swa_lock_ref = 0
        self.swa_tombstone = False
        self.swa_lock_spans: list[int] | None = None

    def __repr__(self) -> str:
        return (
            f"SWARadixNode(id={self.node_id}, tokens={self.num_tokens}, "
            f"full_lock_ref={self.full_lock_ref}, swa_lock_ref={self.swa_lock_ref}, "
            f"tombstone={self.swa_tombstone}, children={len(self.children)})"
        )


class SWARadixCache(BuiltFromContext):
    """Radix-tree prefix cache with window tombstones over an ``SWATokenAllocator``.

    Sizes: ``evictable_size()`` / ``protected_size()`` / ``total_size()`` count full-pool tokens,
    ``swa_evictable_size()`` / ``swa_protected_size()`` / ``swa_total_size()`` window-pool tokens.
    With ``R`` tokens held by running requests in each pool,
    ``full_available + evictable + protected + R == size`` and
    ``swa_available + swa_evictable + swa_protected + R_window == swa_size``.
    """

    name = "swa_radix"
    is_chunk_cache = False

    def __init__(
        self,
        allocator: SWATokenAllocator,
        new_policy: Callable[[], EvictionPolicy] | None = None,
        *,
        page_size: int | None = None,
        events: CacheEvents | None = None,
        block_hasher: BlockHasher | None = None,
        options: SWARadixOptions | None = None,
    ) -> None:
        options = cache_options("swa_radix", options, SWARadixOptions)
        needed = ("free_swa", "swa_available_size", "full_available_size")
        missing = [m for m in needed if not hasattr(allocator, m)]
        if missing:
            raise TypeError(
                f"swa_radix needs a sliding-window allocator (e.g. 'swa'); "
                f"{type(allocator).__name__} has no {', '.join(missing)}"
            )
        window = options.sliding_window_size
        if window is None:
            window = getattr(allocator, "sliding_window_size", None)
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"sliding_window_size must be a positive int, got {window!r}")
        page_size = cache_page_size(page_size, allocator)
        full_policy, swa_policy = new_policy_instance(new_policy), new_policy_instance(new_policy)
        if full_policy is swa_policy:
            raise ValueError("new_policy() must return a fresh policy on every call")
        self.allocator = allocator
        self.sliding_window_size = window
        self.page_size = page_size
        self.device = torch.device(allocator.device)
        self.events = events
        self.block_hasher = block_hasher or BlockHasher()
        """How pages are hashed for the KV events (kvplug's scheme, or vLLM's)."""
        self.options = options
        self.stats = CacheStats()
        self.full_policy = full_policy
        self.swa_policy = swa_policy
        self._empty = torch.empty(0, dtype=torch.int64, device=self.device)
        self._clock = 0
        self._new_tree()

    def _new_tree(self) -> None:
        self.root = SWARadixNode(self._clock)
        self.root.value = self._empty
        self.root.full_lock_ref = self.root.swa_lock_ref = 1  # never evicted, never in a set
        # page hashes of the full side for the KV events, only when someone observes them
        self._hashes = None
        if self.events is not None:
            self._hashes = RadixBlockHashes(
                self.events, self.name, self.root, self.page_size, self.block_hasher
            )
        self._dead: dict[SWARadixNode, None] = {}  # unlocked tombstoned leaves, oldest first
        self._full_evictable = self._full_protected = 0
        self._swa_evictable = self._swa_protected = 0

    # -- sizes ----------------------------------------------------------------------------------

    def evictable_size(self) -> int:
        """Cached full-pool tokens no running request uses."""
        return self._full_evictable

    def protected_size(self) -> int:
        """Cached full-pool tokens locked by running requests."""
        return self._full_protected

    def total_size(self) -> int:
        """All cached full-pool tokens (tombstoned ones included)."""
        return self._full_evictable + self._full_protected

    def swa_evictable_size(self) -> int:
        """Cached window-live tokens outside every running request's window lock."""
        return self._swa_evictable

    def swa_protected_size(self) -> int:
        """Cached window-live tokens inside a running request's window lock."""
        return self._swa_protected

    def swa_total_size(self) -> int:
        """All cached window-live tokens."""
        return self._swa_evictable + self._swa_protected

    # -- evictable-set membership ---------------------------------------------------------------

    def _refresh(self, node: SWARadixNode) -> None:
        """Put ``node`` in exactly the evictable sets its state allows (O(log N))."""
        if node is self.root:
            return
        free_leaf = not node.children and node.full_lock_ref == 0
        full, swa = self.full_policy, self.swa_policy
        if free_leaf and node.swa_tombstone:
            self._dead[node] = None
        else:
            self._dead.pop(node, None)
        if free_leaf and not node.swa_tombstone:
            if node not in full:
                full.add(node)
        else:
            full.discard(node)
        if not node.swa_tombstone and node.swa_lock_ref == 0:
            if node not in swa:
                swa.add(node)
        else:
            swa.discard(node)

    # -- tree helpers ---------------------------------------------------------------------------

    def _split(self, child: SWARadixNode, length: int) -> SWARadixNode:
        """Cut ``child`` after ``length`` tokens: a new node takes the head and child's place.

        The head inherits locks, tombstone and statistics; ``child`` (the tail) keeps its
        identity, so a lock handle and its window spans stay valid.
        """
        parent, value = child.parent, child.value
        assert parent is not None and value is not None
        head = SWARadixNode(child.creation_time, child.priority)
        head.last_access_time = child.last_access_time
        head.hit_count = child.hit_count
        head.full_lock_ref = child.full_lock_ref
        head.swa_lock_ref = child.swa_lock_ref
        head.swa_tombstone = child.swa_tombstone
        head.parent, head.edge = child.parent, child.edge
        head.key, head.value, head.num_tokens = child.key[:length], value[:length], length
        head.depth, head.namespace, head.new_tokens = child.depth, child.namespace, child.new_tokens
        head.content_id, head.turn = child.content_id, child.turn  # the head starts where it did
        parent.children[head.edge] = head
        child.key, child.value = child.key[length:], value[length:]
        child.num_tokens -= length
        child.depth += length
        child.content_id = start_content_id(child.namespace, child.depth, child.key)
        child.edge = child.key[0] if self.page_size == 1 else child.key[: self.page_size]
        child.parent = head
        head.children[child.edge] = child
        if self._hashes is not None:  # no event: a split changes no cached content
            self._hashes.split(head, child)
        for policy in (self.full_policy, self.swa_policy):
            if child in policy:  # its size changed: let size-aware policies re-rank it
                policy.discard(child)
                policy.add(child)
        self._refresh(head)
        return head

    def _check_handle(self, node: Any) -> None:
        if not isinstance(node, SWARadixNode):
            raise TypeError(
                f"expected an SWARadixNode from match_prefix, got {type(node).__name__}"
            )
        top = node
        while top.parent is not None:
            top = top.parent
        if top is not self.root:
            raise ValueError(f"{node!r} is not cached here (evicted, reset, or from another cache)")

    # -- failures -------------------------------------------------------------------------------

    def _counters(self) -> tuple[int, int, int, int]:
        return self._full_evictable, self._full_protected, self._swa_evictable, self._swa_protected

    def _set_counters(self, counters: tuple[int, int, int, int]) -> None:
        (
            self._full_evictable,
            self._full_protected,
            self._swa_evictable,
            self._swa_protected,
        ) = counters

    def _resync(self, recheck: bool = True) -> None:
        """Rebuild both policies' sets and the dead-leaf list from the tree (error path only);
        policies that fail again are quarantined (``common.rebuild_policies``)."""

        def refill() -> None:
            self._dead.clear()
            for node in self._nodes():
                self._refresh(node)

        rebuild_policies(self, ("full_policy", "swa_policy"), refill, recheck=recheck)

    # -- lookup and insert ----------------------------------------------------------------------

    def _lookup(
        self, ids: tuple[int, ...], end: int, extra_key: str | None
    ) -> list[tuple[SWARadixNode, int, int]]:
        """Read-only descent: ``(node, pos, length)`` per matched node (the last may match only
        its first ``length`` tokens)."""
        node, pos = self.root, 0
        parts: list[tuple[SWARadixNode, int, int]] = []
        while pos < end:
            child = node.children.get(
                child_key(ids, pos, self.page_size, node is self.root, extra_key)
            )
            if child is None:
                break
            length = common_len(child.key, ids, pos, end, self.page_size)
            parts.append((child, pos, length))
            node, pos = child, pos + length
            if length < child.num_tokens:
                break
        return parts

    def _descend(
        self, ids: tuple[int, ...], end: int, extra_key: str | None, path: list[SWARadixNode]
    ) -> None:
        """Descend along ``ids[:end]``, splitting where the match ends inside a node; appends the
        matched nodes to ``path``. Stamps nothing."""
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
            node, pos = child, pos + length

    def match_prefix(
        self, key: CacheKey | Sequence[int], *, record_hit: bool = True, gather: bool = True
    ) -> MatchResult:
        """The longest cached prefix of ``key`` whose window is live (in whole pages).

        A prefix counts if no tombstone lies on its path, or if at least ``sliding_window_size``
        window-live tokens follow the last tombstone. Matched nodes get increasing logical times
        from the root down (so window eviction tombstones root-side nodes first) and one more hit.
        ``record_hit=False`` is a probe (no statistic, hit count, clock or recency changes);
        ``gather=False`` returns empty ``device_indices``. The key is checked before anything
        changes; a failing policy changes nothing and raises ``PolicyError``.
        """
        ids, extra_key = check_key(key)
        if self.policy_recheck:  # a policy failed since its view was rebuilt: rebuild it first
            self._resync(recheck=False)
        end = len(ids) - len(ids) % self.page_size
        window = self.sliding_window_size
        path: list[SWARadixNode] = []
        try:
            self._descend(ids, end, extra_key, path)
        except Exception as exc:
            self._resync()
            raise policy_error(self.full_policy, "match_prefix", exc) from exc
        pos = 0
        since_tombstone = _INF
        best_len, best_count = 0, 0
        for count, node in enumerate(path):
            if node.swa_tombstone:
                if since_tombstone >= window:
                    best_len, best_count = pos, count
                since_tombstone = 0
            else:
                since_tombstone += node.num_tokens
            pos += node.num_tokens
        if since_tombstone >= window:
            best_len, best_count = pos, len(path)
        best = path[:best_count]
        if record_hit:
            clock = self._clock
            saved = [(n.last_access_time, n.hit_count) for n in best]
            full, swa = self.full_policy, self.swa_policy
            try:
                self._clock += 1
                for node in best:
                    self._clock += 1
                    node.last_access_time = self._clock
                    node.hit_count += 1
                    full.touch(node)
                    swa.touch(node)
            except Exception as exc:
                self._clock = clock
                for node, (time, hits) in zip(best, saved, strict=True):
                    node.last_access_time, node.hit_count = time, hits
                self._resync()
                raise policy_error(self.full_policy, "match_prefix", exc) from exc
            stats = self.stats
            stats.match_queries += 1
            stats.match_query_tokens += len(ids)
            stats.hit_tokens += best_len
        if best_count == 0:
            return MatchResult(device_indices=self._empty, last_node=self.root, prefix_len=0)
        values = [n.value for n in best if n.value is not None]
        if not gather:
            indices = self._empty
        else:
            indices = torch.cat(values) if len(values) > 1 else values[0]
        return MatchResult(device_indices=indices, last_node=best[-1], prefix_len=best_len)

    def path_indices(self, node: SWARadixNode) -> torch.Tensor:
        """The full slots from the root to ``node`` (int64, on device), root side first."""
        self._check_handle(node)
        values = []
        x: SWARadixNode | None = node
        while x is not None and x is not self.root:
            assert x.value is not None
            values.append(x.value)
            x = x.parent
        values.reverse()
        return torch.cat(values) if values else self._empty

    def insert(
        self,
        key: CacheKey | Sequence[int],
        indices: torch.Tensor,
        *,
        priority: int = 0,
        swa_evicted_seqlen: int = 0,
    ) -> int:
        """Cache ``key[:aligned]`` with full slots ``indices[:aligned]``; return the length already
        cached. The cache owns those slots afterwards (see the module docstring).

        ``swa_evicted_seqlen``: how many leading tokens already had their window side freed by
        the caller (a multiple of ``page_size``, or the key length); 0 when every window slot
        is live. All or nothing: key, indices and the ownership of every slot the cache takes
        are checked before anything changes; a failing policy or ``allocator.free`` leaves
        cache and allocator as they were.
        """
        ids, extra_key = check_key(key)
        indices = check_indices(indices, len(ids), self.device)
        check_int(priority, "priority")
        check_int(swa_evicted_seqlen, "swa_evicted_seqlen")
        if not 0 <= swa_evicted_seqlen <= len(ids) or (
            swa_evicted_seqlen % self.page_size and swa_evicted_seqlen != len(ids)
        ):
            raise ValueError(
                f"swa_evicted_seqlen={swa_evicted_seqlen} must be a multiple of "
                f"page_size={self.page_size} (or the key length) between 0 and the key "
                f"length {len(ids)}"
            )
        if self.policy_recheck:  # a policy failed since its view was rebuilt: rebuild it first
            self._resync(recheck=False)
        end = len(ids) - len(ids) % self.page_size
        parts = self._lookup(ids, end, extra_key)
        pos = parts[-1][1] + parts[-1][2] if parts else 0
        # decide per matched node, before anything changes: revive a tombstone from the fresh
        # window KV (see the module docstring), or free the caller's duplicate slots
        revive: list[bool] = []
        given_parts: list[torch.Tensor] = []
        cached_parts: list[torch.Tensor] = []
        taken_parts: list[torch.Tensor] = []
        for node, start, length in parts:
            assert node.value is not None
            given, cached = indices[start : start + length], node.value[:length]
            fresh = (
                node.swa_tombstone
                and (node.full_lock_ref == 0 or hasattr(self.allocator, "move_swa"))
                and swa_evicted_seqlen <= start
                and not bool((given == cached).any())
            )
            revive.append(fresh)
            if fresh:
                taken_parts.append(given)
            else:
                given_parts.append(given)
                cached_parts.append(cached)
        duplicates = self._empty
        if given_parts:
            given = torch.cat(given_parts)
            duplicates = given[given != torch.cat(cached_parts)]
        taken = torch.cat([*taken_parts, indices[pos:end], duplicates])
        take_ownership(self.allocator, taken)  # raises (nothing changed) on a slot not held

        clock, counters = self._clock, self._counters()
        saved = [(n.last_access_time, n.priority) for n, _, _ in parts]
        path: list[SWARadixNode] = []
        added: list[SWARadixNode] = []
        undo: list[Callable[[], None]] = []
        in_free = False
        full, swa = self.full_policy, self.swa_policy
        try:
            self._clock += 1
            self._descend(ids, end, extra_key, path)
            for node, fresh, (_, start, length) in zip(path, revive, parts, strict=True):
                self._clock += 1
                node.last_access_time = self._clock
                if priority > node.priority:
                    node.priority = priority
                full.touch(node)
                swa.touch(node)
                if fresh:
                    self._revive(node, indices[start : start + length], undo)
            node = path[-1] if path else self.root
            new_tokens = 0
            if pos < end:
                live_from = min(max(swa_evicted_seqlen, pos), end)
                if live_from == end:
                    # Every new token already lost its window: nothing a match could use.
                    in_free = True
                    self.allocator.free(indices[pos:end])
                    in_free = False
                else:
                    if live_from > pos:
                        node = self._add_node(
                            node,
                            ids[pos:live_from],
                            indices[pos:live_from].clone(),
                            child_key(ids, pos, self.page_size, node is self.root, extra_key),
                            True,
                            priority,
                            added,
                            (pos, extra_key, end - pos),
                        )
                    self._add_node(
                        node,
                        ids[live_from:end],
                        indices[live_from:end].clone(),
                        child_key(ids, live_from, self.page_size, node is self.root, extra_key),
                        False,
                        priority,
                        added,
                        (live_from, extra_key, end - pos),
                    )
                    new_tokens = end - pos
            if duplicates.numel():
                in_free = True
                self.allocator.free(duplicates)
        except Exception as exc:
            for node in reversed(added):
                if node.parent is not None:
                    del node.parent.children[node.edge]
                    node.parent = None
            for action in reversed(undo):
                action()
            self._clock = clock
            for node, (time, prio) in zip(path, saved, strict=False):
                node.last_access_time, node.priority = time, prio
            self._set_counters(counters)
            self._resync()
            release_ownership(self.allocator, taken)
            if in_free:
                raise
            raise policy_error(self.full_policy, "insert", exc) from exc
        if new_tokens:
            self.stats.inserted_tokens += new_tokens
            if self._hashes is not None:
                for node in added:  # the full side is cached, window-live or not
                    self._hashes.stored(node)
        return pos

    def _add_node(
        self,
        parent: SWARadixNode,
        key: tuple[int, ...],
        value: torch.Tensor,
        edge: Any,
        tombstone: bool,
        priority: int,
        added: list[SWARadixNode],
        features: tuple[int, str | None, int] = (0, None, 0),
    ) -> SWARadixNode:
        """``features``: the new node's depth, namespace and the tokens its request added."""
        node = SWARadixNode(self._clock, priority)
        node.parent, node.edge, node.key, node.value = parent, edge, key, value
        node.num_tokens = len(key)
        node.depth, node.namespace, node.new_tokens = features
        node.content_id = start_content_id(features[1], features[0], key)
        node.swa_tombstone = tombstone
        parent.children[edge] = node
        added.append(node)
        self._full_evictable += node.num_tokens
        if not tombstone:
            self._swa_evictable += node.num_tokens
        self._refresh(parent)
        self._refresh(node)
        return node

    def _revive(
        self, node: SWARadixNode, given: torch.Tensor, undo: list[Callable[[], None]]
    ) -> None:
        """Make a window tombstone live again from a request's fresh slots ``given``.

        Unlocked: the node takes ``given`` and its old full slots are freed (their window side
        is already gone). Locked (a running request reads its full slots): the node keeps its
        full slots and takes ``given``'s window slots (``allocator.move_swa``); ``given``'s
        full side is then freed. Either way a window's worth of fresh KV is cached, not lost.
        """
        old = node.value
        assert old is not None
        if node.full_lock_ref == 0:
            self.allocator.free(old)  # their window side is already gone
            node.value = given.clone()
        else:
            move = self.allocator.move_swa  # type: ignore[attr-defined]  # checked at lookup
            move(given, old)
            undo.append(functools.partial(move, old, given))
            self.allocator.free(given)  # only the full side: its window slots moved to ``old``
        node.swa_tombstone = False
        if node.swa_lock_ref:
            self._swa_protected += node.num_tokens
        else:
            self._swa_evictable += node.num_tokens
        self._refresh(node)

    # -- locks ----------------------------------------------------------------------------------

    def inc_lock_ref(self, node: SWARadixNode) -> int:
        """Lock the prefix ending at ``node``: full side up to the root, window side over its last
        ``sliding_window_size`` tokens. Returns the change of ``evictable_size()`` (<= 0)."""
        self._check_handle(node)
        if self.policy_recheck:  # a policy failed since its view was rebuilt: rebuild it first
            self._resync(recheck=False)
        root, window = self.root, self.sliding_window_size
        if node is root:
            root.swa_lock_spans = [*(root.swa_lock_spans or []), 0]
            return 0
        covered, x = 0, node
        while x is not root and covered < window:
            assert x.parent is not None
            if x.swa_tombstone:
                raise ValueError(
                    f"cannot lock {node!r}: its last {window} tokens include a tombstoned node "
                    "(lock the last_node of a fresh match_prefix)"
                )
            covered += x.num_tokens
            x = x.parent
        counters = self._counters()
        moved, covered, x = 0, 0, node
        chain: list[tuple[SWARadixNode, bool]] = []
        try:
            while x is not root:
                assert x.parent is not None
                if x.full_lock_ref == 0:
                    moved += x.num_tokens
                x.full_lock_ref += 1
                in_window = covered < window
                if in_window:
                    if x.swa_lock_ref == 0:
                        self._swa_evictable -= x.num_tokens
                        self._swa_protected += x.num_tokens
                    x.swa_lock_ref += 1
                    covered += x.num_tokens
                chain.append((x, in_window))
                self._refresh(x)
                x = x.parent
        except Exception as exc:
            for y, in_window in chain:
                y.full_lock_ref -= 1
                if in_window:
                    y.swa_lock_ref -= 1
            self._set_counters(counters)
            self._resync()
            raise policy_error(self.full_policy, "inc_lock_ref", exc) from exc
        if node.swa_lock_spans is None:
            node.swa_lock_spans = []
        node.swa_lock_spans.append(covered)
        self._full_evictable -= moved
        self._full_protected += moved
        return -moved

    def dec_lock_ref(self, node: SWARadixNode) -> int:
        """Undo one ``inc_lock_ref(node)``; returns the change of ``evictable_size()`` (>= 0).

        A handle this cache never locked (an ancestor of a locked node, the root) is an error
        and changes nothing."""
        self._check_handle(node)
        if not node.swa_lock_spans:
            raise ValueError(
                f"{node!r} is not locked: dec_lock_ref without inc_lock_ref on this handle "
                "(an ancestor of a locked node, or the root, cannot be unlocked)"
            )
        if self.policy_recheck:  # a policy failed since its view was rebuilt: rebuild it first
            self._resync(recheck=False)
        root = self.root
        if node is root:
            node.swa_lock_spans.pop()
            return 0
        span = node.swa_lock_spans[-1]
        counters = self._counters()
        moved, covered, x = 0, 0, node
        chain: list[tuple[SWARadixNode, bool]] = []
        try:
            while x is not root:
                assert x.parent is not None
                x.full_lock_ref -= 1
                if x.full_lock_ref == 0:
                    moved += x.num_tokens
                in_window = covered < span
                if in_window:
                    x.swa_lock_ref -= 1
                    if x.swa_lock_ref == 0:
                        self._swa_evictable += x.num_tokens
                        self._swa_protected -= x.num_tokens
                    covered += x.num_tokens
                chain.append((x, in_window))
                self._refresh(x)
                x = x.parent
        except Exception as exc:
            for y, in_window in chain:
                y.full_lock_ref += 1
                if in_window:
                    y.swa_lock_ref += 1
            self._set_counters(counters)
            self._resync()
            raise policy_error(self.full_policy, "dec_lock_ref", exc) from exc
        node.swa_lock_spans.pop()
        self._full_evictable += moved
        self._full_protected -= moved
        return moved

    # -- eviction -------------------------------------------------------------------------------

    def _next_full_victim(self) -> SWARadixNode | None:
        """A dead (tombstoned) leaf first: no match can use it; else the policy's choice."""
        if self._dead:
            node = next(iter(self._dead))
            del self._dead[node]
            return node
        popped = self.full_policy.pop()
        if popped is None:
            return None
        if (
            not isinstance(popped, SWARadixNode)
            or popped.parent is None
            or popped.parent.children.get(popped.edge) is not popped
            or popped.full_lock_ref
            or popped.children
            or popped.swa_tombstone
        ):
            raise ValueError(f"pop() returned {popped!r}, which is not an evictable leaf here")
        return popped

    def _next_swa_victim(self) -> SWARadixNode | None:
        popped = self.swa_policy.pop()
        if popped is None:
            return None
        if (
            not isinstance(popped, SWARadixNode)
            or popped.parent is None
            or popped.parent.children.get(popped.edge) is not popped
            or popped.swa_lock_ref
            or popped.swa_tombstone
        ):
            raise ValueError(f"pop() returned {popped!r}, which is not window-evictable here")
        return popped

    def evict(self, params: EvictParams) -> EvictResult:
        """Free ``params.num_tokens`` full and ``params.swa_num_tokens`` window tokens (see the
        module docstring); when less is evictable, free what can be and say so in the result.

        All or nothing when a policy fails or ``allocator.free`` fails: every victim is put
        back. If ``allocator.free_swa`` (called last) fails, the full-pool part stays done and
        only the window part is put back.
        """
        if not isinstance(params, EvictParams):
            raise TypeError(f"evict takes EvictParams, got {type(params).__name__}")
        full_need, swa_need = params.num_tokens, params.swa_num_tokens
        if full_need == 0 and swa_need == 0:
            return EvictResult()
        if self.policy_recheck:  # a policy failed since the last evict: see rebuild_policies
            self._resync(recheck=False)
        page = self.page_size
        full_freed = swa_freed = tombstoned = 0
        full_victims: list[torch.Tensor] = []
        swa_victims: list[torch.Tensor] = []
        counters = self._counters()
        undo: list[Callable[[], None]] = []
        removed: list[SWARadixNode] = []  # unlinked leaves, in eviction order (for the events)
        cut_leaf: SWARadixNode | None = None
        cut_pages = 0
        stage = "policy"
        try:
            while full_freed < full_need:
                leaf = self._next_full_victim()
                if leaf is None:
                    break
                assert leaf.value is not None and leaf.parent is not None
                cut = -(-(full_need - full_freed) // page) * page
                live = not leaf.swa_tombstone
                if cut < leaf.num_tokens:  # exact: free the tail pages, keep the head cached
                    keep = leaf.num_tokens - cut
                    old = (leaf.key, leaf.value, leaf.num_tokens)
                    undo.append(functools.partial(self._set_kv, leaf, *old))
                    full_victims.append(leaf.value[keep:])
                    self._set_kv(leaf, leaf.key[:keep], leaf.value[:keep], keep)
                    self._refresh(leaf)
                    cut_leaf, cut_pages = leaf, cut // page
                    freed = cut
                else:
                    full_victims.append(leaf.value)
                    freed = leaf.num_tokens
                    parent = leaf.parent
                    del parent.children[leaf.edge]
                    leaf.parent = None
                    undo.append(functools.partial(self._relink, leaf, parent))
                    removed.append(leaf)
                    self.swa_policy.discard(leaf)
                    self._refresh(parent)
                full_freed += freed
                self._full_evictable -= freed
                if live:
                    swa_freed += freed
                    self._swa_evictable -= freed
            full_counters = self._counters()
            full_undo = len(undo)
            while swa_freed < swa_need:
                node = self._next_swa_victim()
                if node is None:
                    break
                assert node.value is not None
                cut = -(-(swa_need - swa_freed) // page) * page
                target = self._split(node, cut) if cut < node.num_tokens else node
                assert target.value is not None
                swa_victims.append(target.value)
                target.swa_tombstone = True
                undo.append(functools.partial(setattr, target, "swa_tombstone", False))
                swa_freed += target.num_tokens
                tombstoned += target.num_tokens
                self._swa_evictable -= target.num_tokens
                self._refresh(target)
                if target is not node:
                    self._refresh(node)  # the live tail goes back into the window set
            if full_victims:
                stage = "free"
                self.allocator.free(torch.cat(full_victims))
            if swa_victims:
                stage = "free_swa"
                self.allocator.free_swa(torch.cat(swa_victims))
        except Exception as exc:
            if stage == "free_swa":  # the full part is done: put back only the window part
                for action in reversed(undo[full_undo:]):
                    action()
                self._set_counters(full_counters)
                self._resync()
                self._report_removed(removed, cut_leaf, cut_pages, full_freed)
                self._record_eviction(full_freed, full_freed - (swa_freed - tombstoned), 0)
                raise
            for action in reversed(undo):
                action()
            self._set_counters(counters)
            self._resync()
            if stage == "free":
                raise
            raise policy_error(self.full_policy, "evict", exc) from exc
        self._report_removed(removed, cut_leaf, cut_pages, full_freed)
        self._record_eviction(full_freed, swa_freed, tombstoned)
        return EvictResult(num_tokens=full_freed, swa_num_tokens=swa_freed)

    def _record_eviction(self, full_freed: int, swa_freed: int, tombstoned: int) -> None:
        stats = self.stats
        stats.evictions += 1
        stats.evicted_tokens += full_freed
        stats.swa_evicted_tokens += swa_freed
        emit_removed(self.events, self.name, tombstoned, reason="swa_evicted")  # no hashes

    def _report_removed(
        self, removed: list[SWARadixNode], cut: SWARadixNode | None, cut_pages: int, freed: int
    ) -> None:
        """The ``PrefixRemoved`` of an eviction's full side, with the freed pages' hashes
        (without an observer, only the counts are kept)."""
        if self._hashes is not None and freed:
            self._hashes.removed(removed, cut, cut_pages, freed)

    @staticmethod
    def _set_kv(node: SWARadixNode, key: tuple[int, ...], value: torch.Tensor, n: int) -> None:
        node.key, node.value, node.num_tokens = key, value, n

    @staticmethod
    def _relink(node: SWARadixNode, parent: SWARadixNode) -> None:
        node.parent = parent
        parent.children[node.edge] = node

    # -- whole-cache operations -----------------------------------------------------------------

    def _nodes(self) -> list[SWARadixNode]:
        return descendants(self.root)

    def all_values_flatten(self) -> torch.Tensor:
        """Every cached full slot (int64, on device): for checks and debugging."""
        values = [n.value for n in self._nodes() if n.value is not None]
        return torch.cat(values) if values else self._empty

    def reset(self) -> None:
        """Free every cached slot (both pools) and start an empty tree.

        Refused while running requests hold locks (their slots would be freed under them).
        """
        if self._full_protected:
            raise RuntimeError(
                f"cannot reset: {self._full_protected} cached tokens are locked by running requests"
            )
        dropped = self.total_size()
        if dropped:
            self.allocator.free(self.all_values_flatten())  # raises: nothing changed
        with contextlib.suppress(Exception):  # the slots are freed: a fresh tree is right
            self.full_policy.clear()
            self.swa_policy.clear()
        self._new_tree()
        if self.events is not None:
            self.events.cache_cleared(CacheCleared(cache=self.name, num_tokens=dropped))

    def __repr__(self) -> str:
        return (
            f"SWARadixCache(window={self.sliding_window_size}, page_size={self.page_size}, "
            f"evictable={self._full_evictable}, protected={self._full_protected}, "
            f"swa_evictable={self._swa_evictable}, swa_protected={self._swa_protected}, "
            f"policy={type(self.full_policy).__name__})"
        )
