"""kvplug's KV events and block hashes checked against vLLM's own code.

* every batch kvplug publishes decodes with vLLM's own ``vllm.distributed.kv_events`` classes,
  and the decoded stream rebuilds exactly the blocks the cache holds after a long random run;
* kvplug's structs encode byte for byte as vLLM's, and kvplug's publisher sends the same frames
  as vLLM's own ``ZmqEventPublisher`` (PUB and replay);
* ``block_hash = "vllm"`` hashes pages bit-identically to vLLM's ``get_request_block_hasher``
  (plain prompts, LoRA, cache_salt, multimodal extra keys), and the published hashes are the
  ones vLLM's ``maybe_convert_block_hash`` would publish.
"""

from __future__ import annotations

import random
import time
from typing import Any

import pytest

pytest.importorskip("vllm")

import msgspec
import zmq
from vllm.distributed import kv_events as vllm_events

import kvplug
from kvplug.caches.block_hashing import VLLMBlockHasher, vllm_extra_key
from kvplug.cluster import wire
from kvplug_hookspecs import CacheKey
from tests.cluster.subscriber import Subscriber
from tests.cluster.workload import CACHES, cached_block_hashes, publishing_config, random_run

pytestmark = pytest.mark.vllm

vllm_decode = msgspec.msgpack.Decoder(vllm_events.KVEventBatch).decode


