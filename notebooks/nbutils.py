"""Helpers the notebooks share, so that their cells only narrate, call, check and plot.

The notebooks import this module after their setup cell has put the repo root and notebooks/ on
sys.path. It holds no kernel and no reference code (those are in kernels/) and no benchmark harness
(benchmarks/ measures; `run_suite` and `bench_results` are how the notebooks call it).

- `sizes`, `decode_sizes`, `serving_sizes`: the shapes of each notebook, small under the Triton
  interpreter (CPU), full on a GPU.
- `Case`, `grid`, `make_inputs`, `decode_inputs`: attention problems and their seeded inputs.
- Check tables (pandas DataFrames, judged by the error rule of tritonattn.testing; `assert_table_ok`
  fails loudly with the offending rows): `forward_error_table`, `grad_error_table`,
  `padded_keys_table`, `gqa_group_sum_table`, the decode tables (`decode_equivalence_table`,
  `decode_ragged_table`, `decode_split_table`, `decode_causal_table`, `decode_append_table`,
  `kvcache_round_trip_table`), `chunked_prefill_table`; `check_errors` for calls that must raise.
- Arithmetic tables: `kv_bytes_table`, `decode_roofline_table`.
- Benchmarks: `run_suite` (the benchmark suite on a notebook's shapes, GPU only), `bench_results`
  (its rows, measured now or committed), `plot_lines`, `summary_table`, `plot_decode`,
  `decode_summary_table`: notebook views of those rows, titled with the GPU they came from.
- Serving (notebook 04): `engine_from_sizes`, `summary`, `save_stats`, `load_stats`, `plot_serving`.
- `show`: a DataFrame as a rich table in Jupyter/Colab, as text when the cells run headless.
"""

from __future__ import annotations

import datetime
import itertools
import math
import numbers
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from benchmarks import measure, report, results, suite
from benchmarks.competitors import attention_sdpa
from benchmarks.grids import LABELS
from benchmarks.serving import ServingEngine, check_attention
from tritonattn import KVCache, PagedKVCache, flash_attn_func, flash_attn_with_kvcache
from tritonattn.config.hardware import device_target
from tritonattn.config.options import head_dim_tile
from tritonattn.config.tables import prefill_fwd_config
from tritonattn.testing import (
    agreement_tolerance,
    attention_padded_keys_ref,
    attention_ref,
    check_lse,
    error_bound,
    per_request_references,
    rel_err,
)


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
            head_dims=(13, 48, 80, 100, 192),
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
        head_dims=(13, 48, 80, 100),
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
    return prefill_fwd_config(head_dim_tile(head_dim), dtype, causal, device_target(torch.device(device))).block_n


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


def _ratio(err: float, eager_err: float) -> float:
    return err / eager_err if eager_err > 0 else math.nan


def _finite(t: torch.Tensor) -> bool:
    return bool(torch.isfinite(t).all().item())


# --------------------------------------------------------------------------------------------
# Error tables
# --------------------------------------------------------------------------------------------
def padded_keys_table(cases: Sequence[Case], device, block_n: int, *, seed: int = 0):
    """Our kernel vs an emulated kernel WITHOUT the key-length mask, both against the fp32 reference.

    The emulation (tritonattn.testing.attention_padded_keys_ref) pads K/V with zero keys up to a
    multiple of block_n and lets them into the softmax. Columns: the case, block_n, padded_keys,
    err_kernel, err_unmasked (both vs the fp32 reference), eager_err (PyTorch same-dtype), bound
    (the rule's bound for the kernel), ok (kernel within bound, finite).
    """
    import pandas as pd

    rows = []
    for i, case in enumerate(cases):
        q, k, v = make_inputs(case, device, seed + i)
        with torch.no_grad():
            out = flash_attn_func(q, k, v, causal=case.causal)
            ref, _ = attention_ref(q.float(), k.float(), v.float(), causal=case.causal)
            same = ref if case.dtype == torch.float32 else attention_ref(q, k, v, causal=case.causal, upcast=False)[0]
            unmasked, _ = attention_padded_keys_ref(q.float(), k.float(), v.float(), block_n, causal=case.causal)
        err, eager_err = rel_err(out, ref), rel_err(same, ref)
        bound = error_bound(case.dtype, eager_err)
        rows.append({
            **case.fields(), "block_n": block_n, "padded_keys": -(-case.seqlen_k // block_n) * block_n - case.seqlen_k,
            "err_kernel": err, "err_unmasked": rel_err(unmasked, ref), "eager_err": eager_err, "bound": bound,
            "ok": bool(_finite(out) and err <= bound),
        })
    return pd.DataFrame(rows)


def forward_error_table(
    cases: Sequence[Case], device, *, seed: int = 0, layout: str = "bshd"
):
    """Run flash_attn_func and the references over `cases`; one row per case.

    Columns: the case, then
      err_fp32   kernel vs the fp32 eager reference (the ground truth),
      eager_err  PyTorch's eager attention in the same dtype vs the fp32 reference (the yardstick),
      ratio      err_fp32 / eager_err (the rule wants <= 2; NaN for fp32 inputs),
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
        bound = error_bound(case.dtype, eager_err)
        lse_ok, lse_diff = check_lse(lse, lse_ref, case.dtype)
        ok = _finite(out) and err <= bound and lse_ok
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


def grad_error_table(cases: Sequence[Case], device, *, seed: int = 0):
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
            bound = error_bound(case.dtype, eager_err, grad=True)
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
        # two kernel paths on the same data: the expanded path rounds each q head's dK/dV before the sum,
        # GQA once after it
        bound = agreement_tolerance(case.dtype)
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
# Benchmarks: the suite of benchmarks/ on a notebook's shapes, and notebook views of its rows
# --------------------------------------------------------------------------------------------
def run_suite(suites: Sequence[str], shapes: Sequence[Any], *, peers: Optional[Sequence[str]] = None,
              dtypes: Sequence[str] = ("bf16",)) -> None:
    """Measure `shapes` (benchmarks.grids shape objects) with the benchmark suite on this GPU, for each
    of `suites`: its peers (or only `peers`), checked against the reference first, rows appended to
    results/<gpu>/bench_<suite>.csv with the GPU and versions (rows already measured at this commit
    are skipped). Figures are left to the notebook's own views."""
    suite.run(tuple(suites), shapes={name: list(shapes) for name in suites}, peers=peers, dtypes=dtypes,
              figures_dir=None, flex=False, log=say)


def say(line: str) -> None:
    """Print one line of a benchmark run. Passed as the suite's `log`, it also turns the progress bar off:
    the line per measurement is the progress, and a saved notebook keeps no bar redraws."""
    print(line, flush=True)


def bench_results(*suites: str):
    """The rows of the given suites (results/<gpu>/bench_<suite>.csv of every GPU: measured now or
    committed), normalized and status ok, as one DataFrame with a `suite` column; None when there is none."""
    import pandas as pd

    frames = []
    for name in suites:
        df = report.load_suite(name)
        if df is None:
            continue
        df = df[df["status"] == "ok"]
        gpus = ", ".join(sorted(map(str, df["gpu"].unique())))
        print(f"{len(df)} rows of bench_{name}.csv measured on {gpus}")
        frames.append(df)
    return pd.concat(frames, ignore_index=True) if frames else None


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
    figures_dir: Optional[Union[str, Path]] = None,
) -> List[Path]:
    """Latency (top) and peak-memory (bottom) lines per implementation, one column per causal value.

    One figure per (GPU, mode) in df, saved as <figures_dir>/<gpu-slug>/<name>_<mode>.png (default:
    `figures_root()`) and titled with the GPU, torch and triton versions the
    numbers came from. Returns the saved paths; a df without the needed columns is skipped with a note.
    """
    import matplotlib
    import matplotlib.pyplot as plt

    missing = {x, "impl", "median_ms", "mode", "causal", "gpu"} - set(df.columns)
    if missing:
        print(f"note: cannot plot {name}: the results lack columns {sorted(missing)}")
        return []
    df = _select(df, where)
    if df.empty:
        print(f"note: no rows of {name} match {dict(where or {})}; nothing to plot")
        return []
    saved = []
    for (gpu, mode), sub in df.groupby(["gpu", "mode"], sort=True):
        causal_values = sorted(sub["causal"].unique())
        has_mem = bool(sub["peak_mem_mib"].notna().any())
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
        fig.suptitle(f"{title} [{mode}] on {gpu}\n({report.versions_text(sub)}"
                     f"{'' if has_mem else '; peak memory not measured in these results'})", fontsize=11)
        fig.tight_layout()
        saved.append(report.save_figure(fig, figures_dir or figures_root(), gpu, f"{name}_{mode}"))
    return saved


