"""``lru`` is vLLM's own order in every free order: exact block ids and removal events.

vLLM's ``free_blocks`` takes blocks in any order; ``KVCacheManager.free`` passes them tail
first, ``pop_blocks_for_free`` lets a caller choose (vLLM's own ``test_block_removed_event_group_
idx`` frees a chain head first). Each test drives vLLM's ``BlockPool`` or ``KVCacheManager`` side
by side: stock, kvplug ``lru`` (vLLM's pool and list kept as they are) and, to show that this is
what the policy itself chooses, an LRU policy run through kvplug's policy queue without chain
protection.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

pytest.importorskip("vllm")

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue

from kvplug.integrations.vllm.block_pool import PolicyFreeBlockQueue, install_policy
from kvplug.policies.builtin import LRUPolicy
from tests.integration.vllm.conftest import admit, check_pool, free_ids, make_manager, make_request

pytestmark = pytest.mark.vllm

BLOCK = 4


class PolicyQueueLRU(LRUPolicy):
    """kvplug's LRU key run through :class:`PolicyFreeBlockQueue` (a subclass is not taken
    for vLLM's own order, so the policy really ranks the blocks)."""


def new_pool(kind: str, num_blocks: int) -> Any:
    from vllm.v1.core.block_pool import BlockPool

    pool = BlockPool(
        num_gpu_blocks=num_blocks,
        enable_caching=True,
        hash_block_size=BLOCK,
        enable_kv_cache_events=True,
    )
    if kind == "lru":
        queue = install_policy(pool, LRUPolicy())
        assert type(queue) is FreeKVCacheBlockQueue and queue is pool.free_block_queue
    elif kind == "policy-lru":
        queue = install_policy(pool, PolicyQueueLRU(), chain_protection=False)
        assert isinstance(queue, PolicyFreeBlockQueue)
    elif kind == "protected-lru":
        queue = install_policy(pool, LRUPolicy(), chain_protection=True)
        assert isinstance(queue, PolicyFreeBlockQueue)
    else:
        assert kind == "stock"
    return pool


def removed_hashes(pool: Any) -> list[Any]:
    from vllm.distributed.kv_events import BlockRemoved

    return [e.block_hashes for e in pool.take_events() if isinstance(e, BlockRemoved)]


def evict_scenario(kind: str, head_first: bool) -> tuple[list[int], list[Any]]:
    """vLLM's ``test_block_removed_event_group_idx``: 4 blocks, the first 2 cached, all freed
    (in allocation order, or reversed), all taken again."""
    pool = new_pool(kind, 5)
    blocks = pool.get_new_blocks(4)
    request = make_request("r", list(range(2 * BLOCK)), block_size=BLOCK)
    pool.cache_full_blocks(request, blocks, 0, 2, BLOCK, 0)
    pool.take_events()
    pool.free_blocks(blocks if head_first else reversed(blocks))
    taken = [b.block_id for b in pool.get_new_blocks(4)]
    return taken, removed_hashes(pool)


def test_head_first_free_gives_vllms_ids_and_events() -> None:
    stock = evict_scenario("stock", head_first=True)
    assert stock[0] == [3, 4, 1, 2]
    assert evict_scenario("lru", head_first=True) == stock
    assert evict_scenario("policy-lru", head_first=True) == stock
    # what chain protection would do instead: the leaf (block 2) before its parent
    protected = evict_scenario("protected-lru", head_first=True)
    assert protected[0] == [3, 4, 2, 1]
    assert protected[1] == stock[1][::-1]


def test_tail_first_free_gives_vllms_ids_and_events() -> None:
    stock = evict_scenario("stock", head_first=False)
    assert stock[0] == [4, 3, 2, 1]  # unhashed blocks prepended as given, then cached ones
    for kind in ("lru", "policy-lru", "protected-lru"):
        assert evict_scenario(kind, head_first=False) == stock


def manager_trace(kind: str, head_first: bool) -> list[Any]:
    """Two requests sharing a 2-block prefix through vLLM's KVCacheManager, freed head first
    (``pop_blocks_for_free`` then ``free_blocks`` in allocation order) or tail first (``free``),
    then a request that needs every block."""
    manager = make_manager(12, block_size=BLOCK, enable_kv_cache_events=True)
    if kind == "lru":
        install_policy(manager.block_pool, LRUPolicy())
    elif kind == "protected-lru":
        install_policy(manager.block_pool, LRUPolicy(), chain_protection=True)
    shared = list(range(2 * BLOCK))
    first = make_request("a", shared + list(range(100, 100 + 3 * BLOCK + 1)), BLOCK)
    second = make_request("b", shared + list(range(200, 200 + 2 * BLOCK + 2)), BLOCK)
    trace: list[Any] = [admit(manager, first), admit(manager, second)]
    for request in (first, second):
        if head_first:
            manager.block_pool.free_blocks(manager.pop_blocks_for_free(request))
        else:
            manager.free(request)
        trace.append(free_ids(manager))
    manager.block_pool.take_events()
    trace.append(admit(manager, make_request("c", [7] * (11 * BLOCK), BLOCK)))
    trace.append(removed_hashes(manager.block_pool))
    check_pool(manager)
    return trace


