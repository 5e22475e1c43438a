"""Prefill attention: the launchers, autograd and public functions of the FlashAttention-2 kernels
in kernels/tritonattn/prefill_kernels.py (forward and backward, MHA/GQA/MQA, dense or packed varlen batches),
and the forward's cache mode behind chunked prefill (kernels/tritonattn/decode.py).

Each launcher validates (the public functions, before anything is allocated), allocates, launches.
The attention options travel as one `AttnOptions` (kernels/tritonattn/_options.py): every kernel gets
`**options.constexprs, **options.runtime`; tile configs come from tritonattn/tritonattn/_configs.py.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import triton

from ._configs import (
    AttnConfig,
    prefill_bwd_config,
    prefill_bwd_unsupported,
    prefill_fwd_config,
    prefill_fwd_sm90_config,
)
from ._jit import wide_pages
from ._launch import LaunchCache
from ._options import AttnOptions, attn_options, resolve_variants
from ._utils import (
    Target,
    _check_block_table_entries,
    _validate_alibi_slopes,
    _validate_cu_seqlens,
    _validate_cu_seqlens_values,
    _validate_devices,
    _validate_dropout,
    _validate_dtypes,
    _validate_head_dim,
    _validate_heads,
    _validate_max_seqlen,
    _validate_sinks,
    _validate_tensor,
    device_target,
    empty_aligned,
    rows_aligned,
)
from .errors import InputError, InputTypeError
from .prefill_kernels import bwd_dkdv_kernel, bwd_dq_kernel, bwd_preprocess_kernel, dropout_probs_kernel, fwd_kernel


# ============================================================================================
# Launchers: validate, allocate, launch
# ============================================================================================
def _tma_allocator(size: int, alignment: int, stream: Optional[int]) -> torch.Tensor:
    """Scratch for device-side tensor descriptors (a few hundred bytes per program)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _ensure_tma_allocator() -> None:
    from triton.runtime import _allocation

    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(_tma_allocator)


def _tma_planned(requested: bool, target: Optional[Target], dtype: torch.dtype) -> bool:
    """Tensor-descriptor loads: requested by the config, planned for a Hopper-or-newer GPU (`target`),
    2-byte dtypes."""
    return requested and target is not None and target.capability[0] >= 9 and dtype.itemsize == 2


def _use_tma(requested: bool, target: Optional[Target], *tensors: torch.Tensor) -> bool:
    """`_tma_planned`, and every tensor's base and outer strides 16-byte aligned (what descriptors need)."""
    return _tma_planned(requested, target, tensors[0].dtype) and all(rows_aligned(t) for t in tensors)


def _aligned_operands(planned: bool, *tensors: torch.Tensor) -> Tuple[torch.Tensor, ...]:
    """Where tensor descriptors are planned, each tensor whose rows are not 16-byte aligned (a head dim
    that is not a multiple of 8, an odd view) as a copy in an aligned buffer; the others as they are.

    A descriptor cannot address such a tensor, and the pointer path that could runs ~4x slower on Hopper
    (docs/perf-notes.md), while the copy costs one pass over the tensor.
    """
    if not planned:
        return tensors
    return tuple(t if rows_aligned(t) else empty_aligned(t.shape, t.dtype, t.device).copy_(t) for t in tensors)


def _validate_qkv(q, k, v) -> None:
    layout = "(batch, seqlen, nheads, headdim)"
    _validate_tensor("q", q, 4, layout)
    _validate_tensor("k", k, 4, layout)
    _validate_tensor("v", v, 4, layout)
    _validate_dtypes(q=q, k=k, v=v)
    _validate_devices(q=q, k=k, v=v)
    if k.shape != v.shape:
        raise InputError(f"Expected k and v to have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}.")
    if q.shape[0] != k.shape[0]:
        raise InputError(f"Expected q and k to share the batch size, got {q.shape[0]} and {k.shape[0]}.")
    if q.shape[3] != k.shape[3]:
        raise InputError(f"Expected q and k to share the head dim, got {q.shape[3]} and {k.shape[3]}.")
    _validate_head_dim(q.shape[3])
    _validate_heads(q.shape[2], k.shape[2])


def _row_strides(t: torch.Tensor, packed: bool) -> Tuple[int, int, int]:
    """(batch, row, head) strides: a packed (total, heads, D) tensor has no batch dim (stride 0;
    each program moves to its sequence's first row itself)."""
    return (0, t.stride(0), t.stride(1)) if packed else (t.stride(0), t.stride(1), t.stride(2))


def _on_device(t: torch.Tensor):
    """A context making t's CUDA device current (nothing for CPU tensors)."""
    return torch.cuda.device(t.device) if t.device.type == "cuda" else contextlib.nullcontext()


@dataclass(frozen=True)
class Dropout:
    """Dropout of the attention probabilities (see [Note] Dropout in kernels/tritonattn/prefill_kernels.py).

    p: the probability of dropping, in (0, 1); a pair is kept when its 16-bit draw is below
        keep_threshold = round((1 - p) * 2^16), and kept probabilities are scaled by 2^16 / keep_threshold
        (1 / (1 - p) up to that rounding: the expectation stays exact).
    rng_state: int64 (2,) on the inputs' device, (seed, salt) of the Philox bits; the forward draws it
        (`dropout`), the backward and `dropout_probs` take the same one back.
    """

    p: float
    rng_state: torch.Tensor

    @property
    def keep_threshold(self) -> int:
        return round((1.0 - self.p) * 65536)

    @property
    def kernel_args(self) -> dict:
        """The forward's and backward's dropout arguments."""
        return dict(Rng=self.rng_state, keep_threshold=self.keep_threshold, dropout_scale=65536 / self.keep_threshold,
                    HAS_DROPOUT=True)


def dropout(p: float, device: torch.device, rng_state: Optional[torch.Tensor] = None) -> Optional[Dropout]:
    """A validated `Dropout` (None for p == 0). Without rng_state, (seed, salt) are drawn from torch's
    generator of `device` on that device: `torch.manual_seed` reproduces the mask, nothing syncs, and a
    CUDA graph replay draws fresh bits (a graph-safe draw)."""
    if p == 0.0:
        return None
    if round((1.0 - p) * 65536) == 0:
        raise InputError(f"Expected dropout_p < 1 - 2^-17 (the keep rate is drawn in steps of 2^-16), got {p}.")
    if rng_state is None:
        rng_state = torch.randint(0, 2**62, (2,), dtype=torch.int64, device=device)
    elif not (isinstance(rng_state, torch.Tensor) and rng_state.dtype == torch.int64 and rng_state.numel() == 2
              and rng_state.device == device):
        got = (rng_state.dtype, tuple(rng_state.shape), rng_state.device) if isinstance(rng_state, torch.Tensor) else (
            type(rng_state).__name__)
        raise InputError(f"Expected rng_state to be the forward's int64 (2,) tensor on {device}, got {got}.")
    return Dropout(p, rng_state.contiguous())


