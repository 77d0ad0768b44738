"""Stored KV pages: their checksum, their byte form, and the checks a page passes before loading.

A page's checksum is CRC-32C (Castagnoli: the checksum of iSCSI, ext4 and RocksDB, computed by
the SSE4.2/ARMv8 instruction through ``google-crc32c`` at several times zlib's CRC-32 rate) over
its namespace id, key, parent key, token ids, KV shape and dtype and KV bytes: a flipped bit
anywhere, a page stored under another key, or one of another geometry fails it. The byte form
(disk files, Redis values) is::

    b"KVPG" | u16 version | u16 len(namespace id) | u16 len(key) | u16 len(parent)
          | u32 num_tokens | u16 len(dtype name) | 5 x u32 KV shape (zeros: no KV)
          | namespace id | key | parent | dtype name | token ids (int64) | KV bytes | u32 CRC-32C

so a truncated value, a value of another format version or another namespace is recognised
before anything is read into a tensor. Nothing here touches a pool: :func:`check_page` is what
the hierarchy calls before a page may be written into one.
"""

from __future__ import annotations

import functools
import struct
from array import array
from collections.abc import Sequence
from typing import cast

import google_crc32c
import numpy as np
import torch

from kvplug_hookspecs import PAGE_FORMAT_VERSION, PageData

from .. import speedups

__all__ = ["CorruptPageError", "check_page", "decode_page", "encode_page", "page_checksum"]

_MAGIC = b"KVPG"
_HEAD = struct.Struct("<4sHHHHIH5I")
_CRC = struct.Struct("<I")


class CorruptPageError(ValueError):
    """A stored page failed a check: it is discarded, never loaded."""


def _kv_bytes(kv: torch.Tensor | None) -> bytes | np.ndarray:
    """The KV's bytes without a copy: a read-only uint8 array over the tensor's memory (what
    ``google_crc32c`` and ``bytes.join`` both take)."""
    if kv is None:
        return b""
    flat = kv.contiguous().view(-1).view(torch.uint8).numpy()
    flat.flags.writeable = False
    return flat


def _shape(kv: torch.Tensor | None) -> tuple[int, int, int, int, int]:
    if kv is None:
        return (0, 0, 0, 0, 0)
    if kv.dim() != 5:
        raise ValueError(
            f"a page's KV is [2, layers, page, heads, head_dim], got {tuple(kv.shape)}"
        )
    a, b, c, d, e = kv.shape
    return (a, b, c, d, e)


def _dtype_name(kv: torch.Tensor | None) -> bytes:
    return b"" if kv is None else str(kv.dtype).removeprefix("torch.").encode()


_NO_KV = struct.pack("<5I", 0, 0, 0, 0, 0)


@functools.lru_cache(maxsize=64)
def _namespace_crc(namespace_id: str) -> int:
    crc: int = google_crc32c.value(namespace_id.encode())
    return crc


def _token_bytes(page: PageData) -> bytes:
    return speedups.pack_int64(page.token_ids, 0, len(page.token_ids))


def page_checksum(namespace_id: str, page: PageData, tokens: bytes | None = None) -> int:
    """CRC-32C of everything a page is: see the module docstring (one pass over the header
    fields, then the KV bytes: the CRC streams, so this equals a CRC of their concatenation).
    ``tokens``: the page's token ids as int64 bytes when the caller packed them already."""
    kv = page.kv
    head = b"".join(
        (
            page.key,
            page.parent or b"",
            _token_bytes(page) if tokens is None else tokens,
            _NO_KV if kv is None else struct.pack("<5I", *_shape(kv)) + _dtype_name(kv),
        )
    )
    crc: int = google_crc32c.extend(_namespace_crc(namespace_id), head)
    return crc if kv is None else int(google_crc32c.extend(crc, _kv_bytes(kv)))


def encode_page(namespace_id: str, page: PageData) -> bytes:
    """The byte form of ``page`` (its ``kv`` on the host), ending in its checksum."""
    ns, parent, dtype = namespace_id.encode(), page.parent or b"", _dtype_name(page.kv)
    head = _HEAD.pack(
        _MAGIC,
        PAGE_FORMAT_VERSION,
        len(ns),
        len(page.key),
        len(parent),
        page.num_tokens,
        len(dtype),
        *_shape(page.kv),
    )
    tokens = _token_bytes(page)
    kv = cast(bytes, _kv_bytes(page.kv))  # an array over the KV: a buffer join takes
    body = b"".join((head, ns, page.key, parent, dtype, tokens, kv))
    return body + _CRC.pack(page_checksum(namespace_id, page, tokens))


