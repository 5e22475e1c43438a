"""Decode attention (tritonattn/decode.py, tritonattn/decode_kernels.py): flash_attn_with_kvcache, and KVCache
(tritonattn/kv_cache.py).

Ground truth is tritonattn.testing.attention_ref in fp32, per request over the keys it should see
(cache rows [0, L_b) plus the new tokens); fp16/bf16 outputs are judged against PyTorch's own
same-dtype error (helpers.assert_close_to_ref). Small shapes under the interpreter, bigger ones
and bf16 on a GPU.
"""

from __future__ import annotations

import pytest
import torch

from helpers import (
    DEVICE,
    INTERPRET,
    ON_GPU,
    assert_close_to_ref,
    assert_lse_close,
    assert_splits_agree,
    make_qkv,
    needs_graph_capture,
    paged_copy,
    per_request_references,
    references,
)
from tritonattn import KVCache, attention_ref, flash_attn_func, flash_attn_with_kvcache, rel_err
from tritonattn.config.options import attn_options
from tritonattn.launch.decode import launch_kvcache
from tritonattn.launch.fast import DirectLaunch
from tritonattn.testing import agreement_tolerance

DTYPES = [torch.float16, torch.float32] + ([torch.bfloat16] if ON_GPU else [])
HALF_DTYPES = [torch.float16] + ([torch.bfloat16] if ON_GPU else [])
# Interpreter: small heads, head dims and lengths; GPU: the full grid.
NHEADS = 8 if ON_GPU else 4
HEAD_DIM = 128 if ON_GPU else 32
AR_LENGTHS = [1, 31, 33, 63, 65, 127, 257] if ON_GPU else [1, 31, 33, 65, 127]
GROUPS = [1, 2, 4, 8] if ON_GPU else [1, 2, 4]  # nheads // nheads_k; the largest is MQA


def randn(*shape, dtype, device=DEVICE):
    return torch.randn(*shape, dtype=torch.float32, device=device).to(dtype)


def make_decode_inputs(batch, seqlen_cache, seqlen_q, nheads, nheads_k, head_dim, dtype, append=True):
    """Random q, caches (random everywhere, also past the lengths) and new k/v (or None)."""
    q = randn(batch, seqlen_q, nheads, head_dim, dtype=dtype)
    k_cache = randn(batch, seqlen_cache, nheads_k, head_dim, dtype=dtype)
    v_cache = randn(batch, seqlen_cache, nheads_k, head_dim, dtype=dtype)
    if not append:
        return q, k_cache, v_cache, None, None
    k = randn(batch, seqlen_q, nheads_k, head_dim, dtype=dtype)
    v = randn(batch, seqlen_q, nheads_k, head_dim, dtype=dtype)
    return q, k_cache, v_cache, k, v


def expected_caches(k_cache, v_cache, k, v, lengths):
    """The caches as they must be after appending k/v at each request's length."""
    k_exp, v_exp = k_cache.clone(), v_cache.clone()
    if k is not None:
        for b, length in enumerate(lengths):
            k_exp[b, length : length + k.shape[1]] = k[b]
            v_exp[b, length : length + v.shape[1]] = v[b]
    return k_exp, v_exp


# --------------------------------------------------------------------------------------------
# The seed's test: prefill == token-by-token decode
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", HALF_DTYPES + ([] if ON_GPU else [torch.float32]))
@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("seqlen", AR_LENGTHS)
def test_autoregressive_equivalence(seqlen, group, dtype):
    """Causal prefill over a sequence equals decoding it token by token, appending each token first."""
    if INTERPRET and dtype == torch.float32 and (group != 2 or seqlen > 33):
        pytest.skip("fp32 under the interpreter: one GQA ratio, short lengths")
    if INTERPRET and seqlen > 65 and group != GROUPS[-1]:
        pytest.skip("long sequences under the interpreter: MQA only")
    batch, nheads, head_dim = 2, NHEADS, HEAD_DIM
    nheads_k = nheads // group
    q, k, v = make_qkv(batch, seqlen, seqlen, nheads, nheads_k, head_dim, dtype)
    out_prefill = flash_attn_func(q, k, v, causal=True)

    seqlen_cache = seqlen + 7  # not a multiple of any block size
    k_cache = randn(batch, seqlen_cache, nheads_k, head_dim, dtype=dtype)
    v_cache = randn(batch, seqlen_cache, nheads_k, head_dim, dtype=dtype)
    outs = [
        flash_attn_with_kvcache(q[:, t : t + 1], k_cache, v_cache, k[:, t : t + 1], v[:, t : t + 1],
                                cache_seqlens=t, causal=True)
        for t in range(seqlen)
    ]
    out_decode = torch.cat(outs, 1)

    ref32, _, ref_same = references(q, k, v, causal=True)
    msg = f"(seqlen={seqlen}, nheads={nheads}, nheads_k={nheads_k}, {dtype})"
    assert_close_to_ref(out_decode, ref32, ref_same, msg="decode " + msg)
    assert_close_to_ref(out_prefill, ref32, ref_same, msg="prefill " + msg)
    diff = rel_err(out_decode, out_prefill)
    print(f"decode vs prefill rel err {diff:.2e} {msg}")
    assert diff <= 2 * agreement_tolerance(dtype), f"decode vs prefill rel err {diff:.2e} {msg}"
    assert torch.equal(k_cache[:, :seqlen], k) and torch.equal(v_cache[:, :seqlen], v)


# --------------------------------------------------------------------------------------------
# Ragged batches, splits, seqlen_q > 1
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("append", [True, False])
@pytest.mark.parametrize("num_splits", [1, 3, 0])
def test_ragged_batch_against_reference(num_splits, append, dtype):
    """Requests of lengths 0, 1, 17, ... each match the reference over their own keys."""
    lengths = [0, 1, 17, 100, 140] if INTERPRET else [0, 1, 17, 1000, 3000, 4095]
    seqlen_cache = 160 if INTERPRET else 4096
    batch, nheads, nheads_k, head_dim = len(lengths), NHEADS, 2, HEAD_DIM
    q, k_cache, v_cache, k, v = make_decode_inputs(batch, seqlen_cache, 1, nheads, nheads_k, head_dim, dtype, append)
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    k_exp, v_exp = expected_caches(k_cache, v_cache, k, v, lengths)
    ref32, ref_lse, ref_same = per_request_references(q, k_cache, v_cache, k, v, lengths, causal=False)

    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens, num_splits=num_splits,
                                       return_softmax_lse=True)
    msg = f"(lengths={lengths}, num_splits={num_splits}, append={append}, {dtype})"
    assert_close_to_ref(out, ref32, ref_same, msg=msg)
    assert_lse_close(lse, ref_lse, dtype, msg=msg)
    assert torch.equal(k_cache, k_exp) and torch.equal(v_cache, v_exp)

    # the same with attention_ref's key padding over the (appended) cache
    n_keys = torch.tensor(lengths, device=DEVICE) + (1 if append else 0)
    pad32, _ = attention_ref(q.float(), k_exp.float(), v_exp.float(), key_padding_lengths=n_keys)
    assert rel_err(ref32, pad32) < 1e-5


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seqlen_q", [1, 4])
def test_split_and_unsplit_agree(seqlen_q, dtype):
    """num_splits 1, 3 and 0 (heuristic) give the same output and LSE up to rounding."""
    lengths = [0, 5, 90, 255] if INTERPRET else [0, 5, 900, 8191]
    seqlen_cache = 256 if INTERPRET else 8192
    batch, nheads, nheads_k, head_dim = len(lengths), NHEADS, 2, HEAD_DIM
    q, k_cache, v_cache, _, _ = make_decode_inputs(batch, seqlen_cache, seqlen_q, nheads, nheads_k, head_dim, dtype,
                                                   append=False)
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    results = {
        ns: flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, causal=True, num_splits=ns,
                                    return_softmax_lse=True)
        for ns in (1, 3, 0)
    }
    assert_splits_agree(results, dtype)


