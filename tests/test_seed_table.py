"""Tests of benchmarks/seed_method.py (the seed's measurement method), benchmarks/seed_table.py (the seed's
prefill table and the predicted floors) and of the report figures notebook 03 draws from it
(benchmarks.report.plot_seed_prefill, plot_ratios, decode_grid). CPU, except the one CUDA memory test."""

from __future__ import annotations

import math

import pytest
import torch

from benchmarks import grids, measure, report, seed_method, seed_table
from helpers import DEVICE, ON_GPU

SEED = dict(batch=2, nheads=32, nheads_k=8, head_dim=128)


def test_l4_peaks_are_the_dense_datasheet_figures():
    assert seed_table.L4.tflops == pytest.approx(121.0)  # the 242 with sparsity, halved
    assert seed_table.L4.gbps == pytest.approx(300.0)
    assert "nvidia.com" in seed_table.L4.source
    # the public L4 measurement that rules out a halved FP32-accumulate rate
    assert seed_table.L4.tflops / 2 < seed_table.L4_FP16_GEMM_MEASURED_TFLOPS < seed_table.L4.tflops


def test_prefill_floor_at_the_seed_shape():
    floor = seed_table.prefill_floor(seed_table.L4, seqlen=2048, causal=False, **SEED)
    flops = 4 * 2 * 32 * 2048**2 * 128
    nbytes = 2 * (2 * 2048 * 32 * 128) * 2 + 2 * (2 * 2048 * 8 * 128) * 2  # Q and O, K and V, fp16
    assert floor["gflop"] == pytest.approx(flops / 1e9)
    assert floor["mbytes"] == pytest.approx(nbytes / 1e6)
    assert floor["compute_ms"] == pytest.approx(flops / 121e12 * 1e3)
    assert floor["memory_ms"] == pytest.approx(nbytes / 300e9 * 1e3)
    assert floor["floor_ms"] == floor["compute_ms"] and floor["bound"] == "compute"
    assert floor["out_mib"] == 32.0
    causal = seed_table.prefill_floor(seed_table.L4, seqlen=2048, causal=True, **SEED)
    assert causal["compute_ms"] == pytest.approx(floor["compute_ms"] / 2)
    assert causal["memory_ms"] == floor["memory_ms"]
    slow_flops = seed_table.Peaks("x", tflops=1e6, gbps=1.0, source="test")
    assert seed_table.prefill_floor(slow_flops, seqlen=64, causal=False, **SEED)["bound"] == "memory"


def test_floor_rows_cover_the_seed_grid():
    rows = seed_table.floor_rows(seed_table.L4)
    assert [(r["seqlen"], r["mask"]) for r in rows] == [(n, m) for m in ("none", "causal") for n in (2048, 4096, 8192)]
    assert [r["out_mib"] for r in rows[:3]] == [32.0, 64.0, 128.0]
    assert all(r["floor_ms"] > 0 for r in rows)


def test_peaks_from_ceilings():
    h200 = seed_table.peaks_from_ceilings("NVIDIA H200", measure.H200_MEASURED_CEILINGS)
    assert h200.tflops == measure.H200_MEASURED_CEILINGS["matmul_tflops"]
    assert h200.gbps == max(measure.H200_MEASURED_CEILINGS["copy_gbps"], measure.H200_MEASURED_CEILINGS["read_gbps"])
    live = seed_table.peaks_from_ceilings("g", {"matmul_tflops": 10.0, "copy_gbps": 1.0, "read_gbps": 2.0,
                                                "bandwidth_gbps": 3.0})
    assert live.gbps == 3.0


def row(n, mask, impl, ms, status="ok", peak=None):
    return dict(seqlen=n, mask=mask, impl=impl, median_ms=ms if status == "ok" else None,
                std_ms=ms / 10 if status == "ok" else None, peak_mib=peak, status=status, out_mib=32.0, err=None,
                bound=None, ok=None)


def test_tables_print_oom_and_ratios():
    rows = [row(2048, "none", "ours", 1.0, peak=33.0), row(2048, "none", "sdpa", 1.1, peak=32.0),
            row(2048, "none", "eager", 0.0, status="OOM")]
    (time,) = seed_table.seed_table(rows)
    assert time == {"seqlen": "2048", "mask": "none", "ours": "1.000 +- 0.100 ms", "SDPA": "1.100 +- 0.110 ms",
                    "eager": "OOM", "SDPA / ours": "1.10x"}
    (memory,) = seed_table.seed_table(rows, "memory")
    assert memory == {"seqlen": "2048", "mask": "none", "ours MiB": "33.0", "SDPA MiB": "32.0", "eager MiB": "OOM",
                      "output MiB": "32.0"}
    (no_gpu,) = seed_table.seed_table([row(64, "causal", "ours", 5.0)], "memory")
    assert no_gpu["ours MiB"] == "-"
    with pytest.raises(ValueError, match="time"):
        seed_table.seed_table(rows, "both")


