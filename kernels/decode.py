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
  kernels/_common.py). With one split the decode kernel writes the final output directly.
- Paged caches (PagedAttention, Woosuk Kwon et al., 2023; vLLM and flash-attn's block_table): the
  cache is a pool of fixed-size pages and a block table maps each request's logical pages to
  physical blocks; the same kernel reads it behind the constexpr PAGED (see [Note] Paged caches).
The streaming softmax and the masks are the prefill kernel's (`online_softmax`, `mask_scores`,
`finalize`), so prefill and decode cannot drift apart.

Notation:
    B batch, H q heads, H_KV KV heads, G = H // H_KV, M = seqlen_q (new tokens), D = head dim,
    D_PAD = next power of two >= D, N_CACHE = a request's capacity (dense: the allocated
    seqlen_cache; paged: max_blocks_per_seq * P), L_b = cache_seqlens[b], N_b = L_b + M keys seen
    when appending (L_b without k/v). Paged: P = page_size, NUM_BLOCKS = blocks in the pool,
    Block_table (B, max_blocks_per_seq) int32.
    A program's query rows are r = g * M + t for g in [0, G) (q head h = kv_head * G + g) and t in
    [0, M) (the token), head-major; BLOCK_H >= 16 rows per program, several row blocks when G * M
    exceeds the config's max_rows.
    m_i running max (base 2) [BLOCK_H], l_i running sum [BLOCK_H], acc [BLOCK_H, D_PAD] fp32.

Supported: fp16/bf16 (fp32 accumulation), fp32; head dims that are multiples of 8 in [16, 256];
any seqlen_q >= 1; MHA/GQA/MQA; dense caches with any strides and a contiguous last dim (including
a (B, H_KV, S, D) buffer seen through .transpose(1, 2)); paged pools (NUM_BLOCKS, P, H_KV, D) with
any strides and a contiguous last dim (including a (NUM_BLOCKS, H_KV, P, D) pool seen through
.transpose(1, 2)) and any page size P >= 1 (tested: 1, 2, 8, 16, 48, 64, 256); caches beyond 2^31
elements (int64 offsets). Not supported (yet): cache_batch_idx, rotary embedding, alibi, sliding
windows, softcapping. All K/V row addresses go through `kv_row_offsets` (kernels/_common.py).

[Note] Fused append without hazards. The new keys/values are read from the k/v inputs, not from
the cache, by the program that owns them (the last split of each (request, KV head), first row
block), which also writes them into the cache. Every other program reads only cache rows [0, L_b),
so no program reads a row another program writes in the same launch. Paged, each new row looks up
its own page, so an append crossing page boundaries writes each row to its own page slot; requests
may share pages they only read (prefix sharing), but a page appended into must be one request's.
The last split streams its share of the cached keys like every other split, then the new rows, so
it ends last; loading those rows only then (and, paged, their table entries) would add a memory
round trip or two at the end of the grid. With EARLY_NEW (dense caches and pools whose pages hold
whole key blocks, P % BLOCK_N == 0: `_early_new`) it loads the first BLOCK_NEW new rows and their
page entries at its start, under the cached keys' loads (the other splits' loads of them are fully
masked). Measured on an H200 (bf16, 32:8 heads, D = 128, one new token, CUDA-graph replay;
results/nvidia-h200/decode_ab_stop13.log, run 1): dense batch 1 x 16384 23.8 -> 22.7 us, 1 x 65536
69.8 -> 66.7, 8 x 4096 39.4 -> 37.8, 128 x 1024 137.8 -> 133.5; P = 64 and 256 from 0.2 us slower
(batch 1 x 65536) to 5.7 us faster (128 x 1024). Pools that gather a key block from several pages
(P = 16, 48) load early only when split: unsplit, the early tiles' registers (157 -> 240 per
thread) cost more than the round trip (run 3 of that log). The cost on sm_90: 168 registers
instead of 144 for the dense kernel with an append, 4 KB more shared memory.

[Note] One loop for short splits. A split streams its whole blocks through an unmasked loop, then
its ragged tail (the last cached keys when L_b is not a multiple of BLOCK_N, and without an append
the causal band) through a masked one. The pipeliner fills each loop's pipeline on its own, so the
tail's tiles are requested only when the first loop is done: one memory round trip per program that
no other work hides when the splits are short and there is one program per SM. With ONE_LOOP
(`_one_loop`: splits of at most DECODE_ONE_LOOP_MAX_BLOCKS blocks, kernels/_configs.py) every block
takes the masked loop, so the tail comes through the same pipeline; the masks cost a little per
block, which long splits pay more often than the round trip they save. Measured on an H200 (bf16,
32:8 heads, D = 128, one new token, L_b = n - 1, CUDA-graph replay;
results/nvidia-h200/decode_ab_stop14.log): dense batch 1 x 4096 11.7 -> 10.7 us, 1 x 16384 22.7 ->
22.1, 128 x 1024 132.6 -> 129.9; P = 64 batch 1 x 4096 12.2 -> 10.6, 1 x 16384 24.3 -> 22.8; but
dense batch 1 x 65536 (64 blocks per split) 66.6 -> 67.4, so long splits keep the two loops.

[Note] Empty KV splits. The split size is a fixed multiple of BLOCK_N computed from the allocated
N_CACHE and num_splits, never from the current lengths (they live on the device). A split
whose range starts at or past L_b runs no loop iteration and writes an empty partial (lse = -inf,
weight 0 in the merge). A request whose splits are all empty (L_b = 0, no append) outputs zeros and
LSE = +inf.

[Note] Causal with seqlen_q > 1. Bottom-right aligned over the N_b keys: token t sees key j iff
j <= t + N_b - M. With an append every cached key is visible to every token and only the new keys
are masked (token t sees new keys 0..t); without one, the last M - 1 cached keys are masked per row.

[Note] Host overhead. A decode step is a few microseconds of GPU time, so the wrapper caches all it
can. The full path: the validation of a call's tensors per signature (shapes, strides, dtypes,
devices: `_signature`; values and pointers are still checked every call), the launch plan per shape
(`_plan`), the int -> tensor conversion of cache_seqlens, and the compiled kernels, launched through
their C launchers without Triton's per-call dispatch (`LaunchCache`, kernels/_launch.py, keyed by
the signature, the plan, the flags and the inputs' 16-byte alignment: what Triton specialises on). A
call that repeats a validated one -- same signature, cache_seqlens (and block_table) already on the
GPU with the same layout, the same scale, flags and num_splits -- replays it (`_Replay`): the
recorded argument lists of its decode and combine launches get this call's pointers and go straight
to the C launchers; a pointer that is not 16-byte aligned (the kernels were compiled for aligned
ones), another current device or installed launch hooks send the call down the full path instead.
Lengths given as an int or on the CPU are checked on the host every call, so those calls are never
replayed. What a replay still does: the signature, the output allocation, the two launches. The
split scratch (partial outputs and their LSEs) is one fp32 buffer per (device, stream, thread),
reused by that thread's next call on that stream (stream order makes that safe), allocated afresh
while a CUDA graph is captured and for every call above 64 MiB. Measured on an H200 (batch 1 x 4096,
append, device lengths, median CPU time of an eager call without syncs): 20-22 us replayed against
38 us on the full path and 26 us for SDPA in the same run
(results/nvidia-h200/decode_replay_pdl_paged_ab.log).

[Note] Combine launch. With a split, the combine kernel is launched with programmatic dependent
launch on Hopper and newer (`decode_use_pdl`, kernels/_configs.py): every decode program signals at
its start that dependents may launch (`gdc_launch_dependents`), so once all of them run the combine
grid is launched too, and its programs wait in `gdc_wait` until the decode grid has finished and its
writes are visible. The combine's launch latency overlaps the decode grid: 0.5-1.2 us per step at
batch 1-8 on an H200 (e.g. batch 1 x 16384: 24.7 -> 24.1 us). Without PDL (sm_89, the interpreter,
KERNELS_PDL=0 at import) both instructions are compiled out and the launches are ordinary ones.

[Note] Chunked prefill. A call with many new tokens per request (seqlen_q >= 128, num_splits=0)
is a chunk of a long prompt: each chunk's queries attend to the request's cache plus the chunk,
bottom-right causal. The decode kernel would serve it (its row blocks tile the G * M query rows),
but it streams the whole cache once per row block of at most 64 rows: at M = 2048 and G = 4 that
is 128 passes over the cache with small tiles. Instead the call runs the prefill kernel family:
`_append_kernel` writes the chunk's k/v into the cache (dense or paged, exactly as the decode
kernel's fused append does, through `_store_new_rows`), then prefill's `_fwd_kernel` in its cache
mode (IS_KVCACHE, see kernels/prefill.py) attends over each request's min(L_b + M, N_CACHE) keys,
read from the cache: BLOCK_M x BLOCK_N tiles on tensor cores, tensor-descriptor loads on Hopper
for dense caches and for pools whose page size is a multiple of BLOCK_N. Two launches, both free of
host syncs, so a chunk step can be captured in a CUDA graph too. When (`_chunked_prefill_pays`):
at least 128 new tokens, below which the decode kernel's GQA read-once wins, and a prefill grid
(query blocks x batch x heads) of at least 0.8 x the SM count, since the prefill kernel does not
split the keys and a small grid leaves SMs idle where the decode kernel splits. Measured on an H200
(scripts/tune_decode.py; results/nvidia-h200/tune_decode.csv, rows chunked_*: append + causal over
4096 cached keys, 32:8 heads, D = 128, CUDA-graph replay; decode kernel / prefill path): batch 1,
256 new tokens (64 programs) 61 / 98 us, 512 tokens (128 programs) 125 / 104 us; batch 8, 64
tokens 111 / 152 us, 128 tokens 218 / 158 us.

[Note] Lengths on the device. cache_seqlens is read by the kernel, clamped to [0, N_CACHE]: a bad
device length can give wrong results but never a read or write outside the buffers; appends past
N_CACHE are dropped. Lengths known on the host (an int, a CPU tensor, KVCache, PagedKVCache) are
checked before launch and overflow raises ValueError.

