"""Dropout in flash_attn_func / flash_attn_varlen_func and the primitives: the output and the gradients
equal the reference computed with the mask the kernel reports (S_dmask), the keep rate is 1 - p, the
mask is reproducible under torch.manual_seed and fresh otherwise, and the backward regenerates the
forward's mask (also from a returned rng_state, as ring attention passes it).
"""

from __future__ import annotations

import pytest
import torch

from helpers import DEVICE, ON_GPU, assert_close_to_ref, assert_lse_close, needs_graph_capture
from tritonattn import flash_attn_func, flash_attn_varlen_func
from tritonattn.flash_attn_interface import _flash_attn_backward, _flash_attn_forward
from tritonattn.testing import attention_ref, causal_mask

DTYPES = [torch.float16, torch.bfloat16] if ON_GPU else [torch.float16, torch.float32]
P = 0.17  # flash-attn's tests' value


def randn(*shape, dtype=torch.float16):
    return torch.randn(*shape, device=DEVICE, dtype=dtype, requires_grad=True)


def dropout_refs(q, k, v, mask, p, causal):
    """(out_fp32, lse, out_same_dtype) of the reference with the kernel's keep mask."""
    out32, lse = attention_ref(q.float(), k.float(), v.float(), causal=causal, dropout_mask=mask, dropout_p=p)
    if q.dtype == torch.float32:
        return out32, lse, out32
    same, _ = attention_ref(q, k, v, causal=causal, dropout_mask=mask, dropout_p=p, upcast=False)
    return out32, lse, same


def visible(batch, nheads, seqlen_q, seqlen_k, causal):
    """Bool (batch, nheads, seqlen_q, seqlen_k): the pairs attention sees."""
    vis = causal_mask(seqlen_q, seqlen_k, DEVICE) if causal else torch.ones(seqlen_q, seqlen_k, dtype=torch.bool,
                                                                            device=DEVICE)
    return vis.expand(batch, nheads, seqlen_q, seqlen_k)