def test_floor_fractions():
    floor = seed_table.prefill_floor(seed_table.L4, seqlen=2048, causal=True, **SEED)["floor_ms"]
    rows = [row(2048, "causal", "ours", 2 * floor), row(2048, "causal", "eager", 0.0, status="OOM")]
    (line,) = seed_table.floor_fractions(rows, seed_table.L4)
    assert line["ours"] == pytest.approx(0.5) and line["eager"] is None
    assert line["bound"] == "compute" and line["floor_ms"] == pytest.approx(floor)


def test_seed_method_measure_times_counts_and_reports_oom():
    """measure: reps synchronized samples after the warm-ups, median and std; an OOM is a status, not a crash;
    memory only on a CUDA device; bad counts are rejected."""
    calls = []
    result = seed_method.measure(lambda: calls.append(1), warmup=3, reps=4, device="cpu")
    assert len(calls) == 3 + 4 and result["status"] == "ok" and result["peak_mib"] is None
    assert result["median_ms"] >= 0 and result["std_ms"] >= 0
    assert seed_method.cell(result).endswith(" ms") and " +- " in seed_method.cell(result)

    def out_of_memory():
        raise torch.cuda.OutOfMemoryError("CUDA out of memory (test)")

    oom = seed_method.measure(out_of_memory, warmup=0, reps=2, device="cpu")
    assert oom == seed_method.OOM and oom is not seed_method.OOM and seed_method.cell(oom) == "OOM"
    for bad in (dict(reps=1), dict(warmup=-1), dict(reps=2.5)):
        with pytest.raises(ValueError, match="reps >= 2"):
            seed_method.measure(lambda: None, device="cpu", **bad)


@pytest.mark.skipif(not ON_GPU, reason="CUDA memory")
def test_seed_method_measure_counts_what_the_call_allocates():
    """peak_mib is the call's own allocation (its 4 MiB output here), not the resident input."""
    x = torch.empty(2**20, device="cuda")
    result = seed_method.measure(lambda: x * 2, warmup=1, reps=2)
    assert result["peak_mib"] == pytest.approx(4.0, abs=0.01)


def test_measure_seed_prefill_reports_an_oom_row(monkeypatch):
    def out_of_memory(q, k, v, causal):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory (test)")

    monkeypatch.setitem(seed_table.IMPLS, "eager", out_of_memory)
    rows = seed_table.measure_seed_prefill((32,), (False, True), batch=1, nheads=4, nheads_k=2, head_dim=16,
                                           device=DEVICE, warmup=0, reps=2)
    assert [(r["mask"], r["impl"], r["status"]) for r in rows] == [
        (m, i, "OOM" if i == "eager" else "ok") for m in ("none", "causal") for i in ("ours", "sdpa", "eager")]
    ours = [r for r in rows if r["impl"] == "ours"]
    assert all(r["ok"] and r["err"] <= r["bound"] for r in ours)
    assert all((r["peak_mib"] is None) != ON_GPU and r["median_ms"] > 0 for r in ours)
    assert rows[0]["out_mib"] == pytest.approx(32 * 4 * 16 * 2 / 2**20)
    assert [t["eager"] for t in seed_table.seed_table(rows)] == ["OOM", "OOM"]
    with pytest.raises(ValueError, match="impls"):
        seed_table.measure_seed_prefill((32,), impls=("ours", "flash"), device=DEVICE)


def test_committed_seed_rows_read_the_h200_run():
    df = report.load_suite("prefill_fwd", "results", "NVIDIA H200", log=lambda m: None)
    rows = seed_table.committed_seed_rows(df, "fp16")
    assert {(r["seqlen"], r["mask"]) for r in rows} == {(n, m) for n in grids.SEED_SEQLENS for m in ("none", "causal")}
    assert {"ours", "sdpa_cudnn"} <= {r["impl"] for r in rows}
    lines = seed_table.floor_fractions(rows, seed_table.peaks_from_ceilings("H200", measure.H200_MEASURED_CEILINGS))
    assert all(0 < line["ours"] < 1 for line in lines)
    assert "SDPA cuDNN" in lines[0]


def test_report_figures(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    rows = [row(n, m, impl, n / 1000 * k, peak=n / 64 * k) for n in (2048, 4096) for m in ("none", "causal")
            for k, impl in enumerate(("ours", "sdpa", "eager"), start=1)]
    rows[-1] = row(4096, "causal", "eager", 0.0, status="OOM")
    report.plot_seed_prefill(rows, "seed", seed_table.NAMES, path=tmp_path / "seed.png", log=lambda m: None)
    frames = {s: report.load_suite(s, "results", "NVIDIA H200", log=lambda m: None) for s in grids.SUITES}
    report.plot_ratios(frames, "fp16", path=tmp_path / "ratios.png", log=lambda m: None)
    assert (tmp_path / "seed.png").stat().st_size > 0 and (tmp_path / "ratios.png").stat().st_size > 0
    grid = report.decode_grid(frames["decode"])
    assert list(grid.columns) == list(grids.DECODE_CACHE_LENS)
    assert grid.notna().all().all() and all(math.isfinite(v) and v > 0 for v in grid.to_numpy().ravel())
    assert report.decode_grid(frames["decode"], "ours").to_numpy().min() > 100  # GB/s
