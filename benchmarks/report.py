"""Benchmark results: load the suite's CSVs, headline / memory / roofline tables, and the figures.
Needs no GPU: the notebooks plot committed results with it on a CPU.

    load_suite(suite, results_dir, gpu)   rows of results/<gpu>/bench_<suite>.csv, normalized (latest per key)
    headline_table(...), headline_markdown(table)   ours / best peer per shape, and its README rendering
    value_table(df, suite), memory_table(df, suite), roofline_table(df, suite, ceilings), load_ceilings(...)
    decode_splits_table(df), decode_grid(df, value)
    plot_prefill, plot_decode, plot_decode_splits, plot_chunked, plot_roofline, plot_all   -> figures/<gpu>/bench_*.png
    plot_ratios(frames, ...)   ours / each peer against length, prefill and decode, with the 1.0 line
    plot_seed_prefill(rows, title)   the seed's prefill table (benchmarks.seed_table) against seqlen

Implementation colours come from benchmarks.grids.COLORS only (an implementation missing there is grey).

Every figure is titled with the GPU the rows came from, its torch/triton versions and dates.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

from . import results
from .grids import COLORS, CSV_NAMES, KEY_COLUMNS, LABELS, MODES, PAGE_STYLES, SUITES, PathLike


# ============================================================================================
# Loading, tables
# ============================================================================================
def normalize(df, suite: str):
    """One convention for a suite's rows: status/grid/quick/page_size/metric filled, causal and quick boolean,
    group present; the latest row per key (a full-mode row wins over a quick one) kept."""
    df = df.copy()
    defaults = {"status": "ok", "grid": "issue", "quick": False}
    if suite in ("decode", "decode_splits", "chunked"):
        defaults["page_size"] = 0
    if suite in ("decode", "decode_splits"):
        defaults["metric"] = "step"
    for col, value in defaults.items():
        if col not in df.columns:
            df[col] = value
        else:
            df[col] = df[col].fillna(value)
    for col in ("causal", "quick"):
        if col in df.columns:
            df[col] = df[col].astype(str).str.lower().isin(["true", "1", "1.0"])
    if "page_size" in df.columns:
        df["page_size"] = df["page_size"].astype(int)
    if "group" not in df.columns and {"nheads", "nheads_k"} <= set(df.columns):
        df["group"] = df["nheads"] // df["nheads_k"]
    if "label" not in df.columns:
        df["label"] = [LABELS.get(i, i) for i in df["impl"]]
    keys = [c for c in KEY_COLUMNS[suite] if c in df.columns and c != "quick"] + (["gpu"] if "gpu" in df else [])
    df["_order"] = range(len(df))
    df = df.sort_values(["quick", "_order"], ascending=[False, True], kind="stable")
    df = df.drop_duplicates(subset=keys, keep="last").sort_values("_order").drop(columns="_order")
    return df.reset_index(drop=True)


def load_suite(suite: str, results_dir: PathLike = "results", gpu: Optional[str] = None, *,
               log: Callable[[str], None] = print):
    """A suite's rows from results_dir/<gpu-slug>/bench_<suite>.csv (every GPU when gpu is None), normalized;
    None, with a message, when there is nothing."""
    import pandas as pd

    root = results.results_root(results_dir)
    slugs = [results.gpu_slug(gpu)] if gpu else (sorted(p.name for p in root.iterdir() if p.is_dir())
                                               if root.is_dir() else [])
    frames = []
    for slug in slugs:
        path = root / slug / f"{CSV_NAMES[suite]}.csv"
        if path.exists():
            frames.append(pd.read_csv(path))
    if not frames:
        where = root / (results.gpu_slug(gpu) if gpu else "<gpu>") / f"{CSV_NAMES[suite]}.csv"
        log(f"no results for suite {suite!r} ({where} does not exist): run `python -m benchmarks --suite {suite}` "
            f"on a GPU to measure them")
        return None
    return normalize(pd.concat(frames, ignore_index=True), suite)


def _ok(df):
    return df[df["status"] == "ok"]


def _shape_text(suite: str, r: Mapping[str, Any]) -> str:
    if suite in MODES:
        heads = "MHA" if r["nheads"] == r["nheads_k"] else f"GQA {r['nheads']}:{r['nheads_k']}"
        return (f"B={r['batch']} S={r['seqlen']} {heads} D={r['head_dim']} "
                f"{'causal' if r['causal'] else 'non-causal'}")
    if suite == "decode":
        return f"B={r['batch']} L={r['cache_len']} {r['nheads']}:{r['nheads_k']} D={r['head_dim']}"
    if suite == "decode_splits":
        return (f"B={r['batch']} L={r['cache_len']} q={r['seqlen_q']} {r['nheads']}:{r['nheads_k']} "
                f"D={r['head_dim']}")
    return f"B={r['batch']} L={r['cache_len']} chunk={r['chunk']} {r['nheads']}:{r['nheads_k']} D={r['head_dim']}"


def headline_table(results_dir: PathLike = "results", gpu: Optional[str] = None, *,
                   frames: Optional[Mapping[str, Any]] = None, log: Callable[[str], None] = print):
    """Ours / best peer per shape, from the CSVs (or the given {suite: DataFrame}), as a DataFrame with
    suite, gpu, dtype, shape, ours, ours_value, versus, versus_value, ratio, unit.

    prefill_fwd / prefill_fwd_bwd: TFLOP/s of ours vs the fastest peer. decode: GB/s of ours (dense) vs the
    fastest peer, and each paged page size vs ours dense. chunked: TFLOP/s of flash_attn_with_kvcache (dense,
    paged) vs flash_attn_func on the same shape. Only rows with status ok count.
    """
    import pandas as pd

    out: List[Dict[str, Any]] = []
    for suite in SUITES:
        if suite == "decode_splits":  # a sweep of our own num_splits, not a comparison
            continue
        df = (frames or {}).get(suite) if frames is not None else load_suite(suite, results_dir, gpu, log=log)
        if df is None or len(df) == 0:
            continue
        df = _ok(normalize(df, suite))
        if suite in MODES:
            keys, value, unit = ["gpu", "dtype", "head_dim", "nheads", "nheads_k", "causal", "seqlen", "batch"], \
                "tflops", "TFLOP/s"
        elif suite == "decode":
            df = df[df["metric"] == "step"]
            keys, value, unit = ["gpu", "dtype", "head_dim", "nheads", "nheads_k", "batch", "cache_len"], "gbps", "GB/s"
        else:
            keys, value, unit = ["gpu", "dtype", "head_dim", "nheads", "nheads_k", "batch", "chunk", "cache_len"], \
                "tflops", "TFLOP/s"
        for key, grp in df.groupby(keys, sort=True):
            r = dict(zip(keys, key))
            common = dict(suite=suite, gpu=r["gpu"], dtype=r["dtype"], shape=_shape_text(suite, r), unit=unit)
            if suite == "chunked":
                base = grp[grp["impl"] == "ours_prefill"]
                if base.empty:
                    continue
                for _, row in grp[grp["impl"] != "ours_prefill"].iterrows():
                    out.append(dict(common, ours=row["label"], ours_value=row[value], versus=LABELS["ours_prefill"],
                                    versus_value=base[value].iloc[0], ratio=row[value] / base[value].iloc[0]))
                continue
            ours = grp[(grp["impl"] == "ours") & (grp.get("page_size", 0) == 0)]
            if ours.empty:
                continue
            ours_value = float(ours[value].iloc[0])
            peers = grp[~grp["impl"].astype(str).str.startswith("ours")]
            if len(peers):
                best = peers.loc[peers[value].idxmax()]
                out.append(dict(common, ours=LABELS["ours"], ours_value=ours_value, versus=best["label"],
                                versus_value=float(best[value]), ratio=ours_value / float(best[value])))
            if suite == "decode":
                for _, row in grp[grp["impl"] == "ours_paged"].sort_values("page_size").iterrows():
                    out.append(dict(common, ours=row["label"], ours_value=float(row[value]),
                                    versus=LABELS["ours"] + " dense", versus_value=ours_value,
                                    ratio=float(row[value]) / ours_value))
    columns = ["suite", "gpu", "dtype", "shape", "ours", "ours_value", "versus", "versus_value", "ratio", "unit"]
    return pd.DataFrame(out, columns=columns)


# README's decode table: (batch, cache length) at bf16, D = 128, 32 q / 8 KV heads.
README_DECODE_SHAPES = ((1, 1024), (1, 16384), (8, 4096), (32, 16384), (128, 65536))


def readme_markdown(results_dir: PathLike = "results", gpu: Optional[str] = None) -> str:
    """README's two tables, from the CSVs: prefill (bf16, D = 128; per seqlen the range over MHA / GQA and
    causal or not of ours' TFLOP/s and ours / each peer, forward then forward + backward) and decode (bf16,
    D = 128, 32:8 heads; ours and SDPA's K+V GB/s at README_DECODE_SHAPES). One block per GPU."""
    parts = []
    frames = {suite: load_suite(suite, results_dir, gpu, log=lambda _: None)
              for suite in ("prefill_fwd", "prefill_fwd_bwd")}
    blocks = {suite: prefill_ranges(df, suite) for suite, df in frames.items() if df is not None}
    blocks = {suite: t for suite, t in blocks.items() if t is not None}
    for name in sorted({g for t in blocks.values() for g in t.index.get_level_values("gpu")}):
        rows, header = [], None
        for suite, title in (("prefill_fwd", "forward"), ("prefill_fwd_bwd", "forward + backward")):
            if suite not in blocks or (name, "bf16", 128) not in blocks[suite].index.droplevel("seqlen"):
                continue
            table = blocks[suite].xs((name, "bf16", 128), level=("gpu", "dtype", "head_dim"))
            seqlens = list(table.index)
            header = header or ("| seqlen (batch) | " + " | ".join(f"{s} ({16384 // s})" for s in seqlens) + " |\n"
                                + "|---|" + "---:|" * len(seqlens))
            for column in table.columns:
                label = f"{title}, {column}" if column == "ours TFLOP/s" else column
                rows.append(f"| {label} | " + " | ".join(table[column]) + " |")
        if rows:
            parts.append(f"**Prefill**, {name}, bf16, D = 128\n\n{header}\n" + "\n".join(rows) + "\n")
    decode = headline_table(results_dir, gpu, log=lambda _: None)
    decode = decode[(decode["suite"] == "decode") & (decode["dtype"] == "bf16")
                    & decode["versus"].astype(str).str.startswith("SDPA")]
    for name, grp in decode.groupby("gpu"):
        by_shape = {r.shape: r for r in grp.itertuples()}
        cells = [by_shape.get(f"B={b} L={n} 32:8 D=128") for b, n in README_DECODE_SHAPES]
        if not any(cells):
            continue
        shown = [(shape, c) for shape, c in zip(README_DECODE_SHAPES, cells) if c is not None]
        head = "| D = 128, batch x cache length | " + " | ".join(f"{b} x {n}" for (b, n), _ in shown) + " |"
        parts.append(f"**Decode**, {name}, bf16, 32 q / 8 KV heads\n\n{head}\n|---|" + "---:|" * len(shown) + "\n"
                     + "| ours GB/s | " + " | ".join(_fmt(c.ours_value) for _, c in shown) + " |\n"
                     + "| SDPA GB/s | " + " | ".join(_fmt(c.versus_value) for _, c in shown) + " |\n"
                     + "| ours / SDPA | " + " | ".join(f"{c.ratio:.2f}" for _, c in shown) + " |\n")
    return "\n".join(parts)


