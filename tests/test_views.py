"""benchmarks/views.py on a tiny synthetic set of prefill rows: loading, tables and plots. Needs no GPU."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from matplotlib.colors import to_rgba  # noqa: E402

from benchmarks import results, views  # noqa: E402
from benchmarks.grids import COLORS, LABELS  # noqa: E402

GPU = "Test GPU 9000"
# median ms per (impl, mode): ours 2 ms forward, 4 ms forward + backward; the baselines at fixed multiples
TIMES = {"ours": (2.0, 4.0), "sdpa_cudnn": (1.0, 2.0), "sdpa_expand_kv": (3.0, 8.0)}


def rows() -> pd.DataFrame:
    out = []
    for (impl, (fwd_ms, fwd_bwd_ms)), mode, causal, group in (
        (t, m, c, g) for t in TIMES.items() for m in ("fwd", "fwd_bwd") for c in (False, True) for g in (1, 4)
    ):
        ms = (fwd_ms if mode == "fwd" else fwd_bwd_ms) * (0.5 if causal else 1.0)
        out.append({
            "gpu": GPU, "commit": "abc1234", "suite": f"prefill_{mode}", "mode": mode, "grid": "gqa", "dtype": "bf16",
            "batch": 4, "seqlen": 64, "nheads": 4, "nheads_k": 4 // group, "group": group, "head_dim": 32,
            "causal": causal, "impl": impl, "status": "ok", "median_ms": ms, "tflops": 10.0 / ms,
            "peak_mem_mib": 100.0 * group if impl == "ours" else 300.0, "torch": "2.x", "triton": "3.x",
            "date": "2026-01-01T00:00:00+00:00",
        })
    return pd.DataFrame(out)


@pytest.fixture
def results_dir(tmp_path):
    df = rows()
    for mode in ("fwd", "fwd_bwd"):
        part = df[df["mode"] == mode]
        folder = tmp_path / results.gpu_slug(GPU)
        folder.mkdir(exist_ok=True)
        part.to_csv(folder / f"bench_prefill_{mode}.csv", index=False)
    return tmp_path


def test_bench_results_loads_selects_and_names_the_gpu(results_dir):
    lines = []
    df = views.bench_results("prefill_fwd", "prefill_fwd_bwd", where={"grid": "gqa", "causal": True},
                             results_dir=results_dir, log=lines.append)
    assert len(df) == 2 * 3 * 2 and set(df["suite"]) == {"prefill_fwd", "prefill_fwd_bwd"}
    assert df["causal"].all()
    assert lines == [f"6 rows of bench_{s}.csv, measured on {GPU} (commit abc1234)" for s in ("prefill_fwd",
                                                                                               "prefill_fwd_bwd")]
    assert views.gpu_label(df) == GPU
    assert views.bench_results("prefill_fwd", results_dir=results_dir / "nowhere", log=lines.append) is None


def test_select_rejects_an_unknown_column():
    with pytest.raises(KeyError, match="no_such"):
        views.select(rows(), {"no_such": 1})


def test_ratio_table_is_baseline_time_over_ours():
    table = views.ratio_table(rows(), x="group", baselines=("sdpa_cudnn", "sdpa_expand_kv", "flex"))
    assert list(table.columns) == [1, 4]
    assert table.index.names == ["mode", "causal", "vs"] and len(table) == 2 * 2 * 2  # flex absent: left out
    assert table.loc[("fwd", False, "sdpa_cudnn"), 1] == pytest.approx(0.5)
    assert table.loc[("fwd_bwd", True, "sdpa_expand_kv"), 4] == pytest.approx(2.0)
    with pytest.raises(ValueError, match="ours"):
        views.ratio_table(rows(), x="group", baselines=("flex",))


def test_summary_table_pivots_tflops_and_divides_by_each_baseline():
    table = views.summary_table(rows(), x="group", baselines=("sdpa_cudnn",), where={"mode": "fwd"})
    assert table.loc[(GPU, "fwd", False, 1), "ours"] == pytest.approx(5.0)
    assert table.loc[(GPU, "fwd", False, 1), "sdpa_cudnn"] == pytest.approx(10.0)
    assert table.loc[(GPU, "fwd", True, 4), "ours/sdpa_cudnn"] == pytest.approx(0.5)


def test_kv_bytes_table_from_shapes():
    table = views.kv_bytes_table(2, 1024, 8, (8, 2, 1), 64, torch.float16)
    expanded = 2 * 2 * 1024 * 8 * 64 * 2 / 2**20
    assert list(table["group"]) == [1, 4, 8]
    assert table["kv_mib_expanded"].tolist() == [expanded] * 3
    assert table["kv_mib_gqa"].tolist() == [expanded, expanded / 4, expanded / 8]
    assert table["measured_mib"].isna().all()  # no CUDA device given


@pytest.fixture
def kept_figures(monkeypatch):
    """plt.close made a no-op, so the test can inspect the figure a view drew and saved."""
    monkeypatch.setattr(plt, "close", lambda *args, **kwargs: None)
    plt.close("all")
    yield
    monkeypatch.undo()
    plt.close("all")


def lines_of(fig):
    return [line for ax in fig.axes for line in ax.get_lines()]


def test_plot_lines_saves_a_png_with_the_palette(tmp_path, kept_figures):
    lines = []
    (path,) = views.plot_lines(rows(), x="group", name="lat", title="t", figures_dir=tmp_path, log=lines.append)
    assert path == tmp_path / results.gpu_slug(GPU) / "lat.png" and path.stat().st_size > 0
    assert lines == ["drew lat.png (Test GPU 9000 rows)"]  # outside the repo: no machine path logged
    fig = plt.figure(plt.get_fignums()[-1])
    assert len(fig.axes) == 4  # 2 modes x 2 causal values
    ours = [line for line in lines_of(fig) if line.get_label() == LABELS["ours"]]
    assert len(ours) == 4 and all(to_rgba(line.get_color()) == to_rgba(COLORS["ours"]) for line in ours)
    assert all(ax.get_ylim()[0] == 0 for ax in fig.axes)


def test_plot_lines_refuses_more_than_two_by_two_panels(tmp_path):
    with pytest.raises(ValueError, match="2x2"):
        views.plot_lines(rows(), x="group", rows="impl", cols="causal", name="m", title="t", figures_dir=tmp_path,
                         log=lambda _: None)


def test_plot_speedup_draws_the_one_line_in_the_baselines_colours(tmp_path, kept_figures):
    (path,) = views.plot_speedup(rows(), x="group", baselines=("sdpa_cudnn", "sdpa_expand_kv"), name="speed",
                                 title="t", figures_dir=tmp_path, log=lambda _: None)
    assert path.exists()
    fig = plt.figure(plt.get_fignums()[-1])
    assert len(fig.axes) == 2  # one panel per mode
    for ax in fig.axes:
        assert any(list(line.get_ydata()) == [1.0, 1.0] for line in ax.get_lines())
    cudnn = [line for line in lines_of(fig) if line.get_label().startswith(f"vs {LABELS['sdpa_cudnn']}")]
    assert len(cudnn) == 4 and all(to_rgba(line.get_color()) == to_rgba(COLORS["sdpa_cudnn"]) for line in cudnn)
    fwd_cudnn = [line for line in cudnn if line.axes is fig.axes[0]]
    assert sorted(y for line in fwd_cudnn for y in line.get_ydata()) == pytest.approx([0.5] * 4)
