"""Views of the prefill suites' rows for the notebooks: load and select them, tabulate ours against the
peers, plot latency, memory and speed ratios. Needs no GPU (kv_bytes_table measures on one when given it).

    bench_results(*suites, where=...)      the suites' ok rows (committed or measured now), one DataFrame
    select(df, where), gpu_label(df)       rows matching column values; the GPUs the rows came from
    ratio_table(df, x=, baselines=)        ours' speed relative to each baseline: baseline time / our time
    summary_table(df, x=, baselines=)      TFLOP/s per implementation, plus ours / each baseline
    kv_bytes_table(...)                    K+V bytes held by GQA against K/V expanded per query head
    plot_lines(df, x=, y=)                 one line per implementation, panels by mode and causal
    plot_speedup(df, x=, baselines=)       ours / each baseline, with the 1.0 line (above it: ours faster)

Implementation colours come from benchmarks.grids.COLORS and labels from benchmarks.grids.LABELS; every
figure is titled with the GPU, torch and triton versions and dates of its rows, and saved as
<figures_dir>/<gpu-slug>/<name>.png (default `figures_root()`).
"""

from __future__ import annotations

import math
import tempfile
from pathlib import Path
from typing import Any, Callable, List, Mapping, Optional, Sequence

import torch

from . import measure, report, results
from .grids import COLORS, LABELS, PathLike

Y_LABELS = {"median_ms": "median latency (ms)", "peak_mem_mib": "peak memory beyond inputs (MiB)",
            "tflops": "TFLOP/s"}
FACET_TEXT = {("mode", "fwd"): "forward", ("mode", "fwd_bwd"): "forward + backward",
              ("causal", True): "causal", ("causal", False): "non-causal"}
NEUTRAL = "0.5"  # an implementation missing from the palette is drawn grey


def figures_root() -> Path:
    """Where notebook figures go: the committed figures/ on a GPU (the run that measured them), a temporary
    folder on a CPU, which redraws committed results and must leave the checkout untouched."""
    if torch.cuda.is_available():
        return results.REPO_ROOT / "figures"
    return Path(tempfile.gettempdir()) / "tritonattn-figures"


def select(df, where: Optional[Mapping[str, Any]] = None):
    """Rows of df whose column equals each value of `where` (compared as text; booleans as booleans)."""
    for col, value in (where or {}).items():
        if col not in df.columns:
            raise KeyError(f"Expected a column {col!r} to select on; the rows have {sorted(df.columns)}.")
        df = df[df[col].astype(bool) == value] if isinstance(value, bool) else df[df[col].astype(str) == str(value)]
    return df


def gpu_label(df) -> str:
    """The GPU names of the rows, joined ('NVIDIA H200')."""
    return ", ".join(sorted(map(str, df["gpu"].unique())))


def bench_results(*suites: str, where: Optional[Mapping[str, Any]] = None, results_dir: PathLike = "results",
                  gpu: Optional[str] = None, log: Callable[[str], None] = print):
    """The status-ok rows of the given suites (results_dir/<gpu>/bench_<suite>.csv of every GPU, or `gpu`'s),
    normalized and selected by `where`, as one DataFrame with a `suite` column; None when there is none.
    Logs one line per suite: how many rows, from which GPU and commit."""
    import pandas as pd

    frames = []
    for name in suites:
        df = report.load_suite(name, results_dir, gpu, log=log)
        if df is None:
            continue
        df = select(df[df["status"] == "ok"], where).assign(suite=name)
        if df.empty:
            log(f"bench_{name}.csv has no ok rows matching {dict(where or {})}")
            continue
        commits = ", ".join(sorted(map(str, df["commit"].unique()))) if "commit" in df else "-"
        log(f"{len(df)} rows of bench_{name}.csv, measured on {gpu_label(df)} (commit {commits})")
        frames.append(df)
    return pd.concat(frames, ignore_index=True) if frames else None


