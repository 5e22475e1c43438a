"""The prefill forward for Hopper (sm_90), written in Gluon (Triton's tile-level dialect), as FlashAttention-3
schedules it: dense, packed sequences, and a chunk over a dense or paged KV cache.

Triton's block-level compiler waits for each warpgroup MMA right before the softmax that follows it, so in
`jit.prefill_fwd.fwd_kernel` the tensor cores idle while a block's softmax runs, and Triton 3.6's automatic
warp specialization does not reach that kernel's shape (docs/perf-notes.md, "Prefill at cuDNN's speed on
Hopper"). Here the schedule is written out. A program owns BLOCK_M query rows of one (batch, head) and runs
three partitions:

- a loader warp streams K and V blocks by TMA into rings of NUM_STAGES shared-memory slots, each slot
  with a "ready" mbarrier (the copy landed) and an "empty" one (both consumers are done with it);
- two consumer warpgroups own BLOCK_M / 2 rows each and take turns on the tensor cores (two mbarriers
  pass the turn): while one issues its products, the other runs its softmax;
- within a consumer, block j's softmax also overlaps its own p @ v of block j - 1:

      iteration j:  [its turn] S_j = Q K_j^T, O += P_{j-1} V_{j-1} (issued)   wait S_j   release K_j
                    softmax(S_j) -> P_j, alpha_j   wait O   release V_{j-1}   O *= alpha_j

The FP8 forward (e4m3 Q, K, V; [Note] FP8 forward in jit/common.py) runs the same schedule on the FP8 tensor
cores: the descales fold into the score scale and V's into the output, P is quantized to e4m3 for P V in
registers (`_p_operand`), and V arrives transposed with its keys reordered to match P's registers
(jit/layout.py: FP8 warpgroup MMAs read both shared operands with the reduction dim contiguous).

Masks, scores, the softmax step and the epilogue are kernels/tritonattn/jit/common.py's helpers, shared with every other
kernel. The shapes and options this kernel takes, and when it is chosen, are `config.tables.prefill_fwd_sm90_config`;
Gluon kernels do not run under the Triton interpreter, which keeps the portable kernel.
"""

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
from .common import (
    LOG2E,
    finalize,
    key_range,
    kv_descales,
    page_row,
    query_block,
    score_units,
    sequence_keys,
    softmax_step,
    variant_scores,
    window_extent,
)

# The TMA copies under this Triton's names: async_load / async_store from Triton 3.8 (3.9 removed the old
# names), async_copy_global_to_shared / async_copy_shared_to_global before; same arguments, same operations.
tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global


CONSUMER_REGS = gl.constexpr(SM90_CONSUMER_REGS)  # register budgets after setmaxnreg (config/tables.py)
LOADER_REGS = gl.constexpr(SM90_LOADER_REGS)


