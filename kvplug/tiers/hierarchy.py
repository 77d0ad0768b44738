"""The storage hierarchy a cache demotes evicted pages to and loads matched pages from.

:class:`TierHierarchy` owns the configured tiers (fastest first) and everything a cache must
not have to think about:

* **Demotion off the engine's path.** ``demote`` copies the pages' KV out of the pool on the
  caller's thread (one gather; the slots may be freed right after) and posts the copy; a
  background worker takes what was posted in batches (:class:`~kvplug.tiers.mailbox.Mailbox`:
  a post wakes it only when it sleeps), moves it to the host, checksums every page and stores
  the batch in the first working tier. A full queue drops the demotion and counts it: the
  engine never waits.
* **Cascades.** A tier whose bound pushes pages out (``host``) hands them to the next tier; while
  that write runs, the pages stay visible as the upper tier's (a page being written below is not
  dropped from the tier above).
* **Nothing unverified is loaded.** ``load`` checks each page's key, tokens, shape, dtype and
  checksum (:func:`kvplug.tiers.pages.check_page`) before the cache may write it into a pool; a
  page that fails is removed from its tier, counted, and the prefix from there is recomputed.
* **A failing tier never fails a request.** Every tier call is guarded: an exception (refused
  connection, timeout, full or read-only disk) counts a failure, logs once per state change,
  and takes the tier out of use; it is tried again after a backoff (0.5 s doubling to 30 s) and
  used again once a call succeeds.
* **Load versus recompute.** ``plan`` keeps only the runs whose load time (the tier's latency and
  bandwidth) is below their prefill time (:class:`~kvplug_hookspecs.TierCostModel`).
* **Prefetch.** ``prefetch`` (a request was queued) has the worker copy the located pages that
  only slower tiers hold (disk, Redis) into the fastest tier in use, verified first, so the match
  that admits the request loads them from host memory. Queued like a demotion: never waits.

Keys are page digests; the hierarchy never sees a cache's tree. Tier events (pages stored in or
dropped from a tier) are queued here and taken by the cache on its own thread
(``take_events``), which reports them to observers with their medium.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import threading
import time
import weakref
from collections import defaultdict, deque
from collections.abc import Callable, Iterator, Sequence, Set
from dataclasses import dataclass, field
from itertools import groupby, islice
from typing import Any, Literal, cast

import torch

from kvplug_hookspecs import PageData, StorageConfig, StorageTier, TierNamespace

from .mailbox import Mailbox
from .pages import CorruptPageError, check_page, page_checksum

__all__ = ["HierarchyStats", "PageRun", "TierEvent", "TierHierarchy"]

_NO_PARENTS: frozenset[bytes | None] = frozenset()

log = logging.getLogger(__name__)

DEVICE_MEDIUM = "GPU"
_BACKOFF_MIN_S = 0.5
_BACKOFF_MAX_S = 30.0


@dataclass(frozen=True, slots=True)
class TierEvent:
    """Pages stored in (``kind="stored"``) or dropped from (``"removed"``) a tier's medium."""

    kind: Literal["stored", "removed"]
    medium: str
    pages: tuple[PageData, ...]


@dataclass
class HierarchyStats:
    """The hierarchy's counters (named as vLLM's ``kv_offload`` and Dynamo's KVBM report them).

    ``hit_tokens[tier]``: tokens loaded from a tier for a match. ``transfer_bytes["GPU_to_CPU"]``
    and the like: bytes moved per direction (``<from medium>_to_<to medium>``), counted from the
    geometry when the pool keeps no KV (a simulator's bookkeeping tiers). ``demoted_pages``:
    pages stored below the device; ``dropped_pages``: demotions dropped (queue full, no tier
    up); ``corrupt_pages``: pages that failed their checks; ``failures[tier]``: tier calls that
    raised; ``skipped_pages``: located pages recomputed because loading them would be slower;
    ``load_seconds[tier]``: the modelled time of every load (the tier's latency per call and
    its bandwidth), what the cost model set against recomputing.
    """

    hit_tokens: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    load_seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    located_tokens: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    transfer_bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    failures: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    demoted_pages: int = 0
    dropped_pages: int = 0
    corrupt_pages: int = 0
    skipped_pages: int = 0
    prefetched_pages: int = 0
    """Pages a prefetch copied up from a slower tier (verified) into the fastest in use."""

    def as_dict(self) -> dict[str, Any]:
        return {
            "hit_tokens": dict(self.hit_tokens),
            "located_tokens": dict(self.located_tokens),
            "load_seconds": dict(self.load_seconds),
            "transfer_bytes": dict(self.transfer_bytes),
            "failures": dict(self.failures),
            "demoted_pages": self.demoted_pages,
            "dropped_pages": self.dropped_pages,
            "corrupt_pages": self.corrupt_pages,
            "skipped_pages": self.skipped_pages,
            "prefetched_pages": self.prefetched_pages,
        }