def _dropout_args(drop: Optional[Dropout]) -> dict:
    return drop.kernel_args if drop is not None else {}


def variant_args(options: AttnOptions, alibi_slopes: Optional[torch.Tensor], sinks: Optional[torch.Tensor],
                 batch: int, nheads: int, device: torch.device) -> dict:
    """The attention kernels' arguments for the variants' per-call tensors, validated: ALiBi's slopes
    (Alibi, and stride_alibi_b: 0 for one slope per head) and the sinks (Sinks, as float32); {}
    without them. Whether they are on is the options' (HAS_ALIBI, HAS_SINKS)."""
    args = {}
    if options.alibi:
        slopes = _validate_alibi_slopes(alibi_slopes, batch, nheads, device)
        args.update(Alibi=slopes, stride_alibi_b=slopes.stride(0) if slopes.dim() == 2 else 0)
    if options.sinks:
        _validate_sinks(sinks, nheads, device)
        args["Sinks"] = sinks.detach().to(torch.float32).contiguous()
    return args


def variant_options(head_dim: int, softmax_scale, causal: bool, window_size, softcap, alibi_slopes, sinks,
                    seqlen_k: int, batch: int, nheads: int, device: torch.device) -> Tuple[AttnOptions, dict]:
    """A public function's AttnOptions from flash-attn's variant arguments (and our sinks), with the
    kernel arguments of their tensors (`variant_args`); everything checked before any launch."""
    options = attn_options(head_dim, softmax_scale, alibi=alibi_slopes is not None, sinks=sinks is not None,
                           **resolve_variants(window_size, softcap, causal, seqlen_k))
    return options, variant_args(options, alibi_slopes, sinks, batch, nheads, device)


