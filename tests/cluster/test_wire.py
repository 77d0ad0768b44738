"""The wire structs and the per-step batcher."""

from __future__ import annotations

import pytest

pytest.importorskip("msgspec")

import msgspec

from kvplug.cluster.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatcher,
    KVEventBatch,
    decoder,
    encoder,
)
from kvplug_hookspecs import CacheCleared, PrefixRemoved, PrefixStored


def stored(hashes, parent=None, tokens=(), extra_key=None):
    return PrefixStored(
        cache="radix",
        num_tokens=len(tokens),
        block_hashes=tuple(hashes),
        parent_block_hash=parent,
        token_ids=tuple(tokens),
        extra_key=extra_key,
    )


def test_layout_is_vllms():
    """An array batch of tagged map events; an event writes its required fields, omits defaults."""
    batch = KVEventBatch(
        ts=1.5,
        events=[
            BlockStored(
                block_hashes=[7, 2**64 - 1],
                parent_block_hash=None,
                token_ids=[1, 2, 3, 4],
                block_size=2,
                lora_id=None,
                medium="GPU",
                lora_name=None,
            ),
            BlockRemoved(block_hashes=[7], medium="CPU"),
            AllBlocksCleared(),
        ],
    )
    raw = msgspec.msgpack.decode(encoder().encode(batch))
    assert raw == [
        1.5,
        [
            {
                "type": "BlockStored",
                "block_hashes": [7, 2**64 - 1],
                "parent_block_hash": None,
                "token_ids": [1, 2, 3, 4],
                "block_size": 2,
                "lora_id": None,
                "medium": "GPU",
                "lora_name": None,
            },
            {"type": "BlockRemoved", "block_hashes": [7], "medium": "CPU"},
            {"type": "AllBlocksCleared"},
        ],
        None,  # msgspec writes an array's trailing default, for vLLM's struct too
    ]
    assert list(raw[1][0]) == [
        "type",
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
    ]
    assert decoder().decode(encoder().encode(batch)) == batch


def test_batcher_cuts_one_batch_per_step():
    clock = iter([10.0, 11.0]).__next__
    batcher = EventBatcher(2, clock=clock, data_parallel_rank=3)
    assert batcher.end_step() is None  # an empty step sends nothing
    batcher.prefix_stored(stored([5, 6], None, [1, 2, 3, 4]))
    batcher.prefix_stored(stored([8], 6, [9, 9]))
    batcher.prefix_removed(PrefixRemoved(cache="radix", num_tokens=2, block_hashes=(8,)))
    batcher.prefix_removed(PrefixRemoved(cache="r", num_tokens=4, reason="swa_evicted"))
    assert batcher.pending_events == 3  # the window-only drop carries no block
    first = batcher.end_step()
    batcher.cache_cleared(CacheCleared(cache="radix", num_tokens=4))
    second = batcher.end_step()
    assert batcher.take_batches() == [first, second]
    assert first == KVEventBatch(
        ts=10.0,
        data_parallel_rank=3,
        events=[
            BlockStored([5, 6], None, [1, 2, 3, 4], 2, None, "GPU", None),
            BlockStored([8], 6, [9, 9], 2, None, "GPU", None),
            BlockRemoved([8], "GPU"),
        ],
    )
    assert second == KVEventBatch(ts=11.0, events=[AllBlocksCleared()], data_parallel_rank=3)
    assert batcher.take_batch() is None


def test_bytes_hashes_and_lora_names():
    batcher = EventBatcher(2, hashes="bytes", lora_name={"ns": "adapter"}.get)
    batcher.prefix_stored(stored([1, 2**64 - 2], 3, [0] * 4, extra_key="ns"))
    (event,) = batcher.end_step().events
    assert event.block_hashes == [b"\0" * 7 + b"\1", b"\xff" * 7 + b"\xfe"]
    assert event.parent_block_hash == b"\0" * 7 + b"\3"
    assert event.lora_name == "adapter"


def test_full_buffer_drops_the_oldest_and_counts():
    batcher = EventBatcher(1, buffer_steps=2)
    for h in range(5):
        batcher.prefix_stored(stored([h], None, [h]))
        batcher.end_step()
    assert batcher.dropped_batches == 3 and batcher.batches == 5
    assert [b.events[0].block_hashes for b in batcher.take_batches()] == [[3], [4]]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"block_size": 0}, "block_size"),
        ({"block_size": 2, "hashes": "hex"}, "hashes"),
        ({"block_size": 2, "buffer_steps": 0}, "buffer_steps"),
    ],
)
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EventBatcher(**kwargs)
