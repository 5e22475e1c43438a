"""Rollback after a speculative-decoding verify step: the accepted drafts' K/V moved into place after the prefix.

A verify step (`decode(..., tree_mask=...)` of KVCache / PagedKVCache) appends all n drafts of each request after
its prefix of L_b tokens, in tree order. The verifier keeps one path: draft indices a_0 < a_1 < ... < a_{c-1} (a
path of the tree, ancestors first). `accept` moves draft a_i to position L_b + i and sets the length to L_b + c,
on the device, with no host sync (graph-safe with a device `accepted`): every row is gathered before any is
written, and since a_i >= i a move never reads a row an earlier move of the same call wrote. The rejected rows
stay in the buffer past the new length, where no later step reads them (a later append overwrites them).
"""

from __future__ import annotations

from typing import Tuple

import torch

from ..errors import InputError, InputTypeError


def accepted_moves(accepted, drafts: int, seqlens: torch.Tensor, capacity: int
                   ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(src, dst, lengths) of an accept: int64 (batch, A) positions to gather and to write, int32 (batch,) new
    lengths. accepted: integer (batch, A), A <= drafts, each row a request's accepted draft indices in increasing
    order, then -1s; seqlens: the device lengths after the verify step (prefix + drafts). A host `accepted` is
    checked; a device one is trusted: entries are clamped into [-1, drafts) and positions into the buffer, so no
    access leaves it (a wrong entry gives wrong K/V, never a fault)."""
    batch = seqlens.shape[0]
    if not isinstance(accepted, torch.Tensor):
        raise InputTypeError(f"Expected accepted to be an integer tensor (batch, A), got {type(accepted).__name__}.")
    if accepted.dtype.is_floating_point or accepted.dtype == torch.bool or accepted.dim() != 2 or (
            accepted.shape[0] != batch) or accepted.shape[1] > drafts:
        raise InputError(f"Expected accepted of shape (batch, A) = ({batch}, <= {drafts}) with integer draft indices, "
                         f"got {accepted.dtype} of shape {tuple(accepted.shape)}.")
    if accepted.device.type == "cpu":
        valid = accepted >= 0
        if bool((accepted < -1).any() or (accepted >= drafts).any()):
            raise InputError(f"Expected accepted draft indices in [0, {drafts}) (or -1 after a path's end), got "
                             f"{accepted.tolist()}.")
        if bool((valid[:, 1:] & ~valid[:, :-1]).any()):
            raise InputError(f"Expected each row of accepted to be its indices, then -1s, got {accepted.tolist()}.")
        steps = accepted[:, 1:] - accepted[:, :-1]
        if bool((valid[:, 1:] & (steps <= 0)).any()):
            raise InputError(f"Expected each request's accepted drafts in tree order (increasing indices), got "
                             f"{accepted.tolist()}.")
    index = accepted.to(seqlens.device, torch.int64, non_blocking=True).clamp(-1, drafts - 1)
    valid = index >= 0
    prefix = (seqlens.to(torch.int64) - drafts).clamp(min=0)[:, None]
    dst = prefix + torch.arange(index.shape[1], device=seqlens.device)[None, :]
    src = torch.where(valid, prefix + index, dst)  # past the path: each row onto itself
    lengths = (prefix[:, 0] + valid.sum(1)).to(torch.int32)
    return src.clamp(0, capacity - 1), dst.clamp(0, capacity - 1), lengths


def move_rows(buffers, src: tuple, dst: tuple) -> None:
    """buffer[dst] = buffer[src] for each buffer (src, dst: index tuples), every row gathered before any write."""
    for buf in buffers:
        raw = buf.view(torch.uint8) if buf.element_size() == 1 else buf  # e4m3 rows move as bytes
        raw[dst] = raw[src]


def check_tree_step(drafts) -> int:
    if drafts is None:
        raise InputError("accept() follows a verify step: call decode(..., tree_mask=...) first (once per accept).")
    return drafts


def truncated_lengths(lengths, seqlens: torch.Tensor) -> torch.Tensor:
    """`truncate`'s lengths as an int32 tensor like `seqlens` (on its device): an int for every request, or one
    per request (a sequence, or an integer tensor of seqlens' shape; a host one must be >= 0)."""
    if isinstance(lengths, bool):
        raise InputTypeError("Expected lengths to be an int or one int per request, got a bool.")
    if isinstance(lengths, torch.Tensor):
        if lengths.dtype.is_floating_point or lengths.dtype == torch.bool or lengths.shape not in ((), seqlens.shape):
            raise InputError(f"Expected lengths of shape {tuple(seqlens.shape)} (or a scalar) with integers, got "
                             f"{lengths.dtype} of shape {tuple(lengths.shape)}.")
        if lengths.device.type == "cpu" and bool((lengths < 0).any()):
            raise InputError(f"Expected lengths >= 0, got {lengths.tolist()}.")
        return lengths.to(seqlens.device, torch.int32, non_blocking=True).expand(seqlens.shape)
    values = [int(lengths)] * seqlens.shape[0] if isinstance(lengths, int) else [int(x) for x in lengths]
    if len(values) != seqlens.shape[0] or min(values, default=0) < 0:
        raise InputError(f"Expected {seqlens.shape[0]} lengths >= 0, got {values}.")
    return torch.tensor(values, dtype=torch.int32).to(seqlens.device, non_blocking=True)
