"""Speculative decoding's verify step and rollback: flash_attn_with_kvcache(tree_mask=...) and the cache classes'
decode(tree_mask=...) / accept(...).

Tree masks (random trees, chains, a single root, all drafts siblings; dense and the packed ragged form) against
the eager reference with the mask materialised over every key (`tritonattn.testing.tree_attn_mask`), dense and
paged caches (drafts crossing page borders), GQA, split and unsplit, drafts appended by the call or already in
the cache. Rollback against a cache rebuilt from the accepted tokens alone: the same K/V rows, lengths and next
step. Bad input refused before any launch.
"""

from __future__ import annotations

import random

import pytest
import torch

from helpers import DEVICE, ON_GPU, assert_close_to_ref, paged_copy
from tritonattn import KVCache, PagedKVCache, flash_attn_with_kvcache, rel_err
from tritonattn.testing import per_request_references

DTYPE = torch.float16
HEAD_DIM = 64 if ON_GPU else 32


def ancestors(parents) -> torch.Tensor:
    """The (n, n) mask of a tree given each draft's parent (-1: a root): [t, u] iff u is t or an ancestor."""
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for t in range(n):
        u = t
        while u >= 0:
            mask[t, u] = True
            u = parents[u]
    return mask


def tree(kind: str, n: int, rng: random.Random):
    if kind == "chain":
        return [t - 1 for t in range(n)]
    if kind == "siblings":
        return [-1] * n
    if kind == "root":
        return [-1] + [0] * (n - 1)
    return [-1] * min(n, 1) + [rng.randrange(0, t) for t in range(1, n)]  # random, one root


def randn(*shape, dtype=DTYPE):
    return torch.randn(*shape, device=DEVICE, dtype=dtype)


@pytest.mark.parametrize("append", [True, False])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("kind", ["random", "chain", "siblings", "root"])
def test_tree_decode_dense(kind, group, num_splits, append):
    rng = random.Random(hash((kind, group)) % 1000)
    n, lengths, nheads_k = 7, [0, 11, 38], 2
    batch = len(lengths)
    mask = torch.stack([ancestors(tree(kind, n, rng)) for _ in range(batch)]).to(DEVICE)
    q = randn(batch, n, nheads_k * group, HEAD_DIM)
    k_cache, v_cache = randn(batch, 64, nheads_k, HEAD_DIM), randn(batch, 64, nheads_k, HEAD_DIM)
    k, v = randn(batch, n, nheads_k, HEAD_DIM), randn(batch, n, nheads_k, HEAD_DIM)
    if append:
        seqlens, ref_lengths, new = lengths, lengths, (k, v)
    else:  # the drafts already in the cache, the last n keys
        for b, length in enumerate(lengths):
            k_cache[b, length: length + n], v_cache[b, length: length + n] = k[b], v[b]
        seqlens, ref_lengths, new = [length + n for length in lengths], [length + n for length in lengths], ()
    out = flash_attn_with_kvcache(q, k_cache, v_cache, *new, cache_seqlens=torch.tensor(seqlens, dtype=torch.int32,
                                  device=DEVICE), causal=True, num_splits=num_splits, tree_mask=mask)
    ref32, _, same = per_request_references(q, k_cache, v_cache, *(new or (None, None)), ref_lengths, causal=True,
                                            tree_mask=mask)
    assert_close_to_ref(out, ref32, same, msg=f"({kind}, group={group}, splits={num_splits}, append={append})")
    if kind != "chain":  # a tree is not causal attention over the drafts
        plain, _, _ = per_request_references(q, k_cache, v_cache, *(new or (None, None)), ref_lengths, causal=True)
        assert (out.float() - plain.float()).abs().max() > 1e-2


