"""The vLLM free-list kernels (``speedups.free_list_*``): compiled against the Python reference.

The blocks here are stand-ins with vLLM's ``KVCacheBlock`` field names (the kernels read them by
name; the engine's own class is driven in ``tests/integration/vllm``): a slotted class, which
the compiled kernels read through its slot offsets, and a plain one, read by attribute name.
The same random sequence of appends, takes and touches runs on both kernels and must leave the
same list, the same per-block state, the same rank calls and the same results.
"""

from __future__ import annotations

import heapq
import random
from dataclasses import field, make_dataclass
from typing import Any

import pytest

from kvplug import speedups

# vLLM's KVCacheBlock fields, in its order
FIELDS: list[Any] = [
    ("block_id", int),
    ("ref_cnt", int, field(default=0)),
    ("block_hash", Any, field(default=None)),
    ("prev_free_block", Any, field(default=None)),
    ("next_free_block", Any, field(default=None)),
    ("is_null", bool, field(default=False)),
]
SlottedBlock = make_dataclass("SlottedBlock", FIELDS, slots=True)
PlainBlock = make_dataclass("PlainBlock", FIELDS)


class LoggedRank:
    """Smallest block id first; every call is logged (the kernels must make the same calls)."""

    def __init__(self) -> None:
        self.heap: list[int] = []
        self.live: set[int] = set()
        self.log: list[tuple[str, int]] = []

    def add(self, block_id: int) -> None:
        self.log.append(("add", block_id))
        if block_id not in self.live:
            self.live.add(block_id)
            heapq.heappush(self.heap, block_id)

    def discard(self, block_id: int) -> None:
        self.log.append(("discard", block_id))
        self.live.discard(block_id)

    def pop(self) -> int:
        while self.heap:
            block_id = heapq.heappop(self.heap)
            if block_id in self.live:
                self.live.discard(block_id)
                self.log.append(("pop", block_id))
                return block_id
        self.log.append(("pop", -1))
        return -1

    def pushpop(self, block_id: int) -> int:
        self.add(block_id)
        return self.pop()


class FreeList:
    """A free list of ``n`` blocks and its per-block state, all free and linked in id order."""

    def __init__(self, cls: type, n: int) -> None:
        self.blocks = [cls(i) for i in range(n)]
        self.head, self.tail = cls(-1), cls(-1)
        self.tracked = bytearray(n)
        self.last = [0] * n
        self.hits = [0] * n
        self.num_children = [0] * n
        self.parent_of = [-1] * n
        self.parent_gen = [0] * n
        self.gen = [0] * n
        self.content: list[Any] = [None] * n
        self.rank = LoggedRank()
        self.clock = 0
        self.head.next_free_block, self.tail.prev_free_block = self.tail, self.head
        self.append(list(self.blocks))

    def append(self, blocks: list[Any]) -> None:
        speedups.free_list_append(
            blocks, self.tail, self.tracked, self.last, self.num_children, self.clock,
            self.rank.add,
        )  # fmt: skip
        self.clock += len(blocks)

    def popleft(self, n: int) -> list[int]:
        taken = speedups.free_list_popleft(
            self.head, n, self.tracked, self.blocks, self.parent_of, self.parent_gen, self.gen,
            self.num_children, self.content, self.rank.pop, self.rank.pushpop, self.rank.add,
        )  # fmt: skip
        return [block.block_id for block in taken]

    def touch(self, ids: list[int]) -> tuple[int, int]:
        return speedups.free_list_touch(
            [self.blocks[i] for i in ids], self.tracked, self.num_children, self.hits,
            self.rank.discard,
        )  # fmt: skip

    def order(self) -> list[int]:
        out, block = [], self.head.next_free_block
        while block is not self.tail:
            assert block.next_free_block.prev_free_block is block
            out.append(block.block_id)
            block = block.next_free_block
        return out

    def state(self) -> tuple[Any, ...]:
        blocks = [(b.ref_cnt, b.block_hash, b.prev_free_block is None) for b in self.blocks]
        return (
            self.order(), blocks, bytes(self.tracked), self.last, self.hits, self.num_children,
            self.gen, self.content, self.rank.log,
        )  # fmt: skip


