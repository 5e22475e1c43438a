"""Context-parallel attention (tritonattn.parallel) with real process groups: gloo on CPU (under the interpreter),
2 and 4 ranks spawned once per world size for the whole module, process groups with a 60 s timeout so that a
bug fails instead of hanging.

Every rank draws the same whole sequence, runs one single-process `flash_attn_func` on it (the reference the
shards must reproduce), and its shard through each layout, causal or not, with sliding windows in global
positions, GQA and MQA: output, LSE and all three gradients of its shard against the same shard of the
reference's, within the agreement tolerance of two kernel paths on the same data.
"""

from __future__ import annotations

import datetime
import itertools
import os
import socket
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from helpers import DEVICE, ON_GPU
from tritonattn.testing import agreement_tolerance, lse_tolerance, rel_err

CASES = {  # name: (layout, causal, window_size, alibi, nheads, nheads_k, dtype)
    f"{layout} {mask} {heads} {dtype}": (layout, causal, window, alibi, *heads_kv, dtype)
    for layout in ("ring", "zigzag", "stripe")
    for mask, (causal, window, alibi) in {
        "full": (False, (-1, -1), False), "causal": (True, (-1, -1), False), "causal window 9": (True, (9, 0), False),
        "window (5, 7)": (False, (5, 7), False), "causal alibi": (True, (-1, -1), True),
        "window (5, 7) alibi": (False, (5, 7), True)}.items()
    for heads, heads_kv in {"gqa": (4, 2), "mqa": (4, 1)}.items()
    for dtype in ("float32", "float16")
    if (heads == "gqa" or mask == "causal")
    and (dtype == "float32" or (heads == "gqa" and mask in ("causal", "window (5, 7)")))  # fp16: two masks
}
VARLEN_MASKS = {  # name: (causal, window_size, alibi) of the packed ring forms' cases
    "full": (False, (-1, -1), False), "causal": (True, (-1, -1), False), "full alibi": (False, (-1, -1), True),
    "causal alibi": (True, (-1, -1), True), "causal window 9": (True, (9, 0), False),
    "window (5, 7)": (False, (5, 7), False), "causal window 9 alibi": (True, (9, 0), True)}
VARLEN = {f"varlen {layout} {mask} {dtype}": dtype for layout, mask, dtype in
          itertools.product(("ring", "zigzag", "stripe"), VARLEN_MASKS, (torch.float32, torch.float16))
          if (dtype == torch.float32 or mask in ("full", "causal"))  # fp16: two masks
          and (layout != "stripe" or (dtype == torch.float32 and mask in ("causal", "window (5, 7)",
                                                                          "causal window 9 alibi")))}
VARLEN_AT_FOUR = [name for name in VARLEN if "alibi" not in name and "float32" in name and "(5, 7)" not in name]
SLOPES = torch.tensor([0.5, 0.25, 0.125, 0.0625])  # ALiBi's, one per query head
CHUNK, HEAD_DIM = 8, 32  # tokens per chunk: a zigzag shard holds two
# 2 ranks run every case; 4 ranks (four processes on CI's two cores: the module's time) the causal float32 GQA
# masks, and packed sequences in float32 without ALiBi or the two-sided window
AT_FOUR = [name for name in CASES if name.endswith(" gqa float32") and name.split(" ", 1)[1].startswith("causal")]
LLAMA3 = {  # name: (causal, window_size, alibi, softcap, heads_k_stride, dtype)
    "llama3 full float32": (False, (-1, -1), False, 0.0, 1, torch.float32),
    "llama3 causal float32": (True, (-1, -1), False, 0.0, 2, torch.float32),
    "llama3 causal window 5 alibi softcap float32": (True, (5, 0), True, 5.0, 1, torch.float32),
    "llama3 causal float16": (True, (-1, -1), False, 0.0, 1, torch.float16),
}


def ran(cases: dict, case: str) -> dict:
    """The rank's results of `case`, or a skip where this world size does not run it (AT_FOUR)."""
    if case not in cases:
        pytest.skip("not run at this world size (4 ranks: causal float32 GQA cases, packed float32 without ALiBi or "
                    "the two-sided window)")
    return cases[case]


