"""Built-in prefix caches: ``radix``, ``swa_radix``, ``block_hash``, ``chunk``."""

from __future__ import annotations

from collections.abc import Iterator

from kvplug_hookspecs import PrefixCacheRegistration, hookimpl

from ..caches.block_hash import BlockHashCache, BlockHashOptions
from ..caches.chunk import ChunkCache, ChunkCacheOptions
from ..caches.radix import RadixCache, RadixCacheOptions
from ..caches.swa_radix import SWARadixCache, SWARadixOptions


@hookimpl
def kvplug_prefix_caches() -> Iterator[PrefixCacheRegistration]:
    yield PrefixCacheRegistration(
        name="radix",
        factory=RadixCache.from_context,
        options_model=RadixCacheOptions,
        description="SGLang-style radix tree over tokens or whole pages; leaf-only eviction",
        storage_tiers=True,
    )
    yield PrefixCacheRegistration(
        name="swa_radix",
        factory=SWARadixCache.from_context,
        options_model=SWARadixOptions,
        description="radix tree for hybrid full/sliding-window models (window tombstones)",
        aliases=("swa",),
    )
    yield PrefixCacheRegistration(
        name="block_hash",
        factory=BlockHashCache.from_context,
        options_model=BlockHashOptions,
        description="vLLM-style hash-chained blocks with reference counts",
        storage_tiers=True,
        aliases=("hash",),
    )
    yield PrefixCacheRegistration(
        name="chunk",
        factory=ChunkCache.from_context,
        options_model=ChunkCacheOptions,
        description="no prefix sharing; never evicts",
        aliases=("none",),
    )
