"""Helpers the notebooks share, so that their cells only narrate, call, check and plot.

- `sizes(on_gpu)`: the shapes a notebook uses: small under the Triton interpreter, full on a GPU.
- `Case`, `grid`, `make_inputs`: attention problems and their (seeded) inputs.
- `forward_error_table`, `grad_error_table`: pandas DataFrames of relative errors against the fp32
  eager reference, the same-dtype eager reference and torch SDPA (where the conventions agree),
  judged by flash-attn's rule; `assert_table_ok` fails loudly with the offending rows.
- `gqa_group_sum_table`, `kv_bytes_table`: the GQA notebook's checks and memory arithmetic.
- `check_errors`: runs calls that must raise and checks the exception types.
- `prefill_providers`, `gqa_providers`, `measure`, `save_results`: GPU latency / peak-memory sweeps,
  stored with `kernels.bench.write_csv` in the columns scripts/bench_prefill.py uses.
- `load_results`, `plot_lines`, `summary_table`: plots of measured (or committed) results; PNGs go to
  figures/<gpu-slug>/, titles name the GPU the numbers came from.
- `show`: a DataFrame as a rich table in Jupyter/Colab, as text when the cells are exec'd headless.

The error rule (flash-attn's tests): a float16/bfloat16 kernel passes when its error against the
fp32 reference is at most `factor` times PyTorch's own error in the same dtype (2x forward, 3x
gradients) plus a small absolute floor; float32 inputs get plain bounds (exact fp32 under the
interpreter, tf32 matmuls on a GPU). NaN never passes.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from . import bench
from ._utils import is_interpreter
from .prefill import flash_attn_func
from .reference import attention_ref, attention_sdpa, rel_err, sdpa_supports_enable_gqa

# flash-attn's rule: kernel error <= factor * same-dtype eager error + floor.
FWD_FACTOR, GRAD_FACTOR = 2.0, 3.0
ATOL_FLOOR = {torch.float16: 1e-3, torch.bfloat16: 4e-3}
# float32 has no same-dtype yardstick (the reference is fp32): plain relative bounds instead.
FP32_RTOL_INTERPRET = 1e-5  # the interpreter's tl.dot is an exact fp32 numpy matmul
FP32_RTOL_GPU = 5e-3  # tf32 tensor-core matmuls on a GPU
FP32_GRAD_RTOL_INTERPRET = 1e-4  # gradients sum in a different order than autograd's
LSE_ATOL = {torch.float16: 1e-3, torch.bfloat16: 1e-3, torch.float32: 1e-4}
LSE_ATOL_FP32_GPU = 5e-3


# --------------------------------------------------------------------------------------------
# Sizes
# --------------------------------------------------------------------------------------------
def sizes(on_gpu: bool) -> SimpleNamespace:
    """Shapes for the notebooks: small under the interpreter (CPU), full on a GPU.

    Under the interpreter: heads <= 4 (16 in the GQA sweep, with tiny lengths), lengths <= 130,
    head dims 32/64/80, float16/float32 (bfloat16 raises NotImplementedError there by design).
    On a GPU: 32 heads, head dim 128, bfloat16 and float16, lengths up to 4096 in the correctness
    checks and 1024..8192 (batch * seqlen = 16384 tokens) in the benchmarks.
    """
    if on_gpu:
        return SimpleNamespace(
            batch=2, nheads=32, nheads_k=8, head_dim=128,
            dtype=torch.bfloat16, dtypes=(torch.bfloat16, torch.float16),
            lengths=(1, 17, 113), grad_lengths=(17, 113, 1000), seqlen=4096, odd_seqlen=1000,
            head_dims=(48, 80, 96, 192),
            table_seqlens=((1, 1), (113, 113), (1023, 1023), (4096, 4096), (1000, 3000), (3000, 1000)),
            table_heads=((32, 32), (32, 8), (32, 1)),
            table_head_dims=(64, 128),
            grad_seqlens=((17, 17), (113, 113), (1023, 1023), (2048, 2048), (1000, 1500), (1500, 1000)),
            grad_heads=((16, 16), (16, 4), (16, 1)),
            gqa_nheads=16, gqa_nheads_k=(16, 8, 4, 2, 1), gqa_seqlens=((1024, 1024), (1000, 1500)),
            gqa_grad_seqlens=((1024, 1024), (1000, 1500)), gqa_head_dim=128, gqa_batch=2,
            gqa_sum_dtypes=(torch.bfloat16,),
            bench_seqlens=(1024, 2048, 4096, 8192), bench_tokens=16384, bench_nheads=32, bench_head_dim=128,
            bench_dtype=torch.bfloat16, gqa_bench_seqlen=4096, gqa_bench_nheads=16,
        )
    return SimpleNamespace(
        batch=1, nheads=4, nheads_k=2, head_dim=64,
        dtype=torch.float16, dtypes=(torch.float16, torch.float32),
        lengths=(1, 17, 113), grad_lengths=(17, 113), seqlen=113, odd_seqlen=113,
        head_dims=(48, 80, 96),
        table_seqlens=((1, 1), (17, 17), (113, 113), (17, 113), (113, 17)),
        table_heads=((4, 4), (4, 2), (4, 1)),
        table_head_dims=(32, 80),
        grad_seqlens=((17, 17), (113, 113), (17, 113), (113, 17)),
        grad_heads=((4, 4), (4, 1)),
        gqa_nheads=16, gqa_nheads_k=(16, 8, 4, 2, 1), gqa_seqlens=((33, 33), (17, 40)),
        gqa_grad_seqlens=((33, 33), (40, 17)), gqa_head_dim=32, gqa_batch=1,
        gqa_sum_dtypes=(torch.float32,),
        bench_seqlens=(1024, 2048, 4096, 8192), bench_tokens=16384, bench_nheads=32, bench_head_dim=128,
        bench_dtype=torch.bfloat16, gqa_bench_seqlen=4096, gqa_bench_nheads=16,
    )


# --------------------------------------------------------------------------------------------
# Cases and inputs
# --------------------------------------------------------------------------------------------
def dtype_name(dtype: torch.dtype) -> str:
    """'float16' for torch.float16 (CSV- and table-friendly)."""
    return str(dtype).replace("torch.", "")


@dataclass(frozen=True)
class Case:
    """One attention problem: q (batch, seqlen_q, nheads, head_dim), k/v (batch, seqlen_k, nheads_k, head_dim)."""

    batch: int
    seqlen_q: int
    seqlen_k: int
    nheads: int
    nheads_k: int
    head_dim: int
    dtype: torch.dtype
    causal: bool

    @property
    def group(self) -> int:
        return self.nheads // self.nheads_k

    @property
    def sdpa_agrees(self) -> bool:
        """SDPA's causal mask is top-left aligned, ours bottom-right: they agree when not causal or M == N."""
        return not self.causal or self.seqlen_q == self.seqlen_k

    def fields(self) -> Dict[str, Any]:
        d = asdict(self)
        d["dtype"] = dtype_name(self.dtype)
        return d


