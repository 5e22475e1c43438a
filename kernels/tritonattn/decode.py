"""Decode attention: the launcher and public function `flash_attn_with_kvcache` of the decode kernels
in kernels/tritonattn/decode_kernels.py (KV-cache decode with per-request lengths, fused in-place append, GQA
read-once, split-KV, dense or paged caches), and the dispatch of long chunks to the prefill kernels
(chunked prefill). The KV-cache helpers built on it are in kernels/tritonattn/kv_cache.py.

[Note] Host overhead. A decode step is a few microseconds of GPU time, so the wrapper caches all it
can. The full path: the validation of a call's tensors per signature (shapes, strides, dtypes,
devices: `_signature`; values and pointers are still checked every call), the launch plan per shape
(`_plan`), the int -> tensor conversion of cache_seqlens, and the compiled kernels, launched through
their C launchers without Triton's per-call dispatch (`LaunchCache`, kernels/tritonattn/_launch.py, keyed by
the signature and the inputs' 16-byte alignment, plus what the arguments show: every constexpr, the
integers' classes, the launch options). A call that repeats a validated one -- same signature,
cache_seqlens (and block_table) already on the GPU with the same layout, the same compiled options
(`options.compiled`), num_splits and return_softmax_lse -- replays it (`_Replay`): the recorded
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
launch on Hopper and newer (`decode_use_pdl`, kernels/tritonattn/_configs.py): every decode program signals at
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
mode (IS_KVCACHE, see kernels/tritonattn/prefill_kernels.py) attends over each request's min(L_b + M, N_CACHE) keys,
read from the cache: BLOCK_M x BLOCK_N tiles on tensor cores, tensor-descriptor loads on Hopper
for dense caches and for pools whose page size is a multiple of BLOCK_N. Two launches, both free of
host syncs, so a chunk step can be captured in a CUDA graph too. When (`_chunked_prefill_pays`):
at least 128 new tokens, below which the decode kernel's GQA read-once wins, and a prefill grid
(query blocks x batch x heads) of at least 0.8 x the SM count, since the prefill kernel does not
split the keys and a small grid leaves SMs idle where the decode kernel splits. Both thresholds sit
where the two paths cross over on an H200 (benchmarks/tune_decode.py; docs/perf-notes.md, Chunked
prefill, "Dispatch").

[Note] Lengths on the device. cache_seqlens is read by the kernel, clamped to [0, N_CACHE]: a bad
device length can give wrong results but never a read or write outside the buffers; appends past
N_CACHE are dropped. Lengths known on the host (an int, a CPU tensor, KVCache, PagedKVCache) are
checked before launch and overflow raises ValueError. cache_leftpad likewise: a device tensor is
clamped to [0, cache_seqlens[b]] in the kernels, a CPU one checked on the host (`_resolve_cache_leftpad`).

"""

from __future__ import annotations

import contextlib
import functools
import numbers
import threading
from typing import NamedTuple, Optional, Sequence, Tuple, Union

import numpy as np
import torch
import triton

from ._configs import (
    DECODE_ONE_LOOP_MAX_BLOCKS,
    DECODE_ONE_LOOP_MAX_BLOCKS_GATHER,
    DecodeConfig,
    decode_config,
    decode_fit,
    decode_max_registers,
    decode_num_splits,
    decode_paged_tiles,
    decode_unsupported,
    decode_use_pdl,
    planning_sm_count,
    prefill_fwd_config,
)
from ._jit import wide_pages
from ._launch import DirectLaunch, LaunchCache, launch_hooks_active, recording_active
from ._options import AttnOptions, attn_options, head_dim_tile, resolve_variants
from ._utils import (
    Target,
    _check_block_table_entries,
    _validate_devices,
    _validate_dtypes,
    _validate_head_dim,
    _validate_heads,
    _validate_tensor,
    device_target,
    is_interpreter,
)
from .decode_kernels import append_kernel, combine_kernel, decode_kernel
from .errors import InputError, InputTypeError
from .prefill import TRACED, _flash_attn_kvcache_forward, variant_args
from .rotary import apply_rotary

# With num_splits=0, flash_attn_with_kvcache runs the prefill kernel family instead of the decode
# kernel from this many new tokens per request on, when the prefill grid also fills this fraction of
# the SMs (`_chunked_prefill_pays`, see [Note] Chunked prefill).
CHUNKED_PREFILL_MIN_SEQLEN_Q = 128
CHUNKED_PREFILL_MIN_WAVE = 0.8


