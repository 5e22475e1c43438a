"""Paged KV cache (tritonattn/decode.py, tritonattn/decode_kernels.py): flash_attn_with_kvcache(..., block_table=...),
and PagedKVCache (tritonattn/kv_cache.py).

Pools are filled with random data and read through random permuted block tables (flash-attn's
`_generate_block_kvcache`, FlashInfer's paged tests); the dense caches gathered through the same
tables are the yardstick: paged decode must equal dense decode on them (bit for bit under the
interpreter, where both run the same arithmetic), and both must match tritonattn.testing.attention_ref
in fp32 over each request's keys. Small shapes under the interpreter, bigger ones and bf16 on a GPU.
"""

from __future__ import annotations

import pytest
import torch

from helpers import (
    DEVICE,
    INTERPRET,
    ON_GPU,
    assert_close_to_ref,
    assert_lse_close,
    assert_splits_agree,
    make_qkv,
    needs_graph_capture,
    padded_references,
    per_request_references,
    references,
)
from tritonattn import PagedKVCache, PoolExhaustedError, flash_attn_with_kvcache, rel_err
from tritonattn.config.hardware import TARGETS, device_target
from tritonattn.config.options import attn_options
from tritonattn.jit.common import wide_pages
from tritonattn.launch.decode import launch_kvcache
from tritonattn.testing import agreement_tolerance

DTYPES = [torch.float16, torch.float32] + ([torch.bfloat16] if ON_GPU else [])
NHEADS = 8 if ON_GPU else 4
HEAD_DIM = 128 if ON_GPU else 32
LONG = 1500 if ON_GPU else 150  # the longest cached request of the ragged tests


def randn(*shape, dtype, device=DEVICE):
    return torch.randn(*shape, dtype=torch.float32, device=device).to(dtype)


def make_paged_cache(batch, max_blocks, page_size, nheads_k, head_dim, dtype, *, extra_blocks=3, transposed=False):
    """Random pools, a random permuted block table and the dense caches gathered through it.

    Returns k_pool, v_pool (num_blocks, page_size, nheads_k, head_dim) (views of (num_blocks,
    nheads_k, page_size, head_dim) buffers when `transposed`), block_table int32 (batch, max_blocks)
    on DEVICE, and k_dense, v_dense (batch, max_blocks * page_size, nheads_k, head_dim) copies.
    """
    num_blocks = batch * max_blocks + extra_blocks  # some blocks belong to nobody
    if transposed:
        k_pool = randn(num_blocks, nheads_k, page_size, head_dim, dtype=dtype).transpose(1, 2)
        v_pool = randn(num_blocks, nheads_k, page_size, head_dim, dtype=dtype).transpose(1, 2)
    else:
        k_pool = randn(num_blocks, page_size, nheads_k, head_dim, dtype=dtype)
        v_pool = randn(num_blocks, page_size, nheads_k, head_dim, dtype=dtype)
    perm = torch.randperm(num_blocks, device=DEVICE)[: batch * max_blocks]
    block_table = perm.view(batch, max_blocks).to(torch.int32)
    k_dense, v_dense = gather_dense(k_pool, block_table), gather_dense(v_pool, block_table)
    return k_pool, v_pool, block_table, k_dense, v_dense


def gather_dense(pool, block_table):
    """The dense (batch, max_blocks * page_size, nheads_k, head_dim) view of a pool through a table."""
    batch, max_blocks = block_table.shape
    return pool[block_table.long()].reshape(batch, max_blocks * pool.shape[1], *pool.shape[2:]).clone()


def new_tokens(batch, seqlen_q, nheads, nheads_k, head_dim, dtype):
    q = randn(batch, seqlen_q, nheads, head_dim, dtype=dtype)
    k = randn(batch, seqlen_q, nheads_k, head_dim, dtype=dtype)
    v = randn(batch, seqlen_q, nheads_k, head_dim, dtype=dtype)
    return q, k, v


def assert_paged_equals_dense(out_paged, out_dense, dtype, msg=""):
    """Same data, same tiles: bitwise equal under the interpreter, rounding-close on a GPU."""
    if INTERPRET:
        assert torch.equal(out_paged, out_dense), f"paged != dense, rel err {rel_err(out_paged, out_dense):.2e} {msg}"
    else:
        diff = rel_err(out_paged, out_dense)
        print(f"paged vs dense rel err {diff:.2e} {msg}")
        assert diff <= agreement_tolerance(dtype), f"paged vs dense rel err {diff:.2e} {msg}"


