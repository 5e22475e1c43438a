"""notebooks/nb_hardening.py, the teaching foils of notebook 00: each small kernel shows its bug (a wrong or
non-finite answer) and, with its one-line fix switched on, passes the error rule against the fp32 reference;
its guards reject inputs it would read out of bounds."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from helpers import DEVICE
from tritonattn.testing import attention_padded_keys_ref, check_close, references, rel_err

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "notebooks"))
import nb_hardening as nbh  # noqa: E402

B, M, H, D, DT = 1, 40, 2, 32, torch.float16  # M not a multiple of the foils' tiles (16, 32)


def qkv(seed: int):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    return [torch.randn(B, M, H, D, generator=gen, device=DEVICE).to(DT) for _ in range(3)]


def test_delta_is_right_on_contiguous_tensors_and_wrong_on_a_strided_view():
    """Bug a: offsets of a contiguous tensor read a (b, h, s, d) buffer's transposed view in the wrong order."""
    out, _, _ = qkv(0)
    dout = torch.randn(B, H, M, D, device=DEVICE).to(DT).transpose(1, 2)  # strided (b, s, h, d) view
    delta = (dout.float() * out.float()).sum(-1).transpose(1, 2)  # (b, h, s)
    assert rel_err(nbh.delta_assuming_contiguous(out, dout.contiguous()), delta) < 1e-3
    assert rel_err(nbh.delta_assuming_contiguous(out, dout), delta) > 0.1
    with pytest.raises(ValueError, match="one shape"):
        nbh.delta_assuming_contiguous(out, dout[:, :-1])


def test_unmasked_tail_lets_phantom_keys_in_and_the_mask_fixes_it():
    """Bug b: without the score mask the last tile's zero keys enter the softmax, exactly as the emulation."""
    q, k, v = qkv(1)
    ref, _, same = references(q, k, v, causal=False)
    bug = nbh.forward_unmasked_tail(q, k, v, 32)
    ok, err, bound = check_close(nbh.forward_unmasked_tail(q, k, v, 32, mask_scores=True), ref, same)
    assert ok, (err, bound)
    assert rel_err(bug, ref) > 10 * bound
    assert check_close(bug, attention_padded_keys_ref(q.float(), k.float(), v.float(), 32)[0], same)[0]
    with pytest.raises(ValueError, match="contiguous MHA"):
        nbh.forward_unmasked_tail(q, k[:, :, :1], v[:, :, :1], 32)


def test_unmasked_last_query_tile_reads_the_nan_guard_rows():
    """Bug c: the unmasked last query tile reads the NaN guard rows (dV not finite); the row mask fixes it;
    without guard rows the unmasked foil refuses to run."""
    q, k, v = qkv(2)
    dout = torch.randn_like(q)
    leaves = [t.float().requires_grad_() for t in (q, k, v)]
    ref, lse, _ = references(*leaves, causal=False)
    dv_ref = torch.autograd.grad(ref, leaves[2], dout.float())[0]
    qg, dog, lseg = nbh.with_guard_rows(q, 16), nbh.with_guard_rows(dout, 16), nbh.with_guard_rows(lse, 16, dim=2)
    guard = qg.as_strided((B, 16, H, D), qg.stride(), qg.storage_offset() + M * qg.stride(1))
    assert torch.isnan(guard).all(), "the rows after the view, inside its buffer, hold NaN"
    assert not torch.isfinite(nbh.dv_unmasked_tail(qg, k, dog, lseg)).all()
    assert rel_err(nbh.dv_unmasked_tail(qg, k, dog, lseg, mask_rows=True), dv_ref) < 1e-2
    with pytest.raises(ValueError, match="guard rows"):
        nbh.dv_unmasked_tail(q, k, dout, lse)


def test_head_dim_not_a_power_of_two_does_not_compile():
    """Bug d: tl.arange(0, HEAD_DIM) refuses 80; 64 copies."""
    x = torch.randn(64, device=DEVICE)
    assert torch.equal(nbh.copy_head_dim(x), x)
    with pytest.raises(Exception) as caught:
        nbh.copy_head_dim(torch.randn(80, device=DEVICE))
    assert "power of 2" in nbh.first_error_line(caught.value)


def test_jit_source_lines_shows_a_span_and_names_a_missing_one():
    """The library's source is shown from the function itself; a marker the source lacks is a ValueError."""
    text = nbh.jit_source_lines(nbh.copy_head_dim, ("y = torch.empty_like", "return y"))
    assert text.splitlines() == ["y = torch.empty_like(x)", "_copy_kernel[(1,)](x, y, HEAD_DIM=x.shape[0])",
                                 "return y"]
    with pytest.raises(ValueError, match="no_such_line"):
        nbh.jit_source_lines(nbh.copy_head_dim, ("no_such_line", "return y"))
