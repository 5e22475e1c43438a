"""Forward correctness of tritonattn.flash_attn_func (FlashAttention-2 prefill, MHA/GQA/MQA).

Ground truth is tritonattn.attention_ref in fp32; a fp16/bf16 kernel must be within 2x of PyTorch's
own same-dtype eager error (flash-attn's rule, see helpers.assert_close_to_ref), and its LSE must
match the reference LSE, +inf exactly on rows that see no key.

Grids: on a GPU (compiled Triton) the full product of head ratios x causal x lengths x head dims x
dtypes x layouts, plus long sequences (marked slow). Under the interpreter (CPU CI) a small
deterministic sample of the same product with scaled-down head counts, fp16/fp32 only (the
interpreter cannot do bf16 dots; the kernel refuses bf16 there, tested below).
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from helpers import (
    DEVICE,
    LAYOUTS,
    ON_GPU,
    assert_close_to_ref,
    assert_lse_close,
    make_qkv,
    references,
    sdpa_references,
)
from tritonattn import flash_attn_func

DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


CASE_ARGS = "batch,seqlen_q,seqlen_k,nheads,nheads_k,head_dim,dtype,causal,layout"


def case_id(batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, dtype, causal, layout):
    return (
        f"b{batch}-m{seqlen_q}-n{seqlen_k}-h{nheads}:{nheads_k}-d{head_dim}-{DTYPE_NAMES[dtype]}-"
        f"{'causal' if causal else 'full'}-{layout}"
    )


def as_params(cases):
    return [pytest.param(*c, id=case_id(*c)) for c in cases]


# --------------------------------------------------------------------------------------------
# Grids
# --------------------------------------------------------------------------------------------
if ON_GPU:
    BATCH = (2,)
    # MHA, GQA 2/4/8 groups and a non-power-of-two head count, MQA
    HEAD_RATIOS = ((16, 16), (16, 8), (16, 4), (16, 2), (12, 4), (16, 1))
    SEQLENS = ((1, 1), (17, 17), (113, 113), (1023, 1023), (113, 1023), (1023, 113), (17, 1), (1, 17))
    HEAD_DIMS = (32, 64, 80, 128, 256)
    EXTRA_HEAD_DIMS = (16, 48, 96, 192)
    DTYPES = (torch.float16, torch.bfloat16, torch.float32)
else:
    BATCH = (1, 2)
    HEAD_RATIOS = ((4, 4), (4, 2), (4, 1), (6, 2))  # same shapes of grouping, fewer heads
    # 1023 only against a short other side, so a case stays ~1 s under the interpreter
    SEQLENS = ((1, 1), (17, 17), (113, 113), (113, 255), (255, 113), (17, 1023), (1023, 17), (17, 1), (1, 17))
    HEAD_DIMS = (16, 32, 48, 64, 80, 96, 128, 192, 256)
    EXTRA_HEAD_DIMS = ()
    DTYPES = (torch.float16, torch.float32)

INTERPRETER_BLOCK = 32  # tritonattn.config.tables.INTERPRETER_CONFIG tiles
INTERPRETER_MAX_TILES = 256  # ~4 ms per (BLOCK_M x BLOCK_N) tile on one CPU core: ~1 s a case
INTERPRETER_SAMPLES = 25


def _interpreter_cost(batch, seqlen_q, seqlen_k, nheads):
    tiles = -(-max(seqlen_q, 1) // INTERPRETER_BLOCK) * (-(-max(seqlen_k, 1) // INTERPRETER_BLOCK) + 1)
    return batch * nheads * tiles


def _valid(case):
    _, m, n, *_, layout = case
    return layout != "qkv_packed" or m == n


def forward_cases():
    full = [
        (b, m, n, h, hk, d, dtype, causal, layout)
        for b, (h, hk), (m, n), d, dtype, causal, layout in itertools.product(
            BATCH, HEAD_RATIOS, SEQLENS, HEAD_DIMS, DTYPES, (False, True), LAYOUTS
        )
    ]
    full = [c for c in full if _valid(c)]
    if ON_GPU:
        # Every (ratio, lengths, head dim, dtype, causal) point once, its layout taken in turn, so
        # all layouts meet every ratio and length without multiplying the grid by four.
        points = itertools.product(BATCH, HEAD_RATIOS, SEQLENS, HEAD_DIMS, DTYPES, (False, True))
        full, rng = [], random.Random(0)
        for b, (h, hk), (m, n), d, dtype, causal in points:
            layout = rng.choice(LAYOUTS)
            full.append((b, m, n, h, hk, d, dtype, causal, layout if m == n or layout != "qkv_packed" else "bshd"))
        # the occasional head dims on one GQA ratio and two layouts
        extra = [
            (2, m, n, 16, 4, d, dtype, causal, layout)
            for (m, n), d, dtype, causal, layout in itertools.product(
                SEQLENS, EXTRA_HEAD_DIMS, DTYPES, (False, True), ("bshd", "strided")
            )
        ]
        return full + extra
    # Interpreter: a fixed-seed sample, stratified so every (lengths, causal) pair appears once,
    # topped up at random from the rest.
    full = [c for c in full if _interpreter_cost(c[0], c[1], c[2], c[3]) <= INTERPRETER_MAX_TILES]
    rng = random.Random(20240601)
    picked = []
    for (m, n), causal in itertools.product(SEQLENS, (False, True)):
        stratum = [c for c in full if (c[1], c[2]) == (m, n) and c[7] == causal]
        picked.append(rng.choice(stratum))
    rest = [c for c in full if c not in picked]
    picked += rng.sample(rest, INTERPRETER_SAMPLES - len(picked))
    return picked


FORWARD_CASES = forward_cases()


# --------------------------------------------------------------------------------------------
# Against the eager reference
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(CASE_ARGS, as_params(FORWARD_CASES))
def test_forward_matches_reference(batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, dtype, causal, layout):
    """Output within 2x of eager same-dtype error of the fp32 reference; LSE matches, +inf where empty."""
    q, k, v = make_qkv(batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, dtype, DEVICE, layout, seed=0)
    out, lse = flash_attn_func(q, k, v, causal=causal, return_softmax_lse=True)
    ref, ref_lse, ref_same = references(q, k, v, causal=causal)
    assert out.dtype == dtype and out.device == q.device
    assert_close_to_ref(out, ref, ref_same)
    assert_lse_close(lse, ref_lse, dtype)


@pytest.mark.parametrize("softmax_scale", [0.05, 0.3, 1.0], ids=lambda s: f"scale{s}")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_softmax_scale(softmax_scale, causal):
    """A non-default softmax_scale is applied once, to the scores (and to the LSE)."""
    dtype = torch.float16
    q, k, v = make_qkv(1, 65, 80, 4, 2, 64, dtype, DEVICE, seed=1)
    out, lse = flash_attn_func(q, k, v, softmax_scale=softmax_scale, causal=causal, return_softmax_lse=True)
    ref, ref_lse, ref_same = references(q, k, v, causal=causal, softmax_scale=softmax_scale)
    assert_close_to_ref(out, ref, ref_same)
    assert_lse_close(lse, ref_lse, dtype)


# --------------------------------------------------------------------------------------------
# Against torch SDPA where conventions agree
# --------------------------------------------------------------------------------------------
def sdpa_cases():
    if ON_GPU:
        ratios, seqlens, dims, dtypes = HEAD_RATIOS, SEQLENS, (64, 80, 128, 256), DTYPES
    else:
        ratios, dims, dtypes = ((4, 4), (4, 1), (6, 2)), (64, 80), (torch.float16, torch.float32)
        seqlens = ((17, 17), (113, 113), (113, 255), (255, 113), (1, 17), (17, 1))
    cases = []
    for (h, hk), (m, n), d, dtype, causal in itertools.product(ratios, seqlens, dims, dtypes, (False, True)):
        if causal and m != n:
            continue  # SDPA's is_causal is top-left aligned; ours is bottom-right
        cases.append((1, m, n, h, hk, d, dtype, causal, "bshd"))
    if not ON_GPU:
        cases = random.Random(7).sample(cases, 10)
    return cases


@pytest.mark.parametrize(CASE_ARGS, as_params(sdpa_cases()))
def test_forward_matches_sdpa(batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, dtype, causal, layout):
    """Output agrees with torch SDPA (non-causal any lengths, causal with M == N; GQA via enable_gqa)."""
    q, k, v = make_qkv(batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, dtype, DEVICE, layout, seed=2)
    out = flash_attn_func(q, k, v, causal=causal)
    ref, ref_same = sdpa_references(q, k, v, causal=causal)
    assert_close_to_ref(out, ref, ref_same)


# --------------------------------------------------------------------------------------------
# Long sequences (GPU only)
# --------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlen", [4096, 8192])
def test_long_sequences(seqlen, causal, dtype):
    """Long prefill (4k, 8k tokens, GQA 16:4, d=128) stays within the error rule of the reference."""
    q, k, v = make_qkv(1, seqlen, seqlen, 16, 4, 128, dtype, DEVICE, seed=3)
    out, lse = flash_attn_func(q, k, v, causal=causal, return_softmax_lse=True)
    ref, ref_lse, ref_same = references(q, k, v, causal=causal)
    assert_close_to_ref(out, ref, ref_same)
    assert_lse_close(lse, ref_lse, dtype)


# --------------------------------------------------------------------------------------------
# Edge cases: rows with no key, empty inputs
# --------------------------------------------------------------------------------------------
EDGE_DTYPES = [torch.float16, torch.float32] + ([torch.bfloat16] if ON_GPU else [])


@pytest.mark.parametrize("dtype", EDGE_DTYPES, ids=lambda t: DTYPE_NAMES[t])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(17, 1), (113, 17), (40, 33), (100, 64)], ids=lambda x: str(x))
def test_causal_fully_masked_rows(seqlen_q, seqlen_k, dtype):
    """Causal with M > N: the first M - N rows are exact zeros with LSE +inf; no NaN anywhere."""
    q, k, v = make_qkv(2, seqlen_q, seqlen_k, 4, 2, 64, dtype, DEVICE, seed=4)
    out, lse = flash_attn_func(q, k, v, causal=True, return_softmax_lse=True)
    empty = seqlen_q - seqlen_k
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert torch.count_nonzero(out[:, :empty]) == 0, "rows that see no key must be exactly zero"
    assert torch.isposinf(lse[:, :, :empty]).all(), "rows that see no key must have LSE +inf"
    assert torch.isfinite(lse[:, :, empty:]).all(), "rows that see a key must have a finite LSE"
    ref, ref_lse, ref_same = references(q, k, v, causal=True)
    assert_close_to_ref(out, ref, ref_same)
    assert_lse_close(lse, ref_lse, dtype)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlen_q", [1, 17, 40])
def test_empty_keys(seqlen_q, causal):
    """seqlen_k == 0: every row sees no key, so the output is all zeros and the LSE all +inf."""
    q, k, v = make_qkv(2, seqlen_q, 0, 4, 2, 64, torch.float16, DEVICE, seed=5)
    out, lse = flash_attn_func(q, k, v, causal=causal, return_softmax_lse=True)
    assert out.shape == q.shape and lse.shape == (2, 4, seqlen_q)
    assert torch.count_nonzero(out) == 0 and not torch.isnan(out).any()
    assert torch.isposinf(lse).all()


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("batch,seqlen_q,seqlen_k", [(2, 0, 17), (2, 0, 0), (0, 17, 17)], ids=["m0", "m0-n0", "b0"])
def test_empty_queries(batch, seqlen_q, seqlen_k, causal):
    """seqlen_q == 0 (or batch == 0) returns empty out (B, M, H, D) and lse (B, H, M) without launching."""
    q, k, v = make_qkv(batch, seqlen_q, seqlen_k, 4, 2, 64, torch.float16, DEVICE, seed=6)
    out, lse = flash_attn_func(q, k, v, causal=causal, return_softmax_lse=True)
    assert out.shape == (batch, seqlen_q, 4, 64) and out.dtype == torch.float16 and out.device == q.device
    assert lse.shape == (batch, 4, seqlen_q) and lse.dtype == torch.float32 and lse.device == q.device


# --------------------------------------------------------------------------------------------
# Memory safety: inputs are only read, the output is written whole
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["qkv_packed", "strided", "bhsd"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_inputs_unchanged(layout, causal):
    """The kernel never writes into its inputs (packed QKV buffer, padded and transposed views)."""
    q, k, v = make_qkv(2, 70, 70, 4, 2, 80, torch.float16, DEVICE, layout, seed=7)
    bases = {id(t._base): t._base for t in (q, k, v) if t._base is not None}
    snapshots = [(b, b.clone()) for b in bases.values()]
    out = flash_attn_func(q, k, v, causal=causal)
    for base, before in snapshots:
        torch.testing.assert_close(base, before, rtol=0, atol=0, equal_nan=True)
    ref, _, ref_same = references(q, k, v, causal=causal)
    assert_close_to_ref(out, ref, ref_same)


@pytest.mark.parametrize("head_dim", [80, 128], ids=lambda d: f"d{d}")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_output_fully_written(head_dim, causal):
    """Every output element is written (torch.empty memory pre-poisoned with NaN stays nowhere)."""
    batch, seqlen_q, seqlen_k, nheads, nheads_k = 2, 113, 77, 4, 1
    q, k, v = make_qkv(batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, torch.float16, DEVICE, seed=8)
    # Leave NaN-filled blocks of the output's size in the allocator's cache (CUDA caching allocator;
    # on the CPU this is best effort), so an unwritten element of the next torch.empty shows up.
    for _ in range(4):
        poison = torch.full((batch, seqlen_q, nheads, head_dim), float("nan"), dtype=q.dtype, device=DEVICE)
        del poison
    out, lse = flash_attn_func(q, k, v, causal=causal, return_softmax_lse=True)
    assert torch.isfinite(out).all(), f"{(~torch.isfinite(out)).sum().item()} output elements never written"
    assert not torch.isnan(lse).any()
    ref, ref_lse, ref_same = references(q, k, v, causal=causal)
    assert_close_to_ref(out, ref, ref_same)
    assert_lse_close(lse, ref_lse, torch.float16)


# --------------------------------------------------------------------------------------------
# Head dims, GQA mapping, batch independence
# --------------------------------------------------------------------------------------------
ALL_HEAD_DIMS = list(range(16, 257, 8))
HEAD_DIM_SWEEP = ALL_HEAD_DIMS if ON_GPU else [16, 24, 40, 80, 136, 200, 256]
SWEEP_DTYPES = [torch.float16, torch.bfloat16] if ON_GPU else [torch.float16]


@pytest.mark.parametrize("dtype", SWEEP_DTYPES, ids=lambda t: DTYPE_NAMES[t])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", HEAD_DIM_SWEEP, ids=lambda d: f"d{d}")
def test_every_head_dim(head_dim, causal, dtype):
    """Each multiple of 8 in [16, 256] works (padded to a power of two inside); the odd head dims on
    every path are test_head_dims.py's."""
    q, k, v = make_qkv(1, 37, 45, 2, 1, head_dim, dtype, DEVICE, "strided", seed=head_dim)
    out, lse = flash_attn_func(q, k, v, causal=causal, return_softmax_lse=True)
    ref, ref_lse, ref_same = references(q, k, v, causal=causal)
    assert_close_to_ref(out, ref, ref_same)
    assert_lse_close(lse, ref_lse, dtype)