def summary_table(df, *, x: str, baselines: Sequence[str], where: Optional[Mapping[str, Any]] = None):
    """TFLOP/s per implementation (columns) by gpu, mode, causal and x, plus ours / each present baseline."""
    table = _select(df, where).pivot_table(index=["gpu", "mode", "causal", x], columns="impl", values="tflops")
    for baseline in baselines:
        if "ours" in table.columns and baseline in table.columns:
            table[f"ours/{baseline}"] = table["ours"] / table[baseline]
    return table


# ============================================================================================
# Decode (notebook 02): checks on small shapes, measurements on a GPU, plots
# ============================================================================================
def decode_sizes(on_gpu: bool) -> SimpleNamespace:
    """Shapes for notebook 02: small under the interpreter (CPU), full on a GPU.

    Under the interpreter: 4 q heads over 4/2/1 KV heads, head dim 32, float16, lengths around the
    interpreter's BLOCK_N of 32 (31, 33, 65), caches of at most 160 rows. On a GPU: 32 q heads over
    32/8/4/1 KV heads, head dim 128, bfloat16, the issue's lengths (1 ... 257) and caches of 2-4K rows.
    The benchmark shape is the same on both (bf16, 32 q heads, 8 KV heads, head dim 128): on a CPU it
    only feeds the byte/FLOP table and the selection of committed results.
    """
    bench_shape = dict(
        bench_dtype=torch.bfloat16, bench_nheads=32, bench_nheads_k=8, bench_head_dim=128,
        bench_cache_lens=(1024, 4096, 16384, 65536), bench_batches=(1, 8),
    )
    if on_gpu:
        return SimpleNamespace(
            dtype=torch.bfloat16, nheads=32, head_dim=128, nheads_k=8,
            ar_batch=2, ar_nheads_k=(32, 8, 4, 1), ar_lengths=(1, 31, 33, 63, 65, 127, 257),
            ragged_lengths=(0, 1, 17, 1000, 3000, 4095), ragged_cache=4096, split_check_values=(1, 2, 3, 8, 0),
            split_seqlen_q=(1, 4), causal_seqlen_q=(4, 8), causal_lengths=(0, 3, 400, 2040), causal_cache=2048,
            causal_nheads_k=(8, 1), append_seqlen_q=(1, 5), append_lengths=(0, 1, 33, 200), append_cache=205,
            append_head_dim=120, kv_batch=2, kv_prompt=1000, kv_steps=(1, 1, 4, 1, 8), kv_new_prompt=37,
            **bench_shape,
        )
    return SimpleNamespace(
        dtype=torch.float16, nheads=4, head_dim=32, nheads_k=2,
        ar_batch=1, ar_nheads_k=(4, 2, 1), ar_lengths=(1, 31, 33, 65),
        ragged_lengths=(0, 1, 17, 100, 140), ragged_cache=160, split_check_values=(1, 2, 3, 0),
        split_seqlen_q=(1, 4), causal_seqlen_q=(4,), causal_lengths=(0, 3, 40, 100), causal_cache=110,
        causal_nheads_k=(2, 1), append_seqlen_q=(1, 5), append_lengths=(0, 1, 33, 95), append_cache=100,
        append_head_dim=40, kv_batch=2, kv_prompt=20, kv_steps=(1, 1, 3), kv_new_prompt=5,
        **bench_shape,
    )


def head_kind(nheads: int, nheads_k: int) -> str:
    """'MHA', 'GQA' or 'MQA' for nheads q heads over nheads_k KV heads."""
    return "MHA" if nheads == nheads_k else ("MQA" if nheads_k == 1 else "GQA")


def _generator(device, seed: int) -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


