"""Helpers of notebook 05 (the attention variants), so that its cells only narrate, call, check and plot.

- `variant_sizes`: the notebook's shapes, small under the Triton interpreter (CPU), full on a GPU.
- `VARIANTS`, `variant_kwargs`: the variants (sliding window, softcap, ALiBi, sinks, all together) as
  flash_attn_func / flash_attn_with_kvcache keywords, with fresh slopes and sinks.
- `plot_masks`: what each variant does to the scores, drawn.
- Check tables (judged by the rule of kernels/tritonattn/testing/tolerance.py): `prefill_check_table` (forward and every
  gradient, dsinks included), `decode_check_table` (ragged batches, dense and paged, split and not).
- Speed and memory (GPU only; benchmarks/ measures): `prefill_speed_table` (ours against plain causal and
  FlexAttention, TFLOP/s and peak memory), `decode_speed_table` (K/V TB/s against plain decode),
  `committed` (the benchmarks' committed rows), `plot_speed`, `speed_targets`.
- Serving: `window_serving_run` (one workload through ServingEngine with and without a sliding window),
  `plot_window_memory`.
"""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace
from typing import Dict, Optional

import torch

from benchmarks import decode_variants as bench_decode
from benchmarks import report, results
from benchmarks import variants as bench_prefill
from benchmarks.serving import make_workload
from tritonattn import flash_attn_func, flash_attn_with_kvcache
from tritonattn.testing import attention_ref, causal_mask, check_close, check_dsinks, check_lse

VARIANTS = ["causal", "window", "softcap", "alibi", "sinks", "all"]


# --------------------------------------------------------------------------------------------
# Sizes and variants
# --------------------------------------------------------------------------------------------
def variant_sizes(on_gpu: bool) -> SimpleNamespace:
    """GPU: bf16, 32 q / 8 KV heads, head dim 128; checks at 2 x 1024 tokens with a window of 256,
    decode over ragged caches of up to 4096 keys; speed at 1 x 8192 (prefill, Flex too) and batch 8
    over 32768 cached keys (decode, window 2048); serving: 16 requests of up to 3000 + 256 tokens with
    and without a 1024-token window. CPU (the interpreter): fp16, 4 q / 2 KV heads, head dim 32, 80
    tokens, a window of 20, tiny serving; no speed."""
    if on_gpu:
        return SimpleNamespace(
            dtype=torch.bfloat16, nheads=32, nheads_k=8, head_dim=128, batch=2, seqlen=1024, window=256,
            softcap=30.0, capacity=4096, page_size=64, lengths=(0, 1, 255, 256, 257, 1000, 4095),
            prefill_shapes=[(1, 8192)], flex_seqlens=(8192,), decode_batch=8, decode_long=32768, decode_short=2048,
            decode_window=2048,
            serving=dict(page_size=64, num_blocks=640, max_batch=8, max_seqlen=3328, chunk_size=512,
                         token_budget=2048, num_requests=16, prompt_range=(500, 3000), new_tokens_range=(64, 256),
                         arrival_span=40, window=1024, verify="sample"),
        )
    return SimpleNamespace(
        dtype=torch.float16, nheads=4, nheads_k=2, head_dim=32, batch=1, seqlen=80, window=20, softcap=5.0,
        capacity=96, page_size=16, lengths=(0, 1, 19, 20, 21, 95), prefill_shapes=[], flex_seqlens=(),
        serving=dict(page_size=16, num_blocks=24, max_batch=3, max_seqlen=96, chunk_size=32, token_budget=40,
                     num_requests=4, prompt_range=(30, 70), new_tokens_range=(8, 20), arrival_span=4, window=24,
                     verify="all"),
    )


def variant_kwargs(name: str, S: SimpleNamespace, device, *, sinks_grad: bool = False) -> dict:
    """flash_attn keywords of variant `name` (always causal; the window has W keys: itself and W - 1 before);
    sinks are fresh N(0, 1) logits, a leaf with grad when sinks_grad."""
    window = dict(window_size=(S.window - 1, 0))
    softcap = dict(softcap=S.softcap)
    alibi = dict(alibi_slopes=bench_prefill.alibi_slopes(S.nheads, device))
    sinks = dict(sinks=torch.randn(S.nheads, device=device).requires_grad_(sinks_grad))
    parts = {"causal": {}, "window": window, "softcap": softcap, "alibi": alibi, "sinks": sinks,
             "all": {**window, **softcap, **alibi, **sinks}}[name]
    return dict(causal=True, **parts)