def _fmt(value: float) -> str:
    return f"{value:.0f}" if abs(value) >= 10 else f"{value:.3g}"


def headline_markdown(table, *, digits: int = 2) -> str:
    """The headline table as Markdown for the README: one section per (suite, gpu, dtype)."""
    if table is None or len(table) == 0:
        return "_no benchmark results yet_\n"
    parts = []
    for (suite, gpu, dtype), grp in table.groupby(["suite", "gpu", "dtype"], sort=False):
        unit = grp["unit"].iloc[0]
        parts.append(f"**{suite}**, {dtype}, {gpu} ({unit}; ratio = ours / other)\n")
        parts.append(f"| shape | ours | {unit} | versus | {unit} | ratio |")
        parts.append("|---|---|---:|---|---:|---:|")
        for r in grp.itertuples():
            parts.append(f"| {r.shape} | {r.ours} | {_fmt(r.ours_value)} | {r.versus} | {_fmt(r.versus_value)} | "
                         f"{r.ratio:.{digits}f} |")
        parts.append("")
    return "\n".join(parts) + "\n"


def value_table(df, suite: str, value: Optional[str] = None, metric: str = "step"):
    """The suite's main number (TFLOP/s for prefill and chunked, K+V GB/s for decode, or `value`) per shape
    (rows) and implementation (columns); decode rows of `metric` ('step' or 'host_overhead', then host_us)."""
    df = _ok(normalize(df, suite))
    if suite == "decode":
        df = df[df["metric"] == metric]
        value = value or ("host_us" if metric == "host_overhead" else "gbps")
    value = value or "tflops"
    if value not in df.columns or len(df) == 0:
        return None
    df = df.assign(shape=[_shape_text(suite, r) for _, r in df.iterrows()])
    return df.pivot_table(index=["gpu", "dtype", "shape"], columns="label", values=value, sort=False)


