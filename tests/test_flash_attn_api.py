"""flash-attn 2's Python API: signatures (names, order, defaults), the packed variants, the variant
arguments at the values that ask for no variant, return_attn_probs, cache_seqlens=None, and the
NotImplementedError of what is not implemented yet. The numbers themselves are the other files' job;
here each function is checked against the plain call it must equal.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from helpers import DEVICE, ON_GPU, assert_close_to_ref, references
from tritonattn import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
)

DTYPE = torch.float16
D = 64 if ON_GPU else 32

# flash-attn 2.x's parameters, in order, with their defaults (flash_attn/flash_attn_interface.py).
_VARIANTS = [("window_size", (-1, -1)), ("softcap", 0.0), ("alibi_slopes", None), ("deterministic", False),
             ("return_attn_probs", False)]
_COMMON = [("dropout_p", 0.0), ("softmax_scale", None), ("causal", False)] + _VARIANTS
_REQ = inspect.Parameter.empty
FLASH_ATTN_SIGNATURES = {
    flash_attn_func: [("q", _REQ), ("k", _REQ), ("v", _REQ)] + _COMMON,
    flash_attn_qkvpacked_func: [("qkv", _REQ)] + _COMMON,
    flash_attn_kvpacked_func: [("q", _REQ), ("kv", _REQ)] + _COMMON,
    flash_attn_varlen_func: [("q", _REQ), ("k", _REQ), ("v", _REQ), ("cu_seqlens_q", _REQ), ("cu_seqlens_k", _REQ),
                             ("max_seqlen_q", _REQ), ("max_seqlen_k", _REQ)] + _COMMON + [("block_table", None)],
    flash_attn_varlen_qkvpacked_func: [("qkv", _REQ), ("cu_seqlens", _REQ), ("max_seqlen", _REQ)] + _COMMON,
    flash_attn_varlen_kvpacked_func: [("q", _REQ), ("kv", _REQ), ("cu_seqlens_q", _REQ), ("cu_seqlens_k", _REQ),
                                      ("max_seqlen_q", _REQ), ("max_seqlen_k", _REQ)] + _COMMON,
    flash_attn_with_kvcache: [
        ("q", _REQ), ("k_cache", _REQ), ("v_cache", _REQ), ("k", None), ("v", None), ("rotary_cos", None),
        ("rotary_sin", None), ("cache_seqlens", None), ("cache_batch_idx", None), ("cache_leftpad", None),
        ("block_table", None), ("softmax_scale", None), ("causal", False), ("window_size", (-1, -1)),
        ("softcap", 0.0), ("rotary_interleaved", True), ("alibi_slopes", None), ("num_splits", 0),
        ("return_softmax_lse", False)],
}


@pytest.mark.parametrize("fn", list(FLASH_ATTN_SIGNATURES), ids=lambda f: f.__name__)
def test_signature_is_flash_attns(fn):
    """flash-attn's parameters come first, positional-or-keyword, in its order with its defaults;
    anything of ours comes after them, keyword-only."""
    params = list(inspect.signature(fn).parameters.values())
    theirs = FLASH_ATTN_SIGNATURES[fn]
    got = [(p.name, p.default) for p in params[: len(theirs)]]
    assert got == theirs
    assert all(p.kind == p.POSITIONAL_OR_KEYWORD for p in params[: len(theirs)])
    assert all(p.kind == p.KEYWORD_ONLY for p in params[len(theirs):]), [p.name for p in params[len(theirs):]]


def randn(*shape, requires_grad=False):
    return torch.randn(*shape, device=DEVICE, dtype=DTYPE).requires_grad_(requires_grad)


def grads(out, inputs, dout):
    return torch.autograd.grad(out, inputs, dout)


def test_positional_arguments_mean_what_flash_attn_means():
    """flash_attn_func(q, k, v, 0.0, scale, True) is softmax_scale=scale, causal=True."""
    q, k, v = randn(2, 9, 4, D), randn(2, 13, 2, D), randn(2, 13, 2, D)
    positional = flash_attn_func(q, k, v, 0.0, 0.3, True)
    assert torch.equal(positional, flash_attn_func(q, k, v, softmax_scale=0.3, causal=True))
    ref32, _, ref_same = references(q, k, v, causal=True, softmax_scale=0.3)
    assert_close_to_ref(positional, ref32, ref_same)


@pytest.mark.parametrize("causal", [False, True])
def test_qkvpacked_equals_unpacked(causal):
    """flash_attn_qkvpacked_func on (b, s, 3, h, d) equals flash_attn_func on its slices, and its
    gradient is the three gradients stacked."""
    qkv = randn(2, 11, 3, 4, D, requires_grad=True)
    dout = randn(2, 11, 4, D)
    out = flash_attn_qkvpacked_func(qkv, causal=causal)
    (dqkv,) = grads(out, (qkv,), dout)
    q, k, v = (t.detach().requires_grad_() for t in qkv.unbind(2))
    ref = flash_attn_func(q, k, v, causal=causal)
    assert torch.equal(out, ref)
    assert torch.equal(dqkv, torch.stack(grads(ref, (q, k, v), dout), 2))


def test_kvpacked_equals_unpacked_gqa():
    """flash_attn_kvpacked_func with fewer KV heads equals flash_attn_func, gradients included."""
    q, kv = randn(2, 7, 4, D, requires_grad=True), randn(2, 12, 2, 2, D, requires_grad=True)
    dout = randn(2, 7, 4, D)
    out = flash_attn_kvpacked_func(q, kv, causal=True)
    dq, dkv = grads(out, (q, kv), dout)
    q2, k2, v2 = q.detach().requires_grad_(), *(t.detach().requires_grad_() for t in kv.unbind(2))
    ref = flash_attn_func(q2, k2, v2, causal=True)
    assert torch.equal(out, ref)
    rq, rk, rv = grads(ref, (q2, k2, v2), dout)
    assert torch.equal(dq, rq) and torch.equal(dkv, torch.stack((rk, rv), 2))


def test_varlen_packed_variants_equal_varlen():
    """The varlen qkv- and kv-packed functions equal flash_attn_varlen_func on their slices."""
    lens = [3, 0, 9]
    cu = torch.tensor([0, 3, 3, 12], dtype=torch.int32, device=DEVICE)
    qkv = randn(sum(lens), 3, 4, D)
    q, k, v = qkv.unbind(1)
    ref, lse = flash_attn_varlen_func(q, k, v, cu, cu, 9, 9, causal=True, return_softmax_lse=True)
    out, lse_packed = flash_attn_varlen_qkvpacked_func(qkv, cu, 9, causal=True, return_softmax_lse=True)
    assert torch.equal(out, ref) and torch.equal(lse_packed, lse)
    kv = torch.stack((k, v), 1)
    assert torch.equal(flash_attn_varlen_kvpacked_func(q, kv, cu, cu, 9, 9, 0.0, None, True), ref)


def test_packed_shape_errors():
    """A packed tensor without its 3 (or 2) slots is rejected naming the layout."""
    with pytest.raises(ValueError, match=r"qkv of shape \(batch, seqlen, 3, nheads, headdim\)"):
        flash_attn_qkvpacked_func(randn(2, 5, 2, 4, D))
    with pytest.raises(ValueError, match=r"kv of shape \(total_k, 2, nheads_k, headdim\)"):
        flash_attn_varlen_kvpacked_func(randn(5, 4, D), randn(5, 3, 2, D), *([torch.tensor([0, 5], dtype=torch.int32,
                                        device=DEVICE)] * 2), 5, 5)


@pytest.mark.parametrize("window", [(-1, 0), (-3, 0), (100, 0), torch.tensor([-1, 0])], ids=str)
def test_windows_that_mean_causal(window):
    """window_size (left unbounded, right 0) is causal, as in flash-attn (a side reaching past
    seqlen_k is unbounded; a tensor pair works)."""
    q, k, v = randn(1, 9, 2, D), randn(1, 13, 2, D), randn(1, 13, 2, D)
    assert torch.equal(flash_attn_func(q, k, v, window_size=window), flash_attn_func(q, k, v, causal=True))


@pytest.mark.parametrize("window", [(-1, -1), (13, 13), (50, -1)], ids=str)
def test_windows_that_mean_none(window):
    """window_size with both sides unbounded (or past seqlen_k) is plain attention."""
    q, k, v = randn(1, 9, 2, D), randn(1, 13, 2, D), randn(1, 13, 2, D)
    assert torch.equal(flash_attn_func(q, k, v, window_size=window), flash_attn_func(q, k, v))


@pytest.mark.parametrize("kwargs,match", [
    (dict(window_size=(1, 2, 3)), "pair of ints"),
    (dict(window_size=(0.5, 2)), "pair of ints"),
    (dict(softcap="big"), "softcap"),
    (dict(alibi_slopes=torch.ones(3)), "alibi_slopes"),
], ids=lambda x: str(x)[:30])
def test_malformed_variant_arguments_raise(kwargs, match):
    """Malformed variant arguments raise before any launch, with errors that are both ValueError (or
    TypeError) and RuntimeError, as flash-attn's are RuntimeErrors (the variants themselves are
    test_variants.py's)."""
    q, k, v = randn(1, 9, 2, D), randn(1, 13, 2, D), randn(1, 13, 2, D)
    with pytest.raises(RuntimeError, match=match):
        flash_attn_func(q, k, v, **kwargs)


