"""Any head dim in [1, 256] on every path: prefill forward and backward, varlen, KV-cache decode (dense
and paged, split or not, with partial appends) and chunked prefill.

The kernels pad the head-dim tile to a power of two (at least 16) and mask the columns past the real
head dim. Each input here is a view of a wider buffer whose columns past head_dim hold NaN: a kernel
that reads one poisons its output. Each cache is such a view too, and its NaN columns must still be
NaN after an append: a kernel that writes one is caught. The buffers are 16-byte-wide multiples, so on
Hopper the tensor-descriptor (TMA) paths, which clip the padded box at the real head dim, run as well.
Head dims: odd ones (1, 13, 36, 72, 200 on the interpreter; 13, 100, 250 on a GPU) and, on a GPU,
the common 64, 96, 128, 192 and 256. `test_aligned_copies` runs the copies Hopper makes of unaligned
rows (kernels/tritonattn/launch/prefill.py `_aligned_operands`) on any device by planning them with the pointer path.
"""

from __future__ import annotations

import pytest
import torch

import tritonattn.launch.decode as decode
import tritonattn.launch.prefill as prefill_launch
from helpers import DEVICE, INTERPRET, ON_GPU, assert_close_to_ref, assert_lse_close, per_request_references
from tritonattn import attention_ref, flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache

HEAD_DIMS = [13, 100, 250, 64, 96, 128, 192, 256] if ON_GPU else [1, 13, 36, 72, 200]
DTYPES = [torch.float16, torch.bfloat16] if ON_GPU else [torch.float16]
NHEADS, NHEADS_K = 4, 2


def poisoned(*shape, dtype, seed):
    """Standard-normal values of `shape` as a view of a buffer 8 to 15 columns wider (a multiple of 8
    in all), whose extra columns hold NaN."""
    head_dim = shape[-1]
    width = (head_dim + 7) // 8 * 8 + 8
    gen = torch.Generator(device=DEVICE)
    gen.manual_seed(seed)
    buf = torch.randn(*shape[:-1], width, generator=gen, device=DEVICE, dtype=torch.float32).to(dtype)
    buf[..., head_dim:] = float("nan")
    return buf[..., :head_dim]


def assert_padding_untouched(cache: torch.Tensor, msg: str = "") -> None:
    """The NaN columns of `poisoned`'s buffer behind `cache` are all still NaN."""
    width = cache.stride(-2) if cache.dim() > 1 else cache.shape[-1]
    head_dim = cache.shape[-1]
    buf = torch.as_strided(cache, (*cache.shape[:-1], width), (*cache.stride()[:-1], 1))
    assert torch.isnan(buf[..., head_dim:]).all(), f"a kernel wrote past head_dim={head_dim} {msg}"


def grads_and_refs(fn, ref_fn, inputs, dout):
    """(out, grads) of fn and (out, grads) of ref_fn in fp32 and in the inputs' dtype."""
    def run(f, tensors, g):
        leaves = [t.detach().requires_grad_() for t in tensors]  # views keep the poisoned strides
        out = f(*leaves)
        return (out, *torch.autograd.grad(out, leaves, g))

    ours = run(fn, inputs, dout)
    ref32 = run(ref_fn, [t.float() for t in inputs], dout.float())
    same = ref32 if inputs[0].dtype == torch.float32 else run(lambda *t: ref_fn(*t, upcast=False), inputs, dout)
    return ours, ref32, same


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: str(t)[6:])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS, ids=lambda d: f"d{d}")
def test_prefill_forward_and_grads(head_dim, causal, dtype):
    """flash_attn_func and its backward (GQA, seqlen_q != seqlen_k) match the reference at any head dim."""
    m, n = (257, 301) if ON_GPU else (19, 23)
    q = poisoned(2, m, NHEADS, head_dim, dtype=dtype, seed=1)
    k = poisoned(2, n, NHEADS_K, head_dim, dtype=dtype, seed=2)
    v = poisoned(2, n, NHEADS_K, head_dim, dtype=dtype, seed=3)
    dout = torch.randn(2, m, NHEADS, head_dim, device=DEVICE, dtype=dtype)
    ours, ref32, same = grads_and_refs(lambda *t: flash_attn_func(*t, causal=causal),
                                       lambda *t, **kw: attention_ref(*t, causal=causal, **kw)[0], [q, k, v], dout)
    for name, got, want, eager in zip(("out", "dq", "dk", "dv"), ours, ref32, same):
        assert_close_to_ref(got, want, eager, grad=name != "out", msg=f"{name} head_dim={head_dim}")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: str(t)[6:])
@pytest.mark.parametrize("head_dim", HEAD_DIMS, ids=lambda d: f"d{d}")
def test_varlen_forward_and_grads(head_dim, dtype):
    """flash_attn_varlen_func (causal, lengths 0, 1 and longer, seqlen_q != seqlen_k) at any head dim,
    each sequence against its own reference."""
    lens_q, lens_k = ([1, 0, 130, 67], [9, 0, 70, 67]) if ON_GPU else ([1, 0, 13, 7], [5, 0, 9, 7])
    cu_q = torch.tensor([0] + torch.tensor(lens_q).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0] + torch.tensor(lens_k).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    q = poisoned(sum(lens_q), NHEADS, head_dim, dtype=dtype, seed=4)
    k = poisoned(sum(lens_k), NHEADS_K, head_dim, dtype=dtype, seed=5)
    v = poisoned(sum(lens_k), NHEADS_K, head_dim, dtype=dtype, seed=6)
    dout = torch.randn(sum(lens_q), NHEADS, head_dim, device=DEVICE, dtype=dtype)

    def ref(q, k, v, upcast=True):
        outs = []
        for b in range(len(lens_q)):
            qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
            outs.append(attention_ref(q[None, qs], k[None, ks], v[None, ks], causal=True, upcast=upcast)[0][0])
        return torch.cat(outs)

    ours, ref32, same = grads_and_refs(
        lambda q, k, v: flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True),
        ref, [q, k, v], dout)
    for name, got, want, eager in zip(("out", "dq", "dk", "dv"), ours, ref32, same):
        assert_close_to_ref(got, want, eager, grad=name != "out", msg=f"{name} head_dim={head_dim}")


