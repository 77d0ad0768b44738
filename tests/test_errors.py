"""Every error kvplug raises on purpose has one root, ``KvplugError``."""

from __future__ import annotations

import pytest

import kvplug
from kvplug.errors import (
    ConfigError,
    DuplicateComponentError,
    KvplugError,
    PluginError,
    UnknownComponentError,
)


@pytest.mark.parametrize(
    "error", [ConfigError, PluginError, DuplicateComponentError, UnknownComponentError]
)
def test_every_error_derives_from_the_root(error):
    assert issubclass(error, KvplugError)
    assert getattr(kvplug, error.__name__) is error


def test_unknown_component_lists_valid_names_and_keeps_lookup_error_semantics():
    with pytest.raises(LookupError) as info:
        kvplug.build({"eviction_policy": "lruu"})
    assert isinstance(info.value, KvplugError)
    assert "Did you mean 'lru'?" in str(info.value)
