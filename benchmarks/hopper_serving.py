"""The serving shapes of the prefill forward against flash_attn_func on the same queries and keys, in one run on one
card: packed sequences (flash_attn_varlen_func) and a chunk of a prompt against a cache (flash_attn_with_kvcache).

Packed: a ragged batch of 16384 tokens (RAGGED), causal, 32 q / 8 KV heads, head dim 128:
- "varlen": flash_attn_varlen_func as the dispatcher runs it (Hopper's warp-specialized kernel where its rule
  gives it a config);
- "varlen portable": the same call with Hopper's kernel switched off (TRITONATTN_SM90=0): the portable
  fwd_kernel, on a GPU where the dispatcher would take Hopper's;
- "dense": flash_attn_func on each sequence alone, the times summed: the same queries and keys.
Chunked: a CHUNK-token chunk of one request appended to a cache holding CACHED tokens, causal (the chunk's
queries at the last CHUNK key positions):
- "kvcache" / "kvcache paged": flash_attn_with_kvcache with k / v appended, the cache dense or pages of PAGE
  rows in a shuffled pool; "... portable" the same with Hopper's kernel switched off, as above;
- "dense": flash_attn_func on the chunk's queries against all CACHED + CHUNK keys.

Each call is timed by `time_fn` (L2 flushed, host hidden), the best of `--rounds` medians with the cases
interleaved. vs_dense is the dense time over the call's (the target: >= 0.9); rel_err compares each
output with the dense one. Rows go to results/<gpu>/bench_hopper_serving.csv:

    python -m benchmarks.hopper_serving
"""

from __future__ import annotations

import functools
import os
import sys

import torch

from tritonattn import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache, rel_err
from tritonattn.api.args import attention_call
from tritonattn.config.hardware import device_target
from tritonattn.config.tables import prefill_fwd_sm90_config

from .measure import attention_flops, best_medians, table_main

H, H_KV, D = 32, 8, 128
RAGGED = (4096, 3072, 2560, 2048, 1792, 1280, 1024, 512)  # 16384 tokens
CACHED, CHUNK, PAGE = 12288, 2048, 256


def _portable(fn):
    """fn run as the dispatcher runs it with Hopper's warp-specialized kernel switched off (TRITONATTN_SM90=0,
    read per call): the portable kernel (fwd_kernel) on the same call."""
    def run():
        before = os.environ.get("TRITONATTN_SM90")
        os.environ["TRITONATTN_SM90"] = "0"
        try:
            return fn()
        finally:
            if before is None:
                del os.environ["TRITONATTN_SM90"]
            else:
                os.environ["TRITONATTN_SM90"] = before

    return run


def _takes_hopper(q, max_len, cache=False) -> bool:
    call = attention_call(D, None, True, seqlen_k=max_len, batch=1, nheads=H, device=q.device)
    return prefill_fwd_sm90_config(call.options, q.dtype, max_len, device_target(q.device), cache) is not None


