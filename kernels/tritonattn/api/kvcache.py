"""`flash_attn_with_kvcache`: decode and chunked prefill over a dense or paged KV cache, and `kvcache_call`,
its body, which KVCache and PagedKVCache share.

A call validates its tensors (api/validate_cache.py; once per signature on a GPU), translates its options
once (`args.attention_call`; a call without variants: `args.plain_call`, cached), resolves its lengths and
block table, applies rotary only when all of that passed, and hands everything to launch/decode.py. A
call that repeats a validated one replays its launches instead (launch/replay.py, [Note] Host overhead in
launch/decode.py)."""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch

from ..config.hardware import is_interpreter
from ..errors import InputError
from ..launch.decode import launch_kvcache, signature
from ..launch.fast import recording_active
from ..launch.replay import REPLAYS, replay_key_of, run_replay
from ..launch.rotary import rotate
from .args import AttnCall, attention_call, plain_call
from .prefill import TRACED
from .validate_cache import (
    Rotary,
    batch_idx_as_table,
    resolve_cache_leftpad,
    resolve_cache_seqlens,
    resolve_paging,
    validate_kvcache_inputs,
    validate_num_splits,
    validate_rotary,
)
from .validate_tree import check_tree_call

_INTERPRET = is_interpreter()  # fixed when Triton decorated the kernels, at import
# `signature`s of CUDA calls whose tensors passed validate_kvcache_inputs: a repeat skips the checks
VALIDATED_SIGNATURES: set = set()


