"""CPU tests of the benchmark suite (benchmarks/suite.py, grids.py, report.py, __main__.py): the CLI without a
GPU, the grids, resumable CSVs, wrong results never timed, the time budget, the headline ratios and the plots.

Measurements run through a fake timer (calls each function once, returns fixed times) on the CPU, our
kernels under the Triton interpreter at tiny shapes, so the row building, checks and CSV flow are the
GPU run's. Everything is written into pytest's tmp_path, never into results/ or figures/.
"""

import csv
import math
import re
import subprocess
import sys

import matplotlib
import pytest
import torch

from benchmarks import grids, measure, report, results, suite
from benchmarks.__main__ import main
from benchmarks.grids import ChunkedShape, DecodeShape, PrefillShape

matplotlib.use("Agg")

GPU = "FAKE GPU"
SLUG = "fake-gpu"
CPU = torch.device("cpu")


class FakeTimer:
    """benchmarks.suite.CudaTimer's interface without a GPU: runs each function once (so the step code
    really executes), returns fixed timings, and counts what was timed."""

    def __init__(self):
        self.timed = []

    def time(self, fn, *, warmup, rep, rotate=None, flush_l2=False, hide_host=False):
        fn(*(rotate[0] if rotate else ()))
        self.timed.append(fn)
        return {"median_ms": 2.0, "p20_ms": 1.9, "p80_ms": 2.1, "min_ms": 1.8}

    def graph(self, fn, *, rep, repeat=1):
        fn()
        return 1.0

    def memory(self, fn):
        fn()
        return 3 * 2**20

    def host(self, fn, *, calls):
        fn()
        return {"host_us": 20.0, "host_p20_us": 19.0, "host_p80_us": 22.0}

    def ceilings(self):
        return {"matmul_tflops": 800.0, "copy_gbps": 4000.0, "read_gbps": 4400.0, "bandwidth_gbps": 4400.0}

    def free_bytes(self):
        return 1e12

    def l2_bytes(self):
        return 8192

    def synchronize(self):
        pass

    def empty_cache(self):
        pass


def _run(tmp_path, suites, shapes, *, commit="c0ffee", gpu=GPU, timer=None, **kw):
    messages = []
    summary = suite.run(suites, quick=True, dtypes=["fp16"], results_dir=tmp_path / "results", figures_dir=None,
                        flex=False, timer=timer or FakeTimer(), device=CPU, gpu=gpu, commit=commit, shapes=shapes,
                        log=messages.append, **kw)
    return summary, messages


def _rows(tmp_path, name, slug=SLUG):
    with open(tmp_path / "results" / slug / f"bench_{name}.csv", newline="") as f:
        return list(csv.DictReader(f))


TINY_PREFILL = [PrefillShape(1, 24, 2, 1, 32, True), PrefillShape(2, 17, 2, 2, 32, False)]


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CLI's exit without a GPU")
def test_cli_without_gpu_exits_nonzero(capsys):
    """`python -m benchmarks` (any suite, quick or not) without a GPU says it needs one and exits 1."""
    assert main([]) == 1
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert main(["--suite", "decode", "--quick"]) == 1
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert main(["--max-minutes", "5"]) == 1
    assert "needs a CUDA GPU" in capsys.readouterr().err
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        suite.run(["decode"], quick=True)


def test_cli_list_and_bad_arguments(capsys):
    """--list prints the grids without a GPU; an unknown suite or dtype is a usage error (exit 2)."""
    assert main(["--list", "--quick", "--suite", "prefill_fwd,decode,decode_splits"]) == 0
    out = capsys.readouterr().out
    assert "prefill_fwd: 13 shapes" in out and "decode: 5 shapes" in out and "grid=seed" in out
    assert "decode_splits: 1 shapes" in out and "batch=1 cache_len=16384" in out and "grid=splits" in out
    assert main(["--suite", "prefill"]) == 2
    assert main(["--dtypes", "int8"]) == 2