def varlen_cases(dtype):
    """(impl, calls, flops, output): calls is a list of functions whose times add up to the case's."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    total = sum(RAGGED)
    q = torch.randn(total, H, D, device="cuda", dtype=dtype, generator=gen)
    k, v = (torch.randn(total, H_KV, D, device="cuda", dtype=dtype, generator=gen) for _ in range(2))
    cu = torch.tensor((0, *RAGGED), device="cuda").cumsum(0).to(torch.int32)
    flops = sum(attention_flops(1, H, n, n, D, causal=True) for n in RAGGED)
    spans = [(int(a), int(b)) for a, b in zip(cu[:-1], cu[1:])]
    dense = [functools.partial(flash_attn_func, q[None, a:b], k[None, a:b], v[None, a:b], causal=True)
             for a, b in spans]
    reference = torch.cat([fn()[0] for fn in dense])
    packed = functools.partial(flash_attn_varlen_func, q, k, v, cu, cu, max(RAGGED), max(RAGGED), causal=True)
    yield "dense", dense, flops, reference
    yield "varlen", [packed], flops, packed()
    if _takes_hopper(q, max(RAGGED)):
        portable = _portable(packed)
        yield "varlen portable", [portable], flops, portable()


def chunked_cases(dtype):
    """As `varlen_cases`, for one chunk appended to a cache (dense and paged) and the dense call it equals."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    capacity = CACHED + CHUNK
    q = torch.randn(1, CHUNK, H, D, device="cuda", dtype=dtype, generator=gen)
    keys, values = (torch.randn(1, capacity, H_KV, D, device="cuda", dtype=dtype, generator=gen) for _ in range(2))
    lengths = torch.full((1,), CACHED, dtype=torch.int32, device="cuda")
    new = dict(k=keys[:, CACHED:], v=values[:, CACHED:])
    k_cache, v_cache = keys.clone(), values.clone()  # the chunk's rows are rewritten by every call, identically
    perm = torch.randperm(capacity // PAGE, device="cuda", generator=gen)
    table = perm.view(1, -1).to(torch.int32)
    pools = [torch.empty(capacity // PAGE, PAGE, H_KV, D, device="cuda", dtype=dtype) for _ in range(2)]
    pools[0][perm], pools[1][perm] = keys.view(-1, PAGE, H_KV, D), values.view(-1, PAGE, H_KV, D)
    flops = attention_flops(1, H, CHUNK, capacity, D, causal=True)
    dense = functools.partial(flash_attn_func, q, keys, values, causal=True)
    kvcache = functools.partial(flash_attn_with_kvcache, q, k_cache, v_cache, cache_seqlens=lengths, causal=True,
                                **new)
    paged = functools.partial(flash_attn_with_kvcache, q, *pools, cache_seqlens=lengths, block_table=table,
                              causal=True, **new)
    yield "dense", [dense], flops, dense()
    yield "kvcache", [kvcache], flops, kvcache()
    yield "kvcache paged", [paged], flops, paged()
    if _takes_hopper(q, capacity, cache=True):
        for impl, call in (("kvcache portable", _portable(kvcache)), ("kvcache paged portable", _portable(paged))):
            yield impl, [call], flops, call()


def measure(*, rounds: int = 3, rep: int = 30, verbose: bool = True) -> list:
    """Rows (dicts, not yet stamped with the GPU): us per case, TFLOP/s, vs_dense and rel_err."""
    cases = {}
    for dtype in (torch.bfloat16, torch.float16):
        short = str(dtype).removeprefix("torch.")
        for case, make in (("varlen", varlen_cases), ("chunked", chunked_cases)):
            outputs = {}
            for impl, calls, flops, out in make(dtype):
                outputs[impl] = out
                cases[(case, short, impl)] = [calls, flops, rel_err(out, outputs["dense"])]
    best = best_medians({key: calls for key, (calls, _, _) in cases.items()}, rounds=rounds, rep=rep)
    rows = []
    for (case, short, impl), (_, flops, err) in cases.items():
        ms = best[(case, short, impl)]
        row = dict(case=case, impl=impl, dtype=short, tokens=sum(RAGGED) if case == "varlen" else CHUNK,
                   cached=0 if case == "varlen" else CACHED, page_size=PAGE if "paged" in impl else 0, nheads=H,
                   nheads_k=H_KV, head_dim=D, causal=True, us=round(ms * 1e3, 2), tflops=round(flops / ms / 1e9, 1),
                   vs_dense=round(best[(case, short, "dense")] / ms, 3), rel_err=f"{err:.2e}")
        if verbose:
            print(", ".join(f"{k}={v}" for k, v in row.items()), flush=True)
        rows.append(row)
    return rows


def main(argv=None) -> int:
    return table_main(argv, __doc__, measure, "bench_hopper_serving", rep=30)


if __name__ == "__main__":
    sys.exit(main())
