"""Plot committed benchmark CSVs: results/<gpu>/prefill_*.csv -> figures/<gpu>/*.png.

Usage: python scripts/plot_results.py [--gpu nvidia-h200]
One figure per (mode, dtype): TFLOP/s vs seqlen per implementation, panels MHA/GQA x causal.
"""

from __future__ import annotations

import argparse
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
STYLE = {"ours": ("C3", "o", "ours (Triton)"), "sdpa_cudnn": ("C0", "s", "SDPA cuDNN"),
         "sdpa_flash": ("C2", "^", "SDPA flash (FA2)"), "flex": ("C1", "v", "FlexAttention")}


def plot_prefill(df: pd.DataFrame, mode: str, dtype: str, path: str) -> None:
    sub = df[(df["mode"] == mode) & (df["dtype"] == dtype)]
    fig, axes = plt.subplots(1, 4, figsize=(18, 4), sharey=True)
    for ax, (hk, causal) in zip(axes, [(32, False), (32, True), (8, False), (8, True)]):
        panel = sub[(sub["nheads_k"] == hk) & (sub["causal"] == causal)]
        for impl, g in panel.groupby("impl"):
            color, marker, label = STYLE.get(impl, ("k", ".", impl))
            g = g.sort_values("seqlen")
            ax.plot(g["seqlen"], g["tflops"], color=color, marker=marker, label=label)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{'MHA 32:32' if hk == 32 else 'GQA 32:8'}, {'causal' if causal else 'non-causal'}")
        ax.set_xlabel("seqlen (batch x seqlen = 16384)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("TFLOP/s")
    axes[0].legend()
    gpu = sub["gpu"].iloc[0] if len(sub) else "?"
    what = "forward" if mode == "fwd" else "forward + backward (bwd = 2.5x fwd FLOPs)"
    fig.suptitle(f"Prefill {what}, {dtype}, head dim 128, 32 q heads - measured on {gpu}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpu", default="nvidia-h200")
    args = ap.parse_args()
    res = os.path.join(ROOT, "results", args.gpu)
    out = os.path.join(ROOT, "figures", args.gpu)
    os.makedirs(out, exist_ok=True)
    for mode in ("fwd", "fwd_bwd"):
        csv_path = os.path.join(res, f"prefill_{mode}.csv")
        if not os.path.exists(csv_path):
            print("missing", csv_path)
            continue
        df = pd.read_csv(csv_path)
        for dtype in sorted(df["dtype"].unique()):
            path = os.path.join(out, f"prefill_{mode}_{dtype}.png")
            plot_prefill(df, mode, dtype, path)
            print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