def assert_shards_agree(ranks: dict, case: str, dtype: torch.dtype) -> None:
    """Every rank's errors of `case` against the single-process reference: LSE within its tolerance, the output
    within the agreement tolerance of two kernel paths, the gradients within three times it."""
    tol, (atol, _) = agreement_tolerance(dtype), lse_tolerance(dtype)
    for rank, cases in sorted(ranks.items()):
        errors = ran(cases, case)
        assert not isinstance(errors, str), f"rank {rank}:\n{errors}"
        assert errors["lse"] <= atol, (rank, errors)
        for name in ("out", "dq", "dk", "dv"):
            assert errors[name] <= tol * (3 if name != "out" else 1), (rank, name, errors)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ring_flash_attn_on_our_kernels():
    """ring-flash-attn itself (the `ring-flash-attn` package, installed without its flash-attn dependency), its
    `flash_attn.flash_attn_interface` imports answered by ours (the shim flash-attn users would write), or None
    where it is not installed. Its transformers adapter imports a helper that newer transformers no longer
    have; a stand-in is set only when missing, for the import alone."""
    import importlib.util
    import sys
    import types

    if importlib.util.find_spec("ring_flash_attn") is None:
        return None
    import tritonattn.flash_attn_interface as ours

    package = types.ModuleType("flash_attn")
    package.flash_attn_interface = ours
    sys.modules.setdefault("flash_attn", package)
    sys.modules.setdefault("flash_attn.flash_attn_interface", ours)
    import transformers.modeling_flash_attention_utils as hf

    if not hasattr(hf, "is_flash_attn_greater_or_equal_2_10"):
        hf.is_flash_attn_greater_or_equal_2_10 = lambda: True
    import ring_flash_attn

    return ring_flash_attn


