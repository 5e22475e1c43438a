"""Validation of the prefill paths' inputs, and the checks every entry point shares: each raises
InputError / InputTypeError (or NotImplementedError for what the hardware cannot run) before anything
is allocated or launched."""

from __future__ import annotations

import math
import numbers
from typing import Optional, Tuple

import torch

from ..config.hardware import bf16_unsupported, device_target, fp8_unsupported, is_interpreter
from ..config.options import KV_FP8_DTYPES
from ..errors import InputError, InputTypeError

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FP8_QUERY_DTYPES = (torch.float16, torch.bfloat16)  # q (and new k/v, the output) over an FP8 KV cache
MIN_HEAD_DIM, MAX_HEAD_DIM = 1, 256  # any head dim: the tile is padded to a power of two and masked


# --------------------------------------------------------------------------------------------
# Validation: every public function calls these before allocating or launching anything.
# --------------------------------------------------------------------------------------------
def validate_tensor(name: str, t, ndim: int, layout: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise InputTypeError(f"Expected {name} to be a torch.Tensor, got {type(t).__name__}.")
    if t.dim() != ndim:
        raise InputError(
            f"Expected {name} to have {ndim} dims {layout}, got {t.dim()} dims with shape {tuple(t.shape)}."
        )
    if t.numel() > 0 and t.stride(-1) != 1:
        raise InputError(
            f"Expected {name} to have a contiguous last dim (stride 1), got strides {tuple(t.stride())}; "
            f"call {name}.contiguous() or pass a view whose head dim is contiguous."
        )


def validate_dtypes(**tensors: Optional[torch.Tensor]) -> torch.dtype:
    named = {k: v for k, v in tensors.items() if v is not None}
    first_name, first = next(iter(named.items()))
    for name, t in named.items():
        if t.dtype != first.dtype:
            raise InputError(
                f"Expected all inputs to share one dtype, got {first_name}.dtype={first.dtype} "
                f"and {name}.dtype={t.dtype}."
            )
    if first.dtype not in SUPPORTED_DTYPES:
        raise InputTypeError(f"Expected dtype float16, bfloat16 or float32, got {first.dtype}.")
    if first.dtype == torch.bfloat16:
        target = device_target(first.device)
        if target is None and is_interpreter():  # the interpreter would run it (planning_for a card runs nothing)
            raise NotImplementedError(
                "bfloat16 is not supported under the Triton interpreter (TRITON_INTERPRET=1): its tl.dot "
                "gives wrong results for bf16 inputs. Use float16/float32 on the CPU; bf16 runs on a GPU."
            )
        reason = bf16_unsupported(target) if target is not None else None
        if reason is not None:
            raise NotImplementedError(f"bfloat16 {reason}. Use float16 there.")
    return first.dtype


def validate_kv_dtypes(q, k_cache, v_cache, k=None, v=None) -> bool:
    """The dtypes of a KV-cache call; returns whether the cache is FP8 (KV_FP8_DTYPES). Without an FP8 cache
    every tensor shares one dtype (`validate_dtypes`). With one: k_cache and v_cache both float8_e4m3fn,
    q in float16 / bfloat16, the new k / v in q's dtype (the append quantizes them), and a card that
    converts e4m3 (`fp8_unsupported`). Tensors must already be tensors (`validate_tensor`)."""
    fp8 = [name for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v))
           if t is not None and t.dtype.is_floating_point and t.dtype.itemsize == 1]
    if not fp8:
        validate_dtypes(q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v)
        return False
    if "q" in fp8:
        raise NotImplementedError(
            f"q in {q.dtype} is not supported: the FP8 KV cache computes q.k and p.v in q's 16-bit dtype (e4m3 q "
            f"with q_descale, FlashAttention-3's all-FP8 decode, is not implemented); pass q in float16 or bfloat16.")
    for name in ("k", "v"):
        if name in fp8:
            raise InputTypeError(
                f"Expected the new {name} in q's dtype ({q.dtype}), got {(k if name == 'k' else v).dtype}: the "
                f"append quantizes the new rows itself with k_descale / v_descale; pass them unquantized.")
    if k_cache.dtype != v_cache.dtype:
        raise InputTypeError(f"Expected k_cache and v_cache of one dtype, got {k_cache.dtype} and {v_cache.dtype}.")
    if k_cache.dtype not in KV_FP8_DTYPES:
        raise NotImplementedError(f"A KV cache in {k_cache.dtype} is not supported; the FP8 cache is "
                                  f"torch.float8_e4m3fn (e5m2 has too few mantissa bits for keys).")
    if q.dtype not in FP8_QUERY_DTYPES:
        raise NotImplementedError(f"q in {q.dtype} over an FP8 KV cache is not supported: q, the new k / v and the "
                                  f"output are float16 or bfloat16 there.")
    validate_dtypes(q=q, k=k, v=v)  # one 16-bit dtype, and bf16 where the card (or the interpreter) can run it
    target = device_target(q.device)
    reason = fp8_unsupported(target) if target is not None else None
    if reason is not None:
        raise NotImplementedError(f"An FP8 KV cache {reason}. Use a float16 / bfloat16 cache there.")
    return True