def _randn(shape, dtype: torch.dtype, device, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(dtype)


def decode_inputs(batch: int, seqlen_cache: int, seqlen_q: int, nheads: int, nheads_k: int, head_dim: int,
                  dtype: torch.dtype, device, *, seed: int = 0):
    """Seeded (q, k_cache, v_cache, k, v) for a decode step.

    q (batch, seqlen_q, nheads, head_dim); k_cache, v_cache (batch, seqlen_cache, nheads_k, head_dim),
    random in every row, also past the lengths a call uses: stale rows that must never be read;
    k, v (batch, seqlen_q, nheads_k, head_dim): the new tokens.
    """
    gen = _generator(device, seed)
    q = _randn((batch, seqlen_q, nheads, head_dim), dtype, device, gen)
    k_cache = _randn((batch, seqlen_cache, nheads_k, head_dim), dtype, device, gen)
    v_cache = _randn((batch, seqlen_cache, nheads_k, head_dim), dtype, device, gen)
    k = _randn((batch, seqlen_q, nheads_k, head_dim), dtype, device, gen)
    v = _randn((batch, seqlen_q, nheads_k, head_dim), dtype, device, gen)
    return q, k_cache, v_cache, k, v


def _decode_reference(q, k_cache, v_cache, k, v, lengths: Sequence[int], causal: bool):
    """(out fp32, lse, out in q's dtype) of each request over cache rows [0, L_b) plus the new k/v."""
    return per_request_references(q, k_cache, v_cache, k, v, lengths, causal=causal)


# --------------------------------------------------------------------------------------------
# Why decode is bandwidth bound
# --------------------------------------------------------------------------------------------
def decode_roofline_table(batch: int, nheads: int, nheads_k: int, head_dim: int, dtype: torch.dtype,
                          cache_lens: Sequence[int], ceilings: Mapping[str, float]):
    """One decode step (seqlen_q = 1) per cache length against a GPU's ceilings (benchmarks.measure.decode_roofline).

    ceilings: matmul_tflops and copy_gbps, e.g. benchmarks.measure.H200_MEASURED_CEILINGS or
    benchmarks.measure.ceilings() measured on the present GPU. Columns: cache_len, MFLOP, kv_MiB,
    bytes_per_flop, flop_per_byte, ridge (FLOP/byte where the roofs meet), t_compute_us and t_memory_us
    (time floors at the peak matmul rate and at the copy bandwidth), bound.
    """
    import pandas as pd

    rows = measure.decode_roofline(batch, nheads, nheads_k, head_dim, dtype, cache_lens,
                                 peak_tflops=ceilings["matmul_tflops"], bandwidth_gbps=ceilings["copy_gbps"])
    df = pd.DataFrame(rows)
    df["MFLOP"] = df["flops"] / 1e6
    df["kv_MiB"] = df["kv_bytes"] / 2**20
    df = df.rename(columns={"ridge_flop_per_byte": "ridge"})
    return df[["batch", "cache_len", "MFLOP", "kv_MiB", "bytes_per_flop", "flop_per_byte", "ridge", "t_compute_us",
               "t_memory_us", "bound"]]


# --------------------------------------------------------------------------------------------
# Correctness tables
# --------------------------------------------------------------------------------------------
def decode_equivalence_table(*, batch: int, nheads: int, nheads_k_values: Sequence[int], head_dim: int,
                             lengths: Sequence[int], dtype: torch.dtype, device, seed: int = 0):
    """The seed's autoregressive test: causal prefill over a sequence == decoding it token by token.

    For each KV-head count and length L: flash_attn_func(q, k, v, causal=True) over the L tokens, and
    L calls of flash_attn_with_kvcache, call t writing token t's k/v into a cache of L + 7 rows filled
    with stale random values and attending over rows [0, t]. Columns: kind, nheads, nheads_k, group,
    seqlen, err_decode and err_prefill (vs the fp32 reference), eager_err (PyTorch's same-dtype error),
    bound (the rule's), decode_vs_prefill (rel. difference) and agree_tol, cache_written (rows [0, L)
    hold k and v exactly), ok.
    """
    import pandas as pd

    rows = []
    for i, (hk, n) in enumerate(itertools.product(nheads_k_values, lengths)):
        case = Case(batch, n, n, nheads, hk, head_dim, dtype, causal=True)
        q, k, v = make_inputs(case, device, seed + i)
        gen = _generator(device, 1000 + seed + i)
        k_cache = _randn((batch, n + 7, hk, head_dim), dtype, device, gen)  # stale rows, never read
        v_cache = _randn((batch, n + 7, hk, head_dim), dtype, device, gen)
        with torch.no_grad():
            out_prefill = flash_attn_func(q, k, v, causal=True)
            outs = [flash_attn_with_kvcache(q[:, t : t + 1], k_cache, v_cache, k[:, t : t + 1], v[:, t : t + 1],
                                            cache_seqlens=t, causal=True) for t in range(n)]
            out_decode = torch.cat(outs, 1)
            ref, _ = attention_ref(q.float(), k.float(), v.float(), causal=True)
            same = ref if dtype == torch.float32 else attention_ref(q, k, v, causal=True, upcast=False)[0]
        err_dec, err_pre, eager_err = rel_err(out_decode, ref), rel_err(out_prefill, ref), rel_err(same, ref)
        bound = error_bound(dtype, eager_err)
        agree, tol = rel_err(out_decode, out_prefill), agreement_tolerance(dtype)
        written = torch.equal(k_cache[:, :n], k) and torch.equal(v_cache[:, :n], v)
        ok = _finite(out_decode) and err_dec <= bound and err_pre <= bound and agree <= tol and written
        rows.append({
            "kind": head_kind(nheads, hk), "nheads": nheads, "nheads_k": hk, "group": nheads // hk, "seqlen": n,
            "dtype": dtype_name(dtype), "err_decode": err_dec, "err_prefill": err_pre, "eager_err": eager_err,
            "bound": bound, "decode_vs_prefill": agree, "agree_tol": tol, "cache_written": written, "ok": bool(ok),
        })
    return pd.DataFrame(rows)


def decode_ragged_table(*, lengths: Sequence[int], seqlen_cache: int, nheads: int, nheads_k: int, head_dim: int,
                        dtype: torch.dtype, device, num_splits_values: Sequence[int] = (1, 3, 0), seed: int = 0):
    """A ragged batch (one length per request, e.g. 0 and 1 included) against attention_ref with
    key_padding_lengths over the whole cache, with and without appending one new token.

    One row per (append, num_splits, request): cache_len (L_b before the call), keys_seen (L_b + 1
    with an append), err_fp32 (vs attention_ref in fp32 over the whole cache buffer, keys at or past
    keys_seen masked by key_padding_lengths), eager_err, bound, lse_diff, cache_ok (the caches equal
    the old ones with exactly the new rows written), ok. A request that sees no key must give zeros
    and LSE +inf, as the reference does.
    """
    import pandas as pd

    batch = len(lengths)
    q, k_cache0, v_cache0, k_new, v_new = decode_inputs(batch, seqlen_cache, 1, nheads, nheads_k, head_dim, dtype,
                                                        device, seed=seed)
    seqlens = torch.tensor(list(lengths), dtype=torch.int32, device=device)
    rows = []
    for append, num_splits in itertools.product((True, False), num_splits_values):
        k, v = (k_new, v_new) if append else (None, None)
        k_cache, v_cache = k_cache0.clone(), v_cache0.clone()
        with torch.no_grad():
            out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens,
                                               num_splits=num_splits, return_softmax_lse=True)
        k_exp, v_exp = k_cache0.clone(), v_cache0.clone()
        if append:
            for b, n in enumerate(lengths):
                k_exp[b, n : n + 1], v_exp[b, n : n + 1] = k_new[b], v_new[b]
        cache_ok = torch.equal(k_cache, k_exp) and torch.equal(v_cache, v_exp)
        keys_seen = seqlens.long() + (1 if append else 0)
        ref, lse_ref = attention_ref(q.float(), k_exp.float(), v_exp.float(), key_padding_lengths=keys_seen)
        same = ref if dtype == torch.float32 else attention_ref(q, k_exp, v_exp, key_padding_lengths=keys_seen,
                                                                upcast=False)[0]
        used = suite.decode_splits_used(batch, 1, nheads, nheads_k, head_dim, seqlen_cache, dtype, q.device, num_splits)
        for b, n in enumerate(lengths):
            err, eager_err = rel_err(out[b], ref[b]), rel_err(same[b], ref[b])
            bound = error_bound(dtype, eager_err)
            lse_ok, lse_diff = check_lse(lse[b], lse_ref[b], dtype)
            rows.append({
                "append": append, "num_splits": num_splits, "splits_used": used, "request": b, "cache_len": n,
                "keys_seen": int(keys_seen[b]), "err_fp32": err, "eager_err": eager_err, "bound": bound,
                "lse_diff": lse_diff, "cache_ok": cache_ok,
                "ok": bool(_finite(out[b]) and err <= bound and lse_ok and cache_ok),
            })
    return pd.DataFrame(rows)


