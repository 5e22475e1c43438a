"""The attention variants in flash_attn_with_kvcache: sliding window, softcap, ALiBi and sinks in decode
(dense and paged caches, split and unsplit, with and without an append, one or several query tokens)
and in its chunked-prefill path, against the float32 reference per request (kernels/tritonattn/testing/reference.py),
each request aligned bottom-right against its own length. Ragged batches hold lengths 0, 1, the
window's +- 1 and a full cache; a window's keys before the band are never read (poisoned with NaN,
the output is unchanged); the splits tile the band, not the cache.
"""

from __future__ import annotations

import pytest
import torch

import tritonattn.config.hardware as hardware
import tritonattn.launch.decode as decode
from helpers import (
    DEVICE,
    INTERPRET,
    ON_GPU,
    assert_close_to_ref,
    assert_lse_close,
    assert_splits_agree,
    needs_graph_capture,
    paged_copy,
)
from tritonattn import attention_ref, flash_attn_with_kvcache
from tritonattn.config.tables import INTERPRETER_DECODE_CONFIG

DTYPE = torch.float16
BATCH, NHEADS, NHEADS_K, HEAD_DIM = 6, 4, 2, 32
CAPACITY = 192  # 6 key blocks of the interpreter's 32 (GPU: 3 of 64); 3 pages of 64, 12 of 16
WINDOW = 37  # not a multiple of any key block


def randn(*shape, dtype=DTYPE):
    return torch.randn(*shape, dtype=torch.float32, device=DEVICE).to(dtype)


def make_variant(name: str):
    """flash_attn_with_kvcache keywords of one named variant (fresh random slopes and sinks)."""
    slopes = torch.rand(NHEADS, device=DEVICE) * 0.3 + 0.05
    sinks = torch.randn(NHEADS, device=DEVICE) * 2
    return {
        "window_causal": dict(causal=True, window_size=(WINDOW, 0)),
        "window_left": dict(window_size=(WINDOW, -1)),
        "window_both": dict(window_size=(WINDOW, 2)),
        "softcap": dict(softcap=2.0),
        "alibi": dict(alibi_slopes=slopes),
        "alibi_batch_causal": dict(causal=True, alibi_slopes=torch.rand(BATCH, NHEADS, device=DEVICE) * 0.3),
        "sinks": dict(sinks=sinks),
        "all": dict(causal=True, window_size=(WINDOW, 0), softcap=5.0, alibi_slopes=slopes, sinks=sinks),
    }[name]


VARIANTS = ["window_causal", "window_left", "window_both", "softcap", "alibi", "alibi_batch_causal", "sinks", "all"]
# (seqlen_q, seqlen_new, num_splits, one_loop): one token with and without an append, a partial and a full
# append of several tokens; split and unsplit; the masked-only loop and the edge / whole / tail stages
LAYOUTS = [(1, 1, 1, False), (1, 0, 3, True), (1, 1, 3, False), (4, 2, 1, True), (4, 4, 3, False)]


def lengths_for(seqlen_new: int) -> list:
    """Cache lengths: empty, one key, the window's -1 / 0 / +1, and full (room left for the append)."""
    return [0, 1, WINDOW - 1, WINDOW, WINDOW + 1, CAPACITY - seqlen_new]


def inputs(seqlen_q: int, seqlen_new: int):
    """q, dense caches (random everywhere, also past the lengths), and new k/v (None without an append)."""
    q = randn(BATCH, seqlen_q, NHEADS, HEAD_DIM)
    k_cache, v_cache = randn(BATCH, CAPACITY, NHEADS_K, HEAD_DIM), randn(BATCH, CAPACITY, NHEADS_K, HEAD_DIM)
    if not seqlen_new:
        return q, k_cache, v_cache, None, None
    k, v = randn(BATCH, seqlen_new, NHEADS_K, HEAD_DIM), randn(BATCH, seqlen_new, NHEADS_K, HEAD_DIM)
    return q, k_cache, v_cache, k, v


