"""Every launch the config selection can choose fits the shared memory of the card it is chosen for. For each card users
bring (tritonattn.config.hardware.TARGETS: T4, A100, A10, L4, H100/H200) the public functions are called under
`tritonattn.launch.fast.recording`, which plans each call for that card and records its launches instead of running
them, across what changes the choice: head dim, dtype, causal, packed (varlen) or not, dropout or not, the attention
variants (all on at once, paged varlen too) or not, forward and backward, and for the KV-cache path the query rows
per program (seqlen_q x group size), dense or paged with several page sizes, append or not, split or not, grids deep
enough to change a paged plan, and the variants (all on, dense and paged, split or not). One launch of each tile
class (`cross_compile.tile_key`: all but the integer and alignment specialisations) is cross-compiled for the card's
architecture (tests/cross_compile.py: Triton without a GPU) and its shared memory compared with the card's limit.
bf16 plans must equal fp16 ones (same bytes per element; compiled once, as fp16); an FP8 (e4m3) KV cache's launches
(decode dense and paged, append, split, the variants, the chunked cache-mode forward) and the FP8 forward's (e4m3 q, k,
v, dense and packed) are recorded and compiled for the cards that convert e4m3 (sm_89, sm_90), and refused before any
launch on the others; where no tile fits (a T4's fp32
backward above head dim 128, its fp32 decode with an append at 256) the call must say so before launching, and a card
without bf16 (T4) must refuse bf16 before any launch. """

from __future__ import annotations

import functools
import itertools
import os
from typing import Dict, List, Tuple

import pytest
import torch

import cross_compile
from helpers import DEVICE
from tritonattn import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache
from tritonattn.config.hardware import TARGETS, Target, fp8_unsupported
from tritonattn.config.tables import decode_unsupported, gluon_sm90_available, prefill_bwd_unsupported
from tritonattn.launch.decode import chunked_prefill_pays
from tritonattn.launch.fast import recording

# TRITONATTN_FITNESS=full compiles every head-dim tile for every card; by default (CI) the two largest, whose
# tiles need the most shared memory: a smaller head dim gets the same or smaller tiles from every table.
# TRITONATTN_FITNESS=classes (CI's other Triton versions) compiles one launch per launch class
# (cross_compile.class_key: kernel, tiles, options) of the fp16 plans.
FULL = os.environ.get("TRITONATTN_FITNESS", "") == "full"
CLASSES = os.environ.get("TRITONATTN_FITNESS", "") == "classes"
HEAD_DIMS = (16, 32, 64, 128, 256) if FULL else (128, 256)
SEQLEN_Q = (1, 4, 16, 64, 128)  # rows per program = seqlen_q x group: 1 .. 1024
GROUPS = (1, 8)
PAGE_SIZES = (16, 64, 256)
DEEP_BATCH = 100  # x 4 KV heads: more than DECODE_DEEP_GRID programs per SM on every card


def _empty(*shape, dtype):
    return torch.empty(*shape, dtype=dtype, device=DEVICE)


def _backward(out, dout, head_dim: int, target: Target):
    """out.backward(dout), or, where no backward config fits the card, the error that says so."""
    if prefill_bwd_unsupported(head_dim, out.dtype, target) is None:
        out.backward(dout)
    else:
        with pytest.raises(NotImplementedError, match="needs more shared memory per block than"):
            out.backward(dout)


