"""The attention variants in flash_attn_func / flash_attn_varlen_func, forward and backward: sliding
window, logit softcap, ALiBi and learnable sinks, alone and combined, against the float64 reference
(kernels/tritonattn/testing/reference.py, itself checked loop by loop in test_reference_variants.py): out, lse, dq, dk,
dv and dsinks, on odd lengths, seqlen_q != seqlen_k both ways, windows of 0 and wider than the
sequence, rows that see no key, GQA, packed batches with per-sequence alignment, and with dropout.
"""

from __future__ import annotations

import pytest
import torch

from helpers import DEVICE, ON_GPU, assert_close_to_ref, assert_lse_close
from tritonattn import flash_attn_func, flash_attn_varlen_func, testing
from tritonattn.config.options import attn_options
from tritonattn.errors import InputError
from tritonattn.testing import attention_ref

DTYPES = [torch.float16, torch.bfloat16] if ON_GPU else [torch.float16, torch.float32]


def randn(*shape, dtype=torch.float16):
    return torch.randn(*shape, device=DEVICE, dtype=dtype, requires_grad=True)


def make_variant(name: str, batch: int, nheads: int):
    """flash_attn_func keywords of one named variant case (tensors on DEVICE, fresh random values)."""
    slopes = torch.rand(nheads, device=DEVICE) * 0.3 + 0.05
    sinks = (torch.randn(nheads, device=DEVICE) * 2).requires_grad_()
    return {
        "window": dict(window_size=(9, 4)),
        "window_left_only": dict(window_size=(13, -1)),
        "window_causal": dict(causal=True, window_size=(17, 0)),
        "window_zero": dict(window_size=(0, 0)),
        "window_wide": dict(window_size=(500, 500)),
        "softcap": dict(softcap=2.0),
        "softcap_causal": dict(causal=True, softcap=30.0),
        "alibi": dict(alibi_slopes=slopes),
        "alibi_batch_causal": dict(causal=True, alibi_slopes=torch.rand(batch, nheads, device=DEVICE) * 0.3),
        "sinks": dict(sinks=sinks),
        "sinks_causal": dict(causal=True, sinks=sinks),
        "all": dict(causal=True, window_size=(11, 0), softcap=5.0, alibi_slopes=slopes, sinks=sinks),
        "all_noncausal": dict(window_size=(6, 20), softcap=3.0, alibi_slopes=slopes, sinks=sinks),
    }[name]


VARIANTS = ["window", "window_left_only", "window_causal", "window_zero", "window_wide", "softcap", "softcap_causal",
            "alibi", "alibi_batch_causal", "sinks", "sinks_causal", "all", "all_noncausal"]
SHAPES = [(1, 45, 45, 2, 1, 32), (2, 37, 70, 4, 2, 32), (2, 70, 29, 2, 2, 16)]
if ON_GPU:
    SHAPES += [(2, 300, 517, 8, 2, 128), (1, 513, 257, 4, 4, 64), (1, 200, 200, 2, 1, 256)]


def ref_kwargs(kw: dict, dtype: torch.dtype, seqlen_k: int) -> dict:
    """The reference's keywords for a variant case, its tensors in the reference's dtype. The window as
    flash-attn reads it: a side reaching seqlen_k (max_seqlen_k when packed) is unbounded."""
    window = tuple(-1 if w >= seqlen_k else w for w in kw.get("window_size", (-1, -1)))
    out = dict(causal=kw.get("causal", False), window_size=window, softcap=kw.get("softcap", 0.0))
    if kw.get("alibi_slopes") is not None:
        out["alibi_slopes"] = kw["alibi_slopes"]
    if kw.get("sinks") is not None:
        out["sinks"] = kw["sinks"].to(dtype) if dtype != torch.float32 else kw["sinks"]
    return out


