"""What every notebook's setup cell calls once it has found the repository: pick the device, check the
Triton version, import this repository's `kernels`, print the environment.

Kept apart from nbutils.py because it must run before anything imports `kernels`: without a GPU the
kernels run under the Triton interpreter, and TRITON_INTERPRET must be set before Triton decorates them.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Tuple

# The Triton versions the kernels were compiled and tested with (README, "Install").
TRITON_TESTED = ((3, 6),)


def _version(text: str) -> Tuple[int, ...]:
    return tuple(int(part) for part in text.split("+")[0].split(".")[:2] if part.isdigit())


def check_triton(version: str) -> None:
    """Raise ImportError with what to do when `version` is not a Triton release the kernels were tested with."""
    if _version(version) not in TRITON_TESTED:
        tested = ", ".join(".".join(map(str, v)) for v in TRITON_TESTED)
        raise ImportError(
            f"Triton {version} is installed; these kernels are tested with Triton {tested}.x (see README, Install). "
            f"Install a torch build that ships it (e.g. `pip install torch==2.11.0`, which brings triton 3.6), "
            f"restart the runtime, and run this cell again."
        )


def setup(root: Path):
    """Pick the device (cuda, or the CPU with TRITON_INTERPRET=1), check Triton, import `kernels` from
    `root` and check that it is this repository's, print the environment; returns (ON_GPU, DEVICE)."""
    import torch  # only to ask for a GPU: triton and kernels are imported after the switch below

    on_gpu = torch.cuda.is_available()
    if not on_gpu:
        os.environ["TRITON_INTERPRET"] = "1"  # before the first `import kernels`: Triton reads it at decoration
    import triton

    check_triton(triton.__version__)
    # An unrelated PyPI package is also named `kernels`: forget one imported earlier, then check which we get.
    for name in [m for m in sys.modules if m == "kernels" or m.startswith("kernels.")]:
        if Path(root).resolve() not in Path(getattr(sys.modules[name], "__file__", None) or "/").resolve().parents:
            del sys.modules[name]
    import kernels

    found = Path(getattr(kernels, "__file__", None) or "/").resolve()
    if Path(root).resolve() / "kernels" not in found.parents:
        raise ImportError(
            f"`import kernels` found {found}, not this repository's package ({Path(root) / 'kernels'}). An "
            "unrelated PyPI package is also named `kernels`: run `pip uninstall -y kernels`, restart the runtime, "
            "and run this cell again."
        )
    mode = "compiled Triton kernels" if on_gpu else "Triton interpreter on the CPU, small shapes"
    print(f"repo root: {root}\ndevice:    {'cuda' if on_gpu else 'cpu'} ({mode})")
    for key, value in kernels.env_summary().items():
        print(f"{key:>18}: {value}")
    return on_gpu, torch.device("cuda" if on_gpu else "cpu")
