"""flash-attn's prefill functions: `flash_attn_func` (dense batches) and `flash_attn_varlen_func` (sequences
packed without padding, or over a paged K/V), with their autograd. Each validates every argument
(api/validate.py), translates flash-attn's arguments once (`args.attention_call`), and hands the
tensors, the options and the dropout to the launch layer (launch/prefill.py, launch/backward.py).
Under torch.compile each is one custom op (compile/ops.py, reached through `TRACED`).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..config.options import KV_FP8_DTYPES
from ..launch.backward import launch_backward, launch_varlen_backward
from ..launch.prefill import dropout_probs, launch_prefill, launch_varlen, launch_varlen_paged
from .args import AttnCall, attention_call
from .validate import validate_qkv, validate_varlen, validate_varlen_paged


# ============================================================================================
# Autograd
# ============================================================================================
def _sinks_grad(ctx, dsinks: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """dsinks in the sinks' own dtype, where they take a gradient."""
    return dsinks.to(ctx.sinks_dtype) if dsinks is not None and ctx.needs_input_grad[3] else None


def _wants_grad(*tensors: Optional[torch.Tensor]) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


# What the public functions call under torch.compile: the registered custom ops' callers, filled in by
# compile/ops.py when the package is imported (kept apart so that this module does not import it).
TRACED: dict = {}


class _FlashAttnFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, call: AttnCall, deterministic: bool):
        out, lse = launch_prefill(q, k, v, call.options, drop=call.drop, tensors=call.tensors)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.call, ctx.deterministic = call, deterministic
        ctx.sinks_dtype = sinks.dtype if sinks is not None else None
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        call = ctx.call
        dq, dk, dv, _, dsinks = launch_backward(dout, q, k, v, out, lse, call.options, drop=call.drop,
                                                tensors=call.tensors, deterministic=ctx.deterministic)
        return dq, dk, dv, _sinks_grad(ctx, dsinks), None, None


class _FlashAttnVarlenFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, call: AttnCall):
        out, lse = launch_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, call.options,
                                 drop=call.drop, tensors=call.tensors)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k)
        ctx.max_seqlen_q, ctx.max_seqlen_k = max_seqlen_q, max_seqlen_k
        ctx.call = call
        ctx.sinks_dtype = sinks.dtype if sinks is not None else None
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k = ctx.saved_tensors
        call = ctx.call
        dq, dk, dv, _, dsinks = launch_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                                                       ctx.max_seqlen_q, ctx.max_seqlen_k, call.options,
                                                       drop=call.drop, tensors=call.tensors)
        return dq, dk, dv, _sinks_grad(ctx, dsinks), None, None, None, None, None


