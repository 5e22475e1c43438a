"""The attention kernels as PyTorch custom operators (`torch.library`), for torch.compile.

Eager calls of the public functions launch the kernels directly (no dispatcher on the hot path: the
host time of a decode step is tens of microseconds). Under torch.compile they call these ops instead,
which dynamo records as single graph nodes: each op has a fake implementation (the output shapes, for
tracing without running a kernel) and the prefill op its registered autograd.

    tritonattn::prefill_fwd(q, k, v, cu_seqlens_q?, cu_seqlens_k?, max_seqlen_q, max_seqlen_k,
                            alibi_slopes?, sinks?, seqused_k?, rng_state?, softmax_scale?, causal,
                            window_left, window_right, softcap, dropout_p, deterministic) -> (out, lse)
    tritonattn::prefill_bwd(dout, q, k, v, out, lse, <the same inputs after v>) -> (dq, dk, dv, dsinks)

flash_attn_func and flash_attn_varlen_func share the prefill ops: with cu_seqlens, q, k, v are packed
(total, nheads, headdim) and lse is (nheads, total_q), as flash-attn's. A paged K/V has its own
forward-only op, and flash_attn_with_kvcache one op with every argument of the eager function:

    tritonattn::varlen_paged_fwd(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                 max_seqlen_k, block_table, alibi_slopes?, sinks?, seqused_k?,
                                 <scalars>) -> (out, lse)
    tritonattn::kvcache(q, k_cache!, v_cache!, k?, v?, rotary_cos?, rotary_sin?, cache_seqlens,
                     cache_batch_idx?, cache_leftpad?, block_table?, alibi_slopes?, sinks?,
                     softmax_scale?, causal, window_left, window_right, softcap, rotary_interleaved,
                     num_splits, return_lse) -> (out, lse)      (k_cache!, v_cache!: the append)

The scalars are flash-attn's, as the caller gave them (window sides, softcap, softmax_scale or None);
the op's body translates them with the eager path's one translation (`api.args.attention_call`,
cached by value), so a compiled call and an eager one compute the same thing.
Dropout's (seed, salt) come in as rng_state, an input drawn in the graph, so a compiled graph draws
fresh bits per call like the eager path. dsinks is an empty (0,) tensor without sinks (an op output
cannot be None).

[Note] Contiguous outputs: inductor checks at run time that an op's outputs have the strides its fake
implementation gave. The fakes say contiguous, so the ops make it so: eager paths may return a view
of a padded buffer (a head dim that is not a multiple of 8 on Hopper, where tensor descriptors need
16-byte rows), which the op copies; gradients are allocated contiguous, whatever q, k, v's strides.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from ..api.args import attention_call, draw_rng_state
from ..api.kvcache import flash_attn_with_kvcache
from ..api.prefill import PAGED_VARLEN_NO_BACKWARD, TRACED, results, varlen_paged
from ..api.validate import validate_dropout, validate_qkv, validate_varlen
from ..config.options import softcap_number, window_pair
from ..errors import InputError
from ..launch.backward import launch_backward, launch_varlen_backward
from ..launch.prefill import launch_prefill, launch_varlen
from ..launch.replay import uncached_scratch

# The ops' namespace is the package's import name ("tritonattn"), so that two copies of the package can
# share a process under different names (benchmarks.ab --host times two trees side by side).
NAMESPACE = __name__.split(".")[0]


def _call(q: Tensor, k: Tensor, cu_seqlens_q, max_seqlen_k: int, alibi_slopes, sinks, seqused_k, softmax_scale,
          causal: bool, window_left: int, window_right: int, softcap: float, dropout_p: float, rng_state):
    """A prefill op's call through the one translation (`args.attention_call`), dense (q 4-D) or packed."""
    if cu_seqlens_q is None:
        batch, nheads, seqlen_k = q.shape[0], q.shape[2], k.shape[1]
    else:
        batch, nheads, seqlen_k = cu_seqlens_q.numel() - 1, q.shape[1], max_seqlen_k
    return attention_call(q.shape[-1], softmax_scale, causal, (window_left, window_right), softcap, alibi_slopes, sinks,
                          seqused_k, dropout_p, rng_state, seqlen_k=seqlen_k, batch=batch, nheads=nheads,
                          device=q.device)


def _lse_shape(q: Tensor, packed: bool):
    """softmax_lse's shape: (batch, nheads, seqlen_q) dense, (nheads, total_q) packed (flash-attn's)."""
    return (q.shape[1], q.shape[0]) if packed else (q.shape[0], q.shape[2], q.shape[1])


