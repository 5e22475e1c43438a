"""Which Triton (and, under the interpreter, which numpy) the library runs with: checked once, at import.

The kernels are tested on every Triton release from TRITON_MIN to TRITON_NEWEST_TESTED: compiled on a GPU
with the Triton the GPU image ships, and under the interpreter plus cross-compiled for sm_75 / sm_80 / sm_89 /
sm_90 in CPU CI for each release of the range (README, "Install"). Paths that depend on a Triton API (the
Gluon Hopper forward, the direct C launch of launch/fast.py) are chosen by detecting that API, never by the
version number, with the portable path as the fallback. Outside the range:

- older than TRITON_MIN: ImportError naming the version found and the minimum (no kernel path is tested
  there);
- newer than TRITON_NEWEST_TESTED: one warning (what was tested, what was found), then carry on.

Triton 3.5 and 3.6's interpreter fails on numpy >= 2.4 (`only 0-dimensional arrays can be converted to
Python scalars` inside the first kernel); that combination raises at import with the fix, rather than
failing inside a kernel. Compiled runs (a GPU) are not affected.
"""

from __future__ import annotations

import os
import warnings
from typing import Tuple

TRITON_MIN = (3, 5)
TRITON_NEWEST_TESTED = (3, 9)
NUMPY_INTERPRETER_BOUND = {(3, 5): (2, 4), (3, 6): (2, 4)}  # Triton -> first numpy its interpreter fails with


def release(version: str) -> Tuple[int, int]:
    """(major, minor) of a version string ("3.6.0+git1234" -> (3, 6)); (0, 0) when it has no such prefix."""
    parts = []
    for part in version.split("+")[0].split(".")[:2]:
        digits = "".join(ch for ch in part if ch.isdigit()) if part[:1].isdigit() else ""
        if not digits:
            break
        parts.append(int(digits))
    return (parts[0], parts[1]) if len(parts) == 2 else (0, 0)


def _text(version: Tuple[int, int]) -> str:
    return "%d.%d" % version


def check(triton_version: str, numpy_version: str, interpreting: bool) -> None:
    """Raise ImportError for a Triton too old or an interpreter/numpy pair known to fail; warn once for a
    Triton newer than the tested range."""
    found = release(triton_version)
    if found < TRITON_MIN:
        raise ImportError(f"tritonattn needs Triton >= {_text(TRITON_MIN)}; found Triton {triton_version}. Install "
                          f"the torch build that ships a newer one (torch >= 2.9 brings Triton >= 3.5).")
    if found > TRITON_NEWEST_TESTED:
        warnings.warn(f"tritonattn is tested with Triton {_text(TRITON_MIN)} to {_text(TRITON_NEWEST_TESTED)}; "
                      f"found Triton {triton_version}. Carrying on: report anything that fails.", stacklevel=3)
    bound = NUMPY_INTERPRETER_BOUND.get(found)
    if interpreting and bound is not None and release(numpy_version) >= bound:
        raise ImportError(f"Triton {triton_version}'s interpreter (TRITON_INTERPRET=1) fails with numpy >= "
                          f"{_text(bound)}; found numpy {numpy_version}. Run `pip install 'numpy<{_text(bound)}'` "
                          f"and restart Python (Triton >= 3.7 does not need this).")


def check_installed() -> None:
    """`check` on the installed Triton and numpy, as the library is about to use them."""
    import numpy
    import triton

    check(triton.__version__, numpy.__version__, os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"))


check_installed()  # at the package's import, before any kernel is decorated
