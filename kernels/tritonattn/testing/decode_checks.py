"""Decode check tables: `flash_attn_with_kvcache`, `KVCache` and `PagedKVCache` against the references, each
row judged by the error rule of `tolerance` (what notebooks 02 and 04 show and `checks.assert_table_ok`
asserts).

- `decode_inputs`: a decode step's seeded q, caches (stale random rows past every length) and new tokens.
- `decode_equivalence_table`: causal prefill over a sequence == decoding it token by token (the seed's test).
- `decode_ragged_table`: a batch of different cache lengths (0 and 1 included) against the reference
  with key-padding lengths over the whole cache buffer, with and without an append.
- `decode_split_table`: split-KV runs against the unsplit one and the reference.
- `decode_append_table`: the cache rows one appending call changes, next to NaN-poisoned padding.
- `kvcache_round_trip_table`: KVCache end to end (prefill, decode, reset, re-prefill, overflow).
- `chunked_prefill_table`: a prompt prefilled chunk by chunk into a dense and a paged cache.

Each table is a list of rows (dicts of plain values): `pandas.DataFrame(rows)` shows one.
"""

from __future__ import annotations

import itertools
import numbers
from typing import Any, Dict, List, Sequence, Tuple

import torch

from ..api.kvcache import flash_attn_with_kvcache
from ..api.prefill import flash_attn_func
from ..cache import KVCache, PagedKVCache
from ..config.hardware import default_device
from .checks import Case, all_finite, dtype_name, generator, make_inputs, randn
from .requests import per_request_references, references
from .tolerance import agreement_tolerance, check_close, check_lse, error_bound, rel_err

__all__ = [
    "head_kind", "decode_inputs", "decode_equivalence_table", "decode_ragged_table", "decode_split_table",
    "decode_append_table", "kvcache_round_trip_table", "chunked_prefill_table",
]

Row = Dict[str, Any]


def head_kind(nheads: int, nheads_k: int) -> str:
    """'MHA', 'GQA' or 'MQA' for nheads q heads over nheads_k KV heads."""
    return "MHA" if nheads == nheads_k else ("MQA" if nheads_k == 1 else "GQA")


def decode_inputs(batch: int, seqlen_cache: int, seqlen_q: int, nheads: int, nheads_k: int, head_dim: int,
                  dtype: torch.dtype, device, *, seed: int = 0):
    """Seeded (q, k_cache, v_cache, k, v) for a decode step.

    q (batch, seqlen_q, nheads, head_dim); k_cache, v_cache (batch, seqlen_cache, nheads_k, head_dim),
    random in every row, also past the lengths a call uses: stale rows that must never be read;
    k, v (batch, seqlen_q, nheads_k, head_dim): the new tokens.
    """
    gen = generator(device, seed)
    q = randn((batch, seqlen_q, nheads, head_dim), dtype, device, gen)
    k_cache = randn((batch, seqlen_cache, nheads_k, head_dim), dtype, device, gen)
    v_cache = randn((batch, seqlen_cache, nheads_k, head_dim), dtype, device, gen)
    k = randn((batch, seqlen_q, nheads_k, head_dim), dtype, device, gen)
    v = randn((batch, seqlen_q, nheads_k, head_dim), dtype, device, gen)
    return q, k_cache, v_cache, k, v


