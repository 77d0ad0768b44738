"""A hypothesis state machine over a cache with a host + disk hierarchy: random requests (prompts
that share prefixes), prefetches and flushes against a device far too small.

The disk is unbounded and demotion is inline, so no page ever served can be lost: every request
must match exactly the longest page-aligned prefix it shares with any prompt served before
(loaded from wherever it lives now), with K/V equal to a recompute (the driver checks it) and
free + cached + held equal to capacity after every step (the driver checks that too).

A second machine adds faults (a full disk, damaged page files, restarts on the same directory):
then only what was served bounds a match, and nothing damaged may ever be loaded.
"""

from __future__ import annotations

import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from kvplug_hookspecs import CacheKey

from .driver import Driver, config, prompts
from .faults import disk_full

PAGE = 4
HOST_TOKENS = 16
# prompts of 8 or 12 tokens over two shared heads: prefixes that branch at page boundaries and
# inside pages
HEADS = prompts(2, 4, seed=11)
TAILS = prompts(6, 8, seed=12)
PROMPTS = [h + t[:n] for h in HEADS for t in TAILS[:3] for n in (4, 8)] + [
    HEADS[0] + TAILS[3][:2] + TAILS[4][:6]
]


def shared_pages(a: list[int], b: list[int]) -> int:
    """Tokens of the longest page-aligned common prefix of ``a`` and ``b``."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n - n % PAGE


def served_bound(ids: list[int], served: list[list[int]]) -> int:
    """The longest page-aligned prefix ``ids`` shares with any prompt served before."""
    return max((shared_pages(ids, q) for q in served), default=0)


def hierarchy(
    cache: str, directory: str, host_tokens: int, lower: str = "disk", **storage: Any
) -> Driver:
    """A device of 16 tokens (pages of ``PAGE``) over a host tier and an unbounded disk (or an
    unbounded ``memory`` tier: every tier private, so the hierarchy answers misses from its
    index of stored pages, which must never hide one)."""
    below = (
        {"name": "disk", "options": {"path": directory}}
        if lower == "disk"
        else {"name": "memory", "options": {"capacity_tokens": 1 << 20}}
    )
    return Driver.build(
        config(
            [{"name": "host", "options": {"capacity_tokens": host_tokens}}, below],
            cache=cache,
            page_size=PAGE,
            capacity=16,
            **storage,
        )
    )


def run_machine(machine: type[RuleBasedStateMachine], examples: int) -> None:
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=examples,
            stateful_step_count=30,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )


def machine(cache: str, lower: str = "disk") -> type[RuleBasedStateMachine]:
    class TieredCache(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.dir = tempfile.mkdtemp(prefix="kvplug-tiers-")
            self.d = hierarchy(cache, self.dir, HOST_TOKENS, lower, prefetch=True)
            self.served: list[list[int]] = []

        @rule(i=st.integers(0, len(PROMPTS) - 1))
        def request(self, i: int) -> None:
            ids = PROMPTS[i]
            want = served_bound(ids, self.served)
            match = self.d.request(ids)
            assert match.prefix_len == want, (ids, self.served)
            device = match.prefix_len - sum(n for _, n in match.tier_tokens)
            assert 0 <= device <= match.prefix_len
            self.served.append(ids)

        @rule(i=st.integers(0, len(PROMPTS) - 1))
        def prefetch(self, i: int) -> None:
            before = (
                self.d.stack.allocator.available_size(),
                self.d.cache.evictable_size(),
                self.d.cache.all_values_flatten().tolist(),
            )
            pages = self.d.cache.prefetch(CacheKey(tuple(PROMPTS[i])))
            assert 0 <= pages <= len(PROMPTS[i]) // PAGE
            after = (
                self.d.stack.allocator.available_size(),
                self.d.cache.evictable_size(),
                self.d.cache.all_values_flatten().tolist(),
            )
            assert after == before  # a prefetch never touches the device

        @rule()
        def flush(self) -> None:
            self.d.flush()

        @invariant()
        def host_within_capacity(self) -> None:
            host = self.d.stack.storage.tier_stats()[0]
            assert 0 <= host["tokens"] <= HOST_TOKENS
            assert host["tokens"] % PAGE == 0

        @invariant()
        def nothing_corrupt_or_dropped(self) -> None:
            stats = self.d.stack.storage.stats
            assert stats.corrupt_pages == 0
            assert stats.dropped_pages == 0

        def teardown(self) -> None:
            self.d.close()
            shutil.rmtree(self.dir, ignore_errors=True)

    TieredCache.__name__ = f"TieredCache_{cache}_{lower}"
    return TieredCache


@pytest.mark.parametrize("lower", ["disk", "memory"])
@pytest.mark.parametrize("cache", ["radix", "block_hash"])
def test_no_served_page_is_lost_across_the_hierarchy(cache, lower):
    run_machine(machine(cache, lower), examples=150)


def test_pages_under_a_cut_leaf_chain_from_its_last_page(tmp_path):
    """The sequence the state machine found: an exact eviction cuts a two-page leaf whose child
    was evicted just before; the child's page must be demoted under the digest chained from the
    cut leaf's last page (not from the last page it keeps), or it can never be found again."""
    d = hierarchy("radix", str(tmp_path), HOST_TOKENS, prefetch=True)
    try:
        got = [
            (m.prefix_len, m.tier_tokens)
            for m in map(d.request, (PROMPTS[i] for i in (0, 0, 8, 1, 2, 9, 1, 9)))
        ]
        assert got == [
            (0, ()),
            (8, ()),
            (0, ()),
            (8, ()),
            (4, ()),
            (8, (("host", 8),)),
            (12, (("disk", 8),)),
            (12, (("host", 4), ("disk", 4))),
        ]
    finally:
        d.close()


