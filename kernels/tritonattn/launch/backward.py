"""The prefill backward's launches (dense and packed): the preprocessing, dK/dV and dQ kernels of
jit/prefill_bwd.py, on validated inputs with the forward's options, per-call tensors and dropout."""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton

from ..config.hardware import Target, device_target
from ..config.options import AttnOptions, Dropout
from ..config.tables import (
    BWD_PREPROCESS_BLOCK_M,
    AttnConfig,
    prefill_bwd_config,
    prefill_bwd_sm90_config,
    prefill_bwd_unsupported,
)
from ..jit.prefill_bwd import bwd_dkdv_kernel, bwd_dq_kernel, bwd_preprocess_kernel
from .fast import LaunchCache
from .operands import aligned_operands, ensure_tma_allocator, on_device, row_strides, tma_planned, tma_usable
from .prefill import dropout_args, varlen_args

_preprocess_launcher = LaunchCache(bwd_preprocess_kernel)


_dkdv_launcher = LaunchCache(bwd_dkdv_kernel)


_dq_launcher = LaunchCache(bwd_dq_kernel)


def _backward_configs(options: AttnOptions, dtype: torch.dtype, target: Optional[Target],
                      configs: Optional[Tuple[AttnConfig, AttnConfig]]) -> Tuple[AttnConfig, AttnConfig]:
    """The backward's (dK/dV, dQ) configs; raises NotImplementedError, before any launch, where no tile fits."""
    reason = prefill_bwd_unsupported(options.head_dim_pad, dtype, target)
    if reason is not None:
        raise NotImplementedError(f"Cannot run the attention backward here: {reason}.")
    return configs if configs is not None else prefill_bwd_config(options.head_dim_pad, dtype, options.causal, target)


