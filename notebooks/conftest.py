"""pytest setup for the notebooks run by nbmake (`python -m pytest tests notebooks --nbmake -q`): each
notebook's CPU time budget.

A notebook's metadata holds `"tritonattn": {"cpu_budget_s": N}` and its first markdown cell states the same
N as "N s on a CPU" (tests/test_notebook_outputs.py checks that they agree). On a CPU (the Triton
interpreter) a notebook whose nbmake run takes longer than N seconds of wall time fails, so the budget a
reader is promised holds; on a GPU the budget is not timed. A notebook without a budget fails anywhere.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Optional

import pytest

clock = time.perf_counter  # what the budget is timed with (a test substitutes it)


class OverBudget(Exception):
    """A notebook ran longer on the CPU than its stated budget, or states none."""


def cpu_budget_s(path: Path) -> Optional[int]:
    """The notebook's CPU time budget in seconds (its metadata's tritonattn.cpu_budget_s), None when it has
    no positive int there."""
    with open(path, encoding="utf-8") as f:
        budget = json.load(f).get("metadata", {}).get("tritonattn", {}).get("cpu_budget_s")
    return budget if type(budget) is int and budget > 0 else None


def over_budget(name: str, seconds: float, budget: Optional[int]) -> Optional[str]:
    """Why a notebook that ran `seconds` on the CPU fails its budget, or None when it is within it."""
    if budget is None:
        return (f'{name} states no CPU time budget: add "tritonattn": {{"cpu_budget_s": N}} to its metadata '
                f'and "N s on a CPU" to its first markdown cell')
    if seconds > budget:
        return f"{name} ran {seconds:.0f} s on the CPU, over its stated budget of {budget} s"
    return None


def on_cpu() -> bool:
    """Whether the notebooks run under the Triton interpreter (as nbsetup decides: no GPU, or asked for)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return True
    import torch

    return not torch.cuda.is_available()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """Times each nbmake item (a notebook) and fails it when it ran over its CPU budget."""
    path = Path(item.path)
    if path.suffix != ".ipynb":
        return (yield)
    budget = cpu_budget_s(path)
    if budget is None:
        raise OverBudget(over_budget(path.name, 0.0, None))
    start = clock()
    result = yield
    problem = over_budget(path.name, clock() - start, budget) if on_cpu() else None
    if problem:
        raise OverBudget(problem)
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A budget failure reports its one line (nbmake would call it an internal error)."""
    report = yield
    if call.excinfo is not None and isinstance(call.excinfo.value, OverBudget):
        report.longrepr = str(call.excinfo.value)
    return report
