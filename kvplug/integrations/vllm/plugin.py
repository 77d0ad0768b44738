"""vLLM's general-plugin entry point and the activation of a kvplug policy in the scheduler.

vLLM runs every ``vllm.general_plugins`` entry point in each of its processes at start-up.
``register`` wraps ``Scheduler.__init__`` once; the wrapper does nothing unless kvplug is selected
for that engine (``--additional-config '{"kvplug": ...}'`` or ``KVPLUG_VLLM``). vLLM has no hook
that replaces the GPU prefix cache's eviction order, so this wrapper is the narrowest place that
sees both the engine's config and its ``BlockPool``.
"""

from __future__ import annotations

import functools
import logging
import os
from importlib import metadata
from typing import Any

from .config import (
    ENV_VAR,
    SUPPORTED_VLLM,
    check_vllm_version,
    policy_factory,
    selected_config,
    vllm_version_supported,
)

__all__ = ["activate", "chain_group_ids", "register", "vllm_version"]

log = logging.getLogger(__name__)

_WRAPPED = "__kvplug_wrapped__"


def vllm_version() -> str:
    """The installed vLLM version (from its distribution metadata)."""
    try:
        return metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return "not installed"


def register() -> None:
    """Entry point ``vllm.general_plugins: kvplug``; safe to call many times per process.

    Outside the supported vLLM range it logs one error and stays inactive, unless
    ``KVPLUG_VLLM`` selects kvplug: then it raises, because the operator asked for it.
    """
    version = vllm_version()
    if not vllm_version_supported(version):
        if os.environ.get(ENV_VAR, "").strip():
            check_vllm_version(version)
        log.error(
            "kvplug: vLLM %s is outside the supported range vllm%s; the kvplug eviction "
            "policy will refuse to start if selected",
            version,
            SUPPORTED_VLLM,
        )
    try:
        from vllm.v1.core.sched.scheduler import Scheduler
    except ImportError as exc:  # pragma: no cover - a vLLM without the v1 scheduler
        log.error("kvplug: cannot hook vLLM's scheduler (%s); kvplug is not active", exc)
        return
    original = Scheduler.__init__
    if getattr(original, _WRAPPED, False):
        return

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        activate(self)

    setattr(__init__, _WRAPPED, True)
    Scheduler.__init__ = __init__


def chain_group_ids(kv_cache_config: Any) -> frozenset[int]:
    """KV-cache groups whose blocks chain from the first block (full attention, MLA).

    Sliding-window, chunked-local and Mamba groups match from their window only: a block there
    does not need its predecessors, so it never waits for its successors to leave.
    """
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    windowed: tuple[type, ...] = ()
    try:
        from vllm.v1.kv_cache_interface import RSWASpec

        windowed = (RSWASpec,)
    except ImportError:
        pass
    return frozenset(
        i
        for i, group in enumerate(kv_cache_config.kv_cache_groups)
        if isinstance(group.kv_cache_spec, FullAttentionSpec)
        and not isinstance(group.kv_cache_spec, windowed)
    )


def activate(scheduler: Any) -> Any:
    """Install the selected policy in ``scheduler``'s block pool; ``None`` if not selected.

    Called by the wrapped ``Scheduler.__init__``. A bad selection or an unsupported vLLM
    raises, so the engine refuses to start rather than run without the asked-for policy.
    """
    config = selected_config(getattr(scheduler.vllm_config, "additional_config", None))
    if config is None:
        return None
    version = vllm_version()
    check_vllm_version(version)
    from .block_pool import install_policy

    pool = scheduler.kv_cache_manager.block_pool
    policy = policy_factory(config.eviction_policy)()
    queue = install_policy(
        pool,
        policy,
        chain_group_ids=chain_group_ids(scheduler.kv_cache_config),
        chain_protection=config.chain_protection,
    )
    if not pool.enable_caching:
        log.warning(
            "kvplug: eviction policy %r selected but prefix caching is disabled; "
            "no block is ever cached, so vLLM's order is unchanged",
            config.eviction_policy.name,
        )
    log.info(
        "kvplug: eviction policy %r (%s) chooses which free cached block vLLM %s evicts",
        config.eviction_policy.name,
        type(policy).__name__,
        version,
    )
    return queue