def check_against_reference(q, k, v, kw, out, lse, dtype):
    """out and lse, then dq / dk / dv (and dsinks) for a random dout, against the reference."""
    ins = [q, k, v] + ([kw["sinks"]] if kw.get("sinks") is not None else [])
    out32, lse_ref = attention_ref(q.float(), k.float(), v.float(), **ref_kwargs(kw, torch.float32, k.shape[1]))
    same = out32 if dtype == torch.float32 else attention_ref(q, k, v, upcast=False,
                                                              **ref_kwargs(kw, dtype, k.shape[1]))[0]
    assert_close_to_ref(out, out32, same, msg="out")
    assert_lse_close(lse, lse_ref, dtype)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, ins, dout)
    grads32 = torch.autograd.grad(out32, ins, dout.float())
    grads_same = grads32 if dtype == torch.float32 else torch.autograd.grad(same, ins, dout)
    for name, g, g32, gs in zip(["q", "k", "v", "sinks"], grads, grads32, grads_same):
        if name == "sinks":
            check_dsinks(g, g32, gs, out, lse, dout, kw["sinks"], dtype)
        else:
            assert_close_to_ref(g, g32, gs, grad=True, msg=f"d{name}")


def check_dsinks(g, g32, gs, out, lse, dout, sinks, dtype):
    """tritonattn.testing.check_dsinks: the kernel's own arithmetic (against the float64 sum over the O and LSE
    it returned), then the reference, bounded by O's propagated rounding and PyTorch's own error."""
    assert g.dtype == sinks.dtype
    ok, err, bound, kernel_err = testing.check_dsinks(g, g32, gs, out, lse, dout, sinks, dtype)
    assert kernel_err <= 1e-3, f"dsinks rel err {kernel_err:.2e} against the sum over its own O and LSE"
    assert ok, f"dsinks rel err {err:.2e} > {bound:.2e}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_variant_equals_reference(shape, variant, dtype):
    batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim = shape
    q = randn(batch, seqlen_q, nheads, head_dim, dtype=dtype)
    k, v = (randn(batch, seqlen_k, nheads_k, head_dim, dtype=dtype) for _ in range(2))
    kw = make_variant(variant, batch, nheads)
    out, lse = flash_attn_func(q, k, v, return_softmax_lse=True, **kw)
    check_against_reference(q, k, v, kw, out, lse, dtype)


@pytest.mark.parametrize("variant", ["window_causal", "sinks_causal", "all"])
def test_rows_that_see_no_key(variant):
    """seqlen_q > seqlen_k with causal: the first rows see no key and give zeros (never NaN), an LSE of
    +inf, or the sink's logit with sinks (the softmax over the sink alone), and zero dq."""
    q = randn(1, 40, 2, 32)
    k, v = randn(1, 12, 2, 32), randn(1, 12, 2, 32)
    kw = make_variant(variant, 1, 2)
    out, lse = flash_attn_func(q, k, v, return_softmax_lse=True, **kw)
    assert torch.isfinite(out).all() and (out[:, :28] == 0).all()
    if "sinks" in kw:
        assert torch.allclose(lse[0, :, :28], kw["sinks"].detach()[:, None].expand(2, 28))
    else:
        assert torch.isposinf(lse[:, :, :28]).all()
    (dq,) = torch.autograd.grad(out, (q,), torch.randn_like(out), retain_graph=True)
    assert torch.isfinite(dq).all() and (dq[:, :28] == 0).all()
    check_against_reference(q, k, v, kw, out, lse, q.dtype)


