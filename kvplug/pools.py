"""KV pools: the device tensors that hold every cached token's keys and values.

A pool is indexed by *slot*: the allocator hands out slot indices, the model writes K/V rows at
those slots with :meth:`MHAKVPool.set_kv` and attention reads whole per-layer buffers. As in
SGLang, each buffer has ``capacity + page_size`` rows: the first page (slot 0 for page size 1) is
the padding page that padded batch positions write into, so it is never handed out.

Memory is allocated once, at construction; nothing here allocates per step.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from kvplug_hookspecs import TORCH_DTYPES, PoolGeometry

__all__ = ["HybridSWAKVPool", "MHAKVPool", "check_index_tensor", "resolve_device", "resolve_dtype"]

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_INDEX_DTYPES = (torch.int64, torch.int32)


def resolve_device(name: str | torch.device = "auto") -> torch.device:
    """Turn a config device name into a ``torch.device``, failing early if it is not usable.

    ``"auto"`` is the current CUDA device when torch sees one, else the CPU. ``"cuda"`` gets its
    index filled in, so that it compares equal to ``tensor.device`` of tensors created on it.
    """
    device = torch.device(name) if name != "auto" else None
    if device is None:
        if not torch.cuda.is_available():
            return torch.device("cpu")
        device = torch.device("cuda")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"device {str(name)!r} requested but torch.cuda.is_available() is False"
            )
        index = torch.cuda.current_device() if device.index is None else device.index
        if index >= torch.cuda.device_count():
            raise ValueError(
                f"device {str(name)!r} requested but only "
                f"{torch.cuda.device_count()} CUDA device(s) exist"
            )
        return torch.device("cuda", index)
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(
            f"device {str(name)!r} requested but torch.backends.mps.is_available() is False"
        )
    if device.type == "xpu" and not (hasattr(torch, "xpu") and torch.xpu.is_available()):
        raise ValueError(f"device {str(name)!r} requested but torch.xpu.is_available() is False")
    return device


def resolve_dtype(name: str | torch.dtype) -> torch.dtype:
    """The torch dtype of a pool dtype name (one of ``kvplug_hookspecs.TORCH_DTYPES``)."""
    if isinstance(name, torch.dtype):
        if str(name).removeprefix("torch.") not in TORCH_DTYPES:
            raise ValueError(
                f"unsupported KV dtype {name}; expected one of {', '.join(TORCH_DTYPES)}"
            )
        return name
    if name not in TORCH_DTYPES:
        raise ValueError(
            f"unsupported KV dtype {name!r}; expected one of {', '.join(TORCH_DTYPES)}"
        )
    dtype: torch.dtype = getattr(torch, name)
    return dtype


def _check_count(value: int, what: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{what} must be >= {minimum}, got {value}")
    return value


@functools.lru_cache(maxsize=16)
def _arange(n: int) -> np.ndarray:
    """``0 .. n-1`` (a page's slot offsets), made once per page size."""
    return np.arange(n)


class MHAKVPool:
    """Per-layer K and V buffers of shape ``[capacity + page_size, kv_heads, head_dim]``.

    All layers live in one allocation (``[2, num_layers, rows, kv_heads, head_dim]``);
    ``get_k(layer)``/``get_v(layer)`` are views into it. fp8 pools store bytes (``uint8``) and
    hand out fp8 views, because indexed writes into fp8 tensors are not supported on every
    device/torch version.
    """

    def __init__(
        self,
        capacity_tokens: int,
        *,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        page_size: int = 1,
        dtype: str | torch.dtype = "float16",
        device: str | torch.device = "auto",
        store_kv: bool = True,
    ) -> None:
        self.capacity_tokens = _check_count(capacity_tokens, "capacity_tokens", 1)
        self.page_size = _check_count(page_size, "page_size", 1)
        if capacity_tokens % page_size:
            raise ValueError(
                f"capacity_tokens={capacity_tokens} is not a multiple of page_size={page_size}"
            )
        # 0 layers is allowed: a hybrid model may have no full-attention layers (all-SWA models).
        self.num_layers = _check_count(num_layers, "num_layers", 0)
        self.kv_heads = _check_count(kv_heads, "kv_heads", 1)
        self.head_dim = _check_count(head_dim, "head_dim", 1)
        self.dtype = resolve_dtype(dtype)
        self.device = resolve_device(device)
        self.num_rows = capacity_tokens + page_size
        store_dtype = torch.uint8 if self.dtype in _FP8 else self.dtype
        self.store_kv = bool(store_kv)
        self._kv = torch.zeros(
            (2, num_layers, self.num_rows if self.store_kv else 0, kv_heads, head_dim),
            dtype=store_dtype,
            device=self.device,
        )

    @classmethod
    def from_geometry(cls, geometry: PoolGeometry) -> MHAKVPool:
        """The pool a validated ``PoolGeometry`` describes."""
        return cls(
            geometry.capacity_tokens,
            num_layers=geometry.num_layers,
            kv_heads=geometry.kv_heads,
            head_dim=geometry.head_dim,
            page_size=geometry.page_size,
            dtype=geometry.dtype,
            device=geometry.device,
            store_kv=geometry.store_kv,
        )

    def _layer(self, layer: int) -> int:
        if isinstance(layer, bool) or not isinstance(layer, int):
            raise TypeError(f"layer must be an int, got {type(layer).__name__}")
        if not 0 <= layer < self.num_layers:
            raise ValueError(
                f"layer {layer} out of range: this pool has {self.num_layers} layer(s)"
            )
        if not self.store_kv:
            raise RuntimeError(
                "this pool keeps no K/V (store_kv=False: slot bookkeeping only, for simulation)"
            )
        return layer

    def get_k(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s key buffer, ``[rows, kv_heads, head_dim]`` (a view, no copy)."""
        return self._kv[0, self._layer(layer)].view(self.dtype)

    def get_v(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s value buffer, ``[rows, kv_heads, head_dim]`` (a view, no copy)."""
        return self._kv[1, self._layer(layer)].view(self.dtype)

    def get_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(get_k(layer), get_v(layer))``."""
        return self.get_k(layer), self.get_v(layer)

    def set_kv(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write ``k[i]``/``v[i]`` (``[n, kv_heads, head_dim]``) at slot ``loc[i]`` of ``layer``.

        Floating inputs of another dtype are cast to the pool dtype (as SGLang does for fp8
        caches). Slot values are not range-checked here: this is the per-layer hot path, and
        the slots come from the allocator.
        """
        layer = self._layer(layer)
        check_index_tensor(loc, self.device, "loc")
        shape = (loc.numel(), self.kv_heads, self.head_dim)
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if tuple(t.shape) != shape:
                raise ValueError(
                    f"{name} has shape {tuple(t.shape)}, expected {shape} "
                    "(len(loc), kv_heads, head_dim)"
                )
            if t.device != self.device:
                raise ValueError(f"{name} is on {t.device}, the pool is on {self.device}")
            if not t.is_floating_point():
                raise TypeError(f"{name} has dtype {t.dtype}; expected a floating dtype")
        self._kv[0, layer][loc] = self._to_store(k)
        self._kv[1, layer][loc] = self._to_store(v)

    def read_slots(self, loc: torch.Tensor) -> torch.Tensor:
        """Copy out the K/V of slots ``loc`` on every layer: ``[2, layers, len(loc), kv_heads,
        head_dim]`` in the stored dtype (bytes for fp8), on the pool's device.

        One gather for all layers; the copy is the pool's own, so the slots may be freed and
        reused as soon as this returns (a storage tier's demotion copies out this way).
        """
        check_index_tensor(loc, self.device, "loc")
        if not self.store_kv:
            raise RuntimeError("this pool keeps no K/V (store_kv=False)")
        return self._kv.index_select(2, loc)

    def read_pages(self, loc: torch.Tensor, page: int) -> torch.Tensor:
        """Copy out the K/V of the whole pages at slots ``loc`` (``page`` slots a page, in
        order): ``[pages, 2, layers, page, kv_heads, head_dim]``, each page one contiguous
        block, the layout a storage tier keeps a page in.

        On a CPU pool, pages that are ``page`` consecutive slots from a multiple of ``page`` (a
        paged allocator's) are gathered once, page by page, straight into that layout; other
        slots, and other devices, gather by slot and rearrange on the pool's device.
        """
        check_index_tensor(loc, self.device, "loc")
        if not self.store_kv:
            raise RuntimeError("this pool keeps no K/V (store_kv=False)")
        if page < 1 or loc.numel() % page:
            raise ValueError(f"{loc.numel()} slots are not whole pages of {page}")
        n = loc.numel() // page
        kv = self._kv
        if self.device.type == "cpu" and self.num_rows % page == 0:
            idx = loc.numpy()
            firsts = idx[::page]
            if page == 1 or (
                not (firsts % page).any()
                and (idx.reshape(n, page) - firsts[:, None] == _arange(page)).all()
            ):
                two, layers, rows, heads, dim = kv.shape
                blocks = kv.view(two, layers, rows // page, page, heads, dim)
                return blocks.permute(2, 0, 1, 3, 4, 5).index_select(
                    0, torch.from_numpy(firsts // page)
                )
        by_slot = kv.index_select(2, loc)
        two, layers, _, heads, dim = by_slot.shape
        return by_slot.view(two, layers, n, page, heads, dim).permute(2, 0, 1, 3, 4, 5).contiguous()

    def write_slots(self, loc: torch.Tensor, kv: torch.Tensor) -> None:
        """Write ``kv`` (``[2, layers, len(loc), kv_heads, head_dim]``, as ``read_slots`` returns
        it) at slots ``loc`` on every layer: a storage tier's load. Shape and dtype are checked."""
        check_index_tensor(loc, self.device, "loc")
        if not self.store_kv:
            raise RuntimeError("this pool keeps no K/V (store_kv=False)")
        shape = (2, self.num_layers, loc.numel(), self.kv_heads, self.head_dim)
        if not isinstance(kv, torch.Tensor) or tuple(kv.shape) != shape:
            got = tuple(kv.shape) if isinstance(kv, torch.Tensor) else type(kv).__name__
            raise ValueError(f"kv has shape {got}, expected {shape}")
        if kv.dtype != self._kv.dtype:
            raise TypeError(f"kv has dtype {kv.dtype}; the pool stores {self._kv.dtype}")
        self._kv.index_copy_(2, loc, kv.to(self.device, non_blocking=True))

    @property
    def store_dtype(self) -> torch.dtype:
        """The dtype the buffers hold (``uint8`` for fp8 pools)."""
        return self._kv.dtype

    def _to_store(self, t: torch.Tensor) -> torch.Tensor:
        t = t.to(self.dtype)
        return t.view(torch.uint8) if self.dtype in _FP8 else t

    @property
    def k_bytes(self) -> int:
        """Bytes of all key buffers."""
        return self._kv[0].numel() * self._kv.element_size()

    @property
    def v_bytes(self) -> int:
        """Bytes of all value buffers."""
        return self._kv[1].numel() * self._kv.element_size()

    def mem_bytes(self) -> int:
        """Device bytes this pool holds (keys + values, padding page included)."""
        return self.k_bytes + self.v_bytes

    def __repr__(self) -> str:
        return (
            f"MHAKVPool(capacity_tokens={self.capacity_tokens}, page_size={self.page_size}, "
            f"num_layers={self.num_layers}, kv_heads={self.kv_heads}, head_dim={self.head_dim}, "
            f"dtype={self.dtype}, device={self.device})"
        )


class HybridSWAKVPool:
    """Pools of a model that mixes full-attention and sliding-window (SWA) layers.

    Full layers live in ``full`` (``capacity_tokens`` slots), window layers in ``swa``
    (``swa_capacity_tokens`` slots, usually far fewer). ``set_kv/get_k/get_v`` take *global*
    layer ids and route them; for a window layer ``loc`` must already be window-pool slots
    (translate full slots with the SWA allocator's ``translate_loc_from_full_to_swa``).
    """

    def __init__(
        self,
        capacity_tokens: int,
        swa_capacity_tokens: int,
        *,
        full_layer_ids: Sequence[int],
        swa_layer_ids: Sequence[int],
        kv_heads: int,
        head_dim: int,
        page_size: int = 1,
        dtype: str | torch.dtype = "float16",
        device: str | torch.device = "auto",
        store_kv: bool = True,
    ) -> None:
        full_ids, swa_ids = tuple(full_layer_ids), tuple(swa_layer_ids)
        all_ids = sorted(full_ids + swa_ids)
        if all_ids != list(range(len(all_ids))):
            raise ValueError(
                f"full_layer_ids {list(full_ids)} and swa_layer_ids {list(swa_ids)} must split "
                f"layers 0..{len(all_ids) - 1} with each layer in exactly one list"
            )
        if not swa_ids:
            raise ValueError(
                "swa_layer_ids is empty: a model without window layers needs no hybrid pool"
            )
        self.full_layer_ids = full_ids
        self.swa_layer_ids = swa_ids
        self.num_layers = len(all_ids)
        kw: dict[str, Any] = {
            "kv_heads": kv_heads,
            "head_dim": head_dim,
            "page_size": page_size,
            "dtype": dtype,
            "device": device,
            "store_kv": store_kv,
        }
        self.full = MHAKVPool(capacity_tokens, num_layers=len(full_ids), **kw)
        self.swa = MHAKVPool(swa_capacity_tokens, num_layers=len(swa_ids), **kw)
        self.device, self.dtype, self.page_size = self.full.device, self.full.dtype, page_size
        self._route: dict[int, tuple[MHAKVPool, int]] = {
            **{g: (self.full, i) for i, g in enumerate(full_ids)},
            **{g: (self.swa, i) for i, g in enumerate(swa_ids)},
        }

    def route(self, layer_id: int) -> tuple[MHAKVPool, int]:
        """The pool holding global layer ``layer_id`` and the layer's index inside it."""
        try:
            return self._route[layer_id]
        except (KeyError, TypeError):
            raise ValueError(
                f"layer {layer_id!r} out of range: this pool has {self.num_layers} layer(s)"
            ) from None

    def is_swa_layer(self, layer_id: int) -> bool:
        """True when ``layer_id`` is a sliding-window layer."""
        return self.route(layer_id)[0] is self.swa

    def get_k(self, layer_id: int) -> torch.Tensor:
        pool, local = self.route(layer_id)
        return pool.get_k(local)

    def get_v(self, layer_id: int) -> torch.Tensor:
        pool, local = self.route(layer_id)
        return pool.get_v(local)

    def get_kv(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        pool, local = self.route(layer_id)
        return pool.get_kv(local)

    def set_kv(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write K/V of global layer ``layer_id``; window layers take window-pool slots."""
        pool, local = self.route(layer_id)
        pool.set_kv(local, loc, k, v)

    @property
    def k_bytes(self) -> int:
        return self.full.k_bytes + self.swa.k_bytes

    @property
    def v_bytes(self) -> int:
        return self.full.v_bytes + self.swa.v_bytes

    def mem_bytes(self) -> int:
        """Device bytes of both pools."""
        return self.full.mem_bytes() + self.swa.mem_bytes()

    def __repr__(self) -> str:
        return (
            f"HybridSWAKVPool(full={self.full!r}, swa={self.swa!r}, "
            f"full_layer_ids={list(self.full_layer_ids)}, swa_layer_ids={list(self.swa_layer_ids)})"
        )


def check_index_tensor(
    indices: object, device: torch.device, what: str = "indices"
) -> torch.Tensor:
    """Metadata-only checks of an index tensor (no device sync): type, dtype, rank, device."""
    if not isinstance(indices, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(indices).__name__}")
    if indices.dtype not in _INDEX_DTYPES:
        raise TypeError(f"{what} has dtype {indices.dtype}; expected torch.int64 or torch.int32")
    if indices.dim() != 1:
        raise ValueError(f"{what} must be 1-D, got shape {tuple(indices.shape)}")
    if indices.device != device:
        raise ValueError(f"{what} are on {indices.device}, expected {device}")
    return indices
