"""Built-in token allocators: ``standard`` (slots), ``paged`` (pages), ``swa`` (full + window)."""

from .base import CACHED, FREE, HELD, AllocatorCheckOptions, BaseAllocator, FreeIdStack
from .paged import PagedAllocator, PagedAllocatorOptions
from .standard import StandardAllocator, StandardAllocatorOptions
from .swa import SWAAllocator, SWAAllocatorOptions, default_swa_layer_ids

__all__ = [
    "CACHED",
    "FREE",
    "HELD",
    "AllocatorCheckOptions",
    "BaseAllocator",
    "FreeIdStack",
    "PagedAllocator",
    "PagedAllocatorOptions",
    "SWAAllocator",
    "SWAAllocatorOptions",
    "StandardAllocator",
    "StandardAllocatorOptions",
    "default_swa_layer_ids",
]
