"""The error rule: how close a kernel's result must be to the reference. One rule, used by the tests,
the notebooks, the serving engine's checks and the benchmarks' correctness checks.

flash-attn's rule: a float16 / bfloat16 output passes when its relative error against the fp32 (or
fp64) reference is at most `factor` times the error PyTorch's own eager attention makes in the same
dtype -- FWD_FACTOR = 2 for outputs, GRAD_FACTOR = 3 for gradients -- plus a small floor, for cases
where PyTorch's error is ~0 (a single key, tiny rows) while the kernel still rounds its output once.
So the bound follows the precision of the inputs instead of being a magic constant. float32 has no
same-dtype yardstick (the reference is fp32): plain bounds, tight under the Triton interpreter (its
fp32 dot is an exact numpy matmul) and looser on a GPU (tf32 tensor-core matmuls, a 10-bit
mantissa). NaN or inf never passes.

Besides: `agreement_tolerance`, how far two kernel paths may differ on the same data (split vs
unsplit decode, packed vs alone, chunked vs one-shot prefill: the same sums in another order, each
output rounded once), `lse_tolerance` / `check_lse` for the log-sum-exp, and `check_dsinks` for the
gradient of attention sinks.
"""

from __future__ import annotations

import math
from typing import Tuple

import torch

from ..config.hardware import is_interpreter

FWD_FACTOR, GRAD_FACTOR = 2.0, 3.0
ATOL_FLOOR = {torch.float16: 1e-3, torch.bfloat16: 4e-3}
# float32: (under the interpreter, on a GPU); gradients sum in another order than autograd's
FP32_RTOL = (1e-5, 5e-3)
FP32_GRAD_RTOL = (1e-5, 1e-2)
# two kernel paths on the same data: (float16, bfloat16, float32 under the interpreter, float32 on a GPU)
AGREEMENT = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
FP32_AGREEMENT = (1e-5, 5e-3)
# Natural-log LSE: kernel and reference both accumulate the scores in fp32 (exact products of
# fp16/bf16 inputs), so they agree to fp32 rounding of the sum (~1e-6 under the interpreter). fp32
# inputs on a GPU go through tf32, whose conversion truncates the mantissa to 10 bits: score errors
# are biased and grow with |score|, so the LSE (dominated by the largest scores) gets a relative
# term too (5.4e-3 at |lse| ~ 7 on an H200).
LSE_ATOL = {torch.float16: 1e-3, torch.bfloat16: 1e-3, torch.float32: 1e-4}
# The kernels compute scores and the LSE in float32, whose rounding alone is 2^-24 |lse|: at |lse| ~ 1e6 (bf16
# queries of magnitude 3e5) the LSE differs from an fp64 reference by a few ulps (3.75e-1 at 1.08e6 on an H100,
# 3 ulps). 16-bit inputs get 8 ulps as a relative term, which below |lse| ~ 1e3 is under the atol above.
LSE_RTOL_16BIT = 2.0**-20
LSE_FP32_GPU = (5e-3, 2e-3)  # (atol, rtol)
# An FP8 (e4m3) KV cache, the error of the quantization itself: attention over a cache quantized with amax
# descales (per (batch, KV head) or per tensor) against an fp64 reference on the unquantized values, unit-scale
# normal inputs. e4m3 keeps 3 mantissa bits (a relative rounding error up to 2^-4 per value, ~2^-4 / sqrt(3)
# RMS); the output's relative error is ~4e-2 (3.7e-2 per (batch, KV head) descales, 4.0e-2 per tensor, D = 32,
# 256 keys, under the interpreter; an fp16 cache: 3e-4). With a few outlier channels (2 of 32 channels of K
# and V 20x larger) the other channels lose their bits to the amax and the scores grow: ~1e-1 (9.8e-2 per
# head, 1.1e-1 per tensor). tests/test_fp8_kvcache.py prints both. The kernels themselves are judged by the
# usual rule against the reference run on the dequantized cache, which quantizes exactly as they do.
FP8_KV_RTOL = 6e-2
FP8_KV_OUTLIER_RTOL = 1.5e-1
# The FP8 forward (q, k, v in e4m3 with amax descales, P quantized to e4m3 per key block), against an fp64
# reference on the unquantized inputs: the inputs' rounding as above plus P's (small probabilities lose
# relative precision, those below 2^-10 flush to 0). Under the interpreter (D = 32, 96 keys, GQA 4 / 2):
# unit normal inputs 5.3e-2 (RMSE 8.5e-3); FlashAttention-3's outlier distribution (0.1% of entries with
# standard deviation 10) 4.8e-2 / 5.1e-2 per head / per tensor (RMSE 1.9e-2 / 2.0e-2, FA3 reports 2.4e-2 for
# its per-tensor FP8 baseline: FA3_FP8_RMSE, the bar); two outlier channels of K and V (20x) 1.2e-1.
# On an H100 (1024 keys; per head / per tensor): normal 5.2e-2 / 5.2e-2 (RMSE 2.7e-3), FlashAttention-3's
# distribution 9.4e-2 / 9.4e-2 (RMSE 1.6e-2: under FA3's bar; more keys average the output down while the
# outliers' rounding stays), outlier channels 1.7e-1 / 1.9e-1. tests/test_fp8_prefill.py prints them.
FP8_PREFILL_RTOL = 1.2e-1
FP8_PREFILL_OUTLIER_RTOL = 2.5e-1
FA3_FP8_RMSE = 2.4e-2