def test_module_runs_from_the_command_line():
    """`python -m benchmarks --list` runs the package's __main__ in a fresh interpreter and exits 0."""
    done = subprocess.run([sys.executable, "-m", "benchmarks", "--list", "--quick", "--suite", "decode_splits"],
                          cwd=results.REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("decode_splits: 1 shapes")


# --------------------------------------------------------------------------------------------
# Grids
# --------------------------------------------------------------------------------------------
def test_grids_quick_is_a_small_subset_of_full():
    """Each suite's quick grid is a strict subset of its full grid."""
    for name in grids.SUITES:
        quick, full = grids.suite_shapes(name, True), grids.suite_shapes(name, False)
        assert set(quick) < set(full), name
        assert len(quick) <= len(full) / 2, name


def test_prefill_grid_has_issue_seed_and_head_dims_64_and_256():
    """Prefill: 16384 tokens, 32 q heads over 32/8 KV heads, causal and not, D=128, 64 and 256, and the seed's
    rows."""
    full = grids.prefill_shapes(False)
    issue = [s for s in full if s.grid == "issue"]
    assert all(s.batch * s.seqlen == 16384 and s.nheads == 32 for s in issue)
    assert {s.seqlen for s in issue} == {1024, 2048, 4096, 8192, 16384}
    assert {(s.nheads_k, s.causal, s.head_dim) for s in issue} == {
        (hk, c, d) for hk in (32, 8) for c in (False, True) for d in (128, 64, 256)}
    seed = {(s.batch, s.seqlen, s.nheads, s.nheads_k, s.head_dim, s.causal) for s in full if s.grid == "seed"}
    assert seed == {(2, s, 32, 8, 128, c) for s in (2048, 4096, 8192) for c in (False, True)}


def test_a_seed_shape_equal_to_an_issue_shape_keeps_both_rows():
    """The seed's batch 2 x 8192 GQA shape is also an issue-grid point: the grid is part of the key, so
    loading keeps the issue row (the plots draw that grid) next to the seed's."""
    import pandas as pd

    full = grids.prefill_shapes(False)
    shared = {(s.batch, s.seqlen, s.nheads_k, s.head_dim, s.causal) for s in full if s.grid == "seed"} & {
        (s.batch, s.seqlen, s.nheads_k, s.head_dim, s.causal) for s in full if s.grid == "issue"}
    assert shared
    row = dict(impl="ours", dtype="bf16", batch=2, seqlen=8192, nheads=32, nheads_k=8, head_dim=128, causal=True,
               quick=False, gpu="G", tflops=1.0)
    df = report.normalize(pd.DataFrame([dict(row, grid="issue"), dict(row, grid="seed")]), "prefill_fwd")
    assert sorted(df["grid"]) == ["issue", "seed"]
    assert suite.row_key("prefill_fwd", dict(row, grid="issue")) != suite.row_key("prefill_fwd", dict(row, grid="seed"))


def test_prefill_config_names_the_kernel_that_runs(monkeypatch):
    """On Hopper with Gluon, a forward the dispatcher gives the warp-specialized kernel is labelled as that
    kernel, from its key-count threshold on; shorter calls, head dims 64 and 256 and the backward keep the
    block-level tables."""
    import tritonattn.config.tables as tables
    from tritonattn.config.hardware import TARGETS, planning_for

    monkeypatch.setattr(tables, "gluon_sm90_available", lambda: True)
    cuda = torch.device("cuda")
    with planning_for(TARGETS["H100"]):
        long = suite.prefill_config(torch.bfloat16, 128, False, cuda, "fwd_bwd", 4096)
        short = suite.prefill_config(torch.bfloat16, 128, True, cuda, "fwd", 1024)
        d64 = suite.prefill_config(torch.bfloat16, 64, False, cuda, "fwd", 4096)
        d256 = suite.prefill_config(torch.bfloat16, 256, False, cuda, "fwd", 4096)
    with planning_for(TARGETS["L4"]):
        ada = suite.prefill_config(torch.bfloat16, 128, False, cuda, "fwd", 4096)
    assert long.startswith("fwd sm90_ws BM128/BN128") and "; bwd dkdv BM" in long, long
    assert all(t.startswith("fwd BM") for t in (short, d64, d256, ada)), (short, d64, d256, ada)


def test_decode_and_chunked_grids():
    """Decode: batch {1,8,32,128} x cache {1024..65536} at D=128 and 64, the seed's batch 2 up to 8192, one
    host-overhead shape (batch 1 x 4096, D=128); chunked: chunks 512/2048 on 0/4096/12288 cached tokens."""
    full = grids.decode_shapes(False)
    issue = {(s.batch, s.cache_len, s.head_dim) for s in full if s.grid == "issue"}
    assert issue == {(b, n, d) for b in (1, 8, 32, 128) for n in (1024, 4096, 16384, 65536) for d in (128, 64)}
    assert {(s.batch, s.cache_len) for s in full if s.grid == "seed"} == {(2, n) for n in (1024, 2048, 4096, 8192)}
    assert all((s.nheads, s.nheads_k) == (32, 8) for s in full)
    host = [s for s in full if s.host]
    assert [(s.batch, s.cache_len, s.head_dim) for s in host] == [(1, 4096, 128)]
    assert any(s.host for s in grids.decode_shapes(True))
    chunked = grids.chunked_shapes(False)
    assert {(s.batch, s.chunk, s.cache_len) for s in chunked} == {
        (b, c, n) for b in (1, 4) for c in (512, 2048) for n in (0, 4096, 12288)}


def test_split_and_gqa_sweeps():
    """decode_splits: one request of 32:8 heads, D=128, caches 4096/16384/65536 (quick 16384), num_splits 1..64;
    the GQA sweep: 16 q heads over 16/8/4/2/1 KV heads (quick 16/4/1), 4 x 4096 tokens, D=128, causal and not."""
    full = grids.decode_split_shapes(False)
    assert {(s.batch, s.nheads, s.nheads_k, s.head_dim, s.grid) for s in full} == {(1, 32, 8, 128, "splits")}
    assert [s.cache_len for s in full] == [4096, 16384, 65536] and not any(s.host for s in full)
    assert [s.cache_len for s in grids.decode_split_shapes(True)] == [16384]
    assert grids.SPLIT_VALUES == (1, 2, 4, 8, 16, 32, 64)
    gqa = grids.gqa_shapes(False)
    assert {(s.batch, s.seqlen, s.nheads, s.head_dim, s.grid) for s in gqa} == {(4, 4096, 16, 128, "gqa")}
    assert sorted((s.nheads_k, s.causal) for s in gqa) == sorted((hk, c) for hk in (16, 8, 4, 2, 1)
                                                                 for c in (False, True))
    quick = grids.gqa_shapes(True)
    assert set(quick) < set(gqa) and {s.nheads_k for s in quick} == {16, 4, 1}
    assert "gqa" not in grids.SUITES  # run by notebook 01, not by the suite


# --------------------------------------------------------------------------------------------
# Runs with a fake timer
# --------------------------------------------------------------------------------------------
def test_resume_skips_rows_of_the_same_commit_and_gpu(tmp_path):
    """Rows already written for this commit and GPU are skipped; another commit, another GPU or --force re-measure."""
    shapes = {"prefill_fwd": TINY_PREFILL}
    kw = dict(peers=["eager"])
    summary, _ = _run(tmp_path, ["prefill_fwd"], shapes, **kw)
    assert summary["prefill_fwd"]["rows"] == 2
    assert len(suite.done_keys("prefill_fwd", gpu=GPU, commit="c0ffee", results_dir=tmp_path / "results")) == 2

    summary, _ = _run(tmp_path, ["prefill_fwd"], shapes, **kw)
    assert summary["prefill_fwd"] == {"rows": 0, "shapes_done_before": 2, "shapes_left": 0}

    summary, _ = _run(tmp_path, ["prefill_fwd"], shapes, commit="beef", **kw)
    assert summary["prefill_fwd"]["rows"] == 2
    summary, _ = _run(tmp_path, ["prefill_fwd"], shapes, gpu="OTHER GPU", **kw)
    assert summary["prefill_fwd"]["rows"] == 2
    summary, _ = _run(tmp_path, ["prefill_fwd"], shapes, force=True, **kw)
    assert summary["prefill_fwd"]["rows"] == 2
    assert len(_rows(tmp_path, "prefill_fwd")) == 6 and len(_rows(tmp_path, "prefill_fwd", "other-gpu")) == 2

    # a partly measured shape: only the missing (impl, shape) is measured
    summary, _ = _run(tmp_path, ["prefill_fwd"], shapes, commit="partial", peers=["eager", "sdpa_flash"])
    assert summary["prefill_fwd"]["rows"] == 4
    path = tmp_path / "results" / SLUG / "bench_prefill_fwd.csv"
    rows = _rows(tmp_path, "prefill_fwd")
    drop = next(i for i, r in enumerate(rows) if r["commit"] == "partial" and r["impl"] == "sdpa_flash")
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows[:drop] + rows[drop + 1:])
    timer = FakeTimer()
    summary, _ = _run(tmp_path, ["prefill_fwd"], shapes, commit="partial", peers=["eager", "sdpa_flash"], timer=timer)
    assert summary["prefill_fwd"]["rows"] == 1 and len(timer.timed) == 1


