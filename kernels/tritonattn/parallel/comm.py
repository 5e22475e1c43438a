"""Passing tensors around a ring of ranks: each rank sends to the next and receives from the previous, posted
together so that the transfer runs while the caller computes (`Ring.shift`, then `Pending.wait`)."""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch
import torch.distributed as dist


class Pending:
    """Tensors being received; `wait` returns them once the transfers are done."""

    def __init__(self, requests: list, received: List[torch.Tensor]):
        self._requests, self._received = requests, received

    def wait(self) -> List[torch.Tensor]:
        for request in self._requests:
            request.wait()
        return self._received


class Ring:
    """The ranks of `group` (None: the default group) in order; rank r sends to r + 1 and receives from r - 1."""

    def __init__(self, group: Optional[dist.ProcessGroup] = None):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        to_global = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
        self.next = to_global((self.rank + 1) % self.world)
        self.prev = to_global((self.rank - 1) % self.world)

    def shift(self, tensors: Sequence[torch.Tensor]) -> Pending:
        """Post the send of `tensors` to the next rank and the receive of the previous rank's (same shapes)."""
        received = [torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t.contiguous(), self.next, self.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, r, self.prev, self.group) for r in received]
        return Pending(dist.batch_isend_irecv(ops), received)
