"""tritonattn.testing.decode_checks: the decode check tables pass on the kernels at tiny shapes, hold the
columns the notebooks read, and flag what they exist to catch (a stale cache row read, a wrong append)."""

from __future__ import annotations

import pytest
import torch

from helpers import DEVICE
from tritonattn.testing import decode_checks as dc
from tritonattn.testing.checks import assert_table_ok

H, HK, D, DT = 4, 2, 16, torch.float16


def test_decode_inputs_shapes_and_seed():
    q, kc, vc, k, v = dc.decode_inputs(2, 9, 3, H, HK, D, DT, DEVICE, seed=5)
    assert q.shape == (2, 3, H, D) and kc.shape == vc.shape == (2, 9, HK, D) and k.shape == v.shape == (2, 3, HK, D)
    assert all(t.dtype == DT for t in (q, kc, vc, k, v))
    assert torch.equal(q, dc.decode_inputs(2, 9, 3, H, HK, D, DT, DEVICE, seed=5)[0])
    assert not torch.equal(kc, vc)


def test_head_kind():
    assert [dc.head_kind(8, hk) for hk in (8, 2, 1)] == ["MHA", "GQA", "MQA"]


def test_equivalence_table():
    rows = dc.decode_equivalence_table(batch=1, nheads=H, nheads_k_values=(HK,), head_dim=D, lengths=(1, 5),
                                       dtype=DT, device=DEVICE)
    assert [r["seqlen"] for r in rows] == [1, 5] and all(r["kind"] == "GQA" and r["cache_written"] for r in rows)
    assert {"err_decode", "err_prefill", "bound", "decode_vs_prefill", "agree_tol"} <= rows[0].keys()
    assert_table_ok(rows, "equivalence")


def test_ragged_and_split_tables():
    lengths = (0, 1, 20)
    ragged = dc.decode_ragged_table(lengths=lengths, seqlen_cache=24, nheads=H, nheads_k=HK, head_dim=D, dtype=DT,
                                    device=DEVICE, num_splits_values=(1, 2))
    assert len(ragged) == 2 * 2 * len(lengths)
    assert sorted({r["keys_seen"] for r in ragged}) == [0, 1, 2, 20, 21]
    assert_table_ok(ragged, "ragged")
    split = dc.decode_split_table(lengths=lengths, seqlen_cache=24, nheads=H, nheads_k=HK, head_dim=D, dtype=DT,
                                  device=DEVICE, seqlen_q_values=(1,), num_splits_values=(1, 2))
    assert [r["num_splits"] for r in split] == [1, 2] and split[0]["diff_vs_unsplit"] == 0
    assert_table_ok(split, "split")


def test_append_table_lists_the_written_rows():
    rows = dc.decode_append_table(lengths=(0, 3), seqlen_cache=8, seqlen_q=2, nheads=H, nheads_k=HK, head_dim=12,
                                  dtype=DT, device=DEVICE, num_splits=1)
    assert [(r["rows_expected"], r["rows_written_k"], r["rows_written_v"]) for r in rows] == [
        ("0-1", "0-1", "0-1"), ("3-4", "3-4", "3-4")]
    assert_table_ok(rows, "append")


def test_kvcache_round_trip_table():
    rows = dc.kvcache_round_trip_table(batch=2, prompt=5, steps=(1, 2), new_prompt=3, nheads=H, nheads_k=HK,
                                       head_dim=D, dtype=DT, device=DEVICE)
    names = [r["check"] for r in rows]
    assert names[0] == "prefill 5 tokens" and "overflow raises" in names and names[-1] == "reset all"
    assert_table_ok(rows, "KVCache round trip")
    with pytest.raises(ValueError, match="batch >= 2"):
        dc.kvcache_round_trip_table(batch=1, prompt=2, steps=(1,), new_prompt=1, nheads=H, nheads_k=HK, head_dim=D,
                                    dtype=DT, device=DEVICE)


def test_chunked_prefill_table():
    rows = dc.chunked_prefill_table([3, 5], nheads=H, nheads_k=HK, head_dim=D, page_size=4, dtype=DT, device=DEVICE)
    assert [(r["cache"], r["start"], r["end"]) for r in rows] == [
        ("dense", 0, 3), ("paged", 0, 3), ("dense", 3, 8), ("paged", 3, 8)]
    assert_table_ok(rows, "chunked prefill")
    with pytest.raises(ValueError, match="positive ints"):
        dc.chunked_prefill_table([2, 0], nheads=H, nheads_k=HK, head_dim=D, page_size=4, dtype=DT)


def test_tables_flag_a_kernel_that_reads_and_writes_one_row_late(monkeypatch):
    """A kernel off by one cache row (it appends at row L + 1 and attends over a stale row) fails the
    equivalence, ragged and append tables: they catch what they exist to catch."""
    real = dc.flash_attn_with_kvcache

    def one_row_late(q, k_cache, v_cache, k=None, v=None, *, cache_seqlens, **kwargs):
        return real(q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens + 1, **kwargs)

    monkeypatch.setattr(dc, "flash_attn_with_kvcache", one_row_late)
    equivalence = dc.decode_equivalence_table(batch=1, nheads=H, nheads_k_values=(HK,), head_dim=D, lengths=(5,),
                                              dtype=DT, device=DEVICE)
    assert not equivalence[0]["ok"] and not equivalence[0]["cache_written"]
    ragged = dc.decode_ragged_table(lengths=(1, 6), seqlen_cache=10, nheads=H, nheads_k=HK, head_dim=D, dtype=DT,
                                    device=DEVICE, num_splits_values=(1,))
    assert not any(r["ok"] for r in ragged if r["append"]), ragged
    assert all(r["err_fp32"] > r["bound"] for r in ragged), "every request attends over one stale row"
    append = dc.decode_append_table(lengths=(0, 3), seqlen_cache=8, seqlen_q=2, nheads=H, nheads_k=HK, head_dim=12,
                                    dtype=DT, device=DEVICE, num_splits=1)
    assert [r["rows_written_k"] for r in append] == ["1-2", "4-5"] and not any(r["ok"] for r in append)
    with pytest.raises(AssertionError, match="2 of 2 rows break the rule"):
        assert_table_ok(append, "append")