def test_many_rows_take_their_own_plan_on_hopper():
    """The decode plan for an H100 (asked without one, `TARGETS`): more than 64 rows per KV head at D = 128 take
    HOPPER_DECODE_MANY_ROWS (8 warps, 128-row blocks, splits that fill two programs per SM) unless they append
    more than one chunk, one token and a chain of 8 keep the one-token config, and the L4's table is the same
    for both."""
    from tritonattn.config.hardware import TARGETS
    from tritonattn.config.tables import HOPPER_DECODE, HOPPER_DECODE_MANY_ROWS, SMALL_SMEM_DECODE
    from tritonattn.launch.decode import plan_decode

    def plan(card, seqlen_q, dtype=torch.bfloat16, append=True):
        return plan_decode(8, seqlen_q, 32, 8, 128, 16448, dtype, TARGETS[card], 0, 0, append)

    many, one = HOPPER_DECODE_MANY_ROWS[128], HOPPER_DECODE[128]
    tree = plan("H100", 64)  # 64 drafts x 4 heads = 256 rows
    programs = 8 * 8 * 2  # requests x KV heads x row blocks: one per SM of 132, so unsplit at one wave
    assert (tree.num_warps, tree.block_h, tree.grid[0]) == (many.num_warps, many.max_rows, programs), tree
    assert many.waves == 2 and tree.num_splits == many.waves * TARGETS["H100"].sm_count // programs, tree
    for seqlen_q in (1, 8):  # 4 and 32 rows
        assert plan("H100", seqlen_q).num_warps == one.num_warps
    assert plan("H100", 64, torch.float32).block_h == many.max_rows  # the fp32 halving keeps the row block
    # an append of more than one chunk (more than its BLOCK_N new rows) keeps the one-token config; without an
    # append the same rows take the many-row one (see HOPPER_DECODE_MANY_ROWS)
    assert plan("H100", many.block_n + 1).num_warps == one.num_warps
    assert plan("H100", many.block_n + 1, append=False).num_warps == many.num_warps
    assert plan("L4", 64).num_warps == plan("L4", 1).num_warps == SMALL_SMEM_DECODE[128].num_warps


@pytest.mark.skipif(not ON_GPU, reason="the many-row config is a GPU table's (the interpreter has one config)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_tree_decode_many_rows(num_splits, dtype):
    """40 drafts x a GQA group of 4 (160 query rows per KV head, more than one row block of the one-token
    config: Hopper's many-row config at D = 128) against the reference, the drafts appended."""
    rng = random.Random(7)
    n, lengths, nheads_k, group, d = 40, [0, 70, 300], 2, 4, 128
    mask = torch.stack([ancestors(tree("random", n, rng)) for _ in lengths]).to(DEVICE)
    q = randn(len(lengths), n, nheads_k * group, d, dtype=dtype)
    k_cache, v_cache = (randn(len(lengths), 384, nheads_k, d, dtype=dtype) for _ in range(2))
    k, v = (randn(len(lengths), n, nheads_k, d, dtype=dtype) for _ in range(2))
    out = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=torch.tensor(lengths, dtype=torch.int32,
                                  device=DEVICE), causal=True, num_splits=num_splits, tree_mask=mask)
    ref32, _, same = per_request_references(q, k_cache, v_cache, k, v, lengths, causal=True, tree_mask=mask)
    assert_close_to_ref(out, ref32, same, msg=f"(splits={num_splits}, {dtype})")


@pytest.mark.parametrize("page_size", [16, 5])
def test_tree_decode_paged(page_size):
    """Paged: the drafts cross page borders; equal to the dense call on the same values, and to the reference."""
    rng = random.Random(1)
    n, lengths = 9, [3, 14, 30]
    mask = torch.stack([ancestors(tree("random", n, rng)) for _ in lengths]).to(DEVICE)
    q, k, v = randn(3, n, 4, HEAD_DIM), randn(3, n, 2, HEAD_DIM), randn(3, n, 2, HEAD_DIM)
    k_cache, v_cache = randn(3, 80, 2, HEAD_DIM), randn(3, 80, 2, HEAD_DIM)
    ref32, _, same = per_request_references(q, k_cache, v_cache, k, v, lengths, causal=True, tree_mask=mask)
    k_pool, v_pool, table = paged_copy(k_cache, v_cache, page_size)
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    for splits in (1, 2):
        out = flash_attn_with_kvcache(q, k_pool, v_pool, k, v, cache_seqlens=seqlens, block_table=table, causal=True,
                                      num_splits=splits, tree_mask=mask)
        assert_close_to_ref(out, ref32, same, msg=f"(page_size={page_size}, splits={splits})")


def test_packed_ragged_drafts():
    """The packed form: requests with 3, 0 and 5 drafts in a batch padded to seqlen_q = 5; the real drafts match
    the reference, padding tokens see only the prefix and themselves, and no draft sees a padding token."""
    rng = random.Random(2)
    counts, seqlen_q, lengths = [3, 0, 5], 5, [6, 9, 20]
    mats = [ancestors(tree("random", c, rng)) for c in counts]
    packed = torch.cat([m.flatten() for m in mats]).to(DEVICE)
    cu = torch.tensor([0, 3, 3, 8], dtype=torch.int32)
    q, k, v = randn(3, seqlen_q, 4, HEAD_DIM), randn(3, seqlen_q, 2, HEAD_DIM), randn(3, seqlen_q, 2, HEAD_DIM)
    k_cache, v_cache = randn(3, 32, 2, HEAD_DIM), randn(3, 32, 2, HEAD_DIM)
    out = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=torch.tensor(lengths, dtype=torch.int32,
                                  device=DEVICE), causal=True, tree_mask=packed, tree_cu_seqlens=cu)
    ref32, _, same = per_request_references(q, k_cache, v_cache, k, v, lengths, causal=True, tree_mask=packed,
                                            tree_cu_seqlens=cu)
    assert_close_to_ref(out, ref32, same)