def grid(
    *,
    batch: int,
    seqlens: Iterable[Tuple[int, int]],
    heads: Iterable[Tuple[int, int]],
    head_dims: Iterable[int],
    dtypes: Iterable[torch.dtype],
    causal: Iterable[bool] = (False, True),
) -> List[Case]:
    """Every combination of (seqlen_q, seqlen_k) x (nheads, nheads_k) x head_dim x dtype x causal."""
    return [
        Case(batch, m, n, h, hk, d, dt, c)
        for (m, n), (h, hk), d, dt, c in itertools.product(seqlens, heads, head_dims, dtypes, causal)
    ]


LAYOUTS = ("bshd", "bhsd", "nan_padded")


def make_inputs(
    case: Case, device, seed: int = 0, layout: str = "bshd"
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Standard-normal q, k, v of `case` on `device`, reproducible for a given seed and device.

    layout "bshd": contiguous (batch, seqlen, heads, head_dim) tensors; "bhsd": contiguous
    (batch, heads, seqlen, head_dim) buffers seen through .transpose(1, 2); "nan_padded": buffers
    8 columns wider than head_dim, sliced to [..., :head_dim], whose extra columns hold NaN, so a
    kernel that reads past head_dim poisons its output.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"Expected layout to be one of {LAYOUTS}, got {layout!r}.")
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)

    def randn(seqlen, heads):
        d = case.head_dim
        if layout == "bhsd":
            shape = (case.batch, heads, seqlen, d)
        else:
            shape = (case.batch, seqlen, heads, d + (8 if layout == "nan_padded" else 0))
        t = torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(case.dtype)
        if layout == "bhsd":
            return t.transpose(1, 2)
        if layout == "nan_padded":
            t[..., d:] = float("nan")  # poison: must never be read
            return t[..., :d]
        return t

    q = randn(case.seqlen_q, case.nheads)
    k = randn(case.seqlen_k, case.nheads_k)
    v = randn(case.seqlen_k, case.nheads_k)
    return q, k, v


def kernel_block_n(head_dim: int, dtype: torch.dtype, device, causal: bool = False) -> int:
    """BLOCK_N (keys per tile) the prefill forward kernel uses for this head dim, dtype and device."""
    import triton

    from ._configs import prefill_fwd_config

    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    return prefill_fwd_config(head_dim_pad, dtype, causal, torch.device(device)).block_n


