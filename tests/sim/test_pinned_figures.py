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

PINNED = (
    "capacity_tokens", "preemptions", "prompt_tokens", "hit_tokens", "hit_rate",
    "prefill_saved", "evicted_tokens", "shortfall_requested_tokens", "shortfall_freed_tokens",
    "over_eviction",
)  # fmt: skip

# (policy, timing, capacity, page, cache_output) -> the PINNED figures of the run
MOONCAKE_800 = [
    (("lru", "sequential", 400_000, 512, True),
     (399872, 0, 11075086, 409088, 0.036937681567438846, 0.007139985352316541,
      10338816, 10338816, 10338816, 0.0)),
    (("s3fifo", "sequential", 400_000, 512, True),
     (399872, 0, 11075086, 424448, 0.03832457824706734, 0.00760994500338914,
      10323456, 10323456, 10323456, 0.0)),
    (("belady", "sequential", 400_000, 512, True),
     (399872, 0, 11075086, 1366016, 0.12334134470829392, 0.06874203885495211,
      9381888, 9381888, 9381888, 0.0)),
    (("lru", "trace", 400_000, 512, True),
     (399872, 9, 11075086, 404480, 0.0365216125635503, 0.007059559985394328,
      10346496, 10351616, 10346496, -0.0004946087644672748)),
    (("lfu", "sequential", 300_000, 16, False),
     (300000, 0, 11075086, 409088, 0.036937681567438846, 0.007139985352316541,
      10360704, 10360704, 10360704, 0.0)),
]  # fmt: skip

# (policy, timing) -> the PINNED figures (capacity 20,000 tokens, page 1)
SYNTHETIC_CHAT = [
    (("lru", "trace"),
     (20000, 0, 359056, 239355, 0.6666230337328996, 0.6475294997810123,
      154390, 154390, 154390, 0.0)),
    (("belady", "sequential"),
     (20000, 0, 359056, 291935, 0.8130625863375073, 0.8019912868709607,
      104289, 104289, 104289, 0.0)),
]  # fmt: skip


def _figures(result):
    figures = result.as_dict()
    del figures["wall_seconds"], figures["cache_us_per_request"]  # times, not results
    for tier_field in (  # added later (storage tiers): empty or derived without tiers
        "tiers", "device_hit_tokens", "tier_hit_tokens", "transfer_bytes",
        "demotions_dropped", "prefill_seconds", "prefill_seconds_saved",
    ):  # fmt: skip
        figures.pop(tier_field, None)
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
        **dict(zip(PINNED, expected, strict=True)),
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
        "page_size": 1,
        "timing": timing,
        "eviction": "shortfall",
        "requests": 400,
        "completed": 400,
        "aborted": 0,
        **dict(zip(PINNED, expected, strict=True)),
    }
