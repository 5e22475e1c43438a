"""The seed document's prefill table, and the predicted floors it is read against (notebook 03).

The seed's setup: fp16, 32 query heads over 8 KV heads (GQA 4:1), head dim 128, batch 2, sequence lengths
2048 / 4096 / 8192, the forward pass without gradients. `measure_seed_prefill` times ours
(tritonattn.flash_attn_func), SDPA (tritonattn.testing.attention_sdpa, enable_gqa) and naive eager attention
(benchmarks.competitors.attention_eager) by the seed's method (benchmarks.seed_method: seed 42, 10 warm-ups,
median and standard deviation of 30 synchronized calls, incremental peak memory, "OOM" for a call that runs
out of memory). The seed does not say whether its prefill was causal, so both masks are measured.

A floor: no forward takes less than max(FLOPs / peak FLOP/s, bytes / bandwidth), the bytes being Q, K and V
read once and O written once, and none allocates less than its output. `floor_rows` prices the seed's shapes
on any `Peaks`: the NVIDIA L4's datasheet figures (`L4`, predicted) or ceilings measured on the GPU at hand.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence

import torch

from tritonattn import default_device, flash_attn_func
from tritonattn.testing import attention_sdpa, check_close, references

from . import seed_method
from .competitors import attention_eager
from .grids import LABELS, SEED_BATCH, SEED_SEQLENS
from .measure import attention_flops

SEED_NHEADS, SEED_NHEADS_K, SEED_HEAD_DIM, SEED_DTYPE = 32, 8, 128, torch.float16
MASKS = (False, True)  # non-causal, causal
# The implementations, keyed as in benchmarks.grids.COLORS; names as the tables print them.
IMPLS: Dict[str, Callable[..., torch.Tensor]] = {
    "ours": lambda q, k, v, causal: flash_attn_func(q, k, v, causal=causal),
    "sdpa": lambda q, k, v, causal: attention_sdpa(q, k, v, causal=causal),
    "eager": lambda q, k, v, causal: attention_eager(q, k, v, causal=causal),
}
NAMES = {"ours": "ours", "sdpa": "SDPA", "eager": "eager"}
# floor_rows' columns as a table prints them
FLOOR_COLUMNS = {"gflop": "GFLOP", "mbytes": "MB moved", "compute_ms": "compute ms", "memory_ms": "memory ms",
                 "floor_ms": "floor ms", "out_mib": "output MiB"}


@dataclass(frozen=True)
class Peaks:
    """What a GPU can do at most: dense fp16/bf16 tensor TFLOP/s (FP32 accumulate) and memory GB/s (1e9 B/s)."""

    name: str
    tflops: float
    gbps: float
    source: str


# NVIDIA L4. The product page (https://www.nvidia.com/en-us/data-center/l4/) gives "FP16 Tensor Core 242
# teraFLOPS" marked "with sparsity", and "GPU memory bandwidth 300GB/s". Dense is half the sparsity figure.
# The page gives one FP16 figure for either accumulator. On GeForce Ada cards FP32 accumulation runs at half
# the FP16-accumulate rate (Ada whitepaper, RTX 4090 table:
# https://images.nvidia.com/aem-dam/Solutions/geforce/ada/nvidia-ada-gpu-architecture.pdf); on the L4 a
# public measurement of torch's fp16 matmul (FP32 accumulate), L4_FP16_GEMM_MEASURED_TFLOPS, exceeds half
# the dense figure, so the L4 is taken at the full dense rate with FP32 accumulation.
L4_FP16_SPARSE_TFLOPS = 242.0  # https://www.nvidia.com/en-us/data-center/l4/ (with sparsity)
L4_BANDWIDTH_GBPS = 300.0  # https://www.nvidia.com/en-us/data-center/l4/
L4_FP16_GEMM_MEASURED_TFLOPS = 68.83  # 2048^3 fp16 torch.matmul, https://github.com/zzc0721/torch-performance-test-data/issues/120
L4 = Peaks("NVIDIA L4", L4_FP16_SPARSE_TFLOPS / 2, L4_BANDWIDTH_GBPS,
           "datasheet: https://www.nvidia.com/en-us/data-center/l4/ (dense = the sparsity figure / 2)")


def peaks_from_ceilings(name: str, ceilings: Mapping[str, Any]) -> Peaks:
    """Peaks from benchmarks.measure.ceilings() or H200_MEASURED_CEILINGS: the bf16 matmul TFLOP/s and the
    larger of the copy and read-only bandwidths."""
    gbps = ceilings.get("bandwidth_gbps") or max(ceilings["copy_gbps"], ceilings["read_gbps"])
    return Peaks(name, float(ceilings["matmul_tflops"]), float(gbps),
                 "measured ceilings (bf16 matmul, max(copy, read))")


def prefill_floor(peaks: Peaks, *, batch: int, seqlen: int, nheads: int, nheads_k: int, head_dim: int,
                  causal: bool, itemsize: int = 2) -> Dict[str, Any]:
    """The forward's floors on `peaks`: gflop, mbytes (Q, K, V read and O written, 1e6 B), compute_ms,
    memory_ms, floor_ms (the larger), bound ("compute" or "memory") and out_mib (the output, MiB)."""
    flops = attention_flops(batch, nheads, seqlen, seqlen, head_dim, causal)
    out_bytes = batch * seqlen * nheads * head_dim * itemsize
    nbytes = 2 * out_bytes + 2 * batch * seqlen * nheads_k * head_dim * itemsize
    compute_ms = flops / (peaks.tflops * 1e12) * 1e3
    memory_ms = nbytes / (peaks.gbps * 1e9) * 1e3
    return {"gflop": flops / 1e9, "mbytes": nbytes / 1e6, "compute_ms": compute_ms, "memory_ms": memory_ms,
            "floor_ms": max(compute_ms, memory_ms), "bound": "compute" if compute_ms >= memory_ms else "memory",
            "out_mib": out_bytes / 2**20}


def floor_rows(peaks: Peaks, seqlens: Iterable[int] = SEED_SEQLENS, masks: Sequence[bool] = MASKS, *,
               batch: int = SEED_BATCH, nheads: int = SEED_NHEADS, nheads_k: int = SEED_NHEADS_K,
               head_dim: int = SEED_HEAD_DIM, itemsize: int = 2) -> List[Dict[str, Any]]:
    """One row per (seqlen, mask): seqlen, mask, then prefill_floor's fields."""
    return [dict(seqlen=n, mask=_mask(c), **prefill_floor(peaks, batch=batch, seqlen=n, nheads=nheads,
                                                          nheads_k=nheads_k, head_dim=head_dim, causal=c,
                                                          itemsize=itemsize))
            for c in masks for n in seqlens]


