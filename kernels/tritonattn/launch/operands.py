"""The operands of a launch: 16-byte row alignment (what tensor descriptors and vector loads need) and
aligned copies, the (batch, row, head) strides of dense and packed tensors, the device context, and
the allocator of device-side tensor descriptors."""

from __future__ import annotations

import contextlib
from typing import Optional, Tuple

import torch
import triton

from ..config.hardware import Target, has_tma


# --------------------------------------------------------------------------------------------
# Row alignment
# --------------------------------------------------------------------------------------------
def rows_aligned(t: torch.Tensor) -> bool:
    """True when t's base and every outer stride are 16-byte multiples (what a tensor descriptor, and a
    vectorised row load, needs)."""
    size = t.element_size()
    return t.data_ptr() % 16 == 0 and all((s * size) % 16 == 0 for s in t.stride()[:-1])


def empty_aligned(shape, dtype: torch.dtype, device, *, zero: bool = False, aligned: bool = True) -> torch.Tensor:
    """An uninitialised (or, with zero, zeroed) tensor of `shape`; with `aligned` its rows are 16-byte
    multiples: for a last dim that is not, a view [..., :shape[-1]] of a buffer padded along the last dim."""
    shape = tuple(int(n) for n in shape)
    per_16_bytes = max(1, 16 // dtype.itemsize) if aligned else 1
    width = -(-shape[-1] // per_16_bytes) * per_16_bytes
    make = torch.zeros if zero else torch.empty
    return make((*shape[:-1], width), dtype=dtype, device=device)[..., : shape[-1]]


# ============================================================================================
# Launchers: validate, allocate, launch
# ============================================================================================
def _tma_allocator(size: int, alignment: int, stream: Optional[int]) -> torch.Tensor:
    """Scratch for device-side tensor descriptors (a few hundred bytes per program)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def ensure_tma_allocator() -> None:
    from triton.runtime import _allocation

    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(_tma_allocator)


def tma_planned(requested: bool, target: Optional[Target], dtype: torch.dtype) -> bool:
    """Tensor-descriptor loads: requested by the config, planned for a Hopper-or-newer GPU (`target`),
    2-byte dtypes."""
    return requested and target is not None and has_tma(target) and dtype.itemsize == 2


def tma_usable(requested: bool, target: Optional[Target], *tensors: torch.Tensor) -> bool:
    """`tma_planned`, and every tensor's base and outer strides 16-byte aligned (what descriptors need)."""
    return tma_planned(requested, target, tensors[0].dtype) and all(rows_aligned(t) for t in tensors)


def aligned_operands(planned: bool, *tensors: torch.Tensor) -> Tuple[torch.Tensor, ...]:
    """Where tensor descriptors are planned, each tensor whose rows are not 16-byte aligned (a head dim
    that is not a multiple of 8, an odd view) as a copy in an aligned buffer; the others as they are.

    A descriptor cannot address such a tensor, and the pointer path that could runs ~4x slower on Hopper
    (docs/perf-notes.md), while the copy costs one pass over the tensor.
    """
    if not planned:
        return tensors
    return tuple(t if rows_aligned(t) else empty_aligned(t.shape, t.dtype, t.device).copy_(t) for t in tensors)


def row_strides(t: torch.Tensor, packed: bool) -> Tuple[int, int, int]:
    """(batch, row, head) strides: a packed (total, heads, D) tensor has no batch dim (stride 0;
    each program moves to its sequence's first row itself)."""
    return (0, t.stride(0), t.stride(1)) if packed else (t.stride(0), t.stride(1), t.stride(2))


def on_device(t: torch.Tensor):
    """A context making t's CUDA device current (nothing for CPU tensors)."""
    return torch.cuda.device(t.device) if t.device.type == "cuda" else contextlib.nullcontext()
