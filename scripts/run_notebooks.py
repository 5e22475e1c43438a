"""Execute notebooks headless without Jupyter: each notebook's code cells run in order with `exec`.

One fresh namespace per notebook, the notebook's own folder as the working directory (as Jupyter
does), matplotlib on the Agg backend, and TRITON_INTERPRET=1 set before anything imports `tritonattn`
when PyTorch sees no GPU. IPython-only lines (`!pip ...`, `%magic`) are skipped with a note. Outputs
are not written back: notebooks save their figures to files themselves.

With --write the notebooks run in a real Jupyter kernel instead (nbclient and ipykernel must be installed)
and are saved in place with their outputs, as they are committed after a run on the GPU.

    python scripts/run_notebooks.py                  # every notebooks/*.ipynb, in name order
    python scripts/run_notebooks.py notebooks/01_gqa.ipynb --keep-going
    python scripts/run_notebooks.py --write          # execute in Jupyter, save the outputs

Exit status: 0 when every notebook ran, 1 otherwise (the failing cell's traceback is printed).
"""

from __future__ import annotations

import argparse
import json
import linecache
import os
import sys
import time
import traceback
from pathlib import Path
from typing import List, Optional

REPO_ROOT = Path(__file__).resolve().parents[1]


def _setup_environment(jupyter: bool = False) -> None:
    """Headless matplotlib (a Jupyter kernel keeps its inline backend, so figures become outputs), and the
    Triton interpreter when PyTorch sees no GPU."""
    if not jupyter:
        os.environ.setdefault("MPLBACKEND", "Agg")
    import torch

    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        os.environ["TRITON_INTERPRET"] = "1"
    for path in (str(REPO_ROOT), str(REPO_ROOT / "kernels")):  # the harness and the library's source root
        if path not in sys.path:
            sys.path.insert(0, path)


def _strip_ipython(source: str) -> str:
    """Replace IPython-only lines (shell escapes, line and cell magics) by `pass`, keeping indentation."""
    lines = source.splitlines()
    if lines and lines[0].lstrip().startswith("%%"):
        lines[0] = "pass  # skipped cell magic: " + lines[0].strip()
    out = []
    for line in lines:
        stripped = line.lstrip()
        if stripped.startswith(("!", "%")):
            indent = line[: len(line) - len(stripped)]
            out.append(f"{indent}pass  # skipped IPython line: {stripped}")
        else:
            out.append(line)
    return "\n".join(out) + "\n"


def _code_cells(path: Path) -> List[str]:
    """Source of each code cell of the notebook at `path`, in order."""
    with open(path, encoding="utf-8") as f:
        nb = json.load(f)
    cells = []
    for cell in nb.get("cells", []):
        if cell.get("cell_type") != "code":
            continue
        src = cell.get("source", "")
        cells.append("".join(src) if isinstance(src, list) else src)
    return cells


def run_notebook(path: Path) -> bool:
    """Run every code cell of one notebook in a fresh namespace; True on success."""
    path = path.resolve()
    cells = _code_cells(path)
    print(f"== {path}: {len(cells)} code cells")
    namespace = {"__name__": "__main__", "__file__": str(path)}
    old_cwd = os.getcwd()
    os.chdir(path.parent)
    start = time.perf_counter()
    try:
        for i, source in enumerate(cells, 1):
            if not source.strip():
                continue
            filename = f"<{path.name} cell {i}>"
            code = _strip_ipython(source)
            linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
            t0 = time.perf_counter()
            print(f"   cell {i}/{len(cells)} ...", flush=True)
            try:
                exec(compile(code, filename, "exec"), namespace)
            except (Exception, SystemExit) as exc:
                print(f"!! {path.name}: cell {i} failed with {type(exc).__name__}: {exc}", file=sys.stderr)
                traceback.print_exc()
                print(f"-- source of cell {i}:\n{source}", file=sys.stderr)
                return False
            print(f"   cell {i}/{len(cells)} done in {time.perf_counter() - t0:.1f} s", flush=True)
    finally:
        os.chdir(old_cwd)
        if "matplotlib.pyplot" in sys.modules:
            sys.modules["matplotlib.pyplot"].close("all")
    print(f"== {path.name}: ok in {time.perf_counter() - start:.1f} s", flush=True)
    return True


def write_notebook(path: Path) -> bool:
    """Execute the notebook at `path` in a Jupyter kernel (nbclient) and save it in place with its outputs,
    also when a cell fails (the traceback is then the failing cell's output); True on success."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    path = path.resolve()
    nb = nbformat.read(path, as_version=4)
    print(f"== {path}: executing in a Jupyter kernel", flush=True)
    start = time.perf_counter()
    client = NotebookClient(nb, timeout=None, kernel_name="python3", record_timing=False,
                            resources={"metadata": {"path": str(path.parent)}})
    ok = True
    try:
        client.execute()
    except CellExecutionError as exc:
        print(f"!! {path.name}: {exc}", file=sys.stderr)
        ok = False
    finally:
        nbformat.write(nb, path)
    print(f"== {path.name}: {'ok' if ok else 'FAILED'} in {time.perf_counter() - start:.1f} s, saved", flush=True)
    return ok


def main(argv: Optional[List[str]] = None) -> int:
    """Parse arguments, run the notebooks, return the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("notebooks", nargs="*", type=Path, help="notebooks to run (default: notebooks/*.ipynb)")
    parser.add_argument("--keep-going", action="store_true", help="run the remaining notebooks after a failure")
    parser.add_argument("--write", action="store_true",
                        help="execute in a Jupyter kernel (nbclient) and save each notebook with its outputs")
    args = parser.parse_args(argv)

    paths = args.notebooks or sorted((REPO_ROOT / "notebooks").glob("*.ipynb"))
    if not paths:
        print("no notebooks found under notebooks/", file=sys.stderr)
        return 1
    _setup_environment(jupyter=args.write)
    print(f"TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '0')}, {len(paths)} notebook(s)")

    failed = []
    for path in paths:
        if not (write_notebook if args.write else run_notebook)(Path(path)):
            failed.append(str(path))
            if not args.keep_going:
                break
    if failed:
        print(f"FAILED: {', '.join(failed)}", file=sys.stderr)
        return 1
    print(f"all {len(paths)} notebook(s) ran")
    return 0


if __name__ == "__main__":
    sys.exit(main())
