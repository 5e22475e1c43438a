"""`AttnOptions`: what one attention call computes, split into what is compiled and what is passed; and
`Dropout`, the dropout of one call.

Every path -- prefill forward and backward, varlen, kvcache dense and paged, chunked prefill, the
primitives, the custom ops, and the cache classes through them -- gets one frozen `AttnOptions` from
the api layer's one translation of flash-attn's arguments (`api.args.attention_call`, which validates
them) and hands it down. No launcher lists an option by hand:

- `options.constexprs`: the compiled part, a `tl.constexpr` of every attention kernel (head dim and
  its power-of-two tile, causal, which variants are on). Another value compiles another kernel.
- `options.runtime`: the runtime part, plain kernel arguments named like the kernel parameters
  (softmax_scale, the window sides, softcap). Another value never recompiles.
- `options.compiled`: the compiled part as a hashable tuple. Launch caches (launch/fast.py) and
  decode's replays (launch/replay.py) key on it; a replay fills `options.runtime` into the recorded
  launch by parameter name, so a call with another runtime value reuses the launch with its own value.

A per-call tensor (ALiBi slopes, sinks, seqused_k) is a compiled flag here (HAS_ALIBI, ...) and a kernel
argument the translation validates (`AttnCall.tensors`; context parallelism adds ALiBi's origin shift for a
block of a longer sequence, Alibi_shift: [Note] ALiBi origin in jit/common.py). Attention kernels take
`**options.constexprs, **options.runtime, **tensors`; helper kernels that do no attention (the backward's
preprocessing, the cache append, the split combine) take `**options.tile`. A kernel that lacks a parameter
for an option fails at its first launch (an unexpected keyword), never silently. The recipe for a new
option, and the files it touches: docs/design.md.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import torch

from ..errors import InputError, InputTypeError


def head_dim_tile(head_dim: int) -> int:
    """The head-dim tile of the kernels: the next power of two >= head_dim, at least 16 (`tl.dot`)."""
    return max(16, 1 << (int(head_dim) - 1).bit_length())


@dataclass(frozen=True)
class AttnOptions:
    """The options of one attention call (see the module docstring). Build it with `attn_options`.

    head_dim: compiled (HEAD_DIM, and HEAD_DIM_PAD = `head_dim_tile(head_dim)`).
    softmax_scale: runtime; the scores are q @ k^T * softmax_scale.
    causal: compiled (IS_CAUSAL); bottom-right aligned: query i sees keys j <= i + seqlen_k - seqlen_q.
    window_left, window_right: a sliding window, -1 for an unbounded side: query i, whose diagonal key is
        d = i + seqlen_k - seqlen_q, sees keys d - window_left <= j <= d + window_right (causal: the
        right side is 0). Compiled as HAS_WINDOW (either side bounded); the sizes are runtime.
    softcap: runtime, compiled as HAS_SOFTCAP (> 0): scaled scores s become softcap * tanh(s / softcap).
    alibi: compiled (HAS_ALIBI): the scores gain -slope * |d - j|, slopes passed per call (a tensor).
    sinks: compiled (HAS_SINKS): each row's softmax denominator gains exp(sink), per head (a tensor).
    seqused_k: compiled (HAS_SEQUSED_K): packed sequence b attends to the first seqused_k[b] keys of its
        cu_seqlens_k span (a tensor; bottom-right alignment counts those keys only).
    kv_fp8: compiled (KV_FP8): the KV cache holds float8_e4m3fn values, dequantized on load with per-(batch,
        KV head) descales (per-call tensors); appended rows are quantized with the same descales
        (`FP8_E4M3_MAX`). Cache kernels only (decode, the cache-mode forward, the append).
    tree: compiled (HAS_TREE): the query tokens are draft tokens, the last seqlen_q keys, and among them a token
        sees only the drafts its tree mask names (per-call tensors: the mask, each request's draft count and
        its mask's offset), always itself, never a later draft; every key before the drafts is seen. Decode only.
    """

    head_dim: int
    softmax_scale: float
    causal: bool = False
    window_left: int = -1
    window_right: int = -1
    softcap: float = 0.0
    alibi: bool = False
    sinks: bool = False
    seqused_k: bool = False
    kv_fp8: bool = False
    tree: bool = False

    @property
    def has_window(self) -> bool:
        return self.window_left >= 0 or self.window_right >= 0

    @functools.cached_property
    def constexprs(self) -> Dict[str, Any]:
        """The compiled part, by kernel parameter name."""
        return {**self.tile, "IS_CAUSAL": self.causal, "HAS_WINDOW": self.has_window,
                "HAS_SOFTCAP": self.softcap > 0.0, "HAS_ALIBI": self.alibi, "HAS_SINKS": self.sinks,
                "HAS_SEQUSED_K": self.seqused_k, "KV_FP8": self.kv_fp8, "HAS_TREE": self.tree}

    @functools.cached_property
    def runtime(self) -> Dict[str, Any]:
        """The runtime part, by kernel parameter name."""
        return {"softmax_scale": self.softmax_scale, "window_left": self.window_left,
                "window_right": self.window_right, "softcap": self.softcap}

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


def resolve_scale(softmax_scale, head_dim: int) -> float:
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
def _cached_options(head_dim: int, softmax_scale: Optional[float], causal: bool, window: Tuple[int, int],
                    softcap: float, alibi: bool, sinks: bool, seqused_k: bool, kv_fp8: bool,
                    tree: bool) -> AttnOptions:
    left, right = (max(w, -1) for w in window)  # any negative side is unbounded
    if causal:
        right = 0
    if (left, right) == (-1, 0):  # a window bounded only on the right at the diagonal is causal
        causal = True
    if causal and left == -1:
        right = -1  # plain causal: no window
    return AttnOptions(head_dim, resolve_scale(softmax_scale, head_dim), causal, left, right, softcap, alibi, sinks,
                       seqused_k, kv_fp8, tree)


def attn_options(head_dim: int, softmax_scale=None, causal=False, window=(-1, -1), softcap=0.0, alibi=False,
                 sinks=False, seqused_k=False, kv_fp8=False, tree=False) -> AttnOptions:
    """Validated `AttnOptions` (softmax_scale None: head_dim ** -0.5; it must be finite and positive).

    window (left, right) is normalised: a negative side is unbounded (-1), causal makes the right side
    0, and (-1, 0) is causal attention without a window, so equal semantics give equal options.
    softcap must be finite and >= 0 (0: off).

    Options are cached by value, so a decode loop builds each one once (a tensor softmax_scale is
    read when the options are built). The head dim itself is checked by the public functions
    (api/validate.py `validate_head_dim`).
    """
    causal, head_dim = bool(causal), int(head_dim)
    if type(softmax_scale) not in (float, int, type(None)):  # a numpy scalar, a 0-d tensor: its value now
        softmax_scale = resolve_scale(softmax_scale, head_dim)
    window = window_pair(window) if type(window) is not tuple or window != (-1, -1) else window
    return _cached_options(head_dim, softmax_scale, causal, window, _resolve_softcap(softcap), bool(alibi),
                           bool(sinks), bool(seqused_k), bool(kv_fp8), bool(tree))


FP8_E4M3_MAX = 448.0  # the largest finite float8_e4m3fn: appended values are clamped to +-this before the cast
FP8_SCALE_HEADROOM = 2.0  # KVCache / PagedKVCache: a prompt's amax is stored at 448 / this (room for 2x later)
KV_FP8_DTYPES = (torch.float8_e4m3fn,)  # the KV-cache dtypes dequantized on load (config: kv_fp8)


def softcap_number(softcap) -> float:
    """softcap as a float (None: 0.0), or InputTypeError for what is not a number; its range is the caller's
    rule (flash-attn's arguments: <= 0 is off; `attn_options`: finite and >= 0)."""
    try:
        return float(softcap if softcap is not None else 0.0)
    except (TypeError, ValueError):
        raise InputTypeError(f"Expected softcap to be a number, got {type(softcap).__name__}.") from None


def _resolve_softcap(softcap) -> float:
    cap = softcap_number(softcap)
    if not (cap >= 0.0 and math.isfinite(cap)):
        raise InputError(f"Expected softcap to be finite and >= 0 (0: off), got {softcap}.")
    return cap


def window_pair(window_size) -> Tuple[int, int]:
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


@dataclass(frozen=True)
class Dropout:
    """Dropout of the attention probabilities (see [Note] Dropout in kernels/tritonattn/jit/prefill_fwd.py).

    p: the probability of dropping, in (0, 1); a pair is kept when its 16-bit draw is below
        keep_threshold = round((1 - p) * 2^16), and kept probabilities are scaled by 2^16 / keep_threshold
        (1 / (1 - p) up to that rounding: the expectation stays exact).
    rng_state: int64 (2,) on the inputs' device, (seed, salt) of the Philox bits; the forward draws it
        (`dropout`), the backward and `dropout_probs` take the same one back.
    """

    p: float
    rng_state: torch.Tensor

    @property
    def keep_threshold(self) -> int:
        return round((1.0 - self.p) * 65536)

    @property
    def kernel_args(self) -> dict:
        """The forward's and backward's dropout arguments."""
        return dict(Rng=self.rng_state, keep_threshold=self.keep_threshold, dropout_scale=65536 / self.keep_threshold,
                    HAS_DROPOUT=True)
