"""The benchmark suite behind `python -m benchmarks`: peers, correctness checks, runners and resumable
CSVs. The grids are benchmarks/grids.py; loading the CSVs back, the headline table and the figures
are benchmarks/report.py; the command line is benchmarks/__main__.py.

Suites (one CSV each, results/<gpu-slug>/bench_<suite>.csv; figures/<gpu-slug>/bench_<suite>*.png):
    prefill_fwd      flash_attn_func forward vs SDPA (flash, cuDNN, efficient backends forced),
                     FlexAttention (compiled) and eager attention; TFLOP/s = 4*B*H*M*N*D (half causal).
    prefill_fwd_bwd  the same, forward + backward (3.5x the forward FLOPs).
    decode           one decode step (append one token, attend) of flash_attn_with_kvcache over a dense
                     cache and paged caches (page 16, 64, 256) vs SDPA with a length-1 query,
                     FlexAttention and the seed's two eager baselines; GB/s = K+V bytes read / time,
                     CUDA-graph replay below 0.5 GB of K+V, >= 16 steps per graph (eager call
                     latency always reported too),
                     and the host overhead of one eager step (batch 1 x cache 4096) as its own rows.
    chunked          chunked prefill against a cache holding L tokens (flash_attn_with_kvcache with a
                     q chunk and causal=True, dense and paged) vs flash_attn_func on the same shapes.

Method: fixed seeds; warm-up calls excluded; median of N CUDA-event-timed calls with p20/p80/min;
L2 flushed before every timed call (prefill, chunked) or inputs rotated over copies exceeding twice
the L2 (decode); chunked calls are timed behind a GPU sleep that covers their host work
(measure.time_fn's hide_host), so its ratios compare kernels, not Python wrappers; peak memory as
the increment over what was allocated before the call. The ceilings
(bf16 matmul TFLOP/s, device copy and read-only streaming GB/s) are measured in the same invocation
and stored on every row (and in bench_ceilings.csv), with each row's fraction of them. Each of our
kernels is checked against tritonattn.testing once per shape before timing (flash-attn's rule:
error <= 2x PyTorch's same-dtype error + a floor, 3x for gradients): a wrong result is written as a
row with status "wrong" and no timing. Peers are only required to run; a peer missing from this torch
is skipped with a message, one that fails on a shape is written with status "error".

Resumable: before measuring, the runner reads the suite's CSV and skips every (impl, shape, dtype,
quick) already written for the same git commit and GPU; rows are appended shape by shape, so a
killed or budget-stopped run (--max-minutes) loses at most one shape. Run the same command again to
carry on. Exit status 3 means "stopped by the time budget, more to measure".

This module imports without a GPU and queries no device at import; measuring needs one (the CLI
says so and exits 1 without it), loading, plotting and the headline table do not.
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Set, Tuple

import torch
import torch.nn.functional as F

from benchmarks.competitors import attention_eager, decode_eager_cat, decode_eager_slice, sdpa_supports_enable_gqa
from tritonattn import flash_attn_func, flash_attn_with_kvcache
from tritonattn.config.hardware import device_target, gpu_name, has_gpu
from tritonattn.config.options import attn_options, head_dim_tile
from tritonattn.config.tables import prefill_bwd_config, prefill_fwd_config, prefill_fwd_sm90_config
from tritonattn.launch.decode import chunked_prefill_pays, plan_decode
from tritonattn.testing import attention_ref, check_close

from . import inputs, measure, results
from .grids import (
    CEILINGS_CSV,
    CHUNK_PAGE_SIZES,
    CSV_NAMES,
    DEFAULT_DTYPES,
    DTYPES,
    FLEX_DTYPES,
    KEY_COLUMNS,
    LABELS,
    MODES,
    PAGE_SIZES,
    QUICK_DTYPES,
    SPLIT_VALUES,
    SUITES,
    ChunkedShape,
    DecodeShape,
    PathLike,
    PrefillShape,
    suite_shapes,
)
from .report import plot_all

Row = results.Row

GRAPH_MAX_BYTES = 0.5e9  # decode: below this many K+V bytes the headline time is the CUDA-graph replay
MAX_KV_BYTES = 40e9  # decode shapes whose K+V cache exceeds this are skipped
MEMORY_HEADROOM = 0.85  # use at most this fraction of the free GPU memory for one measurement
EAGER_MAX_SCORES = 2**32  # eager prefill materialises b*h*m*n scores (several copies): skip above this
ROTATE_MAX_COPIES = 32
CHECK_ROWS = 512  # correctness check: the last CHECK_ROWS query rows of the last batch entry and KV group

NO_GPU_MESSAGE = (
    "python -m benchmarks needs a CUDA GPU to measure, and torch.cuda.is_available() is False. Run it on "
    "a GPU machine. Without one, --list (the grids), --plot-only (figures from results/) and --headline "
    "(the README table from results/) work, as do the tests (TRITON_INTERPRET=1) and the notebooks."
)


# ============================================================================================
# Settings, timer, deadline, progress
# ============================================================================================
@dataclass(frozen=True)
class Settings:
    """Repetitions of one measurement."""

    warmup: int
    rep: int
    rep_fwd_bwd: int
    graph_rep: int
    host_calls: int


FULL_SETTINGS = Settings(warmup=10, rep=50, rep_fwd_bwd=30, graph_rep=100, host_calls=300)
QUICK_SETTINGS = Settings(warmup=3, rep=10, rep_fwd_bwd=10, graph_rep=20, host_calls=100)


class CudaTimer:
    """The measurements on the current CUDA device (benchmarks/measure.py); tests pass a fake with the same methods."""

    def time(self, fn, *, warmup: int, rep: int, rotate=None, flush_l2: bool = False,
             hide_host: bool = False) -> Dict[str, float]:
        return measure.time_fn(fn, warmup=warmup, rep=rep, rotate=rotate, flush_l2=flush_l2, hide_host=hide_host)

    def graph(self, fn, *, rep: int, repeat: int = 1) -> float:
        return measure.time_cuda_graph(fn, rep=rep, repeat=repeat)

    def memory(self, fn) -> int:
        return measure.peak_memory_delta(fn)

    def host(self, fn, *, calls: int) -> Dict[str, float]:
        return measure.host_overhead_us(fn, calls=calls)

    def ceilings(self) -> Dict[str, float]:
        return measure.ceilings()

    def free_bytes(self) -> float:
        return float(torch.cuda.mem_get_info()[0])

    def l2_bytes(self) -> int:
        return measure.l2_cache_bytes(torch.cuda.current_device())

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()


class Deadline:
    """A wall-clock budget: expired() after `minutes` (never with None)."""

    def __init__(self, minutes: Optional[float]):
        self.end = None if minutes is None else time.monotonic() + 60.0 * float(minutes)

    def expired(self) -> bool:
        return self.end is not None and time.monotonic() >= self.end


class Progress:
    """A tqdm bar over a suite's shapes when tqdm is importable, else plain prints."""

    def __init__(self, total: int, desc: str, enabled: bool = True):
        self.bar = None
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, desc=desc, unit="shape", dynamic_ncols=True, file=sys.stdout)
            except ImportError:
                print(f"{desc}: {total} shapes (install tqdm for a progress bar)", flush=True)
        self.done, self.total, self.desc = 0, total, desc

    def write(self, message: str) -> None:
        if self.bar is not None:
            self.bar.write(message)
        else:
            print(message, flush=True)

    def update(self) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


