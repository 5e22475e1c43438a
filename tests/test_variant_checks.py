"""The attention variants' check tables (tritonattn.testing.variant_checks) and their notebook views
(benchmarks.variant_views): every variant passes at tiny shapes, a broken kernel output fails its row, the
views condense the committed rows and draw them. Tiny shapes under the interpreter; on a GPU also bf16.
"""

from __future__ import annotations

import math

import pytest
import torch

from benchmarks import variant_views
from benchmarks.serving import engine_from_sizes, make_workload
from helpers import DEVICE, ON_GPU
from tritonattn.testing import checks, variant_checks

DTYPES = [torch.float16] + ([torch.bfloat16] if ON_GPU else [])
SIZES = dict(nheads=4, nheads_k=2, head_dim=32, window=6, softcap=5.0)


def test_variant_kwargs_and_slopes():
    slopes = variant_checks.alibi_slopes(8)
    assert slopes.dtype == torch.float32 and torch.allclose(slopes, 2 ** (-torch.arange(1, 9.0)))
    kw = variant_checks.variant_kwargs("all", nheads=4, window=6, softcap=5.0, device=DEVICE, sinks_grad=True)
    assert kw["causal"] and kw["window_size"] == (5, 0) and kw["softcap"] == 5.0
    assert kw["alibi_slopes"].shape == (4,) and kw["sinks"].requires_grad
    assert variant_checks.variant_kwargs("causal", nheads=4, window=6, softcap=5.0) == {"causal": True}
    with pytest.raises(ValueError, match="variant"):
        variant_checks.variant_kwargs("dropout", nheads=4, window=6, softcap=5.0)
    with pytest.raises(ValueError, match="window"):
        variant_checks.variant_kwargs("window", nheads=4, window=0, softcap=5.0)


def test_sinks_come_from_the_tables_seed():
    """The sink logits are drawn from the generator given, so a table is a function of its seed."""
    sinks = [variant_checks.variant_kwargs("sinks", nheads=4, window=6, softcap=5.0, device=DEVICE,
                                           gen=checks.generator(DEVICE, 3))["sinks"] for _ in range(2)]
    assert torch.equal(*sinks) and sinks[0].dtype == torch.float32
    rows = [variant_checks.decode_check_table(lengths=(3, 9), capacity=16, page_size=16, dtype=torch.float16,
                                              device=DEVICE, variants=("sinks",), num_splits=(1,), seed=5,
                                              caches=("dense",), **SIZES) for _ in range(2)]
    assert rows[0] == rows[1]


