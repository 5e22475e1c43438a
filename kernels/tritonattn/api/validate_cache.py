"""Validation of KV-cache calls: the tensors, the lengths (an int, host or device tensors), left
padding, block tables and cache_batch_idx, each checked before any launch.

[Note] Lengths on the device. cache_seqlens is read by the kernel, clamped to [0, N_CACHE]: a bad
device length can give wrong results but never a read or write outside the buffers; appends past
N_CACHE are dropped. Lengths known on the host (an int, a CPU tensor, KVCache, PagedKVCache) are
checked before launch and overflow raises ValueError. cache_leftpad likewise: a device tensor is
clamped to [0, cache_seqlens[b]] in the kernels, a CPU one checked on the host (`resolve_cache_leftpad`).
"""

from __future__ import annotations

import functools
import numbers
from typing import Optional, Tuple

import numpy as np
import torch

from ..errors import InputError, InputTypeError
from ..launch.rotary import Rotary
from .validate import (
    check_block_table_entries,
    validate_devices,
    validate_head_dim,
    validate_heads,
    validate_kv_dtypes,
    validate_tensor,
)


@functools.lru_cache(maxsize=256)
def _filled_seqlens_cached(value: int, batch: int, device: torch.device) -> torch.Tensor:
    return torch.full((batch,), value, dtype=torch.int32, device=device)


def filled_seqlens(value: int, batch: int, device: torch.device) -> torch.Tensor:
    """An int cache_seqlens as an int32 (batch,) tensor on `device`, cached per (value, batch, device).

    Never cached while a CUDA graph is being captured: the fill would only run on replay.
    """
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return torch.full((batch,), value, dtype=torch.int32, device=device)
    return _filled_seqlens_cached(value, batch, device)


def check_host_lengths(lengths, seqlen_new: int, seqlen_cache: int, capacity: Optional[str] = None) -> None:
    """Raise ValueError if a host-known length is negative or the append would pass seqlen_cache.

    `lengths` is an int (every request) or a CPU tensor / numpy array of per-request lengths;
    `capacity` names seqlen_cache in the message (a paged cache: max_blocks_per_seq * page_size).
    """
    if isinstance(lengths, int):
        lo, hi = lengths, lengths
    else:
        if len(lengths) == 0:  # an empty batch: no length to check
            return
        lo, hi = int(lengths.min()), int(lengths.max())
    if lo >= 0 and hi + seqlen_new <= seqlen_cache:
        return
    if isinstance(lengths, int):
        which, length = "every request", lengths
    else:
        values = np.asarray(lengths.tolist() if isinstance(lengths, torch.Tensor) else lengths)
        bad = np.nonzero((values < 0) | (values + seqlen_new > seqlen_cache))[0]
        which, length = f"request {int(bad[0])}", int(values[bad[0]])
        if len(bad) > 1:
            which += f" (and {len(bad) - 1} more)"
    if length < 0:
        raise InputError(f"Expected cache_seqlens >= 0, got {length} for {which}.")
    if capacity is None:
        raise InputError(
            f"KV cache overflow for {which}: cache_seqlens {length} + {seqlen_new} new tokens = "
            f"{length + seqlen_new} > seqlen_cache {seqlen_cache}; allocate a longer cache or reset the request."
        )
    raise InputError(
        f"KV cache overflow for {which}: cache_seqlens {length} + {seqlen_new} new tokens = "
        f"{length + seqlen_new} > {capacity} = {seqlen_cache}; give the block table more columns."
    )