@pytest.mark.parametrize("variant", ["window", "window_causal", "alibi_batch_causal", "all", "all_noncausal"])
def test_varlen_per_sequence_alignment(variant):
    """Packed sequences (lengths 0 and 1 included): each sequence's out, lse and gradients equal its own
    reference, the window aligned to its own bottom-right corner (the window sizes are taken as given:
    flash-attn's unbounding of a side >= seqlen_k applies to max_seqlen_k, not to each sequence);
    per-batch ALiBi slopes index sequences; dsinks sums over sequences."""
    lens_q, lens_k = [17, 0, 40, 1, 33], [30, 5, 40, 9, 12]
    nheads, nheads_k, head_dim = 4, 2, 32
    cu_q = torch.tensor([0] + torch.tensor(lens_q).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0] + torch.tensor(lens_k).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    q = randn(sum(lens_q), nheads, head_dim)
    k, v = randn(sum(lens_k), nheads_k, head_dim), randn(sum(lens_k), nheads_k, head_dim)
    kw = make_variant(variant, len(lens_q), nheads)
    out, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), return_softmax_lse=True, **kw)
    dout = torch.randn_like(out)
    ins = [q, k, v] + ([kw["sinks"]] if "sinks" in kw else [])
    grads = torch.autograd.grad(out, ins, dout)
    dsinks_sum = torch.zeros(nheads, device=DEVICE, dtype=torch.float64)
    for b, (mq, nk) in enumerate(zip(lens_q, lens_k)):
        if mq == 0:
            continue
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        qb, kb, vb = (t.detach()[None, s].requires_grad_() for t, s in ((q, rows), (k, keys), (v, keys)))
        kwb = dict(kw)
        if kw.get("alibi_slopes") is not None and kw["alibi_slopes"].dim() == 2:
            kwb["alibi_slopes"] = kw["alibi_slopes"][b : b + 1]
        if "sinks" in kw:
            kwb["sinks"] = kw["sinks"].detach().clone().requires_grad_()
        ins_b = [qb, kb, vb] + ([kwb["sinks"]] if "sinks" in kw else [])
        out32, lse_ref = attention_ref(qb.float(), kb.float(), vb.float(),
                                       **ref_kwargs(kwb, torch.float32, max(lens_k)))
        same, _ = attention_ref(qb, kb, vb, upcast=False, **ref_kwargs(kwb, qb.dtype, max(lens_k)))
        assert_close_to_ref(out[rows][None], out32, same, msg=f"out of sequence {b}")
        assert_lse_close(lse[:, rows][None], lse_ref, qb.dtype, msg=f"sequence {b}")
        g32 = torch.autograd.grad(out32, ins_b, dout[rows][None].float())
        gs = torch.autograd.grad(same, ins_b, dout[rows][None])
        for name, g, r32, rs in zip("qkv", (grads[0][rows], grads[1][keys], grads[2][keys]), g32, gs):
            assert_close_to_ref(g[None], r32, rs, grad=True, msg=f"d{name} of sequence {b}")
        if "sinks" in kw:
            dsinks_sum += g32[3].double()
    if "sinks" in kw:
        torch.testing.assert_close(grads[3].double(), dsinks_sum, atol=1e-3, rtol=2e-2)


@pytest.mark.parametrize("variant", ["window_causal", "all_noncausal"])
def test_dropout_with_variants(variant):
    """Dropout on top of a variant: out and grads equal the reference with S_dmask's keep mask, and
    S_dmask is 0 outside the window."""
    q = randn(2, 50, 2, 32)
    k, v = randn(2, 61, 2, 32), randn(2, 61, 2, 32)
    kw = make_variant(variant, 2, 2)
    out, lse, s_dmask = flash_attn_func(q, k, v, 0.17, return_attn_probs=True, **kw)
    mask = s_dmask >= 0
    ins = [q, k, v] + ([kw["sinks"]] if "sinks" in kw else [])
    out32, lse_ref = attention_ref(q.float(), k.float(), v.float(), dropout_mask=mask, dropout_p=0.17,
                                   **ref_kwargs(kw, torch.float32, 61))
    same, _ = attention_ref(q, k, v, dropout_mask=mask, dropout_p=0.17, upcast=False, **ref_kwargs(kw, q.dtype, 61))
    assert_close_to_ref(out, out32, same, msg="out")
    assert_lse_close(lse, lse_ref, q.dtype)
    dout = torch.randn_like(out)
    grads, grads32 = torch.autograd.grad(out, ins, dout), torch.autograd.grad(out32, ins, dout.float())
    for name, g, g32, gs in zip("qkv", grads, grads32, torch.autograd.grad(same, ins, dout)):
        assert_close_to_ref(g, g32, gs, grad=True, msg=f"d{name}")
    left, right = kw["window_size"]
    i = torch.arange(50, device=DEVICE)[:, None] + 61 - 50
    j = torch.arange(61, device=DEVICE)[None, :]
    outside = (j < i - left) | (j > i + (0 if kw.get("causal") else right))
    assert (s_dmask[:, :, outside] == 0).all()


