"""`python -m benchmarks`: the command line of the benchmark suite (benchmarks/suite.py).

    python -m benchmarks --quick              # each suite's small grid on this GPU (~3 minutes a suite on an H200)
    python -m benchmarks --suite decode       # one suite's full grid; resumable, rows appended to results/<gpu>/
    python -m benchmarks --headline           # the README's ours / best-peer table from results/ (no GPU needed)
    python -m benchmarks --plot-only          # redraw figures/<gpu>/ from results/ (no GPU needed)
    python -m benchmarks --list               # the grids (no GPU needed)
"""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional, Sequence

from tritonattn.config.hardware import env_summary, has_gpu

from .grids import DEFAULT_DTYPES, DTYPES, FLEX_DTYPES, QUICK_DTYPES, SUITES, suite_shapes
from .report import headline_markdown, headline_table, plot_all, readme_markdown
from .suite import NO_GPU_MESSAGE, describe, run


def _csv_list(text: str) -> List[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="Benchmark suite of the Triton attention kernels against SDPA, FlexAttention and eager "
        "PyTorch (needs a CUDA GPU to measure). Results: <out>/<gpu>/bench_<suite>.csv (appended, resumable), "
        "figures: <figures>/<gpu>/bench_*.png. Exit status 3: stopped by --max-minutes, run again to continue.",
    )
    p.add_argument("--suite", default=",".join(SUITES), help=f"comma-separated, from {','.join(SUITES)} (default all)")
    p.add_argument("--quick", action="store_true", help="small grids, fewer reps, bf16, no Flex")
    p.add_argument("--dtypes", default=None, help="comma-separated from bf16,fp16,fp32 (default: prefill bf16,fp16; "
                   "decode and chunked bf16; --quick bf16)")
    p.add_argument("--out", default="results", help="results folder (relative: from the repo root)")
    p.add_argument("--figures", default="figures", help="figures folder (relative: from the repo root)")
    flex = p.add_mutually_exclusive_group()
    flex.add_argument("--no-flex", dest="flex", action="store_false", default=None, help="skip FlexAttention")
    flex.add_argument("--flex", dest="flex", action="store_true", help="include FlexAttention (also with --quick)")
    p.add_argument("--flex-dtypes", default=",".join(FLEX_DTYPES), help="dtypes FlexAttention is compiled for")
    p.add_argument("--peers", default=None, help="only these implementations, e.g. ours,sdpa_cudnn,ours_paged")
    p.add_argument("--max-minutes", type=float, default=None, help="stop cleanly after this long (resumable)")
    p.add_argument("--force", action="store_true", help="re-measure rows already written for this commit and GPU")
    p.add_argument("--no-plot", action="store_true", help="do not redraw the figures at the end")
    p.add_argument("--plot-only", action="store_true", help="only redraw figures from the CSVs (no GPU needed)")
    p.add_argument("--headline", action="store_true", help="print the ours / best-peer Markdown table (no GPU needed)")
    p.add_argument("--gpu", default=None, help="with --plot-only / --headline: one GPU's results (name or slug)")
    p.add_argument("--list", action="store_true", help="print the grids and exit (no GPU needed)")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`python -m benchmarks` (see build_parser); returns the exit status."""
    args = build_parser().parse_args(argv)
    suites = _csv_list(args.suite)
    unknown = [s for s in suites if s not in SUITES]
    if unknown:
        print(f"unknown suite(s) {unknown}; choose from {','.join(SUITES)}", file=sys.stderr)
        return 2
    dtypes = _csv_list(args.dtypes) if args.dtypes else None
    if dtypes and any(d not in DTYPES for d in dtypes):
        print(f"unknown dtype(s) in {dtypes}; choose from {','.join(DTYPES)}", file=sys.stderr)
        return 2
    if args.list:
        for suite in suites:
            grid = suite_shapes(suite, args.quick)
            names = dtypes or (QUICK_DTYPES if args.quick else DEFAULT_DTYPES[suite])
            print(f"{suite}: {len(grid)} shapes x dtypes {','.join(names)}")
            for shape in grid:
                print(f"    {describe(shape)}")
        return 0
    if args.plot_only or args.headline:
        if args.plot_only:
            plot_all(args.out, args.figures, gpu=args.gpu)
        if args.headline:
            print(readme_markdown(args.out, args.gpu))
            print(headline_markdown(headline_table(args.out, args.gpu)))
        return 0
    if not has_gpu():
        print(NO_GPU_MESSAGE, file=sys.stderr)
        return 1
    for key, value in env_summary().items():
        print(f"{key:>18}: {value}")
    summary = run(suites, quick=args.quick, dtypes=dtypes, results_dir=args.out,
                  figures_dir=None if args.no_plot else args.figures, flex=args.flex,
                  flex_dtypes=_csv_list(args.flex_dtypes), max_minutes=args.max_minutes,
                  peers=_csv_list(args.peers) if args.peers else None, force=args.force)
    return 3 if summary["stopped"] else 0


if __name__ == "__main__":
    sys.exit(main())
