"""The attention kernels as PyTorch custom operators (`torch.library`), for torch.compile.

Eager calls of the public functions launch the kernels directly (no dispatcher on the hot path: the
host time of a decode step is tens of microseconds). Under torch.compile they call these ops instead,
which dynamo records as single graph nodes: each op has a fake implementation (the output shapes, for
tracing without running a kernel) and the prefill op its registered autograd.

    kernels::prefill_fwd(q, k, v, alibi_slopes?, sinks?, rng_state?, softmax_scale, causal,
                         window_left, window_right, softcap, dropout_p) -> (out, lse)
    kernels::prefill_bwd(dout, q, k, v, out, lse, alibi_slopes?, sinks?, rng_state?, <the same
                         scalars>) -> (dq, dk, dv, dsinks)
    kernels::kvcache(q, k_cache!, v_cache!, k?, v?, cache_seqlens, block_table?, alibi_slopes?, sinks?,
                     softmax_scale, causal, window_left, window_right, softcap, num_splits,
                     return_lse) -> (out, lse)      (k_cache and v_cache: the in-place append)

The scalars are flash-attn's (window sides -1 for unbounded, softcap 0 for none, softmax_scale
resolved); the op rebuilds the kernels' options from them (`variant_options`, cached by value).
Dropout's (seed, salt) come in as rng_state, an input drawn in the graph, so a compiled graph draws
fresh bits per call like the eager path. dsinks is an empty (0,) tensor without sinks (an op output
cannot be None).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from ._options import resolve_variants
from .decode import Variants, _kvcache_call
from .prefill import (
    TRACED,
    _flash_attn_backward,
    _flash_attn_forward,
    _results,
    _validate_qkv,
    dropout,
    variant_options,
)


def _options(q: Tensor, k: Tensor, alibi_slopes, sinks, softmax_scale: float, causal: bool, window_left: int,
             window_right: int, softcap: float):
    return variant_options(q.shape[3], softmax_scale, causal, (window_left, window_right), softcap, alibi_slopes,
                           sinks, k.shape[1], q.shape[0], q.shape[2], q.device)


@torch.library.custom_op("kernels::prefill_fwd", mutates_args=())
def prefill_fwd(q: Tensor, k: Tensor, v: Tensor, alibi_slopes: Optional[Tensor], sinks: Optional[Tensor],
                rng_state: Optional[Tensor], softmax_scale: float, causal: bool, window_left: int, window_right: int,
                softcap: float, dropout_p: float) -> Tuple[Tensor, Tensor]:
    _validate_qkv(q, k, v)
    options, variants = _options(q, k, alibi_slopes, sinks, softmax_scale, causal, window_left, window_right, softcap)
    drop = dropout(dropout_p, q.device, rng_state)
    return _flash_attn_forward(q, k, v, options, drop=drop, variants=variants)


@prefill_fwd.register_fake
def _(q, k, v, alibi_slopes, sinks, rng_state, softmax_scale, causal, window_left, window_right, softcap, dropout_p):
    batch, seqlen_q, nheads, head_dim = q.shape
    return q.new_empty((batch, seqlen_q, nheads, head_dim)), q.new_empty((batch, nheads, seqlen_q),
                                                                        dtype=torch.float32)


@torch.library.custom_op("kernels::prefill_bwd", mutates_args=())
def prefill_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                alibi_slopes: Optional[Tensor], sinks: Optional[Tensor], rng_state: Optional[Tensor],
                softmax_scale: float, causal: bool, window_left: int, window_right: int, softcap: float,
                dropout_p: float) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    options, variants = _options(q, k, alibi_slopes, sinks, softmax_scale, causal, window_left, window_right, softcap)
    drop = dropout(dropout_p, q.device, rng_state)
    dq, dk, dv, _, dsinks = _flash_attn_backward(dout, q, k, v, out, lse, options, drop=drop, variants=variants)
    return dq, dk, dv, dsinks if dsinks is not None else q.new_empty((0,), dtype=torch.float32)


@prefill_bwd.register_fake
def _(dout, q, k, v, out, lse, alibi_slopes, sinks, rng_state, softmax_scale, causal, window_left, window_right,
      softcap, dropout_p):
    nheads = q.shape[2] if sinks is not None else 0
    return (torch.empty_like(q, memory_format=torch.contiguous_format), torch.empty_like(k), torch.empty_like(v),
            q.new_empty((nheads,), dtype=torch.float32))


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, alibi_slopes, sinks, rng_state, *scalars = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, alibi_slopes, sinks, rng_state)
    ctx.scalars = scalars


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, alibi_slopes, sinks, rng_state = ctx.saved_tensors
    dq, dk, dv, dsinks = prefill_bwd(dout, q, k, v, out, lse, alibi_slopes, sinks, rng_state, *ctx.scalars)
    dsinks = dsinks.to(sinks.dtype) if sinks is not None and ctx.needs_input_grad[4] else None
    return dq, dk, dv, None, dsinks, None, None, None, None, None, None, None


prefill_fwd.register_autograd(_backward, setup_context=_setup_context)


def flash_attn_func_traced(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           return_attn_probs, return_softmax_lse, sinks):
    """flash_attn_func under torch.compile: flash-attn's arguments resolved in Python (what dynamo
    traces), then one `kernels::prefill_fwd` node; its inputs are checked when it runs, before any launch."""
    if return_attn_probs and dropout_p > 0:
        raise NotImplementedError("return_attn_probs with dropout (S_dmask, a testing aid) is eager only.")
    resolved = resolve_variants(window_size, softcap, causal, k.shape[1])
    left, right = resolved["window"]
    scale = float(softmax_scale) if softmax_scale is not None else q.shape[-1] ** -0.5
    rng_state = torch.randint(0, 2**62, (2,), dtype=torch.int64, device=q.device) if dropout_p > 0 else None
    out, lse = prefill_fwd(q, k, v, alibi_slopes, sinks, rng_state, scale, resolved["causal"], left, right,
                           resolved["softcap"], float(dropout_p))
    return _results(out, lse, None, return_attn_probs, return_softmax_lse)



@torch.library.custom_op("kernels::kvcache", mutates_args=("k_cache", "v_cache"))
def kvcache(q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Optional[Tensor], v: Optional[Tensor],
            cache_seqlens: Tensor, block_table: Optional[Tensor], alibi_slopes: Optional[Tensor],
            sinks: Optional[Tensor], softmax_scale: float, causal: bool, window_left: int, window_right: int,
            softcap: float, num_splits: int, return_lse: bool) -> Tuple[Tensor, Tensor]:
    window = (window_left, window_right)
    variants = None
    if window != (-1, -1) or softcap or alibi_slopes is not None or sinks is not None:
        variants = Variants(window, softcap, alibi_slopes, sinks)
    out, lse = _kvcache_call(q, k_cache, v_cache, k, v, cache_seqlens, block_table, softmax_scale, causal, num_splits,
                             True, validated=False, variants=variants)
    return out, lse if return_lse else q.new_empty((0,), dtype=torch.float32)


@kvcache.register_fake
def _(q, k_cache, v_cache, k, v, cache_seqlens, block_table, alibi_slopes, sinks, softmax_scale, causal, window_left,
      window_right, softcap, num_splits, return_lse):
    batch, seqlen_q, nheads, head_dim = q.shape
    lse_shape = (batch, nheads, seqlen_q) if return_lse else (0,)
    return q.new_empty((batch, seqlen_q, nheads, head_dim)), q.new_empty(lse_shape, dtype=torch.float32)


def flash_attn_with_kvcache_traced(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                                   cache_leftpad, block_table, softmax_scale, causal, window_size, softcap,
                                   rotary_interleaved, alibi_slopes, num_splits, return_softmax_lse, sinks):
    """flash_attn_with_kvcache under torch.compile: one `kernels::kvcache` node, which appends k / v into
    the caches in place (a declared mutation) and attends. cache_seqlens must be a tensor (an int would be
    baked into the graph); rotary, cache_batch_idx and cache_leftpad are eager only for now."""
    if rotary_cos is not None or rotary_sin is not None or cache_batch_idx is not None or cache_leftpad is not None:
        raise NotImplementedError("flash_attn_with_kvcache under torch.compile takes no rotary_cos / rotary_sin, "
                                  "cache_batch_idx or cache_leftpad yet; call it outside the compiled region.")
    if not isinstance(cache_seqlens, torch.Tensor):
        raise NotImplementedError("flash_attn_with_kvcache under torch.compile needs cache_seqlens as an int32 "
                                  "tensor (an int would be compiled into the graph).")
    capacity = k_cache.shape[1] * (1 if block_table is None else block_table.shape[1])
    resolved = resolve_variants(window_size, softcap, causal, capacity)  # the op's options normalise the rest
    causal, window, cap = resolved["causal"], resolved["window"], resolved["softcap"]
    scale = float(softmax_scale) if softmax_scale is not None else q.shape[-1] ** -0.5
    out, lse = kvcache(q, k_cache, v_cache, k, v, cache_seqlens, block_table, alibi_slopes, sinks, scale, causal,
                       window[0], window[1], cap, int(num_splits), bool(return_softmax_lse))
    return (out, lse) if return_softmax_lse else out


TRACED["flash_attn_func"] = flash_attn_func_traced
TRACED["flash_attn_with_kvcache"] = flash_attn_with_kvcache_traced
