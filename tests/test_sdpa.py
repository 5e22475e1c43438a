"""The SDPA provider (tritonattn.compile.sdpa): registered on import, never active until the user activates it;
while active, scaled_dot_product_attention's flash backend runs our kernels (output and gradients equal
ours and the reference: causal, GQA through enable_gqa, dropout with a mask replayed by the backward,
either input layout, under torch.compile too); after restore_flash_attention_impl PyTorch's own runs
again, bit for bit."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import tritonattn.compile.sdpa as sdpa
from helpers import DEVICE, assert_close_to_ref
from tritonattn import flash_attn_func
from tritonattn.api.args import attention_call
from tritonattn.config.options import Dropout
from tritonattn.launch.prefill import dropout_probs
from tritonattn.testing import attention_ref

pytestmark = pytest.mark.skipif(not sdpa.available(), reason="torch has no flash attention provider hook (< 2.10)")
attn = torch.nn.attention


@contextlib.contextmanager
def provider():
    attn.activate_flash_attention_impl(sdpa.IMPL_NAME)
    try:
        yield
    finally:
        attn.restore_flash_attention_impl()


def test_registered_not_active():
    assert sdpa.IMPL_NAME in attn.list_flash_attention_impls()
    assert attn.current_flash_attention_impl() is None
    with provider():
        assert attn.current_flash_attention_impl() == sdpa.IMPL_NAME
    assert attn.current_flash_attention_impl() is None


def bhsd(batch, seqlen, nheads, head_dim, dtype, layout):
    """An SDPA input (batch, nheads, seqlen, head_dim): a transposed (batch, seqlen, nheads, head_dim)
    tensor (what attention layers pass) or a contiguous one."""
    if layout == "bshd":
        return torch.randn(batch, seqlen, nheads, head_dim, device=DEVICE, dtype=dtype).transpose(1, 2)
    return torch.randn(batch, nheads, seqlen, head_dim, device=DEVICE, dtype=dtype)


def sdpa_flash(q, k, v, **kw):
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=k.shape[1] != q.shape[1], **kw)


def leaves(*tensors):
    return [t.detach().requires_grad_() for t in tensors]


def references(q, k, v, causal, mask=None, p=0.0):
    """[(fp32 reference out, its leaves), (same-dtype reference out, its leaves)] in SDPA's layout."""
    kw = dict(dropout_mask=mask, dropout_p=p) if mask is not None else {}
    results = []
    for upcast in (True, False):
        args = leaves(q, k, v)
        inputs = [t.transpose(1, 2).float() if upcast else t.transpose(1, 2) for t in args]
        out, _ = attention_ref(*inputs, causal=causal, upcast=upcast, **kw)
        results.append((out.transpose(1, 2), args))
    return results


