"""Prefill benchmark on the present GPU: ours vs SDPA (flash, cuDNN) and FlexAttention, forward and
forward+backward, the issues' grid (head dim 128, 32 q heads, batch x seqlen = 16384 tokens).

Usage (GPU only): python scripts/bench_prefill.py [--modes fwd,fwd_bwd] [--dtypes bf16,fp16]
    [--seqlens 1024,2048,4096,8192,16384] [--no-flex] [--out results]
Writes <out>/<gpu>/prefill_<mode>.csv via kernels.bench.write_csv and prints a table.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from kernels import attention_ref, flash_attn_func, rel_err  # noqa: E402
from kernels.bench import attention_flops, make_row, time_fn, write_csv  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def sdpa_fn(backend):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    be = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]

    def run(q, k, v, causal):  # (b, h, s, d)
        with sdpa_kernel(be):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1])

    return run


_flex_cache = {}


def flex_fn():
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    compiled = torch.compile(flex_attention)

    def run(q, k, v, causal):
        key = (q.shape[2], causal)
        if key not in _flex_cache:
            mask = (lambda b, h, m, n: m >= n) if causal else (lambda b, h, m, n: m >= 0)
            _flex_cache[key] = create_block_mask(mask, None, None, q.shape[2], k.shape[2], device=q.device)
        return compiled(q, k, v, block_mask=_flex_cache[key], enable_gqa=q.shape[1] != k.shape[1])

    return run


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--modes", default="fwd,fwd_bwd")
    ap.add_argument("--dtypes", default="bf16,fp16")
    ap.add_argument("--seqlens", default="1024,2048,4096,8192,16384")
    ap.add_argument("--kv-heads", default="32,8")
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument("--flex-dtypes", default="bf16")
    ap.add_argument("--out", default="results")
    ap.add_argument("--rep", type=int, default=20)
    args = ap.parse_args()
    torch.manual_seed(0)
    H, D, TOKENS = 32, 128, 16384
    impls = {"ours": None, "sdpa_cudnn": sdpa_fn("cudnn"), "sdpa_flash": sdpa_fn("flash")}
    if not args.no_flex:
        try:
            impls["flex"] = flex_fn()
        except Exception as e:  # missing FlexAttention: skip with a message
            print("FlexAttention unavailable:", e)
    for mode in args.modes.split(","):
        rows = []
        for dname in args.dtypes.split(","):
            dtype = DTYPES[dname]
            for hk in [int(x) for x in args.kv_heads.split(",")]:
                for causal in (False, True):
                    for S in [int(x) for x in args.seqlens.split(",")]:
                        B = TOKENS // S
                        q = torch.randn(B, S, H, D, device="cuda", dtype=dtype)
                        k = torch.randn(B, S, hk, D, device="cuda", dtype=dtype)
                        v = torch.randn(B, S, hk, D, device="cuda", dtype=dtype)
                        dout = torch.randn_like(q)
                        qt, kt, vt, dot = (x.transpose(1, 2).contiguous() for x in (q, k, v, dout))
                        # correctness once per shape before timing (first 1024 queries of batch 0)
                        ref, _ = attention_ref(q[:1], k[:1], v[:1], causal=causal)
                        err = rel_err(flash_attn_func(q[:1], k[:1], v[:1], causal=causal), ref)
                        flops = attention_flops(B, H, S, S, D, causal, mode=mode)
                        line = f"{mode:7s} {dname} H={H}:{hk} causal={int(causal)} B={B:2d} S={S:5d} err={err:.1e} |"
                        for name, fn in impls.items():
                            if name == "flex" and dname not in args.flex_dtypes.split(","):
                                continue
                            if name == "ours":
                                if err > 2e-2:
                                    line += f" ours WRONG({err:.1e})"
                                    continue
                                a, b_, c, g = q, k, v, dout
                                call = lambda a, b_, c: flash_attn_func(a, b_, c, causal=causal)  # noqa: E731
                            else:
                                a, b_, c, g = qt, kt, vt, dot
                                call = lambda a, b_, c, fn=fn: fn(a, b_, c, causal)  # noqa: E731
                            if mode == "fwd":
                                run = lambda: call(a, b_, c)  # noqa: E731
                            else:
                                a2, b2, c2 = (x.detach().requires_grad_() for x in (a, b_, c))

                                def run(a2=a2, b2=b2, c2=c2, g=g, call=call):
                                    out = call(a2, b2, c2)
                                    return torch.autograd.grad(out, (a2, b2, c2), g)
                            try:
                                t = time_fn(run, warmup=5, rep=args.rep)
                            except Exception as e:
                                line += f" {name} n/a({type(e).__name__})"
                                continue
                            tf = flops / t["median_ms"] * 1e-9
                            line += f" {name} {tf:4.0f}"
                            rows.append(make_row(mode=mode, impl=name, dtype=dname, batch=B, seqlen=S, nheads=H,
                                                 nheads_k=hk, head_dim=D, causal=causal, tflops=round(tf, 1),
                                                 **{k_: round(v_, 4) for k_, v_ in t.items()}))
                        print(line, flush=True)
                        del q, k, v, dout, qt, kt, vt, dot
        path = write_csv(rows, f"prefill_{mode}", results_dir=args.out)
        print("wrote", path)


if __name__ == "__main__":
    main()
