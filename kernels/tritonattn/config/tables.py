"""The one place that knows hardware: tile, warp and pipeline-stage choices per GPU class.

Configs are picked by a table, not by `triton.autotune`: a fixed choice per (GPU class, head dim,
dtype, causal) compiles once, never re-tunes while shapes change (so CUDA graphs and serving loops
stay stable), and keeps test compilation cheap. The Hopper tables come from sweeps on an H200
(benchmarks/tune_prefill.py, benchmarks/tune_decode.py; what won and by how much: docs/perf-notes.md);
GPUs with less shared memory per block than Hopper (the L4 has 99 KB) get tiles that fit it. Under
the interpreter one small config is used.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Optional

import torch

from .hardware import PDL, Target, has_tma, sm90_backward_switch, sm90_switch
from .options import KV_FP8_DTYPES, AttnOptions

HOPPER_SMEM = 200 * 1024  # a device with at least this much smem per block gets the big-tile table


@dataclass(frozen=True)
class AttnConfig:
    """Launch parameters of one attention kernel."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    use_tma: bool = False  # Hopper tensor descriptors for tile loads (capability >= 9 only)

    def as_dict(self) -> dict:
        return {
            "block_m": self.block_m,
            "block_n": self.block_n,
            "num_warps": self.num_warps,
            "num_stages": self.num_stages,
            "use_tma": self.use_tma,
        }


INTERPRETER_CONFIG = AttnConfig(block_m=32, block_n=32, num_warps=4, num_stages=1)


# Hopper (H100/H200, 227 KB smem), 2-byte dtypes, tensor-descriptor loads. key: head_dim_pad.
# D=128 is the winner of an H200 sweep (benchmarks/tune_prefill.py), causal and not; tensor descriptors
# because the pointer path is several times slower on Hopper (docs/perf-notes.md, Prefill). Other head
# dims follow the same shape, with 8 warps at D=256 so the [128, 256] fp32 accumulator fits in registers.
HOPPER_FWD = {
    16: AttnConfig(128, 64, 4, 3, True),
    32: AttnConfig(128, 64, 4, 3, True),
    64: AttnConfig(128, 64, 4, 3, True),
    128: AttnConfig(128, 64, 4, 2, True),
    256: AttnConfig(128, 64, 8, 2, True),
}


# Hopper's warp-specialized forward (kernels/tritonattn/jit/sm90.py): 128 query rows split over two consumer
# warpgroups that take turns on the tensor cores, 128-key blocks in a 2-slot K/V ring, 4 warps per consumer
# (config.num_warps: the default partition's). Against fwd_kernel on an H200, bf16, head dim 128 (one run;
# docs/perf-notes.md, "Prefill at cuDNN's speed"): 10 to 18% faster from 4096 keys on, causal or not, MHA and
# GQA; 2 to 5% faster at 2048 keys causal; at 1024 keys 2 to 7% faster without a mask but 5 to 8% slower
# causal, where a program's few key blocks cannot hide its prologue and epilogue at one program per SM;
# slower at head dim 64 (an 82 KB program still holds an SM's registers alone). Hence: head dim 128, 2-byte
# dtypes, dense, no dropout, at least 1024 keys (2048 causal).
SM90_WS_FWD = AttnConfig(128, 128, 4, 2, True)
SM90_WS_MIN_KEYS = {False: 1024, True: 2048}
# The fused Hopper backward (jit/sm90_bwd.py): 64 query rows per step, 128 keys per program (64 per consumer
# warpgroup), Q / dO rings of 2 slots: K, V 64 KB, the rings 64 KB, dS 32 KB at D = 128. Its dQ is summed by
# atomic adds, ordered by key block under `deterministic=True`. Opt-in (TRITONATTN_SM90_BWD=1): correct on an
# H100, but slower there than the portable backward (0.70-0.89x its speed at 16 x 1024 to 1 x 16384 tokens,
# bf16; docs/perf-notes.md, "Prefill at cuDNN's speed on Hopper"), so the default stays portable.
SM90_WS_BWD = AttnConfig(64, 128, 4, 2, True)
SM90_WS_BWD_MIN_KEYS = {False: 1024, True: 1024}
# The FP8 forward takes the same schedule and thresholds with e4m3 tiles (V as a transposed copy,
# jit/layout.py): on an H100 1.13-1.37x faster than the bf16 forward at 4096-16384 tokens, where
# fwd_kernel's FP8 path ran at 0.47-0.52x (docs/perf-notes.md, "The FP8 forward on Hopper"); shorter key
# ranges were not measured.
SM90_WS_DTYPES = (torch.float16, torch.bfloat16, torch.float8_e4m3fn)
FP8_VALUES_BLOCK = 128  # keys per program of the FP8 forward's V copy (jit/layout.py)


