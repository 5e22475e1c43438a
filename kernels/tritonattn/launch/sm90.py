"""The launches of Hopper's warp-specialized Gluon kernels (jit/sm90.py's forward, jit/sm90_bwd.py's fused
backward), imported only where they run."""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import triton

from ..config.options import KV_FP8_DTYPES, AttnOptions
from ..config.tables import FP8_VALUES_BLOCK, SM90_MAXNREG, AttnConfig
from ..jit.layout import fp8_values_kernel
from ..jit.sm90 import fwd_kernel_sm90_ws
from ..jit.sm90_bwd import bwd_kernel_sm90_ws
from .fast import LaunchCache

_ws_launcher = LaunchCache(fwd_kernel_sm90_ws)
_bwd_launcher = LaunchCache(bwd_kernel_sm90_ws)
_fp8_values_launcher = LaunchCache(fp8_values_kernel)


def fp8_values(v: torch.Tensor) -> torch.Tensor:
    """V (batch, seqlen_k, nheads_k, D), its last dim contiguous (as validated), as the FP8 forward's P V operand
    (jit/layout.py): (batch, nheads_k, D, seqlen_k rounded up to 16), keys contiguous and reordered within
    groups of 16 (`fp8_pv_key`), the positions past the last key zero. Rows are 16-byte multiples, as the
    tensor descriptor needs."""
    batch, seqlen_k, nheads_k, head_dim = v.shape
    width = triton.cdiv(seqlen_k, 16) * 16
    out = torch.empty((batch, nheads_k, head_dim, width), dtype=v.dtype, device=v.device)
    grid = (triton.cdiv(width, FP8_VALUES_BLOCK), batch * nheads_k, 1)
    args = (v, out, v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2), nheads_k,
            seqlen_k, width)
    kwargs = dict(HEAD_DIM=head_dim, HEAD_DIM_PAD=triton.next_power_of_2(head_dim), BLOCK_N=FP8_VALUES_BLOCK)
    _fp8_values_launcher(None, grid, args, 4, 1, kwargs, v.device.index or 0)
    return out


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
            options: AttnOptions, config: AttnConfig, tensors: Optional[dict] = None,
            varlen: Optional[Tuple[torch.Tensor, torch.Tensor, int, int]] = None,
            cache: Optional[Tuple[torch.Tensor, int, Optional[torch.Tensor]]] = None) -> None:
    """Launch the warp-specialized forward on tensors whose rows TMA can address, writing out and lse; `tensors`
    as `AttnCall.tensors`. Dense: (batch, seqlen, heads, D) tensors, lse (batch, nheads, seqlen_q) float32.
    Packed (`varlen` = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k), 16-bit only): (total, heads,
    D) tensors, lse (nheads, total_q). Chunked prefill (`cache` = (cache_seqlens, seqlen_new, block_table), as
    `launch.prefill.launch_cache_prefill` takes them; 16-bit, no window): k and v are the cache, dense (batch,
    capacity, heads_k, D) or, with a block table, a pool (num_blocks, page_size, heads_k, D) whose page size is a
    multiple of config.block_n and whose pages are evenly spaced. The caller checks the call is one
    `config.tables.prefill_fwd_sm90_config` gives a config for."""
    nheads, nheads_k = q.shape[-2], k.shape[-2]
    if cache is not None:
        batch, seqlen_q = q.shape[0], q.shape[1]
        strides = [t.stride()[:3] for t in (q, k, v, out)]
        cache_seqlens, seqlen_new, block_table = cache
        extra = dict(Cache_seqlens=cache_seqlens, IS_KVCACHE=True, KV_APPEND=seqlen_new > 0)
        if seqlen_new:
            extra["N_NEW"] = seqlen_new
        if block_table is None:
            seqlen_k = k.shape[1]
        else:  # the pool as rows: no batch offset
            num_blocks, page_size = k.shape[0], k.shape[1]
            seqlen_k = block_table.shape[1] * page_size
            strides[1], strides[2] = (0, *k.stride()[1:3]), (0, *v.stride()[1:3])
            extra.update(Block_table=block_table, stride_btb=block_table.stride(0), NUM_BLOCKS=num_blocks, PAGED=True,
                         PAGE_SIZE=page_size)
    elif varlen is None:
        batch, seqlen_q, seqlen_k = q.shape[0], q.shape[1], k.shape[1]
        strides = [t.stride()[:3] for t in (q, k, v, out)]
        extra = {}
    else:
        if q.dtype in KV_FP8_DTYPES:
            raise ValueError("The Hopper forward takes packed sequences in fp16 / bf16 only; "
                             f"got {q.dtype} (the FP8 forward's V copy is per dense batch entry).")
        cu_seqlens_q, cu_seqlens_k, seqlen_q, seqlen_k = varlen
        batch = cu_seqlens_q.numel() - 1
        strides = [(0, *t.stride()[:2]) for t in (q, k, v, out)]  # (batch, row, head): no batch dim
        extra = dict(Cu_seqlens_q=cu_seqlens_q, Cu_seqlens_k=cu_seqlens_k, stride_lseh=lse.stride(0),
                     IS_VARLEN=True)
    grid = (triton.cdiv(seqlen_q, config.block_m), batch * nheads, 1)
    if q.dtype in KV_FP8_DTYPES:  # FP8 P V reads V transposed, keys reordered: (batch, nheads_k, D, seqlen_k')
        v = fp8_values(v)
        strides[2] = (v.stride(0), v.stride(2), v.stride(1))  # batch, a head-dim row, head
    args = (q, k, v, out, lse, *strides[0], *strides[1], *strides[2], *strides[3], nheads, seqlen_q, seqlen_k,
            nheads // nheads_k)
    kwargs = dict(**options.runtime, **options.constexprs, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
                  NUM_STAGES=config.num_stages, **extra, **(tensors or {}))
    _ws_launcher(None, grid, args, config.num_warps, 1, kwargs, q.device.index or 0, maxnreg=SM90_MAXNREG)


def backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lse: torch.Tensor,
             delta: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, options: AttnOptions,
             config: AttnConfig, deterministic: bool = False) -> torch.Tensor:
    """Launch the fused backward (jit/sm90_bwd.py) on dense (batch, seqlen, heads, 128) fp16 / bf16 tensors whose
    rows TMA can address, without variants: lse and delta (batch, nheads, seqlen_q) float32 (delta from the
    portable preprocessing); writes dk and dv (k's and v's shapes) and returns dQ as float32 (q's shape, softmax
    scale applied; the caller casts it). Its atomic adds make dQ's last bits vary run to run, unless
    `deterministic`: then they come in key-block order ([Note] Deterministic dQ in jit/sm90_bwd.py)."""
    batch, seqlen_q, nheads, _ = q.shape
    seqlen_k, nheads_k = k.shape[1], k.shape[2]
    dq_accum = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    # the loader brings each query block's LSE (times log2(e)) and delta by TMA: rows padded to whole blocks
    rows = triton.cdiv(seqlen_q, config.block_m) * config.block_m
    lse2 = torch.full((batch, nheads, rows), float("inf"), dtype=torch.float32, device=q.device)
    torch.mul(lse, math.log2(math.e), out=lse2[..., :seqlen_q])
    delta_rows = torch.zeros((batch, nheads, rows), dtype=torch.float32, device=q.device)
    delta_rows[..., :seqlen_q] = delta
    grid = (triton.cdiv(seqlen_k, config.block_n), batch * nheads_k, 1)
    strides = [stride for t in (q, k, v, dout, dq_accum, dk, dv) for stride in t.stride()[:3]]
    turns = torch.zeros((2 * batch * nheads * rows // config.block_m) if deterministic else 1, dtype=torch.int32,
                        device=q.device)  # [Note] Deterministic dQ: (consumer, batch * head, query block)
    args = (q, k, v, dout, lse2, delta_rows, dq_accum, dk, dv, turns, *strides, nheads, seqlen_q, seqlen_k,
            nheads // nheads_k)
    kwargs = dict(**options.runtime, **options.constexprs, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
                  NUM_STAGES=config.num_stages, DETERMINISTIC=deterministic)
    _bwd_launcher(None, grid, args, config.num_warps, 1, kwargs, q.device.index or 0, maxnreg=SM90_MAXNREG)
    return dq_accum
