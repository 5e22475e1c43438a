"""Sweep prefill tile configs on the present GPU and print the best per (head dim, causal).

Usage (GPU only): python -m benchmarks.tune_prefill [--out DIR] [--quick]
Writes tune_fwd.csv and tune_bwd.csv to --out (default results/<gpu>/). The winners are copied by
hand into kernels/tritonattn/config/tables.py: the tables there are the contract, this script is how they were found.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import os
import time

import torch
import triton

from tritonattn.config.options import attn_options
from tritonattn.config.tables import AttnConfig
from tritonattn.launch.backward import launch_backward
from tritonattn.launch.prefill import launch_prefill
from tritonattn.testing import attention_ref, rel_err


def flops(b, h, m, n, d, causal, mode):
    f = 4 * b * h * m * n * d * (0.5 if causal else 1.0)
    return f * {"fwd": 1.0, "bwd": 2.5}[mode]


def bench(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--head-dims", default="128")
    ap.add_argument("--skip-bwd", action="store_true")
    ap.add_argument("--skip-fwd", action="store_true")
    ap.add_argument("--fwd-cands", default="all", help="'all' or 'small' (a few strong candidates)")
    args = ap.parse_args()
    gpu = torch.cuda.get_device_name()
    out_dir = args.out or os.path.join("results", gpu.lower().replace(" ", "-"))
    os.makedirs(out_dir, exist_ok=True)
    dtype = torch.bfloat16
    torch.manual_seed(0)
    shapes = [(4, 4096), (1, 16384)] if not args.quick else [(4, 4096)]
    H = 32
    head_dims = [int(x) for x in args.head_dims.split(",")]

    fwd_cands = []
    for (bm, bn, w), s, tma in itertools.product(
        [(128, 64, 4), (128, 64, 8), (128, 128, 8), (64, 64, 4), (64, 128, 4)], [2, 3, 4], [False, True]
    ):
        fwd_cands.append(AttnConfig(bm, bn, w, s, tma))

    if args.fwd_cands == "small":
        fwd_cands = [AttnConfig(128, 64, 4, 2, True), AttnConfig(128, 64, 4, 3, True), AttnConfig(128, 64, 8, 2, True),
                     AttnConfig(128, 128, 8, 2, True), AttnConfig(64, 64, 4, 3, True), AttnConfig(128, 32, 4, 3, True)]
    rows = []
    if not args.skip_fwd:
        for D, causal, (B, S) in itertools.product(head_dims, [False, True], shapes):
            q = torch.randn(B, S, H, D, device="cuda", dtype=dtype)
            k = torch.randn(B, S, H, D, device="cuda", dtype=dtype)
            v = torch.randn(B, S, H, D, device="cuda", dtype=dtype)
            ref, _ = attention_ref(q[:1, :1024], k[:1, :1024], v[:1, :1024], causal=causal)
            options = attn_options(D, None, causal)
            for cfg in fwd_cands:
                t0 = time.time()
                try:
                    o, _ = launch_prefill(q[:1, :1024], k[:1, :1024], v[:1, :1024], options, cfg)
                    err = rel_err(o, ref)
                    ms = bench(lambda: launch_prefill(q, k, v, options, cfg))
                except Exception as e:  # out of resources etc.
                    print("fail", cfg, repr(e)[:200])
                    continue
                tf = flops(B, H, S, S, D, causal, "fwd") / ms * 1e-9
                rows.append(dict(kind="fwd", D=D, causal=causal, B=B, S=S, **cfg.as_dict(), ms=ms, tflops=tf,
                                 err=err, compile_s=time.time() - t0))
                print(f"fwd D={D} causal={causal} B={B} S={S} {cfg} {ms:.3f} ms {tf:.0f} TF/s err={err:.1e}",
                      flush=True)
        with open(os.path.join(out_dir, "tune_fwd.csv"), "w", newline="") as f:
            wr = csv.DictWriter(f, fieldnames=list(rows[0].keys()))
            wr.writeheader()
            wr.writerows(rows)
        print("\nBest fwd configs:")
        for D, causal in itertools.product(head_dims, [False, True]):
            sub = [r for r in rows if r["D"] == D and r["causal"] == causal]
            keyf = lambda r: (r["block_m"], r["block_n"], r["num_warps"], r["num_stages"], r["use_tma"])  # noqa
            agg = {}
            for r in sub:
                agg.setdefault(keyf(r), []).append(r["tflops"])
            best = sorted(agg.items(), key=lambda kv: -min(kv[1]))[:5]
            for k_, v_ in best:
                print(f"  D={D} causal={causal} {k_} TF/s per shape {[round(x) for x in v_]}")

    if args.skip_bwd:
        return
    kv_cands = [AttnConfig(64, 128, 8, 2, True), AttnConfig(64, 128, 8, 3, True), AttnConfig(64, 128, 4, 2, True),
                AttnConfig(32, 128, 4, 3, True), AttnConfig(64, 64, 4, 3, True), AttnConfig(128, 128, 8, 2, True),
                AttnConfig(128, 64, 8, 2, True), AttnConfig(32, 64, 4, 3, True)]
    q_cands = [AttnConfig(128, 64, 8, 3, True), AttnConfig(128, 64, 8, 2, True), AttnConfig(64, 64, 4, 3, True),
               AttnConfig(128, 128, 8, 2, True), AttnConfig(128, 64, 4, 2, True), AttnConfig(64, 128, 4, 2, True),
               AttnConfig(128, 32, 4, 3, True)]
    brows = []
    for D, causal in itertools.product(head_dims, [False, True]):
        B, S = shapes[0]
        q = torch.randn(B, S, H, D, device="cuda", dtype=dtype)
        k = torch.randn(B, S, H // 4, D, device="cuda", dtype=dtype)
        v = torch.randn(B, S, H // 4, D, device="cuda", dtype=dtype)
        options = attn_options(D, None, causal)
        o, lse = launch_prefill(q, k, v, options)
        do = torch.randn_like(o)
        best_kv = kv_cands[0]
        best_ms = float("inf")
        for which, cands in (("dkdv", kv_cands), ("dq", q_cands)):
            for cfg in cands:
                pair = (cfg, q_cands[0]) if which == "dkdv" else (best_kv, cfg)
                try:
                    ms = bench(lambda: launch_backward(do, q, k, v, o, lse, options, pair))
                except Exception as e:
                    print("fail", which, cfg, repr(e)[:200])
                    continue
                tf = flops(B, H, S, S, D, causal, "bwd") / ms * 1e-9
                brows.append(dict(kind=which, D=D, causal=causal, B=B, S=S, **cfg.as_dict(), ms=ms, tflops=tf))
                print(f"bwd[{which}] D={D} causal={causal} {cfg} {ms:.3f} ms {tf:.0f} TF/s", flush=True)
                if which == "dkdv" and ms < best_ms:
                    best_ms, best_kv = ms, cfg
    with open(os.path.join(out_dir, "tune_bwd.csv"), "w", newline="") as f:
        wr = csv.DictWriter(f, fieldnames=list(brows[0].keys()))
        wr.writeheader()
        wr.writerows(brows)


if __name__ == "__main__":
    main()