def reference(q, k_cache, v_cache, k, v, lengths, kw):
    """(out fp32, lse, out in q's dtype) per request over its cached keys plus its new ones; a request
    that sees no key gives zeros and the sink's logit (+inf without sinks)."""
    outs32, lses, outs_same = [], [], []
    for b, length in enumerate(lengths):
        kk, vv = k_cache[b : b + 1, :length], v_cache[b : b + 1, :length]
        if k is not None:
            kk, vv = torch.cat([kk, k[b : b + 1]], 1), torch.cat([vv, v[b : b + 1]], 1)
        ref_kw = dict(causal=kw.get("causal", False), window_size=kw.get("window_size", (-1, -1)),
                      softcap=kw.get("softcap", 0.0), sinks=kw.get("sinks"))
        slopes = kw.get("alibi_slopes")
        if slopes is not None:
            ref_kw["alibi_slopes"] = slopes[b : b + 1] if slopes.dim() == 2 else slopes
        if kk.shape[1] == 0:  # no key: the softmax over the sink alone, or nothing
            m = q.shape[1]
            sink = kw.get("sinks")
            lse = (sink[None, :, None].expand(1, NHEADS, m).float().clone() if sink is not None
                   else torch.full((1, NHEADS, m), float("inf"), device=DEVICE))
            zeros = torch.zeros_like(q[b : b + 1], dtype=torch.float32)
            outs32.append(zeros), lses.append(lse), outs_same.append(zeros.to(q.dtype))
            continue
        out32, lse = attention_ref(q[b : b + 1].float(), kk.float(), vv.float(), **ref_kw)
        same_kw = dict(ref_kw, sinks=ref_kw["sinks"].to(q.dtype) if ref_kw["sinks"] is not None else None)
        out_same, _ = attention_ref(q[b : b + 1], kk, vv, upcast=False, **same_kw)
        outs32.append(out32), lses.append(lse), outs_same.append(out_same)
    return torch.cat(outs32), torch.cat(lses), torch.cat(outs_same)


def run(q, k_cache, v_cache, k, v, lengths, kw, page_size, num_splits, one_loop, monkeypatch):
    """flash_attn_with_kvcache over the dense caches, or paged copies of them; (out, lse, k_cache, v_cache)
    with the caches as dense tensors again. one_loop forces the kernel's loop layout either way."""
    monkeypatch.setattr(decode, "one_loop", lambda *args: one_loop)
    lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    if page_size:
        k_pool, v_pool, table = paged_copy(k_cache, v_cache, page_size)
        out, lse = flash_attn_with_kvcache(q, k_pool, v_pool, k, v, cache_seqlens=lens, block_table=table,
                                           num_splits=num_splits, return_softmax_lse=True, **kw)
        dense = [pool[table.long()].reshape(k_cache.shape) for pool in (k_pool, v_pool)]
        return out, lse, dense[0], dense[1]
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens, num_splits=num_splits,
                                       return_softmax_lse=True, **kw)
    return out, lse, k_cache, v_cache


@pytest.mark.parametrize("page_size", [0, 16, 64], ids=lambda p: f"page{p}" if p else "dense")
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda t: "q{}-new{}-splits{}-{}".format(*t[:3], "1loop" * t[3]))
@pytest.mark.parametrize("variant", VARIANTS)
def test_kvcache_variant_equals_reference(variant, layout, page_size, monkeypatch):
    seqlen_q, seqlen_new, num_splits, one_loop = layout
    lengths = lengths_for(seqlen_new)
    q, k_cache, v_cache, k, v = inputs(seqlen_q, seqlen_new)
    kw = make_variant(variant)
    out, lse, k_after, v_after = run(q, k_cache, v_cache, k, v, lengths, kw, page_size, num_splits, one_loop,
                                     monkeypatch)
    ref32, ref_lse, ref_same = reference(q, k_cache, v_cache, k, v, lengths, kw)
    assert_close_to_ref(out, ref32, ref_same, msg=variant)
    assert_lse_close(lse, ref_lse, DTYPE, msg=variant)
    if k is not None:  # the append went where it should, variants or not
        for b, length in enumerate(lengths):
            assert torch.equal(k_after[b, length : length + seqlen_new], k[b])
            assert torch.equal(v_after[b, length : length + seqlen_new], v[b])


@pytest.mark.parametrize("variant", ["window_causal", "sinks", "all"])
@pytest.mark.parametrize("seqlen_q,seqlen_new", [(1, 1), (1, 0), (3, 2)])
def test_split_and_unsplit_agree(variant, seqlen_q, seqlen_new):
    """The sink is added once however many splits there are; a window's splits cover its band."""
    lengths = lengths_for(seqlen_new)
    q, k_cache, v_cache, k, v = inputs(seqlen_q, seqlen_new)
    kw = make_variant(variant)
    lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    results = {}
    for ns in (1, 2, 5):
        kc, vc = k_cache.clone(), v_cache.clone()
        results[ns] = flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens, num_splits=ns,
                                              return_softmax_lse=True, **kw)
    assert_splits_agree(results, DTYPE)