def validate_descale(name: str, descale, batch: int, nheads_k: int, device: torch.device) -> torch.Tensor:
    """An FP8 cache's k_descale / v_descale (FlashAttention-3's names): float32 (batch, nheads_k) on q's
    device, or a per-tensor scalar (a Python number, or a float32 tensor of one element on q's device or
    the CPU). Required: FlashAttention-3 reads a missing descale as 1.0, but an FP8 cache's values are
    meaningless without the scale they were stored with, so a missing one is refused (pass 1.0 to say it).
    Returned as a float32 (batch, nheads_k) view (a scalar broadcast with strides 0) whose elements
    multiply the stored values. A host-known value must be finite and > 0; a device tensor is not read on
    the host (a bad value gives wrong results, never a fault)."""
    if descale is None:
        raise InputError(f"Expected {name} with an FP8 KV cache (float32 (batch, nheads_k) or one number per "
                         f"tensor): the stored values times {name} are the keys / values; pass 1.0 if they are "
                         f"stored unscaled.")
    if isinstance(descale, bool) or not isinstance(descale, (numbers.Real, torch.Tensor)):
        raise InputTypeError(f"Expected {name} to be a float32 tensor of shape ({batch}, {nheads_k}) (batch, "
                             f"nheads_k) or a number, got {type(descale).__name__}.")
    if isinstance(descale, torch.Tensor):
        if descale.dtype != torch.float32:
            raise InputTypeError(f"Expected {name} of dtype float32 (FlashAttention-3's), got {descale.dtype}; use "
                                 f"{name}.float().")
        if descale.numel() == 1 and tuple(descale.shape) != (batch, nheads_k):  # a per-tensor scalar
            if descale.device.type == "cpu":
                descale = float(descale.reshape(()))
            elif descale.device != device:
                raise InputError(f"Expected {name} on {device} (or on the CPU), got it on {descale.device}.")
            else:
                return descale.reshape(1, 1).expand(batch, nheads_k)
        elif tuple(descale.shape) != (batch, nheads_k) or descale.device != device:
            raise InputError(f"Expected {name} of shape (batch, nheads_k) = ({batch}, {nheads_k}) on {device}, or one "
                             f"element (per tensor), got {tuple(descale.shape)} on {descale.device}.")
        else:
            return descale
    value = float(descale)
    if not (value > 0.0 and math.isfinite(value)):
        raise InputError(f"Expected {name} to be finite and > 0 (stored value * {name} = the value), got {value}.")
    return torch.full((1, 1), value, dtype=torch.float32, device=device).expand(batch, nheads_k)


