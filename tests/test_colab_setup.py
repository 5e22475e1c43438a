"""The notebooks' first code cell on a simulated Colab CPU runtime: a stub `google.colab` module, no clone
around (the working directory is empty), the repository URL overridden (TRITONATTN_REPO_URL) to a local bare
repository. The cell clones it, installs requirements.txt through pip (recorded, not run), never asks pip
for torch, asks for Triton only when the runtime has none (then the release paired with its torch), says in
one line that there is no GPU, goes on with the interpreter, and does the same again when re-run without a
second clone. A URL that cannot be cloned stops the cell with one sentence naming the step and the command."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "notebooks"))
from nbsetup import triton_for_torch  # noqa: E402

NOTEBOOK = REPO / "notebooks" / "00_hardening.ipynb"

# Run before the cell, in the child: Colab's module, pip recorded instead of run, and (optionally) a runtime
# without Triton as importlib sees it (find_spec("triton") is None until pip "installs" it).
PRELUDE = textwrap.dedent("""
    import importlib.util, json, os, subprocess, sys, types
    sys.modules["google"] = types.ModuleType("google")
    sys.modules["google.colab"] = types.ModuleType("google.colab")
    PIP_LOG = os.environ["PIP_LOG"]
    _run, _find_spec = subprocess.run, importlib.util.find_spec
    _installed = {"triton": os.environ.get("HIDE_TRITON") != "1"}

    def run(cmd, *args, **kwargs):
        if list(cmd[1:3]) == ["-m", "pip"]:
            with open(PIP_LOG, "a") as f:
                f.write(json.dumps(list(cmd[3:])) + "\\n")
            if any(str(a).startswith("triton") for a in cmd):
                _installed["triton"] = True
            return subprocess.CompletedProcess(cmd, 0, "", "")
        return _run(cmd, *args, **kwargs)

    def find_spec(name, *args, **kwargs):
        if name == "triton" and not _installed["triton"]:
            return None
        return _find_spec(name, *args, **kwargs)

    subprocess.run, importlib.util.find_spec = run, find_spec
""")


def _setup_cell() -> str:
    nb = json.loads(NOTEBOOK.read_text(encoding="utf-8"))
    return "".join(next(c for c in nb["cells"] if c["cell_type"] == "code")["source"])


def _colab(tmp_path: Path, url: str, hide_triton: bool, runs: int = 1) -> subprocess.CompletedProcess:
    """Run the setup cell `runs` times in one fresh Python, as a Colab kernel would, in an empty folder."""
    content = tmp_path / "content"
    content.mkdir(exist_ok=True)
    cell = _setup_cell()
    body = PRELUDE + "\n".join(f"exec(compile({cell!r}, 'setup-cell', 'exec'))\nprint('ROOT', ROOT, ON_GPU)"
                               for _ in range(runs))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRITON_INTERPRET")}
    env.update(TRITONATTN_REPO_URL=url, PIP_LOG=str(tmp_path / "pip.log"), HIDE_TRITON="1" if hide_triton else "0",
               CUDA_VISIBLE_DEVICES="", MPLBACKEND="Agg")
    return subprocess.run([sys.executable, "-c", body], cwd=content, capture_output=True, text=True, env=env,
                          timeout=600)


@pytest.fixture(scope="module")
def bare_repo(tmp_path_factory) -> str:
    """This checkout's HEAD as a bare repository, reachable by URL as GitHub would be. Skipped where the tree
    is a copy whose git HEAD is not the tree's (a working tree shipped to another machine with an old .git)."""
    head = subprocess.run(["git", "-C", str(REPO), "cat-file", "-e", "HEAD:kernels/tritonattn/__init__.py"],
                          capture_output=True)
    if head.returncode:
        pytest.skip("this checkout's git HEAD does not hold kernels/tritonattn/: nothing to clone")
    dest = tmp_path_factory.mktemp("remote") / "tritonattn.git"
    subprocess.run(["git", "clone", "-q", "--bare", "--no-local", str(REPO), str(dest)], check=True)
    return dest.as_uri()


def _pip_calls(tmp_path: Path):
    log = tmp_path / "pip.log"
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


@pytest.mark.parametrize("hide_triton", [False, True], ids=["gpu-image-has-triton", "cpu-runtime-without-triton"])
def test_first_cell_on_colab_clones_installs_and_never_touches_torch(tmp_path, bare_repo, hide_triton):
    """Clone, requirements.txt, the no-GPU line, the interpreter; pip never asked for torch, nor for Triton
    when one is present; a re-run is idempotent (one clone, same root). Where this machine's numpy is one
    its Triton's interpreter fails with, the cell must stop at the import with the library's message."""
    import numpy
    import torch
    import triton

    from tritonattn import _versions

    try:  # what a CPU runtime with this machine's Triton and numpy meets at `import tritonattn`
        _versions.check(triton.__version__, numpy.__version__, interpreting=True)
        refused = None
    except ImportError as exc:
        refused = str(exc)
    run = _colab(tmp_path, bare_repo, hide_triton, runs=2)
    clone = tmp_path / "content" / "tritonattn"
    if refused:  # the cell stops at the import with the library's one-line fix, after cloning and installing
        assert run.returncode != 0 and refused in run.stderr, run.stdout[-2000:] + run.stderr[-3000:]
    else:
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
        roots = [line for line in run.stdout.splitlines() if line.startswith("ROOT ")]
        assert roots == [f"ROOT {clone} False"] * 2, run.stdout
    assert "No GPU in this runtime: choose Runtime > Change runtime type > L4" in run.stdout
    assert (clone / "kernels" / "tritonattn" / "__init__.py").is_file()
    calls = _pip_calls(tmp_path)
    assert calls, "pip was never asked to install requirements.txt"
    assert not any("torch" in arg for call in calls for arg in call), calls
    triton_calls = [call for call in calls if any(arg.startswith("triton") for arg in call)]
    if hide_triton:
        assert triton_calls == [["install", "-q", f"triton=={triton_for_torch(torch.__version__)}"]], calls
    else:
        assert not triton_calls, calls
    assert all(call[:4] == ["install", "-q", "-r", str(clone / "requirements.txt")] for call in calls
               if "-r" in call), calls


def test_first_cell_says_which_step_failed(tmp_path):
    """A URL that cannot be cloned: one sentence naming the clone and the command to run by hand."""
    run = _colab(tmp_path, (tmp_path / "missing.git").as_uri(), hide_triton=False)
    assert run.returncode != 0
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("RuntimeError: Cloning file://") and "`!git clone file://" in last, last
    assert not (tmp_path / "content" / "tritonattn").exists()
    assert not _pip_calls(tmp_path)


def test_first_cell_outside_colab_and_a_clone_says_what_to_do(tmp_path):
    """Neither in a clone nor on Colab: the cell stops with what to do, installing nothing."""
    cell = _setup_cell()
    run = subprocess.run([sys.executable, "-c", cell], cwd=tmp_path, capture_output=True, text=True,
                         env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, timeout=120)
    assert run.returncode != 0
    assert "This notebook runs from its repository: `git clone https://github.com/" in run.stderr, run.stderr[-2000:]
