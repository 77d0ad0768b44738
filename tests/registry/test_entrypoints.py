"""The entry-point path end to end: discovery, allow/block lists, broken plugins, selection."""

from __future__ import annotations

import pytest

import kvplug
from kvplug.registry import PluginError, PluginRegistry, UnknownComponentError, get_registry
from tests.conftest import MISSPELT_HOOK, RAISING_HOOK, write_distribution


def _load(**env):
    return PluginRegistry().load_plugins(environ=env)


def test_example_plugin_is_discovered_with_its_distribution():
    registry = _load()
    assert registry.has_plugin("example_policy")
    info = {i.name: i for i in registry.plugin_infos()}["example_policy"]
    assert (info.distribution, info.version, info.builtin) == (
        "kvplug-example-policy",
        "0.1.0",
        False,
    )
    assert info.provides["eviction_policy"] == ("largest_first",)
    assert (
        registry.get("eviction_policy", "largest_first").options_model.__name__
        == "LargestFirstOptions"
    )


def test_empty_allow_list_hides_every_entry_point_plugin(plugin_site):
    registry = _load(KVPLUG_PLUGINS="")
    assert not registry.has_plugin("example_policy")
    assert registry.skipped == {
        "example_policy": "not in KVPLUG_PLUGINS",
        "broken": "not in KVPLUG_PLUGINS",
        "extra": "not in KVPLUG_PLUGINS",
    }
    with pytest.raises(UnknownComponentError, match="unknown eviction policy 'largest_first'"):
        registry.get("eviction_policy", "largest_first")
    assert registry.has_plugin("kvplug.plugins.policies")  # built-ins are not entry points


def test_allow_list_keeps_only_the_named_plugins(plugin_site):
    registry = _load(KVPLUG_PLUGINS="extra, example_policy")
    assert registry.has_plugin("extra") and registry.has_plugin("example_policy")
    assert not registry.has_plugin("broken") and registry.failures == []


def test_block_list_and_disabled_autoload(plugin_site):
    blocked = _load(KVPLUG_BLOCK_PLUGINS="example_policy,broken")
    assert not blocked.has_plugin("example_policy") and blocked.has_plugin("extra")
    assert blocked.skipped == {"example_policy": "blocked", "broken": "blocked"}
    for value in ("1", "true"):
        off = _load(KVPLUG_DISABLE_PLUGIN_AUTOLOAD=value)
        assert not off.has_plugin("example_policy") and not off.has_plugin("extra")
    for value in ("0", "false"):
        on = _load(KVPLUG_DISABLE_PLUGIN_AUTOLOAD=value, KVPLUG_PLUGINS="example_policy")
        assert on.has_plugin("example_policy")


def test_a_broken_plugin_is_reported_and_the_others_still_load(plugin_site):
    registry = _load()
    assert registry.has_plugin("example_policy") and registry.has_plugin("extra")
    (failure,) = registry.failures
    assert (failure.name, failure.distribution, failure.version) == (
        "broken",
        "kvplug-broken",
        "0.0.1",
    )
    assert failure.stage == "import of 'kvplug_broken_mod'"
    assert failure.error == "RuntimeError: this plugin is broken on purpose"
    assert "newest_first" in {r.name for r in registry.registrations("eviction_policy")}
    with pytest.raises(
        UnknownComponentError, match=r"plugins that failed to load: broken; see `kvplug plugins`"
    ):
        registry.get("eviction_policy", "nope")


def test_strict_mode_turns_a_broken_plugin_into_an_error(plugin_site, monkeypatch):
    with pytest.raises(
        PluginError, match=r"plugin 'broken' \(distribution kvplug-broken 0.0.1\) failed at import"
    ):
        PluginRegistry(strict=True).load_plugins(environ={})
    monkeypatch.setenv("KVPLUG_STRICT_PLUGINS", "1")
    with pytest.raises(PluginError, match="plugin 'broken'"):
        get_registry()


def test_entry_point_whose_hook_raises_or_is_misspelt(tmp_path, monkeypatch):
    write_distribution(
        tmp_path,
        "kvplug-raising",
        "1.0",
        {"raising": "kvplug_raising_mod"},
        {"kvplug_raising_mod": RAISING_HOOK},
    )
    write_distribution(
        tmp_path,
        "kvplug-typo",
        "1.0",
        {"typo": "kvplug_typo_mod"},
        {"kvplug_typo_mod": MISSPELT_HOOK},
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    registry = _load()
    failures = {f.name: f for f in registry.failures}
    assert failures["raising"].stage == "hook kvplug_eviction_policies()"
    assert failures["raising"].distribution == "kvplug-raising"
    assert failures["typo"].stage == "validation"
    assert "did you mean 'kvplug_eviction_policies'" in failures["typo"].error
    assert not registry.has_plugin("typo") and registry.has_plugin("example_policy")


def test_example_policy_is_selectable_by_config_through_build():
    stack = kvplug.build(
        {
            "eviction_policy": {"name": "largest_first", "options": {"tie_break": "fifo"}},
            "pool": {
                "capacity_tokens": 64,
                "num_layers": 1,
                "kv_heads": 1,
                "head_dim": 8,
                "device": "cpu",
            },
        }
    )
    policy = stack.new_policy()
    assert type(policy).__name__ == "LargestFirstPolicy"
    assert policy.options.tie_break == "fifo" and policy.touch_changes_key is False


def test_unknown_policy_in_config_lists_the_valid_ones():
    with pytest.raises(UnknownComponentError) as info:
        kvplug.build({"eviction_policy": "lruu", "pool": {"capacity_tokens": 64, "device": "cpu"}})
    message = str(info.value)
    assert message.startswith(
        "unknown eviction policy 'lruu'. Did you mean 'lru'? Valid eviction policies: "
    )
    for name in ("fifo", "filo", "largest_first", "lfu", "lru", "mru", "priority", "slru"):
        assert name in message