def decode_equivalence_table(*, batch: int, nheads: int, nheads_k_values: Sequence[int], head_dim: int,
                             lengths: Sequence[int], dtype: torch.dtype, device, seed: int = 0) -> List[Row]:
    """The seed's autoregressive test: causal prefill over a sequence == decoding it token by token.

    For each KV-head count and length L: flash_attn_func(q, k, v, causal=True) over the L tokens, and
    L calls of flash_attn_with_kvcache, call t writing token t's k/v into a cache of max(lengths) + 7
    rows filled with stale random values and attending over rows [0, t] (one cache size for every
    length: one launch plan, so one compilation). Columns: kind, nheads, nheads_k, group,
    seqlen, dtype, err_decode and err_prefill (vs the fp32 reference), eager_err (PyTorch's same-dtype
    error), bound (the rule's), decode_vs_prefill (rel. difference) and agree_tol, cache_written (rows
    [0, L) hold k and v exactly), ok.
    """
    rows, seqlen_cache = [], max(lengths) + 7
    for i, (hk, n) in enumerate(itertools.product(nheads_k_values, lengths)):
        case = Case(batch, n, n, nheads, hk, head_dim, dtype, causal=True)
        q, k, v = make_inputs(case, device, seed + i)
        gen = generator(device, 1000 + seed + i)
        k_cache = randn((batch, seqlen_cache, hk, head_dim), dtype, device, gen)  # stale rows, never read
        v_cache = randn((batch, seqlen_cache, hk, head_dim), dtype, device, gen)
        with torch.no_grad():
            out_prefill = flash_attn_func(q, k, v, causal=True)
            outs = [flash_attn_with_kvcache(q[:, t: t + 1], k_cache, v_cache, k[:, t: t + 1], v[:, t: t + 1],
                                            cache_seqlens=t, causal=True) for t in range(n)]
            out_decode = torch.cat(outs, 1)
            ref, _, same = references(q, k, v, causal=True)
        err_dec, err_pre, eager_err = rel_err(out_decode, ref), rel_err(out_prefill, ref), rel_err(same, ref)
        bound = error_bound(dtype, eager_err)
        agree, tol = rel_err(out_decode, out_prefill), agreement_tolerance(dtype)
        written = torch.equal(k_cache[:, :n], k) and torch.equal(v_cache[:, :n], v)
        ok = all_finite(out_decode) and err_dec <= bound and err_pre <= bound and agree <= tol and written
        rows.append({
            "kind": head_kind(nheads, hk), "nheads": nheads, "nheads_k": hk, "group": nheads // hk, "seqlen": n,
            "dtype": dtype_name(dtype), "err_decode": err_dec, "err_prefill": err_pre, "eager_err": eager_err,
            "bound": bound, "decode_vs_prefill": agree, "agree_tol": tol, "cache_written": written, "ok": bool(ok),
        })
    return rows


def decode_ragged_table(*, lengths: Sequence[int], seqlen_cache: int, nheads: int, nheads_k: int, head_dim: int,
                        dtype: torch.dtype, device, num_splits_values: Sequence[int] = (1, 3, 0),
                        seed: int = 0) -> List[Row]:
    """A ragged batch (one length per request, e.g. 0 and 1 included) against attention_ref with
    key_padding_lengths over the whole cache, with and without appending one new token.

    One row per (append, num_splits, request): cache_len (L_b before the call), keys_seen (L_b + 1
    with an append), err_fp32 (vs attention_ref in fp32 over the whole cache buffer, keys at or past
    keys_seen masked by key_padding_lengths), eager_err, bound, lse_diff, cache_ok (the caches equal
    the old ones with exactly the new rows written), ok. A request that sees no key must give zeros
    and LSE +inf, as the reference does.
    """
    batch = len(lengths)
    q, k_cache0, v_cache0, k_new, v_new = decode_inputs(batch, seqlen_cache, 1, nheads, nheads_k, head_dim, dtype,
                                                        device, seed=seed)
    seqlens = torch.tensor(list(lengths), dtype=torch.int32, device=device)
    rows = []
    for append, num_splits in itertools.product((True, False), num_splits_values):
        k, v = (k_new, v_new) if append else (None, None)
        k_cache, v_cache = k_cache0.clone(), v_cache0.clone()
        with torch.no_grad():
            out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens,
                                               num_splits=num_splits, return_softmax_lse=True)
        k_exp, v_exp = k_cache0.clone(), v_cache0.clone()
        if append:
            for b, n in enumerate(lengths):
                k_exp[b, n: n + 1], v_exp[b, n: n + 1] = k_new[b], v_new[b]
        cache_ok = torch.equal(k_cache, k_exp) and torch.equal(v_cache, v_exp)
        keys_seen = seqlens.long() + (1 if append else 0)
        ref, lse_ref, same = references(q, k_exp, v_exp, causal=False, key_padding_lengths=keys_seen)
        for b, n in enumerate(lengths):
            err, eager_err = rel_err(out[b], ref[b]), rel_err(same[b], ref[b])
            bound = error_bound(dtype, eager_err)
            lse_ok, lse_diff = check_lse(lse[b], lse_ref[b], dtype)
            rows.append({
                "append": append, "num_splits": num_splits, "request": b, "cache_len": n,
                "keys_seen": int(keys_seen[b]), "err_fp32": err, "eager_err": eager_err, "bound": bound,
                "lse_diff": lse_diff, "cache_ok": cache_ok,
                "ok": bool(all_finite(out[b]) and err <= bound and lse_ok and cache_ok),
            })
    return rows