GQA_RATIOS = [(16, 8), (16, 4), (12, 4), (16, 1)] if ON_GPU else [(4, 2), (6, 2), (4, 1)]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("nheads,nheads_k", GQA_RATIOS, ids=lambda x: str(x))
def test_gqa_matches_expanded_mha(nheads, nheads_k, causal):
    """GQA reads KV head h // G: bitwise equal to MHA on K/V expanded with repeat_interleave."""
    q, k, v = make_qkv(2, 50, 70, nheads, nheads_k, 64, torch.float16, DEVICE, seed=9)
    group = nheads // nheads_k
    out_gqa, lse_gqa = flash_attn_func(q, k, v, causal=causal, return_softmax_lse=True)
    k_rep, v_rep = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    out_mha, lse_mha = flash_attn_func(q, k_rep, v_rep, causal=causal, return_softmax_lse=True)
    assert torch.equal(out_gqa, out_mha)
    assert torch.equal(lse_gqa, lse_mha)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_batch_entries_independent(causal):
    """Each batch entry equals the same call on that entry alone (batch strides applied right)."""
    q, k, v = make_qkv(3, 45, 60, 4, 2, 64, torch.float16, DEVICE, "bhsd", seed=10)
    out, lse = flash_attn_func(q, k, v, causal=causal, return_softmax_lse=True)
    for b in range(3):
        out_b, lse_b = flash_attn_func(q[b : b + 1], k[b : b + 1], v[b : b + 1], causal=causal, return_softmax_lse=True)
        assert torch.equal(out[b : b + 1], out_b)
        assert torch.equal(lse[b : b + 1], lse_b)


