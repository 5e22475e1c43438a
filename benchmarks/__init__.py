"""The benchmark harness of the Triton attention kernels in kernels/: `python -m benchmarks --help`.

- benchmarks/grids.py    the suites, their shape grids, dtypes, labels
- benchmarks/measure.py  FLOP and byte models, GPU timing, ceilings
- benchmarks/results.py  result rows (GPU, versions, date, commit) and their CSVs in results/<gpu>/
- benchmarks/suite.py    peers (SDPA backends, FlexAttention, eager), correctness checks, runners
- benchmarks/report.py   tables, the README headline and the figures in figures/<gpu>/
- benchmarks/__main__.py the command line
- benchmarks/tune_prefill.py, tune_decode.py, paged_locality.py: tuning and investigation scripts

kernels/ never imports this package.
"""