SHAPES = [(2, 77, 8, 8, 64), (1, 130, 8, 2, 128), (2, 200, 4, 1, 72)]  # batch, seqlen, nheads, nheads_k, head_dim


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_sdpa_flash_runs_our_kernels(shape, causal, dtype, layout):
    batch, seqlen, nheads, nheads_k, head_dim = shape
    q = bhsd(batch, seqlen, nheads, head_dim, dtype, layout)
    k, v = bhsd(batch, seqlen, nheads_k, head_dim, dtype, layout), bhsd(batch, seqlen, nheads_k, head_dim, dtype,
                                                                        layout)
    dout = torch.randn_like(q)
    with provider():
        inputs = leaves(q, k, v)
        out = sdpa_flash(*inputs, is_causal=causal)
        grads = torch.autograd.grad(out, inputs, dout)
    assert out.stride() == q.stride() and all(g.stride() == t.stride() for g, t in zip(grads, (q, k, v)))
    ours = flash_attn_func(*(t.transpose(1, 2) for t in (q, k, v)), causal=causal).transpose(1, 2)
    assert torch.equal(out, ours)  # bit for bit: our kernel ran, not PyTorch's
    (ref, ref_in), (same, same_in) = references(q, k, v, causal)
    assert_close_to_ref(out, ref, same, msg="out")
    ref_grads = torch.autograd.grad(ref, ref_in, dout.float())
    same_grads = torch.autograd.grad(same, same_in, dout)
    for name, g, r, s in zip("qkv", grads, ref_grads, same_grads):
        assert_close_to_ref(g, r, s, grad=True, msg=f"d{name}")


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_sdpa_flash_dropout_replays_its_mask(causal):
    """With dropout, the rng_state the op returns is our (seed, salt): the mask it names is the one the
    output used, and the backward (which gets that rng_state back) differentiates the same mask."""
    p, dtype = 0.2, torch.float16
    q, k, v = (bhsd(2, 96, 4, 64, dtype, "bshd") for _ in range(3))
    dout = torch.randn_like(q)
    with provider():
        torch.manual_seed(11)
        inputs = leaves(q, k, v)
        out = sdpa_flash(*inputs, is_causal=causal, dropout_p=p)
        grads = torch.autograd.grad(out, inputs, dout)
        torch.manual_seed(11)
        direct = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, p, causal)
    assert torch.equal(direct[0], out)
    seed = direct[6]
    assert seed.dtype == torch.uint64 and seed.shape == (2,)
    qs, ks = q.transpose(1, 2), k.transpose(1, 2)
    options = attention_call(64, None, causal, seqlen_k=96, batch=2, nheads=4, device=q.device).options
    mask = dropout_probs(qs, ks, options, Dropout(p, seed.view(torch.int64))) >= 0
    assert 0.7 < mask.float().mean().item() < 0.9
    (ref, ref_in), (same, same_in) = references(q, k, v, causal, mask, p)
    assert_close_to_ref(out, ref, same, msg="out")
    for name, g, r, s in zip("qkv", grads, torch.autograd.grad(ref, ref_in, dout.float()),
                             torch.autograd.grad(same, same_in, dout)):
        assert_close_to_ref(g, r, s, grad=True, msg=f"d{name}")


@pytest.mark.gpu
def test_restore_gives_pytorch_back_bit_for_bit():
    q, k, v = (bhsd(2, 150, 4, 64, torch.bfloat16, "bshd") for _ in range(3))
    before = sdpa_flash(q, k, v, is_causal=True)
    with provider():
        during = sdpa_flash(q, k, v, is_causal=True)
    after = sdpa_flash(q, k, v, is_causal=True)
    assert torch.equal(before, after)
    assert torch.equal(during, flash_attn_func(*(t.transpose(1, 2) for t in (q, k, v)), causal=True).transpose(1, 2))


@pytest.mark.gpu
def test_sdpa_flash_under_compile_runs_our_kernels():
    """Inductor keeps SDPA's flash op as a call: with the provider active, compiled code runs ours."""
    torch._dynamo.reset()
    q, k, v = (bhsd(2, 128, 4, 64, torch.float16, "bshd") for _ in range(3))
    compiled = torch.compile(lambda q, k, v: sdpa_flash(q, k, v, is_causal=True) * 2, fullgraph=True)
    with provider():
        out = compiled(q, k, v)
    ours = flash_attn_func(*(t.transpose(1, 2) for t in (q, k, v)), causal=True).transpose(1, 2)
    assert torch.equal(out, ours * 2)


@pytest.mark.gpu
def test_varlen_op_runs_our_kernels():
    """aten::_flash_attention_forward (packed sequences, torch.nn.attention.varlen's op) is ours too."""
    from tritonattn import flash_attn_varlen_func

    q, k, v = (torch.randn(70, 4, 64, device=DEVICE, dtype=torch.float16) for _ in range(3))
    cu = torch.tensor([0, 30, 70], dtype=torch.int32, device=DEVICE)
    with provider():
        out, lse, *_ = torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, 40, 40, 0.0, True, False)
    ours, ours_lse, _ = flash_attn_varlen_func(q, k, v, cu, cu, 40, 40, causal=True, return_attn_probs=True)
    assert torch.equal(out, ours) and torch.equal(lse, ours_lse)