def test_return_attn_probs():
    """return_attn_probs gives (out, softmax_lse, None) without dropout, as flash-attn."""
    q, k, v = randn(2, 9, 2, D), randn(2, 13, 2, D), randn(2, 13, 2, D)
    out, lse, s_dmask = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    ref, ref_lse = flash_attn_func(q, k, v, causal=True, return_softmax_lse=True)
    assert s_dmask is None and torch.equal(out, ref) and torch.equal(lse, ref_lse)


@pytest.mark.parametrize("paged", [False, True])
def test_kvcache_seqlens_none_means_full_cache(paged):
    """cache_seqlens=None attends over the whole cache (dense: seqlen_cache; paged: the table's pages)."""
    q = randn(2, 1, 4, D)
    k_cache, v_cache = randn(2, 32, 2, D), randn(2, 32, 2, D)
    full = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=32)
    if paged:
        table = torch.arange(4, dtype=torch.int32, device=DEVICE).view(2, 2)
        k_cache, v_cache = k_cache.view(4, 16, 2, D), v_cache.view(4, 16, 2, D)
        assert torch.equal(flash_attn_with_kvcache(q, k_cache, v_cache, block_table=table), full)
    else:
        assert torch.equal(flash_attn_with_kvcache(q, k_cache, v_cache), full)


