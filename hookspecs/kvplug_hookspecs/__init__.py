"""kvplug's plugin contract: markers, hookspecs, parameter models, Protocols, registrations."""

from __future__ import annotations

from . import hookspecs
from .candidates import CandidateStats
from .markers import PROJECT_NAME, hookimpl, hookspec
from .models import (
    TORCH_DTYPES,
    BlockHashConfig,
    CacheCleared,
    ComponentSelection,
    EvictParams,
    EvictResult,
    FrozenModel,
    KVCacheConfig,
    KVEventsConfig,
    MetricsConfig,
    NoOptions,
    PoolGeometry,
    PrefixRemoved,
    PrefixStored,
)
from .policy_base import FeedbackEvictionPolicy, Ghost, KeyedEvictionPolicy
from .protocols import (
    CacheEvents,
    CacheKey,
    EvictionCandidate,
    EvictionPolicy,
    MatchResult,
    PrefixCache,
    PrefixCacheContext,
    SWATokenAllocator,
    TokenAllocator,
)
from .registration import (
    AllocatorRegistration,
    ComponentRegistration,
    EvictionPolicyRegistration,
    PrefixCacheRegistration,
)

__version__ = "0.1.0"

__all__ = [
    "PROJECT_NAME",
    "TORCH_DTYPES",
    "AllocatorRegistration",
    "BlockHashConfig",
    "CacheCleared",
    "CacheEvents",
    "CacheKey",
    "CandidateStats",
    "ComponentRegistration",
    "ComponentSelection",
    "EvictParams",
    "EvictResult",
    "EvictionCandidate",
    "EvictionPolicy",
    "EvictionPolicyRegistration",
    "FeedbackEvictionPolicy",
    "FrozenModel",
    "Ghost",
    "KVCacheConfig",
    "KVEventsConfig",
    "KeyedEvictionPolicy",
    "MatchResult",
    "MetricsConfig",
    "NoOptions",
    "PoolGeometry",
    "PrefixCache",
    "PrefixCacheContext",
    "PrefixCacheRegistration",
    "PrefixRemoved",
    "PrefixStored",
    "SWATokenAllocator",
    "TokenAllocator",
    "hookimpl",
    "hookspec",
    "hookspecs",
]
