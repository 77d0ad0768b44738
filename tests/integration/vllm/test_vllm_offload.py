"""kvplug policies as vLLM's CPU-offload CachePolicy, loaded by vLLM's own factory by module
path and driven through vLLM's own CPUOffloadingManager."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

pytest.importorskip("vllm")

from kvplug.errors import UnknownComponentError
from kvplug.integrations.vllm import offload
from kvplug.policies import FIFOPolicy, LFUPolicy, LRUPolicy, SLRUPolicy

pytestmark = pytest.mark.vllm

MODULE = "kvplug.integrations.vllm.offload"


def manager(cache_policy: str, num_chunks: int = 4) -> Any:
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    return CPUOffloadingManager(
        num_chunks=num_chunks, cache_policy=cache_policy, cache_policy_module_path=MODULE
    )


def key(name: str) -> Any:
    from vllm.v1.kv_offload.base import make_offload_key

    return make_offload_key(name.encode().ljust(32, b"."), 0)


class Driver:
    """One request at a time through vLLM's manager: store keys, load keys, finish."""

    def __init__(self, mgr: Any) -> None:
        self.mgr = mgr
        self.n = 0

    def request(self, store: Sequence[str] = (), load: Sequence[str] = ()) -> list[Any]:
        from vllm.v1.kv_offload.base import ReqContext

        self.n += 1
        ctx = ReqContext(req_id=f"req{self.n}")
        self.mgr.on_new_request(ctx)
        evicted: list[Any] = []
        if load:
            keys = [key(k) for k in load]
            self.mgr.prepare_load(keys, ctx)
            self.mgr.complete_load(keys, ctx)
        if store:
            keys = [key(k) for k in store]
            out = self.mgr.prepare_store(keys, ctx)
            assert out is not None, "the store should fit after evicting"
            self.mgr.complete_store(out.keys_to_store, ctx)
            evicted = list(out.evicted_keys)
        self.mgr.on_request_finished(ctx)
        return evicted


@pytest.mark.parametrize(
    ("name", "cls"),
    [("kvplug_lru", LRUPolicy), ("kvplug_lfu", LFUPolicy), ("kvplug_slru", SLRUPolicy)],
)
def test_vllm_factory_loads_the_policy_by_module_path(name: str, cls: type) -> None:
    policy = manager(name)._policy
    assert isinstance(policy, offload.KvplugCachePolicy)
    assert isinstance(policy.policy, cls)


def test_configured_policy_class(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVPLUG_VLLM", '{"offload_eviction_policy": "fifo"}')
    assert isinstance(manager("KvplugCachePolicy")._policy.policy, FIFOPolicy)
    monkeypatch.delenv("KVPLUG_VLLM")
    assert isinstance(manager("KvplugCachePolicy")._policy.policy, LRUPolicy)


def test_unknown_policy_names_the_valid_ones() -> None:
    with pytest.raises(UnknownComponentError, match="Valid eviction policies"):
        manager("kvplug_nope")
    with pytest.raises(AttributeError):
        offload.__getattr__("LRUCachePolicy")


@pytest.mark.parametrize("name", ["kvplug_lru", "kvplug_lfu", "kvplug_fifo", "kvplug_slru"])
def test_evicts_what_the_policy_predicts(name: str) -> None:
    mgr = manager(name, num_chunks=4)
    drive = Driver(mgr)
    drive.request(store=["a1", "a2"])
    drive.request(store=["b1", "b2"])
    drive.request(load=["a1", "a2"])  # a reused: a hit on each
    drive.request(load=["a1"])
    policy = mgr._policy
    for new in ["c1", "c2", "c3"]:
        predicted = policy.policy.peek().key
        assert drive.request(store=[new]) == [predicted]
    assert mgr._get_num_free_chunks() == 0


def test_lfu_keeps_reused_chunks_lru_does_not() -> None:
    survivors = {}
    for name in ("kvplug_lru", "kvplug_lfu"):
        mgr = manager(name, num_chunks=4)
        drive = Driver(mgr)
        drive.request(store=["hot1", "hot2"])
        drive.request(load=["hot1", "hot2"])
        drive.request(load=["hot1", "hot2"])
        for i in range(4):
            drive.request(store=[f"scan{i}"])
        survivors[name] = {k for k in ("hot1", "hot2") if mgr._policy.get(key(k)) is not None}
    assert survivors == {"kvplug_lru": set(), "kvplug_lfu": {"hot1", "hot2"}}


def test_evict_is_atomic() -> None:
    from vllm.v1.kv_offload.base import ReqContext
    from vllm.v1.kv_offload.cpu.policies.base import ChunkStatus

    policy = offload.policy_class("lfu")(cache_capacity=3)
    ctx = ReqContext(req_id="x")
    for name in ("a", "b", "c"):
        chunk = ChunkStatus(len(policy.chunks))
        chunk.ref_cnt = 0
        policy.insert(key(name), chunk, ctx)
    before = policy.policy.peek()
    assert policy.evict(3, protected={key("b")}) is None  # only 2 evictable
    assert len(policy.policy) == 3 and policy.policy.peek() is before
    evicted = policy.evict(2, protected={key("b")})
    assert [k for k, _ in evicted] == [key("a"), key("c")]
    assert set(policy.chunks) == {key("b")}
