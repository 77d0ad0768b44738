"""kvplug's vLLM-format KV-event stream read with SGLang's own event classes.

SGLang's ``sglang.srt.disaggregation.kv_events`` defines its own ``KVEventBatch`` /
``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` (the same tags; its batch's third field
is ``attn_dp_rank``) and a publisher with vLLM's replay protocol, so a consumer built on SGLang's
classes (SGLang's router tooling, Dynamo's SGLang path) decodes kvplug's stream: every batch
decodes, and the stream rebuilds exactly the blocks the cache holds, with a gap filled by replay.
"""

from __future__ import annotations

import random

import pytest

pytest.importorskip("sglang")

import msgspec
from sglang.srt.disaggregation import kv_events as sglang_events

import kvplug
from tests.cluster.subscriber import Subscriber, probe, wait_sent
from tests.cluster.workload import CACHES, cached_block_hashes, publishing_config, random_run

pytestmark = pytest.mark.sglang

sglang_decode = msgspec.msgpack.Decoder(sglang_events.KVEventBatch).decode


@pytest.mark.parametrize("cache", CACHES)
def test_sglangs_classes_decode_the_stream_and_rebuild_the_cache(cache):
    stack = kvplug.build(publishing_config(cache))
    publisher = stack.observers[0].publisher
    random_run(stack, 100, random.Random(f"sglang-early-{cache}"))  # missed: comes by replay
    wait_sent(publisher)
    missed = publisher.sent_batches
    sub = Subscriber(publisher.endpoint, publisher.replay_endpoint, sglang_decode, b"kv@")
    try:
        sub.wait_connected(lambda: probe(stack))
        counts = random_run(stack, 500, random.Random(f"sglang-{cache}"))
        assert counts["insert"] > 80 and counts["clear"] >= 2
        wait_sent(publisher)
        sub.receive_until(publisher.sent_batches)
        assert set(range(missed)) <= set(sub.replayed)
        batches = sub.batches()
        assert all(type(b) is sglang_events.KVEventBatch for b in batches)
        assert all(b.attn_dp_rank == 0 for b in batches)
        kinds = {type(e) for b in batches for e in b.events}
        assert kinds == {
            sglang_events.BlockStored,
            sglang_events.BlockRemoved,
            sglang_events.AllBlocksCleared,
        }
        stored = [e for b in batches for e in b.events if isinstance(e, sglang_events.BlockStored)]
        assert all(e.medium == sglang_events.StorageMedium.GPU.value for e in stored)
        assert sub.blocks() == cached_block_hashes(stack.prefix_cache)
    finally:
        sub.close()
        stack.close()