def check_ours(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool):
    """(ok, err, bound): flash_attn_func against the fp32 reference by the tests' error rule
    (tritonattn.testing.check_close), on batch entry 0 and the query heads of KV head 0. A slice, because the
    reference materialises fp32 scores: at the seed's 8192 keys the whole batch's would take 16 GiB."""
    group = q.shape[2] // k.shape[2]
    qs, ks, vs = q[:1, :, :group], k[:1, :, :1], v[:1, :, :1]
    ref, _, same = references(qs, ks, vs, causal=causal)
    return check_close(flash_attn_func(qs, ks, vs, causal=causal), ref, same)


def measure_seed_prefill(seqlens: Iterable[int] = SEED_SEQLENS, masks: Sequence[bool] = MASKS, *,
                         batch: int = SEED_BATCH, nheads: int = SEED_NHEADS, nheads_k: int = SEED_NHEADS_K,
                         head_dim: int = SEED_HEAD_DIM, dtype: torch.dtype = SEED_DTYPE, device: Any = None,
                         warmup: int = seed_method.WARMUP, reps: int = seed_method.REPS,
                         impls: Sequence[str] = tuple(IMPLS)) -> List[Dict[str, Any]]:
    """The seed's prefill table: one row per (seqlen, mask, impl) with seqlen, mask, impl, median_ms, std_ms,
    peak_mib (None without a GPU), status ("ok" or "OOM"), out_mib (the output tensor), and on the ours row
    err / bound / ok: ours against the fp32 reference by the error rule (`check_ours`; None elsewhere). Inputs
    are drawn after seed 42, on `device` (None: tritonattn.default_device())."""
    unknown = [impl for impl in impls if impl not in IMPLS]
    if unknown:
        raise ValueError(f"Expected impls among {list(IMPLS)}, got {unknown}.")
    device = default_device() if device is None else torch.device(device)
    rows = []
    for causal in masks:
        for n in seqlens:
            seed_method.seeded()
            q = torch.randn(batch, n, nheads, head_dim, device=device, dtype=dtype)
            k, v = (torch.randn(batch, n, nheads_k, head_dim, device=device, dtype=dtype) for _ in range(2))
            out_mib = q.numel() * q.element_size() / 2**20
            with torch.no_grad():
                ok, err, bound = check_ours(q, k, v, causal)
                for impl in impls:
                    result = seed_method.measure(lambda: IMPLS[impl](q, k, v, causal), warmup=warmup, reps=reps,
                                                 device=device)
                    rows.append(dict(seqlen=n, mask=_mask(causal), impl=impl, out_mib=out_mib,
                                     **(dict(err=err, bound=bound, ok=ok) if impl == "ours" else
                                        dict(err=None, bound=None, ok=None)), **result))
    return rows