def decode_split_table(*, lengths: Sequence[int], seqlen_cache: int, nheads: int, nheads_k: int, head_dim: int,
                       dtype: torch.dtype, device, seqlen_q_values: Sequence[int] = (1, 4),
                       num_splits_values: Sequence[int] = (1, 2, 3, 0), seed: int = 0):
    """Split-KV and unsplit runs agree: the same ragged batch (causal, no append) with each num_splits.

    One row per (seqlen_q, num_splits): splits_used (what the launch plan picked), err_fp32 vs the
    per-request fp32 reference, bound, diff_vs_unsplit (rel. difference to num_splits=1), agree_tol,
    lse_diff_vs_unsplit, ok. Splits past a request's length are empty and get weight 0 in the merge.
    """
    import pandas as pd

    batch = len(lengths)
    seqlens = torch.tensor(list(lengths), dtype=torch.int32, device=device)
    rows = []
    for m in seqlen_q_values:
        q, k_cache, v_cache, _, _ = decode_inputs(batch, seqlen_cache, m, nheads, nheads_k, head_dim, dtype, device,
                                                  seed=seed + m)
        ref, _, same = _decode_reference(q, k_cache, v_cache, None, None, lengths, causal=True)
        eager_err = rel_err(same, ref)
        bound = error_bound(dtype, eager_err)
        with torch.no_grad():
            base, base_lse = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, causal=True,
                                                     num_splits=1, return_softmax_lse=True)
        for ns in num_splits_values:
            with torch.no_grad():
                out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, causal=True,
                                                   num_splits=ns, return_softmax_lse=True)
            err, diff, tol = rel_err(out, ref), rel_err(out, base), agreement_tolerance(dtype)
            lse_ok, lse_diff = check_lse(lse, base_lse, dtype)
            rows.append({
                "seqlen_q": m, "num_splits": ns,
                "splits_used": suite.decode_splits_used(batch, m, nheads, nheads_k, head_dim, seqlen_cache, dtype,
                                                  q.device, ns),
                "err_fp32": err, "eager_err": eager_err, "bound": bound, "diff_vs_unsplit": diff, "agree_tol": tol,
                "lse_diff_vs_unsplit": lse_diff,
                "ok": bool(_finite(out) and err <= bound and diff <= tol and lse_ok),
            })
    return pd.DataFrame(rows)


def decode_causal_table(*, seqlen_q_values: Sequence[int], lengths: Sequence[int], seqlen_cache: int, nheads: int,
                        nheads_k_values: Sequence[int], head_dim: int, dtype: torch.dtype, device,
                        num_splits_values: Sequence[int] = (1, 3), seed: int = 0):
    """seqlen_q > 1 (speculative verification) with causal=True against the per-request reference,
    whose mask is aligned bottom-right over each request's keys (L_b cached + seqlen_q new).

    One row per (seqlen_q, nheads_k, append, num_splits): err_fp32, eager_err, bound, lse_diff, ok.
    """
    import pandas as pd

    batch, rows = len(lengths), []
    seqlens = torch.tensor(list(lengths), dtype=torch.int32, device=device)
    for i, (m, hk, append) in enumerate(itertools.product(seqlen_q_values, nheads_k_values, (True, False))):
        q, k_cache, v_cache, k, v = decode_inputs(batch, seqlen_cache, m, nheads, hk, head_dim, dtype, device,
                                                  seed=seed + i)
        if not append:
            k = v = None
        ref, lse_ref, same = _decode_reference(q, k_cache, v_cache, k, v, lengths, causal=True)
        eager_err = rel_err(same, ref)
        bound = error_bound(dtype, eager_err)
        for ns in num_splits_values:
            with torch.no_grad():
                out, lse = flash_attn_with_kvcache(q, k_cache.clone(), v_cache.clone(), k, v, cache_seqlens=seqlens,
                                                   causal=True, num_splits=ns, return_softmax_lse=True)
            err = rel_err(out, ref)
            lse_ok, lse_diff = check_lse(lse, lse_ref, dtype)
            rows.append({
                "seqlen_q": m, "kind": head_kind(nheads, hk), "nheads": nheads, "nheads_k": hk, "append": append,
                "num_splits": ns, "err_fp32": err, "eager_err": eager_err, "bound": bound, "lse_diff": lse_diff,
                "ok": bool(_finite(out) and err <= bound and lse_ok),
            })
    return pd.DataFrame(rows)


