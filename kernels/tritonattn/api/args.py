"""The one translation of flash-attn's arguments into what the launch layer takes.

Every entry point calls `attention_call` once, before any launch: flash_attn_func and its packed forms,
flash_attn_varlen_func (packed or paged K/V), flash_attn_with_kvcache (and KVCache / PagedKVCache through
it), flash-attn's primitives (`_flash_attn_forward`, ...), and the custom ops torch.compile traces (the
SDPA provider runs their bodies). It returns an `AttnCall`:

- `options`: the frozen `AttnOptions` (config/options.py): what is compiled, what is passed;
- `tensors`: the kernel arguments of the call's per-call tensors (ALiBi slopes, sinks, seqused_k, an FP8
  cache's descales and its counter of clamped values), each validated here; {} without them;
- `drop`: the `Dropout` (probability and the Philox (seed, salt)), None without dropout.

flash-attn's rules live here and only here: a window side that is negative or reaches seqlen_k is
unbounded, causal means right = 0, (-1, 0) is causal, softcap <= 0 is off, softmax_scale None is
head_dim ** -0.5. A call without any of them (the decode loop's case) costs one cache lookup.
"""

from __future__ import annotations

import functools
from typing import Any, Dict, NamedTuple, Optional

import torch

from ..config.options import AttnOptions, Dropout, attn_options, softcap_number, window_pair
from ..errors import InputError
from .validate import (
    validate_alibi_slopes,
    validate_descale,
    validate_dropout,
    validate_saturated,
    validate_seqused_k,
    validate_sinks,
)
from .validate_tree import check_tree_call, validate_tree_mask


class AttnCall(NamedTuple):
    """What one call computes: its options, its per-call tensors as kernel arguments, its dropout."""

    options: AttnOptions
    tensors: Dict[str, Any]
    drop: Optional[Dropout]


_PLAIN = (float, int, type(None))


@functools.lru_cache(maxsize=1024)
def _plain_call(head_dim: int, softmax_scale: Optional[float], causal: bool) -> AttnCall:
    return AttnCall(attn_options(head_dim, softmax_scale, causal), {}, None)


def plain_call(head_dim: int, softmax_scale=None, causal=False) -> AttnCall:
    """`attention_call` of a call with no variant, no per-call tensor and no dropout (every other argument
    at its default), cached by value: what a decode step costs on the host."""
    if type(softmax_scale) in _PLAIN:
        return _plain_call(int(head_dim), softmax_scale, bool(causal))
    return AttnCall(attn_options(head_dim, softmax_scale, causal), {}, None)


