"""The kvplug hook specifications.

Two kinds of hooks:

* **Registration hooks** are called once, when the registry loads plugins. Each returns an
  iterable of typed registration objects; the results of all plugins are flattened. They are
  never called again after ``kvplug.build``: the engine then calls plain methods.
* **Observer hooks** report cache events to metrics exporters, routers and the like. They are
  optional; a cache built when no plugin implements an observer hook never pays for events.
"""

from __future__ import annotations

from collections.abc import Iterable

from .markers import hookspec
from .models import CacheCleared, PrefixRemoved, PrefixStored
from .registration import (
    AllocatorRegistration,
    EvictionPolicyRegistration,
    PrefixCacheRegistration,
    StorageTierRegistration,
)

# -------------------------------------------------------------------------------------------
# Registration hooks
# -------------------------------------------------------------------------------------------


@hookspec
def kvplug_allocators() -> Iterable[AllocatorRegistration]:
    """Register token allocators.

    Called once when the registry loads plugins.

    :return: an iterable of :class:`AllocatorRegistration`; ``factory(geometry, options)``
        builds the allocator (and its pool) for a :class:`PoolGeometry`.

    Example::

        from kvplug_hookspecs import AllocatorRegistration, hookimpl

        @hookimpl
        def kvplug_allocators():
            yield AllocatorRegistration(
                name="my_alloc", factory=MyAllocator, description="slots from a bitmap"
            )
    """


@hookspec
def kvplug_prefix_caches() -> Iterable[PrefixCacheRegistration]:
    """Register prefix caches.

    Called once when the registry loads plugins.

    :return: an iterable of :class:`PrefixCacheRegistration`; ``factory(context, options)``
        builds the cache over ``context.allocator`` with policies from ``context.new_policy()``.

    Example::

        from kvplug_hookspecs import PrefixCacheRegistration, hookimpl

        @hookimpl
        def kvplug_prefix_caches():
            return [PrefixCacheRegistration(name="my_cache", factory=MyCache)]
    """


@hookspec
def kvplug_eviction_policies() -> Iterable[EvictionPolicyRegistration]:
    """Register eviction policies.

    Called once when the registry loads plugins. A policy only ranks evictable candidates (leaves
    of a radix tree, unreferenced blocks of a block cache); the cache does the freeing, so one
    policy works with every cache.

    :return: an iterable of :class:`EvictionPolicyRegistration`; ``factory(options)`` returns a
        fresh, empty policy.

    Example::

        from kvplug_hookspecs import EvictionPolicyRegistration, KeyedEvictionPolicy, hookimpl

        class LargestFirst(KeyedEvictionPolicy):
            touch_changes_key = False

            def key(self, c):
                return -c.num_tokens

        @hookimpl
        def kvplug_eviction_policies():
            yield EvictionPolicyRegistration(name="largest_first", factory=LargestFirst)
    """


@hookspec
def kvplug_storage_tiers() -> Iterable[StorageTierRegistration]:
    """Register storage tiers: where evicted KV pages go below the device pool.

    Called once when the registry loads plugins. An engine config lists the tiers it uses under
    ``storage.tiers``, fastest first; kvplug builds each with ``factory(context, options)``
    (:class:`~kvplug_hookspecs.TierContext`: the keys' namespace, the page geometry, a policy
    maker) and verifies every page a tier returns before it touches a pool.

    :return: an iterable of :class:`StorageTierRegistration`; the factory returns a
        :class:`~kvplug_hookspecs.StorageTier`.

    Example::

        from kvplug_hookspecs import StorageTierRegistration, hookimpl

        @hookimpl
        def kvplug_storage_tiers():
            yield StorageTierRegistration(
                name="s3", factory=S3Tier, options_model=S3Options,
                description="pages as objects in a bucket, one prefix per namespace",
            )
    """


# -------------------------------------------------------------------------------------------
# Observer hooks
# -------------------------------------------------------------------------------------------


@hookspec
def kvplug_prefix_stored(event: PrefixStored) -> None:
    """A prefix cache stored new tokens.

    Called by the cache after an ``insert`` that cached ``event.num_tokens`` new tokens
    (``radix``, ``swa_radix`` and ``block_hash`` also give one chained hash per new page, the
    parent page's hash and the new tokens). Not called at all when no plugin implements it.

    Example::

        @hookimpl
        def kvplug_prefix_stored(event):
            metrics.stored_tokens.inc(event.num_tokens)
    """


@hookspec
def kvplug_prefix_removed(event: PrefixRemoved) -> None:
    """A prefix cache removed cached tokens.

    Called after an eviction freed ``event.num_tokens`` tokens (``reason="evicted"``), or after
    an SWA cache dropped window-side KV (``reason="swa_evicted"``).

    Example::

        @hookimpl
        def kvplug_prefix_removed(event):
            router.forget(event.block_hashes)
    """


@hookspec
def kvplug_cache_cleared(event: CacheCleared) -> None:
    """A prefix cache was reset and every cached prefix dropped.

    Example::

        @hookimpl
        def kvplug_cache_cleared(event):
            router.forget_all(event.cache)
    """
