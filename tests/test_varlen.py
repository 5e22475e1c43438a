"""Packed variable-length prefill (tritonattn.flash_attn_varlen_func), forward and backward.

Two yardsticks: each sequence run alone through tritonattn.flash_attn_func (the same kernels in dense
mode: bit-identical under the interpreter, within rounding on a GPU), and the fp32 reference per
sequence under flash-attn's error rule (2x eager same-dtype error forward, 3x for gradients).
Lengths 0 and 1, MHA/GQA/MQA, causal with seqlen_q != seqlen_k per sequence, non-contiguous views;
cu_seqlens validation; deterministic backward. Small shapes in fp16/fp32 under the interpreter,
larger ones and bf16 on a GPU.
"""

from __future__ import annotations

import random

import pytest
import torch

from helpers import DEVICE, INTERPRET, ON_GPU, assert_close_to_ref, assert_lse_close
from tritonattn import attention_ref, flash_attn_func, flash_attn_varlen_func, rel_err
from tritonattn.testing import agreement_tolerance


# --------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------
def cu_seqlens(lengths, device=DEVICE) -> torch.Tensor:
    """Prefix sums [0, l0, l0 + l1, ...] as int32 (flash-attn's cu_seqlens)."""
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32, device=device)


def make_packed(lens_q, lens_k, nheads, nheads_k, head_dim, dtype, layout="contiguous", seed=0):
    """Packed q (total_q, h, d), k, v (total_k, h_kv, d) and their cu_seqlens.

    layout "contiguous": three tensors; "qkv_packed": slices of one (total, h + 2 h_kv, d) buffer
    (needs lens_q == lens_k); "strided": (total, h, d + 8) buffers sliced to d, NaN in the padding.
    """
    gen = torch.Generator(device=DEVICE)
    gen.manual_seed(seed)
    tq, tk = sum(lens_q), sum(lens_k)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=DEVICE, dtype=torch.float32).to(dtype)

    if layout == "contiguous":
        q, k, v = randn(tq, nheads, head_dim), randn(tk, nheads_k, head_dim), randn(tk, nheads_k, head_dim)
    elif layout == "qkv_packed":
        assert list(lens_q) == list(lens_k)
        buf = randn(tq, nheads + 2 * nheads_k, head_dim)
        q, k, v = buf[:, :nheads], buf[:, nheads: nheads + nheads_k], buf[:, nheads + nheads_k:]
    elif layout == "strided":
        def padded(total, h):
            buf = randn(total, h, head_dim + 8)
            buf[..., head_dim:] = float("nan")
            return buf[..., :head_dim]

        q, k, v = padded(tq, nheads), padded(tk, nheads_k), padded(tk, nheads_k)
    else:
        raise ValueError(layout)
    return q, k, v, cu_seqlens(lens_q), cu_seqlens(lens_k)


def _slices(lens):
    start = 0
    for n in lens:
        yield slice(start, start + n)
        start += n


# --------------------------------------------------------------------------------------------
# Runners: (out, lse, dq, dk, dv), all packed like the varlen outputs
# --------------------------------------------------------------------------------------------
def run_varlen(q, k, v, lens_q, lens_k, dout, *, causal, deterministic=False):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out, lse = flash_attn_varlen_func(q, k, v, cu_seqlens(lens_q), cu_seqlens(lens_k), max(lens_q), max(lens_k),
                                      causal=causal, deterministic=deterministic, return_softmax_lse=True)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    return out.detach(), lse, dq, dk, dv


