"""The supported Triton range (tritonattn._versions): a Triton too old raises at import with the version found
and the minimum, a newer one than tested warns once and carries on, and an interpreter known to fail with the
installed numpy says so before any kernel runs. Version-specific paths are chosen by detecting their API."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

from tritonattn import _versions
from tritonattn.config.tables import GLUON_SM90_API, gluon_sm90_available
from tritonattn.launch.fast import flat_launch_abi

REPO = Path(__file__).resolve().parents[1]


def test_release_parses_local_and_dev_versions():
    """(major, minor) of release, local and pre-release strings; (0, 0) for a string without one."""
    assert _versions.release("3.6.0") == (3, 6)
    assert _versions.release("3.5.1+git1234abcd") == (3, 5)
    assert _versions.release("3.10.0rc1") == (3, 10)
    assert _versions.release("unknown") == (0, 0)


def test_too_old_a_triton_raises_with_the_minimum():
    """Below the range: ImportError naming what was found and what is needed."""
    with pytest.raises(ImportError, match=r"needs Triton >= 3\.5; found Triton 3\.4\.0"):
        _versions.check("3.4.0", "2.3.5", interpreting=False)


def test_the_tested_range_is_silent_and_a_newer_triton_warns():
    """Every release of the range imports silently; a newer one warns once, naming both, and carries on."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for minor in range(_versions.TRITON_MIN[1], _versions.TRITON_NEWEST_TESTED[1] + 1):
            _versions.check(f"3.{minor}.0", "2.3.5", interpreting=False)
    newer = "%d.%d.0" % (_versions.TRITON_NEWEST_TESTED[0], _versions.TRITON_NEWEST_TESTED[1] + 1)
    with pytest.warns(UserWarning, match=rf"tested with Triton 3\.5 to 3\.9; found Triton {newer}"):
        _versions.check(newer, "2.3.5", interpreting=False)


def test_interpreter_with_a_numpy_it_fails_on_raises_with_the_fix():
    """Triton 3.5 / 3.6's interpreter with numpy >= 2.4: ImportError with the pip command; compiled runs and
    Triton >= 3.7 are not affected."""
    for triton_version in ("3.5.1", "3.6.0"):
        with pytest.raises(ImportError, match=r"pip install 'numpy<2\.4'"):
            _versions.check(triton_version, "2.4.6", interpreting=True)
        _versions.check(triton_version, "2.4.6", interpreting=False)
        _versions.check(triton_version, "2.3.5", interpreting=True)
    _versions.check("3.7.1", "2.4.6", interpreting=True)


def test_import_refuses_an_old_triton_before_any_kernel():
    """`import tritonattn` with a Triton that reports 3.4 raises the range's ImportError (a stub Triton module
    stands in: only its version is read before the check)."""
    code = textwrap.dedent("""
        import sys, types
        stub = types.ModuleType("triton"); stub.__version__ = "3.4.0"
        sys.modules["triton"] = stub
        try:
            import tritonattn
        except ImportError as e:
            print("ImportError:", e)
    """)
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=str(REPO / "kernels")))
    assert "ImportError: tritonattn needs Triton >= 3.5; found Triton 3.4.0" in run.stdout, run.stdout + run.stderr


def test_launch_abi_is_detected_from_the_launcher_signature():
    """The direct C launch is used only behind a launcher of the flat ABI (Triton 3.5 / 3.6's CudaLauncher);
    a launcher that names the metadata and hooks (3.7 and newer) keeps Triton's runner."""
    class Flat:
        def __call__(self, gridX, gridY, gridZ, stream, function, *args):
            pass

    class Named:
        def __call__(self, gridX, gridY, gridZ, stream, function, kernel_metadata, launch_metadata,
                     launch_enter_hook, launch_exit_hook, *args):
            pass

    assert flat_launch_abi(Flat) and not flat_launch_abi(Named)


def test_gluon_api_is_detected_by_name():
    """The Hopper forward's Gluon API as found in each release of the range: Triton 3.5's Gluon lacks part
    of it (gl.num_warps, tma.make_tensor_descriptor), 3.6 to 3.9 have all of it."""
    import triton

    found = _versions.release(triton.__version__)
    if found > _versions.TRITON_NEWEST_TESTED:
        pytest.skip(f"Triton {triton.__version__} is newer than the tested range")
    assert gluon_sm90_available() == (found >= (3, 6)), (triton.__version__, GLUON_SM90_API)
