"""The built-in observers a config turns on: the KV-event publisher and the metrics exporter.

``kvplug.build`` calls :func:`observers_for` only when ``kv_events.publisher`` is not ``"null"``
or ``metrics`` is set, so the core imports this package (and ``pyzmq`` / ``msgspec`` /
``prometheus-client``) only then. Each observer belongs to one stack: it gets that cache's events
(``sink``), is attached to the built stack (``attach``), is told where an engine step ends
(``end_step``) and is closed with the stack (``close``).
"""

from __future__ import annotations

from typing import Any, Protocol

from kvplug_hookspecs import CacheEvents, KVCacheConfig

__all__ = ["StackObserver", "observers_for"]


class StackObserver(Protocol):
    """What a built-in observer offers the stack."""

    @property
    def sink(self) -> CacheEvents | None: ...
    def attach(self, stack: Any) -> None: ...
    def end_step(self) -> None: ...
    def close(self) -> None: ...


class _Publishing:
    """The ZMQ publisher as a stack observer."""

    def __init__(self, config: KVCacheConfig) -> None:
        from .publisher import ZmqEventPublisher

        self.publisher = ZmqEventPublisher.for_config(config.kv_events, config.pool.page_size)
        self.sink: CacheEvents | None = self.publisher.batcher

    def attach(self, stack: Any) -> None:
        pass

    def end_step(self) -> None:
        self.publisher.end_step()

    def close(self) -> None:
        self.publisher.close()


def observers_for(config: KVCacheConfig) -> list[StackObserver]:
    """The observers ``config`` turns on, in a fixed order (publisher, then metrics)."""
    observers: list[StackObserver] = []
    try:
        if config.kv_events.enabled:
            observers.append(_Publishing(config))
        if config.metrics is not None:
            from .metrics import CacheMetrics

            observers.append(CacheMetrics(config))
    except BaseException:
        for observer in observers:
            observer.close()
        raise
    return observers
