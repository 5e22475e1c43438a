"""The one place that knows hardware: tile, warp and pipeline-stage choices per GPU class.

Configs are picked by a table, not by `triton.autotune`: a fixed choice per (GPU class, head dim,
dtype, causal) compiles once, never re-tunes while shapes change (so CUDA graphs and serving loops
stay stable), and keeps test compilation cheap. The tables were measured on an H200 (see
results/ and scripts/tune_prefill.py); GPUs with less shared memory per block than Hopper (the
L4 has 99 KB) get tiles that fit it. Under the interpreter one small config is used.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._utils import device_capability, device_smem_bytes, is_interpreter

HOPPER_SMEM = 200 * 1024  # a device with at least this much smem per block gets the big-tile table


@dataclass(frozen=True)
class AttnConfig:
    """Launch parameters of one attention kernel."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    use_tma: bool = False  # Hopper tensor descriptors for tile loads (capability >= 9 only)

    def as_dict(self) -> dict:
        return {
            "block_m": self.block_m,
            "block_n": self.block_n,
            "num_warps": self.num_warps,
            "num_stages": self.num_stages,
            "use_tma": self.use_tma,
        }


INTERPRETER_CONFIG = AttnConfig(block_m=32, block_n=32, num_warps=4, num_stages=1)

# Hopper (H100/H200, 227 KB smem): measured on an H200, see results/.
# key: (head_dim_pad, causal) -> config for 2-byte dtypes
_HOPPER_FWD = {
    (16, False): AttnConfig(128, 128, 4, 3, True),
    (32, False): AttnConfig(128, 128, 4, 3, True),
    (64, False): AttnConfig(128, 128, 4, 3, True),
    (128, False): AttnConfig(128, 128, 8, 3, True),
    (256, False): AttnConfig(128, 64, 8, 2, True),
    (16, True): AttnConfig(128, 128, 4, 3, True),
    (32, True): AttnConfig(128, 128, 4, 3, True),
    (64, True): AttnConfig(128, 128, 4, 3, True),
    (128, True): AttnConfig(128, 128, 8, 3, True),
    (256, True): AttnConfig(128, 64, 8, 2, True),
}

# Ampere/Ada and other GPUs with ~100 KB smem per block (Colab's L4): tiles that fit.
_SMALL_SMEM_FWD = {
    16: AttnConfig(128, 64, 4, 3),
    32: AttnConfig(128, 64, 4, 3),
    64: AttnConfig(128, 64, 4, 3),
    128: AttnConfig(128, 64, 8, 2),
    256: AttnConfig(64, 32, 4, 2),
}


def prefill_fwd_config(head_dim_pad: int, dtype: torch.dtype, causal: bool, device: torch.device) -> AttnConfig:
    """Tile config for the prefill forward kernel on `device`."""
    if is_interpreter() or device.type != "cuda":
        return INTERPRETER_CONFIG
    index = device.index if device.index is not None else torch.cuda.current_device()
    if dtype == torch.float32:  # 4-byte tiles: halve what a 2-byte config would stage
        return AttnConfig(64, 32, 4, 2)
    major, _ = device_capability(index)
    if major >= 9 and device_smem_bytes(index) >= HOPPER_SMEM:
        return _HOPPER_FWD[(head_dim_pad, causal)]
    return _SMALL_SMEM_FWD[head_dim_pad]


# Backward: (dK/dV config, dQ config). dK/dV programs own BLOCK_N keys and stream queries in
# BLOCK_M steps; dQ programs own BLOCK_M queries and stream keys in BLOCK_N steps.
_HOPPER_BWD = {
    16: (AttnConfig(64, 128, 4, 3), AttnConfig(128, 64, 4, 3)),
    32: (AttnConfig(64, 128, 4, 3), AttnConfig(128, 64, 4, 3)),
    64: (AttnConfig(64, 128, 8, 3), AttnConfig(128, 64, 8, 3)),
    128: (AttnConfig(64, 128, 8, 2), AttnConfig(128, 64, 8, 2)),
    256: (AttnConfig(32, 64, 4, 2), AttnConfig(64, 32, 4, 2)),
}
_SMALL_SMEM_BWD = {
    16: (AttnConfig(32, 64, 4, 2), AttnConfig(64, 32, 4, 2)),
    32: (AttnConfig(32, 64, 4, 2), AttnConfig(64, 32, 4, 2)),
    64: (AttnConfig(32, 64, 4, 2), AttnConfig(64, 32, 4, 2)),
    128: (AttnConfig(32, 64, 4, 2), AttnConfig(64, 32, 4, 2)),
    256: (AttnConfig(16, 32, 4, 1), AttnConfig(32, 16, 4, 1)),
}


def prefill_bwd_config(
    head_dim_pad: int, dtype: torch.dtype, causal: bool, device: torch.device
) -> tuple[AttnConfig, AttnConfig]:
    """(dK/dV config, dQ config) for the prefill backward kernels on `device`."""
    if is_interpreter() or device.type != "cuda":
        return INTERPRETER_CONFIG, INTERPRETER_CONFIG
    index = device.index if device.index is not None else torch.cuda.current_device()
    major, _ = device_capability(index)
    big = major >= 9 and device_smem_bytes(index) >= HOPPER_SMEM
    if dtype == torch.float32:
        return (AttnConfig(32, 64, 4, 1), AttnConfig(64, 32, 4, 1)) if big else (
            AttnConfig(16, 32, 4, 1), AttnConfig(32, 16, 4, 1))
    return (_HOPPER_BWD if big else _SMALL_SMEM_BWD)[head_dim_pad]
