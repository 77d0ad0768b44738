"""SGLang's own radix-cache unit scenarios, on SGLang's ``RadixCache`` and on the kvplug backend.

SGLang tests its tree without memory pools: ``token_to_kv_pool_allocator=None`` (its
``create_simulated``), a ``unittest.mock`` allocator, and ``disable=True``. Each scenario here
builds both caches through SGLang's ``create_tree_cache`` with the same ``CacheInitParams`` and
drives them through SGLang's own ``RadixKey``, ``InsertParams``, ``MatchPrefixParams`` and
``EvictParams``, with the same exact expectations for both (written for this project; the
scenarios follow what SGLang's ``test_radix_cache_unit.py`` covers).
"""

from __future__ import annotations

from array import array
from typing import Any
from unittest import mock

import pytest

pytest.importorskip("sglang.srt.mem_cache.registry")

import torch

from kvplug.integrations.sglang.backend import KvplugPrefixCache, NoAllocator

from .conftest import Engine, parse_server_args
from .test_sglang_kv_events import _pages, _sglang_radix_cache_backend

pytestmark = pytest.mark.sglang

BACKENDS = ["sglang", "kvplug"]


def simulated(
    backend: str,
    *,
    page_size: int = 1,
    disable: bool = False,
    allocator: Any = None,
    kv_events: bool = False,
) -> Any:
    """A tree cache without memory pools, as SGLang's tests build one, via create_tree_cache."""
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.registry import TreeCacheBuildContext, create_tree_cache

    name = _sglang_radix_cache_backend() if backend == "sglang" else "kvplug"
    policy = "lru" if backend == "sglang" else "kvplug_lru"
    server_args = parse_server_args(
        "--radix-cache-backend",
        name,
        "--page-size",
        str(page_size),
        "--radix-eviction-policy",
        policy,
    )
    params = CacheInitParams(
        disable=disable,
        req_to_token_pool=None,
        token_to_kv_pool_allocator=allocator,
        page_size=page_size,
        eviction_policy=server_args.radix_eviction_policy,
        enable_kv_cache_events=kv_events,
    )
    ctx = TreeCacheBuildContext(
        server_args=server_args,
        params=params,
        is_hybrid_swa=False,
        is_hybrid_ssm=False,
        enable_hierarchical_cache=False,
        disable_radix_cache=disable,
        tp_worker=None,
        model_config=None,
        tp_size=1,
        tp_rank=0,
        tp_group=None,
    )
    cache = create_tree_cache(ctx)
    expected = "KvplugPrefixCache" if backend == "kvplug" else "RadixCache"
    assert type(cache).__name__ == expected
    return cache


def key(tokens: list[int], extra_key: str | None = None) -> Any:
    from sglang.srt.mem_cache.radix_cache import RadixKey

    return RadixKey(array("q", tokens), extra_key)


def insert(cache: Any, tokens: list[int], values: list[int] | None, extra: Any = None) -> int:
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams

    value = None if values is None else torch.tensor(values, dtype=torch.int64)
    result = cache.insert(InsertParams(key=key(tokens, extra), value=value))
    prefix_len: int = result.prefix_len
    return prefix_len


def match(cache: Any, tokens: list[int], extra: Any = None) -> tuple[int, list[int]]:
    """The matched length and the slots on the path to the matched node (SGLang 0.5.22/23 give
    the slots through ``path_device_indices``)."""
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams

    result = cache.match_prefix(MatchPrefixParams(key=key(tokens, extra)))
    slots = cache.path_device_indices(result.last_device_node)
    return result.device_prefix_len, slots[: result.device_prefix_len].tolist()


def evict(cache: Any, num_tokens: int) -> int:
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    evicted: int = cache.evict(EvictParams(num_tokens=num_tokens)).num_tokens_evicted
    return evicted


def sizes(cache: Any) -> tuple[int, int, int]:
    return cache.total_size(), cache.evictable_size(), cache.protected_size()


