"""KV caches for generation on top of `flash_attn_with_kvcache` (api/kvcache.py).

- `KVCache`: preallocated dense K/V buffers (batch, max_seqlen, nheads_k, head_dim) and lengths.
- `PagedKVCache`: a pool of fixed-size pages shared by requests that come and go, with a free list
  and a block table (PagedAttention, vLLM); `PoolExhaustedError` when the pool or the slots run out.

Both keep their lengths twice: an int32 device tensor (what the kernels read, advanced in place, so a
decode step never syncs with the host and can be captured in a CUDA graph) and a host mirror (what
the overflow and allocation checks read).

Built with dtype=torch.float8_e4m3fn they hold an FP8 cache and own its scales (cache/fp8.py): one
descale per (request, KV head) for K and for V, set from each prompt's amax with a headroom (or given to
`prefill`), kept for every append, and a count of the values clamped at +-448 (`saturated`). Their
inputs (q, k, v) are then float16 or bfloat16, and the prompt's attention runs on the unquantized
values, as FlashAttention-3 and vLLM do.

Their methods keep host state, so under torch.compile they run eagerly, outside the graph (a graph
break; an error with fullgraph=True). A compiled decode step calls `flash_attn_with_kvcache` on the
buffers with the device lengths (`seqlens_device`), which compiles whole.
"""

from __future__ import annotations

import functools
import numbers
from typing import Optional, Sequence, Union

import numpy as np
import torch

from ..api.kvcache import flash_attn_with_kvcache
from ..api.prefill import flash_attn_func
from ..api.validate import FP8_QUERY_DTYPES, SUPPORTED_DTYPES, validate_head_dim, validate_tensor
from ..api.validate_cache import check_host_lengths
from ..config.hardware import default_device, device_target, fp8_unsupported
from ..config.options import FP8_SCALE_HEADROOM, KV_FP8_DTYPES
from ..errors import InputError, InputTypeError
from ..launch.operands import empty_aligned
from .fp8 import FP8Scales
from .speculative import accepted_moves, check_tree_step, move_rows, truncated_lengths

NO_WINDOW = (-1, -1)  # flash-attn's window_size for none


def eager_only(method):
    """`method` as is, except under torch.compile: run eagerly there (torch.compiler.disable) rather than
    traced, since dynamo would specialise on the host mirror's values."""
    disabled, is_compiling = torch.compiler.disable(method), torch.compiler.is_compiling

    @functools.wraps(method)
    def call(*args, **kwargs):
        return disabled(*args, **kwargs) if is_compiling() else method(*args, **kwargs)

    return call


def cache_dtype(dtype: torch.dtype, device: torch.device) -> bool:
    """Check a cache's dtype (float16, bfloat16, float32, or float8_e4m3fn where the card computes in it);
    returns whether it is FP8."""
    if dtype not in SUPPORTED_DTYPES + KV_FP8_DTYPES:
        raise InputTypeError(f"Expected dtype float16, bfloat16, float32 or float8_e4m3fn (an FP8 cache), got {dtype}.")
    target = device_target(device) if dtype in KV_FP8_DTYPES else None
    reason = fp8_unsupported(target) if target is not None else None
    if reason is not None:
        raise NotImplementedError(f"An FP8 KV cache {reason}. Use a float16 / bfloat16 cache there.")
    return dtype in KV_FP8_DTYPES


def check_input_dtype(name: str, t: torch.Tensor, cache_dtype_: torch.dtype, device: torch.device) -> None:
    """A prompt's or a step's k / v for a cache: the cache's dtype (float16 or bfloat16 for an FP8 cache,
    which quantizes them) on its device."""
    ok = t.dtype in FP8_QUERY_DTYPES if cache_dtype_ in KV_FP8_DTYPES else t.dtype == cache_dtype_
    if not ok or t.device != device:
        want = "float16 or bfloat16 (an FP8 cache quantizes them)" if cache_dtype_ in KV_FP8_DTYPES else cache_dtype_
        raise InputError(f"Expected {name} as {want} on {device} (the cache's), got {t.dtype} on {t.device}.")


