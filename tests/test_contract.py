"""The contract package: models reject bad values, registrations validate, the policy heap ranks."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

import kvplug
import kvplug_hookspecs as hs
from kvplug_hookspecs import (
    ComponentSelection,
    EvictionPolicyRegistration,
    EvictParams,
    EvictResult,
    KeyedEvictionPolicy,
    KVCacheConfig,
    PoolGeometry,
)


def test_kvplug_reexports_the_contract():
    assert kvplug.EvictParams is hs.EvictParams
    assert kvplug.hookimpl is hs.hookimpl
    assert kvplug.hookimpl.project_name == "kvplug"
    assert str(kvplug.EvictParams(num_tokens=3)) == "num_tokens=3 swa_num_tokens=0 mamba_num=0"


@pytest.mark.parametrize("field", ["num_tokens", "swa_num_tokens", "mamba_num"])
def test_evict_params_reject_negative_values_naming_the_field(field):
    with pytest.raises(ValidationError) as info:
        EvictParams(**{field: -1})
    (error,) = info.value.errors()
    assert error["loc"] == (field,)
    assert error["type"] == "greater_than_equal"


def test_evict_params_reject_unknown_fields_and_non_ints():
    with pytest.raises(ValidationError) as info:
        EvictParams(num_token=3)
    assert info.value.errors()[0]["loc"] == ("num_token",)
    assert info.value.errors()[0]["type"] == "extra_forbidden"
    for bad in ("3", 2.5, True):
        with pytest.raises(ValidationError):
            EvictParams(num_tokens=bad)


def test_evict_params_are_frozen_and_report_emptiness():
    params = EvictParams(num_tokens=4)
    with pytest.raises(ValidationError):
        params.num_tokens = 5
    assert not params.is_empty
    assert EvictParams().is_empty
    assert EvictResult(num_tokens=2, swa_num_tokens=1).swa_num_tokens == 1


def test_pool_geometry_validation():
    with pytest.raises(ValidationError) as info:
        PoolGeometry(capacity_tokens=0)
    assert info.value.errors()[0]["loc"] == ("capacity_tokens",)
    with pytest.raises(ValidationError, match="not a multiple of page_size=16"):
        PoolGeometry(capacity_tokens=100, page_size=16)
    with pytest.raises(ValidationError, match="unknown device 'gpu'"):
        PoolGeometry(device="gpu")
    with pytest.raises(ValidationError) as info:
        PoolGeometry(dtype="float17")
    assert info.value.errors()[0]["loc"] == ("dtype",)
    assert PoolGeometry(device="cuda:1", dtype="bfloat16").device == "cuda:1"


def test_component_selection_shorthand_and_normalisation():
    assert ComponentSelection.model_validate("LRU") == ComponentSelection(name="lru")
    config = KVCacheConfig(eviction_policy={"name": "slru", "options": {"protected_hits": 3}})
    assert config.eviction_policy.options == {"protected_hits": 3}
    assert config.allocator.name == "standard" and config.prefix_cache.name == "radix"
    with pytest.raises(ValidationError, match="invalid component name"):
        ComponentSelection(name="no spaces")
    with pytest.raises(ValidationError):
        KVCacheConfig(evictionpolicy="lru")


def test_registration_objects_validate_their_fields():
    def factory(options):
        return KeyedEvictionPolicy(options)

    reg = EvictionPolicyRegistration(name="mine", factory=factory, aliases=("my-alias",))
    assert reg.names == ("mine", "my-alias")
    assert reg.options_model is hs.NoOptions
    with pytest.raises(ValueError, match="eviction policy name 'Bad Name' is invalid"):
        EvictionPolicyRegistration(name="Bad Name", factory=factory)
    with pytest.raises(ValueError, match="alias 'X'"):
        EvictionPolicyRegistration(name="ok", factory=factory, aliases=("X",))
    with pytest.raises(TypeError, match="aliases must be a tuple"):
        EvictionPolicyRegistration(name="ok", factory=factory, aliases=["a"])
    with pytest.raises(TypeError, match="is not callable"):
        EvictionPolicyRegistration(name="ok", factory=42)
    with pytest.raises(TypeError, match="options_model must be a pydantic BaseModel"):
        EvictionPolicyRegistration(name="ok", factory=factory, options_model=dict)


class _Candidate:
    def __init__(self, node_id, last_access_time, num_tokens=1):
        self.node_id = node_id
        self.last_access_time = last_access_time
        self.creation_time = node_id
        self.hit_count = 0
        self.priority = 0
        self.num_tokens = num_tokens


class _ByAccess(KeyedEvictionPolicy):
    def key(self, c):
        return c.last_access_time


def test_keyed_policy_pops_in_key_order_and_skips_stale_entries():
    policy = _ByAccess()
    a, b, c = _Candidate(1, 10), _Candidate(2, 5), _Candidate(3, 7)
    for cand in (a, b, c):
        policy.add(cand)
    b.last_access_time = 20
    policy.touch(b)  # b moves behind a
    policy.discard(c)
    policy.discard(c)  # discarding twice is a no-op
    assert len(policy) == 2 and c not in policy and a in policy
    assert policy.peek() is a
    assert [policy.pop(), policy.pop(), policy.pop()] == [a, b, None]
    assert len(policy) == 0


def test_keyed_policy_breaks_ties_by_node_id_and_compacts_its_heap():
    policy = _ByAccess()
    cands = [_Candidate(i, 0) for i in range(10, 0, -1)]
    for cand in cands:
        policy.add(cand)
    for _ in range(500):  # many touches create stale entries; the heap stays bounded
        policy.touch(cands[0])
    assert len(policy._heap) <= 2 * len(policy) + 64 + 1
    assert [policy.pop().node_id for _ in range(10)] == list(range(1, 11))


def test_touch_is_ignored_for_absent_candidates_and_fixed_keys():
    class Fifo(KeyedEvictionPolicy):
        touch_changes_key = False

        def key(self, c):
            return c.creation_time

    policy = Fifo()
    x = _Candidate(1, 0)
    policy.touch(x)
    assert len(policy) == 0 and policy.pop() is None
    policy.add(x)
    policy.touch(x)
    assert len(policy._heap) == 1
    policy.clear()
    assert policy.pop() is None


def test_protocols_are_runtime_checkable():
    assert isinstance(_ByAccess(), hs.EvictionPolicy)
    assert not isinstance(object(), hs.TokenAllocator)


def test_the_contract_and_the_example_plugin_do_not_import_torch():
    import subprocess
    import sys

    code = (
        "import sys, kvplug_hookspecs, kvplug_example_policy; "
        "assert 'torch' not in sys.modules, 'torch imported'; "
        "from importlib.metadata import requires; "
        "print(sorted(r.split('>')[0].split('<')[0] for r in requires('kvplug-hookspecs')))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "['pluggy', 'pydantic']"


def test_candidate_stats_is_public_and_defaults_features_to_unknown():
    c = hs.CandidateStats(7, priority=2, num_tokens=16)
    assert (c.last_access_time, c.creation_time, c.priority, c.num_tokens) == (7, 7, 2, 16)
    assert (c.depth, c.namespace, c.content_id, c.partial_page, c.new_tokens, c.turn) == (
        0,
        None,
        0,
        False,
        0,
        -1,
    )
    assert hs.CandidateStats().node_id > c.node_id  # unique, increasing ids break ties