def validate_saturated(counter, batch: int, nheads_k: int, device: torch.device) -> torch.Tensor:
    """An FP8 cache's counter of clamped appended values: a contiguous int64 (batch, nheads_k, 2) tensor on
    q's device, [b, h, 0] counting K's values and [b, h, 1] V's; the kernels add to it in place."""
    if not isinstance(counter, torch.Tensor):
        raise InputTypeError(f"Expected kv_saturated to be an int64 tensor of shape ({batch}, {nheads_k}, 2), got "
                             f"{type(counter).__name__}.")
    if counter.dtype != torch.int64:
        raise InputTypeError(f"Expected kv_saturated of dtype int64, got {counter.dtype}.")
    if tuple(counter.shape) != (batch, nheads_k, 2) or counter.device != device or not counter.is_contiguous():
        raise InputError(f"Expected kv_saturated contiguous, of shape (batch, nheads_k, 2) = ({batch}, {nheads_k}, 2) "
                         f"on {device}, got {tuple(counter.shape)} on {counter.device}"
                         f"{'' if counter.is_contiguous() else ', not contiguous'}.")
    return counter


def validate_devices(**tensors: Optional[torch.Tensor]) -> torch.device:
    named = {k: v for k, v in tensors.items() if v is not None}
    first_name, first = next(iter(named.items()))
    for name, t in named.items():
        if t.device != first.device:
            raise InputError(
                f"Expected all inputs on one device, got {first_name} on {first.device} and {name} on {t.device}."
            )
    if first.device.type == "cuda":
        return first.device
    if first.device.type == "cpu":
        if not is_interpreter():
            raise InputError(
                "Got CPU tensors, but Triton kernels need a CUDA device; on a machine without a GPU set "
                "TRITON_INTERPRET=1 before importing kernels to run them under the Triton interpreter."
            )
        return first.device
    raise InputError(f"Expected CUDA tensors (or CPU tensors under the interpreter), got device {first.device}.")


def validate_head_dim(head_dim: int) -> None:
    if not (MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM):
        raise InputError(f"Expected head_dim between {MIN_HEAD_DIM} and {MAX_HEAD_DIM}, got {head_dim}; the kernels "
                         f"take any head dim in that range.")


def validate_heads(nheads: int, nheads_k: int) -> None:
    if nheads_k < 1 or nheads % nheads_k != 0:
        raise InputError(
            f"Expected nheads ({nheads}) to be divisible by nheads_k ({nheads_k}); GQA needs whole groups."
        )


def validate_dropout(dropout_p) -> float:
    """dropout_p: a number in [0, 1) (1 would drop everything and scale by 1 / 0); returns it as a float."""
    if isinstance(dropout_p, (bool, torch.Tensor)) or not isinstance(dropout_p, numbers.Real):
        raise InputTypeError(f"Expected dropout_p to be a float in [0, 1), got {type(dropout_p).__name__}.")
    if not 0.0 <= dropout_p < 1.0:
        raise InputError(f"Expected dropout_p in [0, 1), got {dropout_p}.")
    return float(dropout_p)


def validate_alibi_slopes(alibi_slopes, batch: int, nheads: int, device) -> torch.Tensor:
    """ALiBi's slopes: float32 (nheads,) or (batch, nheads) on q's device (flash-attn's rule); returns
    them with a contiguous last dim."""
    if not isinstance(alibi_slopes, torch.Tensor):
        raise InputTypeError(f"Expected alibi_slopes to be a torch.Tensor or None, got {type(alibi_slopes).__name__}.")
    if alibi_slopes.dtype != torch.float32:
        raise InputTypeError(f"Expected alibi_slopes of dtype float32, got {alibi_slopes.dtype}.")
    if tuple(alibi_slopes.shape) not in ((nheads,), (batch, nheads)) or alibi_slopes.device != device:
        raise InputError(f"Expected alibi_slopes of shape ({nheads},) or ({batch}, {nheads}) on {device}, got "
                         f"{tuple(alibi_slopes.shape)} on {alibi_slopes.device}.")
    return alibi_slopes if alibi_slopes.stride(-1) == 1 else alibi_slopes.contiguous()


