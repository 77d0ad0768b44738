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

That is the default :class:`BlockHasher`. A config's ``block_hash = "vllm"`` gives every cache a
:class:`VLLMBlockHasher` instead: vLLM's own chain (its hash function over ``(parent, tokens,
extra keys)``, from its ``NONE_HASH``), so a router that hashes a prompt as vLLM does (llm-d's
indexer, Dynamo) finds kvplug's pages; slower (it serialises a tuple per page).
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal

from .. import speedups

__all__ = [
    "BlockHasher",
    "Hasher",
    "VLLMBlockHasher",
    "event_hash",
    "hasher_for",
    "iter_chain",
    "make_hasher",
    "seed",
    "vllm_extra_key",
]

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


_COMPILED_PAGE_BYTES = 256
"""Pages up to this size (32 tokens) hash faster in ``sha256_chain`` (0.35 µs a page of 1 token
against hashlib's 1.0, 0.9 against 1.1 at 16 tokens); above it OpenSSL's SHA-256 (with the
CPU's SHA instructions) outruns the portable compiled one (1.8 µs against 4.8 at 128 tokens,
3.9 against 17.3 at 512), whatever the per-call cost."""


def iter_chain(
    hasher: Hasher, parent: bytes, ids: Sequence[int], page_size: int, num_pages: int
) -> Iterator[bytes]:
    """Yield the digests of the first ``num_pages`` pages of ``ids``, chained from ``parent``
    (the seed, or the digest of the page before ``ids[0]``). Lazy: a lookup can stop early.

    The tokens are packed as they are hashed (``kvplug.speedups.pack_int64``), so a lookup
    that stops early packs no more than it hashed. SHA-256 of small pages chains in runs of
    pages (1, then 8, 64, ... at a time) through ``kvplug.speedups.sha256_chain`` (compiled: no
    Python per page); larger pages, and other hash functions, take one hashlib call per page.
    """
    size = 8 * page_size
    digest = parent
    pack = speedups.pack_int64
    if hasher is hashlib.sha256 and size <= _COMPILED_PAGE_BYTES:
        start, batch = 0, 1
        while start < num_pages:
            count = min(batch, num_pages - start)
            data = pack(ids, start * page_size, (start + count) * page_size)
            digests = speedups.sha256_chain(digest, data, 0, count, size)
            yield from digests
            digest = digests[-1]
            start += count
            batch *= 8
        return
    for start in range(0, num_pages * page_size, page_size):
        digest = hasher(digest + pack(ids, start, start + page_size)).digest()
        yield digest


def event_hash(digest: bytes) -> int:
    """The hash a KV event carries for a page: the digest's first 8 bytes, big-endian."""
    return int.from_bytes(digest[:8], "big")


# -- hashers: the scheme a cache hashes its pages with ---------------------------------------


class BlockHasher:
    """kvplug's page hashes (the scheme above): what a cache calls to hash its pages.

    ``name`` is stable and names everything that decides the digests (scheme, algorithm, and
    for vLLM's scheme its root), so page digests are comparable exactly when names are equal:
    a storage tier keys pages by digest inside a namespace that includes it.
    """

    def __init__(self, algorithm: Literal["sha256", "blake2b"] = "sha256") -> None:
        self._hasher = hasher_for(algorithm)
        self.algorithm: str = algorithm
        self.name = f"kvplug-{algorithm}"
        self._roots: dict[str | None, bytes] = {}

    def root(self, extra_key: str | None) -> bytes:
        """The digest a namespace's first page chains from (computed once per namespace)."""
        digest = self._roots.get(extra_key)
        if digest is None:
            if len(self._roots) >= 4096:  # many namespaces (LoRA ids, salts): stay bounded
                self._roots.clear()
            digest = self._roots[extra_key] = seed(self._hasher, extra_key)
        return digest

    def chain(
        self,
        parent: bytes,
        ids: Sequence[int],
        page_size: int,
        num_pages: int,
        extra_key: str | None = None,
    ) -> Iterator[bytes]:
        """The digests of the first ``num_pages`` pages of ``ids`` chained from ``parent``
        (``root(extra_key)``, or the digest of the page before ``ids[0]``); lazy."""
        return iter_chain(self._hasher, parent, ids, page_size, num_pages)

    def event_hash(self, digest: bytes) -> int:
        """The 64-bit hash KV events carry for a page."""
        return event_hash(digest)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"


VLLM_DEFAULT_NONE_HASH_SEED = "vllm-none-hash"
"""vLLM's seed of ``NONE_HASH`` when ``PYTHONHASHSEED`` is unset (0.33, 0.34)."""

_VLLM_NAMESPACE = "\x00vllm:"


def vllm_extra_key(
    *,
    lora_name: str | None = None,
    lora_path: str | None = None,
    cache_salt: str | None = None,
) -> str | None:
    """The kvplug namespace (``CacheKey.extra_key``) of a vLLM request's hash extra keys: its
    LoRA adapter (name and path, hashed into every block, as vLLM does) and its ``cache_salt``
    (hashed into the first block). ``None`` when the request has neither.

    With ``block_hash = "vllm"``, any other namespace string is hashed as a ``cache_salt``.
    """
    if lora_name is None and cache_salt is None:
        return None
    return _VLLM_NAMESPACE + json.dumps([lora_name, lora_path, cache_salt])


