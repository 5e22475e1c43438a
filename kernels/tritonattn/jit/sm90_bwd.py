"""A fused prefill backward for Hopper (sm_90) in Gluon, as FlashAttention-3 schedules it: one program per
block of BLOCK_N keys of one (batch, KV head), dK and dV held in registers, dQ accumulated across programs by
atomic adds into an fp32 buffer.

The portable backward (jit/prefill_bwd.py) runs two kernels and seven products per (query block, key block)
pair: the dK/dV kernel recomputes S and dP, the dQ kernel recomputes them again. Fused, each pair costs five
(S^T, dP^T, dV, dK, dQ) and the two recomputations become one; the price is dQ, whose rows every key block of
the head adds into: here by `gl.atomic_add` of each fp32 tile (so the sum's order, and its last bits, vary run
to run). A program runs three partitions:

- a loader warp brings K and V (the program's keys, two halves of BLOCK_N / 2 rows, one per consumer) once,
  then streams Q_i and dO_i blocks of BLOCK_M rows, for every query head of the KV head's group, into rings
  of NUM_STAGES slots ("ready" / "empty" mbarriers, both consumers releasing each slot);
- two consumer warpgroups own BLOCK_N / 2 keys each. For each query block:

      S^T = K Q_i^T, dP^T = V dO_i^T        (both issued, S^T waited)
      P^T = exp2(S^T * scale - lse_i)       (masked: causal, key tail)
      dV += P^T dO_i                         (P^T a register operand; dP^T waited)
      dS^T = P^T * (dP^T - delta_i)
      dK += dS^T Q_i                         (dS^T a register operand)
      dS^T -> shared memory (this consumer's half of the block's keys)
      dQ_i[:, its half of D] = dS K[:, that half]   (once both halves of dS are in; two products)

  and adds its half of dQ_i, times softmax_scale, into DQ_accum. Splitting dQ by columns keeps its accumulator
  at [BLOCK_M, D / 2] beside dK and dV (a whole [BLOCK_M, D] one, each consumer taking every other block,
  more than doubles ptxas's spills), and gives both consumers the same work. dS has two slots, so a consumer
  writes block i + 1's half while the other may still read block i's.

The call's other paths (variants, dropout, packed sequences, other head dims) are the portable kernels'; this
one takes dense fp16 / bf16 calls at head dim 128, causal or not, MHA / GQA / MQA. Delta = rowsum(dO * O) comes
from the portable preprocessing kernel; DQ_accum must be zero on entry (launch/sm90.py `backward`).

[Note] Deterministic dQ: with DETERMINISTIC, the adds into each (consumer half, head, query block) of
DQ_accum come in key-block order. Turns holds one int32 counter per (consumer, batch * head, query block),
zero on entry: a consumer waits (acquire) until its counter reaches the program's key-block index, adds its
tile, and after a barrier of its warpgroup (every thread's adds issued before it) increments the counter
(release). The key blocks that touch a query block are 0..n_max (causal: those whose m_lo is at or below it),
each adds once, and programs start in index order, so program n waits only on programs that started before
it; the float sums then follow one order run to run."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from ..config.tables import SM90_CONSUMER_REGS, SM90_LOADER_REGS
from .common import LOG2E, gqa_q_head
from .sm90 import mma_layout, smem_layout, tma_load

# a barrier of the calling partition's threads: `barrier` from Triton 3.7, `thread_barrier` before
cta_barrier = getattr(gl, "barrier", None) or gl.thread_barrier
CONSUMER_REGS = gl.constexpr(SM90_CONSUMER_REGS)
LOADER_REGS = gl.constexpr(SM90_LOADER_REGS)


@gluon.jit
def _bwd_loader(q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc, q_smem, do_smem, k_smem, v_smem, lse_smem,
                delta_smem, kv_bar, q_ready, do_ready, q_empty, do_empty, start_n, m_lo, n_m, n_steps,
                HALF: gl.constexpr, BLOCK_M: gl.constexpr, NUM_STAGES: gl.constexpr):
    """One warp: the program's K and V halves once, then Q_i and dO_i for each (query head g of the group, query
    block i), step t = g * n_m + i, as ring slots free up. q_desc / do_desc are [GROUP, M, HEAD_DIM] views
    (the group's heads), so one descriptor serves every head."""
    mbarrier.expect(kv_bar, 2 * (k_desc.block_type.nbytes + v_desc.block_type.nbytes))
    for half in gl.static_range(2):
        tma_load(k_desc, [start_n + half * HALF, 0], kv_bar, k_smem.index(half))
        tma_load(v_desc, [start_n + half * HALF, 0], kv_bar, v_smem.index(half))
    for t in range(n_steps):
        g = t // n_m
        start_m = m_lo + (t - g * n_m) * BLOCK_M
        slot = t % NUM_STAGES
        phase = (t // NUM_STAGES) & 1
        mbarrier.wait(q_empty.index(slot), phase ^ 1)  # a fresh barrier counts as released (phase 1)
        mbarrier.expect(q_ready.index(slot), q_desc.block_type.nbytes + lse_desc.block_type.nbytes)
        tma_load(q_desc, [g, start_m, 0], q_ready.index(slot), q_smem.index(slot))
        tma_load(lse_desc, [g, start_m], q_ready.index(slot), lse_smem.index(slot))
        mbarrier.wait(do_empty.index(slot), phase ^ 1)
        mbarrier.expect(do_ready.index(slot), do_desc.block_type.nbytes + delta_desc.block_type.nbytes)
        tma_load(do_desc, [g, start_m, 0], do_ready.index(slot), do_smem.index(slot))
        tma_load(delta_desc, [g, start_m], do_ready.index(slot), delta_smem.index(slot))


@gluon.jit
def _bwd_consumer(WG: gl.constexpr, q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, ds_smem, kv_bar, q_ready,
                  do_ready, q_empty, do_empty, ds_ready, ds_free, DQ_accum, DK, DV, stride_dqm, stride_dqh, stride_dkn,
                  stride_dvn, M, N, start_n, m_lo, n_m, n_steps, diag, softmax_scale, Turns, pid_n,
                  HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, HALF: gl.constexpr, NUM_STAGES: gl.constexpr,
                  IS_CAUSAL: gl.constexpr, DETERMINISTIC: gl.constexpr):
    """One warpgroup: keys [start_n + WG * HALF, + HALF) of the program; dK, dV of those keys in registers over
    every step, and columns [WG * D / 2, + D / 2) of each step's dQ. DQ_accum, DK and DV point at this batch
    entry (DQ_accum at the group's first head, DK and DV at the KV head); Turns at this consumer's counters of
    the group's first head (DETERMINISTIC)."""
    dtype: gl.constexpr = q_smem.dtype
    NUM_WARPS: gl.constexpr = gl.num_warps()
    s_layout: gl.constexpr = mma_layout(NUM_WARPS, BLOCK_M, dtype)  # S^T, dP^T: [HALF keys, BLOCK_M queries]
    o_layout: gl.constexpr = mma_layout(NUM_WARPS, HEAD_DIM, dtype)  # dK, dV: [HALF, D]
    DQ_COLS: gl.constexpr = HEAD_DIM // 2
    q_layout: gl.constexpr = mma_layout(NUM_WARPS, DQ_COLS, dtype)  # this consumer's half of dQ: [BLOCK_M, D / 2]
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    keys_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    queries_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    rows_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    cols_o: gl.constexpr = gl.SliceLayout(0, o_layout)
    qk_scale = softmax_scale * LOG2E
    k_first = start_n + WG * HALF
    k_tile = k_smem.index(WG)
    v_tile = v_smem.index(WG)
    s_zero = gl.zeros([HALF, BLOCK_M], gl.float32, layout=s_layout)
    dk = gl.zeros([HALF, HEAD_DIM], gl.float32, layout=o_layout)
    dv = gl.zeros([HALF, HEAD_DIM], gl.float32, layout=o_layout)
    tail = k_first + HALF > N  # keys past N (zeros from the descriptor) must get P = 0
    mbarrier.wait(kv_bar, 0)
    for t in range(n_steps):
        g = t // n_m
        start_m = m_lo + (t - g * n_m) * BLOCK_M
        slot = t % NUM_STAGES
        phase = (t // NUM_STAGES) & 1
        dslot = t % 2
        q_tile = q_smem.index(slot).reshape([BLOCK_M, HEAD_DIM])
        do_tile = do_smem.index(slot).reshape([BLOCK_M, HEAD_DIM])
        mbarrier.wait(q_ready.index(slot), phase)
        s_t = warpgroup_mma(k_tile, q_tile.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        mbarrier.wait(do_ready.index(slot), phase)
        dp_t = warpgroup_mma(v_tile, do_tile.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s_t = warpgroup_mma_wait(1, deps=(s_t,))
        lse2 = lse_smem.index(slot).reshape([BLOCK_M]).load(queries_s)  # lse * log2(e); +inf past M
        p_t = gl.exp2(s_t * qk_scale - gl.expand_dims(lse2, 0))
        masked = tail  # a key past N, or (causal) past some row's diagonal
        if IS_CAUSAL:
            masked = masked | (k_first + HALF - 1 > start_m + diag)
        if masked:
            # the indices are made here, where they are used, so that they hold no registers across the step
            offs_k = k_first + gl.arange(0, HALF, layout=keys_s)
            offs_m = start_m + gl.arange(0, BLOCK_M, layout=queries_s)
            seen = gl.expand_dims(offs_k < N, 1)
            if IS_CAUSAL:
                seen = seen & (gl.expand_dims(offs_k, 1) <= gl.expand_dims(offs_m, 0) + diag)
            p_t = gl.where(seen, p_t, 0.0)
        dv = warpgroup_mma(gl.convert_layout(p_t.to(dtype), a_layout), do_tile, dv, is_async=True)
        dp_t = warpgroup_mma_wait(1, deps=(dp_t,))
        delta = delta_smem.index(slot).reshape([BLOCK_M]).load(queries_s)
        ds_t = (p_t * (dp_t - gl.expand_dims(delta, 0))).to(dtype)
        dk = warpgroup_mma(gl.convert_layout(ds_t, a_layout), q_tile, dk, is_async=True)
        # this half of dS^T for the step's dQ (slot dslot is free once both consumers' dQ of step t - 2 is done)
        mbarrier.wait(ds_free.index(dslot), ((t // 2) & 1) ^ 1)
        ds_smem.index(2 * dslot + WG).store(ds_t)
        fence_async_shared()
        mbarrier.arrive(ds_ready.index(dslot), count=1)
        dv, dk = warpgroup_mma_wait(0, deps=(dv, dk))
        mbarrier.arrive(q_empty.index(slot), count=1)
        mbarrier.arrive(do_empty.index(slot), count=1)
        # dQ_i[:, this consumer's half of D] = dS K[:, half], over both halves of the keys
        mbarrier.wait(ds_ready.index(dslot), (t // 2) & 1)
        dq = warpgroup_mma(ds_smem.index(2 * dslot).permute((1, 0)),
                           k_smem.index(0).slice(WG * DQ_COLS, DQ_COLS, dim=1),
                           gl.zeros([BLOCK_M, DQ_COLS], gl.float32, layout=q_layout), use_acc=False, is_async=True)
        dq = warpgroup_mma(ds_smem.index(2 * dslot + 1).permute((1, 0)),
                           k_smem.index(1).slice(WG * DQ_COLS, DQ_COLS, dim=1), dq, is_async=True)
        dq = warpgroup_mma_wait(0, deps=(dq,))
        mbarrier.arrive(ds_free.index(dslot), count=1)
        rows_q = start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, q_layout))
        cols = WG * DQ_COLS + gl.arange(0, DQ_COLS, layout=gl.SliceLayout(0, q_layout))
        ptrs = (DQ_accum + g.to(gl.int64) * stride_dqh + gl.expand_dims(rows_q.to(gl.int64) * stride_dqm, 1)
                + gl.expand_dims(cols, 0))
        if DETERMINISTIC:  # [Note] Deterministic dQ: wait for the programs of the keys before these
            turn = Turns + g * gl.cdiv(M, BLOCK_M) + start_m // BLOCK_M
            while gl.atomic_add(turn, 0, sem="acquire") < pid_n:
                pass
        gl.atomic_add(ptrs, dq * softmax_scale, mask=gl.expand_dims(rows_q < M, 1), sem="relaxed")
        if DETERMINISTIC:  # every thread's adds are done before the next program's turn
            cta_barrier()
            gl.atomic_add(turn, 1, sem="release")
    rows_k = k_first + gl.arange(0, HALF, layout=rows_o)
    cols = gl.arange(0, HEAD_DIM, layout=cols_o)
    mask = gl.expand_dims(rows_k < N, 1)
    gl.store(DK + gl.expand_dims(rows_k.to(gl.int64) * stride_dkn, 1) + gl.expand_dims(cols, 0),
             (dk * softmax_scale).to(DK.dtype.element_ty), mask=mask)
    gl.store(DV + gl.expand_dims(rows_k.to(gl.int64) * stride_dvn, 1) + gl.expand_dims(cols, 0),
             dv.to(DV.dtype.element_ty), mask=mask)


@gluon.jit
def bwd_kernel_sm90_ws(
    Q, K, V, DO, Lse2, Delta, DQ_accum, DK, DV, Turns,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_dob, stride_dom, stride_doh,
    stride_dqb, stride_dqm, stride_dqh,
    stride_dkb, stride_dkn, stride_dkh,
    stride_dvb, stride_dvn, stride_dvh,
    H, M, N, GROUP, softmax_scale, window_left, window_right, softcap,
    HEAD_DIM: gl.constexpr, HEAD_DIM_PAD: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    IS_CAUSAL: gl.constexpr, HAS_WINDOW: gl.constexpr, HAS_SOFTCAP: gl.constexpr, HAS_ALIBI: gl.constexpr,
    HAS_SINKS: gl.constexpr, HAS_SEQUSED_K: gl.constexpr, KV_FP8: gl.constexpr = False,
    HAS_TREE: gl.constexpr = False,
    NUM_STAGES: gl.constexpr = 2, DETERMINISTIC: gl.constexpr = False,
):
    """One program per (key block of BLOCK_N, batch entry, KV head): dK and dV of those keys over every query
    block of every query head in the KV head's group, and their share of dQ added into DQ_accum (float32, q's
    shape, zero on entry). Dense (batch, seqlen, heads, D) tensors; Lse2 (lse * log2(e), +inf past M) and
    Delta (0 past M) (batch, nheads, M_PAD) float32, M_PAD = M rounded up to BLOCK_M; bottom-right causal as the
    forward (row i sees key j iff j <= i + N - M)."""
    HALF: gl.constexpr = BLOCK_N // 2
    dtype: gl.constexpr = Q.dtype.element_ty
    gl.static_assert(gl.num_warps() == 4, "the default partition is one consumer warpgroup")
    gl.static_assert(HEAD_DIM == HEAD_DIM_PAD, "descriptor tiles cover the head dim exactly")
    gl.static_assert(not (HAS_WINDOW or HAS_SOFTCAP or HAS_ALIBI or HAS_SINKS or HAS_SEQUSED_K or KV_FP8 or HAS_TREE),
                     "the variants' backward is the portable kernels'")
    pid_n = gl.program_id(0)
    pid_bhk = gl.program_id(1)
    H_KV = H // GROUP
    off_b = (pid_bhk // H_KV).to(gl.int64)
    off_hk = (pid_bhk % H_KV).to(gl.int64)
    start_n = pid_n * BLOCK_N
    diag = N - M
    if IS_CAUSAL:  # rows before start_n - diag see none of these keys
        m_lo = gl.minimum(gl.maximum(start_n - diag, 0) // BLOCK_M * BLOCK_M, M)
    else:
        m_lo = 0
    n_m = gl.cdiv(M - m_lo, BLOCK_M)
    n_steps = GROUP * n_m

    kv_layout: gl.constexpr = smem_layout(HALF, HEAD_DIM, dtype)
    qd_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([1, BLOCK_M, HEAD_DIM], dtype)
    ds_layout: gl.constexpr = smem_layout(HALF, BLOCK_M, dtype)
    k_desc = tma.make_tensor_descriptor(K + off_b * stride_kb + off_hk * stride_kh, [N, HEAD_DIM], [stride_kn, 1],
                                        [HALF, HEAD_DIM], kv_layout)
    v_desc = tma.make_tensor_descriptor(V + off_b * stride_vb + off_hk * stride_vh, [N, HEAD_DIM], [stride_vn, 1],
                                        [HALF, HEAD_DIM], kv_layout)
    first_h = gqa_q_head(off_hk, GROUP, 0)  # the group's query heads are consecutive
    q_desc = tma.make_tensor_descriptor(Q + off_b * stride_qb + first_h * stride_qh, [GROUP, M, HEAD_DIM],
                                        [stride_qh, stride_qm, 1], [1, BLOCK_M, HEAD_DIM], qd_layout)
    do_desc = tma.make_tensor_descriptor(DO + off_b * stride_dob + first_h * stride_doh, [GROUP, M, HEAD_DIM],
                                         [stride_doh, stride_dom, 1], [1, BLOCK_M, HEAD_DIM], qd_layout)
    M_PAD = gl.cdiv(M, BLOCK_M) * BLOCK_M
    stat_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    stats = (off_b * H + first_h) * M_PAD
    lse_desc = tma.make_tensor_descriptor(Lse2 + stats, [GROUP, M_PAD], [M_PAD, 1], [1, BLOCK_M], stat_layout)
    delta_desc = tma.make_tensor_descriptor(Delta + stats, [GROUP, M_PAD], [M_PAD, 1], [1, BLOCK_M], stat_layout)

    k_smem = gl.allocate_shared_memory(dtype, [2, HALF, HEAD_DIM], kv_layout)
    v_smem = gl.allocate_shared_memory(dtype, [2, HALF, HEAD_DIM], kv_layout)
    q_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, 1, BLOCK_M, HEAD_DIM], qd_layout)
    do_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, 1, BLOCK_M, HEAD_DIM], qd_layout)
    ds_smem = gl.allocate_shared_memory(dtype, [4, HALF, BLOCK_M], ds_layout)  # (slot, half)
    lse_smem = gl.allocate_shared_memory(gl.float32, [NUM_STAGES, 1, BLOCK_M], stat_layout)
    delta_smem = gl.allocate_shared_memory(gl.float32, [NUM_STAGES, 1, BLOCK_M], stat_layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    do_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    do_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    ds_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(do_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=2)
        mbarrier.init(do_empty.index(i), count=2)
    for i in gl.static_range(2):
        mbarrier.init(ds_ready.index(i), count=2)  # both halves of dS written
        mbarrier.init(ds_free.index(i), count=2)  # both dQ halves' products done
    fence_async_shared()

    DQ_accum += off_b * stride_dqb + first_h * stride_dqh
    Turns += (off_b * H + first_h) * gl.cdiv(M, BLOCK_M)
    DK += off_b * stride_dkb + off_hk * stride_dkh
    DV += off_b * stride_dvb + off_hk * stride_dvh
    gl.warp_specialize([
        (_bwd_consumer, (0, q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, ds_smem, kv_bar, q_ready,
                         do_ready, q_empty, do_empty, ds_ready, ds_free, DQ_accum, DK, DV, stride_dqm, stride_dqh,
                         stride_dkn, stride_dvn, M, N, start_n, m_lo, n_m, n_steps, diag, softmax_scale,
                         Turns + 0 * (gl.num_programs(1) * GROUP) * gl.cdiv(M, BLOCK_M), pid_n,
                         HEAD_DIM, BLOCK_M, HALF, NUM_STAGES, IS_CAUSAL, DETERMINISTIC)),
        (_bwd_consumer, (1, q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, ds_smem, kv_bar, q_ready,
                         do_ready, q_empty, do_empty, ds_ready, ds_free, DQ_accum, DK, DV, stride_dqm, stride_dqh,
                         stride_dkn, stride_dvn, M, N, start_n, m_lo, n_m, n_steps, diag, softmax_scale,
                         Turns + 1 * (gl.num_programs(1) * GROUP) * gl.cdiv(M, BLOCK_M), pid_n,
                         HEAD_DIM, BLOCK_M, HALF, NUM_STAGES, IS_CAUSAL, DETERMINISTIC)),
        (_bwd_loader, (q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc, q_smem, do_smem, k_smem, v_smem,
                       lse_smem, delta_smem, kv_bar, q_ready, do_ready, q_empty, do_empty, start_n, m_lo, n_m, n_steps,
                       HALF, BLOCK_M, NUM_STAGES)),
    ], [4, 1], [CONSUMER_REGS, LOADER_REGS])