@dataclass
class Context:
    """Everything a runner needs besides the shapes."""

    device: torch.device
    timer: Any
    results_dir: PathLike
    gpu: str
    commit: str
    quick: bool
    settings: Settings
    deadline: Deadline
    flex: bool
    flex_dtypes: Tuple[str, ...]
    peers: Optional[frozenset]  # None: every peer
    force: bool
    ceilings: Dict[str, float]
    log: Callable[[str], None] = print
    stopped: bool = False


# ============================================================================================
# Resumable CSVs
# ============================================================================================
def _key_str(value: Any) -> str:
    """One key field as text, equal whether it comes from a Python row or back from the CSV."""
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def row_key(suite: str, row: Mapping[str, Any]) -> Tuple[str, ...]:
    """The fields that identify a measurement of `suite` (KEY_COLUMNS), as text."""
    return tuple(_key_str(row.get(col, "")) for col in KEY_COLUMNS[suite])


def csv_path(suite: str, gpu: str, results_dir: PathLike = "results") -> Path:
    """results_dir/<gpu-slug>/bench_<suite>.csv (a relative results_dir is taken from the repo root)."""
    return results.results_root(results_dir) / results.gpu_slug(gpu) / f"{CSV_NAMES[suite]}.csv"


def done_keys(suite: str, *, gpu: str, commit: str, results_dir: PathLike = "results") -> Set[Tuple[str, ...]]:
    """Keys of the rows of `suite` already written for this GPU and commit (any status)."""
    path = csv_path(suite, gpu, results_dir)
    if not path.exists() or path.stat().st_size == 0:
        return set()
    with open(path, newline="", encoding="utf-8") as f:
        return {row_key(suite, r) for r in csv.DictReader(f) if r.get("gpu") == gpu and r.get("commit") == commit}


def _write(ctx: Context, suite: str, rows: List[Row]) -> None:
    if rows:
        results.write_csv(rows, CSV_NAMES[suite], results_dir=ctx.results_dir)


def _row(ctx: Context, **fields: Any) -> Row:
    """results.make_row with this run's GPU name, commit and quick flag."""
    return results.make_row(gpu=ctx.gpu, commit=ctx.commit, quick=ctx.quick, **fields)


# ============================================================================================
# Checks
# ============================================================================================
def _judge(pairs: Sequence[Tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]]) -> Tuple[bool, float, float]:
    """(ok, err, bound) over (ours, fp32 ref, same-dtype ref, is a gradient) tuples by the error rule of
    kernels/tritonattn/testing/tolerance.py; err/bound of the worst one (err NaN when it is not finite)."""
    worst = (-1.0, 0.0, 0.0)
    ok = True
    for ours, ref, same, grad in pairs:
        good, err, bound = check_close(ours, ref, same, grad=grad)
        ok = ok and good
        score = err / bound
        if score > worst[0]:
            worst = (score, err if math.isfinite(err) else math.nan, bound)
    return ok, worst[1], worst[2]


def _check_slice(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: int = CHECK_ROWS):
    """Index of the checked slice: last batch entry, the q heads of the last KV head, the last `rows` query
    rows (with all keys, the bottom-right causal mask of the slice is the full problem's)."""
    b, hk = q.shape[0] - 1, k.shape[2] - 1
    group = q.shape[2] // k.shape[2]
    r = min(rows, q.shape[1])
    heads = slice(hk * group, (hk + 1) * group)
    return b, heads, slice(hk, hk + 1), slice(q.shape[1] - r, q.shape[1])


def check_attention_output(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           causal: bool) -> Tuple[bool, float, float]:
    """Check a slice of our output (b, m, h, d) for q, k, v (b, n, h_kv, d) against attention_ref."""
    b, heads, kv, rows = _check_slice(q, k, v)
    qs, ks, vs = q[b:b + 1, rows, heads], k[b:b + 1, :, kv], v[b:b + 1, :, kv]
    ref, _ = attention_ref(qs.float(), ks.float(), vs.float(), causal=causal)
    same, _ = attention_ref(qs, ks, vs, causal=causal, upcast=False)
    return _judge([(out[b:b + 1, rows, heads], ref, same, False)])


def check_prefill_grads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                        seed: int = 0) -> Tuple[bool, float, float]:
    """Forward and gradients of flash_attn_func on the check slice against attention_ref (fp32 and same dtype)."""
    b, heads, kv, rows = _check_slice(q, k, v)
    base = [t.detach().clone() for t in (q[b:b + 1, rows, heads], k[b:b + 1, :, kv], v[b:b + 1, :, kv])]
    gen = torch.Generator(device=q.device)
    gen.manual_seed(seed)
    dout = torch.randn(base[0].shape, generator=gen, device=q.device, dtype=q.dtype)

    def run(fn, tensors, d):
        leaves = [t.requires_grad_() for t in tensors]
        out = fn(*leaves)
        return (out.detach(), *torch.autograd.grad(out, leaves, d))

    ours = run(lambda a, b_, c: flash_attn_func(a, b_, c, causal=causal), [t.clone() for t in base], dout)
    ref = run(lambda a, b_, c: attention_ref(a, b_, c, causal=causal)[0], [t.float() for t in base], dout.float())
    same = run(lambda a, b_, c: attention_ref(a, b_, c, causal=causal, upcast=False)[0], [t.clone() for t in base],
               dout)
    return _judge(list(zip(ours, ref, same, (False, True, True, True))))


# ============================================================================================
# Peers: prefill
# ============================================================================================
@dataclass(frozen=True)
class PrefillPeer:
    """A prefill implementation: fn(q, k, v, causal) in its layout ('bshd' ours/eager, 'bhsd' SDPA/Flex)."""

    name: str
    layout: str
    fn: Callable[..., torch.Tensor]
    unsupported: Callable[[PrefillShape, torch.dtype, str, Context], Optional[str]] = lambda *a: None


def _needs_enable_gqa(nheads: int, nheads_k: int) -> Optional[str]:
    if nheads != nheads_k and not sdpa_supports_enable_gqa():
        return f"torch {torch.__version__} has no enable_gqa in scaled_dot_product_attention (needs >= 2.5)"
    return None


def _efficient_gqa(nheads: int, nheads_k: int) -> Optional[str]:
    """SDPA's memory-efficient backend takes no enable_gqa (it raises "No available kernel")."""
    if nheads != nheads_k:
        return "SDPA's memory-efficient backend has no GQA kernel (enable_gqa runs on flash, cuDNN or math)"
    return None


