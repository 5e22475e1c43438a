"""Continuous batching over a PagedKVCache: a small serving engine for one attention layer.

What a serving system does with an attention kernel, in ~one screen of scheduling code, with no model
around it: requests with different prompt lengths arrive over time; each engine step admits new
requests while the page pool can hold them, prefills waiting prompts in chunks under a per-step token
budget, decodes every running request together in one batched call, retires finished requests and
returns their pages to the pool. Every attention output can be checked against the eager reference.

There is no model: request `rid` is a stream of random q/k/v tokens drawn from a generator seeded
with (seed, rid), as if from one attention layer whose inputs did not depend on its outputs. Its
token `t` attends to its tokens `0..t` (`t - W..t` in a sliding-window layer, `sliding_window=W`),
so the output of a prefill chunk covering tokens [a, b) (or of a decode step, b = a + 1) must equal
`attention_ref(q[a:b], k[:b], v[:b], causal=True)` (with `window_size=(W, 0)`): bottom-right causal,
GQA. And all of a request's outputs together must equal one-shot causal attention over its whole
stream.

Scheduler (vLLM's chunked prefill, TensorRT-LLM's "guaranteed no evict" capacity policy):
- Admission, first come first served: the oldest arrived request is admitted when a request slot is
  free and the pool's free pages, minus the pages already promised to running requests, cover its
  whole length (prompt + new tokens; in a sliding-window layer, the most pages it holds at once).
  Pages are still taken on demand (`PagedKVCache` takes them as tokens are appended), but a promised
  page is never given to anybody else, so no running request ever has to be preempted. A request
  that waits blocks the ones behind it (no overtaking).
- Token budget per step: decode tokens first (one per request in the decode phase), then prefill
  chunks of at most `chunk_size` tokens for the prompts in admission order, until the budget is
  spent. Long prompts thus share steps with decoding requests instead of stalling them.
- Execution: one `PagedKVCache.decode` call for all decoding requests (seqlen_q = 1), and one call
  per chunk length for the prefill chunks (`flash_attn_with_kvcache` with seqlen_q = chunk, which
  appends the chunk's K/V to the request's pages and attends, bottom-right causal, to everything
  cached so far plus the chunk itself).
- Retirement: a request that has produced all its tokens is freed (`PagedKVCache.free`): its pages
  go back to the pool and its slot to the free slots, in the same step.

Not modelled: preemption (the admission policy makes it unnecessary), prefix sharing, sampling (the
stream is fixed in advance), several layers (multiply the memory by the layer count).

Memory accounting per step: the pool's pages in use (what paging costs) against a dense cache that
reserves `max_seqlen` tokens for every running request, and against a dense cache allocated for
`max_batch` requests up front (what a static batch needs), plus the live K/V (the tokens actually
cached: the gap to the pool is paging's internal fragmentation, less than one page per request).

Notation: H q heads, H_KV KV heads, D head dim, P page size, bytes per token = 2 (K and V) * H_KV *
D * element size.

Around the engine: `engine_from_sizes` (an engine from a notebook's sizes), `make_workload`, `summary` and
`summary_lines` (a run's totals), `save_stats` / `load_stats` (results/<gpu>/serving_steps.csv),
`plot_serving` (a run over its steps) and `plot_request_memory` (each request's K/V against its length).
"""

from __future__ import annotations

import bisect
import datetime
import itertools
import math
import numbers
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from tritonattn import InputError, InputTypeError, PagedKVCache, is_interpreter
from tritonattn.testing import check_close, dequantize_ref, quantize_e4m3_ref, references

from . import report, results
from .grids import COLORS

VERIFY_MODES = ("all", "sample", "none")


class VerificationError(AssertionError):
    """An attention output of the engine broke the error rule against the reference."""


@dataclass(frozen=True)
class Request:
    """A request: `prompt_len` prompt tokens, then `max_new_tokens` decode steps of one token each,
    visible to the scheduler from engine step `arrival_step` on. Its K/V take prompt_len +
    max_new_tokens cache rows in the end."""

    prompt_len: int
    max_new_tokens: int
    arrival_step: int = 0

    @property
    def total_len(self) -> int:
        return self.prompt_len + self.max_new_tokens


