"""The launch of Hopper's warp-specialized Gluon forward (jit/sm90.py), imported only where it runs."""

from __future__ import annotations

from typing import Optional

import torch
import triton

from ..config.options import AttnOptions
from ..config.tables import SM90_MAXNREG, AttnConfig
from ..jit.sm90 import fwd_kernel_sm90_ws
from .fast import LaunchCache

_ws_launcher = LaunchCache(fwd_kernel_sm90_ws)


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
            options: AttnOptions, config: AttnConfig, tensors: Optional[dict] = None) -> None:
    """Launch the warp-specialized forward on dense (batch, seqlen, heads, D) tensors whose rows TMA can
    address, writing out and lse (batch, nheads, seqlen_q) float32; `tensors` as `AttnCall.tensors`.
    The caller checks the call is one `config.tables.prefill_fwd_sm90_config` gives a config for."""
    batch, seqlen_q, nheads, _ = q.shape
    seqlen_k, nheads_k = k.shape[1], k.shape[2]
    grid = (triton.cdiv(seqlen_q, config.block_m), batch * nheads, 1)
    args = (q, k, v, out, lse, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3],
            nheads, seqlen_q, seqlen_k, nheads // nheads_k)
    kwargs = dict(**options.runtime, **options.constexprs, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
                  NUM_STAGES=config.num_stages, **(tensors or {}))
    _ws_launcher(None, grid, args, config.num_warps, 1, kwargs, q.device.index or 0, maxnreg=SM90_MAXNREG)