def _vllm_hash_function(algorithm: str) -> Callable[[Any], bytes]:
    """vLLM's ``get_hash_fn_by_name`` (``vllm/utils/hashing.py``): an object's digest."""
    if algorithm == "sha256":
        return lambda obj: hashlib.sha256(
            pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        ).digest()
    if algorithm == "sha256_cbor":
        import cbor2

        return lambda obj: hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()
    if algorithm in ("xxhash", "xxhash_cbor"):
        try:
            import xxhash
        except ImportError as exc:
            raise ValueError(
                f"block_hash algorithm {algorithm!r} needs `pip install xxhash`"
            ) from exc

        if algorithm == "xxhash":
            return lambda obj: xxhash.xxh3_128_digest(
                pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
            )
        import cbor2

        return lambda obj: xxhash.xxh3_128_digest(cbor2.dumps(obj, canonical=True))
    raise ValueError(
        f"unknown vLLM hash algorithm {algorithm!r}: "
        "expected 'sha256', 'sha256_cbor', 'xxhash' or 'xxhash_cbor'"
    )


class VLLMBlockHasher(BlockHasher):
    """vLLM's prefix-cache block hashes (``hash_block_tokens`` of vllm 0.33 / 0.34), bit for bit.

    Page ``i``'s digest is ``H((parent digest, tuple of the page's tokens, extra keys or None))``
    with ``H`` vLLM's ``prefix_caching_hash_algo`` (``sha256``: pickle; ``sha256_cbor``: canonical
    CBOR) and page 0's parent vLLM's ``NONE_HASH = H(seed)``. The seed is ``none_hash_seed``, else
    ``PYTHONHASHSEED``, else ``"vllm-none-hash"``, as vLLM's ``init_none_hash`` resolves it (for
    ``xxhash`` vLLM then draws a random seed no one else can match: refused here).

    Extra keys come from the namespace (:func:`vllm_extra_key`): ``("lora", name, path)`` on
    every page, ``("cache_salt", salt)`` on page 0; a namespace not made by
    :func:`vllm_extra_key` is a ``cache_salt``. Multimodal and prompt-embeds keys depend on
    positions a namespace does not hold: :meth:`hash_pages` takes vLLM's per-page keys as they
    are. KV events carry what vLLM publishes: the digest's low 64 bits (``int.from_bytes(digest,
    "big") & (2**64 - 1)``, ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``, its default).
    """

    def __init__(
        self,
        algorithm: Literal["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"] = "sha256",
        none_hash_seed: str | None = None,
    ) -> None:
        self.algorithm = algorithm
        if none_hash_seed is None:
            none_hash_seed = os.environ.get("PYTHONHASHSEED")
        if none_hash_seed is None:
            if algorithm.startswith("xxhash"):
                raise ValueError(
                    f"block_hash: vLLM draws a random NONE_HASH seed for {algorithm!r} unless "
                    "PYTHONHASHSEED is set; set PYTHONHASHSEED (in kvplug and vLLM) or "
                    "none_hash_seed to the value vLLM uses"
                )
            none_hash_seed = VLLM_DEFAULT_NONE_HASH_SEED
        self._fn = _vllm_hash_function(algorithm)
        self.none_hash_seed = none_hash_seed
        self.none_hash: bytes = self._fn(none_hash_seed)
        self.name = f"vllm-{algorithm}-{self.none_hash[:8].hex()}"

    def root(self, extra_key: str | None) -> bytes:
        return self.none_hash

    @staticmethod
    def extra_keys(extra_key: str | None) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        """The keys a namespace adds to every page, and to the first page only."""
        if extra_key is None:
            return (), ()
        if not extra_key.startswith(_VLLM_NAMESPACE):
            return (), (("cache_salt", extra_key),)
        lora_name, lora_path, salt = json.loads(extra_key[len(_VLLM_NAMESPACE) :])
        every = (("lora", lora_name, lora_path),) if lora_name is not None else ()
        first = (("cache_salt", salt),) if salt else ()
        return every, first

    def chain(
        self,
        parent: bytes,
        ids: Sequence[int],
        page_size: int,
        num_pages: int,
        extra_key: str | None = None,
    ) -> Iterator[bytes]:
        every, first = self.extra_keys(extra_key)
        fn = self._fn
        digest = parent
        for start in range(0, num_pages * page_size, page_size):
            keys = every + first if digest == self.none_hash else every
            page = tuple(int(t) for t in ids[start : start + page_size])
            digest = fn((digest, page, keys or None))
            yield digest

    def hash_pages(
        self,
        ids: Sequence[int],
        page_size: int,
        extra_keys: Sequence[tuple[Any, ...] | None] | None = None,
        parent: bytes | None = None,
    ) -> list[bytes]:
        """The digests of ``ids``'s whole pages with vLLM's own per-page extra keys (as
        ``generate_block_hash_extra_keys`` returns them: LoRA, ``("mm", identifier, offset)``,
        cache salt, prompt-embeds digests), chained from ``parent`` (``NONE_HASH``)."""
        digest = self.none_hash if parent is None else parent
        out = []
        for i in range(len(ids) // page_size):
            keys = None if extra_keys is None else extra_keys[i]
            page = tuple(int(t) for t in ids[i * page_size : (i + 1) * page_size])
            digest = self._fn((digest, page, keys))
            out.append(digest)
        return out

    def event_hash(self, digest: bytes) -> int:
        return int.from_bytes(digest, "big") & ((1 << 64) - 1)


def make_hasher(config: Any = None, default_algorithm: str = "sha256") -> BlockHasher:
    """The hasher a ``BlockHashConfig`` (or ``None``: kvplug's ``default_algorithm``) selects."""
    if config is None or config.scheme == "kvplug":
        algorithm = (
            default_algorithm if config is None or config.algorithm is None else config.algorithm
        )
        return BlockHasher(algorithm)  # type: ignore[arg-type]
    return VLLMBlockHasher(config.algorithm or "sha256", config.none_hash_seed)