def _run_cases(rank: int, world: int, port: int, results) -> None:
    """One rank: every case against the single-process reference; puts (rank, {case: errors or a traceback})."""
    os.environ["TRITON_INTERPRET"] = "1"
    from tritonattn import flash_attn_func
    from tritonattn.parallel import context_parallel_attention, shard

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    out = {}
    for name, (layout, causal, window, alibi, nheads, nheads_k, dtype) in CASES.items():
        if world == 4 and name not in AT_FOUR:
            continue
        try:
            dtype = getattr(torch, dtype)
            seqlen = CHUNK * world * (2 if layout == "zigzag" else 1)
            g = torch.Generator().manual_seed(0)
            q, k, v, dout = (torch.randn(1, seqlen, h, HEAD_DIM, generator=g).to(dtype)
                             for h in (nheads, nheads_k, nheads_k, nheads))
            whole = [t.clone().requires_grad_() for t in (q, k, v)]
            slopes = SLOPES[:nheads] if alibi else None
            ref, ref_lse = flash_attn_func(*whole, causal=causal, window_size=window, alibi_slopes=slopes,
                                           return_softmax_lse=True)
            ref.backward(dout)
            mine = [shard(t, layout, rank, world).clone().requires_grad_() for t in (q, k, v)]
            res, lse, _ = context_parallel_attention(*mine, causal=causal, window_size=window, alibi_slopes=slopes,
                                                     return_attn_probs=True, layout=layout)
            res.backward(shard(dout, layout, rank, world))
            out[name] = {
                "out": rel_err(res, shard(ref, layout, rank, world)),
                "lse": (lse - shard(ref_lse, layout, rank, world, dim=2)).abs().max().item(),
                **{f"d{n}": rel_err(t.grad, shard(w.grad, layout, rank, world)) for n, t, w in zip("qkv", mine, whole)},
            }
        except Exception:  # reported by the test of that case, on every rank
            out[name] = traceback.format_exc()
    import tritonattn.parallel as cp
    from tritonattn import flash_attn_varlen_func

    for (layout, mask), dtype in itertools.product(itertools.product(("ring", "zigzag", "stripe"), VARLEN_MASKS),
                                                   (torch.float32, torch.float16)):
        name = f"varlen {layout} {mask} {dtype}"
        if name not in VARLEN or (world == 4 and name not in VARLEN_AT_FOUR):
            continue
        causal, window, alibi = VARLEN_MASKS[mask]
        try:  # packed sequences, each cut into world chunks, rank r holding chunk r of every one
            lengths = [8 * world, 2 * world, 12 * world]
            cu = torch.tensor([0] + list(itertools.accumulate(lengths)), dtype=torch.int32)
            g = torch.Generator().manual_seed(2)
            q, k, v, dout = (torch.randn(int(cu[-1]), h, HEAD_DIM, generator=g).to(dtype) for h in (4, 2, 2, 4))
            whole = [t.clone().requires_grad_() for t in (q, k, v)]
            slopes = SLOPES if alibi else None
            ref, ref_lse, _ = flash_attn_varlen_func(*whole, cu, cu, max(lengths), max(lengths), causal=causal,
                                                     window_size=window, alibi_slopes=slopes, return_attn_probs=True)
            ref.backward(dout)
            def local(t):
                return cp.shard_varlen(t, cu, rank, world, layout)

            fn = {"ring": cp.ring_flash_attn_varlen_func, "zigzag": cp.zigzag_ring_flash_attn_varlen_func,
                  "stripe": cp.stripe_flash_attn_varlen_func}[layout]
            mine = [local(t).clone().requires_grad_() for t in (q, k, v)]
            res, lse, _ = fn(*mine, cu // world, max(lengths) // world, causal=causal, window_size=window,
                             alibi_slopes=slopes, return_attn_probs=True)
            res.backward(local(dout))
            out[name] = {
                "out": rel_err(res, local(ref)),
                "lse": (lse - local(ref_lse.T).T).abs().max().item(),
                **{f"d{n}": rel_err(t.grad, local(w.grad)) for n, t, w in zip("qkv", mine, whole)},
            }
        except Exception:
            out[name] = traceback.format_exc()

    for name, (causal, window, alibi, softcap, stride, dtype) in LLAMA3.items():
        if world == 4 and (dtype != torch.float32 or not causal):
            continue
        try:  # the all-gather form: equal token ranges whatever the sequence borders
            lengths = [5 * world, 3 * world + 1, 4 * world - 1, 2 * world]  # borders fall inside shards
            cu = torch.tensor([0] + list(itertools.accumulate(lengths)), dtype=torch.int32)
            g = torch.Generator().manual_seed(4)
            q, k, v, dout = (torch.randn(int(cu[-1]), h, HEAD_DIM, generator=g).to(dtype) for h in (4, 2, 2, 4))
            slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625]) if alibi else None
            whole = [t.clone().requires_grad_() for t in (q, k, v)]
            ref, ref_lse, _ = flash_attn_varlen_func(*whole, cu, cu, max(lengths), max(lengths), causal=causal,
                                                     window_size=window, alibi_slopes=slopes, softcap=softcap,
                                                     return_attn_probs=True)
            ref.backward(dout)
            local = lambda t, dim=0: cp.shard_llama3(t, rank, world, dim)  # noqa: E731
            cu_q, cu_k, max_q, max_k, k_slice = cp.llama3_flash_attn_prepare_cu_seqlens(cu, causal, rank, world)
            mine = [local(t).clone().requires_grad_() for t in (q, k, v)]
            res, lse, _ = cp.llama3_flash_attn_varlen_func(*mine, cu_q, cu_k, max_q, max_k, stride, k_slice,
                                                           causal=causal, window_size=window, alibi_slopes=slopes,
                                                           return_attn_probs=True, softcap=softcap)
            res.backward(local(dout))
            out[name] = {
                "out": rel_err(res, local(ref)),
                "lse": (lse - local(ref_lse, 1)).abs().max().item(),
                **{f"d{n}": rel_err(t.grad, local(w.grad)) for n, t, w in zip("qkv", mine, whole)},
            }
        except Exception:
            out[name] = traceback.format_exc()

    for layout, prefix in (("ring", "ring"), ("zigzag", "zigzag_ring"), ("stripe", "stripe")):
        try:  # the packed forms: the same values and gradients as the unpacked function
            seqlen = CHUNK * world * (2 if layout == "zigzag" else 1)
            g = torch.Generator().manual_seed(1)
            qkv = shard(torch.randn(1, seqlen, 3, 2, HEAD_DIM, generator=g), layout, rank, world)
            dout = torch.randn(qkv[:, :, 0].shape, generator=g)
            results_ = []
            for form in ("", "qkvpacked_", "kvpacked_"):
                fn = getattr(cp, f"{prefix}_flash_attn_{form}func")
                leaf = qkv.clone().requires_grad_()
                if form == "qkvpacked_":
                    o = fn(leaf, causal=True)
                elif form == "kvpacked_":
                    o = fn(leaf[:, :, 0], leaf[:, :, 1:], causal=True)
                else:
                    o = fn(leaf[:, :, 0], leaf[:, :, 1], leaf[:, :, 2], causal=True)
                o.backward(dout)
                results_.append((o.detach(), leaf.grad))
            out[f"packed {layout}"] = max(max(rel_err(a, results_[0][0]), rel_err(b, results_[0][1]))
                                          for a, b in results_[1:])
        except Exception:
            out[f"packed {layout}"] = traceback.format_exc()
    rfa = ring_flash_attn_on_our_kernels()
    for layout, fn_name in (("ring", "ring_flash_attn_func"), ("zigzag", "zigzag_ring_flash_attn_func"),
                            ("stripe", "stripe_flash_attn_func")):
        name = f"ring-flash-attn {layout}"
        try:  # its supported case (causal, no window) through its own code on our primitives, against ours
            if rfa is None:
                out[name] = "ring-flash-attn is not installed"
                continue
            seqlen = CHUNK * world * (2 if layout == "zigzag" else 1)
            g = torch.Generator().manual_seed(3)
            q, k, v, dout = (torch.randn(1, seqlen, h, HEAD_DIM, generator=g).half() for h in (4, 2, 2, 4))
            whole = [t.clone().requires_grad_() for t in (q, k, v)]
            ref = flash_attn_func(*whole, causal=True)
            ref.backward(dout)
            theirs = [shard(t, layout, rank, world).clone().requires_grad_() for t in (q, k, v)]
            res = getattr(rfa, fn_name)(*theirs, causal=True)
            res.backward(shard(dout, layout, rank, world))
            out[name] = {"out": rel_err(res, shard(ref, layout, rank, world)),
                         **{f"d{n}": rel_err(t.grad, shard(w.grad, layout, rank, world))
                            for n, t, w in zip("qkv", theirs, whole)}}
        except Exception:
            out[name] = traceback.format_exc()
    try:  # its all-gather form (causal) through its own code on our primitives
        if rfa is None:
            out["ring-flash-attn llama3"] = "ring-flash-attn is not installed"
        else:
            lengths = [5 * world, 3 * world + 1, 4 * world - 1]
            cu = torch.tensor([0] + list(itertools.accumulate(lengths)), dtype=torch.int32)
            g = torch.Generator().manual_seed(5)
            q, k, v, dout = (torch.randn(int(cu[-1]), h, HEAD_DIM, generator=g).half() for h in (4, 2, 2, 4))
            whole = [t.clone().requires_grad_() for t in (q, k, v)]
            ref = flash_attn_varlen_func(*whole, cu, cu, max(lengths), max(lengths), causal=True)
            ref.backward(dout)
            theirs = [cp.shard_llama3(t, rank, world).clone().requires_grad_() for t in (q, k, v)]
            args = rfa.llama3_flash_attn_prepare_cu_seqlens(cu, True, rank, world)
            res = rfa.llama3_flash_attn_varlen_func(*theirs, *args[:4], 1, args[4], causal=True)
            res.backward(cp.shard_llama3(dout, rank, world))
            out["ring-flash-attn llama3"] = {
                "out": rel_err(res, cp.shard_llama3(ref, rank, world)),
                **{f"d{n}": rel_err(t.grad, cp.shard_llama3(w.grad, rank, world))
                   for n, t, w in zip("qkv", theirs, whole)}}
    except Exception:
        out["ring-flash-attn llama3"] = traceback.format_exc()
    for name, kw in {"disagree": {}, "one rank": dict(dropout_p=0.1 if rank == 0 else 0.0)}.items():
        try:  # ranks that disagree, or one rank's bad input: every rank raises, none hangs
            seqlen = 2 * CHUNK if name == "one rank" or rank == 0 else 4 * CHUNK
            q = torch.randn(1, seqlen, 2, HEAD_DIM)
            context_parallel_attention(q, q, q, **kw)
            out[f"bad {name}"] = "not refused"
        except Exception as e:  # noqa: BLE001
            out[f"bad {name}"] = f"{type(e).__name__}: {e}"
    bad = {  # name: keyword arguments of a call that must be refused on every rank, before any transfer
        "seqlen": {},  # k and v shorter than q, below
        "dropout": dict(dropout_p=0.1),
        "alibi": dict(alibi_slopes=torch.ones(3)),  # two heads
        "layout": dict(layout="stripes"),
    }
    for name, kw in bad.items():
        args = dict(q=torch.randn(1, 2 * CHUNK, 2, HEAD_DIM), k=torch.randn(1, 2 * CHUNK, 2, HEAD_DIM),
                    v=torch.randn(1, 2 * CHUNK, 2, HEAD_DIM))
        args.update(kw)
        if name == "seqlen":
            args["k"] = args["v"] = torch.randn(1, 7, 2, HEAD_DIM)
        try:
            context_parallel_attention(**args)
            out[f"bad {name}"] = "not refused"
        except Exception as e:  # noqa: BLE001  (the message is the result)
            out[f"bad {name}"] = f"{type(e).__name__}: {e}"
    results.put((rank, out))
    dist.destroy_process_group()


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"world{w}")
def ranks(request):
    """{rank: {case: errors}} of one spawned world of gloo ranks."""
    world = request.param
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_run_cases, args=(r, world, port, results)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        got = dict(results.get(timeout=280) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return got


@pytest.mark.skipif(ON_GPU, reason="gloo ranks on CPU under the interpreter (the GPU runs world size 1 with NCCL)")
@pytest.mark.parametrize("case", list(CASES))
def test_shards_equal_the_single_process_attention(ranks, case):
    assert_shards_agree(ranks, case, getattr(torch, CASES[case][-1]))


BAD = {"seqlen": ("InputError", "Expected q, k and v shards of one length divisible into"),
       "dropout": ("NotImplementedError", "Dropout in context-parallel attention"),
       "alibi": ("InputError", "Expected alibi_slopes of shape (2,) or (1, 2)"),
       "layout": ("InputError", "Expected a layout in")}


@pytest.mark.skipif(ON_GPU, reason="gloo ranks on CPU under the interpreter")
@pytest.mark.parametrize("name", list(BAD))
def test_bad_input_is_refused_on_every_rank(ranks, name):
    kind, message = BAD[name]
    for rank, cases in sorted(ranks.items()):
        assert cases[f"bad {name}"].startswith(f"{kind}: Rank {rank} refused its inputs: {message}"), (
            rank, cases[f"bad {name}"])


@pytest.mark.skipif(ON_GPU, reason="gloo ranks on CPU under the interpreter")
def test_disagreeing_ranks_all_raise(ranks):
    """Rank 0's shards are shorter than the others', or only rank 0 asks for dropout: every rank raises before any
    transfer (one all-gather of the call's signature and verdict), naming the ranks, and none waits."""
    for rank, cases in sorted(ranks.items()):
        assert cases["bad disagree"].startswith("InputError: Ranks disagree on the call"), (rank, cases)
        want = "NotImplementedError: Rank 0 refused its inputs: Dropout" if rank == 0 else \
            "InputError: Rank(s) [0] refused their inputs"
        assert cases["bad one rank"].startswith(want), (rank, cases["bad one rank"])


@pytest.mark.skipif(ON_GPU, reason="gloo ranks on CPU under the interpreter")
@pytest.mark.parametrize("case", list(LLAMA3))
def test_llama3_shards_equal_the_single_process_attention(ranks, case):
    """The all-gather form (equal token ranges, sequences crossing shard borders, KV heads gathered one or two at
    a time): output, LSE and gradients equal one single-process flash_attn_varlen_func, windows, ALiBi and
    softcap at their global positions."""
    assert_shards_agree(ranks, case, LLAMA3[case][-1])


def test_llama3_prepare_matches_ring_flash_attn():
    """Our llama3_flash_attn_prepare_cu_seqlens returns ring-flash-attn's values on random batches (its module is
    imported through the flash_attn shim)."""
    import importlib.util
    import random

    if importlib.util.find_spec("ring_flash_attn") is None:
        pytest.skip("ring-flash-attn is not installed: pip install --no-deps ring-flash-attn==0.1.8 (.ci/run does)")
    rfa = ring_flash_attn_on_our_kernels()
    from tritonattn.parallel import llama3_flash_attn_prepare_cu_seqlens as ours

    rng = random.Random(0)
    for _ in range(100):
        world = rng.choice([1, 2, 3, 4, 8])
        lengths = [rng.randint(1, 40) for _ in range(rng.randint(1, 6))]
        lengths[-1] += -sum(lengths) % world
        cu = torch.tensor([0] + list(itertools.accumulate(lengths)), dtype=torch.int32)
        for causal, rank in itertools.product((False, True), range(world)):
            a, b = ours(cu, causal, rank, world), rfa.llama3_flash_attn_prepare_cu_seqlens(cu, causal, rank, world)
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and a[2:] == b[2:], (lengths, world, rank)


def test_uninitialised_distributed_is_refused():
    from tritonattn.parallel import ring_flash_attn_func

    if dist.is_available() and dist.is_initialized():
        pytest.skip("a process group is initialised in this process")
    q = torch.randn(1, 8, 2, HEAD_DIM)
    with pytest.raises(ValueError, match="needs torch.distributed initialised"):
        ring_flash_attn_func(q, q, q)


def test_block_calls_are_the_global_masks():
    """Every pair's call (rows, keys, window on that corner, bottom-right) sees exactly the keys the global mask
    lets each query see: contiguous chunks and stripes, causal or not, windows on either side."""
    import itertools

    from tritonattn.parallel.blocks import block_call
    from tritonattn.testing import window_mask

    pairs = [(a * c, b * c, 1, c) for c in (1, 3, 8) for a, b in itertools.product(range(4), range(4))]
    pairs += [(r, s, w, c) for w in (2, 3, 4) for r, s in itertools.product(range(w), range(w)) for c in (1, 5)]
    for q_start, k_start, step, chunk in pairs:
        for left, right, causal in itertools.product((-1, 0, 1, 2, 5, 9, 20), (-1, 0, 1, 3, 9, 20), (False, True)):
            gi = torch.arange(chunk)[:, None] * step + q_start
            gj = torch.arange(chunk)[None, :] * step + k_start
            r = (0 if right < 0 else min(right, 0)) if causal else right
            want = torch.ones(chunk, chunk, dtype=torch.bool)
            if left >= 0:
                want &= gj >= gi - left
            if r >= 0:
                want &= gj <= gi + r
            call = block_call(q_start, k_start, step, chunk, (left, right), causal)
            got = torch.zeros(chunk, chunk, dtype=torch.bool)
            if call is not None:
                got[: call.rows, : call.keys] = window_mask(call.rows, call.keys, call.window)
            assert torch.equal(got, want), (q_start, k_start, step, chunk, left, right, causal, call)


def test_shard_and_unshard_are_inverse():
    from tritonattn.parallel import LAYOUTS, shard, unshard

    x = torch.arange(2 * 24 * 3).reshape(2, 24, 3)
    for layout, world in itertools.product(LAYOUTS, (1, 2, 3, 4)):
        shards = [shard(x, layout, r, world) for r in range(world)]
        assert sorted(torch.cat(shards, dim=1)[0, :, 0].tolist()) == x[0, :, 0].tolist()
        assert torch.equal(unshard(shards, layout), x), (layout, world)
    assert shard(x, "stripe", 1, 4)[0, :, 0].tolist() == [3 * i for i in range(1, 24, 4)]


@pytest.mark.parametrize("layout", ["ring", "zigzag", "stripe"])
def test_alibi_counts_global_positions_in_a_simulated_ring(layout):
    """A ring of 3 ranks simulated in one process (a stripe's ALiBi origin is then a fraction of the step): the
    forward of every rank with ALiBi, per-batch slopes, causal or with a two-sided window, equals its shard of one
    flash_attn_func on the whole sequence, output and LSE."""
    from tritonattn import flash_attn_func
    from tritonattn.api.args import attention_call
    from tritonattn.parallel.ring import ring_forward, shard

    world, chunk, nheads = 3, 8, 2
    seqlen = chunk * world * (2 if layout == "zigzag" else 1)
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, seqlen, nheads, HEAD_DIM, generator=g).to(DEVICE) for _ in range(3))
    slopes = torch.rand(2, nheads, generator=g).to(DEVICE)
    for causal, window in ((True, (-1, -1)), (False, (-1, -1)), (False, (4, 6))):
        ref, ref_lse = flash_attn_func(q, k, v, causal=causal, window_size=window, alibi_slopes=slopes,
                                       return_softmax_lse=True)
        call = attention_call(HEAD_DIM, None, causal, window, 0.0, slopes, seqlen_k=seqlen, batch=2, nheads=nheads,
                              device=q.device)
        shards = [[shard(t, layout, r, world) for t in (q, k, v)] for r in range(world)]
        for r in range(world):
            out, lse = ring_forward(*shards[r], call, layout, _SimulatedRing(r, world, [s[1:] for s in shards]))
            assert rel_err(out, shard(ref, layout, r, world)) <= agreement_tolerance(torch.float32), (causal, r)
            assert (lse - shard(ref_lse, layout, r, world, dim=2)).abs().max() <= lse_tolerance(torch.float32)[0]