[Note] Paged caches. Logical key j of request b lives in row j % P of physical block
Block_table[b, j // P]; `kv_row_offsets` / `kv_block_offsets` (kernels/_common.py) turn (block,
row) into an int64 offset with the pool's block and row strides, so pool views with any strides
work (see [Note] Paged address arithmetic). Paging is a constexpr: with PAGED=False the paging arguments are
passed as None (Triton makes them constexprs) and every paged branch is compiled out, so the dense
kernel is the very code it was before paging existed (its TTGIR and PTX for sm_90 were compared
identical, line info aside). The grid, the splits and the heuristic see a paged request as a dense
one of N_CACHE = max_blocks_per_seq * P keys.

[Note] BLOCK_N vs page size. A key block of BLOCK_N rows may span several pages (P < BLOCK_N) or a
page several key blocks (P >= BLOCK_N). Rather than tie BLOCK_N to P (48 would force BLOCK_N = 16,
P = 8 a block of 8 rows, too small for `tl.dot`, and a decode tuned at BLOCK_N = 64 would lose its
tuning), the kernel keeps the dense BLOCK_N and finds each key's physical row (`physical_blocks`):
- P % BLOCK_N == 0 (e.g. 64 and 256 at BLOCK_N 64): key blocks start at multiples of BLOCK_N
  (splits are whole blocks), so a block lies in one page: one table entry per block, a scalar load.
