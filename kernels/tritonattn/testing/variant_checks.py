"""Check tables of the attention variants (sliding window, softcap, ALiBi, sinks, and all four together):
the kernels against the fp32 eager reference, each row judged by the error rule of `tolerance`.

- `VARIANTS`, `variant_kwargs`, `alibi_slopes`: the variants as flash_attn keywords.
- `prefill_check_table`: `flash_attn_func` with each variant, forward and every gradient (dsinks included).
- `decode_check_table`: `flash_attn_with_kvcache` with each variant, one token appended per request over a
  ragged batch, dense and paged (pages shuffled in the pool), unsplit and split-KV.

Each table is a list of rows (dicts of plain values) with an `ok` column: `checks.assert_table_ok(rows, what)`
asserts them, `pandas.DataFrame(rows)` shows them.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import torch

from ..api.kvcache import flash_attn_with_kvcache
from ..api.prefill import flash_attn_func
from ..config.hardware import default_device
from .checks import generator, randn
from .reference import attention_ref
from .requests import per_request_references
from .tolerance import check_close, check_dsinks, check_lse

__all__ = ["VARIANTS", "alibi_slopes", "variant_kwargs", "prefill_check_table", "decode_check_table", "worst"]

VARIANTS = ("causal", "window", "softcap", "alibi", "sinks", "all")


def alibi_slopes(nheads: int, device=None) -> torch.Tensor:
    """ALiBi's geometric slopes 2^(-8 (h + 1) / nheads), h = 0..nheads - 1 (Press et al.), float32."""
    return torch.tensor([2 ** (-8 * (h + 1) / nheads) for h in range(nheads)], dtype=torch.float32, device=device)


def variant_kwargs(name: str, *, nheads: int, window: int, softcap: float, device=None,
                   sinks_grad: bool = False, gen: Optional[torch.Generator] = None) -> Dict[str, Any]:
    """flash_attn keywords of variant `name` (one of VARIANTS), always causal: "window" is a window of
    `window` keys (the query's own and window - 1 before it: window_size=(window - 1, 0)), "softcap" caps the
    scores at `softcap`, "alibi" adds ALiBi's bias with `alibi_slopes(nheads)`, "sinks" adds N(0, 1) float32
    sink logits drawn from `gen` (torch's global generator when None; a leaf that requires grad when
    sinks_grad), "all" all four."""
    if name not in VARIANTS:
        raise ValueError(f"Expected a variant in {VARIANTS}, got {name!r}.")
    if int(window) != window or window < 1:
        raise ValueError(f"Expected window to be a positive number of keys, got {window!r}.")
    sinks = torch.randn(nheads, device=device, generator=gen, dtype=torch.float32)
    parts = {
        "window": dict(window_size=(int(window) - 1, 0)),
        "softcap": dict(softcap=float(softcap)),
        "alibi": dict(alibi_slopes=alibi_slopes(nheads, device)),
        "sinks": dict(sinks=sinks.requires_grad_(sinks_grad)),
    }
    if name == "causal":
        chosen: Dict[str, Any] = {}
    elif name == "all":
        chosen = {key: value for part in parts.values() for key, value in part.items()}
    else:
        chosen = parts[name]
    return dict(causal=True, **chosen)


def _device(device) -> torch.device:
    return torch.device(device) if device is not None else default_device()


def prefill_check_table(*, batch: int, seqlen: int, nheads: int, nheads_k: int, head_dim: int, dtype: torch.dtype,
                        window: int, softcap: float, device=None, seed: int = 0,
                        variants: Sequence[str] = VARIANTS) -> List[Dict[str, Any]]:
    """`flash_attn_func` with each variant (see `variant_kwargs`) on fresh seeded inputs (batch, seqlen,
    nheads / nheads_k, head_dim), forward and backward, against the fp32 reference.

    Outputs are judged like the tests: err <= 2x PyTorch's own same-dtype error + a floor; gradients with
    the wider factor; the LSE within `lse_tolerance`; dsinks by `check_dsinks` (against the float64 sum over
    the O and LSE the forward returned, and against the reference). One row per variant: variant, out_err,
    out_bound, lse_diff, dq_err, dq_bound, dk_err, dk_bound, dv_err, dv_bound, with sinks also dsinks_err
    and dsinks_bound, and ok. device None: `default_device()`."""
    device = _device(device)
    gen = generator(device, seed)
    rows = []
    for name in variants:
        q = randn((batch, seqlen, nheads, head_dim), dtype, device, gen)
        k, v = (randn((batch, seqlen, nheads_k, head_dim), dtype, device, gen) for _ in range(2))
        dout = randn((batch, seqlen, nheads, head_dim), dtype, device, gen)
        kw = variant_kwargs(name, nheads=nheads, window=window, softcap=softcap, device=device, sinks_grad=True,
                            gen=gen)
        sinks = [kw["sinks"]] if "sinks" in kw else []
        leaves = [t.requires_grad_() for t in (q, k, v)] + sinks
        out, lse = flash_attn_func(q, k, v, return_softmax_lse=True, **kw)
        grads = torch.autograd.grad(out, leaves, dout)
        # the ground truth and its gradients stay in float32: fp32 leaves of their own, never rounded to dtype
        leaves32 = [t.detach().float().requires_grad_() for t in (q, k, v)] + sinks
        ref, lse_ref = attention_ref(*leaves32[:3], **kw)
        ref_grads = torch.autograd.grad(ref, leaves32, dout.float())
        same, _ = attention_ref(q, k, v, upcast=False, **kw)  # the sinks and slopes enter in q's dtype
        same_grads = torch.autograd.grad(same, leaves, dout)
        ok, err, bound = check_close(out, ref, same)
        lse_ok, lse_diff = check_lse(lse, lse_ref, dtype)
        row: Dict[str, Any] = {"variant": name, "out_err": err, "out_bound": bound, "lse_diff": lse_diff}
        all_ok = ok and lse_ok
        for label, g, g_ref, g_same in zip(("dq", "dk", "dv", "dsinks"), grads, ref_grads, same_grads):
            if label == "dsinks":
                g_ok, g_err, g_bound, _ = check_dsinks(g, g_ref, g_same, out, lse, dout, kw["sinks"], dtype)
            else:
                g_ok, g_err, g_bound = check_close(g, g_ref, g_same, grad=True)
            row.update({f"{label}_err": g_err, f"{label}_bound": g_bound})
            all_ok = all_ok and g_ok
        row["ok"] = bool(all_ok)
        rows.append(row)
    return rows