def committed_seed_rows(df, dtype: str = "fp16") -> List[Dict[str, Any]]:
    """The suite's committed rows of the seed grid (a normalized prefill_fwd DataFrame, e.g. from
    benchmarks.report.load_suite) in measure_seed_prefill's row format (median_ms from the suite's timing)."""
    df = df[(df["grid"] == "seed") & (df["dtype"] == dtype) & (df["status"] == "ok")]
    return [dict(seqlen=int(r.seqlen), mask=_mask(bool(r.causal)), impl=r.impl, median_ms=float(r.median_ms),
                 std_ms=None, peak_mib=float(r.peak_mem_mib), status="ok", out_mib=None, err=None, bound=None,
                 ok=None)
            for r in df.itertuples()]


def seed_table(rows: Sequence[Mapping[str, Any]], what: str = "time") -> List[Dict[str, str]]:
    """The rows as the seed printed them, one line per (seqlen, mask): what="time" gives each implementation's
    'median +- std ms' (or OOM) and SDPA's time over ours (above 1: ours faster); what="memory" each one's
    incremental peak MiB and the output tensor's size."""
    if what not in ("time", "memory"):
        raise ValueError(f"Expected what='time' or 'memory', got {what!r}.")
    out = []
    for (n, mask), by_impl in _by_shape(rows).items():
        line = {"seqlen": str(n), "mask": mask}
        for impl, r in by_impl.items():
            if what == "time":
                line[_name(impl)] = seed_method.cell(r)
            else:
                line[f"{_name(impl)} MiB"] = r["status"] if r["status"] != "ok" else _mib(r["peak_mib"])
        if what == "time":
            line["SDPA / ours"] = _num(_ratio(by_impl.get("sdpa"), by_impl.get("ours")), "{:.2f}x")
        else:
            line["output MiB"] = _mib(next(iter(by_impl.values()))["out_mib"])
        out.append(line)
    return out


def floor_fractions(rows: Sequence[Mapping[str, Any]], peaks: Peaks, *, batch: int = SEED_BATCH,
                    nheads: int = SEED_NHEADS, nheads_k: int = SEED_NHEADS_K,
                    head_dim: int = SEED_HEAD_DIM) -> List[Dict[str, Any]]:
    """Per (seqlen, mask): the floor on `peaks` (ms, bound) and, per implementation, floor_ms / median_ms,
    the fraction of the floor it reached (1.0 = at the floor; None when it has no time)."""
    out = []
    for (n, mask), by_impl in _by_shape(rows).items():
        floor = prefill_floor(peaks, batch=batch, seqlen=n, nheads=nheads, nheads_k=nheads_k, head_dim=head_dim,
                              causal=mask == "causal")
        line: Dict[str, Any] = {"seqlen": n, "mask": mask, "floor_ms": floor["floor_ms"], "bound": floor["bound"]}
        for impl, r in by_impl.items():
            line[_name(impl)] = floor["floor_ms"] / r["median_ms"] if r.get("median_ms") else None
        out.append(line)
    return out


def _mask(causal: bool) -> str:
    return "causal" if causal else "none"


def _name(impl: str) -> str:
    return NAMES.get(impl, LABELS.get(impl, impl))


def _by_shape(rows: Sequence[Mapping[str, Any]]) -> Dict[tuple, Dict[str, Mapping[str, Any]]]:
    shapes: Dict[tuple, Dict[str, Mapping[str, Any]]] = {}
    for r in rows:
        shapes.setdefault((r["seqlen"], r["mask"]), {})[r["impl"]] = r
    return shapes


def _ratio(num: Optional[Mapping[str, Any]], den: Optional[Mapping[str, Any]]) -> Optional[float]:
    if not num or not den or not num.get("median_ms") or not den.get("median_ms"):
        return None
    return num["median_ms"] / den["median_ms"]


def _num(value: Optional[float], fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def _mib(value: Optional[float]) -> str:
    return _num(value, "{:.1f}" if value is None or value >= 0.1 else "{:.3g}")
