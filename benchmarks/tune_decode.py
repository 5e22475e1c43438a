"""Sweep the decode kernel's config and split count on the present GPU (bf16, 32 q / 8 KV heads, D=128).

For each (batch, cache length) every (BLOCK_N, num_warps, num_stages) config of the grid below is
timed at several num_splits with CUDA-graph replay (so launch overhead is excluded), next to SDPA's
default backend with a length-1 query and the current heuristic. Bandwidth = K+V bytes read / time.
Also measures the host overhead of one eager decode step (CPU wall time of the call, no sync).

    python -m benchmarks.tune_decode --out results/nvidia-h200 [--quick]

Writes <out>/tune_decode.csv (one row per measurement) and prints the best config per shape.
"""

from __future__ import annotations

import argparse
import itertools
import sys

import torch
import torch.nn.functional as F

import tritonattn.config.tables as tables
import tritonattn.launch.decode as decode
import tritonattn.launch.replay as replay
from tritonattn import flash_attn_with_kvcache
from tritonattn.config.hardware import device_target
from tritonattn.launch.fast import LaunchCache
from tritonattn.testing import attention_ref, rel_err

from .measure import decode_kv_bytes, host_overhead_us, time_cuda_graph
from .results import make_row, write_csv

H, HK, D = 32, 8, 128


def _set_config(cfg: tables.DecodeConfig) -> None:
    tables.HOPPER_DECODE[D] = cfg
    decode.plan_decode.cache_clear()
    replay.REPLAYS.clear()  # replays hold the launches of the old plans


