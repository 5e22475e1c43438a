"""The FP8 forward: flash_attn_func / flash_attn_varlen_func with q, k, v in float8_e4m3fn and q_descale /
k_descale / v_descale (FlashAttention-3's names), output bfloat16.

Two checks per result. The kernel against `tritonattn.testing.attention_fp8_ref`, which computes what the
kernel computes (the e4m3 products, the online softmax over key blocks of the kernel's BLOCK_N, each block's
probabilities quantized to e4m3 for P V): under the interpreter they agree to the last bit before the bf16
store (whose rounding is the only difference), on a GPU up to exp2's approximation. And the quantization
error itself, against an fp64 reference on the unquantized inputs, printed with its RMSE and bounded by
`FP8_PREFILL_RTOL`: on unit normal inputs, on FlashAttention-3's outlier distribution (0.1% of the entries
drawn with standard deviation 10), and with a few outlier channels.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from helpers import DEVICE, ON_GPU
from tritonattn import flash_attn_func, flash_attn_varlen_func, rel_err
from tritonattn.config.hardware import TARGETS, device_target
from tritonattn.config.options import attn_options, head_dim_tile
from tritonattn.config.tables import prefill_fwd_config, prefill_fwd_sm90_config
from tritonattn.launch.fast import recording
from tritonattn.testing import (
    AGREEMENT,
    FA3_FP8_RMSE,
    FP8_PREFILL_OUTLIER_RTOL,
    FP8_PREFILL_RTOL,
    attention_fp8_ref,
    attention_ref,
    lse_tolerance,
)

E4M3 = torch.float8_e4m3fn
HEAD_DIM = 128 if ON_GPU else 32


def block_n(head_dim: int, causal: bool, seqlen_k: int) -> int:
    """The key block the kernel quantizes its probabilities by (the emulating reference needs it): Hopper's
    warp-specialized kernel's where it is chosen, fwd_kernel's otherwise."""
    target = device_target(torch.device(DEVICE))
    sm90 = prefill_fwd_sm90_config(attn_options(head_dim, causal=causal, kv_fp8=True), E4M3, seqlen_k, target)
    return (sm90 or prefill_fwd_config(head_dim_tile(head_dim), E4M3, causal, target)).block_n


def descales(x: torch.Tensor, nheads_k: int, per_head: bool) -> torch.Tensor:
    """amax / 448 per (batch, KV head) (a query head's amax counts for its KV head), or over the tensor."""
    if not per_head:
        return (x.float().abs().max() / 448.0).reshape(1)
    amax = x.float().abs().amax(dim=(1, 3))  # (batch, heads)
    return (amax.view(x.shape[0], nheads_k, -1).amax(-1) / 448.0).clamp(min=1e-12).contiguous()


def quantize(x: torch.Tensor, descale: torch.Tensor) -> torch.Tensor:
    """x / descale (per (batch, KV head) or one number) as e4m3, clamped, rounded to nearest even."""
    d = descale.reshape(1, 1, 1, 1) if descale.numel() == 1 else descale
    if d.dim() == 2:
        d = d.repeat_interleave(x.shape[2] // d.shape[1], dim=1)[:, None, :, None]
    return (x.float() / d).clamp(-448.0, 448.0).to(E4M3)


def fp8_inputs(batch, seqlen_q, seqlen_k, nheads, nheads_k, *, per_head=True, seed=0, dist="normal",
               head_dim=HEAD_DIM):
    """(fp32 q, k, v, their e4m3 forms, their descales)."""
    g = torch.Generator(device="cpu").manual_seed(seed)

    def rand(*shape, outliers=True):
        x = torch.randn(*shape, generator=g)
        if dist == "fa3":  # FlashAttention-3's: 0.1% of the entries with standard deviation 10
            x = torch.where(torch.rand(*shape, generator=g) < 1e-3, x * 10.0, x)
        elif dist == "channels" and outliers:  # two outlier channels of K and V, 20x (q's stay: the FP8 cache's
            x[..., :2] *= 20.0  # measurement, and the scores of a model stay bounded)
        return x.to(DEVICE)

    q, k, v = rand(batch, seqlen_q, nheads, head_dim, outliers=False), rand(batch, seqlen_k, nheads_k, head_dim), rand(
        batch, seqlen_k, nheads_k, head_dim)
    ds = [descales(t, nheads_k, per_head) for t in (q, k, v)]
    return (q, k, v), tuple(quantize(t, d) for t, d in zip((q, k, v), ds)), tuple(ds)


def check_against_emulation(out, lse, q8, k8, v8, ds, causal, **kw):
    assert out.dtype == torch.bfloat16
    ref, ref_lse = attention_fp8_ref(q8, k8, v8, *ds, block_n=block_n(q8.shape[-1], causal, k8.shape[1]),
                                     causal=causal, **kw)
    err = rel_err(out.float(), ref)
    assert err <= AGREEMENT[torch.bfloat16], err
    atol, rtol = lse_tolerance(torch.float16)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    assert torch.allclose(lse[finite], ref_lse[finite], atol=atol * 10, rtol=rtol), (lse - ref_lse).abs().max()


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1)])
@pytest.mark.parametrize("per_head", [True, False])
def test_dense_matches_the_emulating_reference(causal, heads, per_head):
    """Dense FP8 forward, MHA / GQA / MQA, causal or not, seqlen_q != seqlen_k, lengths off the tile."""
    seqlens = (200, 333) if ON_GPU else (37, 70)
    _, (q8, k8, v8), ds = fp8_inputs(2, *seqlens, *heads, per_head=per_head, seed=1)
    out, lse = flash_attn_func(q8, k8, v8, causal=causal, q_descale=ds[0], k_descale=ds[1], v_descale=ds[2],
                               return_softmax_lse=True)
    check_against_emulation(out, lse, q8, k8, v8, ds, causal)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)])
