"""Generate the notebooks in notebooks/ from the cell sources below (reproducible and reviewable).

    python scripts/make_notebooks.py            # write notebooks/00_hardening.ipynb, 01_gqa.ipynb, 02_decode.ipynb
    python scripts/make_notebooks.py --check    # exit 1 if a notebook on disk differs from what this writes

The notebooks are written with no outputs and fixed cell ids, so regenerating them changes nothing
unless a cell does. Every notebook opens with an "Open in Colab" badge and the same setup cell
(SETUP in scripts/notebook_cells.py): it finds (or in Colab clones) the repo, sets TRITON_INTERPRET=1 before importing
`kernels` when there is no GPU, and checks that `kernels` is this repo's. Cells hold no IPython
magics: scripts/run_notebooks.py executes them with plain `exec`.
"""

from __future__ import annotations

import sys
from typing import List

from nb_benchmarks import benchmarks
from nb_serving import serving
from notebook_cells import SETUP, Cell, badge, cli, code, md

IMPORTS = code(
    """
    import nbutils as nbu
    from kernels import attention_ref, causal_mask, flash_attn_func, rel_err

    torch.manual_seed(0)
    # The fp32 references must be true fp32 on a GPU: no tf32 in the ground truth.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    S = nbu.sizes(ON_GPU)  # small shapes under the interpreter, full shapes on a GPU
    print(S)
    """
)