def prefill_ranges(df, suite: str, peers: Sequence[str] = ("sdpa_cudnn", "sdpa_flash", "flex"), grid: str = "issue"):
    """The README's prefill table: per (gpu, dtype, head_dim, seqlen) of `grid`, the range over MHA / GQA and
    causal or not of ours' TFLOP/s and of ours / each peer (same run), as "lo-hi" text; None without rows."""
    import pandas as pd

    df = _ok(normalize(df, suite))
    df = df[df["grid"] == grid]
    keys = ["gpu", "dtype", "head_dim", "seqlen"]
    shape = keys + ["nheads_k", "causal"]
    ours = df[df["impl"] == "ours"].set_index(shape)["tflops"]
    if len(ours) == 0:
        return None
    columns = {"ours TFLOP/s": ours}
    for peer in peers:
        theirs = df[df["impl"] == peer].set_index(shape)["tflops"]
        if len(theirs):
            columns[f"ours / {LABELS.get(peer, peer)}"] = (ours / theirs).dropna()

    out = {}
    for name, values in columns.items():
        fmt = "{:.0f}" if name == "ours TFLOP/s" else "{:.2f}"
        out[name] = values.groupby(level=keys).agg(lambda v, f=fmt: f"{f.format(v.min())}-{f.format(v.max())}")
    return pd.DataFrame(out).sort_index().fillna("-")


def load_ceilings(results_dir: PathLike = "results", gpu: Optional[str] = None) -> Optional[Dict[str, float]]:
    """The latest ceilings row (matmul_tflops, copy_gbps, read_gbps, bandwidth_gbps) of results_dir/<gpu>/
    bench_ceilings.csv, or None when the file is missing."""
    import pandas as pd

    root = results.results_root(results_dir)
    paths = [root / results.gpu_slug(gpu) / "bench_ceilings.csv"] if gpu else sorted(root.glob("*/bench_ceilings.csv"))
    paths = [p for p in paths if p.exists()]
    if not paths:
        return None
    row = pd.read_csv(paths[-1]).iloc[-1]
    return {k: float(row[k]) for k in ("matmul_tflops", "copy_gbps", "read_gbps", "bandwidth_gbps") if k in row}


def memory_table(df, suite: str):
    """Peak memory beyond the inputs (MiB) per shape (rows) and implementation (columns)."""
    df = _ok(normalize(df, suite))
    if suite == "decode":
        df = df[df["metric"] == "step"]
    if "peak_mem_mib" not in df.columns or df["peak_mem_mib"].isna().all():
        return None
    df = df.assign(shape=[_shape_text(suite, r) for _, r in df.iterrows()], impl_label=df["label"])
    return df.pivot_table(index=["gpu", "dtype", "shape"], columns="impl_label", values="peak_mem_mib", sort=False)


