"""Everything the kvplug backend does not run is refused at start-up, one message each."""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("sglang.srt.mem_cache.registry")

from pydantic import ValidationError

from kvplug.errors import ConfigError
from kvplug.integrations.sglang import UnsupportedSGLangError, register
from kvplug.integrations.sglang.config import (
    plugin_config,
    sglang_version_supported,
)

from .conftest import build_context, parse_server_args

pytestmark = pytest.mark.sglang


def _create(overrides: dict, *flags: str) -> object:
    from sglang.srt.mem_cache.registry import create_tree_cache

    args = parse_server_args("--radix-cache-backend", "kvplug", *flags)
    return create_tree_cache(build_context(args, 64, **overrides))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"is_hybrid_swa": True}, "sliding-window"),
        ({"is_hybrid_ssm": True}, "SSM"),
        ({"is_dsa": True}, "DSA"),
        ({"enable_hierarchical_cache": True}, "HiCache"),
        ({"is_eagle": True}, "EAGLE"),
        ({"enable_kv_cache_events": True, "dynamo_kv_event_format": True}, '"dynamo" KV-event'),
        ({"enable_session_radix_cache": True}, "session"),
        ({"pp_size": 2}, "pipeline"),
    ],
)
def test_unsupported_setups_are_refused(overrides: dict, message: str) -> None:
    with pytest.raises(UnsupportedSGLangError, match=message) as info:
        _create(overrides)
    assert "--radix-cache-backend kvplug does not support" in str(info.value)


def test_an_sglang_policy_name_is_refused_with_the_kvplug_choices() -> None:
    with pytest.raises(UnsupportedSGLangError, match="kvplug_slru"):
        _create({}, "--radix-eviction-policy", "lfu")


def test_a_bad_policy_option_is_refused_by_the_policy_model() -> None:
    with pytest.raises(ValidationError, match="protected_hits"):
        _create(
            {},
            "--radix-eviction-policy",
            "kvplug_slru",
            "--radix-eviction-policy-config",
            '{"protected_hits": 0}',
        )
    with pytest.raises(ValidationError):  # SGLang's default policy is kvplug's lru: no options
        _create({}, "--radix-eviction-policy-config", '{"x": 1}')


def test_a_bad_cache_selection_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVPLUG_SGLANG", "swa_radix")
    with pytest.raises(ValidationError, match="prefix_cache"):
        _create({})
    monkeypatch.setenv("KVPLUG_SGLANG", "{not json")
    with pytest.raises(ConfigError, match="KVPLUG_SGLANG"):
        plugin_config()


def test_block_hash_refuses_dfs_weight_scheduling(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVPLUG_SGLANG", "block_hash")
    with pytest.raises(UnsupportedSGLangError, match="dfs-weight"):
        _create({}, "--schedule-policy", "dfs-weight")


def test_an_unsupported_sglang_release_registers_nothing(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import importlib.metadata

    assert sglang_version_supported("0.5.22") and sglang_version_supported("0.5.23")
    assert not sglang_version_supported("0.5.21") and not sglang_version_supported("0.5.24")
    real = importlib.metadata.version
    monkeypatch.setattr(
        importlib.metadata, "version", lambda name: "0.5.21" if name == "sglang" else real(name)
    )
    with caplog.at_level(logging.ERROR):
        assert register() is False
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "sglang>=0.5.22,<0.5.24" in errors[0].getMessage()


def test_an_unknown_kvplug_policy_lists_the_valid_ones() -> None:
    from kvplug.integrations.sglang.config import policy_selection

    with pytest.raises(UnsupportedSGLangError, match="kvplug_lru, kvplug_mru"):
        policy_selection("kvplug_nope", None)


def test_another_allocator_is_refused() -> None:
    from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.registry import create_tree_cache

    class Custom(TokenToKVPoolAllocator):
        pass

    args = parse_server_args("--radix-cache-backend", "kvplug")
    ctx = build_context(args, 64)
    ctx.params.token_to_kv_pool_allocator.__class__ = Custom
    with pytest.raises(UnsupportedSGLangError, match="Custom allocator"):
        create_tree_cache(ctx)
