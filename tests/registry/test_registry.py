"""Hook-level tests of the registry: a fresh plugin manager per test, tiny explicit plugins."""

from __future__ import annotations

import logging

import pytest
from pydantic import ValidationError

from kvplug import hookimpl
from kvplug.registry import (
    DuplicateComponentError,
    PluginError,
    PluginRegistry,
    UnknownComponentError,
    env_flag,
)
from kvplug_hookspecs import (
    ComponentSelection,
    EvictionPolicyRegistration,
    FrozenModel,
    KeyedEvictionPolicy,
    KVCacheConfig,
    PrefixStored,
)


class _Options(FrozenModel):
    weight: int = 1


class _Policy(KeyedEvictionPolicy):
    def key(self, c):
        return c.last_access_time


def _policy_plugin(*names, aliases=()):
    class Plugin:
        @hookimpl
        def kvplug_eviction_policies(self):
            return [
                EvictionPolicyRegistration(
                    name=n,
                    factory=_Policy,
                    options_model=_Options,
                    description=f"{n} policy",
                    aliases=aliases,
                )
                for n in names
            ]

    return Plugin()


@pytest.fixture
def registry():
    return PluginRegistry()


def test_registration_hooks_are_flattened_across_plugins(registry):
    registry.register(_policy_plugin("alpha", "beta"), name="one")
    registry.register(_policy_plugin("gamma", aliases=("g",)), name="two")
    names = [reg.name for reg in registry.registrations("eviction_policy")]
    assert names == ["alpha", "beta", "gamma"]
    assert registry.get("eviction_policy", "G").name == "gamma"
    assert registry.provider("eviction_policy", "gamma") == "two"
    infos = {info.name: info.provides["eviction_policy"] for info in registry.plugin_infos()}
    assert infos == {"one": ("alpha", "beta"), "two": ("gamma",)}


def test_unknown_name_lists_every_valid_name_and_suggests_one(registry):
    registry.register(_policy_plugin("lru", "lfu", "fifo"), name="p")
    with pytest.raises(UnknownComponentError) as info:
        registry.get("eviction_policy", "lruu")
    assert str(info.value) == (
        "unknown eviction policy 'lruu'. Did you mean 'lru'? "
        "Valid eviction policies: fifo, lfu, lru"
    )
    with pytest.raises(UnknownComponentError, match=r"Valid allocators: \(none registered\)"):
        registry.get("allocator", "standard")


def test_duplicate_names_name_both_providers(registry):
    registry.register(_policy_plugin("lru"), name="first")
    registry.register(_policy_plugin("other", aliases=("lru",)), name="second")
    with pytest.raises(DuplicateComponentError) as info:
        registry.collect()
    assert "eviction policy 'lru' is provided by two plugins: 'first' and 'second'" in str(
        info.value
    )
    assert "KVPLUG_BLOCK_PLUGINS=second" in str(info.value)


def test_a_raising_hookimpl_is_reported_and_the_others_still_register(registry, caplog):
    class Exploding:
        @hookimpl
        def kvplug_eviction_policies(self):
            raise RuntimeError("boom")

    registry.register(_policy_plugin("good"), name="good")
    registry.register(Exploding(), name="exploding")
    with caplog.at_level(logging.WARNING, logger="kvplug.registry"):
        assert [r.name for r in registry.registrations("eviction_policy")] == ["good"]
    (failure,) = registry.failures
    assert (failure.name, failure.stage, failure.error) == (
        "exploding",
        "hook kvplug_eviction_policies()",
        "RuntimeError: boom",
    )
    assert (
        "plugin 'exploding' failed at hook kvplug_eviction_policies(): RuntimeError: boom"
        in caplog.text
    )


def test_strict_mode_raises_for_a_raising_hookimpl():
    registry = PluginRegistry(strict=True)

    class Exploding:
        @hookimpl
        def kvplug_eviction_policies(self):
            raise RuntimeError("boom")

    registry.register(Exploding(), name="exploding")
    with pytest.raises(
        PluginError, match="plugin 'exploding' failed at hook kvplug_eviction_policies"
    ):
        registry.collect()


def test_wrong_return_type_is_a_failure(registry):
    class Wrong:
        @hookimpl
        def kvplug_eviction_policies(self):
            return ["lru"]

    registry.register(Wrong(), name="wrong")
    assert registry.registrations("eviction_policy") == []
    assert registry.failures[0].error == (
        "TypeError: kvplug_eviction_policies() returned 'lru'; expected EvictionPolicyRegistration"
    )