def _with_fraction(df, suite: str, ceilings: Optional[Mapping[str, float]]):
    """(ok rows with a `fraction` column = value / ceiling, whether every ceiling was measured in its run),
    or (None, False). Rows without a measured ceiling take ceilings[...] when given, else are dropped."""
    import pandas as pd

    df = _ok(normalize(df, suite))
    if suite == "decode":
        df = df[df["metric"] == "step"]
        value, col, other = "gbps", "bandwidth_gbps", "copy_gbps"
    else:
        value, col, other = "tflops", "ceiling_tflops", "matmul_tflops"
    ceiling = df[col] if col in df.columns else pd.Series(math.nan, index=df.index)
    measured = bool(len(df)) and bool(ceiling.notna().all())
    fill = (ceilings or {}).get(col, (ceilings or {}).get(other))
    if fill is not None:
        ceiling = ceiling.fillna(fill)
    keep = ceiling.notna()
    if not keep.any():
        return None, False
    df = df[keep]
    return df.assign(fraction=df[value] / ceiling[keep], ceiling_used=ceiling[keep]), measured


def roofline_table(df, suite: str, ceilings: Optional[Mapping[str, float]] = None):
    """Fraction of the run's ceiling per shape and implementation: TFLOP/s / bf16 matmul TFLOP/s (prefill,
    chunked) or GB/s / max(copy, read) GB/s (decode). Rows without a measured ceiling use `ceilings`
    (e.g. bench.H200_MEASURED_CEILINGS) when given, else are dropped; None when no row is left."""
    df, _ = _with_fraction(df, suite, ceilings)
    if df is None:
        return None
    df = df.assign(shape=[_shape_text(suite, r) for _, r in df.iterrows()])
    return df.pivot_table(index=["gpu", "dtype", "shape"], columns="label", values="fraction", sort=False)


# ============================================================================================
# Plots
# ============================================================================================
def versions_text(sub) -> str:
    versions = ", ".join(f"{c} {sub[c].iloc[0]}" for c in ("torch", "triton") if c in sub.columns)
    dates = sorted({str(d)[:10] for d in sub["date"].dropna().unique()}) if "date" in sub.columns else []
    when = (f", {dates[0]}" + (f"..{dates[-1]}" if len(dates) > 1 else "")) if dates else ""
    return versions + when


def save_figure(fig, figures_dir: PathLike, gpu: str, name: str, log: Callable[[str], None] = print) -> Path:
    """Save `fig` as figures_dir/<gpu-slug>/<name>.png (a relative figures_dir is taken from the repo
    root), show it under an interactive backend, close it; returns the path. Used by the benchmark
    plots and the notebooks' plots alike."""
    path = results.results_root(figures_dir) / results.gpu_slug(str(gpu)) / f"{name}.png"
    write_figure(fig, path, log)
    return path


def write_figure(fig, path: Optional[PathLike], log: Callable[[str], None] = print) -> None:
    """Save `fig` to `path` when one is given (folders made, the path logged relative to the repo),
    show it under an interactive backend (a notebook), close it."""
    import matplotlib
    import matplotlib.pyplot as plt

    if path is not None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110, metadata={"Software": None})
        log(f"saved {path.relative_to(results.REPO_ROOT) if path.is_relative_to(results.REPO_ROOT) else path}")
    if "agg" not in matplotlib.get_backend().lower():
        plt.show()
    plt.close(fig)


def log2_axis(ax, values) -> None:
    """A base-2 log x axis ticked at exactly `values`, plain numbers, light grid."""
    import matplotlib

    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(set(values)))
    ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.get_xaxis().set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.grid(True, alpha=0.3)


def _log_y(ax) -> None:
    """Log y axis with plain numbers as tick labels (1, 2, 5 per decade)."""
    import matplotlib

    ax.set_yscale("log")
    ax.yaxis.set_major_locator(matplotlib.ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda value, _: f"{value:g}"))
    ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())


LENGTH_STYLES = ("-", "--", ":", "-.")  # lines of one implementation at several lengths (or batches)


def _line_style(impl: str, page_size: int = 0) -> Dict[str, Any]:
    ours = str(impl).startswith("ours")
    return {"color": COLORS.get(impl, "0.5"), "linestyle": PAGE_STYLES.get(int(page_size), "-"),
            "marker": "o" if ours else "s", "linewidth": 2.4 if ours else 1.4, "markersize": 4}