def validate_sinks(sinks, nheads: int, device) -> None:
    """Attention sinks: a floating (nheads,) tensor on q's device, one logit per query head."""
    if not isinstance(sinks, torch.Tensor):
        raise InputTypeError(f"Expected sinks to be a torch.Tensor or None, got {type(sinks).__name__}.")
    if not sinks.is_floating_point():
        raise InputTypeError(f"Expected sinks of a floating dtype, got {sinks.dtype}.")
    if tuple(sinks.shape) != (nheads,) or sinks.device != device:
        raise InputError(f"Expected sinks of shape ({nheads},) (one per query head) on {device}, got "
                         f"{tuple(sinks.shape)} on {sinks.device}.")


def check_block_table_entries(block_table: torch.Tensor, host_lengths, seqlen_new: int, page_size: int,
                               num_blocks: int, window_left: int = -1, seqlen_q: int = 0) -> None:
    """Raise ValueError if a CPU block_table entry that the call uses lies outside [0, num_blocks).

    With host-known lengths (an int or a CPU tensor) request b uses its first
    ceil((L_b + seqlen_new) / page_size) entries and only those are checked (the rest may hold
    anything, e.g. -1); without them (lengths on the GPU) every entry is. With a sliding window's left
    side (window_left >= 0, seqlen_q query tokens) the pages wholly before request b's band, whose
    first key is L_b + seqlen_new - seqlen_q - window_left, are not used either (a cache may have
    freed them).
    """
    table = block_table.to(torch.int64)
    bad = (table < 0) | (table >= num_blocks)  # (batch, max_blocks)
    if host_lengths is not None:
        if isinstance(host_lengths, int):
            host_lengths = torch.full((table.shape[0],), host_lengths, dtype=torch.int64)
        n_keys = host_lengths.to(torch.int64).clamp(min=0) + seqlen_new
        n_pages = (n_keys + page_size - 1) // page_size
        first = torch.zeros_like(n_pages)
        if window_left >= 0:
            first = (n_keys - seqlen_q - window_left).clamp(min=0) // page_size
        j = torch.arange(table.shape[1])[None, :]
        bad &= (j >= first[:, None]) & (j < n_pages[:, None])
    if not bool(bad.any()):
        return
    b, j = (int(i) for i in bad.nonzero()[0])
    which = (f"request {b} uses entries {int(first[b])} to {int(n_pages[b]) - 1}" if host_lengths is not None
             else "cache_seqlens is on the GPU, so every entry is checked")
    raise InputError(
        f"Expected block_table entries in [0, num_blocks = {num_blocks}) (physical blocks of k_cache), got "
        f"block_table[{b}, {j}] = {int(table[b, j])} ({which}); entries past a request's pages may hold any value."
    )


def validate_max_seqlen(name: str, value) -> int:
    """max_seqlen_q / max_seqlen_k: a host int >= 0 (a tensor would need a device sync to read)."""
    if isinstance(value, (bool, torch.Tensor)) or not hasattr(value, "__index__"):
        raise InputTypeError(
            f"Expected {name} to be a Python int >= 0 (the longest sequence, known on the host), "
            f"got {type(value).__name__}."
        )
    value = int(value)
    if value < 0:
        raise InputError(f"Expected {name} >= 0, got {value}.")
    return value