def run_per_sequence(fn, q, k, v, lens_q, lens_k, dout):
    """fn(q, k, v) -> (out (1, m, h, d), lse (1, h, m)) on each sequence alone; outputs re-packed."""
    outs, lses, dqs, dks, dvs = [], [], [], [], []
    for sq, sk in zip(_slices(lens_q), _slices(lens_k)):
        qb, kb, vb = (t.detach()[s].unsqueeze(0).clone().requires_grad_() for t, s in ((q, sq), (k, sk), (v, sk)))
        out, lse = fn(qb, kb, vb)
        dq, dk, dv = torch.autograd.grad(out, (qb, kb, vb), dout[sq].unsqueeze(0).to(out.dtype))
        outs.append(out.detach()[0])
        lses.append(lse[0])
        dqs.append(dq[0])
        dks.append(dk[0])
        dvs.append(dv[0])
    return torch.cat(outs), torch.cat(lses, dim=1), torch.cat(dqs), torch.cat(dks), torch.cat(dvs)


def dense_kernel(causal):
    return lambda a, b, c: flash_attn_func(a, b, c, causal=causal, return_softmax_lse=True)


def reference(causal, upcast=True):
    """attention_ref on one sequence: the fp32 ground truth (give it fp32 leaves) or, with
    upcast=False, PyTorch's own same-dtype result."""
    return lambda a, b, c: attention_ref(a, b, c, causal=causal, upcast=upcast)


def assert_same(got, want, name, dtype, msg):
    """varlen == the sequence alone: exactly under the interpreter (the same tile arithmetic); on a GPU
    within agreement_tolerance, as the two compiled variants may round differently (the dense one may
    load through TMA)."""
    assert got.shape == want.shape, f"{name} shape {tuple(got.shape)} != {tuple(want.shape)} {msg}"
    if INTERPRET:
        assert torch.equal(got, want), f"{name} differs from the sequence run alone {msg}"
    elif name == "lse":
        inf = torch.isposinf(want)
        assert torch.equal(torch.isposinf(got), inf), f"lse +inf rows differ {msg}"
        diff = (got[~inf] - want[~inf]).abs()
        assert diff.numel() == 0 or diff.max().item() <= 1e-3, f"lse max diff {diff.max().item():.3e} {msg}"
    else:
        err, tol = rel_err(got, want), agreement_tolerance(dtype)
        assert err <= tol, f"{name} rel diff {err:.3e} > {tol:.1e} vs the sequence alone {msg}"


# --------------------------------------------------------------------------------------------
# Grids
# --------------------------------------------------------------------------------------------
# (lens_q, lens_k) per sequence: equal lengths with 0 and 1; seqlen_q < and > seqlen_k (causal rows
# that see nothing), a sequence with queries but no key, and one with keys but no query.
if ON_GPU:
    LENGTHS = {
        "same": ([1, 17, 0, 113, 1023, 64, 300], [1, 17, 0, 113, 1023, 64, 300]),
        "diff": ([113, 1, 1023, 0, 200, 17, 5], [1023, 17, 113, 40, 0, 17, 300]),
    }
    HEADS = [(16, 16), (16, 4), (12, 4), (16, 1)]
    HEAD_DIMS = [64, 80, 128, 256]
    DTYPES = [torch.float16, torch.bfloat16]
    _all = [(name, h, d, causal, dt) for name in LENGTHS for h in HEADS for d in HEAD_DIMS
            for causal in (False, True) for dt in DTYPES]
    CASES = random.Random(0).sample(_all, 32)
    REF_CASES = CASES[:16]
else:
    LENGTHS = {
        "same": ([5, 0, 1, 40, 17], [5, 0, 1, 40, 17]),
        "diff": ([17, 1, 40, 0, 9, 3], [33, 1, 20, 7, 0, 3]),
    }
    CASES = [
        ("same", (4, 4), 32, True, torch.float16),
        ("diff", (4, 2), 32, True, torch.float16),
        ("diff", (4, 1), 32, False, torch.float16),
        ("same", (4, 2), 32, False, torch.float32),
        ("diff", (4, 1), 32, True, torch.float32),
        ("diff", (6, 2), 80, True, torch.float16),
        ("same", (4, 1), 80, False, torch.float16),
    ]
    REF_CASES = [CASES[1], CASES[4], CASES[5]]


