"""Every figure of a run, pinned: the numbers below were produced by the simulator before its
speed work (issue 23, part 5: tokens made once as a tuple, no list copies, no garbage collector
passes during a replay). A faster simulator must reproduce them exactly, field for field."""

from __future__ import annotations

import pytest

from kvplug.sim import RunSpec, TraceSource, run_one
from tests.conftest import MOONCAKE_TRACE

needs_trace = pytest.mark.skipif(
    not MOONCAKE_TRACE.exists(), reason="the shared Mooncake trace is not beside the clone"
)

# (policy, timing, capacity, page, cache_output) -> every count of the run
MOONCAKE_800 = [
    (("lru", "sequential", 400_000, 512, True),
     dict(capacity_tokens=399872, preemptions=0, prompt_tokens=11075086, hit_tokens=409088,
          hit_rate=0.036937681567438846, prefill_saved=0.007139985352316541,
          evicted_tokens=10338816, shortfall_requested_tokens=10338816,
          shortfall_freed_tokens=10338816, over_eviction=0.0)),
    (("s3fifo", "sequential", 400_000, 512, True),
     dict(capacity_tokens=399872, preemptions=0, prompt_tokens=11075086, hit_tokens=424448,
          hit_rate=0.03832457824706734, prefill_saved=0.00760994500338914,
          evicted_tokens=10323456, shortfall_requested_tokens=10323456,
          shortfall_freed_tokens=10323456, over_eviction=0.0)),
    (("belady", "sequential", 400_000, 512, True),
     dict(capacity_tokens=399872, preemptions=0, prompt_tokens=11075086, hit_tokens=1366016,
          hit_rate=0.12334134470829392, prefill_saved=0.06874203885495211,
          evicted_tokens=9381888, shortfall_requested_tokens=9381888,
          shortfall_freed_tokens=9381888, over_eviction=0.0)),
    (("lru", "trace", 400_000, 512, True),
     dict(capacity_tokens=399872, preemptions=9, prompt_tokens=11075086, hit_tokens=404480,
          hit_rate=0.0365216125635503, prefill_saved=0.007059559985394328,
          evicted_tokens=10346496, shortfall_requested_tokens=10351616,
          shortfall_freed_tokens=10346496, over_eviction=-0.0004946087644672748)),
    (("lfu", "sequential", 300_000, 16, False),
     dict(capacity_tokens=300000, preemptions=0, prompt_tokens=11075086, hit_tokens=409088,
          hit_rate=0.036937681567438846, prefill_saved=0.007139985352316541,
          evicted_tokens=10360704, shortfall_requested_tokens=10360704,
          shortfall_freed_tokens=10360704, over_eviction=0.0)),
]  # fmt: skip

SYNTHETIC_CHAT = [
    (("lru", "trace"),
     dict(capacity_tokens=20000, page_size=1, preemptions=0, prompt_tokens=359056,
          hit_tokens=239355, hit_rate=0.6666230337328996, prefill_saved=0.6475294997810123,
          evicted_tokens=154390, shortfall_requested_tokens=154390,
          shortfall_freed_tokens=154390, over_eviction=0.0)),
    (("belady", "sequential"),
     dict(capacity_tokens=20000, page_size=1, preemptions=0, prompt_tokens=359056,
          hit_tokens=291935, hit_rate=0.8130625863375073, prefill_saved=0.8019912868709607,
          evicted_tokens=104289, shortfall_requested_tokens=104289,
          shortfall_freed_tokens=104289, over_eviction=0.0)),
]  # fmt: skip


def _figures(result):
    figures = result.as_dict()
    del figures["wall_seconds"], figures["cache_us_per_request"]  # times, not results
    return figures


@needs_trace
@pytest.mark.parametrize(("run", "expected"), MOONCAKE_800, ids=lambda v: str(v))
def test_mooncake_slice_figures_are_unchanged(run, expected):
    policy, timing, capacity, page, cache_output = run
    source = TraceSource(kind="mooncake", path=str(MOONCAKE_TRACE), limit=800)
    spec = RunSpec(
        source=source,
        policy=policy,
        capacity_tokens=capacity,
        page_size=page,
        timing=timing,
        cache_output=cache_output,
    )
    assert _figures(run_one(spec)) == {
        "trace": MOONCAKE_TRACE.name,
        "cache": "radix",
        "policy": policy,
        "page_size": page,
        "timing": timing,
        "eviction": "shortfall",
        "requests": 800,
        "completed": 800,
        "aborted": 0,
        **expected,
    }


@pytest.mark.parametrize(("run", "expected"), SYNTHETIC_CHAT, ids=lambda v: str(v))
def test_synthetic_chat_figures_are_unchanged(run, expected):
    policy, timing = run
    spec = RunSpec(
        source=TraceSource(kind="synthetic", preset="chat"),
        policy=policy,
        capacity_tokens=20_000,
        timing=timing,
    )
    assert _figures(run_one(spec)) == {
        "trace": "synthetic:chat",
        "cache": "radix",
        "policy": policy,
        "timing": timing,
        "eviction": "shortfall",
        "requests": 400,
        "completed": 400,
        "aborted": 0,
        **expected,
    }
