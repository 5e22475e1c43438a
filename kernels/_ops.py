"""The attention kernels as PyTorch custom operators (`torch.library`), for torch.compile.

Eager calls of the public functions launch the kernels directly (no dispatcher on the hot path: the
host time of a decode step is tens of microseconds). Under torch.compile they call these ops instead,
which dynamo records as single graph nodes: each op has a fake implementation (the output shapes, for
tracing without running a kernel) and the prefill op its registered autograd.

    kernels::prefill_fwd(q, k, v, alibi_slopes?, sinks?, rng_state?, softmax_scale, causal,
                         window_left, window_right, softcap, dropout_p) -> (out, lse)
    kernels::prefill_bwd(dout, q, k, v, out, lse, alibi_slopes?, sinks?, rng_state?, <the same
                         scalars>) -> (dq, dk, dv, dsinks)

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


TRACED["flash_attn_func"] = flash_attn_func_traced