@pytest.mark.parametrize("dtype", HALF_DTYPES)
@pytest.mark.parametrize("append", [True, False])
@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("seqlen_q", [4, 8])
def test_seqlen_q_causal_bottom_right(seqlen_q, group, append, dtype):
    """seqlen_q > 1 (speculative verification) with the bottom-right causal mask matches the reference."""
    lengths = [0, 3, 40, 100] if INTERPRET else [0, 3, 400, 2040]
    seqlen_cache = 110 if INTERPRET else 2048
    batch, nheads, head_dim = len(lengths), NHEADS, HEAD_DIM
    nheads_k = nheads // group
    q, k_cache, v_cache, k, v = make_decode_inputs(batch, seqlen_cache, seqlen_q, nheads, nheads_k, head_dim, dtype,
                                                   append)
    ref32, ref_lse, ref_same = per_request_references(q, k_cache, v_cache, k, v, lengths, causal=True)
    for num_splits in (1, 3):
        k_run, v_run = k_cache.clone(), v_cache.clone()
        out, lse = flash_attn_with_kvcache(q, k_run, v_run, k, v, cache_seqlens=torch.tensor(lengths, dtype=torch.int32,
                                           device=DEVICE), causal=True, num_splits=num_splits, return_softmax_lse=True)
        msg = f"(seqlen_q={seqlen_q}, group={group}, append={append}, num_splits={num_splits}, {dtype})"
        assert_close_to_ref(out, ref32, ref_same, msg=msg)
        assert_lse_close(lse, ref_lse, dtype, msg=msg)


@pytest.mark.parametrize("path", ["decode", "prefill"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("seqlen_q,seqlen_new", [(4, 1), (9, 3), (5, 5)])
def test_partial_append(seqlen_q, seqlen_new, causal, path, monkeypatch):
    """flash-attn's seqlen_new <= seqlen_q (speculative verification with a partial append): the new
    tokens' k/v go to rows [L_b, L_b + seqlen_new) and nothing else changes; the queries are aligned to
    the last seqlen_q of the L_b + seqlen_new keys (causal bottom-right), on the decode kernel (split
    and not) and on the chunked-prefill path."""
    import tritonattn.launch.decode as decode

    lengths = [0, 3, 40, 100] if INTERPRET else [0, 3, 400, 2040]
    seqlen_cache = 110 if INTERPRET else 2048
    batch, nheads, nheads_k, dtype = len(lengths), NHEADS, NHEADS // 2, torch.float16
    q, k_cache, v_cache, _, _ = make_decode_inputs(batch, seqlen_cache, seqlen_q, nheads, nheads_k, HEAD_DIM, dtype,
                                                   append=False)
    k, v = (randn(batch, seqlen_new, nheads_k, HEAD_DIM, dtype=dtype) for _ in range(2))
    ref32, ref_lse, ref_same = per_request_references(q, k_cache, v_cache, k, v, lengths, causal=causal)
    k_exp, v_exp = expected_caches(k_cache, v_cache, k, v, lengths)
    if path == "prefill":
        monkeypatch.setattr(decode, "chunked_prefill_pays", lambda *args: True)
    for num_splits in ((1, 3) if path == "decode" else (0,)):
        k_run, v_run = k_cache.clone(), v_cache.clone()
        out, lse = flash_attn_with_kvcache(q, k_run, v_run, k, v, cache_seqlens=torch.tensor(lengths, dtype=torch.int32,
                                           device=DEVICE), causal=causal, num_splits=num_splits,
                                           return_softmax_lse=True)
        msg = f"(seqlen_q={seqlen_q}, seqlen_new={seqlen_new}, causal={causal}, {path}, num_splits={num_splits})"
        assert_close_to_ref(out, ref32, ref_same, msg=msg)
        assert_lse_close(lse, ref_lse, dtype, msg=msg)
        assert torch.equal(k_run, k_exp) and torch.equal(v_run, v_exp), f"wrong cache rows {msg}"


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("seqlen_q", [16, 64, 128] if ON_GPU else [16, 40])
def test_wide_heads_many_query_rows(seqlen_q, paged):
    """Head dim 256 with many query rows per program (seqlen_q x a group of 4) and an append: the plan's
    tiles shrink to the GPU's shared memory (tritonattn.config.tables.decode_fit) and the result still matches,
    on the decode kernel (split and not) and, through num_splits=0 at 128 new tokens, its dispatch."""
    lengths = [0, 37, 90] if INTERPRET else [0, 37, 900]
    capacity = 160 if INTERPRET else 1152
    dtype, nheads, nheads_k, head_dim = torch.float16, 8, 2, 256
    batch = len(lengths)
    q, k_cache, v_cache, k, v = make_decode_inputs(batch, capacity, seqlen_q, nheads, nheads_k, head_dim, dtype)
    ref32, ref_lse, ref_same = per_request_references(q, k_cache, v_cache, k, v, lengths, causal=True)
    k_exp, v_exp = expected_caches(k_cache, v_cache, k, v, lengths)
    page_size = 16
    for num_splits in (0, 1):
        k_run, v_run = k_cache.clone(), v_cache.clone()
        kwargs = dict(cache_seqlens=torch.tensor(lengths, dtype=torch.int32, device=DEVICE), causal=True,
                      num_splits=num_splits, return_softmax_lse=True)
        if paged:  # the dense caches cut into pages, request b's pages in order
            pages = capacity // page_size
            table = torch.arange(batch * pages, dtype=torch.int32, device=DEVICE).view(batch, pages)
            k_pool = k_run.reshape(batch * pages, page_size, nheads_k, head_dim)
            v_pool = v_run.reshape(batch * pages, page_size, nheads_k, head_dim)
            out, lse = flash_attn_with_kvcache(q, k_pool, v_pool, k, v, block_table=table, **kwargs)
        else:
            out, lse = flash_attn_with_kvcache(q, k_run, v_run, k, v, **kwargs)
        msg = f"(seqlen_q={seqlen_q}, paged={paged}, num_splits={num_splits})"
        assert_close_to_ref(out, ref32, ref_same, msg=msg)
        assert_lse_close(lse, ref_lse, dtype, msg=msg)
        assert torch.equal(k_run, k_exp) and torch.equal(v_run, v_exp), f"wrong cache rows {msg}"


def test_many_row_blocks():
    """More query rows per KV head than one program holds (MQA x seqlen_q = 96 rows) still match."""
    lengths = [0, 7, 50]
    dtype, nheads, head_dim, seqlen_q = torch.float16, 8, 32, 12
    q, k_cache, v_cache, k, v = make_decode_inputs(3, 64, seqlen_q, nheads, 1, head_dim, dtype)
    k_exp, v_exp = expected_caches(k_cache, v_cache, k, v, lengths)
    ref32, ref_lse, ref_same = per_request_references(q, k_cache, v_cache, k, v, lengths, causal=True)
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=torch.tensor(lengths, dtype=torch.int32,
                                       device=DEVICE), causal=True, num_splits=2, return_softmax_lse=True)
    assert_close_to_ref(out, ref32, ref_same)
    assert_lse_close(lse, ref_lse, dtype)
    assert torch.equal(k_cache, k_exp) and torch.equal(v_cache, v_exp)


# --------------------------------------------------------------------------------------------
# The append, layouts, lengths
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seqlen_q", [1, 5])
def test_append_writes_exactly_the_new_slots(seqlen_q):
    """The call writes rows [L_b, L_b + seqlen_q) of both caches and no other byte (NaN-poisoned padding)."""
    dtype, nheads, nheads_k, head_dim = torch.float16, 4, 2, 40  # head_dim 40: padded to 64 in the kernel
    lengths = [0, 1, 33, 100 - seqlen_q]
    batch, seqlen_cache = len(lengths), 100
    # caches are views of wider buffers whose extra columns hold NaN: never read, never written
    k_buf = randn(batch, seqlen_cache, nheads_k, head_dim + 8, dtype=dtype)
    v_buf = randn(batch, seqlen_cache, nheads_k, head_dim + 8, dtype=dtype)
    k_buf[..., head_dim:] = float("nan")
    v_buf[..., head_dim:] = float("nan")
    k_cache, v_cache = k_buf[..., :head_dim], v_buf[..., :head_dim]
    q = randn(batch, seqlen_q, nheads, head_dim, dtype=dtype)
    k = randn(batch, seqlen_q, nheads_k, head_dim, dtype=dtype)
    v = randn(batch, seqlen_q, nheads_k, head_dim, dtype=dtype)
    k_buf_before, v_buf_before = k_buf.clone(), v_buf.clone()
    ref32, _, ref_same = per_request_references(q, k_cache.clone(), v_cache.clone(), k, v, lengths, causal=True)

    out = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=torch.tensor(lengths, dtype=torch.int32),
                                  causal=True, num_splits=3)
    assert_close_to_ref(out, ref32, ref_same)
    changed = torch.zeros(batch, seqlen_cache, dtype=torch.bool, device=DEVICE)
    for b, length in enumerate(lengths):
        changed[b, length : length + seqlen_q] = True
        assert torch.equal(k_buf[b, length : length + seqlen_q, :, :head_dim], k[b])
        assert torch.equal(v_buf[b, length : length + seqlen_q, :, :head_dim], v[b])
    same = lambda a, b: torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))
    assert same(k_buf[~changed], k_buf_before[~changed]) and same(v_buf[~changed], v_buf_before[~changed])
    assert same(k_buf[..., head_dim:], k_buf_before[..., head_dim:])
    assert same(v_buf[..., head_dim:], v_buf_before[..., head_dim:])