def test_row_key_matches_after_a_csv_round_trip(tmp_path):
    """A row's key computed from Python values equals the key of the same row read back from the CSV."""
    row = results.make_row(gpu=GPU, impl="ours_paged", page_size=16, dtype="bf16", batch=8, cache_len=4096,
                           nheads=32, nheads_k=8, head_dim=128, metric="step", quick=False, gbps=1.5)
    results.write_csv([row], "bench_decode", results_dir=tmp_path)
    with open(tmp_path / SLUG / "bench_decode.csv", newline="") as f:
        back = next(csv.DictReader(f))
    assert suite.row_key("decode", back) == suite.row_key("decode", row)


def test_wrong_result_is_reported_and_never_timed(tmp_path, monkeypatch):
    """If our kernel's output fails the reference check, the row says 'wrong' with its error and has no timing."""
    monkeypatch.setattr(suite, "flash_attn_func", lambda q, k, v, causal=False: torch.zeros_like(q))
    timer = FakeTimer()
    summary, messages = _run(tmp_path, ["prefill_fwd"], {"prefill_fwd": TINY_PREFILL[:1]}, peers=["ours"],
                             timer=timer)
    (row,) = _rows(tmp_path, "prefill_fwd")
    assert row["status"] == "wrong" and float(row["err"]) > float(row["err_bound"])
    assert row.get("median_ms", "") == "" and row.get("tflops", "") == ""
    assert timer.timed == [] and any(m.startswith("WRONG") for m in messages)