def _same_or_both_nan(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a == b) | (torch.isnan(a) & torch.isnan(b))


def _row_ranges(rows: Sequence[int]) -> str:
    """[3, 4, 5, 9] -> '3-5, 9' (empty: '-')."""
    rows = sorted(rows)
    if not rows:
        return "-"
    parts, start = [], rows[0]
    for prev, cur in zip(rows, rows[1:] + [None]):
        if cur != prev + 1:
            parts.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = cur
    return ", ".join(parts)


def decode_append_table(*, lengths: Sequence[int], seqlen_cache: int, seqlen_q: int, nheads: int, nheads_k: int,
                        head_dim: int, dtype: torch.dtype, device, num_splits: int = 3, seed: int = 0):
    """Which cache rows one appending call changes, per request, with poisoned padding.

    The caches are views (..., :head_dim) of buffers 8 columns wider whose extra columns hold NaN
    (never to be read or written); head_dim should not be a power of two, so the kernel pads it.
    Columns: request, cache_len, rows_expected [L_b, L_b + seqlen_q), rows_written_k / _v (the rows
    in which any byte changed, NaN-aware), new_rows_equal (they hold exactly k, v), others_untouched
    (every other row and every padding column bit-identical), err_fp32 and bound (the output vs the
    reference), ok.
    """
    import pandas as pd

    batch = len(lengths)
    gen = _generator(device, seed)
    bufs = [_randn((batch, seqlen_cache, nheads_k, head_dim + 8), dtype, device, gen) for _ in range(2)]
    for buf in bufs:
        buf[..., head_dim:] = float("nan")  # poison
    k_buf, v_buf = bufs
    k_cache, v_cache = k_buf[..., :head_dim], v_buf[..., :head_dim]
    q = _randn((batch, seqlen_q, nheads, head_dim), dtype, device, gen)
    k = _randn((batch, seqlen_q, nheads_k, head_dim), dtype, device, gen)
    v = _randn((batch, seqlen_q, nheads_k, head_dim), dtype, device, gen)
    k_before, v_before = k_buf.clone(), v_buf.clone()
    ref, _, same = _decode_reference(q, k_cache.clone(), v_cache.clone(), k, v, lengths, causal=True)
    with torch.no_grad():
        out = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, causal=True, num_splits=num_splits,
                                      cache_seqlens=torch.tensor(list(lengths), dtype=torch.int32, device=device))
    changed_k = ~_same_or_both_nan(k_buf, k_before).flatten(2).all(-1)  # (batch, seqlen_cache)
    changed_v = ~_same_or_both_nan(v_buf, v_before).flatten(2).all(-1)
    padding_ok = bool(_same_or_both_nan(k_buf[..., head_dim:], k_before[..., head_dim:]).all()
                      and _same_or_both_nan(v_buf[..., head_dim:], v_before[..., head_dim:]).all())
    rows = []
    for b, n in enumerate(lengths):
        expected = list(range(n, n + seqlen_q))
        written_k = changed_k[b].nonzero().flatten().tolist()
        written_v = changed_v[b].nonzero().flatten().tolist()
        new_equal = torch.equal(k_cache[b, n : n + seqlen_q], k[b]) and torch.equal(v_cache[b, n : n + seqlen_q], v[b])
        err, eager_err = rel_err(out[b], ref[b]), rel_err(same[b], ref[b])
        bound = error_bound(dtype, eager_err)
        rows.append({
            "request": b, "cache_len": n, "seqlen_q": seqlen_q, "rows_expected": _row_ranges(expected),
            "rows_written_k": _row_ranges(written_k), "rows_written_v": _row_ranges(written_v),
            "new_rows_equal": new_equal, "others_untouched": written_k == expected and written_v == expected,
            "padding_untouched": padding_ok, "err_fp32": err, "bound": bound,
            "ok": bool(written_k == expected and written_v == expected and new_equal and padding_ok and err <= bound
                       and _finite(out[b])),
        })
    return pd.DataFrame(rows)


