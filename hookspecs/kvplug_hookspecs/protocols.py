"""Typing Protocols of the three component kinds, and the context a cache is built with.

They describe what the engine calls; kvplug's default plugins implement them, and so must a
third-party component. They are for type checkers and ``isinstance`` checks only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from .models import CacheCleared, EvictParams, EvictResult, PrefixRemoved, PrefixStored

if (
    TYPE_CHECKING
):  # typed for plugin authors, torch-free at run time (pytest's hookspec.py does this)
    import torch

__all__ = [
    "CacheEvents",
    "CacheKey",
    "EvictionCandidate",
    "EvictionPolicy",
    "MatchResult",
    "PrefixCache",
    "PrefixCacheContext",
    "SWATokenAllocator",
    "TokenAllocator",
]


@runtime_checkable
class TokenAllocator(Protocol):
    """Hands out KV slot indices (int64 tensors on ``device``) into its pool.

    ``size`` counts usable slots (the padding slot 0 is never handed out). ``alloc`` returns
    ``None`` rather than a partial allocation. ``shortfall(n)`` is how many tokens a cache must
    evict so that ``alloc(n)`` can succeed: ``n - available_size()`` when positive, else ``None``.
    """

    size: int
    page_size: int
    device: torch.device
    pool: Any

    def available_size(self) -> int: ...
    def alloc(self, need_size: int) -> torch.Tensor | None: ...
    def free(self, indices: torch.Tensor) -> None: ...
    def shortfall(self, num_tokens: int) -> EvictParams | None: ...
    def clear(self) -> None: ...
    def free_group_begin(self) -> None: ...
    def free_group_end(self) -> None: ...


@runtime_checkable
class SWATokenAllocator(TokenAllocator, Protocol):
    """An allocator over a full-attention pool and a sliding-window pool (hybrid models)."""

    sliding_window_size: int

    def full_available_size(self) -> int: ...
    def swa_available_size(self) -> int: ...
    def free_swa(self, indices: torch.Tensor) -> None: ...
    def translate_loc_from_full_to_swa(self, indices: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True, slots=True)
class CacheKey:
    """Token ids of a prompt, in a namespace: equal tokens under two ``extra_key`` never share.

    ``extra_key`` carries e.g. a LoRA id or a cache salt.
    """

    token_ids: Sequence[int] | torch.Tensor
    extra_key: str | None = None


@dataclass(frozen=True, slots=True)
class MatchResult:
    """The longest cached prefix of a key.

    ``device_indices`` is an int64 tensor of the prefix's KV slots (length ``prefix_len``);
    ``last_node`` is the handle to lock (``inc_lock_ref``) while a request uses the prefix.
    """

    device_indices: torch.Tensor
    last_node: Any
    prefix_len: int


class EvictionCandidate(Protocol):
    """What a policy may read of a cached leaf or block to rank it.

    Times are logical clocks of the cache (monotonic ints), so runs are reproducible.
    Candidates are hashed by identity. :class:`~kvplug_hookspecs.CandidateStats` is the concrete
    class (it documents each field); the features after ``num_tokens`` default to "unknown".
    """

    node_id: int
    last_access_time: int
    creation_time: int
    hit_count: int
    priority: int
    num_tokens: int
    depth: int
    namespace: str | None
    content_id: int
    partial_page: bool
    new_tokens: int
    turn: int


@runtime_checkable
class EvictionPolicy(Protocol):
    """Keeps the set of evictable candidates of one cache and says which goes first.

    The cache calls ``add`` when a leaf/block becomes evictable, ``discard`` when it stops being
    evictable (locked, gained a child, freed), ``touch`` after updating its statistics on a hit,
    ``pop`` to take the next victim (``None`` when empty) and ``peek`` to see it without taking
    it. Each call is O(log N) or better.
    """

    def add(self, candidate: EvictionCandidate) -> None: ...
    def discard(self, candidate: EvictionCandidate) -> None: ...
    def touch(self, candidate: EvictionCandidate) -> None: ...
    def pop(self) -> EvictionCandidate | None: ...
    def peek(self) -> EvictionCandidate | None: ...
    def clear(self) -> None: ...
    def __len__(self) -> int: ...
    def __contains__(self, candidate: object) -> bool: ...


class CacheEvents(Protocol):
    """Where a cache reports events; kvplug passes ``None`` when no plugin observes them."""

    def prefix_stored(self, event: PrefixStored) -> None: ...
    def prefix_removed(self, event: PrefixRemoved) -> None: ...
    def cache_cleared(self, event: CacheCleared) -> None: ...


@dataclass(frozen=True)
class PrefixCacheContext:
    """What a prefix-cache factory is given: it need not have created any of it.

    ``new_policy()`` returns a fresh, empty policy instance of the configured kind (a cache
    with two evictable sets, like ``swa_radix``, calls it twice). ``events`` is ``None`` when no
    plugin implements an observer hook, so a cache pays nothing for events nobody reads.
    ``block_hasher``: how to hash pages when the config chose (``block_hash``, e.g. vLLM's
    scheme; ``kvplug.caches.block_hashing``), else ``None``: the cache's own default.
    """

    allocator: TokenAllocator
    new_policy: Callable[[], EvictionPolicy]
    page_size: int = 1
    events: CacheEvents | None = None
    block_hasher: Any = None


@runtime_checkable
class PrefixCache(Protocol):
    """A prefix cache with SGLang-compatible method names.

    ``insert(key, indices)`` returns the length of the prefix that was already cached; the
    cache frees the caller's duplicate slots for that prefix (see each cache's docstring).
    """

    allocator: TokenAllocator
    is_chunk_cache: bool

    def match_prefix(self, key: CacheKey | Sequence[int]) -> MatchResult: ...
    def insert(
        self, key: CacheKey | Sequence[int], indices: torch.Tensor, *, priority: int = 0
    ) -> int: ...
    def evict(self, params: EvictParams) -> EvictResult: ...
    def inc_lock_ref(self, node: Any) -> Any: ...
    def dec_lock_ref(self, node: Any) -> Any: ...
    def evictable_size(self) -> int: ...
    def protected_size(self) -> int: ...
    def total_size(self) -> int: ...
    def reset(self) -> None: ...
