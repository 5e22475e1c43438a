"""The notebooks' helpers (notebooks/nbutils.py) that compute something a test can check: the
chunked-prefill table of notebook 04 and the serving stats round trip.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from benchmarks.serving import Request, ServingEngine
from helpers import DEVICE

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "notebooks"))
import nbutils  # noqa: E402


def test_chunked_prefill_table_passes_and_sees_every_chunk():
    """The notebook's chunked-prefill table: one passing row per chunk and cache (dense and paged, rows
    that are not the request's poisoned with NaN)."""
    table = nbutils.chunked_prefill_table((5, 17, 1, 33), nheads=4, nheads_k=2, head_dim=32, page_size=16,
                                          dtype=torch.float16, device=DEVICE)
    print(table.to_string())
    assert len(table) == 8 and table["ok"].all()
    assert list(table[table.cache == "paged"]["end"]) == [5, 22, 23, 56]


def test_stats_round_trip_and_plot(tmp_path):
    """Per-step stats saved as CSV rows come back as the latest run, and plot to a PNG."""
    eng = ServingEngine(nheads=4, nheads_k=2, head_dim=32, page_size=16, num_blocks=14, max_batch=4, max_seqlen=96,
                        chunk_size=24, token_budget=32, dtype=torch.float16, device=DEVICE, verify="all", strict=True)
    eng.submit([Request(9, 1, 0), Request(3, 2, 0)])
    eng.run()
    config = {"dtype": torch.float16, "nheads": 4, "chunks": (5, 17)}  # tuples are not stored
    for _ in range(2):
        path = nbutils.save_stats(eng.stats, config, results_dir=tmp_path)
    loaded = nbutils.load_stats(results_dir=tmp_path)
    assert path.exists() and len(loaded) == len(eng.stats), "only the latest run comes back"
    assert loaded["dtype"].iloc[0] == "float16" and "chunks" not in loaded.columns
    assert nbutils.summary(loaded)["tokens"] == nbutils.summary(eng.stats)["tokens"] == 15
    figure = nbutils.plot_serving(loaded, title="test", path=tmp_path / "serving.png")
    assert (tmp_path / "serving.png").stat().st_size > 0 and len(figure.axes) == 4