def copies_during(fn: Callable[[], Any]) -> Optional[List[str]]:
    """Names of the copy-making aten ops (copy_, clone, contiguous, cat, ...) that run inside fn().

    On a GPU, flash_attn_func on any strided view should make none: it only allocates its outputs.
    (Under the Triton interpreter the interpreter itself copies every argument's storage to emulate
    device memory, so the list is not meaningful there.) Returns None if this torch lacks dispatch modes.
    """
    try:
        from torch.utils._python_dispatch import TorchDispatchMode
    except ImportError:
        return None
    copy_like = ("copy_", "clone", "_to_copy", "contiguous", "cat", "index", "index_select", "repeat_interleave")

    class _Log(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops: List[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if name in copy_like:
                self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    with _Log() as log:
        fn()
    return log.ops


def _bound(dtype: torch.dtype, eager_err: float, factor: float, grad: bool) -> float:
    """The largest error the rule accepts for a kernel in `dtype` (see the module docstring)."""
    if dtype == torch.float32:
        if not is_interpreter():
            return FP32_RTOL_GPU
        return FP32_GRAD_RTOL_INTERPRET if grad else FP32_RTOL_INTERPRET
    return factor * eager_err + ATOL_FLOOR[dtype]


def _ratio(err: float, eager_err: float) -> float:
    return err / eager_err if eager_err > 0 else math.nan


def _finite(t: torch.Tensor) -> bool:
    return bool(torch.isfinite(t).all().item())


# --------------------------------------------------------------------------------------------
# Error tables
# --------------------------------------------------------------------------------------------
def padded_keys_table(cases: Sequence[Case], device, block_n: int, *, seed: int = 0, factor: float = FWD_FACTOR):
    """Our kernel vs an emulated kernel WITHOUT the key-length mask, both against the fp32 reference.

    The emulation (kernels.reference.attention_padded_keys_ref) pads K/V with zero keys up to a
    multiple of block_n and lets them into the softmax. Columns: the case, block_n, padded_keys,
    err_kernel, err_unmasked (both vs the fp32 reference), eager_err (PyTorch same-dtype), bound
    (the rule's bound for the kernel), ok (kernel within bound, finite).
    """
    import pandas as pd

    from .reference import attention_padded_keys_ref

    rows = []
    for i, case in enumerate(cases):
        q, k, v = make_inputs(case, device, seed + i)
        with torch.no_grad():
            out = flash_attn_func(q, k, v, causal=case.causal)
            ref, _ = attention_ref(q.float(), k.float(), v.float(), causal=case.causal)
            same = ref if case.dtype == torch.float32 else attention_ref(q, k, v, causal=case.causal, upcast=False)[0]
            unmasked, _ = attention_padded_keys_ref(q.float(), k.float(), v.float(), block_n, causal=case.causal)
        err, eager_err = rel_err(out, ref), rel_err(same, ref)
        bound = _bound(case.dtype, eager_err, factor, grad=False)
        rows.append({
            **case.fields(), "block_n": block_n, "padded_keys": -(-case.seqlen_k // block_n) * block_n - case.seqlen_k,
            "err_kernel": err, "err_unmasked": rel_err(unmasked, ref), "eager_err": eager_err, "bound": bound,
            "ok": bool(_finite(out) and err <= bound),
        })
    return pd.DataFrame(rows)


def forward_error_table(
    cases: Sequence[Case], device, *, seed: int = 0, factor: float = FWD_FACTOR, layout: str = "bshd"
):
    """Run flash_attn_func and the references over `cases`; one row per case.

    Columns: the case, then
      err_fp32   kernel vs the fp32 eager reference (the ground truth),
      eager_err  PyTorch's eager attention in the same dtype vs the fp32 reference (the yardstick),
      ratio      err_fp32 / eager_err (the rule wants <= factor; NaN for fp32 inputs),
      err_eager  kernel vs the same-dtype eager reference,
      err_sdpa   kernel vs torch SDPA in fp32 (NaN where SDPA's causal convention differs),
      sdpa_err   SDPA in the same dtype vs the fp32 reference (PyTorch's fused kernel, for scale),
      lse_diff   max |lse - lse_ref| over rows that see a key,
      bound, ok  the rule's bound on err_fp32, and whether output, LSE and +inf rows all pass.
    layout: how the inputs are laid out in memory (see make_inputs); the references get the same values.
    """
    import pandas as pd

    rows = []
    for i, case in enumerate(cases):
        q, k, v = make_inputs(case, device, seed + i, layout)
        with torch.no_grad():
            out, lse = flash_attn_func(q, k, v, causal=case.causal, return_softmax_lse=True)
            ref, lse_ref = attention_ref(q.float(), k.float(), v.float(), causal=case.causal)
            if case.dtype == torch.float32:
                same = ref
            else:
                same, _ = attention_ref(q, k, v, causal=case.causal, upcast=False)
            err_sdpa = sdpa_err = math.nan
            if case.sdpa_agrees:
                sdpa32 = attention_sdpa(q.float(), k.float(), v.float(), causal=case.causal)
                err_sdpa = rel_err(out, sdpa32)
                sdpa_same = sdpa32 if case.dtype == torch.float32 else attention_sdpa(q, k, v, causal=case.causal)
                sdpa_err = rel_err(sdpa_same, ref)
        err, eager_err = rel_err(out, ref), rel_err(same, ref)
        bound = _bound(case.dtype, eager_err, factor, grad=False)
        inf_ref = torch.isposinf(lse_ref)
        inf_ok = torch.equal(torch.isposinf(lse), inf_ref) and not torch.isnan(lse).any().item()
        lse_diff = (lse[~inf_ref] - lse_ref[~inf_ref]).abs().max().item() if (~inf_ref).any() else 0.0
        lse_tol = LSE_ATOL_FP32_GPU if (case.dtype == torch.float32 and not is_interpreter()) else LSE_ATOL[case.dtype]
        ok = _finite(out) and err <= bound and inf_ok and lse_diff <= lse_tol
        rows.append({
            **case.fields(),
            "err_fp32": err, "eager_err": eager_err, "ratio": _ratio(err, eager_err),
            "err_eager": rel_err(out, same), "err_sdpa": err_sdpa, "sdpa_err": sdpa_err,
            "lse_diff": lse_diff, "bound": bound, "ok": bool(ok),
        })
        if layout != "bshd":
            rows[-1]["layout"] = layout
    return pd.DataFrame(rows)


def _grads(fn: Callable, tensors: Sequence[torch.Tensor], dout: torch.Tensor) -> Tuple[torch.Tensor, ...]:
    """Gradients of <fn(*leaves), dout> with respect to fresh leaves made from `tensors`."""
    leaves = [t.detach().requires_grad_() for t in tensors]
    out = fn(*leaves)
    return torch.autograd.grad(out, leaves, dout)


def grad_error_table(cases: Sequence[Case], device, *, seed: int = 0, factor: float = GRAD_FACTOR):
    """Gradients of flash_attn_func vs autograd through the references; one row per (case, dq/dk/dv).

    Columns as in forward_error_table (err_fp32, eager_err, ratio, err_eager, err_sdpa, sdpa_err,
    bound, ok), for the gradient named in `grad`. dK/dV of GQA/MQA are compared with autograd through
    repeat_interleave, which sums each KV head's gradient over its group of q heads.
    """
    import pandas as pd

    rows = []
    for i, case in enumerate(cases):
        q, k, v = make_inputs(case, device, seed + i)
        gen = torch.Generator(device=device)
        gen.manual_seed(10_000 + seed + i)
        dout = torch.randn(q.shape, generator=gen, device=device, dtype=torch.float32).to(case.dtype)
        c = case.causal
        g_ker = _grads(lambda a, b, d: flash_attn_func(a, b, d, causal=c), (q, k, v), dout)
        f32 = [t.float() for t in (q, k, v)]
        g_ref = _grads(lambda a, b, d: attention_ref(a, b, d, causal=c)[0], f32, dout.float())
        if case.dtype == torch.float32:
            g_same = g_ref
        else:
            g_same = _grads(lambda a, b, d: attention_ref(a, b, d, causal=c, upcast=False)[0], (q, k, v), dout)
        g_sdpa32 = g_sdpa_same = (None, None, None)
        if case.sdpa_agrees:
            g_sdpa32 = _grads(lambda a, b, d: attention_sdpa(a, b, d, causal=c), f32, dout.float())
            g_sdpa_same = g_sdpa32 if case.dtype == torch.float32 else _grads(
                lambda a, b, d: attention_sdpa(a, b, d, causal=c), (q, k, v), dout)
        for name, gk, gr, gs, s32, ss in zip(("dq", "dk", "dv"), g_ker, g_ref, g_same, g_sdpa32, g_sdpa_same):
            err, eager_err = rel_err(gk, gr), rel_err(gs, gr)
            bound = _bound(case.dtype, eager_err, factor, grad=True)
            rows.append({
                **case.fields(), "grad": name,
                "err_fp32": err, "eager_err": eager_err, "ratio": _ratio(err, eager_err),
                "err_eager": rel_err(gk, gs),
                "err_sdpa": rel_err(gk, s32) if s32 is not None else math.nan,
                "sdpa_err": rel_err(ss, gr) if ss is not None else math.nan,
                "bound": bound, "ok": bool(_finite(gk) and err <= bound),
            })
    return pd.DataFrame(rows)


def assert_table_ok(table, what: str) -> None:
    """Raise AssertionError listing the failing rows of an error table; print a one-line summary otherwise."""
    import pandas as pd

    bad = table[~table["ok"]]
    if len(bad):
        with pd.option_context("display.width", 250, "display.max_columns", 50):
            raise AssertionError(
                f"{what}: {len(bad)} of {len(table)} rows break the rule "
                f"(err_fp32 <= bound; finite; LSE where present):\n{bad.to_string()}"
            )
    err_cols = ["err_fp32"] if "err_fp32" in table.columns else [c for c in table.columns if c.startswith("err_")]
    largest = f"; largest {'/'.join(err_cols)} {table[err_cols].max().max():.2e}" if err_cols else ""
    ratio = table["ratio"].dropna() if "ratio" in table.columns else []
    worst = f", worst kernel/eager ratio {ratio.max():.2f}" if len(ratio) else ""
    print(f"{what}: all {len(table)} rows pass{largest}{worst}")


def show(table, float_format: str = "{:.3g}") -> None:
    """Display a DataFrame: a rich table in Jupyter/Colab, plain text when cells are exec'd headless."""
    import pandas as pd

    shell = None
    try:
        from IPython import get_ipython

        shell = get_ipython()
    except ImportError:
        pass
    with pd.option_context(
        "display.float_format", float_format.format, "display.width", 250,
        "display.max_columns", 50, "display.max_rows", 500,
    ):
        if shell is not None:
            from IPython.display import display

            display(table)
        else:
            print(table.to_string())


# --------------------------------------------------------------------------------------------
# GQA checks
# --------------------------------------------------------------------------------------------
def gqa_group_sum_table(cases: Sequence[Case], device, *, seed: int = 0):
    """GQA/MQA vs the same kernel on K/V expanded with repeat_interleave (plain MHA), per case.

    The MHA run gives one dK/dV per q head; summing them over each group of q heads must give the
    GQA kernel's dK/dV of the group's KV head. Columns: err_out (GQA out vs expanded out), err_dq,
    err_dk, err_dv (vs the expanded gradients summed over each group, in fp32), bound, ok.
    """
    import pandas as pd

    rows = []
    for i, case in enumerate(cases):
        q, k, v = make_inputs(case, device, seed + i)
        gen = torch.Generator(device=device)
        gen.manual_seed(20_000 + seed + i)
        dout = torch.randn(q.shape, generator=gen, device=device, dtype=torch.float32).to(case.dtype)
        g, c = case.group, case.causal
        out_g = flash_attn_func(q, k, v, causal=c)
        dq_g, dk_g, dv_g = _grads(lambda a, b, d: flash_attn_func(a, b, d, causal=c), (q, k, v), dout)
        k_exp, v_exp = k.repeat_interleave(g, dim=2), v.repeat_interleave(g, dim=2)  # the copies GQA avoids
        out_e = flash_attn_func(q, k_exp, v_exp, causal=c)
        dq_e, dk_e, dv_e = _grads(lambda a, b, d: flash_attn_func(a, b, d, causal=c), (q, k_exp, v_exp), dout)
        shape = (case.batch, case.seqlen_k, case.nheads_k, g, case.head_dim)
        dk_sum, dv_sum = dk_e.float().view(shape).sum(3), dv_e.float().view(shape).sum(3)
        if case.dtype == torch.float32:
            bound = FP32_GRAD_RTOL_INTERPRET if is_interpreter() else FP32_RTOL_GPU
        else:
            bound = 1e-2  # the expanded path rounds each q head's dK/dV before the sum, GQA once after it
        errs = {
            "err_out": rel_err(out_g, out_e), "err_dq": rel_err(dq_g, dq_e),
            "err_dk": rel_err(dk_g, dk_sum), "err_dv": rel_err(dv_g, dv_sum),
        }
        finite = all(_finite(t) for t in (out_g, dq_g, dk_g, dv_g))
        rows.append({**case.fields(), "group": g, **errs, "bound": bound,
                     "ok": bool(finite and max(errs.values()) <= bound)})
    return pd.DataFrame(rows)


def kv_bytes_table(batch: int, seqlen: int, nheads: int, nheads_k: Iterable[int], head_dim: int, dtype: torch.dtype):
    """K+V bytes (MiB) held by GQA (nheads_k heads) vs K/V expanded to nheads heads, per nheads_k."""
    import pandas as pd

    itemsize = torch.empty((), dtype=dtype).element_size()
    rows = []
    for hk in nheads_k:
        native = 2 * batch * seqlen * hk * head_dim * itemsize
        expanded = 2 * batch * seqlen * nheads * head_dim * itemsize
        rows.append({
            "nheads": nheads, "nheads_k": hk, "group": nheads // hk, "kv_mib_gqa": native / 2**20,
            "kv_mib_expanded": expanded / 2**20, "extra_mib_expanding": (expanded - native) / 2**20,
        })
    return pd.DataFrame(rows)


# --------------------------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------------------------
def check_errors(cases: Sequence[Tuple[str, Callable[[], Any], type]]):
    """Run each (label, call, expected exception type); print what each raised; assert the types.

    Returns a DataFrame (call, expected, raised, message). Raises AssertionError after running all
    of them if any call raised nothing or another type.
    """
    import pandas as pd

    rows, wrong = [], []
    for label, call, expected in cases:
        try:
            call()
        except Exception as exc:  # noqa: BLE001 - we report whatever came
            raised, message = type(exc), str(exc)
        else:
            raised, message = None, "(no exception)"
        name = raised.__name__ if raised is not None else "nothing"
        print(f"{label}\n    -> {name}: {message}\n")
        ok = raised is not None and issubclass(raised, expected)
        if not ok:
            wrong.append(f"{label}: expected {expected.__name__}, got {name} ({message})")
        rows.append({"call": label, "expected": expected.__name__, "raised": name, "ok": ok, "message": message})
    if wrong:
        raise AssertionError("bad input not rejected as documented:\n  " + "\n  ".join(wrong))
    return pd.DataFrame(rows)


# --------------------------------------------------------------------------------------------
# Benchmarks (GPU)
# --------------------------------------------------------------------------------------------
# Result rows share their column names with scripts/bench_prefill.py (mode, impl, dtype as "bf16",
# batch, seqlen, nheads, nheads_k, head_dim, causal, tflops, median_ms, ...), so that both write and
# read the same results/<gpu>/prefill_<mode>.csv; the notebooks add label, group and peak_mem_mib.
Provider = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool], torch.Tensor]

LABELS = {
    "ours": "Triton (ours)",
    "sdpa": "SDPA (auto)",
    "sdpa_flash": "SDPA flash (FA2)",
    "sdpa_cudnn": "SDPA cuDNN",
    "flex": "FlexAttention (compiled)",
    "sdpa_gqa": "SDPA enable_gqa=True",
    "sdpa_expand_kv": "repeat_interleave K/V + SDPA",
}
SHORT_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def short_dtype(dtype: Union[torch.dtype, str]) -> str:
    """'bf16' for torch.bfloat16 or 'bfloat16' (the results/ CSV convention)."""
    name = dtype_name(dtype) if isinstance(dtype, torch.dtype) else str(dtype)
    return SHORT_DTYPES.get(name, name)


def _ours(q, k, v, causal):
    return flash_attn_func(q, k, v, causal=causal)


def _sdpa(q, k, v, causal, **kw):
    """SDPA on our (b, s, h, d) tensors seen as (b, h, s, d) views (no copies; flash reads this layout)."""
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal, **kw)
    return out.transpose(1, 2)


