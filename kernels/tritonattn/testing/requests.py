"""The references of a batch of requests served from a KV cache, one request at a time: what the tests,
the notebooks and the serving engine's checks compare `flash_attn_with_kvcache` (and the cache classes)
against. Each reference comes twice: in fp32 (the ground truth) and in the inputs' own dtype (PyTorch's
eager attention, the yardstick of the error rule, `tolerance.check_close`)."""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

from .reference import attention_ref


def references(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
               softmax_scale: Optional[float] = None, key_leftpad: Optional[torch.Tensor] = None,
               **variants) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out_fp32, lse_fp32, out_same_dtype): the fp32 ground truth (output kept in fp32, not rounded back)
    and PyTorch's eager result computed in the inputs' own dtype. key_leftpad (batch,): keys before it are
    masked; `variants`: window_size, softcap, alibi_slopes, sinks, as attention_ref takes them."""
    kwargs = dict(causal=causal, softmax_scale=softmax_scale, key_leftpad=key_leftpad, **variants)
    out_fp32, lse = attention_ref(q.float(), k.float(), v.float(), **kwargs)
    if q.dtype == torch.float32:
        return out_fp32, lse, out_fp32
    out_same, _ = attention_ref(q, k, v, upcast=False, **kwargs)
    return out_fp32, lse, out_same


def per_request_references(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k: Optional[torch.Tensor],
                           v: Optional[torch.Tensor], lengths: Sequence[int], *, causal: bool,
                           softmax_scale: Optional[float] = None, leftpad: Optional[Sequence[int]] = None,
                           tree_mask: Optional[torch.Tensor] = None, tree_cu_seqlens: Optional[torch.Tensor] = None,
                           **variants):
    """`references` per request of a KV-cache call, concatenated over the batch: request b's queries over
    cache[b, :lengths[b]] plus, when given, its new keys/values k[b], v[b] (dense caches; gather a paged
    pool to dense first); with `leftpad` (cache_leftpad as a list), the keys before cache row leftpad[b]
    are masked; `variants` as `references` takes them (per-request ALiBi slopes (batch, heads) are sliced); a
    verify step's tree_mask (and tree_cu_seqlens) materialised over each request's keys (`tree_attn_mask`)."""
    outs32, lses, outs_same = [], [], []
    for b, length in enumerate(lengths):
        kk, vv = k_cache[b: b + 1, :length], v_cache[b: b + 1, :length]
        if k is not None:
            kk, vv = torch.cat([kk, k[b: b + 1]], 1), torch.cat([vv, v[b: b + 1]], 1)
        start = None if leftpad is None else torch.tensor([leftpad[b]], device=q.device)
        mine = dict(variants)
        if tree_mask is not None:
            mine["attn_mask"] = tree_attn_mask(tree_mask, tree_cu_seqlens, b, q.shape[1], kk.shape[1])
        slopes = mine.get("alibi_slopes")
        if slopes is not None and slopes.dim() == 2:
            mine["alibi_slopes"] = slopes[b: b + 1]
        out32, lse, out_same = references(q[b: b + 1], kk, vv, causal=causal, softmax_scale=softmax_scale,
                                          key_leftpad=start, **mine)
        outs32.append(out32)
        lses.append(lse)
        outs_same.append(out_same)
    return torch.cat(outs32), torch.cat(lses), torch.cat(outs_same)


def tree_attn_mask(tree_mask: torch.Tensor, tree_cu_seqlens: Optional[torch.Tensor], b: int, seqlen_q: int,
                   n_keys: int) -> torch.Tensor:
    """Request b's tree mask as attention_ref's attn_mask (1, seqlen_q, n_keys): every key before the last
    seqlen_q (the drafts) seen; among the drafts, the dense (batch, seqlen_q, seqlen_q) mask's row, or the packed
    form's (n_b x n_b) matrix with the padding tokens past n_b seeing only themselves (api/validate_tree.py
    [Note] Tree masks); the diagonal always set."""
    visible = torch.ones(1, seqlen_q, n_keys, dtype=torch.bool, device=tree_mask.device)
    drafts = torch.zeros(seqlen_q, seqlen_q, dtype=torch.bool, device=tree_mask.device)
    if tree_cu_seqlens is None:
        drafts |= tree_mask[b].bool()
    else:
        bounds = [int(x) for x in tree_cu_seqlens.tolist()]
        sizes = [(hi - lo) for lo, hi in zip(bounds[:-1], bounds[1:])]
        start, n = sum(m * m for m in sizes[:b]), sizes[b]
        drafts[:n, :n] = tree_mask[start: start + n * n].view(n, n).bool()
    drafts |= torch.eye(seqlen_q, dtype=torch.bool, device=tree_mask.device)
    visible[0, :, n_keys - seqlen_q:] = torch.tril(drafts)
    return visible
