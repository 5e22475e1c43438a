"""flash-attn's forward / backward primitives (tritonattn.flash_attn_interface) as ring attention uses them:
queries and keys split into blocks along the sequence, each query block attending to the key blocks at
or before it (the diagonal one causal), the partial results merged by log-sum-exp, and each block's
gradients computed against the merged output and LSE. The whole must equal one flash_attn_func call,
forward and backward.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from helpers import DEVICE, ON_GPU, assert_close_to_ref, references
from tritonattn import flash_attn_func
from tritonattn.flash_attn_interface import (
    _flash_attn_backward,
    _flash_attn_forward,
    _flash_attn_varlen_backward,
    _flash_attn_varlen_forward,
    merge_attention,
)
from tritonattn.testing import agreement_tolerance, rel_err

DTYPES = [torch.float16, torch.bfloat16] if ON_GPU else [torch.float16, torch.float32]


def test_primitive_signatures_are_flash_attns():
    """The parameters of flash-attn 2's primitives, in its order; ours (seqused_k in the varlen backward) come
    after them, keyword-only."""
    expected = {
        _flash_attn_forward: "q k v dropout_p softmax_scale causal window_size_left window_size_right softcap "
                             "alibi_slopes return_softmax",
        _flash_attn_backward: "dout q k v out softmax_lse dq dk dv dropout_p softmax_scale causal window_size_left "
                              "window_size_right softcap alibi_slopes deterministic rng_state",
        _flash_attn_varlen_forward: "q k v cu_seqlens_q cu_seqlens_k max_seqlen_q max_seqlen_k dropout_p softmax_scale "
                                    "causal window_size_left window_size_right softcap alibi_slopes return_softmax "
                                    "block_table leftpad_k seqused_k zero_tensors num_splits",
        _flash_attn_varlen_backward: "dout q k v out softmax_lse dq dk dv cu_seqlens_q cu_seqlens_k max_seqlen_q "
                                     "max_seqlen_k dropout_p softmax_scale causal window_size_left window_size_right "
                                     "softcap alibi_slopes deterministic rng_state zero_tensors",
    }
    for fn, names in expected.items():
        params = inspect.signature(fn).parameters.values()
        theirs = [p.name for p in params if p.kind != inspect.Parameter.KEYWORD_ONLY]
        assert theirs == names.split(), fn.__name__
    ours = [p.name for p in inspect.signature(_flash_attn_varlen_backward).parameters.values()
            if p.kind == inspect.Parameter.KEYWORD_ONLY]
    assert ours == ["seqused_k"]


def ring_attention(q, k, v, blocks: int, scale: float):
    """Causal attention by blocks of the sequence, with the primitives: returns (out, lse, backward),
    backward(dout) -> (dq, dk, dv)."""
    qs, ks, vs = q.chunk(blocks, 1), k.chunk(blocks, 1), v.chunk(blocks, 1)
    outs, lses = [], []
    for i, qi in enumerate(qs):
        out = lse = None
        for j in range(i + 1):  # key blocks after the query block are masked whole: skipped
            o, l_, s_dmask, _ = _flash_attn_forward(qi, ks[j], vs[j], 0.0, scale, j == i)
            assert s_dmask is None
            out, lse = (o, l_) if out is None else merge_attention(out, lse, o, l_)
        outs.append(out)
        lses.append(lse)

    def backward(dout):
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        douts = dout.chunk(blocks, 1)
        bq, bk = q.shape[1] // blocks, k.shape[1] // blocks
        for i, qi in enumerate(qs):
            for j in range(i + 1):
                gq, gk, gv = torch.empty_like(qi), torch.empty_like(ks[j]), torch.empty_like(vs[j])
                _flash_attn_backward(douts[i], qi, ks[j], vs[j], outs[i], lses[i], gq, gk, gv, 0.0, scale, j == i)
                dq[:, i * bq:(i + 1) * bq] += gq
                dk[:, j * bk:(j + 1) * bk] += gk
                dv[:, j * bk:(j + 1) * bk] += gv
        return dq, dk, dv

    return torch.cat(outs, 1), torch.cat(lses, 2), backward


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: str(t)[6:])
@pytest.mark.parametrize("blocks", [2, 3])
def test_ring_attention_equals_whole(blocks, dtype):
    """Blockwise causal attention merged by LSE equals flash_attn_func, output, LSE and gradients."""
    seqlen = (384 if ON_GPU else 24) * blocks
    d = 128 if ON_GPU else 32
    gen = torch.Generator(device=DEVICE).manual_seed(blocks)
    q, k, v = (torch.randn(2, seqlen, h, d, generator=gen, device=DEVICE).to(dtype) for h in (4, 2, 2))
    dout = torch.randn(2, seqlen, 4, d, generator=gen, device=DEVICE).to(dtype)
    scale = d**-0.5
    out, lse, backward = ring_attention(q, k, v, blocks, scale)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    whole, whole_lse = flash_attn_func(*leaves, causal=True, return_softmax_lse=True)
    tol = agreement_tolerance(dtype)
    assert rel_err(out, whole) <= tol
    assert torch.allclose(lse, whole_lse, atol=1e-3 if dtype != torch.float32 else 1e-5, rtol=0)
    ref32, _, ref_same = references(q, k, v, causal=True)
    assert_close_to_ref(out, ref32, ref_same)
    for name, got, want in zip(("dq", "dk", "dv"), backward(dout), torch.autograd.grad(whole, leaves, dout)):
        assert rel_err(got, want) <= 2 * tol, f"{name}: rel err {rel_err(got, want):.2e}"


def test_backward_takes_a_transposed_lse():
    """A ring passes softmax_lse as a view (e.g. lse.transpose(...) of a (b, m, h) buffer): the gradients
    equal those from the dense LSE; a wrong-shaped LSE is rejected before any launch."""
    q, k, v = (torch.randn(1, 20, h, 32, device=DEVICE, dtype=torch.float16) for h in (4, 2, 2))
    dout = torch.randn_like(q)
    out, lse, _, _ = _flash_attn_forward(q, k, v, 0.0, 32**-0.5, True)
    view = lse.transpose(1, 2).contiguous().transpose(1, 2)  # same values, strides (m*h, 1, h)
    assert not view.is_contiguous()
    grads = []
    for l_ in (lse, view):
        g = [torch.empty_like(t) for t in (q, k, v)]
        _flash_attn_backward(dout, q, k, v, out, l_, *g, 0.0, 32**-0.5, True)
        grads.append(g)
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    with pytest.raises(ValueError, match="softmax_lse of shape"):
        _flash_attn_backward(dout, q, k, v, out, lse[:, :, :5], *grads[0], 0.0, 32**-0.5, True)


def test_merge_attention_empty_parts():
    """A part whose rows saw no key (lse +inf) weighs nothing; two empty parts give zeros and +inf."""
    out = torch.randn(1, 3, 2, 8, device=DEVICE)
    lse = torch.randn(1, 2, 3, device=DEVICE)
    empty_out, empty_lse = torch.zeros_like(out), torch.full_like(lse, float("inf"))
    merged, merged_lse = merge_attention(out, lse, empty_out, empty_lse)
    assert torch.allclose(merged, out) and torch.allclose(merged_lse, lse)
    both, both_lse = merge_attention(empty_out, empty_lse, empty_out, empty_lse)
    assert torch.equal(both, empty_out) and torch.isposinf(both_lse).all()


def test_varlen_primitives_match_varlen_function():
    """_flash_attn_varlen_forward / _backward give flash_attn_varlen_func's output, LSE and gradients."""
    from tritonattn import flash_attn_varlen_func

    cu = torch.tensor([0, 5, 5, 17], dtype=torch.int32, device=DEVICE)
    q, k, v = (torch.randn(17, h, 32, device=DEVICE, dtype=torch.float16) for h in (4, 2, 2))
    dout = torch.randn_like(q)
    out, lse, _, rng = _flash_attn_varlen_forward(q, k, v, cu, cu, 12, 12, 0.0, 32**-0.5, True)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref, ref_lse = flash_attn_varlen_func(*leaves, cu, cu, 12, 12, causal=True, return_softmax_lse=True)
    assert torch.equal(out, ref.detach()) and torch.equal(lse, ref_lse)
    grads = [torch.empty_like(t) for t in (q, k, v)]
    delta = _flash_attn_varlen_backward(dout, q, k, v, out, lse, *grads, cu, cu, 12, 12, 0.0, 32**-0.5, True,
                                        rng_state=rng)
    for got, want in zip(grads, torch.autograd.grad(ref, leaves, dout)):
        assert torch.equal(got, want)
    assert torch.allclose(delta, (dout.float() * out.float()).sum(-1).transpose(0, 1), atol=1e-3)