# ============================================================================================
# Launcher: validate, allocate, launch
# ============================================================================================
_launch_decode = LaunchCache(decode_kernel)
_launch_combine = LaunchCache(combine_kernel)
_launch_append_kernel = LaunchCache(append_kernel)


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
          dtype: torch.dtype, target: Optional[Target], num_splits: int, page_size: int = 0,
          append: bool = False, window_left: int = -1) -> _Plan:
    """The launch plan on `target` (`device_target`; None: the interpreter); page_size 0 for a dense
    cache, else the pool's page size (seqlen_cache is then a request's capacity, max_blocks_per_seq *
    page_size); append: the call writes seqlen_q new rows (their K/V tiles take shared memory too);
    window_left >= 0: a sliding window's left side, whose band of at most window_left + seqlen_q
    cached keys the splits tile instead of the whole cache ([Note] Variants in decode,
    kernels/tritonattn/decode_kernels.py). Tiles are shrunk to the target's shared memory first (`decode_fit`);
    the paged plan below only lowers stages or BLOCK_N, so it fits too."""
    head_dim_pad = head_dim_tile(head_dim)
    reason = decode_unsupported(head_dim_pad, dtype.itemsize, append, target)
    if reason is not None:  # before any launch
        raise NotImplementedError(f"Cannot run flash_attn_with_kvcache here: {reason}.")
    config = decode_config(head_dim_pad, dtype, target)
    rows = (nheads // nheads_k) * seqlen_q
    block_h = min(max(16, triton.next_power_of_2(rows)), max(16, config.max_rows))
    wanted_new = min(config.block_n, max(16, triton.next_power_of_2(seqlen_q)))
    block_h, block_n, num_stages, fitted_new = decode_fit(
        head_dim_pad, dtype.itemsize, block_h, config.block_n, config.num_stages, wanted_new if append else 0, target)
    block_new = fitted_new if append else wanted_new  # unused without an append
    config = DecodeConfig(block_n, config.num_warps, num_stages, config.max_rows)
    row_blocks = triton.cdiv(rows, block_h)
    programs = batch * nheads_k * row_blocks
    # the keys a request's splits cover: the whole cache, or a window's band from its first key block on
    span = seqlen_cache if window_left < 0 else min(seqlen_cache, window_left + seqlen_q + block_n)
    if num_splits == 0:
        num_splits = decode_num_splits(programs, span, block_n, target, page_size > 0)
    if page_size:  # [Note] Paged pipelining (decode_kernels.py): an unsplit grid may change BLOCK_N, never the splits
        block_n, num_stages = decode_paged_tiles(config, page_size, programs, num_splits, span, target)
    blocks_total = triton.cdiv(span, block_n)
    num_splits = max(1, min(num_splits, blocks_total))  # more splits than blocks would all be empty
    blocks_per_split = triton.cdiv(max(blocks_total, 1), num_splits)
    num_splits = triton.cdiv(max(blocks_total, 1), blocks_per_split)
    block_new = min(block_new, block_n)
    return _Plan(
        head_dim_pad=head_dim_pad, block_h=block_h, block_n=block_n, block_new=block_new,
        num_warps=config.num_warps, num_stages=num_stages, num_splits=num_splits,
        split_n=blocks_per_split * block_n, grid=(programs, num_splits),
        splits_pad=max(2, triton.next_power_of_2(num_splits)), pdl=num_splits > 1 and decode_use_pdl(target),
        max_registers=decode_max_registers(config.num_warps, num_stages, page_size > 0, programs * num_splits, target),
    )


def _early_new(append: bool, paged: bool, page_size: int, block_n: int, num_splits: int) -> bool:
    """Whether the last split loads its first chunk of new rows at its start (EARLY_NEW, see
    [Note] Fused append in kernels/tritonattn/decode_kernels.py): dense caches, pools of whole key blocks per
    page (P % BLOCK_N == 0), and pools that gather a key block from several pages (P = 16, 48 at
    BLOCK_N 64) when the cache is split. Unsplit, the gathering kernel keeps the late loads: there
    the early tiles' extra registers per thread cost more than the round trip they save, while split
    shapes gain (docs/perf-notes.md, Decode, "Early new row")."""
    return append and (not paged or page_size % block_n == 0 or num_splits > 1)


def _one_loop(blocks_per_split: int, gathers: bool) -> bool:
    """Whether each split streams all its blocks through the masked loop (ONE_LOOP, see [Note] One
    loop for short splits in decode_kernels.py): splits of up to DECODE_ONE_LOOP_MAX_BLOCKS blocks, or of up to
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


def _resolve_cache_seqlens(cache_seqlens, batch: int, seqlen_new: int, seqlen_cache: int,
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
            _check_host_lengths(cache_seqlens, seqlen_new, seqlen_cache, capacity)
            return cache_seqlens if device.type == "cpu" else cache_seqlens.to(device)
        if cache_seqlens.device != device:
            raise InputError(
                f"Expected cache_seqlens on {device} (or on the CPU), got it on {cache_seqlens.device}."
            )
        return cache_seqlens
    if isinstance(cache_seqlens, numbers.Integral) and not isinstance(cache_seqlens, bool):
        value = int(cache_seqlens)
        _check_host_lengths(value, seqlen_new, seqlen_cache, capacity)
        return _filled_seqlens(value, batch, device)
    raise InputTypeError(f"Expected cache_seqlens to be an int or an int32 tensor, got {type(cache_seqlens).__name__}.")


def _resolve_cache_leftpad(cache_leftpad, q, k_cache, cache_seqlens) -> torch.Tensor:
    """Validate cache_leftpad (int32 (batch,), on q's device or on the CPU) and return it contiguous on
    q's device. A CPU cache_leftpad is checked on the host: 0 <= cache_leftpad[b] <= cache_seqlens[b]
    when the lengths are host-known too (None: seqlen_cache, an int, a CPU tensor), else <= seqlen_cache.
    A device tensor is trusted: the kernels clamp each entry into [0, cache_seqlens[b]] (no host sync)."""
    _validate_tensor("q", q, 4, "(batch, seqlen_q, nheads, headdim)")
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
    _validate_tensor("k_cache", k_cache, 4, "(batch, seqlen_cache, nheads_k, headdim)")
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


def _resolve_paging(block_table, cache_seqlens, batch: int, seqlen_new: int, k_cache: torch.Tensor,
                    device: torch.device, window_left: int = -1,
                    seqlen_q: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
    """Validate a paged call's block_table and cache_seqlens; return both on `device`.

    Checks on the host what is host-visible: the lengths (overflow past max_blocks_per_seq *
    page_size) and a CPU block_table's entries (`_check_block_table_entries`; with a window's left
    side and seqlen_q, not the pages before each request's band), then copies them to the GPU. A
    block_table already on the GPU is used as is (the kernel clamps its entries).
    """
    _validate_tensor("block_table", block_table, 2, "(batch, max_blocks_per_seq)")
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
    seqlens = _resolve_cache_seqlens(cache_seqlens, batch, seqlen_new, capacity, device,
                                     f"max_blocks_per_seq * page_size = {block_table.shape[1]} * {page_size}")
    if block_table.device.type == "cpu":  # host-visible: check the entries this call uses, then copy
        if isinstance(cache_seqlens, torch.Tensor):
            host_lengths = cache_seqlens if cache_seqlens.device.type == "cpu" else None
        else:
            host_lengths = int(cache_seqlens)
        _check_block_table_entries(block_table, host_lengths, seqlen_new, page_size, num_blocks, window_left,
                                   seqlen_q)
        return seqlens, (block_table if device.type == "cpu" else block_table.to(device))
    if block_table.device != device:
        raise InputError(f"Expected block_table on {device} (or on the CPU), got it on {block_table.device}.")
    return seqlens, block_table


def _validate_kvcache_inputs(q, k_cache, v_cache, k, v, paged: bool = False) -> None:
    _validate_tensor("q", q, 4, "(batch, seqlen_q, nheads, headdim)")
    layout = "(num_blocks, page_size, nheads_k, headdim)" if paged else "(batch, seqlen_cache, nheads_k, headdim)"
    _validate_tensor("k_cache", k_cache, 4, layout)
    _validate_tensor("v_cache", v_cache, 4, layout)
    if (k is None) != (v is None):
        raise InputError("Expected k and v to be both given (append, then attend) or both None (attend only).")
    if k is not None:
        layout = "(batch, seqlen_new, nheads_k, headdim)"
        _validate_tensor("k", k, 4, layout)
        _validate_tensor("v", v, 4, layout)
    _validate_dtypes(q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v)
    _validate_devices(q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v)
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
    _validate_head_dim(head_dim)
    _validate_heads(nheads, k_cache.shape[2])
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
                          target: Optional[Target]) -> bool:
    """Whether a num_splits=0 call runs the prefill path (see [Note] Chunked prefill): at least
    CHUNKED_PREFILL_MIN_SEQLEN_Q new tokens per request, and enough (query block, batch, head)
    programs for the prefill grid to fill CHUNKED_PREFILL_MIN_WAVE of the SMs (the prefill kernel
    does not split the keys, so a smaller grid leaves SMs idle while the decode kernel would split)."""
    if seqlen_q < CHUNKED_PREFILL_MIN_SEQLEN_Q:
        return False
    return _prefill_programs_fill(batch, seqlen_q, nheads, head_dim, dtype, causal, target)


@functools.lru_cache(maxsize=256)
def _prefill_programs_fill(batch: int, seqlen_q: int, nheads: int, head_dim: int, dtype: torch.dtype, causal: bool,
                           target: Optional[Target]) -> bool:
    block_m = prefill_fwd_config(head_dim_tile(head_dim), dtype, causal, target).block_m
    sm_count = planning_sm_count(target)
    return triton.cdiv(seqlen_q, block_m) * batch * nheads >= CHUNKED_PREFILL_MIN_WAVE * sm_count


def _launch_append(k_cache, v_cache, k, v, cache_seqlens, block_table, options: AttnOptions, key) -> None:
    """Write the new tokens k, v (B, M, H_KV, D) into the cache at cache_seqlens[b] (chunked prefill);
    key: the call's signature and alignment (see kernels/tritonattn/_launch.py)."""
    batch, seqlen_new, nheads_k, _ = k.shape
    block = min(64, max(16, triton.next_power_of_2(seqlen_new)))
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
    _launch_append_kernel(key, (triton.cdiv(seqlen_new, block), batch * nheads_k, 1), args, 4, kwargs=kwargs,
                          device_index=k.device.index if k.device.index is not None else 0)


def _split_scratch(numel: int, device: torch.device, device_index: int) -> torch.Tensor:
    """fp32 scratch of at least `numel` elements for the split partials, reused by the calling
    thread's calls on the current stream of `device_index` (the current device).

    One thread's calls on one stream are issued one after the other and run in stream order, so a
    call's decode kernel writes the scratch only after the previous call's combine kernel has read
    it. Another thread may issue its launches between a call's two, so each thread keeps its own
    (thread-local: freed with the thread). Scratch above SPLIT_SCRATCH_CACHE_BYTES is allocated per
    call, not kept. While a CUDA graph is being captured a fresh allocation is made (from the graph's
    pool), so graph replays never share scratch with eager calls; the same inside `uncached_scratch`
    (the custom ops of kernels/tritonattn/_ops.py: a compiled graph's memory is torch.compile's, and a CUDA-graph
    tree refuses a tensor its warmup allocated that outlives the call).
    """
    if (device.type != "cuda" or numel * 4 > SPLIT_SCRATCH_CACHE_BYTES
            or torch.cuda.is_current_stream_capturing() or _SCRATCH_LOCAL.uncached):
        return torch.empty(numel, dtype=torch.float32, device=device)
    buffers = _SCRATCH_LOCAL.buffers
    if buffers is None:
        buffers = _SCRATCH_LOCAL.buffers = {}
    slot = (device_index, torch._C._cuda_getCurrentRawStream(device_index))
    scratch = buffers.get(slot)
    if scratch is None or scratch.numel() < numel:
        scratch = buffers[slot] = torch.empty(numel, dtype=torch.float32, device=device)
    return scratch


SPLIT_SCRATCH_CACHE_BYTES = 64 * 2**20  # larger split scratch is allocated per call, not kept


class _ScratchLocal(threading.local):
    """A thread's split scratch state; class defaults, so that reading an unset one costs no exception."""

    buffers: Optional[dict] = None  # (device index, raw stream) -> the largest scratch used there
    uncached: bool = False  # True inside `uncached_scratch`


_SCRATCH_LOCAL = _ScratchLocal()


@contextlib.contextmanager
def uncached_scratch():
    """Split scratch is allocated per call inside (see `_split_scratch`)."""
    before = _SCRATCH_LOCAL.uncached
    _SCRATCH_LOCAL.uncached = True
    try:
        yield
    finally:
        _SCRATCH_LOCAL.uncached = before


class _Replay(NamedTuple):
    """A validated CUDA call's decode (+ combine) launches, replayed with the next call's pointers:
    what `flash_attn_with_kvcache` runs for a repeated call instead of validating, planning and
    building arguments again, see [Note] Host overhead. Each launch keeps its full argument list as a
    template, pointer slots (position, source): source indexes the call's pointers in the order q,
    k_cache, v_cache, k, v, cache_seqlens, block_table, out, lse, out_part, lse_part; and option slots
    (position, name): the call's `options.runtime[name]` goes there."""

    device_index: int
    device: torch.device
    lse_shape: Optional[Tuple[int, ...]]
    scratch_numel: int  # 0 without a split
    lse_part_offset: int  # bytes from the scratch's start to the partial LSEs
    launches: Tuple[Tuple[DirectLaunch, Tuple[int, int, int], list, Tuple[Tuple[int, int], ...],
                          Tuple[Tuple[int, str], ...]], ...]


_REPLAYS: dict = {}  # `_replay_key` -> _Replay
_REPLAYS_MAX = 1024
# the current CUDA device's index: torch.cuda.current_device() without its Python wrapper (about half the cost)
_current_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device


# Where a replayed launch's pointer arguments come from: kernel parameter -> index into the call's
# pointers (q, k_cache, v_cache, k, v, cache_seqlens, block_table, out, lse, out_part, lse_part; the
# full path's stand-ins for unused ones: k_cache for k/v without an append, out for lse without
# return_softmax_lse and for the partials without a split).
_DECODE_SOURCES = {"Q": 0, "K_cache": 1, "V_cache": 2, "K_new": 3, "V_new": 4, "Cache_seqlens": 5,
                   "Block_table": 6, "Out": 7, "Lse": 8, "Out_part": 9, "Lse_part": 10}
_COMBINE_SOURCES = {"Out_part": 9, "Lse_part": 10, "Out": 7, "Lse": 8}


def _replay_template(launch: LaunchCache, key, grid, args: Sequence, kwargs: dict, sources: dict,
                     options: AttnOptions):
    """(direct launch, grid, argument template, pointer slots, option slots) for the launch of `launch`
    stored under `key`, made with `args` and `kwargs`: each tensor argument's position gets the call
    pointer that `sources` names for its parameter, whatever tensor the recorded call passed there
    (so tensors aliased in that call, e.g. k is v, are not frozen into the replay), and each runtime
    option's position gets the replayed call's value. The template holds no tensor (its slots are 0
    until a call fills them), so a recording keeps no tensor alive. None when the kernel has no
    direct launch or a tensor parameter has no source."""
    direct = launch.direct(key)
    if direct is None:
        return None
    names = launch.names
    template, slots = launch.positional(args, kwargs), []
    for i in direct.pointers:
        j = sources.get(names[i])
        if j is None:
            return None
        template[i] = 0
        slots.append((i, j))
    option_slots = tuple((i, name) for i, name in enumerate(names) if name in options.runtime)
    return direct, grid, template, tuple(slots), option_slots


def _replay(r: _Replay, q, k_cache, v_cache, k, v, cache_seqlens, block_table, options: AttnOptions):
    """Run a repeated call through its `_Replay`: (out, lse), or None when this call's pointers are
    not all 16-byte aligned (the kernels were compiled for aligned ones), the current device is not
    the call's, the fast launch is off (TRITONATTN_FAST_LAUNCH=0, LaunchCache.enabled) or launch hooks
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
    runtime = options.runtime
    stream = torch._C._cuda_getCurrentRawStream(r.device_index)
    for direct, grid, template, slots, option_slots in r.launches:
        args = template.copy()
        for i, j in slots:
            args[i] = ptrs[j]
        for i, name in option_slots:
            args[i] = runtime[name]
        direct.launch(grid, stream, args)
    return out, lse


def _replay_key(sig: tuple, cache_seqlens, options: AttnOptions, num_splits, return_softmax_lse) -> Optional[tuple]:
    """What a call must share with an earlier one to replay it: the tensors' signature, a device
    cache_seqlens' layout, the options' compiled part (their runtime part is filled into the replay)
    and the other arguments (and a window's left side, which the split plan follows); None when the call
    cannot be replayed: lengths given as an int or on the
    CPU (checked on the host every call), and arguments other than plain Python values (the full path
    converts and checks them)."""
    if type(cache_seqlens) is not torch.Tensor or type(num_splits) is not int or type(return_softmax_lse) is not bool:
        return None
    return (sig, cache_seqlens.shape, cache_seqlens.stride(), cache_seqlens.dtype, cache_seqlens.device,
            options.compiled, options.window_left, num_splits, return_softmax_lse)


def _flash_attn_with_kvcache_launch(
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
    variants: Optional[dict] = None,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Allocate and launch on validated inputs (cache_seqlens: int32 (batch,) on q's device;
    block_table: None for a dense cache, else int32 (batch, max_blocks_per_seq) on q's device;
    sig: `_signature` of the call when the caller has it; replay_key: when given, the decode
    launches are recorded as a `_Replay` under it, for the caller's next call of that key;
    cache_leftpad: None, or int32 (batch,) contiguous on q's device, with a dense cache or a one-page
    table (cache_batch_idx), see [Note] Left padding in kernels/tritonattn/decode_kernels.py; never replayed;
    variants: the ALiBi slopes' and sinks' kernel arguments, `variant_args`; calls with them are never
    replayed)."""
    batch, seqlen_q, nheads, head_dim = q.shape
    device = q.device
    append = k is not None
    variants = variants or {}
    if variants:  # tensors the replays carry no pointer for
        replay_key = None
    if sig is None:
        sig = _signature(q, k_cache, v_cache, k, v, block_table)
    target = device_target(device)
    if batch > 0 and num_splits == 0 and _chunked_prefill_pays(batch, seqlen_q, nheads, head_dim, q.dtype,
                                                               options.causal, target):
        # Kernels specialise on shapes and strides (sig) and on 16-byte pointer alignment; the table
        # on the device may be a copy of the caller's, with its own stride.
        key = (sig, _aligned(q, k_cache, v_cache, k if append else q, v if append else q, cache_seqlens,
                             block_table if block_table is not None else q),
               block_table.stride(0) if block_table is not None else None)
        if cache_leftpad is not None:
            key += (_aligned(cache_leftpad),)
        ctx = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
        with ctx:
            if append:
                _launch_append(k_cache, v_cache, k, v, cache_seqlens, block_table, options, key)
            out, lse = _flash_attn_kvcache_forward(q, k_cache, v_cache, cache_seqlens, k.shape[1] if append else 0,
                                                   block_table, options, launch_key=key, cache_leftpad=cache_leftpad,
                                                   variants=variants)
        return out, (lse if return_softmax_lse else None)

    seqlen_cache, nheads_k = k_cache.shape[1], k_cache.shape[2]
    if block_table is not None:  # the logical capacity of a request; k_cache.shape[1] is the page size
        seqlen_cache = block_table.shape[1] * k_cache.shape[1]
    plan = _plan(batch, seqlen_q, nheads, nheads_k, head_dim, seqlen_cache, q.dtype, target, num_splits,
                 k_cache.shape[1] if block_table is not None else 0, append, options.window_left)

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

    # Kernels specialise on shapes/strides (sig), constexprs (which LaunchCache adds to the key) and
    # 16-byte pointer alignment. The outputs and scratch are fresh allocations (always aligned), so
    # only the inputs' alignment counts.
    if block_table is None:  # dense: the paging arguments are None, i.e. constexprs the kernel never reads
        paging, paged, page_size = (None, None, None), False, 1
        aligned = _aligned(q, k_cache, v_cache, k_arg, v_arg, cache_seqlens)
        key = (sig, aligned)
    else:  # the table on the device may be a copy of the caller's: its own stride
        paging, paged, page_size = (block_table, block_table.stride(0), k_cache.shape[0]), True, k_cache.shape[1]
        aligned = _aligned(q, k_cache, v_cache, k_arg, v_arg, cache_seqlens, block_table)
        key = (sig, aligned, block_table.stride(0))
    if cache_leftpad is not None:  # [Note] Left padding (decode_kernels.py); such calls are never replayed
        key += (_aligned(cache_leftpad),)
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
        EARLY_NEW=_early_new(append, paged, page_size, plan.block_n, plan.num_splits),
        ONE_LOOP=_one_loop(plan.split_n // plan.block_n, paged and page_size % plan.block_n != 0), USE_PDL=plan.pdl,
        Cache_leftpad=cache_leftpad, HAS_LEFTPAD=cache_leftpad is not None, **variants,
    )
    combine_grid = (batch * nheads * seqlen_q, 1, 1)
    combine_args = (out_part, lse_part, out, lse_arg, nheads, seqlen_q, plan.num_splits)
    combine_kwargs = dict(**options.tile, SPLITS_PAD=plan.splits_pad, STORE_LSE=store_lse, USE_PDL=plan.pdl,
                          Sinks=variants.get("Sinks"), HAS_SINKS=options.sinks)
    combine_warps = 4 if plan.splits_pad * plan.head_dim_pad >= 4096 else 1
    with ctx:
        decode_key = _launch_decode(key, decode_grid, decode_args, plan.num_warps, plan.num_stages, decode_kwargs,
                                    device_index=device_index, maxnreg=plan.max_registers)
        if split:
            combine_key = _launch_combine(key, combine_grid, combine_args, combine_warps, 1, combine_kwargs,
                                          device_index=device_index, launch_pdl=plan.pdl)
    if replay_key is not None and aligned == (1 << (7 if paged else 6)) - 1:
        launches = (_replay_template(_launch_decode, decode_key, decode_grid, decode_args, decode_kwargs,
                                     _DECODE_SOURCES, options),)
        if split:
            launches += (_replay_template(_launch_combine, combine_key, combine_grid, combine_args, combine_kwargs,
                                          _COMBINE_SOURCES, options),)
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
    rotary_cos: Optional[torch.Tensor] = None,
    rotary_sin: Optional[torch.Tensor] = None,
    cache_seqlens: Optional[Union[int, torch.Tensor]] = None,
    cache_batch_idx: Optional[torch.Tensor] = None,
    cache_leftpad: Optional[torch.Tensor] = None,
    block_table: Optional[torch.Tensor] = None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    alibi_slopes: Optional[torch.Tensor] = None,
    num_splits: int = 0,
    return_softmax_lse: bool = False,
    *,
    sinks: Optional[torch.Tensor] = None,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Decode attention over a KV cache, dense or paged, with an optional in-place append, in one
    launch (flash-attn 2's `flash_attn_with_kvcache`, same signature).

    Args:
        q: (batch, seqlen_q, nheads, headdim), float16, bfloat16 or float32, any headdim in [1, 256];
            seqlen_q >= 1 (1 for plain decoding, a few for speculative-decoding verification).
        k_cache, v_cache: same dtype and device as q, any strides with a contiguous last dim; no
            copies are made; beyond 2^31 elements is fine. Query head h reads KV head
            h // (nheads // nheads_k) (MHA, GQA, MQA).
            Dense (block_table None): (batch, seqlen_cache, nheads_k, headdim), e.g. also a
            (batch, nheads_k, seqlen_cache, headdim) buffer passed as .transpose(1, 2).
            Paged (block_table given): pools (num_blocks, page_size, nheads_k, headdim), e.g. also a
            (num_blocks, nheads_k, page_size, headdim) pool passed as .transpose(1, 2). Any
            page_size >= 1 (see [Note] Paged caches in kernels/tritonattn/decode_kernels.py).
        k, v: optional (batch, seqlen_new, nheads_k, headdim), 1 <= seqlen_new <= seqlen_q: the new
            tokens' keys and values. They are written into k_cache / v_cache in place at (logical) rows
            [cache_seqlens[b], cache_seqlens[b] + seqlen_new) and attended over in the same launch; the
            queries are the last seqlen_q positions of the cache_seqlens[b] + seqlen_new keys (causal:
            bottom-right), so seqlen_new < seqlen_q verifies draft tokens with a partial append. Both or
            neither. In a paged cache each new row goes to its own page slot, so an append may cross pages.
        rotary_cos, rotary_sin: optional (seqlen_ro, rotary_dim / 2), q's dtype, rotary_dim a multiple
            of 16 <= headdim, seqlen_ro covering the cache; only with k and v. q and k are rotated
            before the append and the attention (kernels/tritonattn/rotary.py): k's token t at position
            cache_seqlens[b] + t, q's the same when causal or with a sliding window, else all at
            cache_seqlens[b], as flash-attn
            (with seqlen_new < seqlen_q that is not the queries' attention alignment, which stays
            bottom-right).
            rotary_interleaved: GPT-J pairs (2i, 2i + 1) when True, GPT-NeoX halves when False.
        cache_batch_idx: optional int32 (batch,): request b reads and appends cache row
            cache_batch_idx[b] of a dense cache with any batch (not with block_table). Duplicate
            indices with an append leave either request's rows, as in flash-attn.
        cache_leftpad: optional int32 (batch,), on q's device or on the CPU (checked, then copied):
            request b's keys are cache rows [cache_leftpad[b], cache_seqlens[b]) (flash-attn's
            convention: cache_seqlens is where the keys end, the padding included); rows before are
            padding, never read. New k/v still go at row cache_seqlens[b], rotary positions count from
            row 0 (the padding included), and causal stays bottom-right over the keys seen (see causal).
            A request padded up to its length (and no append) sees no key: zeros, LSE +inf. A CPU
            tensor is checked on the host: 0 <= cache_leftpad[b] <= cache_seqlens[b] when the lengths
            are host-known too, else <= seqlen_cache (ValueError); a GPU one is trusted and clamped into
            [0, cache_seqlens[b]] by the kernels. Dense caches only, with or without cache_batch_idx:
            with block_table it raises NotImplementedError, as flash-attn does.
        cache_seqlens: each request's cache length before this call: None (every cache full:
            seqlen_cache; not with k and v), an int (the same for every
            request) or an int32 tensor of shape (batch,), on q's device or on the CPU (checked on
            the host, then copied: use a device tensor inside a CUDA graph). It is never modified
            (advance it yourself, e.g. cache_seqlens += seqlen_new, or use KVCache / PagedKVCache).
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
        window_size, softcap, alibi_slopes: as in flash_attn_func, aligned bottom-right over each
            request's N_b keys (see causal): token t's diagonal key is t + N_b - seqlen_q. A window side
            reaching seqlen_cache (paged: max_blocks_per_seq * page_size) is unbounded. With a window's
            left side bounded, only the band's keys are read and the splits tile the band, so a long
            cache under a short window costs what the window costs ([Note] Variants in decode,
            kernels/tritonattn/decode_kernels.py).
        causal: mask aligned to the bottom-right corner over the N_b = cache_seqlens[b] + seqlen_q
            keys (cache_seqlens[b] without k/v): token t sees key j iff j <= t + N_b - seqlen_q (and,
            with cache_leftpad, j >= cache_leftpad[b]).
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
        sinks: optional float32 (nheads,): a learnable sink logit per head (gpt-oss), as in
            flash_attn_func: each row's softmax denominator gains exp(sinks[h]) (added once, also when
            the cache is split), and the LSE includes it.

    Returns:
        out: (batch, seqlen_q, nheads, headdim), dtype of q (on Hopper, when the chunked-prefill path
            runs over a cache with 16-byte aligned rows at a headdim whose rows are not, a view of an
            aligned buffer; contiguous otherwise).
        softmax_lse (if return_softmax_lse): (batch, nheads, seqlen_q) float32, natural log; +inf
            for a row that sees no key (with sinks: the sink's logit).

    No host synchronisation happens with device cache_seqlens (and block_table), so the whole step
    (append + attention) can be captured in a CUDA graph and replayed while the lengths advance on
    the device. Not supported: cache_leftpad together with a paged block_table.

    Under torch.compile the call is one graph node (kernels/tritonattn/_ops.py), the append a declared mutation
    of k_cache and v_cache. With mode="reduce-overhead" (CUDA graphs) whatever the step mutates must
    be static: k_cache, v_cache and cache_seqlens (an int32 device tensor advanced in place) must be
    the same tensors every call, marked with torch._dynamo.mark_static_address or held as module
    buffers; otherwise inductor skips CUDA graphs for the step (it logs "mutated inputs"). Lengths that
    change then recompile nothing.
    """
    if torch.compiler.is_compiling():  # one graph node, see kernels/tritonattn/_ops.py
        return TRACED["flash_attn_with_kvcache"](
            q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
            block_table, softmax_scale, causal, window_size, softcap, rotary_interleaved, alibi_slopes, num_splits,
            return_softmax_lse, sinks)
    if cache_leftpad is not None:
        if block_table is not None:
            raise NotImplementedError("cache_leftpad with a paged KV cache (block_table) is not supported (flash-attn "
                                      "refuses it too); use a dense cache, with cache_batch_idx to pick its rows.")
        cache_leftpad = _resolve_cache_leftpad(cache_leftpad, q, k_cache, cache_seqlens)
    if cache_seqlens is None and (k is not None or v is not None):
        raise InputError("Expected cache_seqlens with new k and v: the append goes at each request's length "
                         "(flash-attn's rule); None means every cache is full.")
    if cache_batch_idx is not None:
        block_table = _batch_idx_as_table(cache_batch_idx, block_table, q, k_cache)
    variants = None
    if cache_seqlens is None or type(window_size) is not tuple or window_size != (-1, -1) or softcap or (
            alibi_slopes is not None or sinks is not None or rotary_cos is not None or rotary_sin is not None):
        try:
            capacity = k_cache.shape[1] * (1 if block_table is None else block_table.shape[1])
        except (AttributeError, IndexError):  # not tensors: validation names the problem
            capacity = 0
        cache_seqlens = capacity if cache_seqlens is None else cache_seqlens
        causal, variants = _resolve_kvcache_variants(window_size, softcap, alibi_slopes, sinks, causal, capacity)
        if rotary_cos is not None or rotary_sin is not None:
            local = variants is not None and variants.window != (-1, -1)  # flash-attn's is_local, or causal
            q, k = _rotate(q, k, v, rotary_cos, rotary_sin, cache_seqlens, capacity, rotary_interleaved,
                           causal or local)
    return _kvcache_call(q, k_cache, v_cache, k, v, cache_seqlens, block_table, softmax_scale, causal, num_splits,
                         return_softmax_lse, validated=False, cache_leftpad=cache_leftpad, variants=variants)


class Variants(NamedTuple):
    """The attention variants of a KV-cache call as the public functions take them (flash-attn's
    window_size and softcap already resolved by `resolve_variants`); `_kvcache_call` turns them into
    options and kernel arguments."""

    window: Tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    alibi_slopes: Optional[torch.Tensor] = None
    sinks: Optional[torch.Tensor] = None


def _resolve_kvcache_variants(window_size, softcap, alibi_slopes, sinks, causal: bool,
                              capacity: int) -> Tuple[bool, Optional[Variants]]:
    """(causal, variants) of a KV-cache call from flash-attn's arguments (`resolve_variants`, a window
    side reaching the capacity unbounded); variants None when there are none."""
    resolved = resolve_variants(window_size, softcap, causal, capacity)
    causal = attn_options(16, None, **resolved).causal  # (-1, 0) is causal
    if resolved["window"] == (-1, -1) and not resolved["softcap"] and alibi_slopes is None and sinks is None:
        return causal, None
    return causal, Variants(resolved["window"], resolved["softcap"], alibi_slopes, sinks)


def _batch_idx_as_table(cache_batch_idx, block_table, q, k_cache) -> torch.Tensor:
    """cache_batch_idx as a block table: a dense cache (batch_cache, seqlen_cache, ...) is a pool of
    batch_cache pages of seqlen_cache rows, and request b's one page is cache_batch_idx[b]."""
    if block_table is not None:
        raise InputError("Expected cache_batch_idx or block_table, not both (flash-attn's rule: a paged cache "
                         "has no batch index).")
    if isinstance(cache_batch_idx, torch.Tensor):
        cache_batch_idx = cache_batch_idx.contiguous()
    _validate_tensor("cache_batch_idx", cache_batch_idx, 1, "(batch,)")
    _validate_tensor("k_cache", k_cache, 4, "(batch_cache, seqlen_cache, nheads_k, headdim)")
    if cache_batch_idx.dtype != torch.int32:
        raise InputTypeError(f"Expected cache_batch_idx of dtype int32, got {cache_batch_idx.dtype}.")
    if cache_batch_idx.shape[0] != q.shape[0]:
        raise InputError(f"Expected cache_batch_idx of shape ({q.shape[0]},), got {tuple(cache_batch_idx.shape)}.")
    if cache_batch_idx.device.type == "cpu" and cache_batch_idx.numel() and not (
            0 <= int(cache_batch_idx.min()) and int(cache_batch_idx.max()) < k_cache.shape[0]):
        raise InputError(f"Expected cache_batch_idx entries in [0, {k_cache.shape[0]}) (the cache's batch), got "
                         f"{cache_batch_idx.tolist()}.")
    return cache_batch_idx.reshape(-1, 1).contiguous()