# --------------------------------------------------------------------------------------------
# Pictures
# --------------------------------------------------------------------------------------------
def plot_masks(path: Optional[Path] = None, n: int = 12, window: int = 4):
    """Six panels on an n x n (or 4 x n) problem: causal; causal + a window of `window` keys; a window
    on both sides, not causal; a 4-query chunk at the end of n keys (bottom-right aligned, the decode
    case); ALiBi's bias; softcap's curve; and one row's softmax with and without a sink."""
    import matplotlib.pyplot as plt

    def band(m, nk, left, right, causal):
        i = torch.arange(m)[:, None] + (nk - m)
        j = torch.arange(nk)[None, :]
        seen = torch.ones(m, nk, dtype=torch.bool)
        if left >= 0:
            seen &= j >= i - left
        if right >= 0 or causal:
            seen &= j <= i + (0 if causal else right)
        return seen

    fig, axes = plt.subplots(2, 4, figsize=(15, 7.5))
    masks = [
        ("causal", causal_mask(n, n)),
        (f"causal + window of {window} keys\nwindow_size=({window - 1}, 0)", band(n, n, window - 1, 0, True)),
        ("window_size=(3, 2), not causal", band(n, n, 3, 2, False)),
        (f"4 new queries over {n} keys\n(bottom-right: a decode chunk), window {window}",
         band(4, n, window - 1, 0, True)),
    ]
    for ax, (title, mask) in zip(axes[0], masks):
        ax.imshow(mask.float(), cmap="Blues", vmin=0, vmax=1.3)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("key j")
        ax.set_ylabel("query i")
    ax = axes[1, 0]
    i = torch.arange(n)[:, None]
    j = torch.arange(n)[None, :]
    bias = torch.where(j <= i, -0.5 * (i - j).float(), torch.tensor(float("nan")))
    im = ax.imshow(bias, cmap="viridis")
    fig.colorbar(im, ax=ax, fraction=0.046)
    ax.set_title("ALiBi: bias -slope * (i - j), slope 0.5", fontsize=9)
    ax.set_xlabel("key j")
    ax.set_ylabel("query i")
    ax = axes[1, 1]
    s = torch.linspace(-120, 120, 400)
    for cap in (10.0, 30.0, 50.0):
        ax.plot(s, cap * torch.tanh(s / cap), label=f"c = {cap:g}")
    ax.plot(s, s, color="0.6", linestyle=":", label="no cap")
    ax.set_ylim(-60, 60)
    ax.set_title("softcap: score -> c * tanh(score / c)", fontsize=9)
    ax.set_xlabel("score")
    ax.legend(fontsize=8)
    ax = axes[1, 2]
    scores = torch.tensor([0.5, -1.0, 0.2, -0.3, 0.1, -2.0])
    sink = 2.0
    plain = torch.softmax(scores, 0)
    with_sink = torch.softmax(torch.cat([scores, torch.tensor([sink])]), 0)
    x = torch.arange(len(scores))
    ax.bar(x - 0.2, plain, width=0.4, label="no sink: sums to 1")
    ax.bar(x + 0.2, with_sink[:-1], width=0.4, label=f"sink logit {sink:g}: keys sum to {with_sink[:-1].sum():.2f}")
    ax.bar([len(scores) + 0.2], with_sink[-1:], width=0.4, color="tab:red", label="the sink's share (no value)")
    ax.set_xticks(list(range(len(scores))) + [len(scores)], [f"k{t}" for t in range(len(scores))] + ["sink"])
    ax.set_title("sinks: one row's probabilities", fontsize=9)
    ax.legend(fontsize=7)
    axes[1, 3].axis("off")
    fig.suptitle("What each variant does to one head's scores (blue: the keys a query sees)", fontsize=11)
    fig.tight_layout()
    report.write_figure(fig, path)  # returns nothing: a cell ending in a plot shows it once


# --------------------------------------------------------------------------------------------
# Checks
# --------------------------------------------------------------------------------------------
def _randn(*shape, dtype, device, gen) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(dtype)


def _same_dtype(kw: dict, dtype: torch.dtype) -> dict:
    """The reference's keywords for PyTorch's own same-dtype run: the sinks in `dtype` too."""
    return {**kw, "sinks": kw["sinks"].to(dtype)} if "sinks" in kw else kw


