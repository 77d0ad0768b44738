"""Built-in token allocators: ``standard``, ``paged``, ``swa``."""

from __future__ import annotations

from collections.abc import Iterator

from kvplug_hookspecs import AllocatorRegistration, hookimpl

from ..allocators.paged import PagedAllocator, PagedAllocatorOptions
from ..allocators.standard import StandardAllocator, StandardAllocatorOptions
from ..allocators.swa import SWAAllocator, SWAAllocatorOptions


@hookimpl
def kvplug_allocators() -> Iterator[AllocatorRegistration]:
    yield AllocatorRegistration(
        name="standard",
        factory=StandardAllocator.from_geometry,
        options_model=StandardAllocatorOptions,
        description="one token per slot (page_size 1) over an MHA pool",
        aliases=("token",),
    )
    yield AllocatorRegistration(
        name="paged",
        factory=PagedAllocator.from_geometry,
        options_model=PagedAllocatorOptions,
        description="whole pages of page_size tokens over an MHA pool",
    )
    yield AllocatorRegistration(
        name="swa",
        factory=SWAAllocator.from_geometry,
        options_model=SWAAllocatorOptions,
        description="full-attention + sliding-window pools with a full->window index map",
        aliases=("hybrid_swa",),
    )
