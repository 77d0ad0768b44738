"""KV pools: device/dtype resolution, buffer shapes, set/get by slot, hybrid routing, errors."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

import kvplug
from kvplug.pools import HybridSWAKVPool, MHAKVPool, resolve_device, resolve_dtype
from kvplug_hookspecs import PoolGeometry

CPU = torch.device("cpu")


def make_pool(capacity_tokens: int = 8, **kw) -> MHAKVPool:
    """8 slots + 1 padding row, 2 layers, 2 heads of dim 4, float32 on the CPU."""
    args = {"num_layers": 2, "kv_heads": 2, "head_dim": 4, "dtype": "float32", "device": "cpu"}
    return MHAKVPool(capacity_tokens, **{**args, **kw})


# -- device and dtype -----------------------------------------------------------------------


def test_resolve_device_auto_follows_cuda_availability():
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == expected


def test_resolve_device_cpu_and_torch_device():
    assert resolve_device("cpu") == CPU
    assert resolve_device(torch.device("cpu")) == CPU


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error when CUDA is absent")
def test_resolve_device_unavailable_cuda_is_a_clear_error():
    with pytest.raises(ValueError, match="cuda.*torch.cuda.is_available\\(\\) is False"):
        resolve_device("cuda")
    with pytest.raises(ValueError, match="cuda:1"):
        resolve_device("cuda:1")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_resolve_device_cuda_gets_an_index_matching_tensor_devices():
    device = resolve_device("cuda")
    assert device.index is not None
    assert torch.zeros(1, device=device).device == device
    with pytest.raises(ValueError, match="CUDA device"):
        resolve_device(f"cuda:{torch.cuda.device_count()}")


def test_resolve_dtype():
    assert resolve_dtype("bfloat16") is torch.bfloat16
    assert resolve_dtype(torch.float16) is torch.float16
    with pytest.raises(ValueError, match="unsupported KV dtype 'int8'"):
        resolve_dtype("int8")
    with pytest.raises(ValueError, match="unsupported KV dtype torch.int32"):
        resolve_dtype(torch.int32)


# -- MHA pool -------------------------------------------------------------------------------


def test_buffers_have_capacity_plus_one_page_rows_and_exact_bytes():
    pool = MHAKVPool(
        64, num_layers=3, kv_heads=4, head_dim=8, page_size=16, dtype="bfloat16", device="cpu"
    )
    assert pool.num_rows == 80
    for layer in range(3):
        assert pool.get_k(layer).shape == (80, 4, 8)
        assert pool.get_v(layer).shape == (80, 4, 8)
        assert pool.get_k(layer).dtype is torch.bfloat16
        assert pool.get_k(layer).device == CPU
    per_buffer = 3 * 80 * 4 * 8 * 2
    assert pool.k_bytes == per_buffer
    assert pool.v_bytes == per_buffer
    assert pool.mem_bytes() == 2 * per_buffer == 30720


def test_from_geometry_uses_every_field():
    geometry = PoolGeometry(
        capacity_tokens=32,
        page_size=4,
        num_layers=2,
        kv_heads=3,
        head_dim=16,
        dtype="float32",
        device="cpu",
    )
    pool = MHAKVPool.from_geometry(geometry)
    assert (pool.capacity_tokens, pool.page_size, pool.num_layers) == (32, 4, 2)
    assert pool.get_k(1).shape == (36, 3, 16)
    assert pool.dtype is torch.float32
    assert pool.mem_bytes() == 2 * 2 * 36 * 3 * 16 * 4


def test_set_kv_writes_exactly_the_given_slots_of_the_given_layer():
    pool = make_pool()
    loc = torch.tensor([3, 1, 7])
    k = torch.arange(3 * 2 * 4, dtype=torch.float32).reshape(3, 2, 4)
    v = -k
    pool.set_kv(1, loc, k, v)
    assert torch.equal(pool.get_k(1)[loc], k)
    assert torch.equal(pool.get_v(1)[loc], v)
    untouched = torch.tensor([0, 2, 4, 5, 6, 8])
    assert not pool.get_k(1)[untouched].any()
    assert not pool.get_k(0).any() and not pool.get_v(0).any()


def test_get_k_is_a_view_not_a_copy():
    pool = make_pool()
    pool.get_k(0)[5] = 2.0
    assert pool.get_k(0)[5].sum().item() == 2.0 * 2 * 4


def test_set_kv_casts_other_float_dtypes_to_the_pool_dtype():
    pool = make_pool(dtype="float16")
    k = torch.full((1, 2, 4), 1.5, dtype=torch.float32)
    pool.set_kv(0, torch.tensor([2], dtype=torch.int32), k, k)
    assert pool.get_k(0).dtype is torch.float16
    assert pool.get_k(0)[2].tolist() == [[1.5] * 4] * 2


def test_fp8_pool_stores_bytes_and_reads_fp8():
    pool = make_pool(dtype="float8_e4m3fn")
    assert pool.mem_bytes() == 2 * 2 * 9 * 2 * 4 * 1
    k = torch.full((2, 2, 4), 0.5, dtype=torch.bfloat16)
    pool.set_kv(1, torch.tensor([1, 8]), k, 2 * k)
    assert pool.get_k(1).dtype is torch.float8_e4m3fn
    assert pool.get_k(1)[torch.tensor([1, 8])].float().tolist() == [[[0.5] * 4] * 2] * 2
    assert pool.get_v(1)[8].float().tolist() == [[1.0] * 4] * 2


@pytest.mark.parametrize(
    "layer, loc, k, error, match",
    [
        (
            2,
            torch.tensor([1]),
            torch.zeros(1, 2, 4),
            ValueError,
            "layer 2 out of range: this pool has 2",
        ),
        (-1, torch.tensor([1]), torch.zeros(1, 2, 4), ValueError, "layer -1 out of range"),
        (True, torch.tensor([1]), torch.zeros(1, 2, 4), TypeError, "layer must be an int"),
        (0, [1], torch.zeros(1, 2, 4), TypeError, "loc must be a torch.Tensor"),
        (0, torch.tensor([1.0]), torch.zeros(1, 2, 4), TypeError, "loc has dtype torch.float32"),
        (0, torch.tensor([[1]]), torch.zeros(1, 2, 4), ValueError, "loc must be 1-D"),
        (
            0,
            torch.tensor([1, 2]),
            torch.zeros(1, 2, 4),
            ValueError,
            r"k has shape \(1, 2, 4\), expected \(2, 2, 4\)",
        ),
        (0, torch.tensor([1]), torch.zeros(1, 8), ValueError, "k has shape"),
        (
            0,
            torch.tensor([1]),
            torch.zeros(1, 2, 4, dtype=torch.int32),
            TypeError,
            "k has dtype torch.int32",
        ),
        (0, torch.tensor([1]), "k", TypeError, "k must be a torch.Tensor"),
    ],
)
def test_set_kv_rejects_bad_input_and_writes_nothing(layer, loc, k, error, match):
    pool = make_pool()
    with pytest.raises(error, match=match):
        pool.set_kv(layer, loc, k, torch.ones(1, 2, 4))
    assert not pool.get_k(0).any() and not pool.get_v(0).any()
    assert not pool.get_k(1).any() and not pool.get_v(1).any()


def test_set_kv_rejects_v_of_wrong_shape():
    pool = make_pool()
    with pytest.raises(ValueError, match="v has shape"):
        pool.set_kv(0, torch.tensor([1]), torch.ones(1, 2, 4), torch.ones(2, 2, 4))
    assert not pool.get_k(0).any()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a second device")
def test_set_kv_rejects_tensors_on_another_device():
    pool = make_pool()
    with pytest.raises(ValueError, match="loc are on cuda"):
        pool.set_kv(0, torch.tensor([1], device="cuda"), torch.ones(1, 2, 4), torch.ones(1, 2, 4))
    with pytest.raises(ValueError, match="k is on cuda"):
        pool.set_kv(0, torch.tensor([1]), torch.ones(1, 2, 4, device="cuda"), torch.ones(1, 2, 4))


@pytest.mark.parametrize(
    "kw, error, match",
    [
        ({"capacity_tokens": 0}, ValueError, "capacity_tokens must be >= 1, got 0"),
        (
            {"capacity_tokens": 10, "page_size": 4},
            ValueError,
            "capacity_tokens=10 is not a multiple of page_size=4",
        ),
        ({"page_size": 0}, ValueError, "page_size must be >= 1"),
        ({"kv_heads": 0}, ValueError, "kv_heads must be >= 1"),
        ({"head_dim": 2.0}, TypeError, "head_dim must be an int"),
        ({"num_layers": -1}, ValueError, "num_layers must be >= 0"),
        ({"dtype": "int8"}, ValueError, "unsupported KV dtype"),
    ],
)
def test_bad_pool_arguments_are_clear_errors(kw, error, match):
    with pytest.raises(error, match=match):
        make_pool(**kw)


def test_geometry_rejects_capacity_zero_and_non_dividing_page_size():
    with pytest.raises(ValidationError, match="capacity_tokens"):
        PoolGeometry(capacity_tokens=0)
    with pytest.raises(
        ValidationError, match="capacity_tokens=10 is not a multiple of page_size=4"
    ):
        PoolGeometry(capacity_tokens=10, page_size=4)


# -- hybrid SWA pool ------------------------------------------------------------------------


def make_hybrid() -> HybridSWAKVPool:
    return HybridSWAKVPool(
        16,
        4,
        full_layer_ids=[1, 3],
        swa_layer_ids=[0, 2],
        kv_heads=1,
        head_dim=2,
        dtype="float32",
        device="cpu",
    )


def test_hybrid_pool_sizes_each_side_and_counts_bytes():
    pool = make_hybrid()
    assert pool.num_layers == 4
    assert pool.full.get_k(0).shape == (17, 1, 2)
    assert pool.swa.get_k(0).shape == (5, 1, 2)
    assert pool.get_k(3).shape == (17, 1, 2)
    assert pool.get_k(2).shape == (5, 1, 2)
    assert pool.mem_bytes() == 2 * 2 * (17 + 5) * 2 * 4 == 704
    assert pool.k_bytes + pool.v_bytes == 704
    assert [pool.is_swa_layer(i) for i in range(4)] == [True, False, True, False]


def test_hybrid_pool_routes_global_layer_ids():
    pool = make_hybrid()
    pool.set_kv(2, torch.tensor([4]), torch.ones(1, 1, 2), torch.full((1, 1, 2), 2.0))
    pool.set_kv(3, torch.tensor([16]), torch.full((1, 1, 2), 3.0), torch.full((1, 1, 2), 4.0))
    assert pool.swa.get_k(1)[4].tolist() == [[1.0, 1.0]]  # global layer 2 is the 2nd window layer
    assert pool.get_v(2)[4].tolist() == [[2.0, 2.0]]
    assert pool.full.get_k(1)[16].tolist() == [[3.0, 3.0]]  # global layer 3 is the 2nd full layer
    assert pool.get_kv(3)[1][16].tolist() == [[4.0, 4.0]]
    assert not pool.swa.get_k(0).any() and not pool.full.get_k(0).any()


def test_hybrid_pool_window_layers_are_indexed_by_window_slots():
    pool = make_hybrid()
    with pytest.raises(IndexError):
        pool.set_kv(0, torch.tensor([16]), torch.ones(1, 1, 2), torch.ones(1, 1, 2))


@pytest.mark.parametrize(
    "full, swa, match",
    [
        ([0, 1], [1, 2], "each layer in exactly one list"),
        ([0], [2], "must split layers 0..1"),
        ([0, 1], [], "swa_layer_ids is empty"),
    ],
)
def test_hybrid_pool_rejects_bad_layer_splits(full, swa, match):
    with pytest.raises(ValueError, match=match):
        HybridSWAKVPool(
            8, 4, full_layer_ids=full, swa_layer_ids=swa, kv_heads=1, head_dim=2, device="cpu"
        )


def test_hybrid_pool_unknown_layer_is_a_clear_error():
    with pytest.raises(ValueError, match="layer 4 out of range: this pool has 4 layer"):
        make_hybrid().get_k(4)


def test_hybrid_pool_allows_all_window_layers():
    pool = HybridSWAKVPool(
        8, 4, full_layer_ids=[], swa_layer_ids=[0, 1], kv_heads=1, head_dim=2, device="cpu"
    )
    assert pool.full.num_layers == 0 and pool.swa.num_layers == 2
    assert pool.full.mem_bytes() == 0


def test_a_pool_without_kv_keeps_slots_but_no_memory():
    stack = kvplug.build(
        {"pool": {"capacity_tokens": 3_000_000, "store_kv": False, "device": "cpu"}}
    )
    assert stack.pool.mem_bytes() == 0
    assert stack.allocator.available_size() == 3_000_000
    assert stack.allocator.alloc(5).tolist() == [1, 2, 3, 4, 5]
    with pytest.raises(RuntimeError, match="keeps no K/V"):
        stack.pool.get_k(0)


def test_a_hybrid_pool_without_kv_holds_no_memory_on_either_side():
    stack = kvplug.build(
        {
            "allocator": {
                "name": "swa",
                "options": {"swa_capacity_tokens": 64, "sliding_window_size": 8},
            },
            "prefix_cache": "swa_radix",
            "pool": {"capacity_tokens": 256, "num_layers": 2, "store_kv": False, "device": "cpu"},
        }
    )
    assert stack.pool.mem_bytes() == 0
    assert (stack.allocator.full_available_size(), stack.allocator.swa_available_size()) == (
        256,
        64,
    )


# -- whole pages out, a storage tier's layout ------------------------------------------------


def filled(pool: MHAKVPool) -> MHAKVPool:
    """Every element of the pool's K/V a distinct value."""
    kv = pool._kv
    kv.copy_(torch.arange(kv.numel(), dtype=torch.float32).view(kv.shape))
    return pool


