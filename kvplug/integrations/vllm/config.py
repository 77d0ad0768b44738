"""Whether kvplug is selected inside vLLM, with which policy, and which vLLM versions it supports.

Nothing here imports vLLM or torch: the selection is read from ``--additional-config`` (the
``"kvplug"`` key of ``VllmConfig.additional_config``) or from the ``KVPLUG_VLLM`` environment
variable, validated by Pydantic models, and the policy named in it by kvplug's registry, so a
bad value stops the engine at start-up with a message naming the field or listing valid names.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from typing import Any

from pydantic import StrictBool

from kvplug_hookspecs import ComponentSelection, EvictionPolicy, FrozenModel

from ...errors import ConfigError, KvplugError
from ..versions import release_tuple

__all__ = [
    "ADDITIONAL_CONFIG_KEY",
    "ENV_VAR",
    "SUPPORTED_VLLM",
    "UnsupportedVllmError",
    "VllmPluginConfig",
    "check_vllm_version",
    "policy_factory",
    "selected_config",
    "vllm_version_supported",
]

ADDITIONAL_CONFIG_KEY = "kvplug"
ENV_VAR = "KVPLUG_VLLM"
SUPPORTED_VLLM = ">=0.33,<0.35"
_MIN, _MAX = (0, 33), (0, 35)


class UnsupportedVllmError(KvplugError):
    """kvplug was selected on a vLLM release outside the supported range."""


class VllmPluginConfig(FrozenModel):
    """What ``{"kvplug": {...}}`` in ``--additional-config`` (or ``KVPLUG_VLLM``) may hold.

    ``eviction_policy`` ranks the GPU block pool's free cached blocks; ``offload_eviction_policy``
    ranks the CPU-offload tier's chunks when its ``KvplugCachePolicy`` is used (the GPU policy
    when unset). Each is a name or ``{"name": ..., "options": {...}}``; options are validated by
    the policy's own model. ``chain_protection`` offers the policy only chain leaves (blocks
    whose successor is not cached) in full-attention groups; unset, it is on for every policy
    but ``lru``, which then keeps vLLM's own order whatever order blocks are freed in.
    """

    eviction_policy: ComponentSelection = ComponentSelection(name="lru")
    offload_eviction_policy: ComponentSelection | None = None
    chain_protection: StrictBool | None = None


def selected_config(
    additional_config: Any = None, environ: Mapping[str, str] | None = None
) -> VllmPluginConfig | None:
    """The kvplug selection of one engine, or ``None`` when kvplug is not selected.

    ``additional_config["kvplug"]`` wins over ``KVPLUG_VLLM``. Either may be a policy name
    (``"slru"``) or an object of :class:`VllmPluginConfig` fields. Policy names and options are
    checked here too, so every mistake is reported before the engine starts.
    """
    environ = os.environ if environ is None else environ
    raw: Any = None
    if isinstance(additional_config, Mapping) and ADDITIONAL_CONFIG_KEY in additional_config:
        raw = additional_config[ADDITIONAL_CONFIG_KEY]
    elif environ.get(ENV_VAR, "").strip():
        text = environ[ENV_VAR].strip()
        try:
            raw = json.loads(text) if text[0] in '{"' else text
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{ENV_VAR} is not valid JSON: {exc}") from None
    else:
        return None
    if isinstance(raw, str):
        raw = {"eviction_policy": raw}
    config = VllmPluginConfig.model_validate(raw)
    policy_factory(config.eviction_policy)
    if config.offload_eviction_policy is not None:
        policy_factory(config.offload_eviction_policy)
    return config


def policy_factory(selection: ComponentSelection) -> Callable[[], EvictionPolicy]:
    """A factory of fresh policies for a selection, resolved and validated by the registry."""
    from ...registry import get_registry

    return get_registry().policy_factory(selection)


def vllm_version_supported(version: str) -> bool:
    """Whether a vLLM version string is in :data:`SUPPORTED_VLLM` (pre-releases included)."""
    release = release_tuple(version, 2)
    return release is not None and _MIN <= release < _MAX


def check_vllm_version(version: str) -> None:
    """Refuse, with the supported range in the message, a vLLM release kvplug was not built on."""
    if not vllm_version_supported(version):
        raise UnsupportedVllmError(
            f"kvplug's vLLM adapter supports vllm{SUPPORTED_VLLM}, found vllm {version}: the "
            f"block pool and offload-policy APIs it hooks differ in other releases. Install a "
            f"supported vLLM or remove the kvplug selection ({ENV_VAR} / --additional-config "
            f"'{{\"{ADDITIONAL_CONFIG_KEY}\": ...}}')."
        )
