"""`AttnOptions`: what one attention call computes, split into what is compiled and what is passed.

Every path -- prefill forward and backward, varlen, kvcache dense and paged, chunked prefill, and the
KV-cache helpers and serving engine through them -- turns its public arguments into one frozen
`AttnOptions` (`attn_options`, which validates them) and hands it down. No launcher lists an option
by hand:

- `options.constexprs`: the compiled part, a `tl.constexpr` of every attention kernel (head dim and
  its power-of-two tile, causal). Another value compiles another kernel.
- `options.runtime`: the runtime part, plain kernel arguments named like the kernel parameters
  (softmax_scale). Another value never recompiles.
- `options.compiled`: the compiled part as a hashable tuple. Launch caches (kernels/_launch.py) and
  decode's replays (kernels/decode.py) key on it; a replay fills `options.runtime` into the recorded
  launch by parameter name, so a call with another runtime value reuses the launch with its own value.

Attention kernels take `**options.constexprs, **options.runtime`; helper kernels that do no attention
(the backward's preprocessing, the cache append, the split combine) take `**options.tile`. A kernel
that lacks a parameter for an option fails at its first launch (an unexpected keyword), never silently.

Adding an option (a sliding window, say) -- see docs/design.md:
1. a field here whose default means "off", validated in `attn_options`;
2. its compiled part in `constexprs` (HAS_WINDOW) and its values in `runtime` (window_left,
   window_right), so a new window size is a new argument, not a new kernel;
3. the parameters in every attention kernel and one place in kernels/_jit.py (the mask) that they call;
4. the reference (kernels/reference.py) and the tests (tests/test_options.py checks every field).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

from .errors import InputError, InputTypeError


def head_dim_tile(head_dim: int) -> int:
    """The head-dim tile of the kernels: the next power of two >= head_dim, at least 16 (`tl.dot`)."""
    return max(16, 1 << (int(head_dim) - 1).bit_length())


@dataclass(frozen=True)
class AttnOptions:
    """The options of one attention call (see the module docstring). Build it with `attn_options`.

    head_dim: compiled (HEAD_DIM, and HEAD_DIM_PAD = `head_dim_tile(head_dim)`).
    softmax_scale: runtime; the scores are q @ k^T * softmax_scale.
    causal: compiled (IS_CAUSAL); bottom-right aligned.
    """

    head_dim: int
    softmax_scale: float
    causal: bool = False

    @functools.cached_property
    def constexprs(self) -> Dict[str, Any]:
        """The compiled part, by kernel parameter name."""
        return {**self.tile, "IS_CAUSAL": self.causal}

    @functools.cached_property
    def runtime(self) -> Dict[str, Any]:
        """The runtime part, by kernel parameter name."""
        return {"softmax_scale": self.softmax_scale}

    @functools.cached_property
    def tile(self) -> Dict[str, int]:
        """The head-dim constexprs alone, for helper kernels that do no attention."""
        return {"HEAD_DIM": self.head_dim, "HEAD_DIM_PAD": head_dim_tile(self.head_dim)}

    @functools.cached_property
    def compiled(self) -> Tuple[Tuple[str, Any], ...]:
        """`constexprs` as a hashable tuple: what launch and replay keys hold of the options."""
        return tuple(self.constexprs.items())

    @property
    def head_dim_pad(self) -> int:
        return self.tile["HEAD_DIM_PAD"]


def _resolve_scale(softmax_scale, head_dim: int) -> float:
    if softmax_scale is None:
        return head_dim**-0.5
    try:
        scale = float(softmax_scale)
    except TypeError:
        raise InputTypeError(
            f"Expected softmax_scale to be a number or None, got {type(softmax_scale).__name__}."
        ) from None
    except ValueError:
        raise InputError(f"Expected softmax_scale to be a finite positive number, got {softmax_scale!r}.") from None
    if not (scale > 0.0 and math.isfinite(scale)):
        raise InputError(f"Expected softmax_scale to be a finite positive number, got {softmax_scale}.")
    return scale


@functools.lru_cache(maxsize=1024)
def _cached_options(head_dim: int, softmax_scale: Optional[float], causal: bool) -> AttnOptions:
    return AttnOptions(head_dim, _resolve_scale(softmax_scale, head_dim), causal)


def attn_options(head_dim: int, softmax_scale=None, causal=False) -> AttnOptions:
    """Validated `AttnOptions` (softmax_scale None: head_dim ** -0.5; it must be finite and positive).

    Options are cached by value, so a decode loop builds each one once (a tensor softmax_scale is
    read when the options are built). The head dim itself is checked by the public functions
    (kernels/_utils.py `_validate_head_dim`).
    """
    causal, head_dim = bool(causal), int(head_dim)
    if type(softmax_scale) not in (float, int, type(None)):  # a numpy scalar, a 0-d tensor: its value now
        softmax_scale = _resolve_scale(softmax_scale, head_dim)
    return _cached_options(head_dim, softmax_scale, causal)


def _window_pair(window_size) -> Tuple[int, int]:
    """flash-attn's window_size: a pair of ints, or a 2-element tensor as its tests pass."""
    if hasattr(window_size, "tolist"):
        window_size = window_size.tolist()
    try:
        left, right = window_size
        if int(left) != left or int(right) != right:
            raise ValueError
    except (TypeError, ValueError):
        raise InputError(f"Expected window_size to be a pair of ints (left, right), got {window_size!r}.") from None
    return int(left), int(right)


def resolve_variants(window_size, softcap, alibi_slopes, causal: bool, seqlen_k: int) -> bool:
    """flash-attn's variant arguments, checked before any launch; returns `causal` as they leave it.

    window_size (left, right), a negative side unbounded, follows flash-attn's rules: causal means
    right = 0, a side reaching past seqlen_k is unbounded, so (-1, -1) is no window and (-1, 0) is
    causal. Sliding windows, softcap > 0 and alibi_slopes are not implemented yet: NotImplementedError.
    """
    if type(window_size) is not tuple or window_size != (-1, -1):
        left, right = _window_pair(window_size)
        right = 0 if causal else right
        left = -1 if left < 0 or left >= seqlen_k else left
        right = -1 if right < 0 or right >= seqlen_k else right
        if left != -1 or right not in (-1, 0):
            raise NotImplementedError(
                f"window_size={tuple(_window_pair(window_size))} (a sliding window) is not implemented yet; "
                "only (-1, -1) and, for causal attention, (-1, 0)."
            )
        causal = right == 0
    if softcap is not None and softcap > 0.0:
        raise NotImplementedError(f"softcap={softcap} is not implemented yet; only softcap=0.0.")
    if alibi_slopes is not None:
        raise NotImplementedError("alibi_slopes (ALiBi) is not implemented yet; pass None.")
    return bool(causal)
