"""Decode attention's launches: the plan (`plan_decode`: tiles, splits, register cap, per shape) and launch
(`launch_kvcache`) of the decode kernels of jit/decode.py (KV-cache decode with per-request lengths, fused
in-place append, GQA read-once, split-KV, dense or paged caches), the recording of replays (launch/replay.py),
and the dispatch of long chunks to the prefill kernels (chunked prefill). The public function,
`flash_attn_with_kvcache`, and its validation are the api layer's (api/kvcache.py).

[Note] Host overhead. A decode step is a few microseconds of GPU time, so the wrapper caches all it
can. The full path: the validation of a call's tensors per signature (shapes, strides, dtypes,
devices: `signature`; values and pointers are still checked every call), the launch plan per shape
(`plan_decode`), the int -> tensor conversion of cache_seqlens, and the compiled kernels, launched through
their C launchers without Triton's per-call dispatch (`LaunchCache`, kernels/tritonattn/launch/fast.py, keyed by
the signature and the inputs' 16-byte alignment, plus what the arguments show: every constexpr, the
integers' classes, the launch options). A call that repeats a validated one -- same signature,
cache_seqlens (and block_table) already on the GPU with the same layout, the same compiled options
(`options.compiled`), num_splits and return_softmax_lse -- replays it (`Replay`): the recorded
argument lists of its decode and combine launches get this call's pointers and runtime options
(`options.runtime`, e.g. its softmax_scale) and go straight to the C launchers; a pointer that is
not 16-byte aligned (the kernels were compiled for aligned ones), another current device or
installed launch hooks send the call down the full path instead.
Lengths given as an int or on the CPU are checked on the host every call, so those calls are never
replayed. What a replay still does: the signature, the output allocation, the two launches. The
split scratch (partial outputs and their LSEs) is one fp32 buffer per (device, stream, thread),
reused by that thread's next call on that stream (stream order makes that safe), allocated afresh
while a CUDA graph is captured and for every call above 64 MiB. Host time of a replayed call
against the full path and SDPA: docs/perf-notes.md, Host overhead and replays.

[Note] Combine launch. With a split, the combine kernel is launched with programmatic dependent
launch on Hopper and newer (`decode_use_pdl`, kernels/tritonattn/config/tables.py): every decode program signals at
its start that dependents may launch (`gdc_launch_dependents`), so once all of them run the combine
grid is launched too, and its programs wait in `gdc_wait` until the decode grid has finished and its
writes are visible. The combine's launch latency overlaps the decode grid (what it saves:
docs/perf-notes.md, Decode, "Combine launch (PDL)"). Without PDL (sm_89, the interpreter,
TRITONATTN_PDL=0 at import) both instructions are compiled out and the launches are ordinary ones.

[Note] Chunked prefill. A call with many new tokens per request (seqlen_q >= 128, num_splits=0)
is a chunk of a long prompt: each chunk's queries attend to the request's cache plus the chunk,
bottom-right causal. The decode kernel would serve it (its row blocks tile the G * M query rows),
but it streams the whole cache once per row block of at most 64 rows: at M = 2048 and G = 4 that
is 128 passes over the cache with small tiles. Instead the call runs the prefill kernel family:
`append_kernel` writes the chunk's k/v into the cache (dense or paged, exactly as the decode
kernel's fused append does, through `store_new_rows`), then prefill's `fwd_kernel` in its cache
mode (IS_KVCACHE, see kernels/tritonattn/jit/prefill_fwd.py) attends over each request's min(L_b + M, N_CACHE) keys,
read from the cache: BLOCK_M x BLOCK_N tiles on tensor cores, tensor-descriptor loads on Hopper
for dense caches and for pools whose page size is a multiple of BLOCK_N. Two launches, both free of
host syncs, so a chunk step can be captured in a CUDA graph too. When (`chunked_prefill_pays`):
at least 128 new tokens, below which the decode kernel's GQA read-once wins, and a prefill grid
(query blocks x batch x heads) of at least 0.8 x the SM count, since the prefill kernel does not
split the keys and a small grid leaves SMs idle where the decode kernel splits. Both thresholds sit
where the two paths cross over on an H200 (benchmarks/tune_decode.py; docs/perf-notes.md, Chunked
prefill, "Dispatch").

[Note] Lengths on the device: see api/validate_cache.py (a device length is clamped by the kernels, a
host-known one is checked before launch).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import NamedTuple, Optional, Tuple

import torch
import triton

from ..config import tables
from ..config.hardware import Target, device_target
from ..config.options import AttnOptions, head_dim_tile
from ..config.tables import (
    DECODE_ONE_LOOP_MAX_BLOCKS,
    DECODE_ONE_LOOP_MAX_BLOCKS_GATHER,
    combine_num_warps,
    decode_config,
    decode_fit,
    decode_max_registers,
    decode_num_splits,
    decode_paged_tiles,
    decode_unsupported,
    decode_use_pdl,
    planning_sm_count,
    prefill_fwd_config,
    row_block,
)
from ..jit.common import wide_pages
from ..jit.decode import append_kernel, combine_kernel, decode_kernel
from .fast import LaunchCache
from .prefill import launch_cache_prefill
from .replay import COMBINE_SOURCES, DECODE_SOURCES, REPLAYS, Replay, replay_template, split_scratch

# ============================================================================================
# Launcher: validate, allocate, launch
# ============================================================================================
decode_launcher = LaunchCache(decode_kernel)


combine_launcher = LaunchCache(combine_kernel)


append_launcher = LaunchCache(append_kernel)


class DecodePlan(NamedTuple):
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
def plan_decode(batch: int, seqlen_q: int, nheads: int, nheads_k: int, head_dim: int, seqlen_cache: int,
          dtype: torch.dtype, target: Optional[Target], num_splits: int, page_size: int = 0,
          append: bool = False, window_left: int = -1, kv_itemsize: int = 0) -> DecodePlan:
    """The launch plan on `target` (`device_target`; None: the interpreter); dtype: q's; kv_itemsize: the
    cache's bytes per element (0: q's; 1 for an FP8 cache, whose K/V tiles take half the shared
    memory while the query and new-row tiles stay in q's dtype); page_size 0 for a dense
    cache, else the pool's page size (seqlen_cache is then a request's capacity, max_blocks_per_seq *
    page_size); append: the call writes seqlen_q new rows (their K/V tiles take shared memory too);
    window_left >= 0: a sliding window's left side, whose band of at most window_left + seqlen_q
    cached keys the splits tile instead of the whole cache ([Note] Variants in decode,
    kernels/tritonattn/jit/decode.py). Tiles are shrunk to the target's shared memory first (`decode_fit`);
    the paged plan below only lowers stages or BLOCK_N, so it fits too."""
    head_dim_pad = head_dim_tile(head_dim)
    reason = decode_unsupported(head_dim_pad, kv_itemsize or dtype.itemsize, append, target, dtype.itemsize)
    if reason is not None:  # before any launch
        raise NotImplementedError(f"Cannot run flash_attn_with_kvcache here: {reason}.")
    rows = (nheads // nheads_k) * seqlen_q
    config = decode_config(head_dim_pad, dtype, target, rows, seqlen_q if append else 0)
    block_h = min(max(16, triton.next_power_of_2(rows)), max(16, config.max_rows))
    wanted_new = min(config.block_n, max(16, triton.next_power_of_2(seqlen_q)))
    block_h, block_n, num_stages, fitted_new = decode_fit(
        head_dim_pad, kv_itemsize or dtype.itemsize, block_h, config.block_n, config.num_stages,
        wanted_new if append else 0, target, dtype.itemsize)
    block_new = fitted_new if append else wanted_new  # unused without an append
    config = dataclasses.replace(config, block_n=block_n, num_stages=num_stages)
    row_blocks = triton.cdiv(rows, block_h)
    programs = batch * nheads_k * row_blocks
    # the keys a request's splits cover: the whole cache, or a window's band from its first key block on
    span = seqlen_cache if window_left < 0 else min(seqlen_cache, window_left + seqlen_q + block_n)
    if num_splits == 0:
        num_splits = decode_num_splits(programs, span, block_n, target, page_size > 0, kv_itemsize == 1, config.waves)
    if page_size:  # [Note] Paged pipelining (jit/decode.py): an unsplit grid may change BLOCK_N, never the splits
        block_n, num_stages = decode_paged_tiles(config, page_size, programs, num_splits, span, target)
    blocks_total = triton.cdiv(span, block_n)
    num_splits = max(1, min(num_splits, blocks_total))  # more splits than blocks would all be empty
    blocks_per_split = triton.cdiv(max(blocks_total, 1), num_splits)
    num_splits = triton.cdiv(max(blocks_total, 1), blocks_per_split)
    block_new = min(block_new, block_n)
    return DecodePlan(
        head_dim_pad=head_dim_pad, block_h=block_h, block_n=block_n, block_new=block_new,
        num_warps=config.num_warps, num_stages=num_stages, num_splits=num_splits,
        split_n=blocks_per_split * block_n, grid=(programs, num_splits),
        splits_pad=max(2, triton.next_power_of_2(num_splits)), pdl=num_splits > 1 and decode_use_pdl(target),
        max_registers=decode_max_registers(config.num_warps, num_stages, page_size > 0, programs * num_splits, target),
    )


def early_new(append: bool, paged: bool, page_size: int, block_n: int, num_splits: int) -> bool:
    """Whether the last split loads its first chunk of new rows at its start (EARLY_NEW, see
    [Note] Fused append in kernels/tritonattn/jit/decode.py): dense caches, pools of whole key blocks per
    page (P % BLOCK_N == 0), and pools that gather a key block from several pages (P = 16, 48 at
    BLOCK_N 64) when the cache is split. Unsplit, the gathering kernel keeps the late loads: there
    the early tiles' extra registers per thread cost more than the round trip they save, while split
    shapes gain (docs/perf-notes.md, Decode, "Early new row")."""
    return append and (not paged or page_size % block_n == 0 or num_splits > 1)


def one_loop(blocks_per_split: int, gathers: bool) -> bool:
    """Whether each split streams all its blocks through the masked loop (ONE_LOOP, see [Note] One
    loop for short splits in jit/decode.py): splits of up to DECODE_ONE_LOOP_MAX_BLOCKS blocks, or of up to
    DECODE_ONE_LOOP_MAX_BLOCKS_GATHER when a key block gathers its rows from several pages."""
    return blocks_per_split <= (DECODE_ONE_LOOP_MAX_BLOCKS_GATHER if gathers else DECODE_ONE_LOOP_MAX_BLOCKS)


def signature(q, k_cache, v_cache, k, v, block_table) -> tuple:
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


def aligned_bits(*tensors: torch.Tensor) -> int:
    """Bit i set when tensors[i]'s data pointer is 16-byte aligned (Triton specialises on it)."""
    bits = 0
    for i, t in enumerate(tensors):
        if t.data_ptr() % 16 == 0:
            bits |= 1 << i
    return bits


