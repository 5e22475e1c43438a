"""What dropout costs: flash_attn_func with dropout_p = 0.17 against itself without dropout, and against
PyTorch SDPA's flash backend with the same dropout (FlashAttention-2's CUDA kernels, Philox bits too).

One shape per head dim, bf16 MHA (SDPA's flash backend takes no GQA on every build), batch 4 x 4096
tokens, 16 heads, causal and not, forward alone and forward + backward. Each call is timed by CUDA events
with the host hidden and the L2 flushed; the fastest of `--rounds` medians is kept. Our dropout output is
first checked against the reference with its own mask (S_dmask). Rows go to
results/<gpu>/bench_dropout.csv:

    python -m benchmarks.dropout            # (~1 minute on an H200)
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from tritonattn import attention_ref, flash_attn_func
from tritonattn.testing import rel_err

from .measure import best_medians, table_bench_args
from .results import make_row, write_csv

BATCH, SEQLEN, H = 4, 4096, 16
DTYPE = torch.bfloat16
P = 0.17


def check(d: int, causal: bool) -> float:
    """rel err of one small call against the reference that drops what S_dmask says was dropped."""
    q, k, v = (torch.randn(1, 256, H, d, device="cuda", dtype=DTYPE) for _ in range(3))
    out, _, s_dmask = flash_attn_func(q, k, v, P, causal=causal, return_attn_probs=True)
    ref, _ = attention_ref(q, k, v, causal=causal, dropout_mask=s_dmask >= 0, dropout_p=P)
    return rel_err(out, ref)


def steps(d: int, causal: bool, backward: bool):
    """{name: callable} for ours without / with dropout and SDPA's flash backend with dropout."""
    q, k, v = (torch.randn(BATCH, SEQLEN, H, d, device="cuda", dtype=DTYPE, requires_grad=backward)
               for _ in range(3))
    qt, kt, vt = (torch.randn(BATCH, H, SEQLEN, d, device="cuda", dtype=DTYPE, requires_grad=backward)
                  for _ in range(3))
    dout = torch.randn(BATCH, SEQLEN, H, d, device="cuda", dtype=DTYPE)
    dout_t = dout.transpose(1, 2).contiguous()

    def ours(p):
        def step():
            out = flash_attn_func(q, k, v, p, causal=causal)
            if backward:
                torch.autograd.grad(out, (q, k, v), dout)
        return step

    def sdpa():
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
            out = F.scaled_dot_product_attention(qt, kt, vt, dropout_p=P, is_causal=causal)
            if backward:
                torch.autograd.grad(out, (qt, kt, vt), dout_t)

    return {"ours_p0": ours(0.0), "ours_p017": ours(P), "sdpa_flash_p017": sdpa}


def main(argv=None) -> int:
    a = table_bench_args(argv, __doc__, rep=20, extra=[("--head-dims", dict(default="64,128"))])
    if a is None:
        return 2
    rows = []
    for d in (int(x) for x in a.head_dims.split(",")):
        for causal in (False, True):
            err = check(d, causal)
            for backward in (False, True):
                built = steps(d, causal, backward)
                best = best_medians(built, rounds=a.rounds, rep=a.rep)
                path = "fwd_bwd" if backward else "fwd"
                print(f"d={d:3d} causal={causal!s:5s} {path:7s} " + "  ".join(f"{n} {ms:.3f} ms" for n, ms in
                                                                             best.items())
                      + f"  dropout/none {best['ours_p017'] / best['ours_p0']:.2f}"
                      + f"  ours/sdpa {best['ours_p017'] / best['sdpa_flash_p017']:.2f}  rel err {err:.1e}",
                      flush=True)
                rows.append(make_row(path=path, shape=f"{BATCH}x{SEQLEN}", dtype="bf16", nheads=H, head_dim=d,
                                     causal=causal, dropout_p=P, ms_no_dropout=round(best["ours_p0"], 5),
                                     ms_dropout=round(best["ours_p017"], 5),
                                     ms_sdpa_flash_dropout=round(best["sdpa_flash_p017"], 5),
                                     max_rel_err=f"{err:.2e}"))
                del built
                torch.cuda.empty_cache()
    if not a.no_write:
        print("wrote", write_csv(rows, "bench_dropout", a.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
