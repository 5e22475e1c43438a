"""cache_leftpad in flash_attn_with_kvcache (kernels/tritonattn/jit/decode.py [Note] Left padding): request b's
keys are cache rows [cache_leftpad[b], cache_seqlens[b]), the rows before are padding.

Checked against tritonattn.testing.attention_ref with key_leftpad (fp32 ground truth, the error relative to
PyTorch's own fp16 error): dense caches with and without an append, seqlen_q 1 and 4, causal or not, GQA,
unsplit and split, cache_batch_idx, the chunked-prefill path (prefill's fwd_kernel in its cache mode); a
request padded up to its length gives zeros and LSE +inf; zero padding equals no padding bit for bit; the
append still writes at cache_seqlens[b]; rotary positions count the padding; device values are clamped;
bad inputs raise before any launch.
"""

from __future__ import annotations

import pytest
import torch

import tritonattn.api.kvcache as kvcache
import tritonattn.config.tables as tables
import tritonattn.launch.decode as decode
from helpers import (
    DEVICE,
    INTERPRET,
    ON_GPU,
    assert_close_to_ref,
    assert_lse_close,
    per_request_references,
    record_chunked_prefill,
)
from tritonattn import flash_attn_with_kvcache, rel_err
from tritonattn.errors import InputError, InputTypeError
from tritonattn.testing import agreement_tolerance, rotary_ref

DTYPE = torch.float16
HEAD_DIM = 128 if ON_GPU else 32
NHEADS, NHEADS_K = 4, 2  # GQA
CAPACITY = 96  # three key blocks of 32 under the interpreter: num_splits=3 gives three splits
# before the call: cache lengths (the end row, padding included) and where each request's keys start;
# request 3 is padded up to its length (it sees only its new keys, or none)
LENGTHS = [9, 50, 88, 40]
LEFTPAD = [0, 3, 37, 40]


def randn(*shape, dtype=DTYPE):
    return torch.randn(*shape, device=DEVICE, dtype=torch.float32).to(dtype)


def inputs(seqlen_q, append, batch=4, cache_batch=None, capacity=CAPACITY):
    """q, k_cache, v_cache (random everywhere, the padding included), k, v (or None)."""
    q = randn(batch, seqlen_q, NHEADS, HEAD_DIM)
    rows = cache_batch or batch
    k_cache, v_cache = randn(rows, capacity, NHEADS_K, HEAD_DIM), randn(rows, capacity, NHEADS_K, HEAD_DIM)
    k = randn(batch, seqlen_q, NHEADS_K, HEAD_DIM) if append else None
    v = randn(batch, seqlen_q, NHEADS_K, HEAD_DIM) if append else None
    return q, k_cache, v_cache, k, v


def int32(values, device=DEVICE):
    return torch.tensor(values, dtype=torch.int32, device=device)


def check_call(q, k_cache, v_cache, k, v, lengths, leftpad, causal, num_splits, cache_batch_idx=None):
    """Run flash_attn_with_kvcache with cache_leftpad and check it against the reference, the cache
    rows the append must write (at cache_seqlens[b], not shifted) and every other row (untouched)."""
    rows = list(range(q.shape[0])) if cache_batch_idx is None else cache_batch_idx
    k_sub, v_sub = k_cache[rows].clone(), v_cache[rows].clone()  # the requests' caches before the call
    ref32, ref_lse, ref_same = per_request_references(q, k_sub, v_sub, k, v, lengths, causal=causal, leftpad=leftpad)
    k_exp, v_exp = k_cache.clone(), v_cache.clone()
    if k is not None:
        for b, (row, n) in enumerate(zip(rows, lengths)):
            k_exp[row, n : n + k.shape[1]], v_exp[row, n : n + k.shape[1]] = k[b], v[b]
    idx = None if cache_batch_idx is None else int32(cache_batch_idx)
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=int32(lengths),
                                       cache_batch_idx=idx, cache_leftpad=int32(leftpad), causal=causal,
                                       num_splits=num_splits, return_softmax_lse=True)
    print(f"rel err {rel_err(out, ref32):.2e} (eager fp16 {rel_err(ref_same, ref32):.2e})")
    assert_close_to_ref(out, ref32, ref_same)
    assert_lse_close(lse, ref_lse, q.dtype)
    assert torch.equal(k_cache, k_exp) and torch.equal(v_cache, v_exp), "the append wrote the wrong rows"
    return out, lse


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q", [1, 4])
@pytest.mark.parametrize("append", [False, True])
def test_dense_matches_reference(append, seqlen_q, causal, num_splits):
    """Dense cache, GQA: keys [leftpad, length) (+ the new ones), causal bottom-right over them, split or not."""
    q, k_cache, v_cache, k, v = inputs(seqlen_q, append)
    out, lse = check_call(q, k_cache, v_cache, k, v, LENGTHS, LEFTPAD, causal, num_splits)
    if not append:  # request 3 is padded up to its length: it sees no key
        assert torch.equal(out[3], torch.zeros_like(out[3])) and torch.isposinf(lse[3]).all()


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("seqlen_q", [1, 4])
@pytest.mark.parametrize("append", [False, True])
def test_cache_batch_idx_matches_reference(append, seqlen_q, num_splits):
    """cache_batch_idx (one page per request, api/validate_cache.py) with leftpad: the request's row of the cache."""
    q, k_cache, v_cache, k, v = inputs(seqlen_q, append, cache_batch=6)
    check_call(q, k_cache, v_cache, k, v, LENGTHS, LEFTPAD, True, num_splits, cache_batch_idx=[4, 0, 5, 2])


