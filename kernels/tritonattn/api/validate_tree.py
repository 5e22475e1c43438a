"""Validation of a speculative-decoding verify step's tree mask (flash_attn_with_kvcache's `tree_mask`).

[Note] Tree masks. The seqlen_q query tokens of a verify step are draft tokens, in tree order (a token's
ancestors come before it), and they are the last seqlen_q keys each request sees (appended by the same call,
or already in the cache). Every key before them is seen by every draft; among them, draft t sees draft u iff
its mask says so, and always itself. Two forms:

- dense: bool (batch, seqlen_q, seqlen_q), mask[b, t, u] = "u is t or an ancestor of t";
- packed (ragged drafts): a 1-D bool tensor, the concatenation of each request's (n_b, n_b) matrix flattened
  row-major, with `tree_cu_seqlens` int32 (batch + 1,) the cumulative draft counts (n_b = cu[b + 1] - cu[b],
  at most seqlen_q). Request b's tokens past n_b are padding: they see the keys before the drafts and
  themselves, and no draft sees them.

A mask on the host is checked here: the diagonal set, nothing above it (an ancestor comes first), the packed
form's size. One on the device is trusted (checking it would sync): the kernel sets the diagonal and ignores
bits above it and past a request's n_b, so no access leaves the buffers, but a wrong mask gives a wrong result.
"""

from __future__ import annotations

from typing import Dict, Optional

import torch

from ..errors import InputError, InputTypeError


def _check_host_matrix(m: torch.Tensor, where: str) -> None:
    n = m.shape[-1]
    if n == 0:
        return
    if not bool(m.diagonal(dim1=-2, dim2=-1).all()):
        raise InputError(f"Expected every draft to see itself (the diagonal of {where} all True), got a token hidden "
                         f"from itself.")
    if bool(torch.triu(m, diagonal=1).any()):
        raise InputError(f"Expected {where} lower-triangular: drafts in tree order (each token's ancestors before it), "
                         f"got a token that sees a later draft.")


def validate_tree_mask(tree_mask, tree_cu_seqlens, batch: int, seqlen_q: int, device: torch.device
                       ) -> Dict[str, torch.Tensor]:
    """The kernel arguments of a tree mask (see [Note] Tree masks): Tree (uint8, flat, on `device`),
    Tree_start (int64 (batch,): where each request's matrix starts) and Tree_n (int32 (batch,): its draft count)."""
    if not isinstance(tree_mask, torch.Tensor):
        raise InputTypeError(f"Expected tree_mask to be a bool tensor, got {type(tree_mask).__name__}.")
    if tree_mask.dtype != torch.bool:
        raise InputTypeError(f"Expected tree_mask of dtype torch.bool, got {tree_mask.dtype}.")
    if tree_cu_seqlens is None:
        if tree_mask.shape != (batch, seqlen_q, seqlen_q):
            raise InputError(f"Expected tree_mask of shape (batch, seqlen_q, seqlen_q) = {(batch, seqlen_q, seqlen_q)} "
                             f"(or a packed 1-D mask with tree_cu_seqlens), got {tuple(tree_mask.shape)}.")
        if tree_mask.device.type == "cpu":
            _check_host_matrix(tree_mask, "tree_mask[b]")
        flat = tree_mask.to(device, non_blocking=True).contiguous().view(torch.uint8).reshape(-1)
        start = torch.arange(batch, dtype=torch.int64, device=device) * (seqlen_q * seqlen_q)
        count = torch.full((batch,), seqlen_q, dtype=torch.int32, device=device)
        return {"Tree": flat, "Tree_start": start, "Tree_n": count}
    cu = tree_cu_seqlens
    if not isinstance(cu, torch.Tensor) or cu.dtype != torch.int32 or cu.shape != (batch + 1,):
        got = (cu.dtype, tuple(cu.shape)) if isinstance(cu, torch.Tensor) else type(cu).__name__
        raise InputError(f"Expected tree_cu_seqlens int32 of shape (batch + 1,) = ({batch + 1},), got {got}.")
    if tree_mask.dim() != 1:
        raise InputError(f"Expected a packed tree_mask (1-D) with tree_cu_seqlens, got shape {tuple(tree_mask.shape)}.")
    if cu.device.type == "cpu":
        bounds = cu.tolist()
        counts = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
        if bounds[0] != 0 or min(counts, default=0) < 0 or max(counts, default=0) > seqlen_q:
            raise InputError(f"Expected tree_cu_seqlens from 0, non-decreasing, each request's drafts at most seqlen_q "
                             f"= {seqlen_q}, got {bounds}.")
        if tree_mask.numel() != sum(n * n for n in counts):
            raise InputError(f"Expected the packed tree_mask to hold sum(n_b^2) = {sum(n * n for n in counts)} "
                             f"entries for draft counts {counts}, got {tree_mask.numel()}.")
        if tree_mask.device.type == "cpu":
            offset = 0
            for b, n in enumerate(counts):
                _check_host_matrix(tree_mask[offset: offset + n * n].view(n, n), f"request {b}'s tree mask")
                offset += n * n
    count = (cu[1:] - cu[:-1]).to(device, non_blocking=True)
    sizes = count.to(torch.int64) ** 2
    start = torch.cumsum(sizes, 0) - sizes
    flat = tree_mask.to(device, non_blocking=True).contiguous().view(torch.uint8)
    if flat.numel() == 0:  # no request has drafts: one readable byte (never visible: n_b = 0)
        flat = torch.zeros(1, dtype=torch.uint8, device=device)
    return {"Tree": flat, "Tree_start": start.contiguous(), "Tree_n": count.to(torch.int32).contiguous()}


def check_tree_call(tree_mask: Optional[torch.Tensor], causal: bool, window_size, alibi_slopes, rotary: bool) -> None:
    """What a tree mask cannot go with, refused before any launch: a draft's position is the prefix length plus
    its depth, not its index, so in-kernel rotary, ALiBi distances and a sliding window would be wrong."""
    if tree_mask is None:
        return
    if not causal:
        raise InputError("Expected causal=True with tree_mask: the drafts see every key before them and, among "
                         "themselves, their tree's ancestors (a tree is causal).")
    if rotary or alibi_slopes is not None or (type(window_size) is not tuple or tuple(window_size) != (-1, -1)):
        raise NotImplementedError("tree_mask with rotary_cos / rotary_sin, alibi_slopes or window_size is not "
                                  "supported: a draft's position is the prefix length plus its depth in the tree, not "
                                  "its index (apply rotary to q and k yourself at those positions).")
