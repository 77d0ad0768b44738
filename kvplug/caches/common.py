"""Pieces every prefix cache shares: key normalisation, counters, the logical clock, events.

Kept small on purpose: each cache owns its own data structure, these are only the parts whose
behaviour must be identical across caches (what a key is, what a counter counts).
"""

from __future__ import annotations

import logging
from array import array
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

import torch
from pydantic import BaseModel

from kvplug_hookspecs import (
    CacheEvents,
    CacheKey,
    CandidateStats,
    EvictionPolicy,
    PrefixCacheContext,
    PrefixRemoved,
    PrefixStored,
    TokenAllocator,
)

from .. import speedups
from ..errors import PolicyError
from ..policies.builtin import LRUPolicy

log = logging.getLogger(__name__)

__all__ = [
    "BuiltFromContext",
    "CacheStats",
    "CandidateStats",
    "QuarantinePolicy",
    "as_cache_key",
    "as_token_ids",
    "cache_options",
    "cache_page_size",
    "check_indices",
    "check_int",
    "check_key",
    "emit_removed",
    "emit_stored",
    "new_policy_instance",
    "policy_error",
    "rebuild_policies",
    "release_ownership",
    "same_device",
    "start_content_id",
    "take_ownership",
]


def start_content_id(namespace: str | None, depth: int, key: Sequence[int]) -> int:
    """A tree node's ``content_id``: where its content starts (namespace, depth, first tokens).

    The same identity the radix cache gives its nodes: content evicted and cached again usually
    comes back longer (a conversation's next turn), so an identity of the start, not the end,
    lets a policy's ghost of it match. Never 0 (0 means "unknown").
    """
    return hash((namespace, depth, tuple(key[:64]))) or 1


def as_cache_key(key: CacheKey | Sequence[int] | torch.Tensor) -> CacheKey:
    """Accept a ``CacheKey``, or bare token ids (a sequence or a 1-D tensor, namespace ``None``)."""
    if isinstance(key, CacheKey):
        return key
    if isinstance(key, (str, bytes)) or not isinstance(key, (Sequence, torch.Tensor)):
        raise TypeError(
            f"a cache key is a CacheKey or a sequence of token ids, got {type(key).__name__}"
        )
    return CacheKey(key)


def as_token_ids(token_ids: Any) -> tuple[int, ...]:
    """A key's token ids as a tuple (hashable, sliceable, compared in C), every element checked.

    A tensor must be 1-D with an integer dtype. Any other sequence is checked in one pass
    without a Python loop per token (``speedups.check_token_ids``): a non-integer or a value
    outside int64 is rejected, naming its position.
    """
    if isinstance(token_ids, torch.Tensor):
        dtype = token_ids.dtype
        if (
            token_ids.dim() != 1
            or dtype.is_floating_point
            or dtype.is_complex
            or dtype == torch.bool
        ):
            raise TypeError(
                f"token ids given as a tensor must be 1-D integers, got shape "
                f"{tuple(token_ids.shape)} dtype {dtype}"
            )
        if dtype == torch.uint64 and token_ids.numel() and int(token_ids.max()) >= 2**63:
            raise ValueError("token ids must fit in int64")
        return tuple(token_ids.tolist())
    last = _last_checked[0]
    if last is not None and token_ids is last:  # the same tuple again (an insert after its match)
        return last
    if isinstance(token_ids, array) and token_ids.typecode in _INT64_CODES:
        ids_of_array: tuple[int, ...] = tuple(token_ids)  # int64 by construction
        return ids_of_array
    if isinstance(token_ids, (str, bytes)) or not isinstance(token_ids, Iterable):
        raise TypeError(f"token ids must be a sequence of ints, got {type(token_ids).__name__}")
    ids = tuple(token_ids)
    # one pass in C, raising naming the first bad position; the leading ints that are the very
    # objects of the last checked tuple are not read again (an insert's key after its match's)
    if speedups.check_token_ids(ids, last):
        _last_checked[0] = ids  # held here, so its identity cannot be reused while remembered
    return ids


# The last tuple of token ids that passed ``as_token_ids`` made only of exact ints: a tuple and
# its ints are immutable, so the same object need not be scanned again (an engine matches, then
# inserts, one key), nor a later tuple's leading positions holding the same int objects.
_last_checked: list[tuple[int, ...] | None] = [None]
_INT64_CODES = frozenset("qlbhiBHI") if array("l").itemsize == 8 else frozenset("qbhiBHI")


def check_key(key: Any) -> tuple[tuple[int, ...], str | None]:
    """Validate a key before a cache changes anything: its token ids and its namespace."""
    if type(key) is tuple:  # bare token ids, as engines pass them: no CacheKey to build
        return as_token_ids(key), None
    key = as_cache_key(key)
    extra_key = key.extra_key
    if extra_key is not None and not isinstance(extra_key, str):
        raise TypeError(f"extra_key must be a str or None, got {type(extra_key).__name__}")
    return as_token_ids(key.token_ids), extra_key


