"""A real ZMQ subscriber of kvplug's KV events, written the way vLLM's and llm-d's are.

It subscribes on the PUB socket, notices a gap in the sequence numbers (a late join, a drop),
asks the ROUTER replay socket for the missing batches (a DEALER sending the 8-byte start
sequence), and rebuilds the set of blocks the publisher's cache holds: ``BlockStored`` adds,
``BlockRemoved`` removes, ``AllBlocksCleared`` empties. ``decode`` is any callable from a
payload to a batch with ``.events`` (kvplug's wire structs, or vLLM's own classes).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

import zmq

END_SEQ = -1


class Subscriber:
    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None,
        decode: Callable[[bytes], Any],
        topic: bytes = b"",
    ) -> None:
        ctx = zmq.Context.instance()
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.connect(endpoint)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        self.replay = None
        if replay_endpoint is not None:
            self.replay = ctx.socket(zmq.DEALER)
            self.replay.setsockopt(zmq.LINGER, 0)
            self.replay.connect(replay_endpoint)
        self.decode = decode
        self.payloads: dict[int, bytes] = {}
        self.topics: set[bytes] = set()
        self.replayed: list[int] = []
        self.next_seq = 0

    def wait_connected(self, publish_probe: Callable[[], None], timeout: float = 20.0) -> None:
        """ZMQ's slow joiner: call ``publish_probe`` until a message arrives (then keep it)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            publish_probe()
            if self.poll(0.1):
                return
        raise AssertionError("no message reached the subscriber")

    def poll(self, timeout: float) -> int:
        """Receive what the PUB socket has (waiting up to ``timeout`` s for the first); fill
        gaps from the replay socket. Returns how many messages arrived."""
        got = 0
        wait_ms = int(timeout * 1000)
        while self.sub.poll(wait_ms):
            wait_ms = 0
            topic, seq_bytes, payload = self.sub.recv_multipart()
            self.topics.add(topic)
            seq = int.from_bytes(seq_bytes, "big")
            if seq > self.next_seq:
                self.request_replay(self.next_seq)
            self.payloads[seq] = payload
            self.next_seq = max(self.next_seq, seq + 1)
            got += 1
        return got

    def request_replay(self, start: int, timeout: float = 5.0) -> None:
        assert self.replay is not None, "a gap, and no replay socket to fill it"
        self.replay.send_multipart((b"", start.to_bytes(8, "big")))
        while True:
            assert self.replay.poll(int(timeout * 1000)), "replay did not answer"
            _, topic, seq_bytes, payload = self.replay.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big", signed=True)
            if seq == END_SEQ:
                return
            self.topics.add(topic)
            self.replayed.append(seq)
            self.payloads.setdefault(seq, payload)

    def receive_until(self, count: int, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while len(self.payloads) < count and time.monotonic() < deadline:
            self.poll(0.05)
        assert sorted(self.payloads) == list(range(count)), (
            f"got {len(self.payloads)} of {count} batches"
        )

    def batches(self) -> list[Any]:
        return [self.decode(self.payloads[seq]) for seq in sorted(self.payloads)]

    def blocks(self) -> set[Any]:
        """The blocks the event stream says are cached (each stored once, removed once)."""
        live: set[Any] = set()
        for batch in self.batches():
            for event in batch.events:
                kind = type(event).__name__
                if kind == "BlockStored":
                    assert event.token_ids and event.block_size
                    assert len(event.token_ids) == event.block_size * len(event.block_hashes)
                    for h in event.block_hashes:
                        assert h not in live, f"block {h} stored twice"
                        live.add(h)
                elif kind == "BlockRemoved":
                    for h in event.block_hashes:
                        live.remove(h)
                elif kind == "AllBlocksCleared":
                    live.clear()
                else:
                    raise AssertionError(f"unknown event {event!r}")
        return live

    def close(self) -> None:
        self.sub.close(linger=0)
        if self.replay is not None:
            self.replay.close(linger=0)


def wait_sent(publisher: Any, timeout: float = 30.0) -> None:
    """Wait until the publisher's thread has sent every batch cut so far."""
    deadline = time.monotonic() + timeout
    while publisher.sent_batches < publisher.batcher.batches and time.monotonic() < deadline:
        time.sleep(0.01)
    assert publisher.sent_batches == publisher.batcher.batches


def probe(stack: Any) -> None:
    """Two batches that leave the cache as it was: store one page (outside every random key's
    alphabet), then evict everything evictable. Every call must publish (the first batches go
    to a subscriber that is not connected yet), so the second step evicts by size, not by
    shortfall: an SWA stack's shortfall for "free + evictable" is not everything evictable."""
    from kvplug_hookspecs import CacheKey, EvictParams

    page = stack.config.pool.page_size
    stack.evict_for(page)
    stack.prefix_cache.insert(CacheKey([99] * page), stack.allocator.alloc(page))
    stack.end_step()
    stack.prefix_cache.evict(EvictParams(num_tokens=stack.prefix_cache.evictable_size()))
    stack.end_step()
    assert stack.prefix_cache.evictable_size() == 0, "the probe left a page cached"


@contextmanager
def subscribed(config: dict[str, Any], decode: Callable[[bytes], Any], topic: bytes = b""):
    """A publishing stack built from ``config`` and a connected :class:`Subscriber`, yielded as
    ``(stack, publisher, subscriber)``; both are closed on exit."""
    import kvplug

    stack = kvplug.build(config)
    publisher = stack.observers[0].publisher
    sub = Subscriber(publisher.endpoint, publisher.replay_endpoint, decode, topic)
    try:
        sub.wait_connected(lambda: probe(stack))
        yield stack, publisher, sub
    finally:
        sub.close()
        stack.close()
