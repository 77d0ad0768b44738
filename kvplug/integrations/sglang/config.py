"""What the SGLang adapter is told, and which SGLang releases it supports.

Nothing here imports SGLang or torch. The eviction policy comes from SGLang's own flags
(``--radix-eviction-policy kvplug_<name>`` and ``--radix-eviction-policy-config '{...}'``); the
cache kind (``radix`` or ``block_hash``) and its options from the ``KVPLUG_SGLANG`` environment
variable, so SGLang's parser needs no new flag. Every value is validated by kvplug's Pydantic
models and registry before the engine serves anything.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from typing import Any, Literal

from pydantic import Field

from kvplug_hookspecs import ComponentSelection, EvictionPolicy, FrozenModel

from ...errors import ConfigError, KvplugError
from ..versions import release_tuple

__all__ = [
    "BACKEND_NAME",
    "ENV_VAR",
    "POLICY_PREFIX",
    "SUPPORTED_SGLANG",
    "SGLangPluginConfig",
    "UnsupportedSGLangError",
    "check_sglang_version",
    "kvplug_policy_choices",
    "plugin_config",
    "policy_factory",
    "policy_selection",
    "sglang_version_supported",
]

BACKEND_NAME = "kvplug"
"""The ``--radix-cache-backend`` name the adapter registers."""
POLICY_PREFIX = "kvplug_"
"""``--radix-eviction-policy kvplug_<name>`` selects kvplug's policy ``<name>``."""
ENV_VAR = "KVPLUG_SGLANG"
SUPPORTED_SGLANG = ">=0.5.22,<0.5.24"
_MIN, _MAX = (0, 5, 22), (0, 5, 24)


class UnsupportedSGLangError(KvplugError):
    """The kvplug backend was selected with an SGLang feature or release it does not support."""


class SGLangPluginConfig(FrozenModel):
    """What ``KVPLUG_SGLANG`` may hold (a JSON object, or just a cache name).

    ``prefix_cache``: ``radix`` (default; SGLang's tree semantics) or ``block_hash``
    (vLLM-style hash-chained pages). ``cache_options`` are validated by that cache's model.
    """

    prefix_cache: Literal["radix", "block_hash"] = "radix"
    cache_options: dict[str, Any] = Field(default_factory=dict)


def plugin_config(environ: Mapping[str, str] | None = None) -> SGLangPluginConfig:
    """The adapter's configuration from ``KVPLUG_SGLANG`` (defaults when unset)."""
    environ = os.environ if environ is None else environ
    text = environ.get(ENV_VAR, "").strip()
    if not text:
        return SGLangPluginConfig()
    raw: Any = text
    if text[0] in '{"':
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{ENV_VAR} is not valid JSON: {exc}") from None
    if isinstance(raw, str):
        raw = {"prefix_cache": raw}
    return SGLangPluginConfig.model_validate(raw)


def kvplug_policy_choices() -> list[str]:
    """``kvplug_<name>`` for every eviction policy in kvplug's registry (plugins included)."""
    from ...registry import get_registry

    names = [r.name for r in get_registry().registrations("eviction_policy")]
    return [POLICY_PREFIX + name for name in sorted(names)]


def policy_selection(policy: str, options: Mapping[str, Any] | None) -> ComponentSelection:
    """The kvplug policy an SGLang ``--radix-eviction-policy`` value names.

    ``kvplug_<name>`` selects ``<name>``; SGLang's default ``lru`` selects kvplug's ``lru``
    (same meaning). Any other SGLang policy is refused: its kvplug namesake may read its options
    differently, so the operator has to say ``kvplug_<name>``.
    """
    choices = kvplug_policy_choices()
    if policy.startswith(POLICY_PREFIX):
        name = policy[len(POLICY_PREFIX) :]
    elif policy == "lru":
        name = "lru"
    else:
        raise UnsupportedSGLangError(
            f"--radix-cache-backend {BACKEND_NAME} runs kvplug policies; "
            f"--radix-eviction-policy {policy!r} is an SGLang policy. Choose one of: "
            f"{', '.join(choices)}."
        )
    if POLICY_PREFIX + name not in choices:
        raise UnsupportedSGLangError(
            f"unknown kvplug eviction policy {policy!r}; valid: {', '.join(choices)}."
        )
    return ComponentSelection(name=name, options=dict(options or {}))


def policy_factory(selection: ComponentSelection) -> Callable[[], EvictionPolicy]:
    """A factory of fresh policies; the registry validates the options by the policy's model."""
    from ...registry import get_registry

    return get_registry().policy_factory(selection)


def sglang_version_supported(version: str) -> bool:
    """Whether an SGLang version string is in :data:`SUPPORTED_SGLANG`."""
    release = release_tuple(version, 3)
    return release is not None and _MIN <= release < _MAX


def check_sglang_version(version: str) -> None:
    """Refuse, naming the supported range, an SGLang release whose cache API differs."""
    if not sglang_version_supported(version):
        raise UnsupportedSGLangError(
            f"kvplug's SGLang backend supports sglang{SUPPORTED_SGLANG}, found sglang "
            f"{version}: the prefix-cache API (checkpoint, lock receipts) differs in other "
            "releases. Install a supported SGLang or uninstall kvplug's plugin."
        )
