"""The simulated cluster: one instance makes exactly run_one's figures behind every router,
runs are deterministic for a seed, the event-fed index holds what the caches hold, and the
routers do what the routers they model do."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from kvplug.cli import app
from kvplug.sim import ROUTERS, ClusterSpec, RunSpec, TraceSource, run_cluster, run_one
from kvplug.sim import cluster as cluster_module
from kvplug.sim.kv_index import block_keys
from kvplug.sim.routers import SessionOptions, SessionRouter, session_key
from kvplug.traces import SyntheticSpec, TraceRequest
from tests.conftest import MOONCAKE_TRACE

pytest.importorskip("msgspec")  # the KV-event routers read the cluster extra's wire structs

needs_trace = pytest.mark.skipif(
    not MOONCAKE_TRACE.exists(), reason="the shared Mooncake trace is not beside the clone"
)
SHARED = (
    "requests", "completed", "aborted", "preemptions", "prompt_tokens", "hit_tokens", "hit_rate",
    "prefill_saved", "evicted_tokens", "capacity_tokens", "page_size",
)  # fmt: skip
SMALL = SyntheticSpec(num_requests=150, block_size=4, system_blocks=8, conversations_per_s=20.0)


def _figures(result):
    figures = result.as_dict()
    for times in ("wall_seconds", "cache_us_per_request", "router_us_per_request"):
        figures.pop(times, None)
    return figures


@pytest.mark.parametrize("timing", ["sequential", "trace"])
def test_one_instance_reproduces_run_one_behind_every_router(timing):
    spec = RunSpec(
        source=TraceSource(kind="synthetic", synthetic=SMALL),
        capacity_tokens=600,
        page_size=4,
        timing=timing,
    )
    single = run_one(spec)
    assert single.evicted_tokens > 0
    for router in ROUTERS:
        result = run_cluster(ClusterSpec(run=spec, instances=1, router=router))
        assert {k: getattr(result, k) for k in SHARED} == {k: getattr(single, k) for k in SHARED}


@needs_trace
def test_one_instance_reproduces_run_one_on_the_mooncake_trace_under_pressure():
    """Trace timing with preemptions: the cluster loop's clock and routing make the same
    scheduler calls as run_one's feed."""
    source = TraceSource(kind="mooncake", path=str(MOONCAKE_TRACE), limit=300)
    spec = RunSpec(source=source, capacity_tokens=400_000, page_size=512, timing="trace")
    single = run_one(spec)
    assert single.preemptions == 6
    for router in ("round_robin", "kv_aware"):
        result = run_cluster(ClusterSpec(run=spec, instances=1, router=router))
        assert {k: getattr(result, k) for k in SHARED} == {k: getattr(single, k) for k in SHARED}


@pytest.mark.parametrize("router", ["llmd", "kv_aware", "prefix_aware", "least_loaded"])
def test_results_are_deterministic_for_a_seed(router):
    spec = RunSpec(
        source=TraceSource(kind="synthetic", synthetic=SMALL),
        capacity_tokens=300,
        page_size=4,
        timing="trace",
    )
    first = run_cluster(ClusterSpec(run=spec, instances=3, router=router, seed=7))
    again = run_cluster(ClusterSpec(run=spec, instances=3, router=router, seed=7))
    assert _figures(first) == _figures(again)
    assert sum(first.served_tokens) == first.prompt_tokens


def test_the_event_fed_index_holds_exactly_what_each_cache_holds(monkeypatch):
    """After a run, every block the KV-aware router believes an instance holds is a whole page
    that instance's cache holds, and the counts agree page for page."""
    seen = {}
    make = cluster_module.make_router

    def keep(*args, **kwargs):
        seen["router"] = make(*args, **kwargs)
        return seen["router"]

    made = []
    original = cluster_module._Instance.__init__

    def track(self, *args, **kwargs):
        original(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(cluster_module, "make_router", keep)
    monkeypatch.setattr(cluster_module._Instance, "__init__", track)
    spec = RunSpec(
        source=TraceSource(kind="synthetic", synthetic=SMALL), capacity_tokens=400, page_size=4
    )
    result = run_cluster(ClusterSpec(run=spec, instances=3, router="kv_aware"))
    router = seen["router"]
    for k, inst in enumerate(made):
        router.observe(k, inst.batcher.take_batches())
        cache = inst.stack.prefix_cache
        assert len(router.index.held[k]) * 4 == cache.total_size() > 0
    assert result.kv_events > 0 and router.index.ignored == 0


def test_block_keys_chain_whole_blocks_only():
    keys = block_keys((1, 2, 3, 4, 5, 6, 7), 3)
    assert len(keys) == 2
    assert keys == block_keys((1, 2, 3, 4, 5, 6, 9, 9), 3)  # the partial block is not keyed
    assert block_keys((1, 2, 3, 9, 5, 6), 3)[1] != keys[1]  # a key holds its whole prefix


def test_round_robin_deals_requests_evenly():
    spec = RunSpec(source=TraceSource(kind="synthetic", synthetic=SMALL), capacity_tokens=400)
    result = run_cluster(ClusterSpec(run=spec, instances=4, router="round_robin"))
    assert result.request_imbalance == pytest.approx(38 / 37.5)  # 150 = 38 + 38 + 37 + 37


def test_session_affinity_is_stable_and_consistent():
    """A session always maps to one instance; growing the ring from 3 to 4 instances moves
    only the sessions the new instance takes (about a quarter), as consistent hashing does."""
    requests = [
        TraceRequest(i, 0.0, (1, 2, 3), 1, session_id=f"conversation-{i}") for i in range(2000)
    ]
    three = SessionRouter(3, 16, 0, SessionOptions())
    four = SessionRouter(4, 16, 0, SessionOptions())
    before = [three.route(r, r.prompt, []) for r in requests]
    assert before == [three.route(r, r.prompt, []) for r in requests]
    after = [four.route(r, r.prompt, []) for r in requests]
    moved = [(a, b) for a, b in zip(before, after) if a != b]
    assert all(b == 3 for _, b in moved)  # only to the new instance
    assert 0.15 < len(moved) / len(requests) < 0.35
    assert session_key(TraceRequest(0, 0.0, (1,), 1), 16, 2) == "None/" + str(hash((1,)))


def test_the_cli_reports_every_router_beside_the_reference(tmp_path):
    out = tmp_path / "cluster.json"
    result = CliRunner().invoke(
        app,
        ["simulate", "--limit", "120", "--capacity", "2000", "--policy", "lru",
         "--instances", "2", "--router", "round_robin,llmd", "--jobs", "1",
         "--json", str(out), "--csv", str(tmp_path / "c.csv")],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    runs = json.loads(out.read_text())["runs"]
    assert [(r["router"], r["instances"], r["capacity_tokens"]) for r in runs] == [
        ("single", 1, 4000), ("round_robin", 2, 2000), ("llmd", 2, 2000)
    ]  # fmt: skip
    assert "llmd" in result.output


def test_the_cli_names_a_bad_router():
    result = CliRunner().invoke(app, ["simulate", "--instances", "2", "--router", "random"])
    assert result.exit_code == 2
    assert "unknown router 'random'" in result.output
