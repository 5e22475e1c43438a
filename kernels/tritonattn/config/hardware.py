"""What the GPU is: the interpreter switch, the device's capability, shared memory and SM count
(`Target`, `device_target`), the cards the tables are proven on (`TARGETS`), the capability tests every
path asks (`has_tma`, `supports_bf16`), and the environment summary notebooks and benchmarks print.

Nothing here queries the GPU driver at import time: `triton.runtime.driver.active` fails on a
machine without a GPU even under the interpreter, so every device query lives inside a function
and is cached per device.
"""

from __future__ import annotations

import contextlib
import functools
import os
import platform
from dataclasses import dataclass
from typing import Iterator, Optional, Tuple

import torch
import triton


# --------------------------------------------------------------------------------------------
# Environment
# --------------------------------------------------------------------------------------------
def is_interpreter() -> bool:
    """True when Triton kernels run under the CPU interpreter (TRITON_INTERPRET=1).

    The variable must be set before `triton` decorates the kernels, i.e. before `import tritonattn`.
    """
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# The switches a user sets in the environment (README, "Limits"): read here, nowhere else.
FAST_LAUNCH = os.environ.get("TRITONATTN_FAST_LAUNCH", "1") not in ("0", "")  # at import: launch/fast.py
PDL = os.environ.get("TRITONATTN_PDL", "1") not in ("0", "")  # at import: decode's combine launch


def sm90_switch() -> bool:
    """TRITONATTN_SM90 (read per call): "0" keeps the dense forward off Hopper's warp-specialized kernel."""
    return os.environ.get("TRITONATTN_SM90", "1") != "0"


def sm90_backward_switch() -> bool:
    """TRITONATTN_SM90_BWD (read per call): "1" opts the dense backward in to Hopper's fused kernel (experimental:
    off by default; TRITONATTN_SM90=0 keeps it off too)."""
    return os.environ.get("TRITONATTN_SM90_BWD", "0") == "1" and sm90_switch()


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
    (see `launch.fast.recording`, which also keeps the launches from running)."""
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


def has_tma(target: Target) -> bool:
    """Whether the card has the Tensor Memory Accelerator (tensor-descriptor loads): Hopper (sm_90) and newer."""
    return target.capability[0] >= 9


def bf16_unsupported(target: Target) -> Optional[str]:
    """Why bfloat16 cannot run on the card (it needs sm_80, Ampere, or newer), or None."""
    if target.capability < (8, 0):
        return (f"needs a GPU of compute capability 8.0 or newer (Ampere); {target.name} is "
                f"{target.capability[0]}.{target.capability[1]}")
    return None


def fp8_unsupported(target: Target) -> Optional[str]:
    """Why a float8_e4m3fn KV cache cannot run on the card, or None: Triton converts e4m3 (its
    float8e4nv) only on sm_89 (Ada) and newer; older cards have no such conversion instructions."""
    if target.capability < (8, 9):
        return (f"needs a GPU of compute capability 8.9 or newer (Ada, Hopper): Triton has no e4m3 conversion "
                f"before sm_89, and {target.name} is {target.capability[0]}.{target.capability[1]}")
    return None


def gpu_name() -> str:
    """Name of the present GPU, or 'cpu-interpreter' / 'cpu' without one."""
    if has_gpu():
        return torch.cuda.get_device_name(torch.cuda.current_device())
    return "cpu-interpreter" if is_interpreter() else "cpu"


def env_summary() -> dict:
    """Versions and hardware, printed by notebooks and stored with every benchmark row."""

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
