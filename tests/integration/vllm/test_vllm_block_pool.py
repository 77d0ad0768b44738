"""kvplug policies inside vLLM's own BlockPool, driven through vLLM's own KVCacheManager.

``lru`` must reproduce vLLM's block ids exactly (run side by side with a stock manager); other
policies must keep vLLM's free-block count, hash map and list exact, reuse unhashed blocks
first, evict the block the policy predicts, and never orphan a chain's successor.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

pytest.importorskip("vllm")

from kvplug import get_registry
from kvplug.integrations.vllm.block_pool import install_policy, installed_policy
from tests.integration.vllm.conftest import admit, check_pool, free_ids, make_manager, make_request

pytestmark = pytest.mark.vllm

BLOCK = 16
POLICIES = ["lru", "lfu", "fifo", "mru", "filo", "priority", "slru", "s3fifo", "arc"]


def new_policy(name: str) -> Any:
    registration = get_registry().get("eviction_policy", name)
    return registration.factory(registration.options_model())


def kvplug_manager(policy: str, num_blocks: int, **kw: Any) -> Any:
    manager = make_manager(num_blocks, **kw)
    chains = {0}  # the full-attention group
    install_policy(manager.block_pool, new_policy(policy), chain_group_ids=chains)
    return manager


def cached_prefix_blocks(manager: Any, prompt: list[int]) -> int:
    """How many leading blocks of ``prompt`` vLLM's hash map finds."""
    found = 0
    for block_hash in make_request("probe", prompt).block_hashes:
        if manager.block_pool.get_cached_block(block_hash, [0]) is None:
            break
        found += 1
    return found


def check_no_orphans(manager: Any, prompts: list[list[int]]) -> None:
    """In vLLM's own hash map, every prompt's cached blocks form a prefix (nothing unreachable)."""
    pool = manager.block_pool
    for prompt in prompts:
        hashes = make_request("probe", prompt).block_hashes
        cached = [pool.get_cached_block(h, [0]) is not None for h in hashes]
        first_miss = cached.index(False) if False in cached else len(cached)
        assert not any(cached[first_miss:]), f"orphaned blocks after a miss: {cached}"


def test_vllm_prefill_scenario_block_ids_with_lru() -> None:
    """vLLM's prefix-caching prefill scenario gives the same block ids, step by step."""
    common = [i for i in range(3) for _ in range(BLOCK)]
    for manager in (make_manager(11), kvplug_manager("lru", 11)):
        req0 = make_request("0", common + [3] * 7)
        req1 = make_request("1", common + [3] * 5)
        assert admit(manager, req0) == (([],), ([1, 2, 3, 4],))
        assert admit(manager, req1) == (([1, 2, 3],), ([5],))
        manager.free(req0)
        manager.free(req1)
        # unhashed tails first (LIFO), never-used blocks, then cached blocks tail first
        assert free_ids(manager) == [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]
        req2 = make_request("2", common + [3] * 6)
        assert admit(manager, req2) == (([1, 2, 3],), ([5],))
        manager.free(req2)
        req3 = make_request("3", [99] * (BLOCK * 10))
        assert admit(manager, req3) == (([],), ([5, 4, 6, 7, 8, 9, 10, 3, 2, 1],))
        assert manager.block_pool.get_num_free_blocks() == 0
        check_pool(manager)


def test_vllm_evict_scenario_block_ids_with_lru() -> None:
    """vLLM's eviction scenario: two requests fill the pool, are freed, and a third request that
    shares the first one's prefix reuses it while evicting in LRU order."""
    results = []
    for manager in (make_manager(11), kvplug_manager("lru", 11)):
        req0 = make_request("0", list(range(5 * BLOCK + 7)))
        req1 = make_request("1", list(range(5 * BLOCK + 7, 8 * BLOCK + 7)))
        trace = [admit(manager, req0), admit(manager, req1)]
        manager.free(req0)
        manager.free(req1)
        trace.append(free_ids(manager))
        req2 = make_request("2", list(range(2 * BLOCK)) + [1000] * (3 * BLOCK))
        trace.append(admit(manager, req2))
        check_pool(manager)
        results.append(trace)
    assert results[0] == results[1]
    # req0's unhashed tail, the never-used block, req0's cached blocks tail first, then req1's
    assert results[0][2] == [6, 10, 5, 4, 3, 2, 1, 9, 8, 7]
    assert results[0][3] == (([1, 2],), ([6, 10, 5],))


