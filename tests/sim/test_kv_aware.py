"""The Dynamo-style KV router, term by term against Dynamo's ``lib/llm/src/kv_router``: the
logits of small hand-built cases, where it routes them, how ties and the temperature pick, and
what it hears from the cluster (first tokens, stream ends, only steps ended by an arrival)."""

from __future__ import annotations

import pytest

from kvplug.sim import ClusterSpec, RunSpec, TraceSource
from kvplug.sim import cluster as cluster_module
from kvplug.sim.kv_index import block_keys
from kvplug.sim.routers import KVAwareOptions, KVAwareRouter
from kvplug.traces import SyntheticSpec, TraceRequest

wire = pytest.importorskip("kvplug.cluster.wire")  # the KV events are the cluster extra's

BS = 4
SYSTEM = tuple(range(8))  # two whole blocks


def _router(instances: int = 2, seed: int = 0, **options) -> KVAwareRouter:
    return KVAwareRouter(instances, BS, seed, KVAwareOptions(**options))


def _store(router: KVAwareRouter, instance: int, tokens: tuple[int, ...]) -> None:
    """``instance`` publishes that it holds the whole blocks of ``tokens``."""
    n = len(tokens) // BS * BS
    stored = wire.BlockStored(
        block_hashes=[hash((instance, tokens[: end + BS])) for end in range(0, n, BS)],
        parent_block_hash=None,
        token_ids=list(tokens[:n]),
        block_size=BS,
        lora_id=None,
        medium="GPU",
        lora_name=None,
    )
    router.observe(instance, [wire.KVEventBatch(ts=0.0, events=[stored])])


def _request(index: int, tokens: tuple[int, ...]) -> TraceRequest:
    return TraceRequest(index, 0.0, tokens, 1)


def _route(router: KVAwareRouter, index: int, tokens: tuple[int, ...]) -> int:
    return router.route(_request(index, tokens), tokens, [])


def test_a_cached_prefix_cuts_prefill_tokens_not_decode_blocks():
    router = _router()
    _store(router, 1, SYSTEM)
    prompt = SYSTEM + (20, 21)  # isl 10: two whole blocks, both cached on worker 1
    logits, overlaps, _ = router.logits(prompt)
    # worker 0: 10 / 4 prefill blocks + 2 new blocks; worker 1: (10 - 2 x 4) / 4 + 2 (its
    # cached blocks still count as decode blocks: no active sequence holds them)
    assert overlaps == [0, 2]
    assert logits == [2.5 + 2, 0.5 + 2]
    assert _route(router, 0, prompt) == 1


def test_blocks_shared_with_active_sequences_count_once_and_prefill_ends_at_first_token():
    router = _router()
    _store(router, 1, SYSTEM)
    assert _route(router, 0, SYSTEM + (20, 21)) == 1  # active on 1: 2 blocks, 2 prefill tokens
    second = SYSTEM + (30, 31, 32, 33, 34)  # isl 13: blocks k0 k1 (shared) and one of its own
    logits, _, _ = router.logits(second)
    # worker 1: prefill (13 - 8 + 2) / 4, decode 2 active + 1 new; worker 0: 13 / 4, 0 + 3
    assert logits == [13 / 4 + 3, 7 / 4 + 3]
    router.first_token(1, 0)  # the first request's prefill no longer counts
    assert router.logits(second)[0] == [13 / 4 + 3, 5 / 4 + 3]
    router.finished(1, 0)  # its blocks leave: the second's shared blocks are new again
    assert router.logits(second)[0] == [13 / 4 + 3, 5 / 4 + 3]
    assert router.active[1].active_blocks == 0 and router.active[1].active_tokens == 0