def _sdpa_backend_fn(backend_attr: str):
    """SDPA restricted to one backend on (b, h, s, d) tensors, or a reason why this torch cannot do it."""
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError as exc:
        return None, f"torch.nn.attention.sdpa_kernel is missing ({exc})"
    backend = getattr(SDPBackend, backend_attr, None)
    if backend is None:
        return None, f"this torch has no SDPBackend.{backend_attr}"

    def fn(q, k, v, causal):
        kw = {"enable_gqa": True} if q.shape[1] != k.shape[1] else {}
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, **kw)

    return fn, None


_FLEX: Dict[Any, Any] = {}


def _flex_available() -> Optional[str]:
    """None when FlexAttention can be imported (and compiled), else the reason."""
    try:
        import torch.nn.attention.flex_attention  # noqa: F401
    except ImportError as exc:
        return f"torch {torch.__version__} has no FlexAttention ({exc}); needs torch >= 2.5"
    if not hasattr(torch, "compile"):
        return "this torch has no torch.compile"
    return None


def _flex_compiled():
    """(compiled flex_attention, create_block_mask), built once; recompiles per shape allowed."""
    if "fn" not in _FLEX:
        import torch._dynamo
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        for name in ("recompile_limit", "cache_size_limit"):  # one compile per shape: do not fall back to eager
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), 256))
                break
        _FLEX["fn"] = torch.compile(flex_attention, dynamic=False)
        _FLEX["mask"] = create_block_mask
    return _FLEX["fn"], _FLEX["mask"]


def _flex_prefill(q, k, v, causal):
    """Compiled FlexAttention on (b, h, s, d) tensors; causal bottom-right through a cached block mask."""
    flex, create_block_mask = _flex_compiled()
    block_mask = None
    if causal:
        m, n = q.shape[2], k.shape[2]
        key = ("mask", m, n, str(q.device))
        if key not in _FLEX:
            offset = n - m
            _FLEX[key] = create_block_mask(lambda b, h, qi, ki: ki <= qi + offset, None, None, m, n, device=q.device)
        block_mask = _FLEX[key]
    return flex(q, k, v, block_mask=block_mask, enable_gqa=q.shape[1] != k.shape[1])


def _eager_unsupported(shape: PrefillShape, dtype: torch.dtype, mode: str, ctx: Context) -> Optional[str]:
    scores = shape.batch * shape.nheads * shape.seqlen * shape.seqlen
    if scores > EAGER_MAX_SCORES:
        return f"would materialise {scores / 1e9:.1f}G scores (limit {EAGER_MAX_SCORES / 1e9:.1f}G)"
    need = scores * (2 * torch.empty((), dtype=dtype).element_size() + 8) * (2 if mode == "fwd_bwd" else 1)
    free = ctx.timer.free_bytes()
    if need > MEMORY_HEADROOM * free:
        return f"needs ~{need / 1e9:.0f} GB, {free / 1e9:.0f} GB free"
    return None


def prefill_peers(ctx: Context, log: Callable[[str], None] = print) -> List[PrefillPeer]:
    """Ours, SDPA with each backend forced (flash, cuDNN, efficient), FlexAttention (compiled) and eager,
    each behind a guard: one this torch lacks is skipped with a message. "sdpa_expand_kv" (K/V expanded
    per q head, then SDPA) runs only when named in the run's peers."""
    peers = [PrefillPeer("ours", "bshd", lambda q, k, v, causal: flash_attn_func(q, k, v, causal=causal))]
    for name, attr in (("sdpa_flash", "FLASH_ATTENTION"), ("sdpa_cudnn", "CUDNN_ATTENTION"),
                       ("sdpa_efficient", "EFFICIENT_ATTENTION")):
        fn, reason = _sdpa_backend_fn(attr)
        if fn is None:
            log(f"skip {LABELS[name]}: {reason}")
            continue
        gqa = _efficient_gqa if name == "sdpa_efficient" else _needs_enable_gqa
        peers.append(PrefillPeer(name, "bhsd", fn, lambda s, *a, gqa=gqa: gqa(s.nheads, s.nheads_k)))
    if ctx.flex:
        reason = _flex_available()
        if reason is None:
            peers.append(PrefillPeer(
                "flex", "bhsd", _flex_prefill,
                lambda s, dtype, m, c: None if _short(dtype) in c.flex_dtypes else
                f"{_short(dtype)} not in --flex-dtypes {','.join(c.flex_dtypes)}"))
        else:
            log(f"skip {LABELS['flex']}: {reason}")
    else:
        log(_flex_off(ctx))
    peers.append(PrefillPeer("eager", "bshd", lambda q, k, v, causal: attention_eager(q, k, v, causal=causal),
                             _eager_unsupported))
    if ctx.peers is not None and "sdpa_expand_kv" in ctx.peers:  # opt-in: what models did before GQA support
        peers.append(PrefillPeer("sdpa_expand_kv", "bhsd", _sdpa_expand_kv))
    return [p for p in peers if ctx.peers is None or p.name in ctx.peers]


def _sdpa_expand_kv(q, k, v, causal):
    """K/V materialised per q head (repeat_interleave), then SDPA with its own backend choice."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def _flex_off(ctx: Context) -> str:
    why = "quick mode" if ctx.quick else "--no-flex"
    return f"skip {LABELS['flex']}: off in this run ({why}; --flex turns it on)"


def _short(dtype: torch.dtype) -> str:
    return {v: k for k, v in DTYPES.items()}[dtype]


def _cfg(c) -> str:
    return f"BM{c.block_m}/BN{c.block_n}/w{c.num_warps}/s{c.num_stages}" + ("/tma" if c.use_tma else "")


def prefill_config(dtype: torch.dtype, head_dim: int, causal: bool, device: torch.device, mode: str,
                   seqlen_k: int = 0) -> str:
    """The config table's choice for our prefill kernels (tritonattn.config.tables), as text; with seqlen_k, a
    dense flash_attn_func call that Hopper's warp-specialized forward takes is named as that kernel."""
    try:
        pad = head_dim_tile(head_dim)
        target = device_target(torch.device(device))
        options = attn_options(head_dim, causal=causal)
        ws = prefill_fwd_sm90_config(options, dtype, seqlen_k, target) if seqlen_k else None
        fwd = ws if ws is not None else prefill_fwd_config(pad, dtype, causal, target)
        text = ("fwd sm90_ws " if ws is not None else "fwd ") + _cfg(fwd)
        if mode == "fwd_bwd":
            kv, dq = prefill_bwd_config(pad, dtype, causal, target)
            text += f"; bwd dkdv {_cfg(kv)} dq {_cfg(dq)}"
        return text
    except Exception as exc:  # a private detail: record it as unknown rather than fail a run
        return f"unknown ({type(exc).__name__})"


def _plan_of(batch: int, seqlen_q: int, nheads: int, nheads_k: int, head_dim: int, seqlen_cache: int,
             dtype: torch.dtype, device: torch.device, page_size: int = 0, num_splits: int = 0):
    return plan_decode(batch, seqlen_q, nheads, nheads_k, head_dim, seqlen_cache, dtype,
                       device_target(torch.device(device)), num_splits, page_size)


