"""kvplug as SGLang's radix-cache backend, driven through SGLang's own loader, parser,
``create_tree_cache``, allocators, ``ReqToTokenPool``, ``Req`` and ``ScheduleBatch``."""

from __future__ import annotations

import json
from typing import Any

import pytest

pytest.importorskip("sglang.srt.mem_cache.registry")

from kvplug.integrations.sglang.backend import KvplugPrefixCache
from kvplug.registry import get_registry

from .conftest import Engine, parse_server_args

pytestmark = pytest.mark.sglang

POLICIES = sorted(r.name for r in get_registry().registrations("eviction_policy"))
SHARED = list(range(1, 41))  # a 40-token system prompt every request starts with


def workload(engine: Engine, n: int = 6, chunk_long: bool = True) -> None:
    for i in range(n):
        tail = [200 + 10 * i + j for j in range(3 + i)]
        engine.add(f"r{i}", SHARED + tail, max_new_tokens=1 + i % 3)
    if chunk_long:
        engine.add("long", [500 + j for j in range(70)], max_new_tokens=2)


def test_sglang_plugin_loader_discovers_the_entry_point() -> None:
    from sglang.srt.arg_groups.choices import RADIX_EVICTION_POLICY_CHOICES
    from sglang.srt.mem_cache.registry import registered_radix_cache_backends
    from sglang.srt.plugins import GENERAL_PLUGINS_GROUP, load_plugins_by_group

    assert "kvplug" in load_plugins_by_group(GENERAL_PLUGINS_GROUP)
    parse_server_args()
    assert "kvplug" in registered_radix_cache_backends()
    assert {f"kvplug_{name}" for name in POLICIES} <= set(RADIX_EVICTION_POLICY_CHOICES)


def test_sglang_parser_accepts_the_flags() -> None:
    config = json.dumps({"protected_hits": 3})
    args = parse_server_args(
        "--radix-cache-backend",
        "kvplug",
        "--radix-eviction-policy",
        "kvplug_slru",
        "--radix-eviction-policy-config",
        config,
    )
    assert args.radix_cache_backend == "kvplug"
    assert args.radix_eviction_policy == "kvplug_slru"
    assert args.radix_eviction_policy_config == {"protected_hits": 3}
    with pytest.raises(SystemExit):  # argparse: not a registered choice
        parse_server_args("--radix-eviction-policy", "kvplug_nonexistent")


@pytest.mark.parametrize("page_size", [1, 16])
def test_create_tree_cache_wraps_sglang_allocator_and_pools(page_size: int) -> None:
    from sglang.srt.mem_cache.allocator import (
        PagedTokenToKVPoolAllocator,
        TokenToKVPoolAllocator,
    )
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    slru = '{"protected_hits": 3}'
    engine = Engine(page_size=page_size, policy="kvplug_slru", policy_config=slru)
    tree = engine.tree
    assert isinstance(tree, KvplugPrefixCache)
    expected = TokenToKVPoolAllocator if page_size == 1 else PagedTokenToKVPoolAllocator
    assert type(tree.token_to_kv_pool_allocator) is expected
    assert tree.allocator_view.sglang is engine.allocator
    assert type(tree.req_to_token_pool) is ReqToTokenPool
    assert tree.policy_selection.name == "slru"
    assert tree.policy._protected_hits == 3