# What jit/sm90.py and jit/sm90_bwd.py use of Gluon, by module; "a|b": either name (the TMA copies were renamed
# in Triton 3.8, and 3.9 keeps the old names only as stubs that raise, so the new name is looked for first).
# Detected rather than read off the version number: Triton 3.5's Gluon lacks gl.num_warps and
# tma.make_tensor_descriptor.
GLUON_SM90_API = {
    "triton.experimental.gluon.language": ("warp_specialize", "num_warps", "NVMMADistributedLayout",
                                           "NVMMASharedLayout", "DotOperandLayout", "SliceLayout",
                                           "allocate_shared_memory", "static_range", "convert_layout", "atomic_add",
                                           "barrier|thread_barrier"),
    "triton.experimental.gluon.language.nvidia.hopper": ("warpgroup_mma", "warpgroup_mma_wait",
                                                         "fence_async_shared"),
    "triton.experimental.gluon.language.nvidia.hopper.tma": ("make_tensor_descriptor", "store_wait",
                                                             "async_load|async_copy_global_to_shared",
                                                             "async_store|async_copy_shared_to_global"),
    "triton.experimental.gluon.language.nvidia.hopper.mbarrier": ("MBarrierLayout", "init", "expect", "wait",
                                                                  "arrive"),
}


@functools.lru_cache(maxsize=None)
def gluon_sm90_available() -> bool:
    """Whether this Triton's Gluon has the Hopper API jit/sm90.py is written against (every name, or one of
    each "a|b" pair, in GLUON_SM90_API). Where it has not, the portable forward runs. CI cross-compiles the
    kernel for sm_90 under each Triton of the supported range where this holds."""
    import importlib

    try:
        modules = {name: importlib.import_module(name) for name in GLUON_SM90_API}
    except ImportError:
        return False
    return all(any(hasattr(modules[name], alt) for alt in attr.split("|"))
               for name, attrs in GLUON_SM90_API.items() for attr in attrs)


def prefill_fwd_sm90_config(options: AttnOptions, dtype: torch.dtype, seqlen_k: int,
                            target: Optional[Target], cache: bool = False) -> Optional[AttnConfig]:
    """The warp-specialized Hopper forward's config for a call without dropout whose tensors descriptors can
    address (dense or packed; with `cache`, chunked prefill over a KV cache of capacity seqlen_k: 16-bit, no
    window), or None where fwd_kernel is chosen (see SM90_WS_FWD)."""
    if target is None or target.capability[0] != 9 or target.smem_per_block < HOPPER_SMEM:
        return None
    if options.head_dim != 128 or options.head_dim_pad != 128 or dtype not in SM90_WS_DTYPES:
        return None
    if cache and (options.has_window or options.kv_fp8 or dtype in KV_FP8_DTYPES):
        return None
    if seqlen_k < SM90_WS_MIN_KEYS[options.causal] or not sm90_switch():
        return None
    return SM90_WS_FWD if gluon_sm90_available() else None


def prefill_bwd_sm90_config(options: AttnOptions, dtype: torch.dtype, seqlen_k: int,
                            target: Optional[Target]) -> Optional[AttnConfig]:
    """The fused Hopper backward's config for a dense call without dropout whose tensors descriptors can
    address, where TRITONATTN_SM90_BWD=1 opts in, or None where the portable kernels run (see SM90_WS_BWD)."""
    if target is None or target.capability[0] != 9 or target.smem_per_block < HOPPER_SMEM:
        return None
    if options.head_dim != 128 or options.head_dim_pad != 128 or dtype not in (torch.float16, torch.bfloat16):
        return None
    if (options.has_window or options.softcap > 0.0 or options.alibi or options.sinks or options.seqused_k
            or options.kv_fp8 or options.tree):
        return None
    if seqlen_k < SM90_WS_BWD_MIN_KEYS[options.causal] or not sm90_backward_switch():
        return None
    return SM90_WS_BWD if gluon_sm90_available() else None