def cpu_mock(**kw: Any) -> mock.Mock:
    allocator = mock.Mock(**kw)
    allocator.device = torch.device("cpu")
    return allocator


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("page_size", "disable", "kv_events"), [(1, False, False), (4, False, True), (1, True, False)]
)
def test_constructions(backend: str, page_size: int, disable: bool, kv_events: bool) -> None:
    cache = simulated(backend, page_size=page_size, disable=disable, kv_events=kv_events)
    assert cache.page_size == page_size
    assert cache.disable is disable
    assert cache.device == torch.device("cpu")
    assert cache.root_node is not None
    assert sizes(cache) == (0, 0, 0)
    assert cache.supports_prefix_sharing() is not disable
    if backend == "kvplug":
        assert isinstance(cache.allocator_view, NoAllocator)


@pytest.mark.parametrize("backend", BACKENDS)
def test_reset_empties_the_tree(backend: str) -> None:
    cache = simulated(backend)
    insert(cache, [5, 6, 7], [50, 60, 70])
    assert sizes(cache) == (3, 3, 0)
    cache.reset()
    assert sizes(cache) == (0, 0, 0)
    assert match(cache, [5, 6, 7]) == (0, [])


@pytest.mark.parametrize("backend", BACKENDS)
def test_insert_then_match_whole_and_partial(backend: str) -> None:
    cache = simulated(backend)
    assert insert(cache, [1, 2, 3], [10, 20, 30]) == 0
    assert sizes(cache) == (3, 3, 0)
    assert match(cache, [1, 2, 3]) == (3, [10, 20, 30])
    assert match(cache, [1, 2]) == (2, [10, 20])
    assert match(cache, [1, 2, 3, 4, 5]) == (3, [10, 20, 30])
    assert match(cache, [2, 3]) == (0, [])
    assert insert(cache, [1, 2, 3, 4], [10, 20, 30, 40]) == 3  # 3 were cached already
    assert sizes(cache) == (4, 4, 0)
    assert sorted(cache.all_values_flatten().tolist()) == [10, 20, 30, 40]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_disabled_cache_caches_nothing(backend: str) -> None:
    cache = simulated(backend, disable=True)
    assert insert(cache, [1, 2, 3], [10, 20, 30]) == 0
    assert sizes(cache) == (0, 0, 0)
    assert match(cache, [1, 2, 3]) == (0, [])
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams

    node = cache.match_prefix(MatchPrefixParams(key=key([1, 2, 3]))).last_device_node
    assert node is cache.root_node
    assert cache.inc_lock_ref(node).delta == 0
    assert cache.dec_lock_ref(node).delta == 0
    assert evict(cache, 3) == 0
    cache.touch_prefix(key([1, 2, 3]))
    assert cache.take_events() == []


@pytest.mark.parametrize("backend", BACKENDS)
def test_insert_without_values_caches_the_token_ids(backend: str) -> None:
    cache = simulated(backend)
    assert insert(cache, [7, 8, 9], None) == 0
    assert sizes(cache) == (3, 3, 0)
    assert match(cache, [7, 8, 9]) == (3, [7, 8, 9])


@pytest.mark.parametrize("backend", BACKENDS)
def test_total_size_grows_with_disjoint_inserts(backend: str) -> None:
    cache = simulated(backend)
    insert(cache, [1, 2, 3], [10, 20, 30])
    assert cache.total_size() == 3
    insert(cache, [4, 5], [40, 50])
    assert cache.total_size() == 5
    assert sorted(cache.all_values_flatten().tolist()) == [10, 20, 30, 40, 50]


