"""Measuring: FLOP and byte models, GPU timing (CUDA events, CUDA-graph replay, host overhead), peak
memory and the device's ceilings (bf16 matmul TFLOP/s, copy and read GB/s).

Measure, store and plot are separate steps: this module times a callable, benchmarks/results.py
stamps the numbers with the GPU, versions, date and git commit and stores them as CSV, and
benchmarks/report.py plots them. The models follow the FlashAttention / Triton tutorial conventions:
forward FLOPs 4*B*H*M*N*D (two matmuls), half of that when causal, 2.5x for the backward; decode is
judged by K/V bytes read per second.

Importing this module needs no GPU and queries no device; the timing functions raise a RuntimeError
without one.
"""

from __future__ import annotations

import argparse
import functools
import math
import time
from typing import Any, Callable, Dict, Hashable, Iterable, List, Mapping, Optional, Sequence, Union

import torch
import triton
import triton.language as tl

from tritonattn import has_gpu  # the public name: the harness also runs against other trees (benchmarks.ab)

from .results import Row, make_row, write_csv

_MODE_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}


# --------------------------------------------------------------------------------------------
# FLOP and byte models
# --------------------------------------------------------------------------------------------
def causal_pairs(seqlen_q: int, seqlen_k: int) -> int:
    """Number of visible (i, j) pairs under the bottom-right causal mask j <= i + seqlen_k - seqlen_q."""
    # Row i sees clamp(i + N - M + 1, 0, N) keys; the last row sees exactly N, so the visible rows
    # see the min(M, N) consecutive counts ending at N.
    t = min(seqlen_q, seqlen_k)
    return t * (2 * seqlen_k - t + 1) // 2


def attention_flops(
    batch: int,
    nheads: int,
    seqlen_q: int,
    seqlen_k: int,
    head_dim: int,
    causal: bool,
    mode: str = "fwd",
) -> float:
    """Attention FLOPs: 4*B*H*M*N*D, halved when causal (exact visible pairs if M != N), x2.5 bwd, x3.5 fwd_bwd."""
    if mode not in _MODE_FACTOR:
        raise ValueError(f"Expected mode to be one of {sorted(_MODE_FACTOR)}, got {mode!r}.")
    sizes = {"batch": batch, "nheads": nheads, "seqlen_q": seqlen_q, "seqlen_k": seqlen_k, "head_dim": head_dim}
    for name, value in sizes.items():
        if int(value) != value or value < 0:
            raise ValueError(f"Expected {name} to be a non-negative integer, got {value!r}.")
    if not causal:
        pairs = seqlen_q * seqlen_k
    elif seqlen_q == seqlen_k:
        pairs = seqlen_q * seqlen_k / 2  # the published convention (FlashAttention, Triton tutorial 06)
    else:
        pairs = causal_pairs(seqlen_q, seqlen_k)
    return 4.0 * batch * nheads * head_dim * pairs * _MODE_FACTOR[mode]


def decode_kv_bytes(
    cache_seqlens_total_tokens: Union[int, Sequence[int], torch.Tensor],
    nheads_k: int,
    head_dim: int,
    dtype: torch.dtype,
) -> int:
    """K+V bytes a decode step reads: 2 * tokens * nheads_k * head_dim * itemsize (tokens summed over the batch)."""
    if isinstance(cache_seqlens_total_tokens, torch.Tensor):
        tokens = int(cache_seqlens_total_tokens.sum().item())
    elif isinstance(cache_seqlens_total_tokens, (list, tuple)):
        tokens = int(sum(cache_seqlens_total_tokens))
    else:
        tokens = int(cache_seqlens_total_tokens)
    if tokens < 0:
        raise ValueError(f"Expected a non-negative number of cached tokens, got {tokens}.")
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * tokens * nheads_k * head_dim * itemsize


# Ceilings of an NVIDIA H200 as measured by the benchmark suite (results/nvidia-h200/bench_ceilings.csv,
# two runs on 2026-12-01: bf16 8192^3 matmul on random data 784-792 TFLOP/s, device copy 4.24-4.26
# TB/s counting bytes read and written, read-only stream 4.48-4.57 TB/s). The datasheet says 4.8 TB/s
# and about 990 TFLOP/s dense bf16. For plots made without a GPU; on a GPU, prefer `ceilings()`
# measured in the same run.
H200_MEASURED_CEILINGS: Dict[str, Any] = {
    "gpu": "NVIDIA H200",
    "matmul_tflops": 788.0,
    "copy_gbps": 4254.0,
    "read_gbps": 4523.0,
    "source": "results/nvidia-h200/bench_ceilings.csv (2026-12-01, means of two runs: bf16 8192^3 matmul "
    "784-792 TFLOP/s, device copy 4.24-4.26 TB/s read+write, read-only stream 4.48-4.57 TB/s)",
}


