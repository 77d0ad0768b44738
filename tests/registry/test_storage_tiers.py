"""Storage tiers through the registry and the config: names, options, refusals."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

import kvplug
from kvplug.errors import ConfigError, UnknownComponentError
from kvplug.registry import PluginRegistry
from kvplug_hookspecs import KVCacheConfig

POOL = {"capacity_tokens": 64, "page_size": 4, "device": "cpu", "dtype": "float32"}


def config(tiers: list, cache: str = "radix", **storage: object) -> dict:
    return {
        "allocator": "paged",
        "prefix_cache": cache,
        "pool": POOL,
        "storage": {"tiers": tiers, **storage},
    }


def test_the_built_in_tiers_are_registered_with_their_aliases() -> None:
    registry = PluginRegistry()
    registry.load_plugins(autoload=False)
    names = [r.name for r in registry.registrations("storage_tier")]
    assert names == ["disk", "host", "memory", "redis"]
    assert registry.get("storage_tier", "cpu").name == "host"
    assert registry.get("storage_tier", "valkey").name == "redis"
    info = next(i for i in registry.plugin_infos() if i.name == "kvplug.plugins.tiers")
    assert info.provides["storage_tier"] == ("disk", "host", "memory", "redis")


def test_an_unknown_tier_lists_the_valid_ones() -> None:
    with pytest.raises(UnknownComponentError, match="disk, host, memory, redis"):
        kvplug.build(config(["tape"]))


def test_bad_tier_options_name_the_tier_and_field() -> None:
    with pytest.raises(ValidationError) as info:
        kvplug.build(config([{"name": "host", "options": {"capacity_tokens": -1}}]))
    assert info.value.errors()[0]["loc"][:4] == ("storage", "tiers", 0, "options")


def test_a_tier_listed_twice_is_refused() -> None:
    with pytest.raises(ValidationError, match="storage tier 'host' is listed twice"):
        KVCacheConfig.model_validate(config(["host", "host"]))


def test_a_cache_without_tiers_is_refused_before_anything_is_built() -> None:
    with pytest.raises(ConfigError, match="'chunk' does not use storage tiers: it neither"):
        kvplug.build(config(["host"], cache="chunk"))
    swa = {
        **config(["host"], cache="swa_radix"),
        "allocator": {
            "name": "swa",
            "options": {"swa_capacity_tokens": 32, "sliding_window_size": 8},
        },
    }
    with pytest.raises(ConfigError, match="'swa_radix' is left out because a prefix loaded"):
        kvplug.build(swa)


def test_no_tiers_means_no_hierarchy() -> None:
    stack = kvplug.build(config([]))
    assert stack.storage is None
    assert stack.prefix_cache.match_prefix(list(range(8))).tier_tokens == ()


def test_the_namespace_separates_models_and_geometries() -> None:
    a = kvplug.build(config(["host"], model_id="a")).storage
    b = kvplug.build(config(["host"], model_id="b")).storage
    c = kvplug.build({**config(["host"], model_id="a"), "pool": {**POOL, "head_dim": 32}}).storage
    assert a is not None and b is not None and c is not None
    assert len({a.namespace.id, b.namespace.id, c.namespace.id}) == 3
    assert a.namespace.hash_function == "kvplug-sha256"