def check_one_key_per_query(q, k, v) -> None:
    """A cache's decode step appends one key per query token: k and v carry q's seqlen_q tokens, which
    is what the lengths advance by (flash_attn_with_kvcache itself allows fewer new keys than queries)."""
    for name, t in (("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4 or t.shape[1] != q.shape[1]:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise InputError(f"Expected {name} with q's {q.shape[1]} new tokens, (batch, {q.shape[1]}, nheads_k, "
                             f"head_dim), got {shape}.")


# ============================================================================================
# KV cache helper
# ============================================================================================
class KVCache:
    """Preallocated K/V buffers plus per-request lengths, for batched autoregressive generation.

    Owns k_cache / v_cache of shape (batch, max_seqlen, nheads_k, head_dim) (rows 16-byte aligned: for a
    head dim that is not a multiple of 8 in fp16/bf16, views of wider buffers) and the lengths, kept
    twice: an int32 device tensor (what the kernel reads; advanced in place, so a decode step never
    syncs with the host and can be captured in a CUDA graph) and a host mirror (what the overflow
    checks read). Every method raises ValueError before an append could pass max_seqlen.

        cache = KVCache(batch, max_seqlen, nheads_k, head_dim, dtype=torch.float16, device="cuda")
        out = cache.prefill(q_prompt, k_prompt, v_prompt)        # causal prompt attention, fills the cache
        for step in range(n):
            out = cache.decode(q_t, k_t, v_t)                    # append + attend, lengths += seqlen_q

    CUDA graphs: a captured `decode` advances the device lengths on every replay but the host mirror
    only once, at capture; call `refresh_host_seqlens()` (one host sync) after replaying.

    FP8 (dtype=torch.float8_e4m3fn, sm_89 or newer): half the bytes a step reads. `prefill` sets each
    request's descales from its prompt (amax per KV head * fp8_headroom / 448) or takes k_descale /
    v_descale; `k_descale`, `v_descale` (float32 (batch, nheads_k)) and `saturated` (int64 (batch,
    nheads_k, 2): K's and V's values clamped at +-448 since the request's reset) are readable.
    """

    def __init__(self, batch: int, max_seqlen: int, nheads_k: int, head_dim: int, *,
                 dtype: torch.dtype = torch.float16, device: Union[str, torch.device, None] = None,
                 fp8_headroom: float = FP8_SCALE_HEADROOM):
        for name, value in (("batch", batch), ("max_seqlen", max_seqlen), ("nheads_k", nheads_k)):
            if not isinstance(value, numbers.Integral) or value < 1:
                raise InputError(f"Expected {name} to be a positive int, got {value!r}.")
        validate_head_dim(head_dim)
        device = default_device() if device is None else torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        fp8 = cache_dtype(dtype, device)
        self._fp8 = FP8Scales(int(batch), int(nheads_k), device, fp8_headroom) if fp8 else None
        shape = (int(batch), int(max_seqlen), int(nheads_k), int(head_dim))
        self.k_cache = empty_aligned(shape, dtype, device, zero=True)
        self.v_cache = empty_aligned(shape, dtype, device, zero=True)
        self._seqlens = torch.zeros(int(batch), dtype=torch.int32, device=device)
        self._host = np.zeros(int(batch), dtype=np.int64)
        self.batch, self.max_seqlen, self.nheads_k, self.head_dim = shape
        self.dtype, self.device = dtype, device
        self._drafts = None  # the last decode's draft count when it verified a tree (for accept)

    # -- an FP8 cache's scales (None for a 16-bit cache) -------------------------------------------
    @property
    def k_descale(self) -> Optional[torch.Tensor]:
        """float32 (batch, nheads_k): stored K * k_descale = K (an FP8 cache; do not modify)."""
        return None if self._fp8 is None else self._fp8.k_descale

    @property
    def v_descale(self) -> Optional[torch.Tensor]:
        """float32 (batch, nheads_k): stored V * v_descale = V (an FP8 cache; do not modify)."""
        return None if self._fp8 is None else self._fp8.v_descale

    @property
    def saturated(self) -> Optional[torch.Tensor]:
        """int64 (batch, nheads_k, 2): K's ([..., 0]) and V's ([..., 1]) values clamped at +-448 * descale
        since each request's reset (an FP8 cache; reading the values syncs)."""
        return None if self._fp8 is None else self._fp8.saturated

    # -- lengths ---------------------------------------------------------------------------------
    @property
    def seqlens(self) -> list:
        """Current length of each request (host mirror, a list of ints)."""
        return self._host.tolist()

    @property
    def seqlens_device(self) -> torch.Tensor:
        """Current lengths as the int32 (batch,) device tensor the kernel reads (do not modify)."""
        return self._seqlens

    @eager_only
    def refresh_host_seqlens(self) -> list:
        """Copy the device lengths to the host mirror (one sync), e.g. after CUDA-graph replays."""
        self._host = self._seqlens.cpu().numpy().astype(np.int64)
        return self.seqlens

    def _indices(self, batch_idx) -> Union[slice, torch.Tensor]:
        """batch_idx (None, int, sequence or 1-D tensor of ints) -> a slice or an index tensor."""
        if batch_idx is None:
            return slice(0, self.batch)
        if isinstance(batch_idx, numbers.Integral) and not isinstance(batch_idx, bool):
            idx = [int(batch_idx)]
        elif isinstance(batch_idx, torch.Tensor):
            if batch_idx.dim() != 1 or batch_idx.dtype.is_floating_point or batch_idx.dtype == torch.bool:
                raise InputError(f"Expected batch_idx to be a 1-D integer tensor, got {batch_idx.dtype} "
                                 f"of shape {tuple(batch_idx.shape)}.")
            idx = [int(i) for i in batch_idx.tolist()]
        elif isinstance(batch_idx, Sequence):
            idx = [int(i) for i in batch_idx]
        else:
            raise InputTypeError(
                f"Expected batch_idx to be None, an int or a sequence of ints, got {type(batch_idx).__name__}."
            )
        if not idx:
            raise InputError("Expected batch_idx to name at least one request.")
        for i in idx:
            if not 0 <= i < self.batch:
                raise InputError(f"Expected batch indices in [0, {self.batch}), got {i}.")
        if len(set(idx)) != len(idx):
            raise InputError(f"Expected distinct batch indices, got {idx}.")
        if idx == list(range(idx[0], idx[0] + len(idx))):
            return slice(idx[0], idx[0] + len(idx))
        return torch.tensor(idx, dtype=torch.long, device=self.device)

    def _host_index(self, index):
        return index if isinstance(index, slice) else index.cpu().numpy()

    @eager_only
    def reset(self, batch_idx=None) -> None:
        """Forget the contents of the given requests (all by default): their lengths become 0."""
        index = self._indices(batch_idx)
        self._host[self._host_index(index)] = 0
        self._seqlens[index] = 0
        self._drafts = None
        if self._fp8 is not None:
            self._fp8.reset(index)

    @eager_only
    def set_scales(self, k: torch.Tensor, v: torch.Tensor, *, batch_idx=None, k_descale=None, v_descale=None) -> None:
        """An FP8 cache: set empty requests' descales from their prompts' K / V (n, seqlen, nheads_k, head_dim)
        (amax per KV head * fp8_headroom / 448) or as given, before decode appends the prompts in chunks
        (`prefill` sets them itself). A request's scales cannot change once it holds tokens."""
        if self._fp8 is None:
            raise InputError("set_scales is for an FP8 cache (dtype=torch.float8_e4m3fn).")
        index = self._indices(batch_idx)
        host_index = self._host_index(index)
        busy = np.nonzero(self._host[host_index] != 0)[0]
        if len(busy):
            request = int(np.arange(self.batch)[host_index][busy[0]])
            raise InputError(f"Expected empty requests for set_scales, but request {request} holds "
                             f"{int(self._host[request])} tokens quantized with its current scales.")
        count = len(self._host[host_index])
        for name, t in (("k", k), ("v", v)):
            validate_tensor(name, t, 4, "(n, seqlen, nheads_k, head_dim)")
            if t.shape[0] != count or tuple(t.shape[2:]) != (self.nheads_k, self.head_dim):
                raise InputError(f"Expected {name} of shape ({count}, seqlen, {self.nheads_k}, {self.head_dim}), "
                                 f"got {tuple(t.shape)}.")
        self._fp8.set_descales(index, k, v, k_descale, v_descale)

    # -- prefill and decode ----------------------------------------------------------------------
    @eager_only
    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
                softmax_scale: Optional[float] = None, batch_idx=None, window_size=NO_WINDOW, softcap: float = 0.0,
                alibi_slopes: Optional[torch.Tensor] = None, sinks: Optional[torch.Tensor] = None,
                k_descale=None, v_descale=None) -> torch.Tensor:
        """Attention over prompts of one length with the prefill kernel; stores k/v in the cache.

        q: (n, seqlen, nheads, head_dim), k/v: (n, seqlen, nheads_k, head_dim) for the n requests
        named by batch_idx (all by default), whose caches must be empty (reset them first). Returns
        tritonattn.flash_attn_func(q, k, v, causal=causal, ...) with the variants given (window_size,
        softcap, alibi_slopes, sinks, as flash_attn_func takes them) and sets those requests' lengths
        to seqlen. An FP8 cache stores k / v quantized with the requests' new descales: k_descale /
        v_descale (a number, or float32 (n, nheads_k)) when given, else amax * fp8_headroom / 448 per
        (request, KV head); not with a 16-bit cache.
        """
        index = self._indices(batch_idx)
        host_index = self._host_index(index)
        count = len(self._host[host_index])
        for name, t in (("k", k), ("v", v)):
            validate_tensor(name, t, 4, "(n, seqlen, nheads_k, headdim)")
            expected = (count, k.shape[1] if isinstance(k, torch.Tensor) else -1, self.nheads_k, self.head_dim)
            if tuple(t.shape) != expected:
                raise InputError(f"Expected {name} of shape (n, seqlen, nheads_k, head_dim) = {expected} for "
                                 f"{count} requests, got {tuple(t.shape)}.")
            check_input_dtype(name, t, self.dtype, self.device)
        if self._fp8 is None and (k_descale is not None or v_descale is not None):
            raise InputError("Expected k_descale / v_descale only for an FP8 cache (dtype=torch.float8_e4m3fn).")
        if not isinstance(q, torch.Tensor) or q.dim() != 4 or q.shape[0] != count or q.shape[1] != k.shape[1]:
            raise InputError(f"Expected q of shape ({count}, {k.shape[1]}, nheads, {self.head_dim}), got "
                             f"{tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__}.")
        seqlen = k.shape[1]
        busy = np.nonzero(self._host[host_index] != 0)[0]
        if len(busy):
            request = int(np.arange(self.batch)[host_index][busy[0]])
            raise InputError(f"Expected empty caches for prefill, but request {request} holds "
                             f"{int(self._host[request])} tokens; call reset() first.")
        if seqlen > self.max_seqlen:
            raise InputError(f"KV cache overflow: prompt of {seqlen} tokens > max_seqlen {self.max_seqlen}.")
        out = flash_attn_func(q, k, v, causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                              softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks)
        if self._fp8 is not None:
            k, v = self._fp8.store_prompt(index, k, v, k_descale, v_descale)
        self.k_cache[index, :seqlen] = k
        self.v_cache[index, :seqlen] = v
        self._host[host_index] = seqlen
        self._seqlens[index] = seqlen
        return out

    @eager_only
    def decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
               softmax_scale: Optional[float] = None, num_splits: int = 0, window_size=NO_WINDOW,
               softcap: float = 0.0, alibi_slopes: Optional[torch.Tensor] = None,
               sinks: Optional[torch.Tensor] = None, tree_mask: Optional[torch.Tensor] = None,
               tree_cu_seqlens: Optional[torch.Tensor] = None) -> torch.Tensor:
        """One decode step for the whole batch: append k/v (batch, seqlen_q, nheads_k, head_dim) at
        each request's length, attend q (batch, seqlen_q, nheads, head_dim) over the cache (with the
        variants given, as flash_attn_with_kvcache takes them), advance the lengths by seqlen_q
        (device tensor in place, no host sync; host mirror). Returns out. With tree_mask (and
        tree_cu_seqlens), a speculative-decoding verify step over a draft tree, as flash_attn_with_kvcache
        takes it; `accept` then keeps one path."""
        if not isinstance(q, torch.Tensor) or q.dim() != 4:
            raise InputError("Expected q of shape (batch, seqlen_q, nheads, head_dim).")
        if k is None or v is None:
            raise InputError("KVCache.decode appends: expected k and v (batch, seqlen_q, nheads_k, head_dim).")
        check_one_key_per_query(q, k, v)
        seqlen_q = q.shape[1]
        if int(self._host.max()) + seqlen_q > self.max_seqlen:
            check_host_lengths(self._host, seqlen_q, self.max_seqlen)
        fp8 = {} if self._fp8 is None else self._fp8.call_args(slice(0, self.batch))  # views: counts in place
        tree = {} if tree_mask is None else dict(tree_mask=tree_mask, tree_cu_seqlens=tree_cu_seqlens)
        out = flash_attn_with_kvcache(q, self.k_cache, self.v_cache, k, v, cache_seqlens=self._seqlens,
                                      softmax_scale=softmax_scale, causal=causal, num_splits=num_splits,
                                      window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                                      sinks=sinks, **fp8, **tree)
        self._seqlens += seqlen_q
        self._host += seqlen_q
        self._drafts = seqlen_q if tree else None
        return out

    @eager_only
    def truncate(self, lengths) -> None:
        """Shorten requests to `lengths` (an int for all, or a (batch,) sequence / int tensor; a request already
        shorter keeps its length): the rows past them are forgotten, nothing moves (e.g. a draft model dropping its
        rejected tokens). A device tensor is applied on the device with no host sync; the host mirror then keeps
        the old lengths, an upper bound, until `refresh_host_seqlens`."""
        new = truncated_lengths(lengths, self._seqlens)
        self._seqlens.copy_(torch.minimum(self._seqlens, new))
        if not isinstance(lengths, torch.Tensor) or lengths.device.type == "cpu":
            host = lengths.numpy() if isinstance(lengths, torch.Tensor) else np.asarray(lengths)
            self._host = np.minimum(self._host, np.broadcast_to(host, self._host.shape)).astype(np.int64)
        self._drafts = None

    @eager_only
    def accept(self, accepted: torch.Tensor) -> None:
        """After a verify step (decode with tree_mask): keep each request's accepted drafts. accepted: integer
        (batch, A), row b request b's accepted draft indices in tree order (increasing), then -1s (none: all
        -1). Draft a_i's K/V move to position prefix + i and the length becomes prefix + (accepted count), on
        the device with no host sync (a device `accepted` is trusted and clamped; a host one is checked, and the
        host mirror follows it; after a device one the mirror keeps prefix + drafts, an upper bound, until
        `refresh_host_seqlens`). See cache/speculative.py."""
        drafts = check_tree_step(self._drafts)
        src, dst, lengths = accepted_moves(accepted, drafts, self._seqlens, self.max_seqlen)
        rows = torch.arange(self.batch, device=self.device)[:, None].expand_as(src)
        move_rows((self.k_cache, self.v_cache), (rows, src), (rows, dst))
        self._seqlens.copy_(lengths)
        if accepted.device.type == "cpu":  # the new lengths are host-known: the mirror follows, no sync
            self._host = self._host - drafts + (accepted >= 0).sum(1).numpy().astype(np.int64)
        self._drafts = None