def decode_roofline(
    batch: int,
    nheads: int,
    nheads_k: int,
    head_dim: int,
    dtype: torch.dtype,
    cache_lens: Iterable[int],
    *,
    peak_tflops: float,
    bandwidth_gbps: float,
    seqlen_q: int = 1,
) -> List[Row]:
    """Roofline of one decode step per cache length: FLOPs, K+V bytes, intensity and both time floors.

    One row per cache length N (keys per request): flops = attention_flops(batch, nheads, seqlen_q,
    N, head_dim, causal=False) (= 4*B*H*M*N*D), kv_bytes = decode_kv_bytes(B*N, ...), bytes_per_flop,
    flop_per_byte (arithmetic intensity; = H / H_KV * M for 2-byte dtypes), ridge_flop_per_byte
    (peak FLOP/s / bandwidth: below it a kernel cannot be compute bound), t_compute_us and
    t_memory_us (the time floors at the given peak and bandwidth), and bound ("memory" or "compute").
    Only K/V bytes are counted: q and the output are B*M*H*D elements each, negligible next to the cache.
    """
    if peak_tflops <= 0 or bandwidth_gbps <= 0:
        raise ValueError(f"Expected positive ceilings, got peak_tflops={peak_tflops}, bandwidth_gbps={bandwidth_gbps}.")
    ridge = peak_tflops * 1e12 / (bandwidth_gbps * 1e9)
    rows: List[Row] = []
    for n in cache_lens:
        flops = attention_flops(batch, nheads, seqlen_q, n, head_dim, causal=False)
        nbytes = decode_kv_bytes(batch * n, nheads_k, head_dim, dtype)
        t_compute = flops / (peak_tflops * 1e12) * 1e6
        t_memory = nbytes / (bandwidth_gbps * 1e9) * 1e6
        rows.append({
            "batch": batch, "cache_len": n, "nheads": nheads, "nheads_k": nheads_k, "head_dim": head_dim,
            "seqlen_q": seqlen_q, "flops": flops, "kv_bytes": nbytes, "bytes_per_flop": nbytes / flops,
            "flop_per_byte": flops / nbytes, "ridge_flop_per_byte": ridge, "t_compute_us": t_compute,
            "t_memory_us": t_memory, "bound": "memory" if t_memory >= t_compute else "compute",
        })
    return rows


def tflops(flops: float, ms: float) -> float:
    """TFLOP/s from a FLOP count and a time in milliseconds."""
    return flops / (ms * 1e-3) / 1e12


def gbps(nbytes: float, ms: float) -> float:
    """GB/s (1e9 bytes) from a byte count and a time in milliseconds."""
    return nbytes / (ms * 1e-3) / 1e9


# --------------------------------------------------------------------------------------------
# Timing (CUDA only)
# --------------------------------------------------------------------------------------------
def require_gpu(what: str) -> None:
    """Raise a RuntimeError naming `what` when no CUDA device is usable."""
    if not has_gpu():
        raise RuntimeError(
            f"{what} needs a CUDA GPU (it times with CUDA events), but torch.cuda.is_available() is False. "
            "Run benchmarks on a GPU machine; on the CPU only correctness checks and plots of results/ work."
        )


