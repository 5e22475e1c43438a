"""torch.compile over the public functions (tritonattn.compile.ops): dynamo traces each with fullgraph=True into
the registered custom ops, which pass torch.library.opcheck (schema, fake tensors, autograd
registration, AOT dispatch); compiled results and gradients equal the eager ones; lengths that change
do not recompile; dropout draws fresh bits per compiled call."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

import tritonattn.compile.ops as ops
from helpers import DEVICE
from tritonattn import flash_attn_func

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
    scalars = (None, 32**-0.5, True, 10, 0, 5.0, 0.0, False)  # rng_state, scale, causal, window sides, softcap,
    # dropout, deterministic
    dense = (None, None, 33, 33)
    tail = (slopes, sinks, None, *scalars)  # no seqused_k: dense
    torch.library.opcheck(ops.prefill_fwd, (q, k, v, *dense, *tail))
    out, lse = ops.prefill_fwd(q, k, v, *dense, *tail)
    torch.library.opcheck(ops.prefill_bwd, (torch.randn_like(out), q, k, v, out, lse, *dense, *tail))
    cu = torch.tensor([0, 12, 33], dtype=torch.int32, device=DEVICE)
    packed = (cu, cu, 21, 21)
    qp, kp, vp = q[0], k[0], v[0]
    for seqused_k in (None, torch.tensor([7, 21], dtype=torch.int32, device=DEVICE)):
        tail = (slopes, sinks, seqused_k, *scalars)
        torch.library.opcheck(ops.prefill_fwd, (qp, kp, vp, *packed, *tail))
        out, lse = ops.prefill_fwd(qp, kp, vp, *packed, *tail)
        torch.library.opcheck(ops.prefill_bwd, (torch.randn_like(out), qp, kp, vp, out, lse, *packed, *tail))


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_flash_attn_varlen_func_traces_whole(backend):
    from tritonattn import flash_attn_varlen_func

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
    from tritonattn import flash_attn_with_kvcache

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
    torch.library.opcheck(ops.kvcache, (q, k_cache, v_cache, k, k, None, None, lens, None, None, None, None, None,
                                        32**-0.5, True, 20, 0, 0.0, False, 0, True))


def test_varlen_paged_op_passes_opcheck():
    from helpers import paged_copy

    k_cache, v_cache, table = paged_copy(randn(2, 64, 2, 32), randn(2, 64, 2, 32), 16)
    q = randn(30, 4, 32)
    cu_q = torch.tensor([0, 10, 30], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, 40, 90], dtype=torch.int32, device=DEVICE)
    seqused_k = torch.tensor([33, 50], dtype=torch.int32, device=DEVICE)
    torch.library.opcheck(ops.varlen_paged_fwd, (q, k_cache, v_cache, cu_q, cu_k, 20, 50, table, None, None,
                                                 seqused_k, 32**-0.5, True, -1, -1, 0.0))


def _kvcache_case(**extra):
    """A chunked append of 3 tokens into dense caches with the given flash_attn_with_kvcache arguments."""
    batch, capacity, nheads, nheads_k, head_dim = 3, 64, 4, 2, 32
    k_cache, v_cache = randn(batch, capacity, nheads_k, head_dim), randn(batch, capacity, nheads_k, head_dim)
    q, k, v = randn(batch, 3, nheads, head_dim), randn(batch, 3, nheads_k, head_dim), randn(batch, 3, nheads_k,
                                                                                          head_dim)
    lens = torch.tensor([0, 10, 40], dtype=torch.int32, device=DEVICE)
    return (q, k_cache, v_cache, k, v), dict(cache_seqlens=lens, causal=True, **extra)


KVCACHE_EXTRAS = {
    "rotary": lambda: dict(rotary_cos=randn(64, 8), rotary_sin=randn(64, 8)),
    "rotary-interleaved-window": lambda: dict(rotary_cos=randn(64, 16), rotary_sin=randn(64, 16),
                                              rotary_interleaved=True, window_size=(12, 0)),
    "batch-idx": lambda: dict(cache_batch_idx=torch.tensor([2, 0, 1], dtype=torch.int32, device=DEVICE)),
    "leftpad": lambda: dict(cache_leftpad=torch.tensor([0, 3, 7], dtype=torch.int32, device=DEVICE)),
    "int-lengths": lambda: dict(cache_seqlens=5, return_softmax_lse=True, softcap=4.0),
}


@pytest.mark.parametrize("extra", list(KVCACHE_EXTRAS))
def test_kvcache_arguments_trace_whole(extra):
    """Every flash_attn_with_kvcache argument compiles whole (rotary, cache_batch_idx, cache_leftpad, an
    int length) and gives the eager result, the appended caches included."""
    from tritonattn import flash_attn_with_kvcache

    torch._dynamo.reset()
    (q, k_cache, v_cache, k, v), kw = _kvcache_case()
    kw.update(KVCACHE_EXTRAS[extra]())
    compiled = torch.compile(lambda *a: flash_attn_with_kvcache(*a, **kw), fullgraph=True, backend="aot_eager")
    kc, vc = k_cache.clone(), v_cache.clone()
    got, want = compiled(q, k_cache, v_cache, k, v), flash_attn_with_kvcache(q, kc, vc, k, v, **kw)
    for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
        assert torch.equal(g, w)
    assert torch.equal(k_cache, kc) and torch.equal(v_cache, vc)


def test_full_caches_without_lengths_trace_whole():
    from tritonattn import flash_attn_with_kvcache

    torch._dynamo.reset()
    q, k_cache = randn(2, 1, 4, 32), randn(2, 40, 2, 32)
    compiled = torch.compile(lambda q, kc: flash_attn_with_kvcache(q, kc, kc), fullgraph=True, backend="eager")
    assert torch.equal(compiled(q, k_cache), flash_attn_with_kvcache(q, k_cache, k_cache))


def test_varlen_paged_traces_whole():
    """flash_attn_varlen_func over a paged K/V compiles whole (forward only, as eager)."""
    from helpers import paged_copy
    from tritonattn import flash_attn_varlen_func

    torch._dynamo.reset()
    k_cache, v_cache, table = paged_copy(randn(2, 64, 2, 32), randn(2, 64, 2, 32), 16)
    q = randn(30, 4, 32)
    cu_q = torch.tensor([0, 10, 30], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, 40, 90], dtype=torch.int32, device=DEVICE)

    def call(q, kc, vc):
        return flash_attn_varlen_func(q, kc, vc, cu_q, cu_k, 20, 50, causal=True, block_table=table,
                                      return_attn_probs=True)

    got, want = torch.compile(call, fullgraph=True, backend="eager")(q, k_cache, v_cache), call(q, k_cache, v_cache)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_cache_classes_run_eagerly_under_compile():
    """KVCache's methods keep host state: compiled code runs them outside the graph (same results as
    eager), and fullgraph=True refuses them rather than tracing host values."""
    from tritonattn import KVCache

    torch._dynamo.reset()
    caches = [KVCache(2, 32, 2, 32, dtype=DTYPE, device=DEVICE) for _ in range(2)]
    prompt = (randn(2, 5, 4, 32), randn(2, 5, 2, 32), randn(2, 5, 2, 32))
    for cache in caches:
        cache.prefill(*prompt)
    step = (randn(2, 1, 4, 32), randn(2, 1, 2, 32), randn(2, 1, 2, 32))
    compiled = torch.compile(lambda cache, q, k, v: cache.decode(q, k, v) * 2, backend="eager")
    assert torch.equal(compiled(caches[0], *step), caches[1].decode(*step) * 2)
    assert caches[0].seqlens == caches[1].seqlens == [6, 6]
    strict = torch.compile(lambda cache, q, k, v: cache.decode(q, k, v), fullgraph=True, backend="eager")
    with pytest.raises(Exception, match="disable"):
        strict(caches[0], *step)


def test_packed_functions_trace_whole():
    """The packed variants call the traced functions: they compile whole too."""
    from tritonattn import flash_attn_kvpacked_func, flash_attn_qkvpacked_func, flash_attn_varlen_qkvpacked_func

    cu = torch.tensor([0, 10, 30], dtype=torch.int32, device=DEVICE)
    cases = [(lambda x: flash_attn_qkvpacked_func(x, causal=True), (randn(2, 30, 3, 4, 32),)),
             (lambda q, kv: flash_attn_kvpacked_func(q, kv, causal=True),
              (randn(2, 30, 4, 32), randn(2, 30, 2, 2, 32))),
             (lambda x: flash_attn_varlen_qkvpacked_func(x, cu, 20, causal=True), (randn(30, 3, 4, 32),))]
    for fn, args in cases:
        torch._dynamo.reset()
        assert torch.equal(torch.compile(fn, fullgraph=True, backend="eager")(*args), fn(*args))


# ---------------------------------------------------------------------------------------------
# GPU: inductor and CUDA graphs (mode="reduce-overhead")
# ---------------------------------------------------------------------------------------------
def _layer(attn="kernels"):
    from benchmarks.compile import AttentionLayer

    torch.manual_seed(0)
    return AttentionLayer(embed=512, nheads=8, nheads_k=2, attn=attn).to(DEVICE, DTYPE)


@pytest.mark.gpu
def test_inductor_attention_layer_forward_backward_equals_eager():
    """Projections, rotary, attention and output projection compiled whole by inductor (fullgraph):
    the output and every gradient agree with the eager layer's."""
    from benchmarks.compile import rotary_tables
    from tritonattn.testing import rel_err

    torch._dynamo.reset()
    layer = _layer()
    cos, sin = rotary_tables(300, 64, DEVICE, DTYPE)
    x = randn(2, 300, 512, grad=True)
    dout = torch.randn_like(x)
    params = [x, *layer.parameters()]
    out = torch.compile(layer, fullgraph=True)(x, cos, sin)
    grads = torch.autograd.grad(out, params, dout)
    ref = layer(x, cos, sin)
    ref_grads = torch.autograd.grad(ref, params, dout)
    assert rel_err(out, ref) < 2e-3
    for g, r in zip(grads, ref_grads):
        assert rel_err(g, r) < 5e-3


