"""pytest setup: interpreter switch, import guard, markers, device fixtures.

Order matters: TRITON_INTERPRET must be set before `triton` decorates the kernels, which happens
when `kernels` is first imported, so this file decides it before importing anything else.
"""

import os
import sys
from pathlib import Path

import torch  # only to ask whether a GPU exists; triton and kernels come after the switch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

TESTS_DIR = Path(__file__).resolve().parent
REPO_ROOT = TESTS_DIR.parent
for path in (str(REPO_ROOT), str(TESTS_DIR)):  # `import kernels` and `from helpers import ...`
    if path not in sys.path:
        sys.path.insert(0, path)

import pytest  # noqa: E402

import kernels  # noqa: E402

# PyPI has an unrelated package called `kernels`: make sure we test this repo's.
assert Path(kernels.__file__).resolve().is_relative_to(REPO_ROOT), (
    f"imported kernels from {kernels.__file__}, not from this repo ({REPO_ROOT}); "
    f"uninstall the other package or run pytest from the repo root"
)

from helpers import DEVICE, INTERPRET, ON_GPU  # noqa: E402

# The references compute in true fp32 on the GPU (no tf32 in the ground truth).
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one)")
    config.addinivalue_line("markers", "slow: long-running (large shapes); deselect with -m 'not slow'")


def pytest_collection_modifyitems(config, items):
    if ON_GPU:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (compiled Triton); this run has none")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def pytest_report_header(config):
    mode = "compiled on " + torch.cuda.get_device_name() if ON_GPU else "Triton interpreter (CPU)"
    return f"kernels: {kernels.__file__} | device: {DEVICE} | {mode}"


@pytest.fixture(scope="session")
def device() -> torch.device:
    """Where test tensors live: cuda when present, else cpu (run by the interpreter)."""
    return DEVICE


@pytest.fixture(scope="session")
def on_gpu() -> bool:
    """True when kernels run compiled on a real GPU."""
    return ON_GPU


@pytest.fixture(scope="session")
def interpret() -> bool:
    """True when kernels run under the Triton interpreter."""
    return INTERPRET
