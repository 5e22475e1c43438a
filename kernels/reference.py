"""Eager PyTorch references, used by tests, notebooks and benchmarks.

Deliberately simple: upcast, materialise the [M, N] scores, mask explicitly with the same
bottom-right causal convention as the kernels, expand GQA heads with repeat_interleave, and give
zeros (LSE +inf) for rows that see no key.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch


def causal_mask(seqlen_q: int, seqlen_k: int, device=None) -> torch.Tensor:
    """Bool [seqlen_q, seqlen_k], True where query i may see key j: j <= i + seqlen_k - seqlen_q."""
    i = torch.arange(seqlen_q, device=device)[:, None]
    j = torch.arange(seqlen_k, device=device)[None, :]
    return j <= i + (seqlen_k - seqlen_q)


def attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    key_padding_lengths: Optional[torch.Tensor] = None,
    upcast: bool = True,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Reference attention over (batch, seqlen, heads, headdim) tensors; returns (out, lse).

    upcast=True computes in float32 (float64 if the inputs are float64) and returns out in q's
    dtype: the ground truth. upcast=False computes in the input dtype: PyTorch's own same-precision
    error, the yardstick for the kernels' error (flash-attn's test rule).
    key_padding_lengths (batch,): keys at or past each batch entry's length are masked (decode).
    lse is (batch, heads, seqlen_q) float32, +inf for rows that see no key.
    """
    dtype = q.dtype
    if upcast:
        work = torch.float64 if dtype == torch.float64 else torch.float32
        q, k, v = q.to(work), k.to(work), v.to(work)
    batch, seqlen_q, nheads, head_dim = q.shape
    seqlen_k, nheads_k = k.shape[1], k.shape[2]
    scale = head_dim**-0.5 if softmax_scale is None else softmax_scale
    group = nheads // nheads_k
    k = k.repeat_interleave(group, dim=2)
    v = v.repeat_interleave(group, dim=2)
    scores = torch.einsum("bmhd,bnhd->bhmn", q * scale, k)
    visible = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=q.device)
    if causal:
        visible = causal_mask(seqlen_q, seqlen_k, q.device)
    visible = visible[None, None].expand(batch, 1, seqlen_q, seqlen_k)
    if key_padding_lengths is not None:
        lengths = key_padding_lengths.to(q.device).view(batch, 1, 1, 1)
        visible = visible & (torch.arange(seqlen_k, device=q.device).view(1, 1, 1, -1) < lengths)
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores.float(), dim=-1)  # (b, h, m), -inf for empty rows
    empty = ~visible.any(dim=-1)  # (b, 1, m)
    probs = torch.softmax(scores, dim=-1).masked_fill(empty[..., None], 0.0)
    out = torch.einsum("bhmn,bnhd->bmhd", probs, v)
    lse = lse.masked_fill(empty.expand_as(lse), float("inf"))
    return out.to(dtype), lse


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64 (0 when both are empty or zero)."""
    out, ref = out.double(), ref.double()
    denom = ref.norm().item()
    diff = (out - ref).norm().item()
    if denom == 0.0:
        return diff
    return diff / denom
