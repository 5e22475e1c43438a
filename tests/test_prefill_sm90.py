"""Hopper's warp-specialized forward (kernels/tritonattn/jit/sm90.py) and the rule that chooses it.

The kernel itself (GPU of capability 9.x with Triton 3.6 only; Gluon does not run under the interpreter) is
launched directly, whatever the rule would choose, on shapes that reach every path: ragged row and key
tails, more queries than keys and fewer (rows that see no key), GQA and MQA, one key block and many, and
each variant (window, softcap, ALiBi, sinks), against tritonattn.attention_ref with the suite's error rule. The
rule is checked without a GPU, for the cards users bring.
"""

from __future__ import annotations

import pytest
import torch

import cross_compile
from helpers import ON_GPU, assert_close_to_ref, assert_lse_close, make_qkv, paged_copy
from tritonattn import flash_attn_func
from tritonattn.api.args import attention_call
from tritonattn.config.hardware import TARGETS
from tritonattn.config.options import attn_options
from tritonattn.config.tables import SM90_WS_MIN_KEYS, gluon_sm90_available, prefill_fwd_sm90_config
from tritonattn.launch.fast import recording
from tritonattn.launch.operands import ensure_tma_allocator
from tritonattn.testing import attention_ref

HOPPER = ON_GPU and torch.cuda.get_device_capability()[0] == 9 and gluon_sm90_available()
needs_hopper = pytest.mark.skipif(not HOPPER, reason="Gluon's Hopper kernel: a 9.x GPU, a Gluon with its API")

SHAPES = [  # batch, seqlen_q, seqlen_k, nheads, nheads_k
    (2, 1000, 1000, 8, 2),  # ragged tails of both
    (1, 300, 1000, 4, 4),  # fewer queries than keys: the diagonal moves right
    (1, 1000, 300, 4, 1),  # more queries than keys: causal rows that see no key; MQA
    (3, 64, 64, 4, 2),  # one key block, half a query block
    (1, 1, 5, 4, 2),
    (1, 2048, 2048, 4, 2),  # many blocks: the K/V rings wrap
]
VARIANTS = {
    "plain": {},
    "window": dict(window_size=(100, 3)),
    "softcap": dict(softcap=30.0),
    "alibi": dict(alibi_slopes=True),
    "sinks": dict(sinks=True),
}


def _run_sm90(q, k, v, causal, **kw):
    """The Hopper kernel on (q, k, v): (out, lse), with the public function's variant handling."""
    import tritonattn.launch.sm90 as sm90

    batch, seqlen_q, nheads, head_dim = q.shape
    call = attention_call(head_dim, None, causal, kw.get("window_size", (-1, -1)), kw.get("softcap", 0.0),
                          kw.get("alibi_slopes"), kw.get("sinks"), seqlen_k=k.shape[1], batch=batch, nheads=nheads,
                          device=q.device)
    options, variants = call.options, call.tensors
    out = torch.empty_like(q)
    lse = torch.empty((batch, nheads, seqlen_q), dtype=torch.float32, device=q.device)
    ensure_tma_allocator()
    sm90.forward(q, k, v, out, lse, options, prefill_sm90_config(), variants)
    return out, lse


def prefill_sm90_config():
    target = TARGETS["H100"]
    return prefill_fwd_sm90_config(attn_options(128, None, False), torch.bfloat16, 1 << 20, target)


@needs_hopper
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "b{}-m{}-n{}-h{}:{}".format(*s))
def test_sm90_forward_matches_reference(shape, dtype, causal, variant):
    batch, seqlen_q, seqlen_k, nheads, nheads_k = shape
    q, k, v = make_qkv(batch, seqlen_q, seqlen_k, nheads, nheads_k, 128, dtype, seed=7)
    kw = dict(VARIANTS[variant])
    if kw.pop("alibi_slopes", False):
        kw["alibi_slopes"] = torch.rand(nheads, device=q.device) * 0.3
    if kw.pop("sinks", False):
        kw["sinks"] = torch.randn(nheads, device=q.device)
    out, lse = _run_sm90(q, k, v, causal, **kw)
    ref, ref_lse = attention_ref(q.float(), k.float(), v.float(), causal=causal, **kw)
    same, _ = attention_ref(q, k, v, causal=causal, upcast=False, **kw)
    assert_close_to_ref(out, ref.float(), same, msg=variant)
    assert_lse_close(lse, ref_lse, dtype, msg=variant)