def validate_cu_seqlens(name: str, cu_seqlens, device: torch.device) -> None:
    """Checks of cu_seqlens that need no device sync: type, dtype int32, 1-D (batch + 1,), device."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise InputTypeError(f"Expected {name} to be a torch.Tensor, got {type(cu_seqlens).__name__}.")
    if cu_seqlens.dtype != torch.int32:
        raise InputTypeError(
            f"Expected {name} to have dtype torch.int32 (flash-attn's layout), got {cu_seqlens.dtype}; "
            f"pass {name}.to(torch.int32)."
        )
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise InputError(
            f"Expected {name} to be 1-D with batch + 1 >= 1 entries (prefix sums of the sequence lengths, "
            f"starting at 0), got shape {tuple(cu_seqlens.shape)}."
        )
    if cu_seqlens.device != device:
        raise InputError(f"Expected {name} on the inputs' device {device}, got {cu_seqlens.device}.")


def validate_cu_seqlens_values(name: str, cu_seqlens: torch.Tensor, total: Optional[int], max_seqlen: int,
                                max_name: str) -> None:
    """Value checks of a CPU cu_seqlens (reading a CUDA one would sync): starts at 0, never
    decreases, ends at the packed row count (unless total is None: keys in a paged pool), no
    sequence longer than max_seqlen."""
    values = cu_seqlens.tolist()
    if values[0] != 0:
        raise InputError(f"Expected {name}[0] == 0 (prefix sums start at 0), got {values[0]}.")
    lengths = [b - a for a, b in zip(values[:-1], values[1:])]
    bad = next((i for i, n in enumerate(lengths) if n < 0), None)
    if bad is not None:
        raise InputError(
            f"Expected {name} to be non-decreasing (sequence lengths >= 0), got {name}[{bad}] = {values[bad]} > "
            f"{name}[{bad + 1}] = {values[bad + 1]}."
        )
    if total is not None and values[-1] != total:
        raise InputError(
            f"Expected {name}[-1] ({values[-1]}) to equal the number of packed rows ({total}); "
            f"cu_seqlens must end at the total length of the packed tensor."
        )
    longest = max(lengths, default=0)
    if longest > max_seqlen:
        raise InputError(
            f"Expected {max_name} ({max_seqlen}) >= the longest sequence in {name} ({longest}); "
            f"rows past {max_name} would never be computed."
        )


def validate_prefill_dtypes(q, k, v) -> bool:
    """q, k, v of a prefill call share one dtype: a 16-bit or fp32 one (`validate_dtypes`), or float8_e4m3fn,
    the FP8 forward (returns True): on sm_89 or newer (`fp8_unsupported`), head dim > 16 (FP8 tensor-core
    products reduce over at least 32), no gradient (forward only)."""
    fp8 = [name for name, t in (("q", q), ("k", k), ("v", v)) if t.dtype in KV_FP8_DTYPES]
    if not fp8:
        validate_dtypes(q=q, k=k, v=v)
        return False
    if len(fp8) < 3:
        raise InputTypeError(f"Expected q, k and v all in float8_e4m3fn for the FP8 forward, got q {q.dtype}, "
                             f"k {k.dtype}, v {v.dtype}.")
    if q.shape[-1] <= 16:
        raise NotImplementedError(f"The FP8 forward needs a head dim > 16 (its products reduce over at least 32), "
                                  f"got {q.shape[-1]}; use float16 / bfloat16 inputs.")
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        raise NotImplementedError("The FP8 forward has no backward: pass e4m3 q, k, v that do not require grad "
                                  "(or run it under torch.no_grad()); train in float16 / bfloat16.")
    target = device_target(q.device)
    reason = fp8_unsupported(target) if target is not None else None
    if reason is not None:
        raise NotImplementedError(f"The FP8 forward {reason}. Use float16 / bfloat16 inputs there.")
    return True


def validate_qkv(q, k, v, fp8_ok: bool = False) -> bool:
    """A dense prefill call's q, k, v; returns whether they are FP8. fp8_ok: the caller runs the FP8 forward
    (`validate_prefill_dtypes`); otherwise one dtype of `SUPPORTED_DTYPES` (`validate_dtypes`)."""
    layout = "(batch, seqlen, nheads, headdim)"
    validate_tensor("q", q, 4, layout)
    validate_tensor("k", k, 4, layout)
    validate_tensor("v", v, 4, layout)
    if fp8_ok:
        fp8 = validate_prefill_dtypes(q, k, v)
    else:
        validate_dtypes(q=q, k=k, v=v)
        fp8 = False
    validate_devices(q=q, k=k, v=v)
    if k.shape != v.shape:
        raise InputError(f"Expected k and v to have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}.")
    if q.shape[0] != k.shape[0]:
        raise InputError(f"Expected q and k to share the batch size, got {q.shape[0]} and {k.shape[0]}.")
    if q.shape[3] != k.shape[3]:
        raise InputError(f"Expected q and k to share the head dim, got {q.shape[3]} and {k.shape[3]}.")
    validate_head_dim(q.shape[3])
    validate_heads(q.shape[2], k.shape[2])
    return fp8


def validate_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, paged: bool = False,
                    seqused_k: Optional[torch.Tensor] = None, fp8_ok: bool = False) -> Tuple[int, int]:
    """Checks of packed inputs that need no device sync (see flash_attn_varlen_func); returns the max lengths.
    paged: k and v are the rows of paged pools, which cu_seqlens_k does not span. seqused_k: None, or
    checked as `validate_seqused_k` says (its values too where it and cu_seqlens_k are on the host). fp8_ok:
    the caller runs the FP8 forward on e4m3 q, k, v (`validate_prefill_dtypes`)."""
    validate_tensor("q", q, 3, "(total_q, nheads, headdim)")
    validate_tensor("k", k, 3, "(total_k, nheads_k, headdim)")
    validate_tensor("v", v, 3, "(total_k, nheads_k, headdim)")
    if fp8_ok and not paged:  # packed q, k, v may be the FP8 forward's
        validate_prefill_dtypes(q, k, v)
    else:
        validate_dtypes(q=q, k=k, v=v)
    device = validate_devices(q=q, k=k, v=v)
    if k.shape != v.shape:
        raise InputError(f"Expected k and v to have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}.")
    if q.shape[2] != k.shape[2]:
        raise InputError(f"Expected q and k to share the head dim, got {q.shape[2]} and {k.shape[2]}.")
    validate_head_dim(q.shape[2])
    validate_heads(q.shape[1], k.shape[1])
    max_seqlen_q = validate_max_seqlen("max_seqlen_q", max_seqlen_q)
    max_seqlen_k = validate_max_seqlen("max_seqlen_k", max_seqlen_k)
    validate_cu_seqlens("cu_seqlens_q", cu_seqlens_q, device)
    validate_cu_seqlens("cu_seqlens_k", cu_seqlens_k, device)
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise InputError(
            f"Expected cu_seqlens_q and cu_seqlens_k to describe the same batch, got {cu_seqlens_q.numel() - 1} "
            f"and {cu_seqlens_k.numel() - 1} sequences (shapes {tuple(cu_seqlens_q.shape)} and "
            f"{tuple(cu_seqlens_k.shape)})."
        )
    if cu_seqlens_q.device.type == "cpu":  # readable without a device sync (the interpreter's case)
        validate_cu_seqlens_values("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q, "max_seqlen_q")
        validate_cu_seqlens_values("cu_seqlens_k", cu_seqlens_k, None if paged else k.shape[0], max_seqlen_k,
                                   "max_seqlen_k")
    if seqused_k is not None:
        validate_seqused_k_values(validate_seqused_k(seqused_k, cu_seqlens_q.numel() - 1, device), cu_seqlens_k)
    return max_seqlen_q, max_seqlen_k


def validate_seqused_k(seqused_k, batch: int, device: torch.device) -> torch.Tensor:
    """seqused_k: int32 (batch,) on the inputs' device (flash-attn's layout), the number of keys each
    packed sequence attends to; returned contiguous. Its values are checked against cu_seqlens_k where
    both are on the host (`validate_seqused_k_values`); on a GPU the kernels clamp each into
    [0, the sequence's cu_seqlens_k span] (wrong results, never a read outside it)."""
    if not isinstance(seqused_k, torch.Tensor):
        raise InputTypeError(f"Expected seqused_k to be an int32 tensor or None, got {type(seqused_k).__name__}.")
    if seqused_k.dtype != torch.int32:
        raise InputTypeError(f"Expected seqused_k of dtype int32 (flash-attn's layout), got {seqused_k.dtype}.")
    if tuple(seqused_k.shape) != (batch,) or seqused_k.device != device:
        raise InputError(f"Expected seqused_k of shape ({batch},) (one key count per sequence) on {device}, got "
                         f"{tuple(seqused_k.shape)} on {seqused_k.device}.")
    return seqused_k.contiguous()


def validate_seqused_k_values(seqused_k: torch.Tensor, cu_seqlens_k: torch.Tensor) -> None:
    """Host-known seqused_k against host-known cu_seqlens_k: 0 <= seqused_k[b] <= that sequence's keys."""
    if seqused_k.device.type != "cpu" or cu_seqlens_k.device.type != "cpu" or seqused_k.numel() == 0:
        return
    span = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).to(torch.int64)
    used = seqused_k.to(torch.int64)
    bad = ((used < 0) | (used > span)).nonzero()
    if len(bad):
        b = int(bad[0])
        raise InputError(f"Expected 0 <= seqused_k[b] <= cu_seqlens_k[b + 1] - cu_seqlens_k[b], got seqused_k[{b}] = "
                         f"{int(used[b])} for a sequence of {int(span[b])} keys.")


