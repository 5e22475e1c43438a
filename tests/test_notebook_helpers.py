"""What notebook 04 (serving) calls beyond the engine: the chunked-prefill table of
tritonattn.testing.decode_checks as the notebook reads it, and benchmarks.serving's construction from a
notebook's sizes, run summaries, stats round trip and plots.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from benchmarks import serving
from benchmarks.serving import Request, ServingEngine
from helpers import DEVICE
from tritonattn.testing.checks import assert_table_ok
from tritonattn.testing.decode_checks import chunked_prefill_table


def small_engine(**overrides) -> ServingEngine:
    kwargs = dict(nheads=4, nheads_k=2, head_dim=32, page_size=16, num_blocks=14, max_batch=4, max_seqlen=96,
                  chunk_size=24, token_budget=32, dtype=torch.float16, device=DEVICE, verify="all", strict=True)
    kwargs.update(overrides)
    return ServingEngine(**kwargs)


def test_chunked_prefill_table_passes_and_sees_every_chunk():
    """Notebook 04's chunked-prefill table: one passing row per chunk and cache (dense and paged, rows that
    are not the request's poisoned with NaN)."""
    rows = chunked_prefill_table((5, 17, 1, 33), nheads=4, nheads_k=2, head_dim=32, page_size=16,
                                 dtype=torch.float16, device=DEVICE)
    assert len(rows) == 8
    assert_table_ok(rows, "chunked prefill")
    assert [r["end"] for r in rows if r["cache"] == "paged"] == [5, 22, 23, 56]


def test_engine_from_sizes_takes_the_engine_fields_and_overrides():
    sizes = SimpleNamespace(nheads=4, nheads_k=2, head_dim=32, page_size=16, num_blocks=14, max_batch=4,
                            max_seqlen=96, chunk_size=24, token_budget=32, dtype=torch.float16, verify="all",
                            num_requests=6, prompt_range=(5, 80), chunks=(5, 17))  # workload fields: ignored
    engine = serving.engine_from_sizes(sizes, DEVICE, verify="none", sliding_window=20)
    assert engine.verify == "none" and engine.sliding_window == 20 and engine.cache.num_blocks == 14
    assert serving.engine_from_sizes(vars(sizes), DEVICE).verify == "all", "a mapping works too"
    with pytest.raises(ValueError, match="token_budget"):
        serving.engine_from_sizes(sizes, DEVICE, token_budget=3)
    with pytest.raises(TypeError, match="mapping or a namespace"):
        serving.engine_from_sizes([("nheads", 4)], DEVICE)


def test_requests_record_the_pages_they_held():
    engine = small_engine()
    engine.submit([Request(40, 3, 0), Request(9, 2, 0)])
    engine.run()
    log = engine.requests_frame()
    assert list(log["pages_held"]) == [-(-43 // 16), 1], "the most pages each request held, measured"
    assert (log["pages_held"] <= log["pages"]).all()


def test_stats_round_trip_summary_and_plots(tmp_path):
    """Per-step stats saved as CSV rows come back as the latest run; their summary reads without nan; the
    plots write PNGs."""
    eng = small_engine()
    eng.submit([Request(9, 1, 0), Request(3, 2, 0)])
    eng.run()
    config = {"dtype": torch.float16, "nheads": 4, "chunks": (5, 17)}  # tuples are not stored
    for _ in range(2):
        path = serving.save_stats(eng.stats, config, results_dir=tmp_path)
    loaded = serving.load_stats(results_dir=tmp_path)
    assert path.exists() and len(loaded) == len(eng.stats), "only the latest run comes back"
    assert loaded["dtype"].iloc[0] == "float16" and "chunks" not in loaded.columns
    totals = serving.summary(loaded)
    assert totals["tokens"] == serving.summary(eng.stats)["tokens"] == 15
    assert totals["peak_pool_in_use_mib"] <= totals["pool_mib"]
    assert serving.load_stats(results_dir=tmp_path / "none") is None
    figure = serving.plot_serving(loaded, title="test", path=tmp_path / "serving.png")
    assert (tmp_path / "serving.png").stat().st_size > 0 and len(figure.axes) == 4
    figure = serving.plot_request_memory({"run": eng.requests_frame()}, bytes_per_token=eng.bytes_per_token,
                                         page_size=16, max_seqlen=96, title="test", path=tmp_path / "requests.png")
    assert (tmp_path / "requests.png").stat().st_size > 0


def test_summary_lines_read_a_missing_rate_as_a_dash():
    stats = [dict(step=0, wall_ms=2.0, tokens=10, prefill_tokens=10, decode_tokens=0, running=1, pool_in_use_mib=1.0,
                  pool_mib=2.0, live_kv_mib=0.5, dense_running_mib=3.0, dense_max_batch_mib=6.0)]
    totals = serving.summary(stats)
    assert math.isnan(totals["tokens_per_s_decode_only_steps"]) and totals["tokens_per_s"] == 5000
    lines = serving.summary_lines(totals)
    assert len(lines) == 3 and "nan" not in " ".join(lines).lower()
    assert "5,000 overall" in lines[1] and "- in decode-only steps" in lines[1]
