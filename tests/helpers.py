"""Shared test helpers: where tests run, input builders in every layout, and the error rule.

Imported by the test modules as `from helpers import ...` (tests/conftest.py puts tests/ on
sys.path). conftest.py has already set TRITON_INTERPRET=1 on machines without a GPU by the time
this module is imported, so DEVICE / ON_GPU / INTERPRET below describe the run correctly.

The error rule is kernels/tritonattn/testing/tolerance.py's (flash-attn's): a kernel in fp16/bf16 is judged by its error
against an fp32 reference *relative to* the error PyTorch's own eager code makes in the same dtype,
so the bound follows the precision of the inputs instead of being a magic constant. The assertions
below apply that one rule and say why a result failed it.
"""

from __future__ import annotations

import os
from typing import Optional, Tuple

import pytest
import torch

from benchmarks.competitors import attention_sdpa
from tritonattn import attention_ref
from tritonattn.config.hardware import is_interpreter
from tritonattn.testing import (  # noqa: F401  (references: re-exported for the tests)
    ATOL_FLOOR,
    FWD_FACTOR,
    GRAD_FACTOR,
    agreement_tolerance,
    check_close,
    check_lse,
    lse_tolerance,
    per_request_references,
    references,
    rel_err,
)

INTERPRET: bool = is_interpreter()
ON_GPU: bool = torch.cuda.is_available() and not INTERPRET  # compiled kernels on a real GPU
DEVICE: torch.device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")

# CUDA-graph capture allocates from PyTorch's caching allocator; with it disabled (as memcheck runs
# need: PYTORCH_NO_CUDA_MEMORY_CACHING=1) capture fails on cudaMalloc, so graph tests skip there.
needs_graph_capture = pytest.mark.skipif(
    os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING", "0") not in ("", "0"),
    reason="CUDA-graph capture needs PyTorch's caching allocator (PYTORCH_NO_CUDA_MEMORY_CACHING is set)",
)

LAYOUTS = ("bshd", "bhsd", "qkv_packed", "strided")