def test_dsinks_deterministic():
    """The backward's dsinks (and dq, dk, dv) are bit-identical run to run."""
    q, k, v = randn(2, 70, 4, 32), randn(2, 70, 2, 32), randn(2, 70, 2, 32)
    sinks = torch.randn(4, device=DEVICE, requires_grad=True)
    out = flash_attn_func(q, k, v, causal=True, sinks=sinks)
    dout = torch.randn_like(out)
    runs = [torch.autograd.grad(out, (q, k, v, sinks), dout, retain_graph=True) for _ in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_window_sizes_normalise_to_one_kernel():
    """flash-attn's window rules: (-1, -1) is no window, (-1, 0) causal, a side at or past seqlen_k
    unbounded; causal makes the right side 0. Equal semantics give equal options."""
    from tritonattn.api.args import attention_call

    def opts(**kw):
        return attention_call(64, None, kw.pop("causal", False), kw.pop("window_size", (-1, -1)), seqlen_k=100,
                              batch=1, nheads=2, device=DEVICE).options

    assert opts(window_size=(-1, 0)) == opts(causal=True)
    assert opts(window_size=(100, 100)) == opts()
    assert opts(causal=True, window_size=(5, 7)) == opts(causal=True, window_size=(5, 0))
    assert opts(window_size=(5, 7)).constexprs["HAS_WINDOW"] and not opts(causal=True).constexprs["HAS_WINDOW"]
    assert opts(window_size=(5, 7)).compiled == opts(window_size=(50, 2)).compiled  # sizes are runtime
    assert opts(window_size=torch.tensor([5, 7])) == opts(window_size=(5, 7))


def test_bad_variant_inputs_raise_before_launch():
    q, k, v = randn(1, 8, 4, 16), randn(1, 8, 2, 16), randn(1, 8, 2, 16)
    with pytest.raises(InputError, match="alibi_slopes of shape"):
        flash_attn_func(q, k, v, alibi_slopes=torch.ones(3, device=DEVICE))
    with pytest.raises(TypeError, match="float32"):
        flash_attn_func(q, k, v, alibi_slopes=torch.ones(4, device=DEVICE, dtype=torch.float16))
    with pytest.raises(InputError, match="sinks of shape"):
        flash_attn_func(q, k, v, sinks=torch.ones(2, device=DEVICE))
    with pytest.raises(InputError, match="softcap"):
        attn_options(16, softcap=float("nan"))
    with pytest.raises(InputError, match="window_size"):
        flash_attn_func(q, k, v, window_size=(1, 2, 3))


@pytest.mark.skipif(not ON_GPU, reason="compiles: GPU only")
def test_new_window_size_or_softcap_does_not_recompile():
    """Window sizes and softcap are runtime arguments: other values reuse the compiled kernels."""
    from tritonattn.jit.prefill_bwd import bwd_dkdv_kernel, bwd_dq_kernel
    from tritonattn.jit.prefill_fwd import fwd_kernel

    def compiled():  # Triton's per-device cache of compiled kernels
        device = torch.cuda.current_device()
        return sum(len(kern.device_caches[device][0]) for kern in (fwd_kernel, bwd_dkdv_kernel, bwd_dq_kernel))

    q, k, v = randn(1, 256, 2, 64), randn(1, 256, 2, 64), randn(1, 256, 2, 64)
    out = flash_attn_func(q, k, v, window_size=(100, 3), softcap=10.0)
    torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    before = compiled()
    for window, cap in (((37, 1), 3.0), ((64, 16), 50.0), ((1, 0), 0.5)):
        out = flash_attn_func(q, k, v, window_size=window, softcap=cap)
        torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    assert compiled() == before


@pytest.mark.parametrize("window,causal", [((70, 0), True), ((50, 30), False), ((100, 0), True), ((5, 120), False)])
def test_window_spans_many_blocks(window, causal):
    """Windows wider than a tile and narrower than the sequence: left edges, whole blocks and right edges
    in one query block's loop (the interpreter's 32-row tiles; a GPU's 64 / 128), forward and backward."""
    q = randn(1, 200, 2, 32)
    k, v = randn(1, 230, 1, 32), randn(1, 230, 1, 32)
    kw = dict(window_size=window, causal=causal)
    out, lse = flash_attn_func(q, k, v, return_softmax_lse=True, **kw)
    check_against_reference(q, k, v, kw, out, lse, q.dtype)