@pytest.mark.parametrize("num_splits", [1, 3])
def test_padded_up_to_length_gives_zeros(num_splits):
    """Every request padded up to its length, no append: zeros and LSE +inf, never NaN."""
    q, k_cache, v_cache, _, _ = inputs(4, False)
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=int32(LENGTHS),
                                       cache_leftpad=int32(LENGTHS), causal=True, num_splits=num_splits,
                                       return_softmax_lse=True)
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.isposinf(lse).all()


@pytest.mark.parametrize("append", [False, True])
def test_zero_leftpad_equals_none(append):
    """cache_leftpad of zeros gives the very result (and cache) of no cache_leftpad."""
    q, k_cache, v_cache, k, v = inputs(4, append)
    results = []
    for leftpad in (None, int32([0, 0, 0, 0])):
        kc, vc = k_cache.clone(), v_cache.clone()
        out, lse = flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=int32(LENGTHS), cache_leftpad=leftpad,
                                           causal=True, num_splits=3, return_softmax_lse=True)
        results.append((out, lse, kc, vc))
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.fixture
def prefill_calls(monkeypatch):
    """Dispatch num_splits=0 calls of >= CHUNKED_PREFILL_MIN_SEQLEN_Q new tokens (8 under the interpreter,
    as tests/test_chunked_prefill.py does) to the chunked-prefill path even when its grid would not fill
    the GPU; yields the list of q shapes that path was called with."""
    if INTERPRET:
        monkeypatch.setattr(tables, "CHUNKED_PREFILL_MIN_SEQLEN_Q", 8)
    monkeypatch.setattr(decode, "prefill_programs_fill", lambda *args: True)
    return record_chunked_prefill(monkeypatch)


@pytest.mark.parametrize("batch_idx", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("append", [False, True])
def test_chunked_prefill_path(prefill_calls, append, causal, batch_idx):
    """The chunked-prefill path (num_splits=0, a long chunk) with leftpad matches the reference and the
    decode kernel (num_splits=1), and both leave the same caches."""
    seqlen_q = max(tables.CHUNKED_PREFILL_MIN_SEQLEN_Q, 12)
    capacity = seqlen_q + CAPACITY  # room for the chunk after the longest cache
    lengths = [9, 50, CAPACITY, 40]
    q, k_cache, v_cache, k, v = inputs(seqlen_q, append, cache_batch=5 if batch_idx else None, capacity=capacity)
    idx = [3, 0, 4, 1] if batch_idx else None
    results = {}
    for num_splits in (0, 1):
        prefill_calls.clear()
        kc, vc = k_cache.clone(), v_cache.clone()
        out, _ = check_call(q, kc, vc, k, v, lengths, LEFTPAD, causal, num_splits, cache_batch_idx=idx)
        assert len(prefill_calls) == (num_splits == 0), "the call did not take the expected path"
        results[num_splits] = (out, kc, vc)
    diff = rel_err(results[0][0], results[1][0])
    assert diff <= agreement_tolerance(DTYPE), f"prefill path vs decode kernel rel err {diff:.2e}"
    assert torch.equal(results[0][1], results[1][1]) and torch.equal(results[0][2], results[1][2])


def test_rotary_positions_count_the_padding():
    """With rotary, q and k are rotated at their absolute cache rows (cache_seqlens[b] + t), as in flash-attn."""
    q, k_cache, v_cache, k, v = inputs(4, True)
    angles = torch.rand(CAPACITY, 8, device=DEVICE) * 6.3
    cos, sin = angles.cos().to(DTYPE), angles.sin().to(DTYPE)
    kc, vc = k_cache.clone(), v_cache.clone()
    out = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cos, sin, cache_seqlens=int32(LENGTHS),
                                  cache_leftpad=int32(LEFTPAD), causal=True)
    positions = torch.tensor(LENGTHS, device=DEVICE)
    q_rot = rotary_ref(q, cos, sin, positions, interleaved=True)
    k_rot = rotary_ref(k, cos, sin, positions, interleaved=True)
    expected = flash_attn_with_kvcache(q_rot, kc, vc, k_rot, v, cache_seqlens=int32(LENGTHS),
                                       cache_leftpad=int32(LEFTPAD), causal=True)
    diff = rel_err(out, expected)
    assert diff <= agreement_tolerance(DTYPE), f"rotary with leftpad rel err {diff:.2e}"