@pytest.mark.skipif(ON_GPU, reason="gloo ranks on CPU under the interpreter")
@pytest.mark.parametrize("layout", ["ring", "zigzag", "stripe"])
def test_packed_forms_equal_the_unpacked(ranks, layout):
    for rank, cases in sorted(ranks.items()):
        err = cases[f"packed {layout}"]
        assert not isinstance(err, str), f"rank {rank}:\n{err}"
        assert err == 0.0, (rank, err)


def test_signatures_are_ring_flash_attns():
    """ring-flash-attn's public functions: names and parameters in its order and with its defaults."""
    import inspect

    import tritonattn.parallel as cp

    tail = "dropout_p=0.0 softmax_scale=None causal=False window_size=(-1, -1) alibi_slopes=None " \
           "deterministic=False return_attn_probs=False group=None"
    for prefix in ("ring", "zigzag_ring", "stripe"):
        for form, head in (("", "q k v"), ("qkvpacked_", "qkv"), ("kvpacked_", "q kv")):
            fn = getattr(cp, f"{prefix}_flash_attn_{form}func")
            params = " ".join(p.name if p.default is inspect.Parameter.empty else f"{p.name}={p.default!r}"
                              for p in inspect.signature(fn).parameters.values())
            assert params == f"{head} {tail}", (fn.__name__, params)
    for fn in (cp.ring_flash_attn_varlen_func, cp.zigzag_ring_flash_attn_varlen_func, cp.stripe_flash_attn_varlen_func):
        varlen = " ".join(p.name if p.default is inspect.Parameter.empty else f"{p.name}={p.default!r}"
                          for p in inspect.signature(fn).parameters.values())
        assert varlen == f"q k v cu_seqlens max_seqlen {tail}", (fn.__name__, varlen)


