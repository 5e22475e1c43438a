"""Input validation of tritonattn.flash_attn_func: the right exception type and a message that says
what was expected, raised before anything is allocated or launched."""

from __future__ import annotations

import pytest
import torch

from helpers import DEVICE, make_qkv
from tritonattn import InputError, flash_attn_func, flash_attn_with_kvcache

B, M, N, H, H_KV, D = 2, 17, 23, 4, 2, 64


def qkv(dtype=torch.float16, **overrides):
    """Small valid inputs; `overrides` replaces q, k or v."""
    q, k, v = make_qkv(B, M, N, H, H_KV, D, dtype, DEVICE, seed=0)
    tensors = {"q": q, "k": k, "v": v}
    tensors.update(overrides)
    return tensors["q"], tensors["k"], tensors["v"]


def randn(*shape, dtype=torch.float16, device=DEVICE):
    return torch.randn(*shape, device=device).to(dtype)


@pytest.fixture(autouse=True)
def no_launch(monkeypatch):
    """Every call in this module must fail in validation: reaching the launcher is a test failure."""

    def launcher_reached(*args, **kwargs):
        raise AssertionError("validation let a bad call through to allocation/launch")

    import tritonattn.api.prefill as prefill

    monkeypatch.setattr(prefill, "launch_prefill", launcher_reached)


# --------------------------------------------------------------------------------------------
# Types and ranks
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("which", ["q", "k", "v"])
@pytest.mark.parametrize("bad", [None, [[1.0]], 3.0], ids=["None", "list", "float"])
def test_non_tensor_raises_type_error(which, bad):
    """A non-tensor q, k or v raises TypeError naming the argument."""
    q, k, v = qkv(**{which: bad})
    with pytest.raises(TypeError, match=f"Expected {which} to be a torch.Tensor"):
        flash_attn_func(q, k, v)


@pytest.mark.parametrize("which", ["q", "k", "v"])
@pytest.mark.parametrize("ndim", [3, 5])
def test_wrong_rank_raises_value_error(which, ndim):
    """A q, k or v that is not 4-D raises ValueError quoting the expected layout."""
    shape = {3: (M, H, D), 5: (B, M, H, D, 1)}[ndim]
    q, k, v = qkv(**{which: randn(*shape)})
    with pytest.raises(ValueError, match=rf"Expected {which} to have 4 dims \(batch, seqlen, nheads, headdim\)"):
        flash_attn_func(q, k, v)


@pytest.mark.parametrize("which", ["k", "v"])
def test_dtype_mismatch_raises_value_error(which):
    """q, k, v of different dtypes raise ValueError naming both dtypes."""
    q, k, v = qkv(**{which: randn(B, N, H_KV, D, dtype=torch.float32)})
    with pytest.raises(ValueError, match="share one dtype.*float16.*float32"):
        flash_attn_func(q, k, v)


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32, torch.int8], ids=str)
def test_unsupported_dtype_raises_type_error(dtype):
    """float64 and integer inputs raise TypeError listing the supported dtypes."""
    q = torch.ones(B, M, H, D, device=DEVICE).to(dtype)
    k = v = torch.ones(B, N, H_KV, D, device=DEVICE).to(dtype)
    with pytest.raises(TypeError, match="Expected dtype float16, bfloat16 or float32"):
        flash_attn_func(q, k, v)


# --------------------------------------------------------------------------------------------
# Devices
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("which", ["k", "v"])
def test_device_mismatch_raises_value_error(which):
    """Inputs on two devices raise ValueError naming both (meta stands in for a 2nd device on CPU)."""
    other = "cpu" if DEVICE.type == "cuda" else "meta"
    q, k, v = qkv(**{which: randn(B, N, H_KV, D, device=other)})
    with pytest.raises(ValueError, match=f"Expected all inputs on one device.*{which} on {other}"):
        flash_attn_func(q, k, v)


def test_unsupported_device_raises_value_error():
    """Tensors on a device that is neither CUDA nor (interpreted) CPU raise ValueError."""
    q, k, v = (randn(*t.shape, device="meta") for t in qkv())
    with pytest.raises(ValueError, match="Expected CUDA tensors .* got device meta"):
        flash_attn_func(q, k, v)


def test_cpu_tensors_without_interpreter_raise_value_error(monkeypatch):
    """CPU tensors with TRITON_INTERPRET unset/0 raise ValueError telling to set TRITON_INTERPRET=1."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # read by tritonattn.config.hardware.is_interpreter() per call
    q, k, v = (t.cpu() for t in qkv())
    with pytest.raises(ValueError, match="Got CPU tensors.*TRITON_INTERPRET=1"):
        flash_attn_func(q, k, v)


def test_bf16_under_interpreter_raises_not_implemented(monkeypatch):
    """bf16 under the interpreter raises NotImplementedError (checked before any launch, so the
    env switch alone exercises it on a GPU machine too)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    q, k, v = qkv(dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError, match="bfloat16 is not supported under the Triton interpreter"):
        flash_attn_func(q, k, v)


# --------------------------------------------------------------------------------------------
# Shapes
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("head_dim", [0, 257, 264, 512])
def test_head_dim_outside_the_range_raises_input_error(head_dim):
    """head dims outside [1, 256] raise InputError (every head dim inside works: test_head_dims.py), in prefill
    and in decode, before any launch."""
    q, k, v = randn(B, M, H, head_dim), randn(B, N, H_KV, head_dim), randn(B, N, H_KV, head_dim)
    with pytest.raises(InputError, match=f"head_dim between 1 and 256, got {head_dim}"):
        flash_attn_func(q, k, v)
    with pytest.raises(InputError, match=f"head_dim between 1 and 256, got {head_dim}"):
        flash_attn_with_kvcache(q[:, :1], k, v, cache_seqlens=N)


