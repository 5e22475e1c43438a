"""The rotary embedding's launch (jit/rotary.py): rotated copies of q and the new k, for
flash_attn_with_kvcache's rotary_cos / rotary_sin (layout and angles: jit/rotary.py)."""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch
import triton

from ..config.options import head_dim_tile
from ..config.tables import row_block
from ..jit.rotary import rotary_kernel


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, *,
                 interleaved: bool, same_position: bool) -> torch.Tensor:
    """A rotated copy of x (batch, seqlen, nheads, headdim): token t of batch entry b at position
    positions[b] + t (positions[b] for all with same_position). Inputs validated by the caller:
    cos / sin (seqlen_ro, rotary_dim / 2) contiguous, positions int32 (batch,) on x's device."""
    batch, seqlen, nheads, head_dim = x.shape
    out = torch.empty((batch, seqlen, nheads, head_dim), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    block_s = row_block(seqlen)
    grid = (batch * nheads, triton.cdiv(seqlen, block_s))  # axis 0 has no 65535 cap
    with torch.cuda.device(x.device) if x.device.type == "cuda" else contextlib.nullcontext():
        rotary_kernel[grid](
            x, out, cos, sin, positions,
            x.stride(0), x.stride(1), x.stride(2), out.stride(0), out.stride(1), out.stride(2), cos.stride(0),
            seqlen, nheads, cos.shape[0],
            HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_tile(head_dim), ROTARY_DIM=2 * cos.shape[1],
            INTERLEAVED=interleaved, SAME_POSITION=same_position, BLOCK_S=block_s,
        )
    return out


class Rotary(NamedTuple):
    """A call's validated rotary tables (contiguous) and style."""

    cos: torch.Tensor
    sin: torch.Tensor
    interleaved: bool


def rotate(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, rotary: Rotary, *, positional: bool):
    """q and k rotated as flash-attn rotates them: k's token t at position positions[b] + t; q's the same
    when `positional` (causal or a sliding window, flash-attn's rule), else every token at positions[b]."""
    q = apply_rotary(q, rotary.cos, rotary.sin, positions, interleaved=rotary.interleaved, same_position=not positional)
    k = apply_rotary(k, rotary.cos, rotary.sin, positions, interleaved=rotary.interleaved, same_position=False)
    return q, k