def _rotate(q, k, v, rotary_cos, rotary_sin, cache_seqlens, capacity: int, interleaved: bool, positional: bool):
    """q and k rotated as flash-attn rotates them (kernels/tritonattn/rotary.py): k's token t at position
    cache_seqlens[b] + t; q's the same when `positional` (causal or a sliding window, flash-attn's rule),
    else every token at cache_seqlens[b]."""
    if rotary_cos is None or rotary_sin is None:
        raise InputError("Expected rotary_cos and rotary_sin together.")
    if k is None or v is None:
        raise InputError("Expected new k and v with rotary_cos / rotary_sin: the rotary embedding applies to the "
                         "appended keys (flash-attn's rule).")
    _validate_tensor("q", q, 4, "(batch, seqlen_q, nheads, headdim)")
    _validate_tensor("k", k, 4, "(batch, seqlen_new, nheads_k, headdim)")
    for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
        _validate_tensor(name, t, 2, "(seqlen_ro, rotary_dim / 2)")
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
    if isinstance(cache_seqlens, torch.Tensor):
        positions = cache_seqlens.to(device=q.device, dtype=torch.int32)
    else:
        positions = _filled_seqlens(int(cache_seqlens), q.shape[0], q.device)
    cos, sin = rotary_cos.contiguous(), rotary_sin.contiguous()
    q = apply_rotary(q, cos, sin, positions, interleaved=bool(interleaved), same_position=not positional)
    k = apply_rotary(k, cos, sin, positions, interleaved=bool(interleaved), same_position=False)
    return q, k


