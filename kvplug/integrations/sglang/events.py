"""SGLang's own KV events (``--kv-events-config``) from a kvplug cache.

:class:`SGLangKVEvents` is the kvplug cache's event sink inside the backend: each kvplug event
becomes SGLang's own ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` object, queued in
SGLang's own ``KVCacheEventRecorder`` (which merges a store that continues the previous one, as
SGLang's tree does), which the scheduler drains with ``take_events()`` and publishes with its
own publisher. kvplug observer plugins, when there are any, get the kvplug events too.

What SGLang's consumers (cache-aware routers) see, compared with SGLang's own radix tree:

* the same events for the same operations: one ``BlockStored`` per new leaf (or run of
  chained pages), with its pages' token ids, ``block_size`` = the page size and the parent
  page's hash; one ``BlockRemoved`` per eviction; ``AllBlocksCleared`` on flush;
* block hashes that are kvplug's (``kvplug.caches.block_hashing``: SHA-256 chained over each
  page's int64 tokens from a namespace seed), as signed int64 like SGLang's, not SGLang's
  values: they are consistent with each other (a page's hash is its ``parent_block_hash``
  in its children's events), which is what a consumer that indexes the published hashes needs.
"""

from __future__ import annotations

from typing import Any

from sglang.srt.disaggregation.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    StorageMedium,
)

from kvplug_hookspecs import CacheCleared, CacheEvents, PrefixRemoved, PrefixStored

__all__ = ["NAMESPACE_SEPARATOR", "SGLangKVEvents", "signed_int64"]

NAMESPACE_SEPARATOR = "\x1f"
"""Between SGLang's ``extra_key`` and ``cache_salt`` in a kvplug namespace."""

_GPU = StorageMedium.GPU  # the device tier


def signed_int64(value: int) -> int:
    """An unsigned 64-bit hash as the signed int64 SGLang publishes."""
    return value - (1 << 64) if value >= 1 << 63 else value


class SGLangKVEvents:
    """A kvplug ``CacheEvents`` sink that queues SGLang's event objects in ``recorder``.

    ``forward``: kvplug's own observer fan-out (or ``None``). ``lora_names``: SGLang's table
    from an ``extra_key`` to a LoRA adapter's public name (``CacheInitParams``), or ``None``;
    its ``get`` names a stored block's adapter as SGLang 0.5.23's default format does (0.5.22's
    table has no ``get``, and its default format names none).
    """

    def __init__(
        self,
        recorder: Any,
        page_size: int,
        forward: CacheEvents | None = None,
        lora_names: Any = None,
    ) -> None:
        self.recorder = recorder
        self.page_size = page_size
        self.forward = forward
        self._lora_name = getattr(lora_names, "get", None)

    def prefix_stored(self, event: PrefixStored) -> None:
        if self.forward is not None:
            self.forward.prefix_stored(event)
        if not event.block_hashes:
            return
        extra_key, cache_salt = None, None
        if event.extra_key is not None:
            extra_key, _, salt = event.extra_key.partition(NAMESPACE_SEPARATOR)
            cache_salt = salt or None
        parent = event.parent_block_hash
        self.recorder.enqueue(
            BlockStored(
                block_hashes=[signed_int64(h) for h in event.block_hashes],
                parent_block_hash=None if parent is None else signed_int64(parent),
                token_ids=list(event.token_ids),
                block_size=self.page_size,
                lora_id=None,
                medium=_GPU,
                cache_salt=cache_salt,
                lora_name=None if self._lora_name is None else self._lora_name(extra_key),
            )
        )

    def prefix_removed(self, event: PrefixRemoved) -> None:
        if self.forward is not None:
            self.forward.prefix_removed(event)
        if event.block_hashes:
            hashes = [signed_int64(h) for h in event.block_hashes]
            self.recorder.enqueue(BlockRemoved(block_hashes=hashes, medium=_GPU))

    def cache_cleared(self, event: CacheCleared | None = None) -> None:
        if self.forward is not None and event is not None:
            self.forward.cache_cleared(event)
        self.recorder.enqueue(AllBlocksCleared())