def _by_x(df, x: str, value: str, index: Sequence[str]):
    return df.pivot_table(index=[*index, x], columns="impl", values=value)


def ratio_table(df, *, x: str, baselines: Sequence[str], index: Sequence[str] = ("mode", "causal"),
                where: Optional[Mapping[str, Any]] = None):
    """ours' speed relative to each baseline, baseline median time / ours (above 1: ours is faster), one row
    per (index..., vs) and one column per value of x; baselines absent from the rows are left out."""
    import pandas as pd

    times = _by_x(select(df, where), x, "median_ms", index)
    parts = {b: (times[b] / times["ours"]).unstack(x) for b in baselines if b in times and "ours" in times}
    if not parts:
        raise ValueError(f"Expected rows of 'ours' and of some of {list(baselines)}, got {sorted(times.columns)}.")
    table = pd.concat(parts, names=["vs"])
    return table.reorder_levels([*range(1, len(index) + 1), 0]).sort_index()


def summary_table(df, *, x: str, baselines: Sequence[str], where: Optional[Mapping[str, Any]] = None,
                  value: str = "tflops"):
    """`value` (TFLOP/s) per implementation (columns) by gpu, mode, causal and x, plus ours / each baseline."""
    table = _by_x(select(df, where), x, value, ("gpu", "mode", "causal"))
    for baseline in baselines:
        if "ours" in table.columns and baseline in table.columns:
            table[f"ours/{baseline}"] = table["ours"] / table[baseline]
    return table


def kv_bytes_table(batch: int, seqlen: int, nheads: int, nheads_k: Sequence[int], head_dim: int,
                   dtype: torch.dtype, device=None):
    """K+V MiB held with nheads_k KV heads (GQA) and with K/V expanded to nheads heads, per nheads_k. With a
    CUDA `device`, `measured_mib` is the allocator's peak while repeat_interleave makes the expanded copies
    of K and V from random ones of the GQA shape (NaN otherwise)."""
    import pandas as pd

    itemsize = torch.empty((), dtype=dtype).element_size()
    cuda = device is not None and torch.device(device).type == "cuda"
    rows = []
    for hk in nheads_k:
        group = nheads // hk
        native, expanded = (2 * batch * seqlen * h * head_dim * itemsize / 2**20 for h in (hk, nheads))
        measured = math.nan
        if cuda:
            k, v = (torch.randn(batch, seqlen, hk, head_dim, device=device).to(dtype) for _ in range(2))
            copies = measure.peak_memory_delta(lambda: (k.repeat_interleave(group, 2), v.repeat_interleave(group, 2)))
            measured = copies / 2**20
            del k, v
        rows.append({"nheads": nheads, "nheads_k": hk, "group": group, "kv_mib_gqa": native,
                     "kv_mib_expanded": expanded, "measured_mib": measured})
    return pd.DataFrame(rows)


def _facets(df, rows: Optional[str], cols: Optional[str]):
    row_values = sorted(df[rows].unique()) if rows else [None]
    col_values = sorted(df[cols].unique()) if cols else [None]
    if len(row_values) > 2 or len(col_values) > 2:
        raise ValueError(f"Expected at most 2x2 panels, got {len(row_values)}x{len(col_values)}: select rows first.")
    return row_values, col_values


def _panel(df, rows, r, cols, c):
    part = df if rows is None else df[df[rows] == r]
    return part if cols is None else part[part[cols] == c]


def _panel_title(rows, r, cols, c) -> str:
    return ", ".join(FACET_TEXT.get((k, v), f"{k} {v}") for k, v in ((rows, r), (cols, c)) if k is not None)


