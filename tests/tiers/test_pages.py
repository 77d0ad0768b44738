"""Stored pages: the byte form round-trips bit for bit, and every corruption is rejected."""

from __future__ import annotations

import struct

import pytest
import torch

from kvplug.tiers.pages import CorruptPageError, check_page, decode_page, encode_page
from kvplug_hookspecs import PAGE_FORMAT_VERSION, PageData

from .helpers import chain, kv_page, namespace, same_page

NS = namespace().id
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.uint8]


def _page(dtype: torch.dtype = torch.float16, page_size: int = 4) -> PageData:
    kv = (
        kv_page(7, page_size, torch.float32).to(dtype)
        if dtype != torch.uint8
        else (
            torch.arange(2 * 2 * page_size * 2 * 4, dtype=torch.int64)
            .remainder(256)
            .to(torch.uint8)
            .view(2, 2, page_size, 2, 4)
        )
    )
    page = PageData(b"k" * 32, tuple(range(10, 10 + page_size)), b"p" * 32, kv)
    from kvplug.tiers.pages import page_checksum

    page.checksum = page_checksum(NS, page)
    return page


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_is_exact(dtype):
    page = _page(dtype)
    data = encode_page(NS, page)
    back = decode_page(NS, data)
    assert back.kv is not None and back.kv.dtype == dtype and back.kv.shape == page.kv.shape
    assert same_page(back, page)
    checked = check_page(NS, back, page.key, page.token_ids, tuple(page.kv.shape), dtype)
    assert checked is back


def test_bookkeeping_page_round_trip():
    (page,) = chain(1, page_size=4, kv=False, ns=namespace())
    back = decode_page(NS, encode_page(NS, page))
    assert back.kv is None and same_page(back, page)
    assert check_page(NS, back, page.key, page.token_ids, None, None) is back
    # a first page has no parent, and stays without one
    assert back.parent is None


def test_non_contiguous_kv_encodes_its_values():
    page = _page(torch.float32)
    assert page.kv is not None
    strided = page.kv.transpose(3, 4).contiguous().transpose(3, 4)  # same values, other strides
    assert not strided.is_contiguous()
    other = PageData(page.key, page.token_ids, page.parent, strided, page.checksum)
    assert encode_page(NS, other) == encode_page(NS, page)


def _decode_and_check(data: bytes, page: PageData) -> None:
    assert page.kv is not None
    back = decode_page(NS, data)
    check_page(NS, back, page.key, page.token_ids, tuple(page.kv.shape), page.kv.dtype)


HEADER = struct.calcsize("<4sHHHHIH5I")


def _regions(page: PageData, data: bytes) -> dict[str, int]:
    """A byte offset inside each region of the byte form."""
    assert page.kv is not None
    ns, key, parent = len(NS), len(page.key), len(page.parent or b"")
    dtype = len(str(page.kv.dtype).removeprefix("torch."))
    tokens_at = HEADER + ns + key + parent + dtype
    kv_at = tokens_at + 8 * page.num_tokens
    return {
        "header": 12,  # inside num_tokens
        "namespace": HEADER + 3,
        "key": HEADER + ns + 5,
        "parent": HEADER + ns + key + 1,
        "tokens": tokens_at + 8,
        "kv_first": kv_at,
        "kv_last": len(data) - 5,
        "checksum": len(data) - 2,
    }


@pytest.mark.parametrize(
    "region",
    ["header", "namespace", "key", "parent", "tokens", "kv_first", "kv_last", "checksum"],
)
@pytest.mark.parametrize("bit", [0, 7])
def test_a_flipped_bit_anywhere_is_rejected(region, bit):
    page = _page()
    data = bytearray(encode_page(NS, page))
    data[_regions(page, bytes(data))[region]] ^= 1 << bit
    with pytest.raises(CorruptPageError):
        _decode_and_check(bytes(data), page)


def test_every_single_bit_flip_is_rejected():
    page = _page(torch.float16, page_size=1)
    data = encode_page(NS, page)
    for i in range(len(data) * 8):
        bad = bytearray(data)
        bad[i // 8] ^= 1 << (i % 8)
        with pytest.raises(CorruptPageError):
            _decode_and_check(bytes(bad), page)


@pytest.mark.parametrize("cut", [0, 1, 10, HEADER, HEADER + 20, -5, -4, -1])
def test_truncation_is_rejected(cut):
    page = _page()
    data = encode_page(NS, page)
    with pytest.raises(CorruptPageError):
        _decode_and_check(data[:cut], page)


def test_extra_bytes_are_rejected():
    page = _page()
    with pytest.raises(CorruptPageError, match="header says"):
        _decode_and_check(encode_page(NS, page) + b"\0", page)


def test_wrong_namespace_is_rejected():
    page = _page()
    other = namespace(model_id="another-model").id
    with pytest.raises(CorruptPageError, match="namespace"):
        decode_page(other, encode_page(NS, page))
    # a page checksummed under another namespace fails even if its bytes claim ours
    forged = encode_page(other, page)
    forged = forged.replace(other.encode(), NS.encode())
    with pytest.raises(CorruptPageError, match="checksum"):
        _decode_and_check(forged, page)


def test_wrong_version_and_magic_are_rejected():
    page = _page()
    data = bytearray(encode_page(NS, page))
    struct.pack_into("<H", data, 4, PAGE_FORMAT_VERSION + 1)
    with pytest.raises(CorruptPageError, match="version"):
        decode_page(NS, bytes(data))
    data = bytearray(encode_page(NS, page))
    data[0:4] = b"XXXX"
    with pytest.raises(CorruptPageError, match="magic"):
        decode_page(NS, bytes(data))


def test_wrong_key_tokens_shape_dtype_are_rejected():
    page = _page()
    assert page.kv is not None
    shape, dtype = tuple(page.kv.shape), page.kv.dtype
    back = decode_page(NS, encode_page(NS, page))
    with pytest.raises(CorruptPageError, match="another key"):
        check_page(NS, back, b"x" * 32, page.token_ids, shape, dtype)
    with pytest.raises(CorruptPageError, match="other tokens"):
        check_page(NS, back, page.key, (1, 2, 3, 4), shape, dtype)
    with pytest.raises(CorruptPageError, match="shape"):
        check_page(NS, back, page.key, page.token_ids, (2, 2, 4, 2, 8), dtype)
    with pytest.raises(CorruptPageError, match="dtype"):
        check_page(NS, back, page.key, page.token_ids, shape, torch.bfloat16)
    with pytest.raises(CorruptPageError, match="bookkeeping"):
        check_page(NS, back, page.key, page.token_ids, None, None)
    with pytest.raises(CorruptPageError, match="not a PageData"):
        check_page(NS, b"bytes", page.key, page.token_ids, shape, dtype)
    # a page whose KV changed after it was checksummed (a tier's memory corrupted in place)
    back.kv.view(torch.uint8)[0, 0, 0, 0, 0] ^= 1
    with pytest.raises(CorruptPageError, match="checksum"):
        check_page(NS, back, page.key, page.token_ids, shape, dtype)


def test_unknown_dtype_is_rejected():
    page = _page(torch.float32)
    data = encode_page(NS, page)
    # same length as "float32": a dtype name torch does not have
    bad = data.replace(b"float32", b"floatXX", 1)
    with pytest.raises(CorruptPageError, match="unknown dtype"):
        decode_page(NS, bad)
