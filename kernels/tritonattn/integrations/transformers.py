"""Our kernels as a Hugging Face transformers attention backend.

    import tritonattn.integrations.transformers           # registers "triton_attention"
    model = AutoModelForCausalLM.from_config(config, attn_implementation="triton_attention")
    # or, on a loaded model: model.set_attn_implementation("triton_attention")

Importing this module registers `attention_forward` with transformers' `AttentionInterface` and
`padding_mask` with its `AttentionMaskInterface` under NAME; `register(name)` registers them under
another name too. `import tritonattn` alone never touches transformers. Tested with transformers 5.23.

What a model passes and where it goes (docs/design.md, "transformers"):
  - (batch, heads, seq, head_dim) query/key/value, GQA/MQA: read in place as (batch, seq, heads,
    head_dim) views, no copies.
  - `scaling` -> softmax_scale; `is_causal` (else `module.is_causal`) -> causal, aligned bottom-right,
    so queries after a cache's keys line up; `softcap` -> softcap; `s_aux` (gpt-oss's sinks) -> sinks,
    with its gradient; `dropout` -> dropout_p (models pass 0 in eval).
  - `sliding_window=W`: a causal query sees W keys, itself included (transformers' masks keep key j
    for query i iff i - j < W), so window_size = (W - 1, 0); bidirectional masks keep |i - j| <= W,
    so (W, W).
  - Padding: the mask function returns transformers' 2-D padding mask (as flash-attn's does) with
    its `Padding` attached, computed once per forward and read by every layer. A left-padded batch
    (each row's padding a prefix: what `generate` makes) runs with no copy through
    `flash_attn_with_kvcache(cache_leftpad=...)` when no gradient is needed;
    any other padding, or training, unpads the real tokens into `flash_attn_varlen_func` and pads the
    output back with zeros. Never a dense mask.
  - Padding-free batches (`cu_seq_lens_q/k` + `max_length_q/k` keywords, or position_ids that restart
    in a batch of one, as `DataCollatorWithFlattening` makes them) run through the varlen kernels.
  - Decode and chunked prefill (fewer queries than keys, no gradient) use the split-KV decode kernels.
Refused with a clear error: a 4-D (dense) mask; a mask pattern other than causal / sliding window /
bidirectional / packed sequences (chunked attention, image-token overlays: use "sdpa" or "eager" for
those models), found by evaluating transformers' mask function at the call's positions once per
forward; `output_attentions=True`; transformers' continuous-batching paged cache (`cache=`, which
transformers itself refuses for a backend of another name). Pad query rows (rows that are padding) come
out as zeros.

Hugging Face's hub-kernels package (`kernels` on PyPI, which transformers >= 5.25 requires) is a different
package: it can be installed next to this one, and transformers' hub-kernel support finds it, not us.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
from transformers import AttentionInterface, masking_utils

from ..api.kvcache import flash_attn_with_kvcache
from ..api.prefill import flash_attn_func, flash_attn_varlen_func
from ..errors import InputError

NAME = "triton_attention"
PADDING_ATTR = "_triton_attention_padding"


class Padding:
    """The padding of one forward's batch, as every attention layer of that forward needs it. It rides on
    the mask tensor the mask function returns (attribute PADDING_ATTR): transformers passes that tensor
    on untouched (generate calls .contiguous() on it, which returns the same tensor), and a layer that
    gets a mask without it builds its own.

    mask: (batch, L) bool, True for a real token; key j of the layer is real iff mask[:, j], keys
        at j >= L (a static cache's unfilled rows) are never read. The layer's queries are the last
        seqlen_q positions of the L.
    leftpad: (batch,) int32, the number of padding tokens of each row, when every row's padding is
        a prefix (left padding); None otherwise.
    The unpadding indices (`varlen`) are computed on first use and shared by the layers.
    """

    def __init__(self, mask: torch.Tensor):
        if mask.ndim != 2 or mask.dtype != torch.bool:
            raise InputError(f"Expected a (batch, seqlen) bool padding mask, got {tuple(mask.shape)} {mask.dtype}.")
        self.mask = mask
        length = mask.shape[1]
        pads = length - mask.sum(-1, dtype=torch.int32)
        prefix = torch.arange(length, device=mask.device)[None, :] >= pads[:, None]
        self.leftpad: Optional[torch.Tensor] = pads if torch.equal(prefix, mask) else None  # one sync
        self._varlen: Dict[int, tuple] = {}

    def varlen(self, seqlen_q: int):
        """((q_rows, k_rows), (cu_seqlens_q, cu_seqlens_k), (max_seqlen_q, max_seqlen_k)) for queries
        that are the last seqlen_q positions: *_rows (n, 2) (batch, position) of the real tokens,
        cu_seqlens int32 (batch + 1,)."""
        if seqlen_q not in self._varlen:
            self._varlen[seqlen_q] = tuple(zip(*(_ragged(m) for m in (self.mask[:, -seqlen_q:], self.mask))))
        return self._varlen[seqlen_q]


def _ragged(mask: torch.Tensor):
    counts = mask.sum(-1, dtype=torch.int32)
    cu = torch.nn.functional.pad(counts.cumsum(0, dtype=torch.int32), (1, 0))
    return mask.nonzero(), cu, int(counts.max())


def _probe(mask_function, batch_size: int, q_length: int, kv_length: int, q_offset, kv_offset, local_size,
           device) -> bool:
    """Whether transformers' mask_function, evaluated at this call's (absolute) query and key positions, is
    one of the patterns the kernels compute from the attention arguments: causal or bidirectional,
    with or without the sliding window `local_size`. Anything else (chunked attention, image-token
    overlays, block masks) would be dropped silently, so the caller refuses it. transformers' own plain
    causal and bidirectional functions are known without a look; a closure (a sliding window, an
    overlay) is evaluated, a block of query rows at a time to keep the probe small for long prompts,
    with one host sync per block."""
    if mask_function in (masking_utils.causal_mask_function, masking_utils.bidirectional_mask_function):
        return True
    kv = (torch.arange(kv_length, device=device) + kv_offset)[None, None, :]
    b = torch.arange(batch_size, device=device)[:, None, None]
    rows = max(1, (1 << 22) // max(1, batch_size * kv_length))
    for start in range(0, q_length, rows):
        q = (torch.arange(start, min(q_length, start + rows), device=device) + q_offset)[None, :, None]
        got = torch.as_tensor(mask_function(b, 0, q, kv), device=device).expand(batch_size, q.shape[1], kv_length)
        causal = kv <= q
        candidates = [causal, torch.ones_like(causal)]
        if local_size is not None:  # transformers' windows: causal keeps q - kv < W, bidirectional |q - kv| <= W
            candidates += [causal & (kv > q - local_size), (q - kv).abs() <= local_size]
        if not bool(torch.stack([(got == c).all() for c in candidates]).any()):
            return False
    return True


def padding_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset=0,
                 mask_function=masking_utils.causal_mask_function, attention_mask: Optional[torch.Tensor] = None,
                 local_size: Optional[int] = None, **kwargs) -> Optional[torch.Tensor]:
    """transformers' mask hook for our backend: None when no token is padding, else the 2-D
    attention_mask's last kv_length columns (a sliding-window cache keeps only the last keys) as a bool
    tensor carrying its `Padding`.
    Packed sequences pass through (the attention function reads their position ids); any other mask
    pattern is checked against what the kernels compute (`_probe`) and refused if it differs."""
    packed = getattr(mask_function, "__qualname__", "").startswith("packed_sequence_compatibility_function")
    device = attention_mask.device if attention_mask is not None else kwargs.get("device", "cpu")
    if not packed and not _probe(mask_function, batch_size, q_length, kv_length, q_offset, kv_offset, local_size,
                                 device):
        name = getattr(mask_function, "__qualname__", repr(mask_function))
        raise NotImplementedError(
            f"attn_implementation='{NAME}' computes causal, sliding-window, bidirectional and packed-sequence "
            f"masks; this model asks for another pattern ({name}). Use attn_implementation='sdpa' or 'eager' for it.")
    if attention_mask is None:
        return None
    mask = attention_mask[:, -kv_length:].bool()
    if mask.shape[1] == kv_length and bool(mask.all()):
        return None
    setattr(mask, PADDING_ATTR, Padding(mask))
    return mask


def _needs_grad(*tensors: Optional[torch.Tensor]) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _packed(position_ids: Optional[torch.Tensor], q: torch.Tensor, k: torch.Tensor):
    """cu_seqlens and max length of a padding-free batch of one (position ids restart at each
    sequence's start), or None. Reads position_ids (a sync) only for a batch of one without a cache."""
    if position_ids is None or q.shape[0] != 1 or q.shape[1] == 1 or q.shape[1] != k.shape[1]:
        return None
    pos = position_ids.reshape(-1)
    starts = (pos == pos.min()).nonzero().reshape(-1).to(torch.int32)
    if starts.numel() <= 1:
        return None
    cu = torch.cat([starts, starts.new_tensor([pos.numel()])])
    return cu, int(cu.diff().max())


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask, dropout: float = 0.0, scaling: Optional[float] = None,
                      sliding_window: Optional[int] = None, softcap: Optional[float] = None,
                      is_causal: Optional[bool] = None, s_aux: Optional[torch.Tensor] = None,
                      **kwargs) -> Tuple[torch.Tensor, None]:
    """transformers' attention hook: (batch, heads, seq, head_dim) query/key/value in, the
    (batch, seq_q, heads, head_dim) output and no weights out. See the module docstring."""
    if kwargs.get("output_attentions", False):
        raise NotImplementedError(f"attn_implementation='{NAME}' never forms attention weights; "
                                  "use attn_implementation='eager' for output_attentions=True.")
    if kwargs.get("cache") is not None:  # continuous batching's paged cache, which the attention updates
        raise NotImplementedError(f"attn_implementation='{NAME}' does not take transformers' continuous-batching "
                                  "(paged) cache yet; use a flash or 'sdpa' implementation for generate_batch.")
    if isinstance(attention_mask, torch.Tensor):
        if attention_mask.ndim != 2:
            raise InputError(
                f"attn_implementation='{NAME}' takes a 2-D padding mask (batch, seqlen), got a "
                f"{attention_mask.ndim}-D mask of shape {tuple(attention_mask.shape)}: dense masks never reach "
                "these kernels; use attn_implementation='sdpa' or 'eager' for custom masks.")
        attention_mask = getattr(attention_mask, PADDING_ATTR, None) or Padding(attention_mask.bool())
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # (batch, seq, heads, head_dim) views
    head_dim, v_head_dim = q.shape[-1], v.shape[-1]
    if v_head_dim != head_dim:  # e.g. MLA: pad V to the query's head dim, crop the output below
        v = torch.nn.functional.pad(v, (0, head_dim - v_head_dim))
    if sliding_window is None:
        window = (-1, -1)
    else:  # transformers' masks: causal keeps i - j < W, bidirectional |i - j| <= W
        window = (sliding_window - 1, 0) if is_causal else (sliding_window, sliding_window)
    variants = dict(softmax_scale=scaling, causal=bool(is_causal), window_size=window,
                    softcap=0.0 if softcap is None else float(softcap))
    out = _attend(q, k, v, attention_mask, float(dropout), variants, s_aux, kwargs)
    if v_head_dim != head_dim:
        out = out[..., :v_head_dim]
    return out, None


def _attend(q, k, v, padding: Optional[Padding], dropout_p: float, variants: dict, sinks, kwargs) -> torch.Tensor:
    batch, seqlen_q = q.shape[:2]
    inference = dropout_p == 0.0 and not _needs_grad(q, k, v, sinks)
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if padding is None and cu_q is not None and cu_k is not None:  # padding-free batch, lengths given
        out = flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu_q.int(), cu_k.int(),
                                     int(kwargs["max_length_q"]), int(kwargs["max_length_k"]), dropout_p,
                                     sinks=sinks, **variants)
        return out.view(batch, seqlen_q, *out.shape[1:])
    if padding is None:
        packed = _packed(kwargs.get("position_ids"), q, k)
        if packed is not None:  # padding-free batch, lengths from the position ids
            cu, longest = packed
            out = flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, longest, longest, dropout_p, sinks=sinks,
                                         **variants)
            return out[None]
        if inference and seqlen_q < k.shape[1]:  # decode, chunked prefill: split-KV over the keys
            return flash_attn_with_kvcache(q, k, v, sinks=sinks, **variants)
        return flash_attn_func(q, k, v, dropout_p, sinks=sinks, **variants)
    length = padding.mask.shape[1]
    if inference and padding.leftpad is not None:  # left padding: the keys in place, the padding skipped
        return flash_attn_with_kvcache(q, k, v, cache_seqlens=length, cache_leftpad=padding.leftpad, sinks=sinks,
                                       **variants)
    (rows_q, rows_k), (cu_q, cu_k), (max_q, max_k) = padding.varlen(seqlen_q)
    k, v = k[:, :length], v[:, :length]
    out = flash_attn_varlen_func(q[rows_q[:, 0], rows_q[:, 1]], k[rows_k[:, 0], rows_k[:, 1]],
                                 v[rows_k[:, 0], rows_k[:, 1]], cu_q, cu_k, max_q, max_k, dropout_p, sinks=sinks,
                                 **variants)
    return out.new_zeros(batch, seqlen_q, *out.shape[1:]).index_put((rows_q[:, 0], rows_q[:, 1]), out)


def register(name: str = NAME) -> str:
    """Register the attention and mask functions under `name` (a model then takes
    attn_implementation=name) and return it. The name must not contain "flash" (transformers routes
    those to its flash-attn loader) nor "/" (hub kernels)."""
    if "flash" in name or "/" in name:
        raise InputError(f"Expected a name without 'flash' or '/' (transformers routes those elsewhere), got {name!r}.")
    AttentionInterface.register(name, attention_forward)
    masking_utils.AttentionMaskInterface.register(name, padding_mask)
    return name


register()

__all__ = ["NAME", "PADDING_ATTR", "Padding", "attention_forward", "padding_mask", "register"]
