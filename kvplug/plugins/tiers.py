"""Built-in storage tiers: ``host``, ``disk``, ``redis``, and ``memory`` (simulations)."""

from __future__ import annotations

from collections.abc import Iterator

from kvplug_hookspecs import StorageTierRegistration, hookimpl

from ..tiers.disk import DiskTier, DiskTierOptions
from ..tiers.host import HostTier, HostTierOptions, MemoryTierOptions, memory_tier
from ..tiers.redis_tier import RedisTier, RedisTierOptions  # the client is imported when built


@hookimpl
def kvplug_storage_tiers() -> Iterator[StorageTierRegistration]:
    yield StorageTierRegistration(
        name="host",
        factory=HostTier,
        options_model=HostTierOptions,
        description="pages in CPU memory (pinned for CUDA pools), ranked by a kvplug policy",
        aliases=("cpu",),
    )
    yield StorageTierRegistration(
        name="disk",
        factory=DiskTier,
        options_model=DiskTierOptions,
        description="page files in a directory, size-bounded, atomic writes, warm restart",
    )
    yield StorageTierRegistration(
        name="redis",
        factory=RedisTier,
        options_model=RedisTierOptions,
        description="pages on a Redis/Valkey server shared by engines; pipelined, timeouts",
        aliases=("valkey",),
    )
    yield StorageTierRegistration(
        name="memory",
        factory=memory_tier,
        options_model=MemoryTierOptions,
        description="host memory under any tier's name and medium: a simulation's stand-in",
    )