def test_transposed_cache_views():
    """Caches that are (B, H_KV, S, D) buffers seen through .transpose(1, 2), and a transposed q, work."""
    dtype, nheads, nheads_k, head_dim = torch.float16, NHEADS, 2, HEAD_DIM
    lengths = [3, 0, 77]
    batch, seqlen_cache, seqlen_q = len(lengths), 96, 2
    k_cache = randn(batch, nheads_k, seqlen_cache, head_dim, dtype=dtype).transpose(1, 2)
    v_cache = randn(batch, nheads_k, seqlen_cache, head_dim, dtype=dtype).transpose(1, 2)
    q = randn(batch, nheads, seqlen_q, head_dim, dtype=dtype).transpose(1, 2)
    k = randn(batch, nheads_k, seqlen_q, head_dim, dtype=dtype).transpose(1, 2)
    v = randn(batch, seqlen_q, nheads_k, head_dim, dtype=dtype)
    k_exp, v_exp = expected_caches(k_cache, v_cache, k, v, lengths)
    ref32, _, ref_same = per_request_references(q, k_cache, v_cache, k, v, lengths, causal=True)
    for num_splits in (1, 2):
        k_run, v_run = k_cache.clone().transpose(1, 2).contiguous().transpose(1, 2), v_cache.clone()
        assert k_run.stride() == k_cache.stride()
        out = flash_attn_with_kvcache(q, k_run, v_run, k, v, cache_seqlens=torch.tensor(lengths, dtype=torch.int32),
                                      causal=True, num_splits=num_splits)
        assert_close_to_ref(out, ref32, ref_same, msg=f"num_splits={num_splits}")
        assert torch.equal(k_run, k_exp) and torch.equal(v_run, v_exp)


def test_cache_seqlens_not_modified_and_int_equals_tensor():
    """cache_seqlens is left unchanged, and an int gives the same result as the equivalent tensor."""
    dtype = torch.float16
    q, k_cache, v_cache, k, v = make_decode_inputs(2, 64, 1, NHEADS, 2, HEAD_DIM, dtype)
    seqlens = torch.tensor([21, 21], dtype=torch.int32, device=DEVICE)
    kc1, vc1 = k_cache.clone(), v_cache.clone()
    out_tensor = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens)
    out_int = flash_attn_with_kvcache(q, kc1, vc1, k, v, cache_seqlens=21)
    assert seqlens.tolist() == [21, 21] and seqlens.dtype == torch.int32
    assert torch.equal(out_tensor, out_int)
    assert torch.equal(k_cache, kc1) and torch.equal(v_cache, vc1)


@pytest.mark.parametrize("dtype", DTYPES)
def test_softmax_lse_matches_reference(dtype):
    """return_softmax_lse gives the reference LSE, +inf for rows that see no key."""
    lengths = [0, 2, 60]  # request 0 sees nothing; with seqlen_q 3 causal and no append, rows of request 1 too
    q, k_cache, v_cache, _, _ = make_decode_inputs(3, 64, 3, NHEADS, 1, HEAD_DIM, dtype, append=False)
    ref32, ref_lse, ref_same = per_request_references(q, k_cache, v_cache, None, None, lengths, causal=True)
    assert torch.isposinf(ref_lse).sum() > 0
    for num_splits in (1, 2):
        out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=torch.tensor(lengths, dtype=torch.int32),
                                           causal=True, num_splits=num_splits, return_softmax_lse=True)
        assert_close_to_ref(out, ref32, ref_same)
        assert_lse_close(lse, ref_lse, dtype, msg=f"num_splits={num_splits}")
        assert torch.equal(out[0], torch.zeros_like(out[0]))


