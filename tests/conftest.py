"""pytest setup: interpreter switch, import guard, markers, device fixtures.

Order matters: TRITON_INTERPRET must be set before `triton` decorates the kernels, which happens
when `tritonattn` is first imported, so this file decides it before importing anything else.
"""

import fcntl
import gc
import os
import sys
import tempfile
import zlib
from pathlib import Path

import torch  # only to ask whether a GPU exists; triton and tritonattn come after the switch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

TESTS_DIR = Path(__file__).resolve().parent
REPO_ROOT = TESTS_DIR.parent
# kernels/ is the library's source root (`import tritonattn`), the root holds the harness (`import benchmarks`),
# tests/ the helpers (`from helpers import ...`).
for path in (str(REPO_ROOT), str(REPO_ROOT / "kernels"), str(TESTS_DIR)):
    if path not in sys.path:
        sys.path.insert(0, path)

import pytest  # noqa: E402

import tritonattn  # noqa: E402

# An installed copy (pip install . of another checkout) must not stand in for this one.
assert Path(tritonattn.__file__).resolve().is_relative_to(REPO_ROOT), (
    f"imported tritonattn from {tritonattn.__file__}, not from this repo ({REPO_ROOT}); "
    f"uninstall the other copy (pip uninstall tritonattn) or run pytest from the repo root"
)

from helpers import DEVICE, INTERPRET, ON_GPU  # noqa: E402

# The references compute in true fp32 on the GPU (no tf32 in the ground truth).
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one)")
    config.addinivalue_line("markers", "slow: long-running (large shapes); deselect with -m 'not slow'")


UPSTREAM_DIR = TESTS_DIR / "upstream"


def pytest_ignore_collect(collection_path, config):
    """tests/upstream (flash-attention's own tests: GPU, einops, a fetched file) runs only when a path
    inside it is named, e.g. `python -m pytest tests/upstream ...` (see tests/upstream/conftest.py)."""
    if Path(collection_path).resolve() != UPSTREAM_DIR:
        return None
    root = config.invocation_params.dir
    named = ((root / arg.split("::", 1)[0]).resolve() for arg in config.args)
    return None if any(p == UPSTREAM_DIR or UPSTREAM_DIR in p.parents for p in named) else True


def pytest_collection_modifyitems(config, items):
    if ON_GPU:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (compiled Triton); this run has none")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def pytest_report_header(config):
    mode = "compiled on " + torch.cuda.get_device_name() if ON_GPU else "Triton interpreter (CPU)"
    return f"tritonattn: {tritonattn.__file__} | device: {DEVICE} | {mode}"


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


# pytest-xdist runs many workers on one GPU: the `slow` tests (buffers of 2^31+ elements, 10-40 GiB
# with their references) could run at the same time and exhaust its memory, and the caching allocator
# keeps what a test freed for that worker's later tests. So `slow` tests take a file lock shared by
# all workers of the machine, and a test that leaves more than this much cached gives it back.
_KEEP_CACHED_BYTES = 4 << 30
_SLOW_LOCK = Path(tempfile.gettempdir()) / "tritonattn-tests-slow-gpu.lock"


@pytest.fixture(autouse=True)
def _seeded(request):
    """Each test draws fresh random inputs, the same ones on every run: torch's generators (CPU and CUDA)
    are seeded from the test's id, so a failure reproduces and a bound is never met by luck of the draw."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))
    yield


@pytest.fixture(autouse=True)
def _share_gpu_memory(request):
    """On a GPU: `slow` tests run one at a time across workers; big caches are emptied after each test."""
    if not ON_GPU:
        yield
        return
    lock = None
    if "slow" in request.keywords:
        lock = open(_SLOW_LOCK, "w")
        fcntl.flock(lock, fcntl.LOCK_EX)
    try:
        yield
    finally:
        if torch.cuda.memory_reserved() > _KEEP_CACHED_BYTES:
            gc.collect()
            torch.cuda.empty_cache()
        if lock is not None:
            fcntl.flock(lock, fcntl.LOCK_UN)
            lock.close()
