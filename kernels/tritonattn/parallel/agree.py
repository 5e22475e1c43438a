"""Checks every rank of a context-parallel call runs before any transfer, so that bad input fails on every rank
with one message instead of leaving the others waiting in a transfer.

`checked_call` runs the local checks (the same as single-GPU calls, plus the layout's) and, on the first call of
a signature (shapes, dtypes, the layout and the flags that change the transfers), one small all-gather of every
rank's signature and verdict: a rank whose inputs were refused makes every rank raise, naming it, and ranks
whose signatures differ are named likewise. Later calls of a checked signature skip the gather (a rank that then
brings other shapes gathers alone, and its group's timeout ends the wait).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence, Set, Tuple

import torch
import torch.distributed as dist

from ..errors import InputError

_CHECKED: Set[Tuple] = set()  # (group, signature) pairs every rank agreed on
_WIDTH = 24  # int64 slots per rank: verdict, signature length, signature
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def backend_device(group: Optional[dist.ProcessGroup]) -> str:
    """The device type whose tensors `group`'s backend moves: "cuda" for NCCL, "cpu" for gloo (a backend string
    such as "cpu:gloo,cuda:nccl" serves both: the first one is taken for the gather)."""
    backend = str(dist.get_backend(group)).lower()
    if ":" in backend:
        return backend.split(",")[0].split(":")[0]
    return "cuda" if backend == "nccl" else "cpu"


def _served(group, device: torch.device) -> Optional[str]:
    backend = str(dist.get_backend(group)).lower()
    served = {part.split(":")[0] for part in backend.split(",")} if ":" in backend else {backend_device(group)}
    if device.type not in served:
        return (f"the process group's backend {backend!r} does not move {device.type} tensors (NCCL: CUDA tensors; "
                f"gloo: CPU tensors); create the group with a backend for {device.type}")
    return None


def _signature(tensors: Sequence[torch.Tensor], extra: Sequence[int]) -> Tuple[int, ...]:
    sig = []
    for t in tensors:
        if not isinstance(t, torch.Tensor):  # refused by the local checks; still one entry
            sig.append(-1)
            continue
        sig += [t.dim(), *t.shape, _DTYPES.index(t.dtype) if t.dtype in _DTYPES else 99]
    return tuple(sig + list(extra))


def checked_call(group: Optional[dist.ProcessGroup], tensors: Sequence[torch.Tensor], extra: Sequence[int],
                 local_checks: Callable[[], None]) -> None:
    """Run `local_checks` (raises InputError / TypeError / NotImplementedError for bad local input) and, on a new
    signature, agree with every rank of `group`: raises on every rank if any rank's checks failed or the ranks'
    signatures differ. tensors: the inputs whose shapes and dtypes must match across ranks; extra: integers
    that must too (the layout, causal, the window)."""
    if not dist.is_available() or not dist.is_initialized():
        raise InputError("Context-parallel attention needs torch.distributed initialised (init_process_group).")
    rank = dist.get_rank(group)
    error: Optional[BaseException] = None
    try:
        local_checks()
        problem = _served(group, tensors[0].device) if isinstance(tensors[0], torch.Tensor) else None
        if problem is not None:
            raise InputError(f"Rank {rank}: {problem}.")
    except (InputError, TypeError, NotImplementedError, ValueError) as exc:
        error = exc
    sig = _signature(tensors, extra)
    key = (id(group), sig)
    if error is None and key in _CHECKED:
        return
    if len(sig) + 2 > _WIDTH:
        sig = sig[: _WIDTH - 2]
    world = dist.get_world_size(group)
    mine = torch.zeros(_WIDTH, dtype=torch.int64)
    mine[0], mine[1] = int(error is not None), len(sig)
    mine[2: 2 + len(sig)] = torch.tensor(sig, dtype=torch.int64)
    device = backend_device(group)
    if device == "cuda":
        mine = mine.to(torch.device("cuda", torch.cuda.current_device()))
    everyone = torch.empty(world * _WIDTH, dtype=torch.int64, device=mine.device)
    dist.all_gather_into_tensor(everyone, mine, group=group)
    rows = everyone.view(world, _WIDTH).cpu()
    refused = [r for r in range(world) if rows[r, 0]]
    if refused:
        if error is not None:
            raise type(error)(f"Rank {rank} refused its inputs: {error}") from error
        raise InputError(f"Rank(s) {refused} refused their inputs (their error says why); every rank stops before "
                         f"any transfer.")
    differ = [r for r in range(world) if not torch.equal(rows[r], rows[rank])]
    if differ:
        raise InputError(f"Ranks disagree on the call: rank {rank} has shapes / dtypes / options {list(sig)}, ranks "
                         f"{differ} others; every rank must pass its shard of the same call (same shapes, dtypes, "
                         f"causal, window and layout).")
    _CHECKED.add(key)


def refuse_dropout(dropout_p) -> None:
    """Every context-parallel form refuses dropout: each rank would draw its blocks' bits in its own local
    coordinates, so the mask would differ from the single-GPU one."""
    if dropout_p:
        raise NotImplementedError("Dropout in context-parallel attention is not supported: its mask would differ "
                                  "from the single-GPU one (pass dropout_p=0).")
