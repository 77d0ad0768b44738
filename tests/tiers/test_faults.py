"""Faults on the real server and directory: requests complete, nothing wrong is loaded, the
device's books stay balanced (the driver checks conservation and K/V at every step)."""

from __future__ import annotations

import threading
import time

from .driver import Driver, config, prompts
from .faults import read_only


def redis_cfg(url: str, **options):
    return config(
        [{"name": "redis", "options": {"url": url, "timeout_s": 0.2, **options}}],
        page_size=4,
        capacity=16,
    )


def test_server_killed_mid_run_and_restarted(redis_server):
    d = Driver.build(redis_cfg(redis_server.url))
    a, b, c = prompts(3, 16, seed=11)
    d.request(a)
    d.request(b)  # a on the server
    redis_server.kill()
    # the server is gone: a recomputes, b's demotion fails and is counted, nothing raises
    assert d.request(a).prefix_len == 0
    storage = d.stack.storage
    assert storage.stats.failures["redis"] >= 1 and not storage.tier_up("redis")
    assert d.request(b).prefix_len == 0
    redis_server.start()  # same port, empty (no persistence)
    time.sleep(0.6)  # past the first backoff
    d.request(c)  # demotes b to the server again: the tier is used again
    assert storage.tier_up("redis")
    m = d.request(b)
    assert m.prefix_len == 16 and m.tier_tokens == (("redis", 16),)


def test_corrupt_values_are_discarded_and_recomputed(redis_server):
    d = Driver.build(redis_cfg(redis_server.url))
    a, b = prompts(2, 16, seed=12)
    d.request(a)
    d.request(b)
    client = redis_server.client()
    names = sorted(client.keys("kvplug:*"))
    assert len(names) == 4
    victims = {}
    for name in names:  # flip one bit in the KV of every page of a
        value = bytearray(client.get(name))
        value[-10] ^= 0x01
        victims[name] = bytes(value)
        client.set(name, bytes(value))
    m = d.request(a)
    assert m.prefix_len == 0  # the first page failed its checksum: a recomputes
    assert d.stack.storage.stats.corrupt_pages == 1
    assert (
        client.exists(names[0])
        + client.exists(names[1])
        + client.exists(names[2])
        + client.exists(names[3])
        <= 3
    )


def test_truncated_and_wrong_namespace_values(redis_server):
    d = Driver.build(redis_cfg(redis_server.url))
    a, b = prompts(2, 16, seed=13)
    d.request(a)
    d.request(b)
    client = redis_server.client()
    other = Driver.build(
        config(
            [{"name": "redis", "options": {"url": redis_server.url}}],
            page_size=4,
            capacity=16,
            model_id="other-model",
        )
    )
    ours = sorted(client.keys("kvplug:*"))
    for name in ours:
        client.set(name, client.get(name)[:-1])  # truncated
    assert d.request(a).prefix_len == 0
    other_ns = other.stack.storage.namespace_id
    assert other_ns != d.stack.storage.namespace_id


def test_read_only_disk_requests_complete(tmp_path):
    path = tmp_path / "disk"
    d = Driver.build(
        config([{"name": "disk", "options": {"path": str(path)}}], page_size=4, capacity=16)
    )
    plain = Driver.build(config([], page_size=4, capacity=16))
    a, b, c = prompts(3, 16, seed=14)
    d.request(a)
    ns_dir = next(path.iterdir())
    with read_only(ns_dir):
        for p in (b, c, a):
            d.request(p)
            plain.request(p)
    assert [m.prefix_len for m in d.results[1:]] == [m.prefix_len for m in plain.results]
    assert d.stack.storage.stats.failures["disk"] >= 1


def test_slow_server_costs_at_most_the_timeout(redis_server):
    d = Driver.build(redis_cfg(redis_server.url))
    a, b = prompts(2, 16, seed=15)
    d.request(a)
    d.request(b)
    sleeper = threading.Thread(
        target=lambda: redis_server.client().execute_command("DEBUG", "SLEEP", "2")
    )
    sleeper.start()
    time.sleep(0.1)
    start = time.monotonic()
    m = d.request(a)
    took = time.monotonic() - start
    sleeper.join()
    assert m.prefix_len == 0 and took < 0.2 * 3 + 0.3
    assert d.stack.storage.stats.failures["redis"] >= 1