@dataclass
class _Active:
    """An admitted request: its slot in the cache, its token stream, its progress."""

    rid: int
    request: Request
    slot: int
    q: torch.Tensor  # (total_len, H, D)
    k: torch.Tensor  # (total_len, H_KV, D)
    v: torch.Tensor
    admitted_step: int
    prefilled: int = 0  # prompt tokens in the cache
    generated: int = 0  # decode steps done
    prefill_done_step: Optional[int] = None
    out: Optional[torch.Tensor] = None  # (total_len, H, D) when keep_outputs
    pages_held: int = 0  # the most pages it held at the end of a step
    k_ref: Optional[torch.Tensor] = None  # an FP8 pool: k and v as the pool holds them, for the checks
    v_ref: Optional[torch.Tensor] = None

    @property
    def cached(self) -> int:
        return self.prefilled + self.generated

    @property
    def in_prefill(self) -> bool:
        return self.prefilled < self.request.prompt_len

    @property
    def finished(self) -> bool:
        return not self.in_prefill and self.generated >= self.request.max_new_tokens


def as_stored(x: torch.Tensor, descale: torch.Tensor) -> torch.Tensor:
    """x (tokens, H_KV, D) as an FP8 pool holds it with per-KV-head descales (H_KV,): quantized to e4m3 as
    the kernels' append quantizes, dequantized, in x's dtype."""
    return dequantize_ref(quantize_e4m3_ref(x[None], descale[None]), descale[None], x.dtype)[0]


def check_attention(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    sliding_window: Optional[int] = None) -> Tuple[float, float]:
    """(err, bound) of `out` (M, H, D), the causal attention of q (M, H, D) over k, v (N, H_KV, D)
    aligned bottom-right (each query seeing at most `sliding_window` keys left of its own, when given),
    against the fp32 reference, by the error rule of tritonattn.testing; err is inf when out is not
    finite."""
    window = (-1, -1) if sliding_window is None else (sliding_window, 0)
    ref32, _, same = references(q[None], k[None], v[None], causal=True, window_size=window)
    _, err, bound = check_close(out[None], ref32, same)
    return err, bound


def _positive_int(name: str, value, minimum: int = 1) -> int:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < minimum:
        raise InputError(f"Expected {name} to be an int >= {minimum}, got {value!r}.")
    return int(value)