def prefill_forward(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor],
                    max_seqlen_q: int, max_seqlen_k: int, alibi_slopes: Optional[Tensor], sinks: Optional[Tensor],
                    seqused_k: Optional[Tensor], rng_state: Optional[Tensor], softmax_scale: Optional[float],
                    causal: bool, window_left: int, window_right: int, softcap: float, dropout_p: float,
                    out: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """The prefill forward from the ops' arguments, inputs checked before the launch (out: written into
    when given, see `launch_prefill`): the body of `tritonattn::prefill_fwd` and of the SDPA provider."""
    if cu_seqlens_q is None:
        validate_qkv(q, k, v)
    else:
        max_seqlen_q, max_seqlen_k = validate_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                                     seqused_k=seqused_k)
    if seqused_k is not None and cu_seqlens_q is None:
        raise InputError("Expected cu_seqlens_q / cu_seqlens_k with seqused_k: it counts the keys of packed sequences.")
    call = _call(q, k, cu_seqlens_q, max_seqlen_k, alibi_slopes, sinks, seqused_k, softmax_scale, causal, window_left,
                 window_right, softcap, dropout_p, rng_state)
    if cu_seqlens_q is None:
        return launch_prefill(q, k, v, call.options, drop=call.drop, tensors=call.tensors, out=out)
    return launch_varlen(q, k, v, cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous(), max_seqlen_q, max_seqlen_k,
                         call.options, drop=call.drop, tensors=call.tensors, out=out)


def prefill_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                     cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor], max_seqlen_q: int,
                     max_seqlen_k: int, alibi_slopes: Optional[Tensor], sinks: Optional[Tensor],
                     seqused_k: Optional[Tensor], rng_state: Optional[Tensor], softmax_scale: Optional[float],
                     causal: bool, window_left: int, window_right: int, softcap: float, dropout_p: float,
                     deterministic: bool, grads: Optional[Tuple[Tensor, Tensor, Tensor]] = None):
    """The prefill backward of `prefill_forward`'s call: (dq, dk, dv, dsinks or None), written into
    `grads` when given (q's, k's and v's shapes, contiguous last dims); `deterministic` as flash_attn_func's."""
    call = _call(q, k, cu_seqlens_q, max_seqlen_k, alibi_slopes, sinks, seqused_k, softmax_scale, causal, window_left,
                 window_right, softcap, dropout_p, rng_state)
    if cu_seqlens_q is None:
        dq, dk, dv, _, dsinks = launch_backward(dout, q, k, v, out, lse, call.options, grads=grads, drop=call.drop,
                                                tensors=call.tensors, deterministic=deterministic)
    else:
        dq, dk, dv, _, dsinks = launch_varlen_backward(
            dout, q, k, v, out, lse, cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous(), max_seqlen_q, max_seqlen_k,
            call.options, grads=grads, drop=call.drop, tensors=call.tensors)
    return dq, dk, dv, dsinks


@torch.library.custom_op(f"{NAMESPACE}::prefill_fwd", mutates_args=())
def prefill_fwd(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor],
                max_seqlen_q: int, max_seqlen_k: int, alibi_slopes: Optional[Tensor], sinks: Optional[Tensor],
                seqused_k: Optional[Tensor], rng_state: Optional[Tensor], softmax_scale: Optional[float], causal: bool,
                window_left: int, window_right: int, softcap: float, dropout_p: float,
                deterministic: bool) -> Tuple[Tensor, Tensor]:
    out, lse = prefill_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, alibi_slopes, sinks,
                               seqused_k, rng_state, softmax_scale, causal, window_left, window_right, softcap,
                               dropout_p)
    return out.contiguous(), lse  # see [Note] Contiguous outputs


@prefill_fwd.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, alibi_slopes, sinks, seqused_k, rng_state,
      softmax_scale, causal, window_left, window_right, softcap, dropout_p, deterministic):
    return torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty(
        _lse_shape(q, cu_seqlens_q is not None), dtype=torch.float32)


@torch.library.custom_op(f"{NAMESPACE}::prefill_bwd", mutates_args=())
def prefill_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor], max_seqlen_q: int, max_seqlen_k: int,
                alibi_slopes: Optional[Tensor], sinks: Optional[Tensor], seqused_k: Optional[Tensor],
                rng_state: Optional[Tensor], softmax_scale: Optional[float], causal: bool, window_left: int,
                window_right: int, softcap: float, dropout_p: float,
                deterministic: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    dq, dk, dv, dsinks = prefill_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                          max_seqlen_k, alibi_slopes, sinks, seqused_k, rng_state, softmax_scale,
                                          causal, window_left, window_right, softcap, dropout_p, deterministic)
    return dq, dk, dv, dsinks if dsinks is not None else q.new_empty((0,), dtype=torch.float32)


