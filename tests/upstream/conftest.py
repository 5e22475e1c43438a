"""Run flash-attention's own tests/test_flash_attn.py against this repo's `tritonattn`.

The upstream file is theirs and never committed: scripts/fetch_flash_attn_tests.py writes it to
tests/upstream/vendor/test_flash_attn.py (git-ignored), its first line naming the upstream commit.
When it runs, `import flash_attn` finds the alias package beside this file (tests/upstream/flash_attn,
backed by `tritonattn`), because this conftest puts tests/upstream first on sys.path. The main suite
(`python -m pytest tests`) never collects this folder: tests/conftest.py ignores it unless a path
inside it is named on the command line.

On a GPU machine, from the repo root (einops installed; the vendor file present, e.g. carried):

    python scripts/fetch_flash_attn_tests.py --source /path/to/flash-attention   # once
    python -m pytest tests/upstream -n 8 -p no:cacheprovider -q \\
        --selected tests/upstream/selected.txt --upstream-json results-upstream.json

- `--selected FILE`: run only the node IDs listed in FILE (tests/upstream/selected.txt is the
  committed sample made by scripts/select_flash_attn_tests.py; selected_hopper_forward.txt, made by its
  --hopper-forward, every case whose forward takes Hopper's warp-specialized kernel). Unlisted cases are
  dropped while the parametrisation is generated, before any test item exists: collecting the ~509k-case
  file then takes about 20 s and 1.4 GB per xdist worker (on 2 CPU cores; 70 s and 2.7 GB without the
  option). A listed ID the file no longer generates is a usage error.
- Cases matching an entry of tests/upstream/skips.py are skipped with its reason (features not
  implemented yet, flash-attn internals); delete an entry when its feature lands.
- At the end a table gives passed / failed / skipped / errors per test function;
  `--upstream-json FILE` writes the same counts as JSON. A crashed xdist worker counts as failed.
- `-n 8`: each worker holds a CUDA context and the upstream references in fp32 (a few GiB at the
  largest shapes: 128K-key caches, 2048 x 2048 scores with their gradients), far below an H200's
  memory; Triton compiles on the host's cores, so more workers than cores / 2 gain little.

Without a GPU the file is collected but every case is skipped (the upstream tests put their
tensors on "cuda"). For that collection only, `torch.cuda.get_device_capability` reports (9, 0)
(the upstream module asks at import, and its dtype lists depend on it; 9.0 is the H200's, so the
IDs match a run there), and a missing einops is replaced by a stub that fails if called.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import types
from collections import Counter, defaultdict
from pathlib import Path

import pytest
import torch

UPSTREAM_DIR = Path(__file__).resolve().parent
if str(UPSTREAM_DIR) not in sys.path[:1]:
    sys.path.insert(0, str(UPSTREAM_DIR))  # `import flash_attn` -> the alias, ahead of any installed one

import skips  # noqa: E402  (tests/upstream/skips.py, importable now)

HAS_CUDA = torch.cuda.is_available()
_PRETEND_CAPABILITY = (9, 0)
_real_get_device_capability = torch.cuda.get_device_capability
_OUTCOMES = defaultdict(Counter)  # function name -> outcome -> count (in the xdist controller too)
_NODEID_PREFIX = "tests/upstream/"  # set from the rootdir in pytest_configure


def _stub_einops() -> types.ModuleType:
    """An `einops` that imports but refuses to compute: enough to collect the upstream file on a CPU."""

    def unavailable(*args, **kwargs):
        raise RuntimeError("einops is not installed: this stub only lets the upstream file be collected.")

    module = types.ModuleType("einops")
    module.rearrange = module.repeat = module.reduce = unavailable
    module.__stub__ = True
    return module


if not HAS_CUDA:
    torch.cuda.get_device_capability = lambda device=None: _PRETEND_CAPABILITY
    if importlib.util.find_spec("einops") is None:
        sys.modules["einops"] = _stub_einops()


def pytest_addoption(parser):
    group = parser.getgroup("upstream", "flash-attention's own tests against tritonattn")
    group.addoption("--selected", metavar="FILE", default=None,
                    help="run only the node IDs listed in FILE (one per line, '#' comments)")
    group.addoption("--upstream-json", metavar="FILE", default=None,
                    help="write passed / failed / skipped / errors per test function to FILE")


def pytest_configure(config):
    if HAS_CUDA and importlib.util.find_spec("einops") is None:
        raise pytest.UsageError("The upstream tests import einops: `pip install einops` first.")
    import flash_attn

    if Path(flash_attn.__file__).resolve().parent != UPSTREAM_DIR / "flash_attn":
        raise pytest.UsageError(
            f"`import flash_attn` found {flash_attn.__file__}, not the alias in {UPSTREAM_DIR / 'flash_attn'}; "
            f"something imported flash_attn before this conftest: run pytest on tests/upstream alone."
        )
    global _NODEID_PREFIX
    _NODEID_PREFIX = UPSTREAM_DIR.relative_to(config.rootpath).as_posix() + "/"
    path = config.getoption("--selected")
    config._upstream_selected = _read_selected(Path(path)) if path else None


def _read_selected(path: Path) -> set:
    """The `function[id]` keys of the node IDs listed in `path` (the part after the last '::')."""
    if not path.is_file():
        raise pytest.UsageError(f"--selected: no file {path}")
    lines = (line.strip() for line in path.read_text().splitlines())
    return {line.rsplit("::", 1)[-1] for line in lines if line and not line.startswith("#")}


def _key(name: str, callspec_id: str) -> str:
    return f"{name}[{callspec_id}]"


@pytest.hookimpl(wrapper=True)
def pytest_generate_tests(metafunc):
    """With --selected: keep only the listed parametrisations of each function, before items exist."""
    result = yield
    selected = metafunc.config._upstream_selected
    calls = getattr(metafunc, "_calls", None)
    if selected is None or not calls:
        return result
    name = metafunc.definition.name
    generated = {_key(name, c.id) for c in calls}
    missing = sorted(k for k in selected if k.startswith(name + "[") and k not in generated)
    if missing:
        raise pytest.UsageError(
            f"--selected lists {len(missing)} case(s) of {name} that the upstream file does not generate "
            f"(e.g. {missing[0]}): the file changed since the sample was drawn; rerun "
            f"scripts/select_flash_attn_tests.py."
        )
    # Keep one case of a function with none selected: an empty list would make pytest yield the
    # function unparametrised. That case is deselected with the rest in pytest_collection_modifyitems.
    metafunc._calls = [c for c in calls if _key(name, c.id) in selected] or calls[:1]
    return result


def _is_upstream(path) -> bool:
    return UPSTREAM_DIR in Path(path).resolve().parents


def pytest_collection_modifyitems(config, items):
    """Drop unselected upstream cases, then mark skips. Only tests/upstream items: this hook sees every
    item of the session, the main suite's too when both are collected."""
    selected = config._upstream_selected
    ours = [item for item in items if _is_upstream(item.path)]
    if selected is not None:
        dropped = [item for item in ours if item.nodeid.rsplit("::", 1)[-1] not in selected]
        if dropped:
            gone = set(map(id, dropped))
            config.hook.pytest_deselected(items=dropped)
            items[:] = [item for item in items if id(item) not in gone]
            ours = [item for item in ours if id(item) not in gone]
    for item in ours:
        name = getattr(item, "originalname", item.name)
        params = item.callspec.params if hasattr(item, "callspec") else {}
        reasons = [entry.reason for entry in skips.matching(name, params)]
        if not HAS_CUDA:
            reasons.append("needs a CUDA GPU (the upstream tests put their tensors on 'cuda')")
        if reasons:
            item.add_marker(pytest.mark.skip(reason="; ".join(dict.fromkeys(reasons))))


