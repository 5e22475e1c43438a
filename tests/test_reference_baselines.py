"""The seed's eager decode baselines (tritonattn.testing.decode_eager_slice, decode_eager_cat).

They are benchmark competitors in notebook 02, so they must compute the same attention as the
ground truth: tritonattn.testing.attention_ref in fp32 over the whole preallocated cache with
key_padding_lengths (seqlen_q == 1), or over the valid rows with the bottom-right causal mask
(seqlen_q > 1). Pure PyTorch: these run on the CPU and need no Triton.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.competitors import decode_eager_cat, decode_eager_slice
from helpers import DEVICE, assert_close_to_ref
from tritonattn.testing import attention_ref, rel_err

HEADS = [(4, 4), (4, 2), (4, 1), (6, 2)]  # MHA, GQA, MQA, G = 3


def randn(*shape, dtype=torch.float32, seed=0):
    gen = torch.Generator(device=DEVICE)
    gen.manual_seed(seed)
    return torch.randn(*shape, generator=gen, device=DEVICE, dtype=torch.float32).to(dtype)


def inputs(batch, seqlen_cache, seqlen_q, nheads, nheads_k, head_dim, dtype):
    q = randn(batch, seqlen_q, nheads, head_dim, dtype=dtype, seed=1)
    k_cache = randn(batch, seqlen_cache, nheads_k, head_dim, dtype=dtype, seed=2)
    v_cache = randn(batch, seqlen_cache, nheads_k, head_dim, dtype=dtype, seed=3)
    k = randn(batch, seqlen_q, nheads_k, head_dim, dtype=dtype, seed=4)
    v = randn(batch, seqlen_q, nheads_k, head_dim, dtype=dtype, seed=5)
    return q, k_cache, v_cache, k, v


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("append", [True, False])
@pytest.mark.parametrize("cache_len", [0, 1, 17, 63])
@pytest.mark.parametrize("nheads,nheads_k", HEADS)
def test_eager_slice_matches_reference_with_key_padding(nheads, nheads_k, cache_len, append, dtype):
    """decode_eager_slice == attention_ref over the whole cache with key_padding_lengths (seqlen_q = 1)."""
    batch, seqlen_cache, head_dim = 3, 64, 32
    q, k_cache, v_cache, k, v = inputs(batch, seqlen_cache, 1, nheads, nheads_k, head_dim, dtype)
    if not append:
        k = v = None
    k_before, v_before = k_cache.clone(), v_cache.clone()
    out = decode_eager_slice(q, k_cache, v_cache, cache_len, k, v)

    n_keys = cache_len + (1 if append else 0)
    lengths = torch.full((batch,), n_keys, dtype=torch.int32)
    ref32, _ = attention_ref(q.float(), k_cache.float(), v_cache.float(), key_padding_lengths=lengths)
    same, _ = attention_ref(q, k_cache, v_cache, key_padding_lengths=lengths, upcast=dtype == torch.float32)
    assert out.shape == q.shape and out.dtype == dtype
    if n_keys == 0:
        assert torch.equal(out, torch.zeros_like(out)), "no key: the baseline must give zeros, like the kernels"
        return
    if dtype == torch.float32:
        err = rel_err(out, ref32)
        assert err < 1e-5, f"fp32 rel err {err:.2e}"
    else:
        assert_close_to_ref(out, ref32.float(), same, msg=f"(cache_len={cache_len}, {nheads}:{nheads_k})")
    # the append wrote rows [cache_len, cache_len + 1) and nothing else
    if append:
        k_before[:, cache_len : cache_len + 1] = k
        v_before[:, cache_len : cache_len + 1] = v
    assert torch.equal(k_cache, k_before) and torch.equal(v_cache, v_before)


@pytest.mark.parametrize("seqlen_q", [1, 4])
@pytest.mark.parametrize("nheads,nheads_k", HEADS)
def test_eager_slice_causal_bottom_right(nheads, nheads_k, seqlen_q):
    """With seqlen_q > 1 and causal=True the mask is aligned bottom-right over the valid rows."""
    batch, seqlen_cache, head_dim, cache_len = 2, 40, 16, 21
    q, k_cache, v_cache, k, v = inputs(batch, seqlen_cache, seqlen_q, nheads, nheads_k, head_dim, torch.float32)
    out = decode_eager_slice(q, k_cache, v_cache, cache_len, k, v, causal=True)
    n = cache_len + seqlen_q
    ref, _ = attention_ref(q, k_cache[:, :n], v_cache[:, :n], causal=True)
    assert rel_err(out, ref) < 1e-5
    if seqlen_q > 1:  # the mask matters: without it the result differs
        assert rel_err(decode_eager_slice(q, k_cache, v_cache, cache_len, causal=False), ref) > 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("cache_len", [0, 1, 33])
@pytest.mark.parametrize("nheads,nheads_k", HEADS)
def test_eager_cat_matches_reference_and_slice(nheads, nheads_k, cache_len, dtype):
    """decode_eager_cat grows the cache by the new token and equals attention_ref and decode_eager_slice."""
    batch, head_dim = 3, 32
    q, k_cache, v_cache, k, v = inputs(batch, 48, 1, nheads, nheads_k, head_dim, dtype)
    k_valid, v_valid = k_cache[:, :cache_len].clone(), v_cache[:, :cache_len].clone()
    out, k_grown, v_grown = decode_eager_cat(q, k_valid, v_valid, k, v)

    assert k_valid.shape[1] == cache_len, "the input cache must not be modified"
    assert k_grown.shape == (batch, cache_len + 1, nheads_k, head_dim)
    assert torch.equal(k_grown, torch.cat([k_cache[:, :cache_len], k], 1))
    assert torch.equal(v_grown, torch.cat([v_cache[:, :cache_len], v], 1))

    # attention_ref over the preallocated buffer holding the same rows, masked by key_padding_lengths
    padded_k, padded_v = k_cache.clone(), v_cache.clone()
    padded_k[:, : cache_len + 1], padded_v[:, : cache_len + 1] = k_grown, v_grown
    lengths = torch.full((batch,), cache_len + 1, dtype=torch.int32)
    ref32, _ = attention_ref(q.float(), padded_k.float(), padded_v.float(), key_padding_lengths=lengths)
    if dtype == torch.float32:
        assert rel_err(out, ref32) < 1e-5
    else:
        same, _ = attention_ref(q, padded_k, padded_v, key_padding_lengths=lengths, upcast=False)
        assert_close_to_ref(out, ref32.float(), same, msg=f"(cache_len={cache_len}, {nheads}:{nheads_k})")
    out_slice = decode_eager_slice(q, k_cache.clone(), v_cache.clone(), cache_len, k, v)
    assert torch.equal(out, out_slice), "the two baselines compute the same attention, only the cache differs"


def test_eager_cat_token_by_token_equals_causal_prefill():
    """Growing the cache with torch.cat token by token reproduces causal attention over the sequence."""
    batch, seqlen, nheads, nheads_k, head_dim = 2, 19, 4, 2, 16
    q = randn(batch, seqlen, nheads, head_dim, seed=6)
    k = randn(batch, seqlen, nheads_k, head_dim, seed=7)
    v = randn(batch, seqlen, nheads_k, head_dim, seed=8)
    k_cache = v_cache = torch.zeros(batch, 0, nheads_k, head_dim, device=DEVICE)
    outs = []
    for t in range(seqlen):
        out, k_cache, v_cache = decode_eager_cat(q[:, t : t + 1], k_cache, v_cache, k[:, t : t + 1], v[:, t : t + 1])
        outs.append(out)
    ref, _ = attention_ref(q, k, v, causal=True)
    assert rel_err(torch.cat(outs, 1), ref) < 1e-5
    assert torch.equal(k_cache, k) and torch.equal(v_cache, v)


def test_baselines_reject_bad_input():
    """Overflowing appends, a missing k or v, and mismatched shapes raise ValueError."""
    q, k_cache, v_cache, k, v = inputs(1, 8, 2, 4, 2, 16, torch.float32)
    with pytest.raises(ValueError, match="cache_len"):
        decode_eager_slice(q, k_cache, v_cache, 7, k, v)  # 7 + 2 > 8
    with pytest.raises(ValueError, match="cache_len"):
        decode_eager_slice(q, k_cache, v_cache, -1)
    with pytest.raises(ValueError, match="both"):
        decode_eager_slice(q, k_cache, v_cache, 0, k, None)
    with pytest.raises(ValueError, match="k and v"):
        decode_eager_cat(q, k_cache, v_cache, None, None)
    with pytest.raises(ValueError, match="shape"):
        decode_eager_cat(q, k_cache, v_cache, k[:, :1], v[:, :1])