def kvcache_round_trip_table(*, batch: int, prompt: int, steps: Sequence[int], new_prompt: int, nheads: int,
                             nheads_k: int, head_dim: int, dtype: torch.dtype, device, seed: int = 0):
    """KVCache end to end: prefill prompts, decode steps (seqlen_q 1 or more), reset one request,
    prefill it again with a new prompt while the other keeps its history, decode both, overflow.

    Returns a table of checks (check, detail, ok): outputs against attention_ref over each request's
    own sequence (causal, bottom-right), the host and device lengths, the cache contents, and the
    ValueError an overflowing decode raises before writing anything.
    """
    import pandas as pd

    checks = []

    def check(name: str, ok: bool, detail: str = "") -> None:
        checks.append({"check": name, "detail": detail, "ok": bool(ok)})

    total = prompt + sum(steps)
    case = Case(batch, total, total, nheads, nheads_k, head_dim, dtype, causal=True)
    q, k, v = make_inputs(case, device, seed)
    cache = KVCache(batch, total + 2, nheads_k, head_dim, dtype=dtype, device=device)
    ref, _ = attention_ref(q.float(), k.float(), v.float(), causal=True)
    same = ref if dtype == torch.float32 else attention_ref(q, k, v, causal=True, upcast=False)[0]

    def close(out, r, s) -> Tuple[bool, str]:
        err, eager_err = rel_err(out, r), rel_err(s, r)
        bound = error_bound(dtype, eager_err)
        return _finite(out) and err <= bound, f"rel err {err:.2e} <= bound {bound:.2e}"

    with torch.no_grad():
        out = cache.prefill(q[:, :prompt], k[:, :prompt], v[:, :prompt])
        check(f"prefill {prompt} tokens", *close(out, ref[:, :prompt], same[:, :prompt]))
        check("lengths after prefill", cache.seqlens == [prompt] * batch
              and cache.seqlens_device.tolist() == [prompt] * batch, f"host {cache.seqlens}")
        pos = prompt
        for n in steps:
            out = cache.decode(q[:, pos : pos + n], k[:, pos : pos + n], v[:, pos : pos + n])
            ok, detail = close(out, ref[:, pos : pos + n], same[:, pos : pos + n])
            pos += n
            lengths_ok = cache.seqlens == [pos] * batch and cache.seqlens_device.tolist() == [pos] * batch
            check(f"decode {n} token(s) at {pos - n}", ok and lengths_ok, f"{detail}; lengths {cache.seqlens}")
        check("cache holds every k, v", torch.equal(cache.k_cache[:, :total], k)
              and torch.equal(cache.v_cache[:, :total], v), f"rows [0, {total})")

        # reset the last request, give it a new prompt, decode both (ragged lengths from here on)
        last = batch - 1
        cache.reset(batch_idx=last)
        check("reset one request", cache.seqlens == [total] * last + [0], f"lengths {cache.seqlens}")
        q2, k2, v2 = make_inputs(Case(1, new_prompt, new_prompt, nheads, nheads_k, head_dim, dtype, True), device,
                                 seed + 1)
        cache.prefill(q2, k2, v2, batch_idx=[last])
        qs, _, _, ks, vs = decode_inputs(batch, 1, 1, nheads, nheads_k, head_dim, dtype, device, seed=seed + 2)
        out = cache.decode(qs, ks, vs)
        k_hist = torch.cat([cache.k_cache[:last, :total], torch.cat(
            [k2, cache.k_cache[last:, new_prompt:total]], 1)], 0)  # rows past a length are never read
        v_hist = torch.cat([cache.v_cache[:last, :total], torch.cat(
            [v2, cache.v_cache[last:, new_prompt:total]], 1)], 0)
        r, _, s = _decode_reference(qs, k_hist, v_hist, ks, vs, [total] * last + [new_prompt], causal=True)
        check("ragged decode after re-prefill", *close(out, r, s))
        check("lengths after it", cache.seqlens == [total + 1] * last + [new_prompt + 1], f"host {cache.seqlens}")

        # one more token fits (total + 2 rows), the next overflows and raises before writing
        cache.decode(qs, ks, vs)
        before = cache.k_cache.clone()
        try:
            cache.decode(qs, ks, vs)
            raised = "nothing"
        except ValueError as exc:
            raised = f"ValueError: {exc}"
        check("overflow raises", raised.startswith("ValueError") and torch.equal(cache.k_cache, before)
              and cache.seqlens[0] == total + 2, raised)
        cache.reset()
        check("reset all", cache.seqlens == [0] * batch and cache.seqlens_device.tolist() == [0] * batch,
              f"lengths {cache.seqlens}")
    return pd.DataFrame(checks)


def plot_decode(df, *, name: str = "decode", title: str, where: Optional[Mapping[str, Any]] = None,
                figures_dir: Optional[Union[str, Path]] = None) -> List[Path]:
    """Per GPU, one column per batch: latency per eager call, peak memory beyond the inputs, and K+V
    GB/s with CUDA-graph replay against the device-copy bandwidth line of the same run. Saved as
    <figures_dir>/<gpu-slug>/<name>.png (default: `figures_root()`), titled with the GPU, versions and dates."""
    import matplotlib.pyplot as plt

    df = _select(df, where)
    missing = {"gpu", "impl", "batch", "cache_len", "median_ms"} - set(df.columns)
    if missing or df.empty:
        print(f"note: nothing to plot for {name}: " + (f"missing columns {sorted(missing)}" if missing else
                                                       f"no rows match {dict(where or {})}"))
        return []
    saved = []
    for gpu, sub in df.groupby("gpu", sort=True):
        batches = sorted(sub["batch"].unique())
        fig, axes = plt.subplots(3, len(batches), figsize=(5.5 * len(batches), 11), squeeze=False, sharex="col")
        for col, batch in enumerate(batches):
            part = sub[sub["batch"] == batch]
            for impl, line in part.groupby("impl", sort=False):
                line = line.sort_values("cache_len")
                style = {"linewidth": 2.5 if impl == "ours" else 1.5, "marker": "o",
                         "label": LABELS.get(impl, impl)}
                axes[0, col].plot(line["cache_len"], line["median_ms"] * 1e3, **style)
                if "peak_mem_mib" in line and line["peak_mem_mib"].notna().any():
                    axes[1, col].plot(line["cache_len"], line["peak_mem_mib"], **style)
                if "gbps_graph" in line and line["gbps_graph"].notna().any():
                    axes[2, col].plot(line["cache_len"], line["gbps_graph"], **style)
            if "copy_gbps" in part and part["copy_gbps"].notna().any():
                axes[2, col].axhline(part["copy_gbps"].median(), color="black", linestyle=":",
                                     label=f"device copy {part['copy_gbps'].median():.0f} GB/s (same run)")
            axes[0, col].set_title(f"batch {batch}")
            axes[0, col].set_ylabel("latency per eager call (us)")
            axes[0, col].set_yscale("log")
            axes[1, col].set_ylabel("peak memory beyond inputs (MiB)")
            axes[1, col].set_yscale("symlog", linthresh=0.01)  # ours: KiBs; eager: GiBs
            axes[2, col].set_ylabel("K+V GB/s (CUDA-graph replay)")
            axes[2, col].set_ylim(bottom=0)
            axes[2, col].set_xlabel("cache length (keys per request)")
            for row in range(3):
                report.log2_axis(axes[row, col], part["cache_len"].unique())
            axes[0, col].legend(fontsize=8)
            axes[2, col].legend(fontsize=8)
        fig.suptitle(f"{title} on {gpu}\n({report.versions_text(sub)})", fontsize=11)
        fig.tight_layout()
        saved.append(report.save_figure(fig, figures_dir or figures_root(), gpu, name))
    return saved