def test_window_mask_is_the_references_mask():
    """window_mask draws the keys attention_ref lets each query see (bottom-right aligned)."""
    from tritonattn.testing import attention_ref, causal_mask, window_mask

    assert torch.equal(window_mask(5, 9, causal=True), causal_mask(5, 9))
    assert window_mask(3, 3).all()
    band = window_mask(4, 6, (1, 1))  # query i sits at key i + 2
    assert band.tolist()[0] == [False, True, True, True, False, False]
    q, k, v = (torch.randn(1, n, 1, 16) for n in (4, 6, 6))
    ref, _ = attention_ref(q, k, v, window_size=(1, 1))
    masked = torch.softmax((q[0, :, 0] @ k[0, :, 0].T * 16**-0.5).masked_fill(~band, float("-inf")), -1)
    assert torch.allclose(ref[0, :, 0], masked @ v[0, :, 0], atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_check_table_passes_every_variant(dtype):
    rows = variant_checks.prefill_check_table(batch=1, seqlen=40, dtype=dtype, device=DEVICE, **SIZES)
    assert [r["variant"] for r in rows] == list(variant_checks.VARIANTS)
    checks.assert_table_ok(rows, "prefill variants")
    assert all(isinstance(r["out_err"], float) and r["dq_err"] <= r["dq_bound"] for r in rows)
    assert [r["variant"] for r in rows if "dsinks_err" in r] == ["sinks", "all"], "dsinks only where there are sinks"


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_check_table_passes_dense_and_paged_split_and_not(dtype):
    rows = variant_checks.decode_check_table(lengths=(0, 1, 5, 6, 7, 47), capacity=48, page_size=16, dtype=dtype,
                                             device=DEVICE, variants=("causal", "window", "all"), **SIZES)
    assert len(rows) == 3 * 2 * 2
    assert {(r["cache"], r["num_splits"]) for r in rows} == {("dense", 1), ("dense", 3), ("paged", 1), ("paged", 3)}
    checks.assert_table_ok(rows, "decode variants")
    worst = variant_checks.worst(rows)
    assert worst in rows and all(r["err"] / r["bound"] <= worst["err"] / worst["bound"] for r in rows)
    assert variant_checks.worst([]) is None


def test_decode_check_table_rejects_a_capacity_off_the_pages():
    with pytest.raises(ValueError, match="multiple of page_size"):
        variant_checks.decode_check_table(lengths=(3,), capacity=40, page_size=16, dtype=torch.float16, **SIZES)


def test_a_broken_output_fails_its_row(monkeypatch):
    """A kernel output off by a little breaks the rule: the table says so instead of passing."""
    real = variant_checks.flash_attn_with_kvcache

    def broken(*args, **kwargs):
        out = real(*args, **kwargs)
        return out + 0.05 * out.abs().max()

    monkeypatch.setattr(variant_checks, "flash_attn_with_kvcache", broken)
    rows = variant_checks.decode_check_table(lengths=(2, 9), capacity=16, page_size=16, dtype=torch.float16,
                                             device=DEVICE, variants=("causal",), num_splits=(1,), **SIZES)
    assert not any(r["ok"] for r in rows)
    with pytest.raises(AssertionError, match="break the rule"):
        checks.assert_table_ok(rows, "broken")


# --------------------------------------------------------------------------------------------
# The views (pandas, matplotlib; committed rows; no GPU)
# --------------------------------------------------------------------------------------------
def test_committed_rows_condense_into_ratio_tables(tmp_path):
    prefill, decode = variant_views.committed("variants"), variant_views.committed("decode_variants")
    if prefill is None or decode is None:
        pytest.skip("no committed variant results")
    keys = ["gpu", "path", "shape", "variant"]
    assert not prefill.duplicated(keys).any() and not decode.duplicated(keys + ["page_size"]).any(), "latest only"
    shape = prefill["shape"].iloc[0]
    table = variant_views.prefill_ratio_table(prefill, shape)
    assert list(table.columns[:2]) == ["fwd / plain", "fwd+bwd / plain"] and table.loc["causal"].iloc[0] == 1.0
    assert "nan" not in table.to_string().lower(), "missing ratios read -"
    dec = variant_views.decode_ratio_table(decode)
    assert dec.columns[0] == "µs, dense" and "nan" not in dec.to_string().lower()
    targets = variant_views.speed_targets(prefill[prefill["shape"] == shape], decode)
    assert set(targets) == {"decode window", "decode others", "decode paged", "prefill window", "prefill others"}
    assert 0 < targets["decode window"] <= 1.5 and 0 < targets["prefill window"] < targets["prefill others"]
    variant_views.plot_speed(prefill, decode, shape=shape, title="test", path=tmp_path / "speed.png")
    variant_views.plot_masks(tmp_path / "masks.png")
    variant_views.plot_score_mods(tmp_path / "mods.png")
    assert all((tmp_path / f"{n}.png").stat().st_size > 0 for n in ("speed", "masks", "mods"))


def test_memory_table_pivots_measured_rows():
    import pandas as pd

    rows = pd.DataFrame([dict(path=p, shape=s, variant=v, mib_ours=m) for p in ("fwd", "fwd_bwd")
                         for s, m in (("1x1024", 10.0), ("1x2048", 20.0)) for v in ("causal", "sinks")])
    table = variant_views.memory_table(rows)
    assert list(table.index) == ["causal", "sinks"] and list(table.columns) == ["1x1024", "1x2048"]
    assert table.loc["sinks", "1x2048"] == 20.0


def test_window_memory_table_full_against_window():
    sizes = dict(nheads=4, nheads_k=2, head_dim=32, page_size=8, num_blocks=40, max_batch=3, max_seqlen=64,
                 chunk_size=16, token_budget=24, dtype=torch.float16, verify="all", num_requests=3)
    workload = make_workload(3, (30, 50), (4, 8), 3, seed=0)
    engines = {}
    for label, window in (("full", None), ("window", 12)):
        engines[label] = engine_from_sizes(sizes, DEVICE, sliding_window=window)
        engines[label].submit(workload)
        engines[label].run()
    table = variant_views.window_memory_table(engines)
    assert table.loc["full", "tokens"] == table.loc["window", "tokens"]
    assert (table["passed"] == table["checked"]).all() and (table["checked"] > 0).all()
    assert table.loc["window", "most_pages_one_request"] < table.loc["full", "most_pages_one_request"]
    assert table.loc["window", "peak_pool_mib"] < table.loc["full", "peak_pool_mib"]
    assert not math.isnan(table.loc["window", "mean_pool_mib"])