def chunked_prefill_pays(batch: int, seqlen_q: int, nheads: int, head_dim: int, dtype: torch.dtype, causal: bool,
                          target: Optional[Target]) -> bool:
    """Whether a num_splits=0 call runs the prefill path (see [Note] Chunked prefill): at least
    CHUNKED_PREFILL_MIN_SEQLEN_Q new tokens per request, and enough (query block, batch, head)
    programs for the prefill grid to fill CHUNKED_PREFILL_MIN_WAVE of the SMs (the prefill kernel
    does not split the keys, so a smaller grid leaves SMs idle while the decode kernel would split)."""
    if seqlen_q < tables.CHUNKED_PREFILL_MIN_SEQLEN_Q:  # read per call: tuning sets it
        return False
    return prefill_programs_fill(batch, seqlen_q, nheads, head_dim, dtype, causal, target)


@functools.lru_cache(maxsize=256)
def prefill_programs_fill(batch: int, seqlen_q: int, nheads: int, head_dim: int, dtype: torch.dtype, causal: bool,
                           target: Optional[Target]) -> bool:
    block_m = prefill_fwd_config(head_dim_tile(head_dim), dtype, causal, target).block_m
    sm_count = planning_sm_count(target)
    return triton.cdiv(seqlen_q, block_m) * batch * nheads >= tables.CHUNKED_PREFILL_MIN_WAVE * sm_count


