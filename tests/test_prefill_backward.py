"""Backward of tritonattn.flash_attn_func: gradients for MHA, GQA and MQA against autograd through
the fp32 reference, judged by tritonattn.testing's rule for gradients (<= GRAD_FACTOR x PyTorch's own
same-dtype error + a floor)."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from helpers import DEVICE, INTERPRET, ON_GPU, assert_close_to_ref, make_qkv
from tritonattn import attention_ref, flash_attn_func


def _grads(fn, q, k, v, dout):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    return out, dq, dk, dv


def check_grads(q, k, v, *, causal: bool, msg: str = ""):
    """Run forward + backward and compare dq, dk, dv with autograd through the reference."""
    dout = torch.randn(q.shape, device=q.device, dtype=torch.float32).to(q.dtype)
    out, dq, dk, dv = _grads(lambda a, b, c: flash_attn_func(a, b, c, causal=causal), q, k, v, dout)
    _, rq, rk, rv = _grads(lambda a, b, c: attention_ref(a, b, c, causal=causal)[0].float(),
                           q.float(), k.float(), v.float(), dout.float())
    if q.dtype != torch.float32:
        _, eq, ek, ev = _grads(lambda a, b, c: attention_ref(a, b, c, causal=causal, upcast=False)[0],
                               q, k, v, dout)
    for name, g, r, e in (("dq", dq, rq, None if q.dtype == torch.float32 else eq),
                          ("dk", dk, rk, None if q.dtype == torch.float32 else ek),
                          ("dv", dv, rv, None if q.dtype == torch.float32 else ev)):
        assert g.shape == r.shape and g.dtype == q.dtype, f"{name} shape/dtype {msg}"
        assert_close_to_ref(g, r, r if e is None else e, grad=True, msg=f"{name} {msg}")
    return dq, dk, dv


# --------------------------------------------------------------------------------------------
# The grid: small and sampled under the interpreter, wide on the GPU.
# --------------------------------------------------------------------------------------------
if ON_GPU:
    HEADS = [(16, 16), (16, 8), (16, 4), (16, 2), (12, 4), (16, 1)]
    LENGTHS = [(1, 1), (17, 17), (113, 113), (1023, 1023), (113, 1023), (1023, 113), (1, 17), (17, 1)]
    HEAD_DIMS = [32, 64, 80, 128, 256]
    DTYPES = [torch.float16, torch.bfloat16]
    _all = list(itertools.product(HEADS, LENGTHS, HEAD_DIMS, [False, True], DTYPES))
    CASES = random.Random(0).sample(_all, 120)
else:
    HEADS = [(4, 4), (4, 2), (6, 2), (4, 1)]
    LENGTHS = [(1, 1), (17, 17), (40, 40), (17, 70), (70, 17), (1, 17)]
    HEAD_DIMS = [32, 64, 80]
    DTYPES = [torch.float16, torch.float32]
    _all = list(itertools.product(HEADS, LENGTHS, HEAD_DIMS, [False, True], DTYPES))
    CASES = random.Random(0).sample(_all, 16)


def _id(case):
    (h, hk), (m, n), d, causal, dt = case
    return f"h{h}:{hk}-m{m}-n{n}-d{d}-{'causal' if causal else 'full'}-{str(dt)[6:]}"


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_grads_match_reference(case):
    """dq, dk, dv match autograd through the fp32 reference (MHA/GQA/MQA, odd lengths, M != N)."""
    (h, hk), (m, n), d, causal, dtype = case
    q, k, v = make_qkv(2, m, n, h, hk, d, dtype)
    check_grads(q, k, v, causal=causal, msg=_id(case))


@pytest.mark.parametrize("layout", ["bhsd", "qkv_packed", "strided"])
def test_grads_non_contiguous_inputs(layout):
    """Gradients are right for transposed, packed-QKV and padded-stride input views."""
    m = 64 if ON_GPU else 33
    q, k, v = make_qkv(1, m, m, 4, 2, 64, torch.float16, layout=layout)
    check_grads(q, k, v, causal=True, msg=layout)


def test_non_contiguous_dout():
    """A transposed-view dout (explicit strides in the preprocessing step) gives the same grads."""
    q, k, v = make_qkv(1, 40, 40, 4, 2, 64, torch.float16)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = flash_attn_func(q, k, v, causal=True)
    dout_t = torch.randn(1, 4, 40, 64, device=DEVICE).to(torch.float16).transpose(1, 2)  # (b, s, h, d) view
    g1 = torch.autograd.grad(out, (q, k, v), dout_t, retain_graph=True)
    g2 = torch.autograd.grad(out, (q, k, v), dout_t.contiguous())
    for a, b in zip(g1, g2):
        assert torch.equal(a, b)


def test_causal_backward_empty_rows():
    """Causal with seqlen_q > seqlen_k: rows that see no key get dq = 0, and no NaN anywhere."""
    m, n = (300, 100) if ON_GPU else (70, 17)
    q, k, v = make_qkv(1, m, n, 4, 2, 32, torch.float16)
    dq, dk, dv = check_grads(q, k, v, causal=True, msg="empty rows")
    assert torch.all(dq[:, : m - n] == 0), "rows with no visible key must get zero dq"


def test_seqlen_k_zero_grads():
    """seqlen_k == 0: output zeros, dq zeros, empty dk/dv, no NaN."""
    q, k, v = make_qkv(1, 5, 0, 2, 1, 32, torch.float16)
    q = q.requires_grad_()
    k, v = k.requires_grad_(), v.requires_grad_()
    out = flash_attn_func(q, k, v)
    assert torch.all(out == 0)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    assert torch.all(dq == 0) and dk.shape == k.shape and dv.shape == v.shape


def test_return_lse_with_autograd():
    """return_softmax_lse=True works under autograd; the LSE is not differentiable."""
    q, k, v = make_qkv(1, 33, 33, 4, 2, 32, torch.float16)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out, lse = flash_attn_func(q, k, v, causal=True, return_softmax_lse=True)
    assert not lse.requires_grad and lse.dtype == torch.float32 and lse.shape == (1, 4, 33)
    out.sum().backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (q, k, v))


@pytest.mark.skipif(not INTERPRET, reason="exact fp32 arithmetic only under the interpreter")
def test_gradcheck_small_fp32():
    """Finite differences agree with the analytic backward on a tiny exact-fp32 case (interpreter)."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, s, h, 16, dtype=torch.float32, requires_grad=True)
               for s, h in ((5, 2), (7, 1), (7, 1)))
    fn = lambda a, b, c: flash_attn_func(a, b, c, causal=True)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (q, k, v), eps=1e-3, atol=2e-3, rtol=2e-3, nondet_tol=0.0)


