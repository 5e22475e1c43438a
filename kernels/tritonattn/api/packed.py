"""flash-attn's packed variants: the same functions over a fused QKV or KV tensor (views, no copy)."""

from __future__ import annotations

from typing import Tuple

import torch

from ..errors import InputError
from .prefill import flash_attn_func, flash_attn_varlen_func
from .validate import validate_tensor


# ============================================================================================
# Packed variants (flash-attn 2's signatures)
# ============================================================================================
def _unpack(name: str, packed: torch.Tensor, ndim: int, count: int, layout: str) -> Tuple[torch.Tensor, ...]:
    """The `count` tensors stacked along dim -3 of `packed`, as views (no copy): the kernels take
    any strides, and autograd assembles the packed gradient from theirs."""
    validate_tensor(name, packed, ndim, layout)
    if packed.shape[-3] != count:
        raise InputError(f"Expected {name} of shape {layout}, got {tuple(packed.shape)}.")
    return packed.unbind(-3)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                              return_softmax_lse=False, sinks=None):
    """flash_attn_func over q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], with qkv
    (batch, seqlen, 3, nheads, headdim) as a fused QKV projection gives it (MHA). Arguments and
    results as in flash_attn_func; the gradient is qkv-shaped."""
    q, k, v = _unpack("qkv", qkv, 5, 3, "(batch, seqlen, 3, nheads, headdim)")
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs, return_softmax_lse=return_softmax_lse, sinks=sinks)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                             return_softmax_lse=False, sinks=None):
    """flash_attn_func over k, v = kv[:, :, 0], kv[:, :, 1], with kv (batch, seqlen_k, 2, nheads_k,
    headdim) (MHA/GQA/MQA). Arguments and results as in flash_attn_func; the gradient is kv-shaped."""
    k, v = _unpack("kv", kv, 5, 2, "(batch, seqlen_k, 2, nheads_k, headdim)")
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs, return_softmax_lse=return_softmax_lse, sinks=sinks)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False, *, return_softmax_lse=False, sinks=None):
    """flash_attn_varlen_func over q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2], with qkv
    (total, 3, nheads, headdim) and one cu_seqlens / max_seqlen for queries and keys. Arguments and
    results as in flash_attn_varlen_func."""
    q, k, v = _unpack("qkv", qkv, 4, 3, "(total, 3, nheads, headdim)")
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p, softmax_scale,
                                  causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs,
                                  return_softmax_lse=return_softmax_lse, sinks=sinks)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                                    return_softmax_lse=False, sinks=None):
    """flash_attn_varlen_func over k, v = kv[:, 0], kv[:, 1], with kv (total_k, 2, nheads_k, headdim).
    Arguments and results as in flash_attn_varlen_func."""
    k, v = _unpack("kv", kv, 4, 2, "(total_k, 2, nheads_k, headdim)")
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                  softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs, return_softmax_lse=return_softmax_lse, sinks=sinks)