def _figure(df, rows, cols, draw, *, x, x_label, y_label, title, name, logx, figures_dir, log) -> List[Path]:
    """One figure per GPU: panels rows x cols, each drawn by draw(ax, part); saved under figures_dir."""
    import matplotlib.pyplot as plt

    saved = []
    for gpu, sub in df.groupby("gpu", sort=True):
        row_values, col_values = _facets(sub, rows, cols)
        fig, axes = plt.subplots(len(row_values), len(col_values), squeeze=False,
                                 figsize=(5.2 * len(col_values), 3.4 * len(row_values) + 0.8))
        for i, r in enumerate(row_values):
            for j, c in enumerate(col_values):
                ax, part = axes[i, j], _panel(sub, rows, r, cols, c)
                draw(ax, part)
                if logx:
                    report.log2_axis(ax, sub[x])
                ax.grid(True, alpha=0.3)
                ax.set_title(_panel_title(rows, r, cols, c), fontsize=10)
                ax.set_xlabel(x_label or x)
                ax.set_ylabel(y_label)
        axes[0, 0].legend(fontsize=7)
        fig.suptitle(f"{title} on {gpu}\n({report.versions_text(sub)})", fontsize=10)
        fig.tight_layout()
        path = Path(figures_dir or figures_root()) / results.gpu_slug(str(gpu)) / f"{name}.png"
        report.write_figure(fig, path, log=lambda _: None)
        inside = path.resolve().is_relative_to(results.REPO_ROOT)
        log(f"saved {path.resolve().relative_to(results.REPO_ROOT)}" if inside else f"drew {name}.png ({gpu} rows)")
        saved.append(path)
    return saved


def plot_lines(df, *, x: str, y: str = "median_ms", name: str, title: str, rows: Optional[str] = "mode",
               cols: Optional[str] = "causal", where: Optional[Mapping[str, Any]] = None,
               x_label: Optional[str] = None, logx: bool = True, figures_dir: Optional[PathLike] = None,
               log: Callable[[str], None] = print) -> List[Path]:
    """`y` against `x`, one line per implementation (its palette colour and label; ours drawn thicker), one
    panel per value of `rows` x `cols` (at most 2x2), linear y axis from 0; returns the saved paths."""
    df = select(df, where)

    def draw(ax, part):
        for impl, line in part.groupby("impl", sort=False):
            line = line.sort_values(x)
            ours = impl == "ours"
            ax.plot(line[x], line[y], marker="o" if ours else "s", markersize=4, linewidth=2.4 if ours else 1.4,
                    color=COLORS.get(impl, NEUTRAL), label=LABELS.get(impl, impl))
        ax.set_ylim(bottom=0, top=1.1 * float(part[y].max()))

    return _figure(df, rows, cols, draw, x=x, x_label=x_label, y_label=Y_LABELS.get(y, y), title=title, name=name,
                   logx=logx, figures_dir=figures_dir, log=log)


def plot_speedup(df, *, x: str, baselines: Sequence[str], name: str, title: str, cols: Optional[str] = "mode",
                 where: Optional[Mapping[str, Any]] = None, x_label: Optional[str] = None, logx: bool = True,
                 figures_dir: Optional[PathLike] = None, log: Callable[[str], None] = print) -> List[Path]:
    """ratio_table's ours / baseline against `x`: one line per (baseline, causal) in the baseline's palette
    colour (causal dashed), one panel per value of `cols`, and the 1.0 line (above it: ours is faster)."""
    df = select(df, where)

    def draw(ax, part):
        table = ratio_table(part, x=x, baselines=baselines, index=("causal",))
        for (causal, vs), ratios in table.iterrows():
            ratios = ratios.dropna()
            ax.plot(ratios.index, ratios.values, marker="o", markersize=4, color=COLORS.get(vs, NEUTRAL),
                    linestyle="--" if causal else "-",
                    label=f"vs {LABELS.get(vs, vs)}, {'causal' if causal else 'non-causal'}")
        ax.axhline(1.0, color="black", linewidth=1, linestyle=":", label="1.0: as fast as the baseline")
        ax.set_ylim(bottom=0, top=max(1.2, 1.1 * float(table.max().max())))

    return _figure(df, None, cols, draw, x=x, x_label=x_label, y_label="ours / baseline (above 1: ours faster)",
                   title=title, name=name, logx=logx, figures_dir=figures_dir, log=log)
