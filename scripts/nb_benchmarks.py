"""Cells of notebooks/03_benchmarks.ipynb (the benchmark suite: run live on a GPU, committed results on a CPU).

    python scripts/nb_benchmarks.py            # write notebooks/03_benchmarks.ipynb
    python scripts/nb_benchmarks.py --check    # exit 1 if the notebook on disk differs from what this writes

Uses scripts/notebook_cells.py's helpers (md, code, badge, the shared SETUP cell, build);
scripts/make_notebooks.py lists this notebook with the others. The cells only call benchmarks.suite
(measure) and benchmarks.report (load, tables, figures).
"""

from __future__ import annotations

import sys
from typing import List

from notebook_cells import SETUP, Cell, badge, cli, code, md

NAME = "03_benchmarks"


def benchmarks() -> List[Cell]:
    return [
        md(
            f"""
            {badge(NAME)}

            # 03 · Benchmarks: our kernels against SDPA, FlexAttention and eager PyTorch

            `python -m benchmarks` measures every kernel of this package on the present GPU against the
            implementations a user would otherwise pick, in one run, the same way for all of them:

            - `prefill_fwd`: `flash_attn_func` against SDPA with each backend forced (flash, cuDNN,
              mem-efficient), FlexAttention (compiled) and eager PyTorch, in TFLOP/s;
            - `prefill_fwd_bwd`: the same through forward + backward (3.5x the forward's FLOPs);
            - `decode`: `flash_attn_with_kvcache` over a dense cache and paged caches (pages of 16, 64, 256)
              against SDPA with a length-1 query, FlexAttention and the seed's two eager baselines, in K+V
              GB/s and microseconds per step;
            - `chunked`: `flash_attn_with_kvcache` with a causal chunk of new tokens against our own
              `flash_attn_func` on the same shapes, in TFLOP/s.

            Rows go to `results/<gpu>/bench_<suite>.csv` (GPU name, torch, triton, cuDNN, kernel config, date
            and commit on every row), figures to `figures/<gpu>/`, so an L4 run never overwrites the H200's.
            The CLI is resumable and has a time budget: `python -m benchmarks --quick --max-minutes 8`.

            **Where it runs.** On a GPU (Colab: *Runtime → Change runtime type → L4*) this notebook runs the
            quick suite live into a scratch folder (the committed results are never overwritten) and plots
            it. On a CPU it plots the committed results of `results/nvidia-h200/`, titled with the GPU they
            came from; suites without committed results yet are skipped with a message.
            """
        ),
        SETUP,
        code(
            """
            import math
            import tempfile

            import nbutils as nbu
            from benchmarks import grids, measure, report, results, suite

            torch.manual_seed(0)
            SUITES = grids.SUITES  # what the live run measures; e.g. ("decode",) to run one suite
            MAX_MINUTES = None  # a time budget for the live run (it stops cleanly, rows so far are kept)
            if ON_GPU:
                GPU = kernels.env_summary()["gpu"]
                LIVE = Path(tempfile.gettempdir()) / "kernels_bench_live"  # not results/: committed rows stay
                RESULTS, FIGURES = LIVE / "results", LIVE / "figures"
            else:
                GPU = "NVIDIA H200"  # the committed results plotted on a CPU
                RESULTS = REPO_ROOT / "results"
                FIGURES = Path(tempfile.mkdtemp(prefix="kernels_bench_figures_"))  # committed figures untouched
            print(f"results from {RESULTS / results.gpu_slug(GPU)}, figures to {FIGURES / results.gpu_slug(GPU)}")
            """
        ),
        md(
            """
            ## 1 · The method

            - **FLOPs and bytes.** Prefill: `4·B·H·M·N·D`, half of it when causal (exact bottom-right pairs when
              `M != N`, as in chunked prefill), 3.5x for forward + backward. Decode reads the whole cache once,
              so it is judged by K+V bytes read per second (`benchmarks.measure.decode_kv_bytes`).
            - **Timing.** Fixed seeds; warm-up calls excluded; median (with p20/p80/min) of N calls timed with
              CUDA events. Before each prefill call a buffer of twice the L2 size is zeroed outside the timed
              region; decode inputs rotate over copies that together exceed twice the L2, so small shapes are
              not flattered by a warm cache. Decode steps are also timed with CUDA-graph replay (the headline
              number below 0.5 GB of K+V, where launch overhead would dominate); the host overhead of one
              eager step (batch 1 x cache 4096) is its own row. Peak memory is what one call allocates on top
              of what existed before it.
            - **Ceilings, measured in the same run.** A bf16 8192³ matmul (TFLOP/s), a device copy counting
              read + write, and a read-only streaming kernel (GB/s; the bandwidth ceiling is the larger).
            - **Correctness first.** Each of our kernels is compared with `kernels.reference.attention_ref` on
              every shape before it is timed (flash-attn's rule: at most 2x PyTorch's own same-dtype error,
              3x for gradients); a wrong result is written as a `wrong` row and never timed. Peers only
              have to run; one that fails on a shape is an `error` row, one missing from this torch is skipped.
            - **Grids.** The earlier issues' grids (prefill: 32 q heads over 32 or 8 KV heads, batch x seqlen
              = 16384 tokens, causal and not; decode: batch 1-128 x cache 1024-65536), at head dims 128 and 64,
              plus the seed's own setup (32 q / 8 KV heads, D=128, batch 2) so its tables compare row by row.
            """
        ),
        code(
            """
            for suite in grids.SUITES:
                quick, full = grids.suite_shapes(suite, quick=True), grids.suite_shapes(suite)
                print(f"{suite:>16}: {len(quick):3d} shapes quick, {len(full):3d} full")
            seed = [s for s in grids.prefill_shapes() if s.grid == "seed"]
            assert {(s.batch, s.nheads, s.nheads_k, s.head_dim) for s in seed} == {(2, 32, 8, 128)}
            assert {s.seqlen for s in seed} == {2048, 4096, 8192}, "the seed's prefill setup must be in the grid"
            assert {s.head_dim for s in grids.prefill_shapes()} == {64, 128}
            """
        ),
        md(
            """
            ## 2 · Measure (GPU) or load the committed results (CPU)

            On a GPU: the quick suite (`python -m benchmarks --quick`: a few shapes per suite, bf16, fewer
            repetitions, no FlexAttention: minutes per suite), resumable within the session (re-running this cell
            measures only what is missing).
            On a CPU: the committed CSVs. Until the suite's own H200 CSVs are committed, the prefill suites
            fall back to the older `results/nvidia-h200/prefill_*.csv` (ours vs SDPA cuDNN / flash only).
            """
        ),
        code(
            """
            if ON_GPU:
                summary = suite.run(SUITES, quick=True, results_dir=RESULTS, figures_dir=None,  # drawn below
                                          max_minutes=MAX_MINUTES)
            frames = {suite: report.load_suite(suite, RESULTS, gpu=GPU) for suite in grids.SUITES}
            assert frames["prefill_fwd"] is not None, f"no prefill results for {GPU} under {RESULTS}"
            for suite, df in frames.items():
                if df is None:
                    continue
                ok = df[df["status"] == "ok"]
                assert len(ok) and (ok["gpu"] == GPU).all(), f"{suite}: every row must name the GPU it ran on ({GPU})"
                value = "gbps" if suite == "decode" else "tflops"
                measured = ok[ok["metric"] == "step"][value] if suite == "decode" else ok[value]
                assert (measured > 0).all(), f"{suite}: every measured row needs a positive {value}"
                bad = df[df["status"] != "ok"]
                print(f"{suite}: {len(ok)} rows on {GPU} ({', '.join(sorted(ok['impl'].unique()))})"
                      + (f"; {len(bad)} rows wrong/error: {sorted(set(bad['impl']))}" if len(bad) else ""))
                assert not (df["status"] == "wrong").any(), f"{suite}: a kernel of ours gave a wrong result"
            """
        ),
        md(
            """
            ## 3 · Prefill forward

            TFLOP/s against the sequence length at 16384 tokens per batch, MHA and GQA, causal and not; the
            dotted line is the bf16 matmul ceiling of the same run (where measured).
            """
        ),
        code(
            """
            report.plot_prefill(frames["prefill_fwd"], "prefill_fwd", FIGURES)
            nbu.show(report.value_table(frames["prefill_fwd"], "prefill_fwd"), "{:.0f}")
            """
        ),
        md(
            """
            ## 4 · Prefill forward + backward

            The same grid through `torch.autograd.grad` of q, k and v (FLOPs: 3.5x the forward's).
            """
        ),
        code(
            """
            if frames["prefill_fwd_bwd"] is None:
                print("no forward + backward results to plot")
            else:
                report.plot_prefill(frames["prefill_fwd_bwd"], "prefill_fwd_bwd", FIGURES)
                nbu.show(report.value_table(frames["prefill_fwd_bwd"], "prefill_fwd_bwd"), "{:.0f}")
            """
        ),
        md(
            """
            ## 5 · Decode: latency and bandwidth against the cache length

            One decode step (append the new token's K/V, attend) per request, 32 q heads over 8 KV heads:
            microseconds per step and K+V GB/s per batch size, our dense and paged caches against SDPA with a
            length-1 query and the seed's eager baselines. The paged rows answer one question: what does
            paging cost against our dense cache at equal shapes? Then the host overhead of one eager call.
            """
        ),
        code(
            """
            decode = frames["decode"]
            if decode is None:
                print("no decode results yet: nothing to plot (run `python -m benchmarks --suite decode` on a GPU)")
            else:
                report.plot_decode(decode, FIGURES)
                print("K+V GB/s per step:")
                nbu.show(report.value_table(decode, "decode"), "{:.0f}")
                host = report.value_table(decode, "decode", metric="host_overhead")
                if host is not None:
                    print("host overhead of one eager call (us, no synchronisation):")
                    nbu.show(host, "{:.1f}")
            """
        ),
        md(
            """
            ## 6 · Chunked prefill against a KV cache

            A chunk of 512 or 2048 new tokens appended to caches already holding 0, 4096 or 12288 tokens, with
            `flash_attn_with_kvcache(..., causal=True)` (dense and paged), against `flash_attn_func` on the same
            q chunk and all the keys: how much the decode-shaped kernel gives up on prefill-shaped work.
            """
        ),
        code(
            """
            chunked = frames["chunked"]
            if chunked is None:
                print("no chunked-prefill results yet: nothing to plot (run `python -m benchmarks --suite chunked`)")
            else:
                report.plot_chunked(chunked, FIGURES)
                nbu.show(report.value_table(chunked, "chunked"), "{:.0f}")
            """
        ),
        md(
            """
            ## 7 · Peak memory beyond the inputs (MiB)

            What one call allocates on top of its inputs: the eager implementations materialise the scores
            (prefill) or copies of the cache (decode); the fused kernels allocate their output and, for
            split-KV decode, a small fp32 scratch.
            """
        ),
        code(
            """
            for suite, df in frames.items():
                table = None if df is None else report.memory_table(df, suite)
                if table is None:
                    print(f"{suite}: no memory measurements in these rows")
                    continue
                print(f"{suite}:")
                nbu.show(table, "{:.1f}")
            """
        ),
        md(
            """
            ## 8 · Fractions of the ceilings

            Each row divided by the ceiling measured in its own run: TFLOP/s over the bf16 matmul rate for
            prefill, K+V GB/s over the larger of the copy and read-only bandwidths for decode. Rows measured
            before the suite stored ceilings use `benchmarks.measure.H200_MEASURED_CEILINGS` (said so in the title).
            """
        ),
        code(
            """
            reference = report.load_ceilings(RESULTS, GPU) or (
                measure.H200_MEASURED_CEILINGS if GPU == measure.H200_MEASURED_CEILINGS["gpu"] else None)
            print("reference ceilings for rows measured without their own:",
                  {k: v for k, v in (reference or {}).items() if k != "source"})
            report.plot_roofline(frames, FIGURES, ceilings=reference)
            for suite in ("prefill_fwd", "decode"):
                if frames[suite] is None:
                    continue
                fractions = report.roofline_table(frames[suite], suite, ceilings=reference)
                if fractions is None:
                    continue
                nbu.show(fractions, "{:.2f}")
                values = fractions.stack().dropna()  # a shape some peer did not run is an empty cell
                assert len(values) > 0 and ((values > 0) & (values < 1.2)).all(), (
                    f"{suite}: a fraction of the ceiling outside (0, 1.2) means a broken measurement (warm L2?)")
            """
        ),
        md(
            """
            ## 9 · Headline: ours / the best peer

            Per shape, ours against the fastest other implementation measured in the same run (prefill and
            decode), paged against our dense cache, and chunked prefill against `flash_attn_func`. The Markdown
            below is what the README's table is pasted from.
            """
        ),
        code(
            """
            headline = report.headline_table(frames=frames)
            assert len(headline) and headline["ratio"].map(math.isfinite).all(), "every ratio must be finite"
            assert (headline["ratio"] > 0).all()
            nbu.show(headline.drop(columns=["gpu"]), "{:.2f}")
            print(report.headline_markdown(headline))
            """
        ),
    ]


def main(argv=None) -> int:
    return cli(lambda: {NAME: benchmarks()}, __doc__, "scripts/nb_benchmarks.py", argv)


if __name__ == "__main__":
    sys.exit(main())
