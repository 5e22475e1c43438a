"""Prefill attention: FlashAttention-2 forward (and backward) for MHA, GQA and MQA in Triton.

Algorithm: FlashAttention-2 (Tri Dao, https://tridao.me/publications/flash2/flash2.pdf) as in the
Triton fused-attention tutorial (OpenAI kernel team): each program owns BLOCK_M query rows of one
head, streams the keys and values of that head's KV head in BLOCK_N blocks, and keeps the softmax
online (running max m_i and sum l_i in base 2), so the [M, N] score matrix never reaches memory.
The log-sum-exp of each row is saved for the backward pass.

Notation:
    B batch, H query heads, H_KV key/value heads, G = H // H_KV (group size), M = seqlen_q,
    N = seqlen_k, D = head dim, D_PAD = next power of two >= D.
    Query head h reads KV head h // G: MHA is G = 1, MQA is H_KV = 1; K/V are never expanded.
    m_i running max (base 2) [BLOCK_M], l_i running sum [BLOCK_M], acc [BLOCK_M, D_PAD] fp32.

Supported: fp16/bf16 (fp32 accumulation), fp32 (tf32 matmuls on GPUs, exact under the
interpreter); head dims that are multiples of 8 in [16, 256] (padded to D_PAD inside the kernel
with masks); any seqlen_q, seqlen_k (including seqlen_q != seqlen_k and 0); any strides with a
contiguous last dim; causal masks aligned to the bottom-right corner; batches of sequences of
different lengths packed without padding (flash_attn_varlen_func). Not supported: dropout.

[Note] Masking layout. The KV loop is split in two ranges. Blocks in [0, n_full) are seen whole by
every row of the query block (in bounds and, when causal, left of the diagonal band): they run
without any mask. Blocks in [n_full, n_end) are the diagonal band and the ragged tail: their loads
are bounds-checked and their scores masked. Blocks at or past n_end are never visited, so a causal
program does about half the work of a non-causal one.

[Note] Two load paths. On Hopper (capability >= 9) with 2-byte dtypes and 16-byte aligned bases and
strides, tiles are loaded through device-side tensor descriptors (TMA) bounded by each (batch,
head)'s [rows, D] slice, so out-of-range rows and padded head dims read as zero without masks;
descriptors need a scratch allocator, which `_ensure_tma_allocator` installs unless the user set
one. Elsewhere (older GPUs, the interpreter, fp32, unaligned views) tiles are loaded through masked
pointers. On an H200 the pointer path reached only ~100 TFLOP/s against ~520 for descriptors
(results/nvidia-h200/tune_fwd.csv): unaligned views are correct there, not fast.

[Note] Causal with M != N. Query i sees key j iff j <= i + N - M (flash-attn >= 2.1). When M > N
the first M - N rows see nothing: they output zeros and LSE = +inf (see kernels/_common.py).

[Note] Packed sequences. flash_attn_varlen_func runs the same four kernels with IS_VARLEN=True. Then
off_b indexes a sequence of the packed batch: each program reads that sequence's first row and
length from Cu_seqlens_q / Cu_seqlens_k and uses them as its M, N and base offsets (the launcher
passes batch strides of 0, and M, N = max_seqlen_q, max_seqlen_k, which the kernels replace). The
grid is sized by the longest sequence; a program whose block starts at or past its own sequence's
end returns at once, and the KV loops stop at each sequence's own length, so no work is spent on
padding. Causal masks are bottom-right per sequence (diag = N - M of that sequence). On the
tensor-descriptor path the descriptors start at the sequence's first row with shape [its length,
D], so each sequence keeps zero-filled bounds. LSE and Delta are (H, total_q), flash-attn's packed
layout. Every varlen argument defaults to None / False, and with IS_VARLEN=False all varlen code
is compiled out: the dense kernels are exactly what they were before varlen was added.

[Note] Chunked prefill over a cache. flash_attn_with_kvcache hands a long chunk (see kernels/decode.py
[Note] Chunked prefill) to the forward kernel with IS_KVCACHE=True: K and V are then a KV cache, N
is its capacity per request, and each program reads its request's key count from Cache_seqlens
(clamped to the capacity; plus M when the chunk was appended just before, KV_APPEND), so lengths
stay on the device and nothing recompiles as they grow. Bottom-right causal over those keys is the
dense kernel's mask with diag = N_b - M. A dense cache (B, S, H_KV, D) is read like a dense K with
per-request length (the descriptors are bounded by N_b). A paged pool (NUM_BLOCKS, P, H_KV, D)
with PAGED=True is addressed through Block_table: when P is a multiple of BLOCK_N and the pool's
rows are evenly spaced, one descriptor spans the whole pool as [NUM_BLOCKS * P, D] rows and each
key block starts at row block * P + start_n % P (`_page_row`, looked up one block ahead as in the
decode kernel's [Note] Paged pipelining); rows of the last block past N_b belong to the page's
unused tail (stale data, possibly NaN bit patterns), so their scores are masked and their values
zeroed. Otherwise (P = 16, 48, ...) each key finds its page through `physical_blocks` (an entry per
page when a key block holds at most 4 whole pages, else per key) and loads through masked pointers.
Every cache argument defaults to None / False: with IS_KVCACHE=False the cache code is compiled out.
"""

from __future__ import annotations

import contextlib
import math
from typing import Optional, Tuple, Union

import torch
import triton
import triton.language as tl

from ._common import (
    finalize,
    kv_block_offsets,
    load_rows,
    mask_scores,
    online_softmax,
    physical_blocks,
    store_rows,
    tile_ptrs,
    wide_pages,
)
from ._configs import AttnConfig, prefill_bwd_config, prefill_fwd_config
from ._launch import LaunchCache
from ._utils import (
    _validate_cu_seqlens,
    _validate_cu_seqlens_values,
    _validate_devices,
    _validate_dropout,
    _validate_dtypes,
    _validate_head_dim,
    _validate_heads,
    _validate_max_seqlen,
    _validate_softmax_scale,
    _validate_tensor,
    device_capability,
    is_interpreter,
)

LOG2E = math.log2(math.e)