def test_failing_peer_is_an_error_row(tmp_path):
    """A peer that raises on a shape (SDPA's cuDNN backend on the CPU) gives an 'error' row with the reason."""
    _run(tmp_path, ["prefill_fwd"], {"prefill_fwd": TINY_PREFILL[:1]}, peers=["sdpa_cudnn"])
    (row,) = _rows(tmp_path, "prefill_fwd")
    assert row["status"] == "error" and row["note"] and row.get("median_ms", "") == ""


def test_time_budget_stops_cleanly(tmp_path):
    """max_minutes=0: the run measures nothing, says it stopped, and a later call carries on."""
    shapes = {"prefill_fwd": TINY_PREFILL}
    summary, messages = _run(tmp_path, ["prefill_fwd"], shapes, peers=["eager"], max_minutes=0)
    assert summary["stopped"] and summary["prefill_fwd"]["rows"] == 0 and summary["prefill_fwd"]["shapes_left"] == 2
    assert any("run the same command again" in m for m in messages)
    assert not (tmp_path / "results" / SLUG / "bench_prefill_fwd.csv").exists()
    summary, _ = _run(tmp_path, ["prefill_fwd"], shapes, peers=["eager"])
    assert not summary["stopped"] and summary["prefill_fwd"]["rows"] == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="runs the runners on CPU tensors under the interpreter; on a GPU "
                    "the suite itself (python -m benchmarks) is the check")