# packed sequences (seqlen_q, seqlen_k) each: ragged tails, an empty sequence, more queries than keys, several blocks
VARLEN_SEQUENCES = [(300, 300), (0, 5), (1000, 1200), (2100, 2100), (64, 40), (129, 700)]


def _run_sm90_varlen(q, k, v, cu_q, cu_k, causal, **kw):
    """The Hopper kernel on packed (total, heads, D) tensors: (out, lse (nheads, total_q))."""
    import tritonattn.launch.sm90 as sm90

    lens_q, lens_k = (cu[1:] - cu[:-1] for cu in (cu_q, cu_k))
    call = attention_call(q.shape[-1], None, causal, kw.get("window_size", (-1, -1)), kw.get("softcap", 0.0),
                          kw.get("alibi_slopes"), kw.get("sinks"), kw.get("seqused_k"), seqlen_k=int(lens_k.max()),
                          batch=cu_q.numel() - 1, nheads=q.shape[1], device=q.device)
    out = torch.empty_like(q)
    lse = torch.empty((q.shape[1], q.shape[0]), dtype=torch.float32, device=q.device)
    ensure_tma_allocator()
    sm90.forward(q, k, v, out, lse, call.options, prefill_sm90_config(), call.tensors,
                 varlen=(cu_q, cu_k, int(lens_q.max()), int(lens_k.max())))
    return out, lse


@needs_hopper
@pytest.mark.parametrize("variant", ["plain", "window", "softcap", "alibi", "sinks", "seqused_k"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("heads", [(8, 8), (8, 2)], ids=["mha", "gqa"])
def test_sm90_varlen_matches_each_sequence_alone(heads, dtype, causal, variant):
    """Packed sequences through the Hopper kernel: each sequence's rows (and LSE) agree with the reference on
    that sequence alone, and no row outside a sequence's span is written by another's programs."""
    nheads, nheads_k = heads
    lens_q = [m for m, _ in VARLEN_SEQUENCES]
    lens_k = [n for _, n in VARLEN_SEQUENCES]
    cu_q = torch.tensor([0] + lens_q, device="cuda").cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + lens_k, device="cuda").cumsum(0).to(torch.int32)
    torch.manual_seed(3)
    q = torch.randn(sum(lens_q), nheads, 128, device="cuda", dtype=dtype)
    k, v = (torch.randn(sum(lens_k), nheads_k, 128, device="cuda", dtype=dtype) for _ in range(2))
    kw = dict(VARIANTS.get(variant, {}))
    if kw.pop("alibi_slopes", False):
        kw["alibi_slopes"] = torch.rand(len(lens_q), nheads, device="cuda") * 0.3
    if kw.pop("sinks", False):
        kw["sinks"] = torch.randn(nheads, device="cuda")
    used = None
    if variant == "seqused_k":  # each sequence's first keys only (flash-attn's seqused_k)
        used = [max(n - 37, 0) for n in lens_k]
        kw["seqused_k"] = torch.tensor(used, dtype=torch.int32, device="cuda")
    out, lse = _run_sm90_varlen(q, k, v, cu_q, cu_k, causal, **kw)
    for b, (m, n) in enumerate(VARLEN_SEQUENCES):
        if m == 0:
            continue
        rows, keys = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b]) + (used or lens_k)[b])
        one = {name: value for name, value in kw.items() if name != "seqused_k"}
        if "alibi_slopes" in one:
            one["alibi_slopes"] = one["alibi_slopes"][b]
        qb, kb, vb = q[None, rows], k[None, keys], v[None, keys]
        ref, ref_lse = attention_ref(qb.float(), kb.float(), vb.float(), causal=causal, **one)
        same, _ = attention_ref(qb, kb, vb, causal=causal, upcast=False, **one)
        assert_close_to_ref(out[None, rows], ref.float(), same, msg=f"{variant} sequence {b}")
        assert_lse_close(lse[None, :, rows], ref_lse, dtype, msg=f"{variant} sequence {b}")


