"""FP8 (e4m3) against 16-bit: the decode step over an e4m3 KV cache against a bf16 one, dense and paged, and the
FP8 forward against the bf16 forward the dispatcher picks (the Hopper kernel on sm_90), in one run on one card.

Decode: one token per request, no append, 32 query / 8 KV heads, head dim 128, full caches (batch x keys:
8 x 16384, 8 x 32768, 16 x 16384, 1 x 65536), per-(request, KV head) descales; paged: pages of 256 in a
shuffled pool. Prefill: the forward over 4096-16384 tokens, batch x seqlen = 16384, 32 / 8 heads, head dim
128, causal and not. Each call is timed by CUDA events with the host hidden and the L2 flushed; the best of
`--rounds` medians is kept (the cases interleaved). Before timing, each FP8 output is compared with the
float64 reference on the unquantized inputs (rel_err). The issue's targets: decode >= 1.8x the bf16 cache at
batch >= 8 and >= 16k keys, >= 1.5x at batch 1 x 65536, paged within 5% of dense; the FP8 forward >= 1.5x the
bf16 forward at >= 4096 keys. Rows go to results/<gpu>/bench_fp8.csv:

    python -m benchmarks.fp8
"""

from __future__ import annotations

import functools
import sys

import torch

from tritonattn import attention_ref, flash_attn_func, flash_attn_with_kvcache
from tritonattn.testing import quantize_e4m3_ref, rel_err

from .measure import attention_flops, best_medians, table_main

H, H_KV, D = 32, 8, 128
E4M3 = torch.float8_e4m3fn
DECODE_SHAPES = ((8, 16384), (8, 32768), (16, 16384), (1, 65536))
PREFILL_SEQLENS = (4096, 8192, 16384)
PAGE = 256


def _descale(x: torch.Tensor, per_head: bool = True) -> torch.Tensor:
    """amax / 448 per (batch, KV head) of a (batch, seqlen, heads, D) tensor (query heads folded into their KV
    head), or over the tensor."""
    amax = x.float().abs().amax(dim=(1, 3))
    if x.shape[2] != H_KV:
        amax = amax.view(x.shape[0], H_KV, -1).amax(-1)
    return (amax if per_head else amax.max().reshape(1)).div(448.0).clamp(min=1e-12).contiguous()


def _quantize(x: torch.Tensor, descale: torch.Tensor) -> torch.Tensor:
    if x.shape[2] != H_KV:  # query heads: each reads its KV head's descale
        group = x.shape[2] // H_KV
        return (x.float() / descale.repeat_interleave(group, 1)[:, None, :, None]).clamp(-448, 448).to(E4M3)
    return quantize_e4m3_ref(x, descale)


def decode_cases(dtype: torch.dtype = torch.bfloat16):
    """(name, batch, keys, page, step, error) per case: the 16-bit cache ("bf16", q's dtype `dtype`), the e4m3
    one, the e4m3 one paged."""
    for batch, keys in DECODE_SHAPES:
        q = torch.randn(batch, 1, H, D, device="cuda", dtype=dtype)
        k, v = (torch.randn(batch, keys, H_KV, D, device="cuda", dtype=dtype) for _ in range(2))
        kd, vd = _descale(k), _descale(v)
        k8, v8 = _quantize(k, kd), _quantize(v, vd)
        lengths = torch.full((batch,), keys, dtype=torch.int32, device="cuda")
        perm = torch.randperm(batch * keys // PAGE, device="cuda")
        table = perm.view(batch, -1).to(torch.int32)
        pools = [torch.empty(batch * keys // PAGE, PAGE, H_KV, D, device="cuda", dtype=E4M3) for _ in range(2)]
        pools[0][perm] = k8.view(-1, PAGE, H_KV, D)
        pools[1][perm] = v8.view(-1, PAGE, H_KV, D)
        ref, _ = attention_ref(q[:1].double(), k[:1].double(), v[:1].double())
        caches = {"bf16": (0, (k, v), {}), "e4m3": (0, (k8, v8), dict(k_descale=kd, v_descale=vd)),
                  "e4m3 paged": (PAGE, pools, dict(block_table=table, k_descale=kd, v_descale=vd))}
        # each step binds this shape's tensors now (a closure over the loop's names would see the last shape's)
        steps = {name: (page, functools.partial(flash_attn_with_kvcache, q, *kv, cache_seqlens=lengths, **kw))
                 for name, (page, kv, kw) in caches.items()}
        for name, (page, step) in steps.items():
            yield name, batch, keys, page, step, rel_err(step()[:1], ref)


def prefill_cases():
    """(name, seqlen, causal, call, error) per case: the bf16 forward and the FP8 forward."""
    for seqlen in PREFILL_SEQLENS:
        batch = max(1, 16384 // seqlen)
        q = torch.randn(batch, seqlen, H, D, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(batch, seqlen, H_KV, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        ds = [_descale(t) for t in (q, k, v)]
        q8, k8, v8 = (_quantize(t, d) for t, d in zip((q, k, v), ds))
        for causal in (False, True):  # the error of request 0's last 256 rows (causal: aligned bottom-right)
            ref, _ = attention_ref(q[:1, -256:].double(), k[:1].double(), v[:1].double(), causal=causal)
            calls = {  # bound to this shape's tensors now, as the decode steps
                "bf16": functools.partial(flash_attn_func, q, k, v, causal=causal),
                "e4m3": functools.partial(flash_attn_func, q8, k8, v8, causal=causal, q_descale=ds[0],
                                          k_descale=ds[1], v_descale=ds[2]),
            }
            for name, call in calls.items():
                err = rel_err(call()[:1, -256:], ref)
                yield name, batch, seqlen, causal, call, err


def measure(*, rounds: int = 3, rep: int = 30, verbose: bool = True) -> list:
    """Rows (dicts, not yet stamped with the GPU): us per call, the speedup over the 16-bit case of the same
    shape, and for decode the K/V bytes per second and paged / dense time."""
    timed = {}
    for name, batch, keys, page, step, err in decode_cases():
        timed[("decode", name, batch, keys, False)] = (step, err, page)
    for name, batch, seqlen, causal, call, err in prefill_cases():
        timed[("prefill", name, batch, seqlen, causal)] = (call, err, 0)
    best = best_medians({key: fn for key, (fn, _, _) in timed.items()}, rounds=rounds, rep=rep)
    rows = []
    for key, (_, err, page) in timed.items():
        path, name, batch, n, causal = key
        base = best[(path, "bf16", batch, n, causal)]
        row = dict(path=path, impl=name, batch=batch, seqlen=n, causal=causal, nheads=H, nheads_k=H_KV, head_dim=D,
                   page_size=page, us=round(best[key] * 1e3, 2), speedup_vs_bf16=round(base / best[key], 3),
                   rel_err_fp64=f"{err:.2e}")
        if path == "decode":
            itemsize = 2 if name == "bf16" else 1
            row["gb_per_s"] = round(2 * batch * n * H_KV * D * itemsize / (best[key] * 1e-3) / 1e9, 1)
            if name == "e4m3 paged":
                row["paged_vs_dense_time"] = round(best[key] / best[(path, "e4m3", batch, n, causal)], 3)
        else:
            row["tflops"] = round(attention_flops(batch, H, n, n, D, causal=causal) / (best[key] * 1e-3) / 1e12, 1)
        if verbose:
            print(", ".join(f"{k}={v}" for k, v in row.items()), flush=True)
        rows.append(row)
    return rows


def main(argv=None) -> int:
    return table_main(argv, __doc__, measure, "bench_fp8", rep=30)


if __name__ == "__main__":
    sys.exit(main())
