"""Stamp the repository's URL (pyproject.toml, [project.urls] Repository: the one place it is written) into
every copy that needs it: each notebook's "Open in Colab" badge (the first line of its first cell) and first
code cell (the setup cell, the same in every notebook), and the badges of README's notebook table.

    python scripts/stamp_url.py           # rewrite the copies that disagree
    python scripts/stamp_url.py --check   # exit 1 listing every copy that disagrees (tests/test_stamp_url.py)

Publishing under another URL: edit pyproject.toml, run this script, commit. Notebook outputs are kept.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import List

REPO_ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = REPO_ROOT / "notebooks"
README = REPO_ROOT / "README.md"
BADGE_SVG = "https://colab.research.google.com/assets/colab-badge.svg"

SETUP_CELL = '''\
# Setup, no edits needed. In a clone it finds the repository; on Colab it clones REPO_URL next to the notebook.
# nbsetup then installs what Colab lacks (requirements.txt; Triton on a CPU runtime; never torch), picks the
# device (no GPU: Triton's interpreter, small shapes) and imports this repository's `tritonattn`.
import os, pathlib, subprocess, sys  # noqa: E401
REPO_URL = os.environ.get("TRITONATTN_REPO_URL", "{git_url}")  # stamped from pyproject.toml
ROOT = next((p for p in (pathlib.Path.cwd(), *pathlib.Path.cwd().parents) if (p / "kernels" / "tritonattn").is_dir()),
            None)
if ROOT is None and "google.colab" in sys.modules:
    ROOT = pathlib.Path.cwd() / "tritonattn"
    if not (ROOT / "kernels" / "tritonattn").is_dir():
        clone = subprocess.run(["git", "clone", "-q", "--depth", "1", REPO_URL, str(ROOT)],
                               capture_output=True, text=True)
        if clone.returncode:
            raise RuntimeError(f"Cloning {{REPO_URL}} failed ({{' '.join(clone.stderr.split())[:300]}}); run "
                               f"`!git clone {{REPO_URL}} {{ROOT}}` in a cell, then this cell again.")
if ROOT is None:
    raise RuntimeError(f"This notebook runs from its repository: `git clone {{REPO_URL}}` and open it there, "
                       "or open it in Colab from GitHub (the badge at the top).")
sys.path[:0] = [str(ROOT), str(ROOT / "kernels"), str(ROOT / "notebooks")]
import nbsetup  # noqa: E402
ON_GPU, DEVICE = nbsetup.setup(ROOT)
import tritonattn, torch  # noqa: E401, E402'''

BADGE_LINE = ("[![Open In Colab]({svg})]({colab}) Run it on Colab: the badge opens this notebook; pick an L4 "
              "runtime (*Runtime → Change runtime type*) and run all. The first code cell clones the repository "
              "and installs what the runtime lacks.\n")
README_BADGE = re.compile(r"\[!\[Open In Colab\]\([^)]*\)\]\([^)]*\)")
PLACEHOLDER = re.compile(r"OWNER/REPO|<owner>|<repo>|example\.com", re.I)
# GitHub repositories the prose cites (credits, peers), never the project's own URL.
ALLOWED_OWNERS = {"Dao-AILab", "hkproj", "triton-lang", "pytorch", "huggingface", "flashinfer-ai",
                  "zhuzilin", "googlecolab",
                  "zzc0721"}  # a public L4 fp16 matmul measurement (notebook 03, benchmarks/seed_table.py)


def repository_url() -> str:
    """[project.urls] Repository of pyproject.toml, without a trailing slash or `.git`."""
    text = (REPO_ROOT / "pyproject.toml").read_text(encoding="utf-8")
    section = re.search(r"^\[project\.urls\]\s*$(.*?)(?=^\[|\Z)", text, re.M | re.S)
    match = section and re.search(r'^Repository\s*=\s*"([^"]+)"', section.group(1), re.M)
    if not match:
        raise SystemExit("pyproject.toml has no [project.urls] Repository = \"https://github.com/<owner>/<repo>\"")
    url = match.group(1).rstrip("/").removesuffix(".git")
    if not re.fullmatch(r"https://github\.com/[\w.-]+/[\w.-]+", url) or PLACEHOLDER.search(url):
        raise SystemExit(f"[project.urls] Repository must be a GitHub repository's URL, got {url!r}")
    return url


def colab_url(url: str, notebook: str) -> str:
    return f"https://colab.research.google.com/github/{url.removeprefix('https://github.com/')}/blob/main/" \
           f"notebooks/{notebook}"


def _lines(text: str) -> List[str]:
    return text.splitlines(keepends=True)


def stamp_notebook(path: Path, url: str, write: bool) -> List[str]:
    """The copies in one notebook that disagree with `url` (rewritten when `write`)."""
    nb = json.loads(path.read_text(encoding="utf-8"))
    problems = []
    first = nb["cells"][0]
    if first["cell_type"] != "markdown":
        raise SystemExit(f"{path.name}: the first cell must be markdown (it holds the badge)")
    badge = BADGE_LINE.format(svg=BADGE_SVG, colab=colab_url(url, path.name))
    md = first["source"] if isinstance(first["source"], list) else _lines(first["source"])
    if not md or md[0] != badge:
        problems.append(f"{path.name}: the Colab badge")
        md = [badge] + (md[1:] if md and ("Open In Colab" in md[0] or md[0].startswith("*Colab*")) else ["\n"] + md)
        first["source"] = md
    code = next(c for c in nb["cells"] if c["cell_type"] == "code")
    want = _lines(SETUP_CELL.format(git_url=url + ".git"))
    have = code["source"] if isinstance(code["source"], list) else _lines(code["source"])
    if have != want:
        problems.append(f"{path.name}: the setup cell")
        code["source"] = want
    if write and problems:
        path.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    return problems


def stamp_readme(url: str, write: bool) -> List[str]:
    """README's notebook table: each row's badge links that notebook on Colab."""
    lines = _lines(README.read_text(encoding="utf-8"))
    problems, out = [], []
    for line in lines:
        row = re.match(r"^\| `(\d\d_[\w]+)` \|", line)
        if row:
            name = f"{row.group(1)}.ipynb"
            badge = f"[![Open In Colab]({BADGE_SVG})]({colab_url(url, name)})"
            cells = line.rstrip("\n").split(" | ")
            if README_BADGE.fullmatch(cells[1].strip()) is None or cells[1].strip() != badge:
                problems.append(f"README.md: the badge of {name}")
                if README_BADGE.fullmatch(cells[1].strip()):
                    cells[1] = badge
                else:
                    cells.insert(1, badge)
                line = " | ".join(cells) + "\n"
        out.append(line)
    if write and problems:
        README.write_text("".join(out), encoding="utf-8")
    return problems


def stale_copies() -> List[str]:
    """Every place outside pyproject.toml that names a placeholder URL or a GitHub URL other than ours."""
    url = repository_url()
    found = []
    for path in [README, *sorted(NOTEBOOKS.glob("*.ipynb"))]:
        text = path.read_text(encoding="utf-8")
        if PLACEHOLDER.search(text):
            found.append(f"{path.name}: a placeholder URL")
        for other in set(re.findall(r"(?:github\.com|colab\.research\.google\.com/github)/([\w.-]+/[\w.-]+?)(?:\.git)?"
                                    r"(?=[/\")\s]|$)", text)):
            if other != url.removeprefix("https://github.com/") and other.split("/")[0] not in ALLOWED_OWNERS:
                found.append(f"{path.name}: github.com/{other}")
    return found



def run(write: bool) -> List[str]:
    url = repository_url()
    problems: List[str] = []
    for path in sorted(NOTEBOOKS.glob("*.ipynb")):
        problems += stamp_notebook(path, url, write)
    problems += stamp_readme(url, write)
    return problems


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 when a copy disagrees")
    args = ap.parse_args(argv)
    problems = run(write=not args.check)
    stale = stale_copies() if args.check else []
    for p in problems + stale:
        print(("disagrees: " if args.check else "stamped: ") + p)
    return 1 if args.check and (problems or stale) else 0


if __name__ == "__main__":
    sys.exit(main())