class _Health:
    """Whether a tier is in use, and when a failed one is tried again."""

    __slots__ = ("backoff", "retry_at", "up")

    def __init__(self) -> None:
        self.up = True
        self.retry_at = 0.0
        self.backoff = _BACKOFF_MIN_S


PageRun = tuple[list[bytes], list[tuple[int, ...]], list[bytes | None]]
"""Demoted pages: their keys, their tokens and their parents' keys (``None`` under the root)."""


@dataclass(slots=True)  # not frozen: one is made per eviction, and frozen init costs ~1 us
class _Job:
    """A demotion: ``num_pages`` pages (``pages``, or what computes them on the worker) and their
    KV (the device copy, or ``None`` when the pool keeps none)."""

    num_pages: int
    pages: PageRun | Callable[[], PageRun]
    kv: torch.Tensor | None


@dataclass(frozen=True, slots=True)
class _Prefetch:
    """A prefetch: located page keys, their tokens, and their runs ``(tier, pages)``."""

    keys: list[bytes]
    tokens: list[tuple[int, ...]]
    runs: list[tuple[int, int]]


def _job_pages(job: _Job | _Prefetch) -> int:
    """The pages a queued job counts in the queue's bound."""
    if isinstance(job, _Prefetch):
        return sum(count for i, count in job.runs if i > 0)
    return job.num_pages


