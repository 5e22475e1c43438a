"""Launching compiled Triton kernels without Triton's per-call dispatch.

A decode step or a small prefill chunk runs for a few microseconds on the GPU, less than Triton's
Python dispatch takes to launch it: `JITFunction.run` binds every argument, computes each one's
specialisation, builds a string key, then `CompiledKernel`'s runner asks for the current device and
stream, builds launch metadata for the (empty) launch hooks, and the C launcher calls `data_ptr()`
and `cuPointerGetAttribute` for every tensor. `LaunchCache` keeps the compiled kernel per caller key
after the first launch and then calls its C launcher directly, with raw pointers and the current
stream (see [Note] Host overhead in launch/decode.py). `LaunchCache.direct` hands that C launch,
bound to its compiled kernel (`DirectLaunch`), to a caller that keeps its own argument templates:
launch/replay.py's replays of repeated decode calls.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import operator
from typing import Any, Dict, Hashable, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import torch
import triton
import triton.language as tl

from ..config.hardware import FAST_LAUNCH, Target, is_interpreter, planning_for


def _hook_active(hook) -> bool:
    """A Triton launch hook that would run: a non-empty HookChain (Triton >= 3.5) or a callable (older)."""
    if hook is None:
        return False
    calls = getattr(hook, "calls", None)
    return calls is None or len(calls) > 0


def _hook_owner():
    """Where Triton keeps its launch hooks: knobs.runtime (Triton >= 3.4) or CompiledKernel (older)."""
    knobs = getattr(triton, "knobs", None)
    if knobs is None:
        from triton.compiler import CompiledKernel

        return CompiledKernel
    return knobs.runtime


_HOOK_OWNER = _hook_owner()  # one object for the process's life; its hook attributes are read per call


def launch_hooks_active() -> bool:
    """True when a profiler or a user installed Triton launch hooks; the fast path then steps aside."""
    return _hook_active(getattr(_HOOK_OWNER, "launch_enter_hook", None)) or _hook_active(
        getattr(_HOOK_OWNER, "launch_exit_hook", None))


class LaunchCache:
    """Launch a `@triton.jit` kernel straight through its compiled handle after the first launch.

    A compiled kernel is stored under `key_of`: the caller's key, plus what the arguments themselves
    show, as Triton's dispatcher specialises on it -- every constexpr's value (the options' compiled
    part, tiles, flags), which other arguments are None (compiled out), each integer's class (1, a
    multiple of 16, past 32 bits) -- and the launch options. So no constexpr and no integer argument
    can be left out of a key by hand. The caller's key must hold what the values do not show: each
    tensor's dtype and 16-byte alignment, and the device (the callers pass their tensors' shapes,
    strides and dtypes too). A hit is then the very kernel Triton's dispatcher would pick,
    launched with the same arguments; a miss (or key None) goes through the dispatcher, which compiles
    if needed, and stores the compiled kernel. Off under the interpreter, with TRITONATTN_FAST_LAUNCH=0,
    and while Triton launch hooks are installed (profilers see every launch).
    """

    enabled = FAST_LAUNCH and not is_interpreter()
    max_entries = 1024

    def __init__(self, fn):
        self.fn = fn
        # key -> (kernel, tensor slots, its DirectLaunch or None when it needs Triton's runner)
        self.kernels: Dict[Hashable, Tuple[Any, Tuple[int, ...], Optional[DirectLaunch]]] = {}
        params = list(inspect.signature(getattr(fn, "fn", fn)).parameters.values())
        self.names = [p.name for p in params]
        self.defaults = {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}
        self.constexprs = tuple(i for i, p in enumerate(params) if is_constexpr(p.annotation))
        self.values = tuple(i for i, p in enumerate(params) if i not in self.constexprs)
        self._get_constexprs, self._get_values = _getter(self.constexprs), _getter(self.values)

    def positional(self, args: Sequence[Any], kwargs: Optional[Dict[str, Any]]) -> list:
        """The kernel's full argument list, in parameter order, of a launch with `args` and `kwargs`."""
        full = list(args)
        kwargs = kwargs or {}
        full.extend(kwargs[name] if name in kwargs else self.defaults[name] for name in self.names[len(args):])
        return full

    def key_of(self, key: Hashable, full: Sequence[Any], num_warps: int, num_stages: int, launch_pdl: bool,
               maxnreg: Optional[int]) -> Hashable:
        """The cache key of a launch with the positional arguments `full` (see the class docstring)."""
        classes = tuple([None if v is None else 0 if type(v) is not int else
                         (v == 1) + 2 * (v % 16 == 0) + 4 * (not -2**31 <= v < 2**31) for v in self._get_values(full)])
        return key, self._get_constexprs(full), classes, num_warps, num_stages, launch_pdl, maxnreg

    def __call__(self, key: Optional[Hashable], grid: Tuple[int, int, int], args: Sequence[Any], num_warps: int,
                 num_stages: int = 1, kwargs: Optional[Dict[str, Any]] = None, device_index: int = 0,
                 launch_pdl: bool = False, maxnreg: Optional[int] = None) -> Optional[Hashable]:
        """Launch; returns the cache key the kernel is stored under (None when the fast path is off).
        Inside `recording`, the launch is recorded instead and nothing runs."""
        if _RECORDS is not None:
            _RECORDS.append(LaunchRecord(self.fn, tuple(grid), self.positional(args, kwargs), num_warps, num_stages,
                                         launch_pdl, maxnreg))
            return None
        if key is None or not self.enabled:
            self._dispatch(grid, args, kwargs, num_warps, num_stages, launch_pdl, maxnreg)
            return None
        full = self.positional(args, kwargs)
        key = self.key_of(key, full, num_warps, num_stages, launch_pdl, maxnreg)
        entry = self.kernels.get(key)
        if entry is not None and not launch_hooks_active():
            kernel, pointers, direct = entry
            for i in pointers:  # raw pointers: no data_ptr() / cuPointerGetAttribute in the C launcher
                full[i] = full[i].data_ptr()
            stream = torch._C._cuda_getCurrentRawStream(device_index)
            if direct is not None:  # the C launcher itself: no scratch to allocate, no hooks
                direct.launch(grid, stream, full)
            else:
                kernel.run(grid[0], grid[1], grid[2], stream, kernel.function, kernel.packed_metadata, None, None,
                           None, *full)
            return key
        kernel = self._dispatch(grid, args, kwargs, num_warps, num_stages, launch_pdl, maxnreg)
        if hasattr(kernel, "run") and hasattr(kernel, "function") and hasattr(kernel, "packed_metadata"):
            if len(self.kernels) >= self.max_entries:  # shapes churn: start over rather than grow without bound
                self.kernels.clear()
            pointers = tuple(i for i, arg in enumerate(full) if isinstance(arg, torch.Tensor))
            launch = _direct_launch(kernel.run)
            direct = None
            if launch is not None:
                run = kernel.run
                direct = DirectLaunch(launch, (kernel.function, run.launch_cooperative_grid, run.launch_pdl, None,
                                               None, kernel.packed_metadata, None, None, None), pointers)
            self.kernels[key] = (kernel, pointers, direct)
        return key

    def _dispatch(self, grid, args, kwargs, num_warps, num_stages, launch_pdl, maxnreg):
        """A launch through Triton's dispatcher (compiling if needed); returns its compiled kernel."""
        options = {"launch_pdl": True} if launch_pdl else {}  # programmatic dependent launch (sm_90+)
        if maxnreg is not None:  # a register cap (ptx .maxnreg)
            options["maxnreg"] = maxnreg
        return self.fn[grid](*args, **(kwargs or {}), num_warps=num_warps, num_stages=num_stages, **options)

    def direct(self, key: Optional[Hashable]) -> Optional["DirectLaunch"]:
        """The cached kernel stored under `key` (what `__call__` returned) as a `DirectLaunch`, if it has
        one that needs no scratch; None when nothing is stored there, the fast path is off, or launch
        hooks are installed."""
        if key is None:
            return None
        entry = self.kernels.get(key)
        if entry is None or not self.enabled or launch_hooks_active():
            return None
        return entry[2]