@gluon.constexpr_function
def mma_layout(num_warps, n, dtype):
    """Accumulator layout of a [rows, n] warpgroup MMA on `dtype` operands: the warps stacked along rows (16
    rows per warp); an instruction reduces 32 bytes of each row (16 16-bit or 32 8-bit values)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                     instr_shape=[16, n, 256 // dtype.primitive_bitwidth])


@gluon.constexpr_function
def smem_layout(rows, cols, dtype):
    """The swizzled shared-memory layout TMA and warpgroup MMAs take for a [rows, cols] `dtype` tile."""
    return gl.NVMMASharedLayout.get_default_for([rows, cols], dtype)


@gluon.jit
def _ws_loader(k_desc, v_desc, v_tail_desc, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, n_lo, n_blocks,
               table, n_tail, n_end, NUM_BLOCKS, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
               V_KEYS_INNER: gl.constexpr, PAGED: gl.constexpr, PAGE_SIZE: gl.constexpr):
    """One warp: streams K_j, V_j into the ring as slots free up (both consumers release each slot).
    V_KEYS_INNER: V comes as [head_dim, keys] (the FP8 forward), so block j is the column block at start_n.
    PAGED: K and V are pools of pages (`fwd_kernel_sm90_ws`); block j's pool row is looked up in `table` one
    block ahead, and V's blocks from logical row n_tail on (the last page) come through v_tail_desc."""
    if PAGED:
        next_row = page_row(table, n_lo, n_end, NUM_BLOCKS, PAGE_SIZE)
    for j in range(n_blocks):
        slot = j % NUM_STAGES
        phase = (j // NUM_STAGES) & 1
        start_n = n_lo + j * BLOCK_N
        if PAGED:
            row = next_row
            next_row = page_row(table, start_n + BLOCK_N, n_end, NUM_BLOCKS, PAGE_SIZE)
        else:
            row = start_n
        mbarrier.wait(k_empty.index(slot), phase ^ 1)  # a fresh barrier counts as released (phase 1)
        mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes)
        tma_load(k_desc, [row, 0], k_ready.index(slot), k_smem.index(slot))
        mbarrier.wait(v_empty.index(slot), phase ^ 1)
        mbarrier.expect(v_ready.index(slot), v_desc.block_type.nbytes)
        if V_KEYS_INNER:
            tma_load(v_desc, [0, start_n], v_ready.index(slot), v_smem.index(slot))
        elif PAGED:
            if start_n >= n_tail:  # the last page: rows past the request's keys load as zeros
                tma_load(v_tail_desc, [start_n - n_tail, 0], v_ready.index(slot), v_smem.index(slot))
            else:
                tma_load(v_desc, [row, 0], v_ready.index(slot), v_smem.index(slot))
        else:
            tma_load(v_desc, [row, 0], v_ready.index(slot), v_smem.index(slot))


@gluon.jit
def _values(v_tile, KEYS_INNER: gl.constexpr):
    """V's ring slot as P V's [BLOCK_N, HEAD_DIM] operand: as stored, or (FP8: stored [HEAD_DIM, BLOCK_N], keys
    inner, since FP8 warpgroup MMAs read the reduction dim contiguous) transposed."""
    if KEYS_INNER:
        v_tile = v_tile.permute((1, 0))
    return v_tile