def _counting_replays(monkeypatch) -> list:
    """Count CUDA graph replays (cudagraph trees replay through torch.cuda.CUDAGraph.replay)."""
    replays = []
    replay = torch.cuda.CUDAGraph.replay

    def counted(self, *args, **kwargs):
        replays.append(1)
        return replay(self, *args, **kwargs)

    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", counted)
    return replays


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [0, 16], ids=lambda p: f"page{p}" if p else "dense")
def test_reduce_overhead_decode_replays_cuda_graphs(page_size, monkeypatch):
    """64 decode steps of an attention layer (rotary inside flash_attn_with_kvcache, the append in
    place, the lengths advanced on the device) under mode="reduce-overhead": CUDA graphs replay, the
    changing lengths recompile nothing, and every step and the caches agree with the eager layer."""
    from benchmarks.compile import rotary_tables
    from helpers import paged_copy
    from tritonattn import flash_attn_with_kvcache
    from tritonattn.testing import rel_err

    torch._dynamo.reset()
    layer = _layer()
    batch, capacity = 4, 256
    cos, sin = rotary_tables(capacity, 64, DEVICE, DTYPE)
    k_cache, v_cache = randn(batch, capacity, 2, 64), randn(batch, capacity, 2, 64)
    table = None
    if page_size:
        k_cache, v_cache, table = paged_copy(k_cache, v_cache, page_size)
    lens = torch.tensor([0, 5, 60, 100], dtype=torch.int32, device=DEVICE)

    def step(x, k_cache, v_cache, lens):
        q, k, v = layer._qkv(x)
        o = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos=cos, rotary_sin=sin, cache_seqlens=lens,
                                    block_table=table, causal=True)
        lens.add_(1)
        return x + layer.out(o.reshape(batch, 1, -1))

    state = [k_cache, v_cache, lens]
    eager_state = [t.clone() for t in state]
    for t in state:  # CUDA graphs mutate these in place: they must keep their addresses
        torch._dynamo.mark_static_address(t)
    replays = _counting_replays(monkeypatch)
    compiled = torch.compile(step, mode="reduce-overhead", fullgraph=True)
    with torch.no_grad(), torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(64):
            x = randn(batch, 1, 512)
            out, ref = compiled(x, *state), step(x, *eager_state)
            assert rel_err(out, ref) < 2e-3
    assert len(replays) >= 60
    assert torch.equal(lens, eager_state[2]) and lens.tolist() == [64, 69, 124, 164]
    for got, want in zip(state[:2], eager_state[:2]):
        assert rel_err(got, want) < 2e-3