def _with_backend(backend_name: str) -> Optional[Provider]:
    """SDPA restricted to one backend, or None when this torch cannot restrict it."""
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        return None
    backend = getattr(SDPBackend, backend_name, None)
    if backend is None:
        return None

    def fn(q, k, v, causal):
        with sdpa_kernel(backend):
            return _sdpa(q, k, v, causal)

    return fn


def prefill_providers() -> Dict[str, Provider]:
    """MHA competitors: ours, SDPA's own choice, and SDPA's flash and cuDNN backends where this torch has them.

    A provider that turns out unsupported on this GPU is skipped by `measure` with a message.
    """
    providers: Dict[str, Provider] = {"ours": _ours, "sdpa": _sdpa}
    for key, backend in (("sdpa_flash", "FLASH_ATTENTION"), ("sdpa_cudnn", "CUDNN_ATTENTION")):
        fn = _with_backend(backend)
        if fn is None:
            print(f"note: this torch cannot select SDPA's {backend} backend; {LABELS[key]} is skipped")
        else:
            providers[key] = fn
    return providers


def _sdpa_expand_kv(q, k, v, causal):
    """What models did before GQA support: materialise K/V per q head, then plain MHA attention."""
    group = q.shape[2] // k.shape[2]
    return _sdpa(q, k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2), causal)


