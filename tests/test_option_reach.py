"""Every attention option reaches every entry point: for each option (a field of AttnOptions, as a user passes
it) and each entry point -- flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache over a dense and
a paged cache, flash-attn's primitives, the custom ops under torch.compile, KVCache and PagedKVCache, the SDPA
provider and the transformers backend -- a call with the option's non-default value matches the reference with
that value, and differs from the call without it. Where an entry point has no way to take an option (flash-attn
gives it no such argument), `NOT_TAKEN` says why, and the test checks the entry point refuses it rather than
ignoring it.

`OPTIONS` must list every field of AttnOptions (head_dim, a shape, aside): a new option fails
`test_every_option_is_listed` until it is added here, so it is proven at every entry point from the start.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from helpers import DEVICE, ON_GPU, assert_close_to_ref
from tritonattn import (
    KVCache,
    PagedKVCache,
    flash_attn_func,
    flash_attn_varlen_func,
    flash_attn_with_kvcache,
    rel_err,
)
from tritonattn.config.options import AttnOptions
from tritonattn.flash_attn_interface import _flash_attn_forward, _flash_attn_varlen_forward
from tritonattn.testing import dequantize_ref, per_request_references, quantize_e4m3_ref, references

DTYPE = torch.float16 if ON_GPU else torch.float32
BATCH, SEQLEN, NHEADS, NHEADS_K, HEAD_DIM = 2, 24, 4, 2, 32
LENGTHS = [20, 13]  # cached keys per request, for the kvcache and cache-class entry points
NEW = 3  # tokens per kvcache / cache-class step (appended, then attended with the cache)
USED = [17, 9]  # seqused_k of the two packed sequences (of SEQLEN keys each)

# One non-default value per option, in flash-attn's argument names. The window is two-sided and symmetric, so
# that transformers' bidirectional sliding_window can express it too.
OPTIONS = {
    "softmax_scale": lambda: dict(softmax_scale=0.3),
    "causal": lambda: dict(causal=True),
    "window": lambda: dict(window_size=(5, 5)),
    "softcap": lambda: dict(softcap=1.5),
    "alibi": lambda: dict(alibi_slopes=torch.rand(NHEADS, device=DEVICE) * 0.5),
    "sinks": lambda: dict(sinks=torch.randn(NHEADS, device=DEVICE)),
    "seqused_k": lambda: dict(seqused_k=torch.tensor(USED, dtype=torch.int32, device=DEVICE)),
    "kv_fp8": lambda: dict(k_descale=torch.full((BATCH, NHEADS_K), 0.01, device=DEVICE), v_descale=0.02),
    "tree": lambda: dict(causal=True, tree_mask=torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool,
                                                             device=DEVICE).expand(BATCH, NEW, NEW).clone()),
}
FIELDS = {"softmax_scale": "softmax_scale", "causal": "causal", "window_left": "window", "window_right": "window",
          "softcap": "softcap", "alibi": "alibi", "sinks": "sinks", "seqused_k": "seqused_k", "kv_fp8": "kv_fp8",
          "tree": "tree"}

# (entry point, option) -> why the entry point cannot take the option: the test checks it is refused.
NOT_TAKEN = {
    **{(entry, "seqused_k"): "seqused_k counts the keys of packed sequences; a dense batch or a cache has lengths "
                             "of its own (cache_seqlens)"
       for entry in ("prefill", "kvcache_dense", "kvcache_paged", "compiled_kvcache", "kvcache_class", "paged_class",
                     "transformers")},
    **{(entry, "kv_fp8"): "k_descale / v_descale with 16-bit inputs: FP8 keys and values are an FP8 KV cache "
                          "(flash_attn_with_kvcache) or the FP8 forward's e4m3 q, k, v with q_descale too "
                          "(flash_attn_func / flash_attn_varlen_func, tests/test_fp8_prefill.py)"
       for entry in ("prefill", "varlen")},
    **{(entry, "kv_fp8"): "the primitives, the custom ops torch.compile traces, SDPA's op and transformers' "
                          "interface take no FP8 descales"
       for entry in ("primitive", "compiled_prefill", "compiled_kvcache", "sdpa", "transformers")},
    **{(entry, "kv_fp8"): "the cache classes are FP8 by their dtype and own their descales (set at prefill from the "
                          "prompt, tests/test_fp8_kvcache.py), not given per step"
       for entry in ("kvcache_class", "paged_class")},
    **{(entry, "tree"): "a draft tree is a verify step over a KV cache: flash_attn_with_kvcache and the cache "
                        "classes take it (tests/test_speculative.py); under torch.compile it is refused for now"
       for entry in ("prefill", "varlen", "primitive", "compiled_prefill", "compiled_kvcache", "sdpa", "transformers")},
    ("primitive", "sinks"): "flash-attn's _flash_attn_forward has no sinks argument",
    ("sdpa", "softcap"): "aten::_flash_attention_forward has no softcap argument",
    ("sdpa", "sinks"): "aten::_flash_attention_forward has no sinks argument",
    ("transformers", "alibi"): "transformers' attention interface passes no ALiBi slopes",
}


def randn(*shape):
    return torch.randn(*shape, device=DEVICE, dtype=DTYPE)


def _base(kw):
    """Every call states causal, so that the cache classes (causal by default) start from the same place."""
    return {"causal": False, **kw}


# ------------------------------------------------------------------------------------------------
# Entry points: each takes the option's keyword arguments and returns (out, ref_fp32, ref_same_dtype)
# ------------------------------------------------------------------------------------------------
def run_prefill(kw, call=flash_attn_func):
    q, k, v = randn(BATCH, SEQLEN, NHEADS, HEAD_DIM), randn(BATCH, SEQLEN, NHEADS_K, HEAD_DIM), randn(
        BATCH, SEQLEN, NHEADS_K, HEAD_DIM)
    return (call(q, k, v, **kw), *references(q, k, v, **kw)[::2])


def _packed():
    q, k, v = randn(BATCH, SEQLEN, NHEADS, HEAD_DIM), randn(BATCH, SEQLEN, NHEADS_K, HEAD_DIM), randn(
        BATCH, SEQLEN, NHEADS_K, HEAD_DIM)
    cu = torch.arange(0, (BATCH + 1) * SEQLEN, SEQLEN, dtype=torch.int32, device=DEVICE)
    return q, k, v, cu


def _packed_reference(q, k, v, kw):
    """Each sequence alone (its first seqused_k keys with seqused_k), packed back."""
    kw = dict(kw)
    used = kw.pop("seqused_k", None)
    outs32, outs_same = [], []
    for b in range(BATCH):
        n = SEQLEN if used is None else USED[b]
        ref32, _, same = references(q[b: b + 1], k[b: b + 1, :n], v[b: b + 1, :n], **kw)
        outs32.append(ref32[0])
        outs_same.append(same[0])
    return torch.cat(outs32), torch.cat(outs_same)


def run_varlen(kw, call=flash_attn_varlen_func):
    q, k, v, cu = _packed()
    out = call(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu, cu, SEQLEN, SEQLEN, **kw)
    return (out, *_packed_reference(q, k, v, kw))


def _cache_inputs():
    capacity = max(LENGTHS) + NEW + 5
    k_cache, v_cache = randn(BATCH, capacity, NHEADS_K, HEAD_DIM), randn(BATCH, capacity, NHEADS_K, HEAD_DIM)
    q, k, v = randn(BATCH, NEW, NHEADS, HEAD_DIM), randn(BATCH, NEW, NHEADS_K, HEAD_DIM), randn(
        BATCH, NEW, NHEADS_K, HEAD_DIM)
    return q, k_cache, v_cache, k, v


def run_kvcache(kw, paged=False, call=flash_attn_with_kvcache):
    q, k_cache, v_cache, k, v = _cache_inputs()
    if "k_descale" in kw:  # an FP8 cache: 16-bit q and new rows, the reference over the dequantized values
        kd, vd = kw["k_descale"], kw["v_descale"]
        q, k, v = q.half(), k.half(), v.half()
        k_cache, v_cache = quantize_e4m3_ref(k_cache, kd), quantize_e4m3_ref(v_cache, vd)
        ref_k, ref_v = (dequantize_ref(quantize_e4m3_ref(t, d), d, q.dtype) for t, d in ((k, kd), (v, vd)))
        ref_kw = {name: value for name, value in kw.items() if not name.endswith("_descale")}
        ref32, _, same = per_request_references(q, dequantize_ref(k_cache, kd, q.dtype),
                                                dequantize_ref(v_cache, vd, q.dtype), ref_k, ref_v, LENGTHS, **ref_kw)
    else:
        ref32, _, same = per_request_references(q, k_cache, v_cache, k, v, LENGTHS, **kw)
    lengths = torch.tensor(LENGTHS, dtype=torch.int32, device=DEVICE)
    if not paged:
        return call(q, k_cache, v_cache, k, v, cache_seqlens=lengths, **kw), ref32, same
    page = 8  # the dense caches as pools of pages, each request's pages scattered in reverse order
    pages_per = k_cache.shape[1] // page
    k_pool = k_cache[:, : pages_per * page].reshape(BATCH * pages_per, page, NHEADS_K, HEAD_DIM).flip(0).contiguous()
    v_pool = v_cache[:, : pages_per * page].reshape(BATCH * pages_per, page, NHEADS_K, HEAD_DIM).flip(0).contiguous()
    table = (BATCH * pages_per - 1 - torch.arange(BATCH * pages_per, device=DEVICE)).view(BATCH, pages_per)
    out = call(q, k_pool, v_pool, k, v, cache_seqlens=lengths, block_table=table.to(torch.int32), **kw)
    return out, ref32, same


def run_primitive(kw):
    if "seqused_k" in kw:  # the varlen primitive is the one that takes it (None: the same path without)
        def varlen(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None, causal=False, seqused_k=None):
            return _flash_attn_varlen_forward(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, softmax_scale, causal,
                                              seqused_k=seqused_k)[0]
        return run_varlen(kw, varlen)

    def dense(q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
              **rest):
        return _flash_attn_forward(q, k, v, 0.0, softmax_scale, causal, window_size[0], window_size[1], softcap,
                                   alibi_slopes, **rest)[0]
    return run_prefill(kw, dense)


def _compiled(fn):
    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True, backend="eager")


def run_compiled_prefill(kw):
    if "seqused_k" in kw:
        return run_varlen(kw, _compiled(lambda *a, **k: flash_attn_varlen_func(*a, **k)))
    return run_prefill(kw, _compiled(lambda *a, **k: flash_attn_func(*a, **k)))


def run_compiled_kvcache(kw):
    return run_kvcache(kw, call=_compiled(lambda *a, **k: flash_attn_with_kvcache(*a, **k)))


def run_kvcache_class(kw, paged=False):
    """A prefill of LENGTHS[b] tokens per request (the options' own), then one step of NEW tokens with them: the
    step is checked against each request's whole history."""
    q_all, k_all, v_all = (randn(BATCH, max(LENGTHS) + NEW, h, HEAD_DIM) for h in (NHEADS, NHEADS_K, NHEADS_K))
    pre = {name: value for name, value in kw.items() if not name.startswith("tree_")}  # prompts: no tree
    if paged:
        cache = PagedKVCache(64, 8, NHEADS_K, HEAD_DIM, max_batch=BATCH, max_blocks_per_seq=8, dtype=DTYPE,
                             device=DEVICE)
        slots = [cache.add_request() for _ in range(BATCH)]
        for b, n in enumerate(LENGTHS):
            cache.prefill(q_all[b: b + 1, :n], k_all[b: b + 1, :n], v_all[b: b + 1, :n], slots=[slots[b]], **pre)
    else:
        cache = KVCache(BATCH, max(LENGTHS) + NEW + 5, NHEADS_K, HEAD_DIM, dtype=DTYPE, device=DEVICE)
        for b, n in enumerate(LENGTHS):
            cache.prefill(q_all[b: b + 1, :n], k_all[b: b + 1, :n], v_all[b: b + 1, :n], batch_idx=[b], **pre)
    steps = [torch.stack([t[b, n: n + NEW] for b, n in enumerate(LENGTHS)]) for t in (q_all, k_all, v_all)]
    out = cache.decode(*steps, **kw)
    k_hist = torch.zeros(BATCH, max(LENGTHS), NHEADS_K, HEAD_DIM, device=DEVICE, dtype=DTYPE)
    v_hist = torch.zeros_like(k_hist)
    for b, n in enumerate(LENGTHS):
        k_hist[b, :n], v_hist[b, :n] = k_all[b, :n], v_all[b, :n]
    ref32, _, same = per_request_references(steps[0], k_hist, v_hist, steps[1], steps[2], LENGTHS, **kw)
    return out, ref32, same


def run_sdpa(kw):
    """aten::_flash_attention_forward (SDPA's varlen flash op) with our provider active."""
    import torch.nn.attention as attn

    q, k, v, cu = _packed()
    aten = {"scale" if name == "softmax_scale" else name: value for name, value in kw.items() if name != "causal"}
    if "window_size" in aten:
        aten["window_size_left"], aten["window_size_right"] = aten.pop("window_size")
    attn.activate_flash_attention_impl("tritonattn")
    try:  # an option aten's op has no argument for (softcap, sinks) is passed as is: the op refuses it
        out = torch.ops.aten._flash_attention_forward(
            q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu, cu, SEQLEN, SEQLEN, 0.0, kw["causal"], False,
            **aten)[0]
    finally:
        attn.restore_flash_attention_impl()
    return (out, *_packed_reference(q, k, v, kw))


def run_transformers(kw):
    from tritonattn.integrations.transformers import attention_forward

    q, k, v = randn(BATCH, SEQLEN, NHEADS, HEAD_DIM), randn(BATCH, SEQLEN, NHEADS_K, HEAD_DIM), randn(
        BATCH, SEQLEN, NHEADS_K, HEAD_DIM)
    window = kw.get("window_size")
    assert window is None or window[0] == window[1], "transformers' bidirectional window is symmetric"
    module = torch.nn.Module()
    out, _ = attention_forward(module, *(t.transpose(1, 2) for t in (q, k, v)), None, scaling=kw.get("softmax_scale"),
                               sliding_window=None if window is None else window[0], softcap=kw.get("softcap"),
                               is_causal=kw["causal"], s_aux=kw.get("sinks"))
    return (out, *references(q, k, v, **kw)[::2])


ENTRIES = {
    "prefill": run_prefill,
    "varlen": run_varlen,
    "kvcache_dense": run_kvcache,
    "kvcache_paged": lambda kw: run_kvcache(kw, paged=True),
    "primitive": run_primitive,
    "compiled_prefill": run_compiled_prefill,
    "compiled_kvcache": run_compiled_kvcache,
    "kvcache_class": run_kvcache_class,
    "paged_class": lambda kw: run_kvcache_class(kw, paged=True),
    "sdpa": run_sdpa,
    "transformers": run_transformers,
}


def test_every_option_is_listed():
    """OPTIONS covers every field of AttnOptions but the head dim (a shape): a new option is checked everywhere."""
    fields = {f.name for f in dataclasses.fields(AttnOptions)} - {"head_dim"}
    assert fields == set(FIELDS) and set(FIELDS.values()) == set(OPTIONS)
    assert all(option in OPTIONS and entry in ENTRIES for entry, option in NOT_TAKEN)


def _skip_unavailable(entry: str) -> None:
    if entry == "sdpa":
        from tritonattn.compile import sdpa

        if not (ON_GPU and sdpa.available()):
            pytest.skip("the SDPA provider registers CUDA kernels: needs a GPU and torch >= 2.10")
    if entry == "transformers":
        pytest.importorskip("transformers")


@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("entry", list(ENTRIES))
def test_option_reaches_entry_point(entry, option):
    """The option's non-default value gives the reference's result, and another result than without it."""
    if (entry, option) in NOT_TAKEN:
        pytest.skip(f"not taken: {NOT_TAKEN[entry, option]} (test_untaken_options_are_refused checks it)")
    _skip_unavailable(entry)
    torch.manual_seed(0)
    kw = _base(OPTIONS[option]())
    out, ref32, same = ENTRIES[entry](kw)
    assert_close_to_ref(out, ref32, same, msg=f"{entry} with {option}")
    torch.manual_seed(0)
    plain, _, _ = ENTRIES[entry](_base({"seqused_k": None} if option == "seqused_k" else {}))  # the same path
    assert rel_err(out.float(), plain.float()) > 1e-3, f"{entry}: {option} changed nothing"


@pytest.mark.parametrize("entry, option", sorted(NOT_TAKEN))
def test_untaken_options_are_refused(entry, option):
    """An entry point without a way to take an option refuses it (an unexpected argument), never ignores it;
    transformers' hook takes **kwargs from the model, which never carries the option, so it has no caller."""
    _skip_unavailable(entry)
    if entry == "transformers":
        pytest.skip(NOT_TAKEN[entry, option])
    torch.manual_seed(0)
    with pytest.raises((TypeError, RuntimeError)):
        ENTRIES[entry](_base(OPTIONS[option]()))
