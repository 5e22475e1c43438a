"""Replays of repeated decode calls and the split scratch they share (see [Note] Host overhead in
launch/decode.py)."""

from __future__ import annotations

import contextlib
import threading
from typing import Dict, NamedTuple, Optional, Sequence, Tuple

import torch

from ..config.options import AttnOptions
from ..config.tables import SPLIT_SCRATCH_CACHE_BYTES
from .fast import DirectLaunch, LaunchCache, launch_hooks_active


def split_scratch(numel: int, device: torch.device, device_index: int) -> torch.Tensor:
    """fp32 scratch of at least `numel` elements for the split partials, reused by the calling
    thread's calls on the current stream of `device_index` (the current device).

    One thread's calls on one stream are issued one after the other and run in stream order, so a
    call's decode kernel writes the scratch only after the previous call's combine kernel has read
    it. Another thread may issue its launches between a call's two, so each thread keeps its own
    (thread-local: freed with the thread). Scratch above SPLIT_SCRATCH_CACHE_BYTES is allocated per
    call, not kept. While a CUDA graph is being captured a fresh allocation is made (from the graph's
    pool), so graph replays never share scratch with eager calls; the same inside `uncached_scratch`
    (the custom ops of kernels/tritonattn/compile/ops.py: a compiled graph's memory is torch.compile's, and a CUDA-graph
    tree refuses a tensor its warmup allocated that outlives the call).
    """
    if (device.type != "cuda" or numel * 4 > SPLIT_SCRATCH_CACHE_BYTES
            or torch.cuda.is_current_stream_capturing() or SCRATCH_LOCAL.uncached):
        return torch.empty(numel, dtype=torch.float32, device=device)
    buffers = SCRATCH_LOCAL.buffers
    if buffers is None:
        buffers = SCRATCH_LOCAL.buffers = {}
    slot = (device_index, torch._C._cuda_getCurrentRawStream(device_index))
    scratch = buffers.get(slot)
    if scratch is None or scratch.numel() < numel:
        scratch = buffers[slot] = torch.empty(numel, dtype=torch.float32, device=device)
    return scratch


class ScratchLocal(threading.local):
    """A thread's split scratch state; class defaults, so that reading an unset one costs no exception."""

    buffers: Optional[dict] = None  # (device index, raw stream) -> the largest scratch used there
    uncached: bool = False  # True inside `uncached_scratch`


SCRATCH_LOCAL = ScratchLocal()


@contextlib.contextmanager
def uncached_scratch():
    """Split scratch is allocated per call inside (see `split_scratch`)."""
    before = SCRATCH_LOCAL.uncached
    SCRATCH_LOCAL.uncached = True
    try:
        yield
    finally:
        SCRATCH_LOCAL.uncached = before


class Replay(NamedTuple):
    """A validated CUDA call's decode (+ combine) launches, replayed with the next call's pointers:
    what `flash_attn_with_kvcache` runs for a repeated call instead of validating, planning and
    building arguments again, see [Note] Host overhead. Each launch keeps its full argument list as a
    template, pointer slots (position, source): source indexes the call's pointers in the order q,
    k_cache, v_cache, k, v, cache_seqlens, block_table, out, lse, out_part, lse_part; and option slots
    (position, name): the call's `options.runtime[name]` goes there."""

    device_index: int
    device: torch.device
    lse_shape: Optional[Tuple[int, ...]]
    scratch_numel: int  # 0 without a split
    lse_part_offset: int  # bytes from the scratch's start to the partial LSEs
    launches: Tuple[Tuple[DirectLaunch, Tuple[int, int, int], list, Tuple[Tuple[int, int], ...],
                          Tuple[Tuple[int, str], ...]], ...]


class ReplayCache:
    """The `Replay`s of validated CUDA decode calls, by `replay_key_of`; cleared, not grown, past
    `max_entries` (shapes that churn start over)."""

    max_entries = 1024

    def __init__(self):
        self._replays: Dict[tuple, Replay] = {}
        self.get = self._replays.get  # the lookup of every decode call: the dict's own method

    def put(self, key: tuple, replay: Replay) -> None:
        if len(self._replays) >= self.max_entries:
            self._replays.clear()
        self._replays[key] = replay

    def clear(self) -> None:
        self._replays.clear()

    def values(self):
        return self._replays.values()

    def __len__(self) -> int:
        return len(self._replays)


REPLAYS = ReplayCache()


# the current CUDA device's index: torch.cuda.current_device() without its Python wrapper (about half the cost)
_current_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device


