"""Typed registration objects that the registration hooks return (conda's ``types.py`` style).

A plugin never hands kvplug a bare class: it hands a frozen record naming the component, the
factory that builds it, the Pydantic model that validates its options, a one-line description
and optional aliases. The registry checks names for clashes across all plugins.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import BaseModel

from .models import NoOptions

if TYPE_CHECKING:
    from .models import PoolGeometry
    from .protocols import EvictionPolicy, PrefixCache, PrefixCacheContext, TokenAllocator
    from .tiers import StorageTier, TierContext

__all__ = [
    "AllocatorRegistration",
    "ComponentRegistration",
    "EvictionPolicyRegistration",
    "PrefixCacheRegistration",
    "StorageTierRegistration",
]

_NAME_RE = re.compile(r"^[a-z][a-z0-9_\-]*$")


@dataclass(frozen=True)
class ComponentRegistration:
    """Fields shared by every registration; use one of the four subclasses."""

    kind: ClassVar[str] = "component"

    name: str
    factory: Callable[..., Any]
    options_model: type[BaseModel] = NoOptions
    description: str = ""
    aliases: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        for label, value in (("name", self.name), *(("alias", a) for a in self.aliases)):
            if not isinstance(value, str) or not _NAME_RE.match(value):
                raise ValueError(
                    f"{self.kind} {label} {value!r} is invalid: use lowercase letters, digits, "
                    "'_' or '-', starting with a letter"
                )
        if isinstance(self.aliases, (list, str)):
            raise TypeError(f"{self.kind} {self.name!r}: aliases must be a tuple of names")
        if not callable(self.factory):
            raise TypeError(f"{self.kind} {self.name!r}: factory {self.factory!r} is not callable")
        if not (isinstance(self.options_model, type) and issubclass(self.options_model, BaseModel)):
            raise TypeError(
                f"{self.kind} {self.name!r}: options_model must be a pydantic BaseModel subclass, "
                f"got {self.options_model!r}"
            )

    @property
    def names(self) -> tuple[str, ...]:
        """The name followed by every alias."""
        return (self.name, *self.aliases)


@dataclass(frozen=True)
class AllocatorRegistration(ComponentRegistration):
    """A token allocator. ``factory(geometry: PoolGeometry, options) -> TokenAllocator``.

    The allocator creates (or is handed) its KV pool and exposes it as ``allocator.pool``.
    """

    kind: ClassVar[str] = "allocator"
    factory: Callable[[PoolGeometry, Any], TokenAllocator]


@dataclass(frozen=True)
class PrefixCacheRegistration(ComponentRegistration):
    """A prefix cache. ``factory(context: PrefixCacheContext, options) -> PrefixCache``.

    ``storage_tiers``: the cache demotes evicted pages to, and loads matched pages from, a
    storage hierarchy (``context.storage``); a config with tiers and a cache without it is refused.
    """

    kind: ClassVar[str] = "prefix cache"
    factory: Callable[[PrefixCacheContext, Any], PrefixCache]
    storage_tiers: bool = False


@dataclass(frozen=True)
class EvictionPolicyRegistration(ComponentRegistration):
    """An eviction policy. ``factory(options) -> EvictionPolicy``; called once per evictable set."""

    kind: ClassVar[str] = "eviction policy"
    factory: Callable[[Any], EvictionPolicy]


@dataclass(frozen=True)
class StorageTierRegistration(ComponentRegistration):
    """A storage tier below the device pool. ``factory(context: TierContext, options) ->
    StorageTier``; called once per engine, with the namespace its keys live in."""

    kind: ClassVar[str] = "storage tier"
    factory: Callable[[TierContext, Any], StorageTier]
