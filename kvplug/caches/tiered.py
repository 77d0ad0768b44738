"""What ``radix`` and ``block_hash`` share to use a storage hierarchy (``kvplug.tiers``).

A cache with tiers keys every page by its chained digest (:mod:`.block_hashing`). On eviction
it calls :func:`demote_runs` with the freed pages before their slots are freed; after a device
match it locates the rest of the key in the tiers and, for a real match, :func:`load_pages`
allocates slots (through the normal shortfall eviction), loads and verifies the pages and
writes their KV into the pool; the cache then inserts them as if the request had computed them.
Tier events are reported by :func:`emit_tier_events` on the cache's thread, with their medium.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from kvplug_hookspecs import CacheEvents, PrefixRemoved, PrefixStored

from .. import speedups
from ..errors import PolicyError
from ..eviction import evict_from_tree_cache
from .block_hashing import BlockHasher, event_hash

if TYPE_CHECKING:
    from ..tiers import TierHierarchy
    from ..tiers.hierarchy import PageRun

__all__ = [
    "ChainedRun",
    "RunHasher",
    "demote_runs",
    "emit_tier_events",
    "load_pages",
    "page_tokens",
    "prefetch_pages",
    "write_pages",
]

log = logging.getLogger(__name__)


def page_tokens(ids: Sequence[int], start: int, num_pages: int, page: int) -> list[tuple[int, ...]]:
    """The token ids of ``num_pages`` pages of ``ids`` from ``start``, one tuple a page."""
    if page == 1:
        return [(t,) for t in ids[start : start + num_pages]]
    return [tuple(ids[start + i * page : start + (i + 1) * page]) for i in range(num_pages)]


class ChainedRun(NamedTuple):
    """One node's pages for :func:`demote_runs` (evicted, or inserted under write-through):
    its ``key`` (whole pages) in namespace ``extra_key``, chained from ``parent`` (a digest;
    the index of a later run of the same demotion, the node it hung from, evicted after it;
    ``None`` under the root); ``digests`` when the cache already knows them; the pages from
    ``first_page`` on are demoted."""

    key: tuple[int, ...]
    extra_key: str | None
    parent: bytes | int | None
    digests: Sequence[bytes] | None = None
    first_page: int = 0


class RunHasher:
    """Hashes the runs :func:`demote_runs` hands over, on one thread only (the hierarchy's
    worker, or the cache's own when demotion is inline), remembering the chain it hashed last
    from each start. A leaf an exact eviction cuts again and again is demoted with its uncut
    key every time, a prefix of the key it had the time before: its digests are a prefix of
    those already hashed, so its head is hashed once, not at every cut."""

    def __init__(self, hasher: BlockHasher, entries: int = 64) -> None:
        self.hasher = hasher
        self._entries = entries
        self._last: dict[tuple[bytes | None, tuple[int, ...]], tuple[tuple[int, ...], list[bytes]]]
        self._last = {}

    def digests(
        self, start: bytes | None, key: tuple[int, ...], page: int, extra_key: str | None
    ) -> list[bytes]:
        """The digests of ``key``'s pages chained from ``start`` (``None``: the namespace's
        seed)."""
        count = len(key) // page
        memo = (start, key[:page])  # siblings under one parent start with other tokens
        last = self._last.get(memo)
        if (
            last is not None
            and len(last[0]) >= len(key)
            and speedups.common_items(last[0], 0, key, 0, len(key)) == len(key)
        ):
            return last[1][:count]
        seed = self.hasher.root(extra_key) if start is None else start
        digests = list(self.hasher.chain(seed, key, page, count, extra_key))
        if len(self._last) >= self._entries:
            self._last.clear()
        self._last[memo] = (key, digests)
        return digests


def demote_runs(
    storage: TierHierarchy,
    hasher: RunHasher,
    runs: Sequence[ChainedRun],
    slots: torch.Tensor,
    page: int,
) -> None:
    """Hand nodes' pages (``runs`` in eviction order; ``slots`` the demoted pages' slots, run
    after run: one per demoted token) to the hierarchy, their digests computed on
    the worker, off the engine's path (they read only immutable keys and digests). Never
    raises."""
    num_pages = slots.numel() // page

    def pages() -> PageRun:
        starts: list[bytes | None] = [None] * len(runs)
        chains: list[Sequence[bytes]] = [()] * len(runs)
        for i in range(len(runs) - 1, -1, -1):  # a run's parent run comes after it
            run = runs[i]
            parent = run.parent
            start = chains[parent][-1] if isinstance(parent, int) else parent
            starts[i] = start
            digests = run.digests
            if digests is None:
                digests = hasher.digests(start, run.key, page, run.extra_key)
            chains[i] = digests
        keys: list[bytes] = []
        tokens: list[tuple[int, ...]] = []
        parents: list[bytes | None] = []
        for run, start, digests in zip(runs, starts, chains, strict=True):
            first, count = run.first_page, len(digests)
            if first < count:
                keys.extend(digests[first:])
                tokens.extend(page_tokens(run.key, first * page, count - first, page))
                parents.append(start if first == 0 else digests[first - 1])
                parents.extend(digests[first : count - 1])
        return keys, tokens, parents

    try:
        storage.demote_run(num_pages, pages, slots)
    except Exception:  # a demotion is an optimisation: the cache's own operation goes on
        log.exception("demoting %d pages failed; they will be recomputed", num_pages)


def prefetch_pages(
    storage: TierHierarchy, digests: Iterator[bytes], ids: Sequence[int], pos: int, page: int
) -> int:
    """Locate the pages after a device match (``digests``: theirs, from ``ids[pos:]``) and have
    the hierarchy copy the ones only slower tiers hold up into the fastest; returns how many
    pages that is (0: nothing below the fastest tier, or the queue is full)."""
    keys, runs = storage.locate(digests)
    if not runs:
        return 0
    return storage.prefetch(keys, page_tokens(ids, pos, len(keys), page), runs)


def load_pages(
    cache: Any,
    storage: TierHierarchy,
    keys: Sequence[bytes],
    runs: list[tuple[int, int]],
    ids: Sequence[int],
    pos: int,
) -> tuple[torch.Tensor, list[tuple[str, int]]] | None:
    """Bring the located pages ``keys`` (runs ``runs``, the key's tokens from ``ids[pos:]``)
    into the pool of ``cache``: slots through the shortfall eviction, verified pages written.

    Returns the slots of the verified pages (their count a multiple of the page size, the
    caller's to insert) and the tokens per tier, or ``None`` when nothing was loaded. The
    caller has locked its matched prefix (the eviction must not free it). A failing tier, a
    page that fails its checks or an allocation that cannot be met recomputes; the slots of
    pages that did not load are freed before returning, on every path.
    """
    page = cache.page_size
    runs = storage.plan(runs, pos)
    num_pages = sum(count for _, count in runs)
    if not num_pages:
        return None
    need = num_pages * page
    allocator = cache.allocator
    evict_from_tree_cache(cache, need)
    slots = allocator.alloc(need)
    if slots is None:
        return None
    kept = 0
    try:
        tokens = page_tokens(ids, pos, num_pages, page)
        pages, per_tier = storage.load(keys[:num_pages], tokens, runs)
        kept = len(pages) * page
        if kept and pages[0].kv is not None:
            write_pages(allocator.pool, slots, [p.kv for p in pages], page)
    except PolicyError:
        kept = 0
        raise
    except Exception:
        log.exception("loading %d pages from the storage tiers failed; recomputing", num_pages)
        kept = 0
    finally:
        if kept < need:
            allocator.free(slots[kept:])
    return (slots[:kept], per_tier) if kept else None


_WRITE_PER_PAGE = 16
"""Pages of at least this many tokens are written one by one (each a copy large enough that a
concatenation into one tensor first would only add a copy of every byte); smaller pages are
concatenated and written at once."""


def write_pages(pool: Any, slots: torch.Tensor, kvs: list[Any], page: int) -> None:
    """Write verified pages' KV (``[2, layers, page, heads, dim]`` each) at ``slots``."""
    if page >= _WRITE_PER_PAGE:
        for i, kv in enumerate(kvs):
            pool.write_slots(slots[i * page : (i + 1) * page], kv)
        return
    kv = torch.cat(kvs, dim=2) if len(kvs) > 1 else kvs[0]
    pool.write_slots(slots[: len(kvs) * page], kv)


def emit_tier_events(
    storage: TierHierarchy,
    events: CacheEvents,
    cache: str,
    event_hash: Callable[[bytes], int] = event_hash,
) -> None:
    """Report the hierarchy's tier events: one event per chain of consecutive pages, their
    hashes by ``event_hash`` (the cache's hasher's: kvplug's or vLLM's)."""
    for event in storage.take_events():
        chains: list[list[Any]] = []
        for p in event.pages:
            if chains and p.parent == chains[-1][-1].key:
                chains[-1].append(p)
            else:
                chains.append([p])
        for chain in chains:
            hashes = tuple(event_hash(p.key) for p in chain)
            tokens = sum(p.num_tokens for p in chain)
            if event.kind == "stored":
                first_parent = chain[0].parent
                events.prefix_stored(
                    PrefixStored(
                        cache=cache,
                        num_tokens=tokens,
                        block_hashes=hashes,
                        parent_block_hash=None
                        if first_parent is None
                        else event_hash(first_parent),
                        token_ids=tuple(t for p in chain for t in p.token_ids),
                        medium=event.medium,
                    )
                )
            else:
                events.prefix_removed(
                    PrefixRemoved(
                        cache=cache, num_tokens=tokens, block_hashes=hashes, medium=event.medium
                    )
                )