def decode_summary_table(df, *, value: str = "gbps_graph", where: Optional[Mapping[str, Any]] = None):
    """`value` (default K+V GB/s with graph replay) per implementation by gpu, batch and cache length,
    plus ours / each other implementation present."""
    df = _select(df, where)
    table = df.pivot_table(index=["gpu", "batch", "cache_len"], columns="impl", values=value)
    for other in [c for c in table.columns if c != "ours"]:
        if "ours" in table.columns:
            table[f"ours/{other}"] = table["ours"] / table[other]
    return table


# ============================================================================================
# Serving (notebook 04)
# ============================================================================================
def serving_sizes(on_gpu: bool) -> SimpleNamespace:
    """Sizes for notebook 04: realistic on a GPU, small enough for the Triton interpreter on a CPU.

    GPU: bf16, 32 q heads over 8 KV heads, head dim 128, pages of 64 tokens, 32 requests with prompts of
    100..4000 tokens and 16..256 new tokens arriving over 200 steps, 16 slots, a pool of 512 pages (a
    dense cache for 16 requests of max_seqlen would need 1088), chunks of 512 tokens, 2048 tokens per step.
    CPU: fp16, 4 q heads over 2 KV heads, head dim 32, pages of 16, 6 requests with prompts of 5..80
    tokens and 2..8 new tokens, 4 slots, a pool of 14 pages (so admission has to wait), chunks of 32.
    """
    if on_gpu:
        return SimpleNamespace(
            dtype=torch.bfloat16, nheads=32, nheads_k=8, head_dim=128, page_size=64, num_blocks=512, max_batch=16,
            max_seqlen=4352, chunk_size=512, token_budget=2048, num_requests=32, prompt_range=(100, 4000),
            new_tokens_range=(16, 256), arrival_span=200, verify="sample", chunks=(5, 17, 1, 33, 700, 1000, 300),
        )
    return SimpleNamespace(
        dtype=torch.float16, nheads=4, nheads_k=2, head_dim=32, page_size=16, num_blocks=14, max_batch=4,
        max_seqlen=96, chunk_size=32, token_budget=40, num_requests=6, prompt_range=(5, 80),
        new_tokens_range=(2, 8), arrival_span=6, verify="all", chunks=(5, 17, 1, 33),
    )


def engine_from_sizes(S: SimpleNamespace, device=None, **overrides) -> ServingEngine:
    """A ServingEngine with the sizes of `serving_sizes` (keyword overrides win)."""
    kwargs = dict(nheads=S.nheads, nheads_k=S.nheads_k, head_dim=S.head_dim, page_size=S.page_size,
                  num_blocks=S.num_blocks, max_batch=S.max_batch, max_seqlen=S.max_seqlen, chunk_size=S.chunk_size,
                  token_budget=S.token_budget, dtype=S.dtype, device=device, verify=S.verify)
    kwargs.update(overrides)
    return ServingEngine(**kwargs)


