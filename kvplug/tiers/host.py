"""``host``: KV pages in CPU memory (pinned when the pool is on CUDA), ranked by a kvplug policy.

The tier holds at most ``capacity_tokens`` tokens of pages. When a ``put`` needs room, the
configured eviction policy (any registered one: ``lru``, ``lfu``, ``s3fifo``, ...) chooses the
page that goes, among the pages no other held page chains from (a prefix's tail goes before its
head, as on the device, so what stays is always reachable from a prefix's start). The pages it
pushes out are returned to the hierarchy, which passes them to the next tier.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from pydantic import Field

from kvplug_hookspecs import (
    CandidateStats,
    ComponentSelection,
    FrozenModel,
    PageData,
    TierContext,
    TierStats,
)

__all__ = ["HostTier", "HostTierOptions", "MemoryTierOptions", "memory_tier"]


class HostTierOptions(FrozenModel):
    """Options of the ``host`` tier.

    ``capacity_tokens``: how many tokens of pages it holds. ``eviction_policy``: which kvplug
    policy ranks its pages (``lru`` by default). ``latency_s`` / ``bandwidth_bytes_per_s``: the
    cost of a load into the device pool, for the load-versus-recompute decision (PCIe 4/5 with
    pinned memory moves 20-50 GB/s).
    """

    capacity_tokens: int = Field(default=1 << 20, gt=0, strict=True)
    eviction_policy: ComponentSelection = ComponentSelection(name="lru")
    latency_s: float = Field(default=10e-6, ge=0)
    bandwidth_bytes_per_s: float = Field(default=25e9, gt=0)


class MemoryTierOptions(HostTierOptions):
    """Options of the ``memory`` tier: a host tier that stands in for any medium (a simulation
    of a disk or a Redis server without one): ``label`` is its name in reports and hit counts,
    ``medium`` what its events report."""

    label: str = "memory"
    medium: str = "CPU"


def memory_tier(context: TierContext, options: MemoryTierOptions) -> HostTier:
    """The ``memory`` tier: pages in host memory under another tier's name and medium."""
    return HostTier(context, options, name=options.label, medium=options.medium)


class _HostPage(CandidateStats):
    """A held page, as the tier's policy sees it."""

    __slots__ = ("page", "size")

    def __init__(self, page: PageData, now: int, size: int) -> None:
        super().__init__(now, 0, page.num_tokens)
        self.page = page
        self.size = size
        self.content_id = int.from_bytes(page.key[:8], "big") or 1


class HostTier:
    """Pages in host memory under one lock; see the module docstring."""

    name = "host"
    medium = "CPU"
    private = True  # process memory: only its hierarchy stores pages here

    def __init__(
        self,
        context: TierContext,
        options: HostTierOptions | None = None,
        *,
        name: str = "host",
        medium: str = "CPU",
    ) -> None:
        options = options or HostTierOptions()
        self.name, self.medium = name, medium
        self.latency_s = options.latency_s
        self.bandwidth_bytes_per_s = options.bandwidth_bytes_per_s
        self.capacity_tokens = options.capacity_tokens
        self._page_bytes = context.page_bytes
        self._policy = context.new_policy(options.eviction_policy)
        self._pages: dict[bytes, _HostPage] = {}
        self._children: dict[bytes, int] = {}  # parent key -> held pages chaining from it
        self._tokens = 0
        self._clock = 0
        self._lock = threading.Lock()
        self._stored_pages = self._loaded_pages = self._evicted_pages = 0

    def contains(self, keys: Sequence[bytes]) -> int:
        pages = self._pages
        count = 0
        with self._lock:
            for key in keys:
                if key not in pages:
                    break
                count += 1
        return count

    def get(self, keys: Sequence[bytes]) -> list[PageData | None]:
        out: list[PageData | None] = []
        with self._lock:
            found = [self._pages.get(key) for key in keys]
            # the head last: it is then the most recent, and a prefix's tail goes first
            for entry in reversed(found):
                if entry is None:
                    continue
                self._clock += 1
                entry.last_access_time = self._clock
                entry.hit_count += 1
                if entry in self._policy:
                    self._policy.touch(entry)
            for entry in found:
                out.append(None if entry is None else entry.page)
                self._loaded_pages += entry is not None
        return out

    def put(self, pages: Sequence[PageData]) -> list[PageData]:
        evicted: list[PageData] = []
        held, children, policy = self._pages, self._children, self._policy
        # new pages join the policy when they are still leaves: before an eviction and at the
        # end (a run of chained pages adds one candidate, its last page, not one per page)
        pending: list[_HostPage] = []
        with self._lock:
            for page in pages:
                key, size = page.key, page.num_tokens
                if key in held:
                    continue  # already held (write-through, or stored by another engine)
                if self._tokens + size > self.capacity_tokens:
                    self._add_leaves(pending)
                    while self._tokens + size > self.capacity_tokens and held:
                        victim = policy.pop()
                        if victim is None:
                            break
                        assert isinstance(victim, _HostPage)
                        self._drop(victim)
                        evicted.append(victim.page)
                        self._evicted_pages += 1
                    if self._tokens + size > self.capacity_tokens:
                        break  # a page larger than the whole tier
                self._clock += 1
                entry = _HostPage(page, self._clock, self._page_bytes)
                held[key] = entry
                self._tokens += size
                self._stored_pages += 1
                parent_key = page.parent
                if parent_key is not None:
                    count = children.get(parent_key, 0)
                    children[parent_key] = count + 1
                    if count == 0:
                        parent = held.get(parent_key)
                        if parent is not None and parent in policy:
                            policy.discard(parent)
                pending.append(entry)
            self._add_leaves(pending)
        return evicted

    def _add_leaves(self, pending: list[_HostPage]) -> None:
        """Make the pending new pages no held page chains from candidates (the lock is held)."""
        children, policy = self._children, self._policy
        for entry in pending:
            if not children.get(entry.page.key):
                policy.add(entry)
        pending.clear()

    def _drop(self, entry: _HostPage) -> None:
        """Forget one held page (the lock is held); its parent may become a candidate."""
        page = entry.page
        del self._pages[page.key]
        self._tokens -= page.num_tokens
        if entry in self._policy:
            self._policy.discard(entry)
        if page.parent is not None:
            count = self._children[page.parent] - 1
            if count:
                self._children[page.parent] = count
            else:
                del self._children[page.parent]
                parent = self._pages.get(page.parent)
                if parent is not None:
                    self._policy.add(parent)

    def remove(self, keys: Sequence[bytes]) -> int:
        removed = 0
        with self._lock:
            for key in keys:
                entry = self._pages.get(key)
                if entry is not None:
                    self._drop(entry)
                    removed += 1
        return removed

    def clear(self) -> None:
        with self._lock:
            self._pages.clear()
            self._children.clear()
            self._policy.clear()
            self._tokens = 0

    def stats(self) -> TierStats:
        with self._lock:
            return TierStats(
                name=self.name,
                medium=self.medium,
                pages=len(self._pages),
                tokens=self._tokens,
                bytes=len(self._pages) * self._page_bytes,
                capacity_tokens=self.capacity_tokens,
                stored_pages=self._stored_pages,
                stored_bytes=self._stored_pages * self._page_bytes,
                loaded_pages=self._loaded_pages,
                loaded_bytes=self._loaded_pages * self._page_bytes,
                evicted_pages=self._evicted_pages,
            )

    def close(self) -> None:
        self.clear()

    def __repr__(self) -> str:
        return f"HostTier(tokens={self._tokens}, capacity_tokens={self.capacity_tokens})"