@prefill_bwd.register_fake
def _(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, alibi_slopes, sinks, seqused_k,
      rng_state, softmax_scale, causal, window_left, window_right, softcap, dropout_p, deterministic):
    nheads = q.shape[-2] if sinks is not None else 0
    return (torch.empty_like(q, memory_format=torch.contiguous_format), k.new_empty(k.shape), v.new_empty(v.shape),
            q.new_empty((nheads,), dtype=torch.float32))


def _setup_context(ctx, inputs, output) -> None:
    (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, alibi_slopes, sinks, seqused_k, rng_state,
     *scalars) = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)  # as in eager: softmax_lse takes no gradient
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, sinks, seqused_k, rng_state)
    ctx.lengths = (max_seqlen_q, max_seqlen_k)
    ctx.scalars = scalars


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, sinks, seqused_k, rng_state = ctx.saved_tensors
    dq, dk, dv, dsinks = prefill_bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *ctx.lengths, alibi_slopes,
                                     sinks, seqused_k, rng_state, *ctx.scalars)
    dsinks = dsinks.to(sinks.dtype) if sinks is not None and ctx.needs_input_grad[8] else None
    return dq, dk, dv, None, None, None, None, None, dsinks, None, None, None, None, None, None, None, None, None


prefill_fwd.register_autograd(_backward, setup_context=_setup_context)


def _scalars(window_size, softcap, softmax_scale):
    """flash-attn's scalar arguments as the ops take them, unresolved (the op's body translates them,
    `args.attention_call`): (softmax_scale or None, window_left, window_right, softcap). Checked here,
    where dynamo traces, so that a bad value fails at the call, not inside the graph."""
    left, right = window_pair(window_size)
    return (None if softmax_scale is None else float(softmax_scale)), left, right, softcap_number(softcap)


def rng_input(dropout_p, device) -> Optional[Tensor]:
    """The ops' rng_state input: a fresh draw with dropout (drawn in the graph, so each compiled call draws anew)."""
    return draw_rng_state(device) if dropout_p > 0 else None


def flash_attn_func_traced(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           return_attn_probs, return_softmax_lse, sinks, deterministic=False):
    """flash_attn_func under torch.compile: one `tritonattn::prefill_fwd` node (flash-attn's scalars checked
    here, where dynamo traces; the tensors when it runs, before any launch)."""
    dropout_p = validate_dropout(dropout_p)
    if return_attn_probs and dropout_p > 0:
        raise NotImplementedError("return_attn_probs with dropout (S_dmask, a testing aid) is eager only.")
    scale, left, right, cap = _scalars(window_size, softcap, softmax_scale)
    out, lse = prefill_fwd(q, k, v, None, None, q.shape[1], k.shape[1], alibi_slopes, sinks, None,
                           rng_input(dropout_p, q.device), scale, bool(causal), left, right, cap, dropout_p,
                           bool(deterministic))
    return results(out, lse, None, return_attn_probs, return_softmax_lse)


def flash_attn_varlen_func_traced(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                  softmax_scale, causal, window_size, softcap, alibi_slopes, return_attn_probs,
                                  block_table, return_softmax_lse, sinks, seqused_k=None):
    """flash_attn_varlen_func under torch.compile: one `tritonattn::prefill_fwd` node over the packed
    sequences (max_seqlen_q / max_seqlen_k as the graph's ints), or one `tritonattn::varlen_paged_fwd` node over a
    paged K/V (forward only, as eager)."""
    dropout_p = validate_dropout(dropout_p)
    if return_attn_probs and dropout_p > 0:
        raise NotImplementedError("return_attn_probs with dropout (S_dmask, a testing aid) is eager only.")
    scale, left, right, cap = _scalars(window_size, softcap, softmax_scale)
    if block_table is not None:  # a paged K/V: forward only, as in eager
        if dropout_p:
            raise NotImplementedError("dropout with a paged K/V (block_table) is not supported: dropout is for "
                                      "training, and the paged forward has no backward.")
        out, lse = varlen_paged_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k),
                                    block_table, alibi_slopes, sinks, seqused_k, scale, bool(causal), left, right, cap)
        return results(out, lse, None, return_attn_probs, return_softmax_lse)
    out, lse = prefill_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k), alibi_slopes,
                           sinks, seqused_k, rng_input(dropout_p, q.device), scale, bool(causal), left, right, cap,
                           dropout_p, True)  # packed sequences' backward is atomic-free either way
    return results(out, lse, None, return_attn_probs, return_softmax_lse)


