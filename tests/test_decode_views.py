"""benchmarks/decode_views.py: the decode step's arithmetic, and the seed's decode benchmark rows and plot at a
tiny shape (host wall time, no memory, under the interpreter)."""

from __future__ import annotations

import pytest
import torch

from benchmarks import decode_views as dv
from helpers import DEVICE, ON_GPU


def test_decode_arithmetic_is_g_flops_per_byte():
    rows = dv.decode_arithmetic(2, 32, 8, 128, torch.float16, (512, 8192))
    assert [r["cache_len"] for r in rows] == [512, 8192]
    assert rows[1]["kv_mib"] == 2 * 2 * 8192 * 8 * 128 * 2 / 2**20
    assert rows[1]["mflop"] == 4 * 2 * 32 * 8192 * 128 / 1e6
    assert all(r["flop_per_byte"] == 4 for r in rows)
    assert dv.decode_arithmetic(1, 8, 8, 64, torch.float32, (100,))[0]["flop_per_byte"] == 0.5


def test_seed_decode_rows_and_plot(tmp_path):
    rows = dv.seed_decode_rows(2, 4, 2, 16, torch.float16, (8, 20), DEVICE, warmup=0, reps=2)
    assert [(r["impl"], r["cache_len"]) for r in rows] == [(i, n) for n in (8, 20) for i in dv.IMPLS]
    assert all(r["ok"] and r["status"] == "ok" and r["median_ms"] > 0 for r in rows)
    assert all((r["peak_mib"] is None) != ON_GPU for r in rows)
    table = dv.by_impl(rows, "median_ms")
    assert set(table) == set(dv.IMPLS) and set(table["ours"]) == {8, 20}
    path = tmp_path / "seed_decode.png"
    dv.plot_seed_decode(rows, title="tiny", path=path)
    assert path.stat().st_size > 0


def test_by_impl_gives_none_for_oom():
    rows = [{"impl": "eager_cat", "cache_len": 4, "status": "OOM", "median_ms": None}]
    assert dv.by_impl(rows, "median_ms") == {"eager_cat": {4: None}}


@pytest.mark.skipif(ON_GPU, reason="the no-GPU error")
def test_decode_bandwidth_needs_a_gpu():
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        dv.decode_bandwidth(1, 4, 2, 16, torch.float16, (8,), copy_gbps=1.0)


def test_fp8_decode_rows_halve_the_bytes_within_the_quantization_error():
    """The FP8 table: half the bytes per token, errors measured against fp64 (the 16-bit cache's far smaller
    than the FP8 one's, with and without outlier channels), and times only when asked for."""
    from tritonattn.testing import FP8_KV_OUTLIER_RTOL, FP8_KV_RTOL

    rows = dv.fp8_decode_rows(1, 4, 2, 32, torch.float16, (40, 100), DEVICE, timed=False)
    assert [r["cache_len"] for r in rows] == [40, 100]
    for r in rows:
        assert r["bytes_per_token_fp8"] * 2 == r["bytes_per_token"] == 2 * 2 * 32 * 2
        assert r["err_16"] < r["err_fp8"] <= FP8_KV_RTOL and r["err_16"] < r["err_fp8_outliers"] <= FP8_KV_OUTLIER_RTOL
        assert "speedup" not in r