# ============================================================================================
# Public function
# ============================================================================================
def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    return_softmax_lse: bool = False,
    sinks: Optional[torch.Tensor] = None,
    q_descale=None,
    k_descale=None,
    v_descale=None,
):
    """Attention softmax(q @ k^T * softmax_scale) @ v with flash-attn 2's signature.

    Args:
        q: (batch, seqlen_q, nheads, headdim), float16, bfloat16 or float32.
        k: (batch, seqlen_k, nheads_k, headdim), same dtype and device as q.
        v: (batch, seqlen_k, nheads_k, headdim).
            nheads must be a multiple of nheads_k: query head h uses KV head h // (nheads // nheads_k)
            (MHA: nheads_k == nheads, GQA: in between, MQA: nheads_k == 1). Any strides work as long
            as the last dim is contiguous (views of a fused QKV projection, transposed
            (batch, nheads, seqlen, headdim) tensors); no copies are made, except on Hopper of a
            tensor whose base or outer strides are not 16-byte multiples (tensor descriptors need
            them; a 2-byte headdim that is not a multiple of 8 is one), and then out is a view
            [..., :headdim] of an aligned buffer, as flash-attn's is.
            headdim: any in [1, 256] (the kernels pad the tile to a power of two and mask the rest).
        dropout_p: the probability, in [0, 1), of dropping each attention probability (the kept
            ones are scaled by 1 / (1 - dropout_p)); applied whenever > 0, as in flash-attn (pass 0.0
            in evaluation). The mask is drawn by a counter-based RNG seeded from torch's generator
            of q's device: `torch.manual_seed` reproduces it, and CUDA graphs capture it (each replay
            draws a fresh mask). The backward regenerates the same mask. The keep rate is 1 - dropout_p
            rounded to a multiple of 2^-16.
        softmax_scale: defaults to headdim ** -0.5.
        causal: mask aligned to the bottom-right corner: query i sees key j iff
            j <= i + seqlen_k - seqlen_q. For seqlen_q = 2, seqlen_k = 5 (1 = kept):
                1 1 1 1 0
                1 1 1 1 1
            and for seqlen_q = 5, seqlen_k = 2:
                0 0
                0 0
                0 0
                1 0
                1 1
            A row that sees no key (the first three above) outputs zeros, never NaN.
        window_size: (left, right), -1 for an unbounded side (a 2-element tensor works too): query i
            sees keys d - left <= j <= d + right, d = i + seqlen_k - seqlen_q (causal sets right to 0;
            (-1, 0) is causal). Key blocks outside the band are never loaded.
        softcap: > 0 caps the scaled scores: s -> softcap * tanh(s / softcap); <= 0 for none.
        alibi_slopes: None, or float32 (nheads,) or (batch, nheads): adds -slope * |d - j| to the
            scaled scores (ALiBi).
        deterministic: flash-attn's flag, for the backward. The backward uses no atomics (dK/dV of a
            KV head summed over its q-head group in registers, dQ in its own kernel): bit-identical run
            to run either way. Opted in on Hopper (TRITONATTN_SM90_BWD=1; head dim 128, no variants
            or dropout), the fused backward sums dQ by atomic adds: in any order by default, so dq's
            last bits vary run to run (dk and dv do not); in key-block order with True, bit-identical.
        return_attn_probs: flash-attn's testing aid: also return softmax_lse and S_dmask, None
            without dropout; with dropout (batch, nheads, seqlen_q, seqlen_k) in q's dtype, S_dmask[b,
            h, i, j] = exp(score_ij - max_j' score_ij') (scores scaled), negated where the pair was
            dropped, 0 where query i does not see key j (`tritonattn.launch.prefill.dropout_probs`). It costs an
            extra pass over the scores and one element of q's dtype per (query, key) pair per head: a
            test's tool.
        return_softmax_lse (keyword only): also return the log-sum-exp of each row.
        sinks (keyword only): None, or a floating (nheads,) tensor: a per-head logit that joins every
            row's softmax with no value (gpt-oss), so the row's probabilities sum to 1 - p_sink; the
            LSE includes it, and the backward returns its gradient. Formulas of every variant:
            `tritonattn.testing.attention_ref`.
        q_descale, k_descale, v_descale (keyword only, FlashAttention-3's): with q, k and v all in
            torch.float8_e4m3fn, the FP8 forward: float32 (batch, nheads_k) on q's device, or one number per
            tensor, all three required; the true q is q * q_descale[b, h // G] (k, v likewise). Both
            products run on the FP8 tensor cores with fp32 accumulation; the probabilities are quantized
            to e4m3 for P V per key block, as FlashAttention-3 does ([Note] FP8 forward in
            kernels/tritonattn/jit/common.py); out is bfloat16. sm_89 (Ada) or newer, head dim > 16,
            forward only (inputs that require grad, and dropout, are refused), not under torch.compile.

    Returns:
        out: (batch, seqlen_q, nheads, headdim), dtype of q (bfloat16 for the FP8 forward);
            (out, softmax_lse, S_dmask) with return_attn_probs, (out, softmax_lse) with return_softmax_lse.
        softmax_lse: (batch, nheads, seqlen_q) float32, natural log of the sum of exp(scaled
            scores) of each row; +inf for a row that sees no key, so that exp(score - lse) is 0 there.

    Precision: fp16/bf16 inputs are multiplied on tensor cores with fp32 accumulation. fp32 inputs
    use tf32 matmuls on GPUs (about 1e-3 relative error) and exact fp32 under the interpreter.
    """
    if torch.compiler.is_compiling():  # one graph node, see compile/ops.py
        refuse_fp8_compiled(q, q_descale, k_descale, v_descale)
        return TRACED["flash_attn_func"](q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                                         alibi_slopes, return_attn_probs, return_softmax_lse, sinks,
                                         deterministic)
    fp8 = validate_qkv(q, k, v, fp8_ok=True)
    call = attention_call(q.shape[3], softmax_scale, causal, window_size, softcap, alibi_slopes, sinks, None,
                          fp8_dropout(fp8, dropout_p), seqlen_k=k.shape[1], batch=q.shape[0], nheads=q.shape[2],
                          device=q.device, kv_fp8=fp8, q_fp8=fp8, nheads_k=k.shape[2], q_descale=q_descale,
                          k_descale=k_descale, v_descale=v_descale)
    if _wants_grad(q, k, v, sinks):
        out, lse = _FlashAttnFunc.apply(q, k, v, sinks, call, bool(deterministic))
    else:
        out, lse = launch_prefill(q, k, v, call.options, drop=call.drop, tensors=call.tensors)
    probs = None
    if return_attn_probs and call.drop is not None:
        probs = dropout_probs(q, k, call.options, call.drop, tensors=call.tensors)
    return results(out, lse, probs, return_attn_probs, return_softmax_lse)


