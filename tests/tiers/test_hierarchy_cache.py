"""Radix and block_hash over a real hierarchy with a device pool far too small: loaded K/V equals
a recompute, exact per-tier hits, conservation at every step, probes move nothing."""

from __future__ import annotations

import pytest

from kvplug.eviction import evict_from_tree_cache
from kvplug_hookspecs import CacheKey

from .driver import Driver, config, prompts

CACHES = ["radix", "block_hash"]
PAGES = [(1, "standard"), (4, "paged"), (1, "paged")]


def tier_list(kind: str, tmp_path, redis_url=None, host_tokens: int = 1024):
    if kind == "host":
        return [{"name": "host", "options": {"capacity_tokens": host_tokens}}]
    if kind == "disk":
        return [{"name": "disk", "options": {"path": str(tmp_path / "disk")}}]
    return [{"name": "redis", "options": {"url": redis_url}}]


@pytest.fixture(params=["host", "disk", "redis"])
def tier_kind(request):
    if request.param == "redis":
        request.getfixturevalue("redis_server")
    return request.param


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("page,allocator", PAGES)
def test_loaded_kv_equals_recompute(cache, page, allocator, tier_kind, tmp_path, request):
    url = request.getfixturevalue("redis_url") if tier_kind == "redis" else None
    cfg = config(
        tier_list(tier_kind, tmp_path, url),
        cache=cache,
        page_size=page,
        capacity=32,
        allocator=allocator,
    )
    tiered = Driver.build(cfg)
    plain = Driver.build(config([], cache=cache, page_size=page, capacity=32, allocator=allocator))
    ps = prompts(6, 24, seed=page)
    for _ in range(2):
        for p in ps:
            plain.request(p)
            tiered.request(p)
    second = tiered.results[6:]
    # everything is somewhere below: every second-round request finds its whole prompt
    assert [m.prefix_len for m in second] == [24] * 6
    assert [m.prefix_len for m in plain.results[6:]] == [0] * 6  # LRU cycles: a recompute
    name = tier_kind
    loaded = sum(t for m in tiered.results for n, t in m.tier_tokens if n == name)
    assert loaded == tiered.stack.storage.stats.hit_tokens[name] > 0
    assert all(n == name for m in tiered.results for n, _ in m.tier_tokens)
    assert tiered.stack.storage.stats.corrupt_pages == 0
    tiered.close()


@pytest.mark.parametrize("cache", CACHES)
def test_exact_per_tier_hits_through_a_cascade(cache, tmp_path):
    # device 2 pages, host 2 pages, then disk
    cfg = config(
        [
            {"name": "host", "options": {"capacity_tokens": 8}},
            {"name": "disk", "options": {"path": str(tmp_path)}},
        ],
        cache=cache,
        page_size=4,
        capacity=8,
    )
    d = Driver.build(cfg)
    a, b, c = prompts(3, 8, seed=5)
    for p in (a, b, c):
        assert d.request(p).prefix_len == 0
    # device: c; host: b; disk: a (pushed out of the host by b)
    # each load demotes the device's page to the host, which pushes its own to the disk
    assert d.request(a).tier_tokens == (("disk", 8),)  # host: c, disk: a, b
    assert d.request(b).tier_tokens == (("disk", 8),)  # host: a, disk: a, b, c
    assert d.request(c).tier_tokens == (("disk", 8),)  # host: b
    stats = d.stack.storage.stats
    assert dict(stats.hit_tokens) == {"disk": 24}
    assert stats.transfer_bytes["Disk_to_GPU"] == 24 * (2 * 2 * 2 * 4 * 2)  # 64 B a token
    d.close()


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("page", [1, 4])
def test_shortfall_contract_unchanged(cache, page):
    d = Driver.build(
        config(
            [{"name": "host", "options": {"capacity_tokens": 1024}}],
            cache=cache,
            page_size=page,
            capacity=32,
        )
    )
    d.request(prompts(1, 24, seed=1)[0])
    # 8 free, a request of 8 + 2*page + 1 needs ceil((2*page + 1) / page) pages more
    need = 8 + 2 * page + 1
    result = evict_from_tree_cache(d.cache, need)
    want = -(-(need - 8) // page) * page
    assert result.num_tokens == want
    assert d.stack.storage.stats.demoted_pages * page == want
    assert d.stack.storage.tier_stats()[0]["tokens"] == want
    d.conserved()


@pytest.mark.parametrize("cache", CACHES)
def test_probe_moves_nothing(cache):
    d = Driver.build(
        config(
            [{"name": "host", "options": {"capacity_tokens": 1024}}],
            cache=cache,
            page_size=4,
            capacity=16,
        )
    )
    a, b = prompts(2, 16, seed=3)
    d.request(a)
    d.request(b)  # a is now only in the host
    storage = d.stack.storage
    before = (
        storage.tier_stats(),
        dict(storage.stats.hit_tokens),
        d.stack.allocator.available_size(),
        d.cache.evictable_size(),
        d.cache.stats.hit_tokens,
        d.cache.all_values_flatten().tolist(),
    )
    probe = d.cache.match_prefix(CacheKey(tuple(a)), record_hit=False)
    assert probe.prefix_len == 0 and probe.tier_tokens == (("host", 16),)
    after = (
        storage.tier_stats(),
        dict(storage.stats.hit_tokens),
        d.stack.allocator.available_size(),
        d.cache.evictable_size(),
        d.cache.stats.hit_tokens,
        d.cache.all_values_flatten().tolist(),
    )
    assert after == before
    assert storage.stats.located_tokens["host"] == 16
    assert d.request(a).tier_tokens == (("host", 16),)


@pytest.mark.parametrize("cache", CACHES)
def test_cost_model_recomputes_when_loading_is_slower(cache):
    cfg = config(
        [{"name": "host", "options": {"capacity_tokens": 1024, "latency_s": 1.0}}],
        cache=cache,
        page_size=4,
        capacity=16,
        cost={"prefill_tokens_per_s": 1e9},
    )
    d = Driver.build(cfg)
    a, b = prompts(2, 16, seed=4)
    d.request(a)
    d.request(b)
    assert d.request(a).prefix_len == 0
    assert d.stack.storage.stats.skipped_pages == 4 and not d.stack.storage.stats.hit_tokens


@pytest.mark.parametrize("cache", CACHES)
def test_write_through_stores_on_insert(cache):
    d = Driver.build(
        config(
            [{"name": "host", "options": {"capacity_tokens": 1024}}],
            cache=cache,
            page_size=4,
            capacity=32,
            write_policy="write_through",
        )
    )
    d.request(prompts(1, 16, seed=6)[0])
    assert d.stack.storage.tier_stats()[0]["pages"] == 4
    assert d.stack.storage.stats.demoted_pages == 4
    evict_from_tree_cache(d.cache, 32)  # an eviction moves nothing more
    assert d.stack.storage.stats.demoted_pages == 4


def test_two_engines_share_prefixes_through_one_server(redis_url):
    cfg = config([{"name": "redis", "options": {"url": redis_url}}], page_size=4, capacity=16)
    first, second = Driver.build(cfg), Driver.build(cfg)
    a, b = prompts(2, 16, seed=7)
    first.request(a)
    first.request(b)  # a demoted to the server
    m = second.request(a)  # another engine: a from the server, K/V checked in the driver
    assert m.prefix_len == 16 and m.tier_tokens == (("redis", 16),)
    other = Driver.build(
        config(
            [{"name": "redis", "options": {"url": redis_url}}],
            page_size=4,
            capacity=16,
            model_id="another-model",
        )
    )
    assert other.request(a).prefix_len == 0