def decode_check_table(*, lengths: Sequence[int], capacity: int, page_size: int, nheads: int, nheads_k: int,
                       head_dim: int, dtype: torch.dtype, window: int, softcap: float, device=None, seed: int = 0,
                       num_splits: Sequence[int] = (1, 3), variants: Sequence[str] = VARIANTS,
                       caches: Sequence[str] = ("dense", "paged")) -> List[Dict[str, Any]]:
    """`flash_attn_with_kvcache` with each variant: one new token appended per request to a ragged batch
    (request b holds lengths[b] cached keys, e.g. none, one, the window's length - 1 / = / + 1, a long one;
    capacity rows each, a multiple of page_size), against the fp32 reference of each request over its own
    keys plus the new one. Dense: the (batch, capacity) cache; paged: the same keys in pages of page_size
    shuffled over the pool, read through a block table. Each `num_splits` value is one call (several splits:
    split-KV, the partial results merged by their log-sum-exp).

    One row per (variant, cache, num_splits): err, bound, ok. device None: `default_device()`."""
    device = _device(device)
    if not lengths or any(c not in ("dense", "paged") for c in caches):
        raise ValueError(f"Expected at least one length and caches among ('dense', 'paged'), got lengths "
                         f"{list(lengths)}, caches {list(caches)}.")
    if capacity % page_size or max(lengths) >= capacity:
        raise ValueError(f"Expected capacity ({capacity}) a multiple of page_size ({page_size}) and above every "
                         f"length (largest {max(lengths)}), one row being appended.")
    gen = generator(device, seed)
    lengths = [int(n) for n in lengths]
    batch, pages = len(lengths), capacity // page_size
    perm = torch.randperm(batch * pages, generator=torch.Generator().manual_seed(seed)).to(device)
    block_table = perm.view(batch, pages).to(torch.int32)
    lens = torch.tensor(lengths, dtype=torch.int32, device=device)
    rows = []
    for name in variants:
        kw = variant_kwargs(name, nheads=nheads, window=window, softcap=softcap, device=device, gen=gen)
        q = randn((batch, 1, nheads, head_dim), dtype, device, gen)
        k, v = (randn((batch, 1, nheads_k, head_dim), dtype, device, gen) for _ in range(2))
        k_cache, v_cache = (randn((batch, capacity, nheads_k, head_dim), dtype, device, gen) for _ in range(2))
        variant = {key: value for key, value in kw.items() if key != "causal"}
        ref, _, same = per_request_references(q, k_cache, v_cache, k, v, lengths, causal=kw["causal"], **variant)
        for cache in caches:
            for splits in num_splits:
                extra: Dict[str, Any] = {}
                if cache == "dense":
                    kc, vc = k_cache.clone(), v_cache.clone()
                else:
                    kc = torch.empty(batch * pages, page_size, nheads_k, head_dim, dtype=dtype, device=device)
                    vc = torch.empty_like(kc)
                    kc[perm] = k_cache.reshape(-1, page_size, nheads_k, head_dim)
                    vc[perm] = v_cache.reshape(-1, page_size, nheads_k, head_dim)
                    extra["block_table"] = block_table
                out = flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens, num_splits=splits, **kw, **extra)
                ok, err, bound = check_close(out, ref, same)
                rows.append({"variant": name, "cache": cache, "num_splits": splits, "err": err, "bound": bound,
                             "ok": bool(ok)})
    return rows


def worst(rows: Sequence[Dict[str, Any]], err: str = "err", bound: str = "bound") -> Optional[Dict[str, Any]]:
    """The row with the largest err / bound (None for no rows): how close a table came to its rule."""
    scored = [row for row in rows if row.get(err) is not None and row.get(bound)]
    return max(scored, key=lambda row: row[err] / row[bound]) if scored else None
