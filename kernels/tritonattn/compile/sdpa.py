"""Our kernels as `scaled_dot_product_attention`'s flash backend (torch >= 2.10's provider hook).

Importing tritonattn registers the provider under the name "tritonattn"; nothing changes until the user
activates it, for the whole process:

    import torch.nn.attention as attn
    attn.activate_flash_attention_impl("tritonattn")   # SDPA's flash backend now runs our kernels
    attn.restore_flash_attention_impl()             # back to PyTorch's own

While active, the CUDA kernels of aten::_scaled_dot_product_flash_attention (and its backward) and of
aten::_flash_attention_forward / _flash_attention_backward (the varlen path) are ours. PyTorch still
picks the backend: this applies wherever SDPA chooses flash (Ampere and Ada, e.g. Colab's L4, for
fp16/bf16; anywhere under `sdpa_kernel(SDPBackend.FLASH_ATTENTION)`). The outputs follow the ops'
contracts: out and the gradients have their inputs' strides, logsumexp is (batch, nheads, seqlen_q)
(packed: (nheads, total_q)), and rng_state holds the dropout's (seed, salt) as uint64 (2,), which the
backward takes back, so a dropout mask is drawn once and replayed exactly (zeros without dropout).
seqused_k (the varlen path's per-sequence key count) is honoured. Not supported, with a clear error:
return_debug_mask, and seqused_k or ALiBi slopes when a gradient is wanted (PyTorch's backward op takes
neither). That last check sees grad mode and requires_grad when
the op runs: code that calls the op with grad mode off and differentiates it through its own autograd
(AOT autograd, a custom op) gets gradients without the slopes, as with PyTorch's own kernels.

PyTorch marks the hook a prototype; it was tested with torch 2.11. Without the hook (torch < 2.10)
nothing is registered.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .ops import prefill_backward, prefill_forward, rng_input

IMPL_NAME = "tritonattn"


def _window(side: Optional[int]) -> int:
    return -1 if side is None else int(side)


def _rng_outputs(rng_state: Optional[Tensor], device: torch.device):
    """The ops' (rng_state, unused) outputs: our (seed, salt) seen as uint64 (2,), zeros without dropout."""
    seed = rng_state.view(torch.uint64) if rng_state is not None else torch.zeros(2, dtype=torch.uint64, device=device)
    return seed, torch.zeros((), dtype=torch.uint64, device=device)


def _forward_rng(dropout_p: float, rng_state: Tensor) -> Optional[Tensor]:
    return rng_state.view(torch.int64) if dropout_p > 0 else None


def _no_debug_mask(return_debug_mask: bool) -> None:
    if return_debug_mask:
        raise NotImplementedError("return_debug_mask (the dropout mask, a testing aid) is not supported by the "
                                  "'tritonattn' flash attention provider; restore_flash_attention_impl() for it.")


def _flash_attention_forward(query: Tensor, key: Tensor, value: Tensor, cum_seq_q: Optional[Tensor],
                             cum_seq_k: Optional[Tensor], max_q: int, max_k: int, dropout_p: float, is_causal: bool,
                             return_debug_mask: bool, *, scale: Optional[float] = None,
                             window_size_left: Optional[int] = None, window_size_right: Optional[int] = None,
                             seqused_k: Optional[Tensor] = None, alibi_slopes: Optional[Tensor] = None):
    """aten::_flash_attention_forward: (batch, seqlen, nheads, headdim), or packed with cum_seq_q/k."""
    _no_debug_mask(return_debug_mask)
    for name, given in (("ALiBi slopes", alibi_slopes), ("seqused_k", seqused_k)):
        if given is not None and torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)):
            raise NotImplementedError(f"{name} with a gradient: aten::_flash_attention_backward does not take it, so "
                                      "the gradient would ignore it; use tritonattn.flash_attn_varlen_func for both.")
    rng = rng_input(dropout_p, query.device)
    out, lse = prefill_forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, alibi_slopes, None, seqused_k,
                               rng, scale, is_causal, _window(window_size_left), _window(window_size_right), 0.0,
                               dropout_p, out=torch.empty_like(query))
    return (out, lse, *_rng_outputs(rng, query.device), query.new_empty((0,)))


