"""kvplug inside vLLM's real Scheduler: loaded by vLLM's plugin loader, selected per engine,
driven through schedule() / update_from_output() with chunked prefill, concurrency and
preemption."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import entry_points
from typing import Any

import pytest

pytest.importorskip("vllm")

from pydantic import ValidationError
from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue

from kvplug import (
    EvictionPolicyRegistration,
    KeyedEvictionPolicy,
    NoOptions,
    get_registry,
    hookimpl,
)
from kvplug.errors import UnknownComponentError
from kvplug.integrations.vllm import UnsupportedVllmError, plugin, selected_config
from kvplug.integrations.vllm.block_pool import PolicyFreeBlockQueue, installed_policy
from kvplug.policies import LFUPolicy, SLRUPolicy
from tests.integration.vllm.conftest import check_pool, make_engine

pytestmark = pytest.mark.vllm

SLRU_JSON = '{"eviction_policy": {"name": "slru", "options": {"protected_hits": 2}}}'
ROUTES: dict[str, tuple[Any, str | None]] = {
    "additional-config object": ({"kvplug": {"eviction_policy": "slru"}}, None),
    "additional-config name": ({"kvplug": "slru"}, None),
    "env name": (None, "slru"),
    "env json": (None, SLRU_JSON),
}


@pytest.fixture(scope="module", autouse=True)
def _vllm_loaded_our_plugin() -> None:
    """vLLM's own loader finds the installed entry point and runs it (once per process)."""
    from vllm.plugins import load_general_plugins
    from vllm.v1.core.sched.scheduler import Scheduler

    load_general_plugins()
    plugin.register()  # idempotent; covers a process where the loader already ran
    assert getattr(Scheduler.__init__, "__kvplug_wrapped__", False)


def test_entry_point_is_installed() -> None:
    found = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert found.get("kvplug") == "kvplug.integrations.vllm:register"


def test_not_selected_keeps_vllm_block_pool(tiny_model_dir: str) -> None:
    from vllm.v1.core.block_pool import BlockPool

    engine = make_engine(tiny_model_dir)
    assert type(engine.pool) is BlockPool
    assert installed_policy(engine.pool) is None


def busy_workload(engine: Any) -> list[Any]:
    """Concurrent requests sharing prefixes, prompts longer than a step's token budget (chunked
    prefill) and decodes that outgrow the pool (preemption); checks vLLM after every step."""
    shared = list(range(40))
    requests = [
        engine.request(f"r{i}", shared[: 16 * (i % 3)] + [100 + i] * (30 + 7 * i), max_tokens=24)
        for i in range(10)
    ]
    for req in requests:
        engine.scheduler.add_request(req)
    for _ in range(500):
        if not engine.scheduler.has_unfinished_requests():
            break
        engine.step()
        check_pool(engine.scheduler.kv_cache_manager)
    assert not engine.scheduler.has_unfinished_requests()
    return requests


