"""KV events (``--kv-events-config``) from the kvplug backend, through SGLang's own recorder,
``take_events()`` and event classes, compared with what SGLang's own trees publish; and the
radix insert continuing from the request's previous node (``prev=``)."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("sglang.srt.mem_cache.registry")

from kvplug.caches.radix import RadixCache
from tests.hash_rule import chain, ev, ev_signed

from .conftest import Engine
from .test_sglang_backend import workload

pytestmark = pytest.mark.sglang


def _evict(engine: Engine, num_tokens: int) -> None:
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    engine.tree.evict(EvictParams(num_tokens=num_tokens))


@pytest.mark.parametrize("page_size", [1, 4])
def test_events_of_prefill_split_evict_and_flush_are_exact(
    page_size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sglang.srt.disaggregation.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

    # exact eviction: the cut leaf's freed pages alone are removed (the default evicts leaves)
    monkeypatch.setenv("KVPLUG_SGLANG", '{"cache_options": {"granularity": "exact"}}')
    p = page_size
    engine = Engine(page_size=p, capacity=128, kv_events=True)
    tree = engine.tree
    assert tree.take_events() == [AllBlocksCleared()]  # at construction, as SGLang's tree

    a = list(range(1, 3 * p + p // 2 + 1))  # 3 pages (and half a page): 3 pages are cached
    engine.add("a", a, max_new_tokens=1)
    engine.run()
    digests_a = chain(a, p)[:3]
    stored_a = BlockStored(
        block_hashes=ev_signed(digests_a),
        parent_block_hash=None,
        token_ids=a[: 3 * p],
        block_size=p,
        lora_id=None,
        medium="GPU",
    )
    assert tree.take_events() == [stored_a]

    b = a[:p] + list(range(50, 50 + 2 * p))  # shares page 1: splits a's node, no event for it
    engine.add("b", b, max_new_tokens=1)
    engine.run()
    digests_b = chain(b[p:], p, parent=digests_a[0])
    assert tree.take_events() == [
        BlockStored(
            block_hashes=ev_signed(digests_b),
            parent_block_hash=ev_signed(digests_a[:1])[0],
            token_ids=b[p:],
            block_size=p,
            lora_id=None,
            medium="GPU",
        )
    ]
    engine.check_idle()

    _evict(engine, p)  # LRU: a's leaf is older; an exact eviction frees its last page only
    assert tree.take_events() == [BlockRemoved(block_hashes=ev_signed(digests_a[2:]), medium="GPU")]
    _evict(engine, 2 * p)  # the rest of a's leaf, then b's last page
    removed = ev_signed(digests_a[1:2]) + ev_signed(digests_b[1:])
    assert tree.take_events() == [BlockRemoved(block_hashes=removed, medium="GPU")]

    engine.flush()
    assert tree.take_events() == [AllBlocksCleared()]
    assert tree.take_events() == []


def _pages(events: list[Any]) -> tuple[list[Any], list[tuple[int, ...]], int]:
    """Per ``BlockStored``: its token ids and, per page, the whole token prefix from the root
    (rebuilt through ``parent_block_hash``); the removed pages' prefixes (sorted); how many
    ``AllBlocksCleared``. Hash values differ between caches, this structure must not."""
    from sglang.srt.disaggregation.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

    prefix: dict[int, tuple[int, ...]] = {}
    stored: list[Any] = []
    removed: list[tuple[int, ...]] = []
    cleared = 0
    for event in events:
        if isinstance(event, BlockStored):
            size = event.block_size
            path = () if event.parent_block_hash is None else prefix[event.parent_block_hash]
            pages = []
            for i, block in enumerate(event.block_hashes):
                path = path + tuple(event.token_ids[i * size : (i + 1) * size])
                prefix[block] = path
                pages.append(path)
            stored.append((list(event.token_ids), size, pages))
        elif isinstance(event, BlockRemoved):
            removed.extend(prefix.pop(block) for block in event.block_hashes)
        else:
            assert isinstance(event, AllBlocksCleared)
            cleared += 1
    return stored, sorted(removed), cleared


def _sglang_radix_cache_backend() -> str:
    """SGLang's classic ``RadixCache`` as a named backend (its default is ``UnifiedRadixCache``)."""
    from sglang.srt.mem_cache.radix_cache import RadixCache as SGLangRadixCache
    from sglang.srt.mem_cache.registry import (
        register_radix_cache_backend,
        registered_radix_cache_backends,
    )

    name = "test_sglang_radix_cache"
    if name not in registered_radix_cache_backends():
        register_radix_cache_backend(name, lambda ctx: SGLangRadixCache(ctx.params))
    return name


