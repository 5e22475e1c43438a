"""`flash_attn.layers.rotary.apply_rotary_emb`: a pure-torch rotary embedding reference.

The upstream kvcache test builds its expected cache and queries with this function and compares
them with what `flash_attn_with_kvcache(..., rotary_cos=, rotary_sin=)` wrote and computed, so it
must have flash-attn's semantics exactly:

- Only the first rotary_dim = 2 * cos.shape[-1] features of each head rotate; the rest pass through.
- Token i of sequence b sits at position i + seqlen_offsets[b] (an int offset applies to all).
- Non-interleaved (GPT-NeoX): feature j pairs with j + rotary_dim / 2. Interleaved (GPT-J): 2j
  pairs with 2j + 1. A pair (x1, x2) at position p with angle index j becomes
      (x1 * cos[p, j] - x2 * sin[p, j],  x1 * sin[p, j] + x2 * cos[p, j]).
- The arithmetic is float32 with a single rounding to x's dtype at the end, as flash-attn's kernel
  does it, so fp16/bf16 results match a fused kernel to about one unit in the last place.
- Positions at or past cos.shape[0] are left unrotated (cos 1, sin 0), as in flash-attn's kernel.
"""

from typing import Optional, Union

import torch

__all__ = ["apply_rotary_emb"]


def _positions(x: torch.Tensor, seqlen_offsets: Union[int, torch.Tensor], cu_seqlens: Optional[torch.Tensor]):
    """Position of every token: (batch, seqlen) for a padded x, (total,) for a packed one."""
    device = x.device
    if cu_seqlens is None:
        batch, seqlen = x.shape[:2]
        pos = torch.arange(seqlen, device=device).expand(batch, seqlen)
        if isinstance(seqlen_offsets, torch.Tensor):
            return pos + seqlen_offsets.to(device=device, dtype=torch.long).reshape(-1, 1)
        return pos + int(seqlen_offsets)
    cu = cu_seqlens.to(device=device, dtype=torch.long)
    total = x.shape[0]
    lengths = cu[1:] - cu[:-1]
    seq_of_token = torch.repeat_interleave(torch.arange(lengths.numel(), device=device), lengths, output_size=total)
    pos = torch.arange(total, device=device) - cu[seq_of_token]
    if isinstance(seqlen_offsets, torch.Tensor):
        return pos + seqlen_offsets.to(device=device, dtype=torch.long)[seq_of_token]
    return pos + int(seqlen_offsets)


def apply_rotary_emb(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleaved: bool = False,
    inplace: bool = False,
    seqlen_offsets: Union[int, torch.Tensor] = 0,
    cu_seqlens: Optional[torch.Tensor] = None,
    max_seqlen: Optional[int] = None,
) -> torch.Tensor:
    """Rotate the first 2 * cos.shape[-1] features of every head of x by its token's position.

    Args:
        x: (batch, seqlen, nheads, headdim), or (total, nheads, headdim) with cu_seqlens.
        cos, sin: (seqlen_rotary, rotary_dim / 2), the cos and sin of each position's angles;
            rotary_dim <= headdim.
        interleaved: rotate (2j, 2j + 1) pairs (GPT-J) instead of (j, j + rotary_dim / 2) (GPT-NeoX).
        inplace: write the result into x and return x.
        seqlen_offsets: int, or (batch,) integer tensor: position of each sequence's first token
            (the cache length in decoding).
        cu_seqlens: (batch + 1,) int32 prefix sums of the sequence lengths of a packed x.
        max_seqlen: flash-attn's launch-size hint for packed x; not needed here.

    Returns:
        x rotated, same shape, dtype and device (x itself when inplace).
    """
    del max_seqlen  # only sizes flash-attn's grid
    half = cos.shape[-1]
    rotary_dim = 2 * half
    if cos.shape != sin.shape or cos.dim() != 2:
        raise ValueError(
            f"Expected cos and sin of one shape (seqlen_rotary, rotary_dim / 2), got {tuple(cos.shape)} "
            f"and {tuple(sin.shape)}."
        )
    if rotary_dim > x.shape[-1]:
        raise ValueError(f"Expected rotary_dim = 2 * cos.shape[-1] = {rotary_dim} <= headdim = {x.shape[-1]}.")
    pos = _positions(x, seqlen_offsets, cu_seqlens)
    in_table = pos < cos.shape[0]
    idx = torch.where(in_table, pos, 0)
    c = torch.where(in_table[..., None], cos.float()[idx], 1.0).unsqueeze(-2)  # [..., 1 (heads), half]
    s = torch.where(in_table[..., None], sin.float()[idx], 0.0).unsqueeze(-2)

    rot = x[..., :rotary_dim].float()
    if interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        rotated = torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)
    else:
        x1, x2 = rot[..., :half], rot[..., half:]
        rotated = torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1)
    rotated = rotated.to(x.dtype)
    if inplace:
        x[..., :rotary_dim] = rotated
        return x
    return torch.cat((rotated, x[..., rotary_dim:]), dim=-1)