def decode_split_table(*, lengths: Sequence[int], seqlen_cache: int, nheads: int, nheads_k: int, head_dim: int,
                       dtype: torch.dtype, device, seqlen_q_values: Sequence[int] = (1, 4),
                       num_splits_values: Sequence[int] = (1, 2, 3, 0), seed: int = 0) -> List[Row]:
    """Split-KV and unsplit runs agree: the same ragged batch (causal, no append) with each num_splits.

    One row per (seqlen_q, num_splits): err_fp32 vs the per-request fp32 reference, eager_err, bound,
    diff_vs_unsplit (rel. difference to num_splits=1), agree_tol, lse_diff_vs_unsplit, ok. Splits past
    a request's length are empty and get weight 0 in the merge.
    """
    batch = len(lengths)
    seqlens = torch.tensor(list(lengths), dtype=torch.int32, device=device)
    rows = []
    for m in seqlen_q_values:
        q, k_cache, v_cache, _, _ = decode_inputs(batch, seqlen_cache, m, nheads, nheads_k, head_dim, dtype, device,
                                                  seed=seed + m)
        ref, _, same = per_request_references(q, k_cache, v_cache, None, None, lengths, causal=True)
        eager_err = rel_err(same, ref)
        bound = error_bound(dtype, eager_err)
        with torch.no_grad():
            base, base_lse = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, causal=True,
                                                     num_splits=1, return_softmax_lse=True)
        for ns in num_splits_values:
            with torch.no_grad():
                out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, causal=True,
                                                   num_splits=ns, return_softmax_lse=True)
            err, diff, tol = rel_err(out, ref), rel_err(out, base), agreement_tolerance(dtype)
            lse_ok, lse_diff = check_lse(lse, base_lse, dtype)
            rows.append({
                "seqlen_q": m, "num_splits": ns, "err_fp32": err, "eager_err": eager_err, "bound": bound,
                "diff_vs_unsplit": diff, "agree_tol": tol, "lse_diff_vs_unsplit": lse_diff,
                "ok": bool(all_finite(out) and err <= bound and diff <= tol and lse_ok),
            })
    return rows


def _same_or_both_nan(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a == b) | (torch.isnan(a) & torch.isnan(b))


def _row_ranges(rows: Sequence[int]) -> str:
    """[3, 4, 5, 9] -> '3-5, 9' (empty: '-')."""
    rows = sorted(rows)
    if not rows:
        return "-"
    parts, start = [], rows[0]
    for prev, cur in zip(rows, rows[1:] + [None]):
        if cur != prev + 1:
            parts.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = cur
    return ", ".join(parts)


def decode_append_table(*, lengths: Sequence[int], seqlen_cache: int, seqlen_q: int, nheads: int, nheads_k: int,
                        head_dim: int, dtype: torch.dtype, device, num_splits: int = 3, seed: int = 0) -> List[Row]:
    """Which cache rows one appending call changes, per request, with poisoned padding.

    The caches are views (..., :head_dim) of buffers 8 columns wider whose extra columns hold NaN
    (never to be read or written); head_dim should not be a power of two, so the kernel pads it.
    Columns: request, cache_len, seqlen_q, rows_expected [L_b, L_b + seqlen_q), rows_written_k / _v (the
    rows in which any byte changed, NaN-aware), new_rows_equal (they hold exactly k, v), others_untouched
    (no other row changed), padding_untouched (every padding column bit-identical), err_fp32 and bound
    (the output vs the reference), ok.
    """
    batch = len(lengths)
    gen = generator(device, seed)
    bufs = [randn((batch, seqlen_cache, nheads_k, head_dim + 8), dtype, device, gen) for _ in range(2)]
    for buf in bufs:
        buf[..., head_dim:] = float("nan")  # poison
    k_buf, v_buf = bufs
    k_cache, v_cache = k_buf[..., :head_dim], v_buf[..., :head_dim]
    q = randn((batch, seqlen_q, nheads, head_dim), dtype, device, gen)
    k = randn((batch, seqlen_q, nheads_k, head_dim), dtype, device, gen)
    v = randn((batch, seqlen_q, nheads_k, head_dim), dtype, device, gen)
    k_before, v_before = k_buf.clone(), v_buf.clone()
    ref, _, same = per_request_references(q, k_cache.clone(), v_cache.clone(), k, v, lengths, causal=True)
    with torch.no_grad():
        out = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, causal=True, num_splits=num_splits,
                                      cache_seqlens=torch.tensor(list(lengths), dtype=torch.int32, device=device))
    changed_k = ~_same_or_both_nan(k_buf, k_before).flatten(2).all(-1)  # (batch, seqlen_cache)
    changed_v = ~_same_or_both_nan(v_buf, v_before).flatten(2).all(-1)
    padding_ok = bool(_same_or_both_nan(k_buf[..., head_dim:], k_before[..., head_dim:]).all()
                      and _same_or_both_nan(v_buf[..., head_dim:], v_before[..., head_dim:]).all())
    rows = []
    for b, n in enumerate(lengths):
        expected = list(range(n, n + seqlen_q))
        written_k = changed_k[b].nonzero().flatten().tolist()
        written_v = changed_v[b].nonzero().flatten().tolist()
        new_equal = torch.equal(k_cache[b, n: n + seqlen_q], k[b]) and torch.equal(v_cache[b, n: n + seqlen_q], v[b])
        err, eager_err = rel_err(out[b], ref[b]), rel_err(same[b], ref[b])
        bound = error_bound(dtype, eager_err)
        untouched = written_k == expected and written_v == expected
        rows.append({
            "request": b, "cache_len": n, "seqlen_q": seqlen_q, "rows_expected": _row_ranges(expected),
            "rows_written_k": _row_ranges(written_k), "rows_written_v": _row_ranges(written_v),
            "new_rows_equal": new_equal, "others_untouched": untouched, "padding_untouched": padding_ok,
            "err_fp32": err, "bound": bound,
            "ok": bool(untouched and new_equal and padding_ok and err <= bound and all_finite(out[b])),
        })
    return rows


