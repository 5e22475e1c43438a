"""The prefill forward's launches: dense, packed (varlen), packed over a paged K/V, and over a KV cache
(chunked prefill), on validated inputs with the call's `AttnOptions`, its per-call tensors' kernel
arguments (`tensors`, api/args.py) and its `Dropout`; plus flash-attn's S_dmask (`dropout_probs`).
Tile configs come from config/tables.py; Hopper's warp-specialized kernel from launch/sm90.py.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton

from ..config.hardware import Target, device_target
from ..config.options import KV_FP8_DTYPES, AttnOptions, Dropout
from ..config.tables import AttnConfig, dropout_probs_tiles, prefill_fwd_config, prefill_fwd_sm90_config
from ..jit.common import wide_pages
from ..jit.prefill_fwd import dropout_probs_kernel, fwd_kernel
from .fast import LaunchCache
from .operands import (
    aligned_operands,
    empty_aligned,
    ensure_tma_allocator,
    on_device,
    row_strides,
    rows_aligned,
    tma_planned,
    tma_usable,
)


def dropout_args(drop: Optional[Dropout]) -> dict:
    return drop.kernel_args if drop is not None else {}


def dropout_probs(q: torch.Tensor, k: torch.Tensor, options: AttnOptions, drop: Dropout,
                  varlen: Optional[Tuple[torch.Tensor, torch.Tensor, int, int]] = None,
                  tensors: Optional[dict] = None) -> torch.Tensor:
    """flash-attn's S_dmask for a forward that ran with `drop` (its testing aid; see
    `dropout_probs_kernel`): (batch, nheads, seqlen_q, seqlen_k) in q's dtype, S[b, h, i, j] =
    +-exp(score - row max), negative where the pair was dropped, 0 where row i does not see key j.
    Packed inputs give (batch, nheads, max_seqlen_q, max_seqlen_k), sequence b's pairs at its own
    positions and zeros past its lengths (a sequence longer than max_seqlen_q / max_seqlen_k is cut to
    them). The scores are those the softmax sees (softcap, ALiBi and window applied; `tensors` as
    `AttnCall.tensors` gives them); a sink takes no part. It costs batch * nheads * seqlen_q * seqlen_k
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
    block_m, block_n = dropout_probs_tiles(options.head_dim_pad)
    grid = (triton.cdiv(seqlen_q, block_m), batch * nheads, 1)
    args = (q, k, probs, drop.rng_state, *row_strides(q, packed), *row_strides(k, packed), *probs.stride()[:3],
            nheads, seqlen_q, seqlen_k, nheads // k.shape[-2])
    kwargs = dict(**options.runtime, keep_threshold=drop.keep_threshold, **options.constexprs, BLOCK_M=block_m,
                  BLOCK_N=block_n, **extra, **(tensors or {}))
    device_index = q.device.index if q.device.index is not None else 0
    with on_device(q):
        _dropout_probs_launcher(None, grid, args, 4, 1, kwargs, device_index)
    return probs


# Every launch goes through a LaunchCache: the cache mode's (chunked prefill) with a key, for the fast
# launch; the others with key None, i.e. through Triton's dispatcher (and into `fast.recording`).
_fwd_launcher = LaunchCache(fwd_kernel)


_dropout_probs_launcher = LaunchCache(dropout_probs_kernel)


def launch_forward(q, k, v, out, lse, batch, seqlen_q, seqlen_k, options: AttnOptions, config: AttnConfig, extra,
                    *, use_tma: bool, kv_strides=None, launch_key=None):
    """Launch fwd_kernel with `config` and the tensor-descriptor decision `use_tma` (`use_tma`);
    `extra` holds the packed-mode or the cache-mode kernel arguments ({} for dense tensors). The cache
    mode also passes its K/V (batch, row, head) strides (`kv_strides`) and a `launch_key` for the fast
    launch (the inputs' signature and alignment, see kernels/tritonattn/launch/fast.py); otherwise the strides follow
    from the tensors and the launch goes through Triton's dispatcher.

    One program per (query block, batch entry or sequence, head); in packed mode seqlen_q/k are the
    longest lengths and blocks past a shorter sequence's end exit at once.
    """
    nheads, nheads_k = q.shape[-2], k.shape[-2]
    if use_tma:
        ensure_tma_allocator()
    packed = extra.get("IS_VARLEN", False)
    if kv_strides is None:
        kv_strides = (row_strides(k, packed), row_strides(v, packed))
    grid = (triton.cdiv(seqlen_q, config.block_m), batch * nheads, 1)
    args = (q, k, v, out, lse,
            *row_strides(q, packed), *kv_strides[0], *kv_strides[1], *row_strides(out, packed),
            nheads, seqlen_q, seqlen_k, nheads // nheads_k)
    kwargs = dict(**options.runtime, **options.constexprs, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
                  USE_TMA=use_tma, **extra)
    device_index = q.device.index if q.device.index is not None else 0
    with on_device(q):
        _fwd_launcher(launch_key, grid, args, config.num_warps, config.num_stages, kwargs, device_index)


def varlen_args(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, total_q: int) -> dict:
    """Packed-mode kernel arguments; LSE and Delta are (nheads, total_q), so their head stride is total_q."""
    return dict(Cu_seqlens_q=cu_seqlens_q, Cu_seqlens_k=cu_seqlens_k, stride_lseh=total_q, IS_VARLEN=True)


def _forward_plan(q: torch.Tensor, options: AttnOptions, config: Optional[AttnConfig],
                  *caches: torch.Tensor) -> Tuple[Optional[Target], AttnConfig, bool]:
    """A forward launcher's (target, config, planned): `config` or the table's, and whether tensor
    descriptors are planned (`tma_planned`; a cache that cannot be copied must have aligned rows
    itself: KVCache and PagedKVCache align them)."""
    target = device_target(q.device)
    if config is None:
        config = prefill_fwd_config(options.head_dim_pad, q.dtype, options.causal, target)
    planned = tma_planned(config.use_tma, target, q.dtype) and all(rows_aligned(t) for t in caches)
    return target, config, planned


def launch_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, options: AttnOptions,
                        config: Optional[AttnConfig] = None, drop: Optional[Dropout] = None,
                        tensors: Optional[dict] = None,
                        out: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Launch the forward kernel on validated inputs (with dropout `drop`, and the tensors' tensors as
    `AttnCall.tensors` gives them); returns (out, softmax_lse). out: written into when given (q's shape and
    dtype, any strides with a contiguous last dim)."""
    batch, seqlen_q, nheads, head_dim = q.shape
    seqlen_k = k.shape[1]
    chosen = config is None  # a caller's config pins fwd_kernel
    target, config, planned = _forward_plan(q, options, config)
    if out is None:
        out = empty_aligned((batch, seqlen_q, nheads, head_dim), out_dtype(q), q.device, aligned=planned)
    lse = torch.empty((batch, nheads, seqlen_q), dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        empty_rows_lse(lse, options, tensors)
        return out, lse
    q, k, v = aligned_operands(planned, q, k, v)
    use_tma = tma_usable(config.use_tma, target, q, k, v, out)
    sm90 = _sm90_plan(q, k, out, options, seqlen_k, target, use_tma) if chosen and drop is None else None
    if sm90 is not None:
        _launch_sm90(q, k, v, out, lse, options, sm90, tensors)
        return out, lse
    launch_forward(q, k, v, out, lse, batch, seqlen_q, seqlen_k, options, config,
                    dict(dropout_args(drop), **(tensors or {})), use_tma=use_tma)
    return out, lse


def _sm90_plan(q: torch.Tensor, k: torch.Tensor, out: torch.Tensor, options: AttnOptions, seqlen_k: int,
               target: Optional[Target], use_tma: bool) -> Optional[AttnConfig]:
    """The config of Hopper's warp-specialized kernel for a forward without dropout and with the table's config,
    or None where fwd_kernel runs: the rule's (`prefill_fwd_sm90_config`, seqlen_k the longest sequence's), and
    descriptors that can address the tensors (the 16-bit path's, or the FP8 forward's: q, k and out, V being
    copied)."""
    descriptors = use_tma or (q.dtype in KV_FP8_DTYPES and all(rows_aligned(t) for t in (q, k, out)))
    return prefill_fwd_sm90_config(options, q.dtype, seqlen_k, target) if descriptors else None


def _launch_sm90(q, k, v, out, lse, options: AttnOptions, config: AttnConfig, tensors: Optional[dict],
                 varlen=None, cache=None) -> None:
    """`launch.sm90.forward` (its `varlen` and `cache` arguments) with q's device current."""
    from .sm90 import forward as sm90_forward  # Gluon, imported only where it runs

    ensure_tma_allocator()
    with on_device(q):
        sm90_forward(q, k, v, out, lse, options, config, tensors, varlen, cache)


def out_dtype(q: torch.Tensor) -> torch.dtype:
    """The output's dtype: q's, or bfloat16 for the FP8 forward (an e4m3 q), as FlashAttention-3's."""
    return torch.bfloat16 if q.dtype in KV_FP8_DTYPES else q.dtype


def empty_rows_lse(lse: torch.Tensor, options: AttnOptions, tensors: Optional[dict]) -> None:
    """The LSE of rows that see no key without a launch: +inf, or each head's sink with sinks (the
    softmax over the sink alone); lse is (..., nheads, rows)."""
    if options.sinks and lse.numel():
        lse.copy_(tensors["Sinks"][:, None].expand(lse.shape))
    else:
        lse.fill_(float("inf"))


def launch_cache_prefill(
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
    tensors: Optional[dict] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Chunked prefill (see [Note] Chunked prefill over a cache in kernels/tritonattn/jit/prefill_fwd.py): q
    (B, M, H, D) attends over each request's cached keys, cache_seqlens[b] of them plus the
    `seqlen_new` (<= M; 0 for none) keys just written after them, the queries aligned to the last M key
    positions. The cache is dense (B, S, H_KV, D) or, with
    block_table (B, max_blocks) int32, a paged pool (NUM_BLOCKS, P, H_KV, D). cache_leftpad: None, or
    int32 (B,) on q's device: request b's keys start at cache row cache_leftpad[b] (a dense cache or a
    one-page-per-request table, cache_batch_idx's). tensors: the ALiBi slopes' and sinks' kernel
    arguments (`AttnCall.tensors`), the rest of the variants being the options'. Inputs are validated
    (tritonattn.launch.decode does it; its `launch_key` holds the inputs' signature and alignment, see
    launch_forward); returns (out (B, M, H, D), lse (B, H, M) float32)."""
    batch, seqlen_q, nheads, head_dim = q.shape
    chosen = config is None  # a caller's config pins fwd_kernel
    target, config, planned = _forward_plan(q, options, config, k_cache, v_cache)  # q and out follow the cache
    out = empty_aligned((batch, seqlen_q, nheads, head_dim), q.dtype, q.device, aligned=planned)
    lse = torch.empty((batch, nheads, seqlen_q), dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        empty_rows_lse(lse, options, tensors)
        return out, lse
    (q,) = aligned_operands(planned, q)
    # an FP8 cache is read through pointers: descriptors are planned for 2-byte tiles
    use_tma = tma_usable(config.use_tma, target, q, k_cache, v_cache, out) and not options.kv_fp8
    if chosen and use_tma and cache_leftpad is None:  # Hopper's kernel, where its rule and the pool allow
        capacity = k_cache.shape[1] if block_table is None else block_table.shape[1] * k_cache.shape[1]
        sm90 = prefill_fwd_sm90_config(options, q.dtype, capacity, target, cache=True)
        if sm90 is not None and (block_table is None or pool_in_blocks(k_cache, v_cache, sm90.block_n)):
            _launch_sm90(q, k_cache, v_cache, out, lse, options, sm90, tensors, cache=(cache_seqlens, seqlen_new,
                                                                                        block_table))
            return out, lse
    cache_args = dict(Cache_seqlens=cache_seqlens, IS_KVCACHE=True, KV_APPEND=seqlen_new > 0, **(tensors or {}))
    if seqlen_new:
        cache_args["N_NEW"] = seqlen_new
    if cache_leftpad is not None:
        cache_args.update(Cache_leftpad=cache_leftpad, HAS_LEFTPAD=True)
    if block_table is None:
        capacity = k_cache.shape[1]
        k_strides, v_strides = k_cache.stride()[:3], v_cache.stride()[:3]
    else:
        # not with left padding, whose shifted base would put the pool descriptor's span past its end
        capacity, use_tma, (k_strides, v_strides), paging = paged_pool_args(
            k_cache, v_cache, block_table, config, use_tma and cache_leftpad is None)
        cache_args.update(paging)
    launch_forward(q, k_cache, v_cache, out, lse, batch, seqlen_q, capacity, options, config, cache_args,
                    use_tma=use_tma, kv_strides=(k_strides, v_strides), launch_key=launch_key)
    return out, lse


def pool_in_blocks(k_cache: torch.Tensor, v_cache: torch.Tensor, block_n: int) -> bool:
    """Whether descriptors can see a paged pool (NUM_BLOCKS, P, H_KV, D) as [NUM_BLOCKS * P, D] rows of whole
    key blocks: P a multiple of block_n, and the rows evenly spaced (pages P rows apart)."""
    page_size = k_cache.shape[1]
    return page_size % block_n == 0 and all(t.stride(0) == page_size * t.stride(1) for t in (k_cache, v_cache))


def paged_pool_args(k_cache, v_cache, block_table, config: AttnConfig, use_tma: bool):
    """The forward's cache-mode arguments of a paged pool (NUM_BLOCKS, P, H_KV, D) read through block_table:
    (capacity per request, use_tma, (k, v) (batch, row, head) strides, kernel arguments)."""
    num_blocks, page_size = k_cache.shape[0], k_cache.shape[1]
    use_tma = use_tma and pool_in_blocks(k_cache, v_cache, config.block_n)
    strides = (0, *k_cache.stride()[1:3]), (0, *v_cache.stride()[1:3])  # no batch offset
    args = dict(Block_table=block_table, stride_btb=block_table.stride(0), NUM_BLOCKS=num_blocks,
                stride_kblk=k_cache.stride(0), stride_vblk=v_cache.stride(0), PAGED=True, PAGE_SIZE=page_size,
                WIDE_PAGES=wide_pages(page_size, k_cache, v_cache))
    return block_table.shape[1] * page_size, use_tma, strides, args


def launch_varlen(
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
    tensors: Optional[dict] = None,
    out: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Launch the forward kernel on validated packed inputs (with dropout `drop` and the tensors'
    tensors `tensors`); returns (out, softmax_lse (nheads, total_q)); out as `launch_prefill`'s."""
    total_q, nheads, head_dim = q.shape
    batch = cu_seqlens_q.numel() - 1
    chosen = config is None  # a caller's config pins fwd_kernel
    target, config, planned = _forward_plan(q, options, config)
    if out is None:
        out = empty_aligned((total_q, nheads, head_dim), out_dtype(q), q.device, aligned=planned)
    lse = torch.empty((nheads, total_q), dtype=torch.float32, device=q.device)
    if out.numel() == 0 or batch == 0 or max_seqlen_q == 0:
        out.zero_()
        empty_rows_lse(lse, options, tensors)
        return out, lse
    q, k, v = aligned_operands(planned, q, k, v)
    use_tma = tma_usable(config.use_tma, target, q, k, v, out)
    # Hopper's kernel takes packed sequences in 16 bits (the FP8 forward's V copy is per dense batch entry)
    packed_sm90 = chosen and drop is None and q.dtype not in KV_FP8_DTYPES
    sm90 = _sm90_plan(q, k, out, options, max_seqlen_k, target, use_tma) if packed_sm90 else None
    if sm90 is not None:
        varlen = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        _launch_sm90(q, k, v, out, lse, options, sm90, tensors, varlen)
        return out, lse
    launch_forward(q, k, v, out, lse, batch, max_seqlen_q, max_seqlen_k, options, config,
                    dict(varlen_args(cu_seqlens_q, cu_seqlens_k, total_q), **dropout_args(drop), **(tensors or {})),
                    use_tma=use_tma)
    return out, lse


def launch_varlen_paged(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    block_table: torch.Tensor,
    options: AttnOptions,
    tensors: Optional[dict] = None,
    config: Optional[AttnConfig] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """flash_attn_varlen_func's forward over a paged K/V (validated): packed queries in the cache mode,
    sequence b's keys the first cu_seqlens_k[b + 1] - cu_seqlens_k[b] logical rows of block_table[b]
    (see [Note] Packed sequences), with the per-call tensors' arguments `tensors` (`AttnCall.tensors`); returns
    (out, softmax_lse (nheads, total_q))."""
    total_q, nheads, head_dim = q.shape
    batch = cu_seqlens_q.numel() - 1
    target, config, planned = _forward_plan(q, options, config, k_cache, v_cache)
    out = empty_aligned((total_q, nheads, head_dim), q.dtype, q.device, aligned=planned)
    lse = torch.empty((nheads, total_q), dtype=torch.float32, device=q.device)
    if out.numel() == 0 or batch == 0 or max_seqlen_q == 0:
        out.zero_()
        empty_rows_lse(lse, options, tensors)
        return out, lse
    (q,) = aligned_operands(planned, q)
    if options.seqused_k:  # each sequence's key count, clamped in the kernel to the table's capacity
        seqlens_k = tensors["Seqused_k"]
    else:
        seqlens_k = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).to(torch.int32)  # on the device: no sync
    capacity, use_tma, kv_strides, paging = paged_pool_args(
        k_cache, v_cache, block_table, config, tma_usable(config.use_tma, target, q, k_cache, v_cache, out))
    args = dict(varlen_args(cu_seqlens_q, cu_seqlens_k, total_q), Cache_seqlens=seqlens_k, IS_KVCACHE=True,
                **paging, **(tensors or {}))
    launch_forward(q, k_cache, v_cache, out, lse, batch, max_seqlen_q, capacity, options, config, args,
                    use_tma=use_tma, kv_strides=kv_strides)
    return out, lse
