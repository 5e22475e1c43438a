"""The attention variants against plain causal and against FlexAttention with the same mask and score
modification: causal, causal + sliding window 1024 / 4096, causal + softcap 50, causal + ALiBi, causal +
sinks (Flex has no sinks: ours only).
Flex runs at 16384 tokens unless --flex-seqlens says otherwise (its compiles dominate the run).

bf16, head dim 128, 32 query / 8 KV heads, B = 1 x 16384 and B = 4 x 4096 tokens, forward alone and
forward + backward. TFLOP/s count the (query, key) pairs the mask admits: 4 * D FLOP per pair forward,
3.5x that forward + backward (the backward is 2.5x the forward). Each call is timed by CUDA events
with the host hidden and the L2 flushed; the best of `--rounds` medians is kept. Before timing, each
case's output on the last 512 queries of batch 0, heads 0-3, is compared with the float64 reference
(kernels/tritonattn/testing/reference.py): ours and Flex's relative errors side by side. Rows go to
results/<gpu>/bench_variants.csv:

    python -m benchmarks.variants            # (~3 minutes on an H200, half of it Flex's compiles)
"""

from __future__ import annotations

import math
import sys

import torch
import torch._dynamo

from tritonattn import attention_ref, flash_attn_func
from tritonattn.testing import rel_err, variant_checks

from .measure import peak_memory_delta, table_bench_args, time_fn
from .results import make_row, write_csv

H, H_KV, D = 32, 8, 128
DTYPE = torch.bfloat16
SHAPES = [(1, 16384), (4, 4096)]
CASES = {  # name: flash_attn_func keywords beyond causal=True (tensors made per shape)
    "causal": {},
    "window_1024": dict(window_size=(1024, 0)),
    "window_4096": dict(window_size=(4096, 0)),
    "softcap_50": dict(softcap=50.0),
    "alibi": dict(alibi=True),
    "sinks": dict(sinks=True),
}


def alibi_slopes(nheads: int, device="cuda") -> torch.Tensor:
    """ALiBi's geometric slopes 2^(-8 (h + 1) / nheads) (Press et al.), float32: the checks' own
    (`tritonattn.testing.variant_checks.alibi_slopes`), on the GPU by default."""
    return variant_checks.alibi_slopes(nheads, device)


def pairs(seqlen: int, window: int) -> int:
    """(query, key) pairs causal attention with a left window admits (window < 0: none)."""
    if window < 0 or window >= seqlen:
        return seqlen * (seqlen + 1) // 2
    return sum(min(i + 1, window + 1) for i in range(seqlen))


def our_kwargs(case: dict) -> dict:
    kw = dict(case)
    if kw.pop("alibi", False):
        kw["alibi_slopes"] = alibi_slopes(H)
    if kw.pop("sinks", False):
        kw["sinks"] = torch.randn(H, device="cuda", requires_grad=True)
    return kw


