"""The backend's scheduler-side reads: ``match_prefix`` walks SGLang's token array in place,
``prefix_device_indices`` and ``free_kv_row`` give what SGLang's base methods give."""

from __future__ import annotations

import types
from array import array
from typing import Any

import pytest

pytest.importorskip("sglang.srt.mem_cache.registry")

import torch

from kvplug.integrations.sglang.events import NAMESPACE_SEPARATOR
from kvplug_hookspecs import CacheKey

from .conftest import Engine

pytestmark = pytest.mark.sglang

SYSTEM = list(range(1000, 1048))  # 48 tokens every prompt starts with


def cached(page_size: int, backend: str | None = "kvplug") -> Engine:
    """Three finished requests over one system prompt (nothing evicted)."""
    policy = "kvplug_lru" if backend else "lru"
    engine = Engine(page_size=page_size, capacity=512, backend=backend, policy=policy)
    for i in range(3):
        engine.add(f"r{i}", SYSTEM + [100 + 10 * i + j for j in range(20)], max_new_tokens=1)
    engine.run()
    return engine


def match(tree: Any, tokens: Any, **key: Any) -> Any:
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    return tree.match_prefix(MatchPrefixParams(key=RadixKey(tokens, **key)))


@pytest.mark.parametrize("page_size", [1, 16])
def test_match_prefix_walks_the_token_array_without_a_tuple(
    page_size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An ``array('q')`` key (what SGLang passes) is probed in place: no token tuple is made,
    and the length and node are the tuple probe's, SGLang's own tree's length too, with the
    key's ``limit``, ``extra_key`` and ``cache_salt`` honoured."""
    engine, default = cached(page_size), cached(page_size, backend=None)
    tree = engine.tree
    made: list[int] = []
    original = type(tree._tuples).get
    monkeypatch.setattr(
        type(tree._tuples), "get", lambda self, ids, n: made.append(n) or original(self, ids, n)
    )
    prompt = SYSTEM + [110 + j for j in range(20)] + [7, 7]  # request r1 and two more tokens
    cases: list[tuple[dict[str, Any], int]] = [
        ({}, 68 if page_size == 1 else 64),
        ({"limit": 50}, 50 if page_size == 1 else 48),
        ({"limit": 0}, 0),
        ({"extra_key": "lora-a"}, 0),
        ({"cache_salt": "s"}, 0),
    ]
    for key, expected in cases:
        found = match(tree, array("q", prompt), **key)
        assert found.device_prefix_len == expected
        assert match(default.tree, array("q", prompt), **key).device_prefix_len == expected
        node = found.last_device_node
        assert found.last_host_node is node and found.best_match_node is node
        assert node is tree.root_node or node.depth + node.num_tokens == expected
        limit = key.get("limit")
        namespace = key.get("extra_key")
        if key.get("cache_salt"):
            namespace = f"{namespace}{NAMESPACE_SEPARATOR}{key['cache_salt']}"
        tokens = tuple(prompt[:limit] if limit is not None else prompt)
        tokens = tokens[: len(tokens) - len(tokens) % page_size]
        probe = tree.cache.match_prefix(CacheKey(tokens, namespace), record_hit=False, gather=False)
        assert (probe.prefix_len, probe.last_node) == (expected, node)
    assert made == []
    assert match(tree, prompt).device_prefix_len == cases[0][1]  # a list: the tuple path
    assert made == [70 if page_size == 1 else 64]  # the whole list, page-aligned


@pytest.mark.parametrize("page_size", [1, 16])
def test_prefix_device_indices_copy_the_matched_slots(page_size: int) -> None:
    engine = cached(page_size)
    tree = engine.tree
    found = match(tree, array("q", SYSTEM + [120 + j for j in range(20)]))
    node, length = found.last_device_node, found.device_prefix_len
    assert length == (68 if page_size == 1 else 64)
    path = tree.path_device_indices(node)
    for prefix_len in (length, 32, 0):
        req = types.SimpleNamespace(rid="q", last_node=node, prefix_len=prefix_len)
        got = tree.prefix_device_indices(req)
        assert torch.equal(got, path[:prefix_len])
        assert got.dtype == torch.int64
        if prefix_len:
            assert got.data_ptr() != node.path_value.data_ptr()  # a copy, not the tree's
    with pytest.raises(RuntimeError, match="matched 69 tokens, its node holds"):
        tree.prefix_device_indices(types.SimpleNamespace(rid="q", last_node=node, prefix_len=69))


@pytest.mark.parametrize("page_size", [1, 16])
def test_free_kv_row_frees_what_sglangs_base_method_frees(page_size: int) -> None:
    """Adjacent ranges are merged (a page is freed once), as SGLang's ``free_kv_row`` does."""
    from sglang.srt.mem_cache.base_prefix_cache import BasePrefixCache

    states = []
    for free_kv_row in ("backend", "sglang"):
        engine = Engine(page_size=page_size, capacity=512)
        req = engine.add("r", list(range(1, 100)), max_new_tokens=4)
        engine.prefill()
        before = engine.allocator.available_size()
        ranges = [(0, page_size * 2), (page_size * 2, page_size * 3), (page_size * 4, 99)]
        if free_kv_row == "backend":
            engine.tree.free_kv_row(req.kv, ranges)
        else:
            BasePrefixCache.free_kv_row(engine.tree, req.kv, ranges)
        freed = engine.allocator.available_size() - before
        states.append((freed, sorted(engine.allocator.get_all_free_pages().tolist())))
    assert states[0] == states[1]
    expected = 3 * page_size + (99 - 4 * page_size) if page_size == 1 else 3 * 16 + 3 * 16
    assert states[0][0] == expected