# Where a replayed launch's pointer arguments come from: kernel parameter -> index into the call's
# pointers (q, k_cache, v_cache, k, v, cache_seqlens, block_table, out, lse, out_part, lse_part; the
# full path's stand-ins for unused ones: k_cache for k/v without an append, out for lse without
# return_softmax_lse and for the partials without a split).
DECODE_SOURCES = {"Q": 0, "K_cache": 1, "V_cache": 2, "K_new": 3, "V_new": 4, "Cache_seqlens": 5,
                   "Block_table": 6, "Out": 7, "Lse": 8, "Out_part": 9, "Lse_part": 10}


COMBINE_SOURCES = {"Out_part": 9, "Lse_part": 10, "Out": 7, "Lse": 8}


def replay_template(launch: LaunchCache, key, grid, args: Sequence, kwargs: dict, sources: dict,
                     options: AttnOptions):
    """(direct launch, grid, argument template, pointer slots, option slots) for the launch of `launch`
    stored under `key`, made with `args` and `kwargs`: each tensor argument's position gets the call
    pointer that `sources` names for its parameter, whatever tensor the recorded call passed there
    (so tensors aliased in that call, e.g. k is v, are not frozen into the replay), and each runtime
    option's position gets the replayed call's value. The template holds no tensor (its slots are 0
    until a call fills them), so a recording keeps no tensor alive. None when the kernel has no
    direct launch or a tensor parameter has no source."""
    direct = launch.direct(key)
    if direct is None:
        return None
    names = launch.names
    template, slots = launch.positional(args, kwargs), []
    for i in direct.pointers:
        j = sources.get(names[i])
        if j is None:
            return None
        template[i] = 0
        slots.append((i, j))
    option_slots = tuple((i, name) for i, name in enumerate(names) if name in options.runtime)
    return direct, grid, template, tuple(slots), option_slots


def run_replay(r: Replay, q, k_cache, v_cache, k, v, cache_seqlens, block_table, options: AttnOptions):
    """Run a repeated call through its `Replay`: (out, lse), or None when this call's pointers are
    not all 16-byte aligned (the kernels were compiled for aligned ones), the current device is not
    the call's, the fast launch is off (TRITONATTN_FAST_LAUNCH=0, LaunchCache.enabled) or launch hooks
    are installed; the caller then takes the full path."""
    q_ptr, kc_ptr, vc_ptr, lens_ptr = q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), cache_seqlens.data_ptr()
    k_ptr, v_ptr = (k.data_ptr(), v.data_ptr()) if k is not None else (kc_ptr, kc_ptr)
    bt_ptr = block_table.data_ptr() if block_table is not None else 0
    if ((q_ptr | kc_ptr | vc_ptr | lens_ptr | k_ptr | v_ptr | bt_ptr) & 15
            or _current_device() != r.device_index or not LaunchCache.enabled or launch_hooks_active()):
        return None
    out = torch.empty_like(q, memory_format=torch.contiguous_format)  # (B, M, H, D): q's shape (cheaper than empty)
    out_ptr = out.data_ptr()
    lse = None
    lse_ptr = out_ptr
    if r.lse_shape is not None:
        lse = torch.empty(r.lse_shape, dtype=torch.float32, device=r.device)
        lse_ptr = lse.data_ptr()
    part_ptr = lse_part_ptr = out_ptr
    if r.scratch_numel:  # held in a local until both launches are issued
        scratch = split_scratch(r.scratch_numel, r.device, r.device_index)
        part_ptr = scratch.data_ptr()
        lse_part_ptr = part_ptr + r.lse_part_offset
    ptrs = (q_ptr, kc_ptr, vc_ptr, k_ptr, v_ptr, lens_ptr, bt_ptr, out_ptr, lse_ptr, part_ptr, lse_part_ptr)
    runtime = options.runtime
    stream = torch._C._cuda_getCurrentRawStream(r.device_index)
    for direct, grid, template, slots, option_slots in r.launches:
        args = template.copy()
        for i, j in slots:
            args[i] = ptrs[j]
        for i, name in option_slots:
            args[i] = runtime[name]
        direct.launch(grid, stream, args)
    return out, lse


def replay_key_of(sig: tuple, cache_seqlens, options: AttnOptions, num_splits, return_softmax_lse) -> Optional[tuple]:
    """What a call must share with an earlier one to replay it: the tensors' signature, a device
    cache_seqlens' layout, the options' compiled part (their runtime part is filled into the replay)
    and the other arguments (and a window's left side, which the split plan follows); None when the call
    cannot be replayed: lengths given as an int or on the
    CPU (checked on the host every call), and arguments other than plain Python values (the full path
    converts and checks them)."""
    if type(cache_seqlens) is not torch.Tensor or type(num_splits) is not int or type(return_softmax_lse) is not bool:
        return None
    return (sig, cache_seqlens.shape, cache_seqlens.stride(), cache_seqlens.dtype, cache_seqlens.device,
            options.compiled, options.window_left, num_splits, return_softmax_lse)