# --------------------------------------------------------------------------------------------
# Interface
# --------------------------------------------------------------------------------------------
def test_deterministic_flag():
    """deterministic=True is accepted and the forward is bitwise reproducible with or without it."""
    q, k, v = make_qkv(2, 70, 90, 4, 2, 64, torch.float16, DEVICE, seed=11)
    out1 = flash_attn_func(q, k, v, causal=True, deterministic=True)
    out2 = flash_attn_func(q, k, v, causal=True, deterministic=True)
    out3 = flash_attn_func(q, k, v, causal=True)
    assert torch.equal(out1, out2) and torch.equal(out1, out3)


def test_return_softmax_lse():
    """return_softmax_lse=True gives (out, lse) with lse (B, H, M) float32; False gives out alone."""
    q, k, v = make_qkv(2, 33, 20, 4, 1, 32, torch.float16, DEVICE, seed=12)
    plain = flash_attn_func(q, k, v)
    assert isinstance(plain, torch.Tensor) and plain.shape == (2, 33, 4, 32)
    result = flash_attn_func(q, k, v, return_softmax_lse=True)
    assert isinstance(result, tuple) and len(result) == 2
    out, lse = result
    assert out.shape == (2, 33, 4, 32) and out.dtype == torch.float16
    assert lse.shape == (2, 4, 33) and lse.dtype == torch.float32 and lse.device == q.device
    assert lse.is_contiguous()
    assert torch.equal(out, plain)