def resolve_cache_seqlens(cache_seqlens, batch: int, seqlen_new: int, seqlen_cache: int,
                           device: torch.device, capacity: Optional[str] = None) -> torch.Tensor:
    """Validate cache_seqlens and return it as an int32 (batch,) tensor on `device`.

    Host-known lengths (an int, a CPU tensor) are checked for overflow; a tensor already on the
    CUDA device is used as is (checking it would need a host sync; the kernel clamps instead).
    """
    if isinstance(cache_seqlens, torch.Tensor):
        if cache_seqlens.dtype != torch.int32:
            raise InputTypeError(
                f"Expected cache_seqlens to be an int32 tensor (flash-attn's convention), got {cache_seqlens.dtype}; "
                f"use cache_seqlens.to(torch.int32)."
            )
        if cache_seqlens.shape != (batch,):
            raise InputError(f"Expected cache_seqlens of shape ({batch},), got {tuple(cache_seqlens.shape)}.")
        if batch > 1 and cache_seqlens.stride(0) != 1:
            raise InputError(
                f"Expected a contiguous cache_seqlens, got stride {cache_seqlens.stride(0)}; the kernel reads "
                f"request b's length at offset b. Pass cache_seqlens.contiguous() (and advance that tensor)."
            )
        if cache_seqlens.device.type == "cpu":  # host-known: check, then copy if the call runs on a GPU
            check_host_lengths(cache_seqlens, seqlen_new, seqlen_cache, capacity)
            return cache_seqlens if device.type == "cpu" else cache_seqlens.to(device)
        if cache_seqlens.device != device:
            raise InputError(
                f"Expected cache_seqlens on {device} (or on the CPU), got it on {cache_seqlens.device}."
            )
        return cache_seqlens
    if isinstance(cache_seqlens, numbers.Integral) and not isinstance(cache_seqlens, bool):
        value = int(cache_seqlens)
        check_host_lengths(value, seqlen_new, seqlen_cache, capacity)
        return filled_seqlens(value, batch, device)
    raise InputTypeError(f"Expected cache_seqlens to be an int or an int32 tensor, got {type(cache_seqlens).__name__}.")


def resolve_cache_leftpad(cache_leftpad, q, k_cache, cache_seqlens) -> torch.Tensor:
    """Validate cache_leftpad (int32 (batch,), on q's device or on the CPU) and return it contiguous on
    q's device. A CPU cache_leftpad is checked on the host: 0 <= cache_leftpad[b] <= cache_seqlens[b]
    when the lengths are host-known too (None: seqlen_cache, an int, a CPU tensor), else <= seqlen_cache.
    A device tensor is trusted: the kernels clamp each entry into [0, cache_seqlens[b]] (no host sync)."""
    validate_tensor("q", q, 4, "(batch, seqlen_q, nheads, headdim)")
    if not isinstance(cache_leftpad, torch.Tensor):
        raise InputTypeError(f"Expected cache_leftpad to be an int32 tensor of shape (batch,), got "
                             f"{type(cache_leftpad).__name__}.")
    if cache_leftpad.dtype != torch.int32:
        raise InputTypeError(f"Expected cache_leftpad to be an int32 tensor (flash-attn's convention), got "
                             f"{cache_leftpad.dtype}; use cache_leftpad.to(torch.int32).")
    batch = q.shape[0]
    if cache_leftpad.shape != (batch,):
        raise InputError(f"Expected cache_leftpad of shape ({batch},) (the first key row of each request), got "
                         f"{tuple(cache_leftpad.shape)}.")
    if cache_leftpad.device.type != "cpu":
        if cache_leftpad.device != q.device:
            raise InputError(f"Expected cache_leftpad on {q.device} (or on the CPU), got it on {cache_leftpad.device}.")
        return cache_leftpad.contiguous()
    validate_tensor("k_cache", k_cache, 4, "(batch, seqlen_cache, nheads_k, headdim)")
    # the bound: host-known lengths (an int, a CPU tensor), else the allocated seqlen_cache
    ends, what = torch.full((batch,), k_cache.shape[1], dtype=torch.int64), "seqlen_cache"
    if isinstance(cache_seqlens, numbers.Integral) and not isinstance(cache_seqlens, bool):
        ends, what = torch.full((batch,), int(cache_seqlens), dtype=torch.int64), "cache_seqlens[b]"
    elif (isinstance(cache_seqlens, torch.Tensor) and cache_seqlens.device.type == "cpu"
          and cache_seqlens.shape == (batch,) and not cache_seqlens.is_floating_point()):
        ends, what = cache_seqlens.to(torch.int64), "cache_seqlens[b]"
    left = cache_leftpad.to(torch.int64)
    bad = ((left < 0) | (left > ends)).nonzero()
    if len(bad):
        b = int(bad[0])
        raise InputError(
            f"Expected 0 <= cache_leftpad[b] <= {what} (cache_seqlens is where a request's keys end, its "
            f"padding included), got cache_leftpad[{b}] = {int(left[b])} with {what.replace('[b]', f'[{b}]')} = "
            f"{int(ends[b])}."
        )
    return cache_leftpad.contiguous().to(q.device)