def test_interpreter_run_of_every_suite(tmp_path):
    """Our kernels under the interpreter through every runner: checked ok, rows stamped, ratios computed."""
    shapes = {
        "prefill_fwd_bwd": [PrefillShape(1, 24, 2, 1, 32, True)],
        "decode": [DecodeShape(2, 48, 2, 1, 32, host=True)],
        "chunked": [ChunkedShape(1, 16, 128, 1, 1, 32)],  # >= 128 new tokens: the prefill path
    }
    peers = ["ours", "eager", "ours_paged", "sdpa", "eager_slice", "eager_cat", "ours_prefill", "ours_kvcache",
             "ours_kvcache_paged"]
    summary, messages = _run(tmp_path, list(shapes), shapes, peers=peers)
    assert not summary["stopped"]

    prefill = _rows(tmp_path, "prefill_fwd_bwd")
    assert {r["impl"]: r["status"] for r in prefill} == {"ours": "ok", "eager": "ok"}
    ours = next(r for r in prefill if r["impl"] == "ours")
    assert float(ours["err"]) <= float(ours["err_bound"]) and ours["config"].startswith("fwd ")
    flops = measure.attention_flops(1, 2, 24, 24, 32, True, "fwd_bwd")
    assert math.isclose(float(ours["tflops"]), measure.tflops(flops, 2.0))
    assert math.isclose(float(ours["frac_ceiling"]), float(ours["tflops"]) / 800.0)
    for key in ("gpu", "torch", "triton", "cudnn", "date", "commit", "dtype", "peak_mem_mib"):
        assert key in ours
    assert ours["gpu"] == GPU and ours["commit"] == "c0ffee" and ours["dtype"] == "fp16"

    decode = _rows(tmp_path, "decode")
    steps = {(r["impl"], int(r["page_size"])): r for r in decode if r["metric"] == "step"}
    assert set(steps) == {("ours", 0), ("ours_paged", 16), ("ours_paged", 64), ("ours_paged", 256), ("sdpa", 0),
                          ("eager_slice", 0), ("eager_cat", 0)}
    assert all(r["status"] == "ok" for r in steps.values())
    assert all(float(r["err"]) <= float(r["err_bound"]) for r in steps.values() if r["impl"].startswith("ours"))
    kv_bytes = measure.decode_kv_bytes(2 * 48, 1, 32, torch.float16)
    ours = steps[("ours", 0)]
    copies = int(ours["rotated_copies"])  # 2 * L2 (8192 B here) / 12 KiB of K+V -> 2 copies in one graph
    assert copies == 2 and ours["timing"] == "graph"  # small cache: graph replay is the headline time
    assert math.isclose(float(ours["graph_ms"]), 1.0 / copies)
    assert math.isclose(float(ours["gbps"]), measure.gbps(kv_bytes, 1.0 / copies))
    assert math.isclose(float(ours["gbps_eager"]), measure.gbps(kv_bytes, 2.0))
    hosts = [r for r in decode if r["metric"] == "host_overhead"]
    assert len(hosts) == len(steps) and all(float(r["host_us"]) == 20.0 for r in hosts)

    chunked = {(r["impl"], int(r["page_size"])): r for r in _rows(tmp_path, "chunked")}
    assert set(chunked) == {("ours_prefill", 0), ("ours_kvcache", 0), ("ours_kvcache_paged", 64),
                            ("ours_kvcache_paged", 256)}
    assert all(r["status"] == "ok" and float(r["err"]) <= float(r["err_bound"]) for r in chunked.values())
    assert float(chunked[("ours_kvcache", 0)]["ratio_vs_prefill"]) == 1.0  # same fake time, same FLOPs
    assert chunked[("ours_kvcache_paged", 64)]["config"].startswith("append + prefill fwd ")

    with open(tmp_path / "results" / SLUG / "bench_ceilings.csv", newline="") as f:
        (ceiling,) = list(csv.DictReader(f))
    assert float(ceiling["bandwidth_gbps"]) == 4400.0 and ceiling["gpu"] == GPU


SPLITS_SHAPE = DecodeShape(1, 200, 2, 1, 32, "splits")  # 7 key blocks of 32 under the interpreter


@pytest.mark.skipif(torch.cuda.is_available(), reason="runs the runner on CPU tensors under the interpreter; on a GPU "
                    "the suite itself (python -m benchmarks --suite decode_splits) is the check")