# ============================================================================================
# Chunked prefill against a cache, one request
# ============================================================================================
def chunked_prefill_table(chunks: Sequence[int], *, nheads: int, nheads_k: int, head_dim: int, page_size: int,
                          dtype: torch.dtype, device=None, seed: int = 0):
    """One prompt of sum(chunks) tokens prefilled chunk by chunk into a dense cache buffer and into a
    PagedKVCache (flash_attn_with_kvcache with seqlen_q = chunk: append, then attend bottom-right
    causal over the cache plus the chunk), against one-shot causal prefill (flash_attn_func) and the
    fp32 reference. The dense buffer's rows past the prompt and the pool's unused pages hold NaN: a
    read of a row that is not the request's poisons the output.

    One row per chunk and cache: tokens [start, end), err (vs the reference), bound, diff_one_shot
    (relative difference to the same rows of the one-shot prefill), ok.
    """
    import pandas as pd

    device = torch.device(device) if device is not None else (torch.device("cuda") if torch.cuda.is_available()
                                                              else torch.device("cpu"))
    if not chunks or any(not isinstance(c, numbers.Integral) or c < 1 for c in chunks):
        raise ValueError(f"Expected chunks to be positive ints, got {chunks!r}.")
    total = sum(chunks)
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(dtype)

    q = randn(1, total, nheads, head_dim)
    k, v = randn(1, total, nheads_k, head_dim), randn(1, total, nheads_k, head_dim)
    one_shot = flash_attn_func(q, k, v, causal=True)
    k_dense = torch.full((1, total + 7, nheads_k, head_dim), float("nan"), dtype=dtype, device=device)
    v_dense = k_dense.clone()
    paged = PagedKVCache(-(-total // page_size) + 3, page_size, nheads_k, head_dim, max_batch=2,
                         max_blocks_per_seq=-(-total // page_size), dtype=dtype, device=device)
    paged.k_cache.fill_(float("nan"))
    paged.v_cache.fill_(float("nan"))
    paged.add_request()  # slot 0 takes nothing; slot 1's pages are then not simply blocks 0, 1, ...
    paged.extend(0, page_size)
    slot = paged.add_request()
    rows, start = [], 0
    agree = agreement_tolerance(dtype)
    for n in chunks:
        end = start + n
        part = (q[:, start:end], k[:, start:end], v[:, start:end])
        outs = {
            "dense": flash_attn_with_kvcache(part[0], k_dense, v_dense, part[1], part[2], cache_seqlens=start,
                                             causal=True),
            "paged": paged.decode(*part, slots=[slot]),
        }
        for cache, out in outs.items():
            err, bound = check_attention(out[0], q[0, start:end], k[0, :end], v[0, :end])
            diff = rel_err(out, one_shot[:, start:end])
            rows.append({"cache": cache, "chunk": n, "start": start, "end": end, "err": err, "bound": bound,
                         "diff_one_shot": diff, "ok": bool(err <= bound and diff <= agree)})
        start = end
    return pd.DataFrame(rows)


# ============================================================================================
# Summaries, results and plots
# ============================================================================================
def summary(stats) -> Dict[str, float]:
    """Totals of a run from its stats rows (a list of dicts or a DataFrame)."""
    import pandas as pd

    df = pd.DataFrame(stats) if not isinstance(stats, pd.DataFrame) else stats
    wall_s = df["wall_ms"].sum() / 1e3
    decode_only = df[(df["prefill_tokens"] == 0) & (df["decode_tokens"] > 0)]
    with_prefill = df[df["prefill_tokens"] > 0]
    return {
        "steps": int(len(df)), "tokens": int(df["tokens"].sum()), "prefill_tokens": int(df["prefill_tokens"].sum()),
        "decode_tokens": int(df["decode_tokens"].sum()), "attention_s": wall_s,
        "tokens_per_s": df["tokens"].sum() / wall_s if wall_s > 0 else math.nan,
        "tokens_per_s_decode_only_steps": (decode_only["tokens"].sum() / (decode_only["wall_ms"].sum() / 1e3)
                                           if len(decode_only) else math.nan),
        "tokens_per_s_prefill_steps": (with_prefill["tokens"].sum() / (with_prefill["wall_ms"].sum() / 1e3)
                                       if len(with_prefill) else math.nan),
        "max_running": int(df["running"].max()),
        "peak_pool_in_use_mib": float(df["pool_in_use_mib"].max()), "pool_mib": float(df["pool_mib"].max()),
        "peak_live_kv_mib": float(df["live_kv_mib"].max()),
        "peak_dense_running_mib": float(df["dense_running_mib"].max()),
        "dense_max_batch_mib": float(df["dense_max_batch_mib"].max()),
    }


def save_stats(stats: Sequence[Dict[str, Any]], config: Dict[str, Any], name: str = "serving_steps",
               results_dir: Union[str, Path] = "results") -> Path:
    """Append a run's stats rows, tagged with the config, a run id and the environment
    (tritonattn.results.make_row), to results/<gpu>/<name>.csv."""
    run = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%S.%f")  # sorts by time
    config = {key: (str(value).replace("torch.", "") if isinstance(value, torch.dtype) else value)
              for key, value in config.items() if isinstance(value, (numbers.Number, str, torch.dtype))}
    rows = [results.make_row(**{**config, **row, "run": run}) for row in stats]
    return results.write_csv(rows, name, results_dir=results_dir)


def load_stats(name: str = "serving_steps", results_dir: Union[str, Path] = "results"):
    """The latest run per GPU of results/<gpu>/<name>.csv as a DataFrame, or None if there is none."""
    try:
        df = results.read_csv(name, results_dir=results_dir)
    except FileNotFoundError:
        return None
    latest = df.groupby("gpu")["run"].transform("max")
    return df[df["run"] == latest].reset_index(drop=True)


def figures_root() -> Path:
    """Where the notebooks save figures: the committed figures/ on a GPU (the run that measured them), a
    temporary folder on a CPU, which redraws committed results and must leave the checkout untouched."""
    if torch.cuda.is_available():
        return results.REPO_ROOT / "figures"
    return Path(tempfile.gettempdir()) / "tritonattn-figures"


def figure_path(gpu: str, name: str, figures_dir: Optional[Union[str, Path]] = None) -> Path:
    """<figures_dir>/<gpu-slug>/<name>.png (default: `figures_root()`; a relative figures_dir is taken from
    the repo root)."""
    root = Path(figures_dir or figures_root())
    root = root if root.is_absolute() else results.REPO_ROOT / root
    return root / results.gpu_slug(str(gpu)) / f"{name}.png"


def plot_serving(stats, *, title: str, path: Optional[Union[str, Path]] = None):
    """Four panels over the engine steps: tokens/s, tokens per step (prefill and decode), memory (pool in
    use and live K/V against the dense reservations), running and waiting requests. Saved to `path`
    when given; shown in a notebook; returns the figure (closed)."""
    import matplotlib
    import matplotlib.pyplot as plt
    import pandas as pd

    df = pd.DataFrame(stats) if not isinstance(stats, pd.DataFrame) else stats
    x = df["step"]
    fig, axes = plt.subplots(4, 1, figsize=(13, 12), sharex=True)
    mixed = df["prefill_tokens"] > 0
    ax = axes[0]
    ax.plot(x, df["tokens_per_s"], color="0.6", linewidth=0.8)
    ax.scatter(x[mixed], df["tokens_per_s"][mixed], s=12, label="steps with prefill chunks", color="tab:orange")
    ax.scatter(x[~mixed], df["tokens_per_s"][~mixed], s=12, label="decode-only steps", color="tab:blue")
    ax.set_yscale("log")
    ax.set_ylabel("tokens / s")
    ax = axes[1]
    ax.bar(x, df["decode_tokens"], width=1.0, label="decode tokens", color="tab:blue")
    ax.bar(x, df["prefill_tokens"], width=1.0, bottom=df["decode_tokens"], label="prefill tokens", color="tab:orange")
    ax.set_ylabel("tokens per step")
    ax = axes[2]
    unit, scale = ("MiB", 1.0) if df["dense_max_batch_mib"].max() >= 1 else ("KiB", 1024.0)
    mem = {c: df[c] * scale for c in ("dense_running_mib", "dense_max_batch_mib", "pool_in_use_mib", "live_kv_mib",
                                      "pool_mib")}
    ax.plot(x, mem["dense_running_mib"], label="dense: max_seqlen reserved per running request", color="tab:red")
    ax.axhline(mem["dense_max_batch_mib"].max(), color="tab:red", linestyle=":",
               label="dense: max_seqlen x max_batch, allocated up front")
    ax.plot(x, mem["pool_in_use_mib"], label="paged: pages in use", color="tab:green", linewidth=2)
    ax.plot(x, mem["live_kv_mib"], label="live K/V (tokens cached)", color="black", linewidth=1, linestyle="--")
    ax.axhline(mem["pool_mib"].max(), color="tab:green", linestyle=":", label="paged: whole pool")
    ax.set_ylabel(f"K/V memory, one layer ({unit})")
    ax.set_ylim(bottom=0)
    ax = axes[3]
    ax.step(x, df["running"], where="mid", label="running")
    ax.step(x, df["waiting"], where="mid", label="arrived, waiting for admission")
    ax.set_ylabel("requests")
    ax.set_xlabel("engine step")
    ax.yaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    for ax in axes:
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    report.write_figure(fig, path)
    return fig
