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
interpreter), e4m3 q, k, v in the forward ([Note] FP8 forward in jit/common.py); head dims that are
multiples of 8 in [16, 256] (padded to D_PAD inside the kernel
with masks); any seqlen_q, seqlen_k (including seqlen_q != seqlen_k and 0); any strides with a
contiguous last dim; causal masks aligned to the bottom-right corner; batches of sequences of
different lengths packed without padding (flash_attn_varlen_func); dropout of the probabilities;
the variants (sliding window, softcap, ALiBi, sinks; kernels/tritonattn/jit/common.py [Note] Key band, [Note] Sinks
below).

[Note] Masking layout. The KV loop is split in two ranges. Blocks in [0, n_full) are seen whole by
every row of the query block (in bounds and, when causal, left of the diagonal band): they run
without any mask. Blocks in [n_full, n_end) are the diagonal band and the ragged tail: their loads
are bounds-checked and their scores masked. Blocks at or past n_end are never visited, so a causal
program does about half the work of a non-causal one. A sliding window adds a third range in front,
[n_lo, n_full_lo), its left edge (masked), and starts there (`key_range`). A narrow window's edges are
a few blocks each, too short to pipeline as loops of their own: the forward runs the band as one loop
that masks only its edge blocks (EDGES); the backward keeps the three loops, where one loop measured
slower (docs/perf-notes.md, Attention variants). Over a paged pool the descriptor path keeps the three
ranges (`paged_fwd_inner`) and the pointer path, already masked throughout, one loop from n_lo.

[Note] Sinks. A sink is a key with a logit (`Sinks`, per head, not scaled) and no value: the forward
starts each row's running max at it and its sum at 1, so the output's denominator and the LSE
include it; a row that sees no key gives zeros and LSE = sink. Its gradient, dsink = -sum_i
exp(sink - lse_i) * delta_i, is summed per preprocessing block and then in a fixed order.

[Note] Two load paths. On Hopper (capability >= 9) with 2-byte dtypes and 16-byte aligned bases and
strides, tiles are loaded through device-side tensor descriptors (TMA) bounded by each (batch,
head)'s [rows, D] slice, so out-of-range rows and padded head dims read as zero without masks;
descriptors need a scratch allocator, which `ensure_tma_allocator` installs unless the user set
one. Elsewhere (older GPUs, the interpreter, fp32, unaligned views) tiles are loaded through masked
pointers. On Hopper the pointer path is several times slower than the descriptor path
(docs/perf-notes.md, Prefill), so the launchers copy unaligned operands into aligned buffers there
(kernels/tritonattn/launch/prefill.py `aligned_operands`); only a chunked prefill over an unaligned cache, which
cannot be copied, takes it.

