"""``evict_from_tree_cache``: evict exactly the allocator's shortfall, never the request size.

This is the call an engine makes before ``alloc`` (SGLang's ``alloc_for_extend`` /
``check_decode_mem``). SGLang's standard-allocator path once evicted ``num_tokens`` whole,
destroying up to ``available_size()`` tokens of reusable prefixes on every memory-pressure event;
here the allocator says what is missing and only that is evicted (rounded up to a page).
"""

from __future__ import annotations

from kvplug_hookspecs import EvictResult, PrefixCache

__all__ = ["evict_from_tree_cache"]


def evict_from_tree_cache(cache: PrefixCache | None, num_tokens: int) -> EvictResult | None:
    """Make room for ``num_tokens`` slots by evicting only what the allocator lacks.

    Returns ``None`` when there is no cache to evict from (``cache`` is ``None`` or a chunk
    cache); an empty ``EvictResult`` when the allocator already has room (nothing is evicted);
    otherwise what ``cache.evict(allocator.shortfall(num_tokens))`` freed, which may be less
    than the shortfall when too little is evictable: the engine then retracts or preempts.

    The cache's ``stats.shortfall_requested_tokens`` / ``shortfall_freed_tokens`` add up the
    full-attention tokens asked for and freed, when the cache keeps ``CacheStats``.
    """
    if not isinstance(num_tokens, int) or isinstance(num_tokens, bool):
        raise TypeError(f"num_tokens must be an int, got {type(num_tokens).__name__}")
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    if cache is None or cache.is_chunk_cache:
        return None
    params = cache.allocator.shortfall(num_tokens)
    if params is None or params.is_empty:
        return EvictResult()
    result = cache.evict(params)
    stats = getattr(cache, "stats", None)
    if stats is not None:
        stats.shortfall_requested_tokens += params.num_tokens
        stats.shortfall_freed_tokens += result.num_tokens
    return result