# Ampere/Ada with 99 KB or more smem per block (A10, Colab's L4, A100): tiles that fit.
SMALL_SMEM_FWD = {
    16: AttnConfig(128, 64, 4, 3),
    32: AttnConfig(128, 64, 4, 3),
    64: AttnConfig(128, 64, 4, 3),
    128: AttnConfig(128, 64, 8, 2),
    256: AttnConfig(64, 32, 4, 2),
}
# Turing (T4: 64 KB per block, no bf16): the largest tiles whose compile fits it.
TINY_SMEM_FWD = {
    16: AttnConfig(128, 64, 4, 3),
    32: AttnConfig(128, 64, 4, 3),
    64: AttnConfig(64, 64, 4, 2),
    128: AttnConfig(64, 32, 4, 2),
    256: AttnConfig(32, 16, 4, 1),
}
SMALL_SMEM = 96 * 1024  # a device with less smem per block than this (T4) gets the tiny tables


def is_hopper_class(target: Target) -> bool:
    """Hopper or newer with Hopper's shared memory: the big-tile tables and tensor descriptors."""
    return target.capability[0] >= 9 and target.smem_per_block >= HOPPER_SMEM


def _table(target: Target, hopper: dict, small: dict, tiny: dict) -> dict:
    if is_hopper_class(target):
        return hopper
    return small if target.smem_per_block >= SMALL_SMEM else tiny


def prefill_fwd_config(head_dim_pad: int, dtype: torch.dtype, causal: bool, target: Optional[Target]) -> AttnConfig:
    """Tile config for the prefill forward kernel on `target` (None: the interpreter's)."""
    if target is None:
        return INTERPRETER_CONFIG
    if dtype == torch.float32:  # 4-byte tiles: about half what a 2-byte config would stage
        if is_hopper_class(target) or (target.smem_per_block >= SMALL_SMEM and head_dim_pad <= 128):
            return AttnConfig(64, 32, 4, 2)
        return AttnConfig(32, 32, 4, 1) if head_dim_pad <= 128 else AttnConfig(16, 16, 4, 1)
    return _table(target, HOPPER_FWD, SMALL_SMEM_FWD, TINY_SMEM_FWD)[head_dim_pad]


# Backward: (dK/dV config, dQ config). dK/dV programs own BLOCK_N keys and stream queries in
# BLOCK_M steps; dQ programs own BLOCK_M queries and stream keys in BLOCK_N steps.
HOPPER_BWD = {
    16: (AttnConfig(64, 128, 4, 3, True), AttnConfig(128, 64, 4, 3, True)),
    32: (AttnConfig(64, 128, 4, 3, True), AttnConfig(128, 64, 4, 3, True)),
    64: (AttnConfig(64, 128, 8, 3, True), AttnConfig(128, 64, 8, 3, True)),
    128: (AttnConfig(64, 128, 8, 3, True), AttnConfig(128, 64, 8, 3, True)),  # swept on an H200
    256: (AttnConfig(32, 64, 4, 2, True), AttnConfig(64, 32, 4, 2, True)),
}


SMALL_SMEM_BWD = {
    16: (AttnConfig(32, 64, 4, 2), AttnConfig(64, 32, 4, 2)),
    32: (AttnConfig(32, 64, 4, 2), AttnConfig(64, 32, 4, 2)),
    64: (AttnConfig(32, 64, 4, 2), AttnConfig(64, 32, 4, 2)),
    128: (AttnConfig(32, 64, 4, 2), AttnConfig(64, 32, 4, 2)),
    256: (AttnConfig(16, 32, 4, 1), AttnConfig(32, 16, 4, 1)),
}


TINY_SMEM_BWD = {  # the 99 KB table, with smaller tiles where it outgrows a T4's 64 KB
    **SMALL_SMEM_BWD,
    128: (AttnConfig(32, 32, 4, 2), AttnConfig(32, 32, 4, 2)),
    256: (AttnConfig(16, 16, 4, 1), AttnConfig(16, 16, 4, 1)),
}


def prefill_bwd_unsupported(head_dim_pad: int, dtype: torch.dtype, target: Optional[Target]) -> Optional[str]:
    """Why the backward cannot run on `target` at all (no config fits its shared memory), or None."""
    if target is not None and dtype == torch.float32 and head_dim_pad > 128 and target.smem_per_block < SMALL_SMEM:
        return (f"the float32 backward at head dim > 128 needs more shared memory per block than {target.name} "
                f"has ({target.smem_per_block // 1024} KB): use float16 there")
    return None


