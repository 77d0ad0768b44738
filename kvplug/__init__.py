"""kvplug: pluggable KV-cache memory for LLM inference engines.

``kvplug`` re-exports the plugin contract (``from kvplug import hookimpl, EvictParams``) next to
the runtime entry points: :func:`build`, :func:`load_config`, :func:`get_registry` and
:func:`evict_from_tree_cache`.
"""

from __future__ import annotations

import logging

from kvplug_hookspecs import (
    AllocatorRegistration,
    CacheCleared,
    CacheKey,
    ComponentSelection,
    EvictionCandidate,
    EvictionPolicy,
    EvictionPolicyRegistration,
    EvictParams,
    EvictResult,
    KeyedEvictionPolicy,
    KVCacheConfig,
    MatchResult,
    NoOptions,
    PoolGeometry,
    PrefixCache,
    PrefixCacheContext,
    PrefixCacheRegistration,
    PrefixRemoved,
    PrefixStored,
    SWATokenAllocator,
    TokenAllocator,
    hookimpl,
    hookspec,
)

from . import _torch  # noqa: F401  (first: imports torch without its numpy warning)
from .config import load_config
from .errors import (
    ConfigError,
    DuplicateComponentError,
    KvplugError,
    PluginError,
    UnknownComponentError,
)
from .eviction import evict_from_tree_cache
from .registry import PluginRegistry, get_registry, reset_registry
from .stack import KVCacheStack, build

__version__ = "0.1.0"

logging.getLogger(__name__).addHandler(logging.NullHandler())


__all__ = [
    "AllocatorRegistration",
    "CacheCleared",
    "CacheKey",
    "ComponentSelection",
    "ConfigError",
    "DuplicateComponentError",
    "EvictParams",
    "EvictResult",
    "EvictionCandidate",
    "EvictionPolicy",
    "EvictionPolicyRegistration",
    "KVCacheConfig",
    "KVCacheStack",
    "KeyedEvictionPolicy",
    "KvplugError",
    "MatchResult",
    "NoOptions",
    "PluginError",
    "PluginRegistry",
    "PoolGeometry",
    "PrefixCache",
    "PrefixCacheContext",
    "PrefixCacheRegistration",
    "PrefixRemoved",
    "PrefixStored",
    "SWATokenAllocator",
    "TokenAllocator",
    "UnknownComponentError",
    "build",
    "evict_from_tree_cache",
    "get_registry",
    "hookimpl",
    "hookspec",
    "load_config",
    "reset_registry",
]
