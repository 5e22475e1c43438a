"""Context-parallel attention over packed sequences (ring-flash-attn's `ring_flash_attn_varlen_func`).

Every sequence of the packed batch is cut into `world` equal chunks and rank r holds chunk r of each, packed
in the same order: its `cu_seqlens` are the whole batch's divided by `world` (ring-flash-attn's convention).
K and V travel around the ring as in ring.py; because every sequence's chunks have the same relation at a
given step (the visiting chunk is before, at, or after the rank's own in every sequence), one packed call per
step covers the whole batch: all keys seen (an earlier chunk), causal (the rank's own), or skipped (a later
chunk, causal only). Partial outputs in float32 merged by LSE in float32; gradients accumulated in float32,
dK/dV travelling with their K/V, as in ring.py.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.distributed as dist

from ..api.args import attention_call
from ..api.primitives import merge_attention
from ..api.validate import validate_varlen
from ..config.hardware import device_target
from ..config.options import AttnOptions, attn_options
from ..config.tables import prefill_fwd_config
from ..errors import InputError
from ..launch.backward import launch_varlen_backward
from ..launch.prefill import launch_varlen
from .comm import Ring


def _step_options(options: AttnOptions, rank: int, src: int) -> Optional[AttnOptions]:
    """The packed call of the step whose keys are src's chunks: None when no query sees them."""
    if not options.causal:
        return options
    if src > rank:
        return None
    return attn_options(options.head_dim, options.softmax_scale, causal=src == rank, softcap=options.softcap)


def ring_varlen_forward(q, k, v, cu_seqlens, max_seqlen: int, options: AttnOptions,
                        ring: Ring) -> Tuple[torch.Tensor, torch.Tensor]:
    """(out float32 (total, nheads, headdim), lse float32 (nheads, total)) of this rank's packed queries."""
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full((q.shape[1], q.shape[0]), float("inf"), dtype=torch.float32, device=q.device)
    config = prefill_fwd_config(options.head_dim_pad, q.dtype, False, device_target(q.device))  # fwd_kernel
    kv = [k, v]
    for step in range(ring.world):
        pending = ring.shift(kv) if step + 1 < ring.world else None
        block = _step_options(options, ring.rank, (ring.rank - step) % ring.world)
        if block is not None:
            part = torch.empty(q.shape, dtype=torch.float32, device=q.device)
            part, part_lse = launch_varlen(q, kv[0], kv[1], cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, block,
                                           config=config, out=part)
            out, lse = merge_attention(out, lse, part, part_lse)
        if pending is not None:
            kv = pending.wait()
    return out, lse


def ring_varlen_backward(dout, q, k, v, out, lse, cu_seqlens, max_seqlen: int, options: AttnOptions, ring: Ring):
    """(dq, dk, dv) float32 of this rank's packed shard; out, lse: `ring_varlen_forward`'s."""
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    kv, travelling = [k, v], None
    for step in range(ring.world):
        pending = ring.shift(kv) if step + 1 < ring.world else None
        block = _step_options(options, ring.rank, (ring.rank - step) % ring.world)
        dkv = [torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in kv]
        if block is not None:
            grads = (torch.empty(q.shape, dtype=torch.float32, device=q.device), *dkv)
            launch_varlen_backward(dout, q, kv[0], kv[1], out, lse, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                   block, grads=grads)
            dq += grads[0]
        if travelling is not None:
            dkv = [a + b for a, b in zip(travelling.wait(), dkv)]
        travelling = ring.shift(dkv)
        if pending is not None:
            kv = pending.wait()
    dk, dv = travelling.wait()
    return dq, dk, dv


class _RingVarlenAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, max_seqlen, options, group):
        out, lse = ring_varlen_forward(q, k, v, cu_seqlens, max_seqlen, options, Ring(group))
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens)
        ctx.max_seqlen, ctx.options, ctx.group = max_seqlen, options, group
        ctx.mark_non_differentiable(lse)
        return out.to(q.dtype), lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, cu_seqlens = ctx.saved_tensors
        dq, dk, dv = ring_varlen_backward(dout, q, k, v, out, lse, cu_seqlens, ctx.max_seqlen, ctx.options,
                                          Ring(ctx.group))
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def ring_flash_attn_varlen_func(q, k, v, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                window_size=(-1, -1), alibi_slopes=None, deterministic=False, return_attn_probs=False,
                                group=None):
    """ring-flash-attn's `ring_flash_attn_varlen_func`: q (total, nheads, headdim), k / v (total, nheads_k,
    headdim) packed by `cu_seqlens` (int32 (batch + 1,), this rank's: every sequence's chunk `rank` of `world`),
    `max_seqlen` its longest; returns out (with return_attn_probs (out, softmax_lse (nheads, total), None))."""
    if not dist.is_available() or not dist.is_initialized():
        raise InputError("Context-parallel attention needs torch.distributed initialised (init_process_group).")
    max_seqlen, _ = validate_varlen(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen)
    if dropout_p:
        raise NotImplementedError("Dropout in context-parallel attention is not supported: its mask would differ from "
                                  "the single-GPU one (pass dropout_p=0).")
    if alibi_slopes is not None:
        raise NotImplementedError("ALiBi in context-parallel attention is not supported yet.")
    if tuple(window_size) != (-1, -1):
        raise NotImplementedError("A sliding window in the packed context-parallel functions is not supported yet "
                                  "(the dense ones take it, in global positions).")
    world = dist.get_world_size(group)
    call = attention_call(q.shape[2], softmax_scale, causal, window_size, 0.0, None, None,
                          seqlen_k=max_seqlen * world, batch=cu_seqlens.numel() - 1, nheads=q.shape[1],
                          device=q.device)
    out, lse = _RingVarlenAttention.apply(q, k, v, cu_seqlens.contiguous(), max_seqlen, call.options, group)
    return (out, lse, None) if return_attn_probs else out


def shard_varlen(x: torch.Tensor, cu_seqlens: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank's packed shard of a packed whole batch (sequence along dim 0): chunk `rank` of each sequence."""
    bounds = cu_seqlens.tolist()
    return torch.cat([x[a:b].chunk(world, dim=0)[rank] for a, b in zip(bounds[:-1], bounds[1:])], dim=0)
