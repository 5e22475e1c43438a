"""What every notebook builder shares: the cell helpers (md, code, badge), the setup cell that opens
every notebook, and writing / checking notebooks/<name>.ipynb (build, write_notebooks, cli).

scripts/make_notebooks.py (notebooks 00-02 and the list of all), nb_benchmarks.py (03) and
nb_serving.py (04) import this module; it imports none of them.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from pathlib import Path
from typing import List, Tuple

import nbformat

# Fill in once the repository is public: the badges and Colab's `git clone` use it.
GITHUB_REPO = "OWNER/REPO"
BRANCH = "main"

REPO_ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = REPO_ROOT / "notebooks"

Cell = Tuple[str, str]  # ("markdown" | "code", source)


def md(text: str) -> Cell:
    return ("markdown", textwrap.dedent(text).strip("\n"))


def code(text: str) -> Cell:
    return ("code", textwrap.dedent(text).strip("\n"))


def badge(name: str) -> str:
    url = f"https://colab.research.google.com/github/{GITHUB_REPO}/blob/{BRANCH}/notebooks/{name}.ipynb"
    return f"[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)]({url})"


# --------------------------------------------------------------------------------------------
# The setup cell, identical in every notebook
# --------------------------------------------------------------------------------------------
SETUP = code(
    '''
    # Setup (the same cell in every notebook): find or fetch this repo, pick the device, import `kernels`.
    # Works in Colab (clones the repo, installs requirements.txt), locally, and headless (nbmake,
    # scripts/run_notebooks.py). Without a GPU the Triton kernels run on the CPU under the interpreter.
    import os
    import subprocess
    import sys
    from pathlib import Path

    REPO_URL = "https://github.com/__GITHUB_REPO__.git"
    COLAB_CLONE = Path("/content") / "__REPO_NAME__"


    def find_repo_root(start):
        """The nearest folder at or above `start` that holds kernels/__init__.py and pyproject.toml."""
        for folder in (start, *start.parents):
            if (folder / "kernels" / "__init__.py").is_file() and (folder / "pyproject.toml").is_file():
                return folder
        return None


    IN_COLAB = "google.colab" in sys.modules or "COLAB_RELEASE_TAG" in os.environ
    REPO_ROOT = find_repo_root(Path.cwd().resolve())
    if REPO_ROOT is None and IN_COLAB:
        if find_repo_root(COLAB_CLONE) is None:
            subprocess.run(["git", "clone", "--depth", "1", REPO_URL, str(COLAB_CLONE)], check=True)
            requirements = str(COLAB_CLONE / "requirements.txt")  # never replaces Colab's torch/triton
            subprocess.run([sys.executable, "-m", "pip", "install", "-q", "-r", requirements], check=True)
        REPO_ROOT = find_repo_root(COLAB_CLONE)
    if REPO_ROOT is None:
        raise RuntimeError(
            f"Could not find the repo root (a folder holding kernels/__init__.py and pyproject.toml) at or above "
            f"{Path.cwd()}. Open this notebook from a clone of {REPO_URL}, or in Colab."
        )
    for _path in (str(REPO_ROOT / "notebooks"), str(REPO_ROOT)):  # nbutils, then kernels and benchmarks
        if _path in sys.path:
            sys.path.remove(_path)
        sys.path.insert(0, _path)

    import torch  # only to ask for a GPU: triton and kernels are imported after the switch below

    ON_GPU = torch.cuda.is_available()
    DEVICE = torch.device("cuda" if ON_GPU else "cpu")
    if not ON_GPU:
        os.environ["TRITON_INTERPRET"] = "1"  # before the first `import kernels`: Triton reads it at decoration

    # An unrelated PyPI package is also named `kernels`. Forget one imported earlier, then check which we get.
    _earlier = sys.modules.get("kernels")
    if _earlier is not None and REPO_ROOT not in Path(getattr(_earlier, "__file__", None) or "/").resolve().parents:
        for _name in [m for m in sys.modules if m == "kernels" or m.startswith("kernels.")]:
            del sys.modules[_name]
    import kernels

    KERNELS_FILE = getattr(kernels, "__file__", None)
    if KERNELS_FILE is None or not Path(KERNELS_FILE).resolve().is_relative_to(REPO_ROOT):
        raise ImportError(
            f"`import kernels` found {KERNELS_FILE or kernels}, not this repo's package ({REPO_ROOT / 'kernels'}). "
            "An unrelated PyPI package is also named `kernels`: run `pip uninstall -y kernels`, restart the "
            "runtime, and run this cell again."
        )
    print(f"repo root: {REPO_ROOT}")
    print(f"kernels:   {KERNELS_FILE}")
    MODE = "compiled Triton kernels" if ON_GPU else "Triton interpreter on the CPU, small shapes"
    print(f"device:    {DEVICE} ({MODE})")
    for _key, _value in kernels.env_summary().items():
        print(f"{_key:>18}: {_value}")
    '''
)

# --------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------
def build(name: str, cells: List[Cell]) -> nbformat.NotebookNode:
    """A notebook with no outputs, fixed cell ids, and Colab metadata asking for a GPU runtime."""
    nb = nbformat.v4.new_notebook()
    nb.metadata = {
        "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
        "language_info": {"name": "python"},
        "accelerator": "GPU",
        "colab": {"provenance": [], "gpuType": "L4"},
    }
    repo_name = GITHUB_REPO.split("/")[-1]
    for i, (kind, source) in enumerate(cells):
        source = source.replace("__GITHUB_REPO__", GITHUB_REPO).replace("__REPO_NAME__", repo_name)
        cell_id = f"{name.replace('_', '-')}-{i:02d}"
        if kind == "markdown":
            nb.cells.append(nbformat.v4.new_markdown_cell(source, id=cell_id))
        else:
            nb.cells.append(nbformat.v4.new_code_cell(source, id=cell_id))
    nbformat.validate(nb)
    return nb


def write_notebooks(cells_by_name: dict, check: bool, script: str = "scripts/make_notebooks.py") -> int:
    """Write notebooks/<name>.ipynb for each {name: cells}, or with `check` only compare them with the
    files on disk; returns the exit status (1 when a notebook on disk is out of date)."""
    stale = []
    NOTEBOOKS.mkdir(exist_ok=True)
    for name, cells in cells_by_name.items():
        text = nbformat.writes(build(name, cells)) + "\n"
        path = NOTEBOOKS / f"{name}.ipynb"
        if check:
            if not path.exists() or path.read_text(encoding="utf-8") != text:
                stale.append(str(path))
            continue
        path.write_text(text, encoding="utf-8")
        print(f"wrote {path.relative_to(REPO_ROOT)} ({len(cells)} cells)")
    if stale:
        print(f"out of date (run python {script}): " + ", ".join(stale), file=sys.stderr)
        return 1
    return 0


def cli(make_cells, doc: str, script: str, argv=None) -> int:
    """The command line of every notebook builder: write the notebooks make_cells() returns
    ({name: cells}), or with --check only compare them with the files on disk."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only compare with the notebooks on disk")
    args = parser.parse_args(argv)
    return write_notebooks(make_cells(), args.check, script)