@pytest.mark.skipif(ON_GPU, reason="gloo ranks on CPU under the interpreter")
@pytest.mark.parametrize("case", list(VARLEN))
def test_varlen_shards_equal_the_single_process_attention(ranks, case):
    """Packed sequences of different lengths, each cut into world chunks (or stripes): every rank's output, LSE
    and gradients equal its part of one single-process flash_attn_varlen_func, windows and ALiBi at global
    positions (the sequences' lengths put a window's edge inside some chunk pairs, past others, before others)."""
    assert_shards_agree(ranks, case, VARLEN[case])


@pytest.mark.skipif(ON_GPU, reason="gloo ranks on CPU under the interpreter")
@pytest.mark.parametrize("layout", ["ring", "zigzag", "stripe", "llama3"])
def test_ring_flash_attn_itself_on_our_kernels(ranks, layout):
    """The cross-check: ring-flash-attn's own ring, zigzag and stripe code (causal, its supported case) over our
    primitives gives the single-process result too, in fp16: its dq passes through bf16 (hence the bound:
    bf16's rounding, 2^-8), and with fp32 inputs its backward is wrong whatever the kernels (its
    `block_dq_buffer.to(torch.float32)` is then the buffer itself, which the next step overwrites). CI
    installs ring-flash-attn without flash-attn (.ci/run)."""
    import importlib.util

    if importlib.util.find_spec("ring_flash_attn") is None:  # (the shim itself only in the spawned ranks)
        pytest.skip("ring-flash-attn is not installed: pip install --no-deps ring-flash-attn==0.1.8 (.ci/run does)")
    for rank, cases in sorted(ranks.items()):
        errors = cases[f"ring-flash-attn {layout}"]
        assert not isinstance(errors, str), f"rank {rank}:\n{errors}"
        assert errors["out"] <= agreement_tolerance(torch.float16), (rank, errors)
        for name in ("dq", "dk", "dv"):
            assert errors[name] <= 2.0**-8, (rank, name, errors)


