"""Draw the committed sample of flash-attention's tests that tests/upstream runs (selected.txt).

flash-attention's tests/test_flash_attn.py parametrises about 509k cases (304k in the kvcache
test): far too many to run. This script collects their node IDs and parameters without a GPU and
writes tests/upstream/selected.txt, a seeded, stratified sample of at most about --budget cases per
test function in which every value of every parameter appears at least once:

    python scripts/fetch_flash_attn_tests.py          # the upstream file, into tests/upstream/vendor/
    python scripts/select_flash_attn_tests.py         # -> tests/upstream/selected.txt (commit it)

Then on a GPU (tests/upstream/conftest.py has the details):

    python -m pytest tests/upstream -n 8 -p no:cacheprovider -q --selected tests/upstream/selected.txt

How a function's sample is drawn (deterministic: the RNG is seeded with --seed and the function name):

1. Its cases are collected through pytest itself (tests/upstream/conftest.py, which lets the module
   import without a GPU), recording each parametrisation's ID and parameters and then dropping the
   items, so the IDs are pytest's own and no ~509k test items are built.
2. Cases upstream skips itself (UPSTREAM_SKIPS below) are not drawn while others remain.
3. The cases are split into strata by the tests/upstream/skips.py reasons they match: the stratum
   that runs today gets half of the budget, the strata waiting for a feature share the other half,
   so each feature's cases are already in the sample, and run, once its skip entries are deleted.
4. Within a stratum: a greedy cover first (repeatedly the case showing the most parameter values
   not yet drawn, ties broken at random), then random cases up to the stratum's quota.
5. Any value of the function still missing gets one more case (the budget is "about").

A parameter group such as "seqlen_q,seqlen_k" counts as one parameter whose values are the pairs.
Functions of flash-attn's internals (skips.OUT_OF_SCOPE) are not sampled.

With --hopper-forward it writes, instead of a sample, every case whose forward Hopper's warp-specialized
kernel takes (kernels/tritonattn/jit/sm90.py: the dispatcher's own rule, planned for an H100) and that no skip
entry applies to, to tests/upstream/selected_hopper_forward.txt; the sample above holds few of them.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Set, Tuple

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
UPSTREAM_DIR = REPO_ROOT / "tests" / "upstream"
VENDOR_FILE = UPSTREAM_DIR / "vendor" / "test_flash_attn.py"
DEFAULT_OUT = UPSTREAM_DIR / "selected.txt"

sys.path.insert(0, str(REPO_ROOT / "kernels"))  # tritonattn, for --hopper-forward's rule
sys.path.insert(0, str(UPSTREAM_DIR))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import skips  # noqa: E402  (tests/upstream/skips.py)
from fetch_flash_attn_tests import upstream_commit  # noqa: E402

HOPPER_OUT = UPSTREAM_DIR / "selected_hopper_forward.txt"
# The upstream functions whose bodies call the dense forward (flash_attn_func, its kvpacked and qkvpacked
# forms) and the packed one (flash_attn_varlen_func and its forms) on ragged (total, heads, D) tensors. The
# KV-cache test never reaches the Hopper forward: its chunks (at most 128 queries, batch 2, 6 heads) are too
# few programs for the prefill path, so flash_attn_with_kvcache runs the decode kernel.
DENSE_FORWARD = ("test_flash_attn_qkvpacked", "test_flash_attn_output", "test_flash_attn_causal",
                 "test_flash_attn_splitkv", "test_flash_attn_race_condition", "test_flash_attn_bwd_overflow",
                 "test_flash_attn_bwd_transpose", "test_flash_attn_deterministic")
VARLEN_FORWARD = ("test_flash_attn_varlen_qkvpacked", "test_flash_attn_varlen_output",
                  "test_flash_attn_varlen_causal", "test_flash_attn_varlen_deterministic")

# Conditions under which the upstream test body calls pytest.skip() itself (read from the file):
# such cases would only spend the budget.
UPSTREAM_SKIPS: Dict[str, Callable[[Mapping], bool]] = {
    "test_flash_attn_output": lambda p: p["softcap"] > 0 and p["dropout_p"] > 0,
    "test_flash_attn_varlen_output": lambda p: p["softcap"] > 0 and p["dropout_p"] > 0,
    "test_flash_attn_kvcache": lambda p: (
        (p["seqlen_q"] > p["seqlen_k"] and p["new_kv"])
        or (not p["new_kv"] and p["rotary_fraction"] > 0)
        or ((p["has_batch_idx"] or p["has_leftpad"]) and p["paged_kv_block_size"] is not None)
    ),
}


@dataclass
class Case:
    """One parametrisation of a test function."""

    nodeid: str
    params: Dict[str, object]
    values: Tuple[Tuple[str, str], ...] = ()  # (group, value) for each parameter group
    stratum: Tuple[str, ...] = ()  # the skips.PENDING reasons it matches; () runs today
    self_skipped: bool = False


class _Recorder:
    """pytest plugin: record every parametrisation, then leave one per function (items are dropped)."""

    def __init__(self) -> None:
        self.cases: Dict[str, List[Case]] = defaultdict(list)
        self.groups: Dict[str, List[List[str]]] = {}

    @pytest.hookimpl(wrapper=True)
    def pytest_generate_tests(self, metafunc):
        result = yield
        name, nodeid = metafunc.definition.name, metafunc.definition.nodeid
        groups = []
        for mark in metafunc.definition.iter_markers(name="parametrize"):
            argnames = mark.args[0] if mark.args else mark.kwargs["argnames"]
            if isinstance(argnames, str):
                argnames = [a.strip() for a in argnames.split(",") if a.strip()]
            groups.append(list(argnames))
        self.groups[name] = groups
        calls = getattr(metafunc, "_calls", [])
        self.cases[name] = [Case(f"{nodeid}[{c.id}]", dict(c.params)) for c in calls] or [Case(nodeid, {})]
        metafunc._calls = calls[:1]
        return result

    def pytest_collection_modifyitems(self, config, items):
        items[:] = []


def collect(vendor: Path) -> Tuple[Dict[str, List[Case]], Dict[str, List[List[str]]]]:
    """Every case of the upstream file, by function, and each function's parameter groups."""
    recorder = _Recorder()
    os.chdir(REPO_ROOT)
    rc = pytest.main([str(vendor.relative_to(REPO_ROOT)), "--collect-only", "-qq", "-p", "no:cacheprovider"],
                     plugins=[recorder])
    if rc not in (0, 5):  # 5: no items left, as intended
        raise SystemExit(f"collecting {vendor} failed (pytest exit {rc})")
    return recorder.cases, recorder.groups


