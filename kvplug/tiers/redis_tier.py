"""``redis``: KV pages on a Redis-compatible server (Redis, Valkey), shared by every engine.

Each page is one string value ``<key_prefix>:<namespace id>:<page key hex>`` in the byte form of
:mod:`kvplug.tiers.pages`, so engines of one namespace pointed at one server share their
prefixes, and engines of another model or geometry never see them. Batches are pipelined (one
round trip for ``contains``, ``get``, ``put``); every call has ``timeout_s`` (socket connect and
read), so a dead or slow server costs a request at most that. A value that fails to decode or
its checks is deleted and counted. Eviction is the server's (``maxmemory-policy allkeys-lru``);
``ttl_s`` bounds how long a page lives. The maintained ``redis`` client is imported only when
this tier is built (``pip install 'kvplug[redis]'``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

from pydantic import Field

from kvplug_hookspecs import FrozenModel, PageData, TierContext, TierStats

from .pages import CorruptPageError, decode_page, encode_page

__all__ = ["RedisTier", "RedisTierOptions"]

log = logging.getLogger(__name__)


class RedisTierOptions(FrozenModel):
    """Options of the ``redis`` tier.

    ``url``: ``redis://host:port/db`` (``rediss://`` for TLS, ``unix://`` for a socket).
    ``key_prefix``: before the namespace id in every key. ``ttl_s``: expire pages after this
    long (``None``: never; the server's maxmemory policy evicts). ``timeout_s``: connect and
    read timeout of every call. ``latency_s`` / ``bandwidth_bytes_per_s``: a round trip and the
    network's rate, for the cost model (defaults: a 25 GbE link in one rack).
    """

    url: str = "redis://127.0.0.1:6379/0"
    key_prefix: str = "kvplug"
    ttl_s: int | None = Field(default=None, gt=0)
    timeout_s: float = Field(default=0.5, gt=0)
    latency_s: float = Field(default=200e-6, ge=0)
    bandwidth_bytes_per_s: float = Field(default=2.5e9, gt=0)


class RedisTier:
    """Pages on a Redis server; see the module docstring."""

    name = "redis"
    medium = "Redis"

    def __init__(self, context: TierContext, options: RedisTierOptions | None = None) -> None:
        import redis  # the optional dependency: only a config that uses this tier needs it

        options = options or RedisTierOptions()
        self.latency_s = options.latency_s
        self.bandwidth_bytes_per_s = options.bandwidth_bytes_per_s
        self.url = options.url
        self._ttl = options.ttl_s
        self._namespace = context.namespace.id
        self._prefix = f"{options.key_prefix}:{self._namespace}:"
        self._tokens_per_page = context.page_size
        self._client: Any = redis.Redis.from_url(
            options.url,
            socket_timeout=options.timeout_s,
            socket_connect_timeout=options.timeout_s,
            retry_on_timeout=False,
            health_check_interval=0,
        )
        self._lock = threading.Lock()
        self._stored = [0, 0]
        self._loaded = [0, 0]
        self._corrupt = 0

    def _name(self, key: bytes) -> str:
        return self._prefix + key.hex()

    def contains(self, keys: Sequence[bytes]) -> int:
        if not keys:
            return 0
        pipe = self._client.pipeline(transaction=False)
        for key in keys:
            pipe.exists(self._name(key))
        count = 0
        for present in pipe.execute():
            if not present:
                break
            count += 1
        return count

    def get(self, keys: Sequence[bytes]) -> list[PageData | None]:
        if not keys:
            return []
        values = self._client.mget([self._name(key) for key in keys])
        out: list[PageData | None] = []
        bad = []
        loaded = [0, 0]
        for key, value in zip(keys, values, strict=True):
            if value is None:
                out.append(None)
                continue
            try:
                page = decode_page(self._namespace, value)
            except CorruptPageError as exc:
                log.warning("redis tier: discarding corrupt page %s: %s", key.hex()[:16], exc)
                bad.append(key)
                out.append(None)
                continue
            out.append(page)
            loaded[0] += 1
            loaded[1] += len(value)
        if bad:
            self.remove(bad)
        with self._lock:
            self._loaded[0] += loaded[0]
            self._loaded[1] += loaded[1]
            self._corrupt += len(bad)
        return out

    def put(self, pages: Sequence[PageData]) -> list[PageData]:
        if not pages:
            return []
        pipe = self._client.pipeline(transaction=False)
        size = 0
        for page in pages:
            data = encode_page(self._namespace, page)
            size += len(data)
            pipe.set(self._name(page.key), data, ex=self._ttl)
        pipe.execute()
        with self._lock:
            self._stored[0] += len(pages)
            self._stored[1] += size
        return []

    def remove(self, keys: Sequence[bytes]) -> int:
        if not keys:
            return 0
        removed: int = self._client.delete(*[self._name(key) for key in keys])
        return removed

    def clear(self) -> None:
        """Delete this namespace's pages (other namespaces on the server are left alone)."""
        batch = []
        for name in self._client.scan_iter(match=self._prefix + "*", count=1000):
            batch.append(name)
            if len(batch) >= 1000:
                self._client.delete(*batch)
                batch.clear()
        if batch:
            self._client.delete(*batch)

    def stats(self) -> TierStats:
        with self._lock:
            return TierStats(
                name=self.name,
                medium=self.medium,
                stored_pages=self._stored[0],
                stored_bytes=self._stored[1],
                loaded_pages=self._loaded[0],
                loaded_bytes=self._loaded[1],
                corrupt_pages=self._corrupt,
            )

    def close(self) -> None:
        self._client.close()

    def __repr__(self) -> str:
        return f"RedisTier(url={self.url!r}, namespace={self._namespace!r})"