# --------------------------------------------------------------------------------------------
# 00_hardening
# --------------------------------------------------------------------------------------------
def hardening() -> List[Cell]:
    name = "00_hardening"
    return [
        md(
            f"""
            {badge(name)}

            # 00 · Hardening: FlashAttention-2 that is right on every shape a model produces

            `kernels.flash_attn_func` is a Triton FlashAttention-2 forward and backward with flash-attn's
            interface. A fast kernel that is right only for lengths that are multiples of its tile, for
            contiguous inputs and for head dims that are powers of two is not usable in a real model. This
            notebook shows each hardening point and checks it inline (every `assert` fails loudly, with the
            numbers):

            1. arbitrary lengths: padded keys never enter the softmax (and the error a kernel without that
               mask would make);
            2. explicit strides: views of a fused QKV projection and of (b, h, s, d) tensors, no copies;
            3. head-dim padding: 48, 80, 96 work, masked inside the kernel;
            4. clear errors for bad input;
            5. causal masks aligned bottom-right, fully masked rows give zeros (LSE +inf);
            6. error tables against the fp32 eager reference and torch SDPA;
            7. backward: masked loads at odd lengths, strided `dout`, gradient error tables;
            8. latency and peak memory against SDPA (measured on a GPU; on a CPU the committed results).

            **Where it runs.** On a GPU (Colab: *Runtime → Change runtime type → L4*) with full shapes. On a
            CPU the kernels run under Triton's interpreter (`TRITON_INTERPRET=1`) with small shapes, float16
            and float32 (bfloat16 is refused there by design); CI executes it that way. All logic lives in
            `kernels/`: these cells only narrate, call, check and plot.
            """
        ),
        SETUP,
        IMPORTS,
        md(
            """
            ## 1 · Arbitrary lengths: padded keys never enter the softmax

            The kernel streams keys and values in tiles of `BLOCK_N` rows. When `seqlen_k` is not a multiple
            of `BLOCK_N`, the last tile hangs past the end of K and V: its loads are bounds-checked (rows past
            the end read as zero) **and** its scores are set to `-inf` before the softmax. Without the second
            step a zero key gets the score `q · 0 = 0`, its `exp(0 - max)` lands in the softmax denominator,
            and every output row of the sequence is shrunk.

            `kernels.reference.attention_padded_keys_ref` emulates such an unmasked kernel (zero-padding K/V
            up to a multiple of `BLOCK_N`). Below: its error and ours against the fp32 reference, at lengths
            that are not multiples of the tile.
            """
        ),
        code(
            """
            block_n = nbu.kernel_block_n(S.head_dim, S.dtype, DEVICE)
            print(f"BLOCK_N of the forward kernel here (head dim {S.head_dim}, {S.dtype}): {block_n}")
            cases = [nbu.Case(S.batch, n, n, S.nheads, S.nheads_k, S.head_dim, S.dtype, causal=False)
                     for n in S.lengths]
            lengths_table = nbu.padded_keys_table(cases, DEVICE, block_n)
            nbu.show(lengths_table[["seqlen_k", "block_n", "padded_keys", "err_kernel", "err_unmasked", "eager_err",
                                    "bound"]])
            """
        ),
        code(
            """
            for row in lengths_table.itertuples():
                assert row.ok, f"seqlen {row.seqlen_k}: kernel rel err {row.err_kernel:.2e} > bound {row.bound:.2e}"
                assert row.err_unmasked > 1e-2 and row.err_unmasked > 10 * row.err_kernel, (
                    f"seqlen {row.seqlen_k}: the unmasked emulation's error {row.err_unmasked:.2e} should dwarf "
                    f"ours ({row.err_kernel:.2e}); {row.padded_keys} zero keys entered its softmax"
                )
            print("ours stays at PyTorch's own rounding level; without the mask the error is "
                  f"{lengths_table.err_unmasked.min():.0%} to {lengths_table.err_unmasked.max():.0%}")
            """
        ),
        md(
            """
            ## 2 · Explicit strides: views in, no copies

            Real models hand attention **views**: q, k and v sliced out of one fused QKV projection
            `(b, s, h + 2·h_kv, d)`, or `(b, h, s, d)` tensors transposed to `(b, s, h, d)`. The kernel takes
            every stride as an argument, so these run as they are; the only requirement is a contiguous head
            dim. Check: the inputs are not contiguous, nothing was copied (their storage is untouched and, on
            a GPU, no copy op runs), and the result equals the one on contiguous copies.
            """
        ),
        code(
            """
            b, s, h, hk, d = S.batch, S.seqlen, S.nheads, S.nheads_k, S.head_dim

            # (a) a fused QKV projection's output: q, k, v are slices along the head axis
            qkv = torch.randn(b, s, h + 2 * hk, d, device=DEVICE, dtype=S.dtype)
            q, k, v = qkv.split([h, hk, hk], dim=2)
            # (b) head-major (b, h, s, d) buffers seen as (b, s, h, d)
            qt, kt, vt = (torch.randn(b, n, s, d, device=DEVICE, dtype=S.dtype).transpose(1, 2) for n in (h, hk, hk))

            for label, views in (("fused QKV slices", (q, k, v)), ("transposed (b, h, s, d)", (qt, kt, vt))):
                print(f"{label}: q strides {tuple(views[0].stride())}, "
                      f"contiguous: {[t.is_contiguous() for t in views]}")
                assert not any(t.is_contiguous() for t in views), f"{label}: expected non-contiguous views"
                ptrs = [t.data_ptr() for t in views]
                out_view = flash_attn_func(*views, causal=True)
                out_copy = flash_attn_func(*(t.contiguous() for t in views), causal=True)
                assert [t.data_ptr() for t in views] == ptrs, f"{label}: the inputs were moved"
                err = rel_err(out_view, out_copy)
                print(f"    views vs copies: bitwise equal {torch.equal(out_view, out_copy)}, rel err {err:.1e}")
                assert err <= 1e-6, f"{label}: views give another result than contiguous copies (rel err {err:.2e})"
                if ON_GPU:
                    copies = nbu.copies_during(lambda: flash_attn_func(*views, causal=True))
                    print(f"    copy ops inside flash_attn_func: {copies}")
                    assert copies == [], f"{label}: flash_attn_func copied its inputs: {copies}"
            if not ON_GPU:
                print("(the no-copy-op check runs on a GPU: the interpreter itself copies every argument's storage)")
            """
        ),
        md(
            """
            ## 3 · Head-dim padding inside the kernel

            Tiles need power-of-two widths, but models use head dims such as 80 (Phi), 96 or 48. The kernel
            works in a `D_PAD = next_power_of_2(D)` wide tile and masks the extra columns in every load and
            store; callers never pad. To prove the padding is never *read*, the inputs here are views of
            buffers 8 columns wider than `D` whose extra columns hold **NaN**: a single stray read would
            poison the output.
            """
        ),
        code(
            """
            cases = [nbu.Case(S.batch, S.odd_seqlen, S.odd_seqlen, S.nheads, S.nheads_k, dim, S.dtype, causal=c)
                     for dim in S.head_dims for c in (False, True)]
            head_dim_table = nbu.forward_error_table(cases, DEVICE, layout="nan_padded")
            head_dim_table.insert(6, "D_PAD", [max(16, 1 << (d - 1).bit_length()) for d in head_dim_table.head_dim])
            nbu.show(head_dim_table[["head_dim", "D_PAD", "causal", "layout", "err_fp32", "eager_err", "ratio", "bound",
                                     "ok"]])
            nbu.assert_table_ok(head_dim_table, "head dims with NaN-poisoned padding")
            """
        ),
        md(
            """
            ## 4 · Clear errors for bad input

            Inputs are validated before anything is allocated or launched: `TypeError` for non-tensors and
            unsupported dtypes, `ValueError` for misuse, `NotImplementedError` for valid but unsupported
            requests. Each message says what was expected, what came and how to fix it.
            """
        ),
        code(
            """
            q, k, v = nbu.make_inputs(nbu.Case(1, 8, 8, 4, 4, 32, S.dtype, False), DEVICE)
            q12, k5, v5 = nbu.make_inputs(nbu.Case(1, 8, 8, 12, 5, 32, S.dtype, False), DEVICE)
            wide = torch.randn(1, 8, 4, 64, device=DEVICE, dtype=S.dtype)[..., ::2]  # head dim 32 with stride 2

            bad_calls = [
                ("dropout_p=0.1", lambda: flash_attn_func(q, k, v, dropout_p=0.1), NotImplementedError),
                ("head dim 20 (not a multiple of 8)", lambda: flash_attn_func(q[..., :20], k[..., :20], v[..., :20]),
                 NotImplementedError),
                ("12 q heads over 5 KV heads", lambda: flash_attn_func(q12, k5, v5), ValueError),
                ("q and k of different dtypes", lambda: flash_attn_func(q, k.float(), v), ValueError),
                ("int32 tensors", lambda: flash_attn_func(q.int(), k.int(), v.int()), TypeError),
                ("a list instead of a tensor", lambda: flash_attn_func(q.tolist(), k, v), TypeError),
                ("3-D q (batch dim missing)", lambda: flash_attn_func(q[0], k, v), ValueError),
                ("head dim not contiguous", lambda: flash_attn_func(wide, wide, wide), ValueError),
                ("k and v of different lengths", lambda: flash_attn_func(q, k, v[:, :5]), ValueError),
                ("q and k of different head dims", lambda: flash_attn_func(q, k[..., :16], v[..., :16]), ValueError),
                ("softmax_scale=-1.0", lambda: flash_attn_func(q, k, v, softmax_scale=-1.0), ValueError),
                ("softmax_scale passed by position (options are keyword-only)",
                 lambda: flash_attn_func(q, k, v, 0.0, 0.5), TypeError),
            ]
            if ON_GPU:
                bad_calls += [
                    ("q on the GPU, k and v on the CPU", lambda: flash_attn_func(q, k.cpu(), v.cpu()), ValueError),
                    ("CPU tensors without TRITON_INTERPRET", lambda: flash_attn_func(q.cpu(), k.cpu(), v.cpu()),
                     ValueError),
                ]
            else:
                bad_calls += [
                    ("bfloat16 under the interpreter",
                     lambda: flash_attn_func(q.bfloat16(), k.bfloat16(), v.bfloat16()), NotImplementedError),
                ]
            errors_table = nbu.check_errors(bad_calls)
            print(f"all {len(errors_table)} bad calls raised the documented exception type")
            """
        ),
        md(
            """
            ## 5 · Causal masks are aligned to the bottom-right corner

            With `causal=True`, query `i` sees key `j` iff `j <= i + seqlen_k - seqlen_q` (flash-attn >= 2.1):
            the **last** query sees every key, as in decoding with a KV cache. When `seqlen_q > seqlen_k` the
            first rows see no key at all: they output zeros (never NaN) and an LSE of `+inf`, so
            `exp(score - lse)` is 0 for every consumer (backward, split-KV merges). `1` = visible:
            """
        ),
        code(
            """
            for m, n in ((3, 5), (5, 3)):
                print(f"causal_mask({m}, {n}): query i (row) sees key j (column) iff j <= i + N - M = i {n - m:+d}")
                print(causal_mask(m, n).int(), end="\\n\\n")

            for m, n in ((3, 5), (5, 3)):
                case = nbu.Case(1, m, n, S.nheads, S.nheads_k, S.head_dim, S.dtype, causal=True)
                q, k, v = nbu.make_inputs(case, DEVICE)
                out, lse = flash_attn_func(q, k, v, causal=True, return_softmax_lse=True)
                ref, lse_ref = attention_ref(q.float(), k.float(), v.float(), causal=True)
                empty = ~causal_mask(m, n, DEVICE).any(dim=1)  # rows that see no key
                print(f"M={m}, N={n}: rows seeing no key {empty.nonzero().flatten().tolist()}, "
                      f"lse of head 0 = {lse[0, 0].tolist()}")
                assert torch.isfinite(out).all(), f"M={m}, N={n}: non-finite output"
                assert (out[:, empty] == 0).all(), f"M={m}, N={n}: rows that see no key must be zeros"
                assert torch.isposinf(lse[..., empty]).all(), f"M={m}, N={n}: their LSE must be +inf"
                assert torch.isfinite(lse[..., ~empty]).all(), f"M={m}, N={n}: other rows need a finite LSE"
                err = rel_err(out, ref)
                assert err < 1e-2, f"M={m}, N={n}: rel err {err:.2e} vs the reference"
            print("bottom-right alignment matches the reference; empty rows give zeros and LSE +inf")
            """
        ),
        md(
            """
            ## 6 · Error tables against both references

            The rule (flash-attn's tests): in float16/bfloat16 our error against the **fp32 eager reference**
            (`err_fp32`) must be at most 2x the error PyTorch's own eager attention makes in the same dtype
            (`eager_err`, the yardstick), plus a small floor; `ratio` is the quotient. `err_sdpa` compares
            with torch's `scaled_dot_product_attention` in fp32 where its conventions agree with ours
            (non-causal, or causal with `M == N`: SDPA aligns causal masks top-left), and `sdpa_err` shows
            SDPA's own same-dtype error for scale. float32 inputs get a plain bound (exact fp32 under the
            interpreter, tf32 on a GPU). `lse_diff` checks the log-sum-exp the backward pass relies on.
            """
        ),
        code(
            """
            cases = nbu.grid(batch=1, seqlens=S.table_seqlens, heads=S.table_heads, head_dims=S.table_head_dims,
                             dtypes=S.dtypes)
            fwd_table = nbu.forward_error_table(cases, DEVICE)
            nbu.show(fwd_table.groupby(["dtype", "causal", "nheads_k"])[["err_fp32", "eager_err", "ratio", "err_sdpa",
                                                                        "sdpa_err", "lse_diff"]].max())
            nbu.assert_table_ok(fwd_table, "forward error table")
            """
        ),
        code(
            """
            nbu.show(fwd_table)  # every case
            """
        ),
        md(
            """
            ## 7 · Backward

            The backward pass runs three kernels: a preprocessing step `delta = rowsum(dO * O)`, a dK/dV
            kernel (each program owns a block of keys and sums the contributions of every q head of its
            group, so GQA never materialises per-q-head dK/dV), and a dQ kernel. Each of them loads tiles
            that hang past the end of the sequence, so every load and store is masked, as in the forward.

            ### 7a · Masked backward loads at lengths that are not multiples of the tile
            Gradients against autograd through the fp32 reference (the rule allows 3x PyTorch's same-dtype
            error in the backward).
            """
        ),
        code(
            """
            assert all(n % 16 for n in S.grad_lengths), "tiles are powers of two >= 16: pick lengths that are not"
            print(f"lengths {S.grad_lengths}: every one ends in a partial tile in all three backward kernels")
            cases = [nbu.Case(S.batch, n, n, S.nheads, S.nheads_k, S.head_dim, S.dtype, causal=c)
                     for n in S.grad_lengths for c in (False, True)]
            masked_grads = nbu.grad_error_table(cases, DEVICE)
            nbu.show(masked_grads[["seqlen_q", "causal", "grad", "err_fp32", "eager_err", "ratio", "bound", "ok"]])
            nbu.assert_table_ok(masked_grads, "gradients at lengths that are not multiples of BLOCK_N")
            """
        ),
        md(
            """
            ### 7b · Fully masked rows get zero gradients
            Causal with `seqlen_q > seqlen_k`: the rows that see no key have LSE `+inf`, so the backward's
            `exp(score - lse)` is 0 there and their dQ is exactly zero, never NaN.
            """
        ),
        code(
            """
            case = nbu.Case(1, 5, 3, S.nheads, S.nheads_k, S.head_dim, S.dtype, causal=True)
            q, k, v = (t.requires_grad_() for t in nbu.make_inputs(case, DEVICE))
            dq, dk, dv = torch.autograd.grad(flash_attn_func(q, k, v, causal=True), (q, k, v), torch.ones_like(q))
            empty = ~causal_mask(5, 3, DEVICE).any(dim=1)
            assert all(torch.isfinite(g).all() for g in (dq, dk, dv)), "NaN/inf in the gradients"
            assert (dq[:, empty] == 0).all(), "dQ of rows that see no key must be zero"
            print(f"dQ of empty rows {empty.nonzero().flatten().tolist()}: all zero; no NaN anywhere")
            """
        ),
        md(
            """
            ### 7c · Explicit strides in the preprocessing step
            The upstream gradient `dout` is whatever autograd hands over: a transposed view when the next
            layer works head-major, or a zero-stride broadcast when the loss is `out.sum()`. The
            preprocessing kernel takes dout's strides as arguments (a broadcast, whose head dim is not
            contiguous, is the one case that is made contiguous first); the gradients must equal those for a
            contiguous `dout`.
            """
        ),
        code(
            """
            case = nbu.Case(S.batch, S.seqlen, S.seqlen, S.nheads, S.nheads_k, S.head_dim, S.dtype, causal=True)
            q, k, v = (t.requires_grad_() for t in nbu.make_inputs(case, DEVICE))
            out = flash_attn_func(q, k, v, causal=True)
            b, s, h, d = out.shape
            douts = {
                "transposed (b, h, s, d) view": torch.randn(b, h, s, d, device=DEVICE, dtype=out.dtype).transpose(1, 2),
                "broadcast ones (loss = out.sum())": torch.ones((), device=DEVICE, dtype=out.dtype).expand(b, s, h, d),
            }
            for label, dout in douts.items():
                grads = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
                grads_ref = torch.autograd.grad(out, (q, k, v), dout.contiguous(), retain_graph=True)
                print(f"dout {label}: strides {tuple(dout.stride())}, contiguous {dout.is_contiguous()}")
                for name, g, r in zip(("dq", "dk", "dv"), grads, grads_ref):
                    err = rel_err(g, r)
                    assert torch.isfinite(g).all() and err <= 1e-6, (
                        f"{label}: {name} differs from the one for a contiguous dout (rel err {err:.2e})")
                print(f"    dq, dk, dv equal to those of a contiguous dout (bitwise: "
                      f"{all(torch.equal(g, r) for g, r in zip(grads, grads_ref))})")
            """
        ),
        md(
            """
            ### 7d · Gradient error tables against both references
            Same columns as the forward table, one row per gradient; `err_sdpa` is against autograd through
            torch SDPA in fp32 (where its causal convention agrees). dK/dV of GQA and MQA are compared with
            autograd through `repeat_interleave`, which sums each KV head's gradient over its q-head group.
            """
        ),
        code(
            """
            cases = nbu.grid(batch=1, seqlens=S.grad_seqlens, heads=S.grad_heads, head_dims=(S.head_dim,),
                             dtypes=S.dtypes)
            grad_table = nbu.grad_error_table(cases, DEVICE)
            nbu.show(grad_table.groupby(["dtype", "causal", "grad"])[["err_fp32", "eager_err", "ratio", "err_sdpa",
                                                                     "sdpa_err"]].max())
            nbu.assert_table_ok(grad_table, "gradient error table")
            """
        ),
        md(
            """
            ## 8 · Latency and peak memory against SDPA

            On a GPU this measures, live, with the project's benchmark suite (`benchmarks/`, also
            `python -m benchmarks`): bfloat16, head dim 128, 32 heads, `batch × seqlen = 16384` tokens,
            seqlen 1024 to 16384, causal and not, forward (`fwd`) and forward + backward (`fwd_bwd`), against
            SDPA's flash (FlashAttention-2) and cuDNN backends where this torch can pick them. Each kernel is
            checked against the reference before it is timed. Timing: CUDA events, median after warm-up, L2
            flushed (`benchmarks.measure.time_fn`); memory: the peak allocated beyond the inputs
            (`benchmarks.measure.peak_memory_delta`). Rows go to `results/<gpu>/bench_prefill_fwd.csv` and
            `bench_prefill_fwd_bwd.csv`, plots to `figures/<gpu>/`.

            On a CPU it plots the committed results instead, titled with the GPU they were measured on.
            """
        ),
        code(
            """
            from benchmarks import grids

            mha = [s for s in grids.prefill_shapes() if s.grid == "issue" and s.head_dim == 128 and s.nheads_k == 32]
            if ON_GPU:  # rows appended to results/<gpu>/bench_prefill_fwd.csv and bench_prefill_fwd_bwd.csv
                nbu.run_suite(["prefill_fwd", "prefill_fwd_bwd"], mha, peers=["ours", "sdpa_flash", "sdpa_cudnn"])
            results = nbu.bench_results("prefill_fwd", "prefill_fwd_bwd")
            """
        ),
        code(
            """
            if results is None:
                print("no committed GPU results yet: nothing to plot (run this notebook on a GPU to make them)")
            else:
                where = {"grid": "issue", "dtype": "bf16", "head_dim": 128, "nheads": 32, "nheads_k": 32}
                saved = nbu.plot_lines(results, x="seqlen", name="prefill_vs_sdpa",
                                       x_label="seqlen (batch x seqlen = 16384)",
                                       title="FlashAttention-2 in Triton vs SDPA: bf16, 32 heads, D=128", where=where)
                if saved:  # TFLOP/s per implementation, and ours / each competitor
                    baselines = ("sdpa_flash", "sdpa_cudnn", "flex")
                    nbu.show(nbu.summary_table(results, x="seqlen", baselines=baselines, where=where), "{:.2f}")
            """
        ),
    ]