def decode_splits_used(batch: int, seqlen_q: int, nheads: int, nheads_k: int, head_dim: int, seqlen_cache: int,
                       dtype: torch.dtype, device: torch.device, num_splits: int) -> int:
    """How many KV splits flash_attn_with_kvcache launches for a dense cache with `num_splits` (0: the heuristic)."""
    return _plan_of(batch, seqlen_q, nheads, nheads_k, head_dim, seqlen_cache, dtype, device, 0,
                    num_splits).num_splits


def decode_config(batch: int, seqlen_q: int, nheads: int, nheads_k: int, head_dim: int, seqlen_cache: int,
                  dtype: torch.dtype, device: torch.device, page_size: int = 0, num_splits: int = 0) -> str:
    """The decode launch plan (tiles, warps, stages, KV splits) flash_attn_with_kvcache picks, as text
    (page_size 0: a dense cache; else seqlen_cache is a paged request's capacity, max_blocks_per_seq *
    page_size)."""
    try:
        p = _plan_of(batch, seqlen_q, nheads, nheads_k, head_dim, seqlen_cache, dtype, device, page_size, num_splits)
        cap = f"/r{p.max_registers}" if p.max_registers else ""
        return f"BN{p.block_n}/BH{p.block_h}/w{p.num_warps}/s{p.num_stages}/splits{p.num_splits}{cap}"
    except Exception as exc:
        return f"unknown ({type(exc).__name__})"


def kvcache_config(batch: int, seqlen_q: int, nheads: int, nheads_k: int, head_dim: int, seqlen_cache: int,
                   dtype: torch.dtype, device: torch.device, causal: bool) -> str:
    """What flash_attn_with_kvcache runs for this shape (num_splits=0): the decode plan, or, for a chunk
    that decode.chunked_prefill_pays for, an append launch then the prefill forward."""
    if chunked_prefill_pays(batch, seqlen_q, nheads, head_dim, dtype, causal, device_target(torch.device(device))):
        return "append + prefill " + prefill_config(dtype, head_dim, causal, device, "fwd")
    return "decode " + decode_config(batch, seqlen_q, nheads, nheads_k, head_dim, seqlen_cache, dtype, device)


# ============================================================================================
# Runner: prefill
# ============================================================================================
_FATAL = ("illegal memory access", "device-side assert", "unspecified launch failure", "CUDA error: an illegal")


def _is_fatal(exc: BaseException) -> bool:
    """A CUDA error that poisons the context: every later call would fail, so the run must stop."""
    text = str(exc)
    return any(marker in text for marker in _FATAL)


def _note(exc: BaseException) -> str:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {first}"[:240]


def _ceiling_fields(ctx: Context, value: float, kind: str) -> Dict[str, float]:
    """The run's ceilings on a row, and the row's fraction of the relevant one (kind: 'flops' or 'bytes')."""
    c = ctx.ceilings
    if kind == "flops":
        ceiling = c.get("matmul_tflops", math.nan)
        return {"ceiling_tflops": ceiling, "frac_ceiling": value / ceiling if ceiling == ceiling else math.nan}
    ceiling = c.get("bandwidth_gbps", math.nan)
    return {"copy_gbps": c.get("copy_gbps", math.nan), "read_gbps": c.get("read_gbps", math.nan),
            "bandwidth_gbps": ceiling, "frac_bandwidth": value / ceiling if ceiling == ceiling else math.nan}


def run_prefill(ctx: Context, mode: str, shapes: Sequence[PrefillShape], dtypes: Sequence[str]) -> Dict[str, int]:
    """Measure prefill (mode 'fwd' or 'fwd_bwd') on every (dtype, shape) not yet in the suite's CSV."""
    suite = "prefill_" + mode
    peers = prefill_peers(ctx, ctx.log)
    done = set() if ctx.force else done_keys(suite, gpu=ctx.gpu, commit=ctx.commit, results_dir=ctx.results_dir)
    stats = {"rows": 0, "shapes_done_before": 0, "shapes_left": 0}
    progress = Progress(len(shapes) * len(dtypes), f"{suite} ({ctx.gpu})", enabled=ctx.log is print)
    log = progress.write if ctx.log is print else ctx.log
    try:
        for dname in dtypes:
            dtype = DTYPES[dname]
            for shape in shapes:
                base = dict(suite=suite, mode=mode, grid=shape.grid, dtype=dname, batch=shape.batch,
                            seqlen=shape.seqlen, nheads=shape.nheads, nheads_k=shape.nheads_k,
                            group=shape.nheads // shape.nheads_k, head_dim=shape.head_dim, causal=shape.causal)
                todo = []
                for peer in peers:
                    if row_key(suite, dict(base, impl=peer.name, quick=ctx.quick)) in done:
                        continue
                    reason = peer.unsupported(shape, dtype, mode, ctx)
                    if reason:
                        log(f"skip {LABELS.get(peer.name, peer.name)} {dname} {describe(shape)}: {reason}")
                        continue
                    todo.append(peer)
                if not todo:
                    stats["shapes_done_before"] += 1
                    progress.update()
                    continue
                if ctx.deadline.expired():
                    ctx.stopped = True
                    stats["shapes_left"] += 1
                    continue
                rows = _prefill_shape(ctx, suite, mode, dtype, shape, todo, base, log)
                _write(ctx, suite, rows)
                stats["rows"] += len(rows)
                stats["shapes_left"] += int(ctx.stopped)  # the budget ran out inside this shape
                progress.update()
    finally:
        progress.close()
    return stats


def describe(shape) -> str:
    fields = dataclasses.asdict(shape)
    fields.pop("host", None)
    return " ".join(f"{k}={v}" for k, v in fields.items())


def _prefill_shape(ctx: Context, suite: str, mode: str, dtype: torch.dtype, shape: PrefillShape,
                   peers: Sequence[PrefillPeer], base: Dict[str, Any], log) -> List[Row]:
    """Measure the given peers on one shape; returns the rows (inputs are freed on return)."""
    gen = inputs.generator(ctx.device, seed=shape.seqlen * 131 + shape.nheads_k)
    b, s, h, hk, d = shape.batch, shape.seqlen, shape.nheads, shape.nheads_k, shape.head_dim
    q, k, v = (inputs.randn((b, s, n, d), dtype, ctx.device, gen) for n in (h, hk, hk))
    dout = inputs.randn((b, s, h, d), dtype, ctx.device, gen)
    layouts = {"bshd": (q, k, v, dout)}
    if any(p.layout == "bhsd" for p in peers):
        layouts["bhsd"] = tuple(t.transpose(1, 2).contiguous() for t in (q, k, v, dout))
    flops = measure.attention_flops(b, h, s, s, d, shape.causal, mode)
    rep = ctx.settings.rep if mode == "fwd" else ctx.settings.rep_fwd_bwd
    rows: List[Row] = []
    for peer in peers:
        if ctx.deadline.expired():
            ctx.stopped = True
            break
        what = f"{suite} {LABELS.get(peer.name, peer.name)} {base['dtype']} {describe(shape)}"
        fields = dict(base, impl=peer.name, label=LABELS.get(peer.name, peer.name), flops=flops)
        if peer.name == "ours":
            fields["config"] = prefill_config(dtype, d, shape.causal, ctx.device, mode, s)
        a, b_, c, g = layouts[peer.layout]
        try:
            if peer.name == "ours":
                with torch.no_grad():
                    ok, err, bound = check_attention_output(peer.fn(a, b_, c, shape.causal), q, k, v, shape.causal)
                if ok and mode == "fwd_bwd":
                    ok, err, bound = check_prefill_grads(q, k, v, shape.causal)
                fields.update(err=err, err_bound=bound)
                if not ok:
                    log(f"WRONG {what}: rel err {err:.2e} > bound {bound:.2e} against attention_ref; not timed")
                    rows.append(_row(ctx, **fields, status="wrong"))
                    continue
            fn = _prefill_callable(peer, (a, b_, c, g), shape.causal, mode)
            fn()  # compile / pick algorithms; fails here if unsupported
            timing = ctx.timer.time(fn, warmup=ctx.settings.warmup, rep=rep, flush_l2=True)
            peak = ctx.timer.memory(fn)
        except Exception as exc:  # a peer failing on one shape is a row, not a crash
            if _is_fatal(exc):
                _write(ctx, suite, rows)
                raise
            log(f"error {what}: {_note(exc)}")
            rows.append(_row(ctx, **fields, status="error", note=_note(exc)))
            ctx.timer.empty_cache()
            continue
        tf = measure.tflops(flops, timing["median_ms"])
        rows.append(_row(ctx, **fields, status="ok", tflops=tf, **timing, peak_mem_mib=peak / 2**20,
                         **_ceiling_fields(ctx, tf, "flops"), l2_flush=True))
        log(f"{what}: {timing['median_ms']:.3f} ms, {tf:.0f} TFLOP/s, peak +{peak / 2**20:.0f} MiB")
    del layouts, q, k, v, dout
    ctx.timer.empty_cache()
    return rows


def _prefill_callable(peer: PrefillPeer, tensors, causal: bool, mode: str) -> Callable[[], Any]:
    q, k, v, dout = tensors
    if mode == "fwd":
        def fwd():
            with torch.no_grad():
                return peer.fn(q, k, v, causal)
        return fwd
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]

    def fwd_bwd():
        return torch.autograd.grad(peer.fn(*leaves, causal), leaves, dout)
    return fwd_bwd


