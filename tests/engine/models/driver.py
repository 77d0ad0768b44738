"""A minimal engine loop for the model tests until they run through the reference scheduler.

Waves of ``batch`` requests: admit (match, lock, evict the shortfall, ``alloc_extend``), chunked
prefill steps, decode steps (``alloc_decode``), finish (insert prompt + output, unlock, free the
unaligned tail). It drives only public kvplug calls, as an engine would.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import kvplug
from kvplug import CacheKey
from kvplug.engine.models import TinyModel


@dataclass(frozen=True)
class Item:
    request_id: int
    token_ids: list[int]
    start_pos: int
    slots: torch.Tensor
    sample: bool


def _pages(n: int, ps: int) -> int:
    return -(-n // ps)


def generate(
    stack: kvplug.KVCacheStack,
    model: TinyModel,
    prompts: list[list[int]],
    max_new_tokens: int,
    *,
    batch: int = 2,
    chunk: int | None = None,
) -> list[list[int]]:
    cache, allocator = stack.prefix_cache, stack.allocator
    ps = allocator.page_size
    dev = allocator.device
    outputs: list[list[int]] = [[] for _ in prompts]
    for first in range(0, len(prompts), batch):
        rids = list(range(first, min(first + batch, len(prompts))))
        nodes, slots, pre = {}, {}, {}
        for r in rids:
            p = prompts[r]
            m = cache.match_prefix(CacheKey(p))
            cache.inc_lock_ref(m.last_node)
            need = (_pages(len(p), ps) - _pages(m.prefix_len, ps)) * ps
            kvplug.evict_from_tree_cache(cache, need)
            last = int(m.device_indices[-1]) if m.prefix_len else -1
            new = allocator.alloc_extend(
                torch.tensor([m.prefix_len], device=dev),
                torch.tensor([len(p)], device=dev),
                torch.tensor([last], device=dev),
                len(p) - m.prefix_len,
            )
            assert new is not None, "out of memory in the test driver"
            nodes[r], pre[r] = m.last_node, m.prefix_len
            slots[r] = torch.cat([m.device_indices.to(dev), new])
        done = dict(pre)
        while any(done[r] < len(prompts[r]) for r in rids):
            items = []
            for r in rids:
                p = prompts[r]
                if done[r] == len(p):
                    continue
                end = len(p) if chunk is None else min(len(p), done[r] + chunk)
                items.append(Item(r, p[done[r] : end], done[r], slots[r][:end], end == len(p)))
                done[r] = end
            for it, tok in zip(items, model.forward(stack, items)):
                if tok is not None:
                    outputs[it.request_id].append(tok)
        for _ in range(max_new_tokens - 1):
            seq = torch.tensor([len(slots[r]) + 1 for r in rids], device=dev)
            last = torch.stack([slots[r][-1] for r in rids])
            need = int(((seq - 1) % ps == 0).sum()) * ps
            kvplug.evict_from_tree_cache(cache, need)
            new = allocator.alloc_decode(seq, last)
            assert new is not None, "out of memory in the test driver"
            items = []
            for j, r in enumerate(rids):
                slots[r] = torch.cat([slots[r], new[j : j + 1]])
                n = len(slots[r])
                items.append(Item(r, [outputs[r][-1]], n - 1, slots[r], True))
            for it, tok in zip(items, model.forward(stack, items)):
                outputs[it.request_id].append(tok)
        for r in rids:
            tokens = (prompts[r] + outputs[r])[: len(slots[r])]
            cache.insert(CacheKey(tokens), slots[r])
            aligned = len(tokens) // ps * ps
            if aligned < len(tokens):
                allocator.free(slots[r][aligned:])
            cache.dec_lock_ref(nodes[r])
    return outputs
