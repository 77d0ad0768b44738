"""kvplug inside vLLM: a kvplug eviction policy chooses which free cached block vLLM reuses.

* GPU prefix cache: ``--additional-config '{"kvplug": {"eviction_policy": "slru"}}'`` (or
  ``KVPLUG_VLLM=slru``) with the ``vllm.general_plugins`` entry point installed by
  ``pip install kvplug`` (:mod:`.plugin`, :mod:`.block_pool`).
* CPU-offload tier: ``"eviction_policy": "kvplug_slru"`` (or ``"KvplugCachePolicy"``) with
  ``"cache_policy_module_path": "kvplug.integrations.vllm.offload"`` (:mod:`.offload`).

Importing this package does not import vLLM; supported: ``vllm>=0.33,<0.35``.
"""

from __future__ import annotations

from .config import (
    ADDITIONAL_CONFIG_KEY,
    ENV_VAR,
    SUPPORTED_VLLM,
    UnsupportedVllmError,
    VllmPluginConfig,
    check_vllm_version,
    selected_config,
)
from .plugin import activate, register

__all__ = [
    "ADDITIONAL_CONFIG_KEY",
    "ENV_VAR",
    "SUPPORTED_VLLM",
    "UnsupportedVllmError",
    "VllmPluginConfig",
    "activate",
    "check_vllm_version",
    "register",
    "selected_config",
]
