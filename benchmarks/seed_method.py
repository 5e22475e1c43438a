"""The seed document's measurement method, as notebooks 02 and 03 report it.

Fixed seed (`torch.manual_seed(42)` before the inputs are drawn), 10 untimed warm-up calls (compiles and
autotuning land there), then 30 timed calls, each between `torch.cuda.synchronize()` calls, reported as
median and standard deviation in ms; and the call's incremental peak memory: `empty_cache()` and
`reset_peak_memory_stats()` first, then the peak allocated during one call minus what was allocated
before it, so resident inputs (Q/K/V, a shared KV cache) are not counted, only what the call allocates.

This differs from the benchmark suite's method (benchmarks.measure.time_fn: CUDA events back to back, no
synchronize between calls, median with 20th/80th percentiles): a per-call synchronize adds the launch
latency to every sample, which is what an eager caller that waits on each call sees.

A call that runs out of memory gives status "OOM" and no numbers, so a table can print the row instead of
stopping. Without a GPU the timing is host wall time and the memory is not measured (None).
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Dict, Optional

import torch

SEED = 42
WARMUP = 10
REPS = 30


def seeded() -> None:
    """Seed torch's generators as the seed document does before drawing a benchmark's inputs."""
    torch.manual_seed(SEED)


def _peak_mib(fn: Callable[[], Any]) -> float:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**20


def measure(fn: Callable[[], Any], *, warmup: int = WARMUP, reps: int = REPS) -> Dict[str, Optional[float]]:
    """median_ms, std_ms (over `reps` synchronized calls after `warmup`), peak_mib (incremental peak of one
    call; None without a GPU) and status ("ok" or "OOM") of fn()."""
    if reps < 2 or warmup < 0:
        raise ValueError(f"Expected reps >= 2 and warmup >= 0, got reps={reps}, warmup={warmup}.")
    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    try:
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(reps):
            sync()
            start = time.perf_counter()
            fn()
            sync()
            times.append((time.perf_counter() - start) * 1e3)
        peak = _peak_mib(fn) if cuda else None
    except torch.cuda.OutOfMemoryError:
        if cuda:
            torch.cuda.empty_cache()
        return {"median_ms": None, "std_ms": None, "peak_mib": None, "status": "OOM"}
    return {"median_ms": statistics.median(times), "std_ms": statistics.stdev(times), "peak_mib": peak,
            "status": "ok"}


def cell(result: Dict[str, Optional[float]]) -> str:
    """One table cell: 'median +- std ms', or 'OOM'."""
    if result["status"] != "ok":
        return result["status"]
    return f"{result['median_ms']:.3f} +- {result['std_ms']:.3f} ms"
