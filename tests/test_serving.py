"""Chunked prefill against a cache, and the continuous-batching engine (kernels/tritonattn/serving.py).

Chunked prefill: a prompt prefilled in uneven chunks through flash_attn_with_kvcache (seqlen_q =
chunk: append the chunk, attend bottom-right causal over the cache plus the chunk), into a dense
cache buffer and into a PagedKVCache, must equal one-shot causal prefill (flash_attn_func, within
tritonattn.testing.agreement_tolerance) and the fp32 reference. Rows of the caches that are not the
request's hold NaN, so reading one fails.

The engine: outputs of a mixed workload (prompts prefilled in chunks while others decode) equal the
reference, checked here independently of the engine's own checks (all of a request's outputs
together are one-shot causal attention over its token stream); pages return to the pool; admission
waits for pages and no live page is ever overwritten; impossible requests raise. Tiny shapes under
the interpreter, bf16 added on a GPU.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.serving import Request, ServingEngine, VerificationError, make_workload
from helpers import DEVICE, ON_GPU, assert_close_to_ref, make_qkv, references
from tritonattn import PagedKVCache, attention_ref, flash_attn_func, flash_attn_with_kvcache, rel_err
from tritonattn.testing import FP8_KV_RTOL, agreement_tolerance

DTYPES = [torch.float16, torch.float32] + ([torch.bfloat16] if ON_GPU else [])
NHEADS, NHEADS_K, HEAD_DIM = (32, 8, 128) if ON_GPU else (4, 2, 32)
# Uneven chunks: lengths 1, below and above the interpreter's BLOCK_N of 32 and the page size 16; on a
# GPU also chunks in the hundreds and thousands (prefill-class seqlen_q).
CHUNKS = (5, 17, 1, 33, 512, 1000, 300) if ON_GPU else (5, 17, 1, 33)
PAGE_SIZE = 16


def engine(**overrides) -> ServingEngine:
    """A small engine: 4 q heads over 2 KV heads, head dim 32, pages of 16 tokens, every output checked."""
    kwargs = dict(nheads=4, nheads_k=2, head_dim=32, page_size=16, num_blocks=14, max_batch=4, max_seqlen=96,
                  chunk_size=24, token_budget=32, dtype=torch.float16, device=DEVICE, verify="all", strict=True)
    kwargs.update(overrides)
    return ServingEngine(**kwargs)


def assert_outputs_match_streams(eng: ServingEngine) -> None:
    """Every request's outputs, all chunks and decode steps together, equal one-shot causal attention
    over its whole token stream (token t sees tokens 0..t) by the tests' error rule."""
    assert sorted(eng.outputs) == list(range(len(eng.requests))), "every request must finish with its outputs"
    for rid, out in eng.outputs.items():
        q, k, v = eng.token_stream(rid)
        ref32, _, same = references(q[None], k[None], v[None], causal=True)
        print(f"request {rid} ({eng.requests[rid]}): rel err {rel_err(out[None], ref32):.2e}")
        assert_close_to_ref(out[None], ref32, same, msg=f"request {rid}")


# --------------------------------------------------------------------------------------------
# Chunked prefill against a cache (the two tests)
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_chunked_prefill_dense_cache_equals_one_shot(dtype):
    """A prompt prefilled in uneven chunks into a dense cache equals one-shot causal prefill."""
    total = sum(CHUNKS)
    q, k, v = make_qkv(2, total, total, NHEADS, NHEADS_K, HEAD_DIM, dtype, seed=1)
    one_shot = flash_attn_func(q, k, v, causal=True)
    ref32, _, same = references(q, k, v, causal=True)
    k_cache = torch.full((2, total + 9, NHEADS_K, HEAD_DIM), float("nan"), dtype=dtype, device=DEVICE)
    v_cache = k_cache.clone()
    outs, start = [], 0
    for n in CHUNKS:
        end = start + n
        lengths = torch.full((2,), start, dtype=torch.int32, device=DEVICE)  # per-request lengths, as a tensor
        outs.append(flash_attn_with_kvcache(q[:, start:end], k_cache, v_cache, k[:, start:end], v[:, start:end],
                                           cache_seqlens=lengths, causal=True))
        start = end
    chunked = torch.cat(outs, dim=1)
    diff = rel_err(chunked, one_shot)
    print(f"chunks {CHUNKS}: chunked vs one-shot rel diff {diff:.2e}, vs fp32 ref {rel_err(chunked, ref32):.2e}")
    assert_close_to_ref(chunked, ref32, same, msg="chunked prefill, dense cache")
    assert diff <= agreement_tolerance(dtype), f"chunked vs one-shot rel diff {diff:.2e}"
    assert torch.equal(k_cache[:, :total], k) and torch.equal(v_cache[:, :total], v), "the cache must hold the prompt"
    assert torch.isnan(k_cache[:, total:]).all(), "rows past the prompt were written"