def prefill_bwd_config(
    head_dim_pad: int, dtype: torch.dtype, causal: bool, target: Optional[Target]
) -> tuple[AttnConfig, AttnConfig]:
    """(dK/dV config, dQ config) for the prefill backward kernels on `target` (None: the interpreter's)."""
    if target is None:
        return INTERPRETER_CONFIG, INTERPRETER_CONFIG
    if dtype == torch.float32:
        if is_hopper_class(target):
            return AttnConfig(32, 64, 4, 1), AttnConfig(64, 32, 4, 1)
        if head_dim_pad <= 128:
            return AttnConfig(16, 32, 4, 1), AttnConfig(32, 16, 4, 1)
        return AttnConfig(16, 16, 4, 1), AttnConfig(16, 16, 4, 1)  # D = 256: K, V and dK, dV stay resident
    return _table(target, HOPPER_BWD, SMALL_SMEM_BWD, TINY_SMEM_BWD)[head_dim_pad]


# --------------------------------------------------------------------------------------------
# Decode (kernels/tritonattn/jit/decode.py): one program streams one split of one (request, KV head)'s cache for
# a block of up to `max_rows` query rows (the q heads of the group x seqlen_q). Decode is bound by
# memory bandwidth, so the configs aim at deep load pipelines rather than big tiles.
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DecodeConfig:
    """Launch parameters of the split-KV decode kernel."""

    block_n: int  # keys per step of the KV loop (a split is a whole number of these)
    num_warps: int
    num_stages: int
    max_rows: int = 64  # query rows per program; more rows -> another row block in the grid
    waves: int = 1  # programs per SM the split heuristic fills at least (see decode_num_splits)


INTERPRETER_DECODE_CONFIG = DecodeConfig(block_n=32, num_warps=4, num_stages=1)


INTERPRETER_SM_COUNT = 4  # what the split heuristic assumes when there is no GPU to ask
DECODE_MIN_BLOCKS_PER_SPLIT = 1  # a split streams at least this many BLOCK_N blocks (see decode_num_splits)
DECODE_MAX_SPLITS = 64
DECODE_FULL_GRID = 0.8  # this many programs per SM or more: no split (flash-attn's rule)
DECODE_PAGED_WAVES = 2  # a paged cache's splits fill this many programs per SM (see decode_num_splits)
DECODE_PAGED_WAVE_MIN_BLOCKS = 4  # ... but the splits past one wave's count keep this many blocks each
DECODE_FP8_WAVES = 2  # an FP8 cache's splits fill this many programs per SM (see decode_num_splits)
DECODE_FP8_PAGED_WAVES = 3  # ... and a paged FP8 cache's this many
# A paged cache's decode runs at most this many pipeline stages (the dense config's 4 on Hopper): at 3 the
# kernel's shared memory fits 3 programs per SM instead of 2, and it runs faster at split and one-wave
# shapes; smaller key blocks (BLOCK_N 16 or 32 for P = 16) are slower than either. The dense cache keeps
# 4: there 3 stages win at some shapes and lose at others (docs/perf-notes.md, Paged decode, "Plans").
DECODE_PAGED_STAGES = 3
# ... except in a deep grid: unsplit, with at least DECODE_DEEP_GRID programs per SM (more than one wave of
# the capped kernel, see decode_paged_tiles), where a cache of at least DECODE_DEEP_MIN_BLOCKS key blocks per
# request keeps the config's stages, and a key block that would gather more than DECODE_GATHER_MAX_PAGES
# pages (P = 16 at BLOCK_N 128) halves BLOCK_N instead.
DECODE_DEEP_GRID = 3
DECODE_DEEP_MIN_BLOCKS = 32


DECODE_GATHER_MAX_PAGES = 4  # jit/common.py's physical_blocks looks up one entry per page up to this


# A split of at most this many BLOCK_N blocks streams them all through one masked loop instead of an
# unmasked loop plus a masked one for its ragged tail (see [Note] One loop for short splits in
# jit/decode.py); pools that gather a key block from several pages (P % BLOCK_N != 0) only up to the
# second count. Both counts are where one loop stops being faster on an H200 (docs/perf-notes.md, Decode,
# "One loop for short splits").
DECODE_ONE_LOOP_MAX_BLOCKS = 32
DECODE_ONE_LOOP_MAX_BLOCKS_GATHER = 16
DECODE_PDL = PDL  # TRITONATTN_PDL, read once at import (see decode_use_pdl)


