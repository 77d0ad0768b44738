"""A minimal engine over a real ``kvplug.build`` stack for the tier tests: match (device, then
tiers), allocate the rest through the shortfall eviction, write each token's K/V, insert.

Every token's K/V is a pure function of its whole prefix (a rolling hash of the tokens up to
it), so any K/V read back from the pool can be compared, exactly, with what a recompute writes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

import kvplug
from kvplug.eviction import evict_from_tree_cache
from kvplug_hookspecs import CacheKey

LAYERS, HEADS, DIM = 2, 2, 4


def config(
    tiers: list[dict[str, Any]],
    *,
    cache: str = "radix",
    page_size: int = 1,
    capacity: int = 32,
    dtype: str = "float16",
    allocator: str | None = None,
    **storage: Any,
) -> dict[str, Any]:
    storage.setdefault("background", False)
    # loading always beats recomputing unless a test says otherwise (hit counts exact)
    storage.setdefault("cost", {"prefill_tokens_per_s": 1.0})
    out: dict[str, Any] = {
        "allocator": {"name": allocator or ("standard" if page_size == 1 else "paged")},
        "prefix_cache": {"name": cache},
        "pool": {
            "capacity_tokens": capacity,
            "page_size": page_size,
            "num_layers": LAYERS,
            "kv_heads": HEADS,
            "head_dim": DIM,
            "dtype": dtype,
            "device": "cpu",
        },
    }
    if tiers:
        out["storage"] = {"tiers": tiers, **storage}
    return out


def expected_kv(ids: tuple[int, ...] | list[int], dtype: torch.dtype) -> torch.Tensor:
    """``[2, layers, len(ids), heads, dim]``: token ``i``'s K/V from the hash of ``ids[:i+1]``
    (values k/16 for k < 256: exact in fp16, bf16, fp32 and fp8 e4m3)."""
    h, hashes = 0, []
    for t in ids:
        h = (h * 1_000_003 + t + 1) % (1 << 31)
        hashes.append(h)
    base = torch.tensor(hashes, dtype=torch.int64).view(1, 1, -1, 1, 1)
    kv, layer, head, dim = (
        torch.arange(n).view(*shape)
        for n, shape in (
            (2, (2, 1, 1, 1, 1)),
            (LAYERS, (1, LAYERS, 1, 1, 1)),
            (HEADS, (1, 1, 1, HEADS, 1)),
            (DIM, (1, 1, 1, 1, DIM)),
        )
    )
    values = (base + 11 * kv + 3 * layer + 5 * head + 7 * dim) % 64
    return (values.to(torch.float32) / 16).to(dtype)


@dataclass
class Driver:
    """Requests against one stack; checks conservation after every step and the K/V of every
    matched prefix against :func:`expected_kv`."""

    stack: Any
    results: list[Any] = field(default_factory=list)

    @classmethod
    def build(cls, cfg: dict[str, Any], registry: Any = None) -> Driver:
        return cls(kvplug.build(cfg, registry=registry))

    @property
    def cache(self) -> Any:
        return self.stack.prefix_cache

    @property
    def pool(self) -> Any:
        return self.stack.allocator.pool

    @property
    def dtype(self) -> torch.dtype:
        return self.pool.dtype

    def store(self, kv: torch.Tensor) -> torch.Tensor:
        """``kv`` as the pool stores it (bytes for fp8)."""
        return kv.view(torch.uint8) if self.pool.store_dtype == torch.uint8 else kv

    def conserved(self) -> None:
        cache, allocator = self.cache, self.stack.allocator
        capacity = self.stack.config.pool.capacity_tokens
        total = allocator.available_size() + cache.evictable_size() + cache.protected_size()
        assert total == capacity, (
            f"available {allocator.available_size()} + evictable {cache.evictable_size()} + "
            f"protected {cache.protected_size()} != {capacity}"
        )
        cached = cache.all_values_flatten().tolist()
        assert len(cached) == len(set(cached)), "a slot is cached twice"

    def check_prefix(self, ids: tuple[int, ...], match: Any) -> None:
        n = match.prefix_len
        assert match.device_indices.numel() == n
        if n:
            got = self.pool.read_slots(match.device_indices)
            want = self.store(expected_kv(ids[:n], self.dtype))
            assert torch.equal(got, want), "K/V of the matched prefix differs from a recompute"

    def request(self, ids: list[int] | tuple[int, ...]) -> Any:
        """Serve one prompt; returns its ``MatchResult`` (``prefix_len`` includes tier loads)."""
        ids = tuple(ids)
        cache, allocator = self.cache, self.stack.allocator
        match = cache.match_prefix(CacheKey(ids))
        self.conserved()
        self.check_prefix(ids, match)
        node = match.last_node
        cache.inc_lock_ref(node)
        try:
            new = len(ids) - match.prefix_len
            if new:
                evict_from_tree_cache(cache, new)
                self.conserved_with(new_held=0)
                slots = allocator.alloc(new)
                assert slots is not None, "the device pool is too small for one request"
                self.pool.write_slots(
                    slots, self.store(expected_kv(ids, self.dtype))[:, :, match.prefix_len :]
                )
                cache.insert(CacheKey(ids), torch.cat((match.device_indices, slots)))
        finally:
            cache.dec_lock_ref(node)
        self.conserved()
        self.results.append(match)
        return match

    def conserved_with(self, new_held: int) -> None:
        cache, allocator = self.cache, self.stack.allocator
        capacity = self.stack.config.pool.capacity_tokens
        total = allocator.available_size() + cache.evictable_size() + cache.protected_size()
        assert total + new_held == capacity

    def flush(self) -> None:
        if self.stack.storage is not None:
            self.stack.storage.flush()

    def close(self) -> None:
        self.stack.close()


def prompts(n: int, length: int, seed: int = 0, shared: int = 0) -> list[list[int]]:
    """``n`` prompts of ``length`` tokens; the first ``shared`` tokens common to all."""
    g = torch.Generator().manual_seed(seed)
    head = torch.randint(0, 50_000, (shared,), generator=g).tolist()
    return [
        head + torch.randint(0, 50_000, (length - shared,), generator=g).tolist() for _ in range(n)
    ]
