"""Helpers shared by the cache tests: real allocators, policies by name, a recording event sink.

``KVPLUG_TEST_DEVICE`` (default ``cpu``) puts the allocators, and so every cache, on another
device, e.g. ``KVPLUG_TEST_DEVICE=cuda pytest tests/test_radix_cache.py``.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from kvplug.allocators.paged import PagedAllocator
from kvplug.allocators.standard import StandardAllocator
from kvplug.caches.chunk import ChunkCache
from kvplug.caches.radix import RadixCache, RadixCacheOptions
from kvplug.plugins.policies import kvplug_eviction_policies
from kvplug_hookspecs import CacheCleared, PrefixRemoved, PrefixStored

POLICIES = {registration.name: registration for registration in kvplug_eviction_policies()}
"""The built-in policy registrations by name."""

POLICY_NAMES = tuple(POLICIES)

DEVICE = os.environ.get("KVPLUG_TEST_DEVICE", "cpu")


def new_policy_factory(name: str, **options: Any):
    """A ``new_policy`` callable for the named built-in policy (options validated by its model)."""
    registration = POLICIES[name]
    validated = registration.options_model(**options)
    return lambda: registration.factory(validated)


def make_allocator(capacity: int, page_size: int = 1):
    """A real allocator on the test device, with double-free detection on."""
    if page_size == 1:
        return StandardAllocator(capacity, device=DEVICE, debug_checks=True)
    return PagedAllocator(capacity, page_size, device=DEVICE, debug_checks=True)


def make_radix(
    capacity: int = 64,
    page_size: int = 1,
    policy: str = "lru",
    granularity: str = "exact",
    events: Any = None,
    **policy_options: Any,
) -> tuple[RadixCache, Any]:
    allocator = make_allocator(capacity, page_size)
    cache = RadixCache(
        allocator,
        new_policy_factory(policy, **policy_options),
        page_size=page_size,
        events=events,
        options=RadixCacheOptions(granularity=granularity),
    )
    return cache, allocator


def make_chunk(
    capacity: int = 64, page_size: int = 1, events: Any = None
) -> tuple[ChunkCache, Any]:
    allocator = make_allocator(capacity, page_size)
    return ChunkCache(allocator, page_size=page_size, events=events), allocator


def put(
    cache: Any,
    allocator: Any,
    tokens: list[int],
    *,
    extra_key: str | None = None,
    priority: int = 0,
) -> torch.Tensor:
    """Cache ``tokens`` (page-aligned) on fresh slots; returns the slots the cache now owns."""
    from kvplug_hookspecs import CacheKey

    slots = allocator.alloc(len(tokens))
    assert slots is not None, "test setup: allocator out of slots"
    cache.insert(CacheKey(tokens, extra_key), slots, priority=priority)
    return slots


def cached_slots(cache: Any) -> set[int]:
    return set(cache.all_values_flatten().tolist())


class RecordingEvents:
    """A ``CacheEvents`` sink that keeps every event."""

    def __init__(self) -> None:
        self.stored: list[PrefixStored] = []
        self.removed: list[PrefixRemoved] = []
        self.cleared: list[CacheCleared] = []

    def prefix_stored(self, event: PrefixStored) -> None:
        self.stored.append(event)

    def prefix_removed(self, event: PrefixRemoved) -> None:
        self.removed.append(event)

    def cache_cleared(self, event: CacheCleared) -> None:
        self.cleared.append(event)