def flex_call(case: dict, seqlen: int):
    """flex(q, k, v) in (B, H, S, D) with the case's block mask and score_mod, or None (sinks)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if case.get("sinks"):
        return None
    window = case.get("window_size", (-1, 0))[0]
    if window >= 0:
        def mask(b, h, qi, ki):
            return (ki <= qi) & (ki >= qi - window)
    else:
        def mask(b, h, qi, ki):
            return ki <= qi
    block_mask = create_block_mask(mask, None, None, seqlen, seqlen, device="cuda")
    score_mod = None
    if case.get("softcap"):
        cap = case["softcap"]

        def score_mod(score, b, h, qi, ki):
            return cap * torch.tanh(score / cap)
    elif case.get("alibi"):
        slopes = alibi_slopes(H)

        def score_mod(score, b, h, qi, ki):
            return score - slopes[h] * (qi - ki).abs()
    flex = torch.compile(flex_attention, dynamic=False)
    return lambda q, k, v: flex(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=True)


def errors(q, k, v, case, kw, out, flex_out) -> tuple:
    """(ours, flex) relative errors on the last 512 queries of batch 0, heads 0-3 (KV head 0)."""
    rows = slice(q.shape[1] - 512, q.shape[1])
    qs, ks, vs = q[:1, rows, :4].double(), k[:1, :, :1].double(), v[:1, :, :1].double()
    ref_kw = dict(causal=True, window_size=kw.get("window_size", (-1, -1)), softcap=kw.get("softcap", 0.0))
    if "alibi_slopes" in kw:
        ref_kw["alibi_slopes"] = kw["alibi_slopes"][:4].double()
    if "sinks" in kw:
        ref_kw["sinks"] = kw["sinks"].detach()[:4].double()
    # the slice's queries are the last 512 of seqlen: bottom-right alignment keeps their positions
    ref, _ = attention_ref(qs, ks, vs, **ref_kw)
    ours = rel_err(out[:1, rows, :4], ref)
    theirs = rel_err(flex_out[:1, :4, rows].transpose(1, 2), ref) if flex_out is not None else float("nan")
    return ours, theirs


def measure(shapes, cases=None, *, flex_seqlens=(), rounds: int = 2, rep: int = 10, memory: bool = False,
            verbose: bool = True) -> list:
    """Rows (dicts, not yet stamped with the GPU) of every (shape, case, fwd / fwd_bwd): ms and TFLOP/s of
    ours and, at `flex_seqlens`, Flex's; ours over plain causal (the "causal" case, measured first) and
    over Flex; both relative errors; with `memory`, the peak bytes one call allocates beyond its inputs
    (mib_ours, mib_flex). shapes: (batch, seqlen) pairs; cases: names of CASES (default all)."""
    names = list(CASES) if cases is None else ["causal"] + [n for n in cases if n != "causal"]
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    rows, plain = [], {}
    for batch, seqlen in shapes:
        q, k, v = (torch.randn(batch, seqlen, h, D, device="cuda", dtype=DTYPE, requires_grad=True)
                   for h in (H, H_KV, H_KV))
        qt, kt, vt = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))
        dout = torch.randn(batch, seqlen, H, D, device="cuda", dtype=DTYPE)
        dout_t = dout.transpose(1, 2).contiguous()
        for name in names:
            case = CASES[name]
            kw = our_kwargs(case)
            flex = flex_call(case, seqlen) if seqlen in flex_seqlens else None
            with torch.no_grad():
                out = flash_attn_func(q, k, v, causal=True, **kw)
                flex_out = flex(qt, kt, vt) if flex is not None else None
            err_ours, err_flex = errors(q, k, v, case, kw, out, flex_out)
            del out, flex_out
            n_pairs = pairs(seqlen, case.get("window_size", (-1, 0))[0]) * batch * H
            for backward in (False, True):
                def ours():
                    o = flash_attn_func(q, k, v, causal=True, **kw)
                    if backward:
                        torch.autograd.grad(o, (q, k, v), dout)

                def theirs():
                    o = flex(qt, kt, vt)
                    if backward:
                        torch.autograd.grad(o, (qt, kt, vt), dout_t)

                steps = {"ours": ours, "flex": theirs if flex is not None else None}
                best = {n: math.inf for n, f in steps.items() if f is not None}
                for _ in range(rounds):
                    for n in best:
                        best[n] = min(best[n], time_fn(steps[n], rep=rep, flush_l2=True, hide_host=True)["median_ms"])
                mib = {n: peak_memory_delta(steps[n]) / 2**20 for n in best} if memory else {}
                flops = 4 * D * n_pairs * (3.5 if backward else 1.0)
                tflops = {n: flops / (ms * 1e-3) / 1e12 for n, ms in best.items()}
                path = "fwd_bwd" if backward else "fwd"
                if name == "causal":
                    plain[(batch, seqlen, path)] = tflops["ours"]
                vs_plain = tflops["ours"] / plain[(batch, seqlen, path)]
                vs_flex = tflops["ours"] / tflops["flex"] if "flex" in tflops else float("nan")
                if verbose:
                    print(f"{batch}x{seqlen:<6d} {name:12s} {path:7s} ours {tflops['ours']:6.1f} TFLOP/s "
                          f"({best['ours']:.3f} ms)  flex {tflops.get('flex', float('nan')):6.1f}  "
                          f"ours/plain {vs_plain:.2f}  ours/flex {vs_flex:.2f}  "
                          f"rel err ours {err_ours:.2e} flex {err_flex:.2e}", flush=True)
                row = dict(path=path, shape=f"{batch}x{seqlen}", dtype="bf16", nheads=H, nheads_k=H_KV, head_dim=D,
                           variant=name, ms_ours=round(best["ours"], 4),
                           ms_flex=round(best.get("flex", float("nan")), 4), tflops_ours=round(tflops["ours"], 1),
                           tflops_flex=round(tflops.get("flex", float("nan")), 1),
                           ours_over_plain=round(vs_plain, 3), ours_over_flex=round(vs_flex, 3),
                           rel_err_ours=f"{err_ours:.2e}", rel_err_flex=f"{err_flex:.2e}")
                if memory:
                    row.update(mib_ours=round(mib["ours"], 1), mib_flex=round(mib.get("flex", float("nan")), 1))
                rows.append(row)
            torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    flex_help = "sequence lengths at which Flex runs too (each case is one Flex compile, ~30 s)"
    a = table_bench_args(argv, __doc__, rep=10, rounds=2,
                         extra=[("--flex-seqlens", dict(default="16384", help=flex_help))])
    if a is None:
        return 2
    flex_seqlens = {int(x) for x in a.flex_seqlens.split(",") if x}
    rows = [make_row(**row) for row in measure(SHAPES, flex_seqlens=flex_seqlens, rounds=a.rounds, rep=a.rep)]
    if not a.no_write:
        print("wrote", write_csv(rows, "bench_variants", a.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