def prefill_check_table(S: SimpleNamespace, device, *, seed: int = 0):
    """flash_attn_func with each variant, forward and backward, against the fp32 reference (kernels/
    tritonattn.testing.reference), judged like the tests: err <= 2x PyTorch's own same-dtype error + a floor (outputs),
    a wider factor for gradients. One row per variant: err and bound of out, dq, dk, dv (and dsinks)."""
    import pandas as pd

    gen = torch.Generator(device=device).manual_seed(seed)
    rows = []
    for name in VARIANTS:
        q = _randn(S.batch, S.seqlen, S.nheads, S.head_dim, dtype=S.dtype, device=device, gen=gen)
        k, v = (_randn(S.batch, S.seqlen, S.nheads_k, S.head_dim, dtype=S.dtype, device=device, gen=gen)
                for _ in range(2))
        dout = _randn(S.batch, S.seqlen, S.nheads, S.head_dim, dtype=S.dtype, device=device, gen=gen)
        kw = variant_kwargs(name, S, device, sinks_grad=True)
        leaves = [t.requires_grad_() for t in (q, k, v)] + ([kw["sinks"]] if "sinks" in kw else [])
        out, lse = flash_attn_func(q, k, v, return_softmax_lse=True, **kw)
        grads = torch.autograd.grad(out, leaves, dout)
        ref, lse_ref = attention_ref(*(t.float() for t in (q, k, v)), **kw)
        ref_grads = torch.autograd.grad(ref, leaves, dout.float())
        same, _ = attention_ref(q, k, v, upcast=False, **_same_dtype(kw, S.dtype))
        same_grads = torch.autograd.grad(same, leaves, dout)
        row = {"variant": name}
        ok, err, bound = check_close(out, ref.to(S.dtype), same)
        lse_ok, lse_diff = check_lse(lse, lse_ref, S.dtype)
        row.update(out_err=err, out_bound=bound, lse_diff=lse_diff)
        all_ok = ok and lse_ok
        for label, g, g_ref, g_same in zip(("dq", "dk", "dv", "dsinks"), grads, ref_grads, same_grads):
            if label == "dsinks":
                g_ok, g_err, g_bound, _ = check_dsinks(g, g_ref, g_same, out, lse, dout, kw["sinks"], S.dtype)
            else:
                g_ok, g_err, g_bound = check_close(g, g_ref.to(g.dtype), g_same, grad=True)
            row.update({f"{label}_err": g_err, f"{label}_bound": g_bound})
            all_ok = all_ok and g_ok
        row["ok"] = bool(all_ok)
        rows.append(row)
    table = pd.DataFrame(rows)
    return table[[c for c in table.columns if c != "ok"] + ["ok"]]


def decode_check_table(S: SimpleNamespace, device, *, seed: int = 0):
    """flash_attn_with_kvcache with each variant: one new token appended per request over a ragged batch
    (lengths S.lengths: empty, one key, the window's -1 / 0 / +1, long), dense and paged (pages shuffled),
    one split and several; against the fp32 reference of each request over its own keys."""
    import pandas as pd

    gen = torch.Generator(device=device).manual_seed(seed)
    lengths = list(S.lengths)
    batch = len(lengths)
    rows = []
    for name in VARIANTS:
        kw = variant_kwargs(name, S, device)
        q = _randn(batch, 1, S.nheads, S.head_dim, dtype=S.dtype, device=device, gen=gen)
        k, v = (_randn(batch, 1, S.nheads_k, S.head_dim, dtype=S.dtype, device=device, gen=gen) for _ in range(2))
        k_cache, v_cache = (_randn(batch, S.capacity, S.nheads_k, S.head_dim, dtype=S.dtype, device=device, gen=gen)
                            for _ in range(2))
        refs, same_kw = [], _same_dtype(kw, S.dtype)
        for b, n in enumerate(lengths):
            kk, vv = torch.cat([k_cache[b : b + 1, :n], k[b : b + 1]], 1), torch.cat([v_cache[b : b + 1, :n],
                                                                                        v[b : b + 1]], 1)
            ref, _ = attention_ref(q[b : b + 1].float(), kk.float(), vv.float(), **kw)
            same, _ = attention_ref(q[b : b + 1], kk, vv, upcast=False, **same_kw)
            refs.append((ref, same))
        ref, same = torch.cat([r for r, _ in refs]), torch.cat([s for _, s in refs])
        lens = torch.tensor(lengths, dtype=torch.int32, device=device)
        pages = S.capacity // S.page_size
        perm = torch.randperm(batch * pages, generator=torch.Generator().manual_seed(seed)).to(device)
        table = perm.view(batch, pages).to(torch.int32)
        for cache in ("dense", "paged"):
            for num_splits in (1, 3):
                if cache == "dense":
                    kc, vc, extra = k_cache.clone(), v_cache.clone(), {}
                else:
                    kc = torch.empty(batch * pages, S.page_size, S.nheads_k, S.head_dim, dtype=S.dtype, device=device)
                    vc = torch.empty_like(kc)
                    kc[perm] = k_cache.reshape(-1, S.page_size, S.nheads_k, S.head_dim)
                    vc[perm] = v_cache.reshape(-1, S.page_size, S.nheads_k, S.head_dim)
                    extra = dict(block_table=table)
                out = flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens, num_splits=num_splits, **kw, **extra)
                ok, err, bound = check_close(out, ref.to(S.dtype), same)
                rows.append({"variant": name, "cache": cache, "num_splits": num_splits, "err": err, "bound": bound,
                             "ok": bool(ok)})
    return pd.DataFrame(rows)


