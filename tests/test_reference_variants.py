"""tritonattn.testing.attention_ref's attention variants (sliding window, softcap, ALiBi, sinks) against a
second, loop-by-loop float64 implementation of the formulas in its docstring: the reference the kernels
will be judged by must itself be right. Also: the variants at their "off" values change nothing, and
causal ALiBi equals flash-attn's form of it (a bias that differs per row by a constant) in the output.
"""

from __future__ import annotations

import math

import pytest
import torch

from tritonattn.testing import attention_ref


def naive(q, k, v, *, causal=False, window=(-1, -1), softcap=0.0, slopes=None, sinks=None):
    """(out, lse) by explicit loops over (batch, head, query), float64; the formulas, nothing shared."""
    batch, seqlen_q, nheads, head_dim = q.shape
    seqlen_k, group = k.shape[1], nheads // k.shape[2]
    out = torch.zeros(batch, seqlen_q, nheads, head_dim, dtype=torch.float64)
    lse = torch.empty(batch, nheads, seqlen_q, dtype=torch.float64)
    left, right = window
    if causal:
        right = 0
    for b in range(batch):
        for h in range(nheads):
            for i in range(seqlen_q):
                d = i + seqlen_k - seqlen_q
                logits, values = [], []
                for j in range(seqlen_k):
                    if (right >= 0 and j > d + right) or (left >= 0 and j < d - left):
                        continue
                    s = float(q[b, i, h] @ k[b, j, h // group]) / math.sqrt(head_dim)
                    if softcap > 0:
                        s = softcap * math.tanh(s / softcap)
                    if slopes is not None:
                        slope = slopes[h] if slopes.dim() == 1 else slopes[b, h]
                        s -= float(slope) * abs(d - j)
                    logits.append(s)
                    values.append(v[b, j, h // group])
                if sinks is not None:
                    logits.append(float(sinks[h]))
                if not logits:
                    lse[b, h, i] = math.inf
                    continue
                top = max(logits)
                weights = [math.exp(x - top) for x in logits]
                total = sum(weights)
                lse[b, h, i] = top + math.log(total)
                for w, val in zip(weights, values):  # the sink, last, weighs no value
                    out[b, i, h] += w / total * val
    return out, lse


def inputs(batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seqlen_q, nheads, head_dim, generator=gen, dtype=torch.float64)
    k = torch.randn(batch, seqlen_k, nheads_k, head_dim, generator=gen, dtype=torch.float64)
    v = torch.randn(batch, seqlen_k, nheads_k, head_dim, generator=gen, dtype=torch.float64)
    return q, k, v


CASES = {
    "window 2,1": dict(window=(2, 1)),
    "window 0,0": dict(window=(0, 0)),
    "window 3 causal": dict(window=(3, -1), causal=True),
    "window wider than the keys": dict(window=(50, 50)),
    "left only": dict(window=(1, -1)),
    "right only": dict(window=(-1, 0)),
    "softcap": dict(softcap=1.5),
    "alibi per head": dict(slopes=torch.tensor([0.5, 0.25, 0.125, 0.0625], dtype=torch.float64)),
    "alibi per batch and head": dict(slopes="per batch"),
    "sinks": dict(sinks=torch.tensor([0.0, 1.0, -2.0, 3.0], dtype=torch.float64)),
    "sinks causal": dict(sinks=torch.tensor([0.5, 2.0, -1.0, 0.0], dtype=torch.float64), causal=True),
    "everything": dict(window=(3, -1), causal=True, softcap=2.0, sinks=torch.tensor([0.3, -0.2, 1.0, 0.0],
                                                                                     dtype=torch.float64),
                       slopes=torch.tensor([0.5, 0.25, 0.125, 0.0625], dtype=torch.float64)),
}


@pytest.mark.parametrize("shape", [(2, 5, 9, 4, 2, 8), (2, 9, 5, 4, 4, 8), (1, 7, 7, 4, 1, 16)],
                         ids=["q<k", "q>k", "q=k mqa"])
@pytest.mark.parametrize("name", list(CASES))
def test_variants_match_the_formulas(name, shape):
    """attention_ref's out and lse equal the loop-by-loop formulas, including rows that see no key."""
    case = dict(CASES[name])
    q, k, v = inputs(*shape)
    if isinstance(case.get("slopes"), str):  # (batch, heads): drawn for this shape's batch
        case["slopes"] = torch.rand(shape[0], 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    want_out, want_lse = naive(q, k, v, **case)
    got_out, got_lse = attention_ref(q, k, v, causal=case.get("causal", False),
                                     window_size=case.get("window", (-1, -1)), softcap=case.get("softcap", 0.0),
                                     alibi_slopes=case.get("slopes"), sinks=case.get("sinks"))
    torch.testing.assert_close(got_out, want_out, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(got_lse.double(), want_lse, atol=1e-5, rtol=1e-6)  # the lse is float32
    assert not torch.isnan(got_out).any()


def test_off_values_change_nothing():
    """window (-1, -1), softcap 0 and no slopes or sinks are plain attention, causal or not."""
    q, k, v = inputs(2, 6, 11, 4, 2, 8)
    for causal in (False, True):
        plain = attention_ref(q, k, v, causal=causal)
        off = attention_ref(q, k, v, causal=causal, window_size=(-1, -1), softcap=0.0)
        assert torch.equal(plain[0], off[0]) and torch.equal(plain[1], off[1])


def test_causal_alibi_equals_flash_attns_bias():
    """flash-attn's causal ALiBi adds slope * (j - (seqlen_k - 1)), which differs from -slope * |d - j| by a
    constant per row: the same probabilities, the same output."""
    q, k, v = inputs(2, 6, 10, 4, 4, 8)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], dtype=torch.float64)
    out, _ = attention_ref(q, k, v, causal=True, alibi_slopes=slopes)
    scores = torch.einsum("bmhd,bnhd->bhmn", q, k) / math.sqrt(8)
    scores = scores + slopes.view(1, 4, 1, 1) * (torch.arange(10, dtype=torch.float64) - 9)
    rows = torch.arange(6)[:, None] + 4
    scores = scores.masked_fill(torch.arange(10)[None, :] > rows, float("-inf"))
    flash_style = torch.einsum("bhmn,bnhd->bmhd", torch.softmax(scores, -1), v)
    torch.testing.assert_close(out, flash_style, atol=1e-12, rtol=1e-10)