def _quantile(sorted_values: List[float], q: float) -> float:
    """Linear-interpolated quantile of an ascending list (numpy's default method)."""
    pos = (len(sorted_values) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def _summary(times_ms: List[float]) -> Dict[str, float]:
    """median / p20 / p80 / min of a list of times in ms."""
    values = sorted(times_ms)
    return {
        "median_ms": _quantile(values, 0.5),
        "p20_ms": _quantile(values, 0.2),
        "p80_ms": _quantile(values, 0.8),
        "min_ms": values[0],
    }


@functools.lru_cache(maxsize=None)
def l2_cache_bytes(index: int = 0) -> int:
    """L2 cache size of CUDA device `index` in bytes (60 MB on an H200); 64 MiB if torch does not say."""
    props = torch.cuda.get_device_properties(index)
    return int(getattr(props, "L2_cache_size", 0) or 64 * 2**20)


_FLUSH_BUFFERS: Dict[int, torch.Tensor] = {}


def _l2_flush_buffer() -> torch.Tensor:
    """A buffer of twice the L2 size on the current device; zeroing it evicts whatever L2 held."""
    index = torch.cuda.current_device()
    if index not in _FLUSH_BUFFERS:
        _FLUSH_BUFFERS[index] = torch.empty(2 * l2_cache_bytes(index), dtype=torch.int8, device=f"cuda:{index}")
    return _FLUSH_BUFFERS[index]


# time_fn(hide_host=True): GPU clock cycles slept before each timed call, ~0.5 ms at an H200's 1.98 GHz.
# A call whose host work takes longer leaks the excess back into its timing; the chunked suite's calls
# take at most ~0.2 ms on the host (their eager timings on an H200 before this option existed).
HIDE_HOST_CYCLES = 1_000_000


def time_fn(
    fn: Callable[..., Any],
    *,
    warmup: int = 10,
    rep: int = 50,
    rotate: Optional[Sequence[tuple]] = None,
    flush_l2: bool = False,
    hide_host: bool = False,
) -> Dict[str, float]:
    """Time fn with CUDA events per call after `warmup` calls; returns median_ms, p20_ms, p80_ms, min_ms.

    rotate: argument tuples cycled through call by call (fn(*args)), so that small shapes do not run
    from a warm L2; without it fn is called with no arguments.
    flush_l2: zero a buffer of twice the L2 size before each call, outside the timed events (Triton's
    do_bench does the same), so that no call finds its inputs in L2.
    hide_host: before each call's start event, keep the GPU busy for HIDE_HOST_CYCLES clock cycles
    (`torch.cuda._sleep`), so the host's work for the call (wrapper, launches) runs while the GPU
    still sleeps and the events time the GPU work alone. Without it a call whose GPU time is
    shorter than its host time is timed as its host time (the GPU idles between the events until
    the launches arrive). Use it to compare kernels, not to report what an eager caller waits.
    """
    require_gpu("time_fn")
    if rep < 1 or warmup < 0:
        raise ValueError(f"Expected rep >= 1 and warmup >= 0, got rep={rep}, warmup={warmup}.")
    arg_sets = [tuple(a) for a in rotate] if rotate is not None else [()]
    if not arg_sets:
        raise ValueError("Expected rotate to hold at least one argument tuple, got an empty sequence.")
    flush = _l2_flush_buffer() if flush_l2 else None
    for i in range(warmup):
        if flush is not None:
            flush.zero_()
        fn(*arg_sets[i % len(arg_sets)])
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(rep)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(rep)]
    sleep = getattr(torch.cuda, "_sleep", None) if hide_host else None
    if hide_host and sleep is None:
        raise RuntimeError("time_fn(hide_host=True) needs torch.cuda._sleep, which this PyTorch lacks.")
    for i in range(rep):
        args = arg_sets[(warmup + i) % len(arg_sets)]
        if flush is not None:
            flush.zero_()  # enqueued before the start event: evicts L2 without being timed
        if sleep is not None:
            sleep(HIDE_HOST_CYCLES)  # the GPU waits here while the host prepares fn's launches
        starts[i].record()
        fn(*args)
        ends[i].record()
    torch.cuda.synchronize()
    return _summary([s.elapsed_time(e) for s, e in zip(starts, ends)])


def wall_us(fn: Callable[[], Any], steps: int = 1, before: Optional[Callable[[], Any]] = None) -> float:
    """Mean wall time per call of `steps` calls, CUDA-synchronised, host included (before: run untimed
    first): what a whole model step or `generate` costs its caller."""
    if before is not None:
        before()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps * 1e6


def host_overhead_us(fn: Callable[[], Any], *, calls: int = 300, warmup: int = 20) -> Dict[str, float]:
    """CPU wall time of one fn() call without synchronising (wrapper + launches), in microseconds.

    The GPU is synchronised only before and after the loop, so each sample is what the Python caller
    waits for before it can issue its next call. Returns host_us (median), host_p20_us, host_p80_us.
    Meaningful for calls whose GPU time is shorter than their host time (small decode steps);
    otherwise the launch queue fills and the samples include waiting for it.
    """
    require_gpu("host_overhead_us")
    if calls < 1 or warmup < 0:
        raise ValueError(f"Expected calls >= 1 and warmup >= 0, got calls={calls}, warmup={warmup}.")
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    values = sorted(samples)
    return {"host_us": _quantile(values, 0.5), "host_p20_us": _quantile(values, 0.2),
            "host_p80_us": _quantile(values, 0.8)}


GRAPH_MIN_CALLS = 16  # decode steps per captured graph in the suite and notebooks: one replay's launch is shared


