"""Eager PyTorch references, used by tests, notebooks and benchmarks.

Deliberately simple: upcast, materialise the [M, N] scores, mask explicitly with the same
bottom-right causal convention as the kernels, expand GQA heads with repeat_interleave, and give
zeros (LSE +inf) for rows that see no key.

`attention_sdpa` runs torch's scaled_dot_product_attention on the same (batch, seqlen, heads, headdim)
layout: a second, independent reference where its top-left causal convention agrees with ours.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch


def causal_mask(seqlen_q: int, seqlen_k: int, device=None) -> torch.Tensor:
    """Bool [seqlen_q, seqlen_k], True where query i may see key j: j <= i + seqlen_k - seqlen_q."""
    return window_mask(seqlen_q, seqlen_k, causal=True, device=device)


def window_mask(seqlen_q: int, seqlen_k: int, window_size: Tuple[int, int] = (-1, -1), causal: bool = False,
                device=None) -> torch.Tensor:
    """Bool [seqlen_q, seqlen_k], True where query i sees key j under a sliding window: with d_i = i +
    seqlen_k - seqlen_q (bottom-right aligned), d_i - left <= j <= d_i + right, -1 unbounded on that side;
    causal makes right 0. The mask attention_ref applies (before key padding)."""
    left, right = (int(x) for x in window_size)
    right = 0 if causal else right
    rows = torch.arange(seqlen_q, device=device)[:, None] + (seqlen_k - seqlen_q)  # d_i
    cols = torch.arange(seqlen_k, device=device)[None, :]
    visible = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if right >= 0:
        visible = visible & (cols <= rows + right)
    if left >= 0:
        visible = visible & (cols >= rows - left)
    return visible


def attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    key_padding_lengths: Optional[torch.Tensor] = None,
    key_leftpad: Optional[torch.Tensor] = None,
    dropout_mask: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    sinks: Optional[torch.Tensor] = None,
    upcast: bool = True,
    attn_mask: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Reference attention over (batch, seqlen, heads, headdim) tensors; returns (out, lse).

    upcast=True computes in float32 (float64 if the inputs are float64) and returns out in q's
    dtype: the ground truth. upcast=False computes in the input dtype: PyTorch's own same-precision
    error, the yardstick for the kernels' error (flash-attn's test rule).
    key_padding_lengths (batch,): keys at or past each batch entry's length are masked (decode).
    key_leftpad (batch,): keys before each batch entry's start are masked too (flash_attn_with_kvcache's
    cache_leftpad, its keys rows [key_leftpad[b], seqlen_k) of k); the causal diagonal does not move:
    query t of batch entry b sees key j iff key_leftpad[b] <= j <= t + seqlen_k - seqlen_q.
    attn_mask (batch, seqlen_q, seqlen_k) bool, True = seen: ANDed with the masks above (a verify step's tree
    mask, materialised over all keys).
    dropout_mask (batch, heads, seqlen_q, seqlen_k) bool, True = kept: the probabilities are masked and
    the kept ones scaled by 1 / (1 - dropout_p) before the product with v (the lse is not affected).

    The variants, in the order they apply to the scaled scores s[i, j] = q_i . k_j * softmax_scale, with
    d_i = i + seqlen_k - seqlen_q query i's bottom-right aligned position:
    softcap c > 0: s = c * tanh(s / c) (Gemma-2's logit softcap);
    alibi_slopes fp32 (heads,) or (batch, heads): s -= slope * |d_i - j| (ALiBi);
    window_size (left, right), -1 unbounded: query i sees keys d_i - left <= j <= d_i + right (causal
    makes right 0; (-1, -1) and causal is plain causal);
    sinks fp32 (heads,) (gpt-oss's learnable logit, not scaled): each row's softmax gains a column of
    value sinks[h] that takes part in the row max and the denominator and multiplies no value, so the
    row's probabilities sum to less than 1, a row that sees no key outputs zeros, and the lse includes
    it (logsumexp over the keys and the sink: sinks[h] for a row that sees no key).
    lse is (batch, heads, seqlen_q) float32, +inf for rows that see no key (without sinks).
    """
    dtype = q.dtype
    if upcast:
        work = torch.float64 if dtype == torch.float64 else torch.float32
        q, k, v = q.to(work), k.to(work), v.to(work)
    batch, seqlen_q, nheads, head_dim = q.shape
    seqlen_k, nheads_k = k.shape[1], k.shape[2]
    scale = head_dim**-0.5 if softmax_scale is None else softmax_scale
    group = nheads // nheads_k
    k = k.repeat_interleave(group, dim=2)
    v = v.repeat_interleave(group, dim=2)
    scores = torch.einsum("bmhd,bnhd->bhmn", q * scale, k)
    if softcap > 0.0:
        scores = softcap * torch.tanh(scores / softcap)
    rows = torch.arange(seqlen_q, device=q.device)[:, None] + (seqlen_k - seqlen_q)  # d_i
    cols = torch.arange(seqlen_k, device=q.device)[None, :]
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(device=q.device, dtype=scores.dtype).reshape(-1, nheads, 1, 1)
        scores = scores - slopes * (rows - cols).abs().to(scores.dtype)
    visible = window_mask(seqlen_q, seqlen_k, window_size, causal, q.device)
    visible = visible[None, None].expand(batch, 1, seqlen_q, seqlen_k)
    if key_padding_lengths is not None:
        lengths = key_padding_lengths.to(q.device).view(batch, 1, 1, 1)
        visible = visible & (torch.arange(seqlen_k, device=q.device).view(1, 1, 1, -1) < lengths)
    if key_leftpad is not None:
        starts = key_leftpad.to(q.device).view(batch, 1, 1, 1)
        visible = visible & (torch.arange(seqlen_k, device=q.device).view(1, 1, 1, -1) >= starts)
    if attn_mask is not None:
        visible = visible & attn_mask.to(q.device)[:, None]
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is not None:  # one more column per row: the sink's logit, which weighs no value
        sink = sinks.to(device=q.device, dtype=scores.dtype).view(1, nheads, 1, 1).expand(batch, nheads, seqlen_q, 1)
        with_sink = torch.cat([scores, sink], dim=-1)
        lse = torch.logsumexp(with_sink.float(), dim=-1)
        probs = torch.softmax(with_sink, dim=-1)[..., :-1]
        empty = torch.zeros(batch, 1, seqlen_q, dtype=torch.bool, device=q.device)  # the sink is always seen
    else:
        lse = torch.logsumexp(scores.float(), dim=-1)  # (b, h, m), -inf for empty rows
        empty = ~visible.any(dim=-1)  # (b, 1, m)
        probs = torch.softmax(scores, dim=-1).masked_fill(empty[..., None], 0.0)
    if dropout_mask is not None:
        probs = probs.masked_fill(~dropout_mask, 0.0) / (1.0 - dropout_p)
    out = torch.einsum("bhmn,bnhd->bmhd", probs, v)
    lse = lse.masked_fill(empty.expand_as(lse), float("inf"))
    return out.to(dtype), lse


