"""``radix``: an SGLang-style radix tree mapping token-id prefixes to KV slot indices.

Each edge holds a run of token ids and the int64 tensor of their KV slots. With ``page_size > 1``
keys are truncated to whole pages and every node holds whole pages, so a page is never split
between two nodes. A node's children are keyed by their first token (``page_size == 1``) or their
first page (a tuple); children of the root are keyed by ``(extra_key, first)``, so two
namespaces never share a node. A match that ends inside a node splits it; the split-off tail
keeps its access time (SGLang refreshes it too): the request did not use those tokens, so LRU
ranks them by their own last use (on issue 10's workload this costs 0.11 % of SGLang's LRU hit
tokens at page 1 and 0.03 % at page 16).

Speed (issue 10): a walk step is one dict lookup and one C-level compare of the whole edge;
every node keeps the slots of its whole path (``path_value``, a view), so a match returns one
tensor instead of gathering one per node; handles are checked in O(1) (an owner stamp, not a
walk to the root); only the one node that can be an eviction candidate (the last of a path:
every other one has a child) is touched, discarded or added; an ``insert`` given the ``prev``
match continues from it instead of walking the prefix again. All of it with every check on.
The walk, the hit stamps and the lock walks run in kvplug's compiled core (``kvplug.speedups``,
with a pure-Python reference); policies stay Python plugins.

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
import functools
import logging
from array import array
from collections.abc import Callable, Sequence
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

from .. import speedups
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
    new_policy_instance,
    policy_error,
    rebuild_policies,
    release_ownership,
    take_ownership,
)
from .radix_events import RadixBlockHashes
from .radix_tree import common_len, descendants
from .tiered import (
    ChainedRun,
    RunHasher,
    demote_runs,
    emit_tier_events,
    load_pages,
    prefetch_pages,
)

if TYPE_CHECKING:
    from ..tiers import TierHierarchy

__all__ = ["RadixCache", "RadixCacheOptions", "RadixNode"]

log = logging.getLogger(__name__)

_INT64_CODES = frozenset("ql") if array("l").itemsize == 8 else frozenset("q")
_NO_SLOTS = torch.empty(0, dtype=torch.int64)  # a node's slots before insert and once freed


class RadixCacheOptions(FrozenModel):
    """Options of the ``radix`` cache.

    ``granularity``: ``exact`` cuts the last victim leaf so an eviction frees the request
    rounded up to a page; ``leaf`` frees whole leaves (SGLang's behaviour, may free more).
    """

    granularity: Literal["exact", "leaf"] = "exact"


_ID_TOKENS = 16


def _start_id(namespace: str | None, depth: int, key: tuple[int, ...]) -> int:
    """A node's ``content_id``: where its content starts (namespace, depth, first tokens).

    Content evicted and cached again usually comes back longer (a conversation's next turn), so
    an identity of the start, not the end, lets a policy's ghost of it match. The first 16
    tokens: a leaf shorter than that is only matched by a re-insert that is no longer (a longer
    prefix would make every leaf of up to that length unmatchable by its own continuation).
    """
    return hash((namespace, depth, key[:_ID_TOKENS])) or 1


@functools.lru_cache(maxsize=4096)
def _evicted(num_tokens: int) -> EvictResult:
    """One validated ``EvictResult(num_tokens=n)`` per count (frozen, so safely shared)."""
    return EvictResult(num_tokens=num_tokens)


class RadixNode(CandidateStats):
    """One edge of the tree: ``key`` token ids, ``value`` their KV slots (int64, on device).

    ``edge`` is this node's key in ``parent.children``; ``lock_ref`` counts requests using the
    prefix that ends here or below, ``own_locks`` the locks taken *at* this node (the handles
    ``dec_lock_ref`` accepts). A freed node has ``parent is None``; ``owner`` is the tree (a
    token ``reset`` renews) it was created in. ``path_value`` holds the slots from the root to
    its end (``value``, the view of its tail, is derived from it: a split or an exact cut then
    slices one tensor, not two): a cached node's path never changes. ``depth + num_tokens``
    is where it ends; ``path_hash`` hashes its namespace and every token from the root to its
    end (``0`` for a new leaf or after an exact eviction cut its tail, until a walk ends at it):
    what ``insert(prev=...)`` checks. ``content_id`` identifies where its content starts (see
    ``_start_id``).
    """

    __slots__ = (
        "children",
        "edge",
        "key",
        "lock_ref",
        "own_locks",
        "owner",
        "parent",
        "path_hash",
        "path_value",
    )

    def __init__(self, now: int, priority: int = 0, owner: object = None) -> None:
        super().__init__(now, priority)
        self.owner = owner
        self.children: dict[Any, RadixNode] = {}
        self.parent: RadixNode | None = None
        self.edge: Any = None
        self.key: tuple[int, ...] = ()
        self.path_value: torch.Tensor = _NO_SLOTS
        self.path_hash = 0
        self.num_tokens = 0
        self.lock_ref = 0
        self.own_locks = 0

    @property
    def value(self) -> torch.Tensor:
        """This node's own slots: the tail of ``path_value`` after ``depth``."""
        return self.path_value[self.depth :]

    def __repr__(self) -> str:
        return (
            f"RadixNode(id={self.node_id}, tokens={self.num_tokens}, lock_ref={self.lock_ref}, "
            f"children={len(self.children)})"
        )


speedups.bind_node_type(RadixNode)  # the compiled walk reads these nodes' slots directly


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
        block_hasher: BlockHasher | None = None,
        options: RadixCacheOptions | None = None,
        storage: Callable[[str], TierHierarchy] | None = None,
    ) -> None:
        options = cache_options("radix", options, RadixCacheOptions)
        page_size = cache_page_size(page_size, allocator)
        policy = new_policy_instance(new_policy)
        self.allocator = allocator
        self.page_size = page_size
        self.device = torch.device(allocator.device)
        self.events = events
        self.block_hasher = block_hasher or BlockHasher()
        """How pages are hashed for the KV events (kvplug's scheme, or vLLM's)."""
        self.options = options
        self.stats = CacheStats()
        self.policy = policy
        self._exact = options.granularity == "exact"
        # a policy that learns from touches of non-candidates (e.g. hits on locked or inner
        # nodes) gets every node of a path touched; the built-in keyed ones only the candidate
        self._touch_all = not getattr(policy, "touch_candidates_only", False)
        self._empty = torch.empty(0, dtype=torch.int64, device=self.device)
        self._clock = 0
        # the key and node of the last match_prefix (see _resume_point)
        self._last_match: tuple[tuple[int, ...] | None, str | None, RadixNode | None] = (
            None,
            None,
            None,
        )
        # the storage hierarchy below the pool (keys: the pages' SHA-256 chain), or None
        self.storage: TierHierarchy | None = storage(self.block_hasher.name) if storage else None
        self._run_hasher = RunHasher(self.block_hasher)  # used where the storage demotes
        self._new_tree()

    def _new_tree(self) -> None:
        self._tree = object()  # handles of an older tree (before reset) fail the owner check
        self.root = RadixNode(self._clock, priority=0, owner=self._tree)
        self.root.path_value = self._empty
        self.root.lock_ref = 1  # never evicted, never in the policy
        # page hashes, only when someone observes the events or storage tiers key pages by them
        self._hashes: RadixBlockHashes | None = None
        if self.events is not None or self.storage is not None:
            self._hashes = RadixBlockHashes(
                self.events, self.name, self.root, self.page_size, self.block_hasher
            )
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

    def _split(
        self,
        child: RadixNode,
        length: int,
        ids: tuple[int, ...] | array[int],
        extra_key: str | None,
    ) -> RadixNode:
        """Cut ``child`` after ``length`` tokens; a new node takes the head and child's place.

        The tail keeps its identity (a lock handle stays valid). ``ids`` is the key being walked
        (the head's content, for ``path_hash``; an array key leaves it ``0``, unknown until a
        tuple walk ends there). The tree is relinked before the policy hears of it, so a
        failing policy leaves a consistent tree (and a resync fixes it).
        """
        parent = cast(RadixNode, child.parent)
        head = RadixNode(child.creation_time, child.priority, child.owner)
        head.last_access_time = child.last_access_time
        head.hit_count = child.hit_count
        head.lock_ref = child.lock_ref
        head.depth, head.namespace, head.new_tokens = child.depth, child.namespace, child.new_tokens
        head.content_id = child.content_id  # the head starts where the child started
        head.path_hash = hash((extra_key, ids[: child.depth + length])) if type(ids) is tuple else 0
        head.parent, head.edge = parent, child.edge
        head.key, head.num_tokens = child.key[:length], length
        head.path_value = child.path_value[: child.depth + length]
        parent.children[head.edge] = head
        child.key = child.key[length:]
        child.num_tokens -= length
        child.depth += length
        child.content_id = _start_id(child.namespace, child.depth, child.key)
        child.edge = child.key[0] if self.page_size == 1 else child.key[: self.page_size]
        child.parent = head
        head.children[child.edge] = child
        if self._hashes is not None:  # no event: a split changes no cached content
            self._hashes.split(head, child)
        if child in self.policy:  # its size changed: let size-aware policies re-rank it
            self.policy.discard(child)
            self.policy.add(child)
        return head

    def _walk(
        self,
        ids: tuple[int, ...] | array[int],
        end: int,
        extra_key: str | None,
        node: RadixNode | None = None,
        pos: int = 0,
    ) -> tuple[RadixNode, int, list[RadixNode]]:
        """Descend along ``ids[pos:end]`` from ``node`` (the root); split where the match ends
        inside a node. Returns the last matched node, the matched length and the walked nodes.

        One step is a dict lookup and one C-level compare of the whole edge; the page-wise
        bisection (``common_len``) runs only on the node where the match ends. No statistic
        changes here (see ``_stamp``), so a failure leaves nothing to undo but the policy.
        ``ids`` may be an int64 ``array`` (``probe_prefix``): read in place, only the tokens
        of the node where the match ends are converted.
        """
        page = self.page_size
        node, pos, path, inside = speedups.walk(
            self.root, self.root if node is None else node, ids, pos, end, page, extra_key
        )
        if inside is not None:  # the match ends inside this node: split it there
            if type(ids) is tuple:
                nxt = pos + common_len(inside.key, ids, pos, end, page)
            else:
                part = tuple(ids[pos : min(end, pos + inside.num_tokens)])
                nxt = pos + common_len(inside.key, part, 0, len(part), page)
            node = self._split(inside, nxt - pos, ids, extra_key)
            path.append(node)
            pos = nxt
        if not node.path_hash and pos and type(ids) is tuple:  # a new leaf, or cut since
            node.path_hash = hash((extra_key, ids[:pos]))
        return node, pos, path

    def _touch_last(self, node: RadixNode, now: int, hit: bool, priority: int | None) -> None:
        """Stamp the last node of a path and tell the policy when it is a candidate (the only
        node of a path that can be). A failing policy gets the node's statistics back."""
        saved = node.last_access_time, node.hit_count, node.priority
        node.last_access_time = now
        if hit:
            node.hit_count += 1
        if priority is not None and priority > node.priority:
            node.priority = priority
        if node.lock_ref == 0 and not node.children:
            try:
                self.policy.touch(node)
            except Exception:
                node.last_access_time, node.hit_count, node.priority = saved
                raise

    def _stamp(
        self,
        path: list[RadixNode],
        now: int,
        hit_from: int | None,
        priority: int | None,
    ) -> None:
        """Give every walked node the time ``now``, one hit when it ends past ``hit_from``
        (``None``: none) and at least ``priority``. The last node goes first (the only policy
        call, undone on failure); the others cannot fail."""
        if not path:
            return
        if self._touch_all:
            self._stamp_and_touch_all(path, now, hit_from, priority)
            return
        last = path[-1]
        hit_last = hit_from is not None and last.depth + last.num_tokens > hit_from
        self._touch_last(last, now, hit_last, priority)
        if hit_from == 0 and priority is None:  # a match: the common case, kept tight
            speedups.stamp_hits(path, len(path) - 1, now)
            return
        for node in path[:-1]:
            node.last_access_time = now
            if hit_from is not None and node.depth + node.num_tokens > hit_from:
                node.hit_count += 1
            if priority is not None and priority > node.priority:
                node.priority = priority

    def _stamp_and_touch_all(
        self, path: list[RadixNode], now: int, hit_from: int | None, priority: int | None
    ) -> None:
        """``_stamp`` for a policy that wants every node of the path touched (third-party and
        learning policies): the path's statistics are saved first and put back on failure."""
        saved = [(n, n.last_access_time, n.hit_count, n.priority) for n in path]
        for node in path:
            node.last_access_time = now
            if hit_from is not None and node.depth + node.num_tokens > hit_from:
                node.hit_count += 1
            if priority is not None and priority > node.priority:
                node.priority = priority
        try:
            for node in path:
                self.policy.touch(node)
        except Exception:
            for node, time, hits, prio in saved:
                node.last_access_time, node.hit_count, node.priority = time, hits, prio
            raise

    def _resync_policy(self, recheck: bool = True) -> None:
        """Make the policy's candidate set the tree's unlocked leaves again (error path only);
        a policy that fails again is quarantined (``common.rebuild_policies``)."""

        def refill() -> None:
            for node in self._nodes():
                if node.lock_ref == 0 and not node.children:
                    self.policy.add(node)

        rebuild_policies(self, ("policy",), refill, recheck=recheck)
        self._touch_all = not getattr(self.policy, "touch_candidates_only", False)

    def _nodes(self) -> list[RadixNode]:
        return descendants(self.root)

    def match_prefix(
        self, key: CacheKey | Sequence[int], *, record_hit: bool = True, gather: bool = True
    ) -> MatchResult:
        """The longest cached prefix of ``key`` (in whole pages) and the node it ends at.

        Every matched node gets the current logical time and one more hit, then the policy is
        told (``touch``, on the one node that can be a candidate). ``device_indices`` is a
        fresh int64 tensor on the allocator's device.

        ``record_hit=False`` is a probe (an engine ranking its waiting queue): it changes no
        statistic, hit count, clock or recency (a node may be split where the match ends: the
        cached content does not change). ``gather=False`` skips building the index tensor
        (``device_indices`` is empty; ``prefix_len`` and ``last_node`` are still right). The key
        is validated before anything changes; a failing policy leaves the cache as it was and
        raises ``PolicyError``.
        """
        ids, extra_key = check_key(key)
        if self.policy_recheck:  # a policy failed since its view was rebuilt: rebuild it first
            self._resync_policy(recheck=False)
        end = len(ids) - len(ids) % self.page_size
        try:
            node, pos, path = self._walk(ids, end, extra_key)
            if record_hit:
                self._stamp(path, self._clock + 1, 0, None)
        except Exception as exc:
            self._resync_policy()
            raise policy_error(self.policy, "match_prefix", exc) from exc
        if record_hit:
            self._clock += 1
            stats = self.stats
            stats.match_queries += 1
            stats.match_query_tokens += len(ids)
            stats.hit_tokens += pos
        tier_tokens: tuple[tuple[str, int], ...] = ()
        if self.storage is not None:
            node, pos, tier_tokens = self._match_tiers(ids, extra_key, node, pos, end, record_hit)
        indices = node.path_value.clone() if gather and pos else self._empty
        self._last_match = (ids, extra_key, node)  # what insert(prev=...) may skip re-hashing
        return MatchResult(
            device_indices=indices, last_node=node, prefix_len=pos, tier_tokens=tier_tokens
        )

    def probe_prefix(
        self, ids: array[int], length: int, extra_key: str | None = None
    ) -> tuple[RadixNode, int]:
        """``match_prefix(CacheKey(ids[:length], extra_key), record_hit=False, gather=False)``
        for an int64 ``array`` of token ids, walked in place: the node and the matched length.

        SGLang keeps each request's tokens in one ``array('q')`` and probes every waiting
        request each round; a tuple of the prompt would box every token for a walk that only
        compares them. Same result and the same split as ``match_prefix``; with storage tiers
        it is ``match_prefix`` (their page digests need the tuple).
        """
        if type(ids) is not array or ids.typecode not in _INT64_CODES:
            raise TypeError(f"probe_prefix takes an int64 array, got {type(ids).__name__}")
        check_int(length, "length", minimum=0)
        if length > len(ids):
            raise ValueError(f"length {length} is longer than the {len(ids)} token ids")
        if extra_key is not None and not isinstance(extra_key, str):
            raise TypeError(f"extra_key must be a str or None, got {type(extra_key).__name__}")
        if self.storage is not None:
            found = self.match_prefix(
                CacheKey(tuple(ids[:length]), extra_key), record_hit=False, gather=False
            )
            return found.last_node, found.prefix_len
        try:
            node, pos, _ = self._walk(ids, length - length % self.page_size, extra_key)
        except Exception as exc:
            self._resync_policy()
            raise policy_error(self.policy, "probe_prefix", exc) from exc
        return node, pos

    def prefetch(self, key: CacheKey | Sequence[int]) -> int:
        """A request with ``key`` was queued: start copying the pages of its prefix that only
        a slower storage tier holds (disk, Redis) into the fastest one (host memory), in the
        background, so its match loads them from there. Changes nothing on the device, no
        statistic and no recency (like a probe). Returns how many pages are on their way (0
        without tiers)."""
        storage = self.storage
        ids, extra_key = check_key(key)
        if storage is None:
            return 0
        page = self.page_size
        end = len(ids) - len(ids) % page
        try:
            node, pos, _ = self._walk(ids, end, extra_key)
        except Exception as exc:
            self._resync_policy()
            raise policy_error(self.policy, "prefetch", exc) from exc
        if pos >= end:
            return 0
        digests = self.block_hasher.chain(
            self._page_digest(node, extra_key), ids[pos:end], page, (end - pos) // page, extra_key
        )
        return prefetch_pages(storage, digests, ids, pos, page)

    # -- storage tiers --------------------------------------------------------------------------

    def _page_digest(self, node: RadixNode, extra_key: str | None) -> bytes:
        """The digest of the last page of ``node``'s path (the namespace's seed at the root)."""
        if node is self.root:
            return self.block_hasher.root(extra_key)
        assert self._hashes is not None
        return self._hashes.digests(node)[-1]

    def _match_tiers(
        self,
        ids: tuple[int, ...],
        extra_key: str | None,
        node: RadixNode,
        pos: int,
        end: int,
        record_hit: bool,
    ) -> tuple[RadixNode, int, tuple[tuple[str, int], ...]]:
        """Continue a device match through the storage tiers (see ``kvplug.caches.tiered``).

        A probe only locates (nothing moves); a match loads what is worth loading, inserts it
        under ``node`` (locked meanwhile) and returns the new last node and prefix length.
        """
        storage = self.storage
        assert storage is not None
        if self.events is not None:
            emit_tier_events(storage, self.events, self.name, self.block_hasher.event_hash)
        if pos >= end:
            return node, pos, ()
        page = self.page_size
        stored = storage.stored_parents(ids[pos : pos + page]) if storage.indexed else None
        if stored is not None and not stored:
            return node, pos, ()  # no stored page has these tokens: nothing hashed
        parent = self._page_digest(node, extra_key)
        if stored is not None and (None if node is self.root else parent) not in stored:
            return node, pos, ()  # none after this parent: the page itself is not hashed
        digests = self.block_hasher.chain(
            parent, ids[pos:end], page, (end - pos) // page, extra_key
        )
        keys, runs = storage.locate(digests)
        if not runs:
            return node, pos, ()
        if not record_hit:
            return node, pos, storage.reach(runs)
        locked = node is not self.root
        if locked:
            self.inc_lock_ref(node)
        try:
            loaded = load_pages(self, storage, keys, runs, ids, pos)
            if loaded is None:
                return node, pos, ()
            slots, per_tier = loaded
            new_end = pos + slots.numel()
            self._last_match = (ids, extra_key, node)  # the insert continues from node
            try:
                self.insert(
                    CacheKey(ids[:new_end], extra_key),
                    torch.cat((node.path_value, slots)),
                    hits_after=pos,
                    prev=MatchResult(self._empty, node, pos),
                )
            except BaseException:
                self.allocator.free(slots)  # insert changed nothing: the slots are still ours
                raise
        finally:
            if locked:
                self.dec_lock_ref(node)
        leaf, new_pos, _ = self._walk(ids, new_end, extra_key, node, pos)
        return leaf, new_pos, tuple(per_tier)

    def _demote_evicted(
        self,
        removed: list[tuple[RadixNode, RadixNode]],
        cut: tuple[RadixNode, tuple[int, ...], torch.Tensor, int] | None,
        slots: torch.Tensor,
    ) -> None:
        """Hand the pages an eviction is about to free (``slots``: theirs, in eviction order)
        to the storage tiers (write-back). Their digests are computed on the worker; only a
        linked parent's last digest is needed here (kept once computed)."""
        try:
            hashes = self._hashes
            assert hashes is not None
            if cut is None and len(removed) == 1:  # the common eviction: one whole leaf
                leaf, parent = removed[0]
                start = None if parent is self.root else hashes.digests(parent)[-1]
                runs = [ChainedRun(leaf.key, leaf.namespace, start, hashes.known(leaf))]
            else:
                runs = self._chained_runs(hashes, removed, cut)
        except Exception:  # never fails the eviction: the pages are recomputed when needed
            log.exception("radix: demoting evicted pages failed")
            return
        assert self.storage is not None
        demote_runs(self.storage, self._run_hasher, runs, slots, self.page_size)

    def _chained_runs(
        self,
        hashes: RadixBlockHashes,
        removed: list[tuple[RadixNode, RadixNode]],
        cut: tuple[RadixNode, tuple[int, ...], torch.Tensor, int] | None,
    ) -> list[ChainedRun]:
        """The runs of an eviction's unlinked leaves (a leaf's parent may be a later one) and
        of the leaf it cut."""
        root = self.root
        nodes = [leaf for leaf, _ in removed]
        if cut is not None:
            nodes.append(cut[0])
        index = {node: i for i, node in enumerate(nodes)}

        def parent_of(parent: RadixNode | None) -> bytes | int | None:
            if parent is root or parent is None:
                return None
            i = index.get(parent)
            return i if i is not None else hashes.digests(parent)[-1]

        runs = [
            ChainedRun(leaf.key, leaf.namespace, parent_of(parent), hashes.known(leaf))
            for leaf, parent in removed
        ]
        if cut is not None:
            leaf, key = cut[0], cut[1]
            # its known digests are still those of its uncut key (forgotten after the free);
            # unknown, the worker hashes the uncut key (its RunHasher remembers the head)
            first = leaf.num_tokens // self.page_size
            runs.append(
                ChainedRun(key, leaf.namespace, parent_of(leaf.parent), hashes.known(leaf), first)
            )
        return runs

    def touch_prefix(self, key: CacheKey | Sequence[int]) -> None:
        """Refresh the recency of ``key``'s cached path without counting a hit or a query
        (SGLang's ``touch_prefix`` for requests that keep waiting)."""
        ids, extra_key = check_key(key)
        if self.policy_recheck:  # a policy failed since its view was rebuilt: rebuild it first
            self._resync_policy(recheck=False)
        end = len(ids) - len(ids) % self.page_size
        try:
            _, _, path = self._walk(ids, end, extra_key)
            self._stamp(path, self._clock + 1, None, None)
        except Exception as exc:
            self._resync_policy()
            raise policy_error(self.policy, "touch_prefix", exc) from exc
        self._clock += 1

    def path_indices(self, node: RadixNode) -> torch.Tensor:
        """The slots from the root to ``node`` (int64, on device), root side first."""
        self._check_handle(node)
        return node.path_value.clone() if node is not self.root else self._empty

    def _resume_point(
        self, prev: MatchResult, ids: tuple[int, ...], end: int, extra_key: str | None
    ) -> RadixNode | None:
        """The node an insert can continue from, given the match ``prev`` that preceded it, or
        ``None`` (walk from the root) when ``prev`` no longer describes this key's cached path.

        Checked without a tree walk: the node is alive in this tree, still ends at
        ``prev.prefix_len``, and its content hash equals the hash of this key's first
        ``prefix_len`` tokens (computed in C), unless this key is the very tuple (and namespace)
        the last ``match_prefix`` walked to this node: a cached node's path never changes, so it
        is this key's prefix. A wrong key never grafts a leaf onto a foreign path, and
        ``prev.device_indices`` is not trusted (the node's own slots are used).
        """
        if not isinstance(prev, MatchResult):
            raise TypeError(
                f"prev must be the MatchResult of match_prefix, got {type(prev).__name__}"
            )
        node: RadixNode = prev.last_node
        plen = prev.prefix_len
        self._check_type(node)
        if node.owner is not self._tree or not isinstance(plen, int) or plen > end:
            return None
        if node is self.root:
            return node if plen == 0 else None
        if node.parent is None or node.depth + node.num_tokens != plen:
            return None  # evicted or cut since the match
        matched_ids, matched_extra_key, matched_node = self._last_match
        if matched_ids is ids and matched_extra_key == extra_key and matched_node is node:
            return node
        if node.path_hash != hash((extra_key, ids[:plen])):
            return None
        return node

    def insert(
        self,
        key: CacheKey | Sequence[int],
        indices: torch.Tensor,
        *,
        priority: int = 0,
        hits_after: int | None = None,
        prev: MatchResult | None = None,
    ) -> int:
        """Cache ``key[:aligned]`` with slots ``indices[:aligned]``; return the length already
        cached. See the class docstring for who owns which slots afterwards.

        ``priority`` (for the ``priority`` policy) is raised to at least ``priority`` on every
        node of the path, as SGLang does. ``hits_after=n`` counts the hits at insert instead of
        at match (engines that probe with ``record_hit=False``): each node of the path ending
        past token ``n`` gets one hit, so a request that re-inserts its growing prefix (chunked
        prefill) with ``n`` = what it inserted before counts each node once.

        ``prev``: the ``match_prefix`` result of this key the request got before (SGLang passes
        its previous prefix length and node alike). The insert then continues from that node
        instead of walking and comparing the prefix again; when the match is stale (the node
        was evicted, or the key differs) it walks from the root, with the same result.

        All or nothing: the key, the indices and the ownership of the slots the cache takes
        (new ones and duplicates it frees) are checked before anything changes; a failing policy
        or ``allocator.free`` leaves cache and allocator as they were.
        """
        ids, extra_key = check_key(key)
        indices = check_indices(indices, len(ids), self.device)
        check_int(priority, "priority")
        if hits_after is not None:
            check_int(hits_after, "hits_after", minimum=0)
        if self.policy_recheck:  # a policy failed since its view was rebuilt: rebuild it first
            self._resync_policy(recheck=False)
        end = len(ids) - len(ids) % self.page_size
        start = None if prev is None else self._resume_point(prev, ids, end, extra_key)
        if self._touch_all:
            start = None  # the policy wants every node of the path touched: walk it
        try:
            if start is None:
                node, pos, path = self._walk(ids, end, extra_key)
            else:
                plen = start.depth + start.num_tokens if start is not self.root else 0
                node, pos, path = self._walk(ids, end, extra_key, start, plen)
        except Exception as exc:  # a split's re-rank: the tree is consistent, the policy resynced
            self._resync_policy()
            raise policy_error(self.policy, "insert", exc) from exc
        duplicates = self._empty
        if pos:
            given = indices[:pos]
            cached = node.path_value
            if not torch.equal(given, cached):
                duplicates = given[given != cached]
        new_slots = indices[pos:end]
        taken = torch.cat((new_slots, duplicates)) if duplicates.numel() else new_slots
        take_ownership(self.allocator, taken)  # raises (nothing changed) on a slot not held
        now = self._clock + 1
        leaf: RadixNode | None = None
        in_free = False
        # a failing free comes last, after the stamps: only then are they saved (rare path)
        saved = self._path_stats(node) if duplicates.numel() else []
        try:
            if pos < end:
                leaf = RadixNode(now, priority, self._tree)
                if hits_after is not None and end > hits_after:
                    leaf.hit_count = 1
                leaf.parent = node
                first = ids[pos] if self.page_size == 1 else ids[pos : pos + self.page_size]
                leaf.edge = (extra_key, first) if node is self.root else first
                leaf.key = ids[pos:end]
                leaf.path_value = torch.cat((node.path_value, new_slots))
                leaf.num_tokens = leaf.new_tokens = end - pos
                leaf.depth, leaf.namespace = pos, extra_key
                leaf.content_id = _start_id(extra_key, pos, leaf.key)
                leaf.path_hash = 0  # hashed when a walk first ends at it (_walk)
                node.children[leaf.edge] = leaf
                if node.lock_ref == 0:
                    self.policy.discard(node)  # no longer a leaf
                self.policy.add(leaf)
            if start is None:
                self._stamp(path, now, hits_after, priority)
            else:
                self._stamp_resumed(start, path, now, hits_after, priority)
            if duplicates.numel():
                in_free = True
                self.allocator.free(duplicates)
        except Exception as exc:
            for n, stats in saved:
                n.last_access_time, n.hit_count, n.priority = stats
            if leaf is not None and leaf.parent is not None:
                del leaf.parent.children[leaf.edge]
                leaf.parent = None
            release_ownership(self.allocator, taken)
            self._resync_policy()
            if in_free:
                raise
            raise policy_error(self.policy, "insert", exc) from exc
        self._clock = now
        if leaf is not None:
            self._evictable += leaf.num_tokens
            self.stats.inserted_tokens += leaf.num_tokens
            if self._hashes is not None:
                self._hashes.stored(leaf)
            if self.storage is not None and self.storage.write_through:
                parent = cast(RadixNode, leaf.parent)
                first_parent = None if parent is self.root else self._page_digest(parent, extra_key)
                assert self._hashes is not None
                run = ChainedRun(leaf.key, extra_key, first_parent, self._hashes.known(leaf))
                demote_runs(self.storage, self._run_hasher, (run,), new_slots, self.page_size)
        return pos

    def _path_stats(self, node: RadixNode) -> list[tuple[RadixNode, tuple[int, int, int]]]:
        """The statistics an insert may change on the path to ``node``, to put them back."""
        out = []
        up: RadixNode | None = node
        while up is not None and up is not self.root:
            out.append((up, (up.last_access_time, up.hit_count, up.priority)))
            up = up.parent
        return out

    def _stamp_resumed(
        self,
        start: RadixNode,
        path: list[RadixNode],
        now: int,
        hits_after: int | None,
        priority: int,
    ) -> None:
        """``_stamp`` for an insert that continued from ``start``: the nodes walked below it as
        usual; at and above it, hits and priority only, walking up only while one applies (ends
        shrink and priorities grow towards the root). The path above keeps the match's time, one
        tick older: only the last node can be a candidate, so the eviction order is the same."""
        if path:
            self._stamp(path, now, hits_after, priority)
            up: RadixNode | None = start
        else:
            if start is self.root:
                return
            hit = hits_after is not None and start.depth + start.num_tokens > hits_after
            self._touch_last(start, now, hit, priority)
            up = start.parent
        while up is not None and up is not self.root:
            hit = hits_after is not None and up.depth + up.num_tokens > hits_after
            if not hit and priority <= up.priority:
                break
            if hit:
                up.hit_count += 1
            if priority > up.priority:
                up.priority = priority
            up = up.parent

    # -- locks ----------------------------------------------------------------------------------

    @staticmethod
    def _check_type(node: Any) -> None:
        if not isinstance(node, RadixNode):
            raise TypeError(f"expected a RadixNode from match_prefix, got {type(node).__name__}")

    def _check_handle(self, node: Any) -> None:
        """O(1): the node was created in this tree (not before a ``reset``, not in another
        cache) and is not freed (a freed node has no parent)."""
        self._check_type(node)
        if node.owner is not self._tree or (node.parent is None and node is not self.root):
            raise ValueError(f"{node!r} is not cached here (evicted, reset, or from another cache)")

    def inc_lock_ref(self, node: RadixNode) -> int:
        """Lock the prefix ending at ``node`` (one running request more uses it).

        Returns the change of ``evictable_size()`` (zero or negative), as SGLang does. Only
        ``dec_lock_ref(node)`` with this same handle undoes it. Only ``node`` itself can be an
        eviction candidate (its ancestors have children), so the policy hears of it alone.
        """
        self._check_handle(node)
        if self.policy_recheck:  # a policy failed since its view was rebuilt: rebuild it first
            self._resync_policy(recheck=False)
        root = self.root
        if node.lock_ref == 0 and not node.children and node is not root:
            try:
                self.policy.discard(node)
            except Exception as exc:
                self._resync_policy()
                raise policy_error(self.policy, "inc_lock_ref", exc) from exc
        node.own_locks += 1
        moved = speedups.lock_path(node, root, 1)
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
        if self.policy_recheck:  # a policy failed since its view was rebuilt: rebuild it first
            self._resync_policy(recheck=False)
        root = self.root
        if node.lock_ref == 1 and not node.children and node is not root:
            try:
                self.policy.add(node)  # before any count changes: nothing else to undo
            except Exception as exc:
                self._resync_policy()
                raise policy_error(self.policy, "dec_lock_ref", exc) from exc
        moved = speedups.lock_path(node, root, -1)  # checked: fails before any count changes
        node.own_locks -= 1
        self._evictable += moved
        self._protected -= moved
        return moved

    # -- eviction -------------------------------------------------------------------------------

    def _check_victim(self, leaf: Any) -> RadixNode:
        """What ``policy.pop()`` returned must be one of this cache's evictable leaves (O(1))."""
        if (
            not isinstance(leaf, RadixNode)
            or leaf.owner is not self._tree
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
        policy or ``allocator.free`` fails, every victim is put back and nothing is freed. The
        victims' slots are freed with one ``allocator.free`` (one range/ownership check).
        """
        if not isinstance(params, EvictParams):
            raise TypeError(f"evict takes EvictParams, got {type(params).__name__}")
        need = params.num_tokens
        if need == 0:
            return EvictResult()
        if self.policy_recheck:  # a policy failed since the last evict: see rebuild_policies
            self._resync_policy(recheck=False)
        page, policy, root = self.page_size, self.policy, self.root
        freed = 0
        victims: list[torch.Tensor] = []
        removed: list[tuple[RadixNode, RadixNode]] = []  # unlinked leaves and their parents
        cut: tuple[RadixNode, tuple[int, ...], torch.Tensor, int] | None = None
        in_free = False
        try:
            while freed < need:
                popped = policy.pop()
                if popped is None:
                    break
                leaf = self._check_victim(popped)
                remaining = -(-(need - freed) // page) * page  # still needed, in whole pages
                if self._exact and remaining < leaf.num_tokens:
                    keep = leaf.num_tokens - remaining
                    cut = (leaf, leaf.key, leaf.path_value, leaf.path_hash)
                    kept = leaf.depth + keep
                    victims.append(leaf.path_value[kept:])
                    leaf.key, leaf.num_tokens = leaf.key[:keep], keep
                    leaf.path_value = leaf.path_value[:kept]
                    leaf.path_hash = 0  # unknown until a walk ends at it (no path walk here)
                    policy.add(leaf)
                    freed += remaining
                    break
                victims.append(leaf.value)
                freed += leaf.num_tokens
                parent = cast(RadixNode, leaf.parent)
                del parent.children[leaf.edge]
                leaf.parent = None
                removed.append((leaf, parent))
                if parent is not root and parent.lock_ref == 0 and not parent.children:
                    policy.add(parent)
            if victims:
                slots = torch.cat(victims) if len(victims) > 1 else victims[0]
                if self.storage is not None and not self.storage.write_through:
                    self._demote_evicted(removed, cut, slots)
                in_free = True
                self.allocator.free(slots)
        except Exception as exc:
            for leaf, parent in reversed(removed):
                leaf.parent = parent
                parent.children[leaf.edge] = leaf
            if cut is not None:
                leaf, key, path_value, path_hash = cut
                leaf.key, leaf.num_tokens = key, len(key)
                leaf.path_value, leaf.path_hash = path_value, path_hash
            self._resync_policy()
            if in_free:
                raise
            raise policy_error(self.policy, "evict", exc) from exc
        for leaf, _ in removed:
            leaf.path_value = _NO_SLOTS
        self._evictable -= freed
        stats = self.stats
        stats.evictions += 1
        stats.evicted_tokens += freed
        if self._hashes is not None and freed:
            cut_leaf, cut_pages = None, 0
            if cut is not None:
                cut_leaf, cut_pages = cut[0], (len(cut[1]) - cut[0].num_tokens) // page
            self._hashes.removed([leaf for leaf, _ in removed], cut_leaf, cut_pages, freed)
        return _evicted(freed)

    # -- whole-cache operations -----------------------------------------------------------------

    def all_values_flatten(self) -> torch.Tensor:
        """Every cached slot (int64, on device), in depth-first order: for checks and debugging."""
        values = [n.value for n in self._nodes()]
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
