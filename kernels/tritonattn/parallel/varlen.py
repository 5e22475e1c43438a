"""Context-parallel attention over packed sequences (ring-flash-attn's `ring_flash_attn_varlen_func` and
`zigzag_ring_flash_attn_varlen_func`, and a stripe form it lacks).

Every sequence of the packed batch is cut the same way and rank r holds the same part of each, packed in the
same order: "ring", chunk r of `world` (its `cu_seqlens` are the whole batch's divided by `world`, ring-flash-
attn's convention); "zigzag", chunks r and 2 * world - 1 - r of 2 * world, concatenated per sequence; "stripe",
tokens r, r + world, ... of each. K and V travel around the ring as in ring.py. A shard is one or two pieces
(one chunk or stripe of every sequence, `pieces`).

Masks and ALiBi count global positions, as in ring.py: sequence s's part of a piece pair is reduced to a
corner call (`blocks.block_call` on its L_s tokens: its first rows and keys, a window relative to that corner,
ALiBi's origin), and the varlen kernels align each sequence's mask to its own bottom-right corner, so the
sequences whose corners have the same window share one packed call. Without a window that is every sequence (a
contiguous key chunk before, at or after the query chunk: all keys seen, causal, or none; a stripe pair: causal,
or causal without the diagonal); a window's edge falls at a place that depends on L_s, and the sequences are
grouped by it. Partial outputs in float32 merged by LSE in float32; gradients accumulated in float32, dK/dV
travelling with their K/V, as in ring.py.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Dict, Iterator, List, NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist

from ..api.args import AttnCall, attention_call
from ..api.primitives import merge_attention
from ..api.validate import validate_varlen
from ..config.hardware import device_target
from ..config.options import AttnOptions, attn_options
from ..config.tables import prefill_fwd_config
from ..errors import InputError
from ..launch.backward import launch_varlen_backward
from ..launch.prefill import launch_varlen
from .agree import checked_call, refuse_dropout
from .blocks import alibi_block, block_call
from .comm import Ring

VARLEN_LAYOUTS = ("ring", "zigzag", "stripe")


class Piece(NamedTuple):
    """One chunk (or stripe) of every sequence in a rank's packed shard: its rows (None: all of them), their cu_seqlens
    and longest length, its tokens per sequence (on the host), and a function giving, for a rank, the world size
    and a sequence's chunk length L, the global position of the chunk's first token and the step between its
    tokens."""

    rows: Optional[torch.Tensor]
    cu_seqlens: torch.Tensor
    max_seqlen: int
    lengths: Tuple[int, ...]
    place: Callable[[int, int, int], Tuple[int, int]]


def pieces(layout: str, cu_seqlens: torch.Tensor, max_seqlen: int) -> List[Piece]:
    """A rank's packed shard as pieces: "ring", one (chunk rank of world of every sequence); "stripe", one
    (tokens rank, rank + world, ... of every sequence); "zigzag", two (chunks rank and 2 * world - 1 - rank, the
    two halves of each sequence's local rows)."""
    bounds = cu_seqlens.tolist()
    lengths = tuple(b - a for a, b in zip(bounds[:-1], bounds[1:]))
    if layout == "ring":
        return [Piece(None, cu_seqlens, max_seqlen, lengths, lambda rank, world, length: (rank * length, 1))]
    if layout == "stripe":
        return [Piece(None, cu_seqlens, max_seqlen, lengths, lambda rank, world, length: (rank, world))]
    if layout != "zigzag":
        raise InputError(f"Expected a packed layout in {VARLEN_LAYOUTS}, got {layout!r}.")
    halves = []
    for h in range(2):
        rows = [torch.arange(a + h * (b - a) // 2, a + (h + 1) * (b - a) // 2) for a, b in zip(bounds[:-1], bounds[1:])]
        halves.append(torch.cat(rows).to(cu_seqlens.device) if rows else torch.zeros(0, dtype=torch.long))
    places = (lambda rank, world, length: (rank * length, 1),
              lambda rank, world, length: ((2 * world - 1 - rank) * length, 1))
    return [Piece(halves[h], cu_seqlens // 2, max_seqlen // 2, tuple(n // 2 for n in lengths), places[h])
            for h in range(2)]


class PairCall(NamedTuple):
    """One packed kernel call of a piece pair: the query rows and key rows of the shard it takes (None: a piece's
    rows as they are), their cu_seqlens and longest lengths, its options and per-call tensors."""

    q_rows: Optional[torch.Tensor]
    cu_q: torch.Tensor
    max_q: int
    k_rows: Optional[torch.Tensor]
    cu_k: torch.Tensor
    max_k: int
    options: AttnOptions
    tensors: Dict[str, Any]


def _take(t: torch.Tensor, rows: Optional[torch.Tensor]) -> torch.Tensor:
    return t if rows is None else t.index_select(0, rows)


def _select(piece: Piece, counts: List[int]) -> Tuple[Optional[torch.Tensor], torch.Tensor, int]:
    """(shard rows, cu_seqlens, longest) of the first counts[s] tokens of every sequence s of `piece`; the
    piece's own when that is all of them."""
    if list(counts) == list(piece.lengths):
        return piece.rows, piece.cu_seqlens, piece.max_seqlen
    device = piece.cu_seqlens.device
    starts = itertools.accumulate(piece.lengths, initial=0)
    rows = torch.cat([torch.arange(a, a + n) for a, n in zip(starts, counts)]).to(device)
    cu = torch.tensor([0, *itertools.accumulate(counts)], dtype=torch.int32, device=device)
    return (rows if piece.rows is None else piece.rows.index_select(0, rows)), cu, max(counts)


def _pair_calls(qp: Piece, kp: Piece, rank: int, src: int, world: int, call: AttnCall) -> Iterator[PairCall]:
    """The packed calls of rank's query piece against src's key piece. Each sequence's pair is reduced to a
    corner (`blocks.block_call` on its chunks of L_s tokens: its first rows and keys, with a window on that corner,
    or nothing where no query sees a key); sequences whose corners have the same window share one call, and a
    corner that sees every key of its chunk pair takes the unmasked one. Without a window every sequence has the
    same corner (all keys seen, causal, or none): one call over the whole batch, on the pieces' rows as they are."""
    options = call.options
    batch = len(qp.lengths)
    step = qp.place(rank, world, 1)[1]  # the same for every sequence of a piece

    def corner_of(length: int):
        """(window, rows, keys, ALiBi origin) of a sequence whose chunks hold `length` tokens, or None."""
        (q_start, _), (k_start, _) = qp.place(rank, world, length), kp.place(src, world, length)
        corner = block_call(q_start, k_start, step, length, (options.window_left, options.window_right),
                            options.causal) if length else None
        if corner is None:
            return None
        left, right = corner.window
        if left >= corner.keys - 1:  # the band's left edge is before every key of the corner: no left mask
            left = -1
        if right >= corner.rows - 1:
            right = -1
        return (left, right), corner.rows, corner.keys, (q_start - k_start) / step - (corner.keys - corner.rows)

    corners: Dict[int, Any] = {}  # by chunk length: a packed batch repeats lengths, each corner is worked out once
    groups: Dict[Tuple[int, int], Tuple[List[int], List[int], List[float]]] = {}
    for s, length in enumerate(qp.lengths):
        if length not in corners:
            corners[length] = corner_of(length)
        if corners[length] is None:
            continue
        window, n_rows, n_keys, shift = corners[length]
        rows, keys, shifts = groups.setdefault(window, ([0] * batch, [0] * batch, [0.0] * batch))
        rows[s], keys[s], shifts[s] = n_rows, n_keys, shift
    for window, (rows, keys, shifts) in groups.items():
        q_rows, cu_q, max_q = _select(qp, rows)
        k_rows, cu_k, max_k = _select(kp, keys)
        shift = torch.tensor(shifts, dtype=torch.float32, device=qp.cu_seqlens.device) if options.alibi else 0.0
        block = attn_options(options.head_dim, options.softmax_scale, window=window, softcap=options.softcap,
                             alibi=options.alibi)
        yield PairCall(q_rows, cu_q, max_q, k_rows, cu_k, max_k, block, alibi_block(call.tensors, shift, step, batch))


def _pairs(parts: List[Piece], call: AttnCall, rank: int, src: int, world: int) -> Iterator[PairCall]:
    """The packed calls of every pair of this rank's query pieces and src's key pieces that some query sees."""
    for qp in parts:
        for kp in parts:
            yield from _pair_calls(qp, kp, rank, src, world, call)


def ring_varlen_forward(q, k, v, parts: List[Piece], call: AttnCall,
                        ring: Ring) -> Tuple[torch.Tensor, torch.Tensor]:
    """(out float32 (total, nheads, headdim), lse float32 (nheads, total)) of this rank's packed queries."""
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full((q.shape[1], q.shape[0]), float("inf"), dtype=torch.float32, device=q.device)
    config = prefill_fwd_config(call.options.head_dim_pad, q.dtype, False, device_target(q.device))  # fwd_kernel
    kv = [k, v]
    for step in range(ring.world):
        pending = ring.shift(kv) if step + 1 < ring.world else None
        for pc in _pairs(parts, call, ring.rank, (ring.rank - step) % ring.world, ring.world):
            qs = _take(q, pc.q_rows)
            part = torch.empty(qs.shape, dtype=torch.float32, device=q.device)
            part, part_lse = launch_varlen(qs, _take(kv[0], pc.k_rows), _take(kv[1], pc.k_rows), pc.cu_q, pc.cu_k,
                                           pc.max_q, pc.max_k, pc.options, config=config, tensors=pc.tensors,
                                           out=part)
            if pc.q_rows is None:
                out, lse = merge_attention(out, lse, part, part_lse)
            else:
                merged, merged_lse = merge_attention(out[pc.q_rows], lse[:, pc.q_rows], part, part_lse)
                out[pc.q_rows], lse[:, pc.q_rows] = merged, merged_lse
        if pending is not None:
            kv = pending.wait()
    return out, lse


def ring_varlen_backward(dout, q, k, v, out, lse, parts: List[Piece], call: AttnCall, ring: Ring):
    """(dq, dk, dv) float32 of this rank's packed shard; out, lse: `ring_varlen_forward`'s."""
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    kv, travelling = [k, v], None
    for step in range(ring.world):
        pending = ring.shift(kv) if step + 1 < ring.world else None
        dkv = [torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in kv]
        for pc in _pairs(parts, call, ring.rank, (ring.rank - step) % ring.world, ring.world):
            qs, ks, vs = _take(q, pc.q_rows), _take(kv[0], pc.k_rows), _take(kv[1], pc.k_rows)
            grads = tuple(torch.empty(t.shape, dtype=torch.float32, device=t.device) for t in (qs, ks, vs))
            launch_varlen_backward(_take(dout, pc.q_rows), qs, ks, vs, _take(out, pc.q_rows),
                                   lse if pc.q_rows is None else lse[:, pc.q_rows].contiguous(), pc.cu_q, pc.cu_k,
                                   pc.max_q, pc.max_k, pc.options, grads=grads, tensors=pc.tensors)
            for acc, grad, rows in ((dq, grads[0], pc.q_rows), (dkv[0], grads[1], pc.k_rows),
                                    (dkv[1], grads[2], pc.k_rows)):
                if rows is None:
                    acc += grad
                else:
                    acc.index_add_(0, rows, grad)
        if travelling is not None:
            dkv = [a + b for a, b in zip(travelling.wait(), dkv)]
        travelling = ring.shift(dkv)
        if pending is not None:
            kv = pending.wait()
    dk, dv = travelling.wait()
    return dq, dk, dv


class _RingVarlenAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, parts, call, group):
        out, lse = ring_varlen_forward(q, k, v, parts, call, Ring(group))
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.parts, ctx.call, ctx.group = parts, call, group
        ctx.mark_non_differentiable(lse)
        return out.to(q.dtype), lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ring_varlen_backward(dout, q, k, v, out, lse, ctx.parts, ctx.call, Ring(ctx.group))
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def context_parallel_varlen_attention(q, k, v, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None,
                                      causal=False, window_size=(-1, -1), alibi_slopes=None, deterministic=False,
                                      return_attn_probs=False, group=None, *, layout: str = "ring", softcap=0.0):
    """ring-flash-attn's packed functions, one body: this rank's packed shard of q (total, nheads, headdim), k and
    v (total, nheads_k, headdim) by `cu_seqlens` (int32 (batch + 1,), this rank's) and `max_seqlen`; returns out
    (with return_attn_probs (out, softmax_lse (nheads, total), None)), checked before any transfer."""
    world = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
    window = tuple(window_size) if isinstance(window_size, (tuple, list)) else (window_size,)
    built = {}

    def local_checks():
        if layout not in VARLEN_LAYOUTS:
            raise InputError(f"Expected a packed layout in {VARLEN_LAYOUTS}, got {layout!r}.")
        built["max"], _ = validate_varlen(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen)
        refuse_dropout(dropout_p)
        if layout == "zigzag" and bool(((cu_seqlens[1:] - cu_seqlens[:-1]) % 2 != 0).any()):
            raise InputError(f"Expected every sequence's local length even for the zigzag layout (two chunks each), "
                             f"got cu_seqlens {cu_seqlens.tolist()} on rank {dist.get_rank(group)}.")
        built["call"] = attention_call(q.shape[2], softmax_scale, causal, window_size, softcap, alibi_slopes, None,
                                       seqlen_k=built["max"] * world, batch=cu_seqlens.numel() - 1,
                                       nheads=q.shape[1], device=q.device)

    signature = (VARLEN_LAYOUTS.index(layout) if layout in VARLEN_LAYOUTS else -1, int(bool(causal)), *window,
                 int(alibi_slopes is not None))
    checked_call(group, (q, k, v, cu_seqlens), signature, local_checks)
    parts = pieces(layout, cu_seqlens.contiguous(), built["max"])
    out, lse = _RingVarlenAttention.apply(q, k, v, parts, built["call"], group)
    return (out, lse, None) if return_attn_probs else out


def ring_flash_attn_varlen_func(q, k, v, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                window_size=(-1, -1), alibi_slopes=None, deterministic=False, return_attn_probs=False,
                                group=None):
    """ring-flash-attn's `ring_flash_attn_varlen_func`: rank r holds chunk r of world of every sequence, packed;
    cu_seqlens are the whole batch's divided by world; see `context_parallel_varlen_attention`."""
    return context_parallel_varlen_attention(q, k, v, cu_seqlens, max_seqlen, dropout_p, softmax_scale, causal,
                                             window_size, alibi_slopes, deterministic, return_attn_probs, group,
                                             layout="ring")


def zigzag_ring_flash_attn_varlen_func(q, k, v, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None,
                                       causal=False, window_size=(-1, -1), alibi_slopes=None, deterministic=False,
                                       return_attn_probs=False, group=None):
    """ring-flash-attn's `zigzag_ring_flash_attn_varlen_func`: every sequence cut into 2 * world chunks, rank r
    holding chunks r and 2 * world - 1 - r of each (concatenated, packed); see
    `context_parallel_varlen_attention`."""
    return context_parallel_varlen_attention(q, k, v, cu_seqlens, max_seqlen, dropout_p, softmax_scale, causal,
                                             window_size, alibi_slopes, deterministic, return_attn_probs, group,
                                             layout="zigzag")


def stripe_flash_attn_varlen_func(q, k, v, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                  window_size=(-1, -1), alibi_slopes=None, deterministic=False,
                                  return_attn_probs=False, group=None):
    """The stripe layout's packed form (ring-flash-attn has none; its name and signature follow its other varlen
    functions): rank r holds tokens r, r + world, r + 2 * world, ... of every sequence, packed; cu_seqlens are the
    whole batch's divided by world. Causal work is balanced across ranks as in `stripe_flash_attn_func`; see
    `context_parallel_varlen_attention`."""
    return context_parallel_varlen_attention(q, k, v, cu_seqlens, max_seqlen, dropout_p, softmax_scale, causal,
                                             window_size, alibi_slopes, deterministic, return_attn_probs, group,
                                             layout="stripe")


def shard_varlen(x: torch.Tensor, cu_seqlens: torch.Tensor, rank: int, world: int,
                 layout: str = "ring") -> torch.Tensor:
    """Rank's packed shard of a packed whole batch (sequence along dim 0) under `layout`: chunk `rank` of `world`
    of each sequence ("ring"), chunks rank and 2 * world - 1 - rank of 2 * world ("zigzag"), or tokens rank,
    rank + world, ... of each ("stripe")."""
    bounds = cu_seqlens.tolist()
    if layout == "stripe":
        return torch.cat([x[a:b][rank::world] for a, b in zip(bounds[:-1], bounds[1:])], dim=0)
    chunks = [rank] if layout == "ring" else [rank, 2 * world - 1 - rank]
    parts = world if layout == "ring" else 2 * world
    return torch.cat([x[a:b].chunk(parts, dim=0)[c] for a, b in zip(bounds[:-1], bounds[1:]) for c in chunks], dim=0)
