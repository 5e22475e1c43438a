"""Views of the attention variants for notebook 05: what each variant does to the scores (drawn), their
speed rows (`benchmarks.variants` for prefill, `benchmarks.decode_variants` for decode; measured now on a
GPU or read from the committed results/<gpu>/ CSVs) condensed into ratio tables and one figure, and the K/V
memory of a workload served with and without a sliding window. Needs a GPU only to measure.

    plot_masks(path), plot_score_mods(path)              the masks; ALiBi's bias, softcap's curve, a sink
    committed(name, gpu)                                 the latest committed rows of bench_<name>.csv
    measure_prefill(shapes), measure_decode(...)         ours, live (GPU), as DataFrames
    prefill_ratio_table(df, shape), decode_ratio_table(df), memory_table(df)
    plot_speed(prefill, decode, shape=..., title=...)    TFLOP/s and ratios (a 1.0 line)
    speed_targets(prefill, decode)                       the numbers the variants are judged by
    window_memory_table({label: engine})                 a served workload's K/V, full against a window
"""

from __future__ import annotations

import math
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

import torch

from tritonattn.testing import causal_mask, window_mask

from . import decode_variants, report, results, variants
from .grids import COLORS, PathLike

PREFILL_CASES = ("causal", "window_1024", "softcap_50", "alibi", "sinks")
PATHS = {"fwd": "forward", "fwd_bwd": "forward + backward"}


def dashed(df):
    """`df` for display: missing values read "-" (not NaN)."""
    return df.astype(object).where(df.notna(), "-")


# ============================================================================================
# Pictures
# ============================================================================================
def plot_masks(path: Optional[PathLike] = None, n: int = 12, window: int = 4) -> None:
    """Four masks on an n x n problem (blue: the keys a query sees): causal; causal with a window of `window`
    keys; a window on both sides, not causal; 4 new queries over n keys, bottom-right aligned (a decode
    chunk), with the window."""
    import matplotlib.pyplot as plt

    masks = [
        ("causal", causal_mask(n, n)),
        (f"causal + window of {window} keys\nwindow_size=({window - 1}, 0)",
         window_mask(n, n, (window - 1, 0), causal=True)),
        ("window_size=(3, 2), not causal", window_mask(n, n, (3, 2))),
        (f"4 new queries over {n} keys (bottom-right:\na decode chunk), window of {window}",
         window_mask(4, n, (window - 1, 0), causal=True)),
    ]
    fig, axes = plt.subplots(2, 2, figsize=(9, 8))
    for ax, (title, mask) in zip(axes.flat, masks):
        ax.imshow(mask.float().numpy(), cmap="Blues", vmin=0, vmax=1.3)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("key j")
        ax.set_ylabel("query i")
    fig.suptitle("Which keys each query sees", fontsize=11)
    fig.tight_layout()
    report.write_figure(fig, path)


