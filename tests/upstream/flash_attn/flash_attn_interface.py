"""`flash_attn.flash_attn_interface` for the upstream test file: our functions and two test hooks.

The upstream test reads three things from this module besides the attention functions:

- `USE_TRITON_ROCM`: flash-attn's switch to its ROCm Triton backend. False: our kernels are not that
  backend, and the one test it gates (a CUDA-extension internal) is out of scope anyway.
- `_get_block_size_n(device, head_dim, is_dropout, is_causal)`: the key-block width with which the
  test undoes the per-block normalisation of `S_dmask` (see below).
- the private entry points `_flash_attn_varlen_forward` and `flash_attn_gpu`, which only tests of
  flash-attn's internals import: they are deliberately absent (tests/upstream/skips.py skips those
  tests as out of scope).
"""

from tritonattn.flash_attn_interface import *  # noqa: F403  the public functions
from tritonattn.flash_attn_interface import __all__ as _PUBLIC

__all__ = ["USE_TRITON_ROCM", *_PUBLIC]

USE_TRITON_ROCM = False

# Wider than any key length: the whole row is one block (see _get_block_size_n).
_ONE_BLOCK = 1 << 31


def _get_block_size_n(device, head_dim: int, is_dropout: bool, is_causal: bool) -> int:
    """The key-block width the upstream test assumes `S_dmask` was normalised with: one block per row.

    With dropout, `return_attn_probs=True` returns `S_dmask`, the probabilities the kernel kept
    (>= 0) or dropped (negated). flash-attn's CUDA kernel stores them unnormalised, each key block
    scaled by the running row maximum at the time the block was visited (it visits key blocks right
    to left), and the test's `normalize_flash_attn_S` undoes exactly that: it splits the keys into
    blocks of this width and rescales block j by exp(max over blocks >= j - lse).

    Our kernels visit key blocks left to right, so no per-block split can describe their running
    maximum; with a single block the test's rescaling is exp(row max - lse) for every key. Hence
    the contract `S_dmask` must meet, whatever the arguments here:

        S_dmask[b, h, i, j] = +-exp(score[i, j] - max_j' score[i, j'])   (sign: kept +, dropped -)

    where score includes the softmax scale (and an ALiBi bias when there is one), the max runs over
    the keys row i may see, and masked or padded positions may hold anything (the test zeroes them).
    The arguments are accepted for flash-attn's signature and do not change the answer.
    """
    return _ONE_BLOCK
