"""flash-attn's `flash_attn.flash_attn_interface`: the public functions, and the forward / backward
primitives that ring-attention and context-parallel libraries build on, with flash-attn 2's argument
lists.

A ring step attends a block of queries to one block of keys (`_flash_attn_forward`), merges the
partial results of the blocks by their log-sum-exp (`merge_attention`), and in the backward runs
each block's gradients against the merged output and LSE (`_flash_attn_backward`, which writes into
the caller's dq / dk / dv buffers so that a ring can accumulate in place).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..errors import InputError
from ..launch.backward import launch_backward, launch_varlen_backward
from ..launch.prefill import dropout_probs, launch_prefill, launch_varlen
from .args import attention_call
from .prefill import flash_attn_varlen_func
from .validate import validate_dropout, validate_qkv, validate_tensor, validate_varlen


def _call(q, softmax_scale, causal, window_size_left, window_size_right, softcap, alibi_slopes, dropout_p,
          seqlen_k, batch, rng_state=None, seqused_k=None):
    """The primitives' arguments through the one translation (`args.attention_call`); rng_state None: a fresh draw."""
    return attention_call(q.shape[-1], softmax_scale, causal, (window_size_left, window_size_right), softcap,
                          alibi_slopes, None, seqused_k, dropout_p, rng_state, seqlen_k=seqlen_k, batch=batch,
                          nheads=q.shape[-2], device=q.device)


def _rng_state(drop, device) -> torch.Tensor:
    """flash-attn's rng_state: our (seed, salt) pair with dropout; zeros without (nothing is drawn)."""
    return drop.rng_state if drop is not None else torch.zeros(2, dtype=torch.int64, device=device)


def _backward_inputs(dout, q, out, softmax_lse, lse_shape) -> torch.Tensor:
    """Checks the backward's dout, out and softmax_lse against q; returns softmax_lse contiguous (the
    kernels read it densely; a ring passes views such as lse.transpose(...))."""
    for name, t in (("dout", dout), ("out", out)):
        validate_tensor(name, t, q.dim(), "like q")
        if t.shape != q.shape or t.dtype != q.dtype or t.device != q.device:
            raise InputError(f"Expected {name} of q's shape {tuple(q.shape)}, {q.dtype} on {q.device}, got "
                             f"{tuple(t.shape)}, {t.dtype} on {t.device}.")
    if not isinstance(softmax_lse, torch.Tensor):
        raise InputError(f"Expected softmax_lse to be a torch.Tensor, got {type(softmax_lse).__name__}.")
    if tuple(softmax_lse.shape) != tuple(lse_shape) or softmax_lse.dtype != torch.float32 or (
            softmax_lse.device != q.device):
        raise InputError(f"Expected softmax_lse of shape {tuple(lse_shape)}, float32 on {q.device}, got "
                         f"{tuple(softmax_lse.shape)}, {softmax_lse.dtype} on {softmax_lse.device}.")
    return softmax_lse.contiguous()


def _check_grad_buffers(grads, tensors) -> Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """dq, dk, dv given by the caller: each like its input (shape, dtype, device), last dim contiguous;
    None where the caller passed None (then freshly allocated and returned only through the buffers
    given, as flash-attn)."""
    if all(g is None for g in grads):
        return None
    if any(g is None for g in grads):
        raise InputError("Expected dq, dk and dv all given or all None.")
    for name, g, t in zip(("dq", "dk", "dv"), grads, tensors):
        validate_tensor(name, g, t.dim(), "like its input")
        if g.shape != t.shape or g.dtype != t.dtype or g.device != t.device:
            raise InputError(f"Expected {name} of shape {tuple(t.shape)}, {t.dtype} on {t.device}, got "
                             f"{tuple(g.shape)}, {g.dtype} on {g.device}.")
    return tuple(grads)


