"""The ZMQ publisher: a real subscriber decodes every batch and rebuilds the cache's blocks."""

from __future__ import annotations

import random
import time

import pytest

pytest.importorskip("zmq")
pytest.importorskip("msgspec")

import zmq

import kvplug
from kvplug.cluster.publisher import ZmqEventPublisher
from kvplug.cluster.wire import EventBatcher, decoder
from kvplug_hookspecs import CacheKey, KVEventsConfig, PrefixStored
from tests.cluster.subscriber import Subscriber
from tests.cluster.workload import CACHES, cached_block_hashes, publishing_config, random_run


def wait_sent(publisher: ZmqEventPublisher, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while publisher.sent_batches < publisher.batcher.batches and time.monotonic() < deadline:
        time.sleep(0.01)
    assert publisher.sent_batches == publisher.batcher.batches


def probe(stack):
    """One batch: store and drop one page outside every random key's alphabet."""
    page = stack.config.pool.page_size
    key = CacheKey([99] * page)
    stack.prefix_cache.insert(key, stack.allocator.alloc(page))
    stack.end_step()
    stack.evict_for(stack.allocator.available_size() + stack.prefix_cache.evictable_size())
    stack.end_step()


@pytest.mark.parametrize("cache", CACHES)
def test_subscriber_rebuilds_exactly_the_cached_blocks(cache):
    stack = kvplug.build(publishing_config(cache))
    publisher = stack.observers[0].publisher
    sub = Subscriber(publisher.endpoint, publisher.replay_endpoint, decoder().decode, b"kv@")
    try:
        sub.wait_connected(lambda: probe(stack))
        counts = random_run(stack, 600, random.Random(cache))
        assert counts["insert"] > 100 and counts["evict"] > 10 and counts["clear"] >= 3
        assert counts["swa_drop"] > 10 if cache == "swa_radix" else counts["swa_drop"] == 0
        wait_sent(publisher)
        sub.receive_until(publisher.sent_batches)
        assert publisher.dropped_batches == 0
        assert sub.topics == {b"kv@pod-0@tiny-model"}
        live = sub.blocks()
        assert live == cached_block_hashes(stack.prefix_cache)
        assert len(live) * 4 == stack.prefix_cache.total_size() > 0
        kinds = {type(e).__name__ for b in sub.batches() for e in b.events}
        assert kinds == {"BlockStored", "BlockRemoved", "AllBlocksCleared"}
        assert all(b.data_parallel_rank == 0 for b in sub.batches())
    finally:
        sub.close()
        stack.close()


def test_replay_recovers_the_batches_a_late_subscriber_missed():
    stack = kvplug.build(publishing_config("radix"))
    publisher = stack.observers[0].publisher
    random_run(stack, 150, random.Random(7))  # nobody listens: these batches are lost on PUB
    wait_sent(publisher)
    missed = publisher.sent_batches
    assert missed > 50
    sub = Subscriber(publisher.endpoint, publisher.replay_endpoint, decoder().decode)
    try:
        sub.wait_connected(lambda: probe(stack))
        random_run(stack, 150, random.Random(8))
        wait_sent(publisher)
        sub.receive_until(publisher.sent_batches)
        assert set(range(missed)) <= set(sub.replayed)  # every missed batch came by replay
        assert publisher.replays >= 1
        assert sub.blocks() == cached_block_hashes(stack.prefix_cache)
    finally:
        sub.close()
        stack.close()


def test_replay_keeps_only_buffer_steps_batches():
    stack = kvplug.build(publishing_config("radix", buffer_steps=5))
    publisher = stack.observers[0].publisher
    random_run(stack, 100, random.Random(3))
    wait_sent(publisher)
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.connect(publisher.replay_endpoint)
    try:
        dealer.send_multipart((b"", (0).to_bytes(8, "big")))
        seqs = []
        while True:
            assert dealer.poll(5000)
            _, topic, seq, payload = dealer.recv_multipart()
            seq = int.from_bytes(seq, "big", signed=True)
            if seq == -1:
                assert (topic, payload) == (b"", b"")
                break
            decoder().decode(payload)
            seqs.append(seq)
        last = publisher.sent_batches - 1
        assert seqs == list(range(last - 4, last + 1))
    finally:
        dealer.close(linger=0)
        stack.close()


def test_absent_subscriber_never_blocks_and_overflow_drops_the_oldest():
    """No subscriber, a tiny high-water mark, a 3-batch queue and a stopped sender: every
    end_step returns, the queue keeps the newest 3 and counts the rest as dropped."""
    config = KVEventsConfig(publisher="zmq", endpoint="tcp://127.0.0.1:*", hwm=1, max_queue_size=3)
    publisher = ZmqEventPublisher.for_config(config, block_size=1)
    publisher._running = False  # the sender thread stops: nothing drains the queue
    publisher.wake()
    publisher._thread.join(2)
    event = PrefixStored(cache="radix", num_tokens=1, block_hashes=(1,), token_ids=(5,))
    for _ in range(1000):
        publisher.batcher.prefix_stored(event)
        publisher.end_step()
    assert publisher.dropped_batches == 997
    assert len(publisher.batcher.take_batches()) == 3
    publisher._close_sockets()


def test_slow_sockets_do_not_slow_the_engine():
    """A publisher with no subscriber sends every batch (PUB drops at its high-water mark)."""
    stack = kvplug.build(publishing_config("radix", hwm=2))
    publisher = stack.observers[0].publisher
    random_run(stack, 300, random.Random(1))
    wait_sent(publisher)
    assert publisher.sent_batches == publisher.batcher.batches > 100
    assert publisher.dropped_batches == 0
    stack.close()
    stack.close()  # idempotent


def test_bytes_hashes_on_the_wire():
    stack = kvplug.build(publishing_config("block_hash", hashes="bytes"))
    publisher = stack.observers[0].publisher
    sub = Subscriber(publisher.endpoint, publisher.replay_endpoint, decoder().decode)
    try:
        sub.wait_connected(lambda: probe(stack))
        random_run(stack, 100, random.Random(2))
        wait_sent(publisher)
        sub.receive_until(publisher.sent_batches)
        live = sub.blocks()
        assert all(isinstance(h, bytes) and len(h) == 8 for h in live)
        assert {int.from_bytes(h, "big") for h in live} == cached_block_hashes(stack.prefix_cache)
    finally:
        sub.close()
        stack.close()


def test_the_scheduler_ends_every_step():
    """The reference scheduler cuts at most one batch per step; the stream matches the cache."""
    from kvplug.engine.request import Request
    from kvplug.engine.scheduler import Scheduler

    stack = kvplug.build(publishing_config("radix"))
    publisher = stack.observers[0].publisher
    sub = Subscriber(publisher.endpoint, publisher.replay_endpoint, decoder().decode)
    try:
        sub.wait_connected(lambda: probe(stack))
        before = publisher.batcher.batches
        scheduler = Scheduler(stack)
        requests = [Request(i, list(range(i % 3, 16 + i % 3)), max_new_tokens=4) for i in range(6)]
        scheduler.run(requests)
        assert scheduler.stats.finished == 6
        assert 0 < publisher.batcher.batches - before <= scheduler.stats.steps
        wait_sent(publisher)
        sub.receive_until(publisher.sent_batches)
        live = sub.blocks()
        assert live == cached_block_hashes(stack.prefix_cache) and len(live) > 4
    finally:
        sub.close()
        stack.close()


def test_busy_port_is_a_clear_error_and_nothing_leaks():
    first = kvplug.build(publishing_config("radix"))
    taken = first.observers[0].publisher.endpoint
    try:
        with pytest.raises(ValueError, match="kv_events: cannot open"):
            kvplug.build(
                {
                    **publishing_config("radix"),
                    "kv_events": {"publisher": "zmq", "endpoint": taken.replace("127.0.0.1", "*")},
                }
            )
    finally:
        first.close()


def test_batcher_is_a_plain_observer_plugin_too():
    """Registered as a plugin, an EventBatcher hears every stack's cache through pluggy."""
    from kvplug.registry import PluginRegistry

    registry = PluginRegistry().load_plugins()
    batcher = EventBatcher(1)
    registry.register(batcher, name="batcher")
    stack = kvplug.build({"pool": {"capacity_tokens": 16, "device": "cpu"}}, registry=registry)
    stack.prefix_cache.insert(CacheKey([1, 2]), stack.allocator.alloc(2))
    (event,) = batcher.end_step().events
    assert (event.token_ids, event.block_size) == ([1, 2], 1)