# --------------------------------------------------------------------------------------------
# Speed and memory (GPU)
# --------------------------------------------------------------------------------------------
PREFILL_CASES = ["causal", "window_1024", "softcap_50", "alibi", "sinks"]


def prefill_speed_table(S: SimpleNamespace):
    """benchmarks.variants on the notebook's shapes: ours and Flex (TFLOP/s over the pairs each mask
    admits, peak memory of one call beyond its inputs), ours over plain causal and over Flex."""
    import pandas as pd

    rows = bench_prefill.measure(S.prefill_shapes, PREFILL_CASES, flex_seqlens=set(S.flex_seqlens), rounds=2, rep=10,
                                 memory=True, verbose=False)
    return pd.DataFrame([results.make_row(**row) for row in rows])


def decode_speed_table(S: SimpleNamespace):
    """benchmarks.decode_variants on the notebook's sizes: K/V TB/s of each variant, dense and paged,
    against plain decode (a window against plain decode over a cache of the window's length)."""
    import pandas as pd

    rows = bench_decode.measure(S.decode_batch, S.decode_long, S.decode_short, S.decode_window, (0, 64), rounds=3,
                                rep=30, verbose=False)
    return pd.DataFrame([results.make_row(**row) for row in rows])


def committed(name: str):
    """The committed rows of results/<gpu>/bench_<name>.csv, every GPU's (None when there are none)."""
    import pandas as pd

    paths = sorted((results.REPO_ROOT / "results").glob(f"*/bench_{name}.csv"))
    return pd.concat([pd.read_csv(p) for p in paths], ignore_index=True) if paths else None