# ============================================================================================
# Forward kernel
# ============================================================================================
@triton.jit
def _page_row(Table, start_n, n_rows, NUM_BLOCKS, PAGE_SIZE: tl.constexpr):
    """Row of the [NUM_BLOCKS * P, D] pool view where the key block starting at logical row start_n
    begins (P a multiple of BLOCK_N: the block lies in one page). Entries at or past n_rows are not
    read (block 0 instead) and every entry is clamped into the pool."""
    block = tl.load(Table + start_n // PAGE_SIZE, mask=start_n < n_rows, other=0)
    block = tl.minimum(tl.maximum(block, 0), NUM_BLOCKS - 1)
    return block * PAGE_SIZE + start_n % PAGE_SIZE


@triton.jit
def _fwd_kernel(
    Q, K, V, Out, Lse,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_ob, stride_om, stride_oh,
    H, M, N, GROUP, qk_scale,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr, USE_TMA: tl.constexpr,
    Cu_seqlens_q=None, Cu_seqlens_k=None, stride_lseh=None, IS_VARLEN: tl.constexpr = False,
    Cache_seqlens=None, Block_table=None, stride_btb=None, NUM_BLOCKS=None, stride_kblk=None, stride_vblk=None,
    IS_KVCACHE: tl.constexpr = False, KV_APPEND: tl.constexpr = False, PAGED: tl.constexpr = False,
    PAGE_SIZE: tl.constexpr = 1, WIDE_PAGES: tl.constexpr = False,
):
    tl.static_assert(BLOCK_M >= 16 and BLOCK_N >= 16, "tl.dot needs tiles of at least 16")
    # -- which query block and head ------------------------------------------------------------
    if IS_CAUSAL:  # heaviest blocks first: the last query blocks see the most keys
        pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    else:
        pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    off_b = (pid_bh // H).to(tl.int64)
    off_h = pid_bh % H
    off_hk = (off_h // GROUP).to(tl.int64)  # GQA: the KV head this query head reads
    start_m = pid_m * BLOCK_M
    if IS_VARLEN:  # off_b is a packed sequence: its own M, N and first rows (see [Note] Packed sequences)
        q_start = tl.load(Cu_seqlens_q + off_b)
        M = tl.load(Cu_seqlens_q + off_b + 1) - q_start  # this sequence's seqlen_q
        if start_m >= M:  # the grid covers max_seqlen_q: blocks past this sequence's end exit at once
            return
        k_start = tl.load(Cu_seqlens_k + off_b)
        N = tl.load(Cu_seqlens_k + off_b + 1) - k_start  # this sequence's seqlen_k
        Q += q_start.to(tl.int64) * stride_qm  # the launcher passes batch strides of 0
        K += k_start.to(tl.int64) * stride_kn
        V += k_start.to(tl.int64) * stride_vn
        Out += q_start.to(tl.int64) * stride_om
        Lse += q_start  # Lse is (H, total_q)
    if IS_KVCACHE:  # K/V are a cache: N is its capacity, the request's key count lives on the device
        n_cached = tl.minimum(tl.maximum(tl.load(Cache_seqlens + off_b), 0), N)
        if KV_APPEND:  # the chunk's own keys were appended at [n_cached, n_cached + M) just before
            N = tl.minimum(n_cached + M, N)
        else:
            N = n_cached

    q_base = Q + off_b * stride_qb + off_h.to(tl.int64) * stride_qh
    k_base = K + off_b * stride_kb + off_hk * stride_kh
    v_base = V + off_b * stride_vb + off_hk * stride_vh
    o_base = Out + off_b * stride_ob + off_h.to(tl.int64) * stride_oh

    offs_m = start_m + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    offs_n = tl.arange(0, BLOCK_N)  # [BLOCK_N]
    offs_d = tl.arange(0, HEAD_DIM_PAD)  # [D_PAD]

    # -- the KV range this block visits (see [Note] Masking layout) ------------------------------
    if IS_CAUSAL:
        diag = N - M  # row i sees keys j <= i + diag
        row_limit = offs_m + diag  # [BLOCK_M]
        n_full = tl.minimum(tl.maximum(start_m + diag + 1, 0) // BLOCK_N * BLOCK_N, N // BLOCK_N * BLOCK_N)
        n_end = tl.minimum(tl.maximum(start_m + BLOCK_M + diag, 0), N)
    else:
        row_limit = offs_m  # unused
        n_full = N // BLOCK_N * BLOCK_N
        n_end = N

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)

    if USE_TMA:
        # Hopper tensor descriptors bounded by this (batch, head)'s [rows, D] slice: out-of-range
        # rows and padded head dims read as zero and are never written.
        q_desc = tl.make_tensor_descriptor(q_base, [M, HEAD_DIM], [stride_qm, 1], [BLOCK_M, HEAD_DIM_PAD])
        if PAGED:  # the whole pool as [NUM_BLOCKS * P, D] rows; see [Note] Chunked prefill over a cache
            k_desc = tl.make_tensor_descriptor(k_base, [NUM_BLOCKS * PAGE_SIZE, HEAD_DIM], [stride_kn, 1],
                                               [BLOCK_N, HEAD_DIM_PAD])
            v_desc = tl.make_tensor_descriptor(v_base, [NUM_BLOCKS * PAGE_SIZE, HEAD_DIM], [stride_vn, 1],
                                               [BLOCK_N, HEAD_DIM_PAD])
            q = q_desc.load([start_m, 0])  # [BLOCK_M, D_PAD]
            table = Block_table + off_b * stride_btb
            next_row = _page_row(table, 0, n_end, NUM_BLOCKS, PAGE_SIZE)
            # stage 1: blocks every row sees whole, no mask; each page is looked up one block ahead
            for start_n in tl.range(0, n_full, BLOCK_N):
                row = next_row
                next_row = _page_row(table, start_n + BLOCK_N, n_end, NUM_BLOCKS, PAGE_SIZE)
                k = k_desc.load([row, 0])
                qk = tl.dot(q, tl.trans(k))
                p, m_i, l_i, acc = online_softmax(qk, m_i, l_i, acc, qk_scale, False)
                v = v_desc.load([row, 0])
                acc = tl.dot(p.to(v.dtype), v, acc)
            # stage 2: diagonal band and ragged tail, masked; rows past N are another request's or
            # stale: their scores are masked and their values zeroed (0 * NaN would poison acc)
            for start_n in tl.range(n_full, n_end, BLOCK_N):
                row = next_row
                next_row = _page_row(table, start_n + BLOCK_N, n_end, NUM_BLOCKS, PAGE_SIZE)
                k = k_desc.load([row, 0])
                qk = tl.dot(q, tl.trans(k))
                qk = mask_scores(qk, start_n + offs_n, n_end, row_limit, IS_CAUSAL)
                p, m_i, l_i, acc = online_softmax(qk, m_i, l_i, acc, qk_scale, True)
                v = v_desc.load([row, 0])
                v = tl.where((start_n + offs_n)[:, None] < n_end, v, 0.0)
                acc = tl.dot(p.to(v.dtype), v, acc)
        else:
            k_desc = tl.make_tensor_descriptor(k_base, [N, HEAD_DIM], [stride_kn, 1], [BLOCK_N, HEAD_DIM_PAD])
            v_desc = tl.make_tensor_descriptor(v_base, [N, HEAD_DIM], [stride_vn, 1], [BLOCK_N, HEAD_DIM_PAD])
            q = q_desc.load([start_m, 0])  # [BLOCK_M, D_PAD]
            # stage 1: blocks every row sees whole, no mask
            for start_n in tl.range(0, n_full, BLOCK_N):
                k = k_desc.load([start_n, 0])  # [BLOCK_N, D_PAD]
                qk = tl.dot(q, tl.trans(k))  # [BLOCK_M, BLOCK_N]
                p, m_i, l_i, acc = online_softmax(qk, m_i, l_i, acc, qk_scale, False)
                v = v_desc.load([start_n, 0])
                acc = tl.dot(p.to(v.dtype), v, acc)
            # stage 2: diagonal band and ragged tail, masked
            for start_n in tl.range(n_full, n_end, BLOCK_N):
                k = k_desc.load([start_n, 0])
                qk = tl.dot(q, tl.trans(k))
                qk = mask_scores(qk, start_n + offs_n, n_end, row_limit, IS_CAUSAL)
                p, m_i, l_i, acc = online_softmax(qk, m_i, l_i, acc, qk_scale, True)
                v = v_desc.load([start_n, 0])
                acc = tl.dot(p.to(v.dtype), v, acc)
    elif PAGED:  # pointer path over a paged pool: each key block finds its rows through the block table
        q = load_rows(tile_ptrs(q_base, start_m, stride_qm, BLOCK_M, offs_d), offs_m, M, offs_d,
                      HEAD_DIM, HEAD_DIM_PAD, True)
        table = Block_table + off_b * stride_btb
        next_blocks = physical_blocks(table, 0, offs_n, n_end, NUM_BLOCKS, PAGE_SIZE, BLOCK_N)
        for start_n in tl.range(0, n_end, BLOCK_N):  # one loop: the masks are cheap next to the gathers
            rows = start_n + offs_n
            blocks = next_blocks
            next_blocks = physical_blocks(table, start_n + BLOCK_N, rows + BLOCK_N, n_end, NUM_BLOCKS, PAGE_SIZE,
                                          BLOCK_N)
            k_offs = kv_block_offsets(blocks, start_n, offs_n, stride_kblk, stride_kn, PAGE_SIZE, True, WIDE_PAGES,
                                      BLOCK_N)
            k = load_rows(k_base + k_offs[:, None] + offs_d[None, :], rows, n_end, offs_d, HEAD_DIM, HEAD_DIM_PAD, True)
            qk = tl.dot(q, tl.trans(k))
            qk = mask_scores(qk, rows, n_end, row_limit, IS_CAUSAL)
            p, m_i, l_i, acc = online_softmax(qk, m_i, l_i, acc, qk_scale, True)
            v_offs = kv_block_offsets(blocks, start_n, offs_n, stride_vblk, stride_vn, PAGE_SIZE, True, WIDE_PAGES,
                                      BLOCK_N)
            v = load_rows(v_base + v_offs[:, None] + offs_d[None, :], rows, n_end, offs_d, HEAD_DIM, HEAD_DIM_PAD, True)
            acc = tl.dot(p.to(v.dtype), v, acc)
    else:
        q = load_rows(tile_ptrs(q_base, start_m, stride_qm, BLOCK_M, offs_d), offs_m, M, offs_d,
                      HEAD_DIM, HEAD_DIM_PAD, True)  # [BLOCK_M, D_PAD]
        # Offsets inside a tile stay small (int32); the tile's start moves by 64-bit pointer steps.
        k_ptrs = k_base + offs_n[:, None] * stride_kn + offs_d[None, :]  # [BLOCK_N, D_PAD]
        v_ptrs = v_base + offs_n[:, None] * stride_vn + offs_d[None, :]  # [BLOCK_N, D_PAD]
        # stage 1: blocks every row sees whole, no mask
        for start_n in tl.range(0, n_full, BLOCK_N):
            k = load_rows(k_ptrs, offs_n, BLOCK_N, offs_d, HEAD_DIM, HEAD_DIM_PAD, False)
            qk = tl.dot(q, tl.trans(k))  # [BLOCK_M, BLOCK_N]
            p, m_i, l_i, acc = online_softmax(qk, m_i, l_i, acc, qk_scale, False)
            v = load_rows(v_ptrs, offs_n, BLOCK_N, offs_d, HEAD_DIM, HEAD_DIM_PAD, False)
            acc = tl.dot(p.to(v.dtype), v, acc)
            k_ptrs += BLOCK_N * stride_kn
            v_ptrs += BLOCK_N * stride_vn
        # stage 2: diagonal band and ragged tail, masked
        for start_n in tl.range(n_full, n_end, BLOCK_N):
            k = load_rows(k_ptrs, start_n + offs_n, n_end, offs_d, HEAD_DIM, HEAD_DIM_PAD, True)
            qk = tl.dot(q, tl.trans(k))
            qk = mask_scores(qk, start_n + offs_n, n_end, row_limit, IS_CAUSAL)
            p, m_i, l_i, acc = online_softmax(qk, m_i, l_i, acc, qk_scale, True)
            v = load_rows(v_ptrs, start_n + offs_n, n_end, offs_d, HEAD_DIM, HEAD_DIM_PAD, True)
            acc = tl.dot(p.to(v.dtype), v, acc)
            k_ptrs += BLOCK_N * stride_kn
            v_ptrs += BLOCK_N * stride_vn

    # -- epilogue: normalise, store the output and the LSE ---------------------------------------
    out, lse = finalize(acc, m_i, l_i)
    if IS_VARLEN:
        tl.store(Lse + off_h.to(tl.int64) * stride_lseh + offs_m, lse, mask=offs_m < M)
    else:
        tl.store(Lse + pid_bh.to(tl.int64) * M + offs_m, lse, mask=offs_m < M)
    if USE_TMA:
        o_desc = tl.make_tensor_descriptor(o_base, [M, HEAD_DIM], [stride_om, 1], [BLOCK_M, HEAD_DIM_PAD])
        o_desc.store([start_m, 0], out.to(Out.dtype.element_ty))
    else:
        store_rows(tile_ptrs(o_base, start_m, stride_om, BLOCK_M, offs_d), out.to(Out.dtype.element_ty),
                   offs_m, M, offs_d, HEAD_DIM, HEAD_DIM_PAD)


# ============================================================================================
# Backward kernels
# ============================================================================================
# dS = P * (dP - delta), delta_i = sum_d O_id * dO_id, dP = dO V^T, P = exp(S - lse):
#   dV = P^T dO,   dK = scale * dS^T Q,   dQ = scale * dS K.
# Three launches: a preprocessing step (delta), a dK/dV kernel whose programs own a block of keys
# of one KV head and stream the queries of every q head in its group (GQA sums in registers: no
# atomics, no per-q-head copies), and a dQ kernel whose programs own a block of queries. Neither
# uses atomics, so the backward is deterministic by construction.
#
# [Note] Fully masked rows in the backward. Their LSE is +inf, so P = exp2(s - inf) = 0 and dS = 0:
# they add nothing to dK/dV and get dQ = 0. Rows past M load LSE = +inf too, which is how the
# dK/dV kernel ignores them without a separate mask.


@triton.jit
def _bwd_preprocess_kernel(
    Out, DO, Delta,
    stride_ob, stride_om, stride_oh,
    stride_dob, stride_dom, stride_doh,
    H, M,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
    Cu_seqlens_q=None, stride_lseh=None, IS_VARLEN: tl.constexpr = False,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    off_b = (pid_bh // H).to(tl.int64)
    off_h = (pid_bh % H).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    if IS_VARLEN:
        q_start = tl.load(Cu_seqlens_q + off_b)
        M = tl.load(Cu_seqlens_q + off_b + 1) - q_start
        if pid_m * BLOCK_M >= M:
            return
        Out += q_start.to(tl.int64) * stride_om
        DO += q_start.to(tl.int64) * stride_dom
        Delta += q_start  # Delta is (H, total_q), like Lse
    o_ptrs = tile_ptrs(Out + off_b * stride_ob + off_h * stride_oh, pid_m * BLOCK_M, stride_om, BLOCK_M, offs_d)
    do_ptrs = tile_ptrs(DO + off_b * stride_dob + off_h * stride_doh, pid_m * BLOCK_M, stride_dom, BLOCK_M, offs_d)
    o = load_rows(o_ptrs, offs_m, M, offs_d, HEAD_DIM, HEAD_DIM_PAD, True).to(tl.float32)
    do = load_rows(do_ptrs, offs_m, M, offs_d, HEAD_DIM, HEAD_DIM_PAD, True).to(tl.float32)
    delta = tl.sum(o * do, 1)  # [BLOCK_M]
    if IS_VARLEN:
        tl.store(Delta + off_h * stride_lseh + offs_m, delta, mask=offs_m < M)
    else:
        tl.store(Delta + pid_bh.to(tl.int64) * M + offs_m, delta, mask=offs_m < M)


@triton.jit
def _bwd_dkdv_inner(
    dk, dv, k, v,
    q_src, do_src, lse_base, delta_base, stride_qm, stride_dom,
    offs_n, offs_d, M, diag, qk_scale, lo, hi,
    BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    IS_CAUSAL: tl.constexpr, MASKED: tl.constexpr, USE_TMA: tl.constexpr,
):
    """Accumulate dK, dV [BLOCK_N, D_PAD] over query rows [lo, hi) of one q head.

    q_src/do_src are tensor descriptors (USE_TMA) or base pointers of that head's (M, D) slice.
    """
    offs_mb = tl.arange(0, BLOCK_M)
    q_rel = offs_mb[:, None] * stride_qm + offs_d[None, :]  # [BLOCK_M, D_PAD], small offsets
    do_rel = offs_mb[:, None] * stride_dom + offs_d[None, :]
    for start_m in tl.range(lo, hi, BLOCK_M):
        offs_m = start_m + offs_mb  # [BLOCK_M]
        if USE_TMA:
            q = q_src.load([start_m, 0])  # [BLOCK_M, D_PAD], rows past M read as 0
        else:
            q = load_rows(q_src + tl.cast(start_m, tl.int64) * stride_qm + q_rel, offs_m, M, offs_d,
                          HEAD_DIM, HEAD_DIM_PAD, MASKED)
        if MASKED:
            lse2 = tl.load(lse_base + offs_m, mask=offs_m < M, other=float("inf")) * 1.4426950408889634
        else:
            lse2 = tl.load(lse_base + offs_m) * 1.4426950408889634
        qkT = tl.dot(k, tl.trans(q))  # [BLOCK_N, BLOCK_M]
        pT = tl.math.exp2(qkT * qk_scale - lse2[None, :])  # [BLOCK_N, BLOCK_M]
        if MASKED and IS_CAUSAL:
            pT = tl.where(offs_n[:, None] <= offs_m[None, :] + diag, pT, 0.0)
        if USE_TMA:
            do = do_src.load([start_m, 0])
        else:
            do = load_rows(do_src + tl.cast(start_m, tl.int64) * stride_dom + do_rel, offs_m, M, offs_d,
                           HEAD_DIM, HEAD_DIM_PAD, MASKED)  # [BLOCK_M, D_PAD]
        dv = tl.dot(pT.to(do.dtype), do, dv)  # [BLOCK_N, D_PAD]
        if MASKED:
            delta = tl.load(delta_base + offs_m, mask=offs_m < M, other=0.0)
        else:
            delta = tl.load(delta_base + offs_m)
        dpT = tl.dot(v, tl.trans(do))  # [BLOCK_N, BLOCK_M]
        dsT = pT * (dpT - delta[None, :])
        dk = tl.dot(dsT.to(q.dtype), q, dk)  # [BLOCK_N, D_PAD]
    return dk, dv


@triton.jit(do_not_specialize=["M"])  # M == 1 as a constant folds the query loops away (see below)
def _bwd_dkdv_kernel(
    Q, K, V, DO, Lse, Delta, DK, DV,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_dob, stride_dom, stride_doh,
    stride_dkb, stride_dkn, stride_dkh,
    stride_dvb, stride_dvn, stride_dvh,
    H, M, N, GROUP, qk_scale, sm_scale,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr, USE_TMA: tl.constexpr,
    Cu_seqlens_q=None, Cu_seqlens_k=None, stride_lseh=None, IS_VARLEN: tl.constexpr = False,
):
    tl.static_assert(BLOCK_M >= 16 and BLOCK_N >= 16, "tl.dot needs tiles of at least 16")
    pid_n = tl.program_id(0)
    pid_bhk = tl.program_id(1)
    H_KV = H // GROUP
    off_b = (pid_bhk // H_KV).to(tl.int64)
    off_hk = (pid_bhk % H_KV).to(tl.int64)
    start_n = pid_n * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    if IS_VARLEN:
        k_start = tl.load(Cu_seqlens_k + off_b)
        N = tl.load(Cu_seqlens_k + off_b + 1) - k_start
        if start_n >= N:  # the grid covers max_seqlen_k
            return
        q_start = tl.load(Cu_seqlens_q + off_b)
        M = tl.load(Cu_seqlens_q + off_b + 1) - q_start  # may be 0: no query, dK = dV = 0
        Q += q_start.to(tl.int64) * stride_qm
        DO += q_start.to(tl.int64) * stride_dom
        K += k_start.to(tl.int64) * stride_kn
        V += k_start.to(tl.int64) * stride_vn
        DK += k_start.to(tl.int64) * stride_dkn
        DV += k_start.to(tl.int64) * stride_dvn
        Lse += q_start
        Delta += q_start

    k_base = K + off_b * stride_kb + off_hk * stride_kh
    v_base = V + off_b * stride_vb + off_hk * stride_vh
    if USE_TMA:
        k = tl.make_tensor_descriptor(k_base, [N, HEAD_DIM], [stride_kn, 1], [BLOCK_N, HEAD_DIM_PAD]).load([start_n, 0])
        v = tl.make_tensor_descriptor(v_base, [N, HEAD_DIM], [stride_vn, 1], [BLOCK_N, HEAD_DIM_PAD]).load([start_n, 0])
    else:
        k = load_rows(tile_ptrs(k_base, start_n, stride_kn, BLOCK_N, offs_d), offs_n, N, offs_d,
                      HEAD_DIM, HEAD_DIM_PAD, True)  # [BLOCK_N, D_PAD]
        v = load_rows(tile_ptrs(v_base, start_n, stride_vn, BLOCK_N, offs_d), offs_n, N, offs_d,
                      HEAD_DIM, HEAD_DIM_PAD, True)
    dk = tl.zeros([BLOCK_N, HEAD_DIM_PAD], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM_PAD], dtype=tl.float32)

    # Query ranges: [m_lo, m_mid) is the diagonal band (causal mask), [m_mid, m_full) is seen
    # whole and in bounds (no mask), [max(m_mid, m_full), m_ceil) is the ragged row tail.
    diag = N - M  # query i sees key j iff j <= i + diag
    if IS_CAUSAL:
        m_lo = tl.maximum(start_n - diag, 0) // BLOCK_M * BLOCK_M
        m_mid = (tl.maximum(start_n + BLOCK_N - 1 - diag, 0) + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    else:
        m_lo = 0
        m_mid = 0
    m_ceil = tl.cdiv(M, BLOCK_M) * BLOCK_M
    m_full = M // BLOCK_M * BLOCK_M
    m_band_end = tl.minimum(m_mid, m_ceil)
    m_tail = tl.maximum(m_mid, m_full)

    # Every q head of this KV head's group adds into the same dK, dV. num_stages=1: this outer loop
    # creates tensor descriptors, which the software pipeliner cannot predicate, so it must never
    # be pipelined (it would be, were the inner query loops folded away).
    for g in tl.range(0, GROUP, num_stages=1):
        off_h = off_hk * GROUP + g
        q_src = Q + off_b * stride_qb + off_h * stride_qh
        do_src = DO + off_b * stride_dob + off_h * stride_doh
        if USE_TMA:
            q_src = tl.make_tensor_descriptor(q_src, [M, HEAD_DIM], [stride_qm, 1], [BLOCK_M, HEAD_DIM_PAD])
            do_src = tl.make_tensor_descriptor(do_src, [M, HEAD_DIM], [stride_dom, 1], [BLOCK_M, HEAD_DIM_PAD])
        if IS_VARLEN:
            lse_base = Lse + off_h * stride_lseh
            delta_base = Delta + off_h * stride_lseh
        else:
            lse_base = Lse + (off_b * H + off_h) * M
            delta_base = Delta + (off_b * H + off_h) * M
        dk, dv = _bwd_dkdv_inner(dk, dv, k, v, q_src, do_src, lse_base, delta_base, stride_qm, stride_dom,
                                 offs_n, offs_d, M, diag, qk_scale, m_lo, m_band_end,
                                 BLOCK_M, HEAD_DIM, HEAD_DIM_PAD, IS_CAUSAL, True, USE_TMA)
        dk, dv = _bwd_dkdv_inner(dk, dv, k, v, q_src, do_src, lse_base, delta_base, stride_qm, stride_dom,
                                 offs_n, offs_d, M, diag, qk_scale, m_mid, m_full,
                                 BLOCK_M, HEAD_DIM, HEAD_DIM_PAD, IS_CAUSAL, False, USE_TMA)
        dk, dv = _bwd_dkdv_inner(dk, dv, k, v, q_src, do_src, lse_base, delta_base, stride_qm, stride_dom,
                                 offs_n, offs_d, M, diag, qk_scale, m_tail, m_ceil,
                                 BLOCK_M, HEAD_DIM, HEAD_DIM_PAD, IS_CAUSAL, True, USE_TMA)

    dk = dk * sm_scale
    store_rows(tile_ptrs(DK + off_b * stride_dkb + off_hk * stride_dkh, start_n, stride_dkn, BLOCK_N, offs_d),
               dk.to(DK.dtype.element_ty), offs_n, N, offs_d, HEAD_DIM, HEAD_DIM_PAD)
    store_rows(tile_ptrs(DV + off_b * stride_dvb + off_hk * stride_dvh, start_n, stride_dvn, BLOCK_N, offs_d),
               dv.to(DV.dtype.element_ty), offs_n, N, offs_d, HEAD_DIM, HEAD_DIM_PAD)


@triton.jit
def _bwd_dq_kernel(
    Q, K, V, DO, Lse, Delta, DQ,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_dob, stride_dom, stride_doh,
    stride_dqb, stride_dqm, stride_dqh,
    H, M, N, GROUP, qk_scale, sm_scale,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr, USE_TMA: tl.constexpr,
    Cu_seqlens_q=None, Cu_seqlens_k=None, stride_lseh=None, IS_VARLEN: tl.constexpr = False,
):
    tl.static_assert(BLOCK_M >= 16 and BLOCK_N >= 16, "tl.dot needs tiles of at least 16")
    if IS_CAUSAL:
        pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    else:
        pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    off_b = (pid_bh // H).to(tl.int64)
    off_h = pid_bh % H
    off_hk = (off_h // GROUP).to(tl.int64)
    off_h = off_h.to(tl.int64)
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    if IS_VARLEN:
        q_start = tl.load(Cu_seqlens_q + off_b)
        M = tl.load(Cu_seqlens_q + off_b + 1) - q_start
        if start_m >= M:  # the grid covers max_seqlen_q
            return
        k_start = tl.load(Cu_seqlens_k + off_b)
        N = tl.load(Cu_seqlens_k + off_b + 1) - k_start  # may be 0: no key, dQ = 0
        Q += q_start.to(tl.int64) * stride_qm
        DO += q_start.to(tl.int64) * stride_dom
        DQ += q_start.to(tl.int64) * stride_dqm
        K += k_start.to(tl.int64) * stride_kn
        V += k_start.to(tl.int64) * stride_vn
        Lse += q_start
        Delta += q_start

    q_base = Q + off_b * stride_qb + off_h * stride_qh
    do_base = DO + off_b * stride_dob + off_h * stride_doh
    k_base = K + off_b * stride_kb + off_hk * stride_kh
    v_base = V + off_b * stride_vb + off_hk * stride_vh
    if USE_TMA:
        q = tl.make_tensor_descriptor(q_base, [M, HEAD_DIM], [stride_qm, 1], [BLOCK_M, HEAD_DIM_PAD]).load([start_m, 0])
        do = tl.make_tensor_descriptor(do_base, [M, HEAD_DIM], [stride_dom, 1], [BLOCK_M, HEAD_DIM_PAD]).load(
            [start_m, 0])
        k_desc = tl.make_tensor_descriptor(k_base, [N, HEAD_DIM], [stride_kn, 1], [BLOCK_N, HEAD_DIM_PAD])
        v_desc = tl.make_tensor_descriptor(v_base, [N, HEAD_DIM], [stride_vn, 1], [BLOCK_N, HEAD_DIM_PAD])
    else:
        q = load_rows(tile_ptrs(q_base, start_m, stride_qm, BLOCK_M, offs_d), offs_m, M, offs_d,
                      HEAD_DIM, HEAD_DIM_PAD, True)  # [BLOCK_M, D_PAD]
        do = load_rows(tile_ptrs(do_base, start_m, stride_dom, BLOCK_M, offs_d), offs_m, M, offs_d,
                       HEAD_DIM, HEAD_DIM_PAD, True)
    if IS_VARLEN:
        row = off_h * stride_lseh
    else:
        row = pid_bh.to(tl.int64) * M
    lse2 = tl.load(Lse + row + offs_m, mask=offs_m < M, other=float("inf")) * 1.4426950408889634
    delta = tl.load(Delta + row + offs_m, mask=offs_m < M, other=0.0)
    dq = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)

    if IS_CAUSAL:
        diag = N - M
        row_limit = offs_m + diag
        n_full = tl.minimum(tl.maximum(start_m + diag + 1, 0) // BLOCK_N * BLOCK_N, N // BLOCK_N * BLOCK_N)
        n_end = tl.minimum(tl.maximum(start_m + BLOCK_M + diag, 0), N)
    else:
        row_limit = offs_m
        n_full = N // BLOCK_N * BLOCK_N
        n_end = N

    k_ptrs = k_base + offs_n[:, None] * stride_kn + offs_d[None, :]  # [BLOCK_N, D_PAD]
    v_ptrs = v_base + offs_n[:, None] * stride_vn + offs_d[None, :]
    for start_n in tl.range(0, n_full, BLOCK_N):  # blocks every row sees whole
        if USE_TMA:
            k = k_desc.load([start_n, 0])
            v = v_desc.load([start_n, 0])
        else:
            k = load_rows(k_ptrs, offs_n, BLOCK_N, offs_d, HEAD_DIM, HEAD_DIM_PAD, False)  # [BLOCK_N, D_PAD]
            v = load_rows(v_ptrs, offs_n, BLOCK_N, offs_d, HEAD_DIM, HEAD_DIM_PAD, False)
        qk = tl.dot(q, tl.trans(k))  # [BLOCK_M, BLOCK_N]
        p = tl.math.exp2(qk * qk_scale - lse2[:, None])
        dp = tl.dot(do, tl.trans(v))  # [BLOCK_M, BLOCK_N]
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq)  # [BLOCK_M, D_PAD]
        k_ptrs += BLOCK_N * stride_kn
        v_ptrs += BLOCK_N * stride_vn
    for start_n in tl.range(n_full, n_end, BLOCK_N):  # diagonal band and ragged tail
        if USE_TMA:
            k = k_desc.load([start_n, 0])
            v = v_desc.load([start_n, 0])
        else:
            k = load_rows(k_ptrs, start_n + offs_n, n_end, offs_d, HEAD_DIM, HEAD_DIM_PAD, True)
            v = load_rows(v_ptrs, start_n + offs_n, n_end, offs_d, HEAD_DIM, HEAD_DIM_PAD, True)
        qk = tl.dot(q, tl.trans(k))
        qk = mask_scores(qk, start_n + offs_n, n_end, row_limit, IS_CAUSAL)
        p = tl.math.exp2(qk * qk_scale - lse2[:, None])
        dp = tl.dot(do, tl.trans(v))
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq)
        k_ptrs += BLOCK_N * stride_kn
        v_ptrs += BLOCK_N * stride_vn

    dq = dq * sm_scale
    store_rows(tile_ptrs(DQ + off_b * stride_dqb + off_h * stride_dqh, start_m, stride_dqm, BLOCK_M, offs_d),
               dq.to(DQ.dtype.element_ty), offs_m, M, offs_d, HEAD_DIM, HEAD_DIM_PAD)


# ============================================================================================
# Launcher: validate, allocate, launch
# ============================================================================================
def _tma_allocator(size: int, alignment: int, stream: Optional[int]) -> torch.Tensor:
    """Scratch for device-side tensor descriptors (a few hundred bytes per program)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _ensure_tma_allocator() -> None:
    from triton.runtime import _allocation

    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(_tma_allocator)


def _tma_ok(*tensors: torch.Tensor) -> bool:
    """Tensor descriptors need 16-byte aligned bases and 16-byte multiples for every outer stride."""
    for t in tensors:
        size = t.element_size()
        if t.data_ptr() % 16 != 0 or any((s * size) % 16 != 0 for s in t.stride()[:-1]):
            return False
    return True


def _use_tma(requested: bool, *tensors: torch.Tensor) -> bool:
    """Tensor-descriptor loads: requested by the config, on a Hopper-or-newer GPU, 2-byte dtypes, aligned."""
    q = tensors[0]
    if not requested or q.device.type != "cuda" or is_interpreter() or q.element_size() != 2:
        return False
    index = q.device.index if q.device.index is not None else torch.cuda.current_device()
    return device_capability(index)[0] >= 9 and _tma_ok(*tensors)


def _validate_qkv(q, k, v) -> None:
    layout = "(batch, seqlen, nheads, headdim)"
    _validate_tensor("q", q, 4, layout)
    _validate_tensor("k", k, 4, layout)
    _validate_tensor("v", v, 4, layout)
    _validate_dtypes(q=q, k=k, v=v)
    _validate_devices(q=q, k=k, v=v)
    if k.shape != v.shape:
        raise ValueError(f"Expected k and v to have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}.")
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"Expected q and k to share the batch size, got {q.shape[0]} and {k.shape[0]}.")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"Expected q and k to share the head dim, got {q.shape[3]} and {k.shape[3]}.")
    _validate_head_dim(q.shape[3])
    _validate_heads(q.shape[2], k.shape[2])


def _row_strides(t: torch.Tensor, packed: bool) -> Tuple[int, int, int]:
    """(batch, row, head) strides: a packed (total, heads, D) tensor has no batch dim (stride 0;
    each program moves to its sequence's first row itself)."""
    return (0, t.stride(0), t.stride(1)) if packed else (t.stride(0), t.stride(1), t.stride(2))


_launch_fwd = LaunchCache(_fwd_kernel)  # the cache mode's fast launch (chunked prefill)


def _launch_forward(q, k, v, out, lse, batch, seqlen_q, seqlen_k, softmax_scale, causal, config, extra, *,
                    use_tma=None, kv_strides=None, launch_key=None):
    """Launch _fwd_kernel; `extra` holds the packed-mode or the cache-mode kernel arguments ({} for
    dense tensors). The cache mode passes its own tensor-descriptor decision (`use_tma`), K/V
    (batch, row, head) strides (`kv_strides`) and a `launch_key` for the fast launch (everything
    the kernel specialises on, see kernels/_launch.py); otherwise the first two follow from the
    tensors and the launch goes through Triton's dispatcher.

    One program per (query block, batch entry or sequence, head); in packed mode seqlen_q/k are the
    longest lengths and blocks past a shorter sequence's end exit at once.
    """
    nheads, nheads_k, head_dim = q.shape[-2], k.shape[-2], q.shape[-1]
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    if config is None:
        config = prefill_fwd_config(head_dim_pad, q.dtype, causal, q.device)
    if use_tma is None:
        use_tma = _use_tma(config.use_tma, q, k, v, out)
    if use_tma:
        _ensure_tma_allocator()
    packed = extra.get("IS_VARLEN", False)
    if kv_strides is None:
        kv_strides = (_row_strides(k, packed), _row_strides(v, packed))
    grid = (triton.cdiv(seqlen_q, config.block_m), batch * nheads, 1)
    args = (q, k, v, out, lse,
            *_row_strides(q, packed), *kv_strides[0], *kv_strides[1], *_row_strides(out, packed),
            nheads, seqlen_q, seqlen_k, nheads // nheads_k, softmax_scale * LOG2E)
    kwargs = dict(HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
                  IS_CAUSAL=causal, USE_TMA=use_tma, **extra)
    device_index = q.device.index if q.device.index is not None else 0
    with torch.cuda.device(q.device) if q.device.type == "cuda" else contextlib.nullcontext():
        if launch_key is None:
            _fwd_kernel[grid](*args, **kwargs, num_warps=config.num_warps, num_stages=config.num_stages)
        else:
            _launch_fwd((launch_key, config, use_tma), grid, args, config.num_warps, config.num_stages, kwargs,
                        device_index)


def _launch_backward(dout, q, k, v, out, lse, dq, dk, dv, delta, batch, seqlen_q, seqlen_k, softmax_scale, causal,
                     configs, varlen):
    """Launch the three backward kernels; `varlen` as in _launch_forward."""
    nheads, nheads_k, head_dim = q.shape[-2], k.shape[-2], q.shape[-1]
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    cfg_kv, cfg_q = configs if configs is not None else prefill_bwd_config(head_dim_pad, q.dtype, causal, q.device)
    group = nheads // nheads_k
    use_tma = _use_tma(cfg_kv.use_tma, q, k, v, dout)
    if use_tma:
        _ensure_tma_allocator()
    packed = bool(varlen)
    varlen_pre = {key: val for key, val in varlen.items() if key != "Cu_seqlens_k"}  # preprocess reads no keys
    q_s, k_s, v_s, do_s = (_row_strides(t, packed) for t in (q, k, v, dout))
    with torch.cuda.device(q.device) if q.device.type == "cuda" else contextlib.nullcontext():
        _bwd_preprocess_kernel[(triton.cdiv(seqlen_q, 64), batch * nheads)](
            out, dout, delta,
            *_row_strides(out, packed), *do_s,
            nheads, seqlen_q,
            HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, BLOCK_M=64,
            **varlen_pre,
        )
        _bwd_dkdv_kernel[(triton.cdiv(seqlen_k, cfg_kv.block_n), batch * nheads_k)](
            q, k, v, dout, lse, delta, dk, dv,
            *q_s, *k_s, *v_s, *do_s, *_row_strides(dk, packed), *_row_strides(dv, packed),
            nheads, seqlen_q, seqlen_k, group, softmax_scale * LOG2E, softmax_scale,
            HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
            BLOCK_M=cfg_kv.block_m, BLOCK_N=cfg_kv.block_n, IS_CAUSAL=causal, USE_TMA=use_tma,
            num_warps=cfg_kv.num_warps, num_stages=cfg_kv.num_stages,
            **varlen,
        )
        _bwd_dq_kernel[(triton.cdiv(seqlen_q, cfg_q.block_m), batch * nheads)](
            q, k, v, dout, lse, delta, dq,
            *q_s, *k_s, *v_s, *do_s, *_row_strides(dq, packed),
            nheads, seqlen_q, seqlen_k, group, softmax_scale * LOG2E, softmax_scale,
            HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
            BLOCK_M=cfg_q.block_m, BLOCK_N=cfg_q.block_n, IS_CAUSAL=causal, USE_TMA=use_tma,
            num_warps=cfg_q.num_warps, num_stages=cfg_q.num_stages,
            **varlen,
        )


def _varlen_args(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, total_q: int) -> dict:
    """Packed-mode kernel arguments; LSE and Delta are (nheads, total_q), so their head stride is total_q."""
    return dict(Cu_seqlens_q=cu_seqlens_q, Cu_seqlens_k=cu_seqlens_k, stride_lseh=total_q, IS_VARLEN=True)


def _flash_attn_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    config: Optional[AttnConfig] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Launch the forward kernel on validated inputs; returns (out, softmax_lse)."""
    batch, seqlen_q, nheads, head_dim = q.shape
    seqlen_k = k.shape[1]
    out = torch.empty((batch, seqlen_q, nheads, head_dim), dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, nheads, seqlen_q), dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        lse.fill_(float("inf"))
        return out, lse
    _launch_forward(q, k, v, out, lse, batch, seqlen_q, seqlen_k, softmax_scale, causal, config, {})
    return out, lse


def _flash_attn_kvcache_forward(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    appended: bool,
    block_table: Optional[torch.Tensor],
    softmax_scale: float,
    causal: bool,
    config: Optional[AttnConfig] = None,
    launch_key=None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Chunked prefill (see [Note] Chunked prefill over a cache): q (B, M, H, D) attends over each
    request's cached keys, cache_seqlens[b] of them plus, when `appended`, the M keys just written
    after them. The cache is dense (B, S, H_KV, D) or, with block_table (B, max_blocks) int32, a
    paged pool (NUM_BLOCKS, P, H_KV, D). Inputs are validated (kernels.decode does it; its
    `launch_key` holds the inputs' shapes, strides, dtypes and alignment, see _launch_forward); returns
    (out (B, M, H, D), lse (B, H, M) float32)."""
    batch, seqlen_q, nheads, head_dim = q.shape
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    if config is None:
        config = prefill_fwd_config(head_dim_pad, q.dtype, causal, q.device)
    out = torch.empty((batch, seqlen_q, nheads, head_dim), dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, nheads, seqlen_q), dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        lse.fill_(float("inf"))
        return out, lse
    use_tma = _use_tma(config.use_tma, q, k_cache, v_cache, out)
    cache_args = dict(Cache_seqlens=cache_seqlens, IS_KVCACHE=True, KV_APPEND=appended)
    if block_table is None:
        capacity = k_cache.shape[1]
        k_strides, v_strides = k_cache.stride()[:3], v_cache.stride()[:3]
    else:
        num_blocks, page_size = k_cache.shape[0], k_cache.shape[1]
        capacity = block_table.shape[1] * page_size
        # descriptors see the pool as [NUM_BLOCKS * P, D] rows: whole key blocks per page, rows evenly spaced
        use_tma = use_tma and page_size % config.block_n == 0 and all(
            t.stride(0) == page_size * t.stride(1) for t in (k_cache, v_cache))
        k_strides, v_strides = (0, *k_cache.stride()[1:3]), (0, *v_cache.stride()[1:3])  # no batch offset
        cache_args.update(Block_table=block_table, stride_btb=block_table.stride(0), NUM_BLOCKS=num_blocks,
                          stride_kblk=k_cache.stride(0), stride_vblk=v_cache.stride(0), PAGED=True,
                          PAGE_SIZE=page_size, WIDE_PAGES=wide_pages(page_size, k_cache, v_cache))
    _launch_forward(q, k_cache, v_cache, out, lse, batch, seqlen_q, capacity, softmax_scale, causal, config,
                    cache_args, use_tma=use_tma, kv_strides=(k_strides, v_strides), launch_key=launch_key)
    return out, lse


def _flash_attn_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    configs: Optional[Tuple[AttnConfig, AttnConfig]] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the backward kernels; returns (dq, dk, dv) shaped like (q, k, v)."""
    batch, seqlen_q, nheads, _ = q.shape
    seqlen_k = k.shape[1]
    if dout.stride(-1) != 1:
        dout = dout.contiguous()

    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    if seqlen_k > 0 and (seqlen_q == 0 or batch == 0):
        dk.zero_()
        dv.zero_()
    if dq.numel() == 0 or dk.numel() == 0:
        dq.zero_()
        return dq, dk, dv
    delta = torch.empty((batch, nheads, seqlen_q), dtype=torch.float32, device=q.device)
    _launch_backward(dout, q, k, v, out, lse, dq, dk, dv, delta, batch, seqlen_q, seqlen_k, softmax_scale, causal,
                     configs, {})
    return dq, dk, dv


def _validate_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> Tuple[int, int]:
    """Checks of packed inputs that need no device sync (see flash_attn_varlen_func); returns the max lengths."""
    _validate_tensor("q", q, 3, "(total_q, nheads, headdim)")
    _validate_tensor("k", k, 3, "(total_k, nheads_k, headdim)")
    _validate_tensor("v", v, 3, "(total_k, nheads_k, headdim)")
    _validate_dtypes(q=q, k=k, v=v)
    device = _validate_devices(q=q, k=k, v=v)
    if k.shape != v.shape:
        raise ValueError(f"Expected k and v to have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}.")
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"Expected q and k to share the head dim, got {q.shape[2]} and {k.shape[2]}.")
    _validate_head_dim(q.shape[2])
    _validate_heads(q.shape[1], k.shape[1])
    max_seqlen_q = _validate_max_seqlen("max_seqlen_q", max_seqlen_q)
    max_seqlen_k = _validate_max_seqlen("max_seqlen_k", max_seqlen_k)
    _validate_cu_seqlens("cu_seqlens_q", cu_seqlens_q, device)
    _validate_cu_seqlens("cu_seqlens_k", cu_seqlens_k, device)
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(
            f"Expected cu_seqlens_q and cu_seqlens_k to describe the same batch, got {cu_seqlens_q.numel() - 1} "
            f"and {cu_seqlens_k.numel() - 1} sequences (shapes {tuple(cu_seqlens_q.shape)} and "
            f"{tuple(cu_seqlens_k.shape)})."
        )
    if cu_seqlens_q.device.type == "cpu":  # readable without a device sync (the interpreter's case)
        _validate_cu_seqlens_values("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q, "max_seqlen_q")
        _validate_cu_seqlens_values("cu_seqlens_k", cu_seqlens_k, k.shape[0], max_seqlen_k, "max_seqlen_k")
    return max_seqlen_q, max_seqlen_k


def _flash_attn_varlen_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    causal: bool,
    config: Optional[AttnConfig] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Launch the forward kernel on validated packed inputs; returns (out, softmax_lse (nheads, total_q))."""
    total_q, nheads, head_dim = q.shape
    batch = cu_seqlens_q.numel() - 1
    out = torch.empty((total_q, nheads, head_dim), dtype=q.dtype, device=q.device)
    lse = torch.empty((nheads, total_q), dtype=torch.float32, device=q.device)
    if out.numel() == 0 or batch == 0 or max_seqlen_q == 0:
        out.zero_()
        lse.fill_(float("inf"))
        return out, lse
    _launch_forward(q, k, v, out, lse, batch, max_seqlen_q, max_seqlen_k, softmax_scale, causal, config,
                    _varlen_args(cu_seqlens_q, cu_seqlens_k, total_q))
    return out, lse


def _flash_attn_varlen_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    causal: bool,
    configs: Optional[Tuple[AttnConfig, AttnConfig]] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the backward kernels in packed mode; returns (dq, dk, dv) shaped like (q, k, v)."""
    total_q, nheads, _ = q.shape
    batch = cu_seqlens_q.numel() - 1
    if dout.stride(-1) != 1:
        dout = dout.contiguous()

    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    if dq.numel() == 0 or dk.numel() == 0 or batch == 0 or max_seqlen_q == 0 or max_seqlen_k == 0:
        dq.zero_()  # no query or no key anywhere: every gradient is 0
        dk.zero_()
        dv.zero_()
        return dq, dk, dv
    delta = torch.empty((nheads, total_q), dtype=torch.float32, device=q.device)
    _launch_backward(dout, q, k, v, out, lse, dq, dk, dv, delta, batch, max_seqlen_q, max_seqlen_k, softmax_scale,
                     causal, configs, _varlen_args(cu_seqlens_q, cu_seqlens_k, total_q))
    return dq, dk, dv


# ============================================================================================
# Autograd
# ============================================================================================
class _FlashAttnFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, softmax_scale, causal):
        out, lse = _flash_attn_forward(q, k, v, softmax_scale, causal)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.softmax_scale = softmax_scale
        ctx.causal = causal
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _flash_attn_backward(dout, q, k, v, out, lse, ctx.softmax_scale, ctx.causal)
        return dq, dk, dv, None, None


class _FlashAttnVarlenFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal):
        out, lse = _flash_attn_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                              softmax_scale, causal)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k)
        ctx.max_seqlen_q, ctx.max_seqlen_k = max_seqlen_q, max_seqlen_k
        ctx.softmax_scale = softmax_scale
        ctx.causal = causal
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k = ctx.saved_tensors
        dq, dk, dv = _flash_attn_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                                                 ctx.max_seqlen_q, ctx.max_seqlen_k, ctx.softmax_scale, ctx.causal)
        return dq, dk, dv, None, None, None, None, None, None


# ============================================================================================
# Public function
# ============================================================================================
def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = 0.0,
    *,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    deterministic: bool = False,
    return_softmax_lse: bool = False,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Attention softmax(q @ k^T * softmax_scale) @ v with flash-attn's interface.

    Args:
        q: (batch, seqlen_q, nheads, headdim), float16, bfloat16 or float32.
        k: (batch, seqlen_k, nheads_k, headdim), same dtype and device as q.
        v: (batch, seqlen_k, nheads_k, headdim).
            nheads must be a multiple of nheads_k: query head h uses KV head h // (nheads // nheads_k)
            (MHA: nheads_k == nheads, GQA: in between, MQA: nheads_k == 1). Any strides work as long
            as the last dim is contiguous (views of a fused QKV projection, transposed
            (batch, nheads, seqlen, headdim) tensors); no copies are made.
            headdim: a multiple of 8 in [16, 256].
        dropout_p: must be 0.0 (dropout is not implemented).
        softmax_scale: defaults to headdim ** -0.5.
        causal: mask aligned to the bottom-right corner: query i sees key j iff
            j <= i + seqlen_k - seqlen_q. For seqlen_q = 2, seqlen_k = 5 (1 = kept):
                1 1 1 1 0
                1 1 1 1 1
            and for seqlen_q = 5, seqlen_k = 2:
                0 0
                0 0
                0 0
                1 0
                1 1
            A row that sees no key (the first three above) outputs zeros, never NaN.
        deterministic: flash-attn's flag. Both values take the same path: neither the forward nor the
            backward uses atomics (dK/dV of a KV head are summed over its q-head group in
            registers, dQ has its own kernel), so gradients are bit-identical run to run.
        return_softmax_lse: also return the log-sum-exp of each row.

    Returns:
        out: (batch, seqlen_q, nheads, headdim), dtype of q.
        softmax_lse (if return_softmax_lse): (batch, nheads, seqlen_q) float32, natural log of the
            sum of exp(scaled scores) of each row; +inf for a row that sees no key, so that
            exp(score - lse) is 0 there.

    Precision: fp16/bf16 inputs are multiplied on tensor cores with fp32 accumulation. fp32 inputs
    use tf32 matmuls on GPUs (about 1e-3 relative error) and exact fp32 under the interpreter.
    """
    _validate_dropout(dropout_p)
    _validate_qkv(q, k, v)
    scale = _validate_softmax_scale(softmax_scale, q.shape[3])
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        out, lse = _FlashAttnFunc.apply(q, k, v, scale, bool(causal))
    else:
        out, lse = _flash_attn_forward(q, k, v, scale, bool(causal))
    return (out, lse) if return_softmax_lse else out


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    *,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    deterministic: bool = False,
    return_softmax_lse: bool = False,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Attention over a batch of sequences of different lengths packed without padding (flash-attn's
    varlen interface). Sequence b's queries attend only to sequence b's keys.

    Args:
        q: (total_q, nheads, headdim), float16, bfloat16 or float32: the queries of every sequence
            concatenated along dim 0; sequence b owns rows [cu_seqlens_q[b], cu_seqlens_q[b + 1]).
        k: (total_k, nheads_k, headdim), same dtype and device as q; rows of sequence b are
            [cu_seqlens_k[b], cu_seqlens_k[b + 1]).
        v: (total_k, nheads_k, headdim).
            Heads, head dims and strides as in flash_attn_func: nheads a multiple of nheads_k
            (MHA/GQA/MQA), headdim a multiple of 8 in [16, 256], any strides with a contiguous last
            dim (e.g. slices of a packed (total, nheads + 2 * nheads_k, headdim) QKV buffer).
        cu_seqlens_q: (batch + 1,) torch.int32 on q's device: prefix sums of the query lengths,
            cu_seqlens_q[0] == 0, non-decreasing, cu_seqlens_q[-1] == total_q. For lengths [3, 0, 5]:
            tensor([0, 3, 3, 8], dtype=torch.int32). Lengths 0 and 1 are allowed.
        cu_seqlens_k: (batch + 1,) torch.int32, the same for the keys; cu_seqlens_k[-1] == total_k.
            The key length of a sequence may differ from its query length (a prompt continuing a
            cached prefix) and may be 0.
        max_seqlen_q: Python int >= the longest query length: sizes the grid (programs of blocks
            past a shorter sequence's end exit at once; no work is spent on padding).
        max_seqlen_k: Python int >= the longest key length.
        dropout_p: must be 0.0 (dropout is not implemented).
        softmax_scale: defaults to headdim ** -0.5.
        causal: per sequence, aligned to the bottom-right corner: query i of sequence b sees key j
            iff j <= i + seqlen_k[b] - seqlen_q[b]. For seqlen_q[b] = 2, seqlen_k[b] = 5 (1 = kept):
                1 1 1 1 0
                1 1 1 1 1
            A row that sees no key (seqlen_q[b] > seqlen_k[b], or seqlen_k[b] == 0) outputs zeros.
        deterministic: flash-attn's flag. As in flash_attn_func, both values take the same
            atomic-free path: gradients are bit-identical run to run.
        return_softmax_lse: also return the log-sum-exp of each row.

    Returns:
        out: (total_q, nheads, headdim), dtype of q, packed like q.
        softmax_lse (if return_softmax_lse): (nheads, total_q) float32, flash-attn's packed varlen
            layout: softmax_lse[h, cu_seqlens_q[b] + i] is the natural-log LSE of query i of
            sequence b at head h (not (batch, nheads, max_seqlen_q) as in flash_attn_func); +inf for
            a row that sees no key.

    Validation (before any launch): ranks, dtypes, devices, head counts and head dim of q/k/v;
    cu_seqlens_q/k of dtype int32, 1-D, the same (batch + 1,) shape, on q's device; max_seqlen_q/k
    ints >= 0. Checking the *values* of cu_seqlens needs them on the host: CPU cu_seqlens (the
    interpreter's case) are checked in full (starts at 0, non-decreasing, ends at total_q /
    total_k, no sequence longer than max_seqlen_q / max_seqlen_k). CUDA cu_seqlens are not read,
    since that would cost a device sync on every call: their values and the max_seqlen bounds are
    trusted, as in flash-attn, and wrong values give wrong results or out-of-bounds accesses.

    Precision as in flash_attn_func. The kernels are flash_attn_func's (IS_VARLEN=True) with the same
    tile arithmetic, so a sequence gives the same result packed as alone (bit-identical under the
    interpreter; on a GPU the two compiled variants may differ in rounding).
    """
    _validate_dropout(dropout_p)
    max_seqlen_q, max_seqlen_k = _validate_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    scale = _validate_softmax_scale(softmax_scale, q.shape[2])
    cu_seqlens_q, cu_seqlens_k = cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous()
    args = (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, bool(causal))
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        out, lse = _FlashAttnVarlenFunc.apply(*args)
    else:
        out, lse = _flash_attn_varlen_forward(*args)
    return (out, lse) if return_softmax_lse else out