def plot_prefill(df, suite: str, figures_dir: PathLike = "figures", log: Callable[[str], None] = print) -> List[Path]:
    """TFLOP/s vs seqlen per implementation, one panel per (heads, causal), for each (GPU, dtype, head dim) of
    the issue grid (batch x seqlen = 16384); the run's bf16 matmul ceiling dotted."""
    import matplotlib.pyplot as plt

    df = _ok(normalize(df, suite))
    df = df[df["grid"] == "issue"]
    saved = []
    what = "forward" if suite == "prefill_fwd" else "forward + backward (3.5x forward FLOPs)"
    for (gpu, dtype, hdim), sub in df.groupby(["gpu", "dtype", "head_dim"], sort=True):
        panels = [(hk, c) for hk in sorted(sub["nheads_k"].unique(), reverse=True) for c in (False, True)
                  if len(sub[(sub["nheads_k"] == hk) & (sub["causal"] == c)])]
        fig, axes = plt.subplots(1, len(panels), figsize=(max(7.5, 4.6 * len(panels)), 4.2), sharey=True, squeeze=False)
        for ax, (hk, causal) in zip(axes[0], panels):
            part = sub[(sub["nheads_k"] == hk) & (sub["causal"] == causal)]
            for impl, line in part.groupby("impl", sort=False):
                line = line.sort_values("seqlen")
                ax.plot(line["seqlen"], line["tflops"], label=LABELS.get(impl, impl), **_line_style(impl))
            if "ceiling_tflops" in part and part["ceiling_tflops"].notna().any():
                ax.axhline(part["ceiling_tflops"].median(), color="black", linestyle=":", linewidth=1,
                           label=f"bf16 matmul {part['ceiling_tflops'].median():.0f} (same run)")
            nh = int(part["nheads"].iloc[0])
            ax.set_title(f"{'MHA' if hk == nh else 'GQA'} {nh}:{hk}, {'causal' if causal else 'non-causal'}")
            log2_axis(ax, part["seqlen"])
            ax.set_xlabel(f"seqlen (batch x seqlen = {int(part['batch'].iloc[0] * part['seqlen'].iloc[0])})")
            ax.set_ylim(bottom=0)
        axes[0, 0].set_ylabel("TFLOP/s")
        axes[0, 0].legend(fontsize=7)
        fig.suptitle(f"Prefill {what}, {dtype}, D={hdim} on {gpu}\n({versions_text(sub)})", fontsize=11)
        fig.tight_layout()
        saved.append(save_figure(fig, figures_dir, gpu, f"bench_{suite}_{dtype}_d{hdim}", log))
    return saved


def plot_decode(df, figures_dir: PathLike = "figures", log: Callable[[str], None] = print) -> List[Path]:
    """Per (GPU, dtype, head dim): step time (us) and K+V GB/s vs cache length, one column per batch, one line
    per implementation (paged page sizes dashed), the run's bandwidth ceiling dotted."""
    import matplotlib.pyplot as plt

    df = _ok(normalize(df, "decode"))
    df = df[(df["grid"] == "issue") & (df["metric"] == "step")]
    saved = []
    for (gpu, dtype, hdim), sub in df.groupby(["gpu", "dtype", "head_dim"], sort=True):
        batches = sorted(sub["batch"].unique())
        fig, axes = plt.subplots(2, len(batches), figsize=(max(7.5, 4.8 * len(batches)), 8), squeeze=False,
                                 sharex="col")
        for col, batch in enumerate(batches):
            part = sub[sub["batch"] == batch]
            for (impl, page), line in part.groupby(["impl", "page_size"], sort=False):
                line = line.sort_values("cache_len")
                style = _line_style(impl, page)
                label = line["label"].iloc[0]
                axes[0, col].plot(line["cache_len"], line["time_ms"] * 1e3, label=label, **style)
                axes[1, col].plot(line["cache_len"], line["gbps"], label=label, **style)
            if "bandwidth_gbps" in part and part["bandwidth_gbps"].notna().any():
                axes[1, col].axhline(part["bandwidth_gbps"].median(), color="black", linestyle=":", linewidth=1,
                                     label=f"max(copy, read) {part['bandwidth_gbps'].median():.0f} GB/s")
            axes[0, col].set_title(f"batch {batch}")
            _log_y(axes[0, col])
            axes[0, col].set_ylabel("us per step (graph replay < 0.5 GB, else eager)")
            axes[1, col].set_ylabel("K+V GB/s")
            axes[1, col].set_ylim(bottom=0)
            axes[1, col].set_xlabel("cache length (keys per request)")
            for row in range(2):
                log2_axis(axes[row, col], part["cache_len"])
        axes[0, 0].legend(fontsize=7)
        axes[1, 0].legend(fontsize=7)
        nh, nk = int(sub["nheads"].iloc[0]), int(sub["nheads_k"].iloc[0])
        fig.suptitle(f"Decode step (append + attend), {dtype}, {nh} q / {nk} KV heads, D={hdim} on {gpu}\n"
                     f"({versions_text(sub)})", fontsize=11)
        fig.tight_layout()
        saved.append(save_figure(fig, figures_dir, gpu, f"bench_decode_{dtype}_d{hdim}", log))
    return saved


def decode_splits_table(df):
    """K+V GB/s (graph replay) of ours per num_splits ('heuristic (n)' for num_splits=0, n the splits it
    launched) and SDPA's, by GPU, dtype and cache length."""
    import pandas as pd

    df = _ok(normalize(df, "decode_splits"))
    config = []
    missing = pd.Series(math.nan, index=df.index)
    for impl, ns, used in zip(df["impl"], df.get("num_splits", missing), df.get("splits_used", missing)):
        if impl != "ours":
            config.append(str(LABELS.get(impl, impl)))
        else:
            config.append(f"heuristic ({used:.0f})" if ns == 0 else f"splits={ns:.0f}")
    df = df.assign(config=config)
    return df.pivot_table(index=["gpu", "dtype", "cache_len"], columns="config", values="gbps", sort=False)


