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
* with storage tiers (``kvplug.tiers``), from the hierarchy's own counters:
  ``<ns>:kv_offload_store_bytes_total{transfer_type}`` / ``<ns>:kv_offload_load_bytes_total
  {transfer_type}`` (vLLM's ``kv_offload`` metrics and label: ``GPU_to_CPU``, ``CPU_to_GPU``,
  ``CPU_to_Disk``...); ``<ns>:tier_prefix_cache_hits_total{tier,medium}``: tokens a match
  loaded from each tier, and their sum ``<ns>:external_prefix_cache_hits_total`` (vLLM counts
  its offloading connector's hits there); ``<ns>:tier_tokens{tier,medium}`` /
  ``<ns>:tier_bytes{tier,medium}``: what each tier holds; ``<ns>:tier_demoted_pages_total`` and
  ``<ns>:tier_dropped_pages_total`` (demotions dropped, never waited for).

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

__all__ = ["CacheMetrics"]


class _MediumCounts:
    """The cache-event side: blocks stored and removed per medium (a cache event sink)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.stored: Counter[str] = Counter()
        self.removed: Counter[str] = Counter()

    def prefix_stored(self, event: PrefixStored) -> None:
        with self._lock:
            self.stored[event.medium] += len(event.block_hashes)

    def prefix_removed(self, event: PrefixRemoved) -> None:
        if event.block_hashes:
            with self._lock:
                self.removed[event.medium] += len(event.block_hashes)

    def cache_cleared(self, event: CacheCleared) -> None:
        pass

    def snapshot(self) -> tuple[dict[str, int], dict[str, int]]:
        with self._lock:
            return dict(self.stored), dict(self.removed)


class CacheMetrics(Collector):
    """The metrics exporter of one stack (a stack observer; see the module docstring)."""

    def __init__(self, config: KVCacheConfig) -> None:
        assert config.metrics is not None
        self.config = config.metrics
        self.capacity = config.pool.capacity_tokens
        self._counts = _MediumCounts()
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

        def labelled(
            name: str,
            doc: str,
            keys: list[str],
            table: dict[tuple[str, ...], float],
            gauge: bool = False,
        ) -> Metric:
            kind = GaugeMetricFamily if gauge else CounterMetricFamily
            family = kind(f"{ns}:{name}", doc, labels=[*names, *keys])
            for key in sorted(table):
                family.add_metric([*values, *key], table[key])
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
        stored, removed = self._counts.snapshot()
        for name, doc, table in (
            ("kv_blocks_stored", "KV blocks stored, by medium.", stored),
            ("kv_blocks_removed", "KV blocks removed, by medium.", removed),
        ):
            yield labelled(name, doc, ["medium"], {(k,): v for k, v in table.items()})
        storage = getattr(stack, "storage", None)
        if storage is not None:
            yield from self._tier_metrics(storage, labelled, counter)

    def _tier_metrics(self, storage: Any, labelled: Any, counter: Any) -> Iterator[Metric]:
        stats = storage.stats
        store = {(k,): v for k, v in stats.transfer_bytes.items() if not k.endswith("_to_GPU")}
        load = {(k,): v for k, v in stats.transfer_bytes.items() if k.endswith("_to_GPU")}
        yield labelled(
            "kv_offload_store_bytes",
            "Total bytes stored from GPU to offload storage.",
            ["transfer_type"],
            store,
        )
        yield labelled(
            "kv_offload_load_bytes",
            "Total bytes loaded from offload storage to GPU.",
            ["transfer_type"],
            load,
        )
        medium = {tier.name: tier.medium for tier in storage.tiers}
        hits = {(name, medium[name]): stats.hit_tokens.get(name, 0) for name in medium}
        yield labelled(
            "tier_prefix_cache_hits",
            "Prefix cache hits loaded from a storage tier, in tokens.",
            ["tier", "medium"],
            hits,
        )
        yield counter(
            "external_prefix_cache_hits",
            "Prefix cache hits loaded from the storage tiers, in tokens.",
            sum(hits.values()),
        )
        held = [s for s in storage.tier_stats() if "medium" in s]
        for name, doc, field in (
            ("tier_tokens", "Tokens a storage tier holds.", "tokens"),
            ("tier_bytes", "Bytes a storage tier holds.", "bytes"),
        ):
            yield labelled(
                name,
                doc,
                ["tier", "medium"],
                {(s["name"], s["medium"]): s[field] for s in held},
                gauge=True,
            )
        yield counter("tier_demoted_pages", "Pages demoted below the device.", stats.demoted_pages)
        yield counter(
            "tier_dropped_pages",
            "Demotions dropped (queue full or no tier up).",
            stats.dropped_pages,
        )