def _prefill_calls(dtype: torch.dtype, target: Target):
    """(label, thunk) per prefill call: dense and packed, forward and backward, each head dim, causal or not."""
    for head_dim, causal in itertools.product(HEAD_DIMS, (False, True)):
        def dense(head_dim=head_dim, causal=causal):
            q = _empty(1, 70, 4, head_dim, dtype=dtype).requires_grad_()
            k = _empty(1, 90, 2, head_dim, dtype=dtype).requires_grad_()
            v = _empty(1, 90, 2, head_dim, dtype=dtype).requires_grad_()
            _backward(flash_attn_func(q, k, v, causal=causal), _empty(1, 70, 4, head_dim, dtype=dtype), head_dim,
                      target)

        def packed(head_dim=head_dim, causal=causal):
            cu = torch.tensor([0, 30, 70], dtype=torch.int32, device=DEVICE)
            q = _empty(70, 4, head_dim, dtype=dtype).requires_grad_()
            k = _empty(70, 2, head_dim, dtype=dtype).requires_grad_()
            v = _empty(70, 2, head_dim, dtype=dtype).requires_grad_()
            out = flash_attn_varlen_func(q, k, v, cu, cu, 40, 40, causal=causal)
            _backward(out, _empty(70, 4, head_dim, dtype=dtype), head_dim, target)

        def dropout(head_dim=head_dim, causal=causal):  # its forward, backward and S_dmask kernels
            cu = torch.tensor([0, 30, 70], dtype=torch.int32, device=DEVICE)
            q = _empty(70, 4, head_dim, dtype=dtype).requires_grad_()
            k = _empty(70, 2, head_dim, dtype=dtype).requires_grad_()
            out, _, _ = flash_attn_varlen_func(q, k, k, cu, cu, 40, 40, 0.1, causal=causal, return_attn_probs=True)
            _backward(out, _empty(70, 4, head_dim, dtype=dtype), head_dim, target)

        def variants(head_dim=head_dim, causal=causal):  # every variant on: the most code in one kernel
            q = _empty(1, 70, 4, head_dim, dtype=dtype).requires_grad_()
            k = _empty(1, 90, 2, head_dim, dtype=dtype).requires_grad_()
            sinks = torch.zeros(4, device=DEVICE, requires_grad=True)
            out = flash_attn_func(q, k, k, causal=causal, window_size=(30, 10), softcap=5.0,
                                  alibi_slopes=torch.ones(4, device=DEVICE), sinks=sinks)
            _backward(out, _empty(1, 70, 4, head_dim, dtype=dtype), head_dim, target)

        def paged_variants(head_dim=head_dim, causal=causal):  # paged varlen forward, every variant on
            cu = torch.tensor([0, 30, 70], dtype=torch.int32, device=DEVICE)
            q = _empty(70, 4, head_dim, dtype=dtype)
            for page_size in (16, 256):  # pages gathered per key, and whole key blocks per page (descriptors)
                cols = -(-40 // page_size)
                pool = _empty(2 * cols, page_size, 2, head_dim, dtype=dtype)
                table = torch.arange(2 * cols, dtype=torch.int32, device=DEVICE).view(2, cols)
                flash_attn_varlen_func(q, pool, pool, cu, cu, 40, 40, causal=causal, window_size=(30, 10),
                                       softcap=5.0, alibi_slopes=torch.ones(4, device=DEVICE),
                                       sinks=torch.zeros(4, device=DEVICE), block_table=table)

        def dense_long(head_dim=head_dim, causal=causal):  # long enough for Hopper's warp-specialized kernel
            q = _empty(1, 2048, 4, head_dim, dtype=dtype)
            k = _empty(1, 2048, 2, head_dim, dtype=dtype)
            flash_attn_func(q, k, k, causal=causal)

        def long_variants(head_dim=head_dim, causal=causal):  # the same with every variant Hopper's kernel takes
            q = _empty(1, 2048, 4, head_dim, dtype=dtype)
            k = _empty(1, 2048, 2, head_dim, dtype=dtype)
            flash_attn_func(q, k, k, causal=causal, window_size=(700, 0 if causal else 300), softcap=5.0,
                            alibi_slopes=torch.ones(4, device=DEVICE), sinks=torch.zeros(4, device=DEVICE))

        yield f"prefill D={head_dim} causal={causal}", dense
        yield f"long prefill D={head_dim} causal={causal}", dense_long
        yield f"long prefill variants D={head_dim} causal={causal}", long_variants
        yield f"varlen D={head_dim} causal={causal}", packed
        yield f"dropout D={head_dim} causal={causal}", dropout
        yield f"variants D={head_dim} causal={causal}", variants
        yield f"paged varlen variants D={head_dim} causal={causal}", paged_variants


def _kvcache_calls(dtype: torch.dtype, target: Target):
    """(label, thunk) per flash_attn_with_kvcache call across rows per program, paging, append, splits."""
    nheads_k, capacity = 4, 4096
    for head_dim, seqlen_q, group, append in itertools.product(HEAD_DIMS, SEQLEN_Q, GROUPS, (False, True)):
        nheads = nheads_k * group
        layouts = [(None, 1, 0), (None, 1, 1)]  # (page size, batch, num_splits): dense, heuristic and unsplit
        layouts += [(p, b, s) for p in PAGE_SIZES for b in (1, DEEP_BATCH) for s in (0, 1)]
        for page_size, batch, num_splits in layouts:
            def run(head_dim=head_dim, seqlen_q=seqlen_q, nheads=nheads, append=append, page_size=page_size,
                    batch=batch, num_splits=num_splits):
                q = _empty(batch, seqlen_q, nheads, head_dim, dtype=dtype)
                new = [_empty(batch, seqlen_q, nheads_k, head_dim, dtype=dtype) for _ in range(2)] if append else []
                lengths = torch.full((batch,), 7, dtype=torch.int32)  # on the host: checked, no sync
                if page_size is None:
                    k_cache = _empty(batch, capacity, nheads_k, head_dim, dtype=dtype)
                    flash_attn_with_kvcache(q, k_cache, k_cache.clone(), *new, cache_seqlens=lengths, causal=True,
                                            num_splits=num_splits)
                else:  # a small pool: every request's table points at its first pages
                    pool = _empty(8, page_size, nheads_k, head_dim, dtype=dtype)
                    table = torch.zeros(batch, capacity // page_size, dtype=torch.int32, device=DEVICE)
                    table[:, :2] = torch.tensor([1, 2], dtype=torch.int32)
                    flash_attn_with_kvcache(q, pool, pool.clone(), *new, cache_seqlens=lengths, block_table=table,
                                            causal=True, num_splits=num_splits)

            def call(run=run, head_dim=head_dim, append=append, seqlen_q=seqlen_q, nheads=nheads, batch=batch,
                     num_splits=num_splits):
                prefill_path = num_splits == 0 and chunked_prefill_pays(batch, seqlen_q, nheads, head_dim, dtype, True,
                                                                         target)
                if prefill_path or decode_unsupported(head_dim, dtype.itemsize, append, target) is None:
                    run()
                else:  # no decode tile fits the card: the call says so before launching
                    with pytest.raises(NotImplementedError, match="needs more shared memory per block than"):
                        run()

            label = (f"kvcache D={head_dim} seqlen_q={seqlen_q} group={group} append={append} "
                     f"page_size={page_size} batch={batch} num_splits={num_splits}")
            yield label, call
    # every variant on at once (the decode kernel's extra stage, slopes and sinks; the combine's sink): the
    # largest head dim, one token and a chunk of rows, dense and paged, with an append, split or not
    for seqlen_q, page_size, num_splits in itertools.product((1, 64), (None, PAGE_SIZES[0]), (0, 1)):
        def variants(seqlen_q=seqlen_q, page_size=page_size, num_splits=num_splits, head_dim=HEAD_DIMS[-1]):
            nheads = nheads_k * GROUPS[-1]
            q = _empty(1, seqlen_q, nheads, head_dim, dtype=dtype)
            k, v = (_empty(1, seqlen_q, nheads_k, head_dim, dtype=dtype) for _ in range(2))
            kw = dict(cache_seqlens=torch.full((1,), 7, dtype=torch.int32), causal=True, window_size=(300, 0),
                      softcap=20.0, alibi_slopes=torch.ones(nheads, device=DEVICE), num_splits=num_splits,
                      sinks=torch.zeros(nheads, device=DEVICE))
            if decode_unsupported(head_dim, dtype.itemsize, True, target) is not None:
                return  # as above: the plain call already checks the refusal
            if page_size is None:
                k_cache = _empty(1, capacity, nheads_k, head_dim, dtype=dtype)
                flash_attn_with_kvcache(q, k_cache, k_cache.clone(), k, v, **kw)
            else:
                pool = _empty(8, page_size, nheads_k, head_dim, dtype=dtype)
                table = torch.zeros(1, capacity // page_size, dtype=torch.int32, device=DEVICE)
                flash_attn_with_kvcache(q, pool, pool.clone(), k, v, block_table=table, **kw)

        yield f"kvcache variants seqlen_q={seqlen_q} page_size={page_size} num_splits={num_splits}", variants


def _fp8_kvcache_calls(dtype: torch.dtype, target: Target):
    """(label, thunk) per flash_attn_with_kvcache call over an FP8 (e4m3) cache with (batch, nheads_k) descales:
    rows per program, dense or paged, append, split or not, every variant on, and a chunk (the cache-mode
    forward and the append kernel)."""
    nheads_k, capacity = 4, 4096
    fp8 = torch.float8_e4m3fn
    for head_dim, seqlen_q, page_size, num_splits in itertools.product(HEAD_DIMS, (1, 16), (None, 16, 256), (0, 1)):
        def run(head_dim=head_dim, seqlen_q=seqlen_q, page_size=page_size, num_splits=num_splits, variants=False):
            nheads = nheads_k * GROUPS[-1]
            q = _empty(2, seqlen_q, nheads, head_dim, dtype=dtype)
            k, v = (_empty(2, seqlen_q, nheads_k, head_dim, dtype=dtype) for _ in range(2))
            kw = dict(cache_seqlens=torch.full((2,), 7, dtype=torch.int32), causal=True, num_splits=num_splits,
                      k_descale=torch.ones(2, nheads_k, device=DEVICE),
                      v_descale=torch.ones(2, nheads_k, device=DEVICE))
            if variants:  # and the counter of clamped appended values (its atomics compiled in)
                kw.update(window_size=(300, 0), softcap=20.0, alibi_slopes=torch.ones(nheads, device=DEVICE),
                          sinks=torch.zeros(nheads, device=DEVICE),
                          kv_saturated=torch.zeros(2, nheads_k, 2, dtype=torch.int64, device=DEVICE))
            if page_size is None:
                k_cache = _empty(2, capacity, nheads_k, head_dim, dtype=fp8)
                flash_attn_with_kvcache(q, k_cache, k_cache.clone(), k, v, **kw)
            else:
                pool = _empty(8, page_size, nheads_k, head_dim, dtype=fp8)
                table = torch.zeros(2, capacity // page_size, dtype=torch.int32, device=DEVICE)
                flash_attn_with_kvcache(q, pool, pool.clone(), k, v, block_table=table, **kw)

        label = f"fp8 kvcache D={head_dim} seqlen_q={seqlen_q} page_size={page_size} num_splits={num_splits}"
        yield label, run
        yield f"{label} variants", functools.partial(run, variants=True)
    for page_size in (None, 16):  # a chunk: append_kernel, then fwd_kernel's cache mode
        def chunk(page_size=page_size, head_dim=HEAD_DIMS[-1]):
            q = _empty(1, 512, 32, head_dim, dtype=dtype)
            k, v = (_empty(1, 512, nheads_k, head_dim, dtype=dtype) for _ in range(2))
            kw = dict(cache_seqlens=torch.full((1,), 7, dtype=torch.int32), causal=True, k_descale=0.5, v_descale=2.0,
                      kv_saturated=torch.zeros(1, nheads_k, 2, dtype=torch.int64, device=DEVICE))
            assert chunked_prefill_pays(1, 512, 32, head_dim, dtype, True, target)
            if page_size is None:
                k_cache = _empty(1, 1024, nheads_k, head_dim, dtype=fp8)
                flash_attn_with_kvcache(q, k_cache, k_cache.clone(), k, v, **kw)
            else:
                pool = _empty(40, page_size, nheads_k, head_dim, dtype=fp8)
                table = torch.arange(1024 // page_size, dtype=torch.int32, device=DEVICE)[None] % 40
                flash_attn_with_kvcache(q, pool, pool.clone(), k, v, block_table=table, **kw)

        yield f"fp8 kvcache chunk page_size={page_size}", chunk


def _fp8_prefill_calls(target: Target):
    """(label, thunk) per FP8 forward call (e4m3 q, k, v with descales): every head dim above 16, causal or
    not, GQA, dense and packed."""
    fp8 = torch.float8_e4m3fn
    for head_dim, causal, packed in itertools.product([d for d in HEAD_DIMS if d > 16], (False, True), (False, True)):
        def run(head_dim=head_dim, causal=causal, packed=packed):
            nheads_k = 2
            descales = dict(q_descale=torch.ones(2, nheads_k, device=DEVICE), k_descale=0.5, v_descale=2.0)
            q = _empty(2, 1024, nheads_k * GROUPS[-1], head_dim, dtype=fp8)
            k, v = (_empty(2, 1024, nheads_k, head_dim, dtype=fp8) for _ in range(2))
            if packed:
                cu = torch.tensor([0, 1024, 2048], dtype=torch.int32, device=DEVICE)
                flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu, cu, 1024, 1024,
                                       causal=causal, **descales)
            else:
                flash_attn_func(q, k, v, causal=causal, **descales)

        yield f"fp8 prefill D={head_dim} causal={causal} packed={packed}", run


def _record(target: Target, dtype: torch.dtype) -> List[Tuple[str, tuple, dict]]:
    """(call label, plan text, compile spec) of every launch the calls make when planned for `target`. The
    launch records hold the calls' tensors (caches of up to a GB): each is reduced to its text and spec
    before the next call, so one call's tensors at a time are alive."""
    records = []
    calls = itertools.chain(_prefill_calls(dtype, target), _kvcache_calls(dtype, target))
    if fp8_unsupported(target) is None and dtype != torch.float32:  # the FP8 forward's q is e4m3 in both
        calls = itertools.chain(calls, _fp8_kvcache_calls(dtype, target), _fp8_prefill_calls(target))
    for label, call in calls:
        with recording(target) as launched:
            call()
        records.extend((label, _plan_text(r), cross_compile.spec_of(r, target.arch)) for r in launched)
        del launched
    return records


def _plan_text(record) -> tuple:
    """A launch without its tensors' dtypes: what must be equal for fp16 and bf16."""
    return (getattr(record.fn, "__name__", str(record.fn)), record.grid, record.num_warps, record.num_stages,
            record.launch_pdl, record.maxnreg,
            tuple(a if not isinstance(a, torch.Tensor) else (tuple(a.shape), a.dtype.itemsize) for a in record.args))


@pytest.mark.parametrize("card", list(TARGETS))
def test_every_config_fits_the_card(card):
    """Each launch the selection makes for this card compiles for its architecture within its shared memory."""
    target = TARGETS[card]
    fp16 = _record(target, torch.float16)
    records = fp16 + (_record(target, torch.float32) if not CLASSES else [])
    if target.capability >= (8, 0) and not CLASSES:  # bf16 plans are the fp16 plans, byte for byte
        bf16 = _record(target, torch.bfloat16)
        assert [(label, text) for label, text, _ in bf16] == [(label, text) for label, text, _ in fp16]

    specs: Dict[str, dict] = {}
    labels: Dict[str, str] = {}
    for label, _, spec in records:
        key = (cross_compile.class_key if CLASSES else cross_compile.tile_key)(spec)
        specs.setdefault(key, spec)
        labels.setdefault(key, label)
    kernels = {spec["name"] for spec in specs.values()}
    expected = {"fwd_kernel", "bwd_preprocess_kernel", "bwd_dkdv_kernel", "bwd_dq_kernel", "decode_kernel",
                "combine_kernel", "append_kernel", "dropout_probs_kernel"}
    if target.capability[0] == 9 and gluon_sm90_available():  # Hopper's Gluon forward (kernels/tritonattn/jit/sm90.py)
        expected |= {"fwd_kernel_sm90_ws", "fp8_values_kernel"}  # the FP8 forward's V copy with it
    assert kernels == expected, f"the calls launched {sorted(kernels)}"
    results = cross_compile.shared_bytes(list(specs.values()))
    over, failed = [], []
    for (key, spec), result in zip(specs.items(), results):
        what = f"{spec['name']} {spec['options']} for {labels[key]}"
        if "error" in result:
            failed.append(f"{what}: {result['error'][:300]}")
        elif result["shared"] > target.smem_per_block:
            over.append(f"{what}: {result['shared']} B > {target.smem_per_block} B")
    print(f"{card}: {len(records)} launches, {len(specs)} tile classes compiled, largest "
          f"{max(r.get('shared', 0) for r in results)} B of {target.smem_per_block} B")
    assert not failed, f"{len(failed)} launches do not compile for {card}:\n" + "\n".join(failed[:20])
    assert not over, (f"{len(over)} of {len(specs)} launches need more shared memory than {card} has:\n"
                      + "\n".join(over[:30]))


@pytest.mark.parametrize("card", [name for name, target in TARGETS.items() if fp8_unsupported(target) is not None])
def test_fp8_cache_is_refused_before_sm89(card):
    """Cards before sm_89 (T4, A100, A10) have no e4m3 conversion in Triton: an FP8 cache is refused before any
    launch, with the reason."""
    q = _empty(1, 1, 4, 64, dtype=torch.float16)
    cache = _empty(1, 16, 2, 64, dtype=torch.float8_e4m3fn)
    with recording(TARGETS[card]) as launched:
        with pytest.raises(NotImplementedError, match="FP8 KV cache needs a GPU of compute capability 8.9"):
            flash_attn_with_kvcache(q, cache, cache, cache_seqlens=3, k_descale=1.0, v_descale=1.0)
        with pytest.raises(NotImplementedError, match="FP8 forward needs a GPU of compute capability 8.9"):
            flash_attn_func(cache, cache, cache, q_descale=1.0, k_descale=1.0, v_descale=1.0)
    assert launched == []


def test_bf16_is_refused_where_the_card_has_none():
    """A T4 (compute capability 7.5) has no bf16: the public functions say so before anything launches."""
    t4 = TARGETS["T4"]
    q = _empty(1, 8, 2, 64, dtype=torch.bfloat16)
    with recording(t4) as launched:
        with pytest.raises(NotImplementedError, match="bfloat16 needs a GPU of compute capability 8.0"):
            flash_attn_func(q, q, q)
        with pytest.raises(NotImplementedError, match="bfloat16 needs a GPU of compute capability 8.0"):
            flash_attn_with_kvcache(q[:, :1], q, q, cache_seqlens=3)
    assert launched == []
