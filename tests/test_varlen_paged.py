"""flash_attn_varlen_func with block_table: packed queries over keys in paged pools equal the same call
over the keys gathered into packed rows, for several page sizes (whole key blocks per page, several
pages per block, pages that straddle blocks), GQA, causal or not, empty sequences, with the attention
variants (window, softcap, ALiBi, sinks); its errors; and its backward, which does not exist
(flash-attn's neither).
"""

from __future__ import annotations

import pytest
import torch

from helpers import DEVICE, ON_GPU
from tritonattn import flash_attn_varlen_func
from tritonattn.flash_attn_interface import _flash_attn_varlen_forward

DTYPE = torch.float16
D = 64 if ON_GPU else 32


def paged_case(lens_q, lens_k, page_size, nheads=4, nheads_k=2, seed=0):
    """Packed q, the keys/values both packed and scattered into shuffled pool pages, and the table."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    max_blocks = max(-(-n // page_size) for n in lens_k) + 1  # one spare entry per row
    num_blocks = len(lens_k) * max_blocks + 3
    perm = torch.randperm(num_blocks, generator=gen)[: len(lens_k) * max_blocks]
    table = perm.view(len(lens_k), max_blocks).to(torch.int32)
    k_pool = torch.randn(num_blocks, page_size, nheads_k, D, generator=gen).to(DTYPE)
    v_pool = torch.randn(num_blocks, page_size, nheads_k, D, generator=gen).to(DTYPE)
    k = torch.cat([k_pool[table[b].long()].flatten(0, 1)[:n] for b, n in enumerate(lens_k)])
    v = torch.cat([v_pool[table[b].long()].flatten(0, 1)[:n] for b, n in enumerate(lens_k)])
    q = torch.randn(sum(lens_q), nheads, D, generator=gen).to(DTYPE)

    def cu(lens):
        return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)

    to = [t.to(DEVICE) for t in (q, k, v, k_pool, v_pool, table)]
    return (*to, cu(lens_q), cu(lens_k))


@pytest.mark.parametrize("page_size", [16, 48, 64, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_paged_equals_packed(page_size, causal):
    """out and lse over the pool equal those over the same keys packed, for evenly spaced and transposed pools."""
    lens_q, lens_k = [5, 0, 70, 33, 1], [130, 7, 70, 0, 64]
    q, k, v, k_pool, v_pool, table, cu_q, cu_k = paged_case(lens_q, lens_k, page_size)
    args = (cu_q, cu_k, max(lens_q), max(lens_k))
    ref, ref_lse = flash_attn_varlen_func(q, k, v, *args, causal=causal, return_softmax_lse=True)
    out, lse = flash_attn_varlen_func(q, k_pool, v_pool, *args, causal=causal, block_table=table,
                                      return_softmax_lse=True)
    tol = 2e-3 if ON_GPU else 1e-3  # the same arithmetic; the two compiled variants may round differently
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
    torch.testing.assert_close(lse, ref_lse, atol=1e-3, rtol=1e-3)
    # a pool whose rows are not evenly spaced (a transposed buffer) reads the same keys
    k_t = k_pool.transpose(1, 2).contiguous().transpose(1, 2)
    v_t = v_pool.transpose(1, 2).contiguous().transpose(1, 2)
    out_t = flash_attn_varlen_func(q, k_t, v_t, *args, causal=causal, block_table=table)
    torch.testing.assert_close(out_t, ref, atol=tol, rtol=tol)


VARIANTS = {
    "window": dict(window_size=(20, 3)),
    "window-causal": dict(window_size=(33, 0), causal=True),
    "window-left-only": dict(window_size=(0, -1)),
    "softcap": dict(softcap=2.0, causal=True),
    "alibi": dict(alibi="per-batch", causal=True),
    "sinks": dict(sinks=True),
    "all": dict(window_size=(40, 10), softcap=3.0, alibi="per-head", sinks=True),
}


@pytest.mark.parametrize("page_size", [16, 64, 128])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_paged_variants_equal_packed(variant, page_size):
    """The variants over the pool equal the packed call with the same variants (the band per sequence,
    bottom-right aligned to each one's own lengths, both ways round), and rows that see no key give
    zeros; the packed call itself is checked against the fp64 reference in tests/test_variants.py."""
    lens_q, lens_k = [5, 0, 70, 33, 1, 90], [130, 7, 70, 0, 64, 50]
    nheads = 4
    q, k, v, k_pool, v_pool, table, cu_q, cu_k = paged_case(lens_q, lens_k, page_size, nheads=nheads, seed=1)
    kwargs = dict(VARIANTS[variant])
    gen = torch.Generator(device="cpu").manual_seed(2)
    alibi = kwargs.pop("alibi", None)
    if alibi is not None:
        shape = (len(lens_q), nheads) if alibi == "per-batch" else (nheads,)
        kwargs["alibi_slopes"] = (torch.rand(shape, generator=gen) * 0.3).to(DEVICE)
    if kwargs.pop("sinks", False):
        kwargs["sinks"] = torch.randn(nheads, generator=gen).to(DEVICE)
    args = (cu_q, cu_k, max(lens_q), max(lens_k))
    ref, ref_lse = flash_attn_varlen_func(q, k, v, *args, return_softmax_lse=True, **kwargs)
    out, lse = flash_attn_varlen_func(q, k_pool, v_pool, *args, block_table=table, return_softmax_lse=True,
                                      **kwargs)
    tol = 2e-3 if ON_GPU else 1e-3
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
    torch.testing.assert_close(lse, ref_lse, atol=1e-3, rtol=1e-3)
    assert not out.isnan().any()
    no_keys = slice(sum(lens_q[:3]), sum(lens_q[:4]))  # sequence 3 has no key: zeros (a sink has no value)
    assert out[no_keys].abs().max().item() == 0


def test_private_forward_takes_block_table():
    """_flash_attn_varlen_forward with block_table: flash_attn_varlen_func's out and packed (nheads, total_q) lse."""
    lens_q, lens_k = [3, 9], [40, 17]
    q, k, v, k_pool, v_pool, table, cu_q, cu_k = paged_case(lens_q, lens_k, 16)
    ref, ref_lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 9, 40, causal=True, return_softmax_lse=True)
    out, lse, s_dmask, _ = _flash_attn_varlen_forward(q, k_pool, v_pool, cu_q, cu_k, 9, 40, 0.0, None, True,
                                                      block_table=table)
    assert torch.equal(out, flash_attn_varlen_func(q, k_pool, v_pool, cu_q, cu_k, 9, 40, causal=True,
                                                   block_table=table))
    tol = 2e-3 if ON_GPU else 1e-3
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
    torch.testing.assert_close(lse, ref_lse, atol=1e-3, rtol=1e-3)
    assert s_dmask is None and lse.shape == (4, sum(lens_q))


