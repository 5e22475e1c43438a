"""`flash_attn.bert_padding`: convert between padded (batch, seqlen, ...) tensors and the packed
(total, ...) layout of the varlen functions, as the upstream test uses them.

Our own pure-torch implementation of flash-attn's call signatures and return tuples. Both directions
are plain indexing, so autograd flows through them (the test differentiates through `pad_input`).

Example: a batch of 2 with seqlen 3 and lengths [2, 3]
    attention_mask = [[1, 1, 0],
                      [1, 1, 1]]
    unpad_input(x, attention_mask) -> x.reshape(6, ...)[[0, 1, 3, 4, 5]],
        indices = [0, 1, 3, 4, 5], cu_seqlens = [0, 2, 5] (int32), max_seqlen = 3, seqused = [2, 3]
    pad_input(x_unpad, indices, 2, 3) puts the rows back and zeros the padding.
"""

from typing import Optional, Tuple

import torch

__all__ = ["pad_input", "unpad_input"]


def unpad_input(
    hidden_states: torch.Tensor,
    attention_mask: torch.Tensor,
    unused_mask: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, torch.Tensor]:
    """Pack the valid tokens of a padded batch.

    Args:
        hidden_states: (batch, seqlen, ...).
        attention_mask: (batch, seqlen) bool or int, nonzero where a token is valid (attended to).
        unused_mask: optional (batch, seqlen), nonzero where a slot is allocated but not used yet
            (packed along with the valid tokens, e.g. room for tokens to come); must not overlap
            attention_mask.

    Returns:
        hidden_states_unpad: (total, ...) the packed tokens in batch-major order, total = number of
            positions selected by attention_mask | unused_mask.
        indices: (total,) int64 positions of those tokens in the flattened (batch * seqlen) input.
        cu_seqlens: (batch + 1,) int32 prefix sums of the packed tokens per sequence, cu_seqlens[0]
            == 0: sequence b owns rows [cu_seqlens[b], cu_seqlens[b + 1]) of hidden_states_unpad.
        max_seqlen_in_batch: Python int, the most packed tokens of any sequence.
        seqused: (batch,) int32, the valid tokens per sequence (attention_mask only); equal to the
            packed lengths when unused_mask is None.
    """
    if attention_mask.shape != hidden_states.shape[:2]:
        raise ValueError(
            f"Expected attention_mask of shape (batch, seqlen) = {tuple(hidden_states.shape[:2])}, "
            f"got {tuple(attention_mask.shape)}."
        )
    valid = attention_mask.bool()
    packed = valid if unused_mask is None else valid | unused_mask.bool()
    seqlens = packed.sum(dim=-1, dtype=torch.int32)
    seqused = valid.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(packed.flatten(), as_tuple=False).flatten()
    cu_seqlens = torch.zeros(seqlens.numel() + 1, dtype=torch.int32, device=seqlens.device)
    cu_seqlens[1:] = torch.cumsum(seqlens, dim=0, dtype=torch.int32)
    max_seqlen = int(seqlens.max().item()) if seqlens.numel() else 0
    flat = hidden_states.reshape(-1, *hidden_states.shape[2:])
    return flat[indices], indices, cu_seqlens, max_seqlen, seqused


def pad_input(hidden_states: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """Scatter packed tokens back into a zero-padded batch: the inverse of `unpad_input`.

    Args:
        hidden_states: (total, ...) packed tokens, as `unpad_input` returned them (or a result or
            gradient computed in that layout).
        indices: (total,) positions in the flattened (batch * seqlen) batch, from `unpad_input`.
        batch, seqlen: the padded shape to produce.

    Returns:
        (batch, seqlen, ...) with the tokens at their positions and zeros elsewhere; dtype and
        device of hidden_states.
    """
    if hidden_states.shape[0] != indices.numel():
        raise ValueError(
            f"Expected one index per packed token ({hidden_states.shape[0]}), got {indices.numel()} indices."
        )
    rest = hidden_states.shape[1:]
    out = hidden_states.new_zeros(batch * seqlen, *rest)
    out = out.index_put((indices.long(),), hidden_states)  # out-of-place, so autograd reaches hidden_states
    return out.reshape(batch, seqlen, *rest)