def to_pool(k_cache, v_cache, page_size, seed=0):
    """Scatter dense (batch, capacity, nheads_k, D) caches into poisoned pools through a random table."""
    batch, capacity = k_cache.shape[:2]
    blocks = capacity // page_size
    gen = torch.Generator().manual_seed(seed)
    table = torch.randperm(batch * blocks, generator=gen).view(batch, blocks).to(torch.int32).to(DEVICE)
    pools = []
    for i, dense in enumerate((k_cache, v_cache)):
        pool = poisoned(batch * blocks, page_size, *dense.shape[2:], dtype=dense.dtype, seed=10 + i)
        pool[table.long().flatten()] = dense.reshape(batch * blocks, page_size, *dense.shape[2:])
        pools.append(pool)
    return pools[0], pools[1], table


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: str(t)[6:])
@pytest.mark.parametrize("path", ["decode", "split", "prefill"])
@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS, ids=lambda d: f"d{d}")
def test_kvcache(head_dim, paged, path, dtype, monkeypatch):
    """flash_attn_with_kvcache, several queries and a partial append (seqlen_new < seqlen_q), causal, on
    the decode kernel (unsplit and split) and the chunked-prefill path: the output matches the reference,
    the new rows land in the cache, and no column past head_dim is read or written."""
    lengths = [0, 5, 40] if INTERPRET else [0, 5, 900]
    capacity, page_size = (64, 16) if INTERPRET else (1024, 64)
    seqlen_q, seqlen_new = (5, 3) if path != "prefill" else ((12, 9) if INTERPRET else (96, 80))
    if path == "prefill":
        monkeypatch.setattr(decode, "chunked_prefill_pays", lambda *args: True)
    batch = len(lengths)
    q = poisoned(batch, seqlen_q, NHEADS, head_dim, dtype=dtype, seed=7)
    k_cache = poisoned(batch, capacity, NHEADS_K, head_dim, dtype=dtype, seed=8)
    v_cache = poisoned(batch, capacity, NHEADS_K, head_dim, dtype=dtype, seed=9)
    k = poisoned(batch, seqlen_new, NHEADS_K, head_dim, dtype=dtype, seed=10)
    v = poisoned(batch, seqlen_new, NHEADS_K, head_dim, dtype=dtype, seed=11)
    ref32, ref_lse, ref_same = per_request_references(q, k_cache, v_cache, k, v, lengths, causal=True)
    table = None
    if paged:
        k_cache, v_cache, table = to_pool(k_cache, v_cache, page_size)
    out, lse = flash_attn_with_kvcache(
        q, k_cache, v_cache, k, v, cache_seqlens=torch.tensor(lengths, dtype=torch.int32, device=DEVICE),
        block_table=table, causal=True, num_splits={"decode": 1, "split": 3, "prefill": 0}[path],
        return_softmax_lse=True)
    msg = f"head_dim={head_dim} {'paged' if paged else 'dense'} {path}"
    assert_close_to_ref(out, ref32, ref_same, msg=msg)
    assert_lse_close(lse, ref_lse, dtype, msg=msg)
    for cache, new in ((k_cache, k), (v_cache, v)):
        assert_padding_untouched(cache, msg)
        for b, length in enumerate(lengths):
            if paged:
                rows = torch.arange(length, length + seqlen_new, device=DEVICE)
                got = cache[table[b].long()[rows // page_size], rows % page_size]
            else:
                got = cache[b, length:length + seqlen_new]
            assert torch.equal(got, new[b]), f"request {b}: the appended rows differ {msg}"


@pytest.mark.parametrize("head_dim", [13, 100] if ON_GPU else [13, 36])
def test_aligned_copies(head_dim, monkeypatch):
    """With tensor descriptors planned (patched here so that the copies happen on any device while the
    kernels keep their pointer loads), contiguous inputs of an odd head dim are copied into aligned
    buffers: out is a view of one, and out and the gradients still match the reference."""

    monkeypatch.setattr(prefill_launch, "tma_planned", lambda *args: True)
    monkeypatch.setattr(prefill_launch, "tma_usable", lambda *args: False)
    dtype = torch.float16
    q = torch.randn(2, 19, NHEADS, head_dim, device=DEVICE, dtype=dtype)
    k, v = (torch.randn(2, 23, NHEADS_K, head_dim, device=DEVICE, dtype=dtype) for _ in range(2))
    dout = torch.randn_like(q)
    ours, ref32, same = grads_and_refs(lambda *t: flash_attn_func(*t, causal=True),
                                       lambda *t, **kw: attention_ref(*t, causal=True, **kw)[0], [q, k, v], dout)
    assert not ours[0].is_contiguous() and ours[0].stride(-2) % 8 == 0, "out is a view of an aligned buffer"
    for name, got, want, eager in zip(("out", "dq", "dk", "dv"), ours, ref32, same):
        assert_close_to_ref(got, want, eager, grad=name != "out", msg=f"{name} head_dim={head_dim}")