@pytest.mark.parametrize("name", ["window", "softcap", "alibi", "sinks"])
def test_kvcache_bad_variant_raises_before_the_append(name):
    """flash_attn_with_kvcache refuses a malformed variant argument before any launch: the append has
    not happened, the cache is untouched."""
    q, k, v = randn(2, 1, 4, D), randn(2, 1, 2, D), randn(2, 1, 2, D)
    k_cache, v_cache = randn(2, 16, 2, D), randn(2, 16, 2, D)
    before = k_cache.clone()
    ones = torch.ones(2, dtype=torch.int32, device=DEVICE)
    kwargs = {"window": dict(window_size=(3, 0, 1)), "softcap": dict(softcap=float("inf")),
              "alibi": dict(alibi_slopes=torch.ones(3, device=DEVICE)),
              "sinks": dict(sinks=torch.ones(3, device=DEVICE))}[name]
    with pytest.raises(ValueError):
        flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=ones, **kwargs)
    assert torch.equal(k_cache, before)


def rotary_tables(seqlen_ro, rotary_dim, dtype=DTYPE):
    angles = torch.rand(seqlen_ro, rotary_dim // 2, device=DEVICE) * 6.3
    return angles.cos().to(dtype), angles.sin().to(dtype)


@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (False, (6, 2))],
                         ids=["full", "causal", "local"])