def plot_decode_splits(df, figures_dir: PathLike = "figures", log: Callable[[str], None] = print) -> List[Path]:
    """Per (GPU, dtype): K+V GB/s of one request's decode step against num_splits, one line per cache
    length, the heuristic's pick starred, SDPA at the same shape dashed, the run's bandwidth dotted."""
    import matplotlib.pyplot as plt

    df = _ok(normalize(df, "decode_splits"))
    saved = []
    for (gpu, dtype), sub in df.groupby(["gpu", "dtype"], sort=True):
        fig, ax = plt.subplots(figsize=(8, 5))
        ours = sub[(sub["impl"] == "ours") & (sub["num_splits"] > 0)]
        for i, (cache_len, line) in enumerate(ours.groupby("cache_len", sort=True)):
            style = LENGTH_STYLES[i % len(LENGTH_STYLES)]
            line = line.sort_values("num_splits")
            ax.plot(line["num_splits"], line["gbps"], marker="o", color=COLORS["ours"], linestyle=style,
                    label=f"ours, cache {cache_len}")
            heur = sub[(sub["impl"] == "ours") & (sub["num_splits"] == 0) & (sub["cache_len"] == cache_len)]
            if len(heur):
                used = heur["splits_used"].iloc[-1]
                ax.plot([used], [heur["gbps"].iloc[-1]], marker="*", markersize=16, color=COLORS["ours"],
                        linestyle="none", markeredgecolor="black",
                        label=f"heuristic ({used:.0f} splits), cache {cache_len}")
            sdpa = sub[(sub["impl"] == "sdpa") & (sub["cache_len"] == cache_len)]
            if len(sdpa):
                ax.axhline(sdpa["gbps"].iloc[-1], color=COLORS["sdpa"], linestyle=style, linewidth=1,
                           label=f"{LABELS['sdpa']}, cache {cache_len}")
        if "bandwidth_gbps" in sub and sub["bandwidth_gbps"].notna().any():
            ax.axhline(sub["bandwidth_gbps"].median(), color="black", linestyle=":", linewidth=1,
                       label=f"max(copy, read) {sub['bandwidth_gbps'].median():.0f} GB/s")
        if len(ours):
            log2_axis(ax, ours["num_splits"].unique())
        ax.set_xlabel("num_splits")
        ax.set_ylabel("K+V GB/s (CUDA-graph replay)")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=7, ncol=2)
        nh, nk, hdim = int(sub["nheads"].iloc[0]), int(sub["nheads_k"].iloc[0]), int(sub["head_dim"].iloc[0])
        fig.suptitle(f"Split-KV at batch 1, {dtype}, {nh} q / {nk} KV heads, D={hdim} on {gpu}\n({versions_text(sub)})",
                     fontsize=11)
        fig.tight_layout()
        saved.append(save_figure(fig, figures_dir, gpu, f"bench_decode_splits_{dtype}", log))
    return saved


def plot_chunked(df, figures_dir: PathLike = "figures", log: Callable[[str], None] = print) -> List[Path]:
    """Per (GPU, dtype): TFLOP/s vs tokens already cached, one panel per (batch, chunk), ours via the KV-cache
    path (dense, paged) against flash_attn_func on the same shape."""
    import matplotlib.pyplot as plt

    df = _ok(normalize(df, "chunked"))
    saved = []
    for (gpu, dtype), sub in df.groupby(["gpu", "dtype"], sort=True):
        panels = sorted({(int(b), int(c)) for b, c in zip(sub["batch"], sub["chunk"])})
        fig, axes = plt.subplots(1, len(panels), figsize=(max(7.5, 4.6 * len(panels)), 4.2), sharey=True, squeeze=False)
        for ax, (batch, chunk) in zip(axes[0], panels):
            part = sub[(sub["batch"] == batch) & (sub["chunk"] == chunk)]
            for (impl, page), line in part.groupby(["impl", "page_size"], sort=False):
                line = line.sort_values("cache_len")
                ax.plot(line["cache_len"], line["tflops"], label=line["label"].iloc[0], **_line_style(impl, page))
            ax.set_title(f"batch {batch}, chunk {chunk}")
            ax.set_xticks(sorted(part["cache_len"].unique()))
            ax.set_xlabel("tokens already in the cache (L)")
            ax.set_ylim(bottom=0)
            ax.grid(True, alpha=0.3)
        axes[0, 0].set_ylabel("TFLOP/s (exact bottom-right causal pairs)")
        axes[0, 0].legend(fontsize=7)
        fig.suptitle(f"Chunked prefill against a KV cache, {dtype}, 32 q / 8 KV heads, D=128 on {gpu}\n"
                     f"({versions_text(sub)})", fontsize=11)
        fig.tight_layout()
        saved.append(save_figure(fig, figures_dir, gpu, f"bench_chunked_{dtype}", log))
    return saved