SHAPES = [(1, 64, 64, 2, 2, 32), (2, 40, 72, 4, 2, 32), (2, 72, 40, 4, 1, 16)]
if ON_GPU:
    SHAPES += [(2, 257, 300, 6, 2, 128), (1, 128, 128, 2, 2, 250), (3, 113, 203, 4, 4, 64)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_dropout_equals_reference_with_its_mask(shape, causal, dtype):
    """out, lse and dq/dk/dv equal the reference that drops what S_dmask says was dropped; S_dmask's
    magnitudes are exp(score - row max)."""
    batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim = shape
    q = randn(batch, seqlen_q, nheads, head_dim, dtype=dtype)
    k, v = randn(batch, seqlen_k, nheads_k, head_dim, dtype=dtype), randn(batch, seqlen_k, nheads_k, head_dim,
                                                                         dtype=dtype)
    out, lse, s_dmask = flash_attn_func(q, k, v, P, causal=causal, return_attn_probs=True)
    assert s_dmask.shape == (batch, nheads, seqlen_q, seqlen_k) and s_dmask.dtype == dtype
    mask = s_dmask >= 0
    out32, lse_ref, same = dropout_refs(q, k, v, mask, P, causal)
    assert_close_to_ref(out, out32, same, msg="out")
    assert_lse_close(lse, lse_ref, dtype)

    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    grads32 = torch.autograd.grad(out32, (q, k, v), dout.float())
    grads_same = torch.autograd.grad(same, (q, k, v), dout) if dtype != torch.float32 else grads32
    for name, g, g32, gs in zip("qkv", grads, grads32, grads_same):
        assert_close_to_ref(g, g32, gs, grad=True, msg=f"d{name}")

    scores = torch.einsum("bmhd,bnhd->bhmn", q.float() * head_dim**-0.5,
                          k.float().repeat_interleave(nheads // nheads_k, 2))
    vis = visible(batch, nheads, seqlen_q, seqlen_k, causal)
    scores = scores.masked_fill(~vis, float("-inf"))
    probs = torch.softmax(scores, -1).nan_to_num(0.0)
    row_max = scores.amax(-1, keepdim=True).clamp_min(-1e30)
    recovered = s_dmask.float().abs() * torch.exp(row_max - lse[..., None].clamp_max(1e30))
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert (recovered - probs).abs().max().item() <= tol
    assert (s_dmask[~vis] == 0).all()


@pytest.mark.parametrize("p", [0.17, 0.5])
def test_keep_rate(p):
    """The share of dropped pairs is p (to 0.01 on 2^17 pairs, about 8 standard deviations), counted
    over the pairs causal attention sees."""
    q, k, v = randn(2, 128, 4, 16), randn(2, 128, 4, 16), randn(2, 128, 4, 16)
    _, _, s_dmask = flash_attn_func(q, k, v, p, causal=True, return_attn_probs=True)
    vis = visible(2, 4, 128, 128, True)
    dropped = (s_dmask[vis] < 0).float().mean().item()
    assert abs(dropped - p) <= 0.01, dropped


def test_mask_reproducible_under_manual_seed_and_fresh_otherwise():
    """The same seed gives the same out and gradients bit for bit; the next call draws another mask."""
    q, k, v = randn(2, 48, 2, 32), randn(2, 48, 2, 32), randn(2, 48, 2, 32)
    dout = torch.randn(2, 48, 2, 32, device=DEVICE, dtype=torch.float16)
    runs = []
    for _ in range(2):
        torch.manual_seed(7)
        out = flash_attn_func(q, k, v, P)
        runs.append((out, *torch.autograd.grad(out, (q, k, v), dout)))
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    assert not torch.equal(flash_attn_func(q, k, v, P), flash_attn_func(q, k, v, P))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen_dropout(causal):
    """Packed sequences: each sequence's out and gradients equal its reference with its part of S_dmask,
    which is (batch, nheads, max_seqlen_q, max_seqlen_k) with zeros past its lengths."""
    lens_q, lens_k = [17, 0, 40, 33], [30, 5, 40, 9]
    nheads, nheads_k, head_dim = 4, 2, 32
    cu_q = torch.tensor([0] + torch.tensor(lens_q).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0] + torch.tensor(lens_k).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    q = randn(sum(lens_q), nheads, head_dim)
    k, v = randn(sum(lens_k), nheads_k, head_dim), randn(sum(lens_k), nheads_k, head_dim)
    out, lse, s_dmask = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), P, causal=causal,
                                               return_attn_probs=True)
    assert s_dmask.shape == (len(lens_q), nheads, max(lens_q), max(lens_k))
    dout = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    for b, (mq, nk) in enumerate(zip(lens_q, lens_k)):
        assert (s_dmask[b, :, mq:] == 0).all() and (s_dmask[b, :, :, nk:] == 0).all()
        if mq == 0:
            continue
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        qb, kb, vb = (t.detach()[None, s].requires_grad_() for t, s in ((q, rows), (k, keys), (v, keys)))
        out32, _, same = dropout_refs(qb, kb, vb, s_dmask[b : b + 1, :, :mq, :nk] >= 0, P, causal)
        assert_close_to_ref(out[rows][None], out32, same, msg=f"sequence {b}")
        g32 = torch.autograd.grad(out32, (qb, kb, vb), dout[rows][None].float())
        gs = torch.autograd.grad(same, (qb, kb, vb), dout[rows][None])
        for name, g, r32, rs in zip("qkv", (dq[rows], dk[keys], dv[keys]), g32, gs):
            assert_close_to_ref(g[None], r32, rs, grad=True, msg=f"d{name} of sequence {b}")


def test_primitives_carry_the_mask_in_rng_state():
    """_flash_attn_forward's rng_state, handed to _flash_attn_backward, gives flash_attn_func's gradients
    under the same seed; without it the backward refuses (a fresh draw would be another mask)."""
    q, k, v = randn(2, 40, 4, 32), randn(2, 56, 2, 32), randn(2, 56, 2, 32)
    dout = torch.randn(2, 40, 4, 32, device=DEVICE, dtype=torch.float16)
    torch.manual_seed(3)
    out_ref = flash_attn_func(q, k, v, P, causal=True)
    grads_ref = torch.autograd.grad(out_ref, (q, k, v), dout)
    torch.manual_seed(3)
    with torch.no_grad():
        out, lse, s_dmask, rng_state = _flash_attn_forward(q, k, v, P, 32**-0.5, True, return_softmax=True)
    assert torch.equal(out, out_ref) and s_dmask is not None and rng_state.shape == (2,)
    dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
    _flash_attn_backward(dout, q, k, v, out, lse, dq, dk, dv, P, 32**-0.5, True, rng_state=rng_state)
    assert all(torch.equal(a, b) for a, b in zip((dq, dk, dv), grads_ref))
    with pytest.raises(ValueError, match="rng_state"):
        _flash_attn_backward(dout, q, k, v, out, lse, dq, dk, dv, P, 32**-0.5, True)


@pytest.mark.parametrize("p,error", [(-0.1, ValueError), (1.0, ValueError), ("0.1", TypeError),
                                     (torch.tensor(0.1), TypeError)], ids=str)
def test_bad_dropout_p_raises(p, error):
    """dropout_p outside [0, 1 - 2^-17) or not a number raises before any launch, in the primitives too."""
    q = randn(1, 8, 2, 32)
    with pytest.raises(error, match="dropout_p"):
        flash_attn_func(q, q, q, p)
    with pytest.raises(error, match="dropout_p"):
        _flash_attn_backward(q, q, q, q, q, torch.zeros(1, 2, 8, device=DEVICE), None, None, None, p, 1.0, False)


def test_masks_differ_across_heads_and_batch_entries():
    """Each (batch entry, query head) draws its own mask, also query heads that share a KV head (GQA)."""
    q, k, v = randn(2, 64, 4, 16), randn(2, 64, 1, 16), randn(2, 64, 1, 16)
    _, _, s_dmask = flash_attn_func(q, k, v, 0.5, return_attn_probs=True)
    kept = s_dmask >= 0
    pairs = [(kept[0, 0], kept[0, 1]), (kept[0, 0], kept[1, 0]), (kept[0, 2], kept[1, 3])]
    for a, b in pairs:
        assert (a != b).float().mean().item() > 0.3  # independent halves disagree on ~50%
    with pytest.raises(ValueError, match="dropout_p"):
        flash_attn_func(q, k, v, 1 - 2**-18)


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
@needs_graph_capture
def test_cuda_graph_draws_fresh_bits_each_replay():
    """The (seed, salt) pair is drawn on the device inside the graph: each replay drops other pairs, and
    each replay's output equals the reference with that replay's mask (read back through S_dmask)."""
    q, k, v = (torch.randn(2, 128, 4, 64, device=DEVICE, dtype=torch.float16) for _ in range(3))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        flash_attn_func(q, k, v, P, return_attn_probs=True)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, _, s_dmask = flash_attn_func(q, k, v, P, return_attn_probs=True)
    results = []
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        out32, _, same = dropout_refs(q, k, v, s_dmask >= 0, P, False)
        assert_close_to_ref(out, out32, same)
        results.append(out.clone())
    assert not torch.equal(results[0], results[1])


def test_drop_counts_per_row_are_binomial():
    """The bits behave as independent draws, not only on average: over 1024 rows of 64 keys (B x H x
    seqlen_q, 65k pairs) the drop count per row has the binomial variance N p (1 - p) (to 30%, about 7
    standard errors) and drops are uncorrelated between neighbouring heads, batch entries, queries and
    keys (|r| < 0.03, about 7 standard errors). flash-attn's tests check the drop fraction of one-query
    rows with a bound only its own stream is sure to meet (tests/upstream/skips.py, RNG_STREAM)."""
    batch, nheads, seqlen_q, seqlen_k = 8, 4, 32, 64
    q = torch.randn(batch, seqlen_q, nheads, 32, device=DEVICE, dtype=torch.float16)
    k = torch.randn(batch, seqlen_k, 1, 32, device=DEVICE, dtype=torch.float16)
    _, _, s_dmask = flash_attn_func(q, k, k, P, return_attn_probs=True)
    drop = (s_dmask[..., :seqlen_q, :seqlen_k] < 0).double()  # (batch, nheads, seqlen_q, seqlen_k)
    assert abs(drop.mean().item() - P) <= 0.01
    ratio = drop.sum(-1).var().item() / (seqlen_k * P * (1 - P))
    assert 0.7 <= ratio <= 1.3, ratio
    for a, b, what in ((drop[:, :-1], drop[:, 1:], "heads"), (drop[:-1], drop[1:], "batch entries"),
                       (drop[:, :, :-1], drop[:, :, 1:], "queries"), (drop[..., :-1], drop[..., 1:], "keys")):
        r = torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1].item()
        assert abs(r) < 0.03, f"drops correlated between neighbouring {what}: r = {r:.3f}"