def gqa_providers() -> Dict[str, Provider]:
    """GQA competitors: ours, SDPA with enable_gqa=True (when this torch has it), and expanded K/V + SDPA."""
    providers: Dict[str, Provider] = {"ours": _ours}
    if sdpa_supports_enable_gqa():
        providers["sdpa_gqa"] = lambda q, k, v, causal: _sdpa(q, k, v, causal, enable_gqa=True)
    else:
        print(f"note: torch {torch.__version__} has no enable_gqa in scaled_dot_product_attention (needs >= 2.5); "
              f"{LABELS['sdpa_gqa']} is skipped")
    providers["sdpa_expand_kv"] = _sdpa_expand_kv
    return providers


def measure(
    providers: Mapping[str, Provider],
    shapes: Iterable[Mapping[str, int]],
    *,
    dtype: torch.dtype = torch.bfloat16,
    causal_values: Iterable[bool] = (False, True),
    modes: Iterable[str] = ("fwd", "fwd_bwd"),
    warmup: int = 5,
    rep: int = 30,
    device="cuda",
) -> List[Dict[str, Any]]:
    """Median latency and peak-memory delta of each provider on each shape; one result row each.

    shapes: mappings with batch, seqlen, nheads, nheads_k, head_dim (self-attention: seqlen_q == seqlen_k).
    modes: "fwd" (inference: inputs without grad) and/or "fwd_bwd" (forward, then autograd.grad of
    q, k, v). Rows come from kernels.bench.make_row (GPU, versions, date, commit stamped) with mode,
    impl, label, dtype, the shape, group, causal, tflops, median_ms, p20_ms, p80_ms, min_ms and
    peak_mem_mib. A provider that fails on a shape (unsupported backend, out of memory) is skipped
    with a message.
    """
    rows: List[Dict[str, Any]] = []
    for shape in shapes:
        rows += _measure_shape(providers, shape, dtype, tuple(causal_values), tuple(modes), warmup, rep, device)
        torch.cuda.empty_cache()
    return rows


