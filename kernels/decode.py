"""Decode attention: batched KV-cache decode with per-request lengths, fused in-place append, GQA
read-once and split-KV (flash-decoding), with no host synchronisation.

Algorithm: each request b of the batch brings seqlen_q new query tokens (1 for plain decoding, a few
for speculative verification) and attends over its own cache of L_b = cache_seqlens[b] keys plus,
when k/v are given, the seqlen_q new keys, which the same launch writes into the cache at
[L_b, L_b + seqlen_q). Decode is bound by memory bandwidth, so the kernel is organised so that every
cached K/V byte is read once:

- GQA read-once: a program owns one (request, KV head) and a block of query rows made of the G q
  heads that share that KV head times the seqlen_q tokens, so each K/V tile it loads serves all of
  them through one `tl.dot` (rows padded to at least 16).
- Split-KV (flash-decoding, Tri Dao, Daniel Haziza, Francisco Massa, Grigory Sizov, 2023): the
  cache is cut into num_splits chunks streamed by parallel programs; each writes a partial output
  and its log-sum-exp to fp32 scratch, and a small combine kernel merges them (`merge_partials` in
  kernels/_common.py). With one split the decode kernel writes the final output directly.
The streaming softmax and the masks are the prefill kernel's (`online_softmax`, `mask_scores`,
`finalize`), so prefill and decode cannot drift apart.

Notation:
    B batch, H q heads, H_KV KV heads, G = H // H_KV, M = seqlen_q (new tokens), D = head dim,
    D_PAD = next power of two >= D, N_CACHE = allocated seqlen_cache, L_b = cache_seqlens[b],
    N_b = L_b + M keys seen when appending (L_b without k/v).
    A program's query rows are r = g * M + t for g in [0, G) (q head h = kv_head * G + g) and t in
    [0, M) (the token), head-major; BLOCK_H >= 16 rows per program, several row blocks when G * M
    exceeds the config's max_rows.
    m_i running max (base 2) [BLOCK_H], l_i running sum [BLOCK_H], acc [BLOCK_H, D_PAD] fp32.

Supported: fp16/bf16 (fp32 accumulation), fp32; head dims that are multiples of 8 in [16, 256];
any seqlen_q >= 1; MHA/GQA/MQA; caches with any strides and a contiguous last dim (including a
(B, H_KV, S, D) buffer seen through .transpose(1, 2)); caches beyond 2^31 elements (int64 offsets).
Not supported (yet): paged caches (block_table), cache_batch_idx, rotary embedding, alibi, sliding
windows, softcapping. All K/V row addresses go through `_kv_row_offsets`, the one place a paged
cache has to change.

[Note] Fused append without hazards. The new keys/values are read from the k/v inputs, not from
the cache, by the program that owns them (the last split of each (request, KV head), first row
block), which also writes them into the cache. Every other program reads only cache rows [0, L_b),
so no program reads a row another program writes in the same launch.

[Note] Empty KV splits. The split size is a fixed multiple of BLOCK_N computed from the allocated
seqlen_cache and num_splits, never from the current lengths (they live on the device). A split
whose range starts at or past L_b runs no loop iteration and writes an empty partial (lse = -inf,
weight 0 in the merge). A request whose splits are all empty (L_b = 0, no append) outputs zeros and
LSE = +inf.

[Note] Causal with seqlen_q > 1. Bottom-right aligned over the N_b keys: token t sees key j iff
j <= t + N_b - M. With an append every cached key is visible to every token and only the new keys
are masked (token t sees new keys 0..t); without one, the last M - 1 cached keys are masked per row.

[Note] Host overhead. A decode step is a few microseconds of GPU time, so the wrapper caches all
it can: the launch plan per shape (`_plan`), the int -> tensor conversion of cache_seqlens, and the
compiled kernels, launched through their handles without Triton's per-call dispatch (`_LaunchCache`).

[Note] Lengths on the device. cache_seqlens is read by the kernel, clamped to [0, N_CACHE]: a bad
device length can give wrong results but never a read or write outside the buffers; appends past
N_CACHE are dropped. Lengths known on the host (an int, a CPU tensor, KVCache) are checked before
launch and overflow raises ValueError.
"""

from __future__ import annotations

import contextlib
import functools
import math
import numbers
import os
from typing import NamedTuple, Optional, Sequence, Tuple, Union

import numpy as np
import torch
import triton
import triton.language as tl

from ._common import finalize, load_rows, mask_scores, merge_partials, online_softmax, store_rows
from ._configs import decode_config, decode_num_splits
from ._utils import (
    SUPPORTED_DTYPES,
    _validate_devices,
    _validate_dtypes,
    _validate_head_dim,
    _validate_heads,
    _validate_softmax_scale,
    _validate_tensor,
    default_device,
    is_interpreter,
)

LOG2E = math.log2(math.e)


