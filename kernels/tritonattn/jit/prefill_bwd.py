"""The FlashAttention-2 backward kernels: `bwd_preprocess_kernel` (delta = rowsum(dO * O), and the
sinks' gradient shares), `bwd_dkdv_kernel` (one program per key block: dK, dV) and `bwd_dq_kernel` (one
program per query block: dQ), atomic-free and so deterministic. Masks, scores and layouts are the
forward's ([Note]s in kernels/tritonattn/jit/prefill_fwd.py), through the same helpers of jit/common.py.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import (
    LOG2E,
    alibi_terms,
    dropout_keep,
    gqa_q_head,
    in_band,
    key_range,
    load_rows,
    mask_scores,
    query_block,
    score_mods,
    score_units,
    sequence_keys,
    store_rows,
    tile_ptrs,
    window_extent,
)


@triton.jit
def bwd_preprocess_kernel(
    Out, DO, Delta,
    stride_ob, stride_om, stride_oh,
    stride_dob, stride_dom, stride_doh,
    H, M,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
    Cu_seqlens_q=None, stride_lseh=None, IS_VARLEN: tl.constexpr = False,
    Lse=None, Sinks=None, Dsinks_part=None, HAS_SINKS: tl.constexpr = False,
):
    """delta = rowsum(dO * O); with sinks also this block's share of dsink[h] = -sum_i P_i,sink * delta_i
    (P_i,sink = exp(sink - lse_i), see [Note] Sinks), written to Dsinks_part[pid_m, pid_bh] (zeros where
    a program exits early) for the launcher to sum in a fixed order: deterministic."""
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
        if HAS_SINKS:
            Lse += q_start
    o_ptrs = tile_ptrs(Out + off_b * stride_ob + off_h * stride_oh, pid_m * BLOCK_M, stride_om, BLOCK_M, offs_d)
    do_ptrs = tile_ptrs(DO + off_b * stride_dob + off_h * stride_doh, pid_m * BLOCK_M, stride_dom, BLOCK_M, offs_d)
    o = load_rows(o_ptrs, offs_m, M, offs_d, HEAD_DIM, HEAD_DIM_PAD, True).to(tl.float32)
    do = load_rows(do_ptrs, offs_m, M, offs_d, HEAD_DIM, HEAD_DIM_PAD, True).to(tl.float32)
    delta = tl.sum(o * do, 1)  # [BLOCK_M]
    if IS_VARLEN:
        row = off_h * stride_lseh
    else:
        row = pid_bh.to(tl.int64) * M
    tl.store(Delta + row + offs_m, delta, mask=offs_m < M)
    if HAS_SINKS:
        lse = tl.load(Lse + row + offs_m, mask=offs_m < M, other=float("inf"))
        p_sink = tl.exp(tl.load(Sinks + off_h).to(tl.float32) - lse)
        tl.store(Dsinks_part + pid_m * tl.num_programs(1) + pid_bh, -tl.sum(p_sink * delta, 0))


@triton.jit
def bwd_dkdv_inner(
    dk, dv, k, v,
    q_src, do_src, lse_base, delta_base, stride_qm, stride_dom,
    offs_n, offs_d, M, diag, left, right, qk_scale, cap_scale, alibi, lo, hi, dropout,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    IS_CAUSAL: tl.constexpr, MASKED: tl.constexpr, USE_TMA: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
):
    """Accumulate dK, dV [BLOCK_N, D_PAD] over query rows [lo, hi) of one q head.

    q_src/do_src are tensor descriptors (USE_TMA) or base pointers of that head's (M, D) slice.
    dropout: (seed, salt, bh, start_n, keep_threshold, dropout_scale) when HAS_DROPOUT, see [Note]
    Dropout; start_n is the key block's first key. Scores are in `score_units` (qk_scale, cap_scale,
    slope as in the forward); with softcap dS carries tanh's derivative 1 - t^2.
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
            lse2 = tl.load(lse_base + offs_m, mask=offs_m < M, other=float("inf")) * LOG2E
        else:
            lse2 = tl.load(lse_base + offs_m) * LOG2E
        qkT = tl.dot(k, tl.trans(q))  # [BLOCK_N, BLOCK_M]
        if HAS_SOFTCAP or HAS_ALIBI:
            qkT, tT = score_mods(qkT, offs_m[None, :], offs_n[:, None], cap_scale, alibi, HAS_SOFTCAP, HAS_ALIBI)
        pT = tl.math.exp2(qkT * qk_scale - lse2[None, :])  # [BLOCK_N, BLOCK_M]
        if MASKED and (IS_CAUSAL or HAS_WINDOW):
            pT = tl.where(in_band(offs_m[None, :], offs_n[:, None], diag, left, right, IS_CAUSAL, HAS_WINDOW), pT, 0.0)
        if HAS_SOFTCAP:  # dS's factors P and tanh' folded now: t dies before the dots (registers)
            pgT = pT * (1.0 - tT * tT)
        else:
            pgT = pT
        if USE_TMA:
            do = do_src.load([start_m, 0])
        else:
            do = load_rows(do_src + tl.cast(start_m, tl.int64) * stride_dom + do_rel, offs_m, M, offs_d,
                           HEAD_DIM, HEAD_DIM_PAD, MASKED)  # [BLOCK_M, D_PAD]
        if HAS_DROPOUT:  # dV = (P * Z / (1 - p))^T dO; dP reaches S through the same mask and scale
            seed, salt, bh, start_n, keep_threshold, dropout_scale = dropout
            keepT = tl.trans(dropout_keep(seed, salt, bh, offs_m, start_n, BLOCK_N, keep_threshold))
            dv = tl.dot(tl.where(keepT, pT * dropout_scale, 0.0).to(do.dtype), do, dv)
        else:
            dv = tl.dot(pT.to(do.dtype), do, dv)  # [BLOCK_N, D_PAD]
        if MASKED:
            delta = tl.load(delta_base + offs_m, mask=offs_m < M, other=0.0)
        else:
            delta = tl.load(delta_base + offs_m)
        dpT = tl.dot(v, tl.trans(do))  # [BLOCK_N, BLOCK_M]
        if HAS_DROPOUT:
            dpT = tl.where(keepT, dpT * dropout_scale, 0.0)
        dsT = pgT * (dpT - delta[None, :])
        dk = tl.dot(dsT.to(q.dtype), q, dk)  # [BLOCK_N, D_PAD]
    return dk, dv