def policy_error(policy: Any, operation: str, exc: BaseException) -> PolicyError:
    """The error a cache raises (``from exc``) when its policy failed during ``operation``."""
    quarantined = isinstance(policy, QuarantinePolicy)
    if quarantined:
        policy = policy.replaced
    return PolicyError(
        f"eviction policy {_qualname(policy)} failed in {operation}: "
        f"{type(exc).__name__}: {exc} (the cache and allocator are as before the call"
        + ("; the policy is quarantined, the cache evicts in LRU order)" if quarantined else ")")
    )


class QuarantinePolicy(LRUPolicy):
    """LRU, standing in for a policy that failed and failed again while the cache re-added its
    candidates (see :func:`rebuild_policies`); ``replaced`` is that policy."""

    def __init__(self, replaced: Any) -> None:
        super().__init__()
        self.replaced = replaced


def rebuild_policies(
    cache: Any, names: tuple[str, ...], refill: Callable[[], None], *, recheck: bool = True
) -> None:
    """After a policy failed: rebuild its view from the cache's own candidates, or quarantine it.

    Why: a failed call can leave a policy holding only some of the candidates, or an entry whose
    key no longer compares with the others; the cache would then keep those slots forever (or
    fail on every later eviction). So every policy named in ``names`` (attributes of ``cache``)
    is cleared and ``refill()`` adds every evictable candidate again. When that fails too (the
    policy still misbehaves), the policies are **quarantined**: each is replaced by a fresh
    :class:`QuarantinePolicy` (LRU), refilled, and a warning is logged (once: LRU does not
    fail). From then on the cache evicts least recently used first, and every unlocked
    slot stays evictable. The caller raises the original failure either way.

    A policy that still misbehaved while it was refilled may not have failed doing so (its
    keys compared among themselves, not with the keys it gives once it behaves again), so with
    ``recheck`` the cache sets ``cache.policy_recheck``: its next call that uses the policy
    (``match_prefix``, ``touch_prefix``, ``insert``, a lock or an unlock, ``evict``) rebuilds
    the view once more, with the policy as it is then (``recheck=False``), before using it.
    """
    try:
        for name in names:
            getattr(cache, name).clear()
        refill()
        cache.policy_recheck = recheck
        return
    except Exception as exc:  # the policy failed again: quarantine it
        error = exc
    kinds = sorted({_qualname(getattr(cache, name)) for name in names})
    for name in names:
        setattr(cache, name, QuarantinePolicy(getattr(cache, name)))
    refill()
    cache.policy_recheck = False
    log.warning(
        "%s: eviction policy %s failed again while the cache re-added its candidates "
        "(%s: %s); quarantined: this cache evicts in LRU order from now on",
        type(cache).__name__,
        ", ".join(kinds),
        type(error).__name__,
        error,
    )


def _qualname(policy: Any) -> str:
    kind = type(policy)
    return f"{kind.__module__}.{kind.__qualname__}"