def decode_page(namespace_id: str, data: bytes | memoryview) -> PageData:
    """The page ``data`` holds; :class:`CorruptPageError` for anything wrong with it (a
    damaged header field that no check names, e.g. a dtype name that is not text or a zero in
    the shape, is reported as undecodable rather than escaping as another error)."""
    try:
        return _decode(namespace_id, memoryview(data))
    except CorruptPageError:
        raise
    except (ValueError, RuntimeError, TypeError, OverflowError, struct.error) as exc:
        raise CorruptPageError(f"undecodable page: {exc}") from exc


def _decode(namespace_id: str, view: memoryview) -> PageData:
    if len(view) < _HEAD.size + _CRC.size:
        raise CorruptPageError(f"truncated page: {len(view)} bytes")
    magic, version, ns_len, key_len, parent_len, num_tokens, dtype_len, *shape = _HEAD.unpack(
        view[: _HEAD.size]
    )
    if magic != _MAGIC:
        raise CorruptPageError("not a kvplug page (bad magic)")
    if version != PAGE_FORMAT_VERSION:
        raise CorruptPageError(f"page format version {version}, expected {PAGE_FORMAT_VERSION}")
    pos = _HEAD.size
    fields = []
    for length in (ns_len, key_len, parent_len, dtype_len, 8 * num_tokens):
        fields.append(bytes(view[pos : pos + length]))
        pos += length
    ns, key, parent, dtype_name, tokens = fields
    if ns != namespace_id.encode():
        raise CorruptPageError(f"page of namespace {ns!r}, expected {namespace_id!r}")
    kv: torch.Tensor | None = None
    if dtype_name:
        dtype = getattr(torch, dtype_name.decode(), None)
        if not isinstance(dtype, torch.dtype):
            raise CorruptPageError(f"unknown dtype {dtype_name!r}")
        numel = shape[0] * shape[1] * shape[2] * shape[3] * shape[4]
        size = numel * torch.empty(0, dtype=dtype).element_size()
        if len(view) != pos + size + _CRC.size:
            raise CorruptPageError(f"page of {len(view)} bytes, its header says {pos + size + 4}")
        raw = torch.frombuffer(bytearray(view[pos : pos + size]), dtype=torch.uint8)
        kv = raw.view(dtype).view(*shape)
        pos += size
    elif len(view) != pos + _CRC.size:
        raise CorruptPageError(f"page of {len(view)} bytes, its header says {pos + 4}")
    ids = array("q")
    ids.frombytes(tokens)
    page = PageData(key=key, token_ids=tuple(ids), parent=parent or None, kv=kv)
    (page.checksum,) = _CRC.unpack(view[pos : pos + _CRC.size])
    return page


def check_page(
    namespace_id: str,
    page: object,
    key: bytes,
    token_ids: Sequence[int],
    kv_shape: tuple[int, ...] | None,
    kv_dtype: torch.dtype | None,
) -> PageData:
    """``page`` if it is the page stored under ``key`` for these tokens and this geometry,
    intact; else :class:`CorruptPageError` naming what is wrong. ``kv_shape=None``: a
    bookkeeping page (no KV expected)."""
    if not isinstance(page, PageData):
        raise CorruptPageError(f"a tier returned {type(page).__name__}, not a PageData")
    if page.key != key:
        raise CorruptPageError("page stored under another key")
    if tuple(page.token_ids) != tuple(token_ids):
        raise CorruptPageError("page holds other tokens than the request's")
    if kv_shape is None:
        if page.kv is not None:
            raise CorruptPageError("a KV page where a bookkeeping page was expected")
    else:
        if page.kv is None or tuple(page.kv.shape) != kv_shape:
            got = None if page.kv is None else tuple(page.kv.shape)
            raise CorruptPageError(f"page KV of shape {got}, expected {kv_shape}")
        if page.kv.dtype != kv_dtype:
            raise CorruptPageError(f"page KV of dtype {page.kv.dtype}, expected {kv_dtype}")
    if page_checksum(namespace_id, page) != page.checksum:
        raise CorruptPageError("checksum mismatch")
    return page
