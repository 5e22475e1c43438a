"""Notebook 02's decode measurements: the arithmetic of one decode step, its achieved K/V bandwidth, and the
seed's comparison against its two eager baselines by the seed's method (benchmarks/seed_method.py).

- `decode_arithmetic`: bytes read, FLOPs and FLOPs per byte of one step, per cache length (no device needed).
- `decode_bandwidth`: K/V bytes over GPU time of one step of flash_attn_with_kvcache, per cache length.
- `seed_decode_rows`: latency (median +- std) and incremental peak memory of one decode step of
  `decode_eager_slice`, `decode_eager_cat` and ours, per cache length; `plot_seed_decode` draws them.
- `fp8_decode_rows`: an FP8 (e4m3) cache against a 16-bit one: bytes per token, the quantization error
  against fp64 on the unquantized cache, and (on a GPU) the step's time and speedup.

Every function returns rows (dicts); the caller builds a DataFrame to show them.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from tritonattn import flash_attn_with_kvcache, rel_err
from tritonattn.testing import attention_ref, check_close, quantize_e4m3_ref, references

from . import measure
from .competitors import decode_eager_cat, decode_eager_slice
from .grids import COLORS, LABELS
from .seed_method import OOM, REPS, WARMUP, seeded
from .seed_method import measure as seed_measure

IMPLS = ("eager_slice", "eager_cat", "ours")
Row = Dict[str, Any]


def decode_arithmetic(batch: int, nheads: int, nheads_k: int, head_dim: int, dtype: torch.dtype,
                      cache_lens: Sequence[int]) -> List[Row]:
    """One decode step (one query token per request) per cache length N: kv_mib (K and V read once,
    2 * batch * N * nheads_k * head_dim * itemsize bytes), mflop (4 * batch * nheads * N * head_dim) and
    flop_per_byte, which is nheads / nheads_k for 2-byte K/V whatever N and the batch."""
    rows = []
    for n in cache_lens:
        nbytes = measure.decode_kv_bytes(batch * n, nheads_k, head_dim, dtype)
        flops = measure.attention_flops(batch, nheads, 1, n, head_dim, causal=False)
        rows.append({"cache_len": n, "kv_mib": nbytes / 2**20, "mflop": flops / 1e6, "flop_per_byte": flops / nbytes})
    return rows


def decode_bandwidth(batch: int, nheads: int, nheads_k: int, head_dim: int, dtype: torch.dtype,
                     cache_lens: Sequence[int], copy_gbps: float, *, rep: int = 30) -> List[Row]:
    """K/V bytes read / GPU time of one flash_attn_with_kvcache step over a full cache of N rows, per N.

    GPU time alone: CUDA events with L2 flushed before each call and the host's launch work hidden
    (measure.time_fn(flush_l2=True, hide_host=True)). Columns: cache_len, kv_mib, us, gbps, fraction
    (gbps / copy_gbps, the device copy's bandwidth, which counts bytes read and written). GPU only.
    """
    measure.require_gpu("decode_bandwidth")
    rows = []
    for n in cache_lens:
        ms = _step_ms(batch, nheads, nheads_k, head_dim, dtype, n, rep)
        nbytes = measure.decode_kv_bytes(batch * n, nheads_k, head_dim, dtype)
        gbps = measure.gbps(nbytes, ms)
        rows.append({"cache_len": n, "kv_mib": nbytes / 2**20, "us": ms * 1e3, "gbps": gbps,
                     "fraction": gbps / copy_gbps})
    torch.cuda.empty_cache()
    return rows


def _step_ms(batch: int, nheads: int, nheads_k: int, head_dim: int, dtype: torch.dtype, n: int, rep: int) -> float:
    """GPU time (ms, median) of one decode step over a full cache of n rows; the inputs die on return."""
    gen = torch.Generator(device="cuda").manual_seed(n)
    q = torch.randn(batch, 1, nheads, head_dim, device="cuda", dtype=dtype, generator=gen)
    k_cache = torch.randn(batch, n, nheads_k, head_dim, device="cuda", dtype=dtype, generator=gen)
    v_cache = torch.randn_like(k_cache)
    return measure.time_fn(lambda: flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=n), warmup=5,
                           rep=rep, flush_l2=True, hide_host=True)["median_ms"]


def _step_fns(q, k_cache, v_cache, k, v, n: int) -> Dict[str, Callable[[], torch.Tensor]]:
    """One decode step of each implementation: append the new token's k, v after n cached rows, attend
    over the n + 1 keys. Slice and ours write row n of the static cache in place; cat grows a copy of
    rows [0, n) by one row (torch.cat allocates and copies the whole cache) and drops it after the call."""
    return {
        "eager_slice": lambda: decode_eager_slice(q, k_cache, v_cache, n, k, v),
        "eager_cat": lambda: decode_eager_cat(q, k_cache[:, :n], v_cache[:, :n], k, v)[0],
        "ours": lambda: flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=n),
    }


def seed_decode_rows(batch: int, nheads: int, nheads_k: int, head_dim: int, dtype: torch.dtype,
                     cache_lens: Sequence[int], device, *, warmup: int = WARMUP, reps: int = REPS) -> List[Row]:
    """The seed's decode benchmark: per cache length N and implementation, one decode step (append one
    token, attend over N + 1 keys) measured by seed_method.measure: median_ms, std_ms, peak_mib (what
    the call allocates beyond the resident inputs; None without a GPU), status ("ok" or "OOM").

    Inputs drawn after seed_method.seeded(): q, k, v of one new token, and one static cache of
    max(cache_lens) + 1 rows that eager_slice and ours share (resident, so not counted); eager_cat gets
    its first N rows as the cache to grow. Before timing, each output is checked against the fp32
    reference over the same keys (error rule of tritonattn.testing): err, bound, ok in the row; a step that
    runs out of memory gives status "OOM" and no numbers.
    """
    on_cuda = torch.device(device).type == "cuda"
    seeded()
    rows_max = max(cache_lens) + 1
    q = torch.randn(batch, 1, nheads, head_dim, device=device, dtype=dtype)
    k_cache = torch.randn(batch, rows_max, nheads_k, head_dim, device=device, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    k = torch.randn(batch, 1, nheads_k, head_dim, device=device, dtype=dtype)
    v = torch.randn_like(k)
    rows = []
    with torch.no_grad():
        for n in cache_lens:
            k_cache[:, n: n + 1], v_cache[:, n: n + 1] = k, v  # the keys every step attends over: rows [0, n]
            ref, _, same = references(q, k_cache[:, : n + 1], v_cache[:, : n + 1], causal=False)
            for impl, fn in _step_fns(q, k_cache, v_cache, k, v, n).items():
                try:
                    ok, err, bound = check_close(fn(), ref, same)
                except torch.cuda.OutOfMemoryError:
                    ok = None
                if ok is None:
                    # Out of memory: an OOM row, not a wrong answer. The cache is emptied here, after the except
                    # clause, whose traceback held the failed call's tensors.
                    if on_cuda:
                        torch.cuda.empty_cache()
                    rows.append({"impl": impl, "cache_len": n, **OOM, "err": None, "bound": None, "ok": True})
                    continue
                rows.append({"impl": impl, "cache_len": n,
                             **seed_measure(fn, warmup=warmup, reps=reps, device=device),
                             "err": err, "bound": bound, "ok": bool(ok)})
    return rows


def plot_seed_decode(rows: Sequence[Row], *, title: str, path=None):
    """Two panels against cache length: latency (median +- std, ms) and incremental peak memory (MiB),
    linear axes, one line per implementation in its benchmarks.grids colour; OOM rows are left out.
    Without peak memory (no GPU) the memory panel says so. Saved to `path` when given, shown, closed."""
    import matplotlib.pyplot as plt

    from .report import write_figure

    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4))
    lens = sorted({r["cache_len"] for r in rows})
    measured_memory = False
    for impl in IMPLS:
        mine = sorted((r for r in rows if r["impl"] == impl and r["status"] == "ok"), key=lambda r: r["cache_len"])
        if not mine:
            continue
        x = [r["cache_len"] for r in mine]
        label, color = LABELS.get(impl, impl), COLORS[impl]
        ax_t.errorbar(x, [r["median_ms"] for r in mine], yerr=[r["std_ms"] for r in mine], marker="o",
                      capsize=3, label=label, color=color)
        if all(r["peak_mib"] is not None for r in mine):
            ax_m.plot(x, [r["peak_mib"] for r in mine], marker="o", label=label, color=color)
            measured_memory = True
    ax_t.set_ylabel("latency per step (ms, median +- std)")
    ax_m.set_ylabel("peak memory of one step (MiB)")
    if not measured_memory:
        ax_m.text(0.5, 0.5, "peak memory is measured on a GPU only", ha="center", va="center",
                  transform=ax_m.transAxes)
        ax_m.set_yticks([])
    for ax in (ax_t, ax_m):
        ax.set_xlabel("cache length (tokens)")
        ax.set_xticks(lens)
        ax.tick_params(axis="x", labelrotation=45)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
    ax_t.legend()
    if measured_memory:
        ax_m.legend()
    fig.suptitle(title)
    fig.tight_layout()
    write_figure(fig, path)


def by_impl(rows: Sequence[Row], value: str) -> Dict[str, Dict[int, Optional[float]]]:
    """{impl: {cache_len: rows' `value`}} (None where the call ran out of memory)."""
    table: Dict[str, Dict[int, Optional[float]]] = {}
    for r in rows:
        table.setdefault(r["impl"], {})[r["cache_len"]] = r[value] if r["status"] == "ok" else None
    return table


def fp8_decode_rows(batch: int, nheads: int, nheads_k: int, head_dim: int, dtype: torch.dtype,
                    cache_lens: Sequence[int], device, *, timed: bool, rep: int = 30) -> List[Row]:
    """An e4m3 cache against a `dtype` one, one decode step (one query token per request, no append) over a
    full cache of N rows, per N: bytes_per_token of each (2 * nheads_k * head_dim * itemsize), the FP8 step's
    relative error against fp64 on the unquantized cache (err_fp8; err_16 the 16-bit cache's), on unit normal
    K/V and with two outlier channels 20x larger (err_fp8_outliers); descales per (request, KV head), amax /
    448. timed (a GPU): us_16, us_fp8 (GPU time alone, as `decode_bandwidth`) and speedup = us_16 / us_fp8."""
    rows = []
    gen = torch.Generator(device="cpu").manual_seed(0)
    for n in cache_lens:
        row: Row = {"cache_len": n, "bytes_per_token": 2 * nheads_k * head_dim * dtype.itemsize,
                    "bytes_per_token_fp8": 2 * nheads_k * head_dim}
        q = torch.randn(batch, 1, nheads, head_dim, generator=gen).to(device=device, dtype=dtype)
        for outliers in (False, True):
            k, v = (torch.randn(batch, n, nheads_k, head_dim, generator=gen).to(device) for _ in range(2))
            if outliers:
                k[..., :2] *= 20.0
                v[..., :2] *= 20.0
            kd, vd = ((t.abs().amax((1, 3)) / 448.0).clamp(min=1e-12).contiguous() for t in (k, v))
            k8, v8 = quantize_e4m3_ref(k, kd), quantize_e4m3_ref(v, vd)
            with torch.no_grad():
                out8 = flash_attn_with_kvcache(q, k8, v8, cache_seqlens=n, k_descale=kd, v_descale=vd)
                ref, _ = attention_ref(q.double(), k.double(), v.double())
                if outliers:
                    row["err_fp8_outliers"] = rel_err(out8, ref)
                    continue
                out16 = flash_attn_with_kvcache(q, k.to(dtype), v.to(dtype), cache_seqlens=n)
            row.update(err_fp8=rel_err(out8, ref), err_16=rel_err(out16, ref))
            if timed:
                k16, v16 = k.to(dtype), v.to(dtype)
                time = dict(warmup=5, rep=rep, flush_l2=True, hide_host=True)
                us16 = measure.time_fn(lambda: flash_attn_with_kvcache(q, k16, v16, cache_seqlens=n),
                                       **time)["median_ms"] * 1e3
                us8 = measure.time_fn(lambda: flash_attn_with_kvcache(q, k8, v8, cache_seqlens=n, k_descale=kd,
                                                                      v_descale=vd), **time)["median_ms"] * 1e3
                row.update(us_16=us16, us_fp8=us8, speedup=us16 / us8)
        rows.append(row)
        if timed:
            torch.cuda.empty_cache()
    return rows
