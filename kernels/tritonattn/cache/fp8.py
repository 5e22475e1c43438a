"""An FP8 cache's scales, owned by `KVCache` / `PagedKVCache` built with dtype=torch.float8_e4m3fn.

One descale per (request slot, KV head) for K and one for V (FlashAttention-3's k_descale / v_descale:
stored value * descale = the value), set when a request's prompt is written: from the prompt's largest
magnitude per KV head, amax * headroom / 448, so the prompt's values use the top of e4m3's range less
a factor `headroom` (default FP8_SCALE_HEADROOM = 2: appended values up to twice the prompt's largest
are stored unclamped; e4m3 is a float format, so the headroom costs no relative precision above its
subnormals, 2^-6 * 448 / headroom below the amax), or given by the caller. The descales are kept for
every append. Values beyond +-448 * descale are clamped (never NaN) and counted per (slot, KV head):
`saturated` [slot, h, 0] for K, [slot, h, 1] for V, prompt and appends alike, added on the device (no
host sync; reading it syncs).
"""

from __future__ import annotations

import numbers
from typing import Optional, Union

import torch

from ..config.options import FP8_E4M3_MAX
from ..errors import InputError, InputTypeError


class FP8Scales:
    """k_descale, v_descale: float32 (slots, nheads_k); saturated: int64 (slots, nheads_k, 2); all on the
    cache's device. A slot's descales are 1.0 until its prompt sets them."""

    def __init__(self, slots: int, nheads_k: int, device: torch.device, headroom: float):
        if isinstance(headroom, bool) or not isinstance(headroom, numbers.Real) or not 1.0 <= headroom < 448.0:
            raise InputError(f"Expected fp8_headroom to be a number in [1, 448), got {headroom!r}.")
        self.headroom = float(headroom)
        self.k_descale = torch.ones(slots, nheads_k, dtype=torch.float32, device=device)
        self.v_descale = torch.ones(slots, nheads_k, dtype=torch.float32, device=device)
        self.saturated = torch.zeros(slots, nheads_k, 2, dtype=torch.int64, device=device)

    def reset(self, index) -> None:
        """Forget the slots' scales (1.0) and counts (0)."""
        self.k_descale[index] = 1.0
        self.v_descale[index] = 1.0
        self.saturated[index] = 0

    def descale_for(self, name: str, given, x: torch.Tensor) -> torch.Tensor:
        """float32 (n, nheads_k): the caller's descale (a number, or a tensor of one element or of shape (n,
        nheads_k)), or x's amax per (request, KV head) * headroom / 448 (1.0 where x is all zeros)."""
        n, nheads_k = x.shape[0], x.shape[2]
        if given is None:
            amax = x.detach().abs().amax(dim=(1, 3)).float()  # (n, nheads_k)
            return torch.where(amax > 0, amax * (self.headroom / FP8_E4M3_MAX), torch.ones_like(amax))
        if isinstance(given, bool) or not isinstance(given, (numbers.Real, torch.Tensor)):
            raise InputTypeError(f"Expected {name} to be a number or a float32 tensor, got {type(given).__name__}.")
        d = torch.as_tensor(given, dtype=torch.float32, device=x.device)
        if d.numel() == 1:
            d = d.reshape(1, 1).expand(n, nheads_k)
        elif tuple(d.shape) != (n, nheads_k):
            raise InputError(f"Expected {name} of shape (n, nheads_k) = ({n}, {nheads_k}) or one element, got "
                             f"{tuple(d.shape)}.")
        if d.device.type == "cpu" or not torch.cuda.is_current_stream_capturing():
            if not bool(torch.isfinite(d).all()) or not bool((d > 0).all()):
                raise InputError(f"Expected {name} finite and > 0 (stored value * {name} = the value).")
        return d.contiguous()

    def set_descales(self, index, k: torch.Tensor, v: torch.Tensor, k_descale=None, v_descale=None):
        """Set the slots' descales from k, v (n, seqlen, nheads_k, head_dim) or as given (`descale_for`); both
        are checked before either is set. Returns them, float32 (n, nheads_k)."""
        kd = self.descale_for("k_descale", k_descale, k)
        vd = self.descale_for("v_descale", v_descale, v)
        self.k_descale[index] = kd
        self.v_descale[index] = vd
        return kd, vd

    def store_prompt(self, index, k: torch.Tensor, v: torch.Tensor, k_descale=None, v_descale=None):
        """The prompt's K and V as e4m3 (n, seqlen, nheads_k, head_dim), quantized as the kernels' append
        quantizes (x / descale in float32, clamped to +-448, rounded to nearest even); the slots' descales
        set (`set_descales`) and their clamped values counted."""
        kd, vd = self.set_descales(index, k, v, k_descale, v_descale)
        out = []
        for x, d, which in ((k, kd, 0), (v, vd, 1)):
            y = x.float() / d[:, None, :, None]
            self.saturated[index, :, which] += (y.abs() > FP8_E4M3_MAX).sum(dim=(1, 3))
            out.append(y.clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn))
        return out[0], out[1]

    def call_args(self, index: Union[slice, torch.Tensor]) -> dict:
        """flash_attn_with_kvcache's k_descale / v_descale / kv_saturated for the slots `index` (a slice: views,
        the counts land in place; an index tensor: gathered copies, `settle` adds the counts back)."""
        counter = self.saturated[index]
        if isinstance(index, torch.Tensor):
            counter = torch.zeros_like(counter)
        return dict(k_descale=self.k_descale[index], v_descale=self.v_descale[index], kv_saturated=counter)

    def settle(self, index: Union[slice, torch.Tensor], args: Optional[dict]) -> None:
        """After a call with `call_args(index)`: a gathered counter's counts added to the slots'."""
        if args is not None and isinstance(index, torch.Tensor):
            self.saturated.index_add_(0, index, args["kv_saturated"])