# A reference whose root-mean-square is below this is zero at the scale the rule is used at: inputs drawn at
# unit scale (torch.randn), so results of order one, and float32 rounding of such results near 1e-7.
ZERO_RMS = 1e-6


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref||, in float64; 0.0 for empty tensors.

    [Note] Zero references. A reference that is zero (RMS below ZERO_RMS: a window of one key makes dq
    exactly zero) has no scale of its own to divide by, and the kernel's result is zero only up to the
    rounding of the sums that cancel to it. Then the error is the root-mean-square of out - ref: the error
    against elements of unit scale, which is what inputs at unit scale produce where the reference is not
    zero. So a bound means the same on both sides of that edge."""
    if ref.numel() == 0:
        return 0.0
    out, ref = out.double(), ref.double()
    diff, norm, root_n = (out - ref).norm().item(), ref.norm().item(), ref.numel() ** 0.5
    return diff / root_n if norm / root_n < ZERO_RMS else diff / norm


def _on_gpu() -> int:
    """Index into the (interpreter, GPU) pairs above."""
    return 0 if is_interpreter() else 1


def error_bound(dtype: torch.dtype, eager_err: float, *, grad: bool = False) -> float:
    """The largest relative error the rule accepts for a kernel result in `dtype`, given PyTorch's own
    same-dtype error `eager_err` (ignored for float32); `grad` for gradients."""
    if dtype == torch.float32:
        return (FP32_GRAD_RTOL if grad else FP32_RTOL)[_on_gpu()]
    return (GRAD_FACTOR if grad else FWD_FACTOR) * eager_err + ATOL_FLOOR[dtype]


def check_close(out: torch.Tensor, ref: torch.Tensor, same: torch.Tensor, *, grad: bool = False
                ) -> Tuple[bool, float, float]:
    """(ok, err, bound) of a kernel result `out` against the fp32 reference `ref`, with `same` PyTorch's
    result in out's dtype (unused for float32). err is inf when out holds NaN or inf."""
    if out.shape != ref.shape:
        raise ValueError(f"Expected out and ref of one shape, got {tuple(out.shape)} and {tuple(ref.shape)}.")
    eager_err = 0.0 if out.dtype == torch.float32 else rel_err(same, ref)
    bound = error_bound(out.dtype, eager_err, grad=grad)
    if not bool(torch.isfinite(out).all()):
        return False, math.inf, bound
    err = rel_err(out, ref)
    return err <= bound, err, bound


def agreement_tolerance(dtype: torch.dtype) -> float:
    """Largest relative difference allowed between two kernel paths' results on the same data."""
    if dtype == torch.float32:
        return FP32_AGREEMENT[_on_gpu()]
    return AGREEMENT[dtype]


def lse_tolerance(dtype: torch.dtype) -> Tuple[float, float]:
    """(atol, rtol) of the LSE of inputs in `dtype`: |lse - ref| <= atol + rtol * |ref|."""
    if dtype == torch.float32 and _on_gpu():
        return LSE_FP32_GPU
    return LSE_ATOL[dtype], (LSE_RTOL_16BIT if dtype in (torch.float16, torch.bfloat16) else 0.0)


def check_lse(lse: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> Tuple[bool, float]:
    """(ok, worst |lse - ref| over rows that see a key): +inf exactly where the reference is +inf (rows
    that see no key), no NaN or -inf, and the rest within `lse_tolerance(dtype)` of the inputs' dtype."""
    ref_inf = torch.isposinf(ref)
    ok = (lse.shape == ref.shape and torch.equal(torch.isposinf(lse), ref_inf)
          and not bool(torch.isnan(lse).any()) and not bool(torch.isneginf(lse).any()))
    if not ok or not bool((~ref_inf).any()):
        return ok, 0.0 if ok else math.inf
    got, want = lse[~ref_inf].double(), ref[~ref_inf].double()
    atol, rtol = lse_tolerance(dtype)
    diff = (got - want).abs()
    return bool((diff <= atol + rtol * want.abs()).all()), diff.max().item()


def check_dsinks(g: torch.Tensor, g_ref: torch.Tensor, g_same: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                 dout: torch.Tensor, sinks: torch.Tensor, dtype: torch.dtype) -> Tuple[bool, float, float, float]:
    """(ok, err, bound, kernel_err) of a kernel's dsinks `g` (sinks' dtype, (nheads,)) against the fp32
    reference's `g_ref`, with `g_same` PyTorch's in `dtype`; out, lse, dout: the kernel's forward output
    (batch, seqlen_q, nheads, D), its LSE (batch, nheads, seqlen_q) and the output gradient.

    dsinks = -sum over rows of P_sink * rowsum(dO * O) is exact given the O and LSE the forward returned,
    so kernel_err, against that sum in float64, must be <= 1e-3 (the kernel's own arithmetic). Against the
    reference, O's rounding to `dtype` propagates through a sum that cancels: err is bounded by 3x the
    larger of that propagated error (the same sum over the kernel's O against g_ref) and PyTorch's own
    same-dtype error, plus 1e-2 (1e-4 for float32)."""
    p_sink = torch.exp(sinks.detach().double()[None, :, None] - lse.detach().double())  # (batch, nheads, seqlen_q)
    delta = (dout.double() * out.detach().double()).sum(-1).transpose(1, 2)
    implied = -(p_sink * delta).sum((0, 2))
    kernel_err = rel_err(g, implied)
    err, from_out, eager = rel_err(g, g_ref), rel_err(implied, g_ref), rel_err(g_same, g_ref)
    bound = 1e-4 if dtype == torch.float32 else 3 * max(eager, from_out) + 1e-2
    finite = bool(torch.isfinite(g).all())
    return finite and kernel_err <= 1e-3 and err <= bound, err, bound, kernel_err
