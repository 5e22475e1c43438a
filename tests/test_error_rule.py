"""The error rule's relative error (tritonattn.testing.rel_err): relative to the reference's norm, and for a
reference that is zero ([Note] Zero references) the root-mean-square error, so that rounding noise around an
exactly-zero result (dq under a window of one key) is judged at the scale of every other result."""

import pytest
import torch

from tritonattn.testing import ZERO_RMS, check_close, rel_err


def test_relative_to_the_reference_norm():
    """||out - ref|| / ||ref|| where the reference is not zero; 0 for empty tensors."""
    ref = torch.randn(64, 32, dtype=torch.float64)
    noise = torch.randn_like(ref)
    assert rel_err(ref + 1e-3 * noise, ref) == pytest.approx(1e-3 * noise.norm().item() / ref.norm().item())
    assert rel_err(torch.empty(0), torch.empty(0)) == 0.0


def test_zero_reference_is_judged_by_rms():
    """A zero reference: rounding noise of float32 size passes the float32 bound, an error of order one fails,
    whatever the number of elements (the absolute norm it replaces grew with their count)."""
    for n in (16, 9472, 1 << 20):
        zero = torch.zeros(n)
        rounding = 1e-7 * torch.randn(n)
        assert rel_err(rounding, zero) < 1e-6
        assert check_close(rounding, zero, zero)[0]
        assert not check_close(1e-2 * torch.randn(n), zero, zero)[0]
    assert rel_err(torch.full((4,), 0.5), torch.full((4,), 0.5 * ZERO_RMS)) == pytest.approx(0.5, rel=1e-5)
