"""The `flash_attn` alias that runs flash-attention's own tests (tests/upstream) computes what they assume.

The upstream tests build their references with the alias's pure-torch helpers (pad/unpad, rotary),
so a wrong helper would make them pass or fail for the wrong reason: these checks pin the helpers to
hand-made examples and direct formulas on the CPU. The alias modules are loaded from their files
under private names, so this process never gets a module called `flash_attn` (the benchmarks look
for the real flash-attn under that name).
"""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch

UPSTREAM = Path(__file__).resolve().parent / "upstream"


def _load(relpath: str, name: str):
    spec = importlib.util.spec_from_file_location(name, UPSTREAM / relpath)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses resolve their module while the class body runs
    spec.loader.exec_module(module)
    return module


bert_padding = _load("flash_attn/bert_padding.py", "_alias_bert_padding")
rotary = _load("flash_attn/layers/rotary.py", "_alias_rotary")
interface = _load("flash_attn/flash_attn_interface.py", "_alias_flash_attn_interface")
skips = _load("skips.py", "_alias_skips")


def test_unpad_input_hand_made():
    """unpad_input packs the valid tokens batch-major and returns flash-attn's five values."""
    x = torch.arange(2 * 3 * 2, dtype=torch.float32).reshape(2, 3, 2)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    x_unpad, indices, cu_seqlens, max_seqlen, seqused = bert_padding.unpad_input(x, mask)
    assert torch.equal(indices, torch.tensor([0, 1, 3, 4, 5]))
    assert torch.equal(x_unpad, x.reshape(6, 2)[[0, 1, 3, 4, 5]])
    assert cu_seqlens.dtype == torch.int32 and cu_seqlens.tolist() == [0, 2, 5]
    assert max_seqlen == 3 and isinstance(max_seqlen, int)
    assert seqused.dtype == torch.int32 and seqused.tolist() == [2, 3]


def test_unpad_input_unused_mask():
    """Slots in unused_mask are packed and counted in cu_seqlens, but not in seqused."""
    x = torch.randn(2, 4, 3)
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 1, 0]])
    unused = torch.tensor([[0, 1, 0, 0], [0, 0, 0, 1]])
    x_unpad, indices, cu_seqlens, max_seqlen, seqused = bert_padding.unpad_input(x, mask, unused)
    assert indices.tolist() == [0, 1, 4, 5, 6, 7]
    assert cu_seqlens.tolist() == [0, 2, 6] and max_seqlen == 4 and seqused.tolist() == [1, 3]


def test_pad_input_inverts_unpad_and_carries_gradients():
    """pad_input puts the tokens back, zeros the padding, and gradients reach the packed tokens."""
    torch.manual_seed(0)
    x = torch.randn(3, 5, 2, 4)
    mask = torch.rand(3, 5) > 0.4
    mask[:, 0] = True
    x_unpad, indices, _, _, _ = bert_padding.unpad_input(x, mask)
    leaf = x_unpad.clone().requires_grad_()
    padded = bert_padding.pad_input(leaf, indices, 3, 5)
    assert torch.equal(padded, x * mask[:, :, None, None])
    (grad,) = torch.autograd.grad((padded * 2).sum(), leaf)
    assert torch.equal(grad, torch.full_like(leaf, 2.0))