def attention_padded_keys_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_n: int,
    *,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """What a kernel WITHOUT the key-length mask would compute: a teaching foil, never a reference.

    A FlashAttention kernel streams keys in tiles of `block_n`. When seqlen_k is not a multiple of
    block_n, the last tile's loads are bounds-checked (out-of-range rows read as zero) but, if its
    scores were not masked, those zero keys would get score q . 0 = 0 and enter the softmax: each
    adds exp(0 - max) to the denominator (and zero to the numerator, as their values are zero too),
    so every row is shrunk. This emulates that bug in float32 by padding K and V with zero rows up
    to a multiple of block_n. The causal mask, when asked for, is the correct one of the real
    lengths (query i sees key j iff j <= i + seqlen_k - seqlen_q), which hides the padded keys by
    itself: the unmasked tail hurts non-causal attention (and any kernel whose causal test is
    skipped on the tail). Returns (out in q's dtype, lse float32 (batch, heads, seqlen_q)).
    """
    if block_n < 1:
        raise ValueError(f"Expected block_n >= 1, got {block_n}.")
    dtype = q.dtype
    q, k, v = q.float(), k.float(), v.float()
    batch, seqlen_q, nheads, head_dim = q.shape
    seqlen_k, nheads_k = k.shape[1], k.shape[2]
    padded_k = -(-seqlen_k // block_n) * block_n
    zeros = k.new_zeros(batch, padded_k - seqlen_k, nheads_k, head_dim)
    k, v = torch.cat([k, zeros], dim=1), torch.cat([v, zeros], dim=1)
    scale = head_dim**-0.5 if softmax_scale is None else softmax_scale
    group = nheads // nheads_k
    k = k.repeat_interleave(group, dim=2)
    v = v.repeat_interleave(group, dim=2)
    scores = torch.einsum("bmhd,bnhd->bhmn", q * scale, k)  # (b, h, m, padded_k)
    visible = torch.ones(seqlen_q, padded_k, dtype=torch.bool, device=q.device)
    if causal:
        visible[:, :seqlen_k] = causal_mask(seqlen_q, seqlen_k, q.device)
        visible[:, seqlen_k:] = False  # j >= seqlen_k > i + seqlen_k - seqlen_q for every row i
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    empty = ~visible.any(dim=-1)  # (m,)
    probs = torch.softmax(scores, dim=-1).masked_fill(empty[:, None], 0.0)
    out = torch.einsum("bhmn,bnhd->bmhd", probs, v)
    lse = lse.masked_fill(empty, float("inf"))
    return out.to(dtype), lse


def quantize_e4m3_ref(x: torch.Tensor, descale) -> torch.Tensor:
    """x (batch, seqlen, nheads_k, headdim) as a float8_e4m3fn cache holds it, the way the kernels' append
    quantizes (bit for bit): (x / descale) in float32, clamped to +-448, rounded to nearest even. descale:
    a number or a (batch, nheads_k) tensor (FlashAttention-3's k_descale / v_descale)."""
    return (x.float() / _descale_view(descale, x)).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)