@pytest.mark.parametrize("seqlen_new", [0, 1])
def test_sink_of_minus_inf_is_no_sink(seqlen_new):
    """A head whose sink is -inf has none: split or not, it equals the call without sinks, and a
    request that sees no key still gives zeros, never NaN (the combine adds the sink to such rows too)."""
    lengths = lengths_for(seqlen_new)
    q, k_cache, v_cache, k, v = inputs(1, seqlen_new)
    lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    sinks = torch.tensor([float("-inf"), 1.0, float("-inf"), -0.5], device=DEVICE)
    none = [0, 2]  # the heads without a sink
    for ns in (1, 3):
        base = flash_attn_with_kvcache(q, k_cache.clone(), v_cache.clone(), k, v, cache_seqlens=lens, num_splits=ns)
        out, lse = flash_attn_with_kvcache(q, k_cache.clone(), v_cache.clone(), k, v, cache_seqlens=lens,
                                           num_splits=ns, sinks=sinks, return_softmax_lse=True)
        assert not torch.isnan(out).any() and not torch.isnan(lse).any(), f"NaN, num_splits={ns}"
        torch.testing.assert_close(out[:, :, none], base[:, :, none], atol=2e-3, rtol=0)
        ref32, _, ref_same = reference(q, k_cache, v_cache, k, v, lengths, dict(sinks=sinks))
        assert_close_to_ref(out, ref32, ref_same, msg=f"num_splits={ns}")


@pytest.mark.parametrize("num_splits", [1, 3])
def test_window_sizes_change_between_calls(num_splits):
    """The window's sizes are runtime arguments, never compiled in (a kernel compiled for a side of 1, or
    of a multiple of 16, would reuse that value): calls alike in all but the window each get their own."""
    lengths = lengths_for(2)
    q, k_cache, v_cache, k, v = inputs(4, 2)
    lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    for window in [(16, 1), (17, 2), (1, 16), (32, 0), (WINDOW, 1)]:
        out = flash_attn_with_kvcache(q, k_cache.clone(), v_cache.clone(), k, v, cache_seqlens=lens,
                                      num_splits=num_splits, window_size=window)
        ref32, _, ref_same = reference(q, k_cache, v_cache, k, v, lengths, dict(window_size=window))
        assert_close_to_ref(out, ref32, ref_same, msg=f"window_size={window}")


# (seqlen_q, num_splits, one_loop, chunked): the decode kernel's loop layouts, split and unsplit, and a
# prompt chunk through the prefill kernel's cache mode
BAND_PATHS = [(2, 1, False, False), (2, 1, True, False), (2, 3, False, False), (2, 3, True, False),
              (24, 0, False, True)]


# pages of 128: a page holds whole key blocks of the prefill kernel (its descriptor path on Hopper)
BAND_CASES = [(path, page) for path in BAND_PATHS for page in (0, 16, 32)] + [(BAND_PATHS[-1], 128)]


@pytest.mark.parametrize("path,page_size", BAND_CASES,
                         ids=["{}-{}".format("chunked" if t[3] else "splits{}{}".format(t[1], "-1loop" * t[2]),
                                             f"page{p}" if p else "dense") for t, p in BAND_CASES])