def plot_score_mods(path: Optional[PathLike] = None, n: int = 12) -> None:
    """Three panels: ALiBi's bias -slope * (i - j) on an n x n causal problem; softcap's c * tanh(s / c) for
    three caps; one row's softmax with and without a sink."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    ax = axes[0]
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    bias = torch.where(j <= i, -0.5 * (i - j).float(), torch.tensor(float("nan")))
    image = ax.imshow(bias.numpy(), cmap="viridis")
    fig.colorbar(image, ax=ax, fraction=0.046)
    ax.set_title("ALiBi: bias -slope * (i - j), slope 0.5", fontsize=9)
    ax.set_xlabel("key j")
    ax.set_ylabel("query i")
    ax = axes[1]
    s = torch.linspace(-120, 120, 400)
    for cap, grey in ((10.0, "0.0"), (30.0, "0.35"), (50.0, "0.6")):
        ax.plot(s.numpy(), (cap * torch.tanh(s / cap)).numpy(), color=grey, label=f"c = {cap:g}")
    ax.plot(s.numpy(), s.numpy(), color="0.75", linestyle=":", label="no cap")
    ax.set_ylim(-60, 60)
    ax.set_title("softcap: score -> c * tanh(score / c)", fontsize=9)
    ax.set_xlabel("score")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    ax = axes[2]
    scores, sink = torch.tensor([0.5, -1.0, 0.2, -0.3, 0.1, -2.0]), 2.0
    plain = torch.softmax(scores, 0)
    with_sink = torch.softmax(torch.cat([scores, torch.tensor([sink])]), 0)
    x = torch.arange(len(scores)).numpy()
    plain, with_sink = plain.numpy(), with_sink.numpy()
    ax.bar(x - 0.2, plain, width=0.4, color="0.7", label="no sink: the keys sum to 1")
    ax.bar(x + 0.2, with_sink[:-1], width=0.4, color="0.3",
           label=f"sink logit {sink:g}: the keys sum to {with_sink[:-1].sum():.2f}")
    ax.bar([len(scores) + 0.2], with_sink[-1:], width=0.4, color="black", hatch="//", label="the sink's share")
    ax.set_xticks(list(range(len(scores))) + [len(scores)], [f"k{t}" for t in range(len(scores))] + ["sink"])
    ax.set_title("sinks: one row's probabilities", fontsize=9)
    ax.legend(fontsize=7)
    fig.suptitle("What softcap, ALiBi and a sink do to one head's scores", fontsize=11)
    fig.tight_layout()
    report.write_figure(fig, path)


# ============================================================================================
# Speed rows: committed or measured now
# ============================================================================================
def committed(name: str, gpu: Optional[str] = None, results_dir: PathLike = "results"):
    """The committed rows of results/<gpu>/bench_<name>.csv (every GPU's when gpu is None), the latest row
    per GPU, shape, variant, path and page size; None when there are none."""
    try:
        df = results.read_csv(f"bench_{name}", gpu=gpu, results_dir=results_dir)
    except FileNotFoundError:
        return None
    keys = [c for c in ("gpu", "path", "shape", "variant", "page_size") if c in df.columns]
    df = df.sort_values("date", kind="stable").drop_duplicates(keys, keep="last")
    return df.sort_index().reset_index(drop=True)


def measure_prefill(shapes: Sequence[Tuple[int, int]], cases: Sequence[str] = PREFILL_CASES, *, rounds: int = 2,
                    rep: int = 10):
    """`benchmarks.variants.measure` on `shapes` ((batch, seqlen) pairs) for ours alone (no Flex, whose
    compiles take minutes), with the peak memory of one call beyond its inputs: a DataFrame of its rows,
    stamped with the GPU. GPU only."""
    import pandas as pd

    rows = variants.measure(shapes, list(cases), flex_seqlens=(), rounds=rounds, rep=rep, memory=True, verbose=False)
    return pd.DataFrame([results.make_row(**row) for row in rows])


def measure_decode(batch: int, long: int, short: int, window: int, page_sizes: Sequence[int] = (0, 64), *,
                   rounds: int = 3, rep: int = 30):
    """`benchmarks.decode_variants.measure`: one-token decode steps with each variant, dense and paged, their
    K/V TB/s against plain decode (a window against plain decode over a cache of the window's length): a
    DataFrame of its rows, stamped with the GPU. GPU only."""
    import pandas as pd

    rows = decode_variants.measure(batch, long, short, window, tuple(page_sizes), rounds=rounds, rep=rep,
                                   verbose=False)
    return pd.DataFrame([results.make_row(**row) for row in rows])


def _at(df, shape: Optional[str]):
    shape = shape if shape is not None else df["shape"].iloc[-1]
    return df[df["shape"] == shape], shape


def prefill_ratio_table(df, shape: Optional[str] = None):
    """Per variant at `shape` (default: the last one): ours over plain causal (TFLOP/s over the pairs each
    mask admits), forward ("fwd / plain") and forward + backward ("fwd+bwd / plain"), and ours over
    FlexAttention ("... / Flex") where Flex ran; "-" where a ratio is missing (Flex has no sinks)."""
    import pandas as pd

    sub, _ = _at(df, shape)
    table = {}
    for column, label in (("ours_over_plain", "plain"), ("ours_over_flex", "Flex")):
        if column in sub and sub[column].notna().any():
            for path, name in (("fwd", "fwd"), ("fwd_bwd", "fwd+bwd")):
                table[f"{name} / {label}"] = sub[sub["path"] == path].set_index("variant")[column]
    return dashed(pd.DataFrame(table))


def decode_ratio_table(df):
    """Per variant and cache length (keys): a dense step's µs, and K/V TB/s over its plain case's for each
    page size (0: dense), "-" for the plain rows themselves."""
    import pandas as pd

    df = df.assign(keys=df["shape"].str.split("x").str[1].astype(int))
    index = list(dict.fromkeys(zip(df["variant"], df["keys"])))
    table = {"µs, dense": df[df["page_size"] == 0].set_index(["variant", "keys"])["us"]}
    for page in sorted(df["page_size"].unique()):
        name = "dense" if page == 0 else f"pages of {page}"
        table[f"vs plain, {name}"] = df[df["page_size"] == page].set_index(["variant", "keys"])["vs_plain"]
    table = pd.DataFrame(table).reindex(pd.MultiIndex.from_tuples(index, names=["variant", "keys"]))
    return dashed(table)


def memory_table(df):
    """Peak MiB one call allocates beyond its inputs, per variant (rows) and shape (columns), forward +
    backward; measured rows only (the committed CSVs hold no memory)."""
    sub = df[df["path"] == "fwd_bwd"]
    return sub.pivot_table(index="variant", columns="shape", values="mib_ours", sort=False)


def plot_speed(prefill, decode, *, title: str, shape: Optional[str] = None, path: Optional[PathLike] = None) -> None:
    """2 x 2: prefill TFLOP/s of ours and (where it ran) FlexAttention per variant at `shape`, forward and
    forward + backward; ours over plain causal per variant with a 1.0 line; decode TB/s over plain decode
    per variant, dense and paged, with a 1.0 line."""
    import matplotlib.pyplot as plt
    import numpy as np

    sub, shape = _at(prefill, shape)
    fig, axes = plt.subplots(2, 2, figsize=(13, 8))
    for ax, (path_name, name) in zip(axes[0], PATHS.items()):
        rows = sub[sub["path"] == path_name]
        x = np.arange(len(rows))
        has_flex = "tflops_flex" in rows and rows["tflops_flex"].notna().any()
        width = 0.4 if has_flex else 0.6
        ax.bar(x - (0.2 if has_flex else 0), rows["tflops_ours"], width=width, color=COLORS["ours"],
               label="ours")
        if has_flex:
            ax.bar(x + 0.2, rows["tflops_flex"].fillna(0), width=width, color=COLORS["flex"],
                   label="FlexAttention (no sinks)")
        ax.set_xticks(x, rows["variant"], rotation=20, fontsize=8)
        ax.set_ylabel("TFLOP/s (pairs the mask admits)")
        ax.set_ylim(0, 1.3 * rows["tflops_ours"].max())
        ax.set_title(f"prefill {name}, {shape}", fontsize=10)
        ax.legend(fontsize=8, loc="upper right")
    ax = axes[1, 0]
    variants_ = list(dict.fromkeys(sub["variant"]))
    x = np.arange(len(variants_))
    for offset, (path_name, name), alpha in zip((-0.2, 0.2), PATHS.items(), (0.45, 1.0)):
        ratio = sub[sub["path"] == path_name].set_index("variant")["ours_over_plain"].reindex(variants_)
        ax.bar(x + offset, ratio, width=0.4, color=COLORS["ours"], alpha=alpha, label=name)
    _ratio_panel(ax, x, variants_, sub["ours_over_plain"], ylabel="ours / plain causal (TFLOP/s)",
                 title=f"prefill: what a variant costs, {shape}", rotation=20, fontsize=8)
    ax = axes[1, 1]
    judged = decode[decode["vs_plain"].notna()]
    judged = judged.assign(label=[f"{r.variant}\n{r.shape.split('x')[1]} keys" for r in judged.itertuples()])
    labels = list(dict.fromkeys(judged["label"]))
    x = np.arange(len(labels))
    pages = sorted(judged["page_size"].unique())
    width = 0.8 / len(pages)
    hatches = iter(["//", "xx", ".."])
    for k, page in enumerate(pages):
        ratios = judged[judged["page_size"] == page].set_index("label")["vs_plain"].reindex(labels)  # one per tick
        ax.bar(x - 0.4 + width * (k + 0.5), ratios, width=width,
               color=COLORS["ours_paged" if page else "ours"], alpha=1.0 if page else 0.45,
               hatch=next(hatches) if page else None, label=f"paged, pages of {page}" if page else "dense")
    _ratio_panel(ax, x, labels, judged["vs_plain"], ylabel="K/V TB/s over plain decode's",
                 title=f"decode, batch {decode['shape'].iloc[0].split('x')[0]}", rotation=30, fontsize=7)
    for a in axes.flat:
        a.grid(True, axis="y", alpha=0.3)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    report.write_figure(fig, path)


def _ratio_panel(ax, x, ticks, ratios, *, ylabel: str, title: str, rotation: int, fontsize: int) -> None:
    """A panel of ratios to a baseline: the 1.0 line, the ticks, a y axis from 0 above the largest ratio."""
    ax.axhline(1.0, color="black", linewidth=1)
    ax.set_xticks(x, ticks, rotation=rotation, fontsize=fontsize)
    ax.set_ylabel(ylabel)
    ax.set_ylim(0, max(1.3, 1.15 * float(ratios.max())))
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="upper right")


def speed_targets(prefill, decode) -> Dict[str, float]:
    """The ratios the variants are judged by, from rows of `benchmarks.variants` and `benchmarks.decode_variants`:
    "decode window", the worst decode TB/s of a window over plain decode's over the window's length (target
    >= 0.9); "decode others", of softcap / ALiBi / sinks over plain decode's (>= 0.95); "decode paged", the worst
    paged over dense time (<= 1.05); "prefill window" and "prefill others", the lowest prefill ours over plain
    causal, forward + backward, of the windows and of the other variants."""
    d = decode
    dense = d[d["page_size"] == 0].set_index(["variant", "shape"])["us"]
    paged = d[d["page_size"] != 0].set_index(["variant", "shape"])["us"]
    fb = prefill[prefill["path"] == "fwd_bwd"]
    is_window = fb["variant"].str.startswith("window")
    rest = fb[~is_window & (fb["variant"] != "causal")]["ours_over_plain"]
    return {
        "decode window": float(d[d["variant"].str.startswith("window")]["vs_plain"].min()),
        "decode others": float(d[d["variant"].isin(["softcap_30", "alibi", "sinks"])]["vs_plain"].min()),
        "decode paged": float((paged / dense).max()),
        "prefill window": float(fb[is_window]["ours_over_plain"].min()),
        "prefill others": float(rest.min()) if len(rest) else math.nan,
    }


# ============================================================================================
# Serving with a window
# ============================================================================================
def window_memory_table(engines: Mapping[str, Any]):
    """Per finished engine ({label: benchmarks.serving.ServingEngine}): steps, tokens, the peak and mean K/V
    pool in use (MiB, one layer), the most pages one request held, outputs checked and passed."""
    import pandas as pd

    rows = []
    for label, engine in engines.items():
        stats, checks, log = engine.stats_frame(), engine.checks_frame(), engine.requests_frame()
        rows.append({"attention": label, "steps": len(stats), "tokens": int(stats["tokens"].sum()),
                     "peak_pool_mib": float(stats["pool_in_use_mib"].max()),
                     "mean_pool_mib": float(stats["pool_in_use_mib"].mean()),
                     "most_pages_one_request": int(log["pages_held"].max()),
                     "checked": len(checks), "passed": int(checks["ok"].sum())})
    return pd.DataFrame(rows).set_index("attention")
