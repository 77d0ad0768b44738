"""Checked by mypy in CI (``[tool.mypy] files``): registry lookups are typed per kind."""

from __future__ import annotations

from typing_extensions import assert_type

from kvplug import get_registry
from kvplug_hookspecs import (
    AllocatorRegistration,
    EvictionPolicyRegistration,
    PoolGeometry,
    PrefixCacheRegistration,
    TokenAllocator,
)


def lookups_are_typed_per_kind() -> None:
    registry = get_registry()
    allocator = registry.get("allocator", "standard")
    assert_type(allocator, AllocatorRegistration)
    assert_type(registry.get("prefix_cache", "radix"), PrefixCacheRegistration)
    assert_type(registry.get("eviction_policy", "lru"), EvictionPolicyRegistration)
    built = allocator.factory(PoolGeometry(), None)
    assert_type(built, TokenAllocator)