[Note] Causal with M != N. Query i sees key j iff j <= i + N - M (flash-attn >= 2.1). When M > N
the first M - N rows see nothing: they output zeros and LSE = +inf (see kernels/tritonattn/jit/common.py).

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
is compiled out: the dense kernels carry none of the varlen code. With a paged K/V
(flash_attn_varlen_func's block_table, forward only) the forward runs packed queries in cache mode
(below): sequence b's keys are the first Cache_seqlens[b] = cu_seqlens_k[b + 1] - cu_seqlens_k[b]
logical rows of its block-table row, and Cu_seqlens_k is not read.

[Note] Chunked prefill over a cache. flash_attn_with_kvcache hands a long chunk (see launch/decode.py
[Note] Chunked prefill) to the forward kernel with IS_KVCACHE=True: K and V are then a KV cache, N
is its capacity per request, and each program reads its request's key count from Cache_seqlens
(clamped to the capacity; plus M when the chunk was appended just before, KV_APPEND), so lengths
stay on the device and nothing recompiles as they grow. Bottom-right causal over those keys is the
dense kernel's mask with diag = N_b - M. A dense cache (B, S, H_KV, D) is read like a dense K with
per-request length (the descriptors are bounded by N_b). A paged pool (NUM_BLOCKS, P, H_KV, D)
with PAGED=True is addressed through Block_table: when P is a multiple of BLOCK_N and the pool's
rows are evenly spaced, one descriptor spans the whole pool as [NUM_BLOCKS * P, D] rows and each
key block starts at row block * P + start_n % P (`page_row`, looked up one block ahead as in the
decode kernel's [Note] Paged pipelining); rows of the last block past N_b belong to the page's
unused tail (stale data, possibly NaN bit patterns), so their scores are masked and their values
zeroed. Otherwise (P = 16, 48, ...) each key finds its page through `physical_blocks` (an entry per
page when a key block holds at most 4 whole pages, else per key) and loads through masked pointers.
With a window, the keys before a query block's band (rows a windowed PagedKVCache may have freed,
their pages reused or their table entries -1) are not loaded through pointers and have their values
zeroed after a descriptor load, as the decode kernel does: 0 * NaN would poison acc. Every cache
argument defaults to None / False: with IS_KVCACHE=False the cache code is compiled out.

[Note] Dropout. With HAS_DROPOUT the forward keeps each probability P_ij with probability 1 - p:
l_i still sums every probability (the softmax is of the undropped scores, as the LSE saved for the
backward), acc only the kept ones, and the epilogue scales the output by 1 / (1 - p) (dropout_scale),
so O = (P * Z / (1 - p)) V for the keep mask Z. The backward regenerates Z from the same bits
(kernels/tritonattn/jit/common.py `dropout_keep`: a function of (seed, salt, batch x head, query, key) alone) and
uses dV = (P * Z / (1 - p))^T dO, dP = (dO V^T) * Z / (1 - p), dS = P * (dP - delta) with delta =
rowsum(dO * O) as without dropout (sum_j P_ij dP_ij = dO_i . O_i still holds). (seed, salt) are
read from a device tensor (Rng), never baked into the launch, so a CUDA graph replays with new
bits. `dropout_probs_kernel` writes flash-attn's S_dmask from the same bits. Dropout arguments
default to None / False: with HAS_DROPOUT=False no RNG code is compiled.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import (
    LOG2E,
    alibi_terms,
    dropout_keep,
    finalize,
    gqa_kv_head,
    key_range,
    kv_block_offsets,
    kv_descales,
    left_padding,
    load_rows,
    mask_scores,
    online_softmax,
    page_row,
    physical_blocks,
    probs_for_values,
    query_block,
    score_units,
    sequence_keys,
    store_rows,
    tile_ptrs,
    variant_scores,
    window_extent,
)


# ============================================================================================
# Forward kernel
# ============================================================================================
@triton.jit
def fwd_inner(
    acc, m_i, l_i, q, k_src, v_src, stride_kn, stride_vn, lo, hi, whole_lo, whole_hi,
    offs_m, offs_n, offs_d, n_end, diag, left, right, qk_scale, cap_scale, alibi, dropout,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, MASKED: tl.constexpr,
    USE_TMA: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr, HAS_DROPOUT: tl.constexpr, EDGES: tl.constexpr = False,
    band_lo=0, GUARD_BAND: tl.constexpr = False,
):
    """Stream key blocks [lo, hi) of a dense K/V into (acc, m_i, l_i). k_src/v_src are tensor
    descriptors (USE_TMA) or base pointers of the (batch, KV head)'s [N, D] slice; MASKED blocks are
    bounds-checked and masked (see [Note] Masking layout); with EDGES only the blocks outside [whole_lo,
    whole_hi) are masked, and pointer loads are bounds-checked. dropout: (seed, salt, bh, keep_threshold).
    GUARD_BAND (a cache with a window): rows before band_lo, which no row of the block sees, are not
    loaded (pointers) or their values zeroed (descriptors), see [Note] Chunked prefill over a cache."""
    k_rel = offs_n[:, None] * stride_kn + offs_d[None, :]  # [BLOCK_N, D_PAD], small offsets
    v_rel = offs_n[:, None] * stride_vn + offs_d[None, :]
    for start_n in tl.range(lo, hi, BLOCK_N):
        if GUARD_BAND:
            rows_in = tl.where(start_n + offs_n >= band_lo, start_n + offs_n, n_end)
        else:
            rows_in = start_n + offs_n
        if USE_TMA:
            k = k_src.load([start_n, 0])  # [BLOCK_N, D_PAD]
        else:
            k = load_rows(k_src + tl.cast(start_n, tl.int64) * stride_kn + k_rel, rows_in, n_end, offs_d,
                          HEAD_DIM, HEAD_DIM_PAD, MASKED or EDGES).to(q.dtype)  # an FP8 cache: dequantized
        qk = tl.dot(q, tl.trans(k))  # [BLOCK_M, BLOCK_N]
        qk = variant_scores(qk, offs_m, start_n + offs_n, n_end, diag, left, right, cap_scale, alibi, MASKED,
                            IS_CAUSAL, HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI)
        if EDGES:
            if (start_n < whole_lo) | (start_n >= whole_hi):
                qk = mask_scores(qk, offs_m, start_n + offs_n, n_end, diag, left, right, IS_CAUSAL, HAS_WINDOW)
        p, m_i, l_i, acc = online_softmax(qk, m_i, l_i, acc, qk_scale, MASKED or EDGES)
        if HAS_DROPOUT:
            seed, salt, bh, keep_threshold = dropout
            p = tl.where(dropout_keep(seed, salt, bh, offs_m, start_n, BLOCK_N, keep_threshold), p, 0.0)
        if USE_TMA:
            v = v_src.load([start_n, 0])
            if GUARD_BAND:
                v = tl.where(rows_in[:, None] < n_end, v, 0.0)
        else:
            v = load_rows(v_src + tl.cast(start_n, tl.int64) * stride_vn + v_rel, rows_in, n_end, offs_d,
                          HEAD_DIM, HEAD_DIM_PAD, MASKED or EDGES).to(q.dtype)
        acc = tl.dot(probs_for_values(p, v), v, acc)  # the FP8 forward: p quantized to e4m3
    return acc, m_i, l_i


@triton.jit
def paged_fwd_inner(
    acc, m_i, l_i, q, k_desc, v_desc, table, next_row, lo, hi, offs_m, offs_n, n_end, diag, left, right, qk_scale,
    cap_scale, alibi, band_lo, NUM_BLOCKS, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, MASKED: tl.constexpr,
    IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
):
    """Stream key blocks [lo, hi) of a paged pool into (acc, m_i, l_i) through descriptors of the whole
    pool as [NUM_BLOCKS * P, D] rows (P a multiple of BLOCK_N, see [Note] Chunked prefill over a cache).
    next_row is block lo's pool row; each page is looked up one block ahead, and the row after hi is
    returned for the next stage. MASKED blocks are masked (band and length) and their values past
    n_end zeroed: those rows are the page's unused tail, stale data that may hold NaN bit patterns
    (0 * NaN would poison acc); with a window, so are the values before band_lo (pages a windowed cache
    freed)."""
    for start_n in tl.range(lo, hi, BLOCK_N):
        row = next_row
        next_row = page_row(table, start_n + BLOCK_N, n_end, NUM_BLOCKS, PAGE_SIZE)
        k = k_desc.load([row, 0])
        qk = tl.dot(q, tl.trans(k))
        qk = variant_scores(qk, offs_m, start_n + offs_n, n_end, diag, left, right, cap_scale, alibi, MASKED,
                            IS_CAUSAL, HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI)
        p, m_i, l_i, acc = online_softmax(qk, m_i, l_i, acc, qk_scale, MASKED)
        v = v_desc.load([row, 0])
        if MASKED:
            if HAS_WINDOW:
                v = tl.where(((start_n + offs_n < n_end) & (start_n + offs_n >= band_lo))[:, None], v, 0.0)
            else:
                v = tl.where((start_n + offs_n)[:, None] < n_end, v, 0.0)
        acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, m_i, l_i, next_row


@triton.jit(do_not_specialize=["window_left", "window_right"])  # a new window size is not a new kernel
def fwd_kernel(
    Q, K, V, Out, Lse,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_ob, stride_om, stride_oh,
    H, M, N, GROUP, softmax_scale, window_left, window_right, softcap,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr, USE_TMA: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_SINKS: tl.constexpr,
    HAS_SEQUSED_K: tl.constexpr,
    Alibi=None, stride_alibi_b=None, Sinks=None, Seqused_k=None, Alibi_shift=None,
    Cu_seqlens_q=None, Cu_seqlens_k=None, stride_lseh=None, IS_VARLEN: tl.constexpr = False,
    Rng=None, keep_threshold=None, dropout_scale=None, HAS_DROPOUT: tl.constexpr = False,
    Cache_seqlens=None, Block_table=None, stride_btb=None, NUM_BLOCKS=None, stride_kblk=None, stride_vblk=None,
    N_NEW=None, IS_KVCACHE: tl.constexpr = False, KV_APPEND: tl.constexpr = False, PAGED: tl.constexpr = False,
    PAGE_SIZE: tl.constexpr = 1, WIDE_PAGES: tl.constexpr = False,
    Cache_leftpad=None, HAS_LEFTPAD: tl.constexpr = False,
    KV_FP8: tl.constexpr = False, K_descale=None, stride_kds=None, stride_kdh=None, V_descale=None, stride_vds=None,
    stride_vdh=None,  # FP8 K/V (a cache, or the FP8 forward's): [Note] FP8 KV cache, FP8 forward in jit/common.py
    Q_descale=None, stride_qds=None, stride_qdh=None,  # the FP8 forward's (an e4m3 Q)
    HAS_TREE: tl.constexpr = False,  # a verify step's tree: the decode kernel's, never on here
):
    Q_FP8: tl.constexpr = Q.dtype.element_ty == tl.float8e4nv  # the FP8 forward: q, k, v all e4m3
    tl.static_assert(BLOCK_M >= 16 and BLOCK_N >= 16, "tl.dot needs tiles of at least 16")
    tl.static_assert(IS_KVCACHE or Q_FP8 or not KV_FP8, "FP8 K/V: a cache, or the FP8 forward")
    tl.static_assert(not Q_FP8 or (KV_FP8 and not IS_KVCACHE and not HAS_DROPOUT), "the FP8 forward: dense/packed")
    tl.static_assert(not (KV_FP8 and USE_TMA), "FP8 K/V are read through pointers")
    tl.static_assert(not HAS_TREE, "a tree mask is decode's")
    tl.static_assert(not (HAS_DROPOUT and IS_KVCACHE), "dropout is a training option: no cache mode")
    tl.static_assert(IS_VARLEN or not HAS_SEQUSED_K, "seqused_k counts the keys of packed sequences")
    # -- which query block and head (off_hk: the KV head this query head reads) ----------------
    pid_m, pid_bh, off_b, off_h, off_hk = query_block(H, GROUP, IS_CAUSAL)
    k_scale, v_scale = kv_descales(K_descale, V_descale, off_b, off_hk, stride_kds, stride_kdh, stride_vds, stride_vdh,
                                   KV_FP8, Q_descale, stride_qds, stride_qdh, Q_FP8)  # 1.0 and 1.0 unless FP8 K/V
    unit, cap_scale = score_units(softmax_scale * k_scale, softcap, HAS_SOFTCAP)  # the descales folded in
    qk_scale = unit * LOG2E  # scores to base-2 logits
    start_m = pid_m * BLOCK_M
    if IS_VARLEN:  # off_b is a packed sequence: its own M, N and first rows (see [Note] Packed sequences)
        q_start = tl.load(Cu_seqlens_q + off_b)
        M = tl.load(Cu_seqlens_q + off_b + 1) - q_start  # this sequence's seqlen_q
        if start_m >= M:  # the grid covers max_seqlen_q: blocks past this sequence's end exit at once
            return
        if not IS_KVCACHE:  # packed keys; a paged pool instead is addressed through Block_table below
            k_start, N = sequence_keys(Cu_seqlens_k, Seqused_k, off_b, HAS_SEQUSED_K)  # this sequence's seqlen_k
            K += k_start.to(tl.int64) * stride_kn
            V += k_start.to(tl.int64) * stride_vn
        Q += q_start.to(tl.int64) * stride_qm  # the launcher passes batch strides of 0
        Out += q_start.to(tl.int64) * stride_om
        Lse += q_start  # Lse is (H, total_q)
    if IS_KVCACHE:  # K/V are a cache: N is its capacity, the request's key count lives on the device
        n_cached = tl.minimum(tl.maximum(tl.load(Cache_seqlens + off_b), 0), N)
        if KV_APPEND:  # N_NEW <= M new keys were appended at [n_cached, n_cached + N_NEW) just before
            N = tl.minimum(n_cached + N_NEW, N)
        else:
            N = n_cached
        if HAS_LEFTPAD:  # keys start at cache row LP_b, see [Note] Left padding in kernels/tritonattn/jit/decode.py
            pad = left_padding(Cache_leftpad, off_b, n_cached)
            N -= pad
            K += pad.to(tl.int64) * stride_kn
            V += pad.to(tl.int64) * stride_vn

    q_base = Q + off_b * stride_qb + off_h.to(tl.int64) * stride_qh
    k_base = K + off_b * stride_kb + off_hk * stride_kh
    v_base = V + off_b * stride_vb + off_hk * stride_vh
    o_base = Out + off_b * stride_ob + off_h.to(tl.int64) * stride_oh

    offs_m = start_m + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    offs_n = tl.arange(0, BLOCK_N)  # [BLOCK_N]
    offs_d = tl.arange(0, HEAD_DIM_PAD)  # [D_PAD]

    # -- the KV range this block visits (see [Note] Masking layout) ------------------------------
    diag = N - M  # row i's diagonal key is i + diag
    left, right = window_extent(window_left, window_right, M, N, IS_CAUSAL, HAS_WINDOW)
    n_lo, n_full_lo, n_full, n_end = key_range(start_m, BLOCK_M, BLOCK_N, diag, N, left, right, IS_CAUSAL, HAS_WINDOW)
    if IS_KVCACHE and HAS_WINDOW:  # the first key any row of the block sees (n_lo rounds it down to a block)
        band_lo = tl.maximum(start_m + diag - left, 0)
    else:
        band_lo = 0
    alibi = alibi_terms(Alibi, stride_alibi_b, Alibi_shift, off_b, off_h, unit, diag, HAS_ALIBI)  # score units

    if HAS_SINKS:  # the sink is a key of score `sink` and no value: it starts the row's max and sum
        m_i = tl.full([BLOCK_M], 0.0, dtype=tl.float32) + tl.load(Sinks + off_h).to(tl.float32) * LOG2E
        l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    if HAS_DROPOUT:  # see [Note] Dropout
        dropout = (tl.load(Rng), tl.load(Rng + 1), pid_bh, keep_threshold)
    else:
        dropout = (0, 0, 0, 0)

    if IS_KVCACHE and PAGED:
        if USE_TMA:
            # Hopper tensor descriptors: the whole pool as [NUM_BLOCKS * P, D] rows; see [Note]
            # Chunked prefill over a cache
            q_desc = tl.make_tensor_descriptor(q_base, [M, HEAD_DIM], [stride_qm, 1], [BLOCK_M, HEAD_DIM_PAD])
            k_desc = tl.make_tensor_descriptor(k_base, [NUM_BLOCKS * PAGE_SIZE, HEAD_DIM], [stride_kn, 1],
                                               [BLOCK_N, HEAD_DIM_PAD])
            v_desc = tl.make_tensor_descriptor(v_base, [NUM_BLOCKS * PAGE_SIZE, HEAD_DIM], [stride_vn, 1],
                                               [BLOCK_N, HEAD_DIM_PAD])
            q = q_desc.load([start_m, 0])  # [BLOCK_M, D_PAD]
            table = Block_table + off_b * stride_btb
            next_row = page_row(table, n_lo, n_end, NUM_BLOCKS, PAGE_SIZE)
            if HAS_WINDOW:  # the band's left edge, masked
                acc, m_i, l_i, next_row = paged_fwd_inner(
                    acc, m_i, l_i, q, k_desc, v_desc, table, next_row, n_lo, n_full_lo, offs_m, offs_n, n_end, diag,
                    left, right, qk_scale, cap_scale, alibi, band_lo, NUM_BLOCKS, BLOCK_N, PAGE_SIZE, True, IS_CAUSAL,
                    HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI)
            # blocks every row sees whole, no mask
            acc, m_i, l_i, next_row = paged_fwd_inner(
                acc, m_i, l_i, q, k_desc, v_desc, table, next_row, n_full_lo, n_full, offs_m, offs_n, n_end, diag,
                left, right, qk_scale, cap_scale, alibi, band_lo, NUM_BLOCKS, BLOCK_N, PAGE_SIZE, False, IS_CAUSAL,
                HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI)
            # the diagonal band and the ragged tail, masked
            acc, m_i, l_i, next_row = paged_fwd_inner(
                acc, m_i, l_i, q, k_desc, v_desc, table, next_row, n_full, n_end, offs_m, offs_n, n_end, diag, left,
                right, qk_scale, cap_scale, alibi, band_lo, NUM_BLOCKS, BLOCK_N, PAGE_SIZE, True, IS_CAUSAL,
                HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI)
        else:  # pointer path over a paged pool: each key block finds its rows through the block table
            q = load_rows(tile_ptrs(q_base, start_m, stride_qm, BLOCK_M, offs_d), offs_m, M, offs_d,
                          HEAD_DIM, HEAD_DIM_PAD, True)
            table = Block_table + off_b * stride_btb
            next_blocks = physical_blocks(table, n_lo, n_lo + offs_n, n_end, NUM_BLOCKS, PAGE_SIZE, BLOCK_N)
            for start_n in tl.range(n_lo, n_end, BLOCK_N):  # one loop: the masks are cheap next to the gathers
                rows = start_n + offs_n
                blocks = next_blocks
                next_blocks = physical_blocks(table, start_n + BLOCK_N, rows + BLOCK_N, n_end, NUM_BLOCKS, PAGE_SIZE,
                                              BLOCK_N)
                if HAS_WINDOW:  # rows before the band (pages the cache may have freed): not loaded
                    rows_in = tl.where(rows >= band_lo, rows, n_end)
                else:
                    rows_in = rows
                k_offs = kv_block_offsets(blocks, start_n, offs_n, stride_kblk, stride_kn, PAGE_SIZE, True,
                                          WIDE_PAGES, BLOCK_N)
                k = load_rows(k_base + k_offs[:, None] + offs_d[None, :], rows_in, n_end, offs_d, HEAD_DIM,
                              HEAD_DIM_PAD, True).to(q.dtype)
                qk = tl.dot(q, tl.trans(k))
                qk = variant_scores(qk, offs_m, rows, n_end, diag, left, right, cap_scale, alibi, True, IS_CAUSAL,
                                    HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI)
                p, m_i, l_i, acc = online_softmax(qk, m_i, l_i, acc, qk_scale, True)
                v_offs = kv_block_offsets(blocks, start_n, offs_n, stride_vblk, stride_vn, PAGE_SIZE, True,
                                          WIDE_PAGES, BLOCK_N)
                v = load_rows(v_base + v_offs[:, None] + offs_d[None, :], rows_in, n_end, offs_d, HEAD_DIM,
                              HEAD_DIM_PAD, True).to(q.dtype)
                acc = tl.dot(p.to(v.dtype), v, acc)
    else:
        if USE_TMA:
            # Hopper tensor descriptors bounded by this (batch, head)'s [rows, D] slice: out-of-range
            # rows and padded head dims read as zero and are never written.
            q = tl.make_tensor_descriptor(q_base, [M, HEAD_DIM], [stride_qm, 1], [BLOCK_M, HEAD_DIM_PAD]).load(
                [start_m, 0])  # [BLOCK_M, D_PAD]
            k_src = tl.make_tensor_descriptor(k_base, [N, HEAD_DIM], [stride_kn, 1], [BLOCK_N, HEAD_DIM_PAD])
            v_src = tl.make_tensor_descriptor(v_base, [N, HEAD_DIM], [stride_vn, 1], [BLOCK_N, HEAD_DIM_PAD])
        else:
            q = load_rows(tile_ptrs(q_base, start_m, stride_qm, BLOCK_M, offs_d), offs_m, M, offs_d,
                          HEAD_DIM, HEAD_DIM_PAD, True)  # [BLOCK_M, D_PAD]
            k_src = k_base
            v_src = v_base
        if HAS_WINDOW:  # one loop over the band, its two edges masked in place (a few blocks each)
            acc, m_i, l_i = fwd_inner(acc, m_i, l_i, q, k_src, v_src, stride_kn, stride_vn, n_lo, n_end, n_full_lo,
                                      n_full, offs_m, offs_n, offs_d, n_end, diag, left, right, qk_scale, cap_scale,
                                      alibi, dropout, BLOCK_N, HEAD_DIM, HEAD_DIM_PAD, False, USE_TMA, IS_CAUSAL,
                                      HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, True, band_lo, IS_KVCACHE)
        else:
            # stage 1: blocks every row sees whole, no mask
            acc, m_i, l_i = fwd_inner(acc, m_i, l_i, q, k_src, v_src, stride_kn, stride_vn, 0, n_full, 0, 0,
                                      offs_m, offs_n, offs_d, n_end, diag, left, right, qk_scale, cap_scale, alibi,
                                      dropout, BLOCK_N, HEAD_DIM, HEAD_DIM_PAD, False, USE_TMA, IS_CAUSAL, HAS_WINDOW,
                                      HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT)
            # stage 2: the diagonal band and the ragged tail, masked
            acc, m_i, l_i = fwd_inner(acc, m_i, l_i, q, k_src, v_src, stride_kn, stride_vn, n_full, n_end, 0, 0,
                                      offs_m, offs_n, offs_d, n_end, diag, left, right, qk_scale, cap_scale, alibi,
                                      dropout, BLOCK_N, HEAD_DIM, HEAD_DIM_PAD, True, USE_TMA, IS_CAUSAL, HAS_WINDOW,
                                      HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT)

    # -- epilogue: normalise, store the output and the LSE ---------------------------------------
    out, lse = finalize(acc, m_i, l_i)
    if KV_FP8:  # V's descale (an FP8 cache or the FP8 forward)
        out = out * v_scale
    if HAS_DROPOUT:  # l_i summed every probability, acc only the kept ones: rescale by 1 / (1 - p)
        out = out * dropout_scale
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


@triton.jit(do_not_specialize=["window_left", "window_right"])
def dropout_probs_kernel(
    Q, K, S, Rng,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_sb, stride_sh, stride_sm,
    H, M, N, GROUP, softmax_scale, window_left, window_right, softcap, keep_threshold,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_SINKS: tl.constexpr,
    HAS_SEQUSED_K: tl.constexpr,
    Alibi=None, stride_alibi_b=None, Sinks=None, Seqused_k=None, Alibi_shift=None,
    Cu_seqlens_q=None, Cu_seqlens_k=None, IS_VARLEN: tl.constexpr = False, KV_FP8: tl.constexpr = False,
    HAS_TREE: tl.constexpr = False,
):
    """flash-attn's S_dmask, a testing aid: S[b, h, i, j] = exp(s_ij - max_j' s_ij') for the keys row i
    sees (s = the scores as the softmax sees them: scaled, softcapped, with ALiBi; a sink takes no
    part), negated where dropout drops the pair (the forward's own bits, see [Note] Dropout), 0 at keys
    the row does not see. Two passes over the keys (row max, then the values), through masked
    pointers: no speed is asked of it."""
    tl.static_assert(not KV_FP8 and not HAS_TREE, "no cache, no tree here")
    unit, cap_scale = score_units(softmax_scale, softcap, HAS_SOFTCAP)
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    off_b = (pid_bh // H).to(tl.int64)
    off_h = pid_bh % H
    off_hk = gqa_kv_head(off_h, GROUP)
    start_m = pid_m * BLOCK_M
    s_rows = M  # S's (rows, columns) per head: a longer packed sequence is cut, never written past S
    s_cols = N
    if IS_VARLEN:  # M, N are S's (max_seqlen_q, max_seqlen_k); each sequence keeps its own alignment
        q_start = tl.load(Cu_seqlens_q + off_b)
        M = tl.load(Cu_seqlens_q + off_b + 1) - q_start
        if start_m >= tl.minimum(M, s_rows):
            return
        k_start, N = sequence_keys(Cu_seqlens_k, Seqused_k, off_b, HAS_SEQUSED_K)
        Q += q_start.to(tl.int64) * stride_qm
        K += k_start.to(tl.int64) * stride_kn
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    q = load_rows(tile_ptrs(Q + off_b * stride_qb + off_h.to(tl.int64) * stride_qh, start_m, stride_qm, BLOCK_M,
                            offs_d), offs_m, M, offs_d, HEAD_DIM, HEAD_DIM_PAD, True)
    k_base = K + off_b * stride_kb + off_hk * stride_kh
    diag = N - M  # each sequence's own alignment, also where S cuts it
    left, right = window_extent(window_left, window_right, M, N, IS_CAUSAL, HAS_WINDOW)
    n_lo, _, _, n_end = key_range(start_m, BLOCK_M, BLOCK_N, diag, N, left, right, IS_CAUSAL, HAS_WINDOW)
    alibi = alibi_terms(Alibi, stride_alibi_b, Alibi_shift, off_b, off_h, unit, diag, HAS_ALIBI)
    seed = tl.load(Rng)
    salt = tl.load(Rng + 1)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    for start_n in tl.range(n_lo, n_end, BLOCK_N):
        k = load_rows(tile_ptrs(k_base, start_n, stride_kn, BLOCK_N, offs_d), start_n + offs_n, n_end, offs_d,
                      HEAD_DIM, HEAD_DIM_PAD, True)
        s = variant_scores(tl.dot(q, tl.trans(k)), offs_m, start_n + offs_n, n_end, diag, left, right, cap_scale,
                           alibi, True, IS_CAUSAL, HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI) * unit
        m_i = tl.maximum(m_i, tl.max(s, 1))
    m_i = tl.where(m_i == float("-inf"), 0.0, m_i)  # a row that sees no key: every exp is 0
    s_base = S + off_b * stride_sb + off_h.to(tl.int64) * stride_sh  # zero-filled: keys past n_end stay 0
    for start_n in tl.range(n_lo, n_end, BLOCK_N):
        k = load_rows(tile_ptrs(k_base, start_n, stride_kn, BLOCK_N, offs_d), start_n + offs_n, n_end, offs_d,
                      HEAD_DIM, HEAD_DIM_PAD, True)
        s = variant_scores(tl.dot(q, tl.trans(k)), offs_m, start_n + offs_n, n_end, diag, left, right, cap_scale,
                           alibi, True, IS_CAUSAL, HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI) * unit
        e = tl.exp(s - m_i[:, None])
        e = tl.where(dropout_keep(seed, salt, pid_bh, offs_m, start_n, BLOCK_N, keep_threshold), e, -e)
        cols = start_n + offs_n
        tl.store(s_base + offs_m.to(tl.int64)[:, None] * stride_sm + cols[None, :], e.to(S.dtype.element_ty),
                 mask=(offs_m[:, None] < tl.minimum(M, s_rows)) & (cols[None, :] < tl.minimum(n_end, s_cols)))