def test_num_splits_larger_than_blocks():
    """num_splits far beyond the number of key blocks in the cache works (clamped; empty splits merge to 0)."""
    dtype, lengths = torch.float16, [0, 1, 40]
    q, k_cache, v_cache, k, v = make_decode_inputs(3, 48, 1, NHEADS, 2, HEAD_DIM, dtype)
    ref32, _, ref_same = per_request_references(q, k_cache, v_cache, k, v, lengths, causal=False)
    out = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=torch.tensor(lengths, dtype=torch.int32),
                                  num_splits=1000)
    assert_close_to_ref(out, ref32, ref_same)


def test_empty_cache_without_append_gives_zeros():
    """A request with length 0 and no append outputs zeros and LSE +inf, never NaN (split or not)."""
    q, k_cache, v_cache, _, _ = make_decode_inputs(2, 64, 1, NHEADS, 2, HEAD_DIM, torch.float16, append=False)
    for num_splits in (1, 2):
        out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=0, num_splits=num_splits,
                                           return_softmax_lse=True)
        assert torch.equal(out, torch.zeros_like(out)) and torch.isposinf(lse).all()


def test_device_lengths_never_leave_the_buffers():
    """Unchecked lengths (negative, past the cache, an append past the end) never read or write outside it."""
    dtype, nheads_k, head_dim, seqlen_cache, guard = torch.float16, 2, HEAD_DIM, 50, 16
    batch, seqlen_q = 4, 4
    k_buf = randn(batch, seqlen_cache + guard, nheads_k, head_dim, dtype=dtype)
    v_buf = randn(batch, seqlen_cache + guard, nheads_k, head_dim, dtype=dtype)
    k_buf[:, seqlen_cache:] = float("nan")  # guard rows: reading them would poison the output
    v_buf[:, seqlen_cache:] = float("nan")
    k_cache, v_cache = k_buf[:, :seqlen_cache], v_buf[:, :seqlen_cache]
    q = randn(batch, seqlen_q, NHEADS, head_dim, dtype=dtype)
    k = randn(batch, seqlen_q, nheads_k, head_dim, dtype=dtype)
    v = randn(batch, seqlen_q, nheads_k, head_dim, dtype=dtype)
    seqlens = torch.tensor([-3, seqlen_cache - 1, seqlen_cache, seqlen_cache + 1000], dtype=torch.int32, device=DEVICE)
    for num_splits in (1, 3):
        out, lse = launch_kvcache(q, k_cache, v_cache, k, v, seqlens,
                                                   attn_options(head_dim, head_dim**-0.5, True), num_splits, True)
        assert torch.isfinite(out).all() and not torch.isnan(lse).any()
        assert torch.isnan(k_buf[:, seqlen_cache:]).all() and torch.isnan(v_buf[:, seqlen_cache:]).all()
    # clamped semantics: a negative length reads as 0, a length past the cache as seqlen_cache
    assert torch.equal(k_cache[1, seqlen_cache - 1], k[1, 0]) and torch.equal(k_cache[0, :seqlen_q], k[0])


# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------
def test_overflow_raises_for_host_known_lengths():
    """An append past seqlen_cache raises ValueError for an int, a CPU tensor and KVCache, before writing."""
    dtype = torch.float16
    q, k_cache, v_cache, k, v = make_decode_inputs(3, 32, 2, NHEADS, 2, HEAD_DIM, dtype)
    before = k_cache.clone()
    with pytest.raises(ValueError, match="overflow for every request"):
        flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=31)
    with pytest.raises(ValueError, match="overflow for request 2"):
        flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=torch.tensor([0, 30, 31], dtype=torch.int32))
    with pytest.raises(ValueError, match=">= 0"):
        flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=torch.tensor([0, -1, 3], dtype=torch.int32))
    with pytest.raises(ValueError, match="overflow"):  # no append, but lengths past the cache
        flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=33)
    assert torch.equal(k_cache, before)
    flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=30)  # exactly fills the cache

    cache = KVCache(2, 8, 2, HEAD_DIM, dtype=dtype, device=DEVICE)
    qp, kp, vp = make_qkv(2, 6, 6, NHEADS, 2, HEAD_DIM, dtype)
    with pytest.raises(ValueError, match="overflow"):
        cache.prefill(*make_qkv(2, 9, 9, NHEADS, 2, HEAD_DIM, dtype))
    cache.prefill(qp, kp, vp)
    q1, _, _, k1, v1 = make_decode_inputs(2, 1, 2, NHEADS, 2, HEAD_DIM, dtype)
    cache.decode(q1, k1, v1)  # 6 + 2 = 8: fits
    assert cache.seqlens == [8, 8]
    k_before = cache.k_cache.clone()
    with pytest.raises(ValueError, match="overflow for request 0"):
        cache.decode(q1[:, :1], k1[:, :1], v1[:, :1])
    assert cache.seqlens == [8, 8] and cache.seqlens_device.tolist() == [8, 8]
    assert torch.equal(cache.k_cache, k_before)


def _bad_inputs():
    d, t = HEAD_DIM, lambda *s, dt=torch.float16: randn(*s, dtype=dt)
    q, kc, vc, k, v = t(2, 1, 4, d), t(2, 16, 2, d), t(2, 16, 2, d), t(2, 1, 2, d), t(2, 1, 2, d)
    i32 = lambda *x: torch.tensor(x, dtype=torch.int32)
    return [
        ("q not a tensor", dict(q=q.tolist()), TypeError, "torch.Tensor"),
        ("q rank", dict(q=q[0]), ValueError, "4 dims"),
        ("dtype mismatch", dict(k_cache=kc.float()), ValueError, "one dtype"),
        ("k without v", dict(v=None), ValueError, "both"),
        ("k longer than q", dict(k=t(2, 2, 2, d), v=t(2, 2, 2, d)), ValueError, "seqlen_new <= seqlen_q"),
        ("k heads", dict(k=t(2, 1, 1, d), v=t(2, 1, 1, d)), ValueError, "nheads_k=2"),
        ("k and v shapes differ", dict(v=t(2, 1, 1, d)), ValueError, "same shape"),
        ("cache shapes differ", dict(v_cache=t(2, 15, 2, d)), ValueError, "same shape"),
        ("cache batch", dict(k_cache=t(3, 16, 2, d), v_cache=t(3, 16, 2, d)), ValueError, "batch"),
        ("head dims differ", dict(k_cache=t(2, 16, 2, 16), v_cache=t(2, 16, 2, 16)), ValueError, "head dim"),
        ("heads not divisible", dict(k_cache=t(2, 16, 3, d), v_cache=t(2, 16, 3, d)), ValueError, "divisible"),
        ("seqlen_q 0", dict(q=t(2, 0, 4, d), k=t(2, 0, 2, d), v=t(2, 0, 2, d)), ValueError, "seqlen_q >= 1"),
        ("int64 lengths", dict(cache_seqlens=torch.tensor([1, 2])), TypeError, "int32"),
        ("float lengths", dict(cache_seqlens=1.0), TypeError, "int"),
        ("lengths shape", dict(cache_seqlens=i32(1, 2, 3)), ValueError, r"shape \(2,\)"),
        ("num_splits < 0", dict(num_splits=-1), ValueError, "num_splits"),
        ("non-contiguous head dim", dict(k_cache=t(2, 16, 2, 2 * d)[..., ::2]), ValueError, "contiguous last dim"),
    ], dict(q=q, k_cache=kc, v_cache=vc, k=k, v=v, cache_seqlens=3)