# --------------------------------------------------------------------------------------------
# On the GPU: one NCCL rank, and the accuracy of the merge at world sizes 2-8 simulated in one process
# --------------------------------------------------------------------------------------------
def _nccl_world_one(port: int, results) -> None:
    """A one-rank NCCL group: every layout forward and backward in bf16 against flash_attn_func."""
    try:
        import tritonattn.parallel as cp
        from tritonattn import flash_attn_func

        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=60))
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, dout = (torch.randn(1, 1024, h, 128, device="cuda", dtype=torch.bfloat16, generator=g)
                         for h in (8, 2, 2, 8))
        errors = {}
        for causal in (False, True):
            whole = [t.clone().requires_grad_() for t in (q, k, v)]
            ref = flash_attn_func(*whole, causal=causal)
            ref.backward(dout)
            for layout in ("ring", "zigzag", "stripe", "llama3"):
                mine = [t.clone().requires_grad_() for t in (q, k, v)]
                if layout == "llama3":
                    cu = torch.tensor([0, 1024], dtype=torch.int32, device="cuda")
                    args = cp.llama3_flash_attn_prepare_cu_seqlens(cu, causal, 0, 1)
                    res = cp.llama3_flash_attn_varlen_func(*(t[0] for t in mine), *args[:4], 1, args[4],
                                                           causal=causal)[None]
                else:
                    res = cp.context_parallel_attention(*mine, causal=causal, layout=layout)
                res.backward(dout)
                errors[f"{layout} causal={causal}"] = [rel_err(res, ref)] + [
                    rel_err(t.grad, w.grad) for t, w in zip(mine, whole)]
        dist.destroy_process_group()
        results.put(errors)
    except Exception:
        results.put(traceback.format_exc())