def test_the_weight_trades_cached_blocks_for_decode_blocks_but_not_for_queued_prefill():
    """Another request on the cached worker: while it prefills, its prefill tokens are weighed
    with the same weight as the cached blocks, so no weight keeps this prompt there; once its
    first token is back only its blocks count, and weight 8 (not Dynamo's 1) keeps it."""
    for weight, prefilling, decoding in ((1.0, 0, 0), (8.0, 0, 1)):
        router = _router(overlap_weight=weight)
        _store(router, 1, SYSTEM)
        other = tuple(range(100, 116))  # 16 tokens, 4 blocks, none shared
        router.active[1].add(99, block_keys(other, BS), len(other), 0)
        prompt = SYSTEM + (20, 21)
        # worker 0: w x 10/4 + 2; worker 1: w x (2 + 16)/4 + (4 + 2)
        assert router.logits(prompt)[0] == [weight * 2.5 + 2, weight * 4.5 + 6]
        assert _route(router, 0, prompt) == prefilling
        router.finished(prefilling, 0)
        router.first_token(1, 99)
        # worker 1: w x 2/4 + (4 + 2)
        assert router.logits(prompt)[0] == [weight * 2.5 + 2, weight * 0.5 + 6]
        assert _route(router, 1, prompt) == decoding


def test_ties_go_to_the_smallest_indexer_tree_then_at_random():
    chosen = set()
    for seed in range(20):
        router = _router(instances=3, seed=seed)
        _store(router, 0, tuple(range(200, 212)))  # 3 unrelated blocks: worker 0's tree is largest
        assert router.logits((1, 2, 3, 4, 5))[0] == [1.25 + 1] * 3
        chosen.add(_route(router, 0, (1, 2, 3, 4, 5)))
    assert chosen == {1, 2}  # never 0; the equal trees at random


def test_a_temperature_samples_the_softmax_of_the_range_normalised_logits():
    # logits 4.5, 2.5 at temperature 0.1: p(worker 0) = e^-10 / (1 + e^-10)
    cold = _router(temperature=0.1)
    assert {cold._select([4.5, 2.5]) for _ in range(200)} == {1}
    hot = _router(temperature=1e9)
    picks = [hot._select([4.5, 2.5]) for _ in range(400)]
    assert 150 < picks.count(0) < 250  # near uniform
    assert {_router(temperature=1.0)._select([3.0, 3.0, 3.0]) for _ in range(50)} <= {0, 1, 2}


SMALL = SyntheticSpec(num_requests=150, block_size=4, system_blocks=8, conversations_per_s=20.0)


def test_the_router_hears_only_of_steps_ended_by_the_arrival_and_frees_every_request(
    monkeypatch,
):
    """Under trace timing a request's end reaches the router at the first arrival after the
    step that finished it; by the run's end every request it routed is freed."""
    requests = {}
    heard = []
    unstamped: list[int] = []
    make_request = cluster_module.scheduled

    def keep(pending):
        request = make_request(pending)
        requests[request.request_id] = request
        return request

    class Recording(KVAwareRouter):
        def route(self, request, tokens, loads):  # what it heard, it heard before this arrival
            heard.extend((rid, request.timestamp_ms) for rid in unstamped)
            unstamped.clear()
            return super().route(request, tokens, loads)

        def finished(self, instance, request_id):
            unstamped.append(request_id)
            super().finished(instance, request_id)

    made = {}

    def make(name, instances, block_size, seed, options=None):
        made["router"] = Recording(instances, block_size, seed, KVAwareOptions())
        return made["router"]

    monkeypatch.setattr(cluster_module, "scheduled", keep)
    monkeypatch.setattr(cluster_module, "make_router", make)
    spec = RunSpec(
        source=TraceSource(kind="synthetic", synthetic=SMALL),
        capacity_tokens=400,
        page_size=4,
        timing="trace",
    )
    cluster_module.run_cluster(ClusterSpec(run=spec, instances=3, router="kv_aware"))
    router = made["router"]
    assert heard and all(requests[rid].finished_ms <= at for rid, at in heard)
    assert len(heard) + len(unstamped) == len(requests) == 150  # the rest after the last
    assert all(a.active_blocks == 0 and a.active_tokens == 0 for a in router.active)
