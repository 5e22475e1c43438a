"""`PagedKVCache`: a pool of fixed-size pages shared by requests that come and go, with a free list and
a block table (PagedAttention, vLLM); `PoolExhaustedError` when the pool or the slots run out."""

from __future__ import annotations

import numbers
from typing import NamedTuple, Optional, Sequence, Union

import numpy as np
import torch

from ..api.args import attention_call
from ..api.kvcache import kvcache_call
from ..api.prefill import flash_attn_func
from ..api.validate import (
    validate_devices,
    validate_dtypes,
    validate_head_dim,
    validate_heads,
    validate_tensor,
)
from ..api.validate_cache import validate_kvcache_inputs, validate_num_splits
from ..config.hardware import default_device
from ..config.options import FP8_SCALE_HEADROOM
from ..errors import InputError, InputTypeError
from ..launch.operands import empty_aligned
from .dense import NO_WINDOW, cache_dtype, check_input_dtype, check_one_key_per_query, eager_only
from .fp8 import FP8Scales
from .speculative import accepted_moves, check_tree_step, move_rows, truncated_lengths


# ============================================================================================
# Paged KV cache helper
# ============================================================================================
class PoolExhaustedError(RuntimeError):
    """PagedKVCache has too few free blocks (or no free request slot) for what was asked.

    Raised before anything changes: no block is taken, no page written, no length advanced.
    Serving loops catch it to preempt or queue a request, then retry after `free`.
    """


class PagedBatch(NamedTuple):
    """What flash_attn_with_kvcache needs for a batch of PagedKVCache requests (`PagedKVCache.batch`)."""

    block_table: torch.Tensor  # int32 (n, max_blocks_per_seq) on the cache's device; -1 = no page
    cache_seqlens: torch.Tensor  # int32 (n,) on the cache's device
    block_table_host: torch.Tensor  # int32 (n, max_blocks_per_seq) CPU copy of the host mirror
    seqlens_host: list  # n ints, the host mirror


