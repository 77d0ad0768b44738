"""The documented block-hash rule (kvplug.caches.block_hashing), written out independently of
kvplug's code, for tests that expect exact hashes.

Page digest = SHA-256(previous page's digest + the page's tokens as little-endian int64); the
first page chains from SHA-256(b"kvplug-none"), or SHA-256(b"kvplug-ns:" + namespace); an event
hash is the digest's first 8 bytes, big-endian (unsigned; SGLang publishes it as signed int64).
"""

from __future__ import annotations

import hashlib
import struct


def seed(namespace: str | None = None) -> bytes:
    tag = b"kvplug-none" if namespace is None else b"kvplug-ns:" + namespace.encode()
    return hashlib.sha256(tag).digest()


def chain(tokens: list[int], page: int, parent: bytes | None = None) -> list[bytes]:
    """Digests of each whole page of ``tokens`` chained from ``parent`` (the seed by default)."""
    digest = seed() if parent is None else parent
    out = []
    for start in range(0, len(tokens) - len(tokens) % page, page):
        chunk = tokens[start : start + page]
        digest = hashlib.sha256(digest + struct.pack(f"<{page}q", *chunk)).digest()
        out.append(digest)
    return out


def ev(digests: list[bytes]) -> tuple[int, ...]:
    """Event hashes (unsigned 64-bit)."""
    return tuple(int.from_bytes(d[:8], "big") for d in digests)


def ev_signed(digests: list[bytes]) -> list[int]:
    """Event hashes as SGLang publishes them (signed int64)."""
    return [int.from_bytes(d[:8], "big", signed=True) for d in digests]
