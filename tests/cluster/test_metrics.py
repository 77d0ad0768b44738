"""The Prometheus exporter: the real HTTP endpoint, scraped, against the cache's own numbers."""

from __future__ import annotations

import random
import urllib.request

import pytest

pytest.importorskip("prometheus_client")

from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError

import kvplug
from kvplug.engine.request import Request
from kvplug.engine.scheduler import Scheduler
from kvplug_hookspecs import MetricsConfig


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def config(**metrics):
    return {
        "pool": {"capacity_tokens": 512, "page_size": 4, "device": "cpu", "store_kv": False},
        "allocator": "paged",
        "metrics": {"port": 0, **metrics},
    }


def workload(seed: int) -> list[Request]:
    """Conversations that share system prompts, enough to overflow the pool."""
    rng = random.Random(seed)
    systems = [[rng.randrange(1000) for _ in range(48)] for _ in range(4)]
    return [
        Request(
            i,
            rng.choice(systems) + [rng.randrange(1000) for _ in range(rng.randrange(8, 80))],
            max_new_tokens=rng.randrange(1, 12),
        )
        for i in range(120)
    ]


def test_scraped_numbers_are_the_caches_own():
    stack = kvplug.build(config(labels={"model_name": "tiny", "engine": "0"}))
    metrics = stack.observers[0]
    try:
        scheduler = Scheduler(stack)
        scheduler.run(workload(1))
        stats = stack.prefix_cache.stats
        assert stats.evictions > 5 and stats.hit_tokens > 1000  # a run with real pressure
        got = scrape(metrics.port)
        labels = (("engine", "0"), ("model_name", "tiny"))
        free = stack.allocator.available_size()
        cached = stack.prefix_cache.evictable_size()
        expected = {
            "kvplug:prefix_cache_queries_total": stats.match_query_tokens,
            "kvplug:prefix_cache_hits_total": stats.hit_tokens,
            "kvplug:prefix_cache_evictions_total": stats.evictions,
            "kvplug:prefix_cache_evicted_tokens_total": stats.evicted_tokens,
            "kvplug:shortfall_requested_tokens_total": stats.shortfall_requested_tokens,
            "kvplug:shortfall_freed_tokens_total": stats.shortfall_freed_tokens,
            "kvplug:kv_cache_capacity_tokens": 512,
            "kvplug:kv_cache_free_tokens": free,
            "kvplug:kv_cache_cached_tokens": cached,
            "kvplug:kv_cache_usage_perc": (512 - free - cached) / 512,
        }
        for name, value in expected.items():
            assert got[(name, labels)] == pytest.approx(value), name
        # blocks by medium, from the cache's events: stored minus removed = cached pages
        stored = got[("kvplug:kv_blocks_stored_total", tuple(sorted((*labels, ("medium", "GPU")))))]
        removed = got[
            ("kvplug:kv_blocks_removed_total", tuple(sorted((*labels, ("medium", "GPU")))))
        ]
        assert stored - removed == stack.prefix_cache.total_size() // 4
        assert removed * 4 == stats.evicted_tokens
    finally:
        stack.close()


def test_vllm_namespace_gives_vllms_names():
    """namespace="vllm" gives vLLM's metric names (for dashboards built on them)."""
    stack = kvplug.build(config(namespace="vllm"))
    try:
        stack.prefix_cache.match_prefix([1, 2, 3, 4])
        got = scrape(stack.observers[0].port)
        assert got[("vllm:prefix_cache_queries_total", ())] == 4
        assert got[("vllm:prefix_cache_hits_total", ())] == 0
        assert got[("vllm:kv_cache_usage_perc", ())] == 0
        assert not any(name.startswith("kvplug:") for name, _ in got)
        assert not any("tier" in name or "offload" in name for name, _ in got)  # no tiers
    finally:
        stack.close()


def test_two_stacks_serve_their_own_numbers():
    a, b = kvplug.build(config()), kvplug.build(config())
    try:
        a.prefix_cache.match_prefix(list(range(8)))
        assert scrape(a.observers[0].port)[("kvplug:prefix_cache_queries_total", ())] == 8
        assert scrape(b.observers[0].port)[("kvplug:prefix_cache_queries_total", ())] == 0
    finally:
        a.close()
        b.close()


def test_close_stops_the_server():
    stack = kvplug.build(config())
    port = stack.observers[0].port
    stack.close()
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)


def test_no_port_serves_nothing_but_keeps_a_registry():
    from prometheus_client import generate_latest

    stack = kvplug.build(config(port=None))
    metrics = stack.observers[0]
    assert metrics.port is None
    assert b"kvplug:prefix_cache_hits_total 0.0" in generate_latest(metrics.registry)


@pytest.mark.parametrize(
    "bad, field",
    [
        ({"namespace": "kv-plug"}, "namespace"),
        ({"port": 70000}, "port"),
        ({"labels": {"__name": "x"}}, "labels"),
    ],
)
def test_bad_metrics_config_names_the_field(bad, field):
    with pytest.raises(ValidationError, match=field):
        MetricsConfig(**bad)
