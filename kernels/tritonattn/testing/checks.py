"""Check tables: run the kernels and the references over a list of problems and judge each row by the
error rule of `tolerance` (what the notebooks show and `assert_table_ok` asserts).

- `Case`, `grid`, `make_inputs`: attention problems and their seeded inputs (contiguous, head-major
  views, or NaN-poisoned padding past head_dim); `generator` and `randn`, the seeded draws every check
  table of this package makes (decode_checks and variant_checks too).
- `forward_error_table`, `grad_error_table`: flash_attn_func and its gradients against the fp32 eager
  reference, the same-dtype eager one and SDPA.
- `padded_keys_table`: the kernel against an emulated kernel that lets zero-padded keys into the softmax.
- `gqa_group_sum_table`: GQA/MQA against the same kernel on expanded K/V, dK/dV summed over each group.
- `summarize`: a check table condensed to one row per group (cases, largest errors, all ok).
- `check_errors`: calls that must raise, with what each raised.
- `copies_during`: the copy-making aten ops a call runs (none for strided views on a GPU).

Each table is a list of rows (dicts of plain values): `pandas.DataFrame(rows)` shows one.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import asdict, dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from ..api.prefill import flash_attn_func
from ..config.hardware import device_target
from ..config.options import head_dim_tile
from ..config.tables import prefill_fwd_config
from .reference import attention_padded_keys_ref, attention_ref, attention_sdpa
from .requests import references
from .tolerance import agreement_tolerance, check_lse, error_bound, rel_err

__all__ = [
    "Case", "grid", "make_inputs", "generator", "randn", "all_finite", "LAYOUTS", "dtype_name", "kernel_block_n",
    "copies_during",
    "forward_error_table", "grad_error_table", "padded_keys_table", "gqa_group_sum_table", "assert_table_ok",
    "summarize", "check_errors",
]


def dtype_name(dtype: torch.dtype) -> str:
    """'float16' for torch.float16 (CSV- and table-friendly)."""
    return str(dtype).replace("torch.", "")


def generator(device, seed: int) -> torch.Generator:
    """A torch.Generator on `device` seeded with `seed`: a table's draws depend on its seed alone."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


def all_finite(t: torch.Tensor) -> bool:
    """No NaN or inf in t: a check that passes needs it whatever its error says."""
    return bool(torch.isfinite(t).all().item())


def randn(shape: Sequence[int], dtype: torch.dtype, device, gen: torch.Generator) -> torch.Tensor:
    """Standard-normal values of `shape` drawn in float32 from `gen`, then cast to `dtype`: one seed gives
    the same values (up to rounding) in every dtype."""
    return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(dtype)


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
    gen = generator(device, seed)

    def draw(seqlen, heads):
        d = case.head_dim
        if layout == "bhsd":
            shape = (case.batch, heads, seqlen, d)
        else:
            shape = (case.batch, seqlen, heads, d + (8 if layout == "nan_padded" else 0))
        t = randn(shape, case.dtype, device, gen)
        if layout == "bhsd":
            return t.transpose(1, 2)
        if layout == "nan_padded":
            t[..., d:] = float("nan")  # poison: must never be read
            return t[..., :d]
        return t

    q = draw(case.seqlen_q, case.nheads)
    k = draw(case.seqlen_k, case.nheads_k)
    v = draw(case.seqlen_k, case.nheads_k)
    return q, k, v


def _inputs_and_dout(case: Case, device, seed: int, dout_seed: int):
    """make_inputs(case, device, seed) and an output gradient dout drawn from its own seed."""
    q, k, v = make_inputs(case, device, seed)
    return q, k, v, randn(q.shape, case.dtype, device, generator(device, dout_seed))


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


def padded_keys_table(cases: Sequence[Case], device, block_n: int, *, seed: int = 0):
    """Our kernel vs an emulated kernel WITHOUT the key-length mask, both against the fp32 reference.

    The emulation (tritonattn.testing.attention_padded_keys_ref) pads K/V with zero keys up to a
    multiple of block_n and lets them into the softmax. Columns: the case, block_n, padded_keys,
    err_kernel, err_unmasked (both vs the fp32 reference), eager_err (PyTorch same-dtype), bound
    (the rule's bound for the kernel), ok (kernel within bound, finite).
    """
    rows = []
    for i, case in enumerate(cases):
        q, k, v = make_inputs(case, device, seed + i)
        with torch.no_grad():
            out = flash_attn_func(q, k, v, causal=case.causal)
            ref, _, same = references(q, k, v, causal=case.causal)
            unmasked, _ = attention_padded_keys_ref(q.float(), k.float(), v.float(), block_n, causal=case.causal)
        err, eager_err = rel_err(out, ref), rel_err(same, ref)
        bound = error_bound(case.dtype, eager_err)
        rows.append({
            **case.fields(), "block_n": block_n, "padded_keys": -(-case.seqlen_k // block_n) * block_n - case.seqlen_k,
            "err_kernel": err, "err_unmasked": rel_err(unmasked, ref), "eager_err": eager_err, "bound": bound,
            "ok": bool(all_finite(out) and err <= bound),
        })
    return rows


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
    rows = []
    for i, case in enumerate(cases):
        q, k, v = make_inputs(case, device, seed + i, layout)
        with torch.no_grad():
            out, lse = flash_attn_func(q, k, v, causal=case.causal, return_softmax_lse=True)
            ref, lse_ref, same = references(q, k, v, causal=case.causal)
            err_sdpa = sdpa_err = math.nan
            if case.sdpa_agrees:
                sdpa32 = attention_sdpa(q.float(), k.float(), v.float(), causal=case.causal)
                err_sdpa = rel_err(out, sdpa32)
                sdpa_same = sdpa32 if case.dtype == torch.float32 else attention_sdpa(q, k, v, causal=case.causal)
                sdpa_err = rel_err(sdpa_same, ref)
        err, eager_err = rel_err(out, ref), rel_err(same, ref)
        bound = error_bound(case.dtype, eager_err)
        lse_ok, lse_diff = check_lse(lse, lse_ref, case.dtype)
        ok = all_finite(out) and err <= bound and lse_ok
        rows.append({
            **case.fields(),
            "err_fp32": err, "eager_err": eager_err, "ratio": _ratio(err, eager_err),
            "err_eager": rel_err(out, same), "err_sdpa": err_sdpa, "sdpa_err": sdpa_err,
            "lse_diff": lse_diff, "bound": bound, "ok": bool(ok),
        })
        if layout != "bshd":
            rows[-1]["layout"] = layout
    return rows


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
    rows = []
    for i, case in enumerate(cases):
        q, k, v, dout = _inputs_and_dout(case, device, seed + i, 10_000 + seed + i)
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
                "bound": bound, "ok": bool(all_finite(gk) and err <= bound),
            })
    return rows


