"""The committed notebooks are executed on a GPU and saved with their outputs (scripts/run_notebooks.py
--write): a reader on the web sees every table, plot and number. Checked from the .ipynb JSON alone, so
this runs on any CPU.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))

# What a section prints when it had nothing to show, and what an exception leaves in an output.
EMPTY_OR_FAILED = re.compile(
    r"nothing to (plot|show)|no committed GPU results|no results for suite|no .*results yet|rows wrong/error"
    r"|Traceback \(most recent call last\)",
    re.IGNORECASE,
)


def _code_cells(path: Path):
    with open(path, encoding="utf-8") as f:
        return [c for c in json.load(f)["cells"] if c["cell_type"] == "code"]


def _texts(output) -> list:
    """The text of one output: a stream's text, or the plain/HTML forms of a displayed value."""
    def join(value):
        return "".join(value) if isinstance(value, list) else str(value)

    if output["output_type"] == "stream":
        return [join(output["text"])]
    if output["output_type"] == "error":
        return [f"{output.get('ename')}: {output.get('evalue')}\nTraceback (most recent call last)"]
    data = output.get("data", {})
    return [join(data[key]) for key in ("text/plain", "text/html") if key in data]


def test_there_are_notebooks():
    assert [p.name[:2] for p in NOTEBOOKS] == ["00", "01", "02", "03", "04", "05"], [p.name for p in NOTEBOOKS]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_committed_executed_on_a_gpu(path):
    cells = _code_cells(path)
    counts = [c.get("execution_count") for c in cells]
    assert counts == list(range(1, len(cells) + 1)), (
        f"{path.name}: code cells not run once, top to bottom (execution counts {counts}); run "
        f"`python scripts/run_notebooks.py --write` on a GPU")

    texts = [t for c in cells for o in c["outputs"] for t in _texts(o)]
    everything = "\n".join(texts)
    gpu = re.search(r"^\s*gpu: (.+)$", everything, re.MULTILINE)
    assert gpu and gpu.group(1).strip() not in ("", "cpu", "None"), f"{path.name}: no output names the GPU"
    assert re.search(r"^\s*interpreter: False$", everything, re.MULTILINE), (
        f"{path.name}: executed under the Triton interpreter, not compiled on the GPU")

    plots = sum("image/png" in o.get("data", {}) for c in cells for o in c["outputs"])
    assert plots >= 1, f"{path.name}: no plot among the outputs"

    errors = [o.get("ename") for c in cells for o in c["outputs"] if o["output_type"] == "error"]
    assert not errors, f"{path.name}: cells raised {errors}"
    bad = [line.strip() for t in texts for line in t.splitlines() if EMPTY_OR_FAILED.search(line)]
    assert not bad, f"{path.name}: outputs say a section had nothing to show or raised: {bad[:3]}"