@pytest.mark.parametrize("case", range(len(_bad_inputs()[0])), ids=[c[0] for c in _bad_inputs()[0]])
def test_validation_errors(case):
    """Bad types, shapes, dtypes and lengths raise the documented exception with a clear message."""
    cases, base = _bad_inputs()
    _, overrides, exc, match = cases[case]
    kwargs = {**base, **overrides}
    with pytest.raises(exc, match=match):
        flash_attn_with_kvcache(kwargs.pop("q"), kwargs.pop("k_cache"), kwargs.pop("v_cache"), kwargs.pop("k"),
                                kwargs.pop("v"), **kwargs)


def test_fast_launch_reuses_kernel_only_for_the_same_key(monkeypatch):
    """The launch cache dispatches through Triton once per key -- the caller's key, every constexpr's
    value, which arguments are None, the launch options -- then calls the compiled kernel's C launcher
    directly: every argument in signature order (keyword arguments and defaults placed), tensors as
    raw pointers, the current stream, no launch hooks."""
    import triton.language as tl

    import tritonattn.launch.fast as fast
    from tritonattn.launch.fast import LaunchCache

    launches = []

    class Launcher:  # Triton 3.5 / 3.6's CudaLauncher (the flat launch ABI), with no scratch to allocate
        launch_cooperative_grid, launch_pdl, global_scratch_size, profile_scratch_size = 0, 1, 0, 0

        def __call__(self, gridX, gridY, gridZ, stream, function, *args):
            raise AssertionError("a hit calls the C launch itself")

        @staticmethod
        def launch(gx, gy, gz, stream, function, cooperative, pdl, scratch, profile_scratch, packed_metadata,
                   launch_metadata, enter, exit_, *args):
            assert (function, packed_metadata) == (FakeCompiled.function, FakeCompiled.packed_metadata)
            assert (cooperative, pdl, scratch, profile_scratch, launch_metadata, enter, exit_) == (
                0, 1, None, None, None, None, None)
            launches.append(("fast", (gx, gy, gz), stream, args))

    class FakeCompiled:  # what JITFunction.run returns on a GPU
        function, packed_metadata = object(), object()
        run = Launcher()

    def kernel(X, n, Y=None, m=7, BLOCK: tl.constexpr = 16):  # the Python function a JITFunction wraps
        pass

    class FakeJit:
        fn = staticmethod(kernel)

        def __getitem__(self, grid):
            def run(*args, **options):
                launches.append(("dispatch", grid, args, options))
                return FakeCompiled()
            return run

    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 1000 + index, raising=False)
    monkeypatch.setattr(fast, "launch_hooks_active", lambda: False)
    x = torch.arange(4)
    cache = LaunchCache(FakeJit())
    cache.enabled = True
    assert cache.names == ["X", "n", "Y", "m", "BLOCK"] and cache.constexprs == (4,)
    first = cache("a", (4, 2, 1), (x, 2), num_warps=4)
    assert first == cache.key_of("a", [x, 2, None, 7, 16], 4, 1, False, None) == (
        "a", (16,), (0, 0, None, 0), 4, 1, False, None)  # tensor, int class, None, int class
    again = cache("a", (4, 2, 1), (x, 3), num_warps=4, kwargs={"m": 9, "BLOCK": 16}, device_index=1)
    assert again == first
    assert [entry[0] for entry in launches] == ["dispatch", "fast"]
    assert launches[1] == ("fast", (4, 2, 1), 1001, (x.data_ptr(), 3, None, 9, 16))
    others = [
        cache("a", (4, 2, 1), (x, 3), num_warps=4, kwargs={"BLOCK": 32}),  # another constexpr value
        cache("a", (4, 2, 1), (x, 3, x), num_warps=4),  # Y no longer None
        cache("a", (4, 2, 1), (x, 3), num_warps=8),  # another launch option
        cache("b", (8, 1, 1), (x, 5), num_warps=4),  # another caller key
    ]
    assert len({first, *others}) == 5
    assert [entry[0] for entry in launches[2:]] == ["dispatch"] * 4
    assert cache("a", (2, 1, 1), (x, 5), num_warps=4, kwargs={"BLOCK": 32}) == others[0]
    assert launches[-1] == ("fast", (2, 1, 1), 1000, (x.data_ptr(), 5, None, 7, 32))
    # integers Triton specialises on (1, multiples of 16, past 32 bits) are other kernels
    assert len({others[0], *(cache("a", (2, 1, 1), (x, n), num_warps=4, kwargs={"BLOCK": 32})
                             for n in (1, 16, 2**31))}) == 4
    assert [entry[0] for entry in launches[-3:]] == ["dispatch"] * 3
    monkeypatch.setattr(fast, "launch_hooks_active", lambda: True)  # a profiler sees every launch
    cache("a", (4, 2, 1), (x, 2), num_warps=4)
    assert launches[-1][0] == "dispatch"
    cache.enabled = False
    assert cache("c", (1, 1, 1), (x, 1), num_warps=4) is None
    assert cache("c", (1, 1, 1), (x, 1), num_warps=4) is None
    assert [entry[0] for entry in launches[-2:]] == ["dispatch", "dispatch"]


def test_launch_hooks_detected():
    """A Triton launch hook switches the fast path off (HookChain in Triton >= 3.5, a callable before)."""
    import triton

    from tritonattn.launch.fast import launch_hooks_active

    knobs = getattr(triton, "knobs", None)
    if knobs is None or not hasattr(knobs.runtime.launch_enter_hook, "add"):
        pytest.skip("this Triton has no launch-hook chain")
    assert not launch_hooks_active()
    hook = lambda metadata: None  # noqa: E731
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        assert launch_hooks_active()
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert not launch_hooks_active()