@pytest.mark.parametrize("cache", ["radix", "block_hash"])
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_scheduler_steps_keep_sglang_pool_invariant(
    page_size: int, policy: str, cache: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVPLUG_SGLANG", cache)
    engine = Engine(page_size=page_size, capacity=512, policy=f"kvplug_{policy}", chunk=32)
    workload(engine)
    engine.run()  # prefill, chunked prefill, decode, finish; invariant after every step
    assert len(engine.finished) == 7
    assert engine.tree.cache.name == cache
    assert engine.tree.total_size() > 0
    engine.check_idle()
    # the shared prompt is cached once and found by the next request
    again = engine.add("again", SHARED + [999], max_new_tokens=1)
    again.init_next_round_input(engine.tree)
    assert again.prefix_len == len(SHARED) // page_size * page_size
    engine.waiting.clear()
    engine.flush()
    engine.check_idle()
    assert engine.tree.total_size() == 0


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_memory_pressure_evicts_and_retracts(page_size: int) -> None:
    engine = Engine(page_size=page_size, capacity=192, chunk=64)
    for i in range(8):
        engine.add(f"p{i}", [1000 * (i + 1) + j for j in range(40)], max_new_tokens=6)
    engine.run(max_steps=400)
    assert len(engine.finished) == 8
    assert engine.tree.kvplug_stats()["evicted_tokens"] > 0
    engine.check_idle()


EXACT = '{"prefix_cache": "radix", "cache_options": {"granularity": "exact"}}'


@pytest.mark.parametrize("granularity", ["leaf", "exact"])
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_eviction_frees_the_predicted_victim(
    page_size: int, policy: str, granularity: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """By default the whole victim leaf is freed (SGLang's eviction); with ``exact`` only the
    shortfall (rounded up to a page) is cut off its end."""
    if granularity == "exact":
        monkeypatch.setenv("KVPLUG_SGLANG", EXACT)
    engine = Engine(page_size=page_size, capacity=256, policy=f"kvplug_{policy}")
    assert engine.tree.cache.options.granularity == granularity
    for i in (0, 1, 2, 3, 0, 4, 5, 0, 2):  # repeats give different hit counts and recency
        engine.add(f"f{i}", [100 * (i + 1) + j for j in range(32)], max_new_tokens=1, priority=i)
        engine.run()
    tree, allocator = engine.tree, engine.allocator
    victim = tree.policy.peek()  # the policy's prediction, before SGLang asks
    victim_slots = victim.value.clone()
    before = set(tree.all_values_flatten().tolist())
    available = allocator.available_size()
    shortfall = min(victim.num_tokens, 2 * page_size + 1)
    allocator.evict_to_free_tokens(tree, available + shortfall)  # SGLang's eviction entry point
    freed = allocator.available_size() - available
    if granularity == "exact":
        assert shortfall <= freed <= shortfall + page_size
    else:
        assert freed == len(victim_slots)  # the whole leaf
    after = set(tree.all_values_flatten().tolist())
    evicted = before - after
    assert evicted <= set(victim_slots.tolist())  # only the predicted victim lost slots
    assert len(evicted) == freed
    engine.check_invariant()
    engine.check_idle()


def test_a_request_waiting_ten_rounds_adds_exactly_one_hit() -> None:
    engine = Engine(page_size=4, policy="kvplug_lfu")
    engine.add("first", SHARED + [7, 7, 7, 7], max_new_tokens=1)
    engine.run()
    node = engine.tree.match_prefix(_params(SHARED)).last_device_node
    hits = node.hit_count
    waiting = engine.add("second", SHARED + [8, 8, 8, 8], max_new_tokens=1)
    for _ in range(10):  # ten scheduling rounds of probes (match + touch) while it waits
        waiting.init_next_round_input(engine.tree)
        engine.tree.touch_prefix(_key(SHARED))
    assert node.hit_count == hits
    engine.run()
    node = engine.tree.match_prefix(_params(SHARED)).last_device_node
    assert node.hit_count == hits + 1


@pytest.mark.parametrize("cache", ["radix", "block_hash"])
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_retracted_requests_resume(
    page_size: int, cache: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVPLUG_SGLANG", cache)
    engine = Engine(page_size=page_size, capacity=512, chunk=64)
    for i in range(3):
        engine.add(f"d{i}", SHARED + [300 + i] * 9, max_new_tokens=12)
    while engine.waiting or engine.chunked_req is not None:
        engine.prefill()
        engine.check_invariant()
    assert len(engine.running.reqs) == 3
    for _ in range(4):
        engine.decode()
        engine.check_invariant()
    assert len(engine.retract()) >= 1  # SGLang's retract path: rows freed, requests requeued
    engine.check_invariant()
    engine.run()
    assert len(engine.finished) == 3
    engine.check_idle()


def test_abort_frees_the_row_without_caching() -> None:
    engine = Engine(page_size=4)
    req = engine.add("gone", [9] * 30, max_new_tokens=8)
    engine.prefill()
    engine.decode()
    cached = engine.tree.total_size()
    engine.abort(req)
    engine.check_invariant()
    assert engine.tree.total_size() == cached
    engine.check_idle()


def test_sglang_default_tree_runs_the_same_harness() -> None:
    """The harness is SGLang's: its own default cache passes the same checks."""
    engine = Engine(page_size=4, policy="lru", backend=None, chunk=32)
    workload(engine)
    engine.run()
    assert not isinstance(engine.tree, KvplugPrefixCache)
    assert len(engine.finished) == 7


def _key(tokens: list[int]) -> Any:
    from array import array

    from sglang.srt.mem_cache.radix_cache import RadixKey

    return RadixKey(array("q", tokens))


def _params(tokens: list[int]) -> Any:
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams

    return MatchPrefixParams(key=_key(tokens))