def _id(case):
    name, (h, hk), d, causal, dt = case
    return f"{name}-h{h}:{hk}-d{d}-{'causal' if causal else 'full'}-{str(dt)[6:]}"


def _inputs(case, seed=0):
    name, (h, hk), d, causal, dtype = case
    lens_q, lens_k = LENGTHS[name]
    q, k, v, _, _ = make_packed(lens_q, lens_k, h, hk, d, dtype, seed=seed)
    dout = torch.randn(q.shape, device=DEVICE, dtype=torch.float32).to(dtype)
    return q, k, v, dout, lens_q, lens_k, causal, dtype


# --------------------------------------------------------------------------------------------
# Against each sequence run alone, and against the reference
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_matches_each_sequence_alone(case):
    """out, LSE, dq, dk, dv equal those of each sequence run alone through flash_attn_func."""
    q, k, v, dout, lens_q, lens_k, causal, dtype = _inputs(case)
    got = run_varlen(q, k, v, lens_q, lens_k, dout, causal=causal)
    want = run_per_sequence(dense_kernel(causal), q, k, v, lens_q, lens_k, dout)
    for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        assert torch.isfinite(g).all() or name == "lse", f"non-finite {name} {_id(case)}"
        assert_same(g, w, name, dtype, _id(case))


@pytest.mark.parametrize("case", REF_CASES, ids=[_id(c) for c in REF_CASES])
def test_matches_reference(case):
    """Forward and gradients within tritonattn.testing's bounds (FWD_FACTOR, GRAD_FACTOR) of the fp32 reference."""
    q, k, v, dout, lens_q, lens_k, causal, dtype = _inputs(case, seed=1)
    out, lse, dq, dk, dv = run_varlen(q, k, v, lens_q, lens_k, dout, causal=causal)
    ref = run_per_sequence(reference(causal), q.float(), k.float(), v.float(), lens_q, lens_k, dout.float())
    same = ref if dtype == torch.float32 else run_per_sequence(reference(causal, upcast=False), q, k, v,
                                                               lens_q, lens_k, dout)
    assert_close_to_ref(out, ref[0], same[0], msg=_id(case))
    assert_lse_close(lse, ref[1], dtype, msg=_id(case))
    for name, g, r, e in zip(("dq", "dk", "dv"), (dq, dk, dv), ref[2:], same[2:]):
        assert g.dtype == dtype and torch.isfinite(g).all(), f"{name} dtype / non-finite {_id(case)}"
        print(f"{name}: rel err {rel_err(g, r):.3e}")
        assert_close_to_ref(g, r, e, grad=True, msg=f"{name} {_id(case)}")


@pytest.mark.parametrize("layout", ["qkv_packed", "strided"])
def test_non_contiguous_views(layout):
    """Slices of a packed QKV buffer and padded-stride views give the results of each sequence alone."""
    lens = [7, 1, 0, 40] if not ON_GPU else [7, 1, 0, 400, 129]
    q, k, v, _, _ = make_packed(lens, lens, 4, 2, 64, torch.float16, layout=layout, seed=2)
    dout = torch.randn(q.shape, device=DEVICE).to(torch.float16)
    got = run_varlen(q, k, v, lens, lens, dout, causal=True)
    want = run_per_sequence(dense_kernel(True), q, k, v, lens, lens, dout)
    for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        assert_same(g, w, name, torch.float16, layout)


