"""What every notebook's first code cell calls once it has found (or, on Colab, cloned) the repository:
install what the runtime lacks, pick the device, import this repository's `tritonattn`, print the environment.

It runs before anything imports `tritonattn`: without a GPU the kernels run under the Triton interpreter,
and TRITON_INTERPRET must be set before Triton decorates them.

What it installs, and only on Colab (elsewhere it says what to run): `requirements.txt` (numpy, matplotlib,
pandas, tqdm), and Triton where the runtime has none (Colab's CPU runtime), the release paired with the
installed torch. Never torch: the runtime's build is the one that matches its driver.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional, Tuple

# The Triton release each torch release requires on Linux (its wheel's `Requires-Dist: triton==...`): what a
# runtime whose torch came without Triton (a CPU build) gets, so that the interpreter matches the compiler
# a GPU build of the same torch would bring.
TRITON_FOR_TORCH: Dict[Tuple[int, int], str] = {
    (2, 9): "3.5.1",
    (2, 10): "3.6.0",
    (2, 11): "3.6.0",
    (2, 12): "3.7.0",
    (2, 13): "3.7.1",
    (2, 14): "3.8.0",
}
NO_GPU_LINE = ("No GPU in this runtime: choose Runtime > Change runtime type > L4 for the real kernels; going on "
               "with the Triton interpreter and small shapes.")


def _minor(version: str) -> Tuple[int, int]:
    parts = [int(p) for p in version.split("+")[0].split(".")[:2] if p.isdigit()]
    return (parts + [0, 0])[0], (parts + [0, 0])[1]


def on_colab() -> bool:
    return "google.colab" in sys.modules


def pip_install(args: List[str], step: str) -> None:
    """`python -m pip install -q <args>`; raises RuntimeError naming the step and the command to run by hand."""
    cmd = [sys.executable, "-m", "pip", "install", "-q", *args]
    run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode:
        tail = (run.stderr or run.stdout).strip().splitlines()[-1:] or ["no output"]
        raise RuntimeError(f"{step} failed ({tail[0]}); run `{' '.join(['pip', 'install', *args])}` in a cell, "
                           "then this cell again.")


def triton_for_torch(torch_version: str) -> Optional[str]:
    """The Triton release paired with `torch_version` (None when the table does not know it)."""
    return TRITON_FOR_TORCH.get(_minor(torch_version))


def ensure_packages(root: Path) -> None:
    """On Colab: install requirements.txt, and Triton when the runtime has none. Elsewhere: name what is missing."""
    import torch  # the runtime's own; never installed or upgraded here

    has_triton = importlib.util.find_spec("triton") is not None
    paired = triton_for_torch(torch.__version__)
    if not on_colab():
        if not has_triton:
            pin = f"triton=={paired}" if paired else "triton"
            raise ImportError(f"Triton is not installed next to torch {torch.__version__}: run `pip install {pin}`.")
        return
    pip_install(["-r", str(Path(root) / "requirements.txt")], "Installing requirements.txt")
    if not has_triton:
        if paired is None:
            raise RuntimeError(f"This runtime's torch {torch.__version__} came without Triton and its pairing is "
                               "not known here; run `pip install triton` in a cell, then this cell again.")
        pip_install([f"triton=={paired}"], f"Installing Triton {paired} (paired with torch {torch.__version__})")
        importlib.invalidate_caches()


def setup(root: Path):
    """Install what is missing (Colab), pick the device (cuda, or the CPU with TRITON_INTERPRET=1), import
    `tritonattn` from `root` and check it is this repository's, print the environment; returns (ON_GPU, DEVICE)."""
    ensure_packages(root)
    import torch  # only to ask for a GPU: triton and tritonattn are imported after the switch below

    on_gpu = torch.cuda.is_available()
    if not on_gpu:
        os.environ["TRITON_INTERPRET"] = "1"  # before the first `import tritonattn`: Triton reads it at decoration
        if on_colab():
            print(NO_GPU_LINE)
    source_root = str(Path(root) / "kernels")
    if source_root not in sys.path:
        sys.path.insert(0, source_root)
    import tritonattn

    found = Path(getattr(tritonattn, "__file__", None) or "/").resolve()
    if (Path(root) / "kernels" / "tritonattn").resolve() not in found.parents:
        raise ImportError(f"`import tritonattn` found {found}, not this repository's package "
                          f"({Path(root) / 'kernels' / 'tritonattn'}): run `pip uninstall -y tritonattn`, restart "
                          "the runtime, and run this cell again.")
    mode = "compiled Triton kernels" if on_gpu else "Triton interpreter on the CPU, small shapes"
    print(f"device: {'cuda' if on_gpu else 'cpu'} ({mode})")
    for key, value in tritonattn.env_summary().items():
        print(f"{key:>18}: {value}")
    return on_gpu, torch.device("cuda" if on_gpu else "cpu")
