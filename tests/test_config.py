"""Config loading: dicts, TOML/JSON files, pyproject.toml, KVPLUG_* variables, precedence."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from pydantic import ValidationError

from kvplug import ConfigError, KVCacheConfig, load_config
from kvplug.config import config_from_env, variable_for

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "configs"


def test_defaults_without_any_source():
    config = load_config(None, environ={})
    assert config == KVCacheConfig()
    assert (config.allocator.name, config.prefix_cache.name, config.eviction_policy.name) == (
        "standard",
        "radix",
        "lru",
    )
    assert config.pool.capacity_tokens == 65536 and config.pool.device == "auto"


def test_from_dict_with_shorthand_names():
    config = load_config(
        {"eviction_policy": "LFU", "pool": {"capacity_tokens": 128, "page_size": 4}}, environ={}
    )
    assert config.eviction_policy.name == "lfu"
    assert (config.pool.capacity_tokens, config.pool.page_size) == (128, 4)


def test_bundled_example_configs_load():
    swa = load_config(EXAMPLES / "swa.toml", environ={})
    assert swa.allocator.name == "swa"
    assert swa.allocator.options == {"swa_capacity_tokens": 16384, "sliding_window_size": 4096}
    paged = load_config(EXAMPLES / "paged_block_hash.toml", environ={})
    assert (paged.pool.page_size, paged.pool.dtype, paged.eviction_policy.options) == (
        16,
        "bfloat16",
        {"protected_hits": 2},
    )
    example = load_config(EXAMPLES / "example_policy.json", environ={})
    assert example.eviction_policy.name == "largest_first" and example.pool.device == "cpu"


def test_pyproject_tool_table(tmp_path):
    path = tmp_path / "pyproject.toml"
    path.write_text('[project]\nname = "x"\n\n[tool.kvplug]\neviction_policy = "fifo"\n')
    assert load_config(path, environ={}).eviction_policy.name == "fifo"


def test_file_errors_name_the_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.toml", environ={})
    bad = tmp_path / "bad.toml"
    bad.write_text("allocator = \n")
    with pytest.raises(ConfigError, match=r"bad.toml' is not valid TOML"):
        load_config(bad, environ={})
    yaml = tmp_path / "c.yaml"
    yaml.write_text("a: 1")
    with pytest.raises(ConfigError, match="unsupported suffix '.yaml'"):
        load_config(yaml, environ={})
    arr = tmp_path / "a.json"
    arr.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="must hold an object"):
        load_config(arr, environ={})


def test_invalid_values_raise_validation_errors_naming_the_field(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"pool": {"capacity_tokens": -5}}))
    with pytest.raises(ValidationError) as info:
        load_config(path, environ={})
    assert info.value.errors()[0]["loc"] == ("pool", "capacity_tokens")
    with pytest.raises(ValidationError) as info:
        load_config({"allocatr": "paged"}, environ={})
    assert info.value.errors()[0]["loc"] == ("allocatr",)


def test_environment_variables():
    env = {
        "KVPLUG_EVICTION_POLICY": "slru",
        "KVPLUG_EVICTION_POLICY_OPTIONS": '{"protected_hits": 4}',
        "KVPLUG_ALLOCATOR": '{"name": "paged"}',
        "KVPLUG_POOL_CAPACITY_TOKENS": "4096",
        "KVPLUG_POOL_PAGE_SIZE": "16",
        "KVPLUG_POOL_DEVICE": "cpu",
        "KVPLUG_PLUGINS": "",  # registry variables are not config fields
    }
    assert config_from_env(env) == {
        "eviction_policy": {"name": "slru", "options": {"protected_hits": 4}},
        "allocator": {"name": "paged"},
        "pool": {"capacity_tokens": 4096, "page_size": 16, "device": "cpu"},
    }
    config = load_config(None, environ=env)
    assert config.eviction_policy.options == {"protected_hits": 4}
    assert (config.allocator.name, config.pool.page_size, config.pool.device) == (
        "paged",
        16,
        "cpu",
    )


def test_environment_overrides_the_file_and_drops_options_of_a_replaced_component():
    env = {"KVPLUG_EVICTION_POLICY": "lru", "KVPLUG_POOL_PAGE_SIZE": "1"}
    config = load_config(EXAMPLES / "paged_block_hash.toml", environ=env)
    assert config.eviction_policy.name == "lru" and config.eviction_policy.options == {}
    assert config.pool.page_size == 1 and config.pool.dtype == "bfloat16"
    same = load_config(
        EXAMPLES / "paged_block_hash.toml", environ={"KVPLUG_EVICTION_POLICY": "slru"}
    )
    assert same.eviction_policy.options == {"protected_hits": 2}
    no_env = load_config(EXAMPLES / "paged_block_hash.toml", environ=env, use_env=False)
    assert no_env.eviction_policy.name == "slru"


def test_environment_errors():
    with pytest.raises(
        ConfigError, match="unknown variable KVPLUG_POOL_CAPACITY; pool fields are: "
    ):
        config_from_env({"KVPLUG_POOL_CAPACITY": "1"})
    with pytest.raises(ConfigError, match="KVPLUG_ALLOCATOR_OPTIONS='3': expected a JSON object"):
        config_from_env({"KVPLUG_ALLOCATOR_OPTIONS": "3"})
    with pytest.raises(ConfigError, match="expected a name or a JSON object"):
        config_from_env({"KVPLUG_ALLOCATOR": "[1]"})


def test_load_config_rejects_other_types():
    with pytest.raises(TypeError, match="cannot load a config from int"):
        load_config(3, environ={})


@pytest.mark.parametrize(
    ("value", "loc", "message"),
    [
        (5, ("eviction_policy",), "got int"),
        (["lru"], ("eviction_policy",), "got list"),
        (None, ("eviction_policy",), "got NoneType"),
        ({"options": {}}, ("eviction_policy", "name"), "Field required"),
        ({"name": 5}, ("eviction_policy", "name"), "valid string"),
        ({"name": "lru", "options": 3}, ("eviction_policy", "options"), "valid dictionary"),
    ],
)
def test_non_string_component_is_a_validation_error_naming_the_field(value, loc, message):
    for env in ({}, {"KVPLUG_POOL_DEVICE": "cpu"}):  # the environment merge must not crash
        with pytest.raises(ValidationError) as info:
            load_config({"eviction_policy": value}, environ=env)
        assert info.value.errors()[0]["loc"] == loc
        assert message in str(info.value)


def test_build_rejects_a_non_string_component(monkeypatch):
    import kvplug

    for var in [v for v in os.environ if v.startswith("KVPLUG_")]:
        monkeypatch.delenv(var)
    with pytest.raises(ValidationError) as info:
        kvplug.build({"eviction_policy": 5})
    assert info.value.errors()[0]["loc"] == ("eviction_policy",)


def test_environment_replaces_a_non_string_component():
    config = load_config({"eviction_policy": 5}, environ={"KVPLUG_EVICTION_POLICY": "fifo"})
    assert config.eviction_policy.name == "fifo"


def test_directory_and_pyproject_without_table_are_errors(tmp_path):
    with pytest.raises(ConfigError, match="is a directory, not a file"):
        load_config(tmp_path, environ={})
    path = tmp_path / "pyproject.toml"
    path.write_text('[project]\nname = "x"\n')
    with pytest.raises(ConfigError, match=r"has no \[tool.kvplug\] table"):
        load_config(path, environ={})
    path.write_text("[tool.ruff]\nline-length = 99\n")
    with pytest.raises(ConfigError, match=r"has no \[tool.kvplug\] table"):
        load_config(path, environ={})
    path.write_text("[tool.kvplug]\n")  # present but empty: the defaults, on purpose
    assert load_config(path, environ={}) == KVCacheConfig()


def test_unreadable_file_is_a_config_error(tmp_path, monkeypatch):
    path = tmp_path / "c.toml"
    path.write_text('allocator = "paged"\n')

    def deny(self, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "read_text", deny)
    with pytest.raises(ConfigError, match=r"c.toml' cannot be read: Permission denied"):
        load_config(path, environ={})


@pytest.mark.parametrize(
    ("var", "raw", "message"),
    [
        ("KVPLUG_POOL_CAPACITY_TOKENS", "abc", "pool.capacity_tokens: Input should be a valid"),
        ("KVPLUG_POOL_DEVICE", "gpu", "pool.device: Value error, unknown device 'gpu'"),
        ("KVPLUG_POOL_DTYPE", "int8", "pool.dtype:"),
        ("KVPLUG_EVICTION_POLICY", '"Not A Name"', "invalid component name"),
        ("KVPLUG_ALLOCATOR", '{"name": "paged", "opts": {}}', "allocator.opts: Extra inputs"),
    ],
)
def test_a_bad_variable_is_named_in_the_error(var, raw, message):
    with pytest.raises(ConfigError) as info:
        load_config(None, environ={var: raw})
    assert str(info.value).startswith(f"{var}={raw!r} is invalid: ")
    assert message in str(info.value)
    assert isinstance(info.value.__cause__, ValidationError)


def test_an_error_of_the_file_is_not_blamed_on_a_variable():
    with pytest.raises(ValidationError) as info:
        load_config({"pool": {"capacity_tokens": -5}}, environ={"KVPLUG_POOL_DEVICE": "cpu"})
    assert info.value.errors()[0]["loc"] == ("pool", "capacity_tokens")


def test_variable_for_names_the_variable_behind_a_field():
    env = {
        "KVPLUG_EVICTION_POLICY": "slru",
        "KVPLUG_ALLOCATOR": '{"name": "paged", "options": {}}',
        "KVPLUG_PREFIX_CACHE_OPTIONS": "{}",
        "KVPLUG_POOL_PAGE_SIZE": "16",
    }
    assert variable_for(("eviction_policy", "name"), env) == "KVPLUG_EVICTION_POLICY"
    assert variable_for(("eviction_policy", "options", "protected_hits"), env) is None
    assert variable_for(("allocator", "options", "x"), env) == "KVPLUG_ALLOCATOR"
    assert variable_for(("prefix_cache", "options", "x"), env) == "KVPLUG_PREFIX_CACHE_OPTIONS"
    assert variable_for(("pool", "page_size"), env) == "KVPLUG_POOL_PAGE_SIZE"
    assert variable_for(("pool", "capacity_tokens"), env) is None