def _measure_shape(providers, shape, dtype, causal_values, modes, warmup, rep, device) -> List[Dict[str, Any]]:
    """measure() for one shape; its inputs are freed when this returns."""
    s = shape["seqlen"]
    case = Case(shape["batch"], s, s, shape["nheads"], shape["nheads_k"], shape["head_dim"], dtype, False)
    q, k, v = make_inputs(case, device)
    dout = torch.randn_like(q)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    rows = []
    for causal, mode, (key, provider) in itertools.product(causal_values, modes, providers.items()):
        if mode == "fwd":
            def fn(provider=provider, causal=causal):
                with torch.no_grad():
                    return provider(q, k, v, causal)
        else:
            def fn(provider=provider, causal=causal):
                return torch.autograd.grad(provider(*leaves, causal), leaves, dout)
        what = f"{LABELS.get(key, key)} {mode} causal={causal} {dict(shape)}"
        try:
            fn()  # compile / pick algorithms before timing; fails early if unsupported
            timing = bench.time_fn(fn, warmup=warmup, rep=rep)
            peak = bench.peak_memory_delta(fn)
        except (RuntimeError, NotImplementedError, ValueError) as exc:
            print(f"skip {what}: {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}")
            torch.cuda.empty_cache()
            continue
        flops = bench.attention_flops(case.batch, case.nheads, s, s, case.head_dim, causal, mode)
        row = bench.make_row(
            mode=mode, impl=key, label=LABELS.get(key, key), dtype=short_dtype(dtype), batch=case.batch, seqlen=s,
            nheads=case.nheads, nheads_k=case.nheads_k, group=case.group, head_dim=case.head_dim, causal=causal,
            tflops=bench.tflops(flops, timing["median_ms"]), **timing, peak_mem_mib=peak / 2**20,
        )
        rows.append(row)
        print(f"{what}: {row['median_ms']:.3f} ms, {row['tflops']:.0f} TFLOP/s, peak +{row['peak_mem_mib']:.0f} MiB")
    return rows