def assert_table_ok(rows: Sequence[Dict[str, Any]], what: str) -> None:
    """Raise AssertionError listing the rows of a check table whose `ok` is False; else print one line:
    how many rows passed, the largest error and the worst kernel/eager ratio."""
    bad = [row for row in rows if not row["ok"]]
    if bad:
        listed = "\n".join(", ".join(f"{k}={_fmt(v)}" for k, v in row.items()) for row in bad[:20])
        raise AssertionError(f"{what}: {len(bad)} of {len(rows)} rows break the rule (err_fp32 <= bound; finite; "
                             f"LSE where present):\n{listed}")
    keys = rows[0].keys() if rows else ()
    err_cols = ["err_fp32"] if "err_fp32" in keys else [k for k in keys if k.startswith("err_")]
    errs = [row[c] for row in rows for c in err_cols if not math.isnan(row[c])]
    largest = f"; largest {'/'.join(err_cols)} {max(errs):.2e}" if errs else ""
    ratios = [row["ratio"] for row in rows if "ratio" in row and not math.isnan(row["ratio"])]
    worst = f", worst kernel/eager ratio {max(ratios):.2f}" if ratios else ""
    print(f"{what}: all {len(rows)} rows pass{largest}{worst}")


CASE_FIELDS = ("batch", "seqlen_q", "seqlen_k", "nheads", "nheads_k", "head_dim", "dtype", "causal")


def summarize(
    rows: Sequence[Dict[str, Any]],
    by: Sequence[str] = ("dtype", "causal"),
    columns: Sequence[str] = ("err_fp32", "ratio", "err_sdpa"),
) -> List[Dict[str, Any]]:
    """A check table condensed to one row per distinct value of the `by` columns, in first-seen order.

    Each row holds the `by` values, `cases` (distinct problems: a gradient table has one row per dq/dk/dv),
    `max_<column>` for each of `columns` the rows have (NaN ignored; NaN when no row has a value) and
    `ok` (every row ok).
    """
    groups: Dict[Tuple, List[Dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault(tuple(row[k] for k in by), []).append(row)
    out = []
    for key, group in groups.items():
        summary = dict(zip(by, key))
        summary["cases"] = len({tuple(r.get(f) for f in CASE_FIELDS) for r in group})
        for col in columns:
            if col in group[0]:
                values = [r[col] for r in group if not math.isnan(r[col])]
                summary[f"max_{col}"] = max(values) if values else math.nan
        summary["ok"] = all(r["ok"] for r in group)
        out.append(summary)
    return out


def _fmt(value: Any) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def gqa_group_sum_table(cases: Sequence[Case], device, *, seed: int = 0):
    """GQA/MQA vs the same kernel on K/V expanded with repeat_interleave (plain MHA), per case.

    The MHA run gives one dK/dV per q head; summing them over each group of q heads must give the
    GQA kernel's dK/dV of the group's KV head. Columns: err_out (GQA out vs expanded out), err_dq,
    err_dk, err_dv (vs the expanded gradients summed over each group, in fp32), bound, ok.
    """
    rows = []
    for i, case in enumerate(cases):
        q, k, v, dout = _inputs_and_dout(case, device, seed + i, 20_000 + seed + i)
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
        finite = all(all_finite(t) for t in (out_g, dq_g, dk_g, dv_g))
        rows.append({**case.fields(), "group": g, **errs, "bound": bound,
                     "ok": bool(finite and max(errs.values()) <= bound)})
    return rows


def check_errors(cases: Sequence[Tuple[str, Callable[[], Any], type]]):
    """Run each (label, call, expected exception type) and record what each raised; assert the types.

    Returns the rows (call, expected, raised, ok, message). Raises AssertionError after running all
    of them if any call raised nothing or another type.
    """
    rows, wrong = [], []
    for label, call, expected in cases:
        try:
            call()
        except Exception as exc:  # noqa: BLE001 - we report whatever came
            raised, message = type(exc), str(exc)
        else:
            raised, message = None, "(no exception)"
        name = raised.__name__ if raised is not None else "nothing"
        ok = raised is not None and issubclass(raised, expected)
        if not ok:
            wrong.append(f"{label}: expected {expected.__name__}, got {name} ({message})")
        rows.append({"call": label, "expected": expected.__name__, "raised": name, "ok": ok, "message": message})
    if wrong:
        raise AssertionError("bad input not rejected as documented:\n  " + "\n  ".join(wrong))
    return rows