@pytest.mark.skipif(not ON_GPU, reason="NCCL needs a GPU (CPU runs gloo ranks above)")
def test_world_size_one_over_nccl():
    """Every layout over a one-rank NCCL group equals flash_attn_func (bf16, causal or not), values and
    gradients, within the agreement tolerance of two kernel paths."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    proc = ctx.Process(target=_nccl_world_one, args=(_free_port(), results))
    proc.start()
    try:
        errors = results.get(timeout=240)
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
    assert not isinstance(errors, str), errors
    tol = agreement_tolerance(torch.bfloat16)
    for name, (out, dq, dk, dv) in errors.items():
        print(f"nccl world 1 {name}: out {out:.2e} dq {dq:.2e} dk {dk:.2e} dv {dv:.2e}")
        assert out <= tol and max(dq, dk, dv) <= 3 * tol, (name, out, dq, dk, dv)


class _SimulatedRing:
    """A ring of `world` ranks in one process, seen from `rank`: shift(t) returns, on wait, what rank - 1 would
    have sent (the K/V shards travel exactly as over a process group)."""

    def __init__(self, rank: int, world: int, shards):
        self.rank, self.world, self._shards, self._step = rank, world, shards, 0

    def shift(self, tensors):
        self._step += 1
        received = self._shards[(self.rank - self._step) % self.world]

        class Done:
            @staticmethod
            def wait():
                return received
        return Done()


@pytest.mark.skipif(not ON_GPU, reason="the bf16 comparison runs on the GPU (the interpreter has no bf16)")
@pytest.mark.parametrize("layout", ["ring", "zigzag"])
def test_merge_in_fp32_beats_rounding_each_step(layout):
    """bf16 inputs, 8k tokens, causal, world sizes 2-8 simulated in one process through ring.py's own forward:
    the error against an fp64 reference of ours (partials merged in float32) and of ring-flash-attn's scheme
    (each step's partial rounded to bf16, then merged in float32). Ours must not be worse at any world size (2%),
    and must stay within the error of one single-GPU call times 1.1."""
    from tritonattn import attention_ref, flash_attn_func
    from tritonattn.api.args import attention_call
    from tritonattn.api.primitives import merge_attention
    from tritonattn.parallel.ring import chunk_pairs, ring_forward, shard, unshard

    g = torch.Generator(device="cuda").manual_seed(0)
    n = 8192
    q, k, v = (torch.randn(1, n, h, 128, device="cuda", dtype=torch.bfloat16, generator=g) for h in (8, 2, 2))
    ref = attention_ref(q.double(), k.double(), v.double(), causal=True)[0]
    single = rel_err(flash_attn_func(q, k, v, causal=True), ref)
    call = attention_call(128, None, True, seqlen_k=n, batch=1, nheads=8, device=q.device)
    for world in (2, 4, 8):
        shards = [[shard(t, layout, r, world) for t in (q, k, v)] for r in range(world)]
        ours, theirs = [], []
        for r in range(world):
            kv = [[s[1], s[2]] for s in shards]
            out, _ = ring_forward(*shards[r], call, layout, _SimulatedRing(r, world, kv))
            ours.append(out.to(torch.bfloat16))
            chunk = shards[r][0].shape[1] // (2 if layout == "zigzag" else 1)
            acc = torch.zeros(shards[r][0].shape, dtype=torch.float32, device="cuda")
            lse = torch.full((1, 8, shards[r][0].shape[1]), float("inf"), device="cuda")
            for step in range(world):  # ring-flash-attn's: each block's output in bf16, merged in fp32
                src = (r - step) % world
                for rows, keys, block, _ in chunk_pairs(layout, r, src, world, chunk, call):
                    part, part_lse = _bf16_block(shards[r][0][:, rows], kv[src][0][:, keys], kv[src][1][:, keys], block)
                    acc[:, rows], lse[:, :, rows] = merge_attention(acc[:, rows], lse[:, :, rows], part.float(),
                                                                    part_lse)
            theirs.append(acc.to(torch.bfloat16))
        err_ours = rel_err(unshard(ours, layout), ref)
        err_theirs = rel_err(unshard(theirs, layout), ref)
        print(f"{layout} world {world}: ours {err_ours:.3e}, rounded per step {err_theirs:.3e}, "
              f"single GPU {single:.3e}")
        assert err_ours <= 1.02 * err_theirs and err_ours <= 1.1 * single, (world, err_ours, err_theirs, single)


def _bf16_block(q, k, v, block):
    """One block's attention as ring-flash-attn computes it: the forward in the inputs' dtype (bf16 output)."""
    from tritonattn.launch.prefill import launch_prefill

    return launch_prefill(q, k, v, block)