def test_inductor_transposed_inputs_forward_backward():
    """Inductor checks the ops' output strides against their fakes at run time: q, k, v as transposed
    views of (batch, nheads, seqlen, headdim) tensors (what attention layers pass) compile forward and
    backward, and equal eager."""
    torch._dynamo.reset()
    q, k, v = (randn(2, h, 33, 32).transpose(1, 2).detach().requires_grad_() for h in (4, 2, 2))
    compiled = torch.compile(lambda q, k, v: flash_attn_func(q, k, v, causal=True) * 2, fullgraph=True)
    out = compiled(q, k, v)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    ref = flash_attn_func(q, k, v, causal=True) * 2
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    assert torch.allclose(out, ref, rtol=1e-3, atol=1e-3)
    for g, r in zip(grads, ref_grads):
        assert torch.allclose(g, r, rtol=1e-3, atol=1e-3)


def test_compiled_calls_check_what_eager_checks():
    """Under compile: a bad dropout_p raises InputError as in eager (with fullgraph=True dynamo reports it
    as an exception it observed, our message inside), softmax_lse takes no gradient as in eager, and a
    paged varlen call refuses a backward with eager's message."""
    from helpers import paged_copy
    from tritonattn import InputError, flash_attn_varlen_func

    torch._dynamo.reset()
    q, k = randn(1, 17, 4, 32, grad=True), randn(1, 17, 2, 32, grad=True)
    for p in (-0.5, 1.5):
        with pytest.raises(InputError, match="dropout_p"):
            torch.compile(lambda q, k: flash_attn_func(q, k, k, dropout_p=p), backend="eager")(q, k)
        torch._dynamo.reset()
        with pytest.raises(Exception, match=r"Expected dropout_p in \[0, 1\)"):
            torch.compile(lambda q, k: flash_attn_func(q, k, k, dropout_p=p), fullgraph=True, backend="eager")(q, k)
    out, lse, _ = torch.compile(lambda q, k: flash_attn_func(q, k, k, return_attn_probs=True), fullgraph=True,
                                backend="aot_eager")(q, k)
    assert out.requires_grad and not lse.requires_grad
    k_cache, v_cache, table = paged_copy(randn(2, 64, 2, 32), randn(2, 64, 2, 32), 16)
    k_cache.requires_grad_()
    cu_q = torch.tensor([0, 10, 30], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, 40, 90], dtype=torch.int32, device=DEVICE)
    def paged(q, kc):
        return flash_attn_varlen_func(q, kc, v_cache, cu_q, cu_k, 20, 50, block_table=table)

    compiled = torch.compile(paged, fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match="is forward only"):  # AOT autograd traces the backward when compiling
        compiled(randn(30, 4, 32), k_cache).sum().backward()


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [100, 72])
def test_inductor_odd_head_dims(head_dim):
    """A head dim that is not a multiple of 8 (on Hopper the eager paths return views of padded
    buffers): inductor forward + backward and a compiled chunked kvcache call equal eager."""
    from tritonattn import flash_attn_with_kvcache
    from tritonattn.testing import rel_err

    torch._dynamo.reset()
    q, k, v = (randn(2, 70, h, head_dim, grad=True) for h in (4, 2, 2))
    out = torch.compile(lambda q, k, v: flash_attn_func(q, k, v, causal=True), fullgraph=True)(q, k, v)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    ref = flash_attn_func(q, k, v, causal=True)
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    assert rel_err(out, ref) < 1e-3 and all(rel_err(g, r) < 1e-3 for g, r in zip(grads, ref_grads))
    k_cache, v_cache = randn(2, 512, 2, head_dim), randn(2, 512, 2, head_dim)
    chunk = [randn(2, 200, h, head_dim) for h in (4, 2, 2)]
    lens = torch.tensor([0, 100], dtype=torch.int32, device=DEVICE)
    kc, vc = k_cache.clone(), v_cache.clone()
    got = torch.compile(lambda *a: flash_attn_with_kvcache(*a, cache_seqlens=lens, causal=True),
                        fullgraph=True)(chunk[0], k_cache, v_cache, chunk[1], chunk[2])
    want = flash_attn_with_kvcache(chunk[0], kc, vc, chunk[1], chunk[2], cache_seqlens=lens, causal=True)
    assert rel_err(got, want) < 1e-3 and torch.equal(k_cache, kc) and torch.equal(v_cache, vc)
