"""Chunked prefill: flash_attn_with_kvcache with many new tokens per request runs the prefill kernel
family over the cache (tritonattn.launch.decode [Note] Chunked prefill), dense or paged.

Checked: the prefill path against the decode kernel (num_splits=1 forces it) and the reference,
ragged lengths incl. 0, causal or not, with or without an append, MHA/GQA/MQA, page sizes that take
the tensor-descriptor path on Hopper (64, 256) and the gathering path (16, 48); the append writes
exactly the new slots; a prompt prefilled in uneven chunks equals one-shot prefill. Under the
interpreter the dispatch threshold is lowered so small shapes exercise the same code.
"""

from __future__ import annotations

import math

import pytest
import torch

import tritonattn.config.tables as tables
from helpers import (
    DEVICE,
    INTERPRET,
    ON_GPU,
    assert_close_to_ref,
    assert_lse_close,
    per_request_references,
    record_chunked_prefill,
    references,
)
from tritonattn import flash_attn_func, flash_attn_with_kvcache
from tritonattn.config.hardware import device_target
from tritonattn.testing import agreement_tolerance

DTYPES = [torch.float16] + ([torch.bfloat16] if ON_GPU else [torch.float32])
HEAD_DIM = 128 if ON_GPU else 32
NHEADS = 16 if ON_GPU else 4
CHUNK = 300 if ON_GPU else 12  # new tokens per request in one call: >= the dispatch threshold
CAPACITY = 2304 if ON_GPU else 96  # keys a request can hold: whole pages of 16, 48, 64 and 256
PAGE_SIZES = [16, 48, 64, 256] if ON_GPU else [16, 48]


@pytest.fixture(autouse=True)
def small_threshold(monkeypatch):
    """Under the interpreter, dispatch to the prefill path from 8 new tokens so small shapes take it."""
    if INTERPRET:
        monkeypatch.setattr(tables, "CHUNKED_PREFILL_MIN_SEQLEN_Q", 8)
    assert CHUNK >= tables.CHUNKED_PREFILL_MIN_SEQLEN_Q


def randn(*shape, dtype):
    return torch.randn(*shape, device=DEVICE, dtype=dtype)


