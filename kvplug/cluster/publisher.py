"""The ZMQ publisher of a cache's KV events, on vLLM's wire and with vLLM's replay protocol.

What a subscriber sees is what vLLM's ``ZmqEventPublisher`` sends (vllm 0.33 / 0.34):

* on the PUB socket, one multipart message per batch: ``(topic, seq, payload)``, ``topic`` the
  configured topic as UTF-8, ``seq`` the batch's sequence number (0, 1, 2, ...) as 8 big-endian
  bytes, ``payload`` the msgpack ``KVEventBatch`` (:mod:`kvplug.cluster.wire`);
* on the ROUTER replay socket, a request ``(identity, b"", start_seq as 8 big-endian bytes)``
  (a REQ or DEALER client's send of the 8 bytes) is answered with every buffered batch from
  ``start_seq`` on, each ``(identity, b"", topic, seq, payload)``, then the end marker
  ``(identity, b"", b"", seq -1 as 8 signed big-endian bytes, b"")``. The last ``buffer_steps``
  batches are kept for replay.

The engine's thread never touches a socket. Cache events go to an
:class:`~kvplug.cluster.wire.EventBatcher`; the engine's ``end_step()`` cuts the step's batch into
the batcher's bounded queue (``max_queue_size`` batches; when full the oldest is dropped and
counted) and wakes the sender thread, which encodes, sends and serves replays. A PUB socket drops
at its high-water mark instead of blocking, so a slow or absent subscriber never slows the engine.

``pyzmq`` and ``msgspec`` are imported here: only a config with ``kv_events.publisher="zmq"``
imports this module.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from typing import Any

import zmq

from kvplug_hookspecs import KVEventsConfig

from .wire import EventBatcher, encoder

__all__ = ["END_SEQ", "ZmqEventPublisher", "is_bind_endpoint"]

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The sequence number of the replay's end marker."""


def is_bind_endpoint(endpoint: str) -> bool:
    """vLLM's rule: bind wildcard, IPv6-any, ``ipc://`` and ``inproc://`` endpoints; connect to
    the rest."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqEventPublisher:
    """Publishes one cache's KV events over ZMQ; see the module docstring for the protocol.

    ``batcher``: the cache's event sink (its ``on_batch`` must be this publisher's
    :meth:`wake`; :meth:`for_config` wires both). ``context``: a ZMQ context (the process's
    shared one by default). Sockets are created (and bound) here, so a busy port fails at build
    time; after that only the sender thread uses them.
    """

    POLL_S = 0.05
    """How long the sender thread sleeps when idle (the worst replay latency)."""

    def __init__(
        self,
        config: KVEventsConfig,
        batcher: EventBatcher,
        *,
        context: zmq.Context[Any] | None = None,
    ) -> None:
        self.config = config
        self.batcher = batcher
        self._ctx = context or zmq.Context.instance()
        self._topic = config.topic.encode("utf-8")
        self._replay_buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._seq = 0
        self.sent_batches = 0
        """Batches sent on the PUB socket."""
        self.replays = 0
        """Replay requests served."""
        self._pub: zmq.Socket[Any] = self._ctx.socket(zmq.PUB)
        self._replay: zmq.Socket[Any] | None = None
        try:
            self._pub.set_hwm(config.hwm)
            self._pub.setsockopt(zmq.LINGER, 0)
            if is_bind_endpoint(config.endpoint):
                self._pub.bind(config.endpoint)
            else:
                self._pub.connect(config.endpoint)
            self.endpoint: str = self._pub.getsockopt_string(zmq.LAST_ENDPOINT) or config.endpoint
            """The PUB socket's endpoint (the bound port when ``endpoint`` asked for ``*``)."""
            self.replay_endpoint: str | None = None
            if config.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.SNDHWM, 2 * (config.buffer_steps + 1))
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(config.replay_endpoint)
                self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise ValueError(f"kv_events: cannot open {config.endpoint!r}: {exc}") from exc
        self._wake = threading.Event()
        self._running = True
        self._thread = threading.Thread(target=self._run, name="kvplug-kv-events", daemon=True)
        self._thread.start()

    @classmethod
    def for_config(
        cls, config: KVEventsConfig, block_size: int, **kwargs: Any
    ) -> ZmqEventPublisher:
        """A publisher and its batcher (``publisher.batcher``) for a cache of ``block_size``."""
        holder: list[ZmqEventPublisher] = []
        batcher = EventBatcher(
            block_size,
            hashes=config.hashes,
            buffer_steps=config.max_queue_size,
            data_parallel_rank=config.data_parallel_rank,
            on_batch=lambda: holder[0].wake(),
        )
        publisher = cls(config, batcher, **kwargs)
        holder.append(publisher)
        return publisher

    # --- the engine's side ------------------------------------------------------------------

    def wake(self) -> None:
        """A batch is waiting: wake the sender thread."""
        self._wake.set()

    def end_step(self) -> None:
        """Close the engine step: its events become one batch, sent in the background."""
        self.batcher.end_step()

    @property
    def dropped_batches(self) -> int:
        """Batches dropped before sending because the queue was full."""
        return self.batcher.dropped_batches

    def close(self, timeout: float = 1.0) -> None:
        """Send what is queued (within ``timeout``), stop the thread, close the sockets."""
        if not self._running:
            return
        self.batcher.end_step()
        self._running = False
        self._wake.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("kvplug KV-event sender did not stop within %.1f s", timeout)
            return  # the daemon thread still owns the sockets
        self._close_sockets()

    def __enter__(self) -> ZmqEventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- the sender thread ------------------------------------------------------------------

    def _run(self) -> None:
        pack = encoder()
        while True:
            running = self._running
            batches = self.batcher.take_batches()
            for batch in batches:
                self._send(pack.encode(batch))
            if self._replay is not None:
                try:
                    while self._replay.poll(0):
                        self._serve_replay()
                except Exception:
                    log.exception("kvplug KV-event replay failed")
            if not running and not batches:
                return
            if not batches:
                self._wake.wait(self.POLL_S)
                self._wake.clear()

    def _send(self, payload: bytes) -> None:
        seq = self._seq
        self._seq += 1
        try:
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            self.sent_batches += 1
        except zmq.ZMQError:
            log.exception("kvplug KV-event batch %d not sent", seq)
        self._replay_buffer.append((seq, payload))

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            log.warning("kvplug KV-event replay: ignoring a request of %d frames", len(frames))
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in list(self._replay_buffer):
            if seq >= start_seq:
                self._replay.send_multipart(
                    (client, b"", self._topic, seq.to_bytes(8, "big"), payload)
                )
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))
        self.replays += 1

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
