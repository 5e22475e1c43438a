"""Where paged decode's residual cost over dense decode comes from: page order, pool placement, L2 rotation.

One decode step (bf16, 32 q / 8 KV heads, D = 128, one new token appended, L_b = n - 1), timed by
CUDA-graph replay, GRAPH_MIN_CALLS steps per graph rotating over `copies` copies of the state, every
variant's graph replayed in turn, round after round (interleaved), the fastest round kept. Variants:

- dense A / dense B: two separately allocated dense caches (placement);
- P<page> <order> <pool>: a pool of batch * n / page pages read through a block table whose order is
  random (the benchmark suite's: a permutation of the whole pool), sorted (the dense layout), or
  w<W> (random inside each run of W consecutive physical blocks: locality at W * page rows); the
  orders of one pool letter read the very same tensors, so they differ by order alone, while pools A
  and B differ by placement alone.

Rotation: copies=rule is the suite's (enough copies to exceed twice the L2); copies=8 rotates 8.

    python -m benchmarks.paged_locality --out results/nvidia-h200 --tag locality

Prints one line per (shape, copies) and appends them to <out>/paged_locality_<tag>.log.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from types import SimpleNamespace

import torch

from tritonattn import flash_attn_with_kvcache
from tritonattn.testing import attention_ref, rel_err

from .inputs import random_block_table
from .measure import GRAPH_MIN_CALLS, capture_graph, decode_kv_bytes, l2_cache_bytes, replay_median_ms
from .suite import decode_keys

H, HK, D = 32, 8, 128
DTYPE = torch.bfloat16


def block_table(pages: int, order: str, seed: int) -> torch.Tensor:
    """(1, pages) int32 over a pool of `pages` blocks: random (the suite's table), sorted or random within
    windows of W."""
    if order == "random":
        return random_block_table(1, pages, seed, "cuda")
    if order == "sorted":
        table = torch.arange(pages)
    else:
        window = int(order[1:])
        assert pages % window == 0, (pages, window)
        gen = torch.Generator()
        gen.manual_seed(seed)
        base = torch.arange(0, pages, window)[:, None]
        table = torch.stack([torch.randperm(window, generator=gen) for _ in range(pages // window)]) + base
    return table.reshape(1, pages).to(torch.int32).cuda()


def new_step(n: int, page: int, gen: torch.Generator):
    """Tensors of one step: q, k, v (one new token) and the cache (page 0: dense (1, n, HK, D))."""
    q = torch.randn(1, 1, H, D, device="cuda", dtype=DTYPE, generator=gen)
    k = torch.randn(1, 1, HK, D, device="cuda", dtype=DTYPE, generator=gen)
    v = torch.randn(1, 1, HK, D, device="cuda", dtype=DTYPE, generator=gen)
    shape = (1, n, HK, D) if page == 0 else (n // page, page, HK, D)
    kc = torch.randn(*shape, device="cuda", dtype=DTYPE, generator=gen)
    vc = torch.randn(*shape, device="cuda", dtype=DTYPE, generator=gen)
    return q, k, v, kc, vc


def check(step, q, kc, vc, table, n: int) -> float:
    """Rel err of one step against attention_ref over the request's n - 1 cached keys + the new one."""
    out = step()
    state = SimpleNamespace(cache_len=n - 1, k_cache=kc, v_cache=vc)
    if table is not None:
        state.block_table = table
    keys, vals = decode_keys(state, 0)
    ref, _ = attention_ref(q, keys, vals, causal=False)
    return rel_err(out, ref)


def graph_of(steps):
    """One graph of GRAPH_MIN_CALLS steps (whole rotations of the copies) and its call count."""
    repeat = -(-GRAPH_MIN_CALLS // len(steps))
    return capture_graph(lambda: [s() for s in steps], repeat), repeat * len(steps)


def measure(n: int, copies: int, pages_sizes, orders, rounds: int, rep: int, seed: int) -> str:
    gen = torch.Generator(device="cuda")
    gen.manual_seed(seed)
    seqlens = torch.full((1,), n - 1, dtype=torch.int32, device="cuda")
    variants = {}  # name -> (graph, calls)
    errs = {}
    alive = []  # the graphs read these tensors: keep them allocated until the graphs are done

    def add(name, states, table):
        steps = []
        for (q, k, v, kc, vc) in states:
            steps.append(lambda q=q, k=k, v=v, kc=kc, vc=vc: flash_attn_with_kvcache(
                q, kc, vc, k, v, cache_seqlens=seqlens, block_table=table))
        q, _, _, kc, vc = states[0]
        # the check appends row n - 1 once more; the cache keeps n - 1 valid rows + the new one
        errs[name] = check(steps[0], q, kc, vc, table, n)
        variants[name] = graph_of(steps)
        alive.append((states, table))

    for pool in "AB":
        add(f"dense{pool}", [new_step(n, 0, gen) for _ in range(copies)], None)
    for page in pages_sizes:
        for pool in "AB":
            states = [new_step(n, page, gen) for _ in range(copies)]
            for order in orders if pool == "A" else ["random"]:
                if order.startswith("w") and (n // page) % int(order[1:]):
                    continue
                add(f"P{page}_{order}_{pool}", states, block_table(n // page, order, seed + page))
    best = {name: math.inf for name in variants}
    for _ in range(rounds):
        for name, (graph, calls) in variants.items():
            best[name] = min(best[name], replay_median_ms(graph, rep) * 1e3 / calls)
    dense = min(best["denseA"], best["denseB"])
    bad = [f"{k}={e:.1e}" for k, e in errs.items() if not e < 2e-2]
    parts = [f"{k}={t:.2f}({t / dense:.3f})" for k, t in best.items()]
    return (f"n={n} copies={copies} " + " ".join(parts) + (f" WRONG {bad}" if bad else "")
            + f" maxerr={max(errs.values()):.1e}")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--tag", default="run")
    p.add_argument("--lens", default="16384,65536")
    p.add_argument("--copies", default="rule,8")
    p.add_argument("--pages", default="16,64")
    p.add_argument("--orders", default="random,sorted,w4,w64,w256")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--rep", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--label", default="")
    a = p.parse_args()
    lines = []
    for n in (int(x) for x in a.lens.split(",")):
        kv = decode_kv_bytes(n, HK, D, DTYPE)
        for c in a.copies.split(","):
            copies = max(1, math.ceil(2 * l2_cache_bytes(0) / kv)) if c == "rule" else int(c)
            line = a.label + measure(n, copies, [int(x) for x in a.pages.split(",")], a.orders.split(","),
                                     a.rounds, a.rep, a.seed)
            print(line, flush=True)
            lines.append(line)
            torch.cuda.empty_cache()
    if a.out:
        with open(os.path.join(a.out, f"paged_locality_{a.tag}.log"), "a") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