class TierHierarchy:
    """Ordered storage tiers below one device pool; see the module docstring.

    ``pool``: the device pool (``read_pages`` / ``write_slots``), or ``None`` when it keeps no
    KV (pages are then bookkeeping only: keys and tokens, no tensors). ``kv_bytes_per_token``:
    the geometry's, for byte counts and the cost model.
    """

    def __init__(
        self,
        tiers: Sequence[StorageTier],
        config: StorageConfig,
        namespace: TierNamespace,
        *,
        pool: Any,
        page_size: int,
        kv_bytes_per_token: int,
        pin_memory: bool = False,
        observed: bool = False,
    ) -> None:
        if not tiers:
            raise ValueError("a storage hierarchy needs at least one tier")
        self.tiers = list(tiers)
        self.config = config
        self.namespace = namespace
        self.namespace_id = namespace.id
        self.page_size = page_size
        self.write_through = config.write_policy == "write_through"
        self.stats = HierarchyStats()
        self._pool = pool
        self._pin = pin_memory
        self._bpt = config.cost.kv_bytes_per_token or kv_bytes_per_token
        self._health = [_Health() for _ in self.tiers]
        self._moving: dict[bytes, tuple[int, PageData]] = {}  # written below, still readable
        # the parents' keys of the pages stored, by the pages' tokens, when every tier is
        # private (nothing else stores pages in them): see may_hold
        self._index: dict[tuple[int, ...], set[bytes | None]] | None = (
            {} if all(getattr(t, "private", False) for t in self.tiers) else None
        )
        self._lock = threading.Lock()
        self._observed = observed
        self._events: deque[TierEvent] = deque()
        self._queue: Mailbox[_Job | _Prefetch | None] | None = None
        self._step = config.handoff == "step"
        self._held: list[_Job | _Prefetch] = []  # handoff "step": this step's, not yet queued
        self._queued_pages = 0  # pages demoted and not yet stored (<= config.queue_pages)
        self._worker: threading.Thread | None = None
        self._closed = False
        if pool is not None:
            self._kv_shape: tuple[int, ...] | None = (
                2,
                pool.num_layers,
                page_size,
                pool.kv_heads,
                pool.head_dim,
            )
            self._kv_dtype: torch.dtype | None = pool.store_dtype
        else:
            self._kv_shape = self._kv_dtype = None
        if config.background:
            self._queue = Mailbox()  # bounded in pages by _queued_pages, not in jobs
            self._worker = threading.Thread(
                target=self._run, name="kvplug-tier-demotion", daemon=True
            )
            self._worker.start()
            _WITH_WORKERS.add(self)

    # -- guarded tier calls -------------------------------------------------------------------

    def _usable(self, i: int) -> bool:
        health = self._health[i]
        return health.up or time.monotonic() >= health.retry_at

    def _call(self, i: int, what: str, fn: Callable[..., Any], default: Any, *args: Any) -> Any:
        """``fn(*args)`` on tier ``i``, or ``default`` while the tier is out of use or when it
        raises."""
        health = self._health[i]
        if not health.up and time.monotonic() < health.retry_at:
            return default
        try:
            result = fn(*args)
        except Exception as exc:
            tier = self.tiers[i]
            self.stats.failures[tier.name] += 1
            if health.up:
                log.warning(
                    "storage tier %r failed (%s: %s); recomputing instead, retrying in %.1f s",
                    tier.name,
                    what,
                    exc,
                    health.backoff,
                )
            else:
                health.backoff = min(health.backoff * 2, _BACKOFF_MAX_S)
            health.up = False
            health.retry_at = time.monotonic() + health.backoff
            return default
        if not health.up:
            log.warning("storage tier %r is back (%s succeeded)", self.tiers[i].name, what)
            health.up = True
            health.backoff = _BACKOFF_MIN_S
        return result

    def tier_up(self, name: str) -> bool:
        """Whether tier ``name`` is in use now (not backing off after a failure)."""
        return self._health[[t.name for t in self.tiers].index(name)].up

    # -- lookup and load ----------------------------------------------------------------------

    def _present(self, i: int, keys: Sequence[bytes]) -> int:
        """How many of ``keys`` tier ``i`` holds from the first (pages moving below count)."""
        count = 0
        if self._moving:  # read without the lock first: empty unless a cascade is writing
            with self._lock:
                moving = self._moving
                while count < len(keys) and moving.get(keys[count], (-1,))[0] == i:
                    count += 1
            if count == len(keys):
                return count
            keys = keys[count:]
        found: int = self._call(i, "contains", self.tiers[i].contains, 0, keys)
        return count + found

    @property
    def indexed(self) -> bool:
        """Whether this hierarchy indexes the pages it stored (every tier private)."""
        return self._index is not None

    def stored_parents(self, tokens: Sequence[int]) -> Set[bytes | None] | None:
        """The parents' keys of the stored pages of ``tokens`` (empty: no tier holds a page of
        these tokens), from the index of the pages this hierarchy stored, kept when every tier
        is private; ``None`` without an index (any page may be anywhere: ``locate`` answers)."""
        index = self._index
        if index is None:
            return None
        return index.get(tuple(tokens), _NO_PARENTS)

    def may_hold(self, parent: bytes | None, tokens: Sequence[int]) -> bool:
        """Whether a tier may hold the page of ``tokens`` after the page keyed ``parent``
        (``None``: a prefix's first page): ``False`` only when the index says none does."""
        stored = self.stored_parents(tokens)
        return stored is None or parent in stored

    def _indexed(self, pages: list[PageData]) -> None:
        """Index stored pages (the worker's thread; a page is indexed once a tier took it)."""
        index = self._index
        if index is not None:
            for p in pages:
                parents = index.get(p.token_ids)
                if parents is None:
                    index[p.token_ids] = {p.parent}
                else:
                    parents.add(p.parent)

    def _unindexed(self, pages: list[PageData]) -> None:
        """Forget pages no tier holds any more (pushed out of the last one)."""
        index = self._index
        if index is None:
            return
        for p in pages:
            if any(self._present(i, [p.key]) for i in range(len(self.tiers))):
                continue  # another tier still holds it (a prefetch's copy)
            parents = index.get(p.token_ids)
            if parents is not None:
                parents.discard(p.parent)
                if not parents:
                    del index[p.token_ids]

    def locate(self, digests: Iterator[bytes]) -> tuple[list[bytes], list[tuple[int, int]]]:
        """How far the tiers reach along a prefix's page digests (pulled lazily from
        ``digests``: 1, then 4, 16, ... at a time, so a miss costs one hash and one lookup).

        Returns the located keys and their runs ``(tier index, pages)`` from the first page:
        each page is attributed to the fastest tier holding it.
        """
        keys: list[bytes] = []
        runs: list[tuple[int, int]] = []
        pos, batch = 0, 1
        while True:
            new = list(islice(digests, batch))
            if not new:
                break
            keys.extend(new)
            while pos < len(keys):
                for i in range(len(self.tiers)):
                    found = self._present(i, keys[pos:]) if self._usable(i) else 0
                    if found:
                        break
                else:
                    return keys[:pos], runs
                if runs and runs[-1][0] == i:
                    runs[-1] = (i, runs[-1][1] + found)
                else:
                    runs.append((i, found))
                pos += found
            batch *= 4
        return keys[:pos], runs

    def reach(self, runs: list[tuple[int, int]]) -> tuple[tuple[str, int], ...]:
        """A probe's answer: ``(tier name, tokens)`` per located run (counted as located,
        nothing moved)."""
        found = tuple((self.tiers[i].name, count * self.page_size) for i, count in runs)
        for name, tokens in found:
            self.stats.located_tokens[name] += tokens
        return found

    def plan(self, runs: list[tuple[int, int]], depth: int) -> list[tuple[int, int]]:
        """The leading runs worth loading at ``depth`` tokens (load time below prefill time),
        or none when they hold fewer than ``min_load_pages`` pages."""
        cost, page = self.config.cost, self.page_size
        out: list[tuple[int, int]] = []
        total = 0
        for i, pages in runs:
            tier = self.tiers[i]
            tokens = pages * page
            load_s = tier.latency_s + tokens * self._bpt / tier.bandwidth_bytes_per_s
            if load_s >= cost.recompute_s(tokens, depth + total * page):
                break
            out.append((i, pages))
            total += pages
        skipped = sum(p for _, p in runs) - total
        if total < self.config.min_load_pages:
            skipped, out = skipped + total, []
        self.stats.skipped_pages += skipped
        return out

    def _get(self, i: int, keys: list[bytes]) -> list[PageData | None]:
        with self._lock:
            moving = [self._moving.get(key) for key in keys]
        if all(m is not None and m[0] == i for m in moving):
            return [m[1] for m in moving if m is not None]
        pages: list[PageData | None] = self._call(
            i, "get", lambda: self.tiers[i].get(keys), [None] * len(keys)
        )
        return [
            m[1] if m is not None and m[0] == i and p is None else p
            for m, p in zip(moving, pages, strict=True)
        ]

    def load(
        self, keys: Sequence[bytes], tokens: Sequence[tuple[int, ...]], runs: list[tuple[int, int]]
    ) -> tuple[list[PageData], list[tuple[str, int]]]:
        """Read the pages of ``runs`` and check each one; return the verified pages from the
        first (stopping at the first page no tier has, or one that fails its checks) and the
        tokens per tier, in load order.

        A page its planned tier no longer has (pushed down since ``locate``, e.g. by the
        demotions of the eviction that made room for this load) is looked for in the other
        tiers. A page that fails its checks is removed from its tier and counted.
        """
        planned = [i for i, count in runs for _ in range(count)]
        verified: list[PageData] = []
        per_tier: list[tuple[str, int]] = []
        pos = 0
        while pos < len(planned):
            first = planned[pos]
            end = pos
            while end < len(planned) and planned[end] == first:
                end += 1
            good, corrupt = 0, False
            for i in [first, *(t for t in range(len(self.tiers)) if t != first)]:
                if not self._usable(i):
                    continue
                good, corrupt = self._load_run(
                    i, keys, tokens, pos, end if i == first else len(planned), verified
                )
                if good or corrupt:
                    if good:
                        self._count_load(i, good, per_tier)
                    break
            if corrupt or not good:
                break
            pos += good
        return verified, per_tier

    def _load_run(
        self,
        i: int,
        keys: Sequence[bytes],
        tokens: Sequence[tuple[int, ...]],
        start: int,
        end: int,
        verified: list[PageData],
    ) -> tuple[int, bool]:
        """Read ``keys[start:end]`` from tier ``i``; append the verified leading pages. Returns
        how many, and whether a page failed its checks (then removed, counted)."""
        tier = self.tiers[i]
        good = 0
        for j, page in enumerate(self._get(i, list(keys[start:end]))):
            if page is None:
                break
            try:
                check_page(
                    self.namespace_id,
                    page,
                    keys[start + j],
                    tokens[start + j],
                    self._kv_shape,
                    self._kv_dtype,
                )
            except CorruptPageError as exc:
                key = keys[start + j]
                log.warning(
                    "storage tier %r: discarding page %s: %s", tier.name, key.hex()[:16], exc
                )
                self.stats.corrupt_pages += 1
                self._call(i, "remove", functools.partial(tier.remove, [key]), 0)
                return good, True
            verified.append(page)
            good += 1
        return good, False

    def _count_load(self, i: int, pages: int, per_tier: list[tuple[str, int]]) -> None:
        tier = self.tiers[i]
        tokens = pages * self.page_size
        moved = tokens * self._bpt
        if per_tier and per_tier[-1][0] == tier.name:
            per_tier[-1] = (tier.name, per_tier[-1][1] + tokens)
        else:
            per_tier.append((tier.name, tokens))
        self.stats.hit_tokens[tier.name] += tokens
        self.stats.transfer_bytes[f"{tier.medium}_to_{DEVICE_MEDIUM}"] += moved
        self.stats.load_seconds[tier.name] += tier.latency_s + moved / tier.bandwidth_bytes_per_s

    # -- demotion ---------------------------------------------------------------------------

    def demote(
        self,
        keys: list[bytes],
        tokens: list[tuple[int, ...]],
        parents: list[bytes | None],
        slots: torch.Tensor,
    ) -> None:
        """Store these pages below the device: their KV is copied out of the pool now (the
        slots may be freed as soon as this returns), stored by the worker later. Never raises,
        never waits: a full queue or no tier in use drops the pages and counts them."""
        self.demote_run(len(keys), (keys, tokens, parents), slots)

    def demote_run(
        self, num_pages: int, pages: PageRun | Callable[[], PageRun], slots: torch.Tensor
    ) -> None:
        """``demote`` for ``num_pages`` pages whose keys, tokens and parents ``pages`` is, or
        computes: a callable runs on the worker, off the engine's path (a radix cache hashes
        its evicted pages there). It must read only what the engine no longer changes (an
        evicted node's key, a digest) and return exactly ``num_pages`` pages."""
        if not num_pages:
            return
        counted = False
        try:
            if self._closed or not (
                self._health[0].up or any(self._usable(i) for i in range(len(self.tiers)))
            ):
                self.stats.dropped_pages += num_pages
                return
            if self._queue is not None:
                if not self._reserve(num_pages):
                    self.stats.dropped_pages += num_pages  # full: dropped, never waited for
                    return
                counted = True
            kv = self._pool.read_pages(slots, self.page_size) if self._pool is not None else None
            job = _Job(num_pages, pages, kv)
            if self._queue is None:
                self._store([job])
            elif self._step:
                self._held.append(job)
            else:
                self._queue.post(job)
        except Exception:  # a pool copy that failed: the pages are recomputed later
            log.exception("storage hierarchy: demotion of %d pages failed", num_pages)
            self.stats.dropped_pages += num_pages
            if counted:
                with self._lock:
                    self._queued_pages -= num_pages

    @property
    def held_pages(self) -> int:
        """Pages demoted or prefetched this step and not yet handed to the worker (always 0
        unless ``handoff="step"``)."""
        return sum(map(_job_pages, self._held))

    def end_step(self) -> None:
        """The engine finished scheduling a step (its forward pass comes next): with
        ``handoff="step"``, the worker gets the step's demotions and prefetches now, so it runs
        while the device computes rather than contending with the scheduler for the GIL.
        Otherwise nothing to do. The engine's thread only."""
        if self._held and self._queue is not None:
            self._queue.post_all(self._held)
            self._held.clear()

    def _reserve(self, pages: int) -> bool:
        """Count ``pages`` into the queue's bound, or say it is full."""
        with self._lock:
            if self._queued_pages + pages > self.config.queue_pages:
                return False
            self._queued_pages += pages
            return True

    def prefetch(
        self, keys: list[bytes], tokens: list[tuple[int, ...]], runs: list[tuple[int, int]]
    ) -> int:
        """Start copying the located pages (``keys``, their ``tokens``, their ``runs`` as
        ``locate`` gave them) that only slower tiers hold into the fastest tier in use, so a
        match that follows loads them from there. Never raises, never waits: the copy is queued
        (or done now without a worker); a full queue drops it. Returns the pages it will try."""
        job = _Prefetch(list(keys), list(tokens), list(runs))
        pages = _job_pages(job)
        if not pages or self._closed:
            return 0
        if self._queue is None:
            try:
                self._promote(job)
            except Exception:
                log.exception("storage hierarchy: a prefetch of %d pages failed", pages)
            return pages
        if not self._reserve(pages):
            return 0  # full: demotions come first, a prefetch is only a head start
        if self._step:
            self._held.append(job)
        else:
            self._queue.post(job)  # unbounded (bounded in pages above): never raises
        return pages

    def _top(self) -> int | None:
        """The fastest tier in use now."""
        return next((i for i in range(len(self.tiers)) if self._usable(i)), None)

    def _promote(self, job: _Prefetch) -> None:
        """Copy the prefetch's pages held below the fastest tier in use up into it (verified
        first: a page that fails is removed from its tier and the prefetch stops there)."""
        top = self._top()
        if top is None:
            return
        start = 0
        for i, count in job.runs:
            end = start + count
            if i > top and self._usable(i):
                verified: list[PageData] = []
                good, _ = self._load_run(i, job.keys, job.tokens, start, end, verified)
                if verified:
                    tier = self.tiers[i]
                    self.stats.transfer_bytes[f"{tier.medium}_to_{self.tiers[top].medium}"] += (
                        len(verified) * self.page_size * self._bpt
                    )
                    if self._place(verified, top, tier.medium):
                        self.stats.prefetched_pages += len(verified)
                if good < count:
                    return
            start = end

    def _pages_of(self, job: _Job) -> list[PageData]:
        """Host pages with checksums, from a demotion's device copy."""
        keys, tokens, parents = job.pages() if callable(job.pages) else job.pages
        kv = job.kv
        if len(keys) != job.num_pages:
            raise ValueError(f"a demotion of {job.num_pages} pages computed {len(keys)}")
        if kv is None:
            pages = [PageData(k, t, p, None) for k, t, p in zip(keys, tokens, parents, strict=True)]
        else:
            if kv.device.type == "cpu":  # the pool's read_pages laid it out page by page
                host = kv
            else:
                host = torch.empty(kv.shape, dtype=kv.dtype, pin_memory=self._pin)
                host.copy_(kv)
            pages = [
                PageData(k, t, p, host[j])
                for j, (k, t, p) in enumerate(zip(keys, tokens, parents, strict=True))
            ]
        for p in pages:
            p.checksum = page_checksum(self.namespace_id, p)
        return pages

    def _store(self, jobs: list[_Job]) -> None:
        """Store demotions in the first tier in use, cascading what each tier pushes out: the
        jobs a worker batch took in a row go down as one run of pages (one ``put`` per tier)."""
        pages: list[PageData] = []
        for job in jobs:
            try:
                pages.extend(self._pages_of(job))
            except Exception:
                log.exception(
                    "storage hierarchy: copying %d pages to the host failed", job.num_pages
                )
                self.stats.dropped_pages += job.num_pages
        if not pages:
            return
        if self._place(pages, 0, DEVICE_MEDIUM):
            self.stats.demoted_pages += len(pages)
        else:
            self.stats.dropped_pages += len(pages)

    def _place(self, pages: list[PageData], first: int, source: str) -> bool:
        """Store ``pages`` (coming from ``source``) in the first tier in use from ``first`` on,
        cascading what each tier pushes out to the next. Returns whether a tier took them."""
        placed = False
        for i in range(first, len(self.tiers)):
            tier = self.tiers[i]
            if not pages:
                return placed
            if not self._usable(i):
                continue
            out: list[PageData] | None = self._call(
                i, "put", functools.partial(tier.put, pages), None
            )
            if out is None:
                continue  # failed: try the next tier with the same pages
            if source == DEVICE_MEDIUM or placed:  # a prefetch counted its own read
                self.stats.transfer_bytes[f"{source}_to_{tier.medium}"] += (
                    len(pages) * self.page_size * self._bpt
                )
            placed = True
            self._indexed(pages)
            self._event("stored", tier.medium, pages)
            if out:
                self._event("removed", tier.medium, out)
                with self._lock:
                    for p in out:
                        self._moving[p.key] = (i, p)
            with self._lock:
                for p in pages:
                    moving = self._moving.get(p.key)
                    if moving is not None and moving[0] < i:
                        del self._moving[p.key]
            pages, source = out, tier.medium
        if pages:  # pushed out of the last tier in use: gone
            with self._lock:
                for p in pages:
                    self._moving.pop(p.key, None)
            self._unindexed(pages)
        return placed

    def _event(
        self, kind: Literal["stored", "removed"], medium: str, pages: list[PageData]
    ) -> None:
        if self._observed:
            self._events.append(TierEvent(kind, medium, tuple(pages)))

    def take_events(self) -> list[TierEvent]:
        """The tier events since the last call (the cache reports them on its own thread)."""
        events = self._events
        out = []
        while events:
            out.append(events.popleft())
        return out

    def _run(self) -> None:
        """The worker: take what was posted since its last batch and run it in order (the
        demotions in a row between prefetches stored together), until ``close`` posts
        ``None``."""
        assert self._queue is not None
        while True:
            jobs = self._queue.take()
            for demotions, run in groupby(jobs, key=lambda job: isinstance(job, _Job)):
                if demotions:
                    self._guarded(self._store, cast(list[_Job], list(run)))
                    continue
                for job in run:
                    if isinstance(job, _Prefetch):
                        self._guarded(self._promote, job)
            self._queue.done(len(jobs))
            if any(job is None for job in jobs):
                return

    def _guarded(self, run: Callable[[Any], None], work: _Prefetch | list[_Job]) -> None:
        """Run one of the worker's jobs (the worker outlives any one), then release its pages
        from the queue's bound."""
        try:
            run(work)
        except Exception:
            log.exception("storage hierarchy: a background job failed")
        finally:
            pages = sum(map(_job_pages, work)) if isinstance(work, list) else _job_pages(work)
            with self._lock:
                self._queued_pages -= pages

    # -- lifecycle --------------------------------------------------------------------------

    def flush(self) -> None:
        """Wait until every queued demotion is stored (tests, shutdown); a step's held ones
        are handed to the worker first."""
        if self._queue is not None:
            self.end_step()
            self._queue.join()

    def clear(self) -> None:
        """Drop every page of every tier (a cache ``reset``)."""
        self.flush()
        with self._lock:
            self._moving.clear()
        if self._index is not None:
            self._index.clear()
        for i, tier in enumerate(self.tiers):
            self._call(i, "clear", tier.clear, None)

    def close(self) -> None:
        """Store what is queued, stop the worker, close the tiers. Idempotent."""
        if self._closed:
            return
        self._closed = True
        _WITH_WORKERS.discard(self)
        if self._queue is not None and self._worker is not None:
            self.end_step()
            self._queue.post(None)
            self._queue.join()  # hurries a polling worker to the None
            self._worker.join()
        for tier in self.tiers:
            with contextlib.suppress(Exception):
                tier.close()

    def tier_stats(self) -> list[dict[str, Any]]:
        """Each tier's own ``stats()`` (``{}`` for one that cannot answer now)."""
        out = []
        for i, tier in enumerate(self.tiers):
            s = self._call(i, "stats", tier.stats, None)
            out.append(s.model_dump() if s is not None else {"name": tier.name})
        return out

    def __repr__(self) -> str:
        names = ", ".join(t.name for t in self.tiers)
        return f"TierHierarchy([{names}], write_policy={self.config.write_policy!r})"


# Hierarchies whose demotion worker runs. A program that exits without ``close()`` (or
# ``stack.close()``) would have the interpreter tear down torch under a worker still copying a
# page: a C++ abort ("terminate called without an active exception") instead of an exit. At
# exit each is closed: what is queued is stored, the worker stops.
_WITH_WORKERS: weakref.WeakSet[TierHierarchy] = weakref.WeakSet()


@atexit.register
def _close_at_exit() -> None:
    for hierarchy in list(_WITH_WORKERS):
        with contextlib.suppress(Exception):
            hierarchy.close()