# ============================================================================================
# Kernels
# ============================================================================================
@triton.jit
def _kv_row_offsets(off_b, rows, stride_b, stride_n):
    """int64 element offsets of the logical cache rows `rows` [BLOCK] of request `off_b` (the KV
    head's offset is added by the caller).

    The one place that maps (request, position) to memory. A paged cache (block_table (B, max_blocks)
    int32 mapping logical page -> physical block, k_cache (num_blocks, page_size, H_KV, D)) replaces
    this body with a table look-up, stride_b becoming the stride of a physical block:
        page = tl.load(Block_table + off_b * stride_tb + rows // PAGE_SIZE)
        return page.to(tl.int64) * stride_b + (rows % PAGE_SIZE).to(tl.int64) * stride_n
    """
    return off_b * stride_b + rows.to(tl.int64) * stride_n


@triton.jit
def _decode_kernel(
    Q, K_cache, V_cache, K_new, V_new, Cache_seqlens, Out, Lse, Out_part, Lse_part,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_knb, stride_knm, stride_knh,
    stride_vnb, stride_vnm, stride_vnh,
    H_KV, GROUP, M, N_CACHE, SPLIT_N, qk_scale,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_NEW: tl.constexpr,
    IS_CAUSAL: tl.constexpr, APPEND: tl.constexpr, SPLIT: tl.constexpr, STORE_LSE: tl.constexpr,
):
    tl.static_assert(BLOCK_H >= 16 and BLOCK_N >= 16 and BLOCK_NEW >= 16, "tl.dot needs tiles of at least 16")
    # -- which (request, KV head, row block) and which split -------------------------------------
    rows_total = GROUP * M  # query rows sharing this KV head
    row_blocks = tl.cdiv(rows_total, BLOCK_H)
    pid = tl.program_id(0)
    split = tl.program_id(1)
    num_splits = tl.num_programs(1)
    pid_rb = pid % row_blocks
    pid_bh = pid // row_blocks
    off_b = (pid_bh // H_KV).to(tl.int64)
    off_hk = (pid_bh % H_KV).to(tl.int64)
    H = H_KV * GROUP

    # -- query rows: r -> (q head off_hk * G + r // M, token r % M) --------------------------------
    offs_r = pid_rb * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    offs_t = offs_r % M  # [BLOCK_H] token
    offs_h = off_hk * GROUP + (offs_r // M)  # [BLOCK_H] q head, int64
    offs_n = tl.arange(0, BLOCK_N)  # [BLOCK_N]
    offs_d = tl.arange(0, HEAD_DIM_PAD)  # [D_PAD]

    # -- this request's lengths, read on the device and clamped to the buffer ---------------------
    seqlen = tl.minimum(tl.maximum(tl.load(Cache_seqlens + off_b), 0), N_CACHE)  # L_b
    if APPEND:
        n_total = seqlen + M
    else:
        n_total = seqlen
    row_limit = offs_t + (n_total - M)  # [BLOCK_H] last key each row may see (causal)

    # -- this split's range of cached keys, see [Note] Empty KV splits -----------------------------
    lo = split * SPLIT_N
    hi = tl.minimum(lo + SPLIT_N, seqlen)
    if IS_CAUSAL:
        free_end = tl.minimum(hi, n_total - M + 1)  # keys every row sees
    else:
        free_end = hi
    full_end = lo + tl.maximum(free_end - lo, 0) // BLOCK_N * BLOCK_N

    q_ptrs = Q + off_b * stride_qb + offs_t[:, None].to(tl.int64) * stride_qm + offs_h[:, None] * stride_qh
    q = load_rows(q_ptrs + offs_d[None, :], offs_r, rows_total, offs_d, HEAD_DIM, HEAD_DIM_PAD, True)
    k_head = K_cache + off_hk * stride_kh
    v_head = V_cache + off_hk * stride_vh

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM_PAD], dtype=tl.float32)

    # stage 1: whole blocks every row sees, no mask
    for start_n in tl.range(lo, full_end, BLOCK_N):
        rows = start_n + offs_n
        k = load_rows(k_head + _kv_row_offsets(off_b, rows, stride_kb, stride_kn)[:, None] + offs_d[None, :],
                      rows, hi, offs_d, HEAD_DIM, HEAD_DIM_PAD, False)  # [BLOCK_N, D_PAD]
        qk = tl.dot(q, tl.trans(k))  # [BLOCK_H, BLOCK_N]
        p, m_i, l_i, acc = online_softmax(qk, m_i, l_i, acc, qk_scale, False)
        v = load_rows(v_head + _kv_row_offsets(off_b, rows, stride_vb, stride_vn)[:, None] + offs_d[None, :],
                      rows, hi, offs_d, HEAD_DIM, HEAD_DIM_PAD, False)
        acc = tl.dot(p.to(v.dtype), v, acc)
    # stage 2: the ragged tail of the split (and, without an append, the causal band), masked
    for start_n in tl.range(full_end, hi, BLOCK_N):
        rows = start_n + offs_n
        k = load_rows(k_head + _kv_row_offsets(off_b, rows, stride_kb, stride_kn)[:, None] + offs_d[None, :],
                      rows, hi, offs_d, HEAD_DIM, HEAD_DIM_PAD, True)
        qk = tl.dot(q, tl.trans(k))
        qk = mask_scores(qk, rows, hi, row_limit, IS_CAUSAL)
        p, m_i, l_i, acc = online_softmax(qk, m_i, l_i, acc, qk_scale, True)
        v = load_rows(v_head + _kv_row_offsets(off_b, rows, stride_vb, stride_vn)[:, None] + offs_d[None, :],
                      rows, hi, offs_d, HEAD_DIM, HEAD_DIM_PAD, True)
        acc = tl.dot(p.to(v.dtype), v, acc)

    # stage 3: the new keys, read from k/v and written to the cache, see [Note] Fused append
    if APPEND:
        if split == num_splits - 1:
            offs_u = tl.arange(0, BLOCK_NEW)  # [BLOCK_NEW]
            kn_head = K_new + off_b * stride_knb + off_hk * stride_knh
            vn_head = V_new + off_b * stride_vnb + off_hk * stride_vnh
            n_write = tl.minimum(M, N_CACHE - seqlen)  # new rows that fit in the buffer
            for start_u in tl.range(0, M, BLOCK_NEW):
                us = start_u + offs_u
                kn = load_rows(kn_head + us[:, None].to(tl.int64) * stride_knm + offs_d[None, :],
                               us, M, offs_d, HEAD_DIM, HEAD_DIM_PAD, True)  # [BLOCK_NEW, D_PAD]
                qk = tl.dot(q, tl.trans(kn))  # [BLOCK_H, BLOCK_NEW]
                qk = mask_scores(qk, seqlen + us, n_total, row_limit, IS_CAUSAL)
                p, m_i, l_i, acc = online_softmax(qk, m_i, l_i, acc, qk_scale, True)
                vn = load_rows(vn_head + us[:, None].to(tl.int64) * stride_vnm + offs_d[None, :],
                               us, M, offs_d, HEAD_DIM, HEAD_DIM_PAD, True)
                acc = tl.dot(p.to(vn.dtype), vn, acc)
                if pid_rb == 0:  # one row block writes the cache
                    dst = seqlen + us  # [BLOCK_NEW] cache rows
                    store_rows(k_head + _kv_row_offsets(off_b, dst, stride_kb, stride_kn)[:, None] + offs_d[None, :],
                               kn, us, n_write, offs_d, HEAD_DIM, HEAD_DIM_PAD)
                    store_rows(v_head + _kv_row_offsets(off_b, dst, stride_vb, stride_vn)[:, None] + offs_d[None, :],
                               vn, us, n_write, offs_d, HEAD_DIM, HEAD_DIM_PAD)

    # -- epilogue --------------------------------------------------------------------------------
    out, lse = finalize(acc, m_i, l_i)  # empty rows: 0 and +inf
    row_ok = offs_r < rows_total
    lse_row = (off_b * H + offs_h) * M + offs_t  # [BLOCK_H] index into (B, H, M)
    if SPLIT:  # partials to fp32 scratch (B, H, M, num_splits[, D]); empty ones get weight 0
        part_row = lse_row * num_splits + split
        tl.store(Lse_part + part_row, tl.where(l_i == 0.0, float("-inf"), lse), mask=row_ok)
        store_rows(Out_part + part_row[:, None] * HEAD_DIM + offs_d[None, :], out,
                   offs_r, rows_total, offs_d, HEAD_DIM, HEAD_DIM_PAD)
    else:  # the final output, (B, M, H, D) contiguous
        o_row = (off_b * M + offs_t) * H + offs_h
        store_rows(Out + o_row[:, None] * HEAD_DIM + offs_d[None, :], out.to(Out.dtype.element_ty),
                   offs_r, rows_total, offs_d, HEAD_DIM, HEAD_DIM_PAD)
        if STORE_LSE:
            tl.store(Lse + lse_row, lse, mask=row_ok)


