"""The tiny model with storage tiers: a device pool far too small for the working set, prefixes
demoted to host memory or disk and loaded back, and still exactly the dense recompute.

Loaded pages are not recomputed (the model computes exactly the tokens the cache did not
serve), and the tokens and logits equal ``reference_generate``'s: so the K/V that came back from
a tier is the K/V the model would have computed. One test also compares the loaded K/V with a
fresh computation of the same tokens, slot by slot.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import kvplug
from kvplug import CacheKey
from kvplug.engine.models import TinyModel
from kvplug.engine.models.serving import serve

from .test_tiny_model import MAX_NEW, check_against_reference, prompts, stack_config


def with_tiers(config: dict[str, Any], tiers: list[Any], **storage: Any) -> dict[str, Any]:
    return {**config, "storage": {"tiers": tiers, "background": False, **storage}}


def host(capacity: int = 4096) -> dict[str, Any]:
    return {"name": "host", "options": {"capacity_tokens": capacity}}


def disk(path: Path) -> dict[str, Any]:
    return {"name": "disk", "options": {"path": str(path)}}


DEVICES = {
    "radix-page1": stack_config("standard", "radix", capacity=64),
    "radix-page4": stack_config("paged", "radix", capacity=64, page_size=4),
    "block_hash-page4": stack_config("paged", "block_hash", capacity=64, page_size=4),
}


def serve_all(config: dict[str, Any], n: int = 12) -> tuple[Any, TinyModel, Any]:
    stack = kvplug.build(config)
    model = TinyModel.for_stack(stack, record_logits=True)
    served = prompts(n=n)
    result = serve(stack, model, served, MAX_NEW, max_running=1, debug=True)
    check_against_reference(model, result.outputs, served)
    computed = sum(len(p) - c + MAX_NEW - 1 for p, c in zip(served, result.cached))
    assert model.tokens_computed == computed  # a loaded page is never recomputed
    return stack, model, result


@pytest.mark.parametrize("name", list(DEVICES))
@pytest.mark.parametrize("hierarchy", ["host", "disk", "host+disk"])
def test_outputs_with_tiers_equal_the_recompute(name: str, hierarchy: str, tmp_path: Path) -> None:
    tiers = {
        "host": [host()],
        "disk": [disk(tmp_path)],
        "host+disk": [host(16), disk(tmp_path)],  # a host too small: pages cascade to the disk
    }[hierarchy]
    plain, _, without = serve_all(DEVICES[name])
    stack, _, result = serve_all(with_tiers(DEVICES[name], tiers))
    assert result.outputs == without.outputs
    loaded = result.scheduler.tier_hit_tokens
    assert sum(loaded.values()) > 0
    assert sum(result.cached) == sum(without.cached) + sum(loaded.values())
    assert stack.storage.stats.corrupt_pages == 0
    if hierarchy == "host+disk":
        assert loaded.get("disk", 0) > 0
    stack.close()
    plain.close()


@pytest.mark.parametrize("name", list(DEVICES))
def test_background_demotion_gives_the_same_outputs(name: str) -> None:
    config = with_tiers(DEVICES[name], [host()])
    config["storage"]["background"] = True
    _, _, without = serve_all(DEVICES[name])
    stack, _, result = serve_all(config)
    assert result.outputs == without.outputs
    stack.close()


@pytest.mark.parametrize("name", list(DEVICES))
def test_loaded_kv_equals_a_fresh_computation(name: str, tmp_path: Path) -> None:
    """Serve A, push it out of the device with B and C, match A again: the slots A's prefix
    loads into hold exactly the K/V a stack that never evicted A computed for it."""
    a, b, c = prompts(n=3)
    stack = kvplug.build(with_tiers(DEVICES[name], [host(16), disk(tmp_path)]))
    model = TinyModel.for_stack(stack)
    for p in (a, b, c):
        serve(stack, model, [p], 1, max_running=1)
    fresh = kvplug.build(DEVICES[name])
    serve(fresh, TinyModel.for_stack(fresh), [a], 1, max_running=1)
    key = CacheKey(a[:-1])
    want = fresh.prefix_cache.match_prefix(key)
    device_before = stack.prefix_cache.match_prefix(key, record_hit=False).prefix_len
    got = stack.prefix_cache.match_prefix(key)
    assert got.loaded_tokens > 0 and device_before < want.prefix_len
    assert got.prefix_len == want.prefix_len
    for layer in range(2):
        k_got, v_got = (t[got.device_indices] for t in stack.pool.get_kv(layer))
        k_want, v_want = (t[want.device_indices] for t in fresh.pool.get_kv(layer))
        assert torch.equal(k_got, k_want) and torch.equal(v_got, v_want)
    stack.close()
