"""CPU tests of benchmarks/results.py (result rows stamped with their environment, and their CSVs) and of how
benchmarks.ab finds a tree's library."""

from pathlib import Path

import pytest
import torch

from benchmarks import results


def test_gpu_slug():
    """GPU names become lowercase folder names with '-' for runs of other characters."""
    assert results.gpu_slug("NVIDIA H200") == "nvidia-h200"
    assert results.gpu_slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert results.gpu_slug("cpu-interpreter") == "cpu-interpreter"


def test_csv_round_trip(tmp_path):
    """Rows written to results/<gpu-slug>/<name>.csv read back; appends keep rows, new columns widen the header."""
    rows = [results.make_row(gpu="NVIDIA H200", kernel="fa2", seqlen=n, median_ms=0.5 * n) for n in (128, 256)]
    for key in ("torch", "triton", "cudnn", "date", "commit"):
        assert key in rows[0]
    path = results.write_csv(rows, "prefill", results_dir=tmp_path)
    assert path == tmp_path / "nvidia-h200" / "prefill.csv"

    df = results.read_csv("prefill", gpu="NVIDIA H200", results_dir=tmp_path)
    assert list(df["seqlen"]) == [128, 256]
    assert list(df["median_ms"]) == [64.0, 128.0]
    assert set(df["gpu"]) == {"NVIDIA H200"}

    results.write_csv(
        [results.make_row(gpu="NVIDIA H200", kernel="sdpa", seqlen=512, median_ms=9.0, tflops=1.5)],
        "prefill",
        results_dir=tmp_path,
    )
    df = results.read_csv("prefill", gpu="nvidia-h200", results_dir=tmp_path)
    assert list(df["kernel"]) == ["fa2", "fa2", "sdpa"]
    assert df["tflops"].isna().sum() == 2 and df["tflops"].iloc[2] == 1.5

    results.write_csv(
        [results.make_row(gpu="NVIDIA L4", kernel="fa2", seqlen=128, median_ms=2.0)], "prefill", results_dir=tmp_path
    )
    assert len(results.read_csv("prefill", results_dir=tmp_path)) == 4
    with pytest.raises(FileNotFoundError):
        results.read_csv("missing", results_dir=tmp_path)


def test_make_row_stamps_environment():
    """make_row adds gpu, versions, a UTC ISO date and a git commit (or 'unknown') to the given fields."""
    row = results.make_row(kernel="fa2", seqlen=1)
    assert row["kernel"] == "fa2" and row["torch"] == torch.__version__
    assert row["date"].endswith("+00:00")
    assert isinstance(row["commit"], str) and row["commit"]


def test_results_root_is_taken_from_the_repo_root(tmp_path):
    """A relative results folder is taken from the repo root, whatever the working directory; an absolute one as is."""
    assert results.results_root("results") == results.REPO_ROOT / "results"
    assert results.results_root(tmp_path) == tmp_path
    assert (results.REPO_ROOT / "benchmarks" / "results.py").is_file()


def test_ab_finds_the_package_in_either_layout(tmp_path):
    """benchmarks.ab imports a tree's library from kernels/tritonattn/ or, in trees older than the source-root
    layout, from kernels/ itself, so an A/B can span the move."""
    from benchmarks.ab import import_tree, package_dir

    root = Path(__file__).resolve().parents[1]
    assert package_dir(str(root)) == root / "kernels" / "tritonattn"
    old = tmp_path / "old"
    (old / "kernels").mkdir(parents=True)
    (old / "kernels" / "__init__.py").write_text("WHICH = 'flat'\n")
    assert package_dir(str(old)) == old / "kernels"
    assert import_tree(str(old), "tritonattn_ab_test_old").WHICH == "flat"