@triton.jit
def _combine_kernel(
    Out_part, Lse_part, Out, Lse,
    H, M, NUM_SPLITS,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr, STORE_LSE: tl.constexpr,
):
    # -- one query row (b, h, t), in the (B, H, M) order of Lse and of the scratch -----------------
    row = tl.program_id(0).to(tl.int64)
    off_b = row // (H * M)
    off_h = (row // M) % H
    off_t = row % M
    offs_s = tl.arange(0, SPLITS_PAD)  # [SPLITS_PAD]
    offs_d = tl.arange(0, HEAD_DIM_PAD)  # [D_PAD]

    lse_parts = tl.load(Lse_part + row * NUM_SPLITS + offs_s, mask=offs_s < NUM_SPLITS, other=float("-inf"))
    nonempty = lse_parts != float("-inf")  # empty splits' outputs are never read
    o_parts = tl.load(Out_part + (row * NUM_SPLITS + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
                      mask=nonempty[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)  # [SPLITS_PAD, D_PAD]
    out, lse = merge_partials(o_parts, lse_parts)
    tl.store(Out + ((off_b * M + off_t) * H + off_h) * HEAD_DIM + offs_d, out.to(Out.dtype.element_ty),
             mask=offs_d < HEAD_DIM)
    if STORE_LSE:
        tl.store(Lse + row, lse)


# ============================================================================================
# Launcher: validate, allocate, launch
# ============================================================================================
class _LaunchCache:
    """Launch a `@triton.jit` kernel straight through its compiled handle after the first launch.

    Triton's per-call dispatch (binding ~30 arguments, computing each one's specialisation, hashing
    the key) costs tens of microseconds of host time: more than a whole decode step on a GPU. The
    caller's key holds everything Triton specialises on (exact integer arguments and strides, the
    dtypes, 16-byte alignment of every pointer, the constexprs and launch options, the device), so
    a hit is the very kernel Triton's dispatcher would pick; a miss goes through the dispatcher,
    which compiles if needed, and stores the compiled kernel. Off under the interpreter and with
    KERNELS_FAST_LAUNCH=0; launch hooks (profilers) still run through CompiledKernel's own launcher.
    """

    enabled = os.environ.get("KERNELS_FAST_LAUNCH", "1") not in ("0", "") and not is_interpreter()

    def __init__(self, fn):
        self.fn = fn
        self.kernels = {}

    def __call__(self, key, grid, args, num_warps: int, num_stages: int = 1) -> None:
        kernel = self.kernels.get(key)
        if kernel is not None:
            kernel[grid](*args)  # CompiledKernel.__getitem__: current device and stream, no re-binding
            return
        kernel = self.fn[grid](*args, num_warps=num_warps, num_stages=num_stages)
        if self.enabled and hasattr(kernel, "function") and hasattr(kernel, "packed_metadata"):
            if len(self.kernels) > 1024:  # shapes churn: start over rather than grow without bound
                self.kernels.clear()
            self.kernels[key] = kernel


_launch_decode = _LaunchCache(_decode_kernel)
_launch_combine = _LaunchCache(_combine_kernel)


class _Plan(NamedTuple):
    """Everything about a launch that depends only on shapes, dtype and device (cached)."""

    head_dim_pad: int
    block_h: int
    block_n: int
    block_new: int
    num_warps: int
    num_stages: int
    num_splits: int  # effective: no split is past the allocated cache
    split_n: int  # keys per split, a multiple of block_n
    grid: Tuple[int, int]
    splits_pad: int


@functools.lru_cache(maxsize=512)
def _plan(batch: int, seqlen_q: int, nheads: int, nheads_k: int, head_dim: int, seqlen_cache: int,
          dtype: torch.dtype, device: torch.device, num_splits: int) -> _Plan:
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    config = decode_config(head_dim_pad, dtype, device)
    rows = (nheads // nheads_k) * seqlen_q
    block_h = min(max(16, triton.next_power_of_2(rows)), max(16, config.max_rows))
    row_blocks = triton.cdiv(rows, block_h)
    programs = batch * nheads_k * row_blocks
    blocks_total = triton.cdiv(seqlen_cache, config.block_n)
    if num_splits == 0:
        num_splits = decode_num_splits(programs, seqlen_cache, config.block_n, device)
    num_splits = max(1, min(num_splits, blocks_total))  # more splits than blocks would all be empty
    blocks_per_split = triton.cdiv(max(blocks_total, 1), num_splits)
    num_splits = triton.cdiv(max(blocks_total, 1), blocks_per_split)
    block_new = min(config.block_n, max(16, triton.next_power_of_2(seqlen_q)))
    return _Plan(
        head_dim_pad=head_dim_pad, block_h=block_h, block_n=config.block_n, block_new=block_new,
        num_warps=config.num_warps, num_stages=config.num_stages, num_splits=num_splits,
        split_n=blocks_per_split * config.block_n, grid=(programs, num_splits),
        splits_pad=max(2, triton.next_power_of_2(num_splits)),
    )


@functools.lru_cache(maxsize=256)
def _filled_seqlens_cached(value: int, batch: int, device: torch.device) -> torch.Tensor:
    return torch.full((batch,), value, dtype=torch.int32, device=device)


def _filled_seqlens(value: int, batch: int, device: torch.device) -> torch.Tensor:
    """An int cache_seqlens as an int32 (batch,) tensor on `device`, cached per (value, batch, device).

    Never cached while a CUDA graph is being captured: the fill would only run on replay.
    """
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return torch.full((batch,), value, dtype=torch.int32, device=device)
    return _filled_seqlens_cached(value, batch, device)


def _check_host_lengths(lengths, seqlen_new: int, seqlen_cache: int) -> None:
    """Raise ValueError if a host-known length is negative or the append would pass seqlen_cache.

    `lengths` is an int (every request) or a CPU tensor / numpy array of per-request lengths.
    """
    if isinstance(lengths, int):
        lo, hi = lengths, lengths
    else:
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
        raise ValueError(f"Expected cache_seqlens >= 0, got {length} for {which}.")
    raise ValueError(
        f"KV cache overflow for {which}: cache_seqlens {length} + {seqlen_new} new tokens = "
        f"{length + seqlen_new} > seqlen_cache {seqlen_cache}; allocate a longer cache or reset the request."
    )


def _resolve_cache_seqlens(cache_seqlens, batch: int, seqlen_new: int, seqlen_cache: int,
                           device: torch.device) -> torch.Tensor:
    """Validate cache_seqlens and return it as an int32 (batch,) tensor on `device`.

    Host-known lengths (an int, a CPU tensor) are checked for overflow; a tensor already on the
    CUDA device is used as is (checking it would need a host sync; the kernel clamps instead).
    """
    if isinstance(cache_seqlens, torch.Tensor):
        if cache_seqlens.dtype != torch.int32:
            raise TypeError(
                f"Expected cache_seqlens to be an int32 tensor (flash-attn's convention), got {cache_seqlens.dtype}; "
                f"use cache_seqlens.to(torch.int32)."
            )
        if cache_seqlens.shape != (batch,):
            raise ValueError(f"Expected cache_seqlens of shape ({batch},), got {tuple(cache_seqlens.shape)}.")
        if cache_seqlens.device.type == "cpu":  # host-known: check, then copy if the call runs on a GPU
            _check_host_lengths(cache_seqlens, seqlen_new, seqlen_cache)
            return cache_seqlens if device.type == "cpu" else cache_seqlens.to(device)
        if cache_seqlens.device != device:
            raise ValueError(
                f"Expected cache_seqlens on {device} (or on the CPU), got it on {cache_seqlens.device}."
            )
        return cache_seqlens
    if isinstance(cache_seqlens, numbers.Integral) and not isinstance(cache_seqlens, bool):
        value = int(cache_seqlens)
        _check_host_lengths(value, seqlen_new, seqlen_cache)
        return _filled_seqlens(value, batch, device)
    raise TypeError(f"Expected cache_seqlens to be an int or an int32 tensor, got {type(cache_seqlens).__name__}.")


def _validate_kvcache_inputs(q, k_cache, v_cache, k, v) -> None:
    _validate_tensor("q", q, 4, "(batch, seqlen_q, nheads, headdim)")
    layout = "(batch, seqlen_cache, nheads_k, headdim)"
    _validate_tensor("k_cache", k_cache, 4, layout)
    _validate_tensor("v_cache", v_cache, 4, layout)
    if (k is None) != (v is None):
        raise ValueError("Expected k and v to be both given (append, then attend) or both None (attend only).")
    if k is not None:
        layout = "(batch, seqlen_q, nheads_k, headdim)"
        _validate_tensor("k", k, 4, layout)
        _validate_tensor("v", v, 4, layout)
    _validate_dtypes(q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v)
    _validate_devices(q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v)
    batch, seqlen_q, nheads, head_dim = q.shape
    if k_cache.shape != v_cache.shape:
        raise ValueError(
            f"Expected k_cache and v_cache to have the same shape, got {tuple(k_cache.shape)} and "
            f"{tuple(v_cache.shape)}."
        )
    if k_cache.shape[0] != batch:
        raise ValueError(
            f"Expected k_cache's batch ({k_cache.shape[0]}) to match q's ({batch}); cache_batch_idx is not supported."
        )
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"Expected q and k_cache to share the head dim, got {head_dim} and {k_cache.shape[3]}.")
    if seqlen_q < 1:
        raise ValueError(f"Expected seqlen_q >= 1, got q of shape {tuple(q.shape)}.")
    _validate_head_dim(head_dim)
    _validate_heads(nheads, k_cache.shape[2])
    if k is not None:
        expected = (batch, seqlen_q, k_cache.shape[2], head_dim)
        for name, t in (("k", k), ("v", v)):
            if tuple(t.shape) != expected:
                raise ValueError(
                    f"Expected {name} of shape (batch, seqlen_q, nheads_k, headdim) = {expected}, got "
                    f"{tuple(t.shape)}; the new tokens' count must equal seqlen_q."
                )


def _flash_attn_with_kvcache_launch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: Optional[torch.Tensor],
    v: Optional[torch.Tensor],
    cache_seqlens: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    num_splits: int,
    return_softmax_lse: bool,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Allocate and launch on validated inputs (cache_seqlens: int32 (batch,) on q's device)."""
    batch, seqlen_q, nheads, head_dim = q.shape
    seqlen_cache, nheads_k = k_cache.shape[1], k_cache.shape[2]
    device = q.device
    plan = _plan(batch, seqlen_q, nheads, nheads_k, head_dim, seqlen_cache, q.dtype, device, num_splits)

    out = torch.empty((batch, seqlen_q, nheads, head_dim), dtype=q.dtype, device=device)
    lse = torch.empty((batch, nheads, seqlen_q), dtype=torch.float32, device=device) if return_softmax_lse else None
    if batch == 0:
        return out, lse
    split = plan.num_splits > 1
    if split:
        out_part = torch.empty((batch, nheads, seqlen_q, plan.num_splits, head_dim), dtype=torch.float32,
                               device=device)
        lse_part = torch.empty((batch, nheads, seqlen_q, plan.num_splits), dtype=torch.float32, device=device)
    else:
        out_part = lse_part = out  # unused
    append = k is not None
    if not append:
        k = v = k_cache  # unused pointers
    lse_arg = lse if lse is not None else out  # unused when STORE_LSE is False
    store_lse = lse is not None

    tensors = (q, k_cache, v_cache, k, v, cache_seqlens, out, lse_arg, out_part, lse_part)
    key = (plan, device, q.dtype, q.shape, k_cache.shape, causal, append, store_lse, q.stride(), k_cache.stride(),
           v_cache.stride(), k.stride(), v.stride(), tuple(t.data_ptr() % 16 == 0 for t in tensors))
    args = (
        *tensors,
        *q.stride()[:3], *k_cache.stride()[:3], *v_cache.stride()[:3], *k.stride()[:3], *v.stride()[:3],
        nheads_k, nheads // nheads_k, seqlen_q, seqlen_cache, plan.split_n, softmax_scale * LOG2E,
        head_dim, plan.head_dim_pad, plan.block_h, plan.block_n, plan.block_new,
        causal, append, split, store_lse,
    )
    ctx = contextlib.nullcontext()
    if device.type == "cuda" and device.index != torch.cuda.current_device():
        ctx = torch.cuda.device(device)
    with ctx:
        _launch_decode(key, (plan.grid[0], plan.grid[1], 1), args, plan.num_warps, plan.num_stages)
        if split:
            _launch_combine(
                key, (batch * nheads * seqlen_q, 1, 1),
                (out_part, lse_part, out, lse_arg, nheads, seqlen_q, plan.num_splits,
                 head_dim, plan.head_dim_pad, plan.splits_pad, store_lse),
                4 if plan.splits_pad * plan.head_dim_pad >= 4096 else 1,
            )
    return out, lse


# ============================================================================================
# Public function
# ============================================================================================
def flash_attn_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: Optional[torch.Tensor] = None,
    v: Optional[torch.Tensor] = None,
    *,
    cache_seqlens: Union[int, torch.Tensor],
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    num_splits: int = 0,
    return_softmax_lse: bool = False,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Decode attention over a KV cache, with an optional in-place append, in one launch
    (flash-attn's `flash_attn_with_kvcache`).

    Args:
        q: (batch, seqlen_q, nheads, headdim), float16, bfloat16 or float32; seqlen_q >= 1 (1 for
            plain decoding, a few for speculative-decoding verification).
        k_cache, v_cache: (batch, seqlen_cache, nheads_k, headdim), same dtype and device as q. Any
            strides with a contiguous last dim (e.g. a (batch, nheads_k, seqlen_cache, headdim)
            buffer passed as .transpose(1, 2)); no copies are made; beyond 2^31 elements is fine.
            Query head h reads KV head h // (nheads // nheads_k) (MHA, GQA, MQA).
        k, v: optional (batch, seqlen_q, nheads_k, headdim): the new tokens' keys and values. They
            are written into k_cache / v_cache in place at rows [cache_seqlens[b], cache_seqlens[b]
            + seqlen_q) and attended over in the same launch. Both or neither.
        cache_seqlens: each request's cache length before this call: an int (the same for every
            request) or an int32 tensor of shape (batch,), on q's device or on the CPU (checked on
            the host, then copied: use a device tensor inside a CUDA graph). It is never modified
            (advance it yourself, e.g. cache_seqlens += seqlen_q, or use KVCache).
            Overflow: lengths known on the host (an int, a CPU tensor) are checked, and an append
            that would pass seqlen_cache raises ValueError. A tensor on the GPU cannot be checked
            without a host sync: the caller is responsible for it; the kernel clamps each length to
            [0, seqlen_cache] and drops appended rows past the end, so no read or write ever leaves
            the buffers, but the result of an overflowing call is not meaningful.
        softmax_scale: defaults to headdim ** -0.5.
        causal: mask aligned to the bottom-right corner over the N_b = cache_seqlens[b] + seqlen_q
            keys (cache_seqlens[b] without k/v): token t sees key j iff j <= t + N_b - seqlen_q.
            For cache_seqlens[b] = 3 and seqlen_q = 2 with an append (1 = kept):
                1 1 1 1 0
                1 1 1 1 1
            With seqlen_q == 1 causal changes nothing. A row that sees no key (a request with an
            empty cache and no append) outputs zeros, never NaN.
        num_splits: 0 = heuristic (from batch, heads, the allocated seqlen_cache and the SM count,
            never from current lengths), 1 = no split, n > 1 = split each cache into about n chunks
            processed in parallel and merged by log-sum-exp (capped at the number of BLOCK_N
            blocks of the cache). Splits past a request's length exit at once.
        return_softmax_lse: also return the log-sum-exp of each row.

    Returns:
        out: (batch, seqlen_q, nheads, headdim), dtype of q.
        softmax_lse (if return_softmax_lse): (batch, nheads, seqlen_q) float32, natural log; +inf
            for a row that sees no key.

    No host synchronisation happens with a device cache_seqlens, so the whole step (append +
    attention) can be captured in a CUDA graph and replayed while the lengths advance on the
    device. Not supported: paged caches (block_table), cache_batch_idx, rotary embedding, alibi,
    sliding windows, softcapping.
    """
    _validate_kvcache_inputs(q, k_cache, v_cache, k, v)
    if not isinstance(num_splits, numbers.Integral) or num_splits < 0:
        raise ValueError(f"Expected num_splits to be an int >= 0 (0 = heuristic), got {num_splits!r}.")
    scale = _validate_softmax_scale(softmax_scale, q.shape[3])
    seqlen_new = q.shape[1] if k is not None else 0
    seqlens = _resolve_cache_seqlens(cache_seqlens, q.shape[0], seqlen_new, k_cache.shape[1], q.device)
    out, lse = _flash_attn_with_kvcache_launch(
        q, k_cache, v_cache, k, v, seqlens, scale, bool(causal), int(num_splits), return_softmax_lse
    )
    return (out, lse) if return_softmax_lse else out


# ============================================================================================
# KV cache helper
# ============================================================================================
class KVCache:
    """Preallocated K/V buffers plus per-request lengths, for batched autoregressive generation.

    Owns k_cache / v_cache of shape (batch, max_seqlen, nheads_k, head_dim) and the lengths, kept
    twice: an int32 device tensor (what the kernel reads; advanced in place, so a decode step never
    syncs with the host and can be captured in a CUDA graph) and a host mirror (what the overflow
    checks read). Every method raises ValueError before an append could pass max_seqlen.

        cache = KVCache(batch, max_seqlen, nheads_k, head_dim, dtype=torch.float16, device="cuda")
        out = cache.prefill(q_prompt, k_prompt, v_prompt)        # causal prompt attention, fills the cache
        for step in range(n):
            out = cache.decode(q_t, k_t, v_t)                    # append + attend, lengths += seqlen_q

    CUDA graphs: a captured `decode` advances the device lengths on every replay but the host mirror
    only once, at capture; call `refresh_host_seqlens()` (one host sync) after replaying.
    """

    def __init__(self, batch: int, max_seqlen: int, nheads_k: int, head_dim: int, *,
                 dtype: torch.dtype = torch.float16, device: Union[str, torch.device, None] = None):
        for name, value in (("batch", batch), ("max_seqlen", max_seqlen), ("nheads_k", nheads_k)):
            if not isinstance(value, numbers.Integral) or value < 1:
                raise ValueError(f"Expected {name} to be a positive int, got {value!r}.")
        _validate_head_dim(head_dim)
        if dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"Expected dtype float16, bfloat16 or float32, got {dtype}.")
        device = default_device() if device is None else torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        shape = (int(batch), int(max_seqlen), int(nheads_k), int(head_dim))
        self.k_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.v_cache = torch.zeros(shape, dtype=dtype, device=device)
        self._seqlens = torch.zeros(int(batch), dtype=torch.int32, device=device)
        self._host = np.zeros(int(batch), dtype=np.int64)
        self.batch, self.max_seqlen, self.nheads_k, self.head_dim = shape
        self.dtype, self.device = dtype, device

    # -- lengths ---------------------------------------------------------------------------------
    @property
    def seqlens(self) -> list:
        """Current length of each request (host mirror, a list of ints)."""
        return self._host.tolist()

    @property
    def seqlens_device(self) -> torch.Tensor:
        """Current lengths as the int32 (batch,) device tensor the kernel reads (do not modify)."""
        return self._seqlens

    def refresh_host_seqlens(self) -> list:
        """Copy the device lengths to the host mirror (one sync), e.g. after CUDA-graph replays."""
        self._host = self._seqlens.cpu().numpy().astype(np.int64)
        return self.seqlens

    def _indices(self, batch_idx) -> Union[slice, torch.Tensor]:
        """batch_idx (None, int, sequence or 1-D tensor of ints) -> a slice or an index tensor."""
        if batch_idx is None:
            return slice(0, self.batch)
        if isinstance(batch_idx, numbers.Integral) and not isinstance(batch_idx, bool):
            idx = [int(batch_idx)]
        elif isinstance(batch_idx, torch.Tensor):
            if batch_idx.dim() != 1 or batch_idx.dtype.is_floating_point or batch_idx.dtype == torch.bool:
                raise ValueError(f"Expected batch_idx to be a 1-D integer tensor, got {batch_idx.dtype} "
                                 f"of shape {tuple(batch_idx.shape)}.")
            idx = [int(i) for i in batch_idx.tolist()]
        elif isinstance(batch_idx, Sequence):
            idx = [int(i) for i in batch_idx]
        else:
            raise TypeError(
                f"Expected batch_idx to be None, an int or a sequence of ints, got {type(batch_idx).__name__}."
            )
        if not idx:
            raise ValueError("Expected batch_idx to name at least one request.")
        for i in idx:
            if not 0 <= i < self.batch:
                raise ValueError(f"Expected batch indices in [0, {self.batch}), got {i}.")
        if len(set(idx)) != len(idx):
            raise ValueError(f"Expected distinct batch indices, got {idx}.")
        if idx == list(range(idx[0], idx[0] + len(idx))):
            return slice(idx[0], idx[0] + len(idx))
        return torch.tensor(idx, dtype=torch.long, device=self.device)

    def _host_index(self, index):
        return index if isinstance(index, slice) else index.cpu().numpy()

    def reset(self, batch_idx=None) -> None:
        """Forget the contents of the given requests (all by default): their lengths become 0."""
        index = self._indices(batch_idx)
        self._host[self._host_index(index)] = 0
        self._seqlens[index] = 0

    # -- prefill and decode ----------------------------------------------------------------------
    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
                softmax_scale: Optional[float] = None, batch_idx=None) -> torch.Tensor:
        """Attention over prompts of one length with the prefill kernel; stores k/v in the cache.

        q: (n, seqlen, nheads, head_dim), k/v: (n, seqlen, nheads_k, head_dim) for the n requests
        named by batch_idx (all by default), whose caches must be empty (reset them first). Returns
        kernels.flash_attn_func(q, k, v, causal=causal) and sets those requests' lengths to seqlen.
        """
        from .prefill import flash_attn_func

        index = self._indices(batch_idx)
        host_index = self._host_index(index)
        count = len(self._host[host_index])
        for name, t in (("k", k), ("v", v)):
            _validate_tensor(name, t, 4, "(n, seqlen, nheads_k, headdim)")
            expected = (count, k.shape[1] if isinstance(k, torch.Tensor) else -1, self.nheads_k, self.head_dim)
            if tuple(t.shape) != expected:
                raise ValueError(f"Expected {name} of shape (n, seqlen, nheads_k, head_dim) = {expected} for "
                                 f"{count} requests, got {tuple(t.shape)}.")
            if t.dtype != self.dtype or t.device != self.device:
                raise ValueError(f"Expected {name} as {self.dtype} on {self.device} (the cache's), got {t.dtype} "
                                 f"on {t.device}.")
        if not isinstance(q, torch.Tensor) or q.dim() != 4 or q.shape[0] != count or q.shape[1] != k.shape[1]:
            raise ValueError(f"Expected q of shape ({count}, {k.shape[1]}, nheads, {self.head_dim}), got "
                             f"{tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__}.")
        seqlen = k.shape[1]
        busy = np.nonzero(self._host[host_index] != 0)[0]
        if len(busy):
            request = int(np.arange(self.batch)[host_index][busy[0]])
            raise ValueError(f"Expected empty caches for prefill, but request {request} holds "
                             f"{int(self._host[request])} tokens; call reset() first.")
        if seqlen > self.max_seqlen:
            raise ValueError(f"KV cache overflow: prompt of {seqlen} tokens > max_seqlen {self.max_seqlen}.")
        out = flash_attn_func(q, k, v, causal=causal, softmax_scale=softmax_scale)
        self.k_cache[index, :seqlen] = k
        self.v_cache[index, :seqlen] = v
        self._host[host_index] = seqlen
        self._seqlens[index] = seqlen
        return out

    def decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
               softmax_scale: Optional[float] = None, num_splits: int = 0) -> torch.Tensor:
        """One decode step for the whole batch: append k/v (batch, seqlen_q, nheads_k, head_dim) at
        each request's length, attend q (batch, seqlen_q, nheads, head_dim) over the cache, advance
        the lengths by seqlen_q (device tensor in place, no host sync; host mirror). Returns out."""
        if not isinstance(q, torch.Tensor) or q.dim() != 4:
            raise ValueError("Expected q of shape (batch, seqlen_q, nheads, head_dim).")
        if k is None or v is None:
            raise ValueError("KVCache.decode appends: expected k and v (batch, seqlen_q, nheads_k, head_dim).")
        seqlen_q = q.shape[1]
        if int(self._host.max()) + seqlen_q > self.max_seqlen:
            _check_host_lengths(self._host, seqlen_q, self.max_seqlen)
        out = flash_attn_with_kvcache(q, self.k_cache, self.v_cache, k, v, cache_seqlens=self._seqlens,
                                      softmax_scale=softmax_scale, causal=causal, num_splits=num_splits)
        self._seqlens += seqlen_q
        self._host += seqlen_q
        return out