def chunked_crossover() -> list:
    """Decode kernel vs prefill path (see tritonattn.launch.decode [Note] Chunked prefill) as seqlen_q grows:
    where CHUNKED_PREFILL_MIN_SEQLEN_Q should sit. Append + causal over 4096 cached tokens."""
    rows = []
    threshold, wave = tables.CHUNKED_PREFILL_MIN_SEQLEN_Q, tables.CHUNKED_PREFILL_MIN_WAVE
    tables.CHUNKED_PREFILL_MIN_WAVE = 0.0  # the seqlen threshold alone picks the path below
    decode.prefill_programs_fill.cache_clear()
    for B in (1, 8):
        kc = torch.randn(B, 8192, HK, D, device="cuda", dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        for M in (16, 32, 64, 128, 256, 512):
            q = torch.randn(B, M, H, D, device="cuda", dtype=torch.bfloat16)
            kn = torch.randn(B, M, HK, D, device="cuda", dtype=torch.bfloat16)
            vn = torch.randn_like(kn)
            times = {}
            for path, thr in (("decode_kernel", 1 << 30), ("prefill_path", 1)):
                tables.CHUNKED_PREFILL_MIN_SEQLEN_Q = thr
                times[path] = time_cuda_graph(
                    lambda: flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=4096, causal=True))
                rows.append(make_row(kernel="chunked_" + path, batch=B, seqlen_cache=4096, seqlen_q=M,
                                     ms=times[path]))
            print(f"chunked B={B} M={M}: decode kernel {times['decode_kernel'] * 1e3:.1f} us, "
                  f"prefill path {times['prefill_path'] * 1e3:.1f} us", flush=True)
    tables.CHUNKED_PREFILL_MIN_SEQLEN_Q, tables.CHUNKED_PREFILL_MIN_WAVE = threshold, wave
    decode.prefill_programs_fill.cache_clear()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="results", help="results root; rows go to <out>/<gpu-slug>/")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-sweep", action="store_true", help="only the host overhead and the chunked crossover")
    args = ap.parse_args()
    torch.manual_seed(0)
    dev = "cuda"
    default_cfg = tables.HOPPER_DECODE[D]
    rows = []
    shapes = [(1, 16384), (1, 32768), (1, 65536), (8, 16384), (1, 4096), (32, 4096)]
    configs = [tables.DecodeConfig(bn, w, s) for bn, w, s in itertools.product((32, 64, 128), (4, 8), (2, 3, 4, 6))
               if not (bn == 128 and s >= 6)]
    if args.quick:
        configs = [default_cfg, tables.DecodeConfig(64, 4, 6), tables.DecodeConfig(128, 8, 3)]
    for B, L in [] if args.no_sweep else shapes:
        q = torch.randn(B, 1, H, D, device=dev, dtype=torch.bfloat16)
        kc = torch.randn(B, L, HK, D, device=dev, dtype=torch.bfloat16)
        vc = torch.randn(B, L, HK, D, device=dev, dtype=torch.bfloat16)
        nbytes = decode_kv_bytes(B * L, HK, D, torch.bfloat16)
        ref = attention_ref(q.float(), kc.float(), vc.float())[0]
        # SDPA default with a length-1 query
        qs, ks, vs = q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2)
        ms = time_cuda_graph(lambda: F.scaled_dot_product_attention(qs, ks, vs, enable_gqa=True))
        rows.append(make_row(kernel="sdpa_default", batch=B, seqlen_cache=L, ms=ms, tbps=nbytes / ms / 1e9))
        print(f"B={B} L={L} sdpa {ms * 1e3:.1f} us {nbytes / ms / 1e9:.2f} TB/s", flush=True)
        best = None
        for cfg in configs:
            _set_config(cfg)
            max_s = min(128, L // cfg.block_n)
            splits_grid = sorted({0, 1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128} & set(range(max_s + 1)))
            if B >= 32:
                splits_grid = [s for s in splits_grid if s <= 4]
            for ns in splits_grid:
                try:
                    out = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=L, num_splits=ns)
                    err = rel_err(out, ref)
                    if err > 2e-2:
                        print(f"  WRONG {cfg} splits={ns}: rel err {err:.2e}", flush=True)
                        continue
                    ms = time_cuda_graph(lambda: flash_attn_with_kvcache(q, kc, vc, cache_seqlens=L, num_splits=ns))
                except Exception as e:  # out of resources etc.
                    print(f"  FAIL {cfg} splits={ns}: {type(e).__name__}: {str(e)[:100]}", flush=True)
                    continue
                plan = decode.plan_decode(B, 1, H, HK, D, L, torch.bfloat16, device_target(q.device), ns)
                tbps = nbytes / ms / 1e9
                rows.append(make_row(kernel="ours", batch=B, seqlen_cache=L, block_n=cfg.block_n,
                                     num_warps=cfg.num_warps, num_stages=cfg.num_stages, num_splits=ns,
                                     eff_splits=plan.num_splits, ms=ms, tbps=tbps))
                if best is None or ms < best[0]:
                    best = (ms, cfg, ns, plan.num_splits)
        print(f"B={B} L={L} best {best[1]} splits={best[2]}->{best[3]}: {best[0] * 1e3:.1f} us "
              f"{nbytes / best[0] / 1e9:.2f} TB/s", flush=True)
        del kc, vc
        torch.cuda.empty_cache()
    _set_config(default_cfg)
    # host overhead of one eager step: append + attend, batch 1, cache 4096
    kc = torch.randn(1, 4096, HK, D, device=dev, dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    q = torch.randn(1, 1, H, D, device=dev, dtype=torch.bfloat16)
    kn = torch.randn(1, 1, HK, D, device=dev, dtype=torch.bfloat16)
    vn = torch.randn_like(kn)
    lens = torch.full((1,), 100, dtype=torch.int32, device=dev)
    for name, fn in [
        ("ours_append_tensor_lens", lambda: flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=lens)),
        ("ours_append_int_len", lambda: flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=100)),
        ("ours_no_append_tensor_lens", lambda: flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens)),
        ("sdpa_default", lambda: F.scaled_dot_product_attention(q.transpose(1, 2), kc.transpose(1, 2),
                                                                vc.transpose(1, 2), enable_gqa=True)),
    ]:
        us = host_overhead_us(fn, calls=2000)["host_us"]
        rows.append(make_row(kernel=name, batch=1, seqlen_cache=4096, host_us=us))
        print(f"host overhead {name}: {us:.1f} us", flush=True)
    LaunchCache.enabled = False  # every launch through Triton's dispatcher: no replays, nothing cached
    replay.REPLAYS.clear()
    decode.decode_launcher.kernels.clear()
    decode.combine_launcher.kernels.clear()
    us = host_overhead_us(lambda: flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=lens),
                          calls=2000)["host_us"]
    rows.append(make_row(kernel="ours_append_tensor_lens_no_fast_launch", batch=1, seqlen_cache=4096, host_us=us))
    print(f"host overhead without fast launch: {us:.1f} us", flush=True)
    LaunchCache.enabled = True
    rows += chunked_crossover()
    path = write_csv(rows, "tune_decode", args.out)
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