@pytest.mark.skipif(ON_GPU, reason="the bf16 refusal applies only under the interpreter")
def test_bf16_rejected_under_interpreter():
    """Under the interpreter bf16 raises NotImplementedError (its tl.dot is wrong for bf16)."""
    q, k, v = make_qkv(1, 17, 17, 2, 1, 32, torch.bfloat16, DEVICE, seed=13)
    with pytest.raises(NotImplementedError, match="bfloat16"):
        flash_attn_func(q, k, v)


# --------------------------------------------------------------------------------------------
# GPU only: device placement and 64-bit offsets
# --------------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_runs_on_tensors_device():
    """With q/k/v on cuda:1 while cuda:0 is current, the kernel runs on cuda:1 and is correct."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    torch.cuda.set_device(0)
    dev = torch.device("cuda:1")
    q, k, v = make_qkv(2, 113, 200, 8, 2, 128, torch.float16, dev, seed=14)
    out, lse = flash_attn_func(q, k, v, causal=True, return_softmax_lse=True)
    torch.cuda.synchronize(dev)
    assert out.device == dev and lse.device == dev
    assert torch.cuda.current_device() == 0, "the call must not change the current device"
    ref, ref_lse, ref_same = references(q, k, v, causal=True)
    assert_close_to_ref(out, ref, ref_same)
    assert_lse_close(lse, ref_lse, torch.float16)


# fp16 takes the tensor-descriptor (TMA) path on Hopper, fp32 the pointer-arithmetic path.
LARGE_DTYPES = [pytest.param(torch.float16, id="fp16"), pytest.param(torch.float32, id="fp32")]


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("dtype", LARGE_DTYPES)
def test_large_batch_offset(dtype):
    """A batch stride beyond 2**31 elements is addressed in 64 bits (batch 1 reads its own data)."""
    nheads, head_dim, seqlen = 1, 128, 256
    rows = 2**31 // (3 * nheads * head_dim) + 64  # (batch stride) = rows * 3 * 128 > 2**31
    gen = torch.Generator(device=DEVICE).manual_seed(15)
    buf = torch.empty(2, rows, 3 * nheads, head_dim, dtype=dtype, device=DEVICE)
    buf[:, :seqlen].normal_(generator=gen)
    q = buf[:, :seqlen, :nheads]
    k = buf[:, :seqlen, nheads : 2 * nheads]
    v = buf[:, :seqlen, 2 * nheads :]
    assert q.stride(0) > 2**31
    out = flash_attn_func(q, k, v, causal=True)
    ref, _, ref_same = references(q, k, v, causal=True)
    assert_close_to_ref(out, ref, ref_same)


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("dtype", LARGE_DTYPES)
def test_large_row_offset(dtype):
    """Query rows past 2**31 elements from the base (1M+ tokens x 16 heads x 128) are read and written right."""
    nheads, head_dim, seqlen_k, tail = 16, 128, 64, 256
    seqlen_q = 2**31 // (nheads * head_dim) + tail  # row index * row stride passes 2**31 in the tail
    q = torch.empty(1, seqlen_q, nheads, head_dim, dtype=dtype, device=DEVICE)
    gen = torch.Generator(device=DEVICE).manual_seed(16)
    q.normal_(generator=gen)
    _, k, v = make_qkv(1, 1, seqlen_k, nheads, nheads, head_dim, dtype, DEVICE, seed=17)
    out, lse = flash_attn_func(q, k, v, return_softmax_lse=True)  # non-causal: rows are independent
    ref, ref_lse, ref_same = references(q[:, -2 * tail :], k, v, causal=False)
    assert_close_to_ref(out[:, -2 * tail :], ref, ref_same)
    assert_lse_close(lse[:, :, -2 * tail :], ref_lse, dtype)