def by_slots(pool: MHAKVPool, loc: torch.Tensor, page: int) -> torch.Tensor:
    """The reference: gather by slot, then each page's block contiguous."""
    kv = pool.read_slots(loc)
    two, layers, _, heads, dim = kv.shape
    return kv.view(two, layers, -1, page, heads, dim).permute(2, 0, 1, 3, 4, 5).contiguous()


@pytest.mark.parametrize(
    ("page", "slots"),
    [
        (1, [5, 2, 7]),
        (4, [8, 9, 10, 11, 4, 5, 6, 7]),  # aligned pages: one gather by page
        (4, [9, 10, 11, 12]),  # consecutive but not from a multiple of 4
        (4, [4, 5, 7, 6]),  # from a multiple of 4 but out of order
        (2, [3, 2, 10, 11]),
    ],
)
def test_read_pages_lays_out_each_page_as_one_block(page, slots):
    pool = filled(make_pool(16, page_size=page if page > 1 else 1))
    loc = torch.tensor(slots, dtype=torch.int64)
    got = pool.read_pages(loc, page)
    assert got.shape == (len(slots) // page, 2, 2, page, 2, 4)
    assert got.is_contiguous()
    assert torch.equal(got, by_slots(pool, loc, page))
    pool._kv.zero_()  # a copy: the slots may be reused at once
    assert got.abs().sum() > 0


def test_read_pages_refuses_a_partial_page():
    pool = make_pool(16, page_size=4)
    with pytest.raises(ValueError, match="6 slots are not whole pages of 4"):
        pool.read_pages(torch.arange(6), 4)