def test_device_values_are_clamped():
    """Past validation (a GPU tensor is trusted), the kernels clamp cache_leftpad into [0, cache_seqlens[b]]:
    a negative entry reads from row 0, one past the length reads nothing."""
    q, k_cache, v_cache, _, _ = inputs(1, False)
    lengths = int32(LENGTHS)
    bad, clamped = int32([-5, 3, 95, 1000]), int32([0, 3, LENGTHS[2], LENGTHS[3]])
    for num_splits in (1, 3):
        got = kvcache.kvcache_call(q, k_cache, v_cache, None, None, lengths, None, None, False, num_splits, False,
                                   validated=False, cache_leftpad=bad)
        want = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, cache_leftpad=clamped,
                                       num_splits=num_splits)
        assert torch.equal(got, want)


def test_strided_and_cpu_leftpad():
    """A non-contiguous cache_leftpad and one on the CPU (checked, then copied) give the plain result."""
    q, k_cache, v_cache, _, _ = inputs(1, False)
    lengths = int32(LENGTHS)
    want = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, cache_leftpad=int32(LEFTPAD))
    strided = int32([x for pad in LEFTPAD for x in (pad, -1)])[::2]
    assert torch.equal(flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, cache_leftpad=strided),
                       want)
    on_cpu = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths.cpu(),
                                     cache_leftpad=int32(LEFTPAD, device="cpu"))
    assert torch.equal(on_cpu, want)


def _bad_calls():
    """(id, kwargs, exception, message pattern) of calls that must raise before any launch."""
    table = torch.arange(4, dtype=torch.int32, device=DEVICE).view(4, 1)
    cpu_lengths = int32(LENGTHS, device="cpu")
    return [
        ("dtype", dict(cache_leftpad=torch.tensor(LEFTPAD, device=DEVICE)), InputTypeError, "int32"),
        ("not a tensor", dict(cache_leftpad=LEFTPAD), InputTypeError, "int32 tensor"),
        ("shape", dict(cache_leftpad=int32(LEFTPAD[:3])), InputError, r"shape \(4,\)"),
        ("2d", dict(cache_leftpad=int32(LEFTPAD).view(4, 1)), InputError, r"shape \(4,\)"),
        ("paged", dict(cache_leftpad=int32(LEFTPAD), block_table=table), NotImplementedError, "block_table"),
        ("past cpu lengths", dict(cache_leftpad=int32([0, 51, 0, 0], device="cpu"), cache_seqlens=cpu_lengths),
         InputError, r"cache_leftpad\[1\] = 51 with cache_seqlens\[1\] = 50"),
        ("past int length", dict(cache_leftpad=int32([0, 0, 0, 41], device="cpu"), cache_seqlens=40),
         InputError, r"cache_leftpad\[3\] = 41"),
        ("negative", dict(cache_leftpad=int32([0, -1, 0, 0], device="cpu")), InputError, r"0 <= cache_leftpad\[b\]"),
    ]


@pytest.mark.parametrize("case", range(len(_bad_calls())), ids=[c[0] for c in _bad_calls()])
def test_bad_leftpad_raises(case):
    """Bad cache_leftpad raises (the error names it) and leaves the cache untouched."""
    _, kwargs, error, pattern = _bad_calls()[case]
    q, k_cache, v_cache, k, v = inputs(1, True)
    if "block_table" in kwargs:
        k_cache, v_cache = k_cache.view(4, CAPACITY, NHEADS_K, HEAD_DIM), v_cache.view(4, CAPACITY, NHEADS_K, HEAD_DIM)
    kwargs.setdefault("cache_seqlens", int32(LENGTHS))
    before = k_cache.clone()
    with pytest.raises(error, match=pattern):
        flash_attn_with_kvcache(q, k_cache, v_cache, k, v, **kwargs)
    assert torch.equal(k_cache, before)
