"""The storage-tier contract: where evicted KV pages go instead of being destroyed.

A *storage tier* (host memory, a local disk, a Redis server, ...) holds KV **pages** below the
device pool. The caches hand pages to a hierarchy of tiers on eviction (write-back) or on insert
(write-through) and, after a device match, continue the match through the tiers and load what
they hold. A tier only stores and returns :class:`PageData`; the hierarchy (``kvplug.tiers``)
verifies every page before it touches a pool, moves pages between tiers and keeps a failing tier
from failing a request.

Keys are the chained page digests the caches already compute (a page's digest covers every token
from the start of its prefix, see ``kvplug.caches.block_hashing``), inside a
:class:`TierNamespace` derived from everything that makes KV incompatible: KV of one geometry,
model or hash function is never found by another.

Everything here is torch-free at run time: ``PageData.kv`` is a ``torch.Tensor`` (or ``None``
for a bookkeeping-only page) typed only for checkers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from .models import ComponentSelection, TierNamespace, TierStats

if TYPE_CHECKING:
    import torch

    from .protocols import EvictionPolicy

__all__ = ["PAGE_FORMAT_VERSION", "PageData", "StorageTier", "TierContext"]

PAGE_FORMAT_VERSION = 2
"""Version of a stored page's header; a page of another version is discarded, never loaded."""


@dataclass(slots=True)
class PageData:
    """One KV page as a tier holds it.

    ``key``: the page's chained digest. ``token_ids``: its tokens (a loaded page is checked
    against the request's own tokens, and KV events carry them). ``parent``: the digest of the
    page before it (``None`` for a prefix's first page). ``kv``: a ``[2, layers, page_size,
    kv_heads, head_dim]`` tensor on the host, or ``None`` when the pool keeps no KV (a
    simulator's bookkeeping page). ``checksum``: CRC-32C of the header and the KV bytes, set by
    ``kvplug.tiers.pages`` and checked before a page is loaded.
    """

    key: bytes
    token_ids: tuple[int, ...]
    parent: bytes | None
    kv: torch.Tensor | None
    checksum: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class TierContext:
    """What a storage-tier factory is given.

    ``namespace``: the keys' namespace (prefix every stored key or path with ``namespace.id``).
    ``page_bytes``: KV bytes of one page (0 when ``store_kv`` is false). ``pin_memory``: the pool
    is on CUDA, so host copies should be pinned. ``new_policy(selection)``: a fresh eviction
    policy from the registry (a tier that ranks its own pages, like ``host``, uses one).
    """

    namespace: TierNamespace
    page_size: int
    page_bytes: int
    store_kv: bool
    pin_memory: bool
    new_policy: Callable[[ComponentSelection], EvictionPolicy]


@runtime_checkable
class StorageTier(Protocol):
    """A store of KV pages under one namespace, with batch operations sized for pages.

    Calls come from the engine's thread (``contains``, ``get``) and the hierarchy's background
    worker (``put``, ``remove``) at once: a tier is thread safe. Any call may raise (a server
    down, a full disk): the hierarchy counts it, backs off and recomputes; a tier never needs to
    hide its failures. A page is visible to ``contains``/``get`` only once its ``put`` completed.

    * ``contains(keys)``: how many of ``keys`` (consecutive pages of one prefix), from the first,
      are present.
    * ``get(keys)``: the pages, ``None`` for a missing one (unverified: the hierarchy checks).
    * ``put(pages)``: store them; returns the pages the tier's own bound pushed out to make room
      (the hierarchy hands them to the next tier), in eviction order.
    * ``remove(keys)``: drop them (a page that failed its checks); returns how many were there.
    * ``clear()``, ``stats()``, ``close()``.

    ``medium`` is what KV events report for pages here (``"CPU"``, ``"Disk"``, ...);
    ``latency_s`` and ``bandwidth_bytes_per_s`` feed the load-versus-recompute cost model.
    Optionally ``private = True``: only the hierarchy that created it ever stores pages in it
    (process memory; not a directory a restart finds again, not a server other engines write
    to). When every tier is private the hierarchy indexes the pages it stored and answers most
    misses without hashing the page (``TierHierarchy.may_hold``).
    """

    name: str
    medium: str
    latency_s: float
    bandwidth_bytes_per_s: float

    def contains(self, keys: Sequence[bytes]) -> int: ...
    def get(self, keys: Sequence[bytes]) -> list[PageData | None]: ...
    def put(self, pages: Sequence[PageData]) -> list[PageData]: ...
    def remove(self, keys: Sequence[bytes]) -> int: ...
    def clear(self) -> None: ...
    def stats(self) -> TierStats: ...
    def close(self) -> None: ...
