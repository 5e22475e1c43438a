"""Context-parallel attention (tritonattn.parallel) against the ideal: every layout's time and fraction of ideal,
forward and forward + backward, on however many GPUs this machine has.

Each rank holds `--tokens` tokens of one sequence (batch 1, 32 query / 8 KV heads, head dim 128, bf16, causal by
default): the whole sequence is world x tokens long. Ideal = the single-GPU time of the whole sequence
(`flash_attn_func`, the dispatcher's fastest kernel) divided by the world size; fraction = ideal / measured, the
slowest rank's time. Every rank runs the same timed loop (a barrier, then CUDA events around each call; the
median of `--rep` calls, the maximum over ranks), so no rank waits on another's timing choices. With one GPU
(or `--world 1`) the layouts run over a one-rank NCCL group: the fraction then measures what the machinery costs
(float32 partials, the LSE merge, the gather or the ring's empty transfers), not the scaling; the run says so.
Launched plainly it spawns one process per GPU (NCCL; NVLink multicast off); under torchrun it joins the group.
Rows go to results/<gpu>/bench_context_parallel.csv, or results/<gpu>-x<N>/ for N GPUs:

    python -m benchmarks.context_parallel [--tokens 4096,8192,16384,32768,65536] [--world N] [--not-causal]
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import statistics
import sys

import torch
import torch.distributed as dist

H, H_KV, D = 32, 8, 128
LAYOUTS = ("ring", "zigzag", "stripe", "llama3")


def _timed(fn, rep: int, warmup: int = 2) -> float:
    """Median ms of `rep` calls of fn on this rank, the maximum over ranks (every rank runs the same loop)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(rep):
        dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    median = torch.tensor([statistics.median(times)], device="cuda")
    dist.all_reduce(median, op=dist.ReduceOp.MAX)
    return float(median.item())


def _layout_call(layout: str, q, k, v, causal: bool, rank: int, world: int):
    """The forward of a layout on this rank's shards (cut from the whole-sequence q, k, v), as a thunk."""
    import tritonattn.parallel as cp

    if layout == "llama3":
        n = q.shape[1]
        cu = torch.tensor([0, n], dtype=torch.int32, device=q.device)
        cu_q, cu_k, max_q, max_k, k_slice = cp.llama3_flash_attn_prepare_cu_seqlens(cu, causal, rank, world)
        qs, ks, vs = (cp.shard_llama3(t[0], rank, world).detach().clone().requires_grad_() for t in (q, k, v))
        return lambda: cp.llama3_flash_attn_varlen_func(qs, ks, vs, cu_q, cu_k, max_q, max_k, 1,
                                                                        k_slice, causal=causal)
    qs, ks, vs = (cp.shard(t, layout, rank, world).detach().clone().requires_grad_() for t in (q, k, v))
    return lambda: cp.context_parallel_attention(qs, ks, vs, causal=causal, layout=layout)


def _rank_main(rank: int, world: int, port: int, args) -> None:
    from tritonattn import flash_attn_func

    from .measure import attention_flops
    from .results import make_row, write_csv

    torch.cuda.set_device(rank % torch.cuda.device_count())
    if not dist.is_initialized():
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=300))
    rows = []
    for tokens in args.tokens:
        n = tokens * world
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(1, n, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
        k, v = (torch.randn(1, n, H_KV, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
        dout = torch.randn_like(q)
        whole = [t.clone().requires_grad_() for t in (q, k, v)]
        single = {"fwd": _timed(lambda: flash_attn_func(*whole, causal=args.causal), args.rep),
                  "fwd_bwd": _timed(lambda: flash_attn_func(*whole, causal=args.causal).backward(dout), args.rep)}
        for layout in LAYOUTS:
            call = _layout_call(layout, q, k, v, args.causal, rank, world)
            d_local = torch.randn_like(call())
            times = {"fwd": _timed(call, args.rep), "fwd_bwd": _timed(lambda: call().backward(d_local), args.rep)}
            for mode, ms in times.items():
                ideal = single[mode] / world
                flops = attention_flops(1, H, n, n, D, causal=args.causal, mode=mode)
                rows.append(dict(layout=layout, mode=mode, world=world, tokens_per_gpu=tokens, seqlen=n,
                                 causal=args.causal, nheads=H, nheads_k=H_KV, head_dim=D, dtype="bfloat16",
                                 ms=round(ms, 3), single_gpu_ms=round(single[mode], 3), ideal_ms=round(ideal, 3),
                                 fraction_of_ideal=round(ideal / ms, 3),
                                 tflops_per_gpu=round(flops / world / (ms * 1e-3) / 1e12, 1)))
                if rank == 0:
                    print(", ".join(f"{key}={value}" for key, value in rows[-1].items()), flush=True)
        whole = call = q = k = v = dout = None  # freed before the next length
        torch.cuda.empty_cache()
    if rank == 0 and not args.no_write:
        stamped = [make_row(**row) for row in rows]
        if world > 1:
            for row in stamped:
                row["gpu"] = f"{row['gpu']} x{world}"
        print("wrote", write_csv(stamped, "bench_context_parallel", args.out))
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="4096,8192,16384,32768,65536",
                   type=lambda s: [int(x) for x in s.split(",")], help="tokens per GPU, comma-separated")
    p.add_argument("--world", type=int, default=0, help="ranks (default: every GPU)")
    p.add_argument("--not-causal", dest="causal", action="store_false")
    p.add_argument("--rep", type=int, default=10)
    p.add_argument("--out", default="results")
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # no NVLink multicast (a shared host's GPUs)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun
        dist.init_process_group("nccl")
        _rank_main(dist.get_rank(), dist.get_world_size(), 0, args)
        return 0
    gpus = torch.cuda.device_count()
    world = args.world or gpus
    if world > gpus:
        print(f"--world {world} needs {world} GPUs; this machine has {gpus}")
        return 2
    if world == 1:
        print(f"world size 1: this machine has {gpus} GPU(s){'' if gpus == 1 else ' (--world 1 asked for one)'}; the "
              f"layouts run over a one-rank NCCL group, so the fractions show the context-parallel machinery's "
              f"cost against flash_attn_func on the same tokens, not scaling (that needs 2 or more GPUs).",
              flush=True)
        _rank_main(0, 1, _free_port(), args)
        return 0
    torch.multiprocessing.spawn(_rank_main, args=(world, _free_port(), args), nprocs=world)
    return 0


if __name__ == "__main__":
    sys.exit(main())