def kvcache_round_trip_table(*, batch: int, prompt: int, steps: Sequence[int], new_prompt: int, nheads: int,
                             nheads_k: int, head_dim: int, dtype: torch.dtype, device, seed: int = 0) -> List[Row]:
    """KVCache end to end: prefill prompts, decode steps (seqlen_q 1 or more), reset one request,
    prefill it again with a new prompt while the other keeps its history, decode both, overflow.

    Returns rows (check, detail, ok): outputs against attention_ref over each request's own sequence
    (causal, bottom-right), the host and device lengths, the cache contents, and the ValueError an
    overflowing decode raises before writing anything. batch >= 2.
    """
    if batch < 2:
        raise ValueError(f"Expected batch >= 2 (one request is reset while another keeps its history), got {batch}.")
    checks: List[Row] = []

    def check(name: str, ok: bool, detail: str = "") -> None:
        checks.append({"check": name, "detail": detail, "ok": bool(ok)})

    def close(out, r, s) -> Tuple[bool, str]:
        ok, err, bound = check_close(out, r, s)
        return ok, f"rel err {err:.2e} <= bound {bound:.2e}"

    total = prompt + sum(steps)
    case = Case(batch, total, total, nheads, nheads_k, head_dim, dtype, causal=True)
    q, k, v = make_inputs(case, device, seed)
    cache = KVCache(batch, total + 2, nheads_k, head_dim, dtype=dtype, device=device)
    ref, _, same = references(q, k, v, causal=True)

    with torch.no_grad():
        out = cache.prefill(q[:, :prompt], k[:, :prompt], v[:, :prompt])
        check(f"prefill {prompt} tokens", *close(out, ref[:, :prompt], same[:, :prompt]))
        check("lengths after prefill", cache.seqlens == [prompt] * batch
              and cache.seqlens_device.tolist() == [prompt] * batch, f"host {cache.seqlens}")
        pos = prompt
        for n in steps:
            out = cache.decode(q[:, pos: pos + n], k[:, pos: pos + n], v[:, pos: pos + n])
            ok, detail = close(out, ref[:, pos: pos + n], same[:, pos: pos + n])
            pos += n
            lengths_ok = cache.seqlens == [pos] * batch and cache.seqlens_device.tolist() == [pos] * batch
            check(f"decode {n} token(s) at {pos - n}", ok and lengths_ok, f"{detail}; lengths {cache.seqlens}")
        check("cache holds every k, v", torch.equal(cache.k_cache[:, :total], k)
              and torch.equal(cache.v_cache[:, :total], v), f"rows [0, {total})")

        # reset the last request, give it a new prompt, decode both (ragged lengths from here on)
        last = batch - 1
        cache.reset(batch_idx=last)
        check("reset one request", cache.seqlens == [total] * last + [0], f"lengths {cache.seqlens}")
        q2, k2, v2 = make_inputs(Case(1, new_prompt, new_prompt, nheads, nheads_k, head_dim, dtype, True), device,
                                 seed + 1)
        cache.prefill(q2, k2, v2, batch_idx=[last])
        qs, _, _, ks, vs = decode_inputs(batch, 1, 1, nheads, nheads_k, head_dim, dtype, device, seed=seed + 2)
        out = cache.decode(qs, ks, vs)
        k_hist = torch.cat([cache.k_cache[:last, :total], torch.cat(
            [k2, cache.k_cache[last:, new_prompt:total]], 1)], 0)  # rows past a length are never read
        v_hist = torch.cat([cache.v_cache[:last, :total], torch.cat(
            [v2, cache.v_cache[last:, new_prompt:total]], 1)], 0)
        r, _, s = per_request_references(qs, k_hist, v_hist, ks, vs, [total] * last + [new_prompt], causal=True)
        check("ragged decode after re-prefill", *close(out, r, s))
        check("lengths after it", cache.seqlens == [total + 1] * last + [new_prompt + 1], f"host {cache.seqlens}")

        # one more token fits (total + 2 rows), the next overflows and raises before writing
        cache.decode(qs, ks, vs)
        before = cache.k_cache.clone()
        try:
            cache.decode(qs, ks, vs)
            raised = "nothing"
        except ValueError as exc:
            raised = f"ValueError: {exc}"
        check("overflow raises", raised.startswith("ValueError") and torch.equal(cache.k_cache, before)
              and cache.seqlens[0] == total + 2, raised)
        cache.reset()
        check("reset all", cache.seqlens == [0] * batch and cache.seqlens_device.tolist() == [0] * batch,
              f"lengths {cache.seqlens}")
    return checks


