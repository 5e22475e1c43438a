"""The launch of Hopper's warp-specialized Gluon forward (jit/sm90.py), imported only where it runs."""

from __future__ import annotations

from typing import Optional

import torch
import triton

from ..config.options import KV_FP8_DTYPES, AttnOptions
from ..config.tables import SM90_MAXNREG, AttnConfig
from ..jit.sm90 import fwd_kernel_sm90_ws
from .fast import LaunchCache
from .operands import empty_aligned

_ws_launcher = LaunchCache(fwd_kernel_sm90_ws)


def keys_inner(v: torch.Tensor) -> torch.Tensor:
    """V (batch, seqlen_k, nheads_k, D) copied to (batch, nheads_k, D, seqlen_k), keys contiguous, rows padded
    to 16 bytes for the tensor descriptor: the FP8 warpgroup MMA reads its operand's reduction dim (the keys,
    for P V) contiguous in shared memory, and TMA copies tiles as they lie. One pass over V, which the
    quadratic forward amortises (docs/perf-notes.md, "The FP8 forward on Hopper")."""
    batch, seqlen_k, nheads_k, head_dim = v.shape
    return empty_aligned((batch, nheads_k, head_dim, seqlen_k), v.dtype, v.device).copy_(v.permute(0, 2, 3, 1))


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
            options: AttnOptions, config: AttnConfig, tensors: Optional[dict] = None) -> None:
    """Launch the warp-specialized forward on dense (batch, seqlen, heads, D) tensors whose rows TMA can
    address, writing out and lse (batch, nheads, seqlen_q) float32; `tensors` as `AttnCall.tensors`.
    The caller checks the call is one `config.tables.prefill_fwd_sm90_config` gives a config for."""
    batch, seqlen_q, nheads, _ = q.shape
    seqlen_k, nheads_k = k.shape[1], k.shape[2]
    grid = (triton.cdiv(seqlen_q, config.block_m), batch * nheads, 1)
    v_strides = v.stride()[:3]
    if q.dtype in KV_FP8_DTYPES:  # FP8 P V reads V with keys contiguous: (batch, nheads_k, D, seqlen_k)
        v = keys_inner(v)
        v_strides = (v.stride(0), v.stride(2), v.stride(1))  # batch, a head-dim row, head
    args = (q, k, v, out, lse, *q.stride()[:3], *k.stride()[:3], *v_strides, *out.stride()[:3],
            nheads, seqlen_q, seqlen_k, nheads // nheads_k)
    kwargs = dict(**options.runtime, **options.constexprs, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
                  NUM_STAGES=config.num_stages, **(tensors or {}))
    _ws_launcher(None, grid, args, config.num_warps, 1, kwargs, q.device.index or 0, maxnreg=SM90_MAXNREG)
