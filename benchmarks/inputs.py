"""Seeded random inputs of the benchmark shapes: the caches, tables and new tokens a decode or chunked
step reads, in our layout (and SDPA's). Needs no kernel: benchmarks/ab.py builds the same inputs for
any tree's kernels.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from .grids import ChunkedShape, DecodeShape


def randn(shape, dtype, device, gen) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, device=device, dtype=dtype)


def generator(device: torch.device, seed: int) -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


def new_token(shape: DecodeShape, dtype, device, gen) -> SimpleNamespace:
    """The step's inputs in our layout: q (b, 1, h, d) and the appended k, v (b, 1, h_kv, d)."""
    b, h, hk, d = shape.batch, shape.nheads, shape.nheads_k, shape.head_dim
    return SimpleNamespace(q=randn((b, 1, h, d), dtype, device, gen), k=randn((b, 1, hk, d), dtype, device, gen),
                           v=randn((b, 1, hk, d), dtype, device, gen), cache_len=shape.cache_len - 1)


def random_block_table(batch: int, pages: int, seed: int, device) -> torch.Tensor:
    """(batch, pages) int32: a random permutation of the pool's batch * pages blocks (no two requests share)."""
    gen = torch.Generator()
    gen.manual_seed(seed)
    return torch.randperm(batch * pages, generator=gen).view(batch, pages).to(torch.int32).to(device)


def dense_state(shape: DecodeShape, dtype, device, gen, *, valid_copy: bool = False,
                 num_splits: int = 0) -> SimpleNamespace:
    """(b, s, h_kv, d) caches of cache_len rows, cache_len - 1 of them valid, and the new token's q, k, v."""
    b, n, hk, d = shape.batch, shape.cache_len, shape.nheads_k, shape.head_dim
    st = new_token(shape, dtype, device, gen)
    st.num_splits = num_splits
    if valid_copy:  # the torch.cat baseline holds exactly the valid rows
        st.k_valid, st.v_valid = (randn((b, n - 1, hk, d), dtype, device, gen) for _ in range(2))
    else:
        st.k_cache, st.v_cache = (randn((b, n, hk, d), dtype, device, gen) for _ in range(2))
        st.seqlens = torch.full((b,), n - 1, dtype=torch.int32, device=device)
    return st


def paged_state(shape: DecodeShape, dtype, device, gen, *, page_size: int) -> SimpleNamespace:
    """A pool of batch * ceil(cache_len / P) pages, a random permutation of them as the block table."""
    b, n, hk, d = shape.batch, shape.cache_len, shape.nheads_k, shape.head_dim
    pages = -(-n // page_size)
    st = new_token(shape, dtype, device, gen)
    st.k_cache, st.v_cache = (randn((b * pages, page_size, hk, d), dtype, device, gen) for _ in range(2))
    st.block_table = random_block_table(b, pages, n * 7 + page_size, device)
    st.seqlens = torch.full((b,), n - 1, dtype=torch.int32, device=device)
    return st


def bhsd_state(shape: DecodeShape, dtype, device, gen) -> SimpleNamespace:
    """SDPA / Flex layout: caches (b, h_kv, s, d), q (b, h, 1, d), new k/v (b, h_kv, 1, d)."""
    b, n, h, hk, d = shape.batch, shape.cache_len, shape.nheads, shape.nheads_k, shape.head_dim
    return SimpleNamespace(q=randn((b, h, 1, d), dtype, device, gen), k=randn((b, hk, 1, d), dtype, device, gen),
                           v=randn((b, hk, 1, d), dtype, device, gen), cache_len=n - 1,
                           k_cache=randn((b, hk, n, d), dtype, device, gen),
                           v_cache=randn((b, hk, n, d), dtype, device, gen))


def chunked_state(shape: ChunkedShape, dtype, device, gen, *, kind: str, page_size: int = 0) -> SimpleNamespace:
    b, n, c, h, hk, d = shape.batch, shape.cache_len, shape.chunk, shape.nheads, shape.nheads_k, shape.head_dim
    total = n + c
    st = SimpleNamespace(q=randn((b, c, h, d), dtype, device, gen), cache_len=n, total=total)
    if kind == "prefill":  # q chunk against all L + chunk keys, as one prefill call
        st.k_full, st.v_full = (randn((b, total, hk, d), dtype, device, gen) for _ in range(2))
        return st
    st.k, st.v = (randn((b, c, hk, d), dtype, device, gen) for _ in range(2))
    st.seqlens = torch.full((b,), n, dtype=torch.int32, device=device)
    if kind == "dense":
        st.k_cache, st.v_cache = (randn((b, total, hk, d), dtype, device, gen) for _ in range(2))
        return st
    pages = -(-total // page_size)
    st.k_cache, st.v_cache = (randn((b * pages, page_size, hk, d), dtype, device, gen) for _ in range(2))
    st.block_table = random_block_table(b, pages, total * 7 + page_size, device)
    return st