@pytest.mark.parametrize("route", list(ROUTES))
def test_activation_routes_run_the_scheduler(
    route: str, tiny_model_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    additional, env = ROUTES[route]
    if env is not None:
        monkeypatch.setenv("KVPLUG_VLLM", env)
    engine = make_engine(
        tiny_model_dir,
        num_blocks=24,
        additional_config=additional,
        max_num_batched_tokens=48,
        max_num_seqs=6,
    )
    assert isinstance(installed_policy(engine.pool), SLRUPolicy)
    requests = busy_workload(engine)
    assert any(req.num_preemptions for req in requests), "the workload should preempt"
    assert sum(engine.cached_tokens.values()) > 0, "shared prefixes should hit"
    # idle: every block but vLLM's null block is free, nothing leaked
    assert engine.pool.get_num_free_blocks() == 23
    check_pool(engine.scheduler.kv_cache_manager)
    assert engine.scheduler.reset_prefix_cache()
    check_pool(engine.scheduler.kv_cache_manager)


@pytest.mark.parametrize(
    ("selection", "queue_class", "chain_groups"),
    [
        ("lru", FreeKVCacheBlockQueue, None),
        ({"eviction_policy": "lru", "chain_protection": True}, PolicyFreeBlockQueue, {0}),
        ({"eviction_policy": "lru", "chain_protection": False}, FreeKVCacheBlockQueue, None),
        ("slru", PolicyFreeBlockQueue, {0}),
        ({"eviction_policy": "slru", "chain_protection": False}, PolicyFreeBlockQueue, set()),
    ],
)
def test_chain_protection_default_and_option(
    selection: Any, queue_class: type, chain_groups: set[int] | None, tiny_model_dir: str
) -> None:
    """lru keeps vLLM's own list unless chain protection is asked for; other policies protect
    the full-attention group's chains unless it is turned off."""
    engine = make_engine(tiny_model_dir, additional_config={"kvplug": selection})
    queue = engine.pool.free_block_queue
    assert type(queue) is queue_class
    assert getattr(engine.pool, "_kvplug_chain_groups", None) == chain_groups
    engine.serve(engine.request("a", list(range(40))))
    assert engine.pool.get_num_free_blocks() == 31
    check_pool(engine.scheduler.kv_cache_manager)


def test_same_workload_same_outcome_as_vllm_with_lru(tiny_model_dir: str) -> None:
    """The scheduler's decisions (tokens cached per request, steps) match vLLM's under lru."""
    outcomes = []
    for additional in (None, {"kvplug": "lru"}):
        engine = make_engine(
            tiny_model_dir,
            num_blocks=24,
            additional_config=additional,
            max_num_batched_tokens=48,
            max_num_seqs=6,
        )
        requests = busy_workload(engine)
        outcomes.append((engine.steps, engine.cached_tokens, [r.num_preemptions for r in requests]))
    assert outcomes[0] == outcomes[1]


@pytest.mark.parametrize(
    ("selection", "survives", "async_scheduling"),
    [
        (None, False, False),
        ("lru", False, False),
        ("lfu", True, False),
        ("slru", True, False),
        (None, False, True),
        ("slru", True, True),
    ],
)
def test_hot_prefix_survives_a_scan(
    selection: str | None, survives: bool, async_scheduling: bool, tiny_model_dir: str
) -> None:
    """A 4-block system prompt used three times, then a scan of one-off prompts larger than the
    pool: vLLM's LRU (and kvplug lru) lose the prompt, lfu and slru keep it; with vLLM's
    Scheduler and with its AsyncScheduler (the engine's default)."""
    additional = {"kvplug": selection} if selection else None
    engine = make_engine(
        tiny_model_dir,
        num_blocks=32,
        additional_config=additional,
        async_scheduling=async_scheduling,
    )
    hot = list(range(64))
    for i in range(3):
        engine.serve(engine.request(f"hot{i}", hot + [900 + i] * 5))
    assert engine.cached_tokens["hot2"] == 64
    for i in range(6):
        engine.serve(engine.request(f"scan{i}", [1000 + i] * 140))
    engine.serve(engine.request("again", hot + [5] * 5))
    assert engine.cached_tokens["again"] == (64 if survives else 0)
    assert engine.pool.get_num_free_blocks() == 31
    check_pool(engine.scheduler.kv_cache_manager)
    if selection == "lfu":
        assert isinstance(installed_policy(engine.pool), LFUPolicy)


def test_bad_selection_refuses_to_start(tiny_model_dir: str) -> None:
    with pytest.raises(UnknownComponentError, match="Valid eviction policies"):
        make_engine(tiny_model_dir, additional_config={"kvplug": "lruu"})
    with pytest.raises(ValidationError, match="protected_hits"):
        make_engine(
            tiny_model_dir,
            additional_config={
                "kvplug": {"eviction_policy": {"name": "slru", "options": {"protected_hits": -1}}}
            },
        )


def test_unsupported_vllm_refuses_loudly(
    tiny_model_dir: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(plugin, "vllm_version", lambda: "0.35.0")
    with pytest.raises(UnsupportedVllmError, match=r"vllm>=0\.33,<0\.35, found vllm 0\.35\.0"):
        make_engine(tiny_model_dir, additional_config={"kvplug": "lfu"})
    make_engine(tiny_model_dir)  # not selected: vLLM runs as usual
    with caplog.at_level("ERROR"):
        plugin.register()
    assert "outside the supported range" in caplog.text
    monkeypatch.setenv("KVPLUG_VLLM", "lfu")
    with pytest.raises(UnsupportedVllmError):
        plugin.register()


def test_cli_flag_reaches_vllm_config(tiny_model_dir: str) -> None:
    """`vllm serve --additional-config '{"kvplug": ...}'` parses into the dict kvplug reads.

    In a subprocess: vLLM's argument parser needs a platform (VLLM_TARGET_DEVICE=cpu here), which
    is fixed per process and must not leak into the other tests."""
    code = (
        "from vllm.engine.arg_utils import EngineArgs\n"
        "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
        "parser = EngineArgs.add_cli_args(FlexibleArgumentParser())\n"
        f"args = parser.parse_args(['--model', {tiny_model_dir!r}, '--enable-prefix-caching',\n"
        '    \'--additional-config\', \'{"kvplug": {"eviction_policy": "slru"}}\'])\n'
        "print(json.dumps(EngineArgs.from_cli_args(args).additional_config))\n"
    )
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-c", "import json\n" + code],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    additional = json.loads(done.stdout.strip().splitlines()[-1])
    config = selected_config(additional, environ={})
    assert config is not None and config.eviction_policy.name == "slru"


class DeepestFirst(KeyedEvictionPolicy):
    """A third-party policy reading a feature the side table fills: deepest blocks go first."""

    def key(self, candidate: Any) -> Any:
        return (-candidate.depth, candidate.last_access_time)


class DeepestFirstPlugin:
    @hookimpl
    def kvplug_eviction_policies(self) -> Any:
        yield EvictionPolicyRegistration(
            name="deepest_first",
            factory=DeepestFirst,
            options_model=NoOptions,
            description="evict the block farthest from the prompt start first",
        )


def test_third_party_policy_runs_in_vllm(tiny_model_dir: str) -> None:
    registry = get_registry()
    plugin_object = DeepestFirstPlugin()
    registry.register(plugin_object, name="test-deepest-first")
    try:
        engine = make_engine(
            tiny_model_dir,
            num_blocks=24,
            additional_config={"kvplug": "deepest_first"},
            max_num_batched_tokens=48,
            max_num_seqs=6,
        )
        queue = engine.pool.free_block_queue
        assert isinstance(queue.policy, DeepestFirst)
        busy_workload(engine)
        pool = engine.pool
        candidates = [
            queue.stats(b) for b in range(len(pool.blocks)) if queue.stats(b) in queue.policy
        ]
        assert candidates and max(c.depth for c in candidates) > 0
        assert queue.policy.peek().depth == max(c.depth for c in candidates)
        assert pool.get_num_free_blocks() == 23
    finally:
        registry.unregister(plugin_object)