GRAPH_TIMED = False  # whether this process has timed a CUDA graph yet (see time_cuda_graph)


def time_cuda_graph(fn: Callable[[], Any], *, rep: int = 100, repeat: int = 1) -> float:
    """Capture fn() `repeat` times back to back in one CUDA graph; return the median ms per fn() call
    (graph replay time / repeat).

    The host's launch cost is excluded; what each replay still pays once, the graph launch latency
    on the device (a few microseconds), is spread over the `repeat` calls, as the per-layer kernels
    of a captured decode step share one replay. Rotate over enough input copies inside fn that
    consecutive calls do not find their data in L2.

    The first graph timing of a process is measured twice and the first result dropped: on an H200
    it read about 0.35 us (5%) fast for a 6.8-us decode step, whichever kernel came first, and never
    again in that process (docs/perf-notes.md, "Measurement method").
    """
    global GRAPH_TIMED
    require_gpu("time_cuda_graph")
    if rep < 1 or repeat < 1:
        raise ValueError(f"Expected rep >= 1 and repeat >= 1, got rep={rep}, repeat={repeat}.")
    if not GRAPH_TIMED:
        graph_median_ms(fn, rep, repeat)
        GRAPH_TIMED = True
    return graph_median_ms(fn, rep, repeat) / repeat


def graph_median_ms(fn: Callable[[], Any], rep: int, repeat: int) -> float:
    """Median ms of `rep` replays of one graph holding `repeat` calls of fn (see time_cuda_graph)."""
    graph = capture_graph(fn, repeat)
    median = replay_median_ms(graph, rep)
    del graph
    return median


def capture_graph(fn: Callable[[], Any], repeat: int = 1) -> "torch.cuda.CUDAGraph":
    """One CUDA graph holding `repeat` calls of fn, after 3 warm-up calls on a side stream (they compile
    Triton kernels and settle the allocator's pools). The caller keeps fn's inputs alive while the
    graph lives."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeat):
            fn()
    return graph


def replay_median_ms(graph: "torch.cuda.CUDAGraph", rep: int) -> float:
    """Median ms of `rep` replays of a captured graph, after 3 untimed ones."""
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(rep)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(rep)]
    for i in range(rep):
        starts[i].record()
        graph.replay()
        ends[i].record()
    torch.cuda.synchronize()
    return _summary([s.elapsed_time(e) for s, e in zip(starts, ends)])["median_ms"]


def peak_memory_delta(fn: Callable[[], Any]) -> int:
    """Bytes allocated at the peak of fn() beyond what was allocated before it (CUDA caching allocator)."""
    require_gpu("peak_memory_delta")
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return int(torch.cuda.max_memory_allocated() - before)


def _matmul_tflops(n: int) -> float:
    """bf16 n x n x n matmul TFLOP/s on random data (median of CUDA-event timings)."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    c = torch.empty(n, n, device="cuda", dtype=torch.bfloat16)
    ms = time_fn(lambda: torch.mm(a, b, out=c), warmup=5, rep=30)["median_ms"]
    return tflops(2.0 * n**3, ms)


