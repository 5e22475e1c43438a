"""Result rows and their CSV storage: `make_row` stamps measured fields with the GPU, torch / triton /
CUDA / cuDNN versions, the date and the git commit; `write_csv` appends rows to
results/<gpu-slug>/<name>.csv; `read_csv` loads them back. Needs no GPU.
"""

from __future__ import annotations

import csv
import datetime
import functools
import os
import re
import subprocess
from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Optional, Union

from tritonattn import env_summary  # public names: the harness also runs against other trees (benchmarks.ab)

REPO_ROOT = Path(__file__).resolve().parents[1]
Row = Dict[str, Any]  # one benchmark measurement: its fields plus the environment stamped by make_row


# --------------------------------------------------------------------------------------------
# Rows and CSV storage
# --------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def git_commit() -> str:
    """Short sha of this checkout's HEAD; $TRITONATTN_COMMIT where the tree travels without .git
    (a remote GPU box); 'unknown' when neither is available."""
    if os.environ.get("TRITONATTN_COMMIT"):
        return os.environ["TRITONATTN_COMMIT"]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() or "unknown"


def make_row(**fields: Any) -> Row:
    """A result row: the given fields, then gpu, torch, triton, cuda, cudnn, date (UTC ISO) and commit."""
    env = env_summary()
    meta = {
        "gpu": env["gpu"],
        "torch": env["torch"],
        "triton": env["triton"],
        "cuda": env["cuda"],
        "cudnn": env["cudnn"],
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(),
    }
    row: Row = dict(fields)
    for key, value in meta.items():
        row.setdefault(key, value)  # an explicit field wins (e.g. re-stamping imported results)
    return row


def gpu_slug(name: str) -> str:
    """Folder name for a GPU: lowercase, runs of non-alphanumerics -> '-' ('NVIDIA H200' -> 'nvidia-h200')."""
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    return slug or "unknown"


def results_root(results_dir: Union[str, Path]) -> Path:
    """results_dir as a path; a relative one is taken from the repo root, whatever the working directory."""
    path = Path(results_dir)
    return path if path.is_absolute() else REPO_ROOT / path


def write_csv(rows: Iterable[Mapping[str, Any]], name: str, results_dir: Union[str, Path] = "results") -> Path:
    """Append rows to results_dir/<gpu-slug>/<name>.csv (created with a header; new columns widen the header)."""
    rows = [dict(r) for r in rows]
    if not rows:
        raise ValueError(f"Expected at least one row to write to {name}.csv, got none.")
    gpus = {str(r.get("gpu") or env_summary()["gpu"]) for r in rows}
    if len(gpus) != 1:
        raise ValueError(f"Expected rows from one GPU per CSV, got {sorted(gpus)}; write each GPU's rows separately.")
    path = results_root(results_dir) / gpu_slug(gpus.pop()) / f"{name}.csv"
    path.parent.mkdir(parents=True, exist_ok=True)

    fieldnames: List[str] = []
    existing: List[Dict[str, str]] = []
    if path.exists() and path.stat().st_size > 0:
        with open(path, newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            fieldnames = list(reader.fieldnames or [])
            existing = list(reader)
    old_header = list(fieldnames)
    for r in rows:
        fieldnames.extend(k for k in r if k not in fieldnames)

    if existing and fieldnames == old_header:
        with open(path, "a", newline="", encoding="utf-8") as f:
            csv.DictWriter(f, fieldnames=fieldnames).writerows(rows)
    else:  # new file, or new columns: rewrite with the widened header
        with open(path, "w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, fieldnames=fieldnames)
            writer.writeheader()
            writer.writerows(existing + rows)
    return path


def read_csv(name: str, gpu: Optional[str] = None, results_dir: Union[str, Path] = "results"):
    """Load results/<gpu-slug>/<name>.csv as a pandas DataFrame; gpu=None concatenates every GPU's file."""
    import pandas as pd

    root = results_root(results_dir)
    if gpu is not None:
        paths = [root / gpu_slug(gpu) / f"{name}.csv"]
        if not paths[0].exists():
            raise FileNotFoundError(f"No results for {name!r} on GPU {gpu!r}: {paths[0]} does not exist.")
    else:
        paths = sorted(root.glob(f"*/{name}.csv"))
        if not paths:
            raise FileNotFoundError(f"No results for {name!r}: no {root}/<gpu>/{name}.csv exists.")
    return pd.concat([pd.read_csv(p) for p in paths], ignore_index=True)
