"""The ``redis`` tier against a real ``redis-server`` (the ``redis_server`` fixture)."""

from __future__ import annotations

import time

import pytest

from kvplug.tiers.pages import encode_page
from kvplug.tiers.redis_tier import RedisTier, RedisTierOptions
from kvplug_hookspecs import StorageTier

from .helpers import chain, namespace, same_page, tier_context

NS = namespace(4)


def redis_tier(url: str, ns=NS, **options) -> RedisTier:
    return RedisTier(tier_context(4, ns=ns), RedisTierOptions(url=url, **options))


def keys(pages):
    return [p.key for p in pages]


def calls(server, command: str) -> int:
    stats = server.client().info("commandstats")
    return int(stats.get(f"cmdstat_{command}", {}).get("calls", 0))


def test_round_trip_pipelined(redis_server):
    tier = redis_tier(redis_server.url)
    assert isinstance(tier, StorageTier)
    pages = chain(8, 4, ns=NS)
    assert tier.put(pages) == []
    assert calls(redis_server, "set") == 8
    assert tier.contains(keys(pages)) == 8
    assert calls(redis_server, "exists") == 8
    got = tier.get(keys(pages))
    assert calls(redis_server, "mget") == 1  # one round trip for the batch
    assert all(same_page(g, p) for g, p in zip(got, pages, strict=True))
    size = sum(len(encode_page(NS.id, p)) for p in pages)
    s = tier.stats()
    assert (s.stored_pages, s.stored_bytes, s.loaded_pages, s.loaded_bytes) == (8, size, 8, size)
    assert s.medium == "Redis"
    assert tier.get([]) == [] and tier.contains([]) == 0 and tier.put([]) == []
    tier.close()


def test_contains_stops_at_the_first_missing_page(redis_server):
    tier = redis_tier(redis_server.url)
    pages = chain(4, 4, ns=NS)
    tier.put([pages[0], pages[1], pages[3]])
    assert tier.contains(keys(pages)) == 2
    assert tier.get(keys(pages))[2] is None


def test_keys_carry_the_prefix_and_namespace(redis_server):
    tier = redis_tier(redis_server.url, key_prefix="kv-test")
    pages = chain(2, 4, ns=NS)
    tier.put(pages)
    names = sorted(k.decode() for k in redis_server.client().keys("*"))
    assert names == sorted(f"kv-test:{NS.id}:{p.key.hex()}" for p in pages)
    assert redis_server.client().get(names[0]) in {encode_page(NS.id, p) for p in pages}


def test_ttl_expires_pages(redis_server):
    tier = redis_tier(redis_server.url, ttl_s=1)
    pages = chain(2, 4, ns=NS)
    tier.put(pages)
    client = redis_server.client()
    ttls = [client.pttl(f"kvplug:{NS.id}:{p.key.hex()}") for p in pages]
    assert all(0 < t <= 1000 for t in ttls)
    assert tier.contains(keys(pages)) == 2
    deadline = time.monotonic() + 5
    while tier.contains(keys(pages)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert tier.contains(keys(pages)) == 0
    no_ttl = redis_tier(redis_server.url)
    no_ttl.put(pages)
    assert client.pttl(f"kvplug:{NS.id}:{pages[0].key.hex()}") == -1


def test_two_engines_share_pages_through_one_server(redis_server):
    a, b = redis_tier(redis_server.url), redis_tier(redis_server.url)
    pages = chain(3, 4, ns=NS)
    a.put(pages)
    assert b.contains(keys(pages)) == 3
    assert all(same_page(g, p) for g, p in zip(b.get(keys(pages)), pages, strict=True))
    # another model (or geometry) on the same server sees nothing, even under the same keys
    other = redis_tier(redis_server.url, ns=namespace(4, model_id="other"))
    assert other.contains(keys(pages)) == 0
    assert other.get(keys(pages)) == [None, None, None]


def test_clear_leaves_other_namespaces_and_keys_alone(redis_server):
    ours = redis_tier(redis_server.url)
    theirs = redis_tier(redis_server.url, ns=namespace(4, model_id="other"))
    client = redis_server.client()
    client.set("unrelated", b"x")
    many = chain(2500, 4, ns=NS, kv=False)  # more than one SCAN batch
    ours.put(many)
    mine = chain(2, 4, seed=3, ns=namespace(4, model_id="other"))
    theirs.put(mine)
    ours.clear()
    assert ours.contains(keys(many[:1])) == 0
    assert client.dbsize() == 1 + 2
    assert theirs.contains(keys(mine)) == 2 and client.get("unrelated") == b"x"


def test_corrupt_values_are_deleted_and_counted(redis_server):
    tier = redis_tier(redis_server.url)
    pages = chain(3, 4, ns=NS)
    tier.put(pages)
    client = redis_server.client()
    name = f"kvplug:{NS.id}:{pages[2].key.hex()}"
    client.set(name, client.get(name)[:-3])  # truncated
    got = tier.get(keys(pages))
    assert got[2] is None and client.exists(name) == 0
    assert tier.stats().corrupt_pages == 1 and tier.stats().loaded_pages == 2


def test_remove(redis_server):
    tier = redis_tier(redis_server.url)
    pages = chain(3, 4, ns=NS)
    tier.put(pages)
    assert tier.remove([pages[1].key, b"\0" * 32]) == 1
    assert tier.contains(keys(pages)) == 1 and tier.remove([]) == 0


def test_a_dead_server_raises_within_the_timeout(redis_server):
    tier = redis_tier(redis_server.url, timeout_s=0.2)
    redis_server.kill()
    start = time.monotonic()
    with pytest.raises(Exception) as info:
        tier.contains(keys(chain(1, 4, ns=NS)))
    assert time.monotonic() - start < 1.0
    assert "connect" in str(info.value).lower() or "refused" in str(info.value).lower()