class LaunchRecord(NamedTuple):
    """One launch that `recording` kept from running: the kernel, its grid, its full argument list in
    parameter order (constexprs included) and its launch options."""

    fn: Any
    grid: Tuple[int, ...]
    args: List[Any]
    num_warps: int
    num_stages: int
    launch_pdl: bool
    maxnreg: Optional[int]


_RECORDS: Optional[List[LaunchRecord]] = None  # set inside `recording`


@contextlib.contextmanager
def recording(target: Target) -> Iterator[List[LaunchRecord]]:
    """Plan every call in this block for `target` (`config.hardware.planning_for`) and record each kernel launch
    instead of running it: yields the list the `LaunchRecord`s are appended to. Calls still validate,
    allocate and return their outputs, unwritten. What the config-fitness test compiles for each card."""
    global _RECORDS
    previous, _RECORDS = _RECORDS, []
    try:
        with planning_for(target):
            yield _RECORDS
    finally:
        _RECORDS = previous


def recording_active() -> bool:
    """True inside `recording`: launches are recorded, nothing runs (callers skip their replays)."""
    return _RECORDS is not None


class DirectLaunch:
    """A compiled kernel's C launch with everything but the grid, stream and arguments bound:
    `launch(grid, stream, args)` is how `LaunchCache` launches on a hit.
    `pointers` are the positions of the tensor arguments (pass raw data_ptr ints there)."""

    __slots__ = ("_launch", "_head", "pointers")

    def __init__(self, launch, head: tuple, pointers: Tuple[int, ...]):
        self._launch, self._head, self.pointers = launch, head, pointers

    def launch(self, grid: Tuple[int, int, int], stream: int, args: Sequence[Any]) -> None:
        self._launch(grid[0], grid[1], grid[2], stream, *self._head, *args)