def test_backward_raises():
    """A paged forward under autograd runs; its backward says it does not exist."""
    q, k, v, k_pool, v_pool, table, cu_q, cu_k = paged_case([4, 6], [20, 30], 16)
    q.requires_grad_()
    out = flash_attn_varlen_func(q, k_pool, v_pool, cu_q, cu_k, 6, 30, block_table=table)
    with pytest.raises(NotImplementedError, match="forward only"):
        out.sum().backward()


def test_errors():
    """Bad tables, pools, lengths and entries raise before any launch."""
    q, k, v, k_pool, v_pool, table, cu_q, cu_k = paged_case([4, 6], [20, 30], 16)
    args = (cu_q, cu_k, 6, 30)
    with pytest.raises(TypeError, match="int32"):
        flash_attn_varlen_func(q, k_pool, v_pool, *args, block_table=table.long())
    with pytest.raises(ValueError, match="block_table"):
        flash_attn_varlen_func(q, k_pool, v_pool, *args, block_table=table[:1])
    with pytest.raises(ValueError, match="4 dims"):
        flash_attn_varlen_func(q, k, v, *args, block_table=table)
    with pytest.raises(NotImplementedError, match="dropout"):
        flash_attn_varlen_func(q, k_pool, v_pool, cu_q, cu_k, 6, 30, 0.1, block_table=table)
    with pytest.raises(ValueError, match=">= 1 column"):
        flash_attn_varlen_func(q, k_pool, v_pool, *args, block_table=table[:, :0])
    if DEVICE.type == "cpu":  # host-known lengths and entries are checked
        short = table[:, :1]
        with pytest.raises(ValueError, match="capacity"):
            flash_attn_varlen_func(q, k_pool, v_pool, *args, block_table=short)
        bad = table.clone()
        bad[1, 1] = k_pool.shape[0]
        with pytest.raises(ValueError, match=r"block_table\[1, 1\] = "):
            flash_attn_varlen_func(q, k_pool, v_pool, *args, block_table=bad)
