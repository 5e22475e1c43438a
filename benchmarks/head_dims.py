"""Odd head dims against the next multiple of 8: is a head dim the kernels pad and mask as fast?

For each pair (d, round_up(d, 8)), one case per path, all in bf16 with 32 q / 8 KV heads:

- prefill_fwd, prefill_fwd_bwd: flash_attn_func, causal, batch 4 x 4096 and batch 16 x 1024 tokens,
  contiguous inputs (an odd head dim's rows are not 16-byte aligned: on Hopper they are copied into
  aligned buffers first, and that copy is timed with the call);
- decode: one new token per request appended to caches of 4096 keys, batch 32, the caches as a user
  allocates them (contiguous) and as KVCache allocates them (rows aligned);
- chunked: 2048 new tokens appended to caches holding 4096, batch 1, KVCache-style caches.

Each call is timed by CUDA events with the host hidden (`measure.time_fn(hide_host=True)`) and the
L2 flushed; the pair's two cases alternate, round after round, and the fastest round's median is kept.
Each case is first checked against the fp32 reference. Rows go to results/<gpu>/bench_head_dims.csv:

    python -m benchmarks.head_dims            # (~1 minute on an H200)
"""

from __future__ import annotations

import sys

import torch

from tritonattn import attention_ref, flash_attn_func, flash_attn_with_kvcache
from tritonattn.launch.operands import empty_aligned
from tritonattn.testing import rel_err

from .measure import best_medians, table_bench_args
from .results import make_row, write_csv

H, HK = 32, 8
DTYPE = torch.bfloat16
HEAD_DIMS = (13, 67, 100, 125, 250)
PREFILL = ((4, 4096), (16, 1024))  # (batch, seqlen)
DECODE = (32, 4096)  # (batch, cache length)
CHUNKED = (1, 4096, 2048)  # (batch, cached prefix, chunk)


def round_up8(d: int) -> int:
    return -(-d // 8) * 8


def randn(*shape, aligned=False):
    t = empty_aligned(shape, DTYPE, "cuda", aligned=aligned)
    return t.copy_(torch.randn(*shape, device="cuda", dtype=DTYPE))


def prefill_case(d, batch, seqlen, backward):
    q = randn(batch, seqlen, H, d).requires_grad_(backward)
    k = randn(batch, seqlen, HK, d).requires_grad_(backward)
    v = randn(batch, seqlen, HK, d).requires_grad_(backward)
    dout = torch.randn(batch, seqlen, H, d, device="cuda", dtype=DTYPE)
    small = (slice(0, 1), slice(0, 256))  # the check: one sequence's first 256 tokens

    def check():
        args = [t[small].detach() for t in (q, k, v)]
        return rel_err(flash_attn_func(*args, causal=True), attention_ref(*args, causal=True)[0])

    if not backward:
        return (lambda: flash_attn_func(q, k, v, causal=True)), check

    def step():
        out = flash_attn_func(q, k, v, causal=True)
        torch.autograd.grad(out, (q, k, v), dout)

    return step, check


def cache_case(d, batch, cached, new, aligned):
    capacity = cached + new
    q = randn(batch, new, H, d)
    k, v = randn(batch, new, HK, d), randn(batch, new, HK, d)
    kc, vc = randn(batch, capacity, HK, d, aligned=aligned), randn(batch, capacity, HK, d, aligned=aligned)
    lengths = torch.full((batch,), cached, dtype=torch.int32, device="cuda")

    def step():
        return flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=lengths, causal=True)

    def check():
        out = step()[:1]
        keys, vals = kc[:1, :capacity], vc[:1, :capacity]
        return rel_err(out, attention_ref(q[:1], keys, vals, causal=True)[0])

    return step, check


def cases(d):
    """(path, shape text, build) for one head dim."""
    out = []
    for batch, seqlen in PREFILL:
        out.append(("prefill_fwd", f"{batch}x{seqlen}", lambda b=batch, s=seqlen: prefill_case(d, b, s, False)))
        out.append(("prefill_fwd_bwd", f"{batch}x{seqlen}", lambda b=batch, s=seqlen: prefill_case(d, b, s, True)))
    b, n = DECODE
    for aligned in (False, True):
        out.append(("decode", f"{b}x{n} {'aligned' if aligned else 'contiguous'}",
                    lambda a=aligned: cache_case(d, b, n - 1, 1, a)))
    b, n, c = CHUNKED
    out.append(("chunked", f"{b}x{n}+{c} aligned", lambda: cache_case(d, b, n, c, True)))
    return out


def main(argv=None) -> int:
    a = table_bench_args(argv, __doc__, rep=30, extra=[("--head-dims", dict(default=",".join(map(str, HEAD_DIMS))))])
    if a is None:
        return 2
    rows, worst = [], 0.0
    for d in (int(x) for x in a.head_dims.split(",")):
        pair = (d, round_up8(d))
        for (path, shape, build_odd), (_, _, build_even) in zip(cases(pair[0]), cases(pair[1])):
            built = {dd: build() for dd, build in zip(pair, (build_odd, build_even))}
            errs = {dd: check() for dd, (_, check) in built.items()}
            best = best_medians({dd: step for dd, (step, _) in built.items()}, rounds=a.rounds, rep=a.rep)
            ratio = best[pair[0]] / best[pair[1]]
            worst = max(worst, ratio)
            ok = all(e < 2e-2 for e in errs.values())
            print(f"{path:16s} {shape:24s} d={pair[0]:3d}: {best[pair[0]]:8.4f} ms  d={pair[1]:3d}: "
                  f"{best[pair[1]]:8.4f} ms  ratio {ratio:.3f}  rel err {max(errs.values()):.1e}"
                  f"{'' if ok else '  WRONG'}", flush=True)
            rows.append(make_row(path=path, shape=shape, dtype="bf16", nheads=H, nheads_k=HK, head_dim=pair[0],
                                 head_dim_next8=pair[1], ms=round(best[pair[0]], 5), ms_next8=round(best[pair[1]], 5),
                                 ratio=round(ratio, 4), max_rel_err=f"{max(errs.values()):.2e}"))
            del built
            torch.cuda.empty_cache()
    print(f"worst ratio {worst:.3f}")
    if not a.no_write:
        print("wrote", write_csv(rows, "bench_head_dims", a.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