def _flash_attn_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float, softmax_scale: float,
                        causal: bool, window_size_left: int = -1, window_size_right: int = -1, softcap: float = 0.0,
                        alibi_slopes: Optional[torch.Tensor] = None, return_softmax: bool = False):
    """One attention forward, no autograd: (out, softmax_lse, S_dmask, rng_state) as flash-attn's.

    q (batch, seqlen_q, nheads, headdim), k / v (batch, seqlen_k, nheads_k, headdim); softmax_lse
    (batch, nheads, seqlen_q) float32, +inf for a row that sees no key (its out is zeros), which
    `merge_attention` treats as an empty part. S_dmask is flash_attn_func's (with dropout and
    return_softmax, else None); rng_state is the dropout bits' (seed, salt) pair, which the backward
    takes back to regenerate the mask.
    """
    validate_qkv(q, k, v)
    call = _call(q, softmax_scale, causal, window_size_left, window_size_right, softcap, alibi_slopes, dropout_p,
                 k.shape[1], q.shape[0])
    out, lse = launch_prefill(q, k, v, call.options, drop=call.drop, tensors=call.tensors)
    probs = None
    if return_softmax and call.drop is not None:
        probs = dropout_probs(q, k, call.options, call.drop, tensors=call.tensors)
    return out, lse, probs, _rng_state(call.drop, q.device)


def _flash_attn_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                         softmax_lse: torch.Tensor, dq: Optional[torch.Tensor], dk: Optional[torch.Tensor],
                         dv: Optional[torch.Tensor], dropout_p: float, softmax_scale: float, causal: bool,
                         window_size_left: int = -1, window_size_right: int = -1, softcap: float = 0.0,
                         alibi_slopes: Optional[torch.Tensor] = None, deterministic: bool = False,
                         rng_state: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The gradients of one attention block, written into dq, dk, dv (overwritten, not accumulated);
    returns softmax_d = rowsum(dout * out) (batch, nheads, seqlen_q) float32 (flash-attn rounds
    seqlen_q up in its copy). softmax_lse may be any view (a ring's transposed LSE): it is made dense.

    `out` and `softmax_lse` may be those of a larger attention this block is part of (a ring's merged
    result): the block's probabilities are exp(scores - softmax_lse), which is what makes the
    per-block gradients sum to the whole's. `deterministic` as in flash_attn_func: False lets Hopper's
    fused backward sum dq by atomic adds in any order. With dropout_p > 0, rng_state must be the forward's.
    """
    validate_qkv(q, k, v)
    call = _call(q, softmax_scale, causal, window_size_left, window_size_right, softcap, alibi_slopes, dropout_p,
                 k.shape[1], q.shape[0], _forward_rng(validate_dropout(dropout_p), rng_state))
    softmax_lse = _backward_inputs(dout, q, out, softmax_lse, (q.shape[0], q.shape[2], q.shape[1]))
    grads = _check_grad_buffers((dq, dk, dv), (q, k, v))
    delta = launch_backward(dout, q, k, v, out, softmax_lse, call.options, grads=grads, drop=call.drop,
                            tensors=call.tensors, deterministic=deterministic)[3]
    return delta


def _forward_rng(dropout_p, rng_state):
    """The backward's rng_state: required with dropout (a fresh draw would be another mask)."""
    if dropout_p and rng_state is None:
        raise InputError("Expected the forward's rng_state with dropout_p > 0: the backward regenerates its mask.")
    return rng_state


def _flash_attn_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                               softmax_scale, causal, window_size_left=-1, window_size_right=-1, softcap=0.0,
                               alibi_slopes=None, return_softmax=False, block_table=None, leftpad_k=None,
                               seqused_k=None, zero_tensors=False, num_splits=0):
    """`_flash_attn_forward` over packed sequences (flash_attn_varlen_func's layout): (out,
    softmax_lse (nheads, total_q), S_dmask, rng_state); k and v paged pools with block_table, as
    flash_attn_varlen_func takes them. seqused_k: as flash_attn_varlen_func's (each sequence attends to the
    first seqused_k[b] keys of its span). leftpad_k is not implemented (NotImplementedError unless None);
    num_splits and zero_tensors change nothing."""
    if leftpad_k is not None:
        raise NotImplementedError("leftpad_k is not implemented; pass None (flash_attn_with_kvcache takes "
                                  "cache_leftpad).")
    if block_table is not None:
        with torch.no_grad():
            out, lse = flash_attn_varlen_func(
                q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
                (window_size_left, window_size_right), softcap, alibi_slopes, block_table=block_table,
                return_softmax_lse=True, seqused_k=seqused_k)
        return out, lse, None, _rng_state(None, q.device)
    max_seqlen_q, max_seqlen_k = validate_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                                 seqused_k=seqused_k)
    call = _call(q, softmax_scale, causal, window_size_left, window_size_right, softcap, alibi_slopes, dropout_p,
                 max_seqlen_k, cu_seqlens_q.numel() - 1, seqused_k=seqused_k)
    lengths = (cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous(), max_seqlen_q, max_seqlen_k)
    out, lse = launch_varlen(q, k, v, *lengths, call.options, drop=call.drop, tensors=call.tensors)
    probs = None
    if return_softmax and call.drop is not None:
        probs = dropout_probs(q, k, call.options, call.drop, lengths, call.tensors)
    return out, lse, probs, _rng_state(call.drop, q.device)