def _verify_and_accept(cache, paged: bool, rng: random.Random):
    """A prompt, a verify step over a random tree per request, an accepted root-to-leaf path each; returns the
    accepted tokens' (k, v) per request and the prompt's."""
    batch, n, prompt = 2, 8, [13, 6]
    slots = [cache.add_request() for _ in range(batch)] if paged else None
    prompts = []
    for b, length in enumerate(prompt):
        pk, pv = randn(1, length, 2, HEAD_DIM), randn(1, length, 2, HEAD_DIM)
        where = dict(slots=[slots[b]]) if paged else dict(batch_idx=[b])  # one prompt length per call
        cache.prefill(randn(1, length, 4, HEAD_DIM), pk, pv, **where)
        prompts.append((pk[0], pv[0]))
    parents = [tree("random", n, rng) for _ in range(batch)]
    mask = torch.stack([ancestors(p) for p in parents]).to(DEVICE)
    q, k, v = randn(batch, n, 4, HEAD_DIM), randn(batch, n, 2, HEAD_DIM), randn(batch, n, 2, HEAD_DIM)
    cache.decode(q, k, v, tree_mask=mask)
    paths = []
    for p in parents:  # the path from the root to a random draft, in tree order
        u, path = rng.randrange(n), []
        while u >= 0:
            path.append(u)
            u = p[u]
        paths.append(sorted(path)[: rng.randint(0, len(path))])
    accepted = torch.full((batch, max(len(p) for p in paths) + 1), -1, dtype=torch.int64)
    for b, path in enumerate(paths):
        accepted[b, : len(path)] = torch.tensor(path, dtype=torch.int64)
    cache.accept(accepted)
    kept = [(k[b, path], v[b, path]) for b, path in enumerate(paths)]
    return prompts, kept, slots