def faulty_machine(cache: str) -> type[RuleBasedStateMachine]:
    """Requests against host + disk while the disk fails (full: every write raises), pages on it
    are damaged (a flipped byte), and the engine restarts on the same directory (warm: only the
    disk's pages survive). Whatever is matched must be K/V equal to a recompute (the driver
    checks every matched token) and conservation must hold; a match never reaches past what
    was served; every damaged page that was read is counted, none is loaded."""

    class FaultyHierarchy(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.dir = tempfile.mkdtemp(prefix="kvplug-tiers-")
            self.d = self.build()
            self.served: list[list[int]] = []
            self.flips = 0
            self.corrupt_before = 0  # counted by engines that restarted since
            self.rng = random.Random(0)

        def build(self) -> Driver:
            return hierarchy(cache, self.dir, 2 * PAGE)

        def serve(self, i: int) -> None:
            ids = PROMPTS[i]
            match = self.d.request(ids)
            assert 0 <= match.prefix_len <= served_bound(ids, self.served)
            self.served.append(ids)

        @rule(i=st.integers(0, len(PROMPTS) - 1))
        def request(self, i: int) -> None:
            self.serve(i)

        @rule(i=st.integers(0, len(PROMPTS) - 1))
        def request_on_a_full_disk(self, i: int) -> None:
            with disk_full(0):  # the disk takes no byte: its writes fail (then it backs off)
                self.serve(i)

        @precondition(lambda self: any(Path(self.dir).rglob("*.kvpg")))
        @rule()
        def damage_a_disk_page(self) -> None:
            files = sorted(Path(self.dir).rglob("*.kvpg"))
            file = files[self.rng.randrange(len(files))]
            data = bytearray(file.read_bytes())
            data[self.rng.randrange(len(data))] ^= 0x10
            file.write_bytes(bytes(data))
            self.flips += 1

        @rule()
        def restart(self) -> None:
            self.corrupt_before += self.d.stack.storage.stats.corrupt_pages
            self.d.close()
            self.d = self.build()

        @invariant()
        def damaged_pages_are_counted_never_loaded(self) -> None:
            corrupt = self.corrupt_before + self.d.stack.storage.stats.corrupt_pages
            assert corrupt <= self.flips

        def teardown(self) -> None:
            self.d.close()
            shutil.rmtree(self.dir, ignore_errors=True)

    FaultyHierarchy.__name__ = f"FaultyHierarchy_{cache}"
    return FaultyHierarchy


@pytest.mark.parametrize("cache", ["radix", "block_hash"])
def test_faults_never_load_a_wrong_page(cache):
    run_machine(faulty_machine(cache), examples=60)
