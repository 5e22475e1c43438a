"""Environment detection and input validation shared by every public entry point.

Nothing here queries the GPU driver at import time: `triton.runtime.driver.active` fails on a
machine without a GPU even under the interpreter, so every device query lives inside a function
and is cached per device.
"""

from __future__ import annotations

import contextlib
import functools
import numbers
import os
import platform
from dataclasses import dataclass
from typing import Iterator, Optional, Tuple

import torch

from .errors import InputError, InputTypeError

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MIN_HEAD_DIM, MAX_HEAD_DIM = 1, 256  # any head dim: the tile is padded to a power of two and masked


# --------------------------------------------------------------------------------------------
# Row alignment
# --------------------------------------------------------------------------------------------
def rows_aligned(t: torch.Tensor) -> bool:
    """True when t's base and every outer stride are 16-byte multiples (what a tensor descriptor, and a
    vectorised row load, needs)."""
    size = t.element_size()
    return t.data_ptr() % 16 == 0 and all((s * size) % 16 == 0 for s in t.stride()[:-1])


def empty_aligned(shape, dtype: torch.dtype, device, *, zero: bool = False, aligned: bool = True) -> torch.Tensor:
    """An uninitialised (or, with zero, zeroed) tensor of `shape`; with `aligned` its rows are 16-byte
    multiples: for a last dim that is not, a view [..., :shape[-1]] of a buffer padded along the last dim."""
    shape = tuple(int(n) for n in shape)
    per_16_bytes = max(1, 16 // dtype.itemsize) if aligned else 1
    width = -(-shape[-1] // per_16_bytes) * per_16_bytes
    make = torch.zeros if zero else torch.empty
    return make((*shape[:-1], width), dtype=dtype, device=device)[..., : shape[-1]]


# --------------------------------------------------------------------------------------------
# Environment
# --------------------------------------------------------------------------------------------
def is_interpreter() -> bool:
    """True when Triton kernels run under the CPU interpreter (TRITON_INTERPRET=1).

    The variable must be set before `triton` decorates the kernels, i.e. before `import tritonattn`.
    """
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def has_gpu() -> bool:
    """True when a CUDA device is usable by PyTorch."""
    return torch.cuda.is_available()


def default_device() -> torch.device:
    """Where tests, notebooks and benchmarks put their tensors: cuda if present, else cpu."""
    return torch.device("cuda") if has_gpu() else torch.device("cpu")


@functools.lru_cache(maxsize=None)
def device_capability(index: int) -> tuple[int, int]:
    """Compute capability of CUDA device `index`, cached."""
    return torch.cuda.get_device_capability(index)


@functools.lru_cache(maxsize=None)
def device_smem_bytes(index: int) -> int:
    """Largest opt-in shared memory per block of CUDA device `index` (L4: 99 KB, H100/H200: 227 KB)."""
    props = torch.cuda.get_device_properties(index)
    return int(getattr(props, "shared_memory_per_block_optin", 0) or 48 * 1024)


@functools.lru_cache(maxsize=None)
def device_sm_count(index: int) -> int:
    """Number of streaming multiprocessors of CUDA device `index`, cached."""
    return torch.cuda.get_device_properties(index).multi_processor_count


@dataclass(frozen=True)
class Target:
    """What the config tables need to know about a GPU: its compute capability, the shared memory one
    block may opt in to (bytes), and its SM count. `device_target` reads one off a device; `TARGETS`
    describes the cards users bring, so the selection can be asked about a card that is not here."""

    name: str
    capability: Tuple[int, int]
    smem_per_block: int
    sm_count: int

    @property
    def arch(self) -> int:
        """The capability as Triton's target names it (sm_89 -> 89)."""
        return 10 * self.capability[0] + self.capability[1]


# The cards the configs are proven to fit (tests/test_config_fitness.py compiles every config for each).
TARGETS = {
    "T4": Target("T4", (7, 5), 64 * 1024, 40),
    "A100": Target("A100", (8, 0), 163 * 1024, 108),
    "A10": Target("A10", (8, 6), 99 * 1024, 72),
    "L4": Target("L4", (8, 9), 99 * 1024, 58),
    "H100": Target("H100", (9, 0), 227 * 1024, 132),
}

_PLANNED_TARGET: Optional[Target] = None  # set by `planning_for`: every device plans for this card


@contextlib.contextmanager
def planning_for(target: Target) -> Iterator[Target]:
    """Within this block every call plans its launches for `target` whatever device its tensors are on
    (see `_launch.recording`, which also keeps the launches from running)."""
    global _PLANNED_TARGET
    previous, _PLANNED_TARGET = _PLANNED_TARGET, target
    try:
        yield target
    finally:
        _PLANNED_TARGET = previous


def device_target(device: torch.device) -> Optional[Target]:
    """The `Target` launches on `device` are planned for: the card `planning_for` names, else the CUDA
    device's own description; None for the interpreter's one small config (CPU tensors)."""
    if _PLANNED_TARGET is not None:
        return _PLANNED_TARGET
    if is_interpreter() or device.type != "cuda":
        return None
    return _cuda_target(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _cuda_target(index: int) -> Target:
    return Target(torch.cuda.get_device_name(index), device_capability(index), device_smem_bytes(index),
                  device_sm_count(index))


def gpu_name() -> str:
    """Name of the present GPU, or 'cpu-interpreter' / 'cpu' without one."""
    if has_gpu():
        return torch.cuda.get_device_name(torch.cuda.current_device())
    return "cpu-interpreter" if is_interpreter() else "cpu"


def env_summary() -> dict:
    """Versions and hardware, printed by notebooks and stored with every benchmark row."""
    import triton

    summary = {
        "gpu": gpu_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "interpreter": is_interpreter(),
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if has_gpu() else None,
    }
    if has_gpu():
        index = torch.cuda.current_device()
        summary["capability"] = "%d.%d" % device_capability(index)
        summary["sm_count"] = device_sm_count(index)
        summary["smem_per_block_kb"] = device_smem_bytes(index) // 1024
    return summary


# --------------------------------------------------------------------------------------------
# Validation: every public function calls these before allocating or launching anything.
# --------------------------------------------------------------------------------------------
def _validate_tensor(name: str, t, ndim: int, layout: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise InputTypeError(f"Expected {name} to be a torch.Tensor, got {type(t).__name__}.")
    if t.dim() != ndim:
        raise InputError(
            f"Expected {name} to have {ndim} dims {layout}, got {t.dim()} dims with shape {tuple(t.shape)}."
        )
    if t.numel() > 0 and t.stride(-1) != 1:
        raise InputError(
            f"Expected {name} to have a contiguous last dim (stride 1), got strides {tuple(t.stride())}; "
            f"call {name}.contiguous() or pass a view whose head dim is contiguous."
        )


def _validate_dtypes(**tensors: Optional[torch.Tensor]) -> torch.dtype:
    named = {k: v for k, v in tensors.items() if v is not None}
    first_name, first = next(iter(named.items()))
    for name, t in named.items():
        if t.dtype != first.dtype:
            raise InputError(
                f"Expected all inputs to share one dtype, got {first_name}.dtype={first.dtype} "
                f"and {name}.dtype={t.dtype}."
            )
    if first.dtype not in SUPPORTED_DTYPES:
        raise InputTypeError(f"Expected dtype float16, bfloat16 or float32, got {first.dtype}.")
    if first.dtype == torch.bfloat16:
        target = device_target(first.device)
        if target is None and is_interpreter():  # the interpreter would run it (planning_for a card runs nothing)
            raise NotImplementedError(
                "bfloat16 is not supported under the Triton interpreter (TRITON_INTERPRET=1): its tl.dot "
                "gives wrong results for bf16 inputs. Use float16/float32 on the CPU; bf16 runs on a GPU."
            )
        if target is not None and target.capability < (8, 0):
            raise NotImplementedError(
                f"bfloat16 needs a GPU of compute capability 8.0 or newer (Ampere); {target.name} is "
                f"{target.capability[0]}.{target.capability[1]}. Use float16 there."
            )
    return first.dtype


def _validate_devices(**tensors: Optional[torch.Tensor]) -> torch.device:
    named = {k: v for k, v in tensors.items() if v is not None}
    first_name, first = next(iter(named.items()))
    for name, t in named.items():
        if t.device != first.device:
            raise InputError(
                f"Expected all inputs on one device, got {first_name} on {first.device} and {name} on {t.device}."
            )
    if first.device.type == "cuda":
        return first.device
    if first.device.type == "cpu":
        if not is_interpreter():
            raise InputError(
                "Got CPU tensors, but Triton kernels need a CUDA device; on a machine without a GPU set "
                "TRITON_INTERPRET=1 before importing kernels to run them under the Triton interpreter."
            )
        return first.device
    raise InputError(f"Expected CUDA tensors (or CPU tensors under the interpreter), got device {first.device}.")


def _validate_head_dim(head_dim: int) -> None:
    if not (MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM):
        raise InputError(f"Expected head_dim between {MIN_HEAD_DIM} and {MAX_HEAD_DIM}, got {head_dim}; the kernels "
                         f"take any head dim in that range.")


def _validate_heads(nheads: int, nheads_k: int) -> None:
    if nheads_k < 1 or nheads % nheads_k != 0:
        raise InputError(
            f"Expected nheads ({nheads}) to be divisible by nheads_k ({nheads_k}); GQA needs whole groups."
        )


def _validate_dropout(dropout_p) -> float:
    """dropout_p: a number in [0, 1) (1 would drop everything and scale by 1 / 0); returns it as a float."""
    if isinstance(dropout_p, (bool, torch.Tensor)) or not isinstance(dropout_p, numbers.Real):
        raise InputTypeError(f"Expected dropout_p to be a float in [0, 1), got {type(dropout_p).__name__}.")
    if not 0.0 <= dropout_p < 1.0:
        raise InputError(f"Expected dropout_p in [0, 1), got {dropout_p}.")
    return float(dropout_p)


def _validate_alibi_slopes(alibi_slopes, batch: int, nheads: int, device) -> torch.Tensor:
    """ALiBi's slopes: float32 (nheads,) or (batch, nheads) on q's device (flash-attn's rule); returns
    them with a contiguous last dim."""
    if not isinstance(alibi_slopes, torch.Tensor):
        raise InputTypeError(f"Expected alibi_slopes to be a torch.Tensor or None, got {type(alibi_slopes).__name__}.")
    if alibi_slopes.dtype != torch.float32:
        raise InputTypeError(f"Expected alibi_slopes of dtype float32, got {alibi_slopes.dtype}.")
    if tuple(alibi_slopes.shape) not in ((nheads,), (batch, nheads)) or alibi_slopes.device != device:
        raise InputError(f"Expected alibi_slopes of shape ({nheads},) or ({batch}, {nheads}) on {device}, got "
                         f"{tuple(alibi_slopes.shape)} on {alibi_slopes.device}.")
    return alibi_slopes if alibi_slopes.stride(-1) == 1 else alibi_slopes.contiguous()


def _validate_sinks(sinks, nheads: int, device) -> None:
    """Attention sinks: a floating (nheads,) tensor on q's device, one logit per query head."""
    if not isinstance(sinks, torch.Tensor):
        raise InputTypeError(f"Expected sinks to be a torch.Tensor or None, got {type(sinks).__name__}.")
    if not sinks.is_floating_point():
        raise InputTypeError(f"Expected sinks of a floating dtype, got {sinks.dtype}.")
    if tuple(sinks.shape) != (nheads,) or sinks.device != device:
        raise InputError(f"Expected sinks of shape ({nheads},) (one per query head) on {device}, got "
                         f"{tuple(sinks.shape)} on {sinks.device}.")


def _check_block_table_entries(block_table: torch.Tensor, host_lengths, seqlen_new: int, page_size: int,
                               num_blocks: int, window_left: int = -1, seqlen_q: int = 0) -> None:
    """Raise ValueError if a CPU block_table entry that the call uses lies outside [0, num_blocks).

    With host-known lengths (an int or a CPU tensor) request b uses its first
    ceil((L_b + seqlen_new) / page_size) entries and only those are checked (the rest may hold
    anything, e.g. -1); without them (lengths on the GPU) every entry is. With a sliding window's left
    side (window_left >= 0, seqlen_q query tokens) the pages wholly before request b's band, whose
    first key is L_b + seqlen_new - seqlen_q - window_left, are not used either (a cache may have
    freed them).
    """
    table = block_table.to(torch.int64)
    bad = (table < 0) | (table >= num_blocks)  # (batch, max_blocks)
    if host_lengths is not None:
        if isinstance(host_lengths, int):
            host_lengths = torch.full((table.shape[0],), host_lengths, dtype=torch.int64)
        n_keys = host_lengths.to(torch.int64).clamp(min=0) + seqlen_new
        n_pages = (n_keys + page_size - 1) // page_size
        first = torch.zeros_like(n_pages)
        if window_left >= 0:
            first = (n_keys - seqlen_q - window_left).clamp(min=0) // page_size
        j = torch.arange(table.shape[1])[None, :]
        bad &= (j >= first[:, None]) & (j < n_pages[:, None])
    if not bool(bad.any()):
        return
    b, j = (int(i) for i in bad.nonzero()[0])
    which = (f"request {b} uses entries {int(first[b])} to {int(n_pages[b]) - 1}" if host_lengths is not None
             else "cache_seqlens is on the GPU, so every entry is checked")
    raise InputError(
        f"Expected block_table entries in [0, num_blocks = {num_blocks}) (physical blocks of k_cache), got "
        f"block_table[{b}, {j}] = {int(table[b, j])} ({which}); entries past a request's pages may hold any value."
    )


def _validate_max_seqlen(name: str, value) -> int:
    """max_seqlen_q / max_seqlen_k: a host int >= 0 (a tensor would need a device sync to read)."""
    if isinstance(value, (bool, torch.Tensor)) or not hasattr(value, "__index__"):
        raise InputTypeError(
            f"Expected {name} to be a Python int >= 0 (the longest sequence, known on the host), "
            f"got {type(value).__name__}."
        )
    value = int(value)
    if value < 0:
        raise InputError(f"Expected {name} >= 0, got {value}.")
    return value


def _validate_cu_seqlens(name: str, cu_seqlens, device: torch.device) -> None:
    """Checks of cu_seqlens that need no device sync: type, dtype int32, 1-D (batch + 1,), device."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise InputTypeError(f"Expected {name} to be a torch.Tensor, got {type(cu_seqlens).__name__}.")
    if cu_seqlens.dtype != torch.int32:
        raise InputTypeError(
            f"Expected {name} to have dtype torch.int32 (flash-attn's layout), got {cu_seqlens.dtype}; "
            f"pass {name}.to(torch.int32)."
        )
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise InputError(
            f"Expected {name} to be 1-D with batch + 1 >= 1 entries (prefix sums of the sequence lengths, "
            f"starting at 0), got shape {tuple(cu_seqlens.shape)}."
        )
    if cu_seqlens.device != device:
        raise InputError(f"Expected {name} on the inputs' device {device}, got {cu_seqlens.device}.")


def _validate_cu_seqlens_values(name: str, cu_seqlens: torch.Tensor, total: Optional[int], max_seqlen: int,
                                max_name: str) -> None:
    """Value checks of a CPU cu_seqlens (reading a CUDA one would sync): starts at 0, never
    decreases, ends at the packed row count (unless total is None: keys in a paged pool), no
    sequence longer than max_seqlen."""
    values = cu_seqlens.tolist()
    if values[0] != 0:
        raise InputError(f"Expected {name}[0] == 0 (prefix sums start at 0), got {values[0]}.")
    lengths = [b - a for a, b in zip(values[:-1], values[1:])]
    bad = next((i for i, n in enumerate(lengths) if n < 0), None)
    if bad is not None:
        raise InputError(
            f"Expected {name} to be non-decreasing (sequence lengths >= 0), got {name}[{bad}] = {values[bad]} > "
            f"{name}[{bad + 1}] = {values[bad + 1]}."
        )
    if total is not None and values[-1] != total:
        raise InputError(
            f"Expected {name}[-1] ({values[-1]}) to equal the number of packed rows ({total}); "
            f"cu_seqlens must end at the total length of the packed tensor."
        )
    longest = max(lengths, default=0)
    if longest > max_seqlen:
        raise InputError(
            f"Expected {max_name} ({max_seqlen}) >= the longest sequence in {name} ({longest}); "
            f"rows past {max_name} would never be computed."
        )