# Hopper (227 KB smem): K and V tiles of 2-byte dtypes, num_stages deep. key: head_dim_pad.
# D=128 is the pick of an H200 sweep (benchmarks/tune_decode.py; docs/perf-notes.md, Decode, "Config"): the
# fastest, or within 1% of it, at the bandwidth-bound shapes. The other head dims are not swept.
HOPPER_DECODE = {
    16: DecodeConfig(128, 4, 4),
    32: DecodeConfig(128, 4, 4),
    64: DecodeConfig(128, 4, 4),
    128: DecodeConfig(64, 4, 4),
    256: DecodeConfig(64, 4, 3),
}
# ... and for query blocks of more than max_rows rows (a speculative verify step: draft tokens x the GQA group),
# where the kernel is compute-bound: 8 warps over 128-row blocks, two programs per SM (an unsplit grid of one
# program per SM leaves each SM one 8-warp program to hide its loads behind). D=128 is the pick of H100 sweeps
# over the 64-draft tree of benchmarks/speculative.py (docs/perf-notes.md, "Speculative decoding's verify
# step"): 346 us against 482 us with the table above; the other head dims keep theirs (not swept).
# Not for a call that appends more than one chunk of new rows (more than the config's BLOCK_N): compiled there
# (H100, Triton 3.6) its outputs were wrong (tests/test_chunked_prefill.py's decode-kernel cases, 300 new rows,
# rel err 1.7e-2 to 1.4e-1), while the same rows without an append, and appends of one chunk (a 64-draft tree),
# were right; the cause is not found yet, so those calls keep the one-token config, which passes them.
HOPPER_DECODE_MANY_ROWS = {
    128: DecodeConfig(64, 8, 3, 128, waves=2),
}
# ~100 KB smem per block (Ampere/Ada, Colab's L4): stages x 2 x BLOCK_N x D x 2 bytes stays < 99 KB.
SMALL_SMEM_DECODE = {
    16: DecodeConfig(64, 4, 3),
    32: DecodeConfig(64, 4, 3),
    64: DecodeConfig(64, 4, 3),
    128: DecodeConfig(64, 4, 2),
    256: DecodeConfig(32, 4, 2),
}