def resolve_paging(block_table, cache_seqlens, batch: int, seqlen_new: int, k_cache: torch.Tensor,
                    device: torch.device, window_left: int = -1,
                    seqlen_q: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
    """Validate a paged call's block_table and cache_seqlens; return both on `device`.

    Checks on the host what is host-visible: the lengths (overflow past max_blocks_per_seq *
    page_size) and a CPU block_table's entries (`check_block_table_entries`; with a window's left
    side and seqlen_q, not the pages before each request's band), then copies them to the GPU. A
    block_table already on the GPU is used as is (the kernel clamps its entries).
    """
    validate_tensor("block_table", block_table, 2, "(batch, max_blocks_per_seq)")
    if block_table.dtype != torch.int32:
        raise InputTypeError(
            f"Expected block_table to be an int32 tensor (flash-attn's convention), got {block_table.dtype}; "
            f"use block_table.to(torch.int32)."
        )
    if block_table.shape[0] != batch or block_table.shape[1] < 1:
        raise InputError(
            f"Expected block_table of shape (batch, max_blocks_per_seq) = ({batch}, >= 1), got "
            f"{tuple(block_table.shape)}."
        )
    num_blocks, page_size = k_cache.shape[0], k_cache.shape[1]
    if num_blocks < 1 or page_size < 1:
        raise InputError(
            f"Expected a paged k_cache (num_blocks, page_size, nheads_k, headdim) with num_blocks >= 1 and "
            f"page_size >= 1, got {tuple(k_cache.shape)}."
        )
    capacity = block_table.shape[1] * page_size
    seqlens = resolve_cache_seqlens(cache_seqlens, batch, seqlen_new, capacity, device,
                                     f"max_blocks_per_seq * page_size = {block_table.shape[1]} * {page_size}")
    if block_table.device.type == "cpu":  # host-visible: check the entries this call uses, then copy
        if isinstance(cache_seqlens, torch.Tensor):
            host_lengths = cache_seqlens if cache_seqlens.device.type == "cpu" else None
        else:
            host_lengths = int(cache_seqlens)
        check_block_table_entries(block_table, host_lengths, seqlen_new, page_size, num_blocks, window_left,
                                   seqlen_q)
        return seqlens, (block_table if device.type == "cpu" else block_table.to(device))
    if block_table.device != device:
        raise InputError(f"Expected block_table on {device} (or on the CPU), got it on {block_table.device}.")
    return seqlens, block_table


def validate_kvcache_inputs(q, k_cache, v_cache, k, v, paged: bool = False) -> bool:
    """The tensors of a KV-cache call (shapes, strides, dtypes, devices); returns whether the cache is FP8
    (`validate_kv_dtypes`)."""
    validate_tensor("q", q, 4, "(batch, seqlen_q, nheads, headdim)")
    layout = "(num_blocks, page_size, nheads_k, headdim)" if paged else "(batch, seqlen_cache, nheads_k, headdim)"
    validate_tensor("k_cache", k_cache, 4, layout)
    validate_tensor("v_cache", v_cache, 4, layout)
    if (k is None) != (v is None):
        raise InputError("Expected k and v to be both given (append, then attend) or both None (attend only).")
    if k is not None:
        layout = "(batch, seqlen_new, nheads_k, headdim)"
        validate_tensor("k", k, 4, layout)
        validate_tensor("v", v, 4, layout)
    kv_fp8 = validate_kv_dtypes(q, k_cache, v_cache, k, v)
    validate_devices(q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v)
    batch, seqlen_q, nheads, head_dim = q.shape
    if k_cache.shape != v_cache.shape:
        raise InputError(
            f"Expected k_cache and v_cache to have the same shape, got {tuple(k_cache.shape)} and "
            f"{tuple(v_cache.shape)}."
        )
    if not paged and k_cache.shape[0] != batch:
        raise InputError(
            f"Expected k_cache's batch ({k_cache.shape[0]}) to match q's ({batch}); cache_batch_idx maps requests "
            f"to other cache rows."
        )
    if k_cache.shape[3] != head_dim:
        raise InputError(f"Expected q and k_cache to share the head dim, got {head_dim} and {k_cache.shape[3]}.")
    if seqlen_q < 1:
        raise InputError(f"Expected seqlen_q >= 1, got q of shape {tuple(q.shape)}.")
    validate_head_dim(head_dim)
    validate_heads(nheads, k_cache.shape[2])
    if k is not None:
        if k.shape != v.shape:
            raise InputError(f"Expected k and v to have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}.")
        seqlen_new = k.shape[1]
        expected = (batch, seqlen_new, k_cache.shape[2], head_dim)
        if tuple(k.shape) != expected or not 1 <= seqlen_new <= seqlen_q:
            raise InputError(
                f"Expected k and v of shape (batch, seqlen_new, nheads_k, headdim) = (batch={batch}, "
                f"1 <= seqlen_new <= seqlen_q={seqlen_q}, nheads_k={k_cache.shape[2]}, headdim={head_dim}), got "
                f"{tuple(k.shape)}."
            )
    return kv_fp8


def batch_idx_as_table(cache_batch_idx, block_table, q, k_cache) -> torch.Tensor:
    """cache_batch_idx as a block table: a dense cache (batch_cache, seqlen_cache, ...) is a pool of
    batch_cache pages of seqlen_cache rows, and request b's one page is cache_batch_idx[b]."""
    if block_table is not None:
        raise InputError("Expected cache_batch_idx or block_table, not both (flash-attn's rule: a paged cache "
                         "has no batch index).")
    if isinstance(cache_batch_idx, torch.Tensor):
        cache_batch_idx = cache_batch_idx.contiguous()
    validate_tensor("cache_batch_idx", cache_batch_idx, 1, "(batch,)")
    validate_tensor("k_cache", k_cache, 4, "(batch_cache, seqlen_cache, nheads_k, headdim)")
    if cache_batch_idx.dtype != torch.int32:
        raise InputTypeError(f"Expected cache_batch_idx of dtype int32, got {cache_batch_idx.dtype}.")
    if cache_batch_idx.shape[0] != q.shape[0]:
        raise InputError(f"Expected cache_batch_idx of shape ({q.shape[0]},), got {tuple(cache_batch_idx.shape)}.")
    if cache_batch_idx.device.type == "cpu" and cache_batch_idx.numel() and not (
            0 <= int(cache_batch_idx.min()) and int(cache_batch_idx.max()) < k_cache.shape[0]):
        raise InputError(f"Expected cache_batch_idx entries in [0, {k_cache.shape[0]}) (the cache's batch), got "
                         f"{cache_batch_idx.tolist()}.")
    return cache_batch_idx.reshape(-1, 1).contiguous()


def validate_num_splits(num_splits) -> None:
    if not isinstance(num_splits, numbers.Integral) or num_splits < 0:
        raise InputError(f"Expected num_splits to be an int >= 0 (0 = heuristic), got {num_splits!r}.")


def validate_rotary(q, k, v, rotary_cos, rotary_sin, capacity: int, interleaved) -> Rotary:
    """flash_attn_with_kvcache's rotary arguments (see launch/rotary.py for the layout), checked against
    the validated q and k: both tables, of q's dtype and device, one shape (seqlen_ro, rotary_dim / 2)
    covering every cache position, rotary_dim a multiple of 16 up to the head dim, new k and v given."""
    if rotary_cos is None or rotary_sin is None:
        raise InputError("Expected rotary_cos and rotary_sin together.")
    if k is None or v is None:
        raise InputError("Expected new k and v with rotary_cos / rotary_sin: the rotary embedding applies to the "
                         "appended keys (flash-attn's rule).")
    for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
        validate_tensor(name, t, 2, "(seqlen_ro, rotary_dim / 2)")
        if t.dtype != q.dtype or t.device != q.device:
            raise InputError(f"Expected {name} of q's dtype and device ({q.dtype}, {q.device}), got {t.dtype} on "
                             f"{t.device}.")
    if rotary_cos.shape != rotary_sin.shape:
        raise InputError(f"Expected rotary_cos and rotary_sin of one shape, got {tuple(rotary_cos.shape)} and "
                         f"{tuple(rotary_sin.shape)}.")
    rotary_dim = 2 * rotary_cos.shape[1]
    if rotary_dim % 16 or not 0 < rotary_dim <= q.shape[-1]:
        raise InputError(f"Expected rotary_dim = 2 * rotary_cos.shape[1] a multiple of 16 in [16, headdim="
                         f"{q.shape[-1]}], got {rotary_dim}.")
    if rotary_cos.shape[0] < capacity:
        raise InputError(f"Expected rotary_cos / rotary_sin to cover every cache position (seqlen_ro >= "
                         f"{capacity}), got seqlen_ro={rotary_cos.shape[0]}.")
    return Rotary(rotary_cos.contiguous(), rotary_sin.contiguous(), bool(interleaved))