def test_misspelt_hookimpl_is_caught_by_check_pending(registry):
    class Misspelt:
        @hookimpl
        def kvplug_eviction_policy(self):
            return []

    registry.register(Misspelt(), name="misspelt")
    registry.load_entrypoints(allow=[])
    assert not registry.has_plugin("misspelt")
    (failure,) = registry.failures
    assert failure.stage == "validation"
    assert "unknown hook 'kvplug_eviction_policy' in plugin 'misspelt'" in failure.error
    assert "did you mean 'kvplug_eviction_policies'?" in failure.error


def test_misspelt_hookimpl_raises_in_strict_mode():
    registry = PluginRegistry(strict=True)

    class Misspelt:
        @hookimpl
        def kvplug_eviction_policy(self):
            return []

    registry.register(Misspelt(), name="misspelt")
    with pytest.raises(PluginError, match="unknown hook 'kvplug_eviction_policy'"):
        registry.load_entrypoints(allow=[])


def test_resolve_validates_options_with_the_plugins_model(registry):
    registry.register(_policy_plugin("weighted"), name="p")
    resolved = registry.resolve(
        "eviction_policy", ComponentSelection(name="weighted", options={"weight": 3})
    )
    assert resolved.options == _Options(weight=3)
    with pytest.raises(ValidationError) as info:
        registry.resolve(
            "eviction_policy", ComponentSelection(name="weighted", options={"wieght": 3})
        )
    (error,) = info.value.errors()
    assert error["loc"] == ("eviction_policy", "options", "wieght")
    assert error["type"] == "extra_forbidden"


def test_collect_runs_registration_hooks_once_until_a_plugin_changes(registry):
    calls = []

    class Counting:
        @hookimpl
        def kvplug_eviction_policies(self):
            calls.append(1)
            return []

    registry.register(Counting(), name="counting")
    registry.collect()
    registry.collect()
    assert len(calls) == 1
    registry.register(_policy_plugin("x"), name="x")
    registry.collect()
    assert len(calls) == 2


def test_builtins_register_under_module_names_and_can_be_blocked():
    registry = PluginRegistry().load_plugins(autoload=False, block=["kvplug.plugins.policies"])
    assert registry.has_plugin("kvplug.plugins.allocators")
    assert not registry.has_plugin("kvplug.plugins.policies")
    assert registry.registrations("eviction_policy") == []


def test_builtins_provide_the_default_components():
    registry = PluginRegistry().load_plugins(autoload=False)
    assert registry.failures == []
    assert {r.name for r in registry.registrations("allocator")} == {"standard", "paged", "swa"}
    assert {r.name for r in registry.registrations("prefix_cache")} == {
        "radix",
        "swa_radix",
        "block_hash",
        "chunk",
    }
    assert {"lru", "lfu", "fifo", "mru", "filo", "priority", "slru"} <= {
        r.name for r in registry.registrations("eviction_policy")
    }
    resolved = registry.resolve_config(KVCacheConfig())
    assert resolved.as_dict()["eviction_policy"] == {"name": "lru", "options": {}}


def test_observer_sink_is_none_without_observers_and_forwards_with_them(registry, caplog):
    assert registry.cache_events() is None
    seen = []

    class Observer:
        @hookimpl
        def kvplug_prefix_stored(self, event):
            seen.append(event)

    class Faulty:
        @hookimpl
        def kvplug_prefix_stored(self, event):
            raise RuntimeError("observer bug")

    registry.register(Observer(), name="observer")
    sink = registry.cache_events()
    event = PrefixStored(cache="radix", num_tokens=4)
    sink.prefix_stored(event)
    sink.prefix_removed(event)  # no implementation: a no-op
    assert seen == [event]
    registry.register(Faulty(), name="faulty")
    with caplog.at_level(logging.ERROR, logger="kvplug.registry"):
        registry.cache_events().prefix_stored(event)
    assert len(seen) == 2 and "Faulty.kvplug_prefix_stored failed" in caplog.text


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("1", True),
        ("true", True),
        ("YES", True),
        ("on", True),
        ("0", False),
        ("false", False),
        ("", False),
        ("off", False),
    ],
)
def test_env_flag_is_a_real_boolean(raw, expected):
    assert env_flag("X", {"X": raw}) is expected
    assert env_flag("X", {}) is False


def test_env_flag_rejects_garbage():
    with pytest.raises(ValueError, match=r"KVPLUG_STRICT_PLUGINS='maybe' is not a boolean"):
        env_flag("KVPLUG_STRICT_PLUGINS", {"KVPLUG_STRICT_PLUGINS": "maybe"})