def _getter(indices: Tuple[int, ...]):
    """A function returning the tuple of a list's items at `indices` (operator.itemgetter, always a tuple)."""
    if len(indices) > 1:
        return operator.itemgetter(*indices)
    return lambda full: tuple(full[i] for i in indices)


def is_constexpr(annotation) -> bool:
    """Whether a kernel parameter is annotated `tl.constexpr` (as Triton itself decides)."""
    return annotation is tl.constexpr or (isinstance(annotation, str) and annotation.split(".")[-1] == "constexpr")


@functools.lru_cache(maxsize=None)
def flat_launch_abi(launcher_cls: type) -> bool:
    """Whether `launcher_cls` calls its C launch with the kernel's arguments flattened after the scratch
    buffers, as Triton 3.5 and 3.6's CudaLauncher does: its `__call__(self, gridX, gridY, gridZ, stream,
    function, *args)` passes `launch(grid..., stream, function, cooperative, pdl, global_scratch,
    profile_scratch, *args)`. Triton 3.7 and newer name the metadata and hooks in `__call__` and pass the
    arguments to the C launch as one tuple with annotations: there the runner (`kernel.run`) is called."""
    try:
        params = list(inspect.signature(launcher_cls.__call__).parameters.values())
    except (TypeError, ValueError):
        return False
    names = [p.name for p in params]
    return (names[:6] == ["self", "gridX", "gridY", "gridZ", "stream", "function"] and len(params) == 7
            and params[6].kind is inspect.Parameter.VAR_POSITIONAL)


def _direct_launch(run):
    """The C launch function behind a CudaLauncher whose launch ABI is the flat one (`flat_launch_abi`)
    when calling it directly is what CudaLauncher.__call__ would do: no global or profile scratch to
    allocate. Else None."""
    launch = getattr(run, "launch", None)
    needed = ("launch_cooperative_grid", "launch_pdl", "global_scratch_size", "profile_scratch_size")
    if launch is None or not all(hasattr(run, name) for name in needed) or not flat_launch_abi(type(run)):
        return None
    if run.global_scratch_size or run.profile_scratch_size:
        return None
    return launch