def _rotate_direct(x, cos, sin, positions, interleaved):
    """The rotary formula written out pair by pair, in float64."""
    out = x.double().clone()
    half = cos.shape[1]
    for b in range(x.shape[0]):
        for i in range(x.shape[1]):
            p = int(positions[b][i])
            if p >= cos.shape[0]:
                continue
            for j in range(half):
                a, c = (2 * j, 2 * j + 1) if interleaved else (j, j + half)
                x1, x2 = x[b, i, :, a].double(), x[b, i, :, c].double()
                cj, sj = float(cos[p, j]), float(sin[p, j])
                out[b, i, :, a] = x1 * cj - x2 * sj
                out[b, i, :, c] = x1 * sj + x2 * cj
    return out


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("offsets", ["int", "tensor"])
def test_apply_rotary_emb_matches_the_formula(interleaved, offsets):
    """Rotates the first rotary_dim features by position (offset per sequence), leaves the rest."""
    torch.manual_seed(0)
    batch, seqlen, nheads, headdim, rotary_dim, table = 2, 5, 3, 12, 8, 9
    x = torch.randn(batch, seqlen, nheads, headdim)
    angle = torch.rand(table, rotary_dim // 2) * 2 * math.pi
    cos, sin = angle.cos(), angle.sin()
    off = 3 if offsets == "int" else torch.tensor([0, 6], dtype=torch.int32)  # 6 + 4 runs past the table
    out = rotary.apply_rotary_emb(x, cos, sin, interleaved=interleaved, seqlen_offsets=off)
    starts = [off, off] if offsets == "int" else off.tolist()
    positions = [[s + i for i in range(seqlen)] for s in starts]
    expected = _rotate_direct(x, cos, sin, positions, interleaved)
    torch.testing.assert_close(out.double(), expected, rtol=1e-6, atol=1e-6)
    assert torch.equal(out[..., rotary_dim:], x[..., rotary_dim:])


def test_apply_rotary_emb_fp16_rounds_once_and_inplace():
    """fp16 results are the float32 computation rounded once; inplace writes into x and returns it."""
    torch.manual_seed(0)
    x = torch.randn(1, 4, 2, 16, dtype=torch.float16)
    angle = torch.rand(4, 4) * 2 * math.pi
    cos, sin = angle.cos().half(), angle.sin().half()
    expected = rotary.apply_rotary_emb(x.float(), cos.float(), sin.float()).half()
    assert torch.equal(rotary.apply_rotary_emb(x, cos, sin), expected)
    y = x.clone()
    assert rotary.apply_rotary_emb(y, cos, sin, inplace=True) is y and torch.equal(y, expected)


def test_apply_rotary_emb_packed_equals_padded():
    """With cu_seqlens, each packed sequence is rotated as the same sequence in a padded batch."""
    torch.manual_seed(0)
    lengths, nheads, headdim = [3, 5], 2, 8
    angle = torch.rand(16, 4) * 2 * math.pi
    cos, sin = angle.cos(), angle.sin()
    offsets = torch.tensor([2, 7])
    seqs = [torch.randn(n, nheads, headdim) for n in lengths]
    packed = torch.cat(seqs)
    cu_seqlens = torch.tensor([0, 3, 8], dtype=torch.int32)
    out = rotary.apply_rotary_emb(packed, cos, sin, seqlen_offsets=offsets, cu_seqlens=cu_seqlens, max_seqlen=5)
    for b, seq in enumerate(seqs):
        alone = rotary.apply_rotary_emb(seq[None], cos, sin, seqlen_offsets=int(offsets[b]))[0]
        torch.testing.assert_close(out[cu_seqlens[b]:cu_seqlens[b + 1]], alone, rtol=0, atol=0)


def test_block_size_n_is_one_block():
    """_get_block_size_n spans every key, so the upstream S_dmask check rescales whole rows."""
    assert interface._get_block_size_n(None, 128, True, False) >= 2**30
    assert interface.USE_TRITON_ROCM is False


def test_skip_entries_match_by_value_and_type():
    """A skip entry matches its function (or any) and exact value; True is not 1 nor 1.0."""
    entry = skips.Skip("*", "alibi", True, "ALiBi")
    assert entry.matches("test_x", {"alibi": True})
    assert not entry.matches("test_x", {"alibi": 1}) and not entry.matches("test_x", {"alibi": False})
    assert not entry.matches("test_x", {})
    whole = skips.Skip("test_y", None, None, "internals")
    assert whole.matches("test_y", {}) and not whole.matches("test_x", {})
    assert all(e.reason for e in skips.OUT_OF_SCOPE + skips.PENDING + skips.RNG_STREAM)
    both = skips.Skip("test_z", "seqlen_q", 1, "small sample", also=(("dropout_p", 0.17),))
    assert both.matches("test_z", {"seqlen_q": 1, "dropout_p": 0.17})
    assert not both.matches("test_z", {"seqlen_q": 1, "dropout_p": 0.0})
    assert not both.matches("test_z", {"seqlen_q": 1})
    assert not both.matches("test_z", {"seqlen_q": 2, "dropout_p": 0.17})