# --------------------------------------------------------------------------------------------
# KVCache
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_kvcache_prefill_decode_round_trip(dtype):
    """KVCache: prompts prefilled, then decode steps (seqlen_q 1 and 3), each match the reference."""
    batch, nheads, nheads_k, head_dim = 2, NHEADS, 2, HEAD_DIM
    prompt, steps = (20, [1, 1, 3, 1]) if INTERPRET else (300, [1, 1, 3, 1, 8])
    total = prompt + sum(steps)
    q_all, k_all, v_all = make_qkv(batch, total, total, nheads, nheads_k, head_dim, dtype)
    cache = KVCache(batch, total + 5, nheads_k, head_dim, dtype=dtype, device=DEVICE)

    outs = [cache.prefill(q_all[:, :prompt], k_all[:, :prompt], v_all[:, :prompt])]
    assert cache.seqlens == [prompt] * batch
    pos = prompt
    for n in steps:
        outs.append(cache.decode(q_all[:, pos : pos + n], k_all[:, pos : pos + n], v_all[:, pos : pos + n]))
        pos += n
        assert cache.seqlens == [pos] * batch and cache.seqlens_device.tolist() == [pos] * batch
    out = torch.cat(outs, 1)
    ref32, _, ref_same = references(q_all, k_all, v_all, causal=True)  # bottom-right == causal per step
    assert_close_to_ref(out, ref32, ref_same)
    assert torch.equal(cache.k_cache[:, :total], k_all) and torch.equal(cache.v_cache[:, :total], v_all)

    # reset one request, prefill it again with a new prompt, and decode both together
    cache.reset(batch_idx=1)
    assert cache.seqlens == [total, 0]
    with pytest.raises(ValueError, match="empty"):
        cache.prefill(q_all[:1, :4], k_all[:1, :4], v_all[:1, :4], batch_idx=0)
    q2, k2, v2 = make_qkv(1, 4, 4, nheads, nheads_k, head_dim, dtype)
    cache.prefill(q2, k2, v2, batch_idx=[1])
    assert cache.seqlens == [total, 4]
    qs, _, _, ks, vs = make_decode_inputs(batch, 1, 1, nheads, nheads_k, head_dim, dtype)
    out = cache.decode(qs, ks, vs)
    ref32, _, ref_same = per_request_references(
        qs, torch.stack([k_all[0, :total], torch.cat([k2[0], k_all[1, 4:total]])]),
        torch.stack([v_all[0, :total], torch.cat([v2[0], v_all[1, 4:total]])]), ks, vs, [total, 4], causal=True)
    assert_close_to_ref(out, ref32, ref_same)
    cache.reset()
    assert cache.seqlens == [0, 0] and cache.seqlens_device.tolist() == [0, 0]


# --------------------------------------------------------------------------------------------
# GPU only
# --------------------------------------------------------------------------------------------
@pytest.mark.gpu
@needs_graph_capture
@pytest.mark.parametrize("num_splits", [1, 4])
def test_cuda_graph_replay_equals_eager(num_splits):
    """Append + decode captured once in a CUDA graph (lengths advanced in-graph) replays like eager calls."""
    dtype, batch, nheads, nheads_k, head_dim, seqlen_cache, steps = torch.bfloat16, 4, 32, 8, 128, 4096, 6
    q_s = randn(batch, 1, nheads, head_dim, dtype=dtype)
    k_s = randn(batch, 1, nheads_k, head_dim, dtype=dtype)
    v_s = randn(batch, 1, nheads_k, head_dim, dtype=dtype)
    k_cache = randn(batch, seqlen_cache, nheads_k, head_dim, dtype=dtype)
    v_cache = randn(batch, seqlen_cache, nheads_k, head_dim, dtype=dtype)
    start = torch.tensor([0, 1, 1000, 3000], dtype=torch.int32, device=DEVICE)
    k_eager, v_eager, lens_eager = k_cache.clone(), v_cache.clone(), start.clone()
    lens = start.clone()

    # warm up (compiles) on a side stream, then restore the state and capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        flash_attn_with_kvcache(q_s, k_cache.clone(), v_cache.clone(), k_s, v_s, cache_seqlens=lens.clone(),
                                num_splits=num_splits)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_s = flash_attn_with_kvcache(q_s, k_cache, v_cache, k_s, v_s, cache_seqlens=lens, num_splits=num_splits)
        lens.add_(1)
    lens.copy_(start)  # capture ran nothing: reset anyway

    for step in range(steps):
        q, k, v = (randn(*t.shape, dtype=dtype) for t in (q_s, k_s, v_s))
        q_s.copy_(q)
        k_s.copy_(k)
        v_s.copy_(v)
        graph.replay()
        out_eager = flash_attn_with_kvcache(q, k_eager, v_eager, k, v, cache_seqlens=lens_eager, num_splits=num_splits)
        lens_eager += 1
        torch.cuda.synchronize()
        assert torch.equal(out_s, out_eager), f"step {step}: graph and eager outputs differ"
        assert torch.equal(lens, lens_eager)
    assert torch.equal(k_cache, k_eager) and torch.equal(v_cache, v_eager)
    ref32, _, ref_same = per_request_references(q, k_cache, v_cache, None, None, lens_eager.tolist(), causal=False)
    assert_close_to_ref(out_eager, ref32, ref_same)


@pytest.mark.gpu
@needs_graph_capture
def test_kvcache_cuda_graph():
    """KVCache.decode captured in a CUDA graph advances the device lengths on every replay."""
    dtype, batch, nheads, nheads_k, head_dim = torch.float16, 2, 8, 2, 64
    cache = KVCache(batch, 256, nheads_k, head_dim, dtype=dtype, device=DEVICE)
    cache.prefill(*make_qkv(batch, 10, 10, nheads, nheads_k, head_dim, dtype))
    q_s, _, _, k_s, v_s = make_decode_inputs(batch, 1, 1, nheads, nheads_k, head_dim, dtype)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile outside the capture (writes row 10, rewritten below)
        flash_attn_with_kvcache(q_s, cache.k_cache, cache.v_cache, k_s, v_s, cache_seqlens=cache.seqlens_device)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_s = cache.decode(q_s, k_s, v_s)
    for _ in range(5):
        graph.replay()
    assert cache.seqlens == [11, 11]  # the host mirror advanced once, at capture
    assert cache.refresh_host_seqlens() == [15, 15]  # the device lengths: 10 + 5 replays
    k_ref, v_ref = cache.k_cache[:, :15].clone(), cache.v_cache[:, :15].clone()
    assert torch.equal(k_ref[:, 10:15], k_s.expand(batch, 5, nheads_k, head_dim))
    ref32, _, ref_same = per_request_references(q_s, k_ref, v_ref, None, None, [15, 15], causal=False)
    assert_close_to_ref(out_s, ref32, ref_same)


def _no_full_path(*args, **kwargs):
    raise AssertionError("a replayable call took the full path")