@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
def test_kvcache_rotary(interleaved, causal, window, paged):
    """rotary_cos / rotary_sin rotate q and the new k as flash-attn does (k's token t at
    cache_seqlens[b] + t; q's too when causal or with a sliding window, else all at cache_seqlens[b];
    the dims past rotary_dim untouched): the call equals rotating with tritonattn.testing.rotary_ref
    first."""
    from tritonattn.testing import rotary_ref

    batch, seqlen_q, capacity, rotary_dim = 3, 3, 32, D // 2
    lengths = torch.tensor([0, 5, 29], dtype=torch.int32, device=DEVICE)
    q, k, v = randn(batch, seqlen_q, 4, D), randn(batch, seqlen_q, 2, D), randn(batch, seqlen_q, 2, D)
    k_cache, v_cache = randn(batch, capacity, 2, D), randn(batch, capacity, 2, D)
    cos, sin = rotary_tables(capacity, rotary_dim)
    table = None
    if paged:
        table = torch.arange(batch * 2, dtype=torch.int32, device=DEVICE).view(batch, 2)
        k_cache, v_cache = k_cache.view(batch * 2, 16, 2, D), v_cache.view(batch * 2, 16, 2, D)
    k_plain, v_plain = k_cache.clone(), v_cache.clone()
    out = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cos, sin, lengths, block_table=table, causal=causal,
                                  rotary_interleaved=interleaved, window_size=window)
    positional = causal or window != (-1, -1)
    q_rot = rotary_ref(q, cos, sin, lengths, interleaved=interleaved, same_position=not positional)
    k_rot = rotary_ref(k, cos, sin, lengths, interleaved=interleaved)
    assert not torch.equal(q_rot, q) and torch.equal(q_rot[..., rotary_dim:], q[..., rotary_dim:])
    ref = flash_attn_with_kvcache(q_rot, k_plain, v_plain, k_rot, v, cache_seqlens=lengths, block_table=table,
                                  causal=causal, window_size=window)
    tol = 1e-2 if DTYPE == torch.float16 else 1e-5
    assert (out.float() - ref.float()).abs().max().item() < tol
    assert (k_cache.float() - k_plain.float()).abs().max().item() < tol, "the cache holds the rotated keys"


def test_kvcache_rotary_errors():
    """Rotary without new keys, a rotary_dim not a multiple of 16, or too few positions are rejected."""
    q, k, v = randn(2, 1, 4, D), randn(2, 1, 2, D), randn(2, 1, 2, D)
    k_cache, v_cache = randn(2, 16, 2, D), randn(2, 16, 2, D)
    cos, sin = rotary_tables(16, 16)
    with pytest.raises(ValueError, match="new k and v"):
        flash_attn_with_kvcache(q, k_cache, v_cache, None, None, cos, sin, 3)
    with pytest.raises(ValueError, match="multiple of 16"):
        flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cos[:, :4], sin[:, :4], 3)
    with pytest.raises(ValueError, match="seqlen_ro"):
        flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cos[:8], sin[:8], 3)


@pytest.mark.parametrize("append", [False, True])
def test_kvcache_batch_idx(append):
    """cache_batch_idx: request b reads (and appends to) row cache_batch_idx[b] of a larger dense cache."""
    idx = torch.tensor([3, 0], dtype=torch.int32, device=DEVICE)
    lengths = torch.tensor([7, 12], dtype=torch.int32, device=DEVICE)
    q = randn(2, 2, 4, D)
    k, v = (randn(2, 2, 2, D), randn(2, 2, 2, D)) if append else (None, None)
    k_cache, v_cache = randn(5, 16, 2, D), randn(5, 16, 2, D)
    rows = idx.long()
    k_sub, v_sub = k_cache[rows].clone(), v_cache[rows].clone()
    out = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lengths, cache_batch_idx=idx, causal=True)
    ref = flash_attn_with_kvcache(q, k_sub, v_sub, k, v, cache_seqlens=lengths, causal=True)
    assert torch.equal(out, ref)
    assert torch.equal(k_cache[rows], k_sub) and torch.equal(v_cache[rows], v_sub)
    with pytest.raises(ValueError, match="cache_batch_idx entries"):
        flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, cache_batch_idx=idx.cpu() + 2)


def test_kvcache_seqlens_none_with_append_raises():
    """New keys need cache_seqlens (where to append), as in flash-attn; nothing is written."""
    q, k, v = randn(2, 1, 4, D), randn(2, 1, 2, D), randn(2, 1, 2, D)
    k_cache, v_cache = randn(2, 16, 2, D), randn(2, 16, 2, D)
    before = k_cache.clone()
    with pytest.raises(ValueError, match="Expected cache_seqlens with new k and v"):
        flash_attn_with_kvcache(q, k_cache, v_cache, k, v)
    assert torch.equal(k_cache, before)