@pytest.mark.parametrize("head_first", [True, False], ids=["head-first", "tail-first"])
def test_manager_free_orders_give_vllms_ids_and_events(head_first: bool) -> None:
    stock = manager_trace("stock", head_first)
    assert manager_trace("lru", head_first) == stock
    # a: blocks 1-6 (2 shared, 3 of its own cached, a partial 6); b: hits 1-2, takes 7-9 (9
    # partial); unhashed blocks are prepended, cached ones appended in the order freed
    assert stock[:2] == [(([],), ([1, 2, 3, 4, 5, 6],)), (([1, 2],), ([7, 8, 9],))]
    if head_first:
        assert stock[2] == [6, 10, 11, 3, 4, 5]
        assert stock[4] == (([],), ([9, 6, 10, 11, 3, 4, 5, 1, 2, 7, 8],))
        # chain protection would take every chain's leaf first instead
        protected = manager_trace("protected-lru", head_first)
        assert protected[4] == (([],), ([9, 6, 10, 11, 5, 4, 3, 8, 7, 2, 1],))
    else:
        assert stock[2] == [6, 10, 11, 5, 4, 3]
        assert stock[4] == (([],), ([9, 6, 10, 11, 5, 4, 3, 8, 7, 2, 1],))
        assert manager_trace("protected-lru", head_first) == stock
    assert len(stock[5]) == 7  # one removal event per cached block


ORDERS = ("head-first", "tail-first", "shuffled")


class SideBySidePools(RuleBasedStateMachine):
    """Stock, kvplug ``lru`` and the LRU policy through kvplug's queue: same calls, same ids,
    same free list and the same removal events after every step, whatever the free order."""

    NUM_BLOCKS = 24

    def __init__(self) -> None:
        super().__init__()
        self.pools = [new_pool(k, self.NUM_BLOCKS) for k in ("stock", "lru", "policy-lru")]
        self.held: list[list[int]] = []  # block ids of live requests, in allocation order
        self.families = [[f * 1000 + t for t in range(6 * BLOCK)] for f in range(3)]
        self.count = 0

    def each(self, call: Any) -> Any:
        """``call(pool)`` on every pool; the results must be equal (returns the stock one)."""
        results = [call(pool) for pool in self.pools]
        assert results[1:] == results[:1] * 2, results
        return results[0]

    @rule(
        family=st.integers(0, 2),
        shared=st.integers(0, 6),
        own=st.integers(0, 4),
        partial=st.integers(0, BLOCK - 1),
    )
    def admit(self, family: int, shared: int, own: int, partial: int) -> None:
        self.count += 1
        tokens = self.families[family][: shared * BLOCK]
        tokens += [100_000 + self.count * 100 + t for t in range(own * BLOCK + partial)]
        if not tokens:
            return
        request = make_request(f"r{self.count}", tokens, BLOCK)
        num_full = len(request.block_hashes)
        num_blocks = num_full + (1 if partial else 0)

        def hits(pool: Any) -> list[int]:
            found = []
            for block_hash in request.block_hashes:
                cached = pool.get_cached_block(block_hash, [0])
                if cached is None:
                    break
                found.append(cached[0].block_id)
            return found

        hit_ids = self.each(hits)
        stock = self.pools[0]
        free_hits = sum(1 for b in hit_ids if stock.blocks[b].ref_cnt == 0)  # touch takes them
        if num_blocks - len(hit_ids) + free_hits > stock.get_num_free_blocks():
            return

        def allocate(pool: Any) -> list[int]:
            hit_blocks = [pool.blocks[b] for b in hit_ids]
            pool.touch(hit_blocks)
            chain = hit_blocks + pool.get_new_blocks(num_blocks - len(hit_ids))
            pool.cache_full_blocks(request, chain, len(hit_ids), num_full, BLOCK, 0)
            return [b.block_id for b in chain]

        self.held.append(self.each(allocate))

    @precondition(lambda self: self.held)
    @rule(index=st.integers(0, 100), order=st.sampled_from(ORDERS), seed=st.integers(0, 99))
    def free(self, index: int, order: str, seed: int) -> None:
        ids = self.held.pop(index % len(self.held))
        if order == "tail-first":
            ids = ids[::-1]
        elif order == "shuffled":
            random.Random(seed).shuffle(ids)
        self.each(lambda pool: pool.free_blocks([pool.blocks[b] for b in ids]))

    @rule(ids=st.sets(st.integers(1, NUM_BLOCKS - 1), max_size=4))
    def evict_blocks(self, ids: set[int]) -> None:
        self.each(lambda pool: pool.evict_blocks(ids))

    @rule()
    def reset_prefix_cache(self) -> None:
        self.each(lambda pool: pool.reset_prefix_cache())

    @invariant()
    def same_free_list_and_events(self) -> None:
        self.each(lambda pool: [b.block_id for b in pool.free_block_queue.get_all_free_blocks()])
        self.each(lambda pool: pool.get_num_free_blocks())
        self.each(removed_hashes)


TestSideBySidePools = SideBySidePools.TestCase
TestSideBySidePools.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
