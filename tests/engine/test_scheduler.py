"""The reference scheduler: exact hit counts derived by hand, preemption, conservation."""

from __future__ import annotations

import pytest
import torch

import kvplug
from kvplug.engine import (
    ForwardItem,
    Request,
    RequestStatus,
    Scheduler,
    SchedulerOptions,
    serve_request,
)


def _stack(capacity: int, policy: str = "lru", **pool: object) -> kvplug.KVCacheStack:
    return kvplug.build(
        {
            "eviction_policy": policy,
            "pool": {"capacity_tokens": capacity, "device": "cpu", "store_kv": False, **pool},
        }
    )


def _seq(token_lists: list[list[int]]) -> list[Request]:
    return [Request(i, tokens, 1, arrival_ms=float(i)) for i, tokens in enumerate(token_lists)]


A, B, C, D = [1, 2, 3, 4, 5], [11, 12, 13, 14, 15], [21, 22, 23, 24, 25], list(range(31, 37))
TRACE = [A, B, C, [*A, 6, 7, 8, 9], D, [*B, 16]]


@pytest.mark.parametrize(("policy", "hits"), [("lru", 5), ("mru", 10)])
def test_lru_and_mru_differ_by_a_known_amount(policy, hits):
    """Capacity 20, prompts only cached, one request at a time.

    After R4 (A extended by 4) the cache holds A5 + A's child 4 + B5 + C5 = 19, 1 slot free.
    R5 (D, 6 tokens) is 5 short. LRU evicts B (least recently used, 5 tokens); MRU evicts A's
    child (4) then 1 token of C. R6 (B + 1) then hits B's 5 tokens under MRU only. Both hit A's
    5 tokens at R4, so LRU hits 5 of 36 prompt tokens, MRU 10.
    """
    stack = _stack(20, policy)
    options = SchedulerOptions(timing="sequential", cache_output=False, debug=True)
    scheduler = Scheduler(stack, None, options)
    scheduler.run(_seq(TRACE))
    assert (scheduler.stats.prompt_tokens, scheduler.stats.hit_tokens) == (36, hits)
    assert scheduler.stats.finished == 6 and scheduler.stats.preemptions == 0


def test_two_requests_sharing_three_of_four_pages():
    """Pages of 4, room for 5: the second request reuses 3 pages (12 tokens) and evicts none."""
    stack = kvplug.build(
        {
            "allocator": "paged",
            "prefix_cache": "radix",
            "pool": {"capacity_tokens": 20, "page_size": 4, "device": "cpu", "store_kv": False},
        }
    )
    first = list(range(1, 17))
    second = [*first[:12], 50, 51, 52, 53]
    scheduler = Scheduler(stack, None, SchedulerOptions(timing="sequential", debug=True))
    done = scheduler.run(_seq([first, second]))
    assert [r.cached_tokens for r in done] == [0, 12]
    assert stack.prefix_cache.stats.evicted_tokens == 0
    assert stack.prefix_cache.total_size() == 20  # 4 pages + the second request's last page


def test_preemption_under_a_tiny_capacity_keeps_every_slot_accounted():
    stack = _stack(40)
    requests = [Request(i, [100 * i + j for j in range(8)], 10) for i in range(4)]
    scheduler = Scheduler(stack, None, SchedulerOptions(debug=True))
    done = scheduler.run(requests)
    assert [r.status for r in done] == [RequestStatus.FINISHED] * 4
    assert scheduler.stats.preemptions > 0
    assert all(len(r.output) == 10 for r in done)
    assert stack.allocator.available_size() + stack.prefix_cache.evictable_size() == 40


def test_a_request_that_can_never_fit_is_aborted_not_looped():
    stack = _stack(16)
    scheduler = Scheduler(stack, None, SchedulerOptions(debug=True))
    done = scheduler.run([Request(0, list(range(1, 13)), 8), Request(1, [1, 2, 3], 2)])
    assert [r.status for r in done] == [RequestStatus.ABORTED, RequestStatus.FINISHED]
    assert "needs 20 slots" in (done[0].abort_reason or "")