@pytest.mark.parametrize("window", [(-1, -1), (300, 200)])
def test_long_keys_match_the_emulating_reference(causal, heads, window):
    """Past SM90_WS_MIN_KEYS keys (on Hopper the warp-specialized kernel, V copied keys-inner, 128-key blocks),
    key and query counts off the tile (the copy's padded tail must not reach the output), with and without a
    sliding window (whose programs start at a key block past 0)."""
    seqlens = (1100, 2100) if ON_GPU else (40, 75)
    if not ON_GPU:
        window = tuple(w // 10 for w in window)
    _, (q8, k8, v8), ds = fp8_inputs(1, *seqlens, *heads, seed=7)
    out, lse = flash_attn_func(q8, k8, v8, causal=causal, window_size=window, q_descale=ds[0], k_descale=ds[1],
                               v_descale=ds[2], return_softmax_lse=True)
    check_against_emulation(out, lse, q8, k8, v8, ds, causal, window_size=window)


@pytest.mark.parametrize("causal", [False, True])
def test_hopper_plans_the_warp_specialized_kernel(causal):
    """On an H100 the FP8 forward at 2048 keys, D = 128, is Hopper's Gluon kernel with V as a (batch, nheads_k,
    D, seqlen_k) copy (keys contiguous) and 128-key blocks; at 256 keys it is fwd_kernel, V as given."""
    if prefill_fwd_sm90_config(attn_options(128, causal=causal, kv_fp8=True), E4M3, 2048, TARGETS["H100"]) is None:
        pytest.skip("Hopper's Gluon kernel is off here (this Triton's Gluon lacks its API, or TRITONATTN_SM90=0)")
    q = torch.empty(1, 2048, 8, 128, dtype=E4M3, device=DEVICE)
    k, v = (torch.empty(1, 2048, 2, 128, dtype=E4M3, device=DEVICE) for _ in range(2))
    kw = dict(causal=causal, q_descale=1.0, k_descale=1.0, v_descale=1.0)
    with recording(TARGETS["H100"]) as launched:
        flash_attn_func(q, k, v, **kw)
        flash_attn_func(q[:, :256], k[:, :256], v[:, :256], **kw)
    copy, ws, portable = ({name: a for name, a in zip(inspect.signature(r.fn.fn).parameters, r.args)}
                          for r in launched)
    assert [r.fn.fn.__name__ for r in launched] == ["fp8_values_kernel", "fwd_kernel_sm90_ws", "fwd_kernel"]
    assert copy["V"] is v and copy["Out"] is ws["V"]
    assert ws["V"].shape == (1, 2, 128, 2048) and ws["V"].stride(-1) == 1 and ws["stride_vn"] == 2048
    assert ws["BLOCK_N"] == 128 and ws["Out"].dtype == torch.bfloat16
    assert portable["V"].shape == (1, 256, 2, 128)


@pytest.mark.parametrize("shape", [(2, 300, 3, 128), (1, 129, 2, 96), (1, 5, 1, 16)])
def test_fp8_values_lays_v_out_as_the_pv_operand(shape):
    """The FP8 forward's V operand on Hopper (launch/sm90.py `fp8_values`): (batch, nheads_k, D, seqlen_k rounded
    up to 16), keys contiguous, position p of each group of 16 holding key 8 p1 + 4 p3 + 2 p2 + p0 (bits of
    p % 16), zeros where that key is past the end; bit-equal to V gathered so. Ragged key tails, a head dim that
    is not a power of two, and a strided V (a slice of a packed qkv) included."""
    from tritonattn.launch.sm90 import fp8_values

    batch, seqlen_k, nheads_k, head_dim = shape
    torch.manual_seed(0)
    qkv = (torch.randn(batch, seqlen_k, 3 * nheads_k, head_dim, device=DEVICE) * 100).clamp(-448, 448).to(E4M3)
    v = qkv[:, :, 2 * nheads_k:]
    out = fp8_values(v)
    width = -(-seqlen_k // 16) * 16
    assert out.shape == (batch, nheads_k, head_dim, width) and out.stride(-1) == 1 and out.data_ptr() % 16 == 0
    group = [8 * (p >> 1 & 1) + 4 * (p >> 3 & 1) + 2 * (p >> 2 & 1) + (p & 1) for p in range(16)]
    assert sorted(group) == list(range(16))
    keys = torch.tensor([g + k for g in range(0, width, 16) for k in group], device=DEVICE)
    tail = v.new_zeros(batch, width - seqlen_k, nheads_k, head_dim)
    padded = torch.cat([v.view(torch.uint8), tail.view(torch.uint8)], dim=1)
    assert torch.equal(out.view(torch.uint8), padded[:, keys].permute(0, 2, 3, 1))


def test_window_and_scale():
    """A sliding window and an explicit softmax_scale pass through the FP8 forward like any option."""
    _, (q8, k8, v8), ds = fp8_inputs(1, 64, 64, 2, 1, seed=2)
    out, lse = flash_attn_func(q8, k8, v8, softmax_scale=0.2, window_size=(20, 3), q_descale=ds[0],
                               k_descale=ds[1], v_descale=ds[2], return_softmax_lse=True)
    check_against_emulation(out, lse, q8, k8, v8, ds, False, window_size=(20, 3), softmax_scale=0.2)


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_matches_each_sequence_alone(causal):
    """Packed sequences (lengths 0, 1, off the tile; keys of their own lengths): each sequence's rows equal the
    emulating reference over that sequence alone, with its own descales."""
    lengths_q, lengths_k = [0, 1, 37, 20], [5, 1, 50, 20]
    nheads, nheads_k = 4, 2
    g = torch.Generator(device="cpu").manual_seed(3)
    qs = [torch.randn(n, nheads, HEAD_DIM, generator=g).to(DEVICE) for n in lengths_q]
    ks = [torch.randn(n, nheads_k, HEAD_DIM, generator=g).to(DEVICE) for n in lengths_k]
    vs = [torch.randn(n, nheads_k, HEAD_DIM, generator=g).to(DEVICE) for n in lengths_k]
    ds = [torch.rand(len(lengths_q), nheads_k, generator=g).to(DEVICE) * 0.01 + 0.002 for _ in range(3)]
    q8 = torch.cat([quantize(t[None], d[b: b + 1])[0] for b, (t, d) in enumerate(zip(qs, [ds[0]] * 4))])
    k8 = torch.cat([quantize(t[None], d[b: b + 1])[0] for b, (t, d) in enumerate(zip(ks, [ds[1]] * 4))])
    v8 = torch.cat([quantize(t[None], d[b: b + 1])[0] for b, (t, d) in enumerate(zip(vs, [ds[2]] * 4))])
    cu_q = torch.tensor([0] + torch.tensor(lengths_q).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0] + torch.tensor(lengths_k).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    out, lse = flash_attn_varlen_func(q8, k8, v8, cu_q, cu_k, max(lengths_q), max(lengths_k), causal=causal,
                                      q_descale=ds[0], k_descale=ds[1], v_descale=ds[2], return_softmax_lse=True)
    for b in range(len(lengths_q)):
        rows, keys = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        if lengths_q[b] == 0:
            continue
        alone = [d[b: b + 1] for d in ds]
        check_against_emulation(out[rows][None], lse[:, rows][None], q8[rows][None], k8[keys][None], v8[keys][None],
                                alone, causal)


@pytest.mark.parametrize("dist", ["normal", "fa3", "channels"])
def test_quantization_error_vs_unquantized(dist):
    """Against an fp64 reference on the unquantized inputs the error is the quantization's (inputs, and P per
    block): printed with its RMSE, within FP8_PREFILL_RTOL (FP8_PREFILL_OUTLIER_RTOL with outlier channels),
    and on FlashAttention-3's distribution an RMSE no worse than the 2.4e-2 it reports (FA3_FP8_RMSE)."""
    seqlen = 1024 if ON_GPU else 96
    errors = {}
    for per_head in (True, False):
        (q, k, v), (q8, k8, v8), ds = fp8_inputs(2, seqlen, seqlen, 4, 2, per_head=per_head, seed=4, dist=dist)
        out = flash_attn_func(q8, k8, v8, q_descale=ds[0], k_descale=ds[1], v_descale=ds[2])
        ref, _ = attention_ref(q.double(), k.double(), v.double())
        err = rel_err(out, ref)
        rmse = (out.double() - ref).pow(2).mean().sqrt().item()
        bf16, _ = attention_ref(q.bfloat16().double(), k.bfloat16().double(), v.bfloat16().double())
        print(f"{dist}, per_head={per_head}: FP8 forward rel err {err:.2e}, RMSE {rmse:.2e} (bf16 inputs: rel err "
              f"{rel_err(bf16, ref):.2e})")
        errors[per_head] = err, rmse
    for per_head, (err, rmse) in errors.items():  # both printed first
        assert err <= (FP8_PREFILL_OUTLIER_RTOL if dist == "channels" else FP8_PREFILL_RTOL), (per_head, err)
        if dist == "fa3":  # the issue's bar: no worse than FlashAttention-3's per-tensor FP8
            assert rmse <= FA3_FP8_RMSE, (per_head, rmse)


def _bad_cases():
    _, (q8, k8, v8), ds = fp8_inputs(2, 16, 16, 4, 2, seed=5)
    good = dict(q_descale=ds[0], k_descale=ds[1], v_descale=ds[2])
    half = q8.to(torch.float16)
    return {  # name: (args, kwargs, error, message fragment)
        "no q_descale": ((q8, k8, v8), {**good, "q_descale": None}, ValueError, "Expected q_descale with"),
        "no descales": ((q8, k8, v8), {}, ValueError, "Expected k_descale with"),
        "mixed dtypes": ((q8, k8.to(torch.float16), v8), good, TypeError, "q, k and v all in float8_e4m3fn"),
        "q_descale with 16-bit": ((half, half[:, :, :2], half[:, :, :2]), {"q_descale": 1.0}, ValueError,
                                  "q_descale only with an e4m3 q"),
        "descale shape": ((q8, k8, v8), {**good, "q_descale": torch.ones(2, 4, device=DEVICE)}, ValueError,
                          r"q_descale of shape \(batch, nheads_k\) = \(2, 2\)"),
        "dropout": ((q8, k8, v8), {**good, "dropout_p": 0.1}, NotImplementedError, "dropout_p must be 0"),
        "head dim 16": ((q8[..., :16], k8[..., :16], v8[..., :16]), good, NotImplementedError, "head dim > 16"),
    }


@pytest.mark.parametrize("case", list(_bad_cases()))
def test_bad_input_is_refused_before_launch(case):
    args, kwargs, error, match = _bad_cases()[case]
    with pytest.raises(error, match=match):
        flash_attn_func(*args, **kwargs)


def test_requires_grad_is_refused():
    """No FP8 backward: e4m3 inputs that require grad are refused with the reason (under no_grad they run)."""
    _, (q8, k8, v8), ds = fp8_inputs(1, 16, 16, 2, 2, seed=6)
    q8.requires_grad_()
    with pytest.raises(NotImplementedError, match="no backward"):
        flash_attn_func(q8, k8, v8, q_descale=ds[0], k_descale=ds[1], v_descale=ds[2])
    with torch.no_grad():
        assert flash_attn_func(q8, k8, v8, q_descale=ds[0], k_descale=ds[1], v_descale=ds[2]).dtype == torch.bfloat16


def test_paged_varlen_refuses_descales():
    _, (q8, k8, v8), ds = fp8_inputs(1, 16, 16, 2, 2, seed=7)
    cu = torch.tensor([0, 16], dtype=torch.int32, device=DEVICE)
    table = torch.zeros(1, 1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(NotImplementedError, match="does not take a paged K/V"):
        flash_attn_varlen_func(q8[0], k8, v8, cu, cu, 16, 16, block_table=table, q_descale=ds[0], k_descale=ds[1],
                               v_descale=ds[2])


def test_entry_points_without_fp8_refuse_e4m3():
    """The primitives (flash-attn's `_flash_attn_forward`) take no descales: e4m3 inputs get the dtype error
    before any launch, not a kernel's compile error."""
    from tritonattn.flash_attn_interface import _flash_attn_forward

    _, (q8, k8, v8), _ = fp8_inputs(1, 16, 16, 2, 2, seed=8)
    with pytest.raises(TypeError, match="Expected dtype float16, bfloat16 or float32"):
        _flash_attn_forward(q8, k8, v8, 0.0, None, False)
