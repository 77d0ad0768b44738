"""One request, start to finish, with the calls an engine makes: the one home of that sequence.

``match_prefix`` → ``inc_lock_ref`` → evict exactly the shortfall → ``alloc_extend`` the rest →
(the caller writes K/V) → ``insert`` → free the caller's unaligned tail → ``dec_lock_ref``.
The reference scheduler runs the same calls step by step for many requests at once; examples and
benchmarks that serve one request at a time call :func:`serve_request`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvplug_hookspecs import CacheKey

from ..errors import KvplugError
from ..stack import KVCacheStack

__all__ = ["OutOfKVMemory", "ServeResult", "serve_request"]


class OutOfKVMemory(KvplugError):
    """Too little is free or evictable for a request: an engine would preempt or wait."""


@dataclass(frozen=True)
class ServeResult:
    """``prefix_len`` tokens came from the cache; ``evicted_tokens`` were evicted to make room."""

    prefix_len: int
    evicted_tokens: int


def serve_request(
    stack: KVCacheStack,
    key: CacheKey | Sequence[int],
    write_kv: Callable[[torch.Tensor, int], None] | None = None,
) -> ServeResult:
    """Serve one prompt: reuse its cached prefix, compute the rest, cache it all.

    ``write_kv(new_slots, start)`` is called with the slots of positions ``start, start + 1,
    ...`` (the tokens not served from the cache) so the caller can write their K/V. Raises
    :class:`OutOfKVMemory`, changing nothing but the evictions, when the request cannot fit.
    """
    key = key if isinstance(key, CacheKey) else CacheKey(key)
    cache, allocator = stack.prefix_cache, stack.allocator
    page = allocator.page_size
    tokens = key.token_ids
    match = cache.match_prefix(key)
    prefix_len = match.prefix_len
    cache.inc_lock_ref(match.last_node)
    need = -(-len(tokens) // page) * page - prefix_len  # allocators hand out whole pages
    freed = stack.evict_for(need)
    device = allocator.device
    last = int(match.device_indices[-1]) if prefix_len else -1
    new = allocator.alloc_extend(  # type: ignore[attr-defined]
        torch.tensor([prefix_len], device=device),
        torch.tensor([len(tokens)], device=device),
        torch.tensor([last], device=device),
        len(tokens) - prefix_len,
    )
    if new is None:
        cache.dec_lock_ref(match.last_node)
        raise OutOfKVMemory(
            f"a {len(tokens)}-token request needs {need} slots; "
            f"{allocator.available_size()} are free and nothing more is evictable"
        )
    if write_kv is not None:
        write_kv(new, prefix_len)
    slots = torch.cat([match.device_indices, new]) if prefix_len else new
    cache.insert(key, slots)
    cache_page = getattr(cache, "page_size", page)
    aligned = len(tokens) // cache_page * cache_page
    if aligned < len(slots):  # the partial last page stays the caller's: done with it
        allocator.free(slots[aligned:])
    cache.dec_lock_ref(match.last_node)
    return ServeResult(prefix_len, freed.num_tokens if freed else 0)
