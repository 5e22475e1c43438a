"""torch.compile over the public functions (kernels/_ops.py): dynamo traces each with fullgraph=True into
the registered custom ops, which pass torch.library.opcheck (schema, fake tensors, autograd
registration, AOT dispatch); compiled results and gradients equal the eager ones; lengths that change
do not recompile; dropout draws fresh bits per compiled call."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

import kernels._ops as ops
from helpers import DEVICE
from kernels import flash_attn_func

DTYPE = torch.float16 if DEVICE.type == "cuda" else torch.float32


def randn(*shape, grad=False):
    return torch.randn(*shape, device=DEVICE, dtype=DTYPE).requires_grad_(grad)


VARIANTS = {
    "plain": lambda: dict(),
    "causal": lambda: dict(causal=True),
    "all": lambda: dict(causal=True, window_size=(10, 0), softcap=5.0,
                        alibi_slopes=torch.rand(4, device=DEVICE),
                        sinks=torch.randn(4, device=DEVICE, requires_grad=True)),
}


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_flash_attn_func_traces_whole(variant, backend):
    torch._dynamo.reset()
    kw = VARIANTS[variant]()
    q, k, v = randn(2, 40, 4, 32, grad=True), randn(2, 40, 2, 32, grad=True), randn(2, 40, 2, 32, grad=True)
    leaves = [q, k, v] + ([kw["sinks"]] if "sinks" in kw else [])
    compiled = torch.compile(lambda q, k, v: flash_attn_func(q, k, v, **kw), fullgraph=True, backend=backend)
    out = compiled(q, k, v)
    grads = torch.autograd.grad(out.square().sum(), leaves)
    ref = flash_attn_func(q, k, v, **kw)
    ref_grads = torch.autograd.grad(ref.square().sum(), leaves)
    assert torch.equal(out, ref)
    for g, r in zip(grads, ref_grads):
        assert torch.equal(g, r)


def test_changing_lengths_do_not_recompile():
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(lambda q, k, v: flash_attn_func(q, k, v, causal=True), fullgraph=True, backend="eager",
                             dynamic=True)
    for n in (17, 29, 40):
        q, k = randn(1, n, 4, 32), randn(1, n, 2, 32)
        assert torch.equal(compiled(q, k, k), flash_attn_func(q, k, k, causal=True))
    assert counters["stats"]["unique_graphs"] == 1


def test_compiled_dropout_draws_fresh_bits():
    torch._dynamo.reset()
    q, k = randn(1, 33, 4, 32), randn(1, 33, 2, 32)
    compiled = torch.compile(lambda q, k: flash_attn_func(q, k, k, dropout_p=0.3), fullgraph=True, backend="aot_eager")
    assert not torch.equal(compiled(q, k), compiled(q, k))


def test_prefill_ops_pass_opcheck():
    q, k, v = randn(1, 33, 4, 32), randn(1, 33, 2, 32), randn(1, 33, 2, 32)
    sinks, slopes = torch.randn(4, device=DEVICE), torch.rand(4, device=DEVICE)
    tail = (slopes, sinks, None, 32**-0.5, True, 10, 0, 5.0, 0.0)
    dense = (None, None, 33, 33)
    torch.library.opcheck(ops.prefill_fwd, (q, k, v, *dense, *tail))
    out, lse = ops.prefill_fwd(q, k, v, *dense, *tail)
    torch.library.opcheck(ops.prefill_bwd, (torch.randn_like(out), q, k, v, out, lse, *dense, *tail))
    cu = torch.tensor([0, 12, 33], dtype=torch.int32, device=DEVICE)
    packed = (cu, cu, 21, 21)
    qp, kp, vp = q[0], k[0], v[0]
    torch.library.opcheck(ops.prefill_fwd, (qp, kp, vp, *packed, *tail))
    out, lse = ops.prefill_fwd(qp, kp, vp, *packed, *tail)
    torch.library.opcheck(ops.prefill_bwd, (torch.randn_like(out), qp, kp, vp, out, lse, *packed, *tail))


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_flash_attn_varlen_func_traces_whole(backend):
    from kernels import flash_attn_varlen_func

    torch._dynamo.reset()
    q, k, v = randn(50, 4, 32, grad=True), randn(60, 2, 32, grad=True), randn(60, 2, 32, grad=True)
    cu_q = torch.tensor([0, 20, 50], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, 25, 60], dtype=torch.int32, device=DEVICE)
    kw = dict(causal=True, window_size=(8, 0), sinks=torch.randn(4, device=DEVICE, requires_grad=True))
    leaves = [q, k, v, kw["sinks"]]

    def call(q, k, v):
        return flash_attn_varlen_func(q, k, v, cu_q, cu_k, 30, 35, **kw)

    compiled = torch.compile(call, fullgraph=True, backend=backend)
    out = compiled(q, k, v)
    grads = torch.autograd.grad(out.square().sum(), leaves)
    ref = call(q, k, v)
    ref_grads = torch.autograd.grad(ref.square().sum(), leaves)
    assert torch.equal(out, ref)
    for g, r in zip(grads, ref_grads):
        assert torch.equal(g, r)


@pytest.mark.parametrize("page_size", [0, 16], ids=lambda p: f"page{p}" if p else "dense")
def test_kvcache_decode_loop_traces_whole(page_size):
    """A decode step (append in place, attend with a window and sinks, advance the lengths on the
    device) compiled whole equals the eager step, caches included, step after step."""
    from helpers import paged_copy
    from kernels import flash_attn_with_kvcache

    torch._dynamo.reset()
    batch, capacity, nheads, nheads_k, head_dim = 3, 64, 4, 2, 32
    kw = dict(causal=True, window_size=(20, 0), sinks=torch.randn(nheads, device=DEVICE))
    k_cache, v_cache = randn(batch, capacity, nheads_k, head_dim), randn(batch, capacity, nheads_k, head_dim)
    table = None
    if page_size:
        k_cache, v_cache, table = paged_copy(k_cache, v_cache, page_size)
    lens = torch.tensor([0, 10, 40], dtype=torch.int32, device=DEVICE)

    def step(q, k, v, kc, vc, lens):
        out = flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens, block_table=table, **kw)
        lens.add_(1)
        return out

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    kc, vc, lens_eager = k_cache.clone(), v_cache.clone(), lens.clone()
    for _ in range(4):
        q, k, v = randn(batch, 1, nheads, head_dim), randn(batch, 1, nheads_k, head_dim), randn(batch, 1, nheads_k,
                                                                                              head_dim)
        assert torch.equal(compiled(q, k, v, k_cache, v_cache, lens), step(q, k, v, kc, vc, lens_eager))
        assert torch.equal(k_cache, kc) and torch.equal(v_cache, vc) and torch.equal(lens, lens_eager)


def test_kvcache_op_passes_opcheck():
    q, k = randn(3, 2, 4, 32), randn(3, 2, 2, 32)
    k_cache, v_cache = randn(3, 64, 2, 32), randn(3, 64, 2, 32)
    lens = torch.tensor([0, 10, 40], dtype=torch.int32, device=DEVICE)
    torch.library.opcheck(ops.kvcache, (q, k_cache, v_cache, k, k, lens, None, None, None, 32**-0.5, True, 20, 0, 0.0,
                                        0, True))


def test_packed_functions_trace_whole():
    """The packed variants call the traced functions: they compile whole too."""
    from kernels import flash_attn_kvpacked_func, flash_attn_qkvpacked_func, flash_attn_varlen_qkvpacked_func

    cu = torch.tensor([0, 10, 30], dtype=torch.int32, device=DEVICE)
    cases = [(lambda x: flash_attn_qkvpacked_func(x, causal=True), (randn(2, 30, 3, 4, 32),)),
             (lambda q, kv: flash_attn_kvpacked_func(q, kv, causal=True),
              (randn(2, 30, 4, 32), randn(2, 30, 2, 2, 32))),
             (lambda x: flash_attn_varlen_qkvpacked_func(x, cu, 20, causal=True), (randn(30, 3, 4, 32),))]
    for fn, args in cases:
        torch._dynamo.reset()
        assert torch.equal(torch.compile(fn, fullgraph=True, backend="eager")(*args), fn(*args))