# --------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------
def make_qkv(
    batch: int,
    seqlen_q: int,
    seqlen_k: int,
    nheads: int,
    nheads_k: int,
    head_dim: int,
    dtype: torch.dtype,
    device=DEVICE,
    layout: str = "bshd",
    seed: Optional[int] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fresh standard-normal q (b, m, h, d), k and v (b, n, h_kv, d) in one of LAYOUTS.

    - "bshd": three contiguous tensors.
    - "bhsd": (b, h, s, d) contiguous buffers seen through .transpose(1, 2) (the layout of
      PyTorch's SDPA / a head-major projection).
    - "qkv_packed": one (b, s, h + 2*h_kv, d) buffer, as from a fused QKV projection; q, k, v are
      non-contiguous slices of it along the head dim. Needs seqlen_q == seqlen_k.
    - "strided": (b, s, h, d + 8) buffers sliced to [..., :d], so the row and head strides are not
      dense. The 8 padding columns hold NaN: a kernel reading past head_dim poisons its output.
    The values are never all zeros; with `seed` they are reproducible on a given device.
    """
    gen = None
    if seed is not None:
        gen = torch.Generator(device=device)
        gen.manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(dtype)

    if layout == "bshd":
        q = randn(batch, seqlen_q, nheads, head_dim)
        k = randn(batch, seqlen_k, nheads_k, head_dim)
        v = randn(batch, seqlen_k, nheads_k, head_dim)
    elif layout == "bhsd":
        q = randn(batch, nheads, seqlen_q, head_dim).transpose(1, 2)
        k = randn(batch, nheads_k, seqlen_k, head_dim).transpose(1, 2)
        v = randn(batch, nheads_k, seqlen_k, head_dim).transpose(1, 2)
    elif layout == "qkv_packed":
        if seqlen_q != seqlen_k:
            raise ValueError(f"qkv_packed needs seqlen_q == seqlen_k, got {seqlen_q} and {seqlen_k}")
        buf = randn(batch, seqlen_q, nheads + 2 * nheads_k, head_dim)
        q = buf[:, :, :nheads]
        k = buf[:, :, nheads : nheads + nheads_k]
        v = buf[:, :, nheads + nheads_k :]
    elif layout == "strided":
        pad = 8

        def padded(s, h):
            buf = randn(batch, s, h, head_dim + pad)
            buf[..., head_dim:] = float("nan")  # poison: must never be read
            return buf[..., :head_dim]

        q, k, v = padded(seqlen_q, nheads), padded(seqlen_k, nheads_k), padded(seqlen_k, nheads_k)
    else:
        raise ValueError(f"unknown layout {layout!r}; expected one of {LAYOUTS}")
    return q, k, v


# --------------------------------------------------------------------------------------------
# References
# --------------------------------------------------------------------------------------------
def padded_references(q, k_cache, v_cache, k, v, lengths, *, softmax_scale: Optional[float] = None):
    """`per_request_references` (not causal, one new token or none) in one batched call: the new rows
    k[:, 0], v[:, 0] written at each request's length into copies of the dense caches, and the keys
    past each request's length + 1 masked (`attention_ref`'s key_padding_lengths). A few large ops
    instead of a few per request: the form that stays fast under compute-sanitizer."""
    assert k is None or k.shape[1] == 1, "one new token per request"
    n_keys = torch.tensor(lengths, device=q.device) + (0 if k is None else 1)
    if k is not None:
        rows = torch.arange(len(lengths), device=q.device)
        k_cache, v_cache = k_cache.clone(), v_cache.clone()
        k_cache[rows, n_keys - 1], v_cache[rows, n_keys - 1] = k[:, 0], v[:, 0]
    out_fp32, lse = attention_ref(q.float(), k_cache.float(), v_cache.float(), key_padding_lengths=n_keys,
                                  softmax_scale=softmax_scale)
    if q.dtype == torch.float32:
        return out_fp32, lse, out_fp32
    out_same, _ = attention_ref(q, k_cache, v_cache, key_padding_lengths=n_keys, softmax_scale=softmax_scale,
                                upcast=False)
    return out_fp32, lse, out_same


def sdpa_references(q, k, v, *, causal: bool, softmax_scale: Optional[float] = None):
    """(out_fp32, out_same_dtype) from torch's scaled_dot_product_attention, in our (b, s, h, d)
    layout. Only valid where its conventions match ours: causal only with seqlen_q == seqlen_k
    (SDPA's is_causal is aligned top-left)."""
    out_fp32 = attention_sdpa(q.float(), k.float(), v.float(), causal=causal, softmax_scale=softmax_scale)
    if q.dtype == torch.float32:
        return out_fp32, out_fp32
    return out_fp32, attention_sdpa(q, k, v, causal=causal, softmax_scale=softmax_scale)


# --------------------------------------------------------------------------------------------
# Error rules: tritonattn.testing's, with messages that say which bound failed and why
# --------------------------------------------------------------------------------------------
def record_chunked_prefill(monkeypatch) -> list:
    """Make tritonattn.launch.decode record each call of its chunked-prefill path (`_flash_attn_kvcache_forward`,
    which still runs): returns the list the calls' q shapes are appended to."""
    import tritonattn.launch.decode as decode
    import tritonattn.launch.prefill as prefill_launch

    calls = []
    forward = prefill_launch.launch_cache_prefill

    def recording_forward(*args, **kwargs):
        calls.append(args[0].shape)
        return forward(*args, **kwargs)

    monkeypatch.setattr(decode, "launch_cache_prefill", recording_forward)
    return calls


def assert_close_to_ref(
    out: torch.Tensor,
    ref_fp32: torch.Tensor,
    ref_same_dtype: torch.Tensor,
    *,
    grad: bool = False,
    msg: str = "",
) -> None:
    """tritonattn.testing.check_close: rel_err(out, ref_fp32) <= factor * rel_err(ref_same_dtype, ref_fp32)
    + ATOL_FLOOR, factor FWD_FACTOR (outputs) or GRAD_FACTOR (`grad`: gradients).

    fp32 inputs get the plain bound of tritonattn.testing.error_bound instead (tight under the
    interpreter, whose fp32 dot is exact; looser on a GPU for tf32 matmuls). NaN or inf in `out`
    never passes.
    """
    assert out.shape == ref_fp32.shape, f"shape {tuple(out.shape)} != reference {tuple(ref_fp32.shape)} {msg}"
    assert torch.isfinite(out).all(), (
        f"non-finite output: {(~torch.isfinite(out)).sum().item()} of {out.numel()} elements {msg}"
    )
    ok, err, bound = check_close(out, ref_fp32, ref_same_dtype, grad=grad)
    if out.dtype == torch.float32:
        assert ok, f"fp32 rel err {err:.3e} > {bound:.1e} {msg}"
        return
    factor = GRAD_FACTOR if grad else FWD_FACTOR
    ref_err = rel_err(ref_same_dtype, ref_fp32)
    assert ok, (
        f"kernel rel err {err:.3e} > {factor} * eager {out.dtype} rel err {ref_err:.3e} + {ATOL_FLOOR[out.dtype]:.0e} "
        f"(= {bound:.3e}) {msg}"
    )


def assert_lse_close(lse: torch.Tensor, ref_lse: torch.Tensor, dtype: torch.dtype, msg: str = "") -> None:
    """tritonattn.testing.check_lse: lse is float32 (B, H, M), +inf exactly where the reference is +inf,
    finite elsewhere and within lse_tolerance(dtype) of it; NaN never passes."""
    assert lse.dtype == torch.float32, f"lse dtype {lse.dtype} {msg}"
    assert lse.shape == ref_lse.shape, f"lse shape {tuple(lse.shape)} != {tuple(ref_lse.shape)} {msg}"
    assert not torch.isnan(lse).any(), f"NaN in lse {msg}"
    ref_inf = torch.isposinf(ref_lse)
    assert torch.equal(torch.isposinf(lse), ref_inf), (
        f"+inf mismatch: kernel {torch.isposinf(lse).sum().item()} rows, reference {ref_inf.sum().item()} {msg}"
    )
    assert not torch.isneginf(lse).any(), f"-inf in lse {msg}"
    ok, worst = check_lse(lse, ref_lse, dtype)
    if ok:
        return
    atol, rtol = lse_tolerance(dtype)
    got, want = lse[~ref_inf].double(), ref_lse[~ref_inf].double()
    diff = (got - want).abs()
    tol = atol + rtol * want.abs()
    at = (diff - tol).argmax()
    raise AssertionError(
        f"lse abs diff {diff[at].item():.3e} > {tol[at].item():.3e} at |lse| {want[at].abs().item():.2f} "
        f"(bound {atol:.0e} + {rtol:.0e} * |lse|; worst abs diff {worst:.3e}) {msg}"
    )


def assert_splits_agree(results: dict, dtype: torch.dtype) -> None:
    """Split-KV results {num_splits: (out, lse)} agree with the unsplit one (key 1): output within
    agreement_tolerance(dtype) relative difference, LSE +inf in the same rows and within 1e-3 elsewhere."""
    tol = agreement_tolerance(dtype)
    out1, lse1 = results[1]
    for ns, (out, lse) in results.items():
        if ns == 1:
            continue
        diff = rel_err(out, out1)
        print(f"num_splits={ns} vs 1: out rel err {diff:.2e}")
        assert diff <= tol, f"num_splits={ns} vs 1: rel err {diff:.2e} > {tol:.1e}"
        assert torch.equal(torch.isinf(lse), torch.isinf(lse1))
        finite = torch.isfinite(lse1)
        assert (lse[finite] - lse1[finite]).abs().max().item() < 1e-3


def paged_copy(k_cache, v_cache, page_size):
    """Pools holding the dense caches' rows behind a random permuted block table, and the table."""
    batch, seqlen_cache, nheads_k, head_dim = k_cache.shape
    pages = seqlen_cache // page_size
    perm = torch.randperm(batch * pages, device=k_cache.device)
    pools = []
    for cache in (k_cache, v_cache):
        pool = torch.empty(batch * pages, page_size, nheads_k, head_dim, dtype=cache.dtype, device=cache.device)
        pool[perm] = cache.reshape(batch * pages, page_size, nheads_k, head_dim)
        pools.append(pool)
    return pools[0], pools[1], perm.view(batch, pages).to(torch.int32)