def test_fast_forward_matches_stepping_one_token_at_a_time():
    trace = [[i % 3 * 100 + j for j in range(20)] + [i] for i in range(30)]

    def run(debug: bool) -> tuple[int, int, int, list[list[int]]]:
        stack = _stack(120)
        requests = [Request(i, t, 7, arrival_ms=i * 0.3) for i, t in enumerate(trace)]
        scheduler = Scheduler(stack, None, SchedulerOptions(debug=debug))
        done = scheduler.run(requests)
        outputs = [r.output for r in sorted(done, key=lambda r: r.request_id)]
        stats = scheduler.stats
        return stats.hit_tokens, stats.preemptions, stack.prefix_cache.stats.evicted_tokens, outputs

    assert run(debug=True) == run(debug=False)  # debug steps one token at a time


def test_requests_must_be_added_in_arrival_order():
    scheduler = Scheduler(_stack(16))
    scheduler.add_request(Request(0, [1], 1, arrival_ms=5.0))
    with pytest.raises(ValueError, match="arrival order"):
        scheduler.add_request(Request(1, [2], 1, arrival_ms=1.0))


def test_bad_requests_are_rejected_with_the_reason():
    with pytest.raises(ValueError, match="prompt is empty"):
        Request(0, [], 1)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        Request(0, [1], 0)


class EchoModel:
    """Returns the last input token + 1 and records every item it was given."""

    def __init__(self) -> None:
        self.items: list[ForwardItem] = []

    def forward(self, stack, items):
        self.items.extend(items)
        return [it.token_ids[-1] + 1 if it.sample else None for it in items]


def test_a_model_sees_chunked_prefill_then_decode_with_all_slots():
    stack = _stack(64)
    model = EchoModel()
    options = SchedulerOptions(max_prefill_tokens=4, debug=True)
    (done,) = Scheduler(stack, model, options).run([Request(0, list(range(1, 11)), 3)])
    assert done.output == [11, 12, 13]
    shapes = [(it.start_pos, len(it.token_ids), len(it.slots), it.sample) for it in model.items]
    assert shapes == [(0, 4, 4, False), (4, 4, 8, False), (8, 2, 10, True), (10, 1, 11, True),
                      (11, 1, 12, True)]  # fmt: skip
    assert model.items[-1].slots.tolist() == list(range(1, 13))


def test_serve_request_is_the_one_shot_lifecycle():
    stack = _stack(32)
    written: list[tuple[list[int], int]] = []

    def write_kv(slots: torch.Tensor, start: int) -> None:
        written.append((slots.tolist(), start))

    assert serve_request(stack, [1, 2, 3, 4, 5, 6], write_kv).prefix_len == 0
    assert serve_request(stack, [1, 2, 3, 4, 9], write_kv).prefix_len == 4
    assert written == [([1, 2, 3, 4, 5, 6], 0), ([7], 4)]
    assert stack.prefix_cache.total_size() == 7


def test_a_request_waiting_for_memory_counts_its_hit_once_and_evicts_nothing_meanwhile():
    """Capacity 40. R0 caches x (8 tokens). R1 (20 tokens, 6 outputs) runs for 6 steps holding
    20..25 slots. R2 = x + 20 new tokens arrives with R1: locked x + R1's 20 leave 12 free and
    nothing evictable, so R2 waits until R1 finishes. Each retry is a probe (as SGLang checks
    free + evictable before it evicts): the cache sees 3 queries and one 8-token hit, not one
    per retry, and nothing is evicted or requested until R2 fits."""
    stack = _stack(40)
    x = list(range(1, 9))
    requests = [
        Request(0, x, 1, arrival_ms=0.0),
        Request(1, list(range(100, 120)), 6, arrival_ms=100.0),
        Request(2, [*x, *range(200, 220)], 1, arrival_ms=100.0),
    ]
    scheduler = Scheduler(stack, None, SchedulerOptions(timing="trace", debug=True))
    scheduler.run(requests)
    stats = stack.prefix_cache.stats
    assert (scheduler.stats.hit_tokens, scheduler.stats.finished) == (8, 3)
    assert (stats.match_queries, stats.hit_tokens) == (3, 8)
    # R1 finished caching 20 + 5 tokens beside x with 7 slots free: R2's shortfall is 13,
    # cut from R1's leaf (x is locked), requested once
    assert (stats.shortfall_requested_tokens, stats.evicted_tokens) == (13, 13)
