"""Storage tiers below the device pool: ``host``, ``disk``, ``redis``, and the hierarchy.

The caches call the hierarchy (demote on eviction, load after a device match); the tiers never
call a cache. :func:`build_hierarchy` is what ``kvplug.build`` hands a cache that asks for one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from kvplug_hookspecs import KVCacheConfig, TierContext, TierNamespace

from .hierarchy import HierarchyStats, TierEvent, TierHierarchy

if TYPE_CHECKING:
    from ..registry import PluginRegistry, ResolvedComponent

__all__ = [
    "HierarchyStats",
    "TierEvent",
    "TierHierarchy",
    "build_hierarchy",
    "kv_bytes_per_token",
    "namespace_for",
]


def kv_bytes_per_token(config: KVCacheConfig) -> int:
    """KV bytes of one token: ``2 x layers x kv_heads x head_dim x dtype size``."""
    pool = config.pool
    size = torch.empty(0, dtype=getattr(torch, pool.dtype)).element_size()
    return 2 * pool.num_layers * pool.kv_heads * pool.head_dim * size


def namespace_for(config: KVCacheConfig, hash_function: str) -> TierNamespace:
    """The namespace of a config's pages: model, geometry and the caches' hash function."""
    pool = config.pool
    return TierNamespace(
        model_id=config.storage.model_id,
        num_layers=pool.num_layers,
        kv_heads=pool.kv_heads,
        head_dim=pool.head_dim,
        dtype=pool.dtype,
        page_size=pool.page_size,
        hash_function=hash_function,
    )


def build_hierarchy(
    config: KVCacheConfig,
    tiers: Sequence[ResolvedComponent],
    pool: Any,
    registry: PluginRegistry,
    hash_function: str,
    *,
    observed: bool = False,
) -> TierHierarchy:
    """Build each configured tier (fastest first) in the namespace of ``hash_function``.

    A tier whose factory raises closes the ones built before it and re-raises.
    """
    namespace = namespace_for(config, hash_function)
    store_kv = config.pool.store_kv
    bpt = kv_bytes_per_token(config)
    device = getattr(pool, "device", torch.device("cpu"))
    context = TierContext(
        namespace=namespace,
        page_size=config.pool.page_size,
        page_bytes=bpt * config.pool.page_size,
        store_kv=store_kv,
        pin_memory=torch.device(device).type == "cuda",
        new_policy=lambda selection: registry.policy_factory(selection)(),
    )
    built: list[Any] = []
    try:
        for tier in tiers:
            built.append(tier.registration.factory(context, tier.options))
    except BaseException:
        for t in built:
            t.close()
        raise
    return TierHierarchy(
        built,
        config.storage,
        namespace,
        pool=pool if store_kv else None,
        page_size=config.pool.page_size,
        kv_bytes_per_token=bpt,
        pin_memory=context.pin_memory,
        observed=observed,
    )
