"""Which part of one (query chunk, key chunk) pair attends, in the kernels' own terms.

Context parallelism splits one sequence into shards spread over ranks; a rank's queries meet every other
rank's keys one chunk pair at a time (a chunk: contiguous tokens, or a stripe of every world-th token).
Causal masks and sliding windows are defined in global positions: query at global position gi sees key gj
iff gi - left <= gj <= gi + right (a side of -1 unbounded; causal is right = 0). For queries at gi = q_start +
i * step and keys at gj = k_start + j * step, local query i sees local key j iff  c_lo <= j - i <= c_hi,
c_lo = ceil((q_start - k_start - left) / step), c_hi = floor((q_start - k_start + right) / step).

The kernels align their masks to the bottom-right corner (query i of M sees key j of N at j - i around
N - M) and a negative window side means unbounded, so a band that starts to the right of the diagonal is
not expressible on the whole pair. It is on a corner of it: keep query rows [0, rows) and keys [0, keys),
with rows = min(chunk, chunk - c_lo) (later rows see no key of the chunk) and keys = min(chunk, chunk + c_hi)
(later keys are seen by no row). Then keys - rows lies in [c_lo, c_hi], and the window
(keys - rows - c_lo, c_hi - (keys - rows)) relative to that corner's diagonal is exactly the band, both
sides >= 0 (or -1 where the global side is unbounded). A pair that no query sees is None.

ALiBi distances are global positions' too: |gi - gj| = step * |i - j + (q_start - k_start) / step|, which the
kernels compute from the corner's call given the slopes times step and an ALiBi origin shift (`alibi_block`).
"""

from __future__ import annotations

from typing import Any, Dict, NamedTuple, Optional, Tuple, Union

import torch


class BlockCall(NamedTuple):
    """Query rows [0, rows) against keys [0, keys) of a chunk pair, with this window (flash-attn's
    window_size, relative to the corner's bottom-right diagonal; -1 unbounded); causal is folded in."""

    rows: int
    keys: int
    window: Tuple[int, int]


def block_call(q_start: int, k_start: int, step: int, chunk: int, window: Tuple[int, int],
               causal: bool) -> Optional[BlockCall]:
    """The call for `chunk` queries at global positions q_start + i * step against `chunk` keys at k_start + j *
    step (a contiguous chunk: step 1; a stripe of every world-th token: step world) under the global `window`
    (left, right; -1 unbounded) and `causal`; None when no query sees a key."""
    left, right = window
    if causal:
        right = 0 if right < 0 else min(right, 0)
    gap = q_start - k_start  # gj - gi = (j - i) * step - gap
    c_lo = None if left < 0 else -((left - gap) // step)  # ceil((gap - left) / step)
    c_hi = None if right < 0 else (gap + right) // step  # floor((gap + right) / step)
    if (c_lo is not None and c_lo > chunk - 1) or (c_hi is not None and c_hi < -(chunk - 1)):
        return None
    if c_lo is not None and c_hi is not None and c_lo > c_hi:  # a stripe pair whose band holds no key
        return None
    rows = chunk if c_lo is None else min(chunk, chunk - c_lo)
    keys = chunk if c_hi is None else min(chunk, chunk + c_hi)
    diag = keys - rows
    return BlockCall(rows, keys, (-1 if c_lo is None else diag - c_lo, -1 if c_hi is None else c_hi - diag))


def alibi_block(tensors: Dict[str, Any], shift: Union[float, torch.Tensor], step: int, batch: int) -> Dict[str, Any]:
    """The per-call tensors of one block of a longer sequence: the call's `tensors` (`AttnCall.tensors`), and with
    ALiBi its slopes times `step` and Alibi_shift, float32 (batch,), from `shift` (one number for every batch entry,
    or a tensor per packed sequence) = (q0 - k0) / step - (seqlen_k - seqlen_q) of the block's call, so that the
    kernels measure ALiBi distances between global positions ([Note] ALiBi origin in jit/common.py)."""
    if "Alibi" not in tensors:
        return tensors
    slopes = tensors["Alibi"]
    if not isinstance(shift, torch.Tensor):
        shift = torch.full((batch,), float(shift), dtype=torch.float32, device=slopes.device)
    return {**tensors, "Alibi": slopes * step if step != 1 else slopes, "Alibi_shift": shift.to(torch.float32)}