# --------------------------------------------------------------------------------------------
# Layout of the LSE, empty rows, empty batches
# --------------------------------------------------------------------------------------------
def test_lse_layout_and_empty_rows():
    """LSE is (nheads, total_q) float32; rows that see no key get out = 0, LSE = +inf, dq = 0."""
    lens_q, lens_k = [3, 4, 2], [5, 0, 1]  # sequence 1 has no key; causal, sequence 2's first row sees none
    q, k, v, cu_q, cu_k = make_packed(lens_q, lens_k, 4, 2, 32, torch.float16, seed=3)
    out, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 4, 5, causal=True, return_softmax_lse=True)
    assert out.shape == q.shape and lse.shape == (4, 9) and lse.dtype == torch.float32
    empty = torch.tensor([False] * 3 + [True] * 4 + [True, False], device=DEVICE)
    assert torch.equal(torch.isposinf(lse), empty[None].expand(4, 9))
    assert torch.all(out[empty] == 0)
    for b, (sq, sk) in enumerate(zip(_slices(lens_q), _slices(lens_k))):
        _, ref_lse = attention_ref(q[sq][None].float(), k[sk][None].float(), v[sk][None].float(), causal=True)
        assert_lse_close(lse[:, sq], ref_lse[0], torch.float16, msg=f"sequence {b}")
    q.requires_grad_()
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 4, 5, causal=True)
    (dq,) = torch.autograd.grad(out, (q,), torch.ones_like(out))
    assert torch.all(dq[empty] == 0) and torch.isfinite(dq).all()


@pytest.mark.parametrize("lens_q,lens_k", [([], []), ([0, 0], [3, 2]), ([2, 3], [0, 0])],
                         ids=["no-sequence", "no-query", "no-key"])
def test_empty_batches(lens_q, lens_k):
    """No sequence, no query anywhere or no key anywhere: zeros / empty outputs and gradients, no NaN."""
    q, k, v, cu_q, cu_k = make_packed(lens_q, lens_k, 4, 2, 32, torch.float16, seed=4)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q, default=0), max(lens_k, default=0),
                                      return_softmax_lse=True)
    assert out.shape == q.shape and lse.shape == (4, sum(lens_q))
    assert torch.all(out == 0) and torch.all(torch.isposinf(lse))
    grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    assert all(g.shape == t.shape and torch.all(g == 0) for g, t in zip(grads, (q, k, v)))


def test_lse_not_differentiable_and_no_grad_path():
    """Without requires_grad the result is the same; under autograd the LSE is not differentiable."""
    lens = [9, 33]
    q, k, v, cu_q, cu_k = make_packed(lens, lens, 4, 1, 32, torch.float16, seed=5)
    out0, lse0 = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 33, 33, causal=True, return_softmax_lse=True)
    q.requires_grad_()
    out1, lse1 = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 33, 33, causal=True, return_softmax_lse=True)
    assert out1.requires_grad and not lse1.requires_grad
    assert torch.equal(out0, out1.detach()) and torch.equal(lse0, lse1)


@pytest.mark.parametrize("deterministic", [False, True])
def test_backward_bit_identical(deterministic):
    """Two backward passes on the same packed inputs give bit-identical dq, dk, dv."""
    if ON_GPU:
        lens_q, lens_k, (h, hk), d, dtype = [1, 700, 0, 1500], [1, 900, 33, 1500], (16, 4), 128, torch.bfloat16
    else:
        lens_q, lens_k, (h, hk), d, dtype = [1, 40, 0, 17], [1, 45, 3, 17], (4, 2), 32, torch.float16
    q, k, v, _, _ = make_packed(lens_q, lens_k, h, hk, d, dtype, seed=6)
    dout = torch.randn(q.shape, device=DEVICE).to(dtype)
    runs = [run_varlen(q, k, v, lens_q, lens_k, dout, causal=True, deterministic=deterministic)[2:]
            for _ in range(2)]
    for a, b in zip(*runs):
        assert torch.equal(a, b)


# --------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------
def _valid_args():
    q, k, v, cu_q, cu_k = make_packed([3, 5], [4, 6], 4, 2, 32, torch.float16, seed=7)
    return dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=5, max_seqlen_k=6)


def _call(**overrides):
    args = _valid_args()
    args.update(overrides)
    return flash_attn_varlen_func(**args)


