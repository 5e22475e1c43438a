"""Teaching foils for notebook 00: minimal Triton kernels with deliberate bugs. This is NOT the library.

Each kernel replays one of the four bugs that the seed's phase 0 ("hardening") fixed in the tutorial
FlashAttention kernel, on small inputs, so that the notebook can print the wrong answer beside the right
one of `tritonattn`. They are written to be read, not used: plain multi-head attention (no GQA, no causal
mask), (batch, seqlen, heads, head_dim) tensors, one program per (query or key tile, batch * head).

- `delta_assuming_contiguous` (bug a): the backward's preprocessing step D_i = rowsum(dO_i * O_i) with
  every offset computed as if dO and O were contiguous, so a strided view of dO is read in the wrong order.
- `forward_unmasked_tail` (bug b): a forward whose last key tile is loaded with other=0 but whose scores
  past seqlen_k are not set to -inf: each padded key adds exp(0 - m_i) to the softmax denominator.
  mask_scores=True is the one-line fix.
- `dv_unmasked_tail` (bug c): dV = P^T dO over query tiles, the last partial tile loaded without a mask.
  Its inputs must be views whose rows past the end lie inside the same allocation (guard rows), so that
  the stray reads stay in memory the caller owns. mask_rows=True is the fix.
- `copy_head_dim` (bug d): tl.arange(0, HEAD_DIM) over a head dim that is not a power of two, which Triton
  refuses to compile.
- `jit_source_lines`: lines of a @triton.jit function's own source, to show the library's code.
"""

from __future__ import annotations

import inspect
import textwrap
from typing import Tuple

import torch
import triton
import triton.language as tl


# --------------------------------------------------------------------------------------------
# Bug a: the backward's preprocessing step assumes a contiguous layout
# --------------------------------------------------------------------------------------------
@triton.jit
def _delta_contiguous_kernel(O, DO, Delta, M, H, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr):
    pid_m, off_bh = tl.program_id(0), tl.program_id(1)
    off_b, off_h = off_bh // H, off_bh % H
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, HEAD_DIM)
    # THE BUG: no strides are passed; the offsets of a contiguous (b, s, h, d) tensor are used for both
    offs = ((off_b * M + rows[:, None]) * H + off_h) * HEAD_DIM + cols[None, :]
    o = tl.load(O + offs, mask=rows[:, None] < M, other=0.0).to(tl.float32)
    do = tl.load(DO + offs, mask=rows[:, None] < M, other=0.0).to(tl.float32)
    tl.store(Delta + off_bh * M + rows, tl.sum(o * do, 1), mask=rows < M)


def delta_assuming_contiguous(out: torch.Tensor, dout: torch.Tensor, block_m: int = 16) -> torch.Tensor:
    """D (batch, heads, seqlen) float32 = rowsum(dout * out), computed by a kernel that ignores strides.

    Right for contiguous tensors; wrong for a strided view. Both tensors must be dense permutations of
    their storage (as a transposed (b, h, s, d) buffer is), so that the wrong offsets stay inside it.
    """
    b, m, h, d = out.shape
    if out.shape != dout.shape:
        raise ValueError(f"Expected out and dout of one shape, got {tuple(out.shape)} and {tuple(dout.shape)}.")
    for t in (out, dout):
        if t.untyped_storage().nbytes() < t.numel() * t.element_size():
            raise ValueError(f"delta_assuming_contiguous reads numel() = {t.numel()} elements from each tensor's "
                             f"storage; a view of {tuple(t.shape)} has a smaller one: pass a dense permutation.")
    delta = torch.empty(b, h, m, device=out.device, dtype=torch.float32)
    _delta_contiguous_kernel[(triton.cdiv(m, block_m), b * h)](out, dout, delta, m, h, HEAD_DIM=d, BLOCK_M=block_m)
    return delta