@pytest.mark.parametrize("dtype", DTYPES)
def test_chunked_prefill_paged_cache_equals_one_shot(dtype):
    """A prompt prefilled in uneven chunks into a PagedKVCache (pages interleaved with another
    request's) equals one-shot causal prefill, and its pages hold exactly the prompt."""
    total = sum(CHUNKS)
    q, k, v = make_qkv(1, total, total, NHEADS, NHEADS_K, HEAD_DIM, dtype, seed=2)
    one_shot = flash_attn_func(q, k, v, causal=True)
    ref32, _, same = references(q, k, v, causal=True)
    pages = -(-total // PAGE_SIZE)
    cache = PagedKVCache(2 * pages + 2, PAGE_SIZE, NHEADS_K, HEAD_DIM, max_batch=2, max_blocks_per_seq=pages,
                         dtype=dtype, device=DEVICE)
    cache.k_cache.fill_(float("nan"))
    cache.v_cache.fill_(float("nan"))
    other, slot = cache.add_request(), cache.add_request()
    outs, start = [], 0
    for n in CHUNKS:
        cache.extend(other, cache.capacity(other) + 1)  # the other request takes a page: the prompt's pages interleave
        outs.append(cache.decode(q[:, start : start + n], k[:, start : start + n], v[:, start : start + n],
                                 slots=[slot]))
        start += n
    chunked = torch.cat(outs, dim=1)
    diff = rel_err(chunked, one_shot)
    print(f"chunks {CHUNKS}, pages {cache.pages(slot)}: chunked vs one-shot rel diff {diff:.2e}")
    held = cache.pages(slot)
    assert held != list(range(held[0], held[0] + len(held))), f"the prompt's pages should interleave: {held}"
    assert_close_to_ref(chunked, ref32, same, msg="chunked prefill, paged cache")
    assert diff <= agreement_tolerance(dtype), f"chunked vs one-shot rel diff {diff:.2e}"
    assert cache.seqlens[slot] == total
    held = torch.tensor(held, device=DEVICE)
    assert torch.equal(cache.k_cache[held].flatten(0, 1)[:total], k[0]), "the pages must hold the prompt's keys"
    assert torch.equal(cache.v_cache[held].flatten(0, 1)[:total], v[0])


# --------------------------------------------------------------------------------------------
# The engine
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float16] + ([torch.bfloat16] if ON_GPU else []))
def test_engine_mixed_workload_matches_reference(dtype):
    """Requests prefilled in chunks while others decode: every output equals the reference, checked
    by the engine per step and here over each request's whole stream."""
    workload = [Request(70, 3, 0), Request(9, 6, 0), Request(40, 4, 1), Request(1, 5, 2), Request(30, 0, 2)]
    eng = engine(dtype=dtype, keep_outputs=True)
    eng.submit(workload)
    eng.run()
    stats, checks = eng.stats_frame(), eng.checks_frame()
    print(stats.to_string())
    assert ((stats.prefill_tokens > 0) & (stats.decode_tokens > 0)).any(), "prefill chunks must share steps with decode"
    assert (stats.prefill_chunks > 1).any() and stats.running.max() >= 3
    assert (stats.tokens <= eng.token_budget).all() and (stats.prefill_tokens <= 2 * eng.chunk_size).all()
    assert checks.ok.all() and (checks.end - checks.start).sum() == sum(r.total_len for r in workload), (
        "every token's output must have been checked exactly once")
    assert (checks[checks.kind == "prefill"].end - checks[checks.kind == "prefill"].start).max() == eng.chunk_size
    assert_outputs_match_streams(eng)