# --------------------------------------------------------------------------------------------
# 01_gqa
# --------------------------------------------------------------------------------------------
def gqa() -> List[Cell]:
    name = "01_gqa"
    return [
        md(
            f"""
            {badge(name)}

            # 01 · GQA and MQA: many query heads, few key/value heads, no copies

            Grouped-query attention (Llama 2/3, Mistral, Qwen) lets `H` query heads share `H_KV` key/value
            heads: query head `h` reads KV head `h // G`, with group size `G = H // H_KV`. Multi-query
            attention is the extreme `H_KV = 1`. The KV cache and K/V projections shrink by `G`.

            The old way to run GQA through an MHA kernel is to **expand** K and V with `repeat_interleave`,
            materialising `G` copies of every KV head (and, in training, per-q-head dK/dV that are then
            summed). `kernels.flash_attn_func` maps heads inside the kernel instead: the forward reads KV
            head `h // G` directly, and the backward sums each KV head's dK/dV over its group in registers.

            This notebook sweeps group ratios 1, 2, 4, 8, 16 at 16 query heads (16 = MQA), causal and not,
            checks the forward and backward inline, and compares latency and memory with SDPA
            (`enable_gqa=True`) and with expanding K/V. On a CPU it runs under the Triton interpreter with
            small sequence lengths and head dims, and plots committed GPU results.
            """
        ),
        SETUP,
        IMPORTS,
        md(
            """
            ## 1 · The head mapping
            Query head `h` uses KV head `h // G`: consecutive query heads share a KV head, as
            `repeat_interleave` would lay them out.
            """
        ),
        code(
            """
            for hk in S.gqa_nheads_k:
                group = S.gqa_nheads // hk
                kind = "MHA" if group == 1 else ("MQA" if hk == 1 else "GQA")
                kv_head_of = [h // group for h in range(S.gqa_nheads)]
                print(f"{kind} {S.gqa_nheads}:{hk} (G={group:2d}) q head -> KV head: {kv_head_of}")
            """
        ),
        md(
            """
            ## 2 · Forward over the sweep
            Every ratio, causal and not, `seqlen_q == seqlen_k` and `seqlen_q != seqlen_k`, against the fp32
            reference (which expands K/V with `repeat_interleave`) and SDPA with `enable_gqa=True` where the
            conventions agree. Same rule and columns as in notebook 00.
            """
        ),
        code(
            """
            heads = [(S.gqa_nheads, hk) for hk in S.gqa_nheads_k]
            fwd_cases = nbu.grid(batch=S.gqa_batch, seqlens=S.gqa_seqlens, heads=heads, head_dims=(S.gqa_head_dim,),
                                 dtypes=S.dtypes)
            gqa_fwd = nbu.forward_error_table(fwd_cases, DEVICE)
            gqa_fwd.insert(5, "group", gqa_fwd.nheads // gqa_fwd.nheads_k)
            nbu.show(gqa_fwd.pivot_table(index=["dtype", "group"], columns="causal", values=["err_fp32", "ratio"],
                                         aggfunc="max"))
            nbu.assert_table_ok(gqa_fwd, "GQA/MQA forward")
            """
        ),
        md(
            """
            ## 3 · Backward over the sweep
            dQ, dK, dV against autograd through the fp32 reference. Autograd through `repeat_interleave` sums
            the gradient of each expanded copy back into its KV head, which is exactly what the kernel's
            dK/dV must equal.
            """
        ),
        code(
            """
            grad_cases = nbu.grid(batch=S.gqa_batch, seqlens=S.gqa_grad_seqlens, heads=heads,
                                  head_dims=(S.gqa_head_dim,), dtypes=(S.dtype,))
            gqa_grads = nbu.grad_error_table(grad_cases, DEVICE)
            gqa_grads.insert(5, "group", gqa_grads.nheads // gqa_grads.nheads_k)
            nbu.show(gqa_grads.pivot_table(index=["group", "grad"], columns="causal", values=["err_fp32", "ratio"],
                                           aggfunc="max"))
            nbu.assert_table_ok(gqa_grads, "GQA/MQA gradients")
            """
        ),
        md(
            """
            ## 4 · dK/dV are summed over each group
            The same kernel run as plain MHA on K/V expanded to 16 heads gives one dK/dV per query head.
            Summing those over each group of `G` query heads must give the GQA kernel's dK/dV, and the
            outputs and dQ must agree. (Shown in float32 on the CPU, where they agree to rounding; on a GPU in
            bfloat16, where the expanded path rounds each head's gradient before the sum and the GQA kernel
            once after it, hence a 1e-2 bound.)
            """
        ),
        code(
            """
            grouped = [hk for hk in S.gqa_nheads_k if hk < S.gqa_nheads]  # GQA and MQA
            sum_cases = [nbu.Case(S.gqa_batch, *S.gqa_seqlens[0], S.gqa_nheads, hk, S.gqa_head_dim, dt, causal=c)
                         for hk in grouped for dt in S.gqa_sum_dtypes for c in (False, True)]
            group_sums = nbu.gqa_group_sum_table(sum_cases, DEVICE)
            nbu.show(group_sums[["nheads", "nheads_k", "group", "dtype", "causal", "err_out", "err_dq", "err_dk",
                                 "err_dv", "bound", "ok"]])
            nbu.assert_table_ok(group_sums, "GQA dK/dV == expanded MHA dK/dV summed over each group")
            """
        ),
        md(
            """
            ## 5 · Ratios that are not powers of two, and ratios that do not divide
            Any whole group size works (12 query heads over 4 KV heads, `G = 3`); a head count that does not
            divide is refused with a message that says why.
            """
        ),
        code(
            """
            odd_cases = [nbu.Case(S.gqa_batch, *S.gqa_seqlens[0], 12, 4, S.gqa_head_dim, S.dtype, causal=c)
                         for c in (False, True)]
            odd_fwd = nbu.forward_error_table(odd_cases, DEVICE)
            odd_grads = nbu.grad_error_table(odd_cases, DEVICE)
            nbu.show(odd_grads[["nheads", "nheads_k", "causal", "grad", "err_fp32", "eager_err", "ratio", "ok"]])
            nbu.assert_table_ok(odd_fwd, "12:4 forward")
            nbu.assert_table_ok(odd_grads, "12:4 gradients")

            q, k, v = nbu.make_inputs(nbu.Case(1, 8, 8, 12, 5, 32, S.dtype, False), DEVICE)
            _ = nbu.check_errors([
                ("12 q heads over 5 KV heads", lambda: flash_attn_func(q, k, v), ValueError),
                ("0 KV heads", lambda: flash_attn_func(q, k[:, :, :0], v[:, :, :0]), ValueError),
            ])
            """
        ),
        md(
            """
            ## 6 · What expanding K/V costs in memory
            Expanding holds `H` heads of K and V instead of `H_KV`: for the benchmark shape below (bfloat16,
            `batch × seqlen = 16384` tokens, 16 query heads, head dim 128) the copies alone are:
            """
        ),
        code(
            """
            n = S.gqa_bench_seqlen
            nbu.show(nbu.kv_bytes_table(S.bench_tokens // n, n, S.gqa_bench_nheads, S.gqa_nheads_k, S.bench_head_dim,
                                        S.bench_dtype), "{:.1f}")
            """
        ),
        md(
            """
            ## 7 · Latency and peak memory: ours vs SDPA `enable_gqa=True` vs expanded K/V + SDPA

            On a GPU this measures, live, with the benchmark suite (`benchmarks/`, the group-size sweep
            `benchmarks.grids.gqa_shapes`): bfloat16, head dim 128, 16 query heads, seqlen 4096 with
            `batch × seqlen = 16384` tokens, each group ratio, causal and not, forward and forward + backward,
            against SDPA's flash and cuDNN backends with `enable_gqa=True` and against K/V expanded by
            `repeat_interleave`, then SDPA. Attention FLOPs do not depend on the ratio, so an ideal GQA kernel's
            latency is flat across it; the expanded path pays for the copies in time and memory (peak memory
            beyond the inputs shows them). Rows go to `results/<gpu>/bench_prefill_fwd.csv` and
            `bench_prefill_fwd_bwd.csv` (grid "gqa"), plots to `figures/<gpu>/`. On a CPU the committed results
            are plotted, titled with the GPU they came from.
            """
        ),
        code(
            """
            from benchmarks import grids

            if ON_GPU:  # rows appended to results/<gpu>/bench_prefill_fwd.csv and bench_prefill_fwd_bwd.csv
                nbu.run_suite(["prefill_fwd", "prefill_fwd_bwd"], grids.gqa_shapes(),
                              peers=["ours", "sdpa_flash", "sdpa_cudnn", "sdpa_expand_kv"])
            results = nbu.bench_results("prefill_fwd", "prefill_fwd_bwd")
            """
        ),
        code(
            """
            if results is None:
                print("no committed GPU results yet: nothing to plot (run this notebook on a GPU to make them)")
            else:
                where = {"grid": "gqa", "dtype": "bf16", "head_dim": 128}
                title = "GQA/MQA: Triton vs SDPA enable_gqa vs expanded K/V, bf16, 16 q heads, D=128"
                saved = nbu.plot_lines(results, x="group", name="gqa_vs_sdpa", title=title, where=where,
                                       x_label="group size G = H / H_KV (16 = MQA)")
                if saved:  # TFLOP/s per implementation, and ours / each competitor
                    baselines = ("sdpa_flash", "sdpa_cudnn", "sdpa_expand_kv")
                    nbu.show(nbu.summary_table(results, x="group", baselines=baselines, where=where), "{:.2f}")
            """
        ),
    ]