DESCALE_ARGS = ("K_descale", "stride_kds", "stride_kdh", "V_descale", "stride_vds", "stride_vdh")


def _launch_append(k_cache, v_cache, k, v, cache_seqlens, block_table, options: AttnOptions, key,
                   tensors: dict) -> None:
    """Write the new tokens k, v (B, M, H_KV, D) into the cache at cache_seqlens[b] (chunked prefill;
    an FP8 cache's rows quantized with the descales in `tensors`); key: the call's signature and
    alignment (see kernels/tritonattn/launch/fast.py)."""
    batch, seqlen_new, nheads_k, _ = k.shape
    block = row_block(seqlen_new)
    if block_table is None:
        capacity, paging, paged, page_size = k_cache.shape[1], (None, None, None), False, 1
    else:
        capacity = block_table.shape[1] * k_cache.shape[1]
        paging, paged, page_size = (block_table, block_table.stride(0), k_cache.shape[0]), True, k_cache.shape[1]
    args = (k_cache, v_cache, k, v, cache_seqlens,
            *k_cache.stride()[:3], *v_cache.stride()[:3], *k.stride()[:3], *v.stride()[:3],
            nheads_k, seqlen_new, capacity, *paging)
    kwargs = dict(**options.tile, BLOCK=block, PAGED=paged, PAGE_SIZE=page_size,
                  WIDE_PAGES=paged and wide_pages(page_size, k_cache, v_cache))
    if options.kv_fp8:
        kwargs.update(KV_FP8=True, Saturated=tensors.get("Saturated"), **{name: tensors[name] for name in DESCALE_ARGS})
    append_launcher(key, (triton.cdiv(seqlen_new, block), batch * nheads_k, 1), args, 4, kwargs=kwargs,
                          device_index=k.device.index if k.device.index is not None else 0)