def check_int(value: Any, what: str, *, minimum: int | None = None) -> int:
    """An int argument (not a bool), checked before anything changes."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be an int, got {type(value).__name__}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{what} must be >= {minimum}, got {value}")
    return value


def take_ownership(allocator: Any, slots: torch.Tensor) -> None:
    """The cache takes these caller-held slots (checked; an error changes nothing). Allocators
    without ownership tracking (e.g. an engine's own) are trusted."""
    take = getattr(allocator, "take_ownership", None)
    if take is not None and slots.numel():
        take(slots)


def release_ownership(allocator: Any, slots: torch.Tensor) -> None:
    """Undo ``take_ownership`` (the cache's operation failed after taking the slots)."""
    release = getattr(allocator, "release_ownership", None)
    if release is not None and slots.numel():
        release(slots)


def same_device(a: torch.device, b: torch.device) -> bool:
    """Equal devices, where an unindexed device (``cuda``) matches any index of its type."""
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def check_indices(indices: Any, length: int, device: torch.device) -> torch.Tensor:
    """Validate KV slot indices given with a key: a 1-D integer tensor of ``length`` slots on
    ``device``. Returns them as int64 (no copy when they already are)."""
    if (  # the common case: what the allocator handed out, in one test
        type(indices) is torch.Tensor
        and indices.dtype == torch.int64
        and indices.dim() == 1
        and indices.numel() == length
        and indices.device == device
    ):
        return indices
    if not isinstance(indices, torch.Tensor):
        raise TypeError(f"indices must be a torch.Tensor of slot ids, got {type(indices).__name__}")
    if indices.dim() != 1 or indices.dtype.is_floating_point or indices.dtype == torch.bool:
        raise TypeError(
            f"indices must be a 1-D integer tensor, got shape {tuple(indices.shape)} "
            f"dtype {indices.dtype}"
        )
    if indices.numel() != length:
        raise ValueError(f"indices has {indices.numel()} slots but the key has {length} tokens")
    if not same_device(indices.device, device):
        raise ValueError(f"indices are on {indices.device}, the allocator's pool is on {device}")
    return indices if indices.dtype == torch.int64 else indices.to(torch.int64)


@dataclass
class CacheStats:
    """Counters every cache keeps; ``evict_from_tree_cache`` fills the shortfall pair."""

    match_queries: int = 0
    match_query_tokens: int = 0
    hit_tokens: int = 0
    inserted_tokens: int = 0
    evicted_tokens: int = 0
    swa_evicted_tokens: int = 0
    evictions: int = 0
    shortfall_requested_tokens: int = 0
    shortfall_freed_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        """Hit tokens over queried tokens (0.0 before any query)."""
        return self.hit_tokens / self.match_query_tokens if self.match_query_tokens else 0.0

    def as_dict(self) -> dict[str, Any]:
        """The counters and the hit rate, for reports and JSON."""
        return {**asdict(self), "hit_rate": self.hit_rate}

    def reset(self) -> None:
        """Zero every counter."""
        for name in self.__dataclass_fields__:
            setattr(self, name, 0)


def emit_stored(
    events: CacheEvents | None,
    cache: str,
    num_tokens: int,
    block_hashes: tuple[int, ...] = (),
    extra_key: str | None = None,
    parent_block_hash: int | None = None,
    token_ids: tuple[int, ...] = (),
) -> None:
    """Report stored tokens when someone observes (``events`` is ``None`` otherwise)."""
    if events is not None and num_tokens:
        events.prefix_stored(
            PrefixStored(
                cache=cache,
                num_tokens=num_tokens,
                block_hashes=block_hashes,
                extra_key=extra_key,
                parent_block_hash=parent_block_hash,
                token_ids=token_ids,
            )
        )


def emit_removed(
    events: CacheEvents | None,
    cache: str,
    num_tokens: int,
    block_hashes: tuple[int, ...] = (),
    reason: str = "evicted",
) -> None:
    """Report removed tokens when someone observes."""
    if events is not None and num_tokens:
        events.prefix_removed(
            PrefixRemoved(
                cache=cache, num_tokens=num_tokens, block_hashes=block_hashes, reason=reason
            )
        )


# -- constructor checks every cache shares ---------------------------------------------------

_Options = TypeVar("_Options", bound=BaseModel)


def cache_options(cache: str, options: _Options | None, options_type: type[_Options]) -> _Options:
    """The cache's options instance (its defaults when ``None``); another type is an error."""
    if options is None:
        return options_type()
    if not isinstance(options, options_type):
        raise TypeError(
            f"{cache} options must be {options_type.__name__}, got {type(options).__name__}"
        )
    return options


def cache_page_size(page_size: int | None, allocator: TokenAllocator) -> int:
    """The cache's page size: the allocator's by default, else a multiple of it.

    A cache page smaller than an allocator page could never be freed on its own.
    """
    if page_size is None:
        return allocator.page_size
    if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size < 1:
        raise ValueError(f"page_size must be a positive int, got {page_size!r}")
    if page_size % allocator.page_size:
        raise ValueError(
            f"page_size={page_size} is not a multiple of the allocator's page_size="
            f"{allocator.page_size}: evicting part of an allocator page cannot free it"
        )
    return page_size


def new_policy_instance(new_policy: Callable[[], EvictionPolicy] | None) -> EvictionPolicy:
    """A fresh policy from the factory (LRU when there is none), checked against the protocol."""
    policy = (new_policy or LRUPolicy)()
    if not isinstance(policy, EvictionPolicy):
        raise TypeError(f"new_policy() returned {type(policy).__name__}, not an EvictionPolicy")
    return policy


class BuiltFromContext:
    """The registered factory every built-in cache shares: ``Cache.from_context(ctx, options)``.

    A cache's constructor takes ``(allocator, new_policy, *, page_size, events, options)``, and
    ``storage`` when the cache uses storage tiers; this unpacks the :class:`PrefixCacheContext`
    the registry hands a prefix-cache factory.
    """

    policy_recheck: bool = False
    """A policy failed and its view was rebuilt: the next call that uses the policy rebuilds it
    once more (see :func:`rebuild_policies`)."""

    @classmethod
    def from_context(cls, context: PrefixCacheContext, options: Any = None) -> Any:
        """Build over ``context.allocator`` with its policy factory, page size and events, and
        its block hasher and storage tiers when the config chose them."""
        extra: dict[str, Any] = {} if context.storage is None else {"storage": context.storage}
        if context.block_hasher is not None:
            extra["block_hasher"] = context.block_hasher
        return cls(  # type: ignore[call-arg]
            context.allocator,
            context.new_policy,
            page_size=context.page_size,
            events=context.events,
            options=options,
            **extra,
        )
