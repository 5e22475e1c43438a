"""Decode attention: batched KV-cache decode with per-request lengths, fused in-place append, GQA
read-once and split-KV (flash-decoding), over a dense or a paged cache, with no host synchronisation.

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
  kernels/tritonattn/jit/common.py). With one split the decode kernel writes the final output directly.
- Paged caches (PagedAttention, Woosuk Kwon et al., 2023; vLLM and flash-attn's block_table): the
  cache is a pool of fixed-size pages and a block table maps each request's logical pages to
  physical blocks; the same kernel reads it behind the constexpr PAGED (see [Note] Paged caches).
The streaming softmax, the variants' scores and the masks are the prefill kernel's (`online_softmax`,
`variant_scores`, `finalize`), so prefill and decode cannot drift apart.

Notation:
    B batch, H q heads, H_KV KV heads, G = H // H_KV, M = seqlen_q (query tokens), M_NEW = seqlen_new
    (appended tokens, 1 <= M_NEW <= M; 0 without k/v), D = head dim, D_PAD = next power of two >= D,
    N_CACHE = a request's capacity (dense: the allocated seqlen_cache; paged: max_blocks_per_seq * P),
    L_b = cache_seqlens[b], N_b = L_b + M_NEW keys seen. Paged: P = page_size, NUM_BLOCKS = blocks in the pool,
    Block_table (B, max_blocks_per_seq) int32. LP_b = cache_leftpad[b] (0 without): rows before it are
    padding (see [Note] Left padding).
    A program's query rows are r = g * M + t for g in [0, G) (q head h = kv_head * G + g) and t in
    [0, M) (the token), head-major; BLOCK_H >= 16 rows per program, several row blocks when G * M
    exceeds the config's max_rows.
    m_i running max (base 2) [BLOCK_H], l_i running sum [BLOCK_H], acc [BLOCK_H, D_PAD] fp32.

Supported: fp16/bf16 (fp32 accumulation), fp32, float8_e4m3fn caches under a 16-bit q (KV_FP8: [Note]
FP8 KV cache in kernels/tritonattn/jit/common.py); head dims that are multiples of 8 in [16, 256];
any seqlen_q >= 1; MHA/GQA/MQA; dense caches with any strides and a contiguous last dim (including
a (B, H_KV, S, D) buffer seen through .transpose(1, 2)); paged pools (NUM_BLOCKS, P, H_KV, D) with
any strides and a contiguous last dim (including a (NUM_BLOCKS, H_KV, P, D) pool seen through
.transpose(1, 2)) and any page size P >= 1 (tested: 1, 2, 8, 16, 48, 64, 256); caches beyond 2^31
elements (int64 offsets); left-padded requests (cache_leftpad) in dense caches and in the one-page
tables of cache_batch_idx. Not here: cache_batch_idx and rotary embedding are the api layer's (api/kvcache.py)
(a one-page-per-request table, a rotary launch before this one). The variants (sliding window,
softcap, ALiBi, sinks): see [Note] Variants in decode. All K/V row addresses go through
`kv_row_offsets` (kernels/tritonattn/jit/common.py).

[Note] Fused append without hazards. The new keys/values are read from the k/v inputs, not from
the cache, by the program that owns them (the last split of each (request, KV head), first row
block), which also writes them into the cache. Every other program reads only cache rows [0, L_b),
so no program reads a row another program writes in the same launch. Paged, each new row looks up
its own page, so an append crossing page boundaries writes each row to its own page slot; requests
may share pages they only read (prefix sharing), but a page appended into must be one request's.
The last split streams its share of the cached keys like every other split, then the new rows, so
it ends last; loading those rows only then (and, paged, their table entries) would add a memory
round trip or two at the end of the grid. With EARLY_NEW (`early_new` in launch/decode.py: dense
caches, pools whose pages hold whole key blocks, P % BLOCK_N == 0, and split pools that gather a
key block from several pages) it loads the first BLOCK_NEW new rows and their page entries at its
start, under the cached keys' loads (the other splits' loads of them are fully masked). The early
tiles cost registers and a little shared memory; an unsplit gathering kernel (P = 16, 48) keeps the
late loads, since there the extra registers cost more than the round trip they save (timings and
register counts: docs/perf-notes.md, Decode, "Early new row").

[Note] One loop for short splits. A split streams its whole blocks through an unmasked loop, then
its ragged tail (the last cached keys when L_b is not a multiple of BLOCK_N, and without an append
the causal band) through a masked one. The pipeliner fills each loop's pipeline on its own, so the
tail's tiles are requested only when the first loop is done: one memory round trip per program that
no other work hides when the splits are short and there is one program per SM. With ONE_LOOP
(`one_loop` in launch/decode.py: splits of at most DECODE_ONE_LOOP_MAX_BLOCKS blocks, config/tables.py) every block
takes the masked loop, so the tail comes through the same pipeline; the masks cost a little per
block, which long splits pay more often than the round trip they save, so long splits keep the two
loops (where the crossover lies on Hopper: docs/perf-notes.md, Decode, "One loop for short splits").

[Note] Empty KV splits. The split size is a fixed multiple of BLOCK_N from the allocated N_CACHE and num_splits,
never from the current lengths (on the device). A split starting at or past L_b runs no iteration and writes an
empty partial (lse = -inf, weight 0); a request whose splits are all empty outputs zeros and LSE = +inf.

[Note] Causal with seqlen_q > 1. Bottom-right over the N_b keys: token t sees key j iff j <= t + N_b - M. With
a full append (M_NEW = M) only the new keys are masked (token t sees new keys 0..t), with a partial one or none
cached keys too. With HAS_TREE the last M keys are drafts masked by a tree (`tree_scores`), in the masked stages.

[Note] Variants in decode. The prefill kernels' semantics (kernels/tritonattn/jit/common.py [Note] Key band), aligned
bottom-right against each request's current length N_b: token t's diagonal key is t + N_b - M. Softcap
and ALiBi change the scores in every stage through `variant_scores` (each row's ALiBi slope is its own
q head's). A sliding window bounds the cached keys a request visits to its band, [N_b - M - left,
N_b), at most left + M keys; the splits tile that band instead of the whole buffer: split s starts s *
SPLIT_N keys after the band's first key block, and the host plans the splits over the band's span (at
most left + M + BLOCK_N keys, `plan_decode` in launch/decode.py) rather than N_CACHE, so a long cache under
a short window costs what the window costs, and splits that would lie past the band run no iteration.
Inside a split the band's left edge (keys some rows of the request do not see) is a masked stage
before the unmasked blocks, and rows of the band's first key block that lie before the band are not
loaded at all (they read as zeros): the kernel never reads a key or value before a request's band, so
such rows (a paged cache's pages wholly before the window) may hold anything, NaN included. A sink is
a key with a logit and no value ([Note] Sinks in kernels/tritonattn/jit/prefill_fwd.py): unsplit, it starts each
row's running max and sum; split, no partial carries it and the combine adds it once to the merged row
(`merge_sink`).

[Note] Left padding. With cache_leftpad (HAS_LEFTPAD), request b's keys are cache rows [LP_b, L_b)
(flash-attn's convention: L_b = cache_seqlens[b] is where they end, the padding included). LP_b is
read on the device and clamped to [0, L_b], like L_b to [0, N_CACHE]. The program moves the request's
K/V base down LP_b rows and counts its cached keys (L_b - LP_b) and its buffer (N_CACHE - LP_b) from
there, so the loops, the masks and the splits run unchanged over the shifted range, and the causal
diagonal j <= t + N_b - M keeps its place since both ends move by LP_b. The fused append still writes
cache row L_b + u (shifted base plus shifted length) and reads its rows back as keys L_b - LP_b + u.
Moving the base by whole rows is right only when a request's rows are one piece of memory: a dense
cache, or the one page per request of cache_batch_idx (api/validate_cache.py), whose page holds all of
N_CACHE; a paged block_table with left padding is refused on the host, as flash-attn refuses it. A
request padded up to its length sees no key without an append: zeros, LSE +inf. The splits are still
cut from N_CACHE, so a heavily padded request leaves its last splits empty ([Note] Empty KV splits).

[Note] Paged caches. Logical key j of request b lives in row j % P of physical block
Block_table[b, j // P]; `kv_row_offsets` / `kv_block_offsets` (kernels/tritonattn/jit/common.py) turn (block,
row) into an int64 offset with the pool's block and row strides, so pool views with any strides
work (see [Note] Paged address arithmetic). Paging is a constexpr: with PAGED=False the paging
arguments are passed as None (Triton makes them constexprs) and every paged branch is compiled out,
so the dense kernel carries none of the paging code. The grid, the splits and the heuristic see a
paged request as a dense one of N_CACHE = max_blocks_per_seq * P keys.

[Note] BLOCK_N vs page size. A key block of BLOCK_N rows may span several pages (P < BLOCK_N) or a
page several key blocks (P >= BLOCK_N). Rather than tie BLOCK_N to P (48 would force BLOCK_N = 16,
P = 8 a block of 8 rows, too small for `tl.dot`, and a decode tuned at BLOCK_N = 64 would lose its
tuning), the kernel keeps the dense BLOCK_N and finds each key's physical row (`physical_blocks`):
- P % BLOCK_N == 0 (e.g. 64 and 256 at BLOCK_N 64): key blocks start at multiples of BLOCK_N
  (splits are whole blocks), so a block lies in one page: one table entry per block, a scalar load.
- BLOCK_N % P == 0 with at most DECODE_GATHER_MAX_PAGES = 4 pages per block (P = 16 and 32 at
  BLOCK_N 64; 32 and 64 at BLOCK_N 128): one entry per page, broadcast over the page's rows
  (`tl.reshape` of a [pages, P] broadcast). Per-key entries (below) would cost each thread a table
  load per row it holds (8 at D = 128, twice since the K and the V tile each re-derive them) where
  this costs one per page, and more registers. With 8 pages per block (P = 16 at D = 64) the
  per-page form is not reliably faster on Hopper, so such blocks keep the per-key gather; an unsplit
  deep grid instead halves BLOCK_N to 4 pages (decode_paged_tiles). Timings: docs/perf-notes.md,
  Paged decode, "Page lookups per key block".
- otherwise (P = 48 and P <= 8 at BLOCK_N 64, P = 16 at BLOCK_N 128): each key gathers its own
  table entry (BLOCK_N int32 loads from one cached table row, as vLLM's paged attention does); rows
  are still loaded whole, so a K/V row is as coalesced as in the dense cache (a row of one KV head is
  D contiguous elements in both). So pages of 1..8 rows take the same path as 48: no slow path, and
  they are supported.
The append always gathers (its rows start anywhere). Table loads are masked to rows below the split's
end, so a program never reads past max_blocks_per_seq entries: its first lookup is bounded by the
capacity N_CACHE (it may read entries past the request's pages, which are clamped and never used,
see [Note] Paged pipelining), later ones by N_b.

[Note] Paged address arithmetic. A key's offset is block * stride_b (64 bits: pools pass 2^31
elements) plus its row inside the page times stride_n, which is below (P - 1) * stride_n and so
computed in 32 bits: int64 multiplies and adds per row would be most of the loop's integer work.
`kv_block_offsets` also writes the in-page row from the key block's alignment (start_n is a multiple
of BLOCK_N): start_n % P + offs_n when a page holds whole blocks, offs_n % P, the same for every
block, when a block holds whole pages. The rest of the offset stays in the loop: hoisting it (a
scalar plus a loop-invariant vector) takes fewer instructions but runs slower at split shapes on
Hopper (instruction counts and timings: docs/perf-notes.md, Paged decode, "In-page offsets in 32
bits"). The unsplit 3-stage kernel's registers are capped so that 3 programs share an SM
(`decode_max_registers`, kernels/tritonattn/config/tables.py; see [Note] Paged pipelining). A pool whose page rows
lie 2^31 / (P - 1) elements apart or more (a permuted (P, num_blocks, ...) buffer) would overflow
the 32-bit in-page offset; the host sees it from the strides (`wide_pages`) and compiles such calls
with WIDE_PAGES, 64-bit in-page offsets.

[Note] Paged pipelining. Triton's software pipeliner gives each load that feeds a `tl.dot` a
latency of (num_stages - 1) // (indirection level + 1) iterations (AssignLatencies.cpp). Looking
the page up in the same iteration as the K/V tile it addresses makes the tile a level-1 load, so
with 4 stages it would be issued only 1 iteration ahead instead of 3: a shallower memory pipeline
than the dense kernel's. The level is traced through values defined in the loop body only, so each
iteration fetches the table entries of the *next* key block into a loop-carried value
(`next_blocks`); the K/V tiles stay level-0 loads, as deep as the dense kernel's at the same stage
count (at 4 stages: the same 3-deep prologue, `async_wait num = 4` and 16-byte cp.async count in the
sm_90 TTGIR/PTX). The table load does not get a free iteration, though: the pipeliner issues each
tile num_stages - 1 iterations ahead, and for it re-derives that block's page lookup inside the
iteration, a plain load (an L1 hit after a split's first block) that the tile's cp.async waits for;
the loop-carried value only hands the first block to the next loop (sm_90 TTGIR at 3 stages).
The other forms lose: fetching two blocks ahead, through two loop-carried values, makes the
pipeliner give up (the tiles become plain loads); the lookup in its own tile's iteration, at 5 or 7
stages, lets the pipeliner stage the table entries too (cp.async two iterations before their
tiles) but runs slower on Hopper (docs/perf-notes.md, Paged decode, "Pipelining the page lookup").
The split's first lookup is bounded by the capacity N_CACHE rather than by L_b, so it can be issued
with the length's load instead of after it (entries past the request's pages are clamped and never
used). It also comes before the query load in the source: the query tile reaches the dot's layout
through shared memory, behind a barrier that waits for the tile to arrive, and ptxas keeps later
loads after that barrier (sm_90 SASS), so a lookup placed after the query load would be issued one
memory round trip late.
Paged caches run at most DECODE_PAGED_STAGES = 3 pipeline stages, against the dense config's 4 on
Hopper: at 3 stages the kernel's shared memory fits 3 programs per SM instead of 2, faster at split
and one-wave shapes (docs/perf-notes.md, Paged decode, "Plans"). An unsplit grid of more programs
than the 3-stage kernel fits at once (3 per SM) keeps the config's stages, and halves a BLOCK_N that
would gather 8 pages (P = 16 at D <= 64), see decode_paged_tiles. Compiled on the device (Triton
specialises the seqlen_q = 1 of a decode step to a constant) the unsplit 3-stage paged kernel takes
more registers than 3 programs of 4 warps can share in an SM's 65536, so a stage-capped paged plan
in a grid of more than 2 programs per SM is compiled with Triton's maxnreg = 168
(`decode_max_registers`; no spills on sm_90) and 3 programs share an SM, as their shared memory
allows.
What the pipeline does not hide is the scatter itself: with one program per SM (the dense split
rule) a paged request streams markedly slower than a dense one at small batches, so paged caches
split over two programs per SM when the splits stay long enough (DECODE_PAGED_WAVES,
DECODE_PAGED_WAVE_MIN_BLOCKS in kernels/tritonattn/config/tables.py). Paged against dense step time over the H200
grid, its one point above 5% (P = 16 at D = 128, batch 1 x 16384) and the causes ruled out for it:
docs/perf-notes.md, Paged decode.

[Note] Bad block-table entries. A CPU block_table is checked on the host (ValueError for an entry outside [0,
NUM_BLOCKS) among those the call uses). A device one cannot be checked without a sync, so the kernel guards it:
for reads every entry is clamped into [0, NUM_BLOCKS) (wrong results, never a read outside the pool), and an
appended row whose entry lies outside the pool is dropped (-1 fillers, as PagedKVCache keeps, never written).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import (
    LOG2E,
    cache_query,
    finalize,
    gqa_q_head,
    kv_block_offsets,
    kv_descales,
    kv_row_offsets,
    left_padding,
    load_rows,
    merge_partials,
    merge_sink,
    online_softmax,
    physical_blocks,
    quantize_counted,
    score_units,
    store_rows,
    tree_scores,
    variant_scores,
    window_extent,
)


# ============================================================================================
# Kernels
# ============================================================================================
@triton.jit
def new_row_pages(table, seqlen, us, n_write, PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr):
    """Paged: the raw block-table entries of the pages that new rows `us` go to (cache rows seqlen + us),
    -1 for rows at or past n_write. Dense: `us` itself, a placeholder `store_new_rows` never reads."""
    if PAGED:
        return tl.load(table + (seqlen + us) // PAGE_SIZE, mask=us < n_write, other=-1)
    else:
        return us


@triton.jit
def store_new_rows(k_head, v_head, kn, vn, us, raw_pages, seqlen, M, n_write, NUM_BLOCKS, off_b,
                    stride_kb, stride_kn, stride_vb, stride_vn, offs_d,
                    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr,
                    WIDE_PAGES: tl.constexpr):
    """Write new rows kn, vn [BLOCK, D_PAD] (token indices `us`) of one (request, KV head) into its
    cache at rows seqlen + us; rows at or past n_write (they would pass the buffer) are dropped.
    Paged, each row goes to its own page, raw_pages from `new_row_pages` (an append may cross page
    boundaries), and a row whose table entry lies outside the pool is dropped, see [Note] Bad
    block-table entries."""
    dst = seqlen + us  # [BLOCK] cache rows
    if PAGED:
        blocks = tl.minimum(tl.maximum(raw_pages, 0), NUM_BLOCKS - 1)
        us_write = tl.where((raw_pages >= 0) & (raw_pages < NUM_BLOCKS), us, M)  # bad page: row dropped
    else:
        blocks = off_b
        us_write = us
    store_rows(k_head + kv_row_offsets(blocks, dst, stride_kb, stride_kn, PAGE_SIZE, PAGED, WIDE_PAGES)[:, None]
               + offs_d[None, :], kn, us_write, n_write, offs_d, HEAD_DIM, HEAD_DIM_PAD)
    store_rows(v_head + kv_row_offsets(blocks, dst, stride_vb, stride_vn, PAGE_SIZE, PAGED, WIDE_PAGES)[:, None]
               + offs_d[None, :], vn, us_write, n_write, offs_d, HEAD_DIM, HEAD_DIM_PAD)


@triton.jit
def append_kernel(
    K_cache, V_cache, K_new, V_new, Cache_seqlens,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_knb, stride_knm, stride_knh,
    stride_vnb, stride_vnm, stride_vnh,
    H_KV, M, N_CACHE,
    Block_table, stride_btb, NUM_BLOCKS,  # paged only; None (compiled out) for a dense cache
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK: tl.constexpr,
    PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, WIDE_PAGES: tl.constexpr,
    KV_FP8: tl.constexpr = False, K_descale=None, stride_kds=None, stride_kdh=None, V_descale=None, stride_vds=None,
    stride_vdh=None, Saturated=None,
):
    """Append BLOCK of the M new tokens of one (request, KV head) to the cache (chunked prefill's
    first launch; the decode kernel fuses its appends instead, see [Note] Chunked prefill); an FP8
    cache's rows quantized with its descales, the clamped values counted into Saturated when given
    (`quantize_counted`)."""
    pid_u = tl.program_id(0)
    pid_bh = tl.program_id(1)
    off_b = (pid_bh // H_KV).to(tl.int64)
    off_hk = (pid_bh % H_KV).to(tl.int64)
    seqlen = tl.minimum(tl.maximum(tl.load(Cache_seqlens + off_b), 0), N_CACHE)
    n_write = tl.minimum(M, N_CACHE - seqlen)  # new rows that fit in the buffer
    us = pid_u * BLOCK + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    kn = load_rows(K_new + off_b * stride_knb + off_hk * stride_knh + us[:, None].to(tl.int64) * stride_knm
                   + offs_d[None, :], us, M, offs_d, HEAD_DIM, HEAD_DIM_PAD, True)
    vn = load_rows(V_new + off_b * stride_vnb + off_hk * stride_vnh + us[:, None].to(tl.int64) * stride_vnm
                   + offs_d[None, :], us, M, offs_d, HEAD_DIM, HEAD_DIM_PAD, True)
    if KV_FP8:
        k_scale, v_scale = kv_descales(K_descale, V_descale, off_b, off_hk, stride_kds, stride_kdh, stride_vds,
                                       stride_vdh, KV_FP8)
        kn = quantize_counted(kn, k_scale, Saturated, (off_b * H_KV + off_hk) * 2, True)
        vn = quantize_counted(vn, v_scale, Saturated, (off_b * H_KV + off_hk) * 2 + 1, True)
    if PAGED:
        table = Block_table + off_b * stride_btb
    else:
        table = Block_table  # None: never read
    store_new_rows(K_cache + off_hk * stride_kh, V_cache + off_hk * stride_vh, kn, vn, us,
                    new_row_pages(table, seqlen, us, n_write, PAGED, PAGE_SIZE), seqlen, M, n_write,
                    NUM_BLOCKS, off_b, stride_kb, stride_kn, stride_vb, stride_vn, offs_d,
                    HEAD_DIM, HEAD_DIM_PAD, PAGED, PAGE_SIZE, WIDE_PAGES)


@triton.jit(do_not_specialize=["window_left", "window_right"])  # a new window size is not a new kernel
def decode_kernel(
    Q, K_cache, V_cache, K_new, V_new, Cache_seqlens, Out, Lse, Out_part, Lse_part,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_knb, stride_knm, stride_knh,
    stride_vnb, stride_vnm, stride_vnh,
    H_KV, GROUP, M, M_NEW, N_CACHE, SPLIT_N, softmax_scale,
    Block_table, stride_btb, NUM_BLOCKS,  # paged only; None (compiled out) for a dense cache
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_NEW: tl.constexpr,
    IS_CAUSAL: tl.constexpr, APPEND: tl.constexpr, SPLIT: tl.constexpr, STORE_LSE: tl.constexpr,
    PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, WIDE_PAGES: tl.constexpr,
    EARLY_NEW: tl.constexpr, ONE_LOOP: tl.constexpr, USE_PDL: tl.constexpr,
    Cache_leftpad=None, HAS_LEFTPAD: tl.constexpr = False,  # None (compiled out) without left padding
    window_left=-1, window_right=-1, softcap=0.0,  # the variants, see [Note] Variants in decode
    HAS_WINDOW: tl.constexpr = False, HAS_SOFTCAP: tl.constexpr = False, HAS_ALIBI: tl.constexpr = False,
    HAS_SINKS: tl.constexpr = False, Alibi=None, stride_alibi_b=None, Sinks=None,
    HAS_SEQUSED_K: tl.constexpr = False, Seqused_k=None,  # packed sequences only: never on here
    KV_FP8: tl.constexpr = False, K_descale=None, stride_kds=None, stride_kdh=None, V_descale=None, stride_vds=None,
    stride_vdh=None,  # an FP8 cache's descales, see [Note] FP8 KV cache in jit/common.py
    Saturated=None,  # with an FP8 cache and an append: int64 (B, H_KV, 2), the clamped values counted
    HAS_TREE: tl.constexpr = False, Tree=None, Tree_start=None, Tree_n=None,  # a verify step's draft tree
):
    tl.static_assert(not HAS_SEQUSED_K, "seqused_k counts packed keys; a cache has cache_seqlens")
    tl.static_assert(BLOCK_H >= 16 and BLOCK_N >= 16 and BLOCK_NEW >= 16, "tl.dot needs tiles of at least 16")
    if USE_PDL:  # let the combine launch now; it waits for this grid to finish, see [Note] Combine launch
        tl.extra.cuda.gdc_launch_dependents()
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
    k_scale, v_scale = kv_descales(K_descale, V_descale, off_b, off_hk, stride_kds, stride_kdh, stride_vds, stride_vdh,
                                   KV_FP8)  # 1.0 and 1.0 for a 16-bit cache

    # -- query rows: r -> (q head off_hk * G + r // M, token r % M) --------------------------------
    offs_r = pid_rb * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    offs_t = offs_r % M  # [BLOCK_H] token
    offs_h = gqa_q_head(off_hk, GROUP, offs_r // M)  # [BLOCK_H] q head, int64
    offs_n = tl.arange(0, BLOCK_N)  # [BLOCK_N]
    offs_d = tl.arange(0, HEAD_DIM_PAD)  # [D_PAD]

    # -- this request's lengths, read on the device and clamped to the buffer ---------------------
    seqlen = tl.minimum(tl.maximum(tl.load(Cache_seqlens + off_b), 0), N_CACHE)  # L_b
    n_cache = N_CACHE  # buffer rows from the request's first key on
    if HAS_LEFTPAD:  # the keys start at row LP_b: count from there, see [Note] Left padding
        pad = left_padding(Cache_leftpad, off_b, seqlen)  # LP_b
        seqlen -= pad
        n_cache -= pad
    if APPEND:  # M_NEW <= M new keys; the M queries are the last M of the n_total keys' positions
        n_total = seqlen + M_NEW
    else:
        n_total = seqlen
    diag = n_total - M  # token t's diagonal key (its last when causal) is t + diag
    left, right = window_extent(window_left, window_right, M, n_total, IS_CAUSAL, HAS_WINDOW)

    # -- this split's range of cached keys, see [Note] Empty KV splits -----------------------------
    lo = split * SPLIT_N
    if HAS_WINDOW:  # the splits tile the band from its first key block on, see [Note] Variants in decode
        band_lo = tl.maximum(diag - left, 0)  # the first key any row sees; rows before it are never loaded
        lo += band_lo // BLOCK_N * BLOCK_N
    hi = tl.minimum(lo + SPLIT_N, seqlen)
    if HAS_WINDOW:  # nothing right of the last token's band
        hi = tl.minimum(hi, diag + M + right)
    if HAS_TREE:  # the drafts are masked by the tree (tree_scores), the keys before them seen by every row
        free_end = tl.minimum(hi, diag)
    elif IS_CAUSAL or HAS_WINDOW:
        free_end = tl.minimum(hi, diag + right + 1)  # keys every row sees on the right
    else:
        free_end = hi
    if HAS_WINDOW and not ONE_LOOP:  # the band's left edge [lo, edge_end): masked
        edge_end = tl.minimum(tl.maximum(tl.cdiv(tl.maximum(diag + M - 1 - left, 0), BLOCK_N) * BLOCK_N, lo), hi)
    else:
        edge_end = lo
    if ONE_LOOP:  # every block takes the masked loop, see [Note] One loop for short splits
        full_end = lo
    else:
        full_end = edge_end + tl.maximum(free_end - edge_end, 0) // BLOCK_N * BLOCK_N

    if PAGED:  # this request's row of the block table, and the pages of the split's first key block
        table = Block_table + off_b * stride_btb
        # bounded by the capacity, not by L_b: the lookup need not wait for the length's load (rows
        # past L_b get clamped entries and are never loaded); and issued before the query load, whose
        # tile's barrier it would otherwise wait behind, see [Note] Paged pipelining
        next_blocks = physical_blocks(table, lo, lo + offs_n, tl.minimum(lo + SPLIT_N, N_CACHE), NUM_BLOCKS,
                                      PAGE_SIZE, BLOCK_N)
    else:
        table = Block_table  # None: never read
    q_ptrs = Q + off_b * stride_qb + offs_t[:, None].to(tl.int64) * stride_qm + offs_h[:, None] * stride_qh
    q = load_rows(q_ptrs + offs_d[None, :], offs_r, rows_total, offs_d, HEAD_DIM, HEAD_DIM_PAD, True)
    q, q_up = cache_query(q, KV_FP8)  # an FP8 cache: fp16 products, q's scale taken back with K's descale
    unit, cap_scale = score_units(softmax_scale * k_scale * q_up, softcap, HAS_SOFTCAP)
    qk_scale = unit * LOG2E  # scores (in units of `unit`) to base-2 logits
    k_head = K_cache + off_hk * stride_kh
    v_head = V_cache + off_hk * stride_vh
    if HAS_LEFTPAD:  # row 0 of the request is now cache row LP_b (dense, or its one page: cache_batch_idx)
        k_head += pad.to(tl.int64) * stride_kn
        v_head += pad.to(tl.int64) * stride_vn
    if APPEND:  # the new rows' first chunk, loaded now by the last split, see [Note] Fused append
        offs_u = tl.arange(0, BLOCK_NEW)  # [BLOCK_NEW]
        kn_head = K_new + off_b * stride_knb + off_hk * stride_knh
        vn_head = V_new + off_b * stride_vnb + off_hk * stride_vnh
        n_write = tl.minimum(M_NEW, n_cache - seqlen)  # new rows that fit in the buffer
        if EARLY_NEW:
            m_early = tl.where(split == num_splits - 1, M_NEW, 0)  # the other splits load nothing
            kn0 = load_rows(kn_head + offs_u[:, None].to(tl.int64) * stride_knm + offs_d[None, :],
                            offs_u, m_early, offs_d, HEAD_DIM, HEAD_DIM_PAD, True)  # [BLOCK_NEW, D_PAD]
            vn0 = load_rows(vn_head + offs_u[:, None].to(tl.int64) * stride_vnm + offs_d[None, :],
                            offs_u, m_early, offs_d, HEAD_DIM, HEAD_DIM_PAD, True)
            pages0 = new_row_pages(table, seqlen, offs_u, tl.minimum(m_early, n_write), PAGED, PAGE_SIZE)
            if KV_FP8:  # stored and attended over as stored; the storing program counts the clamped values
                stores = (pid_rb == 0) & (split == num_splits - 1)
                kn0 = quantize_counted(kn0, k_scale, Saturated, (off_b * H_KV + off_hk) * 2, stores)
                vn0 = quantize_counted(vn0, v_scale, Saturated, (off_b * H_KV + off_hk) * 2 + 1, stores)

    row_ok = offs_r < rows_total
    if HAS_ALIBI:  # (each row's q head's slope in score units as a column, diag): `alibi_terms`
        alibi = ((tl.load(Alibi + off_b * stride_alibi_b + offs_h, mask=row_ok, other=0.0) / unit)[:, None], diag)
    else:
        alibi = (0.0, diag)
    if HAS_SINKS and not SPLIT:  # the sink starts each row's max and sum; split, the combine adds it
        m_i = tl.load(Sinks + offs_h, mask=row_ok, other=0.0).to(tl.float32) * LOG2E
        l_i = tl.full([BLOCK_H], 1.0, dtype=tl.float32)
    else:
        m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM_PAD], dtype=tl.float32)

    if HAS_WINDOW and not ONE_LOOP:  # stage 0: the band's left edge, masked
        for start_n in tl.range(lo, edge_end, BLOCK_N):
            rows = start_n + offs_n
            if PAGED:
                blocks = next_blocks
                next_blocks = physical_blocks(table, start_n + BLOCK_N, rows + BLOCK_N, hi, NUM_BLOCKS, PAGE_SIZE,
                                               BLOCK_N)
            else:
                blocks = off_b
            k_offs = kv_block_offsets(blocks, start_n, offs_n, stride_kb, stride_kn, PAGE_SIZE, PAGED, WIDE_PAGES,
                                      BLOCK_N)
            in_rows = tl.where(rows >= band_lo, rows, hi)  # rows before the band: not loaded (zeros)
            k = load_rows(k_head + k_offs[:, None] + offs_d[None, :], in_rows, hi, offs_d, HEAD_DIM, HEAD_DIM_PAD,
                          True).to(q.dtype)
            qk = variant_scores(tl.dot(q, tl.trans(k)), offs_t, rows, hi, diag, left, right, cap_scale, alibi, True,
                                IS_CAUSAL, HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI)
            p, m_i, l_i, acc = online_softmax(qk, m_i, l_i, acc, qk_scale, True)
            v_offs = kv_block_offsets(blocks, start_n, offs_n, stride_vb, stride_vn, PAGE_SIZE, PAGED, WIDE_PAGES,
                                      BLOCK_N)
            v = load_rows(v_head + v_offs[:, None] + offs_d[None, :], in_rows, hi, offs_d, HEAD_DIM, HEAD_DIM_PAD,
                          True).to(q.dtype)
            acc = tl.dot(p.to(v.dtype), v, acc)
    if not ONE_LOOP:  # stage 1: whole blocks every row sees, no mask
        for start_n in tl.range(edge_end, full_end, BLOCK_N):
            rows = start_n + offs_n
            if PAGED:  # this block's pages were fetched one iteration ahead, see [Note] Paged pipelining
                blocks = next_blocks
                next_blocks = physical_blocks(table, start_n + BLOCK_N, rows + BLOCK_N, hi, NUM_BLOCKS, PAGE_SIZE,
                                               BLOCK_N)
            else:
                blocks = off_b
            k_offs = kv_block_offsets(blocks, start_n, offs_n, stride_kb, stride_kn, PAGE_SIZE, PAGED, WIDE_PAGES,
                                      BLOCK_N)
            k = load_rows(k_head + k_offs[:, None] + offs_d[None, :], rows, hi, offs_d, HEAD_DIM, HEAD_DIM_PAD,
                          False).to(q.dtype)  # [BLOCK_N, D_PAD], an FP8 tile dequantized (its scale: unit)
            qk = variant_scores(tl.dot(q, tl.trans(k)), offs_t, rows, hi, diag, left, right, cap_scale, alibi, False,
                                IS_CAUSAL, HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI)  # [BLOCK_H, BLOCK_N]
            p, m_i, l_i, acc = online_softmax(qk, m_i, l_i, acc, qk_scale, False)
            v_offs = kv_block_offsets(blocks, start_n, offs_n, stride_vb, stride_vn, PAGE_SIZE, PAGED, WIDE_PAGES,
                                      BLOCK_N)
            v = load_rows(v_head + v_offs[:, None] + offs_d[None, :], rows, hi, offs_d, HEAD_DIM, HEAD_DIM_PAD,
                          False).to(q.dtype)
            acc = tl.dot(p.to(v.dtype), v, acc)
    # stage 2: the ragged tail of the split (and, without an append, the causal band), masked; with
    # ONE_LOOP all of the split's blocks
    for start_n in tl.range(full_end, hi, BLOCK_N):
        rows = start_n + offs_n
        if PAGED:  # this block's pages were fetched one iteration ahead, see [Note] Paged pipelining
            blocks = next_blocks
            next_blocks = physical_blocks(table, start_n + BLOCK_N, rows + BLOCK_N, hi, NUM_BLOCKS, PAGE_SIZE,
                                           BLOCK_N)
        else:
            blocks = off_b
        if HAS_WINDOW and ONE_LOOP:  # this loop starts at the band's first block: rows before it not loaded
            in_rows = tl.where(rows >= band_lo, rows, hi)
        else:
            in_rows = rows
        k_offs = kv_block_offsets(blocks, start_n, offs_n, stride_kb, stride_kn, PAGE_SIZE, PAGED, WIDE_PAGES, BLOCK_N)
        k = load_rows(k_head + k_offs[:, None] + offs_d[None, :], in_rows, hi, offs_d, HEAD_DIM, HEAD_DIM_PAD,
                      True).to(q.dtype)
        qk = variant_scores(tl.dot(q, tl.trans(k)), offs_t, rows, hi, diag, left, right, cap_scale, alibi, True,
                            IS_CAUSAL, HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI)
        qk = tree_scores(qk, offs_t, rows, diag, off_b, Tree, Tree_start, Tree_n, HAS_TREE)
        p, m_i, l_i, acc = online_softmax(qk, m_i, l_i, acc, qk_scale, True)
        v_offs = kv_block_offsets(blocks, start_n, offs_n, stride_vb, stride_vn, PAGE_SIZE, PAGED, WIDE_PAGES, BLOCK_N)
        v = load_rows(v_head + v_offs[:, None] + offs_d[None, :], in_rows, hi, offs_d, HEAD_DIM, HEAD_DIM_PAD,
                      True).to(q.dtype)
        acc = tl.dot(p.to(v.dtype), v, acc)

    # stage 3: the new keys, read from k/v and written to the cache, see [Note] Fused append
    if APPEND:
        if split == num_splits - 1:
            if EARLY_NEW:  # the first chunk, loaded at the start
                qk = variant_scores(tl.dot(q, tl.trans(kn0.to(q.dtype))), offs_t, seqlen + offs_u, n_total, diag, left,
                                    right, cap_scale, alibi, True, IS_CAUSAL, HAS_WINDOW, HAS_SOFTCAP,
                                    HAS_ALIBI)  # [BLOCK_H, BLOCK_NEW]
                qk = tree_scores(qk, offs_t, seqlen + offs_u, diag, off_b, Tree, Tree_start, Tree_n, HAS_TREE)
                p, m_i, l_i, acc = online_softmax(qk, m_i, l_i, acc, qk_scale, True)
                acc = tl.dot(p.to(q.dtype), vn0.to(q.dtype), acc)
                if pid_rb == 0:  # one row block writes the cache
                    store_new_rows(k_head, v_head, kn0, vn0, offs_u, pages0, seqlen, M_NEW, n_write, NUM_BLOCKS, off_b,
                                    stride_kb, stride_kn, stride_vb, stride_vn, offs_d,
                                    HEAD_DIM, HEAD_DIM_PAD, PAGED, PAGE_SIZE, WIDE_PAGES)
            for start_u in tl.range(BLOCK_NEW if EARLY_NEW else 0, M_NEW, BLOCK_NEW):
                us = start_u + offs_u
                kn = load_rows(kn_head + us[:, None].to(tl.int64) * stride_knm + offs_d[None, :],
                               us, M_NEW, offs_d, HEAD_DIM, HEAD_DIM_PAD, True)  # [BLOCK_NEW, D_PAD]
                if KV_FP8:  # stored and attended over as stored
                    kn = quantize_counted(kn, k_scale, Saturated, (off_b * H_KV + off_hk) * 2, pid_rb == 0)
                qk = variant_scores(tl.dot(q, tl.trans(kn.to(q.dtype))), offs_t, seqlen + us, n_total, diag, left,
                                    right, cap_scale, alibi, True, IS_CAUSAL, HAS_WINDOW, HAS_SOFTCAP,
                                    HAS_ALIBI)  # [BLOCK_H, BLOCK_NEW]
                qk = tree_scores(qk, offs_t, seqlen + us, diag, off_b, Tree, Tree_start, Tree_n, HAS_TREE)
                p, m_i, l_i, acc = online_softmax(qk, m_i, l_i, acc, qk_scale, True)
                vn = load_rows(vn_head + us[:, None].to(tl.int64) * stride_vnm + offs_d[None, :],
                               us, M_NEW, offs_d, HEAD_DIM, HEAD_DIM_PAD, True)
                if KV_FP8:
                    vn = quantize_counted(vn, v_scale, Saturated, (off_b * H_KV + off_hk) * 2 + 1, pid_rb == 0)
                acc = tl.dot(p.to(q.dtype), vn.to(q.dtype), acc)
                if pid_rb == 0:  # one row block writes the cache
                    pages = new_row_pages(table, seqlen, us, n_write, PAGED, PAGE_SIZE)
                    store_new_rows(k_head, v_head, kn, vn, us, pages, seqlen, M_NEW, n_write, NUM_BLOCKS, off_b,
                                    stride_kb, stride_kn, stride_vb, stride_vn, offs_d,
                                    HEAD_DIM, HEAD_DIM_PAD, PAGED, PAGE_SIZE, WIDE_PAGES)

    # -- epilogue --------------------------------------------------------------------------------
    out, lse = finalize(acc, m_i, l_i)  # empty rows: 0 and +inf (with a sink: 0 and the sink)
    if KV_FP8:  # V's descale, see [Note] FP8 KV cache in jit/common.py
        out = out * v_scale
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
def combine_kernel(
    Out_part, Lse_part, Out, Lse,
    H, M, NUM_SPLITS,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr, STORE_LSE: tl.constexpr,
    USE_PDL: tl.constexpr, Sinks=None, HAS_SINKS: tl.constexpr = False,
):
    # -- one query row (b, h, t), in the (B, H, M) order of Lse and of the scratch -----------------
    row = tl.program_id(0).to(tl.int64)
    off_b = row // (H * M)
    off_h = (row // M) % H
    off_t = row % M
    offs_s = tl.arange(0, SPLITS_PAD)  # [SPLITS_PAD]
    offs_d = tl.arange(0, HEAD_DIM_PAD)  # [D_PAD]
    if USE_PDL:  # launched early: wait until the decode grid has finished and its writes are visible
        tl.extra.cuda.gdc_wait()

    lse_parts = tl.load(Lse_part + row * NUM_SPLITS + offs_s, mask=offs_s < NUM_SPLITS, other=float("-inf"))
    # Empty splits' outputs are not read. Every split does write its partial (zeros for an empty one), so
    # the outputs could be loaded together with the LSEs, but then ptxas spreads those loads among the
    # merge's arithmetic, one round trip after another, a slower step (docs/perf-notes.md, Decode, "What
    # remains of a batch 1 x 16384 step"). Masked by the LSEs, they all issue at once when the LSEs land.
    nonempty = lse_parts != float("-inf")
    o_parts = tl.load(Out_part + (row * NUM_SPLITS + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
                      mask=nonempty[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)  # [SPLITS_PAD, D_PAD]
    out, lse = merge_partials(o_parts, lse_parts)
    if HAS_SINKS:  # added once, here: no partial carries it
        out, lse = merge_sink(out, lse, tl.load(Sinks + off_h).to(tl.float32))
    tl.store(Out + ((off_b * M + off_t) * H + off_h) * HEAD_DIM + offs_d, out.to(Out.dtype.element_ty),
             mask=offs_d < HEAD_DIM)
    if STORE_LSE:
        tl.store(Lse + row, lse)
