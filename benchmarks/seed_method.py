"""The seed document's measurement method, as notebooks 02 and 03 report it.

Fixed seed (`torch.manual_seed(42)` before the inputs are drawn), 10 untimed warm-up calls (compiles and
autotuning land there), then 30 timed calls, each between `torch.cuda.synchronize()` calls, reported as
median and standard deviation in ms; and the call's incremental peak memory: `empty_cache()` and
`reset_peak_memory_stats()` first, then the peak allocated during one call minus what was allocated
before it, so resident inputs (Q/K/V, a shared KV cache) are not counted, only what the call allocates.

This differs from the benchmark suite's method (benchmarks.measure.time_fn: CUDA events back to back, no
synchronize between calls, median with 20th/80th percentiles): a per-call synchronize adds the launch
latency to every sample, which is what an eager caller that waits on each call sees.

A call that runs out of memory gives status "OOM" and no numbers (`OOM`), so a table can print the row instead
of stopping. The GPU path is taken when `device` is a CUDA device (by default: when one is usable); on a CPU
the timing is host wall time and the memory is not measured (None).
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Dict, List

import torch

from tritonattn import has_gpu

from .measure import peak_memory_delta

SEED = 42
WARMUP = 10
REPS = 30
# What measure gives for a call that ran out of memory: no numbers, the status a table prints.
OOM: Dict[str, Any] = {"median_ms": None, "std_ms": None, "peak_mib": None, "status": "OOM"}


def seeded() -> None:
    """Seed torch's generators as the seed document does before drawing a benchmark's inputs."""
    torch.manual_seed(SEED)


def _on_cuda(device) -> bool:
    return has_gpu() if device is None else torch.device(device).type == "cuda"


def _times_ms(fn: Callable[[], Any], warmup: int, reps: int, cuda: bool) -> List[float]:
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        sync()  # the queue is empty when the clock starts: nothing earlier is billed to this call
        start = time.perf_counter()
        fn()
        sync()  # the call's kernels have finished when the clock stops
        times.append((time.perf_counter() - start) * 1e3)
    return times


def measure(fn: Callable[[], Any], *, warmup: int = WARMUP, reps: int = REPS, device=None) -> Dict[str, Any]:
    """median_ms, std_ms (over `reps` synchronized calls after `warmup`), peak_mib (incremental peak of one
    call, after empty_cache: benchmarks.measure.peak_memory_delta; None off the GPU) and status ("ok") of
    fn(); `OOM` (a copy) when a call runs out of CUDA memory. device: where fn's tensors live (None: CUDA
    when usable)."""
    if int(reps) != reps or reps < 2 or int(warmup) != warmup or warmup < 0:
        raise ValueError(f"Expected integers reps >= 2 (a standard deviation needs two) and warmup >= 0, "
                         f"got reps={reps!r}, warmup={warmup!r}.")
    cuda = _on_cuda(device)
    try:
        times = _times_ms(fn, int(warmup), int(reps), cuda)
        peak = None
        if cuda:
            torch.cuda.empty_cache()
            peak = peak_memory_delta(fn) / 2**20
    except torch.cuda.OutOfMemoryError:
        pass
    else:
        return {"median_ms": statistics.median(times), "std_ms": statistics.stdev(times), "peak_mib": peak,
                "status": "ok"}
    # Out of memory. The cache is emptied here, after the except clause: while it ran, the exception's
    # traceback still held the failed call's frames and the tensors they had allocated.
    if cuda:
        torch.cuda.empty_cache()
    return dict(OOM)


def cell(result: Dict[str, Any]) -> str:
    """One table cell: 'median +- std ms', or the status ('OOM')."""
    if result["status"] != "ok":
        return result["status"]
    return f"{result['median_ms']:.3f} +- {result['std_ms']:.3f} ms"