@pytest.mark.gpu
def test_replayed_calls_match_the_full_path(monkeypatch):
    """A repeat of a validated call with device lengths replays its recorded launches (tritonattn.launch.decode
    [Note] Host overhead): fresh values and lengths, a recording made with aliased tensors, a misaligned
    q (takes the full path), split scratch shared by calls of different sizes, and another stream all
    give the reference's answer and append."""
    import tritonattn.launch.decode as decode
    import tritonattn.launch.replay as replay

    dtype, nheads, nheads_k, head_dim = torch.bfloat16, 32, 8, 128

    def check(batch, seqlen_cache, lengths, num_splits=0, stream=None, misalign=False):
        q, k_cache, v_cache, k, v = make_decode_inputs(batch, seqlen_cache, 1, nheads, nheads_k, head_dim, dtype)
        if misalign:  # same shape and strides, data 8 bytes past a 16-byte boundary
            q = torch.empty(q.numel() + 8, dtype=dtype, device=DEVICE)[4 : 4 + q.numel()].view(q.shape).copy_(q)
            assert q.data_ptr() % 16 == 8
        lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
        ref32, ref_lse, ref_same = per_request_references(q, k_cache, v_cache, k, v, lengths, causal=False)
        with torch.cuda.stream(stream if stream is not None else torch.cuda.current_stream()):
            out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens, num_splits=num_splits,
                                               return_softmax_lse=True)
        torch.cuda.synchronize()
        assert_close_to_ref(out, ref32, ref_same)
        assert_lse_close(lse, ref_lse, dtype)
        rows = torch.arange(batch, device=DEVICE), lens.long()
        assert torch.equal(k_cache[rows], k[:, 0]) and torch.equal(v_cache[rows], v[:, 0])

    replay.REPLAYS.clear()
    check(1, 4096, [3000])  # the full path, recorded
    assert len(replay.REPLAYS) == 1
    with monkeypatch.context() as m:
        m.setattr(decode, "launch_kvcache", _no_full_path)
        for lengths in ([17], [4095], [0]):
            check(1, 4096, lengths)  # replayed with new pointers, values and lengths
    replay.REPLAYS.clear()  # recorded with k is v and k_cache is v_cache: the replay must not alias them
    q, k_cache, _, k, _ = make_decode_inputs(1, 4096, 1, nheads, nheads_k, head_dim, dtype)
    flash_attn_with_kvcache(q, k_cache, k_cache, k, k, cache_seqlens=torch.tensor([9], dtype=torch.int32,
                                                                                   device=DEVICE),
                            return_softmax_lse=True)
    with monkeypatch.context() as m:
        m.setattr(decode, "launch_kvcache", _no_full_path)
        check(1, 4096, [1234])
    check(1, 4096, [2000], misalign=True)  # compiled for aligned pointers: not replayed
    check(2, 8192, [8000, 5], num_splits=32)  # a larger split scratch...
    check(1, 4096, [100])  # ... that the smaller call then shares
    check(1, 4096, [4000], stream=torch.cuda.Stream())  # another stream: its own scratch
    assert len(replay.REPLAYS) == 2  # the misaligned call was not recorded
    # a recording keeps no tensor alive: nothing reachable from the replays is one
    seen, todo = set(), list(replay.REPLAYS.values())
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        assert not isinstance(obj, torch.Tensor), "a recorded replay holds a tensor"
        if isinstance(obj, (tuple, list)):
            todo.extend(obj)
        elif isinstance(obj, dict):
            todo.extend(obj.values())
        elif isinstance(obj, DirectLaunch):
            todo.extend(getattr(obj, name) for name in DirectLaunch.__slots__)


@pytest.mark.gpu
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("append,return_lse,causal,seqlen_q", [(True, False, False, 1), (False, True, False, 1),
                                                               (True, True, True, 4), (False, False, True, 4)])
def test_replay_variants(monkeypatch, paged, append, return_lse, causal, seqlen_q):
    """Replays of dense and paged calls (a new block table each call), with and without an append, the
    LSE, the causal mask and several new tokens, equal the reference; the second call is a replay."""
    import tritonattn.launch.decode as decode
    import tritonattn.launch.replay as replay

    dtype, batch, nheads, nheads_k, head_dim, seqlen_cache, page = torch.bfloat16, 2, 32, 8, 128, 2048, 64

    def call(lengths):
        q, k_cache, v_cache, k, v = make_decode_inputs(batch, seqlen_cache, seqlen_q, nheads, nheads_k, head_dim,
                                                       dtype, append=append)
        ref32, ref_lse, ref_same = per_request_references(q, k_cache, v_cache, k, v, lengths, causal=causal)
        kwargs = dict(cache_seqlens=torch.tensor(lengths, dtype=torch.int32, device=DEVICE), causal=causal,
                      return_softmax_lse=return_lse)
        if paged:
            k_pool, v_pool, table = paged_copy(k_cache, v_cache, page)
            result = flash_attn_with_kvcache(q, k_pool, v_pool, k, v, block_table=table, **kwargs)
            k_after, v_after = (pool[table.long()].reshape(k_cache.shape) for pool in (k_pool, v_pool))
        else:
            result = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, **kwargs)
            k_after, v_after = k_cache, v_cache
        out, lse = result if return_lse else (result, None)
        torch.cuda.synchronize()
        assert_close_to_ref(out, ref32, ref_same)
        if return_lse:
            assert_lse_close(lse, ref_lse, dtype)
        if append:
            for b, n in enumerate(lengths):
                assert torch.equal(k_after[b, n : n + seqlen_q], k[b])
                assert torch.equal(v_after[b, n : n + seqlen_q], v[b])

    replay.REPLAYS.clear()
    call([1000, 7])  # the full path, recorded
    assert len(replay.REPLAYS) == 1
    monkeypatch.setattr(decode, "launch_kvcache", _no_full_path)
    call([seqlen_cache - seqlen_q, 5])


def test_replay_templates_take_pointers_by_parameter():
    """A recorded launch's pointer slots follow the kernel's parameter names, not the tensors the
    recording passed (aliased there: k is v), and its option slots take the replayed call's runtime
    options; the replay key holds the options' compiled part only and plain Python arguments only."""
    import tritonattn.jit.decode as decode_jit
    import tritonattn.launch.decode as decode
    import tritonattn.launch.replay as replay
    from tritonattn.launch.fast import LaunchCache

    for names, sources in ((decode.decode_launcher.names, replay.DECODE_SOURCES),
                           (decode.combine_launcher.names, replay.COMBINE_SOURCES)):
        assert set(sources) <= set(names)
    launch = LaunchCache(decode_jit.decode_kernel)
    launch.enabled = True
    names = launch.names
    options = attn_options(32, 0.125, causal=True)
    x, y = torch.zeros(4), torch.zeros(4)
    values = {name: x if name in replay.DECODE_SOURCES else 1 for name in names}
    values["K_new"] = values["V_new"] = y  # k is v in the recording
    values["Block_table"] = None  # dense: not a pointer
    values.update(options.runtime)
    split = names.index("softmax_scale")  # as the launcher passes them: shapes positional, the rest by keyword
    args, kwargs = [values[n] for n in names[:split]], {n: values[n] for n in names[split:]}
    full = launch.positional(args, kwargs)
    assert full == [values[n] for n in names]
    pointers = tuple(i for i, arg in enumerate(full) if isinstance(arg, torch.Tensor))
    key = launch.key_of(("sig", 0), full, 4, 2, False, None)
    assert replay.replay_template(launch, key, (1, 1, 1), args, kwargs, replay.DECODE_SOURCES, options) is None
    launch.kernels[key] = (None, pointers, DirectLaunch(None, (), pointers))
    direct, grid, template, slots, option_slots = replay.replay_template(launch, key, (1, 1, 1), args, kwargs,
                                                                          replay.DECODE_SOURCES, options)
    assert direct is launch.kernels[key][2] and grid == (1, 1, 1)
    assert dict(slots) == {names.index(n): replay.DECODE_SOURCES[n] for n in replay.DECODE_SOURCES
                           if n != "Block_table"}
    assert option_slots == tuple(sorted((names.index(n), n) for n in options.runtime))  # every runtime option
    assert not any(isinstance(arg, torch.Tensor) for arg in template)
    assert replay.replay_template(launch, key, (1, 1, 1), args, kwargs, {}, options) is None

    sig, lens = ("sig",), torch.zeros(2, dtype=torch.int32)
    key = replay.replay_key_of(sig, lens, attn_options(32), 0, False)
    assert key is not None and replay.replay_key_of(sig, lens, options, 3, True) is not None
    assert replay.replay_key_of(sig, lens, attn_options(32, 0.5), 0, False) == key  # runtime: filled into the replay
    assert replay.replay_key_of(sig, lens, attn_options(32, causal=True), 0, False) != key  # compiled: another launch
    for bad in ((5, options, 0, False), (lens, options, 2.0, False), (lens, options, 0, 1)):
        assert replay.replay_key_of(sig, *bad) is None