def _cu(values, dtype=torch.int32, device=DEVICE):
    return torch.tensor(values, dtype=dtype, device=device)


# Checks that need no device sync: they hold for cu_seqlens on any device.
SHAPE_ERRORS = {
    "int64": (dict(cu_seqlens_q=_cu([0, 3, 8], torch.int64)), TypeError, "torch.int32"),
    "list": (dict(cu_seqlens_k=[0, 4, 10]), TypeError, "torch.Tensor"),
    "2d": (dict(cu_seqlens_q=_cu([[0, 3, 8]])), ValueError, "1-D"),
    "empty": (dict(cu_seqlens_q=_cu([]), cu_seqlens_k=_cu([])), ValueError, "1-D"),
    "batch-mismatch": (dict(cu_seqlens_k=_cu([0, 10])), ValueError, "same batch"),
    "max-negative": (dict(max_seqlen_q=-1), ValueError, "max_seqlen_q >= 0"),
    "max-float": (dict(max_seqlen_k=6.0), TypeError, "Python int"),
    "max-tensor": (dict(max_seqlen_k=_cu(6)), TypeError, "Python int"),
    "q-4d": (dict(q=torch.zeros(1, 8, 4, 32, dtype=torch.float16, device=DEVICE)), ValueError, "3 dims"),
    "head-ratio": (dict(q=torch.zeros(8, 3, 32, dtype=torch.float16, device=DEVICE)), ValueError, "divisible"),
    "dropout_p of 1": (dict(dropout_p=1.0), ValueError, "dropout_p"),
}
# Checks of the values: run only for CPU cu_seqlens (the interpreter's case); CUDA ones are trusted.
VALUE_ERRORS = {
    "not-monotone": (dict(cu_seqlens_q=_cu([0, 5, 3, 8]), cu_seqlens_k=_cu([0, 4, 6, 10])), "non-decreasing"),
    "last-not-total": (dict(cu_seqlens_k=_cu([0, 4, 9])), r"cu_seqlens_k\[-1\] \(9\) to equal"),
    "first-not-zero": (dict(cu_seqlens_q=_cu([1, 3, 8])), r"cu_seqlens_q\[0\] == 0"),
    "max-too-small": (dict(max_seqlen_q=4), "longest sequence"),
}


@pytest.mark.parametrize("name", list(SHAPE_ERRORS))
def test_bad_arguments_raise(name):
    """Wrong dtype / shape / batch of cu_seqlens, bad max_seqlen, bad q/k/v raise clear errors."""
    overrides, exc, pattern = SHAPE_ERRORS[name]
    with pytest.raises(exc, match=pattern):
        _call(**overrides)


@pytest.mark.skipif(not INTERPRET, reason="value checks need cu_seqlens on the CPU, i.e. the interpreter")
@pytest.mark.parametrize("name", list(VALUE_ERRORS))
def test_bad_cu_seqlens_values_raise(name):
    """CPU cu_seqlens that do not start at 0, decrease, miss the total or exceed max_seqlen raise."""
    overrides, pattern = VALUE_ERRORS[name]
    with pytest.raises(ValueError, match=pattern):
        _call(**overrides)


@pytest.mark.gpu
def test_cu_seqlens_on_another_device_raise():
    """CPU cu_seqlens with CUDA q/k/v raise (the kernels read cu_seqlens on the device)."""
    with pytest.raises(ValueError, match="device"):
        _call(cu_seqlens_q=_cu([0, 3, 8], device="cpu"))


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_long_packed_batch_gpu(causal):
    """A packed batch of long prompts (GQA 32:8, d=128, bf16) matches the reference per sequence."""
    lens = [4096, 1, 2048, 0, 3000, 777]
    q, k, v, cu_q, cu_k = make_packed(lens, lens, 32, 8, 128, torch.bfloat16, seed=8)
    out, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens), max(lens), causal=causal,
                                      return_softmax_lse=True)
    for b, s in enumerate(_slices(lens)):
        ref, ref_lse = attention_ref(q[s][None].float(), k[s][None].float(), v[s][None].float(), causal=causal)
        same, _ = attention_ref(q[s][None], k[s][None], v[s][None], causal=causal, upcast=False)
        assert_close_to_ref(out[s][None], ref.float(), same, msg=f"sequence {b}")
        assert_lse_close(lse[:, s], ref_lse[0], torch.bfloat16, msg=f"sequence {b}")