def pytest_collection_finish(session):
    if not HAS_CUDA:
        torch.cuda.get_device_capability = _real_get_device_capability


def pytest_report_header(config):
    vendor = UPSTREAM_DIR / "vendor" / "test_flash_attn.py"
    missing = "missing: run scripts/fetch_flash_attn_tests.py"
    origin = vendor.read_text().splitlines()[0] if vendor.is_file() else missing
    selected = config._upstream_selected
    scope = "all cases" if selected is None else f"{len(selected)} selected cases"
    entries = len(skips.OUT_OF_SCOPE) + len(skips.PENDING) + len(skips.RNG_STREAM)
    return [f"upstream: {origin}", f"upstream: {scope}; {entries} skip entries"]


def _function_of(nodeid: str) -> str:
    return nodeid.rsplit("::", 1)[-1].split("[", 1)[0]


def pytest_runtest_logreport(report):
    """Count one outcome per upstream case: its call's, or its setup's when that skipped or failed."""
    if not report.nodeid.startswith(_NODEID_PREFIX):
        return
    counts = _OUTCOMES[_function_of(report.nodeid)]
    if report.when == "call":
        counts["passed" if report.passed else "failed" if report.failed else "skipped"] += 1
    elif report.when == "setup" and not report.passed:
        counts["skipped" if report.skipped else "errors"] += 1
    elif report.when == "teardown" and report.failed:
        counts["errors"] += 1


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    outcomes = _OUTCOMES
    if not outcomes:
        return
    columns = ("passed", "failed", "skipped", "errors")
    width = max(len(name) for name in outcomes)
    tr = terminalreporter
    tr.section("upstream test_flash_attn.py per function")
    tr.write_line(f"{'function':<{width}}  " + "  ".join(f"{c:>7}" for c in columns))
    total = Counter()
    for name in sorted(outcomes):
        total.update(outcomes[name])
        tr.write_line(f"{name:<{width}}  " + "  ".join(f"{outcomes[name][c]:>7}" for c in columns))
    tr.write_line(f"{'total':<{width}}  " + "  ".join(f"{total[c]:>7}" for c in columns))
    path = config.getoption("--upstream-json")
    if path:
        table = {name: {c: outcomes[name][c] for c in columns} for name in sorted(outcomes)}
        Path(path).write_text(json.dumps({"functions": table, "total": {c: total[c] for c in columns}}, indent=1))
        tr.write_line(f"per-function counts written to {path}")