def test_decode_splits_rows_and_resume(tmp_path):
    """decode_splits: a checked row per num_splits (0: the heuristic) with the splits it launched, SDPA's row,
    and a later run measures only the (num_splits, shape) rows that are missing."""
    shapes = {"decode_splits": [SPLITS_SHAPE]}
    summary, _ = _run(tmp_path, ["decode_splits"], shapes)
    assert summary["decode_splits"] == {"rows": len(grids.SPLIT_VALUES) + 2, "shapes_done_before": 0,
                                        "shapes_left": 0}
    rows = _rows(tmp_path, "decode_splits")
    assert all(r["status"] == "ok" and r["metric"] == "step" and r["grid"] == "splits" for r in rows)
    ours = {int(r["num_splits"]): r for r in rows if r["impl"] == "ours"}
    assert sorted(ours) == [0, *grids.SPLIT_VALUES]
    (sdpa,) = [r for r in rows if r["impl"] == "sdpa"]
    assert sdpa["num_splits"] == "" and sdpa["splits_used"] == ""
    kv_bytes = measure.decode_kv_bytes(200, 1, 32, torch.float16)
    used = {ns: int(r["splits_used"]) for ns, r in ours.items()}
    for ns, r in ours.items():
        assert float(r["err"]) <= float(r["err_bound"]), ns
        assert r["config"].endswith(f"/splits{used[ns]}"), (ns, r["config"])
        assert r["timing"] == "graph" and math.isclose(float(r["gbps"]), measure.gbps(kv_bytes, 1.0))
    assert ours[0]["label"].endswith("(heuristic)") and ours[8]["label"].endswith("num_splits=8")
    blocks = -(-SPLITS_SHAPE.cache_len // int(re.search(r"BN(\d+)/", ours[1]["config"]).group(1)))
    explicit = [used[ns] for ns in grids.SPLIT_VALUES]
    assert explicit[0] == 1 and explicit == sorted(explicit) and explicit[-1] == blocks == 7
    assert all(u <= ns for ns, u in zip(grids.SPLIT_VALUES, explicit)) and 1 <= used[0] <= blocks

    summary, _ = _run(tmp_path, ["decode_splits"], shapes)
    assert summary["decode_splits"] == {"rows": 0, "shapes_done_before": 1, "shapes_left": 0}
    path = tmp_path / "results" / SLUG / "bench_decode_splits.csv"
    with open(path, "w", newline="") as f:  # one num_splits' row lost: only it is measured again
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(r for r in rows if not (r["impl"] == "ours" and r["num_splits"] == "8"))
    timer = FakeTimer()
    summary, _ = _run(tmp_path, ["decode_splits"], shapes, timer=timer)
    assert summary["decode_splits"]["rows"] == 1 and len(timer.timed) == 1
    again = _rows(tmp_path, "decode_splits")
    assert len(again) == len(rows) and (again[-1]["num_splits"], again[-1]["splits_used"]) == ("8", str(used[8]))


# --------------------------------------------------------------------------------------------
# Headline table and plots from synthetic CSVs
# --------------------------------------------------------------------------------------------
def _synthetic_results(root, suites=("prefill_fwd", "decode", "decode_splits", "chunked")):
    """Rows shaped like a GPU run's, written with results.write_csv into root/<slug>/bench_<suite>.csv."""
    common = dict(gpu="NVIDIA H200", commit="abc1234", status="ok", quick=False, dtype="bf16", head_dim=128,
                  nheads=32, grid="issue", torch="2.11.0", triton="3.6.0", date="2026-12-01T00:00:00+00:00")
    prefill = []
    for seqlen in (1024, 4096):
        for hk in (32, 8):
            shape = dict(common, batch=16384 // seqlen, seqlen=seqlen, nheads_k=hk, causal=True)
            for impl, tf in (("ours", 400.0), ("sdpa_cudnn", 500.0), ("sdpa_flash", 300.0)):
                prefill.append(dict(shape, impl=impl, label=grids.LABELS[impl], tflops=tf * seqlen / 1024,
                                    ceiling_tflops=800.0, peak_mem_mib=10.0))
            prefill.append(dict(shape, impl="flex", label="flex", status="error", note="boom"))
    # a quick row and an older full row of the same key: the latest full row wins
    prefill.insert(0, dict(prefill[0], quick=True, tflops=1.0))
    prefill.insert(0, dict(prefill[1], tflops=2.0))
    if "prefill_fwd" in suites:
        results.write_csv(prefill, "bench_prefill_fwd", results_dir=root)

    decode = []
    for batch in (1, 8):
        for n in (1024, 4096):
            shape = dict(common, batch=batch, cache_len=n, nheads_k=8, metric="step", bandwidth_gbps=4400.0)
            for impl, page, gb in (("ours", 0, 4000.0), ("ours_paged", 16, 3600.0), ("sdpa", 0, 4200.0),
                                   ("eager_slice", 0, 1000.0)):
                decode.append(dict(shape, impl=impl, page_size=page, label=impl, gbps=gb, time_ms=0.01 * n / 1024,
                                   peak_mem_mib=1.0))
    decode.append(dict(decode[0], metric="host_overhead", host_us=25.0, gbps=""))
    if "decode" in suites:
        results.write_csv(decode, "bench_decode", results_dir=root)

    splits = []
    for n, heuristic in ((4096, 4), (16384, 16)):  # GB/s = 100 x splits launched + cache_len / 1024
        shape = dict(common, grid="splits", batch=1, cache_len=n, nheads_k=8, metric="step", bandwidth_gbps=4400.0)
        for ns in (0, *SPLITS):
            used = heuristic if ns == 0 else ns
            splits.append(dict(shape, impl="ours", page_size=0, num_splits=ns, splits_used=used, label="ours",
                               gbps=100.0 * used + n / 1024))
        splits.append(dict(shape, impl="sdpa", page_size=0, label=grids.LABELS["sdpa"], gbps=500.0))
    splits.insert(0, dict(splits[1], gbps=1.0))  # an older row of the same key: the latest wins
    if "decode_splits" in suites:
        results.write_csv(splits, "bench_decode_splits", results_dir=root)

    chunked = []
    for n in (0, 4096):
        shape = dict(common, batch=1, cache_len=n, chunk=512, nheads_k=8, causal=True)
        chunked += [dict(shape, impl="ours_prefill", page_size=0, label="prefill", tflops=500.0),
                    dict(shape, impl="ours_kvcache", page_size=0, label="kvcache", tflops=400.0),
                    dict(shape, impl="ours_kvcache_paged", page_size=64, label="paged", tflops=450.0)]
    if "chunked" in suites:
        results.write_csv(chunked, "bench_chunked", results_dir=root)


SPLITS = (1, 2, 4, 8, 16)  # num_splits of the synthetic decode_splits rows


def test_headline_ratios(tmp_path):
    """Ours / best peer per shape (errors ignored, latest full row per key), paged / dense, kvcache / prefill."""
    _synthetic_results(tmp_path)
    table = report.headline_table(tmp_path, "NVIDIA H200", log=lambda m: None)
    prefill = table[table["suite"] == "prefill_fwd"]
    assert len(prefill) == 4
    assert set(prefill["versus"]) == {"SDPA cuDNN"} and all(abs(prefill["ratio"] - 0.8) < 1e-12)
    decode = table[table["suite"] == "decode"]
    vs_peer = decode[decode["ours"] == "Triton (ours)"]
    assert len(vs_peer) == 4 and all(abs(vs_peer["ratio"] - 4000 / 4200) < 1e-12) and set(vs_peer["versus"]) == {"sdpa"}
    paged = decode[decode["ours"] == "ours_paged"]
    assert len(paged) == 4 and all(abs(paged["ratio"] - 0.9) < 1e-12)
    chunked = table[table["suite"] == "chunked"].set_index("ours")["ratio"]
    assert all(abs(chunked["kvcache"] - 0.8) < 1e-12) and all(abs(chunked["paged"] - 0.9) < 1e-12)
    assert table["ratio"].map(math.isfinite).all()
    assert set(table["suite"]) == {"prefill_fwd", "decode", "chunked"}  # decode_splits sweeps ours: no ratio

    text = report.headline_markdown(table)
    assert "| B=16 S=1024 MHA D=128 causal | Triton (ours) | 400 | SDPA cuDNN | 500 | 0.80 |" in text
    assert text.count("**decode**") == 1

    df = report.load_suite("prefill_fwd", tmp_path, "NVIDIA H200", log=lambda m: None)
    first = df[(df["impl"] == "ours") & (df["seqlen"] == 1024) & (df["nheads_k"] == 32)]
    assert list(first["tflops"]) == [400.0]
    fractions = report.roofline_table(df, "prefill_fwd")
    assert abs(fractions.loc[("NVIDIA H200", "bf16", "B=16 S=1024 MHA D=128 causal"), "Triton (ours)"] - 0.5) < 1e-12
    memory = report.memory_table(df, "prefill_fwd")
    assert (memory.to_numpy() == 10.0).all()


def test_prefill_ranges():
    """The README's prefill table: per seqlen, ours' TFLOP/s and ours / peer as min-max over heads and masks."""
    import pandas as pd

    rows = []
    for hk, causal, ours, cudnn in ((32, False, 400.0, 500.0), (8, False, 450.0, 500.0), (32, True, 300.0, 500.0),
                                    (8, True, 350.0, 350.0)):
        shape = dict(gpu="G", dtype="bf16", batch=4, seqlen=4096, nheads=32, nheads_k=hk, head_dim=128,
                     causal=causal, quick=False, grid="issue", status="ok")
        rows += [dict(shape, impl="ours", tflops=ours), dict(shape, impl="sdpa_cudnn", tflops=cudnn)]
    rows.append(dict(rows[0], grid="seed", batch=2, tflops=1.0))  # another grid: not in the ranges
    table = report.prefill_ranges(pd.DataFrame(rows), "prefill_fwd", peers=("sdpa_cudnn", "flex"))
    row = table.loc[("G", "bf16", 128, 4096)]
    assert row["ours TFLOP/s"] == "300-450" and row["ours / SDPA cuDNN"] == "0.60-1.00"
    assert "ours / FlexAttention (compiled)" not in table.columns  # a peer without rows gets no column


def test_plots_from_synthetic_csvs(tmp_path):
    """plot_all draws every suite's figure and the roofline from CSVs into the given folder only."""
    _synthetic_results(tmp_path / "res")
    messages = []
    saved = report.plot_all(tmp_path / "res", tmp_path / "fig", log=messages.append)
    names = sorted(p.name for p in saved)
    assert names == ["bench_chunked_bf16.png", "bench_decode_bf16_d128.png", "bench_decode_splits_bf16.png",
                     "bench_prefill_fwd_bf16_d128.png", "bench_roofline.png"]
    assert all(p.parent == tmp_path / "fig" / "nvidia-h200" and p.stat().st_size > 10_000 for p in saved)
    _synthetic_results(tmp_path / "res2", suites=("chunked",))
    assert main(["--plot-only", "--out", str(tmp_path / "res2"), "--figures", str(tmp_path / "f2")]) == 0
    assert [p.name for p in (tmp_path / "f2" / "nvidia-h200").glob("*.png")] == ["bench_chunked_bf16.png"]


def test_decode_splits_table_and_plot(tmp_path):
    """decode_splits_table: GB/s per cache length and num_splits (latest row per key), the heuristic labelled with the
    splits it launched, SDPA's alongside; plot_decode_splits draws one figure per GPU and dtype."""
    _synthetic_results(tmp_path / "res", suites=("decode_splits",))
    df = report.load_suite("decode_splits", tmp_path / "res", "NVIDIA H200", log=lambda m: None)
    assert len(df) == 2 * (len(SPLITS) + 2)
    table = report.decode_splits_table(df)
    assert list(table.index) == [("NVIDIA H200", "bf16", 4096), ("NVIDIA H200", "bf16", 16384)]
    assert set(table.columns) == ({f"splits={ns}" for ns in SPLITS} | {"heuristic (4)", "heuristic (16)"}
                                  | {grids.LABELS["sdpa"]})
    for n in (4096, 16384):
        row = table.loc[("NVIDIA H200", "bf16", n)]
        assert all(row[f"splits={ns}"] == 100.0 * ns + n / 1024 for ns in SPLITS)
        assert row[grids.LABELS["sdpa"]] == 500.0
    assert table.loc[("NVIDIA H200", "bf16", 4096), "heuristic (4)"] == 404.0
    assert table.loc[("NVIDIA H200", "bf16", 16384), "heuristic (16)"] == 1616.0
    assert math.isnan(table.loc[("NVIDIA H200", "bf16", 4096), "heuristic (16)"])
    saved = report.plot_decode_splits(df, tmp_path / "fig", log=lambda m: None)
    assert [p.name for p in saved] == ["bench_decode_splits_bf16.png"]
    assert saved[0].parent == tmp_path / "fig" / "nvidia-h200" and saved[0].stat().st_size > 10_000
