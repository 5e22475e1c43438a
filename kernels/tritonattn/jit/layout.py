"""V as the FP8 forward's P V operand on Hopper (jit/sm90.py): transposed, and its keys reordered within each
group of 16.

Transposed: an FP8 warpgroup MMA reads both shared-memory operands with the reduction dim contiguous, and for
P V that dim is the keys, so V (batch, seqlen_k, nheads_k, D) is copied to (batch, nheads_k, D, seqlen_k').

Reordered: the probabilities leave Q K^T's accumulator with each thread holding, of a row's 16 keys
16g .. 16g + 15, the pairs 2t, 2t + 1 and 2t + 8, 2t + 9 (t = lane % 4), while P V's register operand wants
four consecutive keys 4t .. 4t + 3 per 32-bit register. Rather than moving bytes between threads, the kernel
relabels P's columns so that each thread's own four values form its register (`fp8_pv_key`), and this copy
puts V's rows in the same order: position p of a group holds key `fp8_pv_key(p)`. Summing over the keys,
P V is unchanged. seqlen_k' is seqlen_k rounded up to 16; the positions whose key is past the end hold zeros.

One pass over V, which the quadratic forward amortises (docs/perf-notes.md, "The FP8 forward on Hopper").
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def fp8_pv_key(pos):
    """The key at position pos of the FP8 P V operand: within a group of 16, position bits (p3 p2 p1 p0)
    hold key 8 p1 + 4 p3 + 2 p2 + p0 (jit/sm90.py `_p_operand` applies the same order to P's columns)."""
    low = pos & 15
    return (pos - low) + 8 * ((low >> 1) & 1) + 4 * (low >> 3) + 2 * ((low >> 2) & 1) + (low & 1)


@triton.jit
def fp8_values_kernel(
    V, Out,
    stride_vb, stride_vn, stride_vh, stride_ob, stride_oh, stride_od,
    H, N, N_OUT,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One program per (BLOCK_N positions, batch entry and head): Out[b, h, d, p] = V[b, fp8_pv_key(p), h, d]
    for p < N_OUT, zero where that key is >= N."""
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    off_b = pid_bh // H
    off_h = pid_bh % H
    offs_p = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    keys = fp8_pv_key(offs_p)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    dims = offs_d[None, :] < HEAD_DIM
    src = V + off_b.to(tl.int64) * stride_vb + off_h * stride_vh
    tile = tl.load(src + keys[:, None].to(tl.int64) * stride_vn + offs_d[None, :], mask=(keys[:, None] < N) & dims,
                   other=0.0)
    dst = Out + off_b.to(tl.int64) * stride_ob + off_h.to(tl.int64) * stride_oh
    tl.store(dst + offs_d[:, None] * stride_od + offs_p[None, :], tl.trans(tile),
             mask=tl.trans((offs_p[:, None] < N_OUT) & dims))