def plot_speed(prefill, decode, *, title: str, path: Optional[Path] = None):
    """Left: prefill TFLOP/s of ours and Flex per variant, forward and forward + backward. Right: decode
    TB/s per variant, dense and paged."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for ax, path_name in zip(axes[:2], ("fwd", "fwd_bwd")):
        df = prefill[prefill.path == path_name]
        x = torch.arange(len(df)).numpy()
        ax.bar(x - 0.2, df.tflops_ours, width=0.4, label="ours")
        ax.bar(x + 0.2, df.tflops_flex.fillna(0), width=0.4, label="FlexAttention (no sinks)")
        ax.set_xticks(x, df.variant, rotation=20)
        ax.set_ylabel("TFLOP/s (pairs the mask admits)")
        ax.set_title(f"prefill {path_name}, {df['shape'].iloc[0]}", fontsize=10)
        ax.set_ylim(0, 1.3 * df.tflops_ours.max())  # room for the legend above the bars
        ax.legend(fontsize=8, loc="upper right")
    ax = axes[2]
    labels = [f"{r.variant}\n{r.shape.split('x')[1]} keys" for r in decode[decode.page_size == 0].itertuples()]
    x = torch.arange(len(labels)).numpy()
    for offset, page, label in ((-0.2, 0, "dense"), (0.2, 64, "paged, pages of 64")):
        ax.bar(x + offset, decode[decode.page_size == page].tb_per_s, width=0.4, label=label)
    ax.set_xticks(x, labels, rotation=30, fontsize=7)
    ax.set_ylabel("K/V TB/s (bytes a step must read)")
    ax.set_title(f"decode, batch {decode['shape'].iloc[0].split('x')[0]}", fontsize=10)
    ax.set_ylim(0, 1.25 * decode.tb_per_s.max())
    ax.legend(fontsize=8, loc="upper right")
    for a in axes:
        a.grid(True, axis="y", alpha=0.3)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    report.write_figure(fig, path)  # returns nothing: a cell ending in a plot shows it once


# --------------------------------------------------------------------------------------------
# Serving with a window
# --------------------------------------------------------------------------------------------
def window_serving_run(S: SimpleNamespace, device) -> Dict[str, object]:
    """One workload through ServingEngine twice, over one pool: full causal attention, and a sliding window
    of S.serving["window"] keys (pages before each request's window go back to the pool). Both engines
    check their outputs against the reference as they run (S.serving["verify"]). Returns the two
    engines' stats frames and checks frames, by "full" and "window"."""
    from benchmarks.serving import ServingEngine

    cfg = dict(S.serving)
    window, verify = cfg.pop("window"), cfg.pop("verify")
    workload = make_workload(cfg.pop("num_requests"), cfg.pop("prompt_range"), cfg.pop("new_tokens_range"),
                             cfg.pop("arrival_span"), seed=0)
    runs = {}
    for label, sliding in (("full", None), ("window", window)):
        engine = ServingEngine(nheads=S.nheads, nheads_k=S.nheads_k, head_dim=S.head_dim, dtype=S.dtype, device=device,
                               verify=verify, sliding_window=sliding, **cfg)
        engine.submit(workload)
        engine.run()
        runs[label] = SimpleNamespace(stats=engine.stats_frame(), checks=engine.checks_frame(),
                                      requests=engine.requests_frame(), engine=engine)
    return runs


def window_memory_summary(runs: Dict[str, SimpleNamespace], window: int):
    """Per engine: steps, tokens, the peak and mean K/V pages in use (MiB, one layer), outputs checked and
    how many passed."""
    import pandas as pd

    rows = []
    for label, run in runs.items():
        st, ch = run.stats, run.checks
        rows.append({"attention": "full causal" if label == "full" else f"window of {window}",
                     "steps": len(st), "tokens": int(st.tokens.sum()),
                     "peak_pool_in_use_mib": st.pool_in_use_mib.max(),
                     "mean_pool_in_use_mib": st.pool_in_use_mib.mean(),
                     "checked": len(ch),
                     "passed": int(ch.ok.sum()) if len(ch) else 0})
    return pd.DataFrame(rows)


def plot_window_memory(runs: Dict[str, SimpleNamespace], *, window: int, title: str, path: Optional[Path] = None):
    """Pool pages in use (MiB) per engine step, full causal against the sliding window."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(12, 4))
    for label, run in runs.items():
        name = "full causal: every token's K/V kept" if label == "full" else f"window of {window}: pages freed"
        ax.plot(run.stats.step, run.stats.pool_in_use_mib, label=name)
    ax.set_xlabel("engine step")
    ax.set_ylabel("K/V pages in use, one layer (MiB)")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=9)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    report.write_figure(fig, path)  # returns nothing: a cell ending in a plot shows it once


def speed_targets(prefill, decode) -> Dict[str, float]:
    """The numbers the variant issues ask for, from the tables: the worst decode TB/s ratio of a window
    against plain over the window's length, of softcap / ALiBi / sinks against plain, and paged over dense
    time; prefill ours over Flex per variant (forward + backward)."""
    d = decode
    window = d[d.variant.str.startswith("window")].vs_plain.min()
    others = d[d.variant.isin(["softcap_30", "alibi", "sinks"])].vs_plain.min()
    dense = d[d.page_size == 0].set_index(["variant", "shape"]).us
    paged = d[d.page_size != 0].set_index(["variant", "shape"]).us
    out = {"decode window / plain (>= 0.9)": float(window), "decode softcap, ALiBi, sinks / plain (>= 0.95)":
           float(others), "decode paged / dense time (<= 1.05)": float((paged / dense).max())}
    fb = prefill[prefill.path == "fwd_bwd"]
    for r in fb.itertuples():
        if not math.isnan(r.ours_over_flex):
            out[f"prefill fwd+bwd {r.variant}: ours / Flex"] = float(r.ours_over_flex)
    return out

