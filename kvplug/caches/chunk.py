"""``chunk``: the no-sharing cache (SGLang's ``ChunkCache``), for models or runs without reuse.

Nothing is ever cached: ``match_prefix`` is always empty with ``last_node=None``, sizes are
zero, ``evict`` frees nothing. ``insert`` follows the same ownership rule as ``radix``: the cache
takes ``indices[:aligned]`` and, keeping nothing, frees them at once; ``indices[aligned:]`` stay
the caller's. So an engine's "insert, then free the unaligned tail" path is the same for every
cache. Insert only a *finished* request here: a running one would lose its slots (engines check
``is_chunk_cache``, as SGLang's scheduler does).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvplug_hookspecs import (
    CacheCleared,
    CacheEvents,
    CacheKey,
    EvictionPolicy,
    EvictParams,
    EvictResult,
    MatchResult,
    NoOptions,
    TokenAllocator,
)

from .common import (
    BuiltFromContext,
    CacheStats,
    cache_options,
    cache_page_size,
    check_indices,
    check_int,
    check_key,
    release_ownership,
    take_ownership,
)

__all__ = ["ChunkCache", "ChunkCacheOptions"]


class ChunkCacheOptions(NoOptions):
    """The ``chunk`` cache takes no options."""


class ChunkCache(BuiltFromContext):
    """A prefix cache that shares nothing; ``is_chunk_cache`` is True."""

    name = "chunk"
    is_chunk_cache = True

    def __init__(
        self,
        allocator: TokenAllocator,
        new_policy: Callable[[], EvictionPolicy] | None = None,
        *,
        page_size: int | None = None,
        events: CacheEvents | None = None,
        block_hasher: Any = None,  # shares nothing, so hashes nothing
        options: ChunkCacheOptions | None = None,
    ) -> None:
        options = cache_options("chunk", options, ChunkCacheOptions)
        page_size = cache_page_size(page_size, allocator)
        self.allocator = allocator
        self.page_size = page_size
        self.device = torch.device(allocator.device)
        self.events = events
        self.options = options
        self.stats = CacheStats()
        self._empty = torch.empty(0, dtype=torch.int64, device=self.device)

    def match_prefix(
        self, key: CacheKey | Sequence[int], *, record_hit: bool = True, gather: bool = True
    ) -> MatchResult:
        """Always the empty prefix (the key is still validated; a probe counts nothing)."""
        ids, _ = check_key(key)
        if record_hit:
            self.stats.match_queries += 1
            self.stats.match_query_tokens += len(ids)
        return MatchResult(device_indices=self._empty, last_node=None, prefix_len=0)

    def insert(
        self, key: CacheKey | Sequence[int], indices: torch.Tensor, *, priority: int = 0
    ) -> int:
        """Free ``indices[:aligned]`` (the cache owns and drops them); return 0.

        The slots must be the caller's (held, not cached): they are taken, then freed, and a
        failing ``free`` hands them back, so nothing changes on an error.
        """
        ids, _ = check_key(key)
        indices = check_indices(indices, len(ids), self.device)
        check_int(priority, "priority")
        aligned = len(ids) - len(ids) % self.page_size
        if aligned:
            taken = indices[:aligned]
            take_ownership(self.allocator, taken)
            try:
                self.allocator.free(taken)
            except Exception:
                release_ownership(self.allocator, taken)
                raise
        return 0

    def _check_handle(self, node: Any) -> None:
        if node is not None:
            raise TypeError(f"a chunk cache's only handle is None (match_prefix's), got {node!r}")

    def inc_lock_ref(self, node: None) -> int:
        """Nothing to lock; returns 0."""
        self._check_handle(node)
        return 0

    def dec_lock_ref(self, node: None) -> int:
        """Nothing to unlock; returns 0."""
        self._check_handle(node)
        return 0

    def evict(self, params: EvictParams) -> EvictResult:
        """Nothing is cached, so nothing is freed."""
        if not isinstance(params, EvictParams):
            raise TypeError(f"evict takes EvictParams, got {type(params).__name__}")
        return EvictResult()

    def evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return 0

    def total_size(self) -> int:
        return 0

    def all_values_flatten(self) -> torch.Tensor:
        """No cached slots."""
        return self._empty

    def __repr__(self) -> str:
        return f"ChunkCache(page_size={self.page_size})"

    def reset(self) -> None:
        """Nothing to drop; observers still hear of the reset."""
        if self.events is not None:
            self.events.cache_cleared(CacheCleared(cache=self.name, num_tokens=0))