# M == 1 as a constant folds the query loops away (see below); a new window size is not a new kernel
@triton.jit(do_not_specialize=["M", "window_left", "window_right"])
def bwd_dkdv_kernel(
    Q, K, V, DO, Lse, Delta, DK, DV,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_dob, stride_dom, stride_doh,
    stride_dkb, stride_dkn, stride_dkh,
    stride_dvb, stride_dvn, stride_dvh,
    H, M, N, GROUP, softmax_scale, window_left, window_right, softcap,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr, USE_TMA: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_SINKS: tl.constexpr,
    HAS_SEQUSED_K: tl.constexpr, KV_FP8: tl.constexpr = False,  # no cache here: never on
    HAS_TREE: tl.constexpr = False,  # a verify step's tree: decode only, never on here
    Alibi=None, stride_alibi_b=None, Sinks=None, Seqused_k=None, Alibi_shift=None,
    Cu_seqlens_q=None, Cu_seqlens_k=None, stride_lseh=None, IS_VARLEN: tl.constexpr = False,
    Rng=None, keep_threshold=None, dropout_scale=None, HAS_DROPOUT: tl.constexpr = False,
):
    tl.static_assert(BLOCK_M >= 16 and BLOCK_N >= 16, "tl.dot needs tiles of at least 16")
    tl.static_assert(not HAS_TREE, "a tree mask is decode's")
    unit, cap_scale = score_units(softmax_scale, softcap, HAS_SOFTCAP)
    qk_scale = unit * LOG2E
    pid_n = tl.program_id(0)
    pid_bhk = tl.program_id(1)
    H_KV = H // GROUP
    off_b = (pid_bhk // H_KV).to(tl.int64)
    off_hk = (pid_bhk % H_KV).to(tl.int64)
    start_n = pid_n * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    if IS_VARLEN:
        k_start, N = sequence_keys(Cu_seqlens_k, Seqused_k, off_b, HAS_SEQUSED_K)
        if start_n >= N:  # the grid covers max_seqlen_k (the launcher zeroes dK, dV past seqused_k)
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

    # Query ranges (see [Note] Key band in kernels/tritonattn/jit/common.py; row i sees key j iff
    # i + diag - left <= j <= i + diag + right): [m_lo, m_mid) is the band's diagonal edge (masked),
    # [m_mid, m_whole) is seen whole and in bounds (no mask), [max(m_mid, m_whole), m_end) is the
    # window's far edge and the ragged row tail (masked). Rows outside [m_lo, m_end) see no key here.
    diag = N - M
    left, right = window_extent(window_left, window_right, M, N, IS_CAUSAL, HAS_WINDOW)
    m_ceil = tl.cdiv(M, BLOCK_M) * BLOCK_M
    if IS_CAUSAL or HAS_WINDOW:
        m_lo = tl.minimum(tl.maximum(start_n - diag - right, 0) // BLOCK_M * BLOCK_M, m_ceil)
        m_mid = (tl.maximum(start_n + BLOCK_N - 1 - diag - right, 0) + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    else:
        m_lo = 0
        m_mid = 0
    m_whole = M // BLOCK_M * BLOCK_M
    m_end = m_ceil
    if HAS_WINDOW:  # rows past start_n - diag + left no longer see the block's first key
        m_whole = tl.minimum(m_whole, tl.maximum(start_n - diag + left + 1, 0) // BLOCK_M * BLOCK_M)
        m_end = tl.minimum(tl.cdiv(tl.maximum(start_n + BLOCK_N - diag + left, 0), BLOCK_M) * BLOCK_M, m_ceil)
    m_band_end = tl.minimum(m_mid, m_end)
    m_tail = tl.maximum(m_mid, m_whole)
    if HAS_DROPOUT:
        seed = tl.load(Rng)
        salt = tl.load(Rng + 1)

    # Every q head of this KV head's group adds into the same dK, dV. num_stages=1: this outer loop
    # creates tensor descriptors, which the software pipeliner cannot predicate, so it must never
    # be pipelined (it would be, were the inner query loops folded away).
    for g in tl.range(0, GROUP, num_stages=1):
        off_h = gqa_q_head(off_hk, GROUP, g)
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
        if HAS_DROPOUT:  # the forward's (batch, query head) coordinate
            dropout = (seed, salt, off_b * H + off_h, start_n, keep_threshold, dropout_scale)
        else:
            dropout = (0, 0, 0, 0, 0, 0.0)
        alibi = alibi_terms(Alibi, stride_alibi_b, Alibi_shift, off_b, off_h, unit, diag, HAS_ALIBI)
        dk, dv = bwd_dkdv_inner(dk, dv, k, v, q_src, do_src, lse_base, delta_base, stride_qm, stride_dom,
                                 offs_n, offs_d, M, diag, left, right, qk_scale, cap_scale, alibi, m_lo, m_band_end,
                                 dropout, BLOCK_M, BLOCK_N, HEAD_DIM, HEAD_DIM_PAD, IS_CAUSAL, True, USE_TMA,
                                 HAS_DROPOUT, HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI)
        dk, dv = bwd_dkdv_inner(dk, dv, k, v, q_src, do_src, lse_base, delta_base, stride_qm, stride_dom,
                                 offs_n, offs_d, M, diag, left, right, qk_scale, cap_scale, alibi, m_mid, m_whole,
                                 dropout, BLOCK_M, BLOCK_N, HEAD_DIM, HEAD_DIM_PAD, IS_CAUSAL, False, USE_TMA,
                                 HAS_DROPOUT, HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI)
        dk, dv = bwd_dkdv_inner(dk, dv, k, v, q_src, do_src, lse_base, delta_base, stride_qm, stride_dom,
                                 offs_n, offs_d, M, diag, left, right, qk_scale, cap_scale, alibi, m_tail, m_end,
                                 dropout, BLOCK_M, BLOCK_N, HEAD_DIM, HEAD_DIM_PAD, IS_CAUSAL, True, USE_TMA,
                                 HAS_DROPOUT, HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI)

    dk = dk * softmax_scale
    store_rows(tile_ptrs(DK + off_b * stride_dkb + off_hk * stride_dkh, start_n, stride_dkn, BLOCK_N, offs_d),
               dk.to(DK.dtype.element_ty), offs_n, N, offs_d, HEAD_DIM, HEAD_DIM_PAD)
    store_rows(tile_ptrs(DV + off_b * stride_dvb + off_hk * stride_dvh, start_n, stride_dvn, BLOCK_N, offs_d),
               dv.to(DV.dtype.element_ty), offs_n, N, offs_d, HEAD_DIM, HEAD_DIM_PAD)


@triton.jit
def bwd_dq_inner(
    dq, q, do, lse2, delta, k_src, v_src, stride_kn, stride_vn, lo, hi,
    offs_m, offs_n, offs_d, n_end, diag, left, right, qk_scale, cap_scale, alibi, dropout,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, MASKED: tl.constexpr,
    USE_TMA: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr, HAS_DROPOUT: tl.constexpr,
):
    """Accumulate dQ [BLOCK_M, D_PAD] over key blocks [lo, hi) (k_src/v_src as in `fwd_inner`).
    dropout: (seed, salt, bh, keep_threshold, dropout_scale)."""
    k_rel = offs_n[:, None] * stride_kn + offs_d[None, :]
    v_rel = offs_n[:, None] * stride_vn + offs_d[None, :]
    for start_n in tl.range(lo, hi, BLOCK_N):
        if USE_TMA:
            k = k_src.load([start_n, 0])
            v = v_src.load([start_n, 0])
        else:
            k = load_rows(k_src + tl.cast(start_n, tl.int64) * stride_kn + k_rel, start_n + offs_n, n_end, offs_d,
                          HEAD_DIM, HEAD_DIM_PAD, MASKED)  # [BLOCK_N, D_PAD]
            v = load_rows(v_src + tl.cast(start_n, tl.int64) * stride_vn + v_rel, start_n + offs_n, n_end, offs_d,
                          HEAD_DIM, HEAD_DIM_PAD, MASKED)
        qk = tl.dot(q, tl.trans(k))  # [BLOCK_M, BLOCK_N]
        if HAS_SOFTCAP or HAS_ALIBI:
            qk, t = score_mods(qk, offs_m[:, None], (start_n + offs_n)[None, :], cap_scale, alibi, HAS_SOFTCAP,
                               HAS_ALIBI)
        if MASKED:
            qk = mask_scores(qk, offs_m, start_n + offs_n, n_end, diag, left, right, IS_CAUSAL, HAS_WINDOW)
        p = tl.math.exp2(qk * qk_scale - lse2[:, None])
        if HAS_SOFTCAP:  # dS's factors P and tanh' folded now: t dies before the dot (registers)
            p = p * (1.0 - t * t)
        dp = tl.dot(do, tl.trans(v))  # [BLOCK_M, BLOCK_N]
        if HAS_DROPOUT:
            seed, salt, bh, keep_threshold, dropout_scale = dropout
            dp = tl.where(dropout_keep(seed, salt, bh, offs_m, start_n, BLOCK_N, keep_threshold), dp * dropout_scale,
                          0.0)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq)  # [BLOCK_M, D_PAD]
    return dq


@triton.jit(do_not_specialize=["window_left", "window_right"])
def bwd_dq_kernel(
    Q, K, V, DO, Lse, Delta, DQ,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_dob, stride_dom, stride_doh,
    stride_dqb, stride_dqm, stride_dqh,
    H, M, N, GROUP, softmax_scale, window_left, window_right, softcap,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr, USE_TMA: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_SINKS: tl.constexpr,
    HAS_SEQUSED_K: tl.constexpr, KV_FP8: tl.constexpr = False,  # no cache here: never on
    HAS_TREE: tl.constexpr = False,  # a verify step's tree: decode only, never on here
    Alibi=None, stride_alibi_b=None, Sinks=None, Seqused_k=None, Alibi_shift=None,
    Cu_seqlens_q=None, Cu_seqlens_k=None, stride_lseh=None, IS_VARLEN: tl.constexpr = False,
    Rng=None, keep_threshold=None, dropout_scale=None, HAS_DROPOUT: tl.constexpr = False,
):
    tl.static_assert(BLOCK_M >= 16 and BLOCK_N >= 16, "tl.dot needs tiles of at least 16")
    tl.static_assert(not HAS_TREE, "a tree mask is decode's")
    unit, cap_scale = score_units(softmax_scale, softcap, HAS_SOFTCAP)
    qk_scale = unit * LOG2E
    pid_m, pid_bh, off_b, off_h, off_hk = query_block(H, GROUP, IS_CAUSAL)
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
        k_start, N = sequence_keys(Cu_seqlens_k, Seqused_k, off_b, HAS_SEQUSED_K)  # may be 0: no key, dQ = 0
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
        k_src = tl.make_tensor_descriptor(k_base, [N, HEAD_DIM], [stride_kn, 1], [BLOCK_N, HEAD_DIM_PAD])
        v_src = tl.make_tensor_descriptor(v_base, [N, HEAD_DIM], [stride_vn, 1], [BLOCK_N, HEAD_DIM_PAD])
    else:
        q = load_rows(tile_ptrs(q_base, start_m, stride_qm, BLOCK_M, offs_d), offs_m, M, offs_d,
                      HEAD_DIM, HEAD_DIM_PAD, True)  # [BLOCK_M, D_PAD]
        do = load_rows(tile_ptrs(do_base, start_m, stride_dom, BLOCK_M, offs_d), offs_m, M, offs_d,
                       HEAD_DIM, HEAD_DIM_PAD, True)
        k_src = k_base
        v_src = v_base
    if IS_VARLEN:
        row = off_h * stride_lseh
    else:
        row = pid_bh.to(tl.int64) * M
    lse2 = tl.load(Lse + row + offs_m, mask=offs_m < M, other=float("inf")) * LOG2E
    delta = tl.load(Delta + row + offs_m, mask=offs_m < M, other=0.0)
    dq = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    if HAS_DROPOUT:
        dropout = (tl.load(Rng), tl.load(Rng + 1), pid_bh, keep_threshold, dropout_scale)
    else:
        dropout = (0, 0, 0, 0, 0.0)
    diag = N - M
    alibi = alibi_terms(Alibi, stride_alibi_b, Alibi_shift, off_b, off_h, unit, diag, HAS_ALIBI)
    left, right = window_extent(window_left, window_right, M, N, IS_CAUSAL, HAS_WINDOW)
    n_lo, n_full_lo, n_full, n_end = key_range(start_m, BLOCK_M, BLOCK_N, diag, N, left, right, IS_CAUSAL, HAS_WINDOW)
    if HAS_WINDOW:  # the window's left edge
        dq = bwd_dq_inner(dq, q, do, lse2, delta, k_src, v_src, stride_kn, stride_vn, n_lo, n_full_lo,
                          offs_m, offs_n, offs_d, n_end, diag, left, right, qk_scale, cap_scale, alibi, dropout,
                          BLOCK_N, HEAD_DIM, HEAD_DIM_PAD, True, USE_TMA, IS_CAUSAL, HAS_WINDOW, HAS_SOFTCAP,
                          HAS_ALIBI, HAS_DROPOUT)
    # blocks every row sees whole
    dq = bwd_dq_inner(dq, q, do, lse2, delta, k_src, v_src, stride_kn, stride_vn, n_full_lo, n_full,
                      offs_m, offs_n, offs_d, n_end, diag, left, right, qk_scale, cap_scale, alibi, dropout,
                      BLOCK_N, HEAD_DIM, HEAD_DIM_PAD, False, USE_TMA, IS_CAUSAL, HAS_WINDOW, HAS_SOFTCAP,
                      HAS_ALIBI, HAS_DROPOUT)
    # the diagonal band (or the window's right edge) and the ragged tail
    dq = bwd_dq_inner(dq, q, do, lse2, delta, k_src, v_src, stride_kn, stride_vn, n_full, n_end,
                      offs_m, offs_n, offs_d, n_end, diag, left, right, qk_scale, cap_scale, alibi, dropout,
                      BLOCK_N, HEAD_DIM, HEAD_DIM_PAD, True, USE_TMA, IS_CAUSAL, HAS_WINDOW, HAS_SOFTCAP,
                      HAS_ALIBI, HAS_DROPOUT)

    dq = dq * softmax_scale
    store_rows(tile_ptrs(DQ + off_b * stride_dqb + off_h * stride_dqh, start_m, stride_dqm, BLOCK_M, offs_d),
               dq.to(DQ.dtype.element_ty), offs_m, M, offs_d, HEAD_DIM, HEAD_DIM_PAD)