@pytest.mark.parametrize("backend", BACKENDS)
def test_extra_keys_never_share(backend: str) -> None:
    cache = simulated(backend)
    insert(cache, [1, 2, 3], [10, 20, 30], "lora-a")
    insert(cache, [1, 2, 3], [40, 50, 60], "lora-b")
    insert(cache, [1, 2, 3], [70, 80, 90], None)
    assert match(cache, [1, 2, 3], "lora-a") == (3, [10, 20, 30])
    assert match(cache, [1, 2, 3], "lora-b") == (3, [40, 50, 60])
    assert match(cache, [1, 2, 3], None) == (3, [70, 80, 90])
    assert match(cache, [1, 2, 3], "other") == (0, [])
    assert sizes(cache) == (9, 9, 0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_locks_move_tokens_between_evictable_and_protected(backend: str) -> None:
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams

    cache = simulated(backend)
    insert(cache, [1, 2, 3], [10, 20, 30])
    insert(cache, [1, 2, 4, 5], [10, 20, 40, 50])  # splits [1, 2, 3] after 2 tokens
    assert sizes(cache) == (5, 5, 0)
    node = cache.match_prefix(MatchPrefixParams(key=key([1, 2, 4, 5]))).last_device_node
    assert cache.inc_lock_ref(node).delta == -4  # its own 2 tokens and the shared 2
    assert sizes(cache) == (5, 1, 4)
    assert cache.dec_lock_ref(node).delta == 4
    assert sizes(cache) == (5, 5, 0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_eviction_frees_the_oldest_leaf_through_the_allocator(backend: str) -> None:
    allocator = cpu_mock()
    cache = simulated(backend, allocator=allocator)
    insert(cache, [1, 2], [10, 20])
    insert(cache, [3, 4], [30, 40])
    assert match(cache, [3, 4]) == (2, [30, 40])  # [3, 4] is the more recent
    assert evict(cache, 2) == 2
    assert sizes(cache) == (2, 2, 0)
    assert match(cache, [1, 2]) == (0, [])
    assert match(cache, [3, 4]) == (2, [30, 40])
    # the call SGLang's tree makes for cached pages, with the victim's slots
    (call,) = allocator.free_segment.call_args_list
    assert call.args[0].tolist() == [10, 20] and call.kwargs == {"start_pos": 0}
    assert evict(cache, 1) == 2  # whole leaves, as SGLang's tree evicts
    assert sizes(cache) == (0, 0, 0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_eviction_takes_a_parent_once_its_children_are_gone(backend: str) -> None:
    allocator = cpu_mock()
    cache = simulated(backend, allocator=allocator)
    insert(cache, [1, 2, 3], [10, 20, 30])
    insert(cache, [1, 2, 4], [10, 20, 40])  # [1, 2] -> {[3], [4]}
    assert evict(cache, 4) == 4  # [3], [4], then their parent [1, 2]: all of it
    assert sizes(cache) == (0, 0, 0)
    freed = [s for c in allocator.free_segment.call_args_list for s in c.args[0].tolist()]
    assert sorted(freed) == [10, 20, 30, 40]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("page_size", "length", "cached"), [(1, 5, 5), (2, 5, 4), (4, 6, 4)])
def test_pages_align_inserts_and_matches(
    backend: str, page_size: int, length: int, cached: int
) -> None:
    cache = simulated(backend, page_size=page_size)
    tokens = list(range(1, length + 1))
    insert(cache, tokens, [t * 10 for t in tokens])
    assert cache.total_size() == cached
    assert match(cache, tokens) == (cached, [t * 10 for t in tokens[:cached]])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("page_size", [1, 2])
def test_matches_split_nodes_inside_and_keep_the_data(backend: str, page_size: int) -> None:
    cache = simulated(backend, page_size=page_size)
    long = [1, 2, 3, 4, 5, 6, 7, 8]
    branch = [1, 2, 9, 10]
    insert(cache, long, [t * 10 for t in long])
    insert(cache, branch, [t * 10 for t in branch])
    assert cache.total_size() == 10
    assert match(cache, [1, 2, 3, 4, 99, 98]) == (4, [10, 20, 30, 40])  # splits inside a node
    assert cache.total_size() == 10
    assert match(cache, long) == (8, [t * 10 for t in long])
    assert match(cache, [1, 2, 3, 4, 5, 6, 77, 88]) == (6, [10, 20, 30, 40, 50, 60])
    assert cache.total_size() == 10
    assert match(cache, branch) == (4, [10, 20, 90, 100])


@pytest.mark.parametrize("backend", BACKENDS)
def test_pretty_print_shows_the_cached_tokens(
    backend: str, capsys: pytest.CaptureFixture[str]
) -> None:
    cache = simulated(backend)
    insert(cache, [1, 2, 3], [10, 20, 30])
    cache.pretty_print()
    assert "#tokens: 3" in capsys.readouterr().out


@pytest.mark.parametrize("backend", BACKENDS)
def test_available_and_evictable_text_reads_the_allocator(backend: str) -> None:
    cache = simulated(backend, allocator=cpu_mock(**{"available_size.return_value": 10}))
    insert(cache, [1, 2, 3], [10, 20, 30])
    assert cache.available_and_evictable_str() == (
        "Available tokens: 13 (available_size=10 + evictable_size=3)\n"
    )


def _events(backend: str, page_size: int, steps: Any) -> tuple[Any, ...]:
    allocator = cpu_mock()
    cache = simulated(backend, page_size=page_size, allocator=allocator, kv_events=True)
    steps(cache)
    events = cache.take_events()
    return events, _pages(events)


def _prefixes(tokens: list[int], page_size: int, start: int = 0) -> list[tuple[int, ...]]:
    """Per cached page of ``tokens`` from ``start``: the whole token prefix it ends."""
    return [tuple(tokens[:end]) for end in range(start + page_size, len(tokens) + 1, page_size)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("page_size", [1, 2, 4])
def test_kv_events_of_inserts_and_an_eviction(backend: str, page_size: int) -> None:
    """Stored pages (chained through ``parent_block_hash``), the removed pages of the evicted
    leaf and one ``AllBlocksCleared`` at construction: the same on both caches."""
    from sglang.srt.disaggregation.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

    cache = simulated(backend, page_size=page_size, allocator=cpu_mock(), kv_events=True)
    first, second = [1, 2, 3, 4, 5], [1, 2, 3, 4, 1, 2, 3, 4]
    insert(cache, first, None)
    insert(cache, second, None)  # shares [1, 2, 3, 4]: a new leaf of 4 tokens
    evict(cache, page_size)  # LRU: the oldest leaf, whole
    events = cache.take_events()
    stored, removed, cleared = _pages(events)
    assert cleared == 1 and isinstance(events[0], AllBlocksCleared)
    assert [type(e) for e in events].count(BlockRemoved) == 1
    hashes = [h for e in events if isinstance(e, BlockStored) for h in e.block_hashes]
    assert len(set(hashes)) == len(hashes)  # position-aware: repeated content hashes apart
    if page_size == 1:  # the leaf [5] is older than the leaf [1, 2, 3, 4] of the second key
        assert stored == [
            (first, 1, _prefixes(first, 1)),
            (second[4:], 1, _prefixes(second, 1, 4)),
        ]
        assert removed == [tuple(first)]
    else:  # [1, 2, 3, 4] ([5] is not a whole page) and its leaf, reported together when taken
        assert stored == [(second, page_size, _prefixes(second, page_size))]
        assert removed == _prefixes(second, page_size, 4)  # the leaf is the only leaf


@pytest.mark.parametrize("backend", BACKENDS)
def test_kv_event_hashes_chain_pages(backend: str) -> None:
    from sglang.srt.disaggregation.kv_events import BlockStored

    cache = simulated(backend, page_size=4, kv_events=True)
    cache.take_events()
    insert(cache, [1, 2, 3, 4, 1, 2, 3, 4], None)
    (both,) = [e for e in cache.take_events() if isinstance(e, BlockStored)]
    assert both.parent_block_hash is None and both.token_ids == [1, 2, 3, 4, 1, 2, 3, 4]
    first, second = both.block_hashes  # the same tokens on two pages: two hashes
    assert first != second
    insert(cache, [1, 2, 3, 4, 1, 2, 3, 4, 5, 6, 7, 8], None)
    (third,) = [e for e in cache.take_events() if isinstance(e, BlockStored)]
    assert third.parent_block_hash == second and len(third.block_hashes) == 1
    insert(cache, [1, 2, 3, 4], None, "key1")
    (one,) = [e for e in cache.take_events() if isinstance(e, BlockStored)]
    assert match(cache, [1, 2, 3, 4], "key2") == (0, [])
    insert(cache, [1, 2, 3, 4], None, "key2")
    (two,) = [e for e in cache.take_events() if isinstance(e, BlockStored)]
    # kvplug's page hashes start from the namespace, so two extra_keys never publish the same
    # hash (later SGLang releases do the same); SGLang 0.5.22/0.5.23 leave it out of theirs
    if backend == "kvplug":
        assert one.block_hashes != two.block_hashes
    else:
        assert one.block_hashes == two.block_hashes
    assert one.token_ids == two.token_ids == [1, 2, 3, 4]


# -- kvplug only: what SGLang's tree does not define -------------------------------------------


def test_an_allocator_less_kvplug_cache_evicts_without_freeing() -> None:
    """SGLang's simulated tree has no allocator to free through (its evict fails on ``None``);
    the kvplug backend drops the victims and frees nothing."""
    cache = simulated("kvplug")
    insert(cache, [1, 2], [10, 20])
    insert(cache, [3, 4], [30, 40])
    assert evict(cache, 2) == 2
    assert sizes(cache) == (2, 2, 0)
    assert match(cache, [1, 2]) == (0, [])


def test_a_disabled_kvplug_backend_ignores_the_policy_flags_as_sglang() -> None:
    """SGLang's disabled tree neither builds nor validates its eviction policy."""
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.registry import TreeCacheBuildContext, create_tree_cache

    args = parse_server_args("--radix-cache-backend", "kvplug", "--disable-radix-cache")
    params = CacheInitParams(
        disable=True,
        req_to_token_pool=None,
        token_to_kv_pool_allocator=None,
        page_size=1,
        eviction_policy="lfu",  # an SGLang policy name: refused when the cache is enabled
    )
    ctx = TreeCacheBuildContext(args, params, False, False, False, True, None, None, 1, 0, None)
    cache = create_tree_cache(ctx)
    assert isinstance(cache, KvplugPrefixCache) and cache.disable


@pytest.mark.parametrize("page_size", [1, 4])
def test_disable_radix_cache_serves_requests_with_nothing_cached(page_size: int) -> None:
    """``--disable-radix-cache``: SGLang's scheduler steps over the disabled kvplug backend and
    over SGLang's default (disabled) tree give the same tokens, reuse nothing, cache nothing and
    leave the whole pool free."""
    outputs = []
    for backend, kind in ((None, "UnifiedRadixCache"), ("kvplug", "KvplugPrefixCache")):
        engine = Engine(page_size=page_size, capacity=256, backend=backend, disable=True)
        assert type(engine.tree).__name__ == kind and engine.tree.disable
        shared = list(range(1, 33))
        for i in range(4):
            engine.add(f"r{i}", shared + [100 + i, 200 + i], max_new_tokens=3)
        engine.run()
        assert sorted(r.rid for r in engine.finished) == ["r0", "r1", "r2", "r3"]
        assert all(len(r.output_ids) == 3 for r in engine.finished)
        assert engine.tree.evictable_size() == engine.tree.protected_size() == 0
        assert engine.allocator.available_size() == 256
        outputs.append({r.rid: (list(r.output_ids), r.prefix_len) for r in engine.finished})
    assert outputs[0] == outputs[1]