def dropout_probs(q: torch.Tensor, k: torch.Tensor, options: AttnOptions, drop: Dropout,
                  varlen: Optional[Tuple[torch.Tensor, torch.Tensor, int, int]] = None,
                  variants: Optional[dict] = None) -> torch.Tensor:
    """flash-attn's S_dmask for a forward that ran with `drop` (its testing aid; see
    `dropout_probs_kernel`): (batch, nheads, seqlen_q, seqlen_k) in q's dtype, S[b, h, i, j] =
    +-exp(score - row max), negative where the pair was dropped, 0 where row i does not see key j.
    Packed inputs give (batch, nheads, max_seqlen_q, max_seqlen_k), sequence b's pairs at its own
    positions and zeros past its lengths (a sequence longer than max_seqlen_q / max_seqlen_k is cut to
    them). The scores are those the softmax sees (softcap, ALiBi and window applied; `variants` as
    `variant_args` gives them); a sink takes no part. It costs batch * nheads * seqlen_q * seqlen_k
    elements of q's dtype and a second pass over the scores: a test's tool, not a training one."""
    if varlen is None:
        batch, seqlen_q, nheads, _ = q.shape
        seqlen_k = k.shape[1]
        extra, packed = {}, False
    else:
        cu_q, cu_k, seqlen_q, seqlen_k = varlen
        batch, nheads = cu_q.numel() - 1, q.shape[1]
        extra, packed = dict(Cu_seqlens_q=cu_q, Cu_seqlens_k=cu_k, IS_VARLEN=True), True
    probs = torch.zeros((batch, nheads, seqlen_q, seqlen_k), dtype=q.dtype, device=q.device)
    if probs.numel() == 0:
        return probs
    # Small tiles: a T4's 64 KB of shared memory holds q and k tiles of head dim 256 at 16 x 32.
    block_m, block_n = (64, 64) if options.head_dim_pad <= 64 else (32, 32) if options.head_dim_pad <= 128 else (16, 32)
    grid = (triton.cdiv(seqlen_q, block_m), batch * nheads, 1)
    args = (q, k, probs, drop.rng_state, *_row_strides(q, packed), *_row_strides(k, packed), *probs.stride()[:3],
            nheads, seqlen_q, seqlen_k, nheads // k.shape[-2])
    kwargs = dict(**options.runtime, keep_threshold=drop.keep_threshold, **options.constexprs, BLOCK_M=block_m,
                  BLOCK_N=block_n, **extra, **(variants or {}))
    device_index = q.device.index if q.device.index is not None else 0
    with _on_device(q):
        _launch_dropout_probs(None, grid, args, 4, 1, kwargs, device_index)
    return probs


# Every launch goes through a LaunchCache: the cache mode's (chunked prefill) with a key, for the fast
# launch; the others with key None, i.e. through Triton's dispatcher (and into `_launch.recording`).
_launch_fwd = LaunchCache(fwd_kernel)
_launch_bwd_preprocess = LaunchCache(bwd_preprocess_kernel)
_launch_bwd_dkdv = LaunchCache(bwd_dkdv_kernel)
_launch_bwd_dq = LaunchCache(bwd_dq_kernel)
_launch_dropout_probs = LaunchCache(dropout_probs_kernel)


def _launch_forward(q, k, v, out, lse, batch, seqlen_q, seqlen_k, options: AttnOptions, config: AttnConfig, extra,
                    *, use_tma: bool, kv_strides=None, launch_key=None):
    """Launch fwd_kernel with `config` and the tensor-descriptor decision `use_tma` (`_use_tma`);
    `extra` holds the packed-mode or the cache-mode kernel arguments ({} for dense tensors). The cache
    mode also passes its K/V (batch, row, head) strides (`kv_strides`) and a `launch_key` for the fast
    launch (the inputs' signature and alignment, see kernels/tritonattn/_launch.py); otherwise the strides follow
    from the tensors and the launch goes through Triton's dispatcher.

    One program per (query block, batch entry or sequence, head); in packed mode seqlen_q/k are the
    longest lengths and blocks past a shorter sequence's end exit at once.
    """
    nheads, nheads_k = q.shape[-2], k.shape[-2]
    if use_tma:
        _ensure_tma_allocator()
    packed = extra.get("IS_VARLEN", False)
    if kv_strides is None:
        kv_strides = (_row_strides(k, packed), _row_strides(v, packed))
    grid = (triton.cdiv(seqlen_q, config.block_m), batch * nheads, 1)
    args = (q, k, v, out, lse,
            *_row_strides(q, packed), *kv_strides[0], *kv_strides[1], *_row_strides(out, packed),
            nheads, seqlen_q, seqlen_k, nheads // nheads_k)
    kwargs = dict(**options.runtime, **options.constexprs, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
                  USE_TMA=use_tma, **extra)
    device_index = q.device.index if q.device.index is not None else 0
    with _on_device(q):
        _launch_fwd(launch_key, grid, args, config.num_warps, config.num_stages, kwargs, device_index)


def _backward_configs(options: AttnOptions, dtype: torch.dtype, target: Optional[Target],
                      configs: Optional[Tuple[AttnConfig, AttnConfig]]) -> Tuple[AttnConfig, AttnConfig]:
    """The backward's (dK/dV, dQ) configs; raises NotImplementedError, before any launch, where no tile fits."""
    reason = prefill_bwd_unsupported(options.head_dim_pad, dtype, target)
    if reason is not None:
        raise NotImplementedError(f"Cannot run the attention backward here: {reason}.")
    return configs if configs is not None else prefill_bwd_config(options.head_dim_pad, dtype, options.causal, target)


def _launch_backward(dout, q, k, v, out, lse, dq, dk, dv, delta, batch, seqlen_q, seqlen_k, options: AttnOptions,
                     configs, varlen, drop: Optional[Dropout] = None,
                     variants: Optional[dict] = None) -> Optional[torch.Tensor]:
    """Launch the three backward kernels (`configs` from _backward_configs); `varlen` as in _launch_forward;
    `drop` the forward's dropout, `variants` its `variant_args`. Returns dsinks (nheads,) float32 with
    sinks (the preprocessing's per-block shares summed in a fixed order: deterministic), else None."""
    nheads, nheads_k = q.shape[-2], k.shape[-2]
    target = device_target(q.device)
    cfg_kv, cfg_q = configs
    use_tma = _use_tma(cfg_kv.use_tma, target, q, k, v, dout)
    if use_tma:
        _ensure_tma_allocator()
    packed = bool(varlen)
    varlen_pre = {key: val for key, val in varlen.items() if key != "Cu_seqlens_k"}  # preprocess reads no keys
    q_s, k_s, v_s, do_s = (_row_strides(t, packed) for t in (q, k, v, dout))
    variants = variants or {}
    attention = dict(**options.runtime, **options.constexprs, USE_TMA=use_tma, **varlen, **_dropout_args(drop),
                     **variants)
    pre_grid = (triton.cdiv(seqlen_q, 64), batch * nheads, 1)
    dsinks_part, sinks_args = None, {}
    if options.sinks:  # one share of dsinks per preprocessing program, zero where a program exits early
        dsinks_part = torch.zeros(pre_grid[:2], dtype=torch.float32, device=q.device)
        sinks_args = dict(Lse=lse, Sinks=variants["Sinks"], Dsinks_part=dsinks_part, HAS_SINKS=True)
    device_index = q.device.index if q.device.index is not None else 0
    with _on_device(q):
        _launch_bwd_preprocess(  # Triton's default 4 warps and 3 stages
            None, pre_grid,
            (out, dout, delta, *_row_strides(out, packed), *do_s, nheads, seqlen_q), 4, 3,
            dict(**options.tile, BLOCK_M=64, **varlen_pre, **sinks_args), device_index,
        )
        _launch_bwd_dkdv(
            None, (triton.cdiv(seqlen_k, cfg_kv.block_n), batch * nheads_k, 1),
            (q, k, v, dout, lse, delta, dk, dv,
             *q_s, *k_s, *v_s, *do_s, *_row_strides(dk, packed), *_row_strides(dv, packed),
             nheads, seqlen_q, seqlen_k, nheads // nheads_k),
            cfg_kv.num_warps, cfg_kv.num_stages,
            dict(BLOCK_M=cfg_kv.block_m, BLOCK_N=cfg_kv.block_n, **attention), device_index,
        )
        _launch_bwd_dq(
            None, (triton.cdiv(seqlen_q, cfg_q.block_m), batch * nheads, 1),
            (q, k, v, dout, lse, delta, dq,
             *q_s, *k_s, *v_s, *do_s, *_row_strides(dq, packed), nheads, seqlen_q, seqlen_k, nheads // nheads_k),
            cfg_q.num_warps, cfg_q.num_stages,
            dict(BLOCK_M=cfg_q.block_m, BLOCK_N=cfg_q.block_n, **attention), device_index,
        )
    return None if dsinks_part is None else dsinks_part.view(-1, batch, nheads).sum((0, 1))


def _varlen_args(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, total_q: int) -> dict:
    """Packed-mode kernel arguments; LSE and Delta are (nheads, total_q), so their head stride is total_q."""
    return dict(Cu_seqlens_q=cu_seqlens_q, Cu_seqlens_k=cu_seqlens_k, stride_lseh=total_q, IS_VARLEN=True)


def _forward_plan(q: torch.Tensor, options: AttnOptions, config: Optional[AttnConfig],
                  *caches: torch.Tensor) -> Tuple[Optional[Target], AttnConfig, bool]:
    """A forward launcher's (target, config, planned): `config` or the table's, and whether tensor
    descriptors are planned (`_tma_planned`; a cache that cannot be copied must have aligned rows
    itself: KVCache and PagedKVCache align them)."""
    target = device_target(q.device)
    if config is None:
        config = prefill_fwd_config(options.head_dim_pad, q.dtype, options.causal, target)
    planned = _tma_planned(config.use_tma, target, q.dtype) and all(rows_aligned(t) for t in caches)
    return target, config, planned


def _flash_attn_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, options: AttnOptions,
                        config: Optional[AttnConfig] = None, drop: Optional[Dropout] = None,
                        variants: Optional[dict] = None,
                        out: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Launch the forward kernel on validated inputs (with dropout `drop`, and the variants' tensors as
    `variant_args` gives them); returns (out, softmax_lse). out: written into when given (q's shape and
    dtype, any strides with a contiguous last dim)."""
    batch, seqlen_q, nheads, head_dim = q.shape
    seqlen_k = k.shape[1]
    chosen = config is None  # a caller's config pins fwd_kernel
    target, config, planned = _forward_plan(q, options, config)
    if out is None:
        out = empty_aligned((batch, seqlen_q, nheads, head_dim), q.dtype, q.device, aligned=planned)
    lse = torch.empty((batch, nheads, seqlen_q), dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        _empty_rows_lse(lse, options, variants)
        return out, lse
    q, k, v = _aligned_operands(planned, q, k, v)
    use_tma = _use_tma(config.use_tma, target, q, k, v, out)
    sm90 = prefill_fwd_sm90_config(options, q.dtype, seqlen_k, target) if use_tma and drop is None else None
    if sm90 is not None and chosen:  # Hopper's warp-specialized kernel (kernels/tritonattn/prefill_sm90.py)
        from .prefill_sm90 import forward as sm90_forward  # Gluon, imported only where it runs

        _ensure_tma_allocator()
        with _on_device(q):
            sm90_forward(q, k, v, out, lse, options, sm90, variants)
        return out, lse
    _launch_forward(q, k, v, out, lse, batch, seqlen_q, seqlen_k, options, config,
                    dict(_dropout_args(drop), **(variants or {})), use_tma=use_tma)
    return out, lse


def _empty_rows_lse(lse: torch.Tensor, options: AttnOptions, variants: Optional[dict]) -> None:
    """The LSE of rows that see no key without a launch: +inf, or each head's sink with sinks (the
    softmax over the sink alone); lse is (..., nheads, rows)."""
    if options.sinks and lse.numel():
        lse.copy_(variants["Sinks"][:, None].expand(lse.shape))
    else:
        lse.fill_(float("inf"))


def _flash_attn_kvcache_forward(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    seqlen_new: int,
    block_table: Optional[torch.Tensor],
    options: AttnOptions,
    config: Optional[AttnConfig] = None,
    launch_key=None,
    cache_leftpad: Optional[torch.Tensor] = None,
    variants: Optional[dict] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Chunked prefill (see [Note] Chunked prefill over a cache in kernels/tritonattn/prefill_kernels.py): q
    (B, M, H, D) attends over each request's cached keys, cache_seqlens[b] of them plus the
    `seqlen_new` (<= M; 0 for none) keys just written after them, the queries aligned to the last M key
    positions. The cache is dense (B, S, H_KV, D) or, with
    block_table (B, max_blocks) int32, a paged pool (NUM_BLOCKS, P, H_KV, D). cache_leftpad: None, or
    int32 (B,) on q's device: request b's keys start at cache row cache_leftpad[b] (a dense cache or a
    one-page-per-request table, cache_batch_idx's). variants: the ALiBi slopes' and sinks' kernel
    arguments (`variant_args`), the rest of the variants being the options'. Inputs are validated
    (tritonattn.decode does it; its `launch_key` holds the inputs' signature and alignment, see
    _launch_forward); returns (out (B, M, H, D), lse (B, H, M) float32)."""
    batch, seqlen_q, nheads, head_dim = q.shape
    target, config, planned = _forward_plan(q, options, config, k_cache, v_cache)  # q and out follow the cache
    out = empty_aligned((batch, seqlen_q, nheads, head_dim), q.dtype, q.device, aligned=planned)
    lse = torch.empty((batch, nheads, seqlen_q), dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        _empty_rows_lse(lse, options, variants)
        return out, lse
    (q,) = _aligned_operands(planned, q)
    use_tma = _use_tma(config.use_tma, target, q, k_cache, v_cache, out)
    cache_args = dict(Cache_seqlens=cache_seqlens, IS_KVCACHE=True, KV_APPEND=seqlen_new > 0, **(variants or {}))
    if seqlen_new:
        cache_args["N_NEW"] = seqlen_new
    if cache_leftpad is not None:
        cache_args.update(Cache_leftpad=cache_leftpad, HAS_LEFTPAD=True)
    if block_table is None:
        capacity = k_cache.shape[1]
        k_strides, v_strides = k_cache.stride()[:3], v_cache.stride()[:3]
    else:
        # not with left padding, whose shifted base would put the pool descriptor's span past its end
        capacity, use_tma, (k_strides, v_strides), paging = _paged_pool_args(
            k_cache, v_cache, block_table, config, use_tma and cache_leftpad is None)
        cache_args.update(paging)
    _launch_forward(q, k_cache, v_cache, out, lse, batch, seqlen_q, capacity, options, config, cache_args,
                    use_tma=use_tma, kv_strides=(k_strides, v_strides), launch_key=launch_key)
    return out, lse


def _paged_pool_args(k_cache, v_cache, block_table, config: AttnConfig, use_tma: bool):
    """The forward's cache-mode arguments of a paged pool (NUM_BLOCKS, P, H_KV, D) read through block_table:
    (capacity per request, use_tma, (k, v) (batch, row, head) strides, kernel arguments)."""
    num_blocks, page_size = k_cache.shape[0], k_cache.shape[1]
    # descriptors see the pool as [NUM_BLOCKS * P, D] rows: whole key blocks per page, rows evenly spaced
    use_tma = use_tma and page_size % config.block_n == 0 and all(
        t.stride(0) == page_size * t.stride(1) for t in (k_cache, v_cache))
    strides = (0, *k_cache.stride()[1:3]), (0, *v_cache.stride()[1:3])  # no batch offset
    args = dict(Block_table=block_table, stride_btb=block_table.stride(0), NUM_BLOCKS=num_blocks,
                stride_kblk=k_cache.stride(0), stride_vblk=v_cache.stride(0), PAGED=True, PAGE_SIZE=page_size,
                WIDE_PAGES=wide_pages(page_size, k_cache, v_cache))
    return block_table.shape[1] * page_size, use_tma, strides, args


def _flash_attn_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    options: AttnOptions,
    configs: Optional[Tuple[AttnConfig, AttnConfig]] = None,
    grads: Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None,
    drop: Optional[Dropout] = None,
    variants: Optional[dict] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """Launch the backward kernels (of a forward that ran with dropout `drop` and the variants'
    tensors `variants`); returns (dq, dk, dv) shaped like (q, k, v), written into `grads` when given
    (validated buffers with a contiguous last dim), delta = rowsum(dout * out) (batch, nheads,
    seqlen_q) float32, and dsinks (nheads,) float32 with sinks (else None)."""
    batch, seqlen_q, nheads, _ = q.shape
    seqlen_k = k.shape[1]
    target = device_target(q.device)
    configs = _backward_configs(options, q.dtype, target, configs)
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    dout, q, k, v, out = _aligned_operands(_tma_planned(configs[0].use_tma, target, q.dtype), dout, q, k, v, out)

    dq, dk, dv = grads if grads is not None else _empty_grads(q, k, v)
    delta = torch.empty((batch, nheads, seqlen_q), dtype=torch.float32, device=q.device)
    if seqlen_k > 0 and (seqlen_q == 0 or batch == 0):
        dk.zero_()
        dv.zero_()
    if dq.numel() == 0 or dk.numel() == 0:
        dq.zero_()
        delta.zero_()
        return dq, dk, dv, delta, _no_dsinks(options, nheads, q.device)
    dsinks = _launch_backward(dout, q, k, v, out, lse, dq, dk, dv, delta, batch, seqlen_q, seqlen_k, options, configs,
                              {}, drop, variants)
    return dq, dk, dv, delta, dsinks


def _no_dsinks(options: AttnOptions, nheads: int, device: torch.device) -> Optional[torch.Tensor]:
    """dsinks of a backward with no launch: zeros (the output is empty or zeros, so delta is 0)."""
    return torch.zeros(nheads, dtype=torch.float32, device=device) if options.sinks else None


def _empty_grads(q, k, v) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            torch.empty(k.shape, dtype=k.dtype, device=k.device), torch.empty(v.shape, dtype=v.dtype, device=v.device))


def _validate_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                     paged: bool = False) -> Tuple[int, int]:
    """Checks of packed inputs that need no device sync (see flash_attn_varlen_func); returns the max lengths.
    paged: k and v are the rows of paged pools, which cu_seqlens_k does not span."""
    _validate_tensor("q", q, 3, "(total_q, nheads, headdim)")
    _validate_tensor("k", k, 3, "(total_k, nheads_k, headdim)")
    _validate_tensor("v", v, 3, "(total_k, nheads_k, headdim)")
    _validate_dtypes(q=q, k=k, v=v)
    device = _validate_devices(q=q, k=k, v=v)
    if k.shape != v.shape:
        raise InputError(f"Expected k and v to have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}.")
    if q.shape[2] != k.shape[2]:
        raise InputError(f"Expected q and k to share the head dim, got {q.shape[2]} and {k.shape[2]}.")
    _validate_head_dim(q.shape[2])
    _validate_heads(q.shape[1], k.shape[1])
    max_seqlen_q = _validate_max_seqlen("max_seqlen_q", max_seqlen_q)
    max_seqlen_k = _validate_max_seqlen("max_seqlen_k", max_seqlen_k)
    _validate_cu_seqlens("cu_seqlens_q", cu_seqlens_q, device)
    _validate_cu_seqlens("cu_seqlens_k", cu_seqlens_k, device)
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise InputError(
            f"Expected cu_seqlens_q and cu_seqlens_k to describe the same batch, got {cu_seqlens_q.numel() - 1} "
            f"and {cu_seqlens_k.numel() - 1} sequences (shapes {tuple(cu_seqlens_q.shape)} and "
            f"{tuple(cu_seqlens_k.shape)})."
        )
    if cu_seqlens_q.device.type == "cpu":  # readable without a device sync (the interpreter's case)
        _validate_cu_seqlens_values("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q, "max_seqlen_q")
        _validate_cu_seqlens_values("cu_seqlens_k", cu_seqlens_k, None if paged else k.shape[0], max_seqlen_k,
                                    "max_seqlen_k")
    return max_seqlen_q, max_seqlen_k


def _flash_attn_varlen_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    options: AttnOptions,
    config: Optional[AttnConfig] = None,
    drop: Optional[Dropout] = None,
    variants: Optional[dict] = None,
    out: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Launch the forward kernel on validated packed inputs (with dropout `drop` and the variants'
    tensors `variants`); returns (out, softmax_lse (nheads, total_q)); out as `_flash_attn_forward`'s."""
    total_q, nheads, head_dim = q.shape
    batch = cu_seqlens_q.numel() - 1
    target, config, planned = _forward_plan(q, options, config)
    if out is None:
        out = empty_aligned((total_q, nheads, head_dim), q.dtype, q.device, aligned=planned)
    lse = torch.empty((nheads, total_q), dtype=torch.float32, device=q.device)
    if out.numel() == 0 or batch == 0 or max_seqlen_q == 0:
        out.zero_()
        _empty_rows_lse(lse, options, variants)
        return out, lse
    q, k, v = _aligned_operands(planned, q, k, v)
    _launch_forward(q, k, v, out, lse, batch, max_seqlen_q, max_seqlen_k, options, config,
                    dict(_varlen_args(cu_seqlens_q, cu_seqlens_k, total_q), **_dropout_args(drop), **(variants or {})),
                    use_tma=_use_tma(config.use_tma, target, q, k, v, out))
    return out, lse


def _flash_attn_varlen_paged_forward(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    block_table: torch.Tensor,
    options: AttnOptions,
    variants: Optional[dict] = None,
    config: Optional[AttnConfig] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """flash_attn_varlen_func's forward over a paged K/V (validated): packed queries in the cache mode,
    sequence b's keys the first cu_seqlens_k[b + 1] - cu_seqlens_k[b] logical rows of block_table[b]
    (see [Note] Packed sequences), with the variants' tensors `variants` (`variant_args`); returns
    (out, softmax_lse (nheads, total_q))."""
    total_q, nheads, head_dim = q.shape
    batch = cu_seqlens_q.numel() - 1
    target, config, planned = _forward_plan(q, options, config, k_cache, v_cache)
    out = empty_aligned((total_q, nheads, head_dim), q.dtype, q.device, aligned=planned)
    lse = torch.empty((nheads, total_q), dtype=torch.float32, device=q.device)
    if out.numel() == 0 or batch == 0 or max_seqlen_q == 0:
        out.zero_()
        _empty_rows_lse(lse, options, variants)
        return out, lse
    (q,) = _aligned_operands(planned, q)
    seqlens_k = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).to(torch.int32)  # on the device: no sync
    capacity, use_tma, kv_strides, paging = _paged_pool_args(
        k_cache, v_cache, block_table, config, _use_tma(config.use_tma, target, q, k_cache, v_cache, out))
    args = dict(_varlen_args(cu_seqlens_q, cu_seqlens_k, total_q), Cache_seqlens=seqlens_k, IS_KVCACHE=True,
                **paging, **(variants or {}))
    _launch_forward(q, k_cache, v_cache, out, lse, batch, max_seqlen_q, capacity, options, config, args,
                    use_tma=use_tma, kv_strides=kv_strides)
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
    options: AttnOptions,
    configs: Optional[Tuple[AttnConfig, AttnConfig]] = None,
    grads: Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None,
    drop: Optional[Dropout] = None,
    variants: Optional[dict] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """Launch the backward kernels in packed mode; returns (dq, dk, dv, delta, dsinks) as
    _flash_attn_backward, delta (nheads, total_q)."""
    total_q, nheads, _ = q.shape
    batch = cu_seqlens_q.numel() - 1
    target = device_target(q.device)
    configs = _backward_configs(options, q.dtype, target, configs)
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    dout, q, k, v, out = _aligned_operands(_tma_planned(configs[0].use_tma, target, q.dtype), dout, q, k, v, out)

    dq, dk, dv = grads if grads is not None else _empty_grads(q, k, v)
    delta = torch.empty((nheads, total_q), dtype=torch.float32, device=q.device)
    if dq.numel() == 0 or dk.numel() == 0 or batch == 0 or max_seqlen_q == 0 or max_seqlen_k == 0:
        dq.zero_()  # no query or no key anywhere: every gradient is 0
        dk.zero_()
        dv.zero_()
        delta.zero_()
        return dq, dk, dv, delta, _no_dsinks(options, nheads, q.device)
    dsinks = _launch_backward(dout, q, k, v, out, lse, dq, dk, dv, delta, batch, max_seqlen_q, max_seqlen_k, options,
                              configs, _varlen_args(cu_seqlens_q, cu_seqlens_k, total_q), drop, variants)
    return dq, dk, dv, delta, dsinks


# ============================================================================================
# Autograd
# ============================================================================================
def _sinks_grad(ctx, dsinks: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """dsinks in the sinks' own dtype, where they take a gradient."""
    return dsinks.to(ctx.sinks_dtype) if dsinks is not None and ctx.needs_input_grad[3] else None


def _wants_grad(*tensors: Optional[torch.Tensor]) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


# What the public functions call under torch.compile: the registered custom ops' callers, filled in by
# kernels/tritonattn/_ops.py when the package is imported (kept apart so that this module does not import it).
TRACED: dict = {}


class _FlashAttnFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, options, drop, variants):
        out, lse = _flash_attn_forward(q, k, v, options, drop=drop, variants=variants)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.options, ctx.drop, ctx.variants = options, drop, variants
        ctx.sinks_dtype = sinks.dtype if sinks is not None else None
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv, _, dsinks = _flash_attn_backward(dout, q, k, v, out, lse, ctx.options, drop=ctx.drop,
                                                     variants=ctx.variants)
        return dq, dk, dv, _sinks_grad(ctx, dsinks), None, None, None


class _FlashAttnVarlenFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, options, drop, variants):
        out, lse = _flash_attn_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                              options, drop=drop, variants=variants)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k)
        ctx.max_seqlen_q, ctx.max_seqlen_k = max_seqlen_q, max_seqlen_k
        ctx.options, ctx.drop, ctx.variants = options, drop, variants
        ctx.sinks_dtype = sinks.dtype if sinks is not None else None
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k = ctx.saved_tensors
        dq, dk, dv, _, dsinks = _flash_attn_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                                                            ctx.max_seqlen_q, ctx.max_seqlen_k, ctx.options,
                                                            drop=ctx.drop, variants=ctx.variants)
        return dq, dk, dv, _sinks_grad(ctx, dsinks), None, None, None, None, None, None, None


