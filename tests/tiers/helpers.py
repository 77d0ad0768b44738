"""Helpers of the storage-tier tests: namespaces, tier contexts, KV pages and chains of them."""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from kvplug.tiers.pages import page_checksum
from kvplug_hookspecs import ComponentSelection, PageData, TierContext, TierNamespace

from ..cache_helpers import POLICIES


def namespace(page_size: int = 1, model_id: str = "test", **fields: Any) -> TierNamespace:
    values: dict[str, Any] = {
        "model_id": model_id,
        "num_layers": 2,
        "kv_heads": 2,
        "head_dim": 4,
        "dtype": "float16",
        "page_size": page_size,
        "hash_function": "kvplug-sha256",
    }
    values.update(fields)
    return TierNamespace(**values)


def new_policy(selection: ComponentSelection) -> Any:
    registration = POLICIES[selection.name]
    return registration.factory(registration.options_model(**selection.options))


def tier_context(
    page_size: int = 1, page_bytes: int = 32, ns: TierNamespace | None = None
) -> TierContext:
    return TierContext(
        namespace=ns or namespace(page_size),
        page_size=page_size,
        page_bytes=page_bytes,
        store_kv=True,
        pin_memory=False,
        new_policy=new_policy,
    )


def kv_page(seed: int, page_size: int = 1, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """A distinct ``[2, 2, page, 2, 4]`` KV page (values drawn from ``seed``)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn((2, 2, page_size, 2, 4), generator=g).to(dtype)


def chain(
    n: int, page_size: int = 1, seed: int = 0, ns: TierNamespace | None = None, kv: bool = True
) -> list[PageData]:
    """``n`` consecutive pages of one prefix
    (keys chained like the digests of the caches), checksummed."""
    ns = ns or namespace(page_size)
    pages, parent = [], None
    for j in range(n):
        tokens = tuple(range(seed * 1000 + j * page_size, seed * 1000 + (j + 1) * page_size))
        key = hashlib.sha256((parent or b"root") + repr(tokens).encode()).digest()
        page = PageData(key, tokens, parent, kv_page(seed * 1000 + j, page_size) if kv else None)
        page.checksum = page_checksum(ns.id, page)
        pages.append(page)
        parent = key
    return pages


def same_page(a: PageData | None, b: PageData) -> bool:
    """Exact equality of two pages (KV bit for bit)."""
    if a is None:
        return False
    same_kv = (a.kv is None and b.kv is None) or (
        a.kv is not None
        and b.kv is not None
        and a.kv.dtype == b.kv.dtype
        and torch.equal(a.kv.view(torch.uint8), b.kv.view(torch.uint8))
    )
    return (a.key, a.token_ids, a.parent, a.checksum) == (
        b.key,
        b.token_ids,
        b.parent,
        b.checksum,
    ) and same_kv