- BLOCK_N % P == 0 with at most 4 pages per block (P = 16 and 32 at BLOCK_N 64; 32 and 64 at
  BLOCK_N 128): one entry per page, broadcast over the page's rows (`tl.reshape` of a [pages, P]
  broadcast). Per-key entries (below) would cost each thread a table load per row it holds (8 at
  D = 128, twice since the K and the V tile each re-derive them) where this costs one per page: on
  sm_90, P = 16 went from 241 to 192 registers and from 16 to 4 table loads per thread in the loop,
  and on an H200 (bf16, 32:8 heads, append, CUDA-graph replay; results/nvidia-h200/
  decode_ab_stop14.log, run 4) P = 16 at D = 128 took 11.3 against 12.0 us at batch 1 x 4096, 14.6
  against 15.5 at 8 x 1024 and 128.4 against 132.8 at 32 x 4096, faster at every shape, and P = 64
  at D = 64 (2 pages per block) 0.5-0.9 us less at batch 1-8. With 8 pages per block (P = 16 at
  D = 64) it was slower at 6 of 11 shapes, and again (decode_ab_stop16.log, run 2) 1-3% faster at
  batch 1 x 1024-4096 and 8 x 1024 but up to 4.5% slower elsewhere, so more pages per block keep the
  per-key gather; an unsplit deep grid instead halves BLOCK_N to 4 pages (decode_paged_tiles).
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
computed in 32 bits: the int64 multiplies and adds per row were most of the loop's integer work
(offline sm_90, split, append, one loop: 618 instructions per iteration for P = 16 at D = 64 against
428 dense, 316 of them integer address arithmetic). `kv_block_offsets` also writes the in-page row
from the key block's alignment (start_n is a multiple of BLOCK_N): start_n % P + offs_n when a page
holds whole blocks, offs_n % P, the same for every block, when a block holds whole pages. The loop
body went to 453 instructions at P = 16 / D = 64, 407 at P = 64 / D = 64 and 401-412 at D = 128.
Interleaved on an H200 (results/nvidia-h200/decode_ab_stop17.log, runs 1-2) P = 16 at D = 64 went
from 1.07-1.10 of dense to 1.00-1.05 at batch 1 / 8 / 32 x 1024-4096, and P = 64 / 256 gained up to
5.5% at split shapes. Not kept: hoisting the rest of the offset out of the loop too (the
page-holds-blocks case as a scalar plus a loop-invariant vector, and the same for the dense path):
fewer instructions (dense D = 128: 389 -> 334) but 1-11% slower at D = 128 split shapes (dense batch
1 x 16384: 24.6 against 22.1 us). The same change left the unsplit 3-stage kernel at 178-186 registers
(as compiled on the device, with seqlen_q = 1 a constexpr), 2 programs per SM instead of the 3 its
shared memory allows (the earlier kernel's registers on the device were not read; its 0.84 of dense at
batch 40 x 4096 fits 3 per SM): P = 64 at D = 64, batch 128 x 1024 went from 1.006 to 1.051 of dense,
and off the grid, batch 40 / 48 x 4096 at D = 128, P = 16 from 0.84 / 0.92 to 1.12 / 1.05. The register
cap of `decode_max_registers` (kernels/_configs.py, see [Note] Paged pipelining) took them back to 1.009
and 0.86 / 0.91 (results/nvidia-h200/decode_ab_stop18.log, run 3). A
pool whose page rows lie 2^31 / (P - 1) elements apart or more (a permuted (P, num_blocks, ...)
buffer) would overflow the 32-bit in-page offset; the host sees it from the strides (`wide_pages`)
and compiles such calls with WIDE_PAGES, 64-bit in-page offsets.

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
(Fetching two blocks ahead instead, through two loop-carried values, made the pipeliner give up:
the tiles became plain loads. The natural form, the lookup in its own tile's iteration, at 5 or 7
stages, lets the pipeliner stage the table entries too, by cp.async two iterations before their
tiles, but was slower at 27 of 30 shape / page-size points on an H200, by up to 2.5 us:
results/nvidia-h200/decode_ab_stop13.log, run 2.)
The split's first lookup is bounded by the capacity N_CACHE rather than by L_b, so it can be issued
with the length's load instead of after it (entries past the request's pages are clamped and never
used; on its own this measured no change at P = 64 / 256). It also comes before the query load in
the source: the query tile reaches the dot's layout through shared memory, behind a barrier that
waits for the tile to arrive, and ptxas keeps later loads after that barrier (sm_90 SASS), so a
lookup placed after the query load was issued one memory round trip late. Interleaved on an H200
(decode_ab_stop15.log, run 1) the move made P = 16 0.1-0.6 us faster at 6 of 11 shapes (batch 1 x
1024 7.23 -> 7.11 us, 1 x 65536 68.55 -> 68.16, 128 x 1024 133.0 -> 132.4; 0.3% slower at 32 / 128 x
4096) and moved P = 64 / 256 by less than 0.2 us at most shapes; issuing the last split's early
new-row loads before the query too gained nothing more.
Paged caches run at most DECODE_PAGED_STAGES = 3 pipeline stages, against the dense config's 4,
which measured faster at almost every split or one-wave shape (kernels/_configs.py); an unsplit grid
of more programs than the 3-stage kernel fits at once (3 per SM) keeps the config's stages, and
halves a BLOCK_N that would gather 8 pages (P = 16 at D <= 64), see decode_paged_tiles. Offline
sm_90 compiles (bf16, D = 128, the Hopper config, split, causal, with an append; cuobjdump
-res-usage; before the 32-bit in-page offsets of 2f0d92a) show no spills: the dense kernel uses 168
registers with two loops and 184 with ONE_LOOP (109 without an append) and 106 KB of shared memory
for its 4 stages, the paged kernel 242-243 with two loops (P = 16 / 64, the early append) and
192 / 243 with ONE_LOOP, and 74 KB for its 3. Those compiles passed seqlen_q as a plain integer;
Triton specialises the 1 of a decode step to a constant, and so compiled on the device the unsplit
3-stage paged kernel of 2f0d92a takes 178-186 registers (D = 64 / 128, one new token; 70-75 KB), too
many for 3 programs of 4 warps in an SM's 65536 registers. So a stage-capped paged plan in a grid of
more than 2 programs per SM is compiled with Triton's maxnreg = 168 (`decode_max_registers`; no
spills on sm_90) and 3 programs share an SM, as their shared memory allows.
What the pipeline does not hide is the scatter itself: with one program
per SM (the dense split rule) a paged request streamed 8-21% slower than a dense one at batch 1-8
(P = 16: 621 against 497 us at batch 8 x 65536), so paged caches split over two programs per SM when
the splits stay long enough (DECODE_PAGED_WAVES, DECODE_PAGED_WAVE_MIN_BLOCKS in
kernels/_configs.py). Timed on an H200 (bf16, 32:8 heads, random block tables) in the 219a0ab grid
(results/nvidia-h200/bench_decode.csv, 16 shapes of batch 1-128 x 1024-65536 per head dim),
paged / dense was at most 1.029 for P = 64 and 1.028 for P = 256 at D = 128, 1.041 and 1.032 at
D = 64; P = 16 at most 1.046 at D = 64 and, at D = 128, 1.054 at batch 1 x 16384, the one point above 1.05 (1.066 /
1.063 in the 8aeb96e / c1c3755 grids): not occupancy (its split grid needs 2 programs per SM). A sorted block table
ran it at 1.040 (the pages' scatter); the rest is not the 4-page gather: on one sorted pool the P = 64 addressing
inside this kernel ran 23.52 against 22.95 us; L1 prefetches of the table, 16-byte lookups and BLOCK_N 32 gained
nothing; the point measures 1.044-1.065 from process to process (decode_ab_stop18.log, run 2;
decode_ab_stop19.log). On the very same pool (sorted) the P = 64 kernel, reading it as 64-row pages, runs
1.004-1.010 of dense against 1.037-1.043: the cost is this kernel's code, not memory; per-key or scalar lookups,
loop-variant in-page rows, packed KV heads and 4 page tiles per key block were no faster with an append
(decode_ab_stop21.log), and TMA page tiles (tensor descriptors) were slower at every shape (for P = 64 at 11 of 12;
decode_ab_stop22.log). Earlier grids' dense batch 1 x 1024 was
the process's first CUDA-graph timing, which reads ~0.35 us fast (decode_ab_stop15.log, runs 2-3; now discarded).

[Note] Bad block-table entries. A CPU block_table is checked on the host (ValueError for an entry
outside [0, NUM_BLOCKS) among those the call uses). A device block_table cannot be checked without
a sync, so the kernel guards it: for reads every entry is clamped into [0, NUM_BLOCKS) (a bad entry
gives wrong results, never a read outside the pool), and an appended row whose entry lies outside
the pool is dropped (never a write outside it, and -1 fillers past a request's pages, as
PagedKVCache keeps, are never written through).
"""

from __future__ import annotations

import contextlib
import functools
import math
import numbers
import threading
from typing import NamedTuple, Optional, Sequence, Tuple, Union

import numpy as np
import torch
import triton
import triton.language as tl

from ._common import (
    finalize,
    kv_block_offsets,
    kv_row_offsets,
    load_rows,
    mask_scores,
    merge_partials,
    online_softmax,
    physical_blocks,
    store_rows,
    wide_pages,
)
from ._configs import (
    DECODE_ONE_LOOP_MAX_BLOCKS,
    DECODE_ONE_LOOP_MAX_BLOCKS_GATHER,
    decode_config,
    decode_max_registers,
    decode_num_splits,
    decode_paged_tiles,
    decode_use_pdl,
    planning_sm_count,
    prefill_fwd_config,
)
from ._launch import DirectLaunch, LaunchCache, launch_hooks_active
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
from .prefill import _flash_attn_kvcache_forward

LOG2E = math.log2(math.e)
# With num_splits=0, flash_attn_with_kvcache runs the prefill kernel family instead of the decode
# kernel from this many new tokens per request on, when the prefill grid also fills this fraction of
# the SMs (`_chunked_prefill_pays`, see [Note] Chunked prefill).
CHUNKED_PREFILL_MIN_SEQLEN_Q = 128
CHUNKED_PREFILL_MIN_WAVE = 0.8


# ============================================================================================
# Kernels
# ============================================================================================
@triton.jit
def _new_row_pages(table, seqlen, us, n_write, PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr):
    """Paged: the raw block-table entries of the pages that new rows `us` go to (cache rows seqlen + us),
    -1 for rows at or past n_write. Dense: `us` itself, a placeholder `_store_new_rows` never reads."""
    if PAGED:
        return tl.load(table + (seqlen + us) // PAGE_SIZE, mask=us < n_write, other=-1)
    else:
        return us


@triton.jit
def _store_new_rows(k_head, v_head, kn, vn, us, raw_pages, seqlen, M, n_write, NUM_BLOCKS, off_b,
                    stride_kb, stride_kn, stride_vb, stride_vn, offs_d,
                    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr,
                    WIDE_PAGES: tl.constexpr):
    """Write new rows kn, vn [BLOCK, D_PAD] (token indices `us`) of one (request, KV head) into its
    cache at rows seqlen + us; rows at or past n_write (they would pass the buffer) are dropped.
    Paged, each row goes to its own page, raw_pages from `_new_row_pages` (an append may cross page
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
def _append_kernel(
    K_cache, V_cache, K_new, V_new, Cache_seqlens,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_knb, stride_knm, stride_knh,
    stride_vnb, stride_vnm, stride_vnh,
    H_KV, M, N_CACHE,
    Block_table, stride_btb, NUM_BLOCKS,  # paged only; None (compiled out) for a dense cache
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK: tl.constexpr,
    PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, WIDE_PAGES: tl.constexpr,
):
    """Append BLOCK of the M new tokens of one (request, KV head) to the cache (chunked prefill's
    first launch; the decode kernel fuses its appends instead, see [Note] Chunked prefill)."""
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
    if PAGED:
        table = Block_table + off_b * stride_btb
    else:
        table = Block_table  # None: never read
    _store_new_rows(K_cache + off_hk * stride_kh, V_cache + off_hk * stride_vh, kn, vn, us,
                    _new_row_pages(table, seqlen, us, n_write, PAGED, PAGE_SIZE), seqlen, M, n_write,
                    NUM_BLOCKS, off_b, stride_kb, stride_kn, stride_vb, stride_vn, offs_d,
                    HEAD_DIM, HEAD_DIM_PAD, PAGED, PAGE_SIZE, WIDE_PAGES)


@triton.jit
def _decode_kernel(
    Q, K_cache, V_cache, K_new, V_new, Cache_seqlens, Out, Lse, Out_part, Lse_part,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_knb, stride_knm, stride_knh,
    stride_vnb, stride_vnm, stride_vnh,
    H_KV, GROUP, M, N_CACHE, SPLIT_N, qk_scale,
    Block_table, stride_btb, NUM_BLOCKS,  # paged only; None (compiled out) for a dense cache
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_NEW: tl.constexpr,
    IS_CAUSAL: tl.constexpr, APPEND: tl.constexpr, SPLIT: tl.constexpr, STORE_LSE: tl.constexpr,
    PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, WIDE_PAGES: tl.constexpr,
    EARLY_NEW: tl.constexpr, ONE_LOOP: tl.constexpr, USE_PDL: tl.constexpr,
):
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
    if ONE_LOOP:  # every block takes the masked loop, see [Note] One loop for short splits
        full_end = lo
    else:
        full_end = lo + tl.maximum(free_end - lo, 0) // BLOCK_N * BLOCK_N

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
    k_head = K_cache + off_hk * stride_kh
    v_head = V_cache + off_hk * stride_vh
    if APPEND:  # the new rows' first chunk, loaded now by the last split, see [Note] Fused append
        offs_u = tl.arange(0, BLOCK_NEW)  # [BLOCK_NEW]
        kn_head = K_new + off_b * stride_knb + off_hk * stride_knh
        vn_head = V_new + off_b * stride_vnb + off_hk * stride_vnh
        n_write = tl.minimum(M, N_CACHE - seqlen)  # new rows that fit in the buffer
        if EARLY_NEW:
            m_early = tl.where(split == num_splits - 1, M, 0)  # the other splits load nothing
            kn0 = load_rows(kn_head + offs_u[:, None].to(tl.int64) * stride_knm + offs_d[None, :],
                            offs_u, m_early, offs_d, HEAD_DIM, HEAD_DIM_PAD, True)  # [BLOCK_NEW, D_PAD]
            vn0 = load_rows(vn_head + offs_u[:, None].to(tl.int64) * stride_vnm + offs_d[None, :],
                            offs_u, m_early, offs_d, HEAD_DIM, HEAD_DIM_PAD, True)
            pages0 = _new_row_pages(table, seqlen, offs_u, tl.minimum(m_early, n_write), PAGED, PAGE_SIZE)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM_PAD], dtype=tl.float32)

    if not ONE_LOOP:  # stage 1: whole blocks every row sees, no mask
        for start_n in tl.range(lo, full_end, BLOCK_N):
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
                          False)  # [BLOCK_N, D_PAD]
            qk = tl.dot(q, tl.trans(k))  # [BLOCK_H, BLOCK_N]
            p, m_i, l_i, acc = online_softmax(qk, m_i, l_i, acc, qk_scale, False)
            v_offs = kv_block_offsets(blocks, start_n, offs_n, stride_vb, stride_vn, PAGE_SIZE, PAGED, WIDE_PAGES,
                                      BLOCK_N)
            v = load_rows(v_head + v_offs[:, None] + offs_d[None, :], rows, hi, offs_d, HEAD_DIM, HEAD_DIM_PAD, False)
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
        k_offs = kv_block_offsets(blocks, start_n, offs_n, stride_kb, stride_kn, PAGE_SIZE, PAGED, WIDE_PAGES, BLOCK_N)
        k = load_rows(k_head + k_offs[:, None] + offs_d[None, :], rows, hi, offs_d, HEAD_DIM, HEAD_DIM_PAD, True)
        qk = tl.dot(q, tl.trans(k))
        qk = mask_scores(qk, rows, hi, row_limit, IS_CAUSAL)
        p, m_i, l_i, acc = online_softmax(qk, m_i, l_i, acc, qk_scale, True)
        v_offs = kv_block_offsets(blocks, start_n, offs_n, stride_vb, stride_vn, PAGE_SIZE, PAGED, WIDE_PAGES, BLOCK_N)
        v = load_rows(v_head + v_offs[:, None] + offs_d[None, :], rows, hi, offs_d, HEAD_DIM, HEAD_DIM_PAD, True)
        acc = tl.dot(p.to(v.dtype), v, acc)

    # stage 3: the new keys, read from k/v and written to the cache, see [Note] Fused append
    if APPEND:
        if split == num_splits - 1:
            if EARLY_NEW:  # the first chunk, loaded at the start
                qk = tl.dot(q, tl.trans(kn0))  # [BLOCK_H, BLOCK_NEW]
                qk = mask_scores(qk, seqlen + offs_u, n_total, row_limit, IS_CAUSAL)
                p, m_i, l_i, acc = online_softmax(qk, m_i, l_i, acc, qk_scale, True)
                acc = tl.dot(p.to(vn0.dtype), vn0, acc)
                if pid_rb == 0:  # one row block writes the cache
                    _store_new_rows(k_head, v_head, kn0, vn0, offs_u, pages0, seqlen, M, n_write, NUM_BLOCKS, off_b,
                                    stride_kb, stride_kn, stride_vb, stride_vn, offs_d,
                                    HEAD_DIM, HEAD_DIM_PAD, PAGED, PAGE_SIZE, WIDE_PAGES)
            for start_u in tl.range(BLOCK_NEW if EARLY_NEW else 0, M, BLOCK_NEW):
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
                    pages = _new_row_pages(table, seqlen, us, n_write, PAGED, PAGE_SIZE)
                    _store_new_rows(k_head, v_head, kn, vn, us, pages, seqlen, M, n_write, NUM_BLOCKS, off_b,
                                    stride_kb, stride_kn, stride_vb, stride_vn, offs_d,
                                    HEAD_DIM, HEAD_DIM_PAD, PAGED, PAGE_SIZE, WIDE_PAGES)

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
    USE_PDL: tl.constexpr,
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
    # merge's arithmetic, one round trip after another: 1.4-2.2 us more per step at batch 1 on an H200
    # (16 splits; results/nvidia-h200/decode_ab_stop12.log, run 1). Masked by the LSEs, they all issue
    # at once when the LSEs land.
    nonempty = lse_parts != float("-inf")
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
_launch_decode = LaunchCache(_decode_kernel)
_launch_combine = LaunchCache(_combine_kernel)


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
    pdl: bool  # the combine launch overlaps the decode grid (programmatic dependent launch, sm_90+)
    max_registers: Optional[int]  # the decode kernel's register cap (Triton's maxnreg), None for none