def refuse_fp8_compiled(q, *descales) -> None:
    """The FP8 forward is not a traced op yet: refuse it under torch.compile."""
    if (isinstance(q, torch.Tensor) and q.dtype in KV_FP8_DTYPES) or any(d is not None for d in descales):
        raise NotImplementedError("The FP8 forward (e4m3 q, k, v with q_descale / k_descale / v_descale) is not "
                                  "supported under torch.compile yet; call it eagerly.")


def fp8_dropout(fp8: bool, dropout_p):
    """dropout_p, refused (any value but 0) for the FP8 forward: dropout is a training option."""
    if fp8 and not (type(dropout_p) in (int, float) and dropout_p == 0):
        raise NotImplementedError(f"The FP8 forward is for inference: dropout_p must be 0, got {dropout_p!r}.")
    return dropout_p


def results(out, lse, probs, return_attn_probs: bool, return_softmax_lse: bool):
    """flash-attn's return convention ((out, softmax_lse, S_dmask) with return_attn_probs), then ours."""
    if return_attn_probs:
        return out, lse, probs
    return (out, lse) if return_softmax_lse else out


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table: Optional[torch.Tensor] = None,
    *,
    return_softmax_lse: bool = False,
    sinks: Optional[torch.Tensor] = None,
    seqused_k: Optional[torch.Tensor] = None,
    q_descale=None,
    k_descale=None,
    v_descale=None,
):
    """Attention over a batch of sequences of different lengths packed without padding (flash-attn's
    varlen interface). Sequence b's queries attend only to sequence b's keys.

    Args:
        q: (total_q, nheads, headdim), float16, bfloat16 or float32: the queries of every sequence
            concatenated along dim 0; sequence b owns rows [cu_seqlens_q[b], cu_seqlens_q[b + 1]).
        k: (total_k, nheads_k, headdim), same dtype and device as q; rows of sequence b are
            [cu_seqlens_k[b], cu_seqlens_k[b + 1]).
        v: (total_k, nheads_k, headdim).
            Heads, head dims and strides as in flash_attn_func: nheads a multiple of nheads_k
            (MHA/GQA/MQA), any headdim in [1, 256], any strides with a contiguous last
            dim (e.g. slices of a packed (total, nheads + 2 * nheads_k, headdim) QKV buffer).
        cu_seqlens_q: (batch + 1,) torch.int32 on q's device: prefix sums of the query lengths,
            cu_seqlens_q[0] == 0, non-decreasing, cu_seqlens_q[-1] == total_q. For lengths [3, 0, 5]:
            tensor([0, 3, 3, 8], dtype=torch.int32). Lengths 0 and 1 are allowed.
        cu_seqlens_k: (batch + 1,) torch.int32, the same for the keys; cu_seqlens_k[-1] == total_k.
            The key length of a sequence may differ from its query length (a prompt continuing a
            cached prefix) and may be 0.
        max_seqlen_q: Python int >= the longest query length: sizes the grid (programs of blocks
            past a shorter sequence's end exit at once; no work is spent on padding).
        max_seqlen_k: Python int >= the longest key length.
        dropout_p: as in flash_attn_func.
        softmax_scale: defaults to headdim ** -0.5.
        causal: per sequence, aligned to the bottom-right corner: query i of sequence b sees key j
            iff j <= i + seqlen_k[b] - seqlen_q[b]. For seqlen_q[b] = 2, seqlen_k[b] = 5 (1 = kept):
                1 1 1 1 0
                1 1 1 1 1
            A row that sees no key (seqlen_q[b] > seqlen_k[b], or seqlen_k[b] == 0) outputs zeros.
        window_size, softcap, alibi_slopes: as in flash_attn_func (a window side reaching past
            max_seqlen_k is unbounded, as in flash-attn).
        deterministic: flash-attn's flag. Packed sequences' backward is atomic-free whatever its
            value: gradients are bit-identical run to run.
        return_attn_probs: as in flash_attn_func; S_dmask is (batch, nheads, max_seqlen_q,
            max_seqlen_k), sequence b's pairs at [b, :, :seqlen_q[b], :seqlen_k[b]], zeros elsewhere.
        block_table: optional int32 (batch, max_blocks_per_seq) on q's device: k and v are then
            paged pools (num_blocks, page_size, nheads_k, headdim) and sequence b's keys are the
            first cu_seqlens_k[b + 1] - cu_seqlens_k[b] logical rows of block_table[b] (logical row j
            in row j % page_size of block block_table[b, j // page_size]), as in flash-attn. Forward
            only (its backward raises NotImplementedError; flash-attn has none either), no dropout.
            Any page_size >= 1 (flash-attn asks for multiples of 256). With CPU cu_seqlens (the
            interpreter's case) the lengths and the entries they use are checked; on a GPU they are
            trusted and each entry is clamped into the pool (wrong results, never an out-of-bounds
            read), as in flash_attn_with_kvcache.
        return_softmax_lse (keyword only): also return the log-sum-exp of each row.
        sinks (keyword only): as in flash_attn_func.
        seqused_k (keyword only): optional int32 (batch,) on q's device: sequence b attends to the
            first seqused_k[b] keys of its cu_seqlens_k span only (the rest are never read; their dk,
            dv are zero), and causal alignment counts those keys: N_b = seqused_k[b]. flash-attn's
            varlen argument (its primitives and FlashAttention-3 take it). CPU values are checked
            against cu_seqlens_k; on a GPU each is clamped into [0, the span].
        q_descale, k_descale, v_descale (keyword only): the FP8 forward as in flash_attn_func, with
            (batch, nheads_k) descales, batch the number of sequences; not with block_table.

    Returns:
        out: (total_q, nheads, headdim), dtype of q (bfloat16 for the FP8 forward), packed like q; with
            softmax_lse (and S_dmask) as in flash_attn_func.
        softmax_lse: (nheads, total_q) float32, flash-attn's packed varlen
            layout: softmax_lse[h, cu_seqlens_q[b] + i] is the natural-log LSE of query i of
            sequence b at head h (not (batch, nheads, max_seqlen_q) as in flash_attn_func); +inf for
            a row that sees no key.

    Validation (before any launch): ranks, dtypes, devices, head counts and head dim of q/k/v;
    cu_seqlens_q/k of dtype int32, 1-D, the same (batch + 1,) shape, on q's device; max_seqlen_q/k
    ints >= 0. Checking the *values* of cu_seqlens needs them on the host: CPU cu_seqlens (the
    interpreter's case) are checked in full (starts at 0, non-decreasing, ends at total_q /
    total_k, no sequence longer than max_seqlen_q / max_seqlen_k). CUDA cu_seqlens are not read,
    since that would cost a device sync on every call: their values and the max_seqlen bounds are
    trusted, as in flash-attn, and wrong values give wrong results or out-of-bounds accesses.

    Precision as in flash_attn_func. The kernels are flash_attn_func's (IS_VARLEN=True) with the same
    tile arithmetic, so a sequence gives the same result packed as alone (bit-identical under the
    interpreter; on a GPU the two compiled variants may differ in rounding).
    """
    if torch.compiler.is_compiling():  # one graph node, see compile/ops.py
        refuse_fp8_compiled(q, q_descale, k_descale, v_descale)
        return TRACED["flash_attn_varlen_func"](q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                                dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                                                return_attn_probs, block_table, return_softmax_lse, sinks, seqused_k)
    if block_table is not None:
        if q_descale is not None or k_descale is not None or v_descale is not None:
            raise NotImplementedError("The FP8 forward (q_descale / k_descale / v_descale) does not take a paged K/V "
                                      "(block_table); flash_attn_with_kvcache reads an FP8 paged cache.")
        return varlen_paged(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                            causal, window_size, softcap, alibi_slopes, return_attn_probs, block_table,
                            return_softmax_lse, sinks, seqused_k)
    max_seqlen_q, max_seqlen_k = validate_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                                 seqused_k=seqused_k, fp8_ok=True)
    fp8 = q.dtype in KV_FP8_DTYPES  # validate_varlen checked the three and the card
    call = attention_call(q.shape[2], softmax_scale, causal, window_size, softcap, alibi_slopes, sinks, seqused_k,
                          fp8_dropout(fp8, dropout_p), seqlen_k=max_seqlen_k, batch=cu_seqlens_q.numel() - 1,
                          nheads=q.shape[1], device=q.device, kv_fp8=fp8, q_fp8=fp8, nheads_k=k.shape[1],
                          q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)
    cu_seqlens_q, cu_seqlens_k = cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous()
    lengths = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    if _wants_grad(q, k, v, sinks):
        out, lse = _FlashAttnVarlenFunc.apply(q, k, v, sinks, *lengths, call)
    else:
        out, lse = launch_varlen(q, k, v, *lengths, call.options, drop=call.drop, tensors=call.tensors)
    probs = None
    if return_attn_probs and call.drop is not None:
        probs = dropout_probs(q, k, call.options, call.drop, lengths, call.tensors)
    return results(out, lse, probs, return_attn_probs, return_softmax_lse)