class PagedKVCache:
    """A pool of fixed-size K/V pages shared by requests that come and go (PagedAttention, vLLM).

    Owns the pools k_cache / v_cache of shape (num_blocks, page_size, nheads_k, head_dim) (rows aligned
    as in KVCache), a free
    list of their blocks, and max_batch request slots. Each slot has a row of the block table
    (max_batch, max_blocks_per_seq) (logical page i of the request -> physical block; -1 where the
    request has no page) and a length. Table and lengths are kept twice: int32 device tensors
    (`block_table`, `seqlens_device`: what the kernel reads; lengths advance in place, so a decode
    step never syncs with the host and can be captured in a CUDA graph) and host mirrors (what the
    allocation and overflow checks read).

        cache = PagedKVCache(1024, 16, nheads_k, head_dim, max_batch=8, max_blocks_per_seq=256,
                             dtype=torch.float16, device="cuda")
        a = cache.add_request()                            # a free slot id
        out = cache.prefill(q_p, k_p, v_p, slots=[a])      # causal prompt attention; pages filled
        b = cache.add_request(); cache.prefill(q_p2, k_p2, v_p2, slots=[b])
        out = cache.decode(q_t, k_t, v_t, slots=[a, b])    # append + attend, pages taken on demand
        cache.free(a)                                      # a's pages return to the pool

    Guarantees: a block belongs to at most one request at a time; blocks are taken only from the
    free list, all-or-nothing per call (PoolExhaustedError leaves the cache unchanged), so a full
    pool never overwrites a live page; a request growing past max_seqlen = max_blocks_per_seq *
    page_size raises ValueError before any launch. Freed blocks are reused first (LIFO).

    Sliding window (sliding_window=W, for a cache that serves window-only attention, e.g. Mistral's
    layers): every prefill and decode through the cache attends with a window whose left side is at
    most W (window_size=None, the default, means (W, 0) when causal, else (W, -1)); after each call a
    request keeps only the pages that hold a key at or after its length - W, the first key a later
    query can see, and returns the pages wholly before it to the pool (their table entries become -1;
    the kernels never read a key before a query's band). So a request holds about (W + page_size) /
    page_size pages however long it grows. Not while a CUDA graph is being captured: pages are returned
    by the next call outside a capture.

    CUDA graphs: capture `decode` for slots that form a contiguous ascending range (the table and
    lengths it passes are then views of the cache's own tensors) after reserving, with
    `extend(slot, tokens)`, the pages of every step you will replay: no page can be allocated on the
    host during a replay (a decode that would need one while capturing raises). Each replay
    advances the device lengths; the host mirror advances once, at capture: call
    `refresh_host_seqlens()` (one sync) after replaying. A replay that outgrows the reserved pages
    reaches table entries of -1: its appended rows are dropped (no live page is overwritten) and
    its output is not meaningful.

    FP8 (dtype=torch.float8_e4m3fn, sm_89 or newer): as KVCache's, per request slot: `prefill` sets the
    slots' descales (amax per KV head * fp8_headroom / 448, or k_descale / v_descale given), `free`
    forgets them; `k_descale`, `v_descale` (float32 (max_batch, nheads_k)) and `saturated` (int64
    (max_batch, nheads_k, 2)) are readable.
    """

    def __init__(self, num_blocks: int, page_size: int, nheads_k: int, head_dim: int, *, max_batch: int,
                 max_blocks_per_seq: int, dtype: torch.dtype = torch.float16,
                 device: Union[str, torch.device, None] = None, sliding_window: Optional[int] = None,
                 fp8_headroom: float = FP8_SCALE_HEADROOM):
        if sliding_window is not None and (not isinstance(sliding_window, numbers.Integral)
                                           or isinstance(sliding_window, bool) or sliding_window < 0):
            raise InputError(f"Expected sliding_window to be None or an int >= 0, got {sliding_window!r}.")
        self.sliding_window = None if sliding_window is None else int(sliding_window)
        for name, value in (("num_blocks", num_blocks), ("page_size", page_size), ("nheads_k", nheads_k),
                            ("max_batch", max_batch), ("max_blocks_per_seq", max_blocks_per_seq)):
            if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
                raise InputError(f"Expected {name} to be a positive int, got {value!r}.")
        validate_head_dim(head_dim)
        device = default_device() if device is None else torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        fp8 = cache_dtype(dtype, device)
        self.num_blocks, self.page_size, self.nheads_k, self.head_dim = (int(num_blocks), int(page_size),
                                                                         int(nheads_k), int(head_dim))
        self.max_batch, self.max_blocks_per_seq = int(max_batch), int(max_blocks_per_seq)
        self.max_seqlen = self.max_blocks_per_seq * self.page_size
        self.dtype, self.device = dtype, device
        self._fp8 = FP8Scales(self.max_batch, self.nheads_k, device, fp8_headroom) if fp8 else None
        shape = (self.num_blocks, self.page_size, self.nheads_k, self.head_dim)
        self.k_cache = empty_aligned(shape, dtype, device, zero=True)
        self.v_cache = empty_aligned(shape, dtype, device, zero=True)
        self.block_table = torch.full((self.max_batch, self.max_blocks_per_seq), -1, dtype=torch.int32, device=device)
        self._seqlens = torch.zeros(self.max_batch, dtype=torch.int32, device=device)
        self._host_table = np.full((self.max_batch, self.max_blocks_per_seq), -1, dtype=np.int32)
        self._host_len = np.zeros(self.max_batch, dtype=np.int64)
        self._npages = np.zeros(self.max_batch, dtype=np.int64)  # logical pages of each slot
        self._first = np.zeros(self.max_batch, dtype=np.int64)  # its first page still held (sliding_window)
        self._active = np.zeros(self.max_batch, dtype=bool)
        self._free = list(range(self.num_blocks - 1, -1, -1))  # pop() from the end: block 0 first
        self._tree = None  # (slots, drafts) of the last decode when it verified a tree (for accept)
        self._shrunk = set()  # slots an accept shortened: their spare pages go back at the next refresh

    # -- state ------------------------------------------------------------------------------------
    @property
    def k_descale(self) -> Optional[torch.Tensor]:
        """float32 (max_batch, nheads_k): stored K * k_descale = K, per slot (an FP8 cache; do not modify)."""
        return None if self._fp8 is None else self._fp8.k_descale

    @property
    def v_descale(self) -> Optional[torch.Tensor]:
        """float32 (max_batch, nheads_k): stored V * v_descale = V, per slot (an FP8 cache; do not modify)."""
        return None if self._fp8 is None else self._fp8.v_descale

    @property
    def saturated(self) -> Optional[torch.Tensor]:
        """int64 (max_batch, nheads_k, 2): K's and V's values clamped at +-448 * descale since each slot's
        request was added (an FP8 cache; reading the values syncs)."""
        return None if self._fp8 is None else self._fp8.saturated

    @property
    def num_free_blocks(self) -> int:
        """Blocks in the free list."""
        return len(self._free)

    @property
    def active_slots(self) -> list:
        """Slots holding a request, ascending."""
        return np.nonzero(self._active)[0].tolist()

    @property
    def seqlens(self) -> list:
        """Length of every slot (host mirror, a list of max_batch ints; 0 for free slots)."""
        return self._host_len.tolist()

    @property
    def seqlens_device(self) -> torch.Tensor:
        """Lengths as the int32 (max_batch,) device tensor the kernel reads (do not modify)."""
        return self._seqlens

    def pages(self, slot: int) -> list:
        """Physical blocks of the pages a request holds, in logical order (with sliding_window, from the
        first page it still holds)."""
        self._check_slots([slot])
        return self._host_table[slot, self._first[slot] : self._npages[slot]].tolist()

    def capacity(self, slot: int) -> int:
        """Tokens the request can hold without a new page (its pages x page_size)."""
        self._check_slots([slot])
        return int(self._npages[slot]) * self.page_size

    @eager_only
    def refresh_host_seqlens(self) -> list:
        """Copy the device lengths to the host mirror (one sync), e.g. after CUDA-graph replays; the pages an
        `accept` left past a request's length return to the pool."""
        self._host_len = self._seqlens.cpu().numpy().astype(np.int64)
        self._release_spare(sorted(self._shrunk))
        return self.seqlens

    def _release_spare(self, slots) -> None:
        """Return the pages past each slot's (host-known) length to the pool, e.g. after accept or truncate."""
        rows = []
        for s in slots:
            keep = max(-(-int(self._host_len[s]) // self.page_size), int(self._first[s]))
            if self._active[s] and keep < self._npages[s]:
                self._free.extend(reversed(self._host_table[s, keep: self._npages[s]].tolist()))
                self._host_table[s, keep:] = -1
                self._npages[s] = keep
                rows.append(np.concatenate([[s], self._host_table[s]]))
        self._shrunk.difference_update(slots)
        if rows:
            update = torch.from_numpy(np.stack(rows).astype(np.int32)).to(self.device)
            self.block_table.index_copy_(0, update[:, 0].long(), update[:, 1:])

    # -- requests ---------------------------------------------------------------------------------
    @eager_only
    def add_request(self) -> int:
        """Take a free slot for a new request (length 0, no page yet) and return its id."""
        free = np.nonzero(~self._active)[0]
        if len(free) == 0:
            raise PoolExhaustedError(f"All {self.max_batch} request slots are in use; free a finished request first.")
        slot = int(free[0])
        self._active[slot] = True
        return slot

    @eager_only
    def free(self, slot: int) -> None:
        """Release a finished request: its pages return to the pool, its slot to the free slots."""
        self._check_slots([slot])
        pages = self._host_table[slot, self._first[slot] : self._npages[slot]].tolist()
        self._free.extend(reversed(pages))  # reused first, in logical order
        self._host_table[slot] = -1
        self._npages[slot] = 0
        self._first[slot] = 0
        self._host_len[slot] = 0
        self._active[slot] = False
        self.block_table[slot] = -1
        self._seqlens[slot] = 0
        self._shrunk.discard(slot)
        self._tree = None
        if self._fp8 is not None:
            self._fp8.reset(slot)

    @eager_only
    def set_scales(self, slot: int, k: torch.Tensor, v: torch.Tensor, *, k_descale=None, v_descale=None) -> None:
        """An FP8 cache: set an empty request's descales from its prompt's K / V (seqlen, nheads_k, head_dim)
        (amax per KV head * fp8_headroom / 448) or as given, before decode appends the prompt in chunks
        (chunked prefill; `prefill` sets them itself). A request's scales cannot change once it holds
        tokens: its stored values were quantized with them."""
        if self._fp8 is None:
            raise InputError("set_scales is for an FP8 cache (dtype=torch.float8_e4m3fn).")
        self._check_slots([slot])
        if self._host_len[slot] != 0:
            raise InputError(f"Expected an empty request for set_scales, but slot {slot} holds "
                             f"{int(self._host_len[slot])} tokens quantized with its current scales.")
        for name, t in (("k", k), ("v", v)):
            validate_tensor(name, t, 3, "(seqlen, nheads_k, head_dim)")
            if tuple(t.shape[1:]) != (self.nheads_k, self.head_dim):
                raise InputError(f"Expected {name} of shape (seqlen, {self.nheads_k}, {self.head_dim}), got "
                                 f"{tuple(t.shape)}.")
        self._fp8.set_descales(slice(slot, slot + 1), k[None], v[None], k_descale, v_descale)

    @eager_only
    def extend(self, slot: int, num_tokens: int) -> list:
        """Make room for `num_tokens` more tokens after the request's current length: take the pages
        they need from the pool (none while the last page has room). Returns the new blocks.

        Raises ValueError past max_seqlen and PoolExhaustedError when the pool is short; either way
        nothing changes. The length itself advances only when K/V are written (prefill, decode).
        """
        return self._reserve([slot], int(num_tokens))

    def _check_slots(self, slots) -> None:
        for s in slots:
            if not isinstance(s, numbers.Integral) or isinstance(s, bool) or not 0 <= s < self.max_batch:
                raise InputError(f"Expected slot ids in [0, {self.max_batch}), got {s!r}.")
            if not self._active[s]:
                raise InputError(f"Slot {s} holds no request (add_request() first, or it was freed).")
        if len(set(int(s) for s in slots)) != len(slots):
            raise InputError(f"Expected distinct slots, got {list(slots)}.")

    def _reserve(self, slots: list, num_tokens: int) -> list:
        """Pages for `num_tokens` more tokens in each slot, all or nothing; returns the new blocks."""
        if num_tokens < 0:
            raise InputError(f"Expected num_tokens >= 0, got {num_tokens}.")
        lengths = self._host_len[slots] + num_tokens
        if len(slots) and int(lengths.max()) > self.max_seqlen:
            i = int(np.argmax(lengths > self.max_seqlen))
            raise InputError(
                f"KV cache overflow for slot {slots[i]}: {int(self._host_len[slots[i]])} tokens + {num_tokens} new = "
                f"{int(lengths[i])} > max_seqlen = max_blocks_per_seq * page_size = {self.max_blocks_per_seq} * "
                f"{self.page_size} = {self.max_seqlen}."
            )
        need = np.maximum(-(-lengths // self.page_size) - self._npages[slots], 0)
        total = int(need.sum())
        if total == 0:
            return []
        if total > len(self._free):
            raise PoolExhaustedError(
                f"Page pool exhausted: {total} new blocks of {self.page_size} tokens needed for slots {list(slots)}, "
                f"{len(self._free)} of {self.num_blocks} free; free finished requests or allocate a larger pool."
            )
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "PagedKVCache needs new pages while a CUDA graph is being captured (the block-table update "
                "would only run on replay); reserve them before capturing with extend(slot, num_tokens)."
            )
        taken, rows = [], []
        for s, n in zip(slots, need.tolist()):
            if n == 0:
                continue
            blocks = [self._free.pop() for _ in range(n)]
            start = int(self._npages[s])
            self._host_table[s, start : start + n] = blocks
            self._npages[s] = start + n
            taken += blocks
            rows.append(np.concatenate([[s], self._host_table[s]]))
        # one host-to-device copy of the changed rows (slot id first), scattered into the device table
        update = torch.from_numpy(np.stack(rows).astype(np.int32)).to(self.device)
        self.block_table.index_copy_(0, update[:, 0].long(), update[:, 1:])
        return taken

    def _release_before_window(self, slots: list) -> None:
        """With sliding_window W: return to the pool each slot's pages wholly before its length - W (no
        later query sees a key there), their table entries -1; nothing while a CUDA graph is captured."""
        if self.sliding_window is None or (self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            return
        rows = []
        for s in slots:
            keep = min(max(int(self._host_len[s]) - self.sliding_window, 0) // self.page_size, int(self._npages[s]))
            first = int(self._first[s])
            if keep <= first:
                continue
            self._free.extend(reversed(self._host_table[s, first:keep].tolist()))
            self._host_table[s, first:keep] = -1
            self._first[s] = keep
            rows.append(np.concatenate([[s], self._host_table[s]]))
        if rows:  # one host-to-device copy of the changed rows, as in _reserve
            update = torch.from_numpy(np.stack(rows).astype(np.int32)).to(self.device)
            self.block_table.index_copy_(0, update[:, 0].long(), update[:, 1:])

    def _window(self, window_size, causal: bool):
        """The window a call attends with: window_size, or by default (None) the cache's sliding window
        ((W, 0) causal, else (W, -1); none without one). With sliding_window its left side must be
        bounded by W: the pages before it may have been returned to the pool."""
        if window_size is None:
            if self.sliding_window is None:
                return NO_WINDOW
            return (self.sliding_window, 0 if causal else -1)
        if self.sliding_window is not None:
            left = window_size[0] if isinstance(window_size, Sequence) and len(window_size) == 2 else None
            if not isinstance(left, numbers.Integral) or not 0 <= left <= self.sliding_window:
                raise InputError(f"Expected window_size with a left side in [0, sliding_window = "
                                 f"{self.sliding_window}] (this cache returns the pages before the window to the "
                                 f"pool), got {window_size!r}.")
        return window_size

    def _index(self, slots: list) -> Union[slice, torch.Tensor]:
        """slots -> a slice (contiguous ascending: views, graph-friendly) or a device index tensor."""
        if slots == list(range(slots[0], slots[0] + len(slots))):
            return slice(slots[0], slots[0] + len(slots))
        return torch.tensor(slots, dtype=torch.long, device=self.device)

    def _slots(self, slots) -> list:
        if slots is None:
            slots = self.active_slots
        elif isinstance(slots, numbers.Integral) and not isinstance(slots, bool):
            slots = [int(slots)]
        elif isinstance(slots, torch.Tensor):
            slots = [int(s) for s in slots.tolist()]
        elif isinstance(slots, Sequence):
            slots = list(slots)
        else:
            raise InputTypeError(
                f"Expected slots to be None, an int or a sequence of ints, got {type(slots).__name__}."
            )
        if not slots:
            raise InputError("Expected at least one request slot.")
        self._check_slots(slots)
        return [int(s) for s in slots]

    @eager_only
    def batch(self, slots=None) -> PagedBatch:
        """Block table and lengths of a batch of requests (default: every active slot, ascending).

        For slots forming a contiguous ascending range the device tensors are views of the cache's
        own (they follow later decode steps and are safe to capture in a CUDA graph); otherwise they
        are gathered copies of the current state.
        """
        slots = self._slots(slots)
        index = self._index(slots)
        return PagedBatch(
            block_table=self.block_table[index], cache_seqlens=self._seqlens[index],
            block_table_host=torch.from_numpy(self._host_table[slots].copy()),
            seqlens_host=self._host_len[slots].tolist(),
        )

    # -- prefill and decode ---------------------------------------------------------------------------
    @eager_only
    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, slots, causal: bool = True,
                softmax_scale: Optional[float] = None, window_size=None, softcap: float = 0.0,
                alibi_slopes: Optional[torch.Tensor] = None, sinks: Optional[torch.Tensor] = None,
                k_descale=None, v_descale=None) -> torch.Tensor:
        """Prompt attention with the prefill kernel; writes the prompts' K/V into their pages.

        q: (n, seqlen, nheads, head_dim), k/v: (n, seqlen, nheads_k, head_dim) for the n empty
        requests named by `slots` (prompts of one length; call once per length). Takes the pages
        (all or nothing), returns tritonattn.flash_attn_func(q, k, v, causal=causal, ...) with the variants
        given (window_size None: the cache's sliding window, see the class docstring) and sets those
        requests' lengths to seqlen. An FP8 cache stores them quantized with the slots' new descales
        (k_descale / v_descale when given, else from the prompt's amax, as KVCache.prefill).
        """
        slots = self._slots(slots)
        window_size = self._window(window_size, causal)
        count = len(slots)
        for name, t in (("k", k), ("v", v)):
            validate_tensor(name, t, 4, "(n, seqlen, nheads_k, head_dim)")
            expected = (count, k.shape[1] if isinstance(k, torch.Tensor) else -1, self.nheads_k, self.head_dim)
            if tuple(t.shape) != expected:
                raise InputError(f"Expected {name} of shape (n, seqlen, nheads_k, head_dim) = {expected} for "
                                 f"{count} requests, got {tuple(t.shape)}.")
            check_input_dtype(name, t, self.dtype, self.device)
        if self._fp8 is None and (k_descale is not None or v_descale is not None):
            raise InputError("Expected k_descale / v_descale only for an FP8 cache (dtype=torch.float8_e4m3fn).")
        if (not isinstance(q, torch.Tensor) or q.dim() != 4 or q.shape[0] != count or q.shape[1] != k.shape[1]
                or q.shape[3] != self.head_dim):
            raise InputError(f"Expected q of shape ({count}, {k.shape[1]}, nheads, {self.head_dim}), got "
                             f"{tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__}.")
        validate_heads(q.shape[2], self.nheads_k)
        validate_dtypes(q=q, k=k)
        validate_devices(q=q, k=k)
        busy = [s for s in slots if self._host_len[s] != 0]
        if busy:
            raise InputError(f"Expected empty requests for prefill, but slot {busy[0]} holds "
                             f"{int(self._host_len[busy[0]])} tokens; decode appends to it, or free it.")
        seqlen = k.shape[1]
        attention_call(q.shape[3], softmax_scale, causal, window_size, softcap, alibi_slopes, sinks, seqlen_k=seqlen,
                       batch=count, nheads=q.shape[2], device=q.device)  # checked before pages are taken
        if self._fp8 is not None:  # the descales checked before pages are taken
            for name, given, t in (("k_descale", k_descale, k), ("v_descale", v_descale, v)):
                self._fp8.descale_for(name, given, t)
        self._reserve(slots, seqlen)  # raises before anything is written
        out = flash_attn_func(q, k, v, causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                              softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks)
        if self._fp8 is not None:
            k, v = self._fp8.store_prompt(self._index(slots), k, v, k_descale, v_descale)
        if seqlen > 0:
            pos = np.arange(seqlen)
            blocks = torch.from_numpy(self._host_table[slots][:, pos // self.page_size].astype(np.int64))
            rows = torch.from_numpy(pos % self.page_size)
            blocks, rows = blocks.to(self.device), rows.to(self.device)
            self.k_cache[blocks, rows] = k  # (n, seqlen) physical rows <- (n, seqlen, nheads_k, head_dim)
            self.v_cache[blocks, rows] = v
        self._host_len[slots] = seqlen
        self._seqlens[self._index(slots)] = seqlen
        self._release_before_window(slots)
        return out

    @eager_only
    def decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, slots=None, causal: bool = True,
               softmax_scale: Optional[float] = None, num_splits: int = 0, window_size=None, softcap: float = 0.0,
               alibi_slopes: Optional[torch.Tensor] = None, sinks: Optional[torch.Tensor] = None,
               tree_mask: Optional[torch.Tensor] = None,
               tree_cu_seqlens: Optional[torch.Tensor] = None) -> torch.Tensor:
        """One decode step for a batch of requests (default: every active slot, ascending; q's batch
        order is the slots' order): take the pages the new tokens need, append k/v (n, seqlen_q,
        nheads_k, head_dim) at each request's length through the kernel's fused append, attend q
        (n, seqlen_q, nheads, head_dim) over the cache with the variants given (as
        flash_attn_with_kvcache takes them; window_size None: the cache's sliding window), advance the
        lengths by seqlen_q (device tensor in place, no host sync; host mirror). Returns out (n,
        seqlen_q, nheads, head_dim). With tree_mask (and tree_cu_seqlens) a speculative-decoding verify step
        over a draft tree, as flash_attn_with_kvcache takes it; `accept` then keeps one path."""
        slots = self._slots(slots)
        if not isinstance(q, torch.Tensor) or q.dim() != 4 or q.shape[0] != len(slots):
            raise InputError(f"Expected q of shape ({len(slots)}, seqlen_q, nheads, head_dim) for slots {slots}, got "
                             f"{tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__}.")
        if k is None or v is None:
            raise InputError("PagedKVCache.decode appends: expected k and v (n, seqlen_q, nheads_k, head_dim).")
        check_one_key_per_query(q, k, v)
        # everything that could still fail is checked before pages are taken: all or nothing per call
        kv_fp8 = validate_kvcache_inputs(q, self.k_cache, self.v_cache, k, v, paged=True)
        index = self._index(slots)
        fp8 = {} if self._fp8 is None else self._fp8.call_args(index)
        call = attention_call(q.shape[3], softmax_scale, causal, self._window(window_size, causal), softcap,
                              alibi_slopes, sinks, seqlen_k=self.max_seqlen, batch=len(slots), nheads=q.shape[2],
                              device=q.device, kv_fp8=kv_fp8, nheads_k=self.nheads_k, **fp8, tree_mask=tree_mask,
                              tree_cu_seqlens=tree_cu_seqlens, seqlen_q=q.shape[1])
        validate_num_splits(num_splits)
        seqlen_q = q.shape[1]
        self._reserve(slots, seqlen_q)
        out = kvcache_call(q, self.k_cache, self.v_cache, k, v, self._seqlens[index], self.block_table[index],
                           softmax_scale, causal, num_splits, False, validated=True, call=call)
        if self._fp8 is not None:
            self._fp8.settle(index, fp8)
        self._seqlens[index] += seqlen_q
        self._host_len[slots] += seqlen_q
        self._release_before_window(slots)
        self._tree = None if tree_mask is None else (slots, seqlen_q)
        return out

    @eager_only
    def truncate(self, lengths, *, slots=None) -> None:
        """Shorten the requests of `slots` (default: every active slot, ascending) to `lengths` (an int, or one
        per slot; a request already shorter keeps its length): nothing moves, the pages past the new lengths
        return to the pool at the next `refresh_host_seqlens` (immediately when the lengths are host-known)."""
        slots = self._slots(slots)
        index = self._index(slots)
        new = truncated_lengths(lengths, self._seqlens[index])
        self._seqlens[index] = torch.minimum(self._seqlens[index], new)
        self._shrunk.update(slots)
        self._tree = None
        if not isinstance(lengths, torch.Tensor) or lengths.device.type == "cpu":
            host = lengths.numpy() if isinstance(lengths, torch.Tensor) else np.asarray(lengths)
            self._host_len[slots] = np.minimum(self._host_len[slots], np.broadcast_to(host, (len(slots),)))
            self._release_spare(slots)

    @eager_only
    def accept(self, accepted: torch.Tensor) -> None:
        """After a verify step (decode with tree_mask) of slots S: keep each request's accepted drafts. accepted:
        integer (len(S), A), row i slot S[i]'s accepted draft indices in tree order (increasing), then -1s.
        Draft a_i's K/V move to position prefix + i through the block table and the length becomes prefix +
        (accepted count), on the device with no host sync (a device `accepted` is trusted and clamped; a host
        one is checked, and then the host mirror follows and the pages past the new lengths return to the pool at
        once; after a device one the mirror keeps prefix + drafts until `refresh_host_seqlens`, which returns
        them). See cache/speculative.py."""
        slots, drafts = self._tree or (None, check_tree_step(None))  # the verify step's slots and draft count
        index = self._index(slots)
        src, dst, lengths = accepted_moves(accepted, drafts, self._seqlens[index], self.max_seqlen)
        table = self.block_table[index].long()

        def rows(pos):  # logical positions -> rows of the pool seen as (num_blocks * page_size, ...)
            page = table.gather(1, pos // self.page_size).clamp(0, self.num_blocks - 1)
            return (page * self.page_size + pos % self.page_size,)
        move_rows((self.k_cache.flatten(0, 1), self.v_cache.flatten(0, 1)), rows(src), rows(dst))
        self._seqlens[index] = lengths
        self._shrunk.update(slots)
        self._tree = None
        if accepted.device.type == "cpu":  # host-known lengths: the mirror follows and spare pages go back now
            self._host_len[slots] += (accepted >= 0).sum(1).numpy().astype(np.int64) - drafts
            self._release_spare(slots)