@pytest.mark.parametrize("deterministic", [False, True])
def test_backward_bit_identical(deterministic):
    """Two backward passes on the same inputs give bit-identical dq, dk, dv (both flag values)."""
    shape = (2, 1024, 1024, 16, 4, 128) if ON_GPU else (1, 40, 40, 4, 2, 32)
    b, m, n, h, hk, d = shape
    dtype = torch.bfloat16 if ON_GPU else torch.float16
    q, k, v = make_qkv(b, m, n, h, hk, d, dtype)
    dout = torch.randn(b, m, h, d, device=DEVICE).to(dtype)
    runs = [_grads(lambda a, b_, c: flash_attn_func(a, b_, c, causal=True, deterministic=deterministic),
                   q, k, v, dout)[1:] for _ in range(2)]
    for a, b_ in zip(*runs):
        assert torch.equal(a, b_)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_grads_long_sequences(causal, dtype):
    """Long sequences (4096) with GQA 4:1 in both half dtypes."""
    q, k, v = make_qkv(1, 4096, 4096, 16, 4, 128, dtype)
    check_grads(q, k, v, causal=causal, msg=f"4096 {dtype} causal={causal}")


@pytest.mark.gpu
def test_grads_fp32_gpu():
    """fp32 inputs (tf32 matmuls) give gradients within tf32 accuracy."""
    q, k, v = make_qkv(1, 257, 300, 8, 2, 64, torch.float32)
    check_grads(q, k, v, causal=True, msg="fp32")