def varlen_paged(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                 causal, window_size, softcap, alibi_slopes, return_attn_probs, block_table, return_softmax_lse, sinks,
                 seqused_k=None):
    """flash_attn_varlen_func with block_table: forward only (see its docstring)."""
    max_seqlen_q, max_seqlen_k, block_table = validate_varlen_paged(
        q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table, dropout_p, seqused_k)
    call = attention_call(q.shape[2], softmax_scale, causal, window_size, softcap, alibi_slopes, sinks, seqused_k,
                          seqlen_k=max_seqlen_k, batch=cu_seqlens_q.numel() - 1, nheads=q.shape[1], device=q.device)
    args = (q, k_cache, v_cache, cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous(), max_seqlen_q, block_table,
            call.options, call.tensors)
    if torch.is_grad_enabled() and (q.requires_grad or k_cache.requires_grad or v_cache.requires_grad):
        out, lse = _FlashAttnVarlenPagedFunc.apply(*args)
    else:
        out, lse = launch_varlen_paged(*args)
    return results(out, lse, None, return_attn_probs, return_softmax_lse)


PAGED_VARLEN_NO_BACKWARD = ("flash_attn_varlen_func with block_table (a paged K/V) is forward only, as in flash-attn: "
                            "no gradient flows through it.")


class _FlashAttnVarlenPagedFunc(torch.autograd.Function):
    """The paged varlen forward under autograd: its backward says it does not exist (flash-attn has none)."""

    @staticmethod
    def forward(ctx, q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, block_table, options, tensors):
        out, lse = launch_varlen_paged(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, block_table,
                                       options, tensors)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        raise NotImplementedError(PAGED_VARLEN_NO_BACKWARD)
