"""vLLM's KV-event wire format, and the sink that turns kvplug's cache events into it.

The structs below encode byte for byte as vLLM's ``vllm.distributed.kv_events`` structs
(vllm 0.33 and 0.34 define them identically): a ``KVEventBatch`` is a msgpack *array*
``[ts, events, data_parallel_rank?]``; each event is a msgpack *map* tagged with its class name
(``{"type": "BlockStored", ...}``); fields appear in the same order, fields without a default are
always written (``None`` as nil) and defaulted ones only when set. So a subscriber decoding with
vLLM's own classes (llm-d's indexer, Dynamo's KV router, vLLM's tests) reads kvplug's batches,
and :func:`decoder` reads vLLM's.

A block hash on the wire (vLLM's ``ExternalBlockHash``) is an ``int`` (vLLM's default,
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``) or ``bytes``. kvplug's events carry each page's hash
as a 64-bit unsigned int (``PrefixStored.block_hashes``); :class:`EventBatcher` puts it on the
wire as that int, or with ``hashes="bytes"`` as its 8 big-endian bytes.

``msgspec`` is imported here: import this module only when events are published or consumed.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Literal

import msgspec

from kvplug_hookspecs import CacheCleared, PrefixRemoved, PrefixStored, hookimpl

__all__ = [
    "MEDIUM_CPU",
    "MEDIUM_GPU",
    "MEDIUM_STORAGE",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "EventBatcher",
    "KVCacheEvent",
    "KVEventBatch",
    "decoder",
    "encoder",
]

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"

ExternalBlockHash = bytes | int
"""A block hash as vLLM puts it on the wire."""


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A timestamped batch of events (an array on the wire)."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the KV events: a map on the wire, tagged ``"type": <class name>``."""


class BlockStored(KVCacheEvent):
    """Full blocks became cached: their chained hashes, the parent block's hash, their tokens."""

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(KVCacheEvent):
    """Blocks stopped being cached on ``medium``."""

    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    """Every cached block was dropped."""


class KVEventBatch(EventBatch):
    """The batch vLLM's publisher sends: its events are the three KV events."""

    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def encoder() -> msgspec.msgpack.Encoder:
    """A msgpack encoder for batches (one per thread: encoders are not thread-safe)."""
    return msgspec.msgpack.Encoder()