def validate_varlen_paged(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table,
                          dropout_p, seqused_k=None) -> Tuple[int, int, torch.Tensor]:
    """flash_attn_varlen_func's checks with a paged K/V (block_table): the packed checks on one row of each
    page, the pools, the table (and, host-visible, its entries and the lengths against its capacity);
    returns (max_seqlen_q, max_seqlen_k, block_table with a contiguous last dim)."""
    validate_tensor("k", k_cache, 4, "(num_blocks, page_size, nheads_k, headdim) with block_table")
    validate_tensor("v", v_cache, 4, "(num_blocks, page_size, nheads_k, headdim) with block_table")
    if k_cache.shape != v_cache.shape or k_cache.shape[1] < 1:
        raise InputError(f"Expected k and v pools of one shape with page_size >= 1, got {tuple(k_cache.shape)} and "
                         f"{tuple(v_cache.shape)}.")
    max_seqlen_q, max_seqlen_k = validate_varlen(q, k_cache[:, 0], v_cache[:, 0], cu_seqlens_q, cu_seqlens_k,
                                                 max_seqlen_q, max_seqlen_k, paged=True, seqused_k=seqused_k)
    if not isinstance(block_table, torch.Tensor):
        raise InputTypeError(f"Expected block_table to be a torch.Tensor, got {type(block_table).__name__}.")
    if block_table.dtype != torch.int32:
        raise InputTypeError(f"Expected block_table of dtype int32, got {block_table.dtype}.")
    batch = cu_seqlens_q.numel() - 1
    if block_table.dim() != 2 or block_table.shape[0] != batch or block_table.device != q.device:
        raise InputError(f"Expected block_table (batch={batch}, max_blocks_per_seq) on {q.device}, got shape "
                         f"{tuple(block_table.shape)} on {block_table.device}.")
    if validate_dropout(dropout_p):
        raise NotImplementedError("dropout with a paged K/V (block_table) is not supported: dropout is for training, "
                                  "and the paged forward has no backward.")
    page_size = k_cache.shape[1]
    capacity = block_table.shape[1] * page_size
    if k_cache.shape[0] < 1 or block_table.shape[1] < 1:
        raise InputError(f"Expected a pool of >= 1 block and a block_table of >= 1 column, got pools "
                         f"{tuple(k_cache.shape)} and block_table {tuple(block_table.shape)}.")
    block_table = block_table if block_table.stride(-1) == 1 else block_table.contiguous()
    if cu_seqlens_k.device.type == "cpu":  # host-known lengths (the interpreter's case): check them whole
        lengths = cu_seqlens_k[1:] - cu_seqlens_k[:-1]
        if lengths.numel() and int(lengths.max()) > capacity:
            raise InputError(f"Expected every key length <= the block table's capacity max_blocks_per_seq * "
                             f"page_size = {capacity}, got lengths {lengths.tolist()}.")
        if block_table.device.type == "cpu":
            check_block_table_entries(block_table, lengths, 0, page_size, k_cache.shape[0])
    return max_seqlen_q, max_seqlen_k, block_table
