"""Interleaved A/B of two trees' kernels on the headline shapes: is a change faster, slower, or the same?

    python -m benchmarks.ab --base /path/to/old/checkout --new . --rounds 3 [--quick] [--out DIR]

Each round runs one process per tree, alternating which goes first, and every process imports
`tritonattn` from its tree (the harness, this module and benchmarks.measure, from this one) and times
the same cases on fresh seeded inputs, through the public API only, so trees of any layout compare:

- prefill: flash_attn_func forward and forward + backward, bf16, D = 128, 32 q heads over 32 or 8 KV
  heads, batch x seqlen = 16384 tokens, seqlen 1024 / 4096 / 16384, causal and not (CUDA events,
  L2 flushed before each call);
- decode: one step (append one token, attend) of flash_attn_with_kvcache, dense and paged (P = 16,
  64), bf16, D = 128, 32:8 heads, CUDA-graph replay of 16 steps rotating over input copies;
- chunked: a 2048-token chunk appended to 12288 cached tokens, dense and P = 64;
- host: the CPU time of one eager call, each public entry point: flash_attn_with_kvcache decode
  (batch 1, cache 4096, device lengths), KVCache.decode, flash_attn_func and flash_attn_varlen_func
  forward (batch 1, 128 tokens).

`--host` times the host cases alone and in one process: both trees' kernels are imported side by side
(under other package names) and called in alternating batches of calls, since which core a process
lands on moves host time by more than the few percent a change is judged by.

Per case the median over rounds of each tree, and new / base. Prints the table and writes it with
every process's raw numbers to --out (default: no files). Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Callable, Dict, List

HERE = Path(__file__).resolve().parents[1]  # this checkout: the harness comes from here


HOST_CASES = [dict(kind="host", api="flash_attn_with_kvcache", batch=1, cache_len=4096),
              dict(kind="host", api="KVCache.decode", batch=1, cache_len=4096),
              dict(kind="host", api="flash_attn_func", batch=1, seqlen=128),
              dict(kind="host", api="flash_attn_varlen_func", batch=1, seqlen=128)]


def _cases(quick: bool) -> List[Dict]:
    cases = []
    seqlens = (1024, 16384) if quick else (1024, 4096, 16384)
    for mode in ("fwd", "fwd_bwd"):
        for hk in (32, 8):
            for causal in (False, True):
                for s in seqlens:
                    cases.append(dict(kind="prefill", mode=mode, batch=16384 // s, seqlen=s, nheads_k=hk,
                                      causal=causal))
    shapes = ((1, 4096), (1, 65536), (8, 16384), (128, 1024)) if quick else (
        (1, 1024), (1, 4096), (1, 16384), (1, 65536), (8, 4096), (8, 16384), (32, 4096), (128, 1024), (128, 4096))
    for page in (0, 16, 64):
        for b, n in shapes:
            cases.append(dict(kind="decode", batch=b, cache_len=n, page_size=page))
    for page in (0, 64):
        cases.append(dict(kind="chunked", batch=1, cache_len=12288, chunk=2048, page_size=page))
    return cases + HOST_CASES


def case_name(c: Dict) -> str:
    if c["kind"] == "prefill":
        return (f"prefill {c['mode']} {'MHA' if c['nheads_k'] == 32 else 'GQA'} {'causal' if c['causal'] else 'full'} "
                f"{c['batch']}x{c['seqlen']}")
    if c.get("api"):
        return f"host {c['api']} {c['batch']}x{c.get('cache_len') or c['seqlen']}"
    page = f" P={c['page_size']}" if c.get("page_size") else " dense"
    if c["kind"] == "chunked":
        return f"chunked {c['chunk']} after {c['cache_len']}{page}"
    return f"{c['kind']} {c['batch']}x{c['cache_len']}{page}"


def _measure(cases: List[Dict]) -> Dict[str, float]:
    """Run in a process whose `tritonattn` is the tree under test: ms (host: us) per case."""
    import torch

    from tritonattn import flash_attn_func, flash_attn_with_kvcache

    from . import measure
    from .grids import ChunkedShape, DecodeShape
    from .inputs import chunked_state, dense_state, generator, paged_state, randn

    dev = torch.device("cuda")
    dtype = torch.bfloat16
    out: Dict[str, float] = {}
    for c in cases:
        gen = generator(dev, 0)
        if c.get("api"):
            out[case_name(c)] = measure.host_overhead_us(_host_call(c, dtype, dev, gen), calls=2000)["host_us"]
            continue
        if c["kind"] == "prefill":
            b, s, hk = c["batch"], c["seqlen"], c["nheads_k"]
            q = randn((b, s, 32, 128), dtype, dev, gen)
            k, v = randn((b, s, hk, 128), dtype, dev, gen), randn((b, s, hk, 128), dtype, dev, gen)
            if c["mode"] == "fwd":
                def fn(q=q, k=k, v=v, causal=c["causal"]):
                    return flash_attn_func(q, k, v, causal=causal)
            else:
                leaves = [t.requires_grad_() for t in (q, k, v)]
                dout = torch.randn_like(q)

                def fn(leaves=leaves, dout=dout, causal=c["causal"]):
                    return torch.autograd.grad(flash_attn_func(*leaves, causal=causal), leaves, dout)
            out[case_name(c)] = measure.time_fn(fn, warmup=5, rep=30, flush_l2=True)["median_ms"]
            continue
        if c["kind"] == "chunked":
            shape = ChunkedShape(c["batch"], c["cache_len"], c["chunk"], 32, 8, 128)
            st = chunked_state(shape, dtype, dev, gen, kind="paged" if c["page_size"] else "dense",
                                page_size=c["page_size"])
            table = {"block_table": st.block_table} if c["page_size"] else {}

            def fn(st=st, table=table):
                return flash_attn_with_kvcache(st.q, st.k_cache, st.v_cache, st.k, st.v, cache_seqlens=st.seqlens,
                                               causal=True, **table)
            out[case_name(c)] = measure.time_fn(fn, warmup=5, rep=30, flush_l2=True, hide_host=True)["median_ms"]
            continue
        shape = DecodeShape(c["batch"], c["cache_len"], 32, 8, 128)
        kv_bytes = measure.decode_kv_bytes(shape.batch * shape.cache_len, 8, 128, dtype)
        copies = max(1, min(32, -(-2 * measure.l2_cache_bytes() // kv_bytes)))
        make: Callable = ((lambda g: paged_state(shape, dtype, dev, g, page_size=c["page_size"]))
                          if c["page_size"] else (lambda g: dense_state(shape, dtype, dev, g)))
        states = [make(generator(dev, i)) for i in range(copies)]

        def step(st):
            table = {"block_table": st.block_table} if c["page_size"] else {}
            return flash_attn_with_kvcache(st.q, st.k_cache, st.v_cache, st.k, st.v, cache_seqlens=st.seqlens,
                                           **table)
        repeat = -(-measure.GRAPH_MIN_CALLS // copies)
        out[case_name(c)] = measure.time_cuda_graph(lambda: [step(st) for st in states], rep=100,
                                                    repeat=repeat) / copies
        states = []
        torch.cuda.empty_cache()
    return out


def _host_call(c: Dict, dtype, dev, gen, tritonattn=None) -> Callable:
    """The eager call of a host case with an `api` (its inputs made here), from the package `tritonattn`
    (default: the importable one)."""
    import torch

    from .inputs import randn

    if tritonattn is None:
        import tritonattn

    if c["api"] == "flash_attn_with_kvcache":  # one token appended at a fixed length, device lengths
        k_cache, v_cache = (randn((c["batch"], c["cache_len"], 8, 128), dtype, dev, gen) for _ in range(2))
        q, k, v = (randn((c["batch"], 1, h, 128), dtype, dev, gen) for h in (32, 8, 8))
        lens = torch.full((c["batch"],), c["cache_len"] - 1, dtype=torch.int32, device=dev)
        return lambda: tritonattn.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens)
    if c["api"] == "KVCache.decode":  # back to the prompt every 4,096 steps (the same for both trees)
        cache = tritonattn.KVCache(c["batch"], c["cache_len"] + 4096, 8, 128, dtype=dtype, device=dev)
        prompt = [randn((c["batch"], c["cache_len"], h, 128), dtype, dev, gen) for h in (32, 8, 8)]
        cache.prefill(*prompt)
        q, k, v = (randn((c["batch"], 1, h, 128), dtype, dev, gen) for h in (32, 8, 8))
        steps = [0]

        def decode():
            steps[0] += 1
            if steps[0] % 4096 == 0:
                cache.reset()
                cache.prefill(*prompt)
            return cache.decode(q, k, v)
        return decode
    q = randn((c["batch"] * c["seqlen"], 32, 128), dtype, dev, gen)
    k, v = randn(q.shape[:1] + (8, 128), dtype, dev, gen), randn(q.shape[:1] + (8, 128), dtype, dev, gen)
    if c["api"] == "flash_attn_func":
        q, k, v = (t.view(c["batch"], c["seqlen"], *t.shape[1:]) for t in (q, k, v))
        return lambda: tritonattn.flash_attn_func(q, k, v, causal=True)
    cu = torch.arange(0, c["batch"] + 1, dtype=torch.int32, device=dev) * c["seqlen"]
    return lambda: tritonattn.flash_attn_varlen_func(q, k, v, cu, cu, c["seqlen"], c["seqlen"], causal=True)


def package_dir(tree: str) -> Path:
    """The library's package folder in a checkout: kernels/tritonattn/ (kernels/ itself in trees older than
    the source-root layout, so an A/B can span the move)."""
    nested = Path(tree) / "kernels" / "tritonattn"
    return nested if (nested / "__init__.py").exists() else Path(tree) / "kernels"


def import_tree(tree: str, name: str):
    """tree's package imported as `name` (its modules import each other relatively)."""
    import importlib.util

    init = package_dir(tree) / "__init__.py"
    spec = importlib.util.spec_from_file_location(name, init, submodule_search_locations=[str(init.parent)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _host_ab(trees: Dict[str, str], rounds: int, batches: int = 20, calls: int = 500) -> Dict[str, List[Dict]]:
    """Both trees' host cases in this process, alternating batches of `calls` calls (`batches` per
    tree per round); per round and tree, the median over its batches of host_overhead_us's median."""
    import torch

    from . import measure
    from .inputs import generator

    dev, dtype = torch.device("cuda"), torch.bfloat16
    packages = {which: import_tree(tree, f"tritonattn_ab_{which}") for which, tree in trees.items()}
    fns = {(which, case_name(c)): _host_call(c, dtype, dev, generator(dev, 0), packages[which])
           for c in HOST_CASES for which in trees}
    runs: Dict[str, List[Dict]] = {which: [] for which in trees}
    for r in range(rounds):
        samples: Dict[tuple, list] = {key: [] for key in fns}
        for b in range(batches):
            for name in (case_name(c) for c in HOST_CASES):
                order = ("base", "new") if (r + b) % 2 == 0 else ("new", "base")
                for which in order:
                    samples[(which, name)].append(
                        measure.host_overhead_us(fns[(which, name)], calls=calls, warmup=5)["host_us"])
        for which in trees:
            runs[which].append({name: statistics.median(samples[(which, name)])
                                for name in (case_name(c) for c in HOST_CASES)})
    return runs


def _worker(tree: str, quick: bool) -> int:
    tritonattn = import_tree(tree, "tritonattn")  # this tree's package; benchmarks is the harness's checkout
    if Path(tritonattn.__file__).resolve().parent != package_dir(tree).resolve():
        raise RuntimeError(f"imported {tritonattn.__file__}, not the package of {tree}")
    print("AB-RESULT " + json.dumps(_measure(_cases(quick))), flush=True)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.ab", description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="checkout whose library is the baseline")
    ap.add_argument("--new", default=str(HERE), help="checkout whose library is measured against it")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="fewer shapes")
    ap.add_argument("--host", action="store_true", help="the host cases only, both trees in one process")
    ap.add_argument("--out", default=None, help="folder for ab.json (raw numbers) and ab.txt (the table)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return _worker(args.worker, args.quick)
    trees = {"base": str(Path(args.base).resolve()), "new": str(Path(args.new).resolve())}
    runs: Dict[str, List[Dict[str, float]]] = {"base": [], "new": []}
    if args.host:
        runs = _host_ab(trees, args.rounds)
    else:
        for r in range(args.rounds):
            order = ("base", "new") if r % 2 == 0 else ("new", "base")
            for which in order:
                cmd = [sys.executable, "-m", "benchmarks.ab", "--base", trees["base"], "--worker", trees[which]]
                cmd += ["--quick"] if args.quick else []
                proc = subprocess.run(cmd, cwd=HERE, capture_output=True, text=True)
                lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("AB-RESULT ")]
                if proc.returncode or not lines:
                    print(proc.stdout[-3000:], proc.stderr[-3000:], file=sys.stderr)
                    raise RuntimeError(f"{which} worker failed (round {r})")
                runs[which].append(json.loads(lines[-1][len("AB-RESULT "):]))
                print(f"round {r} {which} done", flush=True)
    rows = []
    for name in runs["base"][0]:
        base = statistics.median(run[name] for run in runs["base"])
        new = statistics.median(run[name] for run in runs["new"])
        spread = max(run[name] for run in runs["base"]) / min(run[name] for run in runs["base"]) - 1
        rows.append((name, base, new, new / base, spread))
    unit = lambda name: "us" if name.startswith("host") else "ms"  # noqa: E731
    import datetime

    import torch
    import triton

    env = (f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
           f"{datetime.date.today().isoformat()}; base {trees['base']}, new {trees['new']}; {args.rounds} rounds, "
           f"median per tree; base spread = max / min - 1 over the base rounds")
    lines = [env, f"{'case':<44} {'base':>10} {'new':>10} {'new/base':>9} {'base spread':>12}"]
    for name, base, new, ratio, spread in rows:
        lines.append(f"{name:<44} {base:>8.4f}{unit(name):>2} {new:>8.4f}{unit(name):>2} {ratio:>9.3f} {spread:>11.1%}")
    ratios = [r[3] for r in rows]
    lines.append(f"new/base over {len(rows)} cases: median {statistics.median(ratios):.3f}, "
                 f"min {min(ratios):.3f}, max {max(ratios):.3f}")
    text = "\n".join(lines)
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "ab.txt").write_text(text + "\n")
        (out / "ab.json").write_text(json.dumps({"trees": trees, "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