def _launch_backward_kernels(dout, q, k, v, out, lse, dq, dk, dv, delta, batch, seqlen_q, seqlen_k,
                             options: AttnOptions, configs, varlen, drop: Optional[Dropout] = None,
                             tensors: Optional[dict] = None) -> Optional[torch.Tensor]:
    """Launch the three backward kernels (`configs` from _backward_configs); `varlen` as in launch_forward;
    `drop` the forward's dropout, `tensors` its per-call tensors' kernel arguments (`AttnCall.tensors`).
    Returns dsinks (nheads,) float32 with sinks (the preprocessing's per-block shares summed in a fixed order:
    deterministic), else None."""
    nheads, nheads_k = q.shape[-2], k.shape[-2]
    target = device_target(q.device)
    cfg_kv, cfg_q = configs
    use_tma = tma_usable(cfg_kv.use_tma, target, q, k, v, dout)
    if use_tma:
        ensure_tma_allocator()
    packed = bool(varlen)
    varlen_pre = {key: val for key, val in varlen.items() if key != "Cu_seqlens_k"}  # preprocess reads no keys
    q_s, k_s, v_s, do_s = (row_strides(t, packed) for t in (q, k, v, dout))
    tensors = tensors or {}
    attention = dict(**options.runtime, **options.constexprs, USE_TMA=use_tma, **varlen, **dropout_args(drop),
                     **tensors)
    device_index = q.device.index if q.device.index is not None else 0
    with on_device(q):
        dsinks_part = _preprocess(out, dout, delta, lse, batch, seqlen_q, options, packed, varlen_pre, tensors)
        _dkdv_launcher(
            None, (triton.cdiv(seqlen_k, cfg_kv.block_n), batch * nheads_k, 1),
            (q, k, v, dout, lse, delta, dk, dv,
             *q_s, *k_s, *v_s, *do_s, *row_strides(dk, packed), *row_strides(dv, packed),
             nheads, seqlen_q, seqlen_k, nheads // nheads_k),
            cfg_kv.num_warps, cfg_kv.num_stages,
            dict(BLOCK_M=cfg_kv.block_m, BLOCK_N=cfg_kv.block_n, **attention), device_index,
        )
        _dq_launcher(
            None, (triton.cdiv(seqlen_q, cfg_q.block_m), batch * nheads, 1),
            (q, k, v, dout, lse, delta, dq,
             *q_s, *k_s, *v_s, *do_s, *row_strides(dq, packed), nheads, seqlen_q, seqlen_k, nheads // nheads_k),
            cfg_q.num_warps, cfg_q.num_stages,
            dict(BLOCK_M=cfg_q.block_m, BLOCK_N=cfg_q.block_n, **attention), device_index,
        )
    return None if dsinks_part is None else dsinks_part.view(-1, batch, nheads).sum((0, 1))


def _preprocess(out, dout, delta, lse, batch, seqlen_q, options: AttnOptions, packed: bool, varlen: dict,
                tensors: dict) -> Optional[torch.Tensor]:
    """Launch the preprocessing kernel: delta = rowsum(dout * out); with sinks also each program's share of
    dsinks, returned as a (programs, batch * nheads) float32 tensor (else None)."""
    nheads = out.shape[-2]
    pre_grid = (triton.cdiv(seqlen_q, BWD_PREPROCESS_BLOCK_M), batch * nheads, 1)
    dsinks_part, sinks_args = None, {}
    if options.sinks:  # one share of dsinks per preprocessing program, zero where a program exits early
        dsinks_part = torch.zeros(pre_grid[:2], dtype=torch.float32, device=out.device)
        sinks_args = dict(Lse=lse, Sinks=tensors["Sinks"], Dsinks_part=dsinks_part, HAS_SINKS=True)
    _preprocess_launcher(  # Triton's default 4 warps and 3 stages
        None, pre_grid,
        (out, dout, delta, *row_strides(out, packed), *row_strides(dout, packed), nheads, seqlen_q), 4, 3,
        dict(**options.tile, BLOCK_M=BWD_PREPROCESS_BLOCK_M, **varlen, **sinks_args),
        out.device.index if out.device.index is not None else 0,
    )
    return dsinks_part


def _launch_sm90_backward(dout, q, k, v, out, lse, dq, dk, dv, delta, options: AttnOptions, config: AttnConfig,
                          deterministic: bool) -> None:
    """The fused Hopper backward (launch/sm90.py `backward`) after the preprocessing; dQ is accumulated in
    float32 by atomic adds (in key-block order if `deterministic`) and cast into dq."""
    from .sm90 import backward as sm90_backward  # Gluon, imported only where it runs

    ensure_tma_allocator()
    with on_device(q):
        _preprocess(out, dout, delta, lse, q.shape[0], q.shape[1], options, False, {}, {})
        dq.copy_(sm90_backward(dout, q, k, v, lse, delta, dk, dv, options, config, deterministic))


def launch_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    options: AttnOptions,
    configs: Optional[Tuple[AttnConfig, AttnConfig]] = None,
    grads: Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None,
    drop: Optional[Dropout] = None,
    tensors: Optional[dict] = None,
    deterministic: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """Launch the backward kernels (of a forward that ran with dropout `drop` and the tensors'
    tensors `tensors`); returns (dq, dk, dv) shaped like (q, k, v), written into `grads` when given
    (validated buffers with a contiguous last dim), delta = rowsum(dout * out) (batch, nheads,
    seqlen_q) float32, and dsinks (nheads,) float32 with sinks (else None).

    On Hopper, where `prefill_bwd_sm90_config` admits the call (TRITONATTN_SM90_BWD=1) and `configs` is not
    given, the fused backward runs: its dQ is summed by atomic adds, so its last bits vary run to run, unless
    `deterministic` orders the adds ([Note] Deterministic dQ in jit/sm90_bwd.py). The portable kernels use no
    atomics: bit-identical run to run either way."""
    batch, seqlen_q, nheads, _ = q.shape
    seqlen_k = k.shape[1]
    target = device_target(q.device)
    fused = None
    if configs is None and drop is None:
        fused = prefill_bwd_sm90_config(options, q.dtype, seqlen_k, target)
    configs = _backward_configs(options, q.dtype, target, configs)
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    planned = fused is not None or tma_planned(configs[0].use_tma, target, q.dtype)
    dout, q, k, v, out = aligned_operands(planned, dout, q, k, v, out)
    if fused is not None and not tma_usable(True, target, q, k, v, dout):
        fused = None

    dq, dk, dv = grads if grads is not None else _empty_grads(q, k, v)
    delta = torch.empty((batch, nheads, seqlen_q), dtype=torch.float32, device=q.device)
    if seqlen_k > 0 and (seqlen_q == 0 or batch == 0):
        dk.zero_()
        dv.zero_()
    if dq.numel() == 0 or dk.numel() == 0:
        dq.zero_()
        delta.zero_()
        return dq, dk, dv, delta, _no_dsinks(options, nheads, q.device)
    if fused is not None:
        _launch_sm90_backward(dout, q, k, v, out, lse, dq, dk, dv, delta, options, fused, deterministic)
        return dq, dk, dv, delta, None
    dsinks = _launch_backward_kernels(dout, q, k, v, out, lse, dq, dk, dv, delta, batch, seqlen_q, seqlen_k, options,
                                      configs, {}, drop, tensors)
    return dq, dk, dv, delta, dsinks


def _no_dsinks(options: AttnOptions, nheads: int, device: torch.device) -> Optional[torch.Tensor]:
    """dsinks of a backward with no launch: zeros (the output is empty or zeros, so delta is 0)."""
    return torch.zeros(nheads, dtype=torch.float32, device=device) if options.sinks else None


def _empty_grads(q, k, v) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            torch.empty(k.shape, dtype=k.dtype, device=k.device), torch.empty(v.shape, dtype=v.dtype, device=v.device))


def launch_varlen_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    options: AttnOptions,
    configs: Optional[Tuple[AttnConfig, AttnConfig]] = None,
    grads: Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None,
    drop: Optional[Dropout] = None,
    tensors: Optional[dict] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """Launch the backward kernels in packed mode; returns (dq, dk, dv, delta, dsinks) as
    launch_backward, delta (nheads, total_q)."""
    total_q, nheads, _ = q.shape
    batch = cu_seqlens_q.numel() - 1
    target = device_target(q.device)
    configs = _backward_configs(options, q.dtype, target, configs)
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    dout, q, k, v, out = aligned_operands(tma_planned(configs[0].use_tma, target, q.dtype), dout, q, k, v, out)

    dq, dk, dv = grads if grads is not None else _empty_grads(q, k, v)
    delta = torch.empty((nheads, total_q), dtype=torch.float32, device=q.device)
    if dq.numel() == 0 or dk.numel() == 0 or batch == 0 or max_seqlen_q == 0 or max_seqlen_k == 0:
        dq.zero_()  # no query or no key anywhere: every gradient is 0
        dk.zero_()
        dv.zero_()
        delta.zero_()
        return dq, dk, dv, delta, _no_dsinks(options, nheads, q.device)
    if options.seqused_k:  # keys past a sequence's seqused_k get no program: their gradient is 0
        dk.zero_()
        dv.zero_()
    dsinks = _launch_backward_kernels(dout, q, k, v, out, lse, dq, dk, dv, delta, batch, max_seqlen_q, max_seqlen_k,
                                      options, configs, varlen_args(cu_seqlens_q, cu_seqlens_k, total_q), drop, tensors)
    return dq, dk, dv, delta, dsinks