def attention_call(head_dim: int, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                   alibi_slopes: Optional[torch.Tensor] = None, sinks: Optional[torch.Tensor] = None,
                   seqused_k: Optional[torch.Tensor] = None, dropout_p=0.0, rng_state: Optional[torch.Tensor] = None,
                   *, seqlen_k: int, batch: int, nheads: int, device: torch.device, kv_fp8: bool = False,
                   k_descale=None, v_descale=None, nheads_k: int = 0, kv_saturated=None, q_fp8: bool = False,
                   q_descale=None, tree_mask=None, tree_cu_seqlens=None, seqlen_q: int = 0) -> AttnCall:
    """flash-attn's arguments (and ours: sinks, seqused_k) as an `AttnCall`, everything checked before any
    launch. seqlen_k decides which window sides are unbounded (packed sequences: max_seqlen_k; a cache:
    its capacity); batch, nheads and device are what the per-call tensors must match. rng_state: the
    forward's (seed, salt) for a backward or a replay of its dropout, None for a fresh draw. kv_fp8: the
    KV cache is FP8, k_descale / v_descale its descales (`validate_descale`, per (batch, nheads_k) or
    per tensor; both required), kv_saturated its optional counter of clamped appended values
    (`validate_saturated`); descales or a counter without an FP8 cache are refused. q_fp8: the FP8 forward
    (q, k, v in e4m3, kv_fp8 too), whose q_descale is required like k's and v's. tree_mask (with
    tree_cu_seqlens for the packed form, seqlen_q the query tokens): a verify step's draft tree
    (`validate_tree_mask`, [Note] Tree masks in api/validate_tree.py)."""
    if not kv_fp8 and (k_descale is not None or v_descale is not None or kv_saturated is not None):
        raise InputError("Expected k_descale / v_descale / kv_saturated only with FP8 keys and values (a "
                         "float8_e4m3fn KV cache, or e4m3 q, k, v); 16-bit inputs hold their values unscaled.")
    if q_descale is not None and not q_fp8:
        raise InputError("Expected q_descale only with an e4m3 q (the FP8 forward: q, k, v in float8_e4m3fn).")
    if tree_cu_seqlens is not None and tree_mask is None:
        raise InputError("Expected tree_cu_seqlens only with a packed tree_mask.")
    check_tree_call(tree_mask, causal, window_size, alibi_slopes, rotary=False)
    if (not kv_fp8 and tree_mask is None and alibi_slopes is None and sinks is None and seqused_k is None
            and type(softmax_scale) in _PLAIN
            and type(window_size) is tuple and window_size == (-1, -1) and type(softcap) in _PLAIN and not softcap
            and type(dropout_p) in (float, int) and dropout_p == 0):
        return _plain_call(int(head_dim), softmax_scale, bool(causal))
    dropout_p = validate_dropout(dropout_p)
    options = attn_options(head_dim, softmax_scale, alibi=alibi_slopes is not None, sinks=sinks is not None,
                           seqused_k=seqused_k is not None, kv_fp8=kv_fp8, tree=tree_mask is not None,
                           **resolve_variants(window_size, softcap, causal, seqlen_k))
    tensors = {}
    if options.alibi:
        slopes = validate_alibi_slopes(alibi_slopes, batch, nheads, device)
        tensors.update(Alibi=slopes, stride_alibi_b=slopes.stride(0) if slopes.dim() == 2 else 0)
    if options.sinks:
        validate_sinks(sinks, nheads, device)
        tensors["Sinks"] = sinks.detach().to(torch.float32).contiguous()
    if options.seqused_k:
        tensors["Seqused_k"] = validate_seqused_k(seqused_k, batch, device)
    if kv_fp8:  # (batch, nheads_k) float32 views; a per-tensor scalar has strides 0
        k_scales = validate_descale("k_descale", k_descale, batch, nheads_k, device)
        v_scales = validate_descale("v_descale", v_descale, batch, nheads_k, device)
        tensors.update(K_descale=k_scales, stride_kds=k_scales.stride(0), stride_kdh=k_scales.stride(1),
                       V_descale=v_scales, stride_vds=v_scales.stride(0), stride_vdh=v_scales.stride(1))
        if kv_saturated is not None:
            tensors["Saturated"] = validate_saturated(kv_saturated, batch, nheads_k, device)
        if q_fp8:
            q_scales = validate_descale("q_descale", q_descale, batch, nheads_k, device)
            tensors.update(Q_descale=q_scales, stride_qds=q_scales.stride(0), stride_qdh=q_scales.stride(1))
    if options.tree:
        tensors.update(validate_tree_mask(tree_mask, tree_cu_seqlens, batch, seqlen_q, device))
    return AttnCall(options, tensors, dropout(dropout_p, device, rng_state))


def resolve_variants(window_size, softcap, causal: bool, seqlen_k: int) -> dict:
    """flash-attn's window_size and softcap as `attn_options` keywords (causal, window, softcap),
    checked before any launch: a negative side is unbounded, causal means right = 0, and a side
    reaching seqlen_k or past it is unbounded, so (-1, -1) is no window and (-1, 0) is causal;
    softcap <= 0 is off."""
    if type(window_size) is not tuple or window_size != (-1, -1):
        left, right = window_pair(window_size)
        left = -1 if left < 0 or left >= seqlen_k else left
        right = -1 if right < 0 or right >= seqlen_k else right
        window_size = (left, right)
    return dict(causal=bool(causal), window=window_size, softcap=max(softcap_number(softcap), 0.0))


def dropout(p: float, device: torch.device, rng_state: Optional[torch.Tensor] = None) -> Optional[Dropout]:
    """A validated `Dropout` (None for p == 0). Without rng_state, (seed, salt) are drawn from torch's
    generator of `device` on that device: `torch.manual_seed` reproduces the mask, nothing syncs, and a
    CUDA graph replay draws fresh bits (a graph-safe draw)."""
    if p == 0.0:
        return None
    if round((1.0 - p) * 65536) == 0:
        raise InputError(f"Expected dropout_p < 1 - 2^-17 (the keep rate is drawn in steps of 2^-16), got {p}.")
    if rng_state is None:
        rng_state = draw_rng_state(device)
    elif not (isinstance(rng_state, torch.Tensor) and rng_state.dtype == torch.int64 and rng_state.numel() == 2
              and rng_state.device == device):
        got = (rng_state.dtype, tuple(rng_state.shape), rng_state.device) if isinstance(rng_state, torch.Tensor) else (
            type(rng_state).__name__)
        raise InputError(f"Expected rng_state to be the forward's int64 (2,) tensor on {device}, got {got}.")
    return Dropout(p, rng_state.contiguous())


def draw_rng_state(device: torch.device) -> torch.Tensor:
    """A fresh dropout (seed, salt): int64 (2,) drawn from torch's generator of `device`, on that device (no
    sync; a CUDA graph draws anew on each replay)."""
    return torch.randint(0, 2**62, (2,), dtype=torch.int64, device=device)
