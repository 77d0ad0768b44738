"""``kvplug.build``: resolve a config's names once and wire pool → allocator → policy → cache.

After ``build`` the engine holds plain objects and calls plain methods; pluggy is not consulted
again (observer events go through a sink resolved here, or nowhere when nobody observes).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

from kvplug_hookspecs import (
    EvictionPolicy,
    EvictResult,
    KVCacheConfig,
    PrefixCache,
    PrefixCacheContext,
    PrefixCacheRegistration,
    TokenAllocator,
)

from .errors import ConfigError
from .eviction import evict_from_tree_cache

if TYPE_CHECKING:
    from .registry import PluginRegistry
    from .tiers import TierHierarchy

__all__ = ["KVCacheStack", "build"]


@dataclass(frozen=True)
class KVCacheStack:
    """What ``kvplug.build`` returns: the resolved config and the wired components.

    ``observers``: the built-in observers the config turned on (the KV-event publisher, the
    metrics exporter; see ``kvplug.cluster``), each fed this cache's events. An engine calls
    :meth:`end_step` once per scheduler step (the publisher sends one batch per step) and
    :meth:`close` when it shuts down.
    """

    config: KVCacheConfig
    allocator: TokenAllocator
    prefix_cache: PrefixCache
    new_policy: Callable[[], EvictionPolicy]
    observers: tuple[Any, ...] = field(default=(), repr=False)

    @property
    def pool(self) -> Any:
        """The allocator's KV pool (device tensors)."""
        return self.allocator.pool

    @property
    def storage(self) -> TierHierarchy | None:
        """The storage hierarchy below the pool, or ``None`` without tiers."""
        storage: TierHierarchy | None = getattr(self.prefix_cache, "storage", None)
        return storage

    def evict_for(self, num_tokens: int) -> EvictResult | None:
        """Evict exactly the shortfall for a request of ``num_tokens`` slots."""
        return evict_from_tree_cache(self.prefix_cache, num_tokens)

    def end_step(self) -> None:
        """The engine finished a step: observers cut what they gathered (one KV-event batch)."""
        for observer in self.observers:
            observer.end_step()

    def close(self) -> None:
        """Store what the tiers still have queued and release them, then stop the observers'
        background work (publisher thread, after sending what is queued; metrics server)."""
        if self.storage is not None:
            self.storage.close()
        for observer in self.observers:
            observer.close()

    def __enter__(self) -> KVCacheStack:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def build(
    config: KVCacheConfig | dict[str, Any] | None = None,
    *,
    registry: PluginRegistry | None = None,
) -> KVCacheStack:
    """Build the KV-cache stack a config selects.

    ``config`` may be a :class:`KVCacheConfig`, a plain dict, or ``None`` for the defaults.
    ``registry`` defaults to the process-wide one (built-ins plus entry-point plugins).
    Unknown names raise :class:`kvplug.UnknownComponentError` listing the valid ones; bad options
    raise ``pydantic.ValidationError`` from the plugin's own options model. Nothing is allocated
    before every name and option has been validated.
    """
    from .caches.block_hashing import make_hasher
    from .config import load_config
    from .events import HookEvents
    from .registry import get_registry, new_policy_factory

    if not isinstance(config, KVCacheConfig):
        config = load_config(config or {})
    registry = registry or get_registry()
    resolved = registry.resolve_config(config)
    cache_reg = cast(PrefixCacheRegistration, resolved.prefix_cache.registration)
    if resolved.storage_tiers and not cache_reg.storage_tiers:
        raise ConfigError(
            f"prefix cache {cache_reg.name!r} does not use storage tiers: it neither demotes "
            "evicted pages nor loads them (of the built-in caches only 'radix' and 'block_hash' "
            "do; 'swa_radix' is left out because a prefix loaded without its sliding-window "
            "KV could not be used, 'chunk' caches no prefixes); use 'radix' or 'block_hash', "
            "or remove storage.tiers"
        )

    allocator = resolved.allocator.registration.factory(config.pool, resolved.allocator.options)
    new_policy = new_policy_factory(resolved.eviction_policy)
    observers: list[Any] = []
    if config.kv_events.enabled or config.metrics is not None:
        from .cluster.observers import observers_for  # the cluster extra, only when asked for

        observers = observers_for(config)
    sinks = [o.sink for o in observers if o.sink is not None]
    events = HookEvents.joined(registry.cache_events(), sinks)
    storage = None
    if resolved.storage_tiers:
        from .tiers import build_hierarchy

        tiers = resolved.storage_tiers

        def storage(hash_function: str) -> TierHierarchy:
            return build_hierarchy(
                config, tiers, allocator.pool, registry, hash_function, observed=events is not None
            )

    try:
        context = PrefixCacheContext(
            allocator=allocator,
            new_policy=new_policy,
            page_size=config.pool.page_size,
            events=events,
            block_hasher=None if config.block_hash is None else make_hasher(config.block_hash),
            storage=storage,
        )
        cache = resolved.prefix_cache.registration.factory(context, resolved.prefix_cache.options)
        stack = KVCacheStack(
            config=config,
            allocator=allocator,
            prefix_cache=cache,
            new_policy=new_policy,
            observers=tuple(observers),
        )
        for observer in observers:
            observer.attach(stack)
    except BaseException:
        for observer in observers:
            observer.close()
        raise
    return stack