def dequantize_ref(x8: torch.Tensor, descale, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The values an FP8 cache x8 (batch, seqlen, nheads_k, headdim) stands for, x8 * descale in float32
    (exact: an e4m3 value times a float32 descale), returned in `dtype`. Run `attention_ref` on the
    dequantized K and V: the reference that quantizes exactly as the kernels do."""
    return (x8.float() * _descale_view(descale, x8)).to(dtype)


def attention_fp8_ref(q8: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor, q_descale, k_descale, v_descale, *,
                      block_n: int, causal: bool = False, window_size: Tuple[int, int] = (-1, -1),
                      softmax_scale: Optional[float] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """The FP8 forward as the kernel computes it, in float32 PyTorch: (out (batch, seqlen_q, nheads, headdim)
    float32, lse (batch, nheads, seqlen_q)). q8, k8, v8: float8_e4m3fn (batch, seqlen, heads, headdim), GQA by
    h // G; descales: numbers or float32 (batch, nheads_k). The scores are the e4m3 products (exact in
    float32), scaled by softmax_scale * (k_descale * q_descale) * log2(e); the keys are visited in blocks of
    block_n from key 0 with the kernel's online softmax (running max, exp2), each block's probabilities
    quantized to e4m3 (round to nearest even) for P V while the row sum adds them unquantized; the output is
    divided by the sum and times v_descale ([Note] FP8 forward, kernels/tritonattn/jit/common.py)."""
    batch, seqlen_q, nheads, head_dim = q8.shape
    seqlen_k, nheads_k = k8.shape[1], k8.shape[2]
    group = nheads // nheads_k
    scale = torch.tensor(head_dim ** -0.5 if softmax_scale is None else softmax_scale, dtype=torch.float32)
    log2e = torch.tensor(1.4426950408889634, dtype=torch.float32)

    def per_head(d):
        d = torch.as_tensor(d, dtype=torch.float32).cpu()
        return d.reshape(1, 1).expand(batch, nheads_k) if d.numel() == 1 else d

    qd, kd, vd = per_head(q_descale), per_head(k_descale), per_head(v_descale)
    visible = window_mask(seqlen_q, seqlen_k, window_size, causal)
    out = torch.zeros(batch, seqlen_q, nheads, head_dim, dtype=torch.float32)
    lse = torch.full((batch, nheads, seqlen_q), float("inf"), dtype=torch.float32)
    for b in range(batch):
        for h in range(nheads):
            hk = h // group
            qk_scale = (scale * (kd[b, hk] * qd[b, hk])) * log2e
            s = q8[b, :, h].float().cpu() @ k8[b, :, hk].float().cpu().T  # [M, N]
            v = v8[b, :, hk].float().cpu()
            m_i = torch.full((seqlen_q,), float("-inf"))
            l_i = torch.zeros(seqlen_q)
            acc = torch.zeros(seqlen_q, head_dim)
            for start in range(0, seqlen_k, block_n):
                qk = s[:, start: start + block_n].masked_fill(~visible[:, start: start + block_n], float("-inf"))
                m_new = torch.maximum(m_i, qk.max(dim=1).values * qk_scale)
                m_safe = torch.where(m_new == float("-inf"), torch.zeros_like(m_new), m_new)
                p = torch.exp2(qk * qk_scale - m_safe[:, None])
                alpha = torch.exp2(m_i - m_safe)
                l_i = l_i * alpha + p.sum(dim=1)
                acc = acc * alpha[:, None] + p.to(torch.float8_e4m3fn).float() @ v[start: start + block_n]
                m_i = m_new
            empty = l_i == 0
            l_safe = torch.where(empty, torch.ones_like(l_i), l_i)
            out[b, :, h] = acc / l_safe[:, None] * vd[b, hk]
            lse[b, h] = torch.where(empty, float("inf"), (m_i + torch.log2(l_safe)) * math.log(2.0))
    return out.to(q8.device), lse.to(q8.device)


def _descale_view(descale, x: torch.Tensor):
    if isinstance(descale, torch.Tensor):
        descale = descale.float().to(x.device)
        return descale.reshape(()) if descale.numel() == 1 else descale[:, None, :, None]
    return torch.tensor(float(descale), dtype=torch.float32, device=x.device)


def rotary_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions, *, interleaved: bool,
               same_position: bool = False) -> torch.Tensor:
    """Rotary embedding of x (batch, seqlen, nheads, headdim), token t of batch entry b at position
    positions[b] + t (positions[b] for all with same_position); cos / sin (seqlen_ro, rotary_dim / 2).
    GPT-NeoX pairs (interleaved=False): dims i and i + rotary_dim / 2; GPT-J (True): dims 2i, 2i + 1.
    Computed in float32, returned in x's dtype; dims past rotary_dim unchanged."""
    batch, seqlen = x.shape[:2]
    half = cos.shape[1]
    start = torch.as_tensor(positions, device=x.device).long().view(batch, 1)
    pos = start.expand(batch, seqlen) if same_position else start + torch.arange(seqlen, device=x.device)
    c, s = cos.float()[pos][:, :, None, :], sin.float()[pos][:, :, None, :]  # (batch, seqlen, 1, half)
    xf = x.float()
    if interleaved:
        a, b = xf[..., 0 : 2 * half : 2], xf[..., 1 : 2 * half : 2]
        rotated = torch.stack((a * c - b * s, b * c + a * s), -1).flatten(-2)
    else:
        a, b = xf[..., :half], xf[..., half : 2 * half]
        rotated = torch.cat((a * c - b * s, b * c + a * s), -1)
    return torch.cat((rotated, xf[..., 2 * half :]), -1).to(x.dtype)