def chunked_prefill_table(chunks: Sequence[int], *, nheads: int, nheads_k: int, head_dim: int, page_size: int,
                          dtype: torch.dtype, device=None, seed: int = 0) -> List[Row]:
    """One prompt of sum(chunks) tokens prefilled chunk by chunk into a dense cache buffer and into a
    PagedKVCache (flash_attn_with_kvcache with seqlen_q = chunk: append, then attend bottom-right
    causal over the cache plus the chunk), against one-shot causal prefill (flash_attn_func) and the
    fp32 reference. The dense buffer's rows past the prompt and the pool's unused pages hold NaN: a
    read of a row that is not the request's poisons the output. device None: `default_device()`.

    One row per chunk and cache: cache ("dense" or "paged"), chunk, tokens [start, end), err (vs the
    reference; inf when not finite), bound, diff_one_shot (relative difference to the same rows of the
    one-shot prefill), ok.
    """
    device = torch.device(device) if device is not None else default_device()
    if not chunks or any(not isinstance(c, numbers.Integral) or isinstance(c, bool) or c < 1 for c in chunks):
        raise ValueError(f"Expected chunks to be positive ints, got {chunks!r}.")
    total = sum(chunks)
    gen = generator(device, seed)
    q = randn((1, total, nheads, head_dim), dtype, device, gen)
    k = randn((1, total, nheads_k, head_dim), dtype, device, gen)
    v = randn((1, total, nheads_k, head_dim), dtype, device, gen)
    with torch.no_grad():
        one_shot = flash_attn_func(q, k, v, causal=True)
    k_dense = torch.full((1, total + 7, nheads_k, head_dim), float("nan"), dtype=dtype, device=device)
    v_dense = k_dense.clone()
    pages = -(-total // page_size)
    paged = PagedKVCache(pages + 3, page_size, nheads_k, head_dim, max_batch=2, max_blocks_per_seq=pages,
                         dtype=dtype, device=device)
    paged.k_cache.fill_(float("nan"))
    paged.v_cache.fill_(float("nan"))
    paged.add_request()  # slot 0 takes a page first: slot 1's pages are then not simply blocks 0, 1, ...
    paged.extend(0, page_size)
    slot = paged.add_request()
    rows, start = [], 0
    agree = agreement_tolerance(dtype)
    for n in chunks:
        end = start + n
        part = (q[:, start:end], k[:, start:end], v[:, start:end])
        with torch.no_grad():
            outs = {
                "dense": flash_attn_with_kvcache(part[0], k_dense, v_dense, part[1], part[2], cache_seqlens=start,
                                                 causal=True),
                "paged": paged.decode(*part, slots=[slot]),
            }
        ref, _, same = references(q[:, start:end], k[:, :end], v[:, :end], causal=True)
        for cache, out in outs.items():
            _, err, bound = check_close(out, ref, same)
            diff = rel_err(out, one_shot[:, start:end])
            rows.append({"cache": cache, "chunk": n, "start": start, "end": end, "err": err, "bound": bound,
                         "diff_one_shot": diff, "ok": bool(err <= bound and diff <= agree)})
        start = end
    return rows