def scenario(cls: type, kernel: str, seed: int, n: int = 24) -> list[Any]:
    """A random sequence of chained caching, takes, frees (tail or head first) and touches."""
    rng = random.Random(seed)
    was = speedups.native_enabled()
    speedups.use_native(kernel == "native")
    try:
        fl = FreeList(cls, n)
        held: list[list[int]] = []
        results: list[Any] = []
        for step in range(60):
            op = rng.random()
            free = len(fl.order())
            if op < 0.4 and free:  # a request takes blocks and caches them as a chain
                ids = fl.popleft(rng.randint(1, min(free, 6)))
                results.append(ids)
                parent = -1
                for block_id in ids:  # what the queue's on_cached does
                    block = fl.blocks[block_id]
                    block.ref_cnt = 1
                    block.block_hash = fl.content[block_id] = (seed, step, block_id)
                    fl.parent_of[block_id] = parent
                    if parent >= 0:
                        fl.parent_gen[block_id] = fl.gen[parent]
                        fl.num_children[parent] += 1
                    parent = block_id
                held.append(ids)
            elif op < 0.75 and held:  # a request frees its blocks
                ids = held.pop(rng.randrange(len(held)))
                ordered = ids[::-1] if rng.random() < 0.7 else ids
                freed = []
                for block_id in ordered:
                    block = fl.blocks[block_id]
                    block.ref_cnt -= 1
                    if block.ref_cnt == 0:
                        freed.append(block)
                if freed:
                    fl.append(freed)
            elif held or free:  # a request reuses some cached blocks (free or held)
                cached = [i for i in range(n) if fl.content[i] is not None]
                ids = rng.sample(cached, min(len(cached), rng.randint(1, 4)))
                results.append(fl.touch(ids))
                held.append(list(ids))
            if rng.random() < 0.1:  # a lone block is taken and kept to the end
                results.append(fl.popleft(1) if fl.order() else [])
        results.append(fl.state())
        return results
    finally:
        speedups.use_native(was)


@pytest.mark.parametrize("cls", [SlottedBlock, PlainBlock])
@pytest.mark.parametrize("seed", range(40))
def test_free_list_kernels_agree_on_random_sequences(cls, seed):
    if not speedups.NATIVE_AVAILABLE:
        pytest.skip("kvplug._speedups was not built")
    assert scenario(cls, "native", seed) == scenario(cls, "python", seed)


@pytest.mark.parametrize("kernel", ["python", "native"])
def test_free_list_take_follows_the_rank_and_frees_the_parent_of_an_evicted_leaf(kernel):
    if kernel == "native" and not speedups.NATIVE_AVAILABLE:
        pytest.skip("kvplug._speedups was not built")
    was = speedups.native_enabled()
    speedups.use_native(kernel == "native")
    try:
        fl = FreeList(SlottedBlock, 6)
        assert fl.order() == [0, 1, 2, 3, 4, 5]
        assert fl.popleft(3) == [0, 1, 2]  # unhashed: vLLM's order, the rank is not asked
        for block_id, parent in ((0, -1), (1, 0), (2, 1)):  # a chain 0 <- 1 <- 2
            block = fl.blocks[block_id]
            block.block_hash = fl.content[block_id] = ("h", block_id)
            fl.parent_of[block_id] = parent
            if parent >= 0:
                fl.num_children[parent] += 1
        fl.append([fl.blocks[0], fl.blocks[1], fl.blocks[2]])  # head first: only 2 is a leaf
        assert fl.rank.log == [("add", 2)]
        assert bytes(fl.tracked) == bytes([1, 1, 1, 0, 0, 0])
        assert fl.last == [7, 8, 9, 0, 0, 0]  # unhashed blocks keep no recency
        assert fl.order() == [3, 4, 5, 0, 1, 2]
        assert fl.popleft(5) == [3, 4, 5, 2, 1]  # then the leaf, then its parent (a carry)
        assert fl.rank.log == [("add", 2), ("pop", 2), ("add", 1), ("pop", 1), ("add", 0)]
        assert fl.num_children == [0, 0, 0, 0, 0, 0] and fl.content[1:3] == [None, None]
        assert fl.order() == [0]
        assert fl.touch([0]) == (1, -1)
        assert fl.order() == [] and fl.blocks[0].ref_cnt == 1 and fl.hits[0] == 1
        assert fl.rank.log[-1] == ("discard", 0) and not fl.tracked[0]
        fl.blocks[0].ref_cnt = 0  # free, but not in the list: the touch stops there
        assert fl.touch([0]) == (0, 0)
        assert fl.blocks[0].ref_cnt == 0
    finally:
        speedups.use_native(was)


def test_free_list_kernels_refuse_state_of_the_wrong_size():
    if not speedups.NATIVE_AVAILABLE:
        pytest.skip("kvplug._speedups was not built")
    fl = FreeList(SlottedBlock, 4)
    native = speedups._native
    with pytest.raises(ValueError, match="one item per block"):
        native.free_list_append([], fl.tail, fl.tracked, [0] * 3, fl.num_children, 0, fl.rank.add)
    with pytest.raises(TypeError, match="bytearray"):
        native.free_list_touch([], list(fl.tracked), fl.num_children, fl.hits, fl.rank.discard)
    block = SlottedBlock(9)
    with pytest.raises(IndexError, match="block id 9 outside 0..3"):
        native.free_list_touch([block], fl.tracked, fl.num_children, fl.hits, fl.rank.discard)
