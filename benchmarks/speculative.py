"""Speculative decoding's verify step against a plain decode step: flash_attn_with_kvcache with a draft tree
(tree_mask) over a full cache, against the same call with one new token, in one run on one card.

Batch 8, 16384 cached keys per request, 32 query / 8 KV heads, head dim 128, bf16 (fp16 without bf16), the new
tokens appended by the call: 1 token (the baseline), a chain of 8 drafts, a binary tree of 64 drafts (draft t's
parent (t - 1) // 2, depth 6). The floor of each step: the K/V bytes it must read once (2 x batch x keys x KV
heads x D x 2 bytes, at the card's measured copy bandwidth) and its FLOPs (4 x batch x heads x queries x keys x
D, at the tensor cores' peak); the step is memory-bound while those FLOPs take less time than the bytes. Each
call is timed by CUDA events, L2 flushed, host hidden; the best of `--rounds` medians. No peer takes this mask
form (FlashInfer's custom_mask and SGLang's take theirs): ours only. Rows go to results/<gpu>/bench_speculative.csv:

    python -m benchmarks.speculative
"""

from __future__ import annotations

import sys

import torch

from tritonattn import flash_attn_with_kvcache

from .measure import best_medians, table_main

BATCH, KEYS, H, H_KV, D = 8, 16384, 32, 8, 128


def tree_of(kind: str, n: int) -> torch.Tensor:
    """(n, n) ancestor mask: "chain" (each draft the previous one's child) or "binary" (parent (t - 1) // 2)."""
    parents = [t - 1 for t in range(n)] if kind == "chain" else [(t - 1) // 2 for t in range(n)]
    mask = torch.zeros(n, n, dtype=torch.bool)
    for t in range(n):
        u = t
        while u >= 0:
            mask[t, u] = True
            u = parents[u] if u > 0 else -1
    return mask


def measure(*, rounds: int = 3, rep: int = 50):
    dtype = torch.bfloat16 if torch.cuda.get_device_capability() >= (8, 0) else torch.float16
    k_cache = torch.randn(BATCH, KEYS + 64, H_KV, D, device="cuda", dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    lengths = torch.full((BATCH,), KEYS, dtype=torch.int32, device="cuda")
    cases = {}
    for name, n, kind in (("decode 1 token", 1, None), ("chain of 8", 8, "chain"), ("tree of 64", 64, "binary")):
        q = torch.randn(BATCH, n, H, D, device="cuda", dtype=dtype)
        k, v = (torch.randn(BATCH, n, H_KV, D, device="cuda", dtype=dtype) for _ in range(2))
        mask = None if kind is None else tree_of(kind, n).to("cuda").expand(BATCH, n, n).contiguous()
        tree = {} if mask is None else {"tree_mask": mask}
        cases[name] = (n, lambda q=q, k=k, v=v, tree=tree: flash_attn_with_kvcache(
            q, k_cache, v_cache, k, v, cache_seqlens=lengths, causal=True, **tree))
    best = best_medians({name: step for name, (_, step) in cases.items()}, rounds=rounds, rep=rep)
    base = best["decode 1 token"]
    rows = []
    for name, (n, _) in cases.items():
        nbytes = 2 * BATCH * (KEYS + n) * H_KV * D * k_cache.element_size()
        flops = 4 * BATCH * H * n * (KEYS + n) * D
        rows.append(dict(case=name, batch=BATCH, cached_keys=KEYS, new_tokens=n, nheads=H, nheads_k=H_KV, head_dim=D,
                         dtype=str(dtype).replace("torch.", ""), us=round(best[name] * 1e3, 2),
                         vs_one_token=round(best[name] / base, 3),
                         kv_gb_per_s=round(nbytes / (best[name] * 1e-3) / 1e9, 1),
                         tflops=round(flops / (best[name] * 1e-3) / 1e12, 1)))
        print(", ".join(f"{key}={value}" for key, value in rows[-1].items()), flush=True)
    return rows


def main(argv=None) -> int:
    return table_main(argv, __doc__, measure, "bench_speculative", rep=50)


if __name__ == "__main__":
    sys.exit(main())