def wait_sent(publisher: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while publisher.sent_batches < publisher.batcher.batches and time.monotonic() < deadline:
        time.sleep(0.01)
    assert publisher.sent_batches == publisher.batcher.batches


def probe(stack: Any) -> None:
    page = stack.config.pool.page_size
    stack.prefix_cache.insert(CacheKey([99] * page), stack.allocator.alloc(page))
    stack.end_step()
    stack.evict_for(stack.allocator.available_size() + stack.prefix_cache.evictable_size())
    stack.end_step()


# -- the wire -------------------------------------------------------------------------------


@pytest.mark.parametrize("cache", CACHES)
def test_vllms_classes_decode_the_stream_and_rebuild_the_cache(cache):
    stack = kvplug.build(publishing_config(cache))
    publisher = stack.observers[0].publisher
    sub = Subscriber(publisher.endpoint, publisher.replay_endpoint, vllm_decode, b"kv@pod-0")
    try:
        sub.wait_connected(lambda: probe(stack))
        counts = random_run(stack, 600, random.Random(f"vllm-{cache}"))
        assert counts["insert"] > 100 and counts["evict"] > 10 and counts["clear"] >= 3
        wait_sent(publisher)
        sub.receive_until(publisher.sent_batches)
        batches = sub.batches()
        assert all(type(b) is vllm_events.KVEventBatch for b in batches)
        kinds = {type(e) for b in batches for e in b.events}
        assert kinds == {
            vllm_events.BlockStored,
            vllm_events.BlockRemoved,
            vllm_events.AllBlocksCleared,
        }
        for event in (e for b in batches for e in b.events):
            if isinstance(event, vllm_events.BlockStored):
                assert event.block_size == 4 and event.medium == vllm_events.MEDIUM_GPU
                assert len(event.token_ids) == 4 * len(event.block_hashes)
                assert all(isinstance(h, int) and 0 <= h < 2**64 for h in event.block_hashes)
        assert sub.blocks() == cached_block_hashes(stack.prefix_cache)
    finally:
        sub.close()
        stack.close()


def test_replay_with_vllms_classes_recovers_a_gap():
    stack = kvplug.build(publishing_config("radix"))
    publisher = stack.observers[0].publisher
    random_run(stack, 120, random.Random(11))
    wait_sent(publisher)
    missed = publisher.sent_batches
    sub = Subscriber(publisher.endpoint, publisher.replay_endpoint, vllm_decode)
    try:
        sub.wait_connected(lambda: probe(stack))
        random_run(stack, 120, random.Random(12))
        wait_sent(publisher)
        sub.receive_until(publisher.sent_batches)
        assert set(range(missed)) <= set(sub.replayed)
        assert sub.blocks() == cached_block_hashes(stack.prefix_cache)
    finally:
        sub.close()
        stack.close()


def _pairs() -> list[tuple[Any, Any]]:
    """The same batches built from kvplug's structs and from vLLM's."""
    stored = {
        "block_hashes": [1, 2**64 - 1],
        "parent_block_hash": None,
        "token_ids": [5, 6, 7, 8],
        "block_size": 2,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }
    pairs = []
    for parent, medium, lora, rank in (
        (None, "GPU", None, None),
        (7, "CPU", "adapter", 0),
        (b"\x01" * 32, None, None, 3),
    ):
        args = {**stored, "parent_block_hash": parent, "medium": medium, "lora_name": lora}
        ours = wire.KVEventBatch(
            ts=12.25,
            events=[
                wire.BlockStored(**args),
                wire.BlockRemoved(block_hashes=[1], medium=medium),
                wire.AllBlocksCleared(),
            ],
            data_parallel_rank=rank,
        )
        theirs = vllm_events.KVEventBatch(
            ts=12.25,
            events=[
                vllm_events.BlockStored(**args),
                vllm_events.BlockRemoved(block_hashes=[1], medium=medium),
                vllm_events.AllBlocksCleared(),
            ],
            data_parallel_rank=rank,
        )
        pairs.append((ours, theirs))
    return pairs


def test_structs_encode_byte_for_byte_as_vllms():
    encode = msgspec.msgpack.Encoder().encode
    ours_decode = wire.decoder().decode
    for ours, theirs in _pairs():
        assert encode(ours) == encode(theirs)
        assert ours_decode(encode(theirs)) == ours
        assert vllm_decode(encode(ours)) == theirs


def test_publisher_frames_equal_vllms_publisher_frames():
    """The same batches through vLLM's ZmqEventPublisher and kvplug's: identical PUB frames and
    identical replay frames."""
    from kvplug.cluster.publisher import ZmqEventPublisher
    from kvplug_hookspecs import KVEventsConfig

    ctx = zmq.Context.instance()
    theirs = vllm_events.ZmqEventPublisher(
        data_parallel_rank=0,
        endpoint="tcp://127.0.0.1:*",
        replay_endpoint="tcp://127.0.0.1:*",
        topic="kv@p@m",
    )
    config = KVEventsConfig(
        publisher="zmq",
        endpoint="tcp://127.0.0.1:*",
        replay_endpoint="tcp://127.0.0.1:*",
        topic="kv@p@m",
    )
    ours = ZmqEventPublisher.for_config(config, block_size=2)
    their_endpoint = theirs._pub.getsockopt_string(zmq.LAST_ENDPOINT)
    their_replay = theirs._replay.getsockopt_string(zmq.LAST_ENDPOINT)
    subs = []
    try:
        for endpoint in (their_endpoint, ours.endpoint):
            sub = ctx.socket(zmq.SUB)
            sub.connect(endpoint)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            subs.append(sub)
        time.sleep(0.5)  # ZMQ's slow joiner: both subscriptions reach their publishers
        for our_batch, their_batch in _pairs():
            theirs.publish(their_batch)  # vLLM writes its rank (0) into a batch without one
            if our_batch.data_parallel_rank is None:
                our_batch.data_parallel_rank = 0  # as kvplug's batcher does (its config's rank)
            ours.batcher._batches.append(our_batch)
            ours.batcher.batches += 1
            ours.wake()
        frames = [[s.recv_multipart() for _ in range(3)] for s in subs if s.poll(5000)]
        assert len(frames) == 2 and frames[0] == frames[1]
        assert [int.from_bytes(f[1], "big") for f in frames[1]] == [0, 1, 2]

        replies = []
        for endpoint in (their_replay, ours.replay_endpoint):
            dealer = ctx.socket(zmq.DEALER)
            dealer.connect(endpoint)
            dealer.send_multipart((b"", (1).to_bytes(8, "big")))
            got = []
            while not got or got[-1][2] != wire_end():
                assert dealer.poll(5000)
                got.append(dealer.recv_multipart())
            dealer.close(linger=0)
            replies.append(got)
        assert replies[0] == replies[1] and len(replies[0]) == 3  # seq 1, seq 2, end marker
    finally:
        for sub in subs:
            sub.close(linger=0)
        theirs.shutdown()
        ours.close()


def wire_end() -> bytes:
    return vllm_events.ZmqEventPublisher.END_SEQ


# -- block hashes ---------------------------------------------------------------------------


def vllm_request(prompt: list[int], block_size: int, hash_fn: Any, **kwargs: Any) -> Any:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request

    return Request(
        request_id="r",
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
        block_hasher=get_request_block_hasher(block_size, hash_fn),
        **kwargs,
    )


@pytest.fixture(params=["sha256", "sha256_cbor"])
def algorithm(request, monkeypatch):
    """vLLM's hash function of that name, with vLLM's NONE_HASH from the default seed."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils

    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    fn = get_hash_fn_by_name(request.param)
    kv_cache_utils.init_none_hash(fn)
    return request.param, fn


def test_plain_prompts_hash_as_vllm(algorithm):
    from vllm.v1.core import kv_cache_utils

    name, fn = algorithm
    hasher = VLLMBlockHasher(name)
    assert hasher.none_hash == kv_cache_utils.NONE_HASH
    rng = random.Random(name)
    for block_size in (1, 4, 16):
        prompt = [rng.randrange(50_000) for _ in range(block_size * 7 + 3)]
        expected = vllm_request(prompt, block_size, fn).block_hashes
        got = list(hasher.chain(hasher.root(None), prompt, block_size, len(prompt) // block_size))
        assert got == expected and len(got) == len(prompt) // block_size >= 7


def test_lora_and_cache_salt_hash_as_vllm(algorithm):
    from vllm.lora.request import LoRARequest

    name, fn = algorithm
    hasher = VLLMBlockHasher(name)
    prompt = list(range(100, 164))
    lora = LoRARequest("sql-adapter", 1, "/adapters/sql")
    cases = [
        (
            {"lora_request": lora},
            vllm_extra_key(lora_name="sql-adapter", lora_path="/adapters/sql"),
        ),
        ({"cache_salt": "tenant-7"}, vllm_extra_key(cache_salt="tenant-7")),
        ({"cache_salt": "tenant-7"}, "tenant-7"),  # a plain namespace is a cache_salt
        (
            {"lora_request": lora, "cache_salt": "s"},
            vllm_extra_key(lora_name="sql-adapter", lora_path="/adapters/sql", cache_salt="s"),
        ),
    ]
    for kwargs, namespace in cases:
        expected = vllm_request(prompt, 16, fn, **kwargs).block_hashes
        got = list(hasher.chain(hasher.root(namespace), prompt, 16, 4, namespace))
        assert got == expected, kwargs
        # the chain resumed mid-prefix (a radix node under a cached parent) agrees too
        tail = list(hasher.chain(got[1], prompt[32:], 16, 2, namespace))
        assert tail == expected[2:]
    assert vllm_request(prompt, 16, fn).block_hashes != expected


def test_multimodal_extra_keys_hash_as_vllm(algorithm):
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys

    name, fn = algorithm
    hasher = VLLMBlockHasher(name)
    prompt = list(range(80))
    features = [
        MultiModalFeatureSpec(
            data=None,
            modality="image",
            identifier=f"img-{i}",
            mm_position=PlaceholderRange(offset=offset, length=length),
        )
        for i, (offset, length) in enumerate([(5, 20), (40, 8)])
    ]
    request = vllm_request(prompt, 16, fn, mm_features=features)
    keys, mm = [], 0
    for i in range(5):
        extra, mm = generate_block_hash_extra_keys(request, 16 * i, 16 * (i + 1), mm)
        keys.append(extra)
    assert sum(k is not None for k in keys) == 3  # blocks 0, 1 and 2 hold image tokens
    assert hasher.hash_pages(prompt, 16, keys) == request.block_hashes


def test_pythonhashseed_and_explicit_seed_give_vllms_root(monkeypatch):
    from vllm.utils.hashing import sha256
    from vllm.v1.core import kv_cache_utils

    monkeypatch.setenv("PYTHONHASHSEED", "1234")
    kv_cache_utils.init_none_hash(sha256)
    assert VLLMBlockHasher("sha256").none_hash == kv_cache_utils.NONE_HASH
    assert VLLMBlockHasher("sha256", none_hash_seed="1234").none_hash == kv_cache_utils.NONE_HASH
    monkeypatch.delenv("PYTHONHASHSEED")
    kv_cache_utils.init_none_hash(sha256)
    assert VLLMBlockHasher("sha256").none_hash == kv_cache_utils.NONE_HASH


@pytest.mark.parametrize("cache", CACHES)
def test_published_hashes_are_the_ones_vllm_publishes(cache, algorithm):
    """A stack with block_hash = vllm publishes, for a prompt, vLLM's
    maybe_convert_block_hash(block hash) of every block, chained the way vLLM chains them."""
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    name, fn = algorithm
    config = publishing_config(cache, page_size=16)
    config["pool"]["capacity_tokens"] = 512
    if cache == "swa_radix":
        config["allocator"]["options"]["swa_capacity_tokens"] = 256
    config["block_hash"] = {"scheme": "vllm", "algorithm": name}
    stack = kvplug.build(config)
    try:
        batcher = stack.observers[0].publisher.batcher
        rng = random.Random(5)
        prompt = [rng.randrange(30_000) for _ in range(16 * 6)]
        second = prompt[:64] + [rng.randrange(30_000) for _ in range(32)]
        cache_obj, allocator = stack.prefix_cache, stack.allocator
        for key in (prompt, second):
            cache_obj.insert(CacheKey(key), allocator.alloc(len(key)))
        stack.end_step()
        events = [e for b in batcher.take_batches() for e in b.events]
        published = [h for e in events for h in e.block_hashes]
        want = [maybe_convert_block_hash(h) for h in vllm_request(prompt, 16, fn).block_hashes]
        want2 = [maybe_convert_block_hash(h) for h in vllm_request(second, 16, fn).block_hashes]
        assert published == want + want2[4:]
        assert events[1].parent_block_hash == want[3]
        assert cached_ok(stack, prompt, second)
    finally:
        stack.close()


def cached_ok(stack: Any, *prompts: list[int]) -> bool:
    """Both prompts match in full (the vLLM chain is the cache's lookup chain too)."""
    return all(stack.prefix_cache.match_prefix(CacheKey(p)).prefix_len == len(p) for p in prompts)