def decode_config(head_dim_pad: int, dtype: torch.dtype, target: Optional[Target], rows: int = 1,
                  new_rows: int = 0) -> DecodeConfig:
    """Tile config for the decode kernel on `target` (None: the interpreter's one small config) for `rows` query
    rows per KV head (new tokens x the GQA group), of which the call appends `new_rows` per request (0: none)."""
    if target is None:
        return INTERPRETER_DECODE_CONFIG
    config = (HOPPER_DECODE if is_hopper_class(target) else SMALL_SMEM_DECODE)[head_dim_pad]
    many = HOPPER_DECODE_MANY_ROWS.get(head_dim_pad) if is_hopper_class(target) else None
    if many is not None and rows > config.max_rows and new_rows <= many.block_n:
        config = many
    if dtype == torch.float32:  # 4-byte tiles: halve the keys per stage
        config = dataclasses.replace(config, block_n=max(16, config.block_n // 2))
    return config


# Beyond its tiles the decode kernel stages a little for layout conversions: 4.5 KB at D = 256 on sm_89
# and nothing on sm_90 by Triton's allocation (tests/test_config_fitness.py compiles every plan per card).
DECODE_SMEM_SLACK = 8 * 1024
DECODE_SMEM_SLACK_HOPPER = 1024


def decode_smem_bytes(head_dim_pad: int, itemsize: int, block_h: int, block_n: int, num_stages: int,
                      block_new: int, target: Target, q_itemsize: int = 0) -> int:
    """Shared memory a decode program needs on `target`: its query tile (BLOCK_H rows), `num_stages` K and
    V tiles of BLOCK_N keys, the new rows' K and V tiles (BLOCK_NEW; 0 without an append), plus slack.
    itemsize: the cache's bytes per element (the K/V tiles); q_itemsize: q's (the query and new-row
    tiles; 0: the same), 2 over an FP8 cache."""
    slack = DECODE_SMEM_SLACK_HOPPER if target.capability[0] >= 9 else DECODE_SMEM_SLACK
    q_itemsize = q_itemsize or itemsize
    return head_dim_pad * (q_itemsize * (block_h + 2 * block_new) + itemsize * 2 * num_stages * block_n) + slack


def decode_fit(head_dim_pad: int, itemsize: int, block_h: int, block_n: int, num_stages: int, block_new: int,
               target: Optional[Target], q_itemsize: int = 0) -> tuple[int, int, int, int]:
    """(BLOCK_H, BLOCK_N, stages, BLOCK_NEW) shrunk until `decode_smem_bytes` fits the target's shared
    memory per block: first the stages (down to 2), then the new rows' tile, then the query rows per
    program (more row blocks), then the key block. Many query rows (speculative verification over a big
    GQA group) and wide heads are what outgrow a card; a one-token step at D <= 128 keeps its config's
    tiles on every card with 99 KB per block or more (a T4's 64 KB takes fewer stages or keys)."""
    if target is None:
        return block_h, block_n, num_stages, block_new
    while (decode_smem_bytes(head_dim_pad, itemsize, block_h, block_n, num_stages, block_new, target, q_itemsize)
           > target.smem_per_block):
        if num_stages > 2:
            num_stages -= 1
        elif block_new > 16:
            block_new //= 2
        elif block_h > 16:
            block_h //= 2
        elif block_n > 16:
            block_n //= 2
        elif num_stages > 1:
            num_stages -= 1
        else:
            break
    return block_h, block_n, num_stages, block_new


def decode_unsupported(head_dim_pad: int, itemsize: int, append: bool, target: Optional[Target],
                       q_itemsize: int = 0) -> Optional[str]:
    """Why no decode tile fits the target's shared memory (even 16 rows, 16 keys, one stage), or None;
    itemsize, q_itemsize as in `decode_smem_bytes`."""
    if target is None:
        return None
    least = decode_smem_bytes(head_dim_pad, itemsize, 16, 16, 1, 16 if append else 0, target, q_itemsize)
    if least <= target.smem_per_block:
        return None
    what = f"{8 * itemsize}-bit decode at head dim {head_dim_pad}" + (" with an append" if append else "")
    return (f"the {what} needs more shared memory per block than {target.name} has "
            f"({target.smem_per_block // 1024} KB): use float16 there")


def planning_sm_count(target: Optional[Target]) -> int:
    """The SM count the launch heuristics plan for: the target's, or INTERPRETER_SM_COUNT without one."""
    return INTERPRETER_SM_COUNT if target is None else target.sm_count


def decode_num_splits(programs: int, seqlen_cache: int, block_n: int, target: Optional[Target],
                      paged: bool = False, fp8: bool = False, waves: int = 1) -> int:
    """num_splits=0 heuristic: how many chunks to split each request's cache into.

    Depends only on `programs` (batch x nheads_k x row blocks), the *allocated* seqlen_cache, the
    SM count and whether the cache is paged, never on current lengths, so the grid and the compiled
    kernel stay fixed while a generation loop runs. flash-attn's rule for when: no split once the programs fill the SMs
    (DECODE_FULL_GRID). How many: the most splits that still run in one wave, SMs // programs, with
    every split at least DECODE_MIN_BLOCKS_PER_SPLIT blocks of BLOCK_N keys and at most
    DECODE_MAX_SPLITS splits. Why one full wave: a second, partial wave costs more than the shorter
    splits save. Why down to one block per split: at short caches one-block splits beat fewer, longer
    ones (the timings behind both: docs/perf-notes.md, Decode, "Split count").

    Paged caches fill DECODE_PAGED_WAVES programs per SM instead of one (both rules count the SMs
    times the waves: no split from 0.8 of that, else as many splits as fit in it). Their pages lie
    anywhere in the pool, so a program's loads wait longer than on a dense cache's one stream, and
    twice the programs in flight hide it; three or four times as many run a partial third wave and
    are slower than two, and the dense cache gains nothing from a second wave. The splits past the
    first wave's count keep at least DECODE_PAGED_WAVE_MIN_BLOCKS blocks each: for shorter splits the
    second wave costs more than it hides (timings: docs/perf-notes.md, Paged decode, "Plans").

    An FP8 cache fills at least DECODE_FP8_WAVES programs per SM: a program dequantizes every K/V tile on
    its loop's critical path and streams half the bytes of a 16-bit one in about the same time, so it
    takes twice the programs to keep the loads in flight (docs/perf-notes.md, "FP8 KV cache in decode"); a
    paged FP8 cache DECODE_FP8_PAGED_WAVES, as its page lookups add to that path.

    `waves` is the config's own count (DecodeConfig.waves): Hopper's many-row config, whose compute-bound
    programs run 8 warps each, fills two per SM, so that one program's loads hide behind another's math.
    """
    sm_count = planning_sm_count(target)
    fp8_waves = (DECODE_FP8_PAGED_WAVES if paged else DECODE_FP8_WAVES) if fp8 else 1
    waves = max(DECODE_PAGED_WAVES if paged else 1, fp8_waves, waves)
    slots = sm_count * waves  # programs the splits may fill
    programs = max(programs, 1)
    if programs >= DECODE_FULL_GRID * slots:
        return 1
    max_splits = min(DECODE_MAX_SPLITS, max(1, seqlen_cache // (block_n * DECODE_MIN_BLOCKS_PER_SPLIT)))
    splits = min(max_splits, slots // programs)
    if paged:  # a second wave only of splits that stay long enough
        one_wave = min(max_splits, sm_count // programs)
        splits = max(one_wave, min(splits, seqlen_cache // (block_n * DECODE_PAGED_WAVE_MIN_BLOCKS)))
    return max(1, splits)


def decode_paged_tiles(config: DecodeConfig, page_size: int, programs: int, num_splits: int, seqlen_cache: int,
                       target: Optional[Target]) -> tuple[int, int]:
    """(BLOCK_N, pipeline stages) of a paged cache's decode plan: the config's BLOCK_N and at most
    DECODE_PAGED_STAGES stages, except in a deep grid (one split per request and at least
    DECODE_DEEP_GRID programs per SM), where a key block of more than DECODE_GATHER_MAX_PAGES pages halves
    BLOCK_N and takes the config's stages, and a cache of at least DECODE_DEEP_MIN_BLOCKS blocks takes
    the config's stages.

    Why: the capped kernel fits 3 programs per SM (70-75 KB of shared memory at D = 64 / 128, against
    102 KB at 4 stages, which fits 2; registers capped by `decode_max_registers` where the grid needs
    more than 2 per SM), which helps split and short grids; a grid of more programs than that runs
    in waves, and a short last wave of long programs leaves the memory system idle: just past one
    wave of the capped kernel the 4-stage plan is the faster one. Short caches (fewer than
    DECODE_DEEP_MIN_BLOCKS blocks) keep the cap, where the capped plan stays the faster one. A block
    of 8 pages (P = 16 at BLOCK_N 128) is a per-row gather; halved to 4 pages it takes one lookup per page
    (see [Note] BLOCK_N vs page size in kernels/tritonattn/jit/decode.py), faster in deep grids though
    slower at split and one-wave shapes, which keep BLOCK_N. The timings behind each threshold:
    docs/perf-notes.md, Paged decode, "Plans".
    """
    block_n, stages = config.block_n, min(config.num_stages, DECODE_PAGED_STAGES)
    sm_count = planning_sm_count(target)
    if num_splits > 1 or programs < DECODE_DEEP_GRID * sm_count:
        return block_n, stages
    if block_n % page_size == 0 and block_n // page_size > DECODE_GATHER_MAX_PAGES:
        return block_n // 2, config.num_stages
    if -(-seqlen_cache // block_n) >= DECODE_DEEP_MIN_BLOCKS:
        return block_n, config.num_stages
    return block_n, stages


DECODE_REGISTERS_PER_SM = 65536  # 32-bit registers per SM from Volta to Hopper (Ada included)


DECODE_CAPPED_PROGRAMS_PER_SM = 3  # programs of a stage-capped paged plan that Hopper's shared memory holds
DECODE_MIN_REGISTER_CAP = 128  # decode_max_registers caps no lower than this


def decode_max_registers(num_warps: int, num_stages: int, paged: bool, programs: int, target: Optional[Target]
                         ) -> Optional[int]:
    """Registers per thread to cap the decode kernel at (Triton's `maxnreg`), or None for no cap.

    A paged plan of at most DECODE_PAGED_STAGES stages takes 70-75 KB of shared memory on Hopper
    (D <= 128), so 3 programs fit in an SM's 228 KB, but ptxas left to itself gives the unsplit kernel
    178-186 registers per thread (sm_90, one new token, with Triton specialising seqlen_q = 1 to a
    constant), and 3 x 128 threads x 178 > 65536: 2 programs per SM. A grid of more than 2 programs per
    SM (`programs` counts every split) then runs a second wave or a larger one. Capped at
    65536 / (3 x 32 x num_warps) = 168 (4 warps) the kernel compiles without
    spills (sm_90, cuobjdump: no stack) and 3 programs share an SM again. Split and short grids (at most
    2 programs per SM) are left uncapped: there the registers limit nothing; so are plans whose cap would
    fall below DECODE_MIN_REGISTER_CAP (8 warps and more; none on Hopper's table).
    """
    if not paged or num_stages > DECODE_PAGED_STAGES or target is None:
        return None
    if target.smem_per_block < HOPPER_SMEM or programs <= 2 * planning_sm_count(target):
        return None
    per_thread = DECODE_REGISTERS_PER_SM // (DECODE_CAPPED_PROGRAMS_PER_SM * 32 * num_warps) // 8 * 8
    # ptxas allocates registers in groups of 8 per thread; a cap far below what the kernel wants (8 warps: 80)
    # would spill: those plans keep their registers
    return per_thread if per_thread >= DECODE_MIN_REGISTER_CAP else None


def decode_use_pdl(target: Optional[Target]) -> bool:
    """Whether the split merge is launched with programmatic dependent launch (PDL): the combine
    kernel's programs start while the decode grid runs and wait in `griddepcontrol.wait` for its
    results, hiding the second launch's latency. Hopper and newer only (sm_90+: `griddepcontrol`);
    off under the interpreter and with TRITONATTN_PDL=0 in the environment at import (DECODE_PDL)."""
    return target is not None and DECODE_PDL and has_tma(target)  # PDL came with Hopper, as TMA did


# With num_splits=0, flash_attn_with_kvcache runs the prefill kernel family instead of the decode
# kernel from this many new tokens per request on, when the prefill grid also fills this fraction of
# the SMs (`chunked_prefill_pays`, see [Note] Chunked prefill).
CHUNKED_PREFILL_MIN_SEQLEN_Q = 128
CHUNKED_PREFILL_MIN_WAVE = 0.8


SPLIT_SCRATCH_CACHE_BYTES = 64 * 2**20  # larger split scratch is allocated per call, not kept


# Registers of Hopper's warp-specialized forward (jit/sm90.py): three warpgroups (two consumers, the
# loader's) x 128 threads x SM90_MAXNREG = 64512 of the SM's 65536. After setmaxnreg each consumer thread
# holds SM90_CONSUMER_REGS (its [64, 128] fp32 output and scores, and the bf16 probabilities), the loader's
# SM90_LOADER_REGS; one program per SM (160 KB of shared memory at D = 128).
SM90_MAXNREG = 168
SM90_CONSUMER_REGS = 240
SM90_LOADER_REGS = 24


# --------------------------------------------------------------------------------------------
# Helper kernels: the backward's preprocessing, flash-attn's S_dmask, row blocks of the append and
# rotary kernels, the split combine
# --------------------------------------------------------------------------------------------
BWD_PREPROCESS_BLOCK_M = 64  # query rows per program of the backward's preprocessing (rowsum(dO * O))


def dropout_probs_tiles(head_dim_pad: int) -> tuple:
    """(BLOCK_M, BLOCK_N) of flash-attn's S_dmask kernel (a test's tool): small, so that a T4's 64 KB of
    shared memory holds q and k tiles of head dim 256 at 16 x 32."""
    return (64, 64) if head_dim_pad <= 64 else (32, 32) if head_dim_pad <= 128 else (16, 32)


def row_block(rows: int) -> int:
    """Rows per program of the cache append and the rotary kernels: the next power of two, 16 to 64."""
    return min(64, max(16, 1 << max(0, int(rows) - 1).bit_length()))


def combine_num_warps(splits_pad: int, head_dim_pad: int) -> int:
    """Warps of the split combine: 4 once a row's partials are 4096 elements or more, else 1."""
    return 4 if splits_pad * head_dim_pad >= 4096 else 1