# --------------------------------------------------------------------------------------------
# 02_decode
# --------------------------------------------------------------------------------------------
def decode() -> List[Cell]:
    name = "02_decode"
    return [
        md(
            f"""
            {badge(name)}

            # 02 · Decode: one new token against a KV cache, as fast as the memory allows

            In autoregressive generation every step brings one new query token per request (a few when
            verifying speculative drafts) that attends over everything the request has seen: its **KV cache**.
            `kernels.flash_attn_with_kvcache` is a decode kernel separate from prefill, with flash-attn's
            interface: per-request cache lengths (`cache_seqlens`), the new tokens' K/V written into the cache
            **in the same launch** that attends over it, the q heads of a GQA group served by one program so
            each cached byte is read once, and split-KV (flash-decoding) so that a single long request still
            fills the GPU. `kernels.KVCache` owns the buffers and the lengths.

            This notebook:

            1. shows why decode is bound by memory bandwidth (bytes per FLOP of one step);
            2. checks inline (every `assert` fails loudly): prefill equals token-by-token decode, a ragged
               batch against the reference, split vs unsplit, `seqlen_q > 1` with the bottom-right causal mask,
               the append writes exactly the new slots, overflow raises, and a `KVCache` round trip;
            3. measures (on a GPU) latency, peak memory and GB/s against the seed's two eager baselines and
               SDPA with a length-1 query, and the effect of split-KV at batch 1 with CUDA-graph replay.

            **Where it runs.** On a GPU with full shapes (bfloat16, 32 q heads, head dim 128). On a CPU the
            kernels run under Triton's interpreter with small shapes in float16, and the measurement sections
            plot the committed GPU results (`results/<gpu>/decode*.csv`), or say that there are none yet.
            """
        ),
        SETUP,
        code(
            """
            import nbutils as nbu
            from benchmarks import grids, measure, report
            from kernels import KVCache, causal_mask, flash_attn_with_kvcache

            torch.manual_seed(0)
            # The fp32 references must be true fp32 on a GPU: no tf32 in the ground truth.
            torch.backends.cuda.matmul.allow_tf32 = False
            torch.backends.cudnn.allow_tf32 = False
            S = nbu.decode_sizes(ON_GPU)  # small shapes under the interpreter, full shapes on a GPU
            print(S)
            """
        ),
        md(
            """
            ## 1 · Why decode is bandwidth bound

            One decode step of one request with `H` q heads over `H_KV` KV heads, head dim `D` and a cache of
            `N` tokens computes `q·Kᵀ` and `p·V`: `4·H·N·D` FLOPs. It must read the whole cache once:
            `2·N·H_KV·D` elements of K and V, 2 bytes each in bf16. That is `H / H_KV = G` FLOPs per byte
            (4 for Llama-style 32:8 GQA) whatever the cache length or the batch (every request reads its own
            cache). A GPU is compute bound only above its **ridge point**, peak FLOP/s ÷ bandwidth: about 184
            FLOP/byte on an H200. Decode sits ~46x below it, so the time of a step is the cache size divided by
            the memory bandwidth, and the kernel's job is to read every byte once (GQA read-once: a kernel that
            re-reads K/V per q head does `G` times the traffic) at full bandwidth (enough programs in flight:
            split-KV when the batch is small).

            The table uses an H200's ceilings as measured by the benchmark suite (`results/nvidia-h200/
            bench_ceilings.csv`, source printed below). On a GPU the same table follows for the present
            card, with its ceilings measured now (`benchmarks.measure.ceilings()`: a large bf16 matmul, a device copy
            counting bytes read and written).
            """
        ),
        code(
            """
            h200 = measure.H200_MEASURED_CEILINGS
            print(f"{h200['gpu']}: {h200['matmul_tflops']:.0f} TFLOP/s (bf16 matmul), {h200['copy_gbps']:.0f} GB/s "
                  f"(device copy, read + write)\\n  source: {h200['source']}")
            shape = (1, S.bench_nheads, S.bench_nheads_k, S.bench_head_dim, S.bench_dtype, S.bench_cache_lens)
            roofline = nbu.decode_roofline_table(*shape, h200)
            print(f"one decode step, batch 1, {nbu.dtype_name(S.bench_dtype)}, {S.bench_nheads} q heads, "
                  f"{S.bench_nheads_k} KV heads, D={S.bench_head_dim}, against the {h200['gpu']}'s ceilings:")
            nbu.show(roofline)

            group = S.bench_nheads // S.bench_nheads_k
            ridge = roofline.ridge.iloc[0]
            assert ((roofline.flop_per_byte - group).abs() < 1e-9).all(), "2-byte K/V: a step does G FLOPs per byte"
            assert (roofline.bound == "memory").all() and ridge > 10 * group, "decode must sit far below the ridge"
            print(f"\\n{group} FLOP/byte against a ridge of {ridge:.0f} FLOP/byte: {ridge / group:.0f}x below it. "
                  f"The memory floor is {roofline.t_memory_us.iloc[-1] / roofline.t_compute_us.iloc[-1]:.0f}x the "
                  f"compute floor at every length.")

            CEILINGS = None
            if ON_GPU:
                CEILINGS = measure.ceilings()  # measured now, on this GPU
                print(f"\\n{kernels.env_summary()['gpu']}, measured now: {CEILINGS['matmul_tflops']:.0f} TFLOP/s, "
                      f"{CEILINGS['copy_gbps']:.0f} GB/s")
                nbu.show(nbu.decode_roofline_table(*shape, CEILINGS))
            """
        ),
        md(
            """
            ## 2 · Prefill equals token-by-token decode

            The seed's test, and the strongest single check of a decode kernel: run causal prefill
            (`kernels.flash_attn_func(causal=True)`) over a sequence; then decode the same sequence one token at
            a time, each call writing token `t`'s K/V into the cache (filled with stale random rows that must
            never be read) and attending over rows `[0, t]` **in the same call**. The outputs must match, and
            both must match the fp32 reference by flash-attn's rule (error at most 2x PyTorch's own same-dtype
            error plus a small floor). Lengths on both sides of the kernel's `BLOCK_N`; MHA, GQA and MQA.
            """
        ),
        code(
            """
            equivalence = nbu.decode_equivalence_table(
                batch=S.ar_batch, nheads=S.nheads, nheads_k_values=S.ar_nheads_k, head_dim=S.head_dim,
                lengths=S.ar_lengths, dtype=S.dtype, device=DEVICE)
            nbu.show(equivalence)
            nbu.assert_table_ok(equivalence, "prefill == token-by-token decode")
            """
        ),
        md(
            """
            ## 3 · A ragged batch against the reference

            Requests in one batch have different lengths (here including 0 and 1). Each row below is one
            request, compared with `kernels.reference.attention_ref` run over the **whole** cache buffer with
            `key_padding_lengths` masking every row at or past the request's length, with and without appending
            a new token, unsplit, split in 3 (the short requests' later splits are empty) and with the split
            heuristic (`num_splits=0`). A request that sees no key must give zeros and an LSE of `+inf`, never
            NaN.
            """
        ),
        code(
            """
            ragged = nbu.decode_ragged_table(
                lengths=S.ragged_lengths, seqlen_cache=S.ragged_cache, nheads=S.nheads, nheads_k=S.nheads_k,
                head_dim=S.head_dim, dtype=S.dtype, device=DEVICE)
            nbu.show(ragged)
            nbu.assert_table_ok(ragged, "ragged batch vs attention_ref(key_padding_lengths=...)")
            assert (ragged.keys_seen == 0).any() and (ragged.keys_seen == 1).any(), "the batch must hold 0 and 1 keys"
            """
        ),
        md(
            """
            ## 4 · Split-KV and unsplit agree

            With `num_splits = n` each request's cache is cut into `n` chunks streamed by parallel programs;
            each writes a partial output and its log-sum-exp, and a combine kernel merges them. The split size
            depends on the *allocated* cache length only (so nothing recompiles as lengths grow): splits past a
            request's length are empty and get weight 0. Every split count must give the unsplit result up to
            rounding, for one and several query tokens. (`splits_used` is what the launch plan picked; under the
            interpreter the heuristic assumes a 4-SM device.)
            """
        ),
        code(
            """
            splits = nbu.decode_split_table(
                lengths=S.ragged_lengths, seqlen_cache=S.ragged_cache, nheads=S.nheads, nheads_k=S.nheads_k,
                head_dim=S.head_dim, dtype=S.dtype, device=DEVICE, seqlen_q_values=S.split_seqlen_q,
                num_splits_values=S.split_check_values)
            nbu.show(splits)
            nbu.assert_table_ok(splits, "split-KV vs unsplit")
            assert (splits.splits_used.dropna() > 1).any(), "at least one configuration must actually split"
            """
        ),
        md(
            """
            ## 5 · Several query tokens: the causal mask is aligned bottom-right

            Verifying a speculative draft sends `seqlen_q > 1` tokens. With `causal=True`, token `t` of request
            `b` sees key `j` iff `j <= t + N_b - seqlen_q`, where `N_b` counts the request's keys (its cached
            rows, plus the new tokens when they are appended): every cached key is visible and the new tokens
            see each other causally. For 3 cached keys and 2 appended tokens (1 = visible):
            """
        ),
        code(
            """
            print(causal_mask(2, 3 + 2).int())
            causal_table = nbu.decode_causal_table(
                seqlen_q_values=S.causal_seqlen_q, lengths=S.causal_lengths, seqlen_cache=S.causal_cache,
                nheads=S.nheads, nheads_k_values=S.causal_nheads_k, head_dim=S.head_dim, dtype=S.dtype, device=DEVICE)
            nbu.show(causal_table)
            nbu.assert_table_ok(causal_table, "seqlen_q > 1, causal bottom-right, vs the per-request reference")
            """
        ),
        md(
            """
            ## 6 · The append writes exactly the new slots

            The new K/V land in the cache at rows `[L_b, L_b + seqlen_q)` of each request, in place, during the
            attention launch; nothing else may change. The caches here are views of buffers 8 columns wider
            than the head dim whose extra columns hold NaN, and the head dim is not a power of two (the kernel
            pads it): the table lists, per request, the rows in which any byte changed.
            """
        ),
        code(
            """
            for seqlen_q in S.append_seqlen_q:
                append_table = nbu.decode_append_table(
                    lengths=S.append_lengths, seqlen_cache=S.append_cache, seqlen_q=seqlen_q, nheads=S.nheads,
                    nheads_k=S.nheads_k, head_dim=S.append_head_dim, dtype=S.dtype, device=DEVICE)
                nbu.show(append_table)
                nbu.assert_table_ok(append_table, f"append of {seqlen_q} token(s): only rows [L_b, L_b + {seqlen_q})")
            """
        ),
        md(
            """
            ## 7 · Overflow raises

            Where the lengths are known on the host (an `int`, a CPU tensor, `KVCache`), a call that would
            write or read past the allocated cache raises `ValueError` before anything is launched or written.
            Lengths held in a GPU tensor cannot be checked without a host sync (which would break CUDA graphs):
            there the kernel clamps every length to the buffer, so no read or write ever leaves it, and keeping
            the lengths in range is the caller's job (`KVCache` does it).
            """
        ),
        code(
            """
            q, k_cache, v_cache, k, v = nbu.decode_inputs(3, 32, 2, S.nheads, S.nheads_k, S.head_dim, S.dtype, DEVICE)
            lengths = lambda *xs: torch.tensor(xs, dtype=torch.int32)  # a CPU tensor: known on the host
            q9, k9, v9 = nbu.make_inputs(nbu.Case(1, 9, 9, S.nheads, S.nheads_k, S.head_dim, S.dtype, True), DEVICE)
            k_before, v_before = k_cache.clone(), v_cache.clone()
            overflow_table = nbu.check_errors([
                ("int cache_seqlens=31 + 2 new tokens > 32 rows",
                 lambda: flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=31), ValueError),
                ("CPU tensor [0, 30, 31]: request 2 overflows",
                 lambda: flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lengths(0, 30, 31)),
                 ValueError),
                ("a negative length",
                 lambda: flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lengths(0, -1, 3)),
                 ValueError),
                ("no append, but 33 > 32 rows",
                 lambda: flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=33), ValueError),
                ("KVCache(max_seqlen=8).prefill of a 9-token prompt",
                 lambda: KVCache(1, 8, S.nheads_k, S.head_dim, dtype=S.dtype, device=DEVICE).prefill(q9, k9, v9),
                 ValueError),
            ])
            assert torch.equal(k_cache, k_before) and torch.equal(v_cache, v_before), "a raising call wrote the cache"
            flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=30)  # 30 + 2 = 32: exactly fills the cache
            assert torch.equal(k_cache[:, 30:], k) and torch.equal(v_cache[:, 30:], v)
            print(f"all {len(overflow_table)} overflowing calls raised ValueError and left the cache untouched; "
                  "an append that exactly fills the cache works")
            """
        ),
        md(
            """
            ## 8 · `KVCache`: prefill, decode, reset, round trip

            `KVCache` owns preallocated buffers and per-request lengths (a device tensor the kernel reads and
            advances without a host sync, plus a host mirror for the overflow checks). Below: prompts prefilled
            with the prefill kernel, decode steps of one or more tokens, one request reset and prefilled again
            while the other keeps its history (the batch becomes ragged), a decode of both, and an overflow.
            Every output is compared with the reference over the request's own sequence.
            """
        ),
        code(
            """
            round_trip = nbu.kvcache_round_trip_table(
                batch=S.kv_batch, prompt=S.kv_prompt, steps=S.kv_steps, new_prompt=S.kv_new_prompt, nheads=S.nheads,
                nheads_k=S.nheads_k, head_dim=S.head_dim, dtype=S.dtype, device=DEVICE)
            nbu.show(round_trip)
            nbu.assert_table_ok(round_trip, "KVCache round trip")
            """
        ),
        md(
            """
            ## 9 · Latency, peak memory and bandwidth against the baselines

            On a GPU this measures, live, one full decode step (append the new token, attend) at bf16, 32 q
            heads, 8 KV heads, head dim 128, batch 1 and 8, cache lengths 1024 to 65536, for:

            - **ours**: `flash_attn_with_kvcache`, the append fused into the launch;
            - **SDPA with a length-1 query**: the append as a slice copy into the preallocated cache, then
              `scaled_dot_product_attention` (its own backend choice) over the valid rows, `enable_gqa=True`;
            - the seed's two eager baselines (`kernels.reference`): **`decode_eager_slice`**, a preallocated
              cache sliced to the current length, KV heads expanded by `repeat_interleave`, scores materialised;
              and **`decode_eager_cat`**, the same attention on a cache grown by `torch.cat` every step.

            Each one is checked against the reference before it is timed. Latency is per eager call (CUDA
            events, median; what a Python loop sees), peak memory is what one step allocates beyond its inputs,
            and GB/s is K+V bytes read ÷ time with CUDA-graph replay, against the device-copy bandwidth measured
            in the same run. Inputs are rotated so that small caches are not read from L2. The measuring is the
            benchmark suite's (`benchmarks/`, `python -m benchmarks --suite decode`): rows go to
            `results/<gpu>/bench_decode.csv`, the plot to `figures/<gpu>/decode.png`. On a CPU: the committed
            results.
            """
        ),
        code(
            """
            bench_where = {"grid": "issue", "metric": "step", "page_size": 0, "dtype": "bf16", "nheads": S.bench_nheads,
                           "nheads_k": S.bench_nheads_k, "head_dim": S.bench_head_dim}
            peers = ["ours", "sdpa", "eager_slice", "eager_cat"]
            shapes = [grids.DecodeShape(b, n, S.bench_nheads, S.bench_nheads_k, S.bench_head_dim)
                      for b in S.bench_batches for n in S.bench_cache_lens]
            if ON_GPU:  # rows appended to results/<gpu>/bench_decode.csv
                nbu.run_suite(["decode"], shapes, peers=peers)
            decode_results = nbu.bench_results("decode")
            if decode_results is not None:
                decode_results = decode_results[decode_results["impl"].isin(peers)
                                                & decode_results["batch"].isin(S.bench_batches)]
            """
        ),
        code(
            """
            if decode_results is None:
                print("no committed GPU results yet: nothing to plot (run this notebook on a GPU to measure them)")
            else:
                title = "Decode step (append + attend), bf16, 32 q heads, 8 KV heads, D=128"
                if nbu.plot_decode(decode_results, name="decode", title=title, where=bench_where):
                    print("K+V GB/s with CUDA-graph replay, and ours / each other implementation:")
                    nbu.show(nbu.decode_summary_table(decode_results, where=bench_where), "{:.2f}")
                    print("latency per eager call (us):")
                    us = decode_results.assign(us=decode_results["median_ms"] * 1e3)
                    nbu.show(nbu.decode_summary_table(us, value="us", where=bench_where), "{:.1f}")
                    print("peak memory beyond the inputs (MiB):")
                    memory = nbu.decode_summary_table(decode_results, value="peak_mem_mib", where=bench_where)
                    nbu.show(memory, "{:.2f}")
            """
        ),
        md(
            """
            ## 10 · Split-KV at batch 1

            One request with 8 KV heads launches 8 programs when its cache is not split: on a GPU with over
            a hundred SMs (132 on an H200) most of the chip idles and the step cannot reach the memory
            bandwidth.
            Splitting each cache into `n` chunks launches `8·n` programs plus a small combine kernel. Below: the
            K+V bandwidth of one step against `num_splits` (1 = no split, then powers of two; the star is the
            heuristic's pick for `num_splits=0`), with SDPA at the same shape dashed and the device-copy line.
            Batch-1 steps last tens of microseconds, so they are timed with CUDA-graph replay (launch overhead
            excluded; `benchmarks.measure.time_cuda_graph`). The benchmark suite measures it
            (`python -m benchmarks --suite decode_splits`): rows go to `results/<gpu>/bench_decode_splits.csv`, the
            plot to `figures/<gpu>/bench_decode_splits_bf16.png`.
            """
        ),
        code(
            """
            if ON_GPU:  # rows appended to results/<gpu>/bench_decode_splits.csv
                nbu.run_suite(["decode_splits"], grids.decode_split_shapes())
            split_results = nbu.bench_results("decode_splits")
            """
        ),
        code(
            """
            if split_results is None:
                print("no committed GPU results yet: nothing to plot (run this notebook on a GPU to measure them)")
            else:
                if report.plot_decode_splits(split_results):
                    print("K+V GB/s per configuration (CUDA-graph replay):")
                    nbu.show(report.decode_splits_table(split_results), "{:.0f}")
            """
        ),
    ]


def notebooks() -> dict:
    return {"00_hardening": hardening(), "01_gqa": gqa(), "02_decode": decode(), "03_benchmarks": benchmarks(),
            "04_serving": serving()}


def main(argv=None) -> int:
    return cli(notebooks, __doc__, "scripts/make_notebooks.py", argv)


if __name__ == "__main__":
    sys.exit(main())