def launch_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: Optional[torch.Tensor],
    v: Optional[torch.Tensor],
    cache_seqlens: torch.Tensor,
    options: AttnOptions,
    num_splits: int,
    return_softmax_lse: bool,
    block_table: Optional[torch.Tensor] = None,
    sig: Optional[tuple] = None,
    replay_key: Optional[tuple] = None,
    cache_leftpad: Optional[torch.Tensor] = None,
    tensors: Optional[dict] = None,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Allocate and launch on validated inputs (cache_seqlens: int32 (batch,) on q's device;
    block_table: None for a dense cache, else int32 (batch, max_blocks_per_seq) on q's device;
    sig: `signature` of the call when the caller has it; replay_key: when given, the decode
    launches are recorded as a `Replay` under it, for the caller's next call of that key;
    cache_leftpad: None, or int32 (batch,) contiguous on q's device, with a dense cache or a one-page
    table (cache_batch_idx), see [Note] Left padding in kernels/tritonattn/jit/decode.py; never replayed;
    tensors: the per-call tensors' kernel arguments (`AttnCall.tensors`: ALiBi slopes, sinks); calls with them are never
    replayed)."""
    batch, seqlen_q, nheads, head_dim = q.shape
    device = q.device
    append = k is not None
    tensors = tensors or {}
    if tensors:  # tensors the replays carry no pointer for
        replay_key = None
    descales = ()  # an FP8 cache's descales (and counter) are pointers Triton specialises on
    if options.kv_fp8:
        descales = (aligned_bits(tensors["K_descale"], tensors["V_descale"], tensors.get("Saturated", q)),)
    if options.tree:  # the tree mask's tensors likewise
        descales += (aligned_bits(tensors["Tree"], tensors["Tree_start"], tensors["Tree_n"]),)
    if sig is None:
        sig = signature(q, k_cache, v_cache, k, v, block_table)
    target = device_target(device)
    if batch > 0 and num_splits == 0 and not options.tree and chunked_prefill_pays(
            batch, seqlen_q, nheads, head_dim, q.dtype, options.causal, target):  # a tree: the decode kernel
        # Kernels specialise on shapes and strides (sig) and on 16-byte pointer alignment; the table
        # on the device may be a copy of the caller's, with its own stride.
        key = (sig, aligned_bits(q, k_cache, v_cache, k if append else q, v if append else q, cache_seqlens,
                             block_table if block_table is not None else q),
               block_table.stride(0) if block_table is not None else None) + descales
        if cache_leftpad is not None:
            key += (aligned_bits(cache_leftpad),)
        ctx = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
        with ctx:
            if append:
                _launch_append(k_cache, v_cache, k, v, cache_seqlens, block_table, options, key, tensors)
            out, lse = launch_cache_prefill(q, k_cache, v_cache, cache_seqlens, k.shape[1] if append else 0,
                                                   block_table, options, launch_key=key, cache_leftpad=cache_leftpad,
                                                   tensors={n: t for n, t in tensors.items() if n != "Saturated"})
        return out, (lse if return_softmax_lse else None)

    seqlen_cache, nheads_k = k_cache.shape[1], k_cache.shape[2]
    if block_table is not None:  # the logical capacity of a request; k_cache.shape[1] is the page size
        seqlen_cache = block_table.shape[1] * k_cache.shape[1]
    plan = plan_decode(batch, seqlen_q, nheads, nheads_k, head_dim, seqlen_cache, q.dtype, target, num_splits,
                 k_cache.shape[1] if block_table is not None else 0, append, options.window_left,
                 k_cache.element_size())

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
            scratch = split_scratch(scratch_numel, device, device_index)
        out_part, lse_part = scratch[: part_rows * head_dim], scratch[part_rows * head_dim: scratch_numel]
    else:
        out_part = lse_part = out  # unused
    k_arg, v_arg = (k, v) if append else (k_cache, k_cache)  # unused pointers without an append
    lse_arg = lse if lse is not None else out  # unused when STORE_LSE is False
    store_lse = lse is not None

    # Kernels specialise on shapes/strides (sig), constexprs (which LaunchCache adds to the key) and
    # 16-byte pointer alignment. The outputs and scratch are fresh allocations (always aligned), so
    # only the inputs' alignment counts.
    if block_table is None:  # dense: the paging arguments are None, i.e. constexprs the kernel never reads
        paging, paged, page_size = (None, None, None), False, 1
        aligned = aligned_bits(q, k_cache, v_cache, k_arg, v_arg, cache_seqlens)
        key = (sig, aligned)
    else:  # the table on the device may be a copy of the caller's: its own stride
        paging, paged, page_size = (block_table, block_table.stride(0), k_cache.shape[0]), True, k_cache.shape[1]
        aligned = aligned_bits(q, k_cache, v_cache, k_arg, v_arg, cache_seqlens, block_table)
        key = (sig, aligned, block_table.stride(0))
    key += descales
    if cache_leftpad is not None:  # [Note] Left padding (jit/decode.py); such calls are never replayed
        key += (aligned_bits(cache_leftpad),)
        replay_key = None
    decode_grid = (plan.grid[0], plan.grid[1], 1)
    decode_args = (
        q, k_cache, v_cache, k_arg, v_arg, cache_seqlens, out, lse_arg, out_part, lse_part,
        *q.stride()[:3], *k_cache.stride()[:3], *v_cache.stride()[:3], *k_arg.stride()[:3], *v_arg.stride()[:3],
        nheads_k, nheads // nheads_k, seqlen_q, k.shape[1] if append else 0, seqlen_cache, plan.split_n,
    )
    decode_kwargs = dict(
        **options.runtime, Block_table=paging[0], stride_btb=paging[1], NUM_BLOCKS=paging[2], **options.constexprs,
        BLOCK_H=plan.block_h, BLOCK_N=plan.block_n, BLOCK_NEW=plan.block_new,
        APPEND=append, SPLIT=split, STORE_LSE=store_lse, PAGED=paged, PAGE_SIZE=page_size,
        WIDE_PAGES=paged and wide_pages(page_size, k_cache, v_cache),
        EARLY_NEW=early_new(append, paged, page_size, plan.block_n, plan.num_splits),
        ONE_LOOP=one_loop(plan.split_n // plan.block_n, paged and page_size % plan.block_n != 0), USE_PDL=plan.pdl,
        Cache_leftpad=cache_leftpad, HAS_LEFTPAD=cache_leftpad is not None, **tensors,
    )
    combine_grid = (batch * nheads * seqlen_q, 1, 1)
    combine_args = (out_part, lse_part, out, lse_arg, nheads, seqlen_q, plan.num_splits)
    combine_kwargs = dict(**options.tile, SPLITS_PAD=plan.splits_pad, STORE_LSE=store_lse, USE_PDL=plan.pdl,
                          Sinks=tensors.get("Sinks"), HAS_SINKS=options.sinks)
    combine_warps = combine_num_warps(plan.splits_pad, plan.head_dim_pad)
    with ctx:
        decode_key = decode_launcher(key, decode_grid, decode_args, plan.num_warps, plan.num_stages, decode_kwargs,
                                    device_index=device_index, maxnreg=plan.max_registers)
        if split:
            combine_key = combine_launcher(key, combine_grid, combine_args, combine_warps, 1, combine_kwargs,
                                          device_index=device_index, launch_pdl=plan.pdl)
    if replay_key is not None and aligned == (1 << (7 if paged else 6)) - 1:
        launches = (replay_template(decode_launcher, decode_key, decode_grid, decode_args, decode_kwargs,
                                     DECODE_SOURCES, options),)
        if split:
            launches += (replay_template(combine_launcher, combine_key, combine_grid, combine_args, combine_kwargs,
                                          COMBINE_SOURCES, options),)
        if all(launch is not None for launch in launches):
            REPLAYS.put(replay_key, Replay(
                device_index=device_index, device=device,
                lse_shape=tuple(lse.shape) if lse is not None else None, scratch_numel=scratch_numel,
                lse_part_offset=part_rows * head_dim * 4, launches=launches,
            ))
    return out, lse