@functools.lru_cache(maxsize=512)
def _plan(batch: int, seqlen_q: int, nheads: int, nheads_k: int, head_dim: int, seqlen_cache: int,
          dtype: torch.dtype, device: torch.device, num_splits: int, page_size: int = 0) -> _Plan:
    """The launch plan; page_size 0 for a dense cache, else the pool's page size (seqlen_cache is then
    a request's capacity, max_blocks_per_seq * page_size)."""
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    config = decode_config(head_dim_pad, dtype, device)
    block_n, num_stages = config.block_n, config.num_stages
    rows = (nheads // nheads_k) * seqlen_q
    block_h = min(max(16, triton.next_power_of_2(rows)), max(16, config.max_rows))
    row_blocks = triton.cdiv(rows, block_h)
    programs = batch * nheads_k * row_blocks
    if num_splits == 0:
        num_splits = decode_num_splits(programs, seqlen_cache, block_n, device, page_size > 0)
    if page_size:  # see [Note] Paged pipelining; an unsplit grid may change BLOCK_N here, never the splits
        block_n, num_stages = decode_paged_tiles(config, page_size, programs, num_splits, seqlen_cache, device)
    blocks_total = triton.cdiv(seqlen_cache, block_n)
    num_splits = max(1, min(num_splits, blocks_total))  # more splits than blocks would all be empty
    blocks_per_split = triton.cdiv(max(blocks_total, 1), num_splits)
    num_splits = triton.cdiv(max(blocks_total, 1), blocks_per_split)
    block_new = min(block_n, max(16, triton.next_power_of_2(seqlen_q)))
    return _Plan(
        head_dim_pad=head_dim_pad, block_h=block_h, block_n=block_n, block_new=block_new,
        num_warps=config.num_warps, num_stages=num_stages, num_splits=num_splits,
        split_n=blocks_per_split * block_n, grid=(programs, num_splits),
        splits_pad=max(2, triton.next_power_of_2(num_splits)), pdl=num_splits > 1 and decode_use_pdl(device),
        max_registers=decode_max_registers(config.num_warps, num_stages, page_size > 0, programs * num_splits, device),
    )


def _early_new(append: bool, paged: bool, page_size: int, block_n: int, num_splits: int) -> bool:
    """Whether the last split loads its first chunk of new rows at its start (EARLY_NEW, see
    [Note] Fused append): dense caches, pools of whole key blocks per page (P % BLOCK_N == 0), and
    pools that gather a key block from several pages (P = 16, 48 at BLOCK_N 64) when the cache is
    split. Unsplit, the gathering kernel keeps the late loads: the early tiles take it from 157 to
    240 registers per thread (sm_90), and at batch 128 x 1024 (P = 16, D = 128, no split) it ran
    147 against 140 us on an H200, while split shapes gained up to 0.6 us (batch 1 x 1024 8.3 ->
    7.7 us, 1 x 4096 13.0 -> 12.4; D = 64, P = 16 and 64: 0.4-1.0 us at batch 1-8;
    results/nvidia-h200/decode_ab_stop13.log, run 3)."""
    return append and (not paged or page_size % block_n == 0 or num_splits > 1)


def _one_loop(blocks_per_split: int, gathers: bool) -> bool:
    """Whether each split streams all its blocks through the masked loop (ONE_LOOP, see [Note] One
    loop for short splits): splits of up to DECODE_ONE_LOOP_MAX_BLOCKS blocks, or of up to
    DECODE_ONE_LOOP_MAX_BLOCKS_GATHER when a key block gathers its rows from several pages."""
    return blocks_per_split <= (DECODE_ONE_LOOP_MAX_BLOCKS_GATHER if gathers else DECODE_ONE_LOOP_MAX_BLOCKS)


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


def _check_host_lengths(lengths, seqlen_new: int, seqlen_cache: int, capacity: Optional[str] = None) -> None:
    """Raise ValueError if a host-known length is negative or the append would pass seqlen_cache.

    `lengths` is an int (every request) or a CPU tensor / numpy array of per-request lengths;
    `capacity` names seqlen_cache in the message (a paged cache: max_blocks_per_seq * page_size).
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
    if capacity is None:
        raise ValueError(
            f"KV cache overflow for {which}: cache_seqlens {length} + {seqlen_new} new tokens = "
            f"{length + seqlen_new} > seqlen_cache {seqlen_cache}; allocate a longer cache or reset the request."
        )
    raise ValueError(
        f"KV cache overflow for {which}: cache_seqlens {length} + {seqlen_new} new tokens = "
        f"{length + seqlen_new} > {capacity} = {seqlen_cache}; give the block table more columns."
    )


def _resolve_cache_seqlens(cache_seqlens, batch: int, seqlen_new: int, seqlen_cache: int,
                           device: torch.device, capacity: Optional[str] = None) -> torch.Tensor:
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
        if batch > 1 and cache_seqlens.stride(0) != 1:
            raise ValueError(
                f"Expected a contiguous cache_seqlens, got stride {cache_seqlens.stride(0)}; the kernel reads "
                f"request b's length at offset b. Pass cache_seqlens.contiguous() (and advance that tensor)."
            )
        if cache_seqlens.device.type == "cpu":  # host-known: check, then copy if the call runs on a GPU
            _check_host_lengths(cache_seqlens, seqlen_new, seqlen_cache, capacity)
            return cache_seqlens if device.type == "cpu" else cache_seqlens.to(device)
        if cache_seqlens.device != device:
            raise ValueError(
                f"Expected cache_seqlens on {device} (or on the CPU), got it on {cache_seqlens.device}."
            )
        return cache_seqlens
    if isinstance(cache_seqlens, numbers.Integral) and not isinstance(cache_seqlens, bool):
        value = int(cache_seqlens)
        _check_host_lengths(value, seqlen_new, seqlen_cache, capacity)
        return _filled_seqlens(value, batch, device)
    raise TypeError(f"Expected cache_seqlens to be an int or an int32 tensor, got {type(cache_seqlens).__name__}.")


def _check_block_table_entries(block_table: torch.Tensor, host_lengths, seqlen_new: int, page_size: int,
                               num_blocks: int) -> None:
    """Raise ValueError if a CPU block_table entry that the call uses lies outside [0, num_blocks).

    With host-known lengths (an int or a CPU tensor) request b uses its first
    ceil((L_b + seqlen_new) / page_size) entries and only those are checked (the rest may hold
    anything, e.g. -1); without them (lengths on the GPU) every entry is.
    """
    table = block_table.to(torch.int64)
    bad = (table < 0) | (table >= num_blocks)  # (batch, max_blocks)
    if host_lengths is not None:
        if isinstance(host_lengths, int):
            host_lengths = torch.full((table.shape[0],), host_lengths, dtype=torch.int64)
        n_pages = (host_lengths.to(torch.int64).clamp(min=0) + seqlen_new + page_size - 1) // page_size
        bad &= torch.arange(table.shape[1])[None, :] < n_pages[:, None]
    if not bool(bad.any()):
        return
    b, j = (int(i) for i in bad.nonzero()[0])
    which = (f"request {b} uses its first {int(n_pages[b])} entries" if host_lengths is not None
             else "cache_seqlens is on the GPU, so every entry is checked")
    raise ValueError(
        f"Expected block_table entries in [0, num_blocks = {num_blocks}) (physical blocks of k_cache), got "
        f"block_table[{b}, {j}] = {int(table[b, j])} ({which}); entries past a request's pages may hold any value."
    )


def _resolve_paging(block_table, cache_seqlens, batch: int, seqlen_new: int, k_cache: torch.Tensor,
                    device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
    """Validate a paged call's block_table and cache_seqlens; return both on `device`.

    Checks on the host what is host-visible: the lengths (overflow past max_blocks_per_seq *
    page_size) and a CPU block_table's entries (`_check_block_table_entries`), then copies them to
    the GPU. A block_table already on the GPU is used as is (the kernel clamps its entries).
    """
    _validate_tensor("block_table", block_table, 2, "(batch, max_blocks_per_seq)")
    if block_table.dtype != torch.int32:
        raise TypeError(
            f"Expected block_table to be an int32 tensor (flash-attn's convention), got {block_table.dtype}; "
            f"use block_table.to(torch.int32)."
        )
    if block_table.shape[0] != batch or block_table.shape[1] < 1:
        raise ValueError(
            f"Expected block_table of shape (batch, max_blocks_per_seq) = ({batch}, >= 1), got "
            f"{tuple(block_table.shape)}."
        )
    num_blocks, page_size = k_cache.shape[0], k_cache.shape[1]
    if num_blocks < 1 or page_size < 1:
        raise ValueError(
            f"Expected a paged k_cache (num_blocks, page_size, nheads_k, headdim) with num_blocks >= 1 and "
            f"page_size >= 1, got {tuple(k_cache.shape)}."
        )
    capacity = block_table.shape[1] * page_size
    seqlens = _resolve_cache_seqlens(cache_seqlens, batch, seqlen_new, capacity, device,
                                     f"max_blocks_per_seq * page_size = {block_table.shape[1]} * {page_size}")
    if block_table.device.type == "cpu":  # host-visible: check the entries this call uses, then copy
        if isinstance(cache_seqlens, torch.Tensor):
            host_lengths = cache_seqlens if cache_seqlens.device.type == "cpu" else None
        else:
            host_lengths = int(cache_seqlens)
        _check_block_table_entries(block_table, host_lengths, seqlen_new, page_size, num_blocks)
        return seqlens, (block_table if device.type == "cpu" else block_table.to(device))
    if block_table.device != device:
        raise ValueError(f"Expected block_table on {device} (or on the CPU), got it on {block_table.device}.")
    return seqlens, block_table


def _validate_kvcache_inputs(q, k_cache, v_cache, k, v, paged: bool = False) -> None:
    _validate_tensor("q", q, 4, "(batch, seqlen_q, nheads, headdim)")
    layout = "(num_blocks, page_size, nheads_k, headdim)" if paged else "(batch, seqlen_cache, nheads_k, headdim)"
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
    if not paged and k_cache.shape[0] != batch:
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


_VALIDATED_SIGNATURES: set = set()  # `_signature`s of CUDA calls whose tensors passed _validate_kvcache_inputs
_INTERPRET = is_interpreter()  # fixed when Triton decorated the kernels, at import


def _signature(q, k_cache, v_cache, k, v, block_table) -> tuple:
    """Shapes, strides, dtypes and devices of a call's tensors: what validation and the launch
    depend on (besides values and pointers), so a repeated signature skips both, see [Note] Host
    overhead. Raises AttributeError when an argument is not a tensor."""
    sig = (q.shape, q.stride(), q.dtype, q.device, k_cache.shape, k_cache.stride(), k_cache.dtype, k_cache.device,
           v_cache.shape, v_cache.stride(), v_cache.dtype, v_cache.device)
    if k is not None or v is not None:  # one of them None: AttributeError, validation says both or neither
        sig += (k.shape, k.stride(), k.dtype, k.device, v.shape, v.stride(), v.dtype, v.device)
    if block_table is not None:
        sig += (block_table.shape, block_table.stride(), block_table.dtype, block_table.device)
    return sig


def _aligned(*tensors: torch.Tensor) -> int:
    """Bit i set when tensors[i]'s data pointer is 16-byte aligned (Triton specialises on it)."""
    bits = 0
    for i, t in enumerate(tensors):
        if t.data_ptr() % 16 == 0:
            bits |= 1 << i
    return bits


def _chunked_prefill_pays(batch: int, seqlen_q: int, nheads: int, head_dim: int, dtype: torch.dtype, causal: bool,
                          device: torch.device) -> bool:
    """Whether a num_splits=0 call runs the prefill path (see [Note] Chunked prefill): at least
    CHUNKED_PREFILL_MIN_SEQLEN_Q new tokens per request, and enough (query block, batch, head)
    programs for the prefill grid to fill CHUNKED_PREFILL_MIN_WAVE of the SMs (the prefill kernel
    does not split the keys, so a smaller grid leaves SMs idle while the decode kernel would split)."""
    if seqlen_q < CHUNKED_PREFILL_MIN_SEQLEN_Q:
        return False
    return _prefill_programs_fill(batch, seqlen_q, nheads, head_dim, dtype, causal, device)


@functools.lru_cache(maxsize=256)
def _prefill_programs_fill(batch: int, seqlen_q: int, nheads: int, head_dim: int, dtype: torch.dtype, causal: bool,
                           device: torch.device) -> bool:
    block_m = prefill_fwd_config(max(16, triton.next_power_of_2(head_dim)), dtype, causal, device).block_m
    sm_count = planning_sm_count(device)
    return triton.cdiv(seqlen_q, block_m) * batch * nheads >= CHUNKED_PREFILL_MIN_WAVE * sm_count


_launch_append_kernel = LaunchCache(_append_kernel)


def _launch_append(k_cache, v_cache, k, v, cache_seqlens, block_table, key) -> None:
    """Write the new tokens k, v (B, M, H_KV, D) into the cache at cache_seqlens[b] (chunked prefill);
    key: what the kernel specialises on (the call's signature and alignment)."""
    batch, seqlen_new, nheads_k, head_dim = k.shape
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    block = min(64, max(16, triton.next_power_of_2(seqlen_new)))
    if block_table is None:
        capacity, paging, paged, page_size = k_cache.shape[1], (None, None, None), False, 1
    else:
        capacity = block_table.shape[1] * k_cache.shape[1]
        paging, paged, page_size = (block_table, block_table.stride(0), k_cache.shape[0]), True, k_cache.shape[1]
    args = (k_cache, v_cache, k, v, cache_seqlens,
            *k_cache.stride()[:3], *v_cache.stride()[:3], *k.stride()[:3], *v.stride()[:3],
            nheads_k, seqlen_new, capacity, *paging, head_dim, head_dim_pad, block, paged, page_size,
            paged and wide_pages(page_size, k_cache, v_cache))
    _launch_append_kernel(key, (triton.cdiv(seqlen_new, block), batch * nheads_k, 1), args, 4,
                          device_index=k.device.index if k.device.index is not None else 0)


def _split_scratch(numel: int, device: torch.device, device_index: int) -> torch.Tensor:
    """fp32 scratch of at least `numel` elements for the split partials, reused by the calling
    thread's calls on the current stream of `device_index` (the current device).

    One thread's calls on one stream are issued one after the other and run in stream order, so a
    call's decode kernel writes the scratch only after the previous call's combine kernel has read
    it. Another thread may issue its launches between a call's two, so each thread keeps its own
    (thread-local: freed with the thread). Scratch above SPLIT_SCRATCH_CACHE_BYTES is allocated per
    call, not kept. While a CUDA graph is being captured a fresh allocation is made (from the graph's
    pool), so graph replays never share scratch with eager calls.
    """
    if (device.type != "cuda" or numel * 4 > SPLIT_SCRATCH_CACHE_BYTES
            or torch.cuda.is_current_stream_capturing()):
        return torch.empty(numel, dtype=torch.float32, device=device)
    buffers = getattr(_SCRATCH_LOCAL, "buffers", None)
    if buffers is None:
        buffers = _SCRATCH_LOCAL.buffers = {}
    slot = (device_index, torch._C._cuda_getCurrentRawStream(device_index))
    scratch = buffers.get(slot)
    if scratch is None or scratch.numel() < numel:
        scratch = buffers[slot] = torch.empty(numel, dtype=torch.float32, device=device)
    return scratch


SPLIT_SCRATCH_CACHE_BYTES = 64 * 2**20  # larger split scratch is allocated per call, not kept
_SCRATCH_LOCAL = threading.local()  # .buffers: (device index, raw stream) -> the largest scratch used there


class _Replay(NamedTuple):
    """A validated CUDA call's decode (+ combine) launches, replayed with the next call's pointers:
    what `flash_attn_with_kvcache` runs for a repeated call instead of validating, planning and
    building arguments again, see [Note] Host overhead. Each launch keeps its full argument list as a
    template and slots (position, source): source indexes the call's pointers in the order q,
    k_cache, v_cache, k, v, cache_seqlens, block_table, out, lse, out_part, lse_part."""

    device_index: int
    device: torch.device
    lse_shape: Optional[Tuple[int, ...]]
    scratch_numel: int  # 0 without a split
    lse_part_offset: int  # bytes from the scratch's start to the partial LSEs
    launches: Tuple[Tuple[DirectLaunch, Tuple[int, int, int], list, Tuple[Tuple[int, int], ...]], ...]


_REPLAYS: dict = {}  # `_replay_key` -> _Replay
_REPLAYS_MAX = 1024
# the current CUDA device's index: torch.cuda.current_device() without its Python wrapper (0.17 vs 0.32 us)
_current_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device


# Where a replayed launch's pointer arguments come from: kernel parameter -> index into the call's
# pointers (q, k_cache, v_cache, k, v, cache_seqlens, block_table, out, lse, out_part, lse_part; the
# full path's stand-ins for unused ones: k_cache for k/v without an append, out for lse without
# return_softmax_lse and for the partials without a split).
_DECODE_SOURCES = {"Q": 0, "K_cache": 1, "V_cache": 2, "K_new": 3, "V_new": 4, "Cache_seqlens": 5,
                   "Block_table": 6, "Out": 7, "Lse": 8, "Out_part": 9, "Lse_part": 10}
_COMBINE_SOURCES = {"Out_part": 9, "Lse_part": 10, "Out": 7, "Lse": 8}


def _replay_template(direct: Optional[DirectLaunch], grid, args: Sequence, names: Sequence[str],
                     sources: dict):
    """(direct launch, grid, argument template, pointer slots) for a launch made with `args` (the
    kernel's parameters `names`): each tensor argument's position gets the call pointer that
    `sources` names for its parameter, whatever tensor the recorded call passed there (so tensors
    aliased in that call, e.g. k is v, are not frozen into the replay). The template holds no tensor
    (its slots are 0 until a call fills them), so a recording keeps no tensor alive. None when the
    kernel has no direct launch or a tensor parameter has no source."""
    if direct is None:
        return None
    template, slots = list(args), []
    for i in direct.pointers:
        j = sources.get(names[i])
        if j is None:
            return None
        template[i] = 0
        slots.append((i, j))
    return direct, grid, template, tuple(slots)


def _replay(r: _Replay, q, k_cache, v_cache, k, v, cache_seqlens, block_table):
    """Run a repeated call through its `_Replay`: (out, lse), or None when this call's pointers are
    not all 16-byte aligned (the kernels were compiled for aligned ones), the current device is not
    the call's, the fast launch is off (KERNELS_FAST_LAUNCH=0, LaunchCache.enabled) or launch hooks
    are installed; the caller then takes the full path."""
    q_ptr, kc_ptr, vc_ptr, lens_ptr = q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), cache_seqlens.data_ptr()
    k_ptr, v_ptr = (k.data_ptr(), v.data_ptr()) if k is not None else (kc_ptr, kc_ptr)
    bt_ptr = block_table.data_ptr() if block_table is not None else 0
    if ((q_ptr | kc_ptr | vc_ptr | lens_ptr | k_ptr | v_ptr | bt_ptr) & 15
            or _current_device() != r.device_index or not _launch_decode.enabled or launch_hooks_active()):
        return None
    out = torch.empty_like(q, memory_format=torch.contiguous_format)  # (B, M, H, D): q's shape (cheaper than empty)
    out_ptr = out.data_ptr()
    lse = None
    lse_ptr = out_ptr
    if r.lse_shape is not None:
        lse = torch.empty(r.lse_shape, dtype=torch.float32, device=r.device)
        lse_ptr = lse.data_ptr()
    part_ptr = lse_part_ptr = out_ptr
    if r.scratch_numel:  # held in a local until both launches are issued
        scratch = _split_scratch(r.scratch_numel, r.device, r.device_index)
        part_ptr = scratch.data_ptr()
        lse_part_ptr = part_ptr + r.lse_part_offset
    ptrs = (q_ptr, kc_ptr, vc_ptr, k_ptr, v_ptr, lens_ptr, bt_ptr, out_ptr, lse_ptr, part_ptr, lse_part_ptr)
    stream = torch._C._cuda_getCurrentRawStream(r.device_index)
    for direct, grid, template, slots in r.launches:
        args = template.copy()
        for i, j in slots:
            args[i] = ptrs[j]
        direct.launch(grid, stream, args)
    return out, lse


