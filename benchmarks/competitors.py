"""The benchmark competitors: torch's SDPA on our layout, naive eager attention, and the seed's two eager
decode baselines (`decode_eager_slice`, a preallocated cache sliced to the current length; `decode_eager_cat`,
a cache grown with torch.cat every step). What the kernels are measured against, not ground truth (that is
tritonattn.testing.attention_ref)."""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from tritonattn.testing import attention_sdpa, causal_mask, sdpa_supports_enable_gqa

__all__ = ["attention_sdpa", "sdpa_supports_enable_gqa", "attention_eager", "decode_eager_slice", "decode_eager_cat"]

# --------------------------------------------------------------------------------------------
# The seed's two eager decode baselines (benchmark competitors, not ground truth)
# --------------------------------------------------------------------------------------------
def _eager_decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: Optional[float], causal: bool
) -> torch.Tensor:
    """Naive eager attention of q (b, m, h, d) over every row of k, v (b, n, h_kv, d), in q's dtype.

    What an unfused decode step does: expand the KV heads with repeat_interleave (G copies of the
    cache in memory), materialise the (b, h, m, n) scores, softmax in float32, multiply by V. With
    causal and m > 1 the mask is aligned bottom-right (token t sees key j iff j <= t + n - m).
    A step with no key (n == 0) gives zeros, like the kernels.
    """
    batch, seqlen_q, nheads, head_dim = q.shape
    seqlen_k, nheads_k = k.shape[1], k.shape[2]
    if seqlen_k == 0:
        return torch.zeros_like(q)
    scale = head_dim**-0.5 if softmax_scale is None else softmax_scale
    group = nheads // nheads_k
    k = k.repeat_interleave(group, dim=2)  # (b, n, h, d): the copies a GQA kernel avoids
    v = v.repeat_interleave(group, dim=2)
    scores = torch.matmul(q.transpose(1, 2), k.permute(0, 2, 3, 1)) * scale  # (b, h, m, n), q's dtype
    if causal and seqlen_q > 1:
        scores = scores.masked_fill(~causal_mask(seqlen_q, seqlen_k, q.device), float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    return torch.matmul(probs, v.transpose(1, 2)).transpose(1, 2)  # (b, m, h, d)


def attention_eager(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
) -> torch.Tensor:
    """Naive eager attention over (batch, seqlen, heads, headdim) tensors, in q's dtype: a benchmark
    competitor (what an unfused model does), not ground truth.

    KV heads expanded with repeat_interleave, the (b, h, m, n) scores materialised in q's dtype, softmax
    in float32, causal bottom-right (as the kernels). Differentiable. Memory grows as b * h * m * n.
    """
    return _eager_decode_attention(q, k, v, softmax_scale, causal)


def _check_decode_shapes(q, k_cache, v_cache, k, v, what: str) -> None:
    if q.dim() != 4 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"{what}: expected q (batch, seqlen_q, nheads, d) and k_cache, v_cache (batch, seqlen, nheads_k, d) "
            f"of one shape, got {tuple(q.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}."
        )
    if (k is None) != (v is None):
        raise ValueError(f"{what}: expected k and v both given or both None.")
    if k is not None:
        expected = (q.shape[0], q.shape[1], k_cache.shape[2], q.shape[3])
        if tuple(k.shape) != expected or tuple(v.shape) != expected:
            raise ValueError(f"{what}: expected k and v of shape {expected}, got {tuple(k.shape)}, {tuple(v.shape)}.")


def decode_eager_slice(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_len: int,
    k: Optional[torch.Tensor] = None,
    v: Optional[torch.Tensor] = None,
    *,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
) -> torch.Tensor:
    """The seed's "eager slice" decode baseline: a preallocated cache sliced to the current length.

    q: (batch, seqlen_q, nheads, d); k_cache, v_cache: preallocated (batch, seqlen_cache, nheads_k, d);
    cache_len: the number of valid cache rows, one int for the whole batch (these baselines have no
    per-request lengths). If k, v (batch, seqlen_q, nheads_k, d) are given they are first written in
    place at rows [cache_len, cache_len + seqlen_q), as flash_attn_with_kvcache does, then attended
    over. Attention over k_cache[:, :n] (n = cache_len (+ seqlen_q)) with the KV heads expanded by
    repeat_interleave and the scores materialised (_eager_decode_attention). Returns (batch,
    seqlen_q, nheads, d) in q's dtype. A baseline to time against, not a ground truth: compare it
    with attention_ref.
    """
    _check_decode_shapes(q, k_cache, v_cache, k, v, "decode_eager_slice")
    seqlen_new = 0 if k is None else k.shape[1]
    if int(cache_len) != cache_len or not 0 <= cache_len <= k_cache.shape[1] - seqlen_new:
        raise ValueError(
            f"decode_eager_slice: expected 0 <= cache_len <= seqlen_cache - seqlen_new = "
            f"{k_cache.shape[1]} - {seqlen_new}, got {cache_len!r}."
        )
    cache_len = int(cache_len)
    if k is not None:
        k_cache[:, cache_len : cache_len + seqlen_new] = k
        v_cache[:, cache_len : cache_len + seqlen_new] = v
    n = cache_len + seqlen_new
    return _eager_decode_attention(q, k_cache[:, :n], v_cache[:, :n], softmax_scale, causal)


def decode_eager_cat(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The seed's "eager dynamic" decode baseline: a cache grown with torch.cat every step.

    k_cache, v_cache: (batch, cache_len, nheads_k, d) holding exactly the valid rows (no spare
    capacity); k, v: (batch, seqlen_q, nheads_k, d), the new tokens. Each step reallocates the cache
    one token longer (torch.cat copies all of it), then attends q over every row as
    decode_eager_slice does. Returns (out (batch, seqlen_q, nheads, d) in q's dtype, the grown
    k_cache, the grown v_cache); the inputs are not modified.
    """
    if k is None or v is None:
        raise ValueError("decode_eager_cat: expected the new tokens' k and v; the cache grows by them.")
    _check_decode_shapes(q, k_cache, v_cache, k, v, "decode_eager_cat")
    k_cache = torch.cat([k_cache, k], dim=1)
    v_cache = torch.cat([v_cache, v], dim=1)
    out = _eager_decode_attention(q, k_cache, v_cache, softmax_scale, causal)
    return out, k_cache, v_cache