_SDPA_GQA: dict = {}


def sdpa_supports_enable_gqa() -> bool:
    """True when this torch's scaled_dot_product_attention takes enable_gqa=True (torch >= 2.5); cached."""
    if "ok" not in _SDPA_GQA:
        q, kv = torch.zeros(1, 2, 1, 8), torch.zeros(1, 1, 1, 8)
        try:
            torch.nn.functional.scaled_dot_product_attention(q, kv, kv, enable_gqa=True)
            _SDPA_GQA["ok"] = True
        except (TypeError, RuntimeError):
            _SDPA_GQA["ok"] = False
    return _SDPA_GQA["ok"]


def attention_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
) -> torch.Tensor:
    """torch's scaled_dot_product_attention on our (batch, seqlen, heads, headdim) tensors.

    Computes in the inputs' dtype (pass float32 tensors for an fp32 result) and returns (b, s, h, d).
    GQA/MQA go through enable_gqa=True where this torch has it, else K/V are expanded with
    repeat_interleave. SDPA's is_causal is aligned to the top-left corner, ours to the bottom-right:
    the two agree only when seqlen_q == seqlen_k, so causal with seqlen_q != seqlen_k raises ValueError.
    """
    seqlen_q, nheads = q.shape[1], q.shape[2]
    seqlen_k, nheads_k = k.shape[1], k.shape[2]
    if causal and seqlen_q != seqlen_k:
        raise ValueError(
            f"SDPA's causal mask is aligned top-left and ours bottom-right; they agree only when seqlen_q == "
            f"seqlen_k, got seqlen_q={seqlen_q}, seqlen_k={seqlen_k}. Use attention_ref instead."
        )
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    if nheads != nheads_k:
        if sdpa_supports_enable_gqa():
            out = sdpa(qt, kt, vt, is_causal=causal, scale=softmax_scale, enable_gqa=True)
            return out.transpose(1, 2)
        group = nheads // nheads_k
        kt, vt = kt.repeat_interleave(group, dim=1), vt.repeat_interleave(group, dim=1)
    return sdpa(qt, kt, vt, is_causal=causal, scale=softmax_scale).transpose(1, 2)