# ============================================================================================
# The engine
# ============================================================================================
class ServingEngine:
    """Continuous batching of `Request`s over a `PagedKVCache` (see the module docstring).

        engine = ServingEngine(nheads=4, nheads_k=2, head_dim=32, page_size=16, num_blocks=16, max_batch=4,
                               max_seqlen=96, chunk_size=32, token_budget=40, dtype=torch.float16)
        engine.submit([Request(70, 5, 0), Request(20, 8, 2)])
        engine.run()                                      # steps until every request has finished
        engine.stats_frame(), engine.checks_frame(), engine.requests_frame()

    Args:
        nheads, nheads_k, head_dim: the attention layer (nheads % nheads_k == 0).
        page_size, num_blocks: the pool: num_blocks pages of page_size tokens.
        max_batch: request slots, i.e. the most requests running at once.
        max_seqlen: the longest request (prompt + new tokens) the engine accepts; also the length a
            dense cache would reserve per request. Requests get ceil(max_seqlen / page_size) block-table
            columns.
        chunk_size: the most prompt tokens of one request processed in one step.
        token_budget: tokens per step, decode tokens first, then prefill chunks; at least max_batch
            so that every running request can decode in every step.
        dtype, device: of the pool and of the token streams (default: cuda if present, else cpu).
        cache_dtype: the pool's dtype when it differs from the streams': torch.float8_e4m3fn for an FP8
            pool (sm_89 or newer), whose scales each request takes from its prompt at admission
            (`PagedKVCache.set_scales`); its outputs are then checked against the reference over the K/V
            as the pool holds them (quantized with those scales), and `cache.saturated` counts the values
            clamped.
        seed: the token streams' seed; request rid draws from a generator seeded with (seed, rid).
        verify: "all" checks every output against the reference; "sample" the first and last
            prefill chunk of each request and its first, middle and last decode step; "none" nothing.
            Default: "all" under the Triton interpreter, "sample" on a GPU.
        strict: raise VerificationError at the first output that breaks the rule (else record it).
        keep_outputs: keep each request's outputs (total_len, H, D) in `outputs[rid]`.
        num_splits: passed to the decode calls (0 = the kernel's heuristic).
        sliding_window: None, or W: a sliding-window layer (Mistral-style): each token attends to itself
            and the W tokens before it. The pool is a `PagedKVCache(sliding_window=W)`, which returns
            the pages before each request's window to the pool as it advances, so a request holds at
            most (W + chunk_size - 1) // page_size + 2 pages however long it grows, and admission
            counts that peak instead of its whole length.

    Raises ValueError for a bad configuration; `submit` raises ValueError for a request that can
    never run (longer than max_seqlen, or needing more pages than the whole pool).
    """

    def __init__(self, *, nheads: int, nheads_k: int, head_dim: int, page_size: int, num_blocks: int,
                 max_batch: int, max_seqlen: int, chunk_size: int, token_budget: int,
                 dtype: torch.dtype = torch.float16, device: Union[str, torch.device, None] = None, seed: int = 0,
                 verify: Optional[str] = None, strict: bool = True, keep_outputs: bool = False,
                 num_splits: int = 0, sliding_window: Optional[int] = None,
                 cache_dtype: Optional[torch.dtype] = None):
        nheads, nheads_k = _positive_int("nheads", nheads), _positive_int("nheads_k", nheads_k)
        if nheads % nheads_k:
            raise InputError(f"Expected nheads ({nheads}) to be divisible by nheads_k ({nheads_k}); GQA needs "
                             f"whole groups.")
        page_size, max_batch = _positive_int("page_size", page_size), _positive_int("max_batch", max_batch)
        self.max_seqlen = _positive_int("max_seqlen", max_seqlen)
        self.chunk_size = _positive_int("chunk_size", chunk_size)
        self.token_budget = _positive_int("token_budget", token_budget)
        if self.token_budget < max_batch:
            raise InputError(f"Expected token_budget ({token_budget}) >= max_batch ({max_batch}): every running "
                             f"request decodes one token per step; raise the budget or lower max_batch.")
        if verify is None:
            verify = "all" if is_interpreter() else "sample"
        if verify not in VERIFY_MODES:
            raise InputError(f"Expected verify to be one of {VERIFY_MODES}, got {verify!r}.")
        self.verify, self.strict, self.keep_outputs, self.num_splits = verify, bool(strict), keep_outputs, num_splits
        self.nheads, self.seed = nheads, int(seed)
        self.sliding_window = None if sliding_window is None else _positive_int("sliding_window", sliding_window, 0)
        self.cache = PagedKVCache(num_blocks, page_size, nheads_k, head_dim, max_batch=max_batch,
                                  max_blocks_per_seq=-(-self.max_seqlen // page_size), dtype=cache_dtype or dtype,
                                  device=device, sliding_window=self.sliding_window)
        self.device, self.dtype = self.cache.device, dtype
        self.fp8 = self.cache.k_descale is not None
        self.bytes_per_token = 2 * nheads_k * head_dim * torch.empty((), dtype=self.cache.dtype).element_size()

        self.clock = 0  # the engine step
        self.requests: List[Request] = []  # by rid
        self._waiting: List[Tuple[int, int]] = []  # (arrival_step, rid), sorted: FCFS
        self._running: Dict[int, _Active] = {}  # rid -> state, in admission order
        self.outputs: Dict[int, torch.Tensor] = {}
        self.request_log: Dict[int, Dict[str, Any]] = {}
        self.stats: List[Dict[str, Any]] = []
        self.checks: List[Dict[str, Any]] = []

    # -- requests ---------------------------------------------------------------------------------
    def pages_for(self, num_tokens: int) -> int:
        """Pages holding num_tokens tokens."""
        return -(-int(num_tokens) // self.cache.page_size)

    def peak_pages(self, request: Request) -> int:
        """The most pages `request` holds at once: its whole length's, or with a sliding window W the
        window's and a chunk's, (W + chunk_size - 1) // page_size + 2 (the pages from the one holding
        its first visible key to the one its chunk ends in), if fewer."""
        whole = self.pages_for(request.total_len)
        if self.sliding_window is None:
            return whole
        return min(whole, (self.sliding_window + self.chunk_size - 1) // self.cache.page_size + 2)

    def submit(self, requests: Union[Request, Sequence[Request]]) -> List[int]:
        """Queue requests (first come, first served by arrival step, then submission order); returns
        their ids. All are checked before any is queued."""
        if isinstance(requests, Request):
            requests = [requests]
        for i, r in enumerate(requests):
            if not isinstance(r, Request):
                raise InputTypeError(f"Expected benchmarks.serving.Request objects, got {type(r).__name__} "
                                     f"at index {i}.")
            _positive_int(f"prompt_len of request {i}", r.prompt_len)
            _positive_int(f"max_new_tokens of request {i}", r.max_new_tokens, minimum=0)
            _positive_int(f"arrival_step of request {i}", r.arrival_step, minimum=0)
            if r.total_len > self.max_seqlen:
                raise InputError(
                    f"Request {i} needs {r.prompt_len} prompt + {r.max_new_tokens} new = {r.total_len} tokens > "
                    f"max_seqlen = {self.max_seqlen}; build the engine with a larger max_seqlen or shorten it.")
            if self.peak_pages(r) > self.cache.num_blocks:
                raise InputError(
                    f"Request {i} needs {self.peak_pages(r)} pages of {self.cache.page_size} tokens for "
                    f"{r.total_len} tokens, but the pool has only {self.cache.num_blocks}: it could never be admitted; "
                    f"allocate a larger pool.")
        ids = []
        for r in requests:
            rid = len(self.requests)
            self.requests.append(r)
            bisect.insort(self._waiting, (r.arrival_step, rid))
            ids.append(rid)
        return ids

    @property
    def done(self) -> bool:
        """No request is waiting or running."""
        return not self._waiting and not self._running

    @property
    def running(self) -> List[int]:
        """Ids of the running requests, in admission order."""
        return list(self._running)

    @property
    def slots(self) -> Dict[int, int]:
        """{rid: cache slot} of the running requests."""
        return {rid: a.slot for rid, a in self._running.items()}

    @property
    def waiting(self) -> List[int]:
        """Ids of the queued requests (arrived or not), in queue order."""
        return [rid for _, rid in self._waiting]

    def pages_promised(self) -> int:
        """Pages the running requests may still take: each one's peak (`peak_pages`) minus the pages it holds."""
        return sum(self.peak_pages(a.request) - len(self.cache.pages(a.slot)) for a in self._running.values())

    def _stream(self, rid: int, total: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        gen = torch.Generator(device=self.device)
        gen.manual_seed(self.seed * 1_000_003 + rid)
        nheads_k, head_dim = self.cache.nheads_k, self.cache.head_dim

        def randn(*shape):
            return torch.randn(*shape, generator=gen, device=self.device, dtype=torch.float32).to(self.dtype)

        return randn(total, self.nheads, head_dim), randn(total, nheads_k, head_dim), randn(total, nheads_k, head_dim)

    def token_stream(self, rid: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Request rid's q (total_len, H, D), k and v (total_len, H_KV, D): the same tensors the engine uses."""
        return self._stream(rid, self.requests[rid].total_len)

    def _admit(self) -> List[int]:
        admitted = []
        while self._waiting and self._waiting[0][0] <= self.clock:
            rid = self._waiting[0][1]
            request = self.requests[rid]
            if len(self._running) >= self.cache.max_batch:
                break
            if self.cache.num_free_blocks - self.pages_promised() < self.peak_pages(request):
                break  # FCFS: the head waits for pages, and so does everybody behind it
            self._waiting.pop(0)
            q, k, v = self._stream(rid, request.total_len)
            active = _Active(rid, request, self.cache.add_request(), q, k, v, admitted_step=self.clock)
            if self.fp8:  # the prompt's scales; the reference then reads K / V as the pool stores them
                prompt = slice(0, request.prompt_len)
                self.cache.set_scales(active.slot, k[prompt], v[prompt])
                active.k_ref, active.v_ref = (as_stored(t, d[active.slot]) for t, d in
                                              ((k, self.cache.k_descale), (v, self.cache.v_descale)))
            if self.keep_outputs:
                active.out = torch.full_like(q, float("nan"))
            self._running[rid] = active
            admitted.append(rid)
        return admitted

    # -- one step ---------------------------------------------------------------------------------
    def _schedule(self) -> Tuple[List[_Active], List[Tuple[_Active, int]]]:
        """Decode tokens first, then prefill chunks in admission order, within the token budget."""
        decoding = sorted((a for a in self._running.values() if not a.in_prefill and not a.finished),
                          key=lambda a: a.slot)  # ascending: a run of consecutive slots is passed as views
        budget = self.token_budget - len(decoding)
        chunks = []
        for a in self._running.values():
            if budget == 0:
                break
            if a.in_prefill:
                n = min(self.chunk_size, a.request.prompt_len - a.prefilled, budget)
                chunks.append((a, n))
                budget -= n
        return decoding, chunks

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def step(self) -> Optional[Dict[str, Any]]:
        """Run one engine step (admit, schedule, attend, verify, retire); return its stats row, or None
        when every request has finished. An idle engine jumps to the next arrival."""
        if self.done:
            return None
        if not self._running and self._waiting[0][0] > self.clock:
            self.clock = self._waiting[0][0]  # nothing to do until then
        admitted = self._admit()
        decoding, chunks = self._schedule()

        # inputs, gathered before the clock starts (a model would produce them)
        dec_inputs = [torch.stack([getattr(a, name)[a.cached] for a in decoding])[:, None]
                      for name in ("q", "k", "v")] if decoding else None  # (n, 1, heads, D)
        groups = []  # prefill chunks of one length go in one call
        for n, group in itertools.groupby(sorted(chunks, key=lambda c: c[1]), key=lambda c: c[1]):
            members = [a for a, _ in group]
            inputs = [torch.stack([getattr(a, name)[a.prefilled : a.prefilled + n] for a in members])
                      for name in ("q", "k", "v")]  # (m, n, heads, D)
            groups.append((n, members, inputs))

        # the step proper: page bookkeeping and attention
        self._synchronize()
        t0 = time.perf_counter()
        dec_out = None
        if decoding:
            dec_out = self.cache.decode(*dec_inputs, slots=[a.slot for a in decoding], num_splits=self.num_splits)
        chunk_outs = [self.cache.decode(*inputs, slots=[a.slot for a in members], num_splits=self.num_splits)
                      for _, members, inputs in groups]
        self._synchronize()
        wall = time.perf_counter() - t0

        # verify, advance, retire
        for i, a in enumerate(decoding):
            self._record(a, dec_out[i], a.cached, a.cached + 1, "decode")
            a.generated += 1
        for (n, members, _), out in zip(groups, chunk_outs):
            for i, a in enumerate(members):
                self._record(a, out[i], a.prefilled, a.prefilled + n, "prefill")
                a.prefilled += n
                if not a.in_prefill:
                    a.prefill_done_step = self.clock
        pages_in_use = self.cache.num_blocks - self.cache.num_free_blocks
        for a in self._running.values():
            a.pages_held = max(a.pages_held, len(self.cache.pages(a.slot)))
        live_tokens = sum(a.cached for a in self._running.values())
        running = len(self._running)
        finished = [a for a in self._running.values() if a.finished]
        for a in finished:
            self._retire(a)

        mib = self.bytes_per_token / 2**20
        row = {
            "step": self.clock, "wall_ms": wall * 1e3,
            "decode_tokens": len(decoding), "prefill_tokens": sum(n for _, n in chunks),
            "prefill_chunks": len(chunks), "calls": (1 if decoding else 0) + len(groups),
            "running": running, "admitted": len(admitted), "finished": len(finished),
            "waiting": sum(1 for arrival, _ in self._waiting if arrival <= self.clock),
            "pages_in_use": pages_in_use, "pages_promised": self.pages_promised(),
            "live_kv_mib": live_tokens * mib,
            "pool_in_use_mib": pages_in_use * self.cache.page_size * mib,
            "pool_mib": self.cache.num_blocks * self.cache.page_size * mib,
            "dense_running_mib": running * self.max_seqlen * mib,
            "dense_max_batch_mib": self.cache.max_batch * self.max_seqlen * mib,
        }
        row["tokens"] = row["decode_tokens"] + row["prefill_tokens"]
        row["tokens_per_s"] = row["tokens"] / wall if wall > 0 else math.nan
        self.stats.append(row)
        self.clock += 1
        return row

    def _sampled(self, a: _Active, start: int, end: int, kind: str) -> bool:
        if self.verify == "all":
            return True
        if self.verify == "none":
            return False
        if kind == "prefill":
            return start == 0 or end == a.request.prompt_len
        g, n = a.generated, a.request.max_new_tokens
        return g in (0, n // 2, n - 1)

    def _record(self, a: _Active, out: torch.Tensor, start: int, end: int, kind: str) -> None:
        """Keep and (if sampled) check the output (end - start, H, D) of a's tokens [start, end)."""
        if a.out is not None:
            a.out[start:end] = out
        if not self._sampled(a, start, end, kind):
            return
        k, v = (a.k, a.v) if a.k_ref is None else (a.k_ref, a.v_ref)
        err, bound = check_attention(out, a.q[start:end], k[:end], v[:end], self.sliding_window)
        ok = err <= bound
        self.checks.append({"step": self.clock, "rid": a.rid, "kind": kind, "start": start, "end": end,
                            "keys": end, "err": err, "bound": bound, "ok": ok})
        if not ok and self.strict:
            raise VerificationError(
                f"step {self.clock}: request {a.rid} {kind} of tokens [{start}, {end}) over {end} keys: rel err "
                f"{err:.3e} > bound {bound:.3e} against tritonattn.testing.attention_ref (causal bottom-right).")

    def _retire(self, a: _Active) -> None:
        self.cache.free(a.slot)
        del self._running[a.rid]
        if a.out is not None:
            self.outputs[a.rid] = a.out
        self.request_log[a.rid] = {
            "rid": a.rid, "prompt_len": a.request.prompt_len, "max_new_tokens": a.request.max_new_tokens,
            "arrival_step": a.request.arrival_step, "admitted_step": a.admitted_step,
            "prefill_done_step": a.prefill_done_step, "finished_step": self.clock,
            "queued_steps": a.admitted_step - a.request.arrival_step,
            "pages": self.peak_pages(a.request), "pages_held": a.pages_held,
        }

    def run(self, max_steps: int = 100_000) -> List[Dict[str, Any]]:
        """Step until every request has finished; returns the stats rows of this run."""
        first = len(self.stats)
        for _ in range(max_steps):
            if self.step() is None:
                return self.stats[first:]
        raise RuntimeError(f"The engine did not finish within max_steps = {max_steps} steps.")

    # -- tables ---------------------------------------------------------------------------------
    def stats_frame(self):
        """Per-step stats as a pandas DataFrame."""
        import pandas as pd

        return pd.DataFrame(self.stats)

    def checks_frame(self):
        """One row per checked output: step, rid, kind, token range, err, bound, ok."""
        import pandas as pd

        return pd.DataFrame(self.checks, columns=["step", "rid", "kind", "start", "end", "keys", "err", "bound", "ok"])

    def requests_frame(self):
        """One row per finished request: lengths, arrival, admission, end of prefill and finish steps, the
        pages admission counted for it (`pages`, see `peak_pages`) and the most it held (`pages_held`)."""
        import pandas as pd

        return pd.DataFrame([self.request_log[rid] for rid in sorted(self.request_log)])


# ============================================================================================
# Workloads
# ============================================================================================
def make_workload(num_requests: int, prompt_range: Tuple[int, int], new_tokens_range: Tuple[int, int],
                  arrival_span: int, *, seed: int = 0) -> List[Request]:
    """Seeded requests: prompt lengths uniform in prompt_range (the first request gets the longest),
    new tokens uniform in new_tokens_range, arrival steps uniform in [0, arrival_span), sorted."""
    num_requests = _positive_int("num_requests", num_requests)
    (p_lo, p_hi), (g_lo, g_hi) = prompt_range, new_tokens_range
    if not 1 <= p_lo <= p_hi or not 0 <= g_lo <= g_hi or arrival_span < 1:
        raise InputError(f"Expected 1 <= prompt_range[0] <= prompt_range[1], 0 <= new_tokens_range[0] <= "
                         f"new_tokens_range[1] and arrival_span >= 1, got {prompt_range}, {new_tokens_range}, "
                         f"{arrival_span}.")
    rng = np.random.default_rng(seed)
    prompts = rng.integers(p_lo, p_hi + 1, num_requests)
    prompts[0] = p_hi
    new_tokens = rng.integers(g_lo, g_hi + 1, num_requests)
    arrivals = np.sort(rng.integers(0, arrival_span, num_requests))
    arrivals[0] = 0
    return [Request(int(p), int(g), int(t)) for p, g, t in zip(prompts, new_tokens, arrivals)]


# ============================================================================================
# Construction from a notebook's sizes, run summaries, results, plots
# ============================================================================================
ENGINE_KEYS = ("nheads", "nheads_k", "head_dim", "page_size", "num_blocks", "max_batch", "max_seqlen", "chunk_size",
               "token_budget", "dtype", "seed", "verify", "strict", "keep_outputs", "num_splits", "sliding_window")


def engine_from_sizes(sizes: Union[Mapping[str, Any], Any], device=None, **overrides) -> ServingEngine:
    """A ServingEngine from the engine keywords (`ENGINE_KEYS`) found in `sizes`, a mapping or a namespace
    (a notebook's sizes: its other fields, e.g. the workload's, are ignored); keyword overrides win."""
    if not isinstance(sizes, Mapping) and not hasattr(sizes, "__dict__"):
        raise TypeError(f"Expected sizes as a mapping or a namespace of engine keywords, got {type(sizes).__name__}.")
    fields = dict(sizes) if isinstance(sizes, Mapping) else vars(sizes)
    kwargs = {key: fields[key] for key in ENGINE_KEYS if key in fields}
    kwargs.update(overrides)
    return ServingEngine(device=device, **kwargs)


def _frame(stats):
    import pandas as pd

    return stats if isinstance(stats, pd.DataFrame) else pd.DataFrame(stats)


def summary(stats) -> Dict[str, float]:
    """Totals of a run from its per-step stats (a list of dicts or a DataFrame): steps, tokens (prefill,
    decode), attention seconds, tokens/s over all steps, over decode-only steps and over steps with prefill
    chunks (nan where there is no such step), the most requests running, and the peak K/V MiB (one layer):
    pool in use, whole pool, live K/V, dense reservations of the running requests, a dense cache for
    max_batch requests."""
    df = _frame(stats)
    wall_s = df["wall_ms"].sum() / 1e3
    decode_only = df[(df["prefill_tokens"] == 0) & (df["decode_tokens"] > 0)]
    with_prefill = df[df["prefill_tokens"] > 0]

    def rate(part) -> float:
        seconds = part["wall_ms"].sum() / 1e3
        return float(part["tokens"].sum() / seconds) if len(part) and seconds > 0 else math.nan

    return {
        "steps": int(len(df)), "tokens": int(df["tokens"].sum()), "prefill_tokens": int(df["prefill_tokens"].sum()),
        "decode_tokens": int(df["decode_tokens"].sum()), "attention_s": float(wall_s),
        "tokens_per_s": rate(df), "tokens_per_s_decode_only_steps": rate(decode_only),
        "tokens_per_s_prefill_steps": rate(with_prefill),
        "max_running": int(df["running"].max()),
        "peak_pool_in_use_mib": float(df["pool_in_use_mib"].max()), "pool_mib": float(df["pool_mib"].max()),
        "peak_live_kv_mib": float(df["live_kv_mib"].max()),
        "peak_dense_running_mib": float(df["dense_running_mib"].max()),
        "dense_max_batch_mib": float(df["dense_max_batch_mib"].max()),
    }


def _rate(value: float) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:,.0f}"


def summary_lines(totals: Mapping[str, float]) -> List[str]:
    """`summary`'s totals as three sentences (a rate that could not be measured reads "-")."""
    t = totals
    return [
        f"{t['steps']} steps, {t['tokens']:,} tokens ({t['prefill_tokens']:,} prefill, {t['decode_tokens']:,} decode), "
        f"at most {t['max_running']} requests running",
        f"tokens/s: {_rate(t['tokens_per_s'])} overall, {_rate(t['tokens_per_s_prefill_steps'])} in steps with "
        f"prefill chunks, {_rate(t['tokens_per_s_decode_only_steps'])} in decode-only steps",
        f"peak K/V, one layer: pages in use {t['peak_pool_in_use_mib']:.3g} MiB of a {t['pool_mib']:.3g} MiB pool "
        f"(live K/V {t['peak_live_kv_mib']:.3g}); dense: {t['peak_dense_running_mib']:.3g} MiB for the running "
        f"requests, {t['dense_max_batch_mib']:.3g} MiB for max_batch",
    ]


def save_stats(stats: Sequence[Mapping[str, Any]], config: Mapping[str, Any], name: str = "serving_steps",
               results_dir: Union[str, Path] = "results") -> Path:
    """Append a run's stats rows, tagged with the config's plain values (numbers, strings, dtypes; tuples
    and the like are left out), a run id and the environment (`results.make_row`), to
    results/<gpu>/<name>.csv; returns its path."""
    run = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%S.%f")  # sorts by time
    config = {key: (str(value).replace("torch.", "") if isinstance(value, torch.dtype) else value)
              for key, value in config.items() if isinstance(value, (numbers.Number, str, torch.dtype))}
    rows = [results.make_row(**{**config, **row, "run": run}) for row in stats]
    return results.write_csv(rows, name, results_dir=results_dir)


def load_stats(name: str = "serving_steps", results_dir: Union[str, Path] = "results"):
    """The latest run per GPU of results/<gpu>/<name>.csv as a DataFrame, or None when there is none."""
    try:
        df = results.read_csv(name, results_dir=results_dir)
    except FileNotFoundError:
        return None
    latest = df.groupby("gpu")["run"].transform("max")
    return df[df["run"] == latest].reset_index(drop=True)


def _memory_unit(largest_mib: float) -> Tuple[str, float]:
    return ("MiB", 1.0) if largest_mib >= 1 else ("KiB", 1024.0)


def plot_serving(stats, *, title: str, path: Optional[Union[str, Path]] = None):
    """Four panels over the engine steps: tokens per step (decode, prefill), tokens/s of each step (with
    prefill chunks, decode only; log), K/V memory (pages in use and live K/V against the whole pool and the
    dense reservations), requests running and waiting. Saved to `path` when given; shown in a notebook;
    returns the figure (closed). Our kernels' series take `grids.COLORS["ours_paged"]`, the rest greys."""
    import matplotlib
    import matplotlib.pyplot as plt

    df = _frame(stats)
    x, ours = df["step"], COLORS["ours_paged"]
    fig, axes = plt.subplots(2, 2, figsize=(13, 8), sharex=True)
    ax = axes[0, 0]
    ax.bar(x, df["decode_tokens"], width=1.0, label="decode tokens", color="0.25")
    ax.bar(x, df["prefill_tokens"], width=1.0, bottom=df["decode_tokens"], label="prefill tokens", color="0.7")
    ax.set_ylabel("tokens per step")
    ax.set_title("what each step computes", fontsize=10)
    ax = axes[0, 1]
    mixed = df["prefill_tokens"] > 0
    ax.scatter(x[mixed], df["tokens_per_s"][mixed], s=12, marker="o", color=ours, label="steps with prefill chunks")
    ax.scatter(x[~mixed], df["tokens_per_s"][~mixed], s=12, marker="x", color=ours, alpha=0.5,
               label="decode-only steps")
    ax.set_yscale("log")
    ax.set_ylabel("tokens / s (attention time)")
    ax.set_title("throughput of each step", fontsize=10)
    ax = axes[1, 0]
    unit, scale = _memory_unit(df["dense_max_batch_mib"].max())
    ax.plot(x, df["pool_in_use_mib"] * scale, color=ours, linewidth=2, label="paged: pages in use")
    ax.axhline(df["pool_mib"].max() * scale, color=ours, linestyle=":", label="paged: the whole pool")
    ax.plot(x, df["live_kv_mib"] * scale, color="black", linewidth=1, linestyle="--", label="live K/V (tokens cached)")
    ax.plot(x, df["dense_running_mib"] * scale, color="0.5", label="dense: max_seqlen per running request")
    ax.axhline(df["dense_max_batch_mib"].max() * scale, color="0.5", linestyle=":", label="dense: max_batch up front")
    ax.set_ylabel(f"K/V memory, one layer ({unit})")
    ax.set_ylim(bottom=0)
    ax.set_title("K/V memory per step", fontsize=10)
    ax = axes[1, 1]
    ax.step(x, df["running"], where="mid", color="black", label="running")
    ax.step(x, df["waiting"], where="mid", color="0.6", label="arrived, waiting for admission")
    ax.set_ylabel("requests")
    ax.yaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.set_title("requests", fontsize=10)
    for ax in axes.flat:
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    for ax in axes[1]:
        ax.set_xlabel("engine step")
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    report.write_figure(fig, path)
    return fig


def plot_request_memory(runs: Mapping[str, Any], *, bytes_per_token: int, page_size: int,
                        max_seqlen: Optional[int] = None, title: str, path: Optional[Union[str, Path]] = None):
    """K/V memory of one request (one layer) against its length (prompt + new tokens): for each run
    ({label: its `requests_frame()`}), the most pages each request held, as memory; the live K/V of a
    request of that length (length x bytes_per_token); and, given max_seqlen, what a dense cache reserves
    per request whatever its length. Linear axes. Saved to `path` when given; returns the figure (closed)."""
    import matplotlib.pyplot as plt

    longest = max(int(df["prompt_len"].max() + df["max_new_tokens"].max()) for df in runs.values())
    top = max(longest, max_seqlen or 0) * bytes_per_token / 2**20
    unit, scale = _memory_unit(top)
    mib = bytes_per_token / 2**20 * scale
    fig, ax = plt.subplots(figsize=(9, 4.5))
    markers = ["o", "s", "^", "D"]
    for i, (label, df) in enumerate(runs.items()):
        length = df["prompt_len"] + df["max_new_tokens"]
        ours = COLORS["ours_paged"]
        ax.scatter(length, df["pages_held"] * page_size * mib, marker=markers[i % 4], s=28, edgecolors=ours,
                   facecolors="none" if i % 2 else ours, label=f"{label}: pages held")
    lengths = [0, max(longest, max_seqlen or 0)]
    ax.plot(lengths, [n * mib for n in lengths], color="black", linestyle="--", linewidth=1,
            label="live K/V of the request")
    if max_seqlen is not None:
        ax.axhline(max_seqlen * mib, color="0.5", linestyle=":", label="dense: max_seqlen reserved per request")
    ax.set_xlabel("request length: prompt + new tokens")
    ax.set_ylabel(f"K/V of one request, one layer ({unit})")
    ax.set_xlim(left=0)
    ax.set_ylim(0, 1.15 * top * scale)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    report.write_figure(fig, path)
    return fig
