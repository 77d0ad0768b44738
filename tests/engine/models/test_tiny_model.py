"""The tiny model over kvplug pools gives exactly what a dense recompute without any cache gives.

Every case generates greedily for prompts that share prefixes, through real caches, allocators
and policies, with capacities small enough that prefixes are evicted and re-matched; tokens must
be identical and logits within 1e-5 of ``reference_generate`` (no pool, no cache, no slots).
"""

from __future__ import annotations

import functools
import random
from typing import Any

import pytest
import torch

import kvplug
from kvplug.engine import ForwardItem
from kvplug.engine.models import TinyConfig, TinyModel, reference_generate, reference_logits
from kvplug.engine.models.prompts import shared_prefix_prompts
from kvplug.engine.models.serving import ServeResult, serve

MAX_NEW = 5
ATOL = 1e-5


def prompts(seed: int = 0, n: int = 8) -> list[list[int]]:
    """Three shared system prompts (24 tokens) + a unique suffix of 3..12 tokens each."""
    return shared_prefix_prompts(n, num_prefixes=3, prefix_len=24, suffix_len=(3, 12), seed=seed)


def stack_config(
    allocator: str = "standard",
    cache: str = "radix",
    policy: str = "lru",
    *,
    capacity: int = 128,
    page_size: int = 1,
    num_layers: int = 2,
    allocator_options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return {
        "allocator": {"name": allocator, "options": allocator_options or {}},
        "prefix_cache": cache,
        "eviction_policy": policy,
        "pool": {
            "capacity_tokens": capacity,
            "page_size": page_size,
            "num_layers": num_layers,
            "kv_heads": 2,
            "head_dim": 16,
            "dtype": "float32",
            "device": "cpu",
        },
    }


@functools.cache
def _reference(config: TinyConfig, prompt: tuple[int, ...]) -> tuple[list[int], list[torch.Tensor]]:
    return reference_generate(TinyModel(config), prompt, MAX_NEW)


def check_against_reference(
    model: TinyModel, outputs: list[list[int]], served: list[list[int]] | None = None
) -> None:
    """Tokens identical and logits within ``ATOL`` of the dense recompute, for every request."""
    for r, p in enumerate(served if served is not None else prompts()):
        ref_tokens, ref_logits = _reference(model.config, tuple(p))
        assert outputs[r] == ref_tokens, f"request {r}"
        for j in range(MAX_NEW):
            got = model.logits[(r, len(p) - 1 + j)]
            torch.testing.assert_close(got, ref_logits[j], atol=ATOL, rtol=0)


def run(
    config: dict[str, Any], *, chunk: int | None = None, max_running: int = 2, seed: int = 0
) -> tuple[kvplug.KVCacheStack, TinyModel, ServeResult]:
    """Serve ``prompts(seed)`` through the reference scheduler (conservation checked every step)
    and require the recompute's tokens and logits."""
    stack = kvplug.build(config)
    model = TinyModel.for_stack(stack, record_logits=True)
    result = serve(
        stack, model, prompts(seed), MAX_NEW, max_running=max_running, chunk_size=chunk, debug=True
    )
    check_against_reference(model, result.outputs, prompts(seed))
    if not result.scheduler.preemptions:  # a cached prefix is read from the pool, not recomputed
        computed = sum(len(p) - c + MAX_NEW - 1 for p, c in zip(prompts(seed), result.cached))
        assert model.tokens_computed == computed
    return stack, model, result


CACHES = {
    "radix-page1": stack_config("standard", "radix"),
    "radix-page16": stack_config("paged", "radix", capacity=112, page_size=16),
    "block_hash-page4": stack_config("paged", "block_hash", capacity=128, page_size=4),
    "block_hash-page16": stack_config("paged", "block_hash", capacity=112, page_size=16),
    "chunk": stack_config("standard", "chunk"),
    "swa_radix": stack_config(
        "swa",
        "swa_radix",
        capacity=160,
        num_layers=4,
        allocator_options={"swa_capacity_tokens": 96, "sliding_window_size": 6},
    ),
    "swa_radix-page4": stack_config(
        "swa",
        "swa_radix",
        capacity=160,
        page_size=4,
        num_layers=4,
        allocator_options={"swa_capacity_tokens": 96, "sliding_window_size": 6},
    ),
}


@pytest.mark.parametrize("chunk", [None, 7])
@pytest.mark.parametrize("name", list(CACHES))
def test_cached_generation_equals_recompute(name: str, chunk: int | None) -> None:
    stack, _, _ = run(CACHES[name], chunk=chunk)
    stats = stack.prefix_cache.stats
    if name == "chunk":
        assert stats.hit_tokens == 0
    elif name.startswith(
        "swa_radix"
    ):  # decoding frees the system prompts' window side: see multi-turn
        assert stats.swa_evicted_tokens > 0
    else:
        assert stats.hit_tokens >= 16  # shared system prompts were served from the pool
        assert stats.evicted_tokens > 0  # the small capacity forced evictions


@pytest.mark.parametrize(
    "name, capacity",
    [
        ("radix-page1", 96),
        ("radix-page16", 80),
        ("block_hash-page4", 96),
        ("block_hash-page16", 80),
        ("chunk", 96),
        ("swa_radix", 96),
        ("swa_radix-page4", 96),
    ],
)
def test_preemption_and_readmission_equal_recompute(name: str, capacity: int) -> None:
    """Eight requests at once in a pool for about three: decode runs short, the scheduler evicts
    then preempts the newest request, which recomputes from its cached prefix when re-admitted."""
    config = dict(CACHES[name], pool={**CACHES[name]["pool"], "capacity_tokens": capacity})
    _, _, result = run(config, max_running=8)
    assert result.scheduler.preemptions > 0


@pytest.mark.parametrize("policy", ["lru", "lfu", "fifo", "mru", "filo", "priority", "slru"])
def test_every_policy_equals_recompute(policy: str) -> None:
    stack, _, _ = run(stack_config("standard", "radix", policy, capacity=112))
    assert stack.prefix_cache.stats.evicted_tokens > 0


def test_swa_window_eviction_on_the_real_path() -> None:
    """Window-side eviction (tombstones) happens and outputs still equal the windowed recompute."""
    config = stack_config(
        "swa",
        "swa_radix",
        capacity=256,
        num_layers=4,
        allocator_options={"swa_capacity_tokens": 80, "sliding_window_size": 5},
    )
    stack, model, _ = run(config)
    stats = stack.prefix_cache.stats
    assert stats.swa_evicted_tokens > 0
    assert model.config.swa_layer_ids == (0, 2)


@pytest.mark.parametrize("chunk", [None, 5])
@pytest.mark.parametrize("page", [1, 4])
def test_swa_multi_turn_reuses_the_conversation(page: int, chunk: int | None) -> None:
    """Next turns (prompt + answer + a question) match the previous turn's window-live tail
    (room for every turn: nothing is evicted, so every match is exact)."""
    window = {"swa_capacity_tokens": 192, "sliding_window_size": 6}
    stack = kvplug.build(
        stack_config(
            "swa", "swa_radix", capacity=320, page_size=page, num_layers=4, allocator_options=window
        )
    )
    model = TinyModel.for_stack(stack, record_logits=True)
    first = prompts(n=4)
    turn1 = serve(stack, model, first, MAX_NEW, max_running=2, chunk_size=chunk, debug=True)
    check_against_reference(model, turn1.outputs, first)
    rng = random.Random(1)
    second = [p + o + [rng.randrange(128) for _ in range(3)] for p, o in zip(first, turn1.outputs)]
    turn2 = serve(stack, model, second, MAX_NEW, max_running=2, chunk_size=chunk, debug=True)
    check_against_reference(model, turn2.outputs, second)
    # each turn-1 sequence was cached with K/V for prompt + all but the last output token
    assert turn2.cached == [(len(p) + MAX_NEW - 1) // page * page for p in first]
    assert stack.prefix_cache.stats.evicted_tokens == 0


def test_a_wrongly_translated_window_slot_is_seen() -> None:
    """One window slot of a cached conversation mapped to its neighbour's changes the next turn:
    the window layers really read the window pool through the allocator's translation."""
    window = {"swa_capacity_tokens": 192, "sliding_window_size": 6}
    stack = kvplug.build(
        stack_config("swa", "swa_radix", capacity=320, num_layers=4, allocator_options=window)
    )
    model = TinyModel.for_stack(stack, record_logits=True)
    first = prompts(n=1)
    turn1 = serve(stack, model, first, MAX_NEW)
    second = [first[0] + turn1.outputs[0] + [1, 2, 3]]
    cached = len(first[0]) + MAX_NEW - 1
    slots = stack.prefix_cache.match_prefix(second[0]).device_indices
    assert len(slots) == cached
    mapping = stack.allocator.full_to_swa_index_mapping
    mapping[slots[-2]] = mapping[slots[-3]]  # a live window position, translated wrongly
    turn2 = serve(stack, model, second, MAX_NEW)
    assert turn2.cached == [cached]
    with pytest.raises(AssertionError):
        check_against_reference(model, turn2.outputs, second)


def test_window_mask_matters() -> None:
    """The windowed reference differs from full attention, so SWA equality is not vacuous."""
    full = TinyModel(TinyConfig(num_layers=4))
    windowed = TinyModel(TinyConfig(num_layers=4, sliding_window_size=5, swa_layer_ids=(0, 2)))
    tokens = prompts()[0]
    diff = (reference_logits(full, tokens) - reference_logits(windowed, tokens)).abs()
    assert float(diff[:5].max()) < ATOL  # inside the first window both masks agree
    assert float(diff[5:].max()) > 1e-2


def _corrupt_matches(monkeypatch: pytest.MonkeyPatch, stack: Any) -> None:
    cache = stack.prefix_cache
    real_match = cache.match_prefix

    def corrupted(key: Any, **kw: Any) -> Any:
        match = real_match(key, **kw)
        if match.prefix_len > 3:
            match.device_indices[3] = match.device_indices[2]  # one wrong slot
        return match

    monkeypatch.setattr(cache, "match_prefix", corrupted)


def test_a_wrong_slot_in_a_match_is_seen(monkeypatch: pytest.MonkeyPatch) -> None:
    """One corrupted index in a match changes the output: the equality tests can see it.

    Ownership checks are off here: with them (the default) the insert that follows already
    rejects the wrong slot (next test), so the model would never get to show it.
    """
    config = stack_config(allocator_options={"ownership_checks": False})
    stack = kvplug.build(config)
    _corrupt_matches(monkeypatch, stack)
    model = TinyModel(TinyConfig.for_stack(stack), record_logits=True)
    outputs = serve(stack, model, prompts(), MAX_NEW, max_running=2).outputs
    with pytest.raises(AssertionError):
        check_against_reference(model, outputs)


def test_a_wrong_slot_in_a_match_is_refused_by_the_ownership_checks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """By default the insert that would cache the wrong slot (one the cache owns already, under
    another position) is rejected before anything changes."""
    stack = kvplug.build(CACHES["radix-page1"])
    _corrupt_matches(monkeypatch, stack)
    model = TinyModel(TinyConfig.for_stack(stack), record_logits=True)
    with pytest.raises(ValueError, match="owned by the cache, expected held"):
        serve(stack, model, prompts(), MAX_NEW)


def test_a_pool_of_another_geometry_is_refused() -> None:
    stack = kvplug.build(stack_config())
    model = TinyModel(TinyConfig(num_layers=3))
    with pytest.raises(ValueError, match=r"does not match the model's \(3, 2, 16, \(\)\)"):
        serve(stack, model, prompts(n=1), 1)


def test_a_window_of_another_size_is_refused() -> None:
    stack = kvplug.build(CACHES["swa_radix"])
    model = TinyModel.for_stack(stack, sliding_window_size=8)
    with pytest.raises(ValueError, match="keeps a 6-token window, the model attends over 8"):
        serve(stack, model, prompts(n=1), 1)


def test_a_window_position_without_a_window_slot_is_an_error() -> None:
    """Freeing a window slot the model still needs is caught, not read as padding."""
    config = CACHES["swa_radix"]
    stack = kvplug.build(config)
    model = TinyModel.for_stack(stack)
    allocator = stack.allocator
    slots = allocator.alloc(10)
    item = ForwardItem(0, list(range(10)), 0, slots, True)
    model.forward(stack, [item])
    allocator.free_swa(slots[8:9])  # position 8 is inside the window of position 10
    grown = torch.cat([slots, allocator.alloc(1)])
    with pytest.raises(RuntimeError, match="position 8 is inside the attention window"):
        model.forward(stack, [ForwardItem(0, [5], 10, grown, True)])


def test_a_bfloat16_pool_equals_a_recompute_rounded_alike() -> None:
    config = stack_config()
    config["pool"]["dtype"] = "bfloat16"
    stack = kvplug.build(config)
    model = TinyModel.for_stack(stack, record_logits=True)
    outputs = serve(stack, model, prompts(n=4), MAX_NEW).outputs
    for r, p in enumerate(prompts(n=4)):
        tokens, logits = reference_generate(model, p, MAX_NEW, kv_dtype=torch.bfloat16)
        assert outputs[r] == tokens
        for j in range(MAX_NEW):
            got = model.logits[(r, len(p) - 1 + j)]
            torch.testing.assert_close(got, logits[j], atol=ATOL, rtol=0)
