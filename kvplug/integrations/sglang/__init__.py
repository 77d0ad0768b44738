"""kvplug inside SGLang: a kvplug prefix cache and eviction policy as SGLang's radix cache.

``pip install kvplug`` installs the ``sglang.srt.plugins`` entry point (:func:`register`), then::

    python -m sglang.launch_server ... --radix-cache-backend kvplug \\
        --radix-eviction-policy kvplug_slru --radix-eviction-policy-config '{"protected_hits": 3}'

builds kvplug's ``radix`` cache (or ``block_hash`` with ``KVPLUG_SGLANG=block_hash``) over
SGLang's own token allocator and request-to-token pool. Importing this package does not import
SGLang; supported: ``sglang>=0.5.22,<0.5.24``.
"""

from __future__ import annotations

from .config import (
    BACKEND_NAME,
    ENV_VAR,
    POLICY_PREFIX,
    SUPPORTED_SGLANG,
    SGLangPluginConfig,
    UnsupportedSGLangError,
    check_sglang_version,
    plugin_config,
    sglang_version_supported,
)
from .plugin import create_backend, register

__all__ = [
    "BACKEND_NAME",
    "ENV_VAR",
    "POLICY_PREFIX",
    "SUPPORTED_SGLANG",
    "SGLangPluginConfig",
    "UnsupportedSGLangError",
    "check_sglang_version",
    "create_backend",
    "plugin_config",
    "register",
    "sglang_version_supported",
]
