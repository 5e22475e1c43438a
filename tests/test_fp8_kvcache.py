"""FP8 (float8_e4m3fn) KV cache in flash_attn_with_kvcache: k_cache / v_cache in e4m3 with k_descale /
v_descale (FlashAttention-3's names), q, new k / v and the output in fp16 / bf16.

Two checks per result, as issue 58 asks: against the reference run on the dequantized cache (what the
kernels compute: the quantization is exact, so the usual rule applies, `helpers.assert_close_to_ref`), and
the quantization error itself, against an fp64 reference on the original unquantized values, with its own
bound (`tritonattn.testing.FP8_KV_RTOL`). Appended rows must equal the reference quantization
(`quantize_e4m3_ref`) bit for bit, values beyond +-448 clamped, never NaN. Dense and paged, MHA and GQA,
lengths off the tile, split and unsplit, the variants, chunked prefill over an FP8 cache, and bad input.
fp16 runs under the interpreter; bf16 only on a GPU (the interpreter's bf16 tl.dot is wrong).
"""

from __future__ import annotations

import pytest
import torch

from helpers import DEVICE, ON_GPU, assert_close_to_ref, assert_lse_close, paged_copy, per_request_references
from tritonattn import flash_attn_with_kvcache, rel_err
from tritonattn.config import tables
from tritonattn.config.hardware import TARGETS, fp8_unsupported
from tritonattn.testing import FP8_KV_OUTLIER_RTOL, FP8_KV_RTOL, attention_ref, dequantize_ref, quantize_e4m3_ref

HALF_DTYPES = [torch.float16] + ([torch.bfloat16] if ON_GPU else [])
HEAD_DIM = 128 if ON_GPU else 32
E4M3 = torch.float8_e4m3fn


def amax_descale(x: torch.Tensor, per_head: bool):
    """A descale that maps x's largest magnitude (per (batch, KV head), or over the tensor) to 448."""
    if per_head:
        return (x.float().abs().amax((1, 3)) / 448.0).clamp(min=1e-6).contiguous()
    return float(x.float().abs().max()) / 448.0