def _replay_key(sig: tuple, cache_seqlens, softmax_scale, causal, num_splits, return_softmax_lse) -> Optional[tuple]:
    """What a call must share with an earlier one to replay it: the tensors' signature, a device
    cache_seqlens' layout, and the other arguments; None when the call cannot be replayed: lengths
    given as an int or on the CPU (checked on the host every call), and arguments other than plain
    Python values (a tensor scale could change in place; the full path converts and checks them)."""
    if (type(cache_seqlens) is not torch.Tensor or type(causal) is not bool or type(num_splits) is not int
            or type(return_softmax_lse) is not bool or not (softmax_scale is None or type(softmax_scale) is float)):
        return None
    return (sig, cache_seqlens.shape, cache_seqlens.stride(), cache_seqlens.dtype, cache_seqlens.device,
            softmax_scale, causal, num_splits, return_softmax_lse)


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
    block_table: Optional[torch.Tensor] = None,
    sig: Optional[tuple] = None,
    replay_key: Optional[tuple] = None,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Allocate and launch on validated inputs (cache_seqlens: int32 (batch,) on q's device;
    block_table: None for a dense cache, else int32 (batch, max_blocks_per_seq) on q's device;
    sig: `_signature` of the call when the caller has it; replay_key: when given, the decode
    launches are recorded as a `_Replay` under it, for the caller's next call of that key)."""
    batch, seqlen_q, nheads, head_dim = q.shape
    device = q.device
    append = k is not None
    if batch > 0 and num_splits == 0 and _chunked_prefill_pays(batch, seqlen_q, nheads, head_dim, q.dtype, causal,
                                                               device):
        if sig is None:
            sig = _signature(q, k_cache, v_cache, k, v, block_table)
        key = (sig, _aligned(q, k_cache, v_cache, k if append else q, v if append else q, cache_seqlens,
                             block_table if block_table is not None else q),
               block_table.stride(0) if block_table is not None else None)
        ctx = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
        with ctx:
            if append:
                _launch_append(k_cache, v_cache, k, v, cache_seqlens, block_table, key)
            out, lse = _flash_attn_kvcache_forward(q, k_cache, v_cache, cache_seqlens, append, block_table,
                                                   softmax_scale, causal, launch_key=(key, append, causal))
        return out, (lse if return_softmax_lse else None)

    seqlen_cache, nheads_k = k_cache.shape[1], k_cache.shape[2]
    if block_table is not None:  # the logical capacity of a request; k_cache.shape[1] is the page size
        seqlen_cache = block_table.shape[1] * k_cache.shape[1]
    plan = _plan(batch, seqlen_q, nheads, nheads_k, head_dim, seqlen_cache, q.dtype, device, num_splits,
                 k_cache.shape[1] if block_table is not None else 0)

    out = torch.empty_like(q, memory_format=torch.contiguous_format)  # (batch, seqlen_q, nheads, head_dim)
    lse = torch.empty((batch, nheads, seqlen_q), dtype=torch.float32, device=device) if return_softmax_lse else None
    if batch == 0:
        return out, lse
    device_index = device.index if device.index is not None or device.type != "cuda" else torch.cuda.current_device()
    ctx = contextlib.nullcontext()
    if device.type == "cuda" and device_index != torch.cuda.current_device():
        ctx = torch.cuda.device(device)
    split = plan.num_splits > 1
    scratch_numel = part_rows = 0
    if split:  # one fp32 scratch: partial outputs (B, H, M, splits, D), then their LSEs
        part_rows = batch * nheads * seqlen_q * plan.num_splits
        scratch_numel = part_rows * (head_dim + 1)
        with ctx:  # q's device current: its stream and capture state count
            scratch = _split_scratch(scratch_numel, device, device_index)
        out_part, lse_part = scratch[: part_rows * head_dim], scratch[part_rows * head_dim: scratch_numel]
    else:
        out_part = lse_part = out  # unused
    k_arg, v_arg = (k, v) if append else (k_cache, k_cache)  # unused pointers without an append
    lse_arg = lse if lse is not None else out  # unused when STORE_LSE is False
    store_lse = lse is not None

    if sig is None:
        sig = _signature(q, k_cache, v_cache, k, v, block_table)
    # Kernels specialise on shapes/strides (sig), constexprs and 16-byte pointer alignment. The
    # outputs and scratch are fresh allocations (always aligned), so only the inputs' alignment counts.
    if block_table is None:  # dense: the paging arguments are None, i.e. constexprs the kernel never reads
        paging, paged, page_size = (None, None, None), False, 1
        aligned = _aligned(q, k_cache, v_cache, k_arg, v_arg, cache_seqlens)
    else:
        paging, paged, page_size = (block_table, block_table.stride(0), k_cache.shape[0]), True, k_cache.shape[1]
        aligned = _aligned(q, k_cache, v_cache, k_arg, v_arg, cache_seqlens, block_table)
    key = (sig, plan, causal, append, store_lse, aligned)
    if paged:  # the table on the device may be a copy of the caller's: its own stride
        key += (block_table.stride(0),)
    decode_grid = (plan.grid[0], plan.grid[1], 1)
    decode_args = (
        q, k_cache, v_cache, k_arg, v_arg, cache_seqlens, out, lse_arg, out_part, lse_part,
        *q.stride()[:3], *k_cache.stride()[:3], *v_cache.stride()[:3], *k_arg.stride()[:3], *v_arg.stride()[:3],
        nheads_k, nheads // nheads_k, seqlen_q, seqlen_cache, plan.split_n, softmax_scale * LOG2E,
        *paging,
        head_dim, plan.head_dim_pad, plan.block_h, plan.block_n, plan.block_new,
        causal, append, split, store_lse, paged, page_size, paged and wide_pages(page_size, k_cache, v_cache),
        _early_new(append, paged, page_size, plan.block_n, plan.num_splits),
        _one_loop(plan.split_n // plan.block_n, paged and page_size % plan.block_n != 0), plan.pdl,
    )
    combine_grid = (batch * nheads * seqlen_q, 1, 1)
    combine_args = (out_part, lse_part, out, lse_arg, nheads, seqlen_q, plan.num_splits,
                    head_dim, plan.head_dim_pad, plan.splits_pad, store_lse, plan.pdl)
    with ctx:
        _launch_decode(key, decode_grid, decode_args, plan.num_warps, plan.num_stages, device_index=device_index,
                       maxnreg=plan.max_registers)
        if split:
            _launch_combine(key, combine_grid, combine_args, 4 if plan.splits_pad * plan.head_dim_pad >= 4096 else 1,
                            device_index=device_index, launch_pdl=plan.pdl)
    if replay_key is not None and aligned == (1 << (7 if paged else 6)) - 1:
        launches = (_replay_template(_launch_decode.direct(key), decode_grid, decode_args, _launch_decode.names,
                                     _DECODE_SOURCES),)
        if split:
            launches += (_replay_template(_launch_combine.direct(key), combine_grid, combine_args,
                                          _launch_combine.names, _COMBINE_SOURCES),)
        if all(launch is not None for launch in launches):
            if len(_REPLAYS) >= _REPLAYS_MAX:  # shapes churn: start over rather than grow without bound
                _REPLAYS.clear()
            _REPLAYS[replay_key] = _Replay(
                device_index=device_index, device=device,
                lse_shape=tuple(lse.shape) if lse is not None else None, scratch_numel=scratch_numel,
                lse_part_offset=part_rows * head_dim * 4, launches=launches,
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
    block_table: Optional[torch.Tensor] = None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    num_splits: int = 0,
    return_softmax_lse: bool = False,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Decode attention over a KV cache, dense or paged, with an optional in-place append, in one
    launch (flash-attn's `flash_attn_with_kvcache`).

    Args:
        q: (batch, seqlen_q, nheads, headdim), float16, bfloat16 or float32; seqlen_q >= 1 (1 for
            plain decoding, a few for speculative-decoding verification).
        k_cache, v_cache: same dtype and device as q, any strides with a contiguous last dim; no
            copies are made; beyond 2^31 elements is fine. Query head h reads KV head
            h // (nheads // nheads_k) (MHA, GQA, MQA).
            Dense (block_table None): (batch, seqlen_cache, nheads_k, headdim), e.g. also a
            (batch, nheads_k, seqlen_cache, headdim) buffer passed as .transpose(1, 2).
            Paged (block_table given): pools (num_blocks, page_size, nheads_k, headdim), e.g. also a
            (num_blocks, nheads_k, page_size, headdim) pool passed as .transpose(1, 2). Any
            page_size >= 1 (see the module's [Note] Paged caches).
        k, v: optional (batch, seqlen_q, nheads_k, headdim): the new tokens' keys and values. They
            are written into k_cache / v_cache in place at (logical) rows [cache_seqlens[b],
            cache_seqlens[b] + seqlen_q) and attended over in the same launch. Both or neither. In a
            paged cache each new row goes to its own page slot, so an append may cross pages.
        cache_seqlens: each request's cache length before this call: an int (the same for every
            request) or an int32 tensor of shape (batch,), on q's device or on the CPU (checked on
            the host, then copied: use a device tensor inside a CUDA graph). It is never modified
            (advance it yourself, e.g. cache_seqlens += seqlen_q, or use KVCache / PagedKVCache).
            Overflow: lengths known on the host (an int, a CPU tensor) are checked, and an append
            that would pass seqlen_cache (paged: max_blocks_per_seq * page_size) raises ValueError.
            A tensor on the GPU cannot be checked without a host sync: the caller is responsible
            for it; the kernel clamps each length to [0, seqlen_cache] and drops appended rows past
            the end, so no read or write ever leaves the buffers, but the result of an overflowing
            call is not meaningful.
        block_table: optional int32 (batch, max_blocks_per_seq), contiguous last dim, on q's device
            or on the CPU (checked, then copied): logical key j of request b lives in row
            j % page_size of physical block block_table[b, j // page_size] of the pools (flash-attn
            and vLLM's convention). Request b uses its first ceil(N_b / page_size) entries; the
            rest may hold anything (-1 is a good filler). Entries outside [0, num_blocks): a CPU
            block_table is checked (ValueError, for the entries the call uses when the lengths are
            host-known, else for all). A GPU block_table cannot be checked without a sync: the kernel
            clamps each entry into [0, num_blocks) for reads (wrong results, never an out-of-bounds
            read) and drops appended rows whose entry is outside the pool (never an out-of-bounds
            write). Two requests may share pages they only read (prefix sharing); a page appended
            into must belong to one request.
        softmax_scale: defaults to headdim ** -0.5.
        causal: mask aligned to the bottom-right corner over the N_b = cache_seqlens[b] + seqlen_q
            keys (cache_seqlens[b] without k/v): token t sees key j iff j <= t + N_b - seqlen_q.
            For cache_seqlens[b] = 3 and seqlen_q = 2 with an append (1 = kept):
                1 1 1 1 0
                1 1 1 1 1
            With seqlen_q == 1 causal changes nothing. A row that sees no key (a request with an
            empty cache and no append) outputs zeros, never NaN.
        num_splits: 0 = heuristic (from batch, heads, the allocated seqlen_cache -- paged:
            max_blocks_per_seq * page_size -- and the SM count, never from current lengths),
            1 = no split, n > 1 = split each cache into about n chunks processed in parallel and
            merged by log-sum-exp (capped at the number of BLOCK_N blocks of the cache). Splits past
            a request's length exit at once. With 0, seqlen_q >= 128 and enough work to fill the
            GPU, the call is a chunk of a prompt: it runs the prefill kernel family instead (an
            append launch, then a FlashAttention-2 forward over the cache; see [Note] Chunked
            prefill); an explicit num_splits >= 1 keeps the decode kernel.
        return_softmax_lse: also return the log-sum-exp of each row.

    Returns:
        out: (batch, seqlen_q, nheads, headdim), dtype of q.
        softmax_lse (if return_softmax_lse): (batch, nheads, seqlen_q) float32, natural log; +inf
            for a row that sees no key.

    No host synchronisation happens with device cache_seqlens (and block_table), so the whole step
    (append + attention) can be captured in a CUDA graph and replayed while the lengths advance on
    the device. Not supported: cache_batch_idx, rotary embedding, alibi, sliding windows,
    softcapping.
    """
    try:
        sig = _signature(q, k_cache, v_cache, k, v, block_table)
    except AttributeError:  # not tensors: validation names the problem
        sig = None
    replay_key = None
    if sig is not None and not _INTERPRET:  # a repeat of a validated call: replay its launches
        try:
            replay_key = _replay_key(sig, cache_seqlens, softmax_scale, causal, num_splits, return_softmax_lse)
            replay = _REPLAYS.get(replay_key) if replay_key is not None else None
        except TypeError:  # an unhashable argument: the full path names what is wrong with it
            replay_key = replay = None
        if replay is not None:
            result = _replay(replay, q, k_cache, v_cache, k, v, cache_seqlens, block_table)
            if result is not None:
                return result if return_softmax_lse else result[0]
    if sig is None or _INTERPRET or sig not in _VALIDATED_SIGNATURES:
        _validate_kvcache_inputs(q, k_cache, v_cache, k, v, block_table is not None)
        if sig is not None and q.device.type == "cuda" and not _INTERPRET:
            if len(_VALIDATED_SIGNATURES) >= 4096:  # shapes churn: start over rather than grow without bound
                _VALIDATED_SIGNATURES.clear()
            _VALIDATED_SIGNATURES.add(sig)
    if not isinstance(num_splits, numbers.Integral) or num_splits < 0:
        raise ValueError(f"Expected num_splits to be an int >= 0 (0 = heuristic), got {num_splits!r}.")
    scale = _validate_softmax_scale(softmax_scale, q.shape[3])
    seqlen_new = q.shape[1] if k is not None else 0
    if block_table is None:
        seqlens, table = _resolve_cache_seqlens(cache_seqlens, q.shape[0], seqlen_new, k_cache.shape[1], q.device), None
    else:
        seqlens, table = _resolve_paging(block_table, cache_seqlens, q.shape[0], seqlen_new, k_cache, q.device)
    if seqlens is not cache_seqlens or table is not block_table or q.device.type != "cuda":
        replay_key = None  # lengths or table checked on the host or copied: not replayable
    out, lse = _flash_attn_with_kvcache_launch(
        q, k_cache, v_cache, k, v, seqlens, scale, bool(causal), int(num_splits), return_softmax_lse, table, sig,
        replay_key,
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


# ============================================================================================
# Paged KV cache helper
# ============================================================================================
class PoolExhaustedError(RuntimeError):
    """PagedKVCache has too few free blocks (or no free request slot) for what was asked.

    Raised before anything changes: no block is taken, no page written, no length advanced.
    Serving loops catch it to preempt or queue a request, then retry after `free`.
    """


class PagedBatch(NamedTuple):
    """What flash_attn_with_kvcache needs for a batch of PagedKVCache requests (`PagedKVCache.batch`)."""

    block_table: torch.Tensor  # int32 (n, max_blocks_per_seq) on the cache's device; -1 = no page
    cache_seqlens: torch.Tensor  # int32 (n,) on the cache's device
    block_table_host: torch.Tensor  # int32 (n, max_blocks_per_seq) CPU copy of the host mirror
    seqlens_host: list  # n ints, the host mirror


class PagedKVCache:
    """A pool of fixed-size K/V pages shared by requests that come and go (PagedAttention, vLLM).

    Owns the pools k_cache / v_cache of shape (num_blocks, page_size, nheads_k, head_dim), a free
    list of their blocks, and max_batch request slots. Each slot has a row of the block table
    (max_batch, max_blocks_per_seq) (logical page i of the request -> physical block; -1 where the
    request has no page) and a length. Table and lengths are kept twice: int32 device tensors
    (`block_table`, `seqlens_device`: what the kernel reads; lengths advance in place, so a decode
    step never syncs with the host and can be captured in a CUDA graph) and host mirrors (what the
    allocation and overflow checks read).

        cache = PagedKVCache(1024, 16, nheads_k, head_dim, max_batch=8, max_blocks_per_seq=256,
                             dtype=torch.float16, device="cuda")
        a = cache.add_request()                            # a free slot id
        out = cache.prefill(q_p, k_p, v_p, slots=[a])      # causal prompt attention; pages filled
        b = cache.add_request(); cache.prefill(q_p2, k_p2, v_p2, slots=[b])
        out = cache.decode(q_t, k_t, v_t, slots=[a, b])    # append + attend, pages taken on demand
        cache.free(a)                                      # a's pages return to the pool

    Guarantees: a block belongs to at most one request at a time; blocks are taken only from the
    free list, all-or-nothing per call (PoolExhaustedError leaves the cache unchanged), so a full
    pool never overwrites a live page; a request growing past max_seqlen = max_blocks_per_seq *
    page_size raises ValueError before any launch. Freed blocks are reused first (LIFO).

    CUDA graphs: capture `decode` for slots that form a contiguous ascending range (the table and
    lengths it passes are then views of the cache's own tensors) after reserving, with
    `extend(slot, tokens)`, the pages of every step you will replay: no page can be allocated on the
    host during a replay (a decode that would need one while capturing raises). Each replay
    advances the device lengths; the host mirror advances once, at capture: call
    `refresh_host_seqlens()` (one sync) after replaying. A replay that outgrows the reserved pages
    reaches table entries of -1: its appended rows are dropped (no live page is overwritten) and
    its output is not meaningful.
    """

    def __init__(self, num_blocks: int, page_size: int, nheads_k: int, head_dim: int, *, max_batch: int,
                 max_blocks_per_seq: int, dtype: torch.dtype = torch.float16,
                 device: Union[str, torch.device, None] = None):
        for name, value in (("num_blocks", num_blocks), ("page_size", page_size), ("nheads_k", nheads_k),
                            ("max_batch", max_batch), ("max_blocks_per_seq", max_blocks_per_seq)):
            if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Expected {name} to be a positive int, got {value!r}.")
        _validate_head_dim(head_dim)
        if dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"Expected dtype float16, bfloat16 or float32, got {dtype}.")
        device = default_device() if device is None else torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.num_blocks, self.page_size, self.nheads_k, self.head_dim = (int(num_blocks), int(page_size),
                                                                         int(nheads_k), int(head_dim))
        self.max_batch, self.max_blocks_per_seq = int(max_batch), int(max_blocks_per_seq)
        self.max_seqlen = self.max_blocks_per_seq * self.page_size
        self.dtype, self.device = dtype, device
        shape = (self.num_blocks, self.page_size, self.nheads_k, self.head_dim)
        self.k_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.v_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.block_table = torch.full((self.max_batch, self.max_blocks_per_seq), -1, dtype=torch.int32, device=device)
        self._seqlens = torch.zeros(self.max_batch, dtype=torch.int32, device=device)
        self._host_table = np.full((self.max_batch, self.max_blocks_per_seq), -1, dtype=np.int32)
        self._host_len = np.zeros(self.max_batch, dtype=np.int64)
        self._npages = np.zeros(self.max_batch, dtype=np.int64)  # pages owned by each slot
        self._active = np.zeros(self.max_batch, dtype=bool)
        self._free = list(range(self.num_blocks - 1, -1, -1))  # pop() from the end: block 0 first

    # -- state ------------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks in the free list."""
        return len(self._free)

    @property
    def active_slots(self) -> list:
        """Slots holding a request, ascending."""
        return np.nonzero(self._active)[0].tolist()

    @property
    def seqlens(self) -> list:
        """Length of every slot (host mirror, a list of max_batch ints; 0 for free slots)."""
        return self._host_len.tolist()

    @property
    def seqlens_device(self) -> torch.Tensor:
        """Lengths as the int32 (max_batch,) device tensor the kernel reads (do not modify)."""
        return self._seqlens

    def pages(self, slot: int) -> list:
        """Physical blocks of a request, in logical order."""
        self._check_slots([slot])
        return self._host_table[slot, : self._npages[slot]].tolist()

    def capacity(self, slot: int) -> int:
        """Tokens the request can hold without a new page (its pages x page_size)."""
        self._check_slots([slot])
        return int(self._npages[slot]) * self.page_size

    def refresh_host_seqlens(self) -> list:
        """Copy the device lengths to the host mirror (one sync), e.g. after CUDA-graph replays."""
        self._host_len = self._seqlens.cpu().numpy().astype(np.int64)
        return self.seqlens

    # -- requests ---------------------------------------------------------------------------------
    def add_request(self) -> int:
        """Take a free slot for a new request (length 0, no page yet) and return its id."""
        free = np.nonzero(~self._active)[0]
        if len(free) == 0:
            raise PoolExhaustedError(f"All {self.max_batch} request slots are in use; free a finished request first.")
        slot = int(free[0])
        self._active[slot] = True
        return slot

    def free(self, slot: int) -> None:
        """Release a finished request: its pages return to the pool, its slot to the free slots."""
        self._check_slots([slot])
        pages = self._host_table[slot, : self._npages[slot]].tolist()
        self._free.extend(reversed(pages))  # reused first, in logical order
        self._host_table[slot] = -1
        self._npages[slot] = 0
        self._host_len[slot] = 0
        self._active[slot] = False
        self.block_table[slot] = -1
        self._seqlens[slot] = 0

    def extend(self, slot: int, num_tokens: int) -> list:
        """Make room for `num_tokens` more tokens after the request's current length: take the pages
        they need from the pool (none while the last page has room). Returns the new blocks.

        Raises ValueError past max_seqlen and PoolExhaustedError when the pool is short; either way
        nothing changes. The length itself advances only when K/V are written (prefill, decode).
        """
        return self._reserve([slot], int(num_tokens))

    def _check_slots(self, slots) -> None:
        for s in slots:
            if not isinstance(s, numbers.Integral) or isinstance(s, bool) or not 0 <= s < self.max_batch:
                raise ValueError(f"Expected slot ids in [0, {self.max_batch}), got {s!r}.")
            if not self._active[s]:
                raise ValueError(f"Slot {s} holds no request (add_request() first, or it was freed).")
        if len(set(int(s) for s in slots)) != len(slots):
            raise ValueError(f"Expected distinct slots, got {list(slots)}.")

    def _reserve(self, slots: list, num_tokens: int) -> list:
        """Pages for `num_tokens` more tokens in each slot, all or nothing; returns the new blocks."""
        if num_tokens < 0:
            raise ValueError(f"Expected num_tokens >= 0, got {num_tokens}.")
        lengths = self._host_len[slots] + num_tokens
        if len(slots) and int(lengths.max()) > self.max_seqlen:
            i = int(np.argmax(lengths > self.max_seqlen))
            raise ValueError(
                f"KV cache overflow for slot {slots[i]}: {int(self._host_len[slots[i]])} tokens + {num_tokens} new = "
                f"{int(lengths[i])} > max_seqlen = max_blocks_per_seq * page_size = {self.max_blocks_per_seq} * "
                f"{self.page_size} = {self.max_seqlen}."
            )
        need = np.maximum(-(-lengths // self.page_size) - self._npages[slots], 0)
        total = int(need.sum())
        if total == 0:
            return []
        if total > len(self._free):
            raise PoolExhaustedError(
                f"Page pool exhausted: {total} new blocks of {self.page_size} tokens needed for slots {list(slots)}, "
                f"{len(self._free)} of {self.num_blocks} free; free finished requests or allocate a larger pool."
            )
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "PagedKVCache needs new pages while a CUDA graph is being captured (the block-table update "
                "would only run on replay); reserve them before capturing with extend(slot, num_tokens)."
            )
        taken, rows = [], []
        for s, n in zip(slots, need.tolist()):
            if n == 0:
                continue
            blocks = [self._free.pop() for _ in range(n)]
            start = int(self._npages[s])
            self._host_table[s, start : start + n] = blocks
            self._npages[s] = start + n
            taken += blocks
            rows.append(np.concatenate([[s], self._host_table[s]]))
        # one host-to-device copy of the changed rows (slot id first), scattered into the device table
        update = torch.from_numpy(np.stack(rows).astype(np.int32)).to(self.device)
        self.block_table.index_copy_(0, update[:, 0].long(), update[:, 1:])
        return taken

    def _index(self, slots: list) -> Union[slice, torch.Tensor]:
        """slots -> a slice (contiguous ascending: views, graph-friendly) or a device index tensor."""
        if slots == list(range(slots[0], slots[0] + len(slots))):
            return slice(slots[0], slots[0] + len(slots))
        return torch.tensor(slots, dtype=torch.long, device=self.device)

    def _slots(self, slots) -> list:
        if slots is None:
            slots = self.active_slots
        elif isinstance(slots, numbers.Integral) and not isinstance(slots, bool):
            slots = [int(slots)]
        elif isinstance(slots, torch.Tensor):
            slots = [int(s) for s in slots.tolist()]
        elif isinstance(slots, Sequence):
            slots = list(slots)
        else:
            raise TypeError(f"Expected slots to be None, an int or a sequence of ints, got {type(slots).__name__}.")
        if not slots:
            raise ValueError("Expected at least one request slot.")
        self._check_slots(slots)
        return [int(s) for s in slots]

    def batch(self, slots=None) -> PagedBatch:
        """Block table and lengths of a batch of requests (default: every active slot, ascending).

        For slots forming a contiguous ascending range the device tensors are views of the cache's
        own (they follow later decode steps and are safe to capture in a CUDA graph); otherwise they
        are gathered copies of the current state.
        """
        slots = self._slots(slots)
        index = self._index(slots)
        return PagedBatch(
            block_table=self.block_table[index], cache_seqlens=self._seqlens[index],
            block_table_host=torch.from_numpy(self._host_table[slots].copy()),
            seqlens_host=self._host_len[slots].tolist(),
        )

    # -- prefill and decode ---------------------------------------------------------------------------
    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, slots, causal: bool = True,
                softmax_scale: Optional[float] = None) -> torch.Tensor:
        """Prompt attention with the prefill kernel; writes the prompts' K/V into their pages.

        q: (n, seqlen, nheads, head_dim), k/v: (n, seqlen, nheads_k, head_dim) for the n empty
        requests named by `slots` (prompts of one length; call once per length). Takes the pages
        (all or nothing), returns kernels.flash_attn_func(q, k, v, causal=causal) and sets those
        requests' lengths to seqlen.
        """
        from .prefill import flash_attn_func

        slots = self._slots(slots)
        count = len(slots)
        for name, t in (("k", k), ("v", v)):
            _validate_tensor(name, t, 4, "(n, seqlen, nheads_k, head_dim)")
            expected = (count, k.shape[1] if isinstance(k, torch.Tensor) else -1, self.nheads_k, self.head_dim)
            if tuple(t.shape) != expected:
                raise ValueError(f"Expected {name} of shape (n, seqlen, nheads_k, head_dim) = {expected} for "
                                 f"{count} requests, got {tuple(t.shape)}.")
            if t.dtype != self.dtype or t.device != self.device:
                raise ValueError(f"Expected {name} as {self.dtype} on {self.device} (the cache's), got {t.dtype} "
                                 f"on {t.device}.")
        if (not isinstance(q, torch.Tensor) or q.dim() != 4 or q.shape[0] != count or q.shape[1] != k.shape[1]
                or q.shape[3] != self.head_dim):
            raise ValueError(f"Expected q of shape ({count}, {k.shape[1]}, nheads, {self.head_dim}), got "
                             f"{tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__}.")
        _validate_heads(q.shape[2], self.nheads_k)
        _validate_dtypes(q=q, k=k)
        _validate_devices(q=q, k=k)
        busy = [s for s in slots if self._host_len[s] != 0]
        if busy:
            raise ValueError(f"Expected empty requests for prefill, but slot {busy[0]} holds "
                             f"{int(self._host_len[busy[0]])} tokens; decode appends to it, or free it.")
        seqlen = k.shape[1]
        self._reserve(slots, seqlen)  # raises before anything is written
        out = flash_attn_func(q, k, v, causal=causal, softmax_scale=softmax_scale)
        if seqlen > 0:
            pos = np.arange(seqlen)
            blocks = torch.from_numpy(self._host_table[slots][:, pos // self.page_size].astype(np.int64))
            rows = torch.from_numpy(pos % self.page_size)
            blocks, rows = blocks.to(self.device), rows.to(self.device)
            self.k_cache[blocks, rows] = k  # (n, seqlen) physical rows <- (n, seqlen, nheads_k, head_dim)
            self.v_cache[blocks, rows] = v
        self._host_len[slots] = seqlen
        self._seqlens[self._index(slots)] = seqlen
        return out

    def decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, slots=None, causal: bool = True,
               softmax_scale: Optional[float] = None, num_splits: int = 0) -> torch.Tensor:
        """One decode step for a batch of requests (default: every active slot, ascending; q's batch
        order is the slots' order): take the pages the new tokens need, append k/v (n, seqlen_q,
        nheads_k, head_dim) at each request's length through the kernel's fused append, attend q
        (n, seqlen_q, nheads, head_dim) over the cache, advance the lengths by seqlen_q (device
        tensor in place, no host sync; host mirror). Returns out (n, seqlen_q, nheads, head_dim)."""
        slots = self._slots(slots)
        if not isinstance(q, torch.Tensor) or q.dim() != 4 or q.shape[0] != len(slots):
            raise ValueError(f"Expected q of shape ({len(slots)}, seqlen_q, nheads, head_dim) for slots {slots}, got "
                             f"{tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__}.")
        if k is None or v is None:
            raise ValueError("PagedKVCache.decode appends: expected k and v (n, seqlen_q, nheads_k, head_dim).")
        # everything that could still fail is checked before pages are taken: all or nothing per call
        _validate_kvcache_inputs(q, self.k_cache, self.v_cache, k, v, paged=True)
        _validate_softmax_scale(softmax_scale, q.shape[3])
        if not isinstance(num_splits, numbers.Integral) or num_splits < 0:
            raise ValueError(f"Expected num_splits to be an int >= 0 (0 = heuristic), got {num_splits!r}.")
        seqlen_q = q.shape[1]
        self._reserve(slots, seqlen_q)
        index = self._index(slots)
        out = flash_attn_with_kvcache(q, self.k_cache, self.v_cache, k, v, cache_seqlens=self._seqlens[index],
                                      block_table=self.block_table[index], softmax_scale=softmax_scale,
                                      causal=causal, num_splits=num_splits)
        self._seqlens[index] += seqlen_q
        self._host_len[slots] += seqlen_q
        return out