def decoder() -> msgspec.msgpack.Decoder[KVEventBatch]:
    """A msgpack decoder of ``KVEventBatch`` payloads (kvplug's or vLLM's)."""
    return msgspec.msgpack.Decoder(KVEventBatch)


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatcher:
    """A cache event sink that turns kvplug events into vLLM's wire events, one batch per step.

    Give it to a cache as its ``events`` (it has the ``CacheEvents`` methods), or register it as
    an observer plugin (it has the ``kvplug_prefix_*`` hookimpls). Each event is converted and
    appended to the open step; :meth:`end_step` closes the step into a ``KVEventBatch`` (none when
    the step had no event) and keeps it in a bounded buffer of ``buffer_steps`` batches, where
    :meth:`take_batches` (a publisher thread, an in-process router) collects them. A full buffer
    drops its oldest batch and counts it in ``dropped_batches``: a consumer that falls behind
    never blocks or grows the engine.

    ``block_size``: the cache's page size (each ``BlockStored`` carries it). ``hashes``: ``"int"``
    puts each 64-bit page hash on the wire as an int (vLLM's default), ``"bytes"`` as its 8
    big-endian bytes. ``lora_name``: maps an event's ``extra_key`` (kvplug's namespace) to the
    LoRA adapter name a ``BlockStored`` carries, or ``None`` to send none. ``on_batch``: called
    (with no argument) after a batch is buffered, e.g. to wake a publisher thread.

    Thread-safe: the cache's thread appends, one consumer thread takes.
    """

    def __init__(
        self,
        block_size: int,
        *,
        hashes: Literal["int", "bytes"] = "int",
        buffer_steps: int = 10_000,
        data_parallel_rank: int | None = None,
        lora_name: Callable[[str | None], str | None] | None = None,
        on_batch: Callable[[], None] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        if hashes not in ("int", "bytes"):
            raise ValueError(f"hashes must be 'int' or 'bytes', got {hashes!r}")
        if not isinstance(buffer_steps, int) or buffer_steps <= 0:
            raise ValueError(f"buffer_steps must be a positive int, got {buffer_steps!r}")
        self.block_size = block_size
        self.hashes = hashes
        self.data_parallel_rank = data_parallel_rank
        self._wire_hash: Callable[[int], ExternalBlockHash] = (
            int if hashes == "int" else _hash_bytes
        )
        self._lora_name = lora_name
        self._on_batch = on_batch
        self._clock = clock
        self._open: list[KVEvent] = []
        self._batches: deque[KVEventBatch] = deque(maxlen=buffer_steps)
        self._lock = threading.Lock()
        self.dropped_batches = 0
        """Batches dropped because the buffer was full (the oldest go first)."""
        self.batches = 0
        """Batches cut so far."""

    # --- the cache's side -------------------------------------------------------------------

    def prefix_stored(self, event: PrefixStored) -> None:
        if not event.block_hashes:
            return
        wire = self._wire_hash
        parent = event.parent_block_hash
        stored = BlockStored(
            block_hashes=[wire(h) for h in event.block_hashes],
            parent_block_hash=None if parent is None else wire(parent),
            token_ids=list(event.token_ids),
            block_size=self.block_size,
            lora_id=None,
            medium=getattr(event, "medium", MEDIUM_GPU),
            lora_name=None if self._lora_name is None else self._lora_name(event.extra_key),
        )
        with self._lock:
            self._open.append(stored)

    def prefix_removed(self, event: PrefixRemoved) -> None:
        if not event.block_hashes:
            return  # a window-only (SWA) drop: the blocks' full KV stays cached
        wire = self._wire_hash
        removed = BlockRemoved(
            block_hashes=[wire(h) for h in event.block_hashes], medium=event.medium
        )
        with self._lock:
            self._open.append(removed)

    def cache_cleared(self, event: CacheCleared | None = None) -> None:
        with self._lock:
            self._open.append(AllBlocksCleared())

    # The same methods as observer hookimpls, so a batcher can be registered as a plugin.
    @hookimpl
    def kvplug_prefix_stored(self, event: PrefixStored) -> None:
        self.prefix_stored(event)

    @hookimpl
    def kvplug_prefix_removed(self, event: PrefixRemoved) -> None:
        self.prefix_removed(event)

    @hookimpl
    def kvplug_cache_cleared(self, event: CacheCleared) -> None:
        self.cache_cleared(event)

    # --- the engine's side ------------------------------------------------------------------

    def end_step(self) -> KVEventBatch | None:
        """Close the step: its events become one buffered batch (returned), or ``None``."""
        with self._lock:
            if not self._open:
                return None
            batch = KVEventBatch(
                ts=self._clock(), events=self._open, data_parallel_rank=self.data_parallel_rank
            )
            self._open = []
            if len(self._batches) == self._batches.maxlen:
                self.dropped_batches += 1
            self._batches.append(batch)
            self.batches += 1
        if self._on_batch is not None:
            self._on_batch()
        return batch

    def take_batch(self) -> KVEventBatch | None:
        """The oldest buffered batch (removed from the buffer), or ``None``."""
        with self._lock:
            return self._batches.popleft() if self._batches else None

    def take_batches(self) -> list[KVEventBatch]:
        """Every buffered batch, oldest first (the buffer is emptied)."""
        with self._lock:
            batches = list(self._batches)
            self._batches.clear()
        return batches

    @property
    def pending_events(self) -> int:
        """Events of the open (not yet ended) step."""
        return len(self._open)


def _hash_bytes(value: int) -> bytes:
    return value.to_bytes(8, "big")
