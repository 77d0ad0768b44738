"""Prometheus metrics of one kvplug stack, named and labelled as vLLM's own.

A config's ``metrics = {port, host, namespace, labels}`` turns this on (``kvplug.build``). The
counters are read from the cache's own statistics at scrape time (a custom collector: nothing is
counted twice and the engine's path pays nothing for the metrics), plus what the cache's events
say about each medium. ``<ns>`` is ``namespace`` (``kvplug`` by default; ``vllm`` gives vLLM's
exact names):

* ``<ns>:prefix_cache_queries_total``: prompt tokens looked up (token-weighted, as vLLM's);
* ``<ns>:prefix_cache_hits_total``: of those, the tokens found cached;
* ``<ns>:kv_cache_usage_perc``: the share of the pool held by requests (vLLM counts cached,
  evictable blocks as free, and so does this); ``<ns>:kv_cache_capacity_tokens``,
  ``<ns>:kv_cache_free_tokens``, ``<ns>:kv_cache_cached_tokens`` (evictable) in tokens;
* ``<ns>:prefix_cache_evictions_total`` (one per shortfall eviction) and
  ``<ns>:prefix_cache_evicted_tokens_total``, ``<ns>:prefix_cache_swa_evicted_tokens_total``;
* ``<ns>:shortfall_requested_tokens_total`` / ``<ns>:shortfall_freed_tokens_total``: what the
  engine was short of, and what eviction freed for it;
* ``<ns>:kv_blocks_stored_total{medium}`` / ``<ns>:kv_blocks_removed_total{medium}``: blocks by
  medium (``GPU``, or a storage tier's ``CPU``, ``Disk``...), from the cache's events;
* ``<ns>:kv_offload_store_bytes_total{transfer_type}``: bytes stored off the GPU, by
  ``GPU_to_<medium>`` (vLLM's ``kv_offload`` metric and label).

Every metric also carries the config's constant ``labels`` (vLLM's dashboards select on
``model_name`` and ``engine``). Each stack has its own registry, so two stacks in a process never
clash; with ``port=None`` nothing is served and :attr:`CacheMetrics.registry` can be mounted
into an engine's own endpoint.

``prometheus-client`` is imported here: only a config with ``metrics`` imports this module.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvplug_hookspecs import CacheCleared, CacheEvents, KVCacheConfig, PrefixRemoved, PrefixStored

__all__ = ["CacheMetrics", "bytes_per_token"]

_DTYPE_BYTES = {
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}


def bytes_per_token(config: KVCacheConfig) -> int:
    """K and V bytes of one token over every layer of the pool."""
    pool = config.pool
    return 2 * pool.num_layers * pool.kv_heads * pool.head_dim * _DTYPE_BYTES[pool.dtype]


class _MediumCounts:
    """The cache-event side: blocks stored and removed per medium (a cache event sink)."""

    def __init__(self, page_size: int, token_bytes: int) -> None:
        self._page = page_size
        self._token_bytes = token_bytes
        self._lock = threading.Lock()
        self.stored: Counter[str] = Counter()
        self.removed: Counter[str] = Counter()
        self.offload_bytes: Counter[str] = Counter()

    def prefix_stored(self, event: PrefixStored) -> None:
        medium = getattr(event, "medium", "GPU")
        with self._lock:
            self.stored[medium] += len(event.block_hashes)
            if medium != "GPU":
                self.offload_bytes[f"GPU_to_{medium}"] += event.num_tokens * self._token_bytes

    def prefix_removed(self, event: PrefixRemoved) -> None:
        if event.block_hashes:
            with self._lock:
                self.removed[event.medium] += len(event.block_hashes)

    def cache_cleared(self, event: CacheCleared) -> None:
        pass

    def snapshot(self) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
        with self._lock:
            return dict(self.stored), dict(self.removed), dict(self.offload_bytes)


class CacheMetrics(Collector):
    """The metrics exporter of one stack (a stack observer; see the module docstring)."""

    def __init__(self, config: KVCacheConfig) -> None:
        assert config.metrics is not None
        self.config = config.metrics
        self.capacity = config.pool.capacity_tokens
        self._counts = _MediumCounts(config.pool.page_size, bytes_per_token(config))
        self.sink: CacheEvents | None = self._counts
        self._stack: Any = None
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)
        self._server: Any = None
        self.port: int | None = None
        """The port ``/metrics`` is served on (the picked one for ``port=0``), or ``None``."""
        if self.config.port is not None:
            try:
                self._server, _ = start_http_server(
                    self.config.port, addr=self.config.host, registry=self.registry
                )
            except OSError as exc:
                raise ValueError(
                    f"metrics: cannot serve on {self.config.host}:{self.config.port}: {exc}"
                ) from exc
            self.port = self._server.server_port

    def attach(self, stack: Any) -> None:
        self._stack = stack

    def end_step(self) -> None:
        pass

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    # --- the collector ----------------------------------------------------------------------

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
        stack = self._stack
        if stack is None:
            return
        ns = self.config.namespace
        names = list(self.config.labels)
        values = list(self.config.labels.values())
        cache, allocator = stack.prefix_cache, stack.allocator
        stats = cache.stats

        def counter(name: str, doc: str, value: float) -> Metric:
            family = CounterMetricFamily(f"{ns}:{name}", doc, labels=names)
            family.add_metric(values, value)
            return family

        def gauge(name: str, doc: str, value: float) -> Metric:
            family = GaugeMetricFamily(f"{ns}:{name}", doc, labels=names)
            family.add_metric(values, value)
            return family

        free = allocator.available_size()
        cached = cache.evictable_size()
        yield counter(
            "prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            stats.match_query_tokens,
        )
        yield counter(
            "prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            stats.hit_tokens,
        )
        yield gauge(
            "kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            (self.capacity - free - cached) / self.capacity,
        )
        yield gauge("kv_cache_capacity_tokens", "Usable token slots of the KV pool.", self.capacity)
        yield gauge("kv_cache_free_tokens", "Free token slots of the KV pool.", free)
        yield gauge(
            "kv_cache_cached_tokens", "Cached tokens no running request holds (evictable).", cached
        )
        yield counter("prefix_cache_evictions", "Prefix cache evictions.", stats.evictions)
        yield counter(
            "prefix_cache_evicted_tokens",
            "Tokens freed by prefix cache evictions.",
            stats.evicted_tokens,
        )
        yield counter(
            "prefix_cache_swa_evicted_tokens",
            "Sliding-window tokens freed by evictions (SWA caches).",
            stats.swa_evicted_tokens,
        )
        yield counter(
            "shortfall_requested_tokens",
            "Tokens the engine was short of and asked eviction to free.",
            stats.shortfall_requested_tokens,
        )
        yield counter(
            "shortfall_freed_tokens",
            "Tokens the shortfall evictions freed.",
            stats.shortfall_freed_tokens,
        )
        stored, removed, offload = self._counts.snapshot()
        for name, doc, label, table in (
            ("kv_blocks_stored", "KV blocks stored, by medium.", "medium", stored),
            ("kv_blocks_removed", "KV blocks removed, by medium.", "medium", removed),
            (
                "kv_offload_store_bytes",
                "Total bytes stored from GPU to offload storage.",
                "transfer_type",
                offload,
            ),
        ):
            family = CounterMetricFamily(f"{ns}:{name}", doc, labels=[*names, label])
            for key in sorted(table):
                family.add_metric([*values, key], table[key])
            yield family