def _show(value: object) -> str:
    return repr(value) if not type(value).__module__.startswith("torch") else str(value)


def annotate(name: str, cases: List[Case], groups: List[List[str]]) -> None:
    """Fill in each case's (group, value) pairs, stratum and upstream self-skip flag."""
    self_skip = UPSTREAM_SKIPS.get(name)
    for case in cases:
        case.values = tuple((",".join(g), ",".join(_show(case.params[a]) for a in g)) for g in groups)
        case.stratum = tuple(sorted({e.reason for e in skips.PENDING if e.matches(name, case.params)}))
        case.self_skipped = bool(self_skip and case.params and self_skip(case.params))


def _quotas(sizes: Mapping[Tuple[str, ...], int], budget: int) -> Dict[Tuple[str, ...], int]:
    """Half the budget to the runnable stratum (), the rest shared equally; unused shares flow on."""
    quotas = {s: 0 for s in sizes}
    runnable = sizes.get((), 0)
    if runnable:
        quotas[()] = min(runnable, (budget + 1) // 2 if len(sizes) > 1 else budget)
    left = budget - quotas.get((), 0)
    open_strata = [s for s in sizes if s != () and sizes[s] > 0]
    while left > 0 and open_strata:
        share = max(1, left // len(open_strata))
        for s in list(open_strata):
            take = min(share, sizes[s] - quotas[s], left)
            quotas[s] += take
            left -= take
            if quotas[s] >= sizes[s]:
                open_strata.remove(s)
            if left == 0:
                break
    if left > 0 and runnable:  # every waiting stratum is exhausted: give the rest back to ()
        quotas[()] = min(runnable, quotas[()] + left)
    return quotas


def _greedy_cover(pool: Sequence[Case], quota: int, covered: Set[Tuple[str, str]]) -> List[Case]:
    """Up to `quota` cases of `pool` (already shuffled) that add values missing from `covered`."""
    chosen: List[Case] = []
    wanted = {v for case in pool for v in case.values} - covered
    while wanted and len(chosen) < quota:
        best = max(pool, key=lambda case: len(wanted.intersection(case.values)))
        gain = wanted.intersection(best.values)
        if not gain:
            break
        chosen.append(best)
        wanted -= gain
        covered |= gain
    return chosen


def sample(name: str, cases: List[Case], budget: int, seed: int) -> List[Case]:
    """The stratified, covering sample of one function's cases (see the module docstring)."""
    rng = random.Random(f"{seed}/{name}")
    shuffled = cases[:]
    rng.shuffle(shuffled)
    candidates = [c for c in shuffled if not c.self_skipped] or shuffled
    if len(candidates) <= budget:
        chosen = candidates[:]
    else:
        by_stratum: Dict[Tuple[str, ...], List[Case]] = defaultdict(list)
        for case in candidates:
            by_stratum[case.stratum].append(case)
        quotas = _quotas({s: len(pool) for s, pool in by_stratum.items()}, budget)
        chosen = []
        for stratum in sorted(by_stratum):  # () first
            pool, quota = by_stratum[stratum], quotas[stratum]
            picked = _greedy_cover(pool, quota, set())
            taken = {id(c) for c in picked}
            picked += [c for c in pool if id(c) not in taken][: quota - len(picked)]
            chosen += picked
    covered = {v for case in chosen for v in case.values}
    chosen_ids = {id(c) for c in chosen}
    rest = [c for c in candidates + shuffled if id(c) not in chosen_ids]  # self-skipped cases last
    chosen += _greedy_cover(rest, len(rest), covered)
    order = {id(c): i for i, c in enumerate(cases)}
    return sorted({id(c): c for c in chosen}.values(), key=lambda c: order[id(c)])


def takes_hopper_forward(name: str, params: Mapping) -> bool:
    """Whether the dispatcher gives this case's forward to Hopper's warp-specialized kernel on an H100:
    a dense or packed call without dropout (packed over a paged K/V keeps the portable kernel), judged by
    tritonattn.config.tables.prefill_fwd_sm90_config itself (head dim, dtype, key count against the causal or
    full threshold). A window, softcap or ALiBi does not matter. A packed case is judged at its seqlen_k, the
    longest its random lengths can be (upstream draws each from the 20 below it), so at the threshold its
    forward may run the portable kernel instead."""
    from tritonattn.config.hardware import TARGETS
    from tritonattn.config.options import attn_options
    from tritonattn.config.tables import prefill_fwd_sm90_config

    if name not in DENSE_FORWARD + VARLEN_FORWARD or params.get("dropout_p", 0.0) > 0:
        return False
    if params.get("paged_kv_block_size") is not None:
        return False
    if "seqlen" in params:
        seqlen_k = params["seqlen"]
    else:  # these bodies swap the pair when swap_sq_sk is set
        seqlen_k = params["seqlen_q"] if params.get("swap_sq_sk") else params["seqlen_k"]
    causal = params.get("causal", name in ("test_flash_attn_causal", "test_flash_attn_varlen_causal"))  # always
    options = attn_options(params["d"], causal=causal)
    return prefill_fwd_sm90_config(options, params["dtype"], seqlen_k, TARGETS["H100"]) is not None


def write_selection(out: Path, vendor: Path, about: Sequence[str], lines: Sequence[str]) -> None:
    """A selection file: the upstream commit, `about` (what was selected and how to run it), then `lines`."""
    header = [f"# flash-attention tests/test_flash_attn.py at {upstream_commit(vendor) or 'unknown commit'}:"]
    out.write_text("\n".join([*header, *about, *lines]) + "\n")


def write_hopper_forward(cases: Mapping[str, List[Case]], groups: Mapping[str, List[List[str]]], vendor: Path,
                         out: Path) -> int:
    """Every case (not a sample) that takes the Hopper forward and runs today, in upstream's order."""
    from tritonattn.config.tables import gluon_sm90_available

    if not gluon_sm90_available():
        print("the Hopper forward needs Triton 3.6 (its Gluon API); run this where that Triton is installed",
              file=sys.stderr)
        return 1
    lines = []
    for name, fn_cases in cases.items():
        candidates = [c for c in fn_cases if takes_hopper_forward(name, c.params)]
        annotate(name, candidates, groups[name])  # only these: the file has ~509k cases
        chosen = [c for c in candidates if not c.self_skipped and not skips.matching(name, c.params)]
        if chosen:
            lines.append(f"# {name}: {len(chosen)} of {len(fn_cases)} cases")
            lines += [c.nodeid for c in chosen]
    total = sum(not line.startswith("#") for line in lines)
    shown = out.relative_to(REPO_ROOT) if out.is_relative_to(REPO_ROOT) else out
    write_selection(out, vendor, [
        f"# all {total} cases whose forward takes Hopper's warp-specialized kernel (dense or packed, no dropout,",
        "# the dispatcher's rule for an H100) and that no skip entry applies to; made by",
        "# scripts/select_flash_attn_tests.py --hopper-forward (do not edit by hand). Run on an H100/H200:",
        f"# python -m pytest tests/upstream -n 8 -p no:cacheprovider -q --selected {shown}",
    ], lines)
    print("\n".join(line for line in lines if line.startswith("#")))
    print(f"wrote {total} cases to {out}")
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget", type=int, default=300, help="cases per test function, about (default 300)")
    parser.add_argument("--seed", type=int, default=0, help="RNG seed (default 0)")
    parser.add_argument("--vendor", type=Path, default=VENDOR_FILE, help=f"the upstream file (default {VENDOR_FILE})")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"output file (default {DEFAULT_OUT}, with --hopper-forward {HOPPER_OUT})")
    parser.add_argument("--hopper-forward", action="store_true",
                        help="every case that takes Hopper's warp-specialized forward, not a sample")
    args = parser.parse_args(argv)
    if not args.vendor.is_file():
        print(f"{args.vendor} is missing: run scripts/fetch_flash_attn_tests.py first.", file=sys.stderr)
        return 1
    cases, groups = collect(args.vendor.resolve())
    if args.hopper_forward:
        return write_hopper_forward(cases, groups, args.vendor, (args.out or HOPPER_OUT).resolve())
    args.out = args.out or DEFAULT_OUT

    lines, report = [], []
    total_cases = total_selected = total_runnable = 0
    used_entries = set()
    for name, fn_cases in cases.items():
        annotate(name, fn_cases, groups[name])
        for case in fn_cases:
            used_entries.update(e for e in skips.PENDING if e.matches(name, case.params))
        total_cases += len(fn_cases)
        if skips.out_of_scope(name):
            report.append(f"{name:<50} {len(fn_cases):>7} {'-':>8} {'-':>8}  out of scope: not sampled")
            continue
        chosen = sample(name, fn_cases, args.budget, args.seed)
        all_values = {v for c in fn_cases for v in c.values}
        missing = all_values - {v for c in chosen for v in c.values}
        runnable = sum(1 for c in chosen if not c.stratum and not c.self_skipped)
        total_selected += len(chosen)
        total_runnable += runnable
        note = "all values covered" if not missing else f"MISSING {sorted(missing)}"
        report.append(f"{name:<50} {len(fn_cases):>7} {len(chosen):>8} {runnable:>8}  {note}")
        lines.append(f"# {name}: {len(chosen)} of {len(fn_cases)} cases, {runnable} not skipped today")
        lines += [c.nodeid for c in chosen]

    write_selection(args.out, args.vendor, [
        f"# a seeded (seed {args.seed}), stratified sample of about {args.budget} cases per test function,",
        "# every parameter value covered; made by scripts/select_flash_attn_tests.py (do not edit by hand).",
        "# Run: python -m pytest tests/upstream -n 8 -p no:cacheprovider -q --selected tests/upstream/selected.txt",
    ], lines)
    print(f"{'function':<50} {'cases':>7} {'selected':>8} {'run now':>8}")
    print("\n".join(report))
    print(f"{'total':<50} {total_cases:>7} {total_selected:>8} {total_runnable:>8}")
    for entry in skips.PENDING:
        if entry not in used_entries and entry.param is not None:
            print(f"note: skip entry matches no case of this upstream version: {entry}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