def fp8_case(batch, seqlen_cache, seqlen_q, nheads, nheads_k, dtype, *, append, per_head=True, seed=0,
             head_dim=HEAD_DIM):
    """q, the original caches (fp32), the FP8 caches and their descales, new k / v (or None)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    rand = lambda *s: torch.randn(*s, generator=g).to(DEVICE)  # noqa: E731
    q = rand(batch, seqlen_q, nheads, head_dim).to(dtype)
    k_orig, v_orig = rand(batch, seqlen_cache, nheads_k, head_dim), rand(batch, seqlen_cache, nheads_k, head_dim)
    kd, vd = amax_descale(k_orig, per_head), amax_descale(v_orig, per_head)
    k8, v8 = quantize_e4m3_ref(k_orig, kd), quantize_e4m3_ref(v_orig, vd)
    k = v = None
    if append:
        k, v = rand(batch, seqlen_q, nheads_k, head_dim).to(dtype), rand(batch, seqlen_q, nheads_k, head_dim).to(dtype)
    return q, k_orig, v_orig, k8, v8, kd, vd, k, v


def saturated_ref(k, v, kd, vd) -> torch.Tensor:
    """int64 (batch, nheads_k, 2): how many new K / V values the append clamps (|value / descale| > 448)."""
    def count(x, d):
        d = torch.as_tensor(d, dtype=torch.float32, device=x.device)
        d = d[:, None, :, None] if d.dim() == 2 else d
        return ((x.float() / d).abs() > 448.0).sum((1, 3))
    return torch.stack([count(k, kd), count(v, vd)], dim=-1)


def appended(k8, v8, kd, vd, k, v, lengths):
    """The FP8 caches as they must be after the append: the new rows quantized with the descales."""
    k_exp, v_exp = k8.clone(), v8.clone()
    if k is not None:
        kq, vq = quantize_e4m3_ref(k, kd), quantize_e4m3_ref(v, vd)
        for b, length in enumerate(lengths):
            k_exp[b, length: length + k.shape[1]] = kq[b]
            v_exp[b, length: length + v.shape[1]] = vq[b]
    return k_exp, v_exp


def check_against_dequantized(out, lse, q, k_exp, v_exp, kd, vd, lengths, *, causal, n_new=0, msg="", **variants):
    """The rule against the reference over the dequantized cache (the appended rows included): fp32 ground
    truth from the exact dequantized values, PyTorch's same-dtype result from them rounded to q's dtype."""
    n_keys = [length + n_new for length in lengths]
    k32, v32 = dequantize_ref(k_exp, kd), dequantize_ref(v_exp, vd)
    ref32, ref_lse, _ = per_request_references(q.float(), k32, v32, None, None, n_keys, causal=causal, **variants)
    _, _, same = per_request_references(q, k32.to(q.dtype), v32.to(q.dtype), None, None, n_keys, causal=causal,
                                        **variants)
    assert_close_to_ref(out, ref32, same, msg=msg)
    if lse is not None:
        assert_lse_close(lse, ref_lse, q.dtype, msg=msg)


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


# --------------------------------------------------------------------------------------------
# Dense and paged decode against the dequantized reference
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", HALF_DTYPES)
@pytest.mark.parametrize("per_head", [True, False])
@pytest.mark.parametrize("append", [False, True])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("group", [1, 4])
def test_dense_decode(group, num_splits, append, per_head, dtype):
    """Dense FP8 decode (MHA / GQA, ragged lengths off the tile, split or not, with an append or not) matches
    the reference on the dequantized cache, and the appended rows are the reference quantization."""
    lengths = [0, 17, 45, 70]
    nheads_k = 2
    q, _, _, k8, v8, kd, vd, k, v = fp8_case(len(lengths), 80, 1, nheads_k * group, nheads_k, dtype, append=append,
                                               per_head=per_head)
    k_exp, v_exp = appended(k8, v8, kd, vd, k, v, lengths)
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    out, lse = flash_attn_with_kvcache(q, k8, v8, k, v, cache_seqlens=seqlens, num_splits=num_splits,
                                       return_softmax_lse=True, k_descale=kd, v_descale=vd)
    assert out.dtype == dtype and k8.dtype == E4M3
    assert bits_equal(k8, k_exp) and bits_equal(v8, v_exp)
    check_against_dequantized(out, lse, q, k_exp, v_exp, kd, vd, lengths, causal=False, n_new=1 if append else 0,
                              msg=f"(group={group}, num_splits={num_splits}, append={append}, per_head={per_head})")


@pytest.mark.parametrize("dtype", HALF_DTYPES)
@pytest.mark.parametrize("append", [False, True])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("page_size", [16, 5])
def test_paged_decode(page_size, num_splits, append, dtype):
    """Paged FP8 decode (pages holding whole key blocks or gathered per key, GQA) equals the dense FP8 decode
    of the same values and matches the dequantized reference; appends land in their pages, quantized."""
    lengths = [3, 38, 59]
    q, _, _, k8, v8, kd, vd, k, v = fp8_case(len(lengths), 16 * 5 * 4 // 4, 2 if append else 1, 4, 2, dtype,
                                               append=append, seed=1)
    counters = None
    if append:  # some values beyond the clamp, counted once per call whatever the splits
        k, v = k * 3.0, v * 3.0
        counters = [torch.zeros((len(lengths), 2, 2), dtype=torch.int64, device=DEVICE) for _ in range(2)]
    k_exp, v_exp = appended(k8, v8, kd, vd, k, v, lengths)
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    k_pool, v_pool, table = paged_copy(k8, v8, page_size)
    out = flash_attn_with_kvcache(q, k_pool, v_pool, k, v, cache_seqlens=seqlens, block_table=table, causal=True,
                                  num_splits=num_splits, k_descale=kd, v_descale=vd,
                                  kv_saturated=counters and counters[0])
    dense = flash_attn_with_kvcache(q, k8, v8, k, v, cache_seqlens=seqlens, causal=True, num_splits=num_splits,
                                    k_descale=kd, v_descale=vd, kv_saturated=counters and counters[1])
    if append:
        expected = saturated_ref(k, v, kd, vd)
        assert expected.sum() > 0 and torch.equal(counters[0], expected) and torch.equal(counters[1], expected)
    pages = table.shape[1]
    k_back = k_pool[table.flatten().long()].reshape(k8.shape[0], pages * page_size, *k8.shape[2:])
    v_back = v_pool[table.flatten().long()].reshape(v8.shape[0], pages * page_size, *v8.shape[2:])
    assert bits_equal(k_back, k_exp) and bits_equal(v_back, v_exp)
    assert rel_err(out, dense) <= 1e-3, rel_err(out, dense)
    check_against_dequantized(out, None, q, k_exp, v_exp, kd, vd, lengths, causal=True,
                              n_new=q.shape[1] if append else 0, msg=f"(page_size={page_size})")


@pytest.mark.skipif(not ON_GPU, reason="bf16 runs on a GPU (the interpreter refuses it)")
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("magnitude", [1e-30, 1e-3, 1.0, 3e5])
def test_bf16_query_any_magnitude(magnitude, paged):
    """Decode computes on an FP8 cache in fp16 also under a bf16 q (`cache_query`: the q tile scaled by a power
    of two into fp16's range, taken back in the score units), so bf16 q of any magnitude, beyond fp16's 65504
    too, matches the dequantized reference."""
    lengths = [9, 40, 33]
    q, _, _, k8, v8, kd, vd, k, v = fp8_case(len(lengths), 48, 2, 4, 2, torch.bfloat16, append=True, seed=3)
    q = (q.float() * magnitude).to(torch.bfloat16)
    k_exp, v_exp = appended(k8, v8, kd, vd, k, v, lengths)
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    extra = {}
    if paged:
        k8, v8, extra["block_table"] = paged_copy(k8, v8, 16)
    out, lse = flash_attn_with_kvcache(q, k8, v8, k, v, cache_seqlens=seqlens, causal=True, num_splits=2,
                                       return_softmax_lse=True, k_descale=kd, v_descale=vd, **extra)
    assert torch.isfinite(out).all() and out.dtype == torch.bfloat16
    check_against_dequantized(out, lse, q, k_exp, v_exp, kd, vd, lengths, causal=True, n_new=2,
                              msg=f"(magnitude={magnitude}, paged={paged})")


# --------------------------------------------------------------------------------------------
# The append: bit for bit the reference quantization, clamped, never NaN
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("seqlen_q", [1, 3])
def test_append_quantizes_bit_for_bit(seqlen_q, paged):
    """New rows are stored as (value / descale) clamped to +-448 and rounded to nearest even: bit for bit
    quantize_e4m3_ref, also for values far beyond 448 * descale (no wrap, no NaN) and for -0.0."""
    lengths = [5, 30]
    q, _, _, k8, v8, kd, vd, k, v = fp8_case(2, 48, seqlen_q, 4, 2, torch.float16, append=True, seed=2)
    k = k * 4.0  # about 16 % of the values land beyond the clamp with the cache's amax descale
    k[0, 0, 0, :6] = torch.tensor([1000.0, -1000.0, 60000.0, -60000.0, -0.0, 0.0], dtype=k.dtype)
    v[1, -1, 1, :2] = torch.tensor([65504.0, -65504.0], dtype=v.dtype)
    k_exp, v_exp = appended(k8, v8, kd, vd, k, v, lengths)
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    counter = torch.full((2, 2, 2), 7, dtype=torch.int64, device=DEVICE)  # added to, not overwritten
    if paged:
        k_pool, v_pool, table = paged_copy(k8, v8, 16)
        out = flash_attn_with_kvcache(q, k_pool, v_pool, k, v, cache_seqlens=seqlens, block_table=table,
                                      k_descale=kd, v_descale=vd, kv_saturated=counter)
        k8 = k_pool[table.flatten().long()].reshape(k_exp.shape)
        v8 = v_pool[table.flatten().long()].reshape(v_exp.shape)
    else:
        out = flash_attn_with_kvcache(q, k8, v8, k, v, cache_seqlens=seqlens, k_descale=kd, v_descale=vd,
                                      kv_saturated=counter)
    assert bits_equal(k8, k_exp) and bits_equal(v8, v_exp)
    expected = saturated_ref(k, v, kd, vd)
    assert expected[..., 0].sum() > 0 and expected[1, 1, 1] > 0
    assert torch.equal(counter, expected + 7)
    assert not torch.isnan(k8.float()).any() and not torch.isnan(v8.float()).any()
    assert k8.float().abs().max() == 448.0 and k8[0, 5, 0, 4].float().item() == 0.0
    assert torch.signbit(k8[0, 5, 0, 4].float()) and not torch.signbit(k8[0, 5, 0, 5].float())
    check_against_dequantized(out, None, q, k_exp, v_exp, kd, vd, lengths, causal=False, n_new=seqlen_q)


# --------------------------------------------------------------------------------------------
# The variants, chunked prefill over an FP8 cache
# --------------------------------------------------------------------------------------------
VARIANTS = {
    "window": dict(window_size=(9, 0)),
    "softcap": dict(softcap=3.0),
    "alibi": dict(alibi_slopes=torch.tensor([0.5, 0.25, 0.125, 0.0625], device=DEVICE)),
    "sinks": dict(sinks=torch.tensor([0.5, -1.0, 2.0, 0.0], device=DEVICE)),
}


@pytest.mark.parametrize("num_splits", [1, 2])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_variants(variant, num_splits):
    """Each variant over an FP8 cache (per-tensor descales, K's folded into the score scale before softcap
    and ALiBi) matches the dequantized reference, with an append of two tokens, causal."""
    lengths = [20, 41]
    q, _, _, k8, v8, kd, vd, k, v = fp8_case(2, 48, 2, 4, 2, torch.float16, append=True, per_head=False, seed=3)
    k_exp, v_exp = appended(k8, v8, kd, vd, k, v, lengths)
    out, lse = flash_attn_with_kvcache(q, k8, v8, k, v, cache_seqlens=torch.tensor(lengths, dtype=torch.int32,
                                       device=DEVICE), causal=True, num_splits=num_splits, return_softmax_lse=True,
                                       k_descale=kd, v_descale=vd, **VARIANTS[variant])
    check_against_dequantized(out, lse, q, k_exp, v_exp, kd, vd, lengths, causal=True, n_new=2, msg=variant,
                              **VARIANTS[variant])


@pytest.mark.parametrize("paged", [False, True])
def test_chunked_prefill_over_fp8_cache(paged, monkeypatch):
    """A chunk of many tokens (the prefill kernels' path: the append launch, then fwd_kernel's cache mode)
    reads an FP8 cache and quantizes its chunk exactly as the decode kernel does."""
    monkeypatch.setattr(tables, "CHUNKED_PREFILL_MIN_SEQLEN_Q", 8)
    monkeypatch.setattr(tables, "CHUNKED_PREFILL_MIN_WAVE", 0.0)
    lengths, chunk = [7, 33], 24
    q, _, _, k8, v8, kd, vd, k, v = fp8_case(2, 64, chunk, 4, 2, torch.float16, append=True, seed=4)
    k[:, :, 0, :4] *= 50.0  # some clamped K values in KV head 0, none in head 1
    k_exp, v_exp = appended(k8, v8, kd, vd, k, v, lengths)
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    counter = torch.zeros((2, 2, 2), dtype=torch.int64, device=DEVICE)
    if paged:
        k_pool, v_pool, table = paged_copy(k8, v8, 16)
        out = flash_attn_with_kvcache(q, k_pool, v_pool, k, v, cache_seqlens=seqlens, block_table=table, causal=True,
                                      k_descale=kd, v_descale=vd, kv_saturated=counter)
        k8 = k_pool[table.flatten().long()].reshape(k_exp.shape)
        v8 = v_pool[table.flatten().long()].reshape(v_exp.shape)
    else:
        out = flash_attn_with_kvcache(q, k8, v8, k, v, cache_seqlens=seqlens, causal=True, k_descale=kd, v_descale=vd,
                                      kv_saturated=counter)
    assert bits_equal(k8, k_exp) and bits_equal(v8, v_exp)
    expected = saturated_ref(k, v, kd, vd)
    assert expected[:, 0, 0].min() > 0 and torch.equal(counter, expected)
    check_against_dequantized(out, None, q, k_exp, v_exp, kd, vd, lengths, causal=True, n_new=chunk)


# --------------------------------------------------------------------------------------------
# The quantization error itself
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("per_head", [True, False])
def test_quantization_error_vs_unquantized(per_head):
    """Against an fp64 reference on the original (unquantized) cache the error is the quantization's:
    printed, within FP8_KV_RTOL for unit-scale normal inputs and FP8_KV_OUTLIER_RTOL with 20x outlier channels."""
    for outliers in (False, True):
        q, k_orig, v_orig, _, _, _, _, _, _ = fp8_case(2, 256, 1, 8, 2, torch.float16, append=False, seed=5)
        if outliers:
            k_orig[..., :2] *= 20.0
            v_orig[..., :2] *= 20.0
        kd, vd = amax_descale(k_orig, per_head), amax_descale(v_orig, per_head)
        k8, v8 = quantize_e4m3_ref(k_orig, kd), quantize_e4m3_ref(v_orig, vd)
        out = flash_attn_with_kvcache(q, k8, v8, cache_seqlens=256, k_descale=kd, v_descale=vd)
        ref64, _ = attention_ref(q.double(), k_orig.double(), v_orig.double())
        fp16, _ = attention_ref(q.double(), k_orig.half().double(), v_orig.half().double())
        err, err16 = rel_err(out, ref64), rel_err(fp16, ref64)
        rmse = (out.double() - ref64).pow(2).mean().sqrt().item()
        print(f"per_head={per_head} outliers={outliers}: FP8 cache rel err {err:.2e} (RMSE {rmse:.2e}); "
              f"an fp16 cache's {err16:.2e}")
        bound = FP8_KV_OUTLIER_RTOL if outliers else FP8_KV_RTOL
        assert err <= bound, (err, bound)


# --------------------------------------------------------------------------------------------
# Descales as numbers, tensors, missing; bad input
# --------------------------------------------------------------------------------------------
def test_descale_forms_agree():
    """A per-tensor descale as a float, a one-element tensor (CPU or device) or a (batch, nheads_k) tensor of
    that value gives one result."""
    q, _, _, k8, v8, _, _, _, _ = fp8_case(2, 40, 1, 4, 2, torch.float16, append=False, seed=6)
    run = lambda kd, vd: flash_attn_with_kvcache(q, k8, v8, cache_seqlens=33, k_descale=kd, v_descale=vd)  # noqa: E731
    full = run(torch.full((2, 2), 0.01, device=DEVICE), torch.full((2, 2), 0.02, device=DEVICE))
    for kd, vd in ((0.01, 0.02), (torch.tensor([0.01]), torch.tensor(0.02)),
                   (torch.tensor([[0.01]], device=DEVICE), torch.tensor([0.02], device=DEVICE))):
        assert torch.equal(run(kd, vd), full)
    check_against_dequantized(full, None, q, k8, v8, 0.01, 0.02, [33, 33], causal=False)


def _bad_cases():
    q, _, _, k8, v8, kd, vd, k, v = fp8_case(2, 32, 1, 4, 2, torch.float16, append=True, seed=7)
    fp16_cache = k8.to(torch.float16)
    good = dict(cache_seqlens=5, k_descale=kd, v_descale=vd)
    return {  # name: (args, kwargs, error, message fragment)
        "descale shape": ((q, k8, v8), {**good, "k_descale": torch.ones(2, 4, device=DEVICE)}, ValueError,
                          r"k_descale of shape \(batch, nheads_k\) = \(2, 2\)"),
        "descale dtype": ((q, k8, v8), {**good, "v_descale": vd.half()}, TypeError, "v_descale of dtype float32"),
        "descale device": ((q, k8, v8), {**good, "k_descale": torch.ones(2, 2, device="meta")}, ValueError,
                           r"got \(2, 2\) on meta"),
        "descale type": ((q, k8, v8), {**good, "k_descale": "1.0"}, TypeError, "k_descale to be a float32 tensor"),
        "no descales": ((q, k8, v8), {"cache_seqlens": 5}, ValueError, "Expected k_descale with an FP8 KV cache"),
        "no v_descale": ((q, k8, v8), {**good, "v_descale": None}, ValueError, "Expected v_descale with an FP8"),
        "counter dtype": ((q, k8, v8), {**good, "kv_saturated": torch.zeros(2, 2, 2, device=DEVICE)}, TypeError,
                          "kv_saturated of dtype int64"),
        "counter shape": ((q, k8, v8), {**good, "kv_saturated": torch.zeros(2, 2, dtype=torch.int64, device=DEVICE)},
                          ValueError, r"kv_saturated contiguous, of shape \(batch, nheads_k, 2\) = \(2, 2, 2\)"),
        "counter with 16-bit cache": ((q, fp16_cache, fp16_cache),
                                      {"cache_seqlens": 5, "kv_saturated": torch.zeros(2, 2, 2, dtype=torch.int64,
                                                                                       device=DEVICE)},
                                      ValueError, "only with FP8 keys and values"),
        "descale zero": ((q, k8, v8), {**good, "k_descale": 0.0}, ValueError, "finite and > 0"),
        "descale nan": ((q, k8, v8), {**good, "v_descale": torch.tensor([float("nan")])}, ValueError,
                        "finite and > 0"),
        "descale with 16-bit cache": ((q, fp16_cache, fp16_cache), good, ValueError, "only with FP8 keys and values"),
        "fp8 q": ((q.to(E4M3), k8, v8), good, NotImplementedError, "e4m3 q with q_descale"),
        "fp8 q, 16-bit cache": ((q.to(E4M3), fp16_cache, fp16_cache), {"cache_seqlens": 5}, NotImplementedError,
                                "e4m3 q with q_descale"),
        "fp32 q": ((q.float(), k8, v8), good, NotImplementedError, "float32 over an FP8 KV cache"),
        "mixed caches": ((q, k8, fp16_cache), good, TypeError, "k_cache and v_cache of one dtype"),
        "fp8 new k": ((q, k8, v8, k.to(E4M3), v), good, TypeError, "new k in q's dtype"),
        "new v dtype": ((q, k8, v8, k, v.float()), good, ValueError, "share one dtype"),
        "e5m2 cache": ((q, k8.to(torch.float8_e5m2), v8.to(torch.float8_e5m2)), good, NotImplementedError,
                       "float8_e4m3fn"),
    }


@pytest.mark.parametrize("case", sorted(_bad_cases()))
def test_bad_input_is_refused_before_launch(case):
    """Bad descales, FP8 mixing rules, unsupported dtypes: a clear error before anything runs (the caches
    unchanged)."""
    args, kwargs, error, match = _bad_cases()[case]
    before = [a.clone() for a in args[1:3]]
    with pytest.raises(error, match=match):
        flash_attn_with_kvcache(*args, **kwargs)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(args[1:3], before))


def test_fp8_needs_sm89():
    """Triton converts e4m3 from sm_89 on: the hardware check names the cards before it."""
    assert fp8_unsupported(TARGETS["L4"]) is None and fp8_unsupported(TARGETS["H100"]) is None
    for card in ("T4", "A100", "A10"):
        assert "compute capability 8.9" in fp8_unsupported(TARGETS[card])


# --------------------------------------------------------------------------------------------
# The cache classes own their scales
# --------------------------------------------------------------------------------------------
def _prompt(n, seqlen, nheads, nheads_k, dtype, seed):
    g = torch.Generator(device="cpu").manual_seed(seed)
    rand = lambda *s: torch.randn(*s, generator=g).to(DEVICE).to(dtype)  # noqa: E731
    return (rand(n, seqlen, nheads, HEAD_DIM), rand(n, seqlen, nheads_k, HEAD_DIM),
            rand(n, seqlen, nheads_k, HEAD_DIM), rand)


def test_kvcache_fp8_scales_and_steps():
    """KVCache(dtype=e4m3): prefill sets each (request, KV head)'s descales to amax * fp8_headroom / 448 and
    stores the prompt quantized with them; decode steps append with the same descales and match the
    reference over the dequantized cache; clamped values are counted; reset forgets scales and counts."""
    from tritonattn import KVCache

    q, k, v, rand = _prompt(2, 20, 4, 2, torch.float16, seed=8)
    cache = KVCache(2, 40, 2, HEAD_DIM, dtype=E4M3, device=DEVICE)
    assert cache.k_cache.dtype == E4M3 and cache.saturated.shape == (2, 2, 2)
    out = cache.prefill(q, k, v)
    kd = k.float().abs().amax((1, 3)) * (2.0 / 448.0)  # the default headroom, FP8_SCALE_HEADROOM
    assert torch.equal(cache.k_descale, kd) and torch.equal(cache.v_descale, v.float().abs().amax((1, 3)) * (2 / 448))
    assert bits_equal(cache.k_cache[:, :20], quantize_e4m3_ref(k, kd))
    assert rel_err(out, attention_ref(q.double(), k.double(), v.double(), causal=True)[0]) < 2e-3  # unquantized
    assert int(cache.saturated.sum()) == 0
    expected_sat = torch.zeros(2, 2, 2, dtype=torch.int64, device=DEVICE)
    for step in range(3):
        qt, kt, vt = rand(2, 1, 4, HEAD_DIM), rand(2, 1, 2, HEAD_DIM), rand(2, 1, 2, HEAD_DIM)
        if step == 1:  # beyond the headroom: clamped and counted
            kt[0, 0, 1, :3] = 1000.0
        expected_sat += saturated_ref(kt, vt, cache.k_descale, cache.v_descale)
        out = cache.decode(qt, kt, vt)
        n = 21 + step
        ref, _ = attention_ref(qt.float(), dequantize_ref(cache.k_cache[:, :n], cache.k_descale),
                               dequantize_ref(cache.v_cache[:, :n], cache.v_descale), causal=True)
        assert_close_to_ref(out, ref.to(out.dtype), ref, msg=f"step {step}")
    assert cache.seqlens == [23, 23] and int(expected_sat[0, 1, 0]) == 3
    assert torch.equal(cache.saturated, expected_sat)
    cache.reset(0)
    assert int(cache.saturated[0].sum()) == 0 and torch.equal(cache.k_descale[0], torch.ones(2, device=DEVICE))
    assert torch.equal(cache.saturated[1], expected_sat[1])


def test_kvcache_fp8_given_scales_and_headroom():
    """Descales given to prefill are used as given (a number or (n, nheads_k)); prompt values they clamp are
    counted; fp8_headroom changes the derived scales."""
    from tritonattn import KVCache

    q, k, v, _ = _prompt(2, 12, 2, 2, torch.float16, seed=9)
    cache = KVCache(2, 16, 2, HEAD_DIM, dtype=E4M3, device=DEVICE)
    given = torch.full((2, 2), 1e-3, device=DEVICE)  # far too small: most values clamp
    cache.prefill(q, k, v, k_descale=given, v_descale=0.5)
    assert torch.equal(cache.k_descale, given) and torch.equal(cache.v_descale, torch.full((2, 2), 0.5, device=DEVICE))
    assert torch.equal(cache.saturated, saturated_ref(k, v, given, 0.5)) and int(cache.saturated[..., 0].sum()) > 0
    loose = KVCache(2, 16, 2, HEAD_DIM, dtype=E4M3, device=DEVICE, fp8_headroom=8.0)
    loose.prefill(q, k, v)
    assert torch.allclose(loose.k_descale, k.float().abs().amax((1, 3)) * 8.0 / 448.0)


def test_paged_fp8_cache_matches_dense():
    """PagedKVCache(dtype=e4m3) over slots out of order (gathered descales and counters) gives the dense
    FP8 KVCache's outputs and counts; free forgets a slot's scales."""
    from tritonattn import KVCache, PagedKVCache

    q, k, v, rand = _prompt(2, 19, 4, 2, torch.float16, seed=10)
    dense = KVCache(2, 40, 2, HEAD_DIM, dtype=E4M3, device=DEVICE)
    paged = PagedKVCache(16, 8, 2, HEAD_DIM, max_batch=3, max_blocks_per_seq=5, dtype=E4M3, device=DEVICE)
    paged.add_request()  # slot 0 stays empty: the batch is slots [2, 1], gathered
    b, a = paged.add_request(), paged.add_request()
    dense.prefill(q, k, v)
    paged.prefill(q[:1], k[:1], v[:1], slots=[a])
    paged.prefill(q[1:], k[1:], v[1:], slots=[b])
    assert torch.equal(paged.k_descale[[a, b]], dense.k_descale)
    for step in range(3):
        qt, kt, vt = rand(2, 1, 4, HEAD_DIM), rand(2, 1, 2, HEAD_DIM), rand(2, 1, 2, HEAD_DIM) * 3.0
        out_d = dense.decode(qt, kt, vt)
        out_p = paged.decode(qt, kt, vt, slots=[a, b])
        assert rel_err(out_p, out_d) <= 1e-3, step
    assert int(dense.saturated.sum()) > 0 and torch.equal(paged.saturated[[a, b]], dense.saturated)
    assert int(paged.saturated[0].sum()) == 0
    paged.free(a)
    assert int(paged.saturated[a].sum()) == 0 and float(paged.v_descale[a].max()) == 1.0


def test_cache_classes_fp8_bad_input():
    from tritonattn import KVCache, PagedKVCache

    q, k, v, _ = _prompt(1, 4, 2, 2, torch.float16, seed=11)
    half = KVCache(1, 8, 2, HEAD_DIM, dtype=torch.float16, device=DEVICE)
    with pytest.raises(ValueError, match="only for an FP8 cache"):
        half.prefill(q, k, v, k_descale=0.1)
    fp8 = KVCache(1, 8, 2, HEAD_DIM, dtype=E4M3, device=DEVICE)
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        fp8.prefill(q.float(), k.float(), v.float())
    with pytest.raises(ValueError, match="k_descale finite and > 0"):
        fp8.prefill(q, k, v, k_descale=0.0)
    with pytest.raises(ValueError, match=r"k_descale of shape \(n, nheads_k\)"):
        fp8.prefill(q, k, v, k_descale=torch.ones(3, device=DEVICE))
    assert fp8.seqlens == [0] and int(fp8.saturated.sum()) == 0  # nothing stored
    with pytest.raises(ValueError, match="fp8_headroom"):
        PagedKVCache(4, 8, 2, HEAD_DIM, max_batch=1, max_blocks_per_seq=2, dtype=E4M3, device=DEVICE, fp8_headroom=0.5)
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        KVCache(1, 8, 2, HEAD_DIM, dtype=torch.float8_e5m2, device=DEVICE)


def test_paged_set_scales_before_chunks():
    """PagedKVCache.set_scales gives an empty request its prompt's scales before decode appends the prompt in
    chunks (chunked prefill): the stored rows are quantized with them; a request holding tokens, or a 16-bit
    pool, is refused."""
    from tritonattn import PagedKVCache

    _, k, v, rand = _prompt(1, 40, 4, 2, torch.float16, seed=12)
    pool = PagedKVCache(8, 16, 2, HEAD_DIM, max_batch=2, max_blocks_per_seq=4, dtype=E4M3, device=DEVICE)
    slot = pool.add_request()
    pool.set_scales(slot, k[0], v[0])
    kd = k.float().abs().amax((1, 3)) * (2.0 / 448.0)
    assert torch.equal(pool.k_descale[slot], kd[0])
    pool.decode(rand(1, 40, 4, HEAD_DIM), k, v, slots=[slot])
    stored = pool.k_cache[torch.tensor(pool.pages(slot), device=DEVICE)].reshape(1, -1, 2, HEAD_DIM)[:, :40]
    assert bits_equal(stored, quantize_e4m3_ref(k, kd))
    with pytest.raises(ValueError, match="holds 40 tokens"):
        pool.set_scales(slot, k[0], v[0])
    half = PagedKVCache(8, 16, 2, HEAD_DIM, max_batch=1, max_blocks_per_seq=4, device=DEVICE)
    with pytest.raises(ValueError, match="for an FP8 cache"):
        half.set_scales(half.add_request(), k[0], v[0])


def test_kvcache_set_scales_before_chunks():
    """KVCache.set_scales likewise for dense caches: the chunked prompt is stored with the set scales."""
    from tritonattn import KVCache

    _, k, v, rand = _prompt(2, 24, 4, 2, torch.float16, seed=13)
    cache = KVCache(2, 40, 2, HEAD_DIM, dtype=E4M3, device=DEVICE)
    cache.set_scales(k, v)
    kd = k.float().abs().amax((1, 3)) * (2.0 / 448.0)
    cache.decode(rand(2, 24, 4, HEAD_DIM), k, v)
    assert torch.equal(cache.k_descale, kd) and bits_equal(cache.k_cache[:, :24], quantize_e4m3_ref(k, kd))
    with pytest.raises(ValueError, match="holds 24 tokens"):
        cache.set_scales(k, v)