def random_ops(manager: Any, rng: random.Random, num_ops: int, prompts: list[list[int]]) -> list:
    """Admit requests from a few prefix families, free them in random order; return the trace."""
    live: list[Any] = []
    trace: list[Any] = []
    families = [[rng.randrange(50, 900) for _ in range(4 * BLOCK)] for _ in range(4)]
    for op in range(num_ops):
        roll = rng.random()
        if live and (roll < 0.4 or len(live) > 5):
            request = live.pop(rng.randrange(len(live)))
            manager.free(request)
            trace.append(("free", request.request_id))
        elif roll < 0.45 and op % 7 == 0:
            victims = set(rng.sample(range(1, len(manager.block_pool.blocks)), 3))
            manager.evict_blocks(victims)
            trace.append(("evict_blocks", sorted(victims)))
        else:
            family = rng.choice(families)
            prefix = family[: rng.randrange(0, len(family) + 1, BLOCK)]
            prompt = prefix + [rng.randrange(1000, 5000) for _ in range(rng.randrange(1, 40))]
            request = make_request(f"r{op}", prompt)
            got = admit(manager, request)
            trace.append(("admit", got))
            if got is not None:
                live.append(request)
                prompts.append(prompt)
        trace.append(free_ids(manager))
        check_pool(manager)
    for request in live:
        manager.free(request)
    trace.append(free_ids(manager))
    if manager.block_pool.reset_prefix_cache():
        check_pool(manager)
        trace.append(free_ids(manager))
    return trace


@pytest.mark.parametrize("seed", range(3))
def test_random_workload_block_ids_with_lru(seed: int) -> None:
    """Random admits, frees, connector evictions and a reset: identical ids and lists."""
    stock = random_ops(make_manager(40), random.Random(seed), 250, [])
    ours = random_ops(kvplug_manager("lru", 40), random.Random(seed), 250, [])
    assert stock == ours


def test_hybrid_sliding_window_block_ids_with_lru() -> None:
    """Full attention plus two sliding-window groups (vLLM's hybrid scenario): identical ids."""
    traces = []
    for manager in (
        make_manager(31, sliding_window_blocks=2),
        kvplug_manager("lru", 31, sliding_window_blocks=2),
    ):
        traces.append(random_ops(manager, random.Random(7), 120, []))
    assert traces[0] == traces[1]


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_keeps_vllm_exact_and_orphans_nothing(policy: str) -> None:
    manager = kvplug_manager(policy, 40)
    prompts: list[list[int]] = []
    random_ops(manager, random.Random(11), 200, prompts)
    check_no_orphans(manager, prompts)
    assert manager.block_pool.get_num_free_blocks() == 39


def test_without_chain_protection_a_policy_orphans() -> None:
    """The orphan check is real: FIFO evicting heads first leaves unreachable successors."""
    manager = make_manager(12)
    install_policy(manager.block_pool, new_policy("fifo"), chain_group_ids=())
    prompt = list(range(4 * BLOCK + 1))
    req = make_request("a", prompt)
    admit(manager, req)
    manager.free(req)
    admit(manager, make_request("b", [7] * (8 * BLOCK + 1)))  # 9 blocks: evicts 2 cached
    with pytest.raises(AssertionError, match="orphaned"):
        check_no_orphans(manager, [prompt])


def test_chain_protection_evicts_tails_first_under_fifo() -> None:
    manager = kvplug_manager("fifo", 12)
    prompt = list(range(4 * BLOCK + 1))
    req = make_request("a", prompt)
    admit(manager, req)
    manager.free(req)
    admit(manager, make_request("b", [7] * (8 * BLOCK + 1)))
    check_no_orphans(manager, [prompt])
    assert cached_prefix_blocks(manager, prompt) == 2


@pytest.mark.parametrize("policy", ["lfu", "slru", "s3fifo", "arc", "mru", "fifo"])
def test_victim_is_the_one_the_policy_predicts(policy: str) -> None:
    manager = kvplug_manager(policy, 30)
    rng = random.Random(3)
    prompts = [[rng.randrange(1000) for _ in range(2 * BLOCK)] for _ in range(6)]
    for round_ in range(3):  # different hit counts and recencies
        for i, prompt in enumerate(prompts[: 2 + 2 * round_]):
            req = make_request(f"{round_}-{i}", prompt + [5000 + i])
            admit(manager, req)
            manager.free(req)
    pool = manager.block_pool
    queue = pool.free_block_queue
    # take every unhashed free block first: vLLM reuses those before any cached one
    unhashed = sum(1 for b in queue.get_all_free_blocks() if b.block_hash is None)
    cached_before = len(pool.cached_block_hash_to_block)
    pool.free_blocks(pool.get_new_blocks(unhashed))
    assert len(pool.cached_block_hash_to_block) == cached_before
    assert len(queue.rank)
    while len(queue.rank):
        head = pool.free_block_queue.fake_free_list_head.next_free_block
        if head.block_hash is None:
            break
        predicted = queue.rank.peek()
        (taken,) = pool.get_new_blocks(1)
        assert taken.block_id == predicted
        check_pool(manager)