@pytest.mark.parametrize("dtype", [torch.float16] + ([torch.bfloat16] if ON_GPU else []))
def test_fp8_pool_engine_matches_the_stored_reference(dtype):
    """An FP8 pool (cache_dtype=e4m3): each request's scales come from its prompt at admission, every output
    matches the reference over K/V as the pool stores them (checked by the engine, every one), the pool
    holds half the bytes per token, and the outputs stay within the FP8 quantization error of the
    unquantized streams."""
    workload = [Request(70, 3, 0), Request(9, 6, 0), Request(40, 4, 1), Request(1, 5, 2)]
    eng = engine(dtype=dtype, cache_dtype=torch.float8_e4m3fn, keep_outputs=True)
    assert eng.bytes_per_token == engine(dtype=dtype).bytes_per_token // 2
    eng.submit(workload)
    eng.run()
    checks = eng.checks_frame()
    assert checks.ok.all() and (checks.end - checks.start).sum() == sum(r.total_len for r in workload)
    for rid, out in eng.outputs.items():
        q, k, v = eng.token_stream(rid)
        ref32, _, _ = references(q[None], k[None], v[None], causal=True)
        assert rel_err(out[None], ref32) <= FP8_KV_RTOL, rid
    assert eng.cache.num_free_blocks == eng.cache.num_blocks


def test_sliding_window_engine_matches_reference_in_fewer_pages():
    """A sliding-window layer (Mistral-style, window W): every output equals the windowed reference (per
    step and over each stream), the pool returns the pages before each request's window as it advances,
    so requests far longer than the window run in a pool that could not hold them whole, and every page
    comes back at the end."""
    window = 20
    workload = [Request(70, 12, 0), Request(9, 30, 0), Request(44, 9, 1), Request(3, 50, 2)]
    eng = engine(sliding_window=window, num_blocks=12, max_seqlen=96, keep_outputs=True)
    assert eng.peak_pages(workload[0]) == (window + eng.chunk_size - 1) // 16 + 2 < eng.pages_for(82)
    eng.submit(workload)
    eng.run()
    stats, checks = eng.stats_frame(), eng.checks_frame()
    assert checks.ok.all() and (checks.end - checks.start).sum() == sum(r.total_len for r in workload)
    peaks = sum(eng.peak_pages(r) for r in workload)
    assert stats.pages_in_use.max() <= min(peaks, eng.cache.num_blocks)
    assert sum(eng.pages_for(r.total_len) for r in workload) > eng.cache.num_blocks  # whole, they would not fit
    assert stats.running.max() >= 3
    assert eng.cache.num_free_blocks == eng.cache.num_blocks and bool((eng.cache.block_table == -1).all())
    for rid, out in eng.outputs.items():
        q, k, v = eng.token_stream(rid)
        ref32, _ = attention_ref(q[None].float(), k[None].float(), v[None].float(), causal=True,
                                 window_size=(window, 0))
        same, _ = attention_ref(q[None], k[None], v[None], causal=True, window_size=(window, 0), upcast=False)
        assert_close_to_ref(out[None], ref32, same, msg=f"request {rid}")


def test_engine_checks_can_fail():
    """A corrupted live page makes the engine's next check raise VerificationError."""
    eng = engine()
    eng.submit([Request(40, 6, 0)])
    for _ in range(3):
        eng.step()
    (rid, slot), = eng.slots.items()
    first_page = eng.cache.pages(slot)[0]
    eng.cache.v_cache[first_page] += 1.0  # what another request writing into this page would do
    with pytest.raises(VerificationError, match="rel err"):
        eng.step()