def test_window_never_reads_before_its_band(path, page_size, monkeypatch):
    """Keys and values before each request's band are never read: NaN there (dense rows; paged, whole
    pages before the band, their table entries -1 as a cache that freed them would hold) leaves the
    output bit-identical, whatever the loop layout and splits, in decode and in a chunk's prefill."""
    seqlen_q, num_splits, one_loop, chunked = path
    monkeypatch.setattr(decode, "one_loop", lambda *args: one_loop)
    monkeypatch.setattr(decode, "chunked_prefill_pays", lambda *args: chunked)
    capacity, window = 256, 40
    lengths = [0, 30, 41, 100, 190, capacity - seqlen_q]
    q = randn(BATCH, seqlen_q, NHEADS, HEAD_DIM)
    k_cache, v_cache = randn(BATCH, capacity, NHEADS_K, HEAD_DIM), randn(BATCH, capacity, NHEADS_K, HEAD_DIM)
    k, v = randn(BATCH, seqlen_q, NHEADS_K, HEAD_DIM), randn(BATCH, seqlen_q, NHEADS_K, HEAD_DIM)
    kw = dict(causal=True, window_size=(window, 0), sinks=torch.randn(NHEADS, device=DEVICE))
    lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    band_lo = [max(length - window, 0) for length in lengths]  # N_b - M - left, N_b = length + seqlen_q

    def call(kc, vc, table):
        return flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens, block_table=table, num_splits=num_splits,
                                       return_softmax_lse=True, **kw)

    if page_size == 0:
        clean = call(k_cache.clone(), v_cache.clone(), None)
        kc, vc = k_cache.clone(), v_cache.clone()
        for b, lo in enumerate(band_lo):
            kc[b, :lo] = float("nan")
            vc[b, :lo] = float("nan")
        poisoned = call(kc, vc, None)
    else:
        k_pool, v_pool, table = paged_copy(k_cache, v_cache, page_size)
        clean = call(k_pool.clone(), v_pool.clone(), table)
        table = table.clone()
        for b, lo in enumerate(band_lo):
            gone = table[b, : lo // page_size]  # pages wholly before the band
            k_pool[gone.long()] = float("nan")
            v_pool[gone.long()] = float("nan")
            table[b, : lo // page_size] = -1
        poisoned = call(k_pool, v_pool, table)
    assert not torch.isnan(poisoned[0]).any()
    assert torch.equal(poisoned[0], clean[0]) and torch.equal(poisoned[1], clean[1])
    ref32, _, ref_same = reference(q, k_cache, v_cache, k, v, lengths, kw)
    assert_close_to_ref(poisoned[0], ref32, ref_same)


def test_window_plans_over_its_band():
    """The splits tile a window's band (at most left + seqlen_q keys past its first key block), not the
    cache: a 4096-key window over a 65536-key cache plans the splits of a 4096-key cache."""
    target = None if INTERPRET or not ON_GPU else hardware.device_target(torch.device("cuda"))
    whole = decode.plan_decode(1, 1, 32, 8, 128, 65536, torch.bfloat16, target, 0)
    windowed = decode.plan_decode(1, 1, 32, 8, 128, 65536, torch.bfloat16, target, 0, 0, False, 4096)
    short = decode.plan_decode(1, 1, 32, 8, 128, 4096 + 1 + windowed.block_n, torch.bfloat16, target, 0)
    assert windowed.num_splits * windowed.split_n >= 4096 + 1 + windowed.block_n - 1
    assert windowed.num_splits * windowed.split_n < whole.num_splits * whole.split_n
    assert (windowed.num_splits, windowed.split_n) == (short.num_splits, short.split_n)
    block_n = INTERPRETER_DECODE_CONFIG.block_n if target is None else windowed.block_n
    assert windowed.split_n % block_n == 0


@pytest.mark.parametrize("variant", ["window_causal", "softcap", "alibi_batch_causal", "sinks", "all"])
@pytest.mark.parametrize("page_size", [0, 32], ids=lambda p: f"page{p}" if p else "dense")
def test_chunked_prefill_takes_the_variants(variant, page_size, monkeypatch):
    """A prompt chunk (the prefill kernels' cache mode, after the append launch) with each variant equals
    the reference over each request's cache plus the chunk."""
    monkeypatch.setattr(decode, "chunked_prefill_pays", lambda *args: True)
    seqlen_q = 24
    lengths = [0, 1, WINDOW, 90, CAPACITY - seqlen_q, 7]
    q = randn(BATCH, seqlen_q, NHEADS, HEAD_DIM)
    k_cache, v_cache = randn(BATCH, CAPACITY, NHEADS_K, HEAD_DIM), randn(BATCH, CAPACITY, NHEADS_K, HEAD_DIM)
    k, v = randn(BATCH, seqlen_q, NHEADS_K, HEAD_DIM), randn(BATCH, seqlen_q, NHEADS_K, HEAD_DIM)
    kw = make_variant(variant)
    out, lse, _, _ = run(q, k_cache, v_cache, k, v, lengths, kw, page_size, 0, False, monkeypatch)
    ref32, ref_lse, ref_same = reference(q, k_cache, v_cache, k, v, lengths, kw)
    assert_close_to_ref(out, ref32, ref_same, msg=variant)
    assert_lse_close(lse, ref_lse, DTYPE, msg=variant)


def test_bad_variant_arguments_raise_before_launch():
    q = randn(1, 1, NHEADS, HEAD_DIM)
    cache = randn(1, 16, NHEADS_K, HEAD_DIM)
    with pytest.raises(ValueError, match="alibi_slopes"):
        flash_attn_with_kvcache(q, cache, cache, cache_seqlens=8, alibi_slopes=torch.ones(3, device=DEVICE))
    with pytest.raises(ValueError, match="sinks"):
        flash_attn_with_kvcache(q, cache, cache, cache_seqlens=8, sinks=torch.ones(NHEADS + 1, device=DEVICE))
    with pytest.raises(ValueError, match="window_size"):
        flash_attn_with_kvcache(q, cache, cache, cache_seqlens=8, window_size=(1, 2, 3))
    with pytest.raises(ValueError, match="softcap"):
        flash_attn_with_kvcache(q, cache, cache, cache_seqlens=8, softcap=float("nan"))


def full_sequence_reference(q, k, v, kw, b):
    """Request b's fp32 reference and same-dtype result over a whole sequence (prompt + decoded tokens)."""
    ref_kw = dict(causal=True, window_size=kw.get("window_size", (-1, -1)), softcap=kw.get("softcap", 0.0),
                  sinks=kw.get("sinks"), alibi_slopes=kw.get("alibi_slopes"))
    out32, _ = attention_ref(q[b : b + 1].float(), k[b : b + 1].float(), v[b : b + 1].float(), **ref_kw)
    same_kw = dict(ref_kw, sinks=ref_kw["sinks"].to(q.dtype) if ref_kw["sinks"] is not None else None)
    out_same, _ = attention_ref(q[b : b + 1], k[b : b + 1], v[b : b + 1], upcast=False, **same_kw)
    return out32, out_same


@pytest.mark.parametrize("variant", ["window_causal", "all"])
def test_kv_cache_helpers_take_the_variants(variant):
    """KVCache and PagedKVCache prefill a prompt and decode token by token with a variant; every step's
    output equals the reference over the whole sequence so far."""
    from tritonattn import KVCache, PagedKVCache

    kw = {key: value for key, value in make_variant(variant).items() if key != "causal"}
    batch, prompt, steps = 2, 21, 30
    total = prompt + steps
    q, k, v = (randn(batch, total, heads, HEAD_DIM) for heads in (NHEADS, NHEADS_K, NHEADS_K))
    dense = KVCache(batch, 64, NHEADS_K, HEAD_DIM, dtype=DTYPE, device=DEVICE)
    paged = PagedKVCache(32, 8, NHEADS_K, HEAD_DIM, max_batch=batch, max_blocks_per_seq=8, dtype=DTYPE, device=DEVICE)
    slots = [paged.add_request() for _ in range(batch)]
    outs = {}
    for name, cache in (("dense", dense), ("paged", paged)):
        extra = {} if name == "dense" else dict(slots=slots)
        first = cache.prefill(q[:, :prompt], k[:, :prompt], v[:, :prompt], **kw, **extra)
        rest = [cache.decode(q[:, t : t + 1], k[:, t : t + 1], v[:, t : t + 1], **kw, **extra)
                for t in range(prompt, total)]
        outs[name] = torch.cat([first] + rest, 1)
    for b in range(batch):
        ref32, ref_same = full_sequence_reference(q, k, v, kw, b)
        for name, out in outs.items():
            assert_close_to_ref(out[b : b + 1], ref32, ref_same, msg=f"{name} request {b}")


def test_paged_cache_returns_the_pages_before_its_window():
    """PagedKVCache(sliding_window=W) keeps only the pages that hold a key a later query can see:
    the rest go back to the pool (poisoned with NaN there, the next steps never read them) and the
    outputs still equal the whole sequence's windowed reference; a call asking for a wider window
    raises before anything changes."""
    from tritonattn import PagedKVCache

    window, page, prompt, steps, batch = 20, 8, 13, 40, 2
    total = prompt + steps
    q, k, v = (randn(batch, total, heads, HEAD_DIM) for heads in (NHEADS, NHEADS_K, NHEADS_K))
    cache = PagedKVCache(2 * 8, page, NHEADS_K, HEAD_DIM, max_batch=batch, max_blocks_per_seq=8, dtype=DTYPE,
                         device=DEVICE, sliding_window=window)
    slots = [cache.add_request() for _ in range(batch)]
    outs = [cache.prefill(q[:, :prompt], k[:, :prompt], v[:, :prompt], slots=slots)]
    held = []
    for t in range(prompt, total):
        free = torch.tensor(cache._free, dtype=torch.long, device=DEVICE)
        cache.k_cache[free] = float("nan")  # whatever the pool holds where no request lives
        cache.v_cache[free] = float("nan")
        outs.append(cache.decode(q[:, t : t + 1], k[:, t : t + 1], v[:, t : t + 1], slots=slots))
        held.append(len(cache.pages(slots[0])))
        first_kept = max(t + 1 - window, 0) // page
        assert (cache.block_table[slots[0], :first_kept] == -1).all()
    assert max(held) <= -(-(window + page) // page) + 1  # about (W + P) / P pages, however long it grows
    assert cache.num_free_blocks + sum(len(cache.pages(s)) for s in slots) == cache.num_blocks
    out = torch.cat(outs, 1)
    assert not torch.isnan(out).any()
    for b in range(batch):
        ref32, ref_same = full_sequence_reference(q, k, v, dict(window_size=(window, 0)), b)
        assert_close_to_ref(out[b : b + 1], ref32, ref_same, msg=f"request {b}")
    lengths = cache.seqlens
    with pytest.raises(ValueError, match="sliding_window"):
        cache.decode(q[:, :1], k[:, :1], v[:, :1], slots=slots, window_size=(-1, -1))
    with pytest.raises(ValueError, match="sliding_window"):
        cache.decode(q[:, :1], k[:, :1], v[:, :1], slots=slots, window_size=(window + 1, 0))
    assert cache.seqlens == lengths


# --------------------------------------------------------------------------------------------
# GPU only
# --------------------------------------------------------------------------------------------
@pytest.mark.gpu
@needs_graph_capture
@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("page_size", [0, 16], ids=lambda p: f"page{p}" if p else "dense")
def test_cuda_graph_replay_with_a_window(page_size, num_splits):
    """A decode step with a window (and softcap, ALiBi, sinks) captured once in a CUDA graph, lengths
    advanced in the graph, replays step by step like eager calls while the band slides past the window's
    length; the last step equals the reference."""
    dtype, batch, capacity, steps = torch.bfloat16, 4, 512, 12
    kw = dict(causal=True, window_size=(WINDOW, 0), softcap=5.0,
              alibi_slopes=torch.rand(NHEADS, device=DEVICE) * 0.3, sinks=torch.randn(NHEADS, device=DEVICE))
    start = torch.tensor([0, WINDOW - 5, 200, capacity - steps - 1], dtype=torch.int32, device=DEVICE)
    q_s, k_s, v_s = (randn(batch, 1, heads, HEAD_DIM, dtype=dtype) for heads in (NHEADS, NHEADS_K, NHEADS_K))
    k_dense, v_dense = randn(batch, capacity, NHEADS_K, HEAD_DIM, dtype=dtype), randn(batch, capacity, NHEADS_K,
                                                                                     HEAD_DIM, dtype=dtype)
    if page_size:
        k_cache, v_cache, table = paged_copy(k_dense, v_dense, page_size)
    else:
        k_cache, v_cache, table = k_dense.clone(), v_dense.clone(), None
    k_eager, v_eager, lens_eager, lens = k_cache.clone(), v_cache.clone(), start.clone(), start.clone()

    def step(q, k, v, kc, vc, lengths):
        return flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=lengths, block_table=table,
                                       num_splits=num_splits, **kw)

    stream = torch.cuda.Stream()  # warm up (compiles) on a side stream, then capture
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step(q_s, k_s, v_s, k_cache.clone(), v_cache.clone(), lens.clone())
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_s = step(q_s, k_s, v_s, k_cache, v_cache, lens)
        lens.add_(1)
    lens.copy_(start)

    for i in range(steps):
        q, k, v = (randn(*t.shape, dtype=dtype) for t in (q_s, k_s, v_s))
        q_s.copy_(q), k_s.copy_(k), v_s.copy_(v)
        graph.replay()
        out_eager = step(q, k, v, k_eager, v_eager, lens_eager)
        lens_eager += 1
        torch.cuda.synchronize()
        assert torch.equal(out_s, out_eager), f"step {i}: graph and eager outputs differ"
        assert torch.equal(lens, lens_eager)
    assert torch.equal(k_cache, k_eager) and torch.equal(v_cache, v_eager)
    if page_size:
        k_after, v_after = (pool[table.long()].reshape(k_dense.shape) for pool in (k_cache, v_cache))
    else:
        k_after, v_after = k_cache, v_cache
    before = (lens_eager - 1).tolist()  # the last step's cached keys, its new key appended at that row
    rows = torch.arange(batch, device=DEVICE), (lens_eager - 1).long()
    ref32, _, ref_same = reference(q, k_after, v_after, k_after[rows][:, None], v_after[rows][:, None], before, kw)
    assert_close_to_ref(out_eager, ref32, ref_same)