def _flash_attention_backward(grad_out: Tensor, query: Tensor, key: Tensor, value: Tensor, out: Tensor,
                              logsumexp: Tensor, cum_seq_q: Optional[Tensor], cum_seq_k: Optional[Tensor], max_q: int,
                              max_k: int, dropout_p: float, is_causal: bool, rng_state: Tensor, unused: Tensor, *,
                              scale: Optional[float] = None, window_size_left: Optional[int] = None,
                              window_size_right: Optional[int] = None):
    grads = tuple(torch.empty_like(t) for t in (query, key, value))
    prefill_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, None, None, None,
                     _forward_rng(dropout_p, rng_state), scale, is_causal, _window(window_size_left),
                     _window(window_size_right), 0.0, dropout_p, torch.are_deterministic_algorithms_enabled(),
                     grads=grads)
    return grads


def _bshd(*tensors: Tensor):
    """SDPA's (batch, nheads, seqlen, headdim) tensors as our (batch, seqlen, nheads, headdim) views."""
    return tuple(t.transpose(1, 2) for t in tensors)


def _sdpa_flash_forward(query: Tensor, key: Tensor, value: Tensor, dropout_p: float = 0.0, is_causal: bool = False,
                        return_debug_mask: bool = False, *, scale: Optional[float] = None):
    """aten::_scaled_dot_product_flash_attention: SDPA's layout; GQA as nheads_k dividing nheads."""
    _no_debug_mask(return_debug_mask)
    q, k, v = _bshd(query, key, value)
    output = torch.empty_like(query)
    rng = rng_input(dropout_p, query.device)
    _, lse = prefill_forward(q, k, v, None, None, q.shape[1], k.shape[1], None, None, None, rng, scale, is_causal, -1,
                             -1, 0.0, dropout_p, out=output.transpose(1, 2))
    seed, offset = _rng_outputs(rng, query.device)
    return output, lse, None, None, query.shape[2], key.shape[2], seed, offset, query.new_empty((0,))


def _sdpa_flash_backward(grad_out: Tensor, query: Tensor, key: Tensor, value: Tensor, out: Tensor, logsumexp: Tensor,
                         cum_seq_q: Optional[Tensor], cum_seq_k: Optional[Tensor], max_q: int, max_k: int,
                         dropout_p: float, is_causal: bool, philox_seed: Tensor, philox_offset: Tensor, *,
                         scale: Optional[float] = None):
    grads = tuple(torch.empty_like(t) for t in (query, key, value))
    q, k, v, o, do = _bshd(query, key, value, out, grad_out)
    prefill_backward(do, q, k, v, o, logsumexp, None, None, q.shape[1], k.shape[1], None, None, None,
                     _forward_rng(dropout_p, philox_seed), scale, is_causal, -1, -1, 0.0, dropout_p,
                     torch.are_deterministic_algorithms_enabled(), grads=_bshd(*grads))
    return grads


_IMPLS = {
    "_scaled_dot_product_flash_attention": _sdpa_flash_forward,
    "_scaled_dot_product_flash_attention_backward": _sdpa_flash_backward,
    "_flash_attention_forward": _flash_attention_forward,
    "_flash_attention_backward": _flash_attention_backward,
}


class _Handle:
    """What `activate_flash_attention_impl` keeps: the registrations, dropped by `remove`."""

    def __init__(self, library: torch.library.Library):
        self.library = library

    def remove(self) -> None:
        if self.library is not None:
            self.library._destroy()
            self.library = None


def _register() -> _Handle:
    library = torch.library.Library("aten", "IMPL", "CUDA")  # noqa: TOR901 (an override, on purpose)
    for name, impl in _IMPLS.items():
        library.impl(name, impl, "CUDA")
    return _Handle(library)


def available() -> bool:
    """Whether this torch has the provider hook (torch.nn.attention.register_flash_attention_impl)."""
    return hasattr(torch.nn.attention, "register_flash_attention_impl")


if available():
    torch.nn.attention.register_flash_attention_impl(IMPL_NAME, register_fn=_register)