def plot_roofline(frames: Mapping[str, Any], figures_dir: PathLike = "figures",
                  ceilings: Optional[Mapping[str, float]] = None, log: Callable[[str], None] = print) -> List[Path]:
    """Fractions of the ceilings, per GPU: prefill forward and forward+backward TFLOP/s over the bf16 matmul
    ceiling vs seqlen (GQA causal, D=128, first dtype), decode GB/s over max(copy, read) vs cache length
    (largest batch). Rows without measured ceilings use `ceilings` (labelled so) or are left out."""
    import matplotlib.pyplot as plt

    tables = {}
    for suite in ("prefill_fwd", "prefill_fwd_bwd", "decode"):
        if frames.get(suite) is not None and len(frames[suite]):
            df, measured = _with_fraction(frames[suite], suite, ceilings)
            if df is not None:
                tables[suite] = (df if "page_size" in df.columns else df.assign(page_size=0), measured)
    if not tables:
        log("note: no rows with a ceiling to plot fractions of")
        return []
    saved = []
    gpus = sorted({g for df, _ in tables.values() for g in df["gpu"].unique()})
    for gpu in gpus:
        fig, axes = plt.subplots(1, len(tables), figsize=(max(7.5, 5.4 * len(tables)), 4.2), squeeze=False)
        for ax, (suite, (df, measured)) in zip(axes[0], tables.items()):
            df = df[(df["gpu"] == gpu) & (df["grid"] == "issue")]
            if suite == "decode":
                df = df[(df["metric"] == "step") & (df["head_dim"] == 128)]
                if len(df):
                    df = df[df["batch"] == df["batch"].max()]
                x, title = "cache_len", f"decode, batch {int(df['batch'].max()) if len(df) else '-'}: GB/s / bandwidth"
            else:
                df = df[(df["head_dim"] == 128) & df["causal"] & (df["nheads_k"] < df["nheads"])]
                if len(df):
                    df = df[df["dtype"] == sorted(df["dtype"].unique())[0]]
                x, title = "seqlen", f"{suite} (GQA, causal): TFLOP/s / bf16 matmul"
            for (impl, page), line in df.groupby(["impl", "page_size"], sort=False):
                line = line.sort_values(x)
                ax.plot(line[x], line["fraction"], label=line["label"].iloc[0], **_line_style(impl, page))
            if len(df):
                log2_axis(ax, df[x])
            ax.axhline(1.0, color="black", linestyle="--", linewidth=1)
            ax.set_ylim(0, max(1.05, 1.05 * float(df["fraction"].max())) if len(df) else 1.05)
            ax.set_xlabel(x)
            if len(df):
                unit = "GB/s" if suite == "decode" else "TFLOP/s"
                title += f" ({df['ceiling_used'].median():.0f} {unit}" + (
                    ", same run)" if measured else ", not measured in that run: reference value)")
            ax.set_title(title, fontsize=9)
            if ax.get_lines():
                ax.legend(fontsize=7)
        fig.suptitle(f"Fractions of the ceilings on {gpu}", fontsize=11)
        fig.tight_layout()
        saved.append(save_figure(fig, figures_dir, gpu, "bench_roofline", log))
    return saved


def decode_grid(df, value: str = "ratio", head_dim: int = 128, versus: str = "sdpa"):
    """Decode steps of the issue grid at `head_dim` (dense cache, graph or eager timing as the suite chose):
    batch (rows) x cache length (columns) of ours' K+V GB/s over `versus`'s (value="ratio"), or of ours' GB/s
    (value="ours"); None without rows of both."""
    df = _ok(normalize(df, "decode"))
    df = df[(df["metric"] == "step") & (df["grid"] == "issue") & (df["head_dim"] == head_dim)
            & (df["page_size"] == 0)]
    ours = df[df["impl"] == "ours"].set_index(["dtype", "batch", "cache_len"])["gbps"]
    if value == "ours":
        table = ours
    else:
        theirs = df[df["impl"] == versus].set_index(["dtype", "batch", "cache_len"])["gbps"]
        table = (ours / theirs).dropna()
    if len(table) == 0:
        return None
    return table.unstack("cache_len")


def _ratio_lines(ax, df, suite: str, peers: Sequence[str]) -> None:
    """ours / peer TFLOP/s against seqlen, per peer: the median over heads and masks, the range shaded."""
    shape = ["nheads_k", "causal", "seqlen"]
    ours = df[df["impl"] == "ours"].set_index(shape)["tflops"]
    for peer in peers:
        ratio = (ours / df[df["impl"] == peer].set_index(shape)["tflops"]).dropna()
        if len(ratio) == 0:
            continue
        by_len = ratio.groupby(level="seqlen").agg(["median", "min", "max"])
        ax.plot(by_len.index, by_len["median"], marker="o", color=COLORS.get(peer, "0.5"),
                label=f"ours / {LABELS.get(peer, peer)}")
        ax.fill_between(by_len.index, by_len["min"], by_len["max"], color=COLORS.get(peer, "0.5"), alpha=0.15)
    if len(ours):
        log2_axis(ax, ours.index.get_level_values("seqlen"))
    ax.set_xlabel("seqlen (batch x seqlen = 16384)")
    ax.set_title(f"{'forward' if suite == 'prefill_fwd' else 'forward + backward'}: TFLOP/s ratio", fontsize=10)