def _flash_attn_varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                max_seqlen_k, dropout_p, softmax_scale, causal, window_size_left=-1,
                                window_size_right=-1, softcap=0.0, alibi_slopes=None, deterministic=False,
                                rng_state=None, zero_tensors=False, *, seqused_k=None):
    """`_flash_attn_backward` over packed sequences; returns softmax_d (nheads, total_q) (flash-attn pads
    its copy per sequence; ours is unpadded). seqused_k (ours, keyword only): the forward's."""
    max_seqlen_q, max_seqlen_k = validate_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                                 seqused_k=seqused_k)
    call = _call(q, softmax_scale, causal, window_size_left, window_size_right, softcap, alibi_slopes, dropout_p,
                 max_seqlen_k, cu_seqlens_q.numel() - 1, _forward_rng(validate_dropout(dropout_p), rng_state),
                 seqused_k)
    softmax_lse = _backward_inputs(dout, q, out, softmax_lse, (q.shape[1], q.shape[0]))
    grads = _check_grad_buffers((dq, dk, dv), (q, k, v))
    cu_q, cu_k = cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous()
    delta = launch_varlen_backward(dout, q, k, v, out, softmax_lse, cu_q, cu_k, max_seqlen_q, max_seqlen_k,
                                   call.options, grads=grads, drop=call.drop, tensors=call.tensors)[3]
    return delta


def merge_attention(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                    lse_b: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """The attention of queries over two disjoint key sets, from each set's (out, lse).

    out (batch, seqlen_q, nheads, headdim), lse (batch, nheads, seqlen_q) float32 as
    `_flash_attn_forward` returns them (or the packed layouts: out (total_q, nheads, headdim), lse
    (nheads, total_q)). lse = log(exp(lse_a) + exp(lse_b)); out = the two outs weighted by
    exp(lse_x - lse). A part with lse +inf saw no key and weighs nothing; if both did, out is zeros
    and lse +inf. Computed in float32, out returned in out_a's dtype.
    """
    if out_a.shape != out_b.shape or lse_a.shape != lse_b.shape:
        raise InputError(f"Expected two parts of the same shape, got out {tuple(out_a.shape)} and "
                         f"{tuple(out_b.shape)}, lse {tuple(lse_a.shape)} and {tuple(lse_b.shape)}.")
    a = torch.where(torch.isposinf(lse_a), float("-inf"), lse_a.float())  # +inf: an empty part, weight 0
    b = torch.where(torch.isposinf(lse_b), float("-inf"), lse_b.float())
    top = torch.maximum(a, b)
    safe = torch.where(torch.isneginf(top), 0.0, top)
    total = torch.exp(a - safe) + torch.exp(b - safe)
    lse = torch.where(total > 0, safe + torch.log(total), float("inf"))
    weight_a, weight_b = torch.exp(a - lse), torch.exp(b - lse)  # 0 where lse is +inf

    def per_row(w):  # lse layout -> out layout: (b, h, m) -> (b, m, h, 1); (h, total) -> (total, h, 1)
        return w.transpose(-1, -2).unsqueeze(-1)

    out = per_row(weight_a) * out_a.float() + per_row(weight_b) * out_b.float()
    return out.to(out_a.dtype), lse
