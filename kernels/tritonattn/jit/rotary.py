"""Rotary position embedding for flash_attn_with_kvcache's rotary_cos / rotary_sin.

flash-attn rotates q and the new k inside its kvcache call; here a small kernel writes rotated copies
of q and k (one pass over tensors of seqlen_q / seqlen_new tokens, small next to the cache the
attention reads) and the attention runs on them. Positions come from the device lengths, so the call
stays free of host syncs and can be captured in a CUDA graph.

Layout of cos / sin: (seqlen_ro, rotary_dim / 2); row p holds the angles of position p. The first
rotary_dim dims of each head are rotated, the rest pass through:
- GPT-NeoX style (interleaved=False): dim i pairs with dim i + rotary_dim / 2, angle i;
- GPT-J style (interleaved=True): dims 2i and 2i + 1 pair, angle i.
For a pair (a, b) at angle t: a' = a cos t - b sin t, b' = b cos t + a sin t (computed in float32).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rotary_kernel(
    X, Out, Cos, Sin, Positions,
    stride_xb, stride_xs, stride_xh, stride_ob, stride_os, stride_oh, stride_cs,
    S, H, SEQLEN_RO,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, ROTARY_DIM: tl.constexpr, INTERLEAVED: tl.constexpr,
    SAME_POSITION: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """One program per (batch entry and head, block of BLOCK_S tokens): token t of batch entry b sits at
    position Positions[b] + t (Positions[b] for every token with SAME_POSITION)."""
    pid_s = tl.program_id(1)
    off_b = tl.program_id(0) // H
    off_h = tl.program_id(0) % H
    offs_s = pid_s * BLOCK_S + tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    start = tl.load(Positions + off_b)
    if SAME_POSITION:
        pos = start + offs_s * 0
    else:
        pos = start + offs_s
    pos = tl.minimum(tl.maximum(pos, 0), SEQLEN_RO - 1)  # the launcher checks SEQLEN_RO covers the cache
    HALF: tl.constexpr = ROTARY_DIM // 2
    if INTERLEAVED:
        partner = offs_d ^ 1
        angle = offs_d // 2
        sign = tl.where(offs_d % 2 == 0, -1.0, 1.0)
    else:
        partner = tl.where(offs_d < HALF, offs_d + HALF, offs_d - HALF)
        angle = offs_d % HALF
        sign = tl.where(offs_d < HALF, -1.0, 1.0)
    rows = offs_s[:, None] < S
    in_dim = offs_d[None, :] < HEAD_DIM
    rotated = offs_d[None, :] < ROTARY_DIM
    x_row = X + off_b.to(tl.int64) * stride_xb + off_h * stride_xh + offs_s[:, None].to(tl.int64) * stride_xs
    x = tl.load(x_row + offs_d[None, :], mask=rows & in_dim, other=0.0).to(tl.float32)
    x_partner = tl.load(x_row + partner[None, :], mask=rows & rotated, other=0.0).to(tl.float32)
    angle_at = pos[:, None].to(tl.int64) * stride_cs + angle[None, :]
    cos = tl.load(Cos + angle_at, mask=rows & rotated, other=1.0).to(tl.float32)
    sin = tl.load(Sin + angle_at, mask=rows & rotated, other=0.0).to(tl.float32)
    out = x * cos + sign[None, :] * x_partner * sin
    o_row = Out + off_b.to(tl.int64) * stride_ob + off_h * stride_oh + offs_s[:, None].to(tl.int64) * stride_os
    tl.store(o_row + offs_d[None, :], out.to(Out.dtype.element_ty), mask=rows & in_dim)