# ============================================================================================
# Public function
# ============================================================================================
def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    return_softmax_lse: bool = False,
    sinks: Optional[torch.Tensor] = None,
):
    """Attention softmax(q @ k^T * softmax_scale) @ v with flash-attn 2's signature.

    Args:
        q: (batch, seqlen_q, nheads, headdim), float16, bfloat16 or float32.
        k: (batch, seqlen_k, nheads_k, headdim), same dtype and device as q.
        v: (batch, seqlen_k, nheads_k, headdim).
            nheads must be a multiple of nheads_k: query head h uses KV head h // (nheads // nheads_k)
            (MHA: nheads_k == nheads, GQA: in between, MQA: nheads_k == 1). Any strides work as long
            as the last dim is contiguous (views of a fused QKV projection, transposed
            (batch, nheads, seqlen, headdim) tensors); no copies are made, except on Hopper of a
            tensor whose base or outer strides are not 16-byte multiples (tensor descriptors need
            them; a 2-byte headdim that is not a multiple of 8 is one), and then out is a view
            [..., :headdim] of an aligned buffer, as flash-attn's is.
            headdim: any in [1, 256] (the kernels pad the tile to a power of two and mask the rest).
        dropout_p: the probability, in [0, 1), of dropping each attention probability (the kept
            ones are scaled by 1 / (1 - dropout_p)); applied whenever > 0, as in flash-attn (pass 0.0
            in evaluation). The mask is drawn by a counter-based RNG seeded from torch's generator
            of q's device: `torch.manual_seed` reproduces it, and CUDA graphs capture it (each replay
            draws a fresh mask). The backward regenerates the same mask. The keep rate is 1 - dropout_p
            rounded to a multiple of 2^-16.
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
        window_size: (left, right), -1 for an unbounded side (a 2-element tensor works too): query i
            sees keys d - left <= j <= d + right, d = i + seqlen_k - seqlen_q (causal sets right to 0;
            (-1, 0) is causal). Key blocks outside the band are never loaded.
        softcap: > 0 caps the scaled scores: s -> softcap * tanh(s / softcap); <= 0 for none.
        alibi_slopes: None, or float32 (nheads,) or (batch, nheads): adds -slope * |d - j| to the
            scaled scores (ALiBi).
        deterministic: flash-attn's flag. Both values take the same path: neither the forward nor the
            backward uses atomics (dK/dV of a KV head are summed over its q-head group in
            registers, dQ has its own kernel), so gradients are bit-identical run to run.
        return_attn_probs: flash-attn's testing aid: also return softmax_lse and S_dmask, None
            without dropout; with dropout (batch, nheads, seqlen_q, seqlen_k) in q's dtype, S_dmask[b,
            h, i, j] = exp(score_ij - max_j' score_ij') (scores scaled), negated where the pair was
            dropped, 0 where query i does not see key j (`tritonattn.prefill.dropout_probs`). It costs an
            extra pass over the scores and one element of q's dtype per (query, key) pair per head: a
            test's tool.
        return_softmax_lse (keyword only): also return the log-sum-exp of each row.
        sinks (keyword only): None, or a floating (nheads,) tensor: a per-head logit that joins every
            row's softmax with no value (gpt-oss), so the row's probabilities sum to 1 - p_sink; the
            LSE includes it, and the backward returns its gradient. Formulas of every variant:
            `tritonattn.reference.attention_ref`.

    Returns:
        out: (batch, seqlen_q, nheads, headdim), dtype of q; (out, softmax_lse, S_dmask) with
            return_attn_probs, (out, softmax_lse) with return_softmax_lse.
        softmax_lse: (batch, nheads, seqlen_q) float32, natural log of the sum of exp(scaled
            scores) of each row; +inf for a row that sees no key, so that exp(score - lse) is 0 there.

    Precision: fp16/bf16 inputs are multiplied on tensor cores with fp32 accumulation. fp32 inputs
    use tf32 matmuls on GPUs (about 1e-3 relative error) and exact fp32 under the interpreter.
    """
    if torch.compiler.is_compiling():  # one graph node, see kernels/tritonattn/_ops.py
        return TRACED["flash_attn_func"](q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                                         alibi_slopes, return_attn_probs, return_softmax_lse, sinks)
    dropout_p = _validate_dropout(dropout_p)
    _validate_qkv(q, k, v)
    options, variants = variant_options(q.shape[3], softmax_scale, causal, window_size, softcap, alibi_slopes, sinks,
                                        k.shape[1], q.shape[0], q.shape[2], q.device)
    drop = dropout(dropout_p, q.device)
    if _wants_grad(q, k, v, sinks):
        out, lse = _FlashAttnFunc.apply(q, k, v, sinks, options, drop, variants)
    else:
        out, lse = _flash_attn_forward(q, k, v, options, drop=drop, variants=variants)
    probs = dropout_probs(q, k, options, drop, variants=variants) if return_attn_probs and drop is not None else None
    return _results(out, lse, probs, return_attn_probs, return_softmax_lse)


