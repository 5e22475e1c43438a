"""tritonattn.testing.checks: the check tables the notebooks show, on tiny problems. Each table is a list of
plain dict rows that passes on cases the kernel handles, and `assert_table_ok` fails loudly on a bad row."""

from __future__ import annotations

import math

import pytest
import torch

from helpers import DEVICE
from tritonattn.testing import checks

FP16 = torch.float16
SMALL = [  # lengths that are not multiples of any tile; MHA non-causal, GQA causal with seqlen_q != seqlen_k
    checks.Case(1, 19, 19, 2, 2, 32, FP16, causal=False),
    checks.Case(1, 13, 21, 4, 2, 32, FP16, causal=True),
]


def test_grid_and_case_fields():
    cases = checks.grid(batch=1, seqlens=[(8, 8), (5, 9)], heads=[(4, 4), (4, 1)], head_dims=[32],
                        dtypes=[FP16])
    assert len(cases) == 2 * 2 * 2  # x causal False/True
    assert cases[0].fields()["dtype"] == "float16" and cases[-1].group == 4
    assert [c.sdpa_agrees for c in cases if c.seqlen_q == 5] == [True, False, True, False]


def test_make_inputs_layouts():
    case = checks.Case(1, 6, 7, 4, 2, 16, FP16, causal=False)
    q, k, v = checks.make_inputs(case, DEVICE)
    assert q.shape == (1, 6, 4, 16) and k.shape == v.shape == (1, 7, 2, 16) and q.is_contiguous()
    q2, _, _ = checks.make_inputs(case, DEVICE, layout="bhsd")
    assert q2.shape == q.shape and not q2.is_contiguous() and q2.stride(1) == 16, "(b, h, s, d) memory"
    q3, _, _ = checks.make_inputs(case, DEVICE, layout="nan_padded")
    assert torch.isfinite(q3).all() and q3.stride(2) == 16 + 8
    padding = torch.as_strided(q3, (1, 6, 4, 8), q3.stride(), q3.storage_offset() + 16)
    assert torch.isnan(padding).all(), "the columns past head_dim hold NaN"
    with pytest.raises(ValueError, match="layout"):
        checks.make_inputs(case, DEVICE, layout="sbhd")


def test_kernel_block_n_is_a_tile():
    block_n = checks.kernel_block_n(80, FP16, DEVICE)
    assert block_n >= 16 and block_n & (block_n - 1) == 0


def test_forward_error_table_passes_on_small_cases(capsys):
    rows = checks.forward_error_table(SMALL, DEVICE)
    assert len(rows) == len(SMALL) and all(isinstance(r, dict) for r in rows)
    assert all(r["ok"] for r in rows), rows
    for r in rows:
        assert r["err_fp32"] <= r["bound"] and r["ratio"] == pytest.approx(r["err_fp32"] / r["eager_err"])
    assert not math.isnan(rows[0]["err_sdpa"]) and math.isnan(rows[1]["err_sdpa"]), \
        "SDPA is compared only where its causal convention agrees"
    checks.assert_table_ok(rows, "forward")
    assert capsys.readouterr().out.startswith(f"forward: all {len(rows)} rows pass")
    padded = checks.forward_error_table(SMALL[:1], DEVICE, layout="nan_padded")
    assert padded[0]["ok"] and padded[0]["layout"] == "nan_padded"


def test_grad_error_table_has_one_row_per_gradient():
    rows = checks.grad_error_table(SMALL[1:], DEVICE)
    assert [r["grad"] for r in rows] == ["dq", "dk", "dv"]
    assert all(r["ok"] for r in rows), rows


def test_padded_keys_table_shows_the_unmasked_error():
    case = checks.Case(1, 19, 19, 2, 2, 32, FP16, causal=False)
    (row,) = checks.padded_keys_table([case], DEVICE, block_n=16)
    assert row["padded_keys"] == 13 and row["ok"]
    assert row["err_unmasked"] > 10 * row["err_kernel"]


def test_gqa_group_sum_table():
    (row,) = checks.gqa_group_sum_table([checks.Case(1, 9, 9, 4, 2, 16, FP16, causal=True)], DEVICE)
    assert row["group"] == 2 and row["ok"], row


def test_assert_table_ok_raises_on_a_bad_row():
    rows = [{"seqlen_q": 8, "err_fp32": 1e-4, "ratio": 1.0, "ok": True},
            {"seqlen_q": 9, "err_fp32": 0.5, "ratio": 900.0, "ok": False}]
    with pytest.raises(AssertionError, match=r"bad table: 1 of 2 rows break the rule[\s\S]*seqlen_q=9, err_fp32=0.5"):
        checks.assert_table_ok(rows, "bad table")


def test_summarize_groups_counts_cases_and_takes_maxima():
    base = dict(batch=1, seqlen_q=8, seqlen_k=8, nheads=2, nheads_k=2, head_dim=32, dtype="float16")
    rows = [
        {**base, "causal": False, "grad": "dq", "err_fp32": 1e-3, "ratio": 1.2, "err_sdpa": 2e-3, "ok": True},
        {**base, "causal": False, "grad": "dk", "err_fp32": 3e-3, "ratio": 0.9, "err_sdpa": math.nan, "ok": True},
        {**base, "causal": True, "grad": "dq", "err_fp32": 2e-3, "ratio": 1.5, "err_sdpa": math.nan, "ok": False},
        {**base, "seqlen_q": 9, "causal": False, "grad": "dq", "err_fp32": 5e-4, "ratio": 2.0, "err_sdpa": 1e-3,
         "ok": True},
    ]
    summary = checks.summarize(rows)
    assert [(s["dtype"], s["causal"], s["cases"]) for s in summary] == [("float16", False, 2), ("float16", True, 1)]
    first, second = summary
    assert (first["max_err_fp32"], first["max_ratio"], first["max_err_sdpa"], first["ok"]) == (3e-3, 2.0, 2e-3, True)
    assert math.isnan(second["max_err_sdpa"]) and second["ok"] is False
    assert set(checks.summarize(rows, by=["grad"], columns=["err_fp32", "lse_diff"])[0]) == \
        {"grad", "cases", "max_err_fp32", "ok"}, "columns the rows lack are left out"


def test_check_errors():
    def bad():
        raise ValueError("no")

    rows = checks.check_errors([("bad", bad, ValueError)])
    assert rows[0]["ok"] and rows[0]["raised"] == "ValueError"
    with pytest.raises(AssertionError, match="quiet: expected ValueError, got nothing"):
        checks.check_errors([("quiet", lambda: None, ValueError)])


def test_copies_during():
    x = torch.randn(4, 4)
    assert checks.copies_during(lambda: x.t()) == []
    assert any("clone" in op for op in checks.copies_during(lambda: x.clone()))