@torch.library.custom_op(f"{NAMESPACE}::varlen_paged_fwd", mutates_args=())
def varlen_paged_fwd(q: Tensor, k_cache: Tensor, v_cache: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                     max_seqlen_q: int, max_seqlen_k: int, block_table: Tensor, alibi_slopes: Optional[Tensor],
                     sinks: Optional[Tensor], seqused_k: Optional[Tensor], softmax_scale: Optional[float], causal: bool,
                     window_left: int, window_right: int, softcap: float) -> Tuple[Tensor, Tensor]:
    out, lse = varlen_paged(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, 0.0,
                            softmax_scale, causal, (window_left, window_right), softcap, alibi_slopes, False,
                            block_table, True, sinks, seqused_k)
    return out.contiguous(), lse  # see [Note] Contiguous outputs


@varlen_paged_fwd.register_fake
def _(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table, alibi_slopes, sinks,
      seqused_k, softmax_scale, causal, window_left, window_right, softcap):
    return torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty(_lse_shape(q, True),
                                                                                   dtype=torch.float32)


def _paged_setup_context(ctx, inputs, output) -> None:
    ctx.mark_non_differentiable(output[1])


def _paged_backward(ctx, dout, dlse):
    raise NotImplementedError(PAGED_VARLEN_NO_BACKWARD)


varlen_paged_fwd.register_autograd(_paged_backward, setup_context=_paged_setup_context)


@torch.library.custom_op(f"{NAMESPACE}::kvcache", mutates_args=("k_cache", "v_cache"))
def kvcache(q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Optional[Tensor], v: Optional[Tensor],
            rotary_cos: Optional[Tensor], rotary_sin: Optional[Tensor], cache_seqlens: Tensor,
            cache_batch_idx: Optional[Tensor], cache_leftpad: Optional[Tensor], block_table: Optional[Tensor],
            alibi_slopes: Optional[Tensor], sinks: Optional[Tensor], softmax_scale: Optional[float], causal: bool,
            window_left: int, window_right: int, softcap: float, rotary_interleaved: bool, num_splits: int,
            return_lse: bool) -> Tuple[Tensor, Tensor]:
    with uncached_scratch():
        result = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                                         cache_batch_idx, cache_leftpad, block_table, softmax_scale, causal,
                                         (window_left, window_right), softcap, rotary_interleaved, alibi_slopes,
                                         num_splits, return_lse, sinks=sinks)
    out, lse = result if return_lse else (result, q.new_empty((0,), dtype=torch.float32))
    return out.contiguous(), lse  # see [Note] Contiguous outputs


@kvcache.register_fake
def _(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad, block_table,
      alibi_slopes, sinks, softmax_scale, causal, window_left, window_right, softcap, rotary_interleaved, num_splits,
      return_lse):
    batch, seqlen_q, nheads, head_dim = q.shape
    lse_shape = (batch, nheads, seqlen_q) if return_lse else (0,)
    return q.new_empty((batch, seqlen_q, nheads, head_dim)), q.new_empty(lse_shape, dtype=torch.float32)


def flash_attn_with_kvcache_traced(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                                   cache_leftpad, block_table, softmax_scale, causal, window_size, softcap,
                                   rotary_interleaved, alibi_slopes, num_splits, return_softmax_lse, sinks):
    """flash_attn_with_kvcache under torch.compile: one `tritonattn::kvcache` node, which appends k / v into
    the caches in place (a declared mutation of k_cache and v_cache) and attends, with every argument of
    the eager function. Lengths given as an int (or None: every cache full) become a device tensor in the
    graph; pass a tensor to advance them on the device without recompiling."""
    capacity = k_cache.shape[1] * (1 if block_table is None else block_table.shape[1])
    if not isinstance(cache_seqlens, torch.Tensor):
        if cache_seqlens is None and (k is not None or v is not None):
            raise InputError("Expected cache_seqlens with new k and v: the append goes at each request's length "
                             "(flash-attn's rule); None means every cache is full.")
        length = capacity if cache_seqlens is None else cache_seqlens
        cache_seqlens = torch.full((q.shape[0],), length, dtype=torch.int32, device=q.device)
    scale, left, right, cap = _scalars(window_size, softcap, softmax_scale)
    out, lse = kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
                       block_table, alibi_slopes, sinks, scale, bool(causal), left, right, cap,
                       bool(rotary_interleaved), int(num_splits), bool(return_softmax_lse))
    return (out, lse) if return_softmax_lse else out


TRACED["flash_attn_func"] = flash_attn_func_traced
TRACED["flash_attn_varlen_func"] = flash_attn_varlen_func_traced
TRACED["flash_attn_with_kvcache"] = flash_attn_with_kvcache_traced