# --------------------------------------------------------------------------------------------
# Bug b: phantom zero-padded keys in the softmax denominator
# --------------------------------------------------------------------------------------------
@triton.jit
def _fwd_kernel(Q, K, V, Out, M, N, H, scale, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, MASK_SCORES: tl.constexpr):
    pid_m, off_bh = tl.program_id(0), tl.program_id(1)
    off_b, off_h = off_bh // H, off_bh % H
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, HEAD_DIM)
    q_offs = ((off_b * M + rows[:, None]) * H + off_h) * HEAD_DIM + cols[None, :]
    q = tl.load(Q + q_offs, mask=rows[:, None] < M, other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for start_n in range(0, N, BLOCK_N):
        keys = start_n + tl.arange(0, BLOCK_N)
        kv_offs = ((off_b * N + keys[:, None]) * H + off_h) * HEAD_DIM + cols[None, :]
        k = tl.load(K + kv_offs, mask=keys[:, None] < N, other=0.0)  # keys past N read as zero rows
        v = tl.load(V + kv_offs, mask=keys[:, None] < N, other=0.0)
        s = tl.dot(q, tl.trans(k)) * scale  # a zero key scores q . 0 = 0
        if MASK_SCORES:  # the fix; without it (THE BUG) exp(0 - m_i) enters l_i for each padded key
            s = tl.where(keys[None, :] < N, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    tl.store(Out + q_offs, (acc / l_i[:, None]).to(Out.dtype.element_ty), mask=rows[:, None] < M)


def forward_unmasked_tail(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_n: int, *,
                          mask_scores: bool = False, block_m: int = 16) -> torch.Tensor:
    """Non-causal attention of contiguous q (b, m, h, d) over k, v (b, n, h, d) in tiles of block_n keys.

    mask_scores=False is the bug: for n % block_n != 0 the padded keys of the last tile enter the softmax,
    as tritonattn.testing.attention_padded_keys_ref emulates. d must be a power of two >= 16.
    """
    b, m, h, d = q.shape
    if not all(t.is_contiguous() for t in (q, k, v)) or k.shape != v.shape or k.shape[2] != h:
        raise ValueError(f"forward_unmasked_tail takes contiguous MHA tensors (as many KV heads as query heads), "
                         f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, contiguous "
                         f"{[t.is_contiguous() for t in (q, k, v)]}.")
    out = torch.empty_like(q)
    grid = (triton.cdiv(m, block_m), b * h)
    _fwd_kernel[grid](q, k, v, out, m, k.shape[1], h, d**-0.5, HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n,
                      MASK_SCORES=mask_scores)
    return out


# --------------------------------------------------------------------------------------------
# Bug c: unmasked loads of the last partial tile in the backward
# --------------------------------------------------------------------------------------------
@triton.jit
def _dv_kernel(Q, K, DO, Lse, DV, stride_qb, stride_qm, stride_qh, stride_lb, stride_lh, M, N, H, scale,
               HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASK_ROWS: tl.constexpr):
    pid_n, off_bh = tl.program_id(0), tl.program_id(1)
    off_b, off_h = off_bh // H, off_bh % H
    keys = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, HEAD_DIM)
    kv_offs = ((off_b * N + keys[:, None]) * H + off_h) * HEAD_DIM + cols[None, :]
    k = tl.load(K + kv_offs, mask=keys[:, None] < N, other=0.0)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    for start_m in range(0, M, BLOCK_M):
        rows = start_m + tl.arange(0, BLOCK_M)
        q_ptrs = Q + off_b * stride_qb + rows[:, None] * stride_qm + off_h * stride_qh + cols[None, :]
        do_ptrs = DO + off_b * stride_qb + rows[:, None] * stride_qm + off_h * stride_qh + cols[None, :]
        lse_ptrs = Lse + off_b * stride_lb + off_h * stride_lh + rows
        if MASK_ROWS:  # the fix: rows past M read as q = 0, dO = 0, lse = +inf (so p = 0)
            q = tl.load(q_ptrs, mask=rows[:, None] < M, other=0.0)
            do = tl.load(do_ptrs, mask=rows[:, None] < M, other=0.0)
            lse = tl.load(lse_ptrs, mask=rows < M, other=float("inf"))
        else:  # THE BUG: the last tile reads BLOCK_M rows whatever M is
            q = tl.load(q_ptrs)
            do = tl.load(do_ptrs)
            lse = tl.load(lse_ptrs)
        p = tl.exp(tl.dot(q, tl.trans(k)) * scale - lse[:, None])  # [BLOCK_M, BLOCK_N]
        dv += tl.dot(tl.trans(p.to(do.dtype)), do)
    tl.store(DV + kv_offs, dv.to(DV.dtype.element_ty), mask=keys[:, None] < N)


def dv_unmasked_tail(q: torch.Tensor, k: torch.Tensor, dout: torch.Tensor, lse: torch.Tensor, *,
                     mask_rows: bool = False, block_m: int = 16, block_n: int = 16) -> torch.Tensor:
    """dV (b, n, h, d) of non-causal attention from q, dout (b, m, h, d) of equal strides, contiguous k
    (b, n, h, d) and the forward's lse (b, h, m).

    mask_rows=False is the bug: the last query tile reads up to block_m - 1 rows past m of q, dout and
    lse. Give it views of buffers that hold at least block_m guard rows after row m (raises otherwise).
    """
    b, m, h, d = q.shape
    if dout.stride() != q.stride() or not k.is_contiguous() or lse.stride(-1) != 1:
        raise ValueError(f"dv_unmasked_tail takes q and dout of equal strides, a contiguous k, lse rows of stride 1; "
                         f"got strides q {q.stride()}, dout {dout.stride()}, lse {lse.stride()}, k contiguous "
                         f"{k.is_contiguous()}.")
    rows_read = triton.cdiv(m, block_m) * block_m
    if not mask_rows and not all(_holds(t, dim, rows_read) for t, dim in ((q, 1), (dout, 1), (lse, 2))):
        raise ValueError(f"without the row mask the inputs need guard rows up to row {rows_read} in their buffers")
    dv = torch.empty_like(k)
    grid = (triton.cdiv(k.shape[1], block_n), b * h)
    _dv_kernel[grid](q, k, dout, lse, dv, q.stride(0), q.stride(1), q.stride(2), lse.stride(0), lse.stride(1),
                     m, k.shape[1], h, d**-0.5, HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n, MASK_ROWS=mask_rows)
    return dv


def _holds(t: torch.Tensor, dim: int, rows: int) -> bool:
    """Whether t's storage holds `rows` rows along `dim` (its other sizes and strides as they are)."""
    sizes = list(t.shape)
    sizes[dim] = rows
    last = t.storage_offset() + sum((n - 1) * s for n, s in zip(sizes, t.stride()))
    return (last + 1) * t.element_size() <= t.untyped_storage().nbytes()


def with_guard_rows(t: torch.Tensor, guard: int, dim: int = 1) -> torch.Tensor:
    """A view of `t`'s values inside one buffer that holds `guard` more rows along `dim`, all NaN: reads
    past the end of the view land on NaN sentinels, never outside the allocation."""
    shape = list(t.shape)
    shape[dim] += guard
    buf = torch.full(shape, float("nan"), device=t.device, dtype=t.dtype)
    view = buf.narrow(dim, 0, t.shape[dim])
    view.copy_(t)
    return view


# --------------------------------------------------------------------------------------------
# Bug d: tl.arange over a head dim that is not a power of two
# --------------------------------------------------------------------------------------------
@triton.jit
def _copy_kernel(X, Y, HEAD_DIM: tl.constexpr):
    cols = tl.arange(0, HEAD_DIM)  # THE BUG: tl.arange needs a power-of-two length
    tl.store(Y + cols, tl.load(X + cols))


def copy_head_dim(x: torch.Tensor) -> torch.Tensor:
    """Copy one row x (head_dim,) with a kernel of tile width head_dim: fails unless it is a power of two."""
    y = torch.empty_like(x)
    _copy_kernel[(1,)](x, y, HEAD_DIM=x.shape[0])
    return y


def first_error_line(exc: BaseException, needle: str = "power of 2") -> str:
    """The line of exc's message that holds `needle` (Triton's compiler puts the cause after the source),
    else its first line."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()] or [repr(exc)]
    return next((line for line in lines if needle in line), lines[0])


# --------------------------------------------------------------------------------------------
# The library's own source
# --------------------------------------------------------------------------------------------
def jit_source_lines(fn, *spans: Tuple[str, str]) -> str:
    """Lines of a @triton.jit (or plain) function's source: for each (first, last) span, the first line
    containing `first` through the next line containing `last`; spans are joined by '...'."""
    lines = inspect.getsource(getattr(fn, "fn", fn)).splitlines()
    parts = []
    for first, last in spans:
        i = next((n for n, line in enumerate(lines) if first in line), None)
        j = None if i is None else next((n for n in range(i, len(lines)) if last in lines[n]), None)
        if j is None:
            missing = first if i is None else last
            raise ValueError(f"Expected {missing!r} in the source of {getattr(fn, '__name__', fn)} (span {first!r} "
                             f"to {last!r}); the source changed: update the span.")
        parts.append(textwrap.dedent("\n".join(lines[i:j + 1])))
    return "\n...\n".join(parts)