def test_engine_returns_every_page():
    """After every request has finished, every page and slot is back in the pool (checking a sample of
    outputs, the GPU default: each request's first and last prefill chunk)."""
    eng = engine(verify="sample")
    workload = make_workload(5, (5, 60), (0, 5), 4, seed=3)
    eng.submit(workload)
    eng.run()
    checks = eng.checks_frame()
    prefill = checks[checks.kind == "prefill"]
    assert checks.ok.all() and len(checks) < len(eng.stats) + sum(r.total_len for r in workload)
    for rid, r in enumerate(workload):
        ends = set(prefill[prefill.rid == rid].end)
        assert 0 in set(prefill[prefill.rid == rid].start) and r.prompt_len in ends, f"request {rid} unchecked"
    cache = eng.cache
    assert eng.done and cache.num_free_blocks == cache.num_blocks, f"{cache.num_free_blocks} of {cache.num_blocks}"
    assert cache.active_slots == [] and cache.seqlens == [0] * cache.max_batch
    assert bool((cache.block_table == -1).all())
    assert sorted(eng.request_log) == list(range(5))
    assert eng.stats[-1]["pages_promised"] == 0 and max(r["pages_in_use"] for r in eng.stats) > 0


def test_admission_waits_for_pages_and_never_overwrites_live_pages():
    """With a small pool and free slots, requests queue for pages; at every step the running requests'
    pages are disjoint, hold exactly their own tokens, and (with the promised pages) fit the pool."""
    eng = engine(num_blocks=8, max_batch=6, token_budget=40, chunk_size=16, keep_outputs=True)
    # 3 + 2 + 3 + 2 + 1 pages: the first two fit (5 of 8), the third must wait for the first to finish.
    eng.submit([Request(40, 4, 0), Request(20, 6, 0), Request(45, 2, 1), Request(30, 1, 1), Request(10, 3, 1)])
    while (row := eng.step()) is not None:
        held = {rid: eng.cache.pages(slot) for rid, slot in eng.slots.items()}
        flat = [p for pages in held.values() for p in pages]
        assert len(flat) == len(set(flat)), f"step {row['step']}: a page belongs to two requests: {held}"
        assert len(flat) + eng.pages_promised() <= eng.cache.num_blocks
        assert len(flat) == eng.cache.num_blocks - eng.cache.num_free_blocks
        for rid, slot in eng.slots.items():
            length = eng.cache.seqlens[slot]
            _, k, v = eng.token_stream(rid)
            pages = torch.tensor(held[rid], dtype=torch.long, device=DEVICE)
            assert torch.equal(eng.cache.k_cache[pages].flatten(0, 1)[:length], k[:length]), (
                f"step {row['step']}: request {rid}'s cached keys differ from its own")
            assert torch.equal(eng.cache.v_cache[pages].flatten(0, 1)[:length], v[:length])
    log = eng.requests_frame()
    stats = eng.stats_frame()
    print(log.to_string())
    print(stats.to_string())
    assert log.queued_steps.max() > 0, "some request must have waited for pages"
    assert (stats.running < eng.cache.max_batch).all(), "the waits were for pages, not for slots"
    assert (stats[stats.waiting > 0].pages_in_use + stats[stats.waiting > 0].pages_promised > 4).all()
    assert_outputs_match_streams(eng)


@pytest.mark.parametrize("request_, match", [
    (Request(90, 10, 0), "max_seqlen"),  # 100 tokens > max_seqlen 96
    (Request(0, 3, 0), "prompt_len"),
    (Request(10, -1, 0), "max_new_tokens"),
    (Request(10, 1, -2), "arrival_step"),
    ((10, 1, 0), "Request"),
])
def test_submit_rejects_impossible_requests(request_, match):
    """Requests that can never run raise before anything is queued."""
    eng = engine()
    with pytest.raises((ValueError, TypeError), match=match):
        eng.submit([Request(5, 1, 0), request_])
    assert eng.requests == [] and eng.done


def test_request_larger_than_the_pool_and_bad_configs_raise():
    """A request needing more pages than the whole pool, and inconsistent configurations, raise ValueError."""
    eng = engine(num_blocks=4)  # 64 tokens of pool, max_seqlen 96
    with pytest.raises(ValueError, match="could never be admitted"):
        eng.submit(Request(60, 10, 0))
    eng.submit(Request(60, 4, 0))  # exactly the 4 pages: fine
    with pytest.raises(ValueError, match="token_budget"):
        engine(token_budget=3, max_batch=4)
    with pytest.raises(ValueError, match="divisible"):
        engine(nheads=6, nheads_k=4)
    with pytest.raises(ValueError, match="verify"):
        engine(verify="some")
    with pytest.raises(ValueError, match="chunk_size"):
        engine(chunk_size=0)
