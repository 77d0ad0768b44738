"""Serve prompts with the tiny model on a kvplug stack: the loop the CLI, benchmark and tests use.

Waves of ``batch`` requests: admit (match, lock, evict the shortfall, ``alloc_extend``), chunked
prefill steps, decode steps (``alloc_decode`` after evicting the shortfall), finish (insert
prompt + output, unlock, free the unaligned tail). Only public kvplug calls, as an engine makes
them. (Stand-in until the reference scheduler ``kvplug.engine.scheduler`` drives the model.)
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvplug_hookspecs import CacheKey

from ...eviction import evict_from_tree_cache
from ...stack import KVCacheStack
from .tiny import TinyModel

__all__ = ["Item", "ServeResult", "serve"]


@dataclass(frozen=True)
class Item:
    """One request's share of a forward step (the scheduler's ``ForwardItem``)."""

    request_id: int
    token_ids: list[int]
    start_pos: int
    slots: torch.Tensor
    sample: bool


@dataclass
class ServeResult:
    """Generated tokens per prompt and what the cache saved."""

    outputs: list[list[int]]
    cached: list[int] = field(default_factory=list)  # prompt tokens each request found cached
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    seconds: float = 0.0
    cache_stats: dict[str, Any] = field(default_factory=dict)

    @property
    def prefill_saved(self) -> float:
        """Fraction of prompt tokens served from the cache instead of computed."""
        return self.cached_prompt_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def _pages(n: int, page_size: int) -> int:
    return -(-n // page_size)


def serve(
    stack: KVCacheStack,
    model: TinyModel,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    batch: int = 2,
    chunk_size: int | None = None,
) -> ServeResult:
    """Greedily generate ``max_new_tokens`` for each prompt, ``batch`` requests at a time."""
    cache = stack.prefix_cache
    allocator: Any = stack.allocator  # alloc_extend/alloc_decode: every built-in allocator
    ps, dev = allocator.page_size, allocator.device
    result = ServeResult(outputs=[[] for _ in prompts], cached=[0] * len(prompts))
    outputs = result.outputs
    began = time.perf_counter()
    for first in range(0, len(prompts), batch):
        rids = list(range(first, min(first + batch, len(prompts))))
        nodes: dict[int, Any] = {}
        slots: dict[int, torch.Tensor] = {}
        done: dict[int, int] = {}
        for r in rids:
            p = list(prompts[r])
            m = cache.match_prefix(CacheKey(p))
            cache.inc_lock_ref(m.last_node)
            evict_from_tree_cache(cache, (_pages(len(p), ps) - _pages(m.prefix_len, ps)) * ps)
            last = int(m.device_indices[-1]) if m.prefix_len else -1
            new = allocator.alloc_extend(
                torch.tensor([m.prefix_len], device=dev),
                torch.tensor([len(p)], device=dev),
                torch.tensor([last], device=dev),
                len(p) - m.prefix_len,
            )
            if new is None:
                raise MemoryError("out of KV slots: lower batch or raise capacity")
            nodes[r], done[r] = m.last_node, m.prefix_len
            slots[r] = torch.cat([m.device_indices.to(dev), new])
            result.prompt_tokens += len(p)
            result.cached_prompt_tokens += m.prefix_len
            result.cached[r] = m.prefix_len
        while any(done[r] < len(prompts[r]) for r in rids):
            items = []
            for r in rids:
                p = list(prompts[r])
                if done[r] == len(p):
                    continue
                end = len(p) if chunk_size is None else min(len(p), done[r] + chunk_size)
                items.append(Item(r, p[done[r] : end], done[r], slots[r][:end], end == len(p)))
                done[r] = end
            for it, tok in zip(items, model.forward(stack, items)):
                if tok is not None:
                    outputs[it.request_id].append(tok)
        for _ in range(max_new_tokens - 1):
            seq = torch.tensor([len(slots[r]) + 1 for r in rids], device=dev)
            last_loc = torch.stack([slots[r][-1] for r in rids])
            evict_from_tree_cache(cache, int(((seq - 1) % ps == 0).sum()) * ps)
            new = allocator.alloc_decode(seq, last_loc)
            if new is None:
                raise MemoryError("out of KV slots: lower batch or raise capacity")
            items = []
            for j, r in enumerate(rids):
                slots[r] = torch.cat([slots[r], new[j : j + 1]])
                items.append(Item(r, [outputs[r][-1]], len(slots[r]) - 1, slots[r], True))
            for it, tok in zip(items, model.forward(stack, items)):
                assert tok is not None  # decode items always sample
                outputs[it.request_id].append(tok)
        for r in rids:
            tokens = (list(prompts[r]) + outputs[r])[: len(slots[r])]
            cache.insert(CacheKey(tokens), slots[r])
            aligned = len(tokens) // ps * ps
            if aligned < len(tokens):
                allocator.free(slots[r][aligned:])
            cache.dec_lock_ref(nodes[r])
    result.seconds = time.perf_counter() - began
    stats = getattr(cache, "stats", None)
    result.cache_stats = stats.as_dict() if stats is not None else {}
    return result
