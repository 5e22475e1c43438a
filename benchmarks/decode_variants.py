"""Decode with the attention variants against plain decode: a sliding window over a long cache against
plain decode over a cache of the window's length, and softcap / ALiBi / sinks against plain decode over
the same cache, dense and paged.

One token per request, no append (a step that only reads), bf16, head dim 128, 32 query / 8 KV heads,
batch 8 (--batch). Bandwidth counts the K/V bytes a step must read, 2 * B * H_KV * keys * D * 2 bytes,
keys = the cache length (plain, softcap, ALiBi, sinks) or the window's (a window reads its band only).
Each step is timed by CUDA events with the host hidden and the L2 flushed; the best of `--rounds`
medians is kept. The targets these rows are judged by: a window >= 0.9x the TB/s of plain decode over a
cache of the window's length; softcap, ALiBi and sinks >= 0.95x plain decode over the same cache; paged
within 5% of dense. Before timing, each case's output is compared with the float64 reference
(kernels/tritonattn/testing/reference.py) on request 0. Rows go to results/<gpu>/bench_decode_variants.csv:

    python -m benchmarks.decode_variants          # (~30 s on an H200)
"""

from __future__ import annotations

import sys

import torch

from tritonattn import attention_ref, flash_attn_with_kvcache
from tritonattn.testing import rel_err

from .measure import best_medians, table_bench_args
from .results import make_row, write_csv
from .variants import alibi_slopes

H, H_KV, D = 32, 8, 128
DTYPE = torch.bfloat16
WINDOW = 4096
LONG, SHORT = 65536, 4096


def cases(long: int = LONG, short: int = SHORT, window: int = WINDOW) -> list:
    """(name, cache length, flash_attn_with_kvcache keywords, the plain case it is judged against)."""
    return [
        ("plain", short, {}, None),
        (f"window_{window}", long, dict(causal=True, window_size=(window - 1, 0)), ("plain", short)),
        ("plain", long, {}, None),
        ("softcap_30", long, dict(softcap=30.0), ("plain", long)),
        ("alibi", long, dict(alibi=True), ("plain", long)),
        ("sinks", long, dict(sinks=True), ("plain", long)),
        ("softcap_30", short, dict(softcap=30.0), ("plain", short)),
        ("alibi", short, dict(alibi=True), ("plain", short)),
        ("sinks", short, dict(sinks=True), ("plain", short)),
    ]


PAGE_SIZES = (0, 16, 64)  # 0: dense


def keys_read(length: int, kw: dict) -> int:
    """Keys a one-token step over `length` cached keys must read: the window's band, or all of them."""
    window = kw.get("window_size", (-1, -1))[0]
    return length if window < 0 else min(length, window + 1)


def paged(cache: torch.Tensor, page_size: int, perm: torch.Tensor) -> torch.Tensor:
    """The dense (B, N, H_KV, D) cache as a pool of pages behind the block table `perm`."""
    batch, length = cache.shape[:2]
    pool = torch.empty(batch * length // page_size, page_size, H_KV, D, device=cache.device, dtype=cache.dtype)
    pool[perm.view(-1).long()] = cache.reshape(-1, page_size, H_KV, D)
    return pool


def call_kwargs(kw: dict) -> dict:
    """flash_attn_with_kvcache keywords of a case (its ALiBi slopes and sinks made here)."""
    kw = dict(kw)
    if kw.pop("alibi", False):
        kw["alibi_slopes"] = alibi_slopes(H)
    if kw.pop("sinks", False):
        kw["sinks"] = torch.randn(H, device="cuda")
    return kw


def reference_error(q, k_cache, v_cache, length: int, kw: dict, out: torch.Tensor) -> float:
    """Relative error of request 0's output against the float64 reference over its `length` keys."""
    ref_kw = dict(causal=kw.get("causal", False), window_size=kw.get("window_size", (-1, -1)),
                  softcap=kw.get("softcap", 0.0), sinks=kw.get("sinks"), alibi_slopes=kw.get("alibi_slopes"))
    ref, _ = attention_ref(q[:1].double(), k_cache[:1, :length].double(), v_cache[:1, :length].double(), **ref_kw)
    return rel_err(out[:1], ref)


def measure(batch: int = 8, long: int = LONG, short: int = SHORT, window: int = WINDOW, page_sizes=PAGE_SIZES,
            *, rounds: int = 3, rep: int = 50, verbose: bool = True) -> list:
    """Rows (dicts, not yet stamped with the GPU) of every case of `cases(long, short, window)` and page
    size (0: dense): us per step, K/V TB/s, TB/s over its plain case's, float64 reference error."""
    q = torch.randn(batch, 1, H, D, device="cuda", dtype=DTYPE)
    caches = {n: [torch.randn(batch, n, H_KV, D, device="cuda", dtype=DTYPE) for _ in range(2)] for n in (short, long)}
    steps, errors = {}, {}
    for name, length, case, _ in cases(long, short, window):
        kw = call_kwargs(case)
        lengths = torch.full((batch,), length, dtype=torch.int32, device="cuda")
        k_cache, v_cache = caches[length]
        for page_size in page_sizes:
            if page_size:
                perm = torch.randperm(batch * length // page_size, device="cuda").view(batch, -1).to(torch.int32)
                kc, vc, extra = paged(k_cache, page_size, perm), paged(v_cache, page_size, perm), dict(block_table=perm)
            else:
                kc, vc, extra = k_cache, v_cache, {}
            key = (name, length, page_size)
            steps[key] = (lambda kc=kc, vc=vc, lengths=lengths, kw=kw, extra=extra:
                          flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lengths, **kw, **extra))
            errors[key] = reference_error(q, k_cache, v_cache, length, kw, steps[key]())
    best = best_medians(steps, rounds=rounds, rep=rep)
    rows = []
    for name, length, case, judge in cases(long, short, window):
        for page_size in page_sizes:
            key = (name, length, page_size)
            tbs = 2 * batch * H_KV * keys_read(length, case) * D * 2 / (best[key] * 1e-3) / 1e12
            base = (judge[0], judge[1], page_size) if judge is not None else None
            vs = (best[base] * keys_read(length, case) / keys_read(judge[1], {}) / best[key]) if base else float("nan")
            vs_dense = best[(name, length, 0)] / best[key] if 0 in page_sizes else float("nan")
            if verbose:
                print(f"{name:12s} cache {length:6d} page {page_size or 'dense':>5} {best[key] * 1e3:8.1f} us "
                      f"{tbs:5.2f} TB/s  vs its plain {vs:.3f}  paged/dense time {1 / vs_dense:.3f}  "
                      f"rel err {errors[key]:.2e}", flush=True)
            rows.append(dict(path="decode", shape=f"{batch}x{length}", dtype="bf16", nheads=H, nheads_k=H_KV,
                             head_dim=D, variant=name, page_size=page_size, us=round(best[key] * 1e3, 2),
                             tb_per_s=round(tbs, 3), vs_plain=round(vs, 3), rel_err=f"{errors[key]:.2e}"))
    return rows


def main(argv=None) -> int:
    a = table_bench_args(argv, __doc__, rep=50, rounds=3,
                         extra=[("--batch", dict(type=int, default=8, help="requests per step"))])
    if a is None:
        return 2
    rows = [make_row(**row) for row in measure(a.batch, rounds=a.rounds, rep=a.rep)]
    if not a.no_write:
        print("wrote", write_csv(rows, "bench_decode_variants", a.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