def ragged_lengths(batch: int, seqlen_new: int) -> list:
    """Lengths before the call: 0, a few, about half the capacity, and full up to the new tokens."""
    choices = [0, 5, CAPACITY // 2 + 3, CAPACITY - seqlen_new]
    return [choices[b % len(choices)] for b in range(batch)]


def to_pool(k_dense, v_dense, page_size, seed=0):
    """Scatter dense (B, CAPACITY, H_KV, D) caches into a shuffled pool through a random block table."""
    batch, capacity = k_dense.shape[:2]
    blocks = capacity // page_size
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(batch * blocks + 3, generator=gen)[: batch * blocks]  # spare blocks stay unused
    table = perm.view(batch, blocks).to(torch.int32)
    pools = []
    for dense in (k_dense, v_dense):
        stale = torch.randn(batch * blocks + 3, page_size, *dense.shape[2:], generator=gen)  # the same on every call
        pool = stale.to(device=DEVICE, dtype=dense.dtype)
        pool[table.long().flatten().to(DEVICE)] = dense.reshape(batch * blocks, page_size, *dense.shape[2:])
        pools.append(pool)
    return pools[0], pools[1], table.to(DEVICE)


@pytest.mark.parametrize("page_size", [None] + PAGE_SIZES)
@pytest.mark.parametrize("group", [1, 4] + ([NHEADS] if ON_GPU else []))
@pytest.mark.parametrize("append", [True, False])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_path_matches_decode_path_and_reference(dtype, causal, append, group, page_size):
    """The prefill path and the decode kernel (num_splits 0 and 1) match the reference, each other and their caches."""
    if page_size is not None and CAPACITY % page_size:
        pytest.skip("capacity must be whole pages")
    if INTERPRET and (dtype == torch.float32 and (group != 1 or page_size is not None)):
        pytest.skip("fp32 on the interpreter: one case")
    batch, nheads_k = 4, NHEADS // group
    lengths = ragged_lengths(batch, CHUNK)
    q = randn(batch, CHUNK, NHEADS, HEAD_DIM, dtype=dtype)
    k_cache = randn(batch, CAPACITY, nheads_k, HEAD_DIM, dtype=dtype)
    v_cache = randn(batch, CAPACITY, nheads_k, HEAD_DIM, dtype=dtype)
    k = randn(batch, CHUNK, nheads_k, HEAD_DIM, dtype=dtype) if append else None
    v = randn(batch, CHUNK, nheads_k, HEAD_DIM, dtype=dtype) if append else None
    ref32, ref_lse, ref_same = per_request_references(q, k_cache, v_cache, k, v, lengths, causal=causal)
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)

    results = {}
    for name, num_splits in (("prefill path", 0), ("decode kernel", 1)):
        if page_size is None:
            kc, vc, table = k_cache.clone(), v_cache.clone(), None
        else:
            kc, vc, table = to_pool(k_cache, v_cache, page_size)
        out, lse = flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=seqlens, block_table=table, causal=causal,
                                           num_splits=num_splits, return_softmax_lse=True)
        assert torch.isfinite(out).all(), f"{name}: non-finite output"
        assert_close_to_ref(out, ref32, ref_same, msg=name)
        assert_lse_close(lse, ref_lse, dtype, msg=name)
        results[name] = (out, kc, vc)
    (out_p, kc_p, vc_p), (out_d, kc_d, vc_d) = results["prefill path"], results["decode kernel"]
    diff = (out_p.float() - out_d.float()).norm() / out_d.float().norm()
    assert diff <= agreement_tolerance(dtype), f"prefill path vs decode kernel rel err {diff:.2e}"
    assert torch.equal(kc_p, kc_d) and torch.equal(vc_p, vc_d), "the two paths left different caches"
    assert torch.equal(seqlens.cpu(), torch.tensor(lengths, dtype=torch.int32)), "cache_seqlens was modified"


@pytest.mark.parametrize("page_size", [None, 16])
def test_append_writes_exactly_the_new_slots(page_size):
    """The prefill path's append writes each request's new rows into its cache (dense or paged) and no other row."""
    dtype, batch, nheads_k = torch.float16, 3, 2
    lengths = [0, 7, CAPACITY - CHUNK]
    q = randn(batch, CHUNK, NHEADS, HEAD_DIM, dtype=dtype)
    k, v = (randn(batch, CHUNK, nheads_k, HEAD_DIM, dtype=dtype) for _ in range(2))
    k_cache, v_cache = (randn(batch, CAPACITY, nheads_k, HEAD_DIM, dtype=dtype) for _ in range(2))
    k_exp, v_exp = k_cache.clone(), v_cache.clone()
    for b, length in enumerate(lengths):
        k_exp[b, length : length + CHUNK], v_exp[b, length : length + CHUNK] = k[b], v[b]
    if page_size is None:
        flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=torch.tensor(lengths, dtype=torch.int32),
                                causal=True)
        assert torch.equal(k_cache, k_exp) and torch.equal(v_cache, v_exp)
    else:
        k_pool, v_pool, table = to_pool(k_cache, v_cache, page_size)
        k_pool_exp, v_pool_exp, _ = to_pool(k_exp, v_exp, page_size)  # same seed: same table, same stale blocks
        flash_attn_with_kvcache(q, k_pool, v_pool, k, v, cache_seqlens=torch.tensor(lengths, dtype=torch.int32),
                                block_table=table, causal=True)
        used = table.long().flatten()
        assert torch.equal(k_pool[used], k_pool_exp[used]) and torch.equal(v_pool[used], v_pool_exp[used])


