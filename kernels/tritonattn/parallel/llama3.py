"""Context parallelism by all-gather (ring-flash-attn's `llama3_flash_attn_varlen_func`, the scheme of Llama 3's
training): the packed batch is cut into `world` equal token ranges, rank r holding range r whatever the sequence
borders; each rank gathers every rank's K and V, `heads_k_stride` KV heads at a time (the next heads' gather
posted before the current heads' attention), and runs one packed call of its queries against the keys they
need (`local_k_slice`, from `llama3_flash_attn_prepare_cu_seqlens`). Causal, the local queries of each sequence
are the last of its local keys, so the kernels' bottom-right alignment puts every mask, window and ALiBi distance
at its global position: exact in one call. The backward gathers K/V again, computes dK/dV of the gathered keys
in float32 and reduce-scatters them to their owners; dQ stays local, in float32 until the end.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import List, Tuple

import torch
import torch.distributed as dist

from ..api.args import AttnCall, attention_call
from ..api.validate import validate_varlen
from ..config.hardware import device_target
from ..config.tables import prefill_fwd_config
from ..errors import InputError
from ..launch.backward import launch_varlen_backward
from ..launch.prefill import launch_varlen
from .agree import checked_call, refuse_dropout


def llama3_flash_attn_prepare_cu_seqlens(cu_seqlens: torch.Tensor, causal: bool, rank: int, world_size: int):
    """ring-flash-attn's helper: from the whole packed batch's cu_seqlens (every rank's tokens), rank's
    (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, local_k_slice). Rank r holds tokens [r * T / w,
    (r + 1) * T / w) (T tokens, w ranks; T must divide); its sequences are those that overlap that range, their
    queries the overlap, their keys from each sequence's start to the range's end (causal) or to the sequence's
    end (not causal), local_k_slice those keys' rows in the gathered K/V."""
    bounds = [int(b) for b in cu_seqlens.tolist()]
    total = bounds[-1]
    if world_size < 1 or total % world_size:
        raise InputError(f"Expected the packed batch's {total} tokens divisible by the world size {world_size} "
                         f"(rank {rank}): each rank holds an equal range of tokens.")
    per = total // world_size
    start, end = rank * per, (rank + 1) * per
    left, right = bisect_left(bounds, start), bisect_left(bounds, end)
    if bounds[left] != start:  # the range starts inside sequence left - 1
        left -= 1
    q_bounds = [min(max(b - start, 0), per) for b in bounds[left: right + 1]]
    k_right = end if causal else bounds[right]
    k_bounds = [b - bounds[left] for b in bounds[left: right]] + [k_right - bounds[left]]
    as_tensor = lambda b: torch.tensor(b, dtype=cu_seqlens.dtype, device=cu_seqlens.device)  # noqa: E731
    max_q = max(b - a for a, b in zip(q_bounds[:-1], q_bounds[1:]))
    max_k = max(b - a for a, b in zip(k_bounds[:-1], k_bounds[1:]))
    return as_tensor(q_bounds), as_tensor(k_bounds), max_q, max_k, slice(bounds[left], k_right)


class _Gather:
    """K and V of KV heads [first, first + count) from every rank, posted now: `wait` gives (2, world * total,
    count, headdim), rank r's rows at [r * total, (r + 1) * total)."""

    def __init__(self, k, v, first: int, count: int, group):
        world = dist.get_world_size(group)
        self.buf = torch.empty((2, world * k.shape[0], count, k.shape[2]), dtype=k.dtype, device=k.device)
        self.requests = [dist.all_gather_into_tensor(self.buf[i], t[:, first: first + count].contiguous(),
                                                     group=group, async_op=True) for i, t in enumerate((k, v))]

    def wait(self) -> torch.Tensor:
        for request in self.requests:
            request.wait()
        return self.buf


def _head_calls(call: AttnCall, stride: int, group_size: int, nheads: int) -> List[AttnCall]:
    """One call per group of `stride` KV heads: with ALiBi, the slopes of its query heads; else the same call."""
    if "Alibi" not in call.tensors:
        return [call] * (nheads // group_size // stride)
    slopes = call.tensors["Alibi"].reshape(-1, nheads)[0]  # one slope per head (validated: batch 1)
    return [AttnCall(call.options, {**call.tensors, "Alibi": slopes[first * group_size: (first + stride) * group_size]
                                    .contiguous(), "stride_alibi_b": 0}, None)
            for first in range(0, nheads // group_size, stride)]


def gathered_heads(k, v, stride: int, group_size: int, group):
    """(n, first, kv, heads) per group of `stride` KV heads [first, first + stride): kv their gathered K/V
    (`_Gather`), heads the slice of the query heads that read them; the next group's gather is posted before this
    one is handed out, so it runs under the caller's attention."""
    pending = _Gather(k, v, 0, stride, group)
    for n, first in enumerate(range(0, k.shape[1], stride)):
        kv = pending.wait()
        if first + stride < k.shape[1]:
            pending = _Gather(k, v, first + stride, stride, group)
        yield n, first, kv, slice(first * group_size, (first + stride) * group_size)


def llama3_forward(q, k, v, meta, calls: List[AttnCall], group) -> Tuple[torch.Tensor, torch.Tensor]:
    """(out float32 (total_q, nheads, headdim), lse float32 (nheads, total_q)) of this rank's packed queries."""
    cu_q, cu_k, max_q, max_k, k_rows, stride = meta
    group_size = q.shape[1] // k.shape[1]
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.empty((q.shape[1], q.shape[0]), dtype=torch.float32, device=q.device)
    config = prefill_fwd_config(calls[0].options.head_dim_pad, q.dtype, False, device_target(q.device))  # fwd_kernel
    for n, _, kv, heads in gathered_heads(k, v, stride, group_size, group):
        part = torch.empty((q.shape[0], stride * group_size, q.shape[2]), dtype=torch.float32, device=q.device)
        part, part_lse = launch_varlen(q[:, heads], kv[0][k_rows], kv[1][k_rows], cu_q, cu_k, max_q, max_k,
                                       calls[n].options, config=config, tensors=calls[n].tensors, out=part)
        out[:, heads], lse[heads] = part, part_lse
    return out, lse


def llama3_backward(dout, q, k, v, out, lse, meta, calls: List[AttnCall], group):
    """(dq, dk, dv) float32 of this rank's packed shard; out, lse: `llama3_forward`'s."""
    cu_q, cu_k, max_q, max_k, k_rows, stride = meta
    group_size = q.shape[1] // k.shape[1]
    dq = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    dk, dv = (torch.empty(t.shape, dtype=torch.float32, device=t.device) for t in (k, v))
    for n, first, kv, heads in gathered_heads(k, v, stride, group_size, group):
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
        grads = (torch.empty(q[:, heads].shape, dtype=torch.float32, device=q.device), dkv[0][k_rows], dkv[1][k_rows])
        launch_varlen_backward(dout[:, heads], q[:, heads], kv[0][k_rows], kv[1][k_rows], out[:, heads],
                               lse[heads].contiguous(), cu_q, cu_k, max_q, max_k, calls[n].options,
                               tensors=calls[n].tensors, grads=grads)
        dq[:, heads] = grads[0]
        for i, target in enumerate((dk, dv)):  # each rank's rows, summed over the ranks whose queries saw them
            mine = torch.empty((k.shape[0], stride, k.shape[2]), dtype=torch.float32, device=k.device)
            dist.reduce_scatter_tensor(mine, dkv[i].contiguous(), group=group)
            target[:, first: first + stride] = mine
    return dq, dk, dv


class _Llama3Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, meta, calls, group):
        out, lse = llama3_forward(q, k, v, meta, calls, group)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.meta, ctx.calls, ctx.group = meta, calls, group
        ctx.mark_non_differentiable(lse)
        return out.to(q.dtype), lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = llama3_backward(dout.contiguous(), q, k, v, out, lse, ctx.meta, ctx.calls, ctx.group)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def llama3_flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, heads_k_stride,
                                  local_k_slice, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                                  alibi_slopes=None, deterministic=False, return_attn_probs=False, group=None, *,
                                  softcap=0.0):
    """ring-flash-attn's `llama3_flash_attn_varlen_func`: this rank's equal range of the packed batch's tokens, q
    (total, nheads, headdim), k and v (total, nheads_k, headdim), with `llama3_flash_attn_prepare_cu_seqlens`'s
    cu_seqlens_q / cu_seqlens_k / max lengths / local_k_slice; K and V gathered heads_k_stride KV heads at a time
    (a divisor of nheads_k: fewer heads, less memory, more steps). Returns out (with return_attn_probs (out,
    softmax_lse (nheads, total), None)). Causal: windows and ALiBi at global positions, exact. Not causal: no
    window and no ALiBi (the last sequence's queries are not the end of its keys), refused. Dropout refused."""
    world = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
    window = tuple(window_size) if isinstance(window_size, (tuple, list)) else window_size
    built = {}

    def local_checks():
        validate_varlen(q, k, v, cu_seqlens_q, cu_seqlens_q, max_seqlen_q, max_seqlen_q)
        refuse_dropout(dropout_p)
        if not causal and (window != (-1, -1) or alibi_slopes is not None):
            raise NotImplementedError("A window or ALiBi with causal=False is not supported by the all-gather form: "
                                      "the last sequence's queries are not aligned to the end of its keys.")
        if not isinstance(heads_k_stride, int) or heads_k_stride < 1 or k.shape[1] % heads_k_stride:
            raise InputError(f"Expected heads_k_stride a divisor of nheads_k = {k.shape[1]}, got {heads_k_stride}.")
        if not isinstance(local_k_slice, slice) or local_k_slice.step not in (None, 1):
            raise InputError(f"Expected local_k_slice a slice (llama3_flash_attn_prepare_cu_seqlens's), got "
                             f"{local_k_slice!r}.")
        lo, hi, _ = local_k_slice.indices(world * k.shape[0])
        cu_k = cu_seqlens_k.tolist() if isinstance(cu_seqlens_k, torch.Tensor) else None
        if cu_k is None or len(cu_k) != cu_seqlens_q.numel() or cu_k[0] != 0 or cu_k[-1] != hi - lo:
            raise InputError(f"Expected cu_seqlens_k of {cu_seqlens_q.numel()} entries from 0 to the local_k_slice's "
                             f"{hi - lo} keys, got {cu_k}.")
        if max(b - a for a, b in zip(cu_k[:-1], cu_k[1:])) > max_seqlen_k:
            raise InputError(f"Expected max_seqlen_k >= the longest key range in cu_seqlens_k, got {max_seqlen_k}.")
        built["call"] = attention_call(q.shape[2], softmax_scale, causal, window_size, softcap, alibi_slopes, None,
                                          seqlen_k=max_seqlen_k, batch=1, nheads=q.shape[1], device=q.device)

    checked_call(group, (q, k, v), (int(bool(causal)), *window, heads_k_stride), local_checks)
    calls = _head_calls(built["call"], heads_k_stride, q.shape[1] // k.shape[1], q.shape[1])
    meta = (cu_seqlens_q.to(q.device, torch.int32), cu_seqlens_k.to(q.device, torch.int32), int(max_seqlen_q),
            int(max_seqlen_k), local_k_slice, heads_k_stride)
    out, lse = _Llama3Attention.apply(q, k, v, meta, calls, group)
    return (out, lse, None) if return_attn_probs else out


def llama3_flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                            heads_k_stride, local_k_slice, dropout_p=0.0, softmax_scale=None,
                                            causal=False, window_size=(-1, -1), alibi_slopes=None, deterministic=False,
                                            return_attn_probs=False, group=None, *, softcap=0.0):
    """`llama3_flash_attn_varlen_func` on qkv (total, 3, nheads, headdim) (ring-flash-attn's)."""
    return llama3_flash_attn_varlen_func(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                         max_seqlen_k, heads_k_stride, local_k_slice, dropout_p, softmax_scale, causal,
                                         window_size, alibi_slopes, deterministic, return_attn_probs, group,
                                         softcap=softcap)


def llama3_flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                           heads_k_stride, local_k_slice, dropout_p=0.0, softmax_scale=None,
                                           causal=False, window_size=(-1, -1), alibi_slopes=None, deterministic=False,
                                           return_attn_probs=False, group=None, *, softcap=0.0):
    """`llama3_flash_attn_varlen_func` on kv (total, 2, nheads_k, headdim) (ring-flash-attn's)."""
    return llama3_flash_attn_varlen_func(q, kv[:, 0], kv[:, 1], cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                         max_seqlen_k, heads_k_stride, local_k_slice, dropout_p, softmax_scale, causal,
                                         window_size, alibi_slopes, deterministic, return_attn_probs, group,
                                         softcap=softcap)


def shard_llama3(x: torch.Tensor, rank: int, world: int, dim: int = 0) -> torch.Tensor:
    """Rank's equal range of a packed whole batch (tokens along `dim`)."""
    if x.shape[dim] % world:
        raise InputError(f"Expected {x.shape[dim]} tokens divisible by the world size {world}.")
    return x.chunk(world, dim=dim)[rank]