@pytest.mark.parametrize("lengths", ["tensor", "int"])
def test_empty_batch_decodes_to_empty_outputs(lengths):
    """A batch of zero requests (a serving loop with nothing running) gives empty outputs, tensor lengths
    included, with or without an append."""
    q, k_cache, v_cache = randn(0, 1, H, 32), randn(0, N, H_KV, 32), randn(0, N, H_KV, 32)
    lens = torch.zeros(0, dtype=torch.int32, device=q.device) if lengths == "tensor" else 3
    for kv in ((None, None), (randn(0, 1, H_KV, 32), randn(0, 1, H_KV, 32))):
        out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, *kv, cache_seqlens=lens, return_softmax_lse=True)
        assert out.shape == (0, 1, H, 32) and lse.shape == (0, H, 1)


@pytest.mark.parametrize("nheads,nheads_k", [(6, 4), (4, 3), (2, 4), (5, 2)], ids=lambda x: str(x))
def test_nheads_not_divisible_raises_value_error(nheads, nheads_k):
    """nheads % nheads_k != 0 (including more KV heads than query heads) raises ValueError."""
    q, k, v = randn(B, M, nheads, D), randn(B, N, nheads_k, D), randn(B, N, nheads_k, D)
    with pytest.raises(ValueError, match=rf"nheads \({nheads}\) to be divisible by nheads_k \({nheads_k}\)"):
        flash_attn_func(q, k, v)


def test_batch_mismatch_raises_value_error():
    """q and k/v with different batch sizes raise ValueError."""
    q, k, v = qkv(q=randn(B + 1, M, H, D))
    with pytest.raises(ValueError, match=f"share the batch size, got {B + 1} and {B}"):
        flash_attn_func(q, k, v)


def test_head_dim_mismatch_raises_value_error():
    """q and k/v with different head dims raise ValueError."""
    q, k, v = qkv(q=randn(B, M, H, 128))
    with pytest.raises(ValueError, match=f"share the head dim, got 128 and {D}"):
        flash_attn_func(q, k, v)


@pytest.mark.parametrize(
    "v_shape",
    [(B, N + 1, H_KV, D), (B, N, H_KV * 2, D), (B, N, H_KV, D * 2), (B + 1, N, H_KV, D)],
    ids=["seqlen", "heads", "headdim", "batch"],
)
def test_kv_shape_mismatch_raises_value_error(v_shape):
    """k and v of different shapes raise ValueError quoting both shapes."""
    q, k, v = qkv(v=randn(*v_shape))
    with pytest.raises(ValueError, match=r"k and v to have the same shape"):
        flash_attn_func(q, k, v)


@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_noncontiguous_last_dim_raises_value_error(which):
    """A q, k or v whose head dim is strided raises ValueError suggesting .contiguous()."""
    shape = (B, M, H, D) if which == "q" else (B, N, H_KV, D)
    strided = randn(*shape[:-1], 2 * D)[..., ::2]
    assert strided.stride(-1) == 2
    q, k, v = qkv(**{which: strided})
    with pytest.raises(ValueError, match=rf"Expected {which} to have a contiguous last dim.*\.contiguous\(\)"):
        flash_attn_func(q, k, v)


# --------------------------------------------------------------------------------------------
# Options
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dropout_p", [-0.5, 1.0, 1.5, float("nan")], ids=str)
def test_dropout_outside_unit_interval_raises_value_error(dropout_p):
    """dropout_p outside [0, 1) raises ValueError (1 would drop everything and scale by 1 / 0)."""
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"dropout_p in \[0, 1\)"):
        flash_attn_func(q, k, v, dropout_p)


@pytest.mark.parametrize("scale", [0.0, -0.125, float("inf"), float("-inf"), float("nan")], ids=str)
def test_bad_softmax_scale_raises_value_error(scale):
    """softmax_scale <= 0, infinite or NaN raises ValueError."""
    q, k, v = qkv()
    with pytest.raises(ValueError, match="softmax_scale to be a finite positive number"):
        flash_attn_func(q, k, v, softmax_scale=scale)


def test_bad_input_errors_are_runtime_errors_too():
    """Bad input raises classes that are ValueError / TypeError and RuntimeError (flash-attn raises
    RuntimeError), before any launch."""
    q, k, v = qkv()
    with pytest.raises(RuntimeError, match="divisible"):
        flash_attn_func(q, k[:, :, :1].expand(-1, -1, 3, -1), v[:, :, :1].expand(-1, -1, 3, -1))
    with pytest.raises(RuntimeError, match="torch.Tensor"):
        flash_attn_func(q.tolist(), k, v)


# --------------------------------------------------------------------------------------------
# Validation runs before allocation
# --------------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_bad_call_allocates_nothing(monkeypatch):
    """A rejected call leaves torch.cuda.memory_allocated unchanged (validate before allocate)."""
    monkeypatch.undo()  # use the real launcher: the check is on GPU memory, not on the monkeypatch
    q, k, v = qkv()
    k32, v32 = k[..., :32].contiguous(), v[..., :32].contiguous()
    k_fp32 = k.float()
    q_strided = q.repeat(1, 1, 1, 2)[..., ::2]
    bad_calls = [
        ((q, k32, v32), {}),  # head-dim mismatch
        ((q, k, v), {"softmax_scale": -1.0}),  # bad scale
        ((q, k_fp32, v), {}),  # dtype mismatch
        ((q_strided, k, v), {}),  # strided head dim
        ((q, k, v, 1.0), {}),  # dropout_p outside [0, 1)
    ]
    for args, kwargs in bad_calls:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        with pytest.raises((ValueError, TypeError, NotImplementedError)):
            flash_attn_func(*args, **kwargs)
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() == before