@pytest.mark.parametrize("page_size", [None, 16, 64] if ON_GPU else [None, 16])
def test_prompt_in_uneven_chunks_equals_one_shot(page_size):
    """Chunks of uneven sizes (some below the dispatch threshold, so both kernels take turns)
    appended one after another give the one-shot causal prefill's output and cache."""
    dtype = torch.bfloat16 if ON_GPU else torch.float16
    chunks = [300, 1000, 7, 129, 600] if ON_GPU else [5, 17, 1, 9, 24]
    total, nheads_k = sum(chunks), NHEADS // 4
    capacity = -(-total // 64) * 64
    q = randn(1, total, NHEADS, HEAD_DIM, dtype=dtype)
    k, v = (randn(1, total, nheads_k, HEAD_DIM, dtype=dtype) for _ in range(2))
    k_cache, v_cache = (torch.zeros(1, capacity, nheads_k, HEAD_DIM, device=DEVICE, dtype=dtype) for _ in range(2))
    table = None
    if page_size is not None:
        k_cache, v_cache, table = to_pool(k_cache, v_cache, page_size)
    seqlens = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    outs, start = [], 0
    for n in chunks:
        sl = slice(start, start + n)
        outs.append(flash_attn_with_kvcache(q[:, sl], k_cache, v_cache, k[:, sl], v[:, sl], cache_seqlens=seqlens,
                                            block_table=table, causal=True))
        seqlens += n
        start += n
    out = torch.cat(outs, 1)
    one_shot = flash_attn_func(q, k, v, causal=True)
    ref32, _, ref_same = references(q, k, v, causal=True)
    assert_close_to_ref(out, ref32, ref_same, msg="chunked")
    diff = (out.float() - one_shot.float()).norm() / one_shot.float().norm()
    assert diff <= agreement_tolerance(dtype), f"chunked vs one-shot prefill rel err {diff:.2e}"
    if table is None:
        assert torch.equal(k_cache[:, :total], k) and torch.equal(v_cache[:, :total], v)
    else:
        dense_k = k_cache[table.long()].reshape(1, -1, nheads_k, HEAD_DIM)[:, :total]
        assert torch.equal(dense_k, k)


def test_dispatch_needs_enough_tokens_and_a_full_grid(monkeypatch):
    """num_splits=0 takes the prefill path only with >= CHUNKED_PREFILL_MIN_SEQLEN_Q new tokens AND a prefill
    grid filling CHUNKED_PREFILL_MIN_WAVE of the SMs; otherwise (and with num_splits >= 1) the decode kernel."""
    calls = record_chunked_prefill(monkeypatch)
    dtype, head_dim = torch.float16, HEAD_DIM
    target = device_target(torch.device(DEVICE))
    sm_count = tables.planning_sm_count(target)
    block_m = tables.prefill_fwd_config(head_dim, dtype, True, target).block_m
    threshold = tables.CHUNKED_PREFILL_MIN_SEQLEN_Q
    # one query block per head: the grid is batch x nheads programs
    small_heads = 1
    full_heads = math.ceil(tables.CHUNKED_PREFILL_MIN_WAVE * sm_count)
    assert small_heads < tables.CHUNKED_PREFILL_MIN_WAVE * sm_count <= full_heads
    seqlen_q = min(block_m, max(threshold, 16))
    for nheads, seqlen, num_splits, expect_prefill in [
        (full_heads, seqlen_q, 0, True),
        (full_heads, seqlen_q, 1, False),  # an explicit split count keeps the decode kernel
        (small_heads, seqlen_q, 0, False),  # the grid would leave SMs idle
        (full_heads, threshold - 1, 0, False),  # too few new tokens
    ]:
        calls.clear()
        q = randn(1, seqlen, nheads, head_dim, dtype=dtype)
        k_cache = randn(1, seqlen + 32, 1, head_dim, dtype=dtype)
        v_cache = randn(1, seqlen + 32, 1, head_dim, dtype=dtype)
        out = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=32, causal=True, num_splits=num_splits)
        assert torch.isfinite(out).all()
        assert bool(calls) == expect_prefill, (nheads, seqlen, num_splits, calls)