@gluon.jit
def _p_operand(p, p_layout: gl.constexpr, FP8: gl.constexpr):
    """The probabilities p [ROWS, BLOCK_N] (Q K^T's accumulator layout) as P V's register operand.

    FP8: P's columns are first reordered within each group of 16 keys (position bits p3 p2 p1 p0 take key
    8 p1 + 4 p3 + 2 p2 + p0, `jit.layout.fp8_pv_key`; V arrives in the same order), which makes each
    thread's accumulator values already the ones its operand registers hold, four consecutive positions to a
    register: the layout change is a renaming of registers, and the e4m3 conversion (round to nearest even,
    saturating, as `.to(gl.float8e4nv)`) packs each register with two cvts, no bytes moved between threads."""
    if FP8:
        ROWS: gl.constexpr = p.shape[0]
        N: gl.constexpr = p.shape[1]
        p = p.reshape([ROWS, N // 16, 2, 2, 2, 2]).permute((0, 1, 3, 4, 2, 5)).reshape([ROWS, N])
        operand = gl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1; cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3; "
            "mov.b32 $0, {lo, hi}; }",
            "=r,r,r,r,r", [gl.convert_layout(p, p_layout)], dtype=gl.float8e4nv, is_pure=True, pack=4)
    else:
        operand = gl.convert_layout(p, p_layout)
    return operand


@gluon.jit
def _block_scores(qk, start_n, offs_m, offs_n, n_full_lo, n_full, n_end, diag, left, right, cap_scale, alibi,
                  IS_CAUSAL: gl.constexpr, HAS_WINDOW: gl.constexpr, HAS_SOFTCAP: gl.constexpr,
                  HAS_ALIBI: gl.constexpr):
    """`variant_scores` of the key block at start_n, masked only outside [n_full_lo, n_full), the blocks
    every row of the program sees whole."""
    if (start_n < n_full_lo) | (start_n >= n_full):
        qk = variant_scores(qk, offs_m, start_n + offs_n, n_end, diag, left, right, cap_scale, alibi, True,
                            IS_CAUSAL, HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI)
    else:
        qk = variant_scores(qk, offs_m, start_n + offs_n, n_end, diag, left, right, cap_scale, alibi, False,
                            IS_CAUSAL, HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI)
    return qk


@gluon.jit
def _ws_consumer(WG: gl.constexpr, q_smem, k_smem, v_smem, o_smem, q_bar, k_ready, v_ready, k_empty, v_empty,
                 turn, o_desc, Lse, Sinks, Alibi, stride_alibi_b, off_b, off_h, pid_bh, M, start_m, n_lo, n_full_lo,
                 n_full, n_end, n_blocks, diag, left, right, qk_scale, cap_scale, unit, v_scale,
                 HEAD_DIM: gl.constexpr, ROWS: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
                 IS_CAUSAL: gl.constexpr, HAS_WINDOW: gl.constexpr, HAS_SOFTCAP: gl.constexpr,
                 HAS_ALIBI: gl.constexpr, HAS_SINKS: gl.constexpr, IS_VARLEN: gl.constexpr):
    """One warpgroup: rows [start_m + WG * ROWS, + ROWS) of the tile. Each iteration issues S_j = Q K_j^T and
    O += P_{j-1} V_{j-1} in its turn (the other warpgroup runs its softmax meanwhile), then takes block
    j's softmax while its own p @ v is in flight. In the FP8 forward (e4m3 tiles) P is quantized to e4m3 for
    P V ([Note] FP8 forward) and V's tiles are [HEAD_DIM, BLOCK_N] (keys inner), read transposed."""
    dtype: gl.constexpr = q_smem.dtype
    FP8: gl.constexpr = dtype == gl.float8e4nv
    NUM_WARPS: gl.constexpr = gl.num_warps()
    s_layout: gl.constexpr = mma_layout(NUM_WARPS, BLOCK_N, dtype)
    o_layout: gl.constexpr = mma_layout(NUM_WARPS, HEAD_DIM, dtype)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4 if FP8 else 2)
    rows_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    rows_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    cols_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    q_tile = q_smem.index(WG)
    row0 = start_m + WG * ROWS
    offs_m = row0 + gl.arange(0, ROWS, layout=rows_s)
    offs_n = gl.arange(0, BLOCK_N, layout=cols_s)
    if HAS_ALIBI:
        alibi = (gl.load(Alibi + off_b * stride_alibi_b + off_h) / unit, diag)  # `alibi_terms`, no shift here
    else:
        alibi = (0.0, diag)
    if HAS_SINKS:
        m_i = gl.full([ROWS], 0.0, gl.float32, layout=rows_s) + gl.load(Sinks + off_h).to(gl.float32) * LOG2E
        l_i = gl.full([ROWS], 1.0, gl.float32, layout=rows_s)
    else:
        m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=rows_s)
        l_i = gl.zeros([ROWS], gl.float32, layout=rows_s)
    acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=o_layout)
    s_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=s_layout)
    mbarrier.wait(q_bar, 0)
    if n_blocks > 0:
        # block 0: scores only (warpgroup 0 takes the first turn)
        mbarrier.wait(k_ready.index(0), 0)
        mbarrier.wait(turn.index(WG), 1 - WG)
        qk = warpgroup_mma(q_tile, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        mbarrier.arrive(turn.index(1 - WG), count=1)
        qk = warpgroup_mma_wait(0, deps=(qk,))
        mbarrier.arrive(k_empty.index(0), count=1)
        qk = _block_scores(qk, n_lo, offs_m, offs_n, n_full_lo, n_full, n_end, diag, left, right, cap_scale, alibi,
                           IS_CAUSAL, HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI)
        p32, m_i, l_i, alpha = softmax_step(qk, m_i, l_i, qk_scale, True)
        # FP8: p stays fp32 until its operand is built at the top of the next iteration, where the conversion
        # and the packing meet in one block (carried as separate bytes, it would be unpacked and re-packed)
        p = p32 if FP8 else p32.to(dtype)
        for j in range(1, n_blocks):
            p_op = _p_operand(p, p_layout, FP8)
            start_n = n_lo + j * BLOCK_N
            slot = j % NUM_STAGES
            prev = (j - 1) % NUM_STAGES
            mbarrier.wait(k_ready.index(slot), (j // NUM_STAGES) & 1)
            mbarrier.wait(v_ready.index(prev), ((j - 1) // NUM_STAGES) & 1)
            # my turn on the tensor cores: S_j = Q K_j^T, then O += P_{j-1} V_{j-1}
            mbarrier.wait(turn.index(WG), (j & 1) ^ (1 - WG))
            qk = warpgroup_mma(q_tile, k_smem.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            acc = warpgroup_mma(p_op, _values(v_smem.index(prev), FP8), acc, is_async=True)
            mbarrier.arrive(turn.index(1 - WG), count=1)
            qk = warpgroup_mma_wait(1, deps=(qk,))
            mbarrier.arrive(k_empty.index(slot), count=1)
            # block j's softmax while P_{j-1} V_{j-1} runs (and the other warpgroup's products)
            qk = _block_scores(qk, start_n, offs_m, offs_n, n_full_lo, n_full, n_end, diag, left, right, cap_scale,
                               alibi, IS_CAUSAL, HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI)
            p32, m_i, l_i, alpha = softmax_step(qk, m_i, l_i, qk_scale, True)
            acc = warpgroup_mma_wait(0, deps=(acc,))
            mbarrier.arrive(v_empty.index(prev), count=1)
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, rows_o), 1)
            p = p32 if FP8 else p32.to(dtype)
        last = (n_blocks - 1) % NUM_STAGES
        mbarrier.wait(v_ready.index(last), ((n_blocks - 1) // NUM_STAGES) & 1)
        acc = warpgroup_mma(_p_operand(p, p_layout, FP8), _values(v_smem.index(last), FP8), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=(acc,))
        mbarrier.arrive(v_empty.index(last), count=1)
    out, lse = finalize(acc, gl.convert_layout(m_i, rows_o), gl.convert_layout(l_i, rows_o))
    offs_m_o = row0 + gl.arange(0, ROWS, layout=rows_o)
    if IS_VARLEN:  # Lse is at this head's and sequence's first row already
        gl.store(Lse + offs_m_o, lse, mask=offs_m_o < M)
    else:
        gl.store(Lse + pid_bh.to(gl.int64) * M + offs_m_o, lse, mask=offs_m_o < M)
    if FP8:
        out = out * v_scale  # V's descale
    o_tile = o_smem.index(WG)  # q's own tile (its products are done), or the FP8 forward's 16-bit one
    o_tile.store(out.to(o_smem.dtype))
    fence_async_shared()
    tma_store(o_desc, [row0, 0], o_tile)
    tma.store_wait(0)


@gluon.jit
def fwd_kernel_sm90_ws(
    Q, K, V, Out, Lse,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_ob, stride_om, stride_oh,
    H, M, N, GROUP, softmax_scale, window_left, window_right, softcap,
    HEAD_DIM: gl.constexpr, HEAD_DIM_PAD: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    IS_CAUSAL: gl.constexpr, HAS_WINDOW: gl.constexpr, HAS_SOFTCAP: gl.constexpr, HAS_ALIBI: gl.constexpr,
    HAS_SINKS: gl.constexpr, HAS_SEQUSED_K: gl.constexpr,
    KV_FP8: gl.constexpr = False,  # the FP8 forward's e4m3 K and V (with an e4m3 Q; no cache here)
    HAS_TREE: gl.constexpr = False,  # decode's: never on here
    Alibi=None, stride_alibi_b=None, Sinks=None, Seqused_k=None,
    Cu_seqlens_q=None, Cu_seqlens_k=None, stride_lseh=None, IS_VARLEN: gl.constexpr = False,
    Cache_seqlens=None, N_NEW=None, IS_KVCACHE: gl.constexpr = False, KV_APPEND: gl.constexpr = False,
    Block_table=None, stride_btb=None, NUM_BLOCKS=None, PAGED: gl.constexpr = False, PAGE_SIZE: gl.constexpr = 1,
    K_descale=None, stride_kds=None, stride_kdh=None, V_descale=None, stride_vds=None, stride_vdh=None,
    Q_descale=None, stride_qds=None, stride_qdh=None,  # the FP8 forward's, (batch, nheads_k) float32
    NUM_STAGES: gl.constexpr = 2,
):
    """The forward as FlashAttention-3 schedules it: BLOCK_M rows split over two consumer warpgroups
    (the kernel's 4 warps and a 4-warp worker) that alternate on the tensor cores, and a loader warp.

    The FP8 forward ([Note] FP8 forward in jit/common.py): Q, K, V in e4m3 with their descales, the output
    16-bit; V comes transposed, (batch, nheads_k, HEAD_DIM, seqlen_k) with keys contiguous, and stride_vn is
    then the stride between its HEAD_DIM rows.

    IS_VARLEN (16-bit only): packed sequences as fwd_kernel takes them ([Note] Packed sequences in
    jit/prefill_fwd.py): batch strides 0, M and N the longest lengths, each program reading its sequence's
    bounds from Cu_seqlens_q / Cu_seqlens_k (and Seqused_k); the descriptors span that sequence's rows only,
    so a tile past its end loads zeros and stores nothing, and Lse is (H, total_q) with head stride
    stride_lseh.

    IS_KVCACHE (16-bit, dense queries, no window): chunked prefill over a KV cache as fwd_kernel takes it
    ([Note] Chunked prefill over a cache in jit/prefill_fwd.py): N is the capacity per request and request b
    sees its first Cache_seqlens[b] keys (clamped to N; plus N_NEW with KV_APPEND), the queries aligned to
    the last M of them. A dense cache's descriptors span those keys. A paged pool (PAGED: NUM_BLOCKS pages of
    PAGE_SIZE rows, a multiple of BLOCK_N, evenly spaced; batch strides 0) is one descriptor of NUM_BLOCKS *
    PAGE_SIZE rows whose blocks the loader finds through Block_table; the rows of the last page past the
    request's keys hold stale data (possibly NaN bit patterns, and 0 * NaN would poison the output), so V's
    blocks in that page come through a descriptor of its valid rows only, which loads zeros past them."""
    ROWS: gl.constexpr = BLOCK_M // 2
    dtype: gl.constexpr = Q.dtype.element_ty
    FP8: gl.constexpr = dtype == gl.float8e4nv
    gl.static_assert(HEAD_DIM == HEAD_DIM_PAD, "descriptor tiles cover the head dim exactly")
    gl.static_assert(KV_FP8 == FP8, "FP8 K/V only with an FP8 Q here (an FP8 cache is fwd_kernel's)")
    gl.static_assert(not HAS_TREE, "a tree mask is decode's")
    gl.static_assert(IS_VARLEN or not HAS_SEQUSED_K, "seqused_k counts the keys of packed sequences")
    gl.static_assert(not (IS_VARLEN and FP8), "the FP8 forward's V copy is per dense batch entry")
    gl.static_assert(not IS_KVCACHE or not (IS_VARLEN or FP8 or HAS_WINDOW), "a cache: dense 16-bit, no window")
    gl.static_assert(IS_KVCACHE or not PAGED, "pages are a cache's")
    gl.static_assert(gl.num_warps() == 4, "the default partition is one consumer warpgroup")
    q_smem_layout: gl.constexpr = smem_layout(ROWS, HEAD_DIM, dtype)
    kv_smem_layout: gl.constexpr = smem_layout(BLOCK_N, HEAD_DIM, dtype)
    pid_m, pid_bh, off_b, off_h, off_hk = query_block(H, GROUP, IS_CAUSAL)
    k_scale, v_scale = kv_descales(K_descale, V_descale, off_b, off_hk, stride_kds, stride_kdh, stride_vds, stride_vdh,
                                   KV_FP8, Q_descale, stride_qds, stride_qdh, FP8)  # 1.0 and 1.0 unless FP8
    unit, cap_scale = score_units(softmax_scale * k_scale, softcap, HAS_SOFTCAP)  # the descales folded in
    qk_scale = unit * LOG2E
    start_m = pid_m * BLOCK_M
    if IS_VARLEN:  # off_b is a packed sequence: its own M, N and first rows
        q_start = gl.load(Cu_seqlens_q + off_b)
        M = gl.load(Cu_seqlens_q + off_b + 1) - q_start
        if start_m >= M:  # the grid covers the longest sequence: blocks past this one's end exit at once
            return
        k_start, N = sequence_keys(Cu_seqlens_k, Seqused_k, off_b, HAS_SEQUSED_K)
        Q += q_start.to(gl.int64) * stride_qm
        K += k_start.to(gl.int64) * stride_kn
        V += k_start.to(gl.int64) * stride_vn
        Out += q_start.to(gl.int64) * stride_om
        Lse += off_h.to(gl.int64) * stride_lseh + q_start  # this head's and sequence's first row
    if IS_KVCACHE:  # K/V are a cache: N is its capacity, the request's key count lives on the device
        n_cached = gl.minimum(gl.maximum(gl.load(Cache_seqlens + off_b), 0), N)
        if KV_APPEND:  # N_NEW new keys were appended at [n_cached, n_cached + N_NEW) just before
            N = gl.minimum(n_cached + N_NEW, N)
        else:
            N = n_cached
    q_desc = tma.make_tensor_descriptor(Q + off_b * stride_qb + off_h.to(gl.int64) * stride_qh, [M, HEAD_DIM],
                                        [stride_qm, 1], [ROWS, HEAD_DIM], q_smem_layout)
    if PAGED:  # the whole pool as rows; V's last page (from logical row n_tail) through its own descriptor
        table = Block_table + off_b * stride_btb
        num_blocks = NUM_BLOCKS
        pool_rows = NUM_BLOCKS * PAGE_SIZE
        k_desc = tma.make_tensor_descriptor(K + off_hk * stride_kh, [pool_rows, HEAD_DIM], [stride_kn, 1],
                                            [BLOCK_N, HEAD_DIM], kv_smem_layout)
        n_tail = gl.maximum(N - 1, 0) // PAGE_SIZE * PAGE_SIZE
        tail_row = page_row(table, n_tail, N, NUM_BLOCKS, PAGE_SIZE)
        v_tail_desc = tma.make_tensor_descriptor(V + off_hk * stride_vh + tail_row.to(gl.int64) * stride_vn,
                                                 [gl.maximum(N - n_tail, 1), HEAD_DIM], [stride_vn, 1],
                                                 [BLOCK_N, HEAD_DIM], kv_smem_layout)
    else:  # the loader's paging arguments, unused
        table = Lse
        num_blocks = 1
        n_tail = N
        k_desc = tma.make_tensor_descriptor(K + off_b * stride_kb + off_hk * stride_kh, [N, HEAD_DIM],
                                            [stride_kn, 1], [BLOCK_N, HEAD_DIM], kv_smem_layout)
    if FP8:  # V as launch/sm90.py `fp8_values` lays it out: [HEAD_DIM, N rounded up to 16], tiles [HEAD_DIM, BLOCK_N]
        v_tile: gl.constexpr = [HEAD_DIM, BLOCK_N]
        v_desc = tma.make_tensor_descriptor(V + off_b * stride_vb + off_hk * stride_vh, [HEAD_DIM, gl.cdiv(N, 16) * 16],
                                            [stride_vn, 1], v_tile, smem_layout(HEAD_DIM, BLOCK_N, dtype))
    elif PAGED:
        v_tile: gl.constexpr = [BLOCK_N, HEAD_DIM]
        v_desc = tma.make_tensor_descriptor(V + off_hk * stride_vh, [pool_rows, HEAD_DIM], [stride_vn, 1], v_tile,
                                            kv_smem_layout)
    else:
        v_tile: gl.constexpr = [BLOCK_N, HEAD_DIM]
        v_desc = tma.make_tensor_descriptor(V + off_b * stride_vb + off_hk * stride_vh, [N, HEAD_DIM],
                                            [stride_vn, 1], v_tile, kv_smem_layout)
    if not PAGED:
        v_tail_desc = v_desc
    o_dtype: gl.constexpr = Out.dtype.element_ty
    o_smem_layout: gl.constexpr = smem_layout(ROWS, HEAD_DIM, o_dtype)
    o_desc = tma.make_tensor_descriptor(Out + off_b * stride_ob + off_h.to(gl.int64) * stride_oh, [M, HEAD_DIM],
                                        [stride_om, 1], [ROWS, HEAD_DIM], o_smem_layout)
    diag = N - M
    left, right = window_extent(window_left, window_right, M, N, IS_CAUSAL, HAS_WINDOW)
    n_lo, n_full_lo, n_full, n_end = key_range(start_m, BLOCK_M, BLOCK_N, diag, N, left, right, IS_CAUSAL,
                                               HAS_WINDOW)
    n_blocks = gl.cdiv(n_end - n_lo, BLOCK_N)

    q_smem = gl.allocate_shared_memory(dtype, [2, ROWS, HEAD_DIM], q_smem_layout)
    k_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM], kv_smem_layout)
    v_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES] + v_tile, v_desc.layout)
    if FP8:  # a 16-bit output needs its own staging tiles; otherwise Q's are reused
        o_smem = gl.allocate_shared_memory(o_dtype, [2, ROWS, HEAD_DIM], o_smem_layout)
    else:
        o_smem = q_smem
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)
        mbarrier.init(v_empty.index(i), count=2)
    mbarrier.init(turn.index(0), count=1)
    mbarrier.init(turn.index(1), count=1)
    fence_async_shared()
    mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes)
    tma_load(q_desc, [start_m, 0], q_bar, q_smem.index(0))
    tma_load(q_desc, [start_m + ROWS, 0], q_bar, q_smem.index(1))

    gl.warp_specialize([
        (_ws_consumer, (0, q_smem, k_smem, v_smem, o_smem, q_bar, k_ready, v_ready, k_empty, v_empty, turn,
                        o_desc, Lse, Sinks, Alibi, stride_alibi_b, off_b, off_h, pid_bh, M, start_m, n_lo, n_full_lo,
                        n_full, n_end, n_blocks, diag, left, right, qk_scale, cap_scale, unit, v_scale, HEAD_DIM,
                        ROWS, BLOCK_N, NUM_STAGES, IS_CAUSAL, HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, HAS_SINKS,
                        IS_VARLEN)),
        (_ws_consumer, (1, q_smem, k_smem, v_smem, o_smem, q_bar, k_ready, v_ready, k_empty, v_empty, turn,
                        o_desc, Lse, Sinks, Alibi, stride_alibi_b, off_b, off_h, pid_bh, M, start_m, n_lo, n_full_lo,
                        n_full, n_end, n_blocks, diag, left, right, qk_scale, cap_scale, unit, v_scale, HEAD_DIM,
                        ROWS, BLOCK_N, NUM_STAGES, IS_CAUSAL, HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, HAS_SINKS,
                        IS_VARLEN)),
        (_ws_loader, (k_desc, v_desc, v_tail_desc, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, n_lo,
                      n_blocks, table, n_tail, n_end, num_blocks, BLOCK_N, NUM_STAGES, FP8, PAGED, PAGE_SIZE)),
    ], [4, 1], [CONSUMER_REGS, LOADER_REGS])
