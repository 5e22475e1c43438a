"""Notebook 04_serving: continuous batching over a paged KV cache (cell sources; built like the others).

    python scripts/nb_serving.py            # write notebooks/04_serving.ipynb
    python scripts/nb_serving.py --check    # exit 1 if the notebook on disk differs from what this writes

The shared pieces (the badge, the setup cell, `md`/`code`, `build`) come from scripts/notebook_cells.py;
scripts/make_notebooks.py lists this notebook with the others.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import List

sys.path.insert(0, str(Path(__file__).resolve().parent))

from notebook_cells import SETUP, Cell, badge, cli, code, md  # noqa: E402

NAME = "04_serving"


def serving() -> List[Cell]:
    return [
        md(
            f"""
            {badge(NAME)}

            # 04 · Serving: continuous batching over a paged KV cache

            A serving system does not run one batch of equal-length prompts: requests with different prompt
            lengths arrive while others are being decoded, each produces a different number of tokens, and
            finished requests leave while new ones join (**continuous batching**). This notebook builds a small
            serving engine on the package, `kernels.serving.ServingEngine`, with no model around the attention
            layer: every request is a stream of random q/k/v tokens from a seeded generator, so every attention
            output can be checked against `kernels.reference.attention_ref` as the simulation goes.

            1. why the KV cache is paged (`kernels.PagedKVCache`): a dense cache reserves the maximum length for
               every request;
            2. chunked prefill against the cache: a prompt cut into uneven chunks, each attending to everything
               cached so far plus itself (bottom-right causal), equals one-shot prefill;
            3. the workload, and the scheduler: admission while the pool's pages suffice, a token budget per
               step (decode tokens first, then prefill chunks), one batched decode call, retirement that returns
               the pages;
            4. the simulation, every output (CPU) or a sample of them (GPU) checked inline: each `assert` fails
               loudly with the numbers;
            5. throughput (tokens/s per step) and the pool's memory against a dense cache of the maximum length.

            **Where it runs.** On a GPU with realistic sizes (bfloat16, 32 q heads over 8 KV heads, head dim 128,
            pages of 64 tokens, 32 requests with prompts of 100..4000 tokens); it measures, saves the per-step
            stats to `results/<gpu>/serving_steps.csv` and the plot to `figures/<gpu>/serving.png`. On a CPU the
            kernels run under Triton's interpreter with small sizes (float16, 4 q heads over 2 KV heads, head dim
            32, pages of 16, 6 requests of up to 80 prompt tokens): every output is checked, the memory accounting
            is exact, the tokens/s are the interpreter's (meaningless), and the committed GPU results are plotted
            when there are any. All logic lives in `kernels/serving.py` and notebooks/nbutils.py: these cells
            narrate, call, check and plot.
            """
        ),
        SETUP,
        code(
            """
            import pandas as pd

            import nbutils as nbu
            from kernels import PagedKVCache, causal_mask, serving

            torch.manual_seed(0)
            # The fp32 references must be true fp32 on a GPU: no tf32 in the ground truth.
            torch.backends.cuda.matmul.allow_tf32 = False
            torch.backends.cudnn.allow_tf32 = False
            S = nbu.serving_sizes(ON_GPU)  # small sizes under the interpreter, realistic ones on a GPU
            print(S)
            """
        ),
        md(
            """
            ## 1 · Why paging

            A dense KV cache gives each request slot one contiguous buffer of `max_seqlen` tokens (per layer,
            `2 · H_KV · D` elements per token). The buffer is reserved when the request is admitted, because the
            request may grow to that length, and it does not know yet how long it will be: a request that ends
            at 300 tokens in a 4096-token slot leaves 93% of its reservation unused (internal fragmentation), and
            the number of requests that fit in memory is set by the worst case, not by what is cached.
            Allocating each request exactly its length instead, in one contiguous piece, fragments memory the
            other way: requests grow, and the free space ends up in holes too small for the next one.

            Paging (PagedAttention, Kwon et al., 2023; vLLM) cuts the cache into fixed-size **pages** of `P`
            tokens in one pool. A request owns a list of pages, its row of the **block table** (logical page
            `i` -> physical block), and takes a new page only when its last one is full: the waste is less than
            one page per request, any free page fits any request, and a finished request's pages are reused at
            once. The kernel reads key `j` of request `b` from row `j % P` of block `block_table[b, j // P]`.

            Below, host bookkeeping only (no kernel): three requests grow in turns, so their pages interleave in
            the pool; freeing one returns its pages, and the next request takes exactly those.
            """
        ),
        code(
            """
            demo = PagedKVCache(10, S.page_size, S.nheads_k, S.head_dim, max_batch=4, max_blocks_per_seq=4,
                                dtype=S.dtype, device=DEVICE)
            a, b, c = demo.add_request(), demo.add_request(), demo.add_request()
            grow = [(a, S.page_size), (b, 1), (c, 2 * S.page_size), (a, 1), (b, S.page_size), (a, S.page_size)]
            tokens = {a: 0, b: 0, c: 0}
            for slot, n in grow:
                tokens[slot] += n
                # pages for the request's tokens so far (extend counts from its length, still 0: only the kernels'
                # appends advance it): a new page only when the last one is full
                demo.extend(slot, tokens[slot])
            pages = {slot: demo.pages(slot) for slot in (a, b, c)}
            nbu.show(pd.DataFrame([{"slot": s, "tokens": tokens[s], "pages": pages[s],
                                    "reserved tokens": len(pages[s]) * S.page_size} for s in (a, b, c)]))
            print(f"free blocks: {demo.num_free_blocks} of {demo.num_blocks}")
            flat = [p for s in (a, b, c) for p in pages[s]]
            assert len(flat) == len(set(flat)), "a block belongs to at most one request"
            assert all(len(pages[s]) == -(-tokens[s] // S.page_size) for s in (a, b, c)), "pages are taken on demand"

            demo.free(b)
            d = demo.add_request()  # the freed slot, reused
            demo.extend(d, len(pages[b]) * S.page_size)
            print(f"freed the request in slot {b} (blocks {pages[b]}); the next request, in slot {d}, got blocks "
                  f"{demo.pages(d)}")
            assert sorted(demo.pages(d)) == sorted(pages[b]), "freed pages are reused first"
            """
        ),
        md(
            """
            ## 2 · Chunked prefill against the cache

            A long prompt processed in one step would stall every request that is decoding (a decode step waits
            for the whole prompt's attention), so the engine gives each step a **token budget**: first one token
            for every decoding request, then prompt **chunks** of at most `chunk_size` tokens until the budget
            is spent (vLLM's chunked prefill). A chunk of `M` tokens starting at position `L` goes through
            `flash_attn_with_kvcache` with `seqlen_q = M` and `cache_seqlens = L`: its K/V are appended to the
            request's pages, and its queries attend to the `L` cached keys plus the chunk itself, causal aligned
            to the bottom-right corner. For a chunk of 4 tokens after 6 cached ones (1 = visible):
            """
        ),
        code(
            """
            print(causal_mask(4, 6 + 4).int())
            assert causal_mask(4, 10)[:, :6].all() and torch.equal(causal_mask(4, 10)[:, 6:], causal_mask(4, 4))
            """
        ),
        md(
            """
            So a prompt prefilled chunk by chunk must give exactly what one-shot causal prefill
            (`flash_attn_func(causal=True)`) gives. Below, one prompt in uneven chunks (lengths 1, below and
            above the kernels' tile and the page size; on a GPU also chunks of hundreds of tokens), into a dense
            cache buffer and into a `PagedKVCache` whose pages interleave with another request's. Cache rows that
            are not the prompt's hold NaN: reading one would poison the output. Each chunk is compared with the
            fp32 reference (the tests' rule: at most 2x PyTorch's own same-dtype error plus a floor) and with
            the same rows of the one-shot prefill.
            """
        ),
        code(
            """
            chunked = nbu.chunked_prefill_table(S.chunks, nheads=S.nheads, nheads_k=S.nheads_k, head_dim=S.head_dim,
                                                    page_size=S.page_size, dtype=S.dtype, device=DEVICE)
            nbu.show(chunked)
            nbu.assert_table_ok(chunked, "chunked prefill == one-shot prefill, dense and paged")
            assert list(chunked[chunked.cache == "paged"].chunk) == list(S.chunks)
            """
        ),
        md(
            """
            ## 3 · The workload and the pool

            Requests with prompt lengths spread over the whole range (the first is the longest), a number of
            new tokens each, and arrival steps. The pool is deliberately smaller than what a dense cache for
            `max_batch` requests of `max_seqlen` tokens would take, so at times the pool, not the slots, limits
            how many requests run.

            The scheduler admits the oldest arrived request when a slot is free and the pool's free pages,
            minus the pages already promised to running requests, cover its whole length (prompt + new tokens):
            pages are still taken on demand, but no running request can ever run out of them, so nothing has to
            be preempted (TensorRT-LLM calls this policy "guaranteed no evict"). A request that cannot be admitted
            blocks those behind it (first come, first served). A request that could never run (longer than
            `max_seqlen`, or needing more pages than the whole pool) is refused when it is submitted.
            """
        ),
        code(
            """
            workload = serving.make_workload(S.num_requests, S.prompt_range, S.new_tokens_range, S.arrival_span, seed=0)
            requests = pd.DataFrame([vars(r) for r in workload])
            requests["total_len"] = requests.prompt_len + requests.max_new_tokens
            nbu.show(requests)
            engine = nbu.engine_from_sizes(S, DEVICE)
            page_mib = S.page_size * engine.bytes_per_token / 2**20
            max_pages = S.max_seqlen // S.page_size
            print(f"pool: {S.num_blocks} pages of {S.page_size} tokens = {S.num_blocks * page_mib:.3g} MiB per layer; "
                  f"a dense cache for {S.max_batch} requests of {S.max_seqlen} tokens: "
                  f"{S.max_batch * max_pages * page_mib:.3g} MiB")

            nbu.check_errors([
                (f"a request of {S.max_seqlen + 1} tokens > max_seqlen",
                 lambda: engine.submit(serving.Request(S.max_seqlen - 1, 2, 0)), ValueError),
                ("a request with an empty prompt", lambda: engine.submit(serving.Request(0, 5, 0)), ValueError),
                ("token_budget < max_batch (decodes could not all fit in a step)",
                 lambda: nbu.engine_from_sizes(S, DEVICE, token_budget=S.max_batch - 1), ValueError),
            ])
            assert engine.requests == [], "a refused request must not be queued"
            """
        ),
        md(
            """
            ## 4 · The simulation

            Each engine step (`ServingEngine.step`):

            1. **admit** arrived requests while a slot is free and the pool can hold them (above);
            2. **schedule** one decode token for every request past its prompt, then prefill chunks of at most
               `chunk_size` tokens, in admission order, until `token_budget` tokens are scheduled;
            3. **attend**: one `PagedKVCache.decode` call for all decoding requests together (`seqlen_q = 1`,
               each request with its own length and block-table row), and one call per chunk length for the
               prefill chunks (`seqlen_q` = the chunk); each call appends the new tokens' K/V to the requests'
               pages, taking new pages as they fill;
            4. **check** outputs against the reference over the request's own tokens so far (every output under
               the interpreter; on a GPU each request's first and last chunk and its first, middle and last
               decode step); a failing output raises `VerificationError` at once;
            5. **retire** finished requests: `PagedKVCache.free` returns their pages and slots.

            Only step 3 is timed (with `torch.cuda.synchronize` on a GPU): page bookkeeping and kernels, not the
            making of the inputs or the checks. On a GPU a first pass over the same workload compiles the kernels
            for every shape the run meets (unchecked, untimed), so that compilation does not show up as slow steps.
            """
        ),
        code(
            """
            if ON_GPU:  # warm-up: Triton compiles a kernel per new shape class at first use
                warmup = nbu.engine_from_sizes(S, DEVICE, verify="none")
                warmup.submit(workload)
                warmup.run()
                print(f"warm-up pass: {len(warmup.stats)} steps")
                del warmup
            engine.submit(workload)
            engine.run()
            stats = engine.stats_frame()
            checks = engine.checks_frame()
            print(f"{len(stats)} steps, {len(engine.requests)} requests, {int(stats.tokens.sum())} tokens "
                  f"({int(stats.prefill_tokens.sum())} prefill, {int(stats.decode_tokens.sum())} decode); "
                  f"{len(checks)} outputs checked ({engine.verify}), largest rel err {checks.err.max():.2e}")
            per_kind = checks.assign(tokens=checks.end - checks.start).groupby("kind")
            nbu.show(per_kind.agg(outputs=("ok", "size"), tokens=("tokens", "sum"), max_err=("err", "max"),
                                  max_bound=("bound", "max"), all_ok=("ok", "all")))

            assert len(checks) and checks.ok.all(), checks[~checks.ok]
            assert sorted(engine.request_log) == list(range(len(workload))), "every request must finish"
            assert engine.cache.num_free_blocks == engine.cache.num_blocks, "every page must be back in the pool"
            assert engine.cache.active_slots == [], "every slot must be free"
            mixed = (stats.prefill_tokens > 0) & (stats.decode_tokens > 0)
            assert mixed.any(), "prefill chunks must share steps with decode tokens"
            assert (stats.tokens <= S.token_budget).all(), "a step exceeded the token budget"
            if engine.verify == "all":
                assert (checks.end - checks.start).sum() == requests.total_len.sum(), "every token's output was checked"
            """
        ),
        md(
            """
            Per request: when it arrived, how many steps it waited for admission, when its prompt was done (its
            time to first token, in steps) and when it finished. Waits happen when the pool is short, not only
            when the slots are full.
            """
        ),
        code(
            """
            log = engine.requests_frame()
            log["ttft_steps"] = log.prefill_done_step - log.arrival_step + 1
            nbu.show(log)
            waited = log[log.queued_steps > 0]
            pool_bound = stats[(stats.waiting > 0) & (stats.running < S.max_batch)]
            print(f"{len(waited)} of {len(log)} requests waited for admission, at most {log.queued_steps.max()} steps; "
                  f"in {len(pool_bound)} steps a request waited with a slot free (for pages)")
            assert len(waited) > 0 and len(pool_bound) > 0, "the pool is sized so that admission waits for pages"
            """
        ),
        md(
            """
            ## 5 · Throughput and memory

            Per step: tokens/s (the step's tokens over its attention wall time), the tokens of the step split
            into decode and prefill, the K/V memory, and the requests running and waiting. Memory lines (one
            layer; a model multiplies them by its layer count):

            - **paged: pages in use**: what the pool holds for the running requests;
            - **live K/V**: the tokens actually cached; the gap to the pages is paging's waste, under one page
              per request;
            - **dense, per running request**: a dense cache reserving `max_seqlen` tokens for each running request;
            - **dense, max_batch up front**: a static dense cache sized for `max_batch` requests, what a system
              without paging allocates to run that many at once.

            Decode-only steps are bound by host overhead here (a Python engine, one launch per call, no CUDA
            graphs); steps with prefill chunks show the kernels' throughput on long chunks.
            """
        ),
        code(
            """
            totals = nbu.summary(stats)
            nbu.show(pd.DataFrame([totals]).T.rename(columns={0: "value"}), "{:.4g}")
            assert (stats.pool_in_use_mib <= stats.dense_running_mib + 1e-9).all(), "paging never takes more than dense"
            assert (stats.live_kv_mib <= stats.pool_in_use_mib + 1e-9).all()
            waste_pages = (stats.pool_in_use_mib - stats.live_kv_mib) / page_mib
            assert (waste_pages < stats.running + 1e-9).all(), "less than one partly filled page per running request"
            assert totals["peak_pool_in_use_mib"] <= totals["pool_mib"] < totals["dense_max_batch_mib"]
            print(f"peak pool in use {totals['peak_pool_in_use_mib']:.3g} MiB vs "
                  f"{totals['peak_dense_running_mib']:.3g} MiB for dense reservations of the running requests "
                  f"({totals['peak_dense_running_mib'] / totals['peak_pool_in_use_mib']:.2f}x) and "
                  f"{totals['dense_max_batch_mib']:.3g} MiB for a dense cache of {S.max_batch} requests")
            """
        ),
        code(
            """
            shape = (f"\\n{nbu.dtype_name(S.dtype)}, {S.nheads} q / {S.nheads_k} KV heads, D={S.head_dim}, "
                     f"pages of {S.page_size}, chunks <= {S.chunk_size}, budget {S.token_budget} tokens/step")
            if ON_GPU:
                gpu = kernels.env_summary()["gpu"]
                config = {key: value for key, value in vars(S).items() if not isinstance(value, tuple)}
                print(f"wrote {nbu.save_stats(engine.stats, config)}")  # results/<gpu>/serving_steps.csv
                nbu.plot_serving(stats, title=f"Continuous batching on {gpu}: {shape}",
                                     path=nbu.figure_path(gpu, "serving"))
            else:
                nbu.plot_serving(stats, title=f"This run, on the CPU under the Triton interpreter (its tokens/s "
                                                  f"mean nothing; the memory is exact): {shape}")
                committed = nbu.load_stats()
                if committed is None:
                    print("no committed GPU results yet (results/<gpu>/serving_steps.csv): run this notebook on a GPU")
                else:
                    for gpu, run in committed.groupby("gpu"):
                        print(f"committed run on {gpu} ({run['date'].iloc[0][:10]}):")
                        nbu.show(pd.DataFrame([nbu.summary(run)]).T.rename(columns={0: "value"}), "{:.4g}")
                        nbu.plot_serving(run, title=f"Continuous batching on {gpu} (committed run)",
                                             path=nbu.figure_path(gpu, "serving"))
            """
        ),
    ]


def main(argv=None) -> int:
    return cli(lambda: {NAME: serving()}, __doc__, "scripts/nb_serving.py", argv)


if __name__ == "__main__":
    sys.exit(main())