def _results(out, lse, probs, return_attn_probs: bool, return_softmax_lse: bool):
    """flash-attn's return convention ((out, softmax_lse, S_dmask) with return_attn_probs), then ours."""
    if return_attn_probs:
        return out, lse, probs
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
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table: Optional[torch.Tensor] = None,
    *,
    return_softmax_lse: bool = False,
    sinks: Optional[torch.Tensor] = None,
):
    """Attention over a batch of sequences of different lengths packed without padding (flash-attn's
    varlen interface). Sequence b's queries attend only to sequence b's keys.

    Args:
        q: (total_q, nheads, headdim), float16, bfloat16 or float32: the queries of every sequence
            concatenated along dim 0; sequence b owns rows [cu_seqlens_q[b], cu_seqlens_q[b + 1]).
        k: (total_k, nheads_k, headdim), same dtype and device as q; rows of sequence b are
            [cu_seqlens_k[b], cu_seqlens_k[b + 1]).
        v: (total_k, nheads_k, headdim).
            Heads, head dims and strides as in flash_attn_func: nheads a multiple of nheads_k
            (MHA/GQA/MQA), any headdim in [1, 256], any strides with a contiguous last
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
        dropout_p: as in flash_attn_func.
        softmax_scale: defaults to headdim ** -0.5.
        causal: per sequence, aligned to the bottom-right corner: query i of sequence b sees key j
            iff j <= i + seqlen_k[b] - seqlen_q[b]. For seqlen_q[b] = 2, seqlen_k[b] = 5 (1 = kept):
                1 1 1 1 0
                1 1 1 1 1
            A row that sees no key (seqlen_q[b] > seqlen_k[b], or seqlen_k[b] == 0) outputs zeros.
        window_size, softcap, alibi_slopes: as in flash_attn_func (a window side reaching past
            max_seqlen_k is unbounded, as in flash-attn).
        deterministic: flash-attn's flag. As in flash_attn_func, both values take the same
            atomic-free path: gradients are bit-identical run to run.
        return_attn_probs: as in flash_attn_func; S_dmask is (batch, nheads, max_seqlen_q,
            max_seqlen_k), sequence b's pairs at [b, :, :seqlen_q[b], :seqlen_k[b]], zeros elsewhere.
        block_table: optional int32 (batch, max_blocks_per_seq) on q's device: k and v are then
            paged pools (num_blocks, page_size, nheads_k, headdim) and sequence b's keys are the
            first cu_seqlens_k[b + 1] - cu_seqlens_k[b] logical rows of block_table[b] (logical row j
            in row j % page_size of block block_table[b, j // page_size]), as in flash-attn. Forward
            only (its backward raises NotImplementedError; flash-attn has none either), no dropout.
            Any page_size >= 1 (flash-attn asks for multiples of 256). With CPU cu_seqlens (the
            interpreter's case) the lengths and the entries they use are checked; on a GPU they are
            trusted and each entry is clamped into the pool (wrong results, never an out-of-bounds
            read), as in flash_attn_with_kvcache.
        return_softmax_lse (keyword only): also return the log-sum-exp of each row.

    Returns:
        out: (total_q, nheads, headdim), dtype of q, packed like q; with softmax_lse (and S_dmask)
            as in flash_attn_func.
        softmax_lse: (nheads, total_q) float32, flash-attn's packed varlen
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
    if torch.compiler.is_compiling():  # one graph node, see kernels/tritonattn/_ops.py
        return TRACED["flash_attn_varlen_func"](q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                                dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                                                return_attn_probs, block_table, return_softmax_lse, sinks)
    dropout_p = _validate_dropout(dropout_p)
    if block_table is not None:
        return _varlen_paged(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                             causal, window_size, softcap, alibi_slopes, return_attn_probs, block_table,
                             return_softmax_lse, sinks)
    max_seqlen_q, max_seqlen_k = _validate_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    options, variants = variant_options(q.shape[2], softmax_scale, causal, window_size, softcap, alibi_slopes, sinks,
                                        max_seqlen_k, cu_seqlens_q.numel() - 1, q.shape[1], q.device)
    cu_seqlens_q, cu_seqlens_k = cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous()
    args = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, options)
    drop = dropout(dropout_p, q.device)
    if _wants_grad(q, k, v, sinks):
        out, lse = _FlashAttnVarlenFunc.apply(q, k, v, sinks, *args, drop, variants)
    else:
        out, lse = _flash_attn_varlen_forward(q, k, v, *args, drop=drop, variants=variants)
    probs = None
    if return_attn_probs and drop is not None:
        probs = dropout_probs(q, k, options, drop, (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k), variants)
    return _results(out, lse, probs, return_attn_probs, return_softmax_lse)


def _varlen_paged(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                  causal, window_size, softcap, alibi_slopes, return_attn_probs, block_table, return_softmax_lse,
                  sinks):
    """flash_attn_varlen_func with block_table: validated here, forward only (see its docstring)."""
    _validate_tensor("k", k_cache, 4, "(num_blocks, page_size, nheads_k, headdim) with block_table")
    _validate_tensor("v", v_cache, 4, "(num_blocks, page_size, nheads_k, headdim) with block_table")
    if k_cache.shape != v_cache.shape or k_cache.shape[1] < 1:
        raise InputError(f"Expected k and v pools of one shape with page_size >= 1, got {tuple(k_cache.shape)} and "
                         f"{tuple(v_cache.shape)}.")
    # the packed-layout checks (dtypes, devices, heads, head dim, cu_seqlens), on one row of each page
    max_seqlen_q, max_seqlen_k = _validate_varlen(q, k_cache[:, 0], v_cache[:, 0], cu_seqlens_q, cu_seqlens_k,
                                                  max_seqlen_q, max_seqlen_k, paged=True)
    if not isinstance(block_table, torch.Tensor):
        raise InputTypeError(f"Expected block_table to be a torch.Tensor, got {type(block_table).__name__}.")
    if block_table.dtype != torch.int32:
        raise InputTypeError(f"Expected block_table of dtype int32, got {block_table.dtype}.")
    batch = cu_seqlens_q.numel() - 1
    if block_table.dim() != 2 or block_table.shape[0] != batch or block_table.device != q.device:
        raise InputError(f"Expected block_table (batch={batch}, max_blocks_per_seq) on {q.device}, got shape "
                         f"{tuple(block_table.shape)} on {block_table.device}.")
    if dropout_p:
        raise NotImplementedError("dropout with a paged K/V (block_table) is not supported: dropout is for training, "
                                  "and the paged forward has no backward.")
    page_size = k_cache.shape[1]
    capacity = block_table.shape[1] * page_size
    if k_cache.shape[0] < 1 or block_table.shape[1] < 1:
        raise InputError(f"Expected a pool of >= 1 block and a block_table of >= 1 column, got pools "
                         f"{tuple(k_cache.shape)} and block_table {tuple(block_table.shape)}.")
    block_table = block_table if block_table.stride(-1) == 1 else block_table.contiguous()
    if cu_seqlens_k.device.type == "cpu":  # host-known lengths (the interpreter's case): check them whole
        lengths = cu_seqlens_k[1:] - cu_seqlens_k[:-1]
        if lengths.numel() and int(lengths.max()) > capacity:
            raise InputError(f"Expected every key length <= the block table's capacity max_blocks_per_seq * "
                             f"page_size = {capacity}, got lengths {lengths.tolist()}.")
        if block_table.device.type == "cpu":
            _check_block_table_entries(block_table, lengths, 0, page_size, k_cache.shape[0])
    options, variants = variant_options(q.shape[2], softmax_scale, causal, window_size, softcap, alibi_slopes, sinks,
                                        max_seqlen_k, batch, q.shape[1], q.device)
    args = (q, k_cache, v_cache, cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous(), max_seqlen_q, block_table,
            options, variants)
    if torch.is_grad_enabled() and (q.requires_grad or k_cache.requires_grad or v_cache.requires_grad):
        out, lse = _FlashAttnVarlenPagedFunc.apply(*args)
    else:
        out, lse = _flash_attn_varlen_paged_forward(*args)
    return _results(out, lse, None, return_attn_probs, return_softmax_lse)


PAGED_VARLEN_NO_BACKWARD = ("flash_attn_varlen_func with block_table (a paged K/V) is forward only, as in flash-attn: "
                            "no gradient flows through it.")


class _FlashAttnVarlenPagedFunc(torch.autograd.Function):
    """The paged varlen forward under autograd: its backward says it does not exist (flash-attn has none)."""

    @staticmethod
    def forward(ctx, q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, block_table, options, variants):
        out, lse = _flash_attn_varlen_paged_forward(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                                    block_table, options, variants)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        raise NotImplementedError(PAGED_VARLEN_NO_BACKWARD)


# ============================================================================================
# Packed variants (flash-attn 2's signatures)
# ============================================================================================
def _unpack(name: str, packed: torch.Tensor, ndim: int, count: int, layout: str) -> Tuple[torch.Tensor, ...]:
    """The `count` tensors stacked along dim -3 of `packed`, as views (no copy): the kernels take
    any strides, and autograd assembles the packed gradient from theirs."""
    _validate_tensor(name, packed, ndim, layout)
    if packed.shape[-3] != count:
        raise InputError(f"Expected {name} of shape {layout}, got {tuple(packed.shape)}.")
    return packed.unbind(-3)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                              return_softmax_lse=False, sinks=None):
    """flash_attn_func over q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], with qkv
    (batch, seqlen, 3, nheads, headdim) as a fused QKV projection gives it (MHA). Arguments and
    results as in flash_attn_func; the gradient is qkv-shaped."""
    q, k, v = _unpack("qkv", qkv, 5, 3, "(batch, seqlen, 3, nheads, headdim)")
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs, return_softmax_lse=return_softmax_lse, sinks=sinks)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                             return_softmax_lse=False, sinks=None):
    """flash_attn_func over k, v = kv[:, :, 0], kv[:, :, 1], with kv (batch, seqlen_k, 2, nheads_k,
    headdim) (MHA/GQA/MQA). Arguments and results as in flash_attn_func; the gradient is kv-shaped."""
    k, v = _unpack("kv", kv, 5, 2, "(batch, seqlen_k, 2, nheads_k, headdim)")
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs, return_softmax_lse=return_softmax_lse, sinks=sinks)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False, *, return_softmax_lse=False, sinks=None):
    """flash_attn_varlen_func over q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2], with qkv
    (total, 3, nheads, headdim) and one cu_seqlens / max_seqlen for queries and keys. Arguments and
    results as in flash_attn_varlen_func."""
    q, k, v = _unpack("qkv", qkv, 4, 3, "(total, 3, nheads, headdim)")
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p, softmax_scale,
                                  causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs,
                                  return_softmax_lse=return_softmax_lse, sinks=sinks)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                                    return_softmax_lse=False, sinks=None):
    """flash_attn_varlen_func over k, v = kv[:, 0], kv[:, 1], with kv (total_k, 2, nheads_k, headdim).
    Arguments and results as in flash_attn_varlen_func."""
    k, v = _unpack("kv", kv, 4, 2, "(total_k, 2, nheads_k, headdim)")
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                  softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs, return_softmax_lse=return_softmax_lse, sinks=sinks)