def save_results(rows: Sequence[Mapping[str, Any]], prefix: str, results_dir: Union[str, Path] = "results"):
    """Append measured rows to results/<gpu>/<prefix>_<mode>.csv, one CSV per mode; returns them as a DataFrame."""
    import pandas as pd

    for mode in sorted({r["mode"] for r in rows}):
        path = bench.write_csv([r for r in rows if r["mode"] == mode], f"{prefix}_{mode}", results_dir=results_dir)
        print(f"wrote {path}")
    if not rows:
        print("nothing was measured: every provider was skipped")
        return None
    return normalize_results(pd.DataFrame(list(rows)))


# --------------------------------------------------------------------------------------------
# Results and plots
# --------------------------------------------------------------------------------------------
_KEY_COLUMNS = ("gpu", "impl", "mode", "batch", "seqlen", "nheads", "nheads_k", "head_dim", "dtype", "causal")


def normalize_results(df):
    """Bring result rows to one convention: impl (older rows: provider), seqlen (older: seqlen_k), short
    dtype names ('bf16'), boolean causal, group = nheads // nheads_k, and a peak_mem_mib column (NaN
    where a benchmark did not measure memory)."""
    df = df.copy()
    for new, old in (("impl", "provider"), ("seqlen", "seqlen_k")):
        if old in df.columns:
            df[new] = df[new].fillna(df[old]) if new in df.columns else df[old]
    if "dtype" in df.columns:
        df["dtype"] = df["dtype"].astype(str).map(lambda name: SHORT_DTYPES.get(name, name))
    if "causal" in df.columns:
        df["causal"] = df["causal"].astype(str).str.lower().isin(["true", "1", "1.0"])
    if "group" not in df.columns and {"nheads", "nheads_k"} <= set(df.columns):
        df["group"] = df["nheads"] // df["nheads_k"]
    if "peak_mem_mib" not in df.columns:
        df["peak_mem_mib"] = math.nan
    return df


def load_results(*names: str, results_dir: Union[str, Path] = "results"):
    """Committed results/<gpu>/<name>.csv of every GPU for each name, as one normalized DataFrame; None if none.

    A name without results prints a note ("no committed GPU results yet ...") instead of failing.
    """
    import pandas as pd

    frames = []
    for name in names:
        try:
            df = bench.read_csv(name, results_dir=results_dir)
        except FileNotFoundError:
            print(f"no committed GPU results yet for {name!r} (looked for {results_dir}/<gpu>/{name}.csv); "
                  f"run this notebook on a GPU to measure them.")
            continue
        gpus = ", ".join(sorted(map(str, df["gpu"].unique()))) if "gpu" in df.columns else "an unnamed GPU"
        print(f"loaded {len(df)} rows of {name!r} measured on {gpus}")
        frames.append(df)
    if not frames:
        return None
    return normalize_results(pd.concat(frames, ignore_index=True))


def _latest(df):
    """Drop repeated measurements of the same configuration, keeping the last one written."""
    keys = [c for c in _KEY_COLUMNS if c in df.columns]
    return df.drop_duplicates(subset=keys, keep="last") if keys else df


