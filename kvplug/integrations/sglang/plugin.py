"""SGLang's ``sglang.srt.plugins`` entry point: register the ``kvplug`` radix-cache backend.

SGLang calls :func:`register` in every process before it parses its flags, so the backend name
and the ``kvplug_<policy>`` choices exist when ``--radix-cache-backend kvplug
--radix-eviction-policy kvplug_slru`` is parsed. Registering selects nothing: SGLang builds its
default cache unless the flag names ``kvplug``.
"""

from __future__ import annotations

import importlib.metadata
import logging
from typing import Any

from .config import (
    BACKEND_NAME,
    UnsupportedSGLangError,
    check_sglang_version,
    kvplug_policy_choices,
)

__all__ = ["create_backend", "register"]

logger = logging.getLogger(__name__)


def register() -> bool:
    """Register the backend and the policy names with SGLang; returns whether it did.

    On an unsupported SGLang release it logs one error and registers nothing, so the engine
    still starts with its own caches and ``--radix-cache-backend kvplug`` is rejected by SGLang's
    parser instead of running on an API kvplug was not built for.
    """
    try:
        check_sglang_version(importlib.metadata.version("sglang"))
    except (UnsupportedSGLangError, importlib.metadata.PackageNotFoundError) as exc:
        logger.error("kvplug: not registering the SGLang backend: %s", exc)
        return False
    from sglang.srt.arg_groups.choices import RADIX_EVICTION_POLICY_CHOICES
    from sglang.srt.mem_cache.registry import (
        register_radix_cache_backend,
        registered_radix_cache_backends,
    )

    if BACKEND_NAME not in registered_radix_cache_backends():
        register_radix_cache_backend(BACKEND_NAME, create_backend)
    new = [c for c in kvplug_policy_choices() if c not in RADIX_EVICTION_POLICY_CHOICES]
    RADIX_EVICTION_POLICY_CHOICES.extend(new)
    return True


def create_backend(ctx: Any) -> Any:
    """SGLang's radix-cache factory: a kvplug cache over SGLang's own allocator and pools."""
    from .backend import KvplugPrefixCache

    return KvplugPrefixCache.from_build_context(ctx)