def flash_attn_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: Optional[torch.Tensor] = None,
    v: Optional[torch.Tensor] = None,
    rotary_cos: Optional[torch.Tensor] = None,
    rotary_sin: Optional[torch.Tensor] = None,
    cache_seqlens: Optional[Union[int, torch.Tensor]] = None,
    cache_batch_idx: Optional[torch.Tensor] = None,
    cache_leftpad: Optional[torch.Tensor] = None,
    block_table: Optional[torch.Tensor] = None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    alibi_slopes: Optional[torch.Tensor] = None,
    num_splits: int = 0,
    return_softmax_lse: bool = False,
    *,
    sinks: Optional[torch.Tensor] = None,
    k_descale: Optional[Union[float, torch.Tensor]] = None,
    v_descale: Optional[Union[float, torch.Tensor]] = None,
    kv_saturated: Optional[torch.Tensor] = None,
    tree_mask: Optional[torch.Tensor] = None,
    tree_cu_seqlens: Optional[torch.Tensor] = None,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Decode attention over a KV cache, dense or paged, with an optional in-place append, in one
    launch (flash-attn 2's `flash_attn_with_kvcache`, same signature).

    Args:
        q: (batch, seqlen_q, nheads, headdim), float16, bfloat16 or float32, any headdim in [1, 256];
            seqlen_q >= 1 (1 for plain decoding, a few for speculative-decoding verification).
        k_cache, v_cache: q's dtype (or both torch.float8_e4m3fn: an FP8 cache, see k_descale) and device,
            any strides with a contiguous last dim; no
            copies are made; beyond 2^31 elements is fine. Query head h reads KV head
            h // (nheads // nheads_k) (MHA, GQA, MQA).
            Dense (block_table None): (batch, seqlen_cache, nheads_k, headdim), e.g. also a
            (batch, nheads_k, seqlen_cache, headdim) buffer passed as .transpose(1, 2).
            Paged (block_table given): pools (num_blocks, page_size, nheads_k, headdim), e.g. also a
            (num_blocks, nheads_k, page_size, headdim) pool passed as .transpose(1, 2). Any
            page_size >= 1 (see [Note] Paged caches in kernels/tritonattn/jit/decode.py).
        k, v: optional (batch, seqlen_new, nheads_k, headdim), 1 <= seqlen_new <= seqlen_q: the new
            tokens' keys and values. They are written into k_cache / v_cache in place at (logical) rows
            [cache_seqlens[b], cache_seqlens[b] + seqlen_new) and attended over in the same launch; the
            queries are the last seqlen_q positions of the cache_seqlens[b] + seqlen_new keys (causal:
            bottom-right), so seqlen_new < seqlen_q verifies draft tokens with a partial append. Both or
            neither. In a paged cache each new row goes to its own page slot, so an append may cross pages.
        rotary_cos, rotary_sin: optional (seqlen_ro, rotary_dim / 2), q's dtype, rotary_dim a multiple
            of 16 <= headdim, seqlen_ro covering the cache; only with k and v. q and k are rotated
            before the append and the attention (kernels/tritonattn/jit/rotary.py): k's token t at position
            cache_seqlens[b] + t, q's the same when causal or with a sliding window, else all at
            cache_seqlens[b], as flash-attn
            (with seqlen_new < seqlen_q that is not the queries' attention alignment, which stays
            bottom-right).
            rotary_interleaved: GPT-J pairs (2i, 2i + 1) when True, GPT-NeoX halves when False.
        cache_batch_idx: optional int32 (batch,): request b reads and appends cache row
            cache_batch_idx[b] of a dense cache with any batch (not with block_table). Duplicate
            indices with an append leave either request's rows, as in flash-attn.
        cache_leftpad: optional int32 (batch,), on q's device or on the CPU (checked, then copied):
            request b's keys are cache rows [cache_leftpad[b], cache_seqlens[b]) (flash-attn's
            convention: cache_seqlens is where the keys end, the padding included); rows before are
            padding, never read. New k/v still go at row cache_seqlens[b], rotary positions count from
            row 0 (the padding included), and causal stays bottom-right over the keys seen (see causal).
            A request padded up to its length (and no append) sees no key: zeros, LSE +inf. A CPU
            tensor is checked on the host: 0 <= cache_leftpad[b] <= cache_seqlens[b] when the lengths
            are host-known too, else <= seqlen_cache (ValueError); a GPU one is trusted and clamped into
            [0, cache_seqlens[b]] by the kernels. Dense caches only, with or without cache_batch_idx:
            with block_table it raises NotImplementedError, as flash-attn does.
        cache_seqlens: each request's cache length before this call: None (every cache full:
            seqlen_cache; not with k and v), an int (the same for every
            request) or an int32 tensor of shape (batch,), on q's device or on the CPU (checked on
            the host, then copied: use a device tensor inside a CUDA graph). It is never modified
            (advance it yourself, e.g. cache_seqlens += seqlen_new, or use KVCache / PagedKVCache).
            Overflow: lengths known on the host (an int, a CPU tensor) are checked, and an append
            that would pass seqlen_cache (paged: max_blocks_per_seq * page_size) raises ValueError.
            A tensor on the GPU cannot be checked without a host sync: the caller is responsible
            for it; the kernel clamps each length to [0, seqlen_cache] and drops appended rows past
            the end, so no read or write ever leaves the buffers, but the result of an overflowing
            call is not meaningful.
        block_table: optional int32 (batch, max_blocks_per_seq), contiguous last dim, on q's device
            or on the CPU (checked, then copied): logical key j of request b lives in row
            j % page_size of physical block block_table[b, j // page_size] of the pools (flash-attn
            and vLLM's convention). Request b uses its first ceil(N_b / page_size) entries; the
            rest may hold anything (-1 is a good filler). Entries outside [0, num_blocks): a CPU
            block_table is checked (ValueError, for the entries the call uses when the lengths are
            host-known, else for all). A GPU block_table cannot be checked without a sync: the kernel
            clamps each entry into [0, num_blocks) for reads (wrong results, never an out-of-bounds
            read) and drops appended rows whose entry is outside the pool (never an out-of-bounds
            write). Two requests may share pages they only read (prefix sharing); a page appended
            into must belong to one request.
        softmax_scale: defaults to headdim ** -0.5.
        window_size, softcap, alibi_slopes: as in flash_attn_func, aligned bottom-right over each
            request's N_b keys (see causal): token t's diagonal key is t + N_b - seqlen_q. A window side
            reaching seqlen_cache (paged: max_blocks_per_seq * page_size) is unbounded. With a window's
            left side bounded, only the band's keys are read and the splits tile the band, so a long
            cache under a short window costs what the window costs ([Note] Variants in decode,
            kernels/tritonattn/jit/decode.py).
        causal: mask aligned to the bottom-right corner over the N_b = cache_seqlens[b] + seqlen_q
            keys (cache_seqlens[b] without k/v): token t sees key j iff j <= t + N_b - seqlen_q (and,
            with cache_leftpad, j >= cache_leftpad[b]).
            For cache_seqlens[b] = 3 and seqlen_q = 2 with an append (1 = kept):
                1 1 1 1 0
                1 1 1 1 1
            With seqlen_q == 1 causal changes nothing. A row that sees no key (a request with an
            empty cache and no append) outputs zeros, never NaN.
        num_splits: 0 = heuristic (from batch, heads, the allocated seqlen_cache -- paged:
            max_blocks_per_seq * page_size -- and the SM count, never from current lengths),
            1 = no split, n > 1 = split each cache into about n chunks processed in parallel and
            merged by log-sum-exp (capped at the number of BLOCK_N blocks of the cache). Splits past
            a request's length exit at once. With 0, seqlen_q >= 128 and enough work to fill the
            GPU, the call is a chunk of a prompt: it runs the prefill kernel family instead (an
            append launch, then a FlashAttention-2 forward over the cache; see [Note] Chunked
            prefill); an explicit num_splits >= 1 keeps the decode kernel.
        return_softmax_lse: also return the log-sum-exp of each row.
        sinks: optional float32 (nheads,): a learnable sink logit per head (gpt-oss), as in
            flash_attn_func: each row's softmax denominator gains exp(sinks[h]) (added once, also when
            the cache is split), and the LSE includes it.
        k_descale, v_descale: an FP8 cache's descales (FlashAttention-3's names): float32 (batch, nheads_k),
            on q's device, or one number per tensor (a Python float or a one-element float32 tensor);
            required with an FP8 cache (FlashAttention-3 reads a missing one as 1.0; here it is refused:
            pass 1.0 for values stored unscaled). Key j of KV head h of request b is
            k_cache[..] * k_descale[b, h] (dequantized on load inside the kernels, K's descale folded into
            the score scale, V's into the epilogue). Only with float8_e4m3fn caches, where q, the new
            k / v and the output are float16 or bfloat16 (an e4m3 or float32 q is refused) and the card
            is sm_89 or newer. An append stores
            clamp(value / descale, -448, 448) rounded to e4m3 (to nearest even; never NaN for finite
            values) and attends over the stored rows, as a later step reads them. Host-known descales
            must be finite and > 0; device ones are not checked. Calls with an FP8 cache are not
            replayed (the descales are per-call tensors) and are refused under torch.compile.
        kv_saturated: optional, ours, with an FP8 cache: a contiguous int64 (batch, nheads_k, 2) tensor on
            q's device; the append adds to [b, h, 0] / [b, h, 1] how many of request b's new K / V values
            of KV head h it clamped at +-448 (|value / descale| > 448), in the kernel, with no host sync:
            a caller's sign that its scales are too tight. Indexed like q's batch.
        tree_mask, tree_cu_seqlens: ours, a speculative-decoding verify step over a draft tree: the seqlen_q
            query tokens are drafts in tree order and the last seqlen_q keys (with k / v: seqlen_new must
            equal seqlen_q; without: already in the cache). Every key before them is seen; among them
            token t sees draft u iff tree_mask says so, and always itself. tree_mask: bool (batch, seqlen_q,
            seqlen_q), [b, t, u] True iff u is t or an ancestor of t; or, for ragged drafts, a packed 1-D
            bool with tree_cu_seqlens int32 (batch + 1,) the cumulative draft counts (request b's n_b x n_b
            matrix row-major, n_b <= seqlen_q; its tokens past n_b are padding no draft sees). Needs
            causal=True; not with rotary, ALiBi or a window (a draft's position is the prefix length plus
            its depth: rotate q and k yourself). A host mask is checked (diagonal set, nothing above it); a
            device one is trusted (no sync; the kernel sets the diagonal and ignores bits above it). Always
            the decode kernel (never the chunked-prefill path); not replayed; refused under torch.compile.

    Returns:
        out: (batch, seqlen_q, nheads, headdim), dtype of q (on Hopper, when the chunked-prefill path
            runs over a cache with 16-byte aligned rows at a headdim whose rows are not, a view of an
            aligned buffer; contiguous otherwise).
        softmax_lse (if return_softmax_lse): (batch, nheads, seqlen_q) float32, natural log; +inf
            for a row that sees no key (with sinks: the sink's logit).

    No host synchronisation happens with device cache_seqlens (and block_table), so the whole step
    (append + attention) can be captured in a CUDA graph and replayed while the lengths advance on
    the device. Not supported: cache_leftpad together with a paged block_table.

    Under torch.compile the call is one graph node (compile/ops.py), the append a declared mutation
    of k_cache and v_cache. With mode="reduce-overhead" (CUDA graphs) whatever the step mutates must
    be static: k_cache, v_cache and cache_seqlens (an int32 device tensor advanced in place) must be
    the same tensors every call, marked with torch._dynamo.mark_static_address or held as module
    buffers; otherwise inductor skips CUDA graphs for the step (it logs "mutated inputs"). Lengths that
    change then recompile nothing.
    """
    kv_fp8 = isinstance(k_cache, torch.Tensor) and k_cache.dtype.is_floating_point and k_cache.dtype.itemsize == 1
    if torch.compiler.is_compiling():  # one graph node, see compile/ops.py
        if kv_fp8 or k_descale is not None or v_descale is not None or kv_saturated is not None:
            raise NotImplementedError("An FP8 KV cache (k_descale / v_descale) is not supported under torch.compile "
                                      "yet; call flash_attn_with_kvcache eagerly.")
        if tree_mask is not None or tree_cu_seqlens is not None:
            raise NotImplementedError("tree_mask is not supported under torch.compile yet; call "
                                      "flash_attn_with_kvcache eagerly (a CUDA graph of the eager call works).")
        return TRACED["flash_attn_with_kvcache"](
            q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
            block_table, softmax_scale, causal, window_size, softcap, rotary_interleaved, alibi_slopes, num_splits,
            return_softmax_lse, sinks)
    if cache_leftpad is not None:
        if block_table is not None:
            raise NotImplementedError("cache_leftpad with a paged KV cache (block_table) is not supported (flash-attn "
                                      "refuses it too); use a dense cache, with cache_batch_idx to pick its rows.")
        cache_leftpad = resolve_cache_leftpad(cache_leftpad, q, k_cache, cache_seqlens)
    if cache_seqlens is None and (k is not None or v is not None):
        raise InputError("Expected cache_seqlens with new k and v: the append goes at each request's length "
                         "(flash-attn's rule); None means every cache is full.")
    if cache_batch_idx is not None:
        block_table = batch_idx_as_table(cache_batch_idx, block_table, q, k_cache)
    call = rotary = None
    if cache_seqlens is None or type(window_size) is not tuple or window_size != (-1, -1) or softcap or (
            alibi_slopes is not None or sinks is not None or rotary_cos is not None or rotary_sin is not None
            or kv_fp8 or k_descale is not None or v_descale is not None or kv_saturated is not None
            or tree_mask is not None or tree_cu_seqlens is not None):
        kv_fp8 = validate_kvcache_inputs(q, k_cache, v_cache, k, v, block_table is not None)
        capacity = k_cache.shape[1] * (1 if block_table is None else block_table.shape[1])
        cache_seqlens = capacity if cache_seqlens is None else cache_seqlens
        call = attention_call(q.shape[3], softmax_scale, causal, window_size, softcap, alibi_slopes, sinks,
                              seqlen_k=capacity, batch=q.shape[0], nheads=q.shape[2], device=q.device, kv_fp8=kv_fp8,
                              k_descale=k_descale, v_descale=v_descale, nheads_k=k_cache.shape[2],
                              kv_saturated=kv_saturated, tree_mask=tree_mask, tree_cu_seqlens=tree_cu_seqlens,
                              seqlen_q=q.shape[1])
        if tree_mask is not None:
            check_tree_call(tree_mask, causal, window_size, alibi_slopes,
                            rotary=rotary_cos is not None or rotary_sin is not None)
            if k is not None and k.shape[1] != q.shape[1]:
                raise InputError(f"Expected k / v with seqlen_q = {q.shape[1]} new tokens with tree_mask (the drafts "
                                 f"are the tokens being appended), got {k.shape[1]}.")
        if rotary_cos is not None or rotary_sin is not None:
            rotary = validate_rotary(q, k, v, rotary_cos, rotary_sin, capacity, rotary_interleaved)
    return kvcache_call(q, k_cache, v_cache, k, v, cache_seqlens, block_table, softmax_scale, causal, num_splits,
                        return_softmax_lse, validated=call is not None, cache_leftpad=cache_leftpad, call=call,
                        rotary=rotary)


def kvcache_call(q, k_cache, v_cache, k, v, cache_seqlens, block_table, softmax_scale, causal, num_splits,
                 return_softmax_lse, *, validated: bool, cache_leftpad: Optional[torch.Tensor] = None,
                 call: Optional[AttnCall] = None, rotary: Optional[Rotary] = None):
    """flash_attn_with_kvcache's body, shared with the cache classes. validated=True: the caller has run
    `validate_kvcache_inputs` on these tensors; cache_leftpad: None or `resolve_cache_leftpad`'s tensor;
    call: the call's `attention_call` (None: softmax_scale and causal alone, the translation's cached
    plain call; an FP8 cache needs the call built with kv_fp8 and its descales, else NotImplementedError);
    rotary: `validate_rotary`'s, applied to q and k once everything is validated. A call
    that repeats a validated one replays its launches (launch/replay.py); calls with left padding, rotary
    or per-call tensors (ALiBi slopes, sinks) never do: the replays carry no pointer for them."""
    try:
        sig = signature(q, k_cache, v_cache, k, v, block_table)
    except AttributeError:  # not tensors: validation names the problem
        sig = None
    key = None
    fast = not _INTERPRET and not recording_active()  # replays and skipped validation: compiled runs only
    if sig is not None and fast and cache_leftpad is None and rotary is None and (call is None or not call.tensors):
        try:  # a repeat of a validated call: replay its launches
            if call is None:
                call = plain_call(q.shape[-1], softmax_scale, causal)
            key = replay_key_of(sig, cache_seqlens, call.options, num_splits, return_softmax_lse)
            replay = REPLAYS.get(key) if key is not None else None
        except (TypeError, ValueError, IndexError, ArithmeticError):  # the full path names what is wrong
            key = replay = None
        if replay is not None:
            result = run_replay(replay, q, k_cache, v_cache, k, v, cache_seqlens, block_table, call.options)
            if result is not None:
                return result if return_softmax_lse else result[0]
    if not validated and (sig is None or not fast or sig not in VALIDATED_SIGNATURES):
        validate_kvcache_inputs(q, k_cache, v_cache, k, v, block_table is not None)
        if sig is not None and q.device.type == "cuda" and fast:
            if len(VALIDATED_SIGNATURES) >= 4096:  # shapes churn: start over rather than grow without bound
                VALIDATED_SIGNATURES.clear()
            VALIDATED_SIGNATURES.add(sig)
    validate_num_splits(num_splits)
    if call is None:  # not built by the replay attempt above
        call = plain_call(q.shape[3], softmax_scale, causal)
    options = call.options
    fp8 = k_cache.dtype.itemsize == 1
    if options.kv_fp8 != fp8:  # a caller that built no FP8 call (or one for a 16-bit cache)
        raise NotImplementedError(f"A {k_cache.dtype} KV cache needs a call built for it (attention_call with "
                                  f"kv_fp8={fp8} and its descales); got kv_fp8={options.kv_fp8}.")
    seqlen_new = k.shape[1] if k is not None else 0
    if block_table is None:
        seqlens, table = resolve_cache_seqlens(cache_seqlens, q.shape[0], seqlen_new, k_cache.shape[1], q.device), None
    else:
        seqlens, table = resolve_paging(block_table, cache_seqlens, q.shape[0], seqlen_new, k_cache, q.device,
                                        options.window_left, q.shape[1])
    if seqlens is not cache_seqlens or table is not block_table or q.device.type != "cuda":
        key = None  # lengths or table checked on the host or copied: not replayable
    if cache_leftpad is not None or rotary is not None:
        key = None
    if rotary is not None:  # everything is validated: the rotary launches may run
        q, k = rotate(q, k, seqlens, rotary, positional=options.causal or options.has_window)
    out, lse = launch_kvcache(q, k_cache, v_cache, k, v, seqlens, options, int(num_splits), return_softmax_lse, table,
                              sig, key, cache_leftpad, call.tensors)
    return (out, lse) if return_softmax_lse else out
