"""Chained, position-aware block hashes: the one hash scheme of kvplug's caches and KV events.

A key is cut into pages (blocks) of ``page_size`` tokens; only whole pages are hashed, because
the caches only ever store whole pages. Page ``i``'s digest is::

    H(digest of page i-1  ||  the page's token ids packed as int64, machine byte order)

and page 0 chains from the namespace's seed, ``H(b"kvplug-none")`` when ``extra_key`` is
``None``, else ``H(b"kvplug-ns:" + extra_key encoded as UTF-8)``. So a digest identifies the
whole prefix up to the end of its page in its namespace: the same tokens at another depth,
after another parent page, or in another namespace hash differently. ``H`` is SHA-256 (default,
as vLLM) or a 128-bit BLAKE2b (``block_hash``'s ``hash_algorithm="blake2b"``); both are
deterministic across processes and machines (of one byte order: little-endian on x86 and ARM).

KV events carry :func:`event_hash` of a digest: its first 8 bytes read big-endian, unsigned.
``block_hash`` (its lookup table) and ``radix`` (its events) both hash with this module, so the
same token pages from the root have the same event hashes in both caches.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal

__all__ = ["Hasher", "event_hash", "hasher_for", "iter_chain", "seed"]

Hasher = Callable[[bytes], Any]
"""A hashlib constructor: ``hasher(data).digest()`` is the digest of ``data``."""


def _blake2b_128(data: bytes) -> Any:
    return hashlib.blake2b(data, digest_size=16)


def hasher_for(algorithm: Literal["sha256", "blake2b"] = "sha256") -> Hasher:
    """The hash function ``H`` for an algorithm name."""
    if algorithm == "sha256":
        return hashlib.sha256
    if algorithm == "blake2b":
        return _blake2b_128
    raise ValueError(f"unknown hash algorithm {algorithm!r}: expected 'sha256' or 'blake2b'")


def seed(hasher: Hasher, extra_key: str | None) -> bytes:
    """The digest a namespace's first page chains from."""
    tag = b"kvplug-none" if extra_key is None else b"kvplug-ns:" + extra_key.encode()
    digest: bytes = hasher(tag).digest()
    return digest


def iter_chain(
    hasher: Hasher, parent: bytes, ids: Sequence[int], page_size: int, num_pages: int
) -> Iterator[bytes]:
    """Yield the digests of the first ``num_pages`` pages of ``ids``, chained from ``parent``
    (the seed, or the digest of the page before ``ids[0]``). Lazy: a lookup can stop early.

    The tokens are packed once in C (``array``); one hash call per page.
    """
    size = 8 * page_size
    data = array("q", ids[: num_pages * page_size]).tobytes()
    digest = parent
    for start in range(0, num_pages * size, size):
        digest = hasher(digest + data[start : start + size]).digest()
        yield digest


def event_hash(digest: bytes) -> int:
    """The hash a KV event carries for a page: the digest's first 8 bytes, big-endian."""
    return int.from_bytes(digest[:8], "big")