def _kvcache_call(q, k_cache, v_cache, k, v, cache_seqlens, block_table, softmax_scale, causal, num_splits,
                  return_softmax_lse, *, validated: bool, cache_leftpad: Optional[torch.Tensor] = None,
                  variants: Optional[Variants] = None):
    """flash_attn_with_kvcache; `validated=True` when the caller (PagedKVCache) has already run
    `_validate_kvcache_inputs` on these tensors; cache_leftpad: None or `_resolve_cache_leftpad`'s
    tensor (a call with it is never replayed: the replays carry no leftpad pointer); variants: None
    for none (calls with ALiBi slopes or sinks are never replayed: they are tensors checked per call)."""
    window, softcap, alibi_slopes, sinks = variants or _NO_VARIANTS
    try:
        sig = _signature(q, k_cache, v_cache, k, v, block_table)
    except AttributeError:  # not tensors: validation names the problem
        sig = None
    replay_key = options = None
    fast = not _INTERPRET and not recording_active()  # replays and skipped validation: compiled runs only
    if sig is not None and fast and cache_leftpad is None and alibi_slopes is None and sinks is None:
        try:  # a repeat of a validated call: replay its launches
            options = attn_options(q.shape[-1], softmax_scale, causal, window, softcap)
            replay_key = _replay_key(sig, cache_seqlens, options, num_splits, return_softmax_lse)
            replay = _REPLAYS.get(replay_key) if replay_key is not None else None
        except (TypeError, ValueError, IndexError, ArithmeticError):  # the full path names what is wrong
            replay_key = replay = None
        if replay is not None:
            result = _replay(replay, q, k_cache, v_cache, k, v, cache_seqlens, block_table, options)
            if result is not None:
                return result if return_softmax_lse else result[0]
    if not validated and (sig is None or not fast or sig not in _VALIDATED_SIGNATURES):
        _validate_kvcache_inputs(q, k_cache, v_cache, k, v, block_table is not None)
        if sig is not None and q.device.type == "cuda" and fast:
            if len(_VALIDATED_SIGNATURES) >= 4096:  # shapes churn: start over rather than grow without bound
                _VALIDATED_SIGNATURES.clear()
            _VALIDATED_SIGNATURES.add(sig)
    _validate_num_splits(num_splits)
    if options is None:  # not built by the replay attempt above
        options = attn_options(q.shape[3], softmax_scale, causal, window, softcap, alibi=alibi_slopes is not None,
                               sinks=sinks is not None)
    tensors = variant_args(options, alibi_slopes, sinks, q.shape[0], q.shape[2], q.device)
    seqlen_new = k.shape[1] if k is not None else 0
    if block_table is None:
        seqlens, table = _resolve_cache_seqlens(cache_seqlens, q.shape[0], seqlen_new, k_cache.shape[1], q.device), None
    else:
        seqlens, table = _resolve_paging(block_table, cache_seqlens, q.shape[0], seqlen_new, k_cache, q.device,
                                         options.window_left, q.shape[1])
    if seqlens is not cache_seqlens or table is not block_table or q.device.type != "cuda":
        replay_key = None  # lengths or table checked on the host or copied: not replayable
    if cache_leftpad is not None:
        replay_key = None
    out, lse = _flash_attn_with_kvcache_launch(
        q, k_cache, v_cache, k, v, seqlens, options, int(num_splits), return_softmax_lse, table, sig, replay_key,
        cache_leftpad, tensors,
    )
    return (out, lse) if return_softmax_lse else out


_NO_VARIANTS = Variants()


def _validate_num_splits(num_splits) -> None:
    if not isinstance(num_splits, numbers.Integral) or num_splits < 0:
        raise InputError(f"Expected num_splits to be an int >= 0 (0 = heuristic), got {num_splits!r}.")
