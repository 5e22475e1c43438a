"""Context-parallel attention over a ring of ranks, forward and backward (ring-flash-attn's functions and
sharding conventions).

Each rank holds a shard of one sequence's q, k and v, by a layout (`LAYOUTS`): "ring", chunk `rank` of
`world`; "zigzag", chunks `rank` and `2 * world - 1 - rank` of `2 * world` (each rank then does the same
causal work); "stripe", tokens rank, rank + world, rank + 2 * world, ... (likewise balanced). K and V
travel around the ring: at step t a rank holds the K/V shard of rank `(rank - t) % world`, posts the next
transfer before it computes (so the two overlap), and attends its queries to the visiting keys chunk pair
by chunk pair, each pair reduced to a call of the kernels by `blocks.block_call` (masks, windows and ALiBi
distances in global positions; pairs no query sees are skipped). The partial outputs are written by the
kernels in float32 and merged by log-sum-exp in float32, never rounded per step. The backward walks the
same ring: dQ stays and accumulates in float32, the dK/dV sums travel with the K/V they belong to (float32)
and are home after `world` shifts; every block's gradient uses the merged output and LSE, which is what makes
the per-block gradients sum to the whole's.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from ..api.args import AttnCall, attention_call
from ..api.primitives import merge_attention
from ..api.validate import validate_qkv
from ..config.hardware import device_target
from ..config.options import attn_options
from ..config.tables import prefill_fwd_config
from ..errors import InputError
from ..launch.backward import launch_backward
from ..launch.prefill import launch_prefill
from .agree import checked_call, refuse_dropout
from .blocks import alibi_block, block_call
from .comm import Ring

LAYOUTS = ("ring", "zigzag", "stripe")


def layout_chunks(layout: str, rank: int, world: int) -> List[int]:
    """The global chunk indices rank `rank` holds, in local order ("stripe": one, its stripe)."""
    if layout == "ring":
        return [rank]
    if layout == "zigzag":
        return [rank, 2 * world - 1 - rank]
    if layout == "stripe":
        return [rank]
    raise InputError(f"Expected a layout in {LAYOUTS}, got {layout!r}.")


def _starts(layout: str, chunk_index: int, chunk: int, world: int) -> Tuple[int, int]:
    """(global position of the chunk's first token, step between its tokens)."""
    if layout == "stripe":  # rank r's stripe: tokens r, r + world, r + 2 * world, ...
        return chunk_index, world
    return chunk_index * chunk, 1


def chunk_pairs(layout: str, rank: int, src: int, world: int, chunk: int, call: AttnCall, batch: int = 1):
    """(query slice, key slice, block options, block tensors) of every chunk pair of rank's queries and src's
    keys that some query sees; `call` is the whole sequence's (`attention_call`), batch its batch size."""
    options = call.options
    window = (options.window_left, options.window_right)
    for qi, a in enumerate(layout_chunks(layout, rank, world)):
        for ki, b in enumerate(layout_chunks(layout, src, world)):
            (q_start, step), (k_start, _) = _starts(layout, a, chunk, world), _starts(layout, b, chunk, world)
            pair = block_call(q_start, k_start, step, chunk, window, options.causal)
            if pair is None:
                continue
            block = attn_options(options.head_dim, options.softmax_scale, window=pair.window, softcap=options.softcap,
                                 alibi=options.alibi)
            tensors = alibi_block(call.tensors, (q_start - k_start) / step - (pair.keys - pair.rows), step, batch)
            yield slice(qi * chunk, qi * chunk + pair.rows), slice(ki * chunk, ki * chunk + pair.keys), block, tensors


def ring_forward(q, k, v, call: AttnCall, layout: str, ring: Ring) -> Tuple[torch.Tensor, torch.Tensor]:
    """(out float32 (batch, seqlen, nheads, headdim), lse float32 (batch, nheads, seqlen)) of this rank's queries
    over the whole sequence's keys; `call`: the whole sequence's options and per-call tensors."""
    batch, seqlen, nheads, head_dim = q.shape
    chunk = seqlen // len(layout_chunks(layout, ring.rank, ring.world))
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full((batch, nheads, seqlen), float("inf"), dtype=torch.float32, device=q.device)
    config = prefill_fwd_config(call.options.head_dim_pad, q.dtype, False, device_target(q.device))  # fwd_kernel
    kv = [k, v]
    for step in range(ring.world):
        pending = ring.shift(kv) if step + 1 < ring.world else None
        src = (ring.rank - step) % ring.world
        for rows, keys, block, tensors in chunk_pairs(layout, ring.rank, src, ring.world, chunk, call, batch):
            part = torch.empty(q[:, rows].shape, dtype=torch.float32, device=q.device)
            part, part_lse = launch_prefill(q[:, rows], kv[0][:, keys], kv[1][:, keys], block, config=config,
                                            tensors=tensors, out=part)
            out[:, rows], lse[:, :, rows] = merge_attention(out[:, rows], lse[:, :, rows], part, part_lse)
        if pending is not None:
            kv = pending.wait()
    return out, lse


def ring_backward(dout, q, k, v, out, lse, call: AttnCall, layout: str, ring: Ring,
                  deterministic: bool = False) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) float32 of this rank's shard; out, lse: `ring_forward`'s; `deterministic` as
    flash_attn_func's (each block's backward)."""
    chunk = q.shape[1] // len(layout_chunks(layout, ring.rank, ring.world))
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    kv, travelling = [k, v], None
    for step in range(ring.world):
        pending = ring.shift(kv) if step + 1 < ring.world else None
        src = (ring.rank - step) % ring.world
        dkv = [torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in kv]
        for rows, keys, block, tensors in chunk_pairs(layout, ring.rank, src, ring.world, chunk, call, q.shape[0]):
            grads = tuple(torch.empty(t.shape, dtype=torch.float32, device=t.device)
                          for t in (q[:, rows], kv[0][:, keys], kv[1][:, keys]))
            launch_backward(dout[:, rows], q[:, rows], kv[0][:, keys], kv[1][:, keys], out[:, rows],
                            lse[:, :, rows].contiguous(), block, grads=grads, tensors=tensors,
                            deterministic=deterministic)
            dq[:, rows] += grads[0]
            dkv[0][:, keys] += grads[1]
            dkv[1][:, keys] += grads[2]
        if travelling is not None:  # the sums of the ranks before this one, for the same K/V shard
            dkv = [a + b for a, b in zip(travelling.wait(), dkv)]
        travelling = ring.shift(dkv)  # on to the next rank with its K/V; after `world` shifts, home
        if pending is not None:
            kv = pending.wait()
    dk, dv = travelling.wait()
    return dq, dk, dv


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, call, layout, group, deterministic):
        ring = Ring(group)
        out, lse = ring_forward(q, k, v, call, layout, ring)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.call, ctx.layout, ctx.group, ctx.deterministic = call, layout, group, deterministic
        ctx.mark_non_differentiable(lse)
        return out.to(q.dtype), lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ring_backward(dout, q, k, v, out, lse, ctx.call, ctx.layout, Ring(ctx.group), ctx.deterministic)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def context_parallel_attention(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                               alibi_slopes=None, deterministic=False, return_attn_probs=False, group=None, *,
                               layout: str = "ring", softcap=0.0):
    """ring-flash-attn's functions, one body: this rank's shard of q (batch, seqlen, nheads, headdim), k and v
    (batch, seqlen, nheads_k, headdim), split by `layout`; returns out (and, with return_attn_probs, (out,
    softmax_lse, None), softmax_lse float32 (batch, nheads, seqlen)). Checked on every rank before any transfer
    (`agree.checked_call`): bad input on any rank raises on all of them. Causal masks, windows and ALiBi
    (alibi_slopes (nheads,) or (batch, nheads), flash-attn's) count global positions. softcap: flash-attn's,
    keyword-only."""
    world = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
    window = tuple(window_size) if isinstance(window_size, (tuple, list)) else (window_size,)
    built = {}

    def local_checks():
        layout_chunks(layout, 0, 1)
        validate_qkv(q, k, v)
        parts = len(layout_chunks(layout, 0, world))
        if q.shape[1] != k.shape[1] or q.shape[1] % parts:
            raise InputError(f"Expected q, k and v shards of one length divisible into {parts} chunks (layout "
                             f"{layout!r}), got seqlen_q {q.shape[1]} and seqlen_k {k.shape[1]} on rank "
                             f"{dist.get_rank(group)}.")
        refuse_dropout(dropout_p)
        built["call"] = attention_call(q.shape[3], softmax_scale, causal, window_size, softcap, alibi_slopes, None,
                                       seqlen_k=q.shape[1] * parts * world, batch=q.shape[0], nheads=q.shape[2],
                                       device=q.device)

    checked_call(group, (q, k, v), (LAYOUTS.index(layout) if layout in LAYOUTS else -1, int(bool(causal)), *window,
                                    int(alibi_slopes is not None)), local_checks)
    out, lse = _RingAttention.apply(q, k, v, built["call"], layout, group, bool(deterministic))
    return (out, lse, None) if return_attn_probs else out


def ring_flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                         alibi_slopes=None, deterministic=False, return_attn_probs=False, group=None):
    """ring-flash-attn's `ring_flash_attn_func`: rank r holds tokens [r * seqlen, (r + 1) * seqlen) of the
    sequence (seqlen = q.shape[1]); see `context_parallel_attention`."""
    return context_parallel_attention(q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes,
                                      deterministic, return_attn_probs, group, layout="ring")


def stripe_flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                           alibi_slopes=None, deterministic=False, return_attn_probs=False, group=None):
    """ring-flash-attn's `stripe_flash_attn_func`: rank r holds tokens r, r + world, r + 2 * world, ... of the
    sequence; see `context_parallel_attention`. Unlike ring-flash-attn's, not only causal, and windows count
    global positions."""
    return context_parallel_attention(q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes,
                                      deterministic, return_attn_probs, group, layout="stripe")


def zigzag_ring_flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                                alibi_slopes=None, deterministic=False, return_attn_probs=False, group=None):
    """ring-flash-attn's `zigzag_ring_flash_attn_func`: the sequence cut into 2 * world chunks, rank r holding
    chunks r and 2 * world - 1 - r (concatenated); see `context_parallel_attention`. Unlike ring-flash-attn's,
    not only causal."""
    return context_parallel_attention(q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes,
                                      deterministic, return_attn_probs, group, layout="zigzag")


def _packed(func):
    """func's qkvpacked and kvpacked forms (ring-flash-attn's): qkv (batch, seqlen, 3, nheads, headdim), kv
    (batch, seqlen, 2, nheads_k, headdim); gradients flow back into the packed tensors."""
    def qkvpacked(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), alibi_slopes=None,
                  deterministic=False, return_attn_probs=False, group=None):
        return func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], dropout_p, softmax_scale, causal, window_size,
                    alibi_slopes, deterministic, return_attn_probs, group)

    def kvpacked(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), alibi_slopes=None,
                 deterministic=False, return_attn_probs=False, group=None):
        return func(q, kv[:, :, 0], kv[:, :, 1], dropout_p, softmax_scale, causal, window_size, alibi_slopes,
                    deterministic, return_attn_probs, group)

    base = func.__name__[: -len("_func")]
    for form, name in ((qkvpacked, "qkvpacked"), (kvpacked, "kvpacked")):
        form.__name__ = form.__qualname__ = f"{base}_{name}_func"
        form.__doc__ = f"`{func.__name__}` on {name} inputs (ring-flash-attn's `{base}_{name}_func`)."
    return qkvpacked, kvpacked


ring_flash_attn_qkvpacked_func, ring_flash_attn_kvpacked_func = _packed(ring_flash_attn_func)
zigzag_ring_flash_attn_qkvpacked_func, zigzag_ring_flash_attn_kvpacked_func = _packed(zigzag_ring_flash_attn_func)
stripe_flash_attn_qkvpacked_func, stripe_flash_attn_kvpacked_func = _packed(stripe_flash_attn_func)


def shard(x: torch.Tensor, layout: str, rank: int, world: int, dim: int = 1) -> torch.Tensor:
    """Rank's shard of a whole-sequence tensor (sequence along `dim`) under `layout`."""
    if layout == "stripe":  # tokens rank, rank + world, rank + 2 * world, ...
        return x.index_select(dim, torch.arange(rank, x.shape[dim], world, device=x.device))
    parts = x.chunk(len(layout_chunks(layout, 0, world)) * world, dim=dim)
    return torch.cat([parts[c] for c in layout_chunks(layout, rank, world)], dim=dim)


def unshard(shards: List[torch.Tensor], layout: str, dim: int = 1) -> torch.Tensor:
    """The whole-sequence tensor from every rank's shard (shards[r] is rank r's)."""
    world = len(shards)
    if layout == "stripe":  # token t of rank r is global token t * world + r
        return torch.stack(shards, dim=dim + 1).flatten(dim, dim + 1)
    per = len(layout_chunks(layout, 0, world))
    chunks: List[Optional[torch.Tensor]] = [None] * (per * world)
    for rank, s in enumerate(shards):
        for piece, c in zip(s.chunk(per, dim=dim), layout_chunks(layout, rank, world)):
            chunks[c] = piece
    return torch.cat(chunks, dim=dim)