@pytest.mark.skipif(not gluon_sm90_available(), reason="this Triton's Gluon lacks the Hopper API the kernel uses")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_sm90_varlen_launch_compiles_for_hopper(causal):
    """Without a GPU: the packed launch, planned for an H100, compiles for sm_90 within its shared memory, and
    an e4m3 packed launch is refused before any launch."""
    dev = "cuda" if ON_GPU else "cpu"
    q = torch.empty(3000, 8, 128, dtype=torch.bfloat16, device=dev)
    k = torch.empty(3000, 2, 128, dtype=torch.bfloat16, device=dev)
    cu = torch.tensor([0, 1000, 3000], dtype=torch.int32, device=dev)
    with recording(TARGETS["H100"]) as launched:
        _run_sm90_varlen(q, k, k, cu, cu, causal)
    (record,) = launched
    spec = cross_compile.spec_of(record, 90)
    assert spec["name"] == "fwd_kernel_sm90_ws" and spec["constexprs"]["IS_VARLEN"] is True
    assert record.grid == (2000 // 128 + 1, 2 * 8, 1)
    (result,) = cross_compile.shared_bytes([spec])
    assert "error" not in result, result["error"][:2000]
    assert result["shared"] <= TARGETS["H100"].smem_per_block
    e4m3 = q.to(torch.float8_e4m3fn) if ON_GPU else torch.empty(3000, 8, 128, dtype=torch.float8_e4m3fn)
    with recording(TARGETS["H100"]) as launched, pytest.raises(ValueError, match="packed sequences in fp16 / bf16"):
        _run_sm90_varlen(e4m3, e4m3[:, :2], e4m3[:, :2], cu, cu, causal)
    assert launched == []


@needs_hopper
@pytest.mark.parametrize("variant", ["plain", "softcap", "alibi", "sinks"])
@pytest.mark.parametrize("page_size", [None, 256, 128], ids=["dense", "page256", "page128"])
@pytest.mark.parametrize("append", [False, True], ids=["cached", "append"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_chunked_prefill_takes_the_hopper_kernel_past_stale_rows(dtype, causal, append, page_size, variant,
                                                                  monkeypatch):
    """flash_attn_with_kvcache's chunked prefill runs the Hopper kernel over a dense cache or a paged pool (page
    size a multiple of its key block; `paged_copy`'s shuffled table) and matches the reference per request,
    though every cache row past a request's keys is NaN: a dense cache's descriptors stop at its keys, and a
    pool's last page (partly filled here: lengths that are not multiples of 128) is read through a descriptor
    of its valid rows."""
    import tritonattn.launch.sm90 as sm90
    from tritonattn import flash_attn_with_kvcache
    from tritonattn.testing import per_request_references

    batch, chunk, capacity, nheads, nheads_k = 3, 512, 3072, 16, 4  # a grid that fills the SMs: the prefill path
    lengths = [0, 1000, capacity - chunk - 37]
    torch.manual_seed(4)
    q = torch.randn(batch, chunk, nheads, 128, device="cuda", dtype=dtype)
    k_cache, v_cache = (torch.randn(batch, capacity, nheads_k, 128, device="cuda", dtype=dtype) for _ in range(2))
    k, v = (torch.randn(batch, chunk, nheads_k, 128, device="cuda", dtype=dtype) if append else None for _ in range(2))
    kw = dict(VARIANTS[variant])
    if kw.pop("alibi_slopes", False):
        kw["alibi_slopes"] = torch.rand(batch, nheads, device="cuda") * 0.3
    if kw.pop("sinks", False):
        kw["sinks"] = torch.randn(nheads, device="cuda")
    ref, ref_lse, same = per_request_references(q, k_cache, v_cache, k, v, lengths, causal=causal, **kw)
    for b, n in enumerate(lengths):  # rows the call must not read (past the appended keys too)
        k_cache[b, n + (chunk if append else 0):] = float("nan")
        v_cache[b, n + (chunk if append else 0):] = float("nan")
    table = None
    if page_size is not None:
        k_cache, v_cache, table = paged_copy(k_cache, v_cache, page_size)
    calls = []
    monkeypatch.setattr(sm90, "forward", lambda *a, _f=sm90.forward: calls.append(1) or _f(*a))
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens, block_table=table,
                                       causal=causal, return_softmax_lse=True, **kw)
    assert calls == [1], "the call did not take the Hopper kernel"
    assert torch.isfinite(out).all(), "a stale row reached the output"
    assert_close_to_ref(out, ref, same, msg=variant)
    assert_lse_close(lse, ref_lse, dtype, msg=variant)


@pytest.mark.skipif(not gluon_sm90_available(), reason="this Triton's Gluon lacks the Hopper API the kernel uses")
@pytest.mark.parametrize("page_size", [None, 256], ids=["dense", "paged"])
@pytest.mark.parametrize("append", [False, True], ids=["cached", "append"])
def test_sm90_cache_launch_compiles_for_hopper(append, page_size):
    """Without a GPU: chunked prefill planned for an H100 records the Hopper kernel in its cache mode, which
    compiles for sm_90 within its shared memory; a window, left padding, an FP8 cache or pages smaller than
    its key block keep the portable kernel."""
    from tritonattn.launch.prefill import launch_cache_prefill

    dev = "cuda" if ON_GPU else "cpu"
    batch, chunk, capacity = 2, 1024, 4096
    q = torch.empty(batch, chunk, 8, 128, dtype=torch.bfloat16, device=dev)
    if page_size is None:
        k = torch.empty(batch, capacity, 2, 128, dtype=torch.bfloat16, device=dev)
        table = None
    else:
        k = torch.empty(batch * capacity // page_size, page_size, 2, 128, dtype=torch.bfloat16, device=dev)
        table = torch.arange(batch * capacity // page_size, dtype=torch.int32, device=dev).view(batch, -1)
    lens = torch.full((batch,), 1000, dtype=torch.int32, device=dev)

    def kernels_of(options, **kw):
        with recording(TARGETS["H100"]) as records:
            launch_cache_prefill(q, k, k, lens, chunk if append else 0, table, options, **kw)
        return records

    (record,) = kernels_of(attn_options(128, None, True))
    spec = cross_compile.spec_of(record, 90)
    assert spec["name"] == "fwd_kernel_sm90_ws" and spec["constexprs"]["IS_KVCACHE"] is True
    assert spec["constexprs"]["PAGED"] is (page_size is not None) and spec["constexprs"]["KV_APPEND"] is append
    (result,) = cross_compile.shared_bytes([spec])
    assert "error" not in result, result["error"][:2000]
    assert result["shared"] <= TARGETS["H100"].smem_per_block
    portable = [kernels_of(attn_options(128, None, True, (256, 0))),
                kernels_of(attn_options(128, None, True), cache_leftpad=torch.zeros_like(lens))]
    assert all(getattr(r.fn, "fn", r.fn).__name__ == "fwd_kernel" for records in portable for r in records)
    if page_size is not None:
        small, small_table = k.view(-1, 64, 2, 128), table.repeat_interleave(4, 1) * 4  # pages of 64 keys
        with recording(TARGETS["H100"]) as records:
            launch_cache_prefill(q, small, small, lens, 0, small_table, attn_options(128, None, True))
        assert [getattr(r.fn, "fn", r.fn).__name__ for r in records] == ["fwd_kernel"]


@needs_hopper
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_public_function_takes_the_hopper_kernel_and_agrees(causal, monkeypatch):
    """flash_attn_func runs the Hopper kernel where the rule says so (TRITONATTN_SM90=0 switches it off), and
    both kernels agree within the error rule."""
    import tritonattn.launch.sm90 as sm90

    q, k, v = make_qkv(1, 2048, 2048, 8, 2, 128, torch.bfloat16, seed=1)
    calls = []
    monkeypatch.setattr(sm90, "forward", lambda *a, _f=sm90.forward: calls.append(1) or _f(*a))
    out = flash_attn_func(q, k, v, causal=causal)
    assert calls == [1]
    monkeypatch.setenv("TRITONATTN_SM90", "0")
    portable = flash_attn_func(q, k, v, causal=causal)
    assert calls == [1]
    ref, _ = attention_ref(q.float(), k.float(), v.float(), causal=causal)
    same, _ = attention_ref(q, k, v, causal=causal, upcast=False)
    assert_close_to_ref(out, ref.float(), same)
    assert_close_to_ref(portable, ref.float(), same)


@needs_hopper
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_packed_public_function_takes_the_hopper_kernel_and_agrees(causal, monkeypatch):
    """flash_attn_varlen_func runs the Hopper kernel where the rule says so (TRITONATTN_SM90=0 switches it off),
    and both kernels agree within the error rule on every sequence."""
    import tritonattn.launch.sm90 as sm90
    from tritonattn import flash_attn_varlen_func

    lens = [2048, 700, 1500]
    cu = torch.tensor([0] + lens, device="cuda").cumsum(0).to(torch.int32)
    q, k, v = (t[0] for t in make_qkv(1, sum(lens), sum(lens), 8, 2, 128, torch.bfloat16, seed=2))
    calls = []
    monkeypatch.setattr(sm90, "forward", lambda *a, _f=sm90.forward: calls.append(1) or _f(*a))
    out = flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=causal)
    assert calls == [1]
    monkeypatch.setenv("TRITONATTN_SM90", "0")
    portable = flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=causal)
    assert calls == [1]
    for b in range(len(lens)):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        qb, kb, vb = q[None, rows], k[None, rows], v[None, rows]
        ref, _ = attention_ref(qb.float(), kb.float(), vb.float(), causal=causal)
        same, _ = attention_ref(qb, kb, vb, causal=causal, upcast=False)
        assert_close_to_ref(out[None, rows], ref.float(), same, msg=f"sequence {b}")
        assert_close_to_ref(portable[None, rows], ref.float(), same, msg=f"sequence {b}")


def test_rule_picks_hopper_dense_head_dim_128_long_rows():
    h100 = TARGETS["H100"]
    full, causal = attn_options(128, None, False), attn_options(128, None, True)
    expected = gluon_sm90_available()
    assert (prefill_fwd_sm90_config(full, torch.bfloat16, 4096, h100) is not None) == expected
    assert (prefill_fwd_sm90_config(causal, torch.float16, SM90_WS_MIN_KEYS[True], h100) is not None) == expected
    assert prefill_fwd_sm90_config(causal, torch.bfloat16, SM90_WS_MIN_KEYS[True] - 1, h100) is None
    assert prefill_fwd_sm90_config(full, torch.bfloat16, SM90_WS_MIN_KEYS[False] - 1, h100) is None
    assert prefill_fwd_sm90_config(full, torch.float32, 4096, h100) is None
    assert prefill_fwd_sm90_config(attn_options(64, None, False), torch.bfloat16, 4096, h100) is None
    assert prefill_fwd_sm90_config(attn_options(256, None, False), torch.bfloat16, 4096, h100) is None
    for card in ("A100", "L4", "T4"):
        assert prefill_fwd_sm90_config(full, torch.bfloat16, 4096, TARGETS[card]) is None
    assert prefill_fwd_sm90_config(full, torch.bfloat16, 4096, None) is None  # the interpreter
    # chunked prefill over a cache (capacity as the key count): 16-bit, no window, no FP8 cache
    assert (prefill_fwd_sm90_config(causal, torch.bfloat16, 4096, h100, cache=True) is not None) == expected
    assert prefill_fwd_sm90_config(attn_options(128, None, True, (256, 0)), torch.bfloat16, 4096, h100, True) is None
    assert prefill_fwd_sm90_config(attn_options(128, None, True, kv_fp8=True), torch.bfloat16, 4096, h100, True) is None
    assert prefill_fwd_sm90_config(causal, torch.float8_e4m3fn, 4096, h100, cache=True) is None


@pytest.mark.skipif(not gluon_sm90_available(), reason="this Triton's Gluon lacks the Hopper API the kernel uses")
def test_dense_and_packed_calls_without_dropout_reach_the_hopper_kernel():
    """Planned for an H100: a long dense or packed 16-bit call records the Hopper kernel; short keys, dropout
    and a short KV-cache call (the decode kernel's) record the portable ones."""
    from tritonattn import flash_attn_varlen_func, flash_attn_with_kvcache

    def kernels_of(fn):
        with recording(TARGETS["H100"]) as records:
            fn()
        return {getattr(r.fn, "fn", r.fn).__name__ for r in records}

    dev = "cuda" if ON_GPU else "cpu"
    q = torch.empty(1, 2048, 4, 128, dtype=torch.float16, device=dev)
    k = torch.empty(1, 2048, 2, 128, dtype=torch.float16, device=dev)
    assert kernels_of(lambda: flash_attn_func(q, k, k, causal=True)) == {"fwd_kernel_sm90_ws"}
    assert kernels_of(lambda: flash_attn_func(q[:, :1024], k[:, :1024], k[:, :1024], causal=True)) == {"fwd_kernel"}
    dropout = kernels_of(lambda: flash_attn_func(q, k, k, 0.1, causal=True))
    assert "fwd_kernel" in dropout and "fwd_kernel_sm90_ws" not in dropout
    cu = torch.tensor([0, 2048], dtype=torch.int32, device=dev)
    assert kernels_of(lambda: flash_attn_varlen_func(q[0], k[0], k[0], cu, cu, 2048, 2048,
                                                     causal=True)) == {"fwd_kernel_sm90_ws"}
    short = torch.tensor([0, 1024], dtype=torch.int32, device=dev)
    assert kernels_of(lambda: flash_attn_varlen_func(q[0, :1024], k[0, :1024], k[0, :1024], short, short, 1024, 1024,
                                                     causal=True)) == {"fwd_kernel"}
    packed_dropout = kernels_of(lambda: flash_attn_varlen_func(q[0], k[0], k[0], cu, cu, 2048, 2048, 0.1))
    assert "fwd_kernel" in packed_dropout and "fwd_kernel_sm90_ws" not in packed_dropout
    lens = torch.full((1,), 2048, dtype=torch.int32, device=dev)
    assert "fwd_kernel_sm90_ws" not in kernels_of(lambda: flash_attn_with_kvcache(q, k, k, cache_seqlens=lens))


# --------------------------------------------------------------------------------------------
# The fused backward (jit/sm90_bwd.py): launched directly, then through the dispatcher
# --------------------------------------------------------------------------------------------
def _run_sm90_backward(q, k, v, dout, causal, deterministic=False):
    """The fused backward on (q, k, v) and dout, the forward's out and lse from the public function: (dq, dk, dv)
    in q's dtype, dq cast from the float32 accumulation."""
    import tritonattn.launch.sm90 as sm90
    from tritonattn.config.tables import SM90_WS_BWD

    out, lse, _ = flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    options = attn_options(q.shape[-1], None, causal)
    delta = (out.float() * dout.float()).sum(-1).transpose(1, 2).contiguous()  # rowsum(dO * O): (B, H, M)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    ensure_tma_allocator()
    dq = sm90.backward(dout, q, k, v, lse, delta, dk, dv, options, SM90_WS_BWD, deterministic)
    return dq.to(q.dtype), dk, dv


BWD_SHAPES = [  # batch, seqlen_q, seqlen_k, nheads, nheads_k
    (2, 1000, 1000, 4, 2),  # ragged tails of both
    (1, 300, 1000, 4, 4),  # fewer queries than keys
    (1, 1000, 300, 4, 1),  # more queries than keys: causal rows that see no key; MQA
    (1, 2048, 2048, 8, 2),  # many blocks
]


@needs_hopper
@pytest.mark.parametrize("shape", BWD_SHAPES, ids=[f"{s[1]}x{s[2]}h{s[3]}k{s[4]}" for s in BWD_SHAPES])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("deterministic", [False, True], ids=["any-order", "ordered"])
def test_sm90_backward_matches_reference(deterministic, dtype, causal, shape):
    """dQ, dK and dV of the fused backward against the fp32 reference's gradients, within the suite's rule
    (a multiple of the same-dtype reference's own error plus its floor); ordered, dQ twice bit for bit."""
    batch, seqlen_q, seqlen_k, nheads, nheads_k = shape
    q, k, v = make_qkv(batch, seqlen_q, seqlen_k, nheads, nheads_k, 128, dtype, seed=5)
    dout = torch.randn(q.shape, device=q.device, dtype=torch.float32).to(dtype)
    grads = _run_sm90_backward(q, k, v, dout, causal, deterministic)
    if deterministic:
        assert torch.equal(grads[0], _run_sm90_backward(q, k, v, dout, causal, True)[0])
    refs = []
    for upcast in (True, False):  # autograd through the fp32 reference, and through the same-dtype one
        leaves = [(t.float() if upcast else t).detach().clone().requires_grad_() for t in (q, k, v)]
        out = attention_ref(*leaves, causal=causal, upcast=upcast)[0]
        refs.append(torch.autograd.grad(out, leaves, dout.float() if upcast else dout))
    for name, got, ref, same in zip(("dq", "dk", "dv"), grads, *refs):
        assert got.shape == ref.shape and torch.isfinite(got).all(), name
        assert_close_to_ref(got, ref, same, grad=True, msg=name)


@pytest.mark.skipif(not gluon_sm90_available(), reason="this Triton's Gluon lacks the Hopper API the kernel uses")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("deterministic", [False, True], ids=["any-order", "ordered"])
def test_sm90_backward_compiles_for_hopper(causal, deterministic):
    """Without a GPU: the fused backward's launch, planned for an H100, compiles for sm_90 within its shared
    memory."""
    import tritonattn.launch.sm90 as sm90
    from tritonattn.config.tables import SM90_WS_BWD

    dev = "cuda" if ON_GPU else "cpu"
    q = torch.empty(2, 1000, 8, 128, dtype=torch.bfloat16, device=dev)
    k = torch.empty(2, 1000, 2, 128, dtype=torch.bfloat16, device=dev)
    lse = torch.empty(2, 8, 1000, dtype=torch.float32, device=dev)
    with recording(TARGETS["H100"]) as launched:
        sm90.backward(q, q, k, k, lse, lse, torch.empty_like(k), torch.empty_like(k), attn_options(128, None, causal),
                      SM90_WS_BWD, deterministic)
    (record,) = launched
    assert record.grid == (1000 // 128 + 1, 2 * 2, 1)
    spec = cross_compile.spec_of(record, 90)
    assert spec["name"] == "bwd_kernel_sm90_ws"
    (result,) = cross_compile.shared_bytes([spec])
    assert "error" not in result, result["error"][:3000]
    assert result["shared"] <= TARGETS["H100"].smem_per_block


def test_backward_rule_picks_the_fused_kernel(monkeypatch):
    """Planned for an H100 with TRITONATTN_SM90_BWD=1: a dense 16-bit backward at head dim 128 without variants or
    dropout records the fused kernel, `deterministic=True` too (its ordered form); a variant, dropout, another head
    dim or card, and short keys record the portable ones. Without the opt-in, or with TRITONATTN_SM90=0, none
    does."""
    from tritonattn.config.options import Dropout
    from tritonattn.config.tables import SM90_WS_BWD_MIN_KEYS, prefill_bwd_sm90_config
    from tritonattn.launch.backward import launch_backward

    h100 = TARGETS["H100"]
    full, causal = attn_options(128, None, False), attn_options(128, None, True)
    monkeypatch.delenv("TRITONATTN_SM90_BWD", raising=False)
    assert prefill_bwd_sm90_config(causal, torch.bfloat16, 4096, h100) is None
    monkeypatch.setenv("TRITONATTN_SM90_BWD", "1")
    monkeypatch.setenv("TRITONATTN_SM90", "0")
    assert prefill_bwd_sm90_config(causal, torch.bfloat16, 4096, h100) is None
    monkeypatch.delenv("TRITONATTN_SM90")
    expected = gluon_sm90_available()
    for options in (full, causal):
        keys = SM90_WS_BWD_MIN_KEYS[options.causal]
        assert (prefill_bwd_sm90_config(options, torch.bfloat16, keys, h100) is not None) == expected
        assert prefill_bwd_sm90_config(options, torch.bfloat16, keys - 1, h100) is None
    for options in (attn_options(128, None, True, (256, 0)), attn_options(128, None, True, softcap=30.0),
                    attn_options(128, None, True, alibi=True), attn_options(128, None, True, sinks=True),
                    attn_options(64, None, True), attn_options(256, None, True)):
        assert prefill_bwd_sm90_config(options, torch.bfloat16, 4096, h100) is None
    assert prefill_bwd_sm90_config(causal, torch.float32, 4096, h100) is None
    for card in ("A100", "L4", "T4"):
        assert prefill_bwd_sm90_config(causal, torch.bfloat16, 4096, TARGETS[card]) is None
    assert prefill_bwd_sm90_config(causal, torch.bfloat16, 4096, None) is None  # the interpreter

    if not expected:
        return
    dev = "cuda" if ON_GPU else "cpu"
    q = torch.zeros(1, 2048, 4, 128, dtype=torch.bfloat16, device=dev)
    k = torch.zeros(1, 2048, 2, 128, dtype=torch.bfloat16, device=dev)
    lse = torch.zeros(1, 4, 2048, dtype=torch.float32, device=dev)

    def kernels_of(**kw):
        with recording(h100) as records:
            launch_backward(q, q, k, k, q, lse, causal, **kw)
        return {getattr(r.fn, "fn", r.fn).__name__ for r in records}

    fused = {"bwd_preprocess_kernel", "bwd_kernel_sm90_ws"}
    assert kernels_of() == fused and kernels_of(deterministic=True) == fused
    seed = torch.zeros(2, dtype=torch.int64, device=dev)
    assert kernels_of(drop=Dropout(0.1, seed)) == {"bwd_preprocess_kernel", "bwd_dkdv_kernel", "bwd_dq_kernel"}


@needs_hopper
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads", [(8, 2), (4, 4)], ids=["gqa", "mha"])
def test_public_backward_takes_the_fused_kernel(causal, heads, monkeypatch):
    """Opted in, flash_attn_func's backward runs the fused kernel, by default and with deterministic=True; both agree
    with the reference by the suite's rule; with deterministic=True two runs give bit-identical gradients (the
    default's dq may differ in its last bits; its dk and dv may not)."""
    import tritonattn.launch.sm90 as sm90

    monkeypatch.setenv("TRITONATTN_SM90_BWD", "1")

    q, k, v = make_qkv(2, 2000, 2000, *heads, 128, torch.bfloat16, seed=3)
    dout = torch.randn(q.shape, device="cuda", dtype=torch.bfloat16)
    calls = []
    monkeypatch.setattr(sm90, "backward", lambda *a, _f=sm90.backward: calls.append(1) or _f(*a))

    def grads(**kw):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        return torch.autograd.grad(flash_attn_func(*leaves, causal=causal, **kw), leaves, dout)

    fused, again = grads(), grads()
    first, second = grads(deterministic=True), grads(deterministic=True)
    assert calls == [1] * 4
    assert torch.equal(fused[1], again[1]) and torch.equal(fused[2], again[2])
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    refs = []
    for upcast in (True, False):
        leaves = [(t.float() if upcast else t).detach().clone().requires_grad_() for t in (q, k, v)]
        out = attention_ref(*leaves, causal=causal, upcast=upcast)[0]
        refs.append(torch.autograd.grad(out, leaves, dout.float() if upcast else dout))
    for name, got, ordered, ref, same in zip(("dq", "dk", "dv"), fused, first, *refs):
        assert_close_to_ref(got, ref, same, grad=True, msg=name)
        assert_close_to_ref(ordered, ref, same, grad=True, msg=f"{name}, deterministic")