@pytest.mark.parametrize("reference", ["default", "RadixCache"])
@pytest.mark.parametrize("cache", ["radix", "block_hash"])
@pytest.mark.parametrize("page_size", [1, 4])
def test_same_events_as_sglang_own_tree(
    page_size: int, cache: str, reference: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same requests through SGLang's scheduler steps: kvplug and SGLang's own tree (its
    default ``UnifiedRadixCache``, and its ``RadixCache``) publish as many ``BlockStored``
    events, with the same tokens and the same parent chains; evicting everything removes the
    same pages; a flush clears once."""
    monkeypatch.setenv("KVPLUG_SGLANG", cache)
    sglang_backend = None if reference == "default" else _sglang_radix_cache_backend()
    published = []
    for backend, policy in (("kvplug", "kvplug_lru"), (sglang_backend, "lru")):
        engine = Engine(
            page_size=page_size,
            capacity=512,
            chunk=32,
            kv_events=True,
            backend=backend,
            policy=policy,
        )
        expected = "KvplugPrefixCache" if backend == "kvplug" else "UnifiedRadixCache"
        if backend not in ("kvplug", None):
            expected = "RadixCache"
        assert type(engine.tree).__name__ == expected
        workload(engine)
        engine.add("again", list(range(1, 41)) + [7] * 9, max_new_tokens=3)
        events = []
        for _ in range(50):
            if not (engine.waiting or engine.chunked_req or not engine.running.is_empty()):
                break
            engine.prefill()
            events += engine.tree.take_events()  # the scheduler drains after each batch
            engine.decode()
            events += engine.tree.take_events()
        assert len(engine.finished) == 8
        _evict(engine, engine.tree.evictable_size())
        assert engine.tree.evictable_size() == 0
        engine.flush()
        events += engine.tree.take_events()
        published.append(_pages(events))
    kvplug, sglang = published
    assert len(kvplug[0]) == len(sglang[0]) >= 8  # one per request at least (chunks merge)
    assert kvplug == sglang
    assert kvplug[2] == 2  # construction and flush


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_insert_continuing_from_the_previous_node_gives_the_same_results(
    page_size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``checkpoint`` passes the request's previous node to the radix insert (``prev=``):
    every cached slot, statistic, hit count, output and event is the same as without it, and
    the insert really continued from that node."""
    resumed: list[bool] = []
    original = RadixCache._resume_point

    def spy(self: RadixCache, *args: Any) -> Any:
        node = original(self, *args)
        resumed.append(node is not None)
        return node

    monkeypatch.setattr(RadixCache, "_resume_point", spy)
    runs = []
    for use_prev in (True, False):
        resumed.clear()
        engine = Engine(page_size=page_size, capacity=512, chunk=32, kv_events=True)
        engine.tree._resumable = use_prev
        workload(engine)
        engine.run()
        tree = engine.tree
        hits = sorted((n.depth, n.num_tokens, n.hit_count) for n in tree.cache._nodes())
        runs.append(
            (
                tree.all_values_flatten().tolist(),
                tree.kvplug_stats(),
                hits,
                [(r.rid, list(r.output_ids)) for r in engine.finished],
                [repr(e) for e in tree.take_events()],
            )
        )
        if use_prev:
            assert resumed and all(resumed)  # every checkpoint continued from its node
        else:
            assert resumed == []
    assert runs[0] == runs[1]


@pytest.mark.parametrize("kv_events", [False, True])
def test_kvplug_observers_see_the_backend_events(
    kv_events: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """kvplug observer plugins get the backend cache's events, hashes included, and a flush,
    with or without SGLang's KV events."""
    from kvplug.registry import PluginRegistry
    from kvplug_hookspecs import CacheCleared
    from tests.cache_helpers import RecordingEvents

    observed = RecordingEvents()
    monkeypatch.setattr(PluginRegistry, "cache_events", lambda self: observed)
    engine = Engine(page_size=4, capacity=128, kv_events=kv_events)
    tokens = list(range(1, 11))
    engine.add("a", tokens, max_new_tokens=1)
    engine.run()
    [stored] = observed.stored
    assert stored.block_hashes == ev(chain(tokens, 4))
    assert stored.token_ids == tuple(tokens[:8])
    engine.flush()
    assert observed.cleared == [CacheCleared(cache="radix", num_tokens=8)]
    assert len(engine.tree.take_events()) == (3 if kv_events else 0)
