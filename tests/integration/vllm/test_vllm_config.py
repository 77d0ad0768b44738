"""The vLLM adapter's selection and version checks: no vLLM needed (part of the default run)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from kvplug.errors import ConfigError, UnknownComponentError
from kvplug.integrations.vllm import (
    UnsupportedVllmError,
    check_vllm_version,
    selected_config,
)
from kvplug.integrations.vllm.config import vllm_version_supported


def test_not_selected_without_config_or_env() -> None:
    assert selected_config({}, environ={}) is None
    assert selected_config({"other_plugin": 1}, environ={"KVPLUG_VLLM": " "}) is None


def test_additional_config_selects_and_validates_options() -> None:
    config = selected_config(
        {"kvplug": {"eviction_policy": {"name": "slru", "options": {"protected_hits": 3}}}},
        environ={},
    )
    assert config is not None
    assert config.eviction_policy.name == "slru"
    assert config.eviction_policy.options == {"protected_hits": 3}
    assert config.offload_eviction_policy is None


def test_chain_protection_is_optional_and_strict() -> None:
    assert selected_config({"kvplug": "lru"}, environ={}).chain_protection is None  # type: ignore[union-attr]
    config = selected_config({"kvplug": {"chain_protection": True}}, environ={})
    assert config is not None and config.chain_protection is True
    with pytest.raises(ValidationError, match="chain_protection"):
        selected_config({"kvplug": {"chain_protection": "yes"}}, environ={})


def test_additional_config_wins_over_env() -> None:
    config = selected_config({"kvplug": "lfu"}, environ={"KVPLUG_VLLM": "fifo"})
    assert config is not None and config.eviction_policy.name == "lfu"


@pytest.mark.parametrize(
    ("value", "name"),
    [("slru", "slru"), ('{"eviction_policy": "lfu"}', "lfu"), ('"mru"', "mru")],
)
def test_env_selects(value: str, name: str) -> None:
    config = selected_config(None, environ={"KVPLUG_VLLM": value})
    assert config is not None and config.eviction_policy.name == name


def test_bad_values_name_the_problem() -> None:
    with pytest.raises(UnknownComponentError, match="Valid eviction policies: .*lru"):
        selected_config({"kvplug": "no_such_policy"}, environ={})
    with pytest.raises(ValidationError, match="protected_hits"):
        selected_config(
            {"kvplug": {"eviction_policy": {"name": "slru", "options": {"protected_hits": 0}}}},
            environ={},
        )
    with pytest.raises(ValidationError, match="unknown_field"):
        selected_config({"kvplug": {"unknown_field": 1}}, environ={})
    with pytest.raises(ConfigError, match="KVPLUG_VLLM is not valid JSON"):
        selected_config(None, environ={"KVPLUG_VLLM": "{bad"})


@pytest.mark.parametrize(
    ("version", "ok"),
    [
        ("0.33.0", True),
        ("0.34.0", True),
        ("0.34.2rc1.dev7+gabc", True),
        ("0.32.9", False),
        ("0.35.0", False),
        ("1.0.0", False),
        ("dev", False),
        ("not installed", False),
    ],
)
def test_supported_versions(version: str, ok: bool) -> None:
    assert vllm_version_supported(version) is ok
    if ok:
        check_vllm_version(version)
    else:
        with pytest.raises(UnsupportedVllmError, match=r"vllm>=0\.33,<0\.35"):
            check_vllm_version(version)