def _select(df, where: Optional[Mapping[str, Any]]):
    """Rows matching every column == value of `where` (columns missing from df are ignored with a note)."""
    for col, value in (where or {}).items():
        if col not in df.columns:
            print(f"note: results have no column {col!r}; not filtering on it")
            continue
        if isinstance(value, bool):
            df = df[df[col].astype(bool) == value]
        else:
            df = df[df[col].astype(str) == str(value)]
    return df


def plot_lines(
    df,
    *,
    x: str,
    name: str,
    title: str,
    where: Optional[Mapping[str, Any]] = None,
    x_label: Optional[str] = None,
    logx: bool = True,
    figures_dir: Union[str, Path] = "figures",
) -> List[Path]:
    """Latency (top) and peak-memory (bottom) lines per implementation, one column per causal value.

    One figure per (GPU, mode) in df, saved as figures/<gpu-slug>/<name>_<mode>.png (relative
    figures_dir is taken from the repo root) and titled with the GPU, torch and triton versions the
    numbers came from. Returns the saved paths; a df without the needed columns is skipped with a note.
    """
    import matplotlib
    import matplotlib.pyplot as plt

    df = normalize_results(df)
    missing = {x, "impl", "median_ms", "mode", "causal", "gpu"} - set(df.columns)
    if missing:
        print(f"note: cannot plot {name}: the results lack columns {sorted(missing)}")
        return []
    df = _latest(_select(df, where))
    if df.empty:
        print(f"note: no rows of {name} match {dict(where or {})}; nothing to plot")
        return []
    root = Path(figures_dir)
    root = root if root.is_absolute() else bench.REPO_ROOT / root
    saved = []
    for (gpu, mode), sub in df.groupby(["gpu", "mode"], sort=True):
        causal_values = sorted(sub["causal"].unique())
        has_mem = bool(sub["peak_mem_mib"].notna().any())  # scripts/bench_prefill.py rows carry no memory
        nrows = 2 if has_mem else 1
        fig, axes = plt.subplots(nrows, len(causal_values), figsize=(6.0 * len(causal_values), 3.75 * nrows + 0.5),
                                 squeeze=False, sharex="col")
        for col, causal in enumerate(causal_values):
            part = sub[sub["causal"] == causal]
            for impl, line in part.groupby("impl", sort=False):
                line = line.sort_values(x)
                label = LABELS.get(impl, impl)
                style = {"linewidth": 2.5} if impl == "ours" else {"linewidth": 1.5}
                axes[0, col].plot(line[x], line["median_ms"], marker="o", label=label, **style)
                if has_mem and line["peak_mem_mib"].notna().any():
                    axes[1, col].plot(line[x], line["peak_mem_mib"], marker="o", label=label, **style)
            axes[0, col].set_title("causal" if causal else "non-causal")
            axes[0, col].set_ylabel("median latency (ms)")
            if has_mem:
                axes[1, col].set_ylabel("peak memory beyond inputs (MiB)")
                axes[1, col].set_ylim(bottom=0)
            axes[nrows - 1, col].set_xlabel(x_label or x)
            for row in range(nrows):
                ax = axes[row, col]
                if logx:
                    ax.set_xscale("log", base=2)
                    ax.set_xticks(sorted(part[x].unique()))
                    ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
                ax.grid(True, alpha=0.3)
            axes[0, col].set_yscale("log")
            axes[0, col].yaxis.set_major_locator(matplotlib.ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
            axes[0, col].yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda value, _: f"{value:g}"))
            axes[0, col].yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
            axes[0, col].legend(fontsize=8)
        versions = ", ".join(f"{c} {sub[c].iloc[0]}" for c in ("torch", "triton") if c in sub.columns)
        dates = sorted({str(d)[:10] for d in sub["date"].unique()}) if "date" in sub.columns else []
        when = f", measured {dates[0]}" + (f"..{dates[-1]}" if len(dates) > 1 else "") if dates else ""
        fig.suptitle(f"{title} [{mode}] on {gpu}\n({versions}{when}"
                     f"{'' if has_mem else '; peak memory not measured in these results'})", fontsize=11)
        fig.tight_layout()
        path = root / bench.gpu_slug(str(gpu)) / f"{name}_{mode}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110, metadata={"Software": None})
        saved.append(path)
        print(f"saved {path.relative_to(bench.REPO_ROOT) if path.is_relative_to(bench.REPO_ROOT) else path}")
        if "agg" not in matplotlib.get_backend().lower():
            plt.show()
        plt.close(fig)
    return saved


def summary_table(df, *, x: str, baselines: Sequence[str], where: Optional[Mapping[str, Any]] = None):
    """TFLOP/s per implementation (columns) by gpu, mode, causal and x, plus ours / each present baseline."""
    df = _latest(_select(normalize_results(df), where))
    table = df.pivot_table(index=["gpu", "mode", "causal", x], columns="impl", values="tflops")
    for baseline in baselines:
        if "ours" in table.columns and baseline in table.columns:
            table[f"ours/{baseline}"] = table["ours"] / table[baseline]
    return table