# ============================================================================================
# Peers and runner: decode
# ============================================================================================
@dataclass(frozen=True)
class DecodePeer:
    """A decode step: make(shape, dtype, device, gen) -> state, step(state) -> out, one new token per request."""

    name: str
    page_size: int  # 0: dense cache
    make: Callable[..., SimpleNamespace]
    step: Callable[[SimpleNamespace], torch.Tensor]
    extra_bytes: Callable[[DecodeShape, int], float] = lambda shape, kv_bytes: 0.0  # temporaries of one step
    checked: bool = False  # ours: checked against attention_ref before timing
    graph_big: bool = True  # also graph-time shapes above GRAPH_MAX_BYTES
    num_splits: Optional[int] = None  # decode_splits: ours with this num_splits (0: the heuristic)

    @property
    def label(self) -> str:
        label = LABELS.get(self.name, self.name) + (f" P={self.page_size}" if self.page_size else "")
        if self.num_splits is not None:
            label += " (heuristic)" if self.num_splits == 0 else f" num_splits={self.num_splits}"
        return label

    def key_fields(self) -> Dict[str, Any]:
        """The fields of this peer's rows that tell it from the suite's other peers."""
        fields: Dict[str, Any] = dict(impl=self.name, page_size=self.page_size)
        if self.num_splits is not None:
            fields["num_splits"] = self.num_splits
        return fields


def _ours_step(st):
    return flash_attn_with_kvcache(st.q, st.k_cache, st.v_cache, st.k, st.v, cache_seqlens=st.seqlens,
                                   num_splits=st.num_splits)


def _ours_paged_step(st):
    return flash_attn_with_kvcache(st.q, st.k_cache, st.v_cache, st.k, st.v, cache_seqlens=st.seqlens,
                                   block_table=st.block_table)


def _append_bhsd(st) -> int:
    n = st.cache_len
    st.k_cache[:, :, n:n + 1].copy_(st.k)
    st.v_cache[:, :, n:n + 1].copy_(st.v)
    return n + 1


def _sdpa_step(st):
    """The append as a slice copy into the preallocated cache, then SDPA (its own backend) over the valid rows."""
    n = _append_bhsd(st)
    return F.scaled_dot_product_attention(st.q, st.k_cache[:, :, :n], st.v_cache[:, :, :n], enable_gqa=True)


def _flex_decode_step(st):
    n = _append_bhsd(st)
    flex, _ = _flex_compiled()
    return flex(st.q, st.k_cache[:, :, :n], st.v_cache[:, :, :n], enable_gqa=True)


def _eager_slice_step(st):
    return decode_eager_slice(st.q, st.k_cache, st.v_cache, st.cache_len, st.k, st.v)


def _eager_cat_step(st):
    return decode_eager_cat(st.q, st.k_valid, st.v_valid, st.k, st.v)[0]