@pytest.mark.parametrize("causal", [False, True])
def test_seqused_k_forward_backward_and_paged(causal):
    """seqused_k: each packed sequence attends to the first seqused_k[b] keys of its span (bottom-right causal
    over those), its gradients match the reference over the cut sequences, the keys past seqused_k get zero
    dk / dv, and a paged K/V (block_table) takes it too. CPU values past a span are refused."""
    dtype = torch.float16 if ON_GPU else torch.float32
    lens_q, lens_k, used = [5, 9, 1], [12, 9, 7], [7, 0, 7]
    nheads, nheads_k, head_dim = 4, 2, 32
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    seqused = torch.tensor(used, dtype=torch.int32, device=DEVICE)
    q = torch.randn(sum(lens_q), nheads, head_dim, device=DEVICE, dtype=dtype, requires_grad=True)
    k = torch.randn(sum(lens_k), nheads_k, head_dim, device=DEVICE, dtype=dtype, requires_grad=True)
    v = torch.randn(sum(lens_k), nheads_k, head_dim, device=DEVICE, dtype=dtype, requires_grad=True)
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal, seqused_k=seqused)
    dout = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    refs, grads = [], []
    for b in range(3):
        qs, ks, vs = (t.detach()[s: s + n].float().requires_grad_() for t, s, n in (
            (q, int(cu_q[b]), lens_q[b]), (k, int(cu_k[b]), used[b]), (v, int(cu_k[b]), used[b])))
        ref, _ = attention_ref(qs[None], ks[None], vs[None], causal=causal)
        refs.append(ref[0])
        grads.append(torch.autograd.grad(ref, (qs, ks, vs), dout[int(cu_q[b]): int(cu_q[b]) + lens_q[b]][None].float(),
                                         allow_unused=True))
    ref = torch.cat(refs)
    assert rel_err(out.detach().float(), ref) < (1e-5 if dtype == torch.float32 else 1e-2)
    assert rel_err(dq.float(), torch.cat([g[0] for g in grads])) < 2e-2
    for b in range(3):  # the used keys' gradients; zero past them
        start = int(cu_k[b])
        for got, ref_grad in ((dk, grads[b][1]), (dv, grads[b][2])):
            assert torch.count_nonzero(got[start + used[b]: start + lens_k[b]]) == 0
            if used[b]:
                assert rel_err(got[start: start + used[b]].float(), ref_grad) < 2e-2
    # a paged K/V with the same keys: one page per sequence
    page = max(lens_k)
    k_pool = torch.zeros(3, page, nheads_k, head_dim, device=DEVICE, dtype=dtype)
    v_pool = torch.zeros_like(k_pool)
    for b in range(3):
        k_pool[b, : lens_k[b]] = k.detach()[int(cu_k[b]): int(cu_k[b + 1])]
        v_pool[b, : lens_k[b]] = v.detach()[int(cu_k[b]): int(cu_k[b + 1])]
    table = torch.arange(3, dtype=torch.int32, device=DEVICE)[:, None]
    paged = flash_attn_varlen_func(q.detach(), k_pool, v_pool, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal,
                                   block_table=table, seqused_k=seqused)
    assert rel_err(paged.float(), out.detach().float()) < 1e-2
    if DEVICE.type == "cpu":
        with pytest.raises(ValueError, match="seqused_k"):
            flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), seqused_k=seqused + 6)