def expected_pools(k_pool, v_pool, block_table, k, v, lengths):
    """The pools as they must be after appending k/v at each request's length, page by page."""
    k_exp, v_exp = k_pool.clone(), v_pool.clone()
    page_size = k_pool.shape[1]
    for b, length in enumerate(lengths):
        for t in range(k.shape[1]):
            block, row = int(block_table[b, (length + t) // page_size]), (length + t) % page_size
            k_exp[block, row], v_exp[block, row] = k[b, t], v[b, t]
    return k_exp, v_exp


def i32(values, device=DEVICE):
    return torch.tensor(values, dtype=torch.int32, device=device)


# --------------------------------------------------------------------------------------------
# Paged == dense == reference
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("append", [True, False])
@pytest.mark.parametrize("page_size", [16, 48, 64, 256])
def test_paged_equals_dense_and_reference(page_size, append, dtype):
    """Ragged requests (lengths incl. 0) through random permuted tables equal dense decode and the reference."""
    if INTERPRET and dtype == torch.float32 and page_size not in (48, 64):
        pytest.skip("fp32 under the interpreter: one gathering and one per-block page size")
    lengths = [0, 1, page_size - 1, page_size + 1, LONG]
    batch, nheads, nheads_k, head_dim = len(lengths), NHEADS, 2, HEAD_DIM
    max_blocks = (max(lengths) + 1) // page_size + 1
    k_pool, v_pool, table, k_dense, v_dense = make_paged_cache(batch, max_blocks, page_size, nheads_k, head_dim, dtype)
    q, k, v = new_tokens(batch, 1, nheads, nheads_k, head_dim, dtype)
    if not append:
        k = v = None
    seqlens = i32(lengths)
    ref32, ref_lse, ref_same = per_request_references(q, k_dense, v_dense, k, v, lengths, causal=False)
    # attention_ref's key padding over the dense cache (after the append) says the same
    pad32, _, _ = padded_references(q, k_dense, v_dense, k, v, lengths)
    assert rel_err(ref32, pad32) < 1e-5
    k_after, v_after = k_dense.clone(), v_dense.clone()  # the dense caches the append must leave
    if append:
        for b, length in enumerate(lengths):
            k_after[b, length], v_after[b, length] = k[b, 0], v[b, 0]

    for num_splits in (1, 3):
        kp, vp, kd, vd = k_pool.clone(), v_pool.clone(), k_dense.clone(), v_dense.clone()
        msg = f"(page_size={page_size}, append={append}, num_splits={num_splits}, {dtype})"
        out, lse = flash_attn_with_kvcache(q, kp, vp, k, v, cache_seqlens=seqlens, block_table=table,
                                           num_splits=num_splits, return_softmax_lse=True)
        out_dense, lse_dense = flash_attn_with_kvcache(q, kd, vd, k, v, cache_seqlens=seqlens, num_splits=num_splits,
                                                       return_softmax_lse=True)
        assert_close_to_ref(out, ref32, ref_same, msg=msg)
        assert_lse_close(lse, ref_lse, dtype, msg=msg)
        assert_paged_equals_dense(out, out_dense, dtype, msg)
        assert torch.equal(gather_dense(kp, table), kd) and torch.equal(gather_dense(vp, table), vd)
        if append:
            assert torch.equal(kd, k_after) and torch.equal(vd, v_after)


@pytest.mark.parametrize("page_size", [16, 64])
def test_deep_grid_equals_dense_and_reference(page_size):
    """An unsplit grid of DECODE_DEEP_GRID programs per SM (decode_paged_tiles: the config's stages and,
    for P = 16 at a 128-key BLOCK_N, BLOCK_N 64) still equals dense decode and the reference."""
    import tritonattn.launch.decode as decode
    from tritonattn.config.hardware import device_sm_count
    from tritonattn.config.tables import DECODE_DEEP_GRID, DECODE_DEEP_MIN_BLOCKS, INTERPRETER_SM_COUNT

    dtype = torch.bfloat16 if ON_GPU else torch.float16
    nheads, nheads_k, head_dim = 8, 2, 64
    sms = device_sm_count(torch.cuda.current_device()) if ON_GPU else INTERPRETER_SM_COUNT
    batch = -(-DECODE_DEEP_GRID * sms // nheads_k)
    target = device_target(torch.device(DEVICE))
    plan = decode.plan_decode(batch, 1, nheads, nheads_k, head_dim, 64 * page_size, dtype, target, 0, 0)
    max_blocks = -(-DECODE_DEEP_MIN_BLOCKS * plan.block_n // page_size)  # a long enough cache
    paged_plan = decode.plan_decode(batch, 1, nheads, nheads_k, head_dim, max_blocks * page_size, dtype, target, 0,
                              page_size)
    assert paged_plan.num_splits == 1 and paged_plan.num_stages == plan.num_stages
    k_pool, v_pool, table, k_dense, v_dense = make_paged_cache(batch, max_blocks, page_size, nheads_k, head_dim, dtype)
    capacity = max_blocks * page_size
    lengths = torch.randint(0, capacity, (batch,)).tolist()
    lengths[:3] = [0, capacity - 1, page_size]
    q, k, v = new_tokens(batch, 1, nheads, nheads_k, head_dim, dtype)
    ref32, _, ref_same = padded_references(q, k_dense, v_dense, k, v, lengths)  # batched: sanitizer-friendly
    k_exp, v_exp = expected_pools(k_pool, v_pool, table, k, v, lengths)
    out = flash_attn_with_kvcache(q, k_pool, v_pool, k, v, cache_seqlens=i32(lengths), block_table=table)
    out_dense = flash_attn_with_kvcache(q, k_dense, v_dense, k, v, cache_seqlens=i32(lengths))
    assert_close_to_ref(out, ref32, ref_same)
    assert_paged_equals_dense(out, out_dense, dtype, f"deep grid, page_size={page_size}, {paged_plan}")
    assert torch.equal(k_pool, k_exp) and torch.equal(v_pool, v_exp)


@pytest.mark.parametrize("page_size", [1, 2, 8])
def test_small_page_sizes(page_size):
    """Pages of 1..8 rows (smaller than a key block) are supported and match dense decode and the reference."""
    lengths = [0, 3, 21, 40]
    dtype, batch, nheads, nheads_k, head_dim = torch.float16, len(lengths), NHEADS, 2, HEAD_DIM
    max_blocks = 48 // page_size
    k_pool, v_pool, table, k_dense, v_dense = make_paged_cache(batch, max_blocks, page_size, nheads_k, head_dim, dtype)
    q, k, v = new_tokens(batch, 3, nheads, nheads_k, head_dim, dtype)
    ref32, ref_lse, ref_same = per_request_references(q, k_dense, v_dense, k, v, lengths, causal=True)
    k_exp, v_exp = expected_pools(k_pool, v_pool, table, k, v, lengths)
    out, lse = flash_attn_with_kvcache(q, k_pool, v_pool, k, v, cache_seqlens=i32(lengths), block_table=table,
                                       causal=True, num_splits=2, return_softmax_lse=True)
    out_dense = flash_attn_with_kvcache(q, k_dense, v_dense, k, v, cache_seqlens=i32(lengths), causal=True,
                                        num_splits=2)
    assert_close_to_ref(out, ref32, ref_same)
    assert_lse_close(lse, ref_lse, dtype)
    assert_paged_equals_dense(out, out_dense, dtype, f"page_size={page_size}")
    assert torch.equal(k_pool, k_exp) and torch.equal(v_pool, v_exp)


# --------------------------------------------------------------------------------------------
# The append, seqlen_q > 1, splits, layouts
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seqlen_q", [5, 70])
@pytest.mark.parametrize("page_size", [16, 48, 64])
def test_append_across_pages_writes_exactly_the_new_slots(page_size, seqlen_q):
    """An append crossing page boundaries writes each new row to its own page slot and no other byte.
    Split, so the last split loads its first chunk of new rows early (EARLY_NEW); 70 new rows take
    more than one chunk (BLOCK_NEW <= BLOCK_N), the rest loaded late."""
    dtype, nheads, nheads_k, head_dim = torch.float16, 4, 2, 40  # head_dim 40: padded to 64
    max_blocks = 3 + -(-seqlen_q // page_size)
    lengths = [page_size - 2, 2 * page_size - 1, 0, max_blocks * page_size - seqlen_q]  # cross, cross, start, fill
    batch, num_blocks = len(lengths), len(lengths) * max_blocks + 2
    # pools are views of wider buffers whose extra columns hold NaN: never read, never written
    k_buf = randn(num_blocks, page_size, nheads_k, head_dim + 8, dtype=dtype)
    v_buf = randn(num_blocks, page_size, nheads_k, head_dim + 8, dtype=dtype)
    k_buf[..., head_dim:] = float("nan")
    v_buf[..., head_dim:] = float("nan")
    k_pool, v_pool = k_buf[..., :head_dim], v_buf[..., :head_dim]
    table = torch.randperm(num_blocks, device=DEVICE)[: batch * max_blocks].view(batch, max_blocks).to(torch.int32)
    for b, length in enumerate(lengths):  # entries past a request's pages may hold anything
        table[b, (length + seqlen_q - 1) // page_size + 1 :] = -1
    q, k, v = new_tokens(batch, seqlen_q, nheads, nheads_k, head_dim, dtype)
    k_dense = gather_dense(k_pool, table.clamp(min=0))
    v_dense = gather_dense(v_pool, table.clamp(min=0))
    ref32, _, ref_same = per_request_references(q, k_dense, v_dense, k, v, lengths, causal=True)
    k_before, v_before = k_buf.clone(), v_buf.clone()

    out = flash_attn_with_kvcache(q, k_pool, v_pool, k, v, cache_seqlens=i32(lengths), block_table=table, causal=True,
                                  num_splits=3)
    assert_close_to_ref(out, ref32, ref_same)
    changed = torch.zeros(num_blocks, page_size, dtype=torch.bool, device=DEVICE)
    for b, length in enumerate(lengths):
        for t in range(seqlen_q):
            block, row = int(table[b, (length + t) // page_size]), (length + t) % page_size
            changed[block, row] = True
            assert torch.equal(k_buf[block, row, :, :head_dim], k[b, t])
            assert torch.equal(v_buf[block, row, :, :head_dim], v[b, t])
    assert int(changed.sum()) == batch * seqlen_q
    same = lambda a, b: torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))
    assert same(k_buf[~changed], k_before[~changed]) and same(v_buf[~changed], v_before[~changed])
    assert same(k_buf[..., head_dim:], k_before[..., head_dim:])
    assert same(v_buf[..., head_dim:], v_before[..., head_dim:])


@pytest.mark.parametrize("append", [True, False])
@pytest.mark.parametrize("group", [1, 4])
def test_seqlen_q_causal_bottom_right(group, append):
    """seqlen_q > 1 with the bottom-right causal mask over a paged cache matches the reference, split or not."""
    dtype, page_size, seqlen_q = torch.float16, 16, 4
    lengths = [0, 3, 40, 100] if INTERPRET else [0, 3, 400, 2040]
    batch, nheads, head_dim = len(lengths), NHEADS, HEAD_DIM
    nheads_k, max_blocks = nheads // group, (max(lengths) + seqlen_q) // page_size + 1
    k_pool, v_pool, table, k_dense, v_dense = make_paged_cache(batch, max_blocks, page_size, nheads_k, head_dim, dtype)
    q, k, v = new_tokens(batch, seqlen_q, nheads, nheads_k, head_dim, dtype)
    if not append:
        k = v = None
    ref32, ref_lse, ref_same = per_request_references(q, k_dense, v_dense, k, v, lengths, causal=True)
    for num_splits in (1, 3):
        out, lse = flash_attn_with_kvcache(q, k_pool.clone(), v_pool.clone(), k, v, cache_seqlens=i32(lengths),
                                           block_table=table, causal=True, num_splits=num_splits,
                                           return_softmax_lse=True)
        msg = f"(group={group}, append={append}, num_splits={num_splits})"
        assert_close_to_ref(out, ref32, ref_same, msg=msg)
        assert_lse_close(lse, ref_lse, dtype, msg=msg)


@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("one_loop", [False, True])
def test_one_loop_and_two_loops_match_the_reference(monkeypatch, one_loop, page_size):
    """Both forms of a split's loop over its cached keys (ONE_LOOP, [Note] One loop for short splits in
    tritonattn/decode_kernels.py), forced whatever the split length, over dense and paged caches: ragged tails
    of every size, empty splits, causal seqlen_q > 1 with and without an append."""
    import tritonattn.launch.decode as decode
    import tritonattn.launch.replay as replay

    monkeypatch.setattr(decode, "one_loop", lambda blocks_per_split, gathers: one_loop)
    replay.REPLAYS.clear()  # replays key on the call, which decides ONE_LOOP in real use: record the forced form
    dtype, seqlen_q = torch.float16, 3
    lengths = [0, 5, 31, 64, 100] if INTERPRET else [0, 5, 63, 640, 2000]
    batch, nheads, nheads_k, head_dim = len(lengths), NHEADS, 2, HEAD_DIM
    max_blocks = (max(lengths) + seqlen_q) // page_size + 1
    k_pool, v_pool, table, k_dense, v_dense = make_paged_cache(batch, max_blocks, page_size, nheads_k, head_dim, dtype)
    q, k_new, v_new = new_tokens(batch, seqlen_q, nheads, nheads_k, head_dim, dtype)
    try:
        for append in (True, False):
            k, v = (k_new, v_new) if append else (None, None)
            ref32, ref_lse, ref_same = per_request_references(q, k_dense, v_dense, k, v, lengths, causal=True)
            for num_splits in (1, 3):
                msg = f"(one_loop={one_loop}, page_size={page_size}, append={append}, num_splits={num_splits})"
                for tables, kc, vc in ((table, k_pool, v_pool), (None, k_dense, v_dense)):
                    out, lse = flash_attn_with_kvcache(q, kc.clone(), vc.clone(), k, v, cache_seqlens=i32(lengths),
                                                       block_table=tables, causal=True, num_splits=num_splits,
                                                       return_softmax_lse=True)
                    where = "paged" if tables is not None else "dense"
                    assert_close_to_ref(out, ref32, ref_same, msg=f"{where} {msg}")
                    assert_lse_close(lse, ref_lse, dtype, msg=f"{where} {msg}")
    finally:
        replay.REPLAYS.clear()  # recorded with the forced form


def test_split_heuristic_fills_more_programs_for_paged_caches():
    """num_splits=0 (tritonattn.config.tables.decode_num_splits): a paged cache's splits fill DECODE_PAGED_WAVES
    programs per SM, a dense cache's one, and neither splits once the programs fill 0.8 of that."""
    from tritonattn.config.hardware import device_target
    from tritonattn.config.tables import DECODE_MAX_SPLITS, DECODE_PAGED_WAVES, decode_num_splits, planning_sm_count

    device = device_target(torch.device(DEVICE))  # the target the heuristic plans for here
    sms = planning_sm_count(device)
    capacity, block_n = 1 << 20, 64  # long enough that no split is capped by the block count
    programs = max(1, sms // 8)
    assert decode_num_splits(programs, capacity, block_n, device) == min(DECODE_MAX_SPLITS, sms // programs)
    assert decode_num_splits(programs, capacity, block_n, device, paged=True) == min(
        DECODE_MAX_SPLITS, DECODE_PAGED_WAVES * sms // programs)
    assert decode_num_splits(sms, capacity, block_n, device) == 1
    assert decode_num_splits(sms, capacity, block_n, device, paged=True) == DECODE_PAGED_WAVES
    assert decode_num_splits(DECODE_PAGED_WAVES * sms, capacity, block_n, device, paged=True) == 1


def test_split_heuristic_fills_more_programs_for_fp8_caches():
    """An FP8 cache's splits fill DECODE_FP8_WAVES programs per SM, a paged one's DECODE_FP8_PAGED_WAVES (or
    the paged count if larger), so its dequantizing programs keep as many bytes in flight as a 16-bit cache's."""
    from tritonattn.config.hardware import device_target
    from tritonattn.config.tables import (
        DECODE_FP8_PAGED_WAVES,
        DECODE_FP8_WAVES,
        DECODE_MAX_SPLITS,
        DECODE_PAGED_WAVES,
        decode_num_splits,
        planning_sm_count,
    )
    from tritonattn.launch.decode import plan_decode

    device = device_target(torch.device(DEVICE))
    sms = planning_sm_count(device)
    capacity, block_n = 1 << 20, 64
    programs = max(1, sms // 8)
    assert decode_num_splits(programs, capacity, block_n, device, fp8=True) == min(
        DECODE_MAX_SPLITS, DECODE_FP8_WAVES * sms // programs)
    assert decode_num_splits(programs, capacity, block_n, device, paged=True, fp8=True) == min(
        DECODE_MAX_SPLITS, max(DECODE_FP8_PAGED_WAVES, DECODE_PAGED_WAVES) * sms // programs)
    assert decode_num_splits(DECODE_FP8_WAVES * sms, capacity, block_n, device, fp8=True) == 1
    for card, batch in (("H100", 8), ("L4", 2)):  # the plan passes the cache's itemsize on
        target = TARGETS[card]
        fp16 = plan_decode(batch, 1, 32, 8, 128, 16384, torch.float16, target, 0)
        fp8 = plan_decode(batch, 1, 32, 8, 128, 16384, torch.float16, target, 0, kv_itemsize=1)
        assert fp8.num_splits == DECODE_FP8_WAVES * target.sm_count // (batch * 8), (card, fp8)
        assert fp8.num_splits > fp16.num_splits, (card, fp8, fp16)


def test_split_heuristic_keeps_a_second_wave_of_splits_long():
    """Past one wave's count, a paged cache's splits keep DECODE_PAGED_WAVE_MIN_BLOCKS blocks each: a
    long cache takes the full second wave, a shorter one part of it, a short one the dense count."""
    from tritonattn.config.hardware import device_target
    from tritonattn.config.tables import DECODE_PAGED_WAVE_MIN_BLOCKS, decode_num_splits, planning_sm_count

    device = device_target(torch.device(DEVICE))  # the target the heuristic plans for here
    sms = planning_sm_count(device)
    block_n, programs = 64, max(1, sms // 8)
    one = decode_num_splits(programs, 1 << 20, block_n, device)
    two = decode_num_splits(programs, 1 << 20, block_n, device, paged=True)
    mid = (one + two) // 2
    assert one < mid < two, (one, two)
    keys = DECODE_PAGED_WAVE_MIN_BLOCKS * block_n  # per split at the minimum
    assert decode_num_splits(programs, two * keys, block_n, device, paged=True) == two
    assert decode_num_splits(programs, mid * keys, block_n, device, paged=True) == mid
    assert decode_num_splits(programs, one * block_n, block_n, device) == one  # one block per split
    assert decode_num_splits(programs, one * block_n, block_n, device, paged=True) == one


def test_paged_caches_cap_the_pipeline_stages(monkeypatch):
    """A paged cache's decode runs at most DECODE_PAGED_STAGES pipeline stages in a split or shallow
    grid; a dense one keeps the config's own (kernels/tritonattn/config/tables.py says why)."""
    import tritonattn.launch.decode as decode
    from tritonattn.config.tables import DECODE_PAGED_STAGES, DecodeConfig

    deep = DecodeConfig(64, 4, DECODE_PAGED_STAGES + 2)  # a config deeper than the cap
    monkeypatch.setattr(decode, "decode_config", lambda *args, **kwargs: deep)
    decode.plan_decode.cache_clear()
    try:
        def stages(page_size):
            return decode.plan_decode(1, 1, 8, 2, 128, 4096, torch.float16, None, 0, page_size).num_stages

        assert stages(0) == deep.num_stages
        assert stages(16) == stages(64) == DECODE_PAGED_STAGES
    finally:
        decode.plan_decode.cache_clear()  # plans made with the fake config must not outlive the test


def test_deep_paged_grids_keep_the_config_stages_and_split_wide_gathers():
    """decode_paged_tiles: split or shallow grids get the stage cap; an unsplit grid of at least
    DECODE_DEEP_GRID programs per SM keeps the config's stages for long caches and halves a BLOCK_N
    that would gather more than DECODE_GATHER_MAX_PAGES pages; and _plan follows it."""
    import tritonattn.config.tables as tables
    import tritonattn.launch.decode as decode
    from tritonattn.config.tables import (
        DECODE_DEEP_GRID,
        DECODE_DEEP_MIN_BLOCKS,
        DECODE_GATHER_MAX_PAGES,
        DECODE_PAGED_STAGES,
        DecodeConfig,
        decode_paged_tiles,
    )

    device = None  # the interpreter's target: INTERPRETER_SM_COUNT SMs
    sms = tables.INTERPRETER_SM_COUNT
    cfg = DecodeConfig(128, 4, DECODE_PAGED_STAGES + 1)
    capped = DECODE_PAGED_STAGES
    deep = DECODE_DEEP_GRID * sms
    long_cache, short_cache = DECODE_DEEP_MIN_BLOCKS * 128, (DECODE_DEEP_MIN_BLOCKS - 1) * 128
    wide = 128 // (2 * DECODE_GATHER_MAX_PAGES)  # a page size whose 128-key block holds 2x the lookup's pages
    assert decode_paged_tiles(cfg, 64, deep - 1, 1, long_cache, device) == (128, capped)  # shallow
    assert decode_paged_tiles(cfg, 64, deep, 2, long_cache, device) == (128, capped)  # split
    assert decode_paged_tiles(cfg, 64, deep, 1, short_cache, device) == (128, capped)  # short cache
    assert decode_paged_tiles(cfg, 64, deep, 1, long_cache, device) == (128, cfg.num_stages)
    assert decode_paged_tiles(cfg, 256, deep, 1, long_cache, device) == (128, cfg.num_stages)
    assert decode_paged_tiles(cfg, 48, deep, 1, long_cache, device) == (128, cfg.num_stages)  # P % BLOCK_N
    assert decode_paged_tiles(cfg, 2 * wide, deep, 1, short_cache, device) == (128, capped)  # fits the lookup
    assert decode_paged_tiles(cfg, wide, deep, 1, short_cache, device) == (64, cfg.num_stages)
    assert decode_paged_tiles(cfg, wide, deep, 2, long_cache, device) == (128, capped)

    def plan(batch, page_size, seqlen_cache):
        return decode.plan_decode(batch, 1, 16, 4, 64, seqlen_cache, torch.float16, device, 0, page_size)

    fake = DecodeConfig(64, 4, DECODE_PAGED_STAGES + 1)
    decode.plan_decode.cache_clear()
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(decode, "decode_config", lambda *args, **kwargs: fake)
            batch = -(-deep // 4)  # 4 KV heads, one row block each: at least `deep` programs, unsplit
            p = plan(batch, 16, DECODE_DEEP_MIN_BLOCKS * 64)
            assert (p.num_splits, p.block_n, p.num_stages) == (1, 64, fake.num_stages)
            p = plan(batch, 16, (DECODE_DEEP_MIN_BLOCKS - 1) * 64)
            assert (p.num_splits, p.block_n, p.num_stages) == (1, 64, capped)
            p = plan(1, 16, DECODE_DEEP_MIN_BLOCKS * 64)  # 4 programs: split, capped
            assert p.num_splits > 1 and p.num_stages == capped
            assert plan(batch, 0, DECODE_DEEP_MIN_BLOCKS * 64).num_stages == fake.num_stages  # dense
    finally:
        decode.plan_decode.cache_clear()


def test_register_cap_only_where_registers_would_cut_occupancy(monkeypatch):
    """decode_max_registers: a stage-capped paged plan in a grid of more than 2 programs per SM, on a
    Hopper-sized SM, is capped at 65536 / (3 x 32 x warps) registers rounded down to 8 (unless that is
    below DECODE_MIN_REGISTER_CAP); dense plans, deeper plans, grids of at most 2 programs per SM and
    small-smem GPUs get no cap."""
    from tritonattn.config.hardware import TARGETS
    from tritonattn.config.tables import DECODE_PAGED_STAGES, decode_max_registers

    hopper = TARGETS["H100"]
    assert hopper.sm_count == 132
    s = DECODE_PAGED_STAGES
    assert decode_max_registers(4, s, True, 2 * 132 + 1, hopper) == 168
    assert decode_max_registers(8, s, True, 2 * 132 + 1, hopper) is None  # 80 would spill: no cap
    assert decode_max_registers(4, s, True, 2 * 132, hopper) is None  # 2 per SM: registers limit nothing
    assert decode_max_registers(4, s + 1, True, 1000, hopper) is None  # deeper: shared memory holds 2
    assert decode_max_registers(4, s, False, 1000, hopper) is None  # dense
    assert decode_max_registers(4, s, True, 1000, None) is None  # the interpreter
    assert decode_max_registers(4, s, True, 1000, TARGETS["L4"]) is None  # small shared memory


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [16, 64])
def test_capped_registers_compile_and_match_dense(page_size):
    """A paged grid of more than 2 programs per SM with a short cache (3 stages) compiles within its
    register cap and still equals dense decode and the reference."""
    import tritonattn.launch.decode as decode
    from tritonattn.config.hardware import device_sm_count

    dtype, nheads, nheads_k, head_dim = torch.bfloat16, 32, 8, 128
    batch = -(-(2 * device_sm_count(torch.cuda.current_device()) + 1) // nheads_k)
    max_blocks = 1024 // page_size
    plan = decode.plan_decode(batch, 1, nheads, nheads_k, head_dim, max_blocks * page_size, dtype,
                        device_target(torch.device(DEVICE)), 0, page_size)
    if plan.max_registers is None:
        pytest.skip(f"no register cap on this GPU ({plan})")
    assert plan.num_splits == 1
    k_pool, v_pool, table, k_dense, v_dense = make_paged_cache(batch, max_blocks, page_size, nheads_k, head_dim, dtype)
    lengths = torch.randint(0, max_blocks * page_size, (batch,)).tolist()
    lengths[:2] = [0, max_blocks * page_size - 1]
    q, k, v = new_tokens(batch, 1, nheads, nheads_k, head_dim, dtype)
    ref32, _, ref_same = padded_references(q, k_dense, v_dense, k, v, lengths)
    out = flash_attn_with_kvcache(q, k_pool, v_pool, k, v, cache_seqlens=i32(lengths), block_table=table)
    out_dense = flash_attn_with_kvcache(q, k_dense, v_dense, k, v, cache_seqlens=i32(lengths))
    assert_close_to_ref(out, ref32, ref_same)
    assert_paged_equals_dense(out, out_dense, dtype, f"capped registers, page_size={page_size}, {plan}")
    # the launch cache's keys: (caller key (signature, ...), constexpr values, argument classes, warps, stages,
    # pdl, maxnreg)
    sig = decode.signature(q, k_pool, v_pool, k, v, table)
    constexpr_names = [decode.decode_launcher.names[i] for i in decode.decode_launcher.constexprs]
    compiled = []
    for key, entry in decode.decode_launcher.kernels.items():
        caller, constexprs, _, num_warps, num_stages, _, maxnreg = key
        tiles = dict(zip(constexpr_names, constexprs))
        if caller[0] == sig and (tiles["PAGE_SIZE"], tiles["BLOCK_N"], tiles["BLOCK_H"], num_warps, num_stages,
                                 maxnreg) == (page_size, plan.block_n, plan.block_h, plan.num_warps, plan.num_stages,
                                              plan.max_registers):
            compiled.append(entry[0])
    assert compiled, "the capped plan's kernel was not launched through the launch cache"
    for kernel in compiled:
        assert 0 < kernel.n_regs <= plan.max_registers, f"{kernel.n_regs} registers > cap {plan.max_registers}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_split_and_unsplit_agree(dtype):
    """num_splits 1, 3 and 0 (heuristic) over a paged cache give the same output and LSE up to rounding."""
    lengths = [0, 5, 90, 239] if INTERPRET else [0, 5, 900, 8159]
    page_size = 48
    batch, nheads, nheads_k, head_dim = len(lengths), NHEADS, 2, HEAD_DIM
    max_blocks = max(lengths) // page_size + 1
    k_pool, v_pool, table, _, _ = make_paged_cache(batch, max_blocks, page_size, nheads_k, head_dim, dtype)
    q, _, _ = new_tokens(batch, 2, nheads, nheads_k, head_dim, dtype)
    results = {
        ns: flash_attn_with_kvcache(q, k_pool, v_pool, cache_seqlens=i32(lengths), block_table=table, causal=True,
                                    num_splits=ns, return_softmax_lse=True)
        for ns in (1, 3, 0)
    }
    assert_splits_agree(results, dtype)


def test_transposed_pool_views():
    """Pools that are (num_blocks, H_KV, page_size, D) buffers seen through .transpose(1, 2) work, appends too."""
    dtype, page_size, seqlen_q = torch.float16, 16, 2
    lengths = [3, 0, 77]
    batch, nheads, nheads_k, head_dim = len(lengths), NHEADS, 2, HEAD_DIM
    k_pool, v_pool, table, k_dense, v_dense = make_paged_cache(batch, 6, page_size, nheads_k, head_dim, dtype,
                                                               transposed=True)
    assert k_pool.stride(1) == head_dim and k_pool.stride(2) == page_size * head_dim
    q = randn(batch, nheads, seqlen_q, head_dim, dtype=dtype).transpose(1, 2)
    k = randn(batch, nheads_k, seqlen_q, head_dim, dtype=dtype).transpose(1, 2)
    v = randn(batch, seqlen_q, nheads_k, head_dim, dtype=dtype)
    ref32, _, ref_same = per_request_references(q, k_dense, v_dense, k, v, lengths, causal=True)
    k_exp, v_exp = expected_pools(k_pool, v_pool, table, k, v, lengths)
    for num_splits in (1, 2):
        kp = k_pool.transpose(1, 2).clone().transpose(1, 2)  # same strides, fresh data
        vp = v_pool.transpose(1, 2).clone().transpose(1, 2)
        out = flash_attn_with_kvcache(q, kp, vp, k, v, cache_seqlens=i32(lengths), block_table=table, causal=True,
                                      num_splits=num_splits)
        out_dense = flash_attn_with_kvcache(q, k_dense.clone(), v_dense.clone(), k, v, cache_seqlens=i32(lengths),
                                            causal=True, num_splits=num_splits)
        assert_close_to_ref(out, ref32, ref_same, msg=f"num_splits={num_splits}")
        assert_paged_equals_dense(out, out_dense, dtype, f"num_splits={num_splits}")
        assert torch.equal(kp, k_exp) and torch.equal(vp, v_exp)


def test_wide_pages_only_where_in_page_offsets_pass_32_bits():
    """`wide_pages` (64-bit in-page offsets) is off for real pool layouts and on only where (P - 1) rows
    of one page span 2^31 elements or more: a (page_size, num_blocks, ...) buffer seen as a pool."""
    meta = dict(dtype=torch.float16, device="meta")
    assert not wide_pages(256, torch.empty(4096, 256, 128, 256, **meta))  # rows nheads_k * D apart
    assert not wide_pages(256, torch.empty(4096, 128, 256, 256, **meta).transpose(1, 2))
    near = 2**31 // 15  # (P - 1) * stride(1) just below 2^31 at P = 16
    page_major = torch.empty(16, near // 64, 1, 64, **meta).transpose(0, 1)  # rows num_blocks * D apart
    assert page_major.stride(1) * 15 < 2**31 and not wide_pages(16, page_major)
    page_major = torch.empty(16, near // 64 + 1, 1, 64, **meta).transpose(0, 1)
    assert page_major.stride(1) * 15 >= 2**31 and wide_pages(16, page_major)
    assert wide_pages(16, torch.empty(8, 16, 1, 64, **meta), page_major)  # either pool
    assert not wide_pages(1, page_major)  # one row per page: no in-page offset


@pytest.mark.parametrize("path", ["decode", "prefill"])
def test_wide_page_offsets_read_and_write_the_same_rows(monkeypatch, path):
    """With WIDE_PAGES forced on (64-bit in-page offsets, taken by pools whose page rows lie 2^31 / (P - 1)
    elements apart or more), the decode kernel, the append and the chunked-prefill path give the same
    output and caches as the 32-bit offsets, and match the reference."""
    import tritonattn.launch.decode as decode
    import tritonattn.launch.prefill as prefill_launch
    import tritonattn.launch.replay as replay

    dtype, page_size = torch.float16, 16
    lengths = [0, 5, page_size - 2, 3 * page_size + 7]
    seqlen_q = 3 if path == "decode" else 20  # the appends cross page boundaries
    batch, nheads, nheads_k, head_dim = len(lengths), NHEADS, 2, HEAD_DIM
    max_blocks = (max(lengths) + seqlen_q) // page_size + 1
    k_pool, v_pool, table, k_dense, v_dense = make_paged_cache(batch, max_blocks, page_size, nheads_k, head_dim, dtype)
    q, k, v = new_tokens(batch, seqlen_q, nheads, nheads_k, head_dim, dtype)
    ref32, _, ref_same = per_request_references(q, k_dense, v_dense, k, v, lengths, causal=True)
    k_exp, v_exp = expected_pools(k_pool, v_pool, table, k, v, lengths)
    if path == "prefill":
        monkeypatch.setattr(decode, "chunked_prefill_pays", lambda *args: True)
    num_splits = 1 if path == "decode" else 0  # 0: the dispatch, patched to the prefill path
    results, asked = [], set()
    for wide in (False, True):
        if wide:
            for module in (decode, prefill_launch):
                monkeypatch.setattr(module, "wide_pages", lambda *args, name=module.__name__: asked.add(name) or True)
            # replays key on the call's signature, which decides WIDE_PAGES in real use: record afresh (the
            # fast launches key on every constexpr, so they compile the forced flag's kernels themselves)
            replay.REPLAYS.clear()
        kp, vp = k_pool.clone(), v_pool.clone()
        out = flash_attn_with_kvcache(q, kp, vp, k, v, cache_seqlens=i32(lengths), block_table=table, causal=True,
                                      num_splits=num_splits)
        assert_close_to_ref(out, ref32, ref_same, msg=f"{path}, wide={wide}")
        assert torch.equal(kp, k_exp) and torch.equal(vp, v_exp), f"{path}, wide={wide}: wrong cache rows"
        results.append(out)
    # the decode kernel, or the append kernel and the prefill kernel, specialised on WIDE_PAGES=True
    assert asked == ({decode.__name__} if path == "decode" else {decode.__name__, prefill_launch.__name__}), asked
    assert_paged_equals_dense(results[1], results[0], dtype, f"{path}: wide vs 32-bit in-page offsets")


@pytest.mark.gpu
@pytest.mark.slow
def test_pool_with_page_rows_2_31_elements_apart():
    """A real pool whose page rows lie num_blocks * D elements apart (a (page_size, num_blocks, 1, D) buffer seen
    as (num_blocks, page_size, 1, D)), so row 15 of every page sits past 2^31 elements: decode with an
    append reads and writes the right rows (32-bit in-page offsets would wrap)."""
    dtype, page_size, nheads_k, head_dim = torch.float16, 16, 1, 64
    num_blocks = 2**31 // ((page_size - 1) * head_dim) + 1
    k_buf, v_buf = (torch.randn(page_size, num_blocks, nheads_k, head_dim, dtype=dtype, device=DEVICE)
                    for _ in range(2))
    k_pool, v_pool = k_buf.transpose(0, 1), v_buf.transpose(0, 1)
    assert (page_size - 1) * k_pool.stride(1) >= 2**31 and wide_pages(page_size, k_pool, v_pool)
    lengths = [page_size - 1, 5 * page_size + 3, 0]
    batch, nheads, seqlen_q, max_blocks = len(lengths), 4, 2, 8
    table = torch.randperm(num_blocks - 1, device=DEVICE)[: batch * max_blocks].view(batch, max_blocks).to(torch.int32)
    table[0, 0] = num_blocks - 1  # the pool's last block (no other entry has it): its last row is the last element
    k_dense, v_dense = gather_dense(k_pool, table), gather_dense(v_pool, table)
    q, k, v = new_tokens(batch, seqlen_q, nheads, nheads_k, head_dim, dtype)
    ref32, _, ref_same = per_request_references(q, k_dense, v_dense, k, v, lengths, causal=True)
    for num_splits in (1, 3):
        out = flash_attn_with_kvcache(q, k_pool, v_pool, k, v, cache_seqlens=i32(lengths), block_table=table,
                                      causal=True, num_splits=num_splits)
        assert_close_to_ref(out, ref32, ref_same, msg=f"num_splits={num_splits}")
    for b, length in enumerate(lengths):  # the append (request 0 fills its first page's last row)
        for t in range(seqlen_q):
            block, row = int(table[b, (length + t) // page_size]), (length + t) % page_size
            assert torch.equal(k_pool[block, row], k[b, t]) and torch.equal(v_pool[block, row], v[b, t])


# --------------------------------------------------------------------------------------------
# Lengths, tables and errors
# --------------------------------------------------------------------------------------------
def test_overflow_raises_before_launch():
    """An append past max_blocks_per_seq * page_size raises ValueError (int or CPU lengths) and writes nothing."""
    dtype, page_size, max_blocks = torch.float16, 16, 2
    k_pool, v_pool, table, _, _ = make_paged_cache(3, max_blocks, page_size, 2, HEAD_DIM, dtype)
    q, k, v = new_tokens(3, 2, NHEADS, 2, HEAD_DIM, dtype)
    before = k_pool.clone()
    with pytest.raises(ValueError, match=r"overflow for every request.*max_blocks_per_seq \* page_size = 2 \* 16"):
        flash_attn_with_kvcache(q, k_pool, v_pool, k, v, cache_seqlens=31, block_table=table)
    with pytest.raises(ValueError, match="overflow for request 2"):
        flash_attn_with_kvcache(q, k_pool, v_pool, k, v, cache_seqlens=torch.tensor([0, 30, 31], dtype=torch.int32),
                                block_table=table)
    with pytest.raises(ValueError, match=">= 0"):
        flash_attn_with_kvcache(q, k_pool, v_pool, k, v, cache_seqlens=torch.tensor([0, -1, 3], dtype=torch.int32),
                                block_table=table)
    assert torch.equal(k_pool, before)
    flash_attn_with_kvcache(q, k_pool, v_pool, k, v, cache_seqlens=30, block_table=table)  # exactly fills the pages
    assert torch.equal(k_pool[table[:, 1].long(), page_size - 2 :], k)


def test_bad_host_block_table_entries_raise():
    """A CPU block_table entry outside [0, num_blocks) among the pages a call uses raises before any write."""
    dtype, page_size = torch.float16, 16
    k_pool, v_pool, table, _, _ = make_paged_cache(2, 4, page_size, 2, HEAD_DIM, dtype, extra_blocks=0)
    num_blocks = k_pool.shape[0]
    q, k, v = new_tokens(2, 1, NHEADS, 2, HEAD_DIM, dtype)
    before = k_pool.clone()
    lengths = torch.tensor([20, 16], dtype=torch.int32)  # request 0 uses pages 0-1, request 1 pages 0-1 (append)
    for bad_value in (-1, num_blocks, 2**30):
        for b, j in ((0, 0), (0, 1), (1, 1)):
            bad = table.cpu().clone()
            bad[b, j] = bad_value
            with pytest.raises(ValueError, match=rf"block_table\[{b}, {j}\] = {bad_value}"):
                flash_attn_with_kvcache(q, k_pool, v_pool, k, v, cache_seqlens=lengths, block_table=bad)
    assert torch.equal(k_pool, before)
    unused = table.cpu().clone()
    unused[:, 2:] = -1  # past both requests' pages: never read, not checked
    out = flash_attn_with_kvcache(q, k_pool, v_pool, k, v, cache_seqlens=lengths, block_table=unused)
    assert torch.isfinite(out).all()


def _bad_block_tables():
    t = lambda *s, dt=torch.int32: torch.zeros(*s, dtype=dt, device=DEVICE)
    return [
        ("not a tensor", [[0, 1], [2, 3]], TypeError, "torch.Tensor"),
        ("int64", t(2, 2, dt=torch.int64), TypeError, "int32"),
        ("1-D", t(4), ValueError, "2 dims"),
        ("batch", t(3, 2), ValueError, r"\(batch, max_blocks_per_seq\) = \(2, >= 1\)"),
        ("no columns", t(2, 0), ValueError, r"= \(2, >= 1\)"),
        ("non-contiguous last dim", t(2, 4)[:, ::2], ValueError, "contiguous last dim"),
    ]


@pytest.mark.parametrize("case", range(len(_bad_block_tables())), ids=[c[0] for c in _bad_block_tables()])
def test_block_table_validation_errors(case):
    """Bad block_table types, dtypes and shapes raise the documented exception with a clear message."""
    _, table, exc, match = _bad_block_tables()[case]
    dtype = torch.float16
    q, k, v = new_tokens(2, 1, NHEADS, 2, HEAD_DIM, dtype)
    k_pool, v_pool = randn(8, 16, 2, HEAD_DIM, dtype=dtype), randn(8, 16, 2, HEAD_DIM, dtype=dtype)
    with pytest.raises(exc, match=match):
        flash_attn_with_kvcache(q, k_pool, v_pool, k, v, cache_seqlens=3, block_table=table)


def test_device_block_table_never_leaves_the_pool():
    """Unchecked bad entries (negative, past the pool) never read or write outside it; their appends are dropped."""
    dtype, page_size, nheads_k, head_dim, guard = torch.float16, 16, 2, HEAD_DIM, 2
    num_blocks, batch, seqlen_q = 6, 3, 4
    k_buf = randn(num_blocks + 2 * guard, page_size, nheads_k, head_dim, dtype=dtype)
    v_buf = randn(num_blocks + 2 * guard, page_size, nheads_k, head_dim, dtype=dtype)
    for buf in (k_buf, v_buf):  # guard blocks on both sides: reading them would poison the output
        buf[:guard] = float("nan")
        buf[-guard:] = float("nan")
    k_pool, v_pool = k_buf[guard:-guard], v_buf[guard:-guard]
    q, k, v = new_tokens(batch, seqlen_q, NHEADS, nheads_k, head_dim, dtype)
    # request 0 reads a page at -1 and appends into page num_blocks; request 1 reads page 2**30 and appends across
    # a good page into a bad one; request 2 is well formed
    table = i32([[-1, num_blocks, 0], [2**30, 1, -(2**30)], [2, 3, 4]])
    seqlens = i32([page_size + 2, page_size + page_size - 2, 20])
    k_start, v_start = k_pool.clone(), v_pool.clone()
    for num_splits in (1, 3):
        k_pool.copy_(k_start)
        v_pool.copy_(v_start)
        out, lse = launch_kvcache(q, k_pool, v_pool, k, v, seqlens,
                                                   attn_options(head_dim, head_dim**-0.5, True), num_splits, True,
                                                   table)
        assert torch.isfinite(out).all() and not torch.isnan(lse).any()
        assert torch.isnan(k_buf[:guard]).all() and torch.isnan(k_buf[-guard:]).all()
        assert torch.isnan(v_buf[:guard]).all() and torch.isnan(v_buf[-guard:]).all()
        changed = (k_pool != k_start).any(-1).any(-1)  # [blocks, rows] that changed
        assert torch.equal((v_pool != v_start).any(-1).any(-1), changed)
        # the only writes: request 1's first two new rows (page 1, rows 14-15) and request 2's four (page 3, 4-7)
        assert changed.sum().item() == 2 + 4, changed.nonzero().tolist()
        assert torch.equal(k_pool[1, page_size - 2 :], k[1, :2]) and torch.equal(k_pool[3, 4:8], k[2])
        assert torch.equal(v_pool[1, page_size - 2 :], v[1, :2]) and torch.equal(v_pool[3, 4:8], v[2])


# --------------------------------------------------------------------------------------------
# PagedKVCache
# --------------------------------------------------------------------------------------------
def test_paged_kvcache_generation_and_reuse():
    """PagedKVCache: prefill, decode steps across pages (ragged, incl. an empty request), free and reuse match."""
    dtype, page_size, nheads, nheads_k, head_dim = torch.float16, 16, NHEADS, 2, HEAD_DIM
    cache = PagedKVCache(12, page_size, nheads_k, head_dim, max_batch=4, max_blocks_per_seq=4, dtype=dtype,
                         device=DEVICE)
    prompts = [30, 0, 14]  # request 1 starts empty
    total = max(prompts) + 6
    seqs = [make_qkv(1, total, total, nheads, nheads_k, head_dim, dtype) for _ in prompts]
    slots = [cache.add_request() for _ in prompts]
    assert slots == [0, 1, 2]
    outs = [[] for _ in prompts]
    for slot, n, (q, k, v) in zip(slots, prompts, seqs):
        if n:
            outs[slot].append(cache.prefill(q[:, :n], k[:, :n], v[:, :n], slots=[slot]))
    assert cache.seqlens[:3] == prompts and cache.num_free_blocks == 12 - 2 - 0 - 1
    pos = list(prompts)
    for n in (1, 3, 2):  # 14 + 1 + 3 crosses into request 2's second page, 30 + 1 + 3 into request 0's third
        q = torch.cat([s[0][:, p : p + n] for s, p in zip(seqs, pos)])
        k = torch.cat([s[1][:, p : p + n] for s, p in zip(seqs, pos)])
        v = torch.cat([s[2][:, p : p + n] for s, p in zip(seqs, pos)])
        out = cache.decode(q, k, v, slots=slots, num_splits=2)
        for i in range(len(slots)):
            outs[i].append(out[i : i + 1])
        pos = [p + n for p in pos]
        assert cache.seqlens[:3] == pos and cache.seqlens_device[:3].tolist() == pos
    for i, (q, k, v) in enumerate(seqs):  # every token's output, prefill or decode, is causal attention
        n = pos[i]
        ref32, _, ref_same = references(q[:, :n], k[:, :n], v[:, :n], causal=True)
        assert_close_to_ref(torch.cat(outs[i], 1), ref32, ref_same, msg=f"request {i}")
        pages = cache.pages(slots[i])
        assert len(pages) == -(-n // page_size)
        gathered = cache.k_cache[torch.tensor(pages, device=DEVICE)].reshape(-1, nheads_k, head_dim)[:n]
        assert torch.equal(gathered, k[0, :n])
    all_pages = sum((cache.pages(s) for s in slots), [])
    assert len(set(all_pages)) == len(all_pages)  # no block is shared

    batch = cache.batch([0, 2])
    assert batch.seqlens_host == [pos[0], pos[2]] and batch.block_table.dtype == torch.int32
    assert batch.block_table_host[1, : len(cache.pages(2))].tolist() == cache.pages(2)

    # free request 0: its pages go back to the pool and a new request reuses them
    freed = cache.pages(0)
    free_before = cache.num_free_blocks
    cache.free(0)
    assert cache.num_free_blocks == free_before + len(freed) and cache.active_slots == [1, 2]
    assert cache.seqlens[0] == 0 and (cache.block_table[0] == -1).all()
    with pytest.raises(ValueError, match="holds no request"):
        cache.decode(*seqs[0], slots=[0])
    slot = cache.add_request()
    assert slot == 0
    q4, k4, v4 = make_qkv(1, 40, 40, nheads, nheads_k, head_dim, dtype)
    cache.prefill(q4, k4, v4, slots=[slot])
    assert cache.pages(slot) == freed  # LIFO: the freed blocks first, in their logical order
    q, _, _ = new_tokens(3, 1, nheads, nheads_k, head_dim, dtype)
    _, k, v = new_tokens(3, 1, nheads, nheads_k, head_dim, dtype)
    out = cache.decode(q, k, v, slots=[2, 0, 1])  # any order: gathered tables
    expected = zip([2, 0, 1], [seqs[2], (q4, k4, v4), seqs[1]], [pos[2], 40, pos[1]])
    for row, (slot, (qs, ks, vs), n) in enumerate(expected):
        kk, vv = torch.cat([ks[:, :n], k[row : row + 1]], 1), torch.cat([vs[:, :n], v[row : row + 1]], 1)
        ref32, _, ref_same = references(q[row : row + 1], kk, vv, causal=True)
        assert_close_to_ref(out[row : row + 1], ref32, ref_same, msg=f"slot {slot}")


def test_paged_kvcache_pool_exhaustion_and_reuse():
    """A full pool raises PoolExhaustedError and changes nothing; after free the pages are reused."""
    dtype, page_size, nheads, nheads_k, head_dim = torch.float16, 16, NHEADS, 2, HEAD_DIM
    cache = PagedKVCache(4, page_size, nheads_k, head_dim, max_batch=2, max_blocks_per_seq=4, dtype=dtype,
                         device=DEVICE)
    a, b = cache.add_request(), cache.add_request()
    with pytest.raises(PoolExhaustedError, match="slots"):
        cache.add_request()
    qa, ka, va = make_qkv(1, 40, 40, nheads, nheads_k, head_dim, dtype)
    cache.prefill(qa, ka, va, slots=[a])  # 3 pages
    assert cache.num_free_blocks == 1 and cache.capacity(a) == 48
    snapshot = lambda: (cache.k_cache.clone(), cache.v_cache.clone(), cache.block_table.clone(), cache.seqlens,
                        cache.num_free_blocks, cache.pages(a), cache.pages(b))
    before = snapshot()
    qb, kb, vb = make_qkv(1, 20, 20, nheads, nheads_k, head_dim, dtype)
    with pytest.raises(PoolExhaustedError, match="2 new blocks .* 1 of 4 free"):
        cache.prefill(qb, kb, vb, slots=[b])
    q1, k1, v1 = new_tokens(2, 9, nheads, nheads_k, head_dim, dtype)
    with pytest.raises(PoolExhaustedError):  # 40 + 9 needs a 4th page for a and b needs one: 2 > 1
        cache.decode(q1, k1, v1, slots=[a, b])
    with pytest.raises(ValueError, match="max_seqlen"):
        cache.extend(a, 25)  # 65 > 4 pages of 16
    after = snapshot()
    for x, y in zip(before, after):
        assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
    assert cache.extend(a, 8) == []  # 48 still fits in 3 pages
    last = cache.extend(a, 9)  # 49: takes the last free block
    assert len(last) == 1 and cache.num_free_blocks == 0
    with pytest.raises(PoolExhaustedError):
        cache.extend(b, 1)

    freed = cache.pages(a)
    cache.free(a)
    assert cache.num_free_blocks == 4
    out = cache.prefill(qb, kb, vb, slots=[b])
    assert set(cache.pages(b)) <= set(freed)
    ref32, _, ref_same = references(qb, kb, vb, causal=True)
    assert_close_to_ref(out, ref32, ref_same)
    q2, k2, v2 = new_tokens(1, 1, nheads, nheads_k, head_dim, dtype)
    out = cache.decode(q2, k2, v2, slots=[b])
    ref32, _, ref_same = references(q2, torch.cat([kb, k2], 1), torch.cat([vb, v2], 1), causal=True)
    assert_close_to_ref(out, ref32, ref_same)
    with pytest.raises(ValueError, match="empty"):
        cache.prefill(qb, kb, vb, slots=[b])


# --------------------------------------------------------------------------------------------
# GPU only
# --------------------------------------------------------------------------------------------
@pytest.mark.gpu
@needs_graph_capture
@pytest.mark.parametrize("page_size", [16, 64, 256])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_cuda_graph_replay_paged_equals_eager(num_splits, page_size):
    """Paged append + decode captured once in a CUDA graph (lengths advanced in-graph) replays like eager calls."""
    dtype, batch, nheads, nheads_k, head_dim, steps = torch.bfloat16, 4, 32, 8, 128, 6
    max_blocks = 4096 // page_size
    k_pool, v_pool, table, _, _ = make_paged_cache(batch, max_blocks, page_size, nheads_k, head_dim, dtype)
    q_s, k_s, v_s = new_tokens(batch, 1, nheads, nheads_k, head_dim, dtype)
    start = i32([0, 1, 1000, 3000])
    k_eager, v_eager, lens_eager, lens = k_pool.clone(), v_pool.clone(), start.clone(), start.clone()

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile outside the capture
        flash_attn_with_kvcache(q_s, k_pool.clone(), v_pool.clone(), k_s, v_s, cache_seqlens=lens.clone(),
                                block_table=table, num_splits=num_splits)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_s = flash_attn_with_kvcache(q_s, k_pool, v_pool, k_s, v_s, cache_seqlens=lens, block_table=table,
                                        num_splits=num_splits)
        lens.add_(1)
    lens.copy_(start)

    for step in range(steps):
        q, k, v = new_tokens(batch, 1, nheads, nheads_k, head_dim, dtype)
        q_s.copy_(q)
        k_s.copy_(k)
        v_s.copy_(v)
        graph.replay()
        out_eager = flash_attn_with_kvcache(q, k_eager, v_eager, k, v, cache_seqlens=lens_eager, block_table=table,
                                           num_splits=num_splits)
        lens_eager += 1
        torch.cuda.synchronize()
        assert torch.equal(out_s, out_eager), f"step {step}: graph and eager outputs differ"
        assert torch.equal(lens, lens_eager)
    assert torch.equal(k_pool, k_eager) and torch.equal(v_pool, v_eager)
    k_dense, v_dense = gather_dense(k_pool, table), gather_dense(v_pool, table)
    ref32, _, ref_same = per_request_references(q, k_dense, v_dense, None, None, lens_eager.tolist(), causal=False)
    assert_close_to_ref(out_eager, ref32, ref_same)


@pytest.mark.gpu
@needs_graph_capture
def test_paged_kvcache_cuda_graph():
    """PagedKVCache.decode captured in a CUDA graph, pages reserved first, advances on every replay."""
    dtype, batch, nheads, nheads_k, head_dim, page_size, replays = torch.float16, 2, 8, 2, 64, 16, 20
    cache = PagedKVCache(32, page_size, nheads_k, head_dim, max_batch=batch, max_blocks_per_seq=8, dtype=dtype,
                         device=DEVICE)
    slots = [cache.add_request() for _ in range(batch)]
    q_p, k_p, v_p = make_qkv(batch, 10, 10, nheads, nheads_k, head_dim, dtype)
    cache.prefill(q_p, k_p, v_p, slots=slots)
    for s in slots:
        cache.extend(s, replays + 1)  # every page the replays will write
    q_s, k_s, v_s = new_tokens(batch, 1, nheads, nheads_k, head_dim, dtype)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile outside the capture (writes row 10, rewritten below)
        b = cache.batch(slots)
        flash_attn_with_kvcache(q_s, cache.k_cache, cache.v_cache, k_s, v_s, cache_seqlens=b.cache_seqlens,
                                block_table=b.block_table)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_s = cache.decode(q_s, k_s, v_s, slots=slots)
    for _ in range(replays):
        graph.replay()
    assert cache.seqlens[:batch] == [11, 11]  # the host mirror advanced once, at capture
    assert cache.refresh_host_seqlens() == [10 + replays] * batch
    n = 10 + replays
    k_dense = gather_dense(cache.k_cache, cache.block_table)[:, :n]
    v_dense = gather_dense(cache.v_cache, cache.block_table)[:, :n]
    assert torch.equal(k_dense[:, :10], k_p) and torch.equal(k_dense[:, 10:n], k_s.expand(batch, replays, -1, -1))
    ref32, _, ref_same = per_request_references(q_s, k_dense, v_dense, None, None, [n] * batch, causal=False)
    assert_close_to_ref(out_s, ref32, ref_same)


@pytest.mark.gpu
def test_cpu_block_table_with_device_lengths_checks_every_entry():
    """With lengths on the GPU the host cannot tell used entries apart: a CPU block_table is checked whole."""
    dtype = torch.float16
    k_pool, v_pool, table, _, _ = make_paged_cache(2, 4, 16, 2, HEAD_DIM, dtype)
    q, k, v = new_tokens(2, 1, NHEADS, 2, HEAD_DIM, dtype)
    bad = table.cpu().clone()
    bad[1, 3] = -1
    with pytest.raises(ValueError, match="every entry"):
        flash_attn_with_kvcache(q, k_pool, v_pool, k, v, cache_seqlens=i32([1, 1]), block_table=bad)
    flash_attn_with_kvcache(q, k_pool, v_pool, k, v, cache_seqlens=i32([1, 1]).cpu(), block_table=bad)  # host-known


def test_paged_kvcache_decode_takes_no_pages_on_bad_input():
    """A decode call that fails validation leaves the pool as it was (all or nothing per call)."""
    cache = PagedKVCache(8, 16, 2, 32, max_batch=2, max_blocks_per_seq=4, dtype=torch.float16, device=DEVICE)
    slot = cache.add_request()
    q = randn(1, 20, 4, 32, dtype=torch.float16)
    k_bad = randn(1, 20, 2, 32, dtype=torch.float32)  # wrong dtype
    with pytest.raises(ValueError, match="dtype"):
        cache.decode(q, k_bad, k_bad, slots=[slot])
    assert cache.num_free_blocks == 8 and cache.pages(slot) == [] and cache.seqlens[slot] == 0


def test_cache_decode_takes_one_key_per_query():
    """KVCache.decode and PagedKVCache.decode advance each length by seqlen_q: k/v of fewer (or more)
    tokens than q is refused before anything changes (flash_attn_with_kvcache itself allows fewer)."""
    from tritonattn import KVCache

    q = randn(1, 3, 4, 32, dtype=torch.float16)
    k = randn(1, 2, 2, 32, dtype=torch.float16)
    dense = KVCache(1, 16, 2, 32, dtype=torch.float16, device=DEVICE)
    with pytest.raises(ValueError, match="3 new tokens"):
        dense.decode(q, k, k)
    assert dense.seqlens == [0]
    paged = PagedKVCache(8, 16, 2, 32, max_batch=1, max_blocks_per_seq=4, dtype=torch.float16, device=DEVICE)
    slot = paged.add_request()
    with pytest.raises(ValueError, match="3 new tokens"):
        paged.decode(q, k, k, slots=[slot])
    assert paged.num_free_blocks == 8 and paged.seqlens[slot] == 0


@pytest.mark.parametrize("path", ["decode", "prefill"])
@pytest.mark.parametrize("page_size", [16, 5])
def test_partial_append_paged(page_size, path, monkeypatch):
    """seqlen_new < seqlen_q into a paged pool: the seqlen_new new rows land page by page at each
    request's length (crossing pages), the queries align to the last seqlen_q of L_b + seqlen_new keys."""
    import tritonattn.launch.decode as decode

    lengths = [0, 13, 37]
    seqlen_q, seqlen_new, dtype = 6, 2, torch.float16
    batch, nheads, nheads_k, head_dim = len(lengths), NHEADS, 2, HEAD_DIM
    max_blocks = (max(lengths) + seqlen_new) // page_size + 1
    k_pool, v_pool, table, k_dense, v_dense = make_paged_cache(batch, max_blocks, page_size, nheads_k, head_dim, dtype)
    q, _, _ = new_tokens(batch, seqlen_q, nheads, nheads_k, head_dim, dtype)
    _, k, v = new_tokens(batch, seqlen_new, nheads, nheads_k, head_dim, dtype)
    ref32, _, ref_same = per_request_references(q, k_dense, v_dense, k, v, lengths, causal=True)
    k_exp, v_exp = expected_pools(k_pool, v_pool, table, k, v, lengths)
    if path == "prefill":
        monkeypatch.setattr(decode, "chunked_prefill_pays", lambda *args: True)
    kp, vp = k_pool.clone(), v_pool.clone()
    out = flash_attn_with_kvcache(q, kp, vp, k, v, cache_seqlens=i32(lengths), block_table=table, causal=True,
                                  num_splits=1 if path == "decode" else 0)
    assert_close_to_ref(out, ref32, ref_same, msg=f"{path}, page_size={page_size}")
    assert torch.equal(kp, k_exp) and torch.equal(vp, v_exp), f"{path}: wrong cache rows"