@pytest.mark.parametrize("paged", [False, True])
def test_accept_equals_a_cache_of_the_accepted_tokens(paged):
    """After accept each request's cache holds its prompt then its accepted drafts, the lengths say so, and the
    next step equals the same step over a cache rebuilt from those tokens alone."""
    rng = random.Random(3)
    if paged:
        cache = PagedKVCache(32, 4, 2, HEAD_DIM, max_batch=2, max_blocks_per_seq=8, dtype=DTYPE, device=DEVICE)
    else:
        cache = KVCache(2, 32, 2, HEAD_DIM, dtype=DTYPE, device=DEVICE)
    prompts, kept, slots = _verify_and_accept(cache, paged, rng)
    want = [pk.shape[0] + kk.shape[0] for (pk, _), (kk, _) in zip(prompts, kept)]
    index = slots if paged else list(range(2))
    assert cache.seqlens_device[index].tolist() == want
    rebuilt = KVCache(2, 32, 2, HEAD_DIM, dtype=DTYPE, device=DEVICE)
    for b, ((pk, pv), (kk, kv)) in enumerate(zip(prompts, kept)):
        keys, values = torch.cat([pk, kk])[None], torch.cat([pv, kv])[None]
        rebuilt.prefill(randn(1, keys.shape[1], 4, HEAD_DIM), keys, values, batch_idx=[b])
        if paged:
            pages = cache.block_table[slots[b]].long()
            pool_k = cache.k_cache[pages.clamp(min=0)].flatten(0, 1)[: want[b]]
            assert torch.equal(pool_k, keys[0])
        else:
            assert torch.equal(cache.k_cache[b, : want[b]], keys[0]) and torch.equal(cache.v_cache[b, : want[b]],
                                                                                     values[0])
    q, k, v = randn(2, 1, 4, HEAD_DIM), randn(2, 1, 2, HEAD_DIM), randn(2, 1, 2, HEAD_DIM)
    out = cache.decode(q, k, v, **({"slots": slots} if paged else {}))
    assert rel_err(out, rebuilt.decode(q, k, v)) <= 1e-3
    assert cache.refresh_host_seqlens()[: 2] == [w + 1 for w in want]
    if paged:  # the pages past the new lengths went back to the pool with that sync
        assert cache.num_free_blocks == 32 - sum(-(-(w + 1) // 4) for w in want)


def _bad_cases():
    n = 4
    good = ancestors([-1, 0, 0, 1])[None].expand(2, n, n).clone()
    hidden = good.clone()
    hidden[0, 2, 2] = False
    later = good.clone()
    later[1, 0, 3] = True
    return {
        "shape": (dict(tree_mask=good[:, :3, :3]), "Expected tree_mask of shape"),
        "dtype": (dict(tree_mask=good.int()), "Expected tree_mask of dtype torch.bool"),
        "hidden from itself": (dict(tree_mask=hidden), "Expected every draft to see itself"),
        "a later draft": (dict(tree_mask=later), "lower-triangular"),
        "not causal": (dict(tree_mask=good, causal=False), "Expected causal=True with tree_mask"),
        "window": (dict(tree_mask=good, window_size=(8, 0)), "not supported"),
        "alibi": (dict(tree_mask=good, alibi_slopes=torch.ones(4, device=DEVICE)), "not supported"),
        "packed size": (dict(tree_mask=torch.ones(7, dtype=torch.bool),
                             tree_cu_seqlens=torch.tensor([0, 2, 4], dtype=torch.int32)), r"sum\(n_b\^2\) = 8"),
        "packed count": (dict(tree_mask=torch.ones(26, dtype=torch.bool),
                              tree_cu_seqlens=torch.tensor([0, 5, 6], dtype=torch.int32)), "at most seqlen_q"),
        "cu alone": (dict(tree_cu_seqlens=torch.tensor([0, 2, 4], dtype=torch.int32)), "only with a packed"),
        "partial append": (dict(tree_mask=good, short=True), "Expected k / v with seqlen_q"),
    }


@pytest.mark.parametrize("case", sorted(_bad_cases()))
def test_bad_tree_input_is_refused_before_launch(case):
    """A mask that does not match the drafts, hides a token from itself or shows it a later draft, a tree with
    causal=False, a window or ALiBi, a packed form of the wrong size: a clear error, the cache untouched."""
    kw, message = _bad_cases()[case]
    kw = {"causal": True, **kw}
    short = kw.pop("short", False)
    q, k, v = randn(2, 4, 4, HEAD_DIM), randn(2, 4, 2, HEAD_DIM), randn(2, 4, 2, HEAD_DIM)
    if short:
        k, v = k[:, :2], v[:, :2]
    k_cache, v_cache = randn(2, 16, 2, HEAD_DIM), randn(2, 16, 2, HEAD_DIM)
    before = k_cache.clone()
    with pytest.raises((ValueError, TypeError, NotImplementedError), match=message):
        flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=torch.tensor([3, 5], dtype=torch.int32,
                                device=DEVICE), **kw)
    assert torch.equal(k_cache, before)


def test_bad_accept_is_refused():
    """accept before a verify step, indices out of range, out of tree order, or -1 before an index: refused
    before anything moves."""
    cache = KVCache(2, 32, 2, HEAD_DIM, dtype=DTYPE, device=DEVICE)
    with pytest.raises(ValueError, match="follows a verify step"):
        cache.accept(torch.tensor([[0], [0]]))
    cache.decode(randn(2, 3, 4, HEAD_DIM), randn(2, 3, 2, HEAD_DIM), randn(2, 3, 2, HEAD_DIM),
                 tree_mask=ancestors([-1, 0, 0])[None].expand(2, 3, 3).clone().to(DEVICE))
    for accepted, message in (([[0, 3], [0, -1]], r"in \[0, 3\)"), ([[0, 2, 1], [0, -1, -1]], "tree order"),
                              ([[-1, 1], [0, 1]], "then -1s"), ([[0, 1, 2, 2]] * 2, r"\(batch, A\)")):
        with pytest.raises(ValueError, match=message):
            cache.accept(torch.tensor(accepted))
    assert cache.seqlens_device.tolist() == [3, 3]
    cache.accept(torch.tensor([[0, 2], [-1, -1]]))
    assert cache.seqlens_device.tolist() == [2, 0]


def test_more_drafts_than_room_is_refused():
    cache = KVCache(1, 6, 2, HEAD_DIM, dtype=DTYPE, device=DEVICE)
    cache.prefill(randn(1, 4, 4, HEAD_DIM), randn(1, 4, 2, HEAD_DIM), randn(1, 4, 2, HEAD_DIM))
    with pytest.raises(ValueError, match="overflow"):
        cache.decode(randn(1, 3, 4, HEAD_DIM), randn(1, 3, 2, HEAD_DIM), randn(1, 3, 2, HEAD_DIM),
                     tree_mask=ancestors([-1, 0, 1])[None].to(DEVICE))