@pytest.mark.gpu
def test_threads_sharing_a_stream_get_their_own_split_scratch():
    """Threads issuing split decode calls on one stream (launches of different threads interleave)
    each get the answer a lone call gives: the reused split scratch is per thread."""
    import threading

    dtype, nheads, nheads_k, head_dim, calls = torch.bfloat16, 32, 8, 128, 40
    cases = []
    for i in range(4):
        q, k_cache, v_cache, _, _ = make_decode_inputs(1, 4096, 1, nheads, nheads_k, head_dim, dtype, append=False)
        lens = torch.tensor([1000 + 700 * i], dtype=torch.int32, device=DEVICE)
        cases.append((q, k_cache, v_cache, lens, flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens)))
    torch.cuda.synchronize()
    errors = []

    def worker(q, k_cache, v_cache, lens, expected):
        try:
            outs = [flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens) for _ in range(calls)]
            torch.cuda.synchronize()
            errors.extend(f"call {n}" for n, out in enumerate(outs) if not torch.equal(out, expected))
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(repr(exc))

    threads = [threading.Thread(target=worker, args=case) for case in cases]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:5]


def test_split_scratch_is_per_stream_and_thread(monkeypatch):
    """The reused split scratch is kept per (device, stream) in each Python thread, grows when a call
    needs more, and is never the cached buffer while a graph is captured or above the size cap."""
    import threading
    from types import SimpleNamespace

    import tritonattn.config.tables as tables
    import tritonattn.launch.replay as replay

    monkeypatch.setattr(replay, "SCRATCH_LOCAL", replay.ScratchLocal())  # this test's buffers go with it
    real_empty, stream, capturing = torch.empty, [7], [False]
    monkeypatch.setattr(torch, "empty", lambda n, dtype, device: real_empty(n, dtype=dtype))
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: stream[0], raising=False)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    cuda = SimpleNamespace(type="cuda")
    first = replay.split_scratch(100, cuda, 0)
    assert replay.split_scratch(50, cuda, 0) is first  # same thread and stream: reused
    bigger = replay.split_scratch(200, cuda, 0)
    assert bigger is not first and replay.split_scratch(100, cuda, 0) is bigger
    assert replay.split_scratch(100, cuda, 1) is not bigger  # another device
    stream[0] = 8
    assert replay.split_scratch(100, cuda, 0) is not bigger  # another stream
    stream[0] = 7
    other = []
    thread = threading.Thread(target=lambda: other.append(replay.split_scratch(100, cuda, 0)))
    thread.start()
    thread.join()
    assert other[0] is not bigger  # another thread
    capturing[0] = True
    assert replay.split_scratch(100, cuda, 0) is not bigger  # a graph capture: its own allocation
    capturing[0] = False
    huge = tables.SPLIT_SCRATCH_CACHE_BYTES // 4 + 1
    monkeypatch.setattr(torch, "empty", lambda n, dtype, device: SimpleNamespace(numel=lambda: n))
    assert replay.split_scratch(huge, cuda, 0) is not replay.split_scratch(huge, cuda, 0)  # not kept


@pytest.mark.gpu
@pytest.mark.slow
def test_large_cache_int64_offsets():
    """Caches of more than 2^31 elements: rows at the end of the buffer are read and written correctly."""
    dtype, batch, seqlen_cache, nheads_k, head_dim = torch.float16, 2, 2**21, 8, 128
    assert batch * seqlen_cache * nheads_k * head_dim > 2**31
    q, k_cache, v_cache, k, v = make_decode_inputs(batch, seqlen_cache, 1, nheads_k, nheads_k, head_dim, dtype)
    lengths = [100, seqlen_cache - 1]
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=torch.tensor(
        lengths, dtype=torch.int32, device=DEVICE), return_softmax_lse=True)
    assert torch.equal(k_cache[1, -1], k[1, 0]) and torch.equal(v_cache[1, -1], v[1, 0])
    assert torch.equal(k_cache[0, 100], k[0, 0])
    ref32, ref_lse, ref_same = per_request_references(q, k_cache, v_cache, None, None, [101, seqlen_cache],
                                                      causal=False)
    assert_close_to_ref(out, ref32, ref_same)
    assert_lse_close(lse, ref_lse, dtype)


def test_validation_cache_never_hides_an_error():
    """The per-signature validation cache (tritonattn.launch.decode [Note] Host overhead; on a GPU, off under the
    interpreter) skips checks only for a signature already validated: a changed dtype, shape or stride
    after a good call still raises, and a repeated good signature with new values gives the right answer."""
    dtype, batch, nheads, nheads_k, head_dim, seqlen_cache = torch.float16, 2, 8, 2, 64, 256
    q, k_cache, v_cache, k, v = make_decode_inputs(batch, seqlen_cache, 1, nheads, nheads_k, head_dim, dtype)
    flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=10)  # validated and cached
    flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=10)  # the no-append signature too
    with pytest.raises(ValueError, match="both given"):
        flash_attn_with_kvcache(q, k_cache, v_cache, None, v, cache_seqlens=10)
    with pytest.raises(ValueError, match="dtype"):
        flash_attn_with_kvcache(q, k_cache, v_cache, k.float(), v, cache_seqlens=10)
    with pytest.raises(ValueError, match="shape"):
        flash_attn_with_kvcache(q, k_cache, v_cache, k[:, :, :1], v[:, :, :1], cache_seqlens=10)
    with pytest.raises(ValueError, match="contiguous last dim"):
        flash_attn_with_kvcache(q.transpose(2, 3).contiguous().transpose(2, 3), k_cache, v_cache, k, v,
                                cache_seqlens=10)
    q2, k2, v2 = (torch.randn_like(t) for t in (q, k, v))  # same signature, new values
    lengths = [37, 200]
    out = flash_attn_with_kvcache(q2, k_cache, v_cache, k2, v2, cache_seqlens=torch.tensor(lengths, dtype=torch.int32))
    ref32, _, ref_same = per_request_references(q2, k_cache, v_cache, None, None, [n + 1 for n in lengths],
                                                causal=False)
    assert_close_to_ref(out, ref32, ref_same)