def _copy_gbps(gib: float) -> float:
    """Device-to-device copy GB/s of a `gib` GiB buffer, counting the read and the write."""
    src = torch.empty(int(gib * 2**30) // 4, device="cuda", dtype=torch.float32).uniform_()
    dst = torch.empty_like(src)
    ms = time_fn(lambda: dst.copy_(src), warmup=3, rep=20)["median_ms"]
    return gbps(2 * src.numel() * src.element_size(), ms)


STREAM_BLOCK, STREAM_ITERS = 4096, 16  # elements per load, loads per program (128 KiB of bf16 per program)


@triton.jit
def _stream_read_kernel(X, Partial, n_elements, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    """Read-only streaming: program p sums elements [p * BLOCK * ITERS, (p + 1) * BLOCK * ITERS) of X."""
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * (BLOCK * ITERS) + tl.arange(0, BLOCK)  # [BLOCK]
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(ITERS):
        cur = offs + i * BLOCK
        acc += tl.load(X + cur, mask=cur < n_elements, other=0.0).to(tl.float32)
    tl.store(Partial + pid, tl.sum(acc, axis=0))


def stream_read(x: torch.Tensor, partial: Optional[torch.Tensor] = None, *, block: int = STREAM_BLOCK,
                iters: int = STREAM_ITERS) -> torch.Tensor:
    """Read every element of the contiguous tensor x once and return per-program fp32 partial sums.

    The read-only bandwidth probe of `ceilings()` (the sum keeps the loads alive); partial.sum() is
    x.sum(). Each program reads `iters` consecutive blocks of `block` elements. Runs under the
    interpreter too (CPU tensors), which is how the CPU tests check it.
    """
    if not x.is_contiguous():
        raise ValueError("stream_read expects a contiguous tensor; call .contiguous() first.")
    n = x.numel()
    programs = max(1, triton.cdiv(n, block * iters))
    if partial is None:
        partial = torch.empty(programs, dtype=torch.float32, device=x.device)
    _stream_read_kernel[(programs,)](x, partial, n, BLOCK=block, ITERS=iters, num_warps=8)
    return partial


def _read_gbps(gib: float) -> float:
    """Read-only streaming GB/s over a `gib` GiB bf16 buffer: the larger of a Triton read kernel
    (stream_read) and torch.sum with fp32 accumulation."""
    x = torch.empty(int(gib * 2**30) // 2, device="cuda", dtype=torch.bfloat16).uniform_()
    partial = torch.empty(triton.cdiv(x.numel(), STREAM_BLOCK * STREAM_ITERS), device="cuda", dtype=torch.float32)
    nbytes = x.numel() * x.element_size()
    triton_ms = time_fn(lambda: stream_read(x, partial), warmup=3, rep=20)["median_ms"]
    torch_ms = time_fn(lambda: torch.sum(x, dtype=torch.float32), warmup=3, rep=20)["median_ms"]
    return gbps(nbytes, min(triton_ms, torch_ms))


def ceilings(*, matmul_n: int = 8192, copy_gib: float = 2.0) -> Dict[str, float]:
    """Measured roofs of this GPU: bf16 matmul TFLOP/s (n^3, random data), device copy GB/s (read+write),
    read-only streaming GB/s (read_gbps), and bandwidth_gbps = the larger of the two bandwidths."""
    require_gpu("ceilings")
    result = {"matmul_tflops": _matmul_tflops(matmul_n), "copy_gbps": _copy_gbps(copy_gib),
              "read_gbps": _read_gbps(copy_gib)}
    result["bandwidth_gbps"] = max(result["copy_gbps"], result["read_gbps"])
    torch.cuda.empty_cache()
    return result


def best_medians(steps: Mapping[Hashable, Union[Callable[[], Any], Sequence[Callable[[], Any]]]], *, rounds: int,
                 rep: int, timer: Optional[Callable[..., Dict[str, float]]] = None) -> Dict[Hashable, float]:
    """The one-table benchmarks' timing: per key, the best over `rounds` of its `time_fn` median (ms, L2 flushed,
    host hidden), every key timed once per round (interleaved, so a slow spell of the card hits all cases
    alike). A key may hold a sequence of calls, whose medians add up to its time. `timer`: time_fn's stand-in
    (tests)."""
    timer = timer or time_fn
    best = {key: math.inf for key in steps}
    for _ in range(rounds):
        for key, calls in steps.items():
            calls = (calls,) if callable(calls) else calls
            best[key] = min(best[key], sum(timer(fn, rep=rep, flush_l2=True, hide_host=True)["median_ms"]
                                           for fn in calls))
    return best


def table_bench_args(argv, doc: str, rep: int, rounds: int = 3, extra=()) -> Optional[argparse.Namespace]:
    """The command line of a one-table benchmark (benchmarks.head_dims, .dropout, .variants): --rounds,
    --rep, --out, --no-write and the `extra` (flag, add_argument keywords) pairs; None (after saying
    so) without a CUDA GPU."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    for flag, kwargs in extra:
        p.add_argument(flag, **kwargs)
    p.add_argument("--rounds", type=int, default=rounds)
    p.add_argument("--rep", type=int, default=rep)
    p.add_argument("--out", default="results")
    p.add_argument("--no-write", action="store_true")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return None
    return a


def table_main(argv, doc: str, measure: Callable[..., List[Row]], name: str, *, rep: int, rounds: int = 3) -> int:
    """A one-table benchmark's main: `table_bench_args`, then measure(rounds=, rep=)'s rows stamped with the GPU
    and versions (`make_row`) and written to results/<gpu>/<name>.csv unless --no-write; 2 without a GPU."""
    a = table_bench_args(argv, doc, rep=rep, rounds=rounds)
    if a is None:
        return 2
    rows = [make_row(**row) for row in measure(rounds=a.rounds, rep=a.rep)]
    if not a.no_write:
        print("wrote", write_csv(rows, name, a.out))
    return 0
