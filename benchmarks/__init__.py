"""The benchmark harness of the attention library tritonattn (kernels/tritonattn/): `python -m benchmarks --help`.

- benchmarks/grids.py    the suites, their shape grids, dtypes, labels
- benchmarks/measure.py  FLOP and byte models, GPU timing, ceilings
- benchmarks/results.py  result rows (GPU, versions, date, commit) and their CSVs in results/<gpu>/
- benchmarks/suite.py    peers (SDPA backends, FlexAttention, eager), correctness checks, runners
- benchmarks/report.py   tables, the README headline and the figures in figures/<gpu>/
- benchmarks/__main__.py the command line
- benchmarks/seed_method.py, seed_table.py: the seed document's measurement method, its prefill table, L4 floors
- benchmarks/views.py, decode_views.py, variant_views.py: the notebooks' tables and plots of result rows
- benchmarks/tune_prefill.py, tune_decode.py, paged_locality.py: tuning and investigation scripts

tritonattn never imports this package. Importing it puts this checkout's source root (kernels/) first on
sys.path, so `python -m benchmarks` from the repository root measures this checkout's tritonattn without
installing it.
"""

import sys
from pathlib import Path

SOURCE_ROOT = str(Path(__file__).resolve().parents[1] / "kernels")
if SOURCE_ROOT not in sys.path:
    sys.path.insert(0, SOURCE_ROOT)