def plot_ratios(frames: Mapping[str, Any], dtype: str = "fp16", head_dim: int = 128,
                peers: Sequence[str] = ("sdpa_cudnn", "sdpa_flash", "flex"), path: Optional[PathLike] = None,
                log: Callable[[str], None] = print) -> None:
    """One figure of speed ratios (above 1: ours faster), each panel with the 1.0 line: prefill forward and
    forward + backward at `dtype` and `head_dim` (ours / each peer against seqlen: the median over MHA / GQA
    and causal or not, their range shaded, in the peer's colour), and decode (ours / SDPA K+V GB/s against
    cache length, one line style per batch). Shown; saved to `path` when given."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    gpus = set()
    for ax, suite in zip(axes, ("prefill_fwd", "prefill_fwd_bwd")):
        if frames.get(suite) is not None:
            df = _ok(normalize(frames[suite], suite))
            df = df[(df["grid"] == "issue") & (df["dtype"] == dtype) & (df["head_dim"] == head_dim)]
            gpus |= set(df["gpu"])
            _ratio_lines(ax, df, suite, peers)
        ax.set_title(ax.get_title() or suite, fontsize=10)
    axes[0].set_ylabel(f"ours / peer ({dtype}, D={head_dim}; above 1: ours faster)")
    grid = decode_grid(frames["decode"], head_dim=head_dim) if frames.get("decode") is not None else None
    if grid is not None:
        gpus |= set(_ok(normalize(frames["decode"], "decode"))["gpu"])
        for i, ((ddtype, batch), line) in enumerate(grid.iterrows()):
            line = line.dropna()
            axes[2].plot(line.index, line.values, marker="s", color=COLORS["sdpa"],
                         linestyle=LENGTH_STYLES[i % len(LENGTH_STYLES)], label=f"batch {batch} ({ddtype})")
        log2_axis(axes[2], grid.columns)
        axes[2].set_xlabel("cache length (keys per request)")
    axes[2].set_title(f"decode step: ours / {LABELS['sdpa']} K+V GB/s", fontsize=10)
    for ax in axes:
        ax.axhline(1.0, color="black", linestyle="--", linewidth=1)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        if ax.get_lines():
            ax.legend(fontsize=7)
    fig.suptitle(f"Ours against the peers on {', '.join(sorted(gpus)) or '-'} (committed results)", fontsize=11)
    fig.tight_layout()
    write_figure(fig, path, log)


def plot_seed_prefill(rows: Sequence[Mapping[str, Any]], title: str, names: Optional[Mapping[str, str]] = None,
                      path: Optional[PathLike] = None, log: Callable[[str], None] = print) -> None:
    """The seed's prefill table (rows of benchmarks.seed_table.measure_seed_prefill): median ms (error bars:
    one standard deviation) and incremental peak MiB against seqlen, per implementation (solid: no mask,
    dashed: causal; labelled by `names`), the output tensor's size dotted; an OOM row is left out. Shown;
    saved to `path` when given."""
    import matplotlib.pyplot as plt

    fig, (t_ax, m_ax) = plt.subplots(1, 2, figsize=(11, 4.2))
    ok = [r for r in rows if r["status"] == "ok"]
    impls = list(dict.fromkeys(r["impl"] for r in ok))  # in the rows' order
    keys = sorted({(r["impl"], r["mask"]) for r in ok}, key=lambda k: (impls.index(k[0]), k[1] == "causal"))
    for impl, mask in keys:
        line = sorted((r for r in ok if r["impl"] == impl and r["mask"] == mask), key=lambda r: r["seqlen"])
        style = dict(color=COLORS.get(impl, "0.5"), linestyle="--" if mask == "causal" else "-", marker="o",
                     label=f"{(names or {}).get(impl, impl)}, {'causal' if mask == 'causal' else 'no mask'}")
        x = [r["seqlen"] for r in line]
        t_ax.errorbar(x, [r["median_ms"] for r in line], yerr=[r["std_ms"] or 0.0 for r in line], capsize=3, **style)
        if all(r["peak_mib"] is not None for r in line):
            m_ax.plot(x, [r["peak_mib"] for r in line], **style)
    lengths = sorted({r["seqlen"] for r in rows})
    outputs = {r["seqlen"]: r["out_mib"] for r in rows}
    m_ax.plot(lengths, [outputs[n] for n in lengths], color="black", linestyle=":", label="output tensor")
    for ax, ylabel in ((t_ax, "median ms of synchronized calls"), (m_ax, "incremental peak MiB of one call")):
        log2_axis(ax, lengths)
        _log_y(ax)
        ax.set_xlabel("seqlen")
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    write_figure(fig, path, log)


def plot_all(results_dir: PathLike = "results", figures_dir: PathLike = "figures", gpu: Optional[str] = None,
             log: Callable[[str], None] = print) -> List[Path]:
    """Redraw figures_dir/<gpu>/bench_*.png from results_dir/<gpu>/bench_*.csv (every GPU when gpu is None)."""
    frames = {suite: load_suite(suite, results_dir, gpu, log=lambda m: None) for suite in SUITES}
    saved: List[Path] = []
    for suite in ("prefill_fwd", "prefill_fwd_bwd"):
        if frames[suite] is not None:
            saved += plot_prefill(frames[suite], suite, figures_dir, log)
    if frames["decode"] is not None:
        saved += plot_decode(frames["decode"], figures_dir, log)
    if frames["decode_splits"] is not None:
        saved += plot_decode_splits(frames["decode_splits"], figures_dir, log)
    if frames["chunked"] is not None:
        saved += plot_chunked(frames["chunked"], figures_dir, log)
    saved += plot_roofline(frames, figures_dir, log=log)
    if not any(f is not None for f in frames.values()):
        log(f"no bench_*.csv under {results.results_root(results_dir)}/{results.gpu_slug(gpu) if gpu else '<gpu>'}: "
            f"nothing to plot")
    return saved