def decode_keys(st, b: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Request b's keys and values after a step of ours (cached rows + the appended token), (1, n, h_kv, d)."""
    n = st.cache_len + 1
    if hasattr(st, "block_table"):
        blocks = st.block_table[b].long()
        k = st.k_cache[blocks].reshape(-1, *st.k_cache.shape[2:])[:n]
        v = st.v_cache[blocks].reshape(-1, *st.v_cache.shape[2:])[:n]
        return k[None], v[None]
    return st.k_cache[b:b + 1, :n], st.v_cache[b:b + 1, :n]


def _check_decode_step(peer: DecodePeer, st: SimpleNamespace, b: int) -> Tuple[bool, float, float]:
    """Run one step of ours and check request b's output against attention_ref over its keys after the step."""
    out = peer.step(st)
    kk, vv = decode_keys(st, b)
    return check_attention_output(out[b:b + 1], st.q[b:b + 1], kk, vv, causal=False)


def _expanded_bytes(shape: DecodeShape, kv_bytes: int) -> float:
    """Eager baselines expand K/V by the group size (repeat_interleave) and materialise fp32 scores."""
    scores = shape.batch * shape.nheads * shape.cache_len * 4 * 2
    return (shape.nheads // shape.nheads_k) * kv_bytes + scores


def decode_peers(ctx: Context, log: Callable[[str], None] = print) -> List[DecodePeer]:
    """Ours (dense; paged with pages of 16, 64, 256), SDPA with a length-1 query, FlexAttention
    (compiled) and the seed's two eager baselines, each behind a guard."""
    peers = [DecodePeer("ours", 0, inputs.dense_state, _ours_step, checked=True)]
    for p in PAGE_SIZES:
        peers.append(DecodePeer("ours_paged", p, functools.partial(inputs.paged_state, page_size=p),
                                _ours_paged_step, checked=True))
    reason = _needs_enable_gqa(2, 1)
    if reason is None:
        peers.append(DecodePeer("sdpa", 0, inputs.bhsd_state, _sdpa_step))
    else:
        log(f"skip {LABELS['sdpa']}: {reason}")
    if ctx.flex:
        reason = _flex_available()
        if reason is None:
            peers.append(DecodePeer("flex", 0, inputs.bhsd_state, _flex_decode_step, graph_big=False))
        else:
            log(f"skip {LABELS['flex']}: {reason}")
    else:
        log(_flex_off(ctx))
    peers.append(DecodePeer("eager_slice", 0, inputs.dense_state, _eager_slice_step,
                            _expanded_bytes, graph_big=False))
    peers.append(DecodePeer("eager_cat", 0, functools.partial(inputs.dense_state, valid_copy=True),
                            _eager_cat_step, lambda s, kv: kv + _expanded_bytes(s, kv), graph_big=False))
    return [p for p in peers if ctx.peers is None or p.name in ctx.peers]


def decode_split_peers(ctx: Context, log: Callable[[str], None] = print) -> List[DecodePeer]:
    """Ours with the heuristic (num_splits=0) and with every num_splits of SPLIT_VALUES, and SDPA for scale."""
    peers = [DecodePeer("ours", 0, functools.partial(inputs.dense_state, num_splits=ns), _ours_step,
                        checked=True, num_splits=ns) for ns in (0, *SPLIT_VALUES)]
    reason = _needs_enable_gqa(2, 1)
    if reason is None:
        peers.append(DecodePeer("sdpa", 0, inputs.bhsd_state, _sdpa_step))
    else:
        log(f"skip {LABELS['sdpa']}: {reason}")
    return [p for p in peers if ctx.peers is None or p.name in ctx.peers]


def _rotation_copies(ctx: Context, state_bytes: float, extra: float) -> int:
    """Copies of a decode state to cycle through so that together they exceed twice the L2 (1 for big
    states), as many as fit in memory."""
    want = max(1, min(ROTATE_MAX_COPIES, math.ceil(2 * ctx.timer.l2_bytes() / max(state_bytes, 1))))
    fit = int((MEMORY_HEADROOM * ctx.timer.free_bytes() - extra) // max(state_bytes, 1))
    return max(1, min(want, fit))


def run_decode(ctx: Context, shapes: Sequence[DecodeShape], dtypes: Sequence[str], suite: str = "decode"
               ) -> Dict[str, int]:
    """Measure one decode step of every peer of `suite` ("decode": `decode_peers`, "decode_splits":
    `decode_split_peers`) on every (dtype, shape) not yet in bench_<suite>.csv."""
    peers = (decode_peers if suite == "decode" else decode_split_peers)(ctx, ctx.log)
    done = set() if ctx.force else done_keys(suite, gpu=ctx.gpu, commit=ctx.commit, results_dir=ctx.results_dir)
    stats = {"rows": 0, "shapes_done_before": 0, "shapes_left": 0}
    progress = Progress(len(shapes) * len(dtypes), f"{suite} ({ctx.gpu})", enabled=ctx.log is print)
    log = progress.write if ctx.log is print else ctx.log
    try:
        for dname in dtypes:
            dtype = DTYPES[dname]
            for shape in shapes:
                base = dict(suite=suite, grid=shape.grid, dtype=dname, batch=shape.batch, cache_len=shape.cache_len,
                            seqlen_q=1, nheads=shape.nheads, nheads_k=shape.nheads_k,
                            group=shape.nheads // shape.nheads_k, head_dim=shape.head_dim)
                kv_bytes = measure.decode_kv_bytes(shape.batch * shape.cache_len, shape.nheads_k, shape.head_dim, dtype)
                if kv_bytes > MAX_KV_BYTES:
                    log(f"skip decode {dname} {describe(shape)}: K+V {kv_bytes / 1e9:.0f} GB > "
                        f"{MAX_KV_BYTES / 1e9:.0f} GB")
                    progress.update()
                    continue
                todo = [p for p in peers if row_key(suite, dict(base, metric="step", **p.key_fields(),
                                                                 quick=ctx.quick)) not in done]
                if not todo:
                    stats["shapes_done_before"] += 1
                    progress.update()
                    continue
                if ctx.deadline.expired():
                    ctx.stopped = True
                    stats["shapes_left"] += 1
                    continue
                rows = _decode_shape(ctx, suite, dtype, shape, todo, base, kv_bytes, log)
                _write(ctx, suite, rows)
                stats["rows"] += len(rows)
                stats["shapes_left"] += int(ctx.stopped)  # the budget ran out inside this shape
                progress.update()
    finally:
        progress.close()
    return stats


def _decode_shape(ctx: Context, suite: str, dtype: torch.dtype, shape: DecodeShape, peers: Sequence[DecodePeer],
                  base: Dict[str, Any], kv_bytes: int, log) -> List[Row]:
    rows: List[Row] = []
    for peer in peers:
        if ctx.deadline.expired():
            ctx.stopped = True
            break
        what = f"{suite} {peer.label} {base['dtype']} {describe(shape)}"
        fields = dict(base, metric="step", **peer.key_fields(), label=peer.label, kv_bytes=kv_bytes)
        if peer.checked:
            seqlen_cache = shape.cache_len
            if peer.page_size:
                seqlen_cache = -(-shape.cache_len // peer.page_size) * peer.page_size
            fields["config"] = decode_config(shape.batch, 1, shape.nheads, shape.nheads_k, shape.head_dim,
                                             seqlen_cache, dtype, ctx.device, page_size=peer.page_size,
                                             num_splits=peer.num_splits or 0)
            if peer.num_splits is not None:
                fields["splits_used"] = decode_splits_used(shape.batch, 1, shape.nheads, shape.nheads_k,
                                                           shape.head_dim, seqlen_cache, dtype, ctx.device,
                                                           peer.num_splits)
        extra = peer.extra_bytes(shape, kv_bytes)
        free = ctx.timer.free_bytes()
        if kv_bytes + extra > MEMORY_HEADROOM * free:
            log(f"skip {what}: needs ~{(kv_bytes + extra) / 1e9:.1f} GB, {free / 1e9:.1f} GB free")
            continue
        states: List[SimpleNamespace] = []
        try:
            copies = _rotation_copies(ctx, kv_bytes, extra)
            states = [peer.make(shape, dtype, ctx.device, inputs.generator(ctx.device, seed=i)) for i in range(copies)]
            with torch.no_grad():
                if peer.checked:  # the first call also compiles; the check frees its temporaries on return
                    ok, err, bound = _check_decode_step(peer, states[0], shape.batch - 1)
                    fields.update(err=err, err_bound=bound)
                    if not ok:
                        log(f"WRONG {what}: rel err {err:.2e} > bound {bound:.2e} against attention_ref; not timed")
                        rows.append(_row(ctx, **fields, status="wrong"))
                        continue
                else:
                    peer.step(states[0])  # compiles; fails here if unsupported
                step = peer.step
                timing = ctx.timer.time(step, warmup=ctx.settings.warmup, rep=ctx.settings.rep,
                                        rotate=[(st,) for st in states])
                peak = ctx.timer.memory(lambda: step(states[0]))
                graph_ms, graph_note = math.nan, ""
                if kv_bytes < GRAPH_MAX_BYTES or peer.graph_big:
                    try:
                        repeat = -(-measure.GRAPH_MIN_CALLS // len(states))  # whole rotations of the copies
                        graph_ms = ctx.timer.graph(lambda: [step(st) for st in states], rep=ctx.settings.graph_rep,
                                                   repeat=repeat) / len(states)
                    except Exception as exc:
                        if _is_fatal(exc):
                            raise
                        graph_note = f"no CUDA-graph timing: {_note(exc)}"
                        log(f"note {what}: {graph_note}")
                        ctx.timer.synchronize()
                host = None
                if shape.host:
                    host = ctx.timer.host(lambda: step(states[0]), calls=ctx.settings.host_calls)
        except Exception as exc:
            if _is_fatal(exc):
                _write(ctx, suite, rows)
                raise
            log(f"error {what}: {_note(exc)}")
            rows.append(_row(ctx, **fields, status="error", note=_note(exc)))
            states = []
            ctx.timer.empty_cache()
            continue
        use_graph = kv_bytes < GRAPH_MAX_BYTES and graph_ms == graph_ms
        time_ms = graph_ms if use_graph else timing["median_ms"]
        gbps = measure.gbps(kv_bytes, time_ms)
        rows.append(_row(
            ctx, **fields, status="ok", rotated_copies=len(states), **timing, graph_ms=graph_ms,
            timing="graph" if use_graph else "eager", time_ms=time_ms, gbps=gbps,
            gbps_eager=measure.gbps(kv_bytes, timing["median_ms"]),
            gbps_graph=measure.gbps(kv_bytes, graph_ms) if graph_ms == graph_ms else math.nan,
            peak_mem_mib=peak / 2**20, **_ceiling_fields(ctx, gbps, "bytes"), note=graph_note,
        ))
        log(f"{what}: {timing['median_ms'] * 1e3:.1f} us/call, graph {graph_ms * 1e3:.1f} us, {gbps:.0f} GB/s "
            f"({'graph' if use_graph else 'eager'}), peak +{peak / 2**20:.1f} MiB")
        if host is not None:
            rows.append(_row(ctx, **dict(fields, metric="host_overhead"), status="ok", **host,
                             calls=ctx.settings.host_calls))
            log(f"{what}: host overhead {host['host_us']:.1f} us per eager call (no sync)")
        states = []
        ctx.timer.empty_cache()
    return rows


# ============================================================================================
# Runner: chunked prefill
# ============================================================================================
@dataclass(frozen=True)
class ChunkedImpl:
    name: str
    page_size: int
    make: Callable[..., SimpleNamespace]
    step: Callable[[SimpleNamespace], torch.Tensor]

    @property
    def label(self) -> str:
        return LABELS.get(self.name, self.name) + (f" P={self.page_size}" if self.page_size else "")


def _chunked_prefill_step(st):
    return flash_attn_func(st.q, st.k_full, st.v_full, causal=True)


def _chunked_kvcache_step(st):
    kw = {"block_table": st.block_table} if hasattr(st, "block_table") else {}
    return flash_attn_with_kvcache(st.q, st.k_cache, st.v_cache, st.k, st.v, cache_seqlens=st.seqlens, causal=True,
                                   **kw)


def chunked_impls(ctx: Context) -> List[ChunkedImpl]:
    """ours_prefill (flash_attn_func, the yardstick: measured first), ours_kvcache (dense) and paged."""
    impls = [ChunkedImpl("ours_prefill", 0, lambda *a: inputs.chunked_state(*a, kind="prefill"), _chunked_prefill_step),
             ChunkedImpl("ours_kvcache", 0, lambda *a: inputs.chunked_state(*a, kind="dense"), _chunked_kvcache_step)]
    impls += [ChunkedImpl("ours_kvcache_paged", p, lambda *a, p=p: inputs.chunked_state(*a, kind="paged", page_size=p),
                          _chunked_kvcache_step) for p in CHUNK_PAGE_SIZES]
    return [i for i in impls if ctx.peers is None or i.name in ctx.peers]


def _chunked_keys(st) -> Tuple[torch.Tensor, torch.Tensor]:
    """All keys/values (b, L + chunk, h_kv, d) each request sees after the call."""
    if hasattr(st, "k_full"):
        return st.k_full, st.v_full
    if hasattr(st, "block_table"):
        b = st.block_table.shape[0]
        blocks = st.block_table.long()
        k = st.k_cache[blocks].reshape(b, -1, *st.k_cache.shape[2:])[:, :st.total]
        v = st.v_cache[blocks].reshape(b, -1, *st.v_cache.shape[2:])[:, :st.total]
        return k, v
    return st.k_cache[:, :st.total], st.v_cache[:, :st.total]


def run_chunked(ctx: Context, shapes: Sequence[ChunkedShape], dtypes: Sequence[str]) -> Dict[str, int]:
    """Measure chunked prefill against a cache, and flash_attn_func on the same shapes, per (dtype, shape)."""
    suite = "chunked"
    impls = chunked_impls(ctx)
    done = set() if ctx.force else done_keys(suite, gpu=ctx.gpu, commit=ctx.commit, results_dir=ctx.results_dir)
    stats = {"rows": 0, "shapes_done_before": 0, "shapes_left": 0}
    progress = Progress(len(shapes) * len(dtypes), f"chunked ({ctx.gpu})", enabled=ctx.log is print)
    log = progress.write if ctx.log is print else ctx.log
    try:
        for dname in dtypes:
            dtype = DTYPES[dname]
            for shape in shapes:
                base = dict(suite=suite, grid=shape.grid, dtype=dname, batch=shape.batch, cache_len=shape.cache_len,
                            chunk=shape.chunk, seqlen_k=shape.cache_len + shape.chunk, nheads=shape.nheads,
                            nheads_k=shape.nheads_k, group=shape.nheads // shape.nheads_k, head_dim=shape.head_dim,
                            causal=True)
                todo = [i for i in impls if row_key(suite, dict(base, impl=i.name, page_size=i.page_size,
                                                                 quick=ctx.quick)) not in done]
                if not todo:
                    stats["shapes_done_before"] += 1
                    progress.update()
                    continue
                if ctx.deadline.expired():
                    ctx.stopped = True
                    stats["shapes_left"] += 1
                    continue
                rows = _chunked_shape(ctx, dtype, shape, todo, base, log)
                _write(ctx, suite, rows)
                stats["rows"] += len(rows)
                stats["shapes_left"] += int(ctx.stopped)  # the budget ran out inside this shape
                progress.update()
    finally:
        progress.close()
    return stats


def _chunked_shape(ctx: Context, dtype, shape: ChunkedShape, impls: Sequence[ChunkedImpl], base, log) -> List[Row]:
    flops = measure.attention_flops(shape.batch, shape.nheads, shape.chunk, shape.cache_len + shape.chunk,
                                  shape.head_dim, True)
    rows: List[Row] = []
    prefill_tflops = math.nan
    for impl in impls:
        if ctx.deadline.expired():
            ctx.stopped = True
            break
        what = f"chunked {impl.label} {base['dtype']} {describe(shape)}"
        fields = dict(base, impl=impl.name, label=impl.label, page_size=impl.page_size, flops=flops)
        if impl.name == "ours_prefill":
            fields["config"] = prefill_config(dtype, shape.head_dim, True, ctx.device, "fwd",
                                              shape.cache_len + shape.chunk)
        else:
            cap = shape.cache_len + shape.chunk
            if impl.page_size:
                cap = -(-cap // impl.page_size) * impl.page_size
            fields["config"] = kvcache_config(shape.batch, shape.chunk, shape.nheads, shape.nheads_k, shape.head_dim,
                                              cap, dtype, ctx.device, True)
        st = None
        try:
            st = impl.make(shape, dtype, ctx.device, inputs.generator(ctx.device, seed=shape.cache_len + shape.chunk))
            with torch.no_grad():
                out = impl.step(st)
                kk, vv = _chunked_keys(st)
                ok, err, bound = check_attention_output(out, st.q, kk, vv, causal=True)
                del out, kk, vv
                fields.update(err=err, err_bound=bound)
                if not ok:
                    log(f"WRONG {what}: rel err {err:.2e} > bound {bound:.2e} against attention_ref; not timed")
                    rows.append(_row(ctx, **fields, status="wrong"))
                    continue
                step = impl.step
                timing = ctx.timer.time(lambda: step(st), warmup=ctx.settings.warmup, rep=ctx.settings.rep,
                                        flush_l2=True, hide_host=True)  # GPU time: kernels compared
                peak = ctx.timer.memory(lambda: step(st))
        except Exception as exc:
            if _is_fatal(exc):
                _write(ctx, "chunked", rows)
                raise
            log(f"error {what}: {_note(exc)}")
            rows.append(_row(ctx, **fields, status="error", note=_note(exc)))
            st = None
            ctx.timer.empty_cache()
            continue
        tf = measure.tflops(flops, timing["median_ms"])
        if impl.name == "ours_prefill":
            prefill_tflops = tf
        rows.append(_row(ctx, **fields, status="ok", tflops=tf, **timing, peak_mem_mib=peak / 2**20,
                         ratio_vs_prefill=tf / prefill_tflops if impl.name != "ours_prefill" else 1.0,
                         **_ceiling_fields(ctx, tf, "flops"), l2_flush=True))
        log(f"{what}: {timing['median_ms']:.3f} ms, {tf:.0f} TFLOP/s")
        st = None
        ctx.timer.empty_cache()
    return rows


# ============================================================================================
# One run: every requested suite
# ============================================================================================
def run(
    suites: Sequence[str] = SUITES,
    *,
    quick: bool = False,
    dtypes: Optional[Sequence[str]] = None,
    results_dir: PathLike = "results",
    figures_dir: Optional[PathLike] = "figures",
    flex: Optional[bool] = None,
    flex_dtypes: Sequence[str] = FLEX_DTYPES,
    max_minutes: Optional[float] = None,
    peers: Optional[Iterable[str]] = None,
    force: bool = False,
    timer: Any = None,
    device: Optional[torch.device] = None,
    gpu: Optional[str] = None,
    commit: Optional[str] = None,
    shapes: Optional[Mapping[str, Sequence[Any]]] = None,
    log: Callable[[str], None] = print,
) -> Dict[str, Any]:
    """Measure the requested suites on this GPU, append to results_dir/<gpu>/bench_<suite>.csv, then (with
    figures_dir) redraw figures_dir/<gpu>/ from the CSVs. Returns {suite: stats, "stopped": bool, ...}.

    quick: the small grids and fewer repetitions (each suite ~3 minutes on an H200), Flex off unless
    flex=True. dtypes: names from DTYPES (default per suite: DEFAULT_DTYPES; quick: bf16). max_minutes:
    stop cleanly (between shapes/peers) after that long, everything measured so far written; call again
    to continue. peers: only these implementation names. force: re-measure rows already written.
    timer/device/gpu/commit/shapes: injection points for tests (a fake timer on the CPU interpreter).
    """
    unknown = [s for s in suites if s not in SUITES]
    if unknown:
        raise ValueError(f"Unknown suite(s) {unknown}; expected some of {list(SUITES)}.")
    if timer is None:
        if not has_gpu():
            raise RuntimeError(NO_GPU_MESSAGE)
        timer = CudaTimer()
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if has_gpu() else torch.device("cpu")
    gpu = gpu or gpu_name()
    commit = commit or results.git_commit()
    flex = (not quick) if flex is None else flex
    bad = [d for d in (dtypes or ()) if d not in DTYPES]
    if bad:
        raise ValueError(f"Unknown dtype(s) {bad}; expected some of {list(DTYPES)}.")
    torch.manual_seed(0)
    ceilings = timer.ceilings()
    log(f"{gpu} (commit {commit}): ceilings measured now: {ceilings.get('matmul_tflops', math.nan):.0f} TFLOP/s "
        f"bf16 matmul, {ceilings.get('copy_gbps', math.nan):.0f} GB/s copy (read+write), "
        f"{ceilings.get('read_gbps', math.nan):.0f} GB/s read-only")
    ctx = Context(device=device, timer=timer, results_dir=results_dir, gpu=gpu, commit=commit, quick=quick,
                  settings=QUICK_SETTINGS if quick else FULL_SETTINGS, deadline=Deadline(max_minutes), flex=flex,
                  flex_dtypes=tuple(flex_dtypes), peers=frozenset(peers) if peers else None, force=force,
                  ceilings=ceilings, log=log)
    results.write_csv([_row(ctx, suite="ceilings", **ceilings)], CEILINGS_CSV, results_dir=results_dir)
    summary: Dict[str, Any] = {}
    for suite in suites:
        grid = (shapes or {}).get(suite) or suite_shapes(suite, quick)
        names = tuple(dtypes) if dtypes else (QUICK_DTYPES if quick else DEFAULT_DTYPES[suite])
        log(f"== {suite}: {len(grid)} shapes x {len(names)} dtype(s) {','.join(names)} "
            f"({'quick' if quick else 'full'}) -> {csv_path(suite, gpu, results_dir)}")
        if suite in MODES:
            stats = run_prefill(ctx, MODES[suite], grid, names)
        elif suite in ("decode", "decode_splits"):
            stats = run_decode(ctx, grid, names, suite)
        else:
            stats = run_chunked(ctx, grid, names)
        summary[suite] = stats
        log(f"== {suite}: {stats['rows']} rows written, {stats['shapes_done_before']} shapes already measured "
            f"(commit {commit})" + (f", {stats['shapes_left']} shapes left for the next call" if ctx.stopped else ""))
    summary["stopped"] = ctx.stopped
    if ctx.stopped:
        log("stopped by the time budget: run the same command again to continue (measured rows are skipped)")
    if figures_dir is not None:
        summary["figures"] = plot_all(results_dir, figures_dir, gpu=gpu, log=log)
    return summary
