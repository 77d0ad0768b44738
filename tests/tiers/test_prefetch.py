"""Prefetch: a queued request's pages that only the disk holds are copied (verified) into the
host tier, so its match loads them from host memory; nothing on the device changes."""

from __future__ import annotations

import pytest

from kvplug.engine.request import Request
from kvplug.engine.scheduler import Scheduler
from kvplug_hookspecs import CacheKey

from .driver import Driver, config, prompts

CACHES = ["radix", "block_hash"]
TOKEN_BYTES = 2 * 2 * 2 * 4 * 2  # K and V, 2 layers, 2 heads, head dim 4, fp16


def cascade(cache: str, tmp_path, device: int = 8, host: int = 16, **storage):
    """A device of ``device`` tokens, a host tier of ``host`` tokens, then disk (page 4), after
    prompts of 8 tokens, one more than the device and host hold: the first is on the disk only.
    With the defaults, after prompts a, b, c, e the device holds e, the host b and c, the disk a."""
    cfg = config(
        [
            {"name": "host", "options": {"capacity_tokens": host}},
            {"name": "disk", "options": {"path": str(tmp_path)}},
        ],
        cache=cache,
        page_size=4,
        capacity=device,
        **storage,
    )
    d = Driver.build(cfg)
    served = prompts((device + host) // 8 + 1, 8, seed=5)
    for p in served:
        assert d.request(p).prefix_len == 0
    d.flush()
    return d, served


def device_state(d: Driver):
    return (
        d.stack.allocator.available_size(),
        d.cache.evictable_size(),
        d.cache.all_values_flatten().tolist(),
        d.cache.stats.hit_tokens,
        d.cache.stats.match_queries,
    )


@pytest.mark.parametrize("background", [False, True])
@pytest.mark.parametrize("cache", CACHES)
def test_prefetch_moves_disk_pages_to_the_host(cache, background, tmp_path):
    d, (a, b, c, _) = cascade(cache, tmp_path, background=background)
    storage = d.stack.storage
    before = device_state(d)
    assert d.cache.prefetch(CacheKey(tuple(a))) == 2
    d.flush()
    assert device_state(d) == before  # the device and its statistics are untouched
    assert storage.stats.prefetched_pages == 2
    assert storage.stats.transfer_bytes["Disk_to_CPU"] == 8 * TOKEN_BYTES
    host, _disk = storage.tier_stats()
    assert host["tokens"] == 16  # c and a (b went down to the disk to make room)
    # the match loads a from the host (making room demotes e, which pushes c down); its K/V is
    # checked against a recompute by the driver
    assert d.request(a).tier_tokens == (("host", 8),)
    d.flush()  # e's demotion (it pushes c down) is stored before c is asked for
    assert dict(storage.stats.hit_tokens) == {"host": 8}
    assert storage.stats.corrupt_pages == 0
    # b was pushed down by the prefetch, c by e's demotion: both come from the disk
    assert d.request(b).tier_tokens == (("disk", 8),)
    assert d.request(c).tier_tokens == (("disk", 8),)
    d.close()


@pytest.mark.parametrize("cache", CACHES)
def test_prefetch_of_what_the_device_or_host_holds_moves_nothing(cache, tmp_path):
    d, (_, _, c, e) = cascade(cache, tmp_path)
    storage = d.stack.storage
    assert d.cache.prefetch(CacheKey(tuple(e))) == 0  # on the device
    assert d.cache.prefetch(CacheKey(tuple(c))) == 0  # already in the fastest tier
    assert d.cache.prefetch(CacheKey((7, 7, 7, 7, 7))) == 0  # nowhere
    assert storage.stats.prefetched_pages == 0
    # making room demotes e, which pushes b (the host's least recent) down; c stays
    assert d.request(c).tier_tokens == (("host", 8),)
    d.close()


@pytest.mark.parametrize("cache", CACHES)
def test_prefetch_without_tiers_is_a_no_op(cache):
    d = Driver.build(config([], cache=cache, page_size=4, capacity=8))
    assert d.cache.prefetch(CacheKey(tuple(prompts(1, 8)[0]))) == 0
    with pytest.raises(TypeError):
        d.cache.prefetch(CacheKey(("x",)))  # type: ignore[arg-type]
    d.close()


def test_a_corrupt_disk_page_stops_the_prefetch_and_is_removed(tmp_path):
    d, (a, *_) = cascade("radix", tmp_path)
    files = sorted(p for p in tmp_path.rglob("*") if p.is_file() and p.stat().st_size > 64)
    assert files
    for f in files:  # flip a bit in every page on the disk
        data = bytearray(f.read_bytes())
        data[-8] ^= 1
        f.write_bytes(bytes(data))
    storage = d.stack.storage
    assert d.cache.prefetch(CacheKey(tuple(a))) == 2
    assert storage.stats.prefetched_pages == 0
    assert storage.stats.corrupt_pages == 1
    assert d.request(a).prefix_len == 0  # recomputed, never loaded
    d.close()


@pytest.mark.parametrize("prefetch", [True, False])
@pytest.mark.parametrize("cache", CACHES)
def test_the_scheduler_prefetches_a_queued_request(cache, prefetch, tmp_path):
    # device 16 (the request needs 10 slots), host 24: device f g, host b c e, disk a
    d, (a, *_) = cascade(cache, tmp_path, device=16, host=24, prefetch=prefetch)
    scheduler = Scheduler(d.stack)
    scheduler.add_request(Request(0, list(a) + [1], max_new_tokens=1))
    assert d.stack.storage.stats.prefetched_pages == (2 if prefetch else 0)
    done = scheduler.run()
    assert [r.prefix_len for r in done] == [8]
    assert dict(d.stack.storage.stats.hit_tokens) == {"host" if prefetch else "disk": 8}
    d.close()