def test_unhashed_blocks_are_reused_first() -> None:
    manager = kvplug_manager("mru", 20)
    pool = manager.block_pool
    req = make_request("a", list(range(3 * BLOCK + 5)))
    admit(manager, req)
    manager.free(req)  # 3 cached blocks + 1 unhashed tail
    blocks = pool.get_new_blocks(16)  # the tail + 15 never-used blocks: no cached block
    assert len(pool.cached_block_hash_to_block) == 3
    pool.free_blocks(blocks)
    check_pool(manager)


def test_evict_first_blocks_are_reused_first() -> None:
    manager = kvplug_manager("lfu", 20)
    pool = manager.block_pool
    if "evict_first" not in pool.free_blocks.__code__.co_varnames:
        pytest.skip("free_blocks(evict_first=...) is new in vLLM 0.34")
    req_a = make_request("a", [1] * (2 * BLOCK + 1))
    admit(manager, req_a)
    manager.free(req_a)
    req_b = make_request("b", [2] * (2 * BLOCK + 1))
    admit(manager, req_b)
    b_blocks = list(manager.get_blocks("b").blocks[0])
    b_cached = {blk.block_id for blk in b_blocks if blk.block_hash is not None}
    assert len(b_cached) == 2
    pool.free_blocks(reversed(b_blocks), evict_first=True)
    taken = pool.get_new_blocks(len(b_blocks))
    assert {blk.block_id for blk in taken} == {blk.block_id for blk in b_blocks}
    assert cached_prefix_blocks(manager, [1] * (2 * BLOCK + 1)) == 2
    pool.free_blocks(taken)
    check_pool(manager)


def test_install_refuses_twice_and_non_policies() -> None:
    manager = kvplug_manager("lru", 8)
    with pytest.raises(ValueError, match="already"):
        install_policy(manager.block_pool, new_policy("lru"))
    with pytest.raises(TypeError, match="EvictionPolicy"):
        install_policy(make_manager(8).block_pool, object())  # type: ignore[arg-type]
    assert installed_policy(make_manager(8).block_pool) is None
    assert installed_policy(manager.block_pool) is not None


def test_unpinned_blocks_stay_last_resort() -> None:
    """Blocks released with unpin_blocks keep vLLM's place at the tail, whatever the policy."""
    manager = kvplug_manager("mru", 16)  # mru would pick the most recently freed block
    pool = manager.block_pool
    req_a = make_request("a", list(range(3 * BLOCK + 1)))
    admit(manager, req_a)
    manager.free(req_a)
    req_b = make_request("b", [9] * (2 * BLOCK))
    admit(manager, req_b)
    pinned = manager.pop_blocks_for_free(req_b)
    reused: list[int] = []
    pool.unpin_blocks(pinned, lambda block: reused.append(block.block_id))
    check_pool(manager)
    others = pool.get_num_free_blocks() - len(pinned)
    taken = pool.get_new_blocks(others)
    assert not reused and {b.block_id for b in pinned}.isdisjoint(b.block_id for b in taken)
    pool.get_new_blocks(len(pinned))
    assert sorted(reused) == sorted(b.block_id for b in pinned)


def test_statistics_mean_what_vllm_does() -> None:
    """A hit per admission that reuses the block; recency when freed; fresh stats per content."""
    manager = kvplug_manager("lfu", 20)
    queue = manager.block_pool.free_block_queue
    prompt = list(range(2 * BLOCK + 3))
    for i in range(3):
        req = make_request(f"r{i}", prompt)
        admit(manager, req)
        block_ids = manager.get_block_ids(req.request_id)[0]
        manager.free(req)
    first, second = (queue.stats(b) for b in block_ids[:2])
    assert (first.hit_count, second.hit_count) == (2, 2)
    assert first.depth == 0 and second.depth == BLOCK and first.num_tokens == BLOCK
    assert first.last_access_time > second.last_access_time  # freed tail first
    assert first.creation_time < second.creation_time
    # evict everything: the next content in those slots starts from zero hits
    manager.block_pool.free_blocks(manager.block_pool.get_new_blocks(19))
    req = make_request("new", [5] * (2 * BLOCK + 1))
    admit(manager, req)
    for block_id in manager.get_block_ids("new")[0][:2]:
        assert queue.stats(block_id).hit_count == 0
    manager.free(req)
    check_pool(manager)
