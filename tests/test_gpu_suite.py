"""scripts/gpu_suite.py's two parts are the whole suite: every decode-part file exists, and the rest is tests/
without exactly those files."""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
import gpu_suite  # noqa: E402


def test_parts_partition_the_suite():
    decode = gpu_suite.pytest_args("decode")
    rest = gpu_suite.pytest_args("rest")
    assert all((REPO / path).is_file() for path in decode), decode
    assert rest[0] == "tests" and sorted(rest[1:]) == sorted(f"--ignore={path}" for path in decode)
    assert len(set(decode)) == len(decode) > 0
