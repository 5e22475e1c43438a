"""Run the compiled test suite on a GPU in two parts of about equal time.

On one H100 at `-n 16` the whole of `tests/` takes about 8.5 minutes (the decode part 247 s, the rest 262 s,
both measured on an NVIDIA H100 80GB HBM3 with torch 2.11 and Triton 3.6); a part fits a machine call of
well under 10 minutes. Together the two parts are exactly `python -m pytest tests`: the decode part is the
files in DECODE_FILES, the rest is every other file (tests/upstream excluded, as `pytest tests` collects
it only with its fetched file).

    python scripts/gpu_suite.py decode              # -n 16 by default; extra arguments go to pytest
    python scripts/gpu_suite.py rest -n 8 -x

Exit status: pytest's.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
# The KV-cache and decode files: about half of the suite's compiled time.
DECODE_FILES = ("test_decode_variants", "test_decode", "test_paged", "test_chunked_prefill", "test_cache_leftpad",
                "test_head_dims", "test_varlen_paged", "test_config_fitness", "test_serving",
                "test_reference_baselines")


def pytest_args(part: str) -> list:
    """The pytest arguments (before the caller's) that select `part` ("decode" or "rest") of tests/."""
    if part == "decode":
        return [f"tests/{name}.py" for name in DECODE_FILES]
    if part == "rest":
        return ["tests"] + [f"--ignore=tests/{name}.py" for name in DECODE_FILES]
    raise SystemExit(f"usage: {sys.argv[0]} decode|rest [pytest arguments]; got part {part!r}")


def main(argv: list) -> int:
    if not argv:
        raise SystemExit(f"usage: {sys.argv[0]} decode|rest [pytest arguments]")
    extra = argv[1:] or ["-n", "16", "-q", "-p", "no:cacheprovider", "-rfE"]
    return subprocess.run([sys.executable, "-m", "pytest", *pytest_args(argv[0]), *extra], cwd=REPO_ROOT).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
